"""Running a benchmark module end to end from the repository, as a user would."""

import os
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLEANUP_GRACE_S = 60
"""How long a benchmark stopped with SIGTERM may take to undo what it made (loop devices, cgroups, folders)."""


def run_to_end(cmd: list[str], timeout_s: float, **kwargs) -> subprocess.CompletedProcess:
    """Run ``cmd`` with its output captured. Past ``timeout_s`` it gets SIGTERM, as Ctrl-C, so that its cleanup
    runs (SIGKILL would leave its devices and folders behind), and the test fails with what it printed.
    A test calling this needs a pytest timeout above ``timeout_s + CLEANUP_GRACE_S``."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=CLEANUP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past {timeout_s:.0f} s and was stopped; it printed:\n{out[-2000:]}\n"
                    f"{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_module(module: str, args: list[str], tmp_path, timeout_s: float = 200) -> subprocess.CompletedProcess:
    """``python -m module *args`` from the repository root, its temporary files under ``tmp_path``."""
    env = {**os.environ, "PYTHONPATH": REPO, "TMPDIR": str(tmp_path)}
    return run_to_end([sys.executable, "-m", module, *args], timeout_s, cwd=REPO, env=env)
