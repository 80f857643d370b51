"""Training-time data stalls on a GPU: a ResNet-18 step fed by torch's DataLoader, coordl and DALI.

    python -m benchmarks.gpu_stall [--images 4096] [--epochs 3] [--trials 3] [--workers N] [--out DIR]

Over one folder of ImageNet-sized JPEGs that fits both the cache and the page cache (the case where
a loader's prep, not storage, decides the stall), each trial runs, interleaved:

- ``synthetic``: the step alone on a batch already on the GPU: ``G``, the most the step can ingest;
- ``torch``: torch's DataLoader (ImageFolder; RandomResizedCrop(224), flip, ToTensor, Normalize in
  ``--workers`` processes; pinned memory), each batch copied to the GPU;
- ``coordl``: ``coordl.DataLoader`` with the same arguments and a cache of the whole dataset;
- ``coordl-dali``: coordl's DALI backend, the ``image_classification`` preset decoding on the GPU
  ("mixed") from the cache, ``--workers`` threads;
- ``dali``: plain DALI (``fn.readers.file``, whole-dataset shuffle), the same preset on the GPU.

Each system runs ``--epochs`` epochs with the step (``step="resnet18"``, bf16 autocast, channels-last,
SGD) and the DALI systems also without it (``step="none"``: decoding from the cache against plain
DALI's reader). Epochs after the first count (the first fills the cache and warms cuDNN and DALI), timed
as one window: the GPU's queue is waited for at its edges, not between its epochs, as in training
(``--drain-each-epoch``: at every epoch's edges, so a pipeline that fills at each epoch's start has
its fill exposed rather than overlapped with the steps queued before). ``--hw-decoder-load X`` binds the DALI
systems' preset to give that share of the JPEGs to the GPU's hardware JPEG decoder (DALI's default: 0.65).
A system's stall is the paper's differential one, ``1 - samples/s / G``, beside the time the loop
itself waited for batches (``wait_s``, ``iter()`` included) and of that, for each epoch's first batch
(``first_wait_s``: the epoch's edge, where a pipeline that restarts each epoch fills). ``results.json``
(every epoch of every trial), ``setup.json`` (GPU, driver, versions, git SHA, settings) and
``results.md`` (medians with min-max; the epochs' edges, :func:`epoch_edge_s`, with their quartiles) go to
``--out``; ``python -m benchmarks.gpu_stall edges DIR [DIR ...]`` gives the edges again for earlier runs.

With ``--analyze``, ``coordl analyze`` also runs on the ``coordl`` and ``coordl-dali`` jobs
(``python -m benchmarks.gpu_stall job ...``, the same loop) and its prediction is set beside the
throughput the trials measured.
"""

import argparse
import contextlib
import functools
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torchvision
from torchvision import transforms as T

from benchmarks import report
import coordl
from coordl._demo.synthetic import make_image_folder
from harness.storage_env import tree_bytes

SYSTEMS = ("synthetic", "torch", "coordl", "coordl-dali", "dali")
DALI_SYSTEMS = ("coordl-dali", "dali")
NUM_CLASSES = 10


def _transform():
    return T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                      T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])


def build_loader(system: str, root: str, *, workers: int, batch_size: int, cache_name: str, device: str,
                 hw_decoder_load: float | None = None):
    """The loader of ``system`` over the ImageFolder ``root``, for a step on ``device`` ("cuda" or "cpu"); the
    DALI systems' preset with ``hw_decoder_load`` where given (else DALI's default)."""
    dali_device = "gpu" if device == "cuda" else "cpu"
    preset = "image_classification"
    if hw_decoder_load is not None:
        from coordl._dali.presets import image_classification
        preset = functools.partial(image_classification, hw_decoder_load=hw_decoder_load)
    if system == "dali":
        from harness.dali_baseline import file_reader_loader
        return file_reader_loader(root, order="shuffle", batch_size=batch_size, num_threads=workers,
                                  device=dali_device, pipeline=preset)
    common = dict(batch_size=batch_size, shuffle=True, num_workers=workers, pin_memory=device == "cuda",
                  drop_last=True, persistent_workers=workers > 0)
    cache = dict(cache_bytes=tree_bytes(root) + 2**24, cache_name=cache_name)  # the whole dataset
    if system == "torch":
        return torch.utils.data.DataLoader(torchvision.datasets.ImageFolder(root, transform=_transform()), **common)
    if system == "coordl":
        return coordl.DataLoader(torchvision.datasets.ImageFolder(root, transform=_transform()), **common, **cache)
    if system == "coordl-dali":
        return coordl.DataLoader(torchvision.datasets.ImageFolder(root), **common, **cache, backend="dali",
                                 dali_pipeline=preset, dali_device=dali_device)
    raise ValueError(f"unknown system {system!r}; one of {SYSTEMS}")


