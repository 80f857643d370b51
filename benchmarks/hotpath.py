"""The cache must never cost throughput: coordl against torch's DataLoader when nothing is slow but the loader.

    python -m benchmarks.hotpath [--images 4000] [--workers 0 1 2 8] [--reps 3] [--out results/hotpath]
                                 [--systems torch coordl coordl-untimed]

Everything is warm: torch reads small files from the page cache, coordl from its cache (filled by
an untimed first epoch). Two workloads: ``image`` (small JPEGs, decoded and center-cropped to 32 px,
a cheap transform) and ``bytes`` (the files' raw bytes, no decode: the loader alone). For each
workload and worker count, torch and coordl run side by side in interleaved repeated trials (each
trial builds both loaders, runs one untimed epoch, then times ``--epochs`` epochs; workers
persist across epochs). Reports samples/s, coordl / torch as median and min–max over trials, and
the per-sample cost of coordl's fetch path against reading the file, in µs, measured in-process.
``coordl-untimed`` is coordl with the clock its live split (``loader.stats()``'s ``storage_wait_s``,
``peer_wait_s``, ``prep_s``) reads replaced by a constant, in the workers too (forked): coordl against
it is what those timers cost; with it in ``--systems`` the same cost is also measured in-process, on
coordl's hit path alone (best of 15 passes over every batch, with the clock and without), and estimated
from its parts (``bound_fraction``): the clock reads a pass makes per batch, counted, times what one timer
(two reads and the add to its counter) takes, timed alone over a million repetitions.
Writes ``results.json``, ``results.md`` and (with matplotlib) ``hotpath.png`` to ``--out``.
"""

import argparse
import contextlib
import os
import random
import shutil
import sys
import tempfile
import time
import types

WORKLOADS = ("image", "bytes")
SYSTEMS = ("torch", "coordl", "coordl-untimed")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hotpath", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=4000, help="files in the dataset (default: 4000)")
    parser.add_argument("--mean-side-px", type=int, default=48, help="generated images' mean longer side (default: 48)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2, 8], help="default: 0 1 2 8")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=["torch", "coordl"],
                        help="default: torch coordl")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per trial (default: 3)")
    parser.add_argument("--reps", type=int, default=3, help="trials of every point, interleaved (default: 3)")
    parser.add_argument("--out", default="results/hotpath", help="default: results/hotpath")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.workers) < 0 or args.reps < 1 or args.epochs < 1 or args.images < 1:
        parser.error("--workers must be >= 0, and --reps, --epochs and --images >= 1")
    return args


def _crop_to_tensor():
    from torchvision import transforms as T

    return T.Compose([T.CenterCrop(32), T.PILToTensor()])


def bytes_collate(batch):
    """A batch of raw bytes as the list it is."""
    return batch


def dataset(root: str, workload: str):
    """The dataset both loaders read: an ImageFolder (``image``), or the same files as raw bytes."""
    import torchvision

    import coordl

    folder = torchvision.datasets.ImageFolder(root, transform=_crop_to_tensor())
    if workload == "image":
        return folder
    return coordl.FileDataset([path for path, _ in folder.samples], decode="bytes")


def loader(system: str, root: str, workload: str, workers: int, batch_size: int, seed: int):
    import torch

    import coordl

    options = dict(batch_size=batch_size, shuffle=True, num_workers=workers, persistent_workers=workers > 0,
                   generator=torch.Generator().manual_seed(seed),
                   collate_fn=bytes_collate if workload == "bytes" else None)
    if system == "torch":
        return torch.utils.data.DataLoader(dataset(root, workload), **options)
    return coordl.DataLoader(dataset(root, workload), cache_bytes="1GiB", **options)


def clock(system: str):
    """For ``coordl-untimed``, the live split's clock reads 0 while the trial runs (its forked workers too)."""
    return _live_split_clock(int if system == "coordl-untimed" else None)


@contextlib.contextmanager
def _live_split_clock(read):
    """The live split reads its clock with ``read()`` (None: the real clock) while this lasts."""
    from coordl._fetch import cached_dataset

    real = cached_dataset.time
    if read is not None:
        cached_dataset.time = types.SimpleNamespace(perf_counter_ns=read)
    try:
        yield
    finally:
        cached_dataset.time = real


def samples_per_s(dl, epochs: int) -> float:
    """One untimed epoch (coordl fills its cache; workers start), then ``epochs`` timed ones."""
    for _ in dl:
        pass
    started = time.perf_counter()
    for _ in range(epochs):
        for _ in dl:
            pass
    return epochs * len(dl.dataset) / (time.perf_counter() - started)


