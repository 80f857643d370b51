"""The data pipeline's model (CoorDL §5): measured rates in, predicted throughput and what-if answers out.

A training job's throughput is the least of three rates, in samples per second: the fetch rate ``F``
(cache and storage), the prep rate ``P`` (decode and augment, all workers) and the ingestion rate ``G``
(the training step alone). For a cache holding a fraction ``x`` of a dataset of ``D`` samples, an epoch
reads ``D·x`` samples from the cache at rate ``C`` and ``D·(1−x)`` from storage at rate ``S``:

    F(x) = D / (D·x/C + D·(1−x)/S)

(MinIO: a cache of x items gives at least x hits per epoch). That is one fetcher taking hits and misses in
turn; with several (two or more workers, or DALI's fetch threads) the cache serves some while storage
serves others, so each is busy for its own share and ``F(x) = D / max(D·x/C, D·(1−x)/S)``. With
partitioned caching over ``N`` servers whose caches each hold ``x``, a rank's epoch takes ``x`` from its
own cache, ``min(1, N·x) − x`` from peers at rate ``R`` (``peer_share`` where measured otherwise) and the
rest from storage. Per epoch, the time
lost to prep is what ``min(P, G)`` costs beyond ``G``, and the time lost to fetching is what the throughput
costs beyond ``min(P, G)``.

A torch worker fetches its batch's misses before it prepares them, so it also waits ``L`` per miss (one
cold read while the storage is not saturated), and the other workers' prep overlaps its wait: the
workers deliver ``W = min(P, workers / (processes/P + misses·L))``, and the prediction is
``min(F, W, G)``; workers that wait longer than they prepare are held by fetching. With the DALI
backend, ``fetch_threads`` threads fetch batches ahead of DALI's prep threads, so prep never waits
(``W = P``) and the fetch threads' own waits bound fetching instead: ``F = min(F, fetch_threads /
(misses·L))``.

From an object store, a worker reads its batch's misses ``concurrency`` at once, so it waits ``L /
concurrency`` per miss (``L``: one GET's wait); with the look-ahead, ``lookahead`` GETs are in flight
ahead of the loop, so the workers wait for none (``W`` as with no misses) and fetching is bound by them:
``F = min(F, lookahead / ((1−x)·L))``; ``S`` is the store's rate at the loader's concurrency (the
look-ahead's and the workers' GETs in flight: latency × concurrency, or the bandwidth).

With a disk tier (``cache_dir=``), the misses of the memory cache (and of the peers) that the disk holds are
read from it at rate ``K``, each waiting ``L_disk``: its share of an epoch is ``min(h, 1 − x − peers)``, for
``h`` the share of the dataset it holds apart from the memory cache once filled (1 where its quota holds
the dataset: it holds what memory holds too; else its quota's share, the two tiers disjoint), and storage
serves the rest. ``F`` adds ``share/K`` to the busy times, ``W`` the share's waits, and the look-ahead and
DALI's fetch threads wait only for storage's share.

The training process and prep share the cores: with ``step_cpu_s`` and ``prep_cpu_s`` seconds of CPU per
sample (the training process's in the ingestion phase; prep's while ``P`` is measured), no more than
``cores / (step_cpu_s + prep_cpu_s)`` samples/s go through, however many workers there are; that bound
is part of ``W`` (each of ``jobs`` jobs pays its own step, and its own prep unless coordinated).

Workers that prepare while the training loop runs also take the cores at the moments the loop wants them
(a worker starts its next batch as the loop takes the last one), which neither ``G`` (the loop alone) nor
``P`` (prep alone) contains: the loop, fed batches its workers prepare from memory, reaches ``Q``, the
``contention`` ``Q / min(W, G)`` of what the two alone allow (at most 1; measured with nothing fetched).
The prediction is ``min(F, contention · min(W, G))``, and what the contention costs is prep stall.
With the DALI backend, prep runs in the training process beside the step, and where DALI decodes on
the GPU (``dali_device='gpu'``) the GPU's time goes to both: ``Q`` is then the loop fed by a twin of its
pipeline, and the contention holds both shares.
"""

import dataclasses
import math

