"""torchtitan's real training state on gloo ranks, for tests/interop/test_torchtitan.py and
launch/bench/bench_torchtitan.py.

torchtitan's Trainer cannot run on this CPU-only machine (``import torchtitan.trainer`` needs
triton), so the training loop below is the Trainer's, reduced to what a checkpoint sees: a plain
nn.Module sharded with FSDP2 ``fully_shard`` (what torchtitan's parallelize functions do), the
OptimizersContainer and LRSchedulersContainer built by torchtitan's own config builders, torchtitan's
ParallelAwareDataloader (a StatefulDataLoader) and a ``train_state`` Stateful with the Trainer's
``step`` / ``ntokens_seen``. Each step: forward, backward, ``checkpointer.maybe_wait_for_staging()``,
optimizer and LR scheduler steps, ``checkpointer.save(step)``: the Trainer's order.

Phases (functions run by tests.helpers.distributed.run_ranks):
  * :func:`train_and_die`: train, checkpointing every ``INTERVAL`` steps through distckpt's manager
    and torchtitan's DCP manager side by side, record the losses of the steps after the last save,
    then SIGKILL itself (no close, no clean exit).
  * :func:`resume`: fresh objects, ``load()`` the latest checkpoint through one manager, train the
    same steps, return the losses.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import IterableDataset

# What the fork server imports once, so that each rank of each launch starts without paying for
# importing torch and torchtitan again (seconds per process on a 2-core machine).
PRELOAD = ["torch", "torch.distributed.fsdp", "torchtitan.components.checkpointer",
           "torchtitan.components.optimizer", "torchtitan.components.dataloader",
           "distckpt.integrations.torchtitan", "tests.helpers.distributed", "tests.helpers.torchtitan_worker"]
INTERVAL = 3       # checkpoint every 3 steps: saves at 3 and 6
LAST_SAVED = 6
STEPS = 8          # the steps after the last save (7, 8) are the ones compared
DIM = 32
BATCH = 4


class TrainState:
    """The Trainer's own Stateful (torchtitan/trainer.py: state_dict/load_state_dict)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


class Samples(IterableDataset):
    """Deterministic samples, every ``world``-th one for data-parallel rank ``rank``."""

    def __init__(self, rank: int, world: int, dim: int = DIM, n: int = 4096) -> None:
        self.rank, self.world, self.dim, self.n = rank, world, dim, n

    def __iter__(self):
        for i in range(self.rank, self.n, self.world):
            g = torch.Generator().manual_seed(1000 + i)
            x = torch.randn(self.dim, generator=g)
            yield {"input": x}, x.sum().tanh().unsqueeze(0)


class Net(nn.Module):
    def __init__(self, dim: int = DIM, depth: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.out = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.out(x)


def build(seed: int = 0, dim: int = DIM, depth: int = 2) -> dict[str, Any]:
    """torchtitan's objects for this process: model parts, optimizers, LR schedulers, dataloader,
    train_state. FSDP2 over every rank when torch.distributed is initialized."""
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    torch.manual_seed(seed)
    model = Net(dim, depth)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if dist.is_initialized():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1})],
        implementation="for-loop").build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=20)
    dataloader = ParallelAwareDataloader(Samples(rank, world, dim), dp_rank=rank, dp_world_size=world,
                                         batch_size=BATCH)
    return {"model": model, "optimizers": optimizers, "lr_schedulers": lr_schedulers,
            "dataloader": dataloader, "train_state": TrainState(), "it": None}


def manager_kwargs(objs: dict[str, Any]) -> dict[str, Any]:
    """The keywords torchtitan's Trainer passes to ``config.checkpoint.build``."""
    return {"dataloader": objs["dataloader"], "model_parts": [objs["model"]], "optimizers": objs["optimizers"],
            "lr_schedulers": objs["lr_schedulers"], "states": {"train_state": objs["train_state"]},
            "sd_adapter": None, "base_folder": ""}


def train_step(objs: dict[str, Any], managers: list) -> float:
    """One step of the Trainer's loop; returns this rank's loss."""
    if objs["it"] is None:
        objs["it"] = iter(objs["dataloader"])
    inputs, labels = next(objs["it"])
    model = objs["model"]
    loss = nn.functional.mse_loss(model(inputs["input"]), labels)
    loss.backward()
    for m in managers:
        m.maybe_wait_for_staging()
    objs["optimizers"].step()
    objs["lr_schedulers"].step()
    objs["optimizers"].zero_grad()
    ts = objs["train_state"]
    ts.step += 1
    ts.ntokens_seen += labels.numel()
    for m in managers:
        m.save(ts.step, last_step=False)
    return float(loss.detach())


