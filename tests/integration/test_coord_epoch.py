"""hp_group epochs in one process: members are HPGroup handles of their own (each its own descriptor, so its
own lock), driven from threads; one job in a real process where a limit of the process matters."""

import logging
import os
import secrets
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import coordl
from coordl._group import membership as coord_prep
from coordl._group.epoch import CoordinatedEpoch, GroupCounters
from coordl._group.membership import HPGroup
from coordl._group.state import _M_ARRIVED_FOR
from tests import _procs
from tests._signals import FileQueue

_WAIT_S = 30  # for something that happens at once, or a timeout of a fraction of a second later


@pytest.fixture
def members():
    """``members(k, n_batches, **HPGroup options)``: k joined members of a new group, left at the end."""
    made = []

    def make(k: int, n_batches: int, **options) -> list[HPGroup]:
        name = f"test-{secrets.token_hex(4)}"
        groups = [HPGroup(name, config={"batch_size": "1"}, n_batches=n_batches, seed=1, staging_bytes=1 << 20,
                          **options) for _ in range(k)]
        made.extend(groups)
        for group in groups:
            group.join()
        return groups

    yield make
    for group in made:
        group.close()


def _start_together(groups: list[HPGroup]) -> list[coord_prep.EpochTicket]:
    with ThreadPoolExecutor(len(groups)) as pool:
        return [f.result(_WAIT_S) for f in [pool.submit(g.start_epoch) for g in groups]]


def _made(batches: list[list[int]]):
    """Batches prepared in this process: each a tensor of its sample indices."""
    return (torch.tensor(indices) for indices in batches)


def _epoch(group: HPGroup, ticket, plan: list[list[int]], share=None, ahead: int = 2) -> CoordinatedEpoch:
    generation, mine = group.share_of_mine()
    share = _made([plan[b] for b in mine]) if share is None else share
    return CoordinatedEpoch(group, ticket, plan, share, mine, generation, _made, GroupCounters(), ahead=ahead)


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        time.sleep(0.005)


class _OnWarning(logging.Handler):
    """Sets ``seen`` at coordl's first warning that contains ``text``."""

    def __init__(self, text: str):
        super().__init__(logging.WARNING)
        self.text, self.seen = text, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.seen.set()


@pytest.fixture
def on_warning():
    handlers = []

    def attach(text: str) -> _OnWarning:
        handlers.append(_OnWarning(text))
        logging.getLogger("coordl").addHandler(handlers[-1])
        return handlers[-1]

    yield attach
    for handler in handlers:
        logging.getLogger("coordl").removeHandler(handler)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# -- the ring: a stale poll ---------------------------------------------------------------------------------


def test_a_stale_poll_is_polled_again_not_raised(members):
    """A poll that returns a sequence number the batch's row no longer (or not yet) holds must not make
    the consumer map another segment or fail: it is confirmed under the lock and polled again."""
    n = 20
    a, b = members(2, n, expected_members=2)
    tickets = _start_together([a, b])
    plan = [[i, 100 + i] for i in range(n)]
    polled, stale_once = b.staged, set()

    def stale(epoch, batch):  # first the previous sequence number: another batch's segment, or one gone
        seq = polled(epoch, batch)
        if seq is None or batch in stale_once:
            return seq
        stale_once.add(batch)
        return seq - 1

    b.staged = stale
    with ThreadPoolExecutor(1) as pool:
        got_a = pool.submit(lambda: [x.tolist() for x in _epoch(a, tickets[0], plan)])
        got_b = [x.tolist() for x in _epoch(b, tickets[1], plan)]
        assert got_a.result(_WAIT_S) == got_b == plan
    assert stale_once == set(range(0, n, 2))  # a's batches, each polled stale once


