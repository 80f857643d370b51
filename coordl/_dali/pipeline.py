"""The DALI backend: DALI pipelines fed with raw bytes from coordl's fetch path.

coordl owns the order and the fetch path: the loader hands each epoch's batches of indices (torch's
sampler, so sharding and ``drop_last`` behave as in the torch backend), a pool of fetch threads reads
each batch's encoded bytes through :meth:`CachedDataset.fetch` (MinIO cache, then storage) ahead
of time, and DALI's ``fn.external_source`` takes them batch by batch. Decoding and augmentation run
in DALI's own threads (CPU) or on the GPU ("mixed" decoding).

This module imports DALI; :func:`require_dali` says how to install it when it is missing.
"""

import collections
import concurrent.futures
import ctypes
import gc
import hashlib
import importlib.util
import io
import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from coordl._core.log import warn_caller
from coordl._fetch.cached_dataset import COUNTER_FIELDS, CachedDataset
from coordl.exceptions import SampleError

summary_logger = logging.getLogger("coordl")
INSTALL_HINT = "pip install 'coordl[dali]'  (or: pip install nvidia-dali-cuda120)"
PREFETCH_DEPTH = 2
"""Batches DALI runs ahead of the training loop."""
FETCH_RAMP = 2
"""Batches a feeder fetches at once at an epoch's start (see :class:`_Feeder`)."""
AHEAD_LEFT = 2
"""A feeder draws the next epoch's plan ahead once this many or fewer of its epoch's batches are left to feed."""
AHEAD_BATCHES = FETCH_RAMP + PREFETCH_DEPTH
"""Batches of the next epoch's plan drawn ahead: more than DALI asks for before that epoch starts."""
AHEAD_MISSES = 2
"""Plans drawn ahead wrong in a row after which a pipeline stops drawing them."""
SAMPLES = COUNTER_FIELDS.index("samples")
_pipelines: "weakref.WeakSet" = weakref.WeakSet()
"""The DALI pipelines coordl built in this process (see :func:`_disown_pipelines_in_child`)."""


def _track(pipe):
    _pipelines.add(pipe)
    return pipe


_fork_gc = {"depth": 0, "was_enabled": True, "lock": threading.Lock()}
"""Forks in progress in this process, and whether collection was on before the first of them."""


def _pause_gc_for_fork() -> None:
    """Before ``fork``: no garbage collection until the child has disowned the pipelines (the other
    at-fork handlers, run first in the child, may trigger one). Threads forking at once share the pause."""
    with _fork_gc["lock"]:
        if _fork_gc["depth"] == 0:
            _fork_gc["was_enabled"] = gc.isenabled()
            gc.disable()
        _fork_gc["depth"] += 1


def _resume_gc_in_parent() -> None:
    with _fork_gc["lock"]:
        _fork_gc["depth"] -= 1
        if _fork_gc["depth"] == 0 and _fork_gc["was_enabled"]:
            gc.enable()


def _disown_pipelines_in_child() -> None:
    """After ``fork``, in the child: keep the parent's pipelines from shutting down here. Their threads
    stayed in the parent, so a shutdown in the child (when the garbage collector or ``atexit`` reaches
    one: a torch worker forked after a DALI epoch) crashes or hangs. Each native pipeline is let go of
    unfreed: its memory is the parent's, copied on write."""
    for pipe in list(_pipelines):
        native = getattr(pipe, "_pipe", None)
        if native is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(native))  # never destroyed in this process
            pipe._pipe = None
    _fork_gc.update(depth=0, lock=threading.Lock())  # only the forking thread lives on here
    if _fork_gc["was_enabled"]:
        gc.enable()


os.register_at_fork(before=_pause_gc_for_fork, after_in_parent=_resume_gc_in_parent,
                    after_in_child=_disown_pipelines_in_child)


def dali_available() -> bool:
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except (ImportError, ValueError):  # a parent package missing, or a module entry blocked
        return False


def require_dali() -> None:
    """Raise ImportError with the install command when DALI is not installed."""
    if not dali_available():
        raise ImportError(f"backend='dali' needs NVIDIA DALI, which is not installed. Install it with: {INSTALL_HINT}")


