"""MinIO cache: a node-wide, fill-once, never-evict cache of raw sample bytes in shared memory.

Unrelated to the MinIO object store: "MinIO" is the cache policy of CoorDL (Mohan et al., VLDB 2021,
§6.1). Items are inserted in first-come order as they are fetched during the first epoch until the
capacity is reached; nothing is ever evicted, so every later epoch gets exactly as many hits as
items cached and reads only (dataset - cache) from storage.

NOTE [ Memory layout ]
One segment ``cdl_<token>_cache`` in the shm directory holds, in order:
  * header (4 KiB): int64 fields ``_H_*``, the dataset fingerprint (32 bytes), a label, and the
    mutex holder's info (``_shm.LOCK_INFO_AT``);
  * users (``MAX_CACHE_USERS`` x (pid, attach time ns)): who maps the cache, for display only;
    row ``i`` belongs to whoever holds liveness slot ``i`` (see ``_core.shm`` NOTE [ Locks and liveness ]);
  * index: ``offsets`` int64[N], ``lengths`` int64[N], ``stamps`` int64[N, 2] (the version of the
    file each item was read from, inode and ctime, see ``storage.Stamp``; zeros without one),
    ``status`` int32[N] with
    0 = empty, 1 = ready, 2 = orphaned (space reserved by a writer that died or was interrupted), -(slot + 1) = being
    written by the user in ``slot``;
  * data (``capacity`` bytes, page aligned): item bytes, packed in insertion order. The first
    ``allocated`` bytes are really allocated; the rest is a hole that is allocated in chunks as the
    fill reaches it (see NOTE [ Claims ]
Where an item's size is known before its bytes are read (an object store's manifest gives it), a reader
*claims* the item first (:meth:`MinIOCache.claim`: the reservation and ``status = -(slot + 1)`` above, no
bytes yet), then reads it and fills the claim; everyone else who needs it meanwhile sees it in flight
(:meth:`MinIOCache.in_flight`) and waits for it (:meth:`MinIOCache.wait`) rather than reading it again. The
claim is taken under the mutex, so of any number of workers, look-aheads and jobs on the node exactly one
reads each item. A claim released unfilled (the read failed, or brought another size) is orphaned, and a
claimer that dies is a dead writer: its waiters stop waiting and read the item themselves.

NOTE [ Sizing ]).

NOTE [ Concurrency and crashes ]
Writers take the segment's mutex only to reserve space: the cursor moves first (a crash leaks at
most that item's bytes), then offset and length, then ``status = -(slot + 1)``; the copy runs
unlocked (the bytes, then the stamp), then one aligned int32 store of ``status = 1`` publishes the
item. Readers take no lock: an item is visible once ready and never moves or changes afterwards (no
eviction). A slot whose copy was interrupted (an exception in ``put``) is marked 2 at once; one whose
writer died (its liveness lock is free) is *orphaned* too: whoever next takes the mutex and meets it
turns it to 2. The next process that fetches the item rewrites it in place, also after the cache
froze. Registration reaps dead users' rows the same way before a slot is reused.

NOTE [ Sizing ]
Every cache is created with only its index allocated (allocating many GiB of tmpfs up front takes
seconds) and grows its data area in ``_CHUNK`` steps under the mutex as the fill reaches it, so it
never takes more than the dataset. An explicit ``capacity_bytes`` (``require_capacity``) is checked
against the free space under the shm directory's lock when the cache is created, so a size that
does not fit fails at once; it then grows while the file system has room. ``"auto"`` caches grow
only while the shm file system keeps ``keep_free`` bytes free: room for torch's worker-to-main
batches (measured by the loader from its first batch) and for other jobs. A step that does not fit
freezes the cache where it is and says so once. Nothing ever SIGBUSes: bytes are written only
inside the allocated area.

NOTE [ Lifecycle ]
The first process to ask for a cache creates it; others attach. Every process that maps the cache
(loader, workers, other jobs) holds a liveness slot and gives it up when it closes, when its handle
is collected, or at exit (after multiprocessing has stopped its daemonic children, so a job's
persistent workers never outlive the check); the last one out unlinks the segment. A process
killed with SIGKILL just loses its slot: the next coordl process on the machine removes caches
whose users are all dead (``_shm.reclaim_dead``), whatever their dataset.
"""

import dataclasses
import functools
import hashlib
import logging
import multiprocessing.util
import os
import threading
import time

import numpy as np

