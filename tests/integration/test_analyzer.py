"""``coordl analyze`` on a small training script: every phase measured for real, the report and its files,
and the scripts it cannot measure (failing, too short, without a coordl loader), with nothing left behind
(the shm fixture fails a test that leaves a process or a segment)."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torchvision
from torchvision import transforms

import coordl
from coordl._core.settings import ANALYZE_TIME_SCALE_ENV
from coordl._peer.topology import TIMEOUT_ENV
from coordl.analyzer import phases, runner
from harness.cluster import make_cluster  # noqa: F401  (a fixture)

JOB = os.path.join(os.path.dirname(os.path.dirname(__file__)), "_analyze_job.py")
BATCH = 8


def _analyze(out, root, *job_args, iters=20, warmup=3):
    return subprocess.run([sys.executable, "-m", "coordl.cli", "analyze", "--out", str(out), "--iters", str(iters),
                           "--warmup", str(warmup), "--timeout", "120", "--", sys.executable, JOB, root, *job_args],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("scale", [pytest.param("0.2", marks=pytest.mark.budget(60)),
                                   pytest.param("1", marks=pytest.mark.slow)], ids=["scaled", "full-times"])
def test_each_phase_is_measured_and_the_report_written(image_root, tmp_path, monkeypatch, scale):
    """The analyzer's one end-to-end run in the default tier, with its least measuring times scaled as the other
    tests' are; in the full tier, also with them as users get them."""
    monkeypatch.setenv(ANALYZE_TIME_SCALE_ENV, scale)
    step_s = 0.02  # the training step: G is at most BATCH / step_s
    proc = _analyze(tmp_path, image_root, "--step-s", str(step_s))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.load(open(tmp_path / "analysis.json"))
    rates = doc["rates"]
    assert 0.5 * BATCH / step_s < rates["G"] <= BATCH / step_s
    assert all(rates[k] > 0 for k in "PSC")
    assert doc["dataset"]["samples"] == 96
    assert doc["dataset"]["bytes"] == pytest.approx(sum(os.path.getsize(os.path.join(d, f))
                                                        for d, _, fs in os.walk(image_root) for f in fs))
    q = doc["phases"]["rates"]["Q"]  # the loop on batches its worker prepares from memory
    assert 0 < q <= BATCH / step_s and doc["phases"]["rates"]["Q_s"] >= float(scale) * phases.PREP_MIN_S
    alone = min(rates["P"], doc["cpu_samples_per_s"], rates["G"])  # what W and G allow with nothing to fetch
    assert doc["contention"] == pytest.approx(min(1.0, q / alone))
    assert doc["predicted_samples_per_s"] == pytest.approx(min(
        doc["fetch_samples_per_s"], doc["contention"] * min(doc["worker_samples_per_s"], rates["G"])))
    assert doc["miss_wait_s"] > 0 and doc["worker_samples_per_s"] <= rates["P"]  # 1 worker waits for its misses
    assert 0 < doc["measured_samples_per_s"] <= BATCH / step_s
    assert 0 <= doc["measured_hit_fraction"] <= 1
    assert doc["phases"]["ingestion"]["iters"] == 20 and doc["phases"]["rates"]["subset"] == 96
    cached = doc["config"]["cache_bytes"] / doc["dataset"]["bytes"]  # L's reads come a batch's misses at a time
    assert doc["phases"]["rates"]["L_burst"] == phases.misses_per_batch(BATCH, cached)
    assert doc["phases"]["rates"]["S_passes"] >= 2  # 96 small files read in far less than phases.STORAGE_MIN_S
    cpu = doc["cpu_s_per_sample"]  # a worker decoding on a core, at most its wall time per sample
    assert 0 < cpu["prep"] <= 1.5 / doc["rates"]["P"] and 0 < cpu["step"] < step_s / BATCH
    assert doc["cpu_samples_per_s"] == pytest.approx(doc["config"]["cores"] / (cpu["step"] + cpu["prep"]))
    assert "bottleneck:" in proc.stdout and "what if:" in proc.stdout and "[3/3]" in proc.stdout
    waited = doc["measured_stall"]  # the loop's waits in the run, split by the worker's own timers
    assert 0 <= waited["stall_s"] <= doc["dataset"]["samples"] / doc["measured_samples_per_s"]  # within an epoch
    assert waited["fetch_s"] >= 0 and waited["prep_s"] >= 0
    assert "per epoch, as measured: the loop waited" in proc.stdout
    assert set(doc["trust"]) == {"why", "range", "withheld"} and doc["phases"]["run"]["step_samples_per_s"] > 0
    for phase in ("ingestion", "rates", "run"):
        assert (tmp_path / f"phase-{phase}.log").exists() and (tmp_path / f"phase-{phase}.json").exists()
    assert not list(tmp_path.glob("*.claimed"))
    again = subprocess.run([sys.executable, "-m", "coordl.cli", "whatif", str(tmp_path / "analysis.json"), "--workers",
                            "2"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "with the changes:" in again.stdout


@pytest.mark.slow
def test_a_step_that_slowed_between_the_phases_withholds_the_prediction_and_says_why(image_root, tmp_path):
    proc = _analyze(tmp_path, image_root, "--step-s", "0.005", "--step-s-in-run", "0.1")  # 20× slower in the run
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.load(open(tmp_path / "analysis.json"))
    assert doc["trust"]["withheld"] and any("between phases" in why for why in doc["trust"]["why"])
    step = doc["phases"]["run"]["step_samples_per_s"]
    assert step == pytest.approx(BATCH / 0.1, rel=0.3)  # the run's step, timed apart from the loader's waits
    assert "predicted       withheld: G varied" in proc.stdout and "the machine was busy" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("rebuilt", ["torch", "accelerate"])
def test_a_loader_a_framework_rebuilds_from_the_parts_is_measured(image_root, tmp_path, rebuilt):
    """The script iterates a torch DataLoader built from the coordl loader's parts (by hand, or Accelerate's
    ``prepare``): coordl.DataLoader's own iterator never runs, and every phase is still measured and ended."""
    step_s = 0.02
    proc = _analyze(tmp_path, image_root, "--step-s", str(step_s), "--workers", "2", "--rebuilt", rebuilt)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.load(open(tmp_path / "analysis.json"))
    assert 0.5 * BATCH / step_s < doc["rates"]["G"] <= BATCH / step_s
    assert all(doc["rates"][k] > 0 for k in "PSC") and doc["phases"]["rates"]["workers"] == 2
    assert "Q" not in doc["phases"]["rates"] and doc["contention"] == 1.0  # torch's iterator, not coordl's, runs
    assert 0 < doc["measured_samples_per_s"] <= BATCH / step_s
    assert doc["phases"]["ingestion"]["iters"] == doc["phases"]["run"]["iters"] == 20
    assert not list(tmp_path.glob("*.claimed"))


@pytest.mark.slow
def test_the_rates_phase_goes_on_with_the_loop_taking_batches_its_workers_prepare(image_root, tmp_path):
    """Q: after P, the loop takes batches that a worker as the loader's prepares from the measured items. With
    prep (4 ms a sample, no core) far slower than the step (none), Q is prep's pace, not the loop's."""
    prep_s = 0.004
    proc = _analyze(tmp_path, image_root, "--prep-s", str(prep_s))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.load(open(tmp_path / "analysis.json"))
    rates = doc["phases"]["rates"]
    assert rates["P"] <= 1 / prep_s and doc["rates"]["G"] > 2 * rates["P"]  # copies come far faster than prep
    assert 0.7 * rates["P"] <= rates["Q"] <= 1.2 * rates["P"]
    assert doc["contention"] == pytest.approx(min(1.0, rates["Q"] / min(rates["P"], doc["rates"]["G"])), rel=0.05)
    assert "Q: the loop on prepared batches" in proc.stdout


@pytest.mark.slow
def test_a_failing_script_is_reported_with_its_last_lines(image_root, tmp_path):
    proc = _analyze(tmp_path, image_root, "--fail-at", "2")
    assert proc.returncode == 1
    assert "failed in the ingestion phase (exit status 1)" in proc.stderr
    assert "the training step failed at batch 2" in proc.stderr
    assert not (tmp_path / "analysis.json").exists()


@pytest.mark.slow
def test_a_script_failing_in_a_later_phase_gets_what_the_earlier_ones_measured(image_root, tmp_path):
    proc = _analyze(tmp_path, image_root, "--fail-at", "5", "--only-in-phase", "run")
    assert proc.returncode == 1 and "failed in the run phase (exit status 1)" in proc.stderr
    assert "measured before that, ingestion: samples_per_s=" in proc.stderr
    assert "measured before that, rates: " in proc.stderr and "P=" in proc.stderr and "S=" in proc.stderr


@pytest.mark.slow
def test_a_script_without_a_coordl_loader_is_told_so(image_root, tmp_path):
    proc = _analyze(tmp_path, image_root, "--torch-loader", "--epochs", "1")
    assert proc.returncode == 1
    assert "without iterating a coordl.DataLoader" in proc.stderr


@pytest.mark.slow
def test_a_script_that_ends_too_soon_is_told_how_many_batches_a_phase_needs(image_root, tmp_path):
    proc = _analyze(tmp_path, image_root, "--epochs", "1", iters=20, warmup=3)  # 12 batches an epoch
    assert proc.returncode == 1
    assert "fewer than 24 batches" in proc.stderr and "--iters" in proc.stderr


@pytest.mark.slow
def test_a_script_leaving_its_epochs_early_keeps_one_batch_in_the_ingestion_phase(image_root, tmp_path):
    """Each epoch's loop stops after 4 batches (persistent workers): later passes of the measured loader
    replay the batch, starting nothing."""
    proc = _analyze(tmp_path, image_root, "--steps-per-epoch", "4", "--step-s", "0.02")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.load(open(tmp_path / "analysis.json"))["rates"]["G"] <= BATCH / 0.02


@pytest.mark.slow
def test_without_a_cache_a_copy_in_memory_stands_for_a_hit(image_root, tmp_path):
    proc = _analyze(tmp_path, image_root, "--cache-bytes", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.load(open(tmp_path / "analysis.json"))
    assert doc["config"]["cache_bytes"] == 0 and doc["phases"]["rates"]["C_from"] == "memory copy"
    assert any("stands for a cache hit" in f for f in doc["flags"])
    assert doc["fetch_samples_per_s"] == pytest.approx(doc["rates"]["S"])  # nothing cached: F = S
    assert doc["phases"]["rates"]["L_burst"] == BATCH  # every sample of a batch misses
    assert doc["phases"]["rates"]["P_from"] == "memory" and doc["phases"]["rates"]["Q"] > 0  # from the bytes held


@pytest.mark.slow
def test_a_disk_tier_is_measured_apart_from_storage_and_modelled(image_root, tmp_path):
    cache_dir = tmp_path / "disk"
    proc = _analyze(tmp_path / "out", image_root, "--cache-bytes", "0", "--cache-dir", str(cache_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.load(open(tmp_path / "out" / "analysis.json"))
    rates = doc["phases"]["rates"]
    assert rates["K"] > 0 and rates["K_samples"] == rates["subset"] and rates["L_disk"] > 0
    assert rates["disk_fraction"] == 1.0 and doc["config"]["disk_bytes"] == pytest.approx(doc["dataset"]["bytes"])
    assert doc["rates"]["K"] == rates["K"] and "K disk tier" in proc.stdout
    assert any(a["question"] == "smallest disk tier that removes the fetch stall" for a in doc["whatif"])
    assert coordl.minio_cache.list_caches() == []  # nothing left in memory; the disk cache stays
    assert os.listdir(cache_dir)


@pytest.mark.slow
def test_a_torchrun_job_is_measured_rank_by_rank(image_root, tmp_path):
    """Both ranks measure each phase at once, each over its own half of the subset; the job's rates are the
    slower rank's, and its throughput twice a rank's."""
    step_s = 0.02
    proc = subprocess.run([sys.executable, "-m", "coordl.cli", "analyze", "--out", str(tmp_path), "--iters", "10",
                           "--warmup", "3", "--timeout", "180", "--", sys.executable, "-m", "torch.distributed.run",
                           "--standalone", "--nproc-per-node", "2", JOB, image_root, "--ddp", "--step-s", str(step_s)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.load(open(tmp_path / "analysis.json"))
    assert doc["config"]["ranks"] == 2 and "2 ranks" in proc.stdout
    for phase, key in (("ingestion", "samples_per_s"), ("rates", "P"), ("rates", "S"), ("rates", "Q"),
                       ("run", "samples_per_s")):
        ranks = doc["phases"][phase]["ranks"]
        assert len(ranks) == 2 and doc["phases"][phase][key] == min(r[key] for r in ranks)
    assert [r["subset"] for r in doc["phases"]["rates"]["ranks"]] == [48, 48]  # 96 images: half each
    assert doc["rates"]["G"] <= BATCH / step_s
    assert doc["job_predicted_samples_per_s"] == pytest.approx(2 * doc["predicted_samples_per_s"])
    assert all((tmp_path / f"phase-{phase}.json").exists() for phase in ("ingestion", "rates", "run"))
    assert not list(tmp_path.glob("*.claimed"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_job_over_two_servers_is_measured_on_each_with_its_peer(make_cluster, image_root, tmp_path):
    """Each server (its own network and mount namespaces) runs ``coordl analyze`` of its torchrun node. In the
    rates phase the servers' caches are mapped as at an epoch start, and each rank fetches from the next
    server's cache what that server's rank put there: R. The model is a server's, with 2 servers."""
    sizes = [os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(image_root) for f in fs]
    cache_bytes = sum(sizes) // 2 + max(sizes)  # each server's cache half the dataset: the two hold it all
    cluster = make_cluster(2)
    outs = [tmp_path / f"server{n}" for n in range(2)]
    for n, out in enumerate(outs):  # 6 batches an epoch per rank: the run phase's window is in epochs 2-4
        cluster.launch(n, JOB, [image_root, "--ddp", "--step-s", "0.02", "--cache-bytes", str(cache_bytes)],
                       env={"COORDL_PEER_SECRET": "this-test", TIMEOUT_ENV: "10"},
                       prefix=[sys.executable, "-m", "coordl.cli", "analyze", "--out", str(out), "--iters", "12",
                               "--warmup", "8", "--timeout", "300", "--"])
    assert cluster.wait(800) == [0, 0], "\n".join(cluster.log(n)[-3000:] for n in range(2))
    docs = [json.load(open(out / "analysis.json")) for out in outs]
    rates = [doc["phases"]["rates"] for doc in docs]
    for n, doc in enumerate(docs):
        theirs = rates[1 - n]
        assert doc["config"]["servers"] == 2 and rates[n]["subset"] == 48  # 96 images: a rank's half
        assert 0 < doc["rates"]["R"] == rates[n]["R"]
        # what it fetched from its peer is what the peer's cache took of the peer's part
        assert rates[n]["R_samples"] == round(theirs["cached_fraction"] * theirs["subset"]) > 0
        assert doc["measured_peer_hit_fraction"] > 0  # past epoch 1, the map sends misses to the peer
        assert doc["predicted_at_measured_hits"] > 0
        assert any(answer.get("servers") == 4 for answer in doc["whatif"])
        assert "R peers" in cluster.log(n) and "from the peers" in cluster.log(n)
        assert cluster.shm_left(n) == [], f"server {n} left {cluster.shm_left(n)} in its /dev/shm"
        assert not list(outs[n].glob("*.claimed"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_peer_that_does_not_deliver_ends_the_rates_phase_saying_so(make_cluster, image_root, tmp_path):
    """The servers hold different secrets, so neither lets the other fetch: R cannot be measured, and each
    server's analysis ends in the rates phase with the reason, leaving nothing behind."""
    sizes = [os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(image_root) for f in fs]
    cluster = make_cluster(2)
    for n in range(2):
        cluster.launch(n, JOB, [image_root, "--ddp", "--cache-bytes", str(sum(sizes))],
                       env={"COORDL_PEER_SECRET": f"secret-of-server-{n}", TIMEOUT_ENV: "5"},
                       prefix=[sys.executable, "-m", "coordl.cli", "analyze", "--out", str(tmp_path / f"server{n}"),
                               "--iters", "4", "--warmup", "1", "--timeout", "300", "--"])
    assert cluster.wait(500) == [1, 1]
    for n in range(2):
        log = cluster.log(n)
        assert "failed in the rates phase" in log and "measured before that, ingestion" in log
        rates_log = (tmp_path / f"server{n}" / "phase-rates.log").read_text()
        assert "the peers delivered 0 of the" in rates_log and "a peer server did not answer" in rates_log
        assert cluster.shm_left(n) == []
        assert not (tmp_path / f"server{n}" / "analysis.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["auto", "0"])
def test_a_dali_job_is_measured_with_its_own_pipeline_preparing(image_root, tmp_path, cache):
    """P from a second DALI pipeline with the loader's settings (over cached items, or bytes held in memory
    without a cache); the model's fetch threads run ahead of DALI's prep, so prep never waits for a miss.
    Then Q, the loop on batches a twin of the pipeline prepares from those items: DALI and the step share the
    training process, and the contention is what Q reaches of min(W, G)."""
    step_s = 0.01
    proc = _analyze(tmp_path, image_root, "--backend", "dali", "--workers", "2", "--cache-bytes", cache,
                    "--step-s", str(step_s))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.load(open(tmp_path / "analysis.json"))
    rates = doc["phases"]["rates"]
    assert rates["backend"] == "dali" and rates["workers"] == 2 and rates["fetch_threads"] == 2
    assert rates["P_from"] == ("cache" if cache == "auto" else "memory") and rates["P"] > 0
    assert doc["config"]["fetch_threads"] == 2 and doc["worker_samples_per_s"] == doc["rates"]["P"]
    assert 0 < rates["Q"] <= BATCH / step_s and rates["Q_s"] >= phases.least_s(phases.PREP_MIN_S)
    alone = min(doc["worker_samples_per_s"], doc["rates"]["G"])  # W with nothing to fetch: P, or the CPU bound
    assert doc["contention"] == pytest.approx(min(1.0, rates["Q"] / alone))
    assert doc["predicted_samples_per_s"] == pytest.approx(min(doc["fetch_samples_per_s"], doc["contention"] * alone))
    assert doc["rates"]["G"] <= BATCH / step_s and 0 < doc["measured_samples_per_s"] <= BATCH / step_s
    assert "DALI: 2 prep and 2 fetch threads" in proc.stdout and "threads (num_workers=)" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "dali"])
def test_the_jobs_of_an_hp_group_are_measured_member_by_member(image_root, tmp_path, backend):
    """Both members of the group measure each phase at once, each over its own half of the subset: the group
    fetches and prepares each sample once for both, so its S, C and P are the members' together, a job goes
    at the slower member's pace, and the model has 2 coordinated jobs."""
    step_s = 0.02
    member = f"{sys.executable} {JOB} {image_root} --hp-group analyzed --hp-group-size 2 --workers 1 " \
             f"--step-s {step_s} --cache-bytes auto --backend {backend}"
    proc = subprocess.run([sys.executable, "-m", "coordl.cli", "analyze", "--out", str(tmp_path), "--iters", "10",
                           "--warmup", "3", "--timeout", "180", "--", "sh", "-c", f"{member} & {member} & wait"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.load(open(tmp_path / "analysis.json"))
    assert doc["config"]["jobs"] == 2 and doc["config"]["coordinated"] and doc["config"]["ranks"] == 1
    assert "2 coordinated jobs" in proc.stdout
    rates = doc["phases"]["rates"]
    members = rates["ranks"]
    assert len(members) == 2 and all(m["hp_group"] for m in members)
    assert [m["subset"] for m in members] == [48, 48]  # 96 images: half each
    for key in ("S", "C", "P", "cores"):
        assert rates[key] == pytest.approx(sum(m[key] for m in members))
    assert "Q" not in rates and doc["contention"] == 1.0
    assert doc["config"]["workers"] == 2 * members[0]["workers"]
    for phase in ("ingestion", "run"):
        ranks = doc["phases"][phase]["ranks"]
        assert len(ranks) == 2 and doc["phases"][phase]["samples_per_s"] == min(r["samples_per_s"] for r in ranks)
    assert doc["rates"]["G"] <= BATCH / step_s and 0 < doc["measured_samples_per_s"] <= BATCH / step_s
    assert doc["predicted_samples_per_s"] <= doc["rates"]["G"]
    assert not list(tmp_path.glob("*.claimed"))


def _in_phase(monkeypatch, tmp_path, phase: str, iters: int = 6, warmup: int = 2) -> None:
    for name, value in ((phases.PHASE_ENV, phase), (phases.RESULT_ENV, str(tmp_path / "result.json")),
                        (phases.ITERS_ENV, str(iters)), (phases.WARMUP_ENV, str(warmup))):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(phases, "_measured", [])
    monkeypatch.setattr(phases, "_member", [])


def test_a_dataset_coordl_cannot_read_raw_is_named_in_the_first_phase(tmp_path, monkeypatch):
    _in_phase(monkeypatch, tmp_path, "ingestion")
    loader = coordl.DataLoader(torch.utils.data.TensorDataset(torch.zeros(8, 2)), batch_size=4)
    with pytest.raises(RuntimeError, match="this one loads TensorDataset"):
        iter(loader)
    loader.close()


@pytest.mark.parametrize("rebuilt", [False, True], ids=["own", "rebuilt"])
def test_the_ingestion_phase_drops_the_dali_pipeline_and_replays_a_copy_of_its_first_batch(image_root, tmp_path,
                                                                                          monkeypatch, rebuilt):
    """Iterated by coordl.DataLoader, or by a torch DataLoader built from its parts."""
    _in_phase(monkeypatch, tmp_path, "ingestion")
    loader = coordl.DataLoader(torchvision.datasets.ImageFolder(image_root), batch_size=4, shuffle=True,
                               backend="dali", cache_bytes=0)
    backend = loader.epoch_ledger.feed.backend
    iterated = torch.utils.data.DataLoader(loader.dataset, batch_sampler=loader.batch_sampler,
                                           collate_fn=loader.collate_fn) if rebuilt else loader
    batches = []
    with pytest.raises(SystemExit):
        for images, _ in iterated:
            batches.append(images)
            assert backend._pipe is None  # nothing loads while the loop runs
    del iterated
    loader.close()
    assert len(batches) == 8 and all(torch.equal(b, batches[0]) for b in batches)
    assert json.load(open(tmp_path / "result.json"))["iters"] == 6


@pytest.mark.parametrize("workers, group", [(0, None), (2, None), (2, "replayed")])
def test_the_ingestion_phase_hands_the_loop_copies_of_its_first_batch(image_root, tmp_path, monkeypatch, workers,
                                                                     group):
    """With workers, the batches after the first are copies sent by other worker processes (the loop pays for
    taking each; an hp_group member, whose training process has no workers of its own, as many as its share's
    loader has); without, the training process loads, and the loop gets the batch itself."""
    _in_phase(monkeypatch, tmp_path, "ingestion")
    dataset = torchvision.datasets.ImageFolder(image_root, transform=transforms.Compose(
        [transforms.RandomResizedCrop(16, antialias=True), transforms.ToTensor()]))
    loader = coordl.DataLoader(dataset, batch_size=4, shuffle=True, num_workers=workers,
                               persistent_workers=workers > 0, cache_bytes=0, hp_group=group)
    batches = []
    with pytest.raises(SystemExit):
        for images, _ in loader:
            batches.append(images)
    window = phases._measured[0]
    if window.handover is not None:
        window.handover._shutdown_workers()
    loader.close()
    assert len(batches) == 8 and all(torch.equal(b, batches[0]) for b in batches)
    assert len({b.data_ptr() for b in batches}) == (8 if workers else 1)
    assert json.load(open(tmp_path / ("result.json.rank0" if group else "result.json")))["iters"] == 6


@pytest.mark.parametrize("workers", [0, 2])
def test_the_ingestion_phase_of_a_rebuilt_loader_hands_out_each_processs_first_batch_again(
        image_root, tmp_path, monkeypatch, workers):
    """A torch DataLoader built from the coordl loader's parts: each process (the training process, or each
    worker) loads its first batch and hands that out again, nothing more is fetched or prepared; the window
    counts the batches torch draws past the ``workers x prefetch_factor`` it draws ahead."""
    _in_phase(monkeypatch, tmp_path, "ingestion")
    dataset = torchvision.datasets.ImageFolder(image_root, transform=transforms.Compose(
        [transforms.RandomResizedCrop(16, antialias=True), transforms.ToTensor()]))
    loader = coordl.DataLoader(dataset, batch_size=4, shuffle=True, num_workers=workers, cache_bytes=0)
    rebuilt = torch.utils.data.DataLoader(loader.dataset, batch_sampler=loader.batch_sampler,
                                          collate_fn=loader.collate_fn, num_workers=workers)
    batches = []
    with pytest.raises(SystemExit):
        for images, _ in rebuilt:
            batches.append(images)
    window = phases._measured[0]
    assert window.ahead == 2 * workers and window.taken == window.ahead + 2 + 6
    loaded = loader.dataset.counters.totals()["samples"]
    assert loaded == 4 * max(workers, 1)  # each process's first batch, nothing after it
    distinct = {bytes(b.numpy()) for b in batches}
    assert len(batches) >= 2 + 6 and len(distinct) == max(workers, 1)
    assert json.load(open(tmp_path / "result.json"))["iters"] == 6
    del rebuilt
    loader.close()


_DIES_MAKING_A_SEGMENT = """
import os, sys, time
if os.fork() == 0:  # a worker of the phase: killed as torch has just made a tensor's segment, before unlinking it
    open(f"/dev/shm/torch_{os.getpid()}_analyze-test_0", "wb").close()
    open(sys.argv[1], "w").close()
    time.sleep(600)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
"""


_ENDS_AFTER_MAKING_A_SEGMENT = """
import os, sys, time
child = os.fork()
if child == 0:  # a worker of the phase that ends on its own as torch has made a tensor's segment, not unlinked
    open(f"/dev/shm/torch_{os.getpid()}_analyze-test_1", "wb").close()
    time.sleep(float(sys.argv[1]))  # alive long enough for the runner to note it
    os._exit(0)
os.waitpid(child, 0)
"""


def test_a_segment_torch_left_for_a_process_that_ended_before_the_phase_did_is_removed(tmp_path):
    """The worker is gone before the phase ends, so it is not in the process group the end stops: the runner
    noted it while it ran."""
    with pytest.raises(runner.PhaseFailed, match="without iterating a coordl.DataLoader"):
        runner.run_phase([sys.executable, "-c", _ENDS_AFTER_MAKING_A_SEGMENT, str(5 * runner.WATCH_S)], "ingestion",
                         str(tmp_path), iters=1, warmup=0, timeout_s=60, say=lambda _: None)
    assert not [p for p in os.listdir("/dev/shm") if p.endswith("_analyze-test_1")]


def test_a_segment_torch_left_for_a_process_the_phase_end_killed_is_removed(tmp_path):
    made = tmp_path / "made"
    with pytest.raises(runner.PhaseFailed, match="without iterating a coordl.DataLoader"):
        runner.run_phase([sys.executable, "-c", _DIES_MAKING_A_SEGMENT, str(made)], "ingestion", str(tmp_path),
                         iters=1, warmup=0, timeout_s=60, say=lambda _: None)
    assert made.exists()
    assert not [p for p in os.listdir("/dev/shm") if p.endswith("_analyze-test_0")]
