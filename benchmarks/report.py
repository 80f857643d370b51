"""Writes a benchmark's results: ``results.json``, ``results.md`` and PNG plots (if matplotlib is installed)."""

import json
import os
import platform
import subprocess
import sys

from benchmarks.drift import source_digests
from benchmarks.metrics import measured

MIB = 2**20
NO_PLOTS = "plots skipped: matplotlib is not installed (pip install 'coordl[bench]')"


def _proc_field(path: str, key: str) -> str | None:
    with open(path) as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith(key)), None)


def machine() -> dict:
    """What the figures were measured on."""
    model = _proc_field("/proc/cpuinfo", "model name") or platform.processor()
    memory = int(_proc_field("/proc/meminfo", "MemTotal").split()[0]) * 1024
    versions = {}
    for module in ("torch", "torchvision", "nvidia.dali"):
        try:
            versions[module] = __import__(module, fromlist=["__version__"]).__version__
        except ImportError:
            versions[module] = None
    summary = f"{os.cpu_count()} × {model}, {memory / 2**30:.0f} GiB RAM, Linux {platform.release()}"
    return {"summary": summary, "cpus": os.cpu_count(), "cpu_model": model, "memory_bytes": memory,
            "kernel": platform.release(), "python": platform.python_version(), **versions}


def provenance() -> dict:
    """Which code made the figures: the git commit (and whether the tree had changes), the command, and a
    digest of each source file (``benchmarks.drift`` tells from them when a figure has drifted)."""
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                                  cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"git_sha": git("rev-parse", "HEAD"), "git_dirty": bool(status) if status is not None else None,
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "sources": source_digests()}


def setup_of(args, **more) -> dict:
    """A run's ``setup.json``: the machine, the provenance, the settings (``args``, and whether ``--quick``) and
    ``more``."""
    return {"machine": machine(), "provenance": provenance(),
            "config": {**vars(args), "mode": "quick" if getattr(args, "quick", False) else "full"}, **more}


def write_run(out: str, result: dict, setup: dict, text: str) -> None:
    """Write a run into folder ``out``: ``results.json`` (``result``), ``setup.json`` (``setup``: machine,
    provenance, settings) and ``results.md`` (``text``, also printed)."""
    os.makedirs(out, exist_ok=True)
    for name, content in (("results.json", result), ("setup.json", setup)):
        with open(os.path.join(out, name), "w") as f:
            json.dump(content, f, indent=1)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text + "\n")
    print("\n" + text)


def spread_text(s: dict, fmt=".2f", scale=1.0) -> str:
    """``median [min–max]`` of a :func:`~benchmarks.metrics.spread` (just the value for one run)."""
    if s["n"] == 1:
        return f"{s['median'] / scale:{fmt}}"
    return f"{s['median'] / scale:{fmt}} [{s['min'] / scale:{fmt}}–{s['max'] / scale:{fmt}}]"


def _pct(x) -> str:
    return "–" if x is None else f"{x:.0%}"


