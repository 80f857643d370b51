"""Run PyTorch's own DataLoader tests against coordl: every test that passes with torch must pass with coordl.

    python tools/torch_dataloader_suite.py PATH/TO/test_dataloader.py [--out result.json]

PATH is ``test/test_dataloader.py`` of the pytorch repository, best at the installed torch's version (tests
written for another version may fail with torch too; only the difference counts). It needs ``expecttest``
(``pip install expecttest``). The file runs twice under pytest, each time in a fresh folder
with its own ``$COORDL_SHM_DIR``: once as it is, once with ``torch.utils.data.DataLoader`` replaced by
``coordl.DataLoader`` in every Python process the run starts (the pytest process, the test's spawned
children and ``python -c`` subprocesses, DataLoader workers) by a generated ``sitecustomize.py``, active
only in that run. It then prints, and writes as JSON with ``--out``:

- each run's passed / failed / skipped counts, and the tests that pass with torch but not with coordl;
- the warnings coordl issued in the coordl run (from every process), counted by kind;
- what either run left behind: files in its shm folder, processes still running with it.

The exit status is 0 when nothing passes with torch only and nothing was left behind.
"""

import argparse
import collections
import glob
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCH_ENV = "COORDL_TORCH_SUITE_PATCH"
WARN_LOG_ENV = "COORDL_TORCH_SUITE_WARNINGS"
LEFTOVER_GRACE_S = 10

# Imported by every Python process of a run (it is on PYTHONPATH); does nothing unless PATCH_ENV is set.
SITECUSTOMIZE = textwrap.dedent(f'''\
    import os

    if os.environ.get("{PATCH_ENV}") == "1":
        import warnings

        import torch.utils.data

        import coordl

        torch.utils.data.DataLoader = coordl.DataLoader
        _warn = warnings.warn

        def _logged_warn(message, category=None, stacklevel=1, source=None, **kwargs):
            """Record each coordl warning as it is issued (before filters dedupe it), then warn."""
            text = str(message)
            if text.startswith("coordl"):
                with open(os.environ["{WARN_LOG_ENV}"], "a") as log:
                    log.write(f"{{os.getpid()}}\\t{{text.splitlines()[0]}}\\n")
            return _warn(message, category, stacklevel + 1, source, **kwargs)

        warnings.warn = _logged_warn
''')


def _processes_with_env(marker: bytes) -> list[int]:
    """Pids of processes whose environment holds ``marker`` (this one excluded)."""
    found = []
    for environ in glob.glob("/proc/[0-9]*/environ"):
        pid = int(environ.split("/")[2])
        if pid == os.getpid():
            continue
        try:
            with open(environ, "rb") as f:
                if marker in f.read().split(b"\0"):
                    found.append(pid)
        except OSError:
            continue
    return found


def _outcomes(junit_path: str) -> dict[str, str]:
    """``Class::test`` -> passed / failed / skipped, from pytest's JUnit XML."""
    outcomes = {}
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        name = f"{case.get('classname').rsplit('.', 1)[-1]}::{case.get('name')}"
        tags = {child.tag for child in case}
        outcomes[name] = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
    return outcomes


def _warning_kinds(log_path: str) -> dict:
    """The coordl warnings a run issued: total, processes, and counts by kind (the text before ':')."""
    if not os.path.exists(log_path):
        return {"total": 0, "processes": 0, "by_kind": {}}
    with open(log_path) as f:
        lines = [line.rstrip("\n").split("\t", 1) for line in f if "\t" in line]
    kinds = collections.Counter(text.split(":", 1)[0] for _, text in lines)
    return {"total": len(lines), "processes": len({pid for pid, _ in lines}), "by_kind": dict(kinds.most_common())}


