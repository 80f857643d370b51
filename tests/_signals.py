"""Event, queue and barrier between test processes, made of files in a test's folder.

multiprocessing's spawn-context Event, Queue and Barrier are named semaphores in /dev/shm that only
their creator or its resource tracker unlinks; a test run killed with its whole process tree (a CI
timeout, ``timeout -s KILL``) would leave them behind. Files in ``tmp_path`` leave nothing outside it.
All three are picklable (they are a path) and poll every few milliseconds.
"""

import os
import pickle
import queue
import tempfile
import time

_POLL_S = 0.005


def _until(ready, timeout: float | None) -> bool:
    deadline = None if timeout is None else time.monotonic() + timeout
    while not ready():
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)
    return True


class FileEvent:
    """Like ``multiprocessing.Event``: ``set()``, ``is_set()``, ``wait(timeout)``."""

    def __init__(self, folder):
        self.path = os.path.join(tempfile.mkdtemp(prefix="event-", dir=folder), "set")

    def set(self) -> None:
        open(self.path, "w").close()

    def is_set(self) -> bool:
        return os.path.exists(self.path)

    def wait(self, timeout: float | None = None) -> bool:
        return _until(self.is_set, timeout)


class FileQueue:
    """Like ``multiprocessing.Queue`` for picklable objects: ``put(obj)``, ``get(timeout)`` (oldest first)."""

    def __init__(self, folder):
        self.folder = tempfile.mkdtemp(prefix="queue-", dir=folder)

    def put(self, obj) -> None:
        name = f"{time.time_ns():020d}-{os.getpid()}"
        tmp = os.path.join(self.folder, f".{name}")
        with open(tmp, "wb") as f:
            pickle.dump(obj, f)
        os.rename(tmp, os.path.join(self.folder, name))  # whole, or not there at all

    def get(self, timeout: float | None = None):
        """The oldest object put; raises ``queue.Empty`` after ``timeout`` seconds without one."""
        if not _until(lambda: any(not n.startswith(".") for n in os.listdir(self.folder)), timeout):
            raise queue.Empty
        oldest = os.path.join(self.folder, min(n for n in os.listdir(self.folder) if not n.startswith(".")))
        with open(oldest, "rb") as f:
            obj = pickle.load(f)
        os.unlink(oldest)
        return obj


class FileBarrier:
    """Like ``multiprocessing.Barrier(parties)``, reusable: the k-th ``wait()`` of each process returns
    once every party has made its k-th call. Each process must hold its own copy (as spawn gives it)."""

    def __init__(self, folder, parties: int):
        self.folder, self.parties, self._calls = tempfile.mkdtemp(prefix="barrier-", dir=folder), parties, 0

    def wait(self, timeout: float | None = None) -> None:
        self._calls += 1
        prefix = f"{self._calls}-"
        open(os.path.join(self.folder, f"{prefix}{os.getpid()}"), "w").close()
        arrived = lambda: sum(n.startswith(prefix) for n in os.listdir(self.folder)) >= self.parties  # noqa: E731
        if not _until(arrived, timeout):
            raise TimeoutError(f"barrier: {self.parties} parties expected at call {self._calls}")
