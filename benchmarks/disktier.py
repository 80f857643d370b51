"""The disk tier on throttled storage with memory bounded: a job fills it, the next job reads from it.

    sudo python -m benchmarks.disktier [--quick] [--out DIR] [--read-mbps 10] [--reps 2] ...

The dataset is on a throttled loop device (``harness.storage_env``), the disk tier's folder on the
workdir's own (unthrottled) file system, and each job's memory cache holds a quarter of the dataset. Per
repetition, each job a child process of its own (``benchmarks.systems``) with a cold page cache: torch
(its page cache held to the same quarter), coordl without the disk tier, coordl reading the files from the
unthrottled local disk (the epoch the disk tier's is set against), and, at each disk quota (a share of the
dataset), job 1 from a fresh disk cache then job 2 in a new process over it; then coordl with a memory
cache that holds the whole dataset, with the tier and without (its cost when every hit is a memory hit).
Then the index's cost at ImageNet's size: the time and memory to open a disk cache of 1,281,167 items. Writes ``results.json``,
``results.md`` and ``setup.json`` into ``--out``.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from benchmarks import metrics, report
from benchmarks.systems import child_command
from harness.storage_env import PREFIX, Cleanup, evict_files, prepare_storage, run_child

MODES = {"quick": dict(images=800, reps=2), "full": dict(images=2000, reps=3)}
SHM_SHARE = 0.25
IMAGENET_ITEMS = 1_281_167


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.disktier", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="800 images, 2 repetitions: minutes")
    parser.add_argument("--out", default="results/disktier")
    parser.add_argument("--images", type=int, help="dataset size (quick: 800, full: 2000)")
    parser.add_argument("--reps", type=int, help="repetitions (quick: 2, full: 3)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--quotas", type=float, nargs="+", default=[1.0, 0.5], help="disk quotas, shares of the "
                        "dataset (1.0: 'auto')")
    parser.add_argument("--read-mbps", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--compute-ms", type=float, default=0.0)
    parser.add_argument("--workdir", default="/var/tmp")
    parser.add_argument("--index-items", type=int, default=IMAGENET_ITEMS, help="items of the index opened at scale")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for key, value in MODES["quick" if args.quick else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def _run(args, cleanup, storage, name: str, root: str, *, system: str, cache_bytes: int, epochs: int,
         page_cache: int | None, cache_dir: str | None = None, quota=None, cache_name: str | None = None) -> dict:
    """One job: a child in a cgroup reading ``root`` (throttled where it is the loop device) from a cold page
    cache; its epochs' rows. Jobs with the same ``cache_name`` (default: ``name``) share their caches."""
    evict_files(root)
    spec = dict(system=system, root=root, epochs=epochs, batch_size=args.batch_size, workers=args.workers,
                compute_ms=args.compute_ms, cache_bytes=cache_bytes,
                cache_name=f"{PREFIX}-{os.getpid()}-{cache_name or name}",
                seed=args.seed, store_socket=None, cache_dir=cache_dir, cache_dir_bytes=quota or "auto")
    group = cleanup.cgroup(f"{PREFIX}-disktier-{name}", storage.cgroup_version, storage.device,
                           int(args.read_mbps * 10**6), page_cache, shm_reserve_bytes=cache_bytes)
    spec["counter"] = group.counter()
    try:
        result = run_child(child_command(spec), 1800, group)
    finally:
        group.remove()
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {result.returncode}): {result.stderr[-3000:]}")
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    print(f"  {name}: " + ", ".join(f"epoch {r['epoch']} {r['time_s']:.2f} s {r['device_read_bytes'] / 2**20:.1f} MiB"
                                    for r in rows if "epoch" in r), flush=True)
    return {"name": name, "system": system, "memory": result.memory, "epochs": [r for r in rows if "epoch" in r],
            "stderr_tail": result.stderr[-2000:]}


