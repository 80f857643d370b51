"""Partitioned caching across servers, each in its own network and mount namespace with its own /dev/shm and
storage cgroup, launched by its own torchrun (``harness/cluster.py``): storage read once, every sample exactly
once per epoch, peers dying mid-epoch, strangers refused."""

import json
import os
import shutil
import signal
import socket
import sys
import time
import zlib

import pytest
from torch.utils.data.distributed import DistributedSampler

from coordl._demo.synthetic import make_image_folder
from coordl._peer.topology import TIMEOUT_ENV
from harness.cluster import make_cluster  # noqa: F401  (a fixture)
from harness.s3 import S3Server
from harness.storage_env import Cleanup, copy_to_loop_disk, evict_files

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

JOB = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "benchmarks", "partitioned_job.py")
N_FILES = 96
SECRET = "known-to-this-test"
RELAXED_PEER_TIMEOUT_S = 10.0
"""The peer timeout of the tests about where bytes come from: on a loaded machine a reply can take more
than the default 1 s, which would send a batch to storage (only the tests of a dead peer keep 1 s)."""


@pytest.fixture(scope="module")
def source_root(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("partitioned") / "images")
    make_image_folder(root, N_FILES, n_classes=3, mean_side_px=64, seed=4)
    return root


@pytest.fixture
def dataset(source_root, tmp_path):
    """The dataset on a loop device of its own where one can be made (so each server's device reads are
    counted), else on the real disk: (root, its files' crc32s and sizes in index order, device or None)."""
    with Cleanup() as cleanup:
        try:
            disk = copy_to_loop_disk(cleanup, str(tmp_path), source_root)
            root, device = disk.root, disk.device
            evict_files(root)
        except OSError as e:
            print(f"dataset on the real disk, device reads not counted: {e}")
            root, device = source_root, None
        files = sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names)
        crcs, sizes = [], []
        for path in files:
            with open(path, "rb") as f:
                raw = f.read()
            crcs.append(zlib.crc32(raw))
            sizes.append(len(raw))
        if device is not None:
            evict_files(root)
        yield root, crcs, sizes, device


def _run(cluster, root: str, out: str, *, epochs: int, cache_bytes, nproc: int, extra=(), wait=True,
         peer_timeout_s: float | None = RELAXED_PEER_TIMEOUT_S, secret: str | None = SECRET, env=None):
    """Launch the job on every server (``peer_timeout_s``: ``COORDL_PEER_TIMEOUT_S``, None for the default,
    which the tests of a dead peer's cost keep; ``secret``: ``COORDL_PEER_SECRET``, None for none; ``env``:
    more variables); with ``wait``, its results."""
    os.makedirs(out, exist_ok=True)
    env = {"COORDL_LOG_LEVEL": "INFO", **({"COORDL_PEER_SECRET": secret} if secret is not None else {}),
           **(env or {})}
    if peer_timeout_s is not None:
        env[TIMEOUT_ENV] = str(peer_timeout_s)
    cluster.launch_all(JOB, ["--root", root, "--out", out, "--epochs", str(epochs), "--cache-bytes", str(cache_bytes),
                             *extra], nproc=nproc, env=env)
    if wait:
        return _results(cluster, out, nproc)


def _results(cluster, out: str, nproc: int, nodes=None) -> list[dict]:
    nodes = list(range(len(cluster.addresses))) if nodes is None else nodes
    codes = cluster.wait(240, nodes=nodes)
    assert codes == [0] * len(nodes), "\n".join(cluster.log(n)[-3000:] for n in nodes)
    for node in nodes:
        assert cluster.shm_left(node) == [], f"server {node} left {cluster.shm_left(node)} in its /dev/shm"
    with_rank = [json.load(open(os.path.join(out, f"rank{r}.json"))) for node in nodes
                 for r in range(node * nproc, (node + 1) * nproc)]
    return with_rank


def _check_every_sample_once(results: list[dict], crcs: list[int], epochs: int) -> None:
    for e in range(epochs):
        samples = [s for r in results for s in r["epochs"][e]["samples"]]
        assert sorted(i for i, _ in samples) == list(range(len(crcs))), f"epoch {e + 1}"
        assert all(crcs[i] == c for i, c in samples), f"epoch {e + 1}: bytes that are not the file's"


