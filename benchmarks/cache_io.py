"""Bytes read from the block device per epoch: torch's DataLoader against coordl, same memory budget.

    sudo python -m benchmarks.cache_io [--images 2000] [--epochs 3] [--cache-fraction 0.5] [--out DIR]

Each system runs in a child process inside its own cgroup (v1): a memory cgroup limits page cache +
shared memory + RSS to (the loader's measured baseline + cache_fraction x dataset), and a blkio cgroup
with a read rule on the dataset's disk counts the bytes really read from the device. The page cache
is dropped before each system. Needs root and cgroup v1 (memory, blkio).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

CGROUP_ROOT = "/sys/fs/cgroup"
UNLIMITED_BPS = 100 * 10**9  # a read rule is needed for blkio to account; this one never throttles
BATCH_SIZE = 64
BATCH_BYTES = BATCH_SIZE * 3 * 224 * 224  # one uint8 batch of 224x224 crops
PREFETCH_FACTOR = 2  # torch's default: batches in flight per worker


def _write(path: str, value) -> None:
    with open(path, "w") as f:
        f.write(f"{value}\n")


def _read_bytes(blkio_dir: str, device: str) -> int:
    with open(os.path.join(blkio_dir, "blkio.throttle.io_service_bytes")) as f:
        return sum(int(line.split()[2]) for line in f if line.startswith(f"{device} Read"))


def _drop_page_cache() -> None:
    os.sync()
    _write("/proc/sys/vm/drop_caches", 1)


class Cgroups:
    """A memory and a blkio cgroup for one run; removed on exit (after its processes are gone)."""

    def __init__(self, name: str, memory_limit: int | None, device: str, read_bps: int):
        self.memory = os.path.join(CGROUP_ROOT, "memory", name)
        self.blkio = os.path.join(CGROUP_ROOT, "blkio", name)
        os.makedirs(self.memory)
        os.makedirs(self.blkio)
        if memory_limit is not None:
            _write(os.path.join(self.memory, "memory.limit_in_bytes"), memory_limit)
        _write(os.path.join(self.blkio, "blkio.throttle.read_bps_device"), f"{device} {read_bps}")

    def __enter__(self) -> "Cgroups":
        return self

    def __exit__(self, *exc) -> None:
        for path in (self.memory, self.blkio):
            for _ in range(50):
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:  # tasks still exiting
                    time.sleep(0.1)



def _held_bytes(memory_dir: str) -> int:
    """Memory the group's processes hold and cannot give back: anonymous pages plus mapped files
    (libraries in use). Unmapped page cache (the dataset's files) is what the budget bounds."""
    with open(os.path.join(memory_dir, "memory.stat")) as f:
        stat = dict(line.split() for line in f)
    return int(stat["total_rss"]) + int(stat["total_mapped_file"])


def run_child(args) -> None:
    """In the cgroups: run the epochs and print one JSON line per epoch."""
    for group in (args.memory_cgroup, args.blkio_cgroup):
        _write(os.path.join(group, "cgroup.procs"), os.getpid())
    import torch.utils.data
    import torchvision
    from torchvision import transforms as T

    import coordl

    dataset = torchvision.datasets.ImageFolder(
        args.root, transform=T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.PILToTensor()]))
    if args.limit_images:
        dataset = torch.utils.data.Subset(dataset, range(args.limit_images))
    common = dict(batch_size=BATCH_SIZE, shuffle=True, num_workers=args.workers, persistent_workers=args.workers > 0)
    if args.child == "coordl":
        loader = coordl.DataLoader(dataset, **common, cache_bytes=args.cache_bytes)
    else:
        loader = torch.utils.data.DataLoader(dataset, **common)
    for epoch in range(1, args.epochs + 1):
        before, started = _read_bytes(args.blkio_cgroup, args.device), time.perf_counter()
        samples = sum(len(labels) for _, labels in loader)
        row = {"epoch": epoch, "samples": samples, "time_s": round(time.perf_counter() - started, 3),
               "device_read_bytes": _read_bytes(args.blkio_cgroup, args.device) - before}
        if isinstance(loader, coordl.DataLoader):
            e = loader.stats().epochs[-1]
            row.update(hits=e.hits, misses=e.misses, storage_bytes=e.storage_bytes)
        print(json.dumps(row), flush=True)
    print(json.dumps({"held_bytes": _held_bytes(args.memory_cgroup)}), flush=True)  # workers still alive
    if isinstance(loader, coordl.DataLoader):
        print(json.dumps({"cache": loader.stats().as_dict()["cache"]}), flush=True)
        loader.close()


