"""``python -m benchmarks.hotpath`` end to end on a tiny dataset: every point measured side by side,
the fetch cost measured, and nothing left behind."""

import json
import os

import pytest

from tests.benchmarks._bench import run_module

pytestmark = pytest.mark.slow


def test_a_tiny_hot_path_run_measures_both_loaders_at_every_point(tmp_path, shm_namespace):
    out = tmp_path / "out"
    done = run_module("benchmarks.hotpath", ["--images", "64", "--mean-side-px", "40", "--workers", "0", "1", "--reps",
                                             "2", "--epochs", "1", "--out", str(out)], tmp_path)
    assert done.returncode == 0, done.stderr
    with open(out / "results.json") as f:
        result = json.load(f)
    assert [(p["workload"], p["workers"]) for p in result["points"]] == [("image", 0), ("image", 1), ("bytes", 0),
                                                                         ("bytes", 1)]
    assert len(result["trials"]) == 2 * 4 * 2 and all(t["samples_per_s"] > 0 for t in result["trials"])
    for p in result["points"]:
        ratio = p["coordl_over_torch"]
        assert ratio["n"] == 2 and ratio["min"] <= ratio["median"] <= ratio["max"]
    assert result["fetch_cost"]["coordl_hit_us"] > 0 and result["fetch_cost"]["read_file_us"] > 0
    assert len(result["setup"]["provenance"]["git_sha"]) == 40
    assert [name for name in os.listdir(tmp_path) if name.startswith("coordl-hotpath-")] == []
    assert os.listdir(shm_namespace) == []  # its caches' folder is gone


def test_untimed_coordl_reads_no_clock_in_the_workers_and_is_compared_with_coordl(tmp_path, shm_namespace):
    from benchmarks import hotpath
    from coordl._demo.synthetic import make_image_folder

    root = str(tmp_path / "images")
    make_image_folder(root, 32, mean_side_px=40, seed=3)
    prep_s = {}
    for system in ("coordl", "coordl-untimed"):
        with hotpath.clock(system):
            dl = hotpath.loader(system, root, "image", 1, 8, seed=0)
            hotpath.samples_per_s(dl, epochs=1)
            prep_s[system] = dl.stats().total.prep_s
            dl.close()
    assert prep_s["coordl"] > 0 and prep_s["coordl-untimed"] == 0  # the worker's clock read 0 throughout
    out = tmp_path / "out"
    done = run_module("benchmarks.hotpath", ["--images", "32", "--mean-side-px", "40", "--workers", "0", "--workloads",
                                             "bytes", "--systems", "coordl", "coordl-untimed", "--reps", "2", "--epochs",
                                             "1", "--out", str(out)], tmp_path)
    assert done.returncode == 0, done.stderr
    with open(out / "results.json") as f:
        result = json.load(f)
    point, = result["points"]
    assert "coordl_over_torch" not in point and point["timed_over_untimed"]["n"] == 2
    timers, = result["timer_cost"]  # the clock's cost in-process, on the workload measured
    assert timers["workload"] == "bytes" and timers["timed_batch_us"]["n"] == timers["untimed_batch_us"]["n"] == 15
    assert timers["cost_us"] == timers["timed_batch_us"]["min"] - timers["untimed_batch_us"]["min"]
    assert timers["cost_fraction"] == timers["cost_us"] / timers["timed_batch_us"]["min"]
    # on the hit path the prep timer is read once a batch: 2 clock reads; one timer well under a µs
    assert timers["clock_reads_per_batch"] == 2 and 0 < timers["timer_us"] < 1
    assert timers["bound_fraction"] == timers["timer_us"] / timers["timed_batch_us"]["min"]
    text = (out / "results.md").read_text()
    assert "coordl / coordl-untimed" in text and "The live split's clock, in-process, bytes batches" in text
    assert "2 clock reads a batch" in text
