"""Benchmarks: ``distckpt bench DIR`` (also ``python -m distckpt.bench DIR``).

The I/O benchmark writes the same number of bytes through every distckpt.storage.posix backend, in the same
directory and the same run, and compares each with the raw O_DIRECT sequential-write baseline of
this device: fio (io_uring, O_DIRECT, 4 MiB blocks, iodepth 8, end_fsync) when installed, else the
project's own plain O_DIRECT pwrite loop. Timings include open, every write, the fsync and close:
what a save pays. Repetitions are interleaved, the order rotated every repetition, so that drift
of a shared virtual disk hits every backend alike; the median is reported.

Invariants: every file the benchmark creates is removed, also on failure; nothing outside DIR is
written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import time

from .errors import ConfigError
from .sizes import format_bytes
from .sizes import parse_size as _parse_size

__all__ = ["add_parser", "run_io_bench", "parse_size", "main"]

ZERO_COPY = "uring (aligned src, zero-copy)"


def parse_size(text: str) -> int:
    """Parse ``1G``, ``512M``, ``4096`` (binary units: distckpt.sizes) into bytes > 0. Raises ValueError."""
    value = _parse_size(text)
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return value


@contextlib.contextmanager
def _env(**overrides: int | None):
    """Run with DISTCKPT_* variables overridden (None: left as it is); the config is read from the
    environment, so its cache is cleared on the way in and out."""
    from .config import get_config

    overrides = {f"DISTCKPT_{k.upper()}": str(v) for k, v in overrides.items() if v}
    saved = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    get_config.cache_clear()
    try:
        yield get_config()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        get_config.cache_clear()


def _tuned(block_size: int | None, queue_depth: int | None):
    """DISTCKPT_BLOCK_SIZE / DISTCKPT_QUEUE_DEPTH overridden (see :func:`_env`)."""
    return _env(block_size=block_size, queue_depth=queue_depth)


def _ring(ring: tuple[int, int] | None):
    """A writer's staging ring overridden: DISTCKPT_STAGE_BLOCK / DISTCKPT_STAGE_BLOCKS."""
    return _env(stage_block=ring[0] if ring else None, stage_blocks=ring[1] if ring else None)


def _ring_label(block: int, count: int) -> str:
    return f"uring staged, ring {count} x {format_bytes(block)}"


def _sources(size_bytes: int) -> tuple[memoryview, memoryview]:
    """(unaligned, page-aligned) views of the same incompressible bytes, at most 64 MiB.

    The unaligned one (offset 1, like arbitrary tensor memory) forces the staging copy; the
    page-aligned one lets the O_DIRECT backends write straight from it (zero-copy path)."""
    n = min(size_bytes, 64 << 20)
    aligned = mmap.mmap(-1, n + 4096)
    aligned.write(os.urandom(1 << 20) * (n >> 20) + os.urandom(n & ((1 << 20) - 1)))
    unaligned = bytearray(1) + aligned[:n]
    return memoryview(unaligned)[1:], memoryview(aligned)[:n]


def _write_backend(directory: str, name: str, size_bytes: int, src: memoryview, size_hint: int | None) -> float:
    from .storage import posix as dio

    choice = dio.choose_backend(directory, backend=name)
    path = os.path.join(directory, f".bench-{name}-{os.getpid()}.bin")
    try:
        t0 = time.perf_counter()
        with dio.open_writer(path, choice=choice, durable=True, size_hint=size_hint) as w:
            left = size_bytes
            while left:
                n = min(left, len(src))
                w.write(src[:n])
                left -= n
        return time.perf_counter() - t0
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _baseline_fio(directory: str, size_bytes: int, block_size: int, queue_depth: int) -> tuple[float, str]:
    path = os.path.join(directory, f".bench-fio-{os.getpid()}.dat")
    cmd = ["fio", "--name=w", "--rw=write", "--direct=1", "--ioengine=io_uring", f"--bs={block_size}",
           f"--iodepth={queue_depth}", f"--size={size_bytes}", "--end_fsync=1", f"--filename={path}",
           "--output-format=json"]
    try:
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    job = json.loads(out[out.index("{"):])["jobs"][0]
    # fio's own figure (bytes / job runtime), the number people quote for this device.
    return size_bytes / job["write"]["bw_bytes"], " ".join(cmd[:-2] + [f"--filename={directory}/..."])