def _epoch_sum(results: list[dict], epoch: int, field: str) -> int:
    return sum(r["stats"][epoch - 1][field] for r in results)


def _print_mode(cluster) -> None:
    print(f"cluster: {cluster.mode} ({cluster.why or 'namespaces'})")


def test_with_the_whole_dataset_cached_across_servers_storage_is_read_once(make_cluster, dataset, tmp_path):
    root, crcs, sizes, device = dataset
    total = sum(sizes)
    cluster = make_cluster(2, device=device)
    _print_mode(cluster)
    results = _run(cluster, root, str(tmp_path / "out"), epochs=3, cache_bytes=total, nproc=2)
    _check_every_sample_once(results, crcs, 3)
    assert _epoch_sum(results, 1, "storage_bytes") == total
    for epoch in (2, 3):
        assert _epoch_sum(results, epoch, "storage_bytes") == 0
        assert _epoch_sum(results, epoch, "peer_hits") > 0 and _epoch_sum(results, epoch, "peer_wait_s") > 0
        assert _epoch_sum(results, epoch, "hits") + _epoch_sum(results, epoch, "peer_hits") == len(sizes)
        assert _epoch_sum(results, epoch, "peer_bytes") + _epoch_sum(results, epoch, "cache_bytes") == total
    assert len({r["owner_digest"] for r in results}) == 1  # one ownership map on every rank
    assert sorted(tuple(r["partition"]) for r in results) == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert all(p["bytes"] > 0 and p["requests"] > 0 and not p["down"] for r in results for p in r["peers"])
    assert "epoch=2 complete=1" in cluster.log(1) and " servers=2 peer_hits=" in cluster.log(1)  # the summary line
    if device is not None:  # the devices agree: the dataset once (file system blocks), not three times
        read = [cluster.device_read_bytes(n) for n in range(2)]
        assert total <= sum(read) <= 1.1 * total + 2**20, read


