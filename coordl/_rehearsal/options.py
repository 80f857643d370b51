"""``coordl.Rehearsal``: what a loader over an experience stream replays, and the buffer it replays from."""

import numpy as np
import torch

from coordl._core.sizes import parse_size_option
from coordl._rehearsal.buffer import POLICIES, RehearsalBuffer, draw

ADMIT = ("epoch_end", "on_sight")


class Rehearsal:
    """Replay exemplars of earlier data in every batch of a loader over a :class:`~coordl.ExperienceStream`.

    Args:
        capacity: K, the most exemplars the buffer holds (see ``_rehearsal.buffer`` NOTE [ Buffer policies ]).
        policy: ``"reservoir"`` (every sample seen kept with probability K/n), ``"class_balanced"`` (each
            class seen holds ⌊K/C⌋ or ⌈K/C⌉; needs labels) or ``"experience_balanced"`` (the same per
            experience). Defaults to ``"reservoir"``.
        per_batch: r, the replayed samples added to each batch of ``batch_size`` new ones (fewer only while
            the buffer holds fewer than r). Give this or ``ratio``.
        ratio: r as a share of ``batch_size`` (rounded), instead of ``per_batch``.
        admit: when the new samples are offered to the buffer: ``"epoch_end"``, those of a pass when it ends
            (a batch then replays only what earlier passes admitted); ``"on_sight"``, each batch's as it is
            drawn (after its replays are drawn). Each sample is offered once, the first time it is drawn.
            Defaults to ``"epoch_end"``.
        seed: seeds the buffer's draws. Defaults to None: one drawn from torch's global RNG now (so
            ``torch.manual_seed`` before makes the run repeatable).
        exemplar_bytes: where the node's cache cannot hold the whole stream, the most bytes of shared memory the
            members it does not hold take in a region of their own (``_rehearsal.exemplars`` NOTE [ Exemplar
            region ]): a byte count or a size string such as ``"512MiB"``; 0 keeps none (replays of them are
            read from storage). Defaults to ``"auto"``: room for 2 x capacity items of 1.25 x the stream's mean file
            size (the members, and those a pass admits while the ones they replace may still be replayed).

    One ``Rehearsal`` holds one buffer: hand the same one to a new loader (after ``stream.add``) to keep it.
    Its state is in the loader's ``state_dict()``. Under a ``DistributedSampler`` of W ranks it holds W
    buffers of about K/W each, one per rank, each offered its rank's samples; every rank keeps all W (they
    follow from the seeds and the sampler's shards, so no rank sends another a byte), and each draws its
    replays from their union (see NOTE [ Rehearsal batches ] in ``_rehearsal.batches``).
    """

    def __init__(self, capacity: int, policy: str = "reservoir", *, per_batch: int | None = None,
                 ratio: float | None = None, admit: str = "epoch_end", seed: int | None = None,
                 exemplar_bytes: int | str = "auto"):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"capacity should be a positive number of exemplars, but got capacity={capacity!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy should be one of {POLICIES}, but got policy={policy!r}")
        if (per_batch is None) == (ratio is None):
            raise ValueError(f"give one of per_batch= (replayed samples per batch) or ratio= (a share of batch_size), "
                             f"but got per_batch={per_batch!r}, ratio={ratio!r}")
        if per_batch is not None and (isinstance(per_batch, bool) or not isinstance(per_batch, int) or per_batch < 0):
            raise ValueError(f"per_batch should be a number of samples (0 or more), but got per_batch={per_batch!r}")
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float))
                                  or not 0 <= ratio <= 1):
            raise ValueError(f"ratio should be a share of batch_size from 0 to 1, but got ratio={ratio!r}")
        if admit not in ADMIT:
            raise ValueError(f"admit should be one of {ADMIT}, but got admit={admit!r}")
        self.exemplar_bytes = parse_size_option("exemplar_bytes", exemplar_bytes, allow_zero=True)  # None: auto
        if seed is None:
            seed = int(torch.empty((), dtype=torch.int64).random_().item()) & (2**63 - 1)
        self.capacity, self.policy, self.per_batch, self.ratio, self.admit, self.seed = \
            capacity, policy, per_batch, ratio, admit, seed
        self.buffers = [RehearsalBuffer(capacity, policy, seed)]
        self.draws = 0  # batches whose replays were drawn: each batch's draw is seeded by its number
        self._offered = np.zeros(0, dtype=bool)  # stream index -> offered to the buffer already

    def __repr__(self) -> str:
        r = f"per_batch={self.per_batch}" if self.per_batch is not None else f"ratio={self.ratio}"
        return f"Rehearsal(capacity={self.capacity}, policy={self.policy!r}, {r}, admit={self.admit!r})"

    def bind(self, world: int) -> None:
        """Hold one buffer per rank of a job of ``world`` ranks (capacity split as evenly as it goes); ValueError
        if it holds members for another number of ranks."""
        if len(self.buffers) == world:
            return
        if any(len(b) for b in self.buffers):
            raise ValueError(f"rehearsal={self!r} holds a buffer for {len(self.buffers)} rank(s); this loader has "
                             f"{world}: give it a new Rehearsal")
        if self.capacity < world:
            raise ValueError(f"rehearsal capacity={self.capacity} is less than one exemplar for each of {world} ranks")
        seeds = np.random.SeedSequence(self.seed).generate_state(world, dtype=np.uint64).tolist() if world > 1 \
            else [self.seed]
        self.buffers = [RehearsalBuffer(self.capacity // world + (k < self.capacity % world), self.policy, seed)
                        for k, seed in enumerate(seeds)]

    def members(self) -> list[int]:
        """Every buffer's members, rank by rank."""
        return [i for b in self.buffers for i in b.items]

    def replay(self, rank: int, r: int, besides: list[int]) -> list[int]:
        """The replays of the next batch of ``rank``: r members of the union drawn uniformly (``buffer.draw``),
        from a generator seeded by the seed, the rank and the batch's number, so any rank's checkpoint resumes
        every rank."""
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, rank, self.draws])))
        self.draws += 1
        return draw(self.buffers, r, besides, rng)

    def replayed_per_batch(self, batch_size: int) -> int:
        """r for batches of ``batch_size`` new samples; ValueError if it is more than ``batch_size``."""
        r = self.per_batch if self.per_batch is not None else int(round(self.ratio * batch_size))
        if r > batch_size:
            raise ValueError(f"rehearsal={self!r}: per_batch={r} replayed samples is more than batch_size={batch_size} "
                             f"new ones; give per_batch <= batch_size (or ratio <= 1)")
        return r

    def fresh(self, indices: list[int]) -> list[int]:
        """Those of ``indices`` never offered to the buffer, now marked offered, in their order."""
        if not indices:
            return []
        at = np.asarray(indices, dtype=np.int64)
        if at.max() >= len(self._offered):
            grown = np.zeros(max(int(at.max()) + 1, 2 * len(self._offered)), dtype=bool)
            grown[:len(self._offered)] = self._offered
            self._offered = grown
        new = at[~self._offered[at]]
        self._offered[new] = True
        return new.tolist()

    def state(self) -> dict:
        """The buffers' state, the batches drawn and which samples were offered (see ``RehearsalBuffer.state``)."""
        return {"buffers": [b.state() for b in self.buffers], "draws": self.draws,
                "offered": np.packbits(self._offered).tobytes(), "offered_len": len(self._offered)}

    def set_state(self, state: dict) -> None:
        if len(state["buffers"]) != len(self.buffers):
            raise ValueError(f"the state holds the buffers of {len(state['buffers'])} rank(s); this loader's rehearsal "
                             f"has {len(self.buffers)}")
        for buffer, saved in zip(self.buffers, state["buffers"]):
            buffer.set_state(saved)
        self.draws = int(state["draws"])
        bits = np.unpackbits(np.frombuffer(state["offered"], dtype=np.uint8))
        self._offered = bits[:state["offered_len"]].astype(bool)
