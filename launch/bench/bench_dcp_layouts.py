"""Reading a DCP checkpoint whose chunks are stored strided: distckpt.load vs dcp.load, one run.

    .venv/bin/python launch/bench/bench_dcp_layouts.py DIR [--repeat 4] [--cold] [--dest same|contiguous] [--own]

The state is what a conv net trained ``channels_last`` with Adam holds: 58 NHWC conv weights
(40 of 256x256x3x3, 12 of 512x512x3x3, 6 of 2048x512x1x1) and two ``*_like`` optimizer states
each (they keep the layout), 666 MiB float32 in 174 tensors. ``dcp.save`` (one process) stores
every chunk with its strides; both libraries then load that checkpoint into the same
destinations (``--dest same``: tensors of the saved layout, as a resumed model and optimizer
have; ``contiguous``: row-major ones), ``--repeat`` times, the library that goes first
alternating, every load checked bit-exact. ``--cold`` drops the page cache before each load
(root). ``--own``: each library loads the checkpoint it saved itself instead (distckpt stores
every chunk row-major, so its load into a channels_last model is a permuting copy), plus
distckpt with ``verify=False``, to show what its checksums cost. Medians and each run are printed
with the ratio distckpt / DCP. DIR is removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
import warnings

import torch


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    sd = {}
    layers = [(256, 256, 3)] * 40 + [(512, 512, 3)] * 12 + [(2048, 512, 1)] * 6
    for i, (co, ci, k) in enumerate(layers):
        w = torch.randn(co, ci, k, k, generator=g).to(memory_format=torch.channels_last)
        sd[f"layer{i}.weight"] = w
        sd[f"layer{i}.exp_avg"] = torch.randn(w.shape, generator=g).to(memory_format=torch.channels_last)
        sd[f"layer{i}.exp_avg_sq"] = torch.rand(w.shape, generator=g).to(memory_format=torch.channels_last)
    return sd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each load (root)")
    ap.add_argument("--dest", choices=("same", "contiguous"), default="same")
    ap.add_argument("--own", action="store_true",
                    help="distckpt loads its own save of the state (and once more with verify=False)")
    args = ap.parse_args()
    warnings.simplefilter("ignore")  # dcp's "no process group: single process" notice
    import torch.distributed.checkpoint as dcp

    import distckpt

    sd = _state()
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    path = os.path.join(args.dir, "dcp")
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(args.dir, exist_ok=True)
    try:
        dcp.save(sd, checkpoint_id=path, no_dist=True)
        mine = path
        if args.own:
            mine = os.path.join(args.dir, "distckpt")
            distckpt.save(sd, mine)
        if args.dest == "same":
            dst = {k: torch.zeros_like(v) for k, v in sd.items()}
        else:
            dst = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}
        names = ["dcp", "distckpt"] + (["distckpt verify=False"] if args.own else [])
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.repeat):
            for name in (names if r % 2 == 0 else names[::-1]):
                for t in dst.values():
                    t.zero_()
                if args.cold:
                    os.sync()
                    with open("/proc/sys/vm/drop_caches", "w") as f:
                        f.write("3")
                t0 = time.perf_counter()
                if name == "dcp":
                    dcp.load(dst, checkpoint_id=path, no_dist=True)
                else:
                    distckpt.load(dst, mine, verify=name == "distckpt")
                times[name].append(time.perf_counter() - t0)
                bad = [k for k in sd if not torch.equal(dst[k], sd[k])]
                if bad:
                    raise SystemExit(f"{name} loaded wrong values for {bad[:3]}")
        print(f"state: {nbytes / 2**20:.0f} MiB in {len(sd)} tensors, channels_last (e.g. strides "
              f"{tuple(sd['layer0.weight'].stride())}); destinations: {args.dest} layout; "
              f"{'cold' if args.cold else 'warm'}; {'each library its own save' if args.own else 'the DCP save'}; "
              f"load average {os.getloadavg()[0]:.2f}")
        for name, ts in times.items():
            print(f"  {name:21s} median {statistics.median(ts):.3f} s  runs " + " ".join(f"{t:.3f}" for t in ts))
        print(f"  distckpt / dcp: {statistics.median(times['distckpt']) / statistics.median(times['dcp']):.2f}x the time")
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
