"""Named shared-memory segments: files in /dev/shm, mapped shared, guarded by an flock.

The only module that creates, maps, locks or unlinks shared memory. A segment is one file:
its bytes are the shared memory and its flock is the cross-process mutex, so there is no
separate lock file to leak, and the kernel releases the lock of a process that dies holding it.
"""

import contextlib
import errno
import fcntl
import glob
import mmap
import os
import sys
import time

from coordl._constants import SHM_DIR, SHM_PREFIX

_UNSIZED_GRACE_S = 1.0
"""How long an empty segment file may wait for its creator to lock and size it."""


def free_shm_bytes() -> int:
    """Bytes free in /dev/shm for an unprivileged writer."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def segment_path(name: str) -> str:
    """Path of the segment called ``name``."""
    return os.path.join(SHM_DIR, name)


def list_segments(kind: str) -> list[str]:
    """Names of all coordl segments of ``kind`` (``cdl_*_<kind>``) on this machine."""
    return sorted(os.path.basename(p) for p in glob.glob(segment_path(f"{SHM_PREFIX}*_{kind}")))


class SegmentKind:
    """Listing, removing and reclaiming the segments of one kind (caches, groups).

    Args:
        kind: the name suffix (see :func:`list_segments`).
        inspect: ``inspect(name, remove_if)``: the segment's stats (None if it is gone), unlinking it
            (and whatever belongs to it) when ``remove_if(stats)``.
        users: the number of live processes using a segment, from its stats.
    """

    def __init__(self, kind: str, inspect, users):
        self.kind, self._inspect, self._users = kind, inspect, users

    def all_stats(self) -> list:
        found = (self._inspect(name, remove_if=lambda s: False) for name in list_segments(self.kind))
        return [s for s in found if s is not None]

    def remove(self, name: str, *, force: bool = False) -> bool:
        stats = self._inspect(name, remove_if=lambda s: force or self._users(s) == 0)
        return stats is not None and (force or self._users(stats) == 0)

    def cleanup_stale(self) -> list[str]:
        removed = (self._inspect(name, remove_if=lambda s: self._users(s) == 0) for name in list_segments(self.kind))
        return [s.name for s in removed if s is not None and self._users(s) == 0]


def unlink_segment(name: str) -> None:
    """Remove segment ``name`` if it exists; processes mapping it keep their mapping."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(segment_path(name))


def unlink_segments(prefix: str) -> int:
    """Remove every segment whose name starts with ``prefix``; return how many were removed."""
    removed = 0
    for path in glob.glob(segment_path(glob.escape(prefix) + "*")):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed += 1
    return removed


class Segment:
    """A file in /dev/shm mapped read-write and shared, with an exclusive flock for writers.

    Lifecycle: :meth:`create` makes the file (exclusively) and sizes it with its pages really
    allocated, so a later write can never SIGBUS on a full /dev/shm; :meth:`open` maps an existing
    one. Whoever decides the segment is no longer used calls :meth:`unlink` (under :meth:`locked`);
    processes that still map it keep working until they :meth:`close`. A segment whose creator died
    before publishing its header is found by the caller's own header check and unlinked.

    Each process must open its own Segment: an flock belongs to an open file description, so a
    descriptor inherited over fork would share (not contend for) its parent's lock.
    """

    def __init__(self, name: str, fd: int, mm: mmap.mmap):
        self.name = name
        self.path = segment_path(name)
        self._fd = fd
        self.buf = mm

    @classmethod
    def create(cls, name: str, size: int, full_error) -> "Segment | None":
        """Create, size and map segment ``name``; None if it already exists.

        The caller holds its lock on return and must release it with :meth:`unlock`.

        Raises:
            Exception: ``full_error(size, free bytes)``, the caller's message for it, if /dev/shm cannot
                hold ``size`` bytes (checked first, and on ``ENOSPC``/``ENOMEM``; the file is removed).
        """
        if size > free_shm_bytes():
            raise full_error(size, free_shm_bytes())
        path = segment_path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.ftruncate(fd, size)
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException as e:
            os.unlink(path)
            os.close(fd)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.ENOMEM):
                raise full_error(size, free_shm_bytes()) from e
            raise
        return cls(name, fd, mm)

    @classmethod
    def open(cls, name: str) -> "Segment | None":
        """Map existing segment ``name`` with its lock held; None if it does not exist (any more).

        The caller holds its lock on return and must release it with :meth:`unlock`. A file left
        empty by a creator that died between creating and sizing it is removed.
        """
        path = segment_path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return None
        deadline = time.monotonic() + _UNSIZED_GRACE_S
        while True:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                replaced = os.fstat(fd).st_ino != os.stat(path).st_ino
            except FileNotFoundError:
                replaced = True
            size = os.fstat(fd).st_size
            if replaced or size or time.monotonic() > deadline:
                break
            # The creator may not have taken its lock yet: let it, then look again.
            fcntl.flock(fd, fcntl.LOCK_UN)
            time.sleep(0.01)
        if replaced:
            os.close(fd)
            return None
        if not size:
            os.unlink(path)
            os.close(fd)
            return None
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        return cls(name, fd, mm)

    def private_map(self, offset: int, length: int) -> mmap.mmap:
        """A copy-on-write mapping of ``length`` bytes from ``offset`` (a multiple of the page size): it
        reads the segment's bytes, its writes stay in this process, and it stays valid after
        :meth:`close` and :meth:`unlink`, until it is garbage."""
        extra = {"trackfd": False} if sys.version_info >= (3, 13) else {}  # else it holds a dup of the fd
        return mmap.mmap(self._fd, length, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE, offset=offset,
                         **extra)

    @property
    def size(self) -> int:
        return len(self.buf)

    def unlock(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def locked(self):
        """Hold the segment's exclusive lock (released on exit, or by the kernel if we die)."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def unlink(self) -> None:
        """Remove the name; mappings stay valid until closed. Call with the lock held."""
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                os.unlink(self.path)

    def close(self) -> None:
        """Unmap and close; idempotent. Views into :attr:`buf` must be released first."""
        if self.buf is not None:
            self.buf.close()
            self.buf = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
