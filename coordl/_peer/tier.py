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
connection to a peer between batches; one the peer closed meanwhile (idle, ``peer_server`` NOTE [ Peer
server limits ]) is reopened, also one closed as the requests went out (they go again, once, before any
reply). A peer that refuses the connection, breaks the protocol, or does not deliver a whole reply
within ``COORDL_PEER_TIMEOUT_S`` (default 1 s) plus its bytes at ``wire.MIN_RATE`` (a slow link) is
marked down for the rest of the epoch in shared memory (so the rank's other workers skip it at
once), logged once, and its items come from storage; every epoch start tries it again. A delivered
item whose stamp is not this server's file's (where the peer reads the same storage) comes from
storage too. An item read from storage because its owner did not deliver it is not cached here, even
with room: its copy is the owner's while the map names it (a server gone from the next map owns
nothing, and its items are then cached where they are read).

NOTE [ Hand-off ]
A server's share of an epoch is random, so with an aggregate cache of about the dataset some caches
fill before their server's share is in while others keep room: without help, what overflowed would be
read from storage again in later epochs. So a process that reads an item no server holds from storage
while its node's cache is full hands the bytes (in the background, never delaying the batch) to the
next server, in turn, that still takes items, with the stamp of the read that produced them; that
server keeps them as if read from its own storage, and the next map exchange makes it the owner. It
declines them if it holds the item already or its own file is missing or another version: where both
servers read the same storage (``_peer_wire`` NOTE [ Peer wire ]), one whose stamp is not the read's,
so a file edited between the read and the hand-off is never kept as current; where it keeps its own
copy of the dataset, one of another length (copies are trusted to hold the same bytes once their
samples matched at the handshake: ``_peer_wire`` NOTE [ Peer wire ]). A server that
answers ``FULL`` (or whose map says frozen) gets no more; one that fails a hand-off gets no more from
that process (its reads are not affected). A process drains its queue (for at most ``HANDOFF_DRAIN_S``) before it exits,
as a torch worker does at its epoch's end, and a rank before it starts an epoch; every live server's
ranks must have started the epoch before any map is taken. So the caches fill up to the sum of their
capacities in epoch 1 and storage is read once, except for what was not handed off in time: an item
past the per-process queue of ``HANDOFF_QUEUE_BYTES``, or the last hand-offs of persistent workers
(which do not exit between epochs) still on their way when the map is taken. Those are read from
storage again in the next epoch, as without hand-offs (a server with room then caches them; one that
received a late hand-off may hold a second copy, wasted capacity, never a wrong byte).

NOTE [ Security ]
Peers authenticate each connection with HMAC challenge-response over a per-job secret, and every
request, reply item, hand-off and answer after it with a tag under the connection's own key (see
``_peer_wire``), so no one without the secret, a relay in the middle included, can alter a byte unseen.
The secret never goes through the rendezvous store, which anyone who can reach it may read and write
(torchrun's ``TCPStore`` has no authentication): it is ``COORDL_PEER_SECRET`` or the file
``COORDL_PEER_SECRET_FILE`` names, the same on every server, else random bytes rank 0 draws and
broadcasts over torch.distributed's default process group once it is initialized (only the job's ranks
are in it). With neither, partitioned caching stays off ("auto", saying why) or fails (True). The
server binds the address this server uses to reach the store
(``MASTER_ADDR``), never every interface, unless ``COORDL_PEER_HOST`` says otherwise.

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

import collections
import dataclasses
import datetime
import hashlib
import ipaddress
import logging
import math
import multiprocessing
import multiprocessing.util
import os
import secrets
import select
import socket
import struct
import threading
import time
import warnings
import weakref
import zlib

import numpy as np
import torch
import torch.distributed

from coordl._core.worker import own_row
from coordl._peer import server as peer_server
from coordl._peer import wire

logger = logging.getLogger(__name__)