def _baseline_loop(directory: str, size_bytes: int, block_size: int) -> tuple[float, str]:
    """Plain O_DIRECT pwrite loop from one page-aligned buffer, then fsync: no copies, no queue."""
    path = os.path.join(directory, f".bench-loop-{os.getpid()}.dat")
    buf = mmap.mmap(-1, block_size)
    buf.write(os.urandom(block_size))
    try:
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_CLOEXEC, 0o600)
        try:
            off = 0
            while off < size_bytes:  # size rounded up to whole blocks: alignment
                off += os.pwrite(fd, buf, off)
            os.fsync(fd)
        finally:
            os.close(fd)
        return time.perf_counter() - t0, "python O_DIRECT pwrite loop, 4 MiB blocks, fsync (fio not used)"
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def run_io_bench(
    directory: str | os.PathLike,
    size_bytes: int = 1 << 30,
    *,
    repeat: int = 5,
    backends: tuple[str, ...] = ("uring", "pwrite", "buffered"),
    baseline: str = "auto",
    block_size: int | None = None,
    queue_depth: int | None = None,
    size_hint: bool = True,
    rings: tuple[tuple[int, int], ...] = (),
    out=sys.stdout,
) -> dict:
    """Write ``size_bytes`` through each backend ``repeat`` times and print one comparison table.

    Args:
        directory: Existing directory on the file system to measure (files are removed after).
        size_bytes: Bytes per file (default 1 GiB).
        repeat: Repetitions per backend; the median is reported.
        backends: Which distckpt.storage.posix backends to run.
        baseline: "fio", "loop" or "auto" (fio when installed).
        block_size, queue_depth: Override DISTCKPT_BLOCK_SIZE / DISTCKPT_QUEUE_DEPTH for the run.
        size_hint: Pass the file size to open_writer (one fallocate up front, as a save does);
            False measures the step-wise preallocation used when the size is unknown.
        rings: extra staged uring rows, one per (stage block bytes, block count): the same
            unaligned source through that staging ring (DISTCKPT_STAGE_BLOCK / _BLOCKS), to
            compare ring sizes in one run.

    Returns:
        {"rows": {name: {"median_mbps", "min_mbps", "max_mbps", "ratio", "seconds": [...]}},
         "baseline": name, "baseline_command": str, "size_bytes": int}.

    Raises:
        ConfigError: ``directory`` does not exist or is not a directory.
        IOBackendUnavailableError: a requested backend cannot run here.
        StorageError subclass: the directory cannot be written.
    """
    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(directory):  # before any write: ENOENT is a wrong argument, not a sick disk
        what = "does not exist" if not os.path.lexists(directory) else "is not a directory"
        raise ConfigError(f"bench directory {directory} {what}", path=directory,
                          remedy="Pass an existing directory on the file system to measure (its test files are "
                                 "written there and removed after).")
    use_fio = baseline == "fio" or (baseline == "auto" and shutil.which("fio") is not None)
    base_name = "fio O_DIRECT io_uring" if use_fio else "O_DIRECT pwrite loop"
    src, src_aligned = _sources(size_bytes)
    hint = size_bytes if size_hint else None
    times: dict[str, list[float]] = {}
    for b in backends:
        times[b] = []
        if b == "uring":
            times[ZERO_COPY] = []
    for ring in rings:
        times[_ring_label(*ring)] = []
    times[base_name] = []
    base_cmd = ""
    with _tuned(block_size, queue_depth) as cfg:
        runs = []
        for b in backends:
            runs.append((b, src, None))
            if b == "uring":
                runs.append((ZERO_COPY, src_aligned, None))
        runs += [(_ring_label(*ring), src, ring) for ring in rings]
        runs.append((base_name, None, None))
        for rep in range(repeat):
            # Rotate the order every repetition: each measurement sits once in every position, so
            # what the previous one left behind (writeback, freed extents) hits all alike.
            k = rep % len(runs)
            for name, source, ring in runs[k:] + runs[:k]:
                if name == base_name:
                    if use_fio:
                        t, base_cmd = _baseline_fio(directory, size_bytes, cfg.block_size, cfg.queue_depth)
                    else:
                        t, base_cmd = _baseline_loop(directory, size_bytes, cfg.block_size)
                else:
                    backend = "uring" if name == ZERO_COPY or ring is not None else name
                    with _ring(ring):
                        t = _write_backend(directory, backend, size_bytes, source, hint)
                times[name].append(t)
        bs, qd, sb, sn = cfg.block_size, cfg.queue_depth, cfg.stage_block, cfg.stage_blocks
    rows = {}
    base_med = statistics.median(size_bytes / t / 1e6 for t in times[base_name])
    for name, ts in times.items():
        mbps = [size_bytes / t / 1e6 for t in ts]
        med = statistics.median(mbps)
        rows[name] = {"median_mbps": med, "min_mbps": min(mbps), "max_mbps": max(mbps),
                      "ratio": med / base_med, "seconds": ts}
    print(f"distckpt io bench: {format_bytes(size_bytes)} per file in {directory}, "
          f"block {format_bytes(bs)}, queue depth {qd}, staging ring {sn} x {format_bytes(sb)}, size hint {'on' if size_hint else 'off'}, "
          f"{repeat} repetitions (median)", file=out)
    print(f"| {'backend':<31} | {'median MB/s':>11} | {'min':>7} | {'max':>7} | {'vs baseline':>11} |", file=out)
    print(f"|{'-' * 33}|{'-' * 12}:|{'-' * 8}:|{'-' * 8}:|{'-' * 12}:|", file=out)
    for name, r in rows.items():
        label = {"buffered": "buffered (+fsync)", "uring": "uring (unaligned src, staged)"}.get(name, name)
        if name == base_name:
            label = f"baseline: {name}"
        print(f"| {label:<31} | {r['median_mbps']:>11.0f} | {r['min_mbps']:>7.0f} | {r['max_mbps']:>7.0f} | "
              f"{r['ratio'] * 100:>10.0f}% |", file=out)
    print(f"baseline command: {base_cmd}", file=out)
    return {"rows": rows, "baseline": base_name, "baseline_command": base_cmd, "size_bytes": size_bytes}


