"""Train/val splits are cached: ``Subset`` (``random_split``) and ``ConcatDataset`` of cacheable datasets."""

import warnings

import pytest
import torch
import torch.utils.data as tud
import torchvision
from torchvision import transforms as T

import coordl
from coordl._cache import setup as cache_setup
from coordl._fetch.raw_datasets import raw_source
from tests.conftest import dataset_bytes

RESIZE = T.Compose([T.Resize((16, 16)), T.ToTensor()])  # deterministic: batches compare exactly


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _shuffled(seed: int, **kwargs) -> dict:
    """Loader arguments that shuffle with a fresh generator seeded ``seed``."""
    return dict(batch_size=10, shuffle=True, generator=_gen(seed), **kwargs)


def _folder(root: str, transform=RESIZE) -> torchvision.datasets.ImageFolder:
    return torchvision.datasets.ImageFolder(root, transform=transform)


def _split(root: str) -> list[tud.Subset]:
    return tud.random_split(_folder(root), [0.75, 0.25], generator=_gen(1))


def _epochs(loader, n: int) -> list[list]:
    return [list(loader) for _ in range(n)]


def _assert_same_batches(got: list[list], expected: list[list]) -> None:
    assert len(got) == len(expected)
    for got_epoch, expected_epoch in zip(got, expected):
        assert len(got_epoch) == len(expected_epoch) > 0
        for (images, labels), (ref_images, ref_labels) in zip(got_epoch, expected_epoch):
            assert torch.equal(labels, ref_labels) and torch.equal(images, ref_images)


def _cached_epochs(dataset, cache_bytes: int, epochs: int = 2, **kwargs):
    """(batches of each epoch, stats) from coordl, asserting that it did not warn it cannot cache."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with coordl.DataLoader(dataset, **kwargs, cache_bytes=cache_bytes) as loader:
            batches = _epochs(loader, epochs)
            stats = loader.stats()
    assert not [w for w in caught if "cannot cache" in str(w.message)]
    return batches, stats


def _assert_second_epoch_all_hits(stats, n: int) -> None:
    first, second = stats.epochs[:2]
    assert (first.misses, first.hits) == (n, 0)
    assert (second.hits, second.misses) == (n, 0)


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_random_split_train_part_is_cached_and_gives_torchs_batches(image_root, num_workers):
    train, _ = _split(image_root)
    got, stats = _cached_epochs(train, dataset_bytes(image_root), **_shuffled(7, num_workers=num_workers))
    _assert_second_epoch_all_hits(stats, len(train))
    _assert_same_batches(got, _epochs(tud.DataLoader(train, **_shuffled(7, num_workers=num_workers)), 2))


def _two_folders(root: str, other_root: str) -> tud.ConcatDataset:
    return tud.ConcatDataset([_folder(root), _folder(other_root)])


def _two_subsets(root: str, other_root: str) -> tud.ConcatDataset:
    train, val = _split(root)
    return tud.ConcatDataset([val, train])


@pytest.mark.slow
@pytest.mark.parametrize("make", [_two_folders, _two_subsets], ids=["folders", "subsets"])
def test_concat_dataset_is_cached_and_gives_torchs_batches(image_root, fresh_image_root, make):
    dataset = make(image_root, fresh_image_root)
    size = dataset_bytes(image_root) + dataset_bytes(fresh_image_root)
    got, stats = _cached_epochs(dataset, size, **_shuffled(3, num_workers=2))
    _assert_second_epoch_all_hits(stats, len(dataset))
    _assert_same_batches(got, _epochs(tud.DataLoader(dataset, **_shuffled(3, num_workers=2)), 2))


def test_subset_of_a_subset_is_cached_and_gives_torchs_batches(image_root):
    train, _ = _split(image_root)
    dataset = tud.Subset(train, list(range(len(train) - 1, 0, -3)))
    got, stats = _cached_epochs(dataset, dataset_bytes(image_root), batch_size=5)
    _assert_second_epoch_all_hits(stats, len(dataset))
    _assert_same_batches(got, _epochs(tud.DataLoader(dataset, batch_size=5), 2))
    source, _ = raw_source(dataset)
    assert [source.raw_key(i) for i in range(len(dataset))] == \
        [train.dataset.samples[train.indices[j]][0] for j in dataset.indices]


class _OwnGetitemFolder(torchvision.datasets.ImageFolder):
    def __getitem__(self, index):
        return super().__getitem__(index)


class _OwnGetitemSubset(tud.Subset):
    def __getitem__(self, index):
        return super().__getitem__(index)

    def __getitems__(self, indices):
        return [self[i] for i in indices]


REFUSED = {
    "concat_part": (lambda root: tud.ConcatDataset([_folder(root), tud.TensorDataset(torch.arange(4))]),
                    r"coordl cannot cache ConcatDataset: its part 1 \(TensorDataset\) cannot be cached: TensorDataset "
                    r"does not implement"),
    "subset_of_own_getitem": (lambda root: tud.Subset(_OwnGetitemFolder(root), [0, 1]),
                              r"coordl cannot cache Subset: its dataset \(_OwnGetitemFolder\) cannot be cached: "
                              r"_OwnGetitemFolder overrides __getitem__"),
    "own_getitem_subset": (lambda root: _OwnGetitemSubset(_folder(root), [0, 1]),
                           r"coordl cannot cache _OwnGetitemSubset \(from tests\.integration\.test_split_caching\): "
                           r"_OwnGetitemSubset overrides __getitem__"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_split_of_what_coordl_cannot_cache_warns_naming_the_part(image_root, case, monkeypatch):
    monkeypatch.setattr(cache_setup, "_warned", set())  # it warns once per process and dataset type
    make, message = REFUSED[case]
    dataset = make(image_root)
    with pytest.warns(UserWarning, match=message), coordl.DataLoader(dataset, batch_size=2) as loader:
        assert loader.dataset is dataset  # loaded as torch would, uncached


def test_dali_needs_only_the_files_and_labels_of_each_part(image_root):
    train, _ = _split(image_root)
    unlabelled = coordl.FileDataset([path for path, _ in train.dataset.samples])
    for dataset in (tud.Subset(_OwnGetitemFolder(image_root), [0, 1]),
                    tud.ConcatDataset([train, coordl.FileDataset(unlabelled.files, targets=[0] * len(unlabelled))])):
        source, why = raw_source(dataset, decode=False)
        assert source is not None and not why and hasattr(source, "dali_target")
    source, _ = raw_source(tud.ConcatDataset([train, unlabelled]), decode=False)
    assert not hasattr(source, "dali_target")  # a part without labels: the DALI backend says so


@pytest.mark.slow
@pytest.mark.parametrize("case", ["subset", "concat"])
def test_dali_backend_loads_a_split_with_torchs_labels_in_torchs_order(image_root, case):
    pytest.importorskip("nvidia.dali")
    train, val = tud.random_split(torchvision.datasets.ImageFolder(image_root), [0.75, 0.25], generator=_gen(1))
    dataset = train if case == "subset" else tud.ConcatDataset([val, train])
    with coordl.DataLoader(dataset, **_shuffled(5, num_workers=2), backend="dali",
                           cache_bytes=dataset_bytes(image_root)) as loader:
        got = [[labels.tolist() for _, labels in epoch] for epoch in _epochs(loader, 2)]
        stats = loader.stats()
    expected = _epochs(tud.DataLoader(dataset, **_shuffled(5), collate_fn=_labels), 2)
    assert got == expected
    _assert_second_epoch_all_hits(stats, len(dataset))


def _labels(items: list[tuple]) -> list[int]:
    return [target for _, target in items]
