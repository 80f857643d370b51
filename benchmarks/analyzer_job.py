"""The training script ``benchmarks.analyzer`` analyzes and then times: an ImageFolder through
``coordl.DataLoader`` (random crops, shuffled, persistent workers), a training step of ``--step-ms``.

``python benchmarks/analyzer_job.py ROOT --cache-bytes B --workers W --epochs E --step-ms S [--batch-size N]
[--workload decode|bytes] [--backend dali] [--cache-dir DIR --cache-dir-bytes B] [--out FILE] [--started FILE]``;
``--cache-dir``: a disk tier in DIR holding at most B bytes; ``--workload bytes``: the files' first
:data:`BYTES_SAMPLE` raw bytes as a tensor (a ``coordl.FileDataset``, no decode), where ``decode`` (the default)
decodes and crops the images;
writes ``loader.stats()``'s epochs to FILE (JSON) at the end, and creates the ``--started`` file once its loader
is built, before its first epoch. Under torchrun with several ranks, each rank
takes its share of every epoch (``DistributedSampler``), all-reduces after each step as DDP does, and
writes FILE.rank<RANK> (and the ``--started`` file with the same suffix).
"""

import argparse
import dataclasses
import json
import os
import time

import torch
import torch.distributed
import torch.utils.data
import torchvision
from torchvision import transforms

import coordl

BYTES_SAMPLE = 4096
"""Bytes of each file a sample of the raw-bytes workload holds (padded with zeros: one size, for collate)."""


def first_bytes(raw: bytes) -> torch.Tensor:
    """The raw-bytes workload's sample: the file's first :data:`BYTES_SAMPLE` bytes."""
    return torch.frombuffer(bytearray(raw[:BYTES_SAMPLE].ljust(BYTES_SAMPLE, b"\0")), dtype=torch.uint8)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--cache-bytes", type=int, required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--step-ms", type=float, default=0.0)
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--workload", choices=("decode", "bytes"), default="decode")
    parser.add_argument("--cache-dir")
    parser.add_argument("--cache-dir-bytes", type=int)
    parser.add_argument("--out")
    parser.add_argument("--started")
    args = parser.parse_args()
    dataset = torchvision.datasets.ImageFolder(args.root, transform=transforms.Compose(
        [transforms.RandomResizedCrop(64, antialias=True), transforms.ToTensor()]))
    if args.workload == "bytes":
        dataset = coordl.FileDataset([path for path, _ in dataset.samples], targets=dataset.targets,
                                     decode=first_bytes)
    ranks = int(os.environ.get("WORLD_SIZE", 1))
    sampler = None
    if ranks > 1:
        torch.distributed.init_process_group("gloo")
        sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True)
    loader = coordl.DataLoader(dataset, batch_size=args.batch_size, shuffle=sampler is None, sampler=sampler,
                               num_workers=args.workers, persistent_workers=args.workers > 0,
                               cache_bytes=args.cache_bytes, backend=args.backend, cache_dir=args.cache_dir,
                               cache_dir_bytes="auto" if args.cache_dir_bytes is None else args.cache_dir_bytes,
                               drop_page_cache=True)  # with no cache too: every epoch reads the device
    if args.started:
        open(args.started + (f".rank{os.environ['RANK']}" if ranks > 1 else ""), "w").close()
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for _ in loader:
            time.sleep(args.step_ms / 1000)
            if sampler is not None:
                torch.distributed.all_reduce(torch.ones(1))
    if args.out:
        with open(args.out + (f".rank{os.environ['RANK']}" if ranks > 1 else ""), "w") as f:
            json.dump([dataclasses.asdict(e) for e in loader.stats().epochs], f)
    loader.close()


if __name__ == "__main__":
    main()
