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

Cases (``--cases`` picks some by name): zero-copy in 4, 8 and 16 MiB requests, each tensor's writes
complete before the next tensor (as before a save passed ``hold``); "held": 8 MiB requests with
``hold``, the writes of one tensor in flight while the next is submitted (what a save does); the
staging ring alone; "reused 32 MiB": the same bytes written, zero-copy in 8 MiB requests, from one
32 MiB buffer written again and again (the memory fio writes from: its bs x iodepth buffer); and
"fio": fio's O_DIRECT io_uring write (4 MiB, iodepth 8, end_fsync) of the same byte count.
``--large N`` spreads ``--size`` over N tensors instead of 8 (``--large 48``: 21 MiB each).

    python launch/bench/bench_direct_request.py DIR [--size 1G] [--large 8] [--processes 6] [--repeat 2]
                                                [--cases "zero-copy 8 MiB,held,reused,fio"]
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

from bench import fio_write_seconds, make_state, parse_size  # noqa: E402

MIB = 1 << 20
# name -> (request size, or None: the staging ring alone; hold; source)
CASES = {"zero-copy 4 MiB": (4 * MIB, False, "state"), "zero-copy 8 MiB": (8 * MIB, False, "state"),
         "zero-copy 16 MiB": (16 * MIB, False, "state"), "held 8 MiB": (8 * MIB, True, "state"),
         "staged 2 MiB x 4": (None, False, "state"), "reused 32 MiB buffer": (8 * MIB, True, "reused"),
         "fio 4 MiB x 8": (None, False, "fio")}


def one_process(directory: str, size: int, large: int, repeat: int, cases: list[str]) -> dict:
    import mmap

    import torch
    from distckpt import _uring
    from distckpt.storage.posix.probe import choose_backend
    sd = make_state(size, 0, 0, 1, big=large)
    bufs = [v.view(-1).view(torch.uint8).numpy() for v in sd.values()]
    total = sum(b.size for b in bufs)
    reused = mmap.mmap(-1, 32 * MIB)
    reused[:] = bytes(bufs[0][:32 * MIB]) if bufs[0].size >= 32 * MIB else os.urandom(32 * MIB)
    choice = choose_backend(directory)
    path = os.path.join(directory, "bench_direct_request.bin")

    def run(case: str) -> float:
        request, hold, source = CASES[case]
        if source == "fio":
            return fio_write_seconds(directory, total, "dr")
        # "reused": exactly the state's byte count, the last pass over the buffer partial
        whole, rest = divmod(total, 32 * MIB)
        srcs = bufs if source == "state" else [reused] * whole + ([memoryview(reused)[:rest]] if rest else [])
        os.sync()
        t0 = time.perf_counter()
        w = _uring.Writer(path, block_size=request or 4 * MIB, queue_depth=8, offset_align=choice.offset_align,
                          mem_align=choice.mem_align, uring=choice.name == "uring", stage_block=2 * MIB,
                          stage_blocks=4, zero_copy_min=request or 1 << 40, fixed_buffers=True)
        try:
            w.reserve(total + len(srcs) * choice.offset_align + 4 * MIB)
            for b in srcs:
                # as Writer.pad_for places a large source: its first aligned byte on an aligned offset
                lead = (w.tell() - _uring.address(b)) % choice.mem_align
                if lead:
                    w.zeros(choice.mem_align - lead)
                w.write_checksummed(b, MIB, b if hold else None)
            w.flush()
            w.fsync()
        finally:
            w.close()
            took = time.perf_counter() - t0  # create, preallocate, write, fsync, close (not the unlink)
            os.unlink(path)
        return took

    times: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(repeat):
        for name in cases[r % len(cases):] + cases[:r % len(cases)]:
            times[name].append(run(name))
    return {"bytes": total, "backend": choice.name, "median": {k: statistics.median(v) for k, v in times.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--size", type=parse_size, default=parse_size("1G"))
    ap.add_argument("--large", type=int, default=8, help="tensors sharing --size")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated case names (or unique prefixes)")
    ap.add_argument("--processes", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cases = []
    for want in filter(None, (c.strip() for c in args.cases.split(","))):
        match = [c for c in CASES if c == want] or [c for c in CASES if c.startswith(want)]
        if len(match) != 1:
            ap.error(f"--cases: {want!r} matches {match or 'nothing'}; cases: {', '.join(CASES)}")
        cases.append(match[0])
    if args.child:
        print(json.dumps(one_process(args.dir, args.size, args.large, args.repeat, cases)))
        return 0
    rows = []
    for _ in range(args.processes):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), args.dir, "--size", str(args.size),
                              "--large", str(args.large), "--repeat", str(args.repeat), "--cases", ",".join(cases),
                              "--child"], check=True, capture_output=True, text=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    nbytes = rows[0]["bytes"]
    print(f"{nbytes / 2**30:.2f} GiB in {args.large} tensors (64 B past a page), backend {rows[0]['backend']}, "
          f"{args.processes} processes x {args.repeat} runs per case, load average {os.getloadavg()[0]:.1f}")
    width = max(len(c) for c in cases)
    print(f"{'case':{width}} " + " ".join(f"{'proc ' + str(i):>8}" for i in range(len(rows)))
          + f" {'median':>8}   GB/s (each process's median; median of those)")
    for name in cases:
        speeds = [nbytes / r["median"][name] / 1e9 for r in rows]
        print(f"{name:{width}} " + " ".join(f"{v:>8.2f}" for v in speeds) + f" {statistics.median(speeds):>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
