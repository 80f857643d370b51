"""coordl yields exactly torch's batches, and each epoch sees every sample once in a new order."""

import multiprocessing as mp
import os
import random
import time
import warnings

import numpy as np
import pytest
import torch
import torch.utils.data as tud
import torchvision
from torchvision import transforms as T

import coordl
from coordl._cache import setup as cache_setup
from tests.conftest import dataset_bytes

AUGMENT = T.Compose([T.RandomResizedCrop(12), T.RandomHorizontalFlip(), T.PILToTensor()])
EVAL = T.Compose([T.Resize((16, 16)), T.PILToTensor()])


def _gen(seed=7):
    return torch.Generator().manual_seed(seed)


def _files(root):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


def _pairs_collate(items):
    images, targets = zip(*items)
    return {"x": torch.stack(images).float().mean(dim=(1, 2, 3)), "y": list(targets)}


def _run(loader_cls, dataset, epochs, make_kwargs, set_epoch=None, in_flight=None):
    """Each epoch's batches; with ``in_flight`` (a list), also each epoch's tasks that torch's iterator
    handed its workers before the first batch (``prefetch_factor`` x ``num_workers``)."""
    out = []
    loader = loader_cls(dataset, **make_kwargs())
    for epoch in range(epochs):
        if set_epoch:
            set_epoch(loader, epoch)
        torch.manual_seed(100 + epoch)  # in-process augmentation (num_workers=0) draws from here
        batches = iter(loader)
        if in_flight is not None:
            in_flight.append(batches._tasks_outstanding)
        out.append(list(batches))
    if isinstance(loader, coordl.DataLoader):
        loader.close()
        if getattr(loader.dataset, "cache", None) is not None:
            assert all(e.hits > 0 for e in loader.stats().epochs[1:]), "the cache served nothing"
    return out


def _assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        assert a.is_pinned() == b.is_pinned()
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


CASES = {
    "shuffle": lambda ds: dict(batch_size=10, shuffle=True, generator=_gen()),
    "sequential_drop_last": lambda ds: dict(batch_size=10, drop_last=True),
    "batch_sampler": lambda ds: dict(batch_sampler=tud.BatchSampler(tud.RandomSampler(ds, generator=_gen(3)), 7, False),
                                     generator=_gen()),
    "collate_fn": lambda ds: dict(batch_size=9, shuffle=True, generator=_gen(), collate_fn=_pairs_collate),
    "distributed": lambda ds: dict(batch_size=8, sampler=tud.DistributedSampler(ds, num_replicas=2, rank=1, seed=5),
                                   generator=_gen()),
}


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_same_batches_as_torch_with_a_cached_image_folder(image_root, case, num_workers):
    dataset = torchvision.datasets.ImageFolder(image_root, transform=AUGMENT)

    def kwargs():
        return {**CASES[case](dataset), "num_workers": num_workers}

    def set_epoch(loader, epoch):
        if isinstance(loader.sampler, tud.DistributedSampler):
            loader.sampler.set_epoch(epoch)

    expected = _run(tud.DataLoader, dataset, 3, kwargs, set_epoch)
    half = dataset_bytes(image_root) // 2
    got = _run(lambda ds, **kw: coordl.DataLoader(ds, **kw, cache_bytes=half), dataset, 3, kwargs, set_epoch)
    _assert_same(got, expected)
    assert [len(epoch) for epoch in got] == [len(epoch) for epoch in expected] and len(got[0]) > 0


@pytest.mark.parametrize("num_workers", [0, 2])
def test_same_batches_as_torch_for_a_dataset_coordl_cannot_cache(num_workers, monkeypatch):
    monkeypatch.setattr(cache_setup, "_warned", set())  # it warns once per process and dataset type
    dataset = tud.TensorDataset(torch.arange(50), torch.randn(50, 3))

    def kwargs():
        return dict(batch_size=6, shuffle=True, generator=_gen(), num_workers=num_workers)

    with pytest.warns(UserWarning, match="coordl cannot cache TensorDataset"):
        got = _run(coordl.DataLoader, dataset, 2, kwargs)
    _assert_same(got, _run(tud.DataLoader, dataset, 2, kwargs))


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_transform_set_through_loader_dataset_applies_from_the_next_epoch(image_root, num_workers):
    dataset = torchvision.datasets.ImageFolder(image_root, transform=AUGMENT)

    def kwargs():
        return dict(batch_size=10, shuffle=True, generator=_gen(), num_workers=num_workers)

    def train_then_evaluate(loader, epoch):
        loader.dataset.transform = AUGMENT if epoch == 0 else EVAL

    expected = _run(tud.DataLoader, dataset, 2, kwargs, train_then_evaluate)
    half = dataset_bytes(image_root) // 2
    got = _run(lambda ds, **kw: coordl.DataLoader(ds, **kw, cache_bytes=half), dataset, 2, kwargs,
               train_then_evaluate)
    _assert_same(got, expected)
    assert got[0][0][0].shape[-2:] == (12, 12) and got[1][0][0].shape[-2:] == (16, 16)
    assert dataset.transform is EVAL


# -- the options of torch's worker processes ---------------------------------------------------------

_loaded_by: dict[int, int] = {}  # pid -> samples that process loaded (a forked worker gets a key of its own)