def fetch_cost_us(root: str, rounds: int = 3) -> dict:
    """Per sample, in-process, in µs: reading a file's bytes (what torch's dataset does), and coordl's fetch
    path for the same sample once cached (best of ``rounds`` passes over every sample)."""
    import coordl

    files = dataset(root, "bytes")
    with coordl.DataLoader(files, batch_size=None, cache_bytes="1GiB") as dl:
        cached = dl.dataset
        for i in range(len(cached)):
            cached[i]  # fill
        indices = list(range(len(files)))

        def best(fetch) -> float:
            times = []
            for _ in range(rounds):
                random.shuffle(indices)
                started = time.perf_counter()
                for i in indices:
                    fetch(i)
                times.append((time.perf_counter() - started) / len(indices) * 1e6)
            return min(times)

        read, hit = best(files.__getitem__), best(cached.__getitem__)
    return {"read_file_us": read, "coordl_hit_us": hit, "difference_us": hit - read}


def timer_cost(root: str, workload: str, batch_size: int, rounds: int = 15) -> dict:
    """What the live split's clock costs a batch on coordl's hit path, in-process (no IPC to hide it): per
    round, one pass over every batch with the clock and one without (the order alternating), in µs per
    batch (median and min–max over ``rounds``); the cost is the best timed pass less the best untimed
    one (the least disturbed of each), in µs and as a fraction of the best timed pass."""
    from benchmarks.metrics import spread
    import coordl

    with coordl.DataLoader(dataset(root, workload), batch_size=batch_size, cache_bytes="1GiB") as dl:
        cached = dl.dataset
        indices = list(range(len(cached)))
        batches = [indices[i:i + batch_size] for i in range(0, len(indices), batch_size)]
        for batch in batches:
            cached.__getitems__(batch)  # fill

        def per_batch_us(system: str) -> float:
            with clock(system):
                started = time.perf_counter()
                for batch in batches:
                    cached.__getitems__(batch)
                return (time.perf_counter() - started) / len(batches) * 1e6

        timed, untimed = [], []
        for r in range(rounds):
            random.shuffle(indices)
            batches = [indices[i:i + batch_size] for i in range(0, len(indices), batch_size)]
            for system in ("coordl", "coordl-untimed")[::1 if r % 2 else -1]:
                (timed if system == "coordl" else untimed).append(per_batch_us(system))
        reads = clock_reads_per_batch(cached, batches)
    cost, timer = min(timed) - min(untimed), timer_us()
    return {"workload": workload, "batch_size": batch_size, "rounds": rounds, "timed_batch_us": spread(timed),
            "untimed_batch_us": spread(untimed), "cost_us": cost, "cost_fraction": cost / min(timed),
            "clock_reads_per_batch": reads, "timer_us": timer,
            "bound_fraction": reads / 2 * timer / min(timed)}


def clock_reads_per_batch(cached, batches: list[list[int]]) -> float:
    """The clock reads the live split makes per batch of ``batches`` through ``cached`` (counted)."""
    reads = [0]

    def counted() -> int:
        reads[0] += 1
        return time.perf_counter_ns()

    with _live_split_clock(counted):
        for batch in batches:
            cached.__getitems__(batch)
    return reads[0] / len(batches)


def timer_us(repetitions: int = 1_000_000) -> float:
    """µs one timer of the live split takes, as the fetch path writes it: two clock reads and the add of
    their difference to a row of 64-bit counters (the best of 5 runs of ``repetitions``)."""
    import timeit

    import numpy as np

    setup = {"perf_counter_ns": time.perf_counter_ns, "row": np.zeros(8, dtype=np.int64)}
    runs = timeit.repeat("started = perf_counter_ns(); row[3] += perf_counter_ns() - started", globals=setup,
                         number=repetitions, repeat=5)
    return min(runs) / repetitions * 1e6


