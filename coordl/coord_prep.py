"""Coordinated prep: jobs of one hyperparameter search share each epoch's prepared minibatches.

K training jobs on one machine that pass the same ``hp_group`` name form a group (CoorDL, Mohan et al.,
VLDB 2021, §6.3). In every epoch they follow one plan, each prepares only its share of the minibatches
and publishes them into a staging area in shared memory, and every member consumes every minibatch,
in plan order. This module owns the group's shared state: membership, the epoch protocol, the staging
table and failure handling. It deals in bytes and numpy; the batches' encoding lives elsewhere.

NOTE [ Group layout ]
One segment ``/dev/shm/cdl_<token>_group`` (token = sha256(uid, group name)) holds, in order:
  * header (4 KiB): int64 fields ``_H_*``, the group name and the members' agreed settings (JSON);
  * members (``MAX_GROUP_MEMBERS`` rows of int64 ``_M_*``): pid and start ticks, the epoch it waits
    for, the epoch it is in, its cursor (next batch it will consume), counters;
  * staging ring (``STAGING_SLOTS`` rows of int64 ``_R_*``): batch ``b`` of the current epoch occupies
    row ``b % STAGING_SLOTS`` while staged: its segment's sequence number, size, state and use mask;
  * owners (int16 per batch of the epoch): which member prepares each batch.
A staged batch's bytes live in their own segment ``cdl_<token>_s<seq>``, sized exactly.

NOTE [ Epochs and membership ]
A member *arrives* for the group's next epoch when its training loop starts one. Whoever holds the lock
and sees that the epoch may start *seals* it: the arrived members become its members, batch ``b`` goes
to member ``b mod M`` (sorted by slot). The epoch may start once every live member of the previous
epoch has arrived, or has finished it and not come back within the timeout (it then joins the epoch
after); the group's first epoch also waits, up to the timeout, for ``hp_group_size`` arrivals. So
membership changes only at epoch boundaries, and a job starting mid-epoch waits for the next one.

NOTE [ Staging and use masks ]
A batch's use counter is a bit mask of the members that used it (its producer's bit is set when it is
published); it is freed, and its segment unlinked, once it covers every *active* member, so a member
that leaves or dies is discounted exactly. Batch ``b`` may be staged only when every active member has
consumed ``b - STAGING_SLOTS`` (its ring row is then free), and only while the staged bytes fit in the
capacity, except for the batch the slowest member needs next, which is always admitted. No batch can
therefore block the one everybody waits for: memory stays under capacity + one batch and the group
moves at the pace of its slowest member. All updates happen under the segment's flock (plus a thread
lock, as a job's producer thread shares the descriptor); consumers poll the ring without the lock.

NOTE [ Failures and takeover ]
A member that dies (SIGKILL included) or abandons an epoch is *failed*: it leaves the active mask, rows
it was writing are reclaimed, and its batches that are not staged yet are dealt round-robin to the
surviving members (sorted by slot) in the owners table, so every survivor still sees every batch once.
Waiting members check liveness (pid + start time) every ``LIVENESS_POLL_S``, so nobody waits on a
dead process; the kernel drops the flock of a process that dies holding it.

NOTE [ Lifecycle ]
The first job creates the segment (header published last); others attach and must match its settings
(:class:`~coordl.exceptions.GroupMismatchError` otherwise). A job leaves on ``close()``, when collected
or at exit; the last one out unlinks the group and any staged batch. A group whose members all died is
replaced by the next job that asks for it, or removed by :func:`cleanup_stale` / ``coordl group rm``.
"""

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import multiprocessing.util
import os
import threading
import time

import numpy as np

from coordl._constants import GROUP_KIND, LIVENESS_POLL_S, MAX_GROUP_MEMBERS, SHM_PREFIX, STAGED_KIND_PREFIX, \
    STAGING_SLOTS
from coordl._shm import Segment, free_shm_bytes, list_segments, unlink_segment, unlink_segments
from coordl._sizes import format_bytes
from coordl._sysinfo import is_process_alive, process_start_ticks
from coordl.exceptions import GroupMismatchError, ShmCapacityError, StagingError

logger = logging.getLogger(__name__)

