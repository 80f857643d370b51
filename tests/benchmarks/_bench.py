"""Running a benchmark module end to end from the repository, as a user would."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_module(module: str, args: list[str], tmp_path, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """``python -m module *args`` from the repository root, its temporary files under ``tmp_path``."""
    env = {**os.environ, "PYTHONPATH": REPO, "TMPDIR": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=timeout_s)
