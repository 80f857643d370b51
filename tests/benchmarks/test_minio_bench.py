"""``python -m benchmarks.minio`` end to end on a tiny dataset: the results' schema and sanity, that it
leaves nothing behind, also when interrupted, and that a system that hangs is recorded and the rest
still run."""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks import minio
from benchmarks.systems import child_command
from coordl._cache.minio import list_caches
from harness.storage_env import PREFIX, block_device, cgroup_version, over_budget
from tests import _procs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IMAGES = 96
TINY = ["--images", str(IMAGES), "--mean-side-px", "160", "--fractions", "0.5", "--workers", "1",
        "--read-mbps", "4", "--compute-ms", "5"]
PAGE = 4096
MODES = ["emulated"] + (["cgroup"] if cgroup_version() and block_device("/tmp") else [])
"""cgroup mode where this machine allows it (root, cgroups, /tmp on a disk): CI does."""


def _start(tmp_path, mode: str, *args) -> tuple[subprocess.Popen, str, str]:
    work, out, tmp = (tmp_path / name for name in ("work", "out", "tmp"))
    for folder in (work, tmp):
        folder.mkdir()
    env = {**os.environ, "PYTHONPATH": REPO, "TMPDIR": str(tmp)}
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.minio", *TINY, "--storage", mode,
                             "--workdir", str(work), "--out", str(out), *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, str(work), str(out)


def _leftovers(pid: int, *folders: str) -> list[str]:
    """Whatever a benchmark with parent ``pid`` could have left: cgroups, its folders in ``folders``,
    processes, caches."""
    tag = f"{PREFIX}-{pid}"
    found = glob.glob(f"/sys/fs/cgroup/*/{tag}-*") + glob.glob(f"/sys/fs/cgroup/{tag}-*")
    found += [os.path.join(f, name) for f in folders for name in os.listdir(f) if name.startswith(PREFIX)]
    found += [s.name for s in list_caches() if s.label.startswith(tag)]
    found += _procs.command_lines(lambda cmd: "benchmarks.systems" in cmd and any(f in cmd for f in folders))
    for backing in glob.glob("/sys/block/loop*/loop/backing_file"):  # the dataset's loop device
        with open(backing) as f:
            found += [backing] if any(f.read().startswith(folder) for folder in folders) else []
    with open("/proc/self/mounts") as f:
        found += [line for line in f if any(line.split()[1].startswith(folder) for folder in folders)]
    return found


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_smoke_run(tmp_path, mode):
    systems = ["torch", "coordl"] + (["dali-seq"] if mode == "emulated" else [])  # where DALI skips at once
    proc, work, out = _start(tmp_path, mode, "--epochs", "2", "--reps", "2", "--systems", *systems)
    log = proc.communicate(timeout=360)[0]
    assert proc.returncode == 0, log  # also: no run's page cache went over its budget
    with open(os.path.join(out, "results.json")) as f:
        result = json.load(f)
    assert set(result) == {"storage_mode", "dataset_on", "dataset_device", "dataset_bytes", "bandwidth_bytes_per_s",
                           "runs", "comparisons"}
    assert result["storage_mode"] == mode
    assert result["dataset_on"] in (("loop device", "whole disk") if mode == "cgroup" else ("emulated store",))
    assert result["bandwidth_bytes_per_s"] == 4_000_000
    dataset = result["dataset_bytes"]
    assert sorted((r["system"], r["rep"]) for r in result["runs"]) == sorted((s, rep) for s in systems for rep in (0, 1))
    runs = {r["system"]: r for r in result["runs"] if r["rep"] == 0}
    assert all(r["cache_fraction"] == 0.5 for r in runs.values())
    measured = {name: r for name, r in runs.items() if r["epochs"]}
    if mode == "emulated":
        assert "cannot use the emulated store" in runs["dali-seq"]["skipped"] and runs["dali-seq"]["epochs"] == []
    for system in ("torch", "coordl"):
        epochs = runs[system]["epochs"]
        assert [e["epoch"] for e in epochs] == [1, 2]
        for e in epochs:
            assert e["samples"] == IMAGES and e["label_counts_match"], (system, e)
            assert e["time_s"] > 0 and 0 <= e["stall_s"] <= e["time_s"]
            assert isinstance(e["device_read_bytes"], int) and isinstance(e["hits"], int)
        assert epochs[0]["device_read_bytes"] >= dataset  # a cold start reads everything
        assert epochs[0]["hits"] == 0

    coordl, cache = runs["coordl"]["epochs"][1], runs["coordl"]["cache"]
    assert 0 < cache["bytes_cached"] <= dataset // 2 and coordl["hits"] == cache["items_cached"]
    slack = IMAGES * PAGE + 256 * 1024  # partial pages of each file, filesystem metadata
    if result["dataset_on"] != "whole disk":  # nothing but the dataset is counted
        assert all(r["epochs"][0]["device_read_bytes"] <= dataset + slack for r in measured.values())
    assert dataset - cache["bytes_cached"] <= coordl["device_read_bytes"] <= dataset - cache["bytes_cached"] + slack
    assert runs["coordl"]["steady"]["speedup"].keys() >= {"torch"}
    coordl_comparison = next(c for c in result["comparisons"] if c["system"] == "coordl")
    assert coordl_comparison["time_s"]["n"] == 2 and coordl_comparison["speedup"]["torch"]["n"] == 2
    if mode == "cgroup":
        for system in ("torch", "coordl"):
            memory, budget = runs[system]["memory"], runs[system]["page_cache_budget_bytes"]
            assert memory["samples"] > 0 and memory["page_cache_series"]
            assert memory["peak_page_cache_bytes"] >= memory["p99_page_cache_bytes"] >= memory["p50_page_cache_bytes"]
            assert over_budget(memory, budget) is None
        assert runs["torch"]["memory"]["peak_page_cache_bytes"] > 0  # torch's reads stay in its page cache
    with open(os.path.join(out, "setup.json")) as f:
        setup = json.load(f)
    assert len(setup["provenance"]["git_sha"]) == 40 and setup["config"]["reps"] == 2
    assert os.path.getsize(os.path.join(out, "results.md")) > 0
    assert _leftovers(proc.pid, work, str(tmp_path / "tmp")) == []


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_ctrl_c_removes_everything(tmp_path, mode):
    proc, work, _ = _start(tmp_path, mode, "--epochs", "100", "--reps", "1", "--systems", "coordl")
    tag = f"{PREFIX}-{proc.pid}"
    deadline = time.monotonic() + 120
    while not any(s.label.startswith(tag) for s in list_caches()):  # coordl's child is running
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.2)
    assert _leftovers(proc.pid, work)  # something to clean up
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert _leftovers(proc.pid, work, str(tmp_path / "tmp")) == []


