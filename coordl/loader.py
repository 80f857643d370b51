"""``coordl.DataLoader``: torch's DataLoader, reading raw sample bytes through a node-wide MinIO cache.

It is a subclass of ``torch.utils.data.DataLoader`` that hands torch a :class:`CachedDataset`
wrapping the user's dataset. Sampling, worker processes, collation, pinning and error reporting are
torch's own, so batches are the ones torch would produce, in the same order, from the same seeds.
This module only composes the stages and keeps the books; it holds no algorithm.
"""

import getpass
import logging
import functools
import math
import os
import time
import warnings
import weakref

import torch.utils.data
from tqdm.auto import tqdm

from coordl._constants import AUTO_CACHE_MEMORY_FRACTION, AUTO_CACHE_SHM_KEEP_FRACTION, DEFAULT_GROUP_TIMEOUT_S
from coordl._group_config import auto_staging_bytes, check_group_compatible, check_group_options, group_settings
from coordl._logging import configure_from_env
from coordl._shm import free_shm_bytes, shm_dir, total_shm_bytes
from coordl._sizes import format_bytes, parse_size_option
from coordl._sysinfo import available_memory_bytes
from coordl.cached_dataset import CachedDataset, SampleCounters
from coordl.coord_epoch import CoordinatedEpoch, GroupCounters
from coordl.coord_prep import HPGroup, epoch_plan
from coordl.exceptions import GroupMismatchError
from coordl.minio_cache import MinIOCache, cache_segment_name, index_bytes
from coordl.raw_datasets import fingerprint_files, raw_source
from coordl.stats import EpochStats, LoaderStats, add_epoch
from coordl.storage import FileStorage

logger = logging.getLogger(__name__)
summary_logger = logging.getLogger("coordl")

CACHE_VERIFY = ("stat", "content")


def _auto_capacity(dataset_bytes: int, n_items: int) -> tuple[int, int]:
    """``cache_bytes="auto"``: (capacity, bytes of the shm file system a growing cache keeps free).

    The least of the dataset, a share of available memory, and what the shm file system has free
    beside the cache's index and the bytes kept free (a share of its size, for other jobs and for
    torch's worker-to-main batches until the loader has measured them; see minio_cache NOTE [ Sizing ]).
    0 when nothing fits.
    """
    memory, free, index = available_memory_bytes(), free_shm_bytes(), index_bytes(n_items)
    keep = int(AUTO_CACHE_SHM_KEEP_FRACTION * total_shm_bytes())
    capacity = max(0, int(min(dataset_bytes, AUTO_CACHE_MEMORY_FRACTION * memory, free - index - keep)))
    logger.info("Because cache_bytes was not given, using %s: the least of the dataset (%s), %d%% of available "
                "memory (%s) and the free space of %s (%s) less the cache's index (%s) and %s kept free for other "
                "jobs and torch's in-flight batches.", format_bytes(capacity), format_bytes(dataset_bytes),
                AUTO_CACHE_MEMORY_FRACTION * 100, format_bytes(memory), shm_dir(), format_bytes(free),
                format_bytes(index), format_bytes(keep))
    return capacity, keep


def _use_dali(backend, dataset, batch_size, batch_sampler) -> bool:
    """Whether ``backend=`` means the DALI backend for this dataset (checks what can be checked up front)."""
    if backend not in ("torch", "dali", "auto"):
        raise ValueError(f"backend should be 'torch', 'dali' or 'auto', but got backend={backend!r}")
    if backend == "torch":
        return False
    from coordl.dali_pipeline import dali_available, require_dali, target_reader
    unbatched = batch_size is None and batch_sampler is None
    source, why = raw_source(dataset.dataset if isinstance(dataset, CachedDataset) else dataset,
                             decode=False)
    if source is not None:
        why = target_reader(source)[1] or ("batch_size=None (DALI works on batches)" if unbatched else "")
    if backend == "auto":
        return dali_available() and not why
    require_dali()
    if why:
        raise TypeError(f"backend='dali' cannot load {type(dataset).__name__}: {why}")
    return True


