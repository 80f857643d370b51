"""Partitioned caching's pieces without a cluster: topology from torchrun's environment, the option, cache maps
and the ownership they give."""

import contextlib
import hashlib
import json
import multiprocessing
import os
import select
import socket
import subprocess
import sys
import textwrap
import threading
import time
import types

import numpy as np
import pytest

from coordl._cache.minio import MinIOCache, cache_segment_name
from coordl._fetch.storage import FileStorage
from coordl._objects.manifest import Manifest
from coordl._objects.storage import ObjectStorage
from coordl._peer import server as peer_server
from coordl import partitioned
from coordl._peer import handoff, launch, topology
from coordl._peer import wire
from coordl._peer.server import CacheKeeper, PeerServer, cache_lookup, storage_id
from coordl.partitioned import Topology, decode_map, encode_map, owners_of, resolve
from tests import _procs
from tests._peers import Relay, edit, flip

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "2",
            "GROUP_WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400",
            "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "1"}


def test_the_topology_is_torchruns():
    t = Topology.from_env(TORCHRUN)
    assert (t.rank, t.world, t.local_rank, t.local_world, t.node, t.nodes) == (5, 8, 1, 2, 2, 4)
    assert (t.master_addr, t.master_port, t.run) == ("10.0.0.1", 29400, "job7/1")
    plain = {k: v for k, v in TORCHRUN.items() if not k.startswith(("GROUP_", "TORCHELASTIC"))}
    t = Topology.from_env(plain)  # env:// without torchrun's extras: nodes from the world and local sizes
    assert (t.node, t.nodes, t.run) == (2, 4, "none/0")
    assert Topology.from_env({k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}) is None


@pytest.mark.parametrize("env, cache_on, expected", [
    (TORCHRUN, True, 4),
    (TORCHRUN, False, None),  # no cache, nothing to partition
    ({**TORCHRUN, "GROUP_WORLD_SIZE": "1", "WORLD_SIZE": "2", "RANK": "1", "GROUP_RANK": "0"}, True, None),  # one server
    ({}, True, None),  # not a distributed job
])
def test_auto_partitions_only_a_job_of_several_servers_with_a_cache(monkeypatch, env, cache_on, expected):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(partitioned.SECRET_ENV, "s" * 16)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    topology = resolve("auto", cache_on)
    assert (topology.nodes if topology else None) == expected
    assert resolve(False, cache_on) is None


def test_insisting_without_torchrun_or_without_a_cache_fails_clearly(monkeypatch):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="torchrun.*RANK, WORLD_SIZE"):
        resolve(True, True)
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="cache_bytes=0"):
        resolve(True, False)
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="partitioned should be"):
            resolve(bad, True)


