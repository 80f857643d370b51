"""``sudo python -m benchmarks.analyzer [--quick] --out DIR``: how well ``coordl analyze`` predicts a job.

For each configuration (cache fraction × storage bandwidth × workers) on a dataset copied onto a loop
device of its own, read through a cgroup that throttles (and counts) that device only:

1. ``coordl analyze`` runs ``benchmarks/analyzer_job.py`` (a small training script: random crops of an
   ImageFolder, a ``--step-ms`` step) and predicts its steady-epoch samples/s, min(F, P, G);
2. the same script runs ``--reps`` times as configured for ``--epochs`` epochs; the measured throughput is
   the median over runs of the epochs after the first (the cache filled) samples/s.

Every run gets a fresh cgroup and a shm folder of its own (no cache carries over); the loader drops
what it reads from the page cache (``drop_page_cache=True``), so each epoch's misses come from the
device, which the cgroup's counters check (``device_bytes_per_epoch``). Configurations run in a shuffled
order. ``results.json``: ``configs: [{cache_fraction, read_mbps, workers, predicted_samples_per_s,
measured_samples_per_s, measured_spread, error, bottleneck, analysis_s, ...}]``, ``median_abs_error``,
``max_abs_error``; ``setup.json``: machine, git SHA, load, settings; ``results.md``; ``analyzer.png``
(predicted against measured, Fig. 11 style).
"""

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

from benchmarks import report
from benchmarks.metrics import spread
from coordl._shm import shm_dir
from benchmarks.storage_env import (PREFIX, Cleanup, cgroup_version, device_read_bytes, evict_files, prepare_storage,
                                    run_child)

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "analyzer_job.py")
FULL = dict(fractions=(0.0, 0.25, 0.5, 0.75, 1.0), mbps=(10.0, 20.0, 40.0), workers=(1, 2), reps=3)
QUICK = dict(fractions=(0.0, 1.0), mbps=(10.0,), workers=(1,), reps=1)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.analyzer", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="where results.json, setup.json, results.md and the plot go")
    parser.add_argument("--quick", action="store_true", help="2 configurations, 1 run each, a small dataset")
    add_job_arguments(parser, epochs=3)
    return parser.parse_args(argv)


def add_job_arguments(parser: argparse.ArgumentParser, *, epochs: int) -> None:
    """The dataset, the job (``analyzer_job.py``) and the analyses' settings, shared with ``benchmarks.knees``."""
    parser.add_argument("--images", type=int, help="JPEGs in the dataset (default 600; quick: 120)")
    parser.add_argument("--mean-side-px", type=int, default=400, help="mean side of the JPEGs (default 400)")
    parser.add_argument("--epochs", type=int, default=epochs, help=f"epochs of each measured run (default {epochs})")
    parser.add_argument("--step-ms", type=float, default=20.0, help="the training step per batch (default 20)")
    parser.add_argument("--iters", type=int, default=40, help="coordl analyze --iters (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="coordl analyze --warmup (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default="/var/tmp", help="where the dataset's disk image goes")


def _cgroup(cleanup: Cleanup, version: int, device: str, read_mbps: float):
    name = f"{PREFIX}-analyzer-{os.getpid()}-{time.monotonic_ns()}"
    return cleanup.cgroup(name, version, device, int(read_mbps * 1e6), page_cache_bytes=None)


def _run(cmd: list[str], group, timeout_s: float) -> tuple[str, int]:
    """Run ``cmd`` in ``group`` with a shm folder of its own; its stdout and the device bytes it read."""
    shm = tempfile.mkdtemp(prefix=f"{PREFIX}-analyzer-", dir=shm_dir())
    previous = os.environ.get("COORDL_SHM_DIR")
    os.environ["COORDL_SHM_DIR"] = shm
    try:
        result = run_child(cmd, timeout_s, group)
        read = device_read_bytes(group.counter())
    finally:
        group.remove()
        shutil.rmtree(shm, ignore_errors=True)
        if previous is None:
            os.environ.pop("COORDL_SHM_DIR", None)
        else:
            os.environ["COORDL_SHM_DIR"] = previous
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed ({'timed out' if result.timed_out else result.returncode})"
                           f": {result.stderr[-3000:]}")
    return result.stdout, read


