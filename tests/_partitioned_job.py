"""One rank of a data-parallel job for the partitioned-caching tests (run by torchrun, or with its environment).

Loads a folder of files through ``coordl.DataLoader`` with a ``DistributedSampler`` and records, per
epoch, every index it was given with a crc32 of the bytes it was decoded from (``--backend dali``: an
ImageFolder through the DALI backend, batches only), the longest wait for a batch, the loader's
statistics and a digest of its ownership map, in ``OUT/rank<RANK>.json``. ``--pause EPOCH:BATCH`` stops
the rank after that many batches of that epoch, writes ``OUT/paused-rank<RANK>`` (holding the pid and
address of the node's peer server, on local rank 0), and waits for ``OUT/go`` (so a test can kill a peer
at a known point).
"""

import argparse
import hashlib
import json
import os
import time
import zlib

import torch.utils.data
from torch.utils.data.distributed import DistributedSampler

import coordl


class Files(torch.utils.data.Dataset):
    """The files under ``root``, sorted; a sample is (index, crc32 of its bytes)."""

    def __init__(self, root: str):
        self.files = sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names)

    def __len__(self):
        return len(self.files)

    def raw_key(self, index):
        return self.files[index]

    def decode_raw(self, index, raw):
        return index, zlib.crc32(raw)

    def __getitem__(self, index):
        with open(self.files[index], "rb") as f:
            return self.decode_raw(index, f.read())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--cache-bytes", default="auto")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--partitioned", default="auto", choices=("auto", "true", "false"))
    parser.add_argument("--pause", default=None, help="EPOCH:BATCH")
    parser.add_argument("--step-s", type=float, default=0.0, help="a training step's time")
    parser.add_argument("--backend", default="torch", choices=("torch", "dali"))
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.backend == "dali":
        import torchvision
        dataset = torchvision.datasets.ImageFolder(args.root)
    else:
        dataset = Files(args.root)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=5)
    cache_bytes = args.cache_bytes if args.cache_bytes == "auto" else int(args.cache_bytes)
    partitioned = {"auto": "auto", "true": True, "false": False}[args.partitioned]
    pause = tuple(int(v) for v in args.pause.split(":")) if args.pause else None
    loader = coordl.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                               cache_bytes=cache_bytes, partitioned=partitioned, backend=args.backend)
    peers = loader.dataset.peers
    epochs = []
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        samples, longest = [], 0.0
        it = iter(loader)
        batch_no = 0
        while True:
            started = time.monotonic()
            try:
                first, second = next(it)
            except StopIteration:
                break
            longest = max(longest, time.monotonic() - started)
            batch_no += 1
            if args.backend == "torch":  # (indices, crcs)
                samples += [[int(i), int(c)] for i, c in zip(first, second)]
            if args.step_s:
                time.sleep(args.step_s)
            if pause == (epoch, batch_no):
                server = peers._server if peers is not None else None
                with open(os.path.join(args.out, f"paused-rank{rank}"), "w") as f:
                    json.dump({"server_pid": server.proc.pid, "address": list(server.address)} if server else {}, f)
                while not os.path.exists(os.path.join(args.out, "go")):
                    time.sleep(0.05)
        epochs.append({"epoch": epoch, "samples": samples, "longest_wait_s": longest})
    stats = loader.stats()
    cache = stats.cache
    result = {"rank": rank, "node": int(os.environ.get("GROUP_RANK", rank)), "epochs": epochs,
              "stats": [e.__dict__ for e in stats.epochs], "peers": stats.peers,
              "partition": list(cache.partition) if cache is not None and cache.partition else None,
              "cached_items": cache.items_cached if cache is not None else 0,
              "cached_bytes": cache.bytes_cached if cache is not None else 0,
              "owner_digest": hashlib.sha256(peers.state.owner.numpy().tobytes()).hexdigest() if peers else None}
    loader.close()
    path = os.path.join(args.out, f"rank{rank}.json")
    with open(path + ".part", "w") as f:
        json.dump(result, f)
    os.replace(path + ".part", path)


if __name__ == "__main__":
    main()
