"""The disk tier: a storage in front of the dataset's storage that serves what a local disk cache holds and
writes what it reads there, behind the training loop.

NOTE [ Disk tier ]
The hierarchy is shared memory (the MinIO cache), then this tier, then peers' caches or storage: the fetch
path reads every miss of the node's memory cache through :class:`DiskTier`, as it would read storage. A
read is served from the disk cache when it holds the key with the stamp the storage gives now (one ``stat``
of a file, a lookup in an object store's manifest; a storage that stamps nothing names immutable bytes), its
bytes checked against their checksum: a failed check is counted ``corrupt`` and the bytes are read from
storage, never served. Every other read goes to storage, and its bytes (with the stamp of that read) are
queued for this process's writer thread, which appends them in groups (``_disk.cache``); so the disk cache
holds what the memory cache holds too, and the next job, whose memory cache starts empty, reads storage
for nothing the disk holds. A read of a key another process on the node is reading into the disk cache
waits for its write (``_disk.reading`` NOTE [ Reads in flight ]), so jobs that fill one disk cache at once
read each item from storage once between them. Where the quota cannot hold the whole dataset (its size
estimated from the items read so far), the items the memory cache took are not written, and the memory
cache does not take what the disk served (``worth_memory``): each holds what the other does not, and a
later epoch reads (1 - memory's share - disk's share) of the dataset from storage. Within a dataset
nothing is evicted (MinIO's policy: fill once); an item
already held with its stamp is not written again. Pages read or written are dropped from the page cache:
memory is the shm tier's. Between datasets, the least recently used one no live process has open is
removed when the quota is short (``_disk.folder``). A full quota stops the writes; an OSError (ENOSPC,
EIO) turns the tier off, with one warning, and loading goes on from storage. In a partitioned job a server's
peers are served from its disk as from its memory cache (:meth:`DiskTier.held_mask`, :meth:`DiskTier.peek`).

Counts go into the dataset's counter rows (``disk_hits``, ``disk_bytes``, ``corrupt``, ``disk_wait_ns``);
a disk hit is also counted by its caller as a read below the memory cache, so the rows' totals take disk
hits out of ``misses`` and ``storage_bytes`` (``SampleCounters.totals``). The look-ahead of an object store
reads past the tier (:meth:`DiskTier.read_past_disk`) and leaves what the disk holds to the workers.
"""

import collections
import logging
import multiprocessing.util
import os
import queue
import threading
import time

import numpy as np
import torch

from coordl._disk import format as fmt
from coordl._disk.cache import CORRUPT, DiskCache
from coordl._disk.folder import room_for
from coordl._disk.reading import ReadClaims
from coordl._fetch.cached_dataset import COUNTER_FIELDS

logger = logging.getLogger(__name__)

WRITE_QUEUE_BYTES = 64 << 20
"""Most bytes a process holds queued for its writer; reads past that are not written this time."""
GROUP_BYTES = 16 << 20
COMMIT_S = 0.2
"""The writer commits a group once it has this many bytes, or once its first item has waited this long."""
FLUSH_S = 4.0
"""How long a process's exit waits for its queued writes (torch stops a worker that takes 5 s)."""
SERVED_KEPT = 4096
"""Disk hits a process remembers until the memory cache asks about them (``worth_memory``)."""
SHORT_S = 1.0
"""How long the writer's and the read path's word on whether the quota is short holds."""
SETTLE_S = 0.02
"""Where the quota is short, how long the writer waits for the memory cache to say it took an item."""
VERIFY = ("checksum", "none")
"""``cache_dir_verify=``: each item read checked against its record's checksum, or only its header and key."""
UNSTAMPED = (0, 0, 0)
"""The stamp recorded for a storage's bytes where it stamps nothing (its keys name immutable bytes)."""
_COLUMNS = [COUNTER_FIELDS.index(name) for name in ("disk_hits", "disk_bytes", "corrupt", "disk_wait_ns")]


