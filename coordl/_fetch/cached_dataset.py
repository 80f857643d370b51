"""The user's dataset read through coordl's fetch path: MinIO cache first, then storage.

Runs in every DataLoader worker. Counts what it does in shared per-process counter rows, which the
loader sums for its statistics.
"""

import sys
import time
from typing import Any

import numpy as np
import torch
import torch.utils.data

from coordl._cache.minio import MinIOCache
from coordl._core.worker import exit_when_orphaned, own_row
from coordl._fetch.concurrent_misses import read_misses, reads_concurrently
from coordl._fetch.raw_datasets import RawBytesDataset
from coordl._fetch.storage import Storage, in_memory, stamper, worth_memory
from coordl.exceptions import SampleError, reading_failed

COUNTER_FIELDS = ("samples", "hits", "misses", "stale", "cache_bytes", "storage_bytes", "peer_hits", "peer_bytes",
                  "storage_wait_ns", "peer_wait_ns", "prep_ns", "waits", "wait_ns", "ahead", "ahead_bytes", "staged",
                  "disk_hits", "disk_bytes", "corrupt", "disk_wait_ns")
"""Per-sample counters: samples returned, cache hits, storage reads, those of them whose cached bytes were
out of date, bytes from cache, bytes from storage, items and bytes fetched from peers' caches (partitioned);
the time spent reading storage, waiting for peers and preparing samples (decode and transform); the hits
that waited for another reader's read in flight, and how long (``concurrent_misses``); items and bytes the
look-ahead read (``_fetch.lookahead``), and the items taken from its overflow (``_fetch.overflow``); the reads
the disk tier served, their bytes and time, and the disk items that failed their check (``_disk.tier``)."""
(_SAMPLES, _HITS, _MISSES, _STALE, _CACHE_BYTES, _STORAGE_BYTES, _PEER_HITS, _PEER_BYTES, _STORAGE_NS, _PEER_NS,
 _PREP_NS, _WAITS, _WAIT_NS, _AHEAD, _AHEAD_BYTES, _STAGED) = range(16)
_CONCURRENT_FIELDS = (_MISSES, _STORAGE_BYTES, _STORAGE_NS, _HITS, _CACHE_BYTES, _WAITS, _WAIT_NS, _STAGED)
_ELSEWHERE = "in the training process"  # a copy's feed: it stayed with the loader
_OWN = frozenset(("dataset", "source", "cache", "storage", "counters", "identity", "feed", "peers", "batch_hook",
                  "overflow", "exemplars"))
"""The proxy's own attributes; any other is the user's dataset's, read and written through the proxy."""


class SampleCounters:
    """int64 counters in shared memory, one row per process (row 0: main, 1 + i: worker i).

    Each process writes only its own row, so no locks are needed; readers sum the rows.
    Travels to workers with the dataset (fork or spawn) and stays shared.
    """

    def __init__(self, processes: int):
        self.table = torch.zeros((max(processes, 1), len(COUNTER_FIELDS)), dtype=torch.int64).share_memory_()
        self._rows = None

    def __getstate__(self) -> dict:
        return {"table": self.table, "_rows": None}

    def row(self) -> np.ndarray:
        """This process's row (a writable numpy view)."""
        if self._rows is None:
            self._rows = self.table.numpy()
        return self._rows[own_row(len(self._rows))]

    def totals(self) -> dict[str, int]:
        """Each counter summed over all processes. A read the disk tier served was also counted as a read
        below the memory cache (``_disk.tier`` NOTE [ Disk tier ]): ``misses``, ``storage_bytes`` and
        ``storage_wait_ns`` count storage's alone."""
        totals = dict(zip(COUNTER_FIELDS, (int(v) for v in self.table.sum(dim=0))))
        totals["misses"] -= totals["disk_hits"]
        totals["storage_bytes"] -= totals["disk_bytes"]
        totals["storage_wait_ns"] = max(0, totals["storage_wait_ns"] - totals["disk_wait_ns"])
        return totals


class PreparedBatch:
    """A whole batch a feed prepared, on its way through torch's fetcher to :class:`PreparedCollate`."""

    __slots__ = ("batch",)

    def __init__(self, batch):
        self.batch = batch


