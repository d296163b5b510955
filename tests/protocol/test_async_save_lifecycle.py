"""Async saves against the process's own lifecycle calls, on real gloo ranks: the process group
destroyed under a save in flight, a staging reservation right before a save, and
CheckpointManager.close() deciding an unread background failure with every rank."""

from __future__ import annotations

import os
import threading
import time

import torch

import distckpt
from distckpt.errors import PeerLostError, ProcessGroupDestroyedError

from ..helpers.distributed import run_ranks


def _destroyed_body(rank, world, tmp):
    import torch.distributed as dist

    import distckpt.save_async as sa
    from distckpt.commit import finish_save
    go = threading.Event()

    def held_finish(*args, **kwargs):  # the background phases start only once the group is gone
        assert go.wait(60)
        return finish_save(*args, **kwargs)

    sd = {f"w{rank}": torch.full((1 << 16,), float(rank))}
    out = {}
    # 1. The caller reads the handle.
    h = sa.async_save_in_root(sd, os.path.join(tmp, "read"), finish=held_finish)
    dist.destroy_process_group()
    go.set()
    t0 = time.monotonic()
    exc = h.exception(timeout=120)
    out["read"] = {"type": type(exc).__name__, "is_peer_lost": isinstance(exc, PeerLostError),
                   "committed": getattr(exc, "committed", "absent"), "path": getattr(exc, "path", None),
                   "cause": type(exc.__cause__).__name__, "destroyed_in_msg": "destroy" in str(exc),
                   "seconds": time.monotonic() - t0}
    # 2. Nobody reads it: the next checkpoint call raises it (no group is left to decide it on).
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{tmp}/rdzv2",
                            timeout=__import__("datetime").timedelta(seconds=60))
    go.clear()
    h = sa.async_save_in_root(sd, os.path.join(tmp, "unread"), finish=held_finish)
    dist.destroy_process_group()
    go.set()
    assert h.wait(120)
    try:
        distckpt.save(sd, os.path.join(tmp, f"alone{rank}"))
        out["next"] = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["next"] = type(exc).__name__
    out["alone_exists"] = os.path.exists(os.path.join(tmp, f"alone{rank}"))
    distckpt.save(sd, os.path.join(tmp, f"alone{rank}"), overwrite=True)  # reported once; saves go on
    return out


def test_destroying_the_group_under_a_save_is_not_a_lost_peer(tmp_path):
    """destroy_process_group() while a collective async save is in flight: every rank's handle
    fails at once with ProcessGroupDestroyedError (not PeerLostError: no peer was lost), saying
    nothing is committed; an unread one is raised at the next checkpoint call. Nothing commits."""
    out = run_ranks(_destroyed_body, 2, str(tmp_path), timeout=240, env={"DISTCKPT_TIMEOUT_S": "60"})
    for o in out:
        r = o["read"]
        assert r["type"] == "ProcessGroupDestroyedError" and not r["is_peer_lost"], r
        assert r["committed"] is False and r["path"] == str(tmp_path / "read") and r["destroyed_in_msg"]
        assert r["cause"] == "PeerLostError" and r["seconds"] < 30
        assert o["next"] == "ProcessGroupDestroyedError" and o["alone_exists"] is False
    assert not (tmp_path / "read").exists() and not (tmp_path / "unread").exists()
    assert issubclass(ProcessGroupDestroyedError, distckpt.errors.DistributedEnvError)