def resolve_pipeline(pipeline) -> Callable:
    """A preset name or a user's pipeline function → the pipeline function."""
    from coordl._dali.presets import PRESETS
    if callable(pipeline):
        return pipeline
    if pipeline not in PRESETS:
        raise ValueError(f"dali_pipeline should be one of {sorted(PRESETS)} or a function "
                         f"(encoded, target, *, device, train) -> outputs, but got dali_pipeline={pipeline!r}")
    return PRESETS[pipeline]


def target_reader(dataset) -> tuple[Callable[[int], tuple] | None, str]:
    """How to read sample ``i``'s target as numpy arrays for the pipeline: (reader, "") or (None, why).

    ``dali_target(i)`` if the dataset defines it (a label, or a ``(boxes, labels)`` pair; coordl's
    view of a ``DatasetFolder`` gives the class index), else ``targets[i]`` (:class:`coordl.FileDataset`).
    """
    if hasattr(dataset, "dali_target"):
        def read(i):
            target = dataset.dali_target(i)
            return tuple(target) if isinstance(target, tuple) else (np.int64(target),)
        return read, ""
    if getattr(dataset, "targets", None) is not None:
        return (lambda i: (np.int64(dataset.targets[i]),)), ""  # looked up each time: it may be replaced
    return None, f"{type(dataset).__name__} has no labels coordl can read (define dali_target(i) or targets)"


def _fetch_batch(cached: CachedDataset, read_target, indices: Sequence[int]) -> tuple[Any, list, np.ndarray]:
    """In a fetch thread: (encoded samples, target columns, counter deltas) of one batch. A column of
    scalars is one array; else a list of contiguous arrays (DALI takes either without a copy). Hits are
    views into the cache's mapping, not copies. The encoded samples are one DALI tensor list over those
    bytes, not contiguous (no copy), built here rather than by ``external_source`` on the thread that runs
    the pipeline (the training loop's), which takes a tensor list as it is where it checks and converts a
    list sample by sample. Each tensor holds the object whose bytes it wraps, and the list its tensors;
    bytes and views of bytes are wrapped as they are, anything else through numpy, as uint8 either way."""
    from nvidia.dali.tensors import TensorCPU, TensorListCPU
    row = np.zeros(len(COUNTER_FIELDS), dtype=np.int64)
    encoded = TensorListCPU([TensorCPU(raw if type(raw) is bytes or type(raw) is memoryview and raw.format == "B"
                                       else np.frombuffer(raw, dtype=np.uint8), "")
                             for raw in cached.fetch_many(list(indices), row, views=True)], None, contiguous=False)
    row[SAMPLES] += len(indices)
    return encoded, _target_columns(read_target, indices), row


def _target_columns(read_target, indices: Sequence[int]) -> list:
    """The targets of a batch's samples, a column per target field (see :func:`_column`)."""
    return [_column(values) for values in zip(*(read_target(i) for i in indices))]


def _column(values: tuple) -> np.ndarray | list:
    """One target field of a batch's samples: one array if every value is a scalar, else a list of
    contiguous arrays. The array is made at once and checked after (the feed's per-sample Python is what
    limits it on a GPU): a column of scalars is one dimension deep, any other fails or is deeper."""
    try:
        column = np.array(values)
    except ValueError:  # values of different shapes
        column = None
    if column is not None and column.ndim == 1 and column.dtype != object:
        return column
    return [np.ascontiguousarray(v) for v in values]


def _same_columns(a: list, b: list) -> bool:
    """Whether two batches' target columns (of :func:`_target_columns`) hold the same values."""
    return len(a) == len(b) and all(
        np.array_equal(x, y) if isinstance(x, np.ndarray) and isinstance(y, np.ndarray) else
        isinstance(x, list) and isinstance(y, list) and len(x) == len(y) and all(map(np.array_equal, x, y))
        for x, y in zip(a, b))


