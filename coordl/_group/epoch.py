"""One epoch of an hp_group member: prepare this job's share, publish it, consume every batch in plan order.

NOTE [ Producer and consumer ]
A producer thread pulls this job's share from its own loader (torch's iterator over the job's workers,
or the job's DALI pipeline), publishes each batch into the group's staging area (one copy into shared
memory, or none where the workers wrote the batch into a segment of its own, which is renamed:
``_group.staging`` NOTE [ Written batches ]) and then hands it to this job's consumer (its large
tensors mapped from the segment, or torch's own) without a copy. Batches taken over from a failed member
are prepared in the producer thread itself. The consumer (the training loop's ``next()``) walks the plan
in order: its own batches come from the producer, the others' are mapped copy-on-write from the staging
area (or copied into pinned memory). A private mapping outlives the segment's name, so the slot is freed
as soon as every member has mapped it, and a member's writes to its batch stay its own. A batch is
handed over only once published, so no member runs ahead of the staging window. The consumer takes
another's batch only after confirming under the lock that its ring row still holds it
(NOTE [ Ring rows ] in _group_state); a stale poll is polled again.

NOTE [ Own batches ahead ]
The staging window bounds what a member stages for the others, but not what its producer holds for its
own consumer: a lone member (no other to stage for) or one far ahead of the slowest would hold its whole
share, each batch with its shared memory and file descriptors (torch's worker tensors, or the mappings
of a written segment). So a producer pulls a batch from its loader only while it holds fewer than
``ahead`` of its own batches that its consumer has not taken yet (pulled, published or not), with
``ahead`` what torch keeps in flight for a job without hp_group (num_workers × prefetch_factor, at least
2): whatever the group's size, a member holds about twice what that job holds, besides the others'
batches it maps. One exception keeps the group live: a source whose next batch comes before every held
one (a batch taken over, needed first) may always pull, so the batch the consumer waits for is never
held back by later ones.
"""

import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from coordl._core.settings import LIVENESS_POLL_S
from coordl._group import codec as _batch_codec
from coordl._group.membership import ALONE, NOT_MINE, EpochTicket, HPGroup
from coordl._group.staging import WrittenBatch

logger = logging.getLogger(__name__)

_MAX_POLL_S = 0.005
_JOIN_S = 10.0


@dataclasses.dataclass
class GroupCounters:
    """What this job did in one group epoch (read by the loader for its statistics)."""

    members: int = 0
    delivered_samples: int = 0
    prepared: int = 0
    shared: int = 0
    staging_wait_s: float = 0.0


class _Backoff:
    """Sleeps that double from 0.25 ms up to ``_MAX_POLL_S`` until :meth:`reset`."""

    def __init__(self):
        self.delay = 0.00025

    def reset(self) -> None:
        self.delay = 0.00025

    def sleep(self) -> None:
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, _MAX_POLL_S)


class _Source:
    """Batches this job prepares, in plan order: ``(batch id, batch)`` with at most one pulled ahead."""

    def __init__(self, ids: list[int], batches: Iterator):
        self.ids, self.batches, self.pending, self.done, self.pulled = ids, batches, None, False, 0

    @property
    def wants(self) -> bool:
        """Whether it would pull now (nothing pending, not exhausted)."""
        return self.pending is None and not self.done

    @property
    def next_id(self) -> float:
        """The id of the batch it pulls next (infinity past its last one, where a pull only finds the end)."""
        return self.ids[self.pulled] if self.pulled < len(self.ids) else float("inf")

    def fill(self) -> None:
        try:
            batch = next(self.batches)
        except StopIteration:
            self.done = True
            return
        self.pending = (self.ids[self.pulled], batch, None)
        self.pulled += 1


