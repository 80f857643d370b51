"""Coordinated prep: jobs of one hyperparameter search share each epoch's prepared minibatches.

K training jobs on one machine that pass the same ``hp_group`` name form a group (CoorDL, Mohan et al.,
VLDB 2021, §6.3). In every epoch they follow one plan, each prepares only its share of the minibatches
and publishes them into a staging area in shared memory, and every member consumes every minibatch,
in plan order. This module is a job's membership of its group: attaching, the epoch protocol's waits,
the staged batches' segments, and the group tools. The shared state and its transitions live in
``_group_state`` (see its NOTEs on layout, staging and takeover); batch encoding lives elsewhere.

NOTE [ Epochs and membership ]
A member *arrives* for the group's next epoch when its training loop starts one. Whoever holds the lock
and sees that the epoch may start *seals* it: the arrived members become its members, batch ``b`` goes
to member ``b mod M`` (sorted by slot). The epoch may start once every live member of the previous
epoch has arrived, or has finished it and not come back within the timeout (it then joins the epoch
after); the group's first epoch also waits, up to the timeout, for ``hp_group_size`` arrivals. So
membership changes only at epoch boundaries, and a job starting mid-epoch waits for the next one.
Waiting members check liveness every ``LIVENESS_POLL_S``, so nobody waits on a dead process. A member's
liveness is the kernel lock on its slot (see ``_core.shm`` NOTE [ Locks and liveness ]): it holds whatever
PID namespace the member runs in, and the kernel drops it, like the mutex, when the member dies.

NOTE [ Lifecycle ]
The first job creates the segment (header published last); others attach and must match its settings
(:class:`~coordl.exceptions.GroupMismatchError` otherwise). A job leaves on ``close()``, when collected
or at exit; the last one out unlinks the group and any staged batch. A group whose members all died is
removed by the next coordl process on the machine (``_shm.reclaim_dead``), by the next job that asks for
it, or by :func:`cleanup_stale` / ``coordl group rm``.
"""

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import multiprocessing.util
import os
import time
import types

import numpy as np

from coordl._core.settings import GROUP_KIND, SHM_PREFIX
from coordl._core.shm import Segment, SegmentKind, create_unlocked, open_or_create, open_unlocked, rename_segment, shm_dir
from coordl._core.sizes import format_bytes
from coordl._group.state import ALONE, LAYOUT_VERSION, NOT_MINE, GroupState, GroupStats, MemberStats, header_ok, segment_size, \
    staged_name, staged_prefix
from coordl.exceptions import GroupMismatchError, ShmCapacityError, StagingError

__all__ = ["ALONE", "EpochTicket", "GroupStats", "HPGroup", "MemberStats", "NOT_MINE", "cleanup_stale",
           "epoch_plan", "group_segment_name", "list_groups", "remove_group"]
assert __all__ == sorted(__all__)

logger = logging.getLogger(__name__)

_VALUE_LEN = 160


def group_segment_name(group: str) -> str:
    """Segment name of the hp_group called ``group`` for this user (the layout version is part of it)."""
    token = hashlib.sha256(f"{os.getuid()}\0hp_group\0{group}\0{LAYOUT_VERSION}".encode()).hexdigest()[:12]
    return f"{SHM_PREFIX}{token}_{GROUP_KIND}"


def epoch_plan(n_items: int, batch_size: int, drop_last: bool, shuffle: bool, seed: int, epoch: int) -> list[list[int]]:
    """The group's minibatches of ``epoch``: a permutation drawn from (seed, epoch), cut into batches."""
    order = np.random.default_rng([seed, epoch]).permutation(n_items) if shuffle else np.arange(n_items)
    stop = n_items - n_items % batch_size if drop_last else n_items
    return [order[i:i + batch_size].tolist() for i in range(0, stop, batch_size)]


def _compact(value: str) -> str:
    if len(value) <= _VALUE_LEN:
        return value
    digest = hashlib.sha256(value.encode()).hexdigest()[:12]
    return f"{value[:_VALUE_LEN - 40]}... (sha256 {digest})"


def _differences(group: dict[str, str], mine: dict[str, str]) -> list[str]:
    return [f"{key}: group has {group.get(key, '-')!r}, this job {mine.get(key, '-')!r}"
            for key in sorted(group.keys() | mine.keys()) if group.get(key) != mine.get(key)]


