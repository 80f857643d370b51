"""The storage environment of a benchmark run: throttled disk, bounded memory, cold page cache, cleanup.

In ``cgroup`` mode the dataset gets a disk of its own: a copy on an ext4 filesystem on a loop device
(:class:`LoopDisk`), so that throttling and counting that device touches the dataset's reads and
nothing else (libraries and Python stay on the real disk, read at full speed). Where no loop device
can be made, the dataset's whole disk is throttled instead. Every system runs in its own memory +
I/O cgroup (v1: ``memory`` and ``blkio`` hierarchies; v2: one group with ``memory.max`` and
``io.max``): reads from the dataset's device are throttled to the set bandwidth and counted by the
kernel, and page cache + shared memory + RSS are bounded. In ``emulated`` mode (no root, no
cgroups, or the dataset on a virtual filesystem) an :mod:`~coordl._demo.emulated_store` plays the disk
and the page cache.

Everything created here (cgroups, loop devices with their mounts and images, process groups, the
work folder, coordl caches named by the run) is registered with :class:`Cleanup` and removed on
exit, failure, Ctrl-C or SIGTERM.
"""

import collections
import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable

from coordl.analyzer.process_group import remove_torch_segments, stop_group, watch

CGROUP_ROOT = "/sys/fs/cgroup"
PREFIX = "coordl-bench"
HEADROOM_BYTES = 48 * 2**20
"""The room a group has beyond what it holds and its page-cache budget, for allocations between two
updates of its bound: shared memory cannot wait for reclaim (under cgroup v1 a system call that
finds the group full fails with ENOMEM: torch's workers allocate each batch's shared memory so,
and DALI takes a batch's buffers, ~20 MiB at batch 32, faster than the bound follows). The page
cache is kept out of it (see :meth:`Cgroup.bound`)."""
SLACK_BYTES = 4 * 2**20
"""How far above its budget a group's page cache may get before it is squeezed back: the file
pages of libraries and output a run touches besides the dataset, and what is read between two
updates."""
FOLLOW_INTERVAL_S = 0.02
FOLLOW_MIN_INTERVAL_S = 0.005
FOLLOW_READ_BYTES = 2**20
"""A :class:`MemoryFollower` updates its group's bound every :data:`FOLLOW_INTERVAL_S`, or more often where
the throttle lets more than :data:`FOLLOW_READ_BYTES` through in that time (down to
:data:`FOLLOW_MIN_INTERVAL_S`): at 200 MB/s DALI's reader got up to 6 MiB past its budget and slack
between two updates 20 ms apart."""
FOLLOW_WINDOW_S = 0.1
"""The bound follows the most held in this last stretch, so that a batch's memory freed and taken
again is not handed to the page cache and back (a longer window lets the page cache read into the
room a freed batch leaves, up to the bandwidth times the window)."""
BUDGET_TOLERANCE = 0.05
BUDGET_TOLERANCE_MIN_BYTES = 3 * 2**20
"""A run's page cache may exceed its budget plus :data:`SLACK_BYTES` by this fraction of the budget, or
by :data:`BUDGET_TOLERANCE_MIN_BYTES` if that is more, at its 99th percentile (the throttle lets reads
through in bursts, and a squeeze comes up to one :func:`follow_interval_s` after them); beyond, the run is
over budget."""
LOOP_TOOLS = ("losetup", "mkfs.ext4", "mount", "umount")
FS_BLOCK = 4096
UNMOUNT_TRIES_S = 10
DRAIN_S = 30
"""How long a killed child's pipes may stay open before its output is taken as it is."""


def _write(path: str, value) -> None:
    with open(path, "w") as f:
        f.write(f"{value}\n")


def cgroup_version() -> int | None:
    """1 or 2 if this process may create the cgroups a run needs, else None."""
    if os.geteuid() != 0:
        return None
    if all(os.path.isdir(os.path.join(CGROUP_ROOT, c)) for c in ("memory", "blkio")):
        return 1
    controllers = os.path.join(CGROUP_ROOT, "cgroup.controllers")
    if os.path.exists(controllers):
        with open(controllers) as f:
            if {"memory", "io"} <= set(f.read().split()):
                return 2
    return None


