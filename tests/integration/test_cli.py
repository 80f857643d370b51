"""`coordl cache ls` / `coordl cache rm` on real caches, live and stale."""

import argparse
import getpass
import os
import re
import secrets
import signal
import subprocess
import sys

import pytest
import torch
import torchvision

import coordl
from coordl._cache.minio import MinIOCache, cache_segment_name
from coordl._core.shm import segment_path
from coordl._core.sizes import format_bytes
from coordl.cli import build_parser
from tests import _procs
from tests._signals import FileEvent


def _coordl(*args):
    return subprocess.run([sys.executable, "-m", "coordl.cli", *args], capture_output=True, text=True, timeout=60)


def _stale_cache(tmp_path) -> str:
    name = cache_segment_name(secrets.token_hex(6))
    locked = FileEvent(tmp_path)
    proc = _procs.spawn(_procs.hold_lock_then_die, name, 4, 4096, locked)
    proc.join(_procs.JOIN_TIMEOUT)
    assert proc.exitcode == -signal.SIGKILL
    return name


def test_ls_and_rm(tmp_path):
    live = MinIOCache(cache_segment_name(secrets.token_hex(6)), n_items=3, capacity_bytes=2**30,
                      fingerprint=bytes(32), label="cli-test live")
    live.put(0, b"x" * 100)
    stale = _stale_cache(tmp_path)
    try:
        out = _coordl("cache", "ls").stdout
        assert live.name in out and "1/3" in out and "cli-test live" in out
        assert stale in out and "stale" in out.split(stale)[1].splitlines()[0]
        row, holders = out.split(live.name)[1].splitlines()[:2]
        held = os.stat(segment_path(live.name)).st_blocks * 512  # sparse: far less than its file's size
        assert held < os.path.getsize(segment_path(live.name)) and format_bytes(held) in row
        assert holders.strip() == f"mapped by {os.getpid()} ({open('/proc/self/comm').read().strip()})"
        assert "mapped by" not in out.split(stale)[1].splitlines()[1]  # its holder was SIGKILLed

        refused = _coordl("cache", "rm", live.name)
        assert refused.returncode == 1 and "in use by 1 process" in refused.stderr
        assert _coordl("cache", "rm", "--stale", "--dry-run").stdout.startswith(f"would remove {stale}")
        assert os.path.exists(segment_path(stale))
        removed = _coordl("cache", "rm", "--stale")
        assert removed.returncode == 0 and f"removed {stale}" in removed.stdout
        assert not os.path.exists(segment_path(stale)) and os.path.exists(segment_path(live.name))
        assert _coordl("cache", "rm", "--force", live.name).returncode == 0
        assert not os.path.exists(segment_path(live.name))
        assert live.get(0) == b"x" * 100  # a forcibly removed cache keeps serving its users
    finally:
        live.close()


