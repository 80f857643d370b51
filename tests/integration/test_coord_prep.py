"""Coordinated prep: independent jobs in one hp_group prepare each batch once and all see every batch."""

import logging
import os
import secrets
import signal
import subprocess
import sys

import pytest
import torch

import coordl
from coordl._core.shm import segment_path
from coordl._group import codec as _batch_codec
from coordl._group.membership import HPGroup, group_segment_name, list_groups
from tests import _procs
from tests._signals import FileEvent, FileQueue

N = 60  # samples; batches of 4 -> 15 batches per epoch


@pytest.fixture
def index_root(tmp_path) -> str:
    root = str(tmp_path / "index-files")
    _procs.IndexFiles.write(root, N)
    return root


def _group() -> str:
    return f"test-{secrets.token_hex(4)}"


def _start_jobs(tmp_path, root, group, jobs, *, n=N):
    """Spawn one independent job per ``(epochs, options)``; they start together. Returns (procs, results)."""
    results, start = FileQueue(tmp_path), FileEvent(tmp_path)
    procs = [_procs.spawn(_procs.hp_job, root, n, group, epochs, results, options, start) for epochs, options in jobs]
    start.set()
    return procs, results


def _collect(results, count: int) -> list[tuple]:
    return [results.get(timeout=_procs.JOIN_TIMEOUT * 2) for _ in range(count)]


def _samples(batches) -> list[int]:
    return sorted(i for indices, _ in batches for i in indices)


def _draws(batches) -> dict[int, float]:
    return {i: d for indices, draws in batches for i, d in zip(indices, draws)}


@pytest.mark.slow
def test_three_jobs_prepare_each_batch_once_and_all_see_every_batch(tmp_path, index_root):
    group = _group()
    common = dict(hp_group_size=3, hp_group_timeout_s=30, cache_bytes="1MiB")
    jobs = [(2, dict(common, num_workers=2, multiprocessing_context="fork")), (2, common), (2, common)]
    procs, results = _start_jobs(tmp_path, index_root, group, jobs)
    runs = _collect(results, 3)
    _procs.join_ok(*procs)

    reference = runs[0][1]
    for _, seen, stats in runs:
        assert [epoch for epoch, _ in seen] == [1, 2]
        for _, batches in seen:
            assert _samples(batches) == list(range(N))  # every sample exactly once per epoch
        assert seen == reference  # identical batches, augmentation included, in every job
    (_, first), (_, second) = reference
    assert [b[0] for b in first] != [b[0] for b in second]  # a new order next epoch
    assert _draws(first) != _draws(second)  # and fresh augmentation
    for e in range(2):
        epochs = [stats["epochs"][e] for _, _, stats in runs]
        assert sum(x["decoded"] for x in epochs) == N  # each sample prepared once on the machine
        assert sum(x["prepared"] for x in epochs) == N // 4
        for x in epochs:
            assert x["members"] == 3 and x["samples"] == N and x["prepared"] + x["shared"] == N // 4
    # Through the MinIO cache: each sample fetched once per epoch on the machine, from storage only once.
    assert sum(stats["epochs"][0]["misses"] for _, _, stats in runs) == N
    assert sum(stats["epochs"][1]["hits"] for _, _, stats in runs) == N
    assert sum(stats["epochs"][1]["misses"] for _, _, stats in runs) == 0
    assert not os.path.exists(segment_path(group_segment_name(group)))


@pytest.mark.slow
def test_staging_memory_stays_bounded_when_one_job_is_slow(tmp_path, index_root):
    capacity = 16 << 10
    batch_bytes = _batch_codec.encode((torch.zeros(4, dtype=torch.int64), torch.zeros(4),
                                       torch.zeros(4, 256))).nbytes  # one staged batch, ~4 KiB
    common = dict(hp_group_size=3, hp_group_timeout_s=30, cache_bytes=0, payload_floats=256,
                  hp_staging_bytes=capacity)
    jobs = [(1, dict(common, step_s=0.05)), (1, common), (1, common)]  # the first job trains slowly
    procs, results = _start_jobs(tmp_path, index_root, _group(), jobs)
    runs = _collect(results, 3)
    _procs.join_ok(*procs)
    for _, seen, stats in runs:
        assert _samples(seen[0][1]) == list(range(N))
    peak = max(stats["group"]["peak_staged_bytes"] for _, _, stats in runs)
    # The fast jobs alone would stage all of their 10 batches (~40 KiB); the bound holds them back.
    assert capacity / 2 < peak <= capacity + batch_bytes


