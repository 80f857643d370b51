"""Locality-aware assignment: Algorithm 1, the reassignment of a global batch, and every rank's plan against
torch's DistributedSampler."""

import types

import numpy as np
import pytest
from torch.utils.data import RandomSampler
from torch.utils.data.distributed import DistributedSampler

from coordl._peer.locality import LocalityPlan, assign, balance, locality_plan


def test_balance_moves_the_total_deficit_in_at_most_p_minus_1_transfers():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        p = int(rng.integers(2, 129))
        counts = rng.multinomial(p * 8, np.ones(p) / p)
        surplus = {s: max(0, int(c) - 8) for s, c in enumerate(counts)}
        deficit = {s: max(0, 8 - int(c)) for s, c in enumerate(counts)}
        transfers = balance(surplus, deficit)
        assert sum(m for _, _, m in transfers) == sum(deficit.values())
        assert len(transfers) <= max(0, sum(1 for s in range(p) if surplus[s] or deficit[s]) - 1) <= p - 1
        for s in range(p):
            assert sum(m for a, _, m in transfers if a == s) == surplus[s]
            assert sum(m for _, b, m in transfers if b == s) == deficit[s]


def test_balance_takes_the_largest_first_and_breaks_ties_by_the_lowest_server():
    assert balance({0: 3, 2: 1}, {1: 2, 3: 2}) == [(0, 1, 2), (0, 3, 1), (2, 3, 1)]
    assert balance({5: 2, 1: 2}, {4: 2, 0: 2}) == [(1, 0, 2), (5, 4, 2)]
    with pytest.raises(ValueError, match="do not balance"):
        balance({0: 2}, {1: 1})


def _check_assignment(batch, owner, servers, ranks, b):
    positions, moved = assign(batch, owner, servers, ranks)
    assert [len(p) for p in positions] == [b] * (servers * ranks)
    assert sorted(np.concatenate(positions).tolist()) == list(range(len(batch)))
    kept = 0
    for s in range(servers):
        mine = np.concatenate(positions[s * ranks:(s + 1) * ranks])
        own = np.count_nonzero(owner[batch] == s)
        kept += min(own, ranks * b)
        assert np.count_nonzero(owner[batch[mine]] == s) == min(own, ranks * b)  # a server keeps what it owns
    return positions, moved, kept


def test_every_position_goes_to_one_rank_each_rank_gets_b_and_servers_keep_their_own():
    rng = np.random.default_rng(1)
    for servers, ranks, b in [(2, 1, 8), (4, 2, 16), (8, 4, 3), (128, 1, 32), (3, 3, 1)]:
        n = servers * ranks * b * 20
        for unowned in (0.0, 0.3):
            owner = rng.integers(0, servers, n).astype(np.int16)
            owner[rng.random(n) < unowned] = -1
            for _ in range(30):
                batch = rng.choice(n, servers * ranks * b, replace=False)
                _, moved, kept = _check_assignment(batch, owner, servers, ranks, b)
                assert moved == len(batch) - kept - np.count_nonzero(owner[batch] < 0)


@pytest.mark.parametrize("instances", [300, pytest.param(3000, marks=pytest.mark.slow)])
def test_the_assignment_is_the_same_wherever_it_is_computed_ties_included(instances):
    rng = np.random.default_rng(2)
    for _ in range(instances):
        servers = int(rng.integers(2, 129))
        owner = np.repeat(np.arange(servers, dtype=np.int16), 4)  # equal shares: many ties
        batch = rng.permutation(len(owner))[:servers * 2]
        first, _ = assign(batch, owner, servers, 1)
        again, _ = assign(batch.copy(), owner.copy(), servers, 1)
        assert all(np.array_equal(a, b) for a, b in zip(first, again))


