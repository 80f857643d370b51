"""Rehearsal: what a class-incremental stream learns with coordl's buffer, against the same protocol in plain
torch, and what replaying costs the loader as the stream grows.

    python -m benchmarks.rehearsal --out DIR [--quick]

Accuracy: 5 experiences of 2 classes each of small synthetic JPEGs (on disk; each class a pattern of its
own under noise), an MLP trained on the CPU, 3 epochs per experience, batches of b = 32 new samples (+ r =
16 replayed), a buffer of K = 200, for 5 seeds. Each method runs twice, alike: through coordl
(``ExperienceStream``, ``Rehearsal``, 2 workers, the node's cache, the JPEGs decoded in the workers) and in
plain torch over the tensors decoded up front, batching them itself around the same buffer state machine
(``coordl.Rehearsal``'s buffer and draws, whose statistics the unit tests check): the same model, seeds and
data, the new samples in the same order (the same generator, drawn as a torch loader draws), the same
samples offered at the same moments (after each experience's first epoch, in the order drawn). So the two
differ in the data path, and in the augmentation's random draws. Methods:
fine-tuning (no rehearsal), reservoir, class-balanced, and joint training (every experience at once, 3
epochs). Reported: final accuracy over all 10 classes; then all again without the augmentation, where the
two runs see the same batches bit for bit.

Throughput: a stream of 20 experiences of 3,000 JPEGs (decode, random crop; 6 of 600 with ``--quick``), 3
epochs each, 2 workers, b = 32, no training step; samples/s (new + replayed) with r = b/2 and K = 1000 against
the same loader without rehearsal, the two side by side (each experience's epochs through one, then the
other). How samples/s moves over the stream: per experience, with rehearsal ÷ without (the machine's speed,
which on a VM moves by 10-20% over tens of seconds, cancels), the median of the repetitions; their largest gap
from their median and the trend of a line fitted through them; the same for each loader's own samples/s. Writes
``results.json``, ``setup.json`` and ``results.md`` into ``--out``.
"""

import argparse
import contextlib
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.data
import torchvision.transforms as T
from PIL import Image

import coordl
from benchmarks import metrics, report
from harness.storage_env import Cleanup, evict_files

