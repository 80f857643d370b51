"""``sudo python -m benchmarks.analyzer [--quick] --out DIR``: how well ``coordl analyze`` predicts a job.

For each configuration (cache fraction × storage bandwidth × workers) on a dataset copied onto a loop
device of its own, read through a cgroup that throttles (and counts) that device only:

1. ``coordl analyze`` runs ``benchmarks/analyzer_job.py`` (a small training script: random crops of an
   ImageFolder, a ``--step-ms`` step) and predicts its steady-epoch samples/s, min(F, P, G);
2. the same script runs ``--reps`` times as configured for ``--epochs`` epochs; the measured throughput is
   the median over runs of the epochs after the first (the cache filled) samples/s.

With ``--analyses N`` (at most ``--reps``), the configuration is analyzed N times, each analysis just
before one of the runs, and the prediction is their median (``predicted_spread``): the analyses and the
runs then see the same stretches of a machine whose speed moves.

The multi-server rows (``--servers N``, default 2; 0: none) run the job over N servers with partitioned
caching, each server a network and mount namespace of its own (``harness/cluster.py``) with its own cgroup
throttling the device to the row's MB/s, its own cache of the row's fraction of the dataset, one rank and
one core (``taskset``): every server runs ``coordl analyze`` of its torchrun node at once, the prediction
is the slowest server's, and the measured throughput a rank's (the ranks all-reduce after each step, so
they go at the slowest one's pace).

Every run and every analysis gets a fresh cgroup and a shm folder of its own (no cache carries over).
Memory is bounded: the cgroup (each server's, on the multi-server rows) holds the processes to what they
hold, plus the row's cache as shared memory from the start, plus a page cache of :data:`PAGE_CACHE_BUDGET`
bytes (the cache is the job's whole memory for data), the bound following them every 20 ms
(``harness.storage_env.MemoryFollower``): a run's (each server's, on a multi-server row) from the moment
its job has built its loader (its imports and start-up unbounded, as in ``benchmarks.coordprep``: in a short
run they would make most of the samples), an analysis's from its start. Each run's page cache
(99th percentile and peak), held memory and limit hits are recorded (``memory``) and a run over its budget is
named in ``over_budget``. The
loader drops what it reads from the page cache (``drop_page_cache=True``), so each epoch's misses come
from the device, which the cgroup's counters check (``device_bytes_per_epoch``). Configurations run in a
shuffled order. ``results.json``: ``configs: [{cache_fraction, read_mbps, workers, predicted_samples_per_s,
measured_samples_per_s, measured_spread, error, bottleneck, analysis_s, ...}]``, ``median_abs_error``,
``max_abs_error``; ``setup.json``: machine, git SHA, load, settings; ``results.md``; ``analyzer.png``
(predicted against measured, Fig. 11 style).
"""

import argparse
import json
import os
import random
import secrets
import shutil
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable

from benchmarks import report
from benchmarks.metrics import spread
from coordl._core.shm import shm_dir
from harness.storage_env import (PREFIX, SLACK_BYTES, Cleanup, cgroup_version, device_read_bytes, evict_files,
                                    over_budget, prepare_storage, run_child)

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "analyzer_job.py")
FULL = dict(fractions=(0.0, 0.25, 0.5, 0.75, 1.0), mbps=(10.0, 20.0, 40.0), workers=(1, 2), reps=3)
QUICK = dict(fractions=(0.0, 1.0), mbps=(4.0,), workers=(1,), reps=1)
SERVERS_FULL = dict(fractions=(0.25, 0.5), mbps=(10.0, 20.0, 40.0), workers=(1,))
SERVERS_QUICK = dict(fractions=(0.25,), mbps=(20.0,), workers=(1,))
PAGE_CACHE_BUDGET = 0
"""The page cache each run may keep beyond :data:`~harness.storage_env.SLACK_BYTES`: none, the job's
cache is its memory for data."""
MEMORY_FIGURES = ("p99_page_cache_bytes", "peak_page_cache_bytes", "peak_held_bytes", "peak_shmem_bytes",
                  "limit_hits")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.analyzer", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="where results.json, setup.json, results.md and the plot go")
    parser.add_argument("--quick", action="store_true", help="2 configurations, 1 run each, a small dataset")
    parser.add_argument("--servers", type=int, default=2,
                        help="servers of the multi-server rows (default 2; 0 or 1: no multi-server rows)")
    parser.add_argument("--multi-server-only", action="store_true", help="only the multi-server rows")
    parser.add_argument("--workers", type=int, nargs="+", help="the one-server rows' workers (default 1 2)")
    parser.add_argument("--fractions", type=float, nargs="+",
                        help="the one-server rows' cache fractions (default 0 0.25 0.5 0.75 1)")
    parser.add_argument("--mbps", type=float, nargs="+", help="the one-server rows' storage MB/s (default 10 20 40)")
    parser.add_argument("--analyses", type=int, default=1,
                        help="analyses per configuration, each before one of the runs (more than 1: the prediction "
                             "is their median; default 1)")
    add_job_arguments(parser, epochs=3)
    return parser.parse_args(argv)


