"""The DALI backend: the pipeline fed from the cache, and its presets."""
