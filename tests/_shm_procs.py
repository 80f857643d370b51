"""Process targets for the shared-memory core's tests (module level: picklable under spawn).

Also runnable as ``python -m tests._shm_procs FUNCTION ARGS...`` for jobs started in other namespaces.
"""

import multiprocessing as mp
import os
import signal
import sys
import threading
import time

from tests._procs import JOIN_TIMEOUT, item_payload

FINGERPRINT = bytes(range(32))


def _cache(name: str, n_items: int = 8, capacity: int = 1 << 16):
    from coordl._cache.minio import MinIOCache
    return MinIOCache(name, n_items=n_items, capacity_bytes=capacity, fingerprint=FINGERPRINT, label="shm-core test")


def threads_put_everything(name: str, n_items: int, capacity: int, seed: int, threads: int, barrier) -> None:
    """``threads`` threads of this process insert every item (index-specific bytes of varying sizes) in
    their own random order, together with the other processes at ``barrier``."""
    import random
    cache = _cache(name, n_items, capacity)
    cache.stats()

    def put_all(k: int) -> None:
        for i in random.Random(seed * 100 + k).sample(range(n_items), n_items):
            cache.put(i, item_payload(i, 400 + 4 * (i % 50)))

    workers = [threading.Thread(target=put_all, args=(k,)) for k in range(threads)]
    barrier.wait(JOIN_TIMEOUT)
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    barrier.wait(JOIN_TIMEOUT)  # everyone has written: now check, then leave together
    bad = [i for i in range(n_items) if cache.get(i) is not None and cache.get(i) != item_payload(i, 400 + 4 * (i % 50))]
    assert not bad, f"items holding another item's bytes: {bad[:10]}"
    barrier.wait(JOIN_TIMEOUT)
    cache.close()


def _sleep_forever() -> None:
    while True:
        time.sleep(1)


def map_staged_then_fork(name: str, mapped) -> None:
    """Map staged segment ``name`` as a consumer does (claimed, then a private mapping; the segment itself
    closed), fork a child that inherits the mapping, put ``(pid, child pid)`` on ``mapped``, then sleep."""
    from coordl._core.shm import open_unlocked
    segment = open_unlocked(name)
    mapping = segment.private_map(0, segment.size)
    segment.close()
    child = os.fork()
    if child == 0:
        _sleep_forever()
    mapped.put((os.getpid(), child))
    del mapping  # the parent lets go of its mapping; the child keeps its copy
    _sleep_forever()


def fork_then_die_holding_locks(cache_name: str, group: str, locked) -> None:
    """Attach a cache and a group, fork a long-lived child (as DataLoader workers are forked), take both
    mutexes, then die by SIGKILL while holding them. The child lives on (the test kills it)."""
    from coordl._group.membership import HPGroup
    cache = _cache(cache_name)
    cache.stats()
    member = HPGroup(group, config={"batch_size": "4"}, n_batches=3, seed=1, staging_bytes=1 << 20)
    member.join()
    child = mp.get_context("fork").Process(target=_sleep_forever, daemon=False)
    child.start()
    cache._segment.lock()
    member._segment.lock()
    locked.put(child.pid)
    os.kill(os.getpid(), signal.SIGKILL)


def hold_locks_then_stop(cache_name: str, group: str, locked) -> None:
    """Attach a cache and a group, take both mutexes, then stop (SIGSTOP) while holding them."""
    from coordl._group.membership import HPGroup
    cache = _cache(cache_name)
    cache.stats()
    member = HPGroup(group, config={"batch_size": "4"}, n_batches=3, seed=1, staging_bytes=1 << 20)
    member.join()
    cache._segment.lock()
    member._segment.lock()
    locked.set()
    os.kill(os.getpid(), signal.SIGSTOP)
    _sleep_forever()


def share_until_released(folder: str, tag: str, cache_name: str, group: str) -> None:
    """A job (possibly in its own PID namespace): attach a cache and a group, write ``<tag>.ready``
    with what it sees (users of the cache, live members of the group), wait for ``<tag>.go``, write
    what it sees then, and leave."""
    from coordl._group.membership import HPGroup
    cache = _cache(cache_name)
    cache.put(0, b"x" * 100)
    member = HPGroup(group, config={"batch_size": "4"}, n_batches=3, seed=1, staging_bytes=1 << 20)
    member.join()

    def report(path: str) -> None:
        with open(f"{path}.tmp", "w") as f:
            f.write(f"{cache.stats().users_alive} {member.stats().members_alive} {cache.get(0) == b'x' * 100}")
        os.rename(f"{path}.tmp", path)

    report(os.path.join(folder, f"{tag}.ready"))
    deadline = time.monotonic() + JOIN_TIMEOUT
    while not os.path.exists(os.path.join(folder, f"{tag}.go")):
        assert time.monotonic() < deadline, "never released"
        time.sleep(0.01)
    report(os.path.join(folder, f"{tag}.done"))
    member.close()
    cache.close()


def create_then_die_mid_creation(cache_name: str) -> None:
    """Start creating a cache and die by SIGKILL after allocating it, before publishing it."""
    cache = _cache(cache_name)

    def die(buf) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    cache._initialize = die
    cache.stats()


def attach_and_die(cache_name: str, done) -> None:
    """Attach a cache (of ``FINGERPRINT``), put one item, say so, and die by SIGKILL."""
    cache = _cache(cache_name)
    cache.put(0, b"y" * 10)
    done.set()
    os.kill(os.getpid(), signal.SIGKILL)


def attach_other_dataset(cache_name: str, done) -> None:
    """Attach another dataset's cache (which reclaims dead ones), say so, close."""
    from coordl._cache.minio import MinIOCache
    cache = MinIOCache(cache_name, n_items=3, capacity_bytes=4096, fingerprint=bytes(32), label="other")
    cache.stats()
    done.set()
    cache.close()


def put_pausing_around_the_copy(cache_name: str, n_items: int, at_copy, go_copy, copied, go_publish) -> None:
    """Put items ``0..n_items-1`` (``item_payload(i, 64)``, stamp ``(i, i, 64)``); the last one's insert stops
    before its bytes are copied (sets ``at_copy``, waits for ``go_copy``) and after (``copied``,
    ``go_publish``)."""
    cache = _cache(cache_name, n_items)
    for i in range(n_items - 1):
        cache.put(i, item_payload(i, 64), (i, i, 64))
    write = cache._write

    def write_paused(*args) -> None:
        at_copy.set()
        assert go_copy.wait(JOIN_TIMEOUT), "the test never let the copy start"
        write(*args)
        copied.set()
        assert go_publish.wait(JOIN_TIMEOUT), "the test never let the item be published"

    cache._write = write_paused
    last = n_items - 1
    assert cache.put(last, item_payload(last, 64), (last, last, 64))
    cache.close()


def claim_and_hold(cache_name: str, n_items: int, index: int, size: int, claimed, then: str, go) -> None:
    """Claim item ``index`` for ``size`` bytes, set ``claimed``, wait for ``go``; ``then``: ``"fill"`` it with
    ``item_payload(index, size)``, ``"release"`` it, or ``"hang"`` (wait to be killed)."""
    cache = _cache(cache_name, n_items)
    claim = cache.claim(index, size)
    assert claim is not None
    claimed.set()
    assert go.wait(JOIN_TIMEOUT), "the test never let the claim go on"
    if then == "fill":
        assert cache.fill(claim, item_payload(index, size), (index, index, size))
    elif then == "release":
        cache.release(claim)
    else:
        _sleep_forever()
    cache.close()


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