@pytest.mark.slow
def test_copied_batches_reuse_spare_segments_but_never_one_a_job_still_holds(tmp_path, index_root):
    """With a collate_fn of its own, each job copies its batches into segments that are kept and written
    again (NOTE [ Spare segments ] in _group_state). One job holds every batch of an epoch (mapped, 1 MiB
    each) and checks them at its end: no segment is written again while a job maps it."""
    common = dict(hp_group_size=2, hp_group_timeout_s=30, cache_bytes=0, payload_floats=1 << 16,
                  collate_fn=_procs.copied_collate)
    jobs = [(3, dict(common, hold=True)), (3, dict(common, step_s=0.01))]
    procs, results = _start_jobs(tmp_path, index_root, _group(), jobs)
    runs = _collect(results, 2)
    _procs.join_ok(*procs)
    assert runs[0][1] == runs[1][1]
    for _, seen, stats in runs:
        assert [_samples(batches) for _, batches in seen] == [list(range(N))] * 3
    group = runs[0][2]["group"]
    assert group["reused"] > 0  # the holder lets an epoch's batches go at its end: the next ones reuse them
    assert group["peak_staged_bytes"] > 0


@pytest.mark.slow
def test_a_job_joins_at_the_next_epoch_and_one_leaves_after_the_first(tmp_path, index_root):
    n, group = 40, _group()  # 10 batches per epoch
    results = FileQueue(tmp_path)
    start, start_late, progress, late_ready = (FileEvent(tmp_path) for _ in range(4))
    common = dict(hp_group_timeout_s=30, cache_bytes=0)
    stays = _procs.spawn(_procs.hp_job, index_root, n, group, 3, results,
                         dict(common, hp_group_size=2, step_s=0.25), start, progress)
    leaves = _procs.spawn(_procs.hp_job, index_root, n, group, 1, results, dict(common, hp_group_size=2), start)
    joins = _procs.spawn(_procs.hp_job, index_root, n, group, 2, results, common, start_late, None, late_ready)
    assert late_ready.wait(_procs.JOIN_TIMEOUT)  # the late job has started up and can join at once
    start.set()
    assert progress.wait(_procs.JOIN_TIMEOUT)  # the group is in its first epoch (~2.5 s long)
    start_late.set()
    runs = {pid: (seen, stats) for pid, seen, stats in _collect(results, 3)}
    _procs.join_ok(stays, leaves, joins)

    (stays_seen, stays_stats), (leaves_seen, _), (joins_seen, joins_stats) = (
        runs[stays.pid], runs[leaves.pid], runs[joins.pid])
    for seen in (stays_seen, leaves_seen, joins_seen):
        assert all(_samples(batches) == list(range(n)) for _, batches in seen)
    assert leaves_seen[0][1] == stays_seen[0][1]  # group epoch 1: the first two jobs
    assert joins_seen[0][1] == stays_seen[1][1]  # the late job's first epoch is the group's second
    assert joins_seen[1][1] == stays_seen[2][1]  # and the job that left is not missed
    assert [e["members"] for e in stays_stats["epochs"]] == [2, 2, 2]
    assert [e["members"] for e in joins_stats["epochs"]] == [2, 2]