_MAGIC = int.from_bytes(b"COORDLG1", "little")
_VERSION = 1
(_H_MAGIC, _H_VERSION, _H_READY, _H_CREATED_NS, _H_CREATOR_PID, _H_N_BATCHES, _H_CAPACITY, _H_SEED, _H_EPOCH,
 _H_ACTIVE, _H_OPEN_SINCE_NS, _H_STAGED_BYTES, _H_PEAK_BYTES, _H_SEQ, _H_GENERATION, _H_MEMBERS) = range(16)
_HEADER_FIELDS = 64
_LABEL_AT, _LABEL_LEN = 1024, 256
_CONFIG_AT, _CONFIG_LEN = 1280, 2816
_HEADER_BYTES = 4096
(_M_PID, _M_TICKS, _M_EXPECT, _M_ARRIVED_FOR, _M_IN_EPOCH, _M_CURSOR, _M_DONE_NS, _M_PREPARED, _M_SHARED,
 _M_EPOCHS) = range(10)
_MEMBER_FIELDS = 16
_MEMBERS_AT = _HEADER_BYTES
(_R_BATCH, _R_EPOCH, _R_STATE, _R_SEQ, _R_NBYTES, _R_USED) = range(6)
_RING_FIELDS = 8
_RING_AT = _MEMBERS_AT + MAX_GROUP_MEMBERS * _MEMBER_FIELDS * 8
_OWNERS_AT = _RING_AT + STAGING_SLOTS * _RING_FIELDS * 8
_FREE, _WRITING, _READY = 0, 1, 2
_OPEN_ATTEMPTS = 50
_VALUE_LEN = 160

NOT_MINE = -1
"""``reserve`` result: the batch is no longer this job's to publish (it left the epoch)."""
ALONE = 0
"""``reserve`` result: this job is the epoch's only active member; nothing needs staging."""


def group_segment_name(group: str) -> str:
    """Segment name of the hp_group called ``group`` for this user."""
    token = hashlib.sha256(f"{os.getuid()}\0hp_group\0{group}".encode()).hexdigest()[:12]
    return f"{SHM_PREFIX}{token}_{GROUP_KIND}"


def _staged_prefix(segment_name: str) -> str:
    return segment_name[:-len(GROUP_KIND)] + STAGED_KIND_PREFIX


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
    """This job's place in one group epoch."""

    epoch: int
    members: int
    slot: int
    n_batches: int


@dataclasses.dataclass(frozen=True)
class MemberStats:
    """One member of a group as ``coordl group ls`` shows it."""

    pid: int
    alive: bool
    epoch: int
    cursor: int
    waiting_for: int
    prepared: int
    shared: int
    epochs_done: int


@dataclasses.dataclass(frozen=True)
class GroupStats:
    """A snapshot of one hp_group: its epoch, members and staging memory."""

    name: str
    label: str
    epoch: int
    n_batches: int
    members: tuple[MemberStats, ...]
    staged_batches: int
    staged_bytes: int
    peak_staged_bytes: int
    capacity_bytes: int

    @property
    def members_alive(self) -> int:
        return sum(m.alive for m in self.members)


