"""The shared state of an hp_group: its segment layout and every change to it, made with the lock held.

NOTE [ Group layout ]
One segment ``cdl_<token>_group`` (token = sha256(uid, group name, layout version)) holds, in order:
  * header (4 KiB): int64 fields ``_H_*``, the group name, the members' agreed settings (JSON) and the
    mutex holder (``_shm.LOCK_INFO_AT``);
  * members (``MAX_GROUP_MEMBERS`` rows of int64 ``_M_*``): pid and join time (member ``i`` holds
    liveness slot ``i``), the epoch it waits for, the epoch it is in, its cursor (next batch it will
    consume), counters;
  * staging ring (``STAGING_SLOTS`` rows of int64 ``_R_*``): batch ``b`` of the current epoch occupies
    row ``b % STAGING_SLOTS`` while staged: its segment's sequence number, size, state, use mask and the
    row's version (NOTE [ Ring rows ]);
  * spares (``SPARE_SLOTS`` rows of int64 ``_S_*``): the segments kept for reuse, by sequence number and
    size (NOTE [ Spare segments ]);
  * owners (int16 per batch of the epoch): the member slot that prepares each batch.
A staged batch's bytes live in their own segment ``cdl_<token>_s<seq>``, sized exactly; a spare segment
is named ``cdl_<token>_sr<seq>``.

NOTE [ Staging and use masks ]
A batch's use counter is a bit mask of the members that used it (its producer's bit is set when it is
published); it is freed, and its segment unlinked, once it covers every *active* member, so a member
that leaves or dies is discounted exactly. Batch ``b`` may be staged only when every active member has
consumed ``b - STAGING_SLOTS`` (its ring row is then free), and only while the staged bytes fit in the
capacity, except for the batch the slowest member needs next, which is always admitted. No batch can
therefore block the one everybody waits for: memory stays under capacity + one batch and the group
moves at the pace of its slowest member.

NOTE [ Spare segments ]
A new segment's pages are allocated, zeroed and, once the last member drops its mapping, freed again:
for a batch of images that costs more CPU than writing it (``results/staging-cost-e49389b``). So a batch
whose producer copied it into a segment of its own (``reserve(reuse=True)``: the DALI backend, another
``collate_fn``) is not removed when freed but kept as a spare while a spare row is free: renamed
``sr<seq>``, so that no consumer can take it again, its bytes in ``_H_SPARE_BYTES``. A producer reserving
a batch of the same size takes a spare over (renamed to the batch's name, its pages written again) only
once nobody maps it: every consumer takes a shared claim on a batch as it opens it, under the lock and
before its use bit can free the row (``_shm.open_unlocked``), and the claim lasts as long as any mapping
of the batch, in any process, SIGKILL included (``_shm.unclaimed``). So no spare is written while a
tensor over its old batch exists. A batch is admitted by the staged bytes alone, as before; spares
nobody maps then give their room up (removed, oldest first) as far as the staged bytes and theirs exceed
the capacity, so memory stays under the capacity plus one batch as before, and a producer waiting for
room removes none. Spares still mapped hold the memory of the tensors over them, as a removed batch's pages
do, and take no room. Rows a member was writing when it failed are removed, never kept (its thread may
still write).

NOTE [ Ring rows ]
Rows change only under the lock, and every change to a row's batch, epoch, state or sequence number is
made between two increments of the row's version (odd meanwhile: a seqlock). Consumers poll without the
lock (:meth:`GroupState.staged`): the version, the fields, the version again; the row counts only if both
reads give the same even version. These are aligned int64 numpy element stores and loads, one instruction
each on x86-64, made in program order, and x86-64 (TSO) keeps a core's stores in order and its loads in
order, so there a poll only ever returns a row as a writer left it. On aarch64 and other weakly ordered
CPUs the writer would need release and the reader acquire ordering, which Python cannot ask for, so there
a poll may mix two states of a row. Correctness therefore never rests on the poll, which is only a hint:
a consumer takes a batch only once :meth:`GroupState.holds` confirms, under the lock, that the row holds
(epoch, batch, seq, ready), and it opens the batch's segment and sets its use bit under that same lock
(taking and dropping the lock are system calls and thread-lock operations, which order memory: a
writer's stores come before its unlock, the reader's loads after its lock). A stale hint is polled again.
A producer waiting for room polls the same way (:meth:`GroupState.waits_for_room`): a poll that reads no
room returns without the lock, so waiting producers leave it to the members that use or publish
batches, and only :meth:`GroupState.reserve`, under the lock, hands a row out.
The row cannot be freed before this member's bit is set, and sequence numbers (so segment names) are
never reused within a group, so the segment opened holds the batch the row named; the batch's own header
(epoch, batch id) is checked as it is read, and a mismatch, which only a segment changed by hand can
cause, raises StagingError.

NOTE [ Failures and takeover ]
A member that dies (SIGKILL included) or abandons an epoch is *failed*: it leaves the active mask, rows
it was writing are reclaimed, and its batches that are not staged yet are dealt round-robin to the
surviving members (sorted by slot) in the owners table, so every survivor still sees every batch once.
Batches below the slowest survivor's cursor were consumed by all survivors, so they were published.
"""

