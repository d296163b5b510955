"""Load benchmark: distckpt.load vs torch.distributed.checkpoint.load vs fio, one run.

    .venv/bin/python launch/bench/bench_load.py DIR [--size 512M] [--small 1000] [--repeat 3]

Two cases, each in freshly spawned gloo ranks on this machine:

  * ``1 -> 1``: a checkpoint saved by 1 rank, loaded by 1 rank;
  * ``2 -> 3``: saved by 2 ranks (large tensors DTensor-sharded on dim 0, small ones replicated),
    loaded by 3 ranks (a resharding load).

Both libraries save the same state into DIR first. Then, ``--repeat`` times and interleaved:
fio O_DIRECT read of distckpt's data files (io_uring, 4 MiB blocks, iodepth 8, after
``sync; echo 3 > /proc/sys/vm/drop_caches``); distckpt.load cold (caches dropped) and warm (its
data files read once with buffered reads, so every page is cached); DCP load cold and warm (DCP's
own cold load leaves its files cached). Medians are printed with the min..max, plus: bytes read /
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

from bench import _barrier, _rchar, drop_caches, make_state, parse_size, rm, spawn, state_bytes  # noqa: E402


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


def _load(rank, world, dc_path, dcp_path, size, small, repeat):
    import torch
    import torch.distributed.checkpoint as dcp

    import distckpt
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    mesh = _mesh(world)
    dst = make_state(size, small, rank, world, mesh, zeros=True)
    needed = sum((v.to_local() if hasattr(v, "to_local") else v).numel() * 4 for v in dst.values())
    data_files = sorted(os.path.join(dc_path, f) for f in os.listdir(dc_path) if f.endswith(".bin"))
    distckpt.load(make_state(size, small, rank, world, mesh, zeros=True), dc_path)  # warm-up: imports, probe
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

    for _ in range(repeat):
        if rank == 0:
            s, n = _fio_read(data_files)
            rows.setdefault("fio", []).append({"s": s, "read": n})
        timed("distckpt cold", lambda: distckpt.load(dst, dc_path), drop_caches)
        timed("distckpt warm", lambda: distckpt.load(dst, dc_path), lambda: _warm_files(dc_path))
        timed("DCP cold", lambda: dcp.load(dst, checkpoint_id=dcp_path), drop_caches)
        timed("DCP warm", lambda: dcp.load(dst, checkpoint_id=dcp_path))
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
    ap.add_argument("--size", default="512M")
    ap.add_argument("--small", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if shutil.which("fio") is None:
        print("fio is not installed: apt-get install -y fio", file=sys.stderr)
        return 2
    size = parse_size(args.size)
    work = os.path.join(os.path.abspath(args.directory), f".distckpt-bench-load-{os.getpid()}")
    os.makedirs(work)
    t_start = time.time()
    table = {}
    try:
        for saved, loaded in ((1, 1), (2, 3)):
            dc, dp = os.path.join(work, f"dc{saved}"), os.path.join(work, f"dcp{saved}")
            spawn(_save, saved, dc, dp, size, args.small)
            table[f"{saved} -> {loaded}"] = _summary(spawn(_load, loaded, dc, dp, size, args.small, args.repeat))
            rm(dc)
            rm(dp)
    finally:
        rm(work)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)
    total = state_bytes(size, args.small)
    print(f"load benchmark: state {total / (1 << 30):.2f} GiB (8 large float32 tensors + {args.small} x 16 KiB), "
          f"median of {args.repeat} (min..max), seconds of the slowest rank")
    print("| case | measurement | seconds | MB/s read | vs fio (MB/s) | vs DCP same cache | bytes read / needed | peak RSS added |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for case, t in table.items():
        fio_bw = t["fio"]["read"] / t["fio"]["median"]
        for name in ("fio", "distckpt cold", "DCP cold", "distckpt warm", "DCP warm"):
            r = t[name]
            bw = r["read"] / r["median"]
            label = "fio O_DIRECT read of distckpt's files, cold" if name == "fio" else name
            vs_fio = f"{bw / fio_bw:.2f}x" if name != "fio" else ""
            peer = {"distckpt cold": "DCP cold", "distckpt warm": "DCP warm"}.get(name)
            vs_dcp = f"{t[peer]['median'] / r['median']:.2f}x faster" if peer else ""
            ratio = f"{r['read'] / t['needed']:.3f}x" if name != "fio" else ""
            rss = f"{r['rss'] / (1 << 20):.1f} MiB" if name != "fio" else ""
            print(f"| {case} | {label} | {r['median']:.3f} ({r['min']:.2f}..{r['max']:.2f}) | {bw / 1e6:.0f} | "
                  f"{vs_fio} | {vs_dcp} | {ratio} | {rss} |")
    print(f"whole run: {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
