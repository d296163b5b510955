"""Cold-load profile: one rank, distckpt.load vs fio's O_DIRECT read of the same files.

    .venv/bin/python launch/bench/bench_cold.py DIR [--size 512M] [--small 1000] [--repeat 7]
                                          [--baseline-fill OLD_FILL.py] [--baseline-repo OLD_CHECKOUT]

Saves one checkpoint into DIR (the state of launch/bench/bench_load.py's ``1 -> 1`` case), then, for
``--repeat`` repetitions, interleaved with the order rotated: fio reads its data files with
O_DIRECT (io_uring, 4 MiB blocks, iodepth 8) and distckpt.load fills the state, verification on;
each after ``sync; echo 3 > /proc/sys/vm/drop_caches``. ``--baseline-fill`` also times the same
load with another version of ``distckpt/fill.py`` (e.g. ``git show REV:distckpt/fill.py >
old_fill.py``), side by side in the same run. ``--baseline-repo`` times the same load with a whole
other checkout of the repository (e.g. ``git worktree add --detach OLD REV`` with its C extension
built), in a child process started once and driven between the other rows.

Per load it prints where the time went: reading + checking MANIFEST, planning, the fill (reads,
checksums, copies), and the CPU the fill's threads used against the time they were runnable
but waiting for a core (``/proc/self/task/*/schedstat``, sampled every 5 ms: approximate). On a
machine whose cores are busy with other work the second number says how much of the gap to fio
is waiting for a CPU. Needs root (drop_caches) and fio (``apt-get install -y fio``). Removes what
it created under DIR.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# The --baseline-repo child imports distckpt from the other checkout.
sys.path.insert(1, os.environ.get("BENCH_COLD_REPO") or os.path.dirname(os.path.dirname(HERE)))

from bench import BaselineChild, drop_caches, make_state, parse_size, ready  # noqa: E402


def _fio(files: list[str]) -> float:
    drop_caches()
    cmd = ["fio", "--name=load", "--rw=read", "--direct=1", "--ioengine=io_uring", "--bs=4M", "--iodepth=8",
           "--filename=" + ":".join(f.replace(":", "\\:") for f in files), "--output-format=json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out[out.index("{"):])["jobs"][0]["read"]["runtime"] / 1000.0


def _schedstat() -> dict[str, tuple[int, int]]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, wait, _ = map(int, f.read().split())
        except (OSError, ValueError):
            continue
        out[tid] = (run, wait)
    return out


class _Phases:
    """Wall time of restore's phases and the CPU run/wait of every thread during one load."""

    # Where each phase is, newest layout first: a load asks the load source for
    # manifest_for_boxes since format 4 (before it, for manifest; the first version of this
    # bench timed only that one, and a load entered neither); restore fills through
    # fill.fill_parts since the storage-seam redesign; a --baseline-repo checkout from before it
    # has restore.load_manifest and restore._fill. The first place found is timed.
    PHASES = {"manifest": [("distckpt.source", "Source", "manifest_for_boxes"), ("distckpt.source", "Source", "manifest"),
                           ("distckpt.restore", None, "load_manifest")],
              "plan": [("distckpt.restore", None, "_plan_tasks")],
              "fill": [("distckpt.restore", None, "fill_parts"), ("distckpt.restore", None, "_fill")]}

    def __init__(self) -> None:
        import importlib
        self.t: dict[str, float] = {}
        for key, places in self.PHASES.items():
            for module, cls, name in places:
                try:
                    owner = importlib.import_module(module)
                except ImportError:
                    continue
                owner = getattr(owner, cls) if cls else owner
                if hasattr(owner, name):
                    setattr(owner, name, self._timed(getattr(owner, name), key))
                    break
            else:
                raise RuntimeError(f"bench_cold: no {key} phase to time in this checkout ({places})")

    def _timed(self, fn, key):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[key] = self.t.get(key, 0.0) + time.perf_counter() - t0
        return run

    def load(self, fn) -> dict:
        self.t = {}
        seen: dict[str, tuple[int, int]] = {}
        first = _schedstat()
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                seen.update(_schedstat())
                time.sleep(0.005)

        sampler = threading.Thread(target=sample)
        sampler.start()
        t0 = time.perf_counter()
        try:
            fn()
        finally:
            wall = time.perf_counter() - t0
            stop.set()
            sampler.join()
        seen.update(_schedstat())
        me = str(threading.get_native_id()), str(sampler.native_id)
        run = sum(v[0] - first.get(k, (0, 0))[0] for k, v in seen.items() if k != me[1])
        wait = sum(v[1] - first.get(k, (0, 0))[1] for k, v in seen.items() if k != me[1])
        return {"s": wall, **self.t, "cpu_run": run / 1e9, "cpu_wait": wait / 1e9}


