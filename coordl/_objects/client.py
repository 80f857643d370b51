"""One bucket of an S3-compatible object store, read through AWS's native client (``s3torchconnectorclient``,
installed with the ``coordl[s3]`` extra): whole-object GETs, HEADs and paginated LISTs.

NOTE [ Object store client ]
The native client (AWS CRT) releases the GIL and retries timeouts, 5xx and throttling (503 SlowDown) with
exponential backoff and jitter, up to :data:`ATTEMPTS` attempts; an error left after them is raised as an
``OSError`` naming the object, the endpoint and the store's message (``FileNotFoundError`` for a missing
key). Its threads do not survive a fork, so each process makes its own client on first use, and before any
fork every client of this process is dropped and the native threads joined (``os.register_at_fork``), as
torch's DataLoader workers are forked while the training process may be reading the bucket (the look-ahead,
the epoch's listing). Every request holds this process's :class:`Gate` while it is in flight (a listing:
all its pages), and the fork first closes the gate: it waits for the requests in flight to end (at most
:data:`FORK_WAIT_S`) and holds back new ones until the child is made. A client pickles without its native
part.

Endpoint, region and credentials come from the usual places: ``endpoint_url=``/``region=``, else
``AWS_ENDPOINT_URL`` and ``AWS_REGION`` (or ``AWS_DEFAULT_REGION``); credentials as the AWS SDKs find them
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``~/.aws``, ``AWS_PROFILE``).
"""

import concurrent.futures
import contextlib
import gc
import logging
import os
import threading
import time
import weakref
from typing import Iterator

from coordl._core import settings

logger = logging.getLogger(__name__)
ATTEMPTS = 5
"""Attempts of each request, the first included (the native client's retries)."""
FORK_WAIT_S = 30.0
"""Longest a fork waits for this process's requests in flight."""
Entry = tuple[str, int, str]
"""An object as listed: (key, size, ETag)."""
LIST_THREADS = 16
"""Prefixes listed at once (:meth:`ObjectClient.list_tree`)."""
CHECK_ATTEMPTS = 2
"""Attempts of the request that checks a bucket at construction: a wrong endpoint fails in seconds."""
DEFAULT_REGION = "us-east-1"
CONNECTIONS = 128
"""Connections the native client of a process may open (as many requests in flight: the look-ahead's
deepest). It opens about 2.5 per Gbps of its throughput target (measured: its default 10 Gbps, 25
connections, which caps objects of 100 kB at 25 ms round trip near 650 GET/s here; 40 Gbps, 100)."""

_clients: "weakref.WeakSet[ObjectClient]" = weakref.WeakSet()
_lock = threading.Lock()
_native_made = False  # whether this process made a native client (whose threads a fork must wait for)


class Gate:
    """The requests of this process in flight (:meth:`request`), and whether new ones may start."""

    def __init__(self):
        self.changed = threading.Condition()
        self.in_flight, self.closed = 0, False

    @contextlib.contextmanager
    def request(self):
        """Hold the gate for one request (waiting while it is closed)."""
        with self.changed:
            self.changed.wait_for(lambda: not self.closed)
            self.in_flight += 1
        try:
            yield
        finally:
            with self.changed:
                self.in_flight -= 1
                self.changed.notify_all()

    def close(self, timeout_s: float) -> bool:
        """Start no request until :meth:`open`; wait (at most ``timeout_s``) for those in flight to end; whether
        they did."""
        with self.changed:
            self.closed = True
            return self.changed.wait_for(lambda: self.in_flight == 0, timeout_s)

    def open(self) -> None:
        with self.changed:
            self.closed = False
            self.changed.notify_all()


_gate = Gate()


