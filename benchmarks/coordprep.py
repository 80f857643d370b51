"""K hyperparameter-search jobs on one machine: K torch DataLoaders against K coordl jobs in one hp_group.

    sudo python -m benchmarks.coordprep --jobs 4 [--backend dali] [--images 2000] [--epochs 3] [--reps 3] [--out DIR]
    python -m benchmarks.coordprep --jobs 2 --quick --out DIR      # small and fast, to check it works

The K jobs of a system run at once, as independent processes, over the same generated JPEG dataset
with a prep-bound pipeline (decode + RandomResizedCrop(224) + flip + ToTensor) and a training
stand-in that sleeps a fixed time per batch. Baseline: each job has its own torch DataLoader.
coordl: each job has a coordl.DataLoader in one hp_group (``hp_group_size=K``) with the MinIO cache
off, so that only coordinated prep is measured (``--cache-bytes`` turns the cache on). Both give each
job the same workers (default: cores // K). With ``--backend dali`` the same two runs use DALI: K plain
DALI jobs (``fn.readers.file``, reshuffled every epoch) against K coordl jobs with ``backend="dali"``
in one hp_group, both decoding and augmenting with the ``image_classification`` preset on the CPU.

Storage and memory as in ``benchmarks.minio`` (see :mod:`harness.storage_env`): as root, the dataset
sits on a loop device of its own whose reads are throttled to ``--read-mbps`` and counted, and each
system's K jobs share one memory cgroup with a budget of ``--memory-fraction`` of the dataset: the
baseline's page cache gets all of it; coordl's staging area (``hp_staging_bytes``) comes out of it and
its page cache gets the rest. So the K independent jobs pay the paper's I/O amplification (each reads
the dataset through a page cache too small to hold it), where the group reads it once per epoch.
With ``--drop-page-cache`` the coordl jobs drop the pages of each file they read (the group reads a
sample once an epoch for all K jobs, so a kept page could serve only the next epoch): their page cache
then stays within its budget at every moment, where a worker reading a batch's files at once
otherwise leaves a batch of pages above it until the bound squeezes them out.
Without root there is no throttle and no bound, and device bytes come from each job's /proc/self/io.

Each system runs ``--reps`` times, the systems' order reversed every other time; a system's figures are
the median over its runs (per-job samples/s with its min and max, and each run's speedup over the
baseline's run beside it). Reported per system: per-job samples/s per epoch, samples decoded per epoch
over all jobs, bytes read from the dataset's device while the jobs train (counted from the moment all
K jobs have started up, when they begin together), the page cache and held memory of the group,
(coordl) the staging area's peak, and where the CPU went: CPU ms per decoded sample in the jobs' main
processes and in their workers, and the cores kept busy. The dataset's files are evicted from the page cache before each system. As root, each
system's K jobs first warm up outside any cgroup (one epoch over a small dataset on the real disk), so
that the libraries they load are not charged to the measured group, and the group is bounded only from
the moment all K jobs have built their loaders.
"""

import argparse
import json
import os
import platform
import resource
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.metrics import spread
from benchmarks.report import NO_PLOTS, axes, machine, provenance, save, spread_text, write_json_and_markdown
from coordl._core.sysinfo import cpu_seconds as process_cpu_seconds, descendants
from coordl.analyzer.process_group import stop_group
from harness.storage_env import (HEADROOM_BYTES, PREFIX, Cleanup, MemoryFollower, Storage, device_read_bytes,
                                    evict_files, over_budget, prepare_storage, tree_bytes)

SYSTEMS = {"torch": ("torch", "coordl"), "dali": ("dali", "coordl-dali")}
"""Per --backend: the baseline (K independent jobs) and the coordl system (K jobs in one hp_group)."""

WARM_UP_BATCHES = 2
"""The size of the dataset each system's jobs warm up on, outside the measured cgroup."""


def _write(path: str, value) -> None:
    with open(path, "w") as f:
        f.write(f"{value}\n")


def _proc_read_bytes() -> int:
    """Bytes this process (and its reaped children) caused to be read from storage."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def _cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid``; 0 if it ended meanwhile."""
    try:
        return process_cpu_seconds(pid)
    except OSError:
        return 0.0


def cpu_seconds() -> tuple[float, float]:
    """(this process's CPU seconds, all threads; its workers': the live descendants' and the reaped
    children's). The difference of two readings is what each did in between."""
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time(), reaped.ru_utime + reaped.ru_stime + sum(map(_cpu_s, descendants(os.getpid())))


