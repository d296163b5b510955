"""convert of a delta of an incremental chain against convert of the same state saved full,
side by side in one run.

    python launch/bench/bench_convert_chain.py DIR [--to safetensors] [--memory-limit 1024,64,4] [--rows 1048576]

Builds in DIR (removed first): a ROWS x 64 float32 table plus an int saved full (s1), then two
deltas each changing a random 5 % of the rows (s2, s3), and the final state saved as one full
checkpoint (full). For each memory limit (MiB), two rounds of convert(full) and convert(s3),
alternating; prints each time (the second round has the page cache warm).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import distckpt  # noqa: E402
from distckpt.convert import convert  # noqa: E402
from distckpt.incremental import IncrementalPolicy, IncrementalSaver  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--to", default="safetensors")
    ap.add_argument("--memory-limit", default="1024,64,4", help="MiB, comma-separated")
    ap.add_argument("--rows", type=int, default=1 << 20)
    args = ap.parse_args()
    d = args.dir
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    g = torch.Generator().manual_seed(0)
    sd = {"emb": torch.randn(args.rows, 64, generator=g), "step": 0}
    saver = IncrementalSaver(IncrementalPolicy(rows={"emb": 0}, full_every=10, max_delta_fraction=0.9,
                                               max_chain_fraction=5.0))
    saver.save(sd, f"{d}/s1")
    for s in (1, 2):
        sd["emb"][torch.randperm(args.rows, generator=g)[: args.rows // 20]] += 1
        sd["step"] = s
        saver.save(sd, f"{d}/s{s + 1}")
    assert saver.last_kind == "delta"
    distckpt.save(sd, f"{d}/full")
    for limit in (int(x) for x in args.memory_limit.split(",")):
        for rnd in (1, 2):
            for src in ("full", "s3"):
                out = f"{d}/out"
                t = time.perf_counter()
                convert(f"{d}/{src}", out, to=args.to, memory_limit=limit << 20, progress=False)
                print(f"memory_limit {limit} MiB, round {rnd}, {src}: {time.perf_counter() - t:.2f} s", flush=True)
                shutil.rmtree(out) if os.path.isdir(out) else os.unlink(out)


if __name__ == "__main__":
    main()
