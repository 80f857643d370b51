"""``analysis.json`` (what ``coordl whatif`` reads) and the terminal report of a :class:`Pipeline`."""

import json
import math

from coordl._core.sizes import format_bytes
from coordl.analyzer.model import BOTTLENECKS, Pipeline, answers

FORMAT = "coordl-analysis/1"


def to_json(pipeline: Pipeline, measured: float | None = None,
            measured_hits: tuple[float, float | None] | None = None) -> dict:
    """The analysis of ``pipeline`` (and, if given, the throughput measured with it, at ``measured_hits``:
    see :func:`describe`) as ``analysis.json``."""
    p = pipeline
    dataset_bytes = p.samples * p.sample_bytes
    return {"format": FORMAT,
            "dataset": {"samples": p.samples, "bytes": dataset_bytes},
            "config": {"cache_bytes": p.cache_fraction * dataset_bytes, "workers": p.workers, "cores": p.cores,
                       "servers": p.servers, "jobs": p.jobs, "coordinated": p.coordinated, "ranks": p.ranks,
                       "fetch_threads": p.fetch_threads, "concurrency": p.concurrency, "lookahead": p.lookahead,
                       "disk_bytes": p.disk_fraction * dataset_bytes if p.K is not None else None},
            "rates": {"G": p.G, "P": p.P, "S": p.S, "C": p.C, "R": p.R, "K": p.K},
            "miss_wait_s": p.L,
            "disk_wait_s": p.L_disk,
            "disk_item_bytes": p.disk_item_bytes,
            "cpu_s_per_sample": {"step": p.step_cpu_s, "prep": p.prep_cpu_s},
            "contention": p.contention,
            "cpu_samples_per_s": None if math.isinf(p.cpu_rate) else p.cpu_rate,
            "fetch_samples_per_s": p.fetch_rate,
            "worker_samples_per_s": p.worker_rate,
            "predicted_samples_per_s": p.predicted,
            "measured_samples_per_s": measured,
            "job_predicted_samples_per_s": p.servers * p.ranks * p.predicted,
            "bottleneck": p.bottleneck,
            "stall": stall_split(p, measured, measured_hits),
            "whatif": answers(p)}


def save(path: str, pipeline: Pipeline, measured: float | None = None, extra: dict | None = None,
         measured_hits: tuple[float, float | None] | None = None) -> None:
    """Write the analysis (:func:`to_json`, plus ``extra`` fields) to ``path``."""
    with open(path, "w") as f:
        json.dump({**to_json(pipeline, measured, measured_hits), **(extra or {})}, f, indent=1)


def stall_split(pipeline: Pipeline, measured: float | None = None,
                measured_hits: tuple[float, float | None] | None = None) -> dict:
    """The model's split of an epoch (``Pipeline.stalls``), and with a measured rate what the run took
    beyond the prediction at the hits it saw (``unexplained_s``; default: the pipeline's cache fraction)."""
    split = pipeline.stalls()
    if measured is not None:
        expected = pipeline if measured_hits is None else at_hits(pipeline, *measured_hits)
        split["unexplained_s"] = expected.stalls(measured)["unexplained_s"]
    return split