from coordl._core.settings import CACHE_KIND, MAX_CACHE_USERS, SHM_PREFIX
from coordl._core.shm import Segment, SegmentKind, free_shm_bytes, open_or_create, shm_dir, total_shm_bytes
from coordl._core.sizes import format_bytes
from coordl.exceptions import CacheMismatchError, ShmCapacityError

logger = logging.getLogger(__name__)
_said_attached: set = set()  # (pid, cache name): "attached existing cache" logged already

_MAGIC = int.from_bytes(b"COORDLC1", "little")
_VERSION = 3
(_H_MAGIC, _H_VERSION, _H_READY, _H_N_ITEMS, _H_CAPACITY, _H_DATA_OFFSET, _H_CURSOR, _H_FROZEN,
 _H_CREATED_NS, _H_CREATOR_PID, _H_ALLOCATED, _H_KEEP_FREE, _H_PEER_NODE, _H_PEER_NODES) = range(14)
_HEADER_FIELDS = 32
_FINGERPRINT_AT, _FINGERPRINT_LEN = 256, 32
_LABEL_AT, _LABEL_LEN = 512, 512
_HEADER_BYTES = 4096
_USERS_AT = _HEADER_BYTES
_EMPTY, _READY, _ORPHANED = 0, 1, 2
VIEWS_AT_ONCE = 6
"""Items from which :meth:`MinIOCache.views` reads them all at once (fewer: one by one is faster)."""
_FULL, _SHM_SHORT = 1, 2  # why a cache froze (the _H_FROZEN value)
_PAGE = 4096
_STAMP_FIELDS = 2
_CHUNK = 64 * 2**20
_CHUNKS_PER_SHM = 64  # and at most this share of the shm file system per step
_HANDLE_LOCKS = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Claim:
    """An item's reserved place, being written by this process (:meth:`MinIOCache.claim`)."""

    index: int
    offset: int
    size: int


def _reset_handle_locks() -> None:
    global _HANDLE_LOCKS
    _HANDLE_LOCKS = threading.Lock()


os.register_at_fork(after_in_child=_reset_handle_locks)


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _index_layout(n_items: int) -> tuple[int, int, int, int, int]:
    """(offsets_at, lengths_at, stamps_at, status_at, data_at) byte positions for ``n_items`` items."""
    offsets_at = _USERS_AT + MAX_CACHE_USERS * 16
    lengths_at = offsets_at + 8 * n_items
    stamps_at = lengths_at + 8 * n_items
    status_at = stamps_at + 8 * _STAMP_FIELDS * n_items
    data_at = _round_up(status_at + 4 * n_items, _PAGE)
    return offsets_at, lengths_at, stamps_at, status_at, data_at


def index_bytes(n_items: int) -> int:
    """Bytes of a cache of ``n_items`` items beside its data: header, users table and index."""
    return _index_layout(n_items)[4]


def cache_segment_name(scope: str) -> str:
    """Segment name of this user's cache for ``scope`` (a cache name or a dataset fingerprint).

    The layout version is part of the name, so caches of another coordl version never collide.
    """
    token = hashlib.sha256(f"{os.getuid()}\0{scope}\0cache v{_VERSION}".encode()).hexdigest()[:12]
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
    allocated_bytes: int
    frozen: bool
    users_alive: int
    partition: tuple[int, int] | None = None
    """(server, servers) when the cache is one server's part of a partitioned job's aggregate cache."""

    @property
    def fill_fraction(self) -> float:
        """Share of the dataset's items held in the cache."""
        return self.items_cached / self.n_items if self.n_items else 0.0


