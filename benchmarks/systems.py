"""The systems under test: how each is built, and the training stand-in that runs its epochs.

Runs as a child process, one per system and cache size (``python -m benchmarks.systems SPEC``,
SPEC a JSON object written by :func:`child_command`); prints JSON lines: the time to build the
loader and the device bytes read meanwhile, one per epoch, then the cache's fill. Every system
reads the same ImageFolder tree with the same augmentation (random-resized crop to 224, horizontal
flip) and the same batch size and number of workers / threads.
"""

import collections
import importlib.util
import inspect
import json
import sys
import time

SYSTEMS = ("torch", "dali-seq", "dali-shuffle", "coordl", "coordl-dali")
COORDL_SYSTEMS = ("coordl", "coordl-dali")
PREP_SYSTEMS = ("prep-torch", "prep-dali")
"""Not loaders: the prep rate measured without any (every file's bytes in memory, decoded and
augmented on every worker, the results dropped), the bound of a run with nothing to read."""


def skip_reason(system: str, storage_mode: str) -> str | None:
    """Why ``system`` cannot run here, or None if it can. Imports only what it checks."""
    if system not in SYSTEMS + PREP_SYSTEMS:
        return f"unknown system (known: {', '.join(SYSTEMS)})"
    if system in ("torch", "coordl", "prep-torch"):
        return None
    if importlib.util.find_spec("nvidia") is None or importlib.util.find_spec("nvidia.dali") is None:
        return "nvidia.dali is not installed (pip install 'coordl[dali]')"
    if system.startswith("dali-") or system == "prep-dali":
        if storage_mode == "emulated" and system != "prep-dali":
            return "DALI's file reader reads the disk itself; it cannot use the emulated store"
        try:
            importlib.import_module("harness.dali_baseline").file_reader_loader
        except (ImportError, AttributeError) as e:
            return f"harness.dali_baseline.file_reader_loader is unavailable ({e})"
        return None
    import coordl

    if "backend" not in inspect.signature(coordl.DataLoader).parameters:
        return "coordl.DataLoader has no backend= argument (the DALI backend is not available)"
    return None


def child_command(spec: dict) -> list[str]:
    """The command that runs one system as described by ``spec`` (see :func:`run`)."""
    return [sys.executable, "-m", "benchmarks.systems", json.dumps(spec)]


def _torch_transform():
    from torchvision import transforms as T

    return T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.PILToTensor()])


def build_loader(spec: dict):
    """The loader of ``spec["system"]`` over ``spec["root"]``, and the dataset's labels in index order."""
    import torch.utils.data
    import torchvision

    from coordl._demo.emulated_store import StoreClient, StoreImageLoader

    system, root, socket_path = spec["system"], spec["root"], spec.get("store_socket")
    if system in PREP_SYSTEMS:
        samples = torchvision.datasets.ImageFolder(root).samples
        prep = TorchPrep if system == "prep-torch" else DaliPrep
        return prep([path for path, _ in samples], [label for _, label in samples], spec), [t for _, t in samples]
    common = dict(batch_size=spec["batch_size"], shuffle=True, num_workers=spec["workers"],
                  persistent_workers=spec["workers"] > 0)
    extra = {} if socket_path is None or system != "torch" else {"loader": StoreImageLoader(socket_path)}
    dataset = torchvision.datasets.ImageFolder(root, transform=_torch_transform(), **extra)
    if system.startswith("dali-"):
        from harness.dali_baseline import file_reader_loader

        loader = file_reader_loader(root, order=system.removeprefix("dali-"), batch_size=spec["batch_size"],
                                    num_threads=max(spec["workers"], 1), device="cpu", seed=spec["seed"])
        return loader, dataset.targets
    if system == "torch":
        return torch.utils.data.DataLoader(dataset, **common), dataset.targets
    import coordl

    kwargs = dict(common, cache_bytes=spec["cache_bytes"], cache_name=spec["cache_name"])
    if spec.get("cache_dir"):
        kwargs.update(cache_dir=spec["cache_dir"], cache_dir_bytes=spec.get("cache_dir_bytes", "auto"))
    if system == "coordl-dali":
        dataset = torchvision.datasets.ImageFolder(root)
        kwargs.update(backend="dali", dali_pipeline="image_classification", dali_device="cpu")
    loader = coordl.DataLoader(dataset, **kwargs)
    if socket_path is not None:  # misses go to the emulated store, as FileStorage would go to disk
        storage = loader.dataset.storage
        loader.dataset.storage = StoreClient(socket_path, drop_page_cache=storage.drop_page_cache)
    return loader, dataset.targets


def _read_all(paths: list[str]) -> list[bytes]:
    out = []
    for path in paths:
        with open(path, "rb") as f:
            out.append(f.read())
    return out


_PREP_BYTES: list[bytes] = []


def _torch_prep(indices: list[int]) -> int:
    """Decode and augment these samples as the torch systems' workers do, and drop the results."""
    from coordl._fetch.raw_datasets import decode_image

    transform = _torch_transform()
    for i in indices:
        transform(decode_image(_PREP_BYTES[i]))
    return len(indices)


