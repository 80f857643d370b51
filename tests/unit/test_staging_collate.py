"""Collating straight into staging segments: torch's default_collate batch, its segment's lifecycle."""

import collections
import gc
import os
import pickle

import numpy as np
import pytest
import torch
import torch.utils.data
from torch.utils.data._utils.collate import default_collate_fn_map

from coordl._group import codec as _batch_codec

from coordl._core import shm as _shm
from coordl._core.shm import open_unlocked, segment_path, shm_dir
from coordl._group.feed import GroupFeed
from coordl._group.staging import StagingCollate, WrittenBatch
from coordl.exceptions import ShmCapacityError

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
    "requiring grad": [torch.rand(3, requires_grad=True) for _ in range(2)],  # collated by torch, then staged
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


@pytest.mark.parametrize("samples", [[torch.zeros(2, 3), torch.zeros(3, 3)], [torch.zeros(0), torch.zeros(3)]],
                         ids=["unequal", "an empty first"])
def test_samples_that_do_not_stack_raise_torchs_error_and_leave_nothing(samples):
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        torch.utils.data.default_collate(samples)
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        StagingCollate(PREFIX, "g")(samples)
    assert not os.listdir(shm_dir())


class _Point:
    def __init__(self, x):
        self.x = x


def test_collation_is_default_collates_as_extended_at_the_call(monkeypatch):
    """Entries added to torch's map after the collate function was made count; a tensor entry of the user's
    own gives default_collate's batch as it is (copied when staged)."""
    collate = StagingCollate(PREFIX, "g")
    monkeypatch.setitem(default_collate_fn_map, _Point, lambda batch, *, collate_fn_map: [p.x for p in batch])
    samples = [(_Point(i), torch.full((2,), i)) for i in range(3)]
    _assert_same(_read(collate(samples)), torch.utils.data.default_collate(samples))
    gc.collect()
    monkeypatch.setitem(default_collate_fn_map, torch.Tensor, lambda batch, *, collate_fn_map: len(batch))
    assert collate(samples) == torch.utils.data.default_collate(samples) == [[0, 1, 2], 3]
    assert not os.listdir(shm_dir())


def test_a_collate_function_sent_to_a_process_keeps_its_tag_and_counts_afresh():
    collate = StagingCollate(PREFIX, "g")
    collate.tag = 5
    assert collate([torch.zeros(1)]).name.endswith("-1")  # (garbage at once: unlinked)
    copy = pickle.loads(pickle.dumps(collate))
    assert (copy.prefix, copy.group, copy.tag) == (PREFIX, "g", 5)
    assert copy([torch.zeros(1)]).name.endswith("-1")  # where it runs, its own pid tells the names apart
    assert collate([torch.zeros(1)]).name.endswith("-2")
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

class _Epoch:
    """What GroupFeed reads of a CoordinatedEpoch when it retires one."""

    def __init__(self, running: bool):
        self.producer_running = running


class _Share:
    """A share iterator's worker shutdown."""

    def __init__(self):
        self.stopped = False

    def _shutdown_workers(self):
        self.stopped = True


def _feed(**loader_options) -> GroupFeed:
    feed = GroupFeed(None, None, batch_size=4, drop_last=False, shuffled=True, collate_fn=None,
                     loader_options=loader_options)
    feed._staging = StagingCollate(PREFIX, "g")
    return feed


def _left_in_queue(feed: GroupFeed, tag: int) -> str:
    """A batch written under ``tag`` that never reached the producer."""
    name = f"{feed._staging.tag_prefix(tag)}7-1"
    open(segment_path(name), "w").close()
    return os.path.basename(segment_path(name))


def test_an_ended_epochs_workers_are_stopped_and_their_unreceived_batches_removed_once_its_producer_ends():
    feed = _feed(num_workers=2)
    stuck, first = _Epoch(running=True), _Share()  # a producer that outlived its join
    feed._share_iter = (first, 1)
    in_first = _left_in_queue(feed, 1)
    feed._retire(stuck)
    assert not first.stopped and os.listdir(shm_dir()) == [in_first]  # its producer may still receive it

    second = _Share()
    feed._share_iter = (second, 2)
    _left_in_queue(feed, 2)
    feed._retire(_Epoch(running=False))
    assert second.stopped and os.listdir(shm_dir()) == [in_first]

    stuck.producer_running = False
    feed._retire(None)  # any later retirement (an epoch's end, or close)
    assert first.stopped and not os.listdir(shm_dir())


def test_persistent_workers_are_kept_and_left_to_torchs_drain():
    feed = _feed(num_workers=2, persistent_workers=True)
    share = _Share()
    feed._share_iter = (share, 0)
    written = _left_in_queue(feed, 0)
    feed._retire(_Epoch(running=False))
    assert not share.stopped and os.listdir(shm_dir()) == [written]
    os.unlink(segment_path(written))
