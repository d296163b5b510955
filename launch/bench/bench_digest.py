"""Benchmark: the row digests of incremental saves (distckpt.incremental.row_digests), one run.

    python launch/bench/bench_digest.py [--device cpu|cuda] [--gib 4] [--dim 64]

Hashes ``--gib`` GiB of float32 rows of ``--dim`` columns (fastest of 3) and prints GiB/s:
* on ``cpu``: the C core straight from the tensor's memory (csrc/rowdigest.c), and the same
  formula in torch integer ops on cache-sized blocks (the implementation it replaced: the GPU
  path, distckpt.incremental._device_digests, run on the host with 512 KiB blocks);
* on ``cuda``: the digest on the device (torch ops, only the digests come back), and the GPU path
  before it: 512 KiB blocks of rows copied to the host and hashed there by the C core.
Every variant's digests are checked equal first.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

import distckpt.incremental as inc  # noqa: E402
from distckpt import _uring  # noqa: E402


def fastest(fn, device: str, k: int = 3) -> float:
    best = float("inf")
    for _ in range(k):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def host_blocks(x: torch.Tensor) -> torch.Tensor:
    """The GPU path before on-device digests: 512 KiB of rows at a time to the host, then C."""
    n, width = x.shape[0], x.shape[1] * x.element_size() // 8
    mult, out = inc._multipliers(width), torch.empty(n, dtype=torch.int64)
    step = (1 << 16) // width
    for a in range(0, n, step):
        blk = x[a:a + step].to("cpu")
        _uring.row_digests(blk.data_ptr(), blk.shape[0], width * 8, width, 8, mult.data_ptr(), out[a:].data_ptr())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--dim", type=int, default=64)
    args = ap.parse_args()
    rows = int(args.gib * 2**30) // (4 * args.dim)
    t = torch.randn(rows, args.dim, device=args.device)
    gib = t.numel() * 4 / 2**30
    width = args.dim * 4 // 8
    if args.device == "cpu":
        inc._DEVICE_BLOCK_WORDS = 1 << 16   # cache-sized blocks, as the torch version on the host had
        variants = {"C core (row_digests)": lambda: inc.row_digests(t),
                    "torch integer ops": lambda: inc._device_digests(t, 8, inc._multipliers(width))}
    else:
        variants = {"on the device (row_digests)": lambda: inc.row_digests(t),
                    "512 KiB blocks to the host, then C": lambda: host_blocks(t)}
    ref = None
    for fn in variants.values():
        d = fn()
        assert ref is None or torch.equal(d, ref), "digests differ"
        ref = d
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{gib:.2f} GiB of {rows} x {args.dim} float32 rows on {name}, torch threads {torch.get_num_threads()}")
    for label, fn in variants.items():
        s = fastest(fn, args.device)
        print(f"  {label:40s} {s:8.3f} s  {gib / s:6.2f} GiB/s")


if __name__ == "__main__":
    main()