def _spawn(system: str, root: str, groups: Cgroups, device: str, args, cache_bytes: int = 0,
           limit_images: int = 0, epochs: int | None = None) -> list[dict]:
    cmd = [sys.executable, "-m", "benchmarks.cache_io", "--child", system, "--root", root,
           "--memory-cgroup", groups.memory, "--blkio-cgroup", groups.blkio, "--device", device,
           "--workers", str(args.workers), "--epochs", str(epochs or args.epochs),
           "--cache-bytes", str(cache_bytes), "--limit-images", str(limit_images)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{system} run failed (exit {proc.returncode}; OOM-killed if -9):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--cache-fraction", type=float, default=0.5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--read-mbps", type=float, default=0, help="throttle the disk to this (default: no throttle)")
    parser.add_argument("--out", default="results/cache_io")
    for hidden in ("--child", "--root", "--memory-cgroup", "--blkio-cgroup", "--device"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--cache-bytes", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--limit-images", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run_child(args)
        return 0
    if os.geteuid() != 0 or not os.path.isdir(os.path.join(CGROUP_ROOT, "blkio")):
        sys.exit("benchmarks.cache_io needs root and cgroup v1 (memory, blkio) to bound memory and count device reads")

    from coordl.synthetic import make_image_folder

    workdir = tempfile.mkdtemp(prefix="coordl-cache-io-", dir="/var/tmp")  # on disk, not tmpfs
    read_bps = int(args.read_mbps * 10**6) if args.read_mbps else UNLIMITED_BPS
    try:
        root = os.path.join(workdir, "train")
        print(f"generating {args.images} JPEGs in {root} ...", flush=True)
        make_image_folder(root, args.images)
        st = os.stat(root)
        device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        dataset_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
        budget = int(args.cache_fraction * dataset_bytes)

        # The loader's own footprint (interpreter, libraries, workers), measured on a small subset.
        _drop_page_cache()
        with Cgroups(f"coordl-bench-{os.getpid()}-base", None, device, read_bps) as groups:
            rows = _spawn("torch", root, groups, device, args, limit_images=128, epochs=1)
        # + the batches in flight (in shared memory) and 64 MiB for decode buffers and the like.
        in_flight = PREFETCH_FACTOR * max(args.workers, 1) * BATCH_BYTES + 64 * 2**20
        baseline = next(r["held_bytes"] for r in rows if "held_bytes" in r) + in_flight
        memory_limit = baseline + budget
        print(f"dataset {dataset_bytes / 2**20:.1f} MiB on {device}; memory limit = baseline "
              f"{baseline / 2**20:.1f} MiB + budget {budget / 2**20:.1f} MiB", flush=True)

        runs = []
        for system in ("torch", "coordl"):
            _drop_page_cache()
            with Cgroups(f"coordl-bench-{os.getpid()}-{system}", memory_limit, device, read_bps) as groups:
                rows = _spawn(system, root, groups, device, args, cache_bytes=budget)
            cache = next((r["cache"] for r in rows if "cache" in r), None)
            runs.append({"system": system, "cache_fraction": args.cache_fraction,
                         "epochs": [r for r in rows if "epoch" in r], "cache": cache})
        result = {"storage_mode": "cgroup", "dataset_bytes": dataset_bytes, "images": args.images,
                  "memory_limit_bytes": memory_limit, "baseline_bytes": baseline, "budget_bytes": budget,
                  "bandwidth_bytes_per_s": read_bps if args.read_mbps else None, "runs": runs}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(result, f, indent=2)
        _print(result)
        return 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _print(result: dict) -> None:
    mib = 2**20
    print(f"\n{'system':<8}{'epoch':>6}{'time_s':>8}{'hits':>7}{'misses':>8}{'coordl storage MiB':>20}"
          f"{'device read MiB':>17}{'of dataset':>12}")
    for run in result["runs"]:
        for e in run["epochs"]:
            storage = f"{e['storage_bytes'] / mib:.1f}" if "storage_bytes" in e else "-"
            print(f"{run['system']:<8}{e['epoch']:>6}{e['time_s']:>8.2f}{e.get('hits', '-')!s:>7}"
                  f"{e.get('misses', '-')!s:>8}{storage:>20}{e['device_read_bytes'] / mib:>17.1f}"
                  f"{e['device_read_bytes'] / result['dataset_bytes']:>12.0%}")


if __name__ == "__main__":
    sys.exit(main())
