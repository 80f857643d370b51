"""Pure parts of coordinated prep: epoch plans and the staged-batch encoding."""

import gc
import mmap
import os
import secrets
import weakref

import numpy as np
import pytest
import torch

from coordl._core.shm import create_unlocked
from coordl._group import codec as _batch_codec
from coordl._group.membership import epoch_plan
from coordl.exceptions import StagingError


def test_epoch_plans_are_shared_per_epoch_and_new_each_epoch():
    first = epoch_plan(10, 3, False, True, seed=5, epoch=1)
    assert first == epoch_plan(10, 3, False, True, seed=5, epoch=1)  # every member computes the same plan
    assert [len(b) for b in first] == [3, 3, 3, 1]
    assert sorted(i for b in first for i in b) == list(range(10))
    assert first != epoch_plan(10, 3, False, True, seed=5, epoch=2)
    assert [len(b) for b in epoch_plan(10, 3, True, True, seed=5, epoch=1)] == [3, 3, 3]
    assert epoch_plan(5, 2, False, False, seed=5, epoch=3) == [[0, 1], [2, 3], [4]]


def _shm_full(size: int, free: int) -> Exception:
    return AssertionError(f"/dev/shm cannot hold a test segment of {size} bytes ({free} free)")


def _round_trip(batch, epoch=2, batch_id=7, mapped=False, through_file=False):
    encoded = _batch_codec.encode(batch)
    segment = create_unlocked(f"cdl_test_{secrets.token_hex(4)}_s0", encoded.nbytes, _shm_full)
    try:
        _batch_codec.write(encoded, segment.buf, epoch, batch_id, write_at=segment.write_at if through_file else None)
        return _batch_codec.read(segment.buf, epoch, batch_id, map_range=segment.private_map if mapped else None)
    finally:
        segment.unlink()
        segment.close()  # mapped tensors keep their own mappings


@pytest.mark.parametrize("through_file", [False, True])
@pytest.mark.parametrize("mapped", [False, True])
def test_staged_batches_keep_structure_dtypes_and_values(mapped, through_file, monkeypatch):
    monkeypatch.setattr(_batch_codec, "MAP_MIN_BYTES", 1)  # with mapped=True, map every non-empty tensor
    batch = (torch.randn(3, 4), torch.arange(5), torch.randn(4, 4).t(), torch.zeros(0),
             torch.randn(2, 2).to(torch.bfloat16), torch.tensor(True),
             {"names": ["a", "b"], 3: np.arange(6, dtype=np.float16).reshape(2, 3), "none": None, "x": 1.5})
    out = _round_trip(batch, mapped=mapped, through_file=through_file)
    assert isinstance(out, tuple) and len(out) == len(batch)
    for got, want in zip(out[:6], batch[:6]):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert out[6]["names"] == ["a", "b"] and out[6]["none"] is None and out[6]["x"] == 1.5
    assert isinstance(out[6][3], np.ndarray) and np.array_equal(out[6][3], batch[6][3])


def test_a_batch_written_through_the_file_survives_short_writes(monkeypatch):
    """``Segment.write_at`` goes on where ``pwrite`` stopped: here it writes at most 1000 bytes a call."""
    from coordl._core import shm as _shm

    pwrite = os.pwrite
    monkeypatch.setattr(_shm.os, "pwrite", lambda fd, data, offset: pwrite(fd, bytes(data[:1000]), offset))
    batch = (torch.randn(3, 50, 7), torch.arange(900))
    out = _round_trip(batch, through_file=True)
    assert all(torch.equal(got, want) for got, want in zip(out, batch))


def test_a_write_through_the_file_that_makes_no_progress_fails_instead_of_spinning(monkeypatch):
    from coordl._core import shm as _shm

    monkeypatch.setattr(_shm.os, "pwrite", lambda fd, data, offset: 0)
    with pytest.raises(OSError, match="nothing written at offset"):
        _round_trip((torch.randn(4, 4),), through_file=True)


def test_an_encoded_batch_holds_its_arrays_only_while_referenced():
    """No reference cycle keeps a batch's memory (for torch's worker tensors: shared memory and a descriptor
    each) until the garbage collector runs."""
    images = np.ones((2, 3), np.float32)  # the tensor made from it holds a reference to it
    gone = weakref.ref(images)
    gc.disable()
    try:
        encoded = _batch_codec.encode({"images": images, "labels": [torch.arange(2)]})
        del images, encoded
        assert gone() is None
    finally:
        gc.enable()


def test_unsupported_batches_and_foreign_segments_are_refused():
    with pytest.raises(TypeError, match="collate_fn returned a set"):
        _batch_codec.encode([{1, 2}])
    encoded = _batch_codec.encode([torch.ones(2)])
    buf = mmap.mmap(-1, encoded.nbytes)
    try:
        _batch_codec.write(encoded, buf, 1, 4)
        with pytest.raises(StagingError, match="holds batch 4 of epoch 1, expected batch 5 of epoch 1"):
            _batch_codec.read(buf, 1, 5)
    finally:
        buf.close()


def test_mapped_tensors_of_a_staged_batch_outlive_it_and_keep_writes_to_themselves():
    images = torch.randn(8, 3, 128, 128)  # 1.5 MiB: mapped
    encoded = _batch_codec.encode((images, torch.arange(8)))
    segment = create_unlocked(f"cdl_test_{secrets.token_hex(4)}_s0", encoded.nbytes, _shm_full)
    _batch_codec.write(encoded, segment.buf, 1, 0)
    mine, theirs = (_batch_codec.read(segment.buf, 1, 0, map_range=segment.private_map) for _ in range(2))
    open_fds = len(os.listdir("/proc/self/fd"))
    labels = [_batch_codec.read(segment.buf, 1, 0, map_range=segment.private_map)[1] for _ in range(20)]
    assert len(os.listdir("/proc/self/fd")) == open_fds  # small tensors are copied: they hold no mapping
    segment.unlink()
    segment.close()
    mine[0].mul_(0)  # a training loop normalizing its batch in place
    assert torch.count_nonzero(mine[0]) == 0
    assert torch.equal(theirs[0], images) and torch.equal(theirs[1], torch.arange(8))
    assert all(torch.equal(l, torch.arange(8)) for l in labels)