PARTITIONED = ("auto", True, False)
SECRET_ENV = "COORDL_PEER_SECRET"
SECRET_FILE_ENV = "COORDL_PEER_SECRET_FILE"
SECRET_BYTES = 32
"""The length of the secret rank 0 draws when none is given."""
HOST_ENV = "COORDL_PEER_HOST"
PORT_ENV = "COORDL_PEER_PORT"
TIMEOUT_ENV = "COORDL_PEER_TIMEOUT_S"
PEER_TIMEOUT_S = 1.0
"""Default connect and inactivity timeout of a peer request (``COORDL_PEER_TIMEOUT_S``)."""
EXCHANGE_ENV = "COORDL_PEER_EXCHANGE_S"
EXCHANGE_TIMEOUT_S = 60.0
"""Default of how long, in all, an epoch start waits for the servers' maps (``COORDL_PEER_EXCHANGE_S``;
servers start epochs together in DDP); a server whose peer server refuses connections is not waited for."""
STORE_UP_S = 5.0
"""How long a rank waits for the rendezvous store to accept once torch.distributed's group is up."""
ADDRESS_WAIT_S = 0.5
"""The longest single wait of the address learner for a peer server's address in the store."""
ADDRESS_RETRY_S = 0.05
"""How long the address learner pauses between two waits."""
THREAD_JOIN_S = 2.0  # > ADDRESS_WAIT_S
"""How long a stopping process waits for the address learner to end (NOTE [ Threads at exit ])."""
HANDOFF_JOIN_S = 0.5
"""How long a closing sender, drained, is waited for to end."""
CLOSE_WAIT_S = 10.0
"""How long a closing peer server keeps serving for the other servers' ranks still loading."""
_MAX_NODES = 4096
_ADDR_BYTES = 64
_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
(_ITEMS, _BYTES, _REQUESTS, _WAIT_NS, _HANDED, _HANDED_BYTES) = range(6)
PEER_COUNTERS = ("items", "bytes", "requests", "wait_ns", "handed_off", "handed_off_bytes")
HANDOFF_QUEUE_BYTES = 64 * 2**20
"""Bytes a process's hand-offs may queue for its sender (NOTE [ Hand-off ])."""
HANDOFF_IDLE_S = 1.0
"""How long a sender keeps its connections with nothing to hand off."""
HANDOFF_DRAIN_S = 4.0
"""How long an exiting process (or a rank starting an epoch) waits for its hand-offs: less than torch gives
an exiting worker before terminating it (5 s)."""
_loaders_built: dict[str, int] = {}  # per dataset: partitioned loaders this process built
_built_lock = threading.Lock()
_threads_lock = threading.Lock()


