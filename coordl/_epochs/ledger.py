"""A loader's epochs: when each starts and ends, what it did, and the feed of prepared batches it runs.

Driven by the batch sampler's passes (see NOTE [ Behaviour in the carried-over objects ] in
``batch_sampler``), so it keeps its books whether ``coordl.DataLoader`` iterates or a framework's plain
torch DataLoader built from the loader's parts does. ``coordl.DataLoader``'s own iterator adds what only
it can see: the time the training loop waits for each batch.

NOTE [ Feeds ]
With the DALI backend or in an hp_group, batches are not made by torch's fetcher from samples: a
*feed* prepares whole batches (a DALI pipeline; the group's producer and staging area) in the training
process. At the start of a pass the feed gets torch's plan (and may replace it: a group's plan is the
group's); the dataset proxy's ``__getitems__(indices)`` then takes the feed's next batch, checks it is
the one planned, and hands it to torch wrapped in :class:`~coordl._fetch.cached_dataset.PreparedBatch`, which
the loader's collate function unwraps. A feed protocol: ``begin(batches, ahead) -> plan`` (``ahead``: a
function returning the next pass's plan drawn ahead, or None; see NOTE [ Planning ahead ] in
``batch_sampler``), ``take(indices)``, ``end(complete)``, ``counters`` (a ``GroupCounters`` or None),
``stats()`` (group state or None), ``close()``.
"""

import logging
import time
import weakref

from coordl._fetch.cached_dataset import CachedDataset, CountingCollate
from coordl._fetch.concurrent_misses import reads_concurrently
from coordl._rehearsal.stream import Replayed
from coordl.stats import EpochStats, LoaderStats, add_epoch

summary_logger = logging.getLogger("coordl")
_OVER: dict[int, list[weakref.ref]] = {}
"""The ledgers of the loaders built over each user's dataset (by id), which later loaders over it follow."""


class _Running:
    """The epoch in progress: its stats, the pass it belongs to, counter totals at its start, batches and
    samples handed to torch (delivered to the training loop, where coordl's iterator sees them), and
    whether the plan ran out."""

    def __init__(self, epoch: EpochStats, owner, counters, start: dict, group):
        self.epoch, self.counters, self.start, self.group = epoch, counters, start, group
        self._owner = weakref.ref(owner)  # the pass refers to this ledger: no cycle, so a dropped loader goes at once
        self.started = time.perf_counter()
        self.yielded, self.handed, self.exhausted = 0, 0, False
        self.timed = False  # coordl's own iterator times the training loop's waits, and counts batches delivered
        self.delivered = 0
        self.replayed = 0  # samples of the batches handed that replay exemplars (an experience stream's)

    @property
    def owner(self):
        """The pass this epoch belongs to, or None once it is gone."""
        return self._owner()


def _plan_ahead(owner):
    """A function drawing the first batches of the pass after ``owner``'s, or None (the sampler held weakly:
    the feed that keeps the function is the sampler's, through this ledger)."""
    method = getattr(owner.sampler, "plan_ahead", None)
    if method is None:
        return None
    ref = weakref.WeakMethod(method)

    def plan_ahead(batches: int):
        method = ref()
        return method(batches) if method is not None else None
    return plan_ahead


