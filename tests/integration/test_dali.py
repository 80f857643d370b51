"""The DALI backend on the CPU: presets, the epoch plan, the cache, errors, and the plain-DALI baselines."""

import collections
import functools
import gc
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
import wave
import weakref

import numpy as np
import pytest
import torch
import torch.utils.data as tud
import torchvision
from PIL import Image, ImageDraw

import coordl
from coordl._dali import presets as dali_presets
from coordl._dali.pipeline import AHEAD_BATCHES, AHEAD_MISSES
from coordl._dali.presets import IMAGENET_MEAN, IMAGENET_STD
from harness.dali_baseline import file_reader_loader

N_IMAGES = 96  # the image_root fixture


def _files(root: str) -> list[str]:
    return [path for path, _ in torchvision.datasets.ImageFolder(root).imgs]


def _indexed(root: str) -> coordl.FileDataset:
    """The image files, each labelled with its own index, so labels reveal the order."""
    files = _files(root)
    return coordl.FileDataset(files, targets=list(range(len(files))))


def _epochs(loader, n: int) -> list[list[tuple]]:
    return [list(loader) for _ in range(n)]


def test_image_classification_batches_are_normalized_float_nchw(image_root):
    with coordl.DataLoader(torchvision.datasets.ImageFolder(image_root), batch_size=16, shuffle=True,
                           num_workers=2, backend="dali", cache_bytes=0) as loader:
        batches = list(loader)
    assert len(batches) == len(loader) == N_IMAGES // 16
    for images, labels in batches:
        assert images.shape == (16, 3, 224, 224) and images.dtype == torch.float32 and images.device.type == "cpu"
        assert labels.shape == (16,) and labels.dtype == torch.int64
    images = torch.cat([b[0] for b in batches])
    assert -2.2 < images.min() < -1.5 and 2.0 < images.max() < 2.7  # (x/255 - mean) / std range
    assert abs(images.mean()) < 0.5


