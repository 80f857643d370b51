"""The batch sampler a coordl loader hands torch: the epoch's plan, and the epoch boundaries that go with it.

NOTE [ Behaviour in the carried-over objects ]
Frameworks do not keep a ``coordl.DataLoader``: Accelerate and others build a plain torch DataLoader from
its ``dataset``, ``batch_sampler`` and ``collate_fn``. So everything coordl adds lives in those three:
the cache in the dataset proxy, the epoch's plan and boundaries here, prepared batches (DALI, hp_group)
handed through the dataset proxy and unwrapped by the collate function. torch's iterator calls
``iter(batch_sampler)`` at each pass and ``next()`` on it for every batch it starts (and once more per
batch consumed after the plan is exhausted); the :class:`EpochPass` turns those calls into the
epoch's start, plan and end, reported to the loader's ``epochs`` (an :class:`~coordl._epochs.ledger.EpochLedger`).
The pass starts on its first ``next()``, not at ``iter()``: torch draws its base seed in between, so
a plan drawn later uses the generator exactly as torch's own iterator would.

NOTE [ Planning ahead ]
A feed that prepares batches ahead (the DALI pipeline, see ``dali_pipeline._Feeder``) may start on the next
pass before it exists: :meth:`EpochBatchSampler.plan_ahead` draws the first batches that pass would draw if
nothing draws from its generators (or the global RNG) first. It repeats what comes before the draw (torch's
iterator drawing its base seed from the loader's ``generator``, a ``DistributedSampler``'s ``set_epoch`` with
the step it took last), then draws, and sets every generator and epoch back as it was. Only torch's own
samplers are drawn ahead: their passes depend on their random state, epoch and settings, and on nothing a
user's sampler might keep. It is a guess the feed checks: the pass draws its plan as ever, and a feed whose
guess differs drops what it prepared. Where the draw involves the global RNG (no ``generator``), it runs
inside ``torch.random.fork_rng``: draws from it by another thread in those milliseconds are undone and drawn
again.

The batch sampler is also where a loader's position is checkpointed (``state_dict``/``load_state_dict``,
see NOTE [ Resuming a pass ] in ``resume_state``), so torchdata's ``StatefulDataLoader`` (and Accelerate's
``use_stateful_dataloader``), which save and restore a ``Stateful`` batch sampler, resume it too.
"""

import contextlib
import itertools
import weakref

import torch.distributed
import torch.utils.data
import torch.utils.data.distributed
from torch.utils.data.dataloader import _InfiniteConstantSampler

from coordl._core import hooks
from coordl._core.log import warn_caller
from coordl._epochs import resume_state

_DRAWN_AHEAD = (torch.utils.data.SequentialSampler, torch.utils.data.RandomSampler,
                torch.utils.data.SubsetRandomSampler, torch.utils.data.WeightedRandomSampler,
                torch.utils.data.distributed.DistributedSampler)
"""torch's samplers, whose passes depend on their random state, epoch and settings only: those
:meth:`plan_ahead` draws."""


def _rank() -> int:
    """This process's rank in torch.distributed's default group, 0 outside one."""
    distributed = torch.distributed
    return distributed.get_rank() if distributed.is_available() and distributed.is_initialized() else 0


