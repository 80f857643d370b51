"""An hp_group member's feed: each epoch joins the group's epoch and serves the group's plan in order.

The feed of a loader in an hp_group (see ``_epochs.ledger`` NOTE [ Feeds ]). At each pass it waits for
the group's next epoch, prepares this job's share (through its own torch workers, or its DALI
pipeline) in a :class:`~coordl._group.epoch.CoordinatedEpoch`, and hands the training process every
batch of the group's plan, its own and the others', in order.
"""

import functools
import math

import torch.utils.data

from coordl._core.log import warn_caller
from coordl._core.shm import unlink_segments
from coordl._fetch.cached_dataset import CachedDataset
from coordl._group.config import auto_staging_bytes, group_settings
from coordl._group.epoch import CoordinatedEpoch, GroupCounters
from coordl._group.membership import HPGroup, epoch_plan
from coordl._group.staging import StagingCollate
from coordl.exceptions import GroupMismatchError


def join_group(name: str, dataset: CachedDataset, *, batch_size: int, drop_last: bool, shuffled: bool, generator,
               collate_fn, dali, size, staging_bytes, timeout_s, on_mismatch: str, key, content: bool) -> HPGroup | None:
    """Join hp_group ``name`` (see coord_prep); None if it runs other settings and the user accepts that."""
    n_items = len(dataset)
    n_batches = n_items // batch_size if drop_last else math.ceil(n_items / batch_size)
    seed = generator.initial_seed() & (2**63 - 1) if generator is not None else None
    config = group_settings(dataset, batch_size=batch_size, drop_last=drop_last, shuffle=shuffled, seed=seed,
                            collate_fn=collate_fn, dali=dali, key=key, content=content)
    group = HPGroup(name, config=config, n_batches=n_batches, seed=seed,
                    staging_bytes=staging_bytes or auto_staging_bytes(), expected_members=size,
                    timeout_s=float(timeout_s))
    try:
        group.join()
    except GroupMismatchError as e:
        if on_mismatch == "raise":
            raise
        warn_caller(f"{e} Running uncoordinated, as hp_group_on_mismatch='uncoordinated' asks.")
        return None
    return group


class _ShareSampler:
    """The batch sampler of a member's own share loader: this job's share of the current epoch."""

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