class DiskTier:
    """``storage`` behind ``cache`` (a :class:`DiskCache`), writing at most ``quota`` bytes in ``cache_dir``
    (None: leave the file system's share free, see ``_disk.folder``). Counts in the counters of
    ``counted_in`` (the ``CachedDataset`` reading through it, whose table each pass renews), once set.
    Anything else is the storage's."""

    def __init__(self, storage, cache: DiskCache, cache_dir: str, quota: int | None, verify: str = "checksum"):
        self.inner, self.cache, self.cache_dir, self.quota = storage, cache, cache_dir, quota
        self.verify = verify == "checksum"
        self.off = torch.zeros(2, dtype=torch.uint8).share_memory_()  # [off (error), full (quota)]
        self.claims = ReadClaims(cache.folder)  # the keys this process reads into it (NOTE [ Reads in flight ])
        self.counted_in = None
        self._pid = None

    def __getstate__(self) -> dict:
        """What travels (to workers, or in a pickled loader): the settings, not this process's writer."""
        kept = ("inner", "cache", "cache_dir", "quota", "verify", "off", "claims", "counted_in")
        return {name: self.__dict__[name] for name in kept} | {"_pid": None}

    def __getattr__(self, name: str):
        if name.startswith("__") or "inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["inner"], name)

    def _local(self) -> None:
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._queued, self._read_items, self._read_bytes = 0, 0, 0
        self._in_memory: dict[str, bool] = {}  # the queued keys: whether the memory cache took each
        self._served: collections.OrderedDict[str, None] = collections.OrderedDict()  # the latest disk hits' keys
        self._short_until, self._was_short = 0.0, False
        self._writer = None
        self._off = self.off.numpy()
        self._digests = None  # the dataset's keys' digests (``held_mask``), made once

    # -- reading ------------------------------------------------------------------------------

    def _stamp_now(self, key: str):
        return self.inner.stamp(key) if getattr(self.inner, "read_stamped", None) is not None else UNSTAMPED

    def holds(self, key: str) -> bool:
        """Whether the disk cache holds ``key``'s current bytes (by its record; they are checked when read)."""
        self._local()
        if self._off[0]:
            return False
        try:
            record = self.cache.record(key)
        except OSError as e:
            self._turn_off(e)
            return False
        return record is not None and tuple(int(v) for v in record["stamp"]) == self._stamp_now(key)

    def takes_writes(self) -> bool:
        """Whether what is read from storage now is written to the disk cache (neither off nor full)."""
        self._local()
        return not self._off.any()

    def _read(self, key: str):
        """``key``'s bytes and stamp: the disk cache's where it holds them current and whole, else storage's
        (then queued to be written); where another process on the node is reading them into the disk cache,
        its write is waited for (``_disk.reading`` NOTE [ Reads in flight ])."""
        self._local()
        current = None if self._off[0] else self._stamp_now(key)
        if current is None:
            return self.read_past_disk(key)
        data = self._from_disk(key, current)
        if data is None and not self._off.any():
            started = time.perf_counter_ns()
            claimed = self.claims.claim(key)
            if not claimed:
                self.claims.wait(key)
            self.cache.catch_up()  # (claimed too: another's write may have been committed since the look above)
            data = self._from_disk(key, current, started)
            if claimed and data is None:
                return self.read_past_disk(key, claimed=True)
            if claimed:
                self.claims.release(key)
        if data is not None:
            return data, (None if current is UNSTAMPED else current)
        return self.read_past_disk(key)  # its reader died, or its bytes went to the memory cache instead

    read_stamped = _read

    def read(self, key: str) -> bytes:
        return self._read(key)[0]

    def stamp(self, key: str):
        return self.inner.stamp(key)

    def worth_memory(self, key: str) -> bool:
        """Whether the memory cache should take ``key``'s bytes just read: not where they came from the disk
        cache and it cannot hold the whole dataset (memory then holds what the disk does not)."""
        self._local()
        with self._lock:
            served = self._served.pop(key, False) is None
        return not served or not self._short()

    def _held_copy(self, key: str, current):
        """``key``'s bytes as the disk cache holds them with the stamp ``current``, checked: the bytes, CORRUPT, or
        None (not held so, or the tier turned off by a failed read)."""
        try:
            record = self.cache.record(key)
            if record is None or tuple(int(v) for v in record["stamp"]) != current:
                return None
            return self.cache.read(key, record, self.verify)
        except OSError as e:
            self._turn_off(e)
            return None

    def _from_disk(self, key: str, current, started: int | None = None):
        """``key``'s bytes the disk cache holds with the stamp ``current``, counted a disk hit (waited for since
        ``started``), or None."""
        started = time.perf_counter_ns() if started is None else started
        data = self._held_copy(key, current)
        if data is None:
            return None
        if data is not CORRUPT:
            with self._lock:
                self._served[key] = None
                if len(self._served) > SERVED_KEPT:
                    self._served.popitem(last=False)
        if self.counted_in is None:
            return None if data is CORRUPT else bytes(data)
        hits, nbytes, corrupt, wait = _COLUMNS
        row = self.counted_in.counters.row()
        with self._lock:
            if data is CORRUPT:
                row[corrupt] += 1
                return None
            row[hits] += 1
            row[nbytes] += len(data)
            row[wait] += time.perf_counter_ns() - started
        return bytes(data)

    # -- for the peers of a partitioned job (``_peer``: a server serves its disk tier as its memory cache) -----

    def held_mask(self, source):
        """Which of ``source``'s items the disk cache holds (by their records), or None while the tier is off."""
        self._local()
        if self._off[0]:
            return None
        if self._digests is None:
            self._digests = np.fromiter((fmt.key_digest(source.raw_key(i)) for i in range(len(source))),
                                        dtype=np.uint64, count=len(source))
        try:
            return self.cache.held_mask(self._digests)
        except OSError as e:
            self._turn_off(e)
            return None

    def peek(self, key: str):
        """``key``'s bytes and stamp (None: unstamped) where the disk cache holds them current and whole, else None;
        counted nowhere (a peer server's lookup: its client counts a peer hit)."""
        self._local()
        current = None if self._off[0] else self._stamp_now(key)
        data = None if current is None else self._held_copy(key, current)
        if data is None or data is CORRUPT:
            return None
        return bytes(data), (None if current is UNSTAMPED else current)

    def read_past_disk(self, key: str, wait: bool = False, claimed: bool = False):
        """``key``'s bytes and stamp from storage, queued to be written to the disk cache (``wait``: for room
        in the queue, else not written this time when it is full); ``claimed``: by this process, which lets go
        of it once its write is committed, or at once if it is not queued."""
        self._local()
        queued = False
        try:
            if getattr(self.inner, "read_stamped", None) is not None:
                raw, stamp = self.inner.read_stamped(key)
            else:
                raw, stamp = self.inner.read(key), UNSTAMPED
            if stamp is not None and not self._off.any():
                queued = self._offer(key, raw, stamp, wait)
        finally:
            if claimed and not queued:
                self.claims.release(key)
        return raw, (None if stamp is UNSTAMPED else stamp)

    def warm(self, keys, jobs: int, done=None) -> tuple[int, int]:
        """Read every one of ``keys`` the disk cache does not hold into it, ``jobs`` reads at once, then wait
        for the writes (``done(nbytes)`` after each read); (items read, bytes read)."""
        import concurrent.futures
        missing = [key for key in keys if not self.holds(key)]

        def read(key: str) -> int:
            n = len(self.read_past_disk(key, wait=True)[0])
            if done is not None:
                done(n)
            return n
        with concurrent.futures.ThreadPoolExecutor(jobs, thread_name_prefix="coordl-warm") as pool:
            nbytes = sum(pool.map(read, missing))
        self.flush(timeout_s=None)
        return len(missing), nbytes

    # -- writing ------------------------------------------------------------------------------

    def _offer(self, key: str, raw: bytes, stamp, wait: bool = False) -> bool:
        """Queue ``key``'s bytes for the writer; whether they were (not when the queue is full and not ``wait``)."""
        while True:
            with self._lock:
                if self._queued + len(raw) <= WRITE_QUEUE_BYTES or not self._queued:
                    self._queued += len(raw)
                    self._read_items, self._read_bytes = self._read_items + 1, self._read_bytes + len(raw)
                    self._in_memory[key] = False
                    if self._writer is None:
                        self._writer = threading.Thread(target=self._write_loop, name="coordl-disk-writer",
                                                        daemon=True)
                        self._writer.start()
                        multiprocessing.util.Finalize(self, self.flush, exitpriority=20)
                    break
                if not wait:
                    return False  # written when it is read again
            time.sleep(0.002)
        self._queue.put((key, raw, tuple(stamp)))
        return True

    def _write_loop(self) -> None:
        stopping = False
        while not stopping:
            item = self._queue.get()
            if item is None:
                return
            batch, nbytes, until = [item], len(item[1]), time.monotonic() + COMMIT_S
            while nbytes < GROUP_BYTES:  # a group: what comes within COMMIT_S (two fdatasyncs per group)
                try:
                    item = self._queue.get(timeout=max(0.0, until - time.monotonic()))
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                    break
                batch.append(item)
                nbytes += len(item[1])
            try:
                short = not self._off.any() and self._short()
                if short:  # the memory cache's word on the last item comes just after its read
                    time.sleep(SETTLE_S)
                with self._lock:
                    in_memory = {key: self._in_memory.pop(key, False) for key, _, _ in batch}
                if not self._off.any():
                    self._write([item for item in batch if not in_memory[item[0]]] if short else batch)
            except OSError as e:
                self._turn_off(e)
            finally:
                with self._lock:
                    self._queued -= nbytes
                for key, _, _ in batch:  # committed, or not to be: whoever waits for them looks again
                    self.claims.release(key)

    def note_in_memory(self, key: str) -> None:
        """The memory cache took ``key``'s bytes just read (``_disk.tier`` NOTE [ Disk tier ]: where the disk
        cannot hold the whole dataset, it takes what the memory cache does not)."""
        with self._lock:
            if key in self._in_memory:
                self._in_memory[key] = True

    def _short(self) -> bool:
        """Whether the quota cannot hold the whole dataset, its size estimated from the items the disk holds and
        those this process read from storage; looked at once a second at most."""
        now = time.monotonic()
        if now < self._short_until:
            return self._was_short
        self._short_until = now + SHORT_S
        held, held_bytes = self.cache.held()
        items, nbytes = self._read_items + held, self._read_bytes + held_bytes
        if not items:
            self._was_short = False
            return False
        estimate = nbytes * self.cache.n_items // items
        have = self.cache.pack_bytes()
        self._was_short = have + room_for(self.cache_dir, self.cache.folder, estimate, self.quota, evict=False) < estimate
        return self._was_short

    def _write(self, batch: list) -> None:
        asked = []

        def room(need: int) -> int:
            asked.append((need, room_for(self.cache_dir, self.cache.folder, need, self.quota)))
            return asked[-1][1]
        self.cache.append(batch, room)
        if asked and asked[0][1] < asked[0][0] and not self._off[1]:
            self._off[1] = 1
            logger.info("coordl: the disk cache in %s is full (quota %s): it keeps what it holds and takes no more",
                        self.cache_dir, "auto" if self.quota is None else self.quota)

    def flush(self, timeout_s: float | None = FLUSH_S) -> None:
        """Write what this process has queued (waiting at most ``timeout_s``; None: as long as that takes),
        then stop its writer."""
        if self._pid != os.getpid() or self._writer is None:
            return
        self._queue.put(None)
        self._writer.join(timeout_s)
        self._writer = None

    def release(self) -> None:
        """The loader closes: write what this process has queued, then close the disk cache and its claims here."""
        self.flush()
        self.cache.close()
        self.claims.close()

    def _turn_off(self, error: OSError) -> None:
        first = not self._off[0]
        self._off[0] = 1
        if first:
            logger.warning("coordl: the disk cache in %s is turned off (%s); loading goes on from storage",
                           self.cache.folder, error)


class UnstampedDiskTier(DiskTier):
    """The disk tier over a storage that stamps nothing (its keys name immutable bytes): as that storage, it
    has no ``read_stamped``, so the fetch path caches what it reads as it would the storage's."""

    read_stamped = None


def disk_tier(storage, cache: DiskCache, cache_dir: str, quota: int | None, verify: str = "checksum") -> DiskTier:
    """``storage`` behind the disk cache ``cache``: a :class:`DiskTier`, or, over a storage that stamps nothing,
    an :class:`UnstampedDiskTier`."""
    kind = DiskTier if getattr(storage, "read_stamped", None) is not None else UnstampedDiskTier
    return kind(storage, cache, cache_dir, quota, verify)
