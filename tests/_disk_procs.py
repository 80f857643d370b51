"""Process targets for the disk-tier tests (module level: picklable for ``_procs.spawn``)."""

import json
import os
import zlib


def files_of(root: str) -> list[str]:
    return sorted(os.path.join(root, name) for name in os.listdir(root) if name.endswith(".bin"))


def make_files(root: str, n: int, seed: int = 0, sizes=(1000, 9000)) -> list[str]:
    """``n`` files of random bytes (of ``sizes``, the least and most) in ``root``."""
    import random
    rng = random.Random(seed)
    os.makedirs(root, exist_ok=True)
    for k in range(n):
        with open(os.path.join(root, f"{k:05d}.bin"), "wb") as f:
            f.write(rng.randbytes(rng.randint(*sizes)))
    return files_of(root)


def disk_job(root: str, cache_dir: str, epochs: int, cache_bytes: int, workers: int, seed: int, out: str,
             quota="auto") -> None:
    """A job: the files of ``root`` (each sample its file's crc32 and its index), ``epochs`` shuffled epochs
    through the disk tier in ``cache_dir``; writes each epoch's samples and counts to ``out`` (JSON)."""
    import torch

    import coordl
    files = files_of(root)
    dataset = coordl.FileDataset(files, targets=list(range(len(files))), decode=zlib.crc32)
    loader = coordl.DataLoader(dataset, batch_size=16, shuffle=True, num_workers=workers, cache_bytes=cache_bytes,
                               cache_dir=cache_dir, cache_dir_bytes=quota,
                               generator=torch.Generator().manual_seed(seed), collate_fn=list)
    seen = [[(int(crc), int(index)) for batch in loader for crc, index in batch] for _ in range(epochs)]
    counts = [{k: getattr(e, k) for k in ("misses", "storage_bytes", "hits", "cache_bytes", "disk_hits", "disk_bytes",
                                          "corrupt")}
              for e in loader.stats().epochs]
    loader.close()
    with open(out + ".tmp", "w") as f:
        json.dump({"seen": seen, "epochs": counts}, f)
    os.replace(out + ".tmp", out)


def fill_until_killed(root: str, cache_dir: str, started: str) -> None:
    """A job that reads the files of ``root`` through the disk tier (no memory cache, 2 workers) epoch after
    epoch, saying when it has started (file ``started``), until it is killed."""
    import coordl
    files = files_of(root)
    loader = coordl.DataLoader(coordl.FileDataset(files, decode=zlib.crc32), batch_size=4, shuffle=True,
                               num_workers=2, cache_bytes=0, cache_dir=cache_dir, collate_fn=list)
    open(started, "w").close()
    while True:
        for _ in loader:
            pass
