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
    from .manager import CheckpointManager, step_dirname
    mgr = CheckpointManager(args.root)
    for step in mgr.steps():
        print(step_dirname(step))
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
    p = sub.add_parser("ls", help="list committed steps under a root")
    p.add_argument("root")
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
