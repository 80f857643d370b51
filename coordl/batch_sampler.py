"""The batch sampler a coordl loader hands torch: the epoch's plan, and the epoch boundaries that go with it.

NOTE [ Behaviour in the carried-over objects ]
Frameworks do not keep a ``coordl.DataLoader``: Accelerate and others build a plain torch DataLoader from
its ``dataset``, ``batch_sampler`` and ``collate_fn``. So everything coordl adds lives in those three:
the cache in the dataset proxy, the epoch's plan and boundaries here, prepared batches (DALI, hp_group)
handed through the dataset proxy and unwrapped by the collate function. torch's iterator calls
``iter(batch_sampler)`` at each pass and ``next()`` on it for every batch it starts (and once more per
batch consumed after the plan is exhausted); the :class:`EpochPass` turns those calls into the
epoch's start, plan and end, reported to the loader's ``epochs`` (an :class:`~coordl.epoch_ledger.EpochLedger`).
The pass starts on its first ``next()``, not at ``iter()``: torch draws its base seed in between, so
a plan drawn later uses the generator exactly as torch's own iterator would.
"""

import torch.utils.data


class EpochBatchSampler(torch.utils.data.BatchSampler):
    """torch's ``BatchSampler`` over ``sampler`` whose passes are coordl's epochs.

    Args:
        sampler, batch_size, drop_last: as torch's ``BatchSampler``.
        epochs: the loader's epoch ledger (set by ``coordl.DataLoader``; a sampler re-created by a framework
            from these three arguments gets it when handed to a coordl loader). Defaults to None: plain batches.
        batches: another batch sampler to draw batches from instead of ``sampler`` (a user's ``batch_sampler=``).

    Attributes torch and frameworks read (``sampler``, ``batch_size``, ``drop_last``) are those of a
    ``BatchSampler``, and ``len()`` is the pass's number of batches.
    """

    def __init__(self, sampler, batch_size: int, drop_last: bool, *, epochs=None, batches=None):
        if batches is None:
            super().__init__(sampler, batch_size, drop_last)
        else:
            self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last
        self.batches = batches
        self.epochs = epochs

    def plain_batches(self):
        """This pass's batches as torch would draw them (lists of indices)."""
        return (list(batch) for batch in (self.batches if self.batches is not None else super().__iter__()))

    def __iter__(self):
        return EpochPass(self) if self.epochs is not None else self.plain_batches()

    def __len__(self) -> int:
        return len(self.batches) if self.batches is not None else super().__len__()


class EpochSampler(torch.utils.data.Sampler):
    """The sampler of an unbatched loader (``batch_size=None``), whose passes are epochs as in
    :class:`EpochBatchSampler`."""

    def __init__(self, sampler, epochs):
        self.sampler, self.epochs = sampler, epochs

    def plain_batches(self):
        return iter(self.sampler)

    def __iter__(self):
        return EpochPass(self) if self.epochs is not None else self.plain_batches()

    def __len__(self) -> int:
        return len(self.sampler)


class EpochPass:
    """One pass over an :class:`EpochBatchSampler`: starts the epoch on its first ``next()``, yields the
    epoch's plan, and reports each call after the plan is exhausted (see NOTE [ Behaviour in the
    carried-over objects ])."""

    def __init__(self, sampler: EpochBatchSampler):
        self.sampler, self._plan = sampler, None

    def __iter__(self):
        return self

    def __next__(self) -> list[int]:
        epochs = self.sampler.epochs
        if self._plan is None:
            self._plan = iter(epochs.begin(self, self.sampler.plain_batches()))
        try:
            batch = next(self._plan)
        except StopIteration:
            epochs.exhausted(self)
            raise
        epochs.planned(self, batch)
        return batch
