"""L's probe: cold reads in bursts of a batch's misses, the bursts paced below the storage's rate."""
import time

import pytest

from coordl._core.settings import ANALYZE_TIME_SCALE_ENV
from coordl.analyzer import phases


@pytest.fixture(autouse=True)
def full_least_times(monkeypatch):
    """The probes' least times as they are (the suite's jobs run them scaled)."""
    monkeypatch.setenv(ANALYZE_TIME_SCALE_ENV, "1")


def test_misses_per_batch_follow_the_cache_and_its_peers():
    assert phases.misses_per_batch(16, 0.0) == 16
    assert phases.misses_per_batch(16, 0.25) == 12
    assert phases.misses_per_batch(16, 0.25, servers=2) == 8  # the other server's cache holds another quarter
    assert phases.misses_per_batch(16, 1.0) == 1  # no misses: a lone read still measures one
    assert phases.misses_per_batch(16, 0.6, servers=2) == 1


def test_reads_come_in_back_to_back_bursts_paced_at_half_the_storage_rate(monkeypatch):
    monkeypatch.setattr(phases, "STORAGE_REST_S", 0.0)
    starts = []

    def read(key):
        starts.append(time.perf_counter())
        time.sleep(0.002)
        return b"x"

    rate = 100.0  # samples/s: a burst of 4 every 4 · 2 / 100 = 80 ms
    mean, cold = phases._miss_wait(read, [f"/nonexistent/{i}" for i in range(10)], 10, rate, burst=4)
    assert len(starts) == 10
    assert 0.002 <= mean < 0.015  # a read's own time, none of the pause (20 ms a read if it were in)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    within = [g for i, g in enumerate(gaps) if (i + 1) % 4 != 0]
    between = [gaps[3], gaps[7]]
    assert max(within) < 0.015  # back to back: a read's own 2 ms, not a pause
    assert starts[4] - starts[0] >= 0.080 - 0.001 and starts[8] - starts[4] >= 0.080 - 0.001
    # the pause after a burst: the period less the burst's first three reads, which the line above the last
    # bounds at 45 ms however slow the machine, so a pause is never under 80 - 45 ms
    assert min(between) > 0.030


def test_hit_rate_is_timed_over_passes_after_a_first_for_at_least_the_least_time(monkeypatch):
    monkeypatch.setattr(phases, "HIT_MIN_S", 0.05)
    calls = []

    def hit(item):
        calls.append(item)
        time.sleep(0.05 if len(calls) <= 3 else 0.001)  # the first pass is slow (a stall), the rest are not
        return item

    rate = phases._hit_rate(hit, [1, 2, 3], cores=1)
    assert len(calls) % 3 == 0 and len(calls) >= 3 * 3  # whole passes: the first, then enough for 50 ms
    assert rate > 3 / 0.010  # the first pass (50 ms a hit) is not in it: counted, the rate would be about 20/s
