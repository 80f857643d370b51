"""A node's peer server: serves the items its MinIO cache holds to the other servers of a partitioned job.

One per node and cache, started by the node's local rank 0 (``partitioned``) as a forked child process,
as torch forks its DataLoader workers, so serving never takes the training loop's GIL and reads the
dataset's keys without pickling them. It exits when that rank tells it to (closing the loader), exits
or dies (it polls its parent). See ``_peer.wire`` NOTE [ Peer wire ] for the protocol.

Each client gets a thread. A client that fails the handshake, sends a malformed or oversized frame, a
bad tag, an id out of range, or takes more than ``frame_s`` to send a frame it has begun is dropped; the
server and its other clients go on.

NOTE [ Peer server limits ]
Connections that have not authenticated yet are held at most ``handshake_s`` (2 s: a peer answers the
greeting in one round trip), at most ``pending_per_source`` of them per source address at once (a whole
server's fetching threads connecting together) and ``max_clients`` in all: past a limit a new one is
closed before the greeting. So silent connections from one address cannot keep out a peer at another.
Authenticated clients, at most ``max_clients`` (sized from the job: :func:`job_limits`), are dropped
after ``idle_s`` (30 s) between requests; a client reopens its connection when it finds it closed
(``_peer.client`` NOTE [ Peer read path ]), so a job's kept connections never pile up to the cap.
"""

import collections
import hashlib
import logging
import socket
import threading
import time

import numpy as np

from coordl._core.worker import exit_when_orphaned
from coordl._fetch.storage import is_current, stamper
from coordl._peer import wire

logger = logging.getLogger(__name__)

HANDSHAKE_S = 2.0
FRAME_S = 5.0
IDLE_S = 30.0
MAX_CLIENTS = 512
"""Authenticated clients a server takes besides its job's own (:func:`job_limits`)."""
PENDING_PER_SOURCE = 8
"""Unauthenticated connections a server holds per source address besides a server's own (:func:`job_limits`)."""


def job_limits(nodes: int, local_world: int, processes: int) -> tuple[int, int]:
    """(``max_clients``, ``pending_per_source``) for a peer server of a job of ``nodes`` servers of
    ``local_world`` ranks, each of ``processes`` processes (workers + 1): every other server's processes
    with a fetching thread and a hand-off sender each, plus :data:`MAX_CLIENTS` (DALI's other fetch
    threads, probes); and one server's, plus :data:`PENDING_PER_SOURCE` (NOTE [ Peer server limits ])."""
    per_server = 2 * local_world * processes
    return (nodes - 1) * per_server + MAX_CLIENTS, per_server + PENDING_PER_SOURCE


class ItemDigests:
    """Each item's ``wire.item_digest``, worked out the first time it is asked for with a stamp and kept with it:
    for a lookup whose bytes for an id and stamp never change (a cache's, a disk tier's, an exemplar region's: a
    file's version has one content). Its memory is only that of the pages it writes (57 bytes an item asked
    for). Threads may ask at once: two that work out the same item write the same bytes."""

    def __init__(self, n_items: int):
        self._digests = np.zeros((n_items, 32), dtype=np.uint8)
        self._stamps = np.zeros((n_items, 3), dtype=np.int64)
        self._known = np.zeros(n_items, dtype=bool)

    def __call__(self, index: int, data, stamp) -> bytes:
        stamp = (0, 0, -1) if stamp is None else tuple(stamp)[:3]
        if self._known[index] and tuple(self._stamps[index].tolist()) == stamp:
            return self._digests[index].tobytes()
        digest = wire.item_digest(data)
        self._known[index] = False
        self._digests[index], self._stamps[index] = np.frombuffer(digest, dtype=np.uint8), stamp
        self._known[index] = True
        return digest


def _hashed(index: int, data, stamp) -> bytes:
    return wire.item_digest(data)


