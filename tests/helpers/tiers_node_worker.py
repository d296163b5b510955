"""One rank of the simulated multi-node tiered jobs of tests/s3/test_tiers_manager.py (torchrun).

Usage: torchrun ... tests/helpers/tiers_node_worker.py PHASE OUT_DIR [STEPS]

Each "node" (torchrun agent) has its own private local tier, TIERS_LOCAL; the remote tier is
TIERS_REMOTE (an s3:// URL) with the storage options in TIERS_OPTIONS (JSON). Every rank prints
one JSON line starting with {"rank". Phases:

  train     save STEPS (comma-separated), wait until the last is durable, close
  restore   load the newest complete step (or TIERS_STEP), check it bit for bit, close
  kill      save 10 (durable), save 20, then node 1 exits at once (its drain in flight)
  killrep   (replicas) save 10 (durable, replicated), save 20, then node 1 exits at once: its
            replication of step 20 in flight
  outage    save 10 (durable); OUT/ready; wait for OUT/down; save 20 and 30 (the server is down);
            OUT/saved-RANK with their status; wait for OUT/up; wait until 30 is durable; close
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist



def _emit(rec: dict) -> None:
    """One record per line, in one write: the ranks share torchrun's stdout, and print() (unbuffered
    under torchrun) writes the text and its newline apart, so two ranks' records could land on one
    line. A single write of a line under PIPE_BUF bytes is atomic on a pipe."""
    sys.stdout.write(json.dumps(rec) + "\n")
    sys.stdout.flush()

def expected(step: int) -> dict:
    """The full (unsharded) values of ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    big = int(os.environ.get("TIERS_BIG_ROWS", 1 << 16))
    return {
        "w": torch.randn(37, 11, generator=g),                       # uneven over 2 or 3 ranks
        "emb": torch.randn(300, 64, generator=g).to(torch.bfloat16),
        "big": torch.randn(big, 16, generator=g),                    # 4 MiB by default
    }


def sharded(step: int, mesh) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor
    return {"model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in expected(step).items()},
            "step": step}


def blank(mesh) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor
    return {"model": {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in expected(0).items()},
            "step": -1}


def same(sd: dict, step: int) -> bool:
    want = expected(step)
    for k, v in want.items():
        full = sd["model"][k].full_tensor()
        if full.dtype != v.dtype or not torch.equal(full.view(torch.uint8) if full.dtype == torch.bfloat16 else full,
                                                    v.view(torch.uint8) if v.dtype == torch.bfloat16 else v):
            return False
    return sd["step"] == step


def wait_file(path: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.1)


def main() -> None:
    phase, out = sys.argv[1], sys.argv[2]
    steps = [int(s) for s in sys.argv[3].split(",")] if len(sys.argv) > 3 else []
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh

    from distckpt import errors
    from distckpt.tiers import TieredCheckpointManager

    mesh = init_device_mesh("cpu", (world,))
    node = int(os.environ.get("GROUP_RANK", 0))
    rec = {"rank": rank, "world": world, "node": node}
    mgr = TieredCheckpointManager(os.environ["TIERS_LOCAL"], os.environ["TIERS_REMOTE"], keep_last_local=2,
                                  keep_last_remote=int(os.environ.get("TIERS_KEEP_REMOTE", 3)),
                                  storage_options=json.loads(os.environ["TIERS_OPTIONS"]),
                                  replicas=int(os.environ.get("TIERS_REPLICAS", 0)))
    close_timeout = float(os.environ.get("TIERS_CLOSE_TIMEOUT", 600))

    def statuses(which):
        return {s: [mgr.status(s).local, mgr.status(s).remote, mgr.status(s).replicas] for s in which}

    if phase == "train":
        for s in steps:
            mgr.save(s, sharded(s, mesh))
        mgr.wait_durable(steps[-1], timeout=180)
        mgr.close()
        rec.update(local=mgr._local.steps(), remote=mgr._remote.steps(), status=statuses(steps))
    elif phase == "restore":
        sd = blank(mesh)
        t_load = time.monotonic()
        step = int(os.environ["TIERS_STEP"]) if os.environ.get("TIERS_STEP") else None
        result = mgr.load(sd, step)
        rec.update(step=sd["step"], ok=same(sd, sd["step"]), by_tier=getattr(result, "bytes_by_tier", None),
                   from_peers=result.bytes_from_peers, seconds=time.monotonic() - t_load)
        try:
            mgr.close(timeout=close_timeout)
            rec["closed"] = "ok"
        except errors.NotDurableError as exc:
            rec["closed"] = f"NotDurableError: {exc.steps}"
        try:
            remote = mgr._remote.steps()
        except errors.ObjectStoreError:  # the remote tier down (a restore that must not need it)
            remote = None
        rec.update(local=mgr._local.steps(), remote=remote)
    elif phase == "kill":
        mgr.save(10, sharded(10, mesh))
        mgr.wait_durable(10, timeout=180)
        mgr.save(20, sharded(20, mesh))
        if node == 1:
            _emit(rec | {"exiting": True})
            os._exit(9)  # a node lost while the drain of step 20 is in flight
        try:
            mgr.wait_durable(20, timeout=240)
            rec["durable20"] = True
        except errors.NotDurableError as exc:
            rec["durable20"] = f"{type(exc.__cause__ or exc).__name__}"
        try:
            mgr.close(timeout=60)
        except errors.NotDurableError as exc:
            rec["closed"] = exc.steps
    elif phase == "killrep":
        mgr.save(10, sharded(10, mesh))
        mgr.wait_durable(10, timeout=180)
        rec["replicas10"] = mgr.status(10).replicas
        mgr.save(20, sharded(20, mesh))
        if node == 1:
            _emit(rec | {"exiting": True})
            os._exit(9)  # a node lost while the replication of step 20 is in flight
        t0 = time.monotonic()
        try:
            mgr.wait_durable(20, timeout=240)
        except errors.NotDurableError:
            pass
        rec["replicas20"] = mgr.status(20).replicas
        rec["waited_s"] = time.monotonic() - t0
        try:
            mgr.close(timeout=60)
        except errors.NotDurableError as exc:
            rec["closed"] = exc.steps
        rec["closed_s"] = time.monotonic() - t0
    elif phase == "outage":
        mgr.save(10, sharded(10, mesh))
        mgr.wait_durable(10, timeout=180)
        open(os.path.join(out, f"ready-{rank}"), "w").close()
        wait_file(os.path.join(out, "down"))
        t0 = time.monotonic()
        mgr.save(20, sharded(20, mesh))
        mgr.save(30, sharded(30, mesh))
        rec["saves_while_down_s"] = time.monotonic() - t0
        time.sleep(3)  # the drain of 20 has met the dead server
        rec["while_down"] = {s: [mgr.status(s).local, mgr.status(s).remote, type(mgr.status(s).error).__name__]
                             for s in (20, 30)}
        open(os.path.join(out, f"saved-{rank}"), "w").close()
        wait_file(os.path.join(out, "up"))
        mgr.wait_durable(30, timeout=240)
        mgr.close()
        rec.update(local=mgr._local.steps(), remote=mgr._remote.steps(), status=statuses([10, 20, 30]))
    _emit(rec)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
