"""The object-store knobs, read from the environment at each save (docs/CONFIG.md lists them)."""

from __future__ import annotations

import os

from ...errors import ConfigError
from . import request as objrequest

_MIN_PART = 5 << 20          # S3's smallest part but the last


def _part_size() -> int:
    from ...sizes import parse_size
    raw = os.environ.get("DISTCKPT_OBJECT_PART_SIZE", "") or "16M"
    try:
        v = parse_size(raw)
    except ValueError as exc:
        raise ConfigError(f"DISTCKPT_OBJECT_PART_SIZE={raw!r}: {exc}", variable="DISTCKPT_OBJECT_PART_SIZE") from None
    if not _MIN_PART <= v <= 5 << 30:
        raise ConfigError(f"DISTCKPT_OBJECT_PART_SIZE={raw!r} must be between 5 MiB and 5 GiB (S3's part sizes)",
                          variable="DISTCKPT_OBJECT_PART_SIZE")
    return v


#: The longest save lease a writer can claim (DISTCKPT_OBJECT_LEASE_S's bound); a longer record
#: is no writer's (lease.Lease.is_live).
MAX_LEASE_S = 86400.0


def settings() -> dict:
    """The object-store knobs (environment, read at each save):

    DISTCKPT_OBJECT_PART_SIZE (bytes, default 16 MiB; raised so a shard needs at most 10000 parts),
    DISTCKPT_OBJECT_PARTS_IN_FLIGHT (default 4: upload parts in flight per rank, which with one
    being filled bounds a rank's upload memory to 5 parts), DISTCKPT_OBJECT_LEASE_S (default 30: a
    save lease not renewed for this long is dead), DISTCKPT_OBJECT_CONDITIONAL (1: MANIFEST by
    conditional create, default; 0: HEAD + PUT + read-back, for servers without If-None-Match),
    DISTCKPT_OBJECT_LATE_S (default 900: how long after a MANIFEST request distckpt gave up on it
    the request may still land; a failed save's data is kept that long, see docs/OBJECT_STORES.md)."""
    cond = os.environ.get("DISTCKPT_OBJECT_CONDITIONAL", "1") or "1"
    if cond not in ("0", "1"):
        raise ConfigError(f"DISTCKPT_OBJECT_CONDITIONAL={cond!r} must be 0 or 1", variable="DISTCKPT_OBJECT_CONDITIONAL")
    return {
        "part_size": _part_size(),
        "in_flight": int(objrequest.env_float("DISTCKPT_OBJECT_PARTS_IN_FLIGHT", 4, 1, 64)),
        "lease_s": objrequest.env_float("DISTCKPT_OBJECT_LEASE_S", 30.0, 1.0, MAX_LEASE_S),
        "conditional": cond == "1",
        "late_s": objrequest.env_float("DISTCKPT_OBJECT_LATE_S", 900.0, 0.0, 7 * 86400.0),
    }
