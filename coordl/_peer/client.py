"""The client side of partitioned caching, in whichever process fetches (a DataLoader worker, a DALI fetch
thread, the training process): requests for a minibatch's misses to the servers that own them, hand-offs
of what a full cache cannot take (``_peer.handoff`` NOTE [ Hand-off ]), and this process's connections to
the peers. The ownership map it routes by is the training process's (``_peer.tier`` NOTE [ Ownership ]).

NOTE [ Peer read path ]
In a worker, ``CachedDataset`` looks up a minibatch in the local cache, then sends one request per owning
peer (or, for a rehearsal member no cache holds, the server whose exemplar region holds it: ``lender``) for
the batch's remaining misses but those its own disk tier holds (all sent before any reply is read), reads
the misses no peer holds from storage meanwhile, then collects the replies, and reads from storage
whatever a peer did not deliver. torch keeps ``num_workers x prefetch_factor`` batches in flight,
so requests for later batches of the plan are out while the training loop consumes earlier ones. Each
thread keeps its connection to a peer between batches; one the peer closed meanwhile (idle,
``_peer.server`` NOTE [ Peer server limits ]) is reopened, also one closed as the requests went out (they
go again, once, before any reply). A peer that refuses the connection, breaks the protocol, or does not
deliver a whole reply within ``COORDL_PEER_TIMEOUT_S`` (default 1 s) plus its bytes at ``wire.MIN_RATE``
(a slow link) is marked down for the rest of the epoch in shared memory (so the rank's other workers skip
it at once), logged once, and its items come from storage; every epoch start tries it again. A delivered
item whose stamp is not this server's file's (where the peer reads the same storage) comes from storage
too. An item read from storage because its owner did not deliver it is not cached here, even with room:
its copy is the owner's while the map names it (a server gone from the next map owns nothing, and its
items are then cached where they are read).
"""

import logging
import os
import select
import socket
import threading
import time

import numpy as np

from coordl._core.worker import own_row
from coordl._peer import handoff, wire
from coordl._peer.handoff import HandOffQueue
from coordl._peer.state import (
    C_BYTES,
    C_HANDED,
    C_HANDED_BYTES,
    C_ITEMS,
    C_REQUESTS,
    C_WAIT_NS,
    PeerState,
)
from coordl._peer.topology import Topology

logger = logging.getLogger(__name__)
_threads_lock = threading.Lock()


def _reset_threads_lock() -> None:
    global _threads_lock
    _threads_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_threads_lock)


