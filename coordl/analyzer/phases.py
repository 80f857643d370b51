"""What a training script's ``coordl.DataLoader`` does when ``coordl analyze`` runs it in a phase.

The runner (``runner.py``) starts the script with ``COORDL_ANALYZE_PHASE`` set; the first loader the
script iterates then measures, writes its result (JSON) to ``COORDL_ANALYZE_RESULT`` and ends the
script (``SystemExit(0)``, so every loader, worker and cache is released as at any exit):

* ``ingestion``: the loader hands the training loop one real batch over and over, so the loop runs at
  its own speed with no fetch or prep at all: ``G``, samples/s, over ``COORDL_ANALYZE_ITERS`` batches
  after ``COORDL_ANALYZE_WARMUP``. With workers, the loader's workers are replaced by as many that send
  copies of that batch, so the loop still pays for taking each batch from a worker.
* ``rates``: before the first batch, with the training loop idle: ``S`` (cold random reads of a sample
  of the dataset's raw bytes, no prep, on as many threads as cores (from an object store, on as many as the
  loader keeps GETs in flight: its workers' misses at once and its look-ahead's), in passes over it for at least
  :data:`STORAGE_MIN_S`; each file is dropped from the page cache before each pass, and the process's
  block-device reads say whether the reads really were cold), ``L``
  (what a worker waits per miss while the storage is not saturated: once the storage has rested
  :data:`STORAGE_REST_S` from S's reads, cold reads in bursts of a batch's misses at the configured cache,
  ``L_burst``, each burst's read back to back as a worker fetches its batch's misses before preparing
  it, the bursts paced at half of ``S``; a read that follows another is faster than one after a pause), ``C``
  (the items the cache took, through its hit path a batch at a time, as the loader fetches them; with no
  cache, a copy of the bytes in memory, as the paper approximates it; in passes for at least
  :data:`HIT_MIN_S` after a first), and ``P`` (the items
  the cache took, or where it took too few the subset's bytes held in memory, decoded and transformed
  by the loader's workers with nothing else running, over at least 2 passes and 5 s after a first that
  starts the workers; and the CPU seconds per sample prep takes, ``prep_cpu_s``: the workers', or this process's). With
  ``backend='dali'``, P is the loader's DALI pipeline (a second one with the same settings) preparing
  those items, and the result says how many threads fetch ahead of it (``fetch_threads``). In a job over
  several servers with partitioned caching, ``R`` too (after C, before P): the servers' caches, each holding
  its ranks' parts, are mapped as at an epoch start, and each rank fetches from the next server's cache what
  that server's rank of the same local rank put there, a batch per request on as many threads as cores.
  With a disk tier (``cache_dir=``), S and L are storage's own (read past the tier, which writes what they
  read), then ``K`` (the subset from the tier's disk, as a worker's misses read it, on as many threads as
  cores, for at least :data:`STORAGE_MIN_S`), ``L_disk`` (one reader's wait for one item from it) and
  ``disk_fraction`` (what its quota, or the file system's room, lets it hold of the dataset), each sample
  taking ``disk_item_bytes`` there (its 4 KiB-aligned item, as the tier packs it).
  Then, where
  coordl.DataLoader's own iterator runs (not an hp_group), ``Q``: the training loop's samples/s over the
  timed window on batches prepared from those items as the loader prepares its own (nothing fetched from
  storage, without end, each pass in a new order): by as many torch workers, so the step and prep share
  the cores as in training; or by a twin of its DALI pipeline, so the step and DALI share the training
  process and, decoding there, the GPU. The window is lengthened to :data:`PREP_MIN_S`, as P's
  (``Q_iters`` batches over ``Q_s``).
* ``run``: the script as configured: its samples/s over the same window, and the window's cache hit
  fraction.

A timed window also says the training process's CPU seconds per sample over it (``loop_cpu_s``, all its
threads): in the ingestion phase, what the step and taking its batch cost the cores that prep shares.
Where the script runs its step on a GPU, both edges of the window wait for the work queued there
(``torch.cuda.synchronize``): an asynchronous step counts when it is done, not when it is queued.

A framework that iterates a torch DataLoader built from the coordl loader's parts (Accelerate and others:
its ``dataset``, ``batch_sampler`` and ``collate_fn``) is measured through those parts
(:func:`observe_pass`, called by the batch sampler at each ``iter()``): the rates phase runs at the first
``iter()``, before torch starts workers; a timed window counts the batches torch draws from the batch
sampler, past the ``workers x prefetch_factor`` it draws before the loop has its first; and in the
ingestion phase the dataset proxy hands each process's first batch out again (:class:`FirstBatches`:
nothing fetched or prepared; torch still collates it), and passes after the first draw plain batches, so
no epoch (nor DALI pipeline) starts again. A worker that a later pass starts loads its first batch
afresh. The settings the phases use are the coordl loader's, as built (kept with its ledger: ``_Observer``).

Each rank of a torchrun job measures at once (so they share storage, cache and cores as in training; each
rank's S, L, C and P over its own part of a common random subset, its part by its rank on every server)
and writes its own result, ``COORDL_ANALYZE_RESULT`` + ``.rank<RANK>``; over several servers, each server's
``coordl analyze`` runs its torchrun node and reads its own ranks' results. So does each member of an
hp_group (``.rank<slot>``, its slot in the group): in the rates phase it measures its part with its
share's workers (or a twin of its DALI pipeline) over an unfed view of the dataset, and in the ingestion
phase it leaves the group once its first batch is in (the copies then come from as many workers as its
share's loader has).
"""