class WorkerProbe(coordl.FileDataset):
    """A cacheable dataset whose samples say what the process that loaded them saw: draws from torch,
    numpy and random, the kind of process, its ``tag`` (set by a ``worker_init_fn``) and how many samples
    it had loaded. At module level, so that spawned workers can unpickle it."""

    tag = -1
    delay_s = 0.0

    def decode_raw(self, index, raw):
        time.sleep(self.delay_s)
        pid = os.getpid()
        _loaded_by[pid] = _loaded_by.get(pid, 0) + 1
        return {"index": index, "size": len(raw), "torch": int(torch.randint(1 << 30, ())),
                "numpy": int(np.random.randint(1 << 30)), "python": random.randrange(1 << 30),
                "process": type(mp.current_process()).__name__, "tag": self.tag, "nth": _loaded_by[pid]}


def _seed_and_tag_worker(worker_id):
    """A worker_init_fn as torch's docs suggest: seed numpy and random per worker, set per-worker state."""
    seed = torch.initial_seed() + 1
    np.random.seed(seed % 2**32)
    random.seed(seed)
    tud.get_worker_info().dataset.tag = 100 + worker_id


def _values(epochs, key) -> list:
    return [v for batches in epochs for batch in batches for v in list(batch[key])]


def _pinned(epochs) -> bool:
    """Whether batches come pinned where they can: without an accelerator torch pins nothing and (newer
    versions) warns, which the runs compare."""
    return epochs[0][0]["size"].is_pinned() or not torch.accelerator.is_available()


WORKER_CASES = {  # name: (options, what torch's own run shows of them: f(epochs, in_flight, warned))
    "worker_init_fn": (dict(worker_init_fn=_seed_and_tag_worker),
                       lambda epochs, in_flight, warned: set(map(int, _values(epochs, "tag"))) == {100, 101}),
    "persistent_workers": (dict(persistent_workers=True),  # each worker's count goes on in epoch 2
                           lambda epochs, in_flight, warned: min(map(int, _values(epochs[1:], "nth"))) > 1),
    "pin_memory": (dict(pin_memory=True), lambda epochs, in_flight, warned: _pinned(epochs)),
    "spawn": (dict(multiprocessing_context="spawn"),
              lambda epochs, in_flight, warned: set(_values(epochs, "process")) == {"SpawnProcess"}),
    "prefetch_factor": (dict(prefetch_factor=4), lambda epochs, in_flight, warned: in_flight == [8, 8]),
    "timeout": (dict(timeout=5), lambda epochs, in_flight, warned: True),  # raising: see the test below
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(WORKER_CASES))
def test_each_worker_option_reaches_torchs_workers(image_root, case):
    """Same samples, per-worker draws and state, kind of worker process, tasks in flight and warnings as
    torch, over two epochs of a cached dataset."""
    options, shows = WORKER_CASES[case]
    dataset = WorkerProbe(_files(image_root))
    half = dataset_bytes(image_root) // 2

    def kwargs():
        return dict(batch_size=10, shuffle=True, generator=_gen(), num_workers=2, **options)

    runs = []
    for loader_cls in (tud.DataLoader, lambda ds, **kw: coordl.DataLoader(ds, **kw, cache_bytes=half)):
        in_flight = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            epochs = _run(loader_cls, dataset, 2, kwargs, in_flight=in_flight)
        runs.append((epochs, in_flight, sorted({str(w.message) for w in caught})))
    (expected, *torch_saw), (got, *coordl_saw) = runs
    _assert_same(got, expected)
    assert coordl_saw == torch_saw
    assert shows(*runs[0]), f"torch's own run does not show {case}"


@pytest.mark.slow
@pytest.mark.parametrize("system", ["torch", "coordl"])
def test_a_worker_slower_than_timeout_raises_torchs_error(image_root, system):
    dataset = WorkerProbe(_files(image_root)[:4])
    dataset.delay_s = 3.0
    loader = (tud.DataLoader if system == "torch" else coordl.DataLoader)(dataset, num_workers=1, timeout=1)
    try:
        with pytest.raises(RuntimeError, match="DataLoader timed out after 1 seconds"):
            next(iter(loader))
    finally:
        getattr(loader, "close", lambda: None)()


def test_len_matches_torch(image_root):
    dataset = torchvision.datasets.ImageFolder(image_root)
    for kwargs in (dict(batch_size=10), dict(batch_size=10, drop_last=True), dict(batch_size=1)):
        with coordl.DataLoader(dataset, **kwargs) as loader:
            assert len(loader) == len(tud.DataLoader(dataset, **kwargs))


def _index_dataset(root):
    files = _files(root)
    return coordl.FileDataset(files, targets=list(range(len(files))), decode=len), files


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_sample_once_per_epoch_in_a_new_order(image_root, num_workers):
    dataset, files = _index_dataset(image_root)
    orders = []
    with coordl.DataLoader(dataset, batch_size=8, shuffle=True, num_workers=num_workers, cache_bytes=100_000) as loader:
        for _ in range(3):
            sizes, indices = [], []
            for batch_sizes, batch_indices in loader:
                sizes += batch_sizes.tolist()
                indices += batch_indices.tolist()
            assert sorted(indices) == list(range(len(files)))
            assert sizes == [os.path.getsize(files[i]) for i in indices]  # bytes of the right file
            orders.append(indices)
    assert len({tuple(o) for o in orders}) == 3


@pytest.mark.slow
def test_augmentation_is_drawn_afresh_each_epoch_from_cached_bytes(image_root):
    dataset = torchvision.datasets.ImageFolder(image_root, transform=AUGMENT)
    with coordl.DataLoader(dataset, batch_size=96, num_workers=2, cache_bytes="1GiB") as loader:
        first, second = (next(iter(loader))[0] for _ in range(2))
        assert loader.stats().epochs[1].hits > 0
    assert first.shape == second.shape and not torch.equal(first, second)
