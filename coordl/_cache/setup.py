"""A loader's fetch path: the user's dataset behind the cache of its files, named and sized.

What ``coordl.DataLoader`` builds before torch sees the dataset: the raw-bytes view of the dataset,
the identity (``dataset_identity``, which names it) and size of its node-wide cache, and the storage
misses are read from. Nothing here reads or stats every file: building a loader costs about what
building the user's dataset does (see docs/benchmarks.md). See minio_cache NOTE [ Sizing ] for how
caches grow.
"""

import logging
import os

import torch.utils.data

from coordl._cache.minio import MinIOCache, cache_segment_name, index_bytes
from coordl._core.log import warn_caller
from coordl._core.settings import AUTO_CACHE_MEMORY_FRACTION, AUTO_CACHE_SHM_KEEP_FRACTION
from coordl._core.shm import free_shm_bytes, shm_dir, total_shm_bytes
from coordl._core.sizes import format_bytes, parse_size_option
from coordl._core.sysinfo import available_memory_bytes
from coordl._disk.cache import DiskCache, DiskCacheMismatch
from coordl._disk.folder import folder_of
from coordl._disk.tier import DiskTier, disk_tier
from coordl._fetch.cached_dataset import CachedDataset, SampleCounters
from coordl._fetch.concurrent_misses import reads_concurrently
from coordl._fetch.raw_datasets import dataset_identity, raw_source
from coordl._fetch.storage import FileStorage
from coordl._peer.tier import PeerTier
from coordl._peer.topology import resolve as resolve_partitioned
from coordl.exceptions import CacheMismatchError

logger = logging.getLogger(__name__)

CACHE_VERIFY = ("stat", "content")
_warned: set = set()


def auto_capacity(n_items: int) -> tuple[int, int]:
    """``cache_bytes="auto"``: (capacity, bytes of the shm file system a growing cache keeps free).

    The lesser of a share of available memory and what the shm file system has free beside the
    cache's index and the bytes kept free (a share of its size, for other jobs and for torch's
    worker-to-main batches until the loader has measured them). 0 when nothing fits. The dataset's
    size is not known (that would stat every file): the cache grows as it fills, so it never takes
    more than the dataset.
    """
    memory, free, index = available_memory_bytes(), free_shm_bytes(), index_bytes(n_items)
    keep = int(AUTO_CACHE_SHM_KEEP_FRACTION * total_shm_bytes())
    capacity = max(0, int(min(AUTO_CACHE_MEMORY_FRACTION * memory, free - index - keep)))
    logger.info("Because cache_bytes was not given, using up to %s, as the dataset fills it: the lesser of %d%% of "
                "available memory (%s) and the free space of %s (%s) less the cache's index (%s) and %s kept free "
                "for other jobs and torch's in-flight batches.", format_bytes(capacity),
                AUTO_CACHE_MEMORY_FRACTION * 100, format_bytes(memory), shm_dir(), format_bytes(free),
                format_bytes(index), format_bytes(keep))
    return capacity, keep


def _warn_once(key, message: str) -> None:
    """A configuration warning, once per process for each ``key`` (e.g. a dataset type)."""
    if key not in _warned:
        _warned.add(key)
        warn_caller(message)


def wrap_dataset(dataset, *, capacity: int | None, cache_name: str | None, cache_verify: str,
                 drop_page_cache: bool | None, num_workers: int, decode: bool, storage=None, partitioned=False,
                 cache_dir: str | None = None, cache_dir_bytes=None, cache_dir_verify: str = "checksum"):
    """The dataset torch will see: the user's dataset behind coordl's fetch path, or the user's dataset
    itself when coordl cannot cache it (it then loads as with torch, and coordl says so once).

    Args:
        capacity: the cache's size in bytes, None for ``"auto"``, 0 for no cache.
        decode: whether samples are decoded by the dataset's own code (False: the DALI backend decodes).
        storage: where misses are read from (a ``coordl._fetch.storage.Storage``). Defaults to the dataset's
            own (:func:`storage_of`: an object store's), else local files.
        partitioned: ``partitioned=`` of the loader (see ``partitioned.resolve``).
        cache_dir, cache_dir_bytes, cache_dir_verify: the disk tier's folder (None: no disk tier), quota
            (``cache_dir_bytes=`` of the loader, checked: see :func:`open_disk_tier`) and check of what it reads.
    """
    identity = peers = None
    if isinstance(dataset, CachedDataset):  # re-created from another coordl loader's attributes
        identity, dataset = dataset.identity, dataset.dataset
    source, why = raw_source(dataset, decode=decode)
    if source is None:
        iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        kind = type(dataset)
        named = kind.__qualname__ if kind.__module__ in ("builtins", "__main__") or kind.__module__.startswith(
            "torch.") else f"{kind.__qualname__} (from {kind.__module__})"
        _warn_once(kind, f"coordl cannot cache {named}: {why}. It is loaded uncached, as torch would" + (
            "." if iterable else "; to cache it, give it raw_key(i) (the file of item i) and decode_raw(i, raw) "
            "(the item from those bytes), or wrap its files in coordl.FileDataset."))
        return dataset
    cache, own = None, storage_of(source)
    storage = storage if storage is not None else own
    if identity is None and (capacity != 0 or cache_dir is not None):
        named = getattr(source, "raw_identity", None)
        identity = named() if named is not None else \
            dataset_identity(source, local=storage is None, content=cache_verify == "content")
    if capacity != 0:
        cache = open_cache(dataset, source, identity, capacity, cache_name=cache_name)
    drop = cache is not None or cache_dir is not None if drop_page_cache is None else bool(drop_page_cache)
    storage = storage if storage is not None else FileStorage(drop_page_cache=drop)
    if cache_dir is not None and len(source):
        try:
            storage = open_disk_tier(storage, cache_dir, cache_dir_bytes, scope=cache_name or identity.hex(),
                                     n_items=len(source), label=_cache_label(dataset, source, cache_name),
                                     verify=cache_dir_verify)
        except BaseException:
            if cache is not None:
                cache.close()
            raise
    rows = num_workers + 1 + reads_concurrently(storage)  # the last one the look-ahead's (NOTE [ Look-ahead ])
    counters = SampleCounters(rows)
    topology = resolve_partitioned(partitioned, cache is not None)
    if topology is not None:  # each loader its own, as every rank re-creates loaders alike (Lightning)
        try:
            peers = PeerTier(topology, cache, source, storage, num_workers + 1)
        except BaseException:
            cache.close()
            raise
    wrapped = CachedDataset(dataset, source, cache, storage, counters, identity, peers)
    if isinstance(storage, DiskTier):
        storage.counted_in = wrapped
    return wrapped