class _Views:
    """numpy views onto a mapped cache segment, and a read-only view of all of it (``data``, which
    :meth:`MinIOCache.view` slices); dropped before the mapping is closed."""

    def __init__(self, buf, n_items: int):
        offsets_at, lengths_at, stamps_at, status_at, self.data_at = _index_layout(n_items)
        self.data = memoryview(buf).toreadonly()
        self.header = np.ndarray((_HEADER_FIELDS,), np.int64, buf, 0)
        self.users = np.ndarray((MAX_CACHE_USERS, 2), np.int64, buf, _USERS_AT)
        self.offsets = np.ndarray((n_items,), np.int64, buf, offsets_at)
        self.lengths = np.ndarray((n_items,), np.int64, buf, lengths_at)
        self.stamps = np.ndarray((n_items, _STAMP_FIELDS), np.int64, buf, stamps_at)
        self.status = np.ndarray((n_items,), np.int32, buf, status_at)

    def fingerprint(self, buf) -> bytes:
        return bytes(buf[_FINGERPRINT_AT:_FINGERPRINT_AT + _FINGERPRINT_LEN])

    def label(self, buf) -> str:
        return bytes(buf[_LABEL_AT:_LABEL_AT + _LABEL_LEN]).rstrip(b"\0").decode("utf-8", "replace")

    def reap(self, slot: int) -> None:
        """Forget the dead user of ``slot``: clear its row, orphan the items it was writing. Hold the mutex."""
        self.users[slot] = 0
        self.status[self.status == -(slot + 1)] = _ORPHANED

    def reap_dead(self, live: list[int]) -> None:
        """Reap every user row whose slot is not in ``live``. Hold the mutex."""
        alive = set(live)
        for slot in np.flatnonzero(self.users[:, 0]):
            if int(slot) not in alive:
                self.reap(int(slot))


def _header_n_items(buf) -> int | None:
    """Item count of a cache header of this layout in ``buf``, None if it is not one."""
    if len(buf) < _HEADER_BYTES:
        return None
    header = np.frombuffer(buf, np.int64, _HEADER_FIELDS, 0)
    if header[_H_MAGIC] != _MAGIC or header[_H_VERSION] != _VERSION or not header[_H_READY]:
        return None
    n_items = int(header[_H_N_ITEMS])
    return n_items if len(buf) >= index_bytes(n_items) else None


def _forget_user(slot: int, pid: int, buf) -> None:
    """Clear users row ``slot`` if ``pid`` still has it (the mutex is held)."""
    users = np.ndarray((MAX_CACHE_USERS, 2), np.int64, buf, _USERS_AT)
    if users[slot, 0] == pid:
        users[slot] = 0
    del users


