"""The suite's own machinery. Its tiers (``tests/README.md``): a plain ``pytest`` leaves the slow tests out and
fails a test over the default tier's limit; ``--all``, ``-m`` and tests named by id run whatever they select, with
no limit. Its jobs (``_procs.spawn``): forked from a preloaded forkserver, each with its test's environment, and
one left running fails its test."""

import pytest

TESTS = """
import time
import pytest

def test_quick():
    pass

def test_over_the_limit():
    time.sleep(0.2)

@pytest.mark.budget(5)
def test_with_a_budget():
    time.sleep(0.2)

@pytest.mark.slow
def test_slow():
    time.sleep(0.2)
"""


@pytest.fixture
def run(pytester):
    pytester.makepyfile(test_tiered=TESTS)

    def run(*args):
        return pytester.runpytest_inprocess("-p", "tests.conftest", "--tier-limit", "0.1", "-p", "no:cacheprovider",
                                            *args)
    return run


def test_the_default_tier_leaves_slow_tests_out_and_fails_one_over_its_limit(run):
    result = run()
    result.assert_outcomes(passed=2, failed=1, deselected=1)
    result.stdout.fnmatch_lines(["*test_over_the_limit: its call took * s, over the default tier's 0.1 s: make it "
                                 "faster, or mark it @pytest.mark.slow*"])


@pytest.mark.parametrize("args", [["--all"], ["-m", "slow or not slow"]])
def test_every_tier_runs_with_all_or_a_mark_expression_and_no_limit(run, args):
    run(*args).assert_outcomes(passed=4)


def test_a_test_named_by_its_id_runs_whatever_its_tier(run, pytester):
    run(f"{pytester.path}/test_tiered.py::test_slow").assert_outcomes(passed=1)


JOB_SEES = """
import os
from tests import _procs

def test_a_job_sees_its_tests_environment(tmp_path):
    job = _procs.spawn(_procs.write_environment, str(tmp_path / "env"))
    _procs.join_ok(job)
    assert (tmp_path / "env").read_text() == os.environ["COORDL_SHM_DIR"]
"""

JOB_LEFT = """
import time
from tests import _procs

def test_a_job_left_running():
    _procs.spawn(time.sleep, 60)
"""


def test_a_job_has_its_tests_environment(pytester):
    pytester.makepyfile(test_jobs=JOB_SEES)
    pytester.runpytest_inprocess("-p", "tests.conftest", "-p", "no:cacheprovider").assert_outcomes(passed=1)


@pytest.mark.slow  # the guard gives a job its grace (conftest.LEAK_GRACE_S) before it fails the test
def test_a_job_left_running_fails_its_test(pytester):
    pytester.makepyfile(test_jobs=JOB_LEFT)
    result = pytester.runpytest_inprocess("-p", "tests.conftest", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_a_job_left_running*", "*test left processes running: [[]*"])
