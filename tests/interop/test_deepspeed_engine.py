"""distckpt as DeepSpeed's checkpoint engine (distckpt.integrations.deepspeed.install), with real
DeepSpeed 0.19.8 on CPU (DS_ACCELERATOR=cpu, gloo) under torchrun; no mocks.

Six torchrun launches (tests/helpers/deepspeed_engine_worker.py), each a fixture or test of its own:
  1. `trained`, 2 ranks: for ZeRO stages 0, 1, 2, 3 (fp32 and bf16 mixed; stage 3 with every
     parameter partitioned): train 3 steps, save through engine.save_checkpoint, train 2 more.
     Then 200 saves with keep_last=3 on a tmpfs; ENOSPC on a small tmpfs; finally rank 1 is
     SIGKILLed inside a save (its data file written, the commit not reached), which ends the launch.
  2. `resumed`, 2 new ranks: engine.load_checkpoint of each stage's checkpoint and the same 2
     steps: losses, parameters, master weights and Adam state identical to the run that never
     stopped; the killed save's directory loads its previous tag.
  3. `resharded`, 3 ranks: a checkpoint saved at 2 ranks, loaded through the engine at 3.
  4-5. DeepSpeed's own checkpoint engine and distckpt's side by side, every load option.
  6. The same at the edges: scheduler and client_state container types, frozen parameters left
     out, ZeRO-3 tied weights.
pytest-timeout's limit covers a test's fixture set-up too: the tests are ordered so that each pays
for one launch at most, and every launch has its own, shorter, time limit (LAUNCH_TIMEOUT_S).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ..helpers.distributed import free_port, kill_tree
from ..helpers.faults import require_root, tmpfs_mount

if importlib.util.find_spec("deepspeed") is None:  # only the torchrun children import it
    pytest.skip("deepspeed is not installed", allow_module_level=True)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, "tests", "helpers", "deepspeed_engine_worker.py")
CONFIGS = ["0-bf16", "1-fp32", "2-bf16", "3-fp32", "3-bf16"]
STEPS_BEFORE = 3  # training steps before the save, in every phase of the worker
RESHARD = ["1-fp32", "2-bf16", "3-fp32"]
ENOSPC_TMPFS = "4m"
BALLAST_ELEMS = 2 << 20  # 8 MiB of client_state: the second save cannot fit the 4 MiB tmpfs
# The longest launch takes about 2 minutes on an idle 2-core machine; 3x that still passes, and the
# limit leaves room under pytest's 600 s for the test's own checks.
LAUNCH_TIMEOUT_S = 480
# Side by side with DeepSpeed's own engine (tests/helpers/deepspeed_engine_worker.py native:<cfg>), two launches
# the ENOSPC must come from the data write itself, not from the pre-flight space check
RUN_ENV = {"DISTCKPT_PREFLIGHT": "0", "DISTCKPT_TIMEOUT_S": "60"}
NATIVE_GROUPS = [["0-bf16", "2-bf16"], ["1-fp32", "3-bf16"], ["2-bf16-offload", "3-bf16-offload"]]


def _torchrun(n: int, out: str, phases: list[str], env: dict | None = None,
              timeout: float = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run the worker's ``phases`` on ``n`` ranks; its output goes to ``out/launch<n>-<phase>.log``.

    Fails the test (torchrun and every process under it killed) when the launch runs past ``timeout``,
    and when DeepSpeed built or loaded its shm op (the workers skip it: see _without_shm_op)."""
    full_env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(n),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), WORKER, out, *phases]
    log = os.path.join(out, f"launch{n}-{phases[0].replace(':', '_')}.log")
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        stdout, stderr = proc.communicate()
        with open(log, "w") as f:
            f.write(stdout + stderr)
        pytest.fail(f"torchrun of {phases} on {n} ranks did not finish within {timeout} s (killed); "
                    f"last output:\n{_tail(subprocess.CompletedProcess(cmd, -9, stdout, stderr))}")
    with open(log, "w") as f:
        f.write(stdout + stderr)
    done = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    assert "deepspeed_shm_comm" not in stdout + stderr, f"the launch built DeepSpeed's shm op:\n{_tail(done)}"
    return done


