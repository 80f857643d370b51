"""The manifest of a dataset in an object store: its objects' keys, sizes and ETags, listed once and pinned.

A dataset reads the objects its manifest names, as they were when it was made: an object added later is
not mixed in, and one changed since no longer matches its entry (see ``storage.ObjectStorage``). Saved as
JSON, a manifest is reused by later jobs (``manifest=PATH``) without listing the bucket again; its
:meth:`Manifest.digest` names the dataset's version.
"""

import dataclasses
import hashlib
import json
import logging
import os
import threading
import time

from coordl._objects.client import ObjectClient, split_url

logger = logging.getLogger(__name__)
PROGRESS_EVERY = 100_000
"""Objects listed between progress lines (a large prefix lists at about 1,000 keys per request)."""
FORMAT = 1


@dataclasses.dataclass
class Manifest:
    """The objects under ``url`` (``s3://BUCKET/PREFIX``), in key order."""

    url: str
    keys: list[str]
    sizes: list[int]
    etags: list[str]

    @classmethod
    def list(cls, client: ObjectClient, url: str) -> "Manifest":
        """List every object under ``url`` now (its first-level prefixes at once; saying how far it got, for a
        large prefix)."""
        _, prefix = split_url(url)
        client.check(prefix)
        objects = [entry for entry in list_objects(client, url) if not entry[0].endswith("/")]  # no folder markers
        if not objects:
            raise FileNotFoundError(f"no objects under {url} ({client.where()})")
        keys, sizes, etags = (list(column) for column in zip(*objects))
        return cls(url, keys, sizes, etags)

    @classmethod
    def load(cls, path: str) -> "Manifest":
        with open(path) as f:
            saved = json.load(f)
        if saved.get("format") != FORMAT:
            raise ValueError(f"manifest={path!r} is not a coordl manifest of format {FORMAT}")
        return cls(saved["url"], saved["keys"], saved["sizes"], saved["etags"])

    def save(self, path: str) -> None:
        """Write it to ``path`` whole or not at all."""
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"format": FORMAT, **dataclasses.asdict(self)}, f)
        os.replace(tmp, path)

    def digest(self) -> bytes:
        """32 bytes naming this version of the dataset: every key with its size and ETag."""
        digest = hashlib.blake2b(f"{self.url}\n{len(self.keys)}\n".encode(), digest_size=32)
        for key, size, etag in zip(self.keys, self.sizes, self.etags):
            digest.update(f"{key}\0{size}\0{etag}\n".encode())
        return digest.digest()


def list_objects(client: ObjectClient, url: str) -> list[tuple[str, int, str]]:
    """Every object under ``url`` (``ObjectClient.list_tree``), logging progress every :data:`PROGRESS_EVERY`."""
    _, prefix = split_url(url)
    started, count, lock = time.monotonic(), [0], threading.Lock()

    def listed(n: int) -> None:
        with lock:
            before, count[0] = count[0], count[0] + n
        if before // PROGRESS_EVERY != count[0] // PROGRESS_EVERY:
            logger.info("listed %d objects under %s (%.0f s)", count[0], url, time.monotonic() - started)
    return client.list_tree(prefix, listed=listed)[0]


def manifest_of(client: ObjectClient, url: str, path: str | None) -> Manifest:
    """The manifest saved at ``path`` if there is one (of ``url``), else ``url`` listed now (and saved at
    ``path``, when given)."""
    if path is not None and os.path.exists(path):
        manifest = Manifest.load(path)
        if manifest.url != url:
            raise ValueError(f"manifest={path!r} lists {manifest.url}, not {url}")
        return manifest
    manifest = Manifest.list(client, url)
    if path is not None:
        manifest.save(path)
    return manifest