class Step:
    """One training step of ResNet-18 on a batch (channels-last, SGD; bf16 autocast on a GPU), or none."""

    def __init__(self, kind: str, device: str):
        self.kind, self.device = kind, device
        if kind == "none":
            return
        torch.backends.cudnn.benchmark = True
        self.model = torchvision.models.resnet18(num_classes=NUM_CLASSES).to(device, memory_format=torch.channels_last)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.loss = torch.nn.CrossEntropyLoss()

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        if self.kind == "none":
            return
        images = images.to(self.device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        labels = labels.to(self.device, non_blocking=True).view(-1).long()
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.device == "cuda"):
            loss = self.loss(self.model(images), labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()


def _drain(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_epoch(batches, step: Step, drain_before: bool = True, drain_after: bool = True) -> dict:
    """One pass: samples, wall time (the GPU's queue drained at the ends asked for), the loop's waits, and of
    them the wait for the pass's first batch (``iter()`` included: the epoch's edge)."""
    if drain_before:
        _drain(step.device)
    started, samples, wait_s, first_wait_s = time.perf_counter(), 0, 0.0, None
    asked = started  # the first wait counts from before iter()
    iterator = iter(batches)
    while True:
        try:
            images, labels = next(iterator)[:2]
        except StopIteration:
            break
        waited = time.perf_counter() - asked
        if first_wait_s is None:
            first_wait_s = waited
        wait_s += waited
        step(images, labels)
        samples += len(labels)
        asked = time.perf_counter()
    if drain_after:
        _drain(step.device)
    return {"samples": samples, "time_s": time.perf_counter() - started, "wait_s": wait_s,
            "first_wait_s": first_wait_s or 0.0}


def synthetic_batches(batch_size: int, batches: int, device: str):
    """``batches`` batches of one random batch already on ``device``."""
    images = torch.randn(batch_size, 3, 224, 224, device=device)
    labels = torch.randint(0, NUM_CLASSES, (batch_size,), device=device)
    return [(images, labels)] * batches


def measure(system: str, step: Step, root: str, args, trial: int) -> list[dict]:
    """``args.epochs`` epochs of ``system`` feeding ``step``: one row per epoch. The GPU's queue is waited for
    after the first epoch and after the last, so the steady epochs' times add up to their window, and between
    them only with ``--drain-each-epoch`` (a training loop does not wait there: the steps it queued run on
    while the next epoch starts)."""
    if system == "synthetic":
        loader = synthetic_batches(args.batch_size, args.images // args.batch_size, args.device)
    else:
        loader = build_loader(system, root, workers=args.workers, batch_size=args.batch_size,
                              cache_name=f"gpu-stall-{os.getpid()}-{system}-{step.kind}-{trial}",
                              device=args.device, hw_decoder_load=args.hw_decoder_load)
    rows = []
    with loader if hasattr(loader, "__enter__") else contextlib.nullcontext(loader) as batches:
        for epoch in range(1, args.epochs + 1):
            row = run_epoch(batches, step, drain_before=epoch <= 2 or args.drain_each_epoch,
                            drain_after=epoch in (1, args.epochs) or args.drain_each_epoch)
            rows.append({"system": system, "step": step.kind, "trial": trial, "epoch": epoch, **row,
                         "samples_per_s": row["samples"] / row["time_s"], **_planned_ahead(loader)})
    _release(loader)
    return rows


def _planned_ahead(loader) -> dict:
    """coordl-dali: how many epochs so far started on batches its pipeline ran on into, their plan drawn
    ahead (``ahead_taken``), and how many on another plan (``ahead_dropped``); else nothing."""
    feed = getattr(getattr(loader, "epoch_ledger", None), "feed", None)
    ahead = getattr(getattr(feed, "backend", None), "ahead", None)
    return {f"ahead_{k}": v for k, v in ahead.items()} if ahead is not None else {}


def _release(loader) -> None:
    """Stop a torch DataLoader's persistent workers before the next system runs (coordl's loaders are closed
    by their ``with``; DALI's pipeline goes with its loader)."""
    if isinstance(loader, torch.utils.data.DataLoader) and not isinstance(loader, coordl.DataLoader):
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None:
            iterator._shutdown_workers()


def _generate(job: tuple[str, int, int]) -> None:
    part_root, n, seed = job
    make_image_folder(part_root, n, n_classes=NUM_CLASSES, mean_side_px=400, seed=seed)


def make_dataset(root: str, images: int, processes: int) -> None:
    """``images`` JPEGs (mean side 400 px, about 75 KB) in ImageFolder layout, made in parallel parts."""
    parts = max(1, min(processes, images // NUM_CLASSES))
    jobs = [(f"{root}.part{k}", images // parts + (k < images % parts), k) for k in range(parts)]
    with multiprocessing.get_context("spawn").Pool(parts) as pool:
        pool.map(_generate, jobs)
    for part_root, _, seed in jobs:
        for cls in os.listdir(part_root):
            os.makedirs(os.path.join(root, cls), exist_ok=True)
            for name in os.listdir(os.path.join(part_root, cls)):
                os.rename(os.path.join(part_root, cls, name), os.path.join(root, cls, f"p{seed}_{name}"))
        shutil.rmtree(part_root)


def epoch_edge_s(row: dict, batch_size: int) -> float:
    """How much longer an epoch's loop waited for its first batch than for each of its other batches, on
    average (the epoch's edge; its batches counted from its samples: no loader here drops the last)."""
    batches = -(-row["samples"] // batch_size)
    rest = (row["wait_s"] - row["first_wait_s"]) / (batches - 1) if batches > 1 else 0.0
    return row["first_wait_s"] - rest


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    """Lower quartile, median and upper quartile (one value: itself thrice)."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return q1, q2, q3


def _steady_rates(trial_rows: list[dict]) -> tuple[float, float, float]:
    """One trial's steady epochs (after the first): samples/s, and the shares of their time the loop waited,
    and waited for their first batches."""
    steady = [r for r in trial_rows if r["epoch"] > 1]
    time_s = sum(r["time_s"] for r in steady)
    return sum(r["samples"] for r in steady) / time_s, sum(r["wait_s"] for r in steady) / time_s, \
        sum(r["first_wait_s"] for r in steady) / time_s


def dali_ratios(rows: list[dict]) -> dict[str, list[float]]:
    """Per step, coordl-dali's steady samples/s over plain DALI's in the same trial, trial by trial (the trials
    where both ran)."""
    def rate(system, step, trial):
        own = [r for r in rows if (r["system"], r["step"], r["trial"]) == (system, step, trial)]
        return _steady_rates(own)[0] if own else None

    out = {}
    for step in sorted({r["step"] for r in rows}):
        pairs = [(rate("coordl-dali", step, t), rate("dali", step, t)) for t in sorted({r["trial"] for r in rows})]
        if ratios := [ours / theirs for ours, theirs in pairs if ours and theirs]:
            out[step] = ratios
    return out


def summarize(rows: list[dict], batch_size: int) -> list[dict]:
    """Per system and step: the median over trials of the steady epochs' samples/s, with min and max,
    the stall against ``G``, the loop's waiting share, the share of its epochs' time it waited for
    their first batches (``edge_fraction``), and the first batch's extra wait (:func:`epoch_edge_s`) over
    all steady epochs of all trials, in ms: median and quartiles (``edge_ms``, ``edge_ms_q1``, ``edge_ms_q3``)."""
    keys = sorted({(r["system"], r["step"]) for r in rows}, key=lambda k: (k[1] != "resnet18", SYSTEMS.index(k[0])))
    out = []
    for system, step in keys:
        own = [r for r in rows if (r["system"], r["step"]) == (system, step)]
        trials = sorted({r["trial"] for r in own})
        rates = [_steady_rates([r for r in own if r["trial"] == t]) for t in trials]
        edge = _quartiles([1000 * epoch_edge_s(r, batch_size) for r in own if r["epoch"] > 1] or [0.0])
        out.append({"system": system, "step": step, "samples_per_s": statistics.median(r for r, _, _ in rates),
                    "min": min(r for r, _, _ in rates), "max": max(r for r, _, _ in rates),
                    "wait_fraction": statistics.median(w for _, w, _ in rates),
                    "edge_fraction": statistics.median(e for _, _, e in rates),
                    "edge_ms_q1": edge[0], "edge_ms": edge[1], "edge_ms_q3": edge[2], "trials": len(rates)})
    g = next((s["samples_per_s"] for s in out if s["system"] == "synthetic"), None)
    for s in out:
        s["stall"] = 1 - s["samples_per_s"] / g if g and s["step"] == "resnet18" else None
    return out


def analyze(system: str, root: str, args, out_dir: str) -> dict:
    """``coordl analyze`` on the ``system`` job: its prediction and the time the analysis took."""
    folder = os.path.join(out_dir, f"analyze-{system}")
    command = [sys.executable, "-m", "coordl.cli", "analyze", "--out", folder, "--iters", str(args.iters),
               "--warmup", str(args.warmup), "--timeout", "240", "--", sys.executable, "-m",
               "benchmarks.gpu_stall", "job", root, "--system", system, "--workers", str(args.workers),
               "--batch-size", str(args.batch_size), "--device", args.device]
    if args.hw_decoder_load is not None:
        command += ["--hw-decoder-load", str(args.hw_decoder_load)]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    print(done.stdout[-3000:], done.stderr[-2000:], sep="\n", flush=True)
    if done.returncode != 0:
        return {"system": system, "failed": f"coordl analyze exited {done.returncode}", "analysis_s": elapsed}
    with open(os.path.join(folder, "analysis.json")) as f:
        analysis = json.load(f)
    return {"system": system, "predicted_samples_per_s": analysis["predicted_samples_per_s"],
            "bottleneck": analysis["bottleneck"], "rates": analysis["rates"], "contention": analysis["contention"],
            "Q": analysis["phases"]["rates"].get("Q"), "analysis_s": elapsed}


def job(argv: list[str]) -> None:
    """The training script ``coordl analyze`` runs: ``system``'s loader feeding the step, epoch after epoch."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_stall job")
    parser.add_argument("root")
    parser.add_argument("--system", choices=SYSTEMS[1:], required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--hw-decoder-load", type=float)
    args = parser.parse_args(argv)
    step = Step("resnet18", args.device)
    loader = build_loader(args.system, args.root, workers=args.workers, batch_size=args.batch_size,
                          cache_name=f"gpu-stall-job-{os.getpid()}", device=args.device,
                          hw_decoder_load=args.hw_decoder_load)
    for _ in range(args.epochs):
        run_epoch(loader, step, drain_before=False, drain_after=False)  # the window waits at its own edges


def setup(args) -> dict:
    """The machine, the GPU, the versions, the commit (``--git-sha`` over the tree's), the settings."""
    cuda = args.device == "cuda"
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip() if cuda else None
    info = {**report.machine(), **report.provenance(), "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "nvidia_smi": smi,
            "load_avg": os.getloadavg(), "settings": vars(args)}
    info["git_sha"] = args.git_sha or info["git_sha"]
    return info


def _edge_text(s: dict) -> str:
    return f"{s['edge_ms']:+.1f} [{s['edge_ms_q1']:+.1f} to {s['edge_ms_q3']:+.1f}]"


def edges(argv: list[str]) -> None:
    """``python -m benchmarks.gpu_stall edges DIR [DIR ...]``: the runs' epoch edges again from their
    ``results.json`` and ``setup.json`` (runs written before the summary had them included) and coordl-dali
    over plain DALI trial by trial (:func:`dali_ratios`), then, for several runs, every steady epoch and every
    trial of them all pooled."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_stall edges", description=edges.__doc__)
    parser.add_argument("dirs", nargs="+", help="--out folders of earlier runs")
    folders, pooled, pooled_ratios = parser.parse_args(argv).dirs, {}, {}
    for folder in folders:
        try:
            with open(os.path.join(folder, "results.json")) as f:
                rows = json.load(f)["epochs"]
            with open(os.path.join(folder, "setup.json")) as f:
                batch_size = json.load(f)["settings"]["batch_size"]
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"{folder}: not a benchmarks.gpu_stall run ({type(e).__name__}: {e})") from e
        print(f"{folder}:")
        for s in summarize(rows, batch_size):
            own = [r for r in rows if (r["system"], r["step"]) == (s["system"], s["step"])]
            ends = {r["trial"]: r for r in own}.values()  # each trial's last epoch: its counts of plans ahead
            ahead = f"  on the plan drawn ahead {sum(r['ahead_taken'] for r in ends)}, on another " \
                f"{sum(r['ahead_dropped'] for r in ends)}" if "ahead_taken" in own[-1] else ""
            print(f"  {s['system']:12s} {s['step']:8s} {s['samples_per_s']:7.0f} [{s['min']:.0f}-{s['max']:.0f}] "
                  f"samples/s  edge {_edge_text(s)} ms{ahead}")
            pooled.setdefault((s["system"], s["step"]), []).extend(
                1000 * epoch_edge_s(r, batch_size) for r in own if r["epoch"] > 1)
        for step, ratios in dali_ratios(rows).items():
            print(f"  coordl-dali / dali {step:8s} {statistics.median(ratios):.3f} "
                  f"(trials: {', '.join(f'{x:.2f}' for x in ratios)})")
            pooled_ratios.setdefault(step, []).extend(ratios)
    if len(folders) > 1:
        print("pooled:")
        for (system, step), values in pooled.items():
            q1, q2, q3 = _quartiles(values)
            print(f"  {system:12s} {step:8s} edge {q2:+.1f} [{q1:+.1f} to {q3:+.1f}] ms over {len(values)} epochs")
        for step, ratios in pooled_ratios.items():
            print(f"  coordl-dali / dali {step:8s} {statistics.median(ratios):.3f} [{min(ratios):.2f}-{max(ratios):.2f}]"
                  f" over {len(ratios)} trials")


def write_markdown(path: str, summary: list[dict], analyses: list[dict], failed: dict, setup_info: dict) -> None:
    lines = [f"GPU: {setup_info['gpu']}; {setup_info['summary']}; torch {setup_info['torch']}, "
             f"DALI {setup_info['nvidia.dali']}; git {setup_info['git_sha']}", "",
             "| system | step | samples/s (median [min-max]) | stall vs G | loop waiting | of it, first batches "
             "| first batch's extra wait, ms (median [quartiles]) |", "|---|---|---|---|---|---|---|"]
    for s in summary:
        stall = f"{100 * s['stall']:.1f}%" if s["stall"] is not None else "-"
        lines.append(f"| {s['system']} | {s['step']} | {s['samples_per_s']:.0f} [{s['min']:.0f}-{s['max']:.0f}] "
                     f"| {stall} | {100 * s['wait_fraction']:.1f}% | {100 * s['edge_fraction']:.1f}% "
                     f"| {_edge_text(s)} |")
    lines += [f"\n{system} failed: {error}" for system, error in failed.items()]
    if analyses:
        lines += ["", "| analyzed job | predicted | measured | error | bottleneck | Q | contention | analysis s |",
                  "|---|---|---|---|---|---|---|---|"]
        for a in analyses:
            if "failed" in a:
                lines.append(f"| {a['system']} | {a['failed']} | | | | | | {a['analysis_s']:.0f} |")
            else:
                q = f"{a['Q']:.0f}" if a.get("Q") else "-"
                lines.append(f"| {a['system']} | {a['predicted_samples_per_s']:.0f} "
                             f"| {a['measured_samples_per_s']:.0f} "
                             f"| {100 * a['error']:+.1f}% | {a['bottleneck']} | {q} | {a['contention']:.3f} "
                             f"| {a['analysis_s']:.0f} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["job"]:
        job(argv[1:])
        return 0
    if argv[:1] == ["edges"]:
        edges(argv[1:])
        return 0
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_stall", description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, of " + ",".join(SYSTEMS))
    parser.add_argument("--analyze", nargs="?", const="coordl,coordl-dali", default="",
                        help="also run coordl analyze on these jobs (default coordl,coordl-dali)")
    parser.add_argument("--iters", type=int, default=60, help="coordl analyze --iters (default 60)")
    parser.add_argument("--warmup", type=int, default=10, help="coordl analyze --warmup (default 10)")
    parser.add_argument("--steps", default="resnet18,none",
                        help="comma-separated, of resnet18,none (none: the DALI systems' loaders alone)")
    parser.add_argument("--drain-each-epoch", action="store_true",
                        help="wait for the GPU's queue at every epoch's edges (each epoch timed on its own)")
    parser.add_argument("--hw-decoder-load", type=float,
                        help="the DALI systems' share of JPEGs for the GPU's hardware decoder (default DALI's, 0.65)")
    parser.add_argument("--out", default="results/gpu_stall")
    parser.add_argument("--git-sha", help="the commit measured, where the tree's .git is not it (a copy)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="where the step runs (cpu: a smoke test of the benchmark itself, no GPU figures)")
    args = parser.parse_args(argv)
    if args.hw_decoder_load is not None and not 0 <= args.hw_decoder_load <= 1:
        parser.error(f"--hw-decoder-load should be a share from 0 to 1, not {args.hw_decoder_load}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks.gpu_stall needs a CUDA GPU, and torch sees none (--device cpu for a smoke test)",
              file=sys.stderr)
        return 2
    systems = [s for s in args.systems.split(",") if s]
    if any(s in DALI_SYSTEMS for s in systems):
        from coordl._dali.pipeline import require_dali
        require_dali()
    os.makedirs(args.out, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="coordl-gpu-stall-")
    try:
        root = os.path.join(workdir, "train")
        started = time.perf_counter()
        make_dataset(root, args.images, os.cpu_count())
        print(f"{args.images} JPEGs in {time.perf_counter() - started:.0f} s", flush=True)
        kinds = [k for k in args.steps.split(",") if k]
        if not kinds or set(kinds) - {"resnet18", "none"}:
            raise SystemExit(f"--steps should be resnet18, none or both, but got --steps {args.steps}")
        steps = {kind: Step(kind, args.device) for kind in kinds}
        plan = [(s, kind) for kind in kinds for s in systems if kind == "resnet18" or s in DALI_SYSTEMS]
        rows, failed = [], {}
        for trial in range(args.trials):
            for system, kind in (plan if trial % 2 == 0 else plan[::-1]):
                if system in failed:
                    continue
                try:
                    trial_rows = measure(system, steps[kind], root, args, trial)
                except Exception as e:  # noqa: BLE001 - a system that fails is reported, the others still run
                    traceback.print_exc()
                    failed[system] = f"{type(e).__name__}: {e}"
                    continue
                rows += trial_rows
                ahead = f" (epochs on the plan drawn ahead: {trial_rows[-1]['ahead_taken']}, on another: " \
                    f"{trial_rows[-1]['ahead_dropped']})" if "ahead_taken" in trial_rows[-1] else ""
                print(f"trial {trial} {system:12s} step={kind:8s} " + " ".join(
                    f"{r['samples_per_s']:7.0f}" for r in trial_rows) + " samples/s" + ahead, flush=True)
        summary = summarize(rows, args.batch_size)
        analyses = []
        for system in [s for s in args.analyze.split(",") if s]:
            if system in systems and system not in failed:
                a = analyze(system, root, args, args.out)
                measured = next(s["samples_per_s"] for s in summary if (s["system"], s["step"]) == (system, "resnet18"))
                if "predicted_samples_per_s" in a:
                    a.update(measured_samples_per_s=measured, error=a["predicted_samples_per_s"] / measured - 1)
                analyses.append(a)
        info = setup(args)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"summary": summary, "analyses": analyses, "failed": failed, "epochs": rows}, f, indent=1)
        with open(os.path.join(args.out, "setup.json"), "w") as f:
            json.dump(info, f, indent=1)
        write_markdown(os.path.join(args.out, "results.md"), summary, analyses, failed, info)
        with open(os.path.join(args.out, "results.md")) as f:
            print(f.read())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
