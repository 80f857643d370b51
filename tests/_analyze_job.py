"""A small training script for tests/integration/test_analyzer.py, run by ``coordl analyze``.

``_analyze_job.py ROOT [--epochs E] [--workers W] [--step-s S] [--fail-at B [--only-in-phase PHASE]]
[--torch-loader]``: an ImageFolder at ROOT through ``coordl.DataLoader`` (or torch's, ``--torch-loader``),
a training step of ``S`` seconds; ``--fail-at B`` raises at batch B (only in coordl analyze's PHASE).
"""

import argparse
import os
import time

import torch
import torchvision
from torchvision import transforms

import coordl


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--step-s", type=float, default=0.0)
    parser.add_argument("--fail-at", type=int)
    parser.add_argument("--only-in-phase", help="fail (--fail-at) only in this phase of coordl analyze")
    parser.add_argument("--torch-loader", action="store_true")
    args = parser.parse_args()
    dataset = torchvision.datasets.ImageFolder(args.root, transform=transforms.Compose(
        [transforms.RandomResizedCrop(32, antialias=True), transforms.ToTensor()]))
    make = torch.utils.data.DataLoader if args.torch_loader else coordl.DataLoader
    loader = make(dataset, batch_size=8, shuffle=True, num_workers=args.workers)
    batch = 0
    for _ in range(args.epochs):
        for images, labels in loader:
            batch += 1
            if batch == args.fail_at and args.only_in_phase in (None, os.environ.get("COORDL_ANALYZE_PHASE")):
                raise RuntimeError(f"the training step failed at batch {batch}")
            if args.step_s:
                time.sleep(args.step_s)


if __name__ == "__main__":
    main()
