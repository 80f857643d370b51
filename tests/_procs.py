"""Module-level process targets for multi-process tests (picklable under spawn) and a runner."""

import contextlib
import faulthandler
import glob
import multiprocessing as mp
import os
import random
import resource
import signal
import sys
import time

from coordl._core.sysinfo import descendants

JOIN_TIMEOUT = 60
"""Seconds a test process may run. Generous: CI machines are small and shared."""


PRELOADED = ["torch", "torchvision", "coordl.loader", "coordl._dali.pipeline"]
"""What the jobs' forkserver imports once, so that a job starts without paying for it (seconds of CPU each)."""


def spawn(target, *args) -> mp.Process:
    """Start ``target(*args)`` as an independent job: a process of its own forked from a forkserver that has
    imported :data:`PRELOADED` and nothing else (no state of the test's), with the test's environment, working
    directory and stack dumps on SIGUSR2 (the conftest's guards find it by :func:`forkserver_descendants`)."""
    start_forkserver()
    job = (dict(os.environ), os.getcwd(), mp.get_start_method(), target, args)
    proc = mp.get_context("forkserver").Process(target=_as_job, args=job)
    proc.start()
    return proc


def start_forkserver() -> None:
    """Start the jobs' forkserver unless it runs; it imports :data:`PRELOADED` in the background (the conftest
    starts it with the session, so that no test waits for that)."""
    mp.get_context("forkserver").set_forkserver_preload(PRELOADED)
    from multiprocessing import forkserver
    forkserver.ensure_running()


def _as_job(environ: dict, cwd: str, start_method: str, target, args) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    mp.set_start_method(start_method, force=True)  # a forkserver's child starts its own children by forkserver
    faulthandler.register(signal.SIGUSR2, file=sys.__stderr__, all_threads=True)
    target(*args)


def forkserver_descendants() -> list[int]:
    """The processes the jobs' forkserver has started (and theirs), which carry the environment it was started
    with, not their test's."""
    from multiprocessing import forkserver
    server = forkserver._forkserver._forkserver_pid
    return [] if server is None else sorted(descendants(server))


def write_environment(path: str) -> None:
    """A job that writes the shm directory it was given (``COORDL_SHM_DIR``) to ``path``."""
    with open(path, "w") as f:
        f.write(os.environ["COORDL_SHM_DIR"])


def join_ok(*procs: mp.Process, timeout: float = JOIN_TIMEOUT) -> None:
    """Join every process; on a hang dump its stacks (SIGUSR1 -> faulthandler) before killing it."""
    for proc in procs:
        proc.join(timeout)
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(1)
            proc.kill()
            proc.join()
            raise AssertionError(f"process {proc.pid} hung (stacks dumped to stderr)")
        assert proc.exitcode == 0, f"process {proc.pid} exited with {proc.exitcode}"


def command_lines(match) -> list[str]:
    """Command lines of this machine's processes for which ``match(command_line)`` holds."""
    found = []
    for proc_dir in glob.glob("/proc/[0-9]*"):
        try:
            with open(f"{proc_dir}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace").replace("\0", " ")
        except OSError:
            continue
        if match(cmdline):
            found.append(f"{os.path.basename(proc_dir)}: {cmdline}")
    return found


def _debuggable() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def run_loader_epochs(root: str, cache_bytes: int, epochs: int, num_workers: int, results, start_event,
                      release_event):
    """A job: wait for ``start_event``, run ``epochs`` epochs over ImageFolder(root), report its stats,
    and keep its loader (and so the cache) until ``release_event``."""
    _debuggable()
    import torchvision
    import coordl
    start_event.wait(JOIN_TIMEOUT)
    loader = coordl.DataLoader(torchvision.datasets.ImageFolder(root), batch_size=8, shuffle=True,
                               num_workers=num_workers, cache_bytes=cache_bytes, collate_fn=list)
    for _ in range(epochs):
        for _ in loader:
            pass
    stats = loader.stats()
    results.put((os.getpid(), loader.dataset.cache.name, [(e.hits, e.misses) for e in stats.epochs],
                 stats.cache.items_cached))
    release_event.wait(JOIN_TIMEOUT)
    loader.close()


