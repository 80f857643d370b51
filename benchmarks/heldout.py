"""``sudo python -m benchmarks.heldout [--quick] --out DIR``: ``coordl analyze`` on jobs it was not tuned on.

The model was revised against ``benchmarks.analyzer``'s grid: 600 JPEGs of about 400 px, decoded, batches of
16, 1 and 2 workers, a 20 ms step, and no row bound by prep. This grid (:data:`HELD_OUT`) was fixed before it
first ran and differs in each of those: two other datasets (:data:`DATASETS`), the files' raw bytes as well as
decoded images (``analyzer_job.py --workload``), batches of 8 to 64, 0 to 4 workers, steps of 5 to 40 ms, and
rows where prep is the bottleneck; then rows with a disk tier (``cache_dir=``, :data:`DISK_HELD_OUT`, fixed
before their first run: the disk model was tuned on no run). Each configuration is analyzed once and run
``--reps`` times, in a shuffled order, its memory bounded and its dataset on a throttled disk of its own as in
``benchmarks.analyzer`` (whose machinery this uses). ``results.json``: ``configs`` (each with its dataset,
workload, batch size, workers, cache, disk tier, MB/s, step, prediction, measured samples/s, error, bottleneck,
the analysis's trust), ``median_abs_error``, ``max_abs_error``; ``setup.json``; ``results.md``.
"""

import argparse
import os
import random
import statistics
import sys

from benchmarks import report
from benchmarks.analyzer import analyze, dataset_on_its_disk, measure, over_budget_of, warm_up
from benchmarks.metrics import spread
from harness.storage_env import Cleanup, cgroup_version

