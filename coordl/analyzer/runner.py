"""``coordl analyze -- COMMAND``: run a training script in DS-Analyzer's phases and model what it measured.

Each phase is a run of the unchanged command with ``COORDL_ANALYZE_PHASE`` set (see ``phases.py``), in a
process group of its own and a shared-memory directory of its own, both removed when the phase ends:
nothing it started is left running or in ``/dev/shm`` (also not a segment torch was making for a tensor
in a process the end of the phase killed).
"""

import dataclasses
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from coordl._core import settings
from coordl._core.shm import SHM_DIR_ENV, shm_dir
from coordl.analyzer import phase_env
from coordl.analyzer.model import Pipeline
from coordl.analyzer.process_group import WATCH_S, stop_group, watch

PHASE_TITLES = {"ingestion": "G: the training step alone (one batch, over and over)",
                "rates": "S, C, P: storage, cache and prep, with the training loop idle; Q: the loop on prepared "
                         "batches",
                "run": "the script as configured"}
STOP_GRACE_S = 5.0
OBSERVER = "coordl.analyzer.phases:OBSERVER"
"""The data path's observer in a phase run of the script (``COORDL_OBSERVER``)."""
RATE_KEYS = ("samples_per_s", "S", "C", "P", "Q", "R", "K", "step_samples_per_s")
"""The rates (samples/s) a phase's result may hold."""
UNSTEADY = 1.5
"""A rate whose window's parts differ by more than this factor, or that moved by more between phases, is
flagged and the prediction given as a range."""
UNTRUSTED = 3.0
"""Past this factor the prediction is withheld: the machine was too busy to measure on."""


class PhaseFailed(RuntimeError):
    """A phase gave no result: the script failed, ended too early or never iterated a coordl loader.
    ``measured``: the results of the phases before it."""

    measured: dict = {}


def run_phase(command: list[str], phase: str, out_dir: str, *, iters: int, warmup: int, timeout_s: float,
              say=print) -> dict:
    """Run ``command`` in ``phase`` and return its result (``phases.py``); its output goes to
    ``out_dir/phase-<phase>.log``.

    Raises:
        PhaseFailed: the script exited without a result (why, and its last lines), or ran past ``timeout_s``.
    """
    out_dir = os.path.abspath(out_dir)  # the script may change directory
    result_path = os.path.join(out_dir, f"phase-{phase}.json")
    log_path = os.path.join(out_dir, f"phase-{phase}.log")
    for path in [result_path, *glob.glob(glob.escape(result_path) + ".rank*")]:
        if os.path.exists(path):
            os.remove(path)
    shm = tempfile.mkdtemp(prefix="coordl-analyze-", dir=shm_dir())  # removed with all it holds when the phase ends
    env = dict(settings.environ(), **{phase_env.PHASE_ENV: phase, phase_env.RESULT_ENV: result_path,
                                      phase_env.ITERS_ENV: str(iters), phase_env.WARMUP_ENV: str(warmup),
                                      SHM_DIR_ENV: shm, settings.OBSERVER_ENV: OBSERVER})
    started = time.monotonic()
    try:
        with open(log_path, "wb") as log:
            try:
                proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
            except OSError as e:
                raise PhaseFailed(f"cannot run {command[0]!r}: {e.strerror or e}") from None
            seen: set[int] = set()
            try:
                status = _wait(proc, started, timeout_s, phase, say, lambda: _ranks_done(result_path), seen)
            finally:
                stop_group(proc, seen, STOP_GRACE_S)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    markers = glob.glob(glob.escape(result_path) + "*" + phase_env.CLAIMED)
    claimed = bool(markers)
    for marker in markers:
        os.remove(marker)
    if os.path.exists(result_path):
        with open(result_path) as f:
            return json.load(f)
    ranks = _rank_results(result_path)
    tail = _tail(log_path)
    if ranks and len(ranks) == ranks[0]["local_world_size"]:
        combined = _combine(ranks)
        with open(result_path, "w") as f:
            json.dump(combined, f)
        return combined
    if ranks:
        raise PhaseFailed(f"only {len(ranks)} of the job's {ranks[0]['local_world_size']} ranks finished the {phase} "
                          f"phase; the script's last lines ({log_path}):\n{tail}")
    if status is None:
        raise PhaseFailed(f"the {phase} phase ran past {timeout_s:.0f} s and was stopped (--timeout); the "
                          f"script's last lines ({log_path}):\n{tail}")
    if status != 0:
        raise PhaseFailed(f"the script failed in the {phase} phase (exit status {status}); its last lines "
                          f"({log_path}):\n{tail}")
    if not claimed:
        raise PhaseFailed(f"the script exited without iterating a coordl.DataLoader, so there is nothing to "
                          f"measure; its last lines ({log_path}):\n{tail}")
    raise PhaseFailed(f"the script ended after fewer than {warmup + iters + 1} batches (--warmup {warmup} + "
                      f"--iters {iters}, and one more to time the last step): run it for longer, or lower --iters")