def iterate_pickled_loader(blob: bytes, results) -> None:
    """A job: unpickle a coordl loader, run one epoch, report each epoch its stats hold as [samples, hits,
    misses]."""
    _debuggable()
    import pickle
    loader = pickle.loads(blob)
    for _ in loader:
        pass
    results.put([[e.samples, e.hits, e.misses] for e in loader.stats().epochs])
    loader.close()


def iterate_slowly_forever(root: str, cache_bytes: int, num_workers: int, progress_file: str):
    """A job that fills the cache slowly and reports batches done, until it is killed."""
    _debuggable()
    os.setsid()  # its own process group, so the test can SIGKILL it together with its workers
    import torchvision
    import coordl
    loader = coordl.DataLoader(torchvision.datasets.ImageFolder(root), batch_size=4, shuffle=True,
                               num_workers=num_workers, cache_bytes=cache_bytes, collate_fn=list,
                               persistent_workers=num_workers > 0)
    done = 0
    while True:
        for _ in loader:
            done += 1
            with open(progress_file, "w") as f:
                f.write(str(done))
            time.sleep(0.05)


def hammer_puts(name: str, n_items: int, item_bytes: int, capacity: int, seed: int, started, go,
                pause_after: int | None = None, paused=None):
    """Once ``go`` is set, insert every item (content derived from its index) in a random order,
    forever, until killed. With ``pause_after``: the insert after that many stops once its slot is
    reserved, before its bytes are copied, sets ``paused`` and waits to be killed there."""
    from coordl._cache.minio import MinIOCache
    cache = MinIOCache(name, n_items=n_items, capacity_bytes=capacity, fingerprint=bytes(32), label="test")
    cache.stats()
    if pause_after is not None:  # wrap the two steps put takes under the cache's lock
        cache._ensure()
        reserve, locked, reserved, inserts = cache._reserve, cache._segment.locked, [], [0]

        def reserve_noted(views, index, size):
            offset = reserve(views, index, size)
            reserved.append(offset is not None)
            return offset

        @contextlib.contextmanager
        def locked_then_pause(**kwargs):
            reserved.clear()
            with locked(**kwargs):
                yield
            if reserved == [True]:  # the lock released, the slot reserved and marked as this writer's
                if inserts[0] >= pause_after:
                    paused.set()
                    time.sleep(3600)
                inserts[0] += 1

        cache._reserve, cache._segment.locked = reserve_noted, locked_then_pause
    started.set()
    go.wait(JOIN_TIMEOUT)
    rng = random.Random(seed)
    while True:
        for i in rng.sample(range(n_items), n_items):
            cache.put(i, item_payload(i, item_bytes))