def test_without_a_secret_the_store_does_not_hold_auto_stays_off_saying_why_and_true_fails(monkeypatch):
    """NOTE [ Security ]: the rendezvous store is readable by anyone who reaches it, so it never carries the
    secret; with none given and no process group to agree one over, no peer server starts."""
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    for name in (partitioned.SECRET_ENV, partitioned.SECRET_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    with pytest.warns(UserWarning, match="init_process_group before building the loader.*COORDL_PEER_SECRET"):
        assert resolve("auto", True) is None
    with pytest.raises(RuntimeError, match="a secret the rendezvous store does not hold"):
        resolve(True, True)
    monkeypatch.setenv(partitioned.SECRET_FILE_ENV, "/no/such/file")
    assert resolve(True, True).nodes == 4


def test_a_secret_file_is_read_only_when_private_to_its_owner(monkeypatch, tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"the-jobs-secret\n")
    monkeypatch.delenv(partitioned.SECRET_ENV, raising=False)
    monkeypatch.setenv(partitioned.SECRET_FILE_ENV, str(path))
    topology = Topology.from_env(TORCHRUN)
    path.chmod(0o644)
    with pytest.raises(ValueError, match=f"COORDL_PEER_SECRET_FILE='{path}' can be read or written by others.*chmod 600"):
        partitioned.job_secret(topology)
    path.chmod(0o600)
    assert partitioned.job_secret(topology) == b"the-jobs-secret"
    path.write_bytes(b"\n")
    with pytest.raises(ValueError, match="is empty"):
        partitioned.job_secret(topology)
    monkeypatch.setenv(partitioned.SECRET_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="missing'.* cannot be read"):
        partitioned.job_secret(topology)
    monkeypatch.setenv(partitioned.SECRET_ENV, "given")  # the variable first
    assert partitioned.job_secret(topology) == b"given"


def test_without_a_given_secret_the_ranks_agree_one_over_their_process_group_not_the_store(tmp_path):
    """Rank 0 draws it and broadcasts it over the gloo group: the ranks hold the same random bytes, and no
    key of the store they rendezvoused through holds them."""
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ranks = [_procs.spawn(_procs.agree_peer_secret, rank, 2, store.port, str(tmp_path / f"rank{rank}"))
             for rank in range(2)]
    for proc in ranks:
        proc.join(_procs.JOIN_TIMEOUT)
        assert proc.exitcode == 0
    secrets = [bytes.fromhex((tmp_path / f"rank{rank}").read_text()) for rank in range(2)]
    assert secrets[0] == secrets[1] and len(secrets[0]) == partitioned.SECRET_BYTES
    if hasattr(store, "list_keys"):  # torch 2.7 and later
        held = [store.get(key) for key in store.list_keys()]
        assert held and not any(secrets[0] in value or secrets[0].hex().encode() in value for value in held)


@pytest.mark.parametrize("name, value, why", [
    ("GROUP_RANK", "7", "GROUP_RANK should be a whole number from 0 to 3, but got '7'"),
    ("RANK", "8", "RANK should be a whole number from 0 to 7"),
    ("LOCAL_RANK", "-1", "LOCAL_RANK should be a whole number from 0 to 1"),
    ("WORLD_SIZE", "x", "WORLD_SIZE should be a whole number of at least 1, but got 'x'"),
    ("MASTER_PORT", "x", "MASTER_PORT should be a whole number from 1 to 65535, but got 'x'"),
    ("MASTER_PORT", "70000", "MASTER_PORT should be a whole number from 1 to 65535"),
])
def test_a_torchrun_variable_out_of_range_is_named(name, value, why):
    with pytest.raises(ValueError, match=why):
        Topology.from_env({**TORCHRUN, name: value})


def test_a_rank_past_the_servers_without_group_rank_is_named():
    plain = {k: v for k, v in TORCHRUN.items() if k != "GROUP_RANK"}
    with pytest.raises(ValueError, match="RANK 5 with LOCAL_WORLD_SIZE 2 makes server 2, but GROUP_WORLD_SIZE is 2: "
                                         "set GROUP_RANK"):
        Topology.from_env({**plain, "GROUP_WORLD_SIZE": "2"})


@pytest.mark.parametrize("name", [partitioned.TIMEOUT_ENV, partitioned.EXCHANGE_ENV])
@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1", "soon"])
def test_a_peer_time_that_is_not_a_positive_finite_number_is_named(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name} should be a .*number of seconds, but got {value!r}"):
        topology.seconds_setting(name, 1.0)


@pytest.mark.parametrize("value, why", [("abc", "COORDL_PEER_PORT should be a whole number from 0 to 65535, but "
                                                "got 'abc'"),
                                        ("-1", "COORDL_PEER_PORT should be a whole number from 0 to 65535"),
                                        ("65535", "partitioned loader 2 of the dataset would serve at port 65536")])
def test_a_peer_port_that_cannot_be_served_at_is_named(monkeypatch, value, why):
    monkeypatch.setenv(partitioned.PORT_ENV, value)
    topology = Topology.from_env(TORCHRUN)
    with pytest.raises(ValueError, match=why):
        launch.start_server(None, None, None, b"", (wire.NO_STORAGE, wire.NO_SAMPLE), wire.NO_BINDING, (1, 1),
                                  topology, ordinal=1)


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_peer_host_that_names_no_address_is_refused(monkeypatch, host):
    monkeypatch.setenv(partitioned.HOST_ENV, host)
    with pytest.raises(ValueError, match=f"COORDL_PEER_HOST should be an address the other servers can reach .*{host!r}"):
        launch.local_address(Topology.from_env(TORCHRUN))
    monkeypatch.setenv(partitioned.HOST_ENV, "node7.cluster")
    assert launch.local_address(Topology.from_env(TORCHRUN)) == "node7.cluster"


@pytest.mark.parametrize("group_up", [False, True])
def test_a_rendezvous_store_that_does_not_answer_fails_soon_naming_it(tmp_path, monkeypatch, group_up):
    """MASTER_PORT is a closed port: the loader fails within ``COORDL_PEER_EXCHANGE_S`` (here 1 s) while no
    process group is up (rank 0 may not have started the store yet), within 5 s once one is (its store is up:
    this address is wrong), naming the address and the setting (torch's client took 103 s at the default)."""
    import torch.distributed as dist
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    port = closed.getsockname()[1]
    monkeypatch.setenv(partitioned.SECRET_ENV, SECRET)
    monkeypatch.setattr(dist, "is_initialized", lambda: group_up)
    if not group_up:
        monkeypatch.setenv(partitioned.EXCHANGE_ENV, "1")
    topology = partitioned.Topology(rank=1, world=4, local_rank=1, local_world=2, node=0, nodes=2,
                                    master_addr="127.0.0.1", master_port=port, run="closed")
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=f"MASTER_ADDR:MASTER_PORT 127.0.0.1:{port} did not accept a "
                                               f"connection within {5 if group_up else 1} s .*COORDL_PEER_EXCHANGE_S"):
            partitioned.PeerTier(topology, None, _Files(tmp_path), None, processes=1)
        assert time.monotonic() - started < (8 if group_up else 4)
    finally:
        closed.close()


