"""The look-ahead's staging area for what the node's cache has no room for: a bounded number of slots in
shared memory, each item in it read once, by the worker that asks for it.

NOTE [ Overflow ]
Once the cache is full, the look-ahead (``_fetch.lookahead``) goes on reading the pass's uncached items in
the sampler's order, into ``slots`` slots of ``slot_bytes`` (an item larger than that is left to the
workers). A slot is EMPTY, WRITING (a look-ahead thread reading its item), READY or TAKEN (a worker
copying it out, then EMPTY again). So the look-ahead runs at most ``slots`` uncached items ahead of the
training loop, and what it read is in memory once, until asked for.

Only the training process's look-ahead threads claim slots (one thread lock); torch's workers only take
them. A worker asking for an item first marks it ``asked`` in this pass, then looks for its slot; the
look-ahead claims a slot for an item first, then gives it up if the item was asked for. So an item is
read by one of them, except when both do so at the same instant (then both read it, and the slot is
freed at the next pass). Each claim bumps the slot's generation: a worker that finds it changed after
copying (the slot claimed again under it, when two workers took one item) reads the item itself.

Items of the next pass's first batches are staged under that pass's number; a pass's ``begin`` frees
every slot staged for an earlier one, except those being written (their writer frees them). The slots are
torch shared tensors: the workers map them (fork or spawn), and a crash leaves nothing in /dev/shm. A
plain pickle of the loader (``ddp_spawn``) makes a new area in the process that unpickles it.
"""

import threading
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch

OVERFLOW_BYTES = 64 << 20
"""Most bytes of shared memory a loader's overflow takes."""
WRITING_WAIT_S = 120.0
"""Longest a worker waits for a slot being written before reading its item itself."""
EMPTY, WRITING, READY, TAKEN = 0, 1, 2, 3
_INDEX, _PASS, _STATE, _LENGTH, _GENERATION, _STAMP = 0, 1, 2, 3, 4, 5  # a slot's row; its stamp takes 3
_FIELDS = _STAMP + 3
SKIP = -1
"""``claim``: nothing to read (too large, asked for, or staged already)."""


