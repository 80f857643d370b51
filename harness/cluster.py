"""Several simulated servers ("nodes") on this one machine, each launched by its own ``torchrun``.

In ``netns`` mode (root, ``ip``, ``nsenter`` and ``unshare``) a node is deployed as a server would be:

- its own network namespace, with ``lo`` and an ``eth0`` at 10.213.X.(i+1)/24 (X random per cluster),
  a veth whose other end is on a bridge in the cluster's own hub namespace. Nothing is added to the
  root namespace, and no route leads out of the cluster. The bridge itself is at 10.213.X.254
  (:attr:`Cluster.hub_address`): a service every node reaches, such as an object store
  (:meth:`Cluster.hub_prefix` runs a command there);
- its own mount and UTS namespaces: a fresh tmpfs on /dev/shm (so ``$COORDL_SHM_DIR``, the path the
  test suite gives every test, is private to the node), its own hostname (``cluster.names[i]``) and an
  /etc/hosts that resolves every node's name to its address;
- its own cgroup (v1 ``blkio``, and ``memory`` if bounded: what its processes hold plus a page-cache
  budget, followed as they grow, as ``harness.storage_env`` bounds one system's run), joined before
  the command starts, so that every process of the node is counted, bounded and killed with it. Nodes
  see this machine's /sys (so their own cgroup under /sys/fs/cgroup, but this machine's interfaces
  under /sys/class/net).

Where network namespaces cannot be made, the ``loopback`` mode stands in: node i is 127.0.0.(i+2),
with the private /dev/shm and hostname where ``unshare`` works, else ``$COORDL_SHM_DIR/node<i>`` as
its shm folder; cgroups where available. ``cluster.why`` says why it fell back.

Every process of a node carries ``CLUSTER_NODE=<its name>`` (and ``CLUSTER_NODE_ADDR=<its address>``)
in its environment: with cgroup membership, that is how :meth:`Cluster.pids` finds them.
"""

import atexit
import contextlib
import glob
import os
import random
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from coordl._core.settings import SHM_DIR_ENV
from harness.storage_env import (CGROUP_ROOT, Cgroup, MemoryFollower, _tool, cgroup_version, device_read_bytes,
                                    remove_cgroup_dir)

NODE_ENV = "CLUSTER_NODE"
ADDR_ENV = "CLUSTER_NODE_ADDR"
COUNT_ONLY_BPS = 10**10
"""A read throttle that never binds: cgroup v1 counts a device's bytes only where it carries a rule."""
PRIVATE = ["unshare", "--mount", "--uts", "--propagation", "private"]
KILL_TRIES_S = 10
HUB_HOST = 254
"""The bridge's host number in the cluster's subnet (its nodes' are 1, 2, ...)."""
LOG_TAIL_CHARS = 3000
_RNG = random.SystemRandom()  # whatever seed a test sets, two clusters draw their own subnet and port


def _private_namespaces() -> str | None:
    """Why a node cannot get its own mount and UTS namespaces here, or None if it can."""
    if shutil.which("unshare") is None:
        return "no unshare"
    probe = subprocess.run([*PRIVATE, "true"], capture_output=True, text=True)
    return f"unshare failed: {probe.stderr.strip()}" if probe.returncode else None


def _namespace(pid: int, kind: str) -> str:
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    return ""


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _pids_with_env(entry: bytes) -> set[int]:
    """Pids of the processes whose environment holds ``entry`` (``NAME=value``)."""
    found = set()
    for environ in glob.glob("/proc/[0-9]*/environ"):
        try:
            with open(environ, "rb") as f:
                if entry in f.read().split(b"\0"):
                    found.add(int(environ.split("/")[2]))
        except OSError:
            continue
    return found


