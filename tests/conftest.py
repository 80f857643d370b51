"""Shared fixtures: small real JPEG datasets and a guard that fails any test leaking /dev/shm."""

import glob
import os
import time

import pytest

from coordl.synthetic import make_image_folder


def _shm_entries() -> set[str]:
    return set(glob.glob("/dev/shm/cdl_*"))


@pytest.fixture(autouse=True)
def shm_leak_guard():
    """Every coordl segment a test creates must be gone when it ends (workers may take a moment)."""
    before = _shm_entries()
    yield
    deadline = time.monotonic() + 10
    while (_shm_entries() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    leaked = _shm_entries() - before
    assert not leaked, f"test leaked shared memory: {sorted(leaked)}"


@pytest.fixture(scope="session")
def image_root(tmp_path_factory) -> str:
    """An ImageFolder tree of 96 small JPEGs in 4 classes (read-only: tests must not modify it)."""
    root = str(tmp_path_factory.mktemp("images"))
    make_image_folder(root, 96, n_classes=4, mean_side_px=96, seed=1)
    return root


@pytest.fixture
def fresh_image_root(tmp_path) -> str:
    """A private ImageFolder tree of 48 JPEGs that a test may modify or corrupt."""
    root = str(tmp_path / "images")
    make_image_folder(root, 48, n_classes=3, mean_side_px=96, seed=2)
    return root


def dataset_bytes(root: str) -> int:
    """Total size of the files under ``root``."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)