BOTTLENECKS = {"fetch": "fetching (storage or cache)", "prep": "prep (decode and augment on the CPU)",
               "ingestion": "the training step itself (no data stall)"}


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """One job's data pipeline on one server, as measured.

    Args:
        samples, sample_bytes: the dataset: samples, and mean bytes per sample as stored.
        G, P, S, C: ingestion, prep, storage fetch and cache fetch rates (samples/s).
        cache_fraction: how much of the dataset the cache holds, in [0, 1].
        workers: the loader's worker processes when ``P`` was measured (0: the main process loads).
        cores: CPU cores available to prep.
        L: seconds a worker waits for one miss while the storage is not saturated (0: none).
        R: peer fetch rate (samples/s) with partitioned caching, None when not measured.
        servers: servers of the job, each with its own cache of ``cache_fraction``.
        peer_share: the share of an epoch fetched from peers; None: ``min(1, servers·cache_fraction) −
            cache_fraction``, what the other servers' caches hold once full (a measured split says otherwise).
        jobs: jobs on this server reading the dataset at once.
        coordinated: whether those jobs share fetch and prep (``hp_group``) or each does its own.
        fetch_threads: threads that fetch batches ahead of prep (the DALI backend: as many as its prep
            threads, ``workers``), each waiting ``L`` per miss; 0: the workers fetch their own batches (torch).
        ranks: training processes of the job on each server (torchrun), each with these rates and its
            share of ``cores``: the rates, the prediction and the stalls are a rank's, over its
            ``samples / (servers · ranks)`` of an epoch; the job's samples/s is ``servers · ranks`` times the
            prediction.
        step_cpu_s, prep_cpu_s: CPU seconds per sample of the training process (the step and taking its
            batch) and of prep (0: not measured, no CPU bound).
        contention: the share of ``min(W, G)`` the training loop reaches while its workers (or DALI) prepare
            (see the module's docstring; 1: none, or not measured).
        concurrency: GETs a worker makes at once for its batch's misses (an object store; 0: one by one).
        lookahead: GETs the look-ahead keeps in flight ahead of the loop (an object store; 0: none).
        K: the disk tier's fetch rate (samples/s), None: no disk tier.
        disk_fraction: ``h``, the share of the dataset the disk tier holds apart from the memory cache once
            filled (1: all of it).
        L_disk: seconds a worker waits for one item from the disk tier.
        disk_item_bytes: bytes a sample takes in the disk tier, as it packs them (None: ``sample_bytes``).
    """

    samples: int
    sample_bytes: float
    G: float
    P: float
    S: float
    C: float
    cache_fraction: float
    workers: int
    cores: int
    L: float = 0.0
    R: float | None = None
    servers: int = 1
    jobs: int = 1
    coordinated: bool = False
    fetch_threads: int = 0
    ranks: int = 1
    step_cpu_s: float = 0.0
    prep_cpu_s: float = 0.0
    contention: float = 1.0
    peer_share: float | None = None
    concurrency: int = 0
    lookahead: int = 0
    K: float | None = None
    disk_fraction: float = 0.0
    L_disk: float = 0.0
    disk_item_bytes: float | None = None

    def __post_init__(self):
        for name in ("G", "P", "S", "C", "sample_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} should be a rate above 0, but got {getattr(self, name)!r}")
        for name in ("L", "step_cpu_s", "prep_cpu_s", "L_disk"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} should be seconds at or above 0, but got {getattr(self, name)!r}")
        if not 0 < self.contention <= 1:
            raise ValueError(f"contention should be in (0, 1], but got {self.contention!r}")
        if self.R is not None and not self.R > 0:
            raise ValueError(f"R should be a rate above 0 or None, but got {self.R!r}")
        if not 0 <= self.cache_fraction <= 1:
            raise ValueError(f"cache_fraction should be in [0, 1], but got {self.cache_fraction!r}")
        if min(self.samples, self.cores, self.servers, self.jobs, self.ranks) < 1 or min(
                self.workers, self.fetch_threads, self.concurrency, self.lookahead) < 0:
            raise ValueError(f"samples, cores, servers, jobs and ranks should be at least 1 and workers, "
                             f"fetch_threads, concurrency and lookahead at least 0: {self.samples}, {self.cores}, "
                             f"{self.servers}, {self.jobs}, {self.ranks}, {self.workers}, {self.fetch_threads}, "
                             f"{self.concurrency}, {self.lookahead}")
        if self.peer_share is not None and not 0 <= self.peer_share <= 1 - self.cache_fraction + 1e-9:
            raise ValueError(f"peer_share should be in [0, 1 − cache_fraction], but got {self.peer_share!r}")
        if not 0 <= self.disk_fraction <= 1:
            raise ValueError(f"disk_fraction should be in [0, 1], but got {self.disk_fraction!r}")
        if self.K is not None and not self.K > 0 or self.disk_fraction > 0 and self.K is None:
            raise ValueError(f"a disk tier's share needs its rate K above 0 (`coordl whatif`: --disk-mbps), but got "
                             f"K={self.K!r} with disk_fraction={self.disk_fraction!r}")
        if self.servers > 1 and self.R is None:
            raise ValueError("a pipeline over several servers needs the peer fetch rate R (`coordl whatif`: --peer-mbps)")

    # -- the three rates -----------------------------------------------------------------------------------

    @property
    def _from_peers(self) -> float:
        """The share of an epoch fetched from the other servers' caches."""
        if self.servers == 1:
            return 0.0
        if self.peer_share is not None:
            return self.peer_share
        return min(1.0, self.servers * self.cache_fraction) - self.cache_fraction

    @property
    def disk_dataset_bytes(self) -> float:
        """Bytes the whole dataset takes in the disk tier (what ``cache_dir_bytes=`` must allow to hold it)."""
        return self.samples * (self.disk_item_bytes or self.sample_bytes)

    @property
    def _from_disk(self) -> float:
        """The share of an epoch read from the disk tier: what it holds of the memory's and peers' misses."""
        if self.K is None:
            return 0.0
        return min(self.disk_fraction, max(0.0, 1.0 - self.cache_fraction - self._from_peers))

    @property
    def _from_storage(self) -> float:
        """The share of an epoch read from storage: what no cache tier holds."""
        return max(0.0, 1.0 - self.cache_fraction - self._from_peers - self._from_disk)

    @property
    def fetch_rate(self) -> float:
        """F: samples/s one job's loader fetches (each of ``jobs`` uncoordinated jobs reads every sample);
        several fetchers keep the cache, the peers, the disk tier and storage busy at once."""
        local, peers, disk, misses = self.cache_fraction, self._from_peers, self._from_disk, self._from_storage
        busy = [local / self.C, misses / self.S]  # seconds per sample of an epoch, by where
        if peers > 0:
            busy.append(peers / self.R)
        if disk > 0:
            busy.append(disk / self.K)
        seconds = max(busy) if max(self.workers, self.fetch_threads) > 1 else sum(busy)  # in parallel, or in turn
        rate = math.inf if seconds == 0 else 1.0 / seconds
        ahead = self.fetch_threads or self.lookahead
        if ahead and misses > 0 and self.L > 0:  # each thread (or GET in flight) waits L per storage read
            rate = min(rate, ahead / (misses * self.L))
        return rate if self.coordinated else rate / self.jobs

    @property
    def prep_rate(self) -> float:
        """P: samples/s one job's prep delivers; it grows with the worker processes up to the cores."""
        return self.P / (1 if self.coordinated else self.jobs)

    @property
    def cpu_rate(self) -> float:
        """Samples/s of one job that the cores can take: each job's step and prep (shared when coordinated)
        in CPU seconds per sample; unbounded where not measured."""
        seconds = self.jobs * self.step_cpu_s + (1 if self.coordinated else self.jobs) * self.prep_cpu_s
        return self.cores / seconds if self.prep_cpu_s > 0 else math.inf

    @property
    def worker_rate(self) -> float:
        """W: samples/s of one job's workers when each waits ``L`` per miss before it prepares its batch, and
        the cores also run the training process."""
        if self.workers == 0:
            return self.prep_rate
        if self.fetch_threads or self.lookahead or self._wait_per_sample == 0:  # fetched ahead (DALI, look-ahead)
            return min(self.prep_rate, self.cpu_rate)
        seconds = _processes(self.workers, self.cores) / self.P + self._wait_per_sample  # of one worker, per sample
        return min(min(self.P, self.workers / seconds) / (1 if self.coordinated else self.jobs), self.cpu_rate)

    @property
    def _wait_per_sample(self) -> float:
        """Seconds a worker waits per sample of an epoch for what it reads: storage's misses and the disk's."""
        return self._from_storage * self.miss_wait + self._from_disk * self.L_disk

    @property
    def miss_wait(self) -> float:
        """Seconds a worker waits per miss: ``L``, or ``L / concurrency`` where it reads its misses at once."""
        return self.L / max(1, self.concurrency)

    @property
    def predicted(self) -> float:
        """Samples/s of one job: ``min(F, contention · min(W, G))``; with no workers the training process
        fetches, prepares and trains in turn, so the three times add up."""
        if self.workers == 0:
            return 1.0 / (1.0 / self.fetch_rate + 1.0 / self.prep_rate + 1.0 / self.G)
        return min(self.fetch_rate, self.contention * min(self.worker_rate, self.G))

    @property
    def bottleneck(self) -> str:
        """The least rate: ``"fetch"``, ``"prep"`` (the workers) or ``"ingestion"`` (no data stall). Workers
        that spend longer waiting for their misses than preparing are held by fetching."""
        c = self.contention
        rates = {"ingestion": c * self.G, "prep": c * self.worker_rate, "fetch": self.fetch_rate}
        least = min(rates, key=lambda k: (rates[k], list(rates).index(k)))  # a tie: the stage nearest the step
        return "fetch" if least == "prep" and self._waits_more_than_prep() else least

    def _waits_more_than_prep(self) -> bool:
        """Whether each worker waits longer per sample for its misses than it takes preparing (W is then
        below P by its waits, not held by the cores)."""
        if not self.workers or self.fetch_threads or self.lookahead or self.worker_rate >= self.cpu_rate:
            return False
        return self._wait_per_sample > _processes(self.workers, self.cores) / self.P

    def stalls(self, samples_per_s: float | None = None) -> dict:
        """Seconds per epoch of a rank, as the model splits it: the training step alone (``ideal_s``), lost to
        prep (``prep_s``: prep's own rate, or the cores it takes from the training process) and lost to
        fetching (``fetch_s``: what the fetch rate and the workers' waits for misses cost beyond that); the
        three add up to an epoch at the predicted rate. Given a measured ``samples_per_s``, also
        ``unexplained_s``: the measured epoch less the predicted one (negative: faster), which the model
        does not book as a stall of either kind."""
        samples = self.samples / (self.servers * self.ranks)  # a rank's share of an epoch
        ideal_s = samples / self.G
        if self.workers == 0:  # nothing overlaps: prep costs its own time, fetching its own
            prep_s = samples / self.prep_rate
        else:
            prep_s = max(0.0, samples / (self.contention * min(self.prep_rate, self.cpu_rate, self.G)) - ideal_s)
        out = {"ideal_s": ideal_s, "prep_s": prep_s,
               "fetch_s": max(0.0, samples / self.predicted - ideal_s - prep_s)}
        if samples_per_s is not None:
            out["unexplained_s"] = samples / samples_per_s - samples / self.predicted
        return out

    # -- what if ---------------------------------------------------------------------------------------------

    def with_changes(self, *, cache_fraction=None, workers=None, storage_factor=1.0, servers=None, jobs=None,
                     coordinated=None, R=None, peer_share=None, lookahead=None, disk_fraction=None,
                     K=None) -> "Pipeline":
        """The pipeline with another cache, worker count, storage ``storage_factor`` times as fast, servers,
        jobs, peer rate, share fetched from peers, look-ahead (GETs in flight; ``S`` stays as measured), disk
        tier's share of the dataset or rate. More workers scale ``P`` in proportion to the processes
        doing prep, up to the cores (the measured rate per process times the processes); the measured
        ``contention`` stays. Another cache or servers drop a given ``peer_share`` (the caches' own again)."""
        changes = {"S": self.S * storage_factor}
        if cache_fraction is not None or servers is not None:
            changes["peer_share"] = None
        if cache_fraction is not None:
            changes["cache_fraction"] = min(1.0, cache_fraction)
        if workers is not None:
            changes.update(workers=workers, P=self.P * _processes(workers, self.cores) /
                           _processes(self.workers, self.cores))
            if self.fetch_threads:  # the DALI backend fetches on as many threads as it prepares on
                changes["fetch_threads"] = max(workers, 1)
        for name, value in (("servers", servers), ("jobs", jobs), ("coordinated", coordinated), ("R", R),
                            ("peer_share", peer_share), ("lookahead", lookahead), ("K", K),
                            ("disk_fraction", None if disk_fraction is None else min(1.0, disk_fraction))):
            if value is not None:
                changes[name] = value
        return dataclasses.replace(self, **changes)

    def cache_knee(self) -> float | None:
        """The least cache fraction at which fetching no longer limits the job (``F ≥ contention · min(W, G)``);
        None when no cache on this server can do it (the cache's own rate is below the target)."""
        def fits(x):
            p = self.with_changes(cache_fraction=x)
            return p.fetch_rate >= p.contention * min(p.worker_rate, p.G) * (1 - 1e-12)

        if not fits(1.0):
            return None
        low, high = 0.0, 1.0  # F grows with x: bisect to 1e-6
        if fits(low):
            return 0.0
        while high - low > 1e-6:
            mid = (low + high) / 2
            low, high = (low, mid) if fits(mid) else (mid, high)
        return high

    def disk_knee(self) -> float | None:
        """The least share of the dataset a disk tier must hold that removes the fetch stall; 0 when there is
        none to remove, None without a disk rate or when even the whole dataset on disk would not do."""
        if self.K is None:
            return None

        def fits(h):
            p = self.with_changes(disk_fraction=h)
            return p.fetch_rate >= p.contention * min(p.worker_rate, p.G) * (1 - 1e-12)
        if fits(0.0):
            return 0.0
        if not fits(1.0):
            return None
        low, high = 0.0, 1.0
        while high - low > 1e-6:
            mid = (low + high) / 2
            low, high = (low, mid) if fits(mid) else (mid, high)
        return high

    def workers_knee(self) -> int | None:
        """The fewest workers (at least 1) that keep up with the training step (``W ≥ G``); None when twice
        as many as the cores cannot."""
        for workers in range(1, 2 * self.cores + 1):  # with none, prep never overlaps the step
            if self.with_changes(workers=workers).worker_rate >= self.G * (1 - 1e-12):
                return workers
        return None


    def lookahead_knee(self) -> int | None:
        """The fewest GETs in flight ahead of the loop that remove the fetch stall (``F ≥ contention · min(W,
        G)`` with the workers waiting for none); 0 when nothing is fetched, None when the store's rate ``S``
        (or the cache's) is what holds fetching, which no look-ahead changes."""
        misses = self._from_storage
        if misses == 0 or self.L == 0:
            return 0
        ahead = self.with_changes(lookahead=1)
        target = ahead.contention * min(ahead.worker_rate, ahead.G)
        depth = max(1, math.ceil(target * misses * self.L * (1 - 1e-12)))
        if self.with_changes(lookahead=depth).fetch_rate < target * (1 - 1e-9):
            return None
        return depth