def _tail(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "Warning" not in ln and "warn" not in ln]
    return "\n".join(lines[-60:])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Launch 1 (see the module docstring); the output directory."""
    require_root("mounting the tmpfs file systems of the rotation and ENOSPC checks")
    out = str(tmp_path_factory.mktemp("deepspeed"))
    rot, nospace = os.path.join(out, "rotate"), os.path.join(out, "enospc")
    env = {"OUT_ROTATE": rot, "OUT_ENOSPC": nospace, "BALLAST_ELEMS": str(BALLAST_ELEMS), **RUN_ENV}
    with tmpfs_mount(rot, size="16m"), tmpfs_mount(nospace, size=ENOSPC_TMPFS):
        first = _torchrun(2, out, [f"train:{c}" for c in CONFIGS] + ["frozen3save", "rotate", "enospc", "kill"],
                          env)
    # The kill phase ends the first launch: rank 1 dies by SIGKILL, torchrun stops rank 0.
    assert first.returncode != 0 and os.path.exists(os.path.join(out, "kill.rank0.pt")), _tail(first)
    return out


@pytest.fixture(scope="module")
def resumed(trained):
    """Launch 2: new ranks load what launch 1 saved."""
    second = _torchrun(2, trained, [f"resume:{c}" for c in CONFIGS] + ["afterkill"], RUN_ENV)
    assert second.returncode == 0, _tail(second)
    return trained


@pytest.fixture(scope="module")
def resharded(trained):
    """Launch 3: 3 ranks load what launch 1 saved at 2."""
    third = _torchrun(3, trained, [f"reshard:{c}" for c in RESHARD] + ["frozen3load"], RUN_ENV)
    assert third.returncode == 0, _tail(third)
    return trained


def _load(out: str, phase: str, rank: int) -> dict:
    return torch.load(os.path.join(out, f"{phase.replace(':', '_')}.rank{rank}.pt"), weights_only=True)


def _model_states(cfg: str, rank: int) -> str:
    """DeepSpeed's model-states file name of ``rank`` (ZeRO-3: one per rank)."""
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if cfg.startswith("3-") else "mp_rank_00_model_states.pt"


def _assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(a.keys() ^ b.keys())}"
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k} differs"
        else:
            assert a[k] == b[k], f"{what}: {k}: {a[k]!r} != {b[k]!r}"


def test_200_saves_keep_last_3_free_space_and_fds(trained):
    runs = trained
    r = _load(runs, "rotate", 0)
    assert r["listing"] == ["latest", "t198", "t199", "t200"], r["listing"]
    assert r["latest"] == "t200"
    assert r["grew"] == [], f"used space grew beyond the plateau after save 3: {r['grew'][:5]}"
    for rank in (0, 1):
        r = _load(runs, "rotate", rank)
        assert r["leaked"] == "{}", r["leaked"]
        assert r["deleted"] == [], r["deleted"]


def test_enospc_mid_save_is_typed_on_every_rank_and_keeps_the_previous_tag(trained):
    runs = trained
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
        assert r["loaded_path"] == os.path.join(runs, "enospc", "good", "mp_rank_00_model_states.pt")
        _assert_same(r["good"], r["reloaded"], f"rank {rank}: previous tag after ENOSPC")
        assert r["new_fds"] == "{}", r["new_fds"]
        refused = r["refused"]
        assert "UnsupportedValueError" in refused["object"], refused
        assert "ConfigError" in refused["tag"] and "ConfigError" in refused["custom_load_fn"], refused
        # Only rank 1's tag is missing: every rank raises its class (errors.collective_error), so
        # `except FileNotFoundError` catches it, with rank 1's error in ``failures``.
        assert refused["one_rank_missing"][0] == "CheckpointNotFoundError", refused
        assert "FileNotFoundError" in refused["one_rank_missing"], refused
        assert not any(n in ("obj", "evil") for n in r["listing_after"]), r["listing_after"]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_resume_is_identical_to_the_uninterrupted_run(resumed, cfg):
    runs = resumed
    for rank in (0, 1):
        train, resume = _load(runs, f"train:{cfg}", rank), _load(runs, f"resume:{cfg}", rank)
        # One distckpt checkpoint per tag: MANIFEST + one data file per rank, no .pt pickle files,
        # and `latest` beside it (DeepSpeed's zero_to_fp32.py copies are not written).
        assert train["files"] == ["latest", "s3"]
        assert train["tag_files"] == ["MANIFEST", "rank00000.bin", "rank00001.bin"]
        # what DeepSpeed returns: the path of the model-states file this rank loaded (in the tag
        # directory; its contents are the checkpoint's files.<name> subtree)
        assert resume["path"] == os.path.join(runs, f"ckpt_{cfg}", "s3", _model_states(cfg, rank))
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


