"""The runner the benchmark tests share: a benchmark that runs too long is stopped as with Ctrl-C, so that it
undoes what it made, and the test fails with what it printed."""

import sys

import pytest

from tests.benchmarks._bench import run_to_end

_SLOW_BENCHMARK = """
import signal, sys, time
def cleanup(*_):
    open(sys.argv[1], "w").write("undone")
    sys.exit(130)
signal.signal(signal.SIGTERM, cleanup)
print("made a loop device", flush=True)
time.sleep(60)
"""


def test_a_run_past_its_time_is_stopped_with_sigterm_and_its_output_named(tmp_path):
    undone = tmp_path / "undone"
    with pytest.raises(pytest.fail.Exception, match=r"(?s)ran past 1 s and was stopped.*made a loop device"):
        run_to_end([sys.executable, "-c", _SLOW_BENCHMARK, str(undone)], 1)
    assert undone.read_text() == "undone"


def test_a_run_within_its_time_returns_its_status_and_output():
    script = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    done = run_to_end([sys.executable, "-c", script], 30)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