def _wait(proc: subprocess.Popen, started: float, timeout_s: float, phase: str, say, done,
          seen: set[int]) -> int | None:
    """The exit status, or None past ``timeout_s``; 0 once ``done()`` has held for :data:`STOP_GRACE_S` (a
    rank's exit can leave the others waiting in a collective); says every 10 s that the phase is still
    running. Every :data:`WATCH_S` the processes the command has started go into ``seen``."""
    said, done_since = started, None
    while True:
        try:
            return watch(proc, seen, WATCH_S)
        except subprocess.TimeoutExpired:
            now = time.monotonic()
            if now - started > timeout_s:
                return None
            if done_since is None and done():
                done_since = now
            if done_since is not None and now - done_since >= STOP_GRACE_S:
                return 0
            if now - said >= 10:
                said = now
                say(f"  ... {phase}: {now - started:.0f} s")


def _rank_results(result_path: str) -> list[dict]:
    """The results the ranks of a torchrun job wrote (``<result>.rank<RANK>``), in rank order."""
    paths = [p for p in glob.glob(glob.escape(result_path) + ".rank*") if p.rsplit(".rank", 1)[1].isdigit()]
    results = []
    for path in sorted(paths, key=lambda p: int(p.rsplit(".rank", 1)[1])):
        with open(path) as f:
            results.append(json.load(f))
    return results


def _ranks_done(result_path: str) -> bool:
    ranks = _rank_results(result_path)
    return bool(ranks) and len(ranks) == ranks[0]["local_world_size"]


def _combine(ranks: list[dict]) -> dict:
    """A torchrun job's result from its ranks' on this server (rates per rank): the slowest rank's rates, as
    the job goes at its pace, and the longest miss wait and most CPU per sample; each rank's own under
    ``ranks``. For the members of an hp_group, which measured at once, each over its part: the group's
    storage, cache and prep rates and cores are the members' together (each sample is fetched and prepared
    once for all of them), and a job's samples/s the slowest member's."""
    out = dict(ranks[0])
    together = ("S", "C", "P", "cores") if out.get("hp_group") else ()
    for key in RATE_KEYS:
        values = [r[key] for r in ranks if r.get(key) is not None]  # R: of the ranks that fetched from a peer
        if key in out and key not in together:
            out[key] = min(values) if values else None
    for key in together:
        out[key] = sum(r[key] for r in ranks)
    for key in ("L", "L_disk", "loop_cpu_s", "prep_cpu_s", "spread", "Q_spread"):
        values = [r[key] for r in ranks if r.get(key) is not None]
        if key in out:
            out[key] = max(values) if values else None
    if out.get("spread") is not None:  # the parts of the rank that ran least steadily
        out["parts_samples_per_s"] = max(ranks, key=lambda r: r.get("spread") or 0)["parts_samples_per_s"]
    if out.get("waits_s") is not None:  # a wait some rank did not time (a torch iterator ran its loop) is None
        out["waits_s"] = {k: None if any(r["waits_s"][k] is None for r in ranks)
                          else sum(r["waits_s"][k] for r in ranks) / len(ranks) for k in out["waits_s"]}
    for key in ("hit_fraction", "peer_hit_fraction"):
        if key in out:
            out[key] = sum(r[key] for r in ranks) / len(ranks)
    out["ranks"] = ranks
    return out