def _reset_threads_lock() -> None:
    global _threads_lock
    _threads_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_threads_lock)


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where this rank is in a torchrun job: ``node`` of ``nodes`` servers, ``local_rank`` of ``local_world``."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    node: int
    nodes: int
    master_addr: str
    master_port: int
    run: str

    @classmethod
    def from_env(cls, environ=os.environ) -> "Topology | None":
        """torchrun's (or torch.distributed's ``env://``) variables, None when they are not all set."""
        if any(name not in environ for name in _ENV):
            return None
        world = _whole(environ, "WORLD_SIZE", 1)
        local_world = _whole(environ, "LOCAL_WORLD_SIZE", 1, world)
        rank, local_rank = _whole(environ, "RANK", 0, world - 1), _whole(environ, "LOCAL_RANK", 0, local_world - 1)
        nodes = _whole(environ, "GROUP_WORLD_SIZE", 1, world, default=max(1, world // local_world))
        node = _whole(environ, "GROUP_RANK", 0, nodes - 1, default=rank // local_world)
        if not node < nodes:
            raise ValueError(f"RANK {rank} with LOCAL_WORLD_SIZE {local_world} makes server {node}, but "
                             f"GROUP_WORLD_SIZE is {nodes}: set GROUP_RANK (torchrun does)")
        run = f"{environ.get('TORCHELASTIC_RUN_ID', 'none')}/{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        return cls(rank, world, local_rank, local_world, node, nodes, environ["MASTER_ADDR"],
                   _whole(environ, "MASTER_PORT", 1, 65535), run)


def _whole(environ, name: str, low: int, high: int | None = None, default: int | None = None) -> int:
    """The whole number in the environment variable ``name``, from ``low`` to ``high``, else a ``ValueError``
    naming it; ``default`` where it is not set."""
    given = environ.get(name)
    if given is None and default is not None:
        return default
    try:
        value = int(given)
    except (TypeError, ValueError):
        value = None
    if value is None or value < low or (high is not None and value > high):
        bounds = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise ValueError(f"{name} should be a whole number {bounds}, but got {given!r}")
    return value


def resolve(partitioned, cache_on: bool) -> Topology | None:
    """The topology to partition over for ``partitioned=``, or None when partitioned caching is off."""
    if partitioned not in PARTITIONED or not isinstance(partitioned, (str, bool)):
        raise ValueError(f"partitioned should be 'auto', True or False, but got partitioned={partitioned!r}")
    if partitioned is False:
        return None
    topology = Topology.from_env()
    if partitioned is True:
        if topology is None:
            missing = [name for name in _ENV if name not in os.environ]
            raise RuntimeError(f"partitioned=True needs torch.distributed's environment (launch with torchrun); "
                               f"{', '.join(missing)} not set")
        if not cache_on:
            raise ValueError("partitioned=True needs the cache: cache_bytes=0 turns it off")
        if topology.nodes > _MAX_NODES:
            raise ValueError(f"partitioned caching supports up to {_MAX_NODES} servers, not {topology.nodes}")
        _secret_known(True)
        return topology
    if topology is None or topology.nodes < 2 or not cache_on or topology.nodes > _MAX_NODES:
        return None
    return topology if _secret_known(partitioned) else None


def _secret_known(partitioned) -> bool:
    """Whether the peers' secret can be had without the rendezvous store (see NOTE [ Security ]): given, or
    agreed over torch.distributed's process group. Without it ``partitioned=True`` fails and "auto" turns
    partitioned caching off, saying why."""
    if os.environ.get(SECRET_ENV) or os.environ.get(SECRET_FILE_ENV) or (torch.distributed.is_available() and
                                                                       torch.distributed.is_initialized()):
        return True
    why = (f"partitioned caching needs a secret the rendezvous store does not hold: call "
           f"torch.distributed.init_process_group before building the loader (rank 0 then draws one and sends "
           f"it over the group), or give every server the same one in {SECRET_ENV} or a file named by "
           f"{SECRET_FILE_ENV}")
    if partitioned is True:
        raise RuntimeError(why)
    warnings.warn(f"{why}; each server caches on its own", stacklevel=2)
    return False


def job_secret(topology: Topology) -> bytes:
    """The peers' secret: ``COORDL_PEER_SECRET``, else the contents of the file ``COORDL_PEER_SECRET_FILE``
    names (readable by its owner only), else :data:`SECRET_BYTES` random bytes rank 0 draws and broadcasts
    over torch.distributed's default process group (which only the job's ranks join; a collective, as every
    rank builds its loaders alike)."""
    given = os.environ.get(SECRET_ENV)
    if given:
        return given.encode()
    path = os.environ.get(SECRET_FILE_ENV)
    if path:
        return _secret_from_file(path)
    backend = torch.distributed.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    drawn = secrets.token_bytes(SECRET_BYTES) if topology.rank == 0 else bytes(SECRET_BYTES)
    secret = torch.frombuffer(bytearray(drawn), dtype=torch.uint8).to(device)
    torch.distributed.broadcast(secret, src=0)
    return bytes(secret.cpu().numpy())


def loader_binding(store, prefix: str) -> bytes:
    """This loader's binding in the peers' handshakes (NOTE [ Security ]): a digest of its store ``prefix``
    and of the nonce under it in ``store`` (drawn here if no rank has yet)."""
    drawn = secrets.token_hex(16)
    nonce = bytes(store.compare_set("binding", "", drawn)).decode()
    return hashlib.blake2b(f"{prefix}\0{nonce}".encode(), digest_size=wire.BINDING_BYTES).digest()


def _secret_from_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_mode & 0o077:
                raise ValueError(f"{SECRET_FILE_ENV}={path!r} can be read or written by others than its owner: "
                                 f"chmod 600 it (the peers' secret must be private to the job)")
            secret = f.read().strip()
    except OSError as e:
        raise ValueError(f"{SECRET_FILE_ENV}={path!r} cannot be read: {e}") from None
    if not secret:
        raise ValueError(f"{SECRET_FILE_ENV}={path!r} is empty: it should hold the peers' secret")
    return secret


def owners_of(maps: list[np.ndarray | None], n_items: int) -> np.ndarray:
    """``owner[i]``: the lowest node whose bool map holds item ``i``, -1 where none does (None: a node
    whose map is unknown holds nothing; with none known, every item comes from storage)."""
    owner = np.full(n_items, -1, dtype=np.int16)
    for node in range(len(maps) - 1, -1, -1):
        if maps[node] is not None:
            owner[maps[node]] = node
    return owner


def encode_map(ready: np.ndarray, frozen: bool) -> bytes:
    """A node's map for the store: frozen flag, item count, zlib of its ready bitmap."""
    return struct.pack("!BQ", int(frozen), len(ready)) + zlib.compress(np.packbits(ready).tobytes(), 1)


def decode_map(blob: bytes, n_items: int) -> tuple[np.ndarray, bool]:
    frozen, n = struct.unpack_from("!BQ", blob)
    if n != n_items:
        raise RuntimeError(f"coordl partitioned caching: a server's dataset has {n} items, this one {n_items}; "
                           "every server must load the same dataset")
    bits = np.frombuffer(zlib.decompress(blob[9:]), dtype=np.uint8)
    return np.unpackbits(bits, count=n).astype(bool), bool(frozen)


class PeerState:
    """What a rank's processes share about the peers: ``owner`` int16[N], ``meta`` (map version, final),
    ``down`` flags per node (this epoch) and ``warned`` (said so), ``full`` (its cache takes no more), their
    ``addresses``, and per-process, per-node counters (:data:`PEER_COUNTERS`). Torch shared tensors underneath,
    so it travels to DataLoader workers (forked or spawned); each field is a numpy view of its tensor, made
    when the state is built or unpickled, so that the background threads never call into torch (NOTE [ Threads
    at exit ])."""

    def __init__(self, n_items: int, nodes: int, processes: int):
        self._shared = {
            "owner": torch.full((n_items,), -1, dtype=torch.int16),
            "meta": torch.zeros(2, dtype=torch.int64),
            "down": torch.zeros(nodes, dtype=torch.int32),
            "warned": torch.zeros(nodes, dtype=torch.int32),
            "full": torch.zeros(nodes, dtype=torch.int32),
            "addresses": torch.zeros((nodes, _ADDR_BYTES), dtype=torch.uint8),
            "counters": torch.zeros((max(processes, 1), nodes, len(PEER_COUNTERS)), dtype=torch.int64),
        }
        for tensor in self._shared.values():
            tensor.share_memory_()
        self._view()

    def __getstate__(self) -> dict:
        return self._shared

    def __setstate__(self, shared: dict) -> None:
        self._shared = shared
        self._view()

    def _view(self) -> None:
        for name, tensor in self._shared.items():
            setattr(self, name, tensor.numpy())

    def address(self, node: int) -> tuple[str, int] | None:
        row = self.addresses[node]
        length = int(row[0])  # written last (see set_address): nonzero means the text is all there
        if not length:
            return None
        host, port = bytes(row[1:1 + length]).decode().rsplit(":", 1)
        return host, int(port)

    def set_address(self, node: int, text: str) -> None:
        """Record ``node``'s address (once: a peer server keeps its address for the run). The text goes in
        first and its length last, so a process reading meanwhile sees no address or all of it."""
        raw = text.encode()
        if len(raw) >= _ADDR_BYTES:
            raise ValueError(f"server {node}'s address {text!r} is longer than {_ADDR_BYTES - 1} bytes")
        row = self.addresses[node]
        row[1:1 + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        row[0] = len(raw)


def _local_address(topology: Topology) -> str:
    """The address this server uses to reach the rendezvous store (a UDP connect sends nothing)."""
    if os.environ.get(HOST_ENV):
        host = os.environ[HOST_ENV]
        try:
            wildcard = ipaddress.ip_address(host).is_unspecified
        except ValueError:  # a host name
            wildcard = False
        if wildcard:
            raise ValueError(f"{HOST_ENV} should be an address the other servers can reach this one at, but got "
                             f"{host!r}, which names none (unset it to use the one this server reaches MASTER_ADDR "
                             f"from)")
        return host
    family = socket.AF_INET6 if ":" in topology.master_addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((topology.master_addr, topology.master_port))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


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


def _seconds(name: str, default: float) -> float:
    """A positive, finite number of seconds from the environment variable ``name``."""
    try:
        value = float(os.environ.get(name, default))
    except ValueError:
        raise ValueError(f"{name} should be a number of seconds, but got {os.environ[name]!r}") from None
    if not 0 < value < math.inf:
        raise ValueError(f"{name} should be a positive, finite number of seconds, but got {os.environ[name]!r}")
    return value


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
        self.timeout_s = _seconds(TIMEOUT_ENV, PEER_TIMEOUT_S)
        self.exchange_s = _seconds(EXCHANGE_ENV, EXCHANGE_TIMEOUT_S)
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
        self._hand_off = None  # (pid, _HandOff): this process's sender
        self._address_wait_s = 0.0  # how long this process's sender has waited for peer addresses
        self._refused: set[int] = set()  # servers this process's sender stopped handing off to
        if topology.local_rank == 0:
            cache.mark_partition(topology.node, topology.nodes)
            limits = peer_server.job_limits(topology.nodes, topology.local_world, processes)
            self._server = _start_server(cache, source, storage, self.secret, (self.storage_id, self.sample),
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
                weakref.finalize(self, _stop_thread, learner, stop.set)  # at exit, or with this tier
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
                self._hand_off = (pid, _HandOff(self._hand_to_a_peer, self._close_thread_connections))
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
            if self._address_wait_s >= HANDOFF_DRAIN_S:
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
                row[node, _HANDED] += 1
                row[node, _HANDED_BYTES] += len(raw)
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
        ``peer_server`` NOTE [ Peer server limits ]), else a new one."""
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


class _HandOff:
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
        _stop_thread(self._thread, self._stop, HANDOFF_JOIN_S)

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


class PendingFetch:
    """Requests sent to peers for some misses of a minibatch: ``asked`` (the ids sent), then ``collect()`` or,
    if the batch fails before, ``abandon()``."""

    def __init__(self, tier: PeerTier):
        self.tier, self.sent, self.asked = tier, {}, set()
        self.kept: set[int] = set()  # the servers asked on a connection kept from before
        self._started = time.monotonic_ns()

    def collect(self) -> dict[int, tuple]:
        """The items peers delivered, checked (see ``_peer_wire``), as (bytes, the stamp the peer's copy was
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
                                row[node, _ITEMS] += 1
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
            row[node, _BYTES] += received
            row[node, _REQUESTS] += 1
            row[node, _WAIT_NS] += time.monotonic_ns() - self._started
        return got

    def abandon(self) -> None:
        """Drop the connections whose replies will not be read (the next request opens new ones)."""
        conns = self.tier._connections()
        for node in self.sent:
            conn = conns.pop(node, None)
            if conn is not None:
                conn.close()


class _ServerProcess:
    """This node's peer server (``peer_server.serve``), a child forked as torch forks DataLoader workers."""

    def __init__(self, cache, source, storage, secret: bytes, copy: tuple[bytes, bytes], binding: bytes,
                 limits: tuple[int, int], host: str, port: int):
        ctx = multiprocessing.get_context("fork")
        self.control, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=peer_server.serve,
                                args=(cache, source, storage, secret, copy, binding, limits, host, port, theirs),
                                name="coordl-peer-server", daemon=True)
        self.proc.start()
        theirs.close()
        try:
            kind, value = self.control.recv() if self.control.poll(60) else ("error", "no answer in 60 s")
        except EOFError:
            kind, value = "error", f"it exited with status {self.proc.exitcode}"
        if kind != "port":
            self.stop()
            raise RuntimeError(f"coordl partitioned caching: the peer server could not listen on {host}:{port}: "
                               f"{value} (set {HOST_ENV} / {PORT_ENV} to choose where)")
        self.address = (host, value)

    def stop(self) -> None:
        try:
            self.control.send("stop")
        except OSError:
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.control.close()


def _start_server(cache, source, storage, secret: bytes, copy: tuple[bytes, bytes], binding: bytes,
                  limits: tuple[int, int], topology: Topology, ordinal: int) -> _ServerProcess:
    host = _local_address(topology)
    port = _whole(os.environ, PORT_ENV, 0, 65535, default=0) if os.environ.get(PORT_ENV) else 0
    if port and port + ordinal > 65535:
        raise ValueError(f"{PORT_ENV}={port}: this process's partitioned loader {ordinal + 1} of the dataset would "
                         f"serve at port {port + ordinal}, past 65535")
    server = _ServerProcess(cache, source, storage, secret, copy, binding, limits, host, port + ordinal if port else 0)
    logger.info("coordl partitioned caching: server %d of %d serves its cache at %s:%d", topology.node,
                topology.nodes, *server.address)
    return server


def _stop_thread(thread: threading.Thread, stop, join_s: float = THREAD_JOIN_S) -> None:
    """``stop()``, then wait (at most ``join_s``) for ``thread`` to end."""
    stop()
    if thread is not threading.current_thread():
        thread.join(join_s)


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

