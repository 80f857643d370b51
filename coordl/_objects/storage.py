"""Where a dataset in an object store reads its misses: whole-object GETs of the objects its manifest pins."""

import hashlib

from coordl._fetch.storage import Stamp
from coordl._objects.client import ObjectClient, split_url
from coordl._objects.manifest import Manifest


def etag_stamp(etag: str, size: int) -> Stamp:
    """An object's version as a ``Stamp``: (a number derived from its ETag, 0, its size)."""
    return int.from_bytes(hashlib.blake2b(etag.encode(), digest_size=7).digest(), "little"), 0, size


class ObjectStorage:
    """The objects of ``manifest``, keyed by their URLs (``s3://BUCKET/KEY``), read through ``client``.

    An object is served with its manifest entry's stamp, so a cached item stays current while the manifest
    says so; bytes whose length is not the entry's size (the object changed since the manifest) come without
    a stamp, and are used once but not cached (see ``storage.Storage``).
    """

    def __init__(self, client: ObjectClient, manifest: Manifest):
        self.client = client
        bucket, _ = split_url(manifest.url)
        self._stamps = {f"s3://{bucket}/{key}": etag_stamp(etag, size)
                        for key, size, etag in zip(manifest.keys, manifest.sizes, manifest.etags)}

    def read(self, key: str) -> bytes:
        return self.read_stamped(key)[0]

    def read_stamped(self, key: str) -> tuple[bytes, Stamp | None]:
        _, object_key = split_url(key)
        data = self.client.get(object_key)
        stamp = self._stamps.get(key)
        return data, stamp if stamp is not None and stamp[2] == len(data) else None

    def stamp(self, key: str) -> Stamp | None:
        """``key``'s version in the manifest (no request)."""
        return self._stamps.get(key)
