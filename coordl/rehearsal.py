"""Rehearsal for continual learning: a stream of experiences trained on in turn, each batch b new samples of
the current experience and r exemplars of earlier ones, replayed from a buffer whose members' raw bytes are
read through the node's cache and decoded and augmented afresh. Its machinery is in ``coordl._rehearsal``: the
stream (``stream``), the buffer's policies (``buffer``), the options (``options``), the batches (``batches``)
and how a loader is put together over a stream (``setup``)."""

from coordl._rehearsal.buffer import POLICIES, RehearsalBuffer
from coordl._rehearsal.options import ADMIT, Rehearsal
from coordl._rehearsal.stream import Experience, ExperienceStream, Replayed

__all__ = ["ADMIT", "POLICIES", "Experience", "ExperienceStream", "Rehearsal", "RehearsalBuffer", "Replayed"]
