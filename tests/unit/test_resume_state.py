"""Mid-epoch checkpoints of coordl loaders (state_dict/load_state_dict), in-process and with torch's own
sampling settings: the resumed loader yields exactly the batches the uninterrupted run yields next."""

import copy
import warnings

import pytest
import torch
import torch.utils.data as tud
from torchdata.stateful_dataloader import StatefulDataLoader

import coordl

N = 20  # 7 batches of 3, the last one short


class Indices(tud.Dataset):
    """Sample i is i: batches show which samples came."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return i


class Stream(tud.IterableDataset):
    def __iter__(self):
        return iter(range(N))


def _generator(explicit: bool):
    return torch.Generator().manual_seed(7) if explicit else None


def _loader(**options) -> coordl.DataLoader:
    generator = options.pop("generator", False)
    options.setdefault("batch_size", 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # coordl says once that it does not cache this dataset
        return coordl.DataLoader(options.pop("dataset", Indices()), generator=_generator(generator), **options)


def _plain(batch):
    return batch.tolist() if isinstance(batch, torch.Tensor) else batch


def _epoch(loader) -> list:
    return [_plain(b) for b in loader]


def _uninterrupted(epochs: int, **options) -> list[list]:
    torch.manual_seed(0)
    loader = _loader(**options)
    return [_epoch(loader) for _ in range(epochs)]


def _interrupted(k: int, epoch: int = 0, **options):
    """Run ``epoch`` whole epochs, then ``k`` batches of the next; the batches seen and the loader's state
    at that point (what a checkpoint holds)."""
    torch.manual_seed(0)
    loader = _loader(**options)
    seen = [_epoch(loader) for _ in range(epoch)]
    it = iter(loader)
    seen.append([_plain(next(it)) for _ in range(k)])
    state = copy.deepcopy(loader.state_dict())
    del it
    loader.close()
    return seen, state


def _resumed(state, epochs: int, **options) -> list[list]:
    torch.manual_seed(123)  # a new process: its own global RNG
    torch.rand(5)  # which its model's initialization draws from
    loader = _loader(**options)
    loader.load_state_dict(state)
    return [_epoch(loader) for _ in range(epochs)]


SETTINGS = [
    dict(shuffle=False),
    dict(shuffle=True),
    dict(shuffle=True, generator=True),
    dict(shuffle=True, generator=True, drop_last=True),
    dict(shuffle=True, num_workers=2),
    dict(shuffle=True, generator=True, num_workers=2, prefetch_factor=3),
    dict(shuffle=True, batch_size=None),
]


@pytest.mark.parametrize("options", SETTINGS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("k", [1, 4])
def test_resumed_mid_epoch_yields_the_rest_and_the_following_epochs(options, k):
    full = _uninterrupted(4, **options)
    seen, state = _interrupted(k, epoch=1, **options)
    assert state["pass"]["consumed"] == k
    assert seen == [full[0], full[1][:k]]
    after = _resumed(state, 3, **options)
    assert after == [full[1][k:], full[2], full[3]]
    # every sample exactly once in the interrupted epoch, across the interruption
    def samples(batches):
        return sorted(i for b in batches for i in (b if isinstance(b, list) else [b]))
    assert samples(seen[1] + after[0]) == samples(full[1])


@pytest.mark.parametrize("options", [dict(shuffle=True, generator=True), dict(shuffle=True, num_workers=2)],
                         ids=["generator", "workers"])
def test_a_state_at_an_epoch_boundary_resumes_with_the_next_epoch(options):
    full = _uninterrupted(3, **options)
    torch.manual_seed(0)
    loader = _loader(**options)
    first = _epoch(loader)
    state = copy.deepcopy(loader.state_dict())
    assert first == full[0] and state["pass"] is None
    assert _resumed(state, 2, **options) == full[1:]
    # after the last batch, before the pass has seen the plan run out, is a boundary too
    torch.manual_seed(0)
    loader = _loader(**options)
    it = iter(loader)
    [next(it) for _ in range(len(loader))]
    state = copy.deepcopy(loader.state_dict())
    assert state["pass"] is None
    assert _resumed(state, 2, **options) == full[1:]


def test_without_a_generator_the_state_carries_the_global_rng_the_next_epochs_draw_from():
    """Later epochs' orders are drawn from the global RNG, as in torch: ``load_state_dict`` sets it to where
    it was at ``state_dict()``, so a job that trains on after resuming draws the uninterrupted job's epochs
    (and draws what it would have). With a generator the global RNG is the user's alone."""
    torch.manual_seed(0)
    loader = _loader(shuffle=True)
    it = iter(loader)
    head = [_plain(next(it)) for _ in range(2)]
    state, at_save = copy.deepcopy(loader.state_dict()), torch.get_rng_state()
    rest, steps = [_plain(b) for b in it], [torch.rand(3).tolist() for _ in range(2)]  # the training's draws
    following = [_epoch(loader), _epoch(loader)]
    assert torch.equal(state["global_rng"], at_save)
    torch.manual_seed(123)
    again = _loader(shuffle=True)
    again.load_state_dict(state)
    assert torch.equal(torch.get_rng_state(), at_save)
    assert _epoch(again) == rest and [torch.rand(3).tolist() for _ in range(2)] == steps
    assert [_epoch(again), _epoch(again)] == following and head == [b for b in head if len(b) == 3]
    _, with_generator = _interrupted(2, shuffle=True, generator=True)
    assert "global_rng" not in with_generator
    torch.manual_seed(5)
    before = torch.get_rng_state()
    _loader(shuffle=True, generator=True).load_state_dict(with_generator)
    assert torch.equal(torch.get_rng_state(), before)


