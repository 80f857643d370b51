"""An analysis that measured on a busy machine says so: a rate that was unsteady within its window, or that
moved between phases, is flagged, and the prediction is widened to a range or withheld (``runner.trust_of``)."""

import pytest

from coordl.analyzer import Pipeline, report
from coordl.analyzer.runner import UNSTEADY, trust_of

BASE = dict(samples=10_000, sample_bytes=100_000.0, G=900.0, P=600.0, S=150.0, C=50_000.0, cache_fraction=0.9,
            workers=4, cores=8, contention=0.8)


def _results(g_parts=(900.0,) * 4, q_spread=1.05, run_spread=1.1, step=850.0) -> dict:
    return {"ingestion": {"samples_per_s": sum(g_parts) / len(g_parts), "parts_samples_per_s": list(g_parts),
                          "spread": max(g_parts) / min(g_parts)},
            "rates": {"Q_spread": q_spread},
            "run": {"spread": run_spread, "step_samples_per_s": step}}


def test_steady_rates_leave_the_prediction_as_it_is():
    p = Pipeline(**BASE)
    trust = trust_of(p, _results())
    assert trust == {"why": [], "range": None, "withheld": False}
    assert "between" not in report.describe(p, 500.0, trust=trust) and "withheld" not in report.describe(p, 500.0)


def test_the_step_sharing_the_cores_with_prep_in_the_run_is_not_a_move():
    p = Pipeline(**BASE)  # contention 0.8: the step may run at 720 to 900 samples/s in the run
    assert trust_of(p, _results(step=0.8 * 900.0 / UNSTEADY * 1.01))["why"] == []
    assert trust_of(p, _results(step=900.0 * UNSTEADY * 1.01))["why"] != []


def test_g_unsteady_within_its_window_widens_the_prediction_to_the_rates_it_was_seen_at():
    p = Pipeline(**{**BASE, "P": 5000.0, "cache_fraction": 1.0})  # bound by the step: the prediction follows G
    trust = trust_of(p, _results(g_parts=(1200.0, 1200.0, 600.0, 600.0)))
    assert not trust["withheld"] and len(trust["why"]) == 1 and "G (the training step alone) varied 2.0x" in \
        trust["why"][0]
    low, high = trust["range"]
    assert low == pytest.approx(Pipeline(**{**BASE, "P": 5000.0, "cache_fraction": 1.0, "G": 600.0}).predicted)
    assert high == pytest.approx(Pipeline(**{**BASE, "P": 5000.0, "cache_fraction": 1.0, "G": 1200.0}).predicted)
    text = report.describe(p, 700.0, trust=trust)
    assert f"between {low:.1f} and {high:.1f}" in text and "the machine was busy" in text


def test_g_moving_14x_between_phases_withholds_the_prediction_and_says_why():
    p = Pipeline(**{**BASE, "G": 3689.0})
    trust = trust_of(p, _results(g_parts=(3689.0,) * 4, step=262.0))
    assert trust["withheld"] and trust["why"] == [
        "G varied 11.3x between phases: the training step ran at 3689 samples/s alone and at 262 in the run: the "
        "machine was busy"]  # 3689 x 0.8 (the contention) / 262
    text = report.describe(p, 262.0, trust=trust)
    assert "withheld: G varied 11.3x between phases" in text and "quieter machine" in text


def test_an_unsteady_q_widens_the_prediction_through_the_contention_and_a_steady_g_alone_gives_no_range():
    p = Pipeline(**{**BASE, "P": 5000.0, "cache_fraction": 1.0})  # the step bounds it: c·G
    trust = trust_of(p, _results(q_spread=2.0))
    low, high = trust["range"]
    assert low == pytest.approx(p.predicted / 2.0) and high == pytest.approx(min(1.0, 0.8 * 2.0) / 0.8 * p.predicted)
    only_run = trust_of(p, _results(run_spread=2.0))  # the run was unsteady: the comparison is doubtful, not G
    assert only_run["range"] is None and "the run's samples/s varied 2.0x" in only_run["why"][0]
    assert "the run's samples/s varied 2.0x within its window" in report.describe(p, 500.0, trust=only_run)


def test_a_step_on_a_gpu_timed_faster_than_g_is_its_launch_not_a_move():
    p = Pipeline(**BASE)
    results = _results(step=5000.0)
    assert trust_of(p, results)["why"] != []
    results["run"]["step_on_gpu"] = True
    assert trust_of(p, results)["why"] == []
    results["run"]["step"] = results["run"]["step_samples_per_s"] = 100.0  # slower than G·c still counts
    assert trust_of(p, results)["why"] != []


def test_what_a_run_took_beyond_the_prediction_is_against_the_prediction_at_the_hits_it_saw():
    p = Pipeline(**BASE)  # 90% cached
    cold = report.at_hits(p, 0.0)
    split = report.stall_split(p, cold.predicted, measured_hits=(0.0, None))  # a run that saw no hits, as predicted
    assert split["unexplained_s"] == pytest.approx(0.0, abs=1e-9)
    assert report.stall_split(p, cold.predicted)["unexplained_s"] > 0  # against the 90% prediction: far off
    text = report.describe(p, cold.predicted * 0.5, (0.0, None))
    assert "s more an epoch than predicted at the hits it saw" in text and "+" not in text.split("more an")[0][-8:]
