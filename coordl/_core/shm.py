"""Named shared-memory segments: files in the shm directory, mapped shared, with kernel-held locks.

The only module that creates, maps, locks or unlinks shared memory. See NOTE [ Locks and liveness ].

NOTE [ Locks and liveness ]
Every lock is an open-file-description (OFD) byte-range lock on the segment file itself, at offsets
far beyond its end (``_MUTEX_AT``, ``_SLOTS_AT + slot``): no lock file to leak, and the kernel drops
a lock when the last descriptor of its holder's open file description closes, i.e. when the holder
dies, however it dies. Because the lock lives on the shared inode, it works between processes that
share the shm directory but not a PID namespace (containers with ``--ipc=host``).

* **Mutex.** One exclusive lock per segment serialises changes to it. An OFD lock excludes other
  open file descriptions but not the threads sharing one, so a per-segment thread lock is taken
  first: threads and processes are both excluded.
* **Liveness.** Each process using a segment holds the exclusive lock of its own slot byte for as
  long as it uses it. "Is slot i's user alive?" is one ``F_OFD_GETLK``; "is anybody alive?" is one
  ``F_OFD_GETLK`` over the whole slot range. No pid is ever compared, so pid reuse and PID
  namespaces cannot fool it.
* **Fork.** Locks are taken on a descriptor opened only for locking (``O_CLOEXEC``), never on the
  descriptor that ``mmap`` duplicates. In a forked child an ``os.register_at_fork`` hook closes every
  inherited lock descriptor and replaces the thread locks, so a child never holds (or keeps alive)
  its parent's mutex or slot, even if the parent is killed while holding them.
* **Who holds the mutex** is written into the segment (``LOCK_INFO_AT``: pid, since) by the holder,
  so a wait that lasts can name it; OFD locks do not report their owner.

NOTE [ Creation ]
A segment is built under a temporary name (``<name>.new-<random>``): sized, allocated, its header
written, its creator's mutex and slot taken, and only then linked to its real name (``link`` fails if
the name exists, so exactly one creator wins). A named segment is therefore always complete; no
opener ever has to guess whether an empty file's creator is slow or dead. Creation runs under a
lock on the shm directory, so two jobs allocating at once see each other's allocations and the
loser gets an error with true numbers. A temporary whose creator died is removed by
:func:`reclaim_dead`.
"""

import contextlib
import dataclasses
import errno
import fcntl
import glob
import logging
import mmap
import os
import secrets
import struct
import threading
import time
import weakref
from collections.abc import Callable

from coordl._core import settings
from coordl._core.settings import SHM_DIR_ENV, SHM_PREFIX
from coordl._core.sysinfo import proc_stat

logger = logging.getLogger(__name__)

LOCK_INFO_AT = 4032
"""Byte offset, in the header of every segment that other processes lock (caches, groups), of two int64:
the mutex holder's pid and since when (ns). Staged batches carry no such field."""

_MUTEX_AT = 1 << 50
_SLOTS_AT = _MUTEX_AT + 4096
MAX_SLOTS = 4096
"""Liveness slots a segment offers (cache users, group members)."""

_FLOCK = struct.Struct("hh4xqqi4x")  # struct flock on Linux (x86-64, aarch64): type, whence, start, len, pid
_TEMP_MARK = ".new-"
_TEMP_GRACE_S = 60.0
_LOCK_WARN_S = 5.0
_SEGMENTS: "weakref.WeakSet[Segment]" = weakref.WeakSet()


def shm_dir() -> str:
    """Where segments live: ``$COORDL_SHM_DIR`` if set (a tmpfs directory), else /dev/shm."""
    return settings.get(SHM_DIR_ENV) or "/dev/shm"


def free_shm_bytes() -> int:
    """Bytes free in the shm directory for an unprivileged writer."""
    st = os.statvfs(shm_dir())
    return st.f_bavail * st.f_frsize


def total_shm_bytes() -> int:
    """Size of the shm file system."""
    st = os.statvfs(shm_dir())
    return st.f_blocks * st.f_frsize


def segment_path(name: str) -> str:
    """Path of the segment called ``name``."""
    return os.path.join(shm_dir(), name)


def list_segments(kind: str) -> list[str]:
    """Names of all coordl segments of ``kind`` (``cdl_*_<kind>``) in the shm directory."""
    return sorted(os.path.basename(p) for p in glob.glob(segment_path(f"{SHM_PREFIX}*_{kind}")))


