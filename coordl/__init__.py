"""coordl: a drop-in ``torch.utils.data.DataLoader`` that removes data stalls."""

from coordl.coco import CocoDetection
from coordl.exceptions import CacheMismatchError, CoordlError, SampleError, ShmCapacityError
from coordl.loader import DataLoader
from coordl.minio_cache import CacheStats, MinIOCache
from coordl.raw_datasets import FileDataset, RawBytesDataset
from coordl.stats import EpochStats, LoaderStats

__version__ = "0.1.0"

__all__ = [
    "CacheMismatchError",
    "CacheStats",
    "CocoDetection",
    "CoordlError",
    "DataLoader",
    "EpochStats",
    "FileDataset",
    "LoaderStats",
    "MinIOCache",
    "RawBytesDataset",
    "SampleError",
    "ShmCapacityError",
]
assert __all__ == sorted(__all__)
