"""Which figures in docs/benchmarks.md still describe the code on this checkout.

Every run records, in its provenance, a digest of each source file it could measure (the package, the
shared harness, the benchmarks): the file's code with comments and docstrings left out, so that editing
prose drifts nothing. A claim (a results folder the docs quote) has drifted when a file under the paths
it measures has another digest now, or is gone. A file that is new since the run does not drift it: the run
could not have used it, and code that uses it now changed to do so. ``python -m benchmarks.drift`` lists every claim
and what changed under it; ``tests/unit/test_benchmark_claims.py`` fails when the docs call a drifted
figure current.
"""

import argparse
import ast
import dataclasses
import hashlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDED = ("coordl", "harness", "benchmarks", "tools")  # what a run's provenance digests

# The loader's data path: the package less the analyzer and the commands built on it.
DATA_PATH = ("coordl/", "!coordl/analyzer/", "!coordl/cli.py", "!coordl/demo.py", "!coordl/_demo/", "harness/")


@dataclasses.dataclass(frozen=True)
class Claim:
    """A results folder the docs quote and the paths its figures depend on (prefixes; ``!`` excludes one)."""

    folder: str
    measures: tuple[str, ...]


def _data_path_and(*modules: str) -> tuple[str, ...]:
    return (*DATA_PATH, *(f"benchmarks/{m}.py" for m in modules))


MINIO = _data_path_and("minio", "systems", "metrics")
ANALYZER = _data_path_and("analyzer", "analyzer_job", "gpu_stall") + ("coordl/analyzer/",)

CLAIMS = (
    Claim("results/minio", MINIO),
    Claim("results/minio-iops", MINIO),
    Claim("results/sweep", (*MINIO, "benchmarks/sweep.py")),
    Claim("results/cache-sim", ("benchmarks/cache_sim.py",)),
    Claim("results/hotpath", _data_path_and("hotpath")),
    Claim("results/live-split", _data_path_and("live_split", "hotpath")),
    Claim("results/dali-feed", MINIO),
    Claim("results/dali-throughput", _data_path_and("dali_throughput")),
    Claim("results/gpu-stall", _data_path_and("gpu_stall")),
    Claim("results/coordprep", _data_path_and("coordprep")),
    Claim("results/construction", _data_path_and("construction")),
    Claim("results/scale", _data_path_and("scale", "construction")),
    Claim("results/partitioned", _data_path_and("partitioned", "partitioned_job")),
    Claim("results/placement", ("benchmarks/placement.py",)),
    Claim("results/locality-sim", ("benchmarks/locality.py", "coordl/_peer/locality.py")),
    Claim("results/analyzer", ANALYZER),
    Claim("results/knees", ANALYZER + ("benchmarks/knees.py",)),
    Claim("results/analyzer-heldout", ANALYZER + ("benchmarks/heldout.py",)),
    Claim("results/objectstore", _data_path_and("objectstore", "metrics", "report")),
    Claim("results/torch-suite", (*DATA_PATH, "tools/torch_dataloader_suite.py")),
    Claim("results/disktier", _data_path_and("disktier", "systems", "metrics", "report")),
    Claim("results/rehearsal", _data_path_and("rehearsal", "metrics", "report")),
)


def code_digest(path: str) -> str:
    """A digest of a file's code: Python as its syntax tree without comments and without string statements
    (docstrings, and the strings that document a constant after it), written out the same way on every
    Python version (:func:`_canonical`); other files as they are."""
    with open(path, "rb") as f:
        data = f.read()
    if path.endswith(".py"):
        try:
            tree = ast.parse(data)
        except SyntaxError:
            pass
        else:
            data = _canonical(tree).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def _is_prose(node) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _canonical(node) -> str:
    """``node`` as text: its type and each field that is set, so that fields a later Python adds empty
    (``type_params``) or leaves out change nothing; string statements dropped from every block."""
    if isinstance(node, ast.AST):
        fields = []
        for name, value in ast.iter_fields(node):
            if isinstance(value, list) and name in ("body", "orelse", "finalbody"):
                value = [v for v in value if not _is_prose(v)]
            if value is None or value == []:
                continue
            fields.append(f"{name}={_canonical(value)}")
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return "[" + ",".join(_canonical(v) for v in node) + "]"
    return repr(node)


