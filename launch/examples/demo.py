"""The distckpt demo: save a sharded (DTensor) model on N ranks, restore it on M ranks.

    torchrun --standalone --nproc-per-node 2 launch/examples/demo.py save    --root /tmp/ckpt
    torchrun --standalone --nproc-per-node 1 launch/examples/demo.py restore --root /tmp/ckpt

``save`` trains a small MLP whose weights are DTensors sharded over all ranks, tensor-parallel
(dim 0 or 1 by layer; Adam, so the optimizer state is sharded too) and saves model + optimizer + step through a
CheckpointManager every step, keeping the last 2. It also writes ``expected.pt`` (the full tensors,
gathered, for the check only). ``restore`` builds the model on its own world size, restores the
newest step through the manager (resharding on the way) and checks every tensor bit for bit.
ROOT may be an object-store URL (``--root s3://bucket/run7``), the endpoint and keys then coming
from the standard AWS variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION).
"""

from __future__ import annotations

import argparse
import time

import fsspec
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import distckpt


def build_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 8))


def shard_model(model: torch.nn.Module, mesh) -> None:
    """Tensor parallelism as torch lays it out: column-wise, row-wise, column-wise. Weights and
    biases are DTensors sharded on dim 0 or 1 (or replicated), and the gradients come back in the
    parameters' own layout, so the optimizer step needs no redistribution (no all-to-all, which
    gloo lacks: torch would fall back and warn)."""
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel(),
                                     "4": ColwiseParallel(output_layouts=Replicate())})


def state(model, optim, step: int) -> dict:
    return {"model": model.state_dict(), "optim": optim.state_dict(), "step": step}


def full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def flat_tensors(sd, prefix=""):
    for key, value in sd.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from flat_tensors(value, name + ".")
        elif isinstance(value, torch.Tensor):
            yield name, value


def run_save(root: str, steps: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = build_model()
    shard_model(model, mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    mgr = distckpt.CheckpointManager(root, keep_last=2)
    gen = torch.Generator().manual_seed(1234)
    for step in range(1, steps + 1):
        x = torch.randn(32, 64, generator=gen)
        x = distribute_tensor(x, mesh, [Replicate()])
        loss = model(x).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        result = mgr.save(step, state(model, optim, step))
        if rank == 0:
            print(f"[save] step {step}: {result.total_bytes} bytes on {world} ranks in {result.seconds:.3f} s "
                  f"(io backend {result.backend}: {result.backend_reason})", flush=True)
    expected = {name: full(t).clone() for name, t in flat_tensors(state(model, optim, steps))}
    if rank == 0:  # through fsspec: ROOT may be a local directory or an s3:// URL
        with fsspec.open(f"{root.rstrip('/')}/expected.pt", "wb") as f:
            torch.save(expected, f)
        print(f"[save] committed steps: {mgr.steps()} (keep_last=2)", flush=True)


def run_restore(root: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = build_model(seed=99)  # different values: everything must come from the checkpoint
    shard_model(model, mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():  # materialize the optimizer state tensors to load into
        p.grad = torch.zeros_like(p)
    optim.step()
    optim.zero_grad()
    mgr = distckpt.CheckpointManager(root, keep_last=2)
    sd = state(model, optim, 0)
    t0 = time.monotonic()
    result = mgr.load(sd)
    optim.load_state_dict(sd["optim"])
    with fsspec.open(f"{root.rstrip('/')}/expected.pt", "rb") as f:
        expected = torch.load(f, weights_only=True)
    got = {name: full(t) for name, t in flat_tensors(state(model, optim, sd["step"]))}
    assert set(got) == set(expected), (sorted(set(got) ^ set(expected)))
    bad = [n for n in expected if not torch.equal(got[n], expected[n])]
    assert not bad, f"restored tensors differ: {bad}"
    if rank == 0:
        print(f"[restore] step {sd['step']} restored on {world} rank(s) from {root} in {time.monotonic() - t0:.3f} s: "
              f"{len(expected)} tensors bit-exact, {result.bytes_read} bytes read", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "restore"])
    parser.add_argument("--root", required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    report = distckpt.preflight(args.root, backend="gloo")
    if not report.ok:
        report.raise_first()
    dist.init_process_group("gloo")
    try:
        if args.mode == "save":
            run_save(args.root, args.steps)
        else:
            run_restore(args.root)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