class DataLoader(torch.utils.data.DataLoader):
    """Drop-in ``torch.utils.data.DataLoader`` that caches raw sample bytes node-wide (MinIO policy).

    Takes every argument of torch's DataLoader, positionally in torch's order, with the same meaning
    and defaults. Datasets whose samples are files (torchvision ``DatasetFolder``/``ImageFolder``,
    :class:`coordl.FileDataset`, or any :class:`coordl.RawBytesDataset`) have their raw bytes read
    through a shared-memory cache that every worker, local rank and job on this machine reading the
    same dataset shares; decoding and transforms still run per sample, so augmentation is fresh each
    epoch. Other datasets work as with torch, uncached (coordl says so once).

    Args:
        cache_bytes: size of the cache. An int (numpy integers too), a string such as ``"8GiB"``,
            ``"auto"`` or 0 (off); a fraction of a byte (``"0.5"``) is refused, a fraction of a larger
            unit rounded down. ``"auto"`` takes the least of the dataset's size, 50% of available
            memory and 90% of free /dev/shm. Defaults to ``"auto"``.
        cache_name: name under which jobs share a cache. Defaults to None: the cache is named by
            the dataset's fingerprint (see ``cache_verify``), so jobs reading the same files share it.
        cache_verify: how a cache is matched to the dataset's files. Its fingerprint holds each
            file's resolved absolute path, size and, with ``"stat"``, mtime: an edit that keeps a
            file's size and mtime (``touch -r``, a copy that preserves mtimes) goes unnoticed and the
            cache serves the old bytes. ``"content"`` hashes each file's bytes instead of its mtime,
            which reads the whole dataset when the loader is built (slow for large datasets).
            Defaults to ``"stat"``.
        drop_page_cache: after reading a miss from storage, drop its pages from the OS page cache
            so that memory stays the MinIO cache's. Defaults to None: on while the cache is on.
        progress: show a tqdm progress bar per epoch. Defaults to False.
        backend: who decodes and augments. ``"torch"``: the dataset's own code in torch's worker
            processes. ``"dali"``: a DALI pipeline (``dali_pipeline``) fed with the raw bytes from
            the same cache; it replaces the dataset's transforms and yields the pipeline's outputs.
            ``"auto"``: DALI when it is installed and can read the dataset, else torch.
            Defaults to ``"torch"``.
        dali_pipeline: ``"image_classification"``, ``"object_detection"``, ``"audio_classification"``
            or a function ``(encoded, target, *, device, train) -> outputs`` building a DALI graph
            (see :mod:`coordl.dali_presets`). Defaults to ``"image_classification"``.
        dali_device: ``"cpu"`` or ``"gpu"`` (GPU decoding; outputs on the GPU). Defaults to ``"cpu"``.
        dali_train: use the preset's training augmentation rather than its eval transform.
            Defaults to None: training when the loader shuffles.
        hp_group: name of a hyperparameter-search group to coordinate prep with: jobs on this machine
            that pass the same name share one epoch plan, each prepares only its share of the
            minibatches, and every job gets every minibatch (the same augmented batches in every job).
            Jobs must agree on the dataset, its transforms, ``collate_fn`` (or DALI pipeline) and
            batch settings; transforms and functions are compared by what defines them (code,
            constants, defaults, closures, attributes). Needs shuffle=True/False (no custom sampler).
            Defaults to None (off).
        hp_group_size: jobs the group's first epoch waits for (up to ``hp_group_timeout_s``), so
            that jobs started together are coordinated from their first batch. Defaults to None.
        hp_staging_bytes: capacity of the group's staging area in /dev/shm, set by the group's first
            job. ``"auto"`` takes the least of 4 GiB, 25% of free /dev/shm and 25% of available memory.
            Defaults to ``"auto"``.
        hp_group_timeout_s: how long the first epoch waits for ``hp_group_size`` jobs, how long an
            epoch waits for a job that finished the previous one (it joins the next epoch if late),
            and after how long waiting on a live job is logged. Dead jobs are detected within a
            second. Defaults to 60.
        hp_group_on_mismatch: ``"raise"`` refuses to join a group whose jobs use other data
            settings (`GroupMismatchError` names them); ``"uncoordinated"`` warns and loads on its own.
            Defaults to ``"raise"``.
        hp_group_key: a name that stands for the transforms, ``collate_fn`` and DALI pipeline
            function among the settings jobs must agree on, for those that cannot be compared (an
            error says so) or should not be: jobs with equal keys share batches whatever those are.
            The dataset and batch settings are still compared. Defaults to None: compare them.

    Example::

        loader = coordl.DataLoader(ImageFolder(root, transform=train_tf), batch_size=256,
                                   shuffle=True, num_workers=8, pin_memory=True)
        for images, labels in loader: ...
        print(loader.stats().epochs[-1])
    """

    def __init__(self, dataset, batch_size=1, shuffle=None, sampler=None, batch_sampler=None, num_workers=0,
                 collate_fn=None, pin_memory=False, drop_last=False, timeout=0, worker_init_fn=None,
                 multiprocessing_context=None, generator=None, *, prefetch_factor=None, persistent_workers=False,
                 pin_memory_device="", in_order=True, cache_bytes="auto", cache_name=None, cache_verify="stat",
                 drop_page_cache=None, progress=False, backend="torch", dali_pipeline="image_classification",
                 dali_device="cpu", dali_train=None, hp_group=None, hp_group_size=None, hp_staging_bytes="auto",
                 hp_group_timeout_s=DEFAULT_GROUP_TIMEOUT_S, hp_group_on_mismatch="raise", hp_group_key=None):
        configure_from_env()
        capacity = parse_size_option("cache_bytes", cache_bytes, allow_zero=True)
        if cache_verify not in CACHE_VERIFY:
            raise ValueError(f"cache_verify should be one of {CACHE_VERIFY}, but got cache_verify={cache_verify!r}")
        use_dali = _use_dali(backend, dataset, batch_size, batch_sampler)
        staging_bytes = None
        if hp_group is not None:
            staging_bytes = check_group_options(hp_group, hp_group_size, hp_staging_bytes, hp_group_timeout_s,
                                                hp_group_on_mismatch, hp_group_key)
            check_group_compatible(dataset, sampler, batch_sampler, batch_size, in_order)
            if use_dali and dali_device != "cpu":
                raise ValueError(f"hp_group with backend='dali' needs dali_device='cpu', but got "
                                 f"dali_device={dali_device!r}: the group stages its batches in host shared memory")
        if cache_name is not None and (not isinstance(cache_name, str) or not cache_name):
            raise ValueError(f"cache_name should be a non-empty string or None, but got cache_name={cache_name!r}")
        self.cache_bytes = cache_bytes
        self.cache_name = cache_name
        self.cache_verify = cache_verify
        self.drop_page_cache = drop_page_cache
        self.progress = progress
        self.backend, self.dali_pipeline, self.dali_device, self.dali_train = \
            backend, dali_pipeline, dali_device, dali_train
        self._epochs: list[EpochStats] = []
        self._current: tuple | None = None  # (epoch, counters, their totals at its start, start time, group counters)
        self._last_pass = None  # weakref to torch's iterator of the latest pass
        self._last_cache_stats = None
        self.hp_group, self.hp_group_size, self.hp_staging_bytes = hp_group, hp_group_size, hp_staging_bytes
        self.hp_group_timeout_s, self.hp_group_on_mismatch = hp_group_timeout_s, hp_group_on_mismatch
        self.hp_group_key = hp_group_key
        self._group = self._share = self._coordinated = self._last_group_stats = None
        wrapped = self._wrap(dataset, capacity, num_workers, decode=not use_dali)
        self._dali = None
        if use_dali:
            from coordl.dali_pipeline import DaliBackend
            self._dali = DaliBackend(
                wrapped, pipeline=dali_pipeline, device=dali_device,
                train=bool(shuffle or sampler is not None) if dali_train is None else bool(dali_train),
                batch_size=batch_size or 1, fetch_threads=max(num_workers, 1), dali_threads=max(num_workers, 1),
                prefetch_batches=(prefetch_factor or 2) * max(num_workers, 1), pin_memory=pin_memory)
        super().__init__(
            wrapped, batch_size, shuffle, sampler, batch_sampler, num_workers,
            collate_fn, pin_memory, drop_last, timeout, worker_init_fn, multiprocessing_context, generator,
            prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device, in_order=in_order)
        if hp_group is not None:
            self._group = self._join_group(staging_bytes)

    def _wrap(self, dataset, capacity: int | None, num_workers: int, decode: bool):
        """The dataset torch will see: the user's dataset behind coordl's fetch path."""
        fingerprint = None
        if isinstance(dataset, CachedDataset):  # re-created from another coordl loader's attributes
            fingerprint, dataset = dataset.fingerprint, dataset.dataset
        source, why = raw_source(dataset, decode=decode)
        if source is None:
            warnings.warn(f"coordl cannot cache {type(dataset).__name__}: {why}. It is loaded uncached, as torch "
                          f"would. Implement coordl.RawBytesDataset to cache it.", stacklevel=3)
            if isinstance(dataset, torch.utils.data.IterableDataset):
                return dataset
        cache = None
        if source is not None and capacity != 0:
            if fingerprint is None:
                fingerprint = fingerprint_files([source.raw_key(i) for i in range(len(source))],
                                                content=self.cache_verify == "content")
            cache = self._open_cache(source, fingerprint, capacity)
        drop = cache is not None if self.drop_page_cache is None else bool(self.drop_page_cache)
        return CachedDataset(dataset, source, cache, FileStorage(drop_page_cache=drop),
                             SampleCounters(num_workers + 1), fingerprint)

    def _open_cache(self, source, fingerprint: tuple[bytes, int], capacity: int | None) -> MinIOCache | None:
        digest, dataset_bytes = fingerprint
        preallocate, keep = capacity is not None, 0
        if capacity is None:
            capacity, keep = _auto_capacity(dataset_bytes, len(source))
            if capacity == 0:
                warnings.warn(f"coordl: {shm_dir()} has no room for a cache of this dataset ({format_bytes(free_shm_bytes())} "
                              f"free, {format_bytes(index_bytes(len(source)))} needed for its index alone), so it loads "
                              f"uncached. Enlarge it (docker: --shm-size) or pass cache_bytes=0 to silence this.",
                              stacklevel=4)
                return None
        elif capacity > dataset_bytes:
            logger.info("cache_bytes=%s exceeds the dataset (%s): using %s.", self.cache_bytes,
                        format_bytes(dataset_bytes), format_bytes(dataset_bytes))
            capacity = dataset_bytes
        if capacity == 0:
            return None
        root = getattr(source, "dataset", source)
        where = getattr(root, "root", None) or os.path.dirname(source.raw_key(0))  # not empty: capacity > 0
        label = f"{self.cache_name or getpass.getuser()}: {len(source)} files in {where}"
        cache = MinIOCache(cache_segment_name(self.cache_name or digest.hex()), n_items=len(source),
                           capacity_bytes=capacity, fingerprint=digest, label=label, preallocate=preallocate,
                           keep_free_bytes=keep)
        cache.stats()  # attach now: fail early on a full /dev/shm, and keep the cache alive for workers
        return cache

    def _join_group(self, staging_bytes: int | None) -> HPGroup | None:
        """Join hp_group (see coord_prep); None if it runs other settings and the user accepts that."""
        n_items = len(self.dataset)
        n_batches = n_items // self.batch_size if self.drop_last else math.ceil(n_items / self.batch_size)
        seed = self.generator.initial_seed() & (2**63 - 1) if self.generator is not None else None
        config = group_settings(self.dataset, batch_size=self.batch_size, drop_last=self.drop_last,
                                shuffle=self._share_shuffled(), seed=seed, collate_fn=self.collate_fn, dali=self._dali,
                                key=self.hp_group_key, content=self.cache_verify == "content")
        group = HPGroup(self.hp_group, config=config, n_batches=n_batches, seed=seed,
                        staging_bytes=staging_bytes or auto_staging_bytes(), expected_members=self.hp_group_size,
                        timeout_s=float(self.hp_group_timeout_s))
        try:
            group.join()
        except GroupMismatchError as e:
            if self.hp_group_on_mismatch == "raise":
                raise
            warnings.warn(f"{e} Running uncoordinated, as hp_group_on_mismatch='uncoordinated' asks.", stacklevel=3)
            return None
        self._share = _ShareSampler()
        return group

    @property
    def _index_sampler(self):
        """What torch's iterator draws batches from: in an hp_group, this job's share of the epoch."""
        share = self.__dict__.get("_share")
        return share if share is not None else super()._index_sampler

    def __len__(self) -> int:
        if self.__dict__.get("_group") is not None:
            return self._group.n_batches
        return super().__len__()

    # -- iteration and bookkeeping ---------------------------------------------------------

    def __iter__(self):
        self._end_epoch(complete=False)  # the previous pass was abandoned midway
        self._stop_coordinated()
        epoch = EpochStats(epoch=len(self._epochs) + 1, group=self.hp_group if self._group is not None else None)
        counters = self._pass_counters()
        started = time.perf_counter()
        group_counters = GroupCounters() if self._group is not None else None
        self._current = (epoch, counters, counters.totals() if counters else {}, started, group_counters)
        if self._dali is not None and self._group is None:
            return _EpochIterator(self, self._dali_epoch(), epoch, counters)
        if self._group is None:
            inner = super().__iter__()
            self._last_pass = weakref.ref(inner)
            return _EpochIterator(self, inner, epoch, counters)
        ticket = self._group.start_epoch()
        try:
            epoch.stall_s += time.perf_counter() - started  # waiting for the group's epoch to start
            group_counters.members = ticket.members
            plan = epoch_plan(len(self.dataset), self.batch_size, self.drop_last, self._share_shuffled(),
                              self._group.seed, ticket.epoch)
            generation, mine = self._group.share_of_mine()  # read once: the producer must pair the same ids
            self._share.batches = [plan[b] for b in mine]
            if self._dali is not None:  # this job's share through its DALI pipeline, takeovers through twins
                seed = torch.empty((), dtype=torch.int64).random_(generator=self.generator).item()
                share = self._dali.epoch(self._share.batches, seed)
                prepare = functools.partial(_prepare_dali_batches, self._dali, seed)
            else:
                share = super().__iter__()
                self._last_pass = weakref.ref(share)
                prepare = functools.partial(_prepare_batches, self.dataset, self.collate_fn)
            coordinated = CoordinatedEpoch(self._group, ticket, plan, share, mine, generation, prepare, group_counters,
                                           pin_memory=self.pin_memory and torch.cuda.is_available(),
                                           ahead=max(2, self.num_workers * (self.prefetch_factor or 2)))
        except BaseException:
            self._group.leave_epoch()  # the others take over this job's share
            raise
        self._coordinated = weakref.ref(coordinated)
        return _EpochIterator(self, coordinated, epoch, counters)

    def _keep_room_for(self, batch) -> None:
        """Once: make a growing cache leave room in /dev/shm for torch's worker-to-main batches, measured
        from this first batch (workers x prefetch_factor batches in flight)."""
        cache = getattr(self.dataset, "cache", None)
        if self.__dict__.get("_room_kept") or cache is None or cache.preallocate or not self.num_workers:
            return
        self._room_kept = True
        in_flight = self.num_workers * (self.prefetch_factor or 2) * _tensor_bytes(batch)
        cache.keep_free(cache.keep_free_bytes + in_flight)
        logger.info("keeping %s of %s free for torch's in-flight batches (%d workers x %d x %s)",
                    format_bytes(in_flight), shm_dir(), self.num_workers, self.prefetch_factor or 2,
                    format_bytes(_tensor_bytes(batch)))

    def _share_shuffled(self) -> bool:
        return isinstance(self.sampler, torch.utils.data.RandomSampler)

    def _stop_coordinated(self) -> None:
        """Stop the latest group epoch's producer (leaving the epoch if it was abandoned midway)."""
        coordinated = self._coordinated() if self._coordinated is not None else None
        if coordinated is not None:
            coordinated.close()
            if coordinated.producer_running and self._dali is not None:
                # Still inside its pipeline past the join timeout: leave that pipeline to it, use a new one.
                self._dali = self._dali.twin()
        self._coordinated = None

    def _dali_epoch(self):
        """This epoch's plan, drawn as torch's iterator draws it (same order for the same generator),
        handed to the DALI pipeline."""
        sampler_iter = iter(self._index_sampler)
        seed = torch.empty((), dtype=torch.int64).random_(generator=self.generator).item()
        return self._dali.epoch([list(batch) for batch in sampler_iter], seed)

    def _pass_counters(self) -> SampleCounters | None:
        """The counters the coming pass's fetches land in.

        A pass that starts its own workers (or fetches in-process) gets a fresh table, so samples
        that an abandoned earlier pass's workers still prefetch are never counted in this one.
        Persistent workers keep the table they were started with; their passes are told apart
        by differences.
        """
        dataset = self.dataset
        if not isinstance(dataset, CachedDataset):
            return None
        if self.num_workers == 0 or not self.persistent_workers or self._iterator is None:
            dataset.counters = SampleCounters(self.num_workers + 1)
        return dataset.counters

    @staticmethod
    def _fill_counts(epoch: EpochStats, counters: SampleCounters | None, start: dict,
                     group: GroupCounters | None) -> None:
        if counters is not None:
            for field, value in counters.totals().items():
                setattr(epoch, field, value - start[field])
        epoch.decoded = epoch.samples
        if group is not None:
            epoch.members, epoch.samples = group.members, group.delivered_samples
            epoch.prepared, epoch.shared, epoch.staging_wait_s = group.prepared, group.shared, group.staging_wait_s

    def _end_epoch(self, complete: bool) -> None:
        if self._current is None:
            return
        epoch, counters, start, started, group = self._current
        self._current = None
        self._fill_counts(epoch, counters, start, group)
        epoch.complete = complete
        epoch.time_s = time.perf_counter() - started
        self._epochs.append(epoch)
        summary_logger.info(epoch.summary_line(self._cache_stats()))

    def _cache_stats(self):
        """The cache's fill now, or as it was at close() (reading it must not re-attach)."""
        cache = getattr(self.dataset, "cache", None)
        if cache is not None and cache.attached:
            self._last_cache_stats = cache.stats()
        return self._last_cache_stats

    def _group_stats(self):
        """The group's state now, or as it was at close()."""
        if self._group is not None and self._group.joined:
            self._last_group_stats = self._group.stats()
        return self._last_group_stats

    def stats(self) -> LoaderStats:
        """Counters of every finished epoch (and the one in progress), their total, the cache's fill and,
        in an hp_group, the group's state and staging memory."""
        epochs = list(self._epochs)
        if self._current is not None:
            running, counters, start, started, group = self._current
            running = EpochStats(**{**running.__dict__, "time_s": time.perf_counter() - started})
            self._fill_counts(running, counters, start, group)
            epochs.append(running)
        total = EpochStats(epoch=0, complete=all(e.complete for e in epochs),
                           group=self.hp_group if self._group is not None else None)
        for e in epochs:
            add_epoch(total, e)
        return LoaderStats(epochs=epochs, total=total, cache=self._cache_stats(), group=self._group_stats())

    def close(self) -> None:
        """Stop this loader's workers, leave its hp_group and release its use of the cache. Idempotent.

        The last process using a cache (or group) removes it from /dev/shm. Iterating again re-attaches.
        """
        self._end_epoch(complete=False)
        self._stop_coordinated()
        latest = self._last_pass() if self._last_pass is not None else None
        for iterator in {id(it): it for it in (self._iterator, latest) if it is not None}.values():
            if hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()
        self._iterator = self._last_pass = None
        if self._dali is not None:
            self._dali.close()
        self._cache_stats()
        cache = getattr(self.dataset, "cache", None)
        if cache is not None:
            cache.close()
        if self._group is not None:
            self._group_stats()
            self._group.close()

    def __enter__(self) -> "DataLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _tensor_bytes(batch) -> int:
    """Bytes of the tensors in a collated batch (what torch's workers hand over through shared memory)."""
    if isinstance(batch, torch.Tensor):
        return batch.nbytes
    if isinstance(batch, dict):
        return sum(_tensor_bytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(_tensor_bytes(v) for v in batch)
    return 0


class _ShareSampler:
    """torch's batch sampler in an hp_group: this job's share of the current epoch's batches."""

    def __init__(self):
        self.batches: list[list[int]] = []

    def __iter__(self):
        return iter(list(self.batches))

    def __len__(self) -> int:
        return len(self.batches)


def _prepare_batches(dataset: CachedDataset, collate_fn, batches: list[list[int]]):
    """Batches made in this process (taken over from a failed member), as torch's fetcher makes them."""
    for indices in batches:
        yield collate_fn(dataset.__getitems__(indices))


def _prepare_dali_batches(backend, seed: int, batches: list[list[int]]):
    """Batches taken over from a failed member, through a pipeline of their own (closed when done)."""
    return backend.twin().epoch(batches, seed)


class _EpochIterator:
    """Wraps torch's iterator for one epoch: times the waits, draws the progress bar, closes the epoch."""

    def __init__(self, loader: DataLoader, inner, epoch: EpochStats, counters: SampleCounters | None):
        self._loader, self._inner, self._epoch, self._counters = loader, inner, epoch, counters
        # Frameworks such as Lightning stop after len(loader) batches without asking for one more,
        # so a map-style epoch (whose length is exact) is complete at its last batch.
        self._last_batch = None if isinstance(loader.dataset, torch.utils.data.IterableDataset) else len(inner)
        self._bar = None
        if loader.progress:
            total = len(inner) if hasattr(inner, "__len__") else None
            self._bar = tqdm(total=total, desc=f"coordl epoch {epoch.epoch}", unit="batch", dynamic_ncols=True)

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self._inner)

    def __next__(self):
        started = time.perf_counter()
        try:
            batch = next(self._inner)
        except StopIteration:
            self._epoch.stall_s += time.perf_counter() - started
            self._finish(complete=True)
            raise
        except BaseException:
            self._finish(complete=False)
            raise
        self._epoch.stall_s += time.perf_counter() - started
        self._epoch.batches += 1
        if self._epoch.batches == 1:
            self._loader._keep_room_for(batch)
        if self._bar is not None:
            self._bar.update(1)
            if self._bar.n % 10 == 1 and self._counters is not None:
                totals = self._counters.totals()
                fetched = totals["hits"] + totals["misses"]
                self._bar.set_postfix(stall_s=f"{self._epoch.stall_s:.1f}",
                                      hit=f"{totals['hits'] / fetched:.0%}" if fetched else "-", refresh=False)
        if self._epoch.batches == self._last_batch:
            self._finish(complete=True)
        return batch

    def _finish(self, complete: bool) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._loader._current is not None and self._loader._current[0] is self._epoch:
            self._loader._end_epoch(complete)
