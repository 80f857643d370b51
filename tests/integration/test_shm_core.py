"""The shared-memory core under threads, forks, PID namespaces, pauses, exits and small /dev/shm.

Every race here is forced (a held lock, a paused or killed process, a creator held inside its
creation), not hoped for.
"""

import contextlib
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import coordl
from coordl._cache import minio as minio_cache
from coordl._cache.minio import MinIOCache, cache_segment_name
from coordl._core import shm as _shm
from coordl._core.shm import Probe, segment_path
from coordl._group.membership import HPGroup, group_segment_name
from tests import _procs, _shm_procs
from tests._signals import FileBarrier, FileEvent, FileQueue

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _name() -> str:
    return cache_segment_name(secrets.token_hex(6))


def _group() -> str:
    return f"test-{secrets.token_hex(4)}"


def _coordl(*args, prefix=(), timeout=30):
    return subprocess.run([*prefix, sys.executable, "-m", "coordl.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


# -- threads ---------------------------------------------------------------------------------------

@contextlib.contextmanager
def _held_by_another_thread(lock):
    """``lock`` (a context manager) held by another thread of this process until the block ends."""
    held, release = threading.Event(), threading.Event()

    def hold():
        with lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    try:
        yield
    finally:
        release.set()
        holder.join()


def test_the_segment_lock_excludes_threads_of_one_process():
    with MinIOCache(_name(), n_items=2, capacity_bytes=4096, fingerprint=bytes(32)) as cache:
        cache.stats()
        segment = cache._segment
        with _held_by_another_thread(segment.locked()):
            assert not segment.lock(timeout_s=0.3)  # another thread of the holder's process is kept out
        assert segment.lock(timeout_s=5)
        segment.unlock()


@pytest.mark.slow
def test_processes_with_several_threads_filling_one_cache_never_mix_items(tmp_path):
    name, n_items = _name(), 1500
    barrier = FileBarrier(tmp_path, 2)
    procs = [_procs.spawn(_shm_procs.threads_put_everything, name, n_items, 1 << 20, seed, 3, barrier)
             for seed in range(2)]
    _procs.join_ok(*procs)  # each process checked every item's bytes before leaving


def test_threads_attaching_one_handle_at_once_attach_it_once(monkeypatch):
    opened = minio_cache.Segment.open

    def slow_open(*args, **kwargs):
        time.sleep(0.05)  # every thread is inside the attach at the same time
        return opened(*args, **kwargs)

    monkeypatch.setattr(minio_cache.Segment, "open", slow_open)
    cache = MinIOCache(_name(), n_items=2, capacity_bytes=4096, fingerprint=bytes(32))
    start = threading.Barrier(8)
    threads = [threading.Thread(target=lambda: (start.wait(), cache.stats())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache._segment.live_slots() == [cache._slot]
    assert int((cache._views.users[:, 0] != 0).sum()) == 1
    path = cache._segment.path
    cache.close()
    assert not os.path.exists(path)  # the one registration undone: the last user removed it


# -- forks and crashes -----------------------------------------------------------------------------

@pytest.mark.slow
def test_a_process_killed_holding_the_locks_after_forking_leaves_them_to_nobody(tmp_path):
    cache_name, group = _name(), _group()
    locked = FileQueue(tmp_path)
    proc = _procs.spawn(_shm_procs.fork_then_die_holding_locks, cache_name, group, locked)
    child = locked.get(timeout=_procs.JOIN_TIMEOUT)
    try:
        _wait_for(lambda: proc.exitcode is not None, 10, "the job's death")  # join() would wait for its fork too
        assert proc.exitcode == -signal.SIGKILL and os.path.exists(f"/proc/{child}")  # its fork lives on
        for name in (cache_name, group_segment_name(group)):
            with Probe(segment_path(name)) as probe:
                assert not probe.mutex_held() and not probe.anyone_alive()
        listed = _coordl("cache", "ls")
        assert listed.returncode == 0 and "stale" in listed.stdout.split(cache_name)[1].splitlines()[0]
        assert "stale" in _coordl("group", "ls").stdout
        again = MinIOCache(cache_name, n_items=8, capacity_bytes=1 << 16, fingerprint=_shm_procs.FINGERPRINT)
        assert again.stats().users_alive == 1  # attaches at once, to the dead job's cache
        again.close()
        member = HPGroup(group, config={"batch_size": "4"}, n_batches=3, seed=1, staging_bytes=1 << 20)
        member.join()
        assert member.stats().members_alive == 1  # the dead member was reaped, not waited on
        member.close()
    finally:
        _kill(child)


def test_a_fork_while_another_thread_creates_a_segment_can_create_its_own():
    """A child forked while a thread holds the shm directory's lock (a producer creating a segment while
    the next epoch's workers fork) must not keep that lock: it waits for the parent's creation only."""
    with _held_by_another_thread(_shm._DirLock()):
        pid = os.fork()
        if pid == 0:  # the child: create a segment, as a worker writing a batch does
            code = 1
            try:
                segment = _shm.create_unlocked(_name(), 4096, lambda size, free: RuntimeError("full"))
                segment.unlink()
                segment.close()
                code = 0
            finally:
                os._exit(code)
    deadline = time.monotonic() + 10
    while (status := os.waitpid(pid, os.WNOHANG)) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child waited forever for the lock its parent had released")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(status[1]) == 0


def test_a_staged_segment_stays_claimed_while_any_process_maps_it_paused_forked_or_not(tmp_path):
    """A spare is written again only once ``unclaimed``: a consumer's claim lasts with its mappings, in its
    forks too, whether it runs or is stopped, and goes with the last of them (SIGKILL included)."""
    name = f"cdl_{secrets.token_hex(6)}_s1"
    _shm.create_unlocked(name, 1 << 16, lambda size, free: AssertionError("/dev/shm full")).close()
    assert _shm.unclaimed(name)
    mapped = FileQueue(tmp_path)
    proc = _procs.spawn(_shm_procs.map_staged_then_fork, name, mapped)
    pid, child = mapped.get(timeout=_procs.JOIN_TIMEOUT)
    try:
        assert not _shm.unclaimed(name)
        os.kill(pid, signal.SIGSTOP)
        assert not _shm.unclaimed(name)
        _kill(pid)
        _wait_for(lambda: proc.exitcode is not None, 10, "the job's death")  # join() would wait for its fork too
        assert proc.exitcode == -signal.SIGKILL and not _shm.unclaimed(name)  # its fork maps it still
    finally:
        _kill(child)
    _wait_for(lambda: _shm.unclaimed(name), 10, "the claim to go with the fork")
    _shm.unlink_segment(name)
    assert not _shm.unclaimed(name)  # (no segment, nothing to write)


def test_a_creator_killed_mid_creation_leaves_no_half_made_segment(tmp_path, monkeypatch):
    name = _name()
    proc = _procs.spawn(_shm_procs.create_then_die_mid_creation, name)
    proc.join(_procs.JOIN_TIMEOUT)
    assert proc.exitcode == -signal.SIGKILL
    assert not os.path.exists(segment_path(name))  # never published
    temps = [n for n in os.listdir(_shm.shm_dir()) if "new-" in n]
    assert len(temps) == 1
    cache = MinIOCache(name, n_items=8, capacity_bytes=1 << 16, fingerprint=_shm_procs.FINGERPRINT)
    assert cache.put(1, b"z") and cache.get(1) == b"z"
    cache.close()
    monkeypatch.setattr(_shm, "_TEMP_GRACE_S", 0.0)
    monkeypatch.setattr(_shm, "_reclaimed_in", None)
    _shm.reclaim_dead()
    assert os.listdir(_shm.shm_dir()) == []  # the dead creator's temporary is reclaimed


def test_a_stalled_creator_never_loses_its_segment_to_another_opener(monkeypatch):
    name = _name()
    slow, fast = (MinIOCache(name, n_items=8, capacity_bytes=1 << 16, fingerprint=_shm_procs.FINGERPRINT)
                  for _ in range(2))
    inside, release = threading.Event(), threading.Event()
    real_open = os.open

    def stall_after_creating(path, flags, *args, **kwargs):  # (os.open for everyone until the test ends)
        fd = real_open(path, flags, *args, **kwargs)
        if flags & os.O_EXCL and threading.current_thread() is creator:  # the file exists, nothing else yet
            inside.set()
            release.wait(10)  # far longer than any grace an opener could give
        return fd

    monkeypatch.setattr(_shm.os, "open", stall_after_creating)
    creator = threading.Thread(target=slow.stats)
    creator.start()
    inside.wait(10)
    threading.Timer(1.5, release.set).start()  # longer than the grace openers used to give an empty file
    fast.put(0, b"first")  # an opener while the creator is stalled: it must end up in the same cache
    creator.join()
    assert os.fstat(slow._segment._map_fd).st_ino == os.fstat(fast._segment._map_fd).st_ino  # one cache
    assert slow.get(0) == b"first" and slow.stats().users_alive == 2
    assert [n for n in os.listdir(_shm.shm_dir())] == [name]  # the loser's temporary is gone
    slow.close()
    fast.close()


@pytest.mark.slow
def test_the_next_coordl_process_reclaims_dead_caches_of_any_dataset(tmp_path):
    dead, other = _name(), _name()
    done = FileEvent(tmp_path)
    proc = _procs.spawn(_shm_procs.attach_and_die, dead, done)
    proc.join(_procs.JOIN_TIMEOUT)
    assert proc.exitcode == -signal.SIGKILL and os.path.exists(segment_path(dead))
    proc = _procs.spawn(_shm_procs.attach_other_dataset, other, FileEvent(tmp_path))
    _procs.join_ok(proc)
    assert not os.path.exists(segment_path(dead))


# -- pauses and inspection -------------------------------------------------------------------------

@pytest.mark.slow
def test_a_paused_lock_holder_is_named_and_never_blocks_inspection(tmp_path, monkeypatch, caplog):
    cache_name, group = _name(), _group()
    locked = FileEvent(tmp_path)
    proc = _procs.spawn(_shm_procs.hold_locks_then_stop, cache_name, group, locked)
    try:
        assert locked.wait(_procs.JOIN_TIMEOUT)
        _wait_for(lambda: open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "T", 10, "SIGSTOP")
        started = time.monotonic()
        cache_ls, group_ls = _coordl("cache", "ls"), _coordl("group", "ls")
        assert cache_ls.returncode == group_ls.returncode == 0 and time.monotonic() - started < 20
        assert cache_name in cache_ls.stdout and group_segment_name(group) in group_ls.stdout
        assert _coordl("group", "rm", "--stale", group_segment_name(group)).returncode == 1  # alive: kept

        monkeypatch.setattr(_shm, "_LOCK_WARN_S", 0.3)
        caplog.set_level(logging.WARNING, logger="coordl._core.shm")
        waiter = MinIOCache(cache_name, n_items=8, capacity_bytes=1 << 16, fingerprint=_shm_procs.FINGERPRINT)
        attach = threading.Thread(target=waiter.stats)
        attach.start()
        _wait_for(lambda: "waiting" in caplog.text, 10, "the warning about the held lock")
        assert re.search(rf"lock of cache {cache_name}, held by pid {proc.pid} \(stopped\)", caplog.text)

        removed = _coordl("group", "rm", "--force", group_segment_name(group))
        assert removed.returncode == 0 and not os.path.exists(segment_path(group_segment_name(group)))
        _kill(proc.pid)
        attach.join(10)
        assert not attach.is_alive() and waiter.stats().users_alive == 1
        waiter.close()
    finally:
        _kill(proc.pid)
        proc.join()


def test_listing_reads_only_and_keeps_what_it_does_not_understand(tmp_path):
    done = FileEvent(tmp_path)
    dead = _name()
    proc = _procs.spawn(_shm_procs.attach_and_die, dead, done)
    proc.join(_procs.JOIN_TIMEOUT)
    foreign = segment_path("cdl_0123456789ab_cache")
    with open(foreign, "wb") as f:
        f.write(b"another coordl version's header".ljust(8192, b"\0"))
    os.chmod(foreign, 0o600)
    before = {n: os.stat(segment_path(n)).st_mtime_ns for n in os.listdir(_shm.shm_dir())}
    listed = _coordl("cache", "ls")
    assert listed.returncode == 0
    assert "stale" in listed.stdout.split(dead)[1].splitlines()[0]
    assert "cdl_0123456789ab_cache  (written by another coordl version (unknown layout))" in listed.stdout
    assert {n: os.stat(segment_path(n)).st_mtime_ns for n in os.listdir(_shm.shm_dir())} == before  # untouched
    with Probe(segment_path(dead)) as probe:
        assert not probe.anyone_alive()

    # Another user's segment: listed, not a crash (root without its override capability stands in for a user).
    os.chown(segment_path(dead), 65534, 65534)
    as_user = _coordl("cache", "ls", prefix=("setpriv", "--bounding-set", "-all", "--inh-caps", "-all"))
    assert as_user.returncode == 0, as_user.stderr
    assert f"{dead}  (owned by uid 65534, not readable by this user)" in as_user.stdout

    stale = _coordl("cache", "rm", "--stale")
    assert os.path.exists(foreign) and f"removed {dead}" in stale.stdout
    refused = _coordl("cache", "rm", "cdl_0123456789ab_cache")
    assert refused.returncode == 1 and "pass --force" in refused.stderr and os.path.exists(foreign)
    assert _coordl("cache", "rm", "--force", "cdl_0123456789ab_cache").returncode == 0
    assert os.listdir(_shm.shm_dir()) == []


def test_a_segment_removed_while_it_is_listed_is_left_out(tmp_path, monkeypatch):
    """The race forced: the segment's last user removes it between the listing's two opens of it (the
    segment, then its lock probe); the listing leaves it out instead of failing."""
    done = FileEvent(tmp_path)
    dead = _name()
    proc = _procs.spawn(_shm_procs.attach_and_die, dead, done)
    proc.join(_procs.JOIN_TIMEOUT)
    real_probe = _shm.Probe

    def removed_first(path):
        os.unlink(path)  # as its last user would, just then
        return real_probe(path)
    monkeypatch.setattr(_shm, "Probe", removed_first)
    assert dead in os.listdir(_shm.shm_dir())
    assert [c for c in minio_cache.list_caches() if c.name == dead] == []
    assert dead not in os.listdir(_shm.shm_dir())


# -- containers: PID namespaces --------------------------------------------------------------------

def _in_pid_namespace(*args) -> subprocess.Popen:
    """``python -m tests._shm_procs ARGS`` as PID 1 of a new PID namespace (a container sharing /dev/shm)."""
    return subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "tests._shm_procs",
                             *args], cwd=REPO)


@pytest.mark.slow
def test_jobs_in_different_pid_namespaces_see_each_other_alive(tmp_path):
    cache_name, group, folder = _name(), _group(), str(tmp_path)
    jobs = [_in_pid_namespace("share_until_released", folder, tag, cache_name, group) for tag in ("a", "b")[:1]]
    _wait_for(lambda: os.path.exists(os.path.join(folder, "a.ready")), 60, "job a")
    jobs.append(_in_pid_namespace("share_until_released", folder, "b", cache_name, group))
    _wait_for(lambda: os.path.exists(os.path.join(folder, "b.ready")), 60, "job b")
    try:
        # Both are PID 1 of their own namespace: judged by pid, each would take the other for dead.
        assert open(os.path.join(folder, "b.ready")).read() == "2 2 True"
        open(os.path.join(folder, "a.go"), "w").close()
        assert jobs[0].wait(60) == 0
        open(os.path.join(folder, "b.go"), "w").close()
        assert jobs[1].wait(60) == 0
        assert open(os.path.join(folder, "b.done")).read() == "1 1 True"  # a's leaving removed nothing of b's
    finally:
        for job in jobs:
            job.kill()
            job.wait()
    assert os.listdir(_shm.shm_dir()) == []


# -- exits -----------------------------------------------------------------------------------------

_EXIT_WITHOUT_CLOSE = textwrap.dedent("""
    import sys, torchvision, coordl
    class Flaky(torchvision.datasets.ImageFolder):
        def __getitem__(self, i):
            if sys.argv[2] == "raise" and i == 5:
                raise ValueError("a bad sample")
            return super().__getitem__(i)
    dataset = coordl.FileDataset([p for p, _ in torchvision.datasets.ImageFolder(sys.argv[1]).samples], decode="bytes")
    loader = coordl.DataLoader(dataset, batch_size=8, num_workers=2, persistent_workers=True, collate_fn=list)
    for batch in loader:
        pass
    if sys.argv[2] == "raise":
        bad = coordl.DataLoader(Flaky(sys.argv[1]), batch_size=8, num_workers=2, persistent_workers=True,
                                collate_fn=list)
        try:
            for batch in bad:
                pass
        except ValueError:
            print("caught")
    print("done")
""")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["normally", "raise"])
def test_a_script_that_never_closes_its_persistent_workers_leaves_nothing(image_root, how):
    done = subprocess.run([sys.executable, "-c", _EXIT_WITHOUT_CLOSE, image_root, how], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == (["caught", "done"] if how == "raise" else ["done"])
    assert os.listdir(_shm.shm_dir()) == []  # at once: the exit itself removed it


# -- sizing ----------------------------------------------------------------------------------------

@pytest.fixture
def small_shm(tmp_path, monkeypatch):
    """A private tmpfs of a chosen size as the shm directory (the test's own namespace, bounded)."""
    mounted = []

    def mount(size: str) -> str:
        path = tmp_path / f"shm-{len(mounted)}"
        path.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
        mounted.append(path)
        monkeypatch.setenv("COORDL_SHM_DIR", str(path))
        return str(path)

    yield mount
    for path in mounted:
        leaked = os.listdir(path)
        subprocess.run(["umount", "-l", str(path)], check=True)
        assert not leaked, f"left in {path}: {leaked}"


def _huge_files(tmp_path, n=3) -> list[str]:
    files = []
    for i in range(n):  # sparse: terabytes of dataset, no disk used
        files.append(str(tmp_path / f"huge{i}.bin"))
        with open(files[-1], "wb") as f:
            f.truncate(8 * 2**40)
    return files


def test_the_size_an_error_suggests_fits(tmp_path, small_shm):
    small_shm("8m")
    dataset = coordl.FileDataset(_huge_files(tmp_path, n=1) * 100_000, decode="bytes")  # an index of 3.5 MiB
    with pytest.raises(coordl.ShmCapacityError) as raised:
        coordl.DataLoader(dataset, cache_bytes="1GiB")
    message = str(raised.value)
    needed, free = re.search(r"needs (\S+ \S+) of .*, which has (\S+ \S+) free", message).groups()
    assert needed.startswith("1.0 GiB") and free.endswith("MiB") and float(free.split()[0]) <= 8
    suggested = re.search(r"cache_bytes='([^']+)'", message).group(1)
    with coordl.DataLoader(dataset, cache_bytes=suggested) as loader:
        assert loader.dataset.cache.stats().capacity_bytes == coordl._core.sizes.parse_bytes(suggested)


def test_auto_counts_the_index_and_turns_the_cache_off_when_nothing_fits(tmp_path, small_shm):
    from coordl._cache.setup import auto_capacity
    small_shm("64m")  # docker's default /dev/shm
    imagenet = 1_281_167
    capacity, keep = auto_capacity(imagenet)
    assert capacity > 0 and keep > 0
    cache = MinIOCache(_name(), n_items=imagenet, capacity_bytes=capacity, fingerprint=bytes(32),
                       require_capacity=False, keep_free_bytes=keep)
    assert cache.stats().capacity_bytes == capacity  # its index fits beside what auto leaves free
    assert cache.put(imagenet - 1, b"last item")
    cache.close()

    small_shm("16k")  # not even the index of 3 items fits
    with pytest.warns(UserWarning, match=r"has no room for a cache of this dataset .* loads uncached"):
        loader = coordl.DataLoader(coordl.FileDataset(_huge_files(tmp_path), decode="bytes"))
    assert loader.dataset.cache is None
    loader.close()


def test_explicit_caches_that_fit_only_alone_are_both_made_and_the_later_fill_freezes(small_shm):
    small_shm("64m")
    first, second = (MinIOCache(_name(), n_items=64, capacity_bytes=40 * 2**20, fingerprint=bytes(32))
                     for _ in range(2))
    assert first.stats().allocated_bytes == second.stats().allocated_bytes == 0  # nothing taken up front
    item = b"x" * 2**20
    assert all(first.put(i, item) for i in range(40))
    stored = sum(second.put(i, item) for i in range(40))
    assert 0 < stored < 40 and second.stats().frozen  # the file system ran short: it stopped, never SIGBUS
    assert all(bytes(first.get(i)) == item for i in range(40)) and bytes(second.get(0)) == item
    first.close()
    second.close()


_STARVE = textwrap.dedent("""
    import os, sys, torch, coordl
    files = [os.path.join(sys.argv[1], name) for name in sorted(os.listdir(sys.argv[1]))]
    def to_tensor(raw):  # 1 MiB per sample: batches of 4 MiB cross from workers through /dev/shm
        return torch.full((256 * 1024,), float(raw[0]))
    loader = coordl.DataLoader(coordl.FileDataset(files, decode=to_tensor), batch_size=4, shuffle=True,
                               num_workers=2, persistent_workers=True)
    for epoch in range(2):
        for batch in loader:
            pass
    stats = loader.stats()
    print(stats.cache.allocated_bytes, stats.epochs[1].hits, stats.epochs[1].samples)
""")


@pytest.mark.slow
def test_an_auto_cache_leaves_room_for_torchs_worker_batches(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(60):  # 36 MiB of files: more than what a 48 MiB /dev/shm can hold beside the batches
        (data / f"{i:03d}.bin").write_bytes(os.urandom(600 * 1024))
    script = ("mount -t tmpfs -o size=48m tmpfs /dev/shm && "
              f"COORDL_SHM_DIR=/dev/shm exec {sys.executable} -c \"$0\" {data}")
    done = subprocess.run(["unshare", "--mount", "sh", "-c", script, _STARVE], capture_output=True, text=True,
                          timeout=180, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    allocated, hits, samples = map(int, done.stdout.split())
    in_flight = 2 * 2 * 4 * 2**20
    assert 0 < allocated <= 48 * 2**20 - in_flight and samples == 60
    assert 0 < hits < 60  # it cached what fit, and no more