def block_device(path: str) -> str | None:
    """``MAJ:MIN`` of the whole disk holding ``path``, or None on a virtual filesystem (tmpfs, overlay)."""
    dev = os.stat(path).st_dev
    if os.major(dev) == 0:
        return None
    sys_dir = os.path.realpath(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if os.path.exists(os.path.join(sys_dir, "partition")):  # throttle rules name whole disks
        sys_dir = os.path.dirname(sys_dir)
    try:
        with open(os.path.join(sys_dir, "dev")) as f:
            return f.read().strip()
    except OSError:
        return None


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _tool(*cmd: str) -> str:
    """Run a system tool; its stdout.

    Raises:
        OSError: it failed (the command and what it said).
    """
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise OSError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout.strip()


@dataclasses.dataclass
class LoopDisk:
    """A copy of a dataset on an ext4 filesystem of its own: an image file attached to a loop device
    with direct I/O (so the image's page cache neither serves the device's reads nor holds the
    dataset twice), mounted at ``mount_point``; the copy is at ``root``."""

    image: str
    loop: str
    device: str
    """``MAJ:MIN`` of the loop device."""
    mount_point: str
    root: str


def _image_size(source: str) -> tuple[int, int]:
    """(bytes, inodes) of an ext4 image with room for the tree at ``source``: its files in whole
    blocks, a block per entry for ext4's own structures, and a fixed reserve."""
    data = entries = 0
    for folder, dirs, files in os.walk(source):
        entries += len(dirs) + len(files)
        data += sum(-(-os.path.getsize(os.path.join(folder, f)) // FS_BLOCK) * FS_BLOCK for f in files)
    return int(1.1 * data) + entries * FS_BLOCK + 64 * 2**20, entries + 1024


def _unmount(mount_point: str) -> None:
    """Unmount, waiting for the last users (killed children) to let go; then detach it lazily."""
    deadline = time.monotonic() + UNMOUNT_TRIES_S
    while True:
        try:
            _tool("umount", mount_point)
            return
        except OSError:
            if time.monotonic() > deadline:
                _tool("umount", "--lazy", mount_point)
                return
            time.sleep(0.2)


def copy_to_loop_disk(cleanup: "Cleanup", folder: str, source: str) -> LoopDisk:
    """Copy the tree at ``source`` onto a new :class:`LoopDisk` in ``folder`` (image ``dataset.img``,
    mounted at ``disk/``), sized for it. Each piece is registered with ``cleanup`` as it is made; if a step
    fails, the pieces made so far are removed before the error propagates.

    Raises:
        OSError: a step failed, or a tool is missing (what, and why).
    """
    with contextlib.ExitStack() as made:
        disk = _loop_disk(made, folder, *_image_size(source))
        disk.root = shutil.copytree(source, os.path.join(disk.mount_point, os.path.basename(os.path.normpath(source))))
        cleanup.enter_context(made.pop_all())
    return disk


def loop_disk(cleanup: "Cleanup", folder: str, size: int, inodes: int = 1024) -> LoopDisk:
    """An empty :class:`LoopDisk` of ``size`` bytes and ``inodes`` inodes in ``folder`` (its ``root`` is its
    mount point), registered with ``cleanup`` as :func:`copy_to_loop_disk` does."""
    with contextlib.ExitStack() as made:
        disk = _loop_disk(made, folder, size, inodes)
        cleanup.enter_context(made.pop_all())
    return disk


def _loop_disk(made: contextlib.ExitStack, folder: str, size: int, inodes: int) -> LoopDisk:
    missing = [tool for tool in LOOP_TOOLS if shutil.which(tool) is None]
    if missing:
        raise OSError(f"{', '.join(missing)} not found (install util-linux and e2fsprogs)")
    image, mount_point = os.path.join(folder, "dataset.img"), os.path.join(folder, "disk")
    with open(image, "wb") as f:
        f.truncate(size)  # sparse: the disk holds only what is written
    made.callback(os.remove, image)
    _tool("mkfs.ext4", "-q", "-F", "-b", str(FS_BLOCK), "-m", "0", "-N", str(inodes), "-O", "^has_journal",
          "-E", "lazy_itable_init=0,nodiscard", image)
    loop = _tool("losetup", "--find", "--show", "--direct-io=on", image)
    made.callback(_tool, "losetup", "--detach", loop)
    sys_dir = f"/sys/block/{os.path.basename(loop)}"
    if _read(f"{sys_dir}/loop/dio") != "1":
        raise OSError(f"{loop}: direct I/O refused over {image} (its page cache would hold the dataset a "
                      "second time); put --workdir on a filesystem that supports O_DIRECT")
    os.mkdir(mount_point)
    made.callback(os.rmdir, mount_point)
    _tool("mount", "-o", "noatime", loop, mount_point)
    made.callback(_unmount, mount_point)
    return LoopDisk(image, loop, _read(f"{sys_dir}/dev"), mount_point, mount_point)


@dataclasses.dataclass
class Storage:
    """Where a run's dataset lives and how its reads are throttled and counted."""

    mode: str
    """``"cgroup"`` or ``"emulated"``."""
    dataset_on: str
    """``"loop device"``, ``"whole disk"`` or ``"emulated store"``."""
    root: str
    """The dataset the systems read."""
    detail: str
    """What was set up, and why not something better."""
    cgroup_version: int | None = None
    device: str | None = None
    """``MAJ:MIN`` throttled and counted (cgroup mode)."""


def prepare_storage(requested: str, source: str, cleanup: "Cleanup", folder: str) -> Storage:
    """The storage for ``requested`` in {"auto", "cgroup", "emulated"} and the dataset at ``source``:
    in cgroup mode a copy on a :class:`LoopDisk` in ``folder``, else (no loop device) ``source`` on
    its whole disk; emulated mode where cgroups are unavailable. Says in ``detail`` why it fell back.

    Raises:
        SystemExit: ``cgroup`` was requested and is not possible here.
    """
    if requested == "emulated":
        return Storage("emulated", "emulated store", source, "requested")
    version = cgroup_version()
    if not version:
        return _emulated(requested, source, "needs root and cgroup v1 (memory, blkio) or v2 (memory, io)")
    try:
        disk = copy_to_loop_disk(cleanup, folder, source)
    except OSError as e:
        no_loop = f"no loop device for the dataset: {e}"
    else:
        return Storage("cgroup", "loop device", disk.root,
                       f"cgroup v{version}; the dataset copied onto its own loop device {disk.device} ({disk.loop}, "
                       f"ext4 over {disk.image}, direct I/O): only its reads are throttled and counted",
                       version, disk.device)
    device = block_device(source)
    if device is None:
        return _emulated(requested, source, f"{no_loop}; and {source} is not on a block device")
    return Storage("cgroup", "whole disk", source,
                   f"cgroup v{version}; FALLBACK, {no_loop}; throttling and counting the dataset's whole disk "
                   f"{device} instead, so whatever else is read from it (libraries, Python) is too", version, device)


def _emulated(requested: str, source: str, why: str) -> Storage:
    """Emulated mode for the dataset at ``source``, as the fallback (``why``) from ``requested``."""
    if requested == "cgroup":
        raise SystemExit(f"cgroup mode unavailable: {why}")
    return Storage("emulated", "emulated store", source, f"FALLBACK, cgroup mode unavailable: {why}")


def tree_bytes(root: str) -> int:
    """Bytes of the files under ``root``."""
    return sum(os.path.getsize(os.path.join(folder, name)) for folder, _, names in os.walk(root) for name in names)


def evict_files(root: str) -> None:
    """Drop every file under ``root`` from the OS page cache (the part of ``drop_caches`` that matters,
    without evicting the libraries every system would then re-read)."""
    os.sync()  # dirty pages are not evicted
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def warm_files(root: str) -> None:
    """Read every file under ``root`` into the page cache (reads charged to the calling process's group)."""
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                while f.read(1 << 20):
                    pass


class Cgroup:
    """The memory + I/O cgroup(s) of one system's run.

    Reads from ``device`` (``MAJ:MIN``, the dataset's device) are throttled to ``read_bps`` and, if
    given, ``read_iops`` read requests per second (what makes random reads of small files cost what
    they cost on a disk with a seek or a flash page per request). Memory is
    bounded to what the processes hold (all but the page cache) plus ``page_cache_bytes`` and a
    headroom (``headroom_bytes``: :data:`HEADROOM_BYTES`, or more where a run allocates in bigger
    bursts), and the page cache is held to ``page_cache_bytes`` whatever the loader's own
    footprint (``page_cache_bytes=None``: memory is not bounded); :meth:`bound` moves the limit as
    holdings change. ``shm_reserve_bytes`` (coordl's cache) is counted as shared memory
    from the start, so that the cache can be allocated. The kernel does not kill for memory in the
    group (v1: ``oom_control``; v2: ``memory.high`` throttles): a process that outgrows the limit
    waits for the next :meth:`bound`.
    """

    def __init__(self, name: str, version: int, device: str, read_bps: int, page_cache_bytes: int | None,
                 shm_reserve_bytes: int = 0, read_iops: int | None = None, headroom_bytes: int = HEADROOM_BYTES):
        self.version, self.device, self.read_bps, self.read_iops = version, device, read_bps, read_iops
        self.page_cache_bytes, self.shm_reserve_bytes = page_cache_bytes, shm_reserve_bytes
        self.headroom_bytes = headroom_bytes
        if version == 1:
            self.dirs = [os.path.join(CGROUP_ROOT, "memory", name), os.path.join(CGROUP_ROOT, "blkio", name)]
        else:
            _write(os.path.join(CGROUP_ROOT, "cgroup.subtree_control"), "+memory +io")
            self.dirs = [os.path.join(CGROUP_ROOT, name)]
        for d in self.dirs:
            os.makedirs(d)
        memory_dir, io_dir = self.dirs[0], self.dirs[-1]
        if version == 1:
            _write(os.path.join(memory_dir, "memory.oom_control"), 1)
            _write(os.path.join(io_dir, "blkio.throttle.read_bps_device"), f"{device} {read_bps}")
            if read_iops:
                _write(os.path.join(io_dir, "blkio.throttle.read_iops_device"), f"{device} {read_iops}")
        else:
            if os.path.exists(os.path.join(memory_dir, "memory.swap.max")):
                _write(os.path.join(memory_dir, "memory.swap.max"), 0)
            _write(os.path.join(io_dir, "io.max"), f"{device} rbps={read_bps}" + (f" riops={read_iops}" if read_iops else ""))
        self.bound(0, 0)

    def counter(self) -> dict:
        """How a process reads this group's device bytes: see :func:`device_read_bytes`."""
        if self.version == 1:
            return {"kind": "cgroup1", "file": os.path.join(self.dirs[1], "blkio.throttle.io_service_bytes"),
                    "device": self.device}
        return {"kind": "cgroup2", "file": os.path.join(self.dirs[0], "io.stat"), "device": self.device}

    def join(self) -> None:
        """Move the calling process into the group(s) (its children are born there)."""
        for d in self.dirs:
            _write(os.path.join(d, "cgroup.procs"), os.getpid())

    def memory(self) -> tuple[int, int, int]:
        """(held, shared, page cache) bytes charged to the group. The page cache is the kernel's file
        LRU lists (``total_inactive_file + total_active_file``, v2 ``file``): the dataset's pages,
        mapped or not, and never shared memory (tmpfs pages live on the anonymous lists). Held is
        everything else: anonymous and shared memory, and the kernel's own (page tables, slab, sockets)."""
        memory_dir = self.dirs[0]
        with open(os.path.join(memory_dir, "memory.stat")) as f:
            stat = dict(line.split() for line in f)
        usage_file = "memory.usage_in_bytes" if self.version == 1 else "memory.current"
        with open(os.path.join(memory_dir, usage_file)) as f:
            usage = int(f.read())
        if self.version == 1:
            shmem, page_cache = int(stat["total_shmem"]), int(stat["total_inactive_file"]) + int(stat["total_active_file"])
        else:
            shmem, page_cache = int(stat["shmem"]), int(stat["file"]) - int(stat["shmem"])
        return max(0, usage - page_cache), shmem, page_cache

    def limit_hits(self) -> int:
        """How often the group's memory use reached its limit (v1 ``memory.failcnt``; v2 the ``high``
        events of ``memory.events``)."""
        memory_dir = self.dirs[0]
        if self.version == 1:
            return int(_read(os.path.join(memory_dir, "memory.failcnt")))
        events = dict(line.split() for line in _read(os.path.join(memory_dir, "memory.events")).splitlines())
        return int(events.get("high", 0)) + int(events.get("max", 0))

    def bound(self, held: int, shmem: int, page_cache: int = 0, held_now: int | None = None,
              slack: int = SLACK_BYTES) -> None:
        """Set the memory limit for ``held`` (the recent peak of what is held): that, the part of the
        shared-memory reserve not yet taken, the page-cache budget and the headroom (``headroom_bytes``,
        default :data:`HEADROOM_BYTES`) for allocations between two updates. A ``page_cache`` above its
        budget plus ``slack`` (default :data:`SLACK_BYTES`) is first squeezed back to that: the limit is lowered
        for a moment to what is held now (``held_now``) plus that, and the kernel reclaims the tail of its
        own LRU lists. So the page cache never keeps the headroom, or the part of the reserve not yet
        taken, which it would otherwise fill."""
        name = "memory.limit_in_bytes" if self.version == 1 else "memory.high"
        budget = self.page_cache_bytes
        if budget is None:  # not bounded
            held, budget = 10**15, 0
        reserve = max(0, self.shm_reserve_bytes - shmem)
        try:
            fd = os.open(os.path.join(self.dirs[0], name), os.O_WRONLY)
        except FileNotFoundError:  # the group is gone
            return
        try:  # the squeeze and the bound back to back: the group is squeezed for as short a time as can be
            if self.page_cache_bytes is not None and page_cache > budget + slack:
                squeeze = (held if held_now is None else held_now) + budget + slack  # the reserve too
                with contextlib.suppress(OSError):  # EBUSY: could not reclaim down to it yet; the next call will
                    os.write(fd, f"{squeeze}\n".encode())
            with contextlib.suppress(OSError):
                os.write(fd, f"{held + reserve + budget + self.headroom_bytes}\n".encode())
        finally:
            os.close(fd)

    def lift(self) -> None:
        """Lift the memory bound and the throttle, so that tasks waiting on either run on (and can die)."""
        self.bound(10**15, 0)
        v1 = self.version == 1
        with contextlib.suppress(OSError):  # the group is gone
            _write(os.path.join(self.dirs[-1], "blkio.throttle.read_bps_device" if v1 else "io.max"),
                   f"{self.device} 0" if v1 else f"{self.device} rbps=max riops=max")
            if v1 and self.read_iops:
                _write(os.path.join(self.dirs[-1], "blkio.throttle.read_iops_device"), f"{self.device} 0")

    def remove(self) -> None:
        """Kill what is left in the group, then remove it."""
        for d in self.dirs:  # waking tasks that wait for memory or the throttle lets them die
            remove_cgroup_dir(d, wake=self.lift)


def remove_cgroup_dir(path: str, wake=None) -> None:
    """SIGKILL every process left in cgroup folder ``path`` (calling ``wake()`` if there were any), then
    remove it; retries while its tasks exit, for up to 5 s."""
    killed = set()
    for _ in range(100):
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = [int(p) for p in f.read().split()]
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed.update(pids)
            if pids and wake is not None:
                wake()
            os.rmdir(path)
            break
        except FileNotFoundError:
            break
        except OSError:  # tasks still exiting
            time.sleep(0.05)
    remove_torch_segments(killed)


def device_read_bytes(counter: dict) -> int:
    """Bytes read so far from the device a counter names: :meth:`Cgroup.counter`, the emulated store's
    ``{"kind": "emulated", "socket": path}``, or ``{"kind": "none"}`` (always 0)."""
    if counter["kind"] == "none":
        return 0
    if counter["kind"] == "emulated":
        from coordl._demo.emulated_store import StoreClient

        return StoreClient(counter["socket"]).device_read_bytes()
    with open(counter["file"]) as f:
        lines = [line.split() for line in f]
    if counter["kind"] == "cgroup1":
        return sum(int(w[2]) for w in lines if len(w) == 3 and w[0] == counter["device"] and w[1] == "Read")
    for w in lines:
        if w and w[0] == counter["device"]:
            return int(dict(kv.split("=") for kv in w[1:]).get("rbytes", 0))
    return 0


class Cleanup(contextlib.ExitStack):
    """Undo everything a run created, in reverse order, also on Ctrl-C and SIGTERM.

    ``with Cleanup() as cleanup: cleanup.callback(...)``; SIGTERM is turned into KeyboardInterrupt
    while it is active so that the same path runs.
    """

    def __enter__(self) -> "Cleanup":
        super().__enter__()
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        self.callback(signal.signal, signal.SIGTERM, previous)
        return self

    def workdir(self, parent: str) -> str:
        """A fresh folder under ``parent``, removed at the end."""
        path = tempfile.mkdtemp(prefix=f"{PREFIX}-", dir=parent)
        self.callback(shutil.rmtree, path, ignore_errors=True)
        return path

    def cgroup(self, *args, **kwargs) -> Cgroup:
        """A :class:`Cgroup`, removed at the end."""
        group = Cgroup(*args, **kwargs)
        self.callback(group.remove)
        return group

    def shm_folder(self) -> str:
        """A fresh folder under the shm directory made ``$COORDL_SHM_DIR`` until the end, for servers whose
        own /dev/shm holds it at that path (``harness/cluster.py``); removed, and the variable restored, then."""
        from coordl._core.shm import SHM_DIR_ENV, shm_dir
        path = tempfile.mkdtemp(prefix=f"{PREFIX}-", dir=shm_dir())
        self.callback(shutil.rmtree, path, ignore_errors=True)
        previous = os.environ.get(SHM_DIR_ENV)
        os.environ[SHM_DIR_ENV] = path
        self.callback(_restore_env, SHM_DIR_ENV, previous)
        return path


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@dataclasses.dataclass
class ChildResult:
    """How a child ended: ``timed_out`` if it was killed at its time limit (``returncode`` is then
    the kill's); ``memory``: its group's figures (bytes): peak and mean held, mean and peak page
    cache (empty without a cgroup)."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    memory: dict


def follow_interval_s(read_bps: int | None) -> float:
    """How often a :class:`MemoryFollower` updates a group whose reads are throttled to ``read_bps``
    (see :data:`FOLLOW_INTERVAL_S`)."""
    if not read_bps:
        return FOLLOW_INTERVAL_S
    return min(FOLLOW_INTERVAL_S, max(FOLLOW_MIN_INTERVAL_S, FOLLOW_READ_BYTES / read_bps))


class MemoryFollower:
    """While started, every :func:`follow_interval_s` (20 ms where reads are throttled to 52 MB/s or less):
    moves ``cgroup``'s memory bound to what its processes hold (the most in the last
    :data:`FOLLOW_WINDOW_S`) and samples its page cache (see :func:`memory_summary`).

    With ``measure_now=False``, or with ``measure_when``, the group is not bounded, and not sampled, until
    :meth:`measure`, or until ``measure_when()`` first returns true: its processes start up (import their
    libraries, build their loaders) at full speed, and the bound and its limit hits cover only what is measured.
    The first measured tick bounds the group without sampling it, squeezing its page cache back to the
    budget with no slack: what start-up left there is not counted as the run's."""

    def __init__(self, cgroup: "Cgroup", measure_now: bool = True, measure_when: Callable[[], bool] | None = None):
        self.cgroup, self.samples, self.limit_hits = cgroup, [], None
        self._measure_when = measure_when
        self._done, self._measuring = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._interval_s = follow_interval_s(cgroup.read_bps)
        self._started, self._hits_before = time.monotonic(), 0
        if measure_now and measure_when is None:
            self._measuring.set()

    def _follow(self) -> None:
        with contextlib.suppress(OSError):  # not preempted between a squeeze and the bound after it
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))  # (this thread only)
        recent = collections.deque()  # (time, held)
        bounded = False
        while not self._done.wait(self._interval_s):
            with contextlib.suppress(OSError):
                held, shmem, page_cache = self.cgroup.memory()
                if not self._measuring.is_set() and self._measure_when is not None and self._measure_when():
                    self.measure()
                if not self._measuring.is_set():
                    self.cgroup.bound(10**15, shmem)
                    continue
                now = time.monotonic()
                recent.append((now, held))
                while recent[0][0] < now - FOLLOW_WINDOW_S:
                    recent.popleft()
                self.cgroup.bound(max(h for _, h in recent), shmem, page_cache, held,
                                  SLACK_BYTES if bounded else 0)
                if bounded:
                    self.samples.append((now - self._started, held, page_cache, shmem))
                bounded = True

    def start(self) -> "MemoryFollower":
        self._started = time.monotonic()
        self._thread.start()
        return self

    def measure(self) -> None:
        """Bound and sample the group from now on (see the class)."""
        self._hits_before = _quiet(self.cgroup.limit_hits) or 0
        self._started = time.monotonic()
        self._measuring.set()

    def stop(self) -> dict:
        """Stop following, lift the group's bounds (so that tasks waiting on them can die) and return
        the :func:`memory_summary` ({} without samples)."""
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
        hits = _quiet(self.cgroup.limit_hits)
        self.limit_hits = None if hits is None else hits - self._hits_before
        self.cgroup.lift()
        return memory_summary(self.samples, self.limit_hits) if self.samples else {}


