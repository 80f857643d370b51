"""The DALI feed's fetching ahead (``_Feeder``, which wraps samples in DALI's tensor type), on a pool that
runs each fetch only when its batch is asked for: an epoch starts with a few batches in flight and adds one
more per batch taken (once that batch is handed over), up to its depth, every batch in plan order; where the
next plan can be drawn ahead, it goes on into that plan, whose counts are the next epoch's, taken over or
dropped when that epoch starts."""

import array
import concurrent.futures
import mmap
import types

import numpy as np
import pytest
import torch

from coordl._dali.pipeline import AHEAD_BATCHES, AHEAD_LEFT, FETCH_RAMP, _Feeder, _fetch_batch, _target_columns
from coordl._fetch.cached_dataset import COUNTER_FIELDS


class _LazyPool:
    """Submissions recorded, each run when its result is first asked for."""

    def __init__(self):
        self.submitted = []

    def submit(self, fn, *args):
        class Lazy(concurrent.futures.Future):
            def result(self, timeout=None):
                if not self.done():
                    try:
                        self.set_result(fn(*args))
                    except Exception as e:
                        self.set_exception(e)
                return super().result()

            def exception(self, timeout=None):
                if not self.done():
                    try:
                        self.result()
                    except Exception:
                        pass
                return super().exception()

            def cancel(self):  # as an executor's thread does with a fetch cancelled before it ran
                return super().cancel() and not self.set_running_or_notify_cancel()

        self.submitted.append(args[-1])
        return Lazy()


SAMPLES, HITS = COUNTER_FIELDS.index("samples"), COUNTER_FIELDS.index("hits")


def _cached(n: int, failing=()):
    """Sample i is 3 bytes of i, each fetch a hit; fetching one of ``failing`` raises."""
    counters = types.SimpleNamespace(table=torch.zeros((1, len(COUNTER_FIELDS)), dtype=torch.int64))

    def fetch_many(indices, row, views):
        if set(indices) & set(failing):
            raise OSError(f"cannot read {sorted(set(indices) & set(failing))}")
        row[HITS] += len(indices)
        return [bytes([i]) * 3 for i in indices]
    return types.SimpleNamespace(counters=counters, fetch_many=fetch_many)


def _labels(fed) -> list[int]:
    return fed[1].tolist()


def _feed(feeder, k: int) -> list[list[int]]:
    """Feed ``k`` batches, each taken out of DALI (off ``in_flight``) one batch behind, as DALI's queue does, and
    handed over (the fetches owed started)."""
    fed = []
    for _ in range(k):
        fed.append(_labels(feeder()))
        if len(feeder.in_flight) > 1:
            feeder.in_flight.popleft()
        feeder.top_up()
    return fed


def _counted(cached, field: int) -> int:
    return int(cached.counters.table[0, field])


@pytest.mark.parametrize("depth", [1, 4, 32])
def test_an_epoch_starts_with_a_few_batches_in_flight_and_ramps_up_to_its_depth(depth):
    batches = [[2 * k, 2 * k + 1] for k in range(10)]
    pool = _LazyPool()
    feeder = _Feeder(_cached(20), lambda i: (np.int64(i),), batches, pool, depth)
    assert pool.submitted == batches[:min(FETCH_RAMP, depth)]
    fed = []
    while True:
        submitted = len(pool.submitted)
        try:
            encoded, labels = feeder()
        except StopIteration:
            break
        if submitted - len(fed) > 1:  # a fetch left for DALI's next call: none started before the hand-over
            assert len(pool.submitted) == submitted
        else:  # none left: the next started at once
            assert len(pool.submitted) == submitted + (len(fed) + 1 < len(batches))
        fed.append(labels.tolist())
        assert [bytes(np.array(t)) for t in encoded] == [bytes([i]) * 3 for i in fed[-1]]
        feeder.top_up()
        in_flight = len(pool.submitted) - len(fed)
        assert in_flight <= depth and in_flight == min(FETCH_RAMP + len(fed), depth, len(batches) - len(fed))
    assert fed == batches and pool.submitted == batches  # each batch fetched once, in plan order