def test_later_epochs_read_what_no_server_caches(make_cluster, dataset, tmp_path):
    root, crcs, sizes, device = dataset
    total = sum(sizes)
    cluster = make_cluster(2, device=device)
    results = _run(cluster, root, str(tmp_path / "out"), epochs=3, cache_bytes=total // 4, nproc=2)
    _check_every_sample_once(results, crcs, 3)
    cached = sum({r["node"]: r["cached_bytes"] for r in results}.values())  # one cache per server
    assert total / 2 - 2 * max(sizes) <= cached <= total / 2
    for epoch in (2, 3):  # exactly dataset - aggregate cache: no duplicates across servers
        assert _epoch_sum(results, epoch, "storage_bytes") == total - cached
        assert _epoch_sum(results, epoch, "peer_bytes") + _epoch_sum(results, epoch, "cache_bytes") == cached
    if device is not None:
        read = sum(cluster.device_read_bytes(n) for n in range(2))
        assert total + 2 * (total - cached) <= read <= 1.1 * (3 * total - 2 * cached) + 2**20


def test_a_servers_peers_are_served_from_its_disk_tier_as_from_its_memory(make_cluster, dataset, tmp_path):
    """Each server's memory cache holds an eighth of the dataset and its disk tier the rest: the job's aggregate
    cache is the sum of both tiers on every server, so later epochs read nothing from storage."""
    root, crcs, sizes, device = dataset
    total = sum(sizes)
    cluster = make_cluster(2, device=device)
    results = _run(cluster, root, str(tmp_path / "out"), epochs=3, cache_bytes=total // 8, nproc=2,
                   extra=["--cache-dir", str(tmp_path / "disk")])
    _check_every_sample_once(results, crcs, 3)
    in_memory = sum({r["node"]: r["cached_bytes"] for r in results}.values())
    assert in_memory <= total / 4 and _epoch_sum(results, 1, "storage_bytes") == total
    for epoch in (2, 3):
        assert _epoch_sum(results, epoch, "storage_bytes") == 0 and _epoch_sum(results, epoch, "misses") == 0
        served = {field: _epoch_sum(results, epoch, field) for field in ("hits", "disk_hits", "peer_hits")}
        assert sum(served.values()) == len(sizes) and served["disk_hits"] > 0, served
        # more than the peers' memory caches hold: the rest came off their disks
        assert _epoch_sum(results, epoch, "peer_bytes") > in_memory, served


def test_what_a_full_cache_cannot_take_is_handed_to_a_peer_with_room(make_cluster, dataset, tmp_path):
    """Server 0's cache holds a quarter of the dataset, server 1's all of it: server 0's overflow of epoch 1
    goes to server 1 as it is read, so no later epoch reads storage (without hand-offs they would read
    about a quarter of the dataset again)."""
    root, crcs, sizes, device = dataset
    total = sum(sizes)
    cluster = make_cluster(2, device=device)
    results = _run(cluster, root, str(tmp_path / "out"), epochs=3, cache_bytes=f"{total // 4},{total}", nproc=2)
    _check_every_sample_once(results, crcs, 3)
    assert _epoch_sum(results, 1, "storage_bytes") == total
    cached = {r["node"]: r["cached_bytes"] for r in results}
    assert cached[0] <= total // 4 and cached[0] + cached[1] == total  # no item twice, none left out
    share0 = sum(sizes[i] for r in results if r["node"] == 0 for i, _ in r["epochs"][0]["samples"])
    handed = sum(p["handed_off_bytes"] for r in results if r["node"] == 0 for p in r["peers"])
    assert handed > 0 and cached[0] + handed == share0  # server 0's epoch 1: kept, or handed off
    for epoch in (2, 3):
        assert _epoch_sum(results, epoch, "storage_bytes") == 0
    if device is not None:
        read = [cluster.device_read_bytes(n) for n in range(2)]
        assert total <= sum(read) <= 1.1 * total + 2**20, read


def test_a_servers_map_waits_for_the_hand_offs_of_every_server_that_is_up(make_cluster, dataset, tmp_path):
    """The race forced: server 0's ranks pause after their first batch of epoch 1 (no workers: they fetch in
    the training loop), so server 1 finishes epoch 1 and reaches the exchange long before server 0 reads,
    overflows and hands off the rest of its share. Server 1's map must still hold those hand-offs."""
    root, crcs, sizes, _ = dataset
    total = sum(sizes)
    out = str(tmp_path / "out")
    cluster = make_cluster(2)
    _run(cluster, root, out, epochs=2, cache_bytes=f"{total // 8},{total}", nproc=2, wait=False,
         extra=["--workers", "0", "--pause", "1:1:0"])
    _wait_paused(out, [0, 1])
    deadline = time.monotonic() + 60
    while "epoch=1 complete=1" not in cluster.log(1):  # server 1 is through epoch 1
        assert time.monotonic() < deadline, cluster.log(1)[-3000:]
        time.sleep(0.1)
    time.sleep(1.0)  # ... and at the exchange
    open(os.path.join(out, "go"), "w").close()
    results = _results(cluster, out, 2)
    _check_every_sample_once(results, crcs, 2)
    handed = sum(p["handed_off"] for r in results if r["node"] == 0 for p in r["peers"])
    assert handed > 0
    assert _epoch_sum(results, 2, "storage_bytes") == 0, "\n".join(cluster.log(n)[-3000:] for n in range(2))


def test_a_server_holding_only_the_files_it_caches_reads_the_rest_from_its_peer(make_cluster, dataset, tmp_path):
    """After epoch 1, server 1's copy of the dataset shrinks to the files its cache holds (in its own mount
    namespace: a tmpfs over the dataset, each kept file bound back in place, its inode and times unchanged).
    Later epochs take everything else from server 0, never touching a file server 1 lacks."""
    root, crcs, sizes, _ = dataset
    out = str(tmp_path / "out")
    cluster = make_cluster(2)
    if not cluster.private:
        pytest.skip(f"hiding files from one server needs private mount namespaces ({cluster.why})")
    batches = -(-len(sizes) // 2 // 8)
    _run(cluster, root, out, epochs=3, cache_bytes=sum(sizes), nproc=1, wait=False,
         extra=["--pause", f"1:{batches}:1"])
    cached = _wait_paused(out, [1])[1]["cached"]
    files = sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names)
    kept = [os.path.relpath(files[i], root) for i in cached]
    assert 0 < len(kept) < len(files)
    side = str(tmp_path / "side")
    os.mkdir(side)
    binds = "".join(f"mkdir -p \"$(dirname {root}/{k})\"; touch {root}/{k}; mount --bind {side}/{k} {root}/{k}\n"
                    for k in kept)
    script = f"set -e\nmount --bind {root} {side}\nmount -t tmpfs hide {root}\n{binds}"
    assert cluster.exec(1, ["sh", "-c", script]).wait(60) == 0
    missing = files[next(i for i in range(len(files)) if i not in set(cached))]
    assert cluster.exec(1, ["test", "-e", missing]).wait(10) == 1  # gone, for server 1 only
    assert os.path.exists(missing)
    open(os.path.join(out, "go"), "w").close()
    results = _results(cluster, out, 1)
    _check_every_sample_once(results, crcs, 3)
    for epoch in (2, 3):
        stats = results[1]["stats"][epoch - 1]
        assert stats["storage_bytes"] == 0 and stats["peer_hits"] > 0 and stats["hits"] > 0


def test_a_dataset_in_an_object_store_is_got_once_and_later_epochs_come_from_the_servers_caches(
        make_cluster, source_root, tmp_path):
    """The dataset is a bucket of an S3 server on the cluster's bridge (``rclone serve s3``, reached by every
    server). Epoch 1 GETs each object once in all, every server its own ranks' shards; later epochs make no
    GET at all: what a server does not cache comes from the peer that does. Every sample exactly once an
    epoch, with its object's bytes."""
    pytest.importorskip("s3torchconnectorclient", reason="the object store needs the s3 extra (in the test extra)")
    shutil.copytree(source_root, tmp_path / "store" / "data" / "train")
    files = sorted(os.path.join(d, f) for d, _, names in os.walk(source_root) for f in names)
    raws = [open(path, "rb").read() for path in files]
    crcs, total = [zlib.crc32(raw) for raw in raws], sum(map(len, raws))
    cluster = make_cluster(2)
    _print_mode(cluster)
    with S3Server(str(tmp_path / "store"), host=cluster.hub_address, prefix=cluster.hub_prefix()) as store:
        results = _run(cluster, "s3://data/train", str(tmp_path / "out"), epochs=3, cache_bytes=total, nproc=2,
                       env=store.environ())
    _check_every_sample_once(results, crcs, 3)
    assert all(r["stats"][0]["object_store"] for r in results)
    gets = [_epoch_sum(results, epoch, "misses") + _epoch_sum(results, epoch, "ahead") for epoch in (1, 2, 3)]
    assert gets == [len(files), 0, 0] and _epoch_sum(results, 1, "storage_bytes") == total
    for epoch in (2, 3):
        assert _epoch_sum(results, epoch, "peer_hits") > 0
        assert _epoch_sum(results, epoch, "hits") + _epoch_sum(results, epoch, "peer_hits") == len(files)


def _wait_paused(out: str, ranks, timeout=120) -> dict:
    deadline = time.monotonic() + timeout
    paths = [os.path.join(out, f"paused-rank{r}") for r in ranks]
    while not all(os.path.exists(p) and os.path.getsize(p) for p in paths):
        assert time.monotonic() < deadline, "the ranks never paused"
        time.sleep(0.1)
    return {r: json.load(open(p)) for r, p in zip(ranks, paths)}


def test_a_peer_server_killed_mid_epoch_costs_storage_reads_not_samples_or_time(make_cluster, dataset, tmp_path):
    """Server 1's peer server is killed while its rank lives on. The race at the end forced: server 1's rank
    starts its last epoch 2 s late, so server 0 is through and closing first; its peer server must keep
    serving server 1's rank (whose own peer server no longer answers). A killed peer server's port refuses
    at once, so the relaxed timeout costs no time here, and a live peer slow to answer on a loaded machine
    is not taken for a dead one."""
    root, crcs, sizes, _ = dataset
    total = sum(sizes)
    out = str(tmp_path / "out")
    cluster = make_cluster(2)
    _run(cluster, root, out, epochs=3, cache_bytes=total, nproc=1, wait=False,
         extra=["--pause", "2:1", "--batch-size", "4", "--lag", "1:2"])
    paused = _wait_paused(out, [0, 1])
    assert paused[1]["server_pid"] in cluster.pids(1)
    os.kill(paused[1]["server_pid"], signal.SIGKILL)  # server 1's training rank lives on
    open(os.path.join(out, "go"), "w").close()
    results = _results(cluster, out, 1)
    _check_every_sample_once(results, crcs, 3)
    for epoch in (2, 3):
        assert max(r["epochs"][epoch - 1]["longest_wait_s"] for r in results) < 2.0
    node1_share = results[1]["cached_bytes"]
    for epoch in (2, 3):  # what server 1 would have served comes from storage, nothing more
        assert 0 < _epoch_sum(results, epoch, "storage_bytes") <= node1_share
    log = cluster.log(0)
    assert log.count("server 1 (") == 1 and "is down" in log  # said once, by the worker that found it
    assert results[1]["stats"][2]["peer_hits"] > 0  # server 1's rank still reads from server 0


def _unread_bytes(pid: int, port: int) -> int:
    """Bytes waiting unread in the established connections to ``port`` in ``pid``'s network namespace."""
    total = 0
    for table in ("tcp", "tcp6"):
        try:
            lines = open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]
        except OSError:
            continue
        for fields in (line.split() for line in lines):
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":  # ESTABLISHED
                total += int(fields[4].split(":")[1], 16)
    return total


