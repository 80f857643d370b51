"""The cache simulator: MinIO's steady hit rate is the cache fraction; LRU thrashes below it."""

import numpy as np
import pytest

from benchmarks.cache_sim import LRUCache, MinIOCache, simulate, simulate_all


@pytest.mark.parametrize("fraction", [0.35, 0.5, 0.65])
def test_minio_steady_hit_rate_is_the_fraction(fraction):
    rates = simulate("minio", fraction, epochs=4, n_items=1000, seed=3)
    assert rates[0] == 0.0
    assert rates[1:] == [fraction] * 3


@pytest.mark.parametrize("fraction", [0.35, 0.5, 0.65])
def test_lru_thrashes_under_random_permutations(fraction):
    rates = simulate("lru", fraction, epochs=4, n_items=2000, seed=3)
    assert rates[0] == 0.0
    assert all(0 < r < fraction - 0.1 for r in rates[1:])


def test_sequential_order_defeats_lru_entirely():
    assert simulate("lru", 0.65, epochs=3, n_items=500, order="sequential") == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("policy,order", [("lru", "random"), ("lru", "sequential"), ("minio", "random")])
def test_a_cache_of_the_whole_dataset_hits_everything_after_epoch_one(policy, order):
    assert simulate(policy, 1.0, epochs=3, n_items=300, order=order) == [0.0, 1.0, 1.0]


def test_byte_capacity_with_uneven_sizes():
    sizes = np.random.default_rng(0).integers(1000, 200_000, size=800)
    rates = simulate("minio", 0.5, epochs=3, sizes=sizes, seed=1)
    assert rates[1] == rates[2] and 0.4 < rates[1] < 0.6  # the same items every epoch, about half of them


def test_minio_freezes_at_the_first_item_that_does_not_fit():
    cache = MinIOCache(capacity_bytes=10)
    assert [cache.access(i, s) for i, s in [(0, 6), (1, 5), (2, 1), (0, 6)]] == [False, False, False, True]
    assert cache.items == {0}  # item 2 would fit, but the cache froze at item 1, as coordl's does


def test_lru_evicts_the_least_recently_used():
    cache = LRUCache(capacity_bytes=2)
    for item in (0, 1, 0, 2):  # 1 is the least recent when 2 arrives
        cache.access(item, 1)
    assert list(cache.items) == [0, 2]


def test_simulate_all_is_deterministic_and_complete():
    rows = simulate_all([0.5, 1.0], epochs=2, n_items=200, seed=7)
    assert rows == simulate_all([0.5, 1.0], epochs=2, n_items=200, seed=7)
    assert {(r["policy"], r["order"], r["cache_fraction"]) for r in rows} == {
        (p, o, f) for f in (0.5, 1.0) for p, o in (("lru", "random"), ("lru", "sequential"), ("minio", "random"))}
