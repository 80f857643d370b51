"""K hyperparameter-search jobs on one machine: K torch DataLoaders against K coordl jobs in one hp_group.

    sudo python -m benchmarks.coordprep --jobs 4 [--backend dali] [--images 2000] [--epochs 3] [--out DIR]
    python -m benchmarks.coordprep --jobs 2 --quick --out DIR      # small and fast, to check it works

The K jobs of a system run at once, as independent processes, over the same generated JPEG dataset
with a prep-bound pipeline (decode + RandomResizedCrop(224) + flip + ToTensor) and a training
stand-in that sleeps a fixed time per batch. Baseline: each job has its own torch DataLoader.
coordl: each job has a coordl.DataLoader in one hp_group (``hp_group_size=K``) with the MinIO cache
off, so that only coordinated prep is measured (``--cache-bytes`` turns the cache on). Both give each
job the same workers (default: cores // K). With ``--backend dali`` the same two runs use DALI: K plain
DALI jobs (``fn.readers.file``, reshuffled every epoch) against K coordl jobs with ``backend="dali"``
in one hp_group, both decoding and augmenting with the ``image_classification`` preset on the CPU.

Reported per system: per-job samples/s per epoch, samples decoded per epoch over all jobs, bytes read
from the block device while the jobs train (counted from the moment all K jobs have started up, when
they begin together), and (coordl) the staging area's peak. Device bytes come from a blkio cgroup
holding the system's jobs when run as root with cgroup v1 (optionally also memory-limited with
``--memory-limit-mb``), else from each job's /proc/self/io (which includes its reaped workers); the
output says which. The dataset's files are evicted from the page cache before each system.
"""

import argparse
import contextlib
import json
import os
import platform
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from benchmarks.report import machine
from benchmarks.storage_env import (Cleanup, block_device, cgroup_version, device_read_bytes, evict_files,
                                    remove_cgroup_dir)

CGROUP_ROOT = "/sys/fs/cgroup"
SYSTEMS = {"torch": ("torch", "coordl"), "dali": ("dali", "coordl-dali")}
"""Per --backend: the baseline (K independent jobs) and the coordl system (K jobs in one hp_group)."""
UNLIMITED_BPS = 100 * 10**9  # blkio accounts only devices with a rule; this one never throttles


def _write(path: str, value) -> None:
    with open(path, "w") as f:
        f.write(f"{value}\n")


def _proc_read_bytes() -> int:
    """Bytes this process (and its reaped children) caused to be read from storage."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


class _Cgroups:
    """A blkio cgroup (counting device reads) and a memory cgroup for one system's jobs; removed on exit."""

    def __init__(self, name: str, device: str, memory_limit: int | None):
        self.blkio = os.path.join(CGROUP_ROOT, "blkio", name)
        self.memory = os.path.join(CGROUP_ROOT, "memory", name)
        self.counter = {"kind": "cgroup1", "file": os.path.join(self.blkio, "blkio.throttle.io_service_bytes"),
                        "device": device}
        try:
            for path in (self.blkio, self.memory):
                os.makedirs(path)
            _write(os.path.join(self.blkio, "blkio.throttle.read_bps_device"), f"{device} {UNLIMITED_BPS}")
            if memory_limit:
                _write(os.path.join(self.memory, "memory.limit_in_bytes"), memory_limit)
        except BaseException:
            self.__exit__()
            raise

    def __enter__(self) -> "_Cgroups":
        return self

    def __exit__(self, *exc) -> None:
        for path in (self.blkio, self.memory):
            remove_cgroup_dir(path)