def test_rank_killed_mid_save_leaves_the_previous_tag_loadable(resumed):
    runs = resumed
    for rank in (0, 1):
        r = _load(runs, "afterkill", rank)
        assert r["path"] == os.path.join(runs, "ckpt_kill", "good", "mp_rank_00_model_states.pt")
        assert "doomed" not in r["listing"], r["listing"]
        assert r["listing_after_save"] == ["again", "good", "latest"], r["listing_after_save"]
        _assert_same(_load(runs, "kill", rank)["good"], r["loaded"], f"rank {rank}: tag saved before the kill")


def test_load_at_another_data_parallel_size(resharded):
    runs = resharded
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
    # ZeRO-3 with a frozen layer: its partitions in DeepSpeed's model states do not reshard; a
    # typed error before the engine changes (it was torch's RuntimeError from DeepSpeed's load)
    for rank in range(3):
        r = _load(runs, "frozen3load", rank)
        assert r["result"].startswith("ReshardError") and "data-parallel size 2" in r["result"], r
        assert r["excluded"] == "loaded", r  # saved without frozen partitions: nothing to reshard


@pytest.mark.parametrize("group", NATIVE_GROUPS, ids=["+".join(g) for g in NATIVE_GROUPS])
def test_load_checkpoint_returns_and_restores_what_deepspeeds_own_engine_does(tmp_path, group):
    """One engine saves the same state through DeepSpeed's own checkpoint engine and through
    distckpt's; fresh engines load each, with the defaults, load_module_only=True,
    load_optimizer_states=False, and that plus load_lr_scheduler_states=False. For every option
    set the two loads return the same (path relative to the save directory, so the same tag and
    model-states file name; every client_state entry) and leave the same engine: parameters, fp32
    masters, optimizer state, lr, global_steps, global_samples, skipped_steps, lr-scheduler state,
    the loaded data-parallel size, and the losses and state of 2 more steps. At ZeRO-3 distckpt's
    load_module_only is compared with DeepSpeed's load_module_only + load_optimizer_states=False,
    the only way DeepSpeed 0.19.8 loads ZeRO-3 weights without the optimizer (checked below)."""
    out = str(tmp_path)
    proc = _torchrun(2, out, [f"native:{cfg}" for cfg in group])
    assert proc.returncode == 0, _tail(proc)
    for cfg in group:
        for rank in (0, 1):
            r = _load(out, f"native:{cfg}", rank)
            saved, fresh, results = r["saved"], r["fresh"], r["results"]
            params = sorted(k for k in saved if k.startswith("param."))
            assert params and sorted(results) == ["default", "module_only", "no_optimizer", "no_optimizer_no_scheduler"]
            for name, res in results.items():
                assert res["differ"] == [], (cfg, rank, name, res["differ"][:10])
                assert res["path"] == os.path.join("s3", _model_states(cfg, rank)), (cfg, name, res["path"])
                assert res["client"] == {"epoch": 7, "note": "s3", "sizes": (1, 2)}, (cfg, name)
                state = res["state"]
                # the weights are the saved ones with every option
                _assert_same({k: saved[k] for k in params}, {k: state[k] for k in params}, f"{cfg} {name} weights")
                sched = json.loads(res["scheduler"])["last_batch_iteration"]
                optim_keys = sorted(k for k in state if k.startswith("optim."))
                if name == "default":
                    _assert_same(saved, state, f"{cfg} rank {rank}: default load")
                    assert sched == STEPS_BEFORE - 1
                else:  # no optimizer state restored: the fresh engine's (stage 0 bf16: a warm-up step's)
                    fresh_optim = {k: v for k, v in fresh.items() if k.startswith("optim.")}
                    _assert_same(fresh_optim, {k: state[k] for k in optim_keys}, f"{cfg} {name} optimizer state")
                if name == "module_only":  # weights only: step counters and scheduler not restored
                    assert state["global_steps"] == fresh["global_steps"] == 0 and sched == -1, (cfg, state["global_steps"])
                    assert "global_steps" in res["client_keys"]  # DeepSpeed returns them in client_state
                elif name != "default":
                    assert state["global_steps"] == saved["global_steps"] == STEPS_BEFORE
                    assert sched == (STEPS_BEFORE - 1 if name == "no_optimizer" else -1), (cfg, name, sched)
            if cfg.startswith("3-"):
                # DeepSpeed's own ZeRO-3 load_module_only (optimizer states left on) loads no weight
                _assert_same({k: fresh[k] for k in params}, r["module_only_zero3"], f"{cfg}: DeepSpeed's module-only")


