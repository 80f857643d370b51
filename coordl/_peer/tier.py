"""Partitioned caching: the MinIO caches of a multi-server job as one aggregate cache (CoorDL §6.2).

In data-parallel training each server's shard changes every epoch, so a server misses on items another
server caches. Here a local miss is fetched from the server that caches the item, over TCP, before
falling back to storage: with aggregate cache >= dataset, storage is read once per training run.

NOTE [ Ownership ]
Epoch 1 fills each server's cache with what its ranks fetched, as on one server. At the start of every
later epoch, until the map is final, the servers exchange what they hold through torch.distributed's
store (torchrun's rendezvous ``TCPStore``, keys under ``coordl/<run id>/<restart>/<dataset>/<k>/``, where
``<dataset>`` is the number of items and a digest of the class folders and names of 1024 sampled files,
the same for every server's copy of the dataset, and ``<k>`` counts this process's loaders of it):
  * every rank sets ``e<epoch>/ready/<node>/<local rank>``: its previous epoch is over, so its inserts (and
    hand-offs, NOTE [ Hand-off ]) are in;
  * each node's local rank 0 waits for the ranks of every server that is up, then sets
    ``e<epoch>/map/<node>``: whether its cache is frozen, and zlib of its cache's ready bitmap (1 bit per item);
  * every rank reads every node's map and computes ``owner[i]`` = the lowest node holding item ``i``
    (-1: no node), identical on every rank. It lives in shared memory (:class:`PeerState`) that the
    rank's DataLoader workers read.
The map is final once every item has an owner or every cache is frozen (nothing can change after);
later epochs exchange nothing. Duplicates are avoided at the source: an item fetched from a peer is
never inserted in the local cache, so after epoch 1 a cache takes only items no server holds (read from
storage). Cost per exchange, per rank: reading ``nodes`` maps of at most N/8 bytes before compression;
at 1.28M items over 64 servers a server's random 1/64 share is a 160 KB bitmap that compresses to 36 KB,
so 2.3 MB per rank (1.2 GB served by the store to 512 ranks), once or a few times per run.

NOTE [ Peer read path ]
In a worker, ``CachedDataset`` looks up a minibatch in the local cache, then sends one request per
owning peer for the batch's remaining misses (all sent before any reply is read), reads the misses no
peer holds from storage meanwhile, then collects the replies, and reads from storage whatever a peer
did not deliver. torch keeps ``num_workers x prefetch_factor`` batches in flight, so requests for
later batches of the plan are out while the training loop consumes earlier ones. Each thread keeps its
connection to a peer between batches; one the peer closed meanwhile (idle, ``_peer.server`` NOTE [ Peer
server limits ]) is reopened, also one closed as the requests went out (they go again, once, before any
reply). A peer that refuses the connection, breaks the protocol, or does not deliver a whole reply
within ``COORDL_PEER_TIMEOUT_S`` (default 1 s) plus its bytes at ``wire.MIN_RATE`` (a slow link) is
marked down for the rest of the epoch in shared memory (so the rank's other workers skip it at
once), logged once, and its items come from storage; every epoch start tries it again. A delivered
item whose stamp is not this server's file's (where the peer reads the same storage) comes from
storage too. An item read from storage because its owner did not deliver it is not cached here, even
with room: its copy is the owner's while the map names it (a server gone from the next map owns
nothing, and its items are then cached where they are read).

NOTE [ Threads at exit ]
A daemon thread inside a call into torch (a tensor op, a store request: torch lets go of the GIL there)
when the interpreter starts finalizing aborts the whole process as the call returns ("terminate called
without an active exception", SIGABRT): CPython then ends the thread by unwinding through torch's C++
frames. So the two background threads here are kept out of torch: the hand-off sender touches only
numpy views of :class:`PeerState` and sockets, and is stopped and joined when its process exits
(multiprocessing's exit hook, which a torch worker also runs); the address learner, which must ask the
store, waits there in short calls (``ADDRESS_WAIT_S``) between which it looks at a stop flag, and is
stopped and joined at exit (a ``weakref.finalize``) before finalization begins.
"""


import datetime
import hashlib
import logging
import os
import select
import socket
import threading
import time
import weakref

import numpy as np
import torch
import torch.distributed

from coordl._core.worker import own_row, stop_thread
from coordl._peer import handoff, wire
from coordl._peer import server as peer_server
from coordl._peer.handoff import HandOffQueue
from coordl._peer.launch import start_server
from coordl._peer.maps import decode_map, encode_map, owners_of
from coordl._peer.secret import job_secret, loader_binding
from coordl._peer.state import C_BYTES, C_HANDED, C_HANDED_BYTES, C_ITEMS, C_REQUESTS, C_WAIT_NS, PeerState
from coordl._peer.topology import (
    EXCHANGE_ENV,
    EXCHANGE_TIMEOUT_S,
    PEER_TIMEOUT_S,
    TIMEOUT_ENV,
    Topology,
    seconds_setting,
)

