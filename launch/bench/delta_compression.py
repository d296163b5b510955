"""Measure exact (lossless) compression of an incremental delta's rows and row ids.

    python launch/bench/delta_compression.py CKPT/step_00000150     # a delta link of a chain

Reads the link's ``_incr.*.rows`` and ``_incr.*.ids`` records (docs/INCREMENTAL.md, "Chain
format") in one process and prints, per codec, the compressed size as a fraction of the raw bytes
and the compression speed on one core: zlib (levels 1 and 6, the standard library) and zstd
(levels 1, 3, 9) when the ``zstandard`` package is installed; for the rows also after a byte
shuffle (the 4 bytes of every 32-bit word grouped by position, exact and reversible), which puts
the slowly varying sign/exponent bytes of float32 values together. Also times zstd-1
decompression of the shuffled rows. Nothing is written.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

from distckpt.restore import load_manifest, read_boxes  # noqa: E402


def _records(path: str, suffix: str) -> bytes:
    m = load_manifest(path)
    names = sorted(f for f in m.tensors if f.startswith("_incr.") and f.endswith(suffix))
    outs = read_boxes(path, m, [(f, (0,) * len(m.tensors[f].shape), tuple(m.tensors[f].shape)) for f in names])
    return b"".join(o.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for o in outs)


def _shuffle(data: bytes) -> bytes:
    words = torch.frombuffer(bytearray(data[:len(data) // 4 * 4]), dtype=torch.uint8).reshape(-1, 4)
    return words.t().contiguous().numpy().tobytes() + data[len(data) // 4 * 4:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="a delta link of an incremental chain")
    args = ap.parse_args()
    rows, ids = _records(args.path, ".rows"), _records(args.path, ".ids")
    if not rows:
        sys.exit(f"{args.path}: no delta records (not a delta link, or nothing changed)")
    codecs = [("zlib-1", lambda d: zlib.compress(d, 1)), ("zlib-6", lambda d: zlib.compress(d, 6))]
    try:
        import zstandard
    except ImportError:
        zstandard = None
        print("zstandard not installed: zlib only")
    if zstandard is not None:
        codecs += [(f"zstd-{lv}", lambda d, lv=lv: zstandard.ZstdCompressor(level=lv).compress(d)) for lv in (1, 3, 9)]
    print(f"rows {len(rows) / 2**20:.1f} MiB, ids {len(ids) / 2**20:.1f} MiB")
    for name, data in (("rows", rows), ("rows shuffled", _shuffle(rows)), ("ids", ids)):
        for cname, fn in codecs:
            t0 = time.perf_counter()
            out = fn(data)
            dt = time.perf_counter() - t0
            print(f"  {name:14s} {cname}: {len(out) / len(data):.3f} of the bytes, {len(data) / dt / 2**20:.0f} MiB/s")
    if zstandard is not None:
        packed = zstandard.ZstdCompressor(level=1).compress(_shuffle(rows))
        t0 = time.perf_counter()
        zstandard.ZstdDecompressor().decompress(packed)
        print(f"rows shuffled zstd-1: decompress {len(rows) / (time.perf_counter() - t0) / 2**20:.0f} MiB/s")


if __name__ == "__main__":
    main()
