"""TieredCheckpointManager end to end: two "nodes" on this machine, each a torchrun agent
(``--nnodes 2``, c10d rendezvous on 127.0.0.1) with its own private local tier, sharing nothing but
the SeaweedFS endpoint (the remote tier). Bit-exact restores, a node killed mid-drain, a node's
local disk wiped (a replaced node), the server down during drains, resharding across tiers.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from ..helpers.distributed import free_port

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "helpers" / "tiers_node_worker.py"


def _node_env(node_dir: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "TORCHELASTIC_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_", "GROUP_"))}
    for sub in ("home", "tmp"):
        (node_dir / sub).mkdir(parents=True, exist_ok=True)
    env.update({"HOME": str(node_dir / "home"), "TMPDIR": str(node_dir / "tmp"), "PYTHONPATH": str(ROOT),
                "OMP_NUM_THREADS": "1", "TIERS_LOCAL": str(node_dir / "local"), "DISTCKPT_TIMEOUT_S": "60"})
    env.update(extra)
    return env


def _start(phase: str, nodes: list[tuple[Path, int]], out: Path, extra: dict[str, str], steps: str = ""):
    port, rdzv = free_port(), f"tiers-{uuid.uuid4().hex[:8]}"
    agents = []
    for node_rank, (node_dir, nproc) in enumerate(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(nodes)), "--node-rank",
               str(node_rank), "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"127.0.0.1:{port}", "--rdzv-id", rdzv, "--max-restarts", "0", str(WORKER), phase, str(out)]
        if steps:
            cmd.append(steps)
        agents.append(subprocess.Popen(cmd, cwd=node_dir, env=_node_env(node_dir, extra), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, start_new_session=True))
    return agents


def _finish(agents, timeout: float = 600, check: bool = True, expect: int | None = None
            ) -> tuple[dict[int, dict], list[str]]:
    """Wait for the agents and parse the ranks' JSON records. A job that lost a node passes
    ``check=False`` and ``expect`` (the number of records its ranks print): torchrun's exit
    barrier would hold the survivor's agent for minutes, so the agents are killed as soon as every
    record is in (or at ``timeout``), and what they printed is kept."""
    outputs = [[] for _ in agents]
    done = threading.Event()

    def pump(k: int, agent) -> None:
        for line in agent.stdout:
            outputs[k].append(line)
            if expect is not None and sum(x.startswith('{"rank"') for o in outputs for x in o) >= expect:
                done.set()

    pumps = [threading.Thread(target=pump, args=(k, a), daemon=True) for k, a in enumerate(agents)]
    for t in pumps:
        t.start()
    deadline = time.monotonic() + timeout
    try:
        for agent in agents:
            while agent.poll() is None and not done.is_set():
                if time.monotonic() > deadline:
                    if check:
                        raise TimeoutError(f"the job did not end within {timeout} s")
                    break
                time.sleep(0.2)
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
        for t in pumps:
            t.join(10)
    texts = ["".join(o) for o in outputs]
    if check:
        for agent, out in zip(agents, texts):
            assert agent.returncode == 0, out[-8000:]
    recs = [json.loads(line) for out in texts for line in out.splitlines() if line.startswith('{"rank"')]
    return {r["rank"]: r for r in recs}, texts


def _job(phase, nodes, out, extra, steps="", check=True, timeout=600, expect=None):
    return _finish(_start(phase, nodes, out, extra, steps), check=check, timeout=timeout, expect=expect)


@pytest.fixture
def tiers(s3_bucket, tmp_path):
    url = f"{s3_bucket.url}/run7"
    extra = {"TIERS_REMOTE": url, "TIERS_OPTIONS": json.dumps(s3_bucket.storage_options)}
    return s3_bucket, url, extra, tmp_path


def _remote_steps(bucket, url) -> list[int]:
    from distckpt import CheckpointManager
    return CheckpointManager(url, storage_options=bucket.storage_options).steps()


def test_saves_drain_and_rotate_per_tier_then_a_wiped_node_restores_bit_exact(tiers):
    bucket, url, extra, tmp = tiers
    n0, n1 = tmp / "node0", tmp / "node1"
    nodes = [(n0, 1), (n1, 1)]
    recs, _ = _job("train", nodes, tmp, extra | {"TIERS_KEEP_REMOTE": "3"}, "10,20,30,40,50")
    for r in (0, 1):
        # keep_last_local=2 on each node (every older step is remote); keep_last_remote=3
        assert recs[r]["local"] == [40, 50], recs[r]
        assert recs[r]["remote"] == [30, 40, 50], recs[r]
        assert recs[r]["status"]["50"] == ["committed", "committed", "off"]
    # Each node's local copy holds its own rank's file only, and the same MANIFEST.
    m0 = (n0 / "local" / "step_00000050" / "MANIFEST").read_bytes()
    assert m0 == (n1 / "local" / "step_00000050" / "MANIFEST").read_bytes()
    assert sorted(p.name for p in (n0 / "local" / "step_00000050").glob("*.bin")) == ["rank00000.bin"]
    assert sorted(p.name for p in (n1 / "local" / "step_00000050").glob("*.bin")) == ["rank00001.bin"]
    assert bucket.fs.cat(f"{url.removeprefix('s3://')}/step_00000050/MANIFEST") == m0  # byte for byte

    # `distckpt ls LOCAL --remote URL`: a column per tier.
    env = os.environ | bucket.env
    ls = subprocess.run([sys.executable, "-m", "distckpt", "ls", str(n0 / "local"), "--remote", url],
                        capture_output=True, text=True, env=env, timeout=120)
    assert ls.returncode == 0, ls.stderr
    lines = {line.split()[0]: line for line in ls.stdout.splitlines()[2:]}
    assert "committed (1/2 files here)" in lines["50"] and "latest" in lines["50"], ls.stdout
    assert lines["30"].count("committed") == 1, ls.stdout  # remote only

    # Both nodes there: the restore reads local files only.
    recs, _ = _job("restore", nodes, tmp, extra)
    for r in (0, 1):
        assert recs[r]["step"] == 50 and recs[r]["ok"], recs[r]
        assert recs[r]["by_tier"]["remote"] == 0, recs[r]

    # Node 1 replaced (its local disk empty): its rank reads from the remote tier, node 0's from local.
    shutil.rmtree(n1 / "local")
    recs, _ = _job("restore", nodes, tmp, extra)
    assert all(recs[r]["step"] == 50 and recs[r]["ok"] for r in (0, 1)), recs
    assert recs[0]["by_tier"]["remote"] == 0 < recs[1]["by_tier"]["remote"], recs

    # Another world size on other nodes: 3 ranks on node 0 alone (its local copy + the remote).
    recs, _ = _job("restore", [(n0, 3)], tmp, extra)
    assert sorted(recs) == [0, 1, 2] and all(recs[r]["step"] == 50 and recs[r]["ok"] for r in recs), recs
    assert sum(recs[r]["by_tier"]["local"] for r in recs) > 0 and sum(recs[r]["by_tier"]["remote"] for r in recs) > 0


def test_a_node_killed_mid_drain_then_the_job_restarts(tiers):
    bucket, url, extra, tmp = tiers
    n0, n1 = tmp / "node0", tmp / "node1"
    nodes = [(n0, 1), (n1, 1)]
    big = {"TIERS_BIG_ROWS": str(1 << 20), "DISTCKPT_TIMEOUT_S": "30",  # 64 MiB: the drain takes a while
           "DISTCKPT_DRAIN_TIMEOUT_S": "30"}  # the survivor's drain notices the lost peer soon
    _job("kill", nodes, tmp, extra | big, check=False, timeout=240, expect=2)
    from distckpt import CheckpointManager
    remote = CheckpointManager(url, storage_options=bucket.storage_options)
    # Node 1 left right after its local commit of step 20, and rank00001.bin of step 20 is on its
    # disk alone: the drain could not finish, and nothing of it is visible remotely.
    assert remote.steps() == [10], remote.steps()
    assert not [k for k in bucket.keys("run7") if k.startswith("run7/step_00000020/") and k.endswith("MANIFEST")]
    # Restart on the same nodes: the newest complete copy is step 20 (local on both nodes); the
    # new manager drains it at construction, and close() waits for it.
    recs, outs = _job("restore", nodes, tmp, extra | big)
    assert all(recs[r]["step"] == 20 and recs[r]["ok"] for r in (0, 1)), recs
    assert all(recs[r]["closed"] == "ok" for r in (0, 1)), recs
    assert 20 in _remote_steps(bucket, url)


def test_server_down_during_drains_saves_go_on_then_drain_completes(tmp_path, s3_private_server):
    bucket = s3_private_server
    server = bucket.server
    url = f"{bucket.url}/run7"
    extra = {"TIERS_REMOTE": url, "TIERS_OPTIONS": json.dumps(bucket.storage_options), "TIERS_KEEP_REMOTE": "5"}
    nodes = [(tmp_path / "node0", 1), (tmp_path / "node1", 1)]
    agents = _start("outage", nodes, tmp_path, extra)
    try:
        deadline = time.monotonic() + 300
        while not all((tmp_path / f"ready-{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and all(a.poll() is None for a in agents), "the job never got ready"
            time.sleep(0.2)
        server.kill()  # the endpoint is gone: connections refused
        (tmp_path / "down").touch()
        while not all((tmp_path / f"saved-{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and all(a.poll() is None for a in agents), "saves stopped"
            time.sleep(0.2)
        server.restart()  # same ports, same data
        (tmp_path / "up").touch()
        recs, outs = _finish(agents)
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
    for r in (0, 1):
        rec = recs[r]
        assert rec["while_down"]["20"][0] == "committed", rec  # local saves went on
        assert rec["while_down"]["20"][1] in ("retrying", "draining", "queued"), rec
        assert rec["status"]["30"] == ["committed", "committed", "off"], rec
        assert rec["remote"] == [10, 20, 30], rec
