"""torchrun worker of tests/protocol/test_distributed.py::test_ranks_exit_cleanly_right_after_a_save: a
2-rank save, after which rank 1 exits at once while rank 0 still works for a moment (the
shape of launch/examples/demo.py, whose rank 1 used to abort at exit now and then: "terminate called
without an active exception", from torch's gloo worker threads; see distckpt._dist).

DISTCKPT_TEST_NO_EXIT_HANDOFF=1 removes distckpt's exit hook (to see the abort without it)."""

import atexit
import os
import sys
import time

import torch
import torch.distributed as dist

import distckpt
import distckpt._dist

dist.init_process_group("gloo")
rank = dist.get_rank()
distckpt.save({f"x.rank_{rank}": torch.full((1000,), float(rank)), "step": 1}, sys.argv[1])
mode = sys.argv[2]
if mode == "control":   # one more collective of distckpt's control group
    distckpt._dist.control_group().all_gather(rank)
elif mode == "world":   # a collective of the job's own group (as DTensor.full_tensor() after a save)
    out = [torch.zeros(1000) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.full((1000,), float(rank)))
if os.environ.get("DISTCKPT_TEST_NO_EXIT_HANDOFF") == "1":
    atexit.unregister(distckpt._dist._let_gloo_workers_finish)
if rank == 0:
    time.sleep(0.2)
dist.destroy_process_group()
