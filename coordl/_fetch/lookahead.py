"""The look-ahead: each pass's items read in the sampler's order into the node's cache, ahead of the
training loop, from a storage whose reads are slow one by one but many can be in flight (an object store).

NOTE [ Look-ahead ]
The training process knows each pass's whole plan when it starts (the ledger's ``begin``), and the next
pass's first batches before this one ends (``plan_ahead``, NOTE [ Planning ahead ] in ``batch_sampler``).
``depth`` threads walk that order, less what is cached when the pass starts (the next pass's items once
this pass's reads are done, so a read is for the pass it is counted in), each taking the next item, claiming it in the cache unless it is cached
or in flight there (minio_cache NOTE [ Claims ]), reading it and filling the claim; torch's workers, asked
for the item later, find it cached or wait for it in flight (``concurrent_misses``), so no item is read
twice on the node. Once the cache is full, the items it has no room for go to the overflow (``_fetch.overflow``
NOTE [ Overflow ]: slots in shared memory, each item taken out by the worker that asks for it), so later
epochs at a partial cache are read ahead too; a thread that finds every slot taken waits for the loop
to take one (one of them polls; the others wait on it). The threads start 16 at first, and one more with
each read done, up to ``depth``.

Its threads hold this state, not the loader, so a dropped loader stops them (``weakref.finalize``). A
fork (torch starting the next epoch's workers while they read) waits for their requests in flight
(``_objects.client`` NOTE [ Object store client ]).
"""

import logging
import os
import threading
import time
import weakref

from coordl._fetch.cached_dataset import COUNTER_FIELDS, CachedDataset
from coordl._fetch.concurrent_misses import reads_concurrently
from coordl._fetch.overflow import SKIP, overflow_for
from coordl._fetch.storage import in_memory

logger = logging.getLogger(__name__)
_AHEAD, _AHEAD_BYTES = COUNTER_FIELDS.index("ahead"), COUNTER_FIELDS.index("ahead_bytes")
FIRST_THREADS = 16
"""Threads the look-ahead starts with; each read done starts one more, up to its depth (so a pass's first
objects are not queued behind a burst of ``depth`` GETs on connections still being opened)."""
POLL_S = 0.002
"""How often a thread waiting for an overflow slot looks for one (the workers free them, in other processes)."""


def lookahead_of(dataset) -> "LookAhead | None":
    """The look-ahead of a loader over ``dataset`` (the loader's): where it caches, alone on its server (no
    peers), from a storage that reads concurrently and asks for one (``storage.lookahead`` > 0). Gives
    ``dataset`` its overflow where the cache cannot hold all of ``storage.sizes()``."""
    if not isinstance(dataset, CachedDataset) or dataset.cache is None or dataset.peers is not None:
        return None
    storage = dataset.storage
    if not reads_concurrently(storage) or getattr(storage, "lookahead", 0) <= 0:
        return None
    dataset.overflow = overflow_for(storage.sizes(), storage.lookahead, dataset.cache)
    return LookAhead(dataset, storage.lookahead, row=len(dataset.counters.table) - 1)


class LookAhead:
    """Reads the items of each pass of a loader over ``dataset`` (a ``CachedDataset`` with a cache) into its
    cache, ``depth`` at a time, in the order the sampler will ask for them; counts them in the counters' last
    row (``ahead``, ``ahead_bytes``). Pickles without its threads (started again in the process that uses
    it)."""

    def __init__(self, dataset, depth: int, row: int):
        self.dataset, self.depth, self.row = dataset, depth, row
        self._walk, self._pid = None, None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_walk": None, "_pid": None}

    def follow(self, batches: list, ahead) -> None:
        """A pass starts with the plan ``batches`` (lists of indices, or indices); ``ahead(n)`` draws the next
        pass's first ``n`` batches (or is None)."""
        if self._pid != os.getpid():
            self._walk, self._pid = _Walk(self.dataset, self.depth, self.row), os.getpid()
            weakref.finalize(self, self._walk.stop)
        self._walk.follow(_flat(batches), ahead)

    def close(self) -> None:
        """Stop, and wait for the reads in flight (a store gone: until the client's retries give up)."""
        if self._walk is not None and self._pid == os.getpid():
            self._walk.stop()
            for thread in list(self._walk.threads):
                thread.join()


