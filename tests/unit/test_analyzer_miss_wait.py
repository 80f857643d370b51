"""The rates phase's L: reads in the job's pattern (readers at once, a batch's misses in a row, a pause for
its prep), against a storage that banks idle time as a throttle does."""

import threading
import time

import pytest

from coordl.analyzer import phases


class _BurstCredit:
    """Reads of ``rate_bps`` bytes/s with up to ``depth_s`` of idle time banked (a token bucket, as a cgroup
    throttle or a cloud volume serves); records when each thread read what."""

    def __init__(self, rate_bps: float, depth_s: float, size: int):
        self.rate, self.depth, self.size = rate_bps, depth_s, size
        self.lock, self.free_at, self.reads = threading.Lock(), time.monotonic(), []

    def read(self, key: str) -> bytes:
        with self.lock:
            now = time.monotonic()
            start = max(self.free_at, now - self.depth)  # at most depth_s of idle time banked
            self.free_at = start + self.size / self.rate
            wait = self.free_at - now
        if wait > 0:
            time.sleep(wait)
        self.reads.append((threading.get_ident(), time.monotonic(), key))
        return b"x" * self.size


def test_each_reader_reads_its_bursts_then_pauses_all_readers_at_once():
    storage = _BurstCredit(rate_bps=1e9, depth_s=0.0, size=10)
    keys = [f"k{i}" for i in range(24)]
    wait, cold = phases._miss_wait(storage.read, keys, 240, readers=2, burst=3, pause_s=0.2)
    assert wait > 0 and (cold is None or cold >= 0)
    threads = {}
    for ident, at, key in storage.reads:
        threads.setdefault(ident, []).append((at, key))
    assert len(threads) == 2 and sorted(k for t in threads.values() for _, k in t) == sorted(keys)
    for reads in threads.values():
        gaps = [b[0] - a[0] for a, b in zip(reads, reads[1:])]
        assert [g >= 0.19 for g in gaps] == [(i + 1) % 3 == 0 for i in range(len(gaps))]  # a pause after each 3


def test_a_pause_for_prep_lets_a_throttle_serve_the_next_misses_from_banked_time():
    """5 ms a read at the throttled rate; with 20 ms of prep between bursts of 4, about 20 ms are banked and
    the burst's reads come almost at once, as the job's worker sees them; without a pause each costs 5 ms."""
    size = 50_000
    keys = [f"k{i}" for i in range(16)]
    busy, _ = phases._miss_wait(_BurstCredit(1e7, 0.02, size).read, keys, 16 * size, readers=1, burst=4,
                                pause_s=0.0)
    paced, _ = phases._miss_wait(_BurstCredit(1e7, 0.02, size).read, keys, 16 * size, readers=1, burst=4,
                                 pause_s=0.02)
    assert busy == pytest.approx(0.005, rel=0.3)
    assert paced < 0.5 * busy
