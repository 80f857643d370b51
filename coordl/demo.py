"""``coordl demo``: torch's DataLoader against coordl with the same memory, on a slow emulated disk.

Both systems read the same generated JPEGs through one :class:`~coordl._demo.emulated_store.EmulatedStore`
(a disk throttled to ``read_mbps`` that counts the bytes it reads) and get the same memory budget,
``cache_fraction`` of the dataset: torch as the store's LRU page cache, coordl as its MinIO cache
(its reads drop their pages, so its page cache is empty). Unless given a bandwidth, the demo measures
what prep takes on this machine first and picks the disk's so that reading each epoch's misses takes longer
than preparing the epoch: storage is the bottleneck, the case a cache is for. Each epoch's row gives the
disk-time floor (its bytes at the disk's bandwidth) and the resource that bound it.
"""

import io
import os
import tempfile
import time

import torch
import torch.utils.data
import torchvision
from PIL import Image
from torchvision import transforms as T
from tqdm import tqdm  # not tqdm.auto: it calls iter() on the loader twice

from coordl._demo.emulated_store import EmulatedStore, StoreClient, StoreImageLoader
from coordl._demo.synthetic import make_image_folder
from coordl.loader import DataLoader

MiB = 2**20
SEED = 0  # both systems draw the same epoch orders
PREP_SAMPLES = 24
"""Files decoded and transformed to measure prep before the run."""
STORAGE_MARGIN = 2.0
"""How much longer than prep the disk takes to read an epoch's misses, with the bandwidth the demo picks."""
STORAGE_BOUND = 0.7
"""An epoch whose disk-time floor is at least this share of its time was bound by storage."""


def _transform():
    return T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor()])


def prep_rate(files: list[str], workers: int) -> float:
    """Samples/s prep can deliver here: decoding and transforming files already in memory in this process,
    times the processes that prepare (the workers, at most the cores; this process with none)."""
    blobs = []
    for path in files[:PREP_SAMPLES]:
        with open(path, "rb") as f:
            blobs.append(f.read())
    transform = _transform()
    started = time.perf_counter()
    for blob in blobs:
        transform(Image.open(io.BytesIO(blob)).convert("RGB"))
    per_process = len(blobs) / (time.perf_counter() - started)
    return per_process * min(max(workers, 1), os.cpu_count() or 1)


def storage_bound_mbps(mean_bytes: float, prep_samples_per_s: float, cache_fraction: float) -> float:
    """A disk bandwidth (MB/s) at which reading an epoch's misses (``1 − cache_fraction`` of it, and no less
    than a quarter, as torch's page cache misses more) takes :data:`STORAGE_MARGIN` times as long as
    preparing the epoch."""
    return max(1 - cache_fraction, 0.25) * mean_bytes * prep_samples_per_s / STORAGE_MARGIN / 1e6


def bound_by(row: dict, workers: int) -> str:
    """``"storage"`` when the epoch took little more than its disk-time floor, else ``"prep"`` (the CPU).
    Without workers nothing overlaps (the epoch is its reads and its prep in turn): storage bound it when
    its reads took at least half of it."""
    share = 0.5 if workers == 0 else STORAGE_BOUND
    return "storage" if row["disk_s"] >= share * row["time_s"] else "prep"


def _epochs(name: str, loader, epochs: int, store: EmulatedStore, read_mbps: float) -> list[dict]:
    """Run ``epochs`` epochs of ``loader``; one row each, counted by the store."""
    rows = []
    for epoch in range(1, epochs + 1):
        before, started = store.counters(), time.perf_counter()
        samples = 0
        for images, _ in tqdm(loader, desc=f"{name:>6} epoch {epoch}", unit="batch", leave=False):
            samples += len(images)
        elapsed, after = time.perf_counter() - started, store.counters()
        misses = after.read_files - before.read_files
        read = after.read_bytes - before.read_bytes
        rows.append({"system": name, "epoch": epoch, "time_s": elapsed, "samples_per_s": samples / elapsed,
                     "read_bytes": read, "hits": samples - misses, "misses": misses,
                     "disk_s": read / (read_mbps * 1e6)})
        rows[-1]["bound"] = bound_by(rows[-1], loader.num_workers)
    return rows


def _run_torch(data: str, store: EmulatedStore, memory: int, epochs: int, read_mbps: float,
               **common) -> list[dict]:
    """torch's DataLoader over an ImageFolder reading through the store, with a page cache of ``memory``."""
    store.reset(page_cache_bytes=memory)
    dataset = torchvision.datasets.ImageFolder(data, transform=_transform(), loader=StoreImageLoader(store.socket_path))
    loader = torch.utils.data.DataLoader(dataset, generator=torch.Generator().manual_seed(SEED), **common)
    return _epochs("torch", loader, epochs, store, read_mbps)


def _run_coordl(data: str, store: EmulatedStore, memory: int, epochs: int, read_mbps: float,
                **common) -> list[dict]:
    """coordl with a MinIO cache of ``memory``, its misses read through the store with no page cache."""
    store.reset(page_cache_bytes=0)
    dataset = torchvision.datasets.ImageFolder(data, transform=_transform())
    with DataLoader(dataset, generator=torch.Generator().manual_seed(SEED), cache_bytes=memory,
                    cache_name=f"demo-{os.getpid()}", storage=StoreClient(store.socket_path, drop_page_cache=True),
                    **common) as loader:
        return _epochs("coordl", loader, epochs, store, read_mbps)


