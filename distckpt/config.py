"""Every DISTCKPT_* environment variable, read once into a frozen dataclass.

A bad value raises :class:`distckpt.errors.ConfigError` naming the variable, the value and what is
allowed; nothing silently falls back to a default. Sizes take binary units (distckpt.sizes):
``DISTCKPT_BLOCK_SIZE=8M`` is 8 MiB; a plain byte count works too.

A DISTCKPT_* variable that distckpt does not know (a typo such as DISTCKPT_IO_BAKCEND) is warned
about once per process, naming the closest known variable: a silently ignored setting is a bug.

| variable                    | default  | meaning                                                   |
|-----------------------------|----------|-----------------------------------------------------------|
| DISTCKPT_IO_BACKEND         | auto     | auto, uring, pwrite or buffered (see distckpt.storage.posix)          |
| DISTCKPT_READ_CACHE         | auto     | loads: auto (uncached pages of a data file that fits the  |
|                             |          | page cache are read through it), cache, or direct         |
|                             |          | (O_DIRECT; storage/posix/readcache.py)                    |
| DISTCKPT_QUEUE_DEPTH        | 8        | writes/reads kept in flight per file                      |
| DISTCKPT_BLOCK_SIZE         | 4M       | bytes per O_DIRECT request (reads; zero-copy writes)       |
| DISTCKPT_STAGE_BLOCK        | 2M       | bytes per block of a writer's staging ring (one staged     |
|                             |          | write); at most DISTCKPT_BLOCK_SIZE                        |
| DISTCKPT_STAGE_BLOCKS       | 4        | blocks in a writer's staging ring (2 .. QUEUE_DEPTH + 1);  |
|                             |          | the ring (here 8 MiB) is all the memory a save adds        |
| DISTCKPT_ZERO_COPY_MIN      | 8M       | sources at least this large are written from their own     |
|                             |          | memory, smaller ones through the ring (default: one        |
|                             |          | zero-copy request, 2 x BLOCK_SIZE; at least BLOCK_SIZE)    |
| DISTCKPT_CHECKSUM_BLOCK     | 1M       | largest checksummed block; a save picks a smaller one (>= |
|                             |          | 16 KiB) when its chunks are small (plan.choose_checksum_block)|
| DISTCKPT_TIMEOUT_S          | 300      | bound on any control-plane collective (dead peer detection)|
| DISTCKPT_IO_TIMEOUT_S       | 300      | bound on the wait for any one O_DIRECT read or write of    |
|                             |          | the C core: a request the kernel never completes fails as  |
|                             |          | StorageIOError (ETIMEDOUT) instead of hanging the rank     |
| DISTCKPT_DRAIN_TIMEOUT_S    | 3600     | bound on a collective of a tiered manager's drain (its     |
|                             |          | "drain" channel: a rank with less to upload waits there    |
|                             |          | for the slowest rank's upload; docs/TIERS.md)              |
| DISTCKPT_PREFLIGHT          | 1        | 1: save() runs the cheap pre-flight checks; 0: skip them   |
| DISTCKPT_ARRIVAL_TIMEOUT_S  | 60       | how long the ranks that called save/load wait for the rest (0: no check) |
|                             |          | before RanksMissingError (a call made on some ranks only)  |
| DISTCKPT_STAGING_POOL_BYTES | (none)   | idle + reserved async staging memory kept for reuse; 0:    |
|                             |          | keep and reserve none (none: up to 2x the last save's)     |
| DISTCKPT_DEVICE_STAGING     | 64M      | pinned host memory a sync save of GPU tensors streams them |
|                             |          | through (2 slots; copies overlap writes: staging/ring.py)  |

Object stores (read by distckpt.storage.object.store at each save):

| DISTCKPT_OBJECT_PART_SIZE       | 16M | multipart upload part size (>= 5 MiB; raised so a shard needs <= 10000 parts) |
| DISTCKPT_OBJECT_PARTS_IN_FLIGHT | 4   | parts uploading at once per rank (memory: one more part being filled)         |
| DISTCKPT_OBJECT_LEASE_S         | 30  | a save lease not renewed for this long belongs to a dead save                 |
| DISTCKPT_OBJECT_CONDITIONAL     | 1   | 1: MANIFEST by conditional create (If-None-Match: *); 0: HEAD + PUT + read-back |
| DISTCKPT_OBJECT_REQUEST_TIMEOUT_S | 30 | distckpt's own deadline of one object-store request (plus its body at the rate below) |
| DISTCKPT_OBJECT_MIN_RATE        | 4M  | bytes/s a request body must at least move at before its deadline (objrequest)  |
| DISTCKPT_OBJECT_LATE_S          | 900 | how late a request given up on may still land: a failed commit's data is kept that long |
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import threading
import warnings

from .errors import ConfigError
from .sizes import CONVENTION, format_bytes, parse_size

__all__ = ["Config", "get_config", "BACKENDS", "KNOWN_VARIABLES"]

BACKENDS = ("auto", "uring", "pwrite", "buffered")
READ_CACHE_MODES = ("auto", "cache", "direct")
READ_ONCE_MODES = ("auto", "on", "off")

#: Every DISTCKPT_* name distckpt or its scripts read. A variable is added here together with the
#: code that reads it; anything else with the prefix is reported as a probable typo.
KNOWN_VARIABLES = (
    # the library (this module)
    "DISTCKPT_IO_BACKEND", "DISTCKPT_READ_CACHE", "DISTCKPT_READ_ONCE", "DISTCKPT_QUEUE_DEPTH", "DISTCKPT_BLOCK_SIZE", "DISTCKPT_CHECKSUM_BLOCK",
    "DISTCKPT_TIMEOUT_S", "DISTCKPT_IO_TIMEOUT_S", "DISTCKPT_DRAIN_TIMEOUT_S", "DISTCKPT_PREFLIGHT", "DISTCKPT_ARRIVAL_TIMEOUT_S", "DISTCKPT_STAGING_POOL_BYTES",
    "DISTCKPT_STAGE_BLOCK", "DISTCKPT_STAGE_BLOCKS", "DISTCKPT_DEVICE_STAGING", "DISTCKPT_ZERO_COPY_MIN",
    # object stores (distckpt.storage.object.settings)
    "DISTCKPT_OBJECT_PART_SIZE", "DISTCKPT_OBJECT_PARTS_IN_FLIGHT", "DISTCKPT_OBJECT_LEASE_S",
    "DISTCKPT_OBJECT_CONDITIONAL", "DISTCKPT_OBJECT_REQUEST_TIMEOUT_S", "DISTCKPT_OBJECT_MIN_RATE",
    "DISTCKPT_OBJECT_LATE_S",
    # launch/env.sh (where the venv goes) and the tests (crash sweeps, the S3 server's switches)
    "DISTCKPT_VENV", "DISTCKPT_ROOT", "DISTCKPT_CRASH_SEED", "DISTCKPT_CRASH_KILLS",
    "DISTCKPT_TEST_S3_IGNORE_IF_NONE_MATCH",
)


@dataclasses.dataclass(frozen=True)
class Config:
    io_backend: str = "auto"
    read_cache: str = "auto"
    read_once: str = "auto"
    queue_depth: int = 8
    block_size: int = 4 << 20
    stage_block: int = 2 << 20
    stage_blocks: int = 4
    zero_copy_min: int = 8 << 20
    checksum_block: int = 1 << 20
    timeout_s: float = 300.0
    io_timeout_s: float = 300.0
    drain_timeout_s: float = 3600.0
    preflight: bool = True
    arrival_timeout_s: float = 60.0
    staging_pool_bytes: int | None = None
    device_staging: int = 64 << 20


def _int(env: dict, name: str, default: int, *, lo: int, hi: int, power_of_two: bool = False) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw, 0)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer", variable=name) from None
    if not lo <= value <= hi or (power_of_two and value & (value - 1)):
        kind = "a power of two " if power_of_two else ""
        raise ConfigError(f"{name}={value} must be {kind}between {lo} and {hi}", variable=name)
    return value


def _seconds(env: dict, name: str, default: float, *, lo: float, hi: float = 86400,
             zero: str | None = None) -> float:
    """A duration variable in seconds, between lo and hi (NaN and infinities refused); ``zero``:
    what 0 means when 0 is allowed too (None: it is not)."""
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number", variable=name) from None
    if zero is not None and value == 0:
        return value
    if not lo <= value <= hi:
        allowed = f"0 ({zero}) or between {lo:g} and {hi:g}" if zero is not None else f"between {lo:g} and {hi:g}"
        raise ConfigError(f"{name}={value} must be {allowed}", variable=name)
    return value


def _size(env: dict, name: str, default: int, *, lo: int, hi: int) -> int:
    """A size variable: ``4M``, ``4MiB`` or ``4194304`` (binary units), a power of two in [lo, hi]."""
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = parse_size(raw)
    except ValueError as exc:
        raise ConfigError(f"{name}={raw!r}: {exc}", variable=name) from None
    if not lo <= value <= hi or value & (value - 1):
        raise ConfigError(f"{name}={raw!r} ({value} bytes) must be a power of two between "
                          f"{format_bytes(lo)} and {format_bytes(hi)} ({CONVENTION})", variable=name)
    return value


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_unknown_variables(env: dict | None = None) -> list[str]:
    """Warn (once per process and name) about DISTCKPT_* variables no code reads.

    Returns the unknown names found this time (warned or not). The warning names the closest
    known variable (difflib), so a typo like DISTCKPT_BLOCKSIZE points at DISTCKPT_BLOCK_SIZE.
    """
    env = os.environ if env is None else env
    unknown = sorted(k for k in env if k.startswith("DISTCKPT_") and k not in KNOWN_VARIABLES)
    for name in unknown:
        with _warned_lock:
            if name in _warned:
                continue
            _warned.add(name)
        close = difflib.get_close_matches(name, KNOWN_VARIABLES, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(KNOWN_VARIABLES[:6])}"
        warnings.warn(f"{name} is set but distckpt does not read it ({hint}); it has no effect",
                      UserWarning, stacklevel=3)
    return unknown


def load_config(env: dict | None = None) -> Config:
    """Parse a Config from ``env`` (default: os.environ). Raises ConfigError on a bad value."""
    env = dict(os.environ if env is None else env)
    warn_unknown_variables(env)
    backend = env.get("DISTCKPT_IO_BACKEND", "auto") or "auto"
    if backend not in BACKENDS:
        raise ConfigError(
            f"DISTCKPT_IO_BACKEND={backend!r} is not one of {', '.join(BACKENDS)}",
            variable="DISTCKPT_IO_BACKEND",
        )
    read_cache = env.get("DISTCKPT_READ_CACHE", "auto") or "auto"
    if read_cache not in READ_CACHE_MODES:
        raise ConfigError(f"DISTCKPT_READ_CACHE={read_cache!r} is not one of {', '.join(READ_CACHE_MODES)}",
                          variable="DISTCKPT_READ_CACHE")
    read_once = env.get("DISTCKPT_READ_ONCE", "auto") or "auto"
    if read_once not in READ_ONCE_MODES:
        raise ConfigError(f"DISTCKPT_READ_ONCE={read_once!r} is not one of {', '.join(READ_ONCE_MODES)}",
                          variable="DISTCKPT_READ_ONCE")
    preflight_raw = env.get("DISTCKPT_PREFLIGHT", "1")
    if preflight_raw not in ("0", "1"):
        raise ConfigError(f"DISTCKPT_PREFLIGHT={preflight_raw!r} must be 0 or 1", variable="DISTCKPT_PREFLIGHT")
    timeout = _seconds(env, "DISTCKPT_TIMEOUT_S", 300.0, lo=1)
    io_timeout = _seconds(env, "DISTCKPT_IO_TIMEOUT_S", 300.0, lo=0.1)
    drain_timeout = _seconds(env, "DISTCKPT_DRAIN_TIMEOUT_S", 3600.0, lo=1)
    arrival = _seconds(env, "DISTCKPT_ARRIVAL_TIMEOUT_S", 60.0, lo=0.1, zero="no arrival check")
    pool_raw = env.get("DISTCKPT_STAGING_POOL_BYTES", "")
    pool = None if pool_raw == "" else _int(env, "DISTCKPT_STAGING_POOL_BYTES", 0, lo=0, hi=1 << 50)
    queue_depth = _int(env, "DISTCKPT_QUEUE_DEPTH", 8, lo=1, hi=256)
    block_size = _size(env, "DISTCKPT_BLOCK_SIZE", 4 << 20, lo=64 << 10, hi=256 << 20)
    # Defaults follow a smaller DISTCKPT_BLOCK_SIZE / QUEUE_DEPTH; explicit values must fit them.
    stage_block = _size(env, "DISTCKPT_STAGE_BLOCK", min(2 << 20, block_size), lo=64 << 10, hi=block_size)
    stage_blocks = _int(env, "DISTCKPT_STAGE_BLOCKS", min(4, queue_depth + 1), lo=2, hi=queue_depth + 1)
    # Zero-copy from one request (the writer's requests are twice the block size): a save's
    # zero-copy writes stay in flight from one tensor to the next (write_checksummed's hold), so a
    # source of one request no longer drains the disk queue and skips the staging memcpy
    # (docs/BENCHMARKS.md, "Zero-copy writes in flight across tensors").
    zero_copy_min = _size(env, "DISTCKPT_ZERO_COPY_MIN", 2 * block_size, lo=block_size, hi=1 << 40)
    return Config(
        io_backend=backend,
        read_cache=read_cache,
        read_once=read_once,
        queue_depth=queue_depth,
        block_size=block_size,
        stage_block=stage_block,
        stage_blocks=stage_blocks,
        zero_copy_min=zero_copy_min,
        checksum_block=_size(env, "DISTCKPT_CHECKSUM_BLOCK", 1 << 20, lo=4 << 10, hi=1 << 30),
        timeout_s=timeout,
        io_timeout_s=io_timeout,
        drain_timeout_s=drain_timeout,
        preflight=preflight_raw == "1",
        arrival_timeout_s=arrival,
        staging_pool_bytes=pool,
        device_staging=_size(env, "DISTCKPT_DEVICE_STAGING", 64 << 20, lo=256 << 10, hi=1 << 40),
    )


@functools.lru_cache(maxsize=1)
def get_config() -> Config:
    """The process-wide Config, read from the environment on first use."""
    return load_config()