def analyze(cleanup, storage, config: dict, args, out_dir: str) -> dict:
    """``coordl analyze`` of ``config``: its analysis.json, and how long it took."""
    group = _cgroup(cleanup, storage.cgroup_version, storage.device, config["read_mbps"])
    started = time.monotonic()
    _run([sys.executable, "-m", "coordl.cli", "analyze", "--out", out_dir, "--iters", str(args.iters),
          "--warmup", str(args.warmup), "--", sys.executable, JOB, storage.root,
          "--cache-bytes", str(config["cache_bytes"]), "--workers", str(config["workers"]),
          "--step-ms", str(args.step_ms)], group, 1800)
    with open(os.path.join(out_dir, "analysis.json")) as f:
        return {**json.load(f), "analysis_s": time.monotonic() - started}


def measure(cleanup, storage, config: dict, args, work: str) -> dict:
    """One run of the job as configured: its steady epochs' samples/s and device bytes per epoch."""
    group = _cgroup(cleanup, storage.cgroup_version, storage.device, config["read_mbps"])
    out = os.path.join(work, f"epochs-{time.monotonic_ns()}.json")
    _, read = _run([sys.executable, JOB, storage.root, "--cache-bytes", str(config["cache_bytes"]),
                    "--workers", str(config["workers"]), "--epochs", str(args.epochs), "--step-ms", str(args.step_ms),
                    "--out", out], group, 1800)
    with open(out) as f:
        epochs = json.load(f)
    steady = epochs[1:]
    return {"samples_per_s": sum(e["samples"] for e in steady) / sum(e["time_s"] for e in steady),
            "device_bytes_per_epoch": read / len(epochs), "hit_fraction": sum(e["hits"] for e in steady) /
            max(1, sum(e["hits"] + e["misses"] for e in steady))}


def plot(configs: list[dict], out_dir: str) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    groups = sorted({(c["read_mbps"], c["workers"]) for c in configs})
    fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.5), squeeze=False)
    for ax, (mbps, workers) in zip(axes[0], groups):
        mine = sorted((c for c in configs if (c["read_mbps"], c["workers"]) == (mbps, workers)),
                      key=lambda c: c["cache_fraction"])
        xs = [100 * c["cache_fraction"] for c in mine]
        ax.plot(xs, [c["predicted_samples_per_s"] for c in mine], "o--", label="predicted min(F, P, G)")
        ax.errorbar(xs, [c["measured_samples_per_s"] for c in mine],
                    yerr=[[c["measured_samples_per_s"] - c["measured_spread"]["min"] for c in mine],
                          [c["measured_spread"]["max"] - c["measured_samples_per_s"] for c in mine]],
                    fmt="s-", label="measured", capsize=3)
        ax.set_title(f"{mbps:g} MB/s, {workers} worker{'s' if workers > 1 else ''}")
        ax.set_xlabel("cache, % of the dataset")
        ax.set_ylabel("samples/s")
        ax.set_ylim(bottom=0)
    axes[0][0].legend(fontsize=8)
    return [report.save(fig, plt, os.path.join(out_dir, "analyzer.png"))]


def markdown(result: dict, setup: dict) -> str:
    lines = [f"# coordl analyze: predicted against measured\n", f"{setup['machine']['summary']}; git "
             f"{setup['provenance']['git_sha']}; `{setup['provenance']['command']}`\n",
             f"median |error| {result['median_abs_error']:.1%}, max |error| {result['max_abs_error']:.1%} over "
             f"{len(result['configs'])} configurations\n",
             "| cache | MB/s | workers | predicted | measured [min–max] | error | bottleneck | analysis s |",
             "|---|---|---|---|---|---|---|---|"]
    for c in sorted(result["configs"], key=lambda c: (c["read_mbps"], c["workers"], c["cache_fraction"])):
        s = c["measured_spread"]
        lines.append(f"| {c['cache_fraction']:.0%} | {c['read_mbps']:g} | {c['workers']} | "
                     f"{c['predicted_samples_per_s']:.1f} | {s['median']:.1f} [{s['min']:.1f}–{s['max']:.1f}] | "
                     f"{c['error']:+.1%} | {c['bottleneck']} | {c['analysis_s']:.0f} |")
    return "\n".join(lines) + "\n"


