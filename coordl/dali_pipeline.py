"""The DALI backend (``backend="dali"``): DALI pipelines fed with raw bytes from coordl's fetch path, so the
cache and the peers serve DALI as they serve torch's workers. Its machinery is in ``coordl._dali``."""

from coordl._dali.pipeline import AHEAD_BATCHES, AHEAD_LEFT, AHEAD_MISSES, FETCH_RAMP, DaliBackend, DaliFeed, \
    dali_available, require_dali, target_reader

__all__ = ["AHEAD_BATCHES", "AHEAD_LEFT", "AHEAD_MISSES", "FETCH_RAMP", "DaliBackend", "DaliFeed", "dali_available",
           "require_dali", "target_reader"]