def item_payload(index: int, size: int) -> bytes:
    """Deterministic, index-specific content of ``size`` bytes."""
    return index.to_bytes(4, "little") * (size // 4)


def put_all_and_report(name: str, n_items: int, capacity: int, seed: int, results, barrier):
    """Together with the others at ``barrier``: insert every item once in a random order, check
    every item's content, and report how many inserts this process won."""
    from coordl._cache.minio import MinIOCache
    cache = MinIOCache(name, n_items=n_items, capacity_bytes=capacity, fingerprint=bytes(32), label="test")
    cache.stats()
    order = random.Random(seed).sample(range(n_items), n_items)
    barrier.wait(JOIN_TIMEOUT)
    won = sum(cache.put(i, item_payload(i, 1000 + i)) for i in order)
    barrier.wait(JOIN_TIMEOUT)
    assert all(cache.get(i) == item_payload(i, 1000 + i) for i in range(n_items))
    results.put(won)
    barrier.wait(JOIN_TIMEOUT)
    cache.close()


def hold_lock_then_die(name: str, n_items: int, capacity: int, locked_event):
    """Take the cache's lock and die with SIGKILL while holding it."""
    from coordl._cache.minio import MinIOCache
    cache = MinIOCache(name, n_items=n_items, capacity_bytes=capacity, fingerprint=bytes(32), label="test")
    cache.stats()
    with cache._segment.locked():
        locked_event.set()
        os.kill(os.getpid(), signal.SIGKILL)


class IndexFiles:
    """A RawBytesDataset of tiny files that hold their own index (so a test knows which sample it got).

    A sample is ``(index, draw, payload)``: ``draw`` is a random "augmentation" drawn at decode time, so
    batches prepared twice differ; ``payload`` (``payload_floats`` copies of the index) gives batches a size.
    ``decode_delay_s`` makes preparation slow.
    """

    def __init__(self, root: str, n: int, transform=None, payload_floats: int = 16, decode_delay_s: float = 0.0):
        self.files = [os.path.join(root, f"{i:05d}.bin") for i in range(n)]
        self.transform, self.payload_floats, self.decode_delay_s = transform, payload_floats, decode_delay_s
        self.fetch_delay_s = 0.0  # a slow disk, for the DALI backend (which does not call decode_raw)

    @staticmethod
    def write(root: str, n: int) -> None:
        os.makedirs(root, exist_ok=True)
        for i in range(n):
            with open(os.path.join(root, f"{i:05d}.bin"), "wb") as f:
                f.write(i.to_bytes(4, "little"))

    def __len__(self) -> int:
        return len(self.files)

    def raw_key(self, index: int) -> str:
        if self.fetch_delay_s:
            time.sleep(self.fetch_delay_s)
        return self.files[index]

    def decode_raw(self, index: int, raw: bytes):
        import torch
        if self.decode_delay_s:
            time.sleep(self.decode_delay_s)
        draw = torch.rand(())
        if self.transform is not None:
            draw = self.transform(draw)
        index = int.from_bytes(raw, "little")
        return torch.tensor(index), draw, torch.full((self.payload_floats,), float(index))

    def __getitem__(self, index: int):
        with open(self.files[index], "rb") as f:
            return self.decode_raw(index, f.read())

    def dali_target(self, index: int) -> int:
        return index


def index_and_draw(encoded, target, *, device, train):
    """A DALI pipeline function for IndexFiles: (the sample's index, a random draw per sample)."""
    from nvidia.dali import fn
    return target, fn.random.uniform(encoded.shape(), range=[0.0, 1.0])


def index_only(encoded, target, *, device, train):
    """A DALI pipeline function for IndexFiles: the sample's index."""
    return target


def hp_dali_job(root: str, n: int, group: str, epochs: int, results, start, jobs: int = 2, kill_after: int = 0):
    """An hp_group job on the DALI backend: puts ``(pid, [[(indices, draws) per batch] per epoch], stats)``;
    with ``kill_after``, SIGKILLs itself after that many batches of its first epoch instead."""
    os.setsid()
    import coordl
    start.wait(JOIN_TIMEOUT)
    dataset = IndexFiles(root, n)
    dataset.fetch_delay_s = 0.05 if kill_after else 0.0  # the job to be killed still has batches to make
    loader = coordl.DataLoader(dataset, batch_size=4, shuffle=True, backend="dali",
                               dali_pipeline=index_and_draw, hp_group=group, hp_group_size=jobs,
                               hp_group_timeout_s=30, cache_bytes=0)
    seen = []
    for _ in range(epochs):
        batches = []
        for index, draw in loader:
            batches.append((index.tolist(), draw.flatten().tolist()))
            if kill_after and len(batches) == kill_after:
                os.killpg(os.getpid(), signal.SIGKILL)
            time.sleep(0.02)
        seen.append(batches)
    stats = loader.stats().as_dict()
    loader.close()
    results.put((os.getpid(), seen, stats))


def copied_collate(batch):
    """torch's ``default_collate`` as a ``collate_fn`` of a user's own: an hp_group's producer copies its
    batches into segments of their own (and keeps them as spares)."""
    import torch.utils.data
    return torch.utils.data.default_collate(batch)


class Scale:
    """A picklable transform with a meaningful repr."""

    def __init__(self, factor: float):
        self.factor = factor

    def __call__(self, x):
        return x * self.factor

    def __repr__(self) -> str:
        return f"Scale({self.factor})"


def hp_job(root: str, n: int, group: str, epochs: int, results, options: dict, start=None, progress=None,
           ready=None):
    """A training job in hp_group ``group``: sets ``ready`` (if any) once imported, then after ``start`` (if
    any) runs ``epochs`` epochs and puts ``(pid, [(epoch, [(indices, draws) per batch]) ...], stats dict)``
    on ``results``; sets ``progress`` (if any) after its first batch.

    ``options``: ``transform``/``payload_floats``/``decode_delay_s`` for the dataset, ``step_s`` (sleep per batch: a
    slow training step), ``hold`` (keep every batch of an epoch, and check at its end that each payload still holds
    its indices: nothing rewrote the memory under it), ``kill_self_after`` (SIGKILL itself after that many batches
    of epoch ``kill_epoch``, default 1), ``max_open_files`` (the process's RLIMIT_NOFILE), ``via`` (``"parts"``:
    iterate a plain torch DataLoader built from the loader's dataset, batch_sampler and collate_fn;
    ``"accelerate"``: what ``Accelerator.prepare`` makes of it), ``load_state``/``save_state`` (a file the loader's
    state is loaded from before its epochs, saved to after them), ``seed`` (the loader's ``generator``'s seed),
    anything else goes to ``coordl.DataLoader``.
    """
    _debuggable()
    os.setsid()  # its own process group: a test can kill it with its workers
    import torch

    import coordl
    options = dict(options)
    dataset = IndexFiles(root, n, transform=options.pop("transform", None),
                         payload_floats=options.pop("payload_floats", 16),
                         decode_delay_s=options.pop("decode_delay_s", 0.0))
    step_s, kill_after = options.pop("step_s", 0.0), options.pop("kill_self_after", 0)
    hold = options.pop("hold", False)
    kill_epoch = options.pop("kill_epoch", 1)
    max_open_files, via = options.pop("max_open_files", None), options.pop("via", None)
    load_state, save_state = options.pop("load_state", None), options.pop("save_state", None)
    if "seed" in options:
        options["generator"] = torch.Generator().manual_seed(options.pop("seed"))
    if max_open_files:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max_open_files, max_open_files))
    if ready is not None:
        ready.set()
    if start is not None:
        start.wait(JOIN_TIMEOUT)
    loader = coordl.DataLoader(dataset, hp_group=group, **{"batch_size": 4, "shuffle": True, **options})
    if load_state:
        loader.load_state_dict(torch.load(load_state))
    batches_of = loader
    if via == "parts":
        import torch.utils.data
        batches_of = torch.utils.data.DataLoader(loader.dataset, batch_sampler=loader.batch_sampler,
                                                 collate_fn=loader.collate_fn, num_workers=loader.num_workers)
    elif via == "accelerate":
        from accelerate import Accelerator
        batches_of = Accelerator(cpu=True).prepare(loader)
    seen = []
    for epoch in range(1, epochs + 1):
        batches, held = [], []
        for k, (index, draw, payload) in enumerate(batches_of):
            batches.append((index.tolist(), draw.tolist()))
            if hold:
                held.append((index, payload))
            if progress is not None:
                progress.set()
            if step_s:
                time.sleep(step_s)
            if kill_after and epoch == kill_epoch and k + 1 == kill_after:
                os.killpg(os.getpid(), signal.SIGKILL)
        for index, payload in held:
            assert torch.equal(payload, index.to(payload.dtype)[:, None].expand_as(payload)), "a held batch changed"
        seen.append((loader.stats().epochs[-1].epoch, batches))
    stats = loader.stats().as_dict()
    if save_state:
        torch.save(loader.state_dict(), save_state)
    loader.close()
    results.put((os.getpid(), seen, stats))


