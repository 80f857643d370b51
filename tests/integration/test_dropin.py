"""Every coordl feature survives a framework that rebuilds the loader from its parts.

A plain ``torch.utils.data.DataLoader(loader.dataset, batch_sampler=loader.batch_sampler,
collate_fn=loader.collate_fn, num_workers=loader.num_workers)``, what HF Accelerate's ``prepare`` makes
(1 and 2 processes), and torch-suite behaviours a swapped-in loader must keep.
"""

import json
import logging
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.utils.data as tud
import torchvision

import coordl
from coordl._cache import setup as cache_setup
from coordl._fetch.storage import FileStorage
from tests import _procs
from tests._signals import FileEvent, FileQueue
from tests.conftest import dataset_bytes

TINY = torchvision.transforms.Compose([torchvision.transforms.Resize((8, 8)), torchvision.transforms.ToTensor()])
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _files(root: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


def _from_parts(loader, **kwargs) -> tud.DataLoader:
    """What a framework builds: a plain torch DataLoader from the loader's attributes."""
    return tud.DataLoader(loader.dataset, batch_sampler=loader.batch_sampler, collate_fn=loader.collate_fn,
                          num_workers=loader.num_workers, **kwargs)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_plain_loader_from_the_parts_keeps_cache_stats_and_summary_line(image_root, num_workers, caplog):
    files = _files(image_root)
    contents = {open(f, "rb").read(): i for i, f in enumerate(files)}
    loader = coordl.DataLoader(coordl.FileDataset(files, decode="bytes"), batch_size=8, shuffle=True,
                               num_workers=num_workers, cache_bytes=dataset_bytes(image_root), collate_fn=list)
    caplog.set_level(logging.INFO, logger="coordl")
    plain = _from_parts(loader)
    orders = []
    for _ in range(2):
        seen = [contents[bytes(b)] for batch in plain for b in batch]
        assert sorted(seen) == list(range(len(files)))  # every sample once per epoch
        orders.append(seen)
    assert orders[0] != orders[1]  # a new order each epoch
    first, second = loader.stats().epochs
    assert (first.samples, first.hits, first.misses, first.complete) == (len(files), 0, len(files), True)
    assert (second.samples, second.hits, second.misses, second.complete) == (len(files), len(files), 0, True)
    lines = [r.getMessage() for r in caplog.records if r.name == "coordl" and r.getMessage().startswith("epoch=")]
    assert [line.split()[:2] for line in lines] == [["epoch=1", "complete=1"], ["epoch=2", "complete=1"]]
    # torch's iterator ran these epochs: the loop's waits were not seen, so they are not given as 0
    assert first.stall_s is None and second.stall_s is None and loader.stats().total.stall_s is None
    assert all("stall_s=- " in line for line in lines) and " - " in str(loader.stats())
    list(loader)  # coordl's own iterator times them
    assert loader.stats().epochs[2].stall_s >= 0 and loader.stats().total.stall_s is None
    loader.close()


def test_a_loader_re_created_from_a_coordl_loaders_parts_reports_to_the_loader_the_user_holds(image_root):
    """As frameworks do (Lightning's DDP, to inject its DistributedSampler): the user's loader, while it has run
    no epoch itself, gives the re-created loader's epochs, the one in progress included, and keeps the finished
    ones after that loader is gone."""
    files = _files(image_root)
    loader = coordl.DataLoader(coordl.FileDataset(files, decode="bytes"), batch_size=8, collate_fn=list,
                               cache_bytes=dataset_bytes(image_root))
    sampler = tud.DistributedSampler(loader.dataset, num_replicas=2, rank=1, shuffle=False)
    again = coordl.DataLoader(loader.dataset, batch_size=8, sampler=sampler, collate_fn=list,
                              cache_bytes=loader.cache_bytes)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        assert sum(len(batch) for batch in again) == len(sampler)
    it = iter(again)
    next(it)
    mine, theirs = loader.stats(), again.stats()
    assert [(e.epoch, e.samples, e.hits) for e in mine.epochs] == [(e.epoch, e.samples, e.hits) for e in theirs.epochs]
    assert [(e.samples, e.hits, e.complete) for e in mine.epochs] == \
        [(len(sampler), 0, True), (len(sampler), len(sampler), True), (8, 8, False)]
    assert mine.cache.items_cached == theirs.cache.items_cached == len(sampler)
    del it
    again.close()
    del again
    assert [e.epoch for e in loader.stats().epochs] == [1, 2, 3] and loader.stats().cache is not None
    assert sum(len(batch) for batch in loader) == len(files)
    assert [e.samples for e in loader.stats().epochs] == [len(files)]  # its own, once it has run an epoch
    loader.close()


def test_the_loader_lightning_re_creates_from_its_arguments_reports_to_the_one_built_before_it(image_root):
    """Re-created over the user's own dataset object (Lightning keeps the arguments), after another loader over
    the same dataset was built first (an evaluation loader): the user's training loader gets the epochs."""
    files = _files(image_root)
    dataset = coordl.FileDataset(files, decode="bytes")
    evaluation = coordl.DataLoader(dataset, batch_size=16, collate_fn=list, cache_bytes=dataset_bytes(image_root))
    training = coordl.DataLoader(dataset, batch_size=8, collate_fn=list, cache_bytes=dataset_bytes(image_root))
    again = coordl.DataLoader(dataset, batch_size=8, collate_fn=list, cache_bytes=dataset_bytes(image_root),
                              sampler=tud.DistributedSampler(dataset, num_replicas=1, rank=0))
    assert sum(len(batch) for batch in again) == len(files)
    assert [(e.samples, e.batches) for e in training.stats().epochs] == [(len(files), len(files) // 8)]
    assert sum(len(batch) for batch in evaluation) == len(files)
    assert [e.batches for e in evaluation.stats().epochs] == [len(files) // 16]  # its own, once it ran
    for loader in (again, training, evaluation):
        loader.close()

def test_the_dali_backend_through_a_plain_loader_gives_its_own_batches(image_root):
    dataset = torchvision.datasets.ImageFolder(image_root)
    options = dict(batch_size=8, backend="dali", cache_bytes=dataset_bytes(image_root))
    with coordl.DataLoader(dataset, **options) as own, coordl.DataLoader(dataset, **options) as parts:
        assert parts.num_workers == 0  # batches come whole from DALI, in the training process
        expected = list(own)
        got = list(_from_parts(parts))
        assert len(got) == len(expected) == len(parts)
        for (images, labels), (want_images, want_labels) in zip(got, expected):
            assert images.shape == (8, 3, 224, 224) and torch.equal(labels, want_labels)
            assert torch.equal(images, want_images)  # eval transform: deterministic
        assert parts.stats().epochs[0].samples == len(dataset) and parts.stats().epochs[0].complete
        with pytest.raises(RuntimeError, match="num_workers=0"):
            next(iter(tud.DataLoader(parts.dataset, batch_sampler=parts.batch_sampler,
                                     collate_fn=parts.collate_fn, num_workers=1)))


class Handles(tud.Dataset):
    """Not cacheable: per-worker state that a ``worker_init_fn`` sets, as with file or DB handles."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor([i, self.worker_tag])


def tag_worker(worker_id: int) -> None:
    tud.get_worker_info().dataset.worker_tag = 100 + worker_id


@pytest.mark.slow
def test_what_torch_users_read_from_a_loader_is_torchs(monkeypatch):
    monkeypatch.setattr(cache_setup, "_warned", set())
    dataset = Handles()
    with pytest.warns(UserWarning, match="coordl cannot cache Handles"):
        loader = coordl.DataLoader(dataset, batch_size=2, num_workers=2, worker_init_fn=tag_worker,
                                   multiprocessing_context="spawn")
    assert loader.dataset is dataset  # not a proxy: isinstance checks and attribute writes reach it
    batches = list(loader)
    assert sorted(int(b[0, 1]) for b in batches) == [100, 100, 101, 101]
    iterator = iter(loader)
    assert len(iterator._workers) == 2  # torch's iterator attributes are there
    del iterator
    loader.close()
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        coordl.DataLoader(Handles(), batch_size=2).close()
    assert not [w for w in again if "cannot cache" in str(w.message)]  # once per process and dataset type
    annotated = coordl.DataLoader[torch.Tensor]  # a module annotated `-> DataLoader[Batch]` imports
    assert annotated is not None


def test_attributes_written_through_loader_dataset_are_the_users_datasets(image_root):
    dataset = coordl.FileDataset(_files(image_root), decode="bytes")
    with coordl.DataLoader(dataset, batch_size=8, cache_bytes=dataset_bytes(image_root)) as loader:
        loader.dataset.some_new_attr = 1
        assert dataset.some_new_attr == 1 and "some_new_attr" not in vars(loader.dataset)
        del loader.dataset.some_new_attr
        assert not hasattr(dataset, "some_new_attr")
        with pytest.raises(AttributeError):
            del loader.dataset.some_new_attr
        loader.dataset.storage = storage = FileStorage()  # coordl's own parts stay on its proxy
        assert vars(loader.dataset)["storage"] is storage and not hasattr(dataset, "storage")
        assert len(next(iter(loader))) == 8


# -- HF Accelerate ---------------------------------------------------------------------------------

@pytest.fixture
def accelerate_state():
    from accelerate.state import AcceleratorState, GradientState
    saved = dict(os.environ)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("backend", ["torch", "dali"])
def test_accelerate_keeps_stats_summary_and_backend(image_root, backend, accelerate_state, caplog):
    from accelerate import Accelerator
    dataset = torchvision.datasets.ImageFolder(image_root, transform=torchvision.transforms.Compose(
        [torchvision.transforms.Resize((32, 32)), torchvision.transforms.ToTensor()]) if backend == "torch" else None)
    loader = coordl.DataLoader(dataset, batch_size=8, shuffle=True, backend=backend,
                               cache_bytes=dataset_bytes(image_root))
    caplog.set_level(logging.INFO, logger="coordl")
    prepared = Accelerator(cpu=True).prepare(loader)
    for _ in range(2):
        labels = [label for _, batch_labels in prepared for label in batch_labels.tolist()]
        assert sorted(labels) == sorted(t for _, t in dataset.samples)
    epochs = loader.stats().epochs
    assert [(e.samples, e.complete) for e in epochs] == [(len(dataset), True)] * 2
    assert epochs[1].hits == len(dataset)
    # torch's iterator runs Accelerate's loop: no waits seen, unless a feed's (DALI) were
    assert all(e.stall_s is None if backend == "torch" else e.stall_s >= 0 for e in epochs)
    assert sum(r.getMessage().startswith("epoch=") for r in caplog.records if r.name == "coordl") == 2
    del prepared
    loader.close()


_TWO_RANKS = textwrap.dedent("""
    import json, os, sys, coordl
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(sys.argv[1]) for f in fs)
    loader = coordl.DataLoader(coordl.FileDataset(files, targets=list(range(len(files))), decode="bytes"),
                               batch_size=4, shuffle=True, num_workers=int(sys.argv[3]),
                               collate_fn=lambda items: [t for _, t in items], cache_bytes=10**9)
    prepared = accelerator.prepare(loader)
    seen = [[i for batch in prepared for i in batch] for _ in range(2)]
    stats = loader.stats()
    with open(os.path.join(sys.argv[2], f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump({"seen": seen, "epochs": [[e.samples, e.hits, e.misses] for e in stats.epochs[:2]],
                   "users": stats.cache.users_alive}, f)
    accelerator.wait_for_everyone()
    loader.close()
""")


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_accelerate_with_two_processes_shares_one_cache(tmp_path, image_root, num_workers):
    script = tmp_path / "train.py"
    script.write_text(_TWO_RANKS)
    # torchrun starts the processes; Accelerate takes its distributed set-up from their environment.
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script), image_root, str(tmp_path), str(num_workers)], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    n = len(_files(image_root))
    for epoch in range(2):
        a, b = (r["seen"][epoch] for r in ranks)
        assert not set(a) & set(b) and sorted(a + b) == list(range(n))  # the ranks split every epoch
    assert sum(r["epochs"][0][2] for r in ranks) == n  # epoch 1: every sample read once, by one rank
    for r in ranks:  # epoch 2: one node-wide cache, filled by both ranks, serves each rank's new shard
        samples, hits, misses = r["epochs"][1]
        assert hits == samples and misses == 0


# -- hp_group through the parts --------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("via", ["parts", "accelerate"])
def test_an_hp_group_member_iterated_by_a_framework_still_shares(tmp_path, via):
    root = str(tmp_path / "index-files")
    n = 40
    _procs.IndexFiles.write(root, n)
    group, results, start = f"dropin-{os.getpid()}-{via}", FileQueue(tmp_path), FileEvent(tmp_path)
    common = dict(hp_group_size=2, hp_group_timeout_s=30, cache_bytes=0)
    procs = [_procs.spawn(_procs.hp_job, root, n, group, 2, results, options, start)
             for options in (dict(common, via=via), dict(common, num_workers=1))]
    start.set()
    runs = [results.get(timeout=_procs.JOIN_TIMEOUT * 2) for _ in procs]
    _procs.join_ok(*procs)
    (_, seen_a, stats_a), (_, seen_b, stats_b) = runs
    assert seen_a == seen_b  # the same batches, augmentation included
    for _, batches in seen_a:
        assert sorted(i for indices, _ in batches for i in indices) == list(range(n))
    for e in range(2):
        assert stats_a["epochs"][e]["members"] == stats_b["epochs"][e]["members"] == 2
        assert stats_a["epochs"][e]["prepared"] + stats_b["epochs"][e]["prepared"] == n // 4  # each made once


# -- Lightning, two processes ----------------------------------------------------------------------

_LIGHTNING_DDP_SPAWN = textwrap.dedent("""
    import json, os, sys
    import pytorch_lightning as pl
    import torch
    from tests.integration.test_frameworks import _TinyModule

    def report(self):
        loader = self.trainer.train_dataloader
        with open(os.path.join(sys.argv[2], f"rank{self.global_rank}.json"), "w") as f:
            json.dump({"type": type(loader).__name__, "sampler": type(loader.sampler).__name__,
                       "epochs": [[e.samples, e.hits, e.misses] for e in loader.stats().epochs]}, f)

    class Tiny(_TinyModule):  # builds its loader in each spawned process (the train_dataloader hook)
        on_train_end = report

    class Given(pl.LightningModule):  # no hook: the loader passed to fit, pickled into each spawned process
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3 * 8 * 8, 4)
        training_step, configure_optimizers = _TinyModule.training_step, _TinyModule.configure_optimizers
        on_train_end = report

    if __name__ == "__main__":
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=2,
                             enable_progress_bar=False, logger=False, enable_checkpointing=False,
                             enable_model_summary=False, default_root_dir=sys.argv[2])
        tiny = Tiny(sys.argv[1], cache_bytes=10**9, num_workers=1)
        if sys.argv[3] == "module":
            trainer.fit(tiny)
        else:
            trainer.fit(Given(), train_dataloaders=tiny.train_dataloader())
""")


@pytest.mark.slow
@pytest.mark.parametrize("built", ["module", "main"])
def test_lightning_ddp_spawn_with_two_processes_shares_one_cache(tmp_path, image_root, built):
    """Two spawned processes; the loader built by the module's hook in each, or built in the main process and
    passed to ``fit``, which pickles it into each (a loader that did not pickle failed there at once)."""
    script = tmp_path / "fit.py"
    script.write_text(_LIGHTNING_DDP_SPAWN)
    done = subprocess.run([sys.executable, str(script), image_root, str(tmp_path), built], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    n = len(_files(image_root))
    for r in ranks:
        assert (r["type"], r["sampler"]) == ("DataLoader", "DistributedSampler")  # re-created by Lightning
    first = [r["epochs"][0] for r in ranks]
    assert sum(samples for samples, _, _ in first) == n and sum(misses for _, _, misses in first) == n
    for r in ranks:  # epoch 2: the node-wide cache both ranks filled serves each rank's new shard
        samples, hits, misses = r["epochs"][1]
        assert samples == n // 2 and hits == samples and misses == 0


def test_a_loader_pickles_before_and_after_an_epoch_and_its_copy_in_a_new_process_uses_the_nodes_cache(
        tmp_path, image_root):
    """As torch's DataLoader pickles (``mp.spawn``, ``ddp_spawn``, ``torch.save``), so does coordl's, and each of
    its parts: a copy made after an epoch, unpickled in a spawned process, reads every sample from the cache
    that epoch filled."""
    import pickle
    loader = coordl.DataLoader(torchvision.datasets.ImageFolder(image_root, transform=TINY),
                               batch_size=16, shuffle=True, num_workers=1, cache_bytes=dataset_bytes(image_root))
    try:
        for part in (loader.dataset, loader.batch_sampler, loader.collate_fn, loader.sampler):
            pickle.loads(pickle.dumps(part))
        pickle.loads(pickle.dumps(loader)).close()
        assert sum(len(targets) for _, targets in loader) == len(_files(image_root))
        results = FileQueue(tmp_path)
        child = _procs.spawn(_procs.iterate_pickled_loader, pickle.dumps(loader), results)
        epochs = results.get(timeout=_procs.JOIN_TIMEOUT)
        _procs.join_ok(child)
        n = len(_files(image_root))
        assert epochs[-1] == [n, n, 0]  # samples, hits, misses: all from the cache the parent filled
    finally:
        loader.close()