class _Views:
    """numpy views onto a mapped group segment, and the protocol steps that need the lock held."""

    def __init__(self, segment: Segment):
        buf = segment.buf
        self.buf = buf
        self.prefix = _staged_prefix(segment.name)
        self.header = np.ndarray((_HEADER_FIELDS,), np.int64, buf, 0)
        self.members = np.ndarray((MAX_GROUP_MEMBERS, _MEMBER_FIELDS), np.int64, buf, _MEMBERS_AT)
        self.ring = np.ndarray((STAGING_SLOTS, _RING_FIELDS), np.int64, buf, _RING_AT)
        self.owners = np.ndarray((int(self.header[_H_N_BATCHES]),), np.int16, buf, _OWNERS_AT)

    def text(self, at: int, length: int) -> str:
        return bytes(self.buf[at:at + length]).rstrip(b"\0").decode("utf-8", "replace")

    def config(self) -> dict[str, str]:
        return json.loads(self.text(_CONFIG_AT, _CONFIG_LEN) or "{}")

    def active_slots(self) -> list[int]:
        active = int(self.header[_H_ACTIVE])
        return [s for s in range(MAX_GROUP_MEMBERS) if active >> s & 1]

    def low(self) -> int:
        """The first batch some active member has not consumed (n_batches when none is active)."""
        slots = self.active_slots()
        return int(self.members[slots, _M_CURSOR].min()) if slots else len(self.owners)

    def free_row(self, row: int) -> None:
        entry = self.ring[row]
        if entry[_R_STATE] != _FREE:
            unlink_segment(f"{self.prefix}{int(entry[_R_SEQ]):x}")
            self.header[_H_STAGED_BYTES] -= entry[_R_NBYTES]
        entry[:] = 0
        entry[_R_BATCH] = -1

    def free_used(self) -> None:
        """Free every staged batch that all active members have used."""
        active = int(self.header[_H_ACTIVE])
        for row in np.flatnonzero(self.ring[:, _R_STATE] == _READY):
            if int(self.ring[row, _R_USED]) & active == active:
                self.free_row(int(row))

    def fail(self, slot: int, why: str) -> None:
        """Take ``slot`` out of the running epoch and deal its unstaged batches to the survivors."""
        bit = 1 << slot
        if not int(self.header[_H_ACTIVE]) & bit:
            return
        self.header[_H_ACTIVE] &= ~bit
        if self.members[slot, _M_DONE_NS]:  # it used every batch: nothing to take over
            self.free_used()
            return
        epoch, pid = int(self.header[_H_EPOCH]), int(self.members[slot, _M_PID])
        for row in np.flatnonzero(self.ring[:, _R_STATE] == _WRITING):
            if self.owners[int(self.ring[row, _R_BATCH])] == slot:
                self.free_row(int(row))
        survivors = self.active_slots()
        remaining = []
        if survivors:
            low = self.low()
            staged = set(self.ring[self.ring[:, _R_STATE] == _READY, _R_BATCH].tolist())
            remaining = [int(b) for b in np.flatnonzero(self.owners[low:] == slot) + low if b not in staged]
            for k, batch in enumerate(remaining):
                self.owners[batch] = survivors[k % len(survivors)]
            self.header[_H_GENERATION] += 1
        self.free_used()
        pids = [int(self.members[s, _M_PID]) for s in survivors]
        logger.warning("hp_group %s: job pid %d %s during epoch %d; its %d remaining batch(es) are taken over by "
                       "pid(s) %s", self.text(_LABEL_AT, _LABEL_LEN), pid, why, epoch, len(remaining),
                       ", ".join(map(str, pids)) or "nobody (no member left)")

    def reap(self) -> int:
        """Fail and unregister members whose process is gone; return how many live members remain."""
        alive = 0
        for slot in np.flatnonzero(self.members[:, _M_PID]):
            pid, ticks = int(self.members[slot, _M_PID]), int(self.members[slot, _M_TICKS])
            if is_process_alive(pid, ticks):
                alive += 1
            else:
                self.fail(int(slot), "died")
                self.members[slot] = 0
        return alive

    def try_seal(self, timeout_s: float) -> None:
        """Start the group's next epoch if it may start (see NOTE [ Epochs and membership ])."""
        h, m = self.header, self.members
        previous, upcoming = int(h[_H_EPOCH]), int(h[_H_EPOCH]) + 1
        live = np.flatnonzero(m[:, _M_PID])
        arrived = [int(s) for s in live if m[s, _M_ARRIVED_FOR] == upcoming]
        if not arrived:
            return
        now, timeout_ns = time.time_ns(), int(timeout_s * 1e9)
        for s in live:
            still_in_previous = previous and m[s, _M_IN_EPOCH] == previous and m[s, _M_ARRIVED_FOR] != upcoming
            if still_in_previous and (not m[s, _M_DONE_NS] and int(h[_H_ACTIVE]) >> int(s) & 1
                                      or m[s, _M_DONE_NS] and now - m[s, _M_DONE_NS] < timeout_ns):
                return
        expected = int(m[arrived, _M_EXPECT].max())
        if not previous and len(arrived) < expected and now - h[_H_OPEN_SINCE_NS] < timeout_ns:
            return
        for row in np.flatnonzero(self.ring[:, _R_STATE] != _FREE):
            self.free_row(int(row))
        h[_H_EPOCH], h[_H_OPEN_SINCE_NS], h[_H_MEMBERS] = upcoming, 0, len(arrived)
        h[_H_ACTIVE] = sum(1 << s for s in arrived)
        h[_H_GENERATION] += 1
        self.owners[:] = np.array(arrived, np.int16)[np.arange(len(self.owners)) % len(arrived)]
        m[arrived, _M_IN_EPOCH], m[arrived, _M_ARRIVED_FOR] = upcoming, 0
        m[arrived, _M_CURSOR], m[arrived, _M_DONE_NS] = 0, 0

    def snapshot(self, name: str) -> GroupStats:
        members = tuple(
            MemberStats(pid=int(r[_M_PID]), alive=is_process_alive(int(r[_M_PID]), int(r[_M_TICKS])),
                        epoch=int(r[_M_IN_EPOCH]), cursor=int(r[_M_CURSOR]), waiting_for=int(r[_M_ARRIVED_FOR]),
                        prepared=int(r[_M_PREPARED]), shared=int(r[_M_SHARED]), epochs_done=int(r[_M_EPOCHS]))
            for r in self.members if r[_M_PID])
        h = self.header
        return GroupStats(name=name, label=self.text(_LABEL_AT, _LABEL_LEN), epoch=int(h[_H_EPOCH]),
                          n_batches=len(self.owners), members=members,
                          staged_batches=int(np.count_nonzero(self.ring[:, _R_STATE] != _FREE)),
                          staged_bytes=int(h[_H_STAGED_BYTES]), peak_staged_bytes=int(h[_H_PEAK_BYTES]),
                          capacity_bytes=int(h[_H_CAPACITY]))


