"""DS-Analyzer's model on constructed rates: F(x), min(F, P, G), the bottleneck, the stall split, the what-if
knees and ``analysis.json``."""

import dataclasses
import json

import pytest

from coordl import analyzer, cli
from coordl._core import sizes
from coordl.analyzer import Pipeline

BASE = dict(samples=10_000, sample_bytes=100_000.0, G=900.0, P=600.0, S=150.0, C=50_000.0, cache_fraction=0.3,
            workers=4, cores=8)


@pytest.mark.parametrize("fetchers", [dict(workers=1), dict(workers=0), dict(workers=4),
                                      dict(workers=1, fetch_threads=2)])
def test_the_fetch_rate_is_the_papers_equation_4_for_one_fetcher_and_the_busiest_source_for_several(fetchers):
    p = Pipeline(**{**BASE, **fetchers})
    d, x = p.samples, p.cache_fraction
    several = max(p.workers, p.fetch_threads) > 1  # the cache and storage serve different fetchers at once
    expected = d / max(d * x / p.C, d * (1 - x) / p.S) if several else d / (d * x / p.C + d * (1 - x) / p.S)
    assert p.fetch_rate == pytest.approx(expected)
    assert Pipeline(**{**BASE, **fetchers, "cache_fraction": 0.0}).fetch_rate == pytest.approx(p.S)
    assert Pipeline(**{**BASE, **fetchers, "cache_fraction": 1.0}).fetch_rate == pytest.approx(p.C)


@pytest.mark.parametrize("x, bottleneck", [(0.0, "fetch"), (0.5, "fetch"), (0.9, "prep")])
def test_the_prediction_is_the_least_rate_and_names_it(x, bottleneck):
    p = Pipeline(**{**BASE, "cache_fraction": x})
    assert p.predicted == min(p.fetch_rate, p.P, p.G)
    assert p.bottleneck == bottleneck
    fast_prep = Pipeline(**{**BASE, "cache_fraction": x, "P": 5000.0})
    assert fast_prep.bottleneck == ("fetch" if x < 0.9 else "ingestion")


def test_without_workers_fetch_prep_and_the_step_take_turns():
    p = Pipeline(**{**BASE, "workers": 0})
    assert p.predicted == pytest.approx(1 / (1 / p.fetch_rate + 1 / p.P + 1 / p.G))
    stall = p.stalls()
    assert stall["prep_s"] == pytest.approx(p.samples / p.P)
    assert stall["fetch_s"] == pytest.approx(p.samples / p.fetch_rate)
    assert p.workers_knee() == 2  # at least one worker; P was measured on one process: 600 samples/s each


def test_the_stall_split_adds_up_to_the_predicted_epoch_and_a_measured_one_adds_what_it_leaves_unexplained():
    p = Pipeline(**BASE)
    for measured in (None, 180.0):
        stall = p.stalls(measured)
        assert stall["ideal_s"] + stall["prep_s"] + stall["fetch_s"] == pytest.approx(p.samples / p.predicted)
        assert stall["prep_s"] == pytest.approx(p.samples / p.P - p.samples / p.G)
    assert p.stalls(180.0)["unexplained_s"] == pytest.approx(p.samples / 180.0 - p.samples / p.predicted)


def test_a_run_slower_than_predicted_with_every_sample_cached_books_no_fetch_stall():
    cached = Pipeline(**{**BASE, "cache_fraction": 1.0, "C": 50_000.0})  # F is 50,000 samples/s
    assert cached.fetch_rate == pytest.approx(50_000.0)
    stall = cached.stalls(cached.predicted / 2)  # a run at half the prediction
    assert stall["fetch_s"] == 0.0 and stall["unexplained_s"] == pytest.approx(cached.samples / cached.predicted)
    fast_storage = Pipeline(**{**BASE, "S": 5000.0})
    for p in (cached, fast_storage, Pipeline(**BASE), Pipeline(**{**BASE, "cache_fraction": 0.9})):
        knee = p.cache_knee()  # "the smallest cache that removes the fetch stall" agrees with the split
        assert (p.stalls(p.predicted / 3)["fetch_s"] == 0) == (knee is not None and knee <= p.cache_fraction + 1e-6)
    assert fast_storage.cache_knee() == 0.0 and fast_storage.stalls(10.0)["fetch_s"] == 0.0