def add_job_arguments(parser: argparse.ArgumentParser, *, epochs: int) -> None:
    """The dataset, the job (``analyzer_job.py``) and the analyses' settings, shared with ``benchmarks.knees``."""
    parser.add_argument("--images", type=int, help="JPEGs in the dataset (default 600; quick: 120)")
    parser.add_argument("--mean-side-px", type=int, default=400, help="mean side of the JPEGs (default 400)")
    parser.add_argument("--epochs", type=int, default=epochs, help=f"epochs of each measured run (default {epochs})")
    parser.add_argument("--step-ms", type=float, default=20.0, help="the training step per batch (default 20)")
    parser.add_argument("--backend", choices=("torch", "dali"), default="torch",
                        help="the job's coordl.DataLoader backend (default torch; dali: DALI on the CPU)")
    parser.add_argument("--iters", type=int, default=40, help="coordl analyze --iters (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="coordl analyze --warmup (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default="/var/tmp", help="where the dataset's disk image goes")


def _cgroup(cleanup: Cleanup, storage, config: dict):
    """A fresh cgroup for one run of ``config``: reads of the dataset's device throttled to its MB/s, memory
    bounded to what the processes hold, its cache and :data:`PAGE_CACHE_BUDGET`."""
    name = f"{PREFIX}-analyzer-{os.getpid()}-{time.monotonic_ns()}"
    return cleanup.cgroup(name, storage.cgroup_version, storage.device, int(config["read_mbps"] * 1e6),
                          page_cache_bytes=PAGE_CACHE_BUDGET, shm_reserve_bytes=config["cache_bytes"])


def memory_figures(memory: dict, where: str) -> dict:
    """What a run's cgroup held (:data:`MEMORY_FIGURES` of its ``memory_summary``), and ``over_budget``: why
    its page cache broke :data:`PAGE_CACHE_BUDGET` (or was never sampled), named with ``where``, or None."""
    why = over_budget(memory, PAGE_CACHE_BUDGET) if memory else "its memory was not followed (no samples)"
    return {**{k: memory.get(k) for k in MEMORY_FIGURES}, "over_budget": f"{where}: {why}" if why else None}


def over_budget_of(done: dict) -> list[str]:
    """Why an analysis or a run (:func:`analyze`, :func:`measure` and their multi-server twins) broke its
    memory budget, one reason per group that did."""
    return [m["over_budget"] for m in done["memory"] if m["over_budget"]]


def _run(cmd: list[str], group, timeout_s: float, where: str,
         measure_when: Callable[[], bool] | None = None) -> tuple[str, int, list[dict]]:
    """Run ``cmd`` in ``group`` (None: in none) with a shm folder of its own; its stdout, the device bytes it
    read and what its group held (``[memory_figures]``, named with ``where``; [] in none), followed from the
    start or from the moment ``measure_when()`` is true."""
    shm = tempfile.mkdtemp(prefix=f"{PREFIX}-analyzer-", dir=shm_dir())
    previous = os.environ.get("COORDL_SHM_DIR")
    os.environ["COORDL_SHM_DIR"] = shm
    try:
        result = run_child(cmd, timeout_s, group, measure_when)
        read = device_read_bytes(group.counter()) if group else 0
    finally:
        if group:
            group.remove()
        shutil.rmtree(shm, ignore_errors=True)
        if previous is None:
            os.environ.pop("COORDL_SHM_DIR", None)
        else:
            os.environ["COORDL_SHM_DIR"] = previous
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed ({'timed out' if result.timed_out else result.returncode})"
                           f": {result.stderr[-3000:]}")
    return result.stdout, read, [memory_figures(result.memory, where)] if group else []


