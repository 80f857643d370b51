"""How coordl scales with the dataset (10k → 1.28M files), and what that projects for an ImageNet epoch.

    python -m benchmarks.scale --sizes 10000 100000 1281167 --workdir /var/tmp --out results/scale
    python -m benchmarks.scale --sizes 2000 20000 --reps 1 --out /tmp/s      # quick

For each size, one-byte files in 1000 class folders (generated once under ``--workdir``, as
``benchmarks.construction`` does) are timed in two ways:

  * construction: ``ImageFolder(root)`` alone and ``coordl.DataLoader(ImageFolder(root), ...)``
    creating its cache, each in a fresh process (``benchmarks.construction``'s trials);
  * steady epochs: the files' raw bytes (no decode: the loader alone) through torch's DataLoader
    and through coordl.DataLoader with the whole dataset cached (an untimed first epoch fills it),
    ``--workers`` workers, batch ``--batch-size``, in interleaved trials.

Then the projection (:func:`project`), a model whose inputs are measured here: an epoch of
``N`` ImageNet-size samples with ``W`` workers on ``W`` cores, a MinIO cache holding a fraction
``x`` of the dataset and storage reading ``B`` bytes/s, takes

    max( N · (t_prep + t_loader) / W ,  (1 − x) · N · s / B )

where ``t_prep`` is the CPU time to decode and augment one ImageNet-like JPEG (measured on
generated ~110 KB JPEGs: RandomResizedCrop(224), flip, ToTensor), ``t_loader`` the loader's own CPU
time per sample (the steady epoch's seconds × busy cores / N at the largest size) and ``s`` the
mean file size of the generated JPEGs. ``W``, ``x`` and ``B`` describe the target machine
(``--project-workers``, ``--project-cache``, ``--project-mbps``); N is ImageNet's 1,281,167.

Writes ``results.json`` (every trial, medians with min–max, the projection's inputs and output, git
SHA, machine), ``results.md`` and (with matplotlib) ``scale.png`` to ``--out``.
"""

import argparse
import io
import os
import shutil
import sys
import tempfile
import time

IMAGENET_SAMPLES = 1_281_167
CLASSES = 1000
PREP_SAMPLES = 200


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, IMAGENET_SAMPLES])
    parser.add_argument("--workers", type=int, default=2, help="loader workers (default: 2)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs per trial (default: 2)")
    parser.add_argument("--reps", type=int, default=2, help="trials per size and system, interleaved (default: 2)")
    parser.add_argument("--workdir", default="/var/tmp", help="where the files are generated: a real disk")
    parser.add_argument("--clean", action="store_true", help="remove the generated files at the end")
    parser.add_argument("--project-workers", type=int, default=8)
    parser.add_argument("--project-cache", type=float, default=0.5, help="cache fraction x (default: 0.5)")
    parser.add_argument("--project-mbps", type=float, default=500.0, help="storage MB/s B (default: 500)")
    parser.add_argument("--out", default="results/scale")
    args = parser.parse_args(argv)
    if min(args.sizes) < CLASSES or args.workers < 0 or args.reps < 1 or args.epochs < 1:
        parser.error(f"--sizes must be >= {CLASSES}, --workers >= 0, --reps and --epochs >= 1")
    return args


def loader(system: str, root: str, workers: int, batch_size: int):
    """``system``'s loader over the raw bytes of the files under ``root`` (``benchmarks.hotpath``'s bytes
    workload, coordl's cache sized "auto")."""
    import torch

    from benchmarks.hotpath import bytes_collate, dataset
    import coordl

    options = dict(batch_size=batch_size, shuffle=True, num_workers=workers, persistent_workers=workers > 0,
                   collate_fn=bytes_collate)
    if system == "torch":
        return torch.utils.data.DataLoader(dataset(root, "bytes"), **options)
    return coordl.DataLoader(dataset(root, "bytes"), cache_bytes="auto", **options)


