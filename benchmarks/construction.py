"""What building a loader costs at ImageNet scale: torch's ImageFolder against coordl.DataLoader.

    python -m benchmarks.construction --files 1281167 --classes 1000 --out results/construction
    python -m benchmarks.construction --files 20000 --classes 100 --trials 3 --out /tmp/c   # quick

Generates ``--files`` one-byte ``.jpg`` files in ``--classes`` class folders under ``--workdir``
(once: a later run with the same counts reuses them; ``--clean`` removes them at the end). With the
file system's dentry and inode caches warm (one untimed ImageFolder scan first), it times, in
interleaved trials, each in a fresh Python process (imports done before the clock starts):

  * ``imagefolder``: ``torchvision.datasets.ImageFolder(root)`` alone;
  * ``coordl-new-cache``: ``coordl.DataLoader(ImageFolder(root), batch_size=256, shuffle=True)``, the
    ImageFolder included, creating the cache (a fresh ``$COORDL_SHM_DIR`` per trial, removed after);
  * ``coordl-attach``: the same while another process holds the cache already (a second rank or job).

It then measures the fetch path's cost per cached sample (``hit_us``): ``CachedDataset.fetch`` over
``--hit-files`` samples already in the cache, best of 5 passes, in one process.

Writes ``results.json`` (every trial, medians, spread, git SHA, machine, load averages) to ``--out``
and prints a table. Shared memory used is under /dev/shm and removed before the run ends.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.report import machine, provenance

MODES = ("imagefolder", "coordl-new-cache", "coordl-attach")
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def generate(root: str, files: int, classes: int) -> float:
    """Write ``files`` one-byte images in ``classes`` folders at ``root`` unless it exists; seconds taken."""
    if os.path.isdir(root):
        return 0.0
    start, partial = time.perf_counter(), root + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    per_class, extra = divmod(files, classes)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for c in range(classes):
        folder = os.path.join(partial, f"class{c:04d}")
        os.makedirs(folder)
        for i in range(per_class + (c < extra)):
            fd = os.open(os.path.join(folder, f"img{i:05d}.jpg"), flags, 0o644)
            os.write(fd, b"x")
            os.close(fd)
    os.rename(partial, root)
    return time.perf_counter() - start


def _child(mode: str, root: str, batch_size: int) -> None:
    """One timed construction in this fresh process; prints its seconds as JSON. ``hold``: build the
    loader, say so, and keep its cache until stdin closes."""
    import torchvision.datasets
    import coordl
    start = time.perf_counter()
    dataset = torchvision.datasets.ImageFolder(root)
    built = time.perf_counter()
    loader = None if mode == "imagefolder" else coordl.DataLoader(dataset, batch_size=batch_size, shuffle=True)
    end = time.perf_counter()
    print(json.dumps({"seconds": end - start, "dataset_s": built - start, "loader_s": end - built,
                      "samples": len(dataset)}), flush=True)
    if mode == "hold":
        sys.stdin.read()
    if loader is not None:
        loader.close()


def _run_child(mode: str, root: str, batch_size: int, env: dict, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "benchmarks.construction", "--child", mode, "--data", root,
                             "--batch-size", str(batch_size)], cwd=_REPO, env=env, text=True,
                            stdout=subprocess.PIPE, **popen)


def _result(child: subprocess.Popen) -> dict:
    line = child.stdout.readline()
    if not line:
        child.wait()
        raise RuntimeError(f"the timed process failed (exit {child.returncode})")
    return json.loads(line)


def trial(mode: str, root: str, batch_size: int) -> dict:
    """One trial of ``mode`` in fresh processes, with a fresh shm directory for coordl's modes."""
    shm = tempfile.mkdtemp(prefix="coordl-bench-construction-", dir="/dev/shm")
    env = {**os.environ, "COORDL_SHM_DIR": shm,
           "PYTHONPATH": os.pathsep.join(filter(None, [_REPO, os.environ.get("PYTHONPATH")]))}
    holder = None
    try:
        if mode == "coordl-attach":
            holder = _run_child("hold", root, batch_size, env, stdin=subprocess.PIPE)
            _result(holder)
        load = os.getloadavg()[0]
        child = _run_child("coordl" if mode != "imagefolder" else mode, root, batch_size, env)
        result = _result(child)
        if child.wait() != 0:
            raise RuntimeError(f"{mode}: the timed process failed (exit {child.returncode})")
        return {**result, "mode": mode, "load_1m": load}
    finally:
        if holder is not None:
            holder.stdin.close()
            holder.wait()
        shutil.rmtree(shm, ignore_errors=True)


