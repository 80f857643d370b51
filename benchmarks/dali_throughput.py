"""Samples/s of the prep backends on the same images in one run: is DALI's feed ever the bottleneck?

    python -m benchmarks.dali_throughput [--images 1500] [--epochs 3] [--workers 2] [--systems ...] [--reps 1]
        [--out DIR]

Systems, each over the same JPEG folder with a cache of the whole dataset (epoch 1 fills it, later
epochs measure prep alone):

- ``feed``: coordl's fetch path into DALI's ``external_source``, with no decode (the feed's ceiling);
- ``coordl-dali-cpu``: the ``image_classification`` preset decoding on the CPU;
- ``coordl-dali-gpu``: the same preset decoding on the GPU (only where torch sees one);
- ``coordl-torch``: the torch backend with the equivalent torchvision transforms
  (RandomResizedCrop(224), RandomHorizontalFlip, ToTensor, Normalize) in worker processes.

With ``--reps N`` every system runs N times, the systems interleaved in each round; a system's result is
the median of its runs' steady samples/s, with the spread. ``results.json`` says the machine and the commit.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch
import torchvision
from torchvision import transforms as T

import coordl
from benchmarks import report
from benchmarks.metrics import spread
from benchmarks.storage_env import tree_bytes
from coordl.synthetic import make_image_folder

BATCH_SIZE = 64
SYSTEMS = ("feed", "coordl-dali-cpu", "coordl-dali-gpu", "coordl-torch")


def _feed_only(encoded, target, *, device, train):
    return encoded.shape(), target


def _loader(system: str, root: str, workers: int) -> coordl.DataLoader:
    common = dict(batch_size=BATCH_SIZE, shuffle=True, num_workers=workers, cache_bytes=2 * tree_bytes(root),
                  cache_name=f"throughput-{os.getpid()}-{system}")
    if system == "coordl-torch":
        tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                        T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
        return coordl.DataLoader(torchvision.datasets.ImageFolder(root, transform=tf), **common,
                                 persistent_workers=workers > 0)
    pipeline = _feed_only if system == "feed" else "image_classification"
    device = "gpu" if system.endswith("gpu") else "cpu"
    return coordl.DataLoader(torchvision.datasets.ImageFolder(root), **common, backend="dali",
                             dali_pipeline=pipeline, dali_device=device)


def measure(system: str, root: str, workers: int, epochs: int) -> dict:
    rows = []
    with _loader(system, root, workers) as loader:
        for epoch in range(1, epochs + 1):
            started, samples = time.perf_counter(), 0
            for batch in loader:
                samples += len(batch[-1])
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - started
            rows.append({"epoch": epoch, "samples": samples, "time_s": round(elapsed, 3),
                         "samples_per_s": round(samples / elapsed, 1), "hits": loader.stats().epochs[-1].hits})
    steady = rows[1:] or rows
    return {"system": system, "epochs": rows,
            "steady_samples_per_s": round(sum(r["samples"] for r in steady) / sum(r["time_s"] for r in steady), 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=1500)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS,
                        help="which to run (default: all; coordl-dali-gpu only where torch sees a GPU)")
    parser.add_argument("--reps", type=int, default=1, help="runs of each system, interleaved (default 1)")
    parser.add_argument("--out", default="results/dali_throughput")
    args = parser.parse_args(argv)
    systems = [s for s in args.systems or SYSTEMS if s != "coordl-dali-gpu" or torch.cuda.is_available()]
    workdir = tempfile.mkdtemp(prefix="coordl-throughput-")
    try:
        root = os.path.join(workdir, "train")
        print(f"generating {args.images} JPEGs ...", flush=True)
        make_image_folder(root, args.images)
        runs = []
        for rep in range(args.reps):
            for system in systems:
                runs.append({**measure(system, root, args.workers, args.epochs), "rep": rep})
                print(f"[{rep + 1}/{args.reps}] {system:<16} {runs[-1]['steady_samples_per_s']:>9.1f} samples/s "
                      "(steady epochs)", flush=True)
        summary = {system: spread([r["steady_samples_per_s"] for r in runs if r["system"] == system])
                   for system in systems}
        for system, s in summary.items():
            print(f"{system:<16} {report.spread_text(s, '.1f')} samples/s")
        result = {"images": args.images, "workers": args.workers, "batch_size": BATCH_SIZE, "epochs": args.epochs,
                  "reps": args.reps, "cpus": os.cpu_count(),
                  "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                  "machine": report.machine(), "provenance": report.provenance(), "summary": summary, "runs": runs}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(result, f, indent=2)
        return 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
