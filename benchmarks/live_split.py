"""What the live split's timers cost a loader's samples/s: on against off, in many rounds side by side.

    python -m benchmarks.live_split [--workers 0 2] [--builds 3] [--rounds 20] [--out results/live-split]

The live split (``loader.stats()``'s ``storage_wait_s``, ``peer_wait_s`` and ``prep_s``) is timed on the
fetch path, in coordl's workers. Three coordl loaders over the same dataset, fully cached and warm (the
light workloads of ``benchmarks.hotpath``: ``image``, small JPEGs decoded and cropped; ``bytes``, the raw
bytes; the loader alone sets the pace), are alive side by side: ``on``, as shipped; ``off``, whose live
split's clock reads a constant (``hotpath``'s ``coordl-untimed``, in its forked workers too); and ``on2``, a
second ``on``: on against on2 is what this method cannot tell from noise. After an untimed epoch each (the
cache filled, the workers started) and one warm epoch that sets the blocks' length, every round runs one
block of each (the same number of epochs, about ``--block-s`` long), in an order that rotates each round,
and gives the ratios on/off and on/on2 of their samples/s: blocks that ran within a second or so of each
other, so that the machine's drift cancels. There are ``--builds`` fresh sets of loaders (built in a
rotating order), each run for ``--rounds`` rounds. Reported per workload and worker count: the median ratio
over all rounds with its 95% bootstrap interval (:func:`median_interval`), and the rounds' min and max.
Timers costing at most 1% (the goal) is shown where the interval of on/off lies at or above 0.99. Each build
checks that the switch did what it says: off's live split stays at 0 while on's grows. Writes
``results.json`` (with ``setup``), ``results.md`` and (with matplotlib) ``live_split.png`` to ``--out``.
"""

import argparse
import os
import statistics
import sys
import time

from benchmarks import hotpath

SYSTEMS = ("on", "off", "on2")
GOAL = 0.99
"""on/off's interval must lie at or above this: the timers cost at most 1% of samples/s."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.live_split", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=4000, help="files in the dataset (default: 4000)")
    parser.add_argument("--mean-side-px", type=int, default=48, help="generated images' mean longer side (default: 48)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="default: 0 2")
    parser.add_argument("--workloads", nargs="+", choices=hotpath.WORKLOADS, default=list(hotpath.WORKLOADS))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--builds", type=int, default=3, help="fresh sets of the three loaders (default: 3)")
    parser.add_argument("--rounds", type=int, default=20, help="rounds per build (default: 20)")
    parser.add_argument("--block-s", type=float, default=0.3, help="about how long one block runs (default: 0.3)")
    parser.add_argument("--out", default="results/live-split", help="default: results/live-split")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.workers) < 0 or min(args.builds, args.rounds, args.images) < 1 or args.block_s <= 0:
        parser.error("--workers must be >= 0, --builds, --rounds and --images >= 1, and --block-s above 0")
    return args


def _clock(system: str):
    return hotpath.clock("coordl-untimed" if system == "off" else "coordl")


def _pass_s(dl, passes: int = 1) -> float:
    started = time.perf_counter()
    for _ in range(passes):
        for _ in dl:
            pass
    return time.perf_counter() - started


def _live_split_s(dl) -> float:
    total = dl.stats().total
    return total.storage_wait_s + total.peer_wait_s + total.prep_s


def measure(root: str, workload: str, workers: int, args, build: int) -> dict:
    """One build of the three loaders: their untimed epoch, then ``args.rounds`` rounds; each round's
    samples/s per loader, how long on's blocks took (median ``block_s``), and each loader's live split
    (seconds) at the end."""
    turn = build % len(SYSTEMS)
    order = SYSTEMS[turn:] + SYSTEMS[:turn]
    loaders = {}
    try:
        for system in order:  # built, their workers forked, under their own clock; the cache filled
            with _clock(system):
                loaders[system] = hotpath.loader("coordl", root, workload, workers, args.batch_size,
                                                 args.seed + build)
                _pass_s(loaders[system])
        with _clock(order[0]):  # a warm epoch sets the blocks' length
            passes = max(1, round(args.block_s / _pass_s(loaders[order[0]])))
        samples = len(loaders["on"].dataset)
        rounds = []
        for r in range(args.rounds):
            rates = {}
            turn = r % len(SYSTEMS)
            for system in order[turn:] + order[:turn]:
                with _clock(system):
                    rates[system] = passes * samples / _pass_s(loaders[system], passes)
            rounds.append(rates)
        split = {system: _live_split_s(dl) for system, dl in loaders.items()}
    finally:
        for dl in loaders.values():
            dl.close()
    return {"workload": workload, "workers": workers, "build": build, "built_in": list(order),
            "epochs_per_block": passes, "block_s": statistics.median(passes * samples / r["on"] for r in rounds),
            "rounds": rounds, "live_split_s": split}


def median_interval(ratios: list[float], resamples: int = 10_000, seed: int = 0) -> dict:
    """The median of ``ratios``, its 95% bootstrap interval (``low``, ``high``: the 2.5th and 97.5th
    percentiles of the medians of ``resamples`` resamplings with replacement), ``min``, ``max`` and ``n``."""
    import numpy as np

    values = np.asarray(ratios, dtype=float)
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(values, size=(resamples, len(values))), axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return {"median": float(np.median(values)), "low": float(low), "high": float(high), "min": float(values.min()),
            "max": float(values.max()), "n": len(values)}


def summarize(builds: list[dict]) -> list[dict]:
    """Per workload and worker count: on/off and on/on2 (:func:`median_interval` over every round of every
    build), each loader's median samples/s, whether the goal is shown, and whether off's live split stayed
    at 0 while on's grew in every build."""
    from benchmarks.metrics import spread

    points = []
    for key in dict.fromkeys((b["workload"], b["workers"]) for b in builds):
        point_builds = [b for b in builds if (b["workload"], b["workers"]) == key]
        rounds = [r for b in point_builds for r in b["rounds"]]
        on_over_off = median_interval([r["on"] / r["off"] for r in rounds])
        points.append({
            "workload": key[0], "workers": key[1], "on_over_off": on_over_off,
            "on_over_on2": median_interval([r["on"] / r["on2"] for r in rounds]),
            **{f"{s}_samples_per_s": spread([r[s] for r in rounds]) for s in SYSTEMS},
            "goal_shown": on_over_off["low"] >= GOAL,
            "switch_checked": all(b["live_split_s"]["off"] == 0 < min(b["live_split_s"]["on"], b["live_split_s"]["on2"])
                                  for b in point_builds)})
    return points