class _Producer:
    """The producer thread's loop and what it shares with the consumer (see NOTE [ Producer and consumer ])."""

    def __init__(self, group: HPGroup, ticket: EpochTicket, share: Iterator, share_ids: list[int], generation: int,
                 prepare: Callable[[list[list[int]]], Iterator], plan: list[list[int]], counters: GroupCounters,
                 ahead: int):
        self.group, self.epoch, self.plan, self.prepare, self.counters = group, ticket.epoch, plan, prepare, counters
        self.share_ids, self.generation, self.ahead = share_ids, generation, ahead
        self.share = share
        self.ready: dict[int, Any] = {}
        self.consumed = 0  # own batches the consumer took from ready
        self.cond = threading.Condition()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.takeovers: list[Iterator] = []

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # handed to the consumer, which re-raises it in the training loop
            with self.cond:
                self.error = e
                self.cond.notify_all()
        finally:
            self.share = None  # torch's iterator: its workers go with it, or the feed stops them (GroupFeed)
            for batches in self.takeovers:
                close = getattr(batches, "close", None)
                if close is not None:
                    close()

    def _loop(self) -> None:
        sources = [_Source(self.share_ids, self.share)]
        known, generation = set(self.share_ids), self.generation
        backoff, last_check = _Backoff(), time.monotonic()
        while not self.stop.is_set():
            consumed = self.consumed
            if self.group.generation != generation:
                generation = self.group.generation
                taken = [b for b in self.group.batches_of_mine() if b not in known]
                if taken:
                    known.update(taken)
                    self.takeovers.append(self.prepare([self.plan[b] for b in taken]))
                    sources.append(_Source(taken, self.takeovers[-1]))
            for source in sources:
                if source.wants and self._may_pull(source, sources):
                    source.fill()
            pending = sorted((s for s in sources if s.pending is not None), key=lambda s: s.pending[0])
            if any(self._publish(s) for s in pending):
                backoff.reset()
                continue
            if time.monotonic() - last_check > LIVENESS_POLL_S:
                self.group.check_members()
                last_check = time.monotonic()
            if pending:
                backoff.sleep()  # no room in the staging area yet
            else:
                with self.cond:  # held back until its consumer takes a batch (or done)
                    self.cond.wait_for(lambda: self.consumed != consumed, _MAX_POLL_S)

    def _may_pull(self, source: _Source, sources: list[_Source]) -> bool:
        """Whether ``source`` may pull its next batch (NOTE [ Own batches ahead ])."""
        with self.cond:
            held = [*self.ready, *(s.pending[0] for s in sources if s.pending is not None)]
        return len(held) < self.ahead or source.next_id < min(held)

    def _publish(self, source: _Source) -> bool:
        """Stage ``source``'s pending batch if there is room; whether it is done with (published or dropped)."""
        batch_id, batch, encoded = source.pending
        written = isinstance(batch, WrittenBatch)
        if encoded is None and not written:
            encoded = _batch_codec.encode(batch)
            source.pending = (batch_id, batch, encoded)
        seq = self.group.reserve(self.epoch, batch_id, batch.nbytes if written else encoded.nbytes, reuse=not written)
        if seq is None:
            return False
        source.pending = None
        if seq == NOT_MINE:  # (a written batch's segment goes with its WrittenBatch)
            return True
        if written:
            batch = self._stage_written(batch, batch_id, seq)
        elif seq != ALONE:
            segment = self.group.create_staged(seq, encoded.nbytes)
            try:
                _batch_codec.write(encoded, segment.buf, self.epoch, batch_id, write_at=segment.write_at)
            finally:
                segment.close()
        if seq != ALONE and not self.group.commit(self.epoch, batch_id, seq):
            return True
        with self.cond:
            self.ready[batch_id] = batch
            self.counters.prepared += 1
            self.cond.notify_all()
        return True

    def _stage_written(self, written: WrittenBatch, batch_id: int, seq: int):
        """This job's batch ``batch_id`` from the segment its loader wrote, which becomes staged batch ``seq``
        (unless it is :data:`ALONE`): stamped, its large tensors mapped copy-on-write (NOTE [ Written batches ]
        in staging_collate)."""
        segment = self.group.open_written(written.name)
        try:
            _batch_codec.stamp(segment.buf, self.epoch, batch_id)
            batch = _batch_codec.read(segment.buf, self.epoch, batch_id, map_range=segment.private_map)
            if seq != ALONE:
                self.group.stage_written(seq, written.name)
                written.adopted()
        finally:
            segment.close()
        return batch


def _stop(producer: _Producer, thread: threading.Thread, group: HPGroup, finished: list[bool]) -> None:
    """Stop the producer and, unless the epoch was consumed to its end, leave it to the others."""
    producer.stop.set()
    if thread is not threading.current_thread():
        thread.join(_JOIN_S)
    if not finished[0]:
        finished[0] = True
        group.leave_epoch()


