"""Whole saves in fresh processes: checkouts and settings side by side, fio between them.

    .venv/bin/python launch/bench/bench_fresh.py DIR [--size 0.88G] [--small 2000] [--large 7]
        [--shape synthetic|llama] [--repo NAME=CHECKOUT ...] [--setting NAME=VAR=VALUE[,VAR=VALUE] ...]
        [--rounds 6] [--saves 5]

Why fresh processes: on the 2-vCPU VM the same save of the same state runs 10-20 % faster or
slower from one process to the next (where the state's pages happen to lie), so a before/after
in one process, or one process per side, measures the process as much as the code. Each round
starts one process per case (a checkout and a setting: ``--repo`` adds checkouts, the tree this
script is in is ``now``; ``--setting`` adds environment variables), in an order rotated every
round, plus fio's O_DIRECT io_uring write of the same bytes (4 MiB blocks, iodepth 8,
end_fsync). A process builds the state (launch/bench/bench.py's synthetic one, or ``llama``: an
FSDP2 ``get_state_dict`` of a small HF Llama with AdamW at one gloo rank), saves it ``--saves``
times (the first is a warm-up: imports, probes, the plan cache) and reports the median of the
others. The table gives the median over rounds of those medians, the range, each phase, and the
ratio to fio's median. A child that imports ``distckpt`` from anywhere but its checkout stops the
run (the check --baseline-repo lacked until 2026-11-29). Needs fio. Removes what it wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
NOW = os.path.dirname(os.path.dirname(HERE))


def _child(repo: str, directory: str, shape: str, size: str, small: int, large: int, saves: int) -> None:
    sys.path.insert(0, repo)  # before anything imports distckpt
    import distckpt
    if not os.path.realpath(distckpt.__file__).startswith(os.path.realpath(repo) + os.sep):
        raise SystemExit(f"distckpt imported from {distckpt.__file__}, not from {repo}")
    sys.path.insert(1, HERE)
    from bench import llama_fsdp_state, make_state, parse_size
    if shape == "llama":
        import torch.distributed as dist
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(20000 + os.getpid() % 20000))
        dist.init_process_group("gloo", rank=0, world_size=1)
        state = llama_fsdp_state(1, {"hidden": 768, "layers": 4, "inter": 2048, "vocab": 8000})
    else:
        state = make_state(parse_size(size), small, 0, 1, big=large)
    runs = []
    for i in range(saves):
        path = os.path.join(directory, f"fresh-{os.getpid()}-{i}")
        os.sync()
        t0 = time.perf_counter()
        result = distckpt.save(state, path)
        runs.append({"s": time.perf_counter() - t0, **result.phase_seconds, "bytes": result.total_bytes})
        shutil.rmtree(path)
    runs = runs[1:] or runs
    print(json.dumps({k: statistics.median(r[k] for r in runs) for k in runs[0]}), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("directory")
    ap.add_argument("--size", default="0.88G")
    ap.add_argument("--small", type=int, default=2000)
    ap.add_argument("--large", type=int, default=7)
    ap.add_argument("--shape", choices=("synthetic", "llama"), default="synthetic")
    ap.add_argument("--repo", action="append", default=[], help="NAME=CHECKOUT (its C extension built)")
    ap.add_argument("--setting", action="append", default=[], help="NAME=VAR=VALUE[,VAR=VALUE...] for this tree")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    directory = os.path.abspath(args.directory)
    if args.child:
        _child(args.child, directory, args.shape, args.size, args.small, args.large, args.saves)
        return 0
    sys.path.insert(0, HERE)  # the parent only; a child imports its own checkout first
    from bench import fio_write_seconds
    cases = [("now", NOW, {})]
    for spec in args.repo:
        name, _, repo = spec.partition("=")
        cases.append((name, os.path.abspath(repo), {}))
    for spec in args.setting:
        name, _, env = spec.partition("=")
        cases.append((name, NOW, dict(kv.split("=", 1) for kv in env.split(","))))
    names = [c[0] for c in cases] + ["fio"]
    rows: dict[str, list[dict]] = {n: [] for n in names}
    nbytes = None
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            if name == "fio":
                if nbytes is not None:
                    rows[name].append({"s": fio_write_seconds(directory, nbytes, "fresh")})
                continue
            _, repo, env = next(c for c in cases if c[0] == name)
            out = subprocess.run([sys.executable, os.path.abspath(__file__), directory, "--child", repo,
                                  "--shape", args.shape, "--size", args.size, "--small", str(args.small),
                                  "--large", str(args.large), "--saves", str(args.saves)],
                                 env=dict(os.environ, **env), check=True, capture_output=True, text=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            nbytes = nbytes or row["bytes"]
            rows[name].append(row)  # round 0 starts with a save, so fio knows its byte count
    fio = statistics.median(x["s"] for x in rows["fio"])
    print(f"whole saves of {nbytes / 2**30:.2f} GiB ({args.shape}), 1 rank, {args.rounds} rounds of fresh processes "
          f"({args.saves} saves each, the first a warm-up); load average {os.getloadavg()[0]:.1f}")
    print("| case | seconds, median (min..max) | vs fio | plan | write | commit |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in names:
        v = rows[name]
        med = statistics.median(x["s"] for x in v)
        phases = " | ".join(f"{statistics.median(x[p] for x in v):.4f}" if p in v[0] else ""
                            for p in ("plan", "write", "commit"))
        print(f"| {name} | {med:.3f} ({min(x['s'] for x in v):.3f}..{max(x['s'] for x in v):.3f}) | "
              f"{fio / med:.2f}x | {phases} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
