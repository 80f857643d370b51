"""Dataset fingerprints: which files, and which versions of them, a cache holds."""

import os

from coordl.raw_datasets import fingerprint_files


def _write(path, data: bytes, mtime_ns: int = 1_700_000_000 * 10**9) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def test_relative_paths_from_other_working_directories_are_other_files(tmp_path, monkeypatch):
    for job in ("job-a", "job-b"):
        _write(str(tmp_path / job / "data" / "0.bin"), b"same size, same mtime, other bytes: " + job.encode())
    fingerprints = set()
    for job in ("job-a", "job-b"):
        monkeypatch.chdir(tmp_path / job)
        fingerprints.add(fingerprint_files(["data/0.bin"], content=False))
    assert len(fingerprints) == 2


def test_links_and_relative_paths_to_the_same_files_agree(tmp_path, monkeypatch):
    _write(str(tmp_path / "data" / "0.bin"), b"x" * 10)
    os.symlink(tmp_path / "data", tmp_path / "alias")
    monkeypatch.chdir(tmp_path)
    expected = fingerprint_files([str(tmp_path / "data" / "0.bin")], content=False)
    assert fingerprint_files(["data/0.bin"], content=False) == expected
    assert fingerprint_files(["alias/0.bin"], content=False) == expected
    assert expected[1] == 10


def test_an_edit_that_keeps_size_and_mtime_is_seen_only_by_content(tmp_path):
    path = str(tmp_path / "0.bin")
    _write(path, b"before")
    stat_before, content_before = (fingerprint_files([path], content=c) for c in (False, True))
    _write(path, b"after!")  # same size, mtime put back
    assert fingerprint_files([path], content=False) == stat_before
    content_after = fingerprint_files([path], content=True)
    assert content_after != content_before
    os.utime(path, ns=(1, 1))  # touched, bytes unchanged
    assert fingerprint_files([path], content=False) != stat_before
    assert fingerprint_files([path], content=True) == content_after  # content ignores mtimes
