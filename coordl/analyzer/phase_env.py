"""What ``coordl analyze``'s runner and a phase run of the script share, without torch: the variables that
tell a run which phase it is and where its result goes, and the marker it leaves beside that result."""

PHASE_ENV = "COORDL_ANALYZE_PHASE"
RESULT_ENV = "COORDL_ANALYZE_RESULT"
ITERS_ENV = "COORDL_ANALYZE_ITERS"
WARMUP_ENV = "COORDL_ANALYZE_WARMUP"
PHASES = ("ingestion", "rates", "run")
CLAIMED = ".claimed"
"""Suffix of the file a phase writes beside its result once a loader is iterated (the runner tells "no
coordl loader" from "too few batches" by it)."""
