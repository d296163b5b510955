"""Run a test body on N real gloo ranks (spawned processes, a real TCP rendezvous on loopback).

Usage::

    def _body(rank, world_size, tmp):          # module level: spawn pickles it by name
        ...
        return something_picklable

    def test_x(tmp_path):
        results = run_ranks(_body, 2, str(tmp_path))   # [result of rank 0, result of rank 1]

A rank that raises makes run_ranks raise RankError carrying every rank's traceback; a rank that
hangs past ``timeout`` is killed and run_ranks raises TimeoutError, so a test can never hang CI.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import socket
import traceback
from typing import Any, Callable

__all__ = ["run_ranks", "RankError", "free_port", "kill_tree"]


class RankError(AssertionError):
    """One or more ranks raised. ``errors``: {rank: (exception or None, traceback text)};
    ``results``: {rank: what it returned} for the ranks that did not."""

    def __init__(self, errors: dict[int, tuple[BaseException | None, str]], results: dict[int, Any] | None = None):
        self.errors = errors
        self.results = dict(results or {})
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, (_, tb) in sorted(errors.items()))
        super().__init__(f"rank(s) {sorted(errors)} failed:\n{text}")


#: What the ranks of run_ranks are forked with by default: torch imported once in the fork server.
DEFAULT_PRELOAD = ["torch", "torch.distributed"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, port, args, kwargs, env, queue, init_pg, parent_env):
    # The caller's environment as it is now (a test's monkeypatch.setenv included), as a spawned
    # rank would inherit it: a rank forked from the fork server would otherwise have the
    # environment the server started with, the first caller's.
    os.environ.clear()
    os.environ.update(parent_env)
    os.environ.update(env)
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })
    try:
        import datetime

        import torch.distributed as dist
        if init_pg:
            dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=60))
        try:
            result = fn(rank, world_size, *args, **kwargs)
        finally:
            if init_pg and dist.is_initialized():
                dist.destroy_process_group()
        queue.put((rank, "ok", pickle.dumps(result), ""))
    except BaseException as exc:  # noqa: BLE001 - report everything, including SystemExit
        try:
            blob = pickle.dumps(exc)
        except Exception:
            blob = None
        queue.put((rank, "err", blob, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
              env: dict[str, str] | None = None, init_process_group: bool = True,
              preload: list[str] | None = None, check_exit: bool = False, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned gloo ranks.

    ``preload``: modules to import once in a fork server; the ranks are then forked from it
    instead of spawned (each spawned rank imports torch and the like anew: seconds per rank on
    this 2-core machine, most of a short multi-rank test's time). The fork server is this
    process's (multiprocessing's "forkserver" context): the first call that starts it fixes its
    preload. Default (None): torch and torch.distributed (:data:`DEFAULT_PRELOAD`); ``[]``: every
    rank spawned, a fresh interpreter (for what must run before torch is imported).

    ``check_exit``: a rank whose process then exits with a non-zero code (SIGABRT at interpreter
    finalization, after it reported its result) counts as failed too. Its ranks are spawned: a rank
    forked from the fork server leaves through os._exit, without finalization.

    Returns the per-rank results in rank order. Raises RankError if any rank raised (with all
    tracebacks, or the exit code of a rank that died without reporting), TimeoutError if the
    ranks did not all finish within ``timeout`` seconds (the stragglers are killed first).
    """
    if check_exit:
        preload = []  # a forked rank leaves through os._exit: its exit code would say nothing
    elif preload is None:
        preload = DEFAULT_PRELOAD
    ctx = mp.get_context("forkserver" if preload else "spawn")
    if preload:
        ctx.set_forkserver_preload(preload)  # effective when this process starts its fork server
    queue = ctx.Queue()
    port = free_port()
    parent_env = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, kwargs, env or {}, queue,
                                              init_process_group, parent_env), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, tuple[BaseException | None, str]] = {}
    import queue as _queue
    import time
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(results) - set(errors))} "
                                   f"did not finish within {timeout} s")
            try:
                rank, status, blob, tb = queue.get(timeout=min(remaining, 1.0))
            except _queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in results and r not in errors]
                for r in dead:
                    errors[r] = (None, f"process exited with code {procs[r].exitcode} before reporting")
                continue
            if status == "ok":
                results[rank] = pickle.loads(blob)
            else:
                errors[rank] = (pickle.loads(blob) if blob else None, tb)
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
                p.join()
    if check_exit:
        for r, p in enumerate(procs):
            if p.exitcode != 0 and r not in errors:
                errors[r] = (None, f"process exited with code {p.exitcode} after reporting its result")
    if errors:
        raise RankError(errors, results)
    return [results[r] for r in range(world_size)]


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process descended from it, parents first (so none spawns more):
    torchrun starts each rank in a session of its own, and a rank's children (the compiler a
    DeepSpeed op build runs) hold the output pipe open."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(entry))
    todo = [pid]
    while todo:
        p = todo.pop(0)
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
        todo += children.get(p, [])