class _Feeder:
    """The supply of batches for ``fn.external_source``: an epoch's plan, then, where the next pass's plan
    can be drawn ahead (``plan_ahead(n)``, its first ``n`` batches; see NOTE [ Planning ahead ] in
    ``batch_sampler``), that plan's first :data:`AHEAD_BATCHES`, so DALI runs on across the epoch's end as its
    own reader does. It draws them once :data:`AHEAD_LEFT` or fewer of the epoch's batches are left to feed.
    Batches are fetched up to ``depth`` ahead on ``pool``, starting with :data:`FETCH_RAMP` and adding one more
    each batch taken until there are ``depth`` (a batch's hits are fetched in Python: the epoch's first,
    fetched beside ``depth - 1`` others, would come after all of them). The fetches owed for the batches taken
    start at :meth:`handed_over`, once the batch DALI ran is handed over: started while the loop is still in DALI's
    ``run()``, a fetch thread's Python competes with the loop's for the interpreter just when the loop waits for
    its batch. Only where nothing is left fetching for DALI's next call do they start at once.

    Batches fed from the plan ahead are the next epoch's: their counts are held until that epoch takes them
    over (:meth:`take_over`: its plan starts with them, and their targets are still what was fetched), or,
    that epoch's plan being another (:meth:`replan`), counted there as reads without samples, their outputs
    dropped. One that fails to fetch is fed as the batch before it and the plan ahead is not taken over:
    the next epoch fetches that batch again, and fails where it belongs.
    """

    def __init__(self, cached: CachedDataset, read_target, batches: list[list[int]],
                 pool: concurrent.futures.ThreadPoolExecutor, depth: int, plan_ahead=None):
        self._cached, self._read_target = cached, read_target
        self._counters = cached.counters.table.numpy()[0]  # the main process's row
        self._pool, self._depth = pool, max(depth, 1)
        # fed to DALI, not yet out of it: (indices, the samples DALI reads without copying them)
        self.in_flight: collections.deque = collections.deque()
        self._start(batches, plan_ahead)

    def _start(self, batches: list[list[int]], plan_ahead) -> None:
        self._batches, self._plan_ahead = batches, plan_ahead
        self.ahead: list[list[int]] | None = None  # the next pass's first batches, once drawn
        self._held = np.zeros(len(COUNTER_FIELDS), dtype=np.int64)  # counts of batches fed from them
        self._spoiled = False  # a batch of them failed to fetch
        self._pending: collections.deque = collections.deque()
        self._next = self._fed = 0  # batches submitted and fed: this plan's, then the ones ahead
        self._owed = 0  # fetches to start at the next top_up
        self._submit(FETCH_RAMP)

    @property
    def goes_on(self) -> bool:
        """Whether batches of the plan ahead follow this epoch's (else the feed ends with it)."""
        return self.ahead is not None

    def fed_ahead(self) -> int:
        """How many of the batches in flight are of the plan ahead (the last ones)."""
        return max(self._fed - len(self._batches), 0)

    def _draw_ahead(self) -> None:
        if self._plan_ahead is None or len(self._batches) - self._fed > AHEAD_LEFT:
            return
        plan_ahead, self._plan_ahead = self._plan_ahead, None
        try:
            self.ahead = plan_ahead(AHEAD_BATCHES) or None
        except Exception:  # a plan that cannot be drawn ahead is drawn when its pass starts, and fails there
            self.ahead = None

    def _submit(self, most: int) -> None:
        """Start fetching up to ``most`` more batches, ``depth`` at most in flight."""
        self._draw_ahead()
        stream = len(self._batches) + len(self.ahead or ())
        for _ in range(most):
            if self._next == stream or len(self._pending) >= self._depth:
                return
            k = self._next - len(self._batches)
            indices = self._batches[self._next] if k < 0 else self.ahead[k]
            self._pending.append((indices, self._pool.submit(_fetch_batch, self._cached, self._read_target,
                                                             indices), k >= 0))
            self._next += 1

    def __call__(self):
        if not self._pending:
            raise StopIteration
        indices, future, fetched_ahead = self._pending.popleft()
        ahead = self._fed >= len(self._batches)
        try:
            encoded, columns, row = future.result()
            if fetched_ahead and not ahead:  # fetched before its epoch started: its targets as they are now
                columns = _target_columns(self._read_target, indices)
            fed = (encoded, *columns)
        except Exception:
            if not ahead:
                raise
            self._spoiled, fed, row = True, self.in_flight[-1][1], 0
        self._fed += 1
        if ahead:
            self._held += row
        else:
            self._counters += row
        self._owed += 2  # in place of the batch taken, and one more until there are depth
        if not self._pending:
            self.top_up()
        self.in_flight.append((indices, fed))
        return fed

    def top_up(self) -> None:
        """Start the fetches owed for the batches taken since the last call."""
        owed, self._owed = self._owed, 0
        if owed:
            self._submit(owed)

    def handed_over(self) -> None:
        """A batch's outputs are out of DALI and handed over: let go of its fed samples (until now an output
        may be them) and start the fetches owed."""
        if self.in_flight:
            self.in_flight.popleft()
        self.top_up()

    def take_over(self, batches: list[list[int]], plan_ahead) -> bool:
        """At the next epoch's start, with this epoch's batches all out of DALI: if its plan ``batches`` starts
        with the batches drawn ahead and the targets fed with them are still the dataset's, go on with it (the
        batches fed ahead are its first; those fetched ahead and not fed get their targets read again when
        fed) and return True."""
        if self._spoiled or batches[:len(self.ahead)] != self.ahead or not self._targets_kept():
            return False
        done = len(self._batches)
        self._batches, self.ahead, self._plan_ahead = batches, None, plan_ahead
        self._next, self._fed = self._next - done, self._fed - done
        self._counters += self._held
        self._held[:] = 0
        self._submit(FETCH_RAMP)
        return True

    def _targets_kept(self) -> bool:
        """Whether the targets fed with the batches ahead are still the dataset's (a training loop may
        relabel samples between epochs)."""
        fed = list(self.in_flight)[len(self.in_flight) - self.fed_ahead():]
        return all(_same_columns(list(fed_batch[1:]), _target_columns(self._read_target, indices))
                   for indices, fed_batch in fed)

    def replan(self, batches: list[list[int]], plan_ahead) -> int:
        """At the next epoch's start, with this epoch's batches all out of DALI and the plan ahead not taken
        over: feed ``batches`` from their first. Returns how many batches DALI was fed from the plan ahead,
        whose outputs come first and are to be dropped."""
        dropped = self.fed_ahead()
        self.close()
        self._held[SAMPLES] = 0
        self._counters += self._held
        self._start(batches, plan_ahead)
        return dropped

    def close(self) -> None:
        """Cancel the fetches not started and wait for those running: none of them runs after. The reads of
        those that ran are counted, without samples (their batches are not fed)."""
        futures = [future for _, future, _ in self._pending]
        for future in futures:
            future.cancel()
        concurrent.futures.wait(futures)
        for future in futures:
            if not future.cancelled() and future.exception() is None:
                row = future.result()[2].copy()
                row[SAMPLES] = 0
                self._counters += row
        self._pending.clear()