def _managers(out: str, async_mode: str, objs: dict[str, Any], exclude: list[str],
              mine_folder: str = "distckpt") -> dict[str, Any]:
    """distckpt's manager (folder ``out/<mine_folder>``) and torchtitan's DCP manager (folder
    ``out/dcp``) on the same objects, both built the way the Trainer builds its checkpointer."""
    from torchtitan.components.checkpointer import CheckpointManager

    from distckpt.integrations.torchtitan import DistckptCheckpointManager
    mine = DistckptCheckpointManager.Config(
        enable=True, folder=os.path.join(out, mine_folder), interval=INTERVAL, keep_latest_k=2,
        async_mode=async_mode, exclude_from_loading=exclude).build(**manager_kwargs(objs))
    theirs = CheckpointManager.Config(
        enable=True, folder=os.path.join(out, "dcp"), interval=INTERVAL, keep_latest_k=2,
        exclude_from_loading=exclude).build(**manager_kwargs(objs))
    return {"distckpt": mine, "dcp": theirs}


def train_and_die(rank: int, world: int, out: str, async_mode: str) -> None:
    """Train STEPS steps with both managers saving every INTERVAL steps, write this rank's
    losses of the steps after LAST_SAVED to ``out/reference-<rank>.json``, then SIGKILL this
    process: no close(), no atexit, nothing flushed but what the saves made durable."""
    torch.set_num_threads(1)
    objs = build()
    mgrs = _managers(out, async_mode, objs, [])
    losses = {}
    for _ in range(STEPS):
        loss = train_step(objs, list(mgrs.values()))
        losses[objs["train_state"].step] = loss
    # The step-6 async save may still be writing: the kill comes after it is committed (a save
    # killed before its commit is never loadable; that is distckpt's crash suite's subject).
    mgrs["distckpt"].maybe_wait_for_saving()
    with open(os.path.join(out, f"reference-{rank}.json"), "w") as f:
        json.dump({str(k): v for k, v in losses.items() if k > LAST_SAVED}, f)
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def resume(rank: int, world: int, out: str, variants: list[str]) -> dict[str, Any]:
    """For each of ``variants``: fresh objects (another seed, so nothing matches unless loaded),
    ``load(step=-1)`` through one manager, train the steps after LAST_SAVED. A variant is
    "distckpt" (distckpt's manager, its own checkpoints), "dcp" (torchtitan's manager, its own) or
    "distckpt<-dcp" (distckpt's manager on the folder torchtitan's wrote: the switch mid-run).
    At another world size than the save's the dataloader is excluded from loading (torchtitan's
    dataloader refuses another data-parallel size). Returns {variant: {"loaded": step, "losses":
    {step: loss}}}."""
    torch.set_num_threads(1)
    results = {}
    for which in variants:
        objs = build(seed=123)
        exclude = ["dataloader"] if world != 2 else []
        mgrs = _managers(out, "disabled", objs, exclude,
                         mine_folder="dcp" if which == "distckpt<-dcp" else "distckpt")
        mgr = mgrs["dcp"] if which == "dcp" else mgrs["distckpt"]
        if which == "distckpt, rank 1 cannot list" and rank == 1:
            # this rank's own listing and MANIFEST reads would fail (a step directory its node
            # cannot look at): the ranks load what rank 0 lists and finds (this rank raised
            # alone, and rank 0 waited for it)
            from distckpt.errors import StorageIOError

            def cannot_list(*_args):
                raise StorageIOError("listing failed: [Errno 5] Input/output error", path=out, errno=5)

            mgr.checkpoints = cannot_list
            mgr._model_only = cannot_list
        assert mgr.load(step=-1), "nothing was loaded"
        loaded = objs["train_state"].step
        losses = {}
        for _ in range(STEPS - LAST_SAVED):
            loss = train_step(objs, [])
            losses[str(objs["train_state"].step)] = loss
        for m in mgrs.values():
            m.close()
        results[which] = {"loaded": loaded, "losses": losses}
    return results


def launch(fn: Callable[..., Any], world: int, *args: Any, timeout: float, env: dict[str, str] | None = None) -> list:
    """tests.helpers.distributed.run_ranks, with ranks forked from a fork server that has imported
    PRELOAD (run_ranks spawns by default: every rank imports torch and torchtitan anew). Returns
    and raises what run_ranks does."""
    from .distributed import run_ranks
    return run_ranks(fn, world, *args, timeout=timeout, env=env, preload=list(PRELOAD))
