"""DS-Analyzer's model: a job's measured rates (ingestion G, prep P, storage S, cache C) give its predicted
throughput, the bottleneck, the data stall split and what-if answers; ``analysis.json`` holds them.

    >>> from coordl import analyzer
    >>> pipeline, measured = analyzer.load("analysis.json")
    >>> pipeline.with_changes(cache_fraction=0.8, workers=12).predicted
"""

from coordl.analyzer.model import BOTTLENECKS, Pipeline, answers
from coordl.analyzer.report import at_hits, describe, load, save, to_json

__all__ = ["BOTTLENECKS", "Pipeline", "answers", "at_hits", "describe", "load", "save", "to_json"]