class MinIOCache:
    """Handle on one node-wide MinIO cache of raw item bytes, indexed ``0 .. n_items - 1``.

    Args:
        name: segment name; from :func:`cache_segment_name`.
        n_items: number of items of the dataset.
        capacity_bytes: bytes of item data the cache may hold (an existing cache keeps its own).
        fingerprint: 32 bytes identifying the dataset's content; a cache holding another
            fingerprint is never served.
        label: human-readable description shown by ``coordl cache ls``.
        require_capacity: creating the cache fails unless the shm file system has the whole capacity
            free (an explicit size); else it grows only while the file system keeps ``keep_free_bytes``
            free (``"auto"``). Either way the data area is allocated as it fills (see NOTE [ Sizing ]).
            Defaults to True.
        keep_free_bytes: bytes of the shm file system a growing cache leaves free. Defaults to 0.

    Lifecycle: a handle maps the cache lazily in each process that uses it, holding a liveness slot
    there (handles travel to DataLoader workers by pickling or fork and re-attach there; threads
    of one process share one attachment). :meth:`close`, garbage collection or process exit gives
    the slot up; the last user out removes the segment. See NOTE [ Lifecycle ].

    Raises (on first use):
        ShmCapacityError: the shm file system cannot hold the cache (or, growing, its index).
        CacheMismatchError: a live cache of this name holds a different dataset.

    Example::

        >>> cache = MinIOCache(cache_segment_name("doc-example"), n_items=2,
        ...                    capacity_bytes=1 << 20, fingerprint=bytes(32))
        >>> cache.put(0, b"raw jpeg bytes"), cache.get(0), cache.get(1)
        (True, b'raw jpeg bytes', None)
        >>> cache.close()
    """

    def __init__(self, name: str, *, n_items: int, capacity_bytes: int, fingerprint: bytes, label: str = "",
                 require_capacity: bool = True, keep_free_bytes: int = 0):
        if len(fingerprint) != _FINGERPRINT_LEN:
            raise ValueError(f"fingerprint must be {_FINGERPRINT_LEN} bytes, got {len(fingerprint)}")
        self.name = name
        self.n_items = n_items
        self.requested_capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.label = label
        self.require_capacity = require_capacity
        self.keep_free_bytes = keep_free_bytes
        self._attach_lock = (None, None)  # (pid, lock): a lock inherited over fork is never used
        self._reset()

    def _reset(self) -> None:
        self._pid = None
        self._segment = None
        self._views = None
        self._slot = -1
        self._finalizer = None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for key in ("_pid", "_segment", "_views", "_finalizer"):
            state[key] = None
        state["_slot"], state["_attach_lock"] = -1, (None, None)
        return state

    # -- attaching -------------------------------------------------------------------------

    def _ensure(self) -> _Views:
        """This process's views of the cache, attaching (and creating) it on first use."""
        pid = os.getpid()
        if self._pid != pid:
            with self._lock_of(pid):  # threads of one process attach once
                if self._pid != pid:
                    self._reset()  # a handle inherited over fork: its locks and slot are the parent's
                    self._connect()
        return self._views

    def _lock_of(self, pid: int) -> threading.Lock:
        """This handle's attach lock in process ``pid``."""
        with _HANDLE_LOCKS:
            if self._attach_lock[0] != pid:
                self._attach_lock = (pid, threading.Lock())
            return self._attach_lock[1]

    def _connect(self) -> None:
        segment = open_or_create(self.name, what=f"cache {self.name}", create=self._create, usable=self._usable)
        self._register(segment)

    def _create(self) -> Segment | None:
        data_at = index_bytes(self.n_items)
        capacity = self.requested_capacity_bytes
        require = data_at + capacity if self.require_capacity else data_at
        segment = Segment.create(self.name, data_at + capacity, self._capacity_error, initialize=self._initialize,
                                 allocate=data_at, require=require)
        if segment is not None:
            logger.info("created cache %s: up to %s for %d items of %s (allocated as it fills)", self.name,
                        format_bytes(capacity), self.n_items, self.label or "a dataset")
        return segment

    def _initialize(self, buf) -> None:
        header = np.ndarray((_HEADER_FIELDS,), np.int64, buf, 0)
        capacity = self.requested_capacity_bytes
        header[_H_MAGIC], header[_H_VERSION] = _MAGIC, _VERSION
        header[_H_N_ITEMS], header[_H_CAPACITY] = self.n_items, capacity
        header[_H_DATA_OFFSET], header[_H_CURSOR], header[_H_FROZEN] = index_bytes(self.n_items), 0, 0
        header[_H_CREATED_NS], header[_H_CREATOR_PID] = time.time_ns(), os.getpid()
        header[_H_ALLOCATED] = 0
        header[_H_KEEP_FREE] = self.keep_free_bytes
        buf[_FINGERPRINT_AT:_FINGERPRINT_AT + _FINGERPRINT_LEN] = self.fingerprint
        label = self.label.encode()[:_LABEL_LEN - 1]
        buf[_LABEL_AT:_LABEL_AT + len(label)] = label
        header[_H_READY] = 1
        del header

    def _capacity_error(self, needed: int, free: int) -> ShmCapacityError:
        index = index_bytes(self.n_items)
        fits = (free - index) // 2**20 * 2**20
        advice = (f"Pass cache_bytes={format_bytes(fits).replace(' ', '')!r} or less, " if fits > 0 else
                  "Even its index does not fit: pass cache_bytes=0, ")
        what = f"a cache of {format_bytes(needed - index)} plus its index of {format_bytes(index)} for " \
               f"{self.n_items} items" if self.require_capacity else f"the index of {format_bytes(index)} for {self.n_items} items"
        return ShmCapacityError(
            f"{what} needs {format_bytes(needed)} of {shm_dir()}, which has {format_bytes(free)} free. {advice}"
            f"free it (`coordl cache ls`, `coordl cache rm --stale`), or enlarge it (docker: --shm-size).")

    def _usable(self, segment: Segment) -> bool:
        """Whether the locked, existing ``segment`` holds our dataset; removes it if it is dead."""
        n_items = _header_n_items(segment.buf)
        live = segment.live_slots()
        if n_items == self.n_items:
            views = _Views(segment.buf, n_items)
            same, label = views.fingerprint(segment.buf) == self.fingerprint, views.label(segment.buf)
            del views
            if same:
                return True
        else:
            label = "unknown layout"
        segment.unlock()
        segment.close()
        if live:
            raise CacheMismatchError(
                f"cache {self.name} ({label}) holds a different dataset than {self.label or 'this one'} "
                f"and is in use by {len(live)} process(es). Pass another cache_name=, or stop the jobs "
                f"using it (`coordl cache ls`).")
        logger.info("replacing dead cache %s (%s): its dataset changed", self.name, label)
        _CACHES.remove(self.name, force=n_items is None)
        return False

    def _register(self, segment: Segment) -> None:
        """Take a liveness slot and a users row in the locked ``segment``, then unlock it."""
        try:
            views = _Views(segment.buf, self.n_items)
            live = segment.live_slots()
            views.reap_dead(live)
            slot = segment.take_slot(s for s in range(MAX_CACHE_USERS) if s not in live)
            if slot is None:
                raise RuntimeError(f"cache {self.name} already has {MAX_CACHE_USERS} live users")
            pid = os.getpid()
            views.users[slot] = (pid, time.time_ns())
            capacity = int(views.header[_H_CAPACITY])
            if self.keep_free_bytes > views.header[_H_KEEP_FREE]:
                views.header[_H_KEEP_FREE] = self.keep_free_bytes
        finally:
            segment.unlock()
        if capacity != self.requested_capacity_bytes and (pid, self.name) not in _said_attached:
            _said_attached.add((pid, self.name))  # once per process: every worker and epoch attaches again
            logger.info("attached existing cache %s of %s (asked for %s)", self.name,
                        format_bytes(capacity), format_bytes(self.requested_capacity_bytes))
        self._pid, self._segment, self._views, self._slot = pid, segment, views, slot
        # After multiprocessing stops this process's daemonic children (persistent workers) at exit.
        self._finalizer = multiprocessing.util.Finalize(
            self, segment.leave, args=(slot, functools.partial(_forget_user, slot, pid)), exitpriority=-1)

    # -- the data path -----------------------------------------------------------------------

    def get(self, index: int) -> bytes | None:
        """The cached bytes of item ``index`` (a copy of :meth:`view`), or None on a miss. Takes no lock."""
        view = self.view(index)
        return None if view is None else bytes(view)

    def view(self, index: int) -> memoryview | None:
        """The cached bytes of item ``index`` without a copy (a read-only view into the cache's mapping),
        or None on a miss. Takes no lock. A ready item never moves or changes, and the mapping stays
        until the last view into it is gone, even past :meth:`close` (the segment's name goes as usual)."""
        views = self._ensure()
        if views.status[index] != _READY:
            return None
        start = views.data_at + int(views.offsets[index])
        return views.data[start:start + int(views.lengths[index])]

    def missing(self, indices: list[int]) -> list[int]:
        """Those of ``indices`` not cached now, in their order (one array read; no lock)."""
        at = np.asarray(indices, dtype=np.int64)
        return at[self._ensure().status[at] != _READY].tolist() if len(at) else []

    def views(self, indices: list[int]) -> list[tuple[memoryview, tuple[int, int, int]] | None]:
        """:meth:`view` and :meth:`stamp` of each of ``indices`` in a few array reads for them all (a batch's
        hits): (view, stamp) for an item that is cached, None for one that is not. Takes no lock. Whether
        each is ready is read first: a ready item's place and stamp were written before it became ready. Fewer
        than :data:`VIEWS_AT_ONCE` items are read one by one."""
        if len(indices) < VIEWS_AT_ONCE:
            return [None if (view := self.view(index)) is None else (view, self.stamp(index)) for index in indices]
        views = self._ensure()
        at = np.asarray(indices, dtype=np.int64)
        ready = (views.status[at] == _READY).tolist()
        starts, lengths = (views.offsets[at] + views.data_at).tolist(), views.lengths[at].tolist()
        stamps, data = views.stamps[at].tolist(), views.data
        return [(data[start:start + length], (stamp[0], stamp[1], length)) if is_ready else None
                for is_ready, start, length, stamp in zip(ready, starts, lengths, stamps)]

    def stamp(self, index: int) -> tuple[int, int, int]:
        """The stamp item ``index`` was put with, its length last (zeros before it if none); read it once
        :meth:`get` or :meth:`view` returned the item."""
        views = self._views
        version, length = views.stamps[index].tolist(), int(views.lengths[index])
        return version[0], version[1], length

    def put(self, index: int, data: bytes, stamp: tuple[int, int, int] | None = None) -> bool:
        """Insert item ``index`` unless it is cached, being written by a live process, or does not fit.
        ``stamp``: the version of the stored bytes (``storage.Stamp``; its last field, the size, is the
        item's length), served back by :meth:`stamp`.

        Returns:
            Whether this call inserted it. A full cache freezes; after that only orphaned items (see
            NOTE [ Concurrency and crashes ]) are written, in place.
        """
        claim = self.claim(index, len(data))
        return claim is not None and self.fill(claim, data, stamp)

    def claim(self, index: int, size: int) -> "Claim | None":
        """Reserve item ``index``'s place for ``size`` bytes and mark it being written by this process, before
        its bytes are read (see NOTE [ Claims ]); None where :meth:`put` would not insert it. Fill the claim
        or :meth:`release` it."""
        views = self._ensure()
        state = int(views.status[index])
        if state == _READY or (views.header[_H_FROZEN] and state == _EMPTY):
            return None
        with self._segment.locked(what=f"cache {self.name}"):  # see NOTE [ Concurrency and crashes ]
            offset = self._reserve(views, index, size)
            if offset is None:
                return None
            views.status[index] = -(self._slot + 1)
        return Claim(index, offset, size)

    def fill(self, claim: "Claim", data, stamp: tuple[int, int, int] | None = None) -> bool:
        """Write and publish a claimed item's bytes; bytes of another size than claimed are not written (the
        claim is released) and False returned."""
        views = self._views
        if len(data) != claim.size:
            self.release(claim)
            return False
        try:
            self._write(views, claim.index, claim.offset, data, stamp)
        except BaseException:  # (a KeyboardInterrupt mid-copy): the space goes to the next writer of the item
            views.status[claim.index] = _ORPHANED
            raise
        views.status[claim.index] = _READY  # the publish: only now may a reader see the item
        return True

    def release(self, claim: "Claim") -> None:
        """Give up a claim unfilled (its read failed): the next writer of the item rewrites its place."""
        views = self._views
        if views is not None and int(views.status[claim.index]) == -(self._slot + 1):
            views.status[claim.index] = _ORPHANED

    def in_flight(self, index: int) -> bool:
        """Whether item ``index`` is claimed by a live process (this one included), its bytes on their way."""
        state = int(self._ensure().status[index])
        return state < 0 and (-state - 1 == self._slot or self._segment.slot_alive(-state - 1))

    def wait(self, index: int, timeout_s: float) -> memoryview | None:
        """Item ``index``'s bytes (a view, with :meth:`stamp` current) once the claim it is under is filled;
        None at once if it is not in flight, or once its claim is released, its writer dies or ``timeout_s``
        passes."""
        deadline, delay = time.monotonic() + timeout_s, 0.0002
        while True:
            view = self.view(index)
            if view is not None:
                return view
            if not self.in_flight(index):
                return self.view(index)  # filled between the two looks, or released
            if time.monotonic() >= deadline:
                return None
            time.sleep(delay)
            delay = min(delay * 2, 0.005)

    def _write(self, views: _Views, index: int, offset: int, data: bytes, stamp) -> None:
        """Copy item ``index``'s bytes to ``offset`` of the data area, then its stamp; unlocked, unpublished."""
        start = views.data_at + offset
        self._segment.buf[start:start + len(data)] = data
        views.stamps[index] = stamp[:_STAMP_FIELDS] if stamp else (0,) * _STAMP_FIELDS

    def _reserve(self, views: _Views, index: int, size: int) -> int | None:
        """Where item ``index`` goes, or None if it is taken or does not fit. Hold the mutex."""
        state = int(views.status[index])
        if state < 0:
            writer = -state - 1
            if writer == self._slot or self._segment.slot_alive(writer):
                return None
            views.reap(writer)
            state = _ORPHANED
        if state == _READY:
            return None
        if state == _ORPHANED and views.lengths[index] == size:
            return int(views.offsets[index])  # rewrite a dead writer's slot in place
        cursor = int(views.header[_H_CURSOR])
        if views.header[_H_FROZEN]:
            return None
        if cursor + size > views.header[_H_CAPACITY]:
            views.header[_H_FROZEN] = _FULL
            return None
        if cursor + size > views.header[_H_ALLOCATED] and not self._grow(views, cursor + size):
            return None
        views.header[_H_CURSOR] = cursor + size
        views.offsets[index], views.lengths[index] = cursor, size
        return cursor

    def _grow(self, views: _Views, end: int) -> bool:
        """Allocate the data area up to at least ``end`` (see NOTE [ Sizing ]); freeze if it does not fit."""
        h = views.header
        allocated, capacity, keep = int(h[_H_ALLOCATED]), int(h[_H_CAPACITY]), int(h[_H_KEEP_FREE])
        free, chunk = free_shm_bytes(), min(_CHUNK, total_shm_bytes() // _CHUNKS_PER_SHM)
        for target in (min(capacity, max(end, allocated + chunk)), end):
            grow = min(_round_up(target - allocated, _PAGE), capacity - allocated)
            if free - grow >= keep and self._segment.allocate(views.data_at + allocated, grow):
                h[_H_ALLOCATED] = allocated + grow
                return True
        h[_H_FROZEN] = _SHM_SHORT
        logger.warning("coordl: cache %s stopped growing at %s of its %s (%d items): %s has %s free and keeps %s "
                       "free for torch's in-flight batches and other jobs. Pass cache_bytes= to size it yourself.",
                       self.name, format_bytes(allocated), format_bytes(capacity),
                       int(np.count_nonzero(views.status == _READY)), shm_dir(), format_bytes(free),
                       format_bytes(keep))
        return False

    @property
    def full(self) -> bool:
        """Whether the cache has frozen: it takes no more items."""
        return bool(self._ensure().header[_H_FROZEN])

    @property
    def capacity_bytes(self) -> int:
        return int(self._ensure().header[_H_CAPACITY])

    def mark_partition(self, node: int, nodes: int) -> None:
        """Record that this cache is server ``node``'s part of a partitioned job over ``nodes`` servers."""
        views = self._ensure()
        with self._segment.locked(what=f"cache {self.name}"):
            views.header[_H_PEER_NODE], views.header[_H_PEER_NODES] = node + 1, nodes

    def ready_mask(self) -> np.ndarray:
        """A bool array: which items are cached (a snapshot)."""
        return self._ensure().status == _READY

    def keep_free(self, nbytes: int) -> None:
        """Make a growing cache leave at least ``nbytes`` of the shm file system free from now on."""
        views = self._ensure()
        if nbytes > views.header[_H_KEEP_FREE]:
            with self._segment.locked(what=f"cache {self.name}"):
                views.header[_H_KEEP_FREE] = max(int(views.header[_H_KEEP_FREE]), nbytes)

    # -- inspection and cleanup --------------------------------------------------------------

    @property
    def attached(self) -> bool:
        """Whether this process currently maps the cache through this handle."""
        return self._pid == os.getpid()

    def stats(self) -> CacheStats:
        """Fill state of the cache as all its users see it (attaching if need be)."""
        views = self._ensure()
        return _stats_of(self.name, self._segment.buf, views, len(self._segment.live_slots()))

    def close(self) -> None:
        """Give up this process's use of the cache; the last user removes it. Idempotent."""
        if self._finalizer is not None and self._pid == os.getpid():
            self._views = None
            self._finalizer()
        self._reset()

    def __enter__(self) -> "MinIOCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _stats_of(name: str, buf, views: _Views, users_alive: int) -> CacheStats:
    ready = views.status == _READY
    return CacheStats(
        name=name,
        label=views.label(buf),
        n_items=len(views.status),
        items_cached=int(np.count_nonzero(ready)),
        bytes_cached=int(views.lengths[ready].sum()),
        capacity_bytes=int(views.header[_H_CAPACITY]),
        allocated_bytes=int(views.header[_H_ALLOCATED]),
        frozen=bool(views.header[_H_FROZEN]),
        users_alive=users_alive,
        partition=(int(views.header[_H_PEER_NODE]) - 1, int(views.header[_H_PEER_NODES]))
        if views.header[_H_PEER_NODES] else None,
    )


def _read(name: str, buf, live_slots: list[int]) -> CacheStats | None:
    """Stats of a cache from a read-only mapping of it (None if its layout is not this version's)."""
    n_items = _header_n_items(buf)
    if n_items is None:
        return None
    views = _Views(buf, n_items)
    return _stats_of(name, buf, views, len(live_slots))


_CACHES = SegmentKind(CACHE_KIND, _read, lambda s: s.users_alive)


def list_caches() -> list:
    """Every MinIO cache in the shm directory (:class:`CacheStats`, or ``_shm.Unreadable`` for one this
    version cannot read). Read-only: takes no lock and changes nothing."""
    return _CACHES.all_stats()


def remove_cache(name: str, *, force: bool = False) -> bool:
    """Remove cache ``name``; only if no live process uses it unless ``force``. Returns whether removed.

    Processes still mapping a forcibly removed cache keep working; its memory is freed when they close.
    """
    return _CACHES.remove(name, force=force)


def cleanup_stale() -> list[str]:
    """Remove every cache whose users are all dead; return their names."""
    return _CACHES.cleanup_stale()
