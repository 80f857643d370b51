"""A dataset in an object store, far away: coordl against torch's DataLoader over s3torchconnector's
``S3MapDataset`` (what users pick today), coordl without its look-ahead, and the same files on local disk.

    python -m benchmarks.objectstore [--quick] [--objects 2000] [--rtt-ms 0 25 50] [--reps 3] [--out DIR]

A real S3 server (``rclone serve s3``, ``harness.s3``) holds ``--objects`` JPEGs of about 100 kB in
``--classes`` prefixes, behind a proxy that holds every chunk ``rtt/2`` in each direction
(``harness.delay_proxy``, in a process of its own: latency, not bandwidth). Each trial builds one loader (2 workers, batches of 32,
shuffled) and runs ``--epochs`` epochs with a stand-in training step of ``--step-ms`` per batch; the
training loop's wait in ``next()`` is the stall. Workloads: ``bytes`` (the objects' bytes, no decode) and
``jpeg`` (decoded and center-cropped, ImageFolder's samples). coordl's cache holds 50% or 100% of the
dataset. Systems, interleaved in every repetition: ``s3map`` (one epoch: it has no cache, every epoch is
the same), ``coordl-nolookahead`` (``lookahead=0``: a batch's misses at once), ``coordl``, ``local``
(torch over the files on local disk, warm in the page cache: the reference). Reports per epoch samples/s,
stall, GETs, bytes, and the first batch's wait against the median batch's. Writes ``results.json`` and
``results.md`` to ``--out``.
"""

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time

SYSTEMS = ("s3map", "coordl-nolookahead", "coordl", "local")
WORKLOADS = ("bytes", "jpeg")
WORKERS, BATCH = 2, 32


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.objectstore", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects", type=int, default=2000)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--rtt-ms", type=float, nargs="+", default=[0, 25, 50])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--cache-fractions", type=float, nargs="+", default=[0.5, 1.0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=10.0, help="the stand-in training step per batch")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="400 objects, 25 ms only, bytes, one repetition")
    parser.add_argument("--out", default="results/objectstore")
    args = parser.parse_args(argv)
    if args.quick:
        args.objects, args.rtt_ms, args.workloads, args.reps = 400, [25.0], ["bytes"], 1
    return args


def _crop(image):
    from torchvision import transforms as T
    return T.Compose([T.CenterCrop(224), T.PILToTensor()])(image)


def _raw(batch):
    return batch


def _decode_crop(raw: bytes):
    from coordl._fetch.raw_datasets import decode_image
    return _crop(decode_image(raw))


class _S3MapSample:
    """What ``S3MapDataset``'s transform makes of an ``S3Reader``: its bytes, or ImageFolder's sample (the
    decoded crop and the class, from the key's prefix)."""

    def __init__(self, workload: str, classes: list[str]):
        self.workload, self.class_of = workload, {name: k for k, name in enumerate(classes)}

    def __call__(self, reader):
        raw = reader.read()
        return raw if self.workload == "bytes" else (_decode_crop(raw), self.class_of[reader.key.split("/")[-2]])


def build(system: str, workload: str, url: str, root: str, endpoint: str, cache_bytes: int, seed: int):
    """The loader of one trial and its dataset's size in objects."""
    import torch
    import torchvision

    import coordl
    generator = torch.Generator().manual_seed(seed)
    collate = _raw if workload == "bytes" else None
    options = dict(batch_size=BATCH, shuffle=True, num_workers=WORKERS, generator=generator,
                   persistent_workers=True, collate_fn=collate)
    if system == "s3map":
        from s3torchconnector import S3MapDataset
        dataset = S3MapDataset.from_prefix(url + "/", region="us-east-1", endpoint=endpoint,
                                           transform=_S3MapSample(workload, sorted(os.listdir(root))))
        return torch.utils.data.DataLoader(dataset, **options)
    if system == "local":
        dataset = torchvision.datasets.ImageFolder(root, transform=_crop) if workload == "jpeg" else \
            coordl.FileDataset(sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs), decode="bytes")
        return torch.utils.data.DataLoader(dataset, **options)
    lookahead = 0 if system == "coordl-nolookahead" else "auto"
    dataset = coordl.ObjectImageFolder(url, transform=_crop, lookahead=lookahead) if workload == "jpeg" else \
        coordl.ObjectDataset(url, lookahead=lookahead)
    return coordl.DataLoader(dataset, cache_bytes=cache_bytes, **options)


def run_epochs(loader, epochs: int, step_s: float, system: str, workload: str) -> list[dict]:
    """Each epoch's samples/s, the loop's waits (stall, first and median batch), GETs and bytes."""
    rows = []
    for _ in range(epochs):
        waits, samples, started = [], 0, time.perf_counter()
        batches = iter(loader)
        while True:
            asked = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                break
            waits.append(time.perf_counter() - asked)
            samples += len(batch) if workload == "bytes" else len(batch[1])  # bytes; or (images, classes)
            time.sleep(step_s)
        took = time.perf_counter() - started
        rows.append({"samples": samples, "time_s": took, "samples_per_s": samples / took, "stall_s": sum(waits),
                     "stall_fraction": sum(waits) / took, "first_wait_s": waits[0],
                     "median_wait_s": statistics.median(waits)})
    stats = getattr(loader, "stats", None)
    if stats is not None:
        for row, epoch in zip(rows, stats().epochs):
            row.update(gets=epoch.gets, get_bytes=epoch.get_bytes, lists=epoch.lists, ahead=epoch.ahead,
                       lookahead_hits=epoch.lookahead_hits, hits=epoch.hits)
    else:  # S3MapDataset GETs each sample; the local files are not in the store
        for row in rows:
            row.update(gets=row["samples"] if system == "s3map" else 0)
    return rows