@dataclasses.dataclass(frozen=True)
class EpochTicket:
    """This job's place in one group epoch, and the group's plan seed for it."""

    epoch: int
    members: int
    slot: int
    seed: int


def _staged_exists(name: str) -> StagingError:
    return StagingError(f"internal error: staged batch segment {name} already exists")


def _forget_member(name: str, slot: int, pid: int, buf) -> None:
    """Unregister member ``slot`` if ``pid`` still has it, failing its running epoch (the mutex is held)."""
    state = GroupState(types.SimpleNamespace(buf=buf, name=name))
    state.unregister(slot, pid)
    del state


class HPGroup:
    """This job's membership of a named hp_group, and its access to the group's staging area.

    Args:
        group: the group's name (``hp_group=``).
        config: this job's data settings, ``{setting: description}``; members must agree on all.
        n_batches: minibatches per epoch.
        seed: the plan seed this job asks for, or None to take the group's (drawn by its creator).
        staging_bytes: capacity of the staging area if this job creates the group.
        expected_members: ``hp_group_size``: the group's first epoch waits for this many. Defaults to 1.
        timeout_s: how long the first epoch waits for ``expected_members``, how long an epoch waits for
            a member that finished the previous one, and after how long a wait logs a warning naming the
            jobs it waits for. Defaults to 60.

    Lifecycle: :meth:`join` creates or attaches the group segment and registers this process (the
    loader's; workers never touch it). :meth:`close`, garbage collection or exit leaves; the last
    member out unlinks the group and its staged batches. See NOTE [ Lifecycle ]. The segment's mutex
    serialises processes and threads alike.

    Example::

        >>> group = HPGroup("doc-example", config={"batch_size": "2"}, n_batches=3, seed=7,
        ...                 staging_bytes=1 << 20)
        >>> group.join(); ticket = group.start_epoch()
        >>> ticket.epoch, ticket.members, group.reserve(ticket.epoch, 0, 100) == ALONE
        (1, 1, True)
        >>> group.close()
    """

    def __init__(self, group: str, *, config: dict[str, str], n_batches: int, seed: int | None,
                 staging_bytes: int, expected_members: int | None = None, timeout_s: float = 60.0):
        self.group = group
        self.name = group_segment_name(group)
        self.config = {key: _compact(value) for key, value in config.items()}
        self.n_batches = n_batches
        self.requested_seed = seed
        self.staging_bytes = staging_bytes
        self.expected_members = expected_members or 1
        self.timeout_s = timeout_s
        self.seed = None
        self._segment = None
        self._state = None
        self._slot = -1
        self._finalizer = None
        self._reused: set[int] = set()  # reserved batches whose segment is a spare taken over

    @contextlib.contextmanager
    def _locked(self):
        with self._segment.locked(what=f"hp_group {self.group!r}"):
            yield self._state

    def _live(self) -> list[int]:
        """Member slots whose process is alive."""
        return self._segment.live_slots()

    # -- joining and leaving -----------------------------------------------------------------

    @property
    def joined(self) -> bool:
        return self._state is not None

    @property
    def slot(self) -> int:
        """This process's slot in the group (members are numbered from 0 as they join); -1 when not joined."""
        return self._slot

    def join(self) -> None:
        """Create or attach the group and register this process in it. Idempotent.

        Raises:
            GroupMismatchError: live members use other settings (the message lists them).
            ShmCapacityError: /dev/shm cannot hold the group.
        """
        if self.joined:
            return
        segment = open_or_create(self.name, what=f"hp_group {self.group!r}", create=self._create,
                                 usable=self._usable)
        self._register(segment)

    def _create(self) -> Segment | None:
        seed = self.requested_seed
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little") >> 1

        def initialize(buf) -> None:
            GroupState.initialize(types.SimpleNamespace(buf=buf, name=self.name), n_batches=self.n_batches,
                                  capacity=self.staging_bytes, seed=seed, label=self.group,
                                  config=json.dumps(self.config).encode(), creator_pid=os.getpid())

        segment = Segment.create(self.name, segment_size(self.n_batches), lambda size, free: ShmCapacityError(
            f"hp_group {self.group!r} needs {format_bytes(size)} of {shm_dir()} but only {format_bytes(free)} is "
            f"free; free it (`coordl cache ls`, `coordl group ls`)."), initialize=initialize)
        if segment is None:
            return None
        logger.info("created hp_group %r (%s): %d batches per epoch, staging area of %s", self.group, self.name,
                    self.n_batches, format_bytes(self.staging_bytes))
        return segment

    def _usable(self, segment: Segment) -> bool:
        """Whether the locked ``segment`` is a live group with our settings; removes a dead one."""
        live = segment.live_slots()
        if not header_ok(segment.buf):
            segment.unlock()
            segment.close()
            if live:
                raise GroupMismatchError(f"hp_group {self.group!r} ({self.name}) is in use by {len(live)} job(s) "
                                         f"whose shared state this version of coordl cannot read; use another hp_group=")
            GROUPS.remove(self.name, force=True)
            return False
        state = GroupState(segment)
        alive, theirs, pids = state.reap(live), state.config(), state.member_pids()
        del state
        if alive and theirs == self.config:
            return True
        segment.unlock()
        if alive:
            segment.close()
            raise GroupMismatchError(
                f"hp_group {self.group!r} is in use by job(s) with pid(s) {', '.join(map(str, pids))} whose data "
                f"settings differ from this job's: {'; '.join(_differences(theirs, self.config))}. Use the same "
                f"settings, another hp_group=, or hp_group_on_mismatch='uncoordinated' to run this job on its own.")
        segment.close()
        logger.info("replacing dead hp_group %r (%s): all its members are gone", self.group, self.name)
        GROUPS.remove(self.name)
        return False

    def _register(self, segment: Segment) -> None:
        """Take a member slot (and its liveness lock) in the locked ``segment``, then unlock it."""
        pid, state = os.getpid(), GroupState(segment)
        try:
            state.reap(segment.live_slots())
            slot = segment.take_slot(state.free_slots())
            if slot is not None:
                state.register(slot, pid, self.expected_members)
        finally:
            segment.unlock()
        if slot is None:
            limit = len(state.members)
            del state
            segment.close()
            raise RuntimeError(f"hp_group {self.group!r} already has {limit} members, the most it can have")
        if state.capacity != self.staging_bytes:
            logger.info("hp_group %r keeps the staging area of %s its first member asked for (this job asked for "
                        "%s)", self.group, format_bytes(state.capacity), format_bytes(self.staging_bytes))
        self.seed = state.seed
        self._segment, self._state, self._slot = segment, state, slot
        forget = functools.partial(_forget_member, self.name, slot, pid)
        self._finalizer = multiprocessing.util.Finalize(self, segment.leave, args=(slot, forget, staged_prefix(self.name)),
                                                        exitpriority=-1)

    def close(self) -> None:
        """Leave the group (and the epoch in progress); the last member out removes it. Idempotent."""
        if self._finalizer is not None:
            self._state = None
            self._finalizer()
        self._segment, self._state, self._finalizer, self._slot = None, None, None, -1

    # -- epochs --------------------------------------------------------------------------------

    def start_epoch(self) -> EpochTicket:
        """Arrive for the group's next epoch and wait until it starts (see NOTE [ Epochs and membership ]).

        If anything interrupts the wait (KeyboardInterrupt included), this job takes its arrival back, or
        leaves the epoch if it has started with it, so the group never waits on a job that stopped waiting.
        """
        self.join()
        upcoming = None
        try:
            with self._locked() as state:
                state.reap(self._live())
                state.remove_strays()
                upcoming = state.arrive(self._slot)
            return self._wait_for_epoch(upcoming)
        except BaseException as e:
            if upcoming is not None and self.joined:
                with self._locked() as state:
                    state.withdraw(self._slot, upcoming, f"stopped by {type(e).__name__}")
            raise

    def _wait_for_epoch(self, upcoming: int) -> EpochTicket:
        """Poll until epoch ``upcoming`` starts; warn, naming whom it waits for, once it takes longer than
        the timeout."""
        started, delay, warned = time.monotonic(), 0.001, False
        while True:
            with self._locked() as state:
                state.reap(self._live())
                state.try_seal(self.timeout_s)
                mine, running, members = state.epoch_of(self._slot)
                first, seed = state.first_epoch, state.seed
                late = mine != upcoming and not warned and time.monotonic() - started > self.timeout_s
                awaited = state.awaited(self.timeout_s) if late else None
            if mine == upcoming:
                if upcoming == first and members < self.expected_members:
                    logger.warning("hp_group %r: epoch %d started with %d of the %d jobs hp_group_size asks for, "
                                   "after hp_group_timeout_s=%g s; jobs that come later join at the next epoch",
                                   self.group, upcoming, members, self.expected_members, self.timeout_s)
                return EpochTicket(upcoming, members, self._slot, seed)
            if late:
                logger.warning("hp_group %r: waited %.0f s for epoch %d to start: %s", self.group,
                               time.monotonic() - started, upcoming,
                               _awaited_text(running, *awaited, self.expected_members))
                warned = True
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def resume_at(self, epoch: int, seed: int) -> bool:
        """Start the group at ``epoch`` with plan seed ``seed`` (a job resuming from a checkpoint), if no epoch
        has started yet; False if the group runs already (this job then joins its next epoch)."""
        self.join()
        with self._locked() as state:
            resumed = state.resume_at(epoch, seed)
            self.seed = state.seed
        return resumed

    def owner(self, batch: int) -> int:
        """Slot of the member that prepares ``batch`` now (read without the lock)."""
        return self._state.owner(batch)

    def pid_of(self, slot: int) -> int:
        """Pid of the job in member ``slot`` (read without the lock)."""
        return self._state.pid_of(slot)

    def batches_of_mine(self) -> list[int]:
        """The batches of the running epoch that this job prepares (its share and any taken over)."""
        return self._state.batches_of(self._slot)

    def share_of_mine(self) -> tuple[int, list[int]]:
        """``(generation, batches_of_mine())``, read in that order: a change after it shows as a new generation."""
        generation = self.generation
        return generation, self.batches_of_mine()

    @property
    def generation(self) -> int:
        """Changes whenever an epoch starts or batches change hands."""
        return self._state.generation

    def advance(self, cursor: int) -> None:
        """Record that this job consumed every batch before ``cursor`` (the epoch ends at n_batches)."""
        self._state.set_cursor(self._slot, cursor)
        if cursor == self.n_batches:
            with self._locked() as state:
                state.finish(self._slot)

    def leave_epoch(self) -> None:
        """Stop taking part in the running epoch; the others take over this job's remaining share."""
        if self.joined:
            with self._locked() as state:
                state.fail(self._slot, "stopped iterating")

    def check_members(self) -> None:
        """Fail members whose process is gone, so that nobody waits on them."""
        with self._locked() as state:
            state.reap(self._live())

    # -- staging ---------------------------------------------------------------------------------

    def reserve(self, epoch: int, batch: int, nbytes: int, reuse: bool = False) -> int | None:
        """Room for this job's ``batch`` in the staging area (see ``_group_state.GroupState.reserve``); with
        ``reuse``, the batch is written by :meth:`create_staged`, into a spare segment where one is free.

        Returns:
            The sequence number of its segment, to get with :meth:`create_staged`; None while there is
            no room yet; :data:`ALONE` if no other member needs it; :data:`NOT_MINE` if it is not this
            job's any more.
        """
        if self._state.waits_for_room(self._slot, epoch, batch, nbytes):
            return None  # seen without the lock: a producer polling for room leaves the lock to the others
        with self._locked() as state:
            seq = state.reserve(self._slot, epoch, batch, nbytes, reuse)
            if seq and seq != NOT_MINE and state.reused(batch, seq):
                self._reused.add(seq)
            return seq

    def create_staged(self, seq: int, nbytes: int) -> Segment:
        """The (unlocked) segment to write reserved batch ``seq`` into: a spare taken over, else a new one;
        the caller closes it.

        Raises:
            ShmCapacityError: /dev/shm is full.
            StagingError: the spare is gone (removed by hand, e.g. ``coordl group rm --force``).
        """
        name = staged_name(self.name, seq)
        if seq in self._reused:
            self._reused.discard(seq)
            segment = open_unlocked(name, claim=False)
            if segment is None:
                raise self._gone(f"staged batch {seq}")
            return segment
        segment = create_unlocked(name, max(nbytes, 1), lambda size, free: ShmCapacityError(
            f"{shm_dir()} is full: cannot stage a batch of {format_bytes(size)} for hp_group {self.group!r} "
            f"({format_bytes(free)} free). Pass a smaller hp_staging_bytes=, free it "
            f"(`coordl cache ls`, `coordl group ls`), or enlarge it (docker: --shm-size)."))
        if segment is None:
            raise _staged_exists(name)
        return segment

    @property
    def written_prefix(self) -> str:
        """Prefix of the segments this member's share loader writes batches into (``staging_collate``)."""
        return self._state.written_prefix(self._slot)

    def open_written(self, name: str) -> Segment:
        """The (unlocked) segment of a batch this member's share loader wrote; the caller closes it.

        Raises:
            StagingError: it is gone (removed by hand, e.g. ``coordl group rm --force``).
        """
        segment = open_unlocked(name)
        if segment is None:
            raise self._gone(f"written batch {name}")
        return segment

    def stage_written(self, seq: int, name: str) -> None:
        """Make written batch segment ``name`` the segment of reserved batch ``seq`` (renamed, not copied)."""
        try:
            rename_segment(name, staged_name(self.name, seq))
        except FileExistsError:
            raise _staged_exists(staged_name(self.name, seq)) from None
        except FileNotFoundError:
            raise self._gone(f"written batch {name}") from None

    def _gone(self, what: str) -> StagingError:
        return StagingError(f"{what} of hp_group {self.group!r} disappeared from {shm_dir()} (was the group removed "
                            f"with `coordl group rm --force`?)")

    def commit(self, epoch: int, batch: int, seq: int) -> bool:
        """Publish reserved ``batch`` once written; False (and its segment removed) if it was taken over."""
        with self._locked() as state:
            return state.commit(self._slot, epoch, batch, seq)

    def staged(self, epoch: int, batch: int) -> int | None:
        """Sequence number of ``batch`` if it reads as staged and ready, else None (read without the lock: a
        hint for :meth:`take_staged`)."""
        return self._state.staged(epoch, batch)

    def take_staged(self, epoch: int, batch: int, seq: int) -> Segment | None:
        """The (unlocked) segment of staged ``batch``, marked used by this job, if its ring row still holds
        ready ``seq``; else None (the hint was stale: poll again). See NOTE [ Ring rows ] in _group_state.

        The caller reads and closes it; the last member to take a batch removes its name, not the open segment.

        Raises:
            StagingError: it is gone (removed by hand, e.g. ``coordl group rm --force``).
        """
        with self._locked() as state:
            if not state.holds(epoch, batch, seq):
                return None
            segment = open_unlocked(staged_name(self.name, seq))
            if segment is not None:
                state.release(self._slot, epoch, batch, seq)
        if segment is None:
            raise self._gone(f"staged batch {seq}")
        return segment

    def stats(self) -> GroupStats:
        """The group's epoch, members and staging memory as all its members see them."""
        with self._locked() as state:
            return state.snapshot(self.name, self._live())


