"""``coordl.DataLoader``: torch's DataLoader, reading raw sample bytes through a node-wide MinIO cache.

It is a subclass of ``torch.utils.data.DataLoader`` and a thin shell: it builds the parts a framework
carries over to a plain torch DataLoader (see NOTE [ Behaviour in the carried-over objects ] in
``batch_sampler``) — the dataset behind coordl's fetch path (``cache_setup``), the batch sampler whose
passes are epochs, the collate function — plus, with the DALI backend or in an hp_group, the feed of
prepared batches. Sampling, worker processes, collation, pinning and error reporting are torch's own,
so batches are the ones torch would produce, in the same order, from the same seeds. Its own iterator
adds what only it can see: how long the training loop waits for each batch, and a progress bar.
"""

import logging
import os
import time
import weakref
from typing import TypeVar

import torch.utils.data
from torch.utils.data.dataloader import _BaseDataLoaderIter, _DatasetKind
from tqdm.auto import tqdm

from coordl._cache.setup import CACHE_VERIFY, disk_quota, wrap_dataset
from coordl._disk.tier import VERIFY as DISK_VERIFY
from coordl._core import hooks, settings
from coordl._core.keywords import suggest_keywords
from coordl._core.log import configure_from_env, warn_caller
from coordl._core.settings import DEFAULT_GROUP_TIMEOUT_S
from coordl._core.shm import shm_dir
from coordl._core.sizes import format_bytes, parse_size_option
from coordl._epochs.batch_sampler import EpochBatchSampler, EpochSampler
from coordl._epochs.ledger import EpochLedger
from coordl._fetch.cached_dataset import CachedDataset, CountingCollate, PreparedCollate, SampleCounters
from coordl._fetch.lookahead import lookahead_of
from coordl._fetch.raw_datasets import raw_source
from coordl._group.config import check_group_compatible, check_group_options
from coordl._peer.locality import LocalityPlan, locality_plan
from coordl._rehearsal.batches import RehearsalBatches
from coordl._rehearsal.setup import exemplar_region, stream_batches, stream_of, stream_sampler
from coordl.stats import LoaderStats

logger = logging.getLogger(__name__)
_T_co = TypeVar("_T_co", covariant=True)


def _use_dali(backend, dataset, batch_size, batch_sampler) -> bool:
    """Whether ``backend=`` means the DALI backend for this dataset (checks what can be checked up front)."""
    if backend not in ("torch", "dali", "auto"):
        raise ValueError(f"backend should be 'torch', 'dali' or 'auto', but got backend={backend!r}")
    if backend == "torch":
        return False
    from coordl._dali.pipeline import dali_available, require_dali, target_reader
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


