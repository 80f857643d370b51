"""coordl: a drop-in ``torch.utils.data.DataLoader`` that removes data stalls.

The public names load on first use (PEP 562), so ``import coordl`` and the commands and modules that need
no torch (``coordl cache ls``, the shared-memory and peer wire modules) do not import it.

NOTE [ Lazy, but never later than torch ]
``coordl.DataLoader`` is defined as soon as torch is imported, whichever comes first: frameworks find
DataLoader subclasses once, when they start wrapping them (Lightning patches every subclass of torch's
DataLoader that exists as it enters a hook such as ``train_dataloader``), and a class first defined inside
that hook is missed there, which breaks their re-instantiation of it. So a process that imports torch
defines coordl's loader right after torch (:class:`_WithTorch`), as the eager package did.
"""

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

_HOMES = {
    "CacheMismatchError": "coordl.exceptions",
    "CacheStats": "coordl.minio_cache",
    "CocoDetection": "coordl._fetch.coco",
    "CoordlError": "coordl.exceptions",
    "DataLoader": "coordl.loader",
    "EpochStats": "coordl.stats",
    "Experience": "coordl.rehearsal",
    "ExperienceStream": "coordl.rehearsal",
    "FileDataset": "coordl._fetch.raw_datasets",
    "GroupMismatchError": "coordl.exceptions",
    "GroupStats": "coordl.coord_prep",
    "LoaderStats": "coordl.stats",
    "MinIOCache": "coordl.minio_cache",
    "ObjectDataset": "coordl._objects.datasets",
    "ObjectImageFolder": "coordl._objects.datasets",
    "RawBytesDataset": "coordl._fetch.raw_datasets",
    "Rehearsal": "coordl.rehearsal",
    "SampleError": "coordl.exceptions",
    "ShmCapacityError": "coordl.exceptions",
    "StagingError": "coordl.exceptions",
}
"""Each public name and the module that defines it."""

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    """A public name from its module, or a submodule (``coordl.coord_prep``) imported on first use."""
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
    elif not name.startswith("__"):
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


class _WithTorch(importlib.abc.MetaPathFinder):
    """Imports ``coordl.loader`` once ``torch`` has been imported (NOTE [ Lazy, but never later than torch ])."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            exec_torch = spec.loader.exec_module

            def exec_then_define(module):
                exec_torch(module)
                _define_loader()
            spec.loader.exec_module = exec_then_define
        return spec


def _define_loader() -> None:
    try:
        importlib.import_module("coordl.loader")
    except Exception:  # never a failed ``import torch``: using coordl.DataLoader raises it
        pass


if "torch" in sys.modules:
    _define_loader()
elif not any(isinstance(finder, _WithTorch) for finder in sys.meta_path):
    sys.meta_path.insert(0, _WithTorch())
