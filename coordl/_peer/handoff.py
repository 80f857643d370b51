"""A process's hand-off queue and its sender thread (the sending itself is ``tier.PeerTier``'s).

NOTE [ Hand-off ]
A server's share of an epoch is random, so with an aggregate cache of about the dataset some caches
fill before their server's share is in while others keep room: without help, what overflowed would be
read from storage again in later epochs. So a process that reads an item no server holds from storage
while its node's cache is full hands the bytes (in the background, never delaying the batch) to the
next server, in turn, that still takes items, with the stamp of the read that produced them; that
server keeps them as if read from its own storage, and the next map exchange makes it the owner. It
declines them if it holds the item already or its own file is missing or another version: where both
servers read the same storage (``_peer.wire`` NOTE [ Peer wire ]), one whose stamp is not the read's,
so a file edited between the read and the hand-off is never kept as current; where it keeps its own
copy of the dataset, one of another length (copies are trusted to hold the same bytes once their
samples matched at the handshake: ``_peer.wire`` NOTE [ Peer wire ]). A server that
answers ``FULL`` (or whose map says frozen) gets no more; one that fails a hand-off gets no more from
that process (its reads are not affected). A process drains its queue (for at most ``HANDOFF_DRAIN_S``) before it exits,
as a torch worker does at its epoch's end, and a rank before it starts an epoch; every live server's
ranks must have started the epoch before any map is taken. So the caches fill up to the sum of their
capacities in epoch 1 and storage is read once, except for what was not handed off in time: an item
past the per-process queue of ``HANDOFF_QUEUE_BYTES``, or the last hand-offs of persistent workers
(which do not exit between epochs) still on their way when the map is taken. Those are read from
storage again in the next epoch, as without hand-offs (a server with room then caches them; one that
received a late hand-off may hold a second copy, wasted capacity, never a wrong byte).
"""


import collections
import logging
import multiprocessing
import multiprocessing.util
import threading

from coordl._core.worker import stop_thread

logger = logging.getLogger(__name__)


HANDOFF_QUEUE_BYTES = 64 * 2**20
"""Bytes a process's hand-offs may queue for its sender (NOTE [ Hand-off ])."""
HANDOFF_IDLE_S = 1.0
"""How long a sender keeps its connections with nothing to hand off."""
HANDOFF_DRAIN_S = 4.0
"""How long an exiting process (or a rank starting an epoch) waits for its hand-offs: less than torch gives
an exiting worker before terminating it (5 s)."""
HANDOFF_JOIN_S = 0.5
"""How long a closing sender, drained, is waited for to end."""


class HandOffQueue:
    """A process's hand-off queue and the daemon thread that drains it into ``send(index, raw, stamp)`` (calling
    ``idle()`` once the queue has stayed empty for :data:`HANDOFF_IDLE_S`); drained (for at most
    :data:`HANDOFF_DRAIN_S`) before the process exits, as a torch worker does at its epoch's end, or when
    closed."""

    def __init__(self, send, idle):
        self._send, self._idle = send, idle
        self._queue, self._bytes, self._busy, self._stopped = collections.deque(), 0, False, False
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="coordl-hand-off", daemon=True)
        self._thread.start()
        self._finalizer = multiprocessing.util.Finalize(self, self.close, exitpriority=0)

    def offer(self, index: int, raw, stamp) -> None:
        """Queue ``raw`` (read with ``stamp``) unless :data:`HANDOFF_QUEUE_BYTES` are queued already (then it
        is dropped)."""
        with self._ready:
            if self._bytes + len(raw) <= HANDOFF_QUEUE_BYTES:
                self._queue.append((index, raw, stamp))
                self._bytes += len(raw)
                self._ready.notify_all()

    def drain(self) -> None:
        """Wait until every queued item is handed off, for at most :data:`HANDOFF_DRAIN_S`."""
        with self._ready:
            self._ready.wait_for(lambda: not self._queue and not self._busy, HANDOFF_DRAIN_S)

    def close(self) -> None:
        """Drain, then stop the thread and wait for it to end: at most :data:`HANDOFF_DRAIN_S` in all plus
        :data:`HANDOFF_JOIN_S` (within torch's 5 s for an exiting worker; a sender still busy past it
        touches no torch, NOTE [ Threads at exit ])."""
        self.drain()
        self._finalizer.cancel()
        stop_thread(self._thread, self._stop, HANDOFF_JOIN_S)

    def _stop(self) -> None:
        """Tell the thread to stop (whatever is still queued is dropped)."""
        with self._ready:
            self._stopped = True
            self._queue.clear()
            self._ready.notify_all()

    def _run(self) -> None:
        connected = False
        while True:
            with self._ready:
                woke = self._ready.wait_for(lambda: bool(self._queue) or self._stopped,
                                            HANDOFF_IDLE_S if connected else None)
                if self._stopped:
                    return
                if woke:
                    index, raw, stamp = self._queue.popleft()
                    self._bytes -= len(raw)
                    self._busy = True
            if not woke:  # nothing to hand off for a while: let go of the connections
                self._idle()
                connected = False
                continue
            try:
                self._send(index, raw, stamp)
            except Exception:  # a hand-off is a favour: losing one costs a later storage read, not a sample
                logger.debug("coordl partitioned caching: handing off item %d failed", index, exc_info=True)
            finally:
                connected = True
                with self._ready:
                    self._busy = False
                    self._ready.notify_all()
