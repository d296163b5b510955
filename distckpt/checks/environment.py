"""The torchrun environment: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT, checked before ``init_process_group`` turns a wrong one into "Transport endpoint is
not connected" or a rendezvous timeout; and how every check reads the environment (an explicit
mapping, or ``os.environ``)."""

from __future__ import annotations

import errno
import os
import socket
import threading
from typing import Any, Mapping

from ..errors import DistCkptError, DistributedEnvError
from .report import CheckResult, finish

__all__ = ["TORCHRUN_VARS", "torchrun_env_check", "env_of", "int_or_none", "rank_of", "env_error"]


def env_of(env: Mapping[str, str] | None) -> Mapping[str, str]:
    """``env``, or ``os.environ`` when it is None: every check reads its variables from here."""
    return os.environ if env is None else env


def int_or_none(value: str | None) -> int | None:
    """``value`` as an int, None when it is missing or not an integer. Never raises."""
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def rank_of(env: Mapping[str, str]) -> int | None:
    """This process's RANK (what the typed errors carry), None when unset or not an integer."""
    return int_or_none(env.get("RANK"))


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


def env_error(var: str, message: str, *, expected: str, found: str, rank: int | None,
              remedy: str | None = None, **fields: Any) -> DistributedEnvError:
    """The DistributedEnvError of variable ``var``: the message says expected vs found, the remedy
    defaults to the torchrun one for ``var``. Returned, not raised, so a check can collect several."""
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