def test_the_time_limit_covers_reading_prepping_and_computing_every_epoch_with_a_margin():
    seconds, how = minio.child_timeout(3, 120_000_000, 10_000_000, 38, 0.02)
    assert seconds == pytest.approx(minio.TIMEOUT_MARGIN * (minio.STARTUP_S + 3 * (12 + 12 + 0.76)))
    assert how == f"{seconds:.0f} s = 2 × (60 s start-up + 3 epochs × (12.0 s reading + 12.0 s prep + 0.8 s compute))"
    unthrottled, _ = minio.child_timeout(1, 10_000_000, None, 2, 0)
    assert unthrottled == pytest.approx(minio.TIMEOUT_MARGIN * (minio.STARTUP_S + 1))


HANG = "import sys, time; print('stuck loading libraries', file=sys.stderr, flush=True); time.sleep(600)  # hung-system"


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_hung_system_is_recorded_and_the_others_still_run(tmp_path, monkeypatch, mode):
    """torch's measured run hangs (a child that sleeps): it is killed at its (tiny) limit, recorded with
    its error and stderr, leaves nothing behind, and coordl still runs; the exit status is 1."""
    def hang_torch(spec):
        hangs = spec["system"] == "torch" and not spec["cache_name"].endswith("warm-up")
        return [sys.executable, "-c", HANG] if hangs else child_command(spec)

    def tiny_limit_for_the_hang(cmd, timeout_s, group=None):
        return run_child(cmd, 3 if HANG in cmd else timeout_s, group)

    run_child = minio.run_child
    monkeypatch.setattr(minio, "child_command", hang_torch)
    monkeypatch.setattr(minio, "run_child", tiny_limit_for_the_hang)
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    status = minio.main([*TINY, "--epochs", "1", "--reps", "1", "--storage", mode, "--systems", "torch", "coordl",
                         "--workdir", str(work), "--out", str(out)])
    assert status == 1
    with open(out / "results.json") as f:
        runs = {r["system"]: r for r in json.load(f)["runs"]}
    assert runs["torch"]["epochs"] == [] and runs["torch"]["error"].startswith("torch at cache 50% timed out after")
    assert "stuck loading libraries" in runs["torch"]["stderr_tail"]
    assert [e["samples"] for e in runs["coordl"]["epochs"]] == [IMAGES] and "error" not in runs["coordl"]
    assert "torch at 50%, repetition 1: FAILED: torch at cache 50% timed out" in (out / "results.md").read_text()
    assert _procs.command_lines(lambda cmd: "hung-system" in cmd) == []
    assert _leftovers(os.getpid(), str(work)) == []


@pytest.mark.slow
@pytest.mark.skipif("cgroup" not in MODES, reason="needs root and cgroups")
def test_at_cache_100_every_system_starts_warm_and_the_prep_bound_is_measured_without_a_loader(tmp_path):
    proc, work, out = _start(tmp_path, "cgroup", "--epochs", "2", "--reps", "1", "--fractions", "1.0",
                             "--systems", "torch", "coordl")
    log = proc.communicate(timeout=360)[0]
    assert proc.returncode == 0, log
    with open(os.path.join(out, "results.json")) as f:
        runs = {r["system"]: r for r in json.load(f)["runs"]}
    assert set(runs) == {"torch", "coordl", "prep-torch"}
    for system in ("torch", "coordl"):
        assert [e["device_read_bytes"] for e in runs[system]["epochs"]] == [0, 0]  # warm from the start
        assert runs[system]["page_cache_budget_bytes"] is None  # memory not bounded
    prep = runs["prep-torch"]
    assert [e["samples"] for e in prep["epochs"]] == [IMAGES, IMAGES]
    assert runs["torch"]["steady"]["prep_bound_s"] == prep["steady"]["time_s"]
    assert _leftovers(proc.pid, work, str(tmp_path / "tmp")) == []
