"""A torchtitan-style job swaps dcp.save/dcp.load for distckpt.save/distckpt.load, or keeps dcp.save
with distckpt's StorageWriter/StorageReader, and loses nothing.

FSDP2 (``fully_shard`` on CPU/gloo) over a small Hugging Face Llama built from a config (random
init, no download). The state is torchtitan's: Stateful wrappers around the model and optimizer
that go through torch's get_state_dict/set_state_dict, an LR scheduler, a Stateful dataloader with
per-rank keys (``dataloader.dp_rank_<r>``) and a train state. Saved at 2 ranks with distckpt and
with DCP; loaded at 1 and 3 ranks (4 ranks costs another minute on a 2-core machine; the 3-rank
case already exercises uneven resharding) into a fresh job whose model, optimizer hyper-parameters
and scheduler differ; every tensor, hyper-parameter and Stateful value is checked (the checkpoint
dcp.save wrote through distckpt's writer holds the same tensors bit for bit), and the next
losses equal those of the DCP-restored job bit for bit and those of the run that never stopped
(to float tolerance: another world size reduces gradients in another order)."""

from __future__ import annotations

import math

import pytest
import torch

import distckpt
from distckpt.integrations.dcp import DistCkptStorageReader, DistCkptStorageWriter
from tests.helpers.distributed import run_ranks

pytest.importorskip("transformers")

GLOBAL_BATCH, SEQ, VOCAB = 12, 8, 128
SAVE_STEP, MORE_STEPS = 2, 2


class ModelWrapper:
    """torchtitan's ModelWrapper: Stateful through get/set_model_state_dict."""

    def __init__(self, model):
        self.model = model

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        return get_model_state_dict(self.model)

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict
        set_model_state_dict(self.model, sd)


class OptimizerWrapper:
    """torchtitan's OptimizersContainer: Stateful through get/set_optimizer_state_dict (which
    initializes the state of an optimizer that has not stepped yet)."""

    def __init__(self, model, optim):
        self.model, self.optim = model, optim

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        return get_optimizer_state_dict(self.model, self.optim)

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        set_optimizer_state_dict(self.model, self.optim, sd)


class Loader:
    """A Stateful dataloader keyed per data-parallel rank, as torchtitan's: at save each rank
    holds ``dp_rank_<r>``; a job resuming on another world size asks for every saved rank's key."""

    def __init__(self, rank, resume_world=None):
        self.rank, self.resume_world, self.pos, self.seen = rank, resume_world, 0, ()

    def state_dict(self):
        if self.resume_world is not None:
            return {f"dp_rank_{r}": {"pos": -1, "seen": ()} for r in range(self.resume_world)}
        return {f"dp_rank_{self.rank}": {"pos": self.pos, "seen": self.seen}}

    def load_state_dict(self, sd):
        self.loaded = sd
        positions = {v["pos"] for v in sd.values()}
        assert len(positions) == 1, positions
        self.pos = positions.pop()
        self.seen = sd[min(sd)]["seen"]

    def batch(self, rank, world):
        g = torch.Generator().manual_seed(1000 + self.pos)
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
        self.pos += 1
        self.seen = self.seen + (self.pos,)
        per = GLOBAL_BATCH // world
        return tokens[rank * per:(rank + 1) * per]


