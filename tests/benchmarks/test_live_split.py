"""``python -m benchmarks.live_split``: the bootstrap interval, the summary's goal and switch checks on
constructed rounds, and a tiny run end to end."""

import json
import os
import random

import pytest

from benchmarks import live_split
from tests.benchmarks._bench import run_module


def test_the_interval_holds_the_median_and_narrows_with_more_rounds():
    rng = random.Random(1)
    few = [rng.gauss(1.0, 0.05) for _ in range(10)]
    many = few + [rng.gauss(1.0, 0.05) for _ in range(990)]
    for ratios in (few, many):
        r = live_split.median_interval(ratios)
        assert r["min"] <= r["low"] <= r["median"] <= r["high"] <= r["max"] and r["n"] == len(ratios)
    narrow, wide = live_split.median_interval(many), live_split.median_interval(few)
    assert narrow["high"] - narrow["low"] < (wide["high"] - wide["low"]) / 3  # about √100 narrower
    assert narrow["low"] < 1.0 < narrow["high"]
    assert live_split.median_interval([1.02] * 7) == {"median": 1.02, "low": 1.02, "high": 1.02, "min": 1.02,
                                                      "max": 1.02, "n": 7}


def _build(on_over_off: float, spread: float = 0.002, split_off: float = 0.0, workers: int = 0) -> dict:
    """Five rounds whose on/off ratios are ``on_over_off`` and that ± ``spread`` and ± half of it."""
    rounds = [{"on": 100.0, "off": 100.0 / (on_over_off + d * spread), "on2": 100.0} for d in (-1, -0.5, 0, 0.5, 1)]
    return {"workload": "bytes", "workers": workers, "rounds": rounds,
            "live_split_s": {"on": 0.5, "off": split_off, "on2": 0.4}}


@pytest.mark.parametrize("ratio, spread, shown", [(1.0, 0.002, True), (0.995, 0.002, True), (0.985, 0.002, False),
                                                  (0.993, 0.02, False)])  # the last: the median over, the interval not
def test_the_goal_is_shown_only_where_the_whole_interval_is_at_or_above_0_99(ratio, spread, shown):
    point, = live_split.summarize([_build(ratio, spread), _build(ratio, spread)])
    r = point["on_over_off"]
    assert r["median"] == pytest.approx(ratio) and r["n"] == 10 and r["low"] < r["median"] < r["high"]
    assert point["goal_shown"] is shown and point["switch_checked"]
    assert (r["low"] >= live_split.GOAL) is shown


def test_a_build_whose_off_loader_timed_anything_fails_the_switch_check():
    points = live_split.summarize([_build(1.0), _build(1.0, split_off=0.01), _build(1.0, workers=2)])
    assert [(p["workers"], p["switch_checked"]) for p in points] == [(0, False), (2, True)]
    assert "the switch did not hold" in live_split.markdown(points)


@pytest.mark.slow
def test_a_tiny_run_measures_on_off_and_on2_side_by_side(tmp_path, shm_namespace):
    out = tmp_path / "out"
    done = run_module("benchmarks.live_split", ["--images", "96", "--mean-side-px", "40", "--workers", "0", "1",
                                                 "--workloads", "image", "--builds", "2", "--rounds", "3", "--block-s",
                                                 "0.01", "--out", str(out)], tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads((out / "results.json").read_text())
    assert [(b["workers"], b["build"], b["built_in"][0]) for b in result["builds"]] == [
        (0, 0, "on"), (1, 0, "on"), (0, 1, "off"), (1, 1, "off")]  # the build order rotates
    for build in result["builds"]:
        assert len(build["rounds"]) == 3 and build["epochs_per_block"] >= 1 and build["block_s"] > 0
        assert all(rates[s] > 0 for rates in build["rounds"] for s in live_split.SYSTEMS)
        split = build["live_split_s"]  # off's clock read a constant, in its worker too; on's did not
        assert split["off"] == 0 and split["on"] > 0 and split["on2"] > 0
    for point in result["points"]:
        assert point["switch_checked"] and point["on_over_off"]["n"] == point["on_over_on2"]["n"] == 6
    assert len(result["setup"]["provenance"]["git_sha"]) == 40
    assert "| image | 1 |" in (out / "results.md").read_text()
    assert [name for name in os.listdir(tmp_path) if name.startswith("coordl-live-split-")] == []
    assert os.listdir(shm_namespace) == []  # its caches' folder is gone
