"""Load benchmark: distckpt.load vs torch.distributed.checkpoint.load vs fio, one run.

    .venv/bin/python launch/bench/bench_load.py DIR [--size 512M] [--small 1000] [--repeat 3]
    .venv/bin/python launch/bench/bench_load.py DIR --shape llama [--cases 2->2,4->4] [--llama-* ...]

Cases (``--cases``), each in freshly spawned gloo ranks on this machine. ``--shape synthetic``
(the default): 8 large float32 tensors plus ``--small`` tensors of 16 KiB;

  * ``1 -> 1``: a checkpoint saved by 1 rank, loaded by 1 rank;
  * ``2 -> 3``: saved by 2 ranks (large tensors DTensor-sharded on dim 0, small ones replicated),
    loaded by 3 ranks (a resharding load).

``--shape llama``: the outside client's state, an FSDP2 (``fully_shard``) HF Llama built from a
config (random init) plus AdamW, ``get_state_dict`` of it, saved and loaded at the same world
size (``--cases``; default 2 and 4 ranks).

Both libraries save the same state into DIR first. Then, ``--repeat`` times, interleaved, the
library that goes first alternating between repetitions:
fio O_DIRECT read of distckpt's data files (io_uring, 4 MiB blocks, iodepth 8, after
``sync; echo 3 > /proc/sys/vm/drop_caches``); DCP load cold (caches dropped) and warm (right after
its cold load, which leaves its files cached); for each ``--read-cache`` mode
(DISTCKPT_READ_CACHE), distckpt.load cold and warm (right after its own cold load: what a second
load finds), and for the first mode also "cached" (after its data files were read once with
buffered reads, so every page is cached). Medians are printed with the min..max, plus: bytes read /
bytes needed (distckpt: LoadResult.bytes_read; DCP: rchar from /proc/self/io), and the peak RSS
the load added on the worst rank (VmHWM reset through /proc/self/clear_refs just before it; the
destination tensors exist and are resident before). Needs root for drop_caches and fio
(``apt-get install -y fio``). Everything created under DIR is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(os.path.dirname(HERE)))

from bench import (_barrier, _rchar, drop_caches, llama_fsdp_state, local_bytes, make_state, parse_size,  # noqa: E402
                   rm, spawn, state_bytes, zeros_like_state)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _mesh(world):
    if world == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (world,))


def _save(rank, world, dc_path, dcp_path, size, small):
    import torch.distributed.checkpoint as dcp

    import distckpt
    sd = make_state(size, small, rank, world, _mesh(world))
    distckpt.save(sd, dc_path)
    dcp.save(sd, checkpoint_id=dcp_path)
    return None


def _warm_files(directory: str) -> None:
    """Read every file of ``directory`` once with buffered reads: all its pages are then cached."""
    buf = bytearray(8 << 20)
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def _fio_read(files: list[str]) -> tuple[float, int]:
    """(seconds, bytes) of fio reading ``files`` with O_DIRECT (its own runtime; caches dropped first)."""
    drop_caches()
    cmd = ["fio", "--name=load", "--rw=read", "--direct=1", "--ioengine=io_uring", "--bs=4M", "--iodepth=8",
           "--filename=" + ":".join(f.replace(":", "\\:") for f in files), "--output-format=json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]["read"]
    return job["runtime"] / 1000.0, job["io_bytes"]


def _state(shape: str, rank: int, world: int, size: int, small: int, llama: dict, zeros: bool) -> dict:
    if shape == "llama":
        return llama_fsdp_state(world, llama)
    return make_state(size, small, rank, world, _mesh(world), zeros=zeros)


def _load(rank, world, dc_path, dcp_path, shape, size, small, llama, repeat, save_here, modes):
    import torch
    import torch.distributed.checkpoint as dcp

    import distckpt
    from distckpt.bench import _env
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if save_here:  # the llama state: FSDP2 shards exist only in the ranks that built them
        src = _state(shape, rank, world, size, small, llama, zeros=False)
        distckpt.save(src, dc_path)
        dcp.save(src, checkpoint_id=dcp_path)
        dst = zeros_like_state(src)
        del src
        warm_dst = zeros_like_state(dst)
    else:
        dst = _state(shape, rank, world, size, small, llama, zeros=True)
        warm_dst = _state(shape, rank, world, size, small, llama, zeros=True)
    needed = local_bytes(dst)
    data_files = sorted(os.path.join(dc_path, f) for f in os.listdir(dc_path) if f.endswith(".bin"))
    distckpt.load(warm_dst, dc_path)  # warm-up: imports, the I/O back-end probe
    dcp.load(warm_dst, checkpoint_id=dcp_path)
    del warm_dst
    rows: dict[str, list] = {}

    def timed(name, fn, prepare=None):
        if rank == 0 and prepare is not None:
            prepare()
        _barrier(world)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")
        before, rc0 = _status("VmRSS"), _rchar()
        t0 = time.perf_counter()
        res = fn()
        _barrier(world)
        dt = time.perf_counter() - t0
        rows.setdefault(name, []).append({"s": dt, "rss": _status("VmHWM") - before, "rchar": _rchar() - rc0,
                                          "read": getattr(res, "bytes_read", None)})

    for i in range(repeat):
        if rank == 0:
            s, n = _fio_read(data_files)
            rows.setdefault("fio", []).append({"s": s, "read": n})
        # Alternate which library goes first, so drift of the shared disk hits both alike.
        # "warm" is the load right after the same library's cold load (what a second load of the
        # checkpoint finds: an evaluation job, a restart in place); "cached" (distckpt only) is a
        # load after every page of its files was read with buffered reads.
        order = ("distckpt", "DCP") if i % 2 == 0 else ("DCP", "distckpt")
        for lib in order:
            if lib == "DCP":
                timed("DCP cold", lambda: dcp.load(dst, checkpoint_id=dcp_path), drop_caches)
                timed("DCP warm", lambda: dcp.load(dst, checkpoint_id=dcp_path))
                continue
            for mode in modes:
                with _env(read_cache=mode):
                    timed(f"distckpt cold [{mode}]", lambda: distckpt.load(dst, dc_path), drop_caches)
                    timed(f"distckpt warm [{mode}]", lambda: distckpt.load(dst, dc_path))
                    if mode == modes[0]:
                        timed(f"distckpt cached [{mode}]", lambda: distckpt.load(dst, dc_path),
                              lambda: _warm_files(dc_path))
    return {"rows": rows, "needed": needed}


def _summary(results: list[dict]) -> dict:
    """Per measurement: median/min/max seconds (the slowest rank per repetition), bytes read in
    total (median over repetitions), the largest RSS any rank added."""
    out = {}
    names = results[0]["rows"].keys()
    for name in names:
        reps = len(results[0]["rows"][name])
        secs, reads, rss = [], [], 0
        for i in range(reps):
            per = [r["rows"][name][i] for r in results if name in r["rows"]]
            secs.append(max(p["s"] for p in per))
            if name == "fio":
                reads.append(per[0]["read"])
            elif name.startswith("distckpt"):
                reads.append(sum(p["read"] for p in per))
            else:
                reads.append(sum(p["rchar"] for p in per))
            rss = max([rss] + [p.get("rss", 0) for p in per])
        out[name] = {"median": statistics.median(secs), "min": min(secs), "max": max(secs),
                     "read": statistics.median(reads), "rss": rss}
    out["needed"] = sum(r["needed"] for r in results)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("directory")
    ap.add_argument("--shape", choices=("synthetic", "llama"), default="synthetic")
    ap.add_argument("--cases", default=None,
                    help="SAVED->LOADED rank counts, comma separated (synthetic default 1->1,2->3; "
                         "llama default 2->2,4->4, and it only loads at the world size it saved with)")
    ap.add_argument("--size", default="512M")
    ap.add_argument("--small", type=int, default=1000)
    ap.add_argument("--llama-hidden", type=int, default=768)
    ap.add_argument("--llama-layers", type=int, default=4)
    ap.add_argument("--llama-inter", type=int, default=2048)
    ap.add_argument("--llama-vocab", type=int, default=8000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--read-cache", default="auto,direct",
                    help="DISTCKPT_READ_CACHE modes distckpt.load runs with, each its own rows (first: the default)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if shutil.which("fio") is None:
        print("fio is not installed: apt-get install -y fio", file=sys.stderr)
        return 2
    cases_text = args.cases or ("1->1,2->3" if args.shape == "synthetic" else "2->2,4->4")
    cases = [tuple(int(x) for x in c.split("->")) for c in cases_text.split(",")]
    if args.shape == "llama" and any(a != b for a, b in cases):
        raise SystemExit("--shape llama loads at the world size it saved with (FSDP2 shards are built per rank)")
    modes = tuple(args.read_cache.split(","))
    size = parse_size(args.size)
    llama = {"hidden": args.llama_hidden, "layers": args.llama_layers, "inter": args.llama_inter,
             "vocab": args.llama_vocab}
    work = os.path.join(os.path.abspath(args.directory), f".distckpt-bench-load-{os.getpid()}")
    os.makedirs(work)
    t_start = time.time()
    table = {}
    try:
        for saved, loaded in cases:
            dc, dp = os.path.join(work, f"dc{saved}"), os.path.join(work, f"dcp{saved}")
            if args.shape == "synthetic":
                spawn(_save, saved, dc, dp, size, args.small)
            table[f"{saved} -> {loaded}"] = _summary(spawn(_load, loaded, dc, dp, args.shape, size, args.small,
                                                           llama, args.repeat, args.shape == "llama", modes))
            rm(dc)
            rm(dp)
    finally:
        rm(work)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)
    if args.shape == "synthetic":
        total = state_bytes(size, args.small)
        what = f"8 large float32 tensors + {args.small} x 16 KiB"
    else:
        total = max(t["needed"] for t in table.values())
        what = (f"FSDP2 get_state_dict of an HF Llama (hidden {args.llama_hidden}, {args.llama_layers} layers, "
                f"intermediate {args.llama_inter}, vocab {args.llama_vocab}) + AdamW")
    print(f"load benchmark: state {total / (1 << 20):.0f} MiB ({what}), load average "
          f"{os.getloadavg()[0]:.1f}, median of {args.repeat} (min..max), seconds of the slowest rank")
    print("| case | measurement | seconds | MB/s read | vs fio (MB/s) | time / DCP's (goal <= 1.00x) | "
          "bytes read / needed | peak RSS added |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    names = (["fio", "DCP cold"] + [f"distckpt cold [{m}]" for m in modes] + ["DCP warm"]
             + [f"distckpt warm [{m}]" for m in modes] + [f"distckpt cached [{modes[0]}]"])
    for case, t in table.items():
        fio_bw = t["fio"]["read"] / t["fio"]["median"]
        for name in names:
            r = t[name]
            bw = r["read"] / r["median"]
            label = "fio O_DIRECT read of distckpt's files, cold" if name == "fio" else name
            vs_fio = f"{bw / fio_bw:.2f}x" if name != "fio" else ""
            peer = "DCP cold" if " cold" in name else "DCP warm"
            vs_dcp = f"{r['median'] / t[peer]['median']:.2f}x" if name.startswith("distckpt") else ""
            ratio = f"{r['read'] / t['needed']:.3f}x" if name != "fio" else ""
            rss = f"{r['rss'] / (1 << 20):.1f} MiB" if name != "fio" else ""
            print(f"| {case} | {label} | {r['median']:.3f} ({r['min']:.2f}..{r['max']:.2f}) | {bw / 1e6:.0f} | "
                  f"{vs_fio} | {vs_dcp} | {ratio} | {rss} |")
    print(f"whole run: {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
