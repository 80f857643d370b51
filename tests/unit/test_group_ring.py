"""The staging ring's state machine, driven step by step on anonymous memory (no processes; /dev/shm only for the
segments a member wrote)."""

import itertools
import mmap
import os
import random

import numpy as np
import pytest

from coordl._group import state as _group_state

from coordl._core import shm as _shm
from coordl._core.settings import STAGING_SLOTS
from coordl._group.state import (_H_CAPACITY, _H_PEAK_BYTES, _H_REUSED, _H_SPARE_BYTES, _H_STAGED_BYTES, _M_EXPECT,
                                 _M_JOINED_NS, _M_PID, _R_BATCH, _R_EPOCH, _R_NBYTES, _R_SEQ, _R_STATE, _READY,
                                 _WRITING, ALONE, NOT_MINE, SPARE_SLOTS, GroupState, segment_size, staged_name)
from coordl._core.shm import segment_path, shm_dir

GROUP = "cdl_0123456789ab_group"


class _Memory:
    """What GroupState uses of a Segment (``buf``, ``name``, ``size``), over anonymous memory (or ``buf``)."""

    def __init__(self, n_batches: int, buf=None):
        self.size = segment_size(n_batches)
        self.buf = mmap.mmap(-1, self.size) if buf is None else buf
        self.name = GROUP


@pytest.fixture
def unlinked(monkeypatch) -> list[str]:
    """Names of the staged segments the state machine removes (nothing is created, so nothing is removed)."""
    names = []
    monkeypatch.setattr(_group_state, "unlink_segment", names.append)
    return names


def _group(n_batches: int, members: int, capacity: int = 1 << 30, expected: int = 1) -> GroupState:
    """A group whose ``members`` slots are registered (pids 1000, 1001, ...), before its first epoch."""
    memory = _Memory(n_batches)
    GroupState.initialize(memory, n_batches=n_batches, capacity=capacity, seed=1, label="test", config=b"{}",
                          creator_pid=1000)
    state = GroupState(memory)
    for slot in range(members):
        state.members[slot, _M_PID], state.members[slot, _M_EXPECT] = 1000 + slot, expected
    return state


def _seal(state: GroupState, slots) -> int:
    for slot in slots:
        epoch = state.arrive(slot)
    state.try_seal(timeout_s=60)
    assert all(state.epoch_of(slot)[0] == epoch for slot in slots)
    return epoch


def _row(state: GroupState, batch: int) -> tuple[int, int, int, int]:
    entry = state.ring[batch % STAGING_SLOTS]
    return int(entry[_R_BATCH]), int(entry[_R_EPOCH]), int(entry[_R_STATE]), int(entry[_R_SEQ])


class _Member:
    """One member's producer and consumer, each step one call into the state as its threads would make it.

    ``got`` lists the batches its consumer took, in order. The producer reserves and commits in two steps,
    so other members act while its batch is being written. Before each reserve it reads the lock-free
    hint, which may say "no room" only where reserve finds none (``no_room``: how often it did).
    """

    def __init__(self, state: GroupState, slot: int, epoch: int, nbytes: int):
        self.state, self.slot, self.epoch, self.nbytes = state, slot, epoch, nbytes
        self.published, self.writing, self.got, self.no_room = set(), None, [], 0

    @property
    def done(self) -> bool:
        return len(self.got) == len(self.state.owners)

    def produce(self) -> None:
        if self.writing is not None:
            (batch, seq), self.writing = self.writing, None
            if self.state.commit(self.slot, self.epoch, batch, seq):
                self.published.add(batch)
            return
        todo = [b for b in self.state.batches_of(self.slot) if b not in self.published]
        if todo:
            waits = self.state.waits_for_room(self.slot, self.epoch, todo[0], self.nbytes)
            seq = self.state.reserve(self.slot, self.epoch, todo[0], self.nbytes)
            assert seq is None or not waits, f"the hint said no room for batch {todo[0]}, reserve found some"
            self.no_room += waits
            if seq == ALONE:
                self.published.add(todo[0])
            elif seq not in (None, NOT_MINE):
                self.writing = (todo[0], seq)

    def consume(self) -> None:
        batch = len(self.got)
        if self.done:
            return
        if self.state.owner(batch) == self.slot:
            if batch not in self.published:
                return
        else:
            seq = self.state.staged(self.epoch, batch)
            if seq is None or not self.state.holds(self.epoch, batch, seq):
                return
            self.state.release(self.slot, self.epoch, batch, seq)
        self.got.append(batch)
        self.state.set_cursor(self.slot, batch + 1)
        if self.done:
            self.state.finish(self.slot)


