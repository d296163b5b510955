"""Benchmark: incremental (delta) vs full checkpoints of embedding tables held on a GPU, one process.

    python launch/bench/bench_incremental_gpu.py DIR [--device cuda] [--rows 8000000] [--dim 128] [--rounds 4]

State: one fp32 table of ``--rows`` x ``--dim`` and its per-row momentum (as EXACT_ROWWISE_ADAGRAD
keeps it), both tracked by row, plus a small dense part, on ``--device``. Per touched fraction
(1 %, 5 %, 20 %): a full incremental base, then ``--rounds`` rounds of (a random ``fraction`` of the
rows updated by kernels on the device; an incremental save under the default policy, a delta or a
new full base; a plain full save of the same state). Then restores onto the device of the last chain and of the full checkpoint of the
same step, alternated 3 times, page cache dropped before each (root), both checked bit-exact.
Prints, per fraction, medians: the delta's bytes and the changed rows' bytes, save seconds of each
kind, the time the row digests alone take on the device, and the fastest restores. Everything under
DIR is removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distckpt  # noqa: E402
from distckpt.incremental import IncrementalPolicy, IncrementalSaver, row_digests  # noqa: E402
from bench import drop_caches  # noqa: E402

ROWS = {"model.emb": 0, "optim.mom": 0}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=8_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fractions", default="0.01,0.05,0.2")
    args = ap.parse_args()
    dev = args.device
    g = torch.Generator(device=dev).manual_seed(0)
    state = {"model": {"emb": torch.randn(args.rows, args.dim, device=dev, generator=g),
                       "dense": torch.randn(256, 256, device=dev, generator=g)},
             "optim": {"mom": torch.rand(args.rows, device=dev, generator=g)}, "step": 0}
    table_bytes = (args.dim + 1) * 4 * args.rows
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"{name}: table {args.rows} x {args.dim} fp32 + momentum = {table_bytes / 2**30:.2f} GiB on {dev}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    dg_s = min(timed(lambda: (row_digests(state["model"]["emb"]), row_digests(state["optim"]["mom"])), dev)[0]
               for _ in range(3))
    print(f"row digests of the whole table on {dev}: {dg_s:.3f} s ({table_bytes / dg_s / 2**30:.1f} GiB/s)",
          flush=True)
    os.makedirs(args.dir, exist_ok=True)
    try:
        for fi, fraction in enumerate(float(x) for x in args.fractions.split(",")):
            root = os.path.join(args.dir, f"f{fraction}")
            saver = IncrementalSaver(IncrementalPolicy(rows=ROWS))   # the default policy
            saver.save(state, os.path.join(root, "link0"))
            rec = {"delta_s": [], "full_s": [], "delta_b": [], "changed_b": [], "kinds": []}
            n = int(args.rows * fraction)
            for k in range(1, args.rounds + 1):
                idx = torch.randperm(args.rows, device=dev, generator=g)[:n]
                state["model"]["emb"].index_add_(0, idx, torch.randn(n, args.dim, device=dev, generator=g))
                state["optim"]["mom"].index_add_(0, idx, torch.rand(n, device=dev, generator=g))
                state["step"] = k
                ds, dres = timed(lambda: saver.save(state, os.path.join(root, f"link{k}")), dev)
                rec["kinds"].append(f"{saver.last_kind}:{saver._link['seq']}")
                fs, _ = timed(lambda: distckpt.save(state, os.path.join(root, f"full{k}")), dev)
                rec["full_s"].append(fs)
                if saver.last_kind == "delta":
                    rec["delta_s"].append(ds)
                    rec["delta_b"].append(dres.total_bytes)
                    rec["changed_b"].append(saver._link["link_bytes"])
            want = {"emb": state["model"]["emb"].clone(), "mom": state["optim"]["mom"].clone()}
            chain_t, full_t = [], []
            for _ in range(3):
                for which, times in ((f"link{args.rounds}", chain_t), (f"full{args.rounds}", full_t)):
                    dst = {"model": {"emb": torch.empty_like(want["emb"]), "dense": torch.empty(256, 256, device=dev)},
                           "optim": {"mom": torch.empty_like(want["mom"])}, "step": -1}
                    drop_caches()
                    t, _r = timed(lambda: distckpt.load(dst, os.path.join(root, which)), dev)
                    assert torch.equal(dst["model"]["emb"], want["emb"]) and torch.equal(dst["optim"]["mom"], want["mom"])
                    times.append(t)
                    del dst
            med = statistics.median
            print(f"touched {fraction:.0%}: delta {med(rec['delta_b']) / 2**20:.1f} MiB for {med(rec['changed_b']) / 2**20:.1f} "
                  f"MiB of changed rows ({med(rec['delta_b']) / med(rec['changed_b']):.3f}x), full "
                  f"{med(rec['full_s']):.3f} s vs delta {med(rec['delta_s']):.3f} s save "
                  f"({med(rec['delta_s']) / med(rec['full_s']):.2f}x); links {' '.join(rec['kinds'])}; restore onto {dev} "
                  f"of the last link (a chain of {int(rec['kinds'][-1].split(':')[1]) + 1}): "
                  f"{min(chain_t):.3f} s vs full {min(full_t):.3f} s ({min(chain_t) / min(full_t):.2f}x fastest, "
                  f"{med(chain_t) / med(full_t):.2f}x medians)", flush=True)
            shutil.rmtree(root)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
