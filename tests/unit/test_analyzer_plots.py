"""The analysis's plots: the what-if curves are the model's answers, and every plot is written."""

import pytest

from coordl.analyzer import Pipeline, plots
from coordl.analyzer.model import answers

BASE = dict(samples=10_000, sample_bytes=100_000.0, G=900.0, P=300.0, S=150.0, C=50_000.0, cache_fraction=0.3,
            workers=1, cores=4)


def _answer(pipeline: Pipeline, key: str, value) -> dict:
    return next(a for a in answers(pipeline) if a.get(key) == value)


def test_the_whatif_curves_pass_through_the_whatif_answers():
    p = Pipeline(**{**BASE, "R": 2_000.0, "servers": 2})
    curves = plots.whatif_curves(p)
    workers = dict(curves["workers"])
    assert sorted(workers) == list(range(1, 2 * p.cores + 1))
    fewest = _answer(p, "question", "fewest workers that remove the prep stall")
    assert curves["workers_knee"] == p.workers_knee() == fewest["workers"]
    for w, rate in workers.items():
        assert rate == pytest.approx(p.with_changes(workers=w).predicted)
    assert dict(curves["storage"])[1.0] == pytest.approx(p.predicted)
    assert dict(curves["storage"])[2.0] == pytest.approx(_answer(p, "storage_factor", 2.0)["samples_per_s"])
    jobs = {k: (together, alone) for k, together, alone in curves["jobs"]}
    assert jobs[1][0] == jobs[1][1] == pytest.approx(p.predicted)
    for k in (2, 4):
        answer = _answer(p, "jobs", k)
        assert jobs[k] == pytest.approx((answer["samples_per_s"], answer["uncoordinated_samples_per_s"]))
        assert jobs[k][0] > jobs[k][1]  # prep-bound: coordinated jobs share one prep
    servers = dict(curves["servers"])
    assert servers[2] == pytest.approx(p.predicted)
    assert servers[4] == pytest.approx(_answer(p, "servers", 4)["samples_per_s"])


@pytest.mark.parametrize("changes", [dict(), dict(contention=0.6, L=0.004, workers=2), dict(workers=0),
                                     dict(cache_fraction=1.0, C=50_000.0, P=5000.0, contention=0.7)])
def test_the_cache_plot_draws_the_model_that_printed_the_prediction(changes):
    p = Pipeline(**{**BASE, **changes})
    curves = plots.cache_curves(p)
    here = round(100 * p.cache_fraction)
    assert curves["predicted"][here] == pytest.approx(p.predicted)  # the report's number, on the line
    for x, predicted in zip(curves["percent"], curves["predicted"]):
        assert predicted == pytest.approx(p.with_changes(cache_fraction=x / 100).predicted)
        assert predicted <= min(curves["F"][x], curves["W"][x], curves["G"] if p.workers else curves["W"][x]) + 1e-9
        assert predicted <= curves["top"]
    knee = p.cache_knee()
    assert curves["knee"] == (None if knee is None else pytest.approx(100 * knee))


def test_one_server_has_no_servers_curve():
    assert plots.whatif_curves(Pipeline(**BASE))["servers"] is None


@pytest.mark.parametrize("peers", [{}, {"R": 2_000.0, "servers": 2}])
def test_every_plot_is_written(tmp_path, peers):
    p = Pipeline(**{**BASE, **peers})
    written = plots.draw(p, 0.9 * p.predicted, str(tmp_path))
    assert [path.rsplit("/", 1)[1] for path in written] == ["rates.png", "cache.png", "whatif.png"]
    for path in written:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
