"""Which figures in docs/benchmarks.md still describe the code on this checkout.

Every run records, in its provenance, a digest of each source file it could measure (the package, the
shared harness, the benchmarks): the file's code with comments and docstrings left out, so that editing
prose drifts nothing. A claim (a results folder the docs quote) has drifted when a file under the paths
it measures has another digest now, or is new or gone. ``python -m benchmarks.drift`` lists every claim
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
    Claim("results/torch-suite", (*DATA_PATH, "tools/torch_dataloader_suite.py")),
)


def code_digest(path: str) -> str:
    """A digest of a file's code: Python without its comments and docstrings (its syntax tree), other
    files as they are."""
    with open(path, "rb") as f:
        data = f.read()
    if path.endswith(".py"):
        try:
            tree = ast.parse(data)
        except SyntaxError:
            pass
        else:
            for node in ast.walk(tree):
                body = getattr(node, "body", None)
                if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                        isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                    node.body = body[1:] or [ast.Pass()]
            data = ast.dump(tree, include_attributes=False).encode()
    return hashlib.sha256(data).hexdigest()[:16]


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
    """The files under ``prefixes`` whose digest differs between ``recorded`` and ``current``, or that
    only one of them has."""
    return sorted(p for p in set(recorded) | set(current)
                  if _under(p, prefixes) and recorded.get(p) != current.get(p))


def recorded_provenances(folder: str) -> list[dict | None]:
    """The provenance of each run in ``folder`` and its subfolders (a ``setup.json`` or ``results.json``
    each), None for a run that recorded none."""
    found = []
    for where, dirs, files in os.walk(folder):
        dirs.sort()
        for name in ("setup.json", "results.json"):
            if name in files:
                with open(os.path.join(where, name)) as f:
                    found.append(_find_provenance(json.load(f)))
                dirs[:] = []  # a run's own subfolders (sweep's bandwidths) are the run's
                break
    return found


def _find_provenance(doc):
    if isinstance(doc, dict):
        if "git_sha" in doc:
            return doc
        for value in doc.values():
            found = _find_provenance(value)
            if found is not None:
                return found
    return None


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
        shas = {(run or {}).get("git_sha") or "?" for run in recorded_provenances(os.path.join(ROOT, claim.folder))}
        sha = ", ".join(sorted(s[:7] for s in shas)) or "no runs"
        if files == []:
            print(f"current  {claim.folder} ({sha})")
            continue
        drifted += 1
        why = "a run without digests" if files is None else \
            f"{len(files)} file(s) changed: {', '.join(files[:4])}{' …' if len(files) > 4 else ''}"
        print(f"DRIFTED  {claim.folder} ({sha}): {why}; rerun {claim.folder}/run.sh")
    print(f"{len(CLAIMS) - drifted} of {len(CLAIMS)} claims current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
