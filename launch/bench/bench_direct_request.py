"""Zero-copy write request size: the O_DIRECT writer's requests straight from tensor memory.

A save writes a large CPU tensor (at least DISTCKPT_ZERO_COPY_MIN) from the tensor's own memory
in requests of a fixed size; smaller pieces go through the registered staging ring. This times
the C writer (``distckpt._uring.Writer``, ``write_checksummed`` as a save calls it, each source
placed as ``Writer.pad_for`` places it) writing launch/bench/bench.py's large tensors (``--size``
bytes in 8 float32 tensors, each starting 64 bytes past a page as torch's large tensors do) into
one new, preallocated, fsynced file in DIR, per request size, and through the staging ring alone.

The speed of zero-copy requests depends on the source memory's layout, which differs from one
process to the next, so every case runs in each of ``--processes`` fresh processes (cases
interleaved, ``--repeat`` times each); the table gives each process's median per case.

    python launch/bench/bench_direct_request.py DIR [--size 1G] [--processes 6] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(os.path.dirname(HERE)))

from bench import make_state, parse_size  # noqa: E402

MIB = 1 << 20
CASES = {"zero-copy 4 MiB": 4 * MIB, "zero-copy 8 MiB": 8 * MIB, "zero-copy 16 MiB": 16 * MIB,
         "staged 2 MiB x 4": None}


def one_process(directory: str, size: int, repeat: int) -> dict:
    import torch
    from distckpt import _uring
    from distckpt.storage.posix.probe import choose_backend
    sd = make_state(size, 0, 0, 1)
    bufs = [v.view(-1).view(torch.uint8).numpy() for v in sd.values()]
    total = sum(b.size for b in bufs)
    choice = choose_backend(directory)
    path = os.path.join(directory, "bench_direct_request.bin")

    def run(request: int | None) -> float:
        os.sync()
        t0 = time.perf_counter()
        w = _uring.Writer(path, block_size=request or 4 * MIB, queue_depth=8, offset_align=choice.offset_align,
                          mem_align=choice.mem_align, uring=choice.name == "uring", stage_block=2 * MIB,
                          stage_blocks=4, zero_copy_min=request or 1 << 40, fixed_buffers=True)
        try:
            w.reserve(total + len(bufs) * choice.offset_align + 4 * MIB)
            for b in bufs:
                # as Writer.pad_for places a large source: its first aligned byte on an aligned offset
                lead = (w.tell() - b.ctypes.data) % choice.mem_align
                if lead:
                    w.zeros(choice.mem_align - lead)
                w.write_checksummed(b, MIB)
            w.flush()
            w.fsync()
        finally:
            w.close()
            os.unlink(path)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {k: [] for k in CASES}
    for _ in range(repeat):
        for name, request in CASES.items():
            times[name].append(run(request))
    return {"bytes": total, "backend": choice.name, "median": {k: statistics.median(v) for k, v in times.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--size", type=parse_size, default=parse_size("1G"))
    ap.add_argument("--processes", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(one_process(args.dir, args.size, args.repeat)))
        return 0
    rows = []
    for _ in range(args.processes):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), args.dir, "--size", str(args.size),
                              "--repeat", str(args.repeat), "--child"], check=True, capture_output=True, text=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    nbytes = rows[0]["bytes"]
    print(f"{nbytes / 2**30:.2f} GiB in 8 tensors (64 B past a page), backend {rows[0]['backend']}, "
          f"{args.processes} processes x {args.repeat} runs per case, load average {os.getloadavg()[0]:.1f}")
    print(f"{'case':18} " + " ".join(f"{'proc ' + str(i):>8}" for i in range(len(rows))) + "   GB/s (each process's median)")
    for name in CASES:
        print(f"{name:18} " + " ".join(f"{nbytes / r['median'][name] / 1e9:>8.2f}" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
