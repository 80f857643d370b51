"""Drawing the next pass's plan ahead (``EpochBatchSampler.plan_ahead``, NOTE [ Planning ahead ]): it is the
plan torch's iterator draws next when nothing draws from the random state in between, and it leaves every
generator, the global RNG and the samplers' epochs as they were."""

import warnings

import pytest
import torch
import torch.utils.data as tud

import coordl

N = 23


class Indices(tud.Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return i


class Mine(tud.Sampler):
    """A user's sampler: what its passes depend on is not known."""

    def __iter__(self):
        return iter(range(N))

    def __len__(self):
        return N


class MyBatches(Mine):
    def __iter__(self):
        return iter([[i] for i in range(N)])


def _loader(**options) -> coordl.DataLoader:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # coordl says once that it does not cache this dataset
        return coordl.DataLoader(Indices(), batch_size=4, **options)


def _epoch(loader) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def _states(loader):
    sampler = loader.batch_sampler.sampler
    generators = [g.get_state() for g in (loader.generator, getattr(sampler, "generator", None)) if g is not None]
    return torch.get_rng_state(), generators, getattr(sampler, "epoch", None)


def _same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and len(a[1]) == len(b[1]) and \
        all(torch.equal(x, y) for x, y in zip(a[1], b[1])) and a[2] == b[2]


SAMPLERS = {
    "shuffle": lambda: dict(shuffle=True),
    "shuffle, generator": lambda: dict(shuffle=True, generator=torch.Generator().manual_seed(3)),
    "sequential, drop_last": lambda: dict(shuffle=False, drop_last=True),
    "weighted": lambda: dict(sampler=tud.WeightedRandomSampler(torch.rand(N), N)),
    "subset": lambda: dict(sampler=tud.SubsetRandomSampler(list(range(0, N, 2)))),
}


@pytest.mark.parametrize("options", list(SAMPLERS), ids=str)
def test_the_plan_drawn_ahead_is_the_next_pass_and_changes_nothing(options):
    torch.manual_seed(0)
    loader = _loader(**SAMPLERS[options]())
    _epoch(loader)
    for _ in range(3):
        before = _states(loader)
        planned, first = loader.batch_sampler.plan_ahead(), loader.batch_sampler.plan_ahead(2)
        assert _same(before, _states(loader))
        assert planned == _epoch(loader) and first == planned[:2]


def test_with_a_generator_the_global_rng_is_left_to_whoever_draws_from_it_meanwhile():
    """Only the loader's generators are set back: a draw from the global RNG made while the plan is drawn ahead
    (by another thread, here forced into the draw) stays drawn."""
    loader = _loader(shuffle=True, generator=torch.Generator().manual_seed(3))
    _epoch(loader)
    sampler, drawn = loader.batch_sampler, []
    plain = sampler.plain_batches
    sampler.plain_batches = lambda: (drawn.append(torch.rand(1)), plain())[1]
    torch.manual_seed(0)
    sampler.plan_ahead()
    after = torch.rand(1)
    torch.manual_seed(0)
    first, second = torch.rand(1), torch.rand(1)
    assert torch.equal(drawn[0], first) and torch.equal(after, second)


@pytest.mark.parametrize("step", [1, 2, 0])
def test_a_distributed_sampler_is_drawn_ahead_at_the_epoch_set_epoch_went_to_last(step):
    """Its order is its epoch's: the first guess is one more; after that, the step between the last two passes
    (a job that never calls ``set_epoch`` keeps one order)."""
    sampler = tud.DistributedSampler(Indices(), num_replicas=2, rank=1, shuffle=True, seed=4)
    loader = _loader(sampler=sampler)
    hits, planned = [], None
    for epoch in range(4):
        sampler.set_epoch(epoch * step)
        drawn = _epoch(loader)
        if epoch:
            hits.append(planned == drawn)
        epoch_before = sampler.epoch
        planned = loader.batch_sampler.plan_ahead()
        assert sampler.epoch == epoch_before
    assert hits == [step == 1, True, True]


def test_a_global_draw_in_between_makes_it_another_plan():
    torch.manual_seed(0)
    loader = _loader(shuffle=True)
    _epoch(loader)
    planned = loader.batch_sampler.plan_ahead()
    torch.rand(1)
    assert planned != _epoch(loader)


@pytest.mark.parametrize("options", [dict(sampler=Mine()), dict(batch_sampler=MyBatches())],
                         ids=["user sampler", "user batch sampler"])
def test_what_it_cannot_know_is_not_drawn_ahead(options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loader = _loader(**options) if "sampler" in options else coordl.DataLoader(Indices(), **options)
    _epoch(loader)
    assert loader.batch_sampler.plan_ahead() is None
