"""``python -m benchmarks.analyzer --quick`` end to end: each configuration analyzed and measured on the
throttled loop device (one of them over two servers), the errors computed from them, and nothing left
behind."""

import glob
import json
import os
import sys

import pytest

from harness.storage_env import BUDGET_TOLERANCE_MIN_BYTES, PREFIX, SLACK_BYTES, cgroup_version
from tests.benchmarks._bench import CLEANUP_GRACE_S, REPO, run_to_end

RUN_S = 780
"""A quick run takes about 300 s on two cores; it may take this long before it is stopped."""


def _leftovers() -> set[str]:
    return set(glob.glob(f"/var/tmp/{PREFIX}-*") + glob.glob(f"/sys/fs/cgroup/*/{PREFIX}-analyzer-*"))


@pytest.mark.slow
@pytest.mark.timeout(RUN_S + CLEANUP_GRACE_S + 60)
def test_quick_run(tmp_path):
    before = _leftovers()
    out = tmp_path / "out"
    run = run_to_end([sys.executable, "-m", "benchmarks.analyzer", "--quick", "--images", "48", "--iters", "6",
                      "--warmup", "1", "--epochs", "2", "--out", str(out)], RUN_S,
                     cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    if not cgroup_version():
        assert run.returncode == 2 and "needs root and cgroups" in run.stderr
        return
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    configs = result["configs"]
    assert sorted((c["servers"], c["cache_fraction"]) for c in configs) == [(1, 0.0), (1, 1.0), (2, 0.25)]
    for c in configs:
        assert c["error"] == pytest.approx(c["predicted_samples_per_s"] / c["measured_samples_per_s"] - 1)
        assert c["measured_spread"]["n"] == c["predicted_spread"]["n"] == 1
        assert c["analysis_s"] > 0 and 0 < c["contention"] <= 1
        assert (out / "analyses").is_dir()
    errors = sorted(abs(c["error"]) for c in configs)
    assert result["max_abs_error"] == errors[-1] and result["median_abs_error"] == pytest.approx(errors[1])
    two = next(c for c in configs if c["servers"] == 2)  # each server caches a quarter: half the misses' bytes
    assert two["rates"]["R"] > 0 and len(two["servers_predicted"]) == 2
    assert two["predicted_samples_per_s"] == min(two["servers_predicted"])
    assert two["peer_hit_fraction"][0] > 0  # the steady epoch took some of its misses from the other server
    assert len(glob.glob(str(out / "analyses" / "config-*" / "server1" / "analysis.json"))) == 1
    cold, cached = sorted((c for c in configs if c["servers"] == 1), key=lambda c: c["cache_fraction"])
    assert cold["bottleneck"] == "fetch"  # 4 MB/s and no cache: each miss waits about 4x a sample's prep
    assert min(cold["device_bytes_per_epoch"]) >= 0.9 * result["dataset_bytes"]  # every epoch from the device
    assert max(cached["device_bytes_per_epoch"]) <= 0.6 * result["dataset_bytes"]  # 1 of 2 epochs
    assert cold["run_miss_wait_s"][0] > 0 and cached["run_miss_wait_s"] == [None]  # the steady epoch: no misses
    assert 0 < cold["run_prep_s_per_sample"][0] < 1 and cold["analysis_L"][0] > 0
    assert cold["analysis_P"] == [cold["rates"]["P"]]
    for c in configs:  # memory bounded: every analysis and run followed, its page cache held to the slack
        assert len(c["memory"]) == 2 * c["servers"] and c["over_budget"] == []
        for m in c["memory"]:
            assert m["limit_hits"] is not None and m["peak_held_bytes"] > 0
            assert m["p99_page_cache_bytes"] <= SLACK_BYTES + BUDGET_TOLERANCE_MIN_BYTES
    assert max(m["peak_shmem_bytes"] for m in cached["memory"]) >= 0.9 * result["dataset_bytes"]  # the cache
    assert result["page_cache_budget_bytes"] == 0 and result["over_budget"] == []
    setup = json.loads((out / "setup.json").read_text())
    assert setup["provenance"]["git_sha"] and setup["settings"]["reps"] == 1
    assert "| 1 | 100% | 4 |" in (out / "results.md").read_text()
    assert _leftovers() == before


@pytest.mark.slow
@pytest.mark.timeout(RUN_S + CLEANUP_GRACE_S + 60)
def test_quick_run_of_a_dali_job(tmp_path):
    """The job on the DALI backend (on the CPU), at a cache of half the dataset (hits and misses): analyzed
    with Q measured on a twin of its pipeline, and measured (the grid's configurations are the torch run's
    to cover; the DALI analyses at no cache and a whole one are ``tests/integration/test_analyzer.py``'s)."""
    before = _leftovers()
    out = tmp_path / "out"
    run = run_to_end([sys.executable, "-m", "benchmarks.analyzer", "--quick", "--servers", "0", "--backend", "dali",
                      "--fractions", "0.5", "--images", "48", "--iters", "6", "--warmup", "1", "--epochs", "2", "--out", str(out)],
                     RUN_S, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    if not cgroup_version():
        assert run.returncode == 2 and "needs root and cgroups" in run.stderr
        return
    assert run.returncode == 0, run.stderr[-3000:]
    configs = json.loads((out / "results.json").read_text())["configs"]
    assert [c["cache_fraction"] for c in configs] == [0.5] and configs[0]["measured_samples_per_s"] > 0
    assert 0 < configs[0]["hit_fraction"][0] < 1
    analyses = [json.loads(open(p).read()) for p in glob.glob(str(out / "analyses" / "**" / "analysis.json"),
                                                              recursive=True)]
    assert len(analyses) == 1
    for analysis in analyses:
        rates = analysis["phases"]["rates"]
        assert rates["backend"] == "dali" and rates["fetch_threads"] == 1 and rates["Q"] > 0
        assert 0 < analysis["contention"] <= 1
    assert json.loads((out / "setup.json").read_text())["settings"]["backend"] == "dali"
    assert _leftovers() == before


def test_settings_that_leave_nothing_to_run_are_refused_before_anything_is_made(tmp_path):
    run = run_to_end([sys.executable, "-m", "benchmarks.analyzer", "--quick", "--analyses", "2", "--out",
                      str(tmp_path / "out")], 120, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert run.returncode == 2 and "--analyses should be from 1 to the runs per configuration (1)" in run.stderr
    assert not (tmp_path / "out").exists()
    alone = run_to_end([sys.executable, "-m", "benchmarks.analyzer", "--multi-server-only", "--servers", "1",
                        "--out", str(tmp_path / "out")], 120, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert alone.returncode == 2 and "--multi-server-only needs --servers of 2 or more, not 1" in alone.stderr
    assert not (tmp_path / "out").exists()


def test_the_grid_takes_the_given_fractions_bandwidths_and_workers():
    from benchmarks.analyzer import FULL, _configs, checked_grid, parse_args
    assert checked_grid(parse_args(["--out", "x"])) == FULL
    grid = checked_grid(parse_args(["--out", "x", "--fractions", "0.5", "1", "--mbps", "20", "--workers", "2"]))
    assert grid == {**FULL, "fractions": (0.5, 1.0), "mbps": (20.0,), "workers": (2,)}
    configs = _configs(grid, 1, dataset_bytes=1000, sizes=[300, 700])
    assert [(c["cache_fraction"], c["read_mbps"], c["workers"], c["cache_bytes"]) for c in configs] == \
        [(0.5, 20.0, 2, 500), (1.0, 20.0, 2, 1700)]  # all of it: room for the largest file besides


@pytest.mark.parametrize("argv, message", [
    (["--fractions", "0.5", "1.5"], "--fractions should be cache fractions from 0 to 1, not [0.5, 1.5]"),
    (["--mbps", "0"], "--mbps should be storage bandwidths above 0, not [0.0]"),
    (["--workers", "0", "1"], "--workers should be 1 or more, not [0, 1]"),
])
def test_a_grid_setting_that_is_off_is_named_before_anything_is_made(tmp_path, argv, message):
    run = run_to_end([sys.executable, "-m", "benchmarks.analyzer", *argv, "--out", str(tmp_path / "out")], 120,
                     cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert run.returncode == 2 and message in run.stderr
    assert not (tmp_path / "out").exists()
