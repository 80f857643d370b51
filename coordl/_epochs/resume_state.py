"""Mid-epoch checkpoints of a coordl loader: what a pass over its batch sampler saves, and how a resumed
pass replays it.

NOTE [ Resuming a pass ]
A pass's batches are its sampler's draws, so a checkpoint holds what those draws came from, not the
batches: at the pass's first ``next()``, just before its plan is drawn, the state of every
``torch.Generator`` the plan can draw from (the loader's ``generator`` and the samplers') and of the
global torch RNG (what samplers without a generator use, torch's ``RandomSampler`` included), a
``DistributedSampler``'s epoch, what else the plan depends on (an experience stream's current experience
and rehearsal buffer, ``_rehearsal.batches``), and how many batches the training loop has consumed. A
resumed pass sets those generators to the saved states, draws the whole plan again with the global RNG set to the
saved state inside ``torch.random.fork_rng`` (so the global RNG is left as the user has it), skips the
consumed batches and hands torch the rest. The generators end where the interrupted run's were after
that epoch, so later epochs (their orders and torch's base seeds for the workers) are the
uninterrupted run's. The base seed torch draws for the resumed pass itself is undone (the interrupted
run drew it already), so a resumed pass leaves the global RNG as it found it. A state taken before a
pass's first batch or after its last is an epoch boundary: it holds the generators' states then, and
the next pass starts from them.

Where a pass draws from the global torch RNG (no ``generator``: torch's base seed, and the seed torch's
``RandomSampler`` draws for each epoch), the next epoch's order is whatever that RNG holds when it starts,
as with torch. So a state also holds the global RNG as it was when the state was taken, and
``load_state_dict`` sets it back: the resumed job's next epochs are the uninterrupted job's, provided its
training draws what that job drew after the checkpoint (the same steps). torchdata's own
``StatefulDataLoader`` gets there by giving its default sampler a generator of fixed seed, which changes the
order a torch loader draws; coordl's order stays torch's. A loader with a ``generator`` leaves the global RNG
alone, and so does a rank other than the one whose state it is (a DDP job's checkpoint is often rank 0's: the
others keep their own streams, and say so). A ``StatefulDataLoader`` around coordl's batch sampler takes the
state as it draws each batch, some steps before its own ``state_dict()``, so that global RNG is as much
older (Accelerate's ``load_state`` sets the RNG afterwards, from its own checkpoint).

Not restored: random state inside worker processes (an augmentation draws afresh for the rest of the
interrupted epoch, as with torchdata for datasets without ``state_dict``) and Python's and numpy's RNGs.
"""

import torch

STATE_VERSION = 1
_KEY = "coordl_resume"


def _generators(*parts) -> list[torch.Generator]:
    """The distinct generators that ``parts`` (the loader's generator, samplers) draw from, in order."""
    found: dict[int, torch.Generator] = {}
    for part in parts:
        generator = part if isinstance(part, torch.Generator) else getattr(part, "generator", None)
        if isinstance(generator, torch.Generator) and generator.device.type == "cpu":
            found.setdefault(id(generator), generator)
    return list(found.values())


def _epoch_holders(*parts) -> list:
    """The samplers among ``parts`` whose order depends on ``set_epoch`` (``DistributedSampler`` and kin)."""
    return [part for part in parts if callable(getattr(part, "set_epoch", None)) and hasattr(part, "epoch")]


def _planners(*parts) -> list:
    """The parts whose plan depends on state of their own beside generators (``plan_state``/``set_plan_state``:
    the rehearsal batches' buffer and current experience, ``_rehearsal.batches``)."""
    return [part for part in parts if callable(getattr(part, "plan_state", None))]


class RngSources:
    """What a batch sampler's plan draws from: ``parts`` are the loader's generator and the samplers."""

    def __init__(self, *parts):
        self.parts = parts

    def capture(self, *, with_global: bool) -> dict:
        state = {"generators": [g.get_state() for g in _generators(*self.parts)],
                 "epochs": [int(s.epoch) for s in _epoch_holders(*self.parts)],
                 "plans": [part.plan_state() for part in _planners(*self.parts)]}
        if with_global:
            state["global"] = torch.get_rng_state()
        return state

    def check(self, state: dict, *, what: str) -> None:
        """ValueError unless ``state`` was captured from sources like these (``what`` loads it)."""
        generators, holders = _generators(*self.parts), _epoch_holders(*self.parts)
        if len(generators) != len(state["generators"]) or len(holders) != len(state["epochs"]):
            raise ValueError(f"{what}: the state was saved with {len(state['generators'])} generator(s) and "
                             f"{len(state['epochs'])} epoch-seeded sampler(s); this loader has {len(generators)} "
                             f"and {len(holders)}. Resume with the loader's sampler, shuffle and generator settings.")
        planners = _planners(*self.parts)
        if len(planners) != len(state.get("plans", [])):
            raise ValueError(f"{what}: the state was saved {'with' if state.get('plans') else 'without'} an experience "
                             f"stream's batches; this loader has {'them' if planners else 'none'}. Resume with the "
                             f"same dataset and rehearsal= settings.")

    def restore(self, state: dict, *, what: str) -> None:
        """Set the generators and epochs to ``state``."""
        self.check(state, what=what)
        for generator, saved in zip(_generators(*self.parts), state["generators"]):
            generator.set_state(saved)
        self.set_epochs(state["epochs"])
        self.set_plans(state)

    def set_plans(self, state: dict) -> None:
        """Put the plans' own state (a stream's current experience, its buffer) back as ``state`` has it."""
        for part, saved in zip(_planners(*self.parts), state.get("plans", [])):
            part.set_plan_state(saved)

    def set_epochs(self, epochs: list[int]) -> None:
        """``set_epoch`` each epoch-seeded sampler to its entry of ``epochs``."""
        for holder, epoch in zip(_epoch_holders(*self.parts), epochs):
            holder.set_epoch(epoch)


def boundary_state(rng: dict) -> dict:
    """A state between passes: the next pass starts from ``rng``."""
    return {_KEY: STATE_VERSION, "rng": rng, "pass": None}


def pass_state(rng: dict, consumed: int, batches: int | None) -> dict:
    """A state inside a pass whose plan was drawn from ``rng`` and whose first ``consumed`` of ``batches``
    batches the training loop has had."""
    return {_KEY: STATE_VERSION, "rng": None, "pass": {"rng": rng, "consumed": int(consumed), "batches": batches}}


def checked(state: dict, what: str) -> dict:
    """``state`` if it is one of these states, else ValueError naming ``what`` loads it."""
    if not isinstance(state, dict) or state.get(_KEY) != STATE_VERSION:
        raise ValueError(f"{what}.load_state_dict: not a coordl loader state (expected a dict from "
                         f"{what}.state_dict() with {_KEY!r}={STATE_VERSION}, got "
                         f"{sorted(state) if isinstance(state, dict) else type(state).__name__})")
    return state


def replay(sources: RngSources, rng: dict, draw) -> list:
    """Draw a pass's whole plan again (``draw()`` iterates the samplers) from the saved ``rng``: the
    generators keep where the draw leaves them; the global RNG is restored afterwards."""
    sources.restore(rng, what="resume")
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(rng["global"])
        return list(draw())
