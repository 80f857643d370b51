"""The exemplars' own region of shared memory: the raw bytes of rehearsal-buffer members the node's cache does not
hold, kept for as long as they are members, within a byte bound.

NOTE [ Exemplar region ]
The MinIO cache fills once and never evicts, so once it is full a stream's later experiences are read from
storage every epoch, and so would be the exemplars admitted from them. Where the cache cannot hold the whole
stream, a loader with a ``Rehearsal`` therefore keeps the members it does not hold in one segment
``cdl_<token>_exemplars`` per (cache, rehearsal seed, ranks), shared by every rank and worker on the node:
  * header (4 KiB: int64 fields ``_H_*``, the mutex holder's info at ``LOCK_INFO_AT``), then per item
    ``first`` int32[N] (its first page, -1 when not held), ``length`` int64[N], ``stamp`` int64[N, 2] (the
    version of the file read, as the cache's), ``wanted`` int8[N]; per page ``next`` int32[P] (the next page
    of its item, or of the free list; -1 ends a chain); then P pages of ``PAGE`` bytes, allocated up front, so
    a write never SIGBUSes. The bound is P pages.
  * **Wanted.** At each pass's start the training process (every rank's) marks wanted exactly the members
    now and the samples the pass will admit (``RehearsalBatches`` plays the pass's offers on a copy of the
    buffers; the offers follow from the seeds), and frees every held item no longer wanted (:meth:`keep`).
  * **Filled by the readers.** A worker that read a wanted sample from storage (or took it from an object
    store's look-ahead overflow), the cache having no room for it, puts its bytes here (:meth:`put`): a new
    sample about to be admitted, or a member replayed before any process on the node held it (a resumed job).
    So an exemplar costs its one storage read as a new sample and none as a replay; one the cache holds is
    never held here too.
  * **Concurrency.** :meth:`put` and :meth:`keep` take the segment's mutex (the copy in too: a sample's
    bytes); a put that finds too few free pages stores nothing (counted in ``refused``), and the replay is
    read from storage. Readers take no lock: an item's pages never change while it is held, and
    :meth:`keep` unpublishes an item (``first = -1``), bumps ``_H_FREES`` and only then returns its pages to
    the free list; a reader that sees ``_H_FREES`` change across its copy drops it and reads again. A
    writer killed inside the mutex leaks at most the pages of the item it was writing (the free list's head
    moves just before the item is published).
  * **Partitioned.** In a partitioned job whose ranks are the buffers' (rank k's is buffer k), a server's
    region wants its own ranks' buffers alone; the training process lends the others' wanted items to their
    servers (``PeerTier.lend``), so a miss of one is asked of its server, whose peer server serves its region
    beside its cache (``_peer.server.cache_lookup``). An exemplar is held once in the job, and another
    server's replay of it, or read of it as a new sample, is a peer fetch, not a storage read.
  * **Lifecycle.** Every process that maps the region holds a liveness slot; the last one out unlinks it, and
    the next coordl process on the node removes one whose users all died (``_core.shm.reclaim_dead``).
"""

import functools
import hashlib
import math
import multiprocessing.util
import os
import threading
import time

import numpy as np

from coordl._core.settings import EXEMPLARS_KIND, MAX_CACHE_USERS, SHM_PREFIX
from coordl._core.shm import Segment, SegmentKind, open_or_create, shm_dir
from coordl._core.sizes import format_bytes
from coordl.exceptions import ShmCapacityError

PAGE = 4096
"""Bytes of one page of the region: an item takes whole pages."""
_MAGIC = int.from_bytes(b"COORDLX1", "little")
_VERSION = 1
(_H_MAGIC, _H_VERSION, _H_READY, _H_N_ITEMS, _H_PAGES, _H_FREE_HEAD, _H_FREE_PAGES, _H_FREES, _H_ITEMS, _H_BYTES,
 _H_REFUSED, _H_CREATED_NS) = range(12)
_HEADER_FIELDS = 32
_HEADER_BYTES = 4096