class EpochLedger:
    """Every epoch of one loader, and its feed (see NOTE [ Feeds ]).

    Args:
        dataset: the loader's dataset (a ``CachedDataset`` counts samples; another dataset counts nothing).
        collate: the loader's collate function (a ``CountingCollate`` counts an iterable dataset's samples).
        feed: the feed of prepared batches, or None (torch's fetcher makes the batches).
        group: the hp_group's name, for the statistics, or None.
        cache_stats: a function returning the cache's fill (or None).
        lookahead: reads each pass's items into the cache ahead of the loop (``_fetch.lookahead``), or None.

    ``stream_batches``: an experience stream's batches (``_rehearsal.batches.RehearsalBatches``), set by the
    loader, or None.

    ``observed``: what an observer of the data path keeps with this ledger (``_core.hooks``); it travels
    with the ledger to other processes.
    """

    def __getstate__(self) -> dict:
        """Pickled with the epochs it recorded, without the one in progress (its pass stays in this process)
        or the ledgers that follow it (they stay too)."""
        state = self.__dict__.copy()
        state["current"], state["_followers"] = None, []
        return state

    def __setstate__(self, state: dict) -> None:
        """Unpickled (``ddp_spawn``'s processes): a loader re-created there over the same dataset follows it."""
        # a ledger pickled before these were its attributes
        self.__dict__.update({"collate": None, "lookahead": None, "_followers": [], "stream_batches": None, **state})
        self.follow_earlier_over(self._users_dataset())

    def __init__(self, dataset, feed=None, group: str | None = None, cache_stats=lambda: None, collate=None,
                 lookahead=None):
        self.dataset, self.feed, self.group, self._cache_stats = dataset, feed, group, cache_stats
        self.collate, self.lookahead = collate, lookahead
        self.observed: dict = {}
        self.epochs: list[EpochStats] = []
        self.current: _Running | None = None
        self._group_stats = None
        self._followers: list[tuple[weakref.ref, list[EpochStats]]] = []
        self.stream_batches = None

    def follow_earlier_over(self, dataset) -> None:
        """Follow the ledgers of the living loaders built earlier over ``dataset`` (the user's). A framework
        re-creates the loader the user holds over the same dataset (Lightning's DDP, from its arguments, to
        inject a DistributedSampler) and iterates the new one, so a loader that has run no epoch of its own
        reports those of the latest loader that follows it (see :meth:`stats`)."""
        for key in [key for key, refs in _OVER.items() if all(ref() is None for ref in refs)]:
            del _OVER[key]
        for ref in _OVER.get(id(dataset), []):
            earlier = ref()
            if earlier is not None and earlier._users_dataset() is dataset:
                earlier._followers.append((weakref.ref(self), self.epochs))
        _OVER.setdefault(id(dataset), []).append(weakref.ref(self))

    def _users_dataset(self):
        return self.dataset.dataset if isinstance(self.dataset, CachedDataset) else self.dataset

    def _reporting(self) -> tuple["EpochLedger | None", list[EpochStats]]:
        """The ledger whose epochs this one's stats give, and its finished epochs: this one, unless it has run
        no epoch and a follower has (None once that follower is gone: its finished epochs stay)."""
        if self.epochs or self.current is not None:
            return self, self.epochs
        for ref, epochs in reversed(self._followers):
            follower = ref()
            if epochs or (follower is not None and follower.current is not None):
                return follower, epochs
        return self, self.epochs

    # -- driven by the batch sampler's passes --------------------------------------------------------

    def begin(self, owner, batches):
        """A pass starts: end the previous one (complete if its plan ran out), start an epoch; return the
        pass's plan."""
        self.end(complete=self.current is not None and self.current.exhausted)
        peers, storage = self._peers(), self._refreshed_storage()
        started = time.perf_counter()
        lists = 0
        if storage is not None and self.epochs:  # NOTE [ Changes in the bucket ] in _objects.storage
            storage.start_refresh()
            lists = storage.finish_refresh()
        if peers is not None:
            peers.begin_epoch(len(self.epochs) + 1)  # the servers' cache maps (partitioned)
        counters = self.counters()
        start = counters.totals() if counters else {}  # before the feed's producer starts fetching
        epoch = EpochStats(epoch=len(self.epochs) + 1, group=self.group,
                           servers=peers.topology.nodes if peers is not None else 0,
                           object_store=isinstance(self.dataset, CachedDataset) and
                           reads_concurrently(self.dataset.storage),
                           disk_tier=isinstance(self.dataset, CachedDataset) and
                           callable(getattr(self.dataset.storage, "read_past_disk", None)))
        epoch.stall_s += time.perf_counter() - started
        epoch.lists = lists
        plan = batches
        if self.feed is not None:
            started = time.perf_counter()
            plan = self.feed.begin(batches, _plan_ahead(owner))
            epoch.stall_s += time.perf_counter() - started  # waiting for the group's epoch to start
        if self.lookahead is not None:
            plan = list(plan)
            self.lookahead.follow(plan, _plan_ahead(owner))
        self.current = _Running(epoch, owner, counters, start, self.feed.counters if self.feed is not None else None)
        return plan

    def counters(self):
        """The shared counters this loader's samples are counted in: the cached dataset's, or the counting
        collate function's (an iterable dataset); else None."""
        if isinstance(self.dataset, CachedDataset):
            return self.dataset.counters
        return self.collate.counters if isinstance(self.collate, CountingCollate) else None

    def close_reads(self) -> None:
        """Stop the look-ahead and wait for a listing of the bucket under way: after the loader's close() no
        request of its is in flight."""
        if self.lookahead is not None:
            self.lookahead.close()
        storage = self._refreshed_storage()
        if storage is not None:
            storage.finish_refresh()

    def _refreshed_storage(self):
        """The dataset's storage where it lists its objects again at epoch boundaries (and there is a cache to keep
        current), else None."""
        if not isinstance(self.dataset, CachedDataset) or self.dataset.cache is None:
            return None
        storage = self.dataset.storage
        return storage if callable(getattr(storage, "start_refresh", None)) else None

    def _peers(self):
        """The dataset's peer tier (partitioned caching), or None."""
        return getattr(self.dataset, "peers", None) if isinstance(self.dataset, CachedDataset) else None

    def planned(self, owner, batch) -> None:
        """The pass handed torch ``batch`` (a list of indices, or one index when unbatched)."""
        if self.current is not None and self.current.owner is owner:
            self.current.handed += 1
            self.current.yielded += len(batch) if isinstance(batch, list) else 1
            if self.stream_batches is not None and isinstance(batch, list):
                self.current.replayed += sum(1 for index in batch if isinstance(index, Replayed))

    def exhausted(self, owner) -> None:
        """The pass's plan ran out. End the epoch once every sample handed out was fetched (with workers,
        torch asks again after each batch it delivers); else the next pass or close() ends it."""
        running = self.current
        if running is None or running.owner is not owner:
            return
        running.exhausted = True
        storage = self._refreshed_storage()
        if storage is not None:  # the last batches are in flight: list while they come
            storage.start_refresh()
        if running.timed or owner.timed:
            return  # coordl's own iterator ends it at the last batch it delivers
        fetched = running.counters.totals()["samples"] - running.start["samples"] if running.counters else 0
        if self.feed is not None or fetched >= running.yielded:
            self.end(complete=True)

    def take(self, indices):
        """The feed's next batch, for the dataset proxy; the wait is stall unless coordl's iterator times it."""
        started = time.perf_counter()
        batch = self.feed.take(indices)
        if self.current is not None and not self.current.timed:
            self.current.epoch.stall_s += time.perf_counter() - started
        return batch

    def end(self, complete: bool, running: _Running | None = None) -> None:
        """End the epoch in progress (only if it is ``running``, when given) and log its line."""
        if running is None:
            running = self.current
        if running is None or running is not self.current:
            return
        self.current = None
        if self.feed is not None:
            self.feed.end(complete)
        epoch = self._filled(running)
        epoch.complete = complete
        self.epochs.append(epoch)
        summary_logger.info(epoch.summary_line(self._cache_stats()))

    # -- what the loader reads -----------------------------------------------------------------------

    def _filled(self, running: _Running) -> EpochStats:
        epoch = EpochStats(**{**running.epoch.__dict__, "time_s": time.perf_counter() - running.started,
                              "batches": running.delivered if running.timed else running.handed})
        if not running.timed and self.feed is None:
            epoch.stall_s = None  # a torch iterator over the loader's parts: the loop's waits are not seen
        if running.counters is not None:
            for field, value in running.counters.totals().items():
                if field.endswith("_ns"):  # times: counted in ns, reported in seconds
                    setattr(epoch, field[:-3] + "_s", (value - running.start[field]) / 1e9)
                else:
                    setattr(epoch, field, value - running.start[field])
        else:  # a map-style dataset coordl does not wrap: what was handed to torch
            epoch.samples = running.yielded
        epoch.decoded = epoch.samples
        epoch.moved = getattr(getattr(running.owner, "sampler", None), "moved", 0)  # locality-aware batches
        if self.stream_batches is not None:
            epoch.experience, epoch.replayed = self.stream_batches.experience, running.replayed
            if self.stream_batches.rehearsal is not None:
                held = self.buffer_stats()
                epoch.buffer_items, epoch.buffer_bytes = held["items"], held["bytes"]
        group = running.group
        if group is not None:
            epoch.members, epoch.samples = group.members, group.delivered_samples
            epoch.prepared, epoch.shared, epoch.staging_wait_s = group.prepared, group.shared, group.staging_wait_s
        return epoch

    def stats(self) -> LoaderStats:
        """Every finished epoch and the one in progress, their total, the cache's fill, the group's state;
        those of the loader that follows this one, where this one has run no epoch (see
        :meth:`follow_earlier_over`)."""
        source, finished = self._reporting()
        running = source.current if source is not None else None
        live = source if source is not None else self
        epochs = list(finished) + ([live._filled(running)] if running is not None else [])
        total = EpochStats(epoch=0, complete=all(e.complete for e in epochs), group=live.group)
        for e in epochs:
            add_epoch(total, e)
        if live.feed is not None:
            live._group_stats = live.feed.stats() or live._group_stats
        peers = live._peers()
        total.servers = peers.topology.nodes if peers is not None else 0
        return LoaderStats(epochs=epochs, total=total, cache=live._cache_stats(), group=live._group_stats,
                           peers=peers.peer_stats() if peers is not None else None,
                           rehearsal=live.buffer_stats())

    def buffer_stats(self) -> dict:
        """The rehearsal buffer now: its members (``items``; every rank's, under DDP), the bytes of those the node's
        cache or exemplar region holds (``bytes``) and how many neither does (``uncached``), members per class
        (``classes``, None without labels), per experience (``experiences``) and per rank's buffer (``ranks``), and
        the exemplar region's fill (``region``: items, bytes, bound, puts refused for want of room; None without
        one); None without a buffer."""
        batches = self.stream_batches
        if batches is None or batches.rehearsal is None:
            return None
        members, stream, region = batches.members(), batches.sampler.stream, batches.exemplars
        cache = self.dataset.cache if isinstance(self.dataset, CachedDataset) else None
        cached = cache.views(members) if cache is not None and members else [None] * len(members)
        sizes = [None if item is None else len(item[0]) for item in cached]
        if region is not None:
            sizes = [size if size is not None else held for size, held in zip(sizes, region.sizes(members))]
        held = [size for size in sizes if size is not None]
        experiences: dict[int, int] = {}
        for index in members:
            number = stream.locate(index)[0]
            experiences[number] = experiences.get(number, 0) + 1
        try:
            classes: dict | None = {}
            for index in members:
                label = stream.target(index)
                classes[label] = classes.get(label, 0) + 1
            classes = dict(sorted(classes.items()))
        except AttributeError:
            classes = None
        except TypeError:  # labels that do not sort
            pass
        return {"items": len(members), "bytes": sum(held),
                "uncached": len(members) - len(held), "classes": classes, "experiences": dict(sorted(experiences.items())),
                "ranks": [len(buffer) for buffer in batches.rehearsal.buffers],
                "region": None if region is None else region.stats()}
