"""Multi-node without a shared file system, simulated on one machine, and a server lost mid-save.

Two torchrun agents (``--nnodes 2``, c10d rendezvous on 127.0.0.1) stand for two nodes: each has
its own private scratch directory as HOME, TMPDIR and working directory, and they share nothing
but the S3 endpoint, which they find through the standard AWS variables alone. The job saves
DTensors sharded over both ranks to S3; the checkpoint is then restored on a single node (this
process, no process group) and compared bit for bit. Neither node's directory holds any
checkpoint byte afterwards.

The second test stops the server (SIGKILL, by PID) while two gloo ranks upload a save: every
rank raises a typed error within a bound, nothing is committed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from distckpt import errors

from ..helpers.distributed import free_port, run_ranks

pytestmark = pytest.mark.timeout(420)
ROOT = Path(__file__).resolve().parents[2]


def _node_env(node_dir: Path, s3_env: dict[str, str]) -> dict[str, str]:
    """The environment of one simulated node: private HOME/TMPDIR/caches, S3 by AWS variables."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "TORCHELASTIC_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_", "GROUP_"))}
    for sub in ("home", "tmp", "cache"):
        (node_dir / sub).mkdir(parents=True, exist_ok=True)
    env.update(s3_env)
    env.update({"HOME": str(node_dir / "home"), "TMPDIR": str(node_dir / "tmp"),
                "XDG_CACHE_HOME": str(node_dir / "cache"), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                "DS_ACCELERATOR": "cpu"})
    return env


def test_two_nodes_no_shared_fs_save_to_s3_restore_on_one(s3_bucket, tmp_path):
    from tests.helpers.s3_node_worker import expected

    url = f"{s3_bucket.url}/run7/step_00000042"
    port = free_port()
    rdzv_id = f"distckpt-s3-{uuid.uuid4().hex[:8]}"
    agents, nodes = [], []
    for node_rank in range(2):
        node_dir = tmp_path / f"node{node_rank}"
        nodes.append(node_dir)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", rdzv_id, "--max-restarts", "0", str(ROOT / "tests" / "helpers" / "s3_node_worker.py"), url]
        env = _node_env(node_dir, s3_bucket.env)
        agents.append(subprocess.Popen(cmd, cwd=node_dir, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, start_new_session=True))
    outputs = []
    try:
        for agent in agents:
            out, _ = agent.communicate(timeout=300)
            outputs.append(out)
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    for agent, out in zip(agents, outputs):
        assert agent.returncode == 0, out[-6000:]
    lines = [json.loads(line) for out in outputs for line in out.splitlines() if line.startswith('{"rank"')]
    by_rank = {rec["rank"]: rec for rec in lines}
    assert sorted(by_rank) == [0, 1] and all(rec["world"] == 2 for rec in lines), outputs
    # The two ranks ran in different "nodes": different private HOME / TMPDIR / working directory.
    assert {Path(rec["home"]).parent for rec in lines} == set(nodes)
    assert len({rec["tmpdir"] for rec in lines}) == 2 and len({rec["cwd"] for rec in lines}) == 2

    # The checkpoint lives in S3 only: MANIFEST plus one data object per rank under its save id.
    keys = s3_bucket.keys("run7")
    manifest = "run7/step_00000042/MANIFEST"
    data = [k for k in keys if k.endswith(".bin")]
    assert manifest in keys and len(data) == 2, keys
    for node_dir in nodes:
        local = [p for p in node_dir.rglob("*") if p.is_file() and (p.name == "MANIFEST" or p.suffix == ".bin")]
        assert local == [], f"checkpoint bytes on a node's private disk: {local}"

    # Restore on one node (this process, no process group), from the same AWS variables.
    import distckpt
    full = expected()
    out = {"model": {k: torch.zeros_like(v) for k, v in full.items()},
           "per_rank": {f"rank{r}": torch.zeros(5, dtype=torch.int64) for r in range(2)}, "step": 0}
    old = {k: os.environ.get(k) for k in s3_bucket.env}
    os.environ.update(s3_bucket.env)
    try:
        distckpt.load(out, url)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    for k, v in full.items():
        assert out["model"][k].dtype == v.dtype and torch.equal(out["model"][k], v), k
    for r in range(2):
        assert torch.equal(out["per_rank"][f"rank{r}"], torch.full((5,), r, dtype=torch.int64))
    assert out["step"] == 42


# ------------------------------------------------------------------------------------------------
# The server lost in the middle of a save


def _save_while_server_dies(rank, world, url, options, pid_file):
    import distckpt

    g = torch.Generator().manual_seed(rank)
    # 64 MiB per rank: many parts, so the uploads outlast the killer's reaction by far (with 24 MiB
    # a save on an idle loopback server could finish between two of its polls and commit).
    sd = {f"r{rank}": torch.randn(16 << 20, generator=g)}
    if rank == 0:
        Path(pid_file + ".started").touch()
    t0 = time.monotonic()
    try:
        distckpt.save(sd, url, storage_options=options)
    except errors.DistCkptError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0, _failure_classes(exc)
    return "saved", "", time.monotonic() - t0, []


def _failure_classes(exc) -> list[str]:
    failures = getattr(exc, "failures", None) or {}
    return sorted({type(e).__name__ for e in failures.values()})


def test_server_killed_mid_save_every_rank_typed_error(s3_private_server, tmp_path):
    """SIGKILL the server while 2 ranks upload: every rank raises the same RankFailureError whose
    per-rank causes are EndpointUnreachableError (never a hang or a bare exception), within a
    bound; nothing committed."""
    from distckpt.storage.object.errors import client_config

    bucket = s3_private_server
    server = bucket.server
    url = f"{bucket.url}/run/step_00000001"
    # Tight client timeouts so the bound the test checks stays small on a loaded machine.
    options = server.storage_options(config_kwargs=client_config(connect_timeout_s=2, read_timeout_s=10,
                                                                 max_attempts=2))
    flag = str(tmp_path / "go")

    def killer():
        deadline = time.monotonic() + 120
        while not os.path.exists(flag + ".started") and time.monotonic() < deadline:
            time.sleep(0.05)
        # Wait until an upload is under way (a multipart upload or an object of the save exists).
        while time.monotonic() < deadline:
            try:
                if bucket.multipart_uploads() or any(k.endswith(".bin") for k in bucket.keys("run")):
                    break
            except Exception:  # noqa: BLE001 - the listing itself may race
                pass
            time.sleep(0.01)
        killed.append(time.monotonic())
        server.kill()

    killed: list[float] = []
    t = threading.Thread(target=killer)
    t.start()
    try:
        results = run_ranks(_save_while_server_dies, 2, url, options, flag, timeout=240)
    finally:
        t.join()
    assert killed, "the server was never killed"
    for rank, (kind, text, seconds, causes) in enumerate(results):
        assert kind != "saved", f"rank {rank} committed a save to a dead server"
        assert seconds < 90, f"rank {rank} took {seconds:.0f} s to give up"
        # The same verdict on every rank: the failed rank(s), each with the endpoint named.
        assert kind == "EndpointUnreachableError" and causes == ["EndpointUnreachableError"], text
        assert server.endpoint in text and "Remedy:" in text
    # Restart the server on the same data (new ports): nothing was committed.
    server.start()
    fs = server.filesystem()
    assert fs.exists(f"{bucket.name}/run/step_00000001") is False or not fs.exists(
        f"{bucket.name}/run/step_00000001/MANIFEST")