def test_the_cache_knee_is_where_fetching_meets_prep():
    p = Pipeline(**BASE)
    knee = p.cache_knee()
    target = min(p.P, p.G)
    assert p.with_changes(cache_fraction=knee).fetch_rate == pytest.approx(target, rel=1e-4)
    assert p.with_changes(cache_fraction=knee - 0.01).fetch_rate < target
    assert Pipeline(**{**BASE, "S": 1000.0}).cache_knee() == 0.0  # storage alone keeps up
    assert Pipeline(**{**BASE, "C": 500.0}).cache_knee() is None  # the cache itself is slower than prep


def test_workers_scale_prep_up_to_the_cores():
    p = Pipeline(**BASE)  # 150 samples/s per process
    assert p.with_changes(workers=2).P == pytest.approx(300.0)
    assert p.with_changes(workers=0).P == pytest.approx(150.0)  # the main process alone
    assert p.with_changes(workers=32).P == pytest.approx(1200.0)  # 8 cores
    assert p.workers_knee() == 6  # 6 × 150 = G
    assert Pipeline(**{**BASE, "G": 5000.0}).workers_knee() is None


def test_a_worker_waits_for_its_misses_before_it_prepares_them():
    p = Pipeline(**{**BASE, "S": 1000.0, "L": 0.004, "workers": 2})  # P = 600 on 2 processes: 300 each
    each = 1 / (1 / 300 + (1 - p.cache_fraction) * 0.004)  # one worker: its prep, then its misses' waits
    assert p.worker_rate == pytest.approx(2 * each)
    assert p.predicted == p.worker_rate < min(p.P, p.fetch_rate, p.G) and p.bottleneck == "prep"
    stall = p.stalls()  # the waits are time lost to fetching
    assert stall["prep_s"] == pytest.approx(p.samples / p.P - p.samples / p.G)
    assert stall["fetch_s"] == pytest.approx(p.samples / p.worker_rate - p.samples / p.P)
    assert Pipeline(**{**BASE, "workers": 2}).worker_rate == 600.0  # L = 0: fetching overlaps prep
    assert p.with_changes(cache_fraction=1.0).worker_rate == 600.0  # no misses, no waits
    assert p.with_changes(workers=16).worker_rate == pytest.approx(2400.0)  # 16 on 8 cores: waits hidden
    assert dataclasses.replace(p, G=1500.0).workers_knee() == 10  # past the cores, to cover the waits
    assert dataclasses.replace(p, G=1500.0, L=0.0).workers_knee() == 5  # without: 1500 / 300 per process
    with pytest.raises(ValueError, match="L should"):
        Pipeline(**{**BASE, "L": -1.0})


def test_workers_that_wait_longer_for_their_misses_than_they_prepare_are_held_by_fetching():
    """One worker, no cache: 0.5 ms of prep and 4 ms of waiting per sample, so W = 1 / 4.5 ms = 222, below
    S (300) and G: the workers' rate binds, and the stall is fetching's. With 1/600 s of prep and 1 ms of
    waiting, prep holds them."""
    p = Pipeline(**{**BASE, "workers": 1, "cache_fraction": 0.0, "P": 2000.0, "S": 300.0, "L": 0.004})
    assert p.worker_rate == pytest.approx(1 / 0.0045) and p.predicted == p.worker_rate
    assert p.bottleneck == "fetch"
    assert p.stalls()["prep_s"] == 0 and p.stalls()["fetch_s"] > 0
    assert Pipeline(**{**BASE, "workers": 1, "cache_fraction": 0.0, "S": 1000.0, "L": 0.001}).bottleneck == "prep"