def test_a_peer_server_killed_with_requests_in_flight_costs_storage_reads_not_samples(make_cluster, dataset, tmp_path):
    """Server 1's peer server is stopped (SIGSTOP) while the ranks are paused in epoch 2; they go on, and it is
    SIGKILLed once server 0's requests are in flight (sent on kept connections, unread in its sockets). The
    items they asked for come from storage: every sample once, with its file's bytes, no wait near the peer
    timeout, server 1 said down once."""
    root, crcs, sizes, _ = dataset
    out = str(tmp_path / "out")
    cluster = make_cluster(2)
    _run(cluster, root, out, epochs=3, cache_bytes=sum(sizes), nproc=1, wait=False,
         extra=["--pause", "2:1", "--batch-size", "4"])
    paused = _wait_paused(out, [0, 1])
    pid, port = paused[1]["server_pid"], paused[1]["address"][1]
    os.kill(pid, signal.SIGSTOP)
    open(os.path.join(out, "go"), "w").close()
    deadline = time.monotonic() + 60
    while not _unread_bytes(pid, port):
        assert time.monotonic() < deadline, "no request reached the stopped peer server:\n" + cluster.log(0)[-3000:]
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    results = _results(cluster, out, 1)
    _check_every_sample_once(results, crcs, 3)
    assert _epoch_sum(results[:1], 2, "storage_bytes") > 0  # what server 1 was asked for
    assert max(r["epochs"][1]["longest_wait_s"] for r in results) < RELAXED_PEER_TIMEOUT_S / 2
    log = cluster.log(0)
    assert log.count("server 1 (") == 1 and "is down" in log


