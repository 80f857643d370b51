"""What the peer wire costs in CPU: one peer server (as a node's serves its cache) and one client on a loopback
connection in this process, the client asking for every item in requests of 50, pass after pass.

    python -m benchmarks.peer_wire_cpu [--items 400] [--item-kb 100] [--passes 6] [--reps 3]

Prints the process's CPU seconds (both ends: tags, hashes, copies and the kernel's socket work) per 400 MB
served, for the first pass (the server works out each item's digest) and the later ones (it has them), and
the same for a server that hashes every item it serves (``PeerServer``'s default, for a lookup whose bytes
may change: two hashes an item, one at each end), in turns within each of ``--reps`` repetitions, with their
spread, and the git SHA. Run it with nothing else on the machine.
"""

import argparse
import os
import resource
import socket
import statistics
import subprocess
import time

from coordl._peer import wire
from coordl._peer.server import ItemDigests, PeerServer

SECRET = b"peer-wire-cpu-secret"
PER = 400 * 10**6
"""The figures' unit: CPU seconds per this many bytes served."""


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def one_rep(items: list[bytes], passes: int, memo: bool) -> list[float]:
    """CPU seconds per :data:`PER` bytes of each pass over ``items`` (``memo``: the server keeps its digests)."""
    digests = {"digests": ItemDigests(len(items))} if memo else {}
    server = PeerServer(lambda i: (items[i], None), len(items), SECRET, "127.0.0.1", **digests).start()
    try:
        with socket.create_connection(server.address, timeout=10) as conn:
            channel = wire.client_handshake(conn, SECRET, time.monotonic() + 10)
            total, costs = sum(map(len, items)), []
            for _ in range(passes):
                started = _cpu_s()
                for first in range(0, len(items), 50):
                    ids = list(range(first, min(first + 50, len(items))))
                    wire.send_request(channel, ids)
                    for _, data, _ in wire.read_reply(channel, ids, time.monotonic() + 30):
                        assert data is not None
                costs.append((_cpu_s() - started) * PER / total)
            return costs
    finally:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=400)
    parser.add_argument("--item-kb", type=int, default=100)
    parser.add_argument("--passes", type=int, default=6)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if args.passes < 2 or args.items < 1 or args.reps < 1:
        parser.error("--passes must be at least 2, --items and --reps at least 1")
    items = [os.urandom(args.item_kb * 1000) for _ in range(args.items)]
    figures = {(memo, which): [] for memo in (True, False) for which in ("first pass", "later passes")}
    for _ in range(args.reps):
        for memo in (True, False):
            first, *later = one_rep(items, args.passes, memo)
            figures[memo, "first pass"].append(first)
            figures[memo, "later passes"].append(statistics.median(later))
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    print(f"at {sha}: {args.items} items of {args.item_kb} kB, {args.reps} repetitions; CPU s per 400 MB served "
          f"(both ends), median [min-max]")
    for (memo, which), values in figures.items():
        server = "digests kept (a cache's server)" if memo else "every item hashed at every serve"
        print(f"  {server}, {which}: {statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]")


if __name__ == "__main__":
    main()
