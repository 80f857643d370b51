"""The simulated-cluster fixture (harness/cluster.py): nodes that each have their own address, /dev/shm,
hostname and cgroup, run one torchrun job together, and leave nothing behind."""

import contextlib
import glob
import json
import os
import subprocess
import threading
import time

import pytest

from harness.cluster import make_cluster  # noqa: F401 (a fixture)
from harness.storage_env import SLACK_BYTES, Cleanup, copy_to_loop_disk, evict_files

JOB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_cluster_job.py")
WORKER = f"-u {JOB}"
"""In a torchrun worker's command line (not in torchrun's, nor in that of the sh running it)."""
RUN_S = 120

pytestmark = pytest.mark.slow


def netns_cluster(make_cluster, nodes: int, **kwargs):
    """A cluster in netns mode, or a skip saying why there is none."""
    cluster = make_cluster(nodes, **kwargs)
    if cluster.mode != "netns":
        pytest.skip(f"no network namespaces here: {cluster.why}")
    return cluster


def run_allreduce(cluster, out, nproc: int) -> list[dict]:
    """Run the all_reduce job with ``nproc`` ranks a node, check what every node can and cannot share, and
    return what each rank saw (``rank<r>.json`` in ``out``)."""
    os.mkdir(out)
    cluster.launch_all(JOB, ["allreduce", out], nproc=nproc)
    assert cluster.wait(RUN_S) == [0] * len(cluster.names), [cluster.log(n)[-3000:] for n in range(len(cluster.names))]
    ranks = [json.loads(open(path).read()) for path in sorted(glob.glob(os.path.join(out, "rank*.json")))]
    world = len(cluster.names) * nproc
    assert [r["rank"] for r in ranks] == list(range(world))
    for r in ranks:
        assert r["sum"] == world * (world - 1) // 2
        assert r["node"] == r["rank"] // nproc
        own = {f"rank{q}" for q in range(r["node"] * nproc, (r["node"] + 1) * nproc)}
        assert set(r["shm_dir"]) == own, "a node sees another node's shared memory"
    return ranks


def workers(cluster, node: int) -> list[int]:
    """``node``'s torchrun workers."""
    found = []
    for pid in cluster.pids(node):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if WORKER in f.read().replace(b"\0", b" ").decode():
                found.append(pid)
    return found


def wait_for_workers(cluster, nodes) -> None:
    """Until each of ``nodes`` runs its torchrun workers (fails with the nodes' logs after ``RUN_S``)."""
    deadline = time.monotonic() + RUN_S
    while not all(workers(cluster, node) for node in nodes):
        assert time.monotonic() < deadline, [cluster.log(n) for n in nodes]
        time.sleep(0.2)


def assert_nothing_left(cluster) -> None:
    """No namespace, cgroup or process of ``cluster`` is left."""
    if cluster.mode == "netns":
        assert cluster.token not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not glob.glob(f"/sys/fs/cgroup/*/cdl{cluster.token}*")
    assert not any(cluster.pids(n) for n in range(len(cluster.names)))


def test_nodes_have_their_own_address_shm_and_hostname(make_cluster, tmp_path):
    cluster = netns_cluster(make_cluster, 2)
    ranks = run_allreduce(cluster, str(tmp_path / "out"), nproc=2)
    shm_folder = os.path.basename(os.environ["COORDL_SHM_DIR"])
    for r in ranks:
        assert r["address"] == cluster.addresses[r["node"]]
        assert r["hostname"] == cluster.names[r["node"]]
        assert r["dev_shm"] == [shm_folder]  # a fresh tmpfs holding only the test's shm folder
    assert len(set(cluster.addresses)) == 2
    assert cluster.shm_left(0) == cluster.shm_left(1) == []
    cluster.close()
    assert_nothing_left(cluster)


def test_exec_logs_into_a_node_and_kill_takes_it_down(make_cluster):
    cluster = netns_cluster(make_cluster, 2)
    cluster.launch_all(JOB, ["sleep", "300"])
    wait_for_workers(cluster, (0, 1))
    shell = "hostname; hostname -i; grep blkio /proc/self/cgroup; df --output=source /dev/shm"
    login = cluster.exec(1, ["sh", "-c", shell], stdout=subprocess.PIPE, text=True)
    hostname, address, cgroup, _, shm = login.communicate(timeout=RUN_S)[0].split()
    assert (hostname, address, shm) == (cluster.names[1], cluster.addresses[1], "cdl-shm")  # the node's own
    assert cgroup.endswith(f"/{cluster.names[1]}")
    worker = workers(cluster, 0)
    assert cluster.kill(0, match=WORKER) == worker  # not torchrun, nor the sh running it ...
    assert cluster.wait(RUN_S, nodes=[0]) == [1]  # ... which report the worker's death
    assert cluster.kill(1)
    assert cluster.pids(1) == []
    assert cluster.wait(10, nodes=[1]) == [-9]
    cluster.close()
    assert_nothing_left(cluster)