def overflow_for(sizes, depth: int, cache) -> "Overflow | None":
    """The overflow of a look-ahead ``depth`` deep over items of ``sizes`` when ``cache`` cannot hold them all:
    ``2 * depth`` slots, of the largest item's size, within :data:`OVERFLOW_BYTES`; None when they all fit."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if cache is None or depth <= 0 or not len(sizes) or int(sizes.sum()) <= cache.capacity_bytes:
        return None
    slots = 2 * depth
    return Overflow(len(sizes), slots, max(1, min(int(sizes.max()), OVERFLOW_BYTES // slots)))


class Overflow:
    """``slots`` slots of ``slot_bytes`` for items ``0..n_items-1``; see NOTE [ Overflow ]."""

    def __init__(self, n_items: int, slots: int, slot_bytes: int, tensors=None):
        self.n_items, self.slots, self.slot_bytes = n_items, slots, slot_bytes
        if tensors is None:
            tensors = (torch.zeros((slots, slot_bytes), dtype=torch.uint8), torch.zeros((slots, _FIELDS), dtype=torch.int64),
                       torch.zeros(n_items, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
            tensors = tuple(t.share_memory_() for t in tensors)
        self.tensors = tensors
        self._np = None
        self._claiming = threading.Lock()

    def __reduce__(self):
        return Overflow, (self.n_items, self.slots, self.slot_bytes)

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if self._np is None:
            self._np = tuple(t.numpy() for t in self.tensors)
        return self._np

    # -- the look-ahead's side (the training process) -----------------------------------------

    def begin(self, pass_no: int) -> None:
        """Pass ``pass_no`` (from 1) starts: free the slots of earlier passes not being written."""
        _, meta, _, passes = self._arrays()
        with self._claiming:
            passes[0] = pass_no
            stale = (meta[:, _PASS] < pass_no) & (meta[:, _STATE] != WRITING)
            meta[stale, _STATE] = EMPTY

    def claim(self, index: int, size: int, pass_no: int) -> int | None:
        """A slot for item ``index`` of pass ``pass_no``, marked WRITING; :data:`SKIP` if there is nothing to read;
        None if every slot is taken (try again later)."""
        _, meta, asked, _ = self._arrays()
        if size > self.slot_bytes or asked[index] >= pass_no:
            return SKIP
        with self._claiming:
            mine = (meta[:, _INDEX] == index) & (meta[:, _PASS] == pass_no)
            if (mine & ((meta[:, _STATE] == WRITING) | (meta[:, _STATE] == READY))).any():
                return SKIP
            free = np.flatnonzero(meta[:, _STATE] == EMPTY)
            if not len(free):
                return None
            slot = int(free[0])
            meta[slot, _GENERATION] += 1
            meta[slot, _INDEX], meta[slot, _PASS], meta[slot, _STATE] = index, pass_no, WRITING
        if asked[index] >= pass_no:  # a worker asked for it meanwhile (see the NOTE)
            meta[slot, _STATE] = EMPTY
            return SKIP
        return slot

    def fill(self, slot: int, data, stamp) -> None:
        """Publish the bytes of the item claimed in ``slot`` (its stamp: the version read)."""
        data_, meta, _, passes = self._arrays()
        data_[slot, :len(data)] = np.frombuffer(data, dtype=np.uint8)
        meta[slot, _LENGTH] = len(data)
        meta[slot, _STAMP:_STAMP + 3] = stamp
        meta[slot, _STATE] = READY if meta[slot, _PASS] >= passes[0] else EMPTY  # a pass gone by: nobody asks

    def release(self, slot: int) -> None:
        """Give up a claimed slot unfilled (its read failed: the worker reads the item)."""
        self._arrays()[1][slot, _STATE] = EMPTY

    def asked_before(self, index: int, pass_no: int) -> bool:
        """Whether a worker asked for item ``index`` in a pass before ``pass_no``."""
        return 0 < int(self._arrays()[2][index]) < pass_no

    def free_slots(self) -> int:
        return int((self._arrays()[1][:, _STATE] == EMPTY).sum())

    # -- the workers' side ---------------------------------------------------------------------

    def take(self, index: int, timeout_s: float = WRITING_WAIT_S) -> tuple[bytes, tuple, float] | None:
        """Item ``index``'s bytes, stamp and the seconds waited for them, taken out of its slot (waiting while
        it is being written); None if it is not staged: read it."""
        data, meta, asked, passes = self._arrays()
        asked[index] = max(int(asked[index]), int(passes[0]))
        deadline, delay, started = time.monotonic() + timeout_s, 0.0002, time.perf_counter()
        while True:
            candidates = np.flatnonzero(meta[:, _INDEX] == index)
            states = meta[candidates, _STATE]
            ready = candidates[states == READY]
            if len(ready):
                slot = int(ready[np.argmin(meta[ready, _PASS])])  # this pass's, before the next one's
                generation = int(meta[slot, _GENERATION])
                meta[slot, _STATE] = TAKEN
                raw, stamp = bytes(data[slot, :int(meta[slot, _LENGTH])]), tuple(int(v) for v in meta[slot, _STAMP:])
                if int(meta[slot, _GENERATION]) != generation:  # claimed again under the copy
                    return None
                meta[slot, _STATE] = EMPTY
                return raw, stamp, time.perf_counter() - started
            if not (states == WRITING).any() or time.monotonic() >= deadline:
                return None
            time.sleep(delay)
            delay = min(delay * 2, 0.001)


def _shared(n_items: int, slots: int, slot_bytes: int, tensors) -> Overflow:
    return Overflow(n_items, slots, slot_bytes, tensors)


# torch's workers (spawn, forkserver) unpickle the same slots; a plain pickle makes new ones (see the NOTE)
ForkingPickler.register(Overflow, lambda o: (_shared, (o.n_items, o.slots, o.slot_bytes, o.tensors)))
