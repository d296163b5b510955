"""NCCL and Gloo: the variables that pick their network interfaces and InfiniBand devices, the
values and names of the NCCL_* variables, and whether the process-group backend can run on this
machine's devices. Each check returns a :class:`~distckpt.checks.report.CheckResult`; a wrong
setting is a DistributedEnvError naming the variable, what was expected and what was found."""

from __future__ import annotations

import difflib
import os
import re
import socket
from typing import Any, Iterable, Mapping

from ..errors import DistCkptError, DistributedEnvError
from .environment import env_error, env_of, int_or_none, rank_of
from .report import OK, CheckResult, finish

__all__ = [
    "NCCL_BOOL_VARS",
    "NCCL_INT_VARS",
    "NCCL_KNOWN_VARS",
    "list_interfaces",
    "socket_ifname_check",
    "ib_hca_check",
    "nccl_vars_check",
    "backend_devices_check",
    "backend_parts",
]


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
        errors.append(env_error(var, f"{var}={value!r} lists no {what}",
                                 expected=f"a comma-separated list of {what} names", found=repr(value),
                                 rank=rank, remedy=remedy, existing=existing))
        return []
    hits = {e: [n for n in existing if _entry_matches(e, n, exact)] for e in entries}
    if exclude:
        used = [n for n in existing if not any(_entry_matches(e, n, exact) for e in entries)]
        if not used:
            errors.append(env_error(
                var, f"{var}={value!r} excludes every {what} ({mode} match); {what}s here: {have}",
                expected=f"at least one {what} left after the exclusion", found="none left",
                rank=rank, remedy=remedy, existing=existing))
        return used
    used = [n for n in existing if any(_entry_matches(e, n, exact) for e in entries)]
    missing = [e for e, h in hits.items() if not h]
    if not used:
        hints = "".join(_hint(e, existing) for e in missing[:1])
        errors.append(env_error(
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
    env = env_of(env)
    rank = rank_of(env)
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
            errors.append(env_error(
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
    return finish("socket_ifname", errors, warnings, ok, details)


def ib_hca_check(env: Mapping[str, str] | None = None, *,
                 ib_root: str = "/sys/class/infiniband") -> CheckResult:
    """Check that NCCL_IB_HCA names InfiniBand devices (and ``:port`` suffixes) that exist.

    Same ``^`` / ``=`` syntax as NCCL_SOCKET_IFNAME. When NCCL_IB_DISABLE=1 the variable is unused
    and only noted.
    """
    env = env_of(env)
    rank = rank_of(env)
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
                errors.append(env_error(
                    "NCCL_IB_HCA", f"NCCL_IB_HCA: device {dev} has no port {port}",
                    expected=f"a port of {dev}: {', '.join(ports) or 'none'}", found=port,
                    rank=rank, remedy=remedy))
    details["nccl_devices"] = used
    return finish("nccl_ib_hca", errors, warnings, f"NCCL uses InfiniBand devices {', '.join(used)}",
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
    env = env_of(env)
    rank = rank_of(env)
    errors: list[DistCkptError] = []
    warnings: list[str] = []
    unknown: dict[str, str | None] = {}
    seen = sorted(k for k in env if k.startswith("NCCL_"))
    for name in seen:
        value = env[name]
        if name in NCCL_BOOL_VARS:
            if value.strip() not in ("0", "1"):
                errors.append(env_error(
                    name, f"{name}={value!r} is not 0 or 1 (NCCL parses it as an integer, so "
                    f"{value!r} reads as {_strtoll(value)})", expected="0 or 1", found=repr(value),
                    rank=rank, remedy=f"Set {name}=1 to turn it on or {name}=0 to turn it off."))
        elif name in NCCL_INT_VARS:
            try:
                int(value.strip(), 0)
            except ValueError:
                errors.append(env_error(
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
    return finish("nccl_vars", errors, warnings, ok, details)


def _strtoll(value: str) -> int:
    """What C's strtoll(value, NULL, 0) returns: the leading integer, 0 when there is none."""
    m = re.match(r"\s*([+-]?(?:0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*))", value)
    return int(m.group(1), 0) if m and m.group(1) not in ("+", "-") else 0


_KNOWN_PG_BACKENDS = ("nccl", "gloo", "mpi", "ucc", "xccl", "hccl", "fake")


def backend_parts(backend: str) -> list[str]:
    """The backends a process-group backend string names, lower-case: 'nccl' -> ['nccl'];
    'cpu:gloo,cuda:nccl' -> ['gloo', 'nccl']."""
    return [p.split(":", 1)[-1].strip().lower() for p in backend.split(",") if p.strip()]


def backend_devices_check(backend: str | None, env: Mapping[str, str] | None = None, *,
                          local_world_size: int | None = None) -> CheckResult:
    """Check that the process-group backend can run on this machine's devices.

    ``nccl`` needs CUDA (torch.cuda.is_available()) and at least one visible GPU per local rank
    (two ranks on one GPU fail inside NCCL with "Duplicate GPU detected"). Gloo runs anywhere.
    """
    env = env_of(env)
    rank = rank_of(env)
    if not backend:
        return CheckResult("backend_devices", OK, "no process-group backend given")
    parts = backend_parts(backend)
    errors: list[DistCkptError] = []
    unknown = [p for p in parts if p not in _KNOWN_PG_BACKENDS]
    if unknown or not parts:
        errors.append(DistributedEnvError(
            f"unknown process-group backend {backend!r} (expected nccl, gloo, mpi, ucc or a "
            f"'cpu:gloo,cuda:nccl' map, found {backend!r})", variable=None, backend=backend,
            rank=rank, remedy="Pass backend='nccl' on GPUs or backend='gloo' on CPUs."))
        return finish("backend_devices", errors, [], "", {"backend": backend})
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
            lws = local_world_size or int_or_none(env.get("LOCAL_WORLD_SIZE"))
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
    return finish("backend_devices", errors, [], ok, details)

