"""Conversion benchmark: `distckpt convert` vs the reference routes, ratios side by side.

    .venv/bin/python launch/bench/bench_convert.py DIR [--tensors 150] [--repeat 5] [--memory-limit 1G]

A state of ``--tensors`` float32 tensors, a third each of [256, 1024] (1 MiB), [256, 256]
(256 KiB) and [1024] (4 KiB): 150 tensors are 62.7 MiB. It is saved once with distckpt (one
rank) and once with ``torch.distributed.checkpoint`` (``dcp.save``), both into DIR. Then, for each
target, ``--repeat`` times, alternating which route runs first, from the page cache (every source
file was read just before):

  =========== ==================================================== =================================
  target      distckpt route                                        reference route
  =========== ==================================================== =================================
  safetensors ``convert(src, dst, to="safetensors")``               ``distckpt.read`` + safetensors ``save_file``
  torch       ``convert(src, dst, to="torch")``                     ``distckpt.read`` + ``torch.save``
  torch (DCP) ``convert(dcp_src, dst, to="torch")``                 torch's ``dcp_to_torch_save(dcp_src, dst)``
  dcp         ``convert(src, dst, to="dcp")``                       ``distckpt.read`` + ``dcp.save(no_dist=True)``
  distckpt    ``convert(src, dst, to="distckpt")``                  ``distckpt.read`` + ``distckpt.save``
  st (HF)     ``convert(hf_src, dst, to="safetensors")``            per shard: safetensors ``load_file`` + ``save_file``
  =========== ==================================================== =================================

``hf_src`` is the same state as a Hugging Face directory: two safetensors shards and their index
(``model.safetensors.index.json``), as ``save_pretrained`` writes them.

``convert`` makes its output durable (fsync), as ``dcp.save`` and ``distckpt.save`` do, while
``save_file`` and ``torch.save`` do not: their routes are timed both as they are and followed by
an fsync of the file they wrote (``+fsync``), the like-for-like figure. Printed: medians (min..max)
and the ratio convert / reference of the medians. Everything created under DIR is removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))


def make_state(n: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    shapes = [(256, 1024), (256, 256), (1024,)]
    return {"model": {f"layers.{i // 3}.p{i % 3}": torch.randn(shapes[i % 3], generator=g) for i in range(n)}}


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rm(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _warm(path: str) -> None:
    """Read every file under ``path`` once (buffered): both routes start from the page cache."""
    for d, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                while fh.read(16 << 20):
                    pass


def write_hf(model: dict, path: str) -> None:
    """``model`` as a Hugging Face directory of two safetensors shards and their index."""
    import json

    from safetensors.torch import save_file

    os.makedirs(path)
    keys = list(model)
    index = {"metadata": {}, "weight_map": {}}
    for i, part in enumerate((keys[:len(keys) // 2], keys[len(keys) // 2:])):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: model[k] for k in part}, os.path.join(path, name), metadata={"format": "pt"})
        index["weight_map"].update({k: name for k in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)


def routes(src: str, dcp_src: str, hf_src: str, out: str, limit: int) -> dict:
    """{target: (convert route, [(name, reference route), ...])}; each route writes ``out``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import distckpt
    from distckpt.convert import convert

    def conv(source, to):
        return lambda: convert(source, out, to=to, memory_limit=limit, progress=False)

    def st(sync):
        def run():
            os.makedirs(out)
            save_file(distckpt.read(src)["model"], os.path.join(out, "model.safetensors"))
            if sync:
                _fsync(os.path.join(out, "model.safetensors"))
        return run

    def hf(sync):
        def run():
            os.makedirs(out)
            for name in sorted(os.listdir(hf_src)):
                if name.endswith(".safetensors"):
                    save_file(load_file(os.path.join(hf_src, name)), os.path.join(out, name))
                    if sync:
                        _fsync(os.path.join(out, name))
        return run

    def ts(sync):
        def run():
            torch.save(distckpt.read(src), out)
            if sync:
                _fsync(out)
        return run

    return {
        "safetensors": (conv(src, "safetensors"), [("read+save_file", st(False)), ("read+save_file+fsync", st(True))]),
        "torch": (conv(src, "torch"), [("read+torch.save", ts(False)), ("read+torch.save+fsync", ts(True))]),
        "torch (DCP src)": (conv(dcp_src, "torch"), [("dcp_to_torch_save", lambda: dcp_to_torch_save(dcp_src, out)),
                                                     ("dcp_to_torch_save+fsync",
                                                      lambda: (dcp_to_torch_save(dcp_src, out), _fsync(out)))]),
        "dcp": (conv(src, "dcp"), [("read+dcp.save", lambda: dcp.save(distckpt.read(src), checkpoint_id=out,
                                                                       no_dist=True))]),
        "distckpt": (conv(src, "distckpt"), [("read+distckpt.save",
                                              lambda: distckpt.save(distckpt.read(src), out, no_dist=True))]),
        "st (HF src)": (conv(hf_src, "safetensors"), [("load_file+save_file", hf(False)),
                                                       ("load_file+save_file+fsync", hf(True))]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("directory")
    ap.add_argument("--tensors", type=int, default=150)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--memory-limit", default="1G", help="convert's --memory-limit (binary units)")
    ap.add_argument("--only", help="run these targets only (comma-separated names as printed)")
    args = ap.parse_args()

    import torch
    import torch.distributed.checkpoint as dcp

    import distckpt
    from distckpt.sizes import format_bytes, parse_size

    limit = parse_size(args.memory_limit)
    work = os.path.join(os.path.abspath(args.directory), "bench_convert")
    _rm(work)
    os.makedirs(work)
    try:
        state = make_state(args.tensors)
        nbytes = sum(t.nbytes for t in state["model"].values())
        src, dcp_src, hf_src, out = (os.path.join(work, n) for n in ("src", "dcp_src", "hf_src", "out"))
        distckpt.save(state, src, no_dist=True)
        dcp.save(state, checkpoint_id=dcp_src, no_dist=True)
        write_hf(state["model"], hf_src)
        del state
        print(f"state: {args.tensors} float32 tensors, {format_bytes(nbytes)}; convert --memory-limit "
              f"{format_bytes(limit)}; median of {args.repeat} (min..max), page cache warm; torch "
              f"{torch.__version__}, {os.cpu_count()} CPUs")
        print(f"{'target':<16} {'convert s':>18}  {'reference':<24} {'reference s':>18}  {'ratio':>6}")
        for target, (mine, refs) in routes(src, dcp_src, hf_src, out, limit).items():
            if args.only and target not in args.only.split(","):
                continue
            times: dict[str, list[float]] = {"convert": [], **{name: [] for name, _ in refs}}
            order = [("convert", mine), *refs]
            for r in range(args.repeat):
                for name, fn in (order if r % 2 == 0 else order[::-1]):
                    for warm in (src, dcp_src, hf_src):
                        _warm(warm)
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
                    _rm(out)

            def show(ts):
                return f"{statistics.median(ts):.3f} ({min(ts):.3f}..{max(ts):.3f})"

            mine_m = statistics.median(times["convert"])
            for i, (name, _) in enumerate(refs):
                ratio = mine_m / statistics.median(times[name])
                print(f"{target if i == 0 else '':<16} {show(times['convert']) if i == 0 else '':>18}  {name:<24} "
                      f"{show(times[name]):>18}  {ratio:>5.2f}x")
    finally:
        _rm(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
