"""Locality-aware batch assignment: each rank loads the samples its own server caches.

With partitioned caching a rank still reads most of its shard from peers: a fraction (p - 1)/p of every
epoch crosses the network for p servers. The gradient of a synchronous step depends only on which
samples make up the *global* batch, not on which rank takes which (Yang et al., "Locality-aware data
loading", Theorem 1). So each global batch is kept exactly as the ``DistributedSampler`` drew it, and
its samples are reassigned among the ranks: each server takes the samples it caches, the counts are
balanced with Algorithm 1 of that paper (largest surplus to largest deficit, at most p - 1 transfers),
and each server's samples are split among its local ranks. Off-server traffic drops from about
(p - 1)/p of the dataset to about beta = sqrt((1 - 1/p) / (2 pi b)) of it for local batch b.

NOTE [ Locality assignment ]
Every rank computes every global batch from the sampler's seed and epoch (the permutation
``DistributedSampler`` draws, padded or cut as it does; checked against the rank's own sampler) and the
ownership map of ``_peer.tier`` NOTE [ Ownership ], identical on every rank, so all ranks agree without
exchanging a byte per step. For a global batch of ``p x L x b`` positions (p servers of L ranks, local
batch b):
  1. server s keeps the positions it owns, in batch order, up to its quota L x b; the rest is surplus;
  2. positions no server owns fill the deficits, servers in order from the batch's number mod p (they
     are read from storage anyway: so every server reads its share of them, and one whose cache has room
     for an item that did not fit elsewhere gets it, caches it, and owns it from the next map on);
  3. :func:`balance` (Algorithm 1, ties to the lowest server) moves surplus positions to deficits;
  4. each server's positions, in batch order, are split among its local ranks, b each.
Every position of the global batch goes to exactly one rank, and every rank gets exactly b.
"""

import heapq

import numpy as np
import torch
from torch.utils.data.distributed import DistributedSampler


def balance(surplus: dict[int, int], deficit: dict[int, int]) -> list[tuple[int, int, int]]:
    """Algorithm 1: transfers ``(from, to, count)`` that even out ``surplus`` and ``deficit`` (server ->
    samples; equal totals), the largest surplus to the largest deficit first, ties to the lowest server.
    At most (servers involved - 1) transfers; the volume moved is the total deficit."""
    sources = [(-n, s) for s, n in surplus.items() if n > 0]
    sinks = [(-n, s) for s, n in deficit.items() if n > 0]
    if sum(-n for n, _ in sources) != sum(-n for n, _ in sinks):
        raise ValueError(f"surplus {surplus} and deficit {deficit} do not balance")
    heapq.heapify(sources)
    heapq.heapify(sinks)
    transfers = []
    while sources:
        (s_n, s), (d_n, d) = heapq.heappop(sources), heapq.heappop(sinks)
        m = min(-s_n, -d_n)
        transfers.append((s, d, m))
        if -s_n > m:
            heapq.heappush(sources, (s_n + m, s))
        if -d_n > m:
            heapq.heappush(sinks, (d_n + m, d))
    return transfers


def assign(batch: np.ndarray, owner: np.ndarray, servers: int, ranks_per_server: int,
           first: int = 0) -> tuple[list[np.ndarray], int]:
    """Reassign one global batch (sample ids; ``len(batch)`` = servers x ranks_per_server x b) among the
    ranks (see NOTE [ Locality assignment ]); samples no server caches fill deficits from server ``first``
    on. Returns each rank's positions into ``batch`` (rank r is on server r // ranks_per_server) and the
    number of positions balancing moved between servers."""
    quota = len(batch) // servers
    held = owner[batch]
    mine, spare, deficit = [], {}, {}
    for s in range(servers):
        own = np.flatnonzero(held == s)
        mine.append(list(own[:quota]))
        spare[s], deficit[s] = list(own[quota:]), quota - len(mine[s])
    free = list(np.flatnonzero((held < 0) | (held >= servers)))
    for s in [(first + k) % servers for k in range(servers)]:
        take = min(deficit[s], len(free))
        mine[s] += free[:take]
        free, deficit[s] = free[take:], deficit[s] - take
    moved = 0
    for source, sink, m in balance({s: len(rest) for s, rest in spare.items()}, deficit):
        mine[sink] += spare[source][:m]
        spare[source] = spare[source][m:]
        moved += m
    b = quota // ranks_per_server
    out = []
    for s in range(servers):
        positions = np.sort(np.asarray(mine[s], dtype=np.int64))
        out += [positions[j * b:(j + 1) * b] for j in range(ranks_per_server)]
    return out, moved


