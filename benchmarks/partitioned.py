"""``sudo python -m benchmarks.partitioned --nodes 2|4 [--quick] --out DIR``: partitioned caching across servers.

Each server is a network and mount namespace of this machine with its own /dev/shm, its own torchrun and
its own cgroups: blkio throttles and counts its reads of the dataset's loop device, memory bounds it to
what its processes hold plus ``--page-cache-mib`` of page cache (``harness/cluster.py``): N servers with N
disks of ``--read-mbps`` each, one rank per server, DDP-style (an all-reduce after every step of
``--step-ms``). Samples are raw bytes (a crc32, no decode), so storage
is the bottleneck wherever it is read. Modes, at an aggregate cache (all servers' caches together) of 50%
and 100% of the dataset:

* ``uncoordinated``: each server's own MinIO cache (``partitioned=False``);
* ``partitioned``: the servers' caches as one (``partitioned=True``);
  (a server's cache is the aggregate / N, plus the largest item at 100%: see :func:`cache_bytes`)
* ``full-local`` (reference): every server holds the whole dataset in its own cache (read once before
  the measured epochs).
* ``locality``: ``partitioned`` at 100% with ``locality_aware=True`` (each rank takes the samples its
  server caches, balanced: peer traffic is beta = sqrt((1 - 1/p) / (2 pi b)) of the dataset per epoch,
  ``beta`` in the summary);
* ``peer-death``: ``partitioned`` at 100%, and server 1's peer server SIGKILLed after the first batch of
  epoch 3 (its training rank lives on).

Runs are repeated ``--reps`` times in interleaved order. ``results.json`` holds ``dataset_bytes`` and every
run's epochs (``time_s`` of the slowest server, ``device_read_bytes`` and ``peer_bytes`` of all servers,
the longest ``stall_s``) and per-server detail; ``results.md`` the summary; ``partitioned.png`` the plot.
Device bytes are the cgroups' counts; each run records every server's memory figures (``memory``: peak
held, page cache percentiles, limit hits) and says where a page cache broke its budget (``over_budget``).
"""

import argparse
import json
import os
import random
import secrets
import shutil
import signal
import sys
import time

from benchmarks import report
from benchmarks.locality import closed_form
from benchmarks.metrics import spread
from harness.storage_env import FS_BLOCK, Cleanup, copy_to_loop_disk, evict_files, over_budget

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "partitioned_job.py")
MODES = ("full-local", "uncoordinated", "partitioned", "locality", "peer-death")
FILE_BYTES = 100_000


