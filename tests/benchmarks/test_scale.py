"""``benchmarks.scale``: the projection's model, and a tiny run end to end."""

import json
import os
import sys

import pytest

from benchmarks.scale import project
from tests.benchmarks._bench import REPO, run_to_end


def test_the_projection_is_bound_by_the_slower_of_prep_and_storage():
    prep_bound = project(n=1000, t_prep_s=0.004, t_loader_s=0.001, file_bytes=100e3, workers=5, cache=0.5, mbps=100)
    assert prep_bound["prep_s"] == pytest.approx(1000 * 0.005 / 5)  # 1 s
    assert prep_bound["storage_s"] == pytest.approx(0.5 * 1000 * 100e3 / 100e6)  # 0.5 s
    assert prep_bound["bound"] == "prep" and prep_bound["epoch_s"] == prep_bound["prep_s"]
    assert prep_bound["loader_share"] == pytest.approx(0.2)
    slow_disk = project(n=1000, t_prep_s=0.004, t_loader_s=0.001, file_bytes=100e3, workers=5, cache=0.5, mbps=10)
    assert slow_disk["bound"] == "storage" and slow_disk["epoch_s"] == pytest.approx(5.0)
    cached = project(n=1000, t_prep_s=0.004, t_loader_s=0.001, file_bytes=100e3, workers=5, cache=1.0, mbps=10)
    assert cached["storage_s"] == 0 and cached["bound"] == "prep"


@pytest.mark.slow
def test_a_tiny_run_times_every_size_and_system_and_leaves_its_files_only_where_asked(tmp_path, shm_namespace):
    out, work = tmp_path / "out", tmp_path / "work"
    work.mkdir()
    done = run_to_end([sys.executable, "-m", "benchmarks.scale", "--sizes", "1000", "3000", "--reps", "2",
                       "--epochs", "1", "--workers", "1", "--batch-size", "64", "--workdir", str(work),
                       "--clean", "--out", str(out)], 200, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    assert [p["size"] for p in result["points"]] == [1000, 3000]
    assert sorted((t["size"], t["system"], t["rep"]) for t in result["trials"]) == sorted(
        (size, system, rep) for size in (1000, 3000) for system in ("torch", "coordl") for rep in (0, 1))
    for p in result["points"]:
        assert p["coordl_epoch_s"]["n"] == 2 and p["torch_epoch_s"]["min"] > 0
        assert p["imagefolder_s"]["n"] == 2 and p["coordl-new-cache_s"]["n"] == 2
    projection = result["projection"]
    assert 0 < projection["inputs"]["t_loader_s"] < projection["inputs"]["t_prep_s"]
    assert projection["inputs"]["file_bytes"] > 10_000  # ImageNet-like JPEGs, not the one-byte files
    assert projection["output"]["epoch_s"] > 0
    assert "Projected ImageNet epoch" in (out / "results.md").read_text()
    assert os.listdir(work) == []  # --clean
    assert os.listdir(shm_namespace) == []
