"""The benchmark's storage environment: the dataset's own loop device (made, evicted, throttled and
counted alone, and removed however a run ends), the fallback without one, and children killed at
their time limit."""

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from harness import storage_env
from harness.storage_env import (LOOP_TOOLS, PREFIX, Cleanup, MemoryFollower, block_device, cgroup_version,
                                    copy_to_loop_disk, device_read_bytes, evict_files, prepare_storage, run_child)
from tests import _procs

FILE_BYTES = 256 * 1024
needs_loop = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/loop-control") or not all(map(shutil.which, LOOP_TOOLS)),
    reason="needs root, loop devices and " + ", ".join(LOOP_TOOLS))
needs_cgroups = pytest.mark.skipif(not cgroup_version(), reason="needs root and cgroups")


@pytest.fixture
def source(tmp_path) -> str:
    """A small tree of random files: two folders of two files each."""
    root = tmp_path / "src"
    for i in range(4):
        folder = root / f"c{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"f{i}").write_bytes(os.urandom(FILE_BYTES))
    return str(root)


def _files(root: str) -> dict[str, bytes]:
    found = {}
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                found[os.path.relpath(os.path.join(folder, name), root)] = f.read()
    return found


def _left(folder: str) -> list[str]:
    """Loop devices backed by a file under ``folder``, mounts under it, and what the disk made in it."""
    found = []
    for backing in glob.glob("/sys/block/loop*/loop/backing_file"):
        with open(backing) as f:
            if f.read().strip().startswith(folder):
                found.append(backing)
    with open("/proc/self/mounts") as f:
        found += [line for line in f if line.split()[1].startswith(folder)]
    return found + [name for name in ("dataset.img", "disk") if os.path.exists(os.path.join(folder, name))]


def _sectors_read(loop: str) -> int:
    with open(f"/sys/block/{os.path.basename(loop)}/stat") as f:
        return int(f.read().split()[2])


@needs_loop
@pytest.mark.parametrize("ending", ["returns", "raises", "sigterm"])
def test_loop_disk_holds_a_copy_and_leaves_nothing(tmp_path, source, ending):
    work = str(tmp_path / "work")
    os.mkdir(work)
    expected = {"returns": contextlib.nullcontext(), "raises": pytest.raises(RuntimeError),
                "sigterm": pytest.raises(KeyboardInterrupt)}[ending]
    with expected:
        with Cleanup() as cleanup:
            disk = copy_to_loop_disk(cleanup, work, source)
            assert _files(disk.root) == _files(source)
            assert os.stat(disk.root).st_dev == os.makedev(*map(int, disk.device.split(":")))
            assert len(_left(work)) == 4  # attached to the image, mounted, image and mount point
            with open(f"/sys/block/{os.path.basename(disk.loop)}/loop/dio") as f:
                assert f.read().strip() == "1"
            if ending == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            if ending == "raises":
                raise RuntimeError("the run failed")
    assert _left(work) == []


@needs_loop
def test_a_failed_setup_removes_what_it_made_at_once(tmp_path, source, monkeypatch):
    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage_env.shutil, "copytree", no_space)
    with Cleanup() as cleanup:
        with pytest.raises(OSError, match="No space"):
            copy_to_loop_disk(cleanup, str(tmp_path), source)
        assert _left(str(tmp_path)) == []


@needs_loop
def test_evict_files_drops_the_loop_disks_files_from_the_page_cache(tmp_path, source):
    with Cleanup() as cleanup:
        disk = copy_to_loop_disk(cleanup, str(tmp_path), source)
        evict_files(disk.root)
        reads = [_sectors_read(disk.loop)]
        for _ in range(2):  # from the device, then from the page cache
            _files(disk.root)
            reads.append(_sectors_read(disk.loop))
        evict_files(disk.root)
        _files(disk.root)
        reads.append(_sectors_read(disk.loop))
    sectors = 4 * FILE_BYTES // 512
    assert [reads[1] - reads[0] >= sectors, reads[2] - reads[1], reads[3] - reads[2] >= sectors] == [True, 0, True]