def _size_arg(text: str) -> int:
    """argparse ``type=`` of --size / --block-size: a positive size (argparse prints the reason)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parse_ring(text: str) -> tuple[int, int]:
    """argparse ``type=`` of --ring: ``BLOCKxCOUNT`` (``4Mx9``) as (block bytes, count)."""
    block, _, count = text.partition("x")
    if not count or not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected BLOCKxCOUNT with a count >= 1, e.g. 4Mx9")
    return _size_arg(block), int(count)


def _cmd_bench(args) -> int:
    run_io_bench(args.directory, args.size, repeat=args.repeat,
                 backends=tuple(args.backends.split(",")), baseline=args.baseline,
                 block_size=args.block_size, queue_depth=args.queue_depth, size_hint=not args.no_size_hint,
                 rings=tuple(args.ring))
    return 0


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", help="directory on the file system to measure")
    p.add_argument("--size", type=_size_arg, default="1G", help="bytes per file, e.g. 1G, 256M (default 1G)")
    p.add_argument("--repeat", type=int, default=5, help="repetitions, median reported (default 5)")
    p.add_argument("--backends", default="uring,pwrite,buffered", help="comma-separated backends")
    p.add_argument("--baseline", choices=("auto", "fio", "loop"), default="auto",
                   help="raw O_DIRECT reference: fio, a plain O_DIRECT loop, or auto (fio when installed)")
    p.add_argument("--block-size", type=_size_arg, default=None, help="override DISTCKPT_BLOCK_SIZE, e.g. 8M")
    p.add_argument("--queue-depth", type=int, default=None, help="override DISTCKPT_QUEUE_DEPTH")
    p.add_argument("--no-size-hint", action="store_true",
                   help="do not tell the writer the file size (step-wise preallocation)")
    p.add_argument("--ring", type=_parse_ring, action="append", default=[], metavar="BLOCKxCOUNT",
                   help="also time the staged uring path with this staging ring, e.g. 4Mx9 (repeatable)")
    p.set_defaults(func=_cmd_bench)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``bench`` subcommand on distckpt.cli's subparsers."""
    p = subparsers.add_parser("bench", help="I/O backend benchmark against the raw O_DIRECT baseline")
    _configure(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m distckpt.bench DIR --size 1G``."""
    p = argparse.ArgumentParser(prog="python -m distckpt.bench", description=__doc__.split("\n")[0])
    _configure(p)
    args = p.parse_args(argv)
    return _cmd_bench(args)


if __name__ == "__main__":
    raise SystemExit(main())