def make_dataset(root: str, files: int, seed: int = 0) -> list[int]:
    """``files`` incompressible files of about ``FILE_BYTES`` in 10 folders, each a whole number of file-system
    blocks (so the device reads exactly what coordl reads); returns their sizes."""
    rng = random.Random(seed)
    sizes = []
    for i in range(files):
        folder = os.path.join(root, f"c{i % 10}")
        os.makedirs(folder, exist_ok=True)
        size = rng.randrange(FILE_BYTES // 2, FILE_BYTES * 3 // 2) // FS_BLOCK * FS_BLOCK
        with open(os.path.join(folder, f"f{i:06d}.bin"), "wb") as f:
            f.write(rng.randbytes(size))
        sizes.append(size)
    return sizes


def plan(nodes: int, reps: int, modes) -> list[dict]:
    """Every run of ``modes``, repetitions interleaved (and rotated, so no mode always runs first)."""
    points = [{"mode": "full-local", "aggregate_cache_fraction": float(nodes)}]
    points += [{"mode": m, "aggregate_cache_fraction": f} for f in (0.5, 1.0) for m in ("uncoordinated", "partitioned")]
    points += [{"mode": "locality", "aggregate_cache_fraction": 1.0},
               {"mode": "peer-death", "aggregate_cache_fraction": 1.0}]
    points = [p for p in points if p["mode"] in modes]
    runs = []
    for rep in range(reps):
        shift = rep % len(points)
        runs += [{**p, "rep": rep, "nodes": nodes} for p in points[shift:] + points[:shift]]
    return runs


def cache_bytes(fraction: float, sizes: list[int], nodes: int) -> int:
    """Each server's cache for an aggregate ``fraction`` of the dataset; from 100% on, plus the largest item:
    items are not split across servers, so N caches of exactly D/N leave a fragment of each uncached."""
    return int(fraction * sum(sizes) / nodes) + (max(sizes) if fraction >= 1 else 0)


def run_one(point: dict, root: str, device: str, sizes: list[int], args, workdir: str) -> dict:
    """One run of ``point`` on a fresh cluster; its epochs summed over servers, and per-server detail."""
    from harness.cluster import Cluster

    nodes = point["nodes"]
    out = os.path.join(workdir, "out")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    evict_files(root)
    cache = cache_bytes(point["aggregate_cache_fraction"], sizes, nodes)
    job = ["--root", root, "--out", out, "--epochs", args.epochs, "--cache-bytes", cache, "--workers", args.workers,
           "--batch-size", args.batch_size, "--step-s", args.step_ms / 1000, "--sync", "--device", device,
           "--partitioned", "false" if point["mode"] in ("full-local", "uncoordinated") else "true"]
    if point["mode"] == "full-local":
        job.append("--warm-all")
    if point["mode"] == "peer-death":
        job += ["--pause", "3:1"]
    if point["mode"] == "locality":
        job.append("--locality")
    budget = int(args.page_cache_mib * 2**20)
    with Cluster(nodes, os.path.join(workdir, "cluster"), device=device, read_bps=args.read_mbps * 10**6,
                 shm_bytes=2 * cache + 64 * 2**20, page_cache_bytes=budget, shm_reserve_bytes=cache,
                 isolation="netns") as cluster:
        cluster.launch_all(JOB, job, env={"COORDL_PEER_SECRET": secrets.token_hex(16)})
        killed = None
        if point["mode"] == "peer-death":
            killed = _kill_peer_server(cluster, out, nodes)
        codes = cluster.wait(args.run_timeout)
        if codes != [0] * nodes:
            raise RuntimeError(f"{point}: exit codes {codes}\n" + "\n".join(cluster.log(n)[-2000:] for n in range(nodes)))
        left = {n: cluster.shm_left(n) for n in range(nodes) if cluster.shm_left(n)}
    memory = [{k: v for k, v in m.items() if k != "page_cache_series"} for m in cluster.memory]
    servers = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(nodes)]
    for s in servers:
        for e in s["epochs"]:
            del e["samples"], e["batches"]  # the indices: large, and checked by the tests, not here
    epochs = []
    for e in range(args.epochs):
        stats = [s["stats"][e] for s in servers]
        epochs.append({"epoch": e + 1, "time_s": max(s["epochs"][e]["time_s"] for s in servers),
                       "device_read_bytes": sum(s["epochs"][e]["device_read_bytes"] for s in servers),
                       "storage_bytes": sum(st["storage_bytes"] for st in stats),
                       "peer_bytes": sum(st["peer_bytes"] for st in stats),
                       "stall_s": max(st["stall_s"] for st in stats),
                       "longest_wait_s": max(s["epochs"][e]["longest_wait_s"] for s in servers)})
    return {**point, "batch_size": args.batch_size, "epochs": epochs, "killed_peer_server": killed, "shm_left": left,
            "over_budget": [why for why in (over_budget(m, budget) for m in memory) if why],
            "servers": [{"node": s["node"], "cached_bytes": s["cached_bytes"], "peers": s["peers"], "memory": m,
                         "epochs": [{**x, **{k: st[k] for k in ("storage_bytes", "peer_bytes", "stall_s", "hits",
                                                                  "misses", "peer_hits")}}
                                    for x, st in zip(s["epochs"], s["stats"])]} for s, m in zip(servers, memory)]}


def _kill_peer_server(cluster, out: str, nodes: int, timeout: float = 300) -> int:
    """Once every rank paused: SIGKILL server 1's peer server, and let the ranks go on."""
    deadline = time.monotonic() + timeout
    paths = [os.path.join(out, f"paused-rank{r}") for r in range(nodes)]
    while not all(os.path.exists(p) and os.path.getsize(p) for p in paths):
        if time.monotonic() > deadline:
            raise RuntimeError("the ranks never paused:\n" + cluster.log(1)[-2000:])
        time.sleep(0.1)
    pid = json.load(open(paths[1]))["server_pid"]
    os.kill(pid, signal.SIGKILL)
    open(os.path.join(out, "go"), "w").close()
    return pid