CLASSES, EXPERIENCES, SIDE = 10, 5, 16
POLICIES = ("reservoir", "class_balanced")
MODES = {"quick": dict(seeds=2, train_per_class=120, reps=1, stream_experiences=6, stream_images=600),
         "full": dict(seeds=5, train_per_class=300, reps=3, stream_experiences=20, stream_images=3000)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rehearsal", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="where results.json, setup.json and results.md go")
    parser.add_argument("--quick", action="store_true", help="2 seeds, smaller data, 6 experiences: a minute")
    parser.add_argument("--seeds", type=int)
    parser.add_argument("--train-per-class", type=int)
    parser.add_argument("--test-per-class", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--per-batch", type=int, default=16)
    parser.add_argument("--capacity", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--reps", type=int, help="throughput repetitions")
    parser.add_argument("--stream-experiences", type=int, help="experiences of the throughput stream")
    parser.add_argument("--stream-images", type=int, help="JPEGs per experience of the throughput stream")
    parser.add_argument("--stream-epochs", type=int, default=3, help="epochs per experience of the throughput stream")
    parser.add_argument("--workdir", default="/var/tmp")
    args = parser.parse_args(argv)
    for key, value in MODES["quick" if args.quick else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


# -- the data --------------------------------------------------------------------------------------------------

def make_class_images(root: str, per_class: int, test_per_class: int, seed: int = 0) -> dict:
    """JPEGs of :data:`CLASSES` classes, each a random pattern of its own under heavy noise: ``train/e{k}/`` holds
    experience k's two classes, ``test/`` every class. Returns ``{"train": [[(path, label)] per experience],
    "test": [(path, label)]}``."""
    rng = np.random.default_rng(seed)
    patterns = rng.uniform(0, 255, (CLASSES, SIDE, SIDE, 3))
    out = {"train": [[] for _ in range(EXPERIENCES)], "test": []}

    def write(folder: str, label: int, i: int) -> str:
        os.makedirs(folder, exist_ok=True)
        pixels = np.clip(0.5 * patterns[label] + 0.5 * rng.uniform(0, 255, (SIDE, SIDE, 3)), 0, 255)
        path = os.path.join(folder, f"{label}_{i:05d}.jpg")
        Image.fromarray(pixels.astype(np.uint8)).save(path, quality=90)
        return path

    for label in range(CLASSES):
        experience = label // (CLASSES // EXPERIENCES)
        for i in range(per_class):
            out["train"][experience].append((write(os.path.join(root, "train", f"e{experience}"), label, i), label))
        for i in range(test_per_class):
            out["test"].append((write(os.path.join(root, "test"), label, i), label))
    return out


class Brighten:
    """A random brightness in [0.9, 1.1]: augmentation, drawn afresh every call."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * (0.9 + 0.2 * torch.rand(()))


def train_transform(augment: bool):
    return T.Compose([T.ToTensor(), Brighten()]) if augment else T.ToTensor()


def decoded(pairs) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.stack([T.ToTensor()(Image.open(path).convert("RGB")) for path, _ in pairs])
    return images, torch.tensor([label for _, label in pairs])


# -- the model -------------------------------------------------------------------------------------------------

def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * SIDE * SIDE, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, CLASSES))


def step(model, optimizer, x, y) -> None:
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


def accuracy(model, test: tuple[torch.Tensor, torch.Tensor]) -> float:
    with torch.no_grad():
        return float((model(test[0]).argmax(1) == test[1]).float().mean())


def optimizer_of(model):
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


# -- the protocol through coordl -------------------------------------------------------------------------------

def train_coordl(data: dict, method: str, seed: int, args, test, augment: bool) -> float:
    model = make_model(seed)
    optimizer = optimizer_of(model)
    transform = train_transform(augment)
    parts = [coordl.FileDataset([p for p, _ in pairs], [label for _, label in pairs], transform=transform)
             for pairs in data["train"]]
    generator = torch.Generator().manual_seed(seed)
    if method == "joint":
        loader = coordl.DataLoader(torch.utils.data.ConcatDataset(parts), batch_size=args.batch_size, shuffle=True,
                                   num_workers=args.workers, generator=generator)
        for _ in range(args.epochs):
            for x, y in loader:
                step(model, optimizer, x, y)
        loader.close()
        return accuracy(model, test)
    stream = coordl.ExperienceStream(parts)
    rehearsal = None if method == "finetune" else \
        coordl.Rehearsal(args.capacity, method, per_batch=args.per_batch, seed=seed)
    with coordl.DataLoader(stream, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                           generator=generator, rehearsal=rehearsal) as loader:
        for _ in stream:
            for _ in range(args.epochs):
                for x, y in loader:
                    step(model, optimizer, x, y)
    return accuracy(model, test)


# -- the same protocol in plain torch ---------------------------------------------------------------------------

def train_plain(train: list, method: str, seed: int, args, test, augment: bool) -> float:
    model = make_model(seed)
    optimizer = optimizer_of(model)
    images = torch.cat([x for x, _ in train])
    labels = torch.cat([y for _, y in train])
    generator = torch.Generator().manual_seed(seed)
    brighten = Brighten() if augment else (lambda x: x)

    def permutation(n: int) -> torch.Tensor:  # as a torch loader over a shuffling sampler draws: its base seed first
        torch.empty((), dtype=torch.int64).random_(generator=generator)
        return torch.randperm(n, generator=generator)

    def batch(indices: list[int]):
        return torch.stack([brighten(images[i]) for i in indices]), labels[indices]
    if method == "joint":
        for _ in range(args.epochs):
            for chunk in permutation(len(images)).split(args.batch_size):
                step(model, optimizer, *batch(chunk.tolist()))
        return accuracy(model, test)
    rehearsal = None if method == "finetune" else coordl.Rehearsal(args.capacity, method, per_batch=args.per_batch,
                                                                   seed=seed)
    start = 0
    for x, _ in train:
        for epoch in range(args.epochs):
            order = (permutation(len(x)) + start).tolist()
            for k in range(0, len(order), args.batch_size):
                new = order[k:k + args.batch_size]
                replayed = rehearsal.replay(0, args.per_batch, besides=new) if rehearsal is not None else []
                step(model, optimizer, *batch(new + replayed))
            if epoch == 0 and rehearsal is not None:
                for i in order:
                    rehearsal.buffers[0].offer(i, int(labels[i]))
        start += len(x)
    return accuracy(model, test)


def accuracy_runs(args, work: str) -> dict:
    data = make_class_images(os.path.join(work, "classes"), args.train_per_class, args.test_per_class)
    test = decoded(data["test"])
    train = [decoded(pairs) for pairs in data["train"]]
    methods = ("finetune", *POLICIES, "joint")
    runs = []
    for augment in (True, False):
        for seed in range(args.seeds):
            for method in methods:
                for system in ("coordl", "plain"):
                    started = time.perf_counter()
                    acc = train_coordl(data, method, seed, args, test, augment) if system == "coordl" else \
                        train_plain(train, method, seed, args, test, augment)
                    runs.append({"method": method, "system": system, "seed": seed, "augment": augment,
                                 "accuracy": acc, "time_s": time.perf_counter() - started})
                    print(f"  augment={augment} seed {seed} {method:>15} {system:>6}: accuracy {acc:.3f}", flush=True)
    summary = {}
    for augment in (True, False):
        for method in methods:
            of = {system: [r["accuracy"] for r in runs if (r["method"], r["system"], r["augment"]) ==
                           (method, system, augment)] for system in ("coordl", "plain")}
            summary[f"{method}{'' if augment else ' (no augmentation)'}"] = {
                "coordl": metrics.spread(of["coordl"]), "plain": metrics.spread(of["plain"]),
                "coordl_mean": statistics.mean(of["coordl"]), "plain_mean": statistics.mean(of["plain"]),
                "difference": statistics.mean(of["coordl"]) - statistics.mean(of["plain"]),
                "largest_seed_difference": max(abs(a - b) for a, b in zip(of["coordl"], of["plain"]))}
    return {"runs": runs, "summary": summary}


# -- throughput as the stream grows ------------------------------------------------------------------------------

CROP_TF = T.Compose([T.RandomResizedCrop(64), T.ToTensor()])


def stream_roots(work: str, experiences: int, images: int) -> list[str]:
    from coordl._demo.synthetic import make_image_folder
    roots = []
    for number in range(experiences):
        root = os.path.join(work, "stream", f"e{number:02d}")
        if not os.path.isdir(root):
            make_image_folder(root, images, n_classes=2, mean_side_px=160, seed=number)
        roots.append(root)
    return roots


def _experience(loader, epochs: int) -> dict:
    """One experience's ``epochs`` through ``loader``: samples (new + replayed), seconds and samples/s."""
    done = []
    for _ in range(epochs):
        samples, started = 0, time.perf_counter()
        for x, _ in loader:
            samples += len(x)
        done.append((samples, time.perf_counter() - started))
    samples, seconds = sum(n for n, _ in done), sum(t for _, t in done)
    later = done[1:]  # every sample a hit of the node's cache
    return {"samples": samples, "time_s": seconds, "samples_per_s": samples / seconds, "epochs": done,
            "later_samples_per_s": sum(n for n, _ in later) / sum(t for _, t in later)}


def throughput_run(roots: list[str], rep: int, args) -> dict[bool, list[dict]]:
    """Both loaders, without rehearsal and with it, each over a stream of its own of the same experiences,
    side by side: experience by experience, each loader's epochs in turn (which goes first alternating), each
    experience's files dropped from the page cache before either reads them. So at every experience both meet
    the machine at the same speed, which on a VM moves by 10-20% over tens of seconds. Per loader and
    experience: see :func:`_experience`."""
    from torchvision.datasets import ImageFolder
    per_batch = args.batch_size // 2
    out: dict[bool, list[dict]] = {False: [], True: []}
    with contextlib.ExitStack() as stack:
        streams, loaders = {}, {}
        for rehearsal in (False, True):
            streams[rehearsal] = coordl.ExperienceStream([ImageFolder(root, transform=CROP_TF) for root in roots])
            loaders[rehearsal] = stack.enter_context(coordl.DataLoader(
                streams[rehearsal], batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                generator=torch.Generator().manual_seed(0), persistent_workers=True,
                rehearsal=coordl.Rehearsal(1000, per_batch=per_batch, seed=0) if rehearsal else None,
                cache_name=f"rehearsal-bench-{os.getpid()}-{int(rehearsal)}"))
        for number, _ in enumerate(zip(streams[False], streams[True])):
            for rehearsal in (False, True) if (number + rep) % 2 == 0 else (True, False):
                evict_files(roots[number])
                out[rehearsal].append({"experience": number, **_experience(loaders[rehearsal], args.stream_epochs)})
    return out


def throughput_runs(args, work: str) -> dict:
    roots = stream_roots(work, args.stream_experiences, args.stream_images)
    runs = []
    for rep in range(args.reps):
        for rehearsal, per_experience in throughput_run(roots, rep, args).items():
            samples, seconds = sum(e["samples"] for e in per_experience), sum(e["time_s"] for e in per_experience)
            runs.append({"rehearsal": rehearsal, "rep": rep, "experiences": per_experience,
                         "samples_per_s": samples / seconds})
            print(f"  rep {rep} rehearsal={rehearsal}: {samples / seconds:.0f} samples/s", flush=True)
    ratios, later_ratios, relative = [], [], []
    for rep in range(args.reps):
        on, off = (next(r for r in runs if r["rep"] == rep and r["rehearsal"] is flag) for flag in (True, False))
        ratios.append(on["samples_per_s"] / off["samples_per_s"])
        later_ratios.append(statistics.median(a["later_samples_per_s"] / b["later_samples_per_s"]
                                              for a, b in zip(on["experiences"], off["experiences"])))
        relative.append([a["samples_per_s"] / b["samples_per_s"]
                         for a, b in zip(on["experiences"], off["experiences"])])
    series = {flag: [[e["samples_per_s"] for e in run["experiences"]] for run in runs if run["rehearsal"] is flag]
              for flag in (True, False)}
    return {"runs": runs, "ratio": metrics.spread(ratios), "ratios": ratios,
            "later_ratio": metrics.spread(later_ratios), "relative": flatness(relative), **flatness(series[True]),
            "without": flatness(series[False])}


def flatness(series: list[list[float]]) -> dict:
    """How a figure moves from experience 1 to the last (experience 0 has nothing to replay), given per
    repetition per experience: each experience's median over the repetitions, their largest gap from their
    median, and the change from the first to the last of a straight line fitted through them (what grows with
    the stream, apart from the machine's noise)."""
    rates = [statistics.median(rep[k] for rep in series) for k in range(1, len(series[0]))]
    middle = statistics.median(rates)
    slope, intercept = np.polyfit(np.arange(len(rates)), rates, 1)
    return {"experience_rates": rates, "flatness": max(abs(rate / middle - 1) for rate in rates),
            "trend": (intercept + slope * (len(rates) - 1)) / intercept - 1}


def markdown(result: dict, args) -> str:
    lines = [f"Accuracy over all {CLASSES} classes after {EXPERIENCES} experiences ({args.seeds} seeds; "
             f"b = {args.batch_size}, r = {args.per_batch}, K = {args.capacity}, {args.epochs} epochs each):", "",
             "| method | coordl | plain torch, same protocol | coordl − plain: means, largest of a seed |",
             "|---|---|---|---|"]
    for method, s in result["accuracy"]["summary"].items():
        lines.append(f"| {method} | {report.spread_text(s['coordl'], '.3f')} | {report.spread_text(s['plain'], '.3f')} "
                     f"| {s['difference']:+.3f}, {s['largest_seed_difference']:.3f} |")
    t = result["throughput"]
    lines += ["", f"Throughput over {args.stream_experiences} experiences ({args.workers} workers, r = b/2, K = 1000, "
                  f"{args.reps} repetitions): samples/s with rehearsal ÷ without {report.spread_text(t['ratio'])} "
                  f"(in the epochs after each experience's first, all cache hits: "
                  f"{report.spread_text(t['later_ratio'])}); from experience 1 to {args.stream_experiences - 1}, "
                  f"each experience's samples/s with rehearsal ÷ without, side by side (median of the repetitions) "
                  f"within {t['relative']['flatness']:.1%} of their median, a straight line through them "
                  f"{t['relative']['trend']:+.1%} from the first to the last; each loader's own samples/s within "
                  f"{t['flatness']:.1%} (without rehearsal: {t['without']['flatness']:.1%}) of their median, a "
                  f"line {t['trend']:+.1%} (without: {t['without']['trend']:+.1%}), with the machine's speed."]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    with Cleanup() as cleanup:
        work = cleanup.workdir(args.workdir)
        print("accuracy ...", flush=True)
        result = {"accuracy": accuracy_runs(args, work)}
        print("throughput ...", flush=True)
        result["throughput"] = throughput_runs(args, work)
        report.write_run(args.out, result, report.setup_of(args), markdown(result, args))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