import atexit
import concurrent.futures
import contextlib
import copy
import dataclasses
import itertools
import json
import math
import os
import random
import time

import torch

from coordl._core import hooks, settings
from coordl._core.settings import ANALYZE_TIME_SCALE_ENV
from coordl._core.sysinfo import cpu_seconds
from coordl._disk.folder import room_for
from coordl._disk.format import packed_bytes
from coordl._fetch.cached_dataset import CachedDataset, SampleCounters
from coordl._fetch.concurrent_misses import reads_concurrently
from coordl._peer.topology import EXCHANGE_ENV
from coordl.analyzer.phase_env import CLAIMED, ITERS_ENV, PHASE_ENV, PHASES, RESULT_ENV, WARMUP_ENV  # noqa: F401

PREP_MIN_BATCHES = 4
"""Batches' worth of cached samples P is measured over through the cache; with fewer, from memory."""
PREP_MIN_S = 5.0
"""The least time P and Q are measured over."""
LATENCY_READS = 128
"""Cold reads ``L`` is the mean of (at most; the subset's first, in whole bursts)."""
STORAGE_MIN_S = 3.0
"""The least time S is measured over (passes over the subset, each cold)."""
HIT_MIN_S = 1.0
"""The least time C is measured over (passes over the items the cache took)."""
STORAGE_REST_S = 1.0
"""Idle time between S's saturating reads and L's (a throttled or queueing device catches up)."""
SPREAD_PARTS = 4
"""Equal parts of a timed window whose rates say how steady it ran (``spread``: the fastest part's rate over
the slowest's)."""
RATES_EPOCH = 2
"""The epoch whose map of the caches the rates phase takes (the first that has one): the phase ends before
the loader starts an epoch of its own."""
_measured = []  # the window of the loader this process's phase measures (the first one iterated)
_member = []  # (index, members) of this process among the hp_group members that measure together
_own_pass = []  # set while coordl.DataLoader's own iterator starts a pass (observe_pass leaves it alone)


@dataclasses.dataclass(frozen=True)
class BuiltWith:
    """The settings a coordl loader was built with, which a phase measures a torch DataLoader that a framework
    built from its parts with (kept with the loader's ledger, ``EpochLedger.observed["built_with"]``)."""

    batch_size: int | None
    backend: str
    num_workers: int
    collate_fn: object
    worker_init_fn: object
    multiprocessing_context: object
    pin_memory: bool
    prefetch_factor: int | None
    hp_group: str | None

    @classmethod
    def of(cls, loader) -> "BuiltWith":
        return cls(**{f.name: getattr(loader, f.name) for f in dataclasses.fields(cls)})


def least_s(seconds: float) -> float:
    """``seconds``, one of the least measuring times or rests here, scaled by ``COORDL_ANALYZE_TIME_SCALE``."""
    given = settings.get(ANALYZE_TIME_SCALE_ENV, "1")
    try:
        scale = float(given)
    except ValueError:
        scale = math.nan
    if not 0 < scale < math.inf:
        raise ValueError(f"{ANALYZE_TIME_SCALE_ENV} should be a positive number (1 measures for the full times), "
                         f"but got {given!r}")
    return seconds * scale


def current() -> str | None:
    """This process's phase, or None outside ``coordl analyze``."""
    phase = settings.get(PHASE_ENV)
    if phase is not None and phase not in PHASES:
        raise ValueError(f"{PHASE_ENV} should be one of {PHASES}, but got {phase!r}")
    return phase


def _world() -> int:
    return int(settings.get("WORLD_SIZE", "1"))


def _local_world() -> int:
    return int(settings.get("LOCAL_WORLD_SIZE", str(_world())))


def result_path() -> str:
    """Where this process writes its phase's result: ``COORDL_ANALYZE_RESULT``, with ``.rank<RANK>`` for a
    rank of a torchrun job, ``.rank<slot>`` for a member of an hp_group."""
    if _member:
        return settings.get(RESULT_ENV) + f".rank{_member[0][0]}"
    return settings.get(RESULT_ENV) + (f".rank{settings.get('RANK')}" if _world() > 1 else "")


def _sharers() -> int:
    """How many processes measure at once on this server: the ranks of a torchrun job, or the members of an
    hp_group."""
    if _member:
        return _member[0][1]
    return _local_world()


def _part() -> tuple[int, int]:
    """(this process's part, how many parts) of the rates phase's subset: its rank among the job's ranks on
    every server, or its slot among the hp_group's members."""
    if _member:
        return _member[0]
    return int(settings.get("RANK", "0")), _world()


def _finish(result: dict) -> None:
    """Write the phase's result and end the script."""
    _write(result)
    raise SystemExit(0)


def _write(result: dict) -> None:
    path = result_path()
    with open(path + ".part", "w") as f:
        json.dump({**result, "local_world_size": _sharers()}, f)
    os.replace(path + ".part", path)


def observe(loader, start):
    """The iterator the script gets from ``iter(loader)`` in a phase (``start()`` makes the loader's own): the
    loader's own unless it is the one measured."""
    if _measured and _measured[0].ledger is not loader.epoch_ledger:
        return _own(start)
    window = _measured[0] if _measured else _claim(loader)
    if window.phase == "ingestion" and window.first is not None:  # a later pass: the same batch, nothing loads
        return _Timed(window, None)
    if window.phase == "rates":  # Q: every pass goes on with the same prepared batches
        return _Timed(window, window.prepared)
    return _Timed(window, _own(start))


