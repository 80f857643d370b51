"""SIGKILL at any moment never deadlocks or corrupts other users, and nothing is left in /dev/shm."""

import os
import secrets
import signal
import time

import pytest
import torchvision

import coordl
from coordl._cache.minio import MinIOCache, cache_segment_name, list_caches
from tests import _procs
from tests._signals import FileEvent


def _wait_for(predicate, timeout=_procs.JOIN_TIMEOUT, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _progress(path) -> int:
    try:
        with open(path) as f:
            return int(f.read() or 0)
    except (OSError, ValueError):
        return 0


def _kill_group(proc):
    os.killpg(proc.pid, signal.SIGKILL)
    proc.join(10)
    assert proc.exitcode == -signal.SIGKILL


def _caches_of(root):
    """Caches of the dataset under ``root`` (other tests may run at the same time)."""
    return [c for c in list_caches() if c.label.endswith(f" in {root}")]


def _files(root):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


@pytest.mark.slow
def test_job_killed_mid_fill_then_a_new_job_works_and_nothing_is_left(fresh_image_root, tmp_path):
    progress = str(tmp_path / "progress")
    job = _procs.spawn(_procs.iterate_slowly_forever, fresh_image_root, 10**9, 2, progress)
    _wait_for(lambda: _progress(progress) >= 3, what="the job to start filling")
    _kill_group(job)  # the job and its workers, mid-epoch, mid-fill
    # SIGKILL is asynchronous: give the kernel a moment to finish tearing the workers down.
    _wait_for(lambda: all(c.users_alive == 0 for c in _caches_of(fresh_image_root)), timeout=10,
              what="the killed processes to be gone")
    stale = _caches_of(fresh_image_root)
    assert len(stale) == 1 and 0 < stale[0].items_cached < stale[0].n_items

    files = _files(fresh_image_root)
    dataset = torchvision.datasets.ImageFolder(fresh_image_root)
    expected = {path: open(path, "rb").read() for path in files}
    with coordl.DataLoader(dataset, batch_size=4, shuffle=True, num_workers=2, cache_bytes=10**9,
                           collate_fn=lambda items: [(img.size, t) for img, t in items]) as loader:
        assert loader.dataset.cache.name == stale[0].name  # the dead job's cache is reclaimed and reused
        for _ in range(2):
            seen = [item for batch in loader for item in batch]
            assert len(seen) == len(files)
        cache = loader.dataset.cache
        assert all(cache.get(i) == expected[path] for i, (path, _) in enumerate(dataset.samples))
        epochs = loader.stats().epochs
        assert epochs[0].hits >= stale[0].items_cached and epochs[1].hits == len(files)
    assert _caches_of(fresh_image_root) == []


@pytest.mark.slow
def test_main_process_killed_its_workers_remove_the_cache(fresh_image_root, tmp_path):
    progress = str(tmp_path / "progress")
    job = _procs.spawn(_procs.iterate_slowly_forever, fresh_image_root, 10**9, 2, progress)
    _wait_for(lambda: _progress(progress) >= 2, what="the job to start filling")
    assert len(_caches_of(fresh_image_root)) == 1
    os.kill(job.pid, signal.SIGKILL)  # only the main process: its workers notice and exit cleanly
    job.join(10)
    _wait_for(lambda: not _caches_of(fresh_image_root), timeout=30, what="the orphaned workers to remove the cache")


@pytest.mark.slow
def test_writers_killed_mid_insert_leave_every_cached_item_intact(tmp_path):
    """Two writers fill a cache together; each stops mid-insert (its slot reserved and marked, its bytes
    not yet copied, the lock released) after a different number of inserts, and both are SIGKILLed there."""
    n_items, item_bytes = 1000, 512 << 10
    capacity = (n_items + 4) * item_bytes  # a kill between reserving and marking leaks one item
    for round_, pause_after in enumerate([(0, 3), (40, 7), (150, 300)]):  # a fresh cache each round
        name = cache_segment_name(secrets.token_hex(6))
        survivor = MinIOCache(name, n_items=n_items, capacity_bytes=capacity, fingerprint=bytes(32),
                              label="test")
        try:
            survivor.stats()
            started, paused = ([FileEvent(tmp_path) for _ in range(2)] for _ in range(2))
            go = FileEvent(tmp_path)
            writers = [_procs.spawn(_procs.hammer_puts, name, n_items, item_bytes, capacity, 10 * round_ + k,
                                    started[k], go, pause_after[k], paused[k]) for k in range(2)]
            assert all(ev.wait(_procs.JOIN_TIMEOUT) for ev in started)
            go.set()  # both writers start together, so both are mid-fill when killed
            assert all(ev.wait(_procs.JOIN_TIMEOUT) for ev in paused), "a writer never reached its pause"
            for w in writers:
                os.kill(w.pid, signal.SIGKILL)
            for w in writers:
                w.join(10)
            status = survivor._views.status
            assert int((status < 0).sum()) == 2  # each left one slot mid-insert
            assert int((status == 1).sum()) == sum(pause_after)  # every insert before the pauses completed
            for i in range(n_items):
                got = survivor.get(i)
                assert got is None or got == _procs.item_payload(i, item_bytes), f"item {i} corrupt"
            for i in range(n_items):  # every slot, abandoned ones included, can still be filled and read
                survivor.put(i, _procs.item_payload(i, item_bytes))
                assert survivor.get(i) == _procs.item_payload(i, item_bytes)
            assert survivor.stats().items_cached == n_items
        finally:
            survivor.close()


def test_a_process_killed_holding_the_lock_blocks_nobody(tmp_path):
    name = cache_segment_name(secrets.token_hex(6))
    cache = MinIOCache(name, n_items=4, capacity_bytes=4096, fingerprint=bytes(32), label="test")
    cache.stats()
    locked = FileEvent(tmp_path)
    proc = _procs.spawn(_procs.hold_lock_then_die, name, 4, 4096, locked)
    assert locked.wait(_procs.JOIN_TIMEOUT)
    proc.join(10)
    assert proc.exitcode == -signal.SIGKILL
    started = time.monotonic()
    assert cache.put(0, b"after the crash") and cache.get(0) == b"after the crash"
    assert time.monotonic() - started < 1
    cache.close()
