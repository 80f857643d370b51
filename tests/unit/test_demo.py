"""The demo's conclusion says what its numbers support."""

from coordl.demo import MiB, conclusion


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
