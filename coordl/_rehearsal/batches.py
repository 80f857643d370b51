"""The batches of a loader over an experience stream: the current experience's samples, and exemplars replayed.

NOTE [ Rehearsal batches ]
Each pass draws the stream's current experience (:class:`ExperienceSampler`: shuffled as torch's
``RandomSampler`` shuffles, from the loader's ``generator`` or the global RNG), cut into batches of b
(``batch_size``) as torch's ``BatchSampler`` cuts them, so every new sample is seen once per epoch. With a
``Rehearsal``, each batch then gets r replayed samples drawn from the buffer (:class:`Replayed` indices),
b + r in all, fewer replayed only while the buffer holds fewer than r members besides the batch's own new
samples (a batch holds no sample twice). The new samples are offered to the buffer once in the stream's
life: as each batch is drawn (after its replays are), or, the pass's all at once, as its last batch is
drawn (``admit``; a pass cut short offers nothing, and its samples are offered by a later one). Replays are
read as any sample is, through the node's cache, and decoded and augmented afresh by the dataset's own
transform.

Under a ``DistributedSampler`` of W ranks, each rank's share of the experience is what that sampler would
draw over the experience alone (:class:`DistributedExperienceSampler`), and the ``Rehearsal`` holds W
buffers, buffer k offered rank k's samples. Every rank computes every rank's shares, so every rank holds
the same W buffers without a byte exchanged, and each draws its r replays uniformly from their union
(with a generator of its own: ranks replay different exemplars). A replay of a sample another server's cache
or exemplar region holds is read as any sample is: with partitioned caching, from that server (so a batch
makes at most r peer fetches for its replays).

The plan depends on the buffers and on which experience is current, so both are part of what a checkpoint
holds for a pass (``plan_state``, see ``_epochs.resume_state`` NOTE [ Resuming a pass ]): a resumed pass
puts them back as they were when it started and draws the same plan again.
"""

import copy
import math

import torch
import torch.utils.data
from torch.utils.data.distributed import DistributedSampler

from coordl._rehearsal.options import Rehearsal
from coordl._rehearsal.stream import ExperienceStream, Replayed


class ExperienceSampler(torch.utils.data.Sampler):
    """The samples (stream indices) of ``stream``'s current experience, shuffled as torch's ``RandomSampler``
    (``shuffle``), else in order. ``experiences``: how many of the stream's experiences the loader was built
    over (its cache covers those)."""

    rank, world = 0, 1

    def __init__(self, stream: ExperienceStream, shuffle: bool, generator: torch.Generator | None = None,
                 experiences: int | None = None):
        self.stream, self.shuffle, self.generator = stream, bool(shuffle), generator
        self.experiences = len(stream.datasets) if experiences is None else experiences

    def current(self):
        """The current experience, or RuntimeError if it came after this loader was built."""
        number = self.stream.current
        if number >= self.experiences:
            raise RuntimeError(f"the stream's experience {number} was added after this loader was built over its first "
                               f"{self.experiences}: build a new coordl.DataLoader over the stream (hand it the same "
                               f"rehearsal= to keep the buffer)")
        return self.stream.experience(number)

    def __iter__(self):
        experience = self.current()
        if not self.shuffle:
            yield from range(experience.start, experience.stop)
            return
        generator = self.generator
        if generator is None:  # as torch's RandomSampler draws its seed
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            generator = torch.Generator()
            generator.manual_seed(seed)
        yield from (torch.randperm(len(experience), generator=generator) + experience.start).tolist()

    def __len__(self) -> int:
        return len(self.current())

    def shards(self) -> list:
        """Every rank's samples of this pass (here one rank's: this sampler)."""
        return [self]


