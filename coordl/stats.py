"""Loader statistics: per-epoch and total counters, and the per-epoch summary line."""

import dataclasses

from coordl._cache.minio import CacheStats
from coordl._core.settings import request_prices
from coordl._group.membership import GroupStats


@dataclasses.dataclass
class EpochStats:
    """What one epoch (one pass of ``iter(loader)``) did. Epoch 0 in :attr:`LoaderStats.total`.

    ``samples`` counts the samples delivered to the training loop and ``decoded`` those this job's
    workers prepared; they differ only in an hp_group, where ``prepared`` batches were made by this
    job and ``shared`` ones taken from other members (``staging_wait_s`` waiting for those).
    ``stale`` counts the ``misses`` whose cached bytes were out of date (their file changed since).
    In a partitioned job (``servers`` > 0), ``peer_hits`` and ``peer_bytes`` count the local misses
    fetched from other servers' caches; ``misses`` and ``storage_bytes`` count only storage reads. With
    ``locality_aware``, ``moved`` counts the samples another server caches that balancing gave this rank.
    ``storage_wait_s``, ``peer_wait_s`` and ``prep_s`` are the seconds this job's loading processes spent
    reading storage, waiting for peers and preparing samples (decode and transform; not counted with
    ``backend="dali"``, whose prep is DALI's, nor for a dataset loaded uncached), summed over the processes: where the loading time goes, to
    read beside ``stall_s``, the time the training loop waited: None where it was not measured, when a
    torch DataLoader built from the loader's parts (Accelerate's, for one) ran the epoch, as only coordl's
    own iterator sees the loop's waits.

    Over an experience stream (``experience``: the one the epoch drew), ``replayed`` counts the samples of its
    batches that replayed exemplars, and ``buffer_items`` and ``buffer_bytes`` the rehearsal buffer's members
    at its end and the bytes of those the node's cache holds.

    From an object store (``object_store``), ``misses`` are the GETs of torch's workers (a batch's at once)
    and ``ahead`` (``ahead_bytes``) those of the look-ahead, which reads the plan's objects into the cache
    before they are asked for, or, what the cache has no room for, into a staging area that torch's workers
    take them out of (``staged``, counted apart from ``hits`` and ``misses``); ``waits`` counts the samples
    that waited for a GET in flight (``wait_s`` long).
    :attr:`gets`, :attr:`get_bytes`, :attr:`get_wait_s` and :attr:`lookahead_hits` sum them up. ``lists``
    counts the LIST requests that looked for changes in the bucket before the epoch began; :attr:`request_cost`
    prices the requests.

    With a disk tier (``disk_tier``), ``disk_hits`` (``disk_bytes``, ``disk_wait_s``) count the misses of the
    memory cache it served, which ``misses`` and ``storage_bytes`` do not count, and ``corrupt`` the items it
    held whose bytes failed their check (read from storage instead).
    """

    epoch: int
    complete: bool = False
    samples: int = 0
    batches: int = 0
    hits: int = 0
    misses: int = 0
    stale: int = 0
    cache_bytes: int = 0
    storage_bytes: int = 0
    stall_s: float | None = 0.0
    time_s: float = 0.0
    decoded: int = 0
    group: str | None = None
    members: int = 0
    prepared: int = 0
    shared: int = 0
    staging_wait_s: float = 0.0
    servers: int = 0
    peer_hits: int = 0
    peer_bytes: int = 0
    moved: int = 0
    storage_wait_s: float = 0.0
    peer_wait_s: float = 0.0
    prep_s: float = 0.0
    waits: int = 0
    wait_s: float = 0.0
    ahead: int = 0
    ahead_bytes: int = 0
    staged: int = 0
    lists: int = 0
    object_store: bool = False
    disk_hits: int = 0
    disk_bytes: int = 0
    disk_wait_s: float = 0.0
    corrupt: int = 0
    disk_tier: bool = False
    experience: int | None = None
    replayed: int = 0
    buffer_items: int = 0
    buffer_bytes: int = 0

    @property
    def gets(self) -> int:
        """Reads of the object store (or storage): torch's workers' and the look-ahead's."""
        return self.misses + self.ahead

    @property
    def get_bytes(self) -> int:
        return self.storage_bytes + self.ahead_bytes

    @property
    def get_wait_s(self) -> float:
        """Seconds the loading processes spent on their own GETs and waiting for GETs in flight elsewhere."""
        return self.storage_wait_s + self.wait_s

    @property
    def request_cost(self) -> float:
        """The epoch's requests at the store's prices, in dollars (``COORDL_GET_PRICE``, ``COORDL_LIST_PRICE``:
        dollars per 1,000 requests; S3 Standard's by default)."""
        get_price, list_price = request_prices()
        return (self.gets * get_price + self.lists * list_price) / 1000

    @property
    def lookahead_hits(self) -> int:
        """Objects the look-ahead read that were there before they were asked for (its reads less the waits)."""
        return max(0, self.ahead - self.waits)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.time_s if self.time_s > 0 else 0.0

    @property
    def hit_rate(self) -> float:
        fetched = self.hits + self.misses
        return self.hits / fetched if fetched else 0.0

    def summary_line(self, cache: CacheStats | None) -> str:
        """``key=value`` line logged at the end of each epoch."""
        fill = f"{cache.fill_fraction:.3f}" if cache is not None else "off"
        line = (f"epoch={self.epoch} complete={int(self.complete)} samples={self.samples} batches={self.batches} "
                f"hits={self.hits} misses={self.misses} stale={self.stale} cache_bytes={self.cache_bytes} "
                f"storage_bytes={self.storage_bytes} stall_s={_seconds(self.stall_s, '.3f')} time_s={self.time_s:.3f} "
                f"samples_per_s={self.samples_per_s:.1f} cache_fill={fill} storage_wait_s={self.storage_wait_s:.3f} "
                f"prep_s={self.prep_s:.3f}")
        if self.object_store:
            line += (f" gets={self.gets} get_bytes={self.get_bytes} lists={self.lists} "
                     f"lookahead_hits={self.lookahead_hits} staged={self.staged} waits={self.waits} get_wait_s={self.get_wait_s:.3f} "
                     f"request_cost={self.request_cost:.6f}")
        if self.disk_tier:
            line += (f" disk_hits={self.disk_hits} disk_bytes={self.disk_bytes} corrupt={self.corrupt} "
                     f"disk_wait_s={self.disk_wait_s:.3f}")
        if self.experience is not None:
            line += (f" experience={self.experience} replayed={self.replayed} buffer_items={self.buffer_items} "
                     f"buffer_bytes={self.buffer_bytes}")
        if self.servers:
            line += (f" servers={self.servers} peer_hits={self.peer_hits} peer_bytes={self.peer_bytes} moved={self.moved} "
                     f"peer_wait_s={self.peer_wait_s:.3f}")
        if self.group is not None:
            line += (f" group={self.group} members={self.members} prepared={self.prepared} shared={self.shared} "
                     f"decoded={self.decoded} staging_wait_s={self.staging_wait_s:.3f}")
        return line


