"""A batch's misses from a storage that serves many reads at once and knows each item's size before reading
it (an object store, whose manifest gives the sizes): claimed in the node's cache, read concurrently, and
waited for where another reader on the node has them in flight (see minio_cache NOTE [ Claims ]): served
from the cache then, and counted as hits and as ``waits``. Those the cache has no room for are taken from
the look-ahead's overflow where it staged them (``_fetch.overflow``), counted ``staged``, and, where a
rehearsal exemplar region wants them, put there (``_rehearsal.exemplars``).

Such a storage defines ``size(key) -> int | None`` (None: not to be cached, e.g. changed since it was listed)
and ``concurrency`` (reads in flight per process) beside
``read_stamped``. Each process reads through its own thread pool (made on first use, so a forked worker
makes its own).
"""

import concurrent.futures
import itertools
import os
import threading
import time

import numpy as np

from coordl._fetch.storage import in_memory, worth_memory
from coordl.exceptions import reading_failed

IN_FLIGHT_TIMEOUT_S = 120.0
"""Longest wait for an item another reader has in flight before reading it here too (its reader is alive
but stuck: a request the store's retries have not given up on)."""
_pools: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def reads_concurrently(storage) -> bool:
    """Whether ``storage``'s misses go through :func:`read_misses`."""
    return getattr(storage, "concurrency", 1) > 1 and callable(getattr(storage, "size", None))


def pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """This process's pool of ``workers`` reading threads."""
    pid = os.getpid()
    with _pools_lock:
        executor = _pools.get(pid)
        if executor is None:
            _pools.clear()  # a forked child's inherited pools have no threads
            executor = _pools[pid] = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="coordl-read")
        return executor


def read_misses(dataset, indices: list[int], row: np.ndarray, fields) -> list[bytes]:
    """The bytes of ``indices``, none of them cached when asked: each claimed and read here (concurrently)
    then filled, or, where another reader has it in flight, waited for, or taken from the overflow.
    ``fields``: the counter row's columns (misses, storage_bytes, storage_wait_ns, hits, cache_bytes, waits,
    wait_ns, staged)."""
    misses, storage_bytes, storage_ns, hits, cache_bytes, waits, wait_ns, staged = fields
    cache, storage, source, overflow = dataset.cache, dataset.storage, dataset.source, dataset.overflow
    exemplars = dataset.exemplars  # rehearsal members the cache has no room for (``_rehearsal.exemplars``)
    keys = [source.raw_key(index) for index in indices]
    out: list = [None] * len(indices)
    claims: dict[int, object] = {}
    to_read, in_flight = [], []
    try:
        for k, (index, key) in enumerate(zip(indices, keys)):
            size = storage.size(key) if cache is not None else None  # None: not to be cached (changed)
            claim = cache.claim(index, size) if size is not None else None
            if claim is not None:
                claims[k] = claim
            elif size is not None and cache.in_flight(index):
                in_flight.append(k)
                continue
            elif size is not None and (view := cache.view(index)) is not None:  # filled since it was looked up
                out[k] = bytes(view)
                row[hits] += 1
                row[cache_bytes] += len(view)
                continue
            to_read.append(k)
        started = time.perf_counter_ns()
        read = _reader(storage, keys, indices)
        waited_ns = 0
        if overflow is not None and cache is not None:  # what the cache had no room for, staged ahead
            unclaimed = [k for k in to_read if k not in claims]
            to_read = [k for k in to_read if k in claims]
            results = pool(storage.concurrency).map(read, to_read)  # under way while the overflow is looked at
            rest = []
            for k in unclaimed:
                taken = overflow.take(indices[k])
                if taken is None or taken[1] != storage.stamp(keys[k]):  # not staged, or changed since
                    rest.append(k)
                    continue
                out[k] = taken[0]
                if exemplars is not None:
                    exemplars.put(indices[k], taken[0], taken[1])
                row[staged] += 1
                if taken[2] > 0.001:  # waited for it to arrive
                    row[waits] += 1
                    waited_ns += int(taken[2] * 1e9)
            results = itertools.chain(results, pool(storage.concurrency).map(read, rest))
            to_read += rest
        else:
            results = pool(storage.concurrency).map(read, to_read)
        for k, (raw, stamp) in zip(to_read, results):
            out[k] = raw
            claim = claims.pop(k, None)
            if claim is not None and (stamp is None or not worth_memory(storage, keys[k])
                                      or not cache.fill(claim, raw, stamp)):
                cache.release(claim)
            elif claim is not None:
                in_memory(storage, keys[k])
            elif exemplars is not None and stamp is not None:
                exemplars.put(indices[k], raw, stamp)
        row[storage_ns] += time.perf_counter_ns() - started - waited_ns
        row[wait_ns] += waited_ns
        row[misses] += len(to_read)
        row[storage_bytes] += sum(len(out[k]) for k in to_read)
    finally:
        for claim in claims.values():  # a read failed: whoever waits for these reads them itself
            cache.release(claim)
    if in_flight:
        started = time.perf_counter_ns()
        for k in in_flight:
            view = cache.wait(indices[k], IN_FLIGHT_TIMEOUT_S)
            if view is None:  # its reader gave up or died: read it here
                out[k] = _reader(storage, keys, indices)(k)[0]
                row[misses] += 1
                row[storage_bytes] += len(out[k])
            else:
                out[k] = bytes(view)
                row[hits] += 1
                row[cache_bytes] += len(view)
        row[waits] += len(in_flight)
        row[wait_ns] += time.perf_counter_ns() - started
    return out


def _reader(storage, keys: list[str], indices: list[int]):
    def read(k: int):
        try:
            return storage.read_stamped(keys[k])
        except OSError as e:
            raise reading_failed(e, f"cannot read sample {indices[k]} ({keys[k]}): {e.strerror or e}") from e
    return read
