"""The analysis's PNG plots (with matplotlib, when it is installed: ``pip install coordl[bench]``)."""

import os

from coordl.analyzer.model import Pipeline
from coordl.analyzer.report import stall_split

STORAGE_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
MOST_JOBS = MOST_SERVERS = 8


def whatif_curves(pipeline: Pipeline) -> dict:
    """What ``whatif.png`` draws: the predicted samples/s (a rank's, as the report gives it) against each knob
    the what-if answers turn, as ``[(setting, samples/s), ...]``: ``workers`` (1 to twice the cores; ``workers_knee``),
    ``storage`` (storage :data:`STORAGE_FACTORS` times as fast), ``jobs`` (1 to :data:`MOST_JOBS` jobs, as
    ``(k, coordinated, each on its own)``) and ``servers`` (1 to :data:`MOST_SERVERS` with partitioned
    caching; None without a measured peer rate R)."""
    p = pipeline
    return {
        "workers": [(w, p.with_changes(workers=w).predicted) for w in range(1, 2 * p.cores + 1)],
        "workers_knee": p.workers_knee(),
        "storage": [(f, p.with_changes(storage_factor=f).predicted) for f in STORAGE_FACTORS],
        "jobs": [(k, p.with_changes(jobs=k, coordinated=True).predicted,
                  p.with_changes(jobs=k, coordinated=False).predicted) for k in range(1, MOST_JOBS + 1)],
        "servers": None if p.R is None else [(n, p.with_changes(servers=n).predicted)
                                             for n in range(1, MOST_SERVERS + 1)],
    }


def cache_curves(pipeline: Pipeline) -> dict:
    """What ``cache.png`` draws, from the model that printed the numbers: against the cache (``percent`` of
    the dataset, 0 to 100), the fetch rate ``F``, the workers' rate ``W`` (``contention · W``, the workers
    waiting for misses included; ``P`` without workers), the step's ``G`` (times the contention) and the
    ``predicted`` samples/s; the cache ``knee`` in percent (None: no cache is enough) and the y axis's ``top``
    (F may run past it)."""
    p = pipeline
    at = [p.with_changes(cache_fraction=i / 100) for i in range(101)]
    w = [q.contention * q.worker_rate if q.workers else q.prep_rate for q in at]
    predicted = [q.predicted for q in at]
    knee = p.cache_knee()
    return {"percent": list(range(101)), "F": [q.fetch_rate for q in at], "W": w, "G": p.contention * p.G,
            "predicted": predicted, "knee": None if knee is None else 100 * knee,
            "top": 1.25 * max(max(predicted), max(w), p.contention * p.G)}


