"""``python -m benchmarks.heldout``: the held-out grid differs from the grid the model was tuned on in every
configuration, and its quick run analyzes and measures end to end."""

import json
import os
import sys

import pytest

from benchmarks import analyzer, heldout
from harness.storage_env import cgroup_version
from tests.benchmarks._bench import CLEANUP_GRACE_S, REPO, run_to_end

RUN_S = 600


def test_no_held_out_configuration_is_one_the_model_was_tuned_on():
    tuned = {("decode", 16, w, 20.0) for w in analyzer.FULL["workers"]}  # 600 JPEGs of ~400 px, its datasets
    assert all((images, side) != (600, 400) for images, side in heldout.DATASETS.values())
    configs = heldout.rows(quick=False)
    assert not [c for c in configs if (c["workload"], c["batch_size"], c["workers"], c["step_ms"]) in tuned]
    assert {c["workers"] for c in configs} == {0, 1, 2, 4} and {c["workload"] for c in configs} == {"decode", "bytes"}
    assert len({c["batch_size"] for c in configs}) >= 3 and len(set(heldout.DATASETS)) == 2


@pytest.mark.slow
@pytest.mark.timeout(RUN_S + CLEANUP_GRACE_S + 60)
def test_quick_run(tmp_path):
    out = tmp_path / "out"
    run = run_to_end([sys.executable, "-m", "benchmarks.heldout", "--quick", "--iters", "6", "--warmup", "1",
                      "--epochs", "2", "--out", str(out)], RUN_S, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    if not cgroup_version():
        assert run.returncode == 2 and "needs root and cgroups" in run.stderr
        return
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    (config,) = result["configs"]
    assert config["error"] == pytest.approx(config["predicted_samples_per_s"] / config["measured_samples_per_s"] - 1)
    assert set(config["trust"]) == {"why", "range", "withheld"} and config["over_budget"] == []
    assert "held-out grid" in (out / "results.md").read_text()
    assert "sources" in json.loads((out / "setup.json").read_text())["provenance"]