def open_disk_tier(storage, cache_dir: str, quota: int | None, *, scope: str, n_items: int, label: str,
                   verify: str = "checksum") -> DiskTier:
    """``storage`` behind the disk cache of the dataset named ``scope`` in ``cache_dir``, opened now (so a
    folder that cannot be made or read fails here, naming it). ``quota``: bytes of ``cache_dir`` the disk
    caches may take (None: ``"auto"``, see ``_disk.folder.room_for``)."""
    folder = folder_of(os.path.abspath(cache_dir), scope)
    cache = DiskCache(folder, identity=scope, n_items=n_items, label=label)
    try:
        cache.items()
    except DiskCacheMismatch as e:
        raise CacheMismatchError(f"coordl: {e}; remove it (coordl cache rm {os.path.basename(folder)} --cache-dir "
                                 f"{cache_dir}) or pass another cache_dir or cache_name") from None
    except OSError as e:
        raise OSError(e.errno, f"coordl cannot use cache_dir={cache_dir!r} for the disk tier: {e.strerror or e} "
                               f"({e.filename or folder})") from e
    return disk_tier(storage, cache, os.path.abspath(cache_dir), quota, verify)


def disk_quota(cache_dir_bytes) -> int | None:
    """``cache_dir_bytes=`` as bytes: an int or a size string (``"500GiB"``), or None for ``"auto"``."""
    if isinstance(cache_dir_bytes, str) and cache_dir_bytes.strip().endswith("%"):
        raise ValueError(f"cache_dir_bytes should be a whole number of bytes (an int or a size string such as "
                         f"'500GiB') or 'auto', but got cache_dir_bytes={cache_dir_bytes!r}")
    return parse_size_option("cache_dir_bytes", cache_dir_bytes, allow_zero=False)


def storage_of(source):
    """The storage a source's keys are read from, where it names one (``raw_storage``: a dataset in an object
    store), else None (files). A ``Subset``'s is its dataset's; a ``ConcatDataset``'s parts, or an
    ``ExperienceStream``'s experiences, must share one."""
    if getattr(source, "parts", None) is not None:  # a view of other datasets' samples
        storages = {id(storage): storage for storage in map(storage_of, source.parts)}
        if len(storages) > 1:
            raise TypeError(f"coordl cannot read this {type(source.dataset).__name__}: its datasets are in different "
                            f"stores (local files, or other buckets, prefixes or manifests); make them of one store "
                            f"(local files, or Subsets of one object-store dataset)")
        return next(iter(storages.values()))
    return getattr(source, "raw_storage", None)


def _cache_label(dataset, source, cache_name: str | None) -> str:
    """What ``coordl cache ls`` says the cache holds, e.g. ``ImageFolder of 96 files in /data/train``,
    after ``cache_name:`` where one was given."""
    folder = _folder(source)
    what = f"{type(dataset).__name__} of {len(source)} {'objects' if '://' in folder else 'files'} in {folder}"
    return f"{cache_name}: {what}" if cache_name else what


def _folder(source) -> str:
    """The absolute folder of a source's files: its dataset's ``root``, else its first file's folder; the
    folder its parts share for a ``Subset`` or ``ConcatDataset``; a dataset's URL in an object store."""
    if getattr(source, "parts", None) is not None:
        folders = [_folder(part) for part in source.parts if len(part)]
        return folders[0] if "://" in folders[0] else os.path.commonpath(folders)
    if getattr(source, "raw_storage", None) is not None:  # a dataset in an object store
        return source.url
    root = getattr(getattr(source, "dataset", source), "root", None)
    return os.path.abspath(root or os.path.dirname(source.raw_key(0)))


def open_cache(dataset, source, identity: bytes, capacity: int | None, *, cache_name: str | None) -> MinIOCache | None:
    """The node's cache for ``source``, the raw bytes of the user's ``dataset`` (attached now, so a
    /dev/shm without room for an explicit ``capacity`` fails here), or None."""
    explicit, keep = capacity is not None, 0
    if capacity is None:
        capacity, keep = auto_capacity(len(source))
        if capacity == 0:
            _warn_once(("no room", shm_dir()),
                       f"coordl: {shm_dir()} has no room for a cache of this dataset ({format_bytes(free_shm_bytes())} "
                       f"free, {format_bytes(index_bytes(len(source)))} needed for its index alone), so it loads "
                       f"uncached. Enlarge it (docker: --shm-size) or pass cache_bytes=0 to silence this.")
            return None
    if len(source) == 0:
        return None
    label = _cache_label(dataset, source, cache_name)  # not empty: len(source) > 0
    cache = MinIOCache(cache_segment_name(cache_name or identity.hex()), n_items=len(source), capacity_bytes=capacity,
                       fingerprint=identity, label=label, require_capacity=explicit, keep_free_bytes=keep)
    cache.stats()
    return cache