@pytest.mark.slow
def test_a_job_killed_mid_epoch_is_taken_over_by_the_others(tmp_path, index_root):
    group, timeout_s = _group(), 5
    common = dict(hp_group_size=3, hp_group_timeout_s=timeout_s, cache_bytes=0)
    # The victim prepares slowly, so it dies with most of its share not yet published.
    victim_options = dict(common, decode_delay_s=0.1, kill_self_after=3)
    procs, results = _start_jobs(tmp_path, index_root, group, [(2, victim_options), (2, common), (2, common)])
    victim, survivors = procs[0], procs[1:]
    runs = _collect(results, 2)
    _procs.join_ok(*survivors)
    victim.join(10)
    assert victim.exitcode == -signal.SIGKILL

    (_, seen_a, stats_a), (_, seen_b, stats_b) = runs
    assert seen_a == seen_b  # the survivors still see identical batches
    for _, batches in seen_a:
        assert _samples(batches) == list(range(N))  # every sample exactly once, in both epochs
    first = (stats_a["epochs"][0], stats_b["epochs"][0])
    assert all(e["members"] == 3 and e["complete"] for e in first)
    assert sum(e["prepared"] for e in first) > 2 * (N // 4) // 3  # more than their own shares: a takeover
    assert all(e["time_s"] < timeout_s + 20 for e in first)  # nobody waited on the dead job for long
    assert [e["members"] for e in stats_a["epochs"]][1] == 2
    assert stats_a["epochs"][1]["prepared"] + stats_b["epochs"][1]["prepared"] == N // 4
    assert not os.path.exists(segment_path(group_segment_name(group)))


def _loader(root, group, n=N, transform=None, **kwargs):
    options = {**dict(batch_size=4, shuffle=True, cache_bytes=0, hp_group=group), **kwargs}
    return coordl.DataLoader(_procs.IndexFiles(root, n, transform=transform), **options)


def test_mismatched_settings_are_refused_naming_what_differs(index_root):
    group = _group()
    with _loader(index_root, group, transform=_procs.Scale(1)):
        cases = [
            (dict(batch_size=8), "batch_size: group has '4', this job '8'"),
            (dict(shuffle=False), "sampler: group has 'shuffled', this job 'sequential'"),
            (dict(drop_last=True), "drop_last"),
            (dict(generator=torch.Generator().manual_seed(3)), "seed: group has 'drawn by the group', this job '3'"),
            (dict(transform=_procs.Scale(2)), r"transforms: group has 'transform=Scale\(1\) \(sha256 \w+\)', this job "
                                              r"'transform=Scale\(2\) \(sha256 \w+\)'"),
            (dict(n=N - 4), "dataset: .* of 60 samples.* of 56 samples"),
        ]
        for kwargs, what in cases:
            kwargs.setdefault("transform", _procs.Scale(1))
            with pytest.raises(coordl.GroupMismatchError, match=f"in use by job.*{what}"):
                _loader(index_root, group, **kwargs)
        with pytest.warns(UserWarning, match="batch_size.*Running uncoordinated"):
            loner = _loader(index_root, group, batch_size=8, transform=_procs.Scale(1),
                            hp_group_on_mismatch="uncoordinated")
        with loner:
            assert sorted(i for indices, _, _ in loner for i in indices.tolist()) == list(range(N))
            assert loner.stats().group is None and loner.stats().epochs[0].group is None


def test_dali_members_must_agree_on_the_pipeline(index_root):
    group, dali = _group(), dict(backend="dali", dali_pipeline=_procs.index_and_draw)
    with _loader(index_root, group, **dali):
        torch_job = (r"collate_fn: group has '-'.*dali_pipeline: group has '.*index_and_draw \(sha256 \w+\) on cpu, "
                     r"train'")
        with pytest.raises(coordl.GroupMismatchError, match=torch_job):
            _loader(index_root, group)  # the torch backend
        with pytest.raises(coordl.GroupMismatchError, match=r"dali_pipeline: .*index_and_draw.*index_only"):
            _loader(index_root, group, backend="dali", dali_pipeline=_procs.index_only)


@pytest.mark.parametrize("kwargs, match", [
    (dict(hp_group=""), "hp_group should be a non-empty string"),
    (dict(hp_group_size=0), "hp_group_size should be a positive int"),
    (dict(hp_staging_bytes="lots"), "hp_staging_bytes should be"),
    (dict(hp_staging_bytes="0.5"), r"hp_staging_bytes should be .* but got hp_staging_bytes='0.5': '0.5' is not a "
                                   r"whole number of bytes"),
    (dict(hp_group_key=""), "hp_group_key should be a non-empty string"),
    (dict(hp_group_timeout_s=0), "hp_group_timeout_s should be a positive number"),
    (dict(hp_group_on_mismatch="ignore"), "hp_group_on_mismatch should be one of"),
    (dict(shuffle=None, sampler=[0, 1]), "pass shuffle=True or False instead of sampler="),
    (dict(in_order=False), "hp_group needs in_order=True"),
    (dict(backend="dali", dali_pipeline=_procs.index_and_draw, dali_device="gpu"),
     "hp_group with backend='dali' needs dali_device='cpu'"),
])
def test_bad_hp_group_options_are_refused(index_root, kwargs, match):
    options = dict(batch_size=4, shuffle=True, cache_bytes=0, hp_group="bad-options")
    with pytest.raises(ValueError, match=match):
        coordl.DataLoader(_procs.IndexFiles(index_root, N), **{**options, **kwargs})


def test_a_lone_member_prepares_everything_and_reports_it(index_root, caplog):
    group = _group()
    with caplog.at_level(logging.INFO, logger="coordl"):
        with _loader(index_root, group) as loader:
            assert len(loader) == N // 4
            for _ in range(2):
                assert sorted(i for indices, _, _ in loader for i in indices.tolist()) == list(range(N))
            stats = loader.stats()
            assert [g.label for g in list_groups()].count(group) == 1
        assert not os.path.exists(segment_path(group_segment_name(group)))  # closing left the group
    first = stats.epochs[0]
    assert (first.members, first.prepared, first.shared, first.decoded, first.samples) == (1, 15, 0, N, N)
    assert stats.total.prepared == 30 and stats.group.epoch == 2 and stats.group.peak_staged_bytes == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("epoch=")]
    assert len(lines) == 2 and f"group={group} members=1 prepared=15 shared=0 decoded={N}" in lines[0]


