"""``sudo python -m benchmarks.knees [--quick] --out DIR``: are ``coordl analyze``'s what-if knees where the
job's own are?

For each setting (storage MB/s, workers), on the dataset's own throttled loop device and with memory bounded
as in ``benchmarks.analyzer`` (after its warm-up):

1. ``coordl analyze`` of the job with no cache predicts the smallest cache that removes the fetch stall
   (``cache_knee``), and of the job fully cached with one worker the fewest workers that remove the prep
   stall (``workers_knee``);
2. the job is measured (``--reps`` runs, interleaved) at every cache fraction from 0 to 100% in steps of
   ``--step``, and fully cached with 1 to ``2 × cores`` workers (``--quick``: 1 to ``cores``);
3. the measured knee is the least cache fraction (workers) whose median samples/s is within ``--within``
   of the best measured; the recommendation is also run as such: the measured samples/s at the predicted
   knee (rounded up to the grid) over the prediction there (goal: ≥ 95%).

``results.json``: ``settings: [{read_mbps, workers, predicted_cache_knee, measured_cache_knee,
cache_knee_error_points, at_recommendation: {predicted, measured, ratio}, curve: [{cache_fraction, predicted,
measured}]}]``, ``workers: {...}`` likewise; ``setup.json``; ``results.md``; ``knees.png``.
"""

import argparse
import json
import os
import random
import statistics
import sys

from benchmarks import analyzer, report
from benchmarks.metrics import spread
from harness.storage_env import Cleanup, cgroup_version

FULL = dict(settings=((20.0, 1), (10.0, 2)), reps=2, step=0.05, workers_per_core=2)
QUICK = dict(settings=((10.0, 1),), reps=1, step=0.5, workers_per_core=1)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.knees", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="where results.json, setup.json, results.md and knees.png go")
    parser.add_argument("--quick", action="store_true", help="1 setting, 3 cache fractions, 1 to cores workers, 1 run each, small")
    analyzer.add_job_arguments(parser, epochs=4)
    parser.add_argument("--within", type=float, default=0.03, help="a knee: within this of the best (default 0.03)")
    return parser.parse_args(argv)


def knee(points: dict, within: float):
    """The least key of ``points`` ({setting: samples/s}) within ``within`` of the best samples/s."""
    best = max(points.values())
    return min(k for k, v in points.items() if v >= (1 - within) * best)


def _cache_bytes(fraction: float, dataset_bytes: int, largest: int) -> int:
    return int(fraction * dataset_bytes) + (largest if fraction >= 1.0 else 0)  # the last file always fits


def _checked(done: dict, over: list[str]) -> dict:
    """``done`` (an analysis or a run of ``benchmarks.analyzer``), why its memory broke its budget added to
    ``over``."""
    over += analyzer.over_budget_of(done)
    return done