@pytest.mark.parametrize("gone", ["killed", "cut off"])
def test_a_whole_server_gone_mid_epoch_leaves_the_others_every_sample_in_time(make_cluster, dataset, tmp_path, gone):
    """Server 1's every process SIGKILLed (its port refuses at once), or its network cut (nothing answers:
    the client's timeout decides)."""
    root, crcs, sizes, _ = dataset
    out = str(tmp_path / "out")
    cluster = make_cluster(2)
    if gone == "cut off" and cluster.mode != "netns":
        pytest.skip(f"cutting a server off needs network namespaces ({cluster.why})")
    _run(cluster, root, out, epochs=3, cache_bytes=sum(sizes), nproc=1, extra=["--pause", "2:1", "--batch-size", "4"],
         wait=False, peer_timeout_s=None)
    _wait_paused(out, [0, 1])
    if gone == "killed":
        cluster.kill(1)
    else:
        assert cluster.exec(1, ["ip", "link", "set", "eth0", "down"]).wait(10) == 0
    open(os.path.join(out, "go"), "w").close()
    survivor = _survivor(cluster, out, crcs, epochs=3)
    assert max(survivor["epochs"][e]["longest_wait_s"] for e in (1, 2)) < 2.0


def _survivor(cluster, out: str, crcs: list[int], epochs: int) -> dict:
    """Server 0's rank's results once written (torchrun's agent there would wait for a gone server 1 at its
    exit barrier), checked: every epoch its shard of the 2 ranks, each sample with its file's bytes."""
    path, deadline = os.path.join(out, "rank0.json"), time.monotonic() + 120
    while not os.path.exists(path):
        assert time.monotonic() < deadline, cluster.log(0)[-3000:]
        time.sleep(0.2)
    survivor = json.load(open(path))
    shard = _ShardOf(len(crcs))
    for epoch in range(1, epochs + 1):
        samples = survivor["epochs"][epoch - 1]["samples"]
        assert sorted(i for i, _ in samples) == sorted(shard(epoch, rank=0, world=2)), f"epoch {epoch}"
        assert all(crcs[i] == c for i, c in samples), f"epoch {epoch}: bytes that are not the file's"
    return survivor


