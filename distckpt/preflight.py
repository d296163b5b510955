"""Pre-flight checks: find a broken environment before a save writes its first byte.

Every check is a small function that returns a :class:`CheckResult` and can run on its own, before
``torch.distributed.init_process_group`` (none of them needs a process group, and the ones that look
at ``torch`` import it lazily). :func:`preflight` runs them all and returns a
:class:`PreflightReport`; ``raise_on_error=True`` raises the typed error of the first failing check.

The checks, in the order :func:`preflight` runs them:

=====================  ==========================================================================
torchrun_env           RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT:
                       all present when any is, integers, in range, MASTER_ADDR resolvable.
                       -> DistributedEnvError(variable=...)
socket_ifname          NCCL_SOCKET_IFNAME (``^`` exclude, ``=`` exact, else prefix) and
                       GLOO_SOCKET_IFNAME (exact names) match interfaces that exist.
nccl_ib_hca            NCCL_IB_HCA names InfiniBand devices (and ports) that exist.
nccl_vars              Boolean NCCL variables hold 0/1, integer ones integers; unknown NCCL_*
                       names are flagged with the closest known name (warning).
backend_devices        backend "nccl" needs CUDA, and no more local ranks than visible GPUs.
shm                    /dev/shm holds NCCL's shared-memory transport buffers plus
                       ``shm_bytes_needed``. -> SharedMemoryError
disk                   free bytes and inodes on the checkpoint file system vs ``expected_bytes``
                       (old checkpoints still exist while the new one is written). -> DiskFullError
tmpdir                 the same for TMPDIR (warning only).
deleted_open_files     space held on that file system by deleted-but-open files (warning).
writable               a probe file can be created, written, fsynced and removed.
                       -> StoragePermissionError / DiskFullError (via errors.from_os_error)
fd_limit               RLIMIT_NOFILE leaves room for the fds a save opens. -> TooManyOpenFilesError
io_backend             which distckpt.storage.posix backend (io_uring / O_DIRECT / buffered) will run and why.
                       -> IOBackendUnavailableError
memlock                RLIMIT_MEMLOCK when pinned memory will be used (warning).
=====================  ==========================================================================

For an object-store URL (``s3://bucket/prefix``) the file-system checks (disk, tmpdir,
deleted_open_files, writable, io_backend) are replaced by those of
:mod:`distckpt.storage.object.check`: object_credentials (credentials resolve), object_endpoint (the
endpoint answers), object_bucket (the bucket exists and may be listed) and object_writable (a probe
object is created and deleted; whether the server honours conditional creates is reported).

save() itself calls the cheap raising helpers :func:`check_save_space`, :func:`check_fd_limit` and
:func:`check_writable` before it writes.

Invariants: a check never raises (an unexpected exception inside a check becomes a warning that
names it, so one broken probe cannot hide the others); a check never leaves a file or an fd behind;
nothing here blocks for long (name resolution is bounded by a timeout).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import errno as _errno
import json
import os
import re
import resource
import socket
import stat
import sys
import tempfile
import threading
import traceback
import uuid
from typing import Any, Callable, Iterable, Mapping

from . import sizes as _sizes
from .clijson import JSON_FORMAT
from .errors import (
    DiskFullError,
    DistCkptError,
    DistributedEnvError,
    IOBackendUnavailableError,
    SharedMemoryError,
    StorageError,
    TooManyOpenFilesError,
    format_bytes,
    from_os_error,
)

__all__ = [
    "CheckResult",
    "PreflightReport",
    "MountInfo",
    "preflight",
    "check_save_space",
    "check_fd_limit",
    "check_writable",
    "torchrun_env_check",
    "socket_ifname_check",
    "ib_hca_check",
    "nccl_vars_check",
    "backend_devices_check",
    "shm_check",
    "disk_check",
    "tmpdir_check",
    "deleted_open_files_check",
    "writable_check",
    "fd_limit_check",
    "io_backend_check",
    "memlock_check",
    "nccl_shm_bytes_per_rank",
    "find_mount",
    "parse_size",
    "add_parser",
    "main",
]

OK, WARNING, ERROR = "ok", "warning", "error"
_STATUS_ORDER = {OK: 0, WARNING: 1, ERROR: 2}


# ------------------------------------------------------------------------------------------------
# Results


@dataclasses.dataclass
class CheckResult:
    """The outcome of one check.

    Attributes:
        name: The check's name (e.g. ``"disk"``).
        status: ``"ok"``, ``"warning"`` or ``"error"``.
        message: One human-readable line (or a few) with the numbers.
        details: Machine-readable numbers and names (JSON-serialisable).
        error: For status ``"error"``, the typed error the check would raise; otherwise None.
    """

    name: str
    status: str
    message: str
    details: dict = dataclasses.field(default_factory=dict)
    error: DistCkptError | None = None

    @property
    def ok(self) -> bool:
        return self.status != ERROR

    def to_dict(self) -> dict:
        out = {"name": self.name, "status": self.status, "message": self.message,
               "details": self.details, "error": None}
        if self.error is not None:
            e = self.error
            out["error"] = {
                "type": type(e).__name__,
                "message": e.message,
                "remedy": e.remedy,
                "path": e.path,
                "rank": e.rank,
                "errno": getattr(e, "errno", None) if isinstance(e, OSError) else e.details.get("errno"),
                "fields": e.details,
            }
        return out


@dataclasses.dataclass
class PreflightReport:
    """Every check's result, in the order they ran.

    ``ok`` is True when no check failed (warnings allowed); ``errors`` and ``warnings`` are the
    failing / warning :class:`CheckResult` objects; ``raise_first()`` raises the typed error of the
    first failing check; ``str(report)`` is a readable table; ``to_dict()`` is JSON-ready.
    """

    path: str
    checks: list[CheckResult]

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def errors(self) -> list[CheckResult]:
        return [c for c in self.checks if c.status == ERROR]

    @property
    def warnings(self) -> list[CheckResult]:
        return [c for c in self.checks if c.status == WARNING]

    def get(self, name: str) -> CheckResult | None:
        """The result of the check called ``name``, or None if it did not run."""
        for c in self.checks:
            if c.name == name:
                return c
        return None

    def raise_first(self) -> None:
        """Raise the typed error of the first failing check; return None when all passed.

        Raises:
            DistCkptError: the subclass the failing check produced (DiskFullError, ...).
        """
        for c in self.errors:
            if c.error is not None:
                raise c.error

    def to_dict(self) -> dict:
        return {"path": self.path, "ok": self.ok, "checks": [c.to_dict() for c in self.checks]}

    def __str__(self) -> str:
        n_err, n_warn = len(self.errors), len(self.warnings)
        head = (f"distckpt preflight for {self.path}: "
                f"{n_err} error{'s' * (n_err != 1)}, {n_warn} warning{'s' * (n_warn != 1)}")
        width = max([len("CHECK")] + [len(c.name) for c in self.checks])
        lines = [head, f"{'CHECK':<{width}}  STATUS   MESSAGE"]
        for c in self.checks:
            msg_lines = c.message.splitlines() or [""]
            lines.append(f"{c.name:<{width}}  {c.status.upper():<7}  {msg_lines[0]}")
            pad = " " * (width + 11)
            lines.extend(pad + m for m in msg_lines[1:])
            if c.error is not None:
                lines.append(f"{pad}remedy: {c.error.remedy}")
        return "\n".join(lines)


def _finish(name: str, errors: list[DistCkptError], warnings: list[str], ok_message: str,
            details: dict | None = None) -> CheckResult:
    """Fold a check's findings into one result: the first error is the one raised, every
    problem is listed in the message so one run shows them all."""
    details = dict(details or {})
    problems = [e.message for e in errors] + warnings
    if problems:
        details["problems"] = problems
    if errors:
        return CheckResult(name, ERROR, "\n".join(problems), details, errors[0])
    if warnings:
        return CheckResult(name, WARNING, "\n".join(problems), details)
    return CheckResult(name, OK, ok_message, details)


def _env_of(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _rank_of(env: Mapping[str, str]) -> int | None:
    return _int_or_none(env.get("RANK"))


def _existing_dir(path: str | os.PathLike) -> str:
    """The path itself if it is a directory, else its nearest existing ancestor directory: a
    checkpoint directory usually does not exist before the first save, but its file system does."""
    probe = os.path.abspath(os.fspath(path))
    while not os.path.isdir(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return probe


# ------------------------------------------------------------------------------------------------
# torchrun environment

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_INT_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")

_TORCHRUN_REMEDY = {
    "RANK": "RANK must be in 0..WORLD_SIZE-1: check that every node passes the same --nnodes and "
            "--nproc-per-node and a distinct --node-rank to torchrun.",
    "WORLD_SIZE": "WORLD_SIZE must equal nnodes * nproc_per_node and be the same on every rank: "
                  "check the torchrun --nnodes/--nproc-per-node arguments of every node.",
    "LOCAL_RANK": "LOCAL_RANK must be in 0..LOCAL_WORLD_SIZE-1: launch with torchrun, or export the "
                  "rank's index on its node (SLURM_LOCALID) as LOCAL_RANK.",
    "LOCAL_WORLD_SIZE": "LOCAL_WORLD_SIZE is the number of ranks on this node (torchrun "
                        "--nproc-per-node); it cannot exceed WORLD_SIZE.",
    "MASTER_ADDR": "Set MASTER_ADDR (torchrun --master-addr / --rdzv-endpoint) to the host name or IP "
                   "of the rank-0 node, one that every node can resolve and reach.",
    "MASTER_PORT": "Set MASTER_PORT (torchrun --master-port) to a free TCP port in 1024..65535, the "
                   "same on every node.",
}


def _env_error(var: str, message: str, *, expected: str, found: str, rank: int | None,
               remedy: str | None = None, **fields: Any) -> DistributedEnvError:
    return DistributedEnvError(f"{message} (expected {expected}, found {found})", variable=var,
                               expected=expected, found=found, rank=rank,
                               remedy=remedy or _TORCHRUN_REMEDY.get(var), **fields)


def _resolve(host: str, port: int | None, timeout_s: float) -> tuple[list[str] | None, str | None]:
    """getaddrinfo bounded by a timeout (a dead DNS server must not stall the job's start).

    Returns (addresses, None), (None, reason) when resolution failed, or (None, None) on timeout.
    """
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            box["addrs"] = sorted({info[4][0] for info in infos})
        except (OSError, UnicodeError) as exc:
            box["reason"] = str(exc)

    t = threading.Thread(target=work, name="distckpt-preflight-resolve", daemon=True)
    t.start()
    t.join(timeout_s)
    return box.get("addrs"), box.get("reason")


def torchrun_env_check(env: Mapping[str, str] | None = None, *, world_size: int | None = None,
                       local_world_size: int | None = None,
                       resolve_timeout_s: float = 5.0) -> CheckResult:
    """Check the six torchrun variables.

    A plain single-process run with none of them set is fine. Once any is set, all six must be,
    the integer ones must parse, and 0 <= RANK < WORLD_SIZE, 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE <=
    WORLD_SIZE, 1 <= MASTER_PORT <= 65535, MASTER_ADDR resolvable. ``world_size`` /
    ``local_world_size``, when given, must agree with the environment.

    Each failure is a :class:`DistributedEnvError` whose ``variable`` field names the variable and
    whose message says expected vs found: this is the error that otherwise surfaces as
    "Transport endpoint is not connected" or a rendezvous timeout.
    """
    env = _env_of(env)
    rank = _rank_of(env)
    present = {k: env[k] for k in TORCHRUN_VARS if k in env}
    errors: list[DistCkptError] = []
    warnings: list[str] = []
    details: dict[str, Any] = {"variables": present}

    if not present:
        if world_size is not None and world_size > 1:
            errors.append(_env_error(
                "WORLD_SIZE", f"world_size={world_size} was requested but no torchrun variable is set",
                expected=str(world_size), found="unset", rank=rank,
                remedy="Launch the job with torchrun (or export RANK, WORLD_SIZE, LOCAL_RANK, "
                       "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT in every rank)."))
        return _finish("torchrun_env", errors, warnings,
                       "single process (no torchrun variables set)", details)

    set_names = ", ".join(sorted(present))
    for var in TORCHRUN_VARS:
        if var not in present:
            errors.append(_env_error(
                var, f"{var} is not set although {set_names} {'is' if len(present) == 1 else 'are'}",
                expected="set (torchrun sets all six)", found="unset", rank=rank,
                remedy=f"Export {var} in every rank's environment like the other torchrun variables "
                       "(a SLURM/mpirun launcher that sets only some of them), or launch with "
                       "torchrun, which sets all six."))

    ints: dict[str, int] = {}
    for var in _INT_VARS:
        if var not in present:
            continue
        raw = present[var]
        try:
            ints[var] = int(raw.strip())
        except ValueError:
            errors.append(_env_error(var, f"{var}={raw!r} is not an integer",
                                     expected="an integer", found=repr(raw), rank=rank))

    def bad(var: str, msg: str, expected: str, value: int) -> None:
        errors.append(_env_error(var, msg, expected=expected, found=str(value), rank=rank))

    ws, r = ints.get("WORLD_SIZE"), ints.get("RANK")
    lws, lr = ints.get("LOCAL_WORLD_SIZE"), ints.get("LOCAL_RANK")
    if ws is not None and ws < 1:
        bad("WORLD_SIZE", f"WORLD_SIZE={ws} is not positive", ">= 1", ws)
    if lws is not None and lws < 1:
        bad("LOCAL_WORLD_SIZE", f"LOCAL_WORLD_SIZE={lws} is not positive", ">= 1", lws)
    if r is not None and (r < 0 or (ws is not None and ws >= 1 and r >= ws)):
        bad("RANK", f"RANK={r} is out of range", f"0 <= RANK < WORLD_SIZE={ws}", r)
    if lr is not None and (lr < 0 or (lws is not None and lws >= 1 and lr >= lws)):
        bad("LOCAL_RANK", f"LOCAL_RANK={lr} is out of range",
            f"0 <= LOCAL_RANK < LOCAL_WORLD_SIZE={lws}", lr)
    if lws is not None and ws is not None and ws >= 1 and lws > ws:
        bad("LOCAL_WORLD_SIZE", f"LOCAL_WORLD_SIZE={lws} exceeds WORLD_SIZE={ws}",
            f"LOCAL_WORLD_SIZE <= WORLD_SIZE={ws}", lws)
    if world_size is not None and ws is not None and ws != world_size:
        bad("WORLD_SIZE", f"WORLD_SIZE={ws} differs from the world_size={world_size} the caller "
            "expects", str(world_size), ws)
    if local_world_size is not None and lws is not None and lws != local_world_size:
        bad("LOCAL_WORLD_SIZE", f"LOCAL_WORLD_SIZE={lws} differs from the local_world_size="
            f"{local_world_size} the caller expects", str(local_world_size), lws)
    port = ints.get("MASTER_PORT")
    if port is not None and not 1 <= port <= 65535:
        bad("MASTER_PORT", f"MASTER_PORT={port} is not a TCP port", "1..65535", port)
        port = None

    addr = present.get("MASTER_ADDR")
    if addr is not None:
        if not addr.strip():
            errors.append(_env_error("MASTER_ADDR", "MASTER_ADDR is empty",
                                     expected="a host name or IP", found="''", rank=rank))
        else:
            addrs, reason = _resolve(addr.strip(), port, resolve_timeout_s)
            if addrs:
                details["master_addr_resolves_to"] = addrs
            elif reason is not None:
                errors.append(_env_error(
                    "MASTER_ADDR", f"MASTER_ADDR={addr!r} does not resolve: {reason}",
                    expected="a resolvable host name or IP", found=repr(addr), rank=rank))
            else:
                warnings.append(f"MASTER_ADDR={addr!r} did not resolve within {resolve_timeout_s:g} s "
                                "(slow or unreachable DNS): the rendezvous may time out")

    summary = (f"torchrun rank {r}/{ws} (local {lr}/{lws}), master "
               f"{addr}:{present.get('MASTER_PORT')}")
    return _finish("torchrun_env", errors, warnings, summary, details)


# ------------------------------------------------------------------------------------------------
# NCCL / Gloo


def list_interfaces() -> list[str]:
    """Names of the network interfaces of this network namespace."""
    try:
        return sorted(name for _, name in socket.if_nameindex())
    except OSError:
        try:
            return sorted(os.listdir("/sys/class/net"))
        except OSError:
            return []


def _parse_nccl_list(value: str) -> tuple[bool, bool, list[str]]:
    """NCCL's list syntax (src/misc/utils.cc parseStringList): a leading ``^`` makes it an exclude
    list, then a leading ``=`` makes the entries exact names instead of prefixes; entries are
    comma-separated. Returns (exclude, exact, entries)."""
    s = value.strip()
    exclude = s.startswith("^")
    if exclude:
        s = s[1:]
    exact = s.startswith("=")
    if exact:
        s = s[1:]
    return exclude, exact, [e.strip() for e in s.split(",") if e.strip()]


def _entry_matches(entry: str, name: str, exact: bool) -> bool:
    return name == entry if exact else name.startswith(entry)


def _hint(entry: str, names: Iterable[str]) -> str:
    close = difflib.get_close_matches(entry, list(names), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_nccl_list(var: str, value: str, existing: list[str], what: str, rank: int | None,
                     errors: list[DistCkptError], warnings: list[str], remedy: str,
                     strip_port: bool = False) -> list[str]:
    """Apply NCCL's include/exclude syntax to ``existing``; returns the names NCCL would use."""
    exclude, exact, entries = _parse_nccl_list(value)
    if strip_port:
        entries = [e.split(":", 1)[0] for e in entries]
    mode = "exact" if exact else "prefix"
    have = ", ".join(existing) or "none"
    if not entries:
        errors.append(_env_error(var, f"{var}={value!r} lists no {what}",
                                 expected=f"a comma-separated list of {what} names", found=repr(value),
                                 rank=rank, remedy=remedy, existing=existing))
        return []
    hits = {e: [n for n in existing if _entry_matches(e, n, exact)] for e in entries}
    if exclude:
        used = [n for n in existing if not any(_entry_matches(e, n, exact) for e in entries)]
        if not used:
            errors.append(_env_error(
                var, f"{var}={value!r} excludes every {what} ({mode} match); {what}s here: {have}",
                expected=f"at least one {what} left after the exclusion", found="none left",
                rank=rank, remedy=remedy, existing=existing))
        return used
    used = [n for n in existing if any(_entry_matches(e, n, exact) for e in entries)]
    missing = [e for e, h in hits.items() if not h]
    if not used:
        hints = "".join(_hint(e, existing) for e in missing[:1])
        errors.append(_env_error(
            var, f"{var}={value!r} matches no {what} ({mode} match){hints}; {what}s here: {have}",
            expected=f"{what} names that exist here ({have})", found=repr(value), rank=rank,
            remedy=remedy,
            existing=existing))
    elif missing:
        warnings.append(f"{var}: {', '.join(repr(m) for m in missing)} match no {what} ({mode} "
                        f"match); NCCL uses {', '.join(used)}; {what}s here: {have}")
    return used


def socket_ifname_check(env: Mapping[str, str] | None = None, *,
                        interfaces: list[str] | None = None) -> CheckResult:
    """Check NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME against the interfaces that exist.

    NCCL_SOCKET_IFNAME uses NCCL's syntax: comma-separated; a leading ``^`` excludes, a leading
    ``=`` (after any ``^``) means exact names, otherwise entries are prefixes. An include list
    matching no interface is an error naming the interfaces that exist.

    GLOO_SOCKET_IFNAME is split on commas by torch and each entry is handed to Gloo as an exact
    interface name (Gloo has no prefix or exclude syntax), so every entry must exist.
    """
    env = _env_of(env)
    rank = _rank_of(env)
    existing = list_interfaces() if interfaces is None else sorted(interfaces)
    errors: list[DistCkptError] = []
    warnings: list[str] = []
    details: dict[str, Any] = {"interfaces": existing}
    remedy_nccl = ("Set NCCL_SOCKET_IFNAME to interfaces this node has (see `ip -br link`), e.g. "
                   "the prefix 'eth' or the exact '=eth0'; or unset it to let NCCL choose.")
    notes = []
    if "NCCL_SOCKET_IFNAME" in env:
        used = _check_nccl_list("NCCL_SOCKET_IFNAME", env["NCCL_SOCKET_IFNAME"], existing,
                                "interface", rank, errors, warnings, remedy_nccl)
        details["nccl_interfaces"] = used
        notes.append(f"NCCL uses {', '.join(used) or 'none'}")
    if "GLOO_SOCKET_IFNAME" in env:
        value = env["GLOO_SOCKET_IFNAME"]
        entries = [e.strip() for e in value.split(",") if e.strip()]
        missing = [e for e in entries if e not in existing]
        have = ", ".join(existing) or "none"
        if not entries or missing:
            hints = "".join(_hint(m, existing) for m in missing[:1])
            syntax = (" (Gloo takes exact interface names; NCCL's ^ and = syntax does not apply)"
                      if any(m[:1] in "^=" for m in missing) else "")
            errors.append(_env_error(
                "GLOO_SOCKET_IFNAME",
                f"GLOO_SOCKET_IFNAME={value!r} names interface(s) that do not exist: "
                f"{', '.join(missing) or '(empty)'}{hints}{syntax}; interfaces here: {have}",
                expected=f"exact interface names from: {have}", found=repr(value), rank=rank,
                remedy="Set GLOO_SOCKET_IFNAME to exact interface names of this node "
                       "(see `ip -br link`), comma-separated, or unset it.",
                existing=existing))
        details["gloo_interfaces"] = [e for e in entries if e in existing]
        notes.append(f"Gloo uses {', '.join(details['gloo_interfaces']) or 'none'}")
    ok = "; ".join(notes) if notes else "NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME not set (auto)"
    return _finish("socket_ifname", errors, warnings, ok, details)


def ib_hca_check(env: Mapping[str, str] | None = None, *,
                 ib_root: str = "/sys/class/infiniband") -> CheckResult:
    """Check that NCCL_IB_HCA names InfiniBand devices (and ``:port`` suffixes) that exist.

    Same ``^`` / ``=`` syntax as NCCL_SOCKET_IFNAME. When NCCL_IB_DISABLE=1 the variable is unused
    and only noted.
    """
    env = _env_of(env)
    rank = _rank_of(env)
    if "NCCL_IB_HCA" not in env:
        return CheckResult("nccl_ib_hca", OK, "NCCL_IB_HCA not set (auto)")
    value = env["NCCL_IB_HCA"]
    try:
        devices = sorted(os.listdir(ib_root))
    except OSError:
        devices = []
    details: dict[str, Any] = {"devices": devices}
    if env.get("NCCL_IB_DISABLE", "").strip() == "1":
        return CheckResult("nccl_ib_hca", OK,
                           f"NCCL_IB_HCA={value!r} is ignored because NCCL_IB_DISABLE=1", details)
    errors: list[DistCkptError] = []
    warnings: list[str] = []
    remedy = ("Set NCCL_IB_HCA to devices listed by `ibv_devices` (or ls /sys/class/infiniband), "
              "e.g. '=mlx5_0:1', or unset it; without a matching device NCCL falls back to TCP "
              "sockets, which is many times slower.")
    used = _check_nccl_list("NCCL_IB_HCA", value, devices, "InfiniBand device", rank, errors,
                            warnings, remedy, strip_port=True)
    exclude, _, entries = _parse_nccl_list(value)
    if not exclude:
        for entry in entries:
            dev, _, port = entry.partition(":")
            if port and dev in devices and not os.path.isdir(os.path.join(ib_root, dev, "ports", port)):
                ports = sorted(os.listdir(os.path.join(ib_root, dev, "ports"))) \
                    if os.path.isdir(os.path.join(ib_root, dev, "ports")) else []
                errors.append(_env_error(
                    "NCCL_IB_HCA", f"NCCL_IB_HCA: device {dev} has no port {port}",
                    expected=f"a port of {dev}: {', '.join(ports) or 'none'}", found=port,
                    rank=rank, remedy=remedy))
    details["nccl_devices"] = used
    return _finish("nccl_ib_hca", errors, warnings, f"NCCL uses InfiniBand devices {', '.join(used)}",
                   details)


# NCCL variables that take 0/1. NCCL parses them with strtoll, so "true" or "yes" silently reads as
# 0: NCCL_SHM_DISABLE=true leaves shared memory ENABLED. That is why a non-0/1 value is an error.
NCCL_BOOL_VARS = frozenset({
    "NCCL_SHM_DISABLE", "NCCL_P2P_DISABLE", "NCCL_IB_DISABLE", "NCCL_NET_GDR_READ",
    "NCCL_CUMEM_ENABLE", "NCCL_CUMEM_HOST_ENABLE", "NCCL_NVLS_ENABLE", "NCCL_COLLNET_ENABLE",
    "NCCL_CHECK_POINTERS", "NCCL_IGNORE_CPU_AFFINITY", "NCCL_P2P_DIRECT_DISABLE",
    "NCCL_P2P_READ_ENABLE", "NCCL_NET_DISABLE_INTRA", "NCCL_IB_RETURN_ASYNC_EVENTS",
    "NCCL_IB_ADAPTIVE_ROUTING", "NCCL_SHM_USE_CUDA_MEMCPY", "NCCL_SET_THREAD_NAME",
    "NCCL_PXN_DISABLE", "NCCL_NVB_DISABLE", "NCCL_DMABUF_ENABLE", "NCCL_LOCAL_REGISTER",
    "NCCL_GRAPH_REGISTER", "NCCL_RUNTIME_CONNECT", "NCCL_GRAPH_MIXING_SUPPORT",
    "NCCL_COMM_BLOCKING", "NCCL_NET_SHARED_COMMS", "NCCL_NET_FORCE_FLUSH", "NCCL_CHECKS_DISABLE",
    "NCCL_SET_STACK_SIZE", "NCCL_OOB_NET_ENABLE", "NCCL_IB_MERGE_NICS", "NCCL_IB_ECE_ENABLE",
    "NCCL_NET_SHARED_BUFFERS", "NCCL_IB_SPLIT_DATA_ON_QPS",
})

# NCCL variables that take an integer (sizes in bytes, counts, timeouts, levels).
NCCL_INT_VARS = frozenset({
    "NCCL_BUFFSIZE", "NCCL_NTHREADS", "NCCL_MAX_NCHANNELS", "NCCL_MIN_NCHANNELS",
    "NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD", "NCCL_IB_TIMEOUT", "NCCL_IB_RETRY_CNT",
    "NCCL_IB_GID_INDEX", "NCCL_IB_SL", "NCCL_IB_TC", "NCCL_IB_FIFO_TC", "NCCL_IB_QPS_PER_CONNECTION",
    "NCCL_IB_PCI_RELAXED_ORDERING", "NCCL_IB_AR_THRESHOLD", "NCCL_IB_ROCE_VERSION_NUM",
    "NCCL_CROSS_NIC", "NCCL_MIN_CTAS", "NCCL_MAX_CTAS", "NCCL_CGA_CLUSTER_SIZE",
    "NCCL_WORK_FIFO_DEPTH", "NCCL_P2P_NET_CHUNKSIZE", "NCCL_P2P_PCI_CHUNKSIZE",
    "NCCL_P2P_NVL_CHUNKSIZE", "NCCL_NCHANNELS_PER_NET_PEER", "NCCL_NVLS_NCHANNELS",
    "NCCL_COLLNET_NODE_THRESHOLD", "NCCL_SINGLE_RING_THRESHOLD", "NCCL_LL_THRESHOLD",
    "NCCL_TREE_THRESHOLD", "NCCL_UID_STAGGER_THRESHOLD", "NCCL_MNNVL_ENABLE",
    "NCCL_MAX_NRINGS", "NCCL_MIN_NRINGS", "NCCL_ASYNC_ERROR_HANDLING", "NCCL_BLOCKING_WAIT",
})

# Everything else NCCL (and torch's legacy NCCL_* spellings) reads, for the typo check.
NCCL_OTHER_VARS = frozenset({
    "NCCL_DEBUG", "NCCL_DEBUG_FILE", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_TIMESTAMP_FORMAT",
    "NCCL_SOCKET_IFNAME", "NCCL_SOCKET_FAMILY", "NCCL_IB_HCA", "NCCL_IB_ADDR_FAMILY",
    "NCCL_IB_ADDR_RANGE", "NCCL_IB_CUDA_SUPPORT", "NCCL_IB_USE_INLINE", "NCCL_OOB_NET_IFNAME",
    "NCCL_NET", "NCCL_NET_PLUGIN", "NCCL_NET_GDR_LEVEL", "NCCL_SHM_MEMCPY_MODE",
    "NCCL_SHM_LOCALITY", "NCCL_P2P_LEVEL", "NCCL_LAUNCH_MODE", "NCCL_ALGO", "NCCL_PROTO",
    "NCCL_TOPO_FILE", "NCCL_TOPO_DUMP_FILE", "NCCL_GRAPH_FILE", "NCCL_GRAPH_DUMP_FILE",
    "NCCL_TUNER_PLUGIN", "NCCL_PROFILER_PLUGIN", "NCCL_COMM_ID", "NCCL_HOSTID", "NCCL_CONF_FILE",
    "NCCL_DESYNC_DEBUG",
})

NCCL_KNOWN_VARS = NCCL_BOOL_VARS | NCCL_INT_VARS | NCCL_OTHER_VARS
_NCCL_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE", "ABORT")


def nccl_vars_check(env: Mapping[str, str] | None = None) -> CheckResult:
    """Check the values and the names of the NCCL_* variables.

    Boolean variables (:data:`NCCL_BOOL_VARS`) must hold 0 or 1 and integer ones
    (:data:`NCCL_INT_VARS`) an integer; anything else is a DistributedEnvError (NCCL would read
    "true" as 0). A name NCCL does not know is a warning with the closest known name, because NCCL
    ignores it silently (NCCL_SOCKT_IFNAME -> did you mean NCCL_SOCKET_IFNAME?).
    """
    env = _env_of(env)
    rank = _rank_of(env)
    errors: list[DistCkptError] = []
    warnings: list[str] = []
    unknown: dict[str, str | None] = {}
    seen = sorted(k for k in env if k.startswith("NCCL_"))
    for name in seen:
        value = env[name]
        if name in NCCL_BOOL_VARS:
            if value.strip() not in ("0", "1"):
                errors.append(_env_error(
                    name, f"{name}={value!r} is not 0 or 1 (NCCL parses it as an integer, so "
                    f"{value!r} reads as {_strtoll(value)})", expected="0 or 1", found=repr(value),
                    rank=rank, remedy=f"Set {name}=1 to turn it on or {name}=0 to turn it off."))
        elif name in NCCL_INT_VARS:
            try:
                int(value.strip(), 0)
            except ValueError:
                errors.append(_env_error(
                    name, f"{name}={value!r} is not an integer", expected="an integer",
                    found=repr(value), rank=rank,
                    remedy=f"Give {name} a plain integer (sizes in bytes, no unit suffix)."))
        elif name == "NCCL_DEBUG" and value.strip().upper() not in _NCCL_DEBUG_LEVELS:
            warnings.append(f"NCCL_DEBUG={value!r} is not one of {', '.join(_NCCL_DEBUG_LEVELS)}; "
                            "NCCL prints no debug output for it")
        elif name not in NCCL_KNOWN_VARS:
            close = difflib.get_close_matches(name, sorted(NCCL_KNOWN_VARS), n=1, cutoff=0.75)
            unknown[name] = close[0] if close else None
            hint = f"; did you mean {close[0]}?" if close else ""
            warnings.append(f"unknown NCCL variable {name} (NCCL ignores it){hint}")
    details = {"nccl_vars": {k: env[k] for k in seen}, "unknown": unknown}
    ok = f"{len(seen)} NCCL variable(s) set, all valid" if seen else "no NCCL variables set"
    return _finish("nccl_vars", errors, warnings, ok, details)


def _strtoll(value: str) -> int:
    """What C's strtoll(value, NULL, 0) returns: the leading integer, 0 when there is none."""
    m = re.match(r"\s*([+-]?(?:0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*))", value)
    return int(m.group(1), 0) if m and m.group(1) not in ("+", "-") else 0


_KNOWN_PG_BACKENDS = ("nccl", "gloo", "mpi", "ucc", "xccl", "hccl", "fake")


def _backend_parts(backend: str) -> list[str]:
    """'nccl' -> ['nccl']; 'cpu:gloo,cuda:nccl' -> ['gloo', 'nccl']."""
    return [p.split(":", 1)[-1].strip().lower() for p in backend.split(",") if p.strip()]


def backend_devices_check(backend: str | None, env: Mapping[str, str] | None = None, *,
                          local_world_size: int | None = None) -> CheckResult:
    """Check that the process-group backend can run on this machine's devices.

    ``nccl`` needs CUDA (torch.cuda.is_available()) and at least one visible GPU per local rank
    (two ranks on one GPU fail inside NCCL with "Duplicate GPU detected"). Gloo runs anywhere.
    """
    env = _env_of(env)
    rank = _rank_of(env)
    if not backend:
        return CheckResult("backend_devices", OK, "no process-group backend given")
    parts = _backend_parts(backend)
    errors: list[DistCkptError] = []
    unknown = [p for p in parts if p not in _KNOWN_PG_BACKENDS]
    if unknown or not parts:
        errors.append(DistributedEnvError(
            f"unknown process-group backend {backend!r} (expected nccl, gloo, mpi, ucc or a "
            f"'cpu:gloo,cuda:nccl' map, found {backend!r})", variable=None, backend=backend,
            rank=rank, remedy="Pass backend='nccl' on GPUs or backend='gloo' on CPUs."))
        return _finish("backend_devices", errors, [], "", {"backend": backend})
    details: dict[str, Any] = {"backend": backend}
    if "nccl" in parts:
        try:
            import torch
            cuda = bool(torch.cuda.is_available())
            count = torch.cuda.device_count() if cuda else 0
            build = f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}"
        except Exception as exc:  # a broken torch import is itself the finding
            cuda, count, build = False, 0, f"torch import failed: {exc}"
        details.update(cuda_available=cuda, cuda_device_count=count)
        visible = env.get("CUDA_VISIBLE_DEVICES")
        if not cuda:
            errors.append(DistributedEnvError(
                f"backend {backend!r} needs CUDA, but torch.cuda.is_available() is False ({build}"
                f"{', CUDA_VISIBLE_DEVICES=' + repr(visible) if visible is not None else ''}) "
                "(expected a visible CUDA device, found none)",
                variable="CUDA_VISIBLE_DEVICES" if visible is not None else None, backend=backend,
                rank=rank, remedy="Use backend='gloo' on CPU-only machines (or 'cpu:gloo,cuda:nccl'), "
                "or install a CUDA build of torch and check nvidia-smi and CUDA_VISIBLE_DEVICES."))
        else:
            lws = local_world_size or _int_or_none(env.get("LOCAL_WORLD_SIZE"))
            if lws is not None and lws > count:
                errors.append(DistributedEnvError(
                    f"{lws} local ranks but {count} visible GPU(s): NCCL fails with 'Duplicate GPU "
                    f"detected' (expected LOCAL_WORLD_SIZE <= {count}, found {lws})",
                    variable="LOCAL_WORLD_SIZE", backend=backend, rank=rank,
                    remedy="Launch one rank per GPU (torchrun --nproc-per-node equal to the GPU "
                           "count) or widen CUDA_VISIBLE_DEVICES."))
        ok = f"backend {backend!r}: CUDA available, {count} GPU(s)"
    else:
        ok = f"backend {backend!r} runs on CPU"
    return _finish("backend_devices", errors, [], ok, details)


