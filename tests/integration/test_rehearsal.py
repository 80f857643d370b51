"""Rehearsal end to end: a stream of JPEG folders, torch's workers, the node's cache, and the block device an
earlier experience lives on, which replaying it never reads."""

import json
import os
import shutil
import zlib

import numpy as np
import pytest
import torch
import torchvision.transforms as T

import coordl
from coordl._demo.synthetic import make_image_folder
from harness.cluster import make_cluster  # noqa: F401  (a fixture)
from harness.storage_env import LOOP_TOOLS, Cleanup, copy_to_loop_disk, evict_files
from tests.unit.test_rehearsal import chi_square, chi_square_bound

needs_loop = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/loop-control") or not all(map(shutil.which, LOOP_TOOLS)),
    reason="needs root, loop devices and " + ", ".join(LOOP_TOOLS) + ": experience 0 lives on a loop-mounted ext4")

NOISY = T.Compose([T.Resize((16, 16)), T.ToTensor(), T.Lambda(lambda x: x + torch.rand(()))])  # fresh every call


def _sectors_read(loop: str) -> int:
    with open(f"/sys/block/{os.path.basename(loop)}/stat") as f:
        return int(f.read().split()[2])


def _stream(roots) -> coordl.ExperienceStream:
    """Each folder's JPEGs an experience, each sample's target its number in the stream (so a replay names the
    sample it replays)."""
    parts, first = [], 0
    for root in roots:
        files = sorted(os.path.join(folder, name) for folder, _, names in os.walk(root) for name in names)
        parts.append(coordl.FileDataset(files, targets=list(range(first, first + len(files))), transform=NOISY))
        first += len(files)
    return coordl.ExperienceStream(parts, tagged=True)


def _experience_folders(tmp_path) -> list[str]:
    roots = []
    for number in range(3):
        root = str(tmp_path / f"experience{number}")
        make_image_folder(root, 40, n_classes=2, mean_side_px=64, seed=number)
        roots.append(root)
    return roots


@needs_loop
def test_replaying_an_earlier_experience_reads_nothing_from_its_device(tmp_path):
    roots = _experience_folders(tmp_path)
    with Cleanup() as cleanup:
        (tmp_path / "loop").mkdir()
        disk = copy_to_loop_disk(cleanup, str(tmp_path / "loop"), roots[0])
        evict_files(disk.root)
        stream = _stream([disk.root, *roots[1:]])
        rehearsal = coordl.Rehearsal(24, "experience_balanced", per_batch=4, seed=0)
        replays: dict[int, list[torch.Tensor]] = {}
        reads = []
        with coordl.DataLoader(stream, batch_size=8, shuffle=True, num_workers=2, rehearsal=rehearsal) as loader:
            for experience in stream:
                before = _sectors_read(disk.loop)
                for _ in range(2):
                    for x, y, replayed, number in loader:
                        assert (int(replayed.sum()), len(x)) in ((0, 8), (4, 12))
                        assert (number[:8] == experience.number).all()
                        for sample, index, was in zip(x, y.tolist(), replayed):
                            if was and index < 40:
                                replays.setdefault(index, []).append(sample)
                reads.append(_sectors_read(disk.loop) - before)
            epochs, held = loader.stats().epochs, loader.stats().rehearsal
        assert reads[0] > 0 and reads[1:] == [0, 0]  # experience 0 was read once, then only replayed
        assert [e.misses for e in epochs] == [40, 0, 40, 0, 40, 0]  # replays are hits: no storage read
        assert [e.replayed for e in epochs] == [0, 20, 20, 20, 20, 20]
        assert held["experiences"] == {0: 8, 1: 8, 2: 8} and held["uncached"] == 0 and held["bytes"] > 0
        twice = [samples for samples in replays.values() if len(samples) > 1]
        assert twice
        for first, again in (samples[:2] for samples in twice):  # the same image, augmented afresh
            offset = first - again
            assert not torch.equal(first, again) and torch.allclose(offset, offset.flatten()[0], atol=1e-5)

        evict_files(disk.root)  # uncached, the replays of experience 0 read its device: the check can fail
        stream = _stream([disk.root, *roots[1:]])
        with coordl.DataLoader(stream, batch_size=8, num_workers=2, cache_bytes=0, drop_page_cache=True,
                               rehearsal=coordl.Rehearsal(24, per_batch=4, seed=0)) as loader:
            list(loader)
            stream.current = 1
            before = _sectors_read(disk.loop)
            list(loader)
            assert _sectors_read(disk.loop) - before > 0