class Cluster:
    """``nodes`` simulated servers (see the module), their files in ``workdir``: ``node<i>.log`` (the
    node's stdout and stderr) and ``node<i>.shm-left`` (what its command left in its shm folder).

    ``shm_bytes``: size of each node's /dev/shm. ``device`` (``MAJ:MIN``): a block device whose reads
    each node's cgroup counts (:meth:`device_read_bytes`) and, with ``read_bps``, throttles.
    ``page_cache_bytes`` (with ``device``): bound each node's memory (cgroup v1) to what its processes
    hold (RSS and its /dev/shm) plus this page cache, with ``shm_reserve_bytes`` of its /dev/shm (its
    cache) counted from the start; with ``measure_when``, node k is bounded and sampled only from the moment
    ``measure_when(k)`` is first true (its start-up unbounded: see ``MemoryFollower``); :attr:`memory` holds
    each node's figures once closed. ``isolation``:
    ``"netns"`` or ``"loopback"`` forces a mode (``"netns"`` raises where it cannot be made); ``"auto"``
    falls back to loopback. A context manager: leaving it (also on
    an exception) is :meth:`close`.

    Attributes: ``mode`` (``"netns"`` or ``"loopback"``), ``why`` (why the fallbacks, if any),
    ``names`` (each node's hostname and cgroup name), ``addresses``, ``hub_address`` (where a service every
    node reaches listens: the bridge's, or 127.0.0.1 in loopback mode), ``master_addr`` and
    ``master_port`` (node 0's, torchrun's static rendezvous), ``token`` (in every name made).

    Raises:
        OSError: ``device`` or ``page_cache_bytes`` given without cgroup v1 as root, or ``isolation="netns"``
            impossible here.
    """

    def __init__(self, nodes: int, workdir: str, *, shm_bytes: int = 512 * 2**20, device: str | None = None,
                 read_bps: int | None = None, page_cache_bytes: int | None = None, shm_reserve_bytes: int = 0,
                 measure_when: Callable[[int], bool] | None = None, isolation: str = "auto"):
        if isolation not in ("auto", "netns", "loopback"):
            raise ValueError(f"isolation must be auto, netns or loopback, not {isolation!r}")
        if (read_bps or page_cache_bytes is not None) and not device:
            raise ValueError("read_bps and page_cache_bytes bound reads from a device: give device")
        self.token = secrets.token_hex(3)
        self.names = [f"cdl{self.token}n{i}" for i in range(nodes)]
        self.hub = f"cdl{self.token}hub"
        self.workdir, self.shm_bytes, self.device, self.read_bps = workdir, shm_bytes, device, read_bps
        self.shm_dir = os.environ[SHM_DIR_ENV]
        self._procs: dict[int, subprocess.Popen] = {}
        self._execs: list[subprocess.Popen] = []
        self._logs = []
        self._netns: list[str] = []
        self._cgroup_dirs: list[list[str]] = [[] for _ in range(nodes)]
        self._followers: list[MemoryFollower] = []
        self.memory: list[dict] = []
        self._node_shm_dirs: list[str] = []
        self._closed = False
        os.makedirs(workdir, exist_ok=True)
        atexit.register(self.close)
        try:
            self._setup(nodes, isolation, page_cache_bytes, shm_reserve_bytes, measure_when)
        except BaseException:
            self.close()
            raise

    def _setup(self, nodes: int, isolation: str, page_cache_bytes: int | None, shm_reserve_bytes: int,
               measure_when: Callable[[int], bool] | None) -> None:
        why = ["requested"] if isolation != "auto" else []
        no_private = _private_namespaces() if os.geteuid() == 0 else "not root"
        self.mode, subnet = "loopback", f"10.213.{_RNG.randint(1, 250)}"
        if isolation != "loopback":
            try:
                if no_private:
                    raise OSError(no_private)
                missing = [tool for tool in ("ip", "nsenter") if shutil.which(tool) is None]
                if missing:
                    raise OSError(f"{', '.join(missing)} not found")
                self._make_netns(subnet)
                self.mode = "netns"
            except OSError as e:
                if isolation == "netns":
                    raise
                self._delete_netns()
                why.append(f"no network namespaces: {e}")
        self.addresses = [f"{subnet}.{i + 1}" if self.mode == "netns" else f"127.0.0.{i + 2}" for i in range(nodes)]
        self.hub_address = f"{subnet}.{HUB_HOST}" if self.mode == "netns" else "127.0.0.1"
        self.private = no_private is None
        if not self.private:
            why.append(f"no private /dev/shm or hostname ({no_private}): node i's shm folder is {SHM_DIR_ENV}/node<i>")
            for i in range(nodes):
                self._node_shm_dirs.append(os.path.join(self.shm_dir, f"node{i}"))
                os.mkdir(self._node_shm_dirs[-1])
        with open(os.path.join(self.workdir, "hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n::1 localhost\n")
            f.writelines(f"{addr} {name}\n" for addr, name in zip(self.addresses, self.names))
        if not self._make_cgroups(page_cache_bytes, shm_reserve_bytes, measure_when):
            why.append("no cgroups (not root, or not cgroup v1)")
        self.why = "; ".join(why)
        self.master_addr = self.addresses[0]
        self.master_port = self._free_port()

    def _make_netns(self, subnet: str) -> None:
        """The hub namespace with its bridge, and each node's namespace wired to it."""
        for ns in (self.hub, *self.names):
            _tool("ip", "netns", "add", ns)
            self._netns.append(ns)
            _tool("ip", "-n", ns, "link", "set", "lo", "up")
        _tool("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _tool("ip", "-n", self.hub, "addr", "add", f"{subnet}.{HUB_HOST}/24", "dev", "br0")
        _tool("ip", "-n", self.hub, "link", "set", "br0", "up")
        for i, ns in enumerate(self.names):
            _tool("ip", "-n", self.hub, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _tool("ip", "-n", self.hub, "link", "set", f"v{i}", "master", "br0", "up")
            _tool("ip", "-n", ns, "addr", "add", f"{subnet}.{i + 1}/24", "dev", "eth0")
            _tool("ip", "-n", ns, "link", "set", "eth0", "up")

    def _make_cgroups(self, page_cache_bytes: int | None, shm_reserve_bytes: int,
                      measure_when: Callable[[int], bool] | None) -> bool:
        """Each node's cgroups; False where they cannot be made."""
        if os.geteuid() != 0 or cgroup_version() != 1:
            if self.device or page_cache_bytes is not None:
                raise OSError("device counting and memory bounds need root and cgroup v1 (blkio, memory)")
            return False
        for i, name in enumerate(self.names):
            if page_cache_bytes is not None:  # memory and blkio, bounded as they grow
                group = Cgroup(name, 1, self.device, self.read_bps or COUNT_ONLY_BPS, page_cache_bytes,
                               shm_reserve_bytes=shm_reserve_bytes)
                self._cgroup_dirs[i] += group.dirs
                when = (lambda node=i: measure_when(node)) if measure_when else None
                self._followers.append(MemoryFollower(group, measure_when=when).start())
                continue
            blkio = os.path.join(CGROUP_ROOT, "blkio", name)
            os.mkdir(blkio)
            self._cgroup_dirs[i].append(blkio)
            if self.device:
                with open(os.path.join(blkio, "blkio.throttle.read_bps_device"), "w") as f:
                    f.write(f"{self.device} {self.read_bps or COUNT_ONLY_BPS}\n")
        return True

    def _free_port(self) -> int:
        """A port below the ephemeral range (where gloo's connections take theirs) that node 0 may bind."""
        while True:
            port = _RNG.randrange(20000, 32768)
            if self.mode == "netns":  # a fresh namespace: nothing is bound there
                return port
            with socket.socket() as s, contextlib.suppress(OSError):
                s.bind((self.master_addr, port))
                return port

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _env(self, node: int, env: dict | None) -> dict:
        defaults = {} if self.private else {"GLOO_SOCKET_IFNAME": "lo"}  # the hostname may not resolve to lo
        shm_dir = self._node_shm_dirs[node] if self._node_shm_dirs else self.shm_dir
        return {**os.environ, **defaults, SHM_DIR_ENV: shm_dir, **(env or {}),
                NODE_ENV: self.names[node], ADDR_ENV: self.addresses[node]}

    def _wrap(self, node: int, script: str, namespaces: list[str]) -> list[str]:
        """``argv`` prefix running the ``sh`` ``script`` (its arguments follow) in ``namespaces`` (an
        ``nsenter`` or ``unshare`` prefix), joined to ``node``'s cgroups first."""
        join = "".join(f"echo $$ > {shlex.quote(d)}/cgroup.procs\n" for d in self._cgroup_dirs[node])
        return [*namespaces, "sh", "-c", f"set -e\n{join}{script}", "sh"]

    def hub_prefix(self) -> list[str]:
        """Prefix running a command where it listens on :attr:`hub_address` (the hub namespace; nothing in
        loopback mode). It is not a node's: stop what it starts yourself."""
        return ["nsenter", f"--net=/run/netns/{self.hub}"] if self.mode == "netns" else []

    def _network(self, node: int) -> list[str]:
        """Prefix entering ``node``'s network namespace (``nsenter``, not ``ip netns exec``: that remounts
        /sys, hiding the node's cgroups from it)."""
        return ["nsenter", f"--net=/run/netns/{self.names[node]}"] if self.mode == "netns" else []

    def launch(self, node: int, script: str, args=(), *, nproc: int = 1, env: dict | None = None,
               prefix=()) -> None:
        """Start ``torchrun`` (static rendezvous at node 0's address) running ``script args`` with ``nproc``
        processes on ``node``; ``env`` is added to this process's environment; ``prefix`` runs torchrun's
        command line (``coordl analyze ... --``)."""
        if node in self._procs:
            raise RuntimeError(f"node {node} was launched already")
        setup = ""
        if self.private:
            setup = (f"hostname {self.names[node]}\n"
                     f"mount --bind {shlex.quote(os.path.join(self.workdir, 'hosts'))} /etc/hosts\n"
                     f"mount -t tmpfs -o size={self.shm_bytes},mode=1777 cdl-shm /dev/shm\n")
        left = shlex.quote(os.path.join(self.workdir, f"node{node}.shm-left"))
        script_sh = (f'{setup}mkdir -p "${SHM_DIR_ENV}"\nset +e\n"$@"\nstatus=$?\n'
                     f'ls -A "${SHM_DIR_ENV}" > {left}\nexit $status\n')
        torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(self.names)}",
                    f"--node-rank={node}", f"--nproc-per-node={nproc}", f"--master-addr={self.master_addr}",
                    f"--master-port={self.master_port}", script, *map(str, args)]
        log = open(os.path.join(self.workdir, f"node{node}.log"), "wb")
        self._logs.append(log)
        namespaces = [*self._network(node), *(PRIVATE if self.private else [])]
        self._procs[node] = subprocess.Popen([*self._wrap(node, script_sh, namespaces), *prefix, *torchrun],
                                             stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                             env=self._env(node, env), start_new_session=True)

    def launch_all(self, script: str, args=(), *, nproc: int = 1, env: dict | None = None) -> None:
        """:meth:`launch` on every node."""
        for node in range(len(self.names)):
            self.launch(node, script, args, nproc=nproc, env=env)

    def exec(self, node: int, argv: list[str], **popen_kwargs) -> subprocess.Popen:
        """Start ``argv`` on ``node``, as a login on that server would: in its cgroups, with its environment
        (plus ``popen_kwargs["env"]``), in its network namespace, and while its launched command runs in
        its mount and UTS namespaces too (its /dev/shm, hostname and /etc/hosts); this machine's otherwise.
        Killed by :meth:`close` like the node's command."""
        env = self._env(node, popen_kwargs.pop("env", None))
        launched = self._procs.get(node)
        if self.private and launched and launched.poll() is None:
            deadline = time.monotonic() + KILL_TRIES_S
            while _namespace(launched.pid, "uts") == _namespace(os.getpid(), "uts") and time.monotonic() < deadline:
                time.sleep(0.01)  # it has not reached its own namespaces yet
            namespaces = ["nsenter", f"--target={launched.pid}", "--net", "--mount", "--uts"]
        else:
            namespaces = self._network(node)
        proc = subprocess.Popen([*self._wrap(node, 'exec "$@"', namespaces), *argv], env=env, **popen_kwargs)
        self._execs.append(proc)
        return proc

    def wait(self, timeout: float, nodes=None) -> list[int]:
        """Exit codes of the launched commands on ``nodes`` (all launched ones by default), in order
        (negative: killed by that signal).

        Raises:
            TimeoutError: one is still running after ``timeout`` s; every node's processes are then
                killed, and the message holds the tail of each node's log.
        """
        deadline = time.monotonic() + timeout
        nodes = sorted(self._procs) if nodes is None else nodes
        try:
            return [self._procs[node].wait(max(0.0, deadline - time.monotonic())) for node in nodes]
        except subprocess.TimeoutExpired:
            self._kill_everything()
            tails = "\n".join(f"--- node {n} ---\n{self.log(n)[-LOG_TAIL_CHARS:]}" for n in sorted(self._procs))
            raise TimeoutError(f"cluster nodes {nodes} still running after {timeout} s; killed\n{tails}") from None

    def pids(self, node: int) -> list[int]:
        """The live processes of ``node``: its cgroup's, and any carrying its name in their environment."""
        found = _pids_with_env(f"{NODE_ENV}={self.names[node]}".encode())
        for d in self._cgroup_dirs[node]:
            with contextlib.suppress(FileNotFoundError), open(os.path.join(d, "cgroup.procs")) as f:
                found.update(int(p) for p in f.read().split())
        return sorted(found)

    def kill(self, node: int, match: str | None = None, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to ``node``'s processes whose command line contains ``match`` (all if None); with
        SIGKILL, again until none is left (children they forked meanwhile) and every one signalled is gone
        (a killed process stays in its cgroup while it exits). Returns the pids signalled."""
        signalled = []
        deadline = time.monotonic() + KILL_TRIES_S
        while time.monotonic() < deadline:
            live = self.pids(node)
            targets = [p for p in live if p not in signalled and (match is None or match in _cmdline(p))]
            for pid in targets:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
                signalled.append(pid)
            if sig != signal.SIGKILL or not targets and not set(signalled) & set(live):
                break
            time.sleep(0.05)
        return signalled

    def _kill_everything(self) -> None:
        """SIGKILL every node's processes until none is left, and reap the ones started here."""
        deadline = time.monotonic() + KILL_TRIES_S
        while any(self.pids(n) for n in range(len(self.names))) and time.monotonic() < deadline:
            for node in range(len(self.names)):
                self.kill(node)
        for proc in [*self._procs.values(), *self._execs]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(KILL_TRIES_S)

    def log(self, node: int) -> str:
        """What ``node``'s command wrote so far (stdout and stderr)."""
        with open(os.path.join(self.workdir, f"node{node}.log"), errors="replace") as f:
            return f.read()

    def shm_left(self, node: int) -> list[str]:
        """What ``node``'s command left in its shm folder when it ended.

        Raises:
            FileNotFoundError: nothing was recorded (the node was killed, or is still running).
        """
        with open(os.path.join(self.workdir, f"node{node}.shm-left")) as f:
            return f.read().split()

    def device_read_bytes(self, node: int) -> int:
        """Bytes ``node``'s processes read from ``device`` (``MAJ:MIN``, given at construction)."""
        if not self.device:
            raise ValueError("no device given to the cluster")
        blkio = next(d for d in self._cgroup_dirs[node] if f"{os.sep}blkio{os.sep}" in d)
        return device_read_bytes({"kind": "cgroup1", "device": self.device,
                                  "file": os.path.join(blkio, "blkio.throttle.io_service_bytes")})

    def _delete_netns(self) -> list[str]:
        """Delete the namespaces made; what ``ip`` said where it failed."""
        failed = [subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True) for ns in self._netns]
        self._netns = []
        return [p.stderr.strip() for p in failed if p.returncode]

    def close(self) -> None:
        """Kill every process of every node (lifting the read throttle first: a throttled read holds its
        process), then delete the namespaces, the cgroups and the nodes' shm folders (those left empty: a
        leak stays for the test suite's check to report). Idempotent.

        Raises:
            OSError: a namespace or cgroup could not be removed.
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self.memory = [follower.stop() for follower in self._followers]  # lifts the bounds too
        for d in [d for dirs in self._cgroup_dirs for d in dirs if self.read_bps and "/blkio/" in d]:
            with contextlib.suppress(OSError), open(os.path.join(d, "blkio.throttle.read_bps_device"), "w") as f:
                f.write(f"{self.device} 0\n")
        self._kill_everything()
        for log in self._logs:
            log.close()
        left = self._delete_netns()
        for d in [d for dirs in self._cgroup_dirs for d in dirs]:
            remove_cgroup_dir(d)
            if os.path.exists(d):
                left.append(f"cgroup {d} still there")
        for d in self._node_shm_dirs:
            with contextlib.suppress(OSError):
                os.rmdir(d)
        if left:
            raise OSError(f"cluster {self.token} not fully removed: {'; '.join(left)}")


@pytest.fixture
def make_cluster(tmp_path):
    """``make_cluster(nodes, **kwargs)``: a :class:`Cluster` with its files in ``tmp_path``, closed at the
    test's teardown. Import it into a test module to use it."""
    clusters = []

    def make(nodes: int, **kwargs) -> Cluster:
        clusters.append(Cluster(nodes, str(tmp_path / f"cluster{len(clusters)}"), **kwargs))
        return clusters[-1]

    yield make
    for cluster in clusters:
        cluster.close()