def test_dali_fetches_ahead_so_its_threads_waits_bound_fetching_not_prep():
    """The DALI backend: ``fetch_threads`` threads fetch batches ahead of its prep threads (``workers``)."""
    p = Pipeline(**{**BASE, "S": 1000.0, "L": 0.004, "workers": 2, "fetch_threads": 2})
    assert p.worker_rate == p.P == 600.0  # prep never waits for a miss
    threads = 2 / ((1 - p.cache_fraction) * 0.004)  # each thread waits L per miss: 714 samples/s
    assert p.fetch_rate == pytest.approx(threads) and threads < 1 / (0.3 / p.C + 0.7 / p.S)
    assert p.predicted == pytest.approx(600.0) and p.bottleneck == "prep"
    one = p.with_changes(workers=1)  # coordl's DALI backend: as many fetch threads as prep threads
    assert one.fetch_threads == 1 and one.fetch_rate == pytest.approx(threads / 2)
    assert dataclasses.replace(p, P=1200.0).bottleneck == "fetch"  # the threads' waits, not the storage's rate
    assert p.with_changes(workers=0).fetch_threads == 1
    assert p.with_changes(cache_fraction=1.0).fetch_rate == pytest.approx(p.C)  # no misses, no waits
    assert Pipeline(**{**BASE, "workers": 2}).with_changes(workers=4).fetch_threads == 0  # torch stays torch
    report = analyzer.describe(p)
    assert "DALI: 2 prep and 2 fetch threads" in report and "W workers" not in report
    with pytest.raises(ValueError, match="fetch_threads, concurrency and lookahead at least 0: .*, -1, 0, 0$"):
        Pipeline(**{**BASE, "fetch_threads": -1})


def test_an_object_stores_workers_wait_a_gets_latency_over_their_concurrency_and_the_lookahead_hides_it():
    """A bucket 25 ms away: each worker GETs its batch's misses 16 at once, so it waits 25/16 ms per miss;
    the look-ahead keeps 64 GETs in flight, so the workers wait for none and fetching is bound by 64 / 25 ms
    over the misses; the what-if finds the depth that removes the stall, or says S holds fetching."""
    store = {**BASE, "S": 3000.0, "L": 0.025, "workers": 2, "concurrency": 16}
    p = Pipeline(**store)
    assert p.miss_wait == pytest.approx(0.025 / 16)
    each = 1 / (1 / 300 + (1 - p.cache_fraction) * 0.025 / 16)
    assert p.worker_rate == pytest.approx(2 * each) and p.bottleneck == "prep"
    ahead = p.with_changes(lookahead=64)
    assert ahead.worker_rate == p.P == 600.0
    assert ahead.fetch_rate == pytest.approx(64 / (0.7 * 0.025))  # below what S and C allow
    assert dataclasses.replace(p, P=4000.0, G=4000.0).with_changes(lookahead=64).bottleneck == "fetch"
    depth = p.lookahead_knee()  # 600 samples/s of which 70% misses, each 25 ms: 10.5 in flight
    assert depth == 11 and p.with_changes(lookahead=depth).predicted == pytest.approx(600.0)
    assert p.with_changes(lookahead=depth - 1).fetch_rate < 600.0
    assert dataclasses.replace(p, S=400.0).lookahead_knee() is None  # the store's rate holds: no depth helps
    assert p.with_changes(cache_fraction=1.0).lookahead_knee() == 0
    answer = next(a for a in analyzer.answers(p) if "lookahead" in a)
    assert answer["lookahead"] == 11 and answer["samples_per_s"] == pytest.approx(600.0)
    assert not any("lookahead" in a for a in analyzer.answers(Pipeline(**BASE)))  # files: no such question
    report = analyzer.describe(ahead)
    assert "an object store: 16 GETs at once per worker, 64 in flight ahead" in report and "lookahead=11" in report
    with pytest.raises(ValueError, match="concurrency and lookahead at least 0: .*, -1$"):
        Pipeline(**{**store, "lookahead": -1})


def test_whatif_takes_a_lookahead_and_an_analysis_keeps_the_stores_concurrency(tmp_path, capsys):
    p = Pipeline(**{**BASE, "S": 3000.0, "L": 0.025, "workers": 2, "concurrency": 16})
    path = str(tmp_path / "analysis.json")
    analyzer.save(path, p)
    assert analyzer.load(path)[0] == p
    assert cli.main(["whatif", path, "--lookahead", "32"]) == 0
    out = capsys.readouterr().out
    assert f"with the changes: {p.with_changes(lookahead=32).predicted:.1f} samples/s" in out
    assert "32 in flight ahead of the loop" in out