def steady_epoch_s(dl, epochs: int) -> float:
    """One untimed epoch (coordl fills its cache; workers start), then the mean of ``epochs`` timed ones."""
    from benchmarks.hotpath import samples_per_s

    return len(dl.dataset) / samples_per_s(dl, epochs)


def prep_cost_s(workdir: str) -> dict:
    """CPU seconds per sample to decode and augment an ImageNet-like JPEG, in this process (one core),
    and the generated JPEGs' mean size."""
    import torch
    from PIL import Image
    from torchvision import transforms as T

    from coordl._demo.synthetic import make_image_folder

    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="coordl-scale-prep-", dir=workdir)
    try:
        make_image_folder(root, PREP_SAMPLES, mean_side_px=490, seed=0)
        paths = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
        raw = [open(p, "rb").read() for p in paths]
        transform = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor()])
        passes = []
        for _ in range(3):
            started = time.process_time()
            for data in raw:
                transform(Image.open(io.BytesIO(data)).convert("RGB"))
            passes.append((time.process_time() - started) / len(raw))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"t_prep_s": min(passes), "passes_s": passes, "mean_file_bytes": sum(map(len, raw)) / len(raw),
            "samples": len(raw)}


def project(n: int, t_prep_s: float, t_loader_s: float, file_bytes: float, workers: int, cache: float,
            mbps: float) -> dict:
    """The projected epoch (see the module docstring): its seconds, the prep and storage terms, which one bounds it."""
    prep_s = n * (t_prep_s + t_loader_s) / workers
    storage_s = (1 - cache) * n * file_bytes / (mbps * 1e6)
    return {"epoch_s": max(prep_s, storage_s), "prep_s": prep_s, "storage_s": storage_s,
            "bound": "prep" if prep_s >= storage_s else "storage", "loader_share": t_loader_s / (t_prep_s + t_loader_s)}


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("COORDL_LOG_LEVEL", "WARNING")
    from benchmarks import report
    from benchmarks.construction import generate, trial
    from benchmarks.metrics import spread
    from harness.storage_env import Cleanup
    from coordl._core.settings import SHM_DIR_ENV

    with Cleanup():  # a SIGTERM runs the same clean-up as Ctrl-C: the shm folder and its caches go
        shm = tempfile.mkdtemp(prefix="coordl-scale-", dir=os.environ.get(SHM_DIR_ENV, "/dev/shm"))
        os.environ[SHM_DIR_ENV] = shm  # this run's caches, removed at the end
        roots, trials, construction = {}, [], []
        try:
            for size in args.sizes:
                roots[size] = os.path.join(args.workdir, f"coordl_construction_{size}x{CLASSES}")
                print(f"{size} files in {roots[size]}: generated in {generate(roots[size], size, CLASSES):.0f} s", flush=True)
            for rep in range(args.reps):
                for size in args.sizes:
                    for mode in (("imagefolder", "coordl-new-cache") if rep % 2 == 0 else ("coordl-new-cache", "imagefolder")):
                        t = trial(mode, roots[size], args.batch_size)
                        construction.append({"rep": rep, "size": size, "mode": mode, "seconds": t["seconds"]})
                    for system in (("torch", "coordl") if (rep + size) % 2 == 0 else ("coordl", "torch")):
                        dl = loader(system, roots[size], args.workers, args.batch_size)
                        seconds = steady_epoch_s(dl, args.epochs)
                        if hasattr(dl, "close"):
                            dl.close()
                        del dl
                        trials.append({"rep": rep, "size": size, "system": system, "epoch_s": seconds})
                        print(f"trial {rep + 1}/{args.reps} {size:>8} files {system:<6} steady epoch {seconds:7.2f} s "
                              f"({seconds / size * 1e6:.1f} µs per sample)", flush=True)
            prep = prep_cost_s(args.workdir)
        finally:
            shutil.rmtree(shm, ignore_errors=True)
            if args.clean:
                for root in roots.values():
                    shutil.rmtree(root, ignore_errors=True)
    points = []
    for size in args.sizes:
        point = {"size": size}
        for system in ("torch", "coordl"):
            point[f"{system}_epoch_s"] = spread([t["epoch_s"] for t in trials
                                                         if (t["size"], t["system"]) == (size, system)])
        for mode in ("imagefolder", "coordl-new-cache"):
            point[f"{mode}_s"] = spread([c["seconds"] for c in construction
                                                 if (c["size"], c["mode"]) == (size, mode)])
        ratios = [a["epoch_s"] / b["epoch_s"] for a in trials for b in trials
                  if (a["size"], a["system"], b["size"], b["system"]) == (size, "coordl", size, "torch")
                  and a["rep"] == b["rep"]]
        point["coordl_over_torch_time"] = spread(ratios)
        points.append(point)
    largest = points[-1]
    busy_cores = min(max(args.workers, 1), os.cpu_count() or 1)
    t_loader = largest["coordl_epoch_s"]["median"] * busy_cores / largest["size"]
    inputs = {"n": IMAGENET_SAMPLES, "t_prep_s": prep["t_prep_s"], "t_loader_s": t_loader,
              "file_bytes": prep["mean_file_bytes"], "workers": args.project_workers, "cache": args.project_cache,
              "mbps": args.project_mbps}
    projection = {"inputs": inputs, "output": project(**inputs), "prep_measurement": prep,
                  "t_loader_from": f"coordl's steady epoch at {largest['size']} files × {busy_cores} busy cores"}
    result = {"points": points, "trials": trials, "construction": construction, "projection": projection,
              "setup": {"machine": report.machine(), "provenance": report.provenance(), "config": vars(args),
                        "load_average_at_end": os.getloadavg()}}
    text = markdown(result)
    report.write_json_and_markdown(args.out, result, text)
    plot(points, os.path.join(args.out, "scale.png"))
    print("\n" + text)
    return 0


