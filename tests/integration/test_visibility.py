"""stats(), the per-epoch summary line, the progress bar, and page-cache hygiene of misses."""

import os
import subprocess
import sys
import time

import pytest
import torchvision

import coordl
from coordl._fetch.storage import FileStorage

SCRIPT = """
import sys, torchvision, coordl
loader = coordl.DataLoader(torchvision.datasets.ImageFolder(sys.argv[1]), batch_size=16, shuffle=True,
                           collate_fn=list, cache_bytes=sys.argv[2], progress=sys.argv[3] == "1")
for _ in range(2):
    for _ in loader:
        pass
loader.close()
"""


def _run_script(root, cache_bytes, progress, env_level):
    env = {**os.environ, "COORDL_LOG_LEVEL": env_level} if env_level else {
        k: v for k, v in os.environ.items() if k != "COORDL_LOG_LEVEL"}
    return subprocess.run([sys.executable, "-c", SCRIPT, root, str(cache_bytes), str(int(progress))],
                          capture_output=True, text=True, env=env, timeout=120, check=True)


@pytest.mark.slow
def test_summary_line_per_epoch_when_the_environment_asks(image_root):
    err = _run_script(image_root, 200_000, False, "INFO").stderr
    lines = [line for line in err.splitlines() if " coordl INFO epoch=" in line]
    assert len(lines) == 2, err
    fields = [dict(kv.split("=", 1) for kv in line.split(" coordl INFO ")[1].split()) for line in lines]
    for f in fields:
        assert {"epoch", "samples", "hits", "misses", "storage_bytes", "stall_s"} <= f.keys()
        assert f["samples"] == "96" and int(f["hits"]) + int(f["misses"]) == 96
    assert fields[0]["hits"] == "0" and int(fields[1]["hits"]) > 0
    assert "Because cache_bytes was not given" not in err and "created cache" in err
    quiet = _run_script(image_root, 200_000, False, None).stderr
    assert "epoch=" not in quiet


@pytest.mark.slow
def test_progress_bar(image_root):
    err = _run_script(image_root, "auto", True, None).stderr
    assert "coordl epoch 1" in err and "coordl epoch 2" in err and "6/6" in err


@pytest.mark.slow
def test_stats_per_epoch_and_total(image_root):
    with coordl.DataLoader(torchvision.datasets.ImageFolder(image_root), batch_size=10, num_workers=2,
                           shuffle=True, collate_fn=list, cache_bytes=10**6) as loader:
        it = iter(loader)  # an abandoned pass whose workers go on prefetching
        next(it)
        for _ in range(2):
            list(loader)
        stats = loader.stats()
    partial, first, second = stats.epochs
    assert not partial.complete and partial.batches == 1
    assert first.complete and second.complete
    assert first.samples == second.samples == 96 and (first.batches, second.batches) == (10, 10)
    assert second.hits == stats.cache.items_cached == 96 and second.misses == 0
    assert first.stall_s > 0 and first.time_s >= first.stall_s
    assert stats.total.samples == partial.samples + 192 and stats.total.hits == sum(e.hits for e in stats.epochs)
    as_dict = stats.as_dict()
    assert as_dict["epochs"][2]["hit_rate"] == 1.0 and as_dict["cache"]["fill_fraction"] == 1.0
    del it


class _SlowStorage(FileStorage):
    """Local files, each read taking at least ``READ_S``."""

    def read_stamped(self, key):
        time.sleep(READ_S)
        return super().read_stamped(key)


def _slow_prep(image):
    time.sleep(PREP_S)
    return image


READ_S, PREP_S = 0.01, 0.005


def test_stats_say_where_loading_time_goes(image_root):
    """Seconds reading storage and preparing samples, summed over the workers: at least what each read and
    each sample's transform slept, and no storage time once everything is cached."""
    dataset = torchvision.datasets.ImageFolder(image_root, transform=_slow_prep)
    with coordl.DataLoader(dataset, batch_size=8, num_workers=2, collate_fn=list, cache_bytes=10**6,
                           storage=_SlowStorage()) as loader:
        for _ in range(2):
            list(loader)
        first, second = loader.stats().epochs
    assert 96 * READ_S <= first.storage_wait_s < 96 * READ_S + 5
    assert 96 * PREP_S <= first.prep_s < 96 * PREP_S + 5 and 96 * PREP_S <= second.prep_s < 96 * PREP_S + 5
    assert second.storage_wait_s == 0 and second.peer_wait_s == first.peer_wait_s == 0
    assert f"storage_wait_s={first.storage_wait_s:.3f} prep_s={first.prep_s:.3f}" in first.summary_line(None)