def test_storage_servers_and_jobs():
    p = Pipeline(**BASE)
    assert p.with_changes(storage_factor=2.0).S == 2 * p.S
    with pytest.raises(ValueError, match="peer fetch rate R"):
        p.with_changes(servers=2)
    peers = p.with_changes(R=2000.0, servers=2)  # 30% here, 30% from the peer, 40% from storage, at once
    assert peers.fetch_rate == pytest.approx(1 / max(0.3 / p.C, 0.3 / 2000.0, 0.4 / p.S))
    assert p.with_changes(R=2000.0, servers=4).fetch_rate == pytest.approx(1 / max(0.3 / p.C, 0.7 / 2000.0))
    one = p.with_changes(workers=1, R=2000.0, servers=2)  # one fetcher: in turn
    assert one.fetch_rate == pytest.approx(1 / (0.3 / p.C + 0.3 / 2000.0 + 0.4 / p.S))
    separate, together = p.with_changes(jobs=4), p.with_changes(jobs=4, coordinated=True)
    assert separate.predicted == pytest.approx(p.predicted / 4)  # each job fetches and preps everything
    assert together.predicted == pytest.approx(p.predicted)


def test_a_measured_share_from_the_peers_replaces_what_their_full_caches_would_hold():
    """2 servers caching 30% each: full caches serve 30% of an epoch from the peer; measured early, 10%."""
    p = Pipeline(**{**BASE, "R": 2000.0, "servers": 2})
    early = p.with_changes(peer_share=0.1)
    assert early.fetch_rate == pytest.approx(1 / max(0.3 / p.C, 0.1 / 2000.0, 0.6 / p.S))
    one = early.with_changes(workers=1, peer_share=0.1)
    assert one.fetch_rate == pytest.approx(1 / (0.3 / p.C + 0.1 / 2000.0 + 0.6 / p.S))
    waiting = dataclasses.replace(one, L=0.01)  # one worker waits L for each miss: 60% of its samples
    assert waiting.worker_rate == pytest.approx(1 / (1 / one.P + 0.6 * 0.01))  # one.P: a worker's, 150
    assert early.with_changes(cache_fraction=0.5).peer_share is None  # another cache: the caches' own share
    assert analyzer.at_hits(p, 0.25, 0.05) == p.with_changes(cache_fraction=0.25, peer_share=0.05)
    assert "with 25% cache hits and 5% from the peers" in analyzer.describe(p, 200.0, (0.25, 0.05))
    assert "from the peers" not in analyzer.describe(p, 200.0, (0.25, None))
    with pytest.raises(ValueError, match="peer_share"):
        Pipeline(**{**BASE, "R": 2000.0, "servers": 2, "peer_share": 0.8})  # 30% here + 80% > all
    four = Pipeline(**{**BASE, "R": 2000.0, "servers": 2, "ranks": 2})  # a rank's quarter of an epoch
    assert four.stalls()["ideal_s"] == pytest.approx(p.samples / 4 / p.G)
    assert analyzer.to_json(four)["job_predicted_samples_per_s"] == pytest.approx(4 * four.predicted)


