"""coordl: a drop-in ``torch.utils.data.DataLoader`` that removes data stalls."""

from coordl.coco import CocoDetection
from coordl.coord_prep import GroupStats
from coordl.exceptions import CacheMismatchError, CoordlError, GroupMismatchError, SampleError, ShmCapacityError, \
    StagingError
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
    "GroupMismatchError",
    "GroupStats",
    "LoaderStats",
    "MinIOCache",
    "RawBytesDataset",
    "SampleError",
    "ShmCapacityError",
    "StagingError",
]
assert __all__ == sorted(__all__)