import dataclasses
import json
import logging
import time

import numpy as np

from coordl._core.settings import GROUP_KIND, MAX_GROUP_MEMBERS, STAGED_KIND_PREFIX, STAGING_SLOTS
from coordl._core.shm import Segment, rename_segment, unclaimed, unlink_segment, unlink_segments

logger = logging.getLogger(__name__)

_MAGIC = int.from_bytes(b"COORDLG1", "little")
_VERSION = 4
LAYOUT_VERSION = _VERSION
"""Layout version of group segments (part of their name, so versions never share a group)."""
(_H_MAGIC, _H_VERSION, _H_READY, _H_CREATED_NS, _H_CREATOR_PID, _H_N_BATCHES, _H_CAPACITY, _H_SEED, _H_EPOCH,
 _H_ACTIVE, _H_OPEN_SINCE_NS, _H_STAGED_BYTES, _H_PEAK_BYTES, _H_SEQ, _H_GENERATION, _H_MEMBERS,
 _H_FIRST_EPOCH, _H_SPARE_BYTES, _H_REUSED) = range(19)
_HEADER_FIELDS = 64
_LABEL_AT, _LABEL_LEN = 1024, 256
_CONFIG_AT, _CONFIG_LEN = 1280, 2752  # up to _shm.LOCK_INFO_AT
_HEADER_BYTES = 4096
(_M_PID, _M_JOINED_NS, _M_EXPECT, _M_ARRIVED_FOR, _M_IN_EPOCH, _M_CURSOR, _M_DONE_NS, _M_PREPARED, _M_SHARED,
 _M_EPOCHS) = range(10)
_MEMBER_FIELDS = 16
_MEMBERS_AT = _HEADER_BYTES
(_R_BATCH, _R_EPOCH, _R_STATE, _R_SEQ, _R_NBYTES, _R_USED, _R_VERSION, _R_KEEP) = range(8)
_RING_FIELDS = 8
_RING_AT = _MEMBERS_AT + MAX_GROUP_MEMBERS * _MEMBER_FIELDS * 8
SPARE_SLOTS = 8
"""Segments a group keeps for reuse at most (NOTE [ Spare segments ])."""
_S_SEQ, _S_NBYTES = range(2)
_SPARES_AT = _RING_AT + STAGING_SLOTS * _RING_FIELDS * 8
_OWNERS_AT = _SPARES_AT + SPARE_SLOTS * 2 * 8
_FREE, _WRITING, _READY = 0, 1, 2

NOT_MINE = -1
"""``reserve`` result: the batch is no longer this member's to publish (it left the epoch)."""
ALONE = 0
"""``reserve`` result: this member is the epoch's only active one; nothing needs staging."""


def segment_size(n_batches: int) -> int:
    """Bytes of the group segment for ``n_batches`` batches per epoch."""
    return _OWNERS_AT + 2 * n_batches


def staged_name(group_segment: str, seq: int) -> str:
    """Segment name of staged batch ``seq`` of the group whose segment is ``group_segment``."""
    return f"{staged_prefix(group_segment)}{seq:x}"


