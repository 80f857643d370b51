"""An hp_group member's share collated straight into staging segments.

NOTE [ Written batches ]
Where a member collates with torch's ``default_collate``, its share loader collates with
:class:`StagingCollate` instead: torch's own collation (``collate`` with torch's map of collate
functions), except that each tensor it would stack is stacked straight into a new segment laid out as
``_batch_codec`` stages a batch. The worker hands over a :class:`WrittenBatch` (the segment's name and
size), and the producer stamps its batch id, renames it into the staging ring under its sequence number
and maps its own job's copy from it. The batch is thus written once, into memory allocated once; torch's
worker would write it into shared memory of its own, which the producer then copied into a new staging
segment (the training processes' share of a member's CPU, measured in ``benchmarks.coordprep``).

Written segments are named ``<group's staged prefix>w<slot>-<join ns>-<tag>-<pid>-<n>``: the member
(slot and join time), the share iterator's tag (set by the feed before each epoch's workers start),
the writing process and a counter. Where each goes:
  * adopted: renamed into the ring under its sequence number;
  * received but not adopted (an epoch left early, a batch no longer this member's, torch draining a
    persistent worker's results at the next epoch): unlinked when its :class:`WrittenBatch` is garbage;
  * never received (workers shut down with results in torch's queue): removed by the feed's sweep of
    the epoch's tag once the epoch's producer has ended and its workers are stopped (``GroupFeed``);
  * whatever is left of a member's: removed when it leaves the group or is reaped dead, and what a dead
    member's orphaned workers write after that at the next epoch's start (``_group_state``); in any case
    with the group's staged segments when its last member leaves.

A member's own batches are read back from the segment like the others': plain tensors (a sample's tensor
subclass, or its autograd history, is not kept), as every member's were before for the others' batches.
"""

import functools
import itertools
import os
import weakref

import torch
import torch.utils.data
from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate, default_collate_fn_map

from coordl._core.shm import create_unlocked, shm_dir, unlink_segment
from coordl._core.sizes import format_bytes
from coordl._group import codec as _batch_codec
from coordl.exceptions import ShmCapacityError, StagingError


class WrittenBatch:
    """A batch collated into segment ``name`` (``nbytes`` long), not yet stamped with its batch id.

    The process that receives it (unpickles it, or made it outside torch's workers) owns the segment: it
    is unlinked when this object is garbage, unless :meth:`adopted` says it now lives under another name.
    """

    def __init__(self, name: str, nbytes: int, *, owned: bool = True):
        self.name, self.nbytes = name, nbytes
        self._discard = weakref.finalize(self, unlink_segment, name) if owned else None

    def __reduce__(self):
        return WrittenBatch, (self.name, self.nbytes)

    def adopted(self) -> None:
        """The segment was renamed (into the staging ring): nothing to discard."""
        if self._discard is not None:
            self._discard.detach()


def _stack_later(batch, *, collate_fn_map=None):
    """torch's tensor collation, with plain CPU tensors left as a :class:`~coordl._group.codec.Stack` for
    :func:`~coordl._group.codec.write` to stack in place (others, and tensors that require grad, collated
    by torch, as torch collates them there)."""
    elem = batch[0]
    if type(elem) is not torch.Tensor or elem.device.type != "cpu" or elem.layout != torch.strided or \
            elem.is_nested or any(t.requires_grad for t in batch):
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    # torch stacks into its worker's shared memory as the first tensor's dtype, elsewhere as their common one
    dtype = elem.dtype if torch.utils.data.get_worker_info() is not None else \
        functools.reduce(torch.promote_types, (t.dtype for t in batch))
    return _batch_codec.Stack(list(batch), dtype)


class StagingCollate:
    """``collate_fn`` of a member's share loader: ``default_collate``'s batch, written into a new segment
    named ``prefix`` + tag, pid and count (NOTE [ Written batches ]); returns its :class:`WrittenBatch`.

    Collation is ``default_collate``'s as it stands at each call, entries added to torch's
    ``default_collate_fn_map`` included; where the entry for tensors is not torch's own, the batch is
    ``default_collate``'s, returned as is (the producer then copies it into the staging area).

    Args:
        prefix: this member's written-segment prefix (``HPGroup.written_prefix``).
        group: the group's name, for errors.
    """

    def __init__(self, prefix: str, group: str):
        self.prefix, self.group, self.tag = prefix, group, 0
        self._count = itertools.count(1)

    def __getstate__(self) -> dict:
        return {"prefix": self.prefix, "group": self.group, "tag": self.tag}  # a new process counts afresh

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"], state["group"])
        self.tag = state["tag"]

    def tag_prefix(self, tag: int | None = None) -> str:
        """The prefix of the segments written under ``tag`` (the current one by default)."""
        return f"{self.prefix}{self.tag if tag is None else tag:x}-"

    def __call__(self, samples):
        if default_collate_fn_map.get(torch.Tensor) is not collate_tensor_fn:
            return default_collate(samples)
        encoded = _batch_codec.encode(collate(samples, collate_fn_map={**default_collate_fn_map,
                                                                       torch.Tensor: _stack_later}))
        name = f"{self.tag_prefix()}{os.getpid():x}-{next(self._count):x}"
        segment = create_unlocked(name, max(encoded.nbytes, 1), self._full)
        if segment is None:
            raise StagingError(f"internal error: written batch segment {name} already exists")
        try:
            _batch_codec.write(encoded, segment.buf, -1, -1, write_at=segment.write_at)
        except BaseException:
            segment.unlink()
            raise
        finally:
            segment.close()
        return WrittenBatch(name, encoded.nbytes, owned=torch.utils.data.get_worker_info() is None)

    def _full(self, size: int, free: int) -> ShmCapacityError:
        return ShmCapacityError(
            f"{shm_dir()} is full: cannot write a batch of {format_bytes(size)} for hp_group {self.group!r} "
            f"({format_bytes(free)} free; the batches in flight are num_workers × prefetch_factor). Pass a "
            f"smaller hp_staging_bytes=, prefetch_factor or batch_size, free it (`coordl cache ls`, `coordl group "
            f"ls`), or enlarge it (docker: --shm-size).")