def run_demo(images: int = 500, epochs: int = 3, cache_fraction: float = 0.5, workers: int = 2,
             batch_size: int = 32, read_mbps: float | None = None, root: str | None = None) -> list[dict]:
    """Generate a dataset (in ``root`` if given and not there yet), run ``epochs`` epochs of torch
    and of coordl on it, print a table and the conclusion. Returns the table's rows. ``read_mbps``: the
    disk's bandwidth; None: measure prep and pick one at which storage is the bottleneck."""
    with tempfile.TemporaryDirectory(prefix="coordl-demo-") as scratch:
        data = os.path.join(root or scratch, "train")
        if not os.path.isdir(data):
            print(f"Generating {images} ImageNet-like JPEGs in {data} ...", flush=True)
            make_image_folder(data, images, n_classes=10)
        files = [p for p, _ in torchvision.datasets.ImageFolder(data).samples]
        size = sum(os.path.getsize(p) for p in files)
        memory = int(cache_fraction * size)
        if read_mbps is None:
            prep = prep_rate(files, workers)
            read_mbps = storage_bound_mbps(size / len(files), prep, cache_fraction)
            print(f"Prep here: about {prep:.0f} samples/s on {min(max(workers, 1), os.cpu_count() or 1)} "
                  f"process(es); the disk gets {read_mbps:.2g} MB/s, so that reading an epoch's misses takes "
                  f"longer than preparing it (--read-mbps sets it).", flush=True)
        print(f"Dataset: {len(files)} files, {size / MiB:.1f} MiB; memory for each system: {memory / MiB:.1f} MiB "
              f"({cache_fraction:.0%}); {workers} workers, batch size {batch_size}, {epochs} epochs in the same "
              f"random orders.\nStorage: emulated disk (no root needed) at {read_mbps:g} MB/s, counting the bytes "
              f"it reads. torch's memory is the disk's LRU page cache; coordl's is its MinIO cache, and its reads "
              f"skip the page cache (posix_fadvise DONTNEED).", flush=True)
        common = dict(batch_size=batch_size, shuffle=True, num_workers=workers)
        with EmulatedStore(os.path.join(scratch, "disk.sock"), int(read_mbps * 10**6), 0) as store:
            rows = (_run_torch(data, store, memory, epochs, read_mbps, **common)
                    + _run_coordl(data, store, memory, epochs, read_mbps, **common))
    _print_table(rows)
    if epochs > 1:
        print("\n" + conclusion(rows, memory))
    return rows


def _print_table(rows: list[dict]) -> None:
    header = (f"\n{'system':<8}{'epoch':>6}{'time_s':>9}{'disk_s':>8}{'bound':>9}{'samples/s':>11}{'read_MiB':>10}"
              f"{'hits':>7}{'misses':>8}")
    print(header)
    print("-" * (len(header) - 1))
    for r in rows:
        print(f"{r['system']:<8}{r['epoch']:>6}{r['time_s']:>9.2f}{r['disk_s']:>8.2f}{r['bound']:>9}"
              f"{r['samples_per_s']:>11.1f}{r['read_bytes'] / MiB:>10.1f}{r['hits']:>7}{r['misses']:>8}")
    print("disk_s: the epoch's reads at the disk's bandwidth, the least time they take; bound: storage where the "
          f"epoch took at most {1 / STORAGE_BOUND:.2g}× that (2× without workers, where reads and prep take turns), "
          "else prep (the CPU)")


def _steady(rows: list[dict], system: str, key: str) -> float:
    """Mean of ``key`` over ``system``'s epochs after the first."""
    values = [r[key] for r in rows if r["system"] == system and r["epoch"] > 1]
    return sum(values) / len(values)


def _hit_rate(rows: list[dict], system: str) -> float:
    """Share of ``system``'s samples served from memory in its epochs after the first."""
    hits = _steady(rows, system, "hits")
    return hits / (hits + _steady(rows, system, "misses"))


def conclusion(rows: list[dict], memory: int) -> str:
    """Why the numbers differ, and one line comparing both systems' epochs after the first."""
    lru, minio = _hit_rate(rows, "torch"), _hit_rate(rows, "coordl")
    why = (f"After epoch 1 torch's LRU page cache served {lru:.0%} of the samples, and coordl's cache, which keeps "
           f"what it took in epoch 1, {minio:.0%}" + (": in each new random order the LRU has evicted many files "
                                                    "before their turn comes." if lru < minio else "."))
    ours, theirs = _steady(rows, "coordl", "read_bytes") / MiB, _steady(rows, "torch", "read_bytes") / MiB
    if ours == 0:
        compared = f"nothing from storage per epoch after the first, torch {theirs:.1f} MiB"
    else:
        ratio = theirs / ours
        than = f"{ratio:.1f}× less" if ratio >= 1 else f"{1 / ratio:.1f}× more"
        compared = f"{ours:.1f} MiB from storage per epoch after the first, {than} than torch's {theirs:.1f} MiB"
    speed = _steady(rows, "coordl", "samples_per_s") / _steady(rows, "torch", "samples_per_s")
    return (f"{why}\ncoordl read {compared}, with the same {memory / MiB:.1f} MiB of memory, "
            f"at {speed:.1f}× torch's samples/s.")
