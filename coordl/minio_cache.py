"""MinIO cache: a node-wide, fill-once, never-evict cache of raw sample bytes in shared memory.

Unrelated to the MinIO object store: "MinIO" is the cache policy of CoorDL (Mohan et al., VLDB 2021,
§6.1). Items are inserted in first-come order as they are fetched during the first epoch until the
capacity is reached; nothing is ever evicted, so every later epoch gets exactly as many hits as
items cached and reads only (dataset - cache) from storage.

NOTE [ Memory layout ]
One segment ``/dev/shm/cdl_<token>_cache`` holds, in order:
  * header (4 KiB): int64 fields ``_H_*``, the dataset fingerprint (32 bytes) and a label;
  * users (``MAX_CACHE_USERS`` x (pid, start ticks)): the processes that map the cache;
  * index: ``offsets`` int64[N], ``lengths`` int64[N], ``status`` int32[N] with
    0 = empty, 1 = ready, -pid = being written by pid;
  * data (``capacity`` bytes, page aligned): item bytes, packed in insertion order.

NOTE [ Concurrency and crashes ]
Writers serialise on the segment's flock only to reserve space; the copy runs unlocked, then a
single aligned store of ``status = 1`` publishes the item. Readers take no lock at all: an item is
visible once ready and never moves or changes afterwards (no eviction), so a lookup is two loads
and a copy. Reservation orders its stores so that a SIGKILL at any point is harmless: the cursor
moves first (a crash leaks at most that item's bytes), then offset and length, then status = -pid.
A slot left at -pid by a dead writer is rewritten in place by the next process that fetches the
item. The kernel drops the flock of a dead holder, so nobody ever waits on a dead process.

NOTE [ Lifecycle ]
The first process to ask for a cache creates it (sized and allocated up front after checking
free /dev/shm, so writes can never SIGBUS) and publishes its header last; others attach. Every
process that maps the cache (loader, workers, other jobs) registers in the users table and
unregisters when it closes, when its handle is collected, or when it exits; the last one out
unlinks the segment. Slots of processes that died without unregistering are reaped whenever
someone takes the lock, so a cache left behind by killed jobs is reclaimed by the next user
(reused if it holds the same dataset) or by :func:`cleanup_stale` / ``coordl cache rm --stale``.
"""

import dataclasses
import logging
import multiprocessing.util
import os
import time

import numpy as np

from coordl._constants import CACHE_KIND, MAX_CACHE_USERS, SHM_PREFIX
from coordl._shm import Segment, SegmentKind
from coordl._sizes import format_bytes
from coordl._sysinfo import is_process_alive, process_start_ticks
from coordl.exceptions import CacheMismatchError, ShmCapacityError

logger = logging.getLogger(__name__)

_MAGIC = int.from_bytes(b"COORDLC1", "little")
_VERSION = 1
(_H_MAGIC, _H_VERSION, _H_READY, _H_N_ITEMS, _H_CAPACITY, _H_DATA_OFFSET, _H_CURSOR, _H_FROZEN,
 _H_CREATED_NS, _H_CREATOR_PID) = range(10)
_HEADER_FIELDS = 32
_FINGERPRINT_AT, _FINGERPRINT_LEN = 256, 32
_LABEL_AT, _LABEL_LEN = 512, 512
_HEADER_BYTES = 4096
_USERS_AT = _HEADER_BYTES
_READY = 1
_PAGE = 4096
_OPEN_ATTEMPTS = 50


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _index_layout(n_items: int) -> tuple[int, int, int, int]:
    """(offsets_at, lengths_at, status_at, data_at) byte positions for ``n_items`` items."""
    offsets_at = _USERS_AT + MAX_CACHE_USERS * 16
    lengths_at = offsets_at + 8 * n_items
    status_at = lengths_at + 8 * n_items
    data_at = _round_up(status_at + 4 * n_items, _PAGE)
    return offsets_at, lengths_at, status_at, data_at


def cache_segment_name(token: str) -> str:
    """Segment name of the cache with scope ``token`` (hex)."""
    return f"{SHM_PREFIX}{token}_{CACHE_KIND}"


@dataclasses.dataclass(frozen=True)
class CacheStats:
    """A snapshot of one cache's fill state."""

    name: str
    label: str
    n_items: int
    items_cached: int
    bytes_cached: int
    capacity_bytes: int
    frozen: bool
    users_alive: int

    @property
    def fill_fraction(self) -> float:
        """Share of the dataset's items held in the cache."""
        return self.items_cached / self.n_items if self.n_items else 0.0


