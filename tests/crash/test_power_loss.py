"""Power loss at every operation of two saves, and of an in-place overwrite (I1, I2, I3, I6), on a
FUSE file system that drops everything no fsync covered (tests/helpers/powercut_fs.py: the model, and
where real ext4 is kinder; tests/helpers/powercut.py: the cut points, the three images a restart may
find, the checks).

O_DIRECT works on FUSE here (the kernel passes O_DIRECT writes to the daemon uncached; ``auto``
picks ``uring`` there). CI runs ``pwrite`` (the same O_DIRECT writes, one at a time: the daemon
sees the same operations as with io_uring, which only reorders writes that no fsync has covered
yet and that every model but ``all`` drops) and ``buffered`` (write + fsync, the fallback for file
systems that refuse O_DIRECT); DISTCKPT_CRASH_FULL=1 adds ``uring`` (slower on FUSE: its writes
are punted to io-wq workers). With the kernel's write-back cache off, every write reaches the
daemon before the syscall returns, whatever the backend.

The canaries show the suite can fail: a save that skips the data files' fsync, or the fsync of
the tmp directory before its rename, loses acknowledged checkpoints after a cut, and the check
says so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers.faults import REPO_ROOT, require_root, require_tools

FULL = os.environ.get("DISTCKPT_CRASH_FULL") == "1"


def _run(tmp_path, *args: str, timeout: float) -> dict:
    require_root("FUSE power-cut tests (mount)")
    require_tools("fusermount3")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse on this machine")
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.powercut", "--workdir", str(tmp_path / "pc"), *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    shutil.rmtree(tmp_path / "pc", ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("backend", ["pwrite", "buffered"] + (["uring"] if FULL else []))
def test_power_cut_after_every_operation(tmp_path, backend):
    s = _run(tmp_path, "--backend", backend, timeout=1100)
    print(json.dumps(s))
    assert s["backend"] == backend
    assert s["violations"] == []
    assert s["drifted_runs"] == [], "runs must issue the same operations (cut points would not match)"
    # The cuts fell before, between and after the two saves' acknowledgements...
    assert set(s["acked_at_cut"]) == {"2", "3", "4"}, s["acked_at_cut"]
    # ...at every kind of operation that changes the file system...
    assert {"create", "write", "fsync", "fsyncdir", "rename", "unlink"} <= set(s["op_kinds"])
    assert s["cut_points"] == s["ops_per_run"] + 1
    # ...and each model produced images of its own that were checked.
    assert all(s["images_checked_per_model"].get(m, 0) > 0 for m in ("strict", "meta", "all"))
    assert 0 < s["cuts_with_new_step_committed"]


def test_power_cut_during_an_overwrite(tmp_path):
    # save(..., overwrite=True) swaps the new directory with the old one (RENAME_EXCHANGE, which
    # the FUSE file system implements): the name always holds one whole checkpoint.
    s = _run(tmp_path, "--scenario", "overwrite", "--backend", "pwrite", timeout=600)
    print(json.dumps(s))
    assert s["violations"] == []
    assert s["drifted_runs"] == []
    assert set(s["acked_at_cut"]) == {"2", "3"}
    assert "rename" in s["op_kinds"] and s["cuts_with_new_step_committed"] > 0


@pytest.mark.parametrize("mutation", ["no-data-fsync", "no-tmpdir-fsync"])
def test_power_cut_catches_a_missing_fsync(tmp_path, mutation):
    s = _run(tmp_path, "--backend", "uring", "--last-only", "--mutation", mutation, timeout=600)
    assert s["violations"], f"a save with {mutation} must lose data at a power cut"
    text = json.dumps(s["violations"])
    assert "I3" in text or "does not load" in text or "without a MANIFEST" in text, text