def _two_servers(make_cluster, tmp_path, *args) -> tuple[list[dict], list[int]]:
    """``tests/_rehearsal_job.py`` on two servers of a rank each (``args`` after its folders and output): each
    rank's report, and every stream sample's crc32."""
    from tests import _rehearsal_job as job
    roots = []
    for number, n in enumerate((64, 192)):
        roots.append(str(tmp_path / f"experience{number}"))
        make_image_folder(roots[-1], n, n_classes=2, mean_side_px=48, seed=number)
    files = [sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names) for root in roots]
    crcs = [zlib.crc32(open(path, "rb").read()) for path in files[0] + files[1]]
    out = str(tmp_path / "out")
    os.makedirs(out)
    cluster = make_cluster(2)
    cluster.launch_all(job.__file__, [*roots, out, *map(str, args)], nproc=1,
                       env={"COORDL_PEER_SECRET": "rehearsal-test", "COORDL_PEER_TIMEOUT_S": "10"})
    assert cluster.wait(240) == [0, 0], "\n".join(cluster.log(n)[-3000:] for n in range(2))
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    cluster.close()
    return ranks, crcs


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_servers_replay_the_union_of_their_buffers_through_each_other_s_caches(make_cluster, tmp_path):
    from tests import _rehearsal_job as job
    ranks, crcs = _two_servers(make_cluster, tmp_path)
    assert ranks[0]["members"] == ranks[1]["members"]  # every rank holds every rank's buffer, alike
    union = ranks[0]["members"][0]
    assert len(union) == job.CAPACITY and all(i < 64 for i in union)
    draws = dict.fromkeys(union, 0)
    for rank in ranks:
        for number, epoch in enumerate(rank["epochs"]):
            for batch in epoch:
                assert all(crcs[i] == c for i, c in batch)  # every sample's own bytes, replayed or new
                replayed = batch[job.BATCH:]
                assert len(replayed) == (0 if number == 0 else job.REPLAYED)
                if number == 1:  # the buffer as experience 0 left it
                    for i, _ in replayed:
                        draws[i] += 1
        first = rank["stats"][1]  # experience 1's first epoch: its new samples come from storage, replays never
        assert first["misses"] == 96 and first["storage_bytes"] > 0
        assert 0 < first["peer_hits"] <= job.REPLAYED * first["batches"]  # the other server's exemplars
    counts = np.array(list(draws.values()), dtype=float)
    assert chi_square(counts) < chi_square_bound(len(counts) - 1)


def test_the_dali_backend_prepares_each_batch_s_new_and_replayed_samples(tmp_path):
    pytest.importorskip("nvidia.dali")
    roots = _experience_folders(tmp_path)[:2]
    parts, first = [], 0
    for root in roots:  # each sample's label its number in the stream, so a batch says which samples it holds
        files = sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names)
        parts.append(coordl.FileDataset(files, targets=list(range(first, first + len(files)))))
        first += len(files)
    stream = coordl.ExperienceStream(parts)
    rehearsal = coordl.Rehearsal(12, per_batch=4, seed=0)
    with coordl.DataLoader(stream, batch_size=8, shuffle=True, num_workers=2, backend="dali", cache_bytes="auto",
                           rehearsal=rehearsal) as loader:
        for experience in stream:
            members = set(rehearsal.members())
            labels = [batch_labels.tolist() for _, batch_labels in loader]
            new = sorted(i for batch in labels for i in batch[:8])
            assert new == list(range(experience.start, experience.stop))
            assert all(len(batch) == (8 if experience.number == 0 else 12) for batch in labels)
            assert all(set(batch[8:]) <= members for batch in labels)
        assert loader.stats().epochs[-1].replayed == 20


def _byte_stream(roots, **options) -> tuple[coordl.ExperienceStream, list[int]]:
    """Each folder's files an experience of raw bytes, each sample's target its number in the stream; and each
    file's crc32."""
    parts, crcs = [], []
    for root in roots:
        files = sorted(os.path.join(folder, name) for folder, _, names in os.walk(root) for name in names)
        parts.append(coordl.FileDataset(files, targets=list(range(len(crcs), len(crcs) + len(files))), decode="bytes"))
        crcs += [zlib.crc32(open(path, "rb").read()) for path in files]
    return coordl.ExperienceStream(parts, **options), crcs


@pytest.mark.parametrize("exemplar_bytes", ["auto", 0])
def test_exemplars_the_full_cache_cannot_hold_are_kept_in_their_own_region_and_replays_read_no_storage(
        tmp_path, exemplar_bytes):
    roots = _experience_folders(tmp_path)
    stream, crcs = _byte_stream(roots, tagged=True)
    first = sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(roots[0]) for f in names)
    rehearsal = coordl.Rehearsal(24, "experience_balanced", per_batch=4, seed=0, exemplar_bytes=exemplar_bytes)
    with coordl.DataLoader(stream, batch_size=8, shuffle=True, num_workers=2, cache_bytes=first,
                           rehearsal=rehearsal, collate_fn=lambda batch: batch) as loader:
        for experience in stream:
            for _ in range(2):
                for batch in loader:
                    assert all(zlib.crc32(raw) == crcs[i] for raw, i, _, _ in batch)  # each sample's own bytes
            members = rehearsal.members()
        stats = loader.stats()
    held = stats.rehearsal
    misses = [e.misses for e in stats.epochs]
    assert [e.replayed for e in stats.epochs] == [0, 20, 20, 20, 20, 20]
    outside = [i for i in members if i >= 40]  # the cache holds experience 0 alone
    assert sorted(held["experiences"].items()) == [(0, 8), (1, 8), (2, 8)] and len(outside) == 16
    if exemplar_bytes == 0:  # the check can fail: replays of later experiences' exemplars are storage reads
        assert held["region"] is None and held["uncached"] == 16
        assert misses[:3] == [40, 0, 40] and all(m > 40 for m in misses[3:])
        return
    # the new samples the cache and the region do not hold, no replay: experience 1 left 12 members, 2 left 8
    assert misses == [40, 0, 40, 40 - 12, 40, 40 - 8]
    region = held["region"]
    assert region["items"] == 16 and held["uncached"] == 0 and region["refused"] == 0  # members the cache lacks
    assert region["bytes"] == sum(os.path.getsize(stream.experience(1 + (i >= 80)).dataset.files[i % 40])
                                  for i in outside) <= region["bound"]
    assert coordl._core.shm.list_segments("exemplars") == []  # gone with the loader