def analyze(cleanup, storage, config: dict, args, out_dir: str, bounded: bool = True) -> dict:
    """``coordl analyze`` of ``config`` in its cgroup (not ``bounded``: in none): its analysis.json, and how
    long it took."""
    group = _cgroup(cleanup, storage, config) if bounded else None
    started = time.monotonic()
    cmd = [sys.executable, "-m", "coordl.cli", "analyze", "--out", out_dir, "--iters", str(args.iters), "--warmup",
           str(args.warmup), "--", sys.executable, JOB, storage.root, *_job_args(config, args)]
    _, _, memory = _run(cmd, group, 1800, "coordl analyze")
    with open(os.path.join(out_dir, "analysis.json")) as f:
        return {**json.load(f), "analysis_s": time.monotonic() - started, "memory": memory}


def _job_args(config: dict, args) -> list[str]:
    """The job's options for ``config``; its ``step_ms``, ``batch_size`` and ``workload`` where it has them (the
    held-out grid's rows), else the run's ``--step-ms``, batches of 16 and decoded images; with its
    ``disk_bytes``, a disk tier of that quota in a fresh folder under its ``disk_root`` (each run fills its own)."""
    disk = ("--cache-dir", os.path.join(config["disk_root"], f"disk-{time.monotonic_ns()}"), "--cache-dir-bytes",
            config["disk_bytes"]) if config.get("disk_bytes") else ()
    return [str(a) for a in ("--cache-bytes", config["cache_bytes"], "--workers", config["workers"], "--step-ms",
                             config.get("step_ms", args.step_ms), "--backend", args.backend, "--batch-size",
                             config.get("batch_size", 16), "--workload", config.get("workload", "decode"), *disk)]


def _on_servers(storage, config: dict, work: str, argv_of, where: str, bounded: bool = True,
                measure_when: Callable[[int], bool] | None = None) -> tuple[int, list[dict]]:
    """Run ``JOB`` on ``config["servers"]`` fresh servers, server k's torchrun node under ``argv_of(k)`` on
    core k, each server's memory bounded as one run's (:func:`_cgroup`) unless not ``bounded`` (from the
    start, or server k's from the moment ``measure_when(k)`` is true); the device bytes they read and each
    bounded server's :func:`memory_figures` (named with ``where``). Raises RuntimeError: one failed (with
    each server's log)."""
    from harness.cluster import Cluster
    n = config["servers"]
    cores = sorted(os.sched_getaffinity(0))
    with Cluster(n, os.path.join(work, f"cluster-{time.monotonic_ns()}"), device=storage.device,
                 read_bps=int(config["read_mbps"] * 1e6), page_cache_bytes=PAGE_CACHE_BUDGET if bounded else None,
                 shm_reserve_bytes=config["cache_bytes"], measure_when=measure_when, isolation="netns") as cluster:
        secret = secrets.token_hex(16)  # the job's, the same on every server
        for k in range(n):
            prefix, job = argv_of(k)
            cluster.launch(k, JOB, job, env={"COORDL_PEER_SECRET": secret},
                           prefix=["taskset", "-c", str(cores[k % len(cores)]), *prefix])
        codes = cluster.wait(1800)
        if codes != [0] * n:
            raise RuntimeError(f"{config}: exit codes {codes}\n" + "\n".join(cluster.log(k)[-3000:] for k in range(n)))
        read = sum(cluster.device_read_bytes(k) for k in range(n))
    return read, [memory_figures(memory, f"{where} on server {k}") for k, memory in enumerate(cluster.memory)]