def _header_ok(segment: Segment) -> bool:
    if segment.size < _OWNERS_AT:
        return False
    header = np.ndarray((_HEADER_FIELDS,), np.int64, segment.buf, 0)
    return bool(header[_H_MAGIC] == _MAGIC and header[_H_VERSION] == _VERSION and header[_H_READY])


def _leave(segment: Segment, lock: threading.RLock, slot: int, pid: int) -> None:
    """Leave the group (failing this member's running epoch); the last member out removes it all."""
    if segment.buf is None:
        return
    try:
        with lock, segment.locked():
            views = _Views(segment)
            if views.members[slot, _M_PID] == pid:
                views.fail(slot, "left")
                views.members[slot] = 0
            if views.reap() == 0:
                unlink_segments(views.prefix)
                segment.unlink()
                logger.debug("removed hp_group %s (last member gone)", segment.name)
            del views
        segment.close()
    except BufferError:  # views of a still-live handle at interpreter exit: the OS unmaps them
        pass


class HPGroup:
    """This job's membership of a named hp_group, and its access to the group's staging area.

    Args:
        group: the group's name (``hp_group=``).
        config: this job's data settings, ``{setting: description}``; members must agree on all.
        n_batches: minibatches per epoch.
        seed: the plan seed this job asks for, or None to take the group's (drawn by its creator).
        staging_bytes: capacity of the staging area if this job creates the group.
        expected_members: ``hp_group_size``: the group's first epoch waits for this many. Defaults to 1.
        timeout_s: how long the first epoch waits for ``expected_members``, and how long an epoch
            waits for a member that finished the previous one. Defaults to 60.

    Lifecycle: :meth:`join` creates or attaches the group segment and registers this process (the
    loader's; workers never touch it). :meth:`close`, garbage collection or exit leaves; the last
    member out unlinks the group and its staged batches. See NOTE [ Lifecycle ].

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
        self._lock = threading.RLock()
        self._segment = None
        self._views = None
        self._slot = -1
        self._finalizer = None

    @contextlib.contextmanager
    def _locked(self):
        with self._lock, self._segment.locked():
            yield self._views

    # -- joining and leaving -----------------------------------------------------------------

    @property
    def joined(self) -> bool:
        return self._views is not None

    def join(self) -> None:
        """Create or attach the group and register this process in it. Idempotent.

        Raises:
            GroupMismatchError: live members use other settings (the message lists them).
            ShmCapacityError: /dev/shm cannot hold the group.
        """
        if self.joined:
            return
        for _ in range(_OPEN_ATTEMPTS):
            segment = Segment.open(self.name)
            if segment is None:
                segment = self._create()
                if segment is None:
                    continue
            elif not self._usable(segment):
                continue
            self._register(segment)
            return
        raise RuntimeError(f"internal error: could not create or attach hp_group {self.group!r} ({self.name})")

    def _create(self) -> Segment | None:
        size = _OWNERS_AT + 2 * self.n_batches
        if size > free_shm_bytes():
            raise ShmCapacityError(f"hp_group {self.group!r} needs {format_bytes(size)} of /dev/shm but only "
                                   f"{format_bytes(free_shm_bytes())} is free; free /dev/shm (`coordl cache ls`).")
        segment = Segment.create(self.name, size)
        if segment is None:
            return None
        config = json.dumps(self.config).encode()
        if len(config) >= _CONFIG_LEN:
            raise ValueError(f"internal error: hp_group settings take {len(config)} bytes")
        header = np.ndarray((_HEADER_FIELDS,), np.int64, segment.buf, 0)
        seed = self.requested_seed
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little") >> 1
        header[_H_MAGIC], header[_H_VERSION], header[_H_CREATED_NS] = _MAGIC, _VERSION, time.time_ns()
        header[_H_CREATOR_PID], header[_H_N_BATCHES] = os.getpid(), self.n_batches
        header[_H_CAPACITY], header[_H_SEED] = self.staging_bytes, seed
        label = self.group.encode()[:_LABEL_LEN - 1]
        segment.buf[_LABEL_AT:_LABEL_AT + len(label)] = label
        segment.buf[_CONFIG_AT:_CONFIG_AT + len(config)] = config
        views = _Views(segment)
        views.ring[:, _R_BATCH] = -1
        header[_H_READY] = 1  # published last: attachers only trust a ready header
        del views, header
        logger.info("created hp_group %r (%s): %d batches per epoch, staging area of %s", self.group, self.name,
                    self.n_batches, format_bytes(self.staging_bytes))
        return segment

    def _usable(self, segment: Segment) -> bool:
        """Whether the locked ``segment`` is a live group with our settings; removes a stale one."""
        if not _header_ok(segment):
            segment.unlink()
            segment.close()
            return False
        views = _Views(segment)
        alive = views.reap()
        theirs = views.config()
        pids = [int(p) for p in views.members[views.members[:, _M_PID] != 0, _M_PID]]
        prefix = views.prefix
        del views
        if alive and theirs == self.config:
            return True
        segment.unlock()
        if alive:
            segment.close()
            raise GroupMismatchError(
                f"hp_group {self.group!r} is in use by job(s) with pid(s) {', '.join(map(str, pids))} whose data "
                f"settings differ from this job's: {'; '.join(_differences(theirs, self.config))}. Use the same "
                f"settings, another hp_group=, or hp_group_on_mismatch='uncoordinated' to run this job on its own.")
        with segment.locked():  # every member died: start afresh
            logger.info("replacing stale hp_group %r (%s): all its members are gone", self.group, self.name)
            unlink_segments(prefix)
            segment.unlink()
        segment.close()
        return False

    def _register(self, segment: Segment) -> None:
        """Enter this process in the members table of the locked ``segment``, then unlock it."""
        try:
            views = _Views(segment)
            busy = int(views.header[_H_ACTIVE])
            free = [s for s in range(MAX_GROUP_MEMBERS) if not views.members[s, _M_PID] and not busy >> s & 1]
            if not free:
                raise RuntimeError(f"hp_group {self.group!r} already has {MAX_GROUP_MEMBERS} members")
            pid = os.getpid()
            row = views.members[free[0]]
            row[:] = 0
            row[_M_PID], row[_M_TICKS], row[_M_EXPECT] = pid, process_start_ticks(pid), self.expected_members
            group_seed, capacity = int(views.header[_H_SEED]), int(views.header[_H_CAPACITY])
        finally:
            segment.unlock()
        if capacity != self.staging_bytes:
            logger.info("hp_group %r keeps the staging area of %s its first member asked for (this job asked for "
                        "%s)", self.group, format_bytes(capacity), format_bytes(self.staging_bytes))
        self.seed = group_seed
        self._segment, self._views, self._slot = segment, views, free[0]
        self._finalizer = multiprocessing.util.Finalize(self, _leave, args=(segment, self._lock, free[0], pid),
                                                        exitpriority=0)

    def close(self) -> None:
        """Leave the group (and the epoch in progress); the last member out removes it. Idempotent."""
        if self._finalizer is not None:
            self._views = None
            self._finalizer()
        self._segment, self._views, self._finalizer, self._slot = None, None, None, -1

    # -- epochs --------------------------------------------------------------------------------

    def start_epoch(self) -> EpochTicket:
        """Arrive for the group's next epoch and wait until it starts (see NOTE [ Epochs and membership ])."""
        self.join()
        with self._locked() as v:
            v.reap()
            upcoming = int(v.header[_H_EPOCH]) + 1
            v.members[self._slot, _M_ARRIVED_FOR] = upcoming
            if not v.header[_H_OPEN_SINCE_NS]:
                v.header[_H_OPEN_SINCE_NS] = time.time_ns()
        started, delay, warned = time.monotonic(), 0.001, False
        while True:
            with self._locked() as v:
                v.reap()
                v.try_seal(self.timeout_s)
                if v.members[self._slot, _M_IN_EPOCH] == upcoming:
                    return EpochTicket(upcoming, int(v.header[_H_MEMBERS]), self._slot, self.n_batches)
                running = int(v.header[_H_EPOCH])
            if not warned and time.monotonic() - started > self.timeout_s:
                logger.info("hp_group %r: waiting for epoch %d to start (the group is in epoch %d)", self.group,
                            upcoming, running)
                warned = True
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def owner(self, batch: int) -> int:
        """Slot of the member that prepares ``batch`` now (read without the lock)."""
        return int(self._views.owners[batch])

    def batches_of_mine(self) -> list[int]:
        """The batches of the running epoch that this job prepares (its share and any taken over)."""
        return np.flatnonzero(self._views.owners == self._slot).tolist()

    @property
    def generation(self) -> int:
        """Changes whenever an epoch starts or batches change hands."""
        return int(self._views.header[_H_GENERATION])

    def advance(self, cursor: int) -> None:
        """Record that this job consumed every batch before ``cursor`` (the epoch ends at n_batches)."""
        row = self._views.members[self._slot]
        row[_M_CURSOR] = cursor
        if cursor == self.n_batches:
            with self._locked():
                row[_M_DONE_NS] = time.time_ns()
                row[_M_EPOCHS] += 1

    def leave_epoch(self) -> None:
        """Stop taking part in the running epoch; the others take over this job's remaining share."""
        if self.joined:
            with self._locked() as v:
                v.fail(self._slot, "stopped iterating")

    def check_members(self) -> None:
        """Fail members whose process is gone, so that nobody waits on them."""
        with self._locked() as v:
            v.reap()

    # -- staging ---------------------------------------------------------------------------------

    def reserve(self, epoch: int, batch: int, nbytes: int) -> int | None:
        """Room for this job's ``batch`` in the staging area (see NOTE [ Staging and use masks ]).

        Returns:
            The sequence number of its segment, to create with :meth:`create_staged`; None while there is
            no room yet; :data:`ALONE` if no other member needs it; :data:`NOT_MINE` if it is not this
            job's any more.
        """
        with self._locked() as v:
            h, bit = v.header, 1 << self._slot
            if h[_H_EPOCH] != epoch or not int(h[_H_ACTIVE]) & bit or v.owners[batch] != self._slot:
                return NOT_MINE
            if h[_H_ACTIVE] == bit:
                v.members[self._slot, _M_PREPARED] += 1
                return ALONE
            low = v.low()
            entry = v.ring[batch % STAGING_SLOTS]
            fits = h[_H_STAGED_BYTES] + nbytes <= h[_H_CAPACITY] or batch <= low
            if batch >= low + STAGING_SLOTS or entry[_R_STATE] != _FREE or not fits:
                return None
            h[_H_SEQ] += 1
            seq = int(h[_H_SEQ])
            entry[_R_BATCH], entry[_R_EPOCH], entry[_R_SEQ] = batch, epoch, seq
            entry[_R_NBYTES], entry[_R_USED], entry[_R_STATE] = nbytes, bit, _WRITING
            h[_H_STAGED_BYTES] += nbytes
            h[_H_PEAK_BYTES] = max(h[_H_PEAK_BYTES], h[_H_STAGED_BYTES])
            return seq

    def create_staged(self, seq: int, nbytes: int) -> Segment:
        """The (unlocked) segment to write reserved batch ``seq`` into; the caller closes it.

        Raises:
            ShmCapacityError: /dev/shm is full.
        """
        name = f"{self._views.prefix}{seq:x}"
        try:
            segment = Segment.create(name, max(nbytes, 1))
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.ENOMEM):
                raise ShmCapacityError(
                    f"/dev/shm is full: cannot stage a batch of {format_bytes(nbytes)} for hp_group {self.group!r} "
                    f"({format_bytes(free_shm_bytes())} free). Pass a smaller hp_staging_bytes=, free /dev/shm "
                    f"(`coordl cache ls`, `coordl group ls`), or enlarge it (docker: --shm-size).") from e
            raise
        if segment is None:
            raise StagingError(f"internal error: staged batch segment {name} already exists")
        segment.unlock()
        return segment

    def commit(self, epoch: int, batch: int, seq: int) -> bool:
        """Publish reserved ``batch`` once written; False (and its segment removed) if it was taken over."""
        with self._locked() as v:
            entry = v.ring[batch % STAGING_SLOTS]
            if entry[_R_SEQ] != seq or entry[_R_STATE] != _WRITING or entry[_R_EPOCH] != epoch:
                unlink_segment(f"{v.prefix}{seq:x}")
                return False
            entry[_R_STATE] = _READY
            v.members[self._slot, _M_PREPARED] += 1
            v.free_used()
            return True

    def staged(self, epoch: int, batch: int) -> int | None:
        """Sequence number of ``batch`` if it is staged and ready, else None (read without the lock)."""
        entry = self._views.ring[batch % STAGING_SLOTS]
        if entry[_R_STATE] == _READY and entry[_R_BATCH] == batch and entry[_R_EPOCH] == epoch:
            return int(entry[_R_SEQ])
        return None

    def open_staged(self, seq: int) -> Segment:
        """The (unlocked) segment of staged batch ``seq``; the caller closes it.

        Raises:
            StagingError: it is gone (removed by hand, e.g. ``coordl group rm --force``).
        """
        segment = Segment.open(f"{self._views.prefix}{seq:x}")
        if segment is None:
            raise StagingError(f"staged batch {seq} of hp_group {self.group!r} disappeared from /dev/shm "
                               f"(was the group removed with `coordl group rm --force`?)")
        segment.unlock()
        return segment

    def release(self, epoch: int, batch: int, seq: int) -> None:
        """Mark staged ``batch`` used by this job; the last of the epoch's members to use it frees it."""
        with self._locked() as v:
            entry = v.ring[batch % STAGING_SLOTS]
            if entry[_R_SEQ] == seq and entry[_R_EPOCH] == epoch and entry[_R_STATE] == _READY:
                entry[_R_USED] |= 1 << self._slot
                v.free_used()
            v.members[self._slot, _M_SHARED] += 1

    def stats(self) -> GroupStats:
        """The group's epoch, members and staging memory as all its members see them."""
        with self._locked() as v:
            return v.snapshot(self.name)


