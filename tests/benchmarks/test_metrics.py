"""Derived figures: estimated page-cache hits, steady means, speedups and the physical bound."""

import pytest

from benchmarks.metrics import add_hits, summarize

MB = 10**6


def _run(system, fraction, times, device, cache=None, hits=None):
    epochs = [{"epoch": i + 1, "time_s": t, "samples": 100, "batches": 4, "samples_per_s": 100 / t,
               "stall_s": t / 2, "device_read_bytes": d} for i, (t, d) in enumerate(zip(times, device))]
    if hits is not None:
        for e, h in zip(epochs, hits):
            e["hits"] = h
    return {"system": system, "cache_fraction": fraction, "epochs": epochs, "cache": cache}


def test_hits_estimated_for_the_page_cache_and_counted_for_coordl():
    sizes = [MB] * 100
    torch_run = _run("torch", 0.5, [10, 8], [100 * MB, 80 * MB])
    coordl_run = _run("coordl", 0.5, [10, 5], [100 * MB, 50 * MB], hits=[0, 50])
    for run in (torch_run, coordl_run):
        add_hits(run, sizes)
    assert [e["hits"] for e in torch_run["epochs"]] == [0, 20]
    assert torch_run["epochs"][1]["hits_source"] == "estimated from device bytes"
    assert [e["hit_rate"] for e in coordl_run["epochs"]] == [0.0, 0.5]
    assert coordl_run["epochs"][1]["simulated_hit_rate"] == 0.5  # MinIO, equal sizes
    assert 0 < torch_run["epochs"][1]["simulated_hit_rate"] < 0.5  # LRU thrashes


def test_speedups_and_bounds():
    sizes = [MB] * 100
    runs = [_run("torch", 0.5, [10, 8, 8], [100 * MB, 80 * MB, 80 * MB]),
            _run("coordl", 0.5, [10, 5, 6], [100 * MB] + [50 * MB] * 2, cache={"bytes_cached": 50 * MB}, hits=[0, 50, 50]),
            _run("coordl", 1.0, [10, 3, 3], [100 * MB, 0, 0], cache={"bytes_cached": 100 * MB}, hits=[0, 100, 100]),
            {"system": "dali-seq", "cache_fraction": 0.5, "skipped": "no DALI", "epochs": []},
            _run("prep-torch", 1.0, [2, 2, 2], [0, 0, 0])]
    for run in runs[:3] + runs[4:]:
        add_hits(run, sizes)
    summarize(runs, dataset_bytes=100 * MB, bandwidth=10 * MB, compute_ms=100)
    half = runs[1]["steady"]
    assert half["time_s"] == 5.5 and half["min_device_read_bytes"] == 50 * MB
    assert half["io_bound_s"] == 5.0 and half["compute_bound_s"] == pytest.approx(0.4) and half["prep_bound_s"] == 2.0
    assert half["bound_s"] == 5.0 and half["of_bound"] == pytest.approx(1.1)
    assert half["speedup"] == {"torch": pytest.approx(8 / 5.5)}
    assert runs[0]["steady"]["excess_read"] == pytest.approx(80 / 50 - 1) and runs[0]["steady"]["speedup"] == {}
    assert runs[2]["steady"]["bound_s"] == 2.0 and "steady" not in runs[3]  # the prep bound: not coordl's own
    assert runs[2]["steady"]["of_bound"] == 1.5 and runs[4]["steady"]["speedup"] == {}
    assert runs[4]["epochs"][1]["hit_rate"] == 1.0


def test_repetitions_pair_speedups_within_a_repetition_and_report_their_spread():
    sizes = [MB] * 100
    runs = []
    for rep, (torch_t, coordl_t) in enumerate([(8, 4), (9, 6), (10, 4)]):
        runs += [{**_run("torch", 0.5, [10, torch_t], [100 * MB, 80 * MB]), "rep": rep},
                 {**_run("coordl", 0.5, [10, coordl_t], [100 * MB, 50 * MB], cache={"bytes_cached": 50 * MB},
                         hits=[0, 50]), "rep": rep}]
    runs.append({**_run("torch", 0.5, [1, 1], [0, 0]), "rep": 3, "error": "page cache over budget"})
    for run in runs:
        add_hits(run, sizes)
    comparisons = summarize(runs, dataset_bytes=100 * MB, bandwidth=10 * MB, compute_ms=0)
    assert [run["steady"]["speedup"] for run in runs[1:6:2]] == [{"torch": 2.0}, {"torch": 1.5}, {"torch": 2.5}]
    assert "steady" not in runs[-1]  # a run over its budget is no measurement
    by_system = {c["system"]: c for c in comparisons}
    assert by_system["torch"]["time_s"] == {"median": 9, "min": 8, "max": 10, "n": 3}
    assert by_system["coordl"]["speedup"]["torch"] == {"median": 2.0, "min": 1.5, "max": 2.5, "n": 3}
    assert by_system["coordl"]["device_read_bytes"]["median"] == 50 * MB