def cpu_split(jobs: list[list[dict]], epochs: int) -> dict:
    """Where the K jobs' CPU went in the steady epochs (2.., or 1 if there is only one): CPU ms per
    decoded sample in the jobs' main processes (training loop, coordl's producer) and in their workers,
    and the cores kept busy (per epoch: the jobs' CPU seconds over the slowest job's time; the median)."""
    first = 2 if epochs > 1 else 1
    steady = [r for job in jobs for r in job if r["epoch"] >= first]
    decoded = sum(r["decoded"] for r in steady)
    busy = [sum(r["main_cpu_s"] + r["workers_cpu_s"] for r in rows) / max(r["time_s"] for r in rows)
            for rows in ([r for r in steady if r["epoch"] == e] for e in range(first, epochs + 1)) if rows]
    return {"main_cpu_ms_per_decoded_sample": round(1000 * sum(r["main_cpu_s"] for r in steady) / decoded, 3),
            "workers_cpu_ms_per_decoded_sample": round(1000 * sum(r["workers_cpu_s"] for r in steady) / decoded, 3),
            "cores_busy": round(statistics.median(busy), 2)}


CPU_KEYS = ("main_cpu_ms_per_decoded_sample", "workers_cpu_ms_per_decoded_sample", "cores_busy")
PAGE_CACHE_KEYS = ("p50_page_cache_bytes", "p99_page_cache_bytes", "peak_page_cache_bytes")
"""The group's page cache (``memory_summary``) a run's summary keeps; over runs, the worst run's."""


def staged_batch_bytes(batch_size: int) -> int:
    """A staged batch's shared memory: ``batch_size`` float32 images of 3 x 224 x 224."""
    return batch_size * 3 * 224 * 224 * 4


def headroom_bytes(jobs: int, batch_size: int) -> int:
    """The group's room for allocations between two updates of its bound: each job's worker and main
    process can each take a batch at once (torch's worker batches, a staged batch, its copy)."""
    return HEADROOM_BYTES + 2 * jobs * staged_batch_bytes(batch_size)


def staging_bytes(budget: int | None) -> str | int:
    """The coordl group's staging area: "auto" without a memory budget, else half of it, which the
    group's page cache does without (the group admits one batch beyond it)."""
    return "auto" if budget is None else budget // 2


def run_child(args) -> None:
    """One training job: print one JSON line per epoch (and the group's state, for the coordl systems)."""
    import torch.utils.data
    import torchvision
    from torchvision import transforms as T

    import coordl

    from harness.dali_baseline import file_reader_loader

    grouped = args.child.startswith("coordl")
    common = dict(batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
    group = dict(cache_bytes=args.cache_bytes, hp_group=args.group, hp_group_size=args.jobs, hp_group_timeout_s=300,
                 hp_staging_bytes=int(args.staging_bytes) if args.staging_bytes.isdigit() else args.staging_bytes,
                 drop_page_cache=True if args.drop_page_cache else None)
    if args.child == "dali":  # a plain DALI user's job: reads and reshuffles on its own
        loader = file_reader_loader(args.root, order="shuffle", batch_size=args.batch_size, num_threads=args.workers,
                                    seed=os.getpid())
    elif args.child == "coordl-dali":
        loader = coordl.DataLoader(torchvision.datasets.ImageFolder(args.root), **common, **group, backend="dali",
                                   dali_pipeline="image_classification", dali_device="cpu")
    else:
        dataset = torchvision.datasets.ImageFolder(
            args.root, transform=T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor()]))
        loader = coordl.DataLoader(dataset, **common, **group) if grouped else \
            torch.utils.data.DataLoader(dataset, **common)
    _write(f"{args.barrier}.{os.getpid()}", "ready")  # then start with the others, once they are all set up
    while not os.path.exists(args.barrier):
        time.sleep(0.01)
    for epoch in range(1, args.epochs + 1):
        read_before, started, samples = _proc_read_bytes(), time.perf_counter(), 0
        cpu_before = cpu_seconds()
        for _, labels in loader:
            samples += len(labels)
            time.sleep(args.step_ms / 1000)  # the training step
        elapsed = time.perf_counter() - started
        main_cpu, workers_cpu = (after - before for after, before in zip(cpu_seconds(), cpu_before))
        row = {"epoch": epoch, "samples": samples, "time_s": round(elapsed, 3),
               "samples_per_s": round(samples / elapsed, 1), "proc_read_bytes": _proc_read_bytes() - read_before,
               "decoded": samples, "main_cpu_s": round(main_cpu, 3), "workers_cpu_s": round(workers_cpu, 3)}
        if grouped:
            e = loader.stats().epochs[-1]
            row.update(decoded=e.decoded, prepared=e.prepared, shared=e.shared, members=e.members,
                       staging_wait_s=round(e.staging_wait_s, 3))
        print(json.dumps(row), flush=True)
    if grouped:
        print(json.dumps({"group": loader.stats().as_dict()["group"]}), flush=True)
        loader.close()