def run_suite(test_file: str, *, coordl: bool, timeout_s: int, select: str | None) -> dict:
    """One pytest run of ``test_file`` in a fresh folder and shm folder, with or without the patch."""
    mode = "coordl" if coordl else "torch"
    work = tempfile.mkdtemp(prefix=f"coordl-torchsuite-{mode}-")
    site = os.path.join(work, "site")
    os.mkdir(site)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(SITECUSTOMIZE)
    target = os.path.join(work, os.path.basename(test_file))  # the file imports itself by its base name
    shutil.copyfile(test_file, target)
    ini = os.path.join(work, "pytest.ini")
    with open(ini, "w") as f:
        f.write("[pytest]\n")
    shm = f"/dev/shm/cdlsuite-{secrets.token_hex(6)}"
    os.mkdir(shm, 0o700)
    junit, warn_log = os.path.join(work, "junit.xml"), os.path.join(work, "coordl-warnings.log")
    env = dict(os.environ, COORDL_SHM_DIR=shm, **{WARN_LOG_ENV: warn_log})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, REPO, env.get("PYTHONPATH")) if p)
    env.pop(PATCH_ENV, None)
    if coordl:
        env[PATCH_ENV] = "1"
    cmd = [sys.executable, "-m", "pytest", target, "-c", ini, "--rootdir", work, "-p", "no:cacheprovider", "-q",
           f"--timeout={timeout_s}", f"--junitxml={junit}", "-o", "junit_family=xunit1"]
    if select:
        cmd += ["-k", select]
    print(f"[{mode}] {' '.join(cmd)}", flush=True)
    started = time.monotonic()
    with open(os.path.join(work, "pytest.log"), "w") as log:
        rc = subprocess.call(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    elapsed = time.monotonic() - started
    marker = f"COORDL_SHM_DIR={shm}".encode()
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while _processes_with_env(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    stray = _processes_with_env(marker)
    for pid in stray:  # this run's own processes
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shm_left = sorted(os.listdir(shm))
    shutil.rmtree(shm, ignore_errors=True)
    outcomes = _outcomes(junit) if os.path.exists(junit) else {}
    counts = collections.Counter(outcomes.values())
    print(f"[{mode}] pytest exit {rc} in {elapsed:.0f}s: {dict(counts)}; log: {work}/pytest.log", flush=True)
    return {"mode": mode, "pytest_exit": rc, "seconds": round(elapsed), "log": os.path.join(work, "pytest.log"),
            "counts": {k: counts.get(k, 0) for k in ("passed", "failed", "skipped")}, "outcomes": outcomes,
            "coordl_warnings": _warning_kinds(warn_log), "shm_left": shm_left, "processes_left": stray}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("test_file", help="pytorch's test/test_dataloader.py")
    parser.add_argument("--out", help="write the result as JSON here")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test (pytest-timeout)")
    parser.add_argument("-k", dest="select", help="pytest -k expression: run only these tests")
    parser.add_argument("--only", choices=("torch", "coordl"), help="run only one of the two")
    args = parser.parse_args(argv)
    test_file = os.path.abspath(args.test_file)
    if not os.path.isfile(test_file):
        parser.error(f"no such file: {test_file}")
    runs = {}
    for coordl in (False, True):
        mode = "coordl" if coordl else "torch"
        if args.only in (None, mode):
            runs[mode] = run_suite(test_file, coordl=coordl, timeout_s=args.timeout, select=args.select)
    result = {"test_file": test_file, "runs": runs}
    bad = any(run["shm_left"] or run["processes_left"] for run in runs.values())
    if len(runs) == 2:
        torch_run, coordl_run = runs["torch"]["outcomes"], runs["coordl"]["outcomes"]
        result["pass_with_torch_only"] = sorted(t for t, o in torch_run.items()
                                                if o == "passed" and coordl_run.get(t) != "passed")
        result["pass_with_coordl_only"] = sorted(t for t, o in coordl_run.items()
                                                 if o == "passed" and torch_run.get(t) != "passed")
        bad = bad or bool(result["pass_with_torch_only"])
    for mode, run in runs.items():
        print(f"{mode}: {run['counts']}, {run['seconds']}s; coordl warnings {run['coordl_warnings']}; "
              f"left in shm {run['shm_left']}; processes left {run['processes_left']}")
    for key in ("pass_with_torch_only", "pass_with_coordl_only"):
        if key in result:
            print(f"{key} ({len(result[key])}):" + "".join(f"\n  {t}" for t in result[key]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
