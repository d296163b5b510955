"""Replicated loads on one node: bytes read from the device vs the checkpoint's size, one run.

    .venv/bin/python launch/bench/bench_replicated_load.py DIR [--size 256M] [--repeat 3]
        [--modes auto,direct,auto+once,direct+once]

Data-parallel ranks need the same bytes: a DDP job's every rank loads the whole model, an HSDP
job's replicas load the same shards. This measures how many bytes the device under DIR delivered
(sectors read in /proc/diskstats, every process on the machine, so run it on a quiet one) for one
load by all ranks, against the checkpoint's size, with the caches dropped before each load.

Cases (spawned gloo ranks, 8 float32 tensors making up ``--size``):

  * ``ddp 4``: saved by 1 rank (plain tensors), loaded by 4 ranks that each want all of it;
  * ``hsdp 2x2``: saved by 2 ranks (DTensors ``Shard(0)`` over 2), loaded by 4 ranks on a 2 x 2
    mesh (``Replicate`` over the outer dim, ``Shard(0)`` over the inner): two replicas of each
    shard;
  * ``llama-hsdp 2x2`` (``--llama``): the users' shape, an HF Llama (random init from a config,
    ``--llama-*``) ``fully_shard``ed on a 2 x 2 mesh (HSDP) with one AdamW step, its
    ``get_state_dict`` (model + optimizer) saved and loaded by the same 4 ranks: two replicas of
    each shard, a few hundred tensors.

For each of ``--modes`` (a DISTCKPT_READ_CACHE mode; ``+once``: with DISTCKPT_READ_ONCE=on, each
replicated segment read by one rank and sent to the others over gloo, distckpt.readonce; without
it DISTCKPT_READ_ONCE=off) and for DCP (``dcp.load`` of the same state saved by ``dcp.save``),
interleaved: device bytes read / checkpoint bytes, the bytes the ranks asked the storage for
(LoadResult.bytes_read summed: what an object store or a remote file system would serve) and the
slowest rank's time, median of ``--repeat``. Needs root (drop_caches). Removes what it created
under DIR.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(os.path.dirname(HERE)))

from bench import _barrier, dir_bytes, drop_caches, llama_fsdp_state, parse_size, rm, spawn  # noqa: E402

N = 8


def _device_of(path: str) -> str:
    """The /proc/diskstats name of the block device holding ``path`` (the whole disk, or the
    partition)."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    with open("/proc/diskstats") as f:
        for line in f:
            p = line.split()
            if int(p[0]) == major and int(p[1]) == minor:
                return p[2]
    raise SystemExit(f"{path} is not on a block device listed in /proc/diskstats")


def _sectors_read(dev: str) -> int:
    with open("/proc/diskstats") as f:
        for line in f:
            p = line.split()
            if p[2] == dev:
                return int(p[5])
    raise KeyError(dev)


