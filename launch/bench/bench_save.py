"""Save profile: one rank, distckpt.save vs fio's O_DIRECT write of the same bytes.

    .venv/bin/python launch/bench/bench_save.py DIR [--size 1G] [--small 2000] [--large 8] [--repeat 7]
                                          [--baseline-repo OLD_CHECKOUT]

The state is launch/bench/bench.py's (``--large`` float32 tensors, 8 by default, + ``--small``
tensors of 16 KiB; ``--large 32 --size 1G`` gives tensors of 32 MiB, a 7B model's matrices). For
``--repeat`` repetitions, interleaved with the order rotated: fio writes the same number of bytes
into DIR (io_uring, O_DIRECT, 4 MiB blocks, iodepth 8, end_fsync; its own runtime), and
distckpt.save writes a checkpoint into DIR (then removed). ``--baseline-repo`` also times the same
save with another checkout of the repository (e.g. ``git worktree add --detach OLD REV`` with its
C extension built), in a child process started once and driven between the other rows.

Per save it prints the wall time, SaveResult.phase_seconds (plan, prepare, write, commit) and the
CPU seconds the process used (getrusage: user + system, every thread), which other jobs on a
shared machine disturb much less than the wall time. Needs fio (``apt-get install -y fio``).
Removes what it created under DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# The --baseline-repo child imports distckpt from the other checkout.
sys.path.insert(1, os.environ.get("BENCH_SAVE_REPO") or os.path.dirname(os.path.dirname(HERE)))

from bench import BaselineChild, fio_write_seconds, make_state, parse_size, ready, state_bytes  # noqa: E402


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class _Saver:
    """distckpt.save of one state into fresh directories under ``directory``."""

    def __init__(self, directory: str, size: int, small: int, large: int) -> None:
        import torch

        import distckpt
        torch.set_num_threads(max(1, os.cpu_count() or 1))
        self.distckpt = distckpt
        self.state = make_state(size, small, 0, 1, big=large)
        self.directory = directory
        self.n = 0
        self.save()  # warm-up: imports, backend probe, first-touch of the writer's staging

    def save(self) -> dict:
        self.n += 1
        path = os.path.join(self.directory, f"ckpt-{os.getpid()}-{self.n}")
        os.sync()
        c0, t0 = _cpu(), time.perf_counter()
        try:
            r = self.distckpt.save(self.state, path)
            wall, cpu = time.perf_counter() - t0, _cpu() - c0
        finally:
            shutil.rmtree(path, ignore_errors=True)
        return {"s": wall, "cpu": cpu, **getattr(r, "phase_seconds", {})}


def _serve(directory: str, size: int, small: int, large: int) -> None:
    """--serve: the --baseline-repo child; one save per "save" line on stdin, one JSON line back."""
    saver = _Saver(directory, size, small, large)
    ready()
    for line in sys.stdin:
        if line.strip() != "save":
            break
        print(json.dumps(saver.save()), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("directory")
    ap.add_argument("--size", default="1G")
    ap.add_argument("--small", type=int, default=2000)
    ap.add_argument("--large", type=int, default=8, help="large tensors sharing --size")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--baseline-repo", default=None, help="another checkout of the repository to time side by side")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    size = parse_size(args.size)
    if args.serve:
        _serve(args.directory, size, args.small, args.large)
        return 0
    work = os.path.join(os.path.abspath(args.directory), f"bench-save-{os.getpid()}")
    os.makedirs(work)
    baseline = None
    try:
        nbytes = state_bytes(size, args.small, args.large)
        saver = _Saver(work, size, args.small, args.large)
        names = ["fio O_DIRECT write", "distckpt.save"]
        if args.baseline_repo:
            baseline = BaselineChild(__file__, "BENCH_SAVE_REPO", args.baseline_repo,
                                     [work, "--serve", "--size", args.size, "--small", str(args.small),
                                      "--large", str(args.large)])
            names.append(f"distckpt.save, {os.path.basename(os.path.normpath(args.baseline_repo))}")
        rows: dict[str, list[dict]] = {n: [] for n in names}
        loadavg = []
        for rep in range(args.repeat):
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                if name == names[0]:
                    rows[name].append({"s": fio_write_seconds(work, nbytes, "save")})
                elif name == names[1]:
                    rows[name].append(saver.save())
                else:
                    rows[name].append(baseline.call("save"))
            with open("/proc/loadavg") as f:
                loadavg.append(float(f.read().split()[0]))
        fio_s = statistics.median(r["s"] for r in rows[names[0]])
        print(f"save of {nbytes / 2**30:.2f} GiB ({args.large} large + {args.small} small tensors), 1 rank, "
              f"{args.repeat} repetitions interleaved; load average {min(loadavg):.1f}..{max(loadavg):.1f}; "
              f"{os.cpu_count()} cores")
        print("| measurement | seconds, median (min..max) | MB/s | vs fio | plan | prepare | write | commit "
              "| CPU s | CPU s per GiB |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        summary = {}
        for name, rs in rows.items():
            s = [r["s"] for r in rs]
            med = statistics.median(s)
            row = {"median": med, "min": min(s), "max": max(s)}
            cells = [f"{med:.3f} ({min(s):.3f}..{max(s):.3f})", f"{nbytes / med / 1e6:.0f}", f"{fio_s / med:.2f}x"]
            if name != names[0]:
                for key in ("plan", "prepare", "write", "commit", "cpu"):
                    vals = [r[key] for r in rs if key in r]
                    row[key] = statistics.median(vals) if vals else float("nan")
                cells += [f"{row[k]:.3f}" for k in ("plan", "prepare", "write", "commit", "cpu")]
                cells.append(f"{row['cpu'] / (nbytes / 2**30):.3f}")
            else:
                cells += [""] * 6
            summary[name] = row
            print(f"| {name} | " + " | ".join(cells) + " |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"bytes": nbytes, "loadavg": loadavg, "rows": summary, "raw": rows}, f, indent=1)
    finally:
        if baseline is not None:
            baseline.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
