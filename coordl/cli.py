"""The ``coordl`` command: ``coordl demo``, ``coordl analyze``, ``coordl whatif``, ``coordl cache ls|rm`` (shared
memory and disk caches),
``coordl group ls|rm``."""

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

from coordl import coord_prep, minio_cache
from coordl._core import settings
from coordl._disk.cache import USERS
from coordl._disk.folder import DiskCacheInfo, list_disk_caches, remove_disk_cache
from coordl._core.shm import Unreadable, segment_path, shm_dir
from coordl._core.sizes import format_bytes, parse_size_option


def _print_unreadable(found: list) -> None:
    for item in found:
        if isinstance(item, Unreadable):
            print(f"{item.name}  ({item.why})")


def _memory_used(name: str) -> int | None:
    """Bytes of memory segment ``name`` really holds (a cache's file is sparse: its size is its capacity)."""
    try:
        return os.stat(segment_path(name)).st_blocks * 512
    except OSError:
        return None


def _mapping_processes(names: list[str]) -> dict[str, list[str]]:
    """``{segment: ["pid (command)", ...]}``: the processes that map each of ``names``, found by the file's
    device and inode in ``/proc/*/maps`` (those this user may read; a segment is mapped under the name it
    was created with, so its path there is not its name)."""
    files = {}
    for name in names:
        try:
            st = os.stat(segment_path(name))
        except OSError:
            continue
        files[(f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}", str(st.st_ino))] = name
    found: dict[str, list[str]] = {n: [] for n in names}
    for pid in sorted((p for p in os.listdir("/proc") if p.isdigit()), key=int):
        try:
            with open(f"/proc/{pid}/maps") as f:
                mapped = {tuple(fields[3:5]) for fields in (line.split() for line in f) if len(fields) >= 6}
            with open(f"/proc/{pid}/comm") as f:
                command = f.read().strip()
        except OSError:  # gone, or another user's
            continue
        for key in mapped & set(files):
            found[files[key]].append(f"{pid} ({command})")
    return found


def _cache_ls(args) -> int:
    found = minio_cache.list_caches()
    if args.cache_dir:
        _disk_ls(args.cache_dir)
    if not found:
        print(f"no coordl caches in {shm_dir()}")
        return 0
    caches = [c for c in found if not isinstance(c, Unreadable)]
    if caches:
        print(f"{'name':<24}{'items':>16}{'cached':>24}{'in memory':>12}{'frozen':>8}{'users':>7}  dataset")
    holders = _mapping_processes([c.name for c in caches])
    for c in caches:
        items = f"{c.items_cached}/{c.n_items}"
        size = f"{format_bytes(c.bytes_cached)}/{format_bytes(c.capacity_bytes)}"
        used = _memory_used(c.name)
        state = "stale" if c.users_alive == 0 else str(c.users_alive)
        role = f" [partitioned: server {c.partition[0]} of {c.partition[1]}]" if c.partition else ""
        print(f"{c.name:<24}{items:>16}{size:>24}{format_bytes(used) if used is not None else '-':>12}"
              f"{'yes' if c.frozen else 'no':>8}{state:>7}  {c.label}{role}")
        if holders[c.name]:
            print(f"{'':<24}mapped by {', '.join(holders[c.name])}")
    if caches:
        print("cached: the samples' bytes / the capacity; in memory: what the segment holds now (its file in "
              f"{shm_dir()} is sparse, so `ls` shows the capacity)")
    _print_unreadable(found)
    return 0


def _disk_users(folder: str) -> int | None:
    """How many processes have the disk cache in ``folder`` open: those holding its users lock, from
    ``/proc/locks`` (which names each lock's file by device and inode); None where it cannot be read."""
    try:
        st = os.stat(os.path.join(folder, USERS))
        with open("/proc/locks") as f:
            lines = [line.split() for line in f]
    except OSError:
        return None
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return sum(1 for fields in lines if "FLOCK" in fields and inode in fields)


def _disk_ls(cache_dir: str) -> None:
    """The disk caches in ``cache_dir`` (read only)."""
    caches = list_disk_caches(cache_dir)
    if not caches:
        print(f"no coordl disk caches in {cache_dir}")
        return
    print(f"{'disk cache':<26}{'items':>16}{'complete':>10}{'on disk':>12}  {'last use':<17}{'users':>6}  dataset")
    for c in caches:
        last = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.last_use))
        users = _disk_users(os.path.join(cache_dir, c.name))
        users = str(users) if users is not None else ("yes" if c.in_use else "0")
        print(f"{c.name:<26}{f'{c.items_cached}/{c.n_items}':>16}{c.fill_fraction:>10.0%}"
              f"{format_bytes(c.bytes_on_disk):>12}  {last:<17}{users:>6}  {c.label}")
    print(f"(disk caches in {cache_dir}; `coordl cache rm NAME --cache-dir {cache_dir}` removes one no job uses)")


