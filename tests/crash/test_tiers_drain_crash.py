"""A drain (distckpt.tiers.drain.drain_step, 1 rank, to the suite's SeaweedFS) killed at system
calls of its local part and at random times: the remote step is all or nothing (issue #25, Faults).

The campaign is tests/helpers/tiers_drain_kill.py (its docstring says how kill points are counted
from a trace of the drain's main thread, which ones are taken, and what is checked after each kill:
committed bit-exact or invisible, never partial; then a fresh drain completes it bit-exact and no
multipart upload stays open). It runs in a subprocess: one torch import, then a fork per trial.

The selection (the summary's ``selection``): every call of the drain's local part on a file of the
step (its MANIFEST, index and data file: opens, stats, reads, closes; and the io_uring_enter calls
that carry the data file's reads), 2 of the calls on the step's directory itself (listings and
stats, evenly sampled), and of the other calls of its main thread (futex waits on the upload's
requests, socket wake-ups, memory) every mutating one and every 8th, at most 2, evenly sampled;
``DISTCKPT_CRASH_FULL=1`` kills at every call of the drain's main thread (about 300). Plus 2 kills
at random times within an untraced drain (seeded). 30-40 trials, 3-4 s each on this 2-core
machine (each trial's checks run beside the next trial).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.faults import REPO_ROOT, require_root, require_tools

FULL = os.environ.get("DISTCKPT_CRASH_FULL") == "1"


def _campaign(s3_bucket, tmp_path, *args: str, timeout: float) -> dict:
    require_root("kill-at-syscall tests (strace -p)")
    require_tools("strace")
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.tiers_drain_kill", "--workdir", str(tmp_path),
                           "--url", f"{s3_bucket.url}/drains", "--options", json.dumps(s3_bucket.storage_options),
                           *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
@pytest.mark.timeout(3600 if FULL else 300)
def test_drain_killed_at_every_local_syscall_and_at_random_times_is_all_or_nothing(s3_bucket, tmp_path):
    s = _campaign(s3_bucket, tmp_path, "--timed", "2", "--others", "2", "--dir-calls", "2",
                  *(["--full"] if FULL else []),
                  timeout=3500 if FULL else 280)
    print(json.dumps({k: v for k, v in s.items() if k != "points"}, indent=1))
    assert s["violations"] == [], s["violations"]
    assert all(t["violations"] == [] for t in s["timed"]), s["timed"]
    # The enumeration covers what it claims: every kill point was reached and killed the drain,
    # and each kill at a call on the local step landed on that very call.
    assert s["file_kill_points"] == s["file_calls"] > 0, s
    # Only calls whose count varies between runs (futex waits) may be missed; a call of the local
    # part is always reached and killed, on that very call.
    assert s["local_not_killed"] == [] and s["killed"] >= s["kill_points"] - len(s["not_killed"]) > 0, s
    assert s["local_not_landed"] == [], s["local_not_landed"]
    # Kills fell before and after the commit point: the step was sometimes committed already,
    # mostly not (the kill points lie in the drain, before its MANIFEST).
    assert 0 <= s["committed_after_kill"] < s["killed"], s
    # The delays are shorter than a drain, but the machine's load varies: at least one must land.
    assert sum(t["killed"] for t in s["timed"]) >= 1, s["timed"]
    assert s3_bucket.multipart_uploads() == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill_suite_catches_a_manifest_written_before_the_data(s3_bucket, tmp_path):
    """The canary: with a drain that writes the MANIFEST before it copies the data, some kill in the
    copy leaves a visible step that does not load, and the checks say so."""
    s = _campaign(s3_bucket, tmp_path, "--mutation", "manifest-first", "--others", "0", "--stop-at-first",
                  timeout=280)
    assert s["violations"], "a MANIFEST written before the data must be caught by a kill in the copy"
    assert any("does not load" in v or "does not read bit-exact" in v for _, vs in s["violations"] for v in vs), s