class CoordinatedEpoch:
    """Iterator over every minibatch of one group epoch, in the group's plan order.

    Args:
        group: this job's group membership.
        ticket: the epoch, as :meth:`HPGroup.start_epoch` returned it.
        plan: the epoch's batches (sample indices), the same in every member.
        share: this job's share in order: torch's iterator or a ``DaliEpoch``.
        share_ids, generation: the share's batch ids and the generation read before them
            (:meth:`HPGroup.share_of_mine`, read once for ``share`` and here).
        prepare: makes batches (lists of sample indices) in this process, for batches taken over: returns
            an iterator over them, in order, whose ``close()`` (if any) is called when the producer ends.
        counters: where this job's counts for the epoch go.
        pin_memory: copy staged batches into pinned memory.
        ahead: how many of its own batches the producer may hold before the consumer takes them (NOTE [ Own
            batches ahead ]); the loader passes num_workers × prefetch_factor, at least 2.

    Lifecycle: starts a daemon producer thread. Reaching the end, :meth:`close`, an error, or garbage
    collection stops it; an epoch left unfinished is handed to the other members.
    """

    def __init__(self, group: HPGroup, ticket: EpochTicket, plan: list[list[int]], share: Iterator,
                 share_ids: list[int], generation: int, prepare: Callable[[list[list[int]]], Iterator],
                 counters: GroupCounters, pin_memory: bool = False, ahead: int = 2):
        self._group, self._ticket, self._plan, self._pin = group, ticket, plan, pin_memory
        self._counters = counters
        self._next = 0
        self._producer = _Producer(group, ticket, share, share_ids, generation, prepare, plan, counters, ahead)
        self._thread = threading.Thread(target=self._producer.run, name=f"coordl-hp-group-epoch-{ticket.epoch}",
                                        daemon=True)
        self._finished = [False]
        self._close = weakref.finalize(self, _stop, self._producer, self._thread, group, self._finished)
        self._thread.start()

    def __iter__(self) -> "CoordinatedEpoch":
        return self

    @property
    def producer_running(self) -> bool:
        """Whether the producer thread still runs (after :meth:`close`: it outlived the join timeout)."""
        return self._thread.is_alive()

    def __len__(self) -> int:
        return len(self._plan)

    def close(self) -> None:
        """Stop preparing; if the epoch is unfinished, leave it so the others take over. Idempotent."""
        self._close()

    def __next__(self):
        i = self._next
        if i >= len(self._plan) or not self._close.alive:  # the end, or an epoch this job left
            self.close()
            raise StopIteration
        try:
            batch = self._wait_for(i)
        except BaseException:
            self.close()
            raise
        self._next = i + 1
        self._counters.delivered_samples += len(self._plan[i])
        if self._next == len(self._plan):
            self._finished[0] = True
        self._group.advance(self._next)
        if self._finished[0]:
            self.close()
        return batch

    def _wait_for(self, i: int):
        producer, backoff, epoch = self._producer, _Backoff(), self._ticket.epoch
        started = last_check = time.monotonic()
        warned = False
        while True:
            if producer.error is not None:
                raise producer.error
            if self._group.owner(i) == self._ticket.slot:
                with producer.cond:
                    if i in producer.ready:
                        producer.consumed += 1
                        producer.cond.notify_all()
                        return producer.ready.pop(i)
                    producer.cond.wait(_MAX_POLL_S)
            else:
                seq = self._group.staged(epoch, i)
                segment = None if seq is None else self._group.take_staged(epoch, i, seq)
                if segment is not None:
                    batch = self._read_staged(i, segment)
                    self._counters.staging_wait_s += time.monotonic() - started
                    return batch
                backoff.sleep()
            now = time.monotonic()
            if now - last_check > LIVENESS_POLL_S:
                self._group.check_members()
                last_check = now
            if not warned and now - started > self._group.timeout_s:
                self._warn_waiting(i, now - started)
                warned = True

    def _warn_waiting(self, i: int, waited_s: float) -> None:
        owner = self._group.owner(i)
        pid = self._group.pid_of(owner)
        if owner == self._ticket.slot:
            who = f"this job (pid {pid}), whose own loader has not delivered it yet"
        else:
            who = f"the job with pid {pid}, which has not published it yet; still waiting while that job is alive"
        logger.warning("hp_group %r: waited %.0f s for batch %d of epoch %d, prepared by %s", self._group.group,
                       waited_s, i, self._ticket.epoch, who)

    def _read_staged(self, i: int, segment):
        """Another member's batch ``i`` from its taken segment (closed here): copied into pinned memory, else
        its large tensors mapped copy-on-write (no copy) and the rest copied."""
        try:
            batch = _batch_codec.read(segment.buf, self._ticket.epoch, i, pin_memory=self._pin,
                                      map_range=None if self._pin else segment.private_map)
        finally:
            segment.close()
        self._counters.shared += 1
        return batch