class DaliBackend:
    """A loader's DALI pipeline: built at the first epoch, kept across epochs, rebuilt after an
    abandoned or failed one (its queued batches cannot be taken back). Where the next epoch's plan can be
    drawn ahead, the pipeline runs on into it without a reset, so that epoch's first batches are ready when
    it starts (its feed draining and filling at each epoch's edge cost coordl's pipeline 14-16% of an
    epoch of 16 batches on an H100, against under 1% for DALI's reader, which runs on). Its fetch threads
    are kept across epochs too: started afresh each epoch, each new thread waits its turn for the
    interpreter behind those already fetching, which held each epoch's first batch back by tens of
    milliseconds.

    ``ahead``: how many epochs started on the plan drawn ahead (``taken``) and on another (``dropped``: the
    batches fed from the plan ahead were dropped).

    Args:
        cached: the loader's dataset behind coordl's fetch path.
        pipeline: a preset name or a pipeline function (see :mod:`coordl._dali.presets`).
        device: ``"cpu"`` or ``"gpu"``.
        train: run the preset's training augmentation (else its eval transform).
        batch_size: the largest batch the plan yields.
        fetch_threads: threads reading raw bytes ahead of DALI.
        dali_threads: DALI's own CPU threads.
        prefetch_batches: batches fetched ahead.
        pin_memory: pin CPU outputs (when a GPU is present).
    """

    def __init__(self, cached: CachedDataset, *, pipeline, device: str, train: bool, batch_size: int,
                 fetch_threads: int, dali_threads: int, prefetch_batches: int, pin_memory: bool):
        require_dali()
        if device not in ("cpu", "gpu"):
            raise ValueError(f"dali_device should be 'cpu' or 'gpu', but got dali_device={device!r}")
        if device == "gpu" and not torch.cuda.is_available():
            raise RuntimeError("dali_device='gpu' needs a CUDA GPU, and torch sees none; use dali_device='cpu'")
        self._read_target, why = target_reader(cached.source)
        if cached.source is None or self._read_target is None:
            raise TypeError(f"backend='dali' cannot read {type(cached.dataset).__name__}: "
                            f"{why or 'it is not a dataset of files'}")
        self.cached, self.pipeline_fn, self.device, self.train = cached, resolve_pipeline(pipeline), device, train
        # a preset's outputs are known (see wraps_output): DALI may read what it is fed in place
        self._feed_in_place = not callable(pipeline)
        self.batch_size, self.fetch_threads, self.dali_threads = batch_size, fetch_threads, dali_threads
        self.prefetch_batches, self.pin_memory = prefetch_batches, pin_memory and torch.cuda.is_available()
        self._pipe = None
        self._feeder: _Feeder | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_pid: int | None = None
        self.finished = True  # the last epoch ran to its end (else its queued batches must be dropped)
        self.ahead = {"taken": 0, "dropped": 0}  # epochs started on a plan drawn ahead: right, and not
        self._misses = 0  # plans drawn ahead wrong in a row
        self._warn_replaced_transforms(cached.dataset)

    def twin(self) -> "DaliBackend":
        """A second, independent pipeline with the same settings (built, and its fetch threads started,
        when first used)."""
        twin = object.__new__(DaliBackend)
        twin.__dict__.update(self.__dict__)
        twin._pipe, twin._feeder, twin._pool, twin._pool_pid, twin.finished = None, None, None, None, True
        twin.ahead, twin._misses = {"taken": 0, "dropped": 0}, 0
        return twin

    def _fetch_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """The fetch threads: this process's (a forked child has none of its parent's threads)."""
        if self._pool is None or self._pool_pid != os.getpid():
            self._pool = concurrent.futures.ThreadPoolExecutor(max(self.fetch_threads, 1),
                                                               thread_name_prefix="coordl-fetch")
            self._pool_pid = os.getpid()
        return self._pool

    @staticmethod
    def _warn_replaced_transforms(dataset) -> None:
        names = [n for n in ("transform", "target_transform", "transforms") if getattr(dataset, n, None) is not None]
        if names:
            warn_caller(f"backend='dali': the DALI pipeline replaces the dataset's own {' and '.join(names)}; "
                        f"they are not applied.")

    def _build(self, seed: int):
        from nvidia.dali import Pipeline, fn, types
        n_targets = len(self._read_target(0)) if len(self.cached) else 1
        pipe = Pipeline(batch_size=self.batch_size, num_threads=max(self.dali_threads, 1),
                        device_id=torch.cuda.current_device() if self.device == "gpu" else None,
                        seed=seed % 2**31, prefetch_queue_depth=PREFETCH_DEPTH)
        with pipe:
            # no_copy: DALI reads the fed samples in place; the feeder keeps them until their batch is out
            encoded, *target = fn.external_source(source=self._feed, num_outputs=1 + n_targets, batch=True,
                                                  dtype=[types.UINT8] + [None] * n_targets,
                                                  no_copy=self._feed_in_place)
            outputs = self.pipeline_fn(encoded, target[0] if n_targets == 1 else tuple(target),
                                       device=self.device, train=self.train)
            pipe.set_outputs(*(outputs if isinstance(outputs, (tuple, list)) else (outputs,)))
        pipe.build()
        return _track(pipe)

    def _feed(self):
        return self._feeder()

    def wraps_output(self, k: int) -> bool:
        """Whether output ``k`` becomes a torch tensor over DALI's own buffer rather than a copy: where
        DALI's dynamic executor hands its buffers over (it never reuses one a tensor holds), and the
        buffer is DALI's. A preset's first output is decoded; its others (labels, boxes) may be the
        fed arrays, which the feeder lets go of after the batch."""
        return self._pipe.exec_dynamic and (k == 0 or not self._feed_in_place)

    def epoch(self, batches: list[list[int]], seed: int, plan_ahead=None) -> "DaliEpoch":
        """Start an epoch over ``batches`` (lists of dataset indices, in plan order); ``plan_ahead``: a
        function drawing the next epoch's first batches ahead (see :class:`_Feeder`), or None."""
        if getattr(self.cached, "peers", None) is not None or self._misses >= AHEAD_MISSES:
            plan_ahead = None  # partitioned: the servers' cache maps change at each epoch's start
        if self.finished and self._feeder is not None and self._feeder.goes_on:
            self.finished = False  # until it has gone on: an interruption leaves the pipeline to be dropped
            if self._pipe is not None and batches and self._go_on(batches, plan_ahead):
                return DaliEpoch(self, len(batches))
        if not self.finished:
            self.discard()
        self._end_feeder()
        if self._pipe is None:
            self._pipe = self._build(seed)
        else:
            self._pipe.reset()
        self.finished = False
        self._feeder = _Feeder(self.cached, self._read_target, batches, self._fetch_pool(), self.prefetch_batches,
                               plan_ahead)
        return DaliEpoch(self, len(batches))

    def _go_on(self, batches: list[list[int]], plan_ahead) -> bool:
        """Run on into ``batches`` with the pipeline as it is, fed ahead: its batches if they were drawn
        right, else after dropping the outputs of those fed. False where that fails (start afresh)."""
        feeder = self._feeder
        try:
            if feeder.take_over(batches, plan_ahead):
                self.ahead["taken"] += 1
                self._misses = 0
                return True
            self.ahead["dropped"] += 1
            self._misses += 1
            if self._misses == AHEAD_MISSES:
                summary_logger.info(
                    "coordl: the DALI pipeline's plan drawn ahead was wrong %d epochs in a row, so it no longer runs "
                    "on across epochs. Something draws from the random state between epochs (a validation "
                    "DataLoader without a generator draws its base seed from torch's global RNG); pass "
                    "generator=torch.Generator() to this loader to keep its order apart from it.", AHEAD_MISSES)
            for _ in range(feeder.replan(batches, plan_ahead if self._misses < AHEAD_MISSES else None)):
                self._pipe.run()
                feeder.handed_over()
            return True
        except Exception:  # failed in DALI (a batch fed ahead, or this plan's, which fails again in its epoch)
            self.discard()
            return False

    def _end_feeder(self) -> None:
        if self._feeder is not None:
            self._feeder.close()
            self._feeder = None

    def discard(self) -> None:
        """Drop the pipeline (after an abandoned or failed epoch); the next epoch builds a new one. The
        pipeline goes first: it may still be reading the arrays its feeder holds."""
        self._pipe = None
        self._end_feeder()
        self.finished = True

    def close(self) -> None:
        """Drop the pipeline and stop the fetch threads."""
        self.discard()
        pool, self._pool = self._pool, None
        if pool is not None and self._pool_pid == os.getpid():
            pool.shutdown(wait=True)

    def explain(self, error: Exception) -> Exception:
        """A DALI failure while decoding → a :class:`SampleError` naming the file that fails to read, or
        the image file that fails to decode, found among the batches DALI had been given; else ``error``
        itself (other files, audio for one, cannot be checked here)."""
        from PIL import Image
        from torchvision.datasets.folder import IMG_EXTENSIONS
        feeder = self._feeder
        this_epochs = list(feeder.in_flight)[:len(feeder.in_flight) - feeder.fed_ahead()] if feeder else []
        in_flight = [i for batch, _ in this_epochs for i in batch]  # not the next epoch's, fed ahead
        scratch = np.zeros(len(COUNTER_FIELDS), dtype=np.int64)
        for index in in_flight:
            try:
                raw = self.cached.fetch(index, scratch)
            except SampleError as e:
                return e
            key = self.cached.source.raw_key(index)
            if not str(key).lower().endswith(IMG_EXTENSIONS):
                continue
            try:
                with Image.open(io.BytesIO(raw)) as image:
                    image.load()
            except Exception as e:
                first = str(error).strip().splitlines()
                return SampleError(f"cannot decode sample {index} ({key}, {len(raw)} bytes): {e} "
                                   f"(DALI: {' '.join(first[2:6]) if len(first) > 2 else error})")
        return error