def test_each_item_is_owned_by_the_lowest_server_holding_it():
    maps = [np.array([1, 0, 1, 0, 0], bool), None, np.array([1, 1, 0, 0, 1], bool), np.array([0, 1, 0, 0, 1], bool)]
    assert owners_of(maps, 5).tolist() == [0, 2, 0, -1, 2]
    assert owners_of([None, None], 3).tolist() == [-1, -1, -1]  # no map in: every item from storage


def test_owners_are_identical_on_every_rank_for_random_maps():
    rng = np.random.default_rng(3)
    for nodes in (2, 7, 64):
        maps = [rng.random(10_000) < 1.5 / nodes for _ in range(nodes)]
        blobs = [encode_map(m, frozen=bool(i % 2)) for i, m in enumerate(maps)]
        seen = {owners_of([decode_map(b, 10_000)[0] for b in blobs], 10_000).tobytes() for _rank in range(3)}
        assert len(seen) == 1
        owner = np.frombuffer(seen.pop(), np.int16)
        for i in range(0, 10_000, 97):
            holders = [n for n in range(nodes) if maps[n][i]]
            assert owner[i] == (holders[0] if holders else -1)


def test_a_map_travels_with_its_frozen_flag_and_refuses_another_datasets_size():
    ready = np.random.default_rng(1).random(1001) < 0.3
    got, frozen = decode_map(encode_map(ready, True), 1001)
    assert frozen and np.array_equal(got, ready)
    with pytest.raises(RuntimeError, match="1001 items, this one 1000"):
        decode_map(encode_map(ready, False), 1000)


def test_a_maps_size_at_imagenet_scale_is_what_the_docs_say():
    n, servers = 1_281_167, 64
    ready = np.random.default_rng(2).random(n) < 1 / servers
    blob = encode_map(ready, True)
    assert len(blob) < 40_000  # partitioned NOTE [ Ownership ]: a random 1/64 share's 160 KB bitmap takes 36 KB


def test_a_hand_off_queue_sends_in_order_drains_lets_go_when_idle_and_stops(monkeypatch):
    """The sender thread: every queued item is sent, in order; ``drain`` returns once they are; after
    ``HANDOFF_IDLE_S`` with nothing to send it lets go of its connections (``idle``); past the queue's
    byte limit an offer is dropped; ``close`` drains and stops the thread."""
    monkeypatch.setattr(handoff, "HANDOFF_IDLE_S", 0.2)
    monkeypatch.setattr(handoff, "HANDOFF_QUEUE_BYTES", 100)
    sent, idle, gate = [], threading.Event(), threading.Event()

    def send(index, raw, stamp):
        gate.wait(5)
        sent.append((index, raw))
    queue = handoff.HandOffQueue(send, idle.set)
    thread = queue._thread
    queue.offer(1, b"a" * 60, None)
    deadline = time.monotonic() + 5
    while not queue._busy and time.monotonic() < deadline:  # item 1 is taken (its send waits on the gate)
        time.sleep(0.01)
    queue.offer(2, b"b" * 30, None)
    queue.offer(3, b"c" * 80, None)  # 30 + 80 > 100: dropped
    queue.offer(4, b"d" * 60, None)
    gate.set()
    queue.drain()
    assert [i for i, _ in sent] == [1, 2, 4]
    assert not idle.is_set() and idle.wait(2)  # quiet for HANDOFF_IDLE_S after the last send
    queue.offer(5, b"e", None)
    queue.close()
    assert [i for i, _ in sent] == [1, 2, 4, 5]
    assert not thread.is_alive()  # close waits for it


