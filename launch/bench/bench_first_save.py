"""The first async save of a job: how long it blocks the caller, against one copy of its bytes.

Each case runs in a fresh process (a process's first async save is what is measured), on
``--device cpu`` or ``cuda``. State: ``--large`` tensors sharing ``--size`` bytes (bf16 on CUDA,
fp32 on the CPU) plus ``--small`` tensors of 16 KiB, random data. Per process:

* ``copy floor``: one copy of every tensor into a buffer allocated and touched beforehand (pinned
  on CUDA: non_blocking DMAs, one synchronize): what any async save must at least block for.
* ``old path's allocation``: what the first save used to pay before copying: one arena from
  torch's pinned caching allocator (CUDA) or a fresh buffer's first touch (CPU), timed alone.
* ``first async_save, nothing reserved``: the first save stages into a plain allocation (no
  pinning on the caller's path); then two more saves (steady state).
* ``first async_save after reserve_staging_memory``: the reservation is started, then (``--train``
  seconds of) a training-like loop runs on the main thread beside it, then the save. The loop's
  step times with and without a reservation in the background are printed (on CUDA: a matmul
  and a synchronize per step), so the reservation's cost to training is visible.
* ``stage_in_background``: nothing reserved; the save is called with ``stage_in_background=True``:
  the call returns after the plan and the copy runs on the save's thread. ``reserve-bg``: both,
  what torchtitan's ``async_with_pinned_mem`` does (reserved at its first ``save()`` call).

Every save is followed by what a training loop does next: a forward and backward (``--fwd``
seconds of the training-like work, calibrated alone first), then ``handle.wait_staged()`` (the
trainer's ``maybe_wait_for_staging()``), then an optimizer step (every tensor of the state
changed in place), then ``handle.result()``. Per save it prints the call's blocked time, the
wait's, and how much slower the forward and backward ran beside the save than alone (the cores
the staging and the write take from training): their sum is the training time the save cost.

Every save is compared bit-exact once. Usage::

    python launch/bench/bench_first_save.py DIR --device cuda --size 2G --repeat 3
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

from bench import parse_size  # noqa: E402


def make_state(size: int, large: int, small: int, device: str) -> dict:
    import torch
    g = torch.Generator(device="cpu").manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    esize = 2 if device == "cuda" else 4
    rows = max(1, size // large // esize // 4096)
    sd = {f"layer{i}.weight": torch.randn(rows, 4096, generator=g).to(dtype).to(device) for i in range(large)}
    for i in range(small):
        sd[f"small{i}.bias"] = torch.randn(4096, generator=g).to(device)
    return sd


def _sync(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


def copy_floor(sd: dict, device: str) -> float:
    import torch
    n = sum(t.numel() * t.element_size() for t in sd.values())
    buf = torch.empty(n, dtype=torch.uint8, pin_memory=(device == "cuda"))
    buf.zero_()
    views, at = [], 0
    for t in sd.values():
        b = t.numel() * t.element_size()
        views.append(buf[at:at + b].view(t.dtype).view(t.shape))
        at += b
    best = None
    for _ in range(3):
        t0 = time.perf_counter()
        if device == "cuda":
            for v, t in zip(views, sd.values()):
                v.copy_(t, non_blocking=True)
            torch.cuda.synchronize()
        else:
            torch._foreach_copy_(views, list(sd.values()))
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return best


def old_allocation(n: int, device: str) -> float:
    import torch
    t0 = time.perf_counter()
    if device == "cuda":
        buf = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    else:
        buf = torch.empty(n, dtype=torch.uint8)
        buf.zero_()  # the first touch a copy into a fresh arena pays
    dt = time.perf_counter() - t0
    del buf
    return dt


def train_steps(device: str, seconds: float) -> list[float]:
    """A training-like loop: on CUDA one 4096^2 bf16 matmul chain and a synchronize per step; on
    the CPU a 512^2 fp32 matmul per step. Returns each step's seconds."""
    import torch
    if device == "cuda":
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    else:
        a = torch.randn(512, 512)
    steps, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        b = a
        for _ in range(8):
            b = b @ a
            b = b / b.abs().max()
        _sync(device)
        steps.append(time.perf_counter() - t0)
    return steps


def fwd_work(device: str, iters: int) -> float:
    """``iters`` iterations of :func:`train_steps`' work (a stand-in for a forward and backward
    that does not touch the state); returns its seconds."""
    import torch
    if device == "cuda":
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    else:
        a = torch.randn(512, 512)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        b = a
        for _ in range(8):
            b = b @ a
            b = b / b.abs().max()
    _sync(device)
    return time.perf_counter() - t0


