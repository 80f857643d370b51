"""Collated minibatches to and from the bytes of a staging segment.

A staged batch is what ``collate_fn`` returned: tensors (or numpy arrays, numbers, strings, None) in
nested tuples, lists and dicts. Its segment holds, in order: four int64 (magic, epoch, batch id, length
of the description), a JSON description of the structure (dtype, shape and offset of each tensor, the
values of scalars; tensor offsets count from the end of the description, 64-byte aligned), then each
tensor's raw bytes. No pickled objects. A :class:`Stack` in a batch stands for the tensor that
stacking its tensors would give: :func:`write` stacks them straight into the segment.
"""

import dataclasses
import json
import math
import mmap

import numpy as np
import torch

from coordl.exceptions import StagingError

_MAGIC = int.from_bytes(b"CDLBATCH", "little")
_PREFIX_BYTES = 32
_ALIGN = 64
_SCALARS = (bool, int, float, str, type(None))
MAP_MIN_BYTES = 1 << 20
"""Tensors this large are mapped, not copied, by :func:`read` with ``map_range``: a mapping per small
tensor would cost more than copying it, and would keep a whole page (and a descriptor) alive."""


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclasses.dataclass
class Stack:
    """A batch's tensor still to be stacked from ``tensors`` (CPU, strided, one shape), as ``dtype``."""

    tensors: list[torch.Tensor]
    dtype: torch.dtype

    @property
    def shape(self) -> list[int]:
        return [len(self.tensors), *self.tensors[0].shape]


@dataclasses.dataclass
class Encoded:
    """A batch ready to be written: its description and its tensors at their offsets."""

    meta: bytes
    tensors: list[tuple[int, torch.Tensor | Stack]]
    nbytes: int


class _Layout:
    """A batch's description, built with its tensors laid out one after another (each 64-byte aligned).

    A class rather than a recursive closure: a closure that calls itself is a reference cycle, which would
    keep the batch's tensors (and the shared memory and descriptors of torch's worker tensors) until the
    garbage collector runs.
    """

    def __init__(self):
        self.tensors: list[tuple[int, torch.Tensor | Stack]] = []
        self.size = 0

    def describe(self, x):
        if isinstance(x, Stack):
            self.tensors.append((self.size, x))
            node = {"t": "tensor", "dtype": str(x.dtype).removeprefix("torch."), "shape": x.shape, "at": self.size}
            self.size += _aligned(math.prod(x.shape) * x.dtype.itemsize)
            return node
        if isinstance(x, (torch.Tensor, np.ndarray)):
            kind = "ndarray" if isinstance(x, np.ndarray) else "tensor"
            t = torch.from_numpy(np.ascontiguousarray(x)) if kind == "ndarray" else x.detach()
            if t.device.type != "cpu":
                raise TypeError(f"hp_group stages CPU tensors, but collate_fn returned one on {t.device}")
            t = t.contiguous()
            self.tensors.append((self.size, t))
            node = {"t": kind, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "at": self.size}
            self.size += _aligned(t.numel() * t.element_size())
            return node
        if type(x) in (tuple, list):
            return {"t": type(x).__name__, "items": [self.describe(v) for v in x]}
        if type(x) is dict and all(type(k) in (str, int) for k in x):
            return {"t": "dict", "keys": list(x), "items": [self.describe(v) for v in x.values()]}
        if type(x) in _SCALARS:
            return {"t": "value", "v": x}
        raise TypeError(f"hp_group stages tensors, numpy arrays, numbers and strings in (nested) tuples, lists "
                        f"and dicts, but collate_fn returned a {type(x).__qualname__}. Make collate_fn return "
                        f"those (or run without hp_group=).")