def markdown(result: dict, setup: dict) -> str:
    """The run's setup, one row per system × cache fraction × (loader build, epoch), and the
    steady-epoch summary."""
    cfg, dataset = setup["config"], result["dataset_bytes"]
    lines = [
        f"storage_mode: **{result['storage_mode']}**, dataset on **{result['dataset_on']}** "
        f"({setup['storage_detail']}); "
        f"bandwidth {result['bandwidth_bytes_per_s'] / MIB:.1f} MiB/s"
        + (f", {cfg['read_iops']} read requests/s" if cfg.get("read_iops") else "") + f"; dataset {cfg['images']} JPEGs, "
        f"{dataset / MIB:.1f} MiB; batch {cfg['batch_size']}, {cfg['workers']} workers, "
        f"compute {cfg['compute_ms']:g} ms/batch; machine: {setup['machine']['summary']}.",
        "",
        "| system | cache | rep | epoch | time_s | samples/s | stall_s | device MiB | of dataset | hits | hit % "
        "| simulated hit % | page cache p99 MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    runs = measured(result["runs"])
    for run in runs:
        built, rep = run["build_device_read_bytes"], run.get("rep", 0) + 1
        p99 = run.get("memory", {}).get("p99_page_cache_bytes")
        lines.append(f"| {run['system']} | {run['cache_fraction']:.0%} | {rep} | build | {run['build_s']:.2f} | – | – | "
                     f"{built / MIB:.1f} | {built / dataset:.0%} | – | – | – | "
                     f"{'–' if p99 is None else f'{p99 / MIB:.1f}'} |")
        for e in run["epochs"]:
            hits = f"{e['hits']}" + ("" if e["hits_source"] == "loader counters" else " (est.)")
            lines.append(
                f"| {run['system']} | {run['cache_fraction']:.0%} | {rep} | {e['epoch']} | {e['time_s']:.2f} | "
                f"{e['samples_per_s']:.0f} | {e['stall_s']:.2f} | {e['device_read_bytes'] / MIB:.1f} | "
                f"{e['device_read_bytes'] / dataset:.0%} | {hits} | {_pct(e['hit_rate'])} | "
                f"{_pct(e['simulated_hit_rate'])} | |")
    lines += ["", "Steady epochs (2..), median [min–max] over repetitions:", "",
              "| system | cache | runs | time_s | stall_s | device MiB | minimum MiB | speedup |",
              "|---|---|---|---|---|---|---|---|"]
    for c in result["comparisons"]:
        speedup = ", ".join(f"{spread_text(v)}× vs {k}" for k, v in c["speedup"].items()) or "–"
        lines.append(
            f"| {c['system']} | {c['cache_fraction']:.0%} | {c['time_s']['n']} | {spread_text(c['time_s'])} | "
            f"{spread_text(c['stall_s'])} | {spread_text(c['device_read_bytes'], '.1f', MIB)} | "
            f"{c['min_device_read_bytes'] / MIB:.1f} | {speedup} |")
    lines.append("")
    for run in result["runs"]:
        if "skipped" in run or "error" in run:
            why = (f"skipped: {run['skipped']}" if "skipped" in run
                   else f"FAILED: {run['error']}" + (" (its stderr's tail is in results.json)" if "stderr_tail" in run
                                                     else ""))
            lines.append(f"- {run['system']} at {run['cache_fraction']:.0%}, repetition {run.get('rep', 0) + 1}: {why}")
    return "\n".join(lines) + "\n"


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_results(result: dict, out_dir: str) -> list[str]:
    """``steady_time.png`` (steady epoch time per system and cache fraction), ``device_bytes.png``
    (device bytes per epoch) and ``hit_rates.png`` (measured and simulated hit rate per epoch), one
    panel per cache fraction. Returns the files written ([] without matplotlib)."""
    plt, runs = pyplot(), measured(result["runs"])
    if plt is None or not runs:
        return []
    systems = list(dict.fromkeys(r["system"] for r in runs))
    fractions = sorted({r["cache_fraction"] for r in runs})
    steady = {(c["system"], c["cache_fraction"]): c["time_s"] for c in result["comparisons"]}
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        points = [(j + i * width, steady[system, f]) for j, f in enumerate(fractions) if (system, f) in steady]
        xs, ys = [x for x, _ in points], [t["median"] for _, t in points]
        errors = [[t["median"] - t["min"] for _, t in points], [t["max"] - t["median"] for _, t in points]]
        ax.bar(xs, ys, width, yerr=errors, capsize=3, label=system)
    bounds = [(1 - f) * result["dataset_bytes"] / result["bandwidth_bytes_per_s"] for f in fractions]
    ax.scatter([j + 0.4 - width / 2 for j in range(len(fractions))], bounds, marker="_", s=400, color="k",
               label="storage bound")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(fractions))], [f"{f:.0%}" for f in fractions])
    ax.set_xlabel("cache / memory budget (fraction of dataset)")
    ax.set_ylabel("steady epoch time (s): median, min–max")
    ax.set_title(f"Steady epoch time ({result['storage_mode']} storage)")
    ax.legend(fontsize=8)
    written.append(save(fig, plt, os.path.join(out_dir, "steady_time.png")))

    written.append(_per_fraction(plt, runs, fractions, os.path.join(out_dir, "device_bytes.png"), "device read (MiB)",
                                 lambda e: e["device_read_bytes"] / MIB,
                                 lambda f: (1 - f) * result["dataset_bytes"] / MIB, "dataset − cache"))
    written.append(_per_fraction(plt, runs, fractions, os.path.join(out_dir, "hit_rates.png"),
                                 "hit rate (dashed: simulated)", lambda e: e["hit_rate"], lambda f: f,
                                 "cache fraction", simulated=True))
    return written


