"""The disk tier's format, one dataset's cache, the shared folder's quota and the tier's read path, in one
process (and a child where a live user is the point)."""

import logging
import multiprocessing as mp
import os
import random
import signal
import threading
import time

import numpy as np
import pytest

from coordl._disk import format as fmt
from coordl._disk.cache import CORRUPT, INDEX, DiskCache, DiskCacheMismatch, pack_name
from coordl._disk.folder import folder_of, list_disk_caches, remove, room_for
from coordl._disk.reading import READING
from coordl._disk.tier import DiskTier
from coordl._fetch.cached_dataset import COUNTER_FIELDS, SampleCounters
from coordl._fetch.storage import FileStorage
from tests._signals import FileEvent


def _cache(folder, n=100, identity="ds") -> DiskCache:
    return DiskCache(str(folder), identity=identity, n_items=n, label=f"test {identity}")


def _items(n, seed=0, sizes=(0, 9000)):
    rng = random.Random(seed)
    return [(f"/data/{k:05d}.jpg", rng.randbytes(rng.randint(*sizes)), (k, 1, 7)) for k in range(n)]


def test_replay_of_every_prefix_of_an_index_gives_whole_groups_only():
    groups = [np.array([(k * 10 + j, 0, 4, 4096 * j, 5, (1, 2, 3), 99) for j in range(k + 1)], dtype=fmt.RECORD)
              for k in range(4)]
    data = fmt.INDEX_MAGIC + b"".join(fmt.group_bytes(g) for g in groups)
    ends = [len(fmt.INDEX_MAGIC)]
    for g in groups:
        ends.append(ends[-1] + fmt.GROUP.size + len(g) * fmt.RECORD.itemsize)
    for cut in range(len(fmt.INDEX_MAGIC), len(data) + 1):
        records, end = fmt.replay(data[:cut], len(fmt.INDEX_MAGIC))
        whole = max(k for k, e in enumerate(ends) if e <= cut)
        assert end == ends[whole] and len(records) == sum(len(g) for g in groups[:whole])


def test_a_flipped_bit_in_a_group_ends_the_replay_before_it():
    groups = [np.array([(j, 0, 4, 0, 5, (1, 2, 3), 99)], dtype=fmt.RECORD) for j in range(3)]
    data = bytearray(fmt.INDEX_MAGIC + b"".join(fmt.group_bytes(g) for g in groups))
    second = len(fmt.INDEX_MAGIC) + fmt.GROUP.size + fmt.RECORD.itemsize
    for at in range(second, second + fmt.GROUP.size + fmt.RECORD.itemsize):
        flipped = bytearray(data)
        flipped[at] ^= 0x10
        records, end = fmt.replay(bytes(flipped), len(fmt.INDEX_MAGIC))
        assert end == second and records["digest"].tolist() == [0]


def test_items_are_read_back_whole_at_aligned_offsets_and_an_open_cache_costs_64_bytes_an_item(tmp_path):
    items = _items(300)
    writer = _cache(tmp_path / "c", n=300)
    assert writer.append(items) > 0
    reader = _cache(tmp_path / "c", n=300)  # another opener replays the index
    assert reader.items() == 300
    for key, data, stamp in items:
        record = reader.record(key)
        assert int(record["offset"]) % fmt.ALIGN == 0 and tuple(record["stamp"]) == stamp
        assert bytes(reader.read(key, record)) == data
    assert reader._records.nbytes == 300 * 64 and fmt.RECORD.itemsize == 64
    assert reader.record("/data/absent.jpg") is None


def test_an_item_is_written_once_per_stamp_and_the_latest_stamp_wins(tmp_path):
    cache = _cache(tmp_path / "c")
    (key, data, stamp), = _items(1)
    assert cache.append([(key, data, stamp)]) > 0
    assert cache.append([(key, data, stamp)]) == 0  # held with that stamp: not written again
    size = os.path.getsize(tmp_path / "c" / INDEX)
    assert cache.append([(key, b"edited", (0, 2, 6))]) > 0
    assert os.path.getsize(tmp_path / "c" / INDEX) > size
    for opener in (cache, _cache(tmp_path / "c")):
        record = opener.record(key)
        assert tuple(record["stamp"]) == (0, 2, 6) and bytes(opener.read(key, record)) == b"edited"