def summarize(runs: list[dict], dataset_bytes: int) -> list[dict]:
    """Per mode and aggregate cache: epoch-1 and later-epoch device reads (fractions of the dataset), steady
    epoch time, stall and peer bytes, each a median [min–max] over repetitions; ratios to the references."""
    rows = []
    for key in sorted({(r["mode"], r["aggregate_cache_fraction"]) for r in runs}, key=lambda k: (k[1], k[0])):
        same = [r for r in runs if (r["mode"], r["aggregate_cache_fraction"]) == key]
        later = [e for r in same for e in r["epochs"][1:]]
        steady = [sum(e["time_s"] for e in r["epochs"][1:]) / len(r["epochs"][1:]) for r in same]
        rows.append({"mode": key[0], "aggregate_cache_fraction": key[1],
                     "epoch1_device_fraction": spread([r["epochs"][0]["device_read_bytes"] / dataset_bytes
                                                       for r in same]),
                     "later_device_fraction": spread([e["device_read_bytes"] / dataset_bytes for e in later]),
                     "later_storage_fraction": spread([e["storage_bytes"] / dataset_bytes for e in later]),
                     "later_peer_fraction": spread([e["peer_bytes"] / dataset_bytes for e in later]),
                     "steady_epoch_s": spread(steady),
                     "longest_wait_s": spread([max(e["longest_wait_s"] for e in r["epochs"][1:]) for r in same]),
                     "handed_off_fraction": spread([sum(p.get("handed_off_bytes", 0) for s in r["servers"]
                                                        for p in s["peers"] or ()) / dataset_bytes for r in same]),
                     "page_cache_p99_bytes": max((s["memory"].get("p99_page_cache_bytes", 0) for r in same
                                                  for s in r["servers"] if s.get("memory")), default=None),
                     "over_budget": sum(len(r.get("over_budget", [])) for r in same),
                     "beta": closed_form(same[0]["nodes"], same[0]["batch_size"])
                     if key[0] == "locality" else None})
    reference = next((r["steady_epoch_s"]["median"] for r in rows if r["mode"] == "full-local"), None)
    for row in rows:
        row["vs_full_local"] = row["steady_epoch_s"]["median"] / reference if reference else None
        other = next((r for r in rows if r["mode"] == "uncoordinated" and
                      r["aggregate_cache_fraction"] == row["aggregate_cache_fraction"]), None)
        row["speedup_vs_uncoordinated"] = other["steady_epoch_s"]["median"] / row["steady_epoch_s"]["median"] \
            if other and row["mode"] in ("partitioned", "locality", "peer-death") else None
    return rows