def _awaited_text(running: int, consuming: list[int], returning: list[int], expected: int) -> str:
    """Whom a group waits for before its next epoch, for a warning."""
    if not running:
        return (f"its first epoch waits for hp_group_size={expected} jobs, up to hp_group_timeout_s after the first "
                f"one arrived")
    parts = []
    if consuming:
        parts.append(f"job(s) with pid(s) {', '.join(map(str, consuming))} still consume epoch {running} (waiting "
                     f"while they are alive)")
    if returning:
        parts.append(f"job(s) with pid(s) {', '.join(map(str, returning))} finished epoch {running} and may come "
                     f"back (waiting up to hp_group_timeout_s after they finished)")
    return "; ".join(parts) or f"epoch {running} has just ended"


def _read(name: str, buf, live: list[int]) -> GroupStats | None:
    """Stats of a group from a read-only mapping of it (None if its layout is not this version's)."""
    if not header_ok(buf):
        return None
    state = GroupState(types.SimpleNamespace(buf=buf, name=name))
    return state.snapshot(name, live)


GROUPS = SegmentKind(GROUP_KIND, _read, lambda s: s.members_alive, companions=staged_prefix)
"""Listing, removing and reclaiming hp_group segments (with their staged batches)."""


def list_groups() -> list:
    """Every hp_group in the shm directory (:class:`GroupStats`, or ``_shm.Unreadable`` for one this version
    cannot read). Read-only: takes no lock and changes nothing."""
    return GROUPS.all_stats()


def remove_group(name: str, *, force: bool = False) -> bool:
    """Remove group segment ``name`` and its staged batches; only if no member lives unless ``force``."""
    return GROUPS.remove(name, force=force)


def cleanup_stale() -> list[str]:
    """Remove every group whose members are all dead; return their names."""
    return GROUPS.cleanup_stale()
