"""The MinIO cache: exact hit accounting, concurrent fill, sharing across jobs, capacity checks."""

import contextlib
import os
import secrets

import pytest
import torchvision

import coordl
from coordl._cache import minio as minio_cache
from coordl._cache.minio import MinIOCache, cache_segment_name, list_caches
from coordl._core.shm import segment_path
from tests import _procs, _shm_procs
from tests._signals import FileBarrier, FileEvent, FileQueue
from tests.conftest import dataset_bytes


def _name() -> str:
    return cache_segment_name(secrets.token_hex(6))


def _files(root):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.35, 0.5, 0.65])
def test_later_epochs_hit_exactly_the_cached_items_and_read_the_rest(image_root, fraction):
    files = _files(image_root)
    sizes = {f: os.path.getsize(f) for f in files}
    dataset = coordl.FileDataset(files, targets=list(range(len(files))), decode=len)
    with coordl.DataLoader(dataset, batch_size=8, shuffle=True, num_workers=2,
                           cache_bytes=int(fraction * sum(sizes.values()))) as loader:
        for _ in range(4):
            for _ in loader:
                pass
        stats = loader.stats()
    cached = stats.cache.items_cached
    assert 0 < cached < len(files) and stats.cache.frozen
    assert stats.cache.bytes_cached <= stats.cache.capacity_bytes
    first, *later = stats.epochs
    assert (first.hits, first.misses, first.storage_bytes) == (0, len(files), sum(sizes.values()))
    for epoch in later:
        assert epoch.hits == cached and epoch.misses == len(files) - cached
        assert epoch.cache_bytes == stats.cache.bytes_cached
        assert epoch.storage_bytes == sum(sizes.values()) - stats.cache.bytes_cached
        assert epoch.samples == len(files)


@pytest.mark.slow
def test_workers_fill_one_cache_concurrently_with_every_item_intact(image_root):
    files = _files(image_root)
    dataset = coordl.FileDataset(files, decode="bytes")
    with coordl.DataLoader(dataset, batch_size=4, shuffle=True, num_workers=4, cache_bytes="1GiB") as loader:
        for _ in loader:
            pass
        cache = loader.dataset.cache
        assert cache.stats().items_cached == len(files)
        for i, path in enumerate(files):
            with open(path, "rb") as f:
                assert cache.get(i) == f.read()
        second = [bytes(b) for batch in loader for b in batch]
    assert loader.stats().epochs[1].hits == len(files) and loader.stats().epochs[1].misses == 0
    assert len(second) == len(files)


def test_an_item_is_a_miss_to_other_processes_until_its_bytes_and_stamp_are_written(tmp_path):
    """The publish order (NOTE [ Concurrency and crashes ]), forced: a writer in another process is held
    before and after copying its last item; a reader here must see a miss both times, one item at a time and
    in a batch read, and may not write the item itself; once published it reads the writer's bytes."""
    name, n_items = _name(), minio_cache.VIEWS_AT_ONCE + 2
    at_copy, go_copy, copied, go_publish = (FileEvent(tmp_path) for _ in range(4))
    with MinIOCache(name, n_items=n_items, capacity_bytes=1 << 16, fingerprint=_shm_procs.FINGERPRINT,
                    label="shm-core test") as cache:
        writer = _procs.spawn(_shm_procs.put_pausing_around_the_copy, name, n_items, at_copy, go_copy, copied,
                              go_publish)
        last, everything = n_items - 1, list(range(n_items))
        try:
            for held, release in ((at_copy, go_copy), (copied, go_publish)):
                assert held.wait(_procs.JOIN_TIMEOUT), "the writer never reached its pause"
                assert cache.get(last) is None and cache.view(last) is None
                batch = cache.views(everything)
                assert batch[last] is None
                assert [bytes(view) for view, _ in batch[:last]] == [_procs.item_payload(i, 64) for i in range(last)]
                assert not cache.put(last, b"another writer's bytes")  # being written by a live process
                release.set()
        finally:
            go_copy.set(), go_publish.set()
            _procs.join_ok(writer)
        assert cache.get(last) == _procs.item_payload(last, 64) and cache.stamp(last) == (last, last, 64)
        assert cache.views(everything)[last][1] == (last, last, 64)