def _native_module():
    try:
        from s3torchconnectorclient import _mountpoint_s3_client
    except ImportError:
        raise ImportError("reading an object store needs AWS's native client: pip install 'coordl[s3]' "
                          "(s3torchconnector)") from None
    return _mountpoint_s3_client


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` as (bucket, prefix); ValueError naming ``url`` otherwise."""
    scheme, _, rest = url.partition("://")
    bucket, _, prefix = rest.partition("/")
    if scheme != "s3" or not bucket:
        raise ValueError(f"not an object store URL: {url!r} (expected s3://BUCKET/PREFIX)")
    return bucket, prefix


class ObjectClient:
    """The objects of ``bucket``.

    Args:
        bucket: the bucket's name.
        endpoint_url: the store's endpoint (another store than AWS S3: MinIO, Ceph, R2, ...); see the module's
            NOTE for the defaults.
        region: the bucket's region.
    """

    def __init__(self, bucket: str, *, endpoint_url: str | None = None, region: str | None = None):
        self.bucket = bucket
        self.endpoint = endpoint_url or settings.get("AWS_ENDPOINT_URL") or None
        self.region = region or settings.get("AWS_REGION") or settings.get("AWS_DEFAULT_REGION") or DEFAULT_REGION
        self._native, self._pid = None, None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_native": None, "_pid": None}

    def where(self) -> str:
        """The bucket and its endpoint, as an error names them."""
        return f"s3://{self.bucket} at {self.endpoint or f'AWS S3 ({self.region})'}"

    def _client(self, attempts: int = ATTEMPTS):
        global _native_made
        if attempts != ATTEMPTS:
            _native_made = True
            return self._new_native(attempts)
        with _lock:  # threads of a process share one
            if self._native is None or self._pid != os.getpid():
                self._native = self._new_native(attempts)
                self._pid, _native_made = os.getpid(), True
                _clients.add(self)
            return self._native

    def _new_native(self, attempts: int):
        return _native_module().MountpointS3Client(region=self.region, endpoint=self.endpoint, max_attempts=attempts,
                                                    throughput_target_gbps=CONNECTIONS / 2.5)

    def get(self, key: str) -> bytes:
        """The bytes of object ``key``, read whole."""
        try:
            with _gate.request():
                return b"".join(self._client().get_object(self.bucket, key))
        except _native_module().S3Exception as e:
            raise self._error(e, key) from None

    def etag(self, key: str) -> str:
        """Object ``key``'s ETag now (a HEAD request)."""
        try:
            with _gate.request():
                return self._client().head_object(self.bucket, key).etag.strip('"')
        except _native_module().S3Exception as e:
            raise self._error(e, key) from None

    def pages(self, prefix: str = "", *, delimiter: str = "",
              attempts: int = ATTEMPTS) -> Iterator[tuple["list[Entry]", "list[str]"]]:
        """Each page of the listing of ``prefix`` (up to 1,000 entries, one request): its objects as (key, size,
        ETag), in key order, and, with a ``delimiter``, the prefixes one level down. Holds the gate until the
        listing is done or closed."""
        try:
            with _gate.request():
                for page in self._client(attempts).list_objects(self.bucket, prefix, delimiter):
                    yield [(info.key, info.size, info.etag.strip('"')) for info in page.object_info], \
                        list(page.common_prefixes)
        except _native_module().S3Exception as e:
            raise self._error(e, prefix + "*") from None

    def list(self, prefix: str = "", *, attempts: int = ATTEMPTS) -> Iterator[Entry]:
        """(key, size, ETag) of every object under ``prefix``, in key order."""
        for objects, _ in self.pages(prefix, attempts=attempts):
            yield from objects

    def list_tree(self, prefix: str, *, threads: int = LIST_THREADS, listed=None) -> tuple["list[Entry]", int]:
        """Every object under ``prefix`` as (key, size, ETag) in key order, and the requests it took: the
        prefixes one level down (``/``-separated: an ImageFolder's classes) are listed ``threads`` at a time.
        ``listed(n)``: told of each page's ``n`` objects as it comes."""
        objects, below, requests, lock = [], [], 0, threading.Lock()
        for page, prefixes in self.pages(prefix, delimiter="/"):
            objects += page
            below += prefixes
            requests += 1
            if listed is not None:
                listed(len(page))
        if not objects and below == [f"{prefix}/"]:  # "a/b" lists the folder "a/b/": its own prefixes are one down
            found, more = self.list_tree(below[0], threads=threads, listed=listed)
            return found, requests + more

        def one(sub: str) -> list:
            nonlocal requests
            found = []
            for page, _ in self.pages(sub):
                found += page
                with lock:
                    requests += 1
                    if listed is not None:
                        listed(len(page))
            return found
        if below:
            with concurrent.futures.ThreadPoolExecutor(min(threads, len(below)), "coordl-list") as pool:
                for found in pool.map(one, below):
                    objects += found
        objects.sort()
        return objects, requests

    def check(self, prefix: str) -> None:
        """Raise a clear error now if the bucket cannot be listed (a wrong endpoint, bucket or credentials)."""
        listing = self.list(prefix, attempts=CHECK_ATTEMPTS)
        try:
            next(listing, None)
        except OSError as e:
            raise type(e)(f"{e} (check endpoint_url= or AWS_ENDPOINT_URL, the bucket's name and region, and the "
                          f"credentials: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws or AWS_PROFILE)") from None
        finally:
            listing.close()

    def latency(self, key: str, probes: int = 2) -> float:
        """The shortest of ``probes`` HEADs of ``key``, in seconds (a clear error now if it cannot be read)."""
        best, native = float("inf"), self._client(CHECK_ATTEMPTS)
        for probe in range(probes + 1):  # the first also sets up the connection: not timed
            started = time.perf_counter()
            try:
                with _gate.request():
                    native.head_object(self.bucket, key)
            except _native_module().S3Exception as e:
                raise self._error(e, key) from None
            if probe:
                best = min(best, time.perf_counter() - started)
        return best

    def _error(self, error: Exception, key: str) -> OSError:
        message = str(error)
        kind = FileNotFoundError if "does not exist" in message or "NoSuch" in message else OSError
        return kind(f"object store: s3://{self.bucket}/{key} at {self.where().partition(' at ')[2]}: {message}")


def _before_fork() -> None:
    """Wait for the requests in flight, then drop every native client of this process and join their threads:
    a forked child makes its own."""
    global _native_made
    if not _gate.close(FORK_WAIT_S):
        logger.warning("coordl: forking while object store requests are still in flight after %.0f s", FORK_WAIT_S)
    with _lock:
        for client in _clients:
            client._native = None
        _clients.clear()
    if _native_made:  # the native runtime is only set up by a client (joining before that crashes it)
        _native_made = False
        gc.collect()  # a client kept only by a cycle (a dropped generator's frame) goes now
        deadline = time.monotonic() + FORK_WAIT_S
        while True:
            try:
                _native_module().join_all_managed_threads(0.5)
                return
            except RuntimeError:  # its threads still close connections
                if time.monotonic() >= deadline:
                    logger.warning("coordl: forking while the object store client's threads still run after %.0f s; "
                                   "the child may hang (use the 'spawn' or 'forkserver' start method)", FORK_WAIT_S)
                    return


def _after_fork_in_child() -> None:
    global _gate
    _gate = Gate()  # the parent's may have been locked by another thread as it forked


os.register_at_fork(before=_before_fork, after_in_parent=lambda: _gate.open(), after_in_child=_after_fork_in_child)