logger = logging.getLogger(__name__)

STORE_UP_S = 5.0
"""How long a rank waits for the rendezvous store to accept once torch.distributed's group is up."""
ADDRESS_WAIT_S = 0.5
"""The longest single wait of the address learner for a peer server's address in the store."""
ADDRESS_RETRY_S = 0.05
"""How long the address learner pauses between two waits."""
THREAD_JOIN_S = 2.0  # > ADDRESS_WAIT_S
"""How long a stopping process waits for the address learner to end (NOTE [ Threads at exit ])."""
CLOSE_WAIT_S = 10.0
"""How long a closing peer server keeps serving for the other servers' ranks still loading."""
_loaders_built: dict[str, int] = {}  # per dataset: partitioned loaders this process built
_built_lock = threading.Lock()
_threads_lock = threading.Lock()


def _reset_threads_lock() -> None:
    global _threads_lock
    _threads_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_threads_lock)


def _store(topology: Topology, prefix: str, wait_s: float):
    """The rendezvous store under ``prefix``, once its port accepts a connection: within ``wait_s``, else a
    ``RuntimeError`` naming it (torch's own client would take about twice its timeout to say so)."""
    import torch.distributed as dist
    address, deadline = (topology.master_addr, topology.master_port), time.monotonic() + wait_s
    while True:
        try:
            socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic())).close()
            break
        except OSError as e:
            if time.monotonic() >= deadline:
                raise RuntimeError(f"coordl partitioned caching: the rendezvous store at MASTER_ADDR:MASTER_PORT "
                                   f"{address[0]}:{address[1]} did not accept a connection within {wait_s:g} s ({e}); "
                                   f"launch with torchrun, or set MASTER_ADDR and MASTER_PORT to torch.distributed's "
                                   f"store ({EXCHANGE_ENV} sets the wait)") from None
            time.sleep(ADDRESS_RETRY_S)
    store = dist.TCPStore(*address, is_master=False, timeout=datetime.timedelta(seconds=EXCHANGE_TIMEOUT_S))
    return dist.PrefixStore(prefix, store)