class DaliFeed:
    """A loader's DALI pipeline as its feed (see ``_epochs.ledger`` NOTE [ Feeds ]): each pass, torch's plan
    through the pipeline, batch by batch.

    Lifecycle: :meth:`close` drops the pipeline.
    """

    counters = None

    def __init__(self, backend: DaliBackend):
        self.backend = backend
        self._epoch: DaliEpoch | None = None
        self._plan: list[list[int]] = []
        self._next = 0
        self._passes = 0
        self._skipped = False

    def begin(self, batches, ahead=None) -> list[list[int]]:
        """Start the pipeline on torch's plan (drawn here, as torch's iterator draws it); ``ahead`` draws the
        next pass's plan ahead, for the pipeline to run on into."""
        self._plan, self._next = [list(b) for b in batches], 0
        self._passes += 1
        first = self._plan[0] if self._plan else []
        seed = int.from_bytes(hashlib.sha256(f"{self._passes}:{first}".encode()).digest()[:8], "little") >> 1
        self._epoch = self.backend.epoch(self._plan, seed, ahead)
        return self._plan

    def take(self, indices) -> Any:
        """The pipeline's batch planned as ``indices``: the next one, or a later one when a sampler wrapper
        takes only some of the plan's batches (Accelerate's shard of several processes), in which case the
        batches it skipped are decoded and dropped (said once: a ``DistributedSampler`` avoids the waste)."""
        indices = list(indices)
        try:
            k = self._plan.index(indices, self._next) if self._epoch is not None else -1
        except ValueError:
            k = -1
        if k < 0:
            raise RuntimeError(f"backend='dali': asked for a batch of indices {indices[:8]}... that is not among the "
                               f"pipeline's coming batches ({self._next} of {len(self._plan)} served); the DALI "
                               f"backend serves its batch sampler's batches in order, in the training process "
                               f"(num_workers=0 in a DataLoader built from this loader's parts)")
        if k > self._next and not self._skipped:
            self._skipped = True
            warn_caller("backend='dali': a wrapper of the batch sampler skips batches (e.g. Accelerate with several "
                        "processes), which DALI decodes and drops; pass a DistributedSampler to the coordl "
                        "DataLoader instead to prepare only this process's batches.")
        for _ in range(k - self._next):
            next(self._epoch)
        self._next = k + 1
        return next(self._epoch)

    def end(self, complete: bool) -> None:
        self._epoch = None  # an unfinished epoch's queued batches are dropped by the next one

    def stats(self) -> None:
        return None

    def close(self) -> None:
        self.backend.close()