@needs_loop
@needs_cgroups
def test_only_the_datasets_reads_are_throttled_and_counted(tmp_path, source):
    other = tmp_path / "library.so"  # on the real disk, as libraries are
    other.write_bytes(os.urandom(8 * FILE_BYTES))
    work = tmp_path / "work"
    work.mkdir()
    with Cleanup() as cleanup:
        disk = copy_to_loop_disk(cleanup, str(work), source)
        evict_files(disk.root)
        evict_files(str(tmp_path / "library.so"))
        group = cleanup.cgroup(f"{PREFIX}-{os.getpid()}-test", cgroup_version(), disk.device, 1_000_000, 2**26)
        files = " ".join(os.path.join(d, f) for d, _, names in os.walk(disk.root) for f in names)
        started = time.monotonic()
        result = run_child(["sh", "-c", f"cat {other} > /dev/null && cat {files} > /dev/null"], 60, group)
        elapsed = time.monotonic() - started
        counted = device_read_bytes(group.counter())
        group.remove()
    assert result.returncode == 0, result.stderr
    assert 4 * FILE_BYTES <= counted <= 4 * FILE_BYTES + 64 * 1024  # the dataset, not the library
    assert elapsed >= 0.7 * 4 * FILE_BYTES / 1_000_000  # 1 MB/s


def test_without_losetup_it_falls_back_and_says_so(tmp_path, source, monkeypatch):
    which = shutil.which
    monkeypatch.setattr(storage_env.shutil, "which", lambda tool, *a, **k: None if tool == "losetup" else which(tool))
    with Cleanup() as cleanup:
        storage = prepare_storage("auto", source, cleanup, str(tmp_path))
    assert storage.root == source and "FALLBACK" in storage.detail
    if cgroup_version() and block_device(source):
        assert (storage.mode, storage.dataset_on, storage.device) == ("cgroup", "whole disk", block_device(source))
        assert "losetup not found" in storage.detail
    else:
        assert (storage.mode, storage.dataset_on) == ("emulated", "emulated store")


def test_emulated_storage_is_taken_as_asked(tmp_path, source):
    with Cleanup() as cleanup:
        storage = prepare_storage("emulated", source, cleanup, str(tmp_path))
    assert (storage.mode, storage.dataset_on, storage.root, storage.detail) == (
        "emulated", "emulated store", source, "requested")


HANG = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "print('stuck loading libraries', file=sys.stderr, flush=True); time.sleep(600)  # hung-child")


def test_a_hung_child_is_killed_at_its_limit_with_its_workers_and_its_output_kept():
    started = time.monotonic()
    result = run_child([sys.executable, "-c", HANG], 2)
    assert time.monotonic() - started < 2 + storage_env.DRAIN_S
    assert result.timed_out and result.returncode == -signal.SIGKILL
    assert "stuck loading libraries" in result.stderr
    assert _procs.command_lines(lambda cmd: "hung-child" in cmd or "time.sleep(600)" in cmd) == []


_LEAVES_SEGMENTS = """
import os, sys, time
tag, made = sys.argv[1], sys.argv[2]
worker = os.fork()
if worker == 0:  # a worker that ends on its own as torch has made a tensor's segment, before unlinking it
    open(f"/dev/shm/torch_{os.getpid()}_{tag}_0", "wb").close()
    time.sleep(1.0)
    os._exit(0)
os.waitpid(worker, 0)
if os.fork() == 0:  # a worker still collating when its job exits: stopped with the job's process group
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1), os.dup2(devnull, 2)  # the job's output ends with the job
    open(f"/dev/shm/torch_{os.getpid()}_{tag}_1", "wb").close()
    open(made, "w").close()
    time.sleep(600)
while not os.path.exists(made):
    time.sleep(0.01)
"""


