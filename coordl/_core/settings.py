"""Names, limits and defaults shared across coordl, each documented where it is defined, and the one reader of
the process environment (:func:`get`, :func:`environ`): every ``COORDL_*`` setting and torchrun variable is
read through it."""

import os
from collections.abc import Mapping


def get(name: str, default: str | None = None) -> str | None:
    """The environment variable ``name``, else ``default``."""
    return os.environ.get(name, default)


def environ() -> Mapping[str, str]:
    """The whole environment (torchrun's variables, a child's environment), read-only."""
    return os.environ


OBSERVER_ENV = "COORDL_OBSERVER"
"""Environment variable naming the data path's observer, "module:name" (``_core.hooks``; ``coordl analyze``
sets it for each phase run of a script)."""


def observer() -> str | None:
    return get(OBSERVER_ENV)


SHM_DIR_ENV = "COORDL_SHM_DIR"
"""Environment variable naming the tmpfs directory that holds coordl's shared memory (default /dev/shm):
jobs share caches and groups only with jobs that use the same directory."""

SHM_PREFIX = "cdl_"
"""Prefix of every shared-memory file coordl creates: ``cdl_<12-hex scope token>_<kind>``."""

CACHE_KIND = "cache"
"""Kind suffix of MinIO cache segments."""

EXEMPLARS_KIND = "exemplars"
"""Kind suffix of the segments that hold rehearsal exemplars the cache does not (``_rehearsal.exemplars``)."""

MAX_CACHE_USERS = 1024
"""Processes that may map one cache at once (loaders, their workers, other jobs)."""

AUTO_CACHE_MEMORY_FRACTION = 0.5
"""``cache_bytes="auto"`` takes at most this share of available memory..."""

AUTO_CACHE_SHM_KEEP_FRACTION = 0.1
"""...and, growing, leaves this share of the shm file system free (for other jobs and torch's in-flight
batches) besides the measured in-flight batches, and never takes more than the dataset."""

CACHE_DIR_ENV = "COORDL_CACHE_DIR"
"""Environment variable naming the folder of the disk cache tier (``cache_dir=``; unset: no disk tier)."""


def cache_dir() -> str | None:
    return get(CACHE_DIR_ENV) or None


AUTO_DISK_KEEP_FRACTION = 0.1
"""``cache_dir_bytes="auto"``: the disk tier grows while its file system keeps this share of its size free."""

ANALYZE_TIME_SCALE_ENV = "COORDL_ANALYZE_TIME_SCALE"
"""Environment variable that scales ``coordl analyze``'s least measuring times and rests (default 1; the tests
lower it, which shortens each phase at some cost in the rates' precision)."""

LOG_LEVEL_ENV = "COORDL_LOG_LEVEL"
"""Environment variable that turns on coordl's log output, e.g. ``COORDL_LOG_LEVEL=INFO``."""

GROUP_KIND = "group"
"""Kind suffix of hyperparameter-search group segments (``cdl_<token>_group``)."""

STAGED_KIND_PREFIX = "s"
"""Staged batches live in ``cdl_<token>_s<seq>``, one segment per batch, beside their group's."""

MAX_GROUP_MEMBERS = 32
"""Jobs that may belong to one hp_group at once."""

STAGING_SLOTS = 64
"""Batches that may be staged at once in one group (also bounded by the staging bytes)."""

AUTO_STAGING_BYTES = 4 * 2**30
"""``hp_staging_bytes="auto"`` takes at most this many bytes..."""

AUTO_STAGING_FRACTION = 0.25
"""...and at most this share of free /dev/shm and of available memory."""

DEFAULT_GROUP_TIMEOUT_S = 60.0
"""``hp_group_timeout_s`` default: the wait for ``hp_group_size`` members, for a member between epochs,
and before warning about a live producer that publishes nothing."""

LIVENESS_POLL_S = 1.0
"""How often a member waiting on another checks that it is still alive."""

GET_PRICE_ENV, LIST_PRICE_ENV = "COORDL_GET_PRICE", "COORDL_LIST_PRICE"
"""Environment variables: an object store's price of 1,000 GETs and of 1,000 LISTs, in dollars (what the
epoch statistics' ``request_cost`` uses)."""
GET_PRICE, LIST_PRICE = 0.0004, 0.005
"""S3 Standard's prices of 1,000 GET and 1,000 LIST requests (us-east-1), the defaults."""


def request_prices() -> tuple[float, float]:
    """(GET, LIST) prices per 1,000 requests: the settings', else S3 Standard's; a ValueError names a bad one."""
    prices = []
    for name, default in ((GET_PRICE_ENV, GET_PRICE), (LIST_PRICE_ENV, LIST_PRICE)):
        value = get(name)
        try:
            prices.append(default if value is None else float(value))
        except ValueError:
            raise ValueError(f"{name}={value!r} is not a price in dollars per 1,000 requests") from None
    return prices[0], prices[1]
