"""Facts about this machine: available memory, bounded by this process's cgroup; a process's state, CPU
time and descendants."""

import glob
import os


def proc_stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` from the third (the state) on: the name before them may hold spaces.
    Raises ``OSError`` for a process that is gone (or in another PID namespace)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """CPU seconds process ``pid`` has run (user and system, ``/proc/<pid>/stat``). Raises ``OSError`` for a
    process that is gone."""
    fields = proc_stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> set[int]:
    """The processes ``pid`` has started, and theirs, now (``/proc/<pid>/task/<tid>/children``; none where the
    kernel does not have it)."""
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for path in glob.glob(f"/proc/{parent}/task/*/children"):
            try:
                with open(path) as f:
                    children = {int(c) for c in f.read().split()} - found
            except OSError:  # ended meanwhile
                continue
            found |= children
            todo.extend(children)
    return found


def _cgroup_memory_headroom() -> int | None:
    """Bytes left under this process's cgroup memory limit (v1 or v2), None if it has no limit."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            limit_file, usage_file = f"/sys/fs/cgroup{path}/memory.max", f"/sys/fs/cgroup{path}/memory.current"
        elif "memory" in controllers.split(","):
            base = f"/sys/fs/cgroup/memory{path}"
            limit_file, usage_file = f"{base}/memory.limit_in_bytes", f"{base}/memory.usage_in_bytes"
        else:
            continue
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except OSError:
            continue
        if limit != "max" and int(limit) < 2**60:
            return max(0, int(limit) - usage)
    return None


def available_memory_bytes() -> int:
    """Memory the kernel can give without swapping: MemAvailable, bounded by this cgroup's limit."""
    available = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    headroom = _cgroup_memory_headroom()
    return available if headroom is None else min(available, headroom)
