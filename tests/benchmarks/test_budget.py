"""How a run's memory is read, summarized and held to its budget, and the order runs are made in."""

import os

from benchmarks.minio import run_order
from harness.storage_env import SLACK_BYTES, Cgroup, memory_summary, over_budget

MIB = 2**20


def _cgroup_v1(tmp_path, **stat) -> Cgroup:
    group = Cgroup.__new__(Cgroup)
    group.version, group.dirs = 1, [str(tmp_path)]
    with open(os.path.join(tmp_path, "memory.stat"), "w") as f:
        f.writelines(f"{key} {value}\n" for key, value in stat.items())
    with open(os.path.join(tmp_path, "memory.usage_in_bytes"), "w") as f:
        f.write(str(stat.pop("usage")))
    return group


def test_mapped_shared_memory_is_held_not_page_cache(tmp_path):
    # 100 MiB of shared memory, all of it mapped (coordl's cache), and 10 MiB of the dataset's pages:
    # total_cache counts the shared memory, total_mapped_file counts it again.
    group = _cgroup_v1(tmp_path, usage=130 * MIB, total_cache=110 * MIB, total_shmem=100 * MIB,
                       total_mapped_file=100 * MIB, total_inactive_file=6 * MIB, total_active_file=4 * MIB)
    held, shmem, page_cache = group.memory()
    assert (held, shmem, page_cache) == (120 * MIB, 100 * MIB, 10 * MIB)


def test_mapped_dataset_pages_count_as_page_cache(tmp_path):
    group = _cgroup_v1(tmp_path, usage=50 * MIB, total_cache=30 * MIB, total_shmem=0, total_mapped_file=30 * MIB,
                       total_inactive_file=20 * MIB, total_active_file=10 * MIB)
    assert group.memory() == (20 * MIB, 0, 30 * MIB)


def test_the_summary_keeps_percentiles_the_peak_and_a_series():
    samples = [(i * 0.02, 5 * MIB, (10 if i < 99 else 40) * MIB, 2 * MIB) for i in range(100)]
    summary = memory_summary(samples, limit_hits=7)
    assert summary["p50_page_cache_bytes"] == 10 * MIB and summary["peak_page_cache_bytes"] == 40 * MIB
    assert summary["peak_shmem_bytes"] == 2 * MIB
    assert summary["p99_page_cache_bytes"] == 40 * MIB and summary["limit_hits"] == 7
    assert [t for t, _ in summary["page_cache_series"]] == [0.0, 0.5, 1.0, 1.5]


def test_a_run_is_over_budget_when_its_99th_percentile_page_cache_exceeds_it():
    def summary(p99):
        return {"p99_page_cache_bytes": p99, "peak_page_cache_bytes": p99}
    budget = 100 * MIB  # tolerance: 5% of it
    assert over_budget(summary(budget + SLACK_BYTES + 5 * MIB), budget) is None
    why = over_budget(summary(budget + SLACK_BYTES + 6 * MIB), budget)
    assert why.startswith("page cache over budget: 99th percentile")
    assert over_budget(summary(SLACK_BYTES + 3 * MIB), 0) is None  # coordl keeps next to no page cache
    assert over_budget(summary(SLACK_BYTES + 4 * MIB), 0)
    assert over_budget({}, budget) is None  # no cgroup: nothing measured


def test_every_point_runs_once_per_repetition_and_the_systems_rotate():
    order = run_order(3, [0.5, 1.0], ["torch", "coordl", "dali-seq"])
    at_half = [system for _, fraction, system in order if fraction == 0.5]
    assert len(at_half) == 9 and at_half[::3] == ["torch", "coordl", "dali-seq"]
    at_full = [(rep, system) for rep, fraction, system in order if fraction == 1.0]
    # the prep rates the bounds need are measured where nothing is read, once per repetition
    assert sorted(system for rep, system in at_full if rep == 0) == ["coordl", "dali-seq", "prep-dali", "prep-torch",
                                                                     "torch"]
    assert len(at_full) == 15 and len(set(at_full)) == 15
    assert [rep for rep, _, _ in order] == sorted(rep for rep, _, _ in order)
