"""The data path's observation points, for a profiler such as ``coordl analyze`` (CoorDL §5, DS-Analyzer).

An observer registers with :func:`register` (``coordl.analyzer.phases`` does as it is imported), or is
named in a process's environment by ``COORDL_OBSERVER`` ("module:name", loaded at the first event: how a
phase run of a script gets it). The data path calls :func:`loader_built`, :func:`epoch` and
:func:`epoch_pass` at those events; with no observer each is the plain call. An observer may also keep
what it needs with a loader's ledger (``EpochLedger.observed``, which travels with it to other processes)
and stand in for a batch's load (``CachedDataset.batch_hook``, set before workers start). The data path
never imports an observer, and an observer uses these points and public methods only.
"""

import importlib

from coordl._core import settings

_observer = None
_looked = False


def register(observer) -> None:
    """Make ``observer`` (methods ``loader_built(loader)``, ``epoch(loader, start)``, ``epoch_pass(sampler,
    start)``) this process's."""
    global _observer, _looked
    _observer, _looked = observer, True


def _current():
    global _observer, _looked
    if not _looked:
        _looked = True
        named = settings.observer()
        if named:
            module, _, name = named.partition(":")
            _observer = getattr(importlib.import_module(module), name)
    return _observer


def loader_built(loader) -> None:
    """A coordl loader is built (its ledger installed)."""
    observer = _current()
    if observer is not None:
        observer.loader_built(loader)


def epoch(loader, start):
    """The iterator ``iter(loader)`` gives: ``start()`` makes the loader's own."""
    observer = _current()
    return start() if observer is None else observer.epoch(loader, start)


def epoch_pass(sampler, start):
    """The pass torch's iterator draws from a coordl batch sampler: ``start()`` makes the sampler's own."""
    observer = _current()
    return start() if observer is None else observer.epoch_pass(sampler, start)
