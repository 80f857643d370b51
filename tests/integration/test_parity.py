"""coordl yields exactly torch's batches, and each epoch sees every sample once in a new order."""

import os

import pytest
import torch
import torch.utils.data as tud
import torchvision
from torchvision import transforms as T

import coordl
from tests.conftest import dataset_bytes

AUGMENT = T.Compose([T.RandomResizedCrop(12), T.RandomHorizontalFlip(), T.PILToTensor()])


def _gen(seed=7):
    return torch.Generator().manual_seed(seed)


def _pairs_collate(items):
    images, targets = zip(*items)
    return {"x": torch.stack(images).float().mean(dim=(1, 2, 3)), "y": list(targets)}


def _run(loader_cls, dataset, epochs, make_kwargs, set_epoch=None):
    out = []
    loader = loader_cls(dataset, **make_kwargs())
    for epoch in range(epochs):
        if set_epoch:
            set_epoch(loader, epoch)
        torch.manual_seed(100 + epoch)  # in-process augmentation (num_workers=0) draws from here
        out.append(list(loader))
    if isinstance(loader, coordl.DataLoader):
        loader.close()
        if getattr(loader.dataset, "cache", None) is not None:
            assert all(e.hits > 0 for e in loader.stats().epochs[1:]), "the cache served nothing"
    return out


def _assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
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
    monkeypatch.setattr(coordl.cache_setup, "_warned", set())  # it warns once per process and dataset type
    dataset = tud.TensorDataset(torch.arange(50), torch.randn(50, 3))

    def kwargs():
        return dict(batch_size=6, shuffle=True, generator=_gen(), num_workers=num_workers)

    with pytest.warns(UserWarning, match="coordl cannot cache TensorDataset"):
        got = _run(coordl.DataLoader, dataset, 2, kwargs)
    _assert_same(got, _run(tud.DataLoader, dataset, 2, kwargs))


def test_len_matches_torch(image_root):
    dataset = torchvision.datasets.ImageFolder(image_root)
    for kwargs in (dict(batch_size=10), dict(batch_size=10, drop_last=True), dict(batch_size=1)):
        with coordl.DataLoader(dataset, **kwargs) as loader:
            assert len(loader) == len(tud.DataLoader(dataset, **kwargs))


def _index_dataset(root):
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)
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
