"""Mid-epoch resume in a new process, through coordl.DataLoader's own state_dict, Accelerate's
save_state/load_state (use_stateful_dataloader=True) and Lightning's mid-epoch checkpoints: the resumed
job sees exactly the batches the uninterrupted job sees next, through the same node cache."""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

import coordl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(REPO, "tests", "integration", "_resume_job.py")
N_IMAGES, BATCH, K = 96, 8, 4


def _run(root, out, mode, way, rng) -> dict:
    done = subprocess.run([sys.executable, JOB, root, str(out), mode, way, str(K), rng], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": REPO}, timeout=240)
    result = os.path.join(out, f"{mode}.json")
    assert os.path.exists(result), done.stderr[-3000:]
    with open(result) as f:
        return json.load(f)


@pytest.mark.slow
@pytest.mark.parametrize("way", ["plain", "accelerate", "lightning"])
@pytest.mark.parametrize("rng", ["generator", "global"])
def test_a_job_resumed_in_a_new_process_sees_the_rest_of_its_epoch_then_the_next(tmp_path, image_root, way, rng):
    """With the loader's generator, and without (the next epoch drawn from the global RNG, which the state
    carries)."""
    files = sorted(glob.glob(os.path.join(image_root, "*", "*.jpg")))
    holder = coordl.DataLoader(coordl.FileDataset(files, targets=list(range(len(files))), decode="bytes"),
                               batch_size=BATCH, cache_name="resume-test")
    try:
        for _ in holder:  # fills the node cache the jobs share, and keeps it while they come and go
            pass
        full = _run(image_root, tmp_path, "full", way, rng)
        saved = _run(image_root, tmp_path, "save", way, rng)
        resumed = _run(image_root, tmp_path, "resume", way, rng)
    finally:
        holder.close()
    assert saved["epochs"] == [full["epochs"][0][:K]]
    assert resumed["epochs"] == [full["epochs"][0][K:], full["epochs"][1]]
    first = saved["epochs"][0] + resumed["epochs"][0]
    assert sorted(i for batch in first for i in batch) == list(range(N_IMAGES))  # each sample once in the epoch
    # the resumed epoch reads the rest of its samples from the cache, and so does the next. (With Accelerate,
    # torchdata first builds an iterator whose workers prefetch before load_state_dict replaces it: an
    # abandoned pass of its own, recorded before these.)
    assert resumed["hits"][-2:] == [N_IMAGES - K * BATCH, N_IMAGES] and resumed["cached"] == N_IMAGES, resumed["hits"]


def test_the_state_survives_torch_save_and_load(tmp_path, image_root):
    """A checkpoint file holds plain tensors and numbers (``weights_only`` loading accepts it)."""
    loader = coordl.DataLoader(torch.utils.data.TensorDataset(torch.arange(30)), batch_size=4, shuffle=True,
                               generator=torch.Generator().manual_seed(1))
    it = iter(loader)
    head = [next(it)[0].tolist() for _ in range(3)]
    torch.save(loader.state_dict(), tmp_path / "state.pt")
    rest = [b[0].tolist() for b in it]
    again = coordl.DataLoader(torch.utils.data.TensorDataset(torch.arange(30)), batch_size=4, shuffle=True,
                              generator=torch.Generator().manual_seed(1))
    again.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert [b[0].tolist() for b in again] == rest and len(head) == 3