_IMPOSTOR = r"""
import json, os, sys
from coordl._peer.server import PeerServer
host, port, n, secret = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].encode()
asked = []
def lookup(i):
    asked.append(i)
    return b"another job's item", None
server = PeerServer(lookup, n, secret, host, port, binding=os.urandom(16)).start()  # another job's loader
print("serving", flush=True)
sys.stdin.readline()
server.close()
print(json.dumps({"asked": len(asked)}), flush=True)
"""


def test_another_jobs_server_on_a_dead_servers_port_is_refused_and_nothing_of_it_is_used(make_cluster, dataset,
                                                                                          tmp_path):
    """Server 1 dies mid-epoch 2 and another job's peer server (the same secret, as a site-wide one would be, and
    a dataset of the same size) takes its address and port: server 0's rank marks it down, says why once, and
    reads server 1's items from storage; the impostor is never asked for an item."""
    root, crcs, sizes, _ = dataset
    out = str(tmp_path / "out")
    cluster = make_cluster(2)
    _run(cluster, root, out, epochs=3, cache_bytes=sum(sizes), nproc=1, wait=False,
         extra=["--pause", "2:1", "--batch-size", "4"], env={"COORDL_PEER_EXCHANGE_S": "5"})
    host, port = _wait_paused(out, [0, 1])[1]["address"]
    cluster.kill(1)
    impostor = cluster.exec(1, [sys.executable, "-c", _IMPOSTOR, host, str(port), str(len(crcs)), SECRET],
                            stdin=-1, stdout=-1, text=True)
    try:
        assert impostor.stdout.readline().strip() == "serving"
        open(os.path.join(out, "go"), "w").close()
        survivor = _survivor(cluster, out, crcs, epochs=3)
        impostor.stdin.write("stop\n")
        impostor.stdin.flush()
        assert json.loads(impostor.stdout.readline()) == {"asked": 0}
    finally:
        impostor.kill()
        impostor.wait()
    assert survivor["stats"][2]["peer_hits"] == 0  # epoch 3's map has no server 1
    log = cluster.log(0)
    assert log.count("server 1 (") == 1 and "serves another job or dataset" in log, log[-3000:]


def test_an_epoch_whose_maps_a_rank_misses_still_gives_it_every_sample(make_cluster, dataset, tmp_path):
    """Server 1 is up (its peer server answers) but starts epoch 2 past the exchange's limit, and server 0's local
    rank 0, which publishes server 0's map, starts it 2 s after local rank 1: rank 1 gets no map at all, so every
    item comes from storage, and it still gets its whole shard (once an empty epoch, torch ending it at a
    ``StopIteration``)."""
    root, crcs, sizes, _ = dataset
    out = str(tmp_path / "out")
    cluster = make_cluster(2)
    results = _run(cluster, root, out, epochs=2, cache_bytes=sum(sizes), nproc=2,
                   extra=["--lag", "1:8", "--lag", "0.0:2"], env={"COORDL_PEER_EXCHANGE_S": "4"})
    _check_every_sample_once(results, crcs, 2)
    shard = _ShardOf(len(crcs))
    for rank, result in enumerate(results):
        assert sorted(i for i, _ in result["epochs"][1]["samples"]) == sorted(shard(2, rank=rank, world=4))
    late = results[1]["stats"][1]  # server 0's local rank 1 in epoch 2: no map, nothing from peers
    assert late["peer_hits"] == 0 and late["storage_bytes"] > 0
    assert "did not report their cache" in cluster.log(0)


class _ShardOf:
    def __init__(self, n: int):
        self.data = list(range(n))

    def __call__(self, epoch: int, rank: int, world: int) -> list[int]:
        sampler = DistributedSampler(self.data, num_replicas=world, rank=rank, shuffle=True, seed=5)
        sampler.set_epoch(epoch)
        return list(sampler)