def _run_system(system: str, args, storage: Storage, cleanup: Cleanup, workdir: str, dataset_bytes: int,
                warm_up_root: str) -> dict:
    """Start the system's K jobs together (in one cgroup, as root) and wait for them; their rows, the
    system's device reads and its group's memory. As root, the K jobs first run one epoch over the small
    dataset at ``warm_up_root`` outside any cgroup, so that the libraries they load (hundreds of MiB for
    DALI) are in the page cache charged elsewhere, not to the measured group's page-cache budget."""
    budget = int(args.memory_fraction * dataset_bytes) if args.memory_fraction else None
    staging = staging_bytes(budget) if system.startswith("coordl") else 0
    page_cache = None if budget is None else budget - (staging or 0)
    # the staging area, and the one batch it admits beyond, count as held from the start
    reserve = staging + staged_batch_bytes(args.batch_size) if isinstance(staging, int) and staging else 0
    headroom = headroom_bytes(args.jobs, args.batch_size)
    group = None
    if storage.mode == "cgroup":  # the libraries this system loads are charged to no measured group
        _run_jobs(system, args, warm_up_root, None, workdir, staging, epochs=1, tag="warm-up")
    evict_files(storage.root)
    if storage.mode == "cgroup":
        group = cleanup.cgroup(f"{PREFIX}-coordprep-{os.getpid()}-{system}", storage.cgroup_version, storage.device,
                               int(args.read_mbps * 10**6), page_cache, shm_reserve_bytes=reserve,
                               headroom_bytes=headroom)
    try:
        run = _run_jobs(system, args, storage.root, group, workdir, staging, epochs=args.epochs, tag="run")
    finally:
        if group is not None:
            group.remove()
    run.update(memory_budget_bytes=budget, page_cache_budget_bytes=page_cache, staging_bytes=staging,
               headroom_bytes=headroom if group is not None else None)
    run["over_budget"] = over_budget(run["memory"], page_cache) if page_cache is not None else None
    return run


def _run_jobs(system: str, args, root: str, cgroup, workdir: str, staging, epochs: int, tag: str) -> dict:
    group, barrier = f"bench-{secrets.token_hex(4)}", os.path.join(workdir, f"{system}-{tag}.go")
    cmd = [sys.executable, "-m", "benchmarks.coordprep", "--child", system, "--root", root, "--group", group,
           "--barrier", barrier,
           "--jobs", str(args.jobs), "--epochs", str(epochs), "--workers", str(args.workers),
           "--batch-size", str(args.batch_size), "--step-ms", str(args.step_ms), "--cache-bytes", str(args.cache_bytes),
           "--staging-bytes", str(staging)] + (["--drop-page-cache"] if args.drop_page_cache else [])
    logs = [tuple(open(os.path.join(workdir, f"{system}-{tag}-{k}.{kind}"), "w+") for kind in ("out", "err"))
            for k in range(args.jobs)]
    # The group is bounded, and its device reads counted, from the moment every job has imported its
    # libraries and built its loader.
    follower, memory, procs = MemoryFollower(cgroup, measure_now=False).start() if cgroup else None, {}, []
    try:
        procs += [subprocess.Popen(cmd, stdout=out, stderr=err, text=True, start_new_session=True,
                                   preexec_fn=cgroup.join if cgroup else None) for out, err in logs]
        while not all(os.path.exists(f"{barrier}.{p.pid}") or p.poll() is not None for p in procs):
            time.sleep(0.05)
        read_before = device_read_bytes(cgroup.counter()) if cgroup is not None else 0
        if follower:
            follower.measure()
        _write(barrier, "go")
        for proc, (_, err) in zip(procs, logs):
            if proc.wait(timeout=3600) != 0:
                err.seek(0)
                raise RuntimeError(f"a {system} job failed (exit {proc.returncode}):\n{err.read()[-3000:]}")
        device_bytes = device_read_bytes(cgroup.counter()) - read_before if cgroup is not None else None
    finally:
        for proc in procs:  # each job with its workers (its own session), and torch's segments they left
            stop_group(proc, grace_s=0)
        if system.startswith("coordl"):  # jobs killed early leave their group behind; none is alive now
            from coordl._group.membership import group_segment_name, remove_group
            remove_group(group_segment_name(group))
        if follower:
            memory = follower.stop()
    jobs = []
    for out, err in logs:
        out.seek(0)
        jobs.append([json.loads(line) for line in out if line.startswith("{")])
        out.close()
        err.close()
    rows = [[r for r in job if "epoch" in r] for job in jobs]
    group_state = next((r["group"] for job in jobs for r in job if "group" in r), None)
    if device_bytes is None:
        device_bytes = sum(r["proc_read_bytes"] for job in rows for r in job)
    return {"jobs": rows, "device_read_bytes": device_bytes, "group": group_state, "memory": memory}


