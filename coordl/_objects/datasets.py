"""Datasets whose samples are objects in a bucket: :class:`ObjectDataset` for any layout, and
:class:`ObjectImageFolder`, torchvision's ``ImageFolder`` over a prefix. Both are ``RawBytesDataset``s, so
coordl caches their objects' bytes; read with a plain torch DataLoader they GET each object."""

import hashlib
import math
from typing import Any, Callable

import torch

from coordl._fetch.raw_datasets import decode_image
from coordl._objects.client import ObjectClient, split_url
from coordl._objects.manifest import manifest_of
from coordl._objects.storage import ObjectStorage

LOOKAHEAD_RATE = 4000
"""Objects a second the look-ahead is sized to sustain (what a node's training loop may take)."""
LOOKAHEAD_MIN, LOOKAHEAD_MAX = 16, 128
LOOKAHEAD_BYTES = 64 * 2**20
"""The most bytes the look-ahead has in flight (its objects' mean size times its depth)."""


class ObjectDataset(torch.utils.data.Dataset):
    """The objects under ``url``, in key order: sample ``i`` is ``decode(bytes)`` (with ``targets[i]``, when
    given, as ``(sample, target)``).

    Args:
        url: ``s3://BUCKET/PREFIX``.
        decode: turns an object's bytes into the sample (the bytes themselves by default).
        targets: one per object, or None.
        manifest: a path to keep the listing at: reused when it exists (no LIST), else written.
        lookahead: objects a coordl loader keeps in flight ahead of the training loop (see ``_fetch.lookahead``
            NOTE [ Look-ahead ]); ``"auto"`` sizes it from the store's latency (:func:`lookahead_depth`), 0
            turns it off.
        endpoint_url, region: the store's (see ``coordl._objects.client`` NOTE [ Object store client ]).

    Attributes: ``keys`` (the objects' keys), ``manifest``, ``raw_storage`` (what coordl reads them through).
    """

    def __init__(self, url: str, decode: Callable[[bytes], Any] | None = None, targets=None, *,
                 manifest: str | None = None, lookahead: int | str = "auto", endpoint_url: str | None = None,
                 region: str | None = None):
        bucket, _ = split_url(url)
        client = ObjectClient(bucket, endpoint_url=endpoint_url, region=region)
        self.url, self.manifest = url, manifest_of(client, url, manifest)
        self.keys = self.manifest.keys
        if lookahead == "auto":
            lookahead = lookahead_depth(client.latency(self.keys[0]), sum(self.manifest.sizes) / len(self.keys))
        elif not isinstance(lookahead, int) or isinstance(lookahead, bool) or lookahead < 0:
            raise ValueError(f"lookahead should be 'auto' or a number of objects >= 0, but got lookahead={lookahead!r}")
        else:
            client.latency(self.keys[0], probes=1)  # a clear error now, not in a worker
        self.raw_storage = ObjectStorage(client, self.manifest, lookahead=lookahead)
        self.decode = decode
        if targets is not None and len(targets) != len(self.keys):
            raise ValueError(f"targets has {len(targets)} entries; {url} has {len(self.keys)} objects")
        self.targets = targets
        self._bucket = bucket

    def __len__(self) -> int:
        return len(self.keys)

    def raw_key(self, index: int) -> str:
        return f"s3://{self._bucket}/{self.keys[index]}"

    def decode_raw(self, index: int, raw: bytes) -> Any:
        sample = self.decode(raw) if self.decode is not None else raw
        return sample if self.targets is None else (sample, self.targets[index])

    def __getitem__(self, index: int) -> Any:
        return self.decode_raw(index, self.raw_storage.read(self.raw_key(index)))

    def raw_identity(self) -> bytes:
        """What names this dataset's cache: its manifest (a changed bucket is another dataset) and the keys
        of its samples, in order."""
        digest = hashlib.blake2b(self.manifest.digest(), digest_size=32)
        for key in self.keys:
            digest.update(f"{key}\n".encode())
        return digest.digest()


def lookahead_depth(latency_s: float, object_bytes: float) -> int:
    """Objects in flight that keep :data:`LOOKAHEAD_RATE` objects a second coming at ``latency_s`` a request,
    within :data:`LOOKAHEAD_MIN`..:data:`LOOKAHEAD_MAX` and :data:`LOOKAHEAD_BYTES` in flight."""
    depth = max(LOOKAHEAD_MIN, min(LOOKAHEAD_MAX, math.ceil(latency_s * LOOKAHEAD_RATE)))
    return max(1, min(depth, int(LOOKAHEAD_BYTES // max(object_bytes, 1))))


class ObjectImageFolder(ObjectDataset):
    """torchvision's ``ImageFolder`` over ``url``: the classes are its first-level prefixes, sorted, each
    class's images in key order (for flat class folders, ``ImageFolder``'s order), and a sample is ``(transform(image), target_transform(class index))``, the image decoded as
    ``ImageFolder``'s default loader does (RGB PIL). Objects directly under ``url``, and those whose names
    ``is_valid_file`` rejects (by default: not an image extension torchvision knows), are left out.

    Attributes as ``ImageFolder``'s: ``classes``, ``class_to_idx``, ``samples`` (key URL, class index),
    ``imgs``, ``targets``, ``transform``, ``target_transform``.
    """

    def __init__(self, url: str, transform=None, target_transform=None, *,
                 is_valid_file: Callable[[str], bool] | None = None, manifest: str | None = None,
                 lookahead: int | str = "auto", endpoint_url: str | None = None, region: str | None = None):
        from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension
        super().__init__(url, manifest=manifest, lookahead=lookahead, endpoint_url=endpoint_url, region=region)
        valid = is_valid_file or (lambda name: has_file_allowed_extension(name, IMG_EXTENSIONS))
        _, prefix = split_url(url)
        start = len(prefix) if not prefix or prefix.endswith("/") else len(prefix) + 1
        chosen = []
        for key in self.manifest.keys:
            folder, _, rest = key[start:].partition("/")
            if rest and valid(key):
                chosen.append((folder, key))
        self.classes = sorted({folder for folder, _ in chosen})
        if not self.classes:
            raise FileNotFoundError(f"no class folders with images under {url}")
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        chosen.sort(key=lambda entry: (self.class_to_idx[entry[0]], entry[1]))
        self.keys = [key for _, key in chosen]
        self.targets = [self.class_to_idx[folder] for folder, _ in chosen]
        self.samples = [(self.raw_key(i), target) for i, target in enumerate(self.targets)]
        self.imgs = self.samples
        self.transform, self.target_transform = transform, target_transform

    def decode_raw(self, index: int, raw: bytes) -> tuple[Any, Any]:
        image, target = decode_image(raw), self.targets[index]
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target

    def __repr__(self) -> str:
        return f"ObjectImageFolder({self.url!r}, {len(self)} images in {len(self.classes)} classes)"