class GroupFeed:
    """The group's batches for one loader, an epoch per pass.

    Args:
        group: this job's membership.
        dataset: the loader's dataset (its fetch path; the feed loads through an unfed view of it).
        batch_size, drop_last, shuffled: the loader's batching (members agree on them).
        collate_fn: the user's collate function (the share is collated with it; torch's ``default_collate``
            as :class:`~coordl._group.staging.StagingCollate`, straight into staging segments).
        loader_options: torch DataLoader options of this job's share loader (``num_workers``,
            ``worker_init_fn``, ``multiprocessing_context``, ``timeout``, ``prefetch_factor``,
            ``persistent_workers``, ``generator``).
        dali: the loader's ``DaliBackend``, or None (torch workers prepare the share).
        ledger: the loader's ``EpochLedger`` (for the time spent waiting outside coordl's own iterator).

    Lifecycle: :meth:`close` stops the epoch's producer, the share loader's workers and the DALI pipeline,
    and leaves the group.
    """

    def __init__(self, group: HPGroup, dataset: CachedDataset, *, batch_size: int, drop_last: bool, shuffled: bool,
                 collate_fn, loader_options: dict, dali=None):
        self.group, self.dataset, self.dali = group, dataset, dali
        self.batch_size, self.drop_last, self.shuffled, self.collate_fn = batch_size, drop_last, shuffled, collate_fn
        self.loader_options = loader_options
        workers = loader_options.get("num_workers", 0)
        self.ahead = max(2, workers * (loader_options.get("prefetch_factor") or 2))
        self.counters: GroupCounters | None = None
        self.ledger = None
        self._share = _ShareSampler()
        self._share_loader = None
        self._share_iter = None  # (iterator, tag) of this epoch's share loader
        self._ended: list[tuple] = []  # (CoordinatedEpoch or None, iterator, tag) of epochs still to sweep
        self._staging = None  # the share loader's StagingCollate, if it collates with one
        self._coordinated = None
        self._plan: list[list[int]] = []
        self._next = 0
        self._last_stats = None
        self._epoch: tuple[int, int] | None = None  # (group epoch, its plan seed) of the latest begin

    def _share_batches(self):
        """This job's share through its own workers (a torch DataLoader over an unfed view of the dataset)."""
        if self._share_loader is None:
            if self.collate_fn is torch.utils.data.default_collate:
                self._staging = StagingCollate(self.group.written_prefix, self.group.group)
            self._share_loader = torch.utils.data.DataLoader(
                self.dataset.unfed(), batch_sampler=self._share, collate_fn=self._staging or self.collate_fn,
                **self.loader_options)
        if self._staging is not None and not self._persistent:
            self._staging.tag += 1  # the epoch's workers start (and take the collate function) in iter()
        share = iter(self._share_loader)
        self._share_iter = (share, self._staging.tag if self._staging is not None else 0)
        return share

    @property
    def _persistent(self) -> bool:
        return bool(self.loader_options.get("num_workers") and self.loader_options.get("persistent_workers"))

    def _retire(self, coordinated: CoordinatedEpoch | None) -> None:
        """Retire this epoch's share iterator (``coordinated`` ran it, if not None), then sweep every retired
        one whose producer has ended: stop its workers and remove the batches they wrote that never reached
        this process (NOTE [ Written batches ] in staging_collate). One whose producer outlived its join is
        swept at a later call. Persistent workers are kept, and what they wrote is drained by torch."""
        if self._share_iter is not None and not self._persistent:
            self._ended.append((coordinated, *self._share_iter))
        self._share_iter = None
        running = []
        for ended in self._ended:
            epoch, share, tag = ended
            if epoch is not None and epoch.producer_running:
                running.append(ended)
                continue
            if hasattr(share, "_shutdown_workers"):
                share._shutdown_workers()
            if self._staging is not None:
                unlink_segments(self._staging.tag_prefix(tag))
        self._ended = running

    def begin(self, batches, ahead=None) -> list[list[int]]:
        """Wait for the group's next epoch and start producing this job's share; the group's plan (torch's
        ``batches`` are not drawn: the group's seed decides the order, so nothing is planned ``ahead``)."""
        self.end(complete=False)
        ticket = self.group.start_epoch()
        try:
            self.counters = GroupCounters(members=ticket.members)
            plan = epoch_plan(len(self.dataset), self.batch_size, self.drop_last, self.shuffled, ticket.seed,
                              ticket.epoch)
            self._epoch = (ticket.epoch, ticket.seed)
            generation, mine = self.group.share_of_mine()  # read once: the producer must pair the same ids
            self._share.batches = [plan[b] for b in mine]
            if self.dali is not None:  # this job's share through its DALI pipeline, takeovers through twins
                seed = ticket.seed ^ ticket.epoch
                share = self.dali.epoch(self._share.batches, seed)
                prepare = functools.partial(_prepare_dali_batches, self.dali, seed)
            else:
                share = self._share_batches()
                prepare = functools.partial(_prepare_batches, self.dataset.unfed(), self._staging or self.collate_fn)
            self._coordinated = CoordinatedEpoch(self.group, ticket, plan, share, mine, generation, prepare,
                                                 self.counters, ahead=self.ahead)
        except BaseException:
            self.group.leave_epoch()  # the others take over this job's share
            self._retire(None)  # no producer ran the share iterator, if it was made
            raise
        self._plan, self._next = plan, 0
        return plan

    def checkpoint(self) -> dict | None:
        """Where this job is in the group, for a checkpoint: the group epoch to resume at (the one after the
        latest it began: a group resumes at epoch boundaries) and the plan seed; None before its first."""
        if self._epoch is None:
            return None
        epoch, seed = self._epoch
        return {"next_epoch": epoch + 1, "seed": seed}

    def resume(self, state: dict) -> bool:
        """Resume at ``state`` (from :meth:`checkpoint`): a group not yet started (re-created by jobs
        resuming) starts at its epoch with its seed, so its plans are the uninterrupted group's; False
        if the group runs already (this job then joins its next epoch)."""
        return self.group.resume_at(int(state["next_epoch"]), int(state["seed"]))

    def take(self, indices: list[int]):
        """The group's next batch, which must be the one planned as ``indices``."""
        k = self._next
        if self._coordinated is None or k >= len(self._plan) or list(indices) != self._plan[k]:
            raise RuntimeError(
                f"hp_group {self.group.group!r}: asked for a batch of indices {list(indices)[:8]}... that is not the "
                f"group's next batch ({k} of {len(self._plan)}). A member must consume the group's plan as its "
                f"batch sampler yields it, in order and whole: a sampler that skips or shards batches (e.g. "
                f"Accelerate with several processes) cannot take part in an hp_group.")
        self._next = k + 1
        return next(self._coordinated)

    def end(self, complete: bool) -> None:
        """Stop the epoch's producer (an unfinished epoch is left to the others)."""
        coordinated, self._coordinated = self._coordinated, None
        if coordinated is None:
            return
        coordinated.close()
        self._retire(coordinated)
        if coordinated.producer_running and self.dali is not None:
            # Still inside its pipeline past the join timeout: leave that pipeline to it, use a new one.
            self.dali = self.dali.twin()

    def stats(self):
        """The group's state now, or as it was when this job left it."""
        if self.group.joined:
            self._last_stats = self.group.stats()
        return self._last_stats

    def close(self) -> None:
        self.end(complete=False)
        if self._share_loader is not None:
            iterator = self._share_loader._iterator
            if iterator is not None and hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()
            self._share_loader = None
        if self.dali is not None:
            self.dali.close()
        self.stats()
        self.group.close()