def _lock_cmd(fd: int, cmd: int, kind: int, start: int, length: int = 1) -> tuple:
    return _FLOCK.unpack(fcntl.fcntl(fd, cmd, _FLOCK.pack(kind, os.SEEK_SET, start, length, 0)))


def try_lock(fd: int, start: int, length: int = 1) -> bool:
    """Take ``fd``'s open file description's write lock on ``[start, start + length)``; False if another holds it."""
    try:
        _lock_cmd(fd, fcntl.F_OFD_SETLK, fcntl.F_WRLCK, start, length)
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def unlock_range(fd: int, start: int, length: int = 1) -> None:
    """Give up ``fd``'s lock on ``[start, start + length)``."""
    _lock_cmd(fd, fcntl.F_OFD_SETLK, fcntl.F_UNLCK, start, length)


def held_in(fd: int, start: int, length: int) -> int | None:
    """Start of a lock some other open file description holds in ``[start, start + length)``, or None."""
    kind, _, at, _, _ = _lock_cmd(fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK, start, length)
    return None if kind == fcntl.F_UNLCK else at


def _count_held(fd: int, start: int, length: int) -> list[int]:
    """Every byte in ``[start, start + length)`` locked by another open file description."""
    if length <= 0 or held_in(fd, start, length) is None:
        return []
    if length == 1:
        return [start]
    half = length // 2
    return _count_held(fd, start, half) + _count_held(fd, start + half, length - half)


class Probe:
    """A lock-free, read-only look at a segment's liveness slots and mutex (never blocks, never changes).

    Lifecycle: opens the file read-only; :meth:`close` (or ``with``) closes it.
    """

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def live_slots(self) -> list[int]:
        """Slots whose holder is alive (held by another open file description)."""
        return [at - _SLOTS_AT for at in _count_held(self.fd, _SLOTS_AT, MAX_SLOTS)]

    def anyone_alive(self) -> bool:
        return held_in(self.fd, _SLOTS_AT, MAX_SLOTS) is not None

    def slot_alive(self, slot: int) -> bool:
        return held_in(self.fd, _SLOTS_AT + slot, 1) is not None

    def mutex_held(self) -> bool:
        return held_in(self.fd, _MUTEX_AT, 1) is not None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Probe":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def describe_holder(buf) -> str:
    """Who holds a segment's mutex, from the info its holder wrote (``LOCK_INFO_AT``)."""
    pid, since = struct.unpack_from("qq", buf, LOCK_INFO_AT)
    if not pid:
        return "a process that has not said who it is"
    held = (time.time_ns() - since) / 1e9
    state = _process_state(pid)
    return f"pid {pid}{f' ({state})' if state else ''}, for {held:.1f} s"


def _process_state(pid: int) -> str:
    try:
        state = proc_stat(pid)[0]
    except (OSError, IndexError):
        return ""  # gone, or in another PID namespace
    return {"T": "stopped", "t": "stopped by a debugger", "D": "in uninterruptible I/O"}.get(state, "")