def _inspect(name: str, remove_if) -> GroupStats | None:
    """Stats of group segment ``name`` (reaping dead members); remove it if ``remove_if(stats)``."""
    segment = Segment.open(name)
    if segment is None:
        return None
    try:
        if not _header_ok(segment):
            segment.unlink()
            return None
        views = _Views(segment)
        views.reap()
        stats = views.snapshot(name)
        prefix = views.prefix
        del views
        if remove_if(stats):
            unlink_segments(prefix)
            segment.unlink()
        return stats
    finally:
        segment.unlock()
        segment.close()


def list_groups() -> list[GroupStats]:
    """Every hp_group on this machine, with dead members reaped."""
    found = (_inspect(name, remove_if=lambda s: False) for name in list_segments(GROUP_KIND))
    return [s for s in found if s is not None]


def remove_group(name: str, *, force: bool = False) -> bool:
    """Remove group segment ``name`` and its staged batches; only if no member lives unless ``force``."""
    stats = _inspect(name, remove_if=lambda s: force or s.members_alive == 0)
    return stats is not None and (force or stats.members_alive == 0)


def cleanup_stale() -> list[str]:
    """Remove every group whose members are all dead; return their names."""
    removed = (_inspect(name, remove_if=lambda s: s.members_alive == 0) for name in list_segments(GROUP_KIND))
    return [s.name for s in removed if s is not None and s.members_alive == 0]