def _layout(n_items: int, pages: int) -> tuple[int, int, int, int, int, int]:
    """(first_at, length_at, stamp_at, wanted_at, next_at, data_at) byte positions."""
    first_at = _HEADER_BYTES
    length_at = first_at + 8 * math.ceil(4 * n_items / 8)
    stamp_at = length_at + 8 * n_items
    wanted_at = stamp_at + 16 * n_items
    next_at = wanted_at + 8 * math.ceil(n_items / 8)
    data_at = (next_at + 4 * pages + PAGE - 1) // PAGE * PAGE
    return first_at, length_at, stamp_at, wanted_at, next_at, data_at


def region_bytes(n_items: int, pages: int) -> int:
    """Bytes of a region of ``pages`` pages over ``n_items`` items."""
    return _layout(n_items, pages)[5] + pages * PAGE


def pages_for(nbytes: int) -> int:
    return max(1, -(-nbytes // PAGE))


def region_name(cache_name: str, seed: int, world: int) -> str:
    """Segment name of the exemplar region of the cache ``cache_name`` under a rehearsal of ``seed`` over ``world``
    ranks: every rank of a job on the node names the same."""
    token = hashlib.sha256(f"{os.getuid()}\0{cache_name}\0{seed}\0{world}\0exemplars v{_VERSION}".encode()).hexdigest()
    return f"{SHM_PREFIX}{token[:12]}_{EXEMPLARS_KIND}"


class _Views:
    def __init__(self, buf, n_items: int, pages: int):
        first_at, length_at, stamp_at, wanted_at, next_at, data_at = _layout(n_items, pages)
        self.header = np.ndarray((_HEADER_FIELDS,), np.int64, buf, 0)
        self.first = np.ndarray((n_items,), np.int32, buf, first_at)
        self.length = np.ndarray((n_items,), np.int64, buf, length_at)
        self.stamp = np.ndarray((n_items, 2), np.int64, buf, stamp_at)
        self.wanted = np.ndarray((n_items,), np.int8, buf, wanted_at)
        self.next = memoryview(buf)[next_at:next_at + 4 * pages].cast("i")
        self.pages = np.ndarray((pages, PAGE), np.uint8, buf, data_at)


def _shape_of(buf) -> tuple[int, int] | None:
    """(n_items, pages) of a region of this layout in ``buf``, else None."""
    if len(buf) < _HEADER_BYTES:
        return None
    header = np.frombuffer(buf, np.int64, _HEADER_FIELDS, 0)
    if header[_H_MAGIC] != _MAGIC or header[_H_VERSION] != _VERSION or not header[_H_READY]:
        return None
    n_items, pages = int(header[_H_N_ITEMS]), int(header[_H_PAGES])
    return (n_items, pages) if len(buf) >= region_bytes(n_items, pages) else None


class ExemplarRegion:
    """Handle on the node's exemplar region of ``n_items`` stream items and ``pages`` pages (see
    NOTE [ Exemplar region ]). Travels to workers (fork, spawn, pickle) and attaches on first use there.

    Raises (on first use): ShmCapacityError if the shm file system cannot hold it.
    """

    def __init__(self, name: str, n_items: int, pages: int):
        self.name, self.n_items, self.pages = name, int(n_items), int(pages)
        self._attach = (None, None)  # (pid, lock)
        self._pid = self._segment = self._views = self._finalizer = None

    def __getstate__(self) -> dict:
        return {"name": self.name, "n_items": self.n_items, "pages": self.pages}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["name"], state["n_items"], state["pages"])

    @property
    def bound_bytes(self) -> int:
        return self.pages * PAGE

    def _ensure(self) -> _Views:
        pid = os.getpid()
        if self._pid != pid:
            if self._attach[0] != pid:
                self._attach = (pid, threading.Lock())
            with self._attach[1]:
                if self._pid != pid:
                    self._connect(pid)
        return self._views

    def _connect(self, pid: int) -> None:
        segment = open_or_create(self.name, what=f"exemplar region {self.name}", create=self._create,
                                 usable=self._usable)
        try:
            slot = segment.take_slot(s for s in range(MAX_CACHE_USERS) if s not in segment.live_slots())
            if slot is None:
                raise RuntimeError(f"exemplar region {self.name} already has {MAX_CACHE_USERS} live users")
        finally:
            segment.unlock()
        self._segment, self._views, self._pid = segment, _Views(segment.buf, self.n_items, self.pages), pid
        self._finalizer = multiprocessing.util.Finalize(self, segment.leave, args=(slot, lambda buf: None),
                                                        exitpriority=-1)

    def _create(self) -> Segment | None:
        size = region_bytes(self.n_items, self.pages)
        return Segment.create(self.name, size, functools.partial(_room_error, self.bound_bytes),
                              initialize=self._initialize)

    def _initialize(self, buf) -> None:
        views = _Views(buf, self.n_items, self.pages)
        views.first[:] = -1
        chain = np.arange(1, self.pages + 1, dtype=np.int32)
        chain[-1] = -1
        np.frombuffer(views.next, dtype=np.int32)[:] = chain
        header = views.header
        header[_H_MAGIC], header[_H_VERSION], header[_H_N_ITEMS], header[_H_PAGES] = _MAGIC, _VERSION, self.n_items, \
            self.pages
        header[_H_FREE_HEAD], header[_H_FREE_PAGES], header[_H_CREATED_NS] = 0, self.pages, time.time_ns()
        header[_H_READY] = 1
        del views, header

    def _usable(self, segment: Segment) -> bool:
        if _shape_of(segment.buf) == (self.n_items, self.pages):
            return True
        live = segment.live_slots()
        segment.unlock()
        segment.close()
        if live:
            raise RuntimeError(f"exemplar region {self.name} is in use by {len(live)} process(es) with another "
                               f"stream or bound; give this job's Rehearsal another seed")
        _REGIONS.remove(self.name, force=True)
        return False

    # -- the training process -------------------------------------------------------------------------

    def keep(self, indices) -> int:
        """Want exactly ``indices`` from now on; free every held item not among them. Returns how many were freed."""
        views = self._ensure()
        at = np.asarray(sorted(set(int(i) for i in indices if 0 <= int(i) < self.n_items)), dtype=np.int64)
        with self._segment.locked(what=f"exemplar region {self.name}"):
            views.wanted[:] = 0
            views.wanted[at] = 1
            held = np.flatnonzero(views.first >= 0)
            drop = held[views.wanted[held] == 0]
            if not len(drop):
                return 0
            heads = views.first[drop].tolist()
            views.first[drop] = -1
            views.header[_H_FREES] += 1  # after unpublishing, before any page is reused (see the NOTE)
            free_head, freed = int(views.header[_H_FREE_HEAD]), 0
            nxt = views.next
            for head in heads:
                last, count = head, 1
                while nxt[last] >= 0:
                    last, count = nxt[last], count + 1
                nxt[last], free_head, freed = free_head, head, freed + count
            views.header[_H_FREE_HEAD] = free_head
            views.header[_H_FREE_PAGES] += freed
            views.header[_H_ITEMS] -= len(drop)
            views.header[_H_BYTES] -= int(views.length[drop].sum())
        return len(drop)

    # -- any process ----------------------------------------------------------------------------------

    def wants(self, index: int) -> bool:
        """Whether item ``index`` is wanted and not held (no lock)."""
        views = self._ensure()
        return bool(views.wanted[index]) and views.first[index] < 0

    def put(self, index: int, raw, stamp=None) -> bool:
        """Hold ``raw``, item ``index``'s bytes (``stamp``: the version read), if it is wanted, not held and fits;
        whether this call stored it."""
        if not self.wants(index):
            return False
        views, need = self._views, pages_for(len(raw))
        with self._segment.locked(what=f"exemplar region {self.name}"):
            if not views.wanted[index] or views.first[index] >= 0:
                return False
            if views.header[_H_FREE_PAGES] < need:
                views.header[_H_REFUSED] += 1
                return False
            nxt, data = views.next, np.frombuffer(raw, dtype=np.uint8)
            pages, page = [], int(views.header[_H_FREE_HEAD])
            for _ in range(need):
                pages.append(page)
                page = nxt[page]
            for k, at in enumerate(pages):
                chunk = data[k * PAGE:(k + 1) * PAGE]
                views.pages[at, :len(chunk)] = chunk
            nxt[pages[-1]] = -1
            views.header[_H_FREE_HEAD], views.header[_H_FREE_PAGES] = page, views.header[_H_FREE_PAGES] - need
            views.length[index] = len(raw)
            views.stamp[index] = stamp[:2] if stamp else (0, 0)
            views.first[index] = pages[0]  # published
            views.header[_H_ITEMS] += 1
            views.header[_H_BYTES] += len(raw)
        return True

    def get(self, index: int) -> tuple[bytes, tuple[int, int, int]] | None:
        """Item ``index``'s bytes and stamp (as ``MinIOCache.stamp``), or None if it is not held. Takes no lock."""
        views = self._ensure()
        for _ in range(2):
            frees = int(views.header[_H_FREES])
            head = int(views.first[index])
            if head < 0:
                return None
            length = int(views.length[index])
            stamp = views.stamp[index].tolist()
            raw = self._copy(views, head, length)
            if raw is not None and int(views.header[_H_FREES]) == frees:
                return raw, (stamp[0], stamp[1], length)
        return None

    def _copy(self, views: _Views, head: int, length: int) -> bytes | None:
        need, nxt, pages = pages_for(length), views.next, [head]
        for _ in range(need - 1):
            page = nxt[pages[-1]]
            if not 0 <= page < self.pages:
                return None  # freed under the copy: the caller reads again
            pages.append(page)
        if pages[-1] - head == need - 1 and pages == list(range(head, head + need)):
            return views.pages[head:head + need].tobytes()[:length]
        return views.pages[pages].tobytes()[:length]

    def sizes(self, indices: list[int]) -> list[int | None]:
        """The length of each of ``indices`` held, None for one not held (a snapshot; no lock)."""
        views = self._ensure()
        at = np.asarray(indices, dtype=np.int64)
        if not len(at):
            return []
        held = views.first[at] >= 0
        return [int(n) if h else None for n, h in zip(views.length[at].tolist(), held.tolist())]

    def stats(self) -> dict:
        """Members held, their bytes, the bound, and puts refused for want of room."""
        header = self._ensure().header
        return {"items": int(header[_H_ITEMS]), "bytes": int(header[_H_BYTES]), "bound": self.bound_bytes,
                "refused": int(header[_H_REFUSED])}

    def close(self) -> None:
        """Give up this process's use of the region; the last user removes it. Idempotent."""
        if self._finalizer is not None and self._pid == os.getpid():
            self._views = None
            self._finalizer()
        self._pid = self._segment = self._views = self._finalizer = None


def _room_error(bound: int, needed: int, free: int) -> ShmCapacityError:
    return ShmCapacityError(f"the rehearsal buffer's exemplar region of {format_bytes(bound)} (the members the cache "
                            f"does not hold) needs {format_bytes(needed)} of {shm_dir()}, which has {format_bytes(free)} "
                            f"free: lower the Rehearsal's capacity or exemplar_bytes, or enlarge it (docker: --shm-size)")


def _read(name: str, buf, live_slots: list[int]) -> dict | None:
    shape = _shape_of(buf)
    if shape is None:
        return None
    header = np.frombuffer(buf, np.int64, _HEADER_FIELDS, 0)
    return {"name": name, "items": int(header[_H_ITEMS]), "bytes": int(header[_H_BYTES]),
            "bound": shape[1] * PAGE, "users_alive": len(live_slots)}


_REGIONS = SegmentKind(EXEMPLARS_KIND, _read, lambda s: s["users_alive"])