def _port_in_use(addrs: list[str], port: int) -> str | None:
    """The first of ``addrs`` that is an address of this host on which TCP ``port`` cannot be
    bound because something holds it (EADDRINUSE); None when it is free on every local one
    (addresses of other hosts are skipped: EADDRNOTAVAIL). The probe sets SO_REUSEADDR as
    torch's TCPStore does, so a previous run's TIME_WAIT connections do not count."""
    for a in addrs:
        family = socket.AF_INET6 if ":" in a else socket.AF_INET
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((a, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return a
        finally:
            sock.close()
    return None


def _own_store_may_hold_port(env: Mapping[str, str], rank: int | None) -> bool:
    """Whether MASTER_PORT may be in use by this job itself: under torchrun's agent
    (TORCHELASTIC_RUN_ID: its rendezvous store listens there), after init_process_group (rank 0's
    store), or on a rank other than 0 (rank 0's store may be up already)."""
    if env.get("TORCHELASTIC_RUN_ID") or (rank is not None and rank != 0):
        return True
    try:
        import torch.distributed as dist
        return dist.is_available() and dist.is_initialized()
    except ImportError:
        return False


def torchrun_env_check(env: Mapping[str, str] | None = None, *, world_size: int | None = None,
                       local_world_size: int | None = None,
                       resolve_timeout_s: float = 5.0) -> CheckResult:
    """Check the six torchrun variables.

    A plain single-process run with none of them set is fine. Once any is set, all six must be,
    the integer ones must parse, and 0 <= RANK < WORLD_SIZE, 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE <=
    WORLD_SIZE, 1 <= MASTER_PORT <= 65535, MASTER_ADDR resolvable. ``world_size`` /
    ``local_world_size``, when given, must agree with the environment. Where the job's own store
    cannot be holding it yet (not under torchrun's agent, rank 0 or no RANK, no process group
    initialized: a launcher's shell, or rank 0 before ``init_process_group``), a MASTER_PORT that
    is in use on a local MASTER_ADDR is a warning: the rendezvous would fail with "address
    already in use" (a previous job still running).

    Each failure is a :class:`DistributedEnvError` whose ``variable`` field names the variable and
    whose message says expected vs found: this is the error that otherwise surfaces as
    "Transport endpoint is not connected" or a rendezvous timeout.
    """
    env = env_of(env)
    rank = rank_of(env)
    present = {k: env[k] for k in TORCHRUN_VARS if k in env}
    errors: list[DistCkptError] = []
    warnings: list[str] = []
    details: dict[str, Any] = {"variables": present}

    if not present:
        if world_size is not None and world_size > 1:
            errors.append(env_error(
                "WORLD_SIZE", f"world_size={world_size} was requested but no torchrun variable is set",
                expected=str(world_size), found="unset", rank=rank,
                remedy="Launch the job with torchrun (or export RANK, WORLD_SIZE, LOCAL_RANK, "
                       "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT in every rank)."))
        return finish("torchrun_env", errors, warnings,
                       "single process (no torchrun variables set)", details)

    set_names = ", ".join(sorted(present))
    for var in TORCHRUN_VARS:
        if var not in present:
            errors.append(env_error(
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
            errors.append(env_error(var, f"{var}={raw!r} is not an integer",
                                     expected="an integer", found=repr(raw), rank=rank))

    def bad(var: str, msg: str, expected: str, value: int) -> None:
        errors.append(env_error(var, msg, expected=expected, found=str(value), rank=rank))

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
            errors.append(env_error("MASTER_ADDR", "MASTER_ADDR is empty",
                                     expected="a host name or IP", found="''", rank=rank))
        else:
            addrs, reason = _resolve(addr.strip(), port, resolve_timeout_s)
            if addrs:
                details["master_addr_resolves_to"] = addrs
                if port is not None and not _own_store_may_hold_port(env, r):
                    held = _port_in_use(addrs, port)
                    details["master_port_in_use"] = held is not None
                    if held is not None:
                        warnings.append(
                            f"MASTER_PORT={port} is in use on this host ({held}), before this job's "
                            f"rendezvous: its store would fail with 'address already in use' (a previous "
                            f"job still running?). Stop that process, or pick a free port "
                            f"(torchrun --master-port)")
            elif reason is not None:
                errors.append(env_error(
                    "MASTER_ADDR", f"MASTER_ADDR={addr!r} does not resolve: {reason}",
                    expected="a resolvable host name or IP", found=repr(addr), rank=rank))
            else:
                warnings.append(f"MASTER_ADDR={addr!r} did not resolve within {resolve_timeout_s:g} s "
                                "(slow or unreachable DNS): the rendezvous may time out")

    summary = (f"torchrun rank {r}/{ws} (local {lr}/{lws}), master "
               f"{addr}:{present.get('MASTER_PORT')}")
    return finish("torchrun_env", errors, warnings, summary, details)



def distckpt_config_check(env: Mapping[str, str] | None = None) -> CheckResult:
    """Check distckpt's own variables: every DISTCKPT_* value parses (the ConfigError a save would
    raise, named here in its own row instead of under whichever check reads it first), the
    object-store knobs too when ``env`` is this process's environment (they are read from it at
    each object-store save), and no DISTCKPT_* variable is one distckpt does not know (a typo: a
    warning naming the closest known one). Every bad variable is reported, not only the first.
    Never raises."""
    import warnings

    from ..config import load_config, warn_unknown_variables
    from ..errors import ConfigError
    env_map = dict(env_of(env))
    errors: list[DistCkptError] = []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        unknown = warn_unknown_variables(env_map)
        # load_config stops at the first bad value: each one found is taken out and the rest
        # parsed again, so one run of the check names every bad variable, not one per fix.
        parsed = dict(env_map)
        while True:
            try:
                load_config(parsed)
                break
            except ConfigError as exc:
                errors.append(exc)
                if parsed.pop(getattr(exc, "variable", None) or "", None) is None:
                    break  # an error no one variable is to blame for: parsing again would repeat it
        if env is None or env is os.environ:
            from ..storage.object import request as objrequest
            from ..storage.object import settings as objsettings
            for read in (objsettings.settings, objrequest.request_timeout):
                try:
                    read()
                except ConfigError as exc:
                    errors.append(exc)
    hints = [str(w.message) for w in said if any(name in str(w.message) for name in unknown)]
    notes = hints or [f"{name} is set but distckpt does not read it; it has no effect" for name in unknown]
    return finish("distckpt_config", errors, notes, "every DISTCKPT_* variable is known and valid",
                  {"unknown": unknown})
