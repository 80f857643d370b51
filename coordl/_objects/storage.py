"""Where a dataset in an object store reads its misses: whole-object GETs of the objects its manifest pins."""

import concurrent.futures
import hashlib
import logging

import numpy as np
import torch

from coordl._fetch.storage import Stamp
from coordl._objects.client import ObjectClient, split_url
from coordl._objects.manifest import Manifest

logger = logging.getLogger(__name__)


def etag_stamp(etag: str, size: int) -> Stamp:
    """An object's version as a ``Stamp``: (a number derived from its ETag, 0, its size)."""
    return int.from_bytes(hashlib.blake2b(etag.encode(), digest_size=7).digest(), "little"), 0, size


def _is_md5(etag: str) -> bool:
    return len(etag) == 32 and all(c in "0123456789abcdef" for c in etag)


CONCURRENCY = 16
"""GETs in flight per loading process for a batch's misses (``_fetch.concurrent_misses``)."""


class ObjectStorage:
    """The objects of ``manifest``, keyed by their URLs (``s3://BUCKET/KEY``), read through ``client``:
    ``concurrency`` GETs at once for a batch's misses, ``lookahead`` objects in flight ahead of the training
    loop (``_fetch.lookahead``; 0: none).

    An object is served with its manifest entry's stamp, so a cached item stays current while the manifest
    says so. Bytes that are not the entry's (the object changed since the manifest) come without a stamp:
    used once, not cached (see ``storage.Storage``). A GET does not give the object's ETag, so the bytes are
    checked against the entry: their length against its size, and, where the ETag has an MD5's form (a
    single-part upload), their MD5 against it. An MD5 that differs is confirmed by a HEAD: where the ETag is
    still the entry's, the store's ETags are not MD5s (server-side encryption with KMS, for one), and this
    storage stops comparing them.

    NOTE [ Changes in the bucket ]
    Changes are noticed whenever an object is read (above), and at every epoch boundary: as the sampler's plan
    runs out, the training process lists the prefix again (:meth:`start_refresh`; a request per 1,000 keys,
    not one per hit) and compares every ETag with the manifest's; the next epoch starts once it is done
    (:meth:`finish_refresh`). An object changed or gone since the manifest is marked in a table shared with
    every loading process: from then on its stamp is None, so no cache serves its old bytes (they are counted
    ``stale``) and its fresh bytes are read, used once and not cached; one gone is a ``FileNotFoundError``
    naming it. Objects added since the manifest are not read (a new manifest takes them in), and said once.
    So a peer's copy of an object marked here is not used either (``pinned``: a key without a stamp has
    changed), even from a peer that has not listed the prefix again yet.
    """

    pinned = True

    def __init__(self, client: ObjectClient, manifest: Manifest, *, concurrency: int = CONCURRENCY,
                 lookahead: int = 0):
        self.client = client
        bucket, _ = split_url(manifest.url)
        self._entries = {f"s3://{bucket}/{key}": (etag_stamp(etag, size), etag, position)
                         for position, (key, size, etag) in enumerate(zip(manifest.keys, manifest.sizes,
                                                                             manifest.etags))}
        self.etags_are_md5 = True
        self.concurrency, self.lookahead = concurrency, lookahead
        self.manifest = manifest
        self.changed = torch.zeros(len(manifest.keys), dtype=torch.uint8).share_memory_()
        self._changed, self._refresh, self._refresh_done = None, None, None
        self._added_said = False

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_changed": None, "_refresh": None, "_refresh_done": None}

    def _marks(self) -> np.ndarray:
        if self._changed is None:
            self._changed = self.changed.numpy()
        return self._changed

    def start_refresh(self) -> None:
        """List the prefix again in the background, unless a listing is under way (NOTE [ Changes in the bucket ])."""
        if self._refresh is None:
            self._refresh = concurrent.futures.ThreadPoolExecutor(1, "coordl-refresh")
            self._refresh_done = self._refresh.submit(self._relist)

    def finish_refresh(self) -> int:
        """Wait for the listing :meth:`start_refresh` began (if any), mark what changed; the requests it took."""
        if self._refresh is None:
            return 0
        try:
            return self._refresh_done.result()
        finally:
            self._refresh.shutdown()
            self._refresh = None

    def _relist(self) -> int:
        listed, requests = self.client.list_tree(split_url(self.manifest.url)[1])
        now = {key: (size, etag) for key, size, etag in listed}
        marks, changed = self._marks(), []
        for position, (key, size, etag) in enumerate(zip(self.manifest.keys, self.manifest.sizes, self.manifest.etags)):
            if now.get(key) != (size, etag) and not marks[position]:
                marks[position] = 1
                changed.append(key)
        if changed:
            logger.warning("coordl: %d objects under %s changed or went since its manifest (%s%s): read fresh, never "
                           "served from a cache", len(changed), self.manifest.url, ", ".join(changed[:3]),
                           ", ..." if len(changed) > 3 else "")
        added = len(now.keys() - set(self.manifest.keys))
        if added and not self._added_said:
            self._added_said = True
            logger.warning("coordl: %d objects were added under %s since its manifest was made; they are not read "
                           "(list it again for a manifest with them)", added, self.manifest.url)
        return requests

    def size(self, key: str) -> int | None:
        """``key``'s size in the manifest (no request); None if it is not there or changed since."""
        stamp = self.stamp(key)
        return None if stamp is None else stamp[2]

    def sizes(self) -> list[int]:
        """Every object's size in the manifest (what sizes the look-ahead's overflow)."""
        return self.manifest.sizes

    def read(self, key: str) -> bytes:
        return self.read_stamped(key)[0]

    def read_stamped(self, key: str) -> tuple[bytes, Stamp | None]:
        _, object_key = split_url(key)
        data = self.client.get(object_key)
        entry = self._entries.get(key)
        if entry is None:
            return data, None
        stamp, etag, position = entry
        if self._marks()[position]:
            return data, None
        if stamp[2] != len(data):
            self._marks()[position] = 1
            return data, None
        if self.etags_are_md5 and _is_md5(etag) and hashlib.md5(data, usedforsecurity=False).hexdigest() != etag:
            if self.client.etag(object_key) != etag:
                self._marks()[position] = 1
                return data, None  # changed since the manifest, to bytes of the same size
            self.etags_are_md5 = False
        return data, stamp

    def stamp(self, key: str) -> Stamp | None:
        """``key``'s version in the manifest (no request); None if it is not there or changed since."""
        entry = self._entries.get(key)
        return None if entry is None or self._marks()[entry[2]] else entry[0]