def _serve(path: str, size: int, small: int) -> None:
    """--serve: the --baseline-repo child. Loads ``path`` (cold) once per "load" line on stdin and
    answers one JSON line of timings."""
    import torch

    import distckpt
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    dst = make_state(size, small, 0, 1, zeros=True)
    distckpt.load(dst, path)  # warm-up: imports, backend probe
    phases = _Phases()
    ready()
    for line in sys.stdin:
        if line.strip() != "load":
            break
        drop_caches()
        print(json.dumps(phases.load(lambda: distckpt.load(dst, path))), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("directory")
    ap.add_argument("--size", default="512M")
    ap.add_argument("--small", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--baseline-fill", default=None, help="another distckpt/fill.py to time side by side")
    ap.add_argument("--baseline-repo", default=None, help="another checkout of the repository to time side by side")
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.serve:
        _serve(args.serve, parse_size(args.size), args.small)
        return 0

    import torch

    import distckpt
    import distckpt.fill as current
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    fills = {"distckpt cold": current}
    if args.baseline_fill:
        spec = importlib.util.spec_from_file_location("distckpt._baseline_fill", args.baseline_fill)
        other = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = other
        spec.loader.exec_module(other)
        fills[f"distckpt cold, {os.path.basename(args.baseline_fill)}"] = other
    work = os.path.join(os.path.abspath(args.directory), f"bench-cold-{os.getpid()}")
    os.makedirs(work)
    try:
        path = os.path.join(work, "ckpt")
        size = parse_size(args.size)
        distckpt.save(make_state(size, args.small, 0, 1), path)
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".bin"))
        nbytes = sum(os.path.getsize(f) for f in files)
        dst = make_state(size, args.small, 0, 1, zeros=True)
        distckpt.load(dst, path)  # warm-up: imports, backend probe
        phases = _Phases()
        rows: dict[str, list[dict]] = {"fio O_DIRECT read": []}
        loadavg = []
        names = ["fio O_DIRECT read"] + list(fills)
        baseline = None
        if args.baseline_repo:
            baseline = BaselineChild(__file__, "BENCH_COLD_REPO", args.baseline_repo,
                                     ["-", "--serve", path, "--size", args.size, "--small", str(args.small)])
            names.append(f"distckpt cold, {os.path.basename(os.path.normpath(args.baseline_repo))}")
        for rep in range(args.repeat):
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                if baseline is not None and name == names[-1]:
                    rows.setdefault(name, []).append(baseline.call("load"))
                elif name in fills:
                    sys.modules["distckpt.fill"] = fills[name]  # restore imports it at each load
                    try:
                        drop_caches()
                        rows.setdefault(name, []).append(phases.load(lambda: distckpt.load(dst, path)))
                    finally:
                        sys.modules["distckpt.fill"] = current
                else:
                    rows[name].append({"s": _fio(files)})
            with open("/proc/loadavg") as f:
                loadavg.append(float(f.read().split()[0]))
        if baseline is not None:
            baseline.close()
        fio_s = statistics.median(r["s"] for r in rows["fio O_DIRECT read"])
        print(f"cold load of {nbytes / 2**30:.2f} GiB ({len(files)} data file(s)), 1 rank, verify on, "
              f"{args.repeat} repetitions interleaved; load average {min(loadavg):.1f}..{max(loadavg):.1f}; "
              f"{os.cpu_count()} cores")
        print("| measurement | seconds, median (min..max) | MB/s | vs fio | manifest | plan | fill | fill vs fio "
              "| CPU used | CPU waited for |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        summary = {}
        for name, rs in rows.items():
            s = [r["s"] for r in rs]
            med = statistics.median(s)
            row = {"median": med, "min": min(s), "max": max(s)}
            cells = [f"{med:.3f} ({min(s):.3f}..{max(s):.3f})", f"{nbytes / med / 1e6:.0f}", f"{fio_s / med:.2f}x"]
            if name != "fio O_DIRECT read":
                for key in ("manifest", "plan", "fill", "cpu_run", "cpu_wait"):
                    row[key] = statistics.median(r[key] for r in rs)
                cells += [f"{row['manifest']:.3f}", f"{row['plan']:.3f}", f"{row['fill']:.3f}",
                          f"{fio_s / row['fill']:.2f}x", f"{row['cpu_run']:.3f}", f"{row['cpu_wait']:.3f}"]
            else:
                cells += [""] * 6
            summary[name] = row
            print(f"| {name} | " + " | ".join(cells) + " |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"bytes": nbytes, "loadavg": loadavg, "rows": summary, "raw": rows}, f, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