DATASETS = {"large": (300, 600), "small": (1500, 250)}
"""Each dataset's JPEGs and their mean side in pixels."""
HELD_OUT = (  # dataset, workload, batch size, workers, cache fraction, MB/s, step ms
    ("large", "decode", 8, 0, 0.5, 20, 10),
    ("large", "decode", 8, 1, 1.0, 40, 5),
    ("large", "decode", 32, 2, 0.25, 10, 20),
    ("large", "decode", 32, 4, 0.75, 40, 10),
    ("large", "bytes", 8, 4, 0.0, 20, 20),
    ("large", "bytes", 32, 0, 1.0, 10, 10),
    ("small", "decode", 16, 1, 0.0, 10, 30),
    ("small", "decode", 16, 2, 0.5, 20, 5),
    ("small", "decode", 64, 4, 1.0, 20, 40),
    ("small", "decode", 64, 0, 0.75, 40, 10),
    ("small", "bytes", 16, 1, 0.25, 10, 10),
    ("small", "bytes", 64, 2, 0.5, 40, 5),
)
DISK_HELD_OUT = (  # dataset, workload, batch size, workers, cache fraction, disk fraction, MB/s, step ms
    ("large", "decode", 16, 2, 0.0, 0.5, 10, 10),
    ("large", "bytes", 32, 1, 0.25, 0.75, 10, 5),
    ("large", "decode", 8, 0, 0.0, 1.0, 20, 10),
    ("small", "decode", 32, 4, 0.25, 0.5, 20, 10),
    ("small", "bytes", 8, 2, 0.0, 1.0, 10, 5),
    ("small", "decode", 64, 1, 0.5, 0.25, 40, 20),
)
"""Rows whose misses the disk tier holds in part (its quota that share of the dataset as the tier packs it,
in a folder on this machine's own disk, not throttled), the rest read from the throttled one."""
QUICK = (("small", "decode", 16, 1, 0.5, 0.5, 20, 10),)
QUICK_DATASETS = {"small": (120, 250)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where results.json, setup.json and results.md go")
    parser.add_argument("--quick", action="store_true", help="one configuration on a small dataset, one run")
    parser.add_argument("--reps", type=int, default=2, help="runs of each configuration (default 2)")
    parser.add_argument("--epochs", type=int, default=4, help="epochs of each run (default 4)")
    parser.add_argument("--iters", type=int, default=40, help="coordl analyze --iters (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="coordl analyze --warmup (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default="/var/tmp", help="where the datasets' disk images go")
    args = parser.parse_args(argv)
    args.step_ms, args.backend, args.mean_side_px = 20.0, "torch", 400  # what analyzer's functions read
    return args


def rows(quick: bool) -> list[dict]:
    """The grid's configurations as dicts (without their caches' bytes, which need the dataset)."""
    grid = QUICK if quick else [(d, w, b, n, x, 0.0, m, s) for d, w, b, n, x, m, s in HELD_OUT] + list(DISK_HELD_OUT)
    return [{"dataset": d, "workload": w, "batch_size": b, "workers": n, "cache_fraction": x, "disk_fraction": h,
             "read_mbps": float(m), "step_ms": float(s), "servers": 1} for d, w, b, n, x, h, m, s in grid]


def packed_bytes(root: str) -> int:
    """Bytes the files under ``root`` take in a disk tier, each its 4 KiB-aligned item (``coordl._disk``)."""
    from coordl._disk.format import packed_bytes as item
    return sum(item(os.path.join(d, f), os.path.getsize(os.path.join(d, f))) for d, _, fs in os.walk(root) for f in fs)


def markdown(result: dict, setup: dict) -> str:
    lines = ["# coordl analyze on a held-out grid: predicted against measured\n",
             f"{setup['machine']['summary']}; git {setup['provenance']['git_sha']}; "
             f"`{setup['provenance']['command']}`\n",
             f"median |error| {result['median_abs_error']:.1%}, max |error| {result['max_abs_error']:.1%} over "
             f"{len(result['configs'])} configurations\n",
             "| dataset | workload | batch | workers | cache | disk tier | MB/s | step ms | predicted | "
             "measured [min–max] | error | bottleneck | trusted |", "|" + "---|" * 13]
    for c in result["configs"]:
        m = c["measured_spread"]
        trusted = "withheld" if c["trust"]["withheld"] else "range" if c["trust"]["range"] else "yes"
        lines.append(f"| {c['dataset']} | {c['workload']} | {c['batch_size']} | {c['workers']} | "
                     f"{c['cache_fraction']:.0%} | {c['disk_fraction']:.0%} | {c['read_mbps']:g} | {c['step_ms']:g} | "
                     f"{c['predicted_samples_per_s']:.1f} | {m['median']:.1f} [{m['min']:.1f}–{m['max']:.1f}] | "
                     f"{c['error']:+.1%} | {c['bottleneck']} | {trusted} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.reps = 1
    if not cgroup_version():
        print("benchmarks.heldout needs root and cgroups (it throttles the datasets' own disks)", file=sys.stderr)
        return 2
    configs = rows(args.quick)
    datasets = QUICK_DATASETS if args.quick else DATASETS
    with Cleanup() as cleanup:
        disks = {name: dataset_on_its_disk(cleanup, args, images, side) for name, (images, side) in datasets.items()}
        work, storage, _ = disks[next(iter(disks))]
        warm_up(cleanup, storage, args, work, servers=1)
        random.Random(args.seed).shuffle(configs)
        for n, config in enumerate(configs, 1):
            work, storage, sizes = disks[config["dataset"]]
            x = config["cache_fraction"]
            config["cache_bytes"] = int(x * sum(sizes)) + (max(sizes) if x == 1.0 else 0)
            h = config["disk_fraction"]
            if h:  # room for the index's records too where it holds everything
                config["disk_bytes"] = int(h * packed_bytes(storage.root)) + (2**20 if h == 1.0 else 0)
                config["disk_root"] = work
            print(f"[{n}/{len(configs)}] {config['dataset']} {config['workload']}, batch {config['batch_size']}, "
                  f"{config['workers']} workers, cache {x:.0%}, disk tier {h:.0%}, {config['read_mbps']:g} MB/s, step "
                  f"{config['step_ms']:g} ms: analyzing ...", flush=True)
            analysis = analyze(cleanup, storage, config, args, os.path.join(args.out, "analyses", f"config-{n}"))
            runs = [measure(cleanup, storage, config, args, work) for _ in range(args.reps)]
            measured = spread([r["samples_per_s"] for r in runs])
            config.update(predicted_samples_per_s=analysis["predicted_samples_per_s"], measured_samples_per_s=
                          measured["median"], measured_spread=measured,
                          error=analysis["predicted_samples_per_s"] / measured["median"] - 1,
                          bottleneck=analysis["bottleneck"], rates=analysis["rates"], trust=analysis["trust"],
                          disk_hit_fraction=statistics.median(r["disk_hit_fraction"] for r in runs),
                          analysis_s=analysis["analysis_s"], memory=analysis["memory"] +
                          [m for r in runs for m in r["memory"]])
            config["over_budget"] = over_budget_of(config)
            print(f"  predicted {config['predicted_samples_per_s']:.1f}, measured {measured['median']:.1f} samples/s "
                  f"({config['error']:+.1%}; {config['bottleneck']})", flush=True)
        errors = [abs(c["error"]) for c in configs]
        result = {"configs": configs, "median_abs_error": statistics.median(errors), "max_abs_error": max(errors),
                  "over_budget": [why for c in configs for why in c["over_budget"]]}
        setup = {"machine": report.machine(), "provenance": report.provenance(), "settings": vars(args),
                 "datasets": datasets}
        report.write_run(args.out, result, setup, markdown(result, setup))
    return 0


if __name__ == "__main__":
    sys.exit(main())