class PeerServer:
    """Serves ``lookup(index) -> (bytes-like, stamp or None) | None`` for ids in ``range(n_items)`` to clients
    that know ``secret``, on ``host:port`` (port 0: any free one; :attr:`address` says which), and takes
    their hand-offs with ``keeper`` (a :class:`CacheKeeper`; None: declines every one), saying ``storage_id``
    (see :func:`storage_id`), ``sample`` (:func:`copy_sample`) and ``binding`` (the job's loader it serves:
    ``_peer.wire`` NOTE [ Peer wire ]); ``digests(index, data)`` gives each served item's digest (an
    :class:`ItemDigests` where ``lookup``'s bytes never change; the default hashes every item it serves);
    the limits are NOTE [ Peer server limits ]'s."""

    def __init__(self, lookup, n_items: int, secret: bytes, host: str, port: int = 0, *, keeper=None,
                 storage_id: bytes = wire.NO_STORAGE, sample: bytes = wire.NO_SAMPLE, binding: bytes = wire.NO_BINDING,
                 digests=_hashed, frame_s: float = FRAME_S,
                 handshake_s: float = HANDSHAKE_S, idle_s: float = IDLE_S, max_clients: int = MAX_CLIENTS,
                 pending_per_source: int = PENDING_PER_SOURCE):
        self.lookup, self.n_items, self.secret, self.keeper = lookup, n_items, secret, keeper
        self.digests = digests
        self.storage_id, self.sample, self.binding = storage_id, sample, binding
        self.frame_s, self.handshake_s, self.idle_s = frame_s, handshake_s, idle_s
        self.max_clients, self.pending_per_source = max_clients, pending_per_source
        self.sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                         backlog=128)
        self.address = self.sock.getsockname()[:2]
        self._clients: set[socket.socket] = set()  # every open connection
        self._pending: collections.Counter = collections.Counter()  # unauthenticated ones, by source address
        self._authenticated = 0
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> "PeerServer":
        threading.Thread(target=self.serve_forever, name="coordl-peer-accept", daemon=True).start()
        return self

    def serve_forever(self) -> None:
        while not self._closed:
            try:
                conn, source = self.sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                if (self._closed or self._pending[source[0]] >= self.pending_per_source
                        or len(self._clients) - self._authenticated >= self.max_clients):
                    conn.close()
                    continue
                self._pending[source[0]] += 1
                self._clients.add(conn)
            threading.Thread(target=self._serve_client, args=(conn, source[0]), name="coordl-peer-client",
                             daemon=True).start()

    def _serve_client(self, conn: socket.socket, source: str) -> None:
        authenticated = False
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                channel = wire.server_handshake(conn, self.secret, time.monotonic() + self.handshake_s,
                                                self.storage_id, self.binding, self.sample)
            finally:
                with self._lock:
                    self._unpend(source)
            with self._lock:
                if self._authenticated >= self.max_clients:
                    raise ConnectionRefusedError(f"{self.max_clients} clients already")
                self._authenticated += 1
                authenticated = True
            while True:
                request = wire.read_request(channel, self.n_items, time.monotonic() + self.idle_s, self.frame_s)
                if request is None:
                    return
                if isinstance(request, wire.Handoff):
                    self._take(channel, request)
                else:
                    wire.send_reply(channel, [(i, self._found(i)) for i in request])
        except (OSError, wire.PeerProtocolError) as e:  # TimeoutError and ConnectionError are OSErrors
            logger.debug("coordl peer server: dropped a client: %s", e)
        finally:
            with self._lock:
                self._clients.discard(conn)
                self._authenticated -= authenticated
            conn.close()

    def _found(self, index: int) -> tuple | None:
        found = self.lookup(index)
        return None if found is None else (*found, self.digests(index, *found))

    def _unpend(self, source: str) -> None:
        self._pending[source] -= 1
        if not self._pending[source]:
            del self._pending[source]

    def _take(self, channel: wire.Channel, handoff: wire.Handoff) -> None:
        """Answer a hand-off: its bytes are read only if the keeper would keep them, and kept only once
        their tag is checked."""
        outcome, stamp = (self.keeper.admit(handoff.index, handoff.length, handoff.stamp) if self.keeper
                          else (wire.DECLINED, None))
        data = wire.read_handoff(channel, handoff, self.frame_s, keep=outcome == wire.STORED)
        if data is not None:
            outcome = self.keeper.keep(handoff.index, data, stamp)
        wire.send_kept(channel, handoff.index, outcome)

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        with self._lock:
            for conn in list(self._clients):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def storage_id(storage, first_key) -> bytes:
    """This server's storage id (``_peer.wire`` NOTE [ Peer wire ]): a digest of its stamp of the dataset's
    first file ``first_key``, the same on every server that reads the same files; ``wire.NO_STORAGE`` with
    a storage that stamps nothing, or no such file."""
    stamp = stamper(storage)
    version = stamp(first_key) if stamp is not None and first_key is not None else None
    if version is None:
        return wire.NO_STORAGE
    return hashlib.blake2b(repr(version).encode(), digest_size=wire.STORAGE_ID_BYTES).digest()


def copy_sample(storage, source) -> bytes:
    """This server's sample of its copy of the dataset (``_peer.wire`` NOTE [ Peer wire ]): its files' sizes
    from their stamps and digests of a few files' bytes; ``wire.NO_SAMPLE`` with a storage that stamps
    nothing (its keys name immutable bytes)."""
    stamp = stamper(storage)
    if stamp is None:
        return wire.NO_SAMPLE

    def size(index: int) -> int | None:
        found = stamp(source.raw_key(index))
        return None if found is None else found[-1]

    def digest(index: int) -> bytes | None:
        try:
            data = getattr(storage, "inner", storage).read(source.raw_key(index))  # the files, not a disk tier's copy
        except OSError:
            return None
        return hashlib.blake2b(data, digest_size=16).digest()
    return wire.copy_sample(len(source), size, digest)


