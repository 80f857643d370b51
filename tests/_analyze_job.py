"""A small training script for tests/integration/test_analyzer.py, run by ``coordl analyze``.

``_analyze_job.py ROOT [--epochs E] [--workers W] [--step-s S] [--prep-s T] [--fail-at B
[--only-in-phase PHASE]] [--torch-loader] [--cache-bytes N] [--steps-per-epoch K] [--ddp] [--backend dali]
[--hp-group NAME] [--hp-group-size K] [--rebuilt torch|accelerate] [--step-s-in-run S2] [--cache-dir D]``: an
ImageFolder at ROOT (a
folder, or an ``s3://`` prefix: an ``ObjectImageFolder``) through
``coordl.DataLoader`` (or torch's, ``--torch-loader``; or, ``--rebuilt``, a torch DataLoader built from the coordl
loader's dataset, batch sampler and collate function, or Accelerate's ``prepare``d one), persistent workers, a
training step of ``S`` seconds (and ``T`` seconds more prep per sample, waited), leaving each epoch after K
batches; ``--fail-at B`` raises at batch B (only in coordl analyze's PHASE); ``--ddp``: a rank of a torchrun job
(gloo, a DistributedSampler, an all-reduce each step, so the ranks go in step); ``--backend``, ``--hp-group``,
``--hp-group-size``: ``coordl.DataLoader``'s; ``--step-s-in-run``: the step takes ``S2`` seconds in coordl analyze's
run phase (a machine that got busy between the phases); ``--cache-dir``: a disk tier there.
"""

import argparse
import os
import time

import torch
import torchvision
from torchvision import transforms

import coordl


class Pause:
    """A transform that waits ``seconds`` (slow prep that takes no core)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self, image):
        time.sleep(self.seconds)
        return image


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--step-s", type=float, default=0.0)
    parser.add_argument("--prep-s", type=float, default=0.0)
    parser.add_argument("--fail-at", type=int)
    parser.add_argument("--only-in-phase", help="fail (--fail-at) only in this phase of coordl analyze")
    parser.add_argument("--torch-loader", action="store_true")
    parser.add_argument("--cache-bytes", default="auto")
    parser.add_argument("--steps-per-epoch", type=int, help="leave each epoch's loop after this many batches")
    parser.add_argument("--ddp", action="store_true")
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--hp-group")
    parser.add_argument("--hp-group-size", type=int)
    parser.add_argument("--rebuilt", choices=["torch", "accelerate"])
    parser.add_argument("--step-s-in-run", type=float)
    parser.add_argument("--cache-dir")
    args = parser.parse_args()
    if args.step_s_in_run is not None and os.environ.get("COORDL_ANALYZE_PHASE") == "run":
        args.step_s = args.step_s_in_run
    transform = transforms.Compose([transforms.RandomResizedCrop(32, antialias=True), transforms.ToTensor(),
                                    Pause(args.prep_s)])
    dataset = coordl.ObjectImageFolder(args.root, transform=transform) if args.root.startswith("s3://") else \
        torchvision.datasets.ImageFolder(args.root, transform=transform)
    options = dict(batch_size=8, shuffle=True, num_workers=args.workers, persistent_workers=args.workers > 0)
    if args.ddp:
        torch.distributed.init_process_group("gloo")
        options.update(shuffle=False, sampler=torch.utils.data.DistributedSampler(dataset, shuffle=True))
    if args.torch_loader:
        loader = torch.utils.data.DataLoader(dataset, **options)
    else:
        cache_bytes = args.cache_bytes if args.cache_bytes == "auto" else int(args.cache_bytes)
        loader = coordl.DataLoader(dataset, cache_bytes=cache_bytes, backend=args.backend, hp_group=args.hp_group,
                                   hp_group_size=args.hp_group_size, cache_dir=args.cache_dir, **options)
    if args.rebuilt == "torch":
        loader = torch.utils.data.DataLoader(loader.dataset, batch_sampler=loader.batch_sampler,
                                             collate_fn=loader.collate_fn, num_workers=loader.num_workers,
                                             persistent_workers=loader.persistent_workers)
    elif args.rebuilt == "accelerate":
        from accelerate import Accelerator
        loader = Accelerator(cpu=True).prepare(loader)
    batch = 0
    for epoch in range(args.epochs):
        if args.ddp:
            options["sampler"].set_epoch(epoch)
        for step, (images, labels) in enumerate(loader, 1):
            batch += 1
            if batch == args.fail_at and args.only_in_phase in (None, os.environ.get("COORDL_ANALYZE_PHASE")):
                raise RuntimeError(f"the training step failed at batch {batch}")
            if args.step_s:
                time.sleep(args.step_s)
            if args.ddp:
                torch.distributed.all_reduce(torch.ones(1))
            if step == args.steps_per_epoch:
                break


if __name__ == "__main__":
    main()