def draw(pipeline: Pipeline, measured: float | None, out_dir: str,
         measured_hits: tuple[float, float | None] | None = None) -> list[str]:
    """``rates.png`` (G, P, S, C, F, predicted and measured; the model's stall split of an epoch, and what a
    measured run took beyond the prediction at the hits it saw, ``measured_hits``, marked as not explained),
    ``cache.png`` (:func:`cache_curves`) and ``whatif.png`` (the prediction
    against workers, storage speed, jobs sharing the server and servers: :func:`whatif_curves`) in
    ``out_dir``; the paths written, none without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    p = pipeline
    paths = [os.path.join(out_dir, name) for name in ("rates.png", "cache.png", "whatif.png")]
    fig, (rates, split) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    names = ["G", "P", "S", "C", "F", "predicted"] + (["measured"] if measured is not None else [])
    values = [p.G, p.prep_rate, p.S, p.C, p.fetch_rate, p.predicted] + ([measured] if measured is not None else [])
    rates.bar(names, values, color=["C0", "C1", "C2", "C3", "C4", "C7", "k"][:len(names)])
    rates.set_yscale("log")
    rates.set_ylabel("samples/s")
    rates.set_title(f"rates (bottleneck: {p.bottleneck})")
    stall = stall_split(p, measured, measured_hits)
    bottom = 0.0
    for key, label, color in (("ideal_s", "training", "C0"), ("prep_s", "prep stall", "C1"),
                              ("fetch_s", "fetch stall", "C2"), ("unexplained_s", "not explained (measured)", "0.7")):
        if stall.get(key, 0) > 0:
            split.bar(["modelled"], [stall[key]], bottom=bottom, label=label, color=color, hatch="//" if
                      key == "unexplained_s" else None)
            bottom += stall[key]
    split.set_ylabel("seconds per epoch")
    split.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)

    curves = cache_curves(p)
    fig, ax = plt.subplots(figsize=(6, 4))
    percent = curves["percent"]
    ax.plot(percent, curves["F"], label="F (fetch)", color="C4")
    ax.plot(percent, curves["W"], label="prep (c·W)" if p.workers else "P (prep)", color="C1", linestyle="--")
    ax.axhline(curves["G"], label="G (ingestion)" + (" · c" if p.contention < 1 else ""), color="C0", linestyle=":")
    ax.plot(percent, curves["predicted"], label="predicted", color="k", linewidth=2, alpha=0.5)
    if curves["knee"] is not None:
        ax.axvline(curves["knee"], color="grey", linewidth=0.8)
    ax.axvline(100 * p.cache_fraction, color="C3", linewidth=0.8, label=f"this cache: {p.predicted:.0f} samples/s")
    ax.set_ylim(0, curves["top"])
    if curves["F"][-1] > curves["top"]:
        ax.annotate(f"F: {curves['F'][-1]:.0f} at 100%", (100, curves["top"]), fontsize=8, ha="right", va="top",
                    textcoords="offset points", xytext=(-4, -4))
    ax.set_xlabel("cache, % of the dataset")
    ax.set_ylabel("samples/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=100)
    plt.close(fig)
    _draw_whatif(plt, p, whatif_curves(p), paths[2])
    return paths


def _draw_whatif(plt, p: Pipeline, curves: dict, path: str) -> None:
    fig, ((workers, storage), (jobs, servers)) = plt.subplots(2, 2, figsize=(10, 7))
    for ax in (workers, storage, jobs, servers):
        ax.set_ylabel("samples/s per rank")  # a rank's prediction, as the report gives it
    xs, ys = zip(*curves["workers"])
    workers.plot(xs, ys, "o-", color="k")
    workers.axhline(p.G, color="C0", linestyle=":", label="G (ingestion)")
    workers.axvline(p.workers, color="C3", linewidth=0.8, label="these workers")
    if curves["workers_knee"] is not None:
        workers.axvline(curves["workers_knee"], color="grey", linewidth=0.8, label="fewest without a prep stall")
    workers.set_xticks(xs)
    workers.set_xlabel("DataLoader workers")
    workers.set_title("workers")
    workers.legend(fontsize=8)
    xs, ys = zip(*curves["storage"])
    storage.plot(xs, ys, "o-", color="k")
    storage.set_xscale("log", base=2)
    storage.axvline(1.0, color="C3", linewidth=0.8, label="this storage")
    storage.annotate(f"×2: {dict(curves['storage'])[2.0]:.0f}", (2.0, dict(curves["storage"])[2.0]), fontsize=8,
                     textcoords="offset points", xytext=(4, -12))
    storage.set_xlabel("storage speed, × this one's")
    storage.set_title("storage")
    storage.legend(fontsize=8)
    ks, coordinated, alone = zip(*curves["jobs"])
    jobs.plot(ks, coordinated, "o-", color="C2", label="coordinated prep (hp_group)")
    jobs.plot(ks, alone, "s--", color="C1", label="each job on its own")
    jobs.set_xticks(ks)
    jobs.set_xlabel("jobs on this server")
    jobs.set_title("jobs reading the dataset at once")
    jobs.legend(fontsize=8)
    if curves["servers"] is None:
        servers.text(0.5, 0.5, "one server measured: no peer rate R\n(analyze the job over several servers)",
                     ha="center", va="center", fontsize=9, transform=servers.transAxes)
        servers.set_xticks([])
        servers.set_yticks([])
        servers.set_ylabel("")
    else:
        xs, ys = zip(*curves["servers"])
        servers.plot(xs, ys, "o-", color="k")
        servers.set_xticks(xs)
        servers.axvline(p.servers, color="C3", linewidth=0.8, label="these servers")
        servers.set_xlabel("servers, each caching the same share (a rank on each)")
        servers.legend(fontsize=8)
    servers.set_title("servers with partitioned caching")
    for ax in (workers, storage, jobs, servers):
        if ax.has_data():
            ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