def observe_pass(sampler, start):
    """The pass torch's iterator draws from ``sampler`` (a coordl batch sampler, at ``iter()``; ``start()``
    makes its own) in a phase. Left as it is under coordl.DataLoader's own iterator (:func:`observe`) and for
    a loader not measured; else the window counts the batches drawn (see the module's docstring)."""
    if _own_pass or (_measured and _measured[0].ledger is not sampler.epochs):
        return start()
    window = _measured[0] if _measured else _claim(_Parts(sampler))
    if window.phase == "ingestion":
        if window.taken:  # a later pass: no epoch, no feed, nothing loads
            return _Drawn(window, sampler.plain_batches())
        if sampler.epochs.dataset.batch_hook is None:  # set before torch starts (or forks) its workers
            sampler.epochs.dataset.batch_hook = FirstBatches()
    return _Drawn(window, start())


class _Observer:
    """The phases as the data path's observer (``coordl._core.hooks``): outside a phase run, every event is
    the plain call."""

    def loader_built(self, loader) -> None:
        loader.epoch_ledger.observed["built_with"] = BuiltWith.of(loader)

    def epoch(self, loader, start):
        return start() if current() is None else observe(loader, start)

    def epoch_pass(self, sampler, start):
        return start() if current() is None else observe_pass(sampler, start)


OBSERVER = _Observer()
"""What ``COORDL_OBSERVER`` names in a phase run (``runner``); registered also as this module is imported."""
hooks.register(OBSERVER)


def _own(start):
    """``start()`` of coordl.DataLoader's own iterator, the batch sampler's ``iter()`` in it left alone."""
    _own_pass.append(True)
    try:
        return start()
    finally:
        _own_pass.pop()


def _claim(loader) -> "_Window":
    """Measure ``loader`` in this process's phase (the rates phase measures its rates here, before any of the
    loader's workers starts, and ends here unless it goes on to measure ``Q``)."""
    _check_measurable(loader)
    window = _Window(loader, current())
    _measured.append(window)
    group = _group_feed(loader.epoch_ledger)
    if group is not None:  # every member measures at once, each its own result (see the module's docstring)
        _member.append((group.group.slot, group.group.expected_members))
    open(result_path() + CLAIMED, "w").close()
    if window.phase == "rates":
        window.rates, prepared = measure_rates(loader, (window.warmup + window.iters) * window.batch_size)
        if prepared is None or isinstance(loader, _Parts) or not window.rates["workers"]:
            _finish(window.rates)
        window.prepared = _prepared(loader, prepared, window.batch_size)
    return window


class _Parts:
    """A torch DataLoader built from a coordl loader's parts, as a phase sees it: the dataset proxy and the
    ledger its batch sampler carries, with the settings the coordl loader was built with."""

    def __init__(self, sampler):
        ledger = sampler.epochs
        self.__dict__.update(vars(ledger.observed["built_with"]))
        self.dataset, self.epoch_ledger, self.batch_sampler = ledger.dataset, ledger, sampler

    def stats(self):
        return self.epoch_ledger.stats()


def _check_measurable(loader) -> None:
    """Refuse, in the first phase, a loader whose rates phase could not be measured."""
    dataset = loader.dataset
    if isinstance(loader, _Parts) and _group_feed(loader.epoch_ledger) is not None:
        raise RuntimeError("coordl analyze measures an hp_group job through its coordl.DataLoader, not through a "
                           "torch DataLoader built from its parts")
    if not isinstance(dataset, CachedDataset) or dataset.source is None:
        raise RuntimeError(f"coordl analyze measures loaders that fetch raw bytes and prepare them on torch's "
                           f"workers or in DALI, over a dataset coordl can read raw (an ImageFolder, "
                           f"DatasetFolder, their Subsets, ...); this one loads "
                           f"{type(getattr(dataset, 'dataset', dataset)).__name__}")


