"""Where coordl's advantage ends: :mod:`benchmarks.minio` at one cache fraction over a range of disk bandwidths.

    sudo python -m benchmarks.sweep [--read-mbps 5 10 20 40 80] [--fraction 0.5] [--reps 3] [--out DIR] ...

Below some bandwidth storage is the bottleneck and coordl's MinIO cache (which reads only what it
does not hold) beats the page cache (which thrashes); above it, prep is, and every system runs at
the prep rate: the speedup falls to 1×. The sweep generates one dataset, runs ``benchmarks.minio``
once per bandwidth over it (every point repeated and interleaved as there), and writes each run's
folder (``DIR/mbps-N/``), ``DIR/results.json`` (the speedup and steady epoch time of every system per
bandwidth, as median, min and max), ``DIR/results.md`` and ``DIR/speedup_vs_bandwidth.png``.
"""

import argparse
import json
import os
import sys

from benchmarks import minio, report
from harness.storage_env import Cleanup


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--read-mbps", type=float, nargs="+", default=[5, 10, 20, 40, 80],
                        help="disk read bandwidths, MB/s (default: 5 10 20 40 80)")
    parser.add_argument("--fraction", type=float, default=0.5, help="cache fraction (default: 0.5)")
    parser.add_argument("--systems", nargs="+", default=["torch", "coordl"], help="default: torch coordl")
    parser.add_argument("--images", type=int, default=1200, help="dataset size (default: 1200)")
    parser.add_argument("--mean-side-px", type=int, default=490)
    parser.add_argument("--workdir", default="/var/tmp", help="where the generated dataset goes (a real disk)")
    parser.add_argument("--out", default="results/sweep", help="default: results/sweep")
    parser.add_argument("--seed", type=int, default=0)
    args, rest = parser.parse_known_args(argv)
    if any(b <= 0 for b in args.read_mbps) or not 0 < args.fraction <= 1:
        parser.error(f"bandwidths must be positive and the fraction in (0, 1], but got --read-mbps "
                     f"{args.read_mbps} --fraction {args.fraction}")
    return args, rest


def sweep_point(out: str, read_mbps: float) -> dict:
    """One bandwidth's entry: from its run's ``results.json``, each system's steady time and speedups."""
    with open(os.path.join(out, "results.json")) as f:
        result = json.load(f)
    failed = [f"{r['system']} (repetition {r.get('rep', 0) + 1}): {r['error']}" for r in result["runs"] if "error" in r]
    return {"read_mbps": read_mbps, "folder": os.path.basename(out), "failed": failed,
            "systems": {c["system"]: {"time_s": c["time_s"], "device_read_bytes": c["device_read_bytes"],
                                      "speedup": c["speedup"]} for c in result["comparisons"]}}


def markdown(points: list[dict], fraction: float) -> str:
    systems = list(dict.fromkeys(s for p in points for s in p["systems"]))
    lines = [f"Cache {fraction:.0%}; steady epoch time (s) and coordl's speedups, median [min–max] over repetitions.",
             "", "| MB/s | " + " | ".join(systems) + " | speedup |", "|---" * (len(systems) + 2) + "|"]
    for p in points:
        times = [report.spread_text(p["systems"][s]["time_s"]) if s in p["systems"] else "–" for s in systems]
        speedups = ", ".join(f"{name}: {report.spread_text(v)}× vs {base}" for name, r in p["systems"].items()
                             for base, v in r["speedup"].items()) or "–"
        lines.append(f"| {p['read_mbps']:g} | " + " | ".join(times) + f" | {speedups} |")
    lines += [f"- {p['read_mbps']:g} MB/s: FAILED: {why}" for p in points for why in p["failed"]]
    return "\n".join(lines) + "\n"


def plot(points: list[dict], path: str) -> bool:
    """Each coordl system's speedup over each baseline against bandwidth (median, min–max bars)."""
    drawn = report.axes()
    if drawn is None:
        return False
    plt, fig, ax = drawn
    pairs = list(dict.fromkeys((s, b) for p in points for s, r in p["systems"].items() for b in r["speedup"]))
    for system, base in pairs:
        xs = [p["read_mbps"] for p in points if base in p["systems"].get(system, {}).get("speedup", {})]
        spreads = [p["systems"][system]["speedup"][base] for p in points
                   if base in p["systems"].get(system, {}).get("speedup", {})]
        ax.errorbar(xs, [s["median"] for s in spreads], marker="o", capsize=3, label=f"{system} vs {base}",
                    yerr=[[s["median"] - s["min"] for s in spreads], [s["max"] - s["median"] for s in spreads]])
    ax.axhline(1.0, color="k", linestyle=":")
    ax.set_xscale("log")
    ax.set_xlabel("disk read bandwidth (MB/s)")
    ax.set_ylabel("steady-epoch speedup")
    ax.legend(fontsize=8)
    report.save(fig, plt, path)
    return True


def main(argv=None) -> int:
    args, rest = parse_args(argv)
    from coordl._demo.synthetic import make_image_folder

    os.makedirs(args.out, exist_ok=True)
    points, status = [], 0
    with Cleanup() as cleanup:
        work = cleanup.workdir(args.workdir)
        source = os.path.join(work, "train")
        print(f"generating {args.images} JPEGs in {source} ...", flush=True)
        make_image_folder(source, args.images, mean_side_px=args.mean_side_px, seed=args.seed)
        for mbps in args.read_mbps:
            out = os.path.join(args.out, f"mbps-{mbps:g}")
            print(f"== {mbps:g} MB/s ==", flush=True)
            code = minio.main(["--data", source, "--read-mbps", str(mbps), "--fractions", str(args.fraction),
                               "--systems", *args.systems, "--workdir", args.workdir, "--out", out,
                               "--seed", str(args.seed), *rest])
            if not os.path.exists(os.path.join(out, "results.json")):
                print(f"{mbps:g} MB/s: no results (exit {code})", flush=True)
                return code or 1
            status = status or code
            points.append(sweep_point(out, mbps))
    result = {"cache_fraction": args.fraction, "points": points}
    setup = {"machine": report.machine(), "provenance": report.provenance(), "config": vars(args), "minio_args": rest}
    text = markdown(points, args.fraction)
    report.write_json_and_markdown(args.out, {**result, "setup": setup}, text)
    plotted = plot(points, os.path.join(args.out, "speedup_vs_bandwidth.png"))
    print("\n" + text + ("" if plotted else f"\n({report.NO_PLOTS})"))
    return status


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
