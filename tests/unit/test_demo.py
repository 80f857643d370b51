"""The demo's conclusion says what its numbers support."""

import pytest

from coordl.demo import STORAGE_MARGIN, MiB, bound_by, conclusion, storage_bound_mbps


def _rows(system: str, read_mib: list[float], hits: list[int]) -> list[dict]:
    return [{"system": system, "epoch": e, "read_bytes": mib * MiB, "hits": h, "misses": 100 - h,
             "samples_per_s": 100.0 * (1 + h / 100)} for e, (mib, h) in enumerate(zip(read_mib, hits), 1)]


def test_conclusion_compares_epochs_after_the_first():
    rows = _rows("torch", [100, 80, 90], [0, 20, 10]) + _rows("coordl", [100, 50, 50], [0, 50, 50])
    why, line = conclusion(rows, 50 * MiB).splitlines()
    assert "torch's LRU page cache served 15% of the samples, and coordl's cache" in why
    assert "epoch 1, 50%: in each new random order the LRU has evicted" in why
    assert line == ("coordl read 50.0 MiB from storage per epoch after the first, 1.7× less than torch's 85.0 MiB, "
                    "with the same 50.0 MiB of memory, at 1.3× torch's samples/s.")


def test_conclusion_says_when_coordl_reads_nothing_or_more():
    torch_rows = _rows("torch", [100, 10], [0, 90])
    assert "coordl read nothing from storage per epoch after the first, torch 10.0 MiB" in conclusion(
        torch_rows + _rows("coordl", [100, 0], [0, 100]), 100 * MiB)
    more = conclusion(torch_rows + _rows("coordl", [100, 20], [0, 80]), 0)
    assert "2.0× more than torch's 10.0 MiB" in more and "evicted" not in more


def test_the_picked_disk_takes_longer_to_read_an_epochs_misses_than_prep_takes_to_prepare_it():
    mean_bytes, prep = 110_000.0, 400.0  # samples/s
    for fraction in (0.3, 0.5, 0.9):
        mbps = storage_bound_mbps(mean_bytes, prep, fraction)
        read_s = max(1 - fraction, 0.25) * 1000 * mean_bytes / (mbps * 1e6)  # an epoch of 1000 samples
        assert read_s == pytest.approx(STORAGE_MARGIN * 1000 / prep)


def test_an_epoch_near_its_disk_time_floor_was_bound_by_storage():
    assert bound_by({"disk_s": 9.0, "time_s": 10.0}, workers=2) == "storage"
    assert bound_by({"disk_s": 3.0, "time_s": 10.0}, workers=2) == "prep"
    assert bound_by({"disk_s": 6.0, "time_s": 10.0}, workers=0) == "storage"  # reads and prep in turn
    assert bound_by({"disk_s": 6.0, "time_s": 10.0}, workers=2) == "prep"
