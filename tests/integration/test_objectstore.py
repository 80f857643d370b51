"""Datasets in an object store, against a real S3 server (``rclone serve s3`` on loopback, ``harness.s3``):
ImageFolder's samples from a bucket, every object once per epoch, later epochs from the node's cache with
no GET, what the cache has no room for read ahead into the overflow, ``coordl analyze`` on a bucket, and
clear errors for a wrong endpoint, bucket, credentials or manifest."""

import collections
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch
import torchvision

import coordl
from coordl._core.settings import ANALYZE_TIME_SCALE_ENV
from coordl._objects.datasets import ObjectDataset, ObjectImageFolder
from coordl._objects.manifest import Manifest
from harness.delay_proxy import DelayProxy
from harness.s3 import S3Server
from tests import _object_procs, _procs
from tests._signals import FileBarrier, FileQueue

pytest.importorskip("s3torchconnectorclient", reason="the object store needs the s3 extra (in the test extra)")
TINY = torchvision.transforms.Compose([torchvision.transforms.Resize((8, 8)), torchvision.transforms.ToTensor()])


@pytest.fixture
def bucket(tmp_path, image_root, monkeypatch):
    """``image_root`` as the prefix ``train/`` of the bucket ``data`` of a live S3 server, whose endpoint and
    credentials are in the environment; (server, url)."""
    shutil.copytree(image_root, tmp_path / "store" / "data" / "train")
    with S3Server(str(tmp_path / "store")) as server:
        for name, value in server.environ().items():
            monkeypatch.setenv(name, value)
        yield server, "s3://data/train"


def test_an_object_image_folder_is_image_folder_from_a_bucket_cached_after_its_first_epoch(bucket, image_root):
    server, url = bucket
    local = torchvision.datasets.ImageFolder(image_root, transform=TINY)
    remote = ObjectImageFolder(url, transform=TINY)
    assert (remote.classes, remote.class_to_idx, remote.targets) == (local.classes, local.class_to_idx, local.targets)
    assert [key.rsplit("/train/", 1)[1] for key, _ in remote.samples] == \
        [os.path.relpath(path, image_root) for path, _ in local.samples]
    assert torch.equal(remote[5][0], local[5][0]) and remote[5][1] == local[5][1]

    loader = coordl.DataLoader(remote, batch_size=16, shuffle=True, num_workers=2, cache_bytes=10**8)
    for seed in range(2):  # torch's batches for the same seed, from the bucket and then from the cache
        torch.manual_seed(seed)
        expected = list(torch.utils.data.DataLoader(local, batch_size=16, shuffle=True))
        torch.manual_seed(seed)
        got = list(loader)
        assert len(got) == len(expected)
        assert all(torch.equal(g[0], e[0]) and torch.equal(g[1], e[1]) for g, e in zip(got, expected))
    first, second = loader.stats().epochs
    loader.close()
    assert (first.gets, first.hits + first.misses) == (len(local), len(local))  # one GET per object
    assert first.ahead > 0 and first.get_bytes == sum(remote.manifest.sizes)  # some read ahead of the loop
    assert (second.gets, second.hits, second.get_bytes) == (0, len(local), 0)  # no GET at all


def test_a_manifest_pins_the_listing_and_is_reused_without_listing(bucket, tmp_path):
    server, url = bucket
    path = str(tmp_path / "train.manifest.json")
    first = ObjectDataset(url, manifest=path)
    assert os.path.exists(path) and len(first) == 96 and first.keys == sorted(first.keys)
    (tmp_path / "store" / "data" / "train" / "late.bin").write_bytes(b"added after the manifest")
    again = ObjectDataset(url, manifest=path)
    assert again.keys == first.keys and again.manifest.digest() == first.manifest.digest()
    assert len(ObjectDataset(url)) == 97  # listing afresh sees it
    assert again[0] == (tmp_path / "store" / "data" / "train" / first.keys[0].split("/", 1)[1]).read_bytes()
    with pytest.raises(ValueError, match="lists s3://data/train, not s3://data/other"):
        ObjectDataset("s3://data/other", manifest=path)
    assert Manifest.load(path) == first.manifest