def test_the_cores_bound_the_step_and_prep_together_whatever_the_workers():
    """8 cores; per sample 2 ms of the training process's CPU and 10 ms of prep's: 8 / 12 ms = 667 samples/s,
    below G (900) and the 4 workers' P (600 → with 8 workers, 1200)."""
    p = Pipeline(**{**BASE, "cache_fraction": 1.0, "step_cpu_s": 0.002, "prep_cpu_s": 0.010})
    assert p.cpu_rate == pytest.approx(8 / 0.012)
    assert p.worker_rate == pytest.approx(600.0) and p.predicted == pytest.approx(600.0)  # P binds first
    more = p.with_changes(workers=8)
    assert more.P == pytest.approx(1200.0) and more.predicted == pytest.approx(8 / 0.012)  # now the cores do
    assert more.bottleneck == "prep" and p.workers_knee() is None  # no worker count reaches G
    assert "the 8 cores, which the training process shares with prep" in analyzer.describe(more)
    stall = more.stalls()
    assert stall["prep_s"] == pytest.approx(p.samples / more.cpu_rate - p.samples / p.G)
    assert p.with_changes(jobs=2).cpu_rate == pytest.approx(8 / (2 * 0.012))  # each job's step and prep
    assert p.with_changes(jobs=2, coordinated=True).cpu_rate == pytest.approx(8 / (2 * 0.002 + 0.010))
    assert Pipeline(**BASE).cpu_rate == float("inf")  # not measured: no bound
    dali = Pipeline(**{**BASE, "cache_fraction": 1.0, "P": 5000.0, "fetch_threads": 4, "prep_cpu_s": 0.010})
    assert dali.predicted == pytest.approx(800.0)  # DALI's threads and the training process share the cores too


def test_contention_scales_what_prep_and_the_step_allow_together_and_costs_prep_stall():
    """G 900, P 600 (4 workers), 8 cores; the loop reaches 0.9 of min(W, G) while the workers prepare."""
    alone, shared = Pipeline(**{**BASE, "cache_fraction": 1.0}), Pipeline(**{**BASE, "cache_fraction": 1.0,
                                                                              "contention": 0.9})
    assert shared.predicted == pytest.approx(0.9 * alone.predicted) == pytest.approx(540.0)
    assert shared.bottleneck == "prep"
    stall = shared.stalls()
    assert stall["prep_s"] == pytest.approx(shared.samples / 540.0 - shared.samples / shared.G)
    assert stall["fetch_s"] == pytest.approx(0.0, abs=1e-9)
    step_bound = shared.with_changes(workers=8)  # P 1200: the step binds, and still only 0.9 of it
    assert step_bound.contention == 0.9 and step_bound.predicted == pytest.approx(810.0)
    assert step_bound.bottleneck == "ingestion" and step_bound.stalls()["prep_s"] > 0
    fetch_bound = shared.with_changes(cache_fraction=0.3)  # F (214) below 540: contention does not matter
    assert fetch_bound.predicted == pytest.approx(fetch_bound.fetch_rate) and fetch_bound.bottleneck == "fetch"
    knee = shared.cache_knee()  # fetching needs to reach only 540, not 600
    assert shared.with_changes(cache_fraction=knee).fetch_rate == pytest.approx(540.0, rel=1e-4)
    assert knee < alone.cache_knee()
    assert "contention" in analyzer.describe(shared) and "contention" not in analyzer.describe(alone)
    no_workers = Pipeline(**{**BASE, "workers": 0, "contention": 0.5})  # the loop prepares: nothing to contend
    assert no_workers.predicted == pytest.approx(Pipeline(**{**BASE, "workers": 0}).predicted)


@pytest.mark.parametrize("field, value", [("G", 0.0), ("S", -1.0), ("cache_fraction", 1.5), ("cores", 0),
                                          ("prep_cpu_s", -0.1), ("contention", 0.0), ("contention", 1.2)])
def test_a_wrong_rate_or_setting_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        Pipeline(**{**BASE, field: value})


def test_an_analysis_round_trips_through_its_json(tmp_path):
    p = Pipeline(**{**BASE, "R": 2000.0, "L": 0.001, "fetch_threads": 3, "step_cpu_s": 0.001, "prep_cpu_s": 0.004,
                    "contention": 0.93})
    path = str(tmp_path / "analysis.json")
    analyzer.save(path, p, measured=205.0)
    doc = json.load(open(path))
    assert doc["predicted_samples_per_s"] == pytest.approx(p.predicted) and doc["bottleneck"] == "fetch"
    assert set(doc["rates"]) == {"G", "P", "S", "C", "R", "K"} and set(doc["stall"]) == {"ideal_s", "prep_s", "fetch_s",
                                                                                  "unexplained_s"}
    again, measured = analyzer.load(path)
    assert again == p and measured == 205.0
    questions = [a["question"] for a in doc["whatif"]]
    assert any("cache" in q for q in questions) and any("servers" in q for q in questions)
    report = analyzer.describe(p, 205.0)
    assert "bottleneck: fetching" in report and "fetch stall" in report


