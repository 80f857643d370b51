"""Where a dataset in an object store reads its misses: whole-object GETs of the objects its manifest pins."""

import hashlib

from coordl._fetch.storage import Stamp
from coordl._objects.client import ObjectClient, split_url
from coordl._objects.manifest import Manifest


def etag_stamp(etag: str, size: int) -> Stamp:
    """An object's version as a ``Stamp``: (a number derived from its ETag, 0, its size)."""
    return int.from_bytes(hashlib.blake2b(etag.encode(), digest_size=7).digest(), "little"), 0, size


def _is_md5(etag: str) -> bool:
    return len(etag) == 32 and all(c in "0123456789abcdef" for c in etag)


class ObjectStorage:
    """The objects of ``manifest``, keyed by their URLs (``s3://BUCKET/KEY``), read through ``client``.

    An object is served with its manifest entry's stamp, so a cached item stays current while the manifest
    says so. Bytes that are not the entry's (the object changed since the manifest) come without a stamp:
    used once, not cached (see ``storage.Storage``). A GET does not give the object's ETag, so the bytes are
    checked against the entry: their length against its size, and, where the ETag has an MD5's form (a
    single-part upload), their MD5 against it. An MD5 that differs is confirmed by a HEAD: where the ETag is
    still the entry's, the store's ETags are not MD5s (server-side encryption with KMS, for one), and this
    storage stops comparing them.
    """

    def __init__(self, client: ObjectClient, manifest: Manifest):
        self.client = client
        bucket, _ = split_url(manifest.url)
        self._entries = {f"s3://{bucket}/{key}": (etag_stamp(etag, size), etag)
                         for key, size, etag in zip(manifest.keys, manifest.sizes, manifest.etags)}
        self.etags_are_md5 = True

    def read(self, key: str) -> bytes:
        return self.read_stamped(key)[0]

    def read_stamped(self, key: str) -> tuple[bytes, Stamp | None]:
        _, object_key = split_url(key)
        data = self.client.get(object_key)
        entry = self._entries.get(key)
        if entry is None or entry[0][2] != len(data):
            return data, None
        stamp, etag = entry
        if self.etags_are_md5 and _is_md5(etag) and hashlib.md5(data, usedforsecurity=False).hexdigest() != etag:
            if self.client.etag(object_key) != etag:
                return data, None  # changed since the manifest, to bytes of the same size
            self.etags_are_md5 = False
        return data, stamp

    def stamp(self, key: str) -> Stamp | None:
        """``key``'s version in the manifest (no request)."""
        entry = self._entries.get(key)
        return None if entry is None else entry[0]