@pytest.mark.parametrize("fault, match", [
    ("bucket", "s3://nobucket/train.* at http://127.0.0.1"),
    ("credentials", "s3://data/train.* at http://127.0.0.1.*AWS_ACCESS_KEY_ID"),
    ("endpoint", "check endpoint_url= or AWS_ENDPOINT_URL"),
    ("prefix", "no objects under s3://data/nothing"),
])
def test_a_wrong_bucket_credentials_endpoint_or_prefix_is_said_at_construction(bucket, monkeypatch, fault, match):
    server, url = bucket
    if fault == "credentials":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    if fault == "endpoint":
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    url = {"bucket": "s3://nobucket/train", "prefix": "s3://data/nothing"}.get(fault, url)
    with pytest.raises(OSError, match=match):
        ObjectImageFolder(url)


def test_a_missing_object_is_file_not_found_naming_it(bucket, tmp_path):
    server, url = bucket
    dataset = ObjectDataset(url)
    os.unlink(tmp_path / "store" / "data" / "train" / dataset.keys[3].split("/", 1)[1])
    with pytest.raises(FileNotFoundError, match=f"s3://data/{dataset.keys[3]} at http://127.0.0.1"):
        dataset[3]


def test_an_object_changed_since_the_manifest_is_read_fresh_and_not_stamped_for_the_cache(bucket, tmp_path):
    """Same size, other bytes: its MD5 is not the manifest's ETag, and a HEAD confirms the change."""
    server, url = bucket
    dataset = ObjectDataset(url)
    changed, kept = dataset.raw_key(2), dataset.raw_key(3)
    path = tmp_path / "store" / "data" / "train" / dataset.keys[2].split("/", 1)[1]
    fresh = bytes(255 - b for b in path.read_bytes())
    path.write_bytes(fresh)
    assert dataset.raw_storage.read_stamped(changed) == (fresh, None)
    assert dataset.raw_storage.stamp(changed) is None  # known changed now: no cache serves its old bytes
    data, stamp = dataset.raw_storage.read_stamped(kept)
    assert stamp == dataset.raw_storage.stamp(kept) and stamp[2] == len(data)
    assert dataset.raw_storage.etags_are_md5


@pytest.mark.slow
def test_an_object_changed_in_the_bucket_after_it_was_cached_is_noticed_at_the_next_epoch_and_never_served_old(
        bucket, tmp_path, caplog):
    """An object of epoch 1's first batch (cached by then) is rewritten, and one is added, while the epoch runs.
    The listing at the epoch boundary (NOTE [ Changes in the bucket ]) marks the rewritten one: each later epoch
    counts it stale, GETs it and returns its new bytes, never the cached ones; the added one is said once, not
    read."""
    server, url = bucket
    probe = ObjectDataset(url)
    dataset = ObjectDataset(url, targets=list(range(len(probe))))
    loader = coordl.DataLoader(dataset, batch_size=8, shuffle=True, num_workers=2, cache_bytes=10**8,
                               collate_fn=lambda batch: batch)
    folder = tmp_path / "store" / "data" / "train"
    batches = iter(loader)
    first = next(batches)
    index = first[0][1]
    changed = folder / dataset.keys[index].split("/", 1)[1]
    new = changed.read_bytes() + b"appended in the bucket"
    changed.write_bytes(new)
    (folder / "added.jpg").write_bytes(b"not in the manifest")
    assert dict(map(reversed, first))[index] != new
    epoch_one = first + [sample for batch in batches for sample in batch]
    with caplog.at_level(logging.WARNING, logger="coordl"):
        later = [dict(map(reversed, (sample for batch in loader for sample in batch))) for _ in range(2)]
    stats = loader.stats().epochs
    loader.close()
    assert sorted(i for _, i in epoch_one) == list(range(len(dataset)))
    expected = {**dict(map(reversed, epoch_one)), index: new}
    assert later == [expected, expected]
    assert [(e.stale, e.gets, e.hits) for e in stats[1:]] == [(1, 1, len(dataset) - 1)] * 2
    assert stats[0].lists == 0 and stats[1].lists == stats[2].lists == 1 + 1 + 4  # "train", "train/", 4 classes
    assert sum("changed or went since its manifest" in r.message for r in caplog.records) == 1
    assert sum("1 objects were added" in r.message for r in caplog.records) == 1


