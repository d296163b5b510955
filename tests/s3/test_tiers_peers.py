"""Peer replicas of a TieredCheckpointManager (``replicas=k``): the resiliency extension's own
test, done here. Two or three "nodes" on this machine (torchrun agents, ``--nnodes``, c10d on
127.0.0.1), each with a private local tier; the remote tier is the SeaweedFS server, which is
stopped (killed) before the restores that must not need it.

  * the in-memory tier (each node's local tier a tmpfs), the server stopped: the job restarts in
    place and resumes from memory; then a node's memory is lost (a fresh empty tmpfs, as a
    replacement node) and it resumes bit-exact from its peer's replica (bytes received from
    peers, none from the remote tier);
  * onto fewer nodes: three nodes save with replicas=1, two nodes restore (resharded 3 -> 2) from
    local copies and replicas alone; then, the server back, two nodes' directories wiped (the
    only copies of a file gone): the restore falls back to the remote tier, typed and logged,
    bit-exact;
  * a node killed while it replicates a step: that step never counts as replicated.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

from ..helpers.faults import mounts  # noqa: F401  (pytest fixture)
from .test_tiers_manager import _job

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


@pytest.fixture
def tiers_private(s3_private_server, tmp_path):
    bucket = s3_private_server
    url = f"{bucket.url}/run7"
    extra = {"TIERS_REMOTE": url, "TIERS_OPTIONS": json.dumps(bucket.storage_options), "TIERS_REPLICAS": "1",
             "TIERS_KEEP_REMOTE": "5"}
    return bucket, url, extra, tmp_path


def _remote_down(extra: dict) -> dict:
    """The environment of a job that runs while the server is stopped: one try per request to the
    dead endpoint (botocore's retries of a refused connection only add seconds before the same
    typed EndpointUnreachableError) and a 2 s bound on close() (the drains it waits for cannot
    reach the remote tier; their outcome is not what these tests check)."""
    opts = json.loads(extra["TIERS_OPTIONS"])
    opts["config_kwargs"] = {**opts.get("config_kwargs", {}), "retries": {"max_attempts": 1, "mode": "standard"}}
    return extra | {"TIERS_OPTIONS": json.dumps(opts), "TIERS_CLOSE_TIMEOUT": "2"}


def _names(step_dir) -> list[str]:
    return sorted(p.name for p in step_dir.glob("*.bin"))


def test_a_memory_tier_survives_a_restart_and_a_lost_node_resumes_from_its_peers(tiers_private, mounts):
    """The in-memory tier (docs/TIERS.md): each node's local tier is a tmpfs of its own. The job
    restarts in place with the remote tier down: it resumes from memory (no byte from the remote
    tier or a peer). Two ranks per node, so each node sends and receives two files at once. Then
    node 1's memory is lost (its tmpfs replaced by an empty one, as a
    replacement node): it resumes bit-exact from node 0's replica, still without the remote
    tier, and holds a checked copy again."""
    bucket, url, extra, tmp = tiers_private
    n0, n1 = tmp / "node0", tmp / "node1"
    for n in (n0, n1):
        mounts.tmpfs(n / "local", size="256m")
    nodes = [(n0, 2), (n1, 2)]  # two ranks per node: two files sent to and received by each node
    recs, _ = _job("train", nodes, tmp, extra, "10,20")
    for r in range(4):
        assert recs[r]["status"]["20"] == ["committed", "committed", "replicated"], recs[r]
    # Each node holds its own file and its peer's replica.
    assert _names(n0 / "local" / "step_00000020") == _names(n1 / "local" / "step_00000020") == \
        [f"rank{r:05d}.bin" for r in range(4)]
    bucket.server.kill()            # the remote tier gone
    recs, _ = _job("restore", nodes, tmp, _remote_down(extra))  # restarted in place
    for r in range(4):
        assert recs[r]["step"] == 20 and recs[r]["ok"], recs[r]
        assert recs[r]["by_tier"]["remote"] == 0 and recs[r]["from_peers"] == 0, recs[r]
        assert recs[r]["by_tier"]["local"] > 0, recs[r]
    mounts.tmpfs(n1 / "local", size="256m")  # node 1's memory lost: an empty tmpfs over the old one
    assert not any((n1 / "local").iterdir())
    recs, _ = _job("restore", nodes, tmp, _remote_down(extra))
    for r in range(4):
        assert recs[r]["step"] == 20 and recs[r]["ok"], recs[r]
        assert recs[r]["by_tier"]["remote"] == 0, recs[r]
    # Both of node 1's ranks received their own file, each from a rank of node 0.
    assert recs[2]["from_peers"] > 0 and recs[3]["from_peers"] > 0, recs
    assert recs[0]["from_peers"] == recs[1]["from_peers"] == 0, recs
    # The fresh node holds a copy of the step again, made from its peer's replica, checked.
    assert (n1 / "local" / "step_00000020" / "MANIFEST").read_bytes() == \
        (n0 / "local" / "step_00000020" / "MANIFEST").read_bytes()
    assert not [p for p in (n1 / "local").iterdir() if ".tmp-" in p.name or ".peer-" in p.name]


def test_three_nodes_onto_two_from_replicas_then_two_wiped_nodes_fall_back_to_the_remote_tier(tiers_private):
    """Three nodes save with replicas=1. (a) With the server stopped, node 2 is gone for good and
    the job restarts on nodes 0 and 1 (resharded 3 -> 2) from local copies and replicas alone.
    (b) With the server back, nodes 1 and 2 are wiped: rank 1's file lived on both (its own and
    its replica; the copy (a)'s repair made on node 0 is removed too), so only the remote tier
    has it; the 3-node restore falls back to it, typed and
    logged, bit-exact. One save for both (a 3-node job is the expensive part)."""
    bucket, url, extra, tmp = tiers_private
    nodes3 = [(tmp / f"node{n}", 1) for n in range(3)]
    recs, _ = _job("train", nodes3, tmp, extra, "10")
    assert all(recs[r]["status"]["10"][2] == "replicated" for r in range(3)), recs
    bucket.server.kill()
    recs, _ = _job("restore", nodes3[:2], tmp, _remote_down(extra))
    assert sorted(recs) == [0, 1] and all(recs[r]["step"] == 10 and recs[r]["ok"] for r in (0, 1)), recs
    assert all(recs[r]["by_tier"]["remote"] == 0 for r in (0, 1)), recs

    bucket.server.restart()  # same ports, same data
    shutil.rmtree(tmp / "node1" / "local")
    shutil.rmtree(tmp / "node2" / "local")
    # The 2-node restore repaired node 0 with a copy of rank 1's file (its rank read half of it):
    # that copy goes too, so no node holds the file.
    repaired = tmp / "node0" / "local" / "step_00000010" / "rank00001.bin"
    assert repaired.exists()
    repaired.unlink()
    recs, outs = _job("restore", nodes3, tmp, extra)
    assert all(recs[r]["step"] == 10 and recs[r]["ok"] for r in range(3)), recs
    assert sum(recs[r]["by_tier"]["remote"] for r in range(3)) > 0, recs
    assert any("on no node as part of the save being loaded" in out for out in outs), outs[0][-3000:]


def test_a_node_killed_mid_replication_never_counts_as_replicated(tiers_private):
    bucket, url, extra, tmp = tiers_private
    nodes = [(tmp / "node0", 1), (tmp / "node1", 1)]
    env = extra | {"TIERS_BIG_ROWS": str(1 << 20), "DISTCKPT_TIMEOUT_S": "20", "DISTCKPT_DRAIN_TIMEOUT_S": "20"}
    t0 = time.monotonic()
    recs, outs = _job("killrep", nodes, tmp, env, check=False, timeout=200, expect=2)
    assert 0 in recs, outs[0][-6000:]
    assert recs[0]["replicas10"] == "replicated", recs
    # The survivor learns of the loss within the drain's deadline (20 s here), not at a timeout of
    # its own waits (240 s), and its job ends.
    assert recs[0]["waited_s"] < 120 and recs[0]["closed_s"] < 150, recs
    assert time.monotonic() - t0 < 180
    assert recs[0]["replicas20"] in ("failed", "pending"), recs
    # No replica of rank 1's step-20 file reached node 0, and no partial file is left in its step.
    assert _names(tmp / "node0" / "local" / "step_00000020") == ["rank00000.bin"]