class PreparedCollate:
    """The collate function of a loader with a feed: a :class:`PreparedBatch` is already collated; anything
    else goes to the user's ``collate_fn``."""

    def __init__(self, collate_fn):
        self.collate_fn = collate_fn

    def __call__(self, data):
        return data.batch if isinstance(data, PreparedBatch) else self.collate_fn(data)


class CountingCollate:
    """The collate function of a loader over an ``IterableDataset``: the user's ``collate_fn``, counting in
    ``counters`` the samples torch's fetcher collates. Its index lists are placeholders, handed out ahead and
    past the dataset's end; the samples collated are what the training loop gets (short of the batches
    fetched ahead when it stops early). ``batched``: whether torch collates lists of samples (else each call
    is one sample)."""

    def __init__(self, collate_fn, counters: SampleCounters, batched: bool):
        self.collate_fn, self.counters, self.batched = collate_fn, counters, batched

    def __call__(self, data):
        self.counters.row()[_SAMPLES] += len(data) if self.batched else 1
        return self.collate_fn(data)


class CachedDataset(torch.utils.data.Dataset):
    """Map-style dataset that fetches each sample's raw bytes from the cache or storage, then
    decodes and transforms them with the dataset's own code.

    Args:
        dataset: the user's dataset. Reading, writing and deleting any other attribute than these
            arguments and ``feed`` falls through to it, as if torch held it: ``loader.dataset.classes``
            reads it, ``loader.dataset.transform = eval_tf`` changes it for the next epoch's workers.
        source: how to read ``dataset``'s raw bytes, or None to call ``dataset[i]`` uncached.
        cache: the node's MinIO cache for this dataset, or None.
        storage: where misses are read from.
        counters: shared counters to record hits, misses and bytes in.
        identity: ``raw_datasets.dataset_identity`` of the dataset's files (names its cache), kept so
            that a loader re-created from this one (Lightning, Accelerate) names the same cache.
        peers: the other servers' caches in a partitioned job (``partitioned.PeerTier``), or None.

    With a feed (``feed``, set by the loader: see ``_epochs.ledger`` NOTE [ Feeds ]), ``__getitems__`` hands
    out the feed's prepared batches instead of fetching samples. A feed lives in the training process:
    a copy of the dataset in a worker process refuses to load rather than return undecoded samples.
    ``batch_hook``, set by an observer of the data path (``_core.hooks``) before workers start, stands in
    for a batch's load: ``batch_hook(load, indices, feed)``.
    """

    def __init__(self, dataset, source: RawBytesDataset | None, cache: MinIOCache | None,
                 storage: Storage, counters: SampleCounters, identity: bytes | None, peers=None):
        self.dataset = dataset
        self.source = source
        self.cache = cache
        self.storage = storage
        self.counters = counters
        self.identity = identity
        self.peers = peers
        self.feed = None
        self.batch_hook = None
        self.overflow = None  # the look-ahead's, where the cache cannot hold the dataset (``_fetch.overflow``)
        self.exemplars = None  # rehearsal members the cache does not hold (``_rehearsal.exemplars``)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["feed"] = _ELSEWHERE if self.feed is not None else None
        return state

    def unfed(self) -> "CachedDataset":
        """The same fetch path without the feed: what prepares the feed's batches loads through it."""
        unfed = CachedDataset(self.dataset, self.source, self.cache, self.storage, self.counters, self.identity,
                              self.peers)
        unfed.overflow, unfed.exemplars = self.overflow, self.exemplars
        return unfed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "dataset" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["dataset"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN or name.startswith("__"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.dataset, name, value)

    def __delattr__(self, name: str) -> None:
        if name in _OWN or name.startswith("__"):
            object.__delattr__(self, name)
        else:
            delattr(self.dataset, name)

    def _release(self) -> None:
        for shared in (self.cache, self.exemplars):
            if shared is not None:
                shared.close()
        release = getattr(self.storage, "release", None)  # the disk tier's (``storage.Storage``)
        if release is not None:
            release()

    def fetch(self, index: int, row: np.ndarray) -> bytes:
        """Raw bytes of sample ``index``: from the cache, else a peer's cache, else storage (then offered to
        the cache). See :meth:`fetch_many`."""
        return self.fetch_many([index], row)[0]

    def fetch_many(self, indices: list[int], row: np.ndarray, views: bool = False) -> list:
        """Raw bytes of each of ``indices``: from the node's cache (``views``: as read-only views into it,
        no copy; see ``MinIOCache.view``), else (partitioned) from the peer that
        caches it, else from storage, offered to the cache (see ``_peer.client`` NOTE [ Peer read path ]:
        peers are asked for all of a batch's misses before storage is read).

        With a storage that stamps its files (``FileStorage``), a cached item is served only while its
        file's stamp (one ``stat``) is the one it was cached with: else (edited, replaced, a link
        re-pointed, gone) it is read from storage and counted ``stale``; the cache keeps the old bytes
        (never rewritten under readers) and serves them to no one. So is a peer's copy whose stamp is not
        this server's file's (where the peer reads the same storage). Bytes from a peer are not inserted:
        the peer holds them already, and neither are bytes read from storage because the peer that the map
        says holds them did not deliver (or its copy was stale). Bytes from storage that a full cache cannot
        take are handed, with their stamp, to a peer with room (``_peer.handoff`` NOTE [ Hand-off ]).
        """
        if self.cache is not None and torch.utils.data.get_worker_info() is not None:
            exit_when_orphaned(self._release)
        raws = self.cached_many(indices, row, views)
        misses = [k for k, raw in enumerate(raws) if raw is None]
        if not misses:
            return raws
        if self.peers is None and reads_concurrently(self.storage):
            for k, raw in zip(misses, read_misses(self, [indices[k] for k in misses], row, _CONCURRENT_FIELDS)):
                raws[k] = raw
            return raws
        pending = None
        if self.peers is not None:
            started = time.perf_counter_ns()
            local = getattr(self.storage, "holds", None)  # a disk tier: what it holds is read here, not asked for
            pending = self.peers.client.request([indices[k] for k in misses
                                                 if local is None or not local(self.source.raw_key(indices[k]))])
            row[_PEER_NS] += time.perf_counter_ns() - started
        asked = pending.asked if pending is not None else ()
        try:
            for k in misses:
                if indices[k] not in asked:
                    raws[k] = self._from_storage(indices[k], row)
        except BaseException:
            if asked:
                pending.abandon()
            raise
        if asked:
            started = time.perf_counter_ns()
            delivered = pending.collect()
            row[_PEER_NS] += time.perf_counter_ns() - started
            for k in misses:
                if indices[k] in asked:
                    raw = self._from_peer(indices[k], delivered, row)
                    raws[k] = self._from_storage(indices[k], row) if raw is None else raw
        return raws

    def _from_peer(self, index: int, delivered: dict, row: np.ndarray):
        """The bytes of ``index`` a peer delivered (counted as a peer hit), or None: none delivered, or (where
        the peer reads the same storage) its copy's stamp is not this server's file's, or the key is
        ``pinned`` here and has no stamp, having changed since (counted stale). A file missing here is no
        version to compare: the peer vouched for its copy against its own file."""
        raw, stamp = delivered.get(index, (None, None))
        if raw is None:
            return None
        current = stamper(self.storage)
        mine = None if current is None else current(self.source.raw_key(index))
        if current is not None and (stamp is not None and mine not in (None, stamp)
                                    or mine is None and getattr(self.storage, "pinned", False)):
            row[_STALE] += 1
            return None
        row[_PEER_HITS] += 1
        row[_PEER_BYTES] += len(raw)
        return raw

    def cached_many(self, indices: list[int], row: np.ndarray, views: bool = False) -> list:
        """The node's cached bytes of each of ``indices`` (``views``: views, not copies) that is current, else
        None; counted as hits, and as stale if cached but not current. A rehearsal exemplar the cache does not
        hold is looked for in the exemplar region (``_rehearsal.exemplars``), and counted the same."""
        cache, exemplars = self.cache, self.exemplars
        if cache is None:
            return [None] * len(indices)
        stamp, raw_key = stamper(self.storage), self.source.raw_key
        raws, hits, hit_bytes, stale = [], 0, 0, 0
        for index, item in zip(indices, cache.views(indices)):
            raw = None
            if item is None and exemplars is not None:
                item = exemplars.get(index)
            if item is not None:
                view, cached = item
                if stamp is None or stamp(raw_key(index)) == cached:
                    raw, hits, hit_bytes = view if views else bytes(view), hits + 1, hit_bytes + len(view)
                else:
                    stale += 1
            raws.append(raw)
        if hits:  # an add to the row costs a few tenths of a µs: none where there is nothing to add
            row[_HITS] += hits
            row[_CACHE_BYTES] += hit_bytes
        if stale:
            row[_STALE] += stale
        return raws

    def _from_storage(self, index: int, row: np.ndarray) -> bytes:
        """``index`` read from storage and offered to the cache (unless its cached copy is stale: taken)."""
        cache, key = self.cache, self.source.raw_key(index)
        stamped = getattr(self.storage, "read_stamped", None)
        started = time.perf_counter_ns()
        try:
            raw, stamp = stamped(key) if stamped is not None else (self.storage.read(key), None)
        except OSError as e:
            raise reading_failed(e, f"cannot read sample {index} ({key}): {e.strerror or e}") from e
        row[_STORAGE_NS] += time.perf_counter_ns() - started
        row[_MISSES] += 1
        row[_STORAGE_BYTES] += len(raw)
        peers = self.peers
        if peers is not None and peers.client.held_elsewhere(index):
            return raw  # its owner did not deliver (slow, down, stale): no second copy while the map names it
        if cache is not None and (stamp is not None or stamped is None) and worth_memory(self.storage, key):
            if cache.put(index, raw, stamp):
                in_memory(self.storage, key)
            elif self.exemplars is not None and self.exemplars.put(index, raw, stamp):
                return raw  # a rehearsal exemplar the cache has no room for (``_rehearsal.exemplars``)
            elif peers is not None and cache.full:
                peers.client.hand_off(index, raw, stamp)  # see partitioned NOTE [ Hand-off ]
        return raw

    def __getitem__(self, index: int) -> Any:
        row = self.counters.row()
        if self.source is None:
            row[_SAMPLES] += 1
            return self.dataset[index]
        raw = self.fetch(index, row)
        row[_SAMPLES] += 1
        started = time.perf_counter_ns()
        sample = self._decode(index, raw)
        row[_PREP_NS] += time.perf_counter_ns() - started
        return sample

    def _decode(self, index: int, raw) -> Any:
        try:
            return self.source.decode_raw(index, raw)
        except OSError as e:  # PIL reports corrupt and truncated images as OSError
            key = self.source.raw_key(index)
            raise SampleError(f"cannot decode sample {index} ({key}, {len(raw)} bytes): {e}") from e
        except Exception as e:
            if sys.version_info >= (3, 11):
                e.add_note(f"coordl: while decoding sample {index} ({self.source.raw_key(index)})")
            raise

    def __getitems__(self, indices: list[int]) -> list[Any]:
        if self.batch_hook is not None:
            return self.batch_hook(self._batch, indices, self.feed)
        return self._batch(indices)

    def _batch(self, indices: list[int]) -> list[Any]:
        if self.feed is not None:
            if self.feed is _ELSEWHERE:
                raise RuntimeError(
                    "this coordl dataset's batches are prepared in the training process (backend='dali' or "
                    "hp_group): build a DataLoader from it with num_workers=0, as the coordl loader's own "
                    "num_workers attribute says; its preparation still runs on coordl's workers or threads")
            return PreparedBatch(self.feed.take(indices))
        batched = getattr(self.dataset, "__getitems__", None)
        if self.source is None and batched:
            self.counters.row()[_SAMPLES] += len(indices)
            return batched(indices)
        if self.source is None:
            return [self[i] for i in indices]
        row = self.counters.row()
        raws = self.fetch_many(indices, row)
        row[_SAMPLES] += len(indices)
        started = time.perf_counter_ns()  # once a batch: a clock read costs as much as a light sample's fetch
        samples = [self._decode(index, raw) for index, raw in zip(indices, raws)]
        row[_PREP_NS] += time.perf_counter_ns() - started
        return samples