def _run(members: list[_Member], rng: random.Random, steps: int = 200_000, until=None, check=None) -> None:
    """Random steps of random members until all are done (or ``until()``); fails on a stall. After each step
    the staged bytes are those of the rows in use, and ``check()`` holds."""
    state = members[0].state
    for _ in range(steps):
        if until() if until else all(m.done for m in members):
            return
        member = rng.choice(members)
        member.produce() if rng.random() < 0.5 else member.consume()
        assert state.header[_H_STAGED_BYTES] == state.ring[:, _R_NBYTES].sum()
        if check is not None:
            check()
    raise AssertionError(f"stalled: members at {[len(m.got) for m in members]}")


@pytest.mark.parametrize("seed", range(4))
def test_every_member_gets_every_batch_once_within_the_capacity_and_the_ring_empties(seed, unlinked):
    n, nbytes, capacity = 3 * STAGING_SLOTS + 5, 100, 1000  # the ring wraps three times; 10 batches fit
    state = _group(n, 3, capacity)
    rng = random.Random(seed)
    for _ in range(2):
        epoch = _seal(state, range(3))
        members = [_Member(state, slot, epoch, nbytes) for slot in range(3)]
        _run(members, rng)
        assert all(m.got == list(range(n)) for m in members)
        assert state.header[_H_STAGED_BYTES] == 0 and not np.any(state.ring[:, _R_STATE])
        assert sum(len(m.published) for m in members) == n  # each batch prepared once
        assert sum(m.no_room for m in members) > 0  # the hint was checked where it said "no room"
    assert capacity < state.header[_H_PEAK_BYTES] <= capacity + nbytes
    assert len(set(unlinked)) == len(unlinked) == 2 * n  # every staged batch's segment removed, once


def test_the_batch_the_slowest_member_needs_is_admitted_beyond_the_capacity(unlinked):
    nbytes = 100
    state = _group(10, 2, capacity=2 * nbytes)
    epoch = _seal(state, [0, 1])  # slot 0 prepares the even batches, slot 1 the odd ones
    staged = {b: state.reserve(0, epoch, b, nbytes) for b in (0, 2)}
    assert all(state.commit(0, epoch, b, seq) for b, seq in staged.items())
    assert state.reserve(0, epoch, 4, nbytes) is None  # the capacity is full
    state.set_cursor(0, 1)  # both members used batch 0 (its producer's bit is set): its row is freed
    state.set_cursor(1, 1)
    state.release(1, epoch, 0, staged[0])
    assert state.header[_H_STAGED_BYTES] == nbytes
    assert state.commit(0, epoch, 4, state.reserve(0, epoch, 4, nbytes))  # full again, with batches 2 and 4
    assert state.reserve(1, epoch, 3, nbytes) is None  # nobody needs batch 3 yet: it waits for room
    assert state.reserve(1, epoch, 1, nbytes) > 0  # both wait for batch 1: admitted beyond the capacity
    assert state.header[_H_STAGED_BYTES] == 3 * nbytes == state.header[_H_CAPACITY] + nbytes
    assert state.reserve(0, epoch, 1, nbytes) == NOT_MINE  # not slot 0's batch


def test_a_batch_waits_for_its_ring_row_while_the_slowest_member_has_not_used_batch_b_minus_64(unlinked):
    n = STAGING_SLOTS + 2
    state = _group(n, 2)
    epoch = _seal(state, [0, 1])
    seq = state.reserve(0, epoch, 0, 1)
    assert state.commit(0, epoch, 0, seq)
    state.set_cursor(0, STAGING_SLOTS)
    assert state.reserve(0, epoch, STAGING_SLOTS, 1) is None  # slot 1 has not used batch 0: row 0 is taken
    state.set_cursor(1, 1)
    state.release(1, epoch, 0, seq)  # slot 1 uses batch 0: the row is freed
    assert unlinked == [staged_name(GROUP, seq)] and state.reserve(0, epoch, STAGING_SLOTS, 1) > seq


