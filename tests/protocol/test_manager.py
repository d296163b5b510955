"""CheckpointManager beside a running job (issue 9): listing and reclaiming never touch a live save,
`latest` is what load() loads after a rollback, lost async failures surface, a save called on some
ranks only fails fast and typed, concurrent saves into one root have exactly one winner, `distckpt ls`
describes a root without writing, and the async staging memory can be given back (issue 14).

Saves "in flight" are real processes stopped with SIGSTOP while their tmp directory exists: the
lock they hold is then exactly what a slow save holds."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import distckpt
from distckpt.storage.posix.leftovers import TMP_RE
from distckpt.errors import CheckpointExistsError, RanksMissingError, SaveInProgressError

from ..helpers.distributed import run_ranks

PY = sys.executable

SAVER = r"""
import json, os, sys, torch, distckpt
root, step, mib, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
state = {"w": torch.full(((mib << 20) // 4,), float(step)), "step": step}
try:
    if mode == "manager":
        distckpt.CheckpointManager(root).save(step, state)
    else:
        distckpt.save(state, os.path.join(root, f"step_{step:08d}"))
    print(json.dumps({"ok": True}))
except Exception as e:
    print(json.dumps({"ok": False, "type": type(e).__name__, "msg": str(e)}))
"""


def _tmp_dirs(root: str) -> list[str]:
    try:
        return [n for n in os.listdir(root) if TMP_RE.match(n) and ".tmp-" in n]
    except FileNotFoundError:
        return []


@contextlib.contextmanager
def stopped_mid_save(root: str, step: int, *, mode: str = "manager", mib: int = 48):
    """A child process saving ``step``, SIGSTOPped while its tmp dir exists. Yields (proc, tmp
    name); on exit the child is continued and its JSON outcome is stored in ``proc.outcome``."""
    for _attempt in range(6):
        proc = subprocess.Popen([PY, "-c", SAVER, root, str(step), str(mib), mode], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        caught = None
        while proc.poll() is None:
            tmp = _tmp_dirs(root)
            if tmp:
                os.kill(proc.pid, signal.SIGSTOP)
                if _tmp_dirs(root):  # still mid-save once stopped
                    caught = tmp[0]
                    break
                os.kill(proc.pid, signal.SIGCONT)
                break
            time.sleep(0.001)
        if caught is None:  # finished before we caught it: remove it and try a bigger save
            proc.communicate(timeout=120)
            for name in os.listdir(root):
                if name == f"step_{step:08d}":
                    import shutil
                    shutil.rmtree(os.path.join(root, name))
            mib *= 2
            continue
        try:
            yield proc, caught
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
            out, err = proc.communicate(timeout=180)
            proc.outcome = json.loads(out.strip().splitlines()[-1]) if out.strip() else {"ok": False, "err": err}
        return
    raise AssertionError("could not stop a saver mid-save")


def _snapshot(root: str) -> dict:
    """Names and metadata of everything directly under root (a write would change it)."""
    out = {"root": os.stat(root).st_mtime_ns}
    for name in os.listdir(root):
        st = os.lstat(os.path.join(root, name))
        out[name] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return out


def _ls(capsys, *args: str) -> tuple[int, str, str]:
    from distckpt.cli import main
    capsys.readouterr()
    rc = main(["ls", *args])
    out, err = capsys.readouterr()
    return rc, out, err


# Another process (a monitoring script): a manager's read calls, reclaim, `distckpt ls` and --json.
PROBE = r"""
import contextlib, io, json, sys, distckpt
from distckpt.cli import main
m = distckpt.CheckpointManager(sys.argv[1])
res = {"steps": m.steps(), "latest": m.latest_step(), "reclaimed": m.reclaim()}
for key, argv in (("table", ["ls", sys.argv[1]]), ("json", ["ls", "--json", sys.argv[1]])):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        res[key + "_rc"] = main(argv)
    res[key] = buf.getvalue()
print(json.dumps(res))
"""


# ------------------------------------------------------------------------------------------------
# 1 + 6: listing and reclaiming from other processes leave a live save alone; `distckpt ls`


def test_listing_and_reclaim_from_other_processes_leave_a_live_save_alone(tmp_path):
    root = str(tmp_path / "root")
    distckpt.CheckpointManager(root).save(1, {"w": torch.ones(10), "step": 1})
    os.mkdir(os.path.join(root, "step_00000009"))  # broken: never committed
    with stopped_mid_save(root, 2) as (saver, tmp):
        before = _snapshot(root)
        probe = subprocess.run([PY, "-c", PROBE, root], capture_output=True, text=True, timeout=120)
        assert probe.returncode == 0, probe.stderr
        seen = json.loads(probe.stdout.strip().splitlines()[-1])
        assert _snapshot(root) == before, "listing or reclaiming wrote into the root"
    assert saver.outcome["ok"], saver.outcome
    assert distckpt.read(os.path.join(root, "step_00000002"))["step"] == 2
    assert not _tmp_dirs(root)

    # What the other process saw while the save was stopped.
    assert (seen["steps"], seen["latest"], seen["reclaimed"]) == ([1], 1, [])
    assert seen["table_rc"] == 0 and seen["json_rc"] == 0
    assert "ALIVE" in seen["table"] and str(saver.pid) in seen["table"] and tmp in seen["table"]
    assert "no MANIFEST" in seen["table"]
    listing = json.loads(seen["json"])
    by_name = {e["name"]: e for e in listing["entries"]}
    assert by_name["step_00000001"]["status"] == "committed" and by_name["step_00000001"]["is_latest"]
    assert by_name["step_00000001"]["ranks"] == 1 and by_name["step_00000001"]["size_bytes"] > 40
    assert by_name["step_00000009"]["status"] == "broken"
    live = [lo for lo in listing["leftovers"] if lo["entry"] == tmp]
    assert live and live[0]["state"] == "alive" and live[0]["owner"]["pid"] == saver.pid


def test_ls_paths(tmp_path, capsys):
    missing = tmp_path / "no" / "such"
    rc, _out, err = _ls(capsys, str(missing))
    assert rc == 2 and "does not exist" in err
    assert not (tmp_path / "no").exists(), "ls created a directory"
    root = tmp_path / "r"
    mgr = distckpt.CheckpointManager(root)
    assert not root.exists(), "constructing a manager created its root"
    mgr.save(3, {"w": torch.ones(4)})
    with open(root / "step_00000004", "w"):  # a stray file: not a checkpoint, not listed
        pass
    os.makedirs(root / "step_00000005")
    with open(root / "step_00000005" / "MANIFEST", "wb") as f:
        f.write(b"garbage")
    rc, out, _err = _ls(capsys, str(root / "step_00000003"))
    assert rc == 0 and "(checkpoint)" in out and "committed" in out
    listing = json.loads(_ls(capsys, "--json", str(root))[1])
    assert [(e["step"], e["status"]) for e in listing["entries"]] == [(3, "committed"), (5, "broken")]
    assert "ManifestCorruptError" in listing["entries"][1]["problem"]
    assert listing["latest"] == 3 and listing["latest_pointer"] == "step_00000003"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["fifo", "symlink", "directory"])
def test_a_latest_that_is_not_a_regular_file_is_named_and_never_blocks(tmp_path, capsys, what):
    """``latest`` as a FIFO made `distckpt ls ROOT` and describe() block forever in open(), and a
    symlinked one was followed (ls quoted its target's first bytes). Now the listing says the
    pointer cannot be read, lists the steps, and the manager saves and loads on (a save replaces
    the pointer)."""
    root = tmp_path / "r"
    mgr = distckpt.CheckpointManager(root)
    mgr.save(1, {"w": torch.ones(4)})
    latest = root / "latest"
    os.unlink(latest)
    secret = tmp_path / "secret"
    secret.write_text("do-not-quote-me\n")
    {"fifo": os.mkfifo, "symlink": lambda p: os.symlink(secret, p), "directory": os.mkdir}[what](latest)
    listing = distckpt.CheckpointManager(root).describe()
    assert [e.step for e in listing.entries] == [1] and listing.latest == 1, listing
    assert listing.latest_pointer is None and "latest file cannot be read" in listing.pointer_problem, listing
    rc, out, _err = _ls(capsys, str(root))
    assert rc == 0 and "committed" in out and "latest file cannot be read" in out, out
    assert "do-not-quote-me" not in out, out
    out = {"w": torch.zeros(4)}
    got = distckpt.CheckpointManager(root).load(out)
    assert got.path.endswith("step_00000001") and torch.equal(out["w"], torch.ones(4))
    if what != "directory":  # a save replaces a FIFO or a symlink by a rename (never through it)
        mgr.save(2, {"w": torch.ones(4) * 2})
        assert os.path.isfile(latest) and not os.path.islink(latest) and secret.read_text() == "do-not-quote-me\n"


def test_only_the_exact_step_names_are_steps(tmp_path):
    """Step names were matched with \\d and $: a directory "step_0000000\u0663" (an Arabic-Indic
    digit) or "step_00000003\\n" (a trailing newline) counted as step 3 beside the real one:
    steps() listed 3 three times, and rotation counted them."""
    root = tmp_path / "r"
    mgr = distckpt.CheckpointManager(root, keep_last=3)
    for s in (1, 2, 3):
        mgr.save(s, {"w": torch.ones(4) * s})
    for name in ("step_0000000\u0663", "step_00000003\n"):
        distckpt.save({"w": torch.ones(4)}, root / name)
    assert mgr.steps() == [1, 2, 3]
    mgr.save(4, {"w": torch.ones(4) * 4})
    assert mgr.steps() == [2, 3, 4]
    assert (root / "step_0000000\u0663").is_dir() and (root / "step_00000003\n").is_dir()  # not ours: left alone
    listing = mgr.describe()
    assert [e.step for e in listing.entries if e.step is not None] == [2, 3, 4], listing


def test_dead_saves_are_still_reclaimed(tmp_path):
    root = str(tmp_path / "root")
    os.makedirs(root)
    with stopped_mid_save(root, 7) as (saver, tmp):
        os.kill(saver.pid, signal.SIGKILL)
        saver.wait()
        listing = distckpt.CheckpointManager(root).describe()
        assert {lo.entry: lo.state for lo in listing.leftovers}[tmp] == "dead"
        removed = distckpt.CheckpointManager(root).reclaim()
        assert tmp in removed and ".distckpt.lock" in removed
        assert os.listdir(root) == []


# ------------------------------------------------------------------------------------------------
# 5: concurrent saves into one root


def test_two_managers_saving_at_once_one_wins(tmp_path):
    root = str(tmp_path / "root")
    os.makedirs(root)
    with stopped_mid_save(root, 5) as (saver, _tmp):
        before = _snapshot(root)
        other = distckpt.CheckpointManager(root)
        for step in (5, 6):
            with pytest.raises(SaveInProgressError) as ei:
                other.save(step, {"w": torch.zeros(8)})
            assert str(saver.pid) in str(ei.value) and isinstance(ei.value, CheckpointExistsError)
        assert _snapshot(root) == before, "the losing save left something behind"
    assert saver.outcome["ok"], saver.outcome
    assert distckpt.CheckpointManager(root).steps() == [5]


def test_same_step_from_two_jobs_exactly_one_commits(tmp_path):
    root = str(tmp_path / "root")
    os.makedirs(root)
    mine = {"w": torch.full((1000,), -1.0), "step": -1}
    with stopped_mid_save(root, 5) as (saver, tmp):
        # Another job saves the same step with a plain save (its own lock): it commits first.
        distckpt.save(mine, os.path.join(root, "step_00000005"))
        assert tmp in os.listdir(root), "the second job touched the first one's save in flight"
    assert not saver.outcome["ok"] and saver.outcome["type"] == "CheckpointExistsError", saver.outcome
    got = distckpt.read(os.path.join(root, "step_00000005"))
    assert got["step"] == -1 and torch.equal(got["w"], mine["w"]), "not the winner's checkpoint"
    assert sorted(os.listdir(root)) == ["step_00000005"], "the loser's leftovers were not removed"


# ------------------------------------------------------------------------------------------------
# 2: rollback then resume


def _state(step: int) -> dict:
    return {"w": torch.full((16,), float(step)), "step": step}


def test_rollback_then_resume(tmp_path, caplog):
    root = tmp_path / "root"
    first = distckpt.CheckpointManager(root)
    for step in (100, 200, 300):
        first.save(step, _state(step))
    mgr = distckpt.CheckpointManager(root, keep_last=2)
    got = _state(0)
    mgr.load(got, step=200)
    assert got["step"] == 200
    with caplog.at_level(logging.WARNING, logger="distckpt"):
        mgr.save(250, _state(250))
    assert mgr.steps() == [200, 250]
    assert "step_00000300" in caplog.text and "abandoned branch" in caplog.text
    assert (root / "latest").read_text() == "step_00000250\n"
    assert mgr.latest_step() == 250
    fresh = distckpt.CheckpointManager(root, keep_last=2)
    got = _state(0)
    fresh.load(got)
    assert got["step"] == 250


def test_lower_step_without_a_rollback_deletes_nothing_newer(tmp_path, caplog):
    """Only a rollback through this manager's load() makes higher steps an abandoned branch: a
    fresh job (or a plain load) that saves a lower step must not delete newer checkpoints."""
    root = tmp_path / "root"
    first = distckpt.CheckpointManager(root)
    for step in (100, 200, 300):
        first.save(step, _state(step))
    fresh = distckpt.CheckpointManager(root, keep_last=2)
    with caplog.at_level(logging.WARNING, logger="distckpt"):
        fresh.save(0, _state(0))
    assert fresh.steps() == [0, 100, 200, 300]
    assert "step_00000300" in caplog.text and "not treated as an abandoned branch" in caplog.text
    assert fresh.latest_step() == 0  # newest by commit order, as `latest` says
    assert (root / "latest").read_text() == "step_00000000\n"


def test_rotation_keeps_the_newest_commits_of_a_rollback_another_job_made(tmp_path, caplog):
    """keep_last keeps the newest steps by number *and* by commit time. A job rolled back to 450
    of 450/480/500 without this manager's load() (so 480 and 500 stay, numbered above) and saved
    460 and 470; the next job resumed from 470 (newest by commit) and saved 510. Counted by number alone, rotation
    deleted 460 and 470 and kept the abandoned 480 and 500, so losing 510 fell back to 500, a
    state the run had abandoned."""
    root = tmp_path / "root"
    first = distckpt.CheckpointManager(root)
    for step in (450, 480, 500):
        first.save(step, _state(step))
        time.sleep(0.01)
    rolled = distckpt.CheckpointManager(root, keep_last=2)
    distckpt.load(_state(0), rolled.path(450))  # not through the manager: nothing is abandoned
    for step in (460, 470):
        rolled.save(step, _state(step))
        time.sleep(0.01)
    assert rolled.steps() == [460, 470, 480, 500]
    resumed = distckpt.CheckpointManager(root, keep_last=2)
    got = _state(0)
    distckpt.load(got, resumed.path(resumed.latest_step()))  # (a manager load() would protect it once)
    assert got["step"] == 470
    with caplog.at_level(logging.WARNING, logger="distckpt"):
        resumed.save(510, _state(510))
    assert resumed.steps() == [470, 500, 510]  # 500: newest by number; 470: newest by commit
    assert "step_00000470" in caplog.text and "by commit time" in caplog.text
    import shutil
    shutil.rmtree(root / "step_00000510")  # the newest lost: the fallback is the resumed branch
    got = _state(0)
    distckpt.CheckpointManager(root).load(got)
    assert got["step"] == 470
    time.sleep(0.01)
    resumed.save(520, _state(520))
    time.sleep(0.01)
    resumed.save(530, _state(530))
    assert resumed.steps() == [520, 530]  # the abandoned 500 goes once it is neither


def test_a_damaged_manifest_is_rotated_by_its_number_and_never_stops_rotation(tmp_path, caplog):
    """A step whose MANIFEST is damaged has no commit time to keep it by: it goes by its number,
    as any step. Kept for good as an unknown time, it also stopped every later deletion (the
    chain check of a kept step that does not read keeps everything): the disk filled."""
    root = tmp_path / "root"
    mgr = distckpt.CheckpointManager(root, keep_last=2)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    with open(root / "step_00000001" / "MANIFEST", "r+b") as f:
        f.truncate(10)
    for step in (3, 4, 5):
        mgr.save(step, _state(step))
    assert mgr.steps() == [4, 5]


def test_a_damaged_higher_step_that_load_passed_over_is_not_deleted_as_an_abandoned_branch(tmp_path, caplog):
    """Steps 10, 20, 30; one byte of step 30's MANIFEST flipped. A new job's load() without a step
    number takes 20 (30 does not load) and saves 25: step 30, data files and all, was deleted as
    "abandoned branch -- step 25 was just saved after a rollback", though nobody rolled back
    (its data may be all there is of it). It is kept now, with a warning; a load of 20 by number
    (a rollback the caller chose) still makes 30 the abandoned branch."""
    root = tmp_path / "r"
    mgr = distckpt.CheckpointManager(root, keep_last=5)
    for s in (10, 20, 30):
        mgr.save(s, {"w": torch.ones(4) * s})
    manifest = root / "step_00000030" / "MANIFEST"
    data = bytearray(manifest.read_bytes())
    data[60] ^= 1
    manifest.write_bytes(bytes(data))
    mgr = distckpt.CheckpointManager(root, keep_last=5)
    out = {"w": torch.zeros(4)}
    result = mgr.load(out)
    assert result.path.endswith("step_00000020") and torch.equal(out["w"], torch.ones(4) * 20)
    # the step it went back past is in the result, by number and why (a warning alone before)
    assert list(result.passed_over) == [30] and "MANIFEST" in result.passed_over[30], result.passed_over
    # a step by number passes over nothing (another manager: a load by number is a rollback)
    assert distckpt.CheckpointManager(root, keep_last=5).load(out, step=20).passed_over == {}
    with caplog.at_level(logging.WARNING, logger="distckpt"):
        mgr.save(25, {"w": torch.ones(4) * 25})
    assert (root / "step_00000030" / "rank00000.bin").exists() and manifest.read_bytes() == bytes(data)
    assert "not known to be an abandoned branch" in caplog.text and "deleting" not in caplog.text, caplog.text
    # The run goes on: its save of step 30 replaces the damaged one (which never loads), named in
    # the log; before, a save of a number load() had passed over was refused (CheckpointExistsError)
    # unless it came first after the load, so whether the run stopped there depended on that.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="distckpt"):
        mgr.save(30, {"w": torch.ones(4) * 31})
    assert "its MANIFEST is damaged" in caplog.text, caplog.text
    assert mgr.load(out).path.endswith("step_00000030") and torch.equal(out["w"], torch.ones(4) * 31)
    manifest.write_bytes(bytes(data))  # damaged again; a job whose first save after load() is step 30
    mgr = distckpt.CheckpointManager(root, keep_last=5)
    assert mgr.load(out).path.endswith("step_00000025")
    mgr.save(30, {"w": torch.ones(4) * 32})
    assert mgr.load(out).path.endswith("step_00000030") and torch.equal(out["w"], torch.ones(4) * 32)
    # keep_abandoned=True refuses to replace it.
    manifest.write_bytes(bytes(data))
    with pytest.raises(CheckpointExistsError):
        distckpt.CheckpointManager(root, keep_abandoned=True).save(30, {"w": torch.ones(4)})
    mgr = distckpt.CheckpointManager(root, keep_last=5)
    mgr.load(out, step=20)  # chosen: a rollback
    mgr.save(21, {"w": torch.ones(4) * 21})
    assert mgr.steps() == [10, 20, 21] and not (root / "step_00000030").exists()  # 25 and 30: abandoned


def test_rollback_keep_abandoned_and_resumed_step_protected(tmp_path):
    root = tmp_path / "root"
    first = distckpt.CheckpointManager(root)
    for step in (100, 200, 300):
        first.save(step, _state(step))
    mgr = distckpt.CheckpointManager(root, keep_last=1, keep_abandoned=True)
    mgr.load(_state(0), step=200)
    mgr.save(250, _state(250))
    # keep_last=1, but the step the job resumed from survives the first save after the resume;
    # the abandoned 300 is kept (and never loaded by default).
    assert mgr.steps() == [200, 250, 300]
    got = _state(0)
    distckpt.CheckpointManager(root).load(got)
    assert got["step"] == 250
    mgr.save(260, _state(260))
    assert mgr.steps() == [260, 300]
    with pytest.raises(CheckpointExistsError):
        mgr.save(300, _state(300))  # keep_abandoned: refuse, never overwrite silently


def test_stale_latest_pointer_after_crash_window(tmp_path):
    # A crash between the commit of 250 and the pointer update leaves `latest` at the abandoned
    # 300 (the job had rolled back to 200): the newest commit, 250, is what load() gives.
    root = tmp_path / "root"
    mgr = distckpt.CheckpointManager(root)
    for step in (100, 200, 300):
        mgr.save(step, _state(step))
    distckpt.save(_state(250), root / "step_00000250")  # committed, pointer not updated
    assert (root / "latest").read_text() == "step_00000300\n"
    assert mgr.latest_step() == 250
    got = _state(0)
    mgr.load(got)
    assert got["step"] == 250
    listing = mgr.describe()
    assert listing.latest == 250 and "committed after it" in listing.pointer_problem


# ------------------------------------------------------------------------------------------------
# 3: a failed async save with nobody waiting surfaces


def _doomed_async_save(tmp_path):
    target = tmp_path / "taken"
    target.mkdir(exist_ok=True)
    (target / "not-a-checkpoint").write_text("x")  # PREPARE refuses it, in the background
    h = distckpt.async_save({"w": torch.ones(4)}, target)
    h._event.wait()
    return h


def test_async_failure_raises_at_next_call(tmp_path):
    h = _doomed_async_save(tmp_path)
    err = h._error
    assert isinstance(err, CheckpointExistsError)
    del h
    with pytest.raises(CheckpointExistsError) as ei:
        distckpt.save({"w": torch.ones(4)}, tmp_path / "next")
    assert ei.value is err and "failed in the background" in "".join(getattr(err, "__notes__", []))
    assert not (tmp_path / "next").exists(), "the next save ran although an earlier one failed unseen"
    distckpt.save({"w": torch.ones(4)}, tmp_path / "next")  # reported once; then saves go on

    mgr = distckpt.CheckpointManager(tmp_path / "root")
    _doomed_async_save(tmp_path)
    with pytest.raises(CheckpointExistsError):
        mgr.save(1, {"w": torch.ones(4)}, blocking=False)
    # A handle whose result() was taken is not raised again.
    h = _doomed_async_save(tmp_path)
    assert isinstance(h.exception(), CheckpointExistsError)
    assert mgr.save(1, {"w": torch.ones(4)}).path == mgr.path(1)


def test_async_failure_logged_at_exit(tmp_path):
    script = (
        "import sys, torch, distckpt, pathlib\n"
        "t = pathlib.Path(sys.argv[1]); t.mkdir(); (t / 'x').write_text('x')\n"
        "distckpt.async_save({'w': torch.ones(4)}, t)\n")
    r = subprocess.run([PY, "-c", script, str(tmp_path / "taken")], capture_output=True, text=True, timeout=120)
    assert "FAILED" in r.stderr and "CheckpointExistsError" in r.stderr, r.stderr


# ------------------------------------------------------------------------------------------------
# 4: save() on some ranks only


def _save_on_rank0_only(rank, world_size, root):
    import torch.distributed as dist
    out = None
    if rank == 0:
        try:
            distckpt.save({"w": torch.ones(4)}, os.path.join(root, "only0"))
        except Exception as exc:  # noqa: BLE001
            out = (type(exc).__name__, getattr(exc, "missing", None), str(exc))
    dist.barrier()  # rank 1 stays in the job until rank 0 has its answer
    return out


def test_save_on_one_rank_only_fails_fast_and_typed(tmp_path):
    # DISTCKPT_TIMEOUT_S bounds the old behaviour (a raw DistStoreError after it) for this test.
    env = {"DISTCKPT_ARRIVAL_TIMEOUT_S": "2", "DISTCKPT_TIMEOUT_S": "30"}
    res = run_ranks(_save_on_rank0_only, 2, str(tmp_path), env=env, timeout=120)
    name, missing, text = res[0]
    assert name == RanksMissingError.__name__ and missing == [1], res[0]
    assert "every rank of the group must call save()" in text and "no_dist=True" in text
    assert not os.path.exists(tmp_path / "only0")


def _one_rank_store_fails_before_the_collective(rank, world_size, root):
    """Rank 0's reclaim before a save fails (its store does not answer), then rank 1's own
    listing for a load would fail: neither may leave the other rank waiting at the collective."""
    from distckpt.errors import EndpointUnreachableError
    mgr = distckpt.CheckpointManager(root)
    boom = EndpointUnreachableError("list failed: the endpoint did not answer", path=root)
    if rank == 0:
        mgr._store.reclaim = lambda *a, **k: (_ for _ in ()).throw(boom)
    mgr.save(3, {"w": torch.arange(4.0)})   # reclaim is housekeeping: the save goes on
    if rank == 1:
        mgr._latest = lambda: (_ for _ in ()).throw(boom)  # rank 0 alone lists for a load
    out = {"w": torch.zeros(4)}
    mgr.load(out)
    loaded = out["w"].tolist()
    if rank == 0:
        mgr._latest = lambda: (_ for _ in ()).throw(boom)
    try:
        mgr.load({"w": torch.zeros(4)})
        error = None
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        error = type(exc).__name__
    return loaded, error


def test_a_store_failing_on_one_rank_before_the_collective_fails_every_rank_at_once(tmp_path):
    """Before, rank 0's reclaim raising before a manager save left rank 1 waiting the arrival
    timeout for a rank that "did not call save()"; each rank listing for a load could fail (or
    find another step) alone. Now the reclaim is housekeeping (a warning) and rank 0 lists for
    everyone: its failure is every rank's, at once."""
    env = {"DISTCKPT_ARRIVAL_TIMEOUT_S": "30", "DISTCKPT_TIMEOUT_S": "60"}
    res = run_ranks(_one_rank_store_fails_before_the_collective, 2, str(tmp_path), env=env, timeout=150)
    # Before: the save raised RanksMissingError on rank 1 (and the listing's error on rank 0 alone);
    # a rank that waited for the other would raise RanksMissingError, not the store's error.
    for rank, (loaded, error) in enumerate(res):
        assert loaded == [0.0, 1.0, 2.0, 3.0], res
        assert error == "EndpointUnreachableError", (rank, res)


# ------------------------------------------------------------------------------------------------
# 7 (issue 14): the async staging pool is bounded and can be given back


RSS_PROBE = r"""
import json, sys, torch, distckpt
from distckpt.staging.pool import staging_pool
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024
state = {"w": torch.randn(32 << 20)}  # 128 MiB
with distckpt.CheckpointManager(sys.argv[1]) as mgr:
    mgr.save(1, state, blocking=False).result()
    held, idle = rss(), staging_pool().idle_bytes()
after_close = rss()
mgr.save(2, state, blocking=False).result()
before_release = rss()
freed = distckpt.release_staging_memory()
print(json.dumps({"held": held, "idle": idle, "after_close": after_close, "before_release": before_release,
                  "freed": freed, "after_release": rss(), "nbytes": state["w"].nbytes}))
"""


def test_staging_memory_released(tmp_path):
    r = subprocess.run([PY, "-c", RSS_PROBE, str(tmp_path / "root")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.strip().splitlines()[-1])
    n = m["nbytes"]
    assert m["idle"] >= n and m["freed"] >= n
    assert m["held"] - m["after_close"] >= 0.9 * n, m          # CheckpointManager.close()
    assert m["before_release"] - m["after_release"] >= 0.9 * n, m  # release_staging_memory()
    import shutil
    shutil.rmtree(tmp_path / "root")


def test_staging_pool_bound(tmp_path, monkeypatch):
    from distckpt.staging.pool import staging_pool
    distckpt.release_staging_memory()
    monkeypatch.setenv("DISTCKPT_STAGING_POOL_BYTES", "0")
    distckpt.async_save({"w": torch.ones(1 << 16)}, tmp_path / "a").result()
    assert staging_pool().idle_bytes() == 0
    monkeypatch.setenv("DISTCKPT_STAGING_POOL_BYTES", str(1 << 20))
    from distckpt.config import get_config
    get_config.cache_clear()
    distckpt.async_save({"w": torch.ones(1 << 16)}, tmp_path / "b").result()
    assert 0 < staging_pool().idle_bytes() <= 1 << 20
    distckpt.async_save({"w": torch.ones(1 << 19)}, tmp_path / "c").result()  # 2 MiB arena: not kept
    assert staging_pool().idle_bytes() <= 1 << 20
    assert distckpt.release_staging_memory() <= 1 << 20 and staging_pool().idle_bytes() == 0


def test_other_hosts_leftovers_are_left_alone(tmp_path):
    # A crashed save whose lock record names another host: on a file system whose flock may be
    # local to each host, a free lock there proves nothing, so it is reported, not deleted.
    root = tmp_path / "root"
    root.mkdir()
    tmp = root / (".step_00000004.tmp-" + "ab" * 16)
    tmp.mkdir()
    (tmp / "rank00000.bin").write_bytes(b"x")
    (root / ".step_00000004.lock").write_text(json.dumps(
        {"host": "some-other-host", "pid": 1, "started_unix": 0, "save_id": "ab" * 16, "what": "x"}))
    mgr = distckpt.CheckpointManager(root)
    states = {lo.entry: lo.state for lo in mgr.describe().leftovers}
    assert states[tmp.name] == "unknown" and states[".step_00000004.lock"] == "unknown"
    assert mgr.reclaim() == [] and tmp.exists()
    mgr.save(5, {"w": torch.ones(2)})  # a save in the same root leaves it alone too
    assert tmp.exists()
    assert sorted(mgr.reclaim(other_hosts=True)) == [".step_00000004.lock", tmp.name]
    assert sorted(os.listdir(root)) == ["latest", "step_00000005"]


def test_plain_save_of_a_path_being_saved_is_refused(tmp_path):
    from distckpt.storage.posix import savelock
    held = savelock.acquire(str(tmp_path / ".ck.lock"), save_id="cd" * 16, what=str(tmp_path / "ck"))
    try:
        with pytest.raises(SaveInProgressError) as ei:
            distckpt.save({"w": torch.ones(2)}, tmp_path / "ck")
        assert ei.value.owner["pid"] == os.getpid()
        assert sorted(os.listdir(tmp_path)) == [".ck.lock"]
    finally:
        held.release()
    assert os.listdir(tmp_path) == []
    distckpt.save({"w": torch.ones(2)}, tmp_path / "ck")
    assert os.listdir(tmp_path) == ["ck"]


def test_foreign_lock_files_are_not_touched(tmp_path):
    (tmp_path / ".tool.lock").write_text("held by some other program")
    assert distckpt.CheckpointManager(tmp_path).reclaim() == []
    assert distckpt.CheckpointManager(tmp_path).describe().leftovers == []
    assert (tmp_path / ".tool.lock").exists()


def test_a_newer_format_version_is_not_a_damaged_step(tmp_path):
    """The newest step written by a newer release (a MANIFEST format version this reader does
    not know) is not damaged: the manager skipped it as such, loaded the step before it, and its
    next save deleted the newer step as an abandoned branch. It raises, naming the version."""
    import struct

    root = tmp_path / "root"
    mgr = distckpt.CheckpointManager(root)
    for step in (100, 200):
        mgr.save(step, _state(step))
    man = root / "step_00000200" / "MANIFEST"
    data = bytearray(man.read_bytes())
    struct.pack_into("<I", data, 8, 99)  # the header's format_version, after the 8-byte magic
    man.write_bytes(bytes(data))
    with pytest.raises(distckpt.errors.ManifestCorruptError, match="format version 99") as info:
        mgr.load(_state(0))
    assert "release" in info.value.remedy
    assert mgr.steps() == [100, 200] and (root / "step_00000200" / "MANIFEST").exists()
    # the listing (distckpt ls) lists every step and says which one it cannot read (it raised)
    listing = mgr.describe()
    assert [(e.name, e.status) for e in listing.entries] == [("step_00000100", "committed"),
                                                              ("step_00000200", "unreadable")]
    assert "format version 99" in listing.entries[1].problem and listing.latest is None


_UNREADABLE_STEP_CHILD = """
import os, torch, distckpt
root = os.environ["ROOT"]
mgr = distckpt.CheckpointManager(root, keep_last=5)
out = {}
try:
    mgr.load({"w": torch.zeros(4), "step": 0})
    out["load"] = "loaded"
except Exception as exc:
    out["load"] = type(exc).__name__
    out["load_remedy"] = getattr(exc, "remedy", None)
said = []
handler = __import__("logging").Handler()
handler.emit = lambda record: said.append(record.getMessage())
__import__("logging").getLogger("distckpt").addHandler(handler)
try:
    mgr.save(210, {"w": torch.full((4,), 210.0), "step": 210})
    out["save"] = "saved"
except Exception as exc:
    out["save"] = type(exc).__name__
out["said"] = said
listing = mgr.describe()
out["ls"] = [[e.name, e.status] for e in listing.entries]
out["latest"] = listing.latest
emit(out)
"""


def test_a_step_directory_that_cannot_be_entered_is_never_skipped(tmp_path):
    """The newest step's directory cannot be entered (EACCES here; an NFS error reads the same):
    the manager left it out of steps() as "not committed", loaded the step before it with no
    warning, and once the directory was readable again the next save deleted it as an abandoned
    branch. Now load() raises the permission error; a save commits, and its rotation leaves the
    step out with a warning (it raised, failing every later save after its commit and stopping
    rotation: a review); the listing shows the step as unreadable and marks no step latest."""
    from ..helpers.faults import run_python
    root = tmp_path / "root"
    mgr = distckpt.CheckpointManager(root, keep_last=5)
    for step in (100, 200, 300):
        mgr.save(step, _state(step))
        time.sleep(0.02)
    s300 = root / "step_00000300"
    os.chmod(s300, 0)
    try:
        res = run_python(_UNREADABLE_STEP_CHILD, env={"ROOT": str(root)},
                         drop_caps=("cap_dac_override", "cap_dac_read_search"), timeout=120).check()
    finally:
        os.chmod(s300, 0o755)
    out = res.emitted[0]
    assert out["load"] == "StoragePermissionError", out
    assert "readable" in out["load_remedy"] and "writable" not in out["load_remedy"], out  # a read's remedy
    assert out["save"] == "saved", out
    assert any("step_00000300 cannot be looked at" in m and "never deleted" in m for m in out["said"]), out
    assert ["step_00000300", "unreadable"] in out["ls"] and out["latest"] is None, out
    assert mgr.steps() == [100, 200, 210, 300]
    got = {"w": torch.zeros(4), "step": 0}
    mgr.load(got)  # step 210 was committed last; 300 is intact
    assert got["step"] == 210
    assert distckpt.read(str(s300))["step"] == 300


_ROTATE_PAST_UNREADABLE_CHILD = """
import os, torch, distckpt
root = os.environ["ROOT"]
mgr = distckpt.CheckpointManager(root, keep_last=2)
out = {}
for step in (3, 4):
    try:
        mgr.save(step, {"w": torch.ones(4) * step})
        out[step] = "saved"
    except Exception as exc:
        out[step] = type(exc).__name__
out["left"] = sorted(n for n in os.listdir(root) if n.startswith("step_"))
emit(out)
"""


def test_rotation_goes_on_past_a_step_it_cannot_look_at(tmp_path):
    """An old step's directory cannot be entered: every save raised after its commit (its
    rotation listed the steps strictly) and nothing was deleted any more, so the disk filled.
    The saves succeed; the rotation keeps that step and deletes the others it should."""
    from ..helpers.faults import run_python
    root = tmp_path / "root"
    mgr = distckpt.CheckpointManager(root, keep_last=2)
    for step in (1, 2):
        mgr.save(step, _state(step))
    os.chmod(root / "step_00000001", 0)
    try:
        res = run_python(_ROTATE_PAST_UNREADABLE_CHILD, env={"ROOT": str(root)},
                         drop_caps=("cap_dac_override", "cap_dac_read_search"), timeout=120).check()
    finally:
        os.chmod(root / "step_00000001", 0o755)
    out = res.emitted[0]
    assert out["3"] == out["4"] == "saved", out
    assert out["left"] == ["step_00000001", "step_00000003", "step_00000004"], out


_RECLAIM_REFUSED_CHILD = """
import logging, os, torch, distckpt
root = os.environ["ROOT"]
said = []
handler = logging.Handler()
handler.emit = lambda record: said.append(record.getMessage())
logging.getLogger("distckpt").addHandler(handler)
mgr = distckpt.CheckpointManager(root)
mgr.save(3, {"w": torch.ones(4)})
emit({"said": said, "steps": mgr.steps()})
"""


def test_a_reclaim_refused_on_a_local_root_is_said_when_the_save_succeeds(tmp_path):
    """A crashed save's leftover whose files cannot be deleted (EACCES) fails the reclaim before
    a save, and the save succeeds: the warning was hidden at DEBUG with the object store's
    errors (which the save then raises itself), so nothing said the space is not freed."""
    from ..helpers.faults import run_python
    root = tmp_path / "root"
    distckpt.CheckpointManager(root).save(1, {"w": torch.ones(4)})
    left = root / (".step_00000002.tmp-" + "ab" * 16)  # a crashed save's leftover
    (left / "sub").mkdir(parents=True)
    (left / "sub" / "rank00000.bin").write_bytes(b"x" * 4096)
    os.chmod(left / "sub", 0o555)  # its file cannot be unlinked without cap_dac_override
    try:
        res = run_python(_RECLAIM_REFUSED_CHILD, env={"ROOT": str(root)},
                         drop_caps=("cap_dac_override",), timeout=120).check()
    finally:
        os.chmod(left / "sub", 0o755)
    out = res.emitted[0]
    assert out["steps"] == [1, 3], out
    assert any("could not reclaim leftovers" in m and "step 3" in m for m in out["said"]), out["said"]


def test_latest_step_decodes_only_the_newest_valid_manifest(tmp_path, monkeypatch, caplog):
    """latest_step() orders the steps by the commit time in each MANIFEST's first bytes and fully
    decodes (checksum + validation) only from the newest down to the first valid one; it never
    returns a step that is not committed (no MANIFEST, damaged MANIFEST, tmp dir)."""
    from distckpt import manifest as mf
    root = tmp_path / "root"
    mgr = distckpt.CheckpointManager(root)
    for step in (100, 300, 200):  # commit order differs from number order: newest commit is 200
        mgr.save(step, _state(step))
    decodes = []
    real_decode = mf.decode_header  # a listing decodes MANIFESTs only, never the data files' indexes
    monkeypatch.setattr(mf, "decode_header", lambda data, path=None: decodes.append(path) or real_decode(data, path=path))
    assert mgr.latest_step() == 200
    # The newest by commit, and the step numbered above it (older by its unchecked peek) too.
    assert [os.path.basename(os.path.dirname(p)) for p in decodes] == ["step_00000200", "step_00000300"], decodes
    # Newest MANIFEST damaged after its first 4 KiB (the peek cannot see it): skipped, next newest.
    man = root / "step_00000200" / "MANIFEST"
    data = bytearray(man.read_bytes())
    data[-1] ^= 0xFF  # its checksum no longer matches
    man.write_bytes(bytes(data))
    decodes.clear()
    with caplog.at_level(logging.WARNING, logger="distckpt"):
        assert mgr.latest_step() == 300
    assert "step_00000200" in caplog.text and "damaged" in caplog.text
    assert [os.path.basename(os.path.dirname(p)) for p in decodes] == ["step_00000200", "step_00000300"]
    # A MANIFEST whose header is garbage (the peek cannot tell its time), a step dir without one,
    # a save's tmp dir with a newer valid MANIFEST: none of them is ever returned.
    (root / "step_00000300" / "MANIFEST").write_bytes(b"garbage")
    (root / "step_00000900").mkdir()
    tmp = root / ".step_00000950.tmp-0123456789abcdef0123456789abcdef"
    tmp.mkdir()
    (tmp / "MANIFEST").write_bytes((root / "step_00000100" / "MANIFEST").read_bytes())
    assert mgr.latest_step() == 100
    (root / "step_00000100" / "MANIFEST").unlink()
    assert mgr.latest_step() is None
    with pytest.raises(distckpt.errors.CheckpointNotFoundError):
        mgr.load(_state(0))


def test_a_peek_read_wrong_never_passes_over_the_newest_step(tmp_path, monkeypatch):
    """latest_step() orders steps by the commit time in each MANIFEST's first 4 KiB, which no
    checksum covers (one ranged GET each on an object store): one bit flipped in transit in the
    newest step's time made it look older and load() took the step before, silently (an outside
    trial). The steps numbered above the newest by peek are decoded whole too: a peek that
    disagrees with its MANIFEST sends latest_step() to the full decode of every step."""
    root = tmp_path / "root"
    mgr = distckpt.CheckpointManager(root)
    for step in (1, 2):
        mgr.save(step, _state(step))
    real = mgr._store.peek_commit_time

    def flipped(path):
        t = real(path)
        return t - 262144.0 if t is not None and path.endswith("step_00000002") else t

    monkeypatch.setattr(mgr._store, "peek_commit_time", flipped)
    assert mgr.latest_step() == 2
    got = _state(0)
    mgr.load(got)
    assert torch.equal(got["w"], _state(2)["w"])


def test_peek_commit_time_matches_the_decoded_manifest(tmp_path):
    from distckpt.storage.posix import manifests as mf
    distckpt.save({"w": torch.ones(3), "objs": {str(i): i for i in range(500)}}, tmp_path / "c",
                  metadata={"note": "x" * 10000})
    assert mf.peek_commit_time(tmp_path / "c") == mf.load_manifest(tmp_path / "c").created_unix
    assert mf.peek_commit_time(tmp_path / "missing") is None
    os.symlink(tmp_path / "c" / "MANIFEST", tmp_path / "link")
    assert mf.peek_commit_time(tmp_path / "link") is None  # never follows a symlink


def test_only_the_managers_own_step_names_are_steps(tmp_path):
    """step_0000000007 beside step_00000007 listed step 7 twice (the listing took any 8+ digits,
    the manager's path(7) names only the second): a name the manager never gives is not a step."""
    for name, value in (("step_00000003", 3.0), ("step_0000000007", 70.0), ("step_00000007", 7.0),
                        ("step_000000005", 5.0), ("step_123456789", 9.0)):
        distckpt.save({"w": torch.full((2,), value)}, str(tmp_path / name), no_dist=True)
    m = distckpt.CheckpointManager(str(tmp_path))
    assert m.steps() == [3, 7, 123456789] and m.path(123456789).endswith("step_123456789")
    sd = {"w": torch.zeros(2)}
    m.load(sd, 7)
    assert torch.equal(sd["w"], torch.full((2,), 7.0))


@pytest.mark.parametrize("kind, skew", [("manager", 120), ("tiered", -120)])  # a clock behind, one ahead
def test_a_restart_on_a_host_whose_clock_is_off_still_resumes_from_the_newest_step(tmp_path, kind, skew):
    """The newest step is the newest by commit time (a rollback's resumed branch, numbered below the
    abandoned one, must win), which rank 0 takes from its clock. A run on a host whose clock ran
    2 minutes behind the previous run's committed steps 6-8 before step 5 (in commit time): the
    next run, on a right clock, loaded step 5, silently. With a clock ahead, the run after it did
    the same to its own steps. Now each commit into a root is stamped after the newest commit time
    known there (distckpt.commitclock): every run resumes from the step the last one saved."""
    from ..helpers.faults import REPO_ROOT

    def run(phase: str, clock_skew: float) -> dict:
        env = os.environ | {"SKEW": str(clock_skew), "PYTHONPATH": str(REPO_ROOT)}
        p = subprocess.run([sys.executable, "-m", "tests.helpers.skewed_clock_worker", kind, str(tmp_path), phase],
                           capture_output=True, text=True, env=env, timeout=240, cwd=str(REPO_ROOT))
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    run("save:1-5", 0)
    assert run("save:6-8", skew) == {"resumed_from": 5}
    assert run("save:9-9", 0) == {"resumed_from": 8}
    assert run("load", skew) == {"latest": 9, "loaded": 9, "exact": True}


def test_a_step_rotated_away_while_listing_is_neither_damaged_nor_passed_over(tmp_path, caplog):
    """An outside trial: readers looping latest_step() + load() beside a writer whose rotation
    deleted steps logged "looks committed but its MANIFEST is damaged (no MANIFEST...)" at every
    rotation: a step deleted between the listing and its decode. It is gone, not damaged: no
    warning, and the load's passed_over does not name it."""
    import shutil
    root = tmp_path / "root"
    mgr = distckpt.CheckpointManager(root, keep_last=5)
    for step in (1, 2, 3):
        mgr.save(step, _state(step))
    real = mgr._store.peek_commit_time

    def peek_then_rotate(path):
        t = real(path)
        if path.endswith("step_00000003"):
            shutil.rmtree(path)   # another process's rotation, right after this one peeked it
        return t
    mgr._store.peek_commit_time = peek_then_rotate
    with caplog.at_level(logging.WARNING, logger="distckpt"):
        result = mgr.load(_state(0))
    assert result.path.endswith("step_00000002") and result.passed_over == {}, result
    assert "damaged" not in caplog.text, caplog.text
