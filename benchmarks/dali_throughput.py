"""Samples/s of the prep backends on the same images in one run: is DALI's feed ever the bottleneck?

    python -m benchmarks.dali_throughput [--images 1500] [--epochs 3] [--workers 2] [--systems ...] [--reps 1]
        [--batch-size 64] [--step-ms BUSY WAIT] [--out DIR]

Systems, each over the same JPEG folder with a cache of the whole dataset (epoch 1 fills it, later
epochs measure prep alone):

- ``feed``: coordl's fetch path into DALI's ``external_source``, with no decode (the feed's ceiling), the
  fetched bytes read in place as the presets have DALI read them;
- ``dali-feed``: plain DALI's ``fn.readers.file`` into the same pipeline (the files in the page cache),
  with ``--workers`` DALI threads: the feed DALI's own reader gives;
- ``coordl-dali-cpu``: the ``image_classification`` preset decoding on the CPU;
- ``coordl-dali-gpu``: the same preset decoding on the GPU (only where torch sees one);
- ``coordl-torch``: the torch backend with the equivalent torchvision transforms
  (RandomResizedCrop(224), RandomHorizontalFlip, ToTensor, Normalize) in worker processes.

``--step-ms BUSY WAIT`` puts a stand-in training step after each batch: BUSY ms of Python on the loop's
thread (holding the interpreter, as a step's kernel launches do), then WAIT ms asleep (the loop waiting for
the GPU, the interpreter free). A loader is then judged by what it leaves of the step's own rate (``of_step``)
and by the share of the time the loop waited for a batch (``loop_waiting``): the feed's Python in the
training process, shared with the step's, shows without a GPU.

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

from benchmarks import report
from benchmarks.metrics import spread
import coordl
from coordl._dali import presets as dali_presets
from coordl._demo.synthetic import make_image_folder
from harness.storage_env import tree_bytes

BATCH_SIZE = 64
SYSTEMS = ("feed", "dali-feed", "coordl-dali-cpu", "coordl-dali-gpu", "coordl-torch")
FEED_ONLY = "benchmarks.feed-only"


def _feed_only(encoded, target, *, device, train):
    return encoded.shape(), target


# named as a preset, so that DALI reads the fed bytes in place as it does for the presets (its outputs are new
# arrays, or the fed target, which coordl copies out)
dali_presets.PRESETS.setdefault(FEED_ONLY, _feed_only)


def _loader(system: str, root: str, workers: int, batch_size: int):
    if system == "dali-feed":
        from harness.dali_baseline import file_reader_loader
        return file_reader_loader(root, order="shuffle", batch_size=batch_size, num_threads=workers,
                                  pipeline=_feed_only)
    common = dict(batch_size=batch_size, shuffle=True, num_workers=workers, cache_bytes=2 * tree_bytes(root),
                  cache_name=f"throughput-{os.getpid()}-{system}")
    if system == "coordl-torch":
        tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                        T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
        return coordl.DataLoader(torchvision.datasets.ImageFolder(root, transform=tf), **common,
                                 persistent_workers=workers > 0)
    pipeline = FEED_ONLY if system == "feed" else "image_classification"
    device = "gpu" if system.endswith("gpu") else "cpu"
    return coordl.DataLoader(torchvision.datasets.ImageFolder(root), **common, backend="dali",
                             dali_pipeline=pipeline, dali_device=device)


def stand_in_step(busy_ms: float, wait_ms: float) -> None:
    """A training step's share of the loop's thread: ``busy_ms`` of Python, then ``wait_ms`` asleep."""
    end = time.perf_counter() + busy_ms / 1e3
    while time.perf_counter() < end:
        pass
    time.sleep(wait_ms / 1e3)


def measure(system: str, root: str, workers: int, epochs: int, batch_size: int = BATCH_SIZE,
            step_ms: tuple[float, float] | None = None) -> dict:
    rows = []
    loader = _loader(system, root, workers, batch_size)
    try:
        for epoch in range(1, epochs + 1):
            started, samples, waited = time.perf_counter(), 0, 0.0
            batches = iter(loader)
            while True:
                asked = time.perf_counter()
                batch = next(batches, None)
                waited += time.perf_counter() - asked
                if batch is None:
                    break
                samples += len(batch[-1])
                if step_ms is not None:
                    stand_in_step(*step_ms)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - started
            stats = getattr(loader, "stats", None)
            rows.append({"epoch": epoch, "samples": samples, "time_s": round(elapsed, 3),
                         "samples_per_s": round(samples / elapsed, 1), "waited_s": round(waited, 4),
                         "hits": stats().epochs[-1].hits if stats is not None else None})
    finally:
        if isinstance(loader, coordl.DataLoader):
            loader.close()
    steady = rows[1:] or rows
    rate = sum(r["samples"] for r in steady) / sum(r["time_s"] for r in steady)
    result = {"system": system, "epochs": rows, "steady_samples_per_s": round(rate, 1),
              "loop_waiting": round(sum(r["waited_s"] for r in steady) / sum(r["time_s"] for r in steady), 4)}
    if step_ms is not None:
        result["of_step"] = round(rate / (batch_size / (sum(step_ms) / 1e3)), 4)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=1500)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS,
                        help="which to run (default: all; coordl-dali-gpu only where torch sees a GPU)")
    parser.add_argument("--reps", type=int, default=1, help="runs of each system, interleaved (default 1)")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    parser.add_argument("--step-ms", type=float, nargs=2, metavar=("BUSY", "WAIT"),
                        help="a stand-in training step after each batch: BUSY ms of Python, then WAIT ms asleep")
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
                runs.append({**measure(system, root, args.workers, args.epochs, args.batch_size, args.step_ms),
                             "rep": rep})
                run = runs[-1]
                print(f"[{rep + 1}/{args.reps}] {system:<16} {run['steady_samples_per_s']:>9.1f} samples/s "
                      f"(steady epochs), loop waiting {run['loop_waiting']:.1%}"
                      + (f", {run['of_step']:.3f} of the step's rate" if args.step_ms else ""), flush=True)
        fields = ("steady_samples_per_s", "loop_waiting") + (("of_step",) if args.step_ms else ())
        summary = {system: {field: spread([r[field] for r in runs if r["system"] == system]) for field in fields}
                   for system in systems}
        for system, s in summary.items():
            print(f"{system:<16} {report.spread_text(s['steady_samples_per_s'], '.1f')} samples/s, loop waiting "
                  f"{report.spread_text(s['loop_waiting'], '.3f')}"
                  + (f", of the step's rate {report.spread_text(s['of_step'], '.3f')}" if args.step_ms else ""))
        result = {"images": args.images, "workers": args.workers, "batch_size": args.batch_size,
                  "epochs": args.epochs, "step_ms": args.step_ms, "reps": args.reps, "cpus": os.cpu_count(),
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