def _coordl(*args):
    return subprocess.run([sys.executable, "-m", "coordl.cli", *args], capture_output=True, text=True, timeout=60)


def test_group_ls_and_rm_on_live_and_stale_groups(tmp_path):
    stale_group, live_group = _group(), _group()
    live = HPGroup(live_group, config={"batch_size": "4"}, n_batches=3, seed=1, staging_bytes=1 << 20)
    live.join()  # before the stale group exists: joining reclaims dead groups
    joined = FileEvent(tmp_path)
    proc = _procs.spawn(_procs.join_group_then_die, stale_group, joined)
    proc.join(_procs.JOIN_TIMEOUT)
    assert proc.exitcode == -signal.SIGKILL
    stale = group_segment_name(stale_group)
    try:
        out = _coordl("group", "ls").stdout
        assert "stale" in out.split(stale)[1].splitlines()[0]
        live_line = out.split(live.name)[1].splitlines()
        assert "1 member(s)" in live_line[0] and f"pid {os.getpid()}" in live_line[1]
        refused = _coordl("group", "rm", live.name)
        assert refused.returncode == 1 and "in use by 1 process(es)" in refused.stderr
        assert f"would remove {stale}" in _coordl("group", "rm", "--stale", "--dry-run").stdout
        assert os.path.exists(segment_path(stale))
        removed = _coordl("group", "rm", "--stale")
        assert removed.returncode == 0 and f"removed {stale}" in removed.stdout
        assert not os.path.exists(segment_path(stale)) and os.path.exists(segment_path(live.name))
    finally:
        live.close()
    assert not os.path.exists(segment_path(live.name))


@pytest.mark.slow
def test_dali_jobs_share_their_batches_too(tmp_path, index_root):
    group, results, start = _group(), FileQueue(tmp_path), FileEvent(tmp_path)
    procs = [_procs.spawn(_procs.hp_dali_job, index_root, N, group, 2, results, start) for _ in range(2)]
    start.set()
    (_, seen_a, stats_a), (_, seen_b, stats_b) = _collect(results, 2)
    for p in procs:
        p.join(_procs.JOIN_TIMEOUT)
    assert seen_a == seen_b  # the same batches, the same draws, in the same order
    for epoch in seen_a:
        assert _samples(epoch) == list(range(N))
    assert seen_a[0] != seen_a[1]
    for epoch in range(2):
        decoded = stats_a["epochs"][epoch]["decoded"] + stats_b["epochs"][epoch]["decoded"]
        assert decoded == N and stats_a["epochs"][epoch]["members"] == 2


@pytest.mark.slow
def test_dali_survivors_take_over_a_killed_jobs_share(tmp_path, index_root):
    group, results, start = _group(), FileQueue(tmp_path), FileEvent(tmp_path)
    victim = _procs.spawn(_procs.hp_dali_job, index_root, N, group, 1, results, start, 3, 2)
    survivors = [_procs.spawn(_procs.hp_dali_job, index_root, N, group, 1, results, start, 3) for _ in range(2)]
    start.set()
    (_, seen_a, stats_a), (_, seen_b, stats_b) = _collect(results, 2)
    for p in survivors + [victim]:
        p.join(_procs.JOIN_TIMEOUT)
    assert victim.exitcode == -signal.SIGKILL
    assert seen_a == seen_b and _samples(seen_a[0]) == list(range(N))
    assert stats_a["epochs"][0]["decoded"] + stats_b["epochs"][0]["decoded"] > 2 * N // 3  # the victim's share too