def _plans(n, world, ranks_per_server, b, *, shuffle=True, drop_last_sampler=False, drop_last=False, owner=None,
           epoch=3):
    data = list(range(n))
    samplers = [DistributedSampler(data, num_replicas=world, rank=r, shuffle=shuffle, seed=7,
                                   drop_last=drop_last_sampler) for r in range(world)]
    for s in samplers:
        s.set_epoch(epoch)
    owner = np.random.default_rng(0).integers(-1, world // ranks_per_server, n).astype(np.int16) if owner is None \
        else owner
    plans = [LocalityPlan(s, b, drop_last, lambda: owner, world // ranks_per_server, ranks_per_server)
             for s in samplers]
    return samplers, plans, owner


@pytest.mark.parametrize("n, world, ranks_per_server, b, shuffle, drop_last_sampler, drop_last", [
    (100, 4, 2, 8, True, False, False),  # padded; a ragged last batch
    (100, 4, 1, 8, True, True, True),
    (97, 6, 3, 5, False, False, False),
    (64, 2, 1, 32, True, False, False),
])
def test_each_global_batch_is_torchs_reassigned_and_every_rank_gets_its_batch_size(
        n, world, ranks_per_server, b, shuffle, drop_last_sampler, drop_last):
    samplers, plans, owner = _plans(n, world, ranks_per_server, b, shuffle=shuffle,
                                    drop_last_sampler=drop_last_sampler, drop_last=drop_last)
    torch_batches = [[list(s)[i:i + b] for i in range(0, s.num_samples, b)] for s in samplers]
    if drop_last:
        torch_batches = [[x for x in batches if len(x) == b] for batches in torch_batches]
    ours = [list(p) for p in plans]
    assert [len(o) for o in ours] == [len(t) for t in torch_batches] == [len(p) for p in plans]
    for k in range(len(ours[0])):
        global_torch = sorted(i for r in range(world) for i in torch_batches[r][k])
        global_ours = sorted(i for r in range(world) for i in ours[r][k])
        assert global_ours == global_torch  # the same global batch, so the same all-reduced gradient
        assert len({len(ours[r][k]) for r in range(world)}) == 1
    servers = world // ranks_per_server
    local = sum(1 for r in range(world) for batch in ours[r] for i in batch if owner[i] == r // ranks_per_server)
    torch_local = sum(1 for r in range(world) for batch in torch_batches[r] for i in batch
                      if owner[i] == r // ranks_per_server)
    assert local >= torch_local and (servers == 1 or local > torch_local)


def test_a_sampler_coordl_cannot_follow_is_refused_by_name():
    peers = types.SimpleNamespace(topology=types.SimpleNamespace(world=2, rank=0, node=0, nodes=2, local_world=1,
                                                                 local_rank=0),
                                  state=types.SimpleNamespace(owner=None))
    data = list(range(10))
    with pytest.raises(ValueError, match="needs partitioned caching"):
        locality_plan(DistributedSampler(data, num_replicas=2, rank=0), 4, False, None, False)
    with pytest.raises(ValueError, match="DistributedSampler.*RandomSampler"):
        locality_plan(RandomSampler(data), 4, False, peers, False)
    with pytest.raises(ValueError, match="not batch_sampler="):
        locality_plan(DistributedSampler(data, num_replicas=2, rank=0), 4, False, peers, True)
    with pytest.raises(ValueError, match="rank 1 of 2, but this process is rank 0 of 2"):
        locality_plan(DistributedSampler(data, num_replicas=2, rank=1), 4, False, peers, False)

    class Reordered(DistributedSampler):
        def __iter__(self):
            return reversed(list(super().__iter__()))
    with pytest.raises(ValueError, match="Reordered"):
        locality_plan(Reordered(data, num_replicas=2, rank=0), 4, False, peers, False)
    assert isinstance(locality_plan(DistributedSampler(data, num_replicas=2, rank=0), 4, False, peers, False),
                      LocalityPlan)


def test_samples_no_server_caches_go_round_the_servers_batch_by_batch():
    owner = np.full(64, -1, dtype=np.int16)
    owner[:8] = 0  # server 0 owns 8 samples, nobody else anything
    batch = np.arange(8, 16)  # 8 uncached samples, 2 servers of 1 rank, b = 4
    for first, takes in ((0, 0), (1, 1)):
        positions, moved = assign(batch, owner, 2, 1, first)
        assert moved == 0
        assert positions[takes].tolist() == [0, 1, 2, 3]  # the first server in turn fills its deficit first
