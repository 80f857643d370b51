"""``python -m benchmarks.coordprep --quick`` end to end: K jobs per system, the decode counts that
coordinated prep promises, and nothing left behind."""

import glob
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import pytest

from benchmarks.coordprep import cpu_seconds, cpu_split
from coordl._group.membership import list_groups
from harness.storage_env import PREFIX, cgroup_version
from tests import _procs
from tests.benchmarks._bench import CLEANUP_GRACE_S, REPO, run_to_end

RUN_S = 200
"""How long one quick run may take before it is stopped (about 40 s on two cores)."""


def _leftovers() -> set[str]:
    return set(glob.glob("/var/tmp/coordl-coordprep-*") + glob.glob(f"/sys/fs/cgroup/*/{PREFIX}-coordprep-*"))


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_S + CLEANUP_GRACE_S + 60)
@pytest.mark.parametrize("backend, systems, reps", [("torch", ("torch", "coordl"), 2),
                                                   ("dali", ("dali", "coordl-dali"), 1)])
def test_quick_run(tmp_path, backend, systems, reps):
    before, groups_before = _leftovers(), {g.name for g in list_groups()}
    out = tmp_path / "out"
    run = run_to_end([sys.executable, "-m", "benchmarks.coordprep", "--jobs", "2", "--quick", "--backend", backend,
                      "--reps", str(reps), "--out", str(out)], RUN_S * reps, cwd=REPO,
                     env={**os.environ, "PYTHONPATH": REPO})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    baseline, coordl = (result["summary"][name] for name in systems)
    assert list(result["summary"]) == list(systems) and result["backend"] == backend
    assert baseline["decoded_x_dataset"] == [2.0, 2.0]  # each of the 2 jobs decodes the whole dataset
    assert coordl["decoded_x_dataset"] == [1.0, 1.0]  # the group decodes it once
    for name in systems:
        runs = result["systems"][name]
        assert len(runs) == reps == len(result["summary"][name]["runs"])
        for run in runs:
            jobs = run["jobs"]
            assert len(jobs) == 2 and all(r["samples"] == result["images"] for job in jobs for r in job)
        rates = [r["per_job_samples_per_s"] for r in result["summary"][name]["runs"]]
        assert result["summary"][name]["per_job_samples_per_s_spread"] == {
            "median": statistics.median(rates), "min": min(rates), "max": max(rates), "n": reps}
    runs_of = {name: result["summary"][name]["runs"] for name in systems}  # the speedup, run beside run
    assert coordl["speedup"]["n"] == reps and coordl["speedup"]["min"] == pytest.approx(min(
        c["per_job_samples_per_s"] / b["per_job_samples_per_s"] for c, b in zip(runs_of[systems[1]], runs_of[systems[0]])))
    assert "speedup" not in baseline
    batch_bytes = result["batch_size"] * 3 * 224 * 224 * 4  # float32 images
    assert 0 < coordl["staging_peak_bytes"] <= coordl["staging_capacity_bytes"] + batch_bytes  # one batch beyond
    assert baseline["staging_peak_bytes"] is None
    for row in (baseline, coordl):  # where the CPU went
        assert row["main_cpu_ms_per_decoded_sample"] > 0 and 0 < row["cores_busy"] <= os.cpu_count() + 0.5
    if backend == "torch":  # decoding in worker processes
        assert baseline["workers_cpu_ms_per_decoded_sample"] > baseline["main_cpu_ms_per_decoded_sample"]
        assert coordl["workers_cpu_ms_per_decoded_sample"] > 0
    else:  # plain DALI decodes in its own threads, in the job's process
        assert baseline["workers_cpu_ms_per_decoded_sample"] == 0
    if cgroup_version():  # throttled, bounded: the group reads the dataset once per epoch, the baseline more
        assert result["memory_fraction"] == 0.5
        assert coordl["device_read_x_dataset_per_epoch"] <= 1.1  # (the tiny dataset partly stays in page cache)
        assert coordl["page_cache_budget_bytes"] == result["dataset_bytes"] // 2 - coordl["staging_capacity_bytes"]
    assert "| " + systems[1] + " |" in (out / "results.md").read_text()
    assert (out / "coordprep.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
    assert _leftovers() == before
    assert {g.name for g in list_groups()} == groups_before


@pytest.mark.slow
def test_coordl_jobs_that_drop_the_pages_they_read_keep_none(tmp_path):
    before = _leftovers()
    out = tmp_path / "out"
    run = run_to_end([sys.executable, "-m", "benchmarks.coordprep", "--jobs", "2", "--quick", "--drop-page-cache",
                      "--out", str(out)], RUN_S, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    assert result["coordl_drop_page_cache"] is True
    torch_jobs, coordl = result["summary"]["torch"], result["summary"]["coordl"]
    assert coordl["decoded_x_dataset"] == [1.0, 1.0]
    if cgroup_version():  # every epoch from the device; the group's page cache stays below the batches being read
        assert coordl["device_read_x_dataset_per_epoch"] >= 0.99
        batch_files = result["dataset_bytes"] / result["images"] * result["batch_size"]
        reading = result["jobs"] * batch_files  # K members read at once (each drops a file's pages once read)
        # (the median: code the jobs load as they run, and as they exit, is charged to the group too: its
        # peak reached 2.7 MB in CI, on a fresh machine)
        assert coordl["p50_page_cache_bytes"] < reading < torch_jobs["p50_page_cache_bytes"]
    assert _leftovers() == before


@pytest.mark.slow
def test_sigterm_mid_run_leaves_nothing(tmp_path):
    before, groups_before = _leftovers(), {g.name for g in list_groups()}
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.coordprep", "--jobs", "2", "--quick",
                             "--out", str(tmp_path / "out")], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.startswith("running 2 coordl jobs"):  # mid-run: its cgroups, workdir and jobs exist
            time.sleep(2)
            proc.send_signal(signal.SIGTERM)
            break
    proc.communicate(timeout=60)
    assert proc.returncode != 0 and not (tmp_path / "out" / "results.json").exists()
    assert _leftovers() == before
    assert {g.name for g in list_groups()} == groups_before
    assert not _procs.command_lines(lambda cmd: "benchmarks.coordprep" in cmd and "--child" in cmd)


_BURN = ("import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3:\n    pass\n"
         "sys.stdout.write('x')\nsys.stdout.flush()\ntime.sleep(60)\n")


def test_cpu_seconds_counts_the_workers_alive_and_once_reaped():
    main_before, workers_before = cpu_seconds()
    proc = subprocess.Popen([sys.executable, "-c", _BURN], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.read(1) == b"x"  # it burned 0.3 s of CPU and now sleeps
        _, alive = cpu_seconds()
    finally:
        proc.kill()
        proc.wait()
    started = time.process_time()
    while time.process_time() - started < 0.2:
        pass
    main_after, reaped = cpu_seconds()
    assert 0.29 <= alive - workers_before < 2.0
    assert reaped >= alive - 0.02  # the reaped child's seconds move to RUSAGE_CHILDREN, none lost
    assert main_after - main_before >= 0.19


def test_cpu_split_over_the_steady_epochs():
    def row(epoch, decoded, main, workers, time_s):
        return {"epoch": epoch, "decoded": decoded, "main_cpu_s": main, "workers_cpu_s": workers, "time_s": time_s}

    jobs = [[row(1, 100, 9.0, 9.0, 9.0), row(2, 50, 0.5, 2.0, 2.0), row(3, 50, 0.5, 2.0, 2.5)],
            [row(1, 100, 9.0, 9.0, 9.0), row(2, 50, 1.5, 2.0, 1.0), row(3, 50, 0.5, 1.0, 2.0)]]
    split = cpu_split(jobs, epochs=3)
    assert split["main_cpu_ms_per_decoded_sample"] == pytest.approx(1000 * 3.0 / 200)  # epoch 1 left out
    assert split["workers_cpu_ms_per_decoded_sample"] == pytest.approx(1000 * 7.0 / 200)
    assert split["cores_busy"] == pytest.approx(statistics.median([6.0 / 2.0, 4.0 / 2.5]))
    assert cpu_split([[row(1, 10, 1.0, 1.0, 4.0)]], epochs=1)["cores_busy"] == pytest.approx(0.5)
