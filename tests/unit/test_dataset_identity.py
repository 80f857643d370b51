"""Dataset identities: which files a cache is named by, and what naming them costs."""

import os

from coordl import FileDataset
from coordl._fetch.raw_datasets import IDENTITY_SAMPLES, dataset_identity


def _write(path, data: bytes, mtime_ns: int = 1_700_000_000 * 10**9) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def _identity(keys, **options) -> bytes:
    return dataset_identity(FileDataset(keys), local=True, **options)


def test_relative_paths_from_other_working_directories_are_other_files(tmp_path, monkeypatch):
    for job in ("job-a", "job-b"):
        _write(str(tmp_path / job / "data" / "0.bin"), b"same size, same mtime, other bytes: " + job.encode())
    identities = set()
    for job in ("job-a", "job-b"):
        monkeypatch.chdir(tmp_path / job)
        identities.add(_identity(["data/0.bin"]))
    assert len(identities) == 2


def test_links_and_relative_paths_to_the_same_files_agree(tmp_path, monkeypatch):
    _write(str(tmp_path / "data" / "0.bin"), b"x" * 10)
    os.symlink(tmp_path / "data", tmp_path / "alias")
    monkeypatch.chdir(tmp_path)
    expected = _identity([str(tmp_path / "data" / "0.bin")])
    assert _identity(["data/0.bin"]) == expected
    assert _identity(["alias/0.bin"]) == expected
    assert dataset_identity(FileDataset(["data/0.bin"]), local=False) != expected  # keys as given: not resolved


def test_a_file_rewritten_in_place_keeping_size_and_mtime_gets_a_new_identity(tmp_path):
    path = str(tmp_path / "0.bin")
    _write(path, b"before")
    stat_before, content_before = (_identity([path], content=c) for c in (False, True))
    _write(path, b"after!")  # same size, mtime put back: the ctime moved
    assert _identity([path]) != stat_before
    assert _identity([path], content=True) != content_before


def test_only_sampled_files_are_looked_at(tmp_path):
    n = 3 * IDENTITY_SAMPLES + 1  # every third key is sampled
    keys = [str(tmp_path / f"{i}.bin") for i in range(n)]
    for i in (0, 1, n - 1):
        _write(keys[i], b"x")
    first = _identity(keys)
    os.unlink(keys[1])  # not sampled: the identity holds; the cache checks it when it serves it
    assert _identity(keys) == first
    os.unlink(keys[n - 1])
    assert _identity(keys) != first
    assert _identity(keys[:-1]) != _identity(keys)  # the number of samples counts


def test_keys_of_another_storage_are_all_hashed_since_they_are_served_unchecked():
    keys = [f"s3://bucket/{i}.jpg" for i in range(5000)]
    moved = keys[:1] + ["s3://bucket/other.jpg"] + keys[2:]  # a key no sample of 1024 would look at
    assert dataset_identity(FileDataset(keys), local=False) != dataset_identity(FileDataset(moved), local=False)
