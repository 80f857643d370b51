"""Frameworks that re-create or wrap the DataLoader keep coordl working, cache included.

* PyTorch Lightning re-creates the user's loader from its attributes (or from the arguments it
  recorded while the ``*_dataloader`` hook ran) to inject a ``DistributedSampler`` under DDP.
* HF Accelerate's ``prepare`` builds a new ``DataLoaderShard`` around ``loader.dataset``.

In both cases the loader that actually iterates must still read raw bytes through the same node
cache: same segment, MinIO fill in epoch 1, then exactly ``items_cached`` hits per later epoch.
"""

import contextlib
import glob
import os
import uuid

import pytest
import pytorch_lightning as pl
import torch
import torch.utils.data as tud
import torchvision
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from lightning_fabric.utilities.data import _replace_dunder_methods
from pytorch_lightning.trainer.states import RunningStage
from pytorch_lightning.utilities.data import _update_dataloader
from torchvision import transforms as T

import coordl
from coordl._fetch.cached_dataset import CachedDataset
from tests.conftest import dataset_bytes

N_IMAGES = 96  # the image_root fixture
TINY = T.Compose([T.Resize((8, 8)), T.ToTensor()])


def _files(root: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(root, "*", "*.jpg")))
    assert len(files) == N_IMAGES
    return files


def _indexed_bytes_dataset(root: str) -> coordl.FileDataset:
    """Items are (raw file bytes, index): batches reveal which samples came, and that their bytes are right."""
    files = _files(root)
    return coordl.FileDataset(files, targets=list(range(len(files))), decode="bytes")


def _contents(root: str) -> list[bytes]:
    out = []
    for path in _files(root):
        with open(path, "rb") as f:
            out.append(f.read())
    return out


def _iterate_indices(loader, contents: list[bytes]) -> list[int]:
    """Indices yielded by one pass over ``loader``, in order, checking every sample's bytes."""
    seen = []
    for raws, indices in loader:
        assert len(raws) == len(indices)
        for raw, index in zip(raws, indices.tolist()):
            assert bytes(raw) == contents[index], f"sample {index} came back with wrong bytes"
            seen.append(index)
    return seen


def _cached_indices(cache) -> set[int]:
    """Indices the cache holds (``get`` only reads; it never inserts)."""
    return {i for i in range(cache.n_items) if cache.get(i) is not None}


@contextlib.contextmanager
def _restored_environ():
    saved = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        os.environ.update(saved)


# -- PyTorch Lightning ---------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("built_in_hook", [False, True], ids=["from_attributes", "from_saved_args"])
def test_lightning_update_dataloader_injects_distributed_sampler(image_root, num_workers, built_in_hook):
    """Lightning's ``_update_dataloader`` (what it calls to inject a DistributedSampler under DDP)."""
    contents = _contents(image_root)
    total = dataset_bytes(image_root)
    cache_name = f"test-frameworks-{uuid.uuid4().hex}"
    dataset = _indexed_bytes_dataset(image_root)

    def make():
        return coordl.DataLoader(dataset, batch_size=5, shuffle=True, num_workers=num_workers,
                                 cache_bytes=total // 2, cache_name=cache_name)

    if built_in_hook:  # as when the loader is built inside a `*_dataloader` hook: Lightning records the args
        with _replace_dunder_methods(tud.DataLoader, "dataset"), _replace_dunder_methods(tud.BatchSampler):
            loader = make()
        assert hasattr(loader, "__pl_saved_args")
    else:
        loader = make()
    new = None
    try:
        assert isinstance(loader.dataset, CachedDataset) and loader.dataset.cache is not None
        sampler = tud.DistributedSampler(loader.dataset, num_replicas=2, rank=0, shuffle=True)
        new = _update_dataloader(loader, sampler, mode=RunningStage.TRAINING)

        assert type(new) is coordl.DataLoader
        assert new is not loader
        assert new.sampler is sampler
        assert new.cache_bytes == total // 2 and new.cache_name == cache_name
        assert new.num_workers == num_workers and new.batch_size == 5
        assert isinstance(new.dataset, CachedDataset)
        assert new.dataset.dataset is dataset  # unwrapped: not a proxy of a proxy
        assert new.dataset.cache is not None
        assert new.dataset.cache.name == loader.dataset.cache.name
        assert new.dataset.identity == loader.dataset.identity

        # Epoch 1: exactly rank 0's shard (in the sampler's order), all misses, filling the cache.
        rank0, rank1 = _shard(loader.dataset, epoch=0), _shard(loader.dataset, epoch=0, rank=1)
        assert len(rank0) == N_IMAGES // 2 and not set(rank0) & set(rank1)
        assert _iterate_indices(new, contents) == rank0
        first = new.stats().epochs[-1]
        assert (first.samples, first.hits, first.misses) == (len(rank0), 0, len(rank0))
        cached = _cached_indices(new.dataset.cache)
        assert cached and cached <= set(rank0)  # only rank 0's samples were read
        assert new.dataset.cache.stats().items_cached == len(cached)
        assert new.dataset.cache.stats().bytes_cached <= total // 2
        # the original loader's handle sees the same segment, filled by the new loader
        assert loader.dataset.cache.stats().items_cached == len(cached)

        # Epoch 2, reshuffled: rank 0's new shard, hits exactly for the cached samples in it.
        sampler.set_epoch(1)
        rank0_e2 = _shard(loader.dataset, epoch=1)
        assert rank0_e2 != rank0
        assert _iterate_indices(new, contents) == rank0_e2
        second = new.stats().epochs[-1]
        expected_hits = len(set(rank0_e2) & cached)
        assert expected_hits > 0
        assert (second.samples, second.hits, second.misses) == (len(rank0_e2), expected_hits,
                                                                 len(rank0_e2) - expected_hits)
    finally:
        if new is not None:
            new.close()
        loader.close()


def _shard(dataset, epoch: int, rank: int = 0) -> list[int]:
    s = tud.DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True)
    s.set_epoch(epoch)
    return list(s)