def test_a_member_failing_while_writing_loses_its_row_and_the_survivors_share_its_batches(unlinked):
    n, nbytes = 2 * STAGING_SLOTS, 10
    state = _group(n, 3)
    epoch = _seal(state, range(3))
    members = [_Member(state, slot, epoch, nbytes) for slot in range(3)]
    victim, survivors = members[1], [members[0], members[2]]
    rng = random.Random(7)
    _run(members, rng, until=lambda: victim.writing is not None and len(victim.got) > 3)
    batch, seq = victim.writing
    assert _row(state, batch)[2:] == (_WRITING, seq)
    staged_before = int(state.header[_H_STAGED_BYTES])

    state.fail(victim.slot, "died")
    assert staged_name(GROUP, seq) in unlinked and _row(state, batch)[0] == -1  # its row is reclaimed
    assert state.header[_H_STAGED_BYTES] <= staged_before - nbytes  # and rows only the victim had not used
    assert state.owner(batch) in (0, 2)
    theirs = [state.batches_of(s.slot) for s in survivors]
    assert sorted(theirs[0] + theirs[1] + sorted(victim.published)) == list(range(n))
    assert not state.commit(victim.slot, epoch, batch, seq)  # the victim's late commit is refused
    assert state.reserve(victim.slot, epoch, batch, nbytes) == NOT_MINE

    _run(survivors, rng)
    assert all(s.got == list(range(n)) for s in survivors)
    assert state.header[_H_STAGED_BYTES] == 0 and not np.any(state.ring[:, _R_STATE])


def test_the_lock_free_hint_says_no_room_only_where_reserve_finds_none(unlinked):
    nbytes = 100
    state = _group(STAGING_SLOTS + 4, 2, capacity=2 * nbytes)
    epoch = _seal(state, [0, 1])  # slot 0 prepares the even batches, slot 1 the odd ones
    waits = lambda slot, batch: state.waits_for_room(slot, epoch, batch, nbytes)  # noqa: E731
    assert not waits(0, 0) and not waits(0, 2)  # room in their rows and the capacity
    staged = {b: state.reserve(0, epoch, b, nbytes) for b in (0, 2)}
    assert all(state.commit(0, epoch, b, seq) for b, seq in staged.items())
    assert waits(0, 4) and state.reserve(0, epoch, 4, nbytes) is None  # the capacity is full
    assert not waits(0, 1) and state.reserve(0, epoch, 1, nbytes) == NOT_MINE  # not slot 0's: reserve says so
    state.set_cursor(0, 1)
    state.set_cursor(1, 1)
    state.release(1, epoch, 0, staged[0])  # both used batch 0: its row and room are freed
    assert not waits(0, 4) and state.reserve(0, epoch, 4, nbytes) > 0  # full again, with batches 2 and 4
    assert waits(1, 3) and state.reserve(1, epoch, 3, nbytes) is None  # nobody needs batch 3 yet
    assert not waits(1, 1) and state.reserve(1, epoch, 1, nbytes) > 0  # both need batch 1: beyond the capacity
    assert waits(0, STAGING_SLOTS + 2)  # past the window: batch 2, a ring before it, is not consumed yet
    assert state.reserve(0, epoch, STAGING_SLOTS + 2, nbytes) is None
    state.fail(1, "left")
    assert not waits(0, 3) and state.reserve(0, epoch, 3, nbytes) == ALONE  # alone: reserve says so


def test_the_last_member_left_stages_nothing(unlinked):
    state = _group(8, 2)
    epoch = _seal(state, [0, 1])
    assert state.reserve(0, epoch, 0, 10) > 0
    state.fail(1, "left")
    assert state.reserve(0, epoch, 2, 10) == ALONE and state.batches_of(0) == list(range(8))


