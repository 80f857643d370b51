"""The look-ahead's walk (``_fetch.lookahead``) and a batch's concurrent misses (``_fetch.concurrent_misses``),
over a real cache and a storage whose reads the tests hold and release; the object store client's fork gate;
the look-ahead's size and the request counts' prices."""

import secrets
import threading
import time

import numpy as np
import pytest

from coordl._cache.minio import MinIOCache, cache_segment_name
from coordl._fetch.cached_dataset import COUNTER_FIELDS, CachedDataset, SampleCounters
from coordl._fetch.concurrent_misses import read_misses
from coordl._fetch.lookahead import LookAhead, lookahead_of
from coordl._fetch.overflow import SKIP, Overflow
from coordl._objects.client import Gate
from coordl._objects.datasets import lookahead_depth
from coordl.stats import EpochStats
from coordl.exceptions import SampleError

SIZE = 32
_FIELDS = [COUNTER_FIELDS.index(f) for f in ("misses", "storage_bytes", "storage_wait_ns", "hits", "cache_bytes", "waits",
                                             "wait_ns", "staged")]


class HeldStorage:
    """Items ``key-i`` of SIZE bytes; each read is logged, and waits while ``held`` is clear."""

    concurrency, lookahead = 4, 3

    def __init__(self, fail=()):
        self.reads, self.fail, self.held = [], set(fail), threading.Event()
        self.held.set()
        self.lock = threading.Lock()

    def size(self, key):
        return SIZE

    def sizes(self):
        return [SIZE] * 12

    def read_stamped(self, key):
        assert self.held.wait(30)
        with self.lock:
            self.reads.append(key)
        if key in self.fail:
            raise OSError(5, "the store said no")
        return key.encode().ljust(SIZE, b"."), (1, 0, SIZE)

    def stamp(self, key):
        return 1, 0, SIZE


class Keys:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def raw_key(self, i):
        return f"key-{i}"

    def decode_raw(self, i, raw):
        return raw


@pytest.fixture
def fetch_path():
    def make(n=12, items_fit=None, **storage):
        capacity = (items_fit if items_fit is not None else n) * SIZE
        cache = MinIOCache(cache_segment_name(secrets.token_hex(6)), n_items=n, capacity_bytes=capacity,
                           fingerprint=bytes(32))
        made.append(cache)
        source = Keys(n)
        return CachedDataset(source, source, cache, HeldStorage(**storage), SampleCounters(2), bytes(32))
    made = []
    yield make
    for cache in made:
        cache.close()


def _counted(dataset, field):
    return int(dataset.counters.table[:, COUNTER_FIELDS.index(field)].sum())