def markdown(points: list[dict]) -> str:
    lines = ["| workload | workers | on samples/s | off samples/s | on / off [95% interval] (rounds' min–max) | "
             "on / on2 [95% interval] (rounds' min–max) | ≤ 1% shown |", "|---" * 7 + "|"]
    for p in points:
        cells = [f"{r['median']:.4f} [{r['low']:.4f}–{r['high']:.4f}] ({r['min']:.2f}–{r['max']:.2f}, "
                 f"n={r['n']})" for r in (p["on_over_off"], p["on_over_on2"])]
        lines.append(f"| {p['workload']} | {p['workers']} | {p['on_samples_per_s']['median']:.0f} | "
                     f"{p['off_samples_per_s']['median']:.0f} | {cells[0]} | {cells[1]} | "
                     f"{'yes' if p['goal_shown'] else 'no'} |")
    if not all(p["switch_checked"] for p in points):
        lines.append("\nIn some build off's live split was not 0, or on's did not grow: the switch did not hold.")
    return "\n".join(lines) + "\n"


def plot(builds: list[dict], points: list[dict], path: str) -> None:
    from benchmarks import report

    drawn = report.axes(figsize=(7, 4))
    if drawn is None:
        return
    plt, fig, ax = drawn
    for n, p in enumerate(points):
        rounds = [r for b in builds if (b["workload"], b["workers"]) == (p["workload"], p["workers"])
                  for r in b["rounds"]]
        for offset, (name, other, color) in enumerate((("on_over_off", "off", "C0"), ("on_over_on2", "on2", "C7"))):
            x = n + (offset - 0.5) * 0.3
            ax.scatter([x] * len(rounds), [r["on"] / r[other] for r in rounds], s=6, alpha=0.4, color=color,
                       label=f"on / {other}" if n == 0 else None)
            r = p[name]
            ax.errorbar([x], [r["median"]], yerr=[[r["median"] - r["low"]], [r["high"] - r["median"]]], fmt="o",
                        color="k", capsize=4)
    ax.axhline(1.0, color="k", linestyle=":")
    ax.axhline(GOAL, color="C3", linestyle="--", linewidth=0.8, label="goal: on / off ≥ 0.99")
    ax.set_xticks(range(len(points)), [f"{p['workload']}\n{p['workers']} workers" for p in points])
    ax.set_ylabel("samples/s ratio (rounds; median, 95% interval)")
    ax.legend(fontsize=8)
    report.save(fig, plt, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("COORDL_LOG_LEVEL", "WARNING")
    from benchmarks import report

    load_at_start = os.getloadavg()
    with hotpath.generated_dataset(args, "coordl-live-split-") as root:
        builds = []
        for build in range(args.builds):
            for workload in args.workloads:
                for workers in args.workers:
                    builds.append(measure(root, workload, workers, args, build))
                    ratios = [r["on"] / r["off"] for r in builds[-1]["rounds"]]
                    print(f"build {build + 1}/{args.builds} {workload:<5} workers={workers}: on / off median "
                          f"{statistics.median(ratios):.4f} over {len(ratios)} rounds", flush=True)
    points = summarize(builds)
    setup = {"machine": report.machine(), "provenance": report.provenance(), "config": vars(args),
             "load_at_start": load_at_start, "load_at_end": os.getloadavg()}
    text = markdown(points)
    report.write_json_and_markdown(args.out, {"points": points, "builds": builds, "setup": setup}, text)
    plot(builds, points, os.path.join(args.out, "live_split.png"))
    print("\n" + text)
    return 0 if all(p["switch_checked"] for p in points) else 1


if __name__ == "__main__":
    sys.exit(main())