class _Walk:
    """The threads and where they are in the plan."""

    def __init__(self, dataset, depth: int, row: int):
        self.dataset, self.depth, self.row_index = dataset, depth, row
        self.changed = threading.Condition()
        self.plan, self.cursor, self.ahead = [], 0, None
        self.pass_no, self.boundary = 0, 0  # the pass the plan is, and where the next one's items start in it
        self.stopped, self.polling = False, False
        self.reading = 0
        self.counting = threading.Lock()
        self.pending = [0, 0]  # items and bytes read for the next pass, counted once it begins
        self.threads: list[threading.Thread] = []

    def follow(self, plan: list[int], ahead) -> None:
        plan = self._missing(plan)  # what is cached already takes no thread's turn
        with self.changed:
            self.plan, self.cursor, self.ahead = plan, 0, ahead
            self.pass_no += 1
            self.boundary = len(plan)
            if self.dataset.overflow is not None:
                self.dataset.overflow.begin(self.pass_no)
            with self.counting:
                self._add(*self.pending)
                self.pending = [0, 0]
            self.changed.notify_all()
            if not self.threads and not self.stopped:
                for _ in range(min(self.depth, FIRST_THREADS)):
                    self._start_thread()

    def _missing(self, plan: list[int]) -> list[int]:
        """Those of ``plan`` neither the cache nor a rehearsal's exemplar region holds, in their order."""
        plan, exemplars = self.dataset.cache.missing(plan), self.dataset.exemplars
        return plan if exemplars is None else [i for i, size in zip(plan, exemplars.sizes(plan)) if size is None]

    def _start_thread(self) -> None:
        thread = threading.Thread(target=self._run, name=f"coordl-lookahead-{len(self.threads)}", daemon=True)
        self.threads.append(thread)
        thread.start()

    def stop(self) -> None:
        with self.changed:
            self.stopped = True
            self.changed.notify_all()

    def _next(self) -> tuple[int, int] | None:
        """The next item to claim and the pass it is of, waiting for a plan; None once stopped."""
        with self.changed:
            while True:
                if self.stopped:
                    return None
                if self.cursor < len(self.plan):
                    self.cursor += 1
                    self.reading += 1
                    return self.plan[self.cursor - 1], self.pass_no + (self.cursor > self.boundary)
                if self.ahead is not None and not self.reading:  # the next pass's first batches, across the
                    ahead, self.ahead = self.ahead, None  # boundary, once this pass's reads are done
                    self.plan = self.plan + self._missing(_flat(ahead(max(1, self.depth))))
                    continue
                self.changed.wait()

    def _done(self, full: bool) -> None:
        with self.changed:
            self.reading -= 1
            if len(self.threads) < self.depth and not self.stopped:  # one more thread a read: a slow start
                self._start_thread()
            if not self.reading:
                self.changed.notify_all()
            if full:  # nothing more fits, and there is no overflow: the rest of this plan is the workers'
                self.cursor, self.ahead = len(self.plan), None

    def _run(self) -> None:
        while (item := self._next()) is not None:
            full = False
            try:
                full = self._read(*item)
            except Exception as e:  # the worker that needs it reads it and says what went wrong
                logger.debug("coordl look-ahead: item %d: %s", item[0], e)
            finally:
                self._done(full)

    def _read(self, index: int, pass_no: int) -> bool:
        """Claim, read and fill item ``index`` of pass ``pass_no`` (in the cache, else in the overflow); whether
        the cache is full with no overflow."""
        dataset = self.dataset
        cache, storage, key = dataset.cache, dataset.storage, dataset.source.raw_key(index)
        holds = getattr(storage, "holds", None)
        if holds is not None and holds(key):  # the workers read it from the disk tier
            return False
        read = getattr(storage, "read_past_disk", storage.read_stamped)
        size = storage.size(key)
        claim = cache.claim(index, size) if size is not None else None
        if claim is None:
            if dataset.overflow is None or size is None:
                return cache.full and dataset.overflow is None
            if cache.in_flight(index) or cache.view(index) is not None:  # (in that order: filled between looks)
                return False
            writes = getattr(storage, "takes_writes", None)
            if writes is not None and writes() and dataset.overflow.asked_before(index, pass_no):
                return False  # read in an earlier pass: the disk tier holds it, or will once its write commits
            return self._stage(index, size, key, read, pass_no)
        try:
            raw, stamp = read(key)
        except BaseException:
            cache.release(claim)
            raise
        if stamp is None or not cache.fill(claim, raw, stamp):
            cache.release(claim)
        else:
            in_memory(storage, key)
        self._count(raw, pass_no)
        return False

    def _stage(self, index: int, size: int, key: str, read, pass_no: int) -> bool:
        """Read item ``index`` into an overflow slot, once one is free (False: the cache is not the limit)."""
        overflow = self.dataset.overflow
        slot = self._slot(index, size, pass_no)
        if slot is None or slot == SKIP:
            return False
        try:
            raw, stamp = read(key)
        except BaseException:
            overflow.release(slot)
            raise
        if stamp is None or len(raw) != size:
            overflow.release(slot)
        else:
            overflow.fill(slot, raw, stamp)
        self._count(raw, pass_no)
        return False

    def _slot(self, index: int, size: int, pass_no: int) -> int | None:
        """An overflow slot claimed for the item (or SKIP), waiting while all are taken; None if the walk
        stopped or moved past the pass meanwhile."""
        overflow = self.dataset.overflow
        with self.changed:
            while True:
                if self.stopped or pass_no < self.pass_no:
                    return None
                slot = overflow.claim(index, size, pass_no)
                if slot is not None:
                    return slot
                if self.polling:
                    self.changed.wait()
                    continue
                self.polling = True
                self.changed.release()
                try:
                    time.sleep(POLL_S)
                finally:
                    self.changed.acquire()
                    self.polling = False
                self.changed.notify(max(1, overflow.free_slots()))

    def _count(self, raw: bytes, pass_no: int) -> None:
        """Count a read in the epoch it is for: one of the next pass's first batches once that pass begins (a
        pass that never begins: not at all)."""
        with self.counting:
            if pass_no > self.pass_no:
                self.pending[0] += 1
                self.pending[1] += len(raw)
            else:
                self._add(1, len(raw))

    def _add(self, items: int, nbytes: int) -> None:
        row = self.dataset.counters.table.numpy()[self.row_index]
        row[_AHEAD] += items
        row[_AHEAD_BYTES] += nbytes


def _flat(batches) -> list[int]:
    return [i for batch in batches or () for i in (batch if isinstance(batch, list) else [batch])]
