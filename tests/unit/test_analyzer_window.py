"""A timed window of ``coordl analyze`` around a step that runs on a GPU: the work queued there is waited for at
both edges, so the window holds its batches' steps and no earlier one's."""

import json
import types

import pytest
import torch

from coordl._core.settings import ANALYZE_TIME_SCALE_ENV
from coordl.analyzer import phases


@pytest.fixture(autouse=True)
def full_least_times(monkeypatch):
    """These windows are judged against the least times as they are (the suite's jobs run them scaled)."""
    monkeypatch.setenv(ANALYZE_TIME_SCALE_ENV, "1")


class _FakeGpu:
    """``torch.cuda`` as a script with a queue of asynchronous steps sees it: each step queued adds work that
    ends only at ``synchronize``, which the clock below then moves past."""

    def __init__(self, clock):
        self.clock, self.queued_s, self.synced_at = clock, 0.0, []

    def is_initialized(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.clock.now += self.queued_s
        self.queued_s = 0.0
        self.synced_at.append(self.clock.now)


class _Clock:
    def __init__(self):
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def process_time(self) -> float:
        return 0.0


def _loader():
    total = types.SimpleNamespace(hits=0, peer_hits=0, misses=0, disk_hits=0)
    return types.SimpleNamespace(epoch_ledger=object(), batch_size=4, num_workers=0, prefetch_factor=None,
                                 stats=lambda: types.SimpleNamespace(total=total))


def _window(monkeypatch, tmp_path, gpu: _FakeGpu, warmup: int, iters: int) -> "phases._Window":
    """An ingestion window of ``iters`` batches after ``warmup``, on ``gpu`` and its clock."""
    monkeypatch.setattr(phases.torch, "cuda", gpu)
    monkeypatch.setattr(phases, "time", gpu.clock)
    monkeypatch.setenv(phases.WARMUP_ENV, str(warmup))
    monkeypatch.setenv(phases.ITERS_ENV, str(iters))
    monkeypatch.setenv(phases.RESULT_ENV, str(tmp_path / "result.json"))
    return phases._Window(_loader(), "ingestion")


def test_a_windows_edges_wait_for_the_steps_queued_on_the_gpu(monkeypatch, tmp_path):
    gpu = _FakeGpu(_Clock())
    window = _window(monkeypatch, tmp_path, gpu, warmup=2, iters=3)
    step_s = 0.5  # each step: queued at once, done on the GPU half a second later
    with pytest.raises(SystemExit):
        while True:
            window.count()
            window.taken += 1
            gpu.queued_s += step_s  # the loop queues the step and goes on
    result = json.loads((tmp_path / "result.json").read_text())
    # the warm-up's two steps end before the clock starts; the window's three end before it stops
    assert gpu.synced_at == [100.0 + 2 * step_s, 100.0 + 5 * step_s]
    assert result["samples_per_s"] == pytest.approx(3 * 4 / (3 * step_s))


def test_a_script_with_no_gpu_is_not_made_to_wait(monkeypatch, tmp_path):
    gpu = _FakeGpu(_Clock())
    gpu.is_initialized = lambda: False
    window = _window(monkeypatch, tmp_path, gpu, warmup=1, iters=2)
    with pytest.raises(SystemExit):
        while True:
            window.count()
            window.taken += 1
            gpu.clock.now += 0.25
    assert gpu.synced_at == []
    assert json.loads((tmp_path / "result.json").read_text())["samples_per_s"] == pytest.approx(2 * 4 / 0.5)


def _plain_loader():
    """What ``phases._prepared`` reads of a loader: in-process, batches as lists."""
    return types.SimpleNamespace(epoch_ledger=types.SimpleNamespace(feed=None), num_workers=0,
                                 collate_fn=lambda batch: batch, worker_init_fn=None, multiprocessing_context=None,
                                 prefetch_factor=None, pin_memory=False)


def test_q_gets_full_batches_without_end_each_pass_in_a_new_order():
    batches = phases._prepared(_plain_loader(), [f"s{i}" for i in range(10)], batch_size=4)
    taken = [next(batches) for _ in range(50)]  # far past the first pass
    assert all(len(b) == 4 for b in taken)  # full batches: the two left over each pass are not a short one
    passes = [taken[k] + taken[k + 1] for k in range(0, 50, 2)]
    assert all(len(set(p)) == 8 and set(p) <= {f"s{i}" for i in range(10)} for p in passes)  # no sample twice
    assert len({tuple(p) for p in passes}) == len(passes)  # each pass in its own order
    few = phases._prepared(_plain_loader(), ["a", "b", "c"], batch_size=4)
    assert [sorted(next(few)) for _ in range(3)] == [["a", "b", "c"]] * 3  # fewer than a batch: all of them


class _FakeDali:
    """What ``phases._prepared`` uses of a DALI backend: twins whose epochs yield their batches as they are, each
    epoch's plan and seed kept, and whether the twin was closed."""

    def __init__(self):
        self.twins = []

    def twin(self) -> "_FakeDali":
        twin = _FakeDali()
        twin.epochs, twin.closed, twin.cached = [], False, None
        self.twins.append(twin)
        return twin

    def epoch(self, batches, seed):
        self.epochs.append((batches, seed))
        return iter([[self.cached[i] for i in batch] for batch in batches])

    def close(self) -> None:
        self.closed = True


def test_q_with_dali_gets_a_twin_pipeline_epoch_after_epoch_each_in_a_new_order_and_seed(monkeypatch):
    dali = _FakeDali()
    monkeypatch.setattr(phases, "_dali", lambda ledger: dali)
    held = {i: f"s{i}" for i in range(20)}
    batches = phases._prepared(_plain_loader(), torch.utils.data.Subset(held, list(range(10, 20))), batch_size=4)
    taken = [next(batches) for _ in range(30)]  # 15 epochs of the twin: 2 full batches each
    (twin,) = dali.twins
    assert twin.cached is held and len(twin.epochs) == 15 and all(len(b) == 4 for b in taken)
    assert [seed for _, seed in twin.epochs] == list(range(15))  # fresh augmentation each pass
    plans = [tuple(i for batch in plan for i in batch) for plan, _ in twin.epochs]
    assert all(len(set(p)) == 8 and set(p) <= set(range(10, 20)) for p in plans)  # the subset's items, each once
    assert len(set(plans)) == 15  # each pass in its own order
    assert taken[:2] == [[held[i] for i in batch] for batch in twin.epochs[0][0]]  # the twin's batches, as they come
    assert not twin.closed
    batches.close()
    assert twin.closed


def test_the_rates_window_drops_q_s_pipeline_when_it_ends(monkeypatch, tmp_path):
    window = _rates_window(monkeypatch, tmp_path, _Clock(), warmup=1, iters=2)
    window.prepared = types.SimpleNamespace(closed=False)
    window.prepared.close = lambda: setattr(window.prepared, "closed", True)
    with pytest.raises(SystemExit):
        while True:
            window.count()
            window.taken += 1
            phases.time.now += phases.PREP_MIN_S
    assert window.prepared.closed and json.loads((tmp_path / "result.json").read_text())["Q_iters"] == 2


def _rates_window(monkeypatch, tmp_path, clock, warmup: int, iters: int) -> "phases._Window":
    """A rates window (Q) of ``iters`` batches after ``warmup``, on ``clock``, with no GPU."""
    gpu = _FakeGpu(clock)
    gpu.is_initialized = lambda: False
    window = _window(monkeypatch, tmp_path, gpu, warmup, iters)
    window.phase, window.rates = "rates", {"P": 1.0}
    return window


def test_q_shorter_than_p_is_lengthened_to_the_same_least_time(monkeypatch, tmp_path):
    registered = []
    monkeypatch.setattr(phases.atexit, "register", registered.append)
    monkeypatch.setattr(phases.atexit, "unregister", registered.remove)
    window = _rates_window(monkeypatch, tmp_path, _Clock(), warmup=1, iters=4)
    step_s = 0.25  # 4 batches: 1 s, a fifth of PREP_MIN_S
    with pytest.raises(SystemExit):
        while True:
            window.count()
            window.taken += 1
            phases.time.now += step_s
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["Q_iters"] == 4 * phases.PREP_MIN_S / 1.0 and result["Q_s"] == pytest.approx(phases.PREP_MIN_S)
    assert result["Q"] == pytest.approx(4 / step_s) and result["P"] == 1.0
    assert registered == []  # written at its end: nothing left to write at exit


def test_q_whose_pace_picks_up_in_the_lengthened_window_is_lengthened_again(monkeypatch, tmp_path):
    """The first lengthening is reckoned at the slow pace of the first batches; the window ends only once it
    is as long as P's."""
    registered = []
    monkeypatch.setattr(phases.atexit, "register", registered.append)
    monkeypatch.setattr(phases.atexit, "unregister", registered.remove)
    window = _rates_window(monkeypatch, tmp_path, _Clock(), warmup=1, iters=4)
    with pytest.raises(SystemExit):
        while True:
            window.count()
            window.taken += 1
            phases.time.now += 0.5 if window.taken <= 1 + 4 else 0.25  # 4 batches in 2 s, then twice as fast
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["Q_s"] == phases.PREP_MIN_S
    assert result["Q_iters"] == 4 + 6 + 5 + 1  # reckoned after 4 batches in 2 s, 10 in 3.5 s, then 15 in 4.75 s
    assert registered == []  # written at its end, once


def test_the_least_time_is_scaled_by_its_setting(monkeypatch, tmp_path):
    monkeypatch.setenv(ANALYZE_TIME_SCALE_ENV, "0.5")
    window = _rates_window(monkeypatch, tmp_path, _Clock(), warmup=1, iters=4)
    with pytest.raises(SystemExit):
        while True:
            window.count()
            window.taken += 1
            phases.time.now += 0.25
    assert json.loads((tmp_path / "result.json").read_text())["Q_s"] == pytest.approx(0.5 * phases.PREP_MIN_S)


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "fast"])
def test_a_bad_time_scale_is_refused_naming_the_setting(monkeypatch, value):
    monkeypatch.setenv(ANALYZE_TIME_SCALE_ENV, value)
    with pytest.raises(ValueError, match=f"COORDL_ANALYZE_TIME_SCALE should be a positive number.*{value!r}"):
        phases.least_s(phases.PREP_MIN_S)


