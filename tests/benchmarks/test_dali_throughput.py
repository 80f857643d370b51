"""``python -m benchmarks.dali_throughput`` end to end on a tiny dataset: the chosen systems, interleaved
repetitions with their spread, every steady epoch served from the cache, and the commit recorded; with a
stand-in step, what each loader leaves of the step's rate."""

import json
import os

import pytest

from tests.benchmarks._bench import run_module

pytestmark = pytest.mark.slow


def test_a_tiny_run_repeats_the_chosen_systems_interleaved(tmp_path, shm_namespace):
    out = tmp_path / "out"
    done = run_module("benchmarks.dali_throughput", ["--images", "64", "--epochs", "2", "--workers", "1", "--systems",
                                                     "feed", "coordl-torch", "--reps", "2", "--out", str(out)], tmp_path)
    assert done.returncode == 0, done.stderr
    with open(out / "results.json") as f:
        result = json.load(f)
    assert [(r["system"], r["rep"]) for r in result["runs"]] == [("feed", 0), ("coordl-torch", 0), ("feed", 1),
                                                                  ("coordl-torch", 1)]
    for run in result["runs"]:
        first, steady = run["epochs"]
        assert first["hits"] == 0 and steady["hits"] == steady["samples"] == 64  # epoch 1 filled the cache
    for system in ("feed", "coordl-torch"):
        s = result["summary"][system]["steady_samples_per_s"]
        assert s["n"] == 2 and s["min"] <= s["median"] <= s["max"] and s["min"] > 0
    assert len(result["provenance"]["git_sha"]) == 40 and result["machine"]["cpus"] == os.cpu_count()


def test_with_a_stand_in_step_each_loader_is_judged_by_what_it_leaves_of_the_steps_rate(tmp_path, shm_namespace):
    out = tmp_path / "out"
    busy, wait, batch = 2.0, 18.0, 16  # a step of 20 ms: 800 samples/s at most
    done = run_module("benchmarks.dali_throughput", ["--images", "64", "--epochs", "2", "--workers", "1",
                                                     "--batch-size", str(batch), "--step-ms", str(busy), str(wait),
                                                     "--systems", "feed", "dali-feed", "--out", str(out)], tmp_path)
    assert done.returncode == 0, done.stderr
    with open(out / "results.json") as f:
        result = json.load(f)
    assert result["step_ms"] == [busy, wait] and result["batch_size"] == batch
    for run in result["runs"]:
        steady = run["epochs"][1]
        assert steady["samples"] == 64 and steady["time_s"] >= 64 / batch * (busy + wait) / 1e3  # each batch stepped
        assert 0 < run["of_step"] <= 1 and abs(run["of_step"] - run["steady_samples_per_s"] / 800) < 1e-3
        assert 0 < steady["waited_s"] < steady["time_s"] and 0 < run["loop_waiting"] < 1
    coordl_feed, dali_feed = result["runs"]
    assert coordl_feed["epochs"][1]["hits"] == 64 and dali_feed["epochs"][1]["hits"] is None  # its reader: no cache