def _until(done, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def _walk_until_idle(walk):
    _until(lambda: walk.reading == 0 and walk.cursor >= len(walk.plan) and walk.ahead is None)


def test_the_walk_reads_the_plan_in_order_then_the_next_passs_first_batches_each_once(fetch_path):
    dataset = fetch_path()
    lookahead = lookahead_of(dataset)
    assert isinstance(lookahead, LookAhead) and lookahead.depth == 3 and lookahead.row == 1
    lookahead.depth = 1  # one thread: the order is the plan's exactly
    plan, following = [[5, 1], [7, 3]], [[3, 0], [2, 11]]
    asked = []
    lookahead.follow(plan, lambda n: asked.append(n) or following[:n])
    _walk_until_idle(lookahead._walk)
    assert asked == [1]  # as many batches of the next pass as the look-ahead's depth
    assert dataset.storage.reads == [f"key-{i}" for i in (5, 1, 7, 3, 0)]  # 3 is cached by then: not read again
    assert _counted(dataset, "ahead") == 4  # the next pass's read counts in it, once it begins
    dataset.storage.held.clear()
    lookahead.follow(following, None)
    assert _counted(dataset, "ahead") == 5 and _counted(dataset, "ahead_bytes") == 5 * SIZE
    dataset.storage.held.set()
    lookahead.close()
    assert all(dataset.cache.get(i) is not None for i in (5, 1, 7, 3, 0))


def test_the_walk_stops_claiming_once_the_cache_is_full_where_it_has_no_overflow(fetch_path):
    dataset = fetch_path(items_fit=4)
    lookahead = lookahead_of(dataset)
    dataset.overflow = None
    lookahead.depth = 1
    lookahead.follow([list(range(12))], None)
    _walk_until_idle(lookahead._walk)
    lookahead.close()
    assert dataset.storage.reads == [f"key-{i}" for i in range(4)]  # the fifth's claim froze the cache
    assert dataset.cache.full


def test_once_the_cache_is_full_the_rest_is_staged_at_most_its_slots_ahead_and_each_item_read_once(fetch_path):
    dataset = fetch_path(items_fit=4)
    lookahead = lookahead_of(dataset)
    assert isinstance(dataset.overflow, Overflow) and dataset.overflow.slots == 6  # twice the depth (3)
    lookahead.depth = 1
    dataset.overflow = Overflow(12, 2, SIZE)  # two slots: the walk may run two uncached items ahead
    lookahead.follow([list(range(12))], None)
    _until(lambda: len(dataset.storage.reads) == 6)
    time.sleep(0.1)  # and no further, while nobody takes a staged item
    assert dataset.storage.reads == [f"key-{i}" for i in range(6)] and dataset.overflow.free_slots() == 0
    raws = read_misses(dataset, [4, 5, 6, 7], dataset.counters.row(), _FIELDS)  # a worker's batch
    assert raws == [f"key-{i}".encode().ljust(SIZE, b".") for i in (4, 5, 6, 7)]
    lookahead.close()
    assert [dataset.storage.reads.count(f"key-{i}") for i in range(8)] == [1] * 8  # 6 and 7: by one of the two
    assert (_counted(dataset, "staged") + _counted(dataset, "misses"), _counted(dataset, "hits")) == (4, 0)
    assert _counted(dataset, "staged") >= 2 and dataset.cache.get(5) is None  # staged, not cached


def test_an_overflow_slot_goes_through_its_states_and_a_pass_frees_the_last_ones():
    overflow = Overflow(8, 2, 16)
    overflow.begin(1)
    assert overflow.claim(3, 17, 1) == SKIP  # larger than a slot
    first = overflow.claim(3, 5, 1)
    assert overflow.claim(3, 5, 1) == SKIP  # being written already
    second = overflow.claim(4, 5, 1)
    assert {first, second} == {0, 1} and overflow.claim(5, 5, 1) is None  # every slot taken
    overflow.fill(first, b"three", (1, 2, 5))
    assert overflow.take(3) == (b"three", (1, 2, 5), pytest.approx(0, abs=0.5))
    assert overflow.take(3) is None and overflow.free_slots() == 1  # read once
    assert overflow.claim(3, 5, 1) == SKIP  # asked for in this pass: the worker read it
    threading.Timer(0.2, overflow.fill, (second, b"four!", (1, 2, 5))).start()
    raw, _, waited = overflow.take(4)  # being written: waited for
    assert raw == b"four!" and waited >= 0.15
    staged = overflow.claim(6, 5, 2)  # the next pass's first items, staged before it begins
    overflow.fill(staged, b"six..", (1, 2, 5))
    stale = overflow.claim(7, 5, 1)
    overflow.fill(stale, b"seven", (1, 2, 5))
    overflow.begin(2)
    assert overflow.take(7) is None and overflow.take(6)[0] == b"six.."  # the last pass's unread ones go
    assert overflow.claim(3, 5, 2) is not None  # a new pass: asked for again


def test_a_slot_claimed_again_under_a_workers_copy_is_not_served():
    overflow = Overflow(4, 1, 8)
    overflow.begin(1)
    slot = overflow.claim(1, 3, 1)
    overflow.fill(slot, b"one", (1, 2, 3))
    arrays = overflow._arrays()
    real_bytes = bytes

    def claimed_again_while_copying(view):  # the look-ahead claims the slot between a worker's check and copy
        arrays[1][slot, 4] += 1
        return real_bytes(view)
    import coordl._fetch.overflow as module
    module.bytes = claimed_again_while_copying
    try:
        assert overflow.take(1) is None
    finally:
        del module.bytes


def test_torchs_workers_share_the_overflow_and_a_plain_pickle_makes_a_new_one():
    import io
    import pickle
    from multiprocessing.reduction import ForkingPickler
    overflow = Overflow(4, 2, 8)
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(overflow)
    shared = pickle.loads(buffer.getvalue())
    shared.begin(1)
    slot = shared.claim(2, 3, 1)
    shared.fill(slot, b"two", (1, 2, 3))
    assert overflow.take(2)[0] == b"two"
    fresh = pickle.loads(pickle.dumps(overflow))
    assert fresh.tensors[0].data_ptr() != overflow.tensors[0].data_ptr() and fresh.tensors[0].is_shared()


def test_a_fork_waits_for_the_requests_in_flight_and_none_starts_until_it_is_done():
    """The object store client's gate (NOTE [ Object store client ]), forced: a request held mid-flight; closing
    the gate (what a fork does first) waits for it, and a request asked for meanwhile starts only at open()."""
    gate, go, order = Gate(), threading.Event(), []

    def request(name, hold):
        with gate.request():
            order.append(f"{name} starts")
            assert not hold or go.wait(30)
            order.append(f"{name} ends")
    first = threading.Thread(target=request, args=("first", True))
    first.start()
    _until(lambda: gate.in_flight == 1)
    closing = threading.Thread(target=gate.close, args=(30,))
    closing.start()
    closing.join(0.3)
    assert closing.is_alive()  # waits for the request in flight
    assert not gate.close(0.05)  # (a fork that has waited long enough goes on, saying so)
    second = threading.Thread(target=request, args=("second", False))
    second.start()
    go.set()
    closing.join(30)
    second.join(0.3)
    assert not closing.is_alive() and second.is_alive() and order == ["first starts", "first ends"]
    gate.open()
    second.join(30)
    first.join(30)
    assert order == ["first starts", "first ends", "second starts", "second ends"]


def test_a_batchs_misses_are_read_concurrently_and_one_in_flight_elsewhere_is_waited_for(fetch_path):
    dataset = fetch_path()
    claim = dataset.cache.claim(4, SIZE)  # another reader's, in flight
    row = dataset.counters.row()
    filler = threading.Timer(0.2, dataset.cache.fill, (claim, b"4".ljust(SIZE, b"."), (1, 0, SIZE)))
    filler.start()
    raws = read_misses(dataset, [2, 4, 6], row, _FIELDS)
    filler.join()
    assert raws == [b"key-2".ljust(SIZE, b"."), b"4".ljust(SIZE, b"."), b"key-6".ljust(SIZE, b".")]
    assert sorted(dataset.storage.reads) == ["key-2", "key-6"]
    assert (_counted(dataset, "misses"), _counted(dataset, "hits"), _counted(dataset, "waits")) == (2, 1, 1)
    assert dataset.cache.get(2) == raws[0] and dataset.cache.get(6) == raws[2]


def test_a_failed_read_names_its_key_and_leaves_no_claim_behind(fetch_path):
    dataset = fetch_path(fail={"key-3"})
    row = np.zeros(len(COUNTER_FIELDS), dtype=np.int64)
    with pytest.raises(SampleError, match=r"sample 3 \(key-3\): the store said no"):
        read_misses(dataset, [1, 3, 5], row, range(8))
    assert not any(dataset.cache.in_flight(i) for i in range(12))
    assert dataset.cache.put(3, b"x" * SIZE)  # its place is free for the next reader


@pytest.mark.parametrize("latency_s, object_bytes, depth", [
    (0.001, 110_000, 16),  # a near store: the least
    (0.025, 110_000, 100),  # 25 ms: 4,000 objects a second need 100 in flight
    (0.5, 110_000, 128),  # far: the most
    (0.025, 8 * 2**20, 8),  # large objects: 64 MiB in flight at most
])
def test_the_lookahead_is_sized_from_the_stores_latency_within_its_bounds(latency_s, object_bytes, depth):
    assert lookahead_depth(latency_s, object_bytes) == depth


def test_an_epochs_requests_are_priced_at_s3s_rates_or_the_settings(monkeypatch):
    epoch = EpochStats(epoch=1, misses=600, ahead=400, lists=200, object_store=True)
    assert epoch.gets == 1000 and epoch.request_cost == pytest.approx(0.0004 + 0.2 * 0.005)
    assert "gets=1000" in epoch.summary_line(None) and "lists=200" in epoch.summary_line(None)
    monkeypatch.setenv("COORDL_GET_PRICE", "0.001")
    monkeypatch.setenv("COORDL_LIST_PRICE", "0")
    assert epoch.request_cost == pytest.approx(0.001)
    monkeypatch.setenv("COORDL_LIST_PRICE", "cheap")
    with pytest.raises(ValueError, match="COORDL_LIST_PRICE='cheap'"):
        epoch.request_cost
    assert "gets=" not in EpochStats(epoch=1).summary_line(None)  # files: no request counts
