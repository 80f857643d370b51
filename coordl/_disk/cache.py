"""One dataset's disk cache: a folder of pack files and their index (``_disk.format``), read in any process,
appended to under the folder's writer lock.

NOTE [ Disk cache locks ]
Two ``flock`` locks per folder, each taken on a descriptor this process opened itself (a forked child opens
its own: a lock on an inherited descriptor would be its parent's): ``users.lock``, held shared by every
process that has the cache open (so a remover, which needs it exclusive, never removes a cache in use, and a
holder's death frees it, however it dies), and ``write.lock``, held exclusive around each append (one writer
at a time; the next one truncates a torn tail its dead predecessor left). Readers take no lock: they replay
the index's committed groups and read the items those name, which are never rewritten.
"""

import errno
import fcntl
import json
import mmap
import os
import threading
import time

import numpy as np

from coordl._disk import format as fmt

PACK_BYTES = 256 << 20
"""A pack file is closed to new items once it holds this many bytes (an item larger than that has one of its
own)."""
_TAIL_MERGE = 1 << 16
"""Records learnt since the index was opened are kept in a dict until this many, then merged into the array."""
_CATCH_UP_S = 0.05
"""A lookup that finds nothing reads what other writers committed at most this often."""
META = "meta.json"
INDEX = "index.log"
USERS, WRITER = "users.lock", "write.lock"
CORRUPT = object()
"""What :meth:`DiskCache.read` returns for an item whose bytes fail their check."""


class DiskCacheMismatch(Exception):
    """The folder holds another dataset's cache."""


def pack_name(pack: int) -> str:
    return f"pack-{pack:06d}.dat"