def join_group_then_die(group: str, joined):
    """Join hp_group ``group``, start its first epoch, then die by SIGKILL (leaving a stale group)."""
    from coordl._group.membership import HPGroup
    member = HPGroup(group, config={"batch_size": "4"}, n_batches=3, seed=1, staging_bytes=1 << 20)
    member.join()
    member.start_epoch()
    joined.set()
    os.kill(os.getpid(), signal.SIGKILL)


def agree_peer_secret(rank: int, world: int, store_port: int, out: str):
    """Join a gloo group of ``world`` through the store at ``store_port`` as ``rank``, agree on the peers'
    secret as a partitioned loader does (none given), and write it to ``out`` (hex)."""
    import torch.distributed as dist
    from coordl import partitioned
    for name in (partitioned.SECRET_ENV, partitioned.SECRET_FILE_ENV):
        os.environ.pop(name, None)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    topology = partitioned.Topology(rank=rank, world=world, local_rank=0, local_world=1, node=rank, nodes=world,
                                    master_addr="127.0.0.1", master_port=store_port, run="secret")
    secret = partitioned.job_secret(topology)
    dist.barrier()  # torch 2.6's gloo may hang destroying a group while the other rank still uses it
    dist.destroy_process_group()
    with open(out, "w") as f:
        f.write(secret.hex())


if __name__ == "__main__":
    sys.exit("not a script")
