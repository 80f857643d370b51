"""The disk tier's folder (``cache_dir``): a cache folder per dataset, the quota they share, the least
recently used unused one removed when it is short, and what ``coordl cache ls`` / ``rm`` show and remove.

A dataset's folder is named by a token of its cache's name (``folder_of``); its ``meta.json`` says what it
holds, and its mtime is the cache's last use (set when a process opens it). A folder is removed only under
its ``users.lock`` held exclusive, so never while a live process has it open (``_disk.cache`` NOTE [ Disk
cache locks ]): renamed out of the way first, so that no opener sees it half removed.
"""

import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import shutil

from coordl._core.settings import AUTO_DISK_KEEP_FRACTION
from coordl._disk import format as fmt
from coordl._disk.cache import INDEX, META, USERS, folder_bytes, in_use

_REMOVING = ".removing-"


def folder_of(cache_dir: str, scope: str) -> str:
    """The folder of the cache named ``scope`` (a dataset's identity in hex, or its ``cache_name``)."""
    return os.path.join(cache_dir, hashlib.sha256(scope.encode()).hexdigest()[:24])


def _datasets(cache_dir: str) -> list[str]:
    try:
        names = sorted(os.listdir(cache_dir))
    except FileNotFoundError:
        return []
    return [os.path.join(cache_dir, n) for n in names if not n.startswith(".")
            and os.path.isfile(os.path.join(cache_dir, n, META))]


def room_for(cache_dir: str, folder: str, need: int, quota: int | None, evict: bool = True) -> int:
    """Bytes ``folder`` may add now, up to ``need``: within ``quota`` of ``cache_dir``'s folders' bytes (None:
    while the file system keeps :data:`AUTO_DISK_KEEP_FRACTION` free), after removing, where that is short,
    the least recently used other datasets no live process has open (``evict=False``: what removing them all
    would give, none removed)."""
    def room() -> int:
        if quota is None:
            fs = os.statvfs(folder)
            return fs.f_bavail * fs.f_frsize - int(AUTO_DISK_KEEP_FRACTION * fs.f_blocks * fs.f_frsize)
        return quota - sum(folder_bytes(f) for f in _datasets(cache_dir))
    free = room()
    if free >= need:
        return need
    others = sorted((f for f in _datasets(cache_dir) if f != folder), key=_last_use)
    if not evict:
        return max(0, min(need, free + sum(folder_bytes(f) for f in others if not in_use(f))))
    for other in others:
        if remove(other):
            free = room()
            if free >= need:
                return need
    return max(0, free)


def _last_use(folder: str) -> float:
    try:
        return os.stat(os.path.join(folder, META)).st_mtime
    except FileNotFoundError:
        return 0.0


def remove(folder: str) -> bool:
    """Remove the cache in ``folder`` unless a live process has it open; whether it was removed."""
    try:
        fd = os.open(os.path.join(folder, USERS), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                return False
            raise
        parent, name = os.path.split(folder)
        away = os.path.join(parent, f".{name}{_REMOVING}{os.getpid()}")
        try:
            os.rename(folder, away)
        except FileNotFoundError:
            return False
        shutil.rmtree(away, ignore_errors=True)
        return True
    finally:
        os.close(fd)


@dataclasses.dataclass
class DiskCacheInfo:
    """One disk cache as ``coordl cache ls`` shows it."""

    name: str
    label: str
    n_items: int
    items_cached: int
    bytes_on_disk: int
    last_use: float
    in_use: bool

    @property
    def fill_fraction(self) -> float:
        return self.items_cached / self.n_items if self.n_items else 0.0


def list_disk_caches(cache_dir: str) -> list[DiskCacheInfo]:
    """The disk caches in ``cache_dir``, read only: no lock taken, nothing written."""
    infos = []
    for folder in _datasets(cache_dir):
        try:
            with open(os.path.join(folder, META)) as f:
                meta = json.load(f)
            with open(os.path.join(folder, INDEX), "rb") as f:
                records, _ = fmt.replay(f.read(), len(fmt.INDEX_MAGIC))
        except (OSError, ValueError):
            continue
        infos.append(DiskCacheInfo(os.path.basename(folder), meta.get("label", ""), int(meta.get("n_items", 0)),
                                   len(fmt.latest(records)), folder_bytes(folder), _last_use(folder), in_use(folder)))
    return infos


def remove_disk_cache(cache_dir: str, name: str) -> bool:
    """Remove the disk cache ``name`` (as ``list_disk_caches`` names it) unless it is in use."""
    return remove(os.path.join(cache_dir, name))