def _resident_bytes(path) -> int:
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", path],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def test_waits_are_timed_when_the_workers_fetched_the_whole_plan_before_the_first_batch(tmp_path):
    """Forced: the loop pauses after iter() while 2 workers fetch both batches of the plan (their prefetch
    holds 4), so torch finds the plan run out, and every sample fetched, inside the loop's first next()."""
    files = []
    for i in range(16):
        files.append(str(tmp_path / f"{i}.bin"))
        with open(files[-1], "wb") as f:
            f.write(bytes([i]) * 100)
    loader = coordl.DataLoader(coordl.FileDataset(files, decode="bytes"), batch_size=8, num_workers=2,
                               collate_fn=list)
    for _ in range(2):
        it = iter(loader)
        deadline = time.monotonic() + 30
        while loader.dataset.counters.totals()["samples"] < len(files):  # the workers fetched everything
            assert time.monotonic() < deadline, "the workers never fetched the plan"
            time.sleep(0.01)
        assert len(list(it)) == 2
    epochs = loader.stats().epochs
    assert [(e.samples, e.batches, e.complete) for e in epochs] == [(16, 2, True)] * 2
    assert all(e.stall_s is not None and e.stall_s >= 0 for e in epochs)
    loader.close()

def test_misses_do_not_fill_the_page_cache(tmp_path):
    path = tmp_path / "sample.bin"
    if subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout.strip() \
            == "tmpfs":  # tmpfs pages cannot be dropped: use a disk-backed folder
        path = os.path.join("/var/tmp", f"coordl-fadvise-{os.getpid()}.bin")
    try:
        with open(path, "wb") as f:
            f.write(os.urandom(4 << 20))
            f.flush()
            os.fsync(f.fileno())
        assert FileStorage(drop_page_cache=False).read(str(path))
        assert _resident_bytes(path) > 0
        assert len(FileStorage(drop_page_cache=True).read(str(path))) == 4 << 20
        assert _resident_bytes(path) == 0
    finally:
        os.remove(path)


def test_attaching_an_existing_cache_of_another_size_is_said_once_per_process(caplog):
    """Every worker and every epoch attaches the cache again; the log says so once per process and cache."""
    from coordl.minio_cache import MinIOCache, cache_segment_name
    name = cache_segment_name(f"said-once-{os.getpid()}-{time.monotonic_ns()}")
    with MinIOCache(name, n_items=4, capacity_bytes=2**20, fingerprint=bytes(32)) as first, \
            caplog.at_level("INFO", logger="coordl._cache.minio"):
        assert first.capacity_bytes == 2**20  # created (a handle attaches when first used)
        for _ in range(3):
            with MinIOCache(name, n_items=4, capacity_bytes=2**21, fingerprint=bytes(32)) as again:
                assert again.capacity_bytes == 2**20  # attached: the existing cache keeps its size
    said = [r for r in caplog.records if "attached existing cache" in r.getMessage()]
    assert len(said) == 1 and "(asked for 2.0 MiB)" in said[0].getMessage()


def test_printed_stats_are_a_table_of_epochs_and_their_repr_is_the_dataclass(image_root):
    with coordl.DataLoader(torchvision.datasets.ImageFolder(image_root), batch_size=16, collate_fn=list) as loader:
        for _ in range(2):
            for _ in loader:
                pass
        stats = loader.stats()
    lines = str(stats).splitlines()
    assert lines[0].split() == ["epoch", "samples", "samples/s", "hits", "misses", "storage", "MiB", "stall", "s",
                                "time", "s"]
    assert [line.split()[0] for line in lines[1:4]] == ["1", "2", "total"]
    assert lines[1].split()[1:2] == [str(stats.epochs[0].samples)] and lines[3].split()[1] == str(stats.total.samples)
    assert lines[4] == (f"cache: {stats.cache.items_cached} of {stats.cache.n_items} items "
                        f"({stats.cache.fill_fraction:.0%}), {stats.cache.bytes_cached / 2**20:.1f} of "
                        f"{stats.cache.capacity_bytes / 2**20:.1f} MiB")
    assert repr(stats).startswith("LoaderStats(epochs=[EpochStats(epoch=1")