def test_a_buffer_whose_exemplars_would_not_fit_in_shared_memory_is_refused_at_construction(tmp_path):
    files = []
    for i in range(20):
        files.append(str(tmp_path / f"{i}.bin"))
        with open(files[-1], "wb") as f:
            f.write(os.urandom(50_000))
    stream = coordl.ExperienceStream([coordl.FileDataset(files, targets=[i % 2 for i in range(20)], decode="bytes")])
    with pytest.raises(ValueError, match=r"capacity=100 exemplars of about 48\.8 KiB each .* exemplar region of "
                                         r"4\.0 TiB .* lower the Rehearsal's capacity or exemplar_bytes"):
        coordl.DataLoader(stream, batch_size=4, cache_bytes="512KiB",
                          rehearsal=coordl.Rehearsal(100, per_batch=2, exemplar_bytes="4TiB"))
    with coordl.DataLoader(stream, batch_size=4, cache_bytes="512KiB", rehearsal=coordl.Rehearsal(100, per_batch=2)):
        assert len(coordl._core.shm.list_segments("exemplars")) == 1  # the stream's 20 fit beside the cache


def test_ranks_on_one_node_share_one_exemplar_region_and_replay_each_other_s_exemplars_from_it(tmp_path):
    roots = _experience_folders(tmp_path)[:2]
    stream, crcs = _byte_stream(roots, tagged=True)
    first = sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(roots[0]) for f in names)
    rehearsal = [coordl.Rehearsal(12, "experience_balanced", per_batch=4, seed=5) for _ in range(2)]  # one per rank
    samplers = [torch.utils.data.distributed.DistributedSampler(stream, num_replicas=2, rank=r, seed=1) for r in range(2)]
    loaders = [coordl.DataLoader(stream, batch_size=8, sampler=samplers[r], cache_bytes=first, rehearsal=rehearsal[r],
                                 collate_fn=lambda batch: batch) for r in range(2)]
    try:
        assert len(coordl._core.shm.list_segments("exemplars")) == 1
        misses = []
        for experience in stream:
            for epoch in range(2):
                for rank in range(2):
                    samplers[rank].set_epoch(epoch)
                    for batch in loaders[rank]:
                        assert all(zlib.crc32(raw) == crcs[i] for raw, i, _, _ in batch)
                misses.append(sum(loader.stats().epochs[-1].misses for loader in loaders))
        assert rehearsal[0].members() == rehearsal[1].members()
        members = rehearsal[0].members()
        assert sum(i >= 40 for i in members) == 6  # experience 1's half of the buffers, held by the region
        assert misses == [40, 0, 40, 40 - 6]  # no replay read storage, whichever rank's buffer it came from
        assert all(loader.stats().rehearsal["uncached"] == 0 for loader in loaders)
    finally:
        for loader in loaders:
            loader.close()
    assert coordl._core.shm.list_segments("exemplars") == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_servers_whose_caches_hold_nothing_serve_each_other_their_exemplar_regions(make_cluster, tmp_path):
    """Caches of 1 byte: every exemplar is in its rank's server's exemplar region, and the other server's replays
    of it (and reads of it as a new sample) are fetched from there. So storage is read exactly for the new samples
    no region holds, and the peers serve exactly the other buffer's members each epoch asks for."""
    from tests import _rehearsal_job as job
    ranks, crcs = _two_servers(make_cluster, tmp_path, 1)
    assert ranks[0]["buffers"] == ranks[1]["buffers"]
    asked_of_peers = 0
    for r, rank in enumerate(ranks):
        for number, (epoch, stats) in enumerate(zip(rank["epochs"], rank["stats"])):
            assert all(crcs[i] == c for batch in epoch for i, c in batch)
            start = rank["buffers"][number - 1] if number else [[], []]  # the buffers as the epoch began
            mine, theirs = set(start[r]), set(start[1 - r])
            new = [i for batch in epoch for i, _ in batch[:job.BATCH]]
            replayed = [i for batch in epoch for i, _ in batch[job.BATCH:]]
            assert set(replayed) <= mine | theirs
            assert stats["misses"] == sum(i not in mine | theirs for i in new), (r, number, stats)
            from_peer = sum(i in theirs for i in new + replayed)
            assert stats["peer_hits"] == from_peer, (r, number, stats)
            asked_of_peers += from_peer
    assert asked_of_peers > 0  # without the regions served, these would be storage reads: the check can fail