def staged_prefix(group_segment: str) -> str:
    """Common prefix of the staged batch segments of the group whose segment is ``group_segment``."""
    return group_segment[:-len(GROUP_KIND)] + STAGED_KIND_PREFIX


def header_ok(buf) -> bool:
    """Whether ``buf`` holds a published group header of this layout."""
    if len(buf) < _OWNERS_AT:
        return False
    header = np.frombuffer(buf, np.int64, _HEADER_FIELDS, 0)
    return bool(header[_H_MAGIC] == _MAGIC and header[_H_VERSION] == _VERSION and header[_H_READY]
                and len(buf) >= segment_size(int(header[_H_N_BATCHES])))


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
    spare_bytes: int
    peak_staged_bytes: int
    capacity_bytes: int
    reused: int

    @property
    def members_alive(self) -> int:
        return sum(m.alive for m in self.members)


class GroupState:
    """numpy views onto a mapped group segment and the protocol steps on them.

    Methods change shared state and must be called with the segment's lock held, except those said to
    read without it. Views must be dropped before the segment is unmapped.
    """

    def __init__(self, segment: Segment):
        buf = segment.buf
        self._buf = buf
        self.prefix = staged_prefix(segment.name)
        self.header = np.ndarray((_HEADER_FIELDS,), np.int64, buf, 0)
        self.members = np.ndarray((MAX_GROUP_MEMBERS, _MEMBER_FIELDS), np.int64, buf, _MEMBERS_AT)
        self.ring = np.ndarray((STAGING_SLOTS, _RING_FIELDS), np.int64, buf, _RING_AT)
        self.spares = np.ndarray((SPARE_SLOTS, 2), np.int64, buf, _SPARES_AT)
        self.owners = np.ndarray((int(self.header[_H_N_BATCHES]),), np.int16, buf, _OWNERS_AT)

    @classmethod
    def initialize(cls, segment: Segment, *, n_batches: int, capacity: int, seed: int, label: str,
                   config: bytes, creator_pid: int) -> None:
        """Fill a new, locked segment's header and publish it (``ready`` last)."""
        header = np.ndarray((_HEADER_FIELDS,), np.int64, segment.buf, 0)
        header[_H_MAGIC], header[_H_VERSION], header[_H_CREATED_NS] = _MAGIC, _VERSION, time.time_ns()
        header[_H_CREATOR_PID], header[_H_N_BATCHES] = creator_pid, n_batches
        header[_H_CAPACITY], header[_H_SEED], header[_H_FIRST_EPOCH] = capacity, seed, 1
        if len(config) >= _CONFIG_LEN:
            raise ValueError(f"internal error: hp_group settings take {len(config)} bytes")
        label_bytes = label.encode()[:_LABEL_LEN - 1]
        segment.buf[_LABEL_AT:_LABEL_AT + len(label_bytes)] = label_bytes
        segment.buf[_CONFIG_AT:_CONFIG_AT + len(config)] = config
        state = cls(segment)
        state.ring[:, _R_BATCH] = -1
        header[_H_READY] = 1
        del state, header

    # -- identity ----------------------------------------------------------------------------

    def _text(self, at: int, length: int) -> str:
        return bytes(self._buf[at:at + length]).rstrip(b"\0").decode("utf-8", "replace")

    @property
    def label(self) -> str:
        return self._text(_LABEL_AT, _LABEL_LEN)

    def config(self) -> dict[str, str]:
        return json.loads(self._text(_CONFIG_AT, _CONFIG_LEN) or "{}")

    @property
    def seed(self) -> int:
        return int(self.header[_H_SEED])

    @property
    def first_epoch(self) -> int:
        """The number of the group's first epoch: 1, or where members resuming from a checkpoint set it."""
        return int(self.header[_H_FIRST_EPOCH])

    def resume_at(self, epoch: int, seed: int) -> bool:
        """Make ``epoch`` the group's first, with plan seed ``seed``, if no epoch has started and no member
        waits for one (a group re-created by jobs resuming from a checkpoint); True if the group now
        starts there with that seed (set now or by another member before), False if it runs already."""
        h = self.header
        if h[_H_EPOCH] >= h[_H_FIRST_EPOCH]:  # an epoch has started
            return False
        if int(h[_H_FIRST_EPOCH]) == epoch and int(h[_H_SEED]) == seed:
            return True
        if np.any(self.members[:, _M_ARRIVED_FOR] != 0):
            return False
        h[_H_FIRST_EPOCH], h[_H_EPOCH], h[_H_SEED] = epoch, epoch - 1, seed
        return True

    @property
    def capacity(self) -> int:
        return int(self.header[_H_CAPACITY])

    @property
    def generation(self) -> int:
        """Changes whenever an epoch starts or batches change hands (read without the lock)."""
        return int(self.header[_H_GENERATION])

    def member_pids(self) -> list[int]:
        return [int(p) for p in self.members[self.members[:, _M_PID] != 0, _M_PID]]

    # -- membership --------------------------------------------------------------------------

    def free_slots(self) -> list[int]:
        """Member slots a new member may take (empty, and not still counted in the running epoch)."""
        busy = int(self.header[_H_ACTIVE])
        return [s for s in range(MAX_GROUP_MEMBERS) if not self.members[s, _M_PID] and not busy >> s & 1]

    def register(self, slot: int, pid: int, expected_members: int) -> None:
        """Enter ``pid`` in free member ``slot`` (whose liveness lock the caller now holds)."""
        row = self.members[slot]
        row[:] = 0
        row[_M_PID], row[_M_JOINED_NS], row[_M_EXPECT] = pid, time.time_ns(), expected_members

    def written_prefix(self, slot: int) -> str:
        """Prefix of the batches member ``slot`` writes before staging them (``_group.staging`` NOTE
        [ Written batches ]): its slot and join time, so a later member in the slot has another."""
        return f"{self.prefix}w{slot}-{int(self.members[slot, _M_JOINED_NS]):x}-"

    def remove_strays(self) -> None:
        """Remove batches written for members no longer in the group: a dead member's orphaned workers may
        write one after it was reaped (``_group.staging`` NOTE [ Written batches ])."""
        members = np.flatnonzero(self.members[:, _M_PID])
        unlink_segments(f"{self.prefix}w", keep=tuple(self.written_prefix(int(slot)) for slot in members))

    def _remove(self, slot: int) -> None:
        """Clear member ``slot``'s row and remove the batches it wrote and did not stage."""
        unlink_segments(self.written_prefix(slot))
        self.members[slot] = 0

    def unregister(self, slot: int, pid: int) -> None:
        """Remove member ``slot`` (if ``pid`` still holds it), failing its part of the running epoch."""
        if self.members[slot, _M_PID] == pid:
            self.fail(slot, "left")
            self._remove(slot)

    def reap(self, live: list[int]) -> int:
        """Fail and unregister members whose liveness slot is not in ``live``; return how many live members
        remain."""
        alive = 0
        for slot in np.flatnonzero(self.members[:, _M_PID]):
            if int(slot) in live:
                alive += 1
            else:
                self.fail(int(slot), "died")
                self._remove(int(slot))
        return alive

    def _active_slots(self) -> list[int]:
        active = int(self.header[_H_ACTIVE])
        return [s for s in range(MAX_GROUP_MEMBERS) if active >> s & 1]

    def _low(self) -> int:
        """The first batch some active member has not consumed (n_batches when none is active)."""
        slots = self._active_slots()
        return int(self.members[slots, _M_CURSOR].min()) if slots else len(self.owners)

    def fail(self, slot: int, why: str) -> None:
        """Take ``slot`` out of the running epoch; deal its unstaged batches to the survivors."""
        bit = 1 << slot
        if not int(self.header[_H_ACTIVE]) & bit:
            return
        self.header[_H_ACTIVE] &= ~bit
        if self.members[slot, _M_DONE_NS]:  # it used every batch: nothing to take over
            self._free_used()
            return
        for row in np.flatnonzero(self.ring[:, _R_STATE] == _WRITING):
            if self.owners[int(self.ring[row, _R_BATCH])] == slot:
                self._free_row(int(row))
        survivors, remaining = self._active_slots(), []
        if survivors:
            low = self._low()
            staged = set(self.ring[self.ring[:, _R_STATE] == _READY, _R_BATCH].tolist())
            remaining = [int(b) for b in np.flatnonzero(self.owners[low:] == slot) + low if b not in staged]
            for k, batch in enumerate(remaining):
                self.owners[batch] = survivors[k % len(survivors)]
            self.header[_H_GENERATION] += 1
        self._free_used()
        pids = [int(self.members[s, _M_PID]) for s in survivors]
        logger.log(logging.WARNING if why == "died" else logging.INFO,
                   "hp_group %s: job pid %d %s during epoch %d; its %d remaining batch(es) are taken over by pid(s) "
                   "%s", self.label, int(self.members[slot, _M_PID]), why, int(self.header[_H_EPOCH]), len(remaining),
                   ", ".join(map(str, pids)) or "nobody (no member left)")

    # -- epochs ------------------------------------------------------------------------------

    def arrive(self, slot: int) -> int:
        """Member ``slot`` waits for the group's next epoch; returns that epoch."""
        upcoming = int(self.header[_H_EPOCH]) + 1
        self.members[slot, _M_ARRIVED_FOR] = upcoming
        if not self.header[_H_OPEN_SINCE_NS]:
            self.header[_H_OPEN_SINCE_NS] = time.time_ns()
        return upcoming

    def withdraw(self, slot: int, upcoming: int, why: str) -> None:
        """Member ``slot`` stopped waiting for epoch ``upcoming``: take back its arrival or, if that epoch
        started with it, fail it out of the epoch (``why`` says what stopped it)."""
        m = self.members
        if m[slot, _M_ARRIVED_FOR] == upcoming:
            m[slot, _M_ARRIVED_FOR] = 0
            if not np.any(m[:, _M_ARRIVED_FOR] == upcoming):
                self.header[_H_OPEN_SINCE_NS] = 0
        elif m[slot, _M_IN_EPOCH] == upcoming:
            self.fail(slot, why)

    def epoch_of(self, slot: int) -> tuple[int, int, int]:
        """(epoch member ``slot`` is in, the group's latest epoch, that epoch's member count)."""
        return int(self.members[slot, _M_IN_EPOCH]), int(self.header[_H_EPOCH]), int(self.header[_H_MEMBERS])

    def _awaited(self, now_ns: int, timeout_ns: int) -> tuple[list[int], list[int]]:
        """Slots of the latest epoch's members that the next epoch waits for: (still consuming it, finished
        it less than the timeout ago and not arrived yet)."""
        h, m = self.header, self.members
        latest, consuming, returning = int(h[_H_EPOCH]), [], []
        for s in np.flatnonzero(m[:, _M_PID]).tolist():
            if not latest or m[s, _M_IN_EPOCH] != latest or m[s, _M_ARRIVED_FOR] == latest + 1:
                continue
            done_ns = int(m[s, _M_DONE_NS])
            if not done_ns and int(h[_H_ACTIVE]) >> s & 1:
                consuming.append(s)
            elif done_ns and now_ns - done_ns < timeout_ns:
                returning.append(s)
        return consuming, returning

    def awaited(self, timeout_s: float) -> tuple[list[int], list[int]]:
        """Pids of the members the next epoch waits for: (still consuming the latest epoch, finished it
        less than ``timeout_s`` ago and not arrived yet)."""
        consuming, returning = self._awaited(time.time_ns(), int(timeout_s * 1e9))
        return [self.pid_of(s) for s in consuming], [self.pid_of(s) for s in returning]

    def try_seal(self, timeout_s: float) -> None:
        """Start the group's next epoch if it may start (see NOTE [ Epochs and membership ] in coord_prep)."""
        h, m = self.header, self.members
        upcoming = int(h[_H_EPOCH]) + 1
        arrived = [int(s) for s in np.flatnonzero(m[:, _M_PID]) if m[s, _M_ARRIVED_FOR] == upcoming]
        if not arrived:
            return
        now, timeout_ns = time.time_ns(), int(timeout_s * 1e9)
        if any(self._awaited(now, timeout_ns)):
            return  # a member of the latest epoch may still come
        expected = int(m[arrived, _M_EXPECT].max())
        if upcoming == h[_H_FIRST_EPOCH] and len(arrived) < expected and now - h[_H_OPEN_SINCE_NS] < timeout_ns:
            return
        for row in np.flatnonzero(self.ring[:, _R_STATE] != _FREE):
            self._free_row(int(row))
        h[_H_EPOCH], h[_H_OPEN_SINCE_NS], h[_H_MEMBERS] = upcoming, 0, len(arrived)
        h[_H_ACTIVE] = sum(1 << s for s in arrived)
        h[_H_GENERATION] += 1
        self.owners[:] = np.array(arrived, np.int16)[np.arange(len(self.owners)) % len(arrived)]
        m[arrived, _M_IN_EPOCH], m[arrived, _M_ARRIVED_FOR] = upcoming, 0
        m[arrived, _M_CURSOR], m[arrived, _M_DONE_NS] = 0, 0

    def owner(self, batch: int) -> int:
        """Slot of the member that prepares ``batch`` now (read without the lock)."""
        return int(self.owners[batch])

    def pid_of(self, slot: int) -> int:
        """Pid of member ``slot`` (0 if the slot is free; read without the lock)."""
        return int(self.members[slot, _M_PID])

    def batches_of(self, slot: int) -> list[int]:
        """The batches of the running epoch that member ``slot`` prepares (read without the lock)."""
        return np.flatnonzero(self.owners == slot).tolist()

    def set_cursor(self, slot: int, cursor: int) -> None:
        """Member ``slot`` consumed every batch before ``cursor`` (its own row: no lock needed)."""
        self.members[slot, _M_CURSOR] = cursor

    def finish(self, slot: int) -> None:
        """Member ``slot`` consumed the whole epoch."""
        self.members[slot, _M_DONE_NS] = time.time_ns()
        self.members[slot, _M_EPOCHS] += 1

    # -- staging -------------------------------------------------------------------------------

    def _write_row(self, row: int, values: dict[int, int]) -> None:
        """Set fields of ring row ``row``, its version odd meanwhile (NOTE [ Ring rows ])."""
        entry = self.ring[row]
        entry[_R_VERSION] += 1
        for field, value in values.items():
            entry[field] = value
        entry[_R_VERSION] += 1

    def _free_row(self, row: int) -> None:
        entry = self.ring[row]
        if entry[_R_STATE] != _FREE:
            seq, nbytes = int(entry[_R_SEQ]), int(entry[_R_NBYTES])
            self.header[_H_STAGED_BYTES] -= nbytes
            if not (entry[_R_STATE] == _READY and entry[_R_KEEP] and self._keep_spare(seq, nbytes)):
                unlink_segment(f"{self.prefix}{seq:x}")
        self._write_row(row, {_R_STATE: _FREE, _R_BATCH: -1, _R_EPOCH: 0, _R_SEQ: 0, _R_NBYTES: 0, _R_USED: 0,
                              _R_KEEP: 0})

    def _keep_spare(self, seq: int, nbytes: int) -> bool:
        """Keep freed batch ``seq``'s segment as a spare, if a spare row (size 0) is free."""
        free = np.flatnonzero(self.spares[:, _S_NBYTES] == 0)
        if not nbytes or not len(free):
            return False
        try:
            rename_segment(f"{self.prefix}{seq:x}", f"{self.prefix}r{seq:x}")
        except (FileNotFoundError, FileExistsError):  # removed (or made) by hand
            return False
        self.spares[free[0]] = (seq, nbytes)
        self.header[_H_SPARE_BYTES] += nbytes
        return True

    def _idle_spares(self) -> list[int]:
        """The spare rows whose segment nobody maps (holds a claim on), oldest first."""
        rows = [int(r) for r in np.argsort(self.spares[:, _S_SEQ]) if self.spares[r, _S_NBYTES]]
        return [r for r in rows if unclaimed(f"{self.prefix}r{int(self.spares[r, _S_SEQ]):x}")]

    def _drop_spare(self, row: int) -> None:
        seq, nbytes = (int(v) for v in self.spares[row])
        unlink_segment(f"{self.prefix}r{seq:x}")
        self.header[_H_SPARE_BYTES] -= nbytes
        self.spares[row] = 0

    def _take_spare(self, row: int, seq: int) -> bool:
        """Make spare ``row``'s segment the one of new batch ``seq``; False if it is gone (removed by hand)."""
        try:
            rename_segment(f"{self.prefix}r{int(self.spares[row, _S_SEQ]):x}", f"{self.prefix}{seq:x}")
        except FileNotFoundError:
            self._drop_spare(row)
            return False
        self.header[_H_SPARE_BYTES] -= self.spares[row, _S_NBYTES]
        self.header[_H_REUSED] += 1
        self.spares[row] = 0
        return True

    def _free_used(self) -> None:
        """Free every staged batch that all active members have used."""
        active = int(self.header[_H_ACTIVE])
        for row in np.flatnonzero(self.ring[:, _R_STATE] == _READY):
            if int(self.ring[row, _R_USED]) & active == active:
                self._free_row(int(row))

    def _mine(self, slot: int, epoch: int, batch: int) -> bool:
        """Whether ``batch`` of ``epoch`` is active member ``slot``'s to publish."""
        h = self.header
        return h[_H_EPOCH] == epoch and bool(int(h[_H_ACTIVE]) & 1 << slot) and self.owners[batch] == slot

    def _no_room(self, batch: int, nbytes: int) -> bool:
        """Whether ``batch`` of ``nbytes`` must wait: for its ring row, or for room in the capacity (which the
        batch the slowest member needs next never waits for)."""
        h, low = self.header, self._low()
        return bool(batch >= low + STAGING_SLOTS or self.ring[batch % STAGING_SLOTS, _R_STATE] != _FREE
                    or h[_H_STAGED_BYTES] + nbytes > h[_H_CAPACITY] and batch > low)

    def waits_for_room(self, slot: int, epoch: int, batch: int, nbytes: int) -> bool:
        """Whether :meth:`reserve` of member ``slot``'s ``batch`` would return None now, read without the lock.

        A hint, as a poll is (NOTE [ Ring rows ]): True only where the fields read say the batch is the
        member's, others are active and there is no room. A stale read says "no room" one poll too long,
        or sends the caller to :meth:`reserve`, which decides under the lock.
        """
        return self._mine(slot, epoch, batch) and self.header[_H_ACTIVE] != 1 << slot and self._no_room(batch, nbytes)

    def reserve(self, slot: int, epoch: int, batch: int, nbytes: int, reuse: bool = False) -> int | None:
        """A ring row for member ``slot``'s ``batch`` if it may be staged now (NOTE [ Staging and use masks ]).

        With ``reuse`` (its producer writes the batch into a segment of its own), the segment is kept as a
        spare once freed, and a spare of ``nbytes`` that nobody maps becomes this batch's segment, with
        :meth:`reused` true (NOTE [ Spare segments ]). Spares that somebody maps hold the memory of the
        tensors over them, not room in the staging area.

        Returns:
            Its segment's sequence number; None while there is no room; :data:`ALONE`; :data:`NOT_MINE`.
        """
        h, bit = self.header, 1 << slot
        if not self._mine(slot, epoch, batch):
            return NOT_MINE
        if h[_H_ACTIVE] == bit:
            self.members[slot, _M_PREPARED] += 1
            return ALONE
        if self._no_room(batch, nbytes):
            return None
        row, capacity, seq = batch % STAGING_SLOTS, int(h[_H_CAPACITY]), int(h[_H_SEQ]) + 1
        idle = self._idle_spares()
        same = [r for r in idle if self.spares[r, _S_NBYTES] == nbytes] if reuse else []
        taken = bool(same) and self._take_spare(same[0], seq)
        if taken:
            idle.remove(same[0])
        held = int(h[_H_STAGED_BYTES]) + nbytes + sum(int(self.spares[r, _S_NBYTES]) for r in idle)
        while idle and held > capacity:  # idle spares give their room up
            held -= int(self.spares[idle[0], _S_NBYTES])
            self._drop_spare(idle.pop(0))
        h[_H_SEQ] = seq
        self._write_row(row, {_R_BATCH: batch, _R_EPOCH: epoch, _R_SEQ: seq, _R_NBYTES: nbytes, _R_USED: bit,
                              _R_KEEP: 2 if taken else int(reuse), _R_STATE: _WRITING})
        h[_H_STAGED_BYTES] += nbytes
        h[_H_PEAK_BYTES] = max(h[_H_PEAK_BYTES], held)
        return seq

    def reused(self, batch: int, seq: int) -> bool:
        """Whether reserved batch ``seq`` took a spare over: its segment exists already."""
        entry = self.ring[batch % STAGING_SLOTS]
        return bool(entry[_R_SEQ] == seq and entry[_R_KEEP] == 2)

    def commit(self, slot: int, epoch: int, batch: int, seq: int) -> bool:
        """Publish reserved ``batch``; False (its segment removed) if it was taken over meanwhile."""
        row = batch % STAGING_SLOTS
        entry = self.ring[row]
        if entry[_R_SEQ] != seq or entry[_R_STATE] != _WRITING or entry[_R_EPOCH] != epoch:
            unlink_segment(f"{self.prefix}{seq:x}")
            return False
        self._write_row(row, {_R_STATE: _READY})
        self.members[slot, _M_PREPARED] += 1
        self._free_used()
        return True

    def staged(self, epoch: int, batch: int) -> int | None:
        """Sequence number of ``batch`` if its row reads as staged and ready, else None.

        Read without the lock, so only a hint: :meth:`holds` confirms it under the lock (NOTE [ Ring rows ]).
        """
        entry = self.ring[batch % STAGING_SLOTS]
        version = int(entry[_R_VERSION])
        row_batch, row_epoch, state, seq = entry[[_R_BATCH, _R_EPOCH, _R_STATE, _R_SEQ]].tolist()
        if version % 2 or int(entry[_R_VERSION]) != version:
            return None
        return seq if (row_batch, row_epoch, state) == (batch, epoch, _READY) else None

    def holds(self, epoch: int, batch: int, seq: int) -> bool:
        """Whether ``batch``'s ring row holds its ready segment ``seq`` of ``epoch``."""
        entry = self.ring[batch % STAGING_SLOTS]
        return bool(entry[_R_STATE] == _READY and entry[_R_SEQ] == seq and entry[_R_BATCH] == batch
                    and entry[_R_EPOCH] == epoch)

    def release(self, slot: int, epoch: int, batch: int, seq: int) -> None:
        """Member ``slot`` used staged ``batch``; the last member of the epoch to use it frees it."""
        if self.holds(epoch, batch, seq):
            self.ring[batch % STAGING_SLOTS, _R_USED] |= 1 << slot
            self._free_used()
        self.members[slot, _M_SHARED] += 1

    # -- inspection ----------------------------------------------------------------------------

    def snapshot(self, name: str, live: list[int]) -> GroupStats:
        """The group as ``coordl group ls`` shows it; ``live``: the member slots whose process is alive."""
        members = tuple(
            MemberStats(pid=int(r[_M_PID]), alive=slot in live,
                        epoch=int(r[_M_IN_EPOCH]), cursor=int(r[_M_CURSOR]), waiting_for=int(r[_M_ARRIVED_FOR]),
                        prepared=int(r[_M_PREPARED]), shared=int(r[_M_SHARED]), epochs_done=int(r[_M_EPOCHS]))
            for slot, r in enumerate(self.members) if r[_M_PID])
        h = self.header
        return GroupStats(name=name, label=self.label, epoch=int(h[_H_EPOCH]), n_batches=len(self.owners),
                          members=members, staged_batches=int(np.count_nonzero(self.ring[:, _R_STATE] != _FREE)),
                          staged_bytes=int(h[_H_STAGED_BYTES]), spare_bytes=int(h[_H_SPARE_BYTES]),
                          peak_staged_bytes=int(h[_H_PEAK_BYTES]), capacity_bytes=int(h[_H_CAPACITY]),
                          reused=int(h[_H_REUSED]))
