"""dcp.save / dcp.load with distckpt's storage layer vs DCP's FileSystemWriter/Reader, one run.

    .venv/bin/python launch/bench/bench_dcp_storage.py DIR [--world 2] [--repeat 3]
        [--size 512M] [--small 200] [--llama-hidden 768 --llama-layers 4 ...] [--no-llama]
        [--setting NAME=VAR=VALUE[,VAR=VALUE]] ...

Two state shapes, each saved by ``--world`` freshly spawned gloo ranks on this machine:

  * ``synthetic``: large DTensor-sharded tensors (dim 0 over the ranks) plus ``--small`` replicated
    small tensors (launch/bench/bench.py's make_state);
  * ``llama``: an FSDP2 (``fully_shard``) Hugging Face Llama built from a config (random init) and
    its AdamW state after one step, as ``get_state_dict`` returns them (torchtitan's layout).

For each shape, ``--repeat`` times and interleaved (the slowest rank's time, median and min..max):
``dcp.save`` with DCP's FileSystemWriter (its defaults: one thread, fsync per file);
``dcp.save`` with DistCkptStorageWriter (DCP's planner, distckpt's writer and commit);
``distckpt.save`` of the same state (distckpt's own plan), so the difference is what DCP's planner
costs; ``dcp.load`` with DCP's FileSystemReader and with DistCkptStorageReader, each cold (after
``drop_caches``: needs root) and then warm (right after its cold load, as it left the page cache).
Ratios are printed against FileSystemWriter/Reader (loads: in the same cache state). Each
``--setting`` adds a ``distckpt.save [NAME]`` row to the same interleaved rounds, saved with those
DISTCKPT_* variables set (for example ``--setting zc4M=DISTCKPT_ZERO_COPY_MIN=4M``). Every
checkpoint written under DIR is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(os.path.dirname(HERE)))

from bench import _barrier, drop_caches, llama_fsdp_state, local_bytes, make_state, parse_size, rm, spawn, zeros_like_state  # noqa: E402


def _with_env(env: dict, fn):
    """Run ``fn`` with the DISTCKPT_* variables ``env`` set (distckpt's config and I/O back-end
    choices re-read; distckpt.bench's override context), then restore them."""
    from distckpt.bench import _env
    from distckpt.storage.posix.probe import reset_choices
    bad = [k for k in env if not k.startswith("DISTCKPT_")]
    if bad:
        raise SystemExit(f"--setting takes DISTCKPT_* variables only, not {bad}")
    with _env(**{k[len("DISTCKPT_"):].lower(): v for k, v in env.items()}):
        reset_choices()
        try:
            return fn()
        finally:
            reset_choices()


def _body(rank, world, work, shape, size, small, llama, repeat, settings):
    import torch
    import torch.distributed.checkpoint as dcp

    import distckpt
    from distckpt.integrations.dcp import DistCkptStorageReader, DistCkptStorageWriter
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if shape == "synthetic":
        from torch.distributed.device_mesh import init_device_mesh
        state = make_state(size, small, rank, world, init_device_mesh("cpu", (world,)) if world > 1 else None)
    else:
        state = llama_fsdp_state(world, llama)
    nbytes = local_bytes(state)
    rows: dict[str, list[float]] = {}

    def timed(name, fn, cleanup):
        _barrier(world)
        t0 = time.perf_counter()
        fn()
        _barrier(world)
        rows.setdefault(name, []).append(time.perf_counter() - t0)
        if cleanup is not None and rank == 0:
            cleanup()
        _barrier(world)

    # Warm-up: imports, the io back-end probe, DCP's planner caches.
    dcp.save(state, storage_writer=DistCkptStorageWriter(f"{work}/warm"))
    _barrier(world)
    if rank == 0:
        rm(f"{work}/warm")
    for i in range(repeat):
        fsw, dck, nat = f"{work}/fsw{i}", f"{work}/dck{i}", f"{work}/nat{i}"
        timed("dcp.save FileSystemWriter", lambda: dcp.save(state, checkpoint_id=fsw), None)
        timed("dcp.save DistCkptStorageWriter", lambda: dcp.save(state, storage_writer=DistCkptStorageWriter(dck)),
              None)
        timed("distckpt.save", lambda: distckpt.save(state, nat), lambda: rm(nat))
        for name, env in settings.items():
            timed(f"distckpt.save [{name}]", lambda: _with_env(env, lambda: distckpt.save(state, nat)),
                  lambda: rm(nat))
        # Loads cold (caches dropped) and warm (right after the cold load, as each reader left the
        # page cache), the two readers alternating which goes first.
        dst = zeros_like_state(state)
        readers = [("FileSystemReader", lambda: dcp.load(dst, checkpoint_id=fsw)),
                   ("DistCkptStorageReader", lambda: dcp.load(dst, storage_reader=DistCkptStorageReader(dck)))]
        for name, fn in (readers if i % 2 == 0 else readers[::-1]):
            if rank == 0:
                drop_caches()
            timed(f"dcp.load {name} cold", fn, None)
            timed(f"dcp.load {name} warm", fn, None)
        if rank == 0:
            rm(fsw)
            rm(dck)
    return {"rows": rows, "bytes": nbytes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("directory")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--size", default="512M", help="synthetic state size (all ranks together)")
    ap.add_argument("--small", type=int, default=200, help="replicated small tensors in the synthetic state")
    ap.add_argument("--llama-hidden", type=int, default=768)
    ap.add_argument("--llama-layers", type=int, default=4)
    ap.add_argument("--llama-inter", type=int, default=2048)
    ap.add_argument("--llama-vocab", type=int, default=8000)
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--setting", action="append", default=[],
                    help="NAME=VAR=VALUE[,VAR=VALUE]: an extra distckpt.save row with these variables")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    settings = {}
    for text in args.setting:
        name, _, assigns = text.partition("=")
        settings[name] = dict(a.split("=", 1) for a in assigns.split(","))
    work = os.path.join(os.path.abspath(args.directory), "bench_dcp_storage")
    os.makedirs(work, exist_ok=True)
    llama = {"hidden": args.llama_hidden, "layers": args.llama_layers, "inter": args.llama_inter,
             "vocab": args.llama_vocab}
    shapes = ["synthetic"] + ([] if args.no_llama else ["llama"])
    out = {}
    try:
        for shape in shapes:
            results = spawn(_body, args.world, work, shape, parse_size(args.size), args.small, llama, args.repeat,
                            settings)
            total = sum(r["bytes"] for r in results)
            names = results[0]["rows"].keys()
            table = {}
            for name in names:
                secs = [max(r["rows"][name][i] for r in results) for i in range(args.repeat)]
                table[name] = {"median": statistics.median(secs), "min": min(secs), "max": max(secs)}
            out[shape] = {"bytes": total, "rows": table}
            print(f"\n{shape}: {total / 2**20:.0f} MiB over {args.world} ranks, {args.repeat} repetitions "
                  f"(slowest rank; median, min..max)")
            for name, row in table.items():
                if "save" in name:
                    base = table["dcp.save FileSystemWriter"]
                else:
                    base = table["dcp.load FileSystemReader " + name.rsplit(" ", 1)[1]]
                print(f"  {name:40s} {row['median']:7.3f} s  ({row['min']:.3f}..{row['max']:.3f})  "
                      f"{total / 2**20 / row['median']:7.0f} MiB/s  {base['median'] / row['median']:5.2f}x vs DCP's")
            plan = table["dcp.save DistCkptStorageWriter"]["median"] / table["distckpt.save"]["median"]
            print(f"  dcp.save with DistCkptStorageWriter / distckpt.save: {plan:.2f}x (what DCP's planner and "
                  f"its collectives add)")
    finally:
        rm(work)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
