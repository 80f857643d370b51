"""Names, limits and defaults shared across coordl, each documented where it is defined."""

SHM_DIR = "/dev/shm"
"""Where node-wide shared memory lives (tmpfs on Linux)."""

SHM_PREFIX = "cdl_"
"""Prefix of every shared-memory file coordl creates: ``cdl_<12-hex scope token>_<kind>``."""

CACHE_KIND = "cache"
"""Kind suffix of MinIO cache segments."""

MAX_CACHE_USERS = 1024
"""Processes that may map one cache at once (loaders, their workers, other jobs)."""

AUTO_CACHE_MEMORY_FRACTION = 0.5
"""``cache_bytes="auto"`` takes at most this share of available memory..."""

AUTO_CACHE_SHM_FRACTION = 0.9
"""...and at most this share of free /dev/shm, and never more than the dataset."""

LOG_LEVEL_ENV = "COORDL_LOG_LEVEL"
"""Environment variable that turns on coordl's log output, e.g. ``COORDL_LOG_LEVEL=INFO``."""