def test_q_long_enough_already_ends_at_its_iters(monkeypatch, tmp_path):
    window = _rates_window(monkeypatch, tmp_path, _Clock(), warmup=1, iters=4)
    with pytest.raises(SystemExit):
        while True:
            window.count()
            window.taken += 1
            phases.time.now += phases.PREP_MIN_S / 2
    assert json.loads((tmp_path / "result.json").read_text())["Q_iters"] == 4


def test_a_script_that_ends_in_the_lengthened_window_has_q_written_at_exit(monkeypatch, tmp_path):
    registered = []
    monkeypatch.setattr(phases.atexit, "register", registered.append)
    window = _rates_window(monkeypatch, tmp_path, _Clock(), warmup=1, iters=4)
    for _ in range(1 + 4 + 3):  # the script's loop ends 3 batches into the lengthened window
        window.count()
        window.taken += 1
        phases.time.now += 0.5
    assert not (tmp_path / "result.json").exists() and registered == [window._write_at_exit]
    registered[0]()  # the interpreter's exit
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["Q_iters"] == 7 and result["Q"] == pytest.approx(7 * 4 / 3.5)


def _ask_most(rank: int, store: str, asked: int, told) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        told.put((rank, phases._most_of_ranks(asked)))
    finally:
        torch.distributed.destroy_process_group()