def test_every_flipped_byte_of_an_item_is_detected_and_never_served(tmp_path):
    items = _items(40, sizes=(1, 3000))
    cache = _cache(tmp_path / "c")
    cache.append(items)
    rng = random.Random(1)
    pack = tmp_path / "c" / pack_name(0)
    for key, data, _ in rng.sample(items, 20):
        record = cache.record(key)
        at = int(record["offset"]) + rng.randrange(fmt.item_span(record))  # header, key or data
        with open(pack, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))
        fresh = _cache(tmp_path / "c")
        assert fresh.read(key, fresh.record(key)) is CORRUPT
        assert fresh.record(key) is None  # no longer found: read from storage, written again
        with open(pack, "r+b") as f:  # put it back for the next trial
            f.seek(at)
            f.write(byte)


def test_a_torn_index_tail_loses_only_uncommitted_groups_and_the_next_writer_cuts_it(tmp_path):
    items = _items(30)
    cache = _cache(tmp_path / "c")
    for k in range(3):
        cache.append(items[10 * k:10 * k + 10])
    index = tmp_path / "c" / INDEX
    whole = index.read_bytes()
    group = fmt.GROUP.size + 10 * fmt.RECORD.itemsize
    rng = random.Random(2)
    for _ in range(20):
        cut = rng.randrange(len(fmt.INDEX_MAGIC), len(whole))
        index.write_bytes(whole[:cut])
        opened = _cache(tmp_path / "c")
        committed = (cut - len(fmt.INDEX_MAGIC)) // group
        assert opened.items() == 10 * committed
        for key, data, _ in items[:10 * committed]:
            assert bytes(opened.read(key, opened.record(key))) == data
        assert all(opened.record(key) is None for key, _, _ in items[10 * committed:])
    index.write_bytes(whole[:len(whole) - 5])  # the last group torn
    writer = _cache(tmp_path / "c")
    writer.append(items[20:])
    assert len(index.read_bytes()) == len(whole)  # cut back to the committed groups, then the group again
    reopened = _cache(tmp_path / "c")
    assert reopened.items() == 30 and all(bytes(reopened.read(k, reopened.record(k))) == d for k, d, _ in items)


