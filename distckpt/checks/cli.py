"""``distckpt preflight PATH`` (and ``python -m distckpt.checks PATH``): the pre-flight checks from
the shell. Prints the report's table, or ``--json`` its dict with ``json_format``; exit status 1
when any check failed."""

from __future__ import annotations

import argparse
import json
from typing import Any

from .. import sizes
from ..clijson import JSON_FORMAT
from .run import preflight

__all__ = ["add_parser", "run_cli", "main"]

_DESCRIPTION = "Pre-flight checks: find a broken environment before a save writes its first byte."


def _size_arg(text: str) -> int:
    # One size convention for the whole package (distckpt.sizes): 60G = 60 GiB.
    try:
        return sizes.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="checkpoint directory (need not exist yet), or an object-store URL "
                                "(s3://bucket/prefix; credentials and endpoint from the AWS variables)")
    p.add_argument("--expected-bytes", type=_size_arg, default=None, metavar="SIZE",
                   help="bytes the save writes to that file system, e.g. 60G (= 60 GiB; "
                        f"{sizes.CONVENTION})")
    p.add_argument("--backend", default=None, help="torch.distributed backend: nccl, gloo, ...")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks the job will run (checked against the torchrun variables when set)")
    p.add_argument("--local-world-size", type=int, default=None,
                   help="ranks per node (sizes the /dev/shm and fd estimates)")
    p.add_argument("--shm-bytes", type=_size_arg, default=None, metavar="SIZE",
                   help="extra /dev/shm the job needs (DataLoader workers), e.g. 2G")
    p.add_argument("--keep-last", type=int, default=None,
                   help="CheckpointManager keep_last: warn when the steady state will not fit")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    """Run the checks for parsed CLI arguments, print the table (or JSON); 1 on any error, else 0."""
    report = preflight(args.path, expected_bytes=args.expected_bytes, backend=args.backend,
                       world_size=args.world_size, local_world_size=args.local_world_size,
                       shm_bytes_needed=args.shm_bytes, keep_last=args.keep_last)
    if args.json:
        print(json.dumps({"json_format": JSON_FORMAT, **report.to_dict()}, indent=2, default=str))
    else:
        print(report)
    return 0 if report.ok else 1


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``distckpt preflight PATH [--expected-bytes 10G] [--backend nccl|gloo] [--json]``.

    ``subparsers`` is what ``ArgumentParser.add_subparsers()`` returned. The handler is stored as
    ``args.func``; it returns the exit code (1 when any check failed).
    """
    p = subparsers.add_parser("preflight", help="check the environment, /dev/shm and disk before "
                              "a save", description=_DESCRIPTION)
    _configure(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m distckpt.checks PATH ...``: the same as ``distckpt preflight``; returns the exit
    status. Raises SystemExit on bad usage (argparse)."""
    parser = argparse.ArgumentParser(prog="distckpt preflight", description=_DESCRIPTION)
    _configure(parser)
    args = parser.parse_args(argv)
    return args.func(args)