def _store_wait_s(exchange_s: float) -> float:
    """How long a rank waits for the rendezvous store to accept: :data:`STORE_UP_S` once torch.distributed's
    group is up (its store is then up: a refusal means a wrong address), else ``exchange_s`` (rank 0 may
    not have started it yet)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return min(STORE_UP_S, exchange_s)
    return exchange_s


class PeerTier:
    """A rank's part in partitioned caching: the ownership map and peer addresses (exchanged by the
    training process at epoch starts, see NOTE [ Ownership ]), this node's peer server (started by local
    rank 0), and the client side of the read path (in whichever process fetches, see NOTE [ Peer read path ]).

    Args:
        topology: this rank's place in the job.
        cache: this node's MinIO cache of the dataset.
        source, storage: the dataset's raw keys and where they are read (the peer server checks its
            items against their files as a local hit is checked).
        processes: rows of per-process counters (the loader's workers + 1).
    """

    def __init__(self, topology: Topology, cache, source, storage, processes: int):
        dataset = f"{len(source)}-{_names_digest(source)}"
        with _built_lock:
            ordinal = _loaders_built.get(dataset, 0)
            _loaders_built[dataset] = ordinal + 1
        self.topology, self.n_items = topology, len(source)
        self.prefix = f"coordl/{topology.run}/{dataset}/{ordinal}/"
        self.state = PeerState(self.n_items, topology.nodes, processes)
        self.timeout_s = seconds_setting(TIMEOUT_ENV, PEER_TIMEOUT_S)
        self.exchange_s = seconds_setting(EXCHANGE_ENV, EXCHANGE_TIMEOUT_S)
        self._store = _store(topology, self.prefix, _store_wait_s(self.exchange_s))
        self.secret = job_secret(topology)
        self.binding = loader_binding(self._store, self.prefix)
        self.storage_id = peer_server.storage_id(storage, source.raw_key(0) if self.n_items else None)
        self.sample = peer_server.copy_sample(storage, source)
        self._cache, self._server = cache, None
        self._maps_known = 0  # the last epoch begun
        self._absent: set[int] = set()  # servers missing from the last map: not waited for again
        self._said_missing: tuple = ()
        self._threads = None  # (pid, threading.local, every thread's connections): see _connections
        self._hand_off = None  # (pid, HandOffQueue): this process's sender
        self._address_wait_s = 0.0  # how long this process's sender has waited for peer addresses
        self._refused: set[int] = set()  # servers this process's sender stopped handing off to
        if topology.local_rank == 0:
            cache.mark_partition(topology.node, topology.nodes)
            limits = peer_server.job_limits(topology.nodes, topology.local_world, processes)
            self._server = start_server(cache, source, storage, self.secret, (self.storage_id, self.sample),
                                         self.binding, limits, topology, sum(_loaders_built.values()) - 1)
            host, port = self._server.address
            self.state.set_address(topology.node, f"{host}:{port}")  # checks that it fits, here where it is made
            self._store.set(f"addr/{topology.node}", f"{host}:{port}")

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.update(_store=None, _server=None, _cache=None, _threads=None, _hand_off=None)
        return state

    # -- the training process: epoch starts ------------------------------------------------------------

    def begin_epoch(self, epoch: int) -> None:
        """The rank starts ``epoch`` (1-based): from epoch 2 on, until the map is final, exchange what every
        server's cache holds and publish the new map to this rank's workers (see NOTE [ Ownership ]). Waits
        at most ``COORDL_PEER_EXCHANGE_S`` in all; a server that has not reported by then (it does not
        iterate this loader, or is gone) holds nothing in this epoch's map and is not waited for again."""
        if self._store is None or epoch <= self._maps_known:
            return
        self._maps_known = epoch
        if self._hand_off is not None and self._hand_off[0] == os.getpid():
            self._hand_off[1].drain()  # this process's overflow of the last epoch in the peers' maps
        self.state.down[:] = 0  # every epoch tries again the peers the last one found down
        t, store = self.topology, self._store
        if epoch < 2:  # where this epoch's overflow can go: learnt in the background as the servers come up
            missing = [n for n in range(t.nodes) if n != t.node and self.state.address(n) is None]
            if missing:
                stop = threading.Event()
                learner = threading.Thread(target=self._learn_addresses, args=(missing, stop),
                                           name="coordl-peer-addresses", daemon=True)
                learner.start()
                weakref.finalize(self, stop_thread, learner, stop.set, THREAD_JOIN_S)  # at exit, or with this tier
        if epoch < 2 or self.state.meta[1]:
            return
        deadline = time.monotonic() + self.exchange_s
        store.set(f"e{epoch}/ready/{t.node}/{t.local_rank}", "1")
        # the servers up now (each probed once): a dead one is never waited for
        up = {t.node} | {n for n in range(t.nodes) if n != t.node and
                         self._learn_address(n, 0.0 if n in self._absent else deadline) and self._live(n)}
        if t.local_rank == 0:  # the map once every live rank's inserts and hand-offs of the last epoch are in
            waited = [n for n in sorted(up) if n not in self._absent]
            self._wait([f"e{epoch}/ready/{n}/{r}" for n in waited for r in range(t.local_world)], deadline)
            cache = self._cache
            store.set(f"e{epoch}/map/{t.node}", encode_map(cache.ready_mask(), cache.full))
        maps, frozen = [], []
        for node in range(t.nodes):
            until = 0.0 if node in self._absent else deadline  # 0: look, don't wait
            available = node in up and self._wait([f"e{epoch}/map/{node}"], until)
            if not available:
                maps.append(None)  # its items come from storage this epoch
                frozen.append(False)
                self._absent.add(node)
                continue
            self._absent.discard(node)
            ready, is_frozen = decode_map(store.get(f"e{epoch}/map/{node}"), self.n_items)
            maps.append(ready)
            frozen.append(is_frozen)
        missing = [n for n, m in enumerate(maps) if m is None]
        if missing and tuple(missing) != self._said_missing:
            self._said_missing = tuple(missing)
            logger.warning("coordl partitioned caching, epoch %d: server(s) %s did not report their cache within "
                           "%.0f s (%s), so their items come from storage; each epoch looks again without waiting. "
                           "A loader that only some servers iterate (or whose dataset differs between servers: it "
                           "must be the same files in the same order) should be built with partitioned=False.", epoch,
                           ", ".join(map(str, missing)), self.exchange_s, EXCHANGE_ENV)
        owner = owners_of(maps, self.n_items)
        self.state.owner[:] = owner
        self.state.full |= np.array(frozen, dtype=np.int32)
        final = not missing and (bool((owner >= 0).all()) or all(frozen))
        self.state.meta[0] += 1
        self.state.meta[1] = int(final)
        held = np.bincount(owner[owner >= 0], minlength=t.nodes)
        logger.info("coordl partitioned caching, epoch %d: %d of %d items cached across %d servers (%s)%s", epoch,
                    int((owner >= 0).sum()), self.n_items, t.nodes, ", ".join(f"server {n}: {c}" for n, c in
                                                                             enumerate(held)),
                    "; the map is final" if final else "")

    def wait_for_ranks(self, step: str, timeout_s: float) -> bool:
        """Whether every rank of the job, on every server, has reached ``step`` (called this with it) within
        ``timeout_s``."""
        t = self.topology
        self._store.set(f"reached/{step}/{t.rank}", "1")
        return self._wait([f"reached/{step}/{r}" for r in range(t.world)], time.monotonic() + timeout_s)

    def _wait(self, keys: list[str], deadline: float) -> bool:
        """Whether ``keys`` are all in the store by ``deadline`` (a ``time.monotonic()``; past: look only)."""
        left = deadline - time.monotonic()
        if left <= 0:
            return self._store.check(keys)
        try:
            self._store.wait(keys, datetime.timedelta(seconds=left))
            return True
        except Exception:  # torch raises DistStoreError (a RuntimeError) on a timeout
            return False

    def _live(self, node: int) -> bool:
        """Whether ``node`` takes part in this epoch's map: this server, or one whose peer server accepts a
        connection now (so a dead server is never waited for); says once when one stops answering."""
        if node == self.topology.node or self._reachable(node):
            return True
        self._say_down(node, "its peer server does not answer")
        return False

    def _reachable(self, node: int) -> bool:
        """Whether ``node``'s peer server accepts a connection now (so a dead server is not waited for)."""
        address = self.state.address(node)
        if address is None:
            return False
        try:
            socket.create_connection(address, timeout=self.timeout_s).close()
            return True
        except OSError:
            return False

    def _learn_address(self, node: int, deadline: float) -> bool:
        """Whether ``node``'s address is known (learnt from the store by ``deadline``)."""
        return self.state.address(node) is not None or _read_address(self._store, self.state, node, deadline)

    def _learn_addresses(self, nodes: list[int], stop: threading.Event) -> None:
        """In a thread of its own (with its own store client): learn ``nodes``' addresses as they appear, for
        at most ``COORDL_PEER_EXCHANGE_S`` or until ``stop`` is set (NOTE [ Threads at exit ])."""
        try:
            store = _store(self.topology, self.prefix, STORE_UP_S)
        except Exception as e:  # the job's store gone: hand-offs skip the servers not known yet
            logger.debug("coordl partitioned caching: peer addresses not learnt: %s", e)
            return
        deadline = time.monotonic() + self.exchange_s
        for node in nodes:
            while not _read_address(store, self.state, node, min(deadline, time.monotonic() + ADDRESS_WAIT_S)):
                if time.monotonic() >= deadline or stop.wait(ADDRESS_RETRY_S):
                    return

    # -- any process: the read path ------------------------------------------------------------------------

    def request(self, indices: list[int]) -> "PendingFetch":
        """Send requests for ``indices`` (local misses) to the peers that own them; the returned
        :class:`PendingFetch` says which were asked and collects the replies."""
        pending = PendingFetch(self)
        if not indices or not self.state.meta[0]:
            return pending
        owner, down, me = self.state.owner, self.state.down, self.topology.node
        by_node: dict[int, list[int]] = {}
        for i in indices:
            node = int(owner[i])
            if node >= 0 and node != me and not down[node]:
                by_node.setdefault(node, []).append(i)
        for node, ids in by_node.items():
            try:
                if self._send_requests(node, ids):
                    pending.kept.add(node)
            except (OSError, wire.PeerProtocolError) as e:
                self._mark_down(node, e)
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
        peer whose cache still takes items (in the background: see NOTE [ Hand-off ])."""
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
        it waits for one, for at most :data:`HANDOFF_DRAIN_S` in this process's life. A server that fails a
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

    def _mark_down(self, node: int, error: BaseException) -> None:
        self._close_connection(node)
        if not self.state.down[node]:
            self.state.down[node] = 1
            self._say_down(node, f"{type(error).__name__}: {error}")

    def _say_down(self, node: int, why: str) -> None:
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

    def peer_stats(self) -> list[dict]:
        """Per peer: its address, whether it is down, the items, bytes, requests and mean wait per request it
        served, and the items (and bytes) this rank's processes handed off to it."""
        totals = self.state.counters.sum(axis=0)
        out = []
        for node in range(self.topology.nodes):
            if node == self.topology.node:
                continue
            items, nbytes, requests, wait_ns, handed, handed_bytes = (int(v) for v in totals[node])
            address = self.state.address(node)
            out.append({"node": node, "address": "%s:%d" % address if address else None,
                        "down": bool(self.state.down[node]), "items": items, "bytes": nbytes, "requests": requests,
                        "mean_wait_ms": wait_ns / requests / 1e6 if requests else 0.0,
                        "handed_off": handed, "handed_off_bytes": handed_bytes})
        return out

    def close(self) -> None:
        """Close this process's connections; in the training process, say that this rank is done, and, where
        this rank runs the node's peer server, keep serving until every rank of the other servers is done too
        (at most ``CLOSE_WAIT_S``; a server missing from the last map exchange is waited for only while its
        peer server answers), then stop it."""
        if self._hand_off is not None and self._hand_off[0] == os.getpid():
            self._hand_off[1].close()
            self._hand_off = None
        threads = self._threads
        if threads is not None and threads[0] == os.getpid():
            for conns in threads[2]:
                for conn in conns.values():
                    conn.close()
                conns.clear()
        t, store = self.topology, self._store
        if store is None:
            return
        self._store = None
        store.set(f"closed/{t.node}/{t.local_rank}", "1")
        if self._server is not None:  # a server whose own peer server is gone may still be loading from ours
            others = [f"closed/{node}/{r}" for node in range(t.nodes) for r in range(t.local_world)
                      if node != t.node and (node not in self._absent or self._reachable(node))]
            try:
                store.wait(others, datetime.timedelta(seconds=CLOSE_WAIT_S))
            except Exception as e:  # DistStoreError on a timeout
                logger.info("coordl partitioned caching: stopping server %d's peer server before every other rank "
                            "is done (%s)", t.node, e)
            self._server.stop()
            self._server = None


class PendingFetch:
    """Requests sent to peers for some misses of a minibatch: ``asked`` (the ids sent), then ``collect()`` or,
    if the batch fails before, ``abandon()``."""

    def __init__(self, tier: PeerTier):
        self.tier, self.sent, self.asked = tier, {}, set()
        self.kept: set[int] = set()  # the servers asked on a connection kept from before
        self._started = time.monotonic_ns()

    def collect(self) -> dict[int, tuple]:
        """The items peers delivered, checked (see ``_peer.wire``), as (bytes, the stamp the peer's copy was
        stored with, or None where its stamps do not compare with this server's); an id missing here comes
        from storage. A peer's whole reply must arrive within ``COORDL_PEER_TIMEOUT_S`` plus its bytes at
        ``wire.MIN_RATE``; a kept connection found closed before any reply (the server dropped it as idle
        while the requests went out) is reopened and the requests sent again, once."""
        got, tier = {}, self.tier
        row = tier.counters_row() if self.sent else None
        for node, ids in self.sent.items():
            received = items = 0
            retry = node in self.kept
            while True:
                try:
                    channel = tier._connections()[node]
                    for start in range(0, len(ids), wire.MAX_IDS):
                        deadline = time.monotonic() + tier.timeout_s
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
                            tier._close_connection(node)
                            tier._send_requests(node, ids)
                            continue
                        except (OSError, wire.PeerProtocolError) as again:
                            e = again
                    tier._mark_down(node, e)
                break
            row[node, C_BYTES] += received
            row[node, C_REQUESTS] += 1
            row[node, C_WAIT_NS] += time.monotonic_ns() - self._started
        return got

    def abandon(self) -> None:
        """Drop the connections whose replies will not be read (the next request opens new ones)."""
        conns = self.tier._connections()
        for node in self.sent:
            conn = conns.pop(node, None)
            if conn is not None:
                conn.close()


def _read_address(store, state: PeerState, node: int, deadline: float) -> bool:
    """Whether ``node``'s address appeared in ``store`` by ``deadline`` (then recorded in ``state``)."""
    key = f"addr/{node}"
    try:
        left = deadline - time.monotonic()
        if left > 0:
            store.wait([key], datetime.timedelta(seconds=left))
        elif not store.check([key]):
            return False
        state.set_address(node, bytes(store.get(key)).decode())
        return True
    except Exception:  # torch raises DistStoreError (a RuntimeError) on a timeout, or the store is gone
        return False


def _names_digest(source) -> str:
    """A digest of the last two path components of up to 1024 evenly spaced keys: the same dataset on every
    server, wherever each keeps its copy."""
    n = len(source)
    step = max(1, n // 1024)
    h = hashlib.blake2b(str(n).encode(), digest_size=8)
    for i in range(0, n, step):
        h.update("/".join(str(source.raw_key(i)).replace(os.sep, "/").split("/")[-2:]).encode() + b"\0")
    return h.hexdigest()