def test_a_file_that_is_not_an_analysis_is_named(tmp_path):
    bad = tmp_path / "a.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="a.json is not a coordl analysis"):
        analyzer.load(str(bad))
    doc = analyzer.to_json(Pipeline(**BASE))
    del doc["rates"]["P"]
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="'P' is missing"):
        analyzer.load(str(bad))


def test_whatif_answers_again_from_the_file_with_the_changes_given(tmp_path, capsys):
    p = Pipeline(**BASE)
    path = str(tmp_path / "analysis.json")
    analyzer.save(path, p)
    assert cli.main(["whatif", path, "--cache", "800MiB", "--workers", "6", "--storage-mbps", "30"]) == 0
    expected = p.with_changes(cache_fraction=800 * 2**20 / (p.samples * p.sample_bytes), workers=6,
                              storage_factor=30e6 / p.sample_bytes / p.S)
    out = capsys.readouterr().out
    assert f"as analyzed: {p.predicted:.1f} samples/s" in out
    assert f"with the changes: {expected.predicted:.1f} samples/s" in out
    assert cli.main(["whatif", path, "--servers", "2"]) == 2
    assert "--peer-mbps" in capsys.readouterr().err
    assert cli.main(["whatif", path, "--servers", "4", "--peer-mbps", "200"]) == 0
    four = p.with_changes(servers=4, R=200e6 / p.sample_bytes)
    assert f"with the changes: {four.predicted:.1f} samples/s" in capsys.readouterr().out
    assert cli.main(["whatif", str(tmp_path / "none.json")]) == 2
    assert "none.json" in capsys.readouterr().err


def test_whatif_says_when_the_analysis_withheld_its_prediction(tmp_path, capsys):
    path = str(tmp_path / "analysis.json")
    analyzer.save(path, Pipeline(**BASE), extra={"trust": {"why": ["G varied 11.3x between phases"], "range": None,
                                                           "withheld": True}})
    assert cli.main(["whatif", path, "--workers", "6"]) == 0
    assert "note: the analysis's prediction was withheld: G varied 11.3x between phases" in capsys.readouterr().out
    analyzer.save(path, Pipeline(**BASE))
    assert cli.main(["whatif", path, "--workers", "6"]) == 0 and "note:" not in capsys.readouterr().out


def test_whatif_takes_a_cache_as_a_share_of_the_memory_available(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sizes, "available_memory_bytes", lambda: 1600 * 2**20)
    p = Pipeline(**BASE)
    path = str(tmp_path / "analysis.json")
    analyzer.save(path, p)
    assert cli.main(["whatif", path, "--cache", "50%"]) == 0
    expected = p.with_changes(cache_fraction=800 * 2**20 / (p.samples * p.sample_bytes))
    assert f"with the changes: {expected.predicted:.1f} samples/s" in capsys.readouterr().out
    for bad in ("auto", "150%"):
        with pytest.raises(SystemExit):
            cli.main(["whatif", path, "--cache", bad])
        assert "--cache" in capsys.readouterr().err


# -- the disk tier -------------------------------------------------------------------------------------------

DISK = dict(BASE, K=2000.0, L_disk=0.0005)


@pytest.mark.parametrize("h", [1.0, 0.5, 0.2])
def test_a_disk_tier_serves_what_it_holds_of_the_memory_caches_misses_and_storage_the_rest(h):
    p = Pipeline(**{**DISK, "disk_fraction": h})
    x = p.cache_fraction
    disk = min(h, 1 - x)  # 1: it holds what memory holds too; below 1, the two tiers are disjoint
    storage = 1 - x - disk
    assert p.fetch_rate == pytest.approx(1 / max(x / p.C, disk / p.K, storage / p.S))
    one = Pipeline(**{**DISK, "disk_fraction": h, "workers": 1})
    assert one.fetch_rate == pytest.approx(1 / (x / p.C + disk / p.K + storage / p.S))  # one fetcher: in turn
    assert Pipeline(**{**DISK, "disk_fraction": 0.0}).fetch_rate == Pipeline(**BASE).fetch_rate
    assert Pipeline(**BASE, disk_fraction=0.0).fetch_rate == Pipeline(**BASE).fetch_rate


