"""``coordl demo``: torch's DataLoader against coordl with a bounded cache, on generated JPEGs."""

import os
import resource
import shutil
import tempfile
import time
import warnings

import torch.utils.data
import torchvision
from torchvision import transforms as T
from tqdm import tqdm  # not tqdm.auto: it calls iter() on the loader twice

from coordl._sizes import format_bytes
from coordl.loader import DataLoader
from coordl.synthetic import make_image_folder


def _device_read_bytes() -> int:
    """Bytes this process and its reaped children (finished workers) read from block devices."""
    return 512 * (resource.getrusage(resource.RUSAGE_SELF).ru_inblock
                  + resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock)


def _drop_page_cache() -> bool:
    """Empty the OS page cache so both systems start cold; needs root."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def _run(name: str, loader, epochs: int) -> list[dict]:
    rows = []
    for epoch in range(1, epochs + 1):
        read_before, started = _device_read_bytes(), time.perf_counter()
        samples = 0
        for images, _ in tqdm(loader, desc=f"{name:>6} epoch {epoch}", unit="batch", leave=False):
            samples += len(images)
        elapsed = time.perf_counter() - started
        row = {"system": name, "epoch": epoch, "time_s": elapsed, "samples_per_s": samples / elapsed,
               "device_read": _device_read_bytes() - read_before, "hits": "-", "misses": "-"}
        if isinstance(loader, DataLoader):
            stats = loader.stats().epochs[-1]
            row.update(hits=stats.hits, misses=stats.misses)
        rows.append(row)
    return rows


def run_demo(images: int = 1500, epochs: int = 3, cache_fraction: float = 0.5, workers: int = 2,
             batch_size: int = 64, root: str | None = None) -> list[dict]:
    """Generate a dataset, run ``epochs`` epochs of torch and of coordl on it, print a table.

    Returns the table's rows.
    """
    workdir = tempfile.mkdtemp(prefix="coordl-demo-") if root is None else root
    try:
        data = os.path.join(workdir, "train")
        if not os.path.isdir(data):
            print(f"Generating {images} ImageNet-like JPEGs in {data} ...")
            make_image_folder(data, images, n_classes=10)
        dataset = torchvision.datasets.ImageFolder(
            data, transform=T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor()]))
        size = sum(os.path.getsize(p) for p, _ in dataset.samples)
        cache_bytes = int(cache_fraction * size)
        print(f"Dataset: {len(dataset)} files, {format_bytes(size)}; coordl cache: {format_bytes(cache_bytes)} "
              f"({cache_fraction:.0%}); {workers} workers, batch size {batch_size}.")
        cold = _drop_page_cache()
        rows = _run("torch", torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True,
                                                         num_workers=workers), epochs)
        _drop_page_cache()
        with warnings.catch_warnings(), DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers,
                                                   cache_bytes=cache_bytes) as loader:
            warnings.simplefilter("ignore")
            rows += _run("coordl", loader, epochs)
        _print_table(rows)
        print("\nEach epoch reads every sample once in a new order. coordl's later epochs hit exactly the items its "
              "cache took in epoch 1 and read only the rest from storage (device_read).")
        print("torch relies on the OS page cache, which here is " +
              ("as large as free memory: its later epochs read little from the device. On a dataset larger than "
               "memory the page cache thrashes instead (see docs/benchmarks.md)." if cold else
               "not dropped (needs root), so epoch 1 may already be warm."))
        return rows
    finally:
        if root is None:
            shutil.rmtree(workdir, ignore_errors=True)


def _print_table(rows: list[dict]) -> None:
    header = f"\n{'system':<8}{'epoch':>6}{'time_s':>9}{'samples/s':>11}{'hits':>7}{'misses':>8}{'device_read':>13}"
    print(header)
    print("-" * (len(header) - 1))
    for r in rows:
        print(f"{r['system']:<8}{r['epoch']:>6}{r['time_s']:>9.2f}{r['samples_per_s']:>11.1f}{r['hits']!s:>7}"
              f"{r['misses']!s:>8}{format_bytes(r['device_read']):>13}")