def hit_cost(root: str, files: int) -> dict:
    """Microseconds per cached sample through ``CachedDataset.fetch``: best of 5 passes over ``files``
    samples, all hits (a fresh shm directory, removed after)."""
    shm = tempfile.mkdtemp(prefix="coordl-bench-construction-", dir="/dev/shm")
    code = f"""
import json, time, torch, torchvision.datasets, coordl
ds = torch.utils.data.Subset(torchvision.datasets.ImageFolder({root!r}), range({files}))
with coordl.DataLoader(ds, batch_size=256) as loader:
    cached = loader.dataset
    row = cached.counters.row()
    for i in range({files}):
        cached.fetch(i, row)
    passes = []
    for _ in range(5):
        start = time.perf_counter()
        for i in range({files}):
            cached.fetch(i, row)
        passes.append(time.perf_counter() - start)
    print(json.dumps({{"hit_us": min(passes) / {files} * 1e6, "passes_s": passes, "stats": str(cached.cache.stats())}}))
"""
    env = {**os.environ, "COORDL_SHM_DIR": shm,
           "PYTHONPATH": os.pathsep.join(filter(None, [_REPO, os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=_REPO, env=env, capture_output=True, text=True,
                              check=True)
        return {"files": files, **json.loads(done.stdout)}
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def summarize(trials: list[dict]) -> dict:
    """Per mode: median, min, max and relative spread ((max - min) / median) of the seconds, and against
    the ImageFolder trials' median. For coordl's modes also what coordl.DataLoader adds in the same
    process, in seconds and as a fraction of that process's own ImageFolder construction (``overhead``:
    the figure that machine load, which moves both alike, changes least)."""
    summary = {}
    for mode in MODES:
        mine = [t for t in trials if t["mode"] == mode]
        seconds = [t["seconds"] for t in mine]
        median = statistics.median(seconds)
        summary[mode] = {"median_s": median, "min_s": min(seconds), "max_s": max(seconds),
                         "spread": (max(seconds) - min(seconds)) / median, "trials": len(seconds)}
        if mode != "imagefolder":
            overhead = [t["loader_s"] / t["dataset_s"] for t in mine]
            summary[mode].update(loader_median_s=statistics.median(t["loader_s"] for t in mine),
                                 overhead_median=statistics.median(overhead), overhead_min=min(overhead),
                                 overhead_max=max(overhead))
    base = summary["imagefolder"]["median_s"]
    for mode in MODES:
        summary[mode]["x_imagefolder"] = summary[mode]["median_s"] / base
    return summary


def table(result: dict) -> str:
    lines = [f"{result['files']} files in {result['classes']} classes, {result['trials_per_mode']} trials each; "
             f"git {result['git_sha'][:10] if result['git_sha'] else '?'}{' (dirty)' if result['git_dirty'] else ''}; "
             f"{result['machine']['summary']}", "",
             "| construction | median s | min s | max s | spread | x ImageFolder | coordl's part s | "
             "+ over its own ImageFolder, median [min–max] |", "|---|---|---|---|---|---|---|---|"]
    for mode, s in result["summary"].items():
        part = (f"{s['loader_median_s']:.3f} | {s['overhead_median']:+.1%} [{s['overhead_min']:+.1%}–"
                f"{s['overhead_max']:+.1%}]") if "overhead_median" in s else "– | –"
        lines.append(f"| {mode} | {s['median_s']:.2f} | {s['min_s']:.2f} | {s['max_s']:.2f} | {s['spread']:.0%} | "
                     f"{s['x_imagefolder']:.2f} | {part} |")
    if result.get("hit_cost"):
        lines += ["", f"cached fetch: {result['hit_cost']['hit_us']:.2f} µs per sample "
                      f"(best of 5 passes over {result['hit_cost']['files']} hits)"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=1281167)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--trials", type=int, default=3, help="trials per mode, interleaved (default: 3)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--hit-files", type=int, default=50000, help="samples of the fetch-path measurement "
                        "(0: skip it; default: 50000)")
    parser.add_argument("--workdir", default="/var/tmp", help="where the files are generated: a real disk, not "
                        "tmpfs (default: /var/tmp)")
    parser.add_argument("--clean", action="store_true", help="remove the generated files at the end")
    parser.add_argument("--out", default="results/construction")
    parser.add_argument("--child", choices=("imagefolder", "coordl", "hold"), help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args.child, args.data, args.batch_size)
    root = os.path.join(args.workdir, f"coordl_construction_{args.files}x{args.classes}")
    generated = generate(root, args.files, args.classes)
    if generated:
        print(f"generated {args.files} files under {root} in {generated:.0f} s", flush=True)
    try:
        _run_child("imagefolder", root, args.batch_size, os.environ).wait()  # warms the dentry and inode caches
        trials = []
        for number in range(args.trials):
            for mode in MODES:
                trials.append({**trial(mode, root, args.batch_size), "trial": number})
                print(f"trial {number} {mode}: {trials[-1]['seconds']:.2f} s", flush=True)
        result = {"files": args.files, "classes": args.classes, "trials_per_mode": args.trials,
                  "batch_size": args.batch_size, "data": root, "host": platform.node(), "machine": machine(),
                  **provenance(), "load_avg_end": os.getloadavg(), "summary": summarize(trials), "trials": trials,
                  "hit_cost": hit_cost(root, min(args.hit_files, args.files)) if args.hit_files else None}
    finally:
        if args.clean:
            shutil.rmtree(root, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(table(result))


if __name__ == "__main__":
    main()
