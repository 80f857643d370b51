"""A training job for test_resume, run in its own process: ``python _resume_job.py ROOT OUT MODE WAY K RNG``.

WAY is how the loop runs: ``plain`` (coordl.DataLoader's own state_dict), ``accelerate`` (save_state /
load_state with use_stateful_dataloader=True) or ``lightning`` (fit, checkpointed every K steps).
MODE ``full`` runs 2 epochs uninterrupted; ``save`` stops after K batches (checkpoint under OUT);
``resume`` loads the checkpoint and runs to the end of epoch 2. Writes OUT/MODE.json: the indices of
every batch, per epoch, and the cache hits of the loader's epochs. RNG is where the order is drawn from:
``generator`` (the loader's, seeded) or ``global`` (no generator: the global RNG, seeded as the job starts).
"""

import glob
import json
import os
import sys

import torch

import coordl

ROOT, OUT, MODE, WAY, K, RNG = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6]
EPOCHS, BATCH = 2, 8


def make_loader() -> coordl.DataLoader:
    files = sorted(glob.glob(os.path.join(ROOT, "*", "*.jpg")))
    dataset = coordl.FileDataset(files, targets=list(range(len(files))), decode="bytes")
    generator = torch.Generator().manual_seed(5) if RNG == "generator" else None
    return coordl.DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=2, cache_name="resume-test",
                             generator=generator)


def report(epochs, loader) -> None:
    hits = [e.hits for e in loader.stats().epochs]
    with open(os.path.join(OUT, f"{MODE}.json"), "w") as f:
        json.dump({"epochs": epochs, "hits": hits, "cached": loader.dataset.cache.stats().items_cached}, f)


def plain() -> None:
    loader, epochs = make_loader(), []
    if MODE == "resume":
        loader.load_state_dict(torch.load(os.path.join(OUT, "state.pt"), weights_only=False))
    while len(epochs) < EPOCHS:
        epochs.append([])
        for _, indices in loader:
            epochs[-1].append(indices.tolist())
            if MODE == "save" and len(epochs) == 1 and len(epochs[0]) == K:
                torch.save(loader.state_dict(), os.path.join(OUT, "state.pt"))
                return report(epochs, loader)
        if MODE == "resume" and len(epochs) == 1 and len(epochs[0]) == 0:
            epochs.pop()  # the saved state was at an epoch's end
    report(epochs, loader)


def accelerate() -> None:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    loader = make_loader()
    prepared, epochs = accelerator.prepare(loader), []
    if MODE == "resume":
        accelerator.load_state(os.path.join(OUT, "accelerate"))
    while len(epochs) < EPOCHS:
        epochs.append([])
        for _, indices in prepared:
            epochs[-1].append(indices.tolist())
            if MODE == "save" and len(epochs) == 1 and len(epochs[0]) == K:
                accelerator.save_state(os.path.join(OUT, "accelerate"))
                return report(epochs, loader)
    report(epochs, loader)


def lightning() -> None:
    import pytorch_lightning as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer, self.epochs, self.loader = torch.nn.Linear(1, 1), [], None

        def training_step(self, batch, batch_idx):
            _, indices = batch
            if batch_idx == 0 or not self.epochs:
                self.epochs.append([])
            self.epochs[-1].append(indices.tolist())
            if MODE == "save" and self.global_step == K:  # the job stops after its checkpoint at step K
                self.epochs[-1].pop()
                report(self.epochs, self.loader)
                raise KeyboardInterrupt
            return self.layer(indices.float()[:, None]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

        def train_dataloader(self):
            self.loader = make_loader()
            return self.loader

    module = Module()
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=OUT, filename="{step}", every_n_train_steps=K,
                                               save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=EPOCHS, callbacks=[checkpoints], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=OUT)
    trainer.fit(module, ckpt_path=os.path.join(OUT, f"step={K}.ckpt") if MODE == "resume" else None)
    report(module.epochs, trainer.train_dataloader)


if __name__ == "__main__":
    torch.manual_seed(0)
    {"plain": plain, "accelerate": accelerate, "lightning": lightning}[WAY]()
    sys.exit(0)
