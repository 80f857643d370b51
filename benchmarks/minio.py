"""The paper's single-server result on really throttled storage: page cache against MinIO.

    python -m benchmarks.minio [--quick] [--out DIR] [--storage auto|cgroup|emulated] [--data DIR] ...

Generates an ImageNet-like dataset on disk (or uses ``--data``) and runs every system (torch's
DataLoader, DALI-seq, DALI-shuffle, coordl, coordl with DALI) at every cache fraction for a few
epochs, each in its own child process with the same memory budget for its cache: for the page
cache of torch and DALI, for the MinIO cache of coordl. Reads from the dataset's disk are throttled
to ``--read-mbps`` and counted by the kernel (cgroup mode, as root) or by an emulated disk
(emulated mode). Writes ``results.json``, ``results.md`` and plots into ``--out``; see
docs/benchmarks.md.
"""

import argparse
import json
import os
import sys
import tempfile

from benchmarks import cache_sim, metrics, report
from benchmarks.storage_env import HEADROOM_BYTES, PREFIX, Cleanup, choose_mode, evict_files, run_child
from benchmarks.systems import COORDL_SYSTEMS, SYSTEMS, child_command, skip_reason

MODES = {
    "quick": dict(images=1200, fractions=[0.5, 1.0], epochs=3, read_mbps=10.0),
    "full": dict(images=5000, fractions=[0.35, 0.5, 0.65, 1.0], epochs=4, read_mbps=15.0),
}
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.minio", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="cache fractions 0.5 and 1.0, a small dataset: minutes")
    parser.add_argument("--out", default="results/minio", help="where results go (default: results/minio)")
    parser.add_argument("--storage", choices=("auto", "cgroup", "emulated"), default="auto",
                        help="cgroup: real throttled disk and memory limit (root); default: cgroup if possible")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--images", type=int, help="dataset size (quick: 1200, full: 5000)")
    parser.add_argument("--fractions", type=float, nargs="+", help="cache fractions (quick: 0.5 1.0)")
    parser.add_argument("--epochs", type=int, help="epochs per run (quick: 3, full: 4)")
    parser.add_argument("--read-mbps", type=float, help="disk read bandwidth, MB/s (quick: 10, full: 15)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2, help="loader worker processes / DALI threads")
    parser.add_argument("--compute-ms", type=float, default=20.0, help="training stand-in: compute per batch")
    parser.add_argument("--mean-side-px", type=int, default=490, help="generated images' mean longer side")
    parser.add_argument("--data", help="use this ImageFolder tree (on a real disk) instead of generating one")
    parser.add_argument("--workdir", default="/var/tmp", help="where the generated dataset goes (a real disk)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for key, value in MODES["quick" if args.quick else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def _remove_caches(tag: str) -> None:
    """Remove the coordl caches this run created (named after ``tag``), also if a child was killed."""
    from coordl.minio_cache import list_caches, remove_cache

    for stats in list_caches():
        if getattr(stats, "label", "").startswith(tag):  # (caches of other versions have none)
            remove_cache(stats.name, force=True)


class Bench:
    """One benchmark run: the storage environment it set up, and how it runs a system in it."""

    def __init__(self, args, cleanup: Cleanup, root: str, sizes: list[int], tag: str):
        self.args, self.cleanup, self.root, self.tag = args, cleanup, root, tag
        self.mode, self.cgroup_version, self.device, self.detail = choose_mode(args.storage, root)
        self.bandwidth = int(args.read_mbps * 10**6)
        self.dataset_bytes = sum(sizes)
        # The page cache holds whole pages: a page-cache budget is a fraction of this (a few % more).
        self.dataset_page_bytes = sum(-(-size // PAGE_BYTES) * PAGE_BYTES for size in sizes)
        self.store = None
        if self.mode == "emulated":
            from coordl.emulated_store import EmulatedStore

            socket_dir = cleanup.workdir(tempfile.gettempdir())  # a short path: socket names are limited
            self.store = EmulatedStore(os.path.join(socket_dir, "store.sock"), self.bandwidth, 0)
            cleanup.callback(self.store.close)

    def warm_up(self, system: str, root: str) -> None:
        """Run ``system`` once over the small dataset at ``root``, outside any measured cgroup, so that
        the libraries and code it loads are in the page cache and charged elsewhere: a measured
        run then neither reads them through the throttle nor counts them against its budget."""
        if self.mode != "cgroup":
            return
        spec = dict(system=system, root=root, epochs=1, batch_size=self.args.batch_size, workers=self.args.workers,
                    compute_ms=0, cache_bytes=2**20 if system in COORDL_SYSTEMS else 0,
                    cache_name=f"{self.tag}-{system}-warm-up", seed=self.args.seed, store_socket=None,
                    counter={"kind": "none"})
        proc, _ = run_child(child_command(spec), 600)
        if proc.returncode != 0:
            raise RuntimeError(f"{system} failed to warm up (exit {proc.returncode}):\n{proc.stderr[-3000:]}")

    def run(self, system: str, cache_fraction: float) -> dict:
        """Run ``system`` from a cold page cache with a memory budget of ``cache_fraction`` of the
        dataset: its page cache (torch, DALI; of the dataset in whole pages) or its MinIO cache
        (coordl). Returns its ``runs`` entry.

        Raises:
            RuntimeError: the run failed (with its stderr).
        """
        coordl_cache = system in COORDL_SYSTEMS
        budget = int(cache_fraction * self.dataset_bytes)
        page_cache = 0 if coordl_cache else int(cache_fraction * self.dataset_page_bytes)
        label = f"{system}-{round(cache_fraction * 100)}"
        spec = dict(system=system, root=self.root, epochs=self.args.epochs, batch_size=self.args.batch_size,
                    workers=self.args.workers, compute_ms=self.args.compute_ms,
                    cache_bytes=budget if coordl_cache else 0, cache_name=f"{self.tag}-{label}",
                    seed=self.args.seed, store_socket=None)
        group = None
        if self.mode == "cgroup":
            evict_files(self.root)
            group = self.cleanup.cgroup(f"{self.tag}-{label}", self.cgroup_version, self.device, self.bandwidth,
                                        page_cache, shm_reserve_bytes=spec["cache_bytes"])
            spec["counter"] = group.counter()
        else:
            self.store.reset(page_cache)
            spec.update(store_socket=self.store.socket_path,
                        counter={"kind": "emulated", "socket": self.store.socket_path})
        timeout = 120 + 4 * self.args.epochs * self.dataset_bytes / self.bandwidth
        proc, memory = run_child(child_command(spec), timeout, group)
        if group is not None:
            group.remove()
        if proc.returncode != 0:
            raise RuntimeError(f"{system} at cache {cache_fraction:.0%} failed (exit {proc.returncode}):\n"
                               f"{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        return {"system": system, "cache_fraction": cache_fraction, "page_cache_budget_bytes": page_cache,
                "cache_budget_bytes": spec["cache_bytes"], "memory": memory,
                "build_s": next(r["build_s"] for r in rows if "build_s" in r),
                "cache": next((r["cache"] for r in rows if "cache" in r), None),
                "epochs": [r for r in rows if "epoch" in r]}


def main(argv=None) -> int:
    args = parse_args(argv)
    from coordl.synthetic import make_image_folder

    tag = f"{PREFIX}-{os.getpid()}"
    with Cleanup() as cleanup:
        cleanup.callback(_remove_caches, tag)
        work = cleanup.workdir(args.workdir)
        root = args.data or os.path.join(work, "train")
        if not args.data:
            print(f"generating {args.images} JPEGs in {root} ...", flush=True)
            make_image_folder(root, args.images, mean_side_px=args.mean_side_px, seed=args.seed)
        import torchvision

        sizes = [os.path.getsize(path) for path, _ in torchvision.datasets.ImageFolder(root).samples]
        bench = Bench(args, cleanup, root, sizes, tag)
        print(f"storage: {bench.mode} ({bench.detail}); dataset {len(sizes)} files, "
              f"{bench.dataset_bytes / 2**20:.1f} MiB; bandwidth {args.read_mbps} MB/s", flush=True)

        skipped = {s: why for s in args.systems if (why := skip_reason(s, bench.mode))}
        for system, why in skipped.items():
            print(f"{system}: skipped ({why})", flush=True)
        warm_up_root = os.path.join(work, "warm-up")
        make_image_folder(warm_up_root, 2 * args.batch_size, mean_side_px=args.mean_side_px, seed=args.seed + 1)
        broken = {}
        for system in (s for s in args.systems if s not in skipped):
            try:
                bench.warm_up(system, warm_up_root)
            except RuntimeError as e:
                broken[system] = str(e)
                print(f"{system}: FAILED\n{e}", flush=True)
        runs = []
        for fraction in args.fractions:
            for system in args.systems:
                if system in skipped or system in broken:
                    why = {"skipped": skipped[system]} if system in skipped else {"error": broken[system]}
                    runs.append({"system": system, "cache_fraction": fraction, **why, "epochs": []})
                    continue
                print(f"{system} at cache {fraction:.0%} ...", flush=True)
                try:
                    run = bench.run(system, fraction)
                except RuntimeError as e:
                    runs.append({"system": system, "cache_fraction": fraction, "error": str(e), "epochs": []})
                    print(f"  FAILED\n{e}", flush=True)
                    continue
                metrics.add_hits(run, sizes)
                runs.append(run)
                for e in run["epochs"]:
                    print(f"  epoch {e['epoch']}: {e['time_s']:.2f} s, {e['device_read_bytes'] / 2**20:.1f} MiB "
                          f"from the device, hits {e['hits']}, stall {e['stall_s']:.2f} s", flush=True)

        metrics.summarize(runs, bench.dataset_bytes, bench.bandwidth, args.compute_ms)
        result = {"storage_mode": bench.mode, "dataset_bytes": bench.dataset_bytes,
                  "bandwidth_bytes_per_s": bench.bandwidth, "runs": runs}
        setup = {"storage_detail": bench.detail, "machine": report.machine(),
                 "config": {"images": len(sizes), "mode": "quick" if args.quick else "full", "epochs": args.epochs,
                            "cache_fractions": args.fractions, "systems": args.systems,
                            "batch_size": args.batch_size, "workers": args.workers, "compute_ms": args.compute_ms,
                            "seed": args.seed, "memory_headroom_bytes": HEADROOM_BYTES},
                 "cache_sim": cache_sim.simulate_all(args.fractions, args.epochs, sizes=sizes, seed=args.seed)}
        written = report.write(result, setup, args.out)
        print("\n" + report.markdown(result, setup))
        print("wrote " + ", ".join(written) + (f" ({report.NO_PLOTS})" if setup["plots"] == report.NO_PLOTS else ""))
        return 1 if any("error" in r for r in runs) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