def _per_fraction(plt, runs, fractions, path, ylabel, value, reference, reference_label, simulated=False) -> str:
    """One panel per cache fraction: ``value(epoch)`` against epoch for every system (and, with
    ``simulated``, its simulated hit rate dashed), with a dotted reference line."""
    fig, axes = plt.subplots(1, len(fractions), figsize=(4 * len(fractions), 3.5), squeeze=False, sharey=True)
    systems = list(dict.fromkeys(r["system"] for r in runs))
    for ax, fraction in zip(axes[0], fractions):
        labelled = set()
        for run in (r for r in runs if r["cache_fraction"] == fraction):  # every repetition, one colour a system
            epochs, color = [e["epoch"] for e in run["epochs"]], f"C{systems.index(run['system'])}"
            label = None if run["system"] in labelled else run["system"]
            labelled.add(run["system"])
            ax.plot(epochs, [value(e) for e in run["epochs"]], marker="o", color=color, label=label, alpha=0.8)
            if simulated:
                ax.plot(epochs, [e["simulated_hit_rate"] for e in run["epochs"]], linestyle="--", color=color)
        ax.axhline(reference(fraction), color="k", linestyle=":", label=reference_label)
        ax.set_title(f"cache {fraction:.0%}")
        ax.set_xlabel("epoch")
        ax.set_xticks(sorted({e["epoch"] for r in runs for e in r["epochs"]}))
        ax.set_ylim(bottom=0)
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=8)
    return save(fig, plt, path)


def plot_cache_sim(rows: list[dict], path: str) -> bool:
    """Simulated hit rate per epoch, one panel per cache fraction. False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    fractions = sorted({r["cache_fraction"] for r in rows})
    fig, axes = plt.subplots(1, len(fractions), figsize=(4 * len(fractions), 3.5), squeeze=False, sharey=True)
    for ax, fraction in zip(axes[0], fractions):
        for r in rows:
            if r["cache_fraction"] == fraction:
                ax.plot(range(1, len(r["hit_rates"]) + 1), r["hit_rates"], marker="o",
                        label=f"{r['policy']} ({r['order']})")
        ax.axhline(fraction, color="k", linestyle=":", label="cache fraction")
        ax.set_title(f"cache {fraction:.0%}")
        ax.set_xlabel("epoch")
    axes[0][0].set_ylabel("hit rate")
    axes[0][-1].legend(fontsize=8)
    save(fig, plt, path)
    return True


def axes(figsize=(6, 4)):
    """``(plt, fig, ax)`` for one plot, or None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=figsize)
    return plt, fig, ax


def write_json_and_markdown(out_dir: str, result: dict, text: str) -> None:
    """``results.json`` (``result``) and ``results.md`` (``text``) in ``out_dir``, made if missing."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(text)


def save(fig, plt, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write(result: dict, setup: dict, out_dir: str) -> list[str]:
    """Write ``results.json`` (``result``), ``setup.json`` (``setup``: machine, configuration, the
    simulated hit rates), ``results.md`` and the plots into ``out_dir``; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    plots = plot_results(result, out_dir)
    setup["plots"] = [os.path.basename(p) for p in plots] or NO_PLOTS
    paths = [os.path.join(out_dir, name) for name in ("results.json", "setup.json", "results.md")]
    for path, content in zip(paths, (result, setup)):
        with open(path, "w") as f:
            json.dump(content, f, indent=2)
    with open(paths[2], "w") as f:
        f.write(markdown(result, setup))
    return paths + plots