class DaliEpoch:
    """Iterator over one epoch's batches from a :class:`DaliBackend`, as torch tensors."""

    def __init__(self, backend: DaliBackend, n_batches: int):
        self._backend, self._n = backend, n_batches
        self._yielded = 0

    def __len__(self) -> int:
        return self._n

    def __iter__(self):
        return self

    def close(self) -> None:
        """Close the backend (its pipeline, fetch threads and buffers): for a backend used for this epoch only."""
        self._backend.close()

    def __next__(self):
        backend = self._backend
        if self._yielded >= self._n:
            raise StopIteration
        try:
            outputs = backend._pipe.run()
        except StopIteration:
            backend._end_feeder()
            raise
        except Exception as e:
            explained = backend.explain(e)
            backend.discard()
            if explained is e:
                raise
            raise explained from e
        batch = tuple(_to_torch(out, backend.pin_memory, backend.wraps_output(k)) for k, out in enumerate(outputs))
        if backend._feeder is not None:
            backend._feeder.handed_over()
        self._yielded += 1
        if self._yielded == self._n and backend._feeder is not None and backend._feeder.goes_on:
            backend.finished = True  # DALI runs on into the plan drawn ahead
        elif self._yielded == self._n:  # take DALI's end-of-epoch signal now, so the next epoch can reset
            try:
                backend._pipe.run()
                raise RuntimeError("DALI yielded more batches than the epoch's plan")
            except StopIteration:
                backend._end_feeder()
                backend.finished = True
        return batch


