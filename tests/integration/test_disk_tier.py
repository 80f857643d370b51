"""The disk tier end to end: a job fills it, the next job (a new process, its memory cache gone) reads
nothing from storage; killed writers, a disk that fills, jobs at once (the full tier)."""

import glob
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import time
import zlib

import pytest
import torch

import coordl
from coordl._core.sysinfo import descendants
from coordl._disk import format as fmt
from coordl._disk.cache import CORRUPT, DiskCache
from coordl._disk.folder import list_disk_caches
from harness.storage_env import LOOP_TOOLS, Cleanup, loop_disk
from tests import _disk_procs, _procs

needs_loop = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/loop-control") or not all(map(shutil.which, LOOP_TOOLS)),
    reason="needs root, loop devices and " + ", ".join(LOOP_TOOLS) + ": the tier's disk is a loop-mounted ext4")


def _crcs(files):
    return [zlib.crc32(open(f, "rb").read()) for f in files]


def _run(tmp_path, name, *args, quota="auto") -> dict:
    """``_disk_procs.disk_job(*args)`` in a job of its own; what it wrote."""
    out = str(tmp_path / f"{name}.json")
    _procs.join_ok(_procs.spawn(_disk_procs.disk_job, *args, out, quota))
    with open(out) as f:
        return json.load(f)


def _each_epoch_sees_every_sample_once_with_its_bytes(result, crcs):
    for epoch in result["seen"]:
        assert sorted(index for _, index in epoch) == list(range(len(crcs)))
        assert all(crc == crcs[index] for crc, index in epoch)
    orders = [[index for _, index in epoch] for epoch in result["seen"]]
    assert len({tuple(o) for o in orders}) == len(orders)  # a new order every epoch