@pytest.mark.slow
def test_concurrent_inserters_each_item_inserted_once(tmp_path):
    name, n_items = _name(), 300
    results, barrier = FileQueue(tmp_path), FileBarrier(tmp_path, 4)
    procs = [_procs.spawn(_procs.put_all_and_report, name, n_items, 10**6, seed, results, barrier) for seed in range(4)]
    _procs.join_ok(*procs)
    assert sum(results.get(timeout=5) for _ in procs) == n_items
    assert not os.path.exists(segment_path(name))  # the last user removed it


def test_full_cache_freezes_and_inserts_nothing_more():
    with MinIOCache(_name(), n_items=10, capacity_bytes=250, fingerprint=bytes(32)) as cache:
        assert [cache.put(i, bytes([i]) * 100) for i in range(4)] == [True, True, False, False]
        assert cache.stats().frozen and cache.stats().items_cached == 2
        assert cache.get(1) == bytes([1]) * 100 and cache.get(2) is None


def test_a_view_is_the_cached_bytes_read_only_without_a_copy():
    with MinIOCache(_name(), n_items=3, capacity_bytes=1 << 20, fingerprint=bytes(32)) as cache:
        cache.put(0, b"jpeg bytes")
        view = cache.view(0)
        assert isinstance(view, memoryview) and view.readonly and view == cache.get(0) == b"jpeg bytes"
        assert cache.view(1) is None
        with pytest.raises(TypeError):
            view[0] = 0
        del view


def test_a_batchs_views_are_each_items_view_and_stamp_and_none_for_a_miss():
    with MinIOCache(_name(), n_items=5, capacity_bytes=1 << 20, fingerprint=bytes(32)) as cache:
        cache.put(0, b"first", (11, 12, 5))
        cache.put(2, b"the third item")
        cache.put(4, b"")
        batch = [2, 1, 0, 0, 3, 4]
        assert len(batch) >= minio_cache.VIEWS_AT_ONCE  # read at once; a few items are read one by one
        found = cache.views(batch)
        one_by_one = [f for i in batch for f in cache.views([i])]
        for items in (found, one_by_one, cache.views(batch[:2]) + cache.views(batch[2:])):
            assert [None if f is None else (bytes(f[0]), f[1]) for f in items] == [
                (b"the third item", (0, 0, 14)), None, (b"first", (11, 12, 5)), (b"first", (11, 12, 5)), None,
                (b"", (0, 0, 0))]
        for k, index in ((0, 2), (2, 0), (5, 4)):
            view, stamp = found[k]
            assert view.readonly and view == cache.view(index) and stamp == cache.stamp(index)
        assert cache.views([]) == []
        del found, one_by_one, items, view


def _descriptors_on(inode: tuple[int, int]) -> int:
    """This process's open descriptors on the file ``(st_dev, st_ino)`` (also once it is removed)."""
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # listdir's own descriptor is gone by now
            st = os.stat(f"/proc/self/fd/{fd}")
            found += (st.st_dev, st.st_ino) == inode
    return found


def test_a_view_held_past_close_keeps_its_bytes_and_the_last_view_unmaps_them():
    """close() with a view still held: the segment is removed and its descriptors closed as always; the
    mapping (and mmap's own descriptor) stays until the view goes, and the bytes stay what they were."""
    cache = MinIOCache(_name(), n_items=2, capacity_bytes=1 << 20, fingerprint=bytes(32))
    cache.put(1, b"x" * 5000)
    path = segment_path(cache.name)
    inode = (os.stat(path).st_dev, os.stat(path).st_ino)
    view = cache.view(1)
    assert _descriptors_on(inode) >= 2  # the segment's own and mmap's
    cache.close()
    assert not os.path.exists(path)  # the last user out removed it
    assert _descriptors_on(inode) == 1  # mmap's, held by the view
    assert view == b"x" * 5000
    del view
    assert _descriptors_on(inode) == 0