def markdown(result: dict) -> str:
    from benchmarks import report

    lines = ["| files | ImageFolder s | coordl construction s | torch steady epoch s | coordl steady epoch s | "
             "coordl µs / sample | coordl / torch epoch time |", "|---|---|---|---|---|---|---|"]
    for p in result["points"]:
        lines.append(f"| {p['size']} | {report.spread_text(p['imagefolder_s'])} | "
                     f"{report.spread_text(p['coordl-new-cache_s'])} | {report.spread_text(p['torch_epoch_s'])} | "
                     f"{report.spread_text(p['coordl_epoch_s'])} | {p['coordl_epoch_s']['median'] / p['size'] * 1e6:.1f} | "
                     f"{report.spread_text(p['coordl_over_torch_time'])} |")
    i, o = result["projection"]["inputs"], result["projection"]["output"]
    lines += ["", f"Projected ImageNet epoch ({i['n']} samples, {i['workers']} workers on as many cores, cache "
              f"{i['cache']:.0%}, storage {i['mbps']:g} MB/s): {o['epoch_s']:.0f} s, {o['bound']}-bound "
              f"(prep {o['prep_s']:.0f} s, storage {o['storage_s']:.0f} s); inputs measured here: t_prep "
              f"{i['t_prep_s'] * 1e3:.2f} ms, t_loader {i['t_loader_s'] * 1e6:.1f} µs "
              f"({o['loader_share']:.1%} of a sample's CPU), mean file {i['file_bytes'] / 1e3:.0f} kB."]
    return "\n".join(lines) + "\n"


def plot(points: list[dict], path: str) -> None:
    from benchmarks import report

    drawn = report.axes()
    if drawn is None:
        return
    plt, fig, ax = drawn
    sizes = [p["size"] for p in points]
    for system in ("torch", "coordl"):
        ax.plot(sizes, [p[f"{system}_epoch_s"]["median"] / p["size"] * 1e6 for p in points], marker="o", label=system)
    ax.set_xscale("log")
    ax.set_xlabel("files")
    ax.set_ylabel("steady epoch, µs per sample")
    ax.set_ylim(bottom=0)
    ax.legend()
    report.save(fig, plt, path)


if __name__ == "__main__":
    sys.exit(main())