# ------------------------------------------------------------------------------------------------
# /dev/shm

# NCCL's shared-memory transport (used between local ranks when CUDA P2P is unavailable, as is
# common in containers) maps one /dev/shm segment per connection and channel, holding one buffer
# per protocol: SIMPLE = NCCL_BUFFSIZE (default 4 MiB), LL = 8 lines * 512 threads * 8 steps *
# 16 B = 512 KiB, LL128 = 120 elems * 640 threads * 8 steps * 8 B = 4800 KiB, plus a 4 KiB header.
# That is 9,637,888 bytes, the exact size NCCL names in its "Error while creating shared memory
# segment /dev/shm/nccl-XXXXXX (size 9637888)" warning. We assume 2 channels (NCCL's minimum for
# PCIe-only topologies, or NCCL_MIN_NCHANNELS) and 2 connections per rank and channel (the ring
# neighbour and the tree parent/child): ~36.8 MiB per local rank, ~294 MiB for 8 GPUs, which is
# why Docker's default 64 MiB /dev/shm fails there. This is an estimate, not NCCL's exact
# allocation; it errs toward too much, and NCCL_SHM_DISABLE=1 removes it.
_NCCL_LL_BYTES = 8 * 512 * 8 * 16
_NCCL_LL128_BYTES = 120 * 640 * 8 * 8
_NCCL_SEGMENT_HEADER = 4096
_NCCL_DEFAULT_BUFFSIZE = 4 << 20
_NCCL_CONNECTIONS_PER_CHANNEL = 2
_NCCL_DEFAULT_CHANNELS = 2


