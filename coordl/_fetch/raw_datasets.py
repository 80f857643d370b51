"""Datasets whose samples are encoded files: the opt-in protocol, coordl's own dataset, adapters.

A dataset opts in to caching by implementing :class:`RawBytesDataset`: ``raw_key(i)`` names the
file holding sample ``i`` as stored, ``decode_raw(i, raw)`` turns those bytes into exactly what
``dataset[i]`` returns (decode, then the dataset's own random transforms, drawn afresh per call).
coordl then reads and caches the raw bytes and never the decoded or augmented sample.
torchvision ``DatasetFolder``/``ImageFolder`` are recognised as they are, and so are torch's
``Subset`` (what ``random_split`` returns) and ``ConcatDataset`` of datasets coordl can cache; a dataset over others says how with
``coordl_raw_source(decode)`` (an experience stream's).
"""

import bisect
import hashlib
import io
import os
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


def part_sources(datasets, decode: bool, part: str = "part") -> tuple[list | None, str]:
    """The raw-bytes views of ``datasets`` (a dataset's parts, each named a ``part`` in errors), or (None, why one
    cannot be cached)."""
    parts = []
    for number, dataset in enumerate(datasets):
        source, why = raw_source(dataset, decode)
        if source is None:
            return None, f"its {part} {number} ({type(dataset).__name__}) cannot be cached: {why}"
        parts.append(source)
    return parts, ""


def _concat_source(dataset, decode: bool) -> tuple[RawBytesDataset | None, str]:
    if decode and (overridden := _overridden(dataset, torch.utils.data.ConcatDataset, ("__getitem__",))):
        return None, f"{type(dataset).__name__} overrides {overridden}"
    parts, why = part_sources(dataset.datasets, decode)
    return (ConcatSource(dataset, parts), "") if parts is not None else (None, why)


def raw_source(dataset, decode: bool = True) -> tuple[RawBytesDataset | None, str]:
    """How coordl reads ``dataset``'s raw bytes: (source, "") or (None, why it cannot).

    A ``Subset`` qualifies if its dataset does, a ``ConcatDataset`` if each of its datasets does.
    With ``decode=False`` (the DALI backend, which decodes itself) only the files matter, so any
    ``DatasetFolder`` qualifies, whatever its loader, and overridden ``__getitem__`` methods do not
    matter.
    """
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return None, "it is an IterableDataset (samples have no index to cache by)"
    view = getattr(type(dataset), "coordl_raw_source", None)  # a dataset over other datasets (a stream's)
    if view is not None:
        return view(dataset, decode)
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


IDENTITY_SAMPLES = 1024
"""How many of a dataset's keys, evenly spaced, name its cache (see :func:`dataset_identity`)."""


def dataset_identity(source: RawBytesDataset, *, local: bool, content: bool = False) -> bytes:
    """32 bytes naming the files ``source`` reads: the name of their node-wide cache, and what jobs of an
    hp_group compare. Costs a few milliseconds whatever the dataset's size (without ``content``).

    With ``local`` (keys are file paths), hashes the number of samples and :data:`IDENTITY_SAMPLES`
    evenly spaced keys (the first and last included), each as its physical path (its directory
    resolved, so relative paths, other working directories and links to folders are told apart or
    agree as the files they name) with its stat (inode, device, size, ctime): a dataset rewritten in
    place gets a new cache. Sharing a name is only a matter of efficiency: each cached item is checked
    against its file when it is served (see ``CachedDataset.fetch``), so the files not sampled need no
    stat here. Keys of another storage are served unchecked, so every key is hashed, as given (no
    stat). ``content`` also hashes every file's bytes, which reads the whole dataset (slow).
    """
    n = len(source)
    digest = hashlib.blake2b(f"{n}\n".encode(), digest_size=32)
    positions = range(n) if n <= IDENTITY_SAMPLES or not local else \
        sorted({i * (n - 1) // (IDENTITY_SAMPLES - 1) for i in range(IDENTITY_SAMPLES)})
    cwd, real_dirs = os.getcwd(), {}
    for i in positions:
        key = os.fspath(source.raw_key(i))
        if local:
            parent, name = os.path.split(os.path.join(cwd, key))  # not normalized: ".." after a link is physical
            if parent not in real_dirs:
                real_dirs[parent] = os.path.realpath(parent)
            key = f"{os.path.join(real_dirs[parent], name)}\0{_stat_line(key)}"
        digest.update(f"{key}\n".encode("utf-8", "surrogateescape"))
    if content:
        for i in range(n):
            digest.update(_content_digest(source.raw_key(i)))
    return digest.digest()


def _stat_line(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return "missing"
    return f"{st.st_ino} {st.st_dev} {st.st_size} {st.st_ctime_ns}"


def _content_digest(path: str) -> bytes:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except OSError:
        return b"unreadable"
    return digest.digest()