class DataLoader(torch.utils.data.DataLoader[_T_co]):
    """Drop-in ``torch.utils.data.DataLoader`` that caches raw sample bytes node-wide (MinIO policy).

    Takes every argument of torch's DataLoader, positionally in torch's order, with the same meaning
    and defaults. Datasets whose samples are files (torchvision ``DatasetFolder``/``ImageFolder``,
    :class:`coordl.FileDataset`, or any :class:`coordl.RawBytesDataset`) have their raw bytes read
    through a shared-memory cache that every worker, local rank and job on this machine reading the
    same dataset shares; decoding and transforms still run per sample, so augmentation is fresh each
    epoch. Other datasets work as with torch, uncached (coordl says so once).

    Args:
        cache_bytes: size of the cache. An int (numpy integers, and floats that are whole numbers, too), a
            string such as ``"8GiB"``, a share of the memory available now such as ``"50%"``,
            ``"auto"`` or 0 (off); a fraction of a byte (``"0.5"``) is refused, a fraction of a larger
            unit rounded down. Either way the cache is allocated as it fills, never past the dataset.
            ``"auto"`` takes the lesser of 50% of available memory and the free space of /dev/shm
            less the cache's index, and grows only while /dev/shm keeps room for torch's in-flight
            batches and other jobs; an explicit size fails here if /dev/shm has not that much free.
            Defaults to ``"auto"``.
        cache_name: name under which jobs share a cache. Defaults to None: the cache is named by
            the dataset's identity (see ``cache_verify``), so jobs reading the same files share it.
        cache_verify: how a cache is matched to the dataset's files. ``"stat"``: the cache is named by
            the dataset's length and a sample of its files (resolved paths, inodes, ctimes; no other
            file is stat'ed when the loader is built), and each cached sample is served only while
            one ``stat`` of its file matches the file it was cached from: one edited (even with its
            mtime put back), replaced or re-pointed since is read from storage and counted
            ``stale``. ``"content"`` also hashes every file's bytes into the name, which reads the
            whole dataset when the loader is built (slow). With a custom ``storage`` cached samples
            are served unchecked. Defaults to ``"stat"``.
        drop_page_cache: after reading a miss from storage, drop its pages from the OS page cache
            so that memory stays the MinIO cache's. Defaults to None: on while the cache is on.
        storage: where misses are read from: any object with ``read(key) -> bytes`` (keys are what
            the dataset's ``raw_key`` returns). Defaults to None: local files.
        cache_dir: a folder on a local disk for the disk cache tier, which keeps the dataset's raw bytes after
            the job, for the next jobs (and what the memory cache cannot hold): misses of the memory cache
            are read from it before storage, and what is read from storage is written to it behind the
            training loop, once (see ``coordl._disk.tier``). Defaults to None: ``$COORDL_CACHE_DIR``, else no
            disk tier.
        cache_dir_bytes: bytes the disk caches in ``cache_dir`` may take together (an int or a size string
            such as ``"500GiB"``); the least recently used dataset no live job uses is removed when another
            needs room, and a full quota stops the writes. ``"auto"``: grow while the file system keeps 10%
            free. Defaults to ``"auto"``.
        cache_dir_verify: how an item read from the disk cache is checked. ``"checksum"``: its bytes against
            the checksum (xxh3) recorded with it, so a flipped bit is counted ``corrupt`` and read from storage
            instead; ``"none"``: only its header and key (a crash still never serves a torn item: a record is
            committed after its bytes are durable). Defaults to ``"checksum"``.
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
        partitioned: in a job that spans several servers (torchrun), make the servers' caches one
            aggregate cache: a local miss is fetched from the server that caches the item before
            storage (see :mod:`coordl.partitioned`). ``"auto"``: on when torch.distributed's
            environment shows several servers and the cache is on (never with ``hp_group``); ``True``:
            insist (fails without that environment, with ``cache_bytes=0`` or with ``hp_group``);
            ``False``: off. Defaults to ``"auto"``.
        locality_aware: in a partitioned job with a ``DistributedSampler``, keep every global batch as the
            sampler drew it but give each rank the samples its own server caches (balanced so each rank
            still gets ``batch_size``), so little crosses the network (see :mod:`coordl._peer.locality`). The
            all-reduced gradient of each step is unchanged; what changes is which rank computes which
            sample, so per-rank batch contents (and per-rank BatchNorm statistics) differ from torch's.
            Defaults to False.
        rehearsal: over a :class:`coordl.ExperienceStream`, a :class:`coordl.Rehearsal`: each batch of
            ``batch_size`` samples of the current experience gets its replayed exemplars of earlier ones
            (see :mod:`coordl.rehearsal`). Defaults to None: a loader over a stream draws its current
            experience alone.

    ``state_dict()``/``load_state_dict()`` checkpoint the loader mid-epoch, as torchdata's
    ``StatefulDataLoader`` does (see README "Checkpointing mid-epoch" for what is and isn't restored).

    Example::

        loader = coordl.DataLoader(ImageFolder(root, transform=train_tf), batch_size=256,
                                   shuffle=True, num_workers=8, pin_memory=True)
        for images, labels in loader: ...
        print(loader.stats().epochs[-1])
    """

    @suggest_keywords
    def __init__(self, dataset, batch_size=1, shuffle=None, sampler=None, batch_sampler=None, num_workers=0,
                 collate_fn=None, pin_memory=False, drop_last=False, timeout=0, worker_init_fn=None,
                 multiprocessing_context=None, generator=None, *, prefetch_factor=None, persistent_workers=False,
                 pin_memory_device="", in_order=True, cache_bytes="auto", cache_name=None, cache_verify="stat",
                 drop_page_cache=None, storage=None, cache_dir=None, cache_dir_bytes="auto",
                 cache_dir_verify="checksum", progress=False, backend="torch",
                 dali_pipeline="image_classification", dali_device="cpu", dali_train=None, hp_group=None,
                 hp_group_size=None, hp_staging_bytes="auto", hp_group_timeout_s=DEFAULT_GROUP_TIMEOUT_S,
                 hp_group_on_mismatch="raise", hp_group_key=None, partitioned="auto", locality_aware=False,
                 rehearsal=None):
        configure_from_env()
        if isinstance(batch_sampler, EpochBatchSampler) and sampler is None and \
                (batch_sampler.batches is None or isinstance(batch_sampler.batches, LocalityPlan)):
            # A framework re-created coordl's batch sampler around its own sampler (Lightning: a
            # DistributedSampler): what it stands for is a sampler and a batch size, as the user gave them.
            sampler, batch_size, drop_last = batch_sampler.sampler, batch_sampler.batch_size, batch_sampler.drop_last
            batch_sampler, shuffle = None, None
        if isinstance(batch_sampler, EpochBatchSampler) and sampler is None and \
                isinstance(batch_sampler.batches, RehearsalBatches):  # a stream's, re-created from its parts
            batches = batch_sampler.batches
            sampler, batch_size, drop_last = batches.sampler, batches.batch_size, batches.drop_last
            batch_sampler, shuffle, rehearsal = None, None, rehearsal if rehearsal is not None else batches.rehearsal
        stream = stream_of(dataset)
        if stream is not None:
            sampler = stream_sampler(stream, rehearsal=rehearsal, sampler=sampler, batch_sampler=batch_sampler,
                                     batch_size=batch_size, shuffle=shuffle, generator=generator)
            shuffle = None
        elif rehearsal is not None:
            raise ValueError(f"rehearsal= needs a coordl.ExperienceStream as the dataset, but got "
                             f"{type(dataset).__name__}: wrap the experiences, ExperienceStream([task0, task1, ...])")
        capacity = parse_size_option("cache_bytes", cache_bytes, allow_zero=True)
        quota = disk_quota(cache_dir_bytes)
        disk_folder = cache_dir if cache_dir is not None else settings.cache_dir()
        if disk_folder is not None and (not isinstance(disk_folder, (str, os.PathLike)) or not str(disk_folder)):
            raise ValueError(f"cache_dir should be a folder's path or None, but got cache_dir={cache_dir!r}")
        if cache_verify not in CACHE_VERIFY:
            raise ValueError(f"cache_verify should be one of {CACHE_VERIFY}, but got cache_verify={cache_verify!r}")
        if cache_dir_verify not in DISK_VERIFY:
            raise ValueError(f"cache_dir_verify should be one of {DISK_VERIFY}, but got "
                             f"cache_dir_verify={cache_dir_verify!r}")
        use_dali = _use_dali(backend, dataset, batch_size, batch_sampler)
        staging_bytes = None
        if hp_group is not None:
            staging_bytes = check_group_options(hp_group, hp_group_size, hp_staging_bytes, hp_group_timeout_s,
                                                hp_group_on_mismatch, hp_group_key)
            check_group_compatible(dataset, sampler, batch_sampler, batch_size, in_order)
            if use_dali and dali_device != "cpu":
                raise ValueError(f"hp_group with backend='dali' needs dali_device='cpu', but got "
                                 f"dali_device={dali_device!r}: the group stages its batches in host shared memory")
            if partitioned is True:
                raise ValueError("hp_group cannot be combined with partitioned=True: an hp_group's jobs share one "
                                 "server's memory, and a partitioned job spans servers with a DistributedSampler, "
                                 "which an hp_group refuses. Leave partitioned='auto' (off in an hp_group).")
        if not isinstance(locality_aware, bool):
            raise ValueError(f"locality_aware should be True or False, but got locality_aware={locality_aware!r}")
        if cache_name is not None and (not isinstance(cache_name, str) or not cache_name):
            raise ValueError(f"cache_name should be a non-empty string or None, but got cache_name={cache_name!r}")
        if backend == "torch":
            _warn_unused_dali_options(dali_pipeline, dali_device, dali_train)
        self.cache_bytes, self.cache_name, self.cache_verify = cache_bytes, cache_name, cache_verify
        self.drop_page_cache, self.storage, self.progress = drop_page_cache, storage, progress
        self.cache_dir, self.cache_dir_bytes, self.cache_dir_verify = cache_dir, cache_dir_bytes, cache_dir_verify
        self.backend, self.dali_pipeline, self.dali_device, self.dali_train = \
            backend, dali_pipeline, dali_device, dali_train
        self.hp_group, self.hp_group_size, self.hp_staging_bytes = hp_group, hp_group_size, hp_staging_bytes
        self.hp_group_timeout_s, self.hp_group_on_mismatch = hp_group_timeout_s, hp_group_on_mismatch
        self.hp_group_key, self.partitioned, self.locality_aware = hp_group_key, partitioned, locality_aware
        self.rehearsal = rehearsal
        wrapped = wrap_dataset(dataset, capacity=capacity, cache_name=cache_name,
                               cache_verify=cache_verify, drop_page_cache=drop_page_cache, num_workers=num_workers,
                               decode=not use_dali, storage=storage,
                               cache_dir=None if disk_folder is None else os.fspath(disk_folder), cache_dir_bytes=quota,
                               cache_dir_verify=cache_dir_verify,
                               partitioned=False if hp_group is not None and partitioned == "auto" else partitioned)
        dali = None
        if use_dali:
            from coordl._dali.pipeline import DaliBackend
            dali = DaliBackend(
                wrapped, pipeline=dali_pipeline, device=dali_device,
                train=bool(shuffle or sampler is not None) if dali_train is None else bool(dali_train),
                batch_size=(batch_size or getattr(batch_sampler, "batch_size", None) or 1) +  # the largest batch
                (rehearsal.replayed_per_batch(batch_size) if stream is not None and rehearsal is not None else 0),
                fetch_threads=max(num_workers, 1), dali_threads=max(num_workers, 1),
                prefetch_batches=(prefetch_factor or 2) * max(num_workers, 1), pin_memory=pin_memory)
        fed = dali is not None or hp_group is not None
        prep_options = dict(num_workers=num_workers, timeout=timeout, worker_init_fn=worker_init_fn,
                            multiprocessing_context=multiprocessing_context, generator=generator,
                            prefetch_factor=prefetch_factor, persistent_workers=persistent_workers)
        if fed:  # the feed prepares batches with these workers; torch's own loop runs in this process
            num_workers, timeout, worker_init_fn, multiprocessing_context = 0, 0, None, None
            prefetch_factor, persistent_workers = None, False
        try:
            super().__init__(
                wrapped, batch_size, shuffle, sampler, batch_sampler, num_workers,
                # DALI's own batches are pinned by its feed, or on the GPU; an hp_group's are staged: torch pins them
                collate_fn, pin_memory and (dali is None or hp_group is not None),
                drop_last, timeout, worker_init_fn, multiprocessing_context, generator,
                prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                pin_memory_device=pin_memory_device, in_order=in_order)
        except BaseException:  # torch refused an argument: its error, with the cache given back now, not at gc
            _release(wrapped)
            raise
        plan = None
        try:
            if locality_aware:
                plan = locality_plan(self.sampler, self.batch_size, self.drop_last, getattr(wrapped, "peers", None),
                                     batch_sampler is not None)
            if stream is not None:
                plan = stream_batches(self.batch_sampler, rehearsal)
                exemplar_region(rehearsal, stream, wrapped, plan)
        except BaseException:
            _release(wrapped)
            raise
        feed = self._feed(dali, staging_bytes, prep_options) if fed else None
        group = hp_group if getattr(feed, "group", None) is not None else None
        self._cache_stats = _CacheFill(wrapped)  # not a bound method: the ledger must not keep this loader alive
        if isinstance(wrapped, torch.utils.data.IterableDataset) and feed is None:
            user_collate = self.collate_fn.collate_fn if isinstance(self.collate_fn, CountingCollate) else \
                self.collate_fn  # re-created from a coordl loader's parts
            object.__setattr__(self, "collate_fn", CountingCollate(user_collate, SampleCounters(num_workers + 1),
                                                                   batched=self._auto_collation))
        self._install(EpochLedger(wrapped, feed, group=group, cache_stats=self._cache_stats,
                                  collate=self.collate_fn, lookahead=lookahead_of(wrapped)), plan)
        self.epoch_ledger.follow_earlier_over(dataset.dataset if isinstance(dataset, CachedDataset) else dataset)
        hooks.loader_built(self)

    def _feed(self, dali, staging_bytes, prep_options: dict):
        """The feed of prepared batches: the group's (hp_group), else the DALI pipeline's."""
        user_collate = self.collate_fn
        if self.hp_group is not None:
            from coordl._group.feed import GroupFeed, join_group
            group = join_group(self.hp_group, self.dataset, batch_size=self.batch_size, drop_last=self.drop_last,
                               shuffled=self._shuffled(), generator=self.generator, collate_fn=user_collate,
                               dali=dali, size=self.hp_group_size, staging_bytes=staging_bytes,
                               timeout_s=self.hp_group_timeout_s, on_mismatch=self.hp_group_on_mismatch,
                               key=self.hp_group_key, content=self.cache_verify == "content")
            if group is not None:
                return GroupFeed(group, self.dataset, batch_size=self.batch_size, drop_last=self.drop_last,
                                 shuffled=self._shuffled(), collate_fn=user_collate, loader_options=prep_options,
                                 dali=dali)
            if dali is None:  # running uncoordinated, on torch's own workers after all
                return None
        from coordl._dali.pipeline import DaliFeed
        return DaliFeed(dali)

    def _install(self, ledger: EpochLedger, locality=None) -> None:
        """Hand torch coordl's batch sampler (or sampler, unbatched) and, with a feed, collate function;
        ``locality``: the batches to draw instead of torch's (``locality.LocalityPlan``, or an experience
        stream's ``RehearsalBatches``)."""
        self.epoch_ledger = ledger
        ledger.stream_batches = locality if isinstance(locality, RehearsalBatches) else None
        if ledger.feed is not None:
            self.dataset.feed = ledger
            object.__setattr__(self, "collate_fn", PreparedCollate(self.collate_fn))
        bs, generator = self.batch_sampler, self.generator
        if bs is None:
            object.__setattr__(self, "sampler", EpochSampler(self.sampler, ledger, generator=generator))
        elif isinstance(bs, torch.utils.data.BatchSampler) and type(bs) is torch.utils.data.BatchSampler:
            object.__setattr__(self, "batch_sampler", EpochBatchSampler(bs.sampler, bs.batch_size, bs.drop_last,
                                                                        epochs=ledger, generator=generator,
                                                                        batches=locality))
        else:  # the user's own batch sampler: drawn as it is
            object.__setattr__(self, "batch_sampler", EpochBatchSampler(
                getattr(bs, "sampler", self.sampler), getattr(bs, "batch_size", None),
                getattr(bs, "drop_last", False), epochs=ledger, batches=bs, generator=generator))

    def _shuffled(self) -> bool:
        return isinstance(self.sampler, torch.utils.data.RandomSampler)

    # -- iteration and bookkeeping ---------------------------------------------------------

    def __iter__(self):
        return hooks.epoch(self, self._epoch_iterator)

    def __getstate__(self) -> dict:
        """Pickled as torch's DataLoader is (Lightning's ``ddp_spawn``, ``mp.spawn``, ``torch.save``), without
        the pass of this process's iterator (a weak reference)."""
        state = self.__dict__.copy()
        state["_last_pass"] = None
        return state

    def _epoch_iterator(self) -> "_EpochIterator":
        self._fresh_counters()
        inner = super().__iter__()
        self._last_pass = weakref.ref(inner)
        return _EpochIterator(self, inner)

    def state_dict(self) -> dict:
        """This loader's position, for a checkpoint: the batches of the epoch in progress the training loop
        has had, and what its order was drawn from (see README "Checkpointing mid-epoch")."""
        latest = self.__dict__.get("_last_pass")
        inner, index_sampler = latest() if latest is not None else None, self._index_sampler
        ours = inner is not None and index_sampler.latest is not None and inner._sampler_iter is index_sampler.latest
        state = index_sampler.resume_state(inner._num_yielded if ours else None)
        running = self.epoch_ledger.current
        if ours and self._dataset_kind == _DatasetKind.Iterable and running is not None \
                and running.owner is index_sampler.latest:
            state["iterable_batches"] = inner._num_yielded
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state`` (from :meth:`state_dict`, in this or another process): the next pass yields
        the rest of the saved epoch, then the following epochs, as the saved loader would have. ``{}``
        changes nothing."""
        if state == {}:
            return
        if state.get("iterable_batches"):
            raise ValueError(f"load_state_dict: this state was saved {state['iterable_batches']} batches into an epoch "
                             f"of an IterableDataset ({type(self.dataset).__name__}), whose position is its own "
                             f"iterator's; coordl resumes map-style datasets mid-epoch, iterable ones at epoch "
                             f"boundaries (save after an epoch ends).")
        self._index_sampler.load_state_dict(state)

    def _fresh_counters(self) -> None:
        """A pass that starts its own workers (or fetches in-process) counts in a fresh table, so samples
        that an abandoned earlier pass's workers still prefetch never count in this one. Persistent
        workers keep the table they were started with; their passes are told apart by differences."""
        holder = self.dataset if isinstance(self.dataset, CachedDataset) else self.collate_fn
        if not isinstance(holder, (CachedDataset, CountingCollate)) or self.epoch_ledger.feed is not None:
            return
        if self.num_workers == 0 or not self.persistent_workers or self._iterator is None:
            holder.counters = SampleCounters(len(holder.counters.table))  # its rows (the look-ahead's too)

    def _keep_room_for(self, batch) -> None:
        """Once: make a growing cache leave room in /dev/shm for torch's worker-to-main batches, measured
        from this first batch (workers x prefetch_factor batches in flight)."""
        cache = getattr(self.dataset, "cache", None)
        if self.__dict__.get("_room_kept") or cache is None or cache.require_capacity or not self.num_workers:
            return
        self._room_kept = True
        in_flight = self.num_workers * (self.prefetch_factor or 2) * _tensor_bytes(batch)
        cache.keep_free(cache.keep_free_bytes + in_flight)
        logger.info("keeping %s of %s free for torch's in-flight batches (%d workers x %d x %s)",
                    format_bytes(in_flight), shm_dir(), self.num_workers, self.prefetch_factor or 2,
                    format_bytes(_tensor_bytes(batch)))

    def stats(self) -> LoaderStats:
        """Counters of every finished epoch (and the one in progress), their total, the cache's fill and,
        in an hp_group, the group's state and staging memory. Kept also when a framework iterates a
        DataLoader built from this loader's parts."""
        return self.epoch_ledger.stats()

    def close(self) -> None:
        """Stop this loader's workers, leave its hp_group and release its use of the cache. Idempotent.

        The last process using a cache (or group) removes it from /dev/shm. Iterating again re-attaches.
        """
        self.epoch_ledger.end(complete=False)
        latest = self.__dict__.get("_last_pass")
        for iterator in {id(it): it for it in (self._iterator, latest and latest()) if it is not None}.values():
            if hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()
        self._iterator = self._last_pass = None
        self.epoch_ledger.close_reads()
        if self.epoch_ledger.feed is not None:
            self.epoch_ledger.stats()  # keep the group's last state
            self.epoch_ledger.feed.close()
        self._cache_stats()
        _release(self.dataset)

    def __enter__(self) -> "DataLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _warn_unused_dali_options(pipeline, device, train) -> None:
    given = [f"{name}={value!r}" for name, value, default in (("dali_pipeline", pipeline, "image_classification"),
                                                              ("dali_device", device, "cpu"),
                                                              ("dali_train", train, None)) if value != default]
    if given:
        warn_caller(f"{', '.join(given)} only apply with backend='dali' (or 'auto'); backend='torch' ignores them.")