def markdown(rows: list[dict], setup: dict) -> str:
    c = setup["config"]
    lines = [f"# Partitioned caching: {c['nodes']} servers, {setup['dataset_bytes'] / 2**20:.1f} MiB, "
             f"{c['read_mbps']} MB/s per server, {c['reps']} repetition(s)", "",
             f"`{setup['provenance']['command']}` at {setup['provenance']['git_sha']}", "",
             "| mode | aggregate cache | epoch 1 device / D | later epochs device / D | later epochs coordl storage / D "
             "| later peer / D | handed off / D | steady epoch s | × full-local | × faster than uncoordinated "
             "| longest wait s | page cache p99 MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    beta = ""
    for r in rows:
        ratio = lambda v: "–" if v is None else f"{v:.2f}"  # noqa: E731
        page_cache = "–" if r["page_cache_p99_bytes"] is None else f"{r['page_cache_p99_bytes'] / 2**20:.1f}"
        lines.append(f"| {r['mode']} | {r['aggregate_cache_fraction']:.0%} | "
                     f"{report.spread_text(r['epoch1_device_fraction'], '.3f')} | "
                     f"{report.spread_text(r['later_device_fraction'], '.3f')} | "
                     f"{report.spread_text(r['later_storage_fraction'], '.3f')} | "
                     f"{report.spread_text(r['later_peer_fraction'], '.3f')} | "
                     f"{report.spread_text(r['handed_off_fraction'], '.3f')} | "
                     f"{report.spread_text(r['steady_epoch_s'])} | {ratio(r['vs_full_local'])} | "
                     f"{ratio(r['speedup_vs_uncoordinated'])} | {report.spread_text(r['longest_wait_s'])} | "
                     f"{page_cache}{' (over budget)' if r['over_budget'] else ''} |")
        if r["beta"] is not None:
            beta = (f"\nlocality: peer bytes per later epoch {r['later_peer_fraction']['median']:.4f} D against "
                    f"beta = sqrt((1 - 1/p) / (2 pi b)) = {r['beta']:.4f} D (p = {c['nodes']}, b = {c['batch_size']})\n")
    return "\n".join(lines) + "\n" + beta


def plot(runs: list[dict], dataset_bytes: int, path: str) -> str | None:
    """Per epoch: device reads and peer bytes (fractions of the dataset) and epoch time of each mode
    (medians over repetitions)."""
    made = report.axes((14, 4))
    if made is None:
        return None
    plt, fig, ax = made
    fig.clf()
    panels = fig.subplots(1, 3)
    values = (lambda e: e["device_read_bytes"] / dataset_bytes, lambda e: e["peer_bytes"] / dataset_bytes,
              lambda e: e["time_s"])
    for key in sorted({(r["mode"], r["aggregate_cache_fraction"]) for r in runs}):
        same = [r for r in runs if (r["mode"], r["aggregate_cache_fraction"]) == key]
        x = list(range(1, len(same[0]["epochs"]) + 1))
        label = f"{key[0]} {key[1]:.0%}" if key[0] != "full-local" else "full-local"
        for panel, value in zip(panels, values):
            panel.plot(x, [spread([value(r["epochs"][e - 1]) for r in same])["median"] for e in x], marker="o",
                       label=label)
            panel.set_xticks(x)
    for panel, (ylabel, title) in zip(panels, (("device reads, all servers / dataset", "storage read per epoch"),
                                               ("peer bytes, all servers / dataset", "read from peers per epoch"),
                                               ("epoch time (s), slowest server", "epoch time"))):
        panel.set(xlabel="epoch", ylabel=ylabel, title=title)
    panels[2].legend(fontsize=7)
    return report.save(fig, plt, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.partitioned", description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a smaller dataset, 1 repetition")
    parser.add_argument("--files", type=int, default=None, help="default 400 (quick: 200)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--reps", type=int, default=None, help="default 3 (quick: 1)")
    parser.add_argument("--read-mbps", type=float, default=2.0, help="each server's storage bandwidth")
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--page-cache-mib", type=float, default=8.0, help="each server's page-cache budget")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--run-timeout", type=float, default=900)
    parser.add_argument("--workdir", default="/var/tmp")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    args.files = args.files or (200 if args.quick else 400)
    args.reps = args.reps or (1 if args.quick else 3)
    if os.geteuid() != 0:
        print("benchmarks.partitioned needs root (network namespaces, cgroups, a loop device)", file=sys.stderr)
        return 2
    with Cleanup() as cleanup:
        workdir = cleanup.workdir(args.workdir)
        cleanup.shm_folder()  # the path each server's private /dev/shm holds its caches under
        source = os.path.join(workdir, "source")
        sizes = make_dataset(source, args.files)
        dataset_bytes = sum(sizes)
        disk = copy_to_loop_disk(cleanup, workdir, source)
        runs = []
        for i, point in enumerate(plan(args.nodes, args.reps, args.modes)):
            print(f"[{i + 1}] {point['mode']} at {point['aggregate_cache_fraction']:.0%} aggregate cache, "
                  f"rep {point['rep']}", flush=True)
            runs.append(run_one(point, disk.root, disk.device, sizes, args, workdir))
            e = runs[-1]["epochs"]
            print("    " + "  ".join(f"e{x['epoch']}: {x['time_s']:.2f} s, device {x['device_read_bytes'] / 2**20:.1f} "
                                     f"MiB, peers {x['peer_bytes'] / 2**20:.1f} MiB" for x in e), flush=True)
    rows = summarize(runs, dataset_bytes)
    setup = {"machine": report.machine(), "provenance": report.provenance(), "config": vars(args),
             "dataset_bytes": dataset_bytes, "dataset_on": "loop device, one blkio cgroup per server",
             "memory": "each server bounded to what its processes hold plus --page-cache-mib of page cache",
             "servers": "network + mount namespaces (harness/cluster.py), torchrun per server"}
    result = {"dataset_bytes": dataset_bytes, "summary": rows, "runs": runs, "setup": setup}
    text = markdown(rows, setup)
    os.makedirs(args.out, exist_ok=True)
    drawn = plot(runs, dataset_bytes, os.path.join(args.out, "partitioned.png"))
    result["setup"]["plots"] = [os.path.basename(drawn)] if drawn else []
    report.write_json_and_markdown(args.out, result, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
