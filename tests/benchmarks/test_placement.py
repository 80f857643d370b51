"""benchmarks.placement: its model of the sampler, and the bounds each policy must meet on any instance."""

import pytest
from torch.utils.data.distributed import DistributedSampler

from benchmarks import placement


@pytest.mark.parametrize("n, servers", [(10, 4), (12, 3), (7, 2), (3, 8)])
def test_shards_are_the_distributed_samplers(n, servers):
    for epoch in (1, 2):
        mine = placement.shards(n, servers, epoch)
        for rank in range(servers):
            sampler = DistributedSampler(range(n), num_replicas=servers, rank=rank, shuffle=True, seed=5)
            sampler.set_epoch(epoch)
            assert mine[rank].tolist() == list(sampler)


def test_with_an_aggregate_cache_of_the_dataset_hand_offs_leave_nothing_for_storage():
    """Each cache holds D/N plus the largest item, and a full cache wastes less than an item: with hand-offs
    every item is cached during epoch 1, whatever the shards; without them the servers whose shard was the
    larger leave some to be read again."""
    left_without = []
    for seed in range(8):
        sizes = placement.item_sizes(300, seed=seed)
        with_hand_off = placement.simulate("first-come", sizes, 4, 1.0, 3, seed=seed)
        without = placement.simulate("first-come, no hand-off", sizes, 4, 1.0, 3, seed=seed)
        assert with_hand_off["epochs"][0]["storage_fraction"] == without["epochs"][0]["storage_fraction"]
        assert with_hand_off["later_storage_fraction"] == 0 and with_hand_off["cached_fraction"] == pytest.approx(1)
        left_without.append(without["later_storage_fraction"])
    assert max(left_without) > 0.005


def test_hash_placement_forwards_most_of_the_first_epoch_and_caches_no_more():
    sizes = placement.item_sizes(2000)
    hashed = placement.simulate("hash", sizes, 4, 1.0, 2)
    first = placement.simulate("first-come", sizes, 4, 1.0, 2)
    assert 0.7 < hashed["epochs"][0]["network_fraction"] < 0.8  # (1 - 1/4) of the dataset goes to its owners
    assert first["epochs"][0]["network_fraction"] < 0.05  # only the overflow
    assert first["cached_fraction"] == pytest.approx(1) and hashed["cached_fraction"] <= 1
    for fraction in (0.5, 1.0):  # later epochs: storage reads what no server caches, whoever caches the rest
        for policy in ("hash", "first-come"):
            run = placement.simulate(policy, sizes, 4, fraction, 3)
            for later in run["epochs"][1:]:
                assert later["storage_fraction"] == pytest.approx(1 - run["cached_fraction"], abs=0.02)