def analyze_servers(cleanup, storage, config: dict, args, out_dir: str, bounded: bool = True) -> dict:
    """``coordl analyze`` on every server of ``config`` at once (``bounded``: see :func:`_on_servers`): the
    slowest server's analysis.json (each server's in ``out_dir/server<k>``), and how long it took."""
    outs = [os.path.join(out_dir, f"server{k}") for k in range(config["servers"])]
    started = time.monotonic()
    _, memory = _on_servers(storage, config, cleanup.workdir(args.workdir), lambda k: (
        [sys.executable, "-m", "coordl.cli", "analyze", "--out", outs[k], "--iters", str(args.iters), "--warmup",
         str(args.warmup), "--"], [storage.root, *_job_args(config, args)]), "coordl analyze", bounded)
    docs = []
    for out in outs:
        with open(os.path.join(out, "analysis.json")) as f:
            docs.append(json.load(f))
    slowest = min(docs, key=lambda d: d["predicted_samples_per_s"])
    return {**slowest, "analysis_s": time.monotonic() - started, "memory": memory,
            "servers_predicted": [d["predicted_samples_per_s"] for d in docs]}


def measure_servers(cleanup, storage, config: dict, args, work: str) -> dict:
    """One run of the job over ``config["servers"]`` servers: a rank's steady samples/s (the slowest's),
    device bytes per epoch (all servers), the hits' shares from the own cache and from the peers."""
    out = os.path.join(work, f"epochs-{time.monotonic_ns()}.json")
    started = out + ".started"  # server k's rank has built its loader at started.rank<k>: bounded from then on
    read, memory = _on_servers(storage, config, work, lambda k: (
        [], [storage.root, *_job_args(config, args), "--epochs", str(args.epochs), "--out", out, "--started",
             started]), "run", measure_when=lambda k: os.path.exists(f"{started}.rank{k}"))
    ranks = []
    for rank in range(config["servers"]):
        with open(f"{out}.rank{rank}") as f:
            ranks.append(json.load(f)[1:])
    steady = [e for epochs in ranks for e in epochs]
    fetched = max(1, sum(e["hits"] + e["peer_hits"] + e["misses"] for e in steady))
    return {"samples_per_s": min(sum(e["samples"] for e in epochs) / sum(e["time_s"] for e in epochs)
                                 for epochs in ranks),
            "device_bytes_per_epoch": read / args.epochs, "hit_fraction": sum(e["hits"] for e in steady) / fetched,
            "peer_hit_fraction": sum(e["peer_hits"] for e in steady) / fetched, "memory": memory}


def measure(cleanup, storage, config: dict, args, work: str) -> dict:
    """One run of the job as configured: its steady epochs' samples/s, device bytes per epoch, and what its
    workers spent per miss waiting on storage and per sample preparing (to set beside the analysis's L and
    1/P); the shares of its steady epochs' samples from the memory cache and from the disk tier."""
    group = _cgroup(cleanup, storage, config)
    out = os.path.join(work, f"epochs-{time.monotonic_ns()}.json")
    started = out + ".started"  # the job's loader is built: its memory is bounded and sampled from then on
    _, read, memory = _run([sys.executable, JOB, storage.root, *_job_args(config, args), "--epochs",
                            str(args.epochs), "--out", out, "--started", started], group, 1800, "run",
                           lambda: os.path.exists(started))
    with open(out) as f:
        epochs = json.load(f)
    steady = epochs[1:]
    misses, decoded, hits, disk_hits = (sum(e[k] for e in steady) for k in ("misses", "decoded", "hits", "disk_hits"))
    return {"samples_per_s": sum(e["samples"] for e in steady) / sum(e["time_s"] for e in steady),
            "device_bytes_per_epoch": read / len(epochs), "hit_fraction": hits / max(1, hits + disk_hits + misses),
            "disk_hit_fraction": disk_hits / max(1, hits + disk_hits + misses),
            "miss_wait_s": sum(e["storage_wait_s"] for e in steady) / misses if misses else None,
            "prep_s_per_sample": sum(e["prep_s"] for e in steady) / decoded if decoded else None, "memory": memory}