def test_a_producer_polling_for_room_leaves_the_lock_to_the_others(members):
    """A reserve that finds no room, read without the lock, returns at once while another member holds the
    group's lock; one that finds room waits for the lock and takes it."""
    a, b = members(2, 8, expected_members=2)
    ticket, _ = _start_together([a, b])
    first, later = a.batches_of_mine()[:2]
    big = 2 << 20  # more than the 1 MiB staging area: only the batch every member needs next is admitted
    with ThreadPoolExecutor(1) as pool:
        with b._locked():
            assert pool.submit(a.reserve, ticket.epoch, later, big).result(_WAIT_S) is None
            admitted = pool.submit(a.reserve, ticket.epoch, first, 1)
            time.sleep(0.2)
            assert not admitted.done()  # room: it waits for b's lock
        assert admitted.result(_WAIT_S) > 0


# -- interrupted epoch starts ---------------------------------------------------------------------------------


def test_a_job_interrupted_while_waiting_for_an_epoch_takes_its_arrival_back(members, monkeypatch):
    a, b = members(2, 6, expected_members=2, timeout_s=0.3)

    def ctrl_c(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(coord_prep, "time", types.SimpleNamespace(monotonic=time.monotonic, sleep=ctrl_c))
    with pytest.raises(KeyboardInterrupt):
        a.start_epoch()  # arrives, then Ctrl-C while it waits for a second job
    monkeypatch.setattr(coord_prep, "time", time)
    ticket = b.start_epoch()  # waits up to hp_group_timeout_s for a second job, then starts alone
    assert ticket.members == 1 and b.batches_of_mine() == list(range(6))


def test_a_job_interrupted_as_its_epoch_starts_leaves_it_to_the_others(members, monkeypatch):
    a, b = members(2, 6, expected_members=2)
    ticket = coord_prep.EpochTicket

    def interrupted_for_a(epoch, count, slot, seed):  # Ctrl-C after the epoch started with a, before a knew
        if slot == a._slot:
            raise KeyboardInterrupt
        return ticket(epoch, count, slot, seed)

    monkeypatch.setattr(coord_prep, "EpochTicket", interrupted_for_a)
    with ThreadPoolExecutor(1) as pool:
        b_ticket = pool.submit(b.start_epoch)
        with pytest.raises(KeyboardInterrupt):
            a.start_epoch()
        assert b_ticket.result(_WAIT_S).members == 2
    assert b.batches_of_mine() == list(range(6))  # a left the epoch: b prepares a's share too
    epoch = _epoch(b, b_ticket.result(), [[i] for i in range(6)])
    assert [x.tolist() for x in epoch] == [[i] for i in range(6)]


# -- own batches held ahead -------------------------------------------------------------------------------------


class _CountingFiles(_procs.IndexFiles):
    """IndexFiles that counts the samples it decoded."""

    decoded = 0

    def decode_raw(self, index: int, raw: bytes):
        self.decoded += 1
        return super().decode_raw(index, raw)


def test_a_lone_member_holds_few_batches_ahead_of_its_training_loop(tmp_path):
    n, batch_size = 60, 4
    root = str(tmp_path / "files")
    _procs.IndexFiles.write(root, n)
    dataset = _CountingFiles(root, n)
    group = f"test-{secrets.token_hex(4)}"
    with coordl.DataLoader(dataset, batch_size=batch_size, shuffle=True, cache_bytes=0, hp_group=group) as loader:
        batches = iter(loader)  # a lone member, num_workers=0: it may hold 2 batches ahead
        time.sleep(0.3)  # a producer without a bound prepares the whole epoch meanwhile
        held = []
        for consumed, _ in enumerate(batches, 1):
            held.append(dataset.decoded // batch_size - consumed)
            time.sleep(0.01)  # a training step
    assert consumed == n // batch_size and max(held) <= 2, held


def test_batches_taken_over_are_prepared_even_with_the_own_bound_reached(members):
    """The producer holds 2 own batches (0 and 2) when the other member leaves and its odd batches become
    this one's: the taken-over batch 1 comes before every held one, so it is prepared beyond the bound."""
    n = 12
    a, b = members(2, n, expected_members=2)
    ticket, _ = _start_together([a, b])
    plan = [[i] for i in range(n)]
    assert a.batches_of_mine() == list(range(0, n, 2))
    epoch = _epoch(a, ticket, plan, ahead=2)
    _until(lambda: sorted(epoch._producer.ready) == [0, 2], "the producer holds 2 batches")
    b.leave_epoch()
    assert [x.tolist() for x in epoch] == plan


def _written(shm: str) -> set[str]:
    """Segments that workers wrote batches into and that are not staged (``staging_collate``)."""
    return {name for name in os.listdir(shm) if "_sw" in name}


@pytest.mark.slow
@pytest.mark.parametrize("persistent, context", [(False, "spawn"), (True, "fork")])
def test_batches_written_for_an_epoch_left_early_are_removed_as_the_next_begins(tmp_path, shm_namespace, persistent,
                                                                                context):
    """Leaving an epoch after one batch, the workers have written the batches torch keeps asked for (prefetch
    factor × workers) into segments that sit in torch's queue, never received; the next epoch removes them
    (the last epoch's workers stopped, or torch's drain of persistent ones), and sees every sample once."""
    n, workers, prefetch = 60, 2, 2
    root = str(tmp_path / "files")
    _procs.IndexFiles.write(root, n)
    with coordl.DataLoader(_procs.IndexFiles(root, n), batch_size=4, shuffle=True, cache_bytes=0,
                           hp_group=f"test-{secrets.token_hex(4)}", num_workers=workers, prefetch_factor=prefetch,
                           persistent_workers=persistent, multiprocessing_context=context) as loader:
        indices, _, _ = next(iter(loader))
        assert len(indices) == 4
        _until(lambda: len(_written(shm_namespace)) == workers * prefetch, "the workers' unreceived batches")
        time.sleep(0.2)
        left = _written(shm_namespace)
        assert len(left) == workers * prefetch  # no more: the producer holds its few batches, mapped
        epoch = iter(loader)
        seen = next(epoch)[0].tolist()
        assert not left & _written(shm_namespace)
        seen += [i for indices, _, _ in epoch for i in indices.tolist()]
        assert sorted(seen) == list(range(n))
        assert not _written(shm_namespace)


@pytest.mark.slow
def test_a_lone_member_with_workers_stays_within_128_open_files(tmp_path):
    """torch's worker tensors each keep a descriptor while held: a lone member whose producer ran ahead of a
    slow training loop to the end of its epoch (150 batches of 3 tensors), or whose batches lingered until
    the garbage collector ran, would run out of them; the job holds a few batches and stays well within."""
    n = 600
    root = str(tmp_path / "files")
    _procs.IndexFiles.write(root, n)
    results = FileQueue(tmp_path)
    options = dict(num_workers=2, cache_bytes=0, step_s=0.02, max_open_files=128)
    proc = _procs.spawn(_procs.hp_job, root, n, f"test-{secrets.token_hex(4)}", 1, results, options)
    _, seen, stats = results.get(timeout=_procs.JOIN_TIMEOUT * 2)
    _procs.join_ok(proc)
    assert sorted(i for indices, _ in seen[0][1] for i in indices) == list(range(n))
    assert stats["epochs"][0]["members"] == 1


# -- who waits for whom -------------------------------------------------------------------------------------------


def test_a_wait_for_another_jobs_batch_names_that_job(members, caplog, on_warning):
    n = 4
    a, b = members(2, n, expected_members=2, timeout_s=0.2)
    _, ticket = _start_together([a, b])
    warned = on_warning("batch 0 of epoch 1")
    with caplog.at_level(logging.WARNING, logger="coordl"), ThreadPoolExecutor(1) as pool:
        got = pool.submit(lambda: [x.tolist() for x in _epoch(b, ticket, [[i] for i in range(n)])])
        assert warned.seen.wait(_WAIT_S)  # a prepares batch 0 but never publishes it
        a.leave_epoch()  # then leaves: b takes its share over
        assert got.result(_WAIT_S) == [[i] for i in range(n)]
    [message] = [m for m in _warnings(caplog) if "batch 0" in m]
    assert f"prepared by the job with pid {os.getpid()}, which has not published it yet" in message


def test_a_wait_for_its_own_batch_says_so(members, caplog, on_warning):
    [a] = members(1, 3, timeout_s=0.2)
    ticket = a.start_epoch()
    warned = on_warning("batch 0 of epoch 1")

    def slow_share():  # this job's own loader, stuck until the warning
        assert warned.seen.wait(_WAIT_S)
        yield from _made([[0], [1], [2]])

    with caplog.at_level(logging.WARNING, logger="coordl"):
        assert [x.tolist() for x in _epoch(a, ticket, [[0], [1], [2]], share=slow_share())] == [[0], [1], [2]]
    [message] = [m for m in _warnings(caplog) if "batch 0" in m]
    assert f"prepared by this job (pid {os.getpid()}), whose own loader has not delivered it yet" in message


def test_an_epoch_boundary_wait_names_the_jobs_still_in_the_last_epoch(members, caplog, on_warning):
    n = 4
    a, b = members(2, n, expected_members=2, timeout_s=0.2)
    _start_together([a, b])
    b.advance(n)  # b consumed epoch 1; a is still in it
    warned = on_warning("for epoch 2 to start")
    with caplog.at_level(logging.WARNING, logger="coordl"), ThreadPoolExecutor(1) as pool:
        second = pool.submit(b.start_epoch)
        assert warned.seen.wait(_WAIT_S)
        a.advance(n)  # a finishes epoch 1 and does not come back: epoch 2 starts without it
        assert second.result(_WAIT_S).members == 1
    [message] = [m for m in _warnings(caplog) if "for epoch 2 to start" in m]
    assert f"job(s) with pid(s) {os.getpid()} still consume epoch 1" in message


def test_a_first_epoch_that_starts_short_of_hp_group_size_says_so(members, caplog):
    [a] = members(1, 3, expected_members=3, timeout_s=0.2)
    with caplog.at_level(logging.WARNING, logger="coordl"):
        assert a.start_epoch().members == 1
    assert any("epoch 1 started with 1 of the 3 jobs hp_group_size asks for" in m for m in _warnings(caplog))


def test_members_resuming_a_group_start_it_at_their_epoch_with_their_seed(members):
    a, b = members(2, n_batches=3, expected_members=2, timeout_s=_WAIT_S)
    assert a.resume_at(5, 99) and b.resume_at(5, 99)  # both load the same checkpoint
    assert [(t.epoch, t.seed) for t in _start_together([a, b])] == [(5, 99), (5, 99)]
    assert a.seed == b.seed == 99
    assert not a.resume_at(9, 7)  # the group runs: a late state cannot move it


def test_the_resumed_first_epoch_waits_for_hp_group_size(members):
    a, b = members(2, n_batches=3, expected_members=2, timeout_s=_WAIT_S)
    assert a.resume_at(4, 11)
    with ThreadPoolExecutor(1) as pool:
        alone = pool.submit(a.start_epoch)
        with pytest.raises(TimeoutError):
            alone.result(0.5)  # the group's first epoch is 4 now: it waits for the second job
        assert b.start_epoch().epoch == 4 and alone.result(_WAIT_S).epoch == 4


def test_a_state_cannot_move_a_group_a_member_already_waits_in(members):
    a, b = members(2, n_batches=3, expected_members=2, timeout_s=_WAIT_S)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(a.start_epoch)  # arrived for epoch 1
        _until(lambda: a._state.members[a._slot, _M_ARRIVED_FOR] == 1, "a arrives")
        assert not b.resume_at(5, 99)
        assert b.start_epoch().epoch == 1 and waiting.result(_WAIT_S).epoch == 1