def test_ranks_that_step_together_lengthen_q_by_the_most_any_of_them_needs(tmp_path):
    """Two real ranks (gloo): each asks for its own count and both get the larger, so their windows end at the
    same batch (a rank that ended first would leave the other waiting in the step's all-reduce)."""
    context = torch.multiprocessing.get_context("spawn")
    told = context.Queue()
    ranks = [context.Process(target=_ask_most, args=(r, str(tmp_path / "store"), asked, told))
             for r, asked in enumerate((3, 17))]
    for p in ranks:
        p.start()
    answers = dict(told.get(timeout=60) for _ in ranks)
    for p in ranks:
        p.join(60)
    assert answers == {0: 17, 1: 17} and [p.exitcode for p in ranks] == [0, 0]


def test_a_process_alone_keeps_its_own_count():
    assert phases._most_of_ranks(9) == 9


def test_a_window_says_how_steady_it_ran_from_its_parts(monkeypatch, tmp_path):
    gpu = _FakeGpu(_Clock())
    gpu.is_initialized = lambda: False
    window = _window(monkeypatch, tmp_path, gpu, warmup=1, iters=8)
    steps = iter([0.1] * 5 + [0.1, 0.1, 1.0, 1.0, 0.1])  # the last quarter but one: the machine got busy
    with pytest.raises(SystemExit):
        while True:
            window.count()
            gpu.clock.now += next(steps)  # waiting for the batch
            window.taken += 1
            window.delivered(timed=False)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["parts_samples_per_s"] == pytest.approx([40.0, 40.0, 40.0, 4.0])  # 2 batches each
    assert result["spread"] == pytest.approx(10.0)
    assert phases.window_parts([0.0, 1.0, 2.0], batch_size=4) is None  # fewer batches than parts