@contextlib.contextmanager
def bucket(args):
    """A generated JPEG folder on local disk, and the same files as the bucket ``data``, prefix ``train``."""
    from coordl._demo.synthetic import make_image_folder
    folder = tempfile.mkdtemp(prefix="coordl-objectstore-")
    try:
        root = os.path.join(folder, "local")
        make_image_folder(root, args.objects, n_classes=args.classes, mean_side_px=490, seed=0)
        shutil.copytree(root, os.path.join(folder, "store", "data", "train"))
        yield root, os.path.join(folder, "store")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("COORDL_LOG_LEVEL", "WARNING")
    from benchmarks import report
    from harness.delay_proxy import DelayProxyProcess
    from harness.s3 import S3Server

    trials = []
    with bucket(args) as (root, store), S3Server(store, dir_cache_time="1h") as server:
        os.environ.update(server.environ())
        dataset_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
        for rep in range(args.reps):
            for rtt in args.rtt_ms:
                with DelayProxyProcess(("127.0.0.1", server.port), rtt / 2000) as proxy:
                    endpoint = f"http://127.0.0.1:{proxy.port}"
                    os.environ["AWS_ENDPOINT_URL"] = endpoint
                    for workload in args.workloads:
                        turn = rep % len(args.systems)
                        for system in args.systems[turn:] + args.systems[:turn]:
                            fractions = args.cache_fractions if system.startswith("coordl") else [None]
                            for fraction in fractions:
                                cache = 0 if fraction is None else int(fraction * dataset_bytes) + 2**20 * (fraction >= 1)
                                loader = build(system, workload, "s3://data/train", root, endpoint, cache, rep)
                                epochs = 1 if system == "s3map" else args.epochs
                                rows = run_epochs(loader, epochs, args.step_ms / 1000, system, workload)
                                if hasattr(loader, "close"):
                                    loader.close()
                                del loader
                                trial = {"rep": rep, "rtt_ms": rtt, "workload": workload, "system": system,
                                         "cache_fraction": fraction, "epochs": rows}
                                trials.append(trial)
                                print(f"rep {rep + 1} rtt={rtt:g}ms {workload:<5} {system:<18} cache={fraction} " +
                                      " ".join(f"{r['samples_per_s']:.0f}/s stall={r['stall_fraction']:.0%} "
                                               f"gets={r['gets']}" for r in rows), flush=True)
    result = {"trials": trials, "points": points(trials), "dataset_bytes": dataset_bytes}
    setup = {"machine": report.machine(), "provenance": report.provenance(), "config": vars(args)}
    text = markdown(result, args)
    report.write_json_and_markdown(args.out, {**result, "setup": setup}, text)
    print("\n" + text)
    return 0


def points(trials: list[dict]) -> list[dict]:
    """Per (RTT, workload, system, cache fraction, epoch): the spread over repetitions of each figure, and
    coordl's epoch-1 rate over S3MapDataset's and over its own at 0 ms."""
    from benchmarks.metrics import spread
    keys = sorted({(t["rtt_ms"], t["workload"], t["system"], t["cache_fraction"] or 0) for t in trials})
    out = []
    for rtt, workload, system, fraction in keys:
        runs = [t for t in trials if (t["rtt_ms"], t["workload"], t["system"], t["cache_fraction"] or 0) ==
                (rtt, workload, system, fraction)]
        for e in range(len(runs[0]["epochs"])):
            point = {"rtt_ms": rtt, "workload": workload, "system": system, "cache_fraction": fraction or None,
                     "epoch": e + 1}
            for field in ("samples_per_s", "stall_fraction", "gets", "first_wait_s", "median_wait_s"):
                point[field] = spread([r["epochs"][e][field] for r in runs])
            point["first_over_median"] = spread([r["epochs"][e]["first_wait_s"] / max(r["epochs"][e]["median_wait_s"],
                                                                                       1e-6) for r in runs])
            out.append(point)
    by = {(p["rtt_ms"], p["workload"], p["system"], p["cache_fraction"], p["epoch"]): p for p in out}
    for p in out:
        if p["system"].startswith("coordl") and p["epoch"] == 1:
            s3map = by.get((p["rtt_ms"], p["workload"], "s3map", None, 1))
            near = by.get((0.0, p["workload"], p["system"], p["cache_fraction"], 1))
            if s3map:
                p["over_s3map"] = p["samples_per_s"]["median"] / s3map["samples_per_s"]["median"]
            if near:
                p["over_own_at_0ms"] = p["samples_per_s"]["median"] / near["samples_per_s"]["median"]
    return out


def markdown(result: dict, args) -> str:
    from benchmarks import report
    lines = [f"{args.objects} objects ({result['dataset_bytes'] / 2**20:.0f} MiB) in {args.classes} prefixes, "
             f"{WORKERS} workers, batches of {BATCH}, a {args.step_ms:g} ms step, {args.reps} repetitions "
             f"(median [min–max]).", "",
             "| RTT ms | workload | system | cache | epoch | samples/s | stall | GETs | first / median wait | "
             "× S3MapDataset | × own at 0 ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in result["points"]:
        cache = "–" if p["cache_fraction"] is None else f"{p['cache_fraction']:.0%}"
        ratio = lambda key: f"{p[key]:.2f}" if key in p else ""  # noqa: E731
        lines.append(f"| {p['rtt_ms']:g} | {p['workload']} | {p['system']} | {cache} | {p['epoch']} | "
                     f"{report.spread_text(p['samples_per_s'], '.0f')} | {report.spread_text(p['stall_fraction'], '.2f')} | "
                     f"{report.spread_text(p['gets'], '.0f')} | {report.spread_text(p['first_over_median'], '.1f')} | "
                     f"{ratio('over_s3map')} | {ratio('over_own_at_0ms')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
