"""distckpt as DeepSpeed's checkpoint engine (distckpt.integrations.deepspeed.install), with real
DeepSpeed 0.19.8 on CPU (DS_ACCELERATOR=cpu, gloo) under torchrun; no mocks.

Three torchrun launches (tests/_deepspeed_worker.py) cover every check, so DeepSpeed's start-up is
paid three times:
  1. 2 ranks: for ZeRO stages 0, 1, 2, 3 (fp32 and bf16 mixed; stage 3 with every parameter
     partitioned): train 3 steps, save through engine.save_checkpoint, train 2 more. Then 200
     saves with keep_last=3 on a tmpfs; ENOSPC on a small tmpfs; finally rank 1 is SIGKILLed
     inside a save (its data file written, the commit not reached), which ends the launch.
  2. 2 new ranks: engine.load_checkpoint of each stage's checkpoint and the same 2 steps: losses,
     parameters, master weights and Adam state identical to the run that never stopped; the
     killed save's directory loads its previous tag.
  3. 3 ranks: a checkpoint saved at 2 ranks, loaded through the engine at 3.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

from .distributed import free_port
from .faults import require_root, tmpfs_mount

if importlib.util.find_spec("deepspeed") is None:  # only the torchrun children import it
    pytest.skip("deepspeed is not installed", allow_module_level=True)

WORKER = os.path.join(os.path.dirname(__file__), "_deepspeed_worker.py")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ["0-bf16", "1-fp32", "2-bf16", "3-fp32", "3-bf16"]
RESHARD = ["1-fp32", "2-bf16", "3-fp32"]
ENOSPC_TMPFS = "4m"
BALLAST_ELEMS = 2 << 20  # 8 MiB of client_state: the second save cannot fit the 4 MiB tmpfs


def _torchrun(n: int, out: str, phases: list[str], env: dict, timeout: float = 420) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **env}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(n),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), WORKER, out, *phases]
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
    with open(os.path.join(out, f"launch{n}-{phases[0].replace(':', '_')}.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    return proc


def _tail(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "Warning" not in ln and "warn" not in ln]
    return "\n".join(lines[-60:])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_root("mounting the tmpfs file systems of the rotation and ENOSPC checks")
    out = str(tmp_path_factory.mktemp("deepspeed"))
    rot, nospace = os.path.join(out, "rotate"), os.path.join(out, "enospc")
    env = {"OUT_ROTATE": rot, "OUT_ENOSPC": nospace, "BALLAST_ELEMS": str(BALLAST_ELEMS),
           # the ENOSPC must come from the data write itself, not from the pre-flight space check
           "DISTCKPT_PREFLIGHT": "0", "DISTCKPT_TIMEOUT_S": "60"}
    with tmpfs_mount(rot, size="16m"), tmpfs_mount(nospace, size=ENOSPC_TMPFS):
        first = _torchrun(2, out, [f"train:{c}" for c in CONFIGS] + ["rotate", "enospc", "kill"], env)
    # The kill phase ends the first launch: rank 1 dies by SIGKILL, torchrun stops rank 0.
    assert first.returncode != 0 and os.path.exists(os.path.join(out, "kill.rank0.pt")), _tail(first)
    second = _torchrun(2, out, [f"resume:{c}" for c in CONFIGS] + ["afterkill"], env)
    assert second.returncode == 0, _tail(second)
    third = _torchrun(3, out, [f"reshard:{c}" for c in RESHARD], env)
    assert third.returncode == 0, _tail(third)
    return out


def _load(out: str, phase: str, rank: int) -> dict:
    return torch.load(os.path.join(out, f"{phase.replace(':', '_')}.rank{rank}.pt"), weights_only=True)


def _assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(a.keys() ^ b.keys())}"
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k} differs"
        else:
            assert a[k] == b[k], f"{what}: {k}: {a[k]!r} != {b[k]!r}"


@pytest.mark.parametrize("cfg", CONFIGS)
def test_resume_is_identical_to_the_uninterrupted_run(runs, cfg):
    for rank in (0, 1):
        train, resume = _load(runs, f"train:{cfg}", rank), _load(runs, f"resume:{cfg}", rank)
        # One distckpt checkpoint per tag: MANIFEST + one data file per rank, no .pt pickle files,
        # and `latest` beside it (DeepSpeed's zero_to_fp32.py copies are not written).
        assert train["files"] == ["latest", "s3"]
        assert train["tag_files"] == ["MANIFEST", "rank00000.bin", "rank00001.bin"]
        assert resume["path"] == os.path.join(runs, f"ckpt_{cfg}", "s3")
        _assert_same(train["saved"], resume["loaded"], f"{cfg} rank {rank}: state after load")
        assert resume["after"] == train["after"], f"{cfg} rank {rank}: losses after resume"
        _assert_same(train["final"], resume["final"], f"{cfg} rank {rank}: state after 2 more steps")
        client = resume["client"]
        assert (client["epoch"], client["note"], client["sizes"]) == (7, "s3", (1, 2))
        assert resume["new_fds"] == "{}", resume["new_fds"]  # no fd into the checkpoint left open
        assert torch.equal(client["rng"], train["rng"])
        # the comparisons above covered the fp32 master weights and the Adam moments of this rank
        assert any(k.startswith("master.") for k in train["saved"]), sorted(train["saved"])
        assert any(k.endswith(".exp_avg_sq") for k in train["saved"]), sorted(train["saved"])


def test_200_saves_keep_last_3_free_space_and_fds(runs):
    r = _load(runs, "rotate", 0)
    assert r["listing"] == ["latest", "t198", "t199", "t200"], r["listing"]
    assert r["latest"] == "t200"
    assert r["grew"] == [], f"used space grew beyond the plateau after save 3: {r['grew'][:5]}"
    for rank in (0, 1):
        r = _load(runs, "rotate", rank)
        assert r["leaked"] == "{}", r["leaked"]
        assert r["deleted"] == [], r["deleted"]


def test_enospc_mid_save_is_typed_on_every_rank_and_keeps_the_previous_tag(runs):
    for rank in (0, 1):
        r = _load(runs, "enospc", rank)
        err = r["error"]
        assert err is not None, "the save that cannot fit returned normally"
        assert "DistCkptError" in err["mro"], err
        assert err["cls"] in ("DiskFullError", "RankFailureError"), err
        if err["cls"] == "RankFailureError":
            assert "DiskFullError" in err["failures"], err
        assert r["latest"] == "good"
        assert "big" not in r["listing"] and "good" in r["listing"], r["listing"]
        assert r["loaded_path"].endswith("/good")
        _assert_same(r["good"], r["reloaded"], f"rank {rank}: previous tag after ENOSPC")
        assert r["new_fds"] == "{}", r["new_fds"]
        refused = r["refused"]
        assert "UnsupportedValueError" in refused["object"], refused
        assert "ConfigError" in refused["tag"] and "ConfigError" in refused["load_module_only"], refused
        # Only rank 1's tag is missing: every rank raises its class (errors.collective_error), so
        # `except FileNotFoundError` catches it, with rank 1's error in ``failures``.
        assert refused["one_rank_missing"][0] == "CheckpointNotFoundError", refused
        assert "FileNotFoundError" in refused["one_rank_missing"], refused
        assert not any(n in ("obj", "evil") for n in r["listing_after"]), r["listing_after"]


def test_rank_killed_mid_save_leaves_the_previous_tag_loadable(runs):
    for rank in (0, 1):
        r = _load(runs, "afterkill", rank)
        assert r["path"] == os.path.join(runs, "ckpt_kill", "good")
        assert "doomed" not in r["listing"], r["listing"]
        assert r["listing_after_save"] == ["again", "good", "latest"], r["listing_after_save"]
        _assert_same(_load(runs, "kill", rank)["good"], r["loaded"], f"rank {rank}: tag saved before the kill")


def test_load_at_another_data_parallel_size(runs):
    """Saved at 2 ranks through the engine, loaded at 3 through the engine: the full parameters,
    and the fp32 masters and Adam state (written again from their 3-rank partitions and read
    whole) are bit-identical to the saved ones, and training goes on."""
    for cfg in RESHARD:
        saved = {k: v for k, v in _load(runs, f"train:{cfg}", 0)["saved"].items()
                 if not k.startswith(("master.", "optim."))}
        for rank in range(3):
            r = _load(runs, f"reshard:{cfg}", rank)
            _assert_same(saved, r["loaded"], f"{cfg} at 3 ranks, rank {rank}")
            assert all(map(math.isfinite, r["after"])), r["after"]
        cmp = _load(runs, f"reshard:{cfg}", 0)["compare"]
        assert cmp["keys"] > 0 and cmp["differ"] == [], cmp


def test_importing_the_integration_does_not_import_deepspeed():
    """`install` imports deepspeed when first asked for; `import distckpt` and the integration
    package alone never do (a monitoring script or the CLI pays nothing for it)."""
    code = ("import sys, distckpt, distckpt.integrations.deepspeed as d; "
            "assert 'deepspeed' not in sys.modules, 'deepspeed imported'; "
            "d.install; assert 'deepspeed' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "DS_ACCELERATOR": "cpu",
                   "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}, timeout=300)