def _processes(workers: int, cores: int) -> int:
    """Processes doing prep: the workers (the main process when there are none), at most the cores."""
    return min(max(workers, 1), cores)


def answers(pipeline: Pipeline, jobs=(2, 4), servers=(2, 4)) -> list[dict]:
    """The standard what-if questions about ``pipeline``, each with the predicted samples/s (per job)."""
    p = pipeline
    out = []
    knee = p.cache_knee()
    out.append({"question": "smallest cache that removes the fetch stall",
                "cache_fraction": knee, "cache_bytes": None if knee is None else knee * p.samples * p.sample_bytes,
                "samples_per_s": None if knee is None else p.with_changes(cache_fraction=knee).predicted})
    workers = p.workers_knee()
    out.append({"question": "fewest workers that remove the prep stall", "workers": workers,
                "samples_per_s": None if workers is None else p.with_changes(workers=workers).predicted})
    if p.concurrency:  # an object store
        depth = p.lookahead_knee()
        out.append({"question": "fewest GETs in flight ahead of the loop that remove the fetch stall",
                    "lookahead": depth,
                    "samples_per_s": None if depth is None else p.with_changes(lookahead=depth).predicted})
    if p.K is not None:
        knee = p.disk_knee()
        out.append({"question": "smallest disk tier that removes the fetch stall", "disk_fraction": knee,
                    "disk_bytes": None if knee is None else knee * p.disk_dataset_bytes,
                    "samples_per_s": None if knee is None else p.with_changes(disk_fraction=knee).predicted})
    out.append({"question": "storage twice as fast", "storage_factor": 2.0,
                "samples_per_s": p.with_changes(storage_factor=2.0).predicted})
    for k in jobs:
        out.append({"question": f"{k} jobs at once, coordinated prep against each on its own", "jobs": k,
                    "samples_per_s": p.with_changes(jobs=k, coordinated=True).predicted,
                    "uncoordinated_samples_per_s": p.with_changes(jobs=k, coordinated=False).predicted})
    if p.R is not None:
        for n in servers:
            out.append({"question": f"{n} servers with partitioned caching", "servers": n,
                        "samples_per_s": p.with_changes(servers=n).predicted})
    return out
