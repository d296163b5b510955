"""Worker for tests/interop/test_lightning.py: real PyTorch Lightning fits on CPU under torchrun
(strategy "ddp", 2 processes, gloo; Lightning detects the torchelastic environment).

    python -m torch.distributed.run --nproc_per_node 2 lightning_worker.py OUT [PHASE...]

PHASEs run in order in one launch (default: ``first resume``; importing Lightning costs most of a
launch on a 2-core machine, so the resume is a new Trainer, model and plugin in the same processes,
reading the checkpoint back from disk).

PHASE ``first``: ``reference`` (4 epochs, no checkpointing) and, for each MODE, 2 epochs that
checkpoint through the plugin into OUT/MODE (ModelCheckpoint every epoch, save_top_k=-1,
save_last=True):
  * ``sync``: DistCkptCheckpointIO(keep_last=2);
  * ``wrapped``: Lightning's AsyncCheckpointIO(DistCkptCheckpointIO());
  * ``async``: DistCkptCheckpointIO(async_save=True).
PHASE ``resume``: for each MODE, a model initialised from another seed (the weights must come
from the checkpoint) fits to 4 epochs with ``ckpt_path="last"``.
Every fit writes each rank's final weights, optimizer and lr scheduler state to
OUT/<name>_rank<R>.pt (torch.save: the test's own record, not a checkpoint).
"""

from __future__ import annotations

import os
import sys
import warnings

# torchmetrics (imported by Lightning) imports transformers when it is installed, for text
# metrics this worker never uses: seconds of every rank's start-up on a 2-core machine. A None
# entry makes find_spec report it missing, so torchmetrics skips it.
sys.modules.setdefault("transformers", None)

import torch  # noqa: E402

warnings.filterwarnings("ignore")  # Lightning's advice (num_workers, ...) is noise in the logs

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402

from distckpt.integrations.lightning import DistCkptCheckpointIO  # noqa: E402

MODES = ("sync", "wrapped", "async")
EPOCHS_FIRST, EPOCHS_ALL = 2, 4


class Net(pl.LightningModule):
    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)]


def _data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(64, 1, generator=g)
    # shuffle=True: Lightning's DistributedSampler shuffles by epoch, so the resumed run must
    # restore the epoch exactly to see the same batches.
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=True)


def _plugin(mode: str):
    if mode == "sync":
        return DistCkptCheckpointIO(keep_last=2)
    if mode == "wrapped":
        return AsyncCheckpointIO(DistCkptCheckpointIO())
    return DistCkptCheckpointIO(async_save=True)


def _fit(out: str, name: str, *, seed: int, epochs: int, mode: str | None, ckpt_path: str | None) -> None:
    torch.manual_seed(seed)
    model = Net()
    # One global seed for every fit: Lightning seeds its DistributedSampler's shuffle with it.
    pl.seed_everything(1234, verbose=False)
    kwargs: dict = {}
    if mode is None:
        kwargs["enable_checkpointing"] = False
    else:
        kwargs["plugins"] = [_plugin(mode)]
        kwargs["callbacks"] = [ModelCheckpoint(dirpath=os.path.join(out, mode), save_top_k=-1, every_n_epochs=1,
                                               save_last=True)]
    trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=2, max_epochs=epochs, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, deterministic=True, **kwargs)
    trainer.fit(model, _data(), ckpt_path=ckpt_path)
    opt = trainer.optimizers[0]
    torch.save({"model": {k: v.clone() for k, v in model.state_dict().items()},
                "optimizer": opt.state_dict(),
                "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                "global_step": trainer.global_step, "epoch": trainer.current_epoch},
               os.path.join(out, f"{name}_rank{trainer.global_rank}.pt"))


def main(out: str, phases: list[str]) -> None:
    torch.set_num_threads(1)
    for phase in phases:
        if phase == "first":
            _fit(out, "reference", seed=1234, epochs=EPOCHS_ALL, mode=None, ckpt_path=None)
            for mode in MODES:
                _fit(out, f"first_{mode}", seed=1234, epochs=EPOCHS_FIRST, mode=mode, ckpt_path=None)
        elif phase == "resume":
            for mode in MODES:
                _fit(out, f"resumed_{mode}", seed=999, epochs=EPOCHS_ALL, mode=mode, ckpt_path="last")
        else:
            raise SystemExit(f"unknown phase {phase!r}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["first", "resume"])