def _plans(run) -> list[list[list[int]]]:
    return [[indices for indices, _ in batches] for _, batches in run[1]]


@pytest.mark.slow
@pytest.mark.parametrize("seeded", [True, False], ids=["generator", "random-seed"])
def test_a_group_restarted_from_its_jobs_checkpoints_goes_on_with_the_uninterrupted_plans(tmp_path, index_root,
                                                                                          seeded):
    """Two jobs run a group for one epoch and save their states; two new jobs load them into a new group,
    which goes on at group epoch 2 with the old group's seed. With a generator, epochs 2 and 3 are those of
    a group that ran three epochs uninterrupted; with a random seed, they continue the saved seed's plans."""
    common = dict(hp_group_size=2, hp_group_timeout_s=30, **({"seed": 7} if seeded else {}))
    states = [str(tmp_path / f"state-{k}.pt") for k in range(2)]
    procs, results = _start_jobs(tmp_path, index_root, _group(), [(1, dict(common, save_state=s)) for s in states])
    first = _collect(results, 2)
    _procs.join_ok(*procs)
    procs, results = _start_jobs(tmp_path, index_root, _group(), [(2, dict(common, load_state=s)) for s in states])
    resumed = _collect(results, 2)
    _procs.join_ok(*procs)

    saved = torch.load(states[0])["hp_group"]
    assert saved["next_epoch"] == 2 and torch.load(states[1])["hp_group"] == saved
    assert _plans(resumed[0]) == _plans(resumed[1])
    expected = [coordl._group.membership.epoch_plan(N, 4, False, True, saved["seed"], epoch) for epoch in (2, 3)]
    assert _plans(resumed[0]) == expected
    assert _plans(first[0])[0] == coordl._group.membership.epoch_plan(N, 4, False, True, saved["seed"], 1)
    if seeded:
        procs, results = _start_jobs(tmp_path, index_root, _group(), [(3, common), (3, common)])
        uninterrupted = _collect(results, 2)
        _procs.join_ok(*procs)
        assert _plans(uninterrupted[0])[1:] == _plans(resumed[0])


def test_a_state_saved_mid_epoch_resumes_the_group_at_the_next_epoch_and_says_so(tmp_path, index_root):
    dataset = _procs.IndexFiles(index_root, N)
    with coordl.DataLoader(dataset, batch_size=4, shuffle=True, hp_group=_group(), cache_bytes=0) as loader:
        iterator = iter(loader)
        next(iterator)
        state = loader.state_dict()
        del iterator
    assert state["hp_group"]["next_epoch"] == 2 and state["pass"]["consumed"] == 1
    with coordl.DataLoader(dataset, batch_size=4, shuffle=True, hp_group=_group(), cache_bytes=0) as loader:
        with pytest.warns(UserWarning, match="resumes at epoch boundaries.*goes on with group epoch 2"):
            loader.load_state_dict(state)
        plan = [batch[0].tolist() for batch in loader]
    assert plan == coordl._group.membership.epoch_plan(N, 4, False, True, state["hp_group"]["seed"], 2)


def test_an_hp_group_in_a_multi_server_environment_stays_on_its_server(tmp_path, index_root, monkeypatch):
    """torchrun's variables of a 2-server job around an hp_group member: ``partitioned="auto"`` starts no peer
    tier (no store is contacted: the master address leads nowhere), and insisting is refused up front."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "192.0.2.1",
                        "MASTER_PORT": "9"}.items():
        monkeypatch.setenv(name, value)
    dataset = _procs.IndexFiles(index_root, N)
    with coordl.DataLoader(dataset, batch_size=4, shuffle=True, hp_group=_group()) as loader:
        assert loader.dataset.peers is None
        assert sorted(i for batch in loader for i in batch[0].tolist()) == list(range(N))
    with pytest.raises(ValueError, match="hp_group cannot be combined with partitioned=True"):
        coordl.DataLoader(dataset, batch_size=4, shuffle=True, hp_group=_group(), partitioned=True)
