"""Module-level process targets for multi-process tests (picklable under spawn) and a runner."""

import faulthandler
import multiprocessing as mp
import os
import random
import signal
import sys
import time

JOIN_TIMEOUT = 60
"""Seconds a test process may run. Generous: CI machines are small and shared."""


def spawn(target, *args) -> mp.Process:
    """Start ``target(*args)`` in a fresh interpreter (spawn), as an independent job would be."""
    proc = mp.get_context("spawn").Process(target=target, args=args)
    proc.start()
    return proc


def join_ok(*procs: mp.Process, timeout: float = JOIN_TIMEOUT) -> None:
    """Join every process; on a hang dump its stacks (SIGUSR1 -> faulthandler) before killing it."""
    for proc in procs:
        proc.join(timeout)
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(1)
            proc.kill()
            proc.join()
            raise AssertionError(f"process {proc.pid} hung (stacks dumped to stderr)")
        assert proc.exitcode == 0, f"process {proc.pid} exited with {proc.exitcode}"


def _debuggable() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def run_loader_epochs(root: str, cache_bytes: int, epochs: int, num_workers: int, results, start_event,
                      release_event):
    """A job: wait for ``start_event``, run ``epochs`` epochs over ImageFolder(root), report its stats,
    and keep its loader (and so the cache) until ``release_event``."""
    _debuggable()
    import torchvision
    import coordl
    start_event.wait(JOIN_TIMEOUT)
    loader = coordl.DataLoader(torchvision.datasets.ImageFolder(root), batch_size=8, shuffle=True,
                               num_workers=num_workers, cache_bytes=cache_bytes, collate_fn=list)
    for _ in range(epochs):
        for _ in loader:
            pass
    stats = loader.stats()
    results.put((os.getpid(), loader.dataset.cache.name, [(e.hits, e.misses) for e in stats.epochs],
                 stats.cache.items_cached))
    release_event.wait(JOIN_TIMEOUT)
    loader.close()


def iterate_slowly_forever(root: str, cache_bytes: int, num_workers: int, progress_file: str):
    """A job that fills the cache slowly and reports batches done, until it is killed."""
    _debuggable()
    os.setsid()  # its own process group, so the test can SIGKILL it together with its workers
    import torchvision
    import coordl
    loader = coordl.DataLoader(torchvision.datasets.ImageFolder(root), batch_size=4, shuffle=True,
                               num_workers=num_workers, cache_bytes=cache_bytes, collate_fn=list,
                               persistent_workers=num_workers > 0)
    done = 0
    while True:
        for _ in loader:
            done += 1
            with open(progress_file, "w") as f:
                f.write(str(done))
            time.sleep(0.05)


def hammer_puts(name: str, n_items: int, item_bytes: int, capacity: int, seed: int, started, go):
    """Once ``go`` is set, insert every item (content derived from its index) in a random order,
    forever, until killed."""
    from coordl.minio_cache import MinIOCache
    cache = MinIOCache(name, n_items=n_items, capacity_bytes=capacity, fingerprint=bytes(32), label="test")
    cache.stats()
    started.set()
    go.wait(JOIN_TIMEOUT)
    rng = random.Random(seed)
    while True:
        for i in rng.sample(range(n_items), n_items):
            cache.put(i, item_payload(i, item_bytes))


def item_payload(index: int, size: int) -> bytes:
    """Deterministic, index-specific content of ``size`` bytes."""
    return index.to_bytes(4, "little") * (size // 4)


def put_all_and_report(name: str, n_items: int, capacity: int, seed: int, results, barrier):
    """Together with the others at ``barrier``: insert every item once in a random order, check
    every item's content, and report how many inserts this process won."""
    from coordl.minio_cache import MinIOCache
    cache = MinIOCache(name, n_items=n_items, capacity_bytes=capacity, fingerprint=bytes(32), label="test")
    cache.stats()
    order = random.Random(seed).sample(range(n_items), n_items)
    barrier.wait(JOIN_TIMEOUT)
    won = sum(cache.put(i, item_payload(i, 1000 + i)) for i in order)
    barrier.wait(JOIN_TIMEOUT)
    assert all(cache.get(i) == item_payload(i, 1000 + i) for i in range(n_items))
    results.put(won)
    barrier.wait(JOIN_TIMEOUT)
    cache.close()


def hold_lock_then_die(name: str, n_items: int, capacity: int, locked_event):
    """Take the cache's lock and die with SIGKILL while holding it."""
    from coordl.minio_cache import MinIOCache
    cache = MinIOCache(name, n_items=n_items, capacity_bytes=capacity, fingerprint=bytes(32), label="test")
    cache.stats()
    with cache._segment.locked():
        locked_event.set()
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    sys.exit("not a script")
