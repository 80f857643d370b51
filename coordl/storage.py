"""Raw-byte sources: read a sample's encoded bytes by key. No caching policy lives here."""

import os
from typing import Protocol


class Storage(Protocol):
    """Where raw sample bytes come from on a cache miss (local files; later object stores, peers)."""

    def read(self, key: str) -> bytes:
        """The stored bytes of ``key``. Raises OSError if it cannot be read."""
        ...


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
        with open(key, "rb", buffering=0) as f:
            data = f.read()
            if self.drop_page_cache:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return data