class DiskCache:
    """The cache of a dataset of ``n_items`` in ``folder`` (made if missing), described by ``label``.

    ``meta`` names what the folder must hold (``identity``: the dataset's, hex); a folder that holds another
    raises :class:`DiskCacheMismatch`. State is per process: a forked child opens its own descriptors."""

    def __init__(self, folder: str, *, identity: str, n_items: int, label: str):
        self.folder, self.identity, self.n_items, self.label = folder, identity, n_items, label
        self._pid = None

    def __getstate__(self) -> dict:
        return {"folder": self.folder, "identity": self.identity, "n_items": self.n_items, "label": self.label,
                "_pid": None}

    # -- opening ------------------------------------------------------------------------------

    def _ensure(self) -> None:
        if self._pid == os.getpid():
            return
        with _opening:
            if self._pid != os.getpid():
                self._open()

    def _open(self) -> None:
        self._lock = threading.Lock()  # the index's state, between this process's threads
        self._packs: dict[int, int] = {}
        self._writers: dict[int, tuple[int, bool]] = {}
        self._records = np.zeros(0, dtype=fmt.RECORD)
        self._tail: dict[int, np.void] = {}
        self._bad: dict[int, tuple[int, int]] = {}
        self._replayed_to, self._caught_up_at = len(fmt.INDEX_MAGIC), 0.0
        opened = []
        try:
            self._users = _users_lock(self.folder)
            opened.append(self._users)
            self._writer = _open_lock(os.path.join(self.folder, WRITER))
            opened.append(self._writer)
            self._check_meta()
            self._index = os.open(os.path.join(self.folder, INDEX), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            opened.append(self._index)
            if os.fstat(self._index).st_size < len(fmt.INDEX_MAGIC):
                with self._writing():
                    if os.fstat(self._index).st_size < len(fmt.INDEX_MAGIC):
                        os.pwrite(self._index, fmt.INDEX_MAGIC, 0)
                        os.fdatasync(self._index)
            elif os.pread(self._index, len(fmt.INDEX_MAGIC), 0) != fmt.INDEX_MAGIC:
                raise DiskCacheMismatch(f"{os.path.join(self.folder, INDEX)} is not a coordl disk cache's index")
            os.utime(os.path.join(self.folder, META))  # its mtime: the cache's last use
        except BaseException:
            for fd in opened:  # its locks with them: a cache this process could not open is not in use by it
                os.close(fd)
            raise
        size = os.fstat(self._index).st_size  # the whole index at once into the sorted array (no per-record work)
        records, end = fmt.replay(os.pread(self._index, size - self._replayed_to, self._replayed_to), 0)
        self._records, self._replayed_to = fmt.latest(records), self._replayed_to + end
        self._pid = os.getpid()

    def _check_meta(self) -> None:
        path = os.path.join(self.folder, META)
        meta = {"identity": self.identity, "n_items": self.n_items, "label": self.label, "format": 1}
        try:
            with open(path) as f:
                found = json.load(f)
        except FileNotFoundError:
            temporary = f"{path}.new-{os.getpid()}"
            with open(temporary, "w") as f:
                json.dump(meta, f)
            os.replace(temporary, path)
            return
        except (OSError, ValueError) as e:
            raise DiskCacheMismatch(f"{path} cannot be read ({e})") from None
        if (found.get("identity"), found.get("n_items")) != (self.identity, self.n_items):
            raise DiskCacheMismatch(f"{self.folder} holds the disk cache of {found.get('label')!r} "
                                    f"({found.get('n_items')} items), not of {self.label!r}")

    def close(self) -> None:
        """Close this process's descriptors (dropping its locks)."""
        if self._pid != os.getpid():
            return
        for fd in (*self._packs.values(), *(fd for fd, _ in self._writers.values()), self._index, self._users,
                   self._writer):
            os.close(fd)
        self._pid = None

    # -- the index ----------------------------------------------------------------------------

    def _catch_up(self, force: bool = False) -> None:
        """Learn the groups committed since the last look."""
        now = time.monotonic()
        if not force and now - self._caught_up_at < _CATCH_UP_S:
            return
        with self._lock:
            self._caught_up_at = now
            size = os.fstat(self._index).st_size
            if size <= self._replayed_to:
                return
            records, end = fmt.replay(os.pread(self._index, size - self._replayed_to, self._replayed_to), 0)
            self._replayed_to += end
            for record in records:
                self._tail[int(record["digest"])] = record
            if len(self._tail) >= _TAIL_MERGE:
                self._merge()

    def _merge(self) -> None:
        """Under ``_lock``: the records learnt since into the sorted array (the array first, so that a lookup
        in another thread finds a record in one or the other)."""
        if self._tail:
            self._records = fmt.latest(np.concatenate([self._records, np.array(list(self._tail.values()),
                                                                                dtype=fmt.RECORD)]))
            self._tail = {}

    def record(self, key: str, catch_up: bool = True):
        """``key``'s latest committed record, or None (none, or its bytes failed their check)."""
        self._ensure()
        digest = fmt.key_digest(key)
        found = self._find(digest)
        if found is None and catch_up:
            self._catch_up()
            found = self._find(digest)
        if found is not None and self._bad.get(digest) == (int(found["pack"]), int(found["offset"])):
            return None
        return found

    def _find(self, digest: int):
        found = self._tail.get(digest)
        if found is not None:
            return found
        digests = self._records["digest"]
        at = int(np.searchsorted(digests, digest))
        return self._records[at] if at < len(digests) and digests[at] == digest else None

    def items(self) -> int:
        """Items with a committed record (as this process has replayed them)."""
        self._ensure()
        self._catch_up(force=True)
        with self._lock:
            return len(self._records) + sum(int(d) not in self._records["digest"] for d in self._tail)

    def held(self) -> tuple[int, int]:
        """(items, bytes of their data) with a record, as this process has replayed them."""
        self._ensure()
        with self._lock:
            records, tail = self._records, list(self._tail.values())
            items, nbytes = len(records), int(records["data_len"].sum())
            if tail:  # learnt since: new keys, or new versions of keys the array holds (whose bytes they replace)
                learnt = np.array(tail, dtype=fmt.RECORD)
                at = np.minimum(np.searchsorted(records["digest"], learnt["digest"]), max(len(records) - 1, 0))
                known = records["digest"][at] == learnt["digest"] if len(records) else np.zeros(len(tail), bool)
                items += int((~known).sum())
                nbytes += int(learnt["data_len"].sum()) - int(records["data_len"][at[known]].sum())
            return items, nbytes

    def catch_up(self) -> None:
        """Learn now what other writers have committed (a lookup that misses looks at most every ``_CATCH_UP_S``)."""
        self._ensure()
        self._catch_up(force=True)

    def held_mask(self, digests: np.ndarray) -> np.ndarray:
        """Which of the keys of ``digests`` (:func:`format.key_digest`) have a committed record, with what other
        writers committed so far; their stamps and bytes are checked when read."""
        self.catch_up()
        with self._lock:
            known = np.concatenate([self._records["digest"],
                                    np.fromiter(self._tail, dtype=np.uint64, count=len(self._tail))])
        return np.isin(digests, known)

    # -- reading ------------------------------------------------------------------------------

    def read(self, key: str, record, verify: bool = True):
        """The data of ``key``'s item at ``record``, checked (``verify``: its bytes against their checksum too);
        :data:`CORRUPT` if it fails the check (then no longer found until a newer record replaces it). Raises
        OSError if the pack cannot be read."""
        fd = self._pack(int(record["pack"]))
        offset, span = int(record["offset"]), fmt.item_span(record)
        blob = os.pread(fd, span, offset)
        if hasattr(os, "posix_fadvise"):  # memory is the shm tier's: the pages go
            os.posix_fadvise(fd, offset, span, os.POSIX_FADV_DONTNEED)
        data = fmt.item_data(blob, record, key, verify)
        if data is None:
            self._bad[int(record["digest"])] = (int(record["pack"]), offset)
            return CORRUPT
        return data

    def _pack(self, pack: int) -> int:
        fd = self._packs.get(pack)
        if fd is None:
            with self._lock:
                fd = self._packs.get(pack)
                if fd is None:
                    fd = self._packs[pack] = os.open(os.path.join(self.folder, pack_name(pack)),
                                                     os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        return fd

    # -- appending ----------------------------------------------------------------------------

    def _writing(self):
        return _Flock(self._writer)

    def append(self, items: list[tuple[str, bytes, tuple]], room=None) -> int:
        """Append ``items`` (key, data, stamp) that have no record with that stamp yet, as one committed group;
        at most ``room(need)`` bytes of pack space, asked under the writer lock for the ``need`` of those items
        (None: no bound), the rest left out. Returns the bytes written."""
        self._ensure()
        with self._writing():
            self._truncate_torn_tail()
            fresh = []
            for key, data, stamp in items:
                found = self.record(key, catch_up=False)
                if found is None or tuple(int(v) for v in found["stamp"]) != tuple(stamp):
                    fresh.append((key, data, stamp))
            if not fresh:
                return 0
            room = None if room is None else room(fmt.ALIGN + sum(  # a block of the index's growth, and the items
                fmt.packed_bytes(key, len(data)) for key, data, _ in fresh)) - fmt.ALIGN
            pack = max(self._known_packs(), default=0)
            end = fmt.aligned(os.fstat(self._pack(pack)).st_size)
            records, writes, written = [], [], 0
            for key, data, stamp in fresh:
                blob = fmt.item_bytes(key, data)
                if end and end + len(blob) > PACK_BYTES:
                    pack, end = pack + 1, 0
                need = fmt.aligned(len(blob))
                if room is not None and written + need > room:
                    break
                writes.append((pack, end, blob))
                records.append((fmt.key_digest(key), pack, len(blob) - fmt.ITEM.size - len(data), end, len(data),
                                stamp, fmt.checksum(data)))
                end, written = end + need, written + need
            if not records:
                return 0
            for pack in dict.fromkeys(pack for pack, _, _ in writes):
                self._write_run(pack, [(offset, blob) for p, offset, blob in writes if p == pack])
            group = np.array(records, dtype=fmt.RECORD)
            os.pwrite(self._index, fmt.group_bytes(group), self._replayed_to)
            os.fdatasync(self._index)
            self._catch_up(force=True)
            return written

    def _write_run(self, pack: int, items: list[tuple[int, bytes]]) -> None:
        """Write ``items`` (offset, blob), consecutive aligned slots of ``pack``, as one aligned buffer (each blob
        padded to its slot), directly to the device where the file system allows (``O_DIRECT``: the page cache
        holds nothing of it), then make it durable."""
        start = items[0][0]
        buffer = mmap.mmap(-1, items[-1][0] + fmt.aligned(len(items[-1][1])) - start)  # page-aligned, zeroed
        try:
            for offset, blob in items:
                buffer[offset - start:offset - start + len(blob)] = blob
            fd, direct = self._pack_writer(pack)
            os.pwrite(fd, buffer, start)
            os.fdatasync(fd)
            if not direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, start, len(buffer), os.POSIX_FADV_DONTNEED)
        finally:
            buffer.close()

    def _pack_writer(self, pack: int) -> tuple[int, bool]:
        """A descriptor writing ``pack`` and whether it bypasses the page cache."""
        found = self._writers.get(pack)
        if found is None:
            path, flags = os.path.join(self.folder, pack_name(pack)), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
            try:
                found = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644), hasattr(os, "O_DIRECT")
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: the file system has no direct I/O (tmpfs)
                    raise
                found = os.open(path, flags, 0o644), False
            self._writers[pack] = found
        return found

    def _known_packs(self) -> list[int]:
        packs = [int(name[5:11]) for name in os.listdir(self.folder) if name.startswith("pack-")
                 and name.endswith(".dat") and name[5:11].isdigit()]
        return packs + list(self._packs)

    def _truncate_torn_tail(self) -> None:
        """Under the writer lock: learn every committed group, and cut what a dead writer left after them."""
        self._catch_up(force=True)
        if os.fstat(self._index).st_size > self._replayed_to:
            os.ftruncate(self._index, self._replayed_to)

    def pack_bytes(self) -> int:
        """Bytes the pack files take on disk."""
        return folder_bytes(self.folder)


def folder_bytes(folder: str) -> int:
    """Bytes a cache folder's files take on disk (allocated blocks)."""
    total = 0
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return 0
    for entry in entries:
        try:
            total += entry.stat(follow_symlinks=False).st_blocks * 512
        except FileNotFoundError:
            pass
    return total


_opening = threading.Lock()
"""Serialises a process's first use of a cache between its threads (made anew in a forked child)."""


def _new_opening_lock() -> None:
    global _opening
    _opening = threading.Lock()


os.register_at_fork(after_in_child=_new_opening_lock)


def _users_lock(folder: str) -> int:
    """A descriptor holding ``folder``'s users lock shared, ``folder`` made if missing (again, if a remover
    renamed it away while this process waited for the lock)."""
    path = os.path.join(folder, USERS)
    while True:
        os.makedirs(folder, exist_ok=True)
        fd = _open_lock(path)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _open_lock(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)


class _Flock:
    def __init__(self, fd: int):
        self.fd = fd

    def __enter__(self):
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)


def in_use(folder: str) -> bool:
    """Whether a live process has the cache in ``folder`` open (holds ``users.lock``)."""
    try:
        fd = os.open(os.path.join(folder, USERS), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
            return True
        raise
    finally:
        os.close(fd)
