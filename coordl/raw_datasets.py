"""Datasets whose samples are encoded files: the opt-in protocol, coordl's own dataset, adapters.

A dataset opts in to caching by implementing :class:`RawBytesDataset`: ``raw_key(i)`` names the
file holding sample ``i`` as stored, ``decode_raw(i, raw)`` turns those bytes into exactly what
``dataset[i]`` returns (decode, then the dataset's own random transforms, drawn afresh per call).
coordl then reads and caches the raw bytes and never the decoded or augmented sample.
torchvision ``DatasetFolder``/``ImageFolder`` are recognised as they are, and so are torch's
``Subset`` (what ``random_split`` returns) and ``ConcatDataset`` of datasets coordl can cache.
"""

import bisect
import hashlib
import io
import os
import stat
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch.utils.data
from PIL import Image


@runtime_checkable
class RawBytesDataset(Protocol):
    """A map-style dataset that coordl can cache: each sample is one stored file.

    Example::

        class Spectrograms(torch.utils.data.Dataset):
            def __len__(self): return len(self.files)
            def raw_key(self, i): return self.files[i]
            def decode_raw(self, i, raw): return augment(load_wav(raw)), self.labels[i]
            def __getitem__(self, i): return self.decode_raw(i, open(self.files[i], "rb").read())
    """

    def __len__(self) -> int: ...

    def raw_key(self, index: int) -> str:
        """Path of the file that stores sample ``index``."""
        ...

    def decode_raw(self, index: int, raw: bytes) -> Any:
        """What ``dataset[index]`` returns, computed from the file's bytes ``raw``."""
        ...


def decode_image(raw: bytes) -> Image.Image:
    """Decode encoded image bytes to an RGB PIL image, as torchvision's ``pil_loader`` does."""
    return Image.open(io.BytesIO(raw)).convert("RGB")


class FileDataset(torch.utils.data.Dataset):
    """Samples stored one per file, e.g. a list of JPEG paths with labels; cacheable by coordl.

    Args:
        files: path of each sample's file.
        targets: label of each sample; if given, items are ``(sample, target)``. Defaults to None.
        decode: ``"image"`` (RGB PIL image), ``"bytes"`` (the raw bytes) or a callable on the
            bytes. Defaults to ``"image"``.
        transform: applied to the decoded sample, e.g. random augmentation. Defaults to None.
        target_transform: applied to the target. Defaults to None.
    """

    def __init__(self, files: Sequence[str], targets: Sequence[Any] | None = None,
                 decode: str | Callable[[bytes], Any] = "image",
                 transform: Callable | None = None, target_transform: Callable | None = None):
        if targets is not None and len(targets) != len(files):
            raise ValueError(f"targets has {len(targets)} entries but files has {len(files)}")
        decoders = {"image": decode_image, "bytes": bytes}
        if not callable(decode) and decode not in decoders:
            raise ValueError(f"decode should be 'image', 'bytes' or a callable, but got decode={decode!r}")
        self.files = [os.fspath(f) for f in files]
        self.targets = targets
        self.decode = decoders.get(decode, decode) if isinstance(decode, str) else decode
        self.transform = transform
        self.target_transform = target_transform

    def __len__(self) -> int:
        return len(self.files)

    def raw_key(self, index: int) -> str:
        return self.files[index]

    def decode_raw(self, index: int, raw: bytes) -> Any:
        sample = self.decode(raw)
        if self.transform is not None:
            sample = self.transform(sample)
        if self.targets is None:
            return sample
        target = self.targets[index]
        if self.target_transform is not None:
            target = self.target_transform(target)
        return sample, target

    def __getitem__(self, index: int) -> Any:
        with open(self.files[index], "rb") as f:
            return self.decode_raw(index, f.read())