def test_a_torn_pack_tail_is_caught_by_the_item_check(tmp_path):
    items = _items(10)
    cache = _cache(tmp_path / "c")
    cache.append(items)
    pack = tmp_path / "c" / pack_name(0)
    last = cache.record(items[-1][0])
    os.truncate(pack, int(last["offset"]) + fmt.item_span(last) // 2)
    fresh = _cache(tmp_path / "c")
    assert fresh.read(items[-1][0], fresh.record(items[-1][0])) is CORRUPT
    assert bytes(fresh.read(items[0][0], fresh.record(items[0][0]))) == items[0][1]


def test_a_reader_learns_what_another_process_committed(tmp_path):
    reader = _cache(tmp_path / "c")
    assert reader.items() == 0
    child = mp.get_context("fork").Process(target=_append_items, args=(str(tmp_path / "c"), 5))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    reader._caught_up_at = 0.0
    assert all(reader.record(key) is not None for key, _, _ in _items(5))


def _append_items(folder, n):
    _cache(folder).append(_items(n))


def test_a_folder_holding_another_datasets_cache_is_refused(tmp_path):
    _cache(tmp_path / "c", n=100).items()
    with pytest.raises(DiskCacheMismatch, match="100 items"):
        _cache(tmp_path / "c", n=101).items()


def test_a_short_quota_removes_the_least_recently_used_dataset_no_process_has_open(tmp_path):
    root = str(tmp_path)
    caches = {name: _cache(folder_of(root, name), identity=name) for name in ("old", "older", "held")}
    for k, name in enumerate(("older", "old", "held")):
        caches[name].append(_items(20, seed=k))
        os.utime(os.path.join(folder_of(root, name), "meta.json"), (1000 + k, 1000 + k))
    for name in ("old", "older"):
        caches[name].close()
    os.utime(os.path.join(folder_of(root, "held"), "meta.json"), (1, 1))  # the least recent, but in use
    new = _cache(folder_of(root, "new"), identity="new")
    new.items()
    sizes = {c.label: c.bytes_on_disk for c in list_disk_caches(root)}
    used, one = sum(sizes.values()), sizes["test older"]
    assert room_for(root, new.folder, one, quota=used + one) == one  # room: nothing removed
    assert len(list_disk_caches(root)) == 4
    assert room_for(root, new.folder, one, quota=used) == one
    left = {c.label for c in list_disk_caches(root)}
    assert left == {"test old", "test held", "test new"}  # "older" went: the least recent not in use
    assert room_for(root, new.folder, 10 * used, quota=used) < 10 * used  # "old" went too, then no more
    assert {c.label for c in list_disk_caches(root)} == {"test held", "test new"}
    assert not remove(caches["held"].folder)


def _storage_with_files(tmp_path, n=12):
    folder = tmp_path / "files"
    folder.mkdir()
    for k in range(n):
        (folder / f"{k}.bin").write_bytes(os.urandom(100 + k))
    return [str(folder / f"{k}.bin") for k in range(n)]


class _Counted:
    def __init__(self):
        self.counters = SampleCounters(1)

    def count(self, name):
        return self.counters.totals()[name]


def _tier(tmp_path, files):
    tier = DiskTier(FileStorage(), _cache(tmp_path / "cache", n=len(files)), str(tmp_path), None)
    tier.counted_in = _Counted()
    return tier


def test_the_tier_serves_what_it_wrote_and_reads_an_edited_file_fresh(tmp_path):
    files = _storage_with_files(tmp_path)
    tier = _tier(tmp_path, files)
    for key in files:
        assert tier.read_stamped(key)[0] == open(key, "rb").read()
    tier.flush()
    assert all(tier.holds(key) for key in files)
    again = _tier(tmp_path, files)  # the next job
    assert [again.read(key) for key in files] == [open(key, "rb").read() for key in files]
    assert again.counted_in.count("disk_hits") == len(files)
    with open(files[3], "wb") as f:
        f.write(b"new bytes, same file")
    assert again.read(files[3]) == b"new bytes, same file" and not again.holds(files[3])
    assert again.counted_in.count("disk_hits") == len(files)  # not served from disk


def test_a_corrupt_item_is_counted_and_read_from_storage(tmp_path):
    files = _storage_with_files(tmp_path)
    tier = _tier(tmp_path, files)
    [tier.read(key) for key in files]
    tier.flush()
    record = tier.cache.record(files[5])
    original = open(files[5], "rb").read()
    with open(tmp_path / "cache" / pack_name(0), "r+b") as f:
        f.seek(int(record["offset"]) + fmt.item_span(record) - 1)
        f.write(b"\xff" if original[-1:] != b"\xff" else b"\x00")
    again = _tier(tmp_path, files)
    assert again.read(files[5]) == original
    assert again.counted_in.count("corrupt") == 1 and again.counted_in.count("disk_hits") == 0
    # cache_dir_verify="none": the item's header and key are checked, its bytes' checksum is not
    unchecked = DiskTier(FileStorage(), _cache(tmp_path / "cache", n=len(files)), str(tmp_path), None, "none")
    unchecked.counted_in = _Counted()
    assert unchecked.read(files[5])[:-1] == original[:-1] and unchecked.read(files[5]) != original
    assert unchecked.read(files[4]) == open(files[4], "rb").read()
    assert unchecked.counted_in.count("corrupt") == 0 and unchecked.counted_in.count("disk_hits") == 3


class _Keys:
    def __init__(self, files):
        self.files = files

    def __len__(self):
        return len(self.files)

    def raw_key(self, i):
        return self.files[i]


def test_a_peer_server_sees_and_gets_what_the_disk_holds_current_and_whole_counted_nowhere(tmp_path):
    files = _storage_with_files(tmp_path)
    tier = _tier(tmp_path, files)
    for key in files[:8]:
        tier.read(key)
    tier.flush()
    server = _tier(tmp_path, files)  # the peer server's process
    assert server.held_mask(_Keys(files)).tolist() == [True] * 8 + [False] * 4
    raw, stamp = server.peek(files[2])
    assert raw == open(files[2], "rb").read() and stamp == FileStorage().stamp(files[2])
    assert server.peek(files[9]) is None
    with open(files[3], "wb") as f:
        f.write(b"edited")
    assert server.peek(files[3]) is None  # a stale copy is not served
    record = server.cache.record(files[4])
    with open(tmp_path / "cache" / pack_name(0), "r+b") as f:
        f.seek(int(record["offset"]) + fmt.item_span(record) - 1)
        f.write(b"\xff" if open(files[4], "rb").read()[-1:] != b"\xff" else b"\x00")
    assert server.peek(files[4]) is None  # nor a corrupt one
    assert sum(server.counted_in.counters.totals().values()) == 0


def test_a_failing_disk_turns_the_tier_off_with_one_warning(tmp_path, caplog, monkeypatch):
    files = _storage_with_files(tmp_path)
    tier = _tier(tmp_path, files)
    [tier.read(key) for key in files]
    tier.flush()

    def failing(*args, **kwargs):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(os, "pread", failing)
    with caplog.at_level(logging.WARNING, logger="coordl._disk.tier"):
        assert [tier.read(key) for key in files] == [open(key, "rb").read() for key in files]
    warnings = [r for r in caplog.records if "turned off" in r.getMessage()]
    assert len(warnings) == 1 and "Input/output error" in warnings[0].getMessage()
    assert tier.counted_in.count("disk_hits") == 0 and tier.off[0] == 1


def test_disk_counters_are_columns_of_the_sample_counters_and_taken_out_of_the_misses():
    counters = SampleCounters(1)
    row = counters.row()
    row[COUNTER_FIELDS.index("misses")] += 5
    row[COUNTER_FIELDS.index("storage_bytes")] += 500
    row[COUNTER_FIELDS.index("disk_hits")] += 2
    row[COUNTER_FIELDS.index("disk_bytes")] += 200
    totals = counters.totals()
    assert (totals["misses"], totals["storage_bytes"], totals["disk_hits"]) == (3, 300, 2)


def test_two_threads_learning_the_index_at_once_learn_each_group_once(tmp_path, monkeypatch):
    """Forced: the first thread in ``_catch_up`` waits inside the replay for a second one to arrive, which the
    cache's lock keeps out; without the lock both would replay the same tail and advance twice."""
    import threading
    writer, reader = _cache(tmp_path / "c"), _cache(tmp_path / "c")
    reader.items()
    writer.append(_items(10))
    arrived, replay = threading.Barrier(2, timeout=0.3), fmt.replay

    def waiting_replay(*args):
        try:
            arrived.wait()
        except threading.BrokenBarrierError:
            pass
        return replay(*args)
    monkeypatch.setattr(fmt, "replay", waiting_replay)
    threads = [threading.Thread(target=reader._catch_up, kwargs={"force": True}) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert reader._replayed_to == os.path.getsize(tmp_path / "c" / INDEX)
    assert reader.items() == 10


class _Immutable:
    """A storage that stamps nothing: ``read`` only."""

    def __init__(self, files):
        self.reads = 0

    def read(self, key):
        self.reads += 1
        with open(key, "rb") as f:
            return f.read()


def test_a_storage_that_stamps_nothing_is_cached_in_memory_and_on_disk(tmp_path):
    import zlib

    import coordl
    files = _storage_with_files(tmp_path, n=20)
    runs = []
    for _ in range(2):
        storage = _Immutable(files)
        loader = coordl.DataLoader(coordl.FileDataset(files, decode=zlib.crc32), batch_size=5, storage=storage,
                                   cache_bytes=10**6, cache_dir=str(tmp_path / "disk"), collate_fn=list)
        assert getattr(loader.dataset.storage, "read_stamped", "absent") is None  # as its storage: no stamps
        epochs = [sorted(x for batch in loader for x in batch) for _ in range(2)]
        runs.append((epochs, loader.stats().epochs, storage.reads))
        loader.close()
    crcs = sorted(zlib.crc32(open(f, "rb").read()) for f in files)
    assert all(epoch == crcs for epochs, _, _ in runs for epoch in epochs)
    (_, first, reads_first), (_, second, reads_second) = runs
    assert reads_first == 20 and (first[1].hits, first[1].misses) == (20, 0)  # memory took them
    assert reads_second == 0 and (second[0].disk_hits, second[0].misses) == (20, 0)  # the disk kept them


def _open_in(folder) -> list[str]:
    """The files under ``folder`` this process holds open."""
    paths = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        if path.startswith(str(folder)):
            paths.append(path)
    return paths


def test_a_closed_loader_holds_no_file_of_its_disk_cache_open(tmp_path):
    import zlib

    import coordl
    files = _storage_with_files(tmp_path, n=20)
    for job in range(2):  # the one that fills the disk cache (claiming what it reads), the next that reads it
        loader = coordl.DataLoader(coordl.FileDataset(files, decode=zlib.crc32), batch_size=5, cache_bytes=1,
                                   cache_dir=str(tmp_path / "disk"), collate_fn=list)
        with loader:
            assert sorted(x for b in loader for x in b) == sorted(zlib.crc32(open(f, "rb").read()) for f in files)
            held = _open_in(tmp_path / "disk")
            assert held and any(path.endswith(READING) for path in held) == (job == 0)
        assert _open_in(tmp_path / "disk") == []


def test_without_cache_dir_the_storage_is_not_wrapped_so_a_hit_runs_no_code_of_the_tier(tmp_path):
    import zlib

    import coordl
    files = _storage_with_files(tmp_path, n=4)
    with coordl.DataLoader(coordl.FileDataset(files, decode=zlib.crc32), batch_size=2, collate_fn=list) as loader:
        assert type(loader.dataset.storage) is FileStorage
        [x for b in loader for x in b]
        assert loader.stats().epochs[0].disk_tier is False


def test_what_a_cache_holds_counts_a_key_written_again_once(tmp_path):
    cache = _cache(tmp_path / "c")
    items = _items(5)
    cache.append(items)
    fresh = _cache(tmp_path / "c")
    fresh.items()
    cache.append([(items[0][0], b"x" * 7, (9, 9, 7))])  # a new version of one, learnt into the dict
    fresh._caught_up_at = 0.0
    fresh.record("/data/absent")
    assert fresh.held() == (5, sum(len(d) for _, d, _ in items[1:]) + 7)


class _CountedFiles(FileStorage):
    def __init__(self):
        super().__init__()
        self.reads = mp.get_context("fork").Value("i", 0)

    def read_stamped(self, key):
        with self.reads.get_lock():
            self.reads.value += 1
        return super().read_stamped(key)


def _claim_then_fill(tmp_path, files, claimed, go) -> None:
    """Another job: claim ``files[0]``, say so, and once told, read it and write it to the disk cache."""
    tier = _tier(tmp_path, files)
    assert not tier.holds(files[0]) and tier.claims.claim(files[0])
    claimed.set()
    go.wait(30)
    tier.read_past_disk(files[0], claimed=True)
    tier.flush()


@pytest.mark.parametrize("then", ["fill", "die"])
def test_a_read_another_job_has_in_flight_waits_for_its_write_or_its_death(tmp_path, then):
    """NOTE [ Reads in flight ], forced: another process claims a key and holds it; here a read of it waits
    (reading nothing from storage) until that process has written it to the disk cache (then it is a disk hit)
    or is killed (then it is read here)."""
    files = _storage_with_files(tmp_path)
    claimed, go = FileEvent(str(tmp_path)), FileEvent(str(tmp_path))
    other = mp.get_context("fork").Process(target=_claim_then_fill, args=(tmp_path, files, claimed, go))
    other.start()
    try:
        assert claimed.wait(30), "the other job never claimed"
        tier = DiskTier(_CountedFiles(), _cache(tmp_path / "cache", n=len(files)), str(tmp_path), None)
        tier.counted_in = _Counted()
        got = []
        reader = threading.Thread(target=lambda: got.append(tier.read_stamped(files[0])[0]))
        reader.start()
        time.sleep(0.3)
        assert reader.is_alive() and tier.inner.reads.value == 0  # waiting, not reading
        if then == "fill":
            go.set()
        else:
            os.kill(other.pid, signal.SIGKILL)
        reader.join(10)
        assert not reader.is_alive() and got == [open(files[0], "rb").read()]
        assert (tier.inner.reads.value, tier.counted_in.count("disk_hits")) == ((0, 1) if then == "fill" else (1, 0))
    finally:
        go.set()
        other.join(30)