class _Window:
    """The batches the training loop has taken from the measured loader (across its epochs), and the time
    and cache counts when the timed ``iters`` began, after ``warmup``."""

    def __init__(self, loader, phase: str):
        self.loader, self.ledger, self.phase = loader, loader.epoch_ledger, phase
        self.batch_size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
        if not self.batch_size:
            raise RuntimeError("coordl analyze needs the measured loader's batch size (batch_size=, or a batch "
                               "sampler with a batch_size attribute)")
        self.warmup, self.iters = int(settings.get(WARMUP_ENV, "10")), int(settings.get(ITERS_ENV, "100"))
        self.taken, self.started, self.hits_before, self.first, self.handover = 0, None, None, None, None
        self.cpu_started, self.rates, self.prepared = None, None, None  # the rates phase's, and Q's batches
        self.marks: list[float] = []  # the window's start, then the clock at each batch delivered in it
        self.returned, self.step_s = None, 0.0  # when the loop got its last batch; its time outside the loader
        self.timers_before = None  # the run's: the loader's waits and timers when the clock started
        self.extended = False  # Q's window has been lengthened (:meth:`_lengthen`) and is written at exit
        # batches torch draws before the loop has its first (counted only where the draws are: _Drawn)
        self.ahead = loader.num_workers * loader.prefetch_factor if isinstance(loader, _Parts) and \
            loader.num_workers else 0

    def count(self) -> None:
        """Before the next batch: end the phase after the window's last; start its clock after the warm-up.
        At both edges the GPU's queued work is waited for, so the window holds its batches' steps and no
        earlier one's."""
        if self.started is not None and self.returned is not None:  # the loop's step on the batch it got
            self.step_s += time.perf_counter() - self.returned
            self.returned = None  # at an epoch's end the loop asks again without a batch in between
        if self.taken == self.ahead + self.warmup + self.iters:
            _drain_gpu()
            if self.phase == "rates":
                self._lengthen()
            if self.taken == self.ahead + self.warmup + self.iters:
                atexit.unregister(self._write_at_exit)
                result = self.result()
                self._close_prepared()
                _finish(result)
        if self.taken == self.ahead + self.warmup:
            _drain_gpu()
            self.started, self.hits_before = time.perf_counter(), _hits(self.loader)
            self.timers_before = _timers(self.loader) if self.phase == "run" else None
            self.cpu_started = time.process_time()  # the training process's, all its threads
            self.marks, self.step_s = [self.started], 0.0

    def delivered(self, timed: bool) -> None:
        """A batch went to the loop (``timed``: through coordl's iterator, so the time until the loop asks for
        the next is its step; a batch torch draws from the batch sampler only marks the clock)."""
        if self.started is not None:
            now = time.perf_counter()
            self.marks.append(now)
            if timed:
                self.returned = now

    def _lengthen(self) -> None:
        """Q's window, each time its ``iters`` are in: shorter than :data:`PREP_MIN_S` (as P's is not), it goes
        on for as many more batches as that takes at its pace so far (again, should the pace pick up); where
        the ranks step together, for as many as the rank that needs most (every rank asks at the same batch).
        Should the script end first, the batches it had are written at exit."""
        elapsed = time.perf_counter() - self.started
        least = least_s(PREP_MIN_S)
        more = _most_of_ranks(math.ceil(self.iters * (least / elapsed - 1)) if elapsed < least else 0)
        if more:
            self.iters += more
            if not self.extended:
                atexit.register(self._write_at_exit)
            self.extended = True

    def _write_at_exit(self) -> None:
        """Q over the batches the loop had, where the script ends in the lengthened window."""
        _drain_gpu()
        _write(self.result())
        self._close_prepared()

    def _close_prepared(self) -> None:
        """Drop Q's DALI pipeline (torch's workers for Q go with their iterator)."""
        close = getattr(self.prepared, "close", None)
        if close is not None:
            close()

    def result(self) -> dict:
        """The window's result, over the batches the loop has taken since its clock started (``iters`` when it
        ends at its last; fewer when the script ends in a lengthened window)."""
        elapsed, cpu_s = time.perf_counter() - self.started, time.process_time() - self.cpu_started
        iters = self.taken - self.ahead - self.warmup
        samples = iters * self.batch_size
        out = {"phase": self.phase, "samples_per_s": samples / elapsed, "loop_cpu_s": cpu_s / samples,
               "iters": iters, "batch_size": self.batch_size}
        out["parts_samples_per_s"] = window_parts(self.marks, self.batch_size)
        out["spread"] = spread(out["parts_samples_per_s"])
        if self.phase == "run":
            hits, peer_hits, fetched = (now - before for now, before in zip(_hits(self.loader), self.hits_before))
            out["hit_fraction"], out["peer_hit_fraction"] = hits / max(1, fetched), peer_hits / max(1, fetched)
            out["step_samples_per_s"] = samples / self.step_s if self.step_s > 0 else None
            out["step_on_gpu"] = torch.cuda.is_initialized()  # then the step's clock sees its launch, not its work
            out["waits_s"] = {k: None if now is None or before is None else (now - before) / samples
                              for (k, now), before in zip(_timers(self.loader).items(), self.timers_before.values())}
        if self.phase == "rates":  # the loop on prepared batches
            return {**self.rates, "Q": out["samples_per_s"], "Q_iters": iters, "Q_s": elapsed,
                    "Q_spread": out["spread"]}
        return out


def window_parts(marks: list[float], batch_size: int, parts: int = SPREAD_PARTS) -> list[float] | None:
    """Samples/s over each of ``parts`` nearly equal runs of batches between the clock ``marks`` (the
    window's start, then one per batch delivered); None with fewer batches than parts."""
    batches = len(marks) - 1
    if batches < parts:
        return None
    cuts = [round(k * batches / parts) for k in range(parts + 1)]
    return [(b - a) * batch_size / max(marks[b] - marks[a], 1e-9) for a, b in zip(cuts, cuts[1:])]


def spread(parts: list[float] | None) -> float | None:
    """The fastest part's rate over the slowest's (1: steady), None where not measured."""
    return None if not parts else max(parts) / min(parts)


def _most_of_ranks(n: int) -> int:
    """``n``, or where the script's ranks step together (``torch.distributed`` is up), the most any rank has
    (every rank asks at the same batch, so they all end their window at the same one)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return n
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    most = torch.tensor([n], device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


def _drain_gpu() -> None:
    """Wait for the work this process has queued on its GPU, if it uses one (a CUDA step runs ahead of the
    loop's clock)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _Timed:
    """One pass's iterator in a timed phase; in the ingestion phase the loader's workers are stopped once
    the first batch is in, and every later batch is a copy of it sent by as many new workers (the first
    itself when the loader has none)."""

    def __init__(self, window: _Window, iterator):
        self._window, self._iterator = window, iterator

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self._window.loader if self._iterator is None or self._window.phase == "rates" else self._iterator)

    def __next__(self):
        w = self._window
        w.count()
        if w.phase == "ingestion" and w.first is not None:
            batch = w.first if w.handover is None else next(w.handover)
        else:
            batch = next(self._iterator)
            if w.phase == "ingestion":
                w.first = batch = _stop_loading(w.loader, self._iterator, batch)
                w.handover = _handover(w.loader, batch)
        w.taken += 1
        w.delivered(timed=True)
        return batch