class TorchPrep:
    """``prep-torch``: the torch systems' decode and augmentation (PIL decode, RandomResizedCrop, flip, to
    a tensor) of every file's bytes, held in memory, by a pool of ``workers`` processes (forked with the
    bytes), in a new random order each epoch; nothing is collated or handed back. Iterating yields one
    batch of labels per batch-size chunk, so that the training stand-in runs as for a loader."""

    def __init__(self, paths: list[str], labels: list[int], spec: dict):
        import multiprocessing

        _PREP_BYTES[:] = _read_all(paths)
        self.labels, self.batch_size = labels, spec["batch_size"]
        self.generator = __import__("random").Random(spec["seed"])
        self.pool = multiprocessing.get_context("fork").Pool(max(spec["workers"], 1))

    def __iter__(self):
        import torch

        order = list(range(len(self.labels)))
        self.generator.shuffle(order)
        batches = [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        for batch, _ in zip(batches, self.pool.imap(_torch_prep, batches)):
            yield None, torch.tensor([self.labels[i] for i in batch])


class DaliPrep:
    """``prep-dali``: the DALI systems' pipeline (``image_classification``, training augmentation, on
    the CPU with ``workers`` threads) over every file's bytes, held in memory and handed to DALI a
    batch at a time, in a new random order each epoch; the outputs are dropped."""

    def __init__(self, paths: list[str], labels: list[int], spec: dict):
        import numpy as np
        from nvidia.dali import Pipeline, fn, types

        from coordl._dali.presets import image_classification

        self.encoded = [np.frombuffer(b, dtype=np.uint8) for b in _read_all(paths)]
        self.labels, self.batch_size = labels, spec["batch_size"]
        self.generator = __import__("random").Random(spec["seed"])
        self.pipe = Pipeline(batch_size=self.batch_size, num_threads=max(spec["workers"], 1), seed=spec["seed"],
                             device_id=None, prefetch_queue_depth=1)
        with self.pipe:
            encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
            images, _ = image_classification(encoded, encoded, device="cpu", train=True)
            self.pipe.set_outputs(images)
        self.pipe.build()

    def __iter__(self):
        import torch

        order = list(range(len(self.labels)))
        self.generator.shuffle(order)
        for i in range(0, len(order), self.batch_size):
            batch = order[i:i + self.batch_size]
            self.pipe.feed_input("encoded", [self.encoded[j] for j in batch])
            self.pipe.run()
            yield None, torch.tensor([self.labels[j] for j in batch])


def _labels_of(batch) -> list[int]:
    labels = batch[1]
    return [int(v) for v in (labels.reshape(-1).tolist() if hasattr(labels, "reshape") else labels)]


def train_epoch(loader, compute_s: float) -> dict:
    """One epoch of the training stand-in: take each batch, then "compute" for ``compute_s``.

    Returns samples, batches, the label histogram, stall_s (time spent waiting for the loader)
    and compute_s (time spent computing).
    """
    stall = compute = 0.0
    batches = 0
    labels: collections.Counter[int] = collections.Counter()
    iterator = iter(loader)
    while True:
        started = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            stall += time.perf_counter() - started
            break
        stall += time.perf_counter() - started
        labels.update(_labels_of(batch))
        batches += 1
        started = time.perf_counter()
        time.sleep(compute_s)  # stands in for the forward and backward pass on an accelerator
        compute += time.perf_counter() - started
    return {"samples": sum(labels.values()), "batches": batches, "labels": labels, "stall_s": stall,
            "compute_s": compute}


def run(spec: dict) -> None:
    """Run ``spec["epochs"]`` epochs and print a JSON line for each, then ``{"cache": ...}``.

    spec keys: system, root, batch_size, workers, epochs, compute_ms, cache_bytes, cache_name,
    cache_dir and cache_dir_bytes (the disk tier; optional), seed, counter (see :func:`harness.storage_env.device_read_bytes`), store_socket (emulated
    mode, else None).
    """
    from harness.storage_env import device_read_bytes

    before, started = device_read_bytes(spec["counter"]), time.perf_counter()
    loader, targets = build_loader(spec)
    build_s, mark = time.perf_counter() - started, device_read_bytes(spec["counter"])
    # What a loader reads while it is built (DALI-seq fills its 1024-sample shuffle buffer) is counted apart.
    print(json.dumps({"build_s": build_s, "build_device_read_bytes": mark - before}), flush=True)
    expected = collections.Counter(targets)
    for epoch in range(1, spec["epochs"] + 1):
        started = time.perf_counter()
        seen = train_epoch(loader, spec["compute_ms"] / 1000)
        elapsed = time.perf_counter() - started
        # Counted from the end of the previous epoch (epoch 1: of the build), so reads a loader does
        # ahead of an epoch (DALI's prefetch) are never lost.
        read, mark = mark, device_read_bytes(spec["counter"])
        row = {"epoch": epoch, "time_s": elapsed, "samples": seen["samples"], "batches": seen["batches"],
               "samples_per_s": seen["samples"] / elapsed, "device_read_bytes": mark - read,
               "stall_s": seen["stall_s"], "compute_s": seen["compute_s"],
               "label_counts_match": seen["labels"] == expected}
        if spec["system"] in COORDL_SYSTEMS:
            e = loader.stats().epochs[-1]
            row.update(hits=e.hits, misses=e.misses, storage_bytes=e.storage_bytes, loader_stall_s=e.stall_s,
                       disk_hits=e.disk_hits, disk_bytes=e.disk_bytes, corrupt=e.corrupt)
        print(json.dumps(row), flush=True)
    cache = None
    if spec["system"] in COORDL_SYSTEMS:
        cache = loader.stats().as_dict()["cache"]
        loader.close()
    print(json.dumps({"cache": cache}), flush=True)


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