class _PassCheckpoints:
    """``state_dict``/``load_state_dict`` of a sampler whose passes are epochs: the position of its latest
    pass (see NOTE [ Resuming a pass ] in ``resume_state``), and the epochs its passes drew at. Needs
    ``rng_sources()``, ``latest``, ``_resume``, ``_drawn_epochs``."""

    def __getstate__(self) -> dict:
        """Pickled (a loader sent to ``ddp_spawn``'s or ``mp.spawn``'s processes), without its latest pass: the
        copy's next ``iter()`` starts the next epoch afresh (a pass refers to its sampler weakly)."""
        state = self.__dict__.copy()
        state["latest"] = None
        return state

    def drew(self, rng: dict) -> None:
        """A pass drew its plan from ``rng``: keep the epoch-seeded samplers' epochs of the last two draws."""
        self._drawn_epochs = (self._drawn_epochs + [rng["epochs"]])[-2:]

    def state_dict(self) -> dict:
        """Where the latest pass is, counting the batches it handed torch as consumed: right when torch's
        iterator asks (torchdata snapshots the batch sampler as it draws each batch, and in-process
        loading draws each batch as it is consumed)."""
        return self.resume_state()

    def draws_from_global_rng(self) -> bool:
        """Whether a pass draws from the global torch RNG: torch's base seed without the loader's
        ``generator``, or a sampler whose ``generator`` is None (torch's ``RandomSampler`` without one)."""
        return self.generator is None or getattr(self.sampler, "generator", False) is None

    def _with_group(self, state: dict) -> dict:
        """``state`` with, in an hp_group, where the group resumes (see ``GroupFeed.checkpoint``)."""
        group = self.epochs.feed.checkpoint() if getattr(self.epochs, "group", None) is not None else None
        if group is not None:
            state["hp_group"] = group
        return state

    def resume_state(self, consumed: int | None = None) -> dict:
        """Where the latest pass is once the training loop has had ``consumed`` of its batches (None: as
        many as the pass handed torch). A pass not started, run out or wholly consumed is a boundary. With
        the global torch RNG as it is now, where a pass draws from it (NOTE [ Resuming a pass ])."""
        state = self._position(consumed)
        if self.draws_from_global_rng():
            state["global_rng"], state["global_rng_rank"] = torch.get_rng_state(), _rank()
        return state

    def _position(self, consumed: int | None) -> dict:
        current = self.latest
        if self._infinite():
            return resume_state.boundary_state(self.rng_sources().capture(with_global=False))
        if current is not None and current.rng is None and current.pending is not None:
            return self._with_group(resume_state.pass_state(current.pending["rng"], current.skipped,
                                                            current.pending["batches"]))
        if current is None or current.rng is None:
            return self._with_group(resume_state.boundary_state(current.created_rng if current is not None else
                                                                self.rng_sources().capture(with_global=False)))
        ran_out = current.exhausted and consumed is None  # else the plan may run out before the loop has it all
        consumed = current.handed if consumed is None else current.skipped + consumed
        batches = self._length()
        if ran_out or (batches is not None and consumed >= batches):
            return self._with_group(resume_state.boundary_state(self.rng_sources().capture(with_global=False)))
        return self._with_group(resume_state.pass_state(current.rng, consumed, batches))

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state`` (from ``state_dict``): the next pass yields the rest of the saved one, or,
        from a boundary, the next epoch, as the saved loader would have."""
        what = type(self).__name__
        state = resume_state.checked(state, what)
        self._load(state, what)
        if "global_rng" not in state or not self.draws_from_global_rng():
            return
        saved_rank = state.get("global_rng_rank", 0)
        if saved_rank == _rank():
            torch.set_rng_state(state["global_rng"])  # what the next epoch draws from (NOTE [ Resuming a pass ])
        else:
            warn_caller(f"{what}.load_state_dict: the state holds rank {saved_rank}'s global torch RNG; rank "
                        f"{_rank()} keeps its own, so its next epochs' worker seeds are not the uninterrupted "
                        f"run's (pass the loader a generator to make them so)")

    def _load(self, state: dict, what: str) -> None:
        saved = state["pass"]
        self._resume, self._drawn_epochs = None, []
        if getattr(self.epochs, "group", None) is not None and "hp_group" in state:
            self._resume_group(state["hp_group"], mid_epoch=saved is not None, what=what)
        if saved is None:
            self.rng_sources().restore(state["rng"], what=what)
            return
        self.rng_sources().set_plans(saved["rng"])  # the experience the pass drew from decides its length
        batches = self._length()
        if saved["batches"] is not None and batches is not None and saved["batches"] != batches:
            raise ValueError(f"{what}.load_state_dict: the state was saved in an epoch of {saved['batches']} batches; "
                             f"this loader's epochs have {batches}. Resume with the same dataset and batch settings.")
        if getattr(self.epochs, "group", None) is not None:
            self.rng_sources().restore(saved["rng"], what=what)
            return
        self.rng_sources().check(saved["rng"], what=what)
        self._resume = saved

    def _resume_group(self, group: dict, *, mid_epoch: bool, what: str) -> None:
        """Resume the hp_group at the epoch boundary ``group`` names (see ``GroupFeed.resume``), saying so
        when the state was taken mid-epoch or the group runs already."""
        epoch = group["next_epoch"]
        if mid_epoch:
            warn_caller(f"{what}.load_state_dict: a loader in an hp_group resumes at epoch boundaries; this state "
                        f"was saved during group epoch {epoch - 1}, so it goes on with group epoch {epoch}.")
        if not self.epochs.feed.resume(group):
            warn_caller(f"{what}.load_state_dict: the hp_group has already started epochs without this state; "
                        f"this job joins the group's next epoch instead of group epoch {epoch}.")

    def _infinite(self) -> bool:
        """An iterable dataset's sampler: its position is the dataset iterator's, which coordl does not see."""
        return isinstance(self.sampler, _InfiniteConstantSampler)

    def _length(self) -> int | None:
        try:
            return len(self)
        except TypeError:
            return None


class EpochBatchSampler(_PassCheckpoints, torch.utils.data.BatchSampler):
    """torch's ``BatchSampler`` over ``sampler`` whose passes are coordl's epochs.

    Args:
        sampler, batch_size, drop_last: as torch's ``BatchSampler``.
        epochs: the loader's epoch ledger (set by ``coordl.DataLoader``; a sampler re-created by a framework
            from these three arguments gets it when handed to a coordl loader). Defaults to None: plain batches.
        batches: another batch sampler to draw batches from instead of ``sampler`` (a user's ``batch_sampler=``).
        generator: the loader's ``generator`` (torch draws its base seeds from it), for checkpoints.

    Attributes torch and frameworks read (``sampler``, ``batch_size``, ``drop_last``) are those of a
    ``BatchSampler``, and ``len()`` is the pass's number of batches.
    """

    def __init__(self, sampler, batch_size: int, drop_last: bool, *, epochs=None, batches=None, generator=None):
        if batches is None:
            super().__init__(sampler, batch_size, drop_last)
        else:
            self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last
        self.batches = batches
        self.epochs = epochs
        self.generator = generator
        self.latest: EpochPass | None = None
        self._resume: dict | None = None
        self._drawn_epochs: list[list[int]] = []

    def plain_batches(self):
        """This pass's batches as torch would draw them (lists of indices). Drawn through a plain
        ``BatchSampler`` over the same sampler, not this one: the pass keeps its draw, and this sampler
        its latest pass, so a draw holding this sampler would be a cycle keeping a dropped loader (and
        its cache) alive until the garbage collector runs."""
        batches = self.batches if self.batches is not None else \
            torch.utils.data.BatchSampler(self.sampler, self.batch_size, self.drop_last)
        return (list(batch) for batch in batches)

    def plan_ahead(self, batches: int | None = None) -> list[list[int]] | None:
        """The next pass's plan (its first ``batches``) if nothing draws from its random state first, or None
        where it cannot be drawn ahead (see NOTE [ Planning ahead ]). Every generator, the global RNG and the
        samplers' epochs are left as they were."""
        sampler = self.sampler
        if self.batches is not None or type(sampler) not in _DRAWN_AHEAD or \
                (self.generator is not None and self.generator.device.type != "cpu"):
            return None
        sources = self.rng_sources()
        state = sources.capture(with_global=False)
        epochs = state["epochs"]
        if len(self._drawn_epochs) == 2:  # the step set_epoch took between the last two passes
            epochs = [e + (e - before) for e, before in zip(*reversed(self._drawn_epochs))]
        elif epochs:
            epochs = [e + 1 for e in epochs]
        try:
            with torch.random.fork_rng(devices=[]) if self.draws_from_global_rng() else contextlib.nullcontext():
                torch.empty((), dtype=torch.int64).random_(generator=self.generator)  # torch's base seed at iter()
                sources.set_epochs(epochs)
                return list(itertools.islice(self.plain_batches(), batches))
        finally:
            sources.restore(state, what="plan_ahead")

    def __iter__(self):
        if self.epochs is None:
            return self.plain_batches()
        return hooks.epoch_pass(self, lambda: EpochPass(self))

    def __len__(self) -> int:
        return len(self.batches) if self.batches is not None else super().__len__()

    @property
    def moved(self) -> int:
        """Locality-aware batches (``locality.LocalityPlan``): samples of another server's cache that balancing
        gave this rank in the latest pass; else 0."""
        return getattr(self.batches, "moved", 0)

    def rng_sources(self) -> resume_state.RngSources:
        return resume_state.RngSources(self.generator, self.sampler, self.batches, getattr(self.batches, "sampler", None))


class EpochSampler(_PassCheckpoints, torch.utils.data.Sampler):
    """The sampler of an unbatched loader (``batch_size=None``), whose passes are epochs as in
    :class:`EpochBatchSampler`."""

    def __init__(self, sampler, epochs, *, generator=None):
        self.sampler, self.epochs, self.generator = sampler, epochs, generator
        self.latest: EpochPass | None = None
        self._resume: dict | None = None
        self._drawn_epochs: list[list[int]] = []

    def plain_batches(self):
        return iter(self.sampler)

    __iter__ = EpochBatchSampler.__iter__

    def __len__(self) -> int:
        return len(self.sampler)

    def rng_sources(self) -> resume_state.RngSources:
        return resume_state.RngSources(self.generator, self.sampler)


class EpochPass:
    """One pass over an :class:`EpochBatchSampler`: starts the epoch on its first ``next()``, yields the
    epoch's plan, and reports each call after the plan is exhausted (see NOTE [ Behaviour in the
    carried-over objects ]). A pass after ``load_state_dict`` replays the saved one and skips the
    batches consumed (see NOTE [ Resuming a pass ] in ``resume_state``).

    Attributes: ``rng`` (what its plan was drawn from, once started), ``created_rng`` (the generators at
    ``iter()``, before torch draws its base seed), ``pending`` (the saved pass it resumes, or None),
    ``skipped`` and ``handed`` (batches, the skipped included), ``exhausted`` (its plan ran out), ``timed``
    (coordl's own iterator runs it).
    """

    def __init__(self, sampler: EpochBatchSampler):
        # weakly: the sampler keeps its latest pass (for checkpoints), and a cycle would keep a dropped
        # loader's cache attached until the garbage collector runs
        self._sampler, self._plan = weakref.ref(sampler), None
        previous = sampler.latest
        if previous is not None and previous.rng is None and sampler._resume is None:
            # torch's multi-process iterator calls iter() twice before drawing: the first pass was never started
            self.pending, self._global_before, self.created_rng = \
                previous.pending, previous._global_before, previous.created_rng
        else:
            self.pending, sampler._resume = sampler._resume, None
            self._global_before = torch.get_rng_state() if self.pending is not None else None
            self.created_rng = sampler.rng_sources().capture(with_global=False) if self.pending is None else None
        self.rng, self.exhausted = None, False
        self.skipped = self.handed = self.pending["consumed"] if self.pending is not None else 0
        self.timed = False  # coordl's own iterator runs this pass: it times the loop's waits and ends the epoch
        sampler.latest = self

    @property
    def sampler(self):
        """The batch sampler this pass is of (whoever iterates the pass holds it)."""
        return self._sampler()

    def __iter__(self):
        return self

    def _draw(self):
        """This pass's batches: drawn as torch would, or the rest of a saved pass."""
        sampler, saved = self.sampler, self.pending
        if saved is None:
            self.rng = sampler.rng_sources().capture(with_global=True)
            sampler.drew(self.rng)
            return sampler.plain_batches()
        self.rng = saved["rng"]
        sampler.drew(self.rng)
        plan = resume_state.replay(sampler.rng_sources(), self.rng, sampler.plain_batches)
        torch.set_rng_state(self._global_before)  # undo the base seed torch drew for this pass: the saved run drew it
        return plan[self.skipped:]

    def __next__(self) -> list[int]:
        epochs = self.sampler.epochs
        if self._plan is None:
            try:
                plan = epochs.begin(self, self._draw())
            except StopIteration as e:  # out of __next__, torch would take it for an epoch without batches
                raise RuntimeError("coordl: starting the epoch raised StopIteration") from e
            self._plan = iter(plan)
        try:
            batch = next(self._plan)
        except StopIteration:
            self.exhausted = True
            epochs.exhausted(self)
            raise
        self.handed += 1
        epochs.planned(self, batch)
        return batch