def _tensors(size: int):
    import torch
    rows = max(4, size // (N * 4096 * 4))
    rows -= rows % 4
    g = torch.Generator().manual_seed(7)
    return {f"w{i}": torch.rand(rows, 4096, generator=g) for i in range(N)}


def _mesh_state(full: dict, mesh, placements, zeros: bool):
    import torch
    from torch.distributed.tensor import distribute_tensor
    out = {}
    for k, v in full.items():
        out[k] = distribute_tensor(torch.zeros_like(v) if zeros else v, mesh, placements)
    return out


def _save(rank, world, case, size, dc, dp):
    import torch.distributed.checkpoint as dcp

    import distckpt
    full = _tensors(size)
    if case == "ddp":
        sd = full
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard
        sd = _mesh_state(full, init_device_mesh("cpu", (world,)), [Shard(0)], zeros=False)
    distckpt.save(sd, dc)
    dcp.save(sd, checkpoint_id=dp)


def _locals(obj, path=""):
    """(path, local tensor) of every tensor of a nested state (a DTensor's local shard)."""
    import torch
    if isinstance(obj, torch.Tensor):
        yield path, (obj.to_local() if hasattr(obj, "to_local") else obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _locals(v, f"{path}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _locals(v, f"{path}/{i}")


def _load(rank, world, case, size, dc, dp, dev, modes, repeat, llama=None):
    import torch
    import torch.distributed.checkpoint as dcp

    import distckpt
    from distckpt.bench import _env
    torch.set_num_threads(1)
    if case == "llama-hsdp":
        # FSDP2 shards exist only in the ranks that built them: saved here, by these 4 ranks.
        src = llama_fsdp_state(world, llama, mesh_shape=(2, 2))
        distckpt.save(src, dc)
        dcp.save(src, checkpoint_id=dp)
        full = {p: t.clone() for p, t in _locals(src)}
        dst = llama_fsdp_state(world, llama, mesh_shape=(2, 2))
        del src
    elif case == "ddp":
        full = _tensors(size)
        dst = {k: torch.zeros_like(v) for k, v in full.items()}
    else:
        full = _tensors(size)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        dst = _mesh_state(full, init_device_mesh("cpu", (2, 2)), [Replicate(), Shard(0)], zeros=True)
    distckpt.load(dst, dc)  # warm-up: imports, the back-end probe
    dcp.load(dst, checkpoint_id=dp)
    rows: dict[str, list] = {}

    def timed(name, fn):
        if rank == 0:
            drop_caches()
        _barrier(world)
        s0 = _sectors_read(dev)
        t0 = time.perf_counter()
        asked = getattr(fn(), "bytes_read", None)   # distckpt's LoadResult; DCP returns None
        _barrier(world)
        dt = time.perf_counter() - t0
        rows.setdefault(name, []).append((dt, (_sectors_read(dev) - s0) * 512, asked))
        if case == "llama-hsdp":
            ok = all(torch.equal(t, full[p]) for p, t in _locals(dst))
        else:
            ok = all(torch.equal((v.full_tensor() if hasattr(v, "full_tensor") else v), full[k]) for k, v in dst.items())
        if not ok:
            raise AssertionError(f"{name}: rank {rank} loaded other bytes")
        for _p, t in _locals(dst):
            t.zero_()

    contenders = [(f"distckpt [{m}]", m) for m in modes] + [("DCP", None)]
    for i in range(repeat):
        for name, mode in (contenders if i % 2 == 0 else contenders[::-1]):
            if mode is None:
                timed(name, lambda: dcp.load(dst, checkpoint_id=dp))
            else:
                cache, _, once = mode.partition("+")
                with _env(read_cache=cache, read_once="on" if once else "off"):
                    timed(name, lambda: distckpt.load(dst, dc))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("directory")
    ap.add_argument("--size", default="256M")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--modes", default="auto,direct,auto+once,direct+once")
    ap.add_argument("--llama", action="store_true", help="add the llama-hsdp case (needs transformers)")
    ap.add_argument("--only-llama", action="store_true", help="the llama-hsdp case alone")
    ap.add_argument("--llama-hidden", type=int, default=768)
    ap.add_argument("--llama-layers", type=int, default=4)
    ap.add_argument("--llama-inter", type=int, default=2048)
    ap.add_argument("--llama-vocab", type=int, default=8000)
    args = ap.parse_args(argv)
    size = parse_size(args.size)
    modes = tuple(args.modes.split(","))
    work = os.path.join(os.path.abspath(args.directory), f".distckpt-bench-replicated-{os.getpid()}")
    os.makedirs(work)
    dev = _device_of(work)
    t_start = time.time()
    print(f"replicated loads: {size / 2**20:.0f} MiB of float32, device {dev}, load average "
          f"{os.getloadavg()[0]:.1f}, median of {args.repeat}, seconds of the slowest rank")
    print("| case | loader | device bytes read / checkpoint bytes | bytes asked of storage, all ranks / checkpoint "
          "| seconds (min..max) |")
    print("|---|---|---:|---:|---:|")
    try:
        llama = {"hidden": args.llama_hidden, "layers": args.llama_layers, "inter": args.llama_inter,
                 "vocab": args.llama_vocab}
        cases = [] if args.only_llama else [("ddp", 1), ("hsdp", 2)]
        if args.llama or args.only_llama:
            cases.append(("llama-hsdp", 0))
        labels = {"ddp": "ddp: saved by 1, loaded by 4", "hsdp": "hsdp: saved by 2, loaded by 2 x 2",
                  "llama-hsdp": "HF Llama FSDP2 HSDP 2 x 2, model + AdamW"}
        for case, saved in cases:
            dc, dp = os.path.join(work, f"dc_{case}"), os.path.join(work, f"dcp_{case}")
            if saved:
                spawn(_save, saved, case, size, dc, dp)
            results = spawn(_load, 4, case, size, dc, dp, dev, modes, args.repeat, llama)
            sizes = {"distckpt": dir_bytes(dc), "DCP": dir_bytes(dp)}
            label = labels[case]
            for name in results[0]:
                reps = len(results[0][name])
                secs = [max(r[name][i][0] for r in results) for i in range(reps)]
                read = statistics.median(results[0][name][i][1] for i in range(reps))  # the device's, same on every rank
                ckpt = sizes["DCP" if name == "DCP" else "distckpt"]
                asked = [sum(r[name][i][2] for r in results) for i in range(reps)] if name != "DCP" else None
                asked_s = f"{statistics.median(asked) / ckpt:.2f}x" if asked else "n/a"
                print(f"| {label} | {name} | {read / ckpt:.2f}x ({read / 2**20:.0f} / {ckpt / 2**20:.0f} MiB) | "
                      f"{asked_s} | {statistics.median(secs):.3f} ({min(secs):.2f}..{max(secs):.2f}) |")
            rm(dc)
            rm(dp)
    finally:
        rm(work)
    print(f"whole run: {time.time() - t_start:.0f} s, load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
