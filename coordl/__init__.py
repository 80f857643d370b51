"""coordl: a drop-in ``torch.utils.data.DataLoader`` that removes data stalls.

The public names load on first use (PEP 562), so ``import coordl`` and the commands and modules that need
no torch (``coordl cache ls``, the shared-memory and peer wire modules) do not import it.
"""

import importlib

__version__ = "0.1.0"

_HOMES = {
    "CacheMismatchError": "coordl.exceptions",
    "CacheStats": "coordl.minio_cache",
    "CocoDetection": "coordl.coco",
    "CoordlError": "coordl.exceptions",
    "DataLoader": "coordl.loader",
    "EpochStats": "coordl.stats",
    "FileDataset": "coordl.raw_datasets",
    "GroupMismatchError": "coordl.exceptions",
    "GroupStats": "coordl.coord_prep",
    "LoaderStats": "coordl.stats",
    "MinIOCache": "coordl.minio_cache",
    "RawBytesDataset": "coordl.raw_datasets",
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