class LocalityPlan:
    """The batches of one rank in a locality-aware job, from its ``DistributedSampler`` and the ownership
    map (``owner()``: a numpy int16 array, -1 for items no server holds), read when the pass's first batch
    is drawn (after the epoch's map exchange).

    Args:
        sampler: this rank's ``DistributedSampler`` (its seed, epoch, shuffle, padding are every rank's).
        batch_size, drop_last: the loader's.
        owner: returns the current ownership map.
        servers, ranks_per_server: the job's shape (torchrun numbers ranks server by server).
    """

    def __init__(self, sampler: DistributedSampler, batch_size: int, drop_last: bool, owner, servers: int,
                 ranks_per_server: int):
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last
        self.owner, self.servers, self.ranks_per_server = owner, servers, ranks_per_server
        self.moved = 0  # samples another server caches that balancing gave this rank, in the latest pass

    def global_indices(self) -> np.ndarray:
        """Every rank's shard as columns (row i: the i-th sample of every rank), drawn as the
        ``DistributedSampler`` draws; checked against this rank's own."""
        s = self.sampler
        n = len(s.dataset)
        if s.shuffle:
            g = torch.Generator()
            g.manual_seed(s.seed + s.epoch)
            indices = torch.randperm(n, generator=g).numpy()
        else:
            indices = np.arange(n)
        if not s.drop_last:
            pad = s.total_size - len(indices)
            indices = np.concatenate([indices, np.resize(indices, pad)]) if pad > 0 else indices
        else:
            indices = indices[:s.total_size]
        table = indices.reshape(s.num_samples, s.num_replicas)
        if not np.array_equal(table[:, s.rank], np.fromiter(iter(s), dtype=np.int64, count=s.num_samples)):
            raise RuntimeError("locality_aware=True: this DistributedSampler's order is not the one coordl computes for "
                               "every rank (a torch version that draws differently?); pass locality_aware=False")
        return table

    def __iter__(self):
        table, owner = self.global_indices(), self.owner()
        rank, b = self.sampler.rank, self.batch_size
        self.moved = 0
        for start in range(0, len(table), b):
            rows = table[start:start + b]
            if len(rows) < b and self.drop_last:
                return
            batch = rows.reshape(-1)
            first = (start // b) % self.servers
            mine = batch[assign(batch, owner, self.servers, self.ranks_per_server, first)[0][rank]]
            held = owner[mine]
            self.moved += int(np.count_nonzero((held >= 0) & (held != rank // self.ranks_per_server)))
            yield [int(i) for i in mine]

    def __len__(self) -> int:
        n = self.sampler.num_samples
        return n // self.batch_size if self.drop_last else (n + self.batch_size - 1) // self.batch_size


def locality_plan(sampler, batch_size, drop_last: bool, peers, batch_sampler_given: bool) -> LocalityPlan:
    """The batches of a ``locality_aware=True`` loader, or a ``ValueError`` saying why it cannot hold."""
    why = "locality_aware=True"
    if peers is None:
        raise ValueError(f"{why} needs partitioned caching: a job over several servers (torchrun) with the cache on "
                         "(partitioned='auto' or True, cache_bytes not 0)")
    if batch_sampler_given or batch_size is None:
        raise ValueError(f"{why} needs batch_size= and a sampler, not batch_sampler= or batch_size=None: coordl draws "
                         "the global batches itself")
    if not isinstance(sampler, DistributedSampler) or type(sampler).__iter__ is not DistributedSampler.__iter__:
        raise ValueError(f"{why} needs torch's DistributedSampler (sampler=DistributedSampler(dataset), or a framework "
                         f"that adds one), whose global batches every rank can compute; got {type(sampler).__name__}")
    t = peers.topology
    if (sampler.num_replicas, sampler.rank) != (t.world, t.rank):
        raise ValueError(f"{why}: the DistributedSampler is rank {sampler.rank} of {sampler.num_replicas}, but this "
                         f"process is rank {t.rank} of {t.world}")
    if t.rank != t.node * t.local_world + t.local_rank or t.world != t.nodes * t.local_world:
        raise ValueError(f"{why} needs ranks numbered server by server with the same number on each (as torchrun "
                         f"does); rank {t.rank} is local rank {t.local_rank} of {t.local_world} on server {t.node}")
    return LocalityPlan(sampler, batch_size, drop_last, lambda: peers.state.owner, t.nodes, t.local_world)
