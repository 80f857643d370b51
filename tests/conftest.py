"""Shared fixtures: small real JPEG datasets, and guards that give every test its own shared-memory
namespace and fail any test that leaks shared memory or processes; the test tiers (``tests/README.md``)
and the default tier's time limit."""

import faulthandler
import glob
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time

import pytest

from coordl._core.settings import ANALYZE_TIME_SCALE_ENV, SHM_DIR_ENV
from coordl._core.sysinfo import descendants
from coordl._demo.synthetic import make_image_folder
from tests._procs import forkserver_descendants, start_forkserver

pytest_plugins = ["pytester"]

LEAK_GRACE_S = 10
DEFAULT_TIER_LIMIT_S = 10.0
"""The most a default-tier test's setup or call may take (``--tier-limit``): a slower one fails, so the tier
(README's ``pytest``) stays within its 5 minutes on a 2-core machine. Mark it ``slow`` (the full tier) or make
it faster."""
FULL_TIER = "slow"
"""The marker of the full tier's tests: ``pytest`` leaves them out, ``pytest --all`` and ``pytest -m slow``
run them (CI runs both tiers)."""
DUMP_BEFORE_TIMEOUT_S = 20
"""This long before a test's timeout, every process it started that catches SIGUSR2 (forked ones: the
handler below is inherited) is sent it and writes its threads' stacks to its stderr: a hang names the
process it is in, workers included."""

faulthandler.register(signal.SIGUSR2, file=sys.__stderr__, all_threads=True)
os.environ.setdefault(ANALYZE_TIME_SCALE_ENV, "0.2")  # the analyzer's least measuring times, for every test's jobs


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true", help="run every tier (the default tier and the slow tests)")
    parser.addoption("--tier-limit", type=float, default=DEFAULT_TIER_LIMIT_S, metavar="SECONDS",
                     help="fail a default-tier test whose setup or call takes longer (0: no limit)")


def pytest_sessionstart(session):
    start_forkserver()


def _default_tier(config) -> bool:
    """Whether this run is the default tier: no ``--all``, no ``-m`` of its own, and not only tests named by
    their ids (``pytest tests/x.py::test_y`` runs that test whatever its tier)."""
    named = config.args and all("::" in arg for arg in config.args)
    return not config.getoption("--all") and not config.getoption("markexpr") and not named


def pytest_collection_modifyitems(config, items):
    if not _default_tier(config):
        return
    full = [item for item in items if item.get_closest_marker(FULL_TIER)]
    if full:
        config.hook.pytest_deselected(items=full)
        items[:] = [item for item in items if not item.get_closest_marker(FULL_TIER)]


def pytest_report_header(config):
    if _default_tier(config):
        return f"default tier: the {FULL_TIER!r} tests are left out (--all runs them); a test's setup or call may " \
               f"take {config.getoption('--tier-limit'):g} s (--tier-limit)"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    limit = item.config.getoption("--tier-limit")
    budget = item.get_closest_marker("budget")
    if limit and budget:
        limit = max(limit, budget.args[0])
    if limit and _default_tier(item.config) and report.when in ("setup", "call") and report.passed \
            and report.duration > limit:
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid}: its {report.when} took {report.duration:.1f} s, over the default " \
                          f"tier's {limit:g} s: make it faster, or mark it @pytest.mark.{FULL_TIER} (the full tier)" + \
            ("" if budget else " (a subsystem's one end-to-end run may have a budget: @pytest.mark.budget(SECONDS))")
    return report


_SESSION_HELPERS = (b"multiprocessing.resource_tracker", b"multiprocessing.forkserver")


def _processes_with_env(marker: bytes) -> list[int]:
    """Pids of this machine's processes whose environment contains ``marker``, except this one and the
    helpers multiprocessing keeps for the whole session (started lazily, so they may carry it)."""
    found = []
    for environ in glob.glob("/proc/[0-9]*/environ"):
        pid = int(environ.split("/")[2])
        if pid == os.getpid():
            continue
        try:
            with open(environ, "rb") as f:
                if marker not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            if any(helper in cmdline for helper in _SESSION_HELPERS):
                continue
        except OSError:
            continue
        found.append(pid)
    return found


def _status(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    except OSError:
        return {}


def _started_by_test(marker: bytes) -> list[int]:
    """The processes a test started that may still run: those with its environment, and the jobs it forked
    from the jobs' forkserver (``_procs.spawn``: their environment is the server's)."""
    return sorted({*_processes_with_env(marker), *forkserver_descendants()})


def _dump_stacks(marker: bytes) -> None:
    for pid in {os.getpid(), *descendants(os.getpid()), *_processes_with_env(marker)}:
        if int(_status(pid).get("SigCgt", "0"), 16) >> (signal.SIGUSR2 - 1) & 1:
            try:
                os.kill(pid, signal.SIGUSR2)
            except ProcessLookupError:
                continue
            time.sleep(0.2)  # one dump after the other


def _timeout_s(request) -> float:
    marker = request.node.get_closest_marker("timeout")
    return float(marker.args[0] if marker and marker.args else request.config.getini("timeout") or 0)


def _wait_until(done, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture(autouse=True)
def temp_dir(monkeypatch, tmp_path_factory):
    """Each test's temporary files in a folder of its own (``$TMPDIR`` and ``tempfile``'s default for what it
    starts: torchrun's logs, multiprocessing's folders), removed after it, also what a process it killed
    left there. pytest's own folders (``tmp_path``) stay where they are."""
    tmp_path_factory.getbasetemp()  # made once, where tempfile says before this
    path = tempfile.mkdtemp(prefix="cdltest-")
    monkeypatch.setenv("TMPDIR", path)
    monkeypatch.setattr(tempfile, "tempdir", path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def shm_namespace(monkeypatch, request):
    """Each test runs in its own shm directory (``$COORDL_SHM_DIR``, a fresh folder in /dev/shm that every
    process it starts inherits), so it only ever sees, counts or removes what it created. Afterwards the
    folder must be empty and no process started with it may still run (workers get a moment to go)."""
    path = f"/dev/shm/cdltest-{secrets.token_hex(6)}"
    os.mkdir(path, 0o700)
    monkeypatch.setenv(SHM_DIR_ENV, path)
    marker = f"{SHM_DIR_ENV}={path}".encode()
    timeout = _timeout_s(request)
    dump = threading.Timer(timeout - DUMP_BEFORE_TIMEOUT_S, _dump_stacks, (marker,)) if timeout > 2 * DUMP_BEFORE_TIMEOUT_S \
        else None
    if dump:
        dump.daemon = True
        dump.start()
    yield path
    if dump:
        dump.cancel()
    gone = _wait_until(lambda: not _started_by_test(marker), LEAK_GRACE_S)
    left = _started_by_test(marker)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _wait_until(lambda: not os.listdir(path), 0 if left else LEAK_GRACE_S)
    leaked = sorted(os.listdir(path))
    shutil.rmtree(path, ignore_errors=True)
    assert gone, f"test left processes running: {left}"
    assert not leaked, f"test leaked shared memory: {leaked}"
    assert not os.path.exists(path), f"could not remove {path} (is os patched still?)"


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
