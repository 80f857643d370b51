"""Collating straight into staging segments: torch's default_collate batch, its segment's lifecycle."""

import collections
import gc
import os
import pickle

import numpy as np
import pytest
import torch
import torch.utils.data

from coordl import _batch_codec, _shm
from coordl._shm import open_unlocked, segment_path, shm_dir
from coordl.exceptions import ShmCapacityError
from coordl.staging_collate import StagingCollate, WrittenBatch

PREFIX = "cdl_0123456789ab_sw0-1f-"

SAMPLES = {
    "tensor and label": [(torch.rand(3, 5, 4), i) for i in range(4)],
    "dict of many kinds": [{"x": torch.arange(6, dtype=torch.int16).reshape(2, 3) + i, "y": float(i), "name": f"s{i}",
                            "flag": i % 2 == 0, "arr": np.full((2, 2), i, np.float64)} for i in range(3)],
    "nested lists and tuples": [[(torch.ones(2) * i, [np.int32(i), torch.zeros(0)]), torch.eye(3)[i]]
                                for i in range(3)],
    "non-contiguous and half": [(torch.rand(4, 6).t(), torch.rand(7).half()) for _ in range(5)],
    "mixed dtypes": [torch.tensor([1, 2]), torch.tensor([0.5, 1.5]), torch.tensor([True, False])],
    # int64 collated here, int32 in a worker (stacked as the first sample)
    "mixed integer widths": [torch.tensor([1, 2], dtype=torch.int32), torch.tensor([3, 4])],
    "one large tensor": [torch.rand(3, 64, 64) for _ in range(80)],  # 3.75 MiB: mapped, not copied, on read
}


def _read(written: WrittenBatch, epoch: int = 3, batch: int = 7):
    """The batch in ``written``'s segment, stamped and read back as a consumer reads a staged one."""
    segment = open_unlocked(written.name)
    try:
        _batch_codec.stamp(segment.buf, epoch, batch)
        return _batch_codec.read(segment.buf, epoch, batch, map_range=segment.private_map)
    finally:
        segment.close()


def _assert_same(got, want):
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape) == (want.dtype, want.shape)
        assert torch.equal(got, want)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            _assert_same(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _assert_same(g, w)
    else:
        assert got == want


@pytest.mark.parametrize("kind", list(SAMPLES))
def test_the_written_batch_is_default_collates_batch(kind):
    written = StagingCollate(PREFIX, "g")(SAMPLES[kind])
    _assert_same(_read(written), torch.utils.data.default_collate(SAMPLES[kind]))
    assert os.path.getsize(segment_path(written.name)) == written.nbytes
    del written
    gc.collect()
    assert not os.listdir(shm_dir())  # received here and not adopted: unlinked once garbage


class _Samples(torch.utils.data.Dataset):
    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


@pytest.mark.parametrize("kind", ["tensor and label", "mixed integer widths"])
def test_a_batch_written_in_torchs_worker_is_the_one_torchs_worker_collates(kind):
    """In a worker torch stacks as the first sample's dtype (into its shared memory); so does the write."""
    samples = SAMPLES[kind]
    want = next(iter(torch.utils.data.DataLoader(_Samples(samples), batch_size=len(samples), num_workers=1)))
    loader = torch.utils.data.DataLoader(_Samples(samples), batch_size=len(samples), num_workers=1,
                                         collate_fn=StagingCollate(PREFIX, "g"))
    written = next(iter(loader))
    if kind == "mixed integer widths":
        assert want.dtype == torch.int32
    assert isinstance(written, WrittenBatch) and written.name.startswith(f"{PREFIX}0-")
    _assert_same(_read(written), want)
    del written, loader
    gc.collect()
    assert not os.listdir(shm_dir())


def test_a_written_batch_is_owned_by_the_process_that_receives_it():
    collate = StagingCollate(PREFIX, "g")
    made = collate(SAMPLES["tensor and label"])
    made.adopted()  # as a worker's: not owned here
    sent = WrittenBatch(made.name, made.nbytes, owned=False)
    received = pickle.loads(pickle.dumps(sent))
    del made, sent
    gc.collect()
    assert os.path.exists(segment_path(received.name))  # the sender's copy removes nothing
    name = received.name
    del received
    gc.collect()
    assert not os.path.exists(segment_path(name))  # the receiver's does

    adopted = collate(SAMPLES["tensor and label"])
    os.rename(segment_path(adopted.name), segment_path("cdl_0123456789ab_s5"))
    adopted.adopted()
    del adopted
    gc.collect()
    assert os.listdir(shm_dir()) == [os.path.basename(segment_path("cdl_0123456789ab_s5"))]
    _shm.unlink_segment("cdl_0123456789ab_s5")


def test_each_tag_names_its_own_segments():
    collate = StagingCollate(PREFIX, "g")
    first = collate(SAMPLES["mixed dtypes"])
    collate.tag = 10
    second = collate(SAMPLES["mixed dtypes"])
    assert first.name.startswith(collate.tag_prefix(0)) and not first.name.startswith(collate.tag_prefix())
    assert second.name.startswith(collate.tag_prefix()) and collate.tag_prefix() == f"{PREFIX}a-"
    assert _shm.unlink_segments(collate.tag_prefix(0)) == 1
    assert os.path.exists(segment_path(second.name))


def test_samples_that_do_not_stack_raise_torchs_error_and_leave_nothing():
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        StagingCollate(PREFIX, "g")([torch.zeros(2, 3), torch.zeros(3, 3)])
    assert not os.listdir(shm_dir())


def test_a_full_shm_directory_is_named_with_the_group(monkeypatch):
    monkeypatch.setattr(_shm, "free_shm_bytes", lambda: 1000)
    with pytest.raises(ShmCapacityError, match=r"cannot write a batch of .* for hp_group 'search-7'.*1000 B free"):
        StagingCollate(PREFIX, "search-7")(SAMPLES["one large tensor"])
    assert not os.listdir(shm_dir())


def test_what_the_codec_cannot_stage_is_refused_by_name():
    point = collections.namedtuple("Point", "x y")
    with pytest.raises(TypeError, match="collate_fn returned a Point"):
        StagingCollate(PREFIX, "g")([point(torch.zeros(2), 1), point(torch.ones(2), 2)])
    assert not os.listdir(shm_dir())
