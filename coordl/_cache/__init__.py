"""The node-wide MinIO cache of raw bytes in shared memory, and how a loader sizes and opens it."""