@pytest.mark.slow
def test_two_independent_jobs_share_one_cache(tmp_path, image_root):
    results, go_a, go_b, release = FileQueue(tmp_path), FileEvent(tmp_path), FileEvent(tmp_path), FileEvent(tmp_path)
    size = dataset_bytes(image_root)
    job_a = _procs.spawn(_procs.run_loader_epochs, image_root, size, 1, 2, results, go_a, release)
    job_b = _procs.spawn(_procs.run_loader_epochs, image_root, size, 1, 0, results, go_b, release)
    go_a.set()
    # job A filled the cache with the whole dataset; job B, started while A still holds it, only hits.
    pid_a, name_a, epochs_a, _ = results.get(timeout=_procs.JOIN_TIMEOUT)
    go_b.set()
    pid_b, name_b, epochs_b, cached = results.get(timeout=_procs.JOIN_TIMEOUT)
    release.set()
    _procs.join_ok(job_a, job_b)
    assert (pid_a, pid_b) == (job_a.pid, job_b.pid)
    assert name_a == name_b and cached == 96
    assert epochs_a == [(0, 96)] and epochs_b == [(96, 0)]
    assert not os.path.exists(segment_path(name_a))


def test_a_changed_dataset_gets_a_new_cache_never_stale_bytes(fresh_image_root):
    dataset = torchvision.datasets.ImageFolder(fresh_image_root)
    with coordl.DataLoader(dataset, batch_size=8, collate_fn=list, cache_bytes="1GiB") as first:
        list(first)
        path = dataset.samples[0][0]
        with open(path, "ab") as f:
            f.write(b"\0" * 10)  # the file changes under a live cache
        with coordl.DataLoader(torchvision.datasets.ImageFolder(fresh_image_root), batch_size=8, collate_fn=list,
                               cache_bytes="1GiB") as second:
            assert second.dataset.cache.name != first.dataset.cache.name
            assert len(list_caches()) >= 2
            with open(path, "rb") as f:
                assert second.dataset.fetch(0, second.dataset.counters.row()) == f.read()


def test_named_cache_of_another_dataset_in_use_is_refused(image_root, fresh_image_root):
    with coordl.DataLoader(torchvision.datasets.ImageFolder(image_root), cache_name="shared-test", cache_bytes="1MiB"):
        with pytest.raises(coordl.CacheMismatchError, match="holds a different dataset.*cache_name="):
            coordl.DataLoader(torchvision.datasets.ImageFolder(fresh_image_root), cache_name="shared-test",
                              cache_bytes="1MiB")


def test_too_little_shm_is_refused_up_front_with_the_fix(tmp_path):
    files = []
    for i in range(3):  # sparse files: 3 x 8 TiB of dataset, no disk used
        files.append(str(tmp_path / f"huge{i}.bin"))
        with open(files[-1], "wb") as f:
            f.truncate(8 * 2**40)
    with pytest.raises(coordl.ShmCapacityError, match=r"a cache of 16.0 TiB plus its index of .* needs 16.0 TiB of "
                                                      r".* which has .* free\. Pass cache_bytes=.*--shm-size"):
        coordl.DataLoader(coordl.FileDataset(files, decode="bytes"), cache_bytes="16TiB")
    with pytest.raises(MemoryError):  # also catchable as the builtin
        MinIOCache(_name(), n_items=1, capacity_bytes=2**50, fingerprint=bytes(32)).stats()


def test_auto_cache_grows_only_as_the_dataset_fills_it_and_zero_turns_it_off(image_root):
    dataset = torchvision.datasets.ImageFolder(image_root)
    with coordl.DataLoader(dataset, collate_fn=list) as auto:
        built = auto.dataset.cache.stats()
        assert built.allocated_bytes == 0 and built.capacity_bytes > dataset_bytes(image_root)
        list(auto)
        filled = auto.dataset.cache.stats()
        assert (filled.items_cached, filled.bytes_cached) == (96, dataset_bytes(image_root))
        assert dataset_bytes(image_root) <= filled.allocated_bytes <= dataset_bytes(image_root) + minio_cache._CHUNK
        assert not filled.frozen
    with coordl.DataLoader(dataset, collate_fn=list, cache_bytes=0) as off:
        assert off.dataset.cache is None and not off.dataset.storage.drop_page_cache
        list(off)
        assert off.stats().epochs[0].misses == 96 and off.stats().cache is None


