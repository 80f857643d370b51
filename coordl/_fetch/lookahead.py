"""The look-ahead: each pass's items read in the sampler's order into the node's cache, ahead of the
training loop, from a storage whose reads are slow one by one but many can be in flight (an object store).

NOTE [ Look-ahead ]
The training process knows each pass's whole plan when it starts (the ledger's ``begin``), and the next
pass's first batches before this one ends (``plan_ahead``, NOTE [ Planning ahead ] in ``batch_sampler``).
``depth`` threads walk that order, each claiming the next item not yet cached or in flight (minio_cache NOTE
[ Claims ]), reading it and filling the claim; torch's workers, asked for the item later, find it cached
or wait for it in flight (``concurrent_misses``), so no item is read twice on the node. The look-ahead
stops claiming once the cache is full, for the rest of the pass: items beyond the cache are read by the
workers, a batch's misses at once.

Its threads hold this state, not the loader, so a dropped loader stops them (``weakref.finalize``). A
fork (torch starting the next epoch's workers while they read) waits for their requests in flight
(``_objects.client`` NOTE [ Object store client ]).
"""

import logging
import os
import threading
import weakref

from coordl._fetch.cached_dataset import COUNTER_FIELDS, CachedDataset
from coordl._fetch.concurrent_misses import reads_concurrently

logger = logging.getLogger(__name__)
_AHEAD, _AHEAD_BYTES = COUNTER_FIELDS.index("ahead"), COUNTER_FIELDS.index("ahead_bytes")


def lookahead_of(dataset) -> "LookAhead | None":
    """The look-ahead of a loader over ``dataset`` (the loader's): where it caches, alone on its server (no
    peers), from a storage that reads concurrently and asks for one (``storage.lookahead`` > 0)."""
    if not isinstance(dataset, CachedDataset) or dataset.cache is None or dataset.peers is not None:
        return None
    storage = dataset.storage
    if not reads_concurrently(storage) or getattr(storage, "lookahead", 0) <= 0:
        return None
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
            for thread in self._walk.threads:
                thread.join()


class _Walk:
    """The threads and where they are in the plan."""

    def __init__(self, dataset, depth: int, row: int):
        self.dataset, self.depth, self.row_index = dataset, depth, row
        self.changed = threading.Condition()
        self.plan, self.cursor, self.ahead = [], 0, None
        self.stopped = False
        self.reading = 0
        self.counting = threading.Lock()
        self.threads: list[threading.Thread] = []

    def follow(self, plan: list[int], ahead) -> None:
        with self.changed:
            self.plan, self.cursor, self.ahead = plan, 0, ahead
            self.changed.notify_all()
            if not self.threads and not self.stopped:
                self.threads = [threading.Thread(target=self._run, name=f"coordl-lookahead-{k}", daemon=True)
                                for k in range(self.depth)]
                for thread in self.threads:
                    thread.start()

    def stop(self) -> None:
        with self.changed:
            self.stopped = True
            self.changed.notify_all()

    def _next(self) -> int | None:
        """The next item to claim, waiting for a plan; None once stopped."""
        with self.changed:
            while True:
                if self.stopped:
                    return None
                if self.cursor < len(self.plan):
                    self.cursor += 1
                    self.reading += 1
                    return self.plan[self.cursor - 1]
                if self.ahead is not None:  # the next pass's first batches, across the boundary
                    ahead, self.ahead = self.ahead, None
                    self.plan = self.plan + _flat(ahead(max(1, self.depth)))
                    continue
                self.changed.wait()

    def _done(self, full: bool) -> None:
        with self.changed:
            self.reading -= 1
            if full:  # nothing more fits: the rest of this plan is the workers'
                self.cursor, self.ahead = len(self.plan), None
            self.changed.notify_all()

    def _run(self) -> None:
        while (index := self._next()) is not None:
            full = False
            try:
                full = self._read(index)
            except Exception as e:  # the worker that needs it reads it and says what went wrong
                logger.debug("coordl look-ahead: item %d: %s", index, e)
            finally:
                self._done(full)

    def _read(self, index: int) -> bool:
        """Claim, read and fill item ``index``; whether the cache is full."""
        dataset = self.dataset
        cache, storage, key = dataset.cache, dataset.storage, dataset.source.raw_key(index)
        size = storage.size(key)
        claim = cache.claim(index, size) if size is not None else None
        if claim is None:
            return cache.full
        try:
            raw, stamp = storage.read_stamped(key)
        except BaseException:
            cache.release(claim)
            raise
        if stamp is None or not cache.fill(claim, raw, stamp):
            cache.release(claim)
        with self.counting:
            row = dataset.counters.table.numpy()[self.row_index]
            row[_AHEAD] += 1
            row[_AHEAD_BYTES] += len(raw)
        return False


def _flat(batches) -> list[int]:
    return [i for batch in batches or () for i in (batch if isinstance(batch, list) else [batch])]
