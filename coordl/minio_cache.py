"""The MinIO cache (CoorDL §4.1): a node-wide, fill-once, never-evict cache of raw sample bytes in shared
memory, shared by every loader of the same dataset on the server. Its machinery is in ``coordl._cache``."""

from coordl._cache.minio import VIEWS_AT_ONCE, CacheStats, MinIOCache, cache_segment_name, index_bytes, list_caches, \
    remove_cache

__all__ = ["VIEWS_AT_ONCE", "CacheStats", "MinIOCache", "cache_segment_name", "index_bytes", "list_caches",
           "remove_cache"]
