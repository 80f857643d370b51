"""Why the page cache loses, without I/O: replay epochs of a training job through LRU and MinIO.

    python -m benchmarks.cache_sim [--items 10000] [--epochs 4] [--fractions 0.35 0.5 0.65 1.0] [--out DIR]

Every epoch requests every item once, in a fresh random permutation ("random", as torch's sampler
and DALI-shuffle) or in file order ("sequential", as DALI-seq's reader before its shuffle buffer).
The LRU cache stands in for the OS page cache; the MinIO cache takes items in the order of the
first epoch until the next one does not fit, then never changes. Prints the hit rate per epoch
(the thrashing of the paper's Fig. 12) and, with ``--out``, writes ``cache_sim.json`` and a plot.
"""

import argparse
import collections
import json
import os
import sys

import numpy as np

POLICIES = ("lru", "minio")
ORDERS = ("random", "sequential")


class LRUCache:
    """Byte-bounded least-recently-used cache of item ids (what a page cache approximates)."""

    def __init__(self, capacity_bytes: int):
        self.capacity, self.used = capacity_bytes, 0
        self.items: collections.OrderedDict[int, int] = collections.OrderedDict()

    def access(self, item: int, size: int) -> bool:
        """Request ``item``; returns whether it was a hit. A miss is inserted, evicting the oldest."""
        if item in self.items:
            self.items.move_to_end(item)
            return True
        if size <= self.capacity:
            self.items[item] = size
            self.used += size
            while self.used > self.capacity:
                self.used -= self.items.popitem(last=False)[1]
        return False


class MinIOCache:
    """Byte-bounded fill-once cache: inserts misses until one does not fit, then freezes."""

    def __init__(self, capacity_bytes: int):
        self.capacity, self.used, self.frozen = capacity_bytes, 0, False
        self.items: set[int] = set()

    def access(self, item: int, size: int) -> bool:
        """Request ``item``; returns whether it was a hit. A miss is inserted while the cache fills."""
        if item in self.items:
            return True
        if not self.frozen:
            if self.used + size > self.capacity:
                self.frozen = True
            else:
                self.items.add(item)
                self.used += size
        return False


def simulate(policy: str, cache_fraction: float, epochs: int, sizes: np.ndarray | None = None,
             n_items: int | None = None, order: str = "random", seed: int = 0) -> list[float]:
    """Hit rate (hits / requests) of each epoch for one cache policy, starting cold.

    Args:
        policy: ``"lru"`` or ``"minio"``.
        cache_fraction: capacity as a fraction of the dataset's total bytes.
        sizes: bytes of each item; or give ``n_items`` for items of equal size.
        order: ``"random"`` (a new permutation each epoch) or ``"sequential"`` (file order).
    """
    if policy not in POLICIES or order not in ORDERS:
        raise ValueError(f"policy should be one of {POLICIES} and order one of {ORDERS}, got {policy!r}, {order!r}")
    sizes = np.ones(n_items, dtype=np.int64) if sizes is None else np.asarray(sizes, dtype=np.int64)
    capacity = int(round(cache_fraction * int(sizes.sum())))
    cache = LRUCache(capacity) if policy == "lru" else MinIOCache(capacity)
    rng = np.random.default_rng(seed)
    rates = []
    for _ in range(epochs):
        requests = rng.permutation(len(sizes)) if order == "random" else range(len(sizes))
        hits = sum(cache.access(int(i), int(sizes[i])) for i in requests)
        rates.append(hits / len(sizes))
    return rates


def simulate_all(cache_fractions, epochs: int, sizes: np.ndarray | None = None, n_items: int | None = None,
                 seed: int = 0) -> list[dict]:
    """Every policy and order at every cache fraction: ``{"policy", "order", "cache_fraction", "hit_rates"}``."""
    return [{"policy": policy, "order": order, "cache_fraction": fraction,
             "hit_rates": simulate(policy, fraction, epochs, sizes, n_items, order, seed)}
            for fraction in cache_fractions for policy in POLICIES for order in ORDERS
            if not (policy == "minio" and order == "sequential")]  # MinIO's hits do not depend on order


def format_table(rows: list[dict]) -> str:
    """Plain-text table: one line per (fraction, policy, order), hit % per epoch."""
    epochs = len(rows[0]["hit_rates"]) if rows else 0
    lines = [f"{'cache':>6} {'policy':<6} {'order':<11}" + "".join(f"{'epoch ' + str(e + 1):>9}" for e in range(epochs))]
    for r in rows:
        lines.append(f"{r['cache_fraction']:>6.0%} {r['policy']:<6} {r['order']:<11}"
                     + "".join(f"{h:>9.1%}" for h in r["hit_rates"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=10000)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.35, 0.5, 0.65, 1.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write cache_sim.json and cache_sim.png here")
    args = parser.parse_args(argv)
    rows = simulate_all(args.fractions, args.epochs, n_items=args.items, seed=args.seed)
    print(format_table(rows))
    if args.out:
        from benchmarks import report

        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cache_sim.json"), "w") as f:
            json.dump({"items": args.items, "runs": rows, "provenance": report.provenance()}, f, indent=2)
        written = report.plot_cache_sim(rows, os.path.join(args.out, "cache_sim.png"))
        print(f"wrote {args.out}/cache_sim.json" + (" and cache_sim.png" if written else " (plots skipped: no matplotlib)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
