"""One rank of a data-parallel job over partitioned caches, for ``benchmarks.partitioned`` and the tests
(run by torchrun).

Loads a folder of files (or the objects under an ``s3://`` URL) through ``coordl.DataLoader`` with a
``DistributedSampler`` and records, per epoch, every index it was given with a crc32 of the bytes it was
decoded from (``--backend dali``: an ImageFolder through the DALI backend, batches only), the longest wait
for a batch, the loader's
statistics and a digest of its ownership map, in ``OUT/rank<RANK>.json``. ``--pause EPOCH:BATCH`` stops
the rank (``EPOCH:BATCH:NODE``: server NODE's ranks only) after that many batches of that epoch, writes
``OUT/paused-rank<RANK>`` (the items its server's cache holds, and on local rank 0 the pid, address and handshake binding
of the node's peer server), and waits for ``OUT/go`` (so a test can kill a peer, or hide files, at a known
point; the pause is not counted in the epoch's time). ``--sync`` all-reduces after every step
as DDP does, ``--step-s`` sleeps for a training step, ``--device MAJ:MIN`` records the bytes this rank's
cgroup read from that device per epoch, ``--warm-all`` first reads the whole dataset into this server's
cache (the full-local reference), ``--idle-after NODE:EPOCHS`` has a server stop iterating early,
``--locality`` turns on locality-aware batches, ``--lag NODE[.LOCAL_RANK]:SECONDS`` (repeatable) has a
server's ranks, or one of them, start their last epoch that much later (so the others finish first),
``--group-first`` joins the gloo group before the loader is built (with no ``COORDL_PEER_SECRET``, the
peers then agree their secret over it).
"""

import argparse
import hashlib
import json
import os
import time
import zlib

import torch
import torch.distributed as dist
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


class Objects(coordl.ObjectDataset):
    """The objects under an ``s3://`` URL, in key order; a sample is (index, crc32 of its bytes), as a
    :class:`Files` sample."""

    def decode_raw(self, index, raw):
        return index, zlib.crc32(raw)


