"""What every feature stands on: shared-memory segments, sizes, system facts, worker helpers, logging, settings."""