def encode(batch) -> Encoded:
    """Describe ``batch`` and lay out its tensors (and :class:`Stack` s); copies nothing.

    Raises:
        TypeError: ``batch`` holds something other than tensors, numpy arrays, scalars, strings or None
            in tuples, lists and dicts (with str or int keys), or a tensor not on the CPU.
    """
    layout = _Layout()
    meta = json.dumps(layout.describe(batch)).encode()
    data_at = _aligned(_PREFIX_BYTES + len(meta))
    return Encoded(meta, [(data_at + at, t) for at, t in layout.tensors], data_at + layout.size)


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """The bytes of contiguous CPU tensor ``t`` as a numpy array (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def write(encoded: Encoded, buf, epoch: int, batch: int, write_at=None) -> None:
    """Copy ``encoded`` into ``buf`` (a writable buffer of at least ``encoded.nbytes``), stacking its
    :class:`Stack` s there.

    The copies are numpy's, on the calling thread with the GIL released: torch's ``copy_`` would split a
    large one over its intra-op threads, whose spinning after each copy costs the training process CPU
    time that the job's workers need (a fifth of a staged batch's CPU on two cores, measured). Stacks are
    torch's: in torch's workers on their one thread (elsewhere, with ``num_workers=0`` or for batches
    taken over, on the training process's intra-op threads). With ``write_at(offset, data)``
    (``Segment.write_at``: the file behind ``buf``, a new segment or a spare one taken over, as every staging
    writer passes) the other tensors' bytes go through it instead, also with the GIL released: writing a
    segment's pages through its file spares faulting each into this process (a batch of images in a third less CPU,
    ``results/staging-cost-e49389b``)."""
    stamp(buf, epoch, batch)
    np.ndarray((1,), np.int64, buf, 24)[0] = len(encoded.meta)
    buf[_PREFIX_BYTES:_PREFIX_BYTES + len(encoded.meta)] = encoded.meta
    for at, t in encoded.tensors:
        if isinstance(t, Stack):
            count = math.prod(t.shape)
            out = torch.frombuffer(buf, dtype=t.dtype, count=count, offset=at).view(t.shape) if count else \
                torch.empty(t.shape, dtype=t.dtype)  # (empty: stacked all the same, for torch's checks)
            torch.stack(t.tensors, 0, out=out)
            continue
        n = t.numel() * t.element_size()
        if n and write_at is not None:
            write_at(at, _bytes_of(t))
        elif n:
            np.copyto(np.ndarray((n,), np.uint8, buf, at), _bytes_of(t))


def stamp(buf, epoch: int, batch: int) -> None:
    """Mark the batch in ``buf`` as batch ``batch`` of epoch ``epoch`` (what :func:`read` checks)."""
    np.ndarray((3,), np.int64, buf, 0)[:] = (_MAGIC, epoch, batch)


def read(buf, epoch: int, batch: int, pin_memory: bool = False, map_range=None):
    """The batch staged in ``buf``, in fresh tensors (pinned if asked).

    With ``map_range(offset, length)`` (a private mapping of those bytes of the segment, offset a
    multiple of the page size: ``Segment.private_map``), tensors of at least ``MAP_MIN_BYTES`` are
    views of their own mapping instead, which they keep alive; smaller ones are copied.

    Raises:
        StagingError: ``buf`` does not hold batch ``batch`` of epoch ``epoch``.
    """
    magic, got_epoch, got_batch, meta_len = (int(v) for v in np.ndarray((4,), np.int64, buf, 0))
    if magic != _MAGIC:
        raise StagingError(f"staged segment for batch {batch} of epoch {epoch} holds no staged batch")
    if (got_epoch, got_batch) != (epoch, batch):
        raise StagingError(f"staged segment holds batch {got_batch} of epoch {got_epoch}, expected batch {batch} "
                           f"of epoch {epoch}")

    def build(node):
        kind = node["t"]
        if kind in ("tensor", "ndarray"):
            dtype = getattr(torch, node["dtype"])
            numel = math.prod(node["shape"])
            start, n = data_at + node["at"], numel * dtype.itemsize
            if map_range is not None and n >= MAP_MIN_BYTES:
                page_start = start - start % mmap.ALLOCATIONGRANULARITY
                view = map_range(page_start, start + n - page_start)
                out = torch.frombuffer(view, dtype=dtype, count=numel, offset=start - page_start)
                out = out.reshape(node["shape"])
                return out.numpy() if kind == "ndarray" else out
            out = torch.empty(node["shape"], dtype=dtype, pin_memory=pin_memory)
            n = out.numel() * out.element_size()
            if n:
                np.copyto(_bytes_of(out), np.ndarray((n,), np.uint8, buf, data_at + node["at"]))
            return out.numpy() if kind == "ndarray" else out
        if kind == "tuple":
            return tuple(build(v) for v in node["items"])
        if kind == "list":
            return [build(v) for v in node["items"]]
        if kind == "dict":
            return dict(zip(node["keys"], (build(v) for v in node["items"])))
        return node["v"]

    data_at = _aligned(_PREFIX_BYTES + meta_len)
    return build(json.loads(bytes(buf[_PREFIX_BYTES:_PREFIX_BYTES + meta_len])))