def nccl_shm_bytes_per_rank(env: Mapping[str, str] | None = None) -> int:
    """Estimated /dev/shm bytes NCCL's shared-memory transport maps per local rank (0 when
    NCCL_SHM_DISABLE=1). See the comment above this function for the derivation."""
    env = _env_of(env)
    if env.get("NCCL_SHM_DISABLE", "").strip() == "1":
        return 0
    buffsize = _int_or_none(env.get("NCCL_BUFFSIZE")) or _NCCL_DEFAULT_BUFFSIZE
    channels = _int_or_none(env.get("NCCL_MIN_NCHANNELS")) or _NCCL_DEFAULT_CHANNELS
    max_ch = _int_or_none(env.get("NCCL_MAX_NCHANNELS"))
    if max_ch:
        channels = min(channels, max_ch)
    segment = buffsize + _NCCL_LL_BYTES + _NCCL_LL128_BYTES + _NCCL_SEGMENT_HEADER
    return segment * max(channels, 1) * _NCCL_CONNECTIONS_PER_CHANNEL


def shm_check(*, backend: str | None = None, local_world_size: int | None = None,
              shm_bytes_needed: int | None = None, env: Mapping[str, str] | None = None,
              shm_path: str = "/dev/shm") -> CheckResult:
    """Check /dev/shm's size and free space against what the job on this node needs.

    Needed = :func:`nccl_shm_bytes_per_rank` * local_world_size when the backend uses NCCL and more
    than one rank shares the node (all local ranks share one /dev/shm), plus ``shm_bytes_needed``
    (e.g. DataLoader workers' shared tensors). Too little -> :class:`SharedMemoryError` with the
    numbers; using it anyway would end in SIGBUS or an NCCL "unhandled system error".
    """
    env = _env_of(env)
    rank = _rank_of(env)
    lws = local_world_size or _int_or_none(env.get("LOCAL_WORLD_SIZE")) or 1
    uses_nccl = bool(backend) and "nccl" in _backend_parts(backend)
    nccl_bytes = nccl_shm_bytes_per_rank(env) * lws if uses_nccl and lws > 1 else 0
    extra = int(shm_bytes_needed or 0)
    needed = nccl_bytes + extra
    details: dict[str, Any] = {"path": shm_path, "needed": needed, "nccl_bytes": nccl_bytes,
                               "extra_bytes": extra, "local_world_size": lws}
    try:
        st = os.statvfs(shm_path)
    except OSError as exc:
        if needed:
            err = SharedMemoryError(
                f"{shm_path} is unusable ({exc.strerror}) but the job needs {format_bytes(needed)} "
                "of shared memory", path=shm_path, rank=rank, errno=exc.errno, needed=needed, free=0)
            return _finish("shm", [err], [], "", details)
        return CheckResult("shm", WARNING, f"{shm_path} is unusable ({exc.strerror}); not needed by "
                           "this job's settings, but DataLoader workers and NCCL use it", details)
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    details.update(size=size, free=free)
    where = f"{shm_path} is {format_bytes(size)} with {format_bytes(free)} free"
    if not needed:
        why = ("NCCL_SHM_DISABLE=1" if uses_nccl and env.get("NCCL_SHM_DISABLE", "").strip() == "1"
               else f"backend {backend or 'none'}, {lws} local rank(s)")
        return CheckResult("shm", OK, f"{where}; no shared-memory need estimated ({why})", details)
    parts = []
    if nccl_bytes:
        parts.append(f"NCCL shared-memory transport ~{format_bytes(nccl_bytes)} for {lws} local ranks "
                     f"({format_bytes(nccl_bytes // lws)} each)")
    if extra:
        parts.append(f"{format_bytes(extra)} requested (shm_bytes_needed)")
    if free >= needed:
        return CheckResult("shm", OK, f"{where}; job needs ~{format_bytes(needed)} "
                           f"({'; '.join(parts)})", details)
    suggest_mib = -(-int(needed * 1.25) // (1 << 20))  # 25% headroom, rounded up to MiB
    remedy = (f"Give the container at least {suggest_mib} MiB of shared memory (docker run "
              f"--shm-size={suggest_mib}m, or a larger memory-backed /dev/shm volume in Kubernetes)")
    remedy += ", or set NCCL_SHM_DISABLE=1 (NCCL then uses P2P or sockets between local ranks)." \
        if nccl_bytes else ", or use fewer DataLoader workers."
    err = SharedMemoryError(
        f"{shm_path} too small: the job needs ~{format_bytes(needed)} ({'; '.join(parts)}), "
        f"{shm_path} is {format_bytes(size)} with {format_bytes(free)} free",
        path=shm_path, rank=rank, remedy=remedy, errno=_errno.ENOSPC, needed=needed, free=free,
        size=size)
    return _finish("shm", [err], [], "", details)


# ------------------------------------------------------------------------------------------------
# Mounts and disk space


@dataclasses.dataclass(frozen=True)
class MountInfo:
    """One line of /proc/self/mountinfo: where a file system is mounted and what it is."""

    mount_point: str
    fstype: str
    source: str
    options: str
    device: str  # "major:minor"


def _unescape_mount(raw: bytes) -> str:
    # The kernel escapes space, tab, newline and backslash in mountinfo paths as \ooo octal.
    return os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), raw))