def dataset_on_its_disk(cleanup: Cleanup, args, images: int):
    """``images`` generated JPEGs copied onto a throttled loop device of their own, every page dropped so
    that each run starts cold: the work folder, the storage and the files' sizes."""
    from coordl.synthetic import make_image_folder
    work = cleanup.workdir(args.workdir)
    source = os.path.join(work, "train")
    print(f"generating {images} JPEGs ...", flush=True)
    make_image_folder(source, images, mean_side_px=args.mean_side_px, seed=args.seed)
    storage = prepare_storage("cgroup", source, cleanup, work)
    evict_files(storage.root)
    sizes = [os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(storage.root) for f in fs]
    print(f"dataset {len(sizes)} files, {sum(sizes) / 2**20:.1f} MiB on {storage.dataset_on} ({storage.detail})",
          flush=True)
    return work, storage, sizes


def main(argv=None) -> int:
    args = parse_args(argv)
    grid = QUICK if args.quick else FULL
    images = args.images or (120 if args.quick else 600)
    version = cgroup_version()
    if not version:
        print("benchmarks.analyzer needs root and cgroups (it throttles the dataset's own disk)", file=sys.stderr)
        return 2
    load_at_start = os.getloadavg()
    with Cleanup() as cleanup:
        work, storage, sizes = dataset_on_its_disk(cleanup, args, images)
        dataset_bytes = sum(sizes)
        configs = [{"cache_fraction": x, "read_mbps": mbps, "workers": w,
                    "cache_bytes": int(x * dataset_bytes) + (max(sizes) if x == 1.0 else 0)}
                   for x in grid["fractions"] for mbps in grid["mbps"] for w in grid["workers"]]
        random.Random(args.seed).shuffle(configs)
        for n, config in enumerate(configs, 1):
            where = f"[{n}/{len(configs)}] cache {config['cache_fraction']:.0%}, {config['read_mbps']:g} MB/s, " \
                    f"{config['workers']} workers"
            print(f"{where}: analyzing ...", flush=True)
            analysis = analyze(cleanup, storage, config, args, os.path.join(args.out, "analyses", f"config-{n}"))
            runs = [measure(cleanup, storage, config, args, work) for _ in range(grid["reps"])]
            measured = spread([r["samples_per_s"] for r in runs])
            config.update(predicted_samples_per_s=analysis["predicted_samples_per_s"],
                          measured_samples_per_s=measured["median"], measured_spread=measured,
                          error=analysis["predicted_samples_per_s"] / measured["median"] - 1,
                          bottleneck=analysis["bottleneck"], rates=analysis["rates"],
                          contention=analysis.get("contention", 1.0),
                          analysis_s=analysis["analysis_s"], flags=analysis.get("flags", []),
                          device_bytes_per_epoch=[r["device_bytes_per_epoch"] for r in runs],
                          hit_fraction=[r["hit_fraction"] for r in runs])
            print(f"  predicted {config['predicted_samples_per_s']:.1f}, measured {measured['median']:.1f} "
                  f"samples/s ({config['error']:+.1%}; {config['bottleneck']}); analysis {config['analysis_s']:.0f} s",
                  flush=True)
        errors = [abs(c["error"]) for c in configs]
        result = {"configs": configs, "median_abs_error": statistics.median(errors), "max_abs_error": max(errors),
                  "dataset_bytes": dataset_bytes, "samples": len(sizes)}
        setup = {"machine": report.machine(), "provenance": report.provenance(), "load_at_start": load_at_start,
                 "load_at_end": os.getloadavg(), "storage": storage.detail, "settings": {**vars(args), **grid,
                                                                                            "images": images}}
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
