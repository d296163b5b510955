"""One run of a job whose rank 0 may sit on a host with a skewed clock (tests/protocol/test_manager.py).

``python -m tests.helpers.skewed_clock_worker KIND DIR PHASE`` with ``SKEW`` seconds (the host's
clock that far behind; negative: ahead) in the environment; KIND ``manager`` (a CheckpointManager on
DIR/root), ``tiered`` (a TieredCheckpointManager, DIR/local and DIR/remote) or ``lightning``
(Lightning's CheckpointIO of distckpt with keep_last=2 in DIR/ckpt: PHASE ``save:A-B`` only, prints
the folder's checkpoints). PHASE ``save:A-B``
resumes from the newest step (if any) and saves steps A..B; ``load`` prints the step load() restores
and whether its tensor is the one saved at that step. One process per run, as a restart is."""

from __future__ import annotations

import json
import os
import sys
import time

import torch


def _state(step: int) -> dict:
    return {"w": torch.full((1024,), float(step)), "step": step}


def main() -> None:
    kind, root, phase = sys.argv[1:4]
    skew = float(os.environ.get("SKEW", "0"))
    if skew:
        real = time.time
        time.time = lambda: real() - skew  # the host's wall clock; monotonic clocks are untouched
    import distckpt
    from distckpt.tiers import TieredCheckpointManager
    if kind == "lightning":  # DistCkptCheckpointIO(keep_last=2) saving steps A..B into DIR/ckpt
        from distckpt.integrations.lightning import DistCkptCheckpointIO
        first, last = map(int, phase[5:].split("-"))
        io = DistCkptCheckpointIO(keep_last=2)
        for step in range(first, last + 1):
            io.save_checkpoint(_state(step), os.path.join(root, "ckpt", f"step={step}.ckpt"))
        io.teardown()
        print(json.dumps(sorted(n for n in os.listdir(os.path.join(root, "ckpt")) if not n.startswith("."))))
        return
    if kind == "manager":
        mgr = distckpt.CheckpointManager(os.path.join(root, "root"), keep_last=10)
    else:
        mgr = TieredCheckpointManager(os.path.join(root, "local"), os.path.join(root, "remote"),
                                      keep_last_local=10, keep_last_remote=10)
    out: dict = {}
    if phase.startswith("save:"):
        first, last = map(int, phase[5:].split("-"))
        if mgr.latest_step() is not None:
            got = {"w": torch.zeros(1024), "step": -1}
            mgr.load(got)
            out["resumed_from"] = got["step"]
        for step in range(first, last + 1):
            mgr.save(step, _state(step))
        if kind == "tiered":
            assert mgr.wait_durable(last, timeout=120).durable
    else:
        got = {"w": torch.zeros(1024), "step": -1}
        mgr.load(got)
        out = {"latest": mgr.latest_step(), "loaded": got["step"], "exact": torch.equal(got["w"], _state(got["step"])["w"])}
    if kind == "tiered":
        mgr.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