def _tail(path: str, lines: int = 15) -> str:
    with open(path, "rb") as f:
        return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])


def analyze(command: list[str], out_dir: str, *, iters: int = 100, warmup: int = 10, timeout_s: float = 600.0,
            say=print) -> tuple[Pipeline, dict]:
    """Every phase of ``command``, then the model: the pipeline and what was measured (``results``: each
    phase's result, ``flags``: what makes a rate doubtful)."""
    os.makedirs(out_dir, exist_ok=True)
    results = {}
    for n, phase in enumerate(phase_env.PHASES, 1):
        say(f"[{n}/{len(phase_env.PHASES)}] {PHASE_TITLES[phase]}")
        started = time.monotonic()
        try:
            results[phase] = run_phase(command, phase, out_dir, iters=iters, warmup=warmup, timeout_s=timeout_s,
                                       say=say)
        except PhaseFailed as e:
            e.measured = results
            raise
        say(f"  done in {time.monotonic() - started:.0f} s")
    rates, g = results["rates"], results["ingestion"]["samples_per_s"]
    dataset_bytes = rates["samples"] * rates["sample_bytes"]
    flags = []
    if rates["C_from"] == "memory copy":
        flags.append("C: the cache took none of the subset (cache_bytes=0, or too small), so a copy of the bytes in "
                     "memory stands for a cache hit")
    for rate, cold, wrong in (("S", "cold_fraction", "too high"), ("L", "L_cold_fraction", "too low")):
        if rates[cold] is not None and rates[cold] < 0.5:
            flags.append(f"{rate}: only {rates[cold]:.0%} of the storage reads came from a block device; the rest "
                         f"was served from memory (the page cache, or a RAM-backed file system), so {rate} is "
                         f"{wrong} for cold reads")
    if "disk_fraction" in rates and rates.get("K") is None:
        flags.append("K: the disk tier held none of the subset after reading it (off, or its quota full), so it is "
                     "modelled as absent")
    servers = rates.get("servers", 1)
    if servers > 1 and rates["R"] is None:
        flags.append("R: nothing was fetched from a peer (the other servers' caches took none of the subset, or "
                     "a server was missing from the map of the caches); modelled as this server alone")
        servers = 1
    sharers = rates["local_world_size"]
    if rates.get("hp_group"):  # K coordinated jobs; the workers (or DALI threads) are all the members'
        shape = dict(jobs=sharers, coordinated=True, workers=sharers * rates["workers"],
                     fetch_threads=sharers * rates["fetch_threads"])
    else:
        shape = dict(ranks=sharers, workers=rates["workers"], fetch_threads=rates["fetch_threads"])
    pipeline = Pipeline(samples=rates["samples"], sample_bytes=rates["sample_bytes"], G=g, P=rates["P"],
                        S=rates["S"], C=rates["C"], L=rates["L"], cores=rates["cores"],
                        cache_fraction=min(1.0, rates["cache_bytes"] / dataset_bytes), servers=servers,
                        R=rates.get("R") if servers > 1 else None,
                        step_cpu_s=results["ingestion"]["loop_cpu_s"], prep_cpu_s=rates["prep_cpu_s"],
                        concurrency=rates.get("concurrency", 0), lookahead=rates.get("lookahead", 0),
                        K=rates.get("K"), disk_fraction=rates.get("disk_fraction", 0.0) if rates.get("K") else 0.0,
                        L_disk=rates.get("L_disk", 0.0), disk_item_bytes=rates.get("disk_item_bytes"), **shape)
    if rates.get("Q") is not None:  # Q had nothing to fetch: of what W and G allow with no misses
        alone = pipeline.with_changes(cache_fraction=1.0)
        pipeline = dataclasses.replace(pipeline, contention=min(1.0, rates["Q"] / min(alone.worker_rate, alone.G)))
    trust = trust_of(pipeline, results)
    return pipeline, {"results": results, "flags": flags + trust["why"], "trust": trust}


