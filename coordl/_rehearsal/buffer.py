"""The rehearsal buffer: which samples of the stream so far are kept as exemplars, decided by a seeded state machine.

NOTE [ Buffer policies ]
Samples are offered one at a time, each once in the stream's life (``RehearsalBatches`` offers a sample
the first time the stream hands it out as new), with its group: its class (``class_balanced``), its
experience (``experience_balanced``), none (``reservoir``). With K slots and the n-th sample offered:
  - ``reservoir`` (Vitter's algorithm R): kept while fewer than K are held; else drawn j uniform in
    [0, n) and kept in slot j if j < K, replacing its sample. Every sample offered so far is held with
    probability K/n.
  - ``class_balanced`` and ``experience_balanced`` (class-balanced reservoir sampling): kept while fewer
    than K are held; else, if its group holds fewer than the largest group, it replaces a member drawn
    at random from the largest group (the lowest-numbered of those tied); if its group is among the
    largest, it replaces a random member of its own group with probability m/n_g (m members of its
    group, n_g of its group offered), as a reservoir within the group. Once every group seen has
    offered enough samples, each holds ⌊K/C⌋ or ⌈K/C⌉ of the K slots (C groups seen).
The offers' draws come from the buffer's own numpy ``Generator``, so the same seed and the same offers give
the same buffer; :meth:`RehearsalBuffer.state` holds all of it. A replay (:func:`draw`) draws r distinct
members uniformly from the union of one or more buffers (one per rank: ``_rehearsal.options``), leaving out
the batch's own new samples, with a generator of its own.
"""

import numpy as np

POLICIES = ("reservoir", "class_balanced", "experience_balanced")


class RehearsalBuffer:
    """K slots of sample indices and the draws that fill them (see NOTE [ Buffer policies ]).

    Args:
        capacity: K, the most exemplars held.
        policy: one of :data:`POLICIES`.
        seed: seeds every draw.
    """

    def __init__(self, capacity: int, policy: str, seed: int):
        if policy not in POLICIES:
            raise ValueError(f"policy should be one of {POLICIES}, but got policy={policy!r}")
        self.capacity, self.policy = int(capacity), policy
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self.items: list[int] = []  # slot -> sample index
        self.groups: list[int] = []  # slot -> its group (its class or experience; 0 under reservoir)
        self.offered = 0
        self._offered_in: dict[int, int] = {}  # group -> samples of it offered
        self._slots_of: dict[int, list[int]] = {}  # group -> its slots
        self._place: list[int] = []  # slot -> its position in its group's list
        self._slot_of: dict[int, int] = {}  # member -> its slot

    @property
    def balanced(self) -> bool:
        return self.policy != "reservoir"

    def __len__(self) -> int:
        return len(self.items)

    def offer(self, index: int, group: int = 0) -> bool:
        """Offer sample ``index`` of ``group``; whether it is now a member."""
        self.offered += 1
        group = int(group) if self.balanced else 0
        seen = self._offered_in[group] = self._offered_in.get(group, 0) + 1
        if len(self.items) < self.capacity:
            self._append(int(index), group)
            return True
        if not self.balanced:
            j = int(self._rng.integers(self.offered))
            if j < self.capacity:
                self._replace(j, int(index), group)
                return True
            return False
        own = self._slots_of.get(group, [])
        largest = max(len(slots) for slots in self._slots_of.values())
        if len(own) < largest:
            victim = min(g for g, slots in self._slots_of.items() if len(slots) == largest)
            slots = self._slots_of[victim]
            self._replace(slots[int(self._rng.integers(len(slots)))], int(index), group)
            return True
        j = int(self._rng.integers(seen))
        if j < len(own):
            self._replace(own[j], int(index), group)
            return True
        return False

    def __contains__(self, index) -> bool:
        return index in self._slot_of

    def counts(self) -> dict[int, int]:
        """Members per group (class or experience; one group under reservoir)."""
        return {g: len(slots) for g, slots in sorted(self._slots_of.items()) if slots}

    def _append(self, index: int, group: int) -> None:
        slot = len(self.items)
        self._slot_of[index] = slot
        self.items.append(index)
        self.groups.append(group)
        slots = self._slots_of.setdefault(group, [])
        self._place.append(len(slots))
        slots.append(slot)

    def _replace(self, slot: int, index: int, group: int) -> None:
        old = self.groups[slot]
        if old != group:
            slots, at = self._slots_of[old], self._place[slot]
            moved = slots[-1]  # the last of the old group's slots takes this one's place there
            slots[at], self._place[moved] = moved, at
            slots.pop()
            new = self._slots_of.setdefault(group, [])
            self._place[slot] = len(new)
            new.append(slot)
        del self._slot_of[self.items[slot]]
        self._slot_of[index] = slot
        self.items[slot], self.groups[slot] = index, group

    # -- checkpoints ---------------------------------------------------------------------------------

    def state(self) -> dict:
        """Everything the buffer's next offers and draws depend on (plain Python values)."""
        return {"capacity": self.capacity, "policy": self.policy, "items": list(self.items),
                "groups": list(self.groups), "offered": self.offered, "offered_in": dict(self._offered_in),
                "slots_of": {g: list(slots) for g, slots in self._slots_of.items()},  # their order decides draws
                "rng": self._rng.bit_generator.state}

    def set_state(self, state: dict) -> None:
        """Make this buffer the one ``state`` (from :meth:`state`) describes."""
        if (state["capacity"], state["policy"]) != (self.capacity, self.policy):
            raise ValueError(f"the state is of a buffer of capacity={state['capacity']} policy={state['policy']!r}; "
                             f"this one has capacity={self.capacity} policy={self.policy!r}")
        self.items, self.groups = [int(i) for i in state["items"]], [int(g) for g in state["groups"]]
        self._slot_of = {index: slot for slot, index in enumerate(self.items)}
        self._slots_of, self._place = {}, [0] * len(self.items)
        for group, slots in state["slots_of"].items():
            self._slots_of[int(group)] = [int(s) for s in slots]
            for at, slot in enumerate(slots):
                self._place[slot] = at
        self.offered, self._offered_in = int(state["offered"]), {int(g): int(n) for g, n in state["offered_in"].items()}
        self._rng.bit_generator.state = state["rng"]


def draw(buffers: list[RehearsalBuffer], r: int, besides: list[int], rng: np.random.Generator) -> list[int]:
    """``r`` distinct members of the union of ``buffers`` drawn uniformly, leaving out those in ``besides`` (a
    batch's new samples, so a batch holds no sample twice); all of them, in a random order, while fewer are
    held."""
    held = sum(len(b) for b in buffers)
    excluded = sum(1 for index in besides if any(index in b for b in buffers))
    if held - excluded <= 0 or r <= 0:
        return []
    # the first r + excluded of a uniform order, less the excluded: the first r of a uniform order of the rest
    picks = rng.choice(held, size=min(r + excluded, held), replace=False).tolist()
    items = buffers[0].items if len(buffers) == 1 else [i for b in buffers for i in b.items]
    drawn = [items[k] for k in picks]
    if excluded:
        leave = set(besides)
        drawn = [i for i in drawn if i not in leave]
    return drawn[:r]