class DatasetFolderSource:
    """:class:`RawBytesDataset` view of a torchvision ``DatasetFolder`` that loads with PIL.

    ``decode_raw`` reproduces ``DatasetFolder.__getitem__`` step by step from the bytes.
    """

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def raw_key(self, index: int) -> str:
        return self.dataset.samples[index][0]

    def decode_raw(self, index: int, raw: bytes) -> Any:
        ds = self.dataset
        sample, target = decode_image(raw), ds.samples[index][1]
        if ds.transform is not None:
            sample = ds.transform(sample)
        if ds.target_transform is not None:
            target = ds.target_transform(target)
        return sample, target

    def dali_target(self, index: int) -> int:
        """The class index, for the DALI backend."""
        return self.dataset.samples[index][1]


class _MappedSource:
    """:class:`RawBytesDataset` view of a dataset whose samples are other datasets' samples.

    Sample ``index`` is sample ``local`` of one of its parts, as :meth:`locate` says; its file,
    bytes and label are that sample's.

    Args:
        dataset: the torch dataset viewed (its ``len`` is the view's).
        parts: the views of the datasets it draws its samples from.
    """

    def __init__(self, dataset, parts: list[RawBytesDataset]):
        self.dataset = dataset
        self.parts = parts
        self._labelled = all(_has_labels(part) for part in parts)

    def __len__(self) -> int:
        return len(self.dataset)

    def locate(self, index: int) -> tuple[RawBytesDataset, Any]:
        """(the part holding sample ``index``, its index there)."""
        raise NotImplementedError

    def raw_key(self, index: int) -> str:
        part, local = self.locate(index)
        return part.raw_key(local)

    def decode_raw(self, index: int, raw: bytes) -> Any:
        part, local = self.locate(index)
        return part.decode_raw(local, raw)

    @property
    def dali_target(self) -> Callable[[int], Any]:
        """The DALI backend's label reader: each part's ``dali_target`` or ``targets``.

        Missing (``hasattr`` is False) where a part has neither, as for any dataset without labels.
        """
        if not self._labelled:
            raise AttributeError(f"a part of this {type(self.dataset).__name__} has no dali_target(i) or targets")
        return self._target

    def _target(self, index: int) -> Any:
        part, local = self.locate(index)
        return part.dali_target(local) if hasattr(part, "dali_target") else part.targets[local]


def _has_labels(source: RawBytesDataset) -> bool:
    return hasattr(source, "dali_target") or getattr(source, "targets", None) is not None


class SubsetSource(_MappedSource):
    """:class:`RawBytesDataset` view of a ``torch.utils.data.Subset`` (what ``random_split`` returns):
    sample ``i`` is sample ``indices[i]`` of the inner dataset."""

    def locate(self, index: int) -> tuple[RawBytesDataset, Any]:
        return self.parts[0], self.dataset.indices[index]


class ConcatSource(_MappedSource):
    """:class:`RawBytesDataset` view of a ``torch.utils.data.ConcatDataset``: its datasets' samples
    one after the other."""

    def locate(self, index: int) -> tuple[RawBytesDataset, int]:
        ends = self.dataset.cumulative_sizes
        part = bisect.bisect_right(ends, index)
        return self.parts[part], index - (ends[part - 1] if part else 0)


def _overridden(dataset, base: type, methods: tuple[str, ...]) -> str | None:
    """The first of ``methods`` that ``dataset``'s class defines otherwise than ``base``, or None."""
    for name in methods:
        if getattr(type(dataset), name, None) is not getattr(base, name, None):
            return name
    return None


def _subset_source(dataset, decode: bool) -> tuple[RawBytesDataset | None, str]:
    if decode and (overridden := _overridden(dataset, torch.utils.data.Subset, ("__getitem__", "__getitems__"))):
        return None, f"{type(dataset).__name__} overrides {overridden}"
    inner, why = raw_source(dataset.dataset, decode)
    if inner is None:
        return None, f"its dataset ({type(dataset.dataset).__name__}) cannot be cached: {why}"
    return SubsetSource(dataset, [inner]), ""