def plot(configs: list[dict], out_dir: str) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    groups = sorted({(c["read_mbps"], c["workers"], c["servers"]) for c in configs})
    fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.5), squeeze=False)
    for ax, (mbps, workers, servers) in zip(axes[0], groups):
        mine = sorted((c for c in configs if (c["read_mbps"], c["workers"], c["servers"]) == (mbps, workers, servers)),
                      key=lambda c: c["cache_fraction"])
        xs = [100 * c["cache_fraction"] for c in mine]
        ax.plot(xs, [c["predicted_samples_per_s"] for c in mine], "o--", label="predicted min(F, P, G)")
        ax.errorbar(xs, [c["measured_samples_per_s"] for c in mine],
                    yerr=[[c["measured_samples_per_s"] - c["measured_spread"]["min"] for c in mine],
                          [c["measured_spread"]["max"] - c["measured_samples_per_s"] for c in mine]],
                    fmt="s-", label="measured", capsize=3)
        ax.set_title(f"{mbps:g} MB/s, {workers} worker{'s' if workers > 1 else ''}" +
                     (f", {servers} servers" if servers > 1 else ""))
        ax.set_xlabel("cache per server, % of the dataset")
        ax.set_ylabel("samples/s")
        ax.set_ylim(bottom=0)
    axes[0][0].legend(fontsize=8)
    return [report.save(fig, plt, os.path.join(out_dir, "analyzer.png"))]


def _page_cache_mib(config: dict) -> float:
    """The highest 99th-percentile page cache of ``config``'s runs and analyses, in MiB."""
    return max(m["p99_page_cache_bytes"] or 0 for m in config["memory"]) / 2**20


def _spread(s: dict) -> str:
    return f"{s['median']:.1f}" + (f" [{s['min']:.1f}–{s['max']:.1f}]" if s["n"] > 1 else "")