def _cache_warm(args) -> int:
    """``coordl cache warm SPEC``: fill the disk cache of an ImageFolder's root or an s3:// prefix ahead of
    training (the cache a job over the same files or objects opens)."""
    if not args.cache_dir:
        print("coordl cache warm needs --cache-dir (or $COORDL_CACHE_DIR): the disk tier's folder", file=sys.stderr)
        return 2
    import torchvision
    from tqdm.auto import tqdm

    import coordl
    if args.dataset.startswith("s3://"):
        dataset = coordl.ObjectImageFolder(args.dataset)
    elif os.path.isdir(args.dataset):
        dataset = torchvision.datasets.ImageFolder(args.dataset)
    else:
        print(f"coordl cache warm: {args.dataset!r} is neither a folder (an ImageFolder's root) nor an s3:// prefix",
              file=sys.stderr)
        return 2
    loader = coordl.DataLoader(dataset, cache_bytes=0, cache_dir=args.cache_dir, cache_dir_bytes=args.cache_dir_bytes)
    tier, source = loader.dataset.storage, loader.dataset.source
    keys = [source.raw_key(i) for i in range(len(source))]
    started = time.monotonic()
    with tqdm(unit="B", unit_scale=True, desc="coordl cache warm", disable=not sys.stderr.isatty()) as bar:
        items, nbytes = tier.warm(keys, args.jobs, done=bar.update)
    took = time.monotonic() - started
    (info,) = [c for c in list_disk_caches(args.cache_dir) if c.name == os.path.basename(tier.cache.folder)]
    print(f"read {items} of {len(keys)} items ({format_bytes(nbytes)}) in {took:.1f} s "
          f"({nbytes / 2**20 / max(took, 1e-9):.1f} MiB/s); the disk cache {info.name} holds "
          f"{info.items_cached}/{info.n_items} ({format_bytes(info.bytes_on_disk)})")
    loader.close()
    return 0 if info.items_cached == info.n_items else 1


def _remove(args, kind: str, found: dict, alive: Callable, remove: Callable, describe: Callable) -> int:
    """``coordl cache rm`` / ``coordl group rm``: the named (or all stale) segments of one kind.

    Never waits on a lock: a segment whose lock is held by a process is in use.
    """
    if not args.names and not args.stale:
        print(f"name the {kind}s to remove (see `coordl {kind} ls`), or pass --stale", file=sys.stderr)
        return 2
    readable = {name: item for name, item in found.items() if not isinstance(item, Unreadable)}
    targets = list(args.names) or [name for name, item in readable.items() if alive(item) == 0]
    status = 0
    for name in targets:
        item = found.get(name)
        if item is None:
            print(f"{name}: no such {kind}", file=sys.stderr)
            status = 1
        elif isinstance(item, Unreadable) and not args.force:
            print(f"{name}: {item.why}; pass --force to remove it anyway", file=sys.stderr)
            status = 1
        elif not isinstance(item, Unreadable) and alive(item) and (args.stale or not args.force):
            print(f"{name}: in use by {alive(item)} process(es)"
                  f"{'' if args.stale else '; pass --force to remove it anyway'}", file=sys.stderr)
            status = 1
        elif args.dry_run:
            print(f"would remove {name} ({describe(item)})")
        elif remove(name, force=args.force):
            print(f"removed {name} ({describe(item)})")
        else:
            print(f"{name}: not removed: a process holds it (in use)", file=sys.stderr)
            status = 1
    return status


def _describe_cache(c) -> str:
    if isinstance(c, DiskCacheInfo):
        return f"disk, {format_bytes(c.bytes_on_disk)}, {c.label}"
    return c.why if isinstance(c, Unreadable) else f"{format_bytes(c.capacity_bytes)}, {c.label}"