def _concat_source(dataset, decode: bool) -> tuple[RawBytesDataset | None, str]:
    if decode and (overridden := _overridden(dataset, torch.utils.data.ConcatDataset, ("__getitem__",))):
        return None, f"{type(dataset).__name__} overrides {overridden}"
    parts = []
    for number, part in enumerate(dataset.datasets):
        source, why = raw_source(part, decode)
        if source is None:
            return None, f"its part {number} ({type(part).__name__}) cannot be cached: {why}"
        parts.append(source)
    return ConcatSource(dataset, parts), ""


def raw_source(dataset, decode: bool = True) -> tuple[RawBytesDataset | None, str]:
    """How coordl reads ``dataset``'s raw bytes: (source, "") or (None, why it cannot).

    A ``Subset`` qualifies if its dataset does, a ``ConcatDataset`` if each of its datasets does.
    With ``decode=False`` (the DALI backend, which decodes itself) only the files matter, so any
    ``DatasetFolder`` qualifies, whatever its loader, and overridden ``__getitem__`` methods do not
    matter.
    """
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return None, "it is an IterableDataset (samples have no index to cache by)"
    if isinstance(dataset, RawBytesDataset):
        return dataset, ""
    if isinstance(dataset, torch.utils.data.Subset):
        return _subset_source(dataset, decode)
    if isinstance(dataset, torch.utils.data.ConcatDataset):
        return _concat_source(dataset, decode)
    try:
        from torchvision.datasets import DatasetFolder
        from torchvision.datasets.folder import default_loader, pil_loader
        from torchvision import get_image_backend
    except ImportError:
        DatasetFolder = None
    if DatasetFolder is not None and isinstance(dataset, DatasetFolder):
        if not decode:
            return DatasetFolderSource(dataset), ""
        if _overridden(dataset, DatasetFolder, ("__getitem__",)):
            return None, f"{type(dataset).__name__} overrides __getitem__"
        if dataset.loader not in (default_loader, pil_loader) or get_image_backend() != "PIL":
            return None, f"its loader {getattr(dataset.loader, '__name__', dataset.loader)!r} reads files itself"
        return DatasetFolderSource(dataset), ""
    return None, f"{type(dataset).__name__} does not implement coordl.RawBytesDataset (raw_key, decode_raw)"


def fingerprint_files(keys: Sequence[str], content: bool) -> tuple[bytes, int]:
    """(sha256 naming the files and their versions, total bytes): what a cache of ``keys`` holds.

    Each file is named by its resolved absolute path (symlinks followed), so the same relative paths
    read from another working directory are other files. By default its version is its size and
    mtime: an edit that keeps both (``touch -r``, a copy that preserves mtimes, a same-size write
    within the file system's mtime granularity) goes unnoticed. ``content=True`` hashes each file's
    bytes instead of its mtime, which reads the whole dataset (slow for large datasets). A file that
    cannot be stat'ed or read is hashed as such; reading it later names it.

    Args:
        keys: the files' paths (each sample's ``raw_key``).
        content: hash the files' bytes rather than their mtimes.
    """
    digest = hashlib.sha256(len(keys).to_bytes(8, "little"))
    total, cwd, real_dirs = 0, os.getcwd(), {}
    for key in keys:
        path, st = _resolve(key, cwd, real_dirs)
        if st is None:
            size, version = -1, 0
        else:
            size, version = st.st_size, _content_digest(path) if content else st.st_mtime_ns
        total += max(size, 0)
        digest.update(f"{path}\0{size}\0{version}\n".encode())
    return digest.digest(), total


def _resolve(key: str, cwd: str, real_dirs: dict[str, str]) -> tuple[str, os.stat_result | None]:
    """``os.path.realpath(key)`` and its stat (None if it has none), resolving each directory once
    (``real_dirs``: directory -> resolved): a single system call per file that is not a link."""
    parent, name = os.path.split(os.path.join(cwd, key))  # not normalized: ".." after a link is physical
    if parent not in real_dirs:
        real_dirs[parent] = os.path.realpath(parent)
    path = os.path.join(real_dirs[parent], name)
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            path = os.path.realpath(path)
            st = os.stat(path)
    except OSError:
        return path, None
    return path, st


def _content_digest(path: str) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except OSError:
        return "unreadable"
    return digest.hexdigest()