def markdown(result: dict, setup: dict) -> str:
    lines = ["# coordl analyze: predicted against measured\n", f"{setup['machine']['summary']}; git "
             f"{setup['provenance']['git_sha']}; `{setup['provenance']['command']}`\n",
             f"median |error| {result['median_abs_error']:.1%}, max |error| {result['max_abs_error']:.1%} over "
             f"{len(result['configs'])} configurations\n",
             f"memory bounded to what the processes hold, the cache and a page cache of "
             f"{result['page_cache_budget_bytes'] / 2**20:g} MiB (+ {SLACK_BYTES / 2**20:g} MiB slack); runs and "
             f"analyses over that budget: {len(result['over_budget'])}\n",
             "| servers | cache | MB/s | workers | predicted [min–max] | measured [min–max] | error | bottleneck | "
             "analysis s | page cache p99 MiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in sorted(result["configs"], key=lambda c: (c["servers"], c["read_mbps"], c["workers"], c["cache_fraction"])):
        lines.append(f"| {c['servers']} | {c['cache_fraction']:.0%} | {c['read_mbps']:g} | {c['workers']} | "
                     f"{_spread(c['predicted_spread'])} | {_spread(c['measured_spread'])} | "
                     f"{c['error']:+.1%} | {c['bottleneck']} | {c['analysis_s']:.0f} | {_page_cache_mib(c):.1f} |")
    return "\n".join(lines) + "\n"


def file_sizes(root: str) -> list[int]:
    """The size of every file under ``root``."""
    return [os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs]


def dataset_on_its_disk(cleanup: Cleanup, args, images: int, mean_side_px: int | None = None):
    """``images`` generated JPEGs (of ``mean_side_px``, default ``--mean-side-px``) copied onto a throttled
    loop device of their own, every page dropped so that each run starts cold: the work folder, the storage
    and the files' sizes."""
    from coordl._demo.synthetic import make_image_folder
    work = cleanup.workdir(args.workdir)
    source = os.path.join(work, "train")
    side = mean_side_px or args.mean_side_px
    print(f"generating {images} JPEGs of about {side} px ...", flush=True)
    make_image_folder(source, images, mean_side_px=side, seed=args.seed)
    storage = prepare_storage("cgroup", source, cleanup, work)
    evict_files(storage.root)
    sizes = file_sizes(storage.root)
    print(f"dataset {len(sizes)} files, {sum(sizes) / 2**20:.1f} MiB on {storage.dataset_on} ({storage.detail})",
          flush=True)
    return work, storage, sizes


def warm_up(cleanup: Cleanup, storage, args, work: str, servers: int) -> None:
    """``coordl analyze`` of the job over a few images on the real disk, outside any cgroup, with a cache of
    part of them and with one of all of them (and, with ``servers`` above 1, on that many servers,
    unbounded), so that the libraries and code it loads are in the page cache, charged to no measured group:
    the bounded runs then hold only their own pages. (A page first loaded in a measured group is squeezed
    out with the group's page cache and loaded again, charged again, by each process after it.) A ``--quick``
    run warms up with the part cache only: a cache that fills runs both the hits' code and the full cache's."""
    from coordl._demo.synthetic import make_image_folder
    root = os.path.join(work, "warm-up")
    make_image_folder(root, 48, mean_side_px=args.mean_side_px, seed=args.seed + 1)
    whole = 2 * sum(file_sizes(root))
    small = argparse.Namespace(**{**vars(args), "iters": 6, "warmup": 1})
    config = {"read_mbps": max(FULL["mbps"]), "workers": 1, "cache_bytes": 2**20, "servers": servers}
    print("warming up (libraries into the page cache, outside the measured cgroups) ...", flush=True)
    warm = types.SimpleNamespace(root=root, device=storage.device)
    caches = (config["cache_bytes"],) if args.quick else (config["cache_bytes"], whole)
    for cache_bytes in caches:  # a cache full before the end runs code of its own
        analyze(cleanup, warm, {**config, "cache_bytes": cache_bytes}, small,
                os.path.join(work, f"warm-up-analysis-{cache_bytes}"), bounded=False)
    if servers > 1:
        analyze_servers(cleanup, warm, config, small, os.path.join(work, "warm-up-servers"), bounded=False)


def _configs(grid: dict, servers: int, dataset_bytes: int, sizes: list[int]) -> list[dict]:
    """The grid's configurations on ``servers`` servers, each server's cache the fraction of the dataset."""
    return [{"cache_fraction": x, "read_mbps": mbps, "workers": w, "servers": servers,
             "cache_bytes": int(x * dataset_bytes) + (max(sizes) if x == 1.0 else 0)}
            for x in grid["fractions"] for mbps in grid["mbps"] for w in grid["workers"]]


def checked_grid(args: argparse.Namespace) -> dict:
    """The one-server rows' grid (the full or quick one, with ``--workers``, ``--fractions`` and ``--mbps`` in
    place of its own), once the settings are checked. Raises ValueError naming a setting that is off."""
    grid = QUICK if args.quick else FULL
    for key in ("workers", "fractions", "mbps"):
        if getattr(args, key):
            grid = {**grid, key: tuple(getattr(args, key))}
    if not all(0 <= x <= 1 for x in grid["fractions"]):
        raise ValueError(f"--fractions should be cache fractions from 0 to 1, not {list(grid['fractions'])}")
    if not all(mbps > 0 for mbps in grid["mbps"]):
        raise ValueError(f"--mbps should be storage bandwidths above 0, not {list(grid['mbps'])}")
    if not all(w >= 1 for w in grid["workers"]):
        raise ValueError(f"--workers should be 1 or more, not {list(grid['workers'])}")
    if not 1 <= args.analyses <= grid["reps"]:
        raise ValueError(f"--analyses should be from 1 to the runs per configuration ({grid['reps']})")
    if args.multi_server_only and args.servers < 2:
        raise ValueError(f"--multi-server-only needs --servers of 2 or more, not {args.servers}")
    return grid


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        grid = checked_grid(args)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    images = args.images or (120 if args.quick else 600)
    servers_grid = SERVERS_QUICK if args.quick else SERVERS_FULL
    version = cgroup_version()
    if not version:
        print("benchmarks.analyzer needs root and cgroups (it throttles the dataset's own disk)", file=sys.stderr)
        return 2
    load_at_start = os.getloadavg()
    with Cleanup() as cleanup:
        work, storage, sizes = dataset_on_its_disk(cleanup, args, images)
        dataset_bytes = sum(sizes)
        configs = [] if args.multi_server_only else _configs(grid, 1, dataset_bytes, sizes)
        if args.servers > 1:
            configs += _configs(servers_grid, args.servers, dataset_bytes, sizes)
            cleanup.shm_folder()
        warm_up(cleanup, storage, args, work, args.servers)
        random.Random(args.seed).shuffle(configs)
        for n, config in enumerate(configs, 1):
            where = f"[{n}/{len(configs)}] cache {config['cache_fraction']:.0%}, {config['read_mbps']:g} MB/s, " \
                    f"{config['workers']} workers" + (f", {config['servers']} servers" if config["servers"] > 1 else "")
            print(f"{where}: analyzing ...", flush=True)
            multi_server = config["servers"] > 1
            analyses, runs = [], []
            for rep in range(grid["reps"]):
                if rep < args.analyses:
                    where_to = os.path.join(args.out, "analyses", f"config-{n}" + (f"-{rep + 1}" if rep else ""))
                    analyze_it = analyze_servers if multi_server else analyze
                    analyses.append(analyze_it(cleanup, storage, config, args, where_to))
                runs.append((measure_servers if multi_server else measure)(cleanup, storage, config, args, work))
            predicted = spread([a["predicted_samples_per_s"] for a in analyses])
            analysis = min(analyses, key=lambda a: abs(a["predicted_samples_per_s"] - predicted["median"]))
            measured = spread([r["samples_per_s"] for r in runs])
            config.update(predicted_samples_per_s=predicted["median"], predicted_spread=predicted,
                          measured_samples_per_s=measured["median"], measured_spread=measured,
                          error=predicted["median"] / measured["median"] - 1,
                          bottleneck=analysis["bottleneck"], rates=analysis["rates"],
                          contention=analysis.get("contention", 1.0),
                          analysis_s=max(a["analysis_s"] for a in analyses), flags=analysis.get("flags", []),
                          device_bytes_per_epoch=[r["device_bytes_per_epoch"] for r in runs],
                          hit_fraction=[r["hit_fraction"] for r in runs],
                          memory=[m for done in analyses + runs for m in done["memory"]])
            config["over_budget"] = over_budget_of(config)
            if multi_server:
                config.update(servers_predicted=analysis["servers_predicted"],
                              peer_hit_fraction=[r["peer_hit_fraction"] for r in runs])
            else:
                config.update(run_miss_wait_s=[r["miss_wait_s"] for r in runs],
                              run_prep_s_per_sample=[r["prep_s_per_sample"] for r in runs],
                              analysis_L=[a.get("miss_wait_s") for a in analyses],
                              analysis_P=[a["rates"]["P"] for a in analyses])
            print(f"  predicted {config['predicted_samples_per_s']:.1f}, measured {measured['median']:.1f} "
                  f"samples/s ({config['error']:+.1%}; {config['bottleneck']}); analysis {config['analysis_s']:.0f} s; "
                  f"page cache p99 {_page_cache_mib(config):.1f} MiB", flush=True)
            for why in config["over_budget"]:
                print(f"  over budget: {why}", flush=True)
        errors = [abs(c["error"]) for c in configs]
        result = {"configs": configs, "median_abs_error": statistics.median(errors), "max_abs_error": max(errors),
                  "dataset_bytes": dataset_bytes, "samples": len(sizes), "page_cache_budget_bytes": PAGE_CACHE_BUDGET,
                  "over_budget": [why for c in configs for why in c["over_budget"]]}
        settings = {**vars(args), **grid, "images": images, "servers_grid": servers_grid}
        setup = {"machine": report.machine(), "provenance": report.provenance(), "load_at_start": load_at_start,
                 "load_at_end": os.getloadavg(), "storage": storage.detail, "settings": settings}
        os.makedirs(args.out, exist_ok=True)
        plots = plot(configs, args.out)
        setup["plots"] = [os.path.basename(p) for p in plots] or report.NO_PLOTS
        for name, content in (("results.json", result), ("setup.json", setup)):
            with open(os.path.join(args.out, name), "w") as f:
                json.dump(content, f, indent=2)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(markdown(result, setup))
        print(markdown(result, setup))
    return 0


if __name__ == "__main__":
    sys.exit(main())