@pytest.fixture(scope="module")
def edges(tmp_path_factory):
    """One launch, 2 ranks: the worker's edges and refusals phases; the output directory."""
    out = str(tmp_path_factory.mktemp("deepspeed_edges"))
    proc = _torchrun(2, out, ["edges", "refusals"])
    assert proc.returncode == 0, _tail(proc)
    return out


def test_parity_with_deepspeeds_own_engine_at_the_edges(edges):
    """Where the side-by-side test above does not look (tests/helpers/deepspeed_engine_worker.py
    edges; every comparison against DeepSpeed's own engine in the same launch, 2 ranks):
      * a torch MultiStepLR (milestones: a Counter) and client_state holding an OrderedDict, a
        Counter, a defaultdict(int) and an nn.Parameter under two keys, through install() and through the standalone
        zero.save/zero.load: the same types and values, the same lr at the next milestone (the
        JSON metadata of format 1 turned the milestones' int keys into strings: lr never decayed);
      * exclude_frozen_parameters=True: a load onto a new frozen base keeps it, and a strict load
        fails on the missing key as DeepSpeed's does;
      * ZeRO-3 with tied weights loaded without optimizer states (and module only): the same
        weights (distckpt's load raised on the tied head's missing key);
      * a scheduler whose state holds no value (nested empty dicts) round-trips through zero;
      * ZeRO 1/2 module weights changed after the last step (a weight constraint), with and
        without zero_optimization.load_from_fp32_weights: the saved weights come back and the
        next losses are DeepSpeed's (distckpt rebuilt the weights from the masters);
      * save_16bit_model after install(): the same pytorch_model.bin as DeepSpeed's (it was a
        ConfigError on rank 0 while rank 1 waited in the commit's collective);
      * ZeRO-3, a parameter frozen at load that was trained at save: ReshardError naming it,
        the engine unchanged (DeepSpeed raises a bare KeyError from its module load);
      * each file of a tag read once per load_checkpoint (DeepSpeed asks for the model states
        twice: the second request is served the state read for the first);
      * a replacement seen by one rank's last look only: every rank raises it;
      * the tag overwritten by another save between DeepSpeed's reads of its files: a
        CheckpointRemovedError on every rank (each file was read alone, the later ones from the
        other save: a silent mix of two checkpoints)."""
    out = edges
    for rank in (0, 1):
        r = _load(out, "edges", rank)
        assert r["scheduler_and_client"] == [] and r["zero_scheduler"] == [], r
        assert r["milestones_type"] == "Counter", r
        assert r["frozen"] == {"ds": True, "ds_strict": True, "dc": True, "dc_strict": True}, r["frozen"]
        assert len(r["tied_zero3"]) == 2 and all(d == [] for d in r["tied_zero3"].values()), r["tied_zero3"]
        assert r["empty_scheduler"] == {"inner": {}}, r["empty_scheduler"]
        assert len(r["edited_weights"]) == 4 and all(d == [] for d in r["edited_weights"].values()), \
            r["edited_weights"]
        assert r["save_16bit_model"] == {"returned": [True, True], "same_file": True if rank == 0 else None,
                                         "fast": True}, r["save_16bit_model"]
        assert r["native_through_install"].startswith("CheckpointNotFoundError") and \
            "DeepSpeed's own checkpoint" in r["native_through_install"], r["native_through_install"]
        assert r["overwritten_mid_load"].startswith("CheckpointRemovedError"), r["overwritten_mid_load"]
        assert r["replaced_at_the_end"] == "CheckpointRemovedError", r["replaced_at_the_end"]  # on both ranks
        # (the ZeRO state's checks run before DeepSpeed's module load now: its ReshardError names it)
        assert r["frozen_now"].startswith("ReshardError") and "frozen" in r["frozen_now"] \
            and "l1.weight" in r["frozen_now"], r["frozen_now"]
        assert r["frozen_now_unchanged"] is True
        files = r["engine_reads"]  # every file read once: the model states, this rank's optimizer file
        assert len(files) == len(set(files)) == 2, files


