"""One rank of a torchrun job (tests/interop/test_dcp_storage.py): three ``dcp.async_save`` calls
through distckpt's StorageWriter (DCP's thread mode), each with a ``distckpt.load`` in the
caller's thread while it runs. Writes ``[(load outcome, save outcome), ...]`` as JSON to
``OUT/rank<R>.json``. Under torchrun the job's store is the agent's, a client in every rank."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import distckpt
from distckpt.integrations.dcp import DistCkptStorageWriter

out_dir = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
distckpt.save({"w": torch.ones(8)}, f"{out_dir}/base", overwrite=True)
results = []
for i in range(3):
    fut = dcp.async_save({"x": torch.full((1 << 14,), float(i))}, storage_writer=DistCkptStorageWriter(f"{out_dir}/d{i}"))
    time.sleep(0.05 * rank)  # the ranks' loads start apart, as a training loop's do
    got = {"w": torch.zeros(8)}
    try:
        distckpt.load(got, f"{out_dir}/base")  # the caller's thread, while DCP's thread saves
        load = "ok" if torch.equal(got["w"], torch.ones(8)) else "wrong values"
    except Exception as exc:  # noqa: BLE001 - reported
        load = f"{type(exc).__name__}: {exc}"[:300]
    try:
        fut.result(timeout=120)
        saved = "ok"
    except BaseException as exc:  # noqa: BLE001 - reported
        saved = f"{type(exc).__name__}: {exc}"[:300]
    results.append([load, saved])
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
dist.destroy_process_group()