def test_the_segments_torch_left_for_a_childs_processes_go_with_it(tmp_path):
    """torch unlinks a tensor's segment once mapped: a worker ended in between leaves it. The child's, noted while
    it ran or stopped with its group, are removed; a live process's stays."""
    tag = f"bench-test-{os.getpid()}"
    alive = f"/dev/shm/torch_{os.getpid()}_{tag}_2"
    open(alive, "wb").close()
    try:
        result = run_child([sys.executable, "-c", _LEAVES_SEGMENTS, tag, str(tmp_path / "made")], 60)
        assert result.returncode == 0 and not result.timed_out and (tmp_path / "made").exists(), result.stderr
        assert [p for p in os.listdir("/dev/shm") if tag in p] == [os.path.basename(alive)]
    finally:
        os.remove(alive)


def _tree(root, files: int, size: int) -> list[str]:
    root.mkdir()
    paths = [str(root / f"f{i:03d}") for i in range(files)]
    for path in paths:
        with open(path, "wb") as f:
            f.write(os.urandom(size))
    return paths


@needs_loop
@needs_cgroups
def test_an_iops_limit_makes_each_read_request_cost_its_share_of_a_second(tmp_path):
    source, work = tmp_path / "src", tmp_path / "work"
    _tree(source, 40, 4096)
    work.mkdir()
    elapsed = {}
    with Cleanup() as cleanup:
        disk = copy_to_loop_disk(cleanup, str(work), str(source))
        files = " ".join(os.path.join(disk.root, name) for name in sorted(os.listdir(disk.root)))
        for iops in (None, 20):  # the same reads, side by side: bandwidth is no limit here
            evict_files(disk.root)
            group = cleanup.cgroup(f"{PREFIX}-{os.getpid()}-iops-{iops}", cgroup_version(), disk.device, 10**9, 2**26,
                                   read_iops=iops)
            started = time.monotonic()
            result = run_child(["sh", "-c", f"cat {files} > /dev/null"], 60, group)
            elapsed[iops] = time.monotonic() - started
            group.remove()
            assert result.returncode == 0, result.stderr
    assert elapsed[20] >= 0.7 * 40 / 20  # at least one request per file
    assert elapsed[None] < elapsed[20] / 2


@needs_loop
@needs_cgroups
@pytest.mark.parametrize("reserve", [0, 32 * 2**20])
def test_a_page_cache_over_its_budget_is_squeezed_back_at_once(tmp_path, reserve):
    """16 MiB read with a page-cache budget of 0 (coordl's groups): the page cache is held to the slack
    all along, though the group's headroom would hold all of it, and so would a shared-memory reserve
    not yet taken."""
    source, work = tmp_path / "src", tmp_path / "work"
    _tree(source, 8, 2 * 2**20)
    work.mkdir()
    with Cleanup() as cleanup:
        disk = copy_to_loop_disk(cleanup, str(work), str(source))
        evict_files(disk.root)
        group = cleanup.cgroup(f"{PREFIX}-{os.getpid()}-squeeze", cgroup_version(), disk.device, 8_000_000, 0,
                               shm_reserve_bytes=reserve)
        files = " ".join(os.path.join(disk.root, name) for name in sorted(os.listdir(disk.root)))
        result = run_child(["sh", "-c", f"cat {files} > /dev/null"], 60, group)
        group.remove()
    assert result.returncode == 0, result.stderr
    assert 16 * 2**20 < storage_env.HEADROOM_BYTES  # without the squeeze, all of it could stay
    assert result.memory["p95_page_cache_bytes"] <= storage_env.SLACK_BYTES + 2 * 2**20, result.memory
    assert storage_env.over_budget(result.memory, 0) is None


class _CountingGroup:
    """A stand-in for a :class:`storage_env.Cgroup` that counts the follower's updates."""

    def __init__(self, read_bps: int):
        self.read_bps, self.updates = read_bps, 0

    def memory(self) -> tuple[int, int, int]:
        return 0, 0, 0

    def bound(self, *args) -> None:
        self.updates += 1

    def limit_hits(self) -> None:
        return None

    def lift(self) -> None:
        pass