def test_the_next_epoch_waits_for_the_last_ones_members_until_they_arrive_or_stay_away(unlinked):
    state = _group(4, 3)
    epoch = _seal(state, range(3))
    state.set_cursor(0, 4)
    state.finish(0)
    assert state.arrive(0) == epoch + 1
    state.try_seal(timeout_s=60)
    assert state.epoch_of(0)[0] == epoch and state.awaited(60) == ([1001, 1002], [])  # still consuming
    state.finish(1)
    state.fail(2, "left")
    state.try_seal(timeout_s=60)
    assert state.epoch_of(0)[0] == epoch and state.awaited(60) == ([], [1001])  # finished: may come back
    state.try_seal(timeout_s=0)  # slot 1 did not come back within the timeout: it joins the epoch after
    assert state.epoch_of(0) == (epoch + 1, epoch + 1, 1) and state.batches_of(0) == [0, 1, 2, 3]


# -- the lock-free poll against every interleaving of a row's reuse -----------------------------------


class _Recorder:
    """A ring (numpy array) that records, in order, the stores its users make: ``(ring index, value)``."""

    def __init__(self, ring: np.ndarray):
        self.ring, self.stores = ring, []

    def __getitem__(self, key):
        return _RecordedRow(self, int(key)) if isinstance(key, (int, np.integer)) else self.ring[key]

    def __setitem__(self, key, value):
        self.ring[key] = value
        self.stores.append((key, np.copy(self.ring[key])))


class _RecordedRow:
    def __init__(self, recorder: _Recorder, row: int):
        self.recorder, self.row = recorder, row

    def __getitem__(self, key):
        return self.recorder.ring[self.row][key]

    def __setitem__(self, key, value):
        self.recorder[self.row, key] = value


class _Paused:
    """A ring (numpy array) whose every load, whatever its shape, first calls ``before_load(i)`` (i = 0, 1, ...)."""

    def __init__(self, ring: np.ndarray, before_load):
        self.ring, self.before_load, self.loads = ring, before_load, 0

    def __getitem__(self, key):
        return _PausedRow(self, int(key)) if isinstance(key, (int, np.integer)) else self.load(key)

    def load(self, key):
        self.before_load(self.loads)
        self.loads += 1
        return np.copy(self.ring[key])


class _PausedRow:
    def __init__(self, paused: _Paused, row: int):
        self.paused, self.row = paused, row

    def __getitem__(self, key):
        return self.paused.load((self.row, key))


def _reuse(state: GroupState, epoch: int, batch: int) -> None:
    """The writers' side, each step under the lock: batch ``batch``'s last user releases it, and batch
    ``batch + STAGING_SLOTS`` takes its row and is published."""
    state.set_cursor(1, batch + 1)
    state.release(1, epoch, batch, _row(state, batch)[3])
    state.set_cursor(0, batch + 1)
    seq = state.reserve(0, epoch, batch + STAGING_SLOTS, 10)
    assert state.commit(0, epoch, batch + STAGING_SLOTS, seq)


def _row_stores(state: GroupState, steps, row: int) -> list[tuple]:
    """The stores that ``steps(state)`` makes to ring row ``row``, in order."""
    recorder = _Recorder(state.ring)
    state.ring = recorder
    try:
        steps(state)
    finally:
        state.ring = recorder.ring
    return [(key, value) for key, value in recorder.stores if key[0] == row]