def index_at_scale(n: int, folder: str) -> dict:
    """The time and memory to open a disk cache whose index holds ``n`` items (written here, in groups of
    256, as the writer commits them; no pack is read to open it)."""
    from coordl._disk import format as fmt
    from coordl._disk.cache import INDEX, DiskCache

    cache = DiskCache(folder, identity="scale", n_items=n, label="index at scale")
    cache.items()
    cache.close()
    records = np.zeros(n, dtype=fmt.RECORD)
    records["digest"] = np.random.default_rng(0).permutation(np.arange(1, n + 1, dtype=np.uint64) * 0x9E3779B97F4A7C15)
    records["offset"] = np.arange(n, dtype=np.uint64) * fmt.ALIGN
    with open(os.path.join(folder, INDEX), "ab") as f:
        for start in range(0, n, 256):
            f.write(fmt.group_bytes(records[start:start + 256]))
    del records
    opened = []
    for _ in range(3):
        cache = DiskCache(folder, identity="scale", n_items=n, label="index at scale")
        started = time.perf_counter()
        items = cache.items()
        opened.append(time.perf_counter() - started)
        bytes_per_item = (cache._records.nbytes + sum(r.nbytes for r in cache._tail.values())) / n
        cache.close()
    assert items == n
    return {"items": n, "open_s": sorted(opened), "held_bytes_per_item": bytes_per_item,
            "index_bytes": os.path.getsize(os.path.join(folder, INDEX))}


def _epoch(run: dict, k: int) -> dict:
    return run["epochs"][k]


def summarize(runs: list[dict], dataset_bytes: int, quotas: list[float]) -> dict:
    """Per quota, each repetition's job 2 against the local disk's epoch and the systems without the tier."""
    by_name = {}
    for run in runs:
        by_name.setdefault(run["name"].rsplit("-rep", 1)[0], []).append(run)

    def times(name: str, k: int) -> list[float]:
        return [_epoch(r, k)["time_s"] for r in by_name.get(name, []) if len(r["epochs"]) > k]

    def steady(name: str) -> list[float]:  # the mean of the epochs after the first
        return [sum(e["time_s"] for e in r["epochs"][1:]) / (len(r["epochs"]) - 1) for r in by_name.get(name, [])
                if len(r["epochs"]) > 1]

    def device(name: str, k: int) -> list[float]:
        return [_epoch(r, k)["device_read_bytes"] / dataset_bytes for r in by_name.get(name, []) if len(r["epochs"]) > k]
    out = {"local_epoch1_s": times("local", 0), "torch_steady_s": times("torch", -1),
           "coordl_steady_s": times("coordl", -1), "coordl_steady_device": device("coordl", -1), "quotas": {},
           "hot_path_with_tier": [without / with_ for without, with_ in zip(steady("hot"), steady("hot-disk"))]}
    for quota in quotas:
        job1, job2 = f"job1-q{quota:g}", f"job2-q{quota:g}"
        local = out["local_epoch1_s"]
        out["quotas"][f"{quota:g}"] = {
            "job1_device": [device(job1, k) for k in range(3)], "job2_device": [device(job2, k) for k in range(3)],
            "job2_epoch_s": [times(job2, k) for k in range(3)],
            "job2_epoch1_vs_local": [lo / t for lo, t in zip(local, times(job2, 0))],
            "job2_steady_vs_torch": [t / j for t, j in zip(out["torch_steady_s"], times(job2, -1))],
            "job2_steady_vs_coordl": [c / j for c, j in zip(out["coordl_steady_s"], times(job2, -1))],
            "expected_later_device": max(0.0, 1 - quota - SHM_SHARE)}
    return out