class PeerClient:
    """A rank's way to the other servers' caches from any of its processes: ``state`` (the map, the peers'
    addresses, which are down, per-process counters), authenticated with ``secret`` and saying ``binding``,
    ``storage_id`` and ``sample`` (``_peer.wire`` NOTE [ Peer wire ]), waiting ``timeout_s`` for a peer.
    Pickled into workers without its connections or sender thread: each process opens its own."""

    def __init__(self, topology: Topology, state: PeerState, secret: bytes, binding: bytes, storage_id: bytes,
                 sample: bytes, timeout_s: float):
        self.topology, self.state, self.secret, self.binding = topology, state, secret, binding
        self.storage_id, self.sample, self.timeout_s = storage_id, sample, timeout_s
        self._threads = None  # (pid, threading.local, every thread's connections): see _connections
        self._hand_off = None  # (pid, HandOffQueue): this process's sender
        self._address_wait_s = 0.0  # how long this process's sender has waited for peer addresses
        self._refused: set[int] = set()  # servers this process's sender stopped handing off to

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_threads": None, "_hand_off": None}

    def request(self, indices: list[int]) -> "PendingFetch":
        """Send requests for ``indices`` (local misses) to the peers that own them; the returned
        :class:`PendingFetch` says which were asked and collects the replies."""
        pending = PendingFetch(self)
        if not indices:
            return pending
        owner, lender, down, me = self.state.owner, self.state.lender, self.state.down, self.topology.node
        by_node: dict[int, list[int]] = {}
        for i in indices:
            node = int(owner[i])
            if node < 0:
                node = int(lender[i])  # a rehearsal member no cache holds, in that server's exemplar region
            if node >= 0 and node != me and not down[node]:
                by_node.setdefault(node, []).append(i)
        for node, ids in by_node.items():
            try:
                if self._send_requests(node, ids):
                    pending.kept.add(node)
            except (OSError, wire.PeerProtocolError) as e:
                self.mark_down(node, e)
                continue
            pending.sent[node] = ids
            pending.asked.update(ids)
        return pending

    def _send_requests(self, node: int, ids: list[int]) -> bool:
        """Ask ``node`` for ``ids``; whether on a connection kept from before (one the server may have closed
        as the requests went out: see :meth:`PendingFetch.collect`)."""
        kept = self._connections().get(node)
        channel = self._connection(node)
        for start in range(0, len(ids), wire.MAX_IDS):
            wire.send_request(channel, ids[start:start + wire.MAX_IDS])
        return channel is kept

    def held_elsewhere(self, index: int) -> bool:
        """Whether this epoch's map says another server caches ``index`` (its copy is there even when it
        does not deliver: a read from storage then adds no second copy here)."""
        owner = int(self.state.owner[index])
        return owner >= 0 and owner != self.topology.node

    def hand_off(self, index: int, raw, stamp) -> None:
        """Offer ``index``'s bytes, just read from storage with ``stamp`` while this node's cache is full, to a
        peer whose cache still takes items (in the background: see ``_peer.handoff`` NOTE [ Hand-off ])."""
        if self.state.owner[index] >= 0:  # a server holds it (down, or its copy stale): no second copy
            return
        full, down = self.state.full, self.state.down
        others = [n for n in range(self.topology.nodes) if n != self.topology.node]
        if all(full[n] or down[n] or n in self._refused for n in others):
            return
        pid = os.getpid()
        with _threads_lock:
            if self._hand_off is None or self._hand_off[0] != pid:
                self._hand_off = (pid, HandOffQueue(self._hand_to_a_peer, self._close_thread_connections))
                self._address_wait_s, self._refused = 0.0, set()
        self._hand_off[1].offer(index, raw, stamp)

    def _hand_to_a_peer(self, index: int, raw: bytes, stamp) -> None:
        """In the sender thread: give ``index`` to the first server after this one that keeps it. While no
        server that may take it has an address yet (at the first epoch's start, servers come up together),
        it waits for one, for at most ``handoff.HANDOFF_DRAIN_S`` in this process's life. A server that fails a
        hand-off (slow, gone, broken) gets no more from this process; reads find out for themselves."""
        t, state = self.topology, self.state
        row = self.counters_row()
        while True:
            candidates = [(t.node + step) % t.nodes for step in range(1, t.nodes)]
            candidates = [n for n in candidates if not state.full[n] and not state.down[n] and n not in self._refused]
            if not candidates or any(state.address(n) is not None for n in candidates):
                break
            if self._address_wait_s >= handoff.HANDOFF_DRAIN_S:
                return
            time.sleep(0.05)
            self._address_wait_s += 0.05
        for node in candidates:
            if state.full[node] or state.down[node] or node in self._refused or state.address(node) is None:
                continue
            try:
                channel = self._connection(node)
                wire.send_keep(channel, index, raw, stamp)
                outcome = wire.read_kept(channel, index, time.monotonic() + self.timeout_s)
            except (OSError, wire.PeerProtocolError) as e:
                self._refused.add(node)
                self._close_connection(node)
                logger.debug("coordl partitioned caching: no more hand-offs to server %d: %s", node, e)
                continue
            if outcome == wire.FULL:
                state.full[node] = 1
                continue
            if outcome == wire.STORED:
                row[node, C_HANDED] += 1
                row[node, C_HANDED_BYTES] += len(raw)
            return

    def _close_connection(self, node: int) -> None:
        conn = self._connections().pop(node, None)
        if conn is not None:
            conn.close()

    def _close_thread_connections(self) -> None:
        """Close the calling thread's connections (the sender's, once its queue is empty)."""
        for node in list(self._connections()):
            self._close_connection(node)

    def _connections(self) -> dict[int, wire.Channel]:
        """This thread's connections to the peers, by server: a connection is never shared by threads (the
        DALI backend fetches from several) nor inherited over fork."""
        with _threads_lock:
            if self._threads is None or self._threads[0] != os.getpid():
                self._threads = (os.getpid(), threading.local(), [])
            local = self._threads[1]
            if not hasattr(local, "conns"):
                local.conns = {}
                self._threads[2].append(local.conns)
            return local.conns

    def _connection(self, node: int) -> wire.Channel:
        """This thread's connection to ``node``: the one it keeps, unless the server closed it meanwhile (idle:
        ``_peer.server`` NOTE [ Peer server limits ]), else a new one."""
        conns = self._connections()
        channel = conns.get(node)
        if channel is not None and select.select([channel.sock], [], [], 0)[0]:  # between replies: closed
            self._close_connection(node)
            channel = None
        if channel is None:
            address = self.state.address(node)
            if address is None:
                raise ConnectionError(f"server {node}'s address is unknown")
            conn = socket.create_connection(address, timeout=self.timeout_s)
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                channel = wire.client_handshake(conn, self.secret, time.monotonic() + self.timeout_s, self.storage_id,
                                                self.binding, self.sample)
            except BaseException:
                conn.close()
                raise
            conn.settimeout(self.timeout_s)
            conns[node] = channel
        return channel

    def mark_down(self, node: int, error: BaseException) -> None:
        """Drop the connection to ``node`` and mark it down for the rest of the epoch (every process of this
        rank skips it), saying so once."""
        self._close_connection(node)
        if not self.state.down[node]:
            self.state.down[node] = 1
            self.say_down(node, f"{type(error).__name__}: {error}")

    def say_down(self, node: int, why: str) -> None:
        """Log that ``node`` is down, the first time any process of this rank finds it so."""
        if self.state.warned[node]:
            logger.debug("coordl partitioned caching: server %d is still down (%s)", node, why)
            return
        self.state.warned[node] = 1
        address = self.state.address(node)
        logger.warning("coordl partitioned caching: server %d (%s) is down (%s); its cached items come from storage, "
                       "and it is tried again at every epoch start (said once)", node,
                       "%s:%d" % address if address else "address unknown", why)

    def counters_row(self) -> np.ndarray:
        """This process's per-node counters (a writable numpy view)."""
        table = self.state.counters
        return table[own_row(len(table))]

    def drain_hand_offs(self) -> None:
        """Wait until this process's queued hand-offs are sent (at most ``handoff.HANDOFF_DRAIN_S``)."""
        if self._hand_off is not None and self._hand_off[0] == os.getpid():
            self._hand_off[1].drain()

    def close(self) -> None:
        """Stop this process's sender (once its queue is drained) and close its connections."""
        if self._hand_off is not None and self._hand_off[0] == os.getpid():
            self._hand_off[1].close()
            self._hand_off = None
        threads = self._threads
        if threads is not None and threads[0] == os.getpid():
            for conns in threads[2]:
                for conn in conns.values():
                    conn.close()
                conns.clear()


