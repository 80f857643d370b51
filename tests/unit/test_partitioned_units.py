"""Partitioned caching's pieces without a cluster: topology from torchrun's environment, the option, cache maps
and the ownership they give."""

import threading
import time

import numpy as np
import pytest

from coordl import partitioned
from coordl.partitioned import Topology, decode_map, encode_map, owners_of, resolve

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
    ({**TORCHRUN, "GROUP_WORLD_SIZE": "1", "WORLD_SIZE": "2", "GROUP_RANK": "0"}, True, None),  # one server
    ({}, True, None),  # not a distributed job
])
def test_auto_partitions_only_a_job_of_several_servers_with_a_cache(monkeypatch, env, cache_on, expected):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
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


def test_each_item_is_owned_by_the_lowest_server_holding_it():
    maps = [np.array([1, 0, 1, 0, 0], bool), None, np.array([1, 1, 0, 0, 1], bool), np.array([0, 1, 0, 0, 1], bool)]
    assert owners_of(maps).tolist() == [0, 2, 0, -1, 2]


def test_owners_are_identical_on_every_rank_for_random_maps():
    rng = np.random.default_rng(3)
    for nodes in (2, 7, 64):
        maps = [rng.random(10_000) < 1.5 / nodes for _ in range(nodes)]
        blobs = [encode_map(m, frozen=bool(i % 2)) for i, m in enumerate(maps)]
        seen = {owners_of([decode_map(b, 10_000)[0] for b in blobs]).tobytes() for _rank in range(3)}
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
    monkeypatch.setattr(partitioned, "HANDOFF_IDLE_S", 0.2)
    monkeypatch.setattr(partitioned, "HANDOFF_QUEUE_BYTES", 100)
    sent, idle, gate = [], threading.Event(), threading.Event()

    def send(index, raw):
        gate.wait(5)
        sent.append((index, raw))
    queue = partitioned._HandOff(send, idle.set)
    thread = [t for t in threading.enumerate() if t.name == "coordl-hand-off"][-1]
    queue.offer(1, b"a" * 60)
    deadline = time.monotonic() + 5
    while not queue._busy and time.monotonic() < deadline:  # item 1 is taken (its send waits on the gate)
        time.sleep(0.01)
    queue.offer(2, b"b" * 30)
    queue.offer(3, b"c" * 80)  # 30 + 80 > 100: dropped
    queue.offer(4, b"d" * 60)
    gate.set()
    queue.drain()
    assert [i for i, _ in sent] == [1, 2, 4]
    assert not idle.is_set() and idle.wait(2)  # quiet for HANDOFF_IDLE_S after the last send
    queue.offer(5, b"e")
    queue.close()
    assert [i for i, _ in sent] == [1, 2, 4, 5]
    thread.join(2)
    assert not thread.is_alive()