def _job(rank, world, seed, lr, betas, resume_world=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
    loader = Loader(rank, resume_world)
    state = {"model": ModelWrapper(model), "optimizer": OptimizerWrapper(model, optim), "lr_scheduler": sched,
             "dataloader": loader, "train_state": {"step": 0, "betas_seen": betas, "dtype": torch.float32}}
    return model, optim, sched, loader, state


def _step(model, optim, sched, loader, rank, world):
    import torch.distributed as dist
    x = loader.batch(rank, world)
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    optim.step()
    optim.zero_grad()
    sched.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / world


def _save_body(rank, world, root):
    import torch.distributed.checkpoint as dcp
    model, optim, sched, loader, state = _job(rank, world, seed=0, lr=1e-2, betas=(0.9, 0.95))
    for _ in range(SAVE_STEP):
        _step(model, optim, sched, loader, rank, world)
    state["train_state"]["step"] = SAVE_STEP
    distckpt.save(state, f"{root}/distckpt")
    dcp.save(state, checkpoint_id=f"{root}/dcp")
    # The same job keeping dcp.save, with distckpt as its storage layer (DCP's planner kept).
    dcp.save(state, storage_writer=DistCkptStorageWriter(f"{root}/dcp_distckpt"))
    return [_step(model, optim, sched, loader, rank, world) for _ in range(MORE_STEPS)]


def _resume_body(rank, world, root, saved_world):
    import torch.distributed.checkpoint as dcp
    out = {}
    for how in ("distckpt", "dcp", "dcp_distckpt"):
        # A fresh job: other weights, other hyper-parameters, no optimizer state yet.
        model, optim, sched, loader, state = _job(rank, world, seed=1 + rank, lr=0.5, betas=(0.8, 0.999),
                                                  resume_world=saved_world)
        if how == "distckpt":
            res = distckpt.load(state, f"{root}/distckpt")
            assert res.missing == [] and res.mismatched == {} and res.not_replaced == []
            # Resave at this world size: every tensor and value must come back identical.
            state["dataloader"] = {"pos": loader.pos}
            distckpt.save(state, f"{root}/resaved{world}")
            state["dataloader"] = loader
        elif how == "dcp":
            dcp.load(state, checkpoint_id=f"{root}/dcp")
        else:
            dcp.load(state, storage_reader=DistCkptStorageReader(f"{root}/dcp_distckpt"))
        g = optim.param_groups[0]
        out[how] = {
            "hyper": (g["lr"], g["betas"], g["weight_decay"], g["initial_lr"], sched.last_epoch),
            "train_state": dict(state["train_state"]), "loader": (loader.pos, loader.seen),
            "losses": [_step(model, optim, sched, loader, rank, world) for _ in range(MORE_STEPS)],
        }
    return out


def _same_tree(a, b, path=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str), (path, sorted(a, key=str), sorted(b, key=str))
        for k in a:
            _same_tree(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same_tree(x, y, f"{path}.{i}")
    else:
        assert type(a) is type(b) and a == b, (path, a, b)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp2")
    continuous = run_ranks(_save_body, 2, str(root), timeout=300)
    assert continuous[0] == continuous[1]
    return root, continuous[0]


@pytest.mark.parametrize("world", [1, 3])
def test_fsdp2_llama_resumes_at_another_world_size_like_dcp(saved, world):
    root, continuous = saved
    results = run_ranks(_resume_body, world, str(root), 2, timeout=300)
    ckpt = distckpt.read(root / "distckpt")
    # Saved: torchtitan's layout, per-rank dataloader keys from both ranks, the tuple kept a tuple.
    assert sorted(ckpt) == ["dataloader", "lr_scheduler", "model", "optimizer", "train_state"]
    assert sorted(ckpt["dataloader"]) == ["dp_rank_0", "dp_rank_1"]
    assert ckpt["dataloader"]["dp_rank_1"] == {"pos": SAVE_STEP, "seen": (1, 2)}
    assert ckpt["train_state"] == {"step": SAVE_STEP, "betas_seen": (0.9, 0.95), "dtype": torch.float32}
    groups = ckpt["optimizer"]["param_groups"]
    assert groups[0]["betas"] == (0.9, 0.95) and groups[0]["lr"] == pytest.approx(1e-2 / (1 + SAVE_STEP))
    assert any(k.endswith("exp_avg_sq") for k in ckpt["optimizer"]["state"]["model.norm.weight"])
    # Loaded: every tensor and value of model, optimizer, scheduler and train state, resaved at
    # this world size, is bit-identical to what was saved at 2 ranks.
    again = distckpt.read(root / f"resaved{world}")
    for key in ("model", "optimizer", "lr_scheduler", "train_state"):
        _same_tree(ckpt[key], again[key], key)
    # dcp.save through distckpt's writer: the same tensors as distckpt.save's, bit for bit.
    through = distckpt.read(root / "dcp_distckpt")
    native = {f"model.{k}": v for k, v in ckpt["model"].items()}
    native.update({f"optimizer.state.{p}.{k}": v for p, s in ckpt["optimizer"]["state"].items() for k, v in s.items()})
    assert set(native) <= set(through)
    for key, value in native.items():
        _same_tree(value, through[key], key)
    for r in results:
        d, c, w = r["distckpt"], r["dcp"], r["dcp_distckpt"]
        # dcp.load through distckpt's reader: the same state as DCP's own reader gives.
        assert w == c
        assert d["hyper"] == c["hyper"]
        lr, betas, wd, initial_lr, epoch = d["hyper"]
        assert betas == (0.9, 0.95) and wd == 0.1 and initial_lr == 1e-2 and epoch == SAVE_STEP
        assert d["train_state"] == {"step": SAVE_STEP, "betas_seen": (0.9, 0.95), "dtype": torch.float32}
        assert d["loader"] == (SAVE_STEP, (1, 2)) == c["loader"]
        # Same state -> the same computation: bit-identical losses to the DCP-restored job ...
        assert d["losses"] == c["losses"]
        # ... and the run that never stopped (another world size sums gradients in another order).
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(d["losses"], continuous)), (d["losses"], continuous)