def test_kill_returns_once_the_killed_processes_are_gone(make_cluster, monkeypatch):
    """A killed process stays in its node while it exits: with every signal landing 0.5 s after it is sent,
    :meth:`Cluster.kill` still returns only once none of the node's processes is left."""
    cluster = make_cluster(1)
    cluster.launch(0, JOB, ["sleep", "300"])
    wait_for_workers(cluster, (0,))
    send = os.kill

    def send_late(pid: int, sig: int) -> None:
        def deliver():
            with contextlib.suppress(ProcessLookupError):
                send(pid, sig)
        threading.Timer(0.5, deliver).start()

    monkeypatch.setattr(os, "kill", send_late)
    assert cluster.kill(0)
    assert cluster.pids(0) == []
    monkeypatch.undo()
    cluster.close()
    assert_nothing_left(cluster)


def test_a_failing_job_returns_its_exit_code_and_traceback(make_cluster):
    cluster = make_cluster(1)
    cluster.launch(0, JOB, ["fail"])
    assert cluster.wait(RUN_S) == [1]
    log = cluster.log(0)
    assert "Traceback" in log and "RuntimeError: the job failed on purpose" in log


def test_loopback_mode_runs_the_same_job(make_cluster, tmp_path):
    cluster = make_cluster(2, isolation="loopback")
    print(f"loopback: {cluster.why}")
    assert cluster.mode == "loopback" and cluster.addresses == ["127.0.0.2", "127.0.0.3"]
    run_allreduce(cluster, str(tmp_path / "out"), nproc=1)
    cluster.close()
    assert_nothing_left(cluster)


def test_device_reads_are_counted_per_node(make_cluster, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "blob").write_bytes(os.urandom(4 * 2**20))
    with Cleanup() as cleanup:
        try:
            disk = copy_to_loop_disk(cleanup, str(tmp_path), str(data))
        except OSError as e:
            pytest.skip(f"no loop device: {e}")
        try:
            cluster = make_cluster(2, device=disk.device)
        except OSError as e:
            pytest.skip(str(e))
        evict_files(disk.root)
        reader = cluster.exec(0, ["cat", os.path.join(disk.root, "blob")], stdout=subprocess.DEVNULL)
        assert reader.wait(RUN_S) == 0
        assert cluster.device_read_bytes(0) >= 4 * 2**20
        assert cluster.device_read_bytes(1) == 0
        cluster.close()  # before the disk is unmounted
    assert_nothing_left(cluster)


BLOB_BYTES = 32 * 2**20
BUDGET_BYTES = 8 * 2**20


def read_a_blob_twice(make_cluster, tmp_path, then: str = ":", **bounds) -> tuple[int, dict, object]:
    """A node bounded to :data:`BUDGET_BYTES` of page cache (``bounds``: the rest of its bounds) reads a
    :data:`BLOB_BYTES` file on a loop disk twice, then runs the shell's ``then``: the device bytes it read,
    its memory figures and the closed cluster. Skips where there is no loop device or memory cgroup."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "blob").write_bytes(os.urandom(BLOB_BYTES))
    with Cleanup() as cleanup:
        try:
            disk = copy_to_loop_disk(cleanup, str(tmp_path), str(data))
            cluster = make_cluster(1, device=disk.device, page_cache_bytes=BUDGET_BYTES, **bounds)
        except OSError as e:
            pytest.skip(f"no loop device or memory cgroup: {e}")
        evict_files(disk.root)
        blob = os.path.join(disk.root, "blob")
        reader = cluster.exec(0, ["sh", "-c", f"cat {blob} > /dev/null; cat {blob} > /dev/null; {then}"])
        assert reader.wait(RUN_S) == 0
        read = cluster.device_read_bytes(0)
        cluster.close()  # before the disk is unmounted
    return read, cluster.memory[0], cluster


def test_a_nodes_page_cache_is_held_to_its_budget(make_cluster, tmp_path):
    """A node bounded to 8 MiB of page cache reads a 32 MiB file twice at 20 MB/s: the kernel cannot keep
    it, so the second pass reads the device again; the page cache is squeezed back to its budget and slack
    whenever it outgrows them (by a read-ahead window between two looks)."""
    read, memory, cluster = read_a_blob_twice(make_cluster, tmp_path, read_bps=20 * 10**6)
    assert read >= 1.8 * BLOB_BYTES, read
    assert memory["samples"] > 0 and memory["p50_page_cache_bytes"] <= BUDGET_BYTES + SLACK_BYTES + 2**20, memory
    assert memory["peak_page_cache_bytes"] < 0.75 * BLOB_BYTES, memory
    assert_nothing_left(cluster)


def test_a_node_measured_from_a_moment_is_unbounded_and_unsampled_until_then(make_cluster, tmp_path):
    """With ``measure_when``, a node reads a 32 MiB file twice unbounded (the second pass from its page cache),
    then says it has started: from then on its page cache is squeezed back to the 8 MiB budget, and only that
    is sampled."""
    started = tmp_path / "started"
    read, memory, cluster = read_a_blob_twice(make_cluster, tmp_path, f"touch {started}; sleep 1",
                                              read_bps=40 * 10**6, measure_when=lambda node: started.exists())
    assert BLOB_BYTES <= read < 1.2 * BLOB_BYTES  # the second pass found the whole file in the unbounded page cache
    assert memory["samples"] > 0 and memory["peak_page_cache_bytes"] <= BUDGET_BYTES + SLACK_BYTES, memory
    assert_nothing_left(cluster)