def test_another_ranks_state_leaves_this_ranks_global_rng_and_says_so(monkeypatch):
    """A DDP job's checkpoint is often rank 0's: rank 1 resumes the epoch from it but keeps its own RNG."""
    from coordl._epochs import batch_sampler
    _, state = _interrupted(2, shuffle=True)
    assert state["global_rng_rank"] == 0
    monkeypatch.setattr(batch_sampler, "_rank", lambda: 1)
    torch.manual_seed(9)
    before = torch.get_rng_state()
    with pytest.warns(UserWarning, match="rank 0's global torch RNG; rank 1 keeps its own"):
        _loader(shuffle=True).load_state_dict(state)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_ledger_pickled_before_its_newer_attributes_unpickles_and_reports():
    import pickle
    loader = _loader(shuffle=True)
    _epoch(loader)
    state = loader.epoch_ledger.__getstate__()
    for newer in ("collate", "_followers"):
        del state[newer]
    old = type(loader.epoch_ledger).__new__(type(loader.epoch_ledger))
    old.__setstate__(state)
    assert [e.samples for e in old.stats().epochs] == [N]
    assert [e.samples for e in pickle.loads(pickle.dumps(loader.epoch_ledger)).stats().epochs] == [N]

def test_distributed_sampler_user_batch_sampler_and_unbatched():
    def distributed():
        sampler = tud.DistributedSampler(Indices(), num_replicas=2, rank=1, shuffle=True, seed=3)
        sampler.set_epoch(5)
        return dict(sampler=sampler)

    def batches():
        sampler = tud.RandomSampler(Indices(), generator=torch.Generator().manual_seed(11))
        return dict(batch_sampler=tud.BatchSampler(sampler, 4, False), batch_size=1)

    for make in (distributed, batches, lambda: dict(batch_size=None, shuffle=True, generator=True)):
        full = _uninterrupted(2, **make())
        _, state = _interrupted(2, **make())
        options = make()
        if "sampler" in options:
            options["sampler"].set_epoch(0)  # the checkpoint brings the epoch back
        assert _resumed(state, 2, **options) == [full[0][2:], full[1]], make


def test_torchdata_resumes_coordls_batch_sampler_like_its_own():
    """StatefulDataLoader around coordl's batch sampler (what Accelerate's use_stateful_dataloader
    builds) snapshots and restores it; the rest of the epoch is the uninterrupted run's, as with
    torchdata's own sampler on the same dataset."""
    for workers in (0, 2):
        def stateful(sampler_of, generator):
            parts = _loader(shuffle=True, generator=generator) if sampler_of == "coordl" else None
            if parts is None:
                return StatefulDataLoader(Indices(), batch_size=3, shuffle=True, num_workers=workers,
                                          generator=_generator(generator))
            return StatefulDataLoader(parts.dataset, batch_sampler=parts.batch_sampler, num_workers=workers,
                                      generator=parts.generator)

        for sampler_of in ("coordl", "torchdata"):
            for generator in (False, True):
                torch.manual_seed(0)
                full = _epoch(stateful(sampler_of, generator))
                torch.manual_seed(0)
                loader = stateful(sampler_of, generator)
                it = iter(loader)
                head = [next(it).tolist() for _ in range(3)]
                state = copy.deepcopy(loader.state_dict())
                del it
                torch.manual_seed(123)
                again = stateful(sampler_of, generator)
                again.load_state_dict(state)
                assert head + _epoch(again) == full, (workers, sampler_of, generator)


def test_unshuffled_batches_equal_torchdatas_before_and_after_resume():
    torchdata = StatefulDataLoader(Indices(), batch_size=3)
    it = iter(torchdata)
    [next(it) for _ in range(2)]
    resumed = StatefulDataLoader(Indices(), batch_size=3)
    resumed.load_state_dict(torchdata.state_dict())
    _, state = _interrupted(2, shuffle=False)
    assert _resumed(state, 1, shuffle=False)[0] == _epoch(resumed)


def test_stats_count_only_the_resumed_batches():
    _, state = _interrupted(5, shuffle=True, generator=True)
    loader = _loader(shuffle=True, generator=True)
    loader.load_state_dict(state)
    assert len(_epoch(loader)) == 2
    epoch = loader.stats().epochs[0]
    assert epoch.complete and epoch.batches == 2 and epoch.samples == N - 5 * 3


def test_wrong_states_are_refused_with_what_to_do():
    _, state = _interrupted(2, shuffle=True, generator=True)
    with pytest.raises(ValueError, match="epoch of 7 batches; this loader's epochs have 5"):
        _loader(shuffle=True, generator=True, batch_size=4).load_state_dict(state)
    with pytest.raises(ValueError, match="1 generator"):
        _loader(shuffle=False).load_state_dict(state)
    with pytest.raises(ValueError, match="not a coordl loader state"):
        _loader().load_state_dict({"_snapshot": {}})
    loader = _loader(dataset=Stream())
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="IterableDataset.*epoch boundaries"):
        _loader(dataset=Stream()).load_state_dict(state)
    assert list(it)  # an iterable dataset's state at the boundary loads
    _loader(dataset=Stream()).load_state_dict(loader.state_dict())


def test_a_state_taken_again_before_the_resumed_pass_starts_is_the_saved_one():
    full = _uninterrupted(1, shuffle=True, generator=True)
    _, state = _interrupted(3, shuffle=True, generator=True)
    loader = _loader(shuffle=True, generator=True)
    loader.load_state_dict(state)
    it = iter(loader)  # in-process: the pass starts at the first next()
    again = copy.deepcopy(loader.state_dict())
    assert again["pass"]["consumed"] == 3
    assert _resumed(again, 1, shuffle=True, generator=True) == [full[0][3:]]
    assert [_plain(b) for b in it] == full[0][3:]