@contextlib.contextmanager
def generated_dataset(args, prefix: str):
    """``args.images`` generated JPEGs of ``args.mean_side_px`` in a temporary folder named ``prefix...``, the
    loaders' caches in a shm folder of their own (``COORDL_SHM_DIR`` while this lasts), both removed at the end:
    the root."""
    from coordl._core.settings import SHM_DIR_ENV
    from coordl._demo.synthetic import make_image_folder

    work, previous = tempfile.mkdtemp(prefix=prefix), os.environ.get(SHM_DIR_ENV)
    shm = tempfile.mkdtemp(prefix=prefix, dir=previous or "/dev/shm")
    os.environ[SHM_DIR_ENV] = shm
    try:
        root = os.path.join(work, "images")
        print(f"generating {args.images} JPEGs of ~{args.mean_side_px} px in {root} ...", flush=True)
        make_image_folder(root, args.images, mean_side_px=args.mean_side_px, seed=args.seed)
        yield root
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
        if previous is None:
            os.environ.pop(SHM_DIR_ENV, None)
        else:
            os.environ[SHM_DIR_ENV] = previous


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("COORDL_LOG_LEVEL", "WARNING")
    from benchmarks import report
    from benchmarks.metrics import spread

    with generated_dataset(args, "coordl-hotpath-") as root:
        trials = []
        for rep in range(args.reps):
            for workload in args.workloads:
                for workers in args.workers:
                    turn = (rep + workers) % len(args.systems)
                    for system in args.systems[turn:] + args.systems[:turn]:
                        with clock(system):
                            with_loader = loader(system, root, workload, workers, args.batch_size, args.seed + rep)
                            rate = samples_per_s(with_loader, args.epochs)
                            if hasattr(with_loader, "close"):
                                with_loader.close()
                            del with_loader
                        trials.append({"rep": rep, "workload": workload, "workers": workers, "system": system,
                                       "samples_per_s": rate})
                        print(f"trial {rep + 1}/{args.reps} {workload:<5} workers={workers} {system:<6} "
                              f"{rate:9.0f} samples/s", flush=True)
        points = []
        for workload in args.workloads:
            for workers in args.workers:
                rates = {s: {t["rep"]: t["samples_per_s"] for t in trials
                             if (t["workload"], t["workers"], t["system"]) == (workload, workers, s)}
                         for s in args.systems}
                point = {"workload": workload, "workers": workers}
                point.update({f"{s.replace('-', '_')}_samples_per_s": spread(list(rates[s].values()))
                              for s in args.systems})
                for name, (a, b) in (("coordl_over_torch", ("coordl", "torch")),
                                     ("timed_over_untimed", ("coordl", "coordl-untimed"))):
                    if a in rates and b in rates:
                        point[name] = spread([rates[a][rep] / rates[b][rep] for rep in range(args.reps)])
                points.append(point)
        cost = fetch_cost_us(root)
        timers = ([timer_cost(root, workload, args.batch_size) for workload in args.workloads]
                  if "coordl-untimed" in args.systems else [])
    result = {"points": points, "trials": trials, "fetch_cost": cost, "timer_cost": timers}
    setup = {"machine": report.machine(), "provenance": report.provenance(), "config": vars(args)}
    text = markdown(result)
    report.write_json_and_markdown(args.out, {**result, "setup": setup}, text)
    plot(points, os.path.join(args.out, "hotpath.png"))
    print("\n" + text)
    return 0


RATIOS = {"coordl_over_torch": "coordl / torch", "timed_over_untimed": "coordl / coordl-untimed"}


def markdown(result: dict) -> str:
    from benchmarks import report

    first = result["points"][0]
    systems = [s for s in SYSTEMS if f"{s.replace('-', '_')}_samples_per_s" in first]
    ratios = [r for r in RATIOS if r in first]
    lines = ["| workload | workers | " + " | ".join(f"{s} samples/s" for s in systems) + " | " +
             " | ".join(RATIOS[r] for r in ratios) + " |", "|---" * (2 + len(systems) + len(ratios)) + "|"]
    for p in result["points"]:
        lines.append(f"| {p['workload']} | {p['workers']} | " +
                     " | ".join(f"{p[s.replace('-', '_') + '_samples_per_s']['median']:.0f}" for s in systems) +
                     " | " + " | ".join(f"{report.spread_text(p[r])}×" for r in ratios) + " |")
    c = result["fetch_cost"]
    lines += ["", f"Per sample, in-process: reading the file {c['read_file_us']:.1f} µs, coordl's fetch path on a "
              f"hit {c['coordl_hit_us']:.1f} µs ({c['difference_us']:+.1f} µs)."]
    for t in result.get("timer_cost", []):
        lines.append(f"\nThe live split's clock, in-process, {t['workload']} batches of {t['batch_size']} (best of "
                     f"{t['rounds']} rounds): {t['cost_us']:+.2f} µs a batch of {t['timed_batch_us']['min']:.1f} µs "
                     f"({t['cost_fraction']:+.2%}); a batch took {report.spread_text(t['timed_batch_us'], '.1f')} µs "
                     f"timed, {report.spread_text(t['untimed_batch_us'], '.1f')} µs untimed. From its parts: "
                     f"{t['clock_reads_per_batch']:g} clock reads a batch, one timer (two reads and the add) "
                     f"{t['timer_us']:.3f} µs, about {t['bound_fraction']:.3%} of the best timed batch.")
    return "\n".join(lines) + "\n"


def plot(points: list[dict], path: str) -> None:
    from benchmarks import report

    drawn = report.axes()
    if drawn is None:
        return
    plt, fig, ax = drawn
    for workload in dict.fromkeys(p["workload"] for p in points):
        mine = [p for p in points if p["workload"] == workload]
        for name in (r for r in RATIOS if r in mine[0]):
            ratios = [p[name] for p in mine]
            ax.errorbar([str(p["workers"]) for p in mine], [r["median"] for r in ratios], marker="o", capsize=3,
                        yerr=[[r["median"] - r["min"] for r in ratios], [r["max"] - r["median"] for r in ratios]],
                        label=f"{workload}: {RATIOS[name]}")
    ax.axhline(1.0, color="k", linestyle=":")
    ax.set_xlabel("workers")
    ax.set_ylabel("samples/s ratio")
    ax.legend()
    report.save(fig, plt, path)


if __name__ == "__main__":
    sys.exit(main())
