"""Which keys of a disk cache some process on the node is reading from storage into it, so that the others wait
for its write instead of reading them too.

NOTE [ Reads in flight ]
Jobs that fill one disk cache at once (a sweep's, say) would each read every item the cache does not hold yet.
So a process about to read a key from storage for the disk cache first takes a kernel lock on one byte of the
cache's ``reading.lock``, at an offset given by the key's digest (``F_OFD_SETLK``: an open file description's
lock, which dies with its holder); its writer releases the byte once the item's group is committed (or at once,
where the item will not be written). A process that finds the byte locked waits for it to be free (polling, at
most ``WAIT_S``), then looks in the disk cache again and reads storage only if the item is not there (its reader
died, or the memory cache took it instead). Threads of one process share its descriptor, whose locks do not
exclude each other, so the process also keeps the keys it has claimed. A forked child closes the descriptor it
inherited, so it never holds its parent's locks (nor keeps them past the parent's death); the loader's close
closes its own once its writes are done (``DiskTier.release``).
"""

import errno
import os
import threading
import time
import weakref

from coordl._core.shm import held_in, try_lock, unlock_range
from coordl._disk import format as fmt

READING = "reading.lock"
WAIT_S = 30.0
"""Longest wait for another process's read and write of a key before reading it here too (its reader is
alive but stuck)."""
_OFFSETS = (1 << 62) - 1
_open_claims: "weakref.WeakSet[ReadClaims]" = weakref.WeakSet()


def _offset(key: str) -> int:
    return fmt.key_digest(key) & _OFFSETS


class ReadClaims:
    """This process's claims on keys of the disk cache in ``folder`` (see NOTE [ Reads in flight ])."""

    def __init__(self, folder: str):
        self.folder = folder
        self._fd, self._pid = -1, None
        self._claimed: set[str] = set()
        self._lock = threading.Lock()
        _open_claims.add(self)

    def __getstate__(self) -> dict:
        return {"folder": self.folder}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["folder"])

    def _descriptor(self) -> int:
        if self._pid != os.getpid():
            self._fd = os.open(os.path.join(self.folder, READING), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self._pid = os.getpid()
        return self._fd

    def claim(self, key: str) -> bool:
        """Take ``key`` for this process to read; False if another process (or thread here) reads it now."""
        with self._lock:
            if key in self._claimed:
                return False
            if not try_lock(self._descriptor(), _offset(key)):
                return False
            self._claimed.add(key)
            return True

    def release(self, key: str) -> None:
        """Give ``key`` up: its item is written, or will not be."""
        with self._lock:
            if key in self._claimed and self._pid == os.getpid():
                self._claimed.discard(key)
                try:
                    unlock_range(self._fd, _offset(key))
                except OSError as e:
                    if e.errno != errno.EBADF:
                        raise

    def wait(self, key: str, timeout_s: float = WAIT_S) -> bool:
        """Wait while another process or thread has ``key`` claimed; whether it let go within ``timeout_s``."""
        deadline, delay, offset = time.monotonic() + timeout_s, 0.0005, _offset(key)
        while True:
            with self._lock:
                free = key not in self._claimed and held_in(self._descriptor(), offset, 1) is None
            if free:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def close(self) -> None:
        with self._lock:
            if self._pid == os.getpid() and self._fd >= 0:
                os.close(self._fd)
            self._fd, self._pid = -1, None
            self._claimed.clear()


def _drop_inherited() -> None:
    """In a forked child: close the descriptors inherited with their locks (the parent's, not this process's)."""
    for claims in list(_open_claims):
        if claims._fd >= 0:
            try:
                os.close(claims._fd)
            except OSError:
                pass
        claims._fd, claims._pid, claims._claimed, claims._lock = -1, None, set(), threading.Lock()


os.register_at_fork(after_in_child=_drop_inherited)