def test_a_poll_never_takes_a_reused_rows_half_written_occupant(unlinked):
    """A consumer polls batch b (or b + 64) without the lock while b's row is freed and reused by b + 64.
    For every interleaving of the writers' stores (in program order, as x86-64 shows them to other cores)
    with the poll's loads, the poll gives None or a seq that the row held, ready, for the polled batch at
    some instant between its first and last load."""
    batch, loads = 3, 4
    state = _group(2 * STAGING_SLOTS, 2)
    epoch = _seal(state, [0, 1])
    state.owners[batch] = state.owners[batch + STAGING_SLOTS] = 0  # slot 0 prepares both
    seq = state.reserve(0, epoch, batch, 10)
    assert state.commit(0, epoch, batch, seq)
    start = bytes(state._buf)
    stores = _row_stores(state, lambda s: _reuse(s, epoch, batch), batch % STAGING_SLOTS)

    state._buf[:] = start
    row_at = [_row(state, batch)]  # the row after each prefix of the stores
    for key, value in stores:
        state.ring[key] = value
        row_at.append(_row(state, batch))
    assert row_at[0] == (batch, epoch, _READY, seq) and row_at[-1][:3] == (batch + STAGING_SLOTS, epoch, _READY)

    reader = GroupState(_Memory(len(state.owners), state._buf))  # another process's view of the segment
    for polled in (batch, batch + STAGING_SLOTS):
        # cuts[i]: how many stores are visible at the poll's load i; later loads see no more.
        for cuts in itertools.combinations_with_replacement(range(len(stores) + 1), loads):
            state._buf[:] = start
            visible = [0]

            def before_load(i, cuts=cuts, visible=visible):
                for key, value in stores[visible[0]:cuts[min(i, loads - 1)]]:
                    state.ring[key] = value
                visible[0] = max(visible[0], cuts[min(i, loads - 1)])

            reader.ring = _Paused(state.ring, before_load)
            got = reader.staged(epoch, polled)
            held = row_at[cuts[0]:visible[0] + 1]
            assert got is None or (polled, epoch, _READY, got) in held, f"poll of batch {polled} with {cuts}: {got}"


def test_a_consumer_confirms_a_poll_under_the_lock(unlinked):
    batch = 3
    state = _group(2 * STAGING_SLOTS, 2)
    epoch = _seal(state, [0, 1])
    state.owners[batch] = state.owners[batch + STAGING_SLOTS] = 0
    old = state.reserve(0, epoch, batch, 10)
    assert not state.holds(epoch, batch, old)  # being written
    assert state.commit(0, epoch, batch, old) and state.holds(epoch, batch, old)
    state.set_cursor(1, batch + 1)
    state.release(1, epoch, batch, old)
    state.set_cursor(0, batch + 1)
    new = state.reserve(0, epoch, batch + STAGING_SLOTS, 10)
    assert not state.holds(epoch, batch, old) and not state.holds(epoch, batch + STAGING_SLOTS, old)
    assert not state.holds(epoch, batch + STAGING_SLOTS, new)  # reserved, not yet published
    assert state.commit(0, epoch, batch + STAGING_SLOTS, new) and state.holds(epoch, batch + STAGING_SLOTS, new)
    assert not state.holds(epoch + 1, batch + STAGING_SLOTS, new)


def test_a_member_gone_takes_the_batches_it_wrote_but_never_staged_along(unlinked):
    """Its written segments (``staging_collate``) go when it dies or leaves; another member's stay, and so do
    those of a member that held its slot before (another join time)."""
    state = _group(4, 3)
    for slot, joined in enumerate((7, 8, 9)):
        state.members[slot, _M_JOINED_NS] = joined
    earlier_in_slot_0 = f"{state.prefix}w0-6-1-a-1"
    written = {slot: f"{state.written_prefix(slot)}1-a-1" for slot in range(3)}
    for name in [earlier_in_slot_0, *written.values()]:
        open(segment_path(name), "w").close()
    assert len({state.written_prefix(slot) for slot in range(3)} | {f"{state.prefix}w0-6-"}) == 4

    assert state.reap(live=[1, 2]) == 2  # slot 0 died
    state.unregister(1, 1001)  # slot 1 left
    assert sorted(os.listdir(shm_dir())) == sorted(os.path.basename(segment_path(n))
                                                   for n in (earlier_in_slot_0, written[2]))
    for name in (earlier_in_slot_0, written[2]):
        os.unlink(segment_path(name))