class _Drawn:
    """A pass of the measured loader's batch sampler that a torch iterator coordl does not own draws from:
    the window counts its draws (see the module's docstring)."""

    def __init__(self, window: _Window, batches):
        self._window, self._batches = window, batches

    def __iter__(self):
        return self

    def __next__(self) -> list[int]:
        self._window.count()
        batch = next(self._batches)
        self._window.taken += 1
        self._window.delivered(timed=False)
        return batch


class FirstBatches:
    """The dataset proxy's batches in the ingestion phase of a loader built from its parts: in each process,
    the first is loaded (and a DALI pipeline then dropped), every later one is that first again."""

    def __init__(self):
        self._first, self._pid = None, None

    def __getstate__(self) -> dict:
        return {"_first": None, "_pid": None}  # a worker loads its own

    def __call__(self, load, indices: list[int], ledger):
        """``load(indices)`` in this process the first time, after that its result; ``ledger``: the feed's
        (the dataset's ``feed``), or None."""
        if self._pid == os.getpid():
            first = self._first
            return list(first) if isinstance(first, list) else first
        batch = load(indices)
        dali = _dali(ledger) if ledger is not None else None
        if dali is not None:
            batch = copy.deepcopy(batch)  # out of the pipeline's buffers, before it goes
            dali.discard()
        self._first, self._pid = batch, os.getpid()
        return batch