def trust_of(pipeline: Pipeline, results: dict) -> dict:
    """How far the prediction can be trusted, from how steady the rates ran: each timed window's spread
    (its parts' fastest rate over the slowest) and how far the training step's rate moved between the
    ingestion phase and the run (where it shares the cores with prep, so from G·contention to G is as
    measured; a step on a GPU is timed by its launch, so only a slower one counts). ``why``: a sentence per
    unsteady rate; ``range``: the least and the most prediction with G at the least and most it was seen at
    and the contention as far off as Q's spread (None when neither moved); ``withheld``: past
    :data:`UNTRUSTED`."""
    g, c = results["ingestion"]["samples_per_s"], pipeline.contention
    seen_g, seen_c = [g], [c]
    why, worst = [], 1.0
    for phase, key, what in (("ingestion", "spread", "G (the training step alone)"),
                             ("rates", "Q_spread", "Q (the loop on prepared batches)"),
                             ("run", "spread", "the run's samples/s")):
        spread = results[phase].get(key)
        if spread is not None and spread > UNSTEADY:
            worst = max(worst, spread)
            why.append(f"{what} varied {spread:.1f}x within its window: the machine was busy")
            if phase == "ingestion":
                seen_g += results[phase]["parts_samples_per_s"]
            elif phase == "rates":
                seen_c += [c / spread, min(1.0, c * spread)]
    run = results["run"]
    step = run.get("step_samples_per_s")
    if step is not None:
        moved = 1.0 if step > g and run.get("step_on_gpu") else step / g if step > g else \
            g * c / step if step < g * c else 1.0
        if moved > UNSTEADY:
            worst = max(worst, moved)
            why.append(f"G varied {moved:.1f}x between phases: the training step ran at {g:.0f} samples/s alone "
                       f"and at {step:.0f} in the run: the machine was busy")
            seen_g.append(step)
    predictions = [dataclasses.replace(pipeline, G=rate, contention=share).predicted
                   for rate in (min(seen_g), max(seen_g)) for share in (min(seen_c), max(seen_c))]
    low, high = min(predictions), max(predictions)
    return {"why": why, "range": [low, high] if high > low * (1 + 1e-9) else None, "withheld": worst > UNTRUSTED}


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(args) -> int:
    """``coordl analyze``: the phases, the report, ``analysis.json`` and the plots in ``--out``."""
    from coordl.analyzer import plots, report
    if not args.command:
        print("coordl analyze: give the training command after --, e.g. coordl analyze -- python train.py",
              file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):  # so that a phase's process group and shm folder go too
        signal.signal(sig, _exit_on_signal)
    try:
        pipeline, measured = analyze(args.command, args.out, iters=args.iters, warmup=args.warmup,
                                     timeout_s=args.timeout)
    except PhaseFailed as e:
        print(f"coordl analyze: {e}", file=sys.stderr)
        for phase, result in e.measured.items():  # the partial report
            rates = {k: round(v, 1) for k, v in result.items() if k in RATE_KEYS and v}
            print(f"measured before that, {phase}: " + ", ".join(f"{k}={v}" for k, v in rates.items()),
                  file=sys.stderr)
        return 1
    run = measured["results"]["run"]
    path = os.path.join(args.out, "analysis.json")
    hits = (run["hit_fraction"], run["peer_hit_fraction"] if pipeline.servers > 1 else None)
    report.save(path, pipeline, run["samples_per_s"], measured_hits=hits, extra={
        "measured_hit_fraction": hits[0], "measured_peer_hit_fraction": hits[1],
        "predicted_at_measured_hits": report.at_hits(pipeline, *hits).predicted,
        "flags": measured["flags"], "trust": measured["trust"], "measured_stall": report.measured_stall(pipeline, run),
        "phases": measured["results"]})
    print(report.describe(pipeline, run["samples_per_s"], hits, trust=measured["trust"], run=run))
    for flag in measured["flags"]:
        if flag not in measured["trust"]["why"]:  # those are on the prediction's line
            print(f"note: {flag}")
    written = plots.draw(pipeline, run["samples_per_s"], args.out, measured_hits=hits)
    print(f"wrote {path}" + "".join(f", {p}" for p in written) +
          ("" if written else " (no plots: matplotlib is not installed; pip install 'coordl[bench]')"))
    return 0
