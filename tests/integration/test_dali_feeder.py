"""The DALI feed's fetching ahead (``_Feeder``, which wraps samples in DALI's tensor type), on a pool that
runs each fetch only when its batch is asked for: an epoch starts with a few batches in flight and adds one
more per batch taken, up to its depth, every batch in plan order."""

import concurrent.futures
import types

import numpy as np
import pytest
import torch

from coordl.cached_dataset import COUNTER_FIELDS
from coordl.dali_pipeline import FETCH_RAMP, _Feeder


class _LazyPool:
    """Submissions recorded, each run when its result is first asked for."""

    def __init__(self):
        self.submitted = []

    def submit(self, fn, *args):
        class Lazy(concurrent.futures.Future):
            def result(self, timeout=None):
                if not self.done():
                    self.set_result(fn(*args))
                return super().result()

        self.submitted.append(args[-1])
        return Lazy()


def _cached(n: int):
    counters = types.SimpleNamespace(table=torch.zeros((1, len(COUNTER_FIELDS)), dtype=torch.int64))
    return types.SimpleNamespace(counters=counters,
                                 fetch_many=lambda indices, row, views: [bytes([i]) * 3 for i in indices])


@pytest.mark.parametrize("depth", [1, 4, 32])
def test_an_epoch_starts_with_a_few_batches_in_flight_and_ramps_up_to_its_depth(depth):
    batches = [[2 * k, 2 * k + 1] for k in range(10)]
    pool = _LazyPool()
    feeder = _Feeder(_cached(20), lambda i: (np.int64(i),), batches, pool, depth)
    assert pool.submitted == batches[:min(FETCH_RAMP, depth)]
    fed = []
    while True:
        try:
            encoded, labels = feeder()
        except StopIteration:
            break
        fed.append(labels.tolist())
        assert [bytes(np.array(t)) for t in encoded] == [bytes([i]) * 3 for i in fed[-1]]
        in_flight = len(pool.submitted) - len(fed)
        assert in_flight <= depth and in_flight == min(FETCH_RAMP + len(fed), depth, len(batches) - len(fed))
    assert fed == batches and pool.submitted == batches  # each batch fetched once, in plan order
