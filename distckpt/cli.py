"""The ``distckpt`` command line (also ``python -m distckpt``).

    distckpt ls ROOT            committed steps under a CheckpointManager root
    distckpt inspect PATH       a checkpoint's manifest summary (or --json for all of it)
    distckpt verify PATH        read every byte and check every checksum
    distckpt preflight PATH     the pre-flight checks (distckpt.preflight)
    distckpt bench DIR          I/O and save/load benchmarks (distckpt.bench)

Exit status: 0 on success, 1 when a check or verification failed, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from .errors import DistCkptError, format_bytes


def _cmd_ls(args) -> int:
    """Print :func:`distckpt.manager.list_root` (the library builds the listing; this only formats
    it). Never writes: no directory is created, nothing is reclaimed."""
    import time
    from .errors import CheckpointNotFoundError
    from .manager import list_root
    try:
        listing = list_root(args.root)
    except CheckpointNotFoundError as exc:
        print(f"distckpt ls: {exc.message}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(listing.to_dict(), indent=1, sort_keys=True))
        return 0

    def when(t):
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) if t is not None else "-"

    rows = [("STEP", "SIZE", "SAVED (UTC)", "RANKS", "LATEST", "STATUS")]
    for e in listing.entries:
        rows.append((str(e.step) if e.step is not None else e.name,
                     format_bytes(e.size_bytes) if e.size_bytes is not None else "-", when(e.created_unix),
                     str(e.ranks) if e.ranks is not None else "-", "latest" if e.is_latest else "",
                     e.status if e.problem is None else f"{e.status}: {e.problem}"))
    print(f"{listing.path} ({'checkpoint' if listing.kind == 'checkpoint' else 'checkpoint root'})")
    if len(rows) == 1:
        print("  no checkpoints")
    else:
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        for r in rows:
            print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    if listing.pointer_problem:
        print(f"  note: {listing.pointer_problem}")
    saves = [lo for lo in listing.leftovers if lo.kind != "lock" or lo.name == ""]
    if saves:
        print("saves in flight or left by crashed saves:")
        for lo in saves:
            o = lo.owner or {}
            who = (f"host {o.get('host', '?')} pid {o.get('pid', '?')}, started {when(o.get('started_unix'))}"
                   if o else "owner unknown")
            what = {"tmp": "save in progress", "del": "deletion", "lock": "save lock"}[lo.kind]
            verdict = {"alive": "ALIVE (in flight)", "dead": "dead (reclaimable)",
                       "unknown": "unknown (another host's; left alone)"}[lo.state]
            print(f"  {lo.entry}  {what}  {who}  {verdict}")
    return 0


def _cmd_inspect(args) -> int:
    from .restore import read_manifest
    m = read_manifest(args.path)
    if args.json:
        print(json.dumps(m, indent=1, default=lambda b: b.hex() if isinstance(b, bytes) else str(b)))
        return 0
    total = sum(f["size"] for f in m["files"])
    print(f"format v{m['format_version']}  save {m['save_id']}  world_size {m['world_size']}  "
          f"{len(m['files'])} files, {format_bytes(total)}")
    for fqn, t in m["tensors"].items():
        print(f"  {fqn}: {t['dtype']}{list(t['shape'])} in {len(t['chunks'])} chunk(s)")
    for fqn, o in m["objects"].items():
        print(f"  {fqn}: {o['kind']}")
    return 0


def _cmd_verify(args) -> int:
    from .restore import read
    read(args.path, allow_pickle=False if not args.allow_pickle else True)
    from .dcp import is_dcp_checkpoint
    if is_dcp_checkpoint(args.path):  # DCP writes no checksums: say what was checked, no more
        print(f"{args.path}: a torch.distributed.checkpoint; every byte range and value read (it has no checksums)")
        return 0
    print(f"{args.path}: every checksum matches")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distckpt", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ls", help="list the checkpoints under a root (or one checkpoint): step, size, date, "
                       "ranks, latest, broken entries, saves in flight; never writes")
    p.add_argument("root", help="a CheckpointManager root, a directory of checkpoints, or one checkpoint directory")
    p.add_argument("--json", action="store_true", help="print the listing as JSON (for scripts)")
    p.set_defaults(func=_cmd_ls)
    p = sub.add_parser("inspect", help="show a checkpoint's manifest")
    p.add_argument("path")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_inspect)
    p = sub.add_parser("verify", help="read everything and check every checksum")
    p.add_argument("path")
    p.add_argument("--allow-pickle", action="store_true")
    p.set_defaults(func=_cmd_verify)
    # importlib, not `from . import preflight`: the package attribute of that name is the function.
    for module in ("distckpt.preflight", "distckpt.bench", "distckpt.convert"):
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except DistCkptError as exc:
        print(f"distckpt: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