def cache_lookup(cache, source, storage, exemplars=()):
    """``lookup`` serving ``cache``'s items, with their stamps, as a local hit is served: with a storage
    that stamps its files, only while the item's file still has the stamp it was cached with
    (``storage.is_current``); where ``storage`` is a disk tier, the items it holds current and whole
    (``_disk.tier.DiskTier.peek``), so a server's peers are served from its memory and disk alike; and the
    rehearsal members the node's exemplar region holds (``exemplars``: a list that holds the region once the
    loader has made it, ``_rehearsal.exemplars``)."""
    peek = getattr(storage, "peek", None)

    def lookup(index: int):
        raw = cache.view(index)  # no copy: the reply is joined from it
        if raw is not None:
            stamp = cache.stamp(index)
        elif exemplars and (held := exemplars[0].get(index)) is not None:
            raw, stamp = held
        else:
            return None if peek is None else peek(source.raw_key(index))
        return (raw, stamp) if is_current(storage, source.raw_key(index), stamp) else None
    return lookup


class CacheKeeper:
    """Puts peers' hand-offs in ``cache`` as a read from this server's own storage would. With a storage
    that stamps its files, a hand-off whose stamp compares here (both servers read the same storage) is
    kept only while this server's file still has that stamp, the stamp of the read that produced the bytes;
    one from a server with its own copy of the dataset, only if this server's file has the item's length,
    stamped with that file (copies are trusted to hold the same bytes once their samples matched at the
    handshake). Else (another version, or missing here) it is declined. Authenticated peers are trusted
    with the bytes, as readers trust what peers serve them: tags guard the transport, not intent."""

    def __init__(self, cache, source, storage):
        self.cache, self.source, self._stamp = cache, source, stamper(storage)

    def admit(self, index: int, length: int, stamp: tuple | None) -> tuple[int, tuple | None]:
        """(``STORED``, the stamp to keep it with) if an item of ``length`` bytes read with ``stamp`` (None:
        one that does not compare here) would be kept (send its bytes), else (``FULL`` or ``DECLINED``, None)."""
        cache = self.cache
        if cache.view(index) is not None:
            return wire.DECLINED, None
        if cache.full:
            return wire.FULL, None
        if self._stamp is None:  # keys name immutable bytes: any length the cache could hold
            return (wire.STORED if length <= cache.capacity_bytes else wire.DECLINED), None
        mine = self._stamp(self.source.raw_key(index))
        if mine is None or mine[-1] != length or (stamp is not None and stamp != mine):
            return wire.DECLINED, None
        return wire.STORED, mine

    def keep(self, index: int, data: bytes, stamp: tuple | None) -> int:
        """Put the admitted item's bytes (its ``length`` of them) with the stamp :meth:`admit` gave."""
        if self.cache.put(index, data, stamp):
            return wire.STORED
        return wire.FULL if self.cache.full else wire.DECLINED


def serve(cache, source, storage, secret: bytes, copy: tuple[bytes, bytes], binding: bytes, limits: tuple[int, int],
          host: str, port: int, control) -> None:
    """The server process: serve ``cache`` on ``host:port`` to the clients of ``binding`` (at most ``limits``:
    :func:`job_limits`), saying ``copy`` (this server's storage id and sample), and keep what they hand it,
    send ``("port", n)`` on the ``control`` pipe once listening, serve the exemplar region the pipe names
    (``("exemplars", region)``) beside the cache, and exit when the pipe says stop or closes, or the parent dies."""
    exemplars: list = []
    try:
        server = PeerServer(cache_lookup(cache, source, storage, exemplars), cache.n_items, secret, host, port,
                            keeper=CacheKeeper(cache, source, storage), storage_id=copy[0], sample=copy[1],
                            binding=binding, digests=ItemDigests(cache.n_items), max_clients=limits[0],
                            pending_per_source=limits[1]).start()
    except OSError as e:
        control.send(("error", f"{type(e).__name__}: {e}"))
        return

    def close_all() -> None:
        for shared in (cache, *exemplars):
            shared.close()
    exit_when_orphaned(close_all)
    control.send(("port", server.address[1]))
    try:
        while (message := control.recv()) != "stop":
            if message[0] == "exemplars" and not exemplars:
                try:
                    message[1].stats()  # attached now, while the loader that made it holds it
                except (OSError, RuntimeError, MemoryError) as e:
                    logger.warning("coordl peer server: cannot serve the exemplar region %s: %s", message[1].name, e)
                    continue
                exemplars.append(message[1])
    except (EOFError, OSError):
        pass
    server.close()
    close_all()