class _Views:
    """numpy views onto a mapped cache segment (dropped before the mapping is closed)."""

    def __init__(self, buf, n_items: int):
        offsets_at, lengths_at, status_at, self.data_at = _index_layout(n_items)
        self.header = np.ndarray((_HEADER_FIELDS,), np.int64, buf, 0)
        self.users = np.ndarray((MAX_CACHE_USERS, 2), np.int64, buf, _USERS_AT)
        self.offsets = np.ndarray((n_items,), np.int64, buf, offsets_at)
        self.lengths = np.ndarray((n_items,), np.int64, buf, lengths_at)
        self.status = np.ndarray((n_items,), np.int32, buf, status_at)

    def fingerprint(self, buf) -> bytes:
        return bytes(buf[_FINGERPRINT_AT:_FINGERPRINT_AT + _FINGERPRINT_LEN])

    def label(self, buf) -> str:
        return bytes(buf[_LABEL_AT:_LABEL_AT + _LABEL_LEN]).rstrip(b"\0").decode("utf-8", "replace")

    def reap_dead_users(self) -> int:
        """Clear the slots of dead processes; return how many live users remain. Hold the lock."""
        alive = 0
        for slot in np.flatnonzero(self.users[:, 0]):
            pid, ticks = (int(v) for v in self.users[slot])
            if is_process_alive(pid, ticks):
                alive += 1
            else:
                self.users[slot] = 0
        return alive


def _header_n_items(buf) -> int | None:
    """Item count of a published cache header in ``buf``, None if the header is not valid."""
    header = np.ndarray((_HEADER_FIELDS,), np.int64, buf, 0) if len(buf) >= _HEADER_BYTES else None
    if header is None or header[_H_MAGIC] != _MAGIC or header[_H_VERSION] != _VERSION or not header[_H_READY]:
        return None
    return int(header[_H_N_ITEMS])


def _detach(segment: Segment, slot: int, n_items: int) -> None:
    """Unregister ``slot``; unlink the segment if no live user is left; close our mapping."""
    if segment.buf is None:
        return
    try:
        with segment.locked():
            views = _Views(segment.buf, n_items)
            if views.users[slot, 0] == os.getpid():
                views.users[slot] = 0
            if views.reap_dead_users() == 0:
                segment.unlink()
                logger.debug("removed cache %s (last user gone)", segment.name)
            del views
        segment.close()
    except BufferError:  # views of a still-live handle at interpreter exit: the OS unmaps them
        pass