def run_child(args) -> None:
    """One training job: print one JSON line per epoch (and the group's state, for the coordl systems)."""
    for group_dir in (args.blkio_cgroup, args.memory_cgroup):
        if group_dir:
            _write(os.path.join(group_dir, "cgroup.procs"), os.getpid())
    import torch.utils.data
    import torchvision
    from torchvision import transforms as T

    import coordl

    from coordl.dali_pipeline import file_reader_loader

    grouped = args.child.startswith("coordl")
    common = dict(batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
    group = dict(cache_bytes=args.cache_bytes, hp_group=args.group, hp_group_size=args.jobs, hp_group_timeout_s=300)
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
        for _, labels in loader:
            samples += len(labels)
            time.sleep(args.step_ms / 1000)  # the training step
        elapsed = time.perf_counter() - started
        row = {"epoch": epoch, "samples": samples, "time_s": round(elapsed, 3),
               "samples_per_s": round(samples / elapsed, 1), "proc_read_bytes": _proc_read_bytes() - read_before,
               "decoded": samples}
        if grouped:
            e = loader.stats().epochs[-1]
            row.update(decoded=e.decoded, prepared=e.prepared, shared=e.shared, members=e.members,
                       staging_wait_s=round(e.staging_wait_s, 3))
        print(json.dumps(row), flush=True)
    if grouped:
        print(json.dumps({"group": loader.stats().as_dict()["group"]}), flush=True)
        loader.close()


def _run_system(system: str, args, root: str, device: str | None, workdir: str) -> dict:
    """Start the system's K jobs together and wait for them; their rows and the system's device reads."""
    name = f"coordl-coordprep-{os.getpid()}-{system}"
    memory_limit = args.memory_limit_mb * 2**20 or None
    with _Cgroups(name, device, memory_limit) if device else contextlib.nullcontext() as cgroups:
        return _run_jobs(system, args, root, device, cgroups, workdir)


def _run_jobs(system: str, args, root: str, device: str | None, cgroups: "_Cgroups | None", workdir: str) -> dict:
    group, barrier = f"bench-{secrets.token_hex(4)}", os.path.join(workdir, f"{system}.go")
    cmd = [sys.executable, "-m", "benchmarks.coordprep", "--child", system, "--root", root, "--group", group,
           "--barrier", barrier,
           "--jobs", str(args.jobs), "--epochs", str(args.epochs), "--workers", str(args.workers),
           "--batch-size", str(args.batch_size), "--step-ms", str(args.step_ms), "--cache-bytes", str(args.cache_bytes)]
    if cgroups is not None:
        cmd += ["--blkio-cgroup", cgroups.blkio, "--memory-cgroup", cgroups.memory]
    evict_files(root)
    logs = [tuple(open(os.path.join(workdir, f"{system}-{k}.{kind}"), "w+") for kind in ("out", "err"))
            for k in range(args.jobs)]
    procs = [subprocess.Popen(cmd, stdout=out, stderr=err, text=True, start_new_session=True) for out, err in logs]
    try:
        # Count device reads from the moment every job has imported its libraries and built its loader.
        while not all(os.path.exists(f"{barrier}.{p.pid}") or p.poll() is not None for p in procs):
            time.sleep(0.05)
        read_before = device_read_bytes(cgroups.counter) if cgroups is not None else 0
        _write(barrier, "go")
        for proc, (_, err) in zip(procs, logs):
            if proc.wait(timeout=3600) != 0:
                err.seek(0)
                raise RuntimeError(f"a {system} job failed (exit {proc.returncode}; OOM-killed if -9):\n"
                                   f"{err.read()[-3000:]}")
    finally:
        for proc in procs:  # each job with its workers (its own session)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    jobs = []
    for out, err in logs:
        out.seek(0)
        jobs.append([json.loads(line) for line in out if line.startswith("{")])
        out.close()
        err.close()
    rows = [[r for r in job if "epoch" in r] for job in jobs]
    group_state = next((r["group"] for job in jobs for r in job if "group" in r), None)
    if cgroups is not None:
        device_bytes = device_read_bytes(cgroups.counter) - read_before
    else:
        device_bytes = sum(r["proc_read_bytes"] for job in rows for r in job)
    return {"jobs": rows, "device_read_bytes": device_bytes, "group": group_state}


def _summary(system: dict, epochs: int, dataset_images: int) -> dict:
    steady = [r for job in system["jobs"] for r in job if r["epoch"] > 1 or epochs == 1]
    decoded = [sum(r["decoded"] for job in system["jobs"] for r in job if r["epoch"] == e)
               for e in range(1, epochs + 1)]
    group = system["group"]
    return {
        "per_job_samples_per_s": round(sum(r["samples_per_s"] for r in steady) / len(steady), 1),
        "decoded_per_epoch": decoded,
        "decoded_x_dataset": [round(d / dataset_images, 2) for d in decoded],
        "device_read_bytes": system["device_read_bytes"],
        "staging_peak_bytes": group["peak_staged_bytes"] if group else None,
        "staging_capacity_bytes": group["capacity_bytes"] if group else None,
    }


def _tags() -> dict:
    sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    return {"host": platform.node(), "machine": machine(), "git_sha": sha}


def _markdown(result: dict) -> str:
    mib = 2**20
    s = result["summary"]
    lines = [f"K = {result['jobs']} jobs, {result['images']} JPEGs ({result['dataset_bytes'] / mib:.1f} MiB), "
             f"{result['epochs']} epochs, batch {result['batch_size']}, {result['workers_per_job']} worker(s) per job, "
             f"training step {result['step_ms']} ms; device bytes from {result['storage_mode']}.", "",
             "| system | per-job samples/s | speedup | decoded per epoch (all jobs) | x dataset | device read MiB "
             "| staging peak MiB |", "|---|---|---|---|---|---|---|"]
    baseline = next(iter(s))
    for name, row in s.items():
        speedup = row["per_job_samples_per_s"] / s[baseline]["per_job_samples_per_s"]
        peak = f"{row['staging_peak_bytes'] / mib:.1f}" if row["staging_peak_bytes"] is not None else "-"
        lines.append(f"| {name} | {row['per_job_samples_per_s']:.1f} | {speedup:.2f}x | "
                     f"{', '.join(map(str, row['decoded_per_epoch']))} | "
                     f"{', '.join(map(str, row['decoded_x_dataset']))} | "
                     f"{row['device_read_bytes'] / mib:.1f} | {peak} |")
    lines += ["", "Per job and epoch (samples/s):", ""]
    for name in s:
        for k, job in enumerate(result["systems"][name]["jobs"]):
            lines.append(f"- {name} job {k}: " + ", ".join(f"epoch {r['epoch']}: {r['samples_per_s']}" for r in job))
    return "\n".join(lines) + "\n"


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
    parser.add_argument("--memory-limit-mb", type=int, default=0, help="memory cgroup limit per system (root)")
    parser.add_argument("--quick", action="store_true", help="a small run: 192 small JPEGs, 2 epochs, batch 16")
    parser.add_argument("--out", default="results/coordprep")
    for hidden in ("--child", "--root", "--group", "--barrier", "--blkio-cgroup", "--memory-cgroup"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run_child(args)
        return 0
    if args.jobs < 1:
        parser.error("--jobs should be at least 1")
    if args.quick:
        args.images, args.epochs, args.batch_size = 192, 2, 16
    args.workers = args.workers or max(1, (os.cpu_count() or 1) // args.jobs)

    from coordl.synthetic import make_image_folder

    with Cleanup() as cleanup:  # also on Ctrl-C and SIGTERM
        workdir = tempfile.mkdtemp(prefix="coordl-coordprep-", dir="/var/tmp")  # on disk, not tmpfs
        cleanup.callback(shutil.rmtree, workdir, ignore_errors=True)
        root = os.path.join(workdir, "train")
        print(f"generating {args.images} JPEGs in {root} ...", flush=True)
        make_image_folder(root, args.images, mean_side_px=256 if args.quick else 448)
        dataset_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
        device = block_device(root)
        cgroup_ok = cgroup_version() == 1 and device is not None
        mode = "blkio cgroup" if cgroup_ok else "/proc/<pid>/io of each job (no root, no cgroup v1 or no block device)"
        if not cgroup_ok:
            args.memory_limit_mb = 0  # nothing to apply it with
        print(f"{args.jobs} jobs x {args.workers} worker(s); dataset {dataset_bytes / 2**20:.1f} MiB; device "
              f"bytes from {mode}", flush=True)
        systems = {}
        for system in SYSTEMS[args.backend]:
            print(f"running {args.jobs} {system} jobs ...", flush=True)
            systems[system] = _run_system(system, args, root, device if cgroup_ok else None, workdir)
        result = {"backend": args.backend, "jobs": args.jobs, "images": args.images, "dataset_bytes": dataset_bytes,
                  "epochs": args.epochs, "batch_size": args.batch_size, "workers_per_job": args.workers,
                  "step_ms": args.step_ms,
                  "cache_bytes": args.cache_bytes, "storage_mode": mode, "memory_limit_mb": args.memory_limit_mb,
                  **_tags(), "systems": systems,
                  "summary": {name: _summary(s, args.epochs, args.images) for name, s in systems.items()}}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(result, f, indent=2)
        table = _markdown(result)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(table)
        print("\n" + table)
        return 0


if __name__ == "__main__":
    sys.exit(main())