def test_batches_written_for_members_no_longer_in_the_group_are_strays(unlinked):
    """A dead member's orphaned worker may write a batch after the member was reaped; the next epoch's start
    removes it, and nothing of a member still in the group."""
    state = _group(4, 2)
    for slot, joined in enumerate((7, 8)):
        state.members[slot, _M_JOINED_NS] = joined
    kept = [f"{state.written_prefix(0)}1-a-1", f"{state.written_prefix(1)}3-b-2", f"{state.prefix}5"]  # and staged
    strays = [f"{state.prefix}w0-6-1-a-1", f"{state.prefix}w2-9-1-c-1"]  # slot 0's earlier member; a dead slot 2
    for name in kept + strays:
        open(segment_path(name), "w").close()
    state.remove_strays()
    assert sorted(os.listdir(shm_dir())) == sorted(os.path.basename(segment_path(n)) for n in kept)
    for name in kept:
        os.unlink(segment_path(name))


# -- spare segments (NOTE [ Spare segments ]): real segments in the test's shm folder ------------------------


def _shm_full(size: int, free: int) -> Exception:
    return AssertionError(f"/dev/shm cannot hold a test segment of {size} bytes ({free} free)")


def _files() -> set[str]:
    return set(os.listdir(shm_dir()))


def _spares(state: GroupState) -> set[str]:
    return {os.path.basename(segment_path(f"{state.prefix}r{int(seq):x}")) for seq, size in state.spares if size}


def _staged_files(state: GroupState) -> set[str]:
    rows = state.ring[state.ring[:, _R_STATE] != 0]
    return {os.path.basename(segment_path(staged_name(GROUP, int(seq)))) for seq in rows[:, _R_SEQ]}


class _Copier(_Member):
    """A member whose producer writes each batch into a segment of its own (``reuse``): a new one, or a spare
    taken over, holding (epoch, batch) once committed. Its consumer keeps the last ``hold`` batches it took
    from others open (claimed, as a training loop holds the tensors over them) and checks, as it lets each
    go, that the segment still holds that batch: nobody ever writes a spare somebody maps."""

    def __init__(self, state: GroupState, slot: int, epoch: int, nbytes: int, hold: int):
        super().__init__(state, slot, epoch, nbytes)
        self.hold, self.held = hold, []

    def produce(self) -> None:
        if self.writing is not None:
            batch, seq = self.writing
            segment = _shm.open_unlocked(staged_name(GROUP, seq), claim=False)
            np.frombuffer(segment.buf, np.int64, 2)[:] = (self.epoch, batch)
            segment.close()
            super().produce()
            return
        todo = [b for b in self.state.batches_of(self.slot) if b not in self.published]
        if todo:
            seq = self.state.reserve(self.slot, self.epoch, todo[0], self.nbytes, reuse=True)
            if seq == ALONE:
                self.published.add(todo[0])
            elif seq not in (None, NOT_MINE):
                if not self.state.reused(todo[0], seq):
                    _shm.create_unlocked(staged_name(GROUP, seq), self.nbytes, _shm_full).close()
                self.writing = (todo[0], seq)

    def consume(self) -> None:
        batch = len(self.got)
        if self.done or self.state.owner(batch) == self.slot:
            super().consume()  # its own batches are the producer's originals: nothing mapped
            return
        seq = self.state.staged(self.epoch, batch)
        if seq is None or not self.state.holds(self.epoch, batch, seq):
            return
        self.held.append((_shm.open_unlocked(staged_name(GROUP, seq)), batch))  # claimed, as take_staged does
        super().consume()
        while len(self.held) > self.hold:
            self.let_go()

    def let_go(self) -> None:
        segment, batch = self.held.pop(0)
        assert tuple(np.frombuffer(segment.buf, np.int64, 2)) == (self.epoch, batch), "a mapped batch was rewritten"
        segment.close()