def test_an_insert_interrupted_mid_copy_leaves_its_space_to_the_next_writer():
    with MinIOCache(_name(), n_items=2, capacity_bytes=1 << 16, fingerprint=bytes(32)) as cache:
        write = cache._write

        def interrupted(*args):
            raise KeyboardInterrupt

        cache._write = interrupted
        with pytest.raises(KeyboardInterrupt):
            cache.put(0, b"x" * 100)
        cache._write = write
        assert cache.get(0) is None and cache.put(0, b"y" * 100) and cache.get(0) == b"y" * 100
        assert cache.stats().items_cached == 1


@pytest.mark.parametrize("then", ["fill", "release", "die"])
def test_an_item_claimed_by_another_process_is_waited_for_not_written_until_filled_released_or_its_writer_dies(
        tmp_path, then):
    """NOTE [ Claims ], forced: another process claims an item and holds it; here it is in flight (not cached,
    not claimable, not insertable) and a wait blocks; then the claimer fills it (the wait returns its bytes),
    releases it or is killed (the wait returns None and the item can be written here)."""
    name, n_items, size = _name(), 4, 64
    claimed, go = FileEvent(tmp_path), FileEvent(tmp_path)
    with MinIOCache(name, n_items=n_items, capacity_bytes=1 << 16, fingerprint=_shm_procs.FINGERPRINT,
                    label="shm-core test") as cache:
        claimer = _procs.spawn(_shm_procs.claim_and_hold, name, n_items, 2, size, claimed, then.replace("die", "hang"),
                               go)
        try:
            assert claimed.wait(_procs.JOIN_TIMEOUT), "the claimer never claimed"
            assert cache.in_flight(2) and not cache.in_flight(1)
            assert cache.view(2) is None and cache.claim(2, size) is None and not cache.put(2, b"x" * size)
            assert cache.wait(2, timeout_s=0.2) is None and cache.in_flight(2)  # still in flight: timed out
            if then == "die":
                claimer.kill()
                claimer.join(_procs.JOIN_TIMEOUT)
            else:
                go.set()
            view = cache.wait(2, timeout_s=_procs.JOIN_TIMEOUT)
        finally:
            go.set()
            if then != "die":
                _procs.join_ok(claimer)
        assert not cache.in_flight(2)
        if then == "fill":
            assert bytes(view) == _procs.item_payload(2, size) and cache.stamp(2) == (2, 2, size)
        else:
            assert view is None
            assert cache.put(2, b"y" * size) and cache.get(2) == b"y" * size  # rewritten in place


def test_a_claim_filled_with_bytes_of_another_size_is_released_and_the_item_stays_uncached():
    with MinIOCache(_name(), n_items=3, capacity_bytes=1 << 16, fingerprint=bytes(32)) as cache:
        claim = cache.claim(0, 10)
        assert cache.in_flight(0) and cache.claim(0, 10) is None  # one claim per item, this process's too
        assert not cache.fill(claim, b"z" * 11)
        assert not cache.in_flight(0) and cache.get(0) is None
        assert cache.put(0, b"z" * 10) and cache.get(0) == b"z" * 10


def test_a_wait_whose_claim_is_filled_between_its_looks_returns_the_bytes(monkeypatch):
    """The race forced: the claimer fills the item just after the waiter found it not cached and before it asks
    whether it is in flight; the wait returns the bytes (not None, which would read the item a second time)."""
    with MinIOCache(_name(), n_items=2, capacity_bytes=1 << 16, fingerprint=bytes(32)) as cache:
        claim, in_flight = cache.claim(1, 10), cache.in_flight

        def filled_just_now(index):
            if claim is not None and cache.view(index) is None:
                cache.fill(claim, b"w" * 10, (1, 2, 10))
            return in_flight(index)
        monkeypatch.setattr(cache, "in_flight", filled_just_now)
        assert cache.view(1) is None
        assert bytes(cache.wait(1, timeout_s=_procs.JOIN_TIMEOUT)) == b"w" * 10
