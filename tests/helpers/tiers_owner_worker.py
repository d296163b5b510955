"""One process of tests/s3/test_tiers_owner.py: a TieredCheckpointManager that owns a remote tier.

Usage: python tiers_owner_worker.py MODE LOCAL REMOTE  (storage options as JSON in TIERS_OPTIONS)

Prints one JSON line per event. Modes:
  hold   build the manager, print {"ready"}, then sleep until killed
  lose   build it (keep_last_remote=1), save step 1 and wait until it is durable, print {"ready"};
         on the stdin line "go": save step 2 and print {"drain": status(2)} once its drain has
         tried (retrying, failed or committed); on "again": wait until step 2 is durable, print
         {"durable"}, close
  freeze as lose, with steps 10 and 20, and on "go" the process stops itself (SIGSTOP) when the
         drain of step 20, published, starts to rotate the remote tier: an owner frozen between
         its publish and its rotation
"""

import json
import sys
import time

import torch

from distckpt.tiers import TieredCheckpointManager


def _emit(rec: dict) -> None:
    sys.stdout.write(json.dumps(rec) + "\n")
    sys.stdout.flush()


def _status(mgr, step: int) -> dict:
    st = mgr.status(step)
    return {"remote": st.remote, "error": type(st.error).__name__ if st.error else None,
            "message": str(st.error) if st.error else None}


def main() -> None:
    import os
    mode, local, remote = sys.argv[1:4]
    options = json.loads(os.environ["TIERS_OPTIONS"])
    if mode == "hold":
        TieredCheckpointManager(local, remote, storage_options=options)
        _emit({"ready": True})
        while True:
            time.sleep(60)
    first, second = (10, 20) if mode == "freeze" else (1, 2)
    mgr = TieredCheckpointManager(local, remote, storage_options=options, keep_last_remote=1)
    mgr.save(first, {"w": torch.arange(1000.0), "step": first})
    mgr.wait_durable(first, timeout=120)
    _emit({"ready": True})
    assert sys.stdin.readline().strip() == "go"
    if mode == "freeze":
        import os
        import signal

        from distckpt import CheckpointManager
        rotate_after = CheckpointManager.rotate_after

        def frozen_once(self, step, **kwargs):
            CheckpointManager.rotate_after = rotate_after
            os.kill(os.getpid(), signal.SIGSTOP)
            return rotate_after(self, step, **kwargs)

        CheckpointManager.rotate_after = frozen_once
    mgr.save(second, {"w": torch.arange(1000.0) * 2, "step": second})
    deadline = time.monotonic() + 120
    while _status(mgr, second)["remote"] in ("queued", "draining") and time.monotonic() < deadline:
        time.sleep(0.05)
    _emit({"drain": _status(mgr, second)})
    assert sys.stdin.readline().strip() == "again"
    mgr.wait_durable(second, timeout=120)
    _emit({"durable": True})
    mgr.close()


if __name__ == "__main__":
    main()