def test_etags_that_are_not_md5s_stop_the_md5_check_after_one_head():
    """Server-side encryption with KMS gives ETags of an MD5's form that are not the bytes' MD5: the first
    mismatch is checked by a HEAD, which says the object is unchanged, and no later read is checked."""
    from coordl._objects.storage import ObjectStorage

    class Store:  # the bucket's client, with the ETags such a store gives
        heads = 0

        def get(self, key):
            return b"encrypted at rest"

        def etag(self, key):
            Store.heads += 1
            return "0" * 32

    storage = ObjectStorage(Store(), Manifest("s3://b/p", ["p/a", "p/b"], [17, 17], ["0" * 32, "0" * 32]))
    assert [storage.read_stamped(f"s3://b/p/{k}")[1] for k in "ab"] == [storage.stamp("s3://b/p/a")] * 2
    assert Store.heads == 1 and not storage.etags_are_md5


@pytest.mark.slow
def test_a_store_gone_mid_epoch_is_named_after_the_clients_retries(bucket):
    server, url = bucket
    dataset = ObjectDataset(url)
    assert dataset[0]
    server.stop()
    with pytest.raises(OSError, match=f"s3://data/{dataset.keys[1]} at http://127.0.0.1:{server.port}"):
        dataset[1]


def test_throttling_is_retried_then_reported_naming_the_object_the_endpoint_and_the_store_s_word(bucket, monkeypatch):
    """503 Slow Down: two in a row are retried with backoff and the object read; a store that keeps saying it is
    reported after the client's attempts (``ATTEMPTS``), naming the object, the endpoint and that it was throttled."""
    from coordl._objects.client import ATTEMPTS
    from tests._fault_proxy import SlowDownProxy
    server, url = bucket
    with SlowDownProxy(("127.0.0.1", server.port)) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
        dataset = ObjectDataset(url)
        with open(os.path.join(server.folder, "data", dataset.keys[0]), "rb") as f:
            first = f.read()
        proxy.fail(2)
        assert dataset[0] == first and proxy.failed == 2
        proxy.fail(10**6)
        with pytest.raises(OSError, match=rf"s3://data/{dataset.keys[1]} at http://127.0.0.1:{proxy.port}: .*throttled"):
            dataset[1]
        assert proxy.failed == 2 + ATTEMPTS


@pytest.fixture
def far_bucket(bucket, monkeypatch):
    """``bucket`` 10 ms away each way (``harness.delay_proxy``): a GET takes a 20 ms round trip or more."""
    server, url = bucket
    with DelayProxy(("127.0.0.1", server.port), 0.010) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
        yield server, url


@pytest.fixture
def gets(tmp_path, monkeypatch):
    """Every GET this test's process and its forked workers make, counted by key (a line appended to a file
    per GET): a function returning the keys' counts so far."""
    from coordl._objects.client import ObjectClient
    path, get = tmp_path / "gets.log", ObjectClient.get

    def counted(self, key: str) -> bytes:
        data = get(self, key)
        with open(path, "a") as f:
            f.write(f"{key}\n")
        return data
    monkeypatch.setattr(ObjectClient, "get", counted)
    return lambda: collections.Counter(path.read_text().split()) if path.exists() else collections.Counter()


def _targets(loader) -> list[int]:
    return sorted(int(t) for _, targets in loader for t in targets)


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_later_epochs_get_exactly_the_objects_the_cache_does_not_hold(bucket, fraction):
    server, url = bucket
    dataset = ObjectImageFolder(url, transform=TINY)
    capacity = int(fraction * sum(dataset.manifest.sizes)) + (fraction == 1.0) * 4096
    loader = coordl.DataLoader(dataset, batch_size=8, shuffle=True, num_workers=2, cache_bytes=capacity)
    epochs = [_targets(loader) for _ in range(3)]
    stats, cached = loader.stats().epochs, loader.stats().cache.items_cached
    loader.close()
    assert all(targets == sorted(dataset.targets) for targets in epochs)  # every sample once an epoch
    assert stats[0].gets == len(dataset)
    assert (fraction == 1.0) == (cached == len(dataset)) and cached > 0
    assert [e.gets for e in stats[1:]] == [len(dataset) - cached] * 2
    assert [e.hits for e in stats[1:]] == [cached] * 2


