"""Every DISTCKPT_* environment variable, read once into a frozen dataclass.

A bad value raises :class:`distckpt.errors.ConfigError` naming the variable, the value and what is
allowed; nothing silently falls back to a default.

| variable                    | default  | meaning                                                   |
|-----------------------------|----------|-----------------------------------------------------------|
| DISTCKPT_IO_BACKEND         | auto     | auto, uring, pwrite or buffered (see distckpt.io)          |
| DISTCKPT_QUEUE_DEPTH        | 8        | writes/reads kept in flight per file                      |
| DISTCKPT_BLOCK_SIZE         | 4194304  | bytes per aligned staging block (one I/O request)          |
| DISTCKPT_CHECKSUM_BLOCK     | 1048576  | bytes per checksummed block inside a chunk                 |
| DISTCKPT_TIMEOUT_S          | 300      | bound on any control-plane collective (dead peer detection)|
| DISTCKPT_PREFLIGHT          | 1        | 1: save() runs the cheap pre-flight checks; 0: skip them   |
| DISTCKPT_ARRIVAL_TIMEOUT_S  | 60       | how long the ranks that called save/load wait for the rest |
|                             |          | before RanksMissingError (a call made on some ranks only)  |
| DISTCKPT_STAGING_POOL_BYTES | (none)   | largest idle async staging arena kept for reuse; 0: free   |
|                             |          | every arena when its save ends (none: keep one, any size)  |
"""

from __future__ import annotations

import dataclasses
import functools
import os

from .errors import ConfigError

__all__ = ["Config", "get_config", "BACKENDS"]

BACKENDS = ("auto", "uring", "pwrite", "buffered")


@dataclasses.dataclass(frozen=True)
class Config:
    io_backend: str = "auto"
    queue_depth: int = 8
    block_size: int = 4 << 20
    checksum_block: int = 1 << 20
    timeout_s: float = 300.0
    preflight: bool = True
    arrival_timeout_s: float = 60.0
    staging_pool_bytes: int | None = None


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


def load_config(env: dict | None = None) -> Config:
    """Parse a Config from ``env`` (default: os.environ). Raises ConfigError on a bad value."""
    env = dict(os.environ if env is None else env)
    backend = env.get("DISTCKPT_IO_BACKEND", "auto") or "auto"
    if backend not in BACKENDS:
        raise ConfigError(
            f"DISTCKPT_IO_BACKEND={backend!r} is not one of {', '.join(BACKENDS)}",
            variable="DISTCKPT_IO_BACKEND",
        )
    preflight_raw = env.get("DISTCKPT_PREFLIGHT", "1")
    if preflight_raw not in ("0", "1"):
        raise ConfigError(f"DISTCKPT_PREFLIGHT={preflight_raw!r} must be 0 or 1", variable="DISTCKPT_PREFLIGHT")
    timeout_raw = env.get("DISTCKPT_TIMEOUT_S", "300")
    try:
        timeout = float(timeout_raw)
    except ValueError:
        raise ConfigError(f"DISTCKPT_TIMEOUT_S={timeout_raw!r} is not a number", variable="DISTCKPT_TIMEOUT_S") from None
    if not 1 <= timeout <= 86400:
        raise ConfigError(f"DISTCKPT_TIMEOUT_S={timeout} must be between 1 and 86400", variable="DISTCKPT_TIMEOUT_S")
    arrival_raw = env.get("DISTCKPT_ARRIVAL_TIMEOUT_S", "") or "60"
    try:
        arrival = float(arrival_raw)
    except ValueError:
        raise ConfigError(f"DISTCKPT_ARRIVAL_TIMEOUT_S={arrival_raw!r} is not a number",
                          variable="DISTCKPT_ARRIVAL_TIMEOUT_S") from None
    if not 0.1 <= arrival <= 86400:
        raise ConfigError(f"DISTCKPT_ARRIVAL_TIMEOUT_S={arrival} must be between 0.1 and 86400",
                          variable="DISTCKPT_ARRIVAL_TIMEOUT_S")
    pool_raw = env.get("DISTCKPT_STAGING_POOL_BYTES", "")
    pool = None if pool_raw == "" else _int(env, "DISTCKPT_STAGING_POOL_BYTES", 0, lo=0, hi=1 << 50)
    return Config(
        io_backend=backend,
        queue_depth=_int(env, "DISTCKPT_QUEUE_DEPTH", 8, lo=1, hi=256),
        block_size=_int(env, "DISTCKPT_BLOCK_SIZE", 4 << 20, lo=64 << 10, hi=256 << 20, power_of_two=True),
        checksum_block=_int(env, "DISTCKPT_CHECKSUM_BLOCK", 1 << 20, lo=4 << 10, hi=1 << 30, power_of_two=True),
        timeout_s=timeout,
        preflight=preflight_raw == "1",
        arrival_timeout_s=arrival,
        staging_pool_bytes=pool,
    )


@functools.lru_cache(maxsize=1)
def get_config() -> Config:
    """The process-wide Config, read from the environment on first use."""
    return load_config()
