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
from coordl._group.agreement import describe
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


@pytest.mark.slow
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


def _edit(kind: str, path: str, tmp_path) -> None:
    """Change the bytes behind ``path`` and keep its size and mtime."""
    if kind == "rewritten":
        _write(path, b"new-" + open(path, "rb").read()[4:])  # in place, mtime put back
    elif kind == "replaced":
        _write(str(tmp_path / "next.bin"), b"new-" + open(path, "rb").read()[4:])
        os.replace(tmp_path / "next.bin", path)  # another inode, same size and mtime
    else:  # a link re-pointed at another file of the same size and mtime
        target = os.readlink(path)
        _write(target + ".other", b"new-" + open(target, "rb").read()[4:])
        os.unlink(path)
        os.symlink(target + ".other", path)


@pytest.mark.parametrize("verify", ["stat", "content"])
@pytest.mark.parametrize("kind", ["rewritten", "replaced", "relinked"])
def test_a_file_changed_after_caching_is_read_again_never_served_stale(tmp_path, kind, verify):
    files = [str(tmp_path / f"{i}.bin") for i in range(4)]
    for i, path in enumerate(files):
        if kind == "relinked":
            _write(path + ".target", f"old-{i}".encode())
            os.symlink(path + ".target", path)
        else:
            _write(path, f"old-{i}".encode())
    with coordl.DataLoader(coordl.FileDataset(files, decode="bytes"), batch_size=4, collate_fn=list,
                           cache_bytes="1MiB", cache_verify=verify) as loader:
        assert [s for batch in loader for s in batch] == [f"old-{i}".encode() for i in range(4)]  # now cached
        _edit(kind, files[1], tmp_path)
        assert [s for batch in loader for s in batch] == [b"old-0", b"new-1", b"old-2", b"old-3"]
        again = loader.stats().epochs[1]
        assert (again.hits, again.misses, again.stale) == (3, 1, 1)
        assert loader.stats().cache.items_cached == 4  # the old bytes stay, served to no one
        with coordl.DataLoader(coordl.FileDataset(files, decode="bytes"), batch_size=4, collate_fn=list,
                               cache_bytes="1MiB", cache_verify=verify) as later:  # a later job: a new cache
            assert later.dataset.cache.name != loader.dataset.cache.name
            assert [s for batch in later for s in batch] == [b"old-0", b"new-1", b"old-2", b"old-3"]
    for path in files:
        os.utime(path, ns=(1, 1))  # touched: bytes unchanged, a new cache all the same
    samples, hits = _read_all(files, cache_verify=verify)
    assert (samples, hits) == ([b"old-0", b"new-1", b"old-2", b"old-3"], 0)


def test_a_storage_without_stamps_is_served_as_cached(tmp_path):
    class Store:  # keys name immutable bytes, as an object store's versioned keys would
        def __init__(self):
            self.reads = 0

        def read(self, key):
            self.reads += 1
            return key.encode()

    store = Store()
    with coordl.DataLoader(coordl.FileDataset([f"object-{i}" for i in range(4)], decode="bytes"), batch_size=4,
                           collate_fn=list, cache_bytes="1MiB", storage=store) as loader:
        for _ in range(2):
            assert [s for batch in loader for s in batch] == [f"object-{i}".encode() for i in range(4)]
        assert store.reads == 4 and loader.stats().epochs[1].hits == 4


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