def test_refused_loads_raise_on_every_rank_and_leave_the_engine_unchanged(edges):
    """tests/helpers/deepspeed_engine_worker.py refusals: each load below raises the same typed
    error on both ranks before DeepSpeed's own load runs, and every parameter, master, optimizer
    state, step counter and the lr are as they were before the call."""
    for rank in (0, 1):
        r = _load(edges, "refusals", rank)
        unchanged = {k[:-len(" unchanged")]: v for k, v in r.items() if k.endswith(" unchanged")}
        assert len(unchanged) == 7 and all(d == [] for d in unchanged.values()), (rank, unchanged)
        # An empty or blank `latest` (what a crash in DeepSpeed's in-place write leaves) names no
        # checkpoint: not "nothing saved yet" (a restart from step 0); the remedy says what to do.
        for text in ("''", "' \\n'"):
            got = r[f"latest {text}"]
            assert got.startswith("CheckpointNotFoundError") and "names no checkpoint" in got \
                and "tag=" in got, (rank, text, got)
        # keep_last=1 deleted nothing while `latest` named nothing (t1 may be what it meant)
        assert r["listing after rotation"] == ["latest", "t1", "t2"], r["listing after rotation"]
        # different tags (or options) on the ranks: refused before DeepSpeed's module load
        assert r["tags"].startswith("ConfigError") and "different" in r["tags"], r["tags"]
        assert "/t2 " in r["tags"] and "/t3 " in r["tags"], r["tags"]
        assert r["options"].startswith("ConfigError") and "load_module_strict" in r["options"], r["options"]
        # a precision switch: a typed error naming both precisions (it was a StateDictMismatchError
        # naming files.bf16_zero_pp_rank_0_mp_rank_00_optim_states, after a partial load)
        for case, (saved, now) in (("1-fp32 -> 1-bf16", ("fp32", "bf16")), ("3-bf16 -> 3-fp32", ("bf16", "fp32"))):
            got = r[f"precision {case}"]
            assert got.startswith("ReshardError") and f"saved with precision {saved}" in got \
                and f"engine uses {now}" in got, (case, got)
        assert r["precision weights only"] == "loaded", r["precision weights only"]
        # a flipped byte only rank 1 reads: the same ChecksumMismatchError on both ranks, at once
        # (rank 0 had gone through DeepSpeed's load and waited for rank 1 until the arrival timeout)
        got = r["rank 1 damage"]
        assert got.startswith("ChecksumMismatchError") and "rank(s) [1]" in got, (rank, got)
        assert r["rank 1 damage seconds"] < 30, r["rank 1 damage seconds"]


def test_importing_the_integration_does_not_import_deepspeed():
    """`install` imports deepspeed when first asked for; `import distckpt` and the integration
    package alone never do (a monitoring script or the CLI pays nothing for it)."""
    code = ("import sys, distckpt, distckpt.integrations.deepspeed as d; "
            "assert 'deepspeed' not in sys.modules, 'deepspeed imported'; "
            "d.install; assert 'deepspeed' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "DS_ACCELERATOR": "cpu",
                   "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}, timeout=300)


def test_the_16bit_export_file_is_atomic_typed_and_has_torch_saves_mode(tmp_path):
    """save_16bit_model's file (engine._export_file), in one process: the mode torch.save gives
    (mkstemp's 0600 made it unreadable to a serving user), written through a symlink as torch.save
    writes, and a failed write (EFBIG here) a typed error with nothing left behind (torch.save
    turns it into its own RuntimeError)."""
    script = textwrap.dedent(f"""
        import os, resource, signal, stat, torch
        from distckpt.errors import FileTooLargeError
        from distckpt.integrations.deepspeed.engine import _export_file
        d = {str(tmp_path)!r}
        sd = {{"w": torch.randn(256, 256)}}
        os.umask(0o022)
        _export_file(sd, d + "/ours.bin")
        torch.save(sd, d + "/torch.bin")
        assert stat.S_IMODE(os.stat(d + "/ours.bin").st_mode) == stat.S_IMODE(os.stat(d + "/torch.bin").st_mode)
        assert torch.equal(torch.load(d + "/ours.bin", weights_only=True)["w"], sd["w"])
        os.mkdir(d + "/real")
        os.symlink(d + "/real/target.bin", d + "/link.bin")
        _export_file(sd, d + "/link.bin")
        assert os.path.islink(d + "/link.bin") and os.path.isfile(d + "/real/target.bin")
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        try:
            _export_file(sd, d + "/big.bin")
            raise SystemExit("no error")
        except FileTooLargeError:
            pass
        assert sorted(os.listdir(d)) == ["link.bin", "ours.bin", "real", "torch.bin"], os.listdir(d)
        from distckpt.errors import ConfigError
        for where in ("s3://bucket/model.bin", d + "/real"):  # a URL, a directory: typed, nothing written
            try:
                _export_file(sd, where)
                raise SystemExit(f"no error for {{where}}")
            except ConfigError:
                pass
        assert sorted(os.listdir(d + "/real")) == ["target.bin"]
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