def _write_in_child(state):
    state.owner[3] = 1
    state.full[1] = 1
    state.counters[0, 1, 2] += 7
    state.set_address(1, "10.0.0.2:4567")


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_peer_state_is_one_shared_memory_for_every_process_and_plain_numpy_in_each(start):
    """Its fields are numpy views of shared tensors (nothing in them calls into torch), made again when the
    state reaches a worker, forked or spawned: what the worker writes, the rank reads."""
    state = partitioned.PeerState(n_items=8, nodes=2, processes=1)
    assert all(type(getattr(state, f)) is np.ndarray for f in ("owner", "meta", "down", "warned", "full",
                                                               "addresses", "counters"))
    child = multiprocessing.get_context(start).Process(target=_write_in_child, args=(state,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert state.owner.tolist() == [-1, -1, -1, 1, -1, -1, -1, -1]
    assert state.full.tolist() == [0, 1] and state.counters[0, 1, 2] == 7
    assert state.address(1) == ("10.0.0.2", 4567) and state.address(0) is None


_EXITING_RANK = textwrap.dedent("""
    import atexit, json, sys, threading

    def record():  # registered first, so it runs last of the exit hooks: what still runs as finalization begins
        with open(sys.argv[1], "w") as f:
            json.dump({"threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("coordl-")),
                       "torch_calls": sorted(torch_calls)}, f)
    atexit.register(record)

    import time
    import torch.distributed as dist
    from coordl import partitioned
    from coordl._peer import handoff

    torch_calls = set()  # (thread, callee) for every call from a coordl thread into torch's native code
    def watch(frame, event, arg):
        name = threading.current_thread().name
        if event == "c_call" and name.startswith("coordl-"):
            owner = getattr(arg, "__self__", None)
            module = getattr(arg, "__module__", None) or type(owner).__module__
            if module and module.startswith("torch"):
                torch_calls.add((name, arg.__qualname__))
    threading.setprofile(watch)

    class Source:  # the dataset's keys: all a rank without a peer server needs of it
        def __len__(self):
            return 8
        def raw_key(self, i):
            return f"class/{i}.jpg"

    handoff.HANDOFF_DRAIN_S = 1.0
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    topology = partitioned.Topology(rank=1, world=4, local_rank=1, local_world=2, node=0, nodes=2,
                                    master_addr="127.0.0.1", master_port=store.port, run="exit")
    tier = partitioned.PeerTier(topology, None, Source(), None, processes=1)
    tier.begin_epoch(1)  # the learner waits for server 1's address: it never comes
    tier.client.hand_off(0, b"x" * 10, None)  # the sender waits for an address to hand it to
    sender = tier.client._hand_off[1]
    while not sender._busy:
        time.sleep(0.01)
    time.sleep(0.3)  # both threads in their waits
    sys.exit(0)  # without closing the loader, as a script may
""")


def test_a_process_exits_with_its_background_threads_stopped_and_out_of_torch(tmp_path):
    """NOTE [ Threads at exit ]: a rank exits (without closing anything) while its address learner waits in
    the store for a server that never comes and its hand-off sender waits for somewhere to send. By the time
    finalization begins both threads have ended (a daemon thread inside torch then aborts the process), and
    the sender never called into torch's native code."""
    out = tmp_path / "exit.json"
    env = dict(os.environ, COORDL_PEER_SECRET="s" * 16, COORDL_PEER_EXCHANGE_S="60")
    proc = subprocess.run([sys.executable, "-c", _EXITING_RANK, str(out)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(out.read_text())
    assert seen["threads"] == [], seen
    assert not [call for call in seen["torch_calls"] if call[0] == "coordl-hand-off"], seen
    assert any(call[0] == "coordl-peer-addresses" for call in seen["torch_calls"])  # the watch sees store calls


def test_an_item_its_owner_does_not_deliver_is_read_from_storage_and_not_cached_twice(tmp_path):
    """NOTE [ Peer read path ]: server 1 owns items 0 and 1 but serves only 0 (its copy of 1 is stale, say);
    item 2 is no server's. With room in this server's cache, only item 2 goes in: 0 came from the peer and
    1's copy is server 1's while the map names it. With server 1 gone, 0 too is read and not cached."""
    import torch.distributed as dist

    from coordl._cache.minio import MinIOCache, cache_segment_name
    from coordl._fetch.cached_dataset import CachedDataset, SampleCounters
    from coordl._fetch.storage import FileStorage
    from coordl._peer.server import PeerServer

    files = [tmp_path / f"f{i}" for i in range(3)]
    for i, f in enumerate(files):
        f.write_bytes(bytes([i]) * (100 + i))

    class Source:
        def __len__(self):
            return len(files)

        def raw_key(self, i):
            return str(files[i])

        def decode_raw(self, i, raw):
            return bytes(raw)

    peer = PeerServer(lambda i: (files[i].read_bytes(), None) if i == 0 else None, len(files), b"s" * 16,
                      "127.0.0.1").start()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    topology = partitioned.Topology(rank=1, world=4, local_rank=1, local_world=2, node=0, nodes=2,
                                    master_addr="127.0.0.1", master_port=store.port, run="no-double")
    os.environ[partitioned.SECRET_ENV] = "s" * 16
    try:
        tier = partitioned.PeerTier(topology, None, Source(), None, processes=1)
        peer.binding = tier.binding  # server 1 serves this job's loader
        tier.state.set_address(1, "127.0.0.1:%d" % peer.address[1])
        tier.state.owner[:] = [1, 1, -1]
        tier.state.meta[0] = 1  # a map is known
        with MinIOCache(cache_segment_name(f"no-double-{time.monotonic_ns()}"), n_items=3, capacity_bytes=2**20,
                        fingerprint=bytes(32)) as cache:
            counters = SampleCounters(1)
            dataset = CachedDataset(Source(), Source(), cache, FileStorage(drop_page_cache=False), counters,
                                    identity=bytes(32), peers=tier)
            got = dataset.fetch_many([0, 1, 2], counters.row())
            assert [bytes(g) for g in got] == [f.read_bytes() for f in files]
            row = counters.totals()
            assert (row["peer_hits"], row["misses"]) == (1, 2)
            assert [cache.get(i) is not None for i in range(3)] == [False, False, True]
            peer.close()
            tier.state.down[1] = 1  # found gone: its items come from storage, its copies stay its own
            assert [bytes(g) for g in dataset.fetch_many([0, 1], counters.row())] == [f.read_bytes() for f in files[:2]]
            assert [cache.get(i) is not None for i in range(3)] == [False, False, True]
            tier.close()
    finally:
        del os.environ[partitioned.SECRET_ENV]
        peer.close()


SECRET = "s" * 16


class _Files:
    """``n`` small files under ``root``, as a ``CachedDataset``'s source (keys, and bytes as the sample)."""

    def __init__(self, root, n: int = 3):
        self.paths = [root / f"f{i}" for i in range(n)]
        for i, path in enumerate(self.paths):
            path.write_bytes(bytes([i]) * (100 + i))

    def __len__(self):
        return len(self.paths)

    def raw_key(self, i):
        return str(self.paths[i])

    def decode_raw(self, i, raw):
        return bytes(raw)

    def read(self) -> list[bytes]:
        return [path.read_bytes() for path in self.paths]


@contextlib.contextmanager
def _server_0(monkeypatch, files: _Files, storage, peer: PeerServer, peer_address=None, cache_bytes: int = 2**20):
    """A ``CachedDataset`` of ``files`` read from ``storage`` by rank 1 of server 0 of 2 (no peer server of its
    own) with a cache of ``cache_bytes``, and its counters; server 1's peer server is ``peer`` (made to serve
    this loader's binding), reached at ``peer_address`` (default: its own), and no map is known yet."""
    import torch.distributed as dist

    from coordl._fetch.cached_dataset import CachedDataset, SampleCounters
    monkeypatch.setenv(partitioned.SECRET_ENV, SECRET)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    topology = partitioned.Topology(rank=1, world=4, local_rank=1, local_world=2, node=0, nodes=2,
                                    master_addr="127.0.0.1", master_port=store.port, run=f"peer-{time.monotonic_ns()}")
    tier = partitioned.PeerTier(topology, None, files, storage, processes=1)
    peer.binding = tier.binding
    tier.state.set_address(1, "127.0.0.1:%d" % (peer_address or peer.address)[1])
    with MinIOCache(cache_segment_name(f"server-0-{time.monotonic_ns()}"), n_items=len(files),
                    capacity_bytes=cache_bytes, fingerprint=bytes(32)) as cache:
        counters = SampleCounters(1)
        try:
            yield CachedDataset(files, files, cache, storage, counters, identity=bytes(32), peers=tier), counters
        finally:
            tier.close()


def _owned_by_server_1(dataset) -> None:
    dataset.peers.state.owner[:] = 1
    dataset.peers.state.meta[0] = 1  # a map is known


def test_a_peer_copy_whose_stamp_is_not_this_servers_files_is_read_from_storage(tmp_path, monkeypatch):
    """Server 1 reads the same files and serves its copies with the stamps they were stored with, unchecked (as
    a server that missed an edit would): item 1's file has been edited since, so item 1 comes from storage
    (counted stale), items 0 and 2 from the peer. The stamps of a server with its own copy of the dataset
    (another storage id) are not compared: its items are used."""
    files, storage = _Files(tmp_path), FileStorage(drop_page_cache=False)
    stored = {i: storage.read_stamped(files.raw_key(i)) for i in range(len(files))}
    edit(files.paths[1])
    copies = {i: (raw, (7, 7, len(raw))) for i, raw in enumerate(files.read())}  # another server's stamps
    peers = [PeerServer(stored.get, len(files), SECRET.encode(), "127.0.0.1",
                        storage_id=storage_id(storage, files.raw_key(0))).start(),
             PeerServer(copies.get, len(files), SECRET.encode(), "127.0.0.1",
                        storage_id=b"its own copy".ljust(16, b"\0")).start()]
    try:
        for peer, expected in zip(peers, [(2, 1, 1), (3, 0, 0)]):
            with _server_0(monkeypatch, files, storage, peer) as (dataset, counters):
                _owned_by_server_1(dataset)
                assert [bytes(raw) for raw in dataset.fetch_many([0, 1, 2], counters.row())] == files.read()
                totals = counters.totals()
                assert (totals["peer_hits"], totals["stale"], totals["misses"]) == expected
    finally:
        for peer in peers:
            peer.close()


class _Bucket:
    """Three objects as an object store's client holds them (``get``, ``etag``: MD5s, as single-part
    uploads), and as a ``CachedDataset``'s source (their URLs as keys, bytes as the sample)."""

    def __init__(self):
        self.objects = {f"p/o{i}": bytes([i]) * (100 + i) for i in range(3)}

    def get(self, key):
        return self.objects[key]

    def etag(self, key):
        return hashlib.md5(self.objects[key]).hexdigest()

    def manifest(self):
        keys = sorted(self.objects)
        return Manifest("s3://b/p", keys, [len(self.objects[k]) for k in keys], [self.etag(k) for k in keys])

    def __len__(self):
        return len(self.objects)

    def raw_key(self, i):
        return f"s3://b/p/o{i}"

    def decode_raw(self, i, raw):
        return bytes(raw)


def test_a_peer_copy_of_an_object_changed_in_the_bucket_is_not_used_before_the_peer_notices(tmp_path, monkeypatch):
    """Object 1 changed in the bucket (to bytes of the same size) and this server's listing marked it, but
    server 1 has not listed the prefix again: it still serves its cached copy with the manifest's stamp. This
    server reads object 1 fresh from the bucket (counted stale) and takes 0 and 2 from the peer; a peer copy
    of a changed object is no file missing here."""
    bucket = _Bucket()
    manifest, old = bucket.manifest(), [bucket.objects[f"p/o{i}"] for i in range(3)]
    theirs = ObjectStorage(bucket, manifest)
    stored = {i: theirs.read_stamped(bucket.raw_key(i)) for i in range(3)}
    bucket.objects["p/o1"] = b"\xff" * len(old[1])
    mine = ObjectStorage(bucket, manifest)
    mine.changed[1] = 1  # as this server's listing at the epoch boundary marks it
    peer = PeerServer(stored.get, 3, SECRET.encode(), "127.0.0.1",
                      storage_id=storage_id(theirs, bucket.raw_key(0))).start()
    try:
        assert storage_id(mine, bucket.raw_key(0)) == peer.storage_id  # both read the same bucket: stamps compare
        with _server_0(monkeypatch, bucket, mine, peer) as (dataset, counters):
            _owned_by_server_1(dataset)
            got = [bytes(raw) for raw in dataset.fetch_many([0, 1, 2], counters.row())]
            assert got == [old[0], bucket.objects["p/o1"], old[2]]
            totals = counters.totals()
            assert (totals["peer_hits"], totals["stale"], totals["misses"]) == (2, 1, 1)
    finally:
        peer.close()


def test_a_hand_off_carries_the_stamp_of_the_read_and_is_not_kept_after_an_edit(tmp_path, monkeypatch):
    """This server's cache is full, so what it reads is handed to server 1, which reads the same files. Item
    1's file is edited right after this server read it (a hook in the storage), before server 1 admits the
    bytes: server 1 declines them, and holds and serves nothing for item 1; item 2 it keeps with the stamp
    of this server's read."""
    files = _Files(tmp_path)

    class EditedAfterRead(FileStorage):
        armed = False  # from the batch's reads on

        def read_stamped(self, key):
            read = super().read_stamped(key)
            if self.armed and key == files.raw_key(1):
                edit(files.paths[1])
            return read
    storage, before = EditedAfterRead(drop_page_cache=False), files.read()
    with MinIOCache(cache_segment_name(f"server-1-{time.monotonic_ns()}"), n_items=len(files),
                    capacity_bytes=2**20, fingerprint=bytes(32)) as theirs:
        peer = PeerServer(cache_lookup(theirs, files, storage), len(files), SECRET.encode(), "127.0.0.1",
                          keeper=CacheKeeper(theirs, files, storage),
                          storage_id=storage_id(storage, files.raw_key(0))).start()
        try:
            with _server_0(monkeypatch, files, storage, peer, cache_bytes=1) as (dataset, counters):
                storage.armed = True
                assert [bytes(raw) for raw in dataset.fetch_many([1, 2], counters.row())] == before[1:]
                dataset.peers.client.drain_hand_offs()
                assert dataset.peers.peer_stats()[0]["handed_off"] == 1
        finally:
            peer.close()
        assert theirs.get(1) is None
        assert theirs.get(2) == before[2] and theirs.stamp(2) == storage.stamp(files.raw_key(2))


def test_a_relay_that_rewrites_a_peers_replies_gets_no_forged_byte_into_a_batch(tmp_path, monkeypatch):
    """A relay between this server and server 1 passes the handshake through and rewrites every item it
    relays: the batch holds the files' own bytes (from storage), nothing from the peer, and the peer is
    marked down for the epoch."""
    files, storage = _Files(tmp_path), FileStorage(drop_page_cache=False)
    served = {i: (raw, None) for i, raw in enumerate(files.read())}
    peer = PeerServer(served.get, len(files), SECRET.encode(), "127.0.0.1").start()
    relay = Relay(peer.address, forge_item=flip)
    try:
        with _server_0(monkeypatch, files, storage, peer, relay.address) as (dataset, counters):
            _owned_by_server_1(dataset)
            assert [bytes(raw) for raw in dataset.fetch_many([0, 1, 2], counters.row())] == files.read()
            assert counters.totals()["peer_hits"] == 0 and relay.seen["items"] >= 1
            assert dataset.peers.state.down[1] == 1
    finally:
        relay.close()
        peer.close()


def test_another_jobs_server_at_a_peers_address_is_marked_down_and_nothing_of_it_is_used(tmp_path, monkeypatch,
                                                                                          caplog):
    """Another job's peer server (the same secret, the same dataset's size, other bytes) took over server 1's
    address: the handshake fails on the binding, server 1 is marked down, said once, and the batch is read
    from storage. Server 1's own peer server there is used."""
    files, storage = _Files(tmp_path), FileStorage(drop_page_cache=False)
    others = {i: (b"another dataset's item", None) for i in range(len(files))}
    impostor = PeerServer(others.get, len(files), SECRET.encode(), "127.0.0.1").start()
    try:
        with _server_0(monkeypatch, files, storage, impostor) as (dataset, counters):
            impostor.binding = os.urandom(wire.BINDING_BYTES)  # another job's loader
            _owned_by_server_1(dataset)
            with caplog.at_level("WARNING", logger="coordl._peer.tier"):
                for _ in range(2):
                    assert [bytes(raw) for raw in dataset.fetch_many([0, 1, 2], counters.row())] == files.read()
                    dataset.peers.state.down[1] = 0  # as at an epoch start: tried again
            assert counters.totals()["peer_hits"] == 0
            said = [r.getMessage() for r in caplog.records if "server 1" in r.getMessage()]
            assert len(said) == 1 and "serves another job or dataset" in said[0], said
            impostor.binding = dataset.peers.binding  # the job's own server 1
            assert [bytes(raw) for raw in dataset.fetch_many([0, 1, 2], counters.row())] == [others[i][0]
                                                                                             for i in range(3)]
    finally:
        impostor.close()


@pytest.mark.parametrize("theirs", ["other bytes", "only some files", "the same"])
def test_a_server_whose_copy_of_the_dataset_differs_is_marked_down_and_said_so_once(tmp_path, monkeypatch, caplog,
                                                                                     theirs):
    """Server 1 keeps its own copy of the dataset (another storage id). With other bytes in files of the same
    sizes, the handshake's samples differ: server 1 is marked down, said once naming the items, and nothing of
    its copy is used, epoch after epoch. A copy that lacks some files, or holds the same bytes, is used."""
    files, storage = _Files(tmp_path), FileStorage(drop_page_cache=False)
    (tmp_path / "copy").mkdir()
    copy = _Files(tmp_path / "copy")
    if theirs == "other bytes":
        for i, path in enumerate(copy.paths):
            path.write_bytes(bytes([i + 7]) * (100 + i))
    elif theirs == "only some files":
        copy.paths[1].unlink()
    served = {i: (path.read_bytes(), None) for i, path in enumerate(copy.paths) if path.exists()}
    peer = PeerServer(served.get, len(files), SECRET.encode(), "127.0.0.1", storage_id=b"own copy".ljust(16, b"\0"),
                      sample=peer_server.copy_sample(storage, copy)).start()
    try:
        with _server_0(monkeypatch, files, storage, peer) as (dataset, counters):
            _owned_by_server_1(dataset)
            with caplog.at_level("WARNING", logger="coordl._peer.tier"):
                for _ in range(2):
                    assert [bytes(raw) for raw in dataset.fetch_many([0, 1, 2], counters.row())] == files.read()
                    dataset.peers.state.down[1] = 0  # as at an epoch start: tried again
            said = [r.getMessage() for r in caplog.records if "server 1" in r.getMessage()]
            if theirs == "other bytes":
                assert counters.totals()["peer_hits"] == 0
                assert len(said) == 1 and "copy of the dataset differs" in said[0] and "0, 1, 2" in said[0], said
            else:
                assert counters.totals()["peer_hits"] == 2 * len(served) and said == []
    finally:
        peer.close()


def test_a_peer_found_down_is_tried_again_at_the_next_epoch_start(tmp_path, monkeypatch):
    """Server 1 refuses this process's handshake in epoch 1 (another job's binding): it is marked down and the
    batch comes from storage. Then it serves this job's loader; once epoch 2 has begun (its map exchange
    through the rendezvous store), the next batch comes from it."""
    files, storage = _Files(tmp_path), FileStorage(drop_page_cache=False)
    served = {i: (raw, None) for i, raw in enumerate(files.read())}
    peer = PeerServer(served.get, len(files), SECRET.encode(), "127.0.0.1").start()
    try:
        with _server_0(monkeypatch, files, storage, peer) as (dataset, counters):
            tier = dataset.peers
            peer.binding = os.urandom(wire.BINDING_BYTES)
            _owned_by_server_1(dataset)
            assert [bytes(raw) for raw in dataset.fetch_many([0, 1, 2], counters.row())] == files.read()
            assert tier.state.down[1] == 1 and counters.totals()["peer_hits"] == 0
            peer.binding = tier.binding
            assert [bytes(raw) for raw in dataset.fetch_many([0, 1, 2], counters.row())] == files.read()
            assert counters.totals()["peer_hits"] == 0  # down for the rest of the epoch
            tier._store.set("e2/map/0", encode_map(np.zeros(len(files), dtype=bool), False))  # as local rank 0 would
            tier._store.set("e2/map/1", encode_map(np.ones(len(files), dtype=bool), True))
            tier.begin_epoch(1)
            tier.begin_epoch(2)
            assert tier.state.down[1] == 0 and list(tier.state.owner) == [1, 1, 1]
            assert [bytes(raw) for raw in dataset.fetch_many([0, 1, 2], counters.row())] == files.read()
            assert counters.totals()["peer_hits"] == 3
    finally:
        peer.close()


def test_a_connection_the_peer_dropped_as_idle_is_reopened_and_costs_no_peer_hit(tmp_path, monkeypatch):
    """``_peer.server`` NOTE [ Peer server limits ]: server 1 drops this process's kept connection once idle; the
    next batch reopens it. Then server 1 drops it just as a request arrives (the server reads it and closes,
    as an idle deadline passing then would): the request goes again on a new connection. Every item comes
    from the peer, which is never marked down."""
    files, storage = _Files(tmp_path), FileStorage(drop_page_cache=False)
    served = {i: (raw, None) for i, raw in enumerate(files.read())}
    peer = PeerServer(served.get, len(files), SECRET.encode(), "127.0.0.1", idle_s=0.2).start()
    read_request, requests, dropped = peer_server.wire.read_request, {}, []

    def drop_a_kept_connection(channel, *args):  # its second request, once: read, then dropped unanswered
        request = read_request(channel, *args)
        requests[id(channel)] = requests.get(id(channel), 0) + 1
        if requests[id(channel)] == 2 and not dropped:
            dropped.append(channel)
            return None
        return request
    try:
        with _server_0(monkeypatch, files, storage, peer) as (dataset, counters):
            _owned_by_server_1(dataset)
            assert [bytes(raw) for raw in dataset.fetch_many([0, 1, 2], counters.row())] == files.read()
            kept = dataset.peers.client._connections()[1].sock
            assert select.select([kept], [], [], 5)[0]  # server 1 closed it (idle)
            peer.idle_s = 60.0  # from now on connections are dropped by the hook only
            monkeypatch.setattr(peer_server.wire, "read_request", drop_a_kept_connection)
            assert [bytes(raw) for raw in dataset.fetch_many([0, 1, 2], counters.row())] == files.read()
            assert [bytes(raw) for raw in dataset.fetch_many([0, 1, 2], counters.row())] == files.read()
            assert dropped and counters.totals()["peer_hits"] == 9 and dataset.peers.state.down[1] == 0
    finally:
        peer.close()


def test_a_slow_but_live_link_costs_a_bounded_wait(tmp_path, monkeypatch):
    """A relay passes server 1's replies on a byte every 20 ms (never silent for the 0.5 s timeout): the
    whole reply is due within the timeout plus its bytes at ``wire.MIN_RATE``, so the batch waits about
    0.5 s, not the 9 s the reply would take, and its items come from storage."""
    files, storage = _Files(tmp_path), FileStorage(drop_page_cache=False)
    served = {i: (raw, None) for i, raw in enumerate(files.read())}
    peer = PeerServer(served.get, len(files), SECRET.encode(), "127.0.0.1").start()
    relay = Relay(peer.address, trickle_s=0.02)
    monkeypatch.setenv(partitioned.TIMEOUT_ENV, "0.5")
    try:
        with _server_0(monkeypatch, files, storage, peer, relay.address) as (dataset, counters):
            _owned_by_server_1(dataset)
            started = time.monotonic()
            assert [bytes(raw) for raw in dataset.fetch_many([0, 1, 2], counters.row())] == files.read()
            assert time.monotonic() - started < 2.0
            assert counters.totals()["peer_hits"] == 0 and dataset.peers.state.down[1] == 1
    finally:
        relay.close()
        peer.close()


class _PeersThatStopIterating:
    """A peer tier whose epoch start raises StopIteration (as a map exchange that found no map once did)."""

    topology = types.SimpleNamespace(nodes=2)

    def begin_epoch(self, epoch):
        raise StopIteration

    def close(self):
        pass


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_epoch_start_that_raises_stopiteration_fails_and_never_ends_the_epoch_empty(image_root, num_workers):
    """Out of the batch sampler's ``__next__``, a StopIteration is torch's end of the epoch: 0 batches, no error."""
    import coordl
    from coordl._fetch.raw_datasets import FileDataset
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(image_root) for f in fs)
    with coordl.DataLoader(FileDataset(files, decode="bytes"), batch_size=8, num_workers=num_workers,
                           collate_fn=list) as loader:
        loader.dataset.peers = _PeersThatStopIterating()
        with pytest.raises(RuntimeError, match="starting the epoch raised StopIteration"):
            list(loader)