def _run_window(monkeypatch, tmp_path, clock, totals, iters: int) -> "phases._Window":
    """A run phase's window of ``iters`` batches after one, on ``clock``, over a loader whose statistics'
    total is ``totals``."""
    loader = types.SimpleNamespace(epoch_ledger=object(), batch_size=4, num_workers=0, prefetch_factor=None,
                                   stats=lambda: types.SimpleNamespace(total=totals))
    monkeypatch.setattr(phases, "time", clock)
    monkeypatch.setattr(phases.torch.cuda, "is_initialized", lambda: False)
    for name, value in ((phases.WARMUP_ENV, "1"), (phases.ITERS_ENV, str(iters)),
                        (phases.RESULT_ENV, str(tmp_path / "result.json"))):
        monkeypatch.setenv(name, value)
    return phases._Window(loader, "run")


def _totals():
    return types.SimpleNamespace(hits=0, peer_hits=0, misses=0, disk_hits=0, stall_s=0.0, storage_wait_s=0.0,
                                 peer_wait_s=0.0,
                                 prep_s=0.0)


def test_an_epochs_end_inside_the_runs_window_adds_no_step_and_no_mark(monkeypatch, tmp_path):
    clock = _Clock()
    window = _run_window(monkeypatch, tmp_path, clock, _totals(), iters=8)

    def epoch():  # 3 batches, each after 0.1 s of loading
        for _ in range(3):
            clock.now += 0.1
            yield [0, 1, 2, 3]

    with pytest.raises(SystemExit):
        while True:  # the script's epochs: 0.2 s steps, then 1 s of its own between epochs
            for _ in phases._Timed(window, epoch()):
                clock.now += 0.2
            clock.now += 1.0
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["step_samples_per_s"] == pytest.approx(4 / 0.2)  # each step counted once, the gaps not at all
    assert len(window.marks) == 8 + 1


def test_the_runs_window_times_the_step_apart_from_the_loaders_waits(monkeypatch, tmp_path):
    clock, totals = _Clock(), _totals()
    window = _run_window(monkeypatch, tmp_path, clock, totals, iters=4)

    def batches():
        while True:  # the loop waits 0.3 s for each, while the workers read for 0.2 s and prepare for 0.6 s
            clock.now += 0.3
            totals.stall_s += 0.3
            totals.storage_wait_s += 0.2
            totals.prep_s += 0.6
            yield [0, 1, 2, 3]

    timed = phases._Timed(window, batches())
    with pytest.raises(SystemExit):
        while True:
            next(timed)
            clock.now += 0.2  # the step
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["samples_per_s"] == pytest.approx(4 * 4 / (4 * 0.5))
    assert result["step_samples_per_s"] == pytest.approx(4 * 4 / (4 * 0.2))
    assert result["waits_s"] == pytest.approx({"stall": 0.3 / 4, "storage": 0.2 / 4, "peers": 0.0, "prep": 0.6 / 4})
