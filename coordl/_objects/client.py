"""One bucket of an S3-compatible object store, read through AWS's native client (``s3torchconnectorclient``,
installed with the ``coordl[s3]`` extra): whole-object GETs, HEADs and paginated LISTs.

NOTE [ Object store client ]
The native client (AWS CRT) releases the GIL and retries timeouts, 5xx and throttling (503 SlowDown) with
exponential backoff and jitter, up to :data:`ATTEMPTS` attempts; an error left after them is raised as an
``OSError`` naming the object, the endpoint and the store's message (``FileNotFoundError`` for a missing
key). Its threads do not survive a fork, so each process makes its own client on first use, and before any
fork every client of this process is dropped and the native threads joined (``os.register_at_fork``), as
torch's DataLoader workers are forked while the training process may have listed the bucket. A client
pickles without its native part.

Endpoint, region and credentials come from the usual places: ``endpoint_url=``/``region=``, else
``AWS_ENDPOINT_URL`` and ``AWS_REGION`` (or ``AWS_DEFAULT_REGION``); credentials as the AWS SDKs find them
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``~/.aws``, ``AWS_PROFILE``).
"""

import os
import threading
import weakref
from typing import Iterator

from coordl._core import settings

ATTEMPTS = 5
"""Attempts of each request, the first included (the native client's retries)."""
CHECK_ATTEMPTS = 2
"""Attempts of the request that checks a bucket at construction: a wrong endpoint fails in seconds."""
DEFAULT_REGION = "us-east-1"

_clients: "weakref.WeakSet[ObjectClient]" = weakref.WeakSet()
_lock = threading.Lock()
_native_made = False  # whether this process made a native client (whose threads a fork must wait for)


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
        if self._native is None or self._pid != os.getpid() or attempts != ATTEMPTS:
            native = _native_module().MountpointS3Client(region=self.region, endpoint=self.endpoint,
                                                          max_attempts=attempts)
            _native_made = True
            if attempts != ATTEMPTS:
                return native
            with _lock:
                self._native, self._pid = native, os.getpid()
                _clients.add(self)
        return self._native

    def get(self, key: str) -> bytes:
        """The bytes of object ``key``, read whole."""
        try:
            return b"".join(self._client().get_object(self.bucket, key))
        except _native_module().S3Exception as e:
            raise self._error(e, key) from None

    def etag(self, key: str) -> str:
        """Object ``key``'s ETag now (a HEAD request)."""
        try:
            return self._client().head_object(self.bucket, key).etag.strip('"')
        except _native_module().S3Exception as e:
            raise self._error(e, key) from None

    def list(self, prefix: str = "", *, attempts: int = ATTEMPTS) -> Iterator[tuple[str, int, str]]:
        """(key, size, ETag) of every object under ``prefix``, a page of up to 1,000 at a time, in key order."""
        try:
            for page in self._client(attempts).list_objects(self.bucket, prefix):
                for info in page.object_info:
                    yield info.key, info.size, info.etag.strip('"')
        except _native_module().S3Exception as e:
            raise self._error(e, prefix + "*") from None

    def check(self, prefix: str) -> None:
        """Raise a clear error now if the bucket cannot be listed (a wrong endpoint, bucket or credentials)."""
        try:
            for _ in self.list(prefix, attempts=CHECK_ATTEMPTS):
                break
        except OSError as e:
            raise type(e)(f"{e} (check endpoint_url= or AWS_ENDPOINT_URL, the bucket's name and region, and the "
                          f"credentials: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws or AWS_PROFILE)") from None

    def _error(self, error: Exception, key: str) -> OSError:
        message = str(error)
        kind = FileNotFoundError if "does not exist" in message or "NoSuch" in message else OSError
        return kind(f"object store: s3://{self.bucket}/{key} at {self.where().partition(' at ')[2]}: {message}")


def _before_fork() -> None:
    """Drop every native client of this process and join their threads: a forked child makes its own."""
    global _native_made
    with _lock:
        for client in _clients:
            client._native = None
        _clients.clear()
    if _native_made:  # the native runtime is only set up by a client (joining before that crashes it)
        _native_made = False
        _native_module().join_all_managed_threads(0.5)


os.register_at_fork(before=_before_fork)