class MinIOCache:
    """Handle on one node-wide MinIO cache of raw item bytes, indexed ``0 .. n_items - 1``.

    Args:
        name: segment name; from :func:`cache_segment_name`.
        n_items: number of items of the dataset.
        capacity_bytes: bytes of item data the cache may hold (an existing cache keeps its own).
        fingerprint: 32 bytes identifying the dataset's content; a cache holding another
            fingerprint is never served.
        label: human-readable description shown by ``coordl cache ls``.

    Lifecycle: a handle maps the cache lazily in each process that uses it, registering that
    process as a user (handles travel to DataLoader workers by pickling or fork and re-attach
    there). :meth:`close`, garbage collection or process exit unregisters; the last user out
    removes the segment. See NOTE [ Lifecycle ].

    Raises (on first use):
        ShmCapacityError: /dev/shm cannot hold ``capacity_bytes``.
        CacheMismatchError: a live cache of this name holds a different dataset.

    Example::

        >>> cache = MinIOCache(cache_segment_name("0123456789ab"), n_items=2,
        ...                    capacity_bytes=1 << 20, fingerprint=bytes(32))
        >>> cache.put(0, b"raw jpeg bytes"), cache.get(0), cache.get(1)
        (True, b'raw jpeg bytes', None)
        >>> cache.close()
    """

    def __init__(self, name: str, *, n_items: int, capacity_bytes: int, fingerprint: bytes, label: str = ""):
        if len(fingerprint) != _FINGERPRINT_LEN:
            raise ValueError(f"fingerprint must be {_FINGERPRINT_LEN} bytes, got {len(fingerprint)}")
        self.name = name
        self.n_items = n_items
        self.requested_capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.label = label
        self._reset()

    def _reset(self) -> None:
        self._pid = None
        self._segment = None
        self._views = None
        self._finalizer = None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for key in ("_pid", "_segment", "_views", "_finalizer"):
            state[key] = None
        return state

    # -- attaching -------------------------------------------------------------------------

    def _ensure(self) -> _Views:
        """This process's views of the cache, attaching (and creating) it on first use."""
        if self._pid != os.getpid():
            self._reset()  # a handle inherited over fork: its lock and registration are the parent's
            self._connect()
        return self._views

    def _connect(self) -> None:
        _, _, _, data_at = _index_layout(self.n_items)
        size = data_at + self.requested_capacity_bytes
        for _ in range(_OPEN_ATTEMPTS):
            segment = Segment.open(self.name)
            if segment is None:
                segment = self._create(size)
                if segment is None:
                    continue  # another process created it first: attach to theirs
            elif not self._usable(segment):
                continue
            self._register(segment)
            return
        raise RuntimeError(f"internal error: could not create or attach cache {self.name}")

    def _create(self, size: int) -> Segment | None:
        segment = Segment.create(self.name, size, self._capacity_error)
        if segment is None:
            return None
        buf = segment.buf
        header = np.ndarray((_HEADER_FIELDS,), np.int64, buf, 0)
        _, _, _, data_at = _index_layout(self.n_items)
        header[_H_MAGIC], header[_H_VERSION] = _MAGIC, _VERSION
        header[_H_N_ITEMS], header[_H_CAPACITY] = self.n_items, self.requested_capacity_bytes
        header[_H_DATA_OFFSET], header[_H_CURSOR], header[_H_FROZEN] = data_at, 0, 0
        header[_H_CREATED_NS], header[_H_CREATOR_PID] = time.time_ns(), os.getpid()
        buf[_FINGERPRINT_AT:_FINGERPRINT_AT + _FINGERPRINT_LEN] = self.fingerprint
        label = self.label.encode()[:_LABEL_LEN - 1]
        buf[_LABEL_AT:_LABEL_AT + len(label)] = label
        header[_H_READY] = 1  # published last: attachers only trust a ready header
        del header
        logger.info("created cache %s: %s for %d items of %s", self.name,
                    format_bytes(self.requested_capacity_bytes), self.n_items, self.label or "a dataset")
        return segment

    def _capacity_error(self, size: int, free: int) -> ShmCapacityError:
        return ShmCapacityError(
            f"cache capacity {format_bytes(size)} exceeds free space in /dev/shm ({format_bytes(free)}). "
            f"Pass a smaller cache_bytes= (e.g. cache_bytes={format_bytes(free * 0.8).replace(' ', '')!r}), "
            f"free /dev/shm (`coordl cache ls`, `coordl cache rm --stale`), "
            f"or enlarge it (docker: --shm-size)."
        )

    def _usable(self, segment: Segment) -> bool:
        """Whether the locked, existing ``segment`` holds our dataset; removes it if abandoned."""
        n_items = _header_n_items(segment.buf)
        if n_items is None:  # its creator died before publishing the header
            segment.unlink()
            segment.close()
            return False
        views = _Views(segment.buf, n_items)
        same = n_items == self.n_items and views.fingerprint(segment.buf) == self.fingerprint
        alive = views.reap_dead_users()
        label = views.label(segment.buf)
        del views
        if same:
            return True
        if alive:
            segment.unlock()
            segment.close()
            raise CacheMismatchError(
                f"cache {self.name} ({label}) holds a different dataset than {self.label or 'this one'} "
                f"and is in use by {alive} process(es). Pass another cache_name=, or stop the jobs "
                f"using it (`coordl cache ls`)."
            )
        logger.info("replacing stale cache %s (%s): its dataset changed", self.name, label)
        segment.unlink()
        segment.close()
        return False

    def _register(self, segment: Segment) -> None:
        """Enter this process in the users table of the locked ``segment``, then unlock it."""
        try:
            views = _Views(segment.buf, self.n_items)
            free_slots = np.flatnonzero(views.users[:, 0] == 0)
            if len(free_slots) == 0 and views.reap_dead_users() < MAX_CACHE_USERS:
                free_slots = np.flatnonzero(views.users[:, 0] == 0)
            if len(free_slots) == 0:
                raise RuntimeError(f"cache {self.name} already has {MAX_CACHE_USERS} live users")
            slot, pid = int(free_slots[0]), os.getpid()
            views.users[slot] = (pid, process_start_ticks(pid))
            capacity = int(views.header[_H_CAPACITY])
        finally:
            segment.unlock()
        if capacity != self.requested_capacity_bytes:
            logger.info("attached existing cache %s of %s (asked for %s)", self.name,
                        format_bytes(capacity), format_bytes(self.requested_capacity_bytes))
        self._pid, self._segment, self._views = pid, segment, views
        self._finalizer = multiprocessing.util.Finalize(
            self, _detach, args=(segment, slot, self.n_items), exitpriority=0)

    # -- the data path -----------------------------------------------------------------------

    def get(self, index: int) -> bytes | None:
        """The cached bytes of item ``index``, or None on a miss. Takes no lock."""
        views = self._ensure()
        if views.status[index] != _READY:
            return None
        start = views.data_at + int(views.offsets[index])
        return self._segment.buf[start:start + int(views.lengths[index])]

    def put(self, index: int, data: bytes) -> bool:
        """Insert item ``index`` unless it is cached, being written, or does not fit.

        Returns:
            Whether this call inserted it. A full cache freezes: nothing is inserted after.
        """
        views = self._ensure()
        if views.header[_H_FROZEN] or views.status[index] == _READY:
            return False
        size = len(data)
        with self._segment.locked():  # see NOTE [ Concurrency and crashes ] for the store order
            state = int(views.status[index])
            if state == _READY or (state < 0 and is_process_alive(-state)):
                return False
            if state < 0 and views.lengths[index] == size:
                offset = int(views.offsets[index])  # a dead writer's slot: rewrite it in place
            else:
                cursor = int(views.header[_H_CURSOR])
                if views.header[_H_FROZEN] or cursor + size > views.header[_H_CAPACITY]:
                    views.header[_H_FROZEN] = 1
                    return False
                views.header[_H_CURSOR] = cursor + size
                views.offsets[index], views.lengths[index] = cursor, size
                offset = cursor
            views.status[index] = -self._pid
        start = views.data_at + offset
        self._segment.buf[start:start + size] = data
        views.status[index] = _READY
        return True

    # -- inspection and cleanup --------------------------------------------------------------

    @property
    def attached(self) -> bool:
        """Whether this process currently maps the cache through this handle."""
        return self._pid == os.getpid()

    def stats(self) -> CacheStats:
        """Fill state of the cache as all its users see it (attaching if need be)."""
        views = self._ensure()
        return _stats_of(self.name, self._segment.buf, views, users_alive=None)

    def close(self) -> None:
        """Unregister this process; the last user removes the cache. Idempotent."""
        if self._finalizer is not None and self._pid == os.getpid():
            self._views = None
            self._finalizer()
        self._reset()

    def __enter__(self) -> "MinIOCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _stats_of(name: str, buf, views: _Views, users_alive: int | None) -> CacheStats:
    ready = views.status == _READY
    if users_alive is None:
        users_alive = int(np.count_nonzero(views.users[:, 0]))
    return CacheStats(
        name=name,
        label=views.label(buf),
        n_items=len(views.status),
        items_cached=int(np.count_nonzero(ready)),
        bytes_cached=int(views.lengths[ready].sum()),
        capacity_bytes=int(views.header[_H_CAPACITY]),
        frozen=bool(views.header[_H_FROZEN]),
        users_alive=users_alive,
    )


