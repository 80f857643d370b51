"""Process targets for the object-store tests (module level: picklable for ``_procs.spawn``)."""

from tests._procs import JOIN_TIMEOUT


def read_an_epoch_and_report(url: str, seed: int, barrier, results) -> None:
    """A job: an ``ObjectImageFolder`` over ``url`` read for one epoch (2 workers, shuffled by ``seed``) once
    every job is at ``barrier``; reports its epoch's GETs, hits and misses, and every sample's target."""
    import torch

    import coordl
    dataset = coordl.ObjectImageFolder(url)
    loader = coordl.DataLoader(dataset, batch_size=8, shuffle=True, num_workers=2, cache_bytes=10**8,
                               generator=torch.Generator().manual_seed(seed), collate_fn=lambda batch: batch)
    barrier.wait(JOIN_TIMEOUT)
    targets = sorted(target for batch in loader for _, target in batch)
    epoch = loader.stats().epochs[0]
    loader.close()
    results.put((epoch.gets, epoch.hits, epoch.misses, targets))


def hp_member(url: str, group: str, epochs: int, results) -> None:
    """A job in hp_group ``group`` of 2 over the objects under ``url`` (each labelled with its index, no cache):
    reports each epoch's batches (their labels), the samples it prepared and the GETs it made."""
    import coordl
    dataset = coordl.ObjectDataset(url, decode=len)
    dataset.targets = list(range(len(dataset)))
    loader = coordl.DataLoader(dataset, batch_size=8, shuffle=True, cache_bytes=0, hp_group=group, hp_group_size=2)
    seen = [[labels.tolist() for _, labels in loader] for _ in range(epochs)]
    stats = [(e.prepared, e.gets) for e in loader.stats().epochs]
    loader.close()
    results.put((seen, stats))
