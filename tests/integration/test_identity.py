"""What makes jobs share a cache or an hp_group: dataset fingerprints and the settings members compare."""

import functools
import json
import os
import secrets
import subprocess
import sys
import threading

import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.v2 as v2
from torch.utils.data import default_collate

import coordl
from coordl._describe import describe
from tests import _procs

N = 12
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _scaled(k):
    return lambda x: x * k


class Jitter:
    """A transform with the default repr and a set among its state."""

    def __init__(self, names):
        self.names = names

    def __call__(self, x):
        return x


def described() -> list[str]:
    """Descriptions of objects whose parts a process could order or name differently: sets of strings,
    closures, nested transforms, modules, tensors."""
    names = {"flip", "crop", "blur", "jitter", "noise"}
    objects = [_scaled(names), functools.partial(_scaled(frozenset(names))), Jitter(names), default_collate,
               T.Compose([T.RandomResizedCrop(224), T.ToTensor(), T.Normalize([0.5], [0.2]), T.Lambda(_scaled(2))]),
               v2.Compose([v2.RandomResizedCrop(224), v2.ToDtype(torch.float32, scale=True),
                           v2.Normalize([0.5], [0.2])])]
    return [describe(obj, "transform") for obj in objects]


def test_descriptions_hold_across_processes_and_hash_seeds():
    code = "import json; from tests.integration.test_identity import described; print(json.dumps(described()))"
    runs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed,
               "PYTHONPATH": os.pathsep.join(filter(None, [_REPO, os.environ.get("PYTHONPATH")]))}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=_REPO, env=env,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        runs.append(json.loads(done.stdout))
    assert runs[0] == runs[1] == described()


@pytest.fixture
def index_root(tmp_path) -> str:
    root = str(tmp_path / "index-files")
    _procs.IndexFiles.write(root, N)
    return root


def _member(root, group, transform, **kwargs):
    return coordl.DataLoader(_procs.IndexFiles(root, N, transform=transform), batch_size=4, shuffle=True,
                             cache_bytes=0, hp_group=group, **kwargs)


def _locked():
    lock = threading.Lock()
    return lambda x: (lock, x)[1]


def test_members_whose_transforms_differ_in_a_constant_are_refused(index_root):
    group = f"test-{secrets.token_hex(4)}"
    with _member(index_root, group, _scaled(2)):
        with pytest.raises(coordl.GroupMismatchError, match=r"transforms: group has 'transform=tests\.integration"
                                                            r"\.test_identity\._scaled\.<locals>\.<lambda> \(sha256 "):
            _member(index_root, group, _scaled(3))
        with _member(index_root, group, _scaled(2)) as same:
            assert same.epoch_ledger.feed is not None


def test_hp_group_key_lets_members_with_uncomparable_transforms_join(index_root):
    group = f"test-{secrets.token_hex(4)}"
    with pytest.raises(ValueError, match=r"hp_group cannot compare transform=.*<closure lock>.*hp_group_key="):
        _member(index_root, group, _locked())
    with _member(index_root, group, _locked(), hp_group_key="lock-sweep"):
        with _member(index_root, group, _locked(), hp_group_key="lock-sweep") as second:
            assert second.epoch_ledger.feed is not None
        with pytest.raises(coordl.GroupMismatchError, match="hp_group_key: group has 'lock-sweep', this job 'other'"):
            _member(index_root, group, _locked(), hp_group_key="other")
        with pytest.raises(coordl.GroupMismatchError, match="batch_size: group has '4', this job '6'"):
            coordl.DataLoader(_procs.IndexFiles(index_root, N, transform=_locked()), batch_size=6, shuffle=True,
                              cache_bytes=0, hp_group=group, hp_group_key="lock-sweep")


def _write(path: str, data: bytes, mtime_ns: int = 1_700_000_000 * 10**9) -> None:
    with open(path, "wb") as f:
        f.write(data)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def _read_all(files, **options) -> tuple[list[bytes], int]:
    """Every sample's bytes through a new loader, and its cache hits."""
    with coordl.DataLoader(coordl.FileDataset(files, decode="bytes"), batch_size=len(files), collate_fn=list,
                           cache_bytes="1MiB", **options) as loader:
        samples = [sample for batch in loader for sample in batch]
        return samples, loader.stats().epochs[0].hits


@pytest.mark.parametrize("verify", ["stat", "content"])
def test_an_edit_keeping_size_and_mtime_is_served_stale_unless_content_is_verified(tmp_path, verify):
    files = [str(tmp_path / f"{i}.bin") for i in range(4)]
    for i, path in enumerate(files):
        _write(path, f"old-{i}".encode())
    with coordl.DataLoader(coordl.FileDataset(files, decode="bytes"), batch_size=4, collate_fn=list,
                           cache_bytes="1MiB", cache_verify=verify) as first:
        assert [s for batch in first for s in batch] == [f"old-{i}".encode() for i in range(4)]  # now cached
        for i, path in enumerate(files):
            _write(path, f"new-{i}".encode())  # same size, mtime put back
        samples, hits = _read_all(files, cache_verify=verify)
    if verify == "stat":
        assert (samples, hits) == ([f"old-{i}".encode() for i in range(4)], 4)
    else:
        assert (samples, hits) == ([f"new-{i}".encode() for i in range(4)], 0)


def test_relative_paths_from_another_working_directory_do_not_share_a_cache(tmp_path, monkeypatch):
    for job in ("job-a", "job-b"):
        os.makedirs(tmp_path / job / "data")
        _write(str(tmp_path / job / "data" / "0.bin"), job.encode())  # same size and mtime
    monkeypatch.chdir(tmp_path / "job-a")
    with coordl.DataLoader(coordl.FileDataset(["data/0.bin"], decode="bytes"), collate_fn=list,
                           cache_bytes="1MiB") as first:
        assert list(first) == [[b"job-a"]]
        monkeypatch.chdir(tmp_path / "job-b")
        assert _read_all(["data/0.bin"]) == ([b"job-b"], 0)