def test_a_server_that_stops_iterating_delays_one_epoch_start_by_the_exchange_limit_only(make_cluster, dataset,
                                                                                         tmp_path):
    """Server 1 iterates only epoch 1 (as a loader only some ranks run): server 0 waits for its map once, for
    COORDL_PEER_EXCHANGE_S, says so once, and reads server 1's items from storage from then on."""
    root, crcs, sizes, _ = dataset
    out = str(tmp_path / "out")
    cluster = make_cluster(2)
    os.makedirs(out)
    cluster.launch_all(JOB, ["--root", root, "--out", out, "--epochs", "4", "--cache-bytes", sum(sizes),
                             "--idle-after", "1:1"], env={"COORDL_LOG_LEVEL": "INFO", "COORDL_PEER_EXCHANGE_S": "3",
                                                          "COORDL_PEER_SECRET": SECRET})
    server0, server1 = _results(cluster, out, 1)
    shard = _ShardOf(len(crcs))
    for epoch in (1, 2, 3, 4):
        assert sorted(i for i, _ in server0["epochs"][epoch - 1]["samples"]) == sorted(shard(epoch, rank=0, world=2))
    waits = [e["longest_wait_s"] for e in server0["epochs"]]
    assert 2.5 < waits[1] < 10 and waits[2] < 2 and waits[3] < 2, waits
    assert server0["stats"][2]["peer_hits"] == 0 and server0["stats"][2]["storage_bytes"] > 0
    assert cluster.log(0).count("did not report their cache") == 1
    assert len(server1["epochs"]) == 1