def _plans(n: int, offset: int) -> list[list[int]]:
    return [[offset + 2 * k, offset + 2 * k + 1] for k in range(n)]


class _Ahead:
    """A plan drawn ahead; records how many of the epoch's batches were fed when it was drawn."""

    def __init__(self, feeder_of, plan):
        self.feeder_of, self.plan, self.drawn_at = feeder_of, plan, []

    def __call__(self, batches):
        self.drawn_at.append(self.feeder_of()._fed)
        if isinstance(self.plan, Exception):
            raise self.plan
        return self.plan[:batches] if self.plan is not None else None


def _feeder(batches, ahead_plan, failing=(), depth=4, labels=None):
    cached, holder = _cached(64, failing), {}
    ahead = _Ahead(lambda: holder["feeder"], ahead_plan)
    labels = {} if labels is None else labels
    holder["feeder"] = _Feeder(cached, lambda i: (np.int64(labels.get(i, i)),), batches, _LazyPool(), depth, ahead)
    return holder["feeder"], ahead, cached


def test_the_plan_ahead_is_drawn_with_the_ramp_left_and_fed_after_the_epoch_counted_as_the_next():
    this, following = _plans(6, 0), _plans(AHEAD_BATCHES + 2, 20)
    feeder, ahead, cached = _feeder(this, following)
    assert _feed(feeder, 7) == this + following[:1]  # DALI has the epoch's last output out and the next queued
    assert ahead.drawn_at == [len(this) - AHEAD_LEFT] and feeder.ahead == following[:AHEAD_BATCHES]
    assert [indices for indices, _ in feeder.in_flight] == following[:1]
    assert _counted(cached, SAMPLES) == 12 and _counted(cached, HITS) == 12  # the one fed ahead is held back

    assert feeder.take_over(following, None)  # the plan starts with the batches drawn ahead: the rest is its own
    assert _counted(cached, SAMPLES) == 14 and _counted(cached, HITS) == 14
    assert _feed(feeder, len(following) - 1) == following[1:]
    assert not feeder.goes_on
    with pytest.raises(StopIteration):
        feeder()
    assert _counted(cached, SAMPLES) == 12 + 2 * len(following)


def test_targets_changed_since_they_were_fetched_ahead_are_read_again():
    """A training loop relabelling samples between epochs: a batch fed ahead with the old labels is not taken
    over; one fetched ahead and not yet fed gets its labels read again when fed."""
    this, following, labels = _plans(3, 0), _plans(4, 20), {}
    feeder, _, _ = _feeder(this, following, labels=labels)
    assert _feed(feeder, 4) == this + following[:1]
    feeder._pending[0][1].result()  # following[1] fetched
    labels[following[0][0]] = 99
    assert not feeder.take_over(following, None)
    labels.clear()
    labels[following[1][1]] = 99
    assert feeder.take_over(following, None)
    assert _feed(feeder, 1) == [[following[1][0], 99]]


def test_another_plan_drops_what_was_fed_ahead_and_counts_its_reads_without_samples():
    this, following, actual = _plans(4, 0), _plans(4, 20), _plans(3, 40)
    feeder, _, cached = _feeder(this, following)
    assert _feed(feeder, 5) == this + following[:1]
    fetched, not_run = feeder._pending[0][1], feeder._pending[1][1]
    fetched.result()  # fetched ahead, not fed; the next not started
    assert not feeder.take_over(actual, None)
    assert feeder.replan(actual, None) == 1  # the one fed ahead: DALI outputs it first, to be dropped
    assert not_run.cancelled()
    feeder.in_flight.popleft()
    assert _counted(cached, SAMPLES) == 8 and _counted(cached, HITS) == 12  # both reads counted, no samples
    assert _feed(feeder, 3) == actual
    with pytest.raises(StopIteration):
        feeder()
    assert _counted(cached, SAMPLES) == 14 and _counted(cached, HITS) == 18