def markdown(summary: dict, index: dict) -> str:
    def spread(values) -> str:
        return report.spread_text(metrics.spread(values)) if values else "–"

    lines = ["| disk quota | job 2: device / D, epochs 1–3 | job 2's epoch 1 speed ÷ the local disk's | "
             "job 2 × torch | job 2 × coordl without | job 1's last epoch: device / D (asked: 1 − x − ¼) |",
             "|---" * 6 + "|"]
    for quota, q in summary["quotas"].items():
        job2 = ", ".join(spread(d) for d in q["job2_device"])
        lines.append(f"| {float(quota):.0%} | {job2} | {spread(q['job2_epoch1_vs_local'])} | "
                     f"{spread(q['job2_steady_vs_torch'])}× | "
                     f"{spread(q['job2_steady_vs_coordl'])}× | {spread(q['job1_device'][-1])} "
                     f"({q['expected_later_device']:.2f}) |")
    lines += ["", f"Every hit a memory hit: samples/s of the epochs after the first with the tier on ÷ off "
                  f"{spread(summary['hot_path_with_tier'])} (asked: ≥ 0.95).",
              "", f"Opening a disk cache of {index['items']:,} items: {spread(index['open_s'])} s, "
                  f"{index['held_bytes_per_item']:.0f} B held an item ({index['index_bytes'] / 2**20:.0f} MiB index)."]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    from coordl._demo.synthetic import make_image_folder

    with Cleanup() as cleanup:
        work = cleanup.workdir(args.workdir)
        source = os.path.join(work, "train")
        print(f"generating {args.images} JPEGs in {source} ...", flush=True)
        make_image_folder(source, args.images, seed=args.seed)
        storage = prepare_storage("cgroup", source, cleanup, work)
        if storage.mode != "cgroup":
            print(f"needs root and cgroups: {storage.detail}", file=sys.stderr)
            return 2
        sizes = [os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(source) for f in files]
        dataset = sum(sizes)
        shm = int(SHM_SHARE * dataset)
        print(f"dataset {len(sizes)} files, {dataset / 2**20:.1f} MiB on {storage.dataset_on} at {args.read_mbps} MB/s; "
              f"memory cache {shm / 2**20:.1f} MiB", flush=True)
        runs = []
        for rep in range(args.reps):
            print(f"repetition {rep + 1} of {args.reps}", flush=True)
            common = dict(epochs=args.epochs)
            runs.append(_run(args, cleanup, storage, f"torch-rep{rep}", storage.root, system="torch", cache_bytes=0,
                             page_cache=shm, **common))
            runs.append(_run(args, cleanup, storage, f"coordl-rep{rep}", storage.root, system="coordl",
                             cache_bytes=shm, page_cache=0, **common))
            runs.append(_run(args, cleanup, storage, f"local-rep{rep}", source, system="coordl", cache_bytes=shm,
                             page_cache=0, epochs=1))
            for quota in args.quotas:
                cache_dir = os.path.join(work, f"disk-{quota:g}-{rep}")
                limit = None if quota >= 1.0 else int(quota * dataset)
                for job in ("job1", "job2"):
                    runs.append(_run(args, cleanup, storage, f"{job}-q{quota:g}-rep{rep}", storage.root,
                                     system="coordl", cache_bytes=shm, page_cache=0, cache_dir=cache_dir, quota=limit,
                                     cache_name=f"q{quota:g}-rep{rep}", **common))
                shutil.rmtree(cache_dir, ignore_errors=True)
            whole = int(1.1 * dataset)  # every later hit a memory hit: what the tier costs the hot path
            for tier in (False, True) if rep % 2 == 0 else (True, False):  # neither always runs first
                runs.append(_run(args, cleanup, storage, f"hot{'-disk' if tier else ''}-rep{rep}", storage.root,
                                 system="coordl", cache_bytes=whole, page_cache=0,
                                 cache_dir=os.path.join(work, f"disk-hot-{rep}") if tier else None, **common))
            shutil.rmtree(os.path.join(work, f"disk-hot-{rep}"), ignore_errors=True)
        with tempfile.TemporaryDirectory(dir=work) as folder:
            index = index_at_scale(args.index_items, folder)
        summary = summarize(runs, dataset, args.quotas)
        result = {"dataset_bytes": dataset, "files": len(sizes), "shm_share": SHM_SHARE, "runs": runs,
                  "summary": summary, "index": index}
        report.write_run(args.out, result, report.setup_of(args, storage_detail=storage.detail),
                         markdown(summary, index))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
