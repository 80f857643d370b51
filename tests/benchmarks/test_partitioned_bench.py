"""benchmarks.partitioned: its plan, per-server cache sizes and summary, and a tiny run end to end."""

import json
import os

import pytest

from benchmarks import partitioned
from harness.storage_env import PREFIX


def test_the_plan_interleaves_and_rotates_every_mode_and_cache():
    runs = partitioned.plan(2, 3, partitioned.MODES)
    points = {(r["mode"], r["aggregate_cache_fraction"]) for r in runs}
    assert points == {("full-local", 2.0), ("uncoordinated", 0.5), ("partitioned", 0.5), ("uncoordinated", 1.0),
                      ("partitioned", 1.0), ("locality", 1.0), ("peer-death", 1.0)}
    assert len(runs) == 21 and all(r["nodes"] == 2 for r in runs)
    firsts = [runs[rep * 7]["mode"] for rep in range(3)]
    assert len(set(firsts)) == 3  # no mode always runs first
    assert {r["mode"] for r in partitioned.plan(4, 1, ["partitioned"])} == {"partitioned"}


def test_caches_at_100_percent_hold_every_item_despite_fragments():
    sizes = [4096 * k for k in (7, 30, 11, 25, 2, 19)]
    total = sum(sizes)
    assert partitioned.cache_bytes(0.5, sizes, 2) == total // 4
    assert partitioned.cache_bytes(1.0, sizes, 2) == total // 2 + max(sizes)
    assert partitioned.cache_bytes(2.0, sizes, 2) == total + max(sizes)


def _run(mode, fraction, times, device, peers, rep=0, handed=0, page_cache=2**20, over=()):
    return {"mode": mode, "aggregate_cache_fraction": fraction, "rep": rep, "over_budget": list(over),
            "epochs": [{"epoch": i + 1, "time_s": t, "device_read_bytes": d, "storage_bytes": d, "peer_bytes": p,
                        "stall_s": 0.0, "longest_wait_s": 0.1}
                       for i, (t, d, p) in enumerate(zip(times, device, peers))],
            "servers": [{"peers": [{"handed_off_bytes": handed}], "memory": {"p99_page_cache_bytes": page_cache}},
                        {"peers": [{"handed_off_bytes": 0}], "memory": {"p99_page_cache_bytes": 0}}]}


def test_the_summary_compares_steady_epochs_with_the_references():
    d = 1000
    runs = [_run("full-local", 2.0, [9, 1, 1], [0, 0, 0], [0, 0, 0]),
            _run("uncoordinated", 1.0, [9, 5, 5], [d, 500, 500], [0, 0, 0]),
            _run("partitioned", 1.0, [9, 1.2, 1.0], [d, 2, 0], [0, 480, 500], handed=10),
            _run("partitioned", 1.0, [9, 1.0, 1.2], [d, 0, 0], [0, 500, 500], rep=1, handed=30, page_cache=3 * 2**20,
                 over=["page cache over budget"])]
    rows = {(r["mode"], r["aggregate_cache_fraction"]): r for r in partitioned.summarize(runs, d)}
    part = rows[("partitioned", 1.0)]
    assert part["epoch1_device_fraction"]["median"] == 1.0
    assert part["later_device_fraction"] == {"median": 0.0, "min": 0.0, "max": 0.002, "n": 4}
    assert part["steady_epoch_s"]["median"] == pytest.approx(1.1)
    assert part["vs_full_local"] == pytest.approx(1.1)
    assert part["speedup_vs_uncoordinated"] == pytest.approx(5 / 1.1)
    assert rows[("uncoordinated", 1.0)]["speedup_vs_uncoordinated"] is None
    assert part["handed_off_fraction"] == {"median": 0.02, "min": 0.01, "max": 0.03, "n": 2}
    assert part["page_cache_p99_bytes"] == 3 * 2**20 and part["over_budget"] == 1
    text = partitioned.markdown(list(rows.values()), {"config": {"nodes": 2, "read_mbps": 2, "reps": 2},
                                                       "dataset_bytes": d, "provenance": {"command": "x", "git_sha": "y"}})
    assert "| partitioned | 100% | 1.000 [1.000–1.000] | 0.000 [0.000–0.002] |" in text
    assert "| 3.0 (over budget) |" in text


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_tiny_run_measures_every_epoch_and_leaves_nothing(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("benchmarks.partitioned needs root (namespaces, cgroups, a loop device)")
    out = str(tmp_path / "out")
    assert partitioned.main(["--files", "40", "--epochs", "2", "--reps", "1", "--modes", "uncoordinated", "partitioned",
                             "--read-mbps", "20", "--batch-size", "4", "--workdir", str(tmp_path), "--out", out]) == 0
    result = json.load(open(os.path.join(out, "results.json")))
    assert {r["mode"] for r in result["runs"]} == {"uncoordinated", "partitioned"}
    for run in result["runs"]:
        first, second = run["epochs"]
        assert first["device_read_bytes"] >= result["dataset_bytes"] and first["peer_bytes"] == 0
        assert not run["shm_left"] and not run["over_budget"]
        assert all(s["memory"]["samples"] > 0 for s in run["servers"])  # each server's memory was bounded
        if run["mode"] == "partitioned":
            assert second["peer_bytes"] > 0 and second["device_read_bytes"] <= first["device_read_bytes"]
        else:
            assert second["peer_bytes"] == 0
    assert os.path.exists(os.path.join(out, "results.md"))
    assert not [d for d in os.listdir(tmp_path) if d.startswith(PREFIX)]