def source_digests(root: str = ROOT) -> dict[str, str]:
    """``{path: code_digest}`` of every source file a run could measure, paths relative to ``root``."""
    digests = {}
    for top in RECORDED:
        for folder, dirs, files in os.walk(os.path.join(root, top)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
            for name in sorted(files):
                if name.endswith((".py", ".sh", ".json", ".toml")):
                    path = os.path.join(folder, name)
                    digests[os.path.relpath(path, root)] = code_digest(path)
    return digests


def _under(path: str, prefixes: tuple[str, ...]) -> bool:
    included = any(path.startswith(p) for p in prefixes if not p.startswith("!"))
    return included and not any(path.startswith(p[1:]) for p in prefixes if p.startswith("!"))


def changed(recorded: dict[str, str], current: dict[str, str], prefixes: tuple[str, ...]) -> list[str]:
    """The files under ``prefixes`` that ``recorded`` has and whose digest differs in ``current`` (or that are
    gone from it)."""
    return sorted(p for p in recorded if _under(p, prefixes) and recorded[p] != current.get(p))


def recorded_provenances(folder: str) -> list[dict | None]:
    """The provenance of each run in ``folder`` and its subfolders (in its ``setup.json``, else its
    ``results.json`` or ``cache_sim.json``), None for a run that recorded none."""
    found = []
    for where, dirs, files in os.walk(folder):
        dirs.sort()
        names = [n for n in ("setup.json", "results.json", "cache_sim.json") if n in files]
        if names:
            provenance = None
            for name in names:
                with open(os.path.join(where, name)) as f:
                    provenance = _find_provenance(json.load(f))
                if provenance is not None:
                    break
            found.append(provenance)
            dirs[:] = []  # a run's own subfolders (sweep's bandwidths) are the run's
    return found


def _find_provenance(doc):
    """The dict that records a run's commit: the one under a ``provenance`` key, else the first holding a
    ``git_sha`` (a dict with ``sources`` before one without), searching dicts and lists."""
    candidates = []

    def walk(value, key=None):
        if isinstance(value, dict):
            if "git_sha" in value:
                candidates.append((key != "provenance", "sources" not in value, len(candidates), value))
            for k, v in value.items():
                walk(v, k)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    walk(doc)
    return min(candidates, key=lambda c: c[:3])[3] if candidates else None


def drift(claim: Claim, current: dict[str, str], root: str = ROOT) -> list[str] | None:
    """What changed under ``claim``'s paths since its run (empty: current); None when the run recorded
    no digests (it predates them, so it cannot be shown current)."""
    runs = recorded_provenances(os.path.join(root, claim.folder))
    if not runs or any(run is None or "sources" not in run for run in runs):
        return None
    return sorted({path for run in runs for path in changed(run["sources"], current, claim.measures)})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    current, drifted = source_digests(), 0
    for claim in CLAIMS:
        files = drift(claim, current)
        runs = recorded_provenances(os.path.join(ROOT, claim.folder))
        sha = ", ".join(sorted({((run or {}).get("git_sha") or "?")[:7] for run in runs})) or "no runs"
        if files == []:
            print(f"current  {claim.folder} ({sha})")
            continue
        drifted += 1
        why = "no runs" if not runs else "a run without digests" if files is None else \
            f"{len(files)} file(s) changed: {', '.join(files[:4])}{' …' if len(files) > 4 else ''}"
        print(f"DRIFTED  {claim.folder} ({sha}): {why}; rerun {claim.folder}/run.sh")
    print(f"{len(CLAIMS) - drifted} of {len(CLAIMS)} claims current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