def _stop_loading(loader, iterator, batch):
    """Nothing loads while the loop runs: the loader's workers are stopped, its DALI pipeline dropped.
    Returns ``batch``, copied out of a dropped pipeline's buffers."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    group = _group_feed(loader.epoch_ledger)
    if group is not None:  # the member leaves the group: its share's workers (or pipeline) stop
        batch = copy.deepcopy(batch)  # out of the staging area
        group.close()
        return batch
    dali = _dali(loader.epoch_ledger)
    if dali is None:
        return batch
    batch = copy.deepcopy(batch)
    dali.discard()
    return batch


def _dali(ledger):
    """The DALI backend of a loader (its ``epoch_ledger``), where DALI prepares its batches on their own (no
    hp_group), else None."""
    from coordl._dali.pipeline import DaliFeed
    feed = ledger.feed
    return feed.backend if isinstance(feed, DaliFeed) else None


def _group_feed(ledger):
    """The hp_group feed of a loader (its ``epoch_ledger``), else None."""
    from coordl._group.feed import GroupFeed
    feed = ledger.feed
    return feed if isinstance(feed, GroupFeed) else None


def _prep_options(loader) -> dict:
    """How the loader's workers prepare: ``num_workers``, ``collate_fn``, ``worker_init_fn``,
    ``multiprocessing_context``, ``prefetch_factor`` (an hp_group member's: its share's loader's)."""
    group = _group_feed(loader.epoch_ledger)
    if group is not None:
        return dict(group.loader_options, collate_fn=group.collate_fn)
    return dict(num_workers=loader.num_workers, collate_fn=loader.collate_fn, worker_init_fn=loader.worker_init_fn,
                multiprocessing_context=loader.multiprocessing_context, prefetch_factor=loader.prefetch_factor)


class _Replay(torch.utils.data.Dataset):
    """Fresh copies of one batch, as a worker sends what it has prepared (nothing fetched or prepared)."""

    def __init__(self, batch):
        self.batch = batch

    def __len__(self) -> int:
        return 1

    def __getitems__(self, indices: list[int]):
        return copy.deepcopy(self.batch)


def _as_is(batch):
    return batch


def _handover(loader, batch):
    """Batches from as many worker processes as ``loader`` has (an hp_group member: as its share's loader
    has), each a copy of ``batch`` (None without workers: the training process loads, so nothing is handed
    over)."""
    options = _prep_options(loader)
    if not options["num_workers"]:
        return None
    batches = iter(torch.utils.data.DataLoader(
        _Replay(batch), batch_sampler=itertools.repeat([0]), num_workers=options["num_workers"], collate_fn=_as_is,
        pin_memory=loader.pin_memory, multiprocessing_context=options.get("multiprocessing_context"),
        prefetch_factor=options.get("prefetch_factor")))
    next(batches)  # the workers start now, not in the timed window
    return batches


def _passes(indices, batch_size: int):
    """Passes over ``indices`` without end, each in a new order, as lists of full batches (one batch of all of
    them where there are fewer than a batch)."""
    order, rng = list(indices), random.Random(1)
    while True:
        rng.shuffle(order)
        yield [order[i:i + batch_size] for i in range(0, max(1, len(order) - batch_size + 1), batch_size)]


def _prepared(loader, samples: torch.utils.data.Dataset, batch_size: int):
    """Batches of ``samples`` (cached or held: nothing fetched) prepared as ``loader`` prepares its own, without
    end, each pass in a new order (:func:`_passes`): by workers as its own, or by a twin of its DALI pipeline
    (``samples``: a ``Subset`` of what the twin fetches from)."""
    dali = _dali(loader.epoch_ledger)
    if dali is not None:
        return _DaliPasses(dali, samples.dataset, samples.indices, batch_size)
    options = _prep_options(loader)
    batches = (batch for one_pass in _passes(range(len(samples)), batch_size) for batch in one_pass)
    return iter(torch.utils.data.DataLoader(
        samples, batch_sampler=batches, num_workers=options["num_workers"], collate_fn=options["collate_fn"],
        worker_init_fn=options.get("worker_init_fn"), multiprocessing_context=options.get("multiprocessing_context"),
        prefetch_factor=options.get("prefetch_factor"), pin_memory=loader.pin_memory))


class _DaliPasses:
    """Batches of ``indices`` of ``held`` from a pipeline with ``backend``'s settings (fed as the loader feeds its
    own), an epoch per pass of :func:`_passes`, each with a new seed; :meth:`close` drops the pipeline."""

    def __init__(self, backend, held, indices: list[int], batch_size: int):
        self._twin = backend.twin()
        self._twin.cached = held
        self._passes, self._seeds, self._epoch = _passes(indices, batch_size), itertools.count(), None

    def __iter__(self):
        return self

    def __next__(self):
        while True:
            if self._epoch is None:
                self._epoch = self._twin.epoch(next(self._passes), next(self._seeds))
            try:
                return next(self._epoch)
            except StopIteration:
                self._epoch = None

    def close(self) -> None:
        self._twin.close()


def _hits(loader) -> tuple[int, int, int]:
    """Samples served from this server's cache, from the peers' caches, and fetched in all, so far."""
    total = loader.stats().total
    return total.hits, total.peer_hits, total.hits + total.peer_hits + total.disk_hits + total.misses


def _timers(loader) -> dict:
    """The loop's waits for batches and the loading processes' seconds reading storage, waiting for peers
    and preparing, so far (the loader's statistics; see ``EpochStats``)."""
    total = loader.stats().total
    return {"stall": total.stall_s, "storage": total.storage_wait_s, "peers": total.peer_wait_s,
            "prep": total.prep_s}


def measure_rates(loader, samples: int) -> tuple[dict, torch.utils.data.Dataset | None]:
    """``S``, ``C`` and ``P`` of ``loader``'s dataset, in samples/s, over a random subset of ``samples``
    (see the module's docstring); and the samples P was measured on (a ``Subset``), None for an hp_group's
    member."""
    batch_size = _measured[0].batch_size
    dataset, dali, group = loader.dataset, _dali(loader.epoch_ledger), _group_feed(loader.epoch_ledger)
    prep = _prep_options(loader)
    if group is not None:  # a member prepares its share on its own workers or DALI pipeline, from the fetch path
        dataset, dali = dataset.unfed(), group.dali
    source, storage, cache = dataset.source, dataset.storage, dataset.cache
    cores = max(1, len(os.sched_getaffinity(0)) // _sharers())  # this rank's share
    part, parts = _part()
    n = max(1, min(len(dataset) // parts, samples))
    order = random.Random(0).sample(range(len(dataset)), len(dataset))
    subset = order[part * n:(part + 1) * n]  # this rank's part
    keys = [source.raw_key(i) for i in subset]
    stamped = hasattr(storage, "read_stamped")
    read = storage.read_stamped if stamped else storage.read
    disk = callable(getattr(storage, "read_past_disk", None))
    if disk:  # storage's own rate: the tier writes what these read, for K
        read = storage.read_past_disk
    in_flight, lookahead = _gets_in_flight(loader, storage, prep["num_workers"])
    device_before, storage_s, passes = _device_read_bytes(), 0.0, 0
    least = least_s(STORAGE_MIN_S)
    with concurrent.futures.ThreadPoolExecutor(in_flight or cores) as pool:
        while passes == 0 or storage_s < least:  # a throttle lets a short burst through
            for key in keys:
                _evict(key)
            started = time.perf_counter()
            raws = list(pool.map(read, keys))
            storage_s += time.perf_counter() - started
            passes += 1
    sizes = [len(r[0] if stamped else r) for r in raws]
    result = {"phase": "rates", "samples": len(dataset), "sample_bytes": sum(sizes) / n, "subset": n,
              "S": passes * n / storage_s, "S_passes": passes, "cores": cores, "batch_size": batch_size,
              "backend": loader.backend,
              "workers": prep["num_workers"] if dali is None else dali.dali_threads,
              "fetch_threads": 0 if dali is None else dali.fetch_threads,
              "cache_bytes": cache.capacity_bytes if cache is not None else 0,
              "cold_fraction": None if in_flight else _cold_fraction(device_before, passes * sum(sizes)),
              "hp_group": group is not None, "concurrency": storage.concurrency if in_flight else 0,
              "lookahead": lookahead, "S_threads": in_flight or cores}
    peers = getattr(dataset, "peers", None)
    burst = misses_per_batch(batch_size, result["cache_bytes"] / (result["sample_bytes"] * len(dataset)),
                             peers.topology.nodes if peers is not None else 1)
    probe = keys[:max(burst, LATENCY_READS // burst * burst)]
    result["L"], result["L_cold_fraction"] = _miss_wait(read, probe, sum(sizes[:len(probe)]), n / storage_s, burst)
    if in_flight:  # an object store: no block device to say how cold
        result["L_cold_fraction"] = None
    result["L_burst"] = burst
    if disk:
        result["disk_item_bytes"] = sum(packed_bytes(key, size) for key, size in zip(keys, sizes)) / n
        result.update(_disk_rates(storage, keys, result["disk_item_bytes"] * len(dataset), cores))
    datas = [r[0] if stamped else r for r in raws]
    cached = []
    if cache is not None:
        for index, raw in zip(subset, raws):
            data, stamp = raw if stamped else (raw, None)
            cache.put(index, data, stamp)
        row = dataset.counters.row()
        cached = [i for i in subset if cache.view(i) is not None]
    if cached:  # the hit path, timed over the items the cache took, a batch at a time as the loader fetches them
        batches = [cached[k:k + batch_size] for k in range(0, len(cached), batch_size)]
        rate = _hit_rate(lambda batch: dataset.cached_many(batch, row, views=dali is not None), batches, cores)
        result["C"], result["C_from"] = rate * len(cached) / len(batches), "cache"
    else:  # no cache, or it took nothing: a copy of the bytes in memory stands for a hit (CoorDL §5.1 (iv))
        result["C"], result["C_from"] = _hit_rate(bytes, datas, cores), "memory copy"
    result["cached_fraction"] = len(cached) / n
    if peers is not None and peers.topology.nodes > 1:  # partitioned caching: R, from what the others' caches took
        result["servers"] = peers.topology.nodes
        result["R"], result["R_samples"] = _peer_rate(peers, order, n, batch_size, cores)
    if len(cached) >= min(n, PREP_MIN_BATCHES * batch_size):  # through the cache, as the job's hits go
        result["P_from"], indices, held = "cache", cached, dataset
    else:  # the cache cannot hold enough of it: from the bytes read, held in memory
        result["P_from"], indices, held = "memory", subset, _Held(source, subset, datas)
    prepared = torch.utils.data.Subset(held, indices)
    if dali is None:
        rate, cpu_s = _prep_rate(prep, prepared, batch_size)
    else:
        rate, cpu_s = _dali_prep_rate(dali, held, indices, batch_size)
    result["P"], result["prep_cpu_s"] = rate, cpu_s / len(indices)
    return result, prepared if group is None else None


def _disk_rates(tier, keys: list, dataset_bytes: float, cores: int) -> dict:
    """The disk tier's ``K`` (samples/s over the keys it holds once their writes are done, on ``cores``
    threads, as a batch's misses are read), ``L_disk`` (one reader's mean wait for one of them) and
    ``disk_fraction`` (the share of the dataset, ``dataset_bytes`` as the tier packs them, that its quota or
    the file system's room lets it hold; 1: all)."""
    tier.flush(None)
    cache = tier.cache
    room = cache.pack_bytes() + room_for(tier.cache_dir, cache.folder, int(dataset_bytes), tier.quota, evict=False)
    held = [key for key in keys if tier.holds(key)]
    out = {"disk_fraction": min(1.0, room / max(1.0, dataset_bytes)), "K_samples": len(held), "K": None,
           "L_disk": 0.0}
    if not held:
        return out
    elapsed, passes, least = 0.0, 0, least_s(STORAGE_MIN_S)
    with concurrent.futures.ThreadPoolExecutor(cores) as pool:
        while passes == 0 or elapsed < least:
            started = time.perf_counter()
            list(pool.map(tier.read_stamped, held))  # from its disk (its pages dropped after each read)
            elapsed += time.perf_counter() - started
            passes += 1
    waits = []
    for key in held[:LATENCY_READS]:
        started = time.perf_counter()
        tier.read_stamped(key)
        waits.append(time.perf_counter() - started)
    out.update(K=passes * len(held) / elapsed, L_disk=sum(waits) / len(waits))
    return out


def _gets_in_flight(loader, storage, workers: int) -> tuple[int, int]:
    """From an object store (``_fetch.concurrent_misses``): the GETs the loader keeps in flight at most (each
    worker's misses at once, and the look-ahead's), and the look-ahead's; (0, 0) from files."""
    if not reads_concurrently(storage):
        return 0, 0
    lookahead = loader.epoch_ledger.lookahead
    depth = lookahead.depth if lookahead is not None else 0
    return max(1, workers) * storage.concurrency + depth, depth


def _hit_rate(hit, items: list, cores: int) -> float:
    """Items/s of ``hit(item)`` over ``items`` on ``cores`` threads, over the passes after a first, for at least
    :data:`HIT_MIN_S` (one pass takes milliseconds: a single stall of the process would set it)."""
    with concurrent.futures.ThreadPoolExecutor(cores) as pool:
        list(pool.map(hit, items))
        started, passes, least = time.perf_counter(), 0, least_s(HIT_MIN_S)
        while passes == 0 or time.perf_counter() - started < least:
            list(pool.map(hit, items))
            passes += 1
        return passes * len(items) / (time.perf_counter() - started)


def _peer_rate(peers, order: list[int], n: int, batch_size: int, cores: int) -> tuple[float | None, int]:
    """``R``: samples/s this rank fetches from the other servers' caches (a batch per request, on ``cores``
    threads, as its workers fetch), over the part of ``order`` that the same local rank of the next server
    put in that server's cache; and how many samples that was. Every rank of the job takes part: the caches
    are mapped as at an epoch start (:meth:`PeerTier.begin_epoch`), once each holds its ranks' parts, and no
    rank goes on before all have fetched (a server's cache goes with its processes). None: nothing was
    fetched (the next server's cache took none of its part, or it is missing from the map)."""
    t = peers.topology
    peers.begin_epoch(RATES_EPOCH)
    theirs = ((t.node + 1) % t.nodes) * t.local_world + t.local_rank
    held = [i for i in order[theirs * n:(theirs + 1) * n] if peers.client.held_elsewhere(i)]
    batches = [held[i:i + batch_size] for i in range(0, len(held), batch_size)]
    got = 0
    if batches:
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(cores) as pool:
            got = sum(pool.map(lambda batch: len(peers.client.request(batch).collect()), batches))
        elapsed = time.perf_counter() - started
    if not peers.wait_for_ranks("analyze-rates", peers.exchange_s):
        raise RuntimeError(f"coordl analyze: not every server's ranks fetched from their peers within "
                           f"{peers.exchange_s:.0f} s ({EXCHANGE_ENV})")
    if got < len(held):
        raise RuntimeError(f"coordl analyze: the peers delivered {got} of the {len(held)} samples their caches "
                           f"hold; a peer server did not answer (see the log above)")
    return (got / elapsed if got else None), got


class _Held(torch.utils.data.Dataset):
    """The samples of a subset, prepared (torch) or fetched (DALI) from their raw bytes held in memory:
    nothing is read from storage. Indexed like the dataset."""

    def __init__(self, source, indices: list[int], raws: list):
        self.source, self.raws = source, dict(zip(indices, raws))
        self.counters = SampleCounters(1)  # what a DALI feeder counts in

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int):
        return self.source.decode_raw(index, self.raws[index])

    def fetch_many(self, indices: list[int], row, views: bool = False) -> list:
        return [self.raws[i] for i in indices]


def _prep_rate(options: dict, samples: torch.utils.data.Dataset, batch_size: int) -> tuple[float, float]:
    """Samples/s of workers as the loader's (``options``: :func:`_prep_options`) preparing ``samples`` (nothing
    read from storage), and the CPU seconds they take per pass (the workers', or the training process's where
    it prepares)."""
    workers = options["num_workers"]
    prep = torch.utils.data.DataLoader(
        samples, batch_size=batch_size, num_workers=workers, collate_fn=options["collate_fn"],
        persistent_workers=workers > 0, multiprocessing_context=options.get("multiprocessing_context"),
        worker_init_fn=options.get("worker_init_fn"))
    cpu_s = (lambda: sum(map(cpu_seconds, (w.pid for w in prep._iterator._workers)))) if workers else \
        time.process_time
    passes_per_s, cpu_per_pass = _passes_per_s(lambda: [None for _ in prep], cpu_s)
    return passes_per_s * len(samples), cpu_per_pass


def _dali_prep_rate(backend, held, indices: list[int], batch_size: int) -> tuple[float, float]:
    """Samples/s of a pipeline with ``backend``'s settings preparing ``indices`` of ``held`` (the loader's
    dataset: through its cache; or bytes held in memory), fed as the loader feeds its own; and the CPU
    seconds of this process (DALI's threads are in it) per pass."""
    twin = backend.twin()
    twin.cached = held
    batches = [indices[i:i + batch_size] for i in range(0, len(indices), batch_size)]
    seeds = itertools.count()
    try:
        passes_per_s, cpu_per_pass = _passes_per_s(lambda: [None for _ in twin.epoch(batches, next(seeds))],
                                                   time.process_time)
        return passes_per_s * len(indices), cpu_per_pass
    finally:
        twin.close()


def _passes_per_s(one_pass, cpu_s) -> tuple[float, float]:
    """Passes per second of ``one_pass()``, over the passes after a first (which starts the workers or the
    pipeline): at least 2, and :data:`PREP_MIN_S`; and the CPU seconds (``cpu_s()``: so far) per pass."""
    one_pass()
    started, cpu_started, passes, least = time.perf_counter(), cpu_s(), 0, least_s(PREP_MIN_S)
    while passes < 2 or time.perf_counter() - started < least:
        one_pass()
        passes += 1
    return passes / (time.perf_counter() - started), (cpu_s() - cpu_started) / passes


def misses_per_batch(batch_size: int, cache_fraction: float, servers: int = 1) -> int:
    """The storage reads a worker makes for one batch when each of ``servers`` caches holds
    ``cache_fraction`` of the dataset (the rest misses them all); at least 1."""
    return max(1, round(batch_size * (1.0 - min(1.0, servers * cache_fraction))))


def _miss_wait(read, keys: list, size: int, storage_rate: float, burst: int) -> tuple[float, float | None]:
    """Mean seconds one reader waits for a cold read of one of ``keys`` (``size`` bytes in all), after
    :data:`STORAGE_REST_S` of rest, in bursts of ``burst`` reads back to back (a worker's misses of one
    batch), a burst started every ``burst`` reads' worth of half ``storage_rate`` samples/s, so that the
    storage is never saturated; and the fraction of those bytes a block device served."""
    for key in keys:
        _evict(key)
    time.sleep(least_s(STORAGE_REST_S))
    before, waits = _device_read_bytes(), []
    for first in range(0, len(keys), burst):
        started = time.perf_counter()
        for key in keys[first:first + burst]:
            read_started = time.perf_counter()
            read(key)
            waits.append(time.perf_counter() - read_started)
        time.sleep(max(0.0, 2.0 * burst / storage_rate - (time.perf_counter() - started)))
    return sum(waits) / len(waits), _cold_fraction(before, size)


def _cold_fraction(device_before: int | None, size: int) -> float | None:
    """The fraction of ``size`` bytes read since ``device_before`` (:func:`_device_read_bytes`) that came
    from a block device, None where unknown."""
    after = _device_read_bytes()
    return None if device_before is None or after is None else (after - device_before) / max(1, size)


def _evict(path: str) -> None:
    """Drop ``path`` from the page cache (a path that is not a local file is left as it is)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except (OSError, TypeError):
        return
    try:
        with contextlib.suppress(OSError):
            os.fdatasync(fd)  # dirty pages stay cached: written back first (a freshly copied dataset)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _device_read_bytes() -> int | None:
    """Bytes this process has caused to be read from block devices (``/proc/self/io``), None if unknown."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    except (OSError, StopIteration, ValueError):
        return None