def _to_torch(tensor_list, pin_memory: bool, shared: bool = False) -> Any:
    """One DALI output batch → a torch tensor, or a list of tensors when its samples differ in shape. A
    CPU batch is copied out of DALI's buffers unless they are ``shared``: handed over by DALI's dynamic
    executor, which never reuses a buffer a tensor still holds (then the tensor wraps it, via DLPack, as
    DALI's own PyTorch iterator does)."""
    from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type
    from nvidia.dali.tensors import TensorListGPU
    if isinstance(tensor_list, TensorListGPU):
        if not tensor_list.is_dense_tensor():
            return [t.cuda() for t in _to_torch(tensor_list.as_cpu(), False)]
        dense = tensor_list.as_tensor()
        out = torch.empty(dense.shape(), dtype=to_torch_type[dense.dtype], device="cuda")
        return feed_ndarray(dense, out, cuda_stream=torch.cuda.current_stream())
    take = torch.from_dlpack if shared else (lambda tensor: torch.from_numpy(np.array(tensor)))
    if tensor_list.is_dense_tensor():
        out = take(tensor_list.as_tensor())
        return out.pin_memory() if pin_memory else out
    return [take(tensor_list[i]) for i in range(len(tensor_list))]


def _int64():
    from nvidia.dali import types
    return types.INT64