def _inspect(name: str, remove_if) -> CacheStats | None:
    """Stats of cache ``name`` (reaping dead users); unlink it if ``remove_if(stats)``."""
    segment = Segment.open(name)
    if segment is None:
        return None
    try:
        n_items = _header_n_items(segment.buf)
        if n_items is None:  # abandoned mid-creation
            segment.unlink()
            return None
        views = _Views(segment.buf, n_items)
        stats = _stats_of(name, segment.buf, views, users_alive=views.reap_dead_users())
        del views
        if remove_if(stats):
            segment.unlink()
        return stats
    finally:
        segment.unlock()
        segment.close()


_CACHES = SegmentKind(CACHE_KIND, _inspect, lambda s: s.users_alive)


def list_caches() -> list[CacheStats]:
    """Every MinIO cache on this machine, with dead users reaped."""
    return _CACHES.all_stats()


def remove_cache(name: str, *, force: bool = False) -> bool:
    """Remove cache ``name``; only if no live process uses it unless ``force``. Returns whether removed.

    Processes still mapping a forcibly removed cache keep working; its memory is freed when they close.
    """
    return _CACHES.remove(name, force=force)


def cleanup_stale() -> list[str]:
    """Remove every cache whose users are all dead; return their names."""
    return _CACHES.cleanup_stale()
