"""Derived figures of a benchmark run: hit rates, steady-epoch means, speedups, the physical bound.

Epoch 1 fills the caches from a cold start; epochs 2.. are the steady epochs every comparison uses.
"""

import statistics

from benchmarks.cache_sim import simulate

BASELINES = ("torch", "dali-seq", "dali-shuffle")
PREP = ("prep-torch", "prep-dali")
SIM_POLICY = {"torch": ("lru", "random"), "dali-shuffle": ("lru", "random"), "dali-seq": ("lru", "sequential"),
              "coordl": ("minio", "random"), "coordl-dali": ("minio", "random")}
"""How each system's cache behaves in :mod:`benchmarks.cache_sim`: the page cache is an LRU;
DALI-seq reads in file order."""
PREP_REFERENCE = {"torch": "prep-torch", "coordl": "prep-torch", "prep-torch": "prep-torch",
                  "dali-seq": "prep-dali", "dali-shuffle": "prep-dali", "coordl-dali": "prep-dali",
                  "prep-dali": "prep-dali"}
"""The measurement of a system's prep rate without any loader (``benchmarks.systems.PREP_SYSTEMS``: the
same decode and augmentation of bytes in memory, on every worker), run at cache fraction 1.0."""


def add_hits(run: dict, file_sizes: list[int]) -> None:
    """Give every epoch of ``run`` ``hits``, ``hit_rate`` and ``simulated_hit_rate``.

    coordl's hits are its loader's counters. The page cache's are estimated from the device:
    samples minus (device bytes read / mean file size); ``hits_source`` says which.
    """
    epochs = run["epochs"]
    if run["system"] in PREP:  # everything in memory: nothing to hit or miss
        for e in epochs:
            e.update(hits=e["samples"], hits_source="in memory", hit_rate=1.0, simulated_hit_rate=1.0)
        return
    mean_size = sum(file_sizes) / len(file_sizes)
    policy, order = SIM_POLICY[run["system"]]
    simulated = simulate(policy, run["cache_fraction"], len(epochs), sizes=file_sizes, order=order)
    for e, sim in zip(epochs, simulated):
        if "hits" not in e:
            misses = min(e["samples"], round(e["device_read_bytes"] / mean_size))
            e.update(hits=e["samples"] - misses, hits_source="estimated from device bytes")
        else:
            e["hits_source"] = "loader counters"
        e["hit_rate"] = e["hits"] / e["samples"] if e["samples"] else 0.0
        e["simulated_hit_rate"] = sim


def steady(run: dict) -> dict:
    """Means over the steady epochs (all epochs if there is only one)."""
    epochs = run["epochs"][1:] or run["epochs"]
    mean = lambda key: statistics.fmean(e[key] for e in epochs)  # noqa: E731
    return {"time_s": mean("time_s"), "samples_per_s": mean("samples_per_s"), "stall_s": mean("stall_s"),
            "device_read_bytes": mean("device_read_bytes"), "hit_rate": mean("hit_rate"),
            "simulated_hit_rate": mean("simulated_hit_rate"), "batches": mean("batches")}


def measured(runs: list[dict]) -> list[dict]:
    """The runs that have epochs and no error (not skipped, not failed, not over their budget)."""
    return [r for r in runs if r["epochs"] and "error" not in r]


def spread(values: list[float]) -> dict:
    """``median``, ``min``, ``max`` and ``n`` of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(runs: list[dict], dataset_bytes: int, bandwidth: int, compute_ms: float) -> list[dict]:
    """Give every measured run a ``steady`` entry (steady-epoch means, the physical bound, and for
    coordl's runs the speedup over each baseline of the same repetition and cache fraction), and
    return one comparison per system and cache fraction over its repetitions: the :func:`spread` of
    its steady time, device bytes and stall, and of each speedup.

    The bound of a steady epoch is the largest of: the bytes that must come from storage (dataset
    minus what the cache holds) at the throttled bandwidth; the training stand-in's compute; and the
    prep time of its :data:`PREP_REFERENCE` in the same repetition, where it ran.
    """
    by_key = {(r["system"], r["cache_fraction"], r.get("rep", 0)): r for r in measured(runs)}
    for (system, fraction, rep), run in by_key.items():
        s = steady(run)
        cached = run["cache"]["bytes_cached"] if run.get("cache") else int(fraction * dataset_bytes)
        must_read = max(0, dataset_bytes - cached)
        full = by_key.get((PREP_REFERENCE[system], 1.0, rep))
        bounds = {"io_bound_s": must_read / bandwidth, "compute_bound_s": s["batches"] * compute_ms / 1000,
                  "prep_bound_s": steady(full)["time_s"] if full else None}
        bound = max(v for v in bounds.values() if v is not None)
        run["steady"] = {**s, "min_device_read_bytes": must_read,
                         "excess_read": s["device_read_bytes"] / must_read - 1 if must_read else None,
                         **bounds, "bound_s": bound, "of_bound": s["time_s"] / bound if bound else None,
                         "speedup": {}}
        if system not in BASELINES + PREP:
            for base in BASELINES:
                other = by_key.get((base, fraction, rep))
                if other:
                    run["steady"]["speedup"][base] = steady(other)["time_s"] / s["time_s"]
    comparisons = []
    for system, fraction in dict.fromkeys((k[0], k[1]) for k in by_key):
        reps = [r["steady"] for k, r in by_key.items() if k[:2] == (system, fraction)]
        bases = dict.fromkeys(b for r in reps for b in r["speedup"])
        comparisons.append({
            "system": system, "cache_fraction": fraction,
            **{key: spread([r[key] for r in reps]) for key in ("time_s", "device_read_bytes", "stall_s")},
            "min_device_read_bytes": reps[0]["min_device_read_bytes"],
            "speedup": {b: spread([r["speedup"][b] for r in reps if b in r["speedup"]]) for b in bases}})
    return comparisons