@pytest.mark.parametrize("hold", [0, 3])
@pytest.mark.parametrize("seed", range(3))
def test_spares_are_reused_only_once_nobody_maps_them_and_none_is_lost(seed, hold):
    n, nbytes, capacity = 2 * STAGING_SLOTS + 5, 4096, 10 * 4096
    state = _group(n, 3, capacity)
    rng = random.Random(seed)

    def check():
        assert state.header[_H_SPARE_BYTES] == state.spares[:, 1].sum()
        assert _files() == _staged_files(state) | _spares(state)  # every segment accounted for, none leaked

    for _ in range(2):
        epoch = _seal(state, range(3))
        members = [_Copier(state, slot, epoch, nbytes, hold) for slot in range(3)]
        _run(members, rng, check=check)
        assert all(m.got == list(range(n)) for m in members)
        for m in members:
            while m.held:
                m.let_go()
    assert state.header[_H_PEAK_BYTES] <= capacity + nbytes
    assert state.header[_H_REUSED] > n  # most batches were written into a spare
    assert _files() == _spares(state) and len(_spares(state)) <= SPARE_SLOTS
    _shm.unlink_segments(state.prefix)  # as the last member out does


def _publish(state: GroupState, slot: int, epoch: int, batch: int, nbytes: int, reuse: bool = True) -> int:
    seq = state.reserve(slot, epoch, batch, nbytes, reuse=reuse)
    if not state.reused(batch, seq):
        _shm.create_unlocked(staged_name(GROUP, seq), nbytes, _shm_full).close()
    assert state.commit(slot, epoch, batch, seq)
    return seq


def _take(state: GroupState, slot: int, epoch: int, batch: int) -> _shm.Segment:
    seq = state.staged(epoch, batch)
    segment = _shm.open_unlocked(staged_name(GROUP, seq))
    state.set_cursor(slot, batch + 1)
    state.release(slot, epoch, batch, seq)
    return segment


def test_a_spare_somebody_maps_is_left_alone_and_taken_over_once_let_go():
    nbytes = 8192
    state = _group(8, 2)
    epoch = _seal(state, [0, 1])  # slot 0 prepares the even batches
    first = _publish(state, 0, epoch, 0, nbytes)
    state.set_cursor(0, 1)
    reader = _take(state, 1, epoch, 0)
    mapping = reader.private_map(0, nbytes)  # a tensor over the batch
    reader.close()
    spare = f"{state.prefix}r{first:x}"
    assert _files() == _spares(state) == {os.path.basename(segment_path(spare))}
    assert state.header[_H_SPARE_BYTES] == nbytes and state.header[_H_STAGED_BYTES] == 0

    second = _publish(state, 0, epoch, 2, nbytes)  # the spare is mapped: a new segment
    assert not state.reused(2, second) and state.header[_H_REUSED] == 0
    inode = os.stat(segment_path(spare)).st_ino
    del mapping  # the tensor is gone
    state.set_cursor(0, 3)
    _take(state, 1, epoch, 2).close()
    assert len(_spares(state)) == 2
    third = _publish(state, 0, epoch, 4, nbytes)
    assert state.reused(4, third) and state.header[_H_REUSED] == 1
    assert os.stat(segment_path(staged_name(GROUP, third))).st_ino == inode  # the first batch's segment
    assert not os.path.exists(segment_path(spare)) and state.header[_H_SPARE_BYTES] == nbytes
    assert state.header[_H_STAGED_BYTES] == nbytes
    _shm.unlink_segments(state.prefix)