def _release(dataset) -> None:
    """Stop the peer server this loader started (partitioned) and give up its use of the caches."""
    if getattr(dataset, "peers", None) is not None:
        dataset.peers.close()
    if isinstance(dataset, CachedDataset):
        dataset._release()


class _CacheFill:
    """Called, the fill of ``dataset``'s cache now, or as it was when last read attached (at close(): reading
    it must not re-attach), or None without a cache. A class, not a closure, so that the loader pickles
    (Lightning's ``ddp_spawn``, ``mp.spawn``)."""

    def __init__(self, dataset):
        self.dataset, self.last = dataset, None

    def __call__(self):
        cache = getattr(self.dataset, "cache", None)
        if cache is not None and cache.attached:
            self.last = cache.stats()
        return self.last


def _tensor_bytes(batch) -> int:
    """Bytes of the tensors in a collated batch (what torch's workers hand over through shared memory)."""
    if isinstance(batch, torch.Tensor):
        return batch.nbytes
    if isinstance(batch, dict):
        return sum(_tensor_bytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(_tensor_bytes(v) for v in batch)
    return 0


class _EpochIterator(_BaseDataLoaderIter):
    """coordl's own iterator over one pass of torch's: times the training loop's waits, draws the progress
    bar, and ends the epoch at its last batch. Anything else is torch's iterator's (``_workers``, ...). It is a
    ``_BaseDataLoaderIter``, as torch's iterators are, for code that checks the type; torch's state is the
    inner iterator's, so the base class's ``__init__`` never runs and its methods go to the inner one."""

    def __init__(self, loader: DataLoader, inner):
        self._loader, self._inner = loader, inner
        self._running = None
        # Frameworks such as Lightning stop after len(loader) batches without asking for one more,
        # so a map-style epoch (whose length is exact) is complete at its last batch.
        current = loader._index_sampler.latest  # a resumed pass skips the batches consumed before its checkpoint
        if current is not None:
            current.timed = True  # its plan may run out, fetched ahead, before the loop has its first batch
        self._last_batch = None if isinstance(loader.dataset, torch.utils.data.IterableDataset) else \
            len(inner) - (current.skipped if current is not None else 0)
        self._delivered = 0
        self._bar = None
        if loader.progress:  # no total for an IterableDataset: len(loader) may fail, and alters torch's warnings
            self._bar = tqdm(total=self._last_batch, desc=f"coordl epoch {len(loader.epoch_ledger.epochs) + 1}",
                             unit="batch", dynamic_ncols=True)

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str):
        if name.startswith("__") or "_inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self._inner, name)

    def _reset(self, loader, first_iter: bool = False) -> None:
        self._inner._reset(loader, first_iter)

    def _next_index(self):
        return self._inner._next_index()

    def _next_data(self):
        return self._inner._next_data()

    def __next__(self):
        ledger = self._loader.epoch_ledger
        started = time.perf_counter()
        try:
            batch = next(self._inner)
        except StopIteration:
            self._stalled(ledger, time.perf_counter() - started)
            self._finish(complete=True)
            raise
        except BaseException:
            self._finish(complete=False)
            raise
        self._stalled(ledger, time.perf_counter() - started)
        self._delivered += 1
        if self._running is not None:
            self._running.delivered += 1
        if self._delivered == 1:
            self._loader._keep_room_for(batch)
        if self._bar is not None:
            self._bar.update(1)
            running = self._running
            if self._bar.n % 10 == 1 and running is not None and running.counters is not None:
                totals = running.counters.totals()
                hits, fetched = totals["hits"] - running.start["hits"], totals["hits"] + totals["misses"] - \
                    running.start["hits"] - running.start["misses"]
                self._bar.set_postfix(stall_s=f"{running.epoch.stall_s:.1f}",
                                      hit=f"{hits / fetched:.0%}" if fetched else "-", refresh=False)
        if self._delivered == self._last_batch:
            self._finish(complete=True)
        return batch

    def _stalled(self, ledger: EpochLedger, seconds: float) -> None:
        """Count a wait in this pass's epoch (which the first ``next`` started)."""
        if self._running is None and ledger.current is not None and not ledger.current.timed:
            self._running = ledger.current
            self._running.timed = True
            self._running.epoch.stall_s = 0.0  # this iterator times every wait of the pass, the first included
        if self._running is not None:
            self._running.epoch.stall_s += seconds

    def _finish(self, complete: bool) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._running is not None:
            self._loader.epoch_ledger.end(complete, self._running)