class _TinyModule(pl.LightningModule):
    """A linear layer over 8x8 images; its train_dataloader is a coordl.DataLoader."""

    def __init__(self, root: str, cache_bytes: int, num_workers: int):
        super().__init__()
        self.layer = torch.nn.Linear(3 * 8 * 8, 4)
        self.root, self.cache_bytes, self.num_workers = root, cache_bytes, num_workers
        self.made: list[coordl.DataLoader] = []

    def training_step(self, batch, batch_idx):
        images, targets = batch
        return torch.nn.functional.cross_entropy(self.layer(images.flatten(1)), targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        loader = coordl.DataLoader(torchvision.datasets.ImageFolder(self.root, transform=TINY), batch_size=16,
                                   shuffle=True, num_workers=self.num_workers, cache_bytes=self.cache_bytes)
        self.made.append(loader)
        return loader


class _EpochCounters(pl.Callback):
    """The train loader's shared counters of the pass (main + workers) and cache fill at each epoch's end."""

    def __init__(self):
        self.loaders, self.totals, self.items_cached = [], [], []

    def on_train_epoch_end(self, trainer, pl_module):
        loader = trainer.train_dataloader
        self.loaders.append(loader)
        self.totals.append(loader.dataset.counters.totals())
        self.items_cached.append(loader.dataset.cache.stats().items_cached)


def _fit(tmp_path, image_root, num_workers):
    """3 epochs of DDP on one CPU process; returns (module, trainer, callback). Caller closes the loaders."""
    total = dataset_bytes(image_root)
    module, counters = _TinyModule(image_root, total // 2, num_workers), _EpochCounters()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="ddp", max_epochs=3, callbacks=[counters],
                         enable_progress_bar=False, logger=False, enable_checkpointing=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path))
    with _restored_environ():
        try:
            trainer.fit(module)
        finally:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    return module, trainer, counters