def test_a_worker_waits_for_its_disk_reads_too():
    p = Pipeline(**{**DISK, "disk_fraction": 0.4, "L": 0.01, "workers": 2, "P": 600.0})
    x, disk = p.cache_fraction, 0.4
    seconds = 2 / p.P + (1 - x - disk) * p.L + disk * p.L_disk
    assert p.worker_rate == pytest.approx(min(p.P, 2 / seconds))
    assert p.worker_rate > Pipeline(**{**BASE, "L": 0.01, "workers": 2}).worker_rate  # disk reads wait less


def test_the_disk_knee_is_the_least_share_on_disk_that_removes_the_fetch_stall():
    p = Pipeline(**DISK)
    knee = p.disk_knee()
    assert 0 < knee < 1
    at, below = p.with_changes(disk_fraction=knee), p.with_changes(disk_fraction=knee * 0.95)
    target = min(at.worker_rate, at.G)
    assert at.fetch_rate >= target * (1 - 1e-9) and below.fetch_rate < target
    assert Pipeline(**{**DISK, "K": 100.0}).disk_knee() is None  # a disk slower than storage's share needs
    assert Pipeline(**{**DISK, "cache_fraction": 1.0}).disk_knee() == 0.0
    assert Pipeline(**BASE).disk_knee() is None  # no disk rate to answer with
    questions = {a["question"]: a for a in analyzer.answers(p)}
    assert questions["smallest disk tier that removes the fetch stall"]["disk_fraction"] == pytest.approx(knee)
    packed = {a["question"]: a for a in analyzer.answers(Pipeline(**DISK, disk_item_bytes=2 * p.sample_bytes))}
    assert packed["smallest disk tier that removes the fetch stall"]["disk_bytes"] == pytest.approx(
        2 * knee * p.samples * p.sample_bytes)  # the quota to set: the items as the tier packs them


def test_a_disk_share_without_a_disk_rate_is_refused_naming_the_option():
    with pytest.raises(ValueError, match="--disk-mbps"):
        Pipeline(**BASE, disk_fraction=0.5)
    with pytest.raises(ValueError, match="disk_fraction"):
        Pipeline(**{**DISK, "disk_fraction": 1.5})


def test_an_analysis_with_a_disk_tier_round_trips_and_whatif_answers_for_another_disk(tmp_path, capsys):
    p = Pipeline(**{**DISK, "disk_fraction": 0.25, "disk_item_bytes": 1.25 * DISK["sample_bytes"]})
    path = str(tmp_path / "analysis.json")
    analyzer.save(path, p)
    assert analyzer.load(path)[0] == p
    assert "K disk tier" in analyzer.describe(p) and "a disk tier holding" in analyzer.describe(p)
    assert cli.main(["whatif", path, "--disk", "500MiB"]) == 0  # a quota: of the items as the tier packs them
    expected = p.with_changes(disk_fraction=500 * 2**20 / (p.samples * 1.25 * p.sample_bytes))
    assert f"with the changes: {expected.predicted:.1f} samples/s" in capsys.readouterr().out
    plain = str(tmp_path / "plain.json")
    analyzer.save(plain, Pipeline(**BASE))
    assert cli.main(["whatif", plain, "--disk", "1GiB"]) == 2
    assert "--disk-mbps" in capsys.readouterr().err
    assert cli.main(["whatif", plain, "--disk", "1GiB", "--disk-mbps", "400"]) == 0
    disk = Pipeline(**BASE).with_changes(disk_fraction=2**30 / (p.samples * p.sample_bytes), K=400e6 / p.sample_bytes)
    assert f"with the changes: {disk.predicted:.1f} samples/s" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["whatif", plain, "--disk", "50%"])

