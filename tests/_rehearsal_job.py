"""One rank of a data-parallel job over an experience stream with rehearsal, for tests/integration/test_rehearsal.py
(run by torchrun): ``_rehearsal_job.py ROOT0 ROOT1 OUT [CACHE_BYTES]``.

Each folder is an experience (its files sorted; a sample is (its stream index, crc32 of its bytes)). The rank
trains on experience 0 for one epoch and on experience 1 for two, through ``coordl.DataLoader`` with a
``DistributedSampler`` and a ``Rehearsal`` of 16 exemplars, 8 a batch (partitioned caching as torchrun's
environment makes it; a cache of ``CACHE_BYTES``, else "auto"), the ranks in step at every epoch's end (as a
training step's all-reduce keeps them), and writes ``OUT/rank<RANK>.json``: per epoch its batches (stream
indices, the replayed ones after the first 8, with the crc32s) and its statistics, and the members after each
epoch, of the union and buffer by buffer.
"""

import dataclasses
import json
import os
import sys
import zlib

import torch.distributed as dist
import torch.utils.data
from torch.utils.data.distributed import DistributedSampler

import coordl

BATCH, REPLAYED, CAPACITY = 8, 8, 16


class Files(torch.utils.data.Dataset):
    def __init__(self, root: str, first: int):
        self.files, self.first = sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names), first

    def __len__(self):
        return len(self.files)

    def raw_key(self, index):
        return self.files[index]

    def decode_raw(self, index, raw):
        return self.first + index, zlib.crc32(raw)

    def __getitem__(self, index):
        with open(self.files[index], "rb") as f:
            return self.decode_raw(index, f.read())


def main() -> None:
    roots, out = sys.argv[1:3], sys.argv[3]
    cache_bytes = int(sys.argv[4]) if len(sys.argv) > 4 else "auto"
    dist.init_process_group("gloo")
    first = Files(roots[0], 0)
    stream = coordl.ExperienceStream([first, Files(roots[1], len(first))])
    sampler = DistributedSampler(stream, num_replicas=int(os.environ["WORLD_SIZE"]), rank=int(os.environ["RANK"]),
                                 seed=5)
    loader = coordl.DataLoader(stream, batch_size=BATCH, sampler=sampler, num_workers=2, cache_bytes=cache_bytes,
                               rehearsal=coordl.Rehearsal(CAPACITY, per_batch=REPLAYED, seed=9))
    epochs, members, buffers = [], [], []
    for experience in stream:
        for epoch in range(1 if experience.number == 0 else 2):
            sampler.set_epoch(epoch)
            epochs.append([[(int(i), int(c)) for i, c in zip(*batch)] for batch in loader])
            members.append(loader.rehearsal.members())
            buffers.append([list(buffer.items) for buffer in loader.rehearsal.buffers])
            dist.barrier()  # (and no rank's peer server goes while another still fetches from it)
    stats = [dataclasses.asdict(e) for e in loader.stats().epochs]
    loader.close()
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"epochs": epochs, "members": members, "buffers": buffers, "stats": stats}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