@pytest.mark.budget(30)  # the demo's one end-to-end run: a fresh interpreter that imports torchvision
def test_demo_shows_coordl_reading_less_than_torch_with_the_same_memory(tmp_path):
    done = _coordl("demo", "--images", "40", "--epochs", "2", "--workers", "0", "--batch-size", "8",
                   "--dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "Storage: emulated disk" in done.stdout
    assert "the disk gets" in done.stdout  # it measured prep, then picked the disk
    picked = re.search(r"Storage: emulated disk \(no root needed\) at ([\d.e+-]+) MB/s", done.stdout)
    assert picked, done.stdout
    rows = {(r[0], int(r[1])): r for r in (line.split() for line in done.stdout.splitlines())
            if r and r[0] in ("torch", "coordl") and r[1].isdigit()}
    assert list(rows) == [("torch", 1), ("torch", 2), ("coordl", 1), ("coordl", 2)]
    hits, misses, read_mib, disk_s = ({key: float(r[column]) for key, r in rows.items()} for column in (7, 8, 6, 3))
    for key, row in rows.items():  # each epoch's floor is its bytes at the disk's bandwidth, and it names a bound
        assert disk_s[key] == pytest.approx(read_mib[key] * 2**20 / (float(picked.group(1)) * 1e6), rel=0.05,
                                            abs=0.01)
        assert row[4] in ("storage", "prep") and float(row[2]) >= disk_s[key] * 0.95
    assert hits["torch", 1] == hits["coordl", 1] == 0 and misses["torch", 1] == misses["coordl", 1] == 40
    assert 0 < hits["coordl", 2] < 40 and hits["coordl", 2] + misses["coordl", 2] == 40  # half cached
    assert hits["torch", 2] + misses["torch", 2] == 40
    assert read_mib["coordl", 2] < read_mib["torch", 2]  # the LRU page cache thrashes, the MinIO cache does not
    last = done.stdout.rstrip().splitlines()[-1]
    assert last.startswith(f"coordl read {read_mib['coordl', 2]} MiB from storage per epoch after the first")
    assert "less than torch's" in last


def test_ls_says_what_each_cache_holds(image_root):
    dataset = torchvision.datasets.ImageFolder(image_root)
    half = torch.utils.data.random_split(dataset, [0.5, 0.5], generator=torch.Generator().manual_seed(0))[0]
    with coordl.DataLoader(dataset, cache_bytes=10_000), coordl.DataLoader(half, cache_bytes=10_000), \
            coordl.DataLoader(dataset, cache_bytes=10_000, cache_name="mine"):
        out = _coordl("cache", "ls").stdout
    labels = sorted(line.split("  ")[-1] for line in out.splitlines() if line.startswith("cdl_"))  # a row a cache
    assert labels == [f"ImageFolder of 96 files in {image_root}", f"Subset of 48 files in {image_root}",
                      f"mine: ImageFolder of 96 files in {image_root}"]
    assert f"{getpass.getuser()}:" not in out


@pytest.mark.parametrize("command, choices", [((), "a command: demo, analyze, whatif, cache, group"),
                                              (("cache",), "a subcommand: ls, rm"),
                                              (("group",), "a subcommand: ls, rm")])
def test_a_missing_subcommand_names_the_choices(command, choices):
    done = _coordl(*command)
    assert done.returncode == 2 and f"error: choose {choices}" in done.stderr and "_command" not in done.stderr


WHOLE, SHARE = "a whole number of at least 1", "more than 0 and at most 1 (0.5: half the dataset)"


@pytest.mark.parametrize("option, value, accepted", [
    ("--images", "-3", WHOLE), ("--epochs", "0", WHOLE), ("--batch-size", "x", WHOLE),
    ("--workers", "-1", "a whole number of at least 0"), ("--cache-fraction", "1.5", SHARE),
    ("--cache-fraction", "0", SHARE)])
def test_demo_refuses_a_bad_setting_before_it_starts(tmp_path, option, value, accepted):
    done = _coordl("demo", option, value, "--dir", str(tmp_path))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"error: argument {option}: should be {accepted}, but got {value!r}" in done.stderr
    assert os.listdir(tmp_path) == []


def test_every_demo_option_has_help():
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    options = [a for a in commands.choices["demo"]._actions if a.option_strings]
    assert len(options) == 8 and all(a.help for a in options)


def test_ls_shows_a_caches_part_in_a_partitioned_job():
    with MinIOCache(cache_segment_name(secrets.token_hex(6)), n_items=3, capacity_bytes=1000, fingerprint=bytes(32),
                    label="cli-test partitioned") as cache:
        cache.stats()  # creates it
        listed = _coordl("cache", "ls")
        assert "cli-test partitioned" in listed.stdout and "[partitioned" not in listed.stdout
        cache.mark_partition(2, 4)
        listed = _coordl("cache", "ls")
    assert listed.returncode == 0
    assert "cli-test partitioned [partitioned: server 2 of 4]" in listed.stdout


@pytest.mark.slow
def test_cache_warm_fills_the_disk_cache_a_job_then_reads_and_rm_waits_until_no_job_uses_it(tmp_path, image_root):
    cache_dir = str(tmp_path / "disk")
    warm = _coordl("cache", "warm", image_root, "--cache-dir", cache_dir, "--jobs", "4")
    n = len(torchvision.datasets.ImageFolder(image_root))
    assert warm.returncode == 0, warm.stderr
    assert re.search(rf"read {n} of {n} items .* holds {n}/{n}", warm.stdout), warm.stdout
    again = _coordl("cache", "warm", image_root, "--cache-dir", cache_dir)
    assert again.returncode == 0 and f"read 0 of {n} items" in again.stdout
    loader = coordl.DataLoader(torchvision.datasets.ImageFolder(image_root), batch_size=16, cache_bytes=0,
                               cache_dir=cache_dir, collate_fn=list)
    assert sum(len(batch) for batch in loader) == n
    epoch = loader.stats().epochs[0]
    assert (epoch.disk_hits, epoch.misses, epoch.storage_bytes) == (n, 0, 0)
    name = re.search(r"the disk cache (\w+)", warm.stdout).group(1)
    listed = _coordl("cache", "ls", "--cache-dir", cache_dir).stdout
    assert re.search(rf"{name} +{n}/{n} +100% .* 1  ImageFolder of {n} files", listed), listed  # this process
    busy = _coordl("cache", "rm", name, "--cache-dir", cache_dir, "--force")
    assert busy.returncode == 1 and "in use" in busy.stderr
    loader.close()
    assert _coordl("cache", "rm", "--stale", "--cache-dir", cache_dir).returncode == 0  # never a disk cache
    assert os.path.isdir(os.path.join(cache_dir, name))
    removed = _coordl("cache", "rm", name, "--cache-dir", cache_dir)
    assert removed.returncode == 0 and f"removed {name}" in removed.stdout and not os.listdir(cache_dir)
