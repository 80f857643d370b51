"""Nothing is left running or in /dev/shm once a loader is gone, also after errors."""

import gc
import os
import time

import pytest
import torchvision

import coordl
from coordl._cache.minio import list_caches


def _mine(root):
    return [c for c in list_caches() if c.label.endswith(f" in {root}")]


def is_process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.slow
def test_close_stops_persistent_workers_and_removes_the_cache(image_root):
    loader = coordl.DataLoader(torchvision.datasets.ImageFolder(image_root), batch_size=8, num_workers=2,
                               persistent_workers=True, collate_fn=list, cache_bytes="1MiB")
    for _ in range(2):
        list(loader)
    pids = [w.pid for w in loader._iterator._workers]
    assert len(_mine(image_root)) == 1 and all(is_process_alive(p) for p in pids)
    loader.close()
    assert not any(is_process_alive(p) for p in pids)
    assert _mine(image_root) == []
    list(loader)  # a closed loader can be iterated again: it re-attaches
    loader.close()


@pytest.mark.slow
def test_dropping_the_loader_releases_everything(image_root):
    loader = coordl.DataLoader(torchvision.datasets.ImageFolder(image_root), batch_size=8, num_workers=2,
                               collate_fn=list, cache_bytes="1MiB")
    it = iter(loader)
    next(it)
    pids = [w.pid for w in it._inner._workers]
    del it, loader
    gc.collect()
    deadline = time.monotonic() + 10
    while (_mine(image_root) or any(is_process_alive(p) for p in pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _mine(image_root) == [] and not any(is_process_alive(p) for p in pids)


def test_an_error_mid_epoch_leaves_nothing_behind(fresh_image_root):
    dataset = torchvision.datasets.ImageFolder(fresh_image_root)
    os.remove(dataset.samples[20][0])
    with pytest.raises(coordl.SampleError):
        with coordl.DataLoader(dataset, batch_size=4, num_workers=2, collate_fn=list, cache_bytes="1MiB") as loader:
            list(loader)
    assert loader.stats().epochs[0].complete is False
    assert _mine(fresh_image_root) == []