class _DirLock:
    """An exclusive flock on the shm directory: serialises creations so allocations never race.

    A flock belongs to the open file description, which a forked child shares: a child forked while
    another thread holds the lock closes its copy (:func:`_after_fork_in_child`), or the lock would stay
    held for as long as the child lives, and the child's own first creation would wait for it forever.
    Descriptors are opened and closed under ``_dir_lock_fds_lock``, which a fork waits for, so the child
    knows exactly which of its descriptors are such copies."""

    def __enter__(self):
        with _dir_lock_fds_lock:
            self.fd = os.open(shm_dir(), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            _dir_lock_fds.add(self.fd)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            self._close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._close()  # closing drops the flock

    def _close(self) -> None:
        with _dir_lock_fds_lock:
            _dir_lock_fds.discard(self.fd)
            os.close(self.fd)


_dir_lock_fds: set[int] = set()
_dir_lock_fds_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _dir_lock_fds_lock
    for fd in _dir_lock_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    _dir_lock_fds.clear()
    _dir_lock_fds_lock = threading.Lock()
    for segment in list(_SEGMENTS):
        segment._drop_inherited_locks()


os.register_at_fork(before=lambda: _dir_lock_fds_lock.acquire(), after_in_parent=lambda: _dir_lock_fds_lock.release(),
                    after_in_child=_after_fork_in_child)


class Segment:
    """A file in the shm directory, mapped read-write and shared, with a mutex and liveness slots.

    See NOTE [ Locks and liveness ] and NOTE [ Creation ]. Each process uses its own Segment object:
    one inherited over fork has lost its locks (its lock descriptor was closed in the child).

    Lifecycle: :meth:`create` or :meth:`open` maps it with the mutex held (release with
    :meth:`unlock`). A user holds a liveness slot (:meth:`hold_slot`) while it uses the segment.
    Whoever finds no live slot left calls :meth:`unlink` under the mutex; processes that still map
    it keep working until they :meth:`close`, which also drops this process's slot and locks.
    """

    def __init__(self, name: str, path: str, map_fd: int, lock_fd: int, mm: mmap.mmap, *, holder_info: bool = True):
        self.name = name
        self._holder_info = holder_info
        self.path = path
        self._map_fd = map_fd
        self._lock_fd = lock_fd
        self._thread_lock = threading.Lock()
        self._slots: set[int] = set()
        self.buf = mm
        _SEGMENTS.add(self)

    # -- creating and opening --------------------------------------------------------------

    @classmethod
    def create(cls, name: str, size: int, full_error: Callable, *, initialize: Callable,
               allocate: int | None = None, require: int | None = None,
               holder_info: bool = True) -> "Segment | None":
        """Create segment ``name`` of ``size`` bytes, ``initialize(buf)`` it, publish it; None if it exists.

        The first ``allocate`` bytes (all by default) are allocated for real, so writes there can never
        SIGBUS on a full file system (see :meth:`allocate`). The caller holds the mutex on return.

        Raises:
            Exception: ``full_error(bytes needed, bytes free)``, the caller's message, if the file system
                has less than ``require`` bytes (default: ``allocate``) free, or the allocation does not
                fit (checked under the directory lock, so the numbers are consistent).
        """
        allocate = size if allocate is None else allocate
        require = allocate if require is None else require
        path = segment_path(name)
        temp = f"{path}{_TEMP_MARK}{secrets.token_hex(4)}"
        with _DirLock():
            if os.path.exists(path):
                return None
            free = free_shm_bytes()
            if require > free:
                raise full_error(require, free)
            map_fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            lock_fd = -1
            try:
                lock_fd = os.open(temp, os.O_RDWR | os.O_CLOEXEC)
                _lock_cmd(lock_fd, fcntl.F_OFD_SETLKW, fcntl.F_WRLCK, _MUTEX_AT)
                os.ftruncate(map_fd, size)
                if allocate:
                    os.posix_fallocate(map_fd, 0, allocate)
                mm = mmap.mmap(map_fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException as e:
                os.unlink(temp)
                for fd in (map_fd, lock_fd):
                    if fd >= 0:
                        os.close(fd)
                if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise full_error(require, free_shm_bytes()) from e
                raise
        segment = cls(name, path, map_fd, lock_fd, mm, holder_info=holder_info)
        segment._thread_lock.acquire()
        segment._note_holder()
        try:
            initialize(mm)
            os.link(temp, path)
        except BaseException as e:
            segment._abandon(temp)
            if isinstance(e, FileExistsError):
                return None
            raise
        os.unlink(temp)
        return segment

    @classmethod
    def _map(cls, name: str, *, locking: bool, holder_info: bool = True) -> "Segment | None":
        """Map existing segment ``name`` (with a lock descriptor if ``locking``), no lock taken; None if it
        does not exist."""
        path = segment_path(name)
        try:
            map_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        lock_fd = -1
        try:
            if locking:
                lock_fd = os.open(f"/proc/self/fd/{map_fd}", os.O_RDWR | os.O_CLOEXEC)  # same inode, own description
            size = os.fstat(map_fd).st_size
            mm = mmap.mmap(map_fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            for fd in (map_fd, lock_fd):
                if fd >= 0:
                    os.close(fd)
            raise
        return cls(name, path, map_fd, lock_fd, mm, holder_info=holder_info and size >= LOCK_INFO_AT + 16)

    @classmethod
    def open(cls, name: str, *, what: str = "", timeout_s: float | None = None) -> "Segment | None":
        """Map existing segment ``name`` with its mutex held; None if it does not exist (any more), or if
        ``timeout_s`` passed before the mutex could be had.

        ``what`` names the segment in the warning logged while the mutex is held by someone else.
        """
        segment = cls._map(name, locking=True)
        if segment is None:
            return None
        if not segment.lock(what=what or name, timeout_s=timeout_s):
            segment.close()
            return None
        try:
            current = os.stat(segment.path).st_ino
        except FileNotFoundError:
            current = None
        if current != os.fstat(segment._map_fd).st_ino:  # unlinked (or replaced) before we got the mutex
            segment.unlock()
            segment.close()
            return None
        return segment

    def _abandon(self, temp: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        self.unlock()
        self.close()

    # -- the mutex ---------------------------------------------------------------------------

    def lock(self, *, what: str = "", timeout_s: float | None = None) -> bool:
        """Take the mutex (threads and processes); with ``timeout_s``, give up after it (returns False).

        A wait longer than a few seconds logs a warning naming the holder (see :func:`describe_holder`).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._thread_lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
            return False
        try:
            started, delay, warned = time.monotonic(), 0.0002, False
            while not try_lock(self._lock_fd, _MUTEX_AT):
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    self._thread_lock.release()
                    return False
                if not warned and now - started > _LOCK_WARN_S:
                    logger.warning("coordl: waiting %.0f s for the lock of %s, held by %s", now - started,
                                   what or self.name, describe_holder(self.buf))
                    warned = True
                time.sleep(delay)
                delay = min(delay * 2, 0.01)
        except BaseException:
            self._thread_lock.release()
            raise
        self._note_holder()
        return True

    def _note_holder(self) -> None:
        if self._holder_info:
            struct.pack_into("qq", self.buf, LOCK_INFO_AT, os.getpid(), time.time_ns())

    def unlock(self) -> None:
        if self._holder_info:
            struct.pack_into("qq", self.buf, LOCK_INFO_AT, 0, 0)
        unlock_range(self._lock_fd, _MUTEX_AT)
        self._thread_lock.release()

    @contextlib.contextmanager
    def locked(self, *, what: str = ""):
        """Hold the mutex (released on exit, or by the kernel if this process dies)."""
        self.lock(what=what)
        try:
            yield
        finally:
            self.unlock()

    # -- liveness slots ----------------------------------------------------------------------

    def hold_slot(self, slot: int) -> bool:
        """Take liveness slot ``slot`` for this process; False if a live process holds it."""
        if not 0 <= slot < MAX_SLOTS:
            raise ValueError(f"internal error: slot {slot} out of range")
        if try_lock(self._lock_fd, _SLOTS_AT + slot):
            self._slots.add(slot)
            return True
        return False

    def take_slot(self, candidates) -> int | None:
        """Hold the first of ``candidates`` that no live process holds; None if every one is held."""
        return next((slot for slot in candidates if self.hold_slot(slot)), None)

    def leave(self, slot: int, forget: Callable, companions: str | None = None) -> None:
        """Stop using the segment: under the mutex ``forget(buf)`` this user's row and give up ``slot``;
        if no live user is left, unlink the segment (and the segments named ``companions*``). Then close.
        Idempotent."""
        if self.buf is None:
            return
        with self.locked():
            forget(self.buf)
            self.release_slot(slot)
            if not self.live_slots():
                if companions is not None:
                    unlink_segments(companions)
                self.unlink()
                logger.debug("removed %s (last user gone)", self.name)
        self.close()

    def release_slot(self, slot: int) -> None:
        if slot in self._slots and self._lock_fd >= 0:
            unlock_range(self._lock_fd, _SLOTS_AT + slot)
        self._slots.discard(slot)

    def slot_alive(self, slot: int) -> bool:
        """Whether slot ``slot`` is held, by this process or a live other one."""
        if slot in self._slots:
            return True
        with Probe(f"/proc/self/fd/{self._map_fd}") as probe:
            return probe.slot_alive(slot)

    def live_slots(self) -> list[int]:
        """Every held slot, this process's included."""
        with Probe(f"/proc/self/fd/{self._map_fd}") as probe:
            return sorted(set(probe.live_slots()) | self._slots)

    def _drop_inherited_locks(self) -> None:
        """In a forked child: close the parent's lock descriptor (its locks stay the parent's)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
        self._lock_fd = -1
        self._slots = set()
        self._thread_lock = threading.Lock()

    # -- memory ------------------------------------------------------------------------------

    def allocate(self, offset: int, length: int) -> bool:
        """Allocate ``[offset, offset + length)`` for real; False if the file system is full."""
        try:
            os.posix_fallocate(self._map_fd, offset, length)
            return True
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.ENOMEM):
                return False
            raise

    def private_map(self, offset: int, length: int) -> mmap.mmap:
        """A copy-on-write mapping of ``length`` bytes from ``offset`` (a multiple of the page size): it
        reads the segment's bytes, its writes stay in this process, and it stays valid after
        :meth:`close` and :meth:`unlink`, until it is garbage. It holds a duplicate of the segment's
        descriptor, and with it the claim :func:`open_unlocked` took (see :func:`unclaimed`)."""
        return mmap.mmap(self._map_fd, length, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)

    def write_at(self, offset: int, data) -> None:
        """Write ``data`` (a contiguous buffer) at ``offset`` through the segment's file, not its mapping:
        the kernel fills the file's pages directly, with no page faulted into this process."""
        view = memoryview(data).cast("B")
        while view:
            written = os.pwrite(self._map_fd, view, offset)
            if not written:
                raise OSError(errno.EIO, f"segment {self.name}: nothing written at offset {offset}")
            view, offset = view[written:], offset + written

    @property
    def size(self) -> int:
        return len(self.buf)

    def unlink(self) -> None:
        """Remove the name; mappings stay valid until closed. Call with the mutex held."""
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self.path).st_ino == os.fstat(self._map_fd).st_ino:
                os.unlink(self.path)

    def close(self) -> None:
        """Drop this process's slots and locks, unmap and close; idempotent. Where views into :attr:`buf`
        are still held (``MinIOCache.view``), the mapping (and the descriptor ``mmap`` keeps of its own)
        goes with the last of them instead."""
        if self.buf is not None:
            with contextlib.suppress(BufferError):
                self.buf.close()
            self.buf = None
        for fd in (self._lock_fd, self._map_fd):
            if fd >= 0:
                os.close(fd)
        self._lock_fd = self._map_fd = -1
        self._slots = set()
        _SEGMENTS.discard(self)


def open_or_create(name: str, *, what: str, create: Callable, usable: Callable, attempts: int = 50) -> Segment:
    """Segment ``name`` with its mutex held: attached if it exists and ``usable(segment)``, else ``create()``d.

    ``usable`` returns False after unlocking and closing a segment it will not use (removing it if it is
    dead); ``create`` returns None if another process created it first. Dead segments of every kind are
    reclaimed first (:func:`reclaim_dead`), except this one, which a new user may reuse.
    """
    reclaim_dead(keep=name)
    for _ in range(attempts):
        segment = Segment.open(name, what=what)
        if segment is None:
            segment = create()
        elif not usable(segment):
            continue
        if segment is not None:
            return segment
    raise RuntimeError(f"internal error: could not create or attach {what} ({name})")


def create_unlocked(name: str, size: int, full_error: Callable) -> "Segment | None":
    """A plain segment (a staged batch): created, allocated and published, mutex released; None if it exists."""
    segment = Segment.create(name, size, full_error, initialize=lambda buf: None, holder_info=False)
    if segment is not None:
        segment.unlock()
    return segment


def open_unlocked(name: str, *, claim: bool = True) -> "Segment | None":
    """Map existing plain segment ``name`` (a staged batch) without locking; None if it does not exist.

    With ``claim``, take a shared ``flock`` on it: a claim belongs to the open file description, which
    every mapping made from the segment (:meth:`Segment.private_map`) and every process forked meanwhile
    shares, so it lasts until the last of them is gone, SIGKILL included. :func:`unclaimed` tells."""
    segment = Segment._map(name, locking=False, holder_info=False)
    if segment is not None and claim:
        try:
            fcntl.flock(segment._map_fd, fcntl.LOCK_SH)
        except BaseException:
            segment.close()
            raise
    return segment


def unclaimed(name: str) -> bool:
    """Whether plain segment ``name`` exists and no process holds a claim on it (:func:`open_unlocked`),
    so that nobody maps it: an exclusive ``flock`` is tried, and dropped at once."""
    try:
        fd = os.open(segment_path(name), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # (closing drops the lock)


def rename_segment(old: str, new: str) -> None:
    """Give segment ``old`` the name ``new``; processes mapping it keep their mapping.

    Raises:
        FileExistsError: segment ``new`` exists (it is left alone, and ``old`` too).
        FileNotFoundError: segment ``old`` does not exist.
    """
    os.link(segment_path(old), segment_path(new))
    os.unlink(segment_path(old))


def unlink_segment(name: str) -> None:
    """Remove segment ``name`` if it exists; processes mapping it keep their mapping."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(segment_path(name))


def unlink_segments(prefix: str, keep: tuple[str, ...] = ()) -> int:
    """Remove every segment whose name starts with ``prefix`` but with none of ``keep``; return how many
    were removed."""
    removed = 0
    for path in glob.glob(segment_path(glob.escape(prefix) + "*")):
        if os.path.basename(path).startswith(keep):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed += 1
    return removed


@dataclasses.dataclass(frozen=True)
class Unreadable:
    """A segment that ``ls`` cannot describe: another user's, or a layout this version does not know."""

    name: str
    why: str


class SegmentKind:
    """Listing, removing and reclaiming the segments of one kind (caches, groups).

    Listing only reads: it takes no lock, changes nothing and removes nothing it does not understand.

    Args:
        kind: the name suffix (see :func:`list_segments`).
        read: ``read(name, buf, live_slots)``: the segment's stats from a read-only mapping, or None if
            its layout is not this version's.
        users: the number of live users, from its stats.
        companions: ``companions(name)``: the prefix of segments that belong to it (removed with it), or None.
    """

    def __init__(self, kind: str, read: Callable, users: Callable, companions: Callable | None = None):
        self.kind, self._read, self._users, self._companions = kind, read, users, companions
        _KINDS.append(self)

    def look(self, name: str):
        """Stats of segment ``name``, an :class:`Unreadable`, or None if it is gone. Read-only."""
        path = segment_path(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except PermissionError:
            return Unreadable(name, f"owned by uid {_owner(path)}, not readable by this user")
        try:
            size = os.fstat(fd).st_size
            if not size:
                return Unreadable(name, "empty")
            with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as buf, Probe(path) as probe:
                stats = self._read(name, buf, probe.live_slots())
        except FileNotFoundError:  # its last user removed it while it was looked at (Probe opens it again)
            return None
        finally:
            os.close(fd)
        return stats if stats is not None else Unreadable(name, "written by another coordl version (unknown layout)")

    def all_stats(self) -> list:
        """Stats (or :class:`Unreadable`) of every segment of this kind. Read-only."""
        found = (self.look(name) for name in list_segments(self.kind))
        return [s for s in found if s is not None]

    def remove(self, name: str, *, force: bool = False) -> bool:
        """Remove segment ``name`` (and its companions) if no live process uses it, or anyway if ``force``.

        Without ``force`` the segment's mutex is tried briefly, never waited on: a segment whose mutex is
        held is in use. A segment this version cannot read is removed only with ``force``.
        """
        if force:
            existed = os.path.exists(segment_path(name))
            self._unlink(name)
            return existed
        stats = self.look(name)
        if stats is None or isinstance(stats, Unreadable) or self._users(stats):
            return False
        return self._remove_if_dead(name)

    def _remove_if_dead(self, name: str) -> bool:
        try:
            segment = Segment.open(name, timeout_s=0.2)  # a held mutex means a live user: never wait on it
        except PermissionError:
            return False
        if segment is None:
            return False
        try:
            with Probe(segment.path) as probe:
                dead = not probe.anyone_alive()
            if dead:
                self._unlink(name)
            return dead
        finally:
            segment.unlock()
            segment.close()

    def _unlink(self, name: str) -> None:
        if self._companions is not None:
            unlink_segments(self._companions(name))
        unlink_segment(name)

    def cleanup_stale(self, keep: str = "") -> list[str]:
        """Remove every segment of this kind (but ``keep``) whose users are all dead; return their names."""
        return [name for name in list_segments(self.kind) if name != keep and self.remove(name)]


def _owner(path: str) -> int:
    try:
        return os.stat(path).st_uid
    except OSError:
        return -1


_KINDS: list[SegmentKind] = []
_reclaimed_in: tuple[int, str] | None = None


def reclaim_dead(keep: str = "") -> None:
    """Once per process: remove segments of every kind whose users all died (SIGKILL), except ``keep`` (the
    one this process is about to reuse), and temporaries of creators that died. Cheap: a few system
    calls per segment; never waits on a lock."""
    global _reclaimed_in
    if _reclaimed_in == (os.getpid(), shm_dir()):
        return
    _reclaimed_in = (os.getpid(), shm_dir())
    for kind in _KINDS:
        for name in kind.cleanup_stale(keep=keep):
            logger.info("removed %s %s: every process using it had died", kind.kind, name)
    now = time.time()
    for temp in glob.glob(segment_path(f"{SHM_PREFIX}*{_TEMP_MARK}*")):
        with contextlib.suppress(OSError):
            if now - os.stat(temp).st_mtime > _TEMP_GRACE_S:
                with Probe(temp) as probe:
                    if not probe.mutex_held():
                        os.unlink(temp)
