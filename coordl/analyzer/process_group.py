"""A child's process group: what it started, stopping it, and the segments torch left in ``/dev/shm`` for its
processes.

torch names a tensor's shared memory ``torch_<pid>_...`` and unlinks it once mapped, so a process ended between
the two (a DataLoader worker stopped as it collated a batch) leaves its segment behind for good. Whoever stops a
group removes those of the processes it started and that have ended; a pid in use again is another process's
now, and so are its segments.
"""

import contextlib
import glob
import os
import signal
import subprocess
import time

from coordl._core.sysinfo import descendants, proc_stat

TORCH_SHM = "/dev/shm"
"""Where torch's ``shm_open`` puts the segments that carry tensors between processes."""
KILL_WAIT_S = 5.0
"""How long :func:`stop_group` waits for a group it sent SIGKILL to end."""
WATCH_S = 0.2
"""How often a watcher notes the processes a child has started (see :func:`watch`)."""


def ended(pid: int) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie not reaped yet)."""
    try:
        return proc_stat(pid)[0] == "Z"
    except OSError:
        return True


def members(group: int) -> set[int]:
    """The processes of process group ``group`` now (``/proc/<pid>/stat``)."""
    pids = set()
    for stat in glob.glob("/proc/[0-9]*/stat"):
        pid = int(stat.split("/")[2])
        try:
            if int(proc_stat(pid)[2]) == group:
                pids.add(pid)
        except OSError:  # gone meanwhile
            continue
    return pids


def watch(proc: subprocess.Popen, seen: set[int], timeout_s: float, wait=None):
    """``wait(timeout)`` on ``proc`` (default ``proc.wait``) for at most ``timeout_s``, noting in ``seen`` every
    :data:`WATCH_S` the processes it has started (a worker ended before the group is stopped is no member
    then). Returns what ``wait`` returned; raises ``subprocess.TimeoutExpired`` past ``timeout_s``."""
    wait = wait or proc.wait
    deadline = time.monotonic() + timeout_s
    while True:
        seen |= descendants(proc.pid)
        left = deadline - time.monotonic()
        try:
            return wait(timeout=max(min(WATCH_S, left), 0))
        except subprocess.TimeoutExpired:
            if left <= WATCH_S:
                raise


def stop_group(proc: subprocess.Popen, seen: set[int] = frozenset(), grace_s: float = 5.0) -> None:
    """End the process group ``proc`` leads (started with ``start_new_session=True``): SIGTERM and ``grace_s``
    to end (none: 0), then SIGKILL and up to :data:`KILL_WAIT_S`; then remove the segments torch left for a
    process that ended as it made one: one of the group, or one of ``seen`` (processes ``proc`` started, some
    ended before)."""
    stopped = {proc.pid} | set(seen)
    for sig, wait_s in [(signal.SIGTERM, grace_s)] * (grace_s > 0) + [(signal.SIGKILL, KILL_WAIT_S)]:
        stopped |= members(proc.pid)
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader, else its zombie keeps the group alive
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
    if proc.poll() is None:
        proc.wait()
    remove_torch_segments(stopped)


def remove_torch_segments(pids) -> None:
    """Remove the segments torch left for those of ``pids`` that have ended."""
    for pid in (p for p in pids if ended(p)):
        for path in glob.glob(os.path.join(TORCH_SHM, f"torch_{pid}_*")):
            with contextlib.suppress(OSError):
                os.remove(path)