def run_child(cmd: list[str], timeout_s: float, cgroup: Cgroup | None = None,
              measure_when: Callable[[], bool] | None = None) -> ChildResult:
    """Run ``cmd`` in its own process group, inside ``cgroup`` from its first instruction, for at most
    ``timeout_s``, its memory followed by a :class:`MemoryFollower` (from the start, or from the moment
    ``measure_when()`` is true). The whole process group is killed when this returns, early or not (timeout,
    Ctrl-C, error), and the group's bounds lifted."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=cgroup.join if cgroup else None)
    follower = MemoryFollower(cgroup, measure_when=measure_when).start() if cgroup else None
    timed_out, memory, seen = False, {}, set()
    try:
        out, err = watch(proc, seen, timeout_s, wait=proc.communicate)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        stop_group(proc, seen, grace_s=0)  # the child's workers, if it left any, and torch's segments they left
        if follower:
            memory = follower.stop()
    if timed_out:
        out, err = _drain(proc)
    proc.wait()
    return ChildResult(proc.returncode, out, err, timed_out, memory)


SERIES_STEP_S = 0.5


def _percentile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def memory_summary(samples: list[tuple[float, int, int, int]], limit_hits: int | None) -> dict:
    """What a group held and its page cache, from ``(seconds, held, page cache, shared memory)`` samples:
    peak and mean held; the page cache's mean, median, 95th and 99th percentile and maximum; the page
    cache every :data:`SERIES_STEP_S` (``page_cache_series``: ``[seconds, bytes]``); shared memory's
    peak; and ``limit_hits``."""
    _, held, cache, shared = zip(*samples)
    series, next_t = [], 0.0
    for t, _, c, _ in samples:
        if t >= next_t:
            series.append([round(t, 2), c])
            next_t = t + SERIES_STEP_S
    return {"peak_held_bytes": max(held), "mean_held_bytes": int(sum(held) / len(held)),
            "mean_page_cache_bytes": int(sum(cache) / len(cache)), "p50_page_cache_bytes": _percentile(cache, 0.5),
            "p95_page_cache_bytes": _percentile(cache, 0.95), "p99_page_cache_bytes": _percentile(cache, 0.99),
            "peak_page_cache_bytes": max(cache), "peak_shmem_bytes": max(shared), "samples": len(cache),
            "limit_hits": limit_hits, "page_cache_series": series}


def over_budget(memory: dict, page_cache_budget: int) -> str | None:
    """Why a run's page cache broke its budget (its 99th percentile above the budget plus
    :data:`SLACK_BYTES` by more than the tolerance, :data:`BUDGET_TOLERANCE`), or None. A group with no
    page-cache budget is held to :data:`SLACK_BYTES` and the tolerance (coordl drops the pages it reads)."""
    if not memory:
        return None
    tolerance = max(int(BUDGET_TOLERANCE * page_cache_budget), BUDGET_TOLERANCE_MIN_BYTES)
    allowed = page_cache_budget + SLACK_BYTES + tolerance
    p99 = memory["p99_page_cache_bytes"]
    if p99 <= allowed:
        return None
    return (f"page cache over budget: 99th percentile {p99 / 2**20:.1f} MiB > {allowed / 2**20:.1f} MiB allowed "
            f"(budget {page_cache_budget / 2**20:.1f} MiB + {SLACK_BYTES / 2**20:.0f} MiB slack + "
            f"{tolerance / 2**20:.1f} MiB tolerance); peak {memory['peak_page_cache_bytes'] / 2**20:.1f} MiB")


def _quiet(read) -> int | None:
    try:
        return read()
    except (OSError, ValueError):
        return None


def _drain(proc: subprocess.Popen) -> tuple[str, str]:
    """(stdout, stderr) of a killed child: all of it once its processes are gone, what came within
    :data:`DRAIN_S` if one of them keeps the pipes open."""
    try:
        return proc.communicate(timeout=DRAIN_S)
    except subprocess.TimeoutExpired as e:  # its partial output comes as bytes
        out, err = ((b or b"").decode(errors="replace") for b in (e.stdout, e.stderr))
        return out, err + f"\n[output cut: pipes still open {DRAIN_S} s after SIGKILL]"