def test_the_next_job_reads_nothing_from_storage_and_cache_ls_shows_it_without_changing_it(tmp_path, shm_namespace):
    root, cache_dir = str(tmp_path / "data"), str(tmp_path / "disk")
    files = _disk_procs.make_files(root, 120)
    crcs, size = _crcs(files), sum(os.path.getsize(f) for f in files)
    first = _run(tmp_path, "first", root, cache_dir, 2, size // 4, 2, 0)  # memory holds a quarter
    _each_epoch_sees_every_sample_once_with_its_bytes(first, crcs)
    assert first["epochs"][0]["storage_bytes"] == size and first["epochs"][0]["disk_hits"] == 0
    assert first["epochs"][1]["storage_bytes"] == 0  # what the workers read was written as they exited
    second = _run(tmp_path, "second", root, cache_dir, 2, size // 4, 2, 1)
    _each_epoch_sees_every_sample_once_with_its_bytes(second, crcs)
    for epoch in second["epochs"]:
        assert epoch["misses"] == 0 and epoch["storage_bytes"] == 0 and epoch["corrupt"] == 0
    assert second["epochs"][0]["disk_hits"] == 120 and second["epochs"][0]["disk_bytes"] == size
    assert 0 < second["epochs"][1]["hits"] < 120  # the memory cache took what it holds from the disk
    assert second["epochs"][1]["hits"] + second["epochs"][1]["disk_hits"] == 120
    (cache,) = list_disk_caches(cache_dir)
    before = {name: os.stat(os.path.join(cache_dir, cache.name, name)).st_mtime_ns
              for name in os.listdir(os.path.join(cache_dir, cache.name))}
    listing = subprocess.run([sys.executable, "-m", "coordl.cli", "cache", "ls", "--cache-dir", cache_dir],
                             capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0 and cache.name in listing.stdout and "120/120" in listing.stdout
    assert "100%" in listing.stdout and f"FileDataset of 120 files in {root}" in listing.stdout
    assert {name: os.stat(os.path.join(cache_dir, cache.name, name)).st_mtime_ns
            for name in os.listdir(os.path.join(cache_dir, cache.name))} == before


def test_a_torch_loader_built_from_the_parts_and_a_pickled_loader_read_through_the_disk_tier(tmp_path, shm_namespace):
    files = _disk_procs.make_files(str(tmp_path / "data"), 40)
    dataset = coordl.FileDataset(files, decode=zlib.crc32)
    loader = coordl.DataLoader(dataset, batch_size=8, cache_bytes=0, cache_dir=str(tmp_path / "disk"), collate_fn=list)
    assert sorted(x for batch in loader for x in batch) == sorted(_crcs(files))
    loader.dataset.storage.flush()
    before = loader.dataset.counters.totals()["disk_hits"]
    rebuilt = torch.utils.data.DataLoader(loader.dataset, batch_size=8, num_workers=2, collate_fn=list)  # Accelerate
    assert sorted(x for batch in rebuilt for x in batch) == sorted(_crcs(files))
    assert loader.dataset.counters.totals()["disk_hits"] - before == 40
    clone = pickle.loads(pickle.dumps(loader))  # ddp_spawn
    assert sorted(x for batch in clone for x in batch) == sorted(_crcs(files))
    assert clone.stats().epochs[-1].disk_hits == 40 and clone.stats().epochs[-1].misses == 0
    clone.close()
    loader.close()


def _opened(cache_dir: str, n: int) -> DiskCache:
    (info,) = list_disk_caches(cache_dir)
    with open(os.path.join(cache_dir, info.name, "meta.json")) as f:
        meta = json.load(f)
    return DiskCache(os.path.join(cache_dir, info.name), identity=meta["identity"], n_items=n, label=meta["label"])


def _kill_job(job) -> None:
    for pid in [job.pid, *descendants(job.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    job.join(30)


@pytest.mark.slow
@needs_loop
def test_writers_killed_at_random_moments_leave_only_whole_items_and_the_next_job_finishes_the_fill(
        tmp_path, shm_namespace):
    root = str(tmp_path / "data")
    files = _disk_procs.make_files(root, 300, sizes=(100_000, 300_000))
    contents = {f: open(f, "rb").read() for f in files}
    rng, held = random.Random(4), []
    with Cleanup() as cleanup:
        disk = loop_disk(cleanup, str(tmp_path), 256 << 20)
        for trial in range(10):  # a fresh cache each trial, so that each kill lands during the fill
            cache_dir, started = os.path.join(disk.root, f"trial{trial}"), str(tmp_path / f"started{trial}")
            job = _procs.spawn(_disk_procs.fill_until_killed, root, cache_dir, started)
            deadline, index = time.monotonic() + 60, None
            while time.monotonic() < deadline:  # the fill is under way once its first group is committed
                index = index or next(iter(glob.glob(os.path.join(cache_dir, "*", "index.log"))), None)
                if index is not None and os.path.getsize(index) > len(fmt.INDEX_MAGIC):
                    break
                time.sleep(0.001)
            time.sleep(rng.uniform(0.0, 0.3))
            _kill_job(job)
            cache = _opened(cache_dir, len(files))
            committed = [f for f in files if cache.record(f) is not None]
            for f in committed:  # every item a record names is whole, its file's bytes
                data = cache.read(f, cache.record(f))
                assert data is not CORRUPT and bytes(data) == contents[f]
            held.append(len(committed))
            cache.close()
            if trial < 9:
                shutil.rmtree(cache_dir)  # room on the disk for the next
        assert sum(0 < n < len(files) for n in held) >= 5  # most kills landed during the fill
        size = sum(map(len, contents.values()))
        crcs = _crcs(files)
        result = _run(tmp_path, "after", root, os.path.join(disk.root, "trial9"), 2, 0, 2, 0)
        _each_epoch_sees_every_sample_once_with_its_bytes(result, crcs)
        assert result["epochs"][0]["disk_hits"] == held[-1] and result["epochs"][0]["corrupt"] == 0
        assert result["epochs"][1]["storage_bytes"] == 0 and result["epochs"][1]["disk_bytes"] == size


def _job_with_stderr(tmp_path, name, *args, quota) -> tuple[dict, str]:
    """:func:`_run` in a fresh interpreter, with what it wrote to stderr."""
    out = str(tmp_path / f"{name}.json")
    code = f"from tests._disk_procs import disk_job; disk_job(*{list(args) + [out, quota]!r})"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert run.returncode == 0, run.stderr[-3000:]
    with open(out) as f:
        return json.load(f), run.stderr


@pytest.mark.slow
@needs_loop
def test_a_disk_that_fills_turns_the_tier_off_with_one_warning_and_loading_goes_on(tmp_path, shm_namespace):
    root = str(tmp_path / "data")
    files = _disk_procs.make_files(root, 60, sizes=(1_400_000, 1_600_000))  # 90 MB, on a 64 MiB disk
    with Cleanup() as cleanup:
        disk = loop_disk(cleanup, str(tmp_path), 64 << 20)
        result, stderr = _job_with_stderr(tmp_path, "full", root, os.path.join(disk.root, "cache"), 2, 0, 2, 0,
                                          quota="1TiB")
    _each_epoch_sees_every_sample_once_with_its_bytes(result, _crcs(files))
    warnings = [line for line in stderr.splitlines() if "disk cache" in line and "turned off" in line]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], stderr[-2000:]
    assert result["epochs"][1]["corrupt"] == 0 and result["epochs"][1]["misses"] == len(files)


def _cut_short(disk) -> None:
    """Make every read of ``disk`` (a :class:`LoopDisk`) past its first 8 MiB fail with EIO in the block layer, as
    a failing disk's reads do: its image is cut to 8 MiB and the loop device told its new size."""
    os.truncate(disk.image, 8 << 20)
    subprocess.run(["losetup", "--set-capacity", disk.loop], check=True)


@pytest.mark.slow
@needs_loop
def test_a_disk_whose_reads_fail_turns_the_tier_off_with_one_warning_and_loading_goes_on(tmp_path, shm_namespace):
    root = str(tmp_path / "data")
    files = _disk_procs.make_files(root, 60, sizes=(200_000, 400_000))  # 18 MB: most of it past the cut
    crcs = _crcs(files)
    with Cleanup() as cleanup:
        disk = loop_disk(cleanup, str(tmp_path), 128 << 20)
        cache_dir = os.path.join(disk.root, "cache")
        filled = _run(tmp_path, "fill", root, cache_dir, 2, 0, 2, 0)
        assert filled["epochs"][1]["disk_hits"] == len(files)  # the tier held every item
        os.sync()
        _cut_short(disk)  # from now on the packs' blocks cannot be read
        result, stderr = _job_with_stderr(tmp_path, "failing", root, cache_dir, 2, 0, 2, 1, quota="auto")
    _each_epoch_sees_every_sample_once_with_its_bytes(result, crcs)
    warnings = [line for line in stderr.splitlines() if "disk cache" in line and "turned off" in line]
    assert len(warnings) == 1 and "Input/output error" in warnings[0], stderr[-2000:]
    assert result["epochs"][1]["misses"] == len(files) and result["epochs"][1]["disk_hits"] == 0


@pytest.mark.slow
def test_a_quota_of_half_the_dataset_gives_the_same_disk_hits_every_later_epoch(tmp_path, shm_namespace):
    root, cache_dir = str(tmp_path / "data"), str(tmp_path / "disk")
    files = _disk_procs.make_files(root, 200)
    size = sum(os.path.getsize(f) for f in files)
    result = _run(tmp_path, "half", root, cache_dir, 3, 0, 2, 0, quota=size // 2)
    _each_epoch_sees_every_sample_once_with_its_bytes(result, _crcs(files))
    (info,) = list_disk_caches(cache_dir)
    assert info.bytes_on_disk <= size // 2 and 0.3 < info.fill_fraction < 0.7
    later = result["epochs"][1:]
    assert later[0]["disk_hits"] == later[1]["disk_hits"] == info.items_cached  # filled once, never evicted
    for epoch in later:
        assert epoch["disk_bytes"] + epoch["storage_bytes"] == size
    # the next job's memory cache (a quarter) takes what the disk does not hold: the tiers add up
    second = _run(tmp_path, "next", root, cache_dir, 3, size // 4, 2, 1, quota=size // 2)
    _each_epoch_sees_every_sample_once_with_its_bytes(second, _crcs(files))
    assert second["epochs"][0]["disk_hits"] == info.items_cached and second["epochs"][0]["hits"] == 0, second["epochs"]
    (topped,) = list_disk_caches(cache_dir)  # the first job's last group may have left room for an item or two
    assert info.items_cached <= topped.items_cached <= info.items_cached + 2 and topped.bytes_on_disk <= size // 2
    for epoch in second["epochs"][1:]:
        assert epoch["disk_hits"] == topped.items_cached and epoch["hits"] > 0
        assert epoch["storage_bytes"] == size - epoch["disk_bytes"] - epoch["cache_bytes"]


@pytest.mark.slow
def test_four_jobs_filling_one_disk_cache_at_once_read_and_write_each_item_once(tmp_path, shm_namespace):
    """Four jobs in their first epoch at once, each in its own order: an item one of them is reading into the
    disk cache is waited for by the others (NOTE [ Reads in flight ]), so storage is read once for them all."""
    root, cache_dir = str(tmp_path / "data"), str(tmp_path / "disk")
    files = _disk_procs.make_files(root, 200)
    crcs, size = _crcs(files), sum(os.path.getsize(f) for f in files)
    outs = [str(tmp_path / f"job{k}.json") for k in range(4)]
    jobs = [_procs.spawn(_disk_procs.disk_job, root, cache_dir, 2, size // 4, 2, k, outs[k]) for k in range(4)]
    _procs.join_ok(*jobs, timeout=180)
    first_epochs = []
    for out in outs:
        with open(out) as f:
            result = json.load(f)
        _each_epoch_sees_every_sample_once_with_its_bytes(result, crcs)
        assert result["epochs"][1]["storage_bytes"] == 0 and result["epochs"][1]["corrupt"] == 0
        first_epochs.append(result["epochs"][0])
    assert sum(e["storage_bytes"] for e in first_epochs) == size, first_epochs  # each item read once in all
    cache = _opened(cache_dir, len(files))
    records = cache.items()
    with open(os.path.join(cache.folder, "index.log"), "rb") as f:
        every, _ = fmt.replay(f.read(), len(fmt.INDEX_MAGIC))
    assert records == len(every) == len(files)  # no item written twice
