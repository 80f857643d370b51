"""A torchrun job for tests/integration/test_cluster.py: ``_cluster_job.py MODE [ARG]``.

- ``allreduce OUT``: all ranks join a gloo group and sum their ranks; each writes ``OUT/rank<r>.json``
  with what it sees of its node: its node rank, address, hostname, /dev/shm and shm folder (in which
  every rank has a file while it lists).
- ``sleep S``: sleep S seconds.
- ``fail``: raise.
- ``read PATH``: on node 0, read the file at PATH.
"""

import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist


def own_address() -> str:
    """The address this rank's traffic to the master leaves from (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((os.environ["MASTER_ADDR"], 9))
        return s.getsockname()[0]


def allreduce(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = torch.tensor([rank])
    dist.all_reduce(total)
    shm_dir = os.environ["COORDL_SHM_DIR"]
    mine = os.path.join(shm_dir, f"rank{rank}")
    open(mine, "w").close()
    dist.barrier()  # every rank's file is made before any lists
    seen = {"rank": rank, "node": int(os.environ["GROUP_RANK"]), "sum": int(total), "address": own_address(),
            "hostname": socket.gethostname(), "dev_shm": sorted(os.listdir("/dev/shm")),
            "shm_dir": sorted(os.listdir(shm_dir))}
    dist.barrier()  # ... and removed only once all have listed
    os.remove(mine)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()


def main() -> None:
    mode, *args = sys.argv[1:]
    if mode == "allreduce":
        allreduce(args[0])
    elif mode == "sleep":
        time.sleep(float(args[0]))
    elif mode == "fail":
        raise RuntimeError("the job failed on purpose")
    elif mode == "read" and os.environ["GROUP_RANK"] == "0":
        with open(args[0], "rb") as f:
            while f.read(1 << 20):
                pass


if __name__ == "__main__":
    main()
