"""``python -m benchmarks.placement --out DIR``: where items should be cached across servers, simulated.

Partitioned caching needs each item in at most one server's cache. Two ways to decide which:

* ``first-come``: what coordl does (``coordl._peer.tier`` NOTE [ Ownership ], [ Hand-off ]): a server
  caches what its ranks read from storage while its cache has room; once full, it hands what it reads
  to the next server that still has room; the map of who holds what is exchanged at epoch starts.
  ``first-come, no hand-off`` is the same without handing off (coordl before hand-offs).
* ``hash``: item i belongs to server hash(i) mod N; a server caches only its own items and forwards
  what it reads of another server's to that server while that server's cache takes items (no map to
  exchange: anyone can compute owners).

Each server's cache holds ``fraction`` x D / N bytes (plus the largest item from 100% on, as in
``benchmarks.partitioned``). Items have lognormal sizes (ImageNet's JPEGs: mean 110 KB); each epoch every
server reads its ``DistributedSampler`` shard (one rank per server, the shards' reads interleaved in
time). Per epoch: bytes read from storage, and bytes that cross the network (peer reads, hand-offs,
forwards), as fractions of the dataset D.
"""

import argparse
import os
import sys

import numpy as np
import torch

from benchmarks import report

POLICIES = ("first-come", "first-come, no hand-off", "hash")


def shards(n: int, servers: int, epoch: int, seed: int = 5) -> list[np.ndarray]:
    """Each server's shard of ``epoch`` as ``DistributedSampler(shuffle=True, seed=seed, drop_last=False)``
    draws it (its permutation, its padding, its stride), without building n samplers."""
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    order = torch.randperm(n, generator=generator).numpy()
    total = -(-n // servers) * servers
    order = np.concatenate([order, np.resize(order, total - n)])  # padded as torch pads
    return [order[s::servers] for s in range(servers)]


def _interleaved(parts: list[np.ndarray]) -> list[tuple[int, int]]:
    """(server, item) in the order the servers read them: their shards side by side, in step."""
    longest = max(len(p) for p in parts)
    return [(s, int(part[k])) for k in range(longest) for s, part in enumerate(parts) if k < len(part)]


class Caches:
    """N MinIO caches: a cache freezes at the first item that does not fit, and never evicts."""

    def __init__(self, servers: int, capacity: int, n: int):
        self.free = [capacity] * servers
        self.frozen = [False] * servers
        self.holder = np.full(n, -1, dtype=np.int32)

    def put(self, server: int, item: int, size: int) -> bool:
        if self.frozen[server] or self.holder[item] >= 0:
            return False
        if size > self.free[server]:
            self.frozen[server] = True
            return False
        self.free[server] -= size
        self.holder[item] = server
        return True


def simulate(policy: str, sizes: np.ndarray, servers: int, fraction: float, epochs: int, seed: int = 5) -> dict:
    """Storage and network bytes per epoch (fractions of the dataset) of ``policy``."""
    n, total = len(sizes), int(sizes.sum())
    capacity = int(fraction * total / servers) + (int(sizes.max()) if fraction >= 1 else 0)
    caches = Caches(servers, capacity, n)
    owner_of = np.random.default_rng(seed).permutation(n) % servers  # a hash: an even, random split
    rows = []
    for epoch in range(1, epochs + 1):
        known = caches.holder.copy()  # the map exchanged at the epoch's start (hash: not needed)
        storage = network = 0
        for server, item in _interleaved(shards(n, servers, epoch, seed)):
            size = int(sizes[item])
            holder = known[item] if policy != "hash" else caches.holder[item]
            if holder == server:
                continue
            if holder >= 0:
                network += size
                continue
            storage += size
            if policy == "hash":
                target = int(owner_of[item])
                if target != server and not caches.frozen[target]:
                    network += size  # forwarded to its owner, while its cache takes items
                caches.put(target, item, size)
            elif not caches.put(server, item, size) and caches.frozen[server] and policy == "first-come":
                for step in range(1, servers):  # the next server that keeps it
                    other = (server + step) % servers
                    if caches.frozen[other]:
                        continue
                    network += size
                    if caches.put(other, item, size) or caches.holder[item] >= 0:
                        break
        rows.append({"epoch": epoch, "storage_fraction": storage / total, "network_fraction": network / total})
    return {"policy": policy, "servers": servers, "fraction": fraction, "items": n, "epochs": rows,
            "cached_fraction": float(sizes[caches.holder >= 0].sum()) / total,
            "later_storage_fraction": sum(r["storage_fraction"] for r in rows[1:])}


def item_sizes(n: int, seed: int = 0) -> np.ndarray:
    """Lognormal sizes with ImageNet's mean (110 KB) and a spread like its JPEGs'."""
    rng = np.random.default_rng(seed)
    sigma = 0.5
    return np.maximum(1, rng.lognormal(np.log(110_000) - sigma ** 2 / 2, sigma, n)).astype(np.int64)


def markdown(rows: list[dict], setup: dict) -> str:
    lines = ["# Placement across servers: first come (coordl) against hash", "",
             f"`{setup['provenance']['command']}` at {setup['provenance']['git_sha']}", "",
             "| items | servers | aggregate cache | policy | epoch 1 storage / D | later epochs storage / D (together) "
             "| epoch 1 network / D | later network / D per epoch | cached / D |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        e = r["epochs"]
        later_net = sum(x["network_fraction"] for x in e[1:]) / max(1, len(e) - 1)
        lines.append(f"| {r['items']} | {r['servers']} | {r['fraction']:.0%} | {r['policy']} | "
                     f"{e[0]['storage_fraction']:.3f} | {r['later_storage_fraction']:.4f} | "
                     f"{e[0]['network_fraction']:.3f} | {later_net:.3f} | {r['cached_fraction']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.placement", description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, nargs="+", default=[400, 20_000])
    parser.add_argument("--servers", type=int, nargs="+", default=[2, 4, 16])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.5, 1.0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    rows = [simulate(policy, item_sizes(n), servers, fraction, args.epochs)
            for n in args.items for servers in args.servers for fraction in args.fractions for policy in POLICIES]
    setup = {"machine": report.machine(), "provenance": report.provenance(), "config": vars(args)}
    text = markdown(rows, setup)
    os.makedirs(args.out, exist_ok=True)
    report.write_json_and_markdown(args.out, {"runs": rows, "setup": setup}, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