def test_a_batch_ahead_that_fails_to_fetch_is_fed_as_the_one_before_and_not_taken_over():
    this, following = _plans(3, 0), _plans(3, 20)
    feeder, _, cached = _feeder(this, following, failing=(following[0][1],))
    fed = [feeder() for _ in range(5)]
    assert [_labels(f) for f in fed[:3]] == this
    assert fed[3] is fed[2] and _labels(fed[4]) == following[1]  # in place of following[0], this epoch's last
    assert not feeder.take_over(following, None)
    assert feeder.replan(following, None) == 2
    with pytest.raises(OSError, match="cannot read"):
        feeder()  # the plan's own batch fails in its own epoch


@pytest.mark.parametrize("plan", [None, [], RuntimeError("no plan")], ids=["none", "empty", "fails"])
def test_without_a_plan_ahead_the_feed_ends_with_the_epoch(plan):
    this = _plans(5, 0)
    feeder, ahead, _ = _feeder(this, plan)
    assert _feed(feeder, 5) == this
    assert ahead.drawn_at == [len(this) - AHEAD_LEFT] and not feeder.goes_on
    with pytest.raises(StopIteration):
        feeder()


@pytest.mark.parametrize("label", [np.int64, np.int32, np.float32, int])
def test_a_column_of_scalar_targets_is_one_array_of_their_type(label):
    [column] = _target_columns(lambda i: (label(3 * i),), [2, 0, 5])
    assert isinstance(column, np.ndarray) and column.tolist() == [6, 0, 15]
    assert column.dtype == np.stack([label(0)]).dtype


@pytest.mark.parametrize("shapes", [[(2, 4), (2, 4)], [(1, 4), (3, 4)], [(0, 4), (0, 4)], [(1,), (1,)], [(1,), (2,)]])
def test_a_column_of_arrays_is_a_list_of_contiguous_arrays(shapes):
    """Detection targets: boxes of each sample's count, whether the counts agree or not (or are zero)."""
    values = [np.asfortranarray(np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + k)  # not C-ordered
              for k, shape in enumerate(shapes)]
    boxes, labels = _target_columns(lambda i: (values[i], np.int64(i)), [0, 1])
    assert isinstance(boxes, list) and [b.shape for b in boxes] == [v.shape for v in values]
    assert all(b.flags.c_contiguous and np.array_equal(b, v) for b, v in zip(boxes, values))
    assert isinstance(labels, np.ndarray) and labels.tolist() == [0, 1]


def test_fetched_bytes_are_wrapped_as_uint8_in_place_and_kept_alive():
    """A hit's view into the cache's mapping, storage's bytes, and any other buffer become uint8 tensors over
    the same bytes; each tensor holds what it wraps (the mapping cannot close while one exists)."""
    mapping = mmap.mmap(-1, 4096)
    mapping[:6] = b"abcdef"
    raws = [memoryview(mapping)[1:4].toreadonly(), b"xyz", bytearray(b"qq"), array.array("H", [258]),
            np.arange(3, dtype=np.uint8)]
    fetched = types.SimpleNamespace(fetch_many=lambda indices, row, views: list(raws))
    encoded, _, _ = _fetch_batch(fetched, lambda i: (np.int64(i),), list(range(len(raws))))
    assert [bytes(np.array(t)) for t in encoded] == [bytes(r) for r in raws]
    assert all(np.array(t).dtype == np.uint8 for t in encoded)
    assert encoded[0].data_ptr() == np.frombuffer(raws[0], dtype=np.uint8).ctypes.data  # no copy
    raws.clear()
    with pytest.raises(BufferError):
        mapping.close()  # the first tensor still holds its view
    del encoded
    mapping.close()
