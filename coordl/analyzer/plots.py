"""The analysis's PNG plots (with matplotlib, when it is installed: ``pip install coordl[bench]``)."""

import os

from coordl.analyzer.model import Pipeline


def draw(pipeline: Pipeline, measured: float | None, out_dir: str) -> list[str]:
    """``rates.png`` (G, P, S, C, F, predicted and measured; the stall split of an epoch) and ``cache.png``
    (F, P, G and the prediction against the cache size, the knee marked) in ``out_dir``; the paths written,
    none without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    p = pipeline
    paths = [os.path.join(out_dir, "rates.png"), os.path.join(out_dir, "cache.png")]
    fig, (rates, split) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    names = ["G", "P", "S", "C", "F", "predicted"] + (["measured"] if measured is not None else [])
    values = [p.G, p.prep_rate, p.S, p.C, p.fetch_rate, p.predicted] + ([measured] if measured is not None else [])
    rates.bar(names, values, color=["C0", "C1", "C2", "C3", "C4", "C7", "k"][:len(names)])
    rates.set_yscale("log")
    rates.set_ylabel("samples/s")
    rates.set_title(f"rates (bottleneck: {p.bottleneck})")
    stall = p.stalls(measured)
    bottom = 0.0
    for key, label, color in (("ideal_s", "training", "C0"), ("prep_s", "prep stall", "C1"),
                              ("fetch_s", "fetch stall", "C2")):
        split.bar(["epoch"], [stall[key]], bottom=bottom, label=label, color=color)
        bottom += stall[key]
    split.set_ylabel("seconds per epoch")
    split.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)

    fractions = [i / 100 for i in range(101)]
    fetch = [p.with_changes(cache_fraction=x).fetch_rate for x in fractions]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([100 * x for x in fractions], fetch, label="F (fetch)", color="C4")
    ax.axhline(p.prep_rate, label="P (prep)", color="C1", linestyle="--")
    ax.axhline(p.G, label="G (ingestion)", color="C0", linestyle=":")
    ax.plot([100 * x for x in fractions], [min(f, p.prep_rate, p.G) for f in fetch], label="predicted", color="k",
            linewidth=2, alpha=0.5)
    knee = p.cache_knee()
    if knee is not None:
        ax.axvline(100 * knee, color="grey", linewidth=0.8)
    ax.axvline(100 * p.cache_fraction, color="C3", linewidth=0.8, label="this cache")
    ax.set_ylim(0, 1.2 * max(p.prep_rate, p.G, min(fetch[-1], 2 * max(p.prep_rate, p.G))))
    ax.set_xlabel("cache, % of the dataset")
    ax.set_ylabel("samples/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=100)
    plt.close(fig)
    return paths