def cgroup_read_bytes(device: str | None) -> int:
    """Bytes this process's blkio cgroup read from ``device`` (``MAJ:MIN``); 0 without one."""
    if device is None:
        return 0
    with open("/proc/self/cgroup") as f:
        path = next(line.split(":", 2)[2].strip() for line in f if ":blkio:" in line)
    with open(f"/sys/fs/cgroup/blkio{path}/blkio.throttle.io_service_bytes") as f:
        return sum(int(w[2]) for w in (line.split() for line in f) if len(w) == 3 and w[0] == device and w[1] == "Read")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True, help="a folder, or an s3:// URL (the store's from AWS_* variables)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--cache-bytes", default="auto", help="'auto', bytes, or bytes per server: A,B,...")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--partitioned", default="auto", choices=("auto", "true", "false"))
    parser.add_argument("--pause", default=None, help="EPOCH:BATCH[:NODE] (NODE: only that server's ranks)")
    parser.add_argument("--step-s", type=float, default=0.0, help="a training step's time")
    parser.add_argument("--backend", default="torch", choices=("torch", "dali"))
    parser.add_argument("--sync", action="store_true", help="all-reduce after every step, as DDP")
    parser.add_argument("--group-first", action="store_true",
                        help="join the gloo group before building the loader (the peers then agree their secret over it)")
    parser.add_argument("--device", default=None, help="MAJ:MIN whose reads this rank's cgroup counts")
    parser.add_argument("--warm-all", action="store_true", help="read every sample into the cache first")
    parser.add_argument("--locality", action="store_true", help="locality_aware=True")
    parser.add_argument("--idle-after", default=None, help="NODE:EPOCHS: that server's ranks stop iterating after "
                        "EPOCHS epochs and keep their loader until rank 0 has iterated all of its epochs")
    parser.add_argument("--cache-dir", default=None, help="a disk tier for each server, in DIR/node<N>")
    parser.add_argument("--lag", action="append", default=[], help="NODE[.LOCAL_RANK]:SECONDS: that server's "
                        "ranks (or that one) start their last epoch SECONDS late; repeatable")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.backend == "dali":
        import torchvision
        dataset = torchvision.datasets.ImageFolder(args.root)
    elif args.root.startswith("s3://"):
        dataset = Objects(args.root)
    else:
        dataset = Files(args.root)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=5)
    node = int(os.environ.get("GROUP_RANK", rank))
    per_node = args.cache_bytes.split(",")
    if len(per_node) not in (1, int(os.environ.get("GROUP_WORLD_SIZE", 1))):
        parser.error(f"--cache-bytes gives {len(per_node)} sizes for {os.environ.get('GROUP_WORLD_SIZE')} servers")
    cache_bytes = per_node[node] if len(per_node) > 1 else per_node[0]
    cache_bytes = cache_bytes if cache_bytes == "auto" else int(cache_bytes)
    partitioned = {"auto": "auto", "true": True, "false": False}[args.partitioned]
    pause = tuple(int(v) for v in args.pause.split(":")) if args.pause else None
    if pause is not None and len(pause) == 3:
        pause = pause[:2] if pause[2] == node else None
    if args.group_first:
        dist.init_process_group("gloo")
    loader = coordl.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                               cache_bytes=cache_bytes, partitioned=partitioned, backend=args.backend,
                               locality_aware=args.locality,
                               cache_dir=os.path.join(args.cache_dir, f"node{node}") if args.cache_dir else None)
    peers = loader.dataset.peers
    if args.sync and not dist.is_initialized():
        dist.init_process_group("gloo")
    if args.warm_all:
        for _ in coordl.DataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers,
                                   cache_bytes=cache_bytes, partitioned=False):
            pass
    idle = tuple(int(v) for v in args.idle_after.split(":")) if args.idle_after else None
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    lag = sum(float(seconds) for who, seconds in (entry.split(":") for entry in args.lag)
              if who in (str(node), f"{node}.{local_rank}"))
    epochs = []
    for epoch in range(1, (idle[1] if idle and idle[0] == node else args.epochs) + 1):
        if lag and epoch == args.epochs:
            time.sleep(lag)
        sampler.set_epoch(epoch)
        samples, batches, longest, paused_s = [], [], 0.0, 0.0
        device_before, epoch_started = cgroup_read_bytes(args.device), time.monotonic()
        it = iter(loader)  # with workers, torch starts the epoch (and its first fetches) here
        batch_no = 0
        started = epoch_started
        while True:
            try:
                first, second = next(it)
            except StopIteration:
                break
            longest = max(longest, time.monotonic() - started)  # the first wait includes iter()
            batch_no += 1
            if args.backend == "torch":  # (indices, crcs)
                samples += [[int(i), int(c)] for i, c in zip(first, second)]
                batches.append([int(i) for i in first])
            if args.step_s:
                time.sleep(args.step_s)
            if args.sync:
                dist.all_reduce(torch.zeros(1))
            if pause == (epoch, batch_no):
                pause_started = time.monotonic()
                server = peers._server if peers is not None else None
                cache = loader.dataset.cache
                paused = {"cached": [int(i) for i in cache.ready_mask().nonzero()[0]] if cache is not None else []}
                if server is not None:
                    paused.update(server_pid=server.proc.pid, address=list(server.address),
                                  binding=peers.binding.hex())
                with open(os.path.join(args.out, f"paused-rank{rank}"), "w") as f:
                    json.dump(paused, f)
                while not os.path.exists(os.path.join(args.out, "go")):
                    time.sleep(0.05)
                paused_s = time.monotonic() - pause_started
            started = time.monotonic()
        epochs.append({"epoch": epoch, "samples": samples, "batches": batches, "longest_wait_s": longest,
                       "time_s": time.monotonic() - epoch_started - paused_s,
                       "device_read_bytes": cgroup_read_bytes(args.device) - device_before})
    open(os.path.join(args.out, f"iterated-rank{rank}"), "w").close()
    if idle and idle[0] == node:
        while not os.path.exists(os.path.join(args.out, "iterated-rank0")):
            time.sleep(0.1)
    stats = loader.stats()
    cache = stats.cache
    result = {"rank": rank, "node": node, "epochs": epochs,
              "stats": [e.__dict__ for e in stats.epochs], "peers": stats.peers,
              "partition": list(cache.partition) if cache is not None and cache.partition else None,
              "cached_items": cache.items_cached if cache is not None else 0,
              "cached_bytes": cache.bytes_cached if cache is not None else 0,
              "owner_digest": hashlib.sha256(peers.state.owner.tobytes()).hexdigest() if peers else None}
    loader.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    path = os.path.join(args.out, f"rank{rank}.json")
    with open(path + ".part", "w") as f:
        json.dump(result, f)
    os.replace(path + ".part", path)


if __name__ == "__main__":
    main()
