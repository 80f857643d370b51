"""Raw-byte sources: read a sample's encoded bytes by key. No caching policy lives here."""

import os
from typing import Protocol

Stamp = tuple[int, int, int]
"""A stored file's version: (inode, ctime ns, size). Any write, replacement (a new inode), re-pointed
link or ``touch``, even one that puts the mtime back, changes the inode or the ctime, which no one
can set (POSIX file systems keep it; one that does not is not checked)."""


class Storage(Protocol):
    """Where raw sample bytes come from on a cache miss (local files; later object stores, peers).

    A storage may also define ``read_stamped(key) -> (bytes, Stamp | None)`` and ``stamp(key) ->
    Stamp | None``, as :class:`FileStorage` does: then each cached item is checked against its key's
    stamp when it is served. Without them, cached items are served unchecked: the storage's keys
    name immutable bytes. A storage whose every key has a pinned version (an object store's manifest) says
    ``pinned = True``: there a key without a stamp has changed since, where a file without one is missing.
    A storage that holds something for its loader (the disk tier: its files' locks) defines ``release()``,
    which the loader's ``close`` calls.
    """

    def read(self, key: str) -> bytes:
        """The stored bytes of ``key``. Raises OSError if it cannot be read."""
        ...


def stamper(storage):
    """``storage.stamp`` for a storage that stamps its files (``read_stamped``), else None (its keys name
    immutable bytes)."""
    return storage.stamp if getattr(storage, "read_stamped", None) is not None else None


def in_memory(storage, key: str) -> None:
    """Tell ``storage`` the node's memory cache took the bytes of ``key`` it just read (the disk tier, which
    then may leave them out: ``_disk.tier``); other storages need not know."""
    note = getattr(storage, "note_in_memory", None)
    if note is not None:
        note(key)


def worth_memory(storage, key: str) -> bool:
    """Whether the node's memory cache should take the bytes of ``key`` just read from ``storage``: always,
    but from a disk tier that holds them where it cannot hold the whole dataset (``_disk.tier``)."""
    worth = getattr(storage, "worth_memory", None)
    return worth is None or worth(key)


def is_current(storage, key: str, cached: Stamp) -> bool:
    """Whether bytes cached with stamp ``cached`` may be served for ``key``: always from a storage that does
    not stamp its files, else only while ``key``'s stamp is still that one."""
    stamp = stamper(storage)
    return stamp is None or stamp(key) == cached


def stamp_of(st: os.stat_result) -> Stamp:
    return st.st_ino, st.st_ctime_ns, st.st_size


class FileStorage:
    """Local (or mounted) files, read whole in one pass.

    Args:
        drop_page_cache: after each read, tell the kernel the file's pages are not needed
            (``posix_fadvise(DONTNEED)``), so misses do not fill the OS page cache behind the
            user's back and the memory budget stays the MinIO cache's. Defaults to True.
    """

    def __init__(self, drop_page_cache: bool = True):
        self.drop_page_cache = drop_page_cache and hasattr(os, "posix_fadvise")

    def read(self, key: str) -> bytes:
        return self.read_stamped(key)[0]

    def read_stamped(self, key: str) -> tuple[bytes, Stamp | None]:
        """The bytes of ``key`` and its stamp as of before the read (so a write during the read makes the
        stamp out of date, never the bytes newer than it); None if the file changed size meanwhile."""
        with open(key, "rb", buffering=0) as f:
            st = os.fstat(f.fileno())
            data = f.read()
            if self.drop_page_cache:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return data, stamp_of(st) if len(data) == st.st_size else None

    def stamp(self, key: str) -> Stamp | None:
        """The stamp of ``key`` now (links followed); None if it cannot be stat'ed."""
        try:
            return stamp_of(os.stat(key))
        except OSError:
            return None