def _close_all(*loaders) -> None:
    for loader in loaders:
        if isinstance(loader, coordl.DataLoader):
            loader.close()


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_lightning_ddp_fit_reads_through_the_cache(tmp_path, image_root, num_workers):
    module, trainer, counters = _fit(tmp_path, image_root, num_workers)
    loader = trainer.train_dataloader
    try:
        assert trainer.state.finished and trainer.current_epoch == 3
        assert len(module.made) == 1
        original = module.made[0]
        # Lightning really re-created the loader to inject its DistributedSampler, and it is still coordl's.
        assert type(loader) is coordl.DataLoader and loader is not original
        assert isinstance(loader.sampler, tud.DistributedSampler) and loader.sampler.num_replicas == 1
        assert all(seen is loader for seen in counters.loaders)
        assert loader.cache_bytes == original.cache_bytes == dataset_bytes(image_root) // 2
        assert loader.num_workers == num_workers
        assert isinstance(loader.dataset, CachedDataset) and loader.dataset.cache is not None
        assert loader.dataset.cache.name == original.dataset.cache.name

        stats = loader.dataset.cache.stats()
        assert 0 < stats.items_cached < N_IMAGES and stats.frozen
        assert stats.bytes_cached <= dataset_bytes(image_root) // 2
        assert counters.items_cached == [stats.items_cached] * 3  # filled in epoch 1, never changed

        # Per epoch, from the shared counters (each pass counts into its own table): epoch 1 all
        # misses; epochs 2, 3 hit exactly the cached items.
        per_epoch = counters.totals
        assert [e["samples"] for e in per_epoch] == [N_IMAGES] * 3
        assert (per_epoch[0]["hits"], per_epoch[0]["misses"]) == (0, N_IMAGES)
        for epoch in per_epoch[1:]:
            assert epoch["hits"] == stats.items_cached
            assert epoch["misses"] == N_IMAGES - stats.items_cached
            assert epoch["cache_bytes"] == stats.bytes_cached

        # The loader's own per-epoch stats agree, and so do those of the loader the module made, which
        # Lightning re-created: the one the user holds.
        epochs = loader.stats().epochs
        assert len(epochs) == 3
        assert [(e.samples, e.hits) for e in epochs] == [(N_IMAGES, 0)] + [(N_IMAGES, stats.items_cached)] * 2
        assert [(e.samples, e.hits) for e in original.stats().epochs] == [(e.samples, e.hits) for e in epochs]
        assert all(e.stall_s is not None for e in epochs)  # Lightning iterates coordl's loader: waits timed
    finally:
        _close_all(loader, *module.made)


# -- HF Accelerate ---------------------------------------------------------------------------------


@pytest.fixture
def fresh_accelerate_state():
    def reset():
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    reset()
    with _restored_environ():
        yield
    reset()


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_accelerate_prepare_keeps_the_cache(image_root, num_workers, fresh_accelerate_state):
    contents = _contents(image_root)
    total = dataset_bytes(image_root)
    dataset = _indexed_bytes_dataset(image_root)
    loader = coordl.DataLoader(dataset, batch_size=7, shuffle=True, num_workers=num_workers,
                               cache_bytes=total // 2)
    prepared = None
    try:
        accelerator = Accelerator(cpu=True)
        prepared = accelerator.prepare(loader)
        assert prepared is not loader
        # Accelerate re-wraps loader.dataset: the CachedDataset proxy, so it reads through the same cache.
        assert prepared.dataset is loader.dataset
        assert isinstance(prepared.dataset, CachedDataset) and prepared.dataset.dataset is dataset
        cache = prepared.dataset.cache
        assert cache is not None and cache is loader.dataset.cache
        assert prepared.num_workers == num_workers

        counts, orders = [], []
        for _ in range(2):
            before = loader.dataset.counters.totals()
            seen = _iterate_indices(prepared, contents)
            after = loader.dataset.counters.totals()
            assert sorted(seen) == list(range(N_IMAGES)), "each sample exactly once per epoch"
            orders.append(seen)
            counts.append({k: after[k] - before[k] for k in after})

        stats = cache.stats()
        assert 0 < stats.items_cached < N_IMAGES and stats.bytes_cached <= total // 2
        assert (counts[0]["samples"], counts[0]["hits"], counts[0]["misses"]) == (N_IMAGES, 0, N_IMAGES)
        assert counts[1]["samples"] == N_IMAGES
        assert counts[1]["hits"] == stats.items_cached
        assert counts[1]["misses"] == N_IMAGES - stats.items_cached
        assert counts[1]["cache_bytes"] == stats.bytes_cached
        assert orders[0] != orders[1]  # shuffle=True survived prepare
    finally:
        del prepared
        loader.close()


# -- Lightning: epoch bookkeeping --------------------------------------------------------------


@pytest.mark.slow
def test_lightning_fit_epochs_are_recorded_as_complete(tmp_path, image_root):
    """Lightning stops each epoch after len(loader) batches without asking for StopIteration;
    every sample was delivered, so coordl's stats should not call these epochs incomplete."""
    module, trainer, _ = _fit(tmp_path, image_root, num_workers=0)
    loader = trainer.train_dataloader
    try:
        epochs = loader.stats().epochs
        assert [e.samples for e in epochs] == [N_IMAGES] * 3
        assert [e.batches for e in epochs] == [len(loader)] * 3
        finished = epochs[:2]  # epoch 3 is still "running" until the next iter() or close()
        assert all(e.complete for e in finished), f"fully consumed epochs recorded as incomplete: {finished}"
    finally:
        _close_all(loader, *module.made)