def _describe_group(g) -> str:
    return g.why if isinstance(g, Unreadable) else f"group {g.label!r}, {g.staged_batches} staged batch(es)"


def _cache_rm(args) -> int:
    found = {c.name: c for c in minio_cache.list_caches()}
    # a disk cache outlives its jobs: no users is what it is for, so --stale leaves them alone
    disk = {c.name: c for c in list_disk_caches(args.cache_dir)} if args.cache_dir and not args.stale else {}

    def remove(name: str, force: bool) -> bool:
        return remove_disk_cache(args.cache_dir, name) if name in disk else minio_cache.remove_cache(name, force=force)
    return _remove(args, "cache", {**found, **disk}, lambda c: int(c.in_use) if isinstance(c, DiskCacheInfo)
                   else c.users_alive, remove, _describe_cache)


def _group_ls(args) -> int:
    found = coord_prep.list_groups()
    if not found:
        print(f"no coordl hp_groups in {shm_dir()}")
        return 0
    for g in (g for g in found if not isinstance(g, Unreadable)):
        state = "stale" if g.members_alive == 0 else f"{g.members_alive} member(s)"
        print(f"{g.name}  group {g.label!r}: epoch {g.epoch}, {g.n_batches} batches per epoch, {state}; staging "
              f"{g.staged_batches} batch(es), {format_bytes(g.staged_bytes)} of {format_bytes(g.capacity_bytes)} "
              f"(peak {format_bytes(g.peak_staged_bytes)}); {format_bytes(g.spare_bytes)} in spare segments, "
              f"{g.reused} reused")
        for m in g.members:
            where = f"in epoch {m.epoch} at batch {m.cursor}" if m.epoch else "not in an epoch yet"
            waiting = f", waiting for epoch {m.waiting_for}" if m.waiting_for else ""
            print(f"    pid {m.pid:<8}{'alive' if m.alive else 'dead':<7}{where}{waiting}; prepared {m.prepared}, "
                  f"taken from others {m.shared}, epochs done {m.epochs_done}")
    _print_unreadable(found)
    return 0


def _group_rm(args) -> int:
    return _remove(args, "group", {g.name: g for g in coord_prep.list_groups()}, lambda g: g.members_alive,
                   coord_prep.remove_group, _describe_group)


def _demo(args) -> int:
    from coordl.demo import run_demo
    run_demo(images=args.images, epochs=args.epochs, cache_fraction=args.cache_fraction, workers=args.workers,
             batch_size=args.batch_size, read_mbps=args.read_mbps, root=args.dir)
    return 0


def _number(convert: Callable[[str], float], accept: Callable[[float], bool], expected: str) -> Callable[[str], float]:
    """An argparse type: ``convert(text)`` if ``accept`` takes it, else an error saying it ``should be {expected}``."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not accept(value):
            raise argparse.ArgumentTypeError(f"should be {expected}, but got {text!r}")
        return value
    return parse


def _whole_number(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``minimum``."""
    return _number(int, lambda value: value >= minimum, f"a whole number of at least {minimum}")


_fraction = _number(float, lambda value: 0 < value <= 1, "more than 0 and at most 1 (0.5: half the dataset)")
_positive_number = _number(float, lambda value: value > 0, "a number above 0")


def _analyze(args) -> int:
    from coordl.analyzer import runner
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    return runner.main(args)