@pytest.mark.slow
def test_four_jobs_reading_one_prefix_on_a_node_get_each_object_once_in_all(bucket, tmp_path):
    """Four jobs start their first epoch together (a barrier), each with its own order and look-ahead: their
    GETs add up to the dataset, each object claimed by one reader of the node (minio_cache NOTE [ Claims ])."""
    server, url = bucket
    n = len(ObjectImageFolder(url))
    barrier, results = FileBarrier(tmp_path, 4), FileQueue(tmp_path)
    jobs = [_procs.spawn(_object_procs.read_an_epoch_and_report, url, seed, barrier, results) for seed in range(4)]
    _procs.join_ok(*jobs)
    reports = [results.get(timeout=5) for _ in jobs]
    assert sum(gets for gets, *_ in reports) == n
    assert all(hits + misses == n for _, hits, misses, _ in reports)
    assert all(targets == reports[0][3] and len(targets) == n for *_, targets in reports)


@pytest.mark.slow
def test_coordl_analyze_measures_a_bucket_at_the_loaders_gets_in_flight_and_asks_what_lookahead_it_needs(
        far_bucket, tmp_path):
    """Half the dataset cached. S from as many GETs at once as the loader keeps in flight (its worker's misses
    and its look-ahead's), L as one GET's wait (a 20 ms round trip or more), no complaint about reads a block
    device did not serve, and the what-if of the fewest GETs in flight that remove the fetch stall, which
    ``coordl whatif`` answers again for another depth."""
    server, url = far_bucket
    job = os.path.join(os.path.dirname(os.path.dirname(__file__)), "_analyze_job.py")
    proc = subprocess.run([sys.executable, "-m", "coordl.cli", "analyze", "--out", str(tmp_path), "--iters", "20",
                           "--warmup", "3", "--timeout", "120", "--", sys.executable, job, url, "--step-s", "0.02",
                           "--cache-bytes", str(sum(ObjectImageFolder(url).manifest.sizes) // 2)],
                          capture_output=True, text=True, timeout=600, env={**os.environ,
                                                                            ANALYZE_TIME_SCALE_ENV: "0.2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.load(open(tmp_path / "analysis.json"))
    config, rates = doc["config"], doc["phases"]["rates"]
    assert config["concurrency"] == 16 and config["lookahead"] >= 16
    assert rates["S_threads"] == 16 + config["lookahead"] and rates["cold_fraction"] is None
    assert doc["miss_wait_s"] >= 0.02 and "block device" not in proc.stdout
    assert "an object store: 16 GETs at once per worker" in proc.stdout
    asked = [a for a in doc["whatif"] if a["question"].startswith("fewest GETs in flight")]
    assert len(asked) == 1 and (asked[0]["lookahead"] is None or asked[0]["lookahead"] >= 1)  # half is GETs
    again = subprocess.run([sys.executable, "-m", "coordl.cli", "whatif", str(tmp_path / "analysis.json"),
                            "--lookahead", "1"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "1 in flight ahead of the loop" in again.stdout


@pytest.mark.slow
def test_at_a_partial_cache_a_later_epochs_uncached_objects_are_read_ahead_and_taken_out_once(far_bucket, gets):
    """Half the dataset fits. The loop takes epoch 2's first batch half a second late: by then the look-ahead
    has read the uncached objects in the sampler's order into its overflow, as many as it holds, and the
    workers take them out as they come to them; each object read once an epoch, every GET counted."""
    server, url = far_bucket
    dataset = ObjectImageFolder(url, transform=TINY)
    loader = coordl.DataLoader(dataset, batch_size=8, shuffle=True, num_workers=2,
                               cache_bytes=sum(dataset.manifest.sizes) // 2)
    first = [t for _, targets in loader for t in targets.tolist()]
    batches = iter(loader)
    time.sleep(0.5)
    second = [t for _, targets in batches for t in targets.tolist()]
    stats, walk = loader.stats(), loader.epoch_ledger.lookahead._walk
    loader.close()
    epoch, uncached = stats.epochs[1], len(dataset) - stats.cache.items_cached
    assert sorted(first) == sorted(second) == sorted(dataset.targets)
    assert stats.epochs[0].gets == len(dataset) and epoch.gets == uncached and 0 < uncached < len(dataset)
    assert epoch.hits == len(dataset) - uncached and epoch.staged + epoch.misses == uncached
    asked_at_once = 2 * 2 * 8  # workers x prefetch_factor x batch_size
    assert epoch.staged >= uncached - asked_at_once, epoch
    assert sum(gets().values()) == stats.epochs[0].gets + epoch.gets + walk.pending[0]  # + epoch 3's first ones
    assert max(gets().values()) <= 3


@pytest.mark.slow
def test_the_lookahead_reads_the_plan_before_torch_asks_so_the_workers_wait_little(far_bucket, gets):
    """20 ms a GET. The training loop takes its first batch half a second late: torch's 2 workers have asked for
    their first 4 batches by then, and the look-ahead has read the rest of the epoch in the sampler's order,
    each object once, so every later object was there before it was asked for."""
    server, url = far_bucket
    dataset = ObjectImageFolder(url, transform=TINY)
    assert dataset.raw_storage.lookahead >= 16
    loader = coordl.DataLoader(dataset, batch_size=8, shuffle=True, num_workers=2, cache_bytes=10**8)
    batches = iter(loader)
    time.sleep(0.5)
    seen = [t for _, targets in batches for t in targets.tolist()]
    epoch = loader.stats().epochs[0]
    loader.close()
    assert sorted(seen) == sorted(dataset.targets)
    assert epoch.gets == len(dataset) and epoch.hits + epoch.misses == len(dataset)
    asked_at_once = 2 * 2 * 8  # workers x prefetch_factor x batch_size
    assert epoch.lookahead_hits >= len(dataset) - asked_at_once, epoch
    assert sorted(gets().values()) == [1] * len(dataset)
    assert not [t for t in threading.enumerate() if t.name.startswith("coordl-lookahead")]


@pytest.mark.slow
def test_a_torch_dataloader_built_from_the_loaders_parts_reads_ahead_too(far_bucket):
    server, url = far_bucket
    dataset = ObjectImageFolder(url, transform=TINY)
    loader = coordl.DataLoader(dataset, batch_size=8, shuffle=True, num_workers=2, cache_bytes=10**8)
    rebuilt = torch.utils.data.DataLoader(loader.dataset, batch_sampler=loader.batch_sampler, num_workers=2)
    assert _targets(rebuilt) == sorted(dataset.targets)
    epoch = loader.stats().epochs[0]
    loader.close()
    assert epoch.gets == len(dataset) and epoch.ahead > 0


@pytest.mark.slow
def test_workers_forked_while_the_lookahead_reads_start_cleanly_and_nothing_is_left_running(far_bucket, gets):
    """An epoch left after one batch, so the look-ahead is mid-read when the next epoch forks new workers: the
    fork waits for its reads in flight (NOTE [ Look-ahead ]), the workers read the bucket, and every epoch
    still has every sample once."""
    server, url = far_bucket
    dataset = ObjectImageFolder(url, transform=TINY, lookahead=2)  # 2 at a time: about a second for them all
    loader = coordl.DataLoader(dataset, batch_size=8, shuffle=True, num_workers=2, cache_bytes=10**8)
    walk = None
    for _ in range(3):
        if walk is not None:
            assert walk.reading and walk.cursor < len(walk.plan)  # mid-read as the next epoch forks its workers
        next(iter(loader))  # the epoch left early: its workers go, the look-ahead reads on
        walk = loader.epoch_ledger.lookahead._walk
    assert _targets(loader) == sorted(dataset.targets) == _targets(loader)
    loader.close()
    assert sorted(gets().values()) == [1] * len(dataset)  # each object once, whoever read it
    assert not [t for t in threading.enumerate() if t.name.startswith("coordl-lookahead")]


def _labels(batch) -> list[int]:
    return [label for _, label in batch]


def _indexed(url: str) -> ObjectDataset:
    """The objects under ``url``, each labelled with its index (so labels reveal the order)."""
    dataset = ObjectDataset(url)
    dataset.targets = list(range(len(dataset)))
    return dataset


@pytest.mark.slow
def test_the_dali_backend_reads_a_bucket_in_torchs_order_then_from_the_cache_as_it_reads_files(bucket, image_root):
    """Shuffled: torch's order every epoch, every object got once in epoch 1 and none later. In order with the
    eval preset (no randomness): the images the same files give through the DALI backend."""
    pytest.importorskip("nvidia.dali")
    server, url = bucket
    dataset = _indexed(url)
    whole = 2 * sum(dataset.manifest.sizes)
    with coordl.DataLoader(dataset, batch_size=10, shuffle=True, num_workers=2, backend="dali", cache_bytes=whole,
                           generator=torch.Generator().manual_seed(5)) as loader:
        orders = [torch.cat([labels for _, labels in loader]).tolist() for _ in range(2)]
        gets = [e.gets for e in loader.stats().epochs]
    reference = torch.utils.data.DataLoader(range(len(dataset)), batch_size=10, shuffle=True,
                                            generator=torch.Generator().manual_seed(5))
    assert orders == [torch.cat(list(reference)).tolist() for _ in range(2)]
    assert gets == [len(dataset), 0]
    files = [path for path, _ in torchvision.datasets.ImageFolder(image_root).imgs]
    local = coordl.FileDataset(files, targets=list(range(len(files))))
    with coordl.DataLoader(_indexed(url), batch_size=16, backend="dali", cache_bytes=0) as remote, \
            coordl.DataLoader(local, batch_size=16, backend="dali", cache_bytes=0) as reference:
        for (a, a_labels), (b, b_labels) in zip(remote, reference, strict=True):
            assert torch.equal(a_labels, b_labels) and torch.equal(a, b)


@pytest.mark.slow
def test_an_hp_group_over_a_bucket_gets_each_object_once_an_epoch_for_all_its_jobs(bucket, tmp_path):
    """Two jobs in one hp_group, no cache: both see the same batches, every sample once an epoch, each batch
    prepared by one of them, so the group's GETs are the dataset's each epoch, not twice it."""
    server, url = bucket
    n = len(ObjectDataset(url))
    group = f"objects-{os.getpid()}-{time.monotonic_ns()}"
    results = FileQueue(tmp_path)
    jobs = [_procs.spawn(_object_procs.hp_member, url, group, 2, results) for _ in range(2)]
    _procs.join_ok(*jobs)
    (seen_a, stats_a), (seen_b, stats_b) = [results.get(timeout=5) for _ in jobs]
    assert seen_a == seen_b
    assert all(sorted(label for batch in epoch for label in batch) == list(range(n)) for epoch in seen_a)
    for epoch in range(2):
        assert stats_a[epoch][0] + stats_b[epoch][0] == -(-n // 8)  # each batch prepared once, by one job
        assert stats_a[epoch][1] + stats_b[epoch][1] == n


@pytest.mark.slow
def test_a_loader_over_a_bucket_resumes_mid_epoch_with_the_rest_of_its_batches(bucket, tmp_path):
    server, url = bucket

    def loader():
        return coordl.DataLoader(_indexed(url), batch_size=8, shuffle=True, num_workers=2, cache_bytes=0,
                                 generator=torch.Generator().manual_seed(3), collate_fn=_labels)
    with loader() as full:
        expected = [list(full) for _ in range(2)]
    with loader() as saved:
        it = iter(saved)
        head = [next(it) for _ in range(3)]
        torch.save(saved.state_dict(), tmp_path / "state.pt")
    with loader() as resumed:
        resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
        rest = [list(resumed) for _ in range(2)]
    assert head == expected[0][:3] and rest == [expected[0][3:], expected[1]]


@pytest.mark.slow
def test_a_disk_tier_over_a_bucket_keeps_the_objects_for_the_next_job_which_gets_none(bucket, tmp_path, gets):
    """A job with a memory cache of a quarter fills the disk tier; the next loader (its memory cache gone)
    makes no GET: every object comes from the disk, then what the memory cache holds from there. The
    look-ahead reads nothing the disk holds, nor what a worker read in an earlier epoch; what it staged for
    the next epoch before this one ended (its overflow's slots at most) it may read again."""
    server, url = bucket
    first = ObjectImageFolder(url, transform=TINY)
    quarter = sum(first.manifest.sizes) // 4
    runs = []
    for _ in range(2):
        loader = coordl.DataLoader(ObjectImageFolder(url, transform=TINY), batch_size=8, shuffle=True,
                                   num_workers=2, cache_bytes=quarter, cache_dir=str(tmp_path / "disk"))
        epochs = [_targets(loader) for _ in range(2)]
        runs.append((epochs, loader.stats().epochs))
        slots = loader.dataset.overflow.slots
        loader.close()
    for epochs, _ in runs:
        assert all(targets == sorted(first.targets) for targets in epochs)
    (_, filling), (_, next_job) = runs
    assert filling[0].gets == len(first) and filling[1].gets <= slots and filling[1].disk_hits > 0
    assert sum(gets().values()) == len(first) + filling[1].gets  # no other GET, in either job
    assert [e.gets for e in next_job] == [0, 0] and next_job[0].disk_hits == len(first)
    assert next_job[1].hits > 0 and next_job[1].hits + next_job[1].disk_hits == len(first)


@pytest.mark.slow
@pytest.mark.parametrize("exemplar_bytes", ["auto", 0])
def test_a_stream_over_a_bucket_replays_exemplars_the_full_cache_lacks_from_their_region_with_no_get(
        bucket, exemplar_bytes):
    """Two experiences, Subsets of one bucket's dataset; a cache that holds the first alone. Each epoch GETs
    exactly the new samples neither the cache nor the exemplar region holds, never a replay; without a region
    the replays of the second experience's members are GETs (so the check can fail). Experiences of two
    datasets (two manifests) are refused, naming the fix."""
    server, url = bucket
    dataset = ObjectImageFolder(url, transform=TINY)
    half = len(dataset) // 2
    parts = [torch.utils.data.Subset(dataset, range(half)), torch.utils.data.Subset(dataset, range(half, len(dataset)))]
    stream = coordl.ExperienceStream(parts, tagged=True)
    rehearsal = coordl.Rehearsal(16, "experience_balanced", per_batch=4, seed=3, exemplar_bytes=exemplar_bytes)
    loader = coordl.DataLoader(stream, batch_size=8, shuffle=True, num_workers=2, rehearsal=rehearsal,
                               cache_bytes=sum(dataset.manifest.sizes[:half]))
    later = []  # the members from the second experience as each epoch begins
    for experience in stream:
        for _ in range(2):
            later.append([i for i in rehearsal.members() if i >= half])
            targets = [(int(t), bool(r)) for _, targets, replayed, _ in loader for t, r in zip(targets, replayed)]
            assert sorted(t for t, r in targets if not r) == sorted(dataset.targets[experience.start:experience.stop])
    stats, region = loader.stats().epochs, loader.stats().rehearsal["region"]
    loader.close()
    gets = [e.gets for e in stats]
    assert [len(members) for members in later] == [0, 0, 0, 8]  # experience-balanced: 8 of each
    if exemplar_bytes == 0:
        assert region is None and gets[3] > half - 8
    else:  # the last epoch's new samples that are members are hits too
        assert gets == [half, 0, half, half - 8]
        assert region["items"] == 8 and region["refused"] == 0
    with pytest.raises(TypeError, match="its datasets are in different stores.*Subsets of one object-store"):
        coordl.DataLoader(coordl.ExperienceStream([dataset, ObjectImageFolder(url)]), batch_size=8,
                          rehearsal=coordl.Rehearsal(4, per_batch=2))
