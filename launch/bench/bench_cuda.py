"""The CUDA path: saves and loads of GPU tensors against their floors, one run.

One process, one GPU. State: ``--large`` bf16 tensors sharing ``--size`` bytes plus ``--small``
tensors of 16 KiB, all on cuda:0, random data. Every repetition, interleaved:

* ``D2H pinned``: copy every tensor into one preallocated pinned host buffer (non_blocking, one
  synchronize): the floor of any save of this state, and what async_save's blocking part pays.
* ``fio write``: fio's O_DIRECT io_uring write of the same bytes (4 MiB blocks, iodepth 8,
  end_fsync): the disk's floor (when fio is on PATH).
* ``distckpt.save (cuda)``: a sync save of the GPU state (through the pinned ring of
  distckpt.staging.ring); ``no ring``: the same with the ring switched off (one blocking copy of each
  whole piece into torch's pinned memory, then its write); ``host copy``: the same bytes already in
  host memory (what the write costs without any device copy). Host memory each GPU save adds
  (VmHWM reset through /proc/self/clear_refs) and keeps after it is printed too.
* ``distckpt.async_save``: the time the call blocks the caller, and the time until result().
* ``torch.save + fsync`` and ``DCP save`` of the GPU state.
* Loads into GPU destinations, page cache dropped first (root): distckpt, DCP; and distckpt into
  host destinations followed by a plain ``.copy_`` to the GPU.

Every load is checked bit-exact against the saved state once. Everything under DIR is removed at
the end. Usage::

    python launch/bench/bench_cuda.py DIR --size 2G --repeat 3
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

from bench import drop_caches, parse_size  # noqa: E402


def make_state(size: int, large: int, small: int, device: str, seed: int = 0) -> dict:
    import torch
    g = torch.Generator(device="cpu").manual_seed(seed)
    per = size // large // 2 // 4096 * 4096  # elements of bf16 per large tensor, 4096-row multiple
    sd = {}
    for i in range(large):
        sd[f"layer{i}.weight"] = torch.randn(per // 4096, 4096, generator=g).to(torch.bfloat16).to(device)
    for i in range(small):
        sd[f"small{i}.bias"] = torch.randn(4096, generator=g).to(device)  # 16 KiB fp32
    return sd


def nbytes(sd: dict) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def fio_write(directory: str, size: int) -> float | None:
    if shutil.which("fio") is None:
        return None
    path = os.path.join(directory, "fio.dat")
    cmd = ["fio", "--name=w", "--rw=write", "--direct=1", "--ioengine=io_uring", "--bs=4M", "--iodepth=8",
           f"--size={size}", "--end_fsync=1", f"--filename={path}", "--output-format=json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    os.unlink(path)
    job = json.loads(out[out.index("{"):])["jobs"][0]["write"]
    return job["io_bytes"] / (job["bw_bytes"] or 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir")
    p.add_argument("--size", default="2G", help="bytes of large tensors (default 2G)")
    p.add_argument("--large", type=int, default=8)
    p.add_argument("--small", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=None, help="write every measurement here")
    args = p.parse_args(argv)

    import torch
    import torch.distributed.checkpoint as dcp

    import distckpt

    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark measures the GPU path", file=sys.stderr)
        return 2
    dev = "cuda:0"
    root = os.path.abspath(args.dir)
    os.makedirs(root, exist_ok=True)
    work = os.path.join(root, f"bench-cuda-{os.getpid()}")
    os.makedirs(work)
    try:
        sd = make_state(parse_size(args.size), args.large, args.small, dev)
        total = nbytes(sd)
        host_sd = {k: v.cpu() for k, v in sd.items()}
        pinned = torch.empty(total + 4096 * len(sd), dtype=torch.uint8, pin_memory=True)
        rows: dict[str, list[float]] = {}
        extra: dict[str, list] = {}

        def rec(name, seconds):
            rows.setdefault(name, []).append(seconds)

        def d2h_pinned():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            at = 0
            for t in sd.values():
                n = t.numel() * t.element_size()
                pinned[at:at + n].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
                at += (n + 4095) // 4096 * 4096
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        def status(key):
            with open("/proc/self/status") as fh:
                for line in fh:
                    if line.startswith(key + ":"):
                        return int(line.split()[1]) * 1024
            return 0

        def timed(fn, mem=None):
            torch.cuda.synchronize()
            if mem is not None:
                with open("/proc/self/clear_refs", "w") as fh:
                    fh.write("5\n")  # reset VmHWM to the current RSS
                before = status("VmRSS")
            t0 = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if mem is not None:
                extra.setdefault("host memory " + mem, []).append(
                    {"peak added MiB": round((status("VmHWM") - before) / 2**20, 1),
                     "held after MiB": round((status("VmRSS") - before) / 2**20, 1)})
            return dt, out

        def fresh(name):
            path = os.path.join(work, name)
            if os.path.exists(path):
                shutil.rmtree(path)
            return path

        # warm-up: CUDA context, distckpt's probes, DCP's imports
        distckpt.save(sd, fresh("warm"))
        distckpt.load({k: torch.empty_like(v) for k, v in sd.items()}, os.path.join(work, "warm"))
        shutil.rmtree(os.path.join(work, "warm"))
        checked = False
        for rep in range(args.repeat):
            rec("D2H pinned", d2h_pinned())
            f = fio_write(work, total)
            if f is not None:
                rec("fio write", f)
            s, res = timed(lambda: distckpt.save(sd, fresh("dc")), mem="distckpt.save (cuda)")
            rec("distckpt.save (cuda)", s)
            extra.setdefault("phases cuda", []).append(res.phase_seconds)
            # The path before the pinned ring: one blocking device-to-host copy per piece, then its write.
            import distckpt.datafile as co  # the module that decides which pieces take the ring
            orig, co.needs_staging = co.needs_staging, lambda t: False
            try:
                rec("distckpt.save (cuda), no ring",
                    timed(lambda: distckpt.save(sd, fresh("dcn")), mem="distckpt.save (cuda), no ring")[0])
            finally:
                co.needs_staging = orig
            shutil.rmtree(os.path.join(work, "dcn"))
            s, res = timed(lambda: distckpt.save(host_sd, fresh("dch")))
            rec("distckpt.save (host copy)", s)
            shutil.rmtree(os.path.join(work, "dch"))
            t0 = time.perf_counter()
            h = distckpt.async_save(sd, fresh("dca"))
            rec("async_save blocking", time.perf_counter() - t0)
            h.result()
            rec("async_save total", time.perf_counter() - t0)
            shutil.rmtree(os.path.join(work, "dca"))

            def tsave():
                path = fresh("ts.pt")
                with open(path, "wb") as fh:
                    torch.save(sd, fh)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.unlink(path)
            rec("torch.save + fsync", timed(tsave)[0])
            rec("DCP save", timed(lambda: dcp.save(sd, checkpoint_id=fresh("dcp")))[0])

            if shutil.which("fio"):
                drop_caches()
                cmd = ["fio", "--name=r", "--rw=read", "--direct=1", "--ioengine=io_uring", "--bs=4M",
                       "--iodepth=8", f"--filename={os.path.join(work, 'dc', 'rank00000.bin')}",
                       "--output-format=json"]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                job = json.loads(out[out.index("{"):])["jobs"][0]["read"]
                rec("fio read (distckpt's file), cold", job["io_bytes"] / (job["bw_bytes"] or 1))
            dst = {k: torch.empty_like(v) for k, v in sd.items()}
            host_dst = {k: torch.empty_like(v) for k, v in host_sd.items()}
            drop_caches()
            s, res = timed(lambda: distckpt.load(dst, os.path.join(work, "dc")))
            rec("distckpt.load -> cuda, cold", s)
            if not checked:
                bad = [k for k in sd if not torch.equal(dst[k].view(torch.uint8), sd[k].view(torch.uint8))]
                assert not bad, f"distckpt load differs: {bad[:5]}"
            drop_caches()

            def host_then_copy():
                distckpt.load(host_dst, os.path.join(work, "dc"))
                for k, v in host_dst.items():
                    dst[k].copy_(v)
            rec("distckpt.load -> host, then .to(cuda), cold", timed(host_then_copy)[0])
            drop_caches()
            for v in dst.values():
                v.zero_()
            rec("DCP load -> cuda, cold", timed(lambda: dcp.load(dst, checkpoint_id=os.path.join(work, "dcp")))[0])
            if not checked:
                bad = [k for k in sd if not torch.equal(dst[k].view(torch.uint8), sd[k].view(torch.uint8))]
                assert not bad, f"DCP load differs: {bad[:5]}"
                checked = True
            shutil.rmtree(os.path.join(work, "dc"))
            shutil.rmtree(os.path.join(work, "dcp"))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    props = torch.cuda.get_device_properties(0)
    print(f"\n{props.name}, torch {torch.__version__}, {total / 2**30:.2f} GiB in {args.large} large bf16 + "
          f"{args.small} x 16 KiB fp32 tensors, {args.repeat} repetitions, load average "
          f"{open('/proc/loadavg').read().split()[:3]}")
    base = statistics.median(rows["fio write"]) if "fio write" in rows else None
    rbase = statistics.median(rows["fio read (distckpt's file), cold"]) if shutil.which("fio") else None
    print(f"{'measurement':48s} {'median s':>9s} {'min':>7s} {'max':>7s} {'GB/s':>6s} {'vs fio':>7s}")
    for name, vals in rows.items():
        med = statistics.median(vals)
        ref = rbase if ("load" in name or "read" in name) else base
        ratio = f"{ref / med:.2f}x" if ref and "D2H" not in name and "blocking" not in name else ""
        print(f"{name:48s} {med:9.3f} {min(vals):7.3f} {max(vals):7.3f} {total / med / 1e9:6.2f} {ratio:>7s}")
    print("distckpt.save (cuda) phases:", extra.get("phases cuda"))
    for key, val in extra.items():
        if key.startswith("host memory"):
            print(f"{key}: {val}")
    if hasattr(torch.cuda, "host_memory_stats"):
        st = torch.cuda.host_memory_stats()
        print("torch's pinned host cache at the end: reserved "
              f"{st.get('reserved_bytes.current', st.get('segment.current', '?'))} bytes, "
              f"allocated {st.get('allocated_bytes.current', '?')} bytes")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "extra": extra, "bytes": total}, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