def _whatif(args) -> int:
    """``coordl whatif analysis.json [--cache SIZE] [--workers N] ...``: the analysis again with changes."""
    from coordl import analyzer
    try:
        pipeline, _ = analyzer.load(args.analysis)
        mb = 1e6 / pipeline.sample_bytes  # samples/s per MB/s
        changed = pipeline.with_changes(
            cache_fraction=None if args.cache is None else args.cache / (pipeline.samples * pipeline.sample_bytes),
            workers=args.workers, servers=args.servers, jobs=args.jobs,
            coordinated=True if args.coordinated else None,
            storage_factor=1.0 if args.storage_mbps is None else args.storage_mbps * mb / pipeline.S,
            R=None if args.peer_mbps is None else args.peer_mbps * mb, lookahead=args.lookahead,
            K=None if args.disk_mbps is None else args.disk_mbps * mb,
            disk_fraction=None if args.disk is None else args.disk / pipeline.disk_dataset_bytes)
    except (OSError, ValueError) as e:
        print(f"coordl whatif: {e}", file=sys.stderr)
        return 2
    trust = _trust_of_file(args.analysis)
    if trust and (trust.get("withheld") or trust.get("range")):
        print(f"note: the analysis's prediction was {'withheld' if trust['withheld'] else 'given as a range'}: "
              f"{'; '.join(trust['why'])}; these answers share its doubt")
    print(f"as analyzed: {pipeline.predicted:.1f} samples/s per job, bound by "
          f"{analyzer.BOTTLENECKS[pipeline.bottleneck]}")
    print(f"with the changes: {changed.predicted:.1f} samples/s per job "
          f"({changed.predicted / pipeline.predicted:.2f}x), bound by {analyzer.BOTTLENECKS[changed.bottleneck]}\n")
    print(analyzer.describe(changed))
    return 0


def _trust_of_file(path: str) -> dict | None:
    """The ``trust`` an ``analysis.json`` records (``coordl analyze`` since it measures how steady rates ran)."""
    try:
        with open(path) as f:
            return json.load(f).get("trust")
    except (OSError, ValueError, AttributeError):
        return None


def _byte_size(text: str) -> int:
    """``--cache``: a size such as ``64GiB`` or a share of the memory available now such as ``50%``."""
    if text.strip().lower() == "auto":
        raise argparse.ArgumentTypeError("--cache takes a size such as 64GiB or a share of memory such as 50%, "
                                         "not 'auto', which a loader sizes from the machine it starts on")
    try:
        return parse_size_option("--cache", text, allow_zero=True)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _disk_size(text: str) -> int:
    """``--disk``: a size such as ``500GiB``."""
    if text.strip().endswith("%") or text.strip().lower() == "auto":
        raise argparse.ArgumentTypeError(f"--disk takes a size such as 500GiB, not {text!r}")
    try:
        return parse_size_option("--disk", text, allow_zero=True)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _subcommands(parser: argparse.ArgumentParser, what: str):
    """``parser``'s subparsers; given none of them, the command fails naming them."""
    commands = parser.add_subparsers()
    parser.set_defaults(func=lambda args: parser.error(f"choose a {what}: {', '.join(commands.choices)}"))
    return commands