def find_mount(path: str | os.PathLike, *, mountinfo: str = "/proc/self/mountinfo") -> MountInfo:
    """The mount that holds ``path`` (or its nearest existing ancestor): the longest mount-point
    prefix in /proc/self/mountinfo, the last one listed when several are stacked on one point."""
    target = os.path.realpath(_existing_dir(path) if not os.path.exists(path) else path)
    best: MountInfo | None = None
    try:
        with open(mountinfo, "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        left, sep, right = line.partition(b" - ")
        fields = left.split()
        tail = right.split()
        if not sep or len(fields) < 6 or len(tail) < 2:
            continue
        mp = _unescape_mount(fields[4])
        if not (target == mp or mp == "/" or target.startswith(mp.rstrip("/") + "/")):
            continue
        if best is None or len(mp) >= len(best.mount_point):
            best = MountInfo(mp, os.fsdecode(tail[0]), _unescape_mount(tail[1]),
                             os.fsdecode(fields[5]), os.fsdecode(fields[2]))
    return best or MountInfo("/", "unknown", "unknown", "", "")


def _count_committed(path: str) -> int:
    """Committed checkpoints under ``path`` (step_* directories with a MANIFEST; see docs/DESIGN.md)."""
    try:
        names = os.listdir(path)
    except OSError:
        return 0
    return sum(1 for n in names if n.startswith("step_")
               and os.path.isfile(os.path.join(path, n, "MANIFEST")))


def _fs_summary(path: str) -> tuple[MountInfo, os.statvfs_result, str]:
    existing = _existing_dir(path)
    return find_mount(existing), os.statvfs(existing), existing


def check_save_space(path: str | os.PathLike, needed_bytes: int, *, rank: int | None = None) -> None:
    """Raise unless the file system holding ``path`` has ``needed_bytes`` free (and an inode).

    Cheap (one statvfs and one read of /proc/self/mountinfo): save() calls it before writing.

    Raises:
        DiskFullError: errno ENOSPC, with ``needed``, ``free``, ``mount_point`` and ``fstype``.
    """
    path = os.fspath(path)
    mount, st, _ = _fs_summary(path)
    if mount.fstype in PSEUDO_FILE_SYSTEMS:
        raise _pseudo_fs_error(path, mount, rank)
    free = st.f_bavail * st.f_frsize
    no_inodes = st.f_files > 0 and st.f_favail == 0
    if free >= needed_bytes and not no_inodes:
        return
    short = (f"checkpoint needs {format_bytes(needed_bytes)} on {mount.mount_point} ({mount.fstype}), "
             f"{format_bytes(free)} free")
    if no_inodes:
        short += f" and 0 of {st.f_files} inodes free"
    raise DiskFullError(short, path=path, rank=rank, errno=_errno.ENOSPC, needed=needed_bytes,
                        free=free, free_inodes=st.f_favail, mount_point=mount.mount_point,
                        fstype=mount.fstype, remedy=_disk_remedy(mount, needed_bytes - free))


#: Kernel interfaces that look like directories but cannot hold files: their zero free bytes are
#: not a full disk, so saving there is reported as the wrong place, never as DiskFullError.
PSEUDO_FILE_SYSTEMS = frozenset({
    "proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs", "devpts",
    "pstore", "bpf", "mqueue", "fusectl", "binfmt_misc", "efivarfs", "selinuxfs", "nsfs", "autofs",
    "rpc_pipefs", "nfsd",
})


def refuse_pseudo_fs(path: str | os.PathLike, *, rank: int | None = None) -> None:
    """Raise StorageError when ``path`` lies on a kernel pseudo file system (/proc, /sys, ...).

    save() calls it before anything else touches the target directory (the save lock, the tmp
    dir), so saving there is reported as the wrong place instead of as whatever the first file
    operation there fails with."""
    mount = find_mount(_existing_dir(os.fspath(path)))
    if mount.fstype in PSEUDO_FILE_SYSTEMS:
        raise _pseudo_fs_error(os.fspath(path), mount, rank)


def _pseudo_fs_error(path: str, mount: MountInfo, rank: int | None) -> StorageError:
    return StorageError(
        f"{path} is on {mount.mount_point} ({mount.fstype}), a kernel pseudo file system that cannot "
        "hold a checkpoint", path=path, rank=rank, mount_point=mount.mount_point, fstype=mount.fstype,
        remedy="Save to a directory on a real file system (ext4, xfs, a network file system, or tmpfs "
               "for tests).")


def _disk_remedy(mount: MountInfo, short_by: int) -> str:
    amount = f"at least {format_bytes(short_by)} " if short_by > 0 else ""
    return (f"Free {amount}on {mount.mount_point}: delete old checkpoints or lower keep_last "
            "(rotation frees space only after a new checkpoint is durable), make processes close "
            "deleted files they still hold (see the deleted_open_files check), or save to a larger "
            "volume.")


def disk_check(path: str | os.PathLike, expected_bytes: int | None = None, *,
               keep_last: int | None = None, n_files: int | None = None,
               rank: int | None = None) -> CheckResult:
    """Check free bytes and inodes of the checkpoint file system.

    ``expected_bytes`` is what this save writes to that file system (all ranks' bytes summed when
    it is shared). Old checkpoints are deleted by rotation only after the new one is durable, so
    the new checkpoint must fit next to them: free >= expected_bytes, else DiskFullError. With
    ``keep_last=k``, the steady state holds k+1 checkpoints during a save; when fewer exist now,
    a warning says later saves will run out. ``n_files`` files need as many inodes.
    """
    path = os.fspath(path)
    mount, st, existing = _fs_summary(path)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    details: dict[str, Any] = {
        "mount_point": mount.mount_point, "fstype": mount.fstype, "source": mount.source,
        "checked_dir": existing, "free": free, "total": total, "free_inodes": st.f_favail,
        "total_inodes": st.f_files, "needed": expected_bytes,
    }
    where = f"{mount.mount_point} ({mount.fstype})"
    errors: list[DistCkptError] = []
    warnings: list[str] = []
    if mount.fstype in PSEUDO_FILE_SYSTEMS:
        return _finish("disk", [_pseudo_fs_error(path, mount, rank)], warnings, "", details)
    n_files = n_files or 5
    if st.f_files > 0 and st.f_favail < n_files:  # f_files == 0: no inode limit (btrfs, some FUSE)
        errors.append(DiskFullError(
            f"checkpoint needs {n_files} inodes on {where}, {st.f_favail} of {st.f_files} free",
            path=path, rank=rank, errno=_errno.ENOSPC, needed=expected_bytes, free=free,
            needed_inodes=n_files, free_inodes=st.f_favail, mount_point=mount.mount_point,
            fstype=mount.fstype,
            remedy=f"Delete files on {mount.mount_point} (many small files use up inodes) or save to "
                   "a file system with free inodes (`df -i` shows them)."))
    if expected_bytes is None:
        return _finish("disk", errors, warnings,
                       f"{format_bytes(free)} free of {format_bytes(total)} on {where}, "
                       f"{st.f_favail} inodes free (expected size not given)", details)
    existing_ckpts = _count_committed(path)
    details["committed_checkpoints"] = existing_ckpts
    rotation = (f" (rotation to keep_last={keep_last} deletes old checkpoints only after the new one "
                "is durable)" if keep_last else "")
    if free < expected_bytes:
        errors.append(DiskFullError(
            f"checkpoint needs {format_bytes(expected_bytes)} on {where}, {format_bytes(free)} free; "
            f"the new checkpoint must fit while the old ones still exist{rotation}",
            path=path, rank=rank, errno=_errno.ENOSPC, needed=expected_bytes, free=free,
            free_inodes=st.f_favail, mount_point=mount.mount_point, fstype=mount.fstype,
            remedy=_disk_remedy(mount, expected_bytes - free)))
    elif keep_last:
        more = max(1, keep_last + 1 - existing_ckpts)
        future = expected_bytes * more
        details["steady_state_needed"] = future
        if free < future:
            warnings.append(
                f"with keep_last={keep_last}, {keep_last + 1} checkpoints exist at once during a "
                f"save and {existing_ckpts} exist now: {more} more x {format_bytes(expected_bytes)} = "
                f"{format_bytes(future)} needed on {where}, {format_bytes(free)} free; a later save "
                "will run out of space")
    ok = (f"checkpoint needs {format_bytes(expected_bytes)} on {where}, {format_bytes(free)} free, "
          f"{st.f_favail} inodes free; the new checkpoint fits while the old ones still exist")
    return _finish("disk", errors, warnings, ok, details)


def tmpdir_check(path: str | os.PathLike, expected_bytes: int | None = None,
                 env: Mapping[str, str] | None = None, *,
                 min_bytes: int = 1 << 30) -> CheckResult:
    """Check TMPDIR's free space (warning level only).

    distckpt does not stage checkpoints in TMPDIR, but torch does put files there (compile caches,
    DataLoader's file_system sharing strategy, multiprocessing sockets), and a full TMPDIR fails a
    job in ways that look unrelated. The threshold is min(expected_bytes, ``min_bytes``).
    """
    env = _env_of(env)
    tmp = env.get("TMPDIR") or tempfile.gettempdir()
    details: dict[str, Any] = {"tmpdir": tmp}
    if not os.path.isdir(tmp):
        return CheckResult("tmpdir", WARNING, f"TMPDIR={tmp!r} does not exist: Python silently falls "
                           "back to another directory and torch's temp files land there", details)
    try:
        same = os.stat(tmp).st_dev == os.stat(_existing_dir(path)).st_dev
        mount, st, _ = _fs_summary(tmp)
    except OSError as exc:
        return CheckResult("tmpdir", WARNING, f"cannot inspect TMPDIR {tmp}: {exc}", details)
    free = st.f_bavail * st.f_frsize
    need = min(expected_bytes, min_bytes) if expected_bytes else min_bytes
    details.update(free=free, needed=need, mount_point=mount.mount_point, fstype=mount.fstype,
                   same_fs_as_checkpoint=same)
    where = f"TMPDIR {tmp} on {mount.mount_point} ({mount.fstype})"
    warnings = []
    if free < need:
        warnings.append(f"{where} has {format_bytes(free)} free, less than {format_bytes(need)}: "
                        "torch's temporary files may fill it (set TMPDIR to a larger file system)")
    if st.f_files > 0 and st.f_favail == 0:
        warnings.append(f"{where} has no free inodes")
    if not os.access(tmp, os.W_OK):
        warnings.append(f"{where} is not writable by this user")
    same_note = " (same file system as the checkpoint)" if same else ""
    return _finish("tmpdir", [], warnings, f"{where}: {format_bytes(free)} free{same_note}", details)


def _comm(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def deleted_open_files_check(path: str | os.PathLike, *, min_bytes: int = 1 << 20,
                             proc: str = "/proc", max_examples: int = 3) -> CheckResult:
    """Find space on the checkpoint's file system held by files that are deleted but still open.

    Scans /proc/self/fd and every other /proc/PID/fd this user may read. A link ending in
    " (deleted)" whose target (os.stat follows /proc/PID/fd/N to the open file) lives on the same
    device as ``path`` still occupies its blocks (st_blocks * 512): df counts them, du does not. A
    process holding at least ``min_bytes`` is a warning naming the pid, its name, the bytes and
    example paths. This is what a leaked fd to a rotated checkpoint looks like.
    """
    path = os.fspath(path)
    existing = _existing_dir(path)
    dev = os.stat(existing).st_dev
    mount = find_mount(existing)
    holders: dict[str, dict[str, Any]] = {}
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        pids = []
    for pid in pids:
        fd_dir = f"{proc}/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:  # other users' processes, or gone already
            continue
        for fd in fds:
            link = f"{fd_dir}/{fd}"
            try:
                target = os.readlink(link)
                if not target.endswith(" (deleted)"):
                    continue
                st = os.stat(link)
            except OSError:
                continue
            if st.st_dev != dev or not stat.S_ISREG(st.st_mode):
                continue
            h = holders.setdefault(pid, {"pid": int(pid), "comm": _comm(pid), "bytes": 0,
                                         "files": 0, "examples": [], "_inodes": set()})
            if st.st_ino in h["_inodes"]:  # the same file open twice holds its blocks once
                continue
            h["_inodes"].add(st.st_ino)
            h["bytes"] += st.st_blocks * 512
            h["files"] += 1
            if len(h["examples"]) < max_examples:
                h["examples"].append(target[: -len(" (deleted)")])
    for h in holders.values():
        del h["_inodes"]
    found = sorted(holders.values(), key=lambda h: -h["bytes"])
    details = {"mount_point": mount.mount_point, "fstype": mount.fstype, "holders": found,
               "total_bytes": sum(h["bytes"] for h in found)}
    where = f"{mount.mount_point} ({mount.fstype})"
    me = os.getpid()
    warnings = [
        f"df says full and du says small: process {h['pid']} ({h['comm']}"
        f"{', this process' if h['pid'] == me else ''}) holds {format_bytes(h['bytes'])} in "
        f"{h['files']} deleted file(s) on {where}, e.g. {', '.join(h['examples'])}; the space "
        "returns only when it closes them (or exits)"
        for h in found if h["bytes"] >= min_bytes]
    total = details["total_bytes"]
    ok = (f"no deleted-but-open files hold space on {where}" if not found else
          f"deleted-but-open files hold {format_bytes(total)} on {where} (below "
          f"{format_bytes(min_bytes)} per process)")
    return _finish("deleted_open_files", [], warnings, ok, details)


# ------------------------------------------------------------------------------------------------
# Permission, fds, io backend, memlock


def check_writable(directory: str | os.PathLike, *, rank: int | None = None) -> None:
    """Create, write, fsync and unlink a probe file in ``directory`` (or its nearest existing
    parent when it does not exist yet, since save() will create it there).

    Uses O_CREAT|O_EXCL with a unique name, so it never touches an existing file; the probe is
    always closed and removed, also on failure.

    Raises:
        StoragePermissionError: EACCES, EPERM or EROFS (errno kept).
        DiskFullError: ENOSPC/EDQUOT, e.g. no inode left for the probe.
        StorageError: any other OS error (via errors.from_os_error).
    """
    directory = os.fspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise from_os_error(OSError(_errno.ENOTDIR, os.strerror(_errno.ENOTDIR), directory),
                            path=directory, rank=rank, operation="use as checkpoint directory")
    target = _existing_dir(directory)
    probe = os.path.join(target, f".distckpt-probe-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    fd = -1
    created = False
    op = "create probe file"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        created = True
        op = "write probe file"
        os.write(fd, b"\0")
        op = "fsync probe file"
        os.fsync(fd)
        op = "close probe file"
        os.close(fd)
        fd = -1
        op = "unlink probe file"
        os.unlink(probe)
        created = False
    except OSError as exc:
        raise from_os_error(exc, path=target, rank=rank, operation=op) from exc
    finally:
        if fd >= 0:
            os.close(fd)
        if created:
            try:
                os.unlink(probe)
            except OSError:
                pass


def writable_check(path: str | os.PathLike, *, rank: int | None = None) -> CheckResult:
    """:func:`check_writable` as a CheckResult."""
    target = _existing_dir(path)
    try:
        check_writable(path, rank=rank)
    except DistCkptError as exc:
        return CheckResult("writable", ERROR, exc.message, {"dir": target}, exc)
    note = "" if os.path.abspath(os.fspath(path)) == target else " (nearest existing parent)"
    return CheckResult("writable", OK, f"{target}{note} is writable (probe created, written, "
                       "fsynced and removed)", {"dir": target})


def _open_fd_count() -> int:
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # minus the fd listdir itself used
    except OSError:
        return 0


def check_fd_limit(n_needed: int, *, rank: int | None = None, path: str | None = None) -> None:
    """Raise unless ``n_needed`` more fds fit under RLIMIT_NOFILE next to the ones open now.
    ``path`` (the checkpoint the fds are for) is carried by the error.

    Raises:
        TooManyOpenFilesError: errno EMFILE, fields ``needed``, ``open``, ``limit``, ``hard``.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    n_open = _open_fd_count()
    if n_open + n_needed <= soft:
        return
    hard_txt = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    if hard == resource.RLIM_INFINITY or hard >= n_open + n_needed:
        remedy = (f"Raise the soft limit up to the hard limit ({hard_txt}): `ulimit -n {hard_txt}` "
                  "before launching, or resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard)).")
    else:
        remedy = (f"The hard limit ({hard_txt}) is too low as well: raise it (limits.conf, "
                  "docker --ulimit nofile=65536:65536, systemd LimitNOFILE) or close files the job "
                  "keeps open.")
    raise TooManyOpenFilesError(
        f"the save needs {n_needed} file descriptors but only {max(soft - n_open, 0)} are left "
        f"({n_open} open, RLIMIT_NOFILE soft limit {soft}, hard limit {hard_txt})",
        rank=rank, path=path, errno=_errno.EMFILE, remedy=remedy, needed=n_needed, open=n_open,
        limit=soft, hard=hard)


def fd_limit_check(n_needed: int, *, rank: int | None = None) -> CheckResult:
    """:func:`check_fd_limit` as a CheckResult."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    n_open = _open_fd_count()
    details = {"needed": n_needed, "open": n_open, "soft": soft, "hard": hard}
    try:
        check_fd_limit(n_needed, rank=rank)
    except TooManyOpenFilesError as exc:
        return CheckResult("fd_limit", ERROR, exc.message, details, exc)
    return CheckResult("fd_limit", OK, f"{n_needed} fds needed, {n_open} open, RLIMIT_NOFILE {soft} "
                       f"(hard {hard})", details)


def io_backend_check(path: str | os.PathLike) -> CheckResult:
    """Report which distckpt.storage.posix backend (io_uring, O_DIRECT pwrite, buffered) will run and why.

    distckpt.storage.posix is imported here, lazily: when it cannot be imported the result is a warning
    "unknown (io module not available yet)". A forced backend that cannot run here is an error
    carrying its IOBackendUnavailableError.
    """
    try:
        from distckpt.storage.posix import choose_backend
    except ImportError as exc:
        return CheckResult("io_backend", WARNING, "unknown (io module not available yet)",
                           {"import_error": str(exc)})
    target = _existing_dir(path)
    try:
        choice = choose_backend(target)
    except IOBackendUnavailableError as exc:
        return CheckResult("io_backend", ERROR, exc.message, {"dir": target}, exc)
    except DistCkptError as exc:  # e.g. a ConfigError for a bad DISTCKPT_IO_BACKEND
        return CheckResult("io_backend", ERROR, exc.message, {"dir": target}, exc)
    details = {k: getattr(choice, k, None) for k in ("name", "reason", "mem_align", "offset_align",
                                                     "directory")}
    return CheckResult("io_backend", OK, f"{details['name']}: {details['reason']} (memory alignment "
                       f"{details['mem_align']}, offset alignment {details['offset_align']})", details)


def memlock_check(*, pinned: bool | None = None, min_bytes: int = 64 << 20) -> CheckResult:
    """Check RLIMIT_MEMLOCK when pinned host memory will be used (warning only).

    Pinned memory is used when CUDA is available (``pinned=None`` asks torch). Locked pages count
    against RLIMIT_MEMLOCK for io_uring registered buffers and InfiniBand memory registration
    (NCCL's "ibv_reg_mr failed" in containers with the default 64 KiB-8 MiB limit), so a low limit
    makes those fail or fall back to slower pageable copies.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    details = {"soft": soft, "hard": hard, "min_bytes": min_bytes}
    if pinned is None:
        try:
            import torch
            pinned = bool(torch.cuda.is_available())
        except Exception:
            pinned = False
    details["pinned"] = pinned
    fmt = lambda v: "unlimited" if v == resource.RLIM_INFINITY else format_bytes(v)  # noqa: E731
    if not pinned:
        return CheckResult("memlock", OK, f"not relevant: no pinned memory without CUDA "
                           f"(RLIMIT_MEMLOCK {fmt(soft)})", details)
    if soft != resource.RLIM_INFINITY and soft < min_bytes:
        return CheckResult("memlock", WARNING, f"RLIMIT_MEMLOCK is {fmt(soft)} (hard {fmt(hard)}), "
                           f"below {format_bytes(min_bytes)}: pinned staging buffers and InfiniBand "
                           "registration may fail or fall back to pageable copies; raise it with "
                           "`ulimit -l unlimited` (docker --ulimit memlock=-1)", details)
    return CheckResult("memlock", OK, f"RLIMIT_MEMLOCK {fmt(soft)} (hard {fmt(hard)})", details)


# ------------------------------------------------------------------------------------------------
# The whole run


def _is_object_url(path: str) -> bool:
    """An fsspec URL of an object store (``s3://...``); ``file://`` is a local path."""
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.isidentifier() and scheme != "file"



def _object_store_results(path: str, storage_options: Mapping[str, Any] | None, rank: int | None) -> list:
    """The object-store checks of :mod:`distckpt.storage.object.check` as CheckResults (the report)."""
    from .storage.object.check import run_checks  # loads the S3 client stack only for an object-store path
    results = []
    for name, msg, details, err in run_checks(path, storage_options, rank, probe=True):
        if err is None:
            results.append(CheckResult(name, OK, msg, details))
        else:
            results.append(CheckResult(name, ERROR, getattr(err, "message", str(err)), dict(details), err))
    return results

def preflight(
    path: str | os.PathLike,
    *,
    expected_bytes: int | None = None,
    world_size: int | None = None,
    backend: str | None = None,
    local_world_size: int | None = None,
    shm_bytes_needed: int | None = None,
    keep_last: int | None = None,
    raise_on_error: bool = False,
    env: Mapping[str, str] | None = None,
    fds_needed: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> PreflightReport:
    """Run every pre-flight check for a save to ``path`` and return the report.

    Safe to call before ``init_process_group``; it never writes anything but a removed probe file.

    Args:
        path: The checkpoint directory (it need not exist yet).
        expected_bytes: Bytes the save writes to that file system (sum over ranks on a shared FS).
        world_size: Expected number of ranks (checked against WORLD_SIZE; sizes the inode need).
        backend: The torch.distributed backend ("nccl", "gloo", "cpu:gloo,cuda:nccl").
        local_world_size: Ranks on this node (default LOCAL_WORLD_SIZE); sizes the /dev/shm need.
        shm_bytes_needed: Extra /dev/shm bytes the job needs (DataLoader workers).
        keep_last: Rotation setting; the new checkpoint must fit next to the old ones.
        raise_on_error: Raise the first failing check's typed error instead of returning.
        env: Environment to check instead of os.environ.
        fds_needed: fds a save opens; default 64 + the number of files it writes.
        storage_options: fsspec options for an object-store URL (``s3://...``), as save() takes;
            without them the standard AWS variables are used.

    Raises:
        DistCkptError: only with ``raise_on_error=True``: the typed error of the first failing
            check (DistributedEnvError, SharedMemoryError, DiskFullError, ...).
    """
    path = os.fspath(path)
    if path.startswith("file://"):
        path = path[len("file://"):]
    env_map = _env_of(env)
    rank = _rank_of(env_map)
    n_files = (world_size or _int_or_none(env_map.get("WORLD_SIZE")) or 1) + 4  # data + MANIFEST, dirs
    fds = fds_needed if fds_needed is not None else 64 + n_files

    steps: list[tuple[str, Callable[[], CheckResult]]] = [
        ("torchrun_env", lambda: torchrun_env_check(env_map, world_size=world_size,
                                                    local_world_size=local_world_size)),
        ("socket_ifname", lambda: socket_ifname_check(env_map)),
        ("nccl_ib_hca", lambda: ib_hca_check(env_map)),
        ("nccl_vars", lambda: nccl_vars_check(env_map)),
        ("backend_devices", lambda: backend_devices_check(backend, env_map,
                                                          local_world_size=local_world_size)),
        ("shm", lambda: shm_check(backend=backend, local_world_size=local_world_size,
                                  shm_bytes_needed=shm_bytes_needed, env=env_map)),
    ]
    if _is_object_url(path):
        steps += [("object_store", lambda: _object_store_results(path, storage_options, rank))]
    else:
        steps += [
            ("disk", lambda: disk_check(path, expected_bytes, keep_last=keep_last, n_files=n_files,
                                        rank=rank)),
            ("tmpdir", lambda: tmpdir_check(path, expected_bytes, env_map)),
            ("deleted_open_files", lambda: deleted_open_files_check(path)),
            ("writable", lambda: writable_check(path, rank=rank)),
        ]
    steps += [("fd_limit", lambda: fd_limit_check(fds, rank=rank))]
    if not _is_object_url(path):
        steps += [("io_backend", lambda: io_backend_check(path))]
    steps += [("memlock", lambda: memlock_check())]
    results = []
    for name, run in steps:
        try:
            result = run()
            results.extend(result if isinstance(result, list) else [result])
        except Exception as exc:  # a broken probe must not hide the other checks
            results.append(CheckResult(name, WARNING, f"check could not run: {type(exc).__name__}: "
                                       f"{exc}", {"traceback": traceback.format_exc()}))
    report = PreflightReport(path, results)
    if raise_on_error:
        report.raise_first()
    return report


# ------------------------------------------------------------------------------------------------
# CLI

# One size convention for the whole package (distckpt.sizes): 60G = 60 GiB.
parse_size = _sizes.parse_size


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="checkpoint directory (need not exist yet), or an object-store URL "
                                "(s3://bucket/prefix; credentials and endpoint from the AWS variables)")
    p.add_argument("--expected-bytes", type=_size_arg, default=None, metavar="SIZE",
                   help="bytes the save writes to that file system, e.g. 60G (= 60 GiB; "
                        f"{_sizes.CONVENTION})")
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
    """Run the checks for parsed CLI arguments, print the table (or JSON); 1 on any error."""
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
                              "a save", description=__doc__.split("\n\n")[0])
    _configure(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m distckpt.preflight PATH ...``: the same as ``distckpt preflight``."""
    parser = argparse.ArgumentParser(prog="distckpt preflight")
    _configure(parser)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