def main(argv=None) -> int:
    args = parse_args(argv)
    grid = QUICK if args.quick else FULL
    images = args.images or (120 if args.quick else 600)
    version = cgroup_version()
    if not version:
        print("benchmarks.knees needs root and cgroups (it throttles the dataset's own disk)", file=sys.stderr)
        return 2
    from coordl.analyzer import load
    load_at_start = os.getloadavg()
    fractions = [round(i * grid["step"], 6) for i in range(int(round(1 / grid["step"])) + 1)]
    cores = len(os.sched_getaffinity(0))
    with Cleanup() as cleanup:
        work, storage, sizes = analyzer.dataset_on_its_disk(cleanup, args, images)
        analyzer.warm_up(cleanup, storage, args, work, servers=1)
        dataset_bytes = sum(sizes)
        settings, over = [], []  # over: why any analysis or run broke its memory budget
        for mbps, workers in grid["settings"]:
            config = {"read_mbps": mbps, "workers": workers, "cache_bytes": 0}
            where = os.path.join(args.out, "analyses", f"{mbps:g}mbps-{workers}w")
            print(f"{mbps:g} MB/s, {workers} workers: analyzing with no cache ...", flush=True)
            _checked(analyzer.analyze(cleanup, storage, config, args, where), over)
            pipeline, _ = load(os.path.join(where, "analysis.json"))
            predicted_knee = pipeline.cache_knee()
            runs = [(x, rep) for rep in range(grid["reps"]) for x in fractions]
            random.Random(args.seed).shuffle(runs)
            measured = {x: [] for x in fractions}
            for n, (x, rep) in enumerate(runs, 1):
                rate = _checked(analyzer.measure(cleanup, storage, {**config, "cache_bytes": _cache_bytes(
                    x, dataset_bytes, max(sizes))}, args, work), over)["samples_per_s"]
                measured[x].append(rate)
                print(f"  [{n}/{len(runs)}] cache {x:.0%}: {rate:.1f} samples/s", flush=True)
            medians = {x: statistics.median(v) for x, v in measured.items()}
            at = None if predicted_knee is None else min(x for x in fractions if x >= predicted_knee - 1e-9)
            expected = None if at is None else pipeline.with_changes(cache_fraction=at).predicted
            settings.append({
                "read_mbps": mbps, "workers": workers, "predicted_cache_knee": predicted_knee,
                "measured_cache_knee": knee(medians, args.within),
                "cache_knee_error_points": None if predicted_knee is None else
                100 * (predicted_knee - knee(medians, args.within)),
                "at_recommendation": None if at is None else {
                    "cache_fraction": at, "predicted": expected, "measured": medians[at],
                    "ratio": medians[at] / expected},
                "curve": [{"cache_fraction": x, "predicted": pipeline.with_changes(cache_fraction=x).predicted,
                           "measured": spread(measured[x])} for x in fractions]})
            s = settings[-1]
            print(f"  cache knee: predicted {predicted_knee}, measured {s['measured_cache_knee']}", flush=True)
        mbps, _ = grid["settings"][0]
        config = {"read_mbps": mbps, "workers": 1, "cache_bytes": _cache_bytes(1.0, dataset_bytes, max(sizes))}
        where = os.path.join(args.out, "analyses", f"{mbps:g}mbps-cached-1w")
        print(f"{mbps:g} MB/s, fully cached, 1 worker: analyzing ...", flush=True)
        _checked(analyzer.analyze(cleanup, storage, config, args, where), over)
        pipeline, _ = load(os.path.join(where, "analysis.json"))
        worker_counts = list(range(1, grid["workers_per_core"] * cores + 1))
        runs = [(w, rep) for rep in range(grid["reps"]) for w in worker_counts]
        random.Random(args.seed + 1).shuffle(runs)
        measured = {w: [] for w in worker_counts}
        for n, (w, rep) in enumerate(runs, 1):
            run = _checked(analyzer.measure(cleanup, storage, {**config, "workers": w}, args, work), over)
            measured[w].append(run["samples_per_s"])
            print(f"  [{n}/{len(runs)}] {w} workers: {measured[w][-1]:.1f} samples/s", flush=True)
        medians = {w: statistics.median(v) for w, v in measured.items()}
        predicted_workers = pipeline.workers_knee()
        workers_result = {
            "read_mbps": mbps, "predicted_workers_knee": predicted_workers,
            "measured_workers_knee": knee(medians, args.within),
            "at_recommendation": None if predicted_workers is None or predicted_workers not in medians else {
                "workers": predicted_workers, "predicted": pipeline.with_changes(workers=predicted_workers).predicted,
                "measured": medians[predicted_workers],
                "ratio": medians[predicted_workers] / pipeline.with_changes(workers=predicted_workers).predicted},
            "curve": [{"workers": w, "predicted": pipeline.with_changes(workers=w).predicted,
                       "measured": spread(measured[w])} for w in worker_counts]}
    result = {"settings": settings, "workers": workers_result, "within": args.within,
              "dataset_bytes": dataset_bytes, "samples": len(sizes), "over_budget": over}
    setup = {"machine": report.machine(), "provenance": report.provenance(), "load_at_start": load_at_start,
             "load_at_end": os.getloadavg(), "storage": storage.detail,
             "settings": {**vars(args), **grid, "images": images}}
    os.makedirs(args.out, exist_ok=True)
    setup["plots"] = [os.path.basename(p) for p in plot(result, args.out)] or report.NO_PLOTS
    for name, content in (("results.json", result), ("setup.json", setup)):
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(content, f, indent=2)
    text = markdown(result, setup) + f"\nanalyses and runs over their memory budget: {len(over)}\n"
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


def _pct(x) -> str:
    return "none" if x is None else f"{100 * x:.0f}%"


def markdown(result: dict, setup: dict) -> str:
    lines = ["# coordl analyze: what-if knees against measured ones\n",
             f"{setup['machine']['summary']}; git {setup['provenance']['git_sha']}; "
             f"`{setup['provenance']['command']}`; a knee: the least setting within {result['within']:.0%} of the "
             "best measured samples/s\n",
             "| storage | workers | predicted cache knee | measured | error (points) | measured / predicted there |",
             "|---|---|---|---|---|---|"]
    for s in result["settings"]:
        at, error = s["at_recommendation"], s["cache_knee_error_points"]
        there = "—" if at is None else "{:.2f} at {:.0%}".format(at["ratio"], at["cache_fraction"])
        lines.append(f"| {s['read_mbps']:g} MB/s | {s['workers']} | {_pct(s['predicted_cache_knee'])} | "
                     f"{_pct(s['measured_cache_knee'])} | {'—' if error is None else format(error, '+.0f')} | "
                     f"{there} |")
    w = result["workers"]
    at = w["at_recommendation"]
    there = "—" if at is None else "{:.2f} at {}".format(at["ratio"], at["workers"])
    lines += ["", "| storage, fully cached | predicted workers knee | measured | measured / predicted there |",
              "|---|---|---|---|",
              f"| {w['read_mbps']:g} MB/s | {w['predicted_workers_knee']} | {w['measured_workers_knee']} | {there} |"]
    return "\n".join(lines) + "\n"


def plot(result: dict, out_dir: str) -> list[str]:
    drawn = report.axes()
    if drawn is None:
        return []
    plt, fig, ax = drawn
    for s in result["settings"]:
        xs = [100 * c["cache_fraction"] for c in s["curve"]]
        line, = ax.plot(xs, [c["measured"]["median"] for c in s["curve"]], "s-",
                        label=f"{s['read_mbps']:g} MB/s, {s['workers']} w: measured")
        ax.plot(xs, [c["predicted"] for c in s["curve"]], "--", color=line.get_color(), label="predicted")
        for k, style in ((s["predicted_cache_knee"], "--"), (s["measured_cache_knee"], ":")):
            if k is not None:
                ax.axvline(100 * k, color=line.get_color(), linestyle=style, linewidth=0.8)
    ax.set_xlabel("cache, % of the dataset (knees: dashed predicted, dotted measured)")
    ax.set_ylabel("samples/s")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    return [report.save(fig, plt, os.path.join(out_dir, "knees.png"))]


if __name__ == "__main__":
    sys.exit(main())
