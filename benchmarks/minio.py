"""The paper's single-server result on really throttled storage: page cache against MinIO.

    python -m benchmarks.minio [--quick] [--out DIR] [--storage auto|cgroup|emulated] [--data DIR] ...

Generates an ImageNet-like dataset on disk (or uses ``--data``) and runs every system (torch's
DataLoader, DALI-seq, DALI-shuffle, coordl, coordl with DALI) at every cache fraction for a few
epochs, each in its own child process with the same memory budget for its cache: for the page
cache of torch and DALI, for the MinIO cache of coordl. Reads of the dataset are throttled to
``--read-mbps`` and counted by the kernel (cgroup mode, as root: the dataset on a loop device of
its own, else on its whole disk) or by an emulated disk (emulated mode). A system that fails or
runs past its time limit is recorded with its error, and the others still run. Writes
``results.json``, ``results.md`` and plots into ``--out``; see docs/benchmarks.md.
"""

import argparse
import json
import os
import sys
import tempfile

from benchmarks import cache_sim, metrics, report
from harness.storage_env import (BUDGET_TOLERANCE, FOLLOW_WINDOW_S, HEADROOM_BYTES, PREFIX, SLACK_BYTES,
                                    ChildResult, Cleanup, Storage, evict_files, over_budget, prepare_storage,
                                    run_child, tree_bytes, warm_files)
from benchmarks.systems import COORDL_SYSTEMS, PREP_SYSTEMS, SYSTEMS, child_command, skip_reason