def _summary(system: dict, epochs: int, dataset_images: int, dataset_bytes: int) -> dict:
    steady = [r for job in system["jobs"] for r in job if r["epoch"] > 1 or epochs == 1]
    decoded = [sum(r["decoded"] for job in system["jobs"] for r in job if r["epoch"] == e)
               for e in range(1, epochs + 1)]
    group = system["group"]
    return {
        "per_job_samples_per_s": round(sum(r["samples_per_s"] for r in steady) / len(steady), 1),
        "decoded_per_epoch": decoded,
        "decoded_x_dataset": [round(d / dataset_images, 2) for d in decoded],
        "device_read_bytes": system["device_read_bytes"],
        "device_read_x_dataset_per_epoch": round(system["device_read_bytes"] / dataset_bytes / epochs, 2),
        **{key: system["memory"].get(key) for key in PAGE_CACHE_KEYS},
        "page_cache_budget_bytes": system["page_cache_budget_bytes"],
        "over_budget": system.get("over_budget"),
        "staging_peak_bytes": group["peak_staged_bytes"] if group else None,
        "staging_capacity_bytes": group["capacity_bytes"] if group else None,
        **cpu_split(system["jobs"], epochs),
    }


def _over_runs(rows: list[dict], baseline: list[dict] | None) -> dict:
    """One system's :func:`_summary` over its runs: the median per-job samples/s and device reads, the
    spread of the samples/s and (against ``baseline``'s summaries, run for run) of the speedup, the worst
    page cache and staging peak, each run's own under ``runs``."""
    out = dict(rows[0])
    rates = [r["per_job_samples_per_s"] for r in rows]
    out.update(per_job_samples_per_s=round(statistics.median(rates), 1), per_job_samples_per_s_spread=spread(rates),
               device_read_bytes=statistics.median(r["device_read_bytes"] for r in rows),
               device_read_x_dataset_per_epoch=statistics.median(r["device_read_x_dataset_per_epoch"] for r in rows),
               over_budget=next((r["over_budget"] for r in rows if r["over_budget"]), None), runs=rows)
    for key in CPU_KEYS:
        out[key] = statistics.median(r[key] for r in rows)
    for key in (*PAGE_CACHE_KEYS, "staging_peak_bytes"):
        values = [r[key] for r in rows if r[key] is not None]
        out[key] = max(values) if values else None
    if baseline is not None:
        out["speedup"] = spread([r["per_job_samples_per_s"] / b["per_job_samples_per_s"] for r, b in zip(rows, baseline)])
    return out


def _tags() -> dict:
    return {"host": platform.node(), "machine": machine(), **provenance(), "load_average": os.getloadavg()}


