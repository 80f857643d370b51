"""``python -m benchmarks.knees --quick`` end to end: the predicted knees from real analyses, the job measured
across caches and workers on the throttled loop device, the knees read off those runs, and nothing left
behind; the knee itself on constructed curves."""

import glob
import json
import os
import sys

import pytest

from benchmarks.knees import knee
from harness.storage_env import PREFIX, cgroup_version
from tests.benchmarks._bench import CLEANUP_GRACE_S, REPO, run_to_end

RUN_S = 780
"""How long the quick run may take before it is stopped."""


def test_a_knee_is_the_least_setting_within_the_tolerance_of_the_best():
    curve = {0.0: 100.0, 0.25: 180.0, 0.5: 292.0, 0.75: 300.0, 1.0: 299.0}
    assert knee(curve, 0.03) == 0.5 and knee(curve, 0.0) == 0.75 and knee(curve, 0.5) == 0.25


@pytest.mark.slow
@pytest.mark.timeout(RUN_S + CLEANUP_GRACE_S + 60)
def test_quick_run(tmp_path):
    leftovers = lambda: set(glob.glob(f"/var/tmp/{PREFIX}-*") + glob.glob(f"/sys/fs/cgroup/*/{PREFIX}-analyzer-*"))
    before = leftovers()
    out = tmp_path / "out"
    run = run_to_end([sys.executable, "-m", "benchmarks.knees", "--quick", "--images", "48", "--iters", "6",
                      "--warmup", "1", "--epochs", "2", "--out", str(out)], RUN_S, cwd=REPO,
                     env={**os.environ, "PYTHONPATH": REPO})
    if not cgroup_version():
        assert run.returncode == 2 and "needs root and cgroups" in run.stderr
        return
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    setting, = result["settings"]
    curve = {c["cache_fraction"]: c["measured"]["median"] for c in setting["curve"]}
    assert sorted(curve) == [0.0, 0.5, 1.0] and all(c["measured"]["n"] == 1 for c in setting["curve"])
    assert setting["measured_cache_knee"] == knee(curve, result["within"])
    assert setting["predicted_cache_knee"] is None or 0 <= setting["predicted_cache_knee"] <= 1
    workers = result["workers"]
    assert [c["workers"] for c in workers["curve"]] == list(range(1, len(os.sched_getaffinity(0)) + 1))
    assert workers["measured_workers_knee"] == knee({c["workers"]: c["measured"]["median"]
                                                     for c in workers["curve"]}, result["within"])
    assert "predicted cache knee" in (out / "results.md").read_text()
    assert json.loads((out / "setup.json").read_text())["provenance"]["git_sha"]
    assert leftovers() == before