def test_locality_aware_ranks_take_their_servers_samples_in_torchs_global_batches(make_cluster, dataset, tmp_path):
    root, crcs, sizes, _ = dataset
    cluster = make_cluster(2)
    b, world = 4, 4
    results = _run(cluster, root, str(tmp_path / "out"), epochs=3, cache_bytes=sum(sizes), nproc=2,
                   extra=["--locality", "--batch-size", str(b)])
    _check_every_sample_once(results, crcs, 3)
    shard = _ShardOf(len(crcs))
    for epoch in (1, 2, 3):
        torch_batches = [[shard(epoch, rank=r, world=world)[k:k + b] for k in range(0, len(crcs) // world, b)]
                         for r in range(world)]
        ours = [r["epochs"][epoch - 1]["batches"] for r in results]
        for k in range(len(torch_batches[0])):  # the same global batches: the same all-reduced gradients
            assert sorted(i for r in range(world) for i in ours[r][k]) == \
                sorted(i for r in range(world) for i in torch_batches[r][k])
            assert all(len(ours[r][k]) == b for r in range(world))
    for epoch in (2, 3):
        assert _epoch_sum(results, epoch, "storage_bytes") == 0
        moved, peer = _epoch_sum(results, epoch, "moved"), _epoch_sum(results, epoch, "peer_hits")
        assert peer == moved < 0.25 * len(crcs)  # what crosses the network is what balancing moved, not half
    assert len({r["owner_digest"] for r in results}) == 1


def test_locality_aware_without_a_partitioned_job_is_refused_clearly(image_root):
    import torchvision

    import coordl
    dataset = torchvision.datasets.ImageFolder(image_root)
    with pytest.raises(ValueError, match="locality_aware=True needs partitioned caching"):
        coordl.DataLoader(dataset, batch_size=4, sampler=DistributedSampler(dataset, num_replicas=2, rank=0),
                          locality_aware=True)


_CLIENT = r"""
import socket, sys, time, json
from coordl._peer import wire
host, port, secret, binding = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode(), bytes.fromhex(sys.argv[5])
result = {}
conn = socket.create_connection((host, port), timeout=5)
try:
    channel = wire.client_handshake(conn, secret, time.monotonic() + 5, binding=binding)
    ids = list(range(int(sys.argv[4])))
    wire.send_request(channel, ids)
    result["items"] = {i: __import__("zlib").crc32(d) for i, d, _ in wire.read_reply(channel, ids, time.monotonic() + 5)
                       if d is not None}
except (OSError, wire.PeerProtocolError) as e:
    result["refused"] = type(e).__name__
print(json.dumps(result))
"""


def test_a_client_from_another_server_without_the_secret_gets_nothing(make_cluster, dataset, tmp_path):
    root, crcs, sizes, _ = dataset
    out = str(tmp_path / "out")
    cluster = make_cluster(2)
    _run(cluster, root, out, epochs=2, cache_bytes=sum(sizes), nproc=1, extra=["--pause", "2:1"], wait=False)
    paused = _wait_paused(out, [0, 1])
    host, port = paused[0]["address"]
    if cluster.mode == "netns":
        assert host == cluster.addresses[0]  # bound to the interface torch.distributed uses, not 0.0.0.0
        with pytest.raises(OSError):  # and not on loopback
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
    answers = {}
    for secret in ("wrong", SECRET):
        client = cluster.exec(1, [sys.executable, "-c", _CLIENT, host, str(port), secret, str(len(crcs)),
                                  paused[0]["binding"]],
                              stdout=-1, text=True)
        answers[secret] = json.loads(client.communicate(timeout=60)[0])
    open(os.path.join(out, "go"), "w").close()
    _results(cluster, out, 1)
    assert "refused" in answers["wrong"] and "items" not in answers["wrong"]
    served = {int(i): c for i, c in answers[SECRET]["items"].items()}
    assert len(served) > 0 and all(crcs[i] == c for i, c in served.items())


_STORE_READER = r"""
import datetime, json, socket, sys, time
import torch.distributed as dist
from coordl._peer import wire
master, master_port, host, port, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
binding = bytes.fromhex(sys.argv[6])  # the loader's, which is no secret: only the secret is missing
store = dist.TCPStore(master, master_port, is_master=False, timeout=datetime.timedelta(seconds=10))
values = {store.get(key) for key in store.list_keys()}
result = {"keys": len(values), "refused": 0, "served": 0}
for secret in values:
    conn = socket.create_connection((host, port), timeout=5)
    try:
        channel = wire.client_handshake(conn, secret, time.monotonic() + 5, binding=binding)
        wire.send_request(channel, list(range(n)))
        result["served"] += sum(d is not None for _, d, _ in wire.read_reply(channel, list(range(n)),
                                                                            time.monotonic() + 5))
    except (OSError, wire.PeerProtocolError):
        result["refused"] += 1
    finally:
        conn.close()
print(json.dumps(result))
"""


def test_a_process_that_reads_every_key_of_the_store_gets_no_cached_byte(make_cluster, dataset, tmp_path):
    """No secret given: the ranks agree one over their process group, so a process outside the job that
    reads every key of torchrun's rendezvous store and tries each value as the secret is refused by the peer
    server, while the job's own ranks read through it."""
    root, crcs, sizes, _ = dataset
    out = str(tmp_path / "out")
    cluster = make_cluster(2)
    _run(cluster, root, out, epochs=2, cache_bytes=sum(sizes) // 2, nproc=1, secret=None,
         extra=["--pause", "2:1", "--group-first"], wait=False)
    paused = _wait_paused(out, [0, 1])[0]
    (host, port), binding = paused["address"], paused["binding"]
    reader = cluster.exec(1, [sys.executable, "-c", _STORE_READER, cluster.master_addr, str(cluster.master_port),
                              host, str(port), str(len(crcs)), binding], stdout=-1, stderr=-1, text=True)
    stdout, stderr = reader.communicate(timeout=120)
    open(os.path.join(out, "go"), "w").close()
    results = _results(cluster, out, 1)
    _check_every_sample_once(results, crcs, 2)
    seen = json.loads(stdout or "{}")
    assert seen and seen["keys"] > 0 and seen["refused"] == seen["keys"] and seen["served"] == 0, stderr
    assert _epoch_sum(results, 2, "peer_hits") > 0  # the secret the ranks agreed serves them


def test_the_dali_backend_reads_through_the_peers(make_cluster, source_root, tmp_path):
    pytest.importorskip("nvidia.dali")
    cluster = make_cluster(2)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(source_root) for f in fs)
    results = _run(cluster, source_root, str(tmp_path / "out"), epochs=2, cache_bytes=total, nproc=1,
                   extra=["--backend", "dali", "--workers", "2"])  # two fetch threads share the tier
    assert _epoch_sum(results, 2, "storage_bytes") == 0
    assert _epoch_sum(results, 2, "peer_hits") > 0
    assert _epoch_sum(results, 2, "hits") + _epoch_sum(results, 2, "peer_hits") == N_FILES