def test_eval_transform_matches_resize_center_crop_normalize(image_root):
    dataset = _indexed(image_root)
    with coordl.DataLoader(dataset, batch_size=8, backend="dali", cache_bytes=0) as loader:  # no shuffle: eval
        images, labels = next(iter(loader))
    for image, index in zip(images, labels.tolist()):
        with Image.open(dataset.files[index]) as pil:
            pil = pil.convert("RGB")
            scale = 256 / min(pil.size)
            pil = pil.resize((round(pil.width * scale), round(pil.height * scale)), Image.BILINEAR)
            left, top = (pil.width - 224) // 2, (pil.height - 224) // 2
            ref = np.asarray(pil.crop((left, top, left + 224, top + 224)), dtype=np.float32)
        ref = (ref - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
        diff = np.abs(image.permute(1, 2, 0).numpy() - ref)  # JPEG decoders and resize filters differ slightly
        assert diff.mean() < 0.2, f"sample {index} differs from resize+center-crop+normalize by {diff.mean():.3f}"


def test_every_sample_once_per_epoch_in_torchs_order(image_root):
    dataset = _indexed(image_root)
    with coordl.DataLoader(dataset, batch_size=10, shuffle=True, num_workers=2, backend="dali", cache_bytes=0,
                           generator=torch.Generator().manual_seed(5)) as loader:
        orders = [torch.cat([labels for _, labels in epoch]).tolist() for epoch in _epochs(loader, 3)]
    reference = tud.DataLoader(range(len(dataset)), batch_size=10, shuffle=True,
                               generator=torch.Generator().manual_seed(5))
    expected = [torch.cat(list(reference)).tolist() for _ in range(3)]
    assert orders == expected  # the same plan as torch's DataLoader, partial last batch included
    for order in orders:
        assert sorted(order) == list(range(len(dataset)))
    assert len({tuple(o) for o in orders}) == 3


@pytest.mark.parametrize("pipeline", ["image_classification", "user"])
def test_batches_kept_by_the_training_loop_stay_as_they_were_yielded(image_root, pipeline):
    """Outputs wrap DALI's buffers and DALI may read the fed bytes in place: neither may change under
    batches the loop still holds while later batches and epochs run."""
    from coordl._dali.presets import image_classification

    def user(encoded, target, *, device, train):  # a user's pipeline that hands its target straight out
        return image_classification(encoded, target, device=device, train=train)

    with coordl.DataLoader(_indexed(image_root), batch_size=8, shuffle=True, backend="dali", cache_bytes="auto",
                           dali_pipeline=user if pipeline == "user" else pipeline) as loader:
        kept, seen = [], []
        for _ in range(3):
            for images, labels in loader:
                kept.append((images, labels))
                seen.append((images.clone(), labels.clone()))
    assert len(kept) == 3 * math.ceil(N_IMAGES / 8)
    for (images, labels), (images_then, labels_then) in zip(kept, seen):
        assert torch.equal(labels, labels_then) and torch.equal(images, images_then)
    assert sorted(torch.cat([labels for _, labels in kept[:len(kept) // 3]]).tolist()) == list(range(N_IMAGES))


def test_drop_last_and_sharding_by_rank(image_root):
    dataset, seen = _indexed(image_root), []
    for rank in range(2):
        sampler = tud.DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=3)
        sampler.set_epoch(1)
        with coordl.DataLoader(dataset, batch_size=10, sampler=sampler, drop_last=True, backend="dali",
                               cache_bytes=0) as loader:
            batches = list(loader)
        assert [len(labels) for _, labels in batches] == [10] * (N_IMAGES // 2 // 10)
        seen.append(torch.cat([labels for _, labels in batches]).tolist())
    for rank in range(2):
        sampler = tud.DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=3)
        sampler.set_epoch(1)
        assert seen[rank] == list(sampler)[:len(seen[rank])]
    assert not set(seen[0]) & set(seen[1])


def test_augmentation_is_drawn_afresh_each_epoch(image_root):
    dataset = _indexed(image_root)
    with coordl.DataLoader(dataset, batch_size=16, shuffle=True, backend="dali", cache_bytes=0) as loader:
        per_epoch = []
        for epoch in _epochs(loader, 2):
            images, labels = torch.cat([b[0] for b in epoch]), torch.cat([b[1] for b in epoch])
            per_epoch.append(images[labels.argsort()])
    same = [torch.equal(a, b) for a, b in zip(*per_epoch)]
    assert sum(same) <= 2, f"{sum(same)} of {len(same)} samples got the same crop and flip in both epochs"


def test_epoch_two_hits_equal_the_cached_items(image_root, caplog):
    dataset = torchvision.datasets.ImageFolder(image_root)
    half = sum(os.path.getsize(p) for p, _ in dataset.imgs) // 2
    with caplog.at_level(logging.INFO, logger="coordl"), \
            coordl.DataLoader(dataset, batch_size=16, shuffle=True, num_workers=2, backend="dali",
                              cache_bytes=half, cache_name=f"dali-test-{os.getpid()}") as loader:
        _epochs(loader, 3)
        stats = loader.stats()
    cached = stats.cache.items_cached
    assert 0 < cached < N_IMAGES
    first, *later = stats.epochs
    assert (first.hits, first.misses, first.samples) == (0, N_IMAGES, N_IMAGES)
    for epoch in later:
        assert (epoch.hits, epoch.misses, epoch.samples) == (cached, N_IMAGES - cached, N_IMAGES)
        assert epoch.complete and epoch.stall_s > 0
    lines = [r.getMessage() for r in caplog.records if r.name == "coordl" and "epoch=" in r.getMessage()]
    assert len(lines) == 3 and f"hits={cached}" in lines[1] and f"misses={N_IMAGES - cached}" in lines[2]


def test_hits_fed_from_the_cache_in_place_decode_as_the_files_do(image_root):
    """Epoch 2's samples are all hits, fed to DALI as views into the cache's shared memory: the eval
    transform (no randomness) gives what epoch 1 gave from the files, and nothing outlives close()."""
    dataset = _indexed(image_root)
    whole = 2 * sum(os.path.getsize(f) for f in dataset.files)
    with coordl.DataLoader(dataset, batch_size=8, backend="dali", num_workers=2, cache_bytes=whole,
                           cache_name=f"dali-views-{os.getpid()}") as loader:  # no shuffle: eval
        first, second = ([(images.clone(), labels.clone()) for images, labels in loader] for _ in range(2))
        epochs = loader.stats().epochs
    assert (epochs[0].misses, epochs[1].hits) == (N_IMAGES, N_IMAGES)
    assert len(first) == len(second) == N_IMAGES // 8
    for (a, a_labels), (b, b_labels) in zip(first, second):
        assert torch.equal(a_labels, b_labels) and torch.equal(a, b)


def _cached_epochs_labels(image_root, name: str, epochs: int, **options) -> list[list[int]]:
    """Each of ``epochs`` epochs' labels, sorted, from a DALI loader over a cache of the whole dataset."""
    dataset = _indexed(image_root)
    whole = 2 * sum(os.path.getsize(f) for f in dataset.files)
    with coordl.DataLoader(dataset, shuffle=True, backend="dali", cache_bytes=whole,
                           cache_name=f"{name}-{os.getpid()}", **options) as loader:
        return [torch.cat([batch[1] for batch in loader]).sort().values.tolist() for _ in range(epochs)]


def test_the_training_loops_thread_feeds_a_batch_without_checking_its_samples_one_by_one(image_root, monkeypatch):
    """DALI's ``external_source`` runs on the thread that runs the pipeline, the training loop's; handed a list
    it checks and converts each sample there, handed a tensor list it takes it as it is. The fetch threads
    hand it one, so the loop's work per batch does not grow with the batch."""
    from nvidia.dali import external_source
    shapes_read = collections.Counter()
    get_shape = external_source._get_shape

    def counted(data):
        shapes_read[threading.current_thread().name] += 1
        return get_shape(data)

    monkeypatch.setattr(external_source, "_get_shape", counted)
    labels = _cached_epochs_labels(image_root, "dali-one-list", 2, batch_size=16, num_workers=2)
    assert labels == [list(range(N_IMAGES))] * 2
    batches = 2 * N_IMAGES // 16 + AHEAD_BATCHES  # and those fed from the plan drawn ahead
    assert 0 < sum(shapes_read.values()) <= batches  # the label column's shape, once a batch
    assert set(shapes_read) == {threading.main_thread().name}


def test_the_next_fetches_start_once_the_loop_has_its_batch(image_root, monkeypatch):
    """A fetch started while the loop is in DALI's ``run()`` competes with it for the interpreter just when the
    loop waits for its batch: the fetches owed for the batches taken start once the batch is handed over, and in
    ``run()`` only where DALI's next call would find none fetching (at each epoch's start, as DALI fills its
    queue from the two fetched first)."""
    from nvidia.dali.pipeline import Pipeline
    from coordl._dali.pipeline import DaliBackend
    runs, started = [0], collections.Counter()  # run() calls begun; fetches started, by run() call or "after"
    in_run = threading.Event()
    run, fetch_pool = Pipeline.run, DaliBackend._fetch_pool

    def running(self, *args, **kwargs):
        runs[0] += 1
        in_run.set()
        try:
            return run(self, *args, **kwargs)
        finally:
            in_run.clear()

    class Recorded:
        def __init__(self, pool):
            self.pool = pool

        def submit(self, *args):
            started[runs[0] if in_run.is_set() else "after"] += 1
            return self.pool.submit(*args)

    monkeypatch.setattr(Pipeline, "run", running)
    monkeypatch.setattr(DaliBackend, "_fetch_pool", lambda self: Recorded(fetch_pool(self)))
    labels = _cached_epochs_labels(image_root, "dali-top-up", 3, batch_size=8, num_workers=4)
    assert labels == [list(range(N_IMAGES))] * 3
    assert sum(started.values()) == 3 * N_IMAGES // 8 + AHEAD_BATCHES  # and those fetched from the plan drawn ahead
    assert set(started) <= {1, "after"}  # in run() only in the first (later epochs start on the batches fed ahead)


def test_an_abandoned_epoch_does_not_leak_into_the_next(image_root):
    dataset = _indexed(image_root)
    with coordl.DataLoader(dataset, batch_size=8, shuffle=True, num_workers=2, backend="dali",
                           cache_bytes=0) as loader:
        it = iter(loader)
        next(it), next(it)
        order = torch.cat([labels for _, labels in loader]).tolist()
        assert sorted(order) == list(range(len(dataset)))
        assert [e.complete for e in loader.stats().epochs] == [False, True]


def _ordered_epochs(loader, n: int, between=lambda epoch: None) -> list[list[int]]:
    orders = []
    for epoch in range(n):
        between(epoch)
        orders.append(torch.cat([labels for _, labels in loader]).tolist())
    return orders


AHEAD = {  # loader options, and what the training loop does before each epoch
    "generator": (lambda ds: dict(shuffle=True, generator=torch.Generator().manual_seed(5)), lambda e: None),
    "global RNG": (lambda ds: dict(shuffle=True), lambda e: None),
    "set_epoch": (lambda ds: dict(sampler=tud.DistributedSampler(ds, num_replicas=2, rank=1, seed=3)),
                  lambda e: None),
    # a validation DataLoader without a generator draws its base seed from the global RNG
    "validation between epochs": (lambda ds: dict(shuffle=True), lambda e: next(iter(tud.DataLoader(range(4))))),
}


@pytest.mark.parametrize("setting", list(AHEAD))
def test_the_pipeline_runs_on_into_the_next_epochs_plan_drawn_ahead(image_root, setting, caplog):
    """Each epoch after the first starts on batches fed to DALI during the one before, where its plan was drawn
    right: every epoch is still torch's plan, each sample once, counted in its own epoch. A training loop drawing
    from the global RNG between epochs changes the plan: what was fed ahead is dropped, its reads counted, and
    after two such epochs the pipeline stops drawing ahead, saying why and what to pass."""
    dataset, (options, between) = _indexed(image_root), AHEAD[setting]
    sampler_options = options(dataset)
    sampler = sampler_options.get("sampler")
    set_epoch = (lambda e: (between(e), sampler.set_epoch(e))) if sampler is not None else between
    torch.manual_seed(11)
    with caplog.at_level(logging.INFO, logger="coordl"), \
            coordl.DataLoader(dataset, batch_size=10, num_workers=2, backend="dali", cache_bytes="auto",
                              **sampler_options) as loader:
        orders = _ordered_epochs(loader, 4, set_epoch)
        ahead, epochs = loader.epoch_ledger.feed.backend.ahead, loader.stats().epochs
    reference_options = options(range(len(dataset)))
    torch.manual_seed(11)
    reference = tud.DataLoader(range(len(dataset)), batch_size=10, **reference_options)
    sampler = reference_options.get("sampler")
    expected = _ordered_epochs(_Pairs(reference), 4,
                               (lambda e: (between(e), sampler.set_epoch(e))) if sampler is not None else between)
    assert orders == expected
    per_epoch = len(expected[0])
    for order in orders:
        assert len(set(order)) == per_epoch
    assert [e.samples for e in epochs] == [per_epoch] * 4 and all(e.complete for e in epochs)
    dropped_reads = [e.hits + e.misses - e.samples for e in epochs]  # of the batches fetched ahead and dropped
    stopped = "no longer runs on across epochs" in caplog.text
    if setting != "validation between epochs":
        assert ahead == {"taken": 3, "dropped": 0} and dropped_reads == [0] * 4 and not stopped
    else:
        assert ahead == {"taken": 0, "dropped": AHEAD_MISSES} and stopped and "generator=torch.Generator()" in caplog.text
        assert all(10 <= r <= 10 * AHEAD_BATCHES and r % 10 == 0 for r in dropped_reads[1:1 + AHEAD_MISSES])
        assert dropped_reads[0] == 0 and dropped_reads[1 + AHEAD_MISSES:] == [0] * (3 - AHEAD_MISSES)


class _Pairs:
    """A plain DataLoader of indices as (images, labels) batches, labels the indices."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        return ((None, batch) for batch in self.loader)


def test_an_epoch_left_after_its_plan_ahead_was_fed_does_not_leak_into_the_next(image_root):
    dataset = _indexed(image_root)
    with coordl.DataLoader(dataset, batch_size=10, shuffle=True, backend="dali", cache_bytes=0,
                           generator=torch.Generator().manual_seed(2)) as loader:
        it = iter(loader)
        for _ in range(len(loader) - 1):  # all but the last: the next plan was drawn and fed
            next(it)
        assert loader.epoch_ledger.feed.backend._feeder.goes_on
        order = torch.cat([labels for _, labels in loader]).tolist()
        ahead = dict(loader.epoch_ledger.feed.backend.ahead)
        assert [e.complete for e in loader.stats().epochs] == [False, True]
    assert sorted(order) == list(range(len(dataset)))
    assert ahead == {"taken": 0, "dropped": 0}  # the pipeline of the epoch left was dropped whole


def test_a_file_of_the_plan_ahead_that_fails_fails_in_its_own_epoch(fresh_image_root):
    """A file lost after its last read in one epoch, in the first batch of the next: that epoch's plan, fetched
    ahead during this one, fails to fetch there; this epoch ends as it should, and the next one names the file."""
    dataset = _indexed(fresh_image_root)
    with coordl.DataLoader(dataset, batch_size=6, shuffle=True, backend="dali", cache_bytes=0,
                           generator=torch.Generator().manual_seed(4)) as loader:
        list(loader)
        it = iter(loader)
        first = torch.cat([next(it)[1] for _ in range(3)]).tolist()  # fetched: the next plan is not drawn yet
        following = loader.batch_sampler.plan_ahead()[0]
        victim = next(i for i in following if i in first)  # read in this epoch already, not again in it
        os.remove(dataset.files[victim])
        rest = [labels for _, labels in it]
        assert sorted(first + torch.cat(rest).tolist()) == list(range(len(dataset)))
        with pytest.raises(coordl.SampleError, match=f"sample {victim} \\({dataset.files[victim]}"):
            list(loader)
        assert loader.epoch_ledger.feed.backend.ahead == {"taken": 1, "dropped": 1}


def test_an_interruption_while_dropping_the_batches_fed_ahead_leaves_nothing_in_the_next_epoch(image_root,
                                                                                               monkeypatch):
    """Ctrl-C in the epoch's start, while the outputs of a wrong guess are run and dropped: the pipeline is
    dropped, and the next epoch is its plan, not the batch fed ahead and left in DALI."""
    from coordl._dali import pipeline as dali_pipeline
    armed, fetch = {"on": False}, dali_pipeline._fetch_batch
    dataset, generator = _indexed(image_root), torch.Generator()
    reference_generator = torch.Generator()
    reference = tud.DataLoader(range(len(dataset)), batch_size=10, shuffle=True, generator=reference_generator)
    # the interrupted pass's first batch: a fetch of the guess ahead may still start after arming, and is not it
    first = next(iter(tud.DataLoader(range(len(dataset)), batch_size=10, shuffle=True,
                                     generator=torch.Generator().manual_seed(2)))).tolist()

    def interrupted(cached, read_target, indices):
        if armed["on"] and list(indices) == first:
            armed["on"] = False
            raise KeyboardInterrupt
        return fetch(cached, read_target, indices)

    monkeypatch.setattr(dali_pipeline, "_fetch_batch", interrupted)
    with coordl.DataLoader(dataset, batch_size=10, shuffle=True, backend="dali", cache_bytes=0,
                           generator=generator) as loader:
        for g in (generator, reference_generator):
            g.manual_seed(1)
        list(loader), list(reference)
        for g in (generator, reference_generator):
            g.manual_seed(2)  # the plan drawn ahead is wrong
        armed["on"] = True
        with pytest.raises(KeyboardInterrupt):
            next(iter(loader))
        list(reference)  # the interrupted pass drew its whole plan: the pipeline is fed ahead of the loop
        order = torch.cat([labels for _, labels in loader]).tolist()
    assert order == torch.cat(list(reference)).tolist()


@pytest.mark.parametrize("relabel", ["in place", "replaced"])
def test_samples_relabelled_between_epochs_come_with_their_new_labels(image_root, relabel):
    dataset = _indexed(image_root)
    with coordl.DataLoader(dataset, batch_size=10, shuffle=True, backend="dali", cache_bytes=0,
                           generator=torch.Generator().manual_seed(3)) as loader:
        list(loader)
        assert loader.epoch_ledger.feed.backend._feeder.goes_on  # the next epoch's first labels were read
        if relabel == "in place":
            dataset.targets[:] = [1000 + i for i in range(len(dataset))]
        else:
            dataset.targets = [1000 + i for i in range(len(dataset))]
        labels = torch.cat([labels for _, labels in loader]).tolist()
        assert loader.epoch_ledger.feed.backend.ahead == {"taken": 0, "dropped": 1}
    assert sorted(labels) == [1000 + i for i in range(len(dataset))]


def _fetch_threads(before=frozenset()) -> set:
    return {t for t in threading.enumerate() if t.name.startswith("coordl-fetch")} - before


def test_the_fetch_threads_are_kept_across_epochs_and_stopped_at_close(image_root):
    """Started once, not at each epoch's start (where starting them held the first batch back); a forked child,
    which has none of its parent's threads, fetches on threads of its own; closing the loader stops them."""
    before = _fetch_threads()
    dataset = _indexed(image_root)
    with coordl.DataLoader(dataset, batch_size=8, shuffle=True, num_workers=2, backend="dali") as loader:
        seen = []
        for _ in range(3):
            assert sorted(torch.cat([labels for _, labels in loader]).tolist()) == list(range(len(dataset)))
            seen.append(_fetch_threads(before))
        assert 1 <= len(seen[0]) <= 2 and seen[0] == seen[1] == seen[2]
        pool = loader.epoch_ledger.feed.backend._fetch_pool
        assert _exit_status_of_fork(lambda: 0 if pool().submit(sum, [1, 2]).result(timeout=20) == 3 else 1) == 0
    assert not _fetch_threads(before)


class _Collects(tud.Dataset):
    """Collects garbage in torch's worker, as any allocation there may; says whether ``pipeline`` (a weak
    reference) was still there to be collected."""

    def __init__(self, pipeline):
        self.pipeline = pipeline

    def __len__(self):
        return 2

    def __getitem__(self, i):
        alive = self.pipeline() is not None
        gc.collect()
        return int(alive)


def _exit_status_of_fork(child, timeout_s: float = 60) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = child()
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child hung")


def _dropped_mid_epoch(dataset):
    """A weak reference to the DALI pipeline of a loader dropped half-way through an epoch, left as
    garbage in a reference cycle (collect it only with the collector off)."""
    loader = coordl.DataLoader(dataset, batch_size=8, backend="dali", cache_bytes=0)
    it = iter(loader)
    next(it)  # DALI's threads are busy
    pipeline = weakref.ref(loader.epoch_ledger.feed.backend._pipe)
    cycle = [loader, it]
    cycle.append(cycle)
    return pipeline


def test_a_process_forked_after_dali_epochs_can_collect_their_pipelines(image_root):
    """A child forked (by hand, and as torch's worker) while a dropped pipeline is garbage in the parent
    finds it there and collects it, without crashing or hanging; the parent's pipelines are untouched.
    (The collector stays off in the parent until then, so the garbage survives to the fork.)"""
    dataset = torchvision.datasets.ImageFolder(image_root)
    collecting = gc.isenabled()
    gc.disable()
    try:
        with coordl.DataLoader(dataset, batch_size=8, backend="dali", cache_bytes=0) as live:
            first = list(live)
            pipeline = _dropped_mid_epoch(dataset)

            def child():  # 0: collected it without crashing or hanging; 3: there was nothing to collect
                if pipeline() is None:
                    return 3
                gc.collect()
                return 0
            assert _exit_status_of_fork(child) == 0
            assert pipeline() is not None  # ... and the parent still holds its own garbage
            workers = tud.DataLoader(_Collects(pipeline), batch_size=2, num_workers=1, multiprocessing_context="fork")
            assert [b.tolist() for b in workers] == [[1, 0]]  # the worker found it, collected it, and it was gone
            gc.collect()  # in this process the pipelines shut down as ever
            assert pipeline() is None
            assert len(list(live)) == len(first)  # the parent's pipeline untouched by its children
    finally:
        gc.enable() if collecting else gc.disable()


def test_collection_is_paused_across_forks_and_resumed_once_the_last_is_through():
    """The at-fork handlers' state: two threads forking at once share one pause; the collector comes back
    (if it was on) when both are through, and in a child at once."""
    from coordl._dali import pipeline as dali_pipeline
    collecting = gc.isenabled()
    gc.enable()
    try:
        dali_pipeline._pause_gc_for_fork()
        dali_pipeline._pause_gc_for_fork()  # a second thread forks meanwhile
        assert not gc.isenabled()
        dali_pipeline._resume_gc_in_parent()
        assert not gc.isenabled()  # the other fork is not through
        dali_pipeline._resume_gc_in_parent()
        assert gc.isenabled()
        gc.disable()  # off before the fork: stays off after it
        dali_pipeline._pause_gc_for_fork()
        dali_pipeline._resume_gc_in_parent()
        assert not gc.isenabled()
        gc.enable()
        dali_pipeline._pause_gc_for_fork()
        dali_pipeline._disown_pipelines_in_child()  # in a child: on again, and the count starts over
        assert gc.isenabled() and dali_pipeline._fork_gc["depth"] == 0
    finally:
        gc.enable() if collecting else gc.disable()


def _write_coco(root: str, n: int) -> str:
    """Black images with one white rectangle each, and a COCO annotation file giving that rectangle."""
    rng = np.random.default_rng(0)
    images, annotations = [], []
    for i in range(n):
        w, h = int(rng.integers(200, 320)), int(rng.integers(200, 320))
        x0, y0 = int(rng.integers(10, w // 2)), int(rng.integers(10, h // 2))
        bw, bh = int(rng.integers(w // 4, w // 2 - 5)), int(rng.integers(h // 4, h // 2 - 5))
        image = Image.new("RGB", (w, h))
        ImageDraw.Draw(image).rectangle([x0, y0, x0 + bw - 1, y0 + bh - 1], fill=(255, 255, 255))
        image.save(os.path.join(root, f"{i}.png"))
        images.append({"id": i, "file_name": f"{i}.png", "width": w, "height": h})
        annotations.append({"id": i, "image_id": i, "bbox": [x0, y0, bw, bh], "category_id": 3 + i % 2,
                            "iscrowd": 0})
    path = os.path.join(root, "annotations.json")
    with open(path, "w") as f:
        json.dump({"images": images, "annotations": annotations}, f)
    return path


def test_detection_boxes_follow_the_crop_and_flip(tmp_path):
    dataset = coordl.CocoDetection(str(tmp_path), _write_coco(str(tmp_path), 24))
    with coordl.DataLoader(dataset, batch_size=8, shuffle=True, backend="dali", dali_pipeline="object_detection",
                           cache_bytes=0) as loader:
        epochs = _epochs(loader, 3)
    checked = 0
    for images, boxes, labels in (b for epoch in epochs for b in epoch):
        assert images.shape[1:] == (3, 300, 300) and images.dtype == torch.float32
        for image, box, label in zip(images, boxes, labels):
            assert box.dtype == torch.float32 and label.dtype == torch.int64 and len(box) == len(label)
            if not len(box):
                continue  # the crop left the box out
            assert set(label.tolist()) <= {3, 4}
            x0, y0, x1, y1 = (box[0] * 300).round().int().tolist()
            if min(x1 - x0, y1 - y0) < 12:
                continue
            brightness = image.mean(dim=0)  # bright inside the white box, dark outside it
            inside = brightness[y0 + 3:y1 - 3, x0 + 3:x1 - 3].mean()
            outside = torch.cat([brightness[:, :max(x0 - 3, 0)].flatten(), brightness[:, x1 + 3:].flatten(),
                                 brightness[:max(y0 - 3, 0), :].flatten(), brightness[y1 + 3:, :].flatten()])
            assert inside > 0.5, f"box {box[0].tolist()} does not cover the white rectangle"
            if len(outside):
                assert outside.mean() < inside - 1.5
            checked += 1
    assert checked >= 30


def _write_wav(path: str, seconds: float, rate: int = 16000, freq: float = 1000.0) -> None:
    t = np.arange(int(seconds * rate)) / rate
    tone = (0.5 * np.sin(2 * math.pi * freq * t) * 32767).astype(np.int16)
    with wave.open(path, "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.stack([tone, tone], axis=1).tobytes())


def test_audio_is_mono_8khz_and_cropped_or_padded_to_one_second(tmp_path):
    files = []
    for i, seconds in enumerate([0.5, 2.0, 1.0, 1.5]):
        files.append(str(tmp_path / f"{i}.wav"))
        _write_wav(files[-1], seconds)
    dataset = coordl.FileDataset(files, targets=[0, 1, 0, 1], decode="bytes")
    with coordl.DataLoader(dataset, batch_size=4, backend="dali", dali_pipeline="audio_classification",
                           cache_bytes=0) as loader:
        (audio, labels), = list(loader)
    assert audio.shape == (4, 8000) and audio.dtype == torch.float32 and labels.tolist() == [0, 1, 0, 1]
    short, long = audio[0], audio[1]
    assert short[4100:].abs().max() == 0 and short[:3900].abs().max() > 0.3  # 0.5 s of tone, then padding
    crossings = int((np.diff(np.sign(long[100:7900].numpy())) != 0).sum())
    assert abs(crossings - 2 * 1000 * 7800 / 8000) < 40  # a 1 kHz tone at 8000 samples/s


def test_a_corrupt_image_is_named(fresh_image_root):
    dataset = torchvision.datasets.ImageFolder(fresh_image_root)
    victim = dataset.imgs[17][0]
    with open(victim, "r+b") as f:
        f.seek(400)
        f.write(b"\x00" * 3000)
        f.truncate(3400)
    with coordl.DataLoader(dataset, batch_size=8, backend="dali", cache_bytes=0) as loader:
        with pytest.raises(coordl.SampleError, match=f"sample 17 \\({victim}"):
            list(loader)
        os.remove(victim)
        with pytest.raises(coordl.SampleError, match=f"sample 17 \\({victim}"):
            list(loader)  # a missing file too, and the loader is usable after a failed epoch


def test_auto_picks_dali_when_it_can_and_transforms_are_said_to_be_replaced(image_root):
    tf = torchvision.transforms.ToTensor()
    with pytest.warns(UserWarning, match="replaces the dataset's own transform"):
        loader = coordl.DataLoader(torchvision.datasets.ImageFolder(image_root, transform=tf), batch_size=8,
                                   backend="auto", cache_bytes=0)
    images, _ = next(iter(loader))
    assert images.shape == (8, 3, 224, 224)
    loader.close()

    plain = coordl.DataLoader(list(range(10)), batch_size=4, backend="auto", cache_bytes=0)
    assert plain.epoch_ledger.feed is None and [b.tolist() for b in plain][0] == [0, 1, 2, 3]


def test_bad_backend_settings_are_refused(image_root):
    dataset = torchvision.datasets.ImageFolder(image_root)
    with pytest.raises(ValueError, match="backend should be"):
        coordl.DataLoader(dataset, backend="dal")
    with pytest.raises(ValueError, match="dali_pipeline should be one of"):
        coordl.DataLoader(dataset, backend="dali", dali_pipeline="segmentation", cache_bytes=0)
    with pytest.raises(TypeError, match="cannot load list"):
        coordl.DataLoader(list(range(10)), backend="dali")


@pytest.mark.slow
def test_missing_dali_gives_the_install_command(image_root):
    script = f"""
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "nvidia.dali" or name.startswith("nvidia.dali."):
            raise ImportError("blocked")
sys.meta_path.insert(0, Block())
import torchvision, coordl
try:
    coordl.DataLoader(torchvision.datasets.ImageFolder({image_root!r}), backend="dali")
except ImportError as e:
    print("ERROR:", e)
loader = coordl.DataLoader(torchvision.datasets.ImageFolder({image_root!r}), backend="auto", cache_bytes=0)
print("AUTO:", loader.epoch_ledger.feed is None)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "ERROR: backend='dali' needs NVIDIA DALI" in done.stdout and "pip install" in done.stdout, done.stderr
    assert "AUTO: True" in done.stdout


@pytest.mark.parametrize("order", ["seq", "shuffle"])
def test_plain_dali_baselines_read_every_file_each_epoch(image_root, order):
    loader = file_reader_loader(image_root, order=order, batch_size=16, num_threads=2)
    expected = torch.bincount(torch.tensor([c for _, c in torchvision.datasets.ImageFolder(image_root).imgs]))
    for _ in range(2):
        batches = list(loader)
        assert len(batches) == len(loader)
        labels = torch.cat([b[1] for b in batches])
        assert batches[0][0].shape == (16, 3, 224, 224) and labels.dtype == torch.int64
        assert torch.equal(torch.bincount(labels.flatten()), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU decoding path needs a CUDA GPU")
@pytest.mark.parametrize("preset, hw_decoder_load", [("image_classification", None), ("image_classification", 1.0),
                                                     ("image_classification", 0.0), ("object_detection", None)])
def test_gpu_decoding_yields_cuda_tensors_like_the_cpu_path(image_root, tmp_path, preset, hw_decoder_load):
    """Also with every JPEG given to the GPU's hardware decoder (``hw_decoder_load=1.0``) and none (0.0)."""
    dataset = torchvision.datasets.ImageFolder(image_root) if preset == "image_classification" else \
        coordl.CocoDetection(str(tmp_path), _write_coco(str(tmp_path), 16))
    pipeline = preset if hw_decoder_load is None else \
        functools.partial(dali_presets.image_classification, hw_decoder_load=hw_decoder_load)
    outputs = {}
    for device in ("cpu", "gpu"):
        # eval transforms: no randomness to compare; pinned memory asked for, as training scripts do
        with coordl.DataLoader(dataset, batch_size=8, backend="dali", dali_pipeline=pipeline, dali_device=device,
                               cache_bytes=0, pin_memory=True) as loader:
            outputs[device] = list(loader)
    for cpu_batch, gpu_batch in zip(outputs["cpu"], outputs["gpu"]):
        images = gpu_batch[0]
        assert images.device.type == "cuda" and images.shape == cpu_batch[0].shape
        assert (images.cpu() - cpu_batch[0]).abs().mean() < 0.1  # GPU and CPU JPEG decoders differ slightly
        assert torch.equal(cpu_batch[-1].cpu() if torch.is_tensor(cpu_batch[-1]) else cpu_batch[-1][0],
                           gpu_batch[-1].cpu() if torch.is_tensor(gpu_batch[-1]) else gpu_batch[-1][0].cpu())
