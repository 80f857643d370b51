"""``python -m benchmarks.sweep`` end to end on a tiny dataset (emulated storage: no root needed)."""

import json
import os

import pytest

from benchmarks import sweep
from harness.storage_env import PREFIX


@pytest.mark.slow
def test_a_sweep_runs_every_bandwidth_and_collects_the_speedups(tmp_path, monkeypatch):
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    status = sweep.main(["--read-mbps", "2", "50", "--images", "64", "--mean-side-px", "160", "--workdir", str(work),
                         "--out", str(out), "--storage", "emulated", "--reps", "1", "--epochs", "2",
                         "--workers", "1", "--compute-ms", "0"])
    assert status == 0
    with open(out / "results.json") as f:
        result = json.load(f)
    assert [p["read_mbps"] for p in result["points"]] == [2, 50] and result["cache_fraction"] == 0.5
    slow, fast = result["points"]
    for point in (slow, fast):
        assert set(point["systems"]) == {"torch", "coordl"} and point["failed"] == []
        assert os.path.exists(out / point["folder"] / "results.json")
    # The slower the disk, the longer torch's epochs (it rereads what its page cache lost).
    assert slow["systems"]["torch"]["time_s"]["median"] > fast["systems"]["torch"]["time_s"]["median"]
    assert slow["systems"]["coordl"]["speedup"]["torch"]["n"] == 1
    assert result["setup"]["minio_args"][:2] == ["--storage", "emulated"]
    assert "| 2 |" in (out / "results.md").read_text()
    assert [name for name in os.listdir(work) if name.startswith(PREFIX)] == []