def test_spares_give_way_to_the_capacity_and_only_copied_published_batches_are_kept():
    nbytes = 4096
    state = _group(16, 3, capacity=2 * nbytes)
    epoch = _seal(state, [0, 1, 2])  # slot 0 prepares batches 0, 3, 6, ...
    for slot in (0, 1, 2):
        state.set_cursor(slot, 1)
    seq = _publish(state, 0, epoch, 0, nbytes)
    _take(state, 1, epoch, 0).close()
    _take(state, 2, epoch, 0).close()  # freed, nobody maps it: an idle spare
    assert _spares(state) and state.header[_H_SPARE_BYTES] == nbytes

    state.set_cursor(2, 3)
    state.set_cursor(0, 3)
    odd = _publish(state, 0, epoch, 3, nbytes // 2)  # another size: a new segment, the idle spare stays
    assert not state.reused(3, odd) and state.header[_H_SPARE_BYTES] == nbytes
    # A new segment that would not fit beside the idle spare takes its room.
    fresh = _publish(state, 0, epoch, 6, nbytes, reuse=False)
    assert not state.reused(6, fresh) and not _spares(state) and state.header[_H_SPARE_BYTES] == 0
    assert not os.path.exists(segment_path(f"{state.prefix}r{seq:x}"))

    # Written batches (reuse=False) and rows a failing member was writing are removed, not kept.
    state.set_cursor(1, 4)
    state.set_cursor(2, 4)
    _take(state, 1, epoch, 3).close()
    _take(state, 2, epoch, 3).close()
    assert state.header[_H_SPARE_BYTES] == nbytes // 2  # the odd-sized copy is kept
    for slot in (1, 2):
        state.set_cursor(slot, 7)
        _take(state, slot, epoch, 6).close()
    assert state.header[_H_SPARE_BYTES] == nbytes // 2  # the written one is not
    writing = state.reserve(0, epoch, 9, nbytes, reuse=True)
    _shm.create_unlocked(staged_name(GROUP, writing), nbytes, _shm_full).close()
    state.fail(0, "died")
    assert _files() == _spares(state) and state.header[_H_SPARE_BYTES] == nbytes // 2
    _shm.unlink_segments(state.prefix)


def _mapped_then_new(nbytes: int, second_bytes: int):
    """A group of 2 (slot 0 prepares the even batches) holding one batch's worth: batch 0 published and taken,
    then batch 2 (``second_bytes``) published while slot 1 still maps batch 0. Returns (state, epoch, batch 0's
    seq, batch 2's seq, slot 1's open batch 0)."""
    state = _group(8, 2, capacity=nbytes)
    epoch = _seal(state, [0, 1])
    first = _publish(state, 0, epoch, 0, nbytes)
    state.set_cursor(0, 1)
    held = _take(state, 1, epoch, 0)  # mapped while the next batch is staged: not idle, not in the way
    return state, epoch, first, _publish(state, 0, epoch, 2, second_bytes), held


def test_a_spare_taken_over_leaves_no_room_to_the_other_idle_ones():
    nbytes = 4096
    state, epoch, first, second, held = _mapped_then_new(nbytes, nbytes // 2)
    state.set_cursor(0, 3)
    _take(state, 1, epoch, 2).close()
    held.close()
    assert len(_spares(state)) == 2 and state.header[_H_SPARE_BYTES] == nbytes + nbytes // 2  # both idle now
    third = _publish(state, 0, epoch, 4, nbytes)
    assert state.reused(4, third) and os.path.exists(segment_path(staged_name(GROUP, third)))
    assert not _spares(state) and not os.path.exists(segment_path(f"{state.prefix}r{second:x}"))  # gave way
    assert state.header[_H_SPARE_BYTES] == 0 and state.header[_H_PEAK_BYTES] <= nbytes + nbytes // 2
    assert first < second < third
    _shm.unlink_segments(state.prefix)


def test_a_producer_waiting_for_room_removes_no_spare():
    nbytes = 4096
    state, epoch, first, _, reader = _mapped_then_new(nbytes, nbytes)  # batch 2 in a new segment
    reader.close()  # batch 0's is idle now
    assert state.reserve(0, epoch, 4, nbytes, reuse=True) is None  # batch 2 fills the staging area
    assert _spares(state) == {os.path.basename(segment_path(f"{state.prefix}r{first:x}"))}  # still there
    assert state.header[_H_SPARE_BYTES] == nbytes
    _shm.unlink_segments(state.prefix)


def test_a_full_spare_table_removes_what_is_freed():
    nbytes = 4096
    state = _group(2 * SPARE_SLOTS + 2, 2)
    epoch = _seal(state, [0, 1])
    readers = []
    for batch in range(0, 2 * SPARE_SLOTS + 2, 2):
        _publish(state, 0, epoch, batch, nbytes)
        state.set_cursor(0, batch + 1)
        readers.append(_take(state, 1, epoch, batch))  # each still mapped: no spare can be taken over
    assert len(_spares(state)) == SPARE_SLOTS and state.header[_H_REUSED] == 0
    assert _files() == _spares(state)  # the batches freed once the table was full are gone
    for reader in readers:
        reader.close()
    _shm.unlink_segments(state.prefix)
