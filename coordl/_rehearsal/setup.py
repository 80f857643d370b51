"""How a loader over an experience stream is put together: its sampler, its batches, and the checks made up front."""

import logging
import os

from torch.utils.data.distributed import DistributedSampler

from coordl._core.sizes import format_bytes
from coordl._fetch.cached_dataset import CachedDataset
from coordl._rehearsal.batches import DistributedExperienceSampler, ExperienceSampler, RehearsalBatches, check_labels
from coordl._rehearsal.exemplars import PAGE, ExemplarRegion, pages_for, region_name
from coordl._rehearsal.options import Rehearsal
from coordl._rehearsal.stream import ExperienceStream
from coordl.exceptions import ShmCapacityError

logger = logging.getLogger(__name__)

SIZE_SAMPLES = 64
"""How many of the stream's files are stat'ed to estimate an exemplar's size (see :func:`exemplar_region`)."""


def stream_of(dataset) -> ExperienceStream | None:
    """The experience stream ``dataset`` is (or a coordl dataset proxy wraps), else None."""
    inner = dataset.dataset if isinstance(dataset, CachedDataset) else dataset
    return inner if isinstance(inner, ExperienceStream) else None


def stream_sampler(stream: ExperienceStream, *, rehearsal, sampler, batch_sampler, batch_size, shuffle, generator):
    """The sampler of a loader over ``stream``: the current experience's samples (:class:`ExperienceSampler`;
    this rank's share of them under a torch ``DistributedSampler`` over the stream, as Lightning and users add
    one), or a ValueError naming the argument that cannot be combined with a stream."""
    if rehearsal is not None and not isinstance(rehearsal, Rehearsal):
        raise ValueError(f"rehearsal should be a coordl.Rehearsal or None, but got rehearsal={rehearsal!r}")
    if batch_sampler is not None:
        raise ValueError("a coordl loader over an ExperienceStream draws its batches from the current experience "
                         f"itself; batch_sampler= ({type(batch_sampler).__name__}) cannot be combined with it")
    if isinstance(sampler, ExperienceSampler):  # re-created from a coordl loader's parts
        return sampler
    distributed = isinstance(sampler, DistributedSampler) and type(sampler).__iter__ is DistributedSampler.__iter__
    if sampler is not None and not distributed:
        raise ValueError("a coordl loader over an ExperienceStream draws from the current experience itself; "
                         f"sampler= ({type(sampler).__name__}) cannot be combined with it (torch's DistributedSampler "
                         "can: each rank then draws its share of the experience)")
    if not stream.datasets:
        raise ValueError("the ExperienceStream has no experience yet: add one (stream.add(dataset)) before building "
                         "a loader over it")
    if rehearsal is not None:
        if batch_size is None:
            raise ValueError("rehearsal= needs batch_size=: replayed samples are added to each batch")
        rehearsal.replayed_per_batch(batch_size)
        check_labels(stream, rehearsal)
    if distributed:
        return DistributedExperienceSampler(stream, sampler)
    return ExperienceSampler(stream, bool(shuffle), generator)


def stream_batches(batch_sampler, rehearsal) -> RehearsalBatches | None:
    """The batches of a loader whose batch sampler (torch's, over an :class:`ExperienceSampler`) is
    ``batch_sampler``, else None (not a stream's)."""
    sampler = getattr(batch_sampler, "sampler", None)
    if not isinstance(sampler, ExperienceSampler):
        return None
    return RehearsalBatches(sampler, batch_sampler.batch_size, batch_sampler.drop_last, rehearsal)


def exemplar_region(rehearsal: Rehearsal | None, stream: ExperienceStream, wrapped, plan) -> ExemplarRegion | None:
    """The node's exemplar region for ``rehearsal``'s members the cache of ``wrapped`` will not hold (see
    ``_rehearsal.exemplars`` NOTE [ Exemplar region ]), made now and handed to the fetch path and to ``plan`` (the
    loader's :class:`RehearsalBatches`); None where the cache holds the whole stream (its size estimated from
    :data:`SIZE_SAMPLES` files' or objects' sizes), their sizes are not known, or ``exemplar_bytes=0``. ValueError,
    naming the capacity, if shared memory has no room for it."""
    cache, source = getattr(wrapped, "cache", None), getattr(wrapped, "source", None)
    if rehearsal is None or plan is None or cache is None or source is None or not len(source) or \
            rehearsal.exemplar_bytes == 0:
        return None
    n = len(source)
    known = getattr(wrapped.storage, "size", None)  # an object store's: its manifest's, no request
    sizes = []
    for i in sorted({k * (n - 1) // max(SIZE_SAMPLES - 1, 1) for k in range(min(SIZE_SAMPLES, n))}):
        try:
            size = known(source.raw_key(i)) if callable(known) else os.stat(source.raw_key(i)).st_size
        except (OSError, TypeError, ValueError):  # not a local file, nor a store that knows its sizes
            return None
        if size is None:
            return None
        sizes.append(size)
    mean = sum(sizes) / len(sizes)
    room = cache.capacity_bytes
    if mean * n <= room:
        return None  # every member is a cache hit
    bound = rehearsal.exemplar_bytes
    if bound is None:
        bound = 2 * min(rehearsal.capacity, n) * pages_for(int(1.25 * mean)) * PAGE  # the members and a pass's admissions
    region = ExemplarRegion(region_name(cache.name, rehearsal.seed, len(rehearsal.buffers)), n, pages_for(bound))
    try:
        region.stats()  # made (or attached) now: no room is an error at construction
    except ShmCapacityError as e:
        raise ValueError(f"rehearsal capacity={rehearsal.capacity} exemplars of about {format_bytes(int(mean))} each "
                         f"(the stream's files): {e}") from e
    logger.info("rehearsal: the cache's %s cannot hold the stream's about %s; up to %s of exemplars it does not hold "
                "go in %s", format_bytes(room), format_bytes(int(mean * n)), format_bytes(region.bound_bytes),
                region.name)
    wrapped.exemplars = plan.exemplars = region
    plan.peers = getattr(wrapped, "peers", None)
    if plan.peers is not None:  # its server serves the region to the others (this server's ranks' members)
        plan.peers.serve_exemplars(region)
    return region