def _markdown(result: dict) -> str:
    mib = 2**20
    s = result["summary"]
    bound = (f"memory budget {result['memory_fraction']:.0%} of the dataset per system"
             if result["memory_fraction"] else "memory not bounded")
    lines = [f"K = {result['jobs']} jobs, {result['images']} JPEGs ({result['dataset_bytes'] / mib:.1f} MiB), "
             f"{result['epochs']} epochs, batch {result['batch_size']}, {result['workers_per_job']} worker(s) per job, "
             f"training step {result['step_ms']} ms; {bound}; storage {result['storage_mode']}.", "",
             f"{result['reps']} run(s) per system, median [min-max].", "",
             "| system | per-job samples/s | speedup | speedup / K | decoded per epoch (all jobs) | x dataset "
             "| device read MiB | x dataset per epoch | page cache p99 MiB (budget) | staging peak MiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in s.items():
        speedup = row.get("speedup") or spread([1.0])
        peak = f"{row['staging_peak_bytes'] / mib:.1f}" if row["staging_peak_bytes"] is not None else "-"
        cache = "-" if row["p99_page_cache_bytes"] is None else (
            f"{row['p99_page_cache_bytes'] / mib:.1f} ({(row['page_cache_budget_bytes'] or 0) / mib:.1f})")
        lines.append(f"| {name} | {spread_text(row['per_job_samples_per_s_spread'], '.1f')} | "
                     f"{spread_text(speedup)}x | {speedup['median'] / result['jobs']:.2f} | "
                     f"{', '.join(map(str, row['decoded_per_epoch']))} | "
                     f"{', '.join(map(str, row['decoded_x_dataset']))} | "
                     f"{row['device_read_bytes'] / mib:.1f} | {row['device_read_x_dataset_per_epoch']} | {cache} | "
                     f"{peak} |")
    lines += [f"- {name}: OVER BUDGET: {row['over_budget']}" for name, row in s.items() if row["over_budget"]]
    lines += ["", "Where the CPU went (steady epochs, median over runs): CPU ms per decoded sample in the jobs' main "
              "processes and in their workers, and the cores kept busy.", ""]
    lines += [f"- {name}: main {row['main_cpu_ms_per_decoded_sample']:.2f} ms, workers "
              f"{row['workers_cpu_ms_per_decoded_sample']:.2f} ms per decoded sample; {row['cores_busy']:.2f} cores busy"
              for name, row in s.items()]
    lines += ["", "Per job and epoch (samples/s):", ""]
    for name in s:
        for rep, run in enumerate(result["systems"][name]):
            for k, job in enumerate(run["jobs"]):
                lines.append(f"- {name} run {rep} job {k}: " +
                             ", ".join(f"epoch {r['epoch']}: {r['samples_per_s']}" for r in job))
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> bool:
    """Per system: each job's samples/s in every epoch (bars), and the device reads per epoch as a
    multiple of the dataset (labelled). False without matplotlib."""
    drawn = axes()
    if drawn is None:
        return False
    plt, fig, ax = drawn
    systems = list(result["summary"])
    epochs, width = range(1, result["epochs"] + 1), 0.8 / len(systems)
    for k, name in enumerate(systems):
        jobs = [job for run in result["systems"][name] for job in run["jobs"]]
        rates = [sum(r["samples_per_s"] for job in jobs for r in job if r["epoch"] == e) / len(jobs) for e in epochs]
        reads = result["summary"][name]["device_read_x_dataset_per_epoch"]
        ax.bar([e + (k - (len(systems) - 1) / 2) * width for e in epochs], rates, width,
               label=f"{name} (reads {reads}× the dataset per epoch)")
    ax.set_xticks(list(epochs))
    ax.set_xlabel("epoch")
    ax.set_ylabel("samples/s per job (mean of the K jobs and the runs)")
    disk = f"{result['read_mbps']:g} MB/s" if result["read_mbps"] else "storage not throttled"
    ax.set_title(f"K = {result['jobs']} jobs, {disk}")
    ax.legend(fontsize=8)
    save(fig, plt, path)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=4, help="concurrent jobs K (default: 4)")
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--backend", choices=sorted(SYSTEMS), default="torch",
                        help="torch: torch's DataLoader against coordl; dali: plain DALI against coordl's DALI backend")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers per job (default: cores // K)")
    parser.add_argument("--step-ms", type=float, default=30, help="training stand-in: time per batch (default: 30)")
    parser.add_argument("--cache-bytes", default="0", help="coordl jobs' MinIO cache (default: 0, off)")
    parser.add_argument("--drop-page-cache", action="store_true",
                        help="coordl jobs drop the pages of the files they read (drop_page_cache=True; default: as "
                             "coordl does, which with no cache leaves them)")
    parser.add_argument("--memory-fraction", type=float, default=0.5,
                        help="each system's memory budget beside what its jobs hold, as a fraction of the dataset: "
                             "page cache (and coordl's staging area); 0: not bounded (default: 0.5)")
    parser.add_argument("--read-mbps", type=float, default=20.0, help="the dataset's disk bandwidth (default: 20)")
    parser.add_argument("--storage", choices=("auto", "cgroup", "emulated"), default="auto",
                        help="cgroup: throttled loop device and memory bound (root); emulated: neither (default: auto)")
    parser.add_argument("--reps", type=int, default=1, help="runs of each system, interleaved (default: 1)")
    parser.add_argument("--quick", action="store_true", help="a small run: 192 small JPEGs, 2 epochs, batch 16")
    parser.add_argument("--out", default="results/coordprep")
    for hidden in ("--child", "--root", "--group", "--barrier", "--staging-bytes"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run_child(args)
        return 0
    if args.jobs < 1 or args.reps < 1:
        parser.error("--jobs and --reps should be at least 1")
    if args.quick:
        args.images, args.epochs, args.batch_size = 192, 2, 16
    args.workers = args.workers or max(1, (os.cpu_count() or 1) // args.jobs)

    from coordl._demo.synthetic import make_image_folder

    with Cleanup() as cleanup:  # also on Ctrl-C and SIGTERM
        workdir = tempfile.mkdtemp(prefix="coordl-coordprep-", dir="/var/tmp")  # on disk, not tmpfs
        cleanup.callback(shutil.rmtree, workdir, ignore_errors=True)
        source = os.path.join(workdir, "train")
        print(f"generating {args.images} JPEGs in {source} ...", flush=True)
        make_image_folder(source, args.images, mean_side_px=256 if args.quick else 448)
        warm_up_root = os.path.join(workdir, "warm-up")  # on the real disk
        make_image_folder(warm_up_root, WARM_UP_BATCHES * args.batch_size, mean_side_px=256 if args.quick else 448)
        dataset_bytes = tree_bytes(source)
        storage = prepare_storage(args.storage, source, cleanup, workdir)
        if storage.mode == "cgroup":
            mode = f"cgroup: {storage.detail}; throttled to {args.read_mbps:g} MB/s"
        else:
            mode = f"emulated: no throttle, no memory bound ({storage.detail}); device bytes from /proc/<pid>/io"
            args.memory_fraction = 0
        print(f"{args.jobs} jobs x {args.workers} worker(s); dataset {dataset_bytes / 2**20:.1f} MiB; {mode}",
              flush=True)
        names = SYSTEMS[args.backend]
        systems = {name: [] for name in names}
        for rep in range(args.reps):
            for system in (names if rep % 2 == 0 else names[::-1]):
                print(f"running {args.jobs} {system} jobs ..." + (f" (run {rep + 1} of {args.reps})" if args.reps > 1
                                                                  else ""), flush=True)
                systems[system].append(_run_system(system, args, storage, cleanup, workdir, dataset_bytes,
                                                   warm_up_root))
        per_run = {name: [_summary(run, args.epochs, args.images, dataset_bytes) for run in runs]
                   for name, runs in systems.items()}
        baseline = per_run[names[0]]
        result = {"backend": args.backend, "jobs": args.jobs, "images": args.images, "dataset_bytes": dataset_bytes,
                  "epochs": args.epochs, "batch_size": args.batch_size, "workers_per_job": args.workers,
                  "step_ms": args.step_ms, "read_mbps": args.read_mbps if storage.mode == "cgroup" else None,
                  "memory_fraction": args.memory_fraction, "cache_bytes": args.cache_bytes,
                  "coordl_drop_page_cache": args.drop_page_cache, "storage_mode": mode,
                  "reps": args.reps, **_tags(), "systems": systems,
                  "summary": {name: _over_runs(rows, None if name == names[0] else baseline)
                              for name, rows in per_run.items()}}
        table = _markdown(result)
        write_json_and_markdown(args.out, result, table)
        if not plot(result, os.path.join(args.out, "coordprep.png")):
            table += f"\n({NO_PLOTS})\n"
        print("\n" + table)
        # --quick's dataset (5 MiB) is smaller than the slack the check allows for libraries' file pages:
        # its budget check is reported, not held against the run
        return 1 if not args.quick and any(row["over_budget"] for row in result["summary"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
