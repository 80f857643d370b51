"""``python -m benchmarks.dali_throughput`` end to end on a tiny dataset: the chosen systems, interleaved
repetitions with their spread, every steady epoch served from the cache, and the commit recorded."""

import json
import os

from tests.benchmarks._bench import run_module


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
        s = result["summary"][system]
        assert s["n"] == 2 and s["min"] <= s["median"] <= s["max"] and s["min"] > 0
    assert len(result["provenance"]["git_sha"]) == 40 and result["machine"]["cpus"] == os.cpu_count()
