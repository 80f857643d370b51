"""``benchmarks.gpu_stall``: the summary of its trials on constructed epochs, and a run end to end with the step on
the CPU (the benchmark's own smoke test; its figures need a GPU)."""

import json
import os
import sys
import types

import pytest

from benchmarks import gpu_stall
from benchmarks.gpu_stall import summarize
from tests.benchmarks._bench import REPO, run_to_end


def _epochs(system, step, trial, rates, waits=0.0, first=0.0):
    return [{"system": system, "step": step, "trial": trial, "epoch": k + 1, "samples": 1000,
             "time_s": 1000 / rate, "wait_s": waits * 1000 / rate, "first_wait_s": first * 1000 / rate}
            for k, rate in enumerate(rates)]


def test_the_summary_counts_steady_epochs_takes_the_median_trial_and_the_stall_against_g():
    rows = (_epochs("synthetic", "resnet18", 0, [10, 4000]) + _epochs("synthetic", "resnet18", 1, [10, 4000])
            + _epochs("torch", "resnet18", 0, [5, 1000, 1000], 0.5, 0.2)
            + _epochs("torch", "resnet18", 1, [5, 3000, 3000])
            + _epochs("torch", "resnet18", 2, [5, 2000, 2000], 0.25, 0.1) + _epochs("dali", "none", 0, [7, 9000]))
    summary = {(s["system"], s["step"]): s for s in summarize(rows, batch_size=100)}
    assert summary["synthetic", "resnet18"]["samples_per_s"] == pytest.approx(4000)  # epoch 1 left out
    torch_row = summary["torch", "resnet18"]
    assert (torch_row["samples_per_s"], torch_row["min"], torch_row["max"]) == pytest.approx((2000, 1000, 3000))
    assert torch_row["stall"] == pytest.approx(0.5) and torch_row["wait_fraction"] == pytest.approx(0.25)
    assert torch_row["edge_fraction"] == pytest.approx(0.1)  # the median of the trials' 0.2, 0 and 0.1
    assert summary["dali", "none"]["stall"] is None  # no step: nothing to stall
    assert [s["system"] for s in summarize(rows, batch_size=100)] == ["synthetic", "torch", "dali"]


def test_coordl_dali_is_set_against_plain_dali_trial_by_trial_where_both_ran():
    rows = (_epochs("coordl-dali", "resnet18", 0, [5, 800, 800]) + _epochs("dali", "resnet18", 0, [5, 1000, 1000])
            + _epochs("coordl-dali", "resnet18", 1, [5, 900]) + _epochs("dali", "resnet18", 1, [5, 600])
            + _epochs("dali", "resnet18", 2, [5, 700])  # no coordl-dali in this trial
            + _epochs("coordl-dali", "none", 0, [5, 2000]) + _epochs("dali", "none", 0, [5, 1000])
            + _epochs("synthetic", "resnet18", 0, [5, 4000]))
    assert gpu_stall.dali_ratios(rows) == {"resnet18": pytest.approx([0.8, 1.5]), "none": pytest.approx([2.0])}
    assert gpu_stall.dali_ratios(_epochs("dali", "none", 0, [5, 1000])) == {}


def _edged(trial, first_waits, rest_wait, batches=4, batch_size=10, system="coordl-dali"):
    """Epochs of ``batches`` batches (the last one short) whose first waits are ``first_waits`` and whose other
    batches wait ``rest_wait`` each."""
    samples = (batches - 1) * batch_size + 3
    return [{"system": system, "step": "none", "trial": trial, "epoch": k + 1, "samples": samples, "time_s": 1.0,
             "wait_s": first + (batches - 1) * rest_wait, "first_wait_s": first, "ahead_taken": k,
             "ahead_dropped": 0} for k, first in enumerate(first_waits)]


def test_an_epochs_edge_is_its_first_batchs_wait_beyond_the_others_and_the_summary_takes_its_quartiles():
    assert gpu_stall.epoch_edge_s(_edged(0, [0.05], 0.01)[0], batch_size=10) == pytest.approx(0.04)
    assert gpu_stall.epoch_edge_s(_edged(0, [0.05], 0.01, batches=1)[0], batch_size=10) == pytest.approx(0.05)
    # epoch 1 of each trial (a first wait of 1 s) is left out; the steady epochs' edges are 1, 3, 5, 0, 2, 6 ms
    rows = _edged(0, [1.0, 0.011, 0.013, 0.015], 0.01) + _edged(1, [1.0, 0.010, 0.012, 0.016], 0.01)
    s, = summarize(rows, batch_size=10)
    assert (s["edge_ms_q1"], s["edge_ms"], s["edge_ms_q3"]) == pytest.approx((0.75, 2.5, 5.25))


