"""``python -m benchmarks.locality --out DIR``: the load imbalance of locality-aware assignment, simulated.

The dataset is split evenly at random over p servers (one rank each, as in Fig. 6 of the locality-aware
loading paper), global batches of p x b samples are drawn from random permutations, and each is
reassigned with ``coordl._peer.locality.assign``. A batch's imbalance is the samples balancing must move
between servers (the sum of the deficits) over the global batch; its median over many batches is set
beside the closed form beta = sqrt((1 - 1/p) / (2 pi b)) (each server's count is Binomial(p b, 1/p); a
deficit's mean is its standard deviation / sqrt(2 pi)). Every batch also checks Algorithm 1: the volume it
moves is the sum of the deficits, in at most p - 1 transfers.
"""

import argparse
import math
import os
import statistics
import sys

import numpy as np

from benchmarks import report
from coordl._peer.locality import assign, balance


def closed_form(servers: int, local_batch: int) -> float:
    """beta: the expected share of a global batch that balancing moves."""
    return math.sqrt((1 - 1 / servers) / (2 * math.pi * local_batch))


def simulate(servers: int, local_batch: int, batches: int, seed: int = 0) -> dict:
    """Imbalance of ``batches`` global batches (percent): median, quartiles, and Algorithm 1's checks."""
    rng = np.random.default_rng(seed)
    global_batch = servers * local_batch
    n = global_batch * max(8, -(-batches // 8))
    owner = np.empty(n, dtype=np.int16)
    owner[rng.permutation(n)] = np.arange(n) % servers  # an even random split
    imbalance, max_transfers = [], 0
    order = rng.permutation(n)
    for k in range(batches):
        start = (k * global_batch) % n
        if start + global_batch > n:
            order = rng.permutation(n)
            start = 0
        batch = order[start:start + global_batch]
        counts = np.bincount(owner[batch], minlength=servers)
        deficit = {s: max(0, local_batch - int(c)) for s, c in enumerate(counts)}
        surplus = {s: max(0, int(c) - local_batch) for s, c in enumerate(counts)}
        transfers = balance(surplus, deficit)
        _, moved = assign(batch, owner, servers, 1)
        if moved != sum(deficit.values()) or sum(m for _, _, m in transfers) != moved or len(transfers) > servers - 1:
            raise AssertionError(f"Algorithm 1 broke its bounds at p={servers}, b={local_batch}, batch {k}")
        max_transfers = max(max_transfers, len(transfers))
        imbalance.append(100 * moved / global_batch)
    q1, median, q3 = statistics.quantiles(imbalance, n=4)
    return {"local_batch": local_batch, "servers": servers, "batches": batches, "median_percent": median,
            "q1_percent": q1, "q3_percent": q3, "closed_form_percent": 100 * closed_form(servers, local_batch),
            "max_transfers": max_transfers}


def markdown(rows: list[dict], setup: dict) -> str:
    lines = ["# Locality-aware assignment: imbalance (samples balancing moves / global batch)", "",
             f"`{setup['provenance']['command']}` at {setup['provenance']['git_sha']}", "",
             "| local batch | servers | median % [q1–q3] | closed form % | paper (Fig. 6) % | most transfers (≤ p−1) |",
             "|---|---|---|---|---|---|"]
    paper = {32: 6.9, 64: 4.8, 128: 3.4}
    for r in rows:
        lines.append(f"| {r['local_batch']} | {r['servers']} | {r['median_percent']:.2f} [{r['q1_percent']:.2f}–"
                     f"{r['q3_percent']:.2f}] | {r['closed_form_percent']:.2f} | {paper.get(r['local_batch'], '–')} | "
                     f"{r['max_transfers']} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> str | None:
    made = report.axes((6, 4))
    if made is None:
        return None
    plt, fig, ax = made
    for servers in sorted({r["servers"] for r in rows}):
        mine = [r for r in rows if r["servers"] == servers]
        ax.plot([r["local_batch"] for r in mine], [r["median_percent"] for r in mine], marker="o",
                label=f"p = {servers}, simulated median")
    bs = sorted({r["local_batch"] for r in rows})
    ax.plot(bs, [100 * closed_form(10**9, b) for b in bs], "k--", label="closed form (p large)")
    ax.scatter([32, 64, 128], [6.9, 4.8, 3.4], marker="x", color="red", label="paper, Fig. 6 medians")
    ax.set(xscale="log", xlabel="local batch b", ylabel="imbalance, % of the global batch",
           title="samples balancing moves between servers")
    ax.minorticks_off()
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.legend(fontsize=7)
    return report.save(fig, plt, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.locality", description=__doc__.split("\n")[0])
    parser.add_argument("--local-batches", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--servers", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--batches", type=int, default=500, help="global batches per point")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    rows = [simulate(p, b, args.batches, seed=p * 1000 + b) for b in args.local_batches for p in args.servers]
    setup = {"machine": report.machine(), "provenance": report.provenance(), "config": vars(args)}
    text = markdown(rows, setup)
    os.makedirs(args.out, exist_ok=True)
    drawn = plot(rows, os.path.join(args.out, "imbalance.png"))
    setup["plots"] = [os.path.basename(drawn)] if drawn else []
    report.write_json_and_markdown(args.out, {"imbalance": rows, "setup": setup}, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
