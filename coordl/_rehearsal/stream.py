"""A stream of experiences: datasets that arrive one after another, trained on in turn.

An :class:`ExperienceStream` is, as a dataset, every experience's samples one after the other (as a
``ConcatDataset``: a torch loader over it trains on them all at once, jointly). A coordl loader over it
draws each pass from its current experience only (``_rehearsal.batches``), with exemplars of what came
before when given ``rehearsal=``. ``for experience in stream`` makes each experience current in turn.
"""

import bisect
from collections.abc import Iterable, Iterator
from typing import Any

import torch.utils.data

from coordl._fetch.raw_datasets import _MappedSource, part_sources, raw_source


class Replayed(int):
    """A sample index a batch replays from the rehearsal buffer (an ``int``; torch hands it to the dataset
    as it is, so a tagged stream can say so in the sample)."""

    __slots__ = ()


class Experience:
    """One experience of a stream: its number, its dataset, and its samples' indices in the stream
    (``start`` to ``stop``)."""

    def __init__(self, number: int, dataset, start: int, stop: int):
        self.number, self.dataset, self.start, self.stop = number, dataset, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __repr__(self) -> str:
        return f"Experience({self.number}, {len(self)} samples, {type(self.dataset).__name__})"


class ExperienceStream(torch.utils.data.Dataset):
    """Datasets trained on one after another (a class-, task- or domain-incremental stream).

    Args:
        experiences: the datasets known now (map-style, with ``len``); more can be added with :meth:`add`.
        tagged: each sample becomes ``(*sample, replayed, experience)`` (a sample that is not a tuple:
            ``(sample, replayed, experience)``): whether the batch replayed it from the buffer, and the
            experience it came from, for methods that weigh replayed samples otherwise. Defaults to False.

    ``stream[i]`` is sample ``i`` of the experiences one after the other; ``current`` is the number of the
    experience a coordl loader over the stream draws from, set by iterating the stream.

    Example::

        stream = coordl.ExperienceStream([task0, task1, task2])
        loader = coordl.DataLoader(stream, batch_size=32, shuffle=True, num_workers=4,
                                   rehearsal=coordl.Rehearsal(capacity=2000, per_batch=16))
        for experience in stream:
            for epoch in range(epochs):
                for x, y in loader: ...
    """

    def __init__(self, experiences: Iterable = (), *, tagged: bool = False):
        if not isinstance(tagged, bool):
            raise ValueError(f"tagged should be True or False, but got tagged={tagged!r}")
        self.datasets: list = []
        self.ends: list[int] = []
        self.tagged = tagged
        self.current = 0
        for dataset in experiences:
            self.add(dataset)

    def add(self, dataset) -> Experience:
        """Append an experience (data that arrived); a loader built before draws only from those it was built
        with (build a new one over the stream, with the same ``Rehearsal`` to keep the buffer)."""
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            raise TypeError(f"ExperienceStream: experience {len(self.datasets)} should be a map-style dataset with a "
                            f"length, but got {type(dataset).__name__}")
        if len(dataset) == 0:
            raise ValueError(f"ExperienceStream: experience {len(self.datasets)} ({type(dataset).__name__}) is empty")
        self.datasets.append(dataset)
        self.ends.append((self.ends[-1] if self.ends else 0) + len(dataset))
        return self.experience(len(self.datasets) - 1)

    def experience(self, number: int) -> Experience:
        if not 0 <= number < len(self.datasets):
            raise IndexError(f"the stream has {len(self.datasets)} experiences; there is no experience {number}")
        return Experience(number, self.datasets[number], self.ends[number - 1] if number else 0, self.ends[number])

    def __iter__(self) -> Iterator[Experience]:
        """Each experience from the current one on, made current in turn (a resumed stream goes on from where
        its checkpoint was)."""
        number = self.current
        while number < len(self.datasets):
            self.current = number
            yield self.experience(number)
            number += 1

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def locate(self, index: int) -> tuple[int, int]:
        """(the experience holding sample ``index``, its index there)."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is out of range for a stream of {len(self)} samples")
        number = bisect.bisect_right(self.ends, index)
        return number, index - (self.ends[number - 1] if number else 0)

    def __getitem__(self, index: int) -> Any:
        number, local = self.locate(index)
        return self.tag(index, self.datasets[number][local])

    def tag(self, index: int, sample: Any) -> Any:
        """``sample`` (of stream index ``index``) as the stream hands it out: tagged, when it is."""
        if not self.tagged:
            return sample
        flags = (isinstance(index, Replayed), self.locate(index)[0])
        return (*sample, *flags) if isinstance(sample, tuple) else (sample, *flags)

    def target(self, index: int) -> Any:
        """The label of sample ``index`` (its experience's ``targets``, or ``dali_target``); AttributeError if its
        experience has neither."""
        number, local = self.locate(index)
        dataset = self.datasets[number]
        if callable(getattr(dataset, "dali_target", None)):
            return dataset.dali_target(local)
        targets = getattr(dataset, "targets", None)
        if targets is None:
            source, _ = raw_source(dataset)
            if source is not None and callable(getattr(source, "dali_target", None)):
                return source.dali_target(local)
            raise AttributeError(f"experience {number} ({type(dataset).__name__}) has no targets")
        return targets[local]

    def coordl_raw_source(self, decode: bool):
        """How coordl reads the stream's raw bytes (see ``raw_datasets.raw_source``): (source, "") or (None,
        why not)."""
        parts, why = part_sources(self.datasets, decode, "experience")
        return (StreamSource(self, parts), "") if parts is not None else (None, why)


class StreamSource(_MappedSource):
    """The raw-bytes view of a stream, over the experiences it had when the view was made (a loader's)."""

    def __init__(self, stream: ExperienceStream, parts: list):
        super().__init__(stream, parts)
        self.ends = list(stream.ends)

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def locate(self, index: int):
        number = bisect.bisect_right(self.ends, index)
        return self.parts[number], index - (self.ends[number - 1] if number else 0)

    def decode_raw(self, index: int, raw: bytes) -> Any:
        return self.dataset.tag(index, super().decode_raw(index, raw))