def test_edges_summarizes_earlier_runs_one_by_one_and_pooled(tmp_path, capsys):
    runs = {"a": _edged(0, [1.0, 0.012, 0.012], 0.01) + _edged(0, [1.0, 0.01, 0.01], 0.01, system="dali"),
            "b": _edged(0, [1.0, 0.05, 0.05], 0.01) + _edged(0, [1.0, 0.01, 0.01], 0.01, system="dali")}
    for name, rows in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"epochs": rows}))
        (tmp_path / name / "setup.json").write_text(json.dumps({"settings": {"batch_size": 10}}))
    assert gpu_stall.main(["edges", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out.splitlines()
    a_row = next(line for line in out[out.index(f"{tmp_path / 'a'}:"):] if "coordl-dali" in line)
    assert "edge +2.0 [+2.0 to +2.0] ms  on the plan drawn ahead 2, on another 0" in a_row
    assert "  coordl-dali / dali none     1.000 (trials: 1.00)" in out  # the same samples in the same time
    pooled = out[out.index("pooled:"):]
    assert any("coordl-dali" in line and "edge +21.0 [+2.0 to +40.0] ms over 4 epochs" in line for line in pooled)
    assert "  coordl-dali / dali none     1.000 [1.00-1.00] over 2 trials" in pooled
    assert any("dali " in line and "edge +0.0 [+0.0 to +0.0] ms over 4 epochs" in line for line in pooled)
    with pytest.raises(SystemExit, match="not a benchmarks.gpu_stall run"):
        gpu_stall.main(["edges", str(tmp_path)])


@pytest.mark.parametrize("each_epoch", [False, True])
def test_the_gpu_is_waited_for_around_the_steady_window_and_only_asked_between_its_epochs(monkeypatch, each_epoch):
    """A training loop does not wait for its GPU between epochs: the steady epochs are one window, waited for at
    its edges (after the first epoch, after the last), and at every epoch's edges only with --drain-each-epoch."""
    events = []
    monkeypatch.setattr(gpu_stall, "_drain", lambda device: events.append("drain"))
    step = gpu_stall.Step("none", "cpu")
    args = types.SimpleNamespace(batch_size=2, images=4, device="cpu", epochs=4, drain_each_epoch=each_epoch)
    original = gpu_stall.run_epoch

    def run_epoch(*a, **k):
        events.append("epoch")
        return original(*a, **k)

    monkeypatch.setattr(gpu_stall, "run_epoch", run_epoch)
    rows = gpu_stall.measure("synthetic", step, "unused", args, trial=0)
    assert [r["epoch"] for r in rows] == [1, 2, 3, 4] and all(r["samples"] == 4 for r in rows)
    if each_epoch:
        assert events == ["epoch", "drain", "drain"] * 4
    else:  # before and after epoch 1, before epoch 2, after epoch 4
        assert events == ["epoch", "drain", "drain", "epoch", "drain", "epoch", "epoch", "drain"]


@pytest.mark.slow
def test_a_run_with_the_step_on_the_cpu_delivers_every_sample_of_every_epoch(tmp_path):
    out = tmp_path / "out"
    run = run_to_end([sys.executable, "-m", "benchmarks.gpu_stall", "--device", "cpu", "--images", "24",
                      "--batch-size", "8", "--epochs", "2", "--trials", "2", "--workers", "2",
                      "--systems", "synthetic,torch,coordl", "--out", str(out)], 200, cwd=REPO,
                     env={**os.environ, "PYTHONPATH": REPO})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    assert result["failed"] == {}
    assert sorted({(r["system"], r["trial"], r["epoch"]) for r in result["epochs"]}) == sorted(
        (s, t, e) for s in ("synthetic", "torch", "coordl") for t in (0, 1) for e in (1, 2))
    assert all(r["samples"] == 24 for r in result["epochs"])
    loaded = [r for r in result["epochs"] if r["system"] != "synthetic"]
    assert all(0 < r["first_wait_s"] <= r["wait_s"] < r["time_s"] for r in loaded)
    setup = json.loads((out / "setup.json").read_text())
    assert setup["gpu"] is None and setup["settings"]["device"] == "cpu" and setup["git_sha"]
    assert "| coordl | resnet18 |" in (out / "results.md").read_text()


@pytest.mark.slow
def test_the_dali_loaders_alone_and_coordl_dalis_epochs_on_the_plan_drawn_ahead(tmp_path):
    pytest.importorskip("nvidia.dali")
    out = tmp_path / "out"
    run = run_to_end([sys.executable, "-m", "benchmarks.gpu_stall", "--device", "cpu", "--images", "24",
                      "--batch-size", "8", "--epochs", "3", "--trials", "1", "--workers", "2", "--steps", "none",
                      "--systems", "coordl-dali,dali", "--hw-decoder-load", "1", "--out", str(out)], 200, cwd=REPO,
                     env={**os.environ, "PYTHONPATH": REPO})
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())["epochs"]
    assert sorted((r["system"], r["step"], r["epoch"]) for r in rows) == sorted(
        (s, "none", e) for s in ("coordl-dali", "dali") for e in (1, 2, 3))
    assert all(r["samples"] == 24 for r in rows)
    coordl_dali = [r for r in rows if r["system"] == "coordl-dali"]
    assert [(r["ahead_taken"], r["ahead_dropped"]) for r in coordl_dali] == [(0, 0), (1, 0), (2, 0)]
    assert "epochs on the plan drawn ahead: 2, on another: 0" in run.stdout
    assert "first batch's extra wait" in (out / "results.md").read_text()
    assert json.loads((out / "setup.json").read_text())["settings"]["hw_decoder_load"] == 1.0  # the preset bound
    edges = run_to_end([sys.executable, "-m", "benchmarks.gpu_stall", "edges", str(out)], 60, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": REPO})
    assert edges.returncode == 0 and "on the plan drawn ahead 2, on another 0" in edges.stdout, edges.stderr


def test_a_hardware_decoder_share_outside_0_to_1_is_refused_before_anything_is_made(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        gpu_stall.main(["--device", "cpu", "--hw-decoder-load", "1.5", "--out", str(tmp_path / "out")])
    assert stop.value.code == 2
    assert "--hw-decoder-load should be a share from 0 to 1, not 1.5" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