def _add_ls_rm(sub, kind: str, what: str, *, ls: tuple, rm: tuple, users: str, in_use: str,
               disk: bool = False) -> None:
    """``coordl KIND ls`` and ``coordl KIND rm [NAME ...] [--stale] [--force] [--dry-run]`` (``disk``: both
    with ``--cache-dir``, the disk tier's folder)."""
    where = "/dev/shm and the disk tier's folder" if disk else "/dev/shm"
    commands = _subcommands(sub.add_parser(kind, help=f"inspect and remove {what} in {where}"), "subcommand")
    listing = commands.add_parser("ls", help=ls[1])
    listing.set_defaults(func=ls[0])
    remove = commands.add_parser("rm", help=rm[1])
    if disk:
        warm = commands.add_parser("warm", help="fill the disk cache of a dataset ahead of training")
        warm.add_argument("dataset", help="an ImageFolder's root folder, or an s3:// prefix (ObjectImageFolder)")
        warm.add_argument("--jobs", type=_whole_number(1), default=16, help="reads at once (default: 16)")
        warm.add_argument("--cache-dir-bytes", default="auto", help="the disk caches' quota, as cache_dir_bytes= "
                                                                    "(default: auto)")
        warm.set_defaults(func=_cache_warm)
    for command in (listing, remove, warm) if disk else ():
        command.add_argument("--cache-dir", default=settings.cache_dir(),
                             help="the disk tier's folder (default: $COORDL_CACHE_DIR)")
    remove.add_argument("names", nargs="*", help=f"{kind}s to remove (as `coordl {kind} ls` names them)")
    remove.add_argument("--stale", action="store_true", help=f"remove every {kind} whose {users} are all gone")
    remove.add_argument("--force", action="store_true", help=f"also remove {kind}s {in_use}")
    remove.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    remove.set_defaults(func=rm[0])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="coordl", description="coordl: a DataLoader without data stalls.")
    sub = _subcommands(parser, "command")

    demo = sub.add_parser("demo", help="torch's DataLoader against coordl with the same memory, on a slow "
                                       "emulated disk, on a generated JPEG dataset")
    demo.add_argument("--images", type=_whole_number(1), default=500, help="JPEGs to generate (default: 500, ~50 MiB)")
    demo.add_argument("--epochs", type=_whole_number(1), default=3, help="epochs of each loader (default: 3)")
    demo.add_argument("--cache-fraction", type=_fraction, default=0.5,
                      help="memory of each system (torch's page cache, coordl's cache) / dataset size, in (0, 1] "
                           "(default: 0.5)")
    demo.add_argument("--read-mbps", type=_positive_number, default=None,
                      help="the emulated disk's bandwidth in MB/s (default: measure prep here first and pick one at "
                           "which reading an epoch's misses takes longer than preparing it)")
    demo.add_argument("--workers", type=_whole_number(0), default=2,
                      help="DataLoader worker processes, 0 to load in the main process (default: 2)")
    demo.add_argument("--batch-size", type=_whole_number(1), default=32, help="samples per batch (default: 32)")
    demo.add_argument("--dir", help="keep the dataset in DIR (generated once) instead of a temporary folder")
    demo.set_defaults(func=_demo)

    analyze = sub.add_parser("analyze", help="measure where a training script stalls (DS-Analyzer): "
                                             "coordl analyze [options] -- python train.py ...")
    analyze.add_argument("--out", default=".", help="where analysis.json, the plots and each phase's log go "
                                                   "(default: the working directory)")
    analyze.add_argument("--iters", type=_whole_number(1), default=100,
                         help="batches each phase times (default: 100)")
    analyze.add_argument("--warmup", type=_whole_number(1), default=10,
                         help="batches each phase lets pass before timing (default: 10)")
    analyze.add_argument("--timeout", type=_positive_number, default=600.0,
                         help="seconds a phase may run before it is stopped (default: 600)")
    analyze.add_argument("command", nargs=argparse.REMAINDER, help="the training command, after --")
    analyze.set_defaults(func=_analyze)

    whatif = sub.add_parser("whatif", help="predict a job's throughput with another cache, workers, storage, "
                                           "servers, jobs or look-ahead, from the analysis.json `coordl analyze` "
                                           "wrote")
    whatif.add_argument("analysis", help="an analysis.json")
    whatif.add_argument("--cache", type=_byte_size, help="cache size, e.g. 64GiB, or a share of the memory available "
                                                        "now, e.g. 50%%")
    whatif.add_argument("--workers", type=_whole_number(0), help="DataLoader worker processes")
    whatif.add_argument("--storage-mbps", type=_positive_number, help="storage random-read bandwidth in MB/s")
    whatif.add_argument("--servers", type=_whole_number(1), help="servers, with partitioned caching")
    whatif.add_argument("--peer-mbps", type=_positive_number,
                        help="what one server fetches from its peers, in MB/s (needed with --servers unless "
                             "the analysis measured it)")
    whatif.add_argument("--jobs", type=_whole_number(1), help="jobs reading the dataset at once on this server")
    whatif.add_argument("--coordinated", action="store_true", help="those jobs share fetch and prep (hp_group)")
    whatif.add_argument("--lookahead", type=_whole_number(0),
                        help="an object store's GETs in flight ahead of the loop (the datasets' lookahead=)")
    whatif.add_argument("--disk", type=_disk_size, help="what the disk tier may hold (cache_dir_bytes=), e.g. 500GiB")
    whatif.add_argument("--disk-mbps", type=_positive_number,
                        help="what the disk tier reads, in MB/s (needed with --disk unless the analysis measured it)")
    whatif.set_defaults(func=_whatif)

    _add_ls_rm(sub, "cache", "MinIO caches", ls=(_cache_ls, "list caches, their fill and users"),
               rm=(_cache_rm, "remove caches"), users="users", in_use="still in use (never a disk cache in use)",
               disk=True)
    _add_ls_rm(sub, "group", "hp_groups (coordinated prep)",
               ls=(_group_ls, "list groups, their members, epochs and staging memory"),
               rm=(_group_rm, "remove groups and their staged batches"), users="members", in_use="with live members")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