class DistributedExperienceSampler(ExperienceSampler):
    """This rank's share of the current experience, drawn as ``distributed`` (a torch ``DistributedSampler``
    over the stream, whose seed, shuffle, ``drop_last``, rank, ranks and epoch it takes) would draw over the
    experience alone."""

    def __init__(self, stream: ExperienceStream, distributed: DistributedSampler, experiences: int | None = None):
        self.stream, self.distributed = stream, distributed
        self.shuffle, self.rank, self.world = distributed.shuffle, distributed.rank, distributed.num_replicas
        self.experiences = len(stream.datasets) if experiences is None else experiences

    @property
    def epoch(self) -> int:
        return self.distributed.epoch

    def set_epoch(self, epoch: int) -> None:
        self.distributed.set_epoch(epoch)

    def _per_rank(self, n: int) -> int:
        d = self.distributed
        return math.ceil((n - d.num_replicas) / d.num_replicas) if d.drop_last and n % d.num_replicas else \
            math.ceil(n / d.num_replicas)

    def shards(self) -> list[list[int]]:
        """Every rank's samples of the current experience this pass, padded or cut as ``DistributedSampler``
        does, so every rank has as many."""
        experience, d = self.current(), self.distributed
        n = len(experience)
        if d.shuffle:
            g = torch.Generator()
            g.manual_seed(d.seed + d.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        total = self._per_rank(n) * self.world
        order = (order * math.ceil(total / n))[:total]
        return [[experience.start + i for i in order[rank:total:self.world]] for rank in range(self.world)]

    def __iter__(self):
        yield from self.shards()[self.rank]

    def __len__(self) -> int:
        return self._per_rank(len(self.current()))


class RehearsalBatches:
    """A pass's batches: b new samples of the current experience, then r replayed (see NOTE [ Rehearsal batches ]).

    Args:
        sampler: the :class:`ExperienceSampler` (a :class:`DistributedExperienceSampler` under DDP).
        batch_size, drop_last: b, and torch's ``drop_last``.
        rehearsal: what to replay, or None (the current experience alone: fine-tuning).
    """

    def __init__(self, sampler: ExperienceSampler, batch_size: int, drop_last: bool, rehearsal: Rehearsal | None):
        self.sampler, self.batch_size, self.drop_last, self.rehearsal = sampler, batch_size, drop_last, rehearsal
        self.replays = 0 if rehearsal is None else rehearsal.replayed_per_batch(batch_size)
        if rehearsal is not None:
            rehearsal.bind(sampler.world)
        self.experience: int | None = None  # the latest pass's
        self.exemplars = None  # the node's exemplar region, where the cache cannot hold the stream
        self.peers = None  # a partitioned job's peer tier: the region holds this server's ranks' members alone

    def __iter__(self):
        self.experience = self.sampler.current().number
        rehearsal, rank = self.rehearsal, self.sampler.rank
        if rehearsal is None:
            yield from torch.utils.data.BatchSampler(self.sampler, self.batch_size, self.drop_last)
            return
        # every rank's batches side by side (they have as many): each rank's samples go to its buffer
        steps = list(zip(*(list(torch.utils.data.BatchSampler(shard, self.batch_size, self.drop_last))
                           for shard in self.sampler.shards())))
        if self.exemplars is not None:
            self._want(self._wanted(steps))
        for step, batches in enumerate(steps):
            replayed = [Replayed(i) for i in rehearsal.replay(rank, self.replays, besides=batches[rank])]
            self._offer(rehearsal, steps, step)  # after the replays: a batch replays nothing it brings
            yield list(batches[rank]) + replayed

    def _offer(self, rehearsal: Rehearsal, steps: list, step: int) -> list[tuple[int, int]]:
        """Offer ``rehearsal``'s buffers what step ``step`` of the pass offers (see NOTE [ Rehearsal batches ]): each
        rank's batch's fresh samples, or, at the last step under ``admit="epoch_end"``, its whole pass's; the
        samples admitted, (buffer, sample) in their order."""
        if rehearsal.admit == "on_sight":
            offers = [(k, rehearsal.fresh(batch)) for k, batch in enumerate(steps[step])]
        elif step == len(steps) - 1:
            offers = [(k, rehearsal.fresh([i for batches in steps for i in batches[k]])) for k in range(len(steps[0]))]
        else:
            return []
        admitted, stream = [], self.sampler.stream
        for k, indices in offers:
            buffer = rehearsal.buffers[k]
            for index in indices:
                group = label_group(stream, index) if buffer.policy == "class_balanced" else stream.locate(index)[0]
                if buffer.offer(index, group):
                    admitted.append((k, index))
        return admitted

    def _wanted(self, steps: list) -> list[set[int]]:
        """What the pass may replay or admit, buffer by buffer: the members now, and those the pass's offers admit
        (the pass played on a copy of the buffers: the offers follow from their seeds); under
        ``admit="epoch_end"`` only those still members at its end (the offers come all at once, after the last
        replays are drawn)."""
        rehearsal = copy.deepcopy(self.rehearsal)
        wanted = [set(buffer.items) for buffer in rehearsal.buffers]
        for step in range(len(steps)):
            for k, index in self._offer(rehearsal, steps, step):
                if rehearsal.admit != "epoch_end" or index in rehearsal.buffers[k]:
                    wanted[k].add(index)
        return wanted

    def _want(self, wanted: list[set[int]]) -> None:
        """Have the node's region hold ``wanted`` (:meth:`_wanted`): every buffer's, or, in a partitioned job whose
        ranks are the buffers', this server's ranks' alone, the others' read from their servers' regions
        (``_rehearsal.exemplars`` NOTE [ Exemplar region ])."""
        servers = None if self.peers is None else self.peers.servers_of(len(wanted))
        if servers is None:
            self.exemplars.keep(set().union(*wanted))
            return
        here = self.peers.topology.node
        self.exemplars.keep(set().union(*(w for w, node in zip(wanted, servers) if node == here)))
        self.peers.lend({i: node for w, node in zip(wanted, servers) if node != here for i in w})

    def __len__(self) -> int:
        return len(torch.utils.data.BatchSampler(self.sampler, self.batch_size, self.drop_last))

    def plan_state(self) -> dict:
        """What this pass's plan depends on beside the generators: the current experience and the buffers."""
        return {"experience": self.sampler.stream.current,
                "rehearsal": None if self.rehearsal is None else self.rehearsal.state()}

    def set_plan_state(self, state: dict) -> None:
        self.sampler.stream.current = state["experience"]
        if self.rehearsal is not None and state["rehearsal"] is not None:
            self.rehearsal.set_state(state["rehearsal"])

    def members(self) -> list[int]:
        return [] if self.rehearsal is None else self.rehearsal.members()


def label_group(stream: ExperienceStream, index: int) -> int:
    """The class of sample ``index`` as a group number (its label, an integer)."""
    target = stream.target(index)
    try:
        return int(target)
    except (TypeError, ValueError):
        raise ValueError(f"policy='class_balanced' needs integer class labels; sample {index} has {target!r}") from None


def check_labels(stream: ExperienceStream, rehearsal: Rehearsal) -> None:
    """ValueError, at construction, if ``rehearsal``'s policy needs labels some experience does not have."""
    if rehearsal.policy != "class_balanced":
        return
    for number, dataset in enumerate(stream.datasets):
        start = stream.experience(number).start
        try:
            label_group(stream, start)
        except AttributeError:
            raise ValueError(f"rehearsal policy='class_balanced' needs each sample's class, but experience {number} "
                             f"({type(dataset).__name__}) has no targets (a list of labels) or dali_target(i); give "
                             f"it one, or use policy='reservoir' or 'experience_balanced'") from None