def child(args) -> dict:
    import torch
    import distckpt
    from distckpt.staging.pool import staging_pool
    sd = make_state(args.size, args.large, args.small, args.device)
    _sync(args.device)
    n = sum(t.numel() * t.element_size() for t in sd.values())
    out: dict = {"bytes": n, "case": args.case}
    if args.case == "old":
        # First, before any pinned memory exists: torch's caching host allocator would otherwise
        # hand back the floor's buffer (cached, not freed).
        out["old_alloc"] = old_allocation(n, args.device)
    out["floor"] = copy_floor(sd, args.device)
    if args.case == "old":
        return out
    if args.case in ("reserve", "reserve-bg"):
        out["train_alone"] = train_steps(args.device, args.train)
        t0 = time.perf_counter()
        res = distckpt.reserve_staging_memory(sd)
        out["reserve_call"] = time.perf_counter() - t0
        out["train_beside"] = train_steps(args.device, args.train)
        res.wait()
        out["reserve_ready"] = time.perf_counter() - t0
        out["reserve_error"] = repr(res.error) if res.error else None
    fwd_work(args.device, 1)  # warm-up
    one = statistics.median(fwd_work(args.device, 1) for _ in range(5))
    iters = max(1, round(args.fwd / one))
    out["fwd_alone"] = statistics.median(fwd_work(args.device, iters) for _ in range(3))
    blocked, waited, fwd_beside, done, allocs = [], [], [], [], []
    tensors = list(sd.values())
    for i in range(3):
        want = {k: t.clone() for k, t in sd.items()} if i == 0 else None
        _sync(args.device)
        before = staging_pool().allocations
        t0 = time.perf_counter()
        h = distckpt.async_save(sd, os.path.join(args.dir, f"{args.case}-{i}"),
                                stage_in_background=args.case in ("background", "reserve-bg"))
        blocked.append(time.perf_counter() - t0)
        fwd_beside.append(fwd_work(args.device, iters))  # the next forward and backward
        t1 = time.perf_counter()
        h.wait_staged()                                   # maybe_wait_for_staging()
        waited.append(time.perf_counter() - t1)
        with torch.no_grad():
            torch._foreach_add_(tensors, 1)               # the optimizer step
        h.result()
        done.append(time.perf_counter() - t0)  # staged, written from the staging memory, committed
        allocs.append(staging_pool().allocations - before)
        if i == 0:
            back = distckpt.read(os.path.join(args.dir, f"{args.case}-{i}"))
            for k, t in want.items():
                if not torch.equal(back[k].to(t.device), t):
                    raise SystemExit(f"bench_first_save: {k} differs after the save")
            del want, back
        shutil.rmtree(os.path.join(args.dir, f"{args.case}-{i}"))
        if args.case == "plain" and i == 0:
            # Wait for the pinned reservation the overflow starts, as a job's next steps would.
            deadline = time.time() + 120
            while staging_pool().pending_bytes() and time.time() < deadline:
                time.sleep(0.05)
    out["blocked"] = blocked
    out["waited"] = waited
    out["fwd_beside"] = fwd_beside
    out["done"] = done
    out["segments_allocated"] = allocs
    return out


def run_case(args, case: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), args.dir, "--child", "--case", case,
           "--device", args.device, "--size", str(args.size), "--large", str(args.large),
           "--small", str(args.small), "--train", str(args.train), "--fwd", str(args.fwd)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"bench_first_save: case {case} failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--size", type=parse_size, default=parse_size("1G"))
    ap.add_argument("--large", type=int, default=8)
    ap.add_argument("--small", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--train", type=float, default=2.0, help="seconds of the training-like loop")
    ap.add_argument("--fwd", type=float, default=1.0,
                    help="seconds of the forward and backward after each save (calibrated alone)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--case", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    runs: dict[str, list[dict]] = {"old": [], "plain": [], "reserve": [], "background": [], "reserve-bg": []}
    try:
        for _ in range(args.repeat):
            for case in runs:  # interleaved
                runs[case].append(run_case(args, case))
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    med = statistics.median
    n = runs["plain"][0]["bytes"]
    floor = med([r["floor"] for rs in runs.values() for r in rs])
    print(f"state: {n / 2**30:.2f} GiB on {args.device} ({args.large} large + {args.small} x 16 KiB), "
          f"{args.repeat} fresh processes per case, medians")
    print(f"copy floor (one copy into ready {'pinned ' if args.device == 'cuda' else ''}memory): {floor:.3f} s")
    print(f"old path's arena allocation alone: {med([r['old_alloc'] for r in runs['old']]):.3f} s")
    for case, label in (("plain", "nothing reserved"), ("reserve", "after reserve_staging_memory"),
                        ("background", "stage_in_background, nothing reserved"),
                        ("reserve-bg", "stage_in_background after reserve_staging_memory")):
        rs = runs[case]
        b = [r["blocked"] for r in rs]
        first, later = [x[0] for x in b], [x for r in b for x in r[1:]]
        print(f"async_save, {label}: call blocked first {med(first):.3f} s = {med(first) / floor:.2f}x floor "
              f"(runs {', '.join(f'{x:.3f}' for x in first)}), later {med(later):.3f} s = "
              f"{med(later) / floor:.2f}x; later saves done (written, committed) after "
              f"{med([x for r in rs for x in r['done'][1:]]):.3f} s; "
              f"segments allocated per save {rs[0]['segments_allocated']}")
        for which, pick in (("first", lambda x: x[:1]), ("later", lambda x: x[1:])):
            wait = [w for r in rs for w in pick(r["waited"])]
            slow = [f - r["fwd_alone"] for r in rs for f in pick(r["fwd_beside"])]
            cost = [c + w + (f - r["fwd_alone"]) for r in rs
                    for c, w, f in zip(pick(r["blocked"]), pick(r["waited"]), pick(r["fwd_beside"]))]
            print(f"    {which}: wait_staged {med(wait):.3f} s, forward/backward slower by {med(slow):+.3f} s "
                  f"(alone {med([r['fwd_alone'] for r in rs]):.3f} s), training time lost "
                  f"{med(cost):.3f} s = {med(cost) / floor:.2f}x floor (max {max(cost):.3f} s)")
    rs = runs["reserve"]
    alone = [s for r in rs for s in r["train_alone"]]
    beside = [s for r in rs for s in r["train_beside"]]
    print(f"reservation: call {med([r['reserve_call'] for r in rs]) * 1e3:.1f} ms, ready after "
          f"{med([r['reserve_ready'] for r in rs]):.3f} s; errors {[r['reserve_error'] for r in rs if r['reserve_error']]}")
    print(f"training step alone: median {med(alone) * 1e3:.2f} ms, max {max(alone) * 1e3:.2f} ms; beside the "
          f"reservation: median {med(beside) * 1e3:.2f} ms, max {max(beside) * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