class PendingFetch:
    """Requests sent to peers for some misses of a minibatch: ``asked`` (the ids sent), then ``collect()`` or,
    if the batch fails before, ``abandon()``."""

    def __init__(self, client: "PeerClient"):
        self.client, self.sent, self.asked = client, {}, set()
        self.kept: set[int] = set()  # the servers asked on a connection kept from before
        self._started = time.monotonic_ns()

    def collect(self) -> dict[int, tuple]:
        """The items peers delivered, checked (see ``_peer.wire``), as (bytes, the stamp the peer's copy was
        stored with, or None where its stamps do not compare with this server's); an id missing here comes
        from storage. A peer's whole reply must arrive within ``COORDL_PEER_TIMEOUT_S`` plus its bytes at
        ``wire.MIN_RATE``; a kept connection found closed before any reply (the server dropped it as idle
        while the requests went out) is reopened and the requests sent again, once."""
        got, client = {}, self.client
        row = client.counters_row() if self.sent else None
        for node, ids in self.sent.items():
            received = items = 0
            retry = node in self.kept
            while True:
                try:
                    channel = client._connections()[node]
                    for start in range(0, len(ids), wire.MAX_IDS):
                        deadline = time.monotonic() + client.timeout_s
                        for index, data, stamp in wire.read_reply(channel, ids[start:start + wire.MAX_IDS],
                                                                  deadline):
                            items += 1
                            if data is not None:
                                got[index] = data, stamp
                                received += len(data)
                                row[node, C_ITEMS] += 1
                except (OSError, KeyError, wire.PeerProtocolError) as e:
                    closed = isinstance(e, ConnectionError) and not isinstance(e, wire.PeerProtocolError)
                    if retry and closed and not items:
                        retry = False
                        try:
                            client._close_connection(node)
                            client._send_requests(node, ids)
                            continue
                        except (OSError, wire.PeerProtocolError) as again:
                            e = again
                    client.mark_down(node, e)
                break
            row[node, C_BYTES] += received
            row[node, C_REQUESTS] += 1
            row[node, C_WAIT_NS] += time.monotonic_ns() - self._started
        return got

    def abandon(self) -> None:
        """Drop the connections whose replies will not be read (the next request opens new ones)."""
        conns = self.client._connections()
        for node in self.sent:
            conn = conns.pop(node, None)
            if conn is not None:
                conn.close()