@pytest.mark.parametrize("read_bps, least, most", [(10_000_000, 8, 16), (200_000_000, 30, 70)])
def test_the_bound_follows_a_faster_throttle_more_often(read_bps, least, most):
    """Every 20 ms up to 52 MB/s; at 200 MB/s every 5.2 ms (one update per MiB the throttle lets
    through), so that a fast reader's page cache is squeezed back before it reads much past its budget."""
    group = _CountingGroup(read_bps)
    follower = MemoryFollower(group).start()
    time.sleep(0.3)
    follower.stop()
    assert least <= group.updates <= most, group.updates


def _memory_limit(group) -> int:
    name = "memory.limit_in_bytes" if group.version == 1 else "memory.high"
    value = open(os.path.join(group.dirs[0], name)).read().strip()
    return 2**63 if value == "max" else int(value)


STARTS_UP = """import os, sys, time
held = b"x" * (256 << 20)  # more than the headroom, at once
open(sys.argv[1], "w").close()
while not os.path.exists(sys.argv[2]):
    time.sleep(0.01)
"""


@needs_loop
@needs_cgroups
@pytest.mark.parametrize("told", ["measure()", "measure_when"])
def test_a_group_is_bounded_and_sampled_only_from_the_moment_it_is_measured(tmp_path, source, told):
    """What a group's processes take while they start up (256 MiB at once, beyond the headroom) is not
    held to the bound; from measure() on, or from the first tick where ``measure_when()`` is true, the group
    is bounded to what it holds, and sampled."""
    ready, go, started = tmp_path / "ready", tmp_path / "go", tmp_path / "started"
    with Cleanup() as cleanup:
        (tmp_path / "work").mkdir()
        disk = copy_to_loop_disk(cleanup, str(tmp_path / "work"), source)
        group = cleanup.cgroup(f"{PREFIX}-{os.getpid()}-measure", cgroup_version(), disk.device, 10**9, 2**20)
        follower = (MemoryFollower(group, measure_now=False) if told == "measure()" else
                    MemoryFollower(group, measure_when=started.exists)).start()
        child = subprocess.Popen([sys.executable, "-c", STARTS_UP, str(ready), str(go)], preexec_fn=group.join)
        try:
            deadline = time.monotonic() + 60
            while not ready.exists() and child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert ready.exists(), "the child did not start up"
            assert _memory_limit(group) >= 10**15 // 2  # not bounded yet
            assert follower.samples == []
            if told == "measure()":
                follower.measure()
            else:
                started.touch()
            time.sleep(0.3)
            bound = _memory_limit(group)
            go.touch()
            assert child.wait(timeout=30) == 0
        finally:
            child.kill()
            memory = follower.stop()
    assert 256 * 2**20 < bound < 256 * 2**20 + 2**20 + storage_env.HEADROOM_BYTES + 64 * 2**20
    assert follower.samples[0][1] >= 256 * 2**20  # the first sample comes after the start-up
    assert memory["limit_hits"] == 0


@needs_loop
@needs_cgroups
def test_what_start_up_leaves_in_the_page_cache_is_squeezed_back_before_the_first_sample(tmp_path):
    """A child reads 16 MiB while it starts up (not bounded: all of it stays in its group's page cache),
    then says it has started: the first measured tick squeezes all of it back (to the budget, 0, without
    the slack), so no sample counts it."""
    source, work, started = tmp_path / "src", tmp_path / "work", tmp_path / "started"
    _tree(source, 8, 2 * 2**20)
    work.mkdir()
    with Cleanup() as cleanup:
        disk = copy_to_loop_disk(cleanup, str(work), str(source))
        evict_files(disk.root)
        group = cleanup.cgroup(f"{PREFIX}-{os.getpid()}-start-up", cgroup_version(), disk.device, 10**9, 0)
        files = " ".join(os.path.join(disk.root, name) for name in sorted(os.listdir(disk.root)))
        result = run_child(["sh", "-c", f"cat {files} > /dev/null && touch {started} && sleep 0.5"], 60, group,
                           measure_when=started.exists)
        group.remove()
    assert result.returncode == 0, result.stderr
    assert result.memory["samples"] >= 5
    assert result.memory["peak_page_cache_bytes"] < 2**20, result.memory