MODES = {
    "quick": dict(images=1200, fractions=[0.5, 1.0], epochs=3, read_mbps=10.0),
    "full": dict(images=5000, fractions=[0.35, 0.5, 0.65, 1.0], epochs=4, read_mbps=15.0),
}
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
STARTUP_S = 60.0
"""A child's start: interpreter, imports, building the loader (DALI's pipeline), starting workers."""
PREP_BYTES_PER_S = 10e6
"""A low estimate of the prep rate (JPEG decode + augmentation): ~45 MB/s was measured with 2
workers on 2 cores."""
TIMEOUT_MARGIN = 2.0
WARM_UP_BATCHES = 2


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.minio", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="cache fractions 0.5 and 1.0, a small dataset: minutes")
    parser.add_argument("--out", default="results/minio", help="where results go (default: results/minio)")
    parser.add_argument("--storage", choices=("auto", "cgroup", "emulated"), default="auto",
                        help="cgroup: the dataset on a throttled loop device (else its whole disk) and a memory "
                             "limit (root); default: cgroup if possible")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--images", type=int, help="dataset size (quick: 1200, full: 5000)")
    parser.add_argument("--fractions", type=float, nargs="+", help="cache fractions (quick: 0.5 1.0)")
    parser.add_argument("--epochs", type=int, help="epochs per run (quick: 3, full: 4)")
    parser.add_argument("--read-mbps", type=float, help="disk read bandwidth, MB/s (quick: 10, full: 15)")
    parser.add_argument("--read-iops", type=int,
                        help="disk read requests per second (cgroup mode; default: no limit)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2, help="loader worker processes / DALI threads")
    parser.add_argument("--compute-ms", type=float, default=20.0, help="training stand-in: compute per batch")
    parser.add_argument("--mean-side-px", type=int, default=490, help="generated images' mean longer side")
    parser.add_argument("--data", help="use (a copy of) this ImageFolder tree instead of generating one")
    parser.add_argument("--workdir", default="/var/tmp",
                        help="where the generated dataset and the loop device's image go (a real disk)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reps", type=int, default=3,
                        help="repetitions of every system and cache fraction, interleaved (default: 3)")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps should be at least 1, but got {args.reps}")
    if args.read_iops is not None and (args.read_iops < 1 or args.storage == "emulated"):
        parser.error(f"--read-iops should be a positive number of requests per second, in cgroup mode (the emulated "
                     f"store models bandwidth only), but got --read-iops {args.read_iops} --storage {args.storage}")
    for key, value in MODES["quick" if args.quick else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def _remove_caches(tag: str) -> None:
    """Remove the coordl caches this run created (named after ``tag``), also if a child was killed."""
    from coordl._cache.minio import list_caches, remove_cache

    for stats in list_caches():
        if getattr(stats, "label", "").startswith(tag):  # (caches of other versions have none)
            remove_cache(stats.name, force=True)


def child_timeout(epochs: int, dataset_bytes: int, read_bps: float | None, batches: int,
                  compute_s: float, read_seconds_by_iops: float = 0.0) -> tuple[float, str]:
    """Seconds a child may run, and how they were derived: its start-up, then per epoch the whole
    dataset read through the throttle (``read_bps``; None: not throttled; or the read requests at the
    IOPS limit, ``read_seconds_by_iops``, if that takes longer) and prepped, and the compute of every
    batch; times a margin."""
    read = max(dataset_bytes / read_bps if read_bps else 0.0, read_seconds_by_iops)
    prep, compute = dataset_bytes / PREP_BYTES_PER_S, batches * compute_s
    total = TIMEOUT_MARGIN * (STARTUP_S + epochs * (read + prep + compute))
    return total, (f"{total:.0f} s = {TIMEOUT_MARGIN:g} × ({STARTUP_S:.0f} s start-up + {epochs} epochs × "
                   f"({read:.1f} s reading + {prep:.1f} s prep + {compute:.1f} s compute))")


READ_REQUEST_BYTES = 128 * 1024
"""The largest read request a file's read is split into, as the readahead window (for the time limit)."""


class RunFailed(Exception):
    """A system's child failed or timed out; ``record`` (error, stderr_tail) goes into its ``runs`` entry."""

    def __init__(self, what: str, result: ChildResult, limit: str):
        how = f"timed out after {limit}" if result.timed_out else f"failed (exit {result.returncode})"
        self.record = {"error": f"{what} {how}", "stderr_tail": result.stderr[-3000:]}
        super().__init__(f"{self.record['error']}; its stderr ends:\n{self.record['stderr_tail']}")


class Bench:
    """One benchmark run: the storage environment it set up, and how it runs a system in it."""

    def __init__(self, args, cleanup: Cleanup, storage: Storage, sizes: list[int], tag: str):
        self.args, self.cleanup, self.storage, self.tag = args, cleanup, storage, tag
        self.bandwidth = int(args.read_mbps * 10**6)
        self.dataset_bytes, self.batches = sum(sizes), -(-len(sizes) // args.batch_size)
        self.read_requests = sum(1 + size // READ_REQUEST_BYTES for size in sizes)
        # The page cache holds whole pages: a page-cache budget is a fraction of this (a few % more).
        self.dataset_page_bytes = sum(-(-size // PAGE_BYTES) * PAGE_BYTES for size in sizes)
        self.store = None
        if storage.mode == "emulated":
            from coordl._demo.emulated_store import EmulatedStore

            socket_dir = cleanup.workdir(tempfile.gettempdir())  # a short path: socket names are limited
            self.store = EmulatedStore(os.path.join(socket_dir, "store.sock"), self.bandwidth, 0)
            cleanup.callback(self.store.close)

    def _run_child(self, what: str, spec: dict, limit: tuple[float, str], group=None) -> ChildResult:
        """Run the child for ``spec`` for at most ``limit`` (seconds, how derived); then remove its
        cgroup and its coordl cache, whatever happened.

        Raises:
            RunFailed: it failed or timed out.
        """
        try:
            result = run_child(child_command(spec), limit[0], group)
        finally:
            if group is not None:
                group.remove()
            _remove_caches(spec["cache_name"])
        if result.returncode != 0:
            raise RunFailed(what, result, limit[1])
        return result

    def warm_up(self, system: str, root: str, root_bytes: int) -> None:
        """Run ``system`` once over the small dataset at ``root`` (``root_bytes``, on the real disk),
        outside any measured cgroup, so that the libraries and code it loads are in the page cache
        and charged elsewhere: a measured run then does not count them against its budget.

        Raises:
            RunFailed: it failed or timed out.
        """
        if self.storage.mode != "cgroup":
            return
        spec = dict(system=system, root=root, epochs=1, batch_size=self.args.batch_size, workers=self.args.workers,
                    compute_ms=0, cache_bytes=2**20 if system in COORDL_SYSTEMS else 0,
                    cache_name=f"{self.tag}-{system}-warm-up", seed=self.args.seed, store_socket=None,
                    counter={"kind": "none"})
        limit = child_timeout(1, root_bytes, None, WARM_UP_BATCHES, 0)
        print(f"{system}: warm-up, time limit {limit[1]}", flush=True)
        self._run_child(f"{system} warm-up", spec, limit)

    def run(self, system: str, cache_fraction: float, rep: int) -> dict:
        """Run ``system`` from a cold page cache with a memory budget of ``cache_fraction`` of the
        dataset: its page cache (torch, DALI; of the dataset in whole pages) or its MinIO cache
        (coordl). Returns its ``runs`` entry (for repetition ``rep``), with an ``error`` if its page
        cache broke its budget (:func:`~harness.storage_env.over_budget`).

        At cache fraction 1.0 (cgroup mode) the run compares prep, not storage: the dataset is in
        the page cache from the start and memory is not bounded, for every system (coordl's epoch 1
        fills its cache from the page cache).

        Raises:
            RunFailed: it failed or timed out.
        """
        coordl_cache = system in COORDL_SYSTEMS
        budget = int(cache_fraction * self.dataset_bytes)
        page_cache = 0 if coordl_cache else int(cache_fraction * self.dataset_page_bytes)
        label = f"{system}-{round(cache_fraction * 100)}-{rep}"
        spec = dict(system=system, root=self.storage.root, epochs=self.args.epochs, batch_size=self.args.batch_size,
                    workers=self.args.workers, compute_ms=self.args.compute_ms,
                    cache_bytes=budget if coordl_cache else 0, cache_name=f"{self.tag}-{label}",
                    seed=self.args.seed, store_socket=None)
        group = None
        if self.storage.mode == "cgroup":
            warm = cache_fraction >= 1.0
            if warm:
                warm_files(self.storage.root)
                page_cache = None
            else:
                evict_files(self.storage.root)
            group = self.cleanup.cgroup(f"{self.tag}-{label}", self.storage.cgroup_version, self.storage.device,
                                        self.bandwidth, page_cache, shm_reserve_bytes=spec["cache_bytes"],
                                        read_iops=self.args.read_iops)
            spec["counter"] = group.counter()
        else:
            self.store.reset(page_cache)
            spec.update(store_socket=self.store.socket_path,
                        counter={"kind": "emulated", "socket": self.store.socket_path})
        limit = child_timeout(self.args.epochs, self.dataset_bytes, self.bandwidth, self.batches,
                              self.args.compute_ms / 1000, self.read_requests / self.args.read_iops
                              if self.args.read_iops else 0.0)
        print(f"  time limit {limit[1]}", flush=True)
        result = self._run_child(f"{system} at cache {cache_fraction:.0%}", spec, limit, group)
        rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
        run = {"system": system, "cache_fraction": cache_fraction, "rep": rep, "page_cache_budget_bytes": page_cache,
               "cache_budget_bytes": spec["cache_bytes"], "time_limit_s": limit[0], "memory": result.memory,
               **next({k: r[k] for k in ("build_s", "build_device_read_bytes")} for r in rows if "build_s" in r),
               "cache": next((r["cache"] for r in rows if "cache" in r), None),
               "epochs": [r for r in rows if "epoch" in r]}
        why = over_budget(result.memory, page_cache) if page_cache is not None else None
        if why:
            run["error"] = f"{system} at cache {cache_fraction:.0%}: {why}"
        return run


def run_order(reps: int, fractions: list[float], systems: list[str]) -> list[tuple[int, float, str]]:
    """(repetition, cache fraction, system) in the order they run: each repetition runs every point
    once, so that drift on the machine spreads over all systems; the systems' order rotates by one
    place per repetition, so that none always runs first or after the same neighbour. At cache
    fraction 1.0 the prep rates the systems' bounds need (:data:`~benchmarks.metrics.PREP_REFERENCE`)
    are measured too."""
    order = []
    for rep in range(reps):
        for fraction in fractions:
            points = list(systems)
            if fraction >= 1.0:
                points += list(dict.fromkeys(metrics.PREP_REFERENCE[s] for s in systems if s not in PREP_SYSTEMS))
            shift = rep % len(points)
            order += [(rep, fraction, system) for system in points[shift:] + points[:shift]]
    return order


def main(argv=None) -> int:
    args = parse_args(argv)
    from coordl._demo.synthetic import make_image_folder

    tag = f"{PREFIX}-{os.getpid()}"
    load_at_start = os.getloadavg()
    with Cleanup() as cleanup:
        cleanup.callback(_remove_caches, tag)
        work = cleanup.workdir(args.workdir)
        source = args.data or os.path.join(work, "train")
        if not args.data:
            print(f"generating {args.images} JPEGs in {source} ...", flush=True)
            make_image_folder(source, args.images, mean_side_px=args.mean_side_px, seed=args.seed)
        storage = prepare_storage(args.storage, source, cleanup, work)
        if args.read_iops and storage.mode != "cgroup":
            print(f"--read-iops needs cgroup mode, but the storage is {storage.mode} ({storage.detail})", flush=True)
            return 2
        import torchvision

        sizes = [os.path.getsize(path) for path, _ in torchvision.datasets.ImageFolder(storage.root).samples]
        bench = Bench(args, cleanup, storage, sizes, tag)
        print(f"storage: {storage.mode}, dataset on {storage.dataset_on} ({storage.detail}); dataset {len(sizes)} "
              f"files, {bench.dataset_bytes / 2**20:.1f} MiB; bandwidth {args.read_mbps} MB/s"
              + (f", {args.read_iops} read requests/s" if args.read_iops else ""), flush=True)

        order = run_order(args.reps, args.fractions, args.systems)
        everything = list(dict.fromkeys(system for _, _, system in order))
        skipped = {s: why for s in everything if (why := skip_reason(s, storage.mode))}
        for system, why in skipped.items():
            print(f"{system}: skipped ({why})", flush=True)
        warm_up_root = os.path.join(work, "warm-up")
        make_image_folder(warm_up_root, WARM_UP_BATCHES * args.batch_size, mean_side_px=args.mean_side_px,
                          seed=args.seed + 1)
        broken = {}
        for system in (s for s in everything if s not in skipped):
            try:
                bench.warm_up(system, warm_up_root, tree_bytes(warm_up_root))
            except RunFailed as e:
                broken[system] = e.record
                print(f"{system}: FAILED: {e}", flush=True)
        runs = []
        for rep, fraction, system in order:
            where = f"{system} at cache {fraction:.0%}, repetition {rep + 1} of {args.reps}"
            if system in skipped or system in broken:
                why = {"skipped": skipped[system]} if system in skipped else broken[system]
                runs.append({"system": system, "cache_fraction": fraction, "rep": rep, **why, "epochs": []})
                continue
            print(f"{where} ...", flush=True)
            try:
                run = bench.run(system, fraction, rep)
            except RunFailed as e:
                runs.append({"system": system, "cache_fraction": fraction, "rep": rep, **e.record, "epochs": []})
                print(f"  FAILED: {e}", flush=True)
                continue
            metrics.add_hits(run, sizes)
            runs.append(run)
            print(f"  built in {run['build_s']:.2f} s, {run['build_device_read_bytes'] / 2**20:.1f} MiB from the "
                  f"device; page cache p99 {run['memory'].get('p99_page_cache_bytes', 0) / 2**20:.1f} MiB", flush=True)
            for e in run["epochs"]:
                print(f"  epoch {e['epoch']}: {e['time_s']:.2f} s, {e['device_read_bytes'] / 2**20:.1f} MiB "
                      f"from the device, hits {e['hits']}, stall {e['stall_s']:.2f} s", flush=True)
            if "error" in run:
                print(f"  FAILED: {run['error']}", flush=True)

        comparisons = metrics.summarize(runs, bench.dataset_bytes, bench.bandwidth, args.compute_ms)
        result = {"storage_mode": storage.mode, "dataset_on": storage.dataset_on, "dataset_device": storage.device,
                  "dataset_bytes": bench.dataset_bytes, "bandwidth_bytes_per_s": bench.bandwidth, "runs": runs,
                  "comparisons": comparisons}
        setup = {"storage_detail": storage.detail, "machine": report.machine(), "provenance": {
                     **report.provenance(), "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg()},
                 "config": {**vars(args), "images": len(sizes), "mode": "quick" if args.quick else "full",
                            "memory_headroom_bytes": HEADROOM_BYTES, "memory_slack_bytes": SLACK_BYTES,
                            "memory_follow_window_s": FOLLOW_WINDOW_S, "budget_tolerance": BUDGET_TOLERANCE,
                            "run_order": "repetitions outermost; in each, cache fractions, then systems rotated "
                                         "by one place per repetition"},
                 "cache_sim": cache_sim.simulate_all(args.fractions, args.epochs, sizes=sizes, seed=args.seed)}
        written = report.write(result, setup, args.out)
        print("\n" + report.markdown(result, setup))
        print("wrote " + ", ".join(written) + (f" ({report.NO_PLOTS})" if setup["plots"] == report.NO_PLOTS else ""))
        failed = [r for r in runs if "error" in r]
        if failed:
            print(f"{len(failed)} of {len(runs)} runs FAILED: "
                  + ", ".join(f"{r['system']} at {r['cache_fraction']:.0%}" for r in failed), flush=True)
        return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