@dataclasses.dataclass
class LoaderStats:
    """Returned by ``loader.stats()``: every epoch so far, their total, the cache's fill state and the
    hp_group's state (staging memory included)."""

    epochs: list[EpochStats]
    total: EpochStats
    cache: CacheStats | None
    group: GroupStats | None = None
    peers: list[dict] | None = None
    """Partitioned caching: per other server, its address, whether it is down, and the items, bytes,
    requests and mean wait per request this rank fetched from it."""
    rehearsal: dict | None = None
    """Over an experience stream with ``rehearsal=``: the buffer's members (``items``; every rank's, under DDP),
    the bytes of those the node's cache holds (``bytes``), how many it does not (``uncached``), and members per
    class (``classes``, None without labels), per experience (``experiences``) and per rank (``ranks``)."""

    def __str__(self) -> str:
        """A small table, a row per epoch and one for the total, then the cache's fill (``repr`` stays the
        dataclass's, for code)."""
        columns = [("epoch", lambda e: str(e.epoch) if e.epoch else "total"), ("samples", lambda e: str(e.samples)),
                   ("samples/s", lambda e: f"{e.samples_per_s:.1f}"), ("hits", lambda e: str(e.hits)),
                   ("misses", lambda e: str(e.misses)), ("storage MiB", lambda e: f"{e.storage_bytes / 2**20:.1f}"),
                   ("stall s", lambda e: _seconds(e.stall_s, ".2f")), ("time s", lambda e: f"{e.time_s:.2f}")]
        if self.total.object_store:
            columns.insert(5, ("GETs", lambda e: str(e.gets)))
        if self.total.disk_tier:
            columns.insert(5, ("disk hits", lambda e: str(e.disk_hits)))
        if self.total.servers:
            columns.insert(5, ("peer hits", lambda e: str(e.peer_hits)))
        if self.total.experience is not None:
            columns[1:1] = [("experience", lambda e: str(e.experience)), ("replayed", lambda e: str(e.replayed))]
        if self.total.group is not None:
            columns.insert(5, ("shared", lambda e: str(e.shared)))
        rows = [[name for name, _ in columns]] + [[cell(e) for _, cell in columns] for e in [*self.epochs, self.total]]
        widths = [max(len(row[k]) for row in rows) for k in range(len(columns))]
        lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
        if self.cache is not None:
            cache = self.cache
            lines.append(f"cache: {cache.items_cached} of {cache.n_items} items ({cache.fill_fraction:.0%}), "
                         f"{cache.bytes_cached / 2**20:.1f} of {cache.capacity_bytes / 2**20:.1f} MiB")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        """Plain dict (JSON-serialisable), derived rates included."""
        def epoch_dict(e: EpochStats) -> dict:
            return {**dataclasses.asdict(e), "samples_per_s": e.samples_per_s, "hit_rate": e.hit_rate,
                    "gets": e.gets, "get_bytes": e.get_bytes, "get_wait_s": e.get_wait_s,
                    "lookahead_hits": e.lookahead_hits, "request_cost": e.request_cost}
        cache = None if self.cache is None else {**dataclasses.asdict(self.cache),
                                                 "fill_fraction": self.cache.fill_fraction}
        group = None if self.group is None else dataclasses.asdict(self.group)
        return {"epochs": [epoch_dict(e) for e in self.epochs], "total": epoch_dict(self.total), "cache": cache,
                "group": group, "peers": self.peers, "rehearsal": self.rehearsal}


def _seconds(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def add_epoch(total: EpochStats, epoch: EpochStats) -> None:
    """Accumulate ``epoch``'s counts into ``total`` (whose ``stall_s`` is None once an epoch's is)."""
    for field in ("samples", "batches", "hits", "misses", "stale", "cache_bytes", "storage_bytes", "time_s",
                  "decoded", "prepared", "shared", "staging_wait_s", "peer_hits", "peer_bytes", "moved", "storage_wait_s",
                  "peer_wait_s", "prep_s", "waits", "wait_s", "ahead", "ahead_bytes", "staged", "lists",
                  "disk_hits", "disk_bytes", "disk_wait_s", "corrupt", "replayed"):
        setattr(total, field, getattr(total, field) + getattr(epoch, field))
    if epoch.experience is not None:  # the buffer as the latest epoch left it
        total.experience, total.buffer_items = epoch.experience, epoch.buffer_items
        total.buffer_bytes = epoch.buffer_bytes
    total.object_store = total.object_store or epoch.object_store
    total.disk_tier = total.disk_tier or epoch.disk_tier
    total.stall_s = None if total.stall_s is None or epoch.stall_s is None else total.stall_s + epoch.stall_s