def load(path: str) -> tuple[Pipeline, float | None]:
    """The pipeline and the measured samples/s (None if not measured) of an ``analysis.json``.

    Raises:
        ValueError: the file is not an analysis, or a field is missing or wrong (named).
    """
    try:
        with open(path) as f:
            doc = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{path} is not a coordl analysis (no \"format\": \"{FORMAT}\"); "
                         "`coordl analyze` writes one")
    try:
        dataset, config, rates = doc["dataset"], doc["config"], doc["rates"]
        cpu = doc.get("cpu_s_per_sample", {})
        disk_bytes = config.get("disk_bytes")
        pipeline = Pipeline(samples=int(dataset["samples"]), sample_bytes=dataset["bytes"] / dataset["samples"],
                            G=rates["G"], P=rates["P"], S=rates["S"], C=rates["C"], R=rates.get("R"),
                            L=float(doc.get("miss_wait_s", 0.0)),
                            cache_fraction=min(1.0, config["cache_bytes"] / dataset["bytes"]),
                            workers=int(config["workers"]), cores=int(config["cores"]),
                            servers=int(config.get("servers", 1)), jobs=int(config.get("jobs", 1)),
                            coordinated=bool(config.get("coordinated", False)), ranks=int(config.get("ranks", 1)),
                            fetch_threads=int(config.get("fetch_threads", 0)),
                            concurrency=int(config.get("concurrency", 0)), lookahead=int(config.get("lookahead", 0)),
                            step_cpu_s=float(cpu.get("step", 0.0)), prep_cpu_s=float(cpu.get("prep", 0.0)),
                            contention=float(doc.get("contention", 1.0)), K=rates.get("K"),
                            disk_fraction=0.0 if disk_bytes is None else min(1.0, disk_bytes / dataset["bytes"]),
                            L_disk=float(doc.get("disk_wait_s", 0.0)), disk_item_bytes=doc.get("disk_item_bytes"))
    except KeyError as e:
        raise ValueError(f"{path}: {e.args[0]!r} is missing") from None
    except (AttributeError, TypeError, ZeroDivisionError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    return pipeline, doc.get("measured_samples_per_s")


def _rate(samples_per_s: float, sample_bytes: float) -> str:
    if math.isinf(samples_per_s):
        return "unbounded"
    return f"{samples_per_s:10.1f} samples/s {samples_per_s * sample_bytes / 1e6:9.1f} MB/s"


def at_hits(pipeline: Pipeline, hits: float, peer_hits: float | None = None) -> Pipeline:
    """``pipeline`` with the share ``hits`` of an epoch from this server's cache and ``peer_hits`` from the
    peers' (None: what the peers' caches would hold)."""
    return pipeline.with_changes(cache_fraction=hits, peer_share=peer_hits)


def measured_stall(pipeline: Pipeline, run: dict) -> dict | None:
    """Seconds per epoch of a rank the run's training loop waited for batches (``stall_s``), split into
    fetching and prep (``fetch_s``, ``prep_s``) by the loading processes' own timers over the same window
    (their seconds reading storage and waiting for peers, against preparing); the split is None where prep
    is not timed (the DALI backend). None where the loop's waits were not timed (a torch iterator over the
    loader's parts)."""
    waits = run.get("waits_s")
    if waits is None or waits["stall"] is None or run.get("step_samples_per_s") is None:
        return None
    samples = pipeline.samples / (pipeline.servers * pipeline.ranks)
    stall_s, fetching, preparing = waits["stall"] * samples, waits["storage"] + waits["peers"], waits["prep"]
    if pipeline.fetch_threads or pipeline.coordinated or fetching + preparing <= 0:  # DALI, or staging waits too
        return {"stall_s": stall_s, "fetch_s": None, "prep_s": None}
    share = fetching / (fetching + preparing)
    return {"stall_s": stall_s, "fetch_s": stall_s * share, "prep_s": stall_s * (1 - share)}


def describe(pipeline: Pipeline, measured: float | None = None,
             measured_hits: tuple[float, float | None] | None = None, *, trust: dict | None = None,
             run: dict | None = None) -> str:
    """The report: the rates, the prediction and its bottleneck in one sentence, the stall split per epoch
    and the what-if answers. ``measured``, measured with ``measured_hits`` (the share of its fetches from
    this server's cache, and from the peers' or None; default: the pipeline's cache fraction), is set beside
    the prediction for those hits. ``trust`` (``runner.trust_of``) widens the prediction to a range or
    withholds it, saying why; ``run`` (the run phase's result) gives the measured stall's split."""
    p = pipeline
    dataset_bytes = p.samples * p.sample_bytes
    lines = [f"dataset {p.samples} samples, {format_bytes(dataset_bytes)}; cache "
             f"{format_bytes(p.cache_fraction * dataset_bytes)} ({p.cache_fraction:.0%}), " +
             (f"DALI: {p.workers} prep and {p.fetch_threads} fetch threads" if p.fetch_threads else
              f"{p.workers} workers") + f" on {p.cores} cores" + (f", {p.servers} servers" if p.servers > 1 else "") +
             (f"; an object store: {p.concurrency} GETs at once per worker, {p.lookahead} in flight ahead of the "
              "loop" if p.concurrency else "") +
             (f"; a disk tier holding {format_bytes(p.disk_fraction * dataset_bytes)} ({p.disk_fraction:.0%})"
              if p.K is not None else "") +
             (f", {p.jobs} {'coordinated' if p.coordinated else 'separate'} jobs" if p.jobs > 1 else "") +
             (f"; {p.servers * p.ranks} ranks, each with the rates below (the job: {p.servers * p.ranks} × a "
              "rank's)" if p.servers * p.ranks > 1 else ""),
             f"  G ingestion     {_rate(p.G, p.sample_bytes)}",
             f"  P prep          {_rate(p.prep_rate, p.sample_bytes)}",
             f"  S storage       {_rate(p.S, p.sample_bytes)}",
             f"  C cache         {_rate(p.C, p.sample_bytes)}"]
    if p.R is not None:
        lines.append(f"  R peers         {_rate(p.R, p.sample_bytes)}")
    if p.K is not None:
        lines.append(f"  K disk tier     {_rate(p.K, p.sample_bytes)}  ({p.L_disk * 1e3:.2f} ms waited per item)")
    lines += [f"  F fetch         {_rate(p.fetch_rate, p.sample_bytes)}"]
    if not math.isinf(p.cpu_rate):
        lines.append(f"  CPU             {_rate(p.cpu_rate, p.sample_bytes)}  ({p.cores} cores; per sample "
                     f"{p.step_cpu_s * 1e3:.2f} ms training process, {p.prep_cpu_s * 1e3:.2f} ms prep)")
    if p.L > 0 and not p.fetch_threads and not p.lookahead:
        lines.append(f"  W workers       {_rate(p.worker_rate, p.sample_bytes)}  (prep, and {p.miss_wait * 1e3:.2f} ms "
                     "waited per miss)")
    if p.contention < 1 and p.workers:
        lines.append(f"  contention      {p.contention:10.3f}  (the share of min(W, G) the loop reaches while "
                     f"{'DALI prepares' if p.fetch_threads else 'its workers prepare'})")
    if trust and trust["withheld"]:
        lines.append(f"  predicted       withheld: {'; '.join(trust['why'])}. Analyze again on a quieter machine "
                     f"(the model's {p.predicted:.1f} samples/s stands on rates that did not hold still)")
    elif trust and trust["range"]:
        low, high = trust["range"]
        lines.append(f"  predicted       {_rate(p.predicted, p.sample_bytes)}  (between {low:.1f} and {high:.1f}: "
                     f"{'; '.join(trust['why'])})")
    elif trust and trust["why"]:
        lines.append(f"  predicted       {_rate(p.predicted, p.sample_bytes)}  ({'; '.join(trust['why'])}; the "
                     "prediction does not change within what was seen)")
    else:
        lines.append(f"  predicted       {_rate(p.predicted, p.sample_bytes)}")
    if measured is not None:
        hits, peer_hits = (p.cache_fraction, None) if measured_hits is None else measured_hits
        expected = at_hits(p, hits, peer_hits).predicted
        from_peers = "" if peer_hits is None else f" and {peer_hits:.0%} from the peers"
        withheld = ", withheld" if trust and trust["withheld"] else ""
        lines.append(f"  measured        {_rate(measured, p.sample_bytes)}  (with {hits:.0%} cache hits{from_peers}; "
                     f"predicted {expected:.1f}{withheld}, {(expected - measured) / measured:+.1%})")
    cores_bound = p.bottleneck == "prep" and p.workers and p.worker_rate >= p.cpu_rate
    lines.append(f"bottleneck: {BOTTLENECKS[p.bottleneck]}" + (
        f": the {p.cores} cores, which the training process shares with prep, so more workers do not help"
        if cores_bound else ""))
    stall = stall_split(p, measured, measured_hits)
    epoch_s = stall["ideal_s"] + stall["prep_s"] + stall["fetch_s"]
    lines.append(f"per epoch, as modelled: {stall['ideal_s']:.1f} s training, {stall['prep_s']:.1f} s prep stall, "
                 f"{stall['fetch_s']:.1f} s fetch stall")
    off = stall.get("unexplained_s")
    if off is not None and abs(off) >= 0.05 * epoch_s:
        lines.append(f"  the run took {abs(off):.1f} s {'more' if off > 0 else 'less'} an epoch than predicted at the "
                     "hits it saw, which the model does not explain")
    waited = measured_stall(p, run) if run is not None else None
    if waited is not None:
        split = "" if waited["fetch_s"] is None else (
            f": {waited['fetch_s']:.1f} s fetching and {waited['prep_s']:.1f} s prep, by the workers' own timers")
        lines.append(f"per epoch, as measured: the loop waited {waited['stall_s']:.1f} s for batches{split}")
    lines.append("what if:")
    for a in answers(p):
        rate = a["samples_per_s"]
        if "cache_fraction" in a:
            text = ("no cache is enough: the cache's own rate C is below min(P, G)" if rate is None else
                    f"{format_bytes(a['cache_bytes'])} ({a['cache_fraction']:.0%} of the dataset)")
        elif "disk_fraction" in a:
            text = ("no disk tier is enough: its own rate K is below min(P, G)" if rate is None else
                    f"{format_bytes(a['disk_bytes'])} ({a['disk_fraction']:.0%} of the dataset)")
        elif "lookahead" in a:
            text = ("no look-ahead is enough: the store's rate S holds fetching" if a["lookahead"] is None else
                    f"lookahead={a['lookahead']}")
        elif "workers" in a:
            unit = "threads (num_workers=)" if p.fetch_threads else "workers"
            text = f"not even {2 * p.cores} {unit}" if rate is None else f"{a['workers']} {unit}"
        else:
            text = ""
        extra = f" (each on its own: {a['uncoordinated_samples_per_s']:.1f})" if "uncoordinated_samples_per_s" in a \
            else ""
        rate_text = "" if rate is None else f"{rate:.1f} samples/s{extra}"
        lines.append(f"  {a['question']}: " + ", ".join(t for t in (text, rate_text) if t))
    return "\n".join(lines)
