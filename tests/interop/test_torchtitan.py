"""distckpt as torchtitan's checkpoint manager (distckpt.integrations.torchtitan), against
torchtitan 0.3.0's real objects and its own DCP CheckpointManager side by side; no mocks.

torchtitan's Trainer cannot run here (``import torchtitan.trainer`` needs triton): the training
loop of tests/helpers/torchtitan_worker.py is the Trainer's, reduced to what a checkpoint sees,
with torchtitan's ModelWrapper, OptimizersContainer, LRSchedulersContainer, ParallelAwareDataloader
and a train_state, the model sharded with FSDP2 on 2 gloo ranks.

  * `trained` (2 ranks): train 8 steps, both managers checkpoint every 3 steps (distckpt's in
    "async_with_pinned_mem" mode: staged in the background beside the next forward and backward,
    waited for by maybe_wait_for_staging() before the optimizer step), then every rank SIGKILLs
    itself (no close).
  * resumed at 2 ranks (one more launch) and at 1 process (here, unsharded): through distckpt's
    manager, through torchtitan's, and through distckpt's reading torchtitan's DCP folder (the
    switch mid-run): the next losses are identical, and at 2 ranks equal to the run that went on.
  * in this process (no torch.distributed): build-time ConfigErrors, keep_latest_k rotation,
    load_step, both kinds of checkpoint in one folder, model-only last save in export_dtype,
    initial_load_path, exclude_from_loading, the async modes.
Two launches of 2 ranks (forked from a fork server that imported torch and torchtitan once:
tests/helpers/torchtitan_worker.py, launch); each has its own time limit (LAUNCH_TIMEOUT_S), so
nothing can hang.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("torchtitan.components.checkpointer")

import distckpt  # noqa: E402
from distckpt.errors import CheckpointNotFoundError, ConfigError, StateDictMismatchError  # noqa: E402

from ..helpers import torchtitan_worker as tw  # noqa: E402
from ..helpers.distributed import RankError  # noqa: E402

LAUNCH_TIMEOUT_S = 120  # a launch takes 10-25 s on the 2-core VM (more when it is busy)
ENV = {"OMP_NUM_THREADS": "1", "DISTCKPT_TIMEOUT_S": "60"}
VARIANTS = ["distckpt", "dcp", "distckpt<-dcp"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The killed 2-rank run: its folder (``distckpt/`` and ``dcp/``) and each rank's losses of
    the steps after the last save."""
    out = str(tmp_path_factory.mktemp("torchtitan"))
    with pytest.raises(RankError) as info:
        tw.launch(tw.train_and_die, 2, out, "async_with_pinned_mem", timeout=LAUNCH_TIMEOUT_S, env=ENV)
    # Every rank died of its own SIGKILL after writing its losses: nothing else failed.
    assert all("code -9" in tb for _, tb in info.value.errors.values()), str(info.value)
    reference = [json.load(open(os.path.join(out, f"reference-{r}.json"))) for r in range(2)]
    return out, reference


def test_killed_run_resumes_at_2_ranks_like_torchtitans_dcp_manager(trained):
    out, reference = trained
    # torchtitan's manager rotated to keep_latest_k=2 too; distckpt left no incomplete entry.
    assert sorted(os.listdir(os.path.join(out, "distckpt"))) == ["latest", "step_00000003", "step_00000006"]
    # and once more with rank 1's own listing failing: the ranks load what rank 0 lists
    variants = VARIANTS + ["distckpt, rank 1 cannot list"]
    results = tw.launch(tw.resume, 2, out, variants, timeout=LAUNCH_TIMEOUT_S, env=ENV)
    for rank, per_variant in enumerate(results):
        for which in variants:
            assert per_variant[which]["loaded"] == tw.LAST_SAVED, which
            # bit-identical: the same floats as the run that never stopped, and as torchtitan's
            assert per_variant[which]["losses"] == reference[rank], (rank, which)


def test_killed_run_resumes_at_1_process_like_torchtitans_dcp_manager(trained):
    out, _ = trained
    # One process, no torch.distributed: the FSDP shards of 2 ranks into unsharded tensors.
    results = tw.resume(0, 1, out, VARIANTS)
    first = results["distckpt"]
    assert first["loaded"] == tw.LAST_SAVED
    for which in VARIANTS:
        assert results[which] == first, which


# ---------------------------------------------------------------------------------------------
# In this process, no torch.distributed.


def _mine(folder, objs=None, **fields):
    from distckpt.integrations.torchtitan import DistckptCheckpointManager
    objs = objs or tw.build()
    cfg = DistckptCheckpointManager.Config(enable=True, folder=str(folder), **fields)
    return cfg.build(**tw.manager_kwargs(objs)), objs


def _theirs(folder, objs, **fields):
    from torchtitan.components.checkpointer import CheckpointManager
    cfg = CheckpointManager.Config(enable=True, folder=str(folder), keep_latest_k=0, **fields)
    return cfg.build(**tw.manager_kwargs(objs))


def _weights(objs):
    return {k: v.detach().clone() for k, v in objs["model"].state_dict().items()}


def test_config_is_torchtitans_contract_and_inapplicable_fields_raise_at_build(tmp_path):
    from torchtitan.components.checkpointer import BaseCheckpointManager

    from distckpt.integrations.torchtitan import DistckptCheckpointManager
    Config = DistckptCheckpointManager.Config
    assert issubclass(Config, BaseCheckpointManager.Config)  # what Trainer.Config.checkpoint holds
    mgr, _ = _mine(tmp_path / "ok")
    assert isinstance(mgr, BaseCheckpointManager) and type(mgr) is DistckptCheckpointManager
    assert not Config(enable=False).build(**tw.manager_kwargs(tw.build())).save(3)
    bad_fields = [
        {"last_save_in_hf": True},                                 # HF export: DCP + sd_adapter
        {"initial_load_in_hf": True, "initial_load_path": "/x"},   # HF import
        {"async_mode": "threads"},
        {"keep_latest_k": 1},                                      # torchtitan's own checks, typed
        {"interval": 0},
        {"exclude_from_loading": ["model"]},
        {"incremental": True, "incremental_full_every": 0},
        # Wrong types: bare TypeError, AttributeError or KeyError (at build) before (helper trial).
        {"interval": "5"}, {"interval": None}, {"keep_latest_k": "3"}, {"export_dtype": "int8"},
        {"initial_load_path": 5}, {"load_step": "x"}, {"exclude_from_loading": "dataloader"},
    ]
    for fields in bad_fields:
        with pytest.raises(ConfigError):
            Config(enable=True, folder=str(tmp_path / "c"), **fields)
    with pytest.raises(ConfigError, match="checkpoint.folder"):
        Config(enable=True, folder=None)
    # Known only once the trainer's objects and the folder are: raised by build().
    for fields in [{"exclude_from_loading": ["no_such_state"]}, {"storage_options": {"anon": True}}]:
        with pytest.raises(ConfigError):
            _mine(tmp_path / "c", **fields)
    with pytest.raises(ConfigError):  # chains are local only
        _mine("s3://bucket/run", incremental=True)


def _train(objs, mgrs, steps):
    for _ in range(steps):
        tw.train_step(objs, mgrs)


def test_keep_latest_k_load_step_and_both_formats_in_one_folder(tmp_path):
    mgr, objs = _mine(tmp_path, interval=1, keep_latest_k=2)
    after = {}
    for _ in range(5):
        tw.train_step(objs, [mgr])
        after[objs["train_state"].step] = _weights(objs)
    # A dead save's leftovers and a DCP folder without .metadata are not checkpoints.
    os.makedirs(tmp_path / ".step_00000009.tmp-dead")
    os.makedirs(tmp_path / "step-9")
    assert sorted(mgr.checkpoints()) == [4, 5]
    assert sorted(distckpt.CheckpointManager(str(tmp_path)).steps()) == [4, 5]

    fresh, objs2 = _mine(tmp_path, interval=1, keep_latest_k=2, load_step=4)
    assert fresh.load(step=4) and objs2["train_state"].step == 4
    assert all(torch.equal(v, after[4][k]) for k, v in _weights(objs2).items())
    assert fresh.load(step=-1) and objs2["train_state"].step == 5
    with pytest.raises(CheckpointNotFoundError):  # rotated away
        fresh.load(step=3)

    # torchtitan's manager writes step-6 and step-5 (a switch back and forth): the highest step
    # wins whichever wrote it, and on a tie distckpt's copy is the one loaded.
    theirs = _theirs(tmp_path, objs, interval=1)
    objs["train_state"].step = 6
    theirs.save(6)
    objs["train_state"].step = 5
    with torch.no_grad():
        for p in objs["model"].parameters():
            p.add_(1.0)
    theirs.save(5)
    theirs.close()
    found = fresh.checkpoints()
    assert found[6][1] == "dcp" and found[5][1] == "distckpt"
    assert fresh.load(step=-1) and objs2["train_state"].step == 6
    assert fresh.load(step=5)
    assert all(torch.equal(v, after[5][k]) for k, v in _weights(objs2).items())  # not the +1 copy
    # Rotation counts distckpt's steps only and never deletes torchtitan's folders.
    objs2["train_state"].step = 7
    fresh.save(7)
    assert sorted(fresh.checkpoints().items())[-1] == (7, (fresh.path(7), "distckpt"))
    assert os.path.isdir(tmp_path / "step-6") and sorted(fresh._mgr.steps()) == [5, 7]
    fresh.close()
    mgr.close()
    # A rollback to torchtitan's DCP step-6 (load_step=6): distckpt's step 7 above it is the
    # abandoned branch, replaced by the next save as after a rollback to one of distckpt's own
    # steps, and as torchtitan's manager overwrites it (CheckpointExistsError before, whose remedy
    # named the very load just done).
    before = distckpt.read_manifest(fresh.path(7))["save_id"]
    back, objs3 = _mine(tmp_path, interval=1, keep_latest_k=2, load_step=6)
    assert back.load(step=6) and objs3["train_state"].step == 6
    tw.train_step(objs3, [back])
    assert objs3["train_state"].step == 7 and distckpt.read_manifest(back.path(7))["save_id"] != before
    saved = distckpt.read(back.path(7))
    assert all(torch.equal(v, saved[k]) for k, v in _weights(objs3).items())
    back.close()


def test_last_save_model_only_export_dtype_initial_load_and_exclude(tmp_path):
    mgr, objs = _mine(tmp_path / "run", interval=100, export_dtype="bfloat16")
    _train(objs, [mgr], 3)
    assert mgr.save(4, last_step=True)
    saved = distckpt.read(mgr.path(4))
    assert "optimizer" not in saved and "train_state" not in saved
    assert {v.dtype for v in saved.values() if isinstance(v, torch.Tensor)} == {torch.bfloat16}
    bf16 = _weights(objs)

    # load(-1) of a model-only last save fails, as torchtitan's manager does (a resume would
    # restart every other state); load(step=4) asks for it: the model only (in fp32, from bf16).
    again, objs2 = _mine(tmp_path / "run")
    with pytest.raises(StateDictMismatchError, match="holds the model only") as info:
        again.load()
    assert "load_step=4" in str(info.value) and "optimizer" in info.value.missing
    assert objs2["train_state"].step == 0 and not any(torch.equal(v, bf16[k]) for k, v in _weights(objs2).items())
    assert again.load(step=4) and objs2["train_state"].step == 0
    assert all(torch.equal(v, bf16[k].to(torch.bfloat16).float()) for k, v in _weights(objs2).items())

    # The same from torchtitan's manager's model-only last save (DCP).
    theirs = _theirs(tmp_path / "dcp_run", objs, interval=100, export_dtype="bfloat16")
    assert theirs.save(4, last_step=True)
    theirs.close()
    switched, objs2b = _mine(tmp_path / "dcp_run")
    with pytest.raises(StateDictMismatchError, match="holds the model only"):
        switched.load()
    assert switched.load(step=4) and objs2b["train_state"].step == 0
    assert all(torch.equal(v, bf16[k].to(torch.bfloat16).float()) for k, v in _weights(objs2b).items())

    # keep_latest_k: the last save purges nothing (torchtitan's too), so with keep_latest_k=2 the
    # two newest full-state steps stay resumable beside the export, and the error names the newest.
    kept, objs8 = _mine(tmp_path / "kept", interval=2, keep_latest_k=2)
    _train(objs8, [kept], 6)
    assert kept.save(7, last_step=True) and sorted(kept.checkpoints()) == [4, 6, 7]
    resumed, objs9 = _mine(tmp_path / "kept")
    with pytest.raises(StateDictMismatchError, match="load_step=6 to resume"):
        resumed.load()
    assert resumed.load(step=6) and objs9["train_state"].step == 6

    # initial_load_path: used only while the folder holds no checkpoint; model only by default.
    full, objs3 = _mine(tmp_path / "full", interval=2, last_save_model_only=False)
    _train(objs3, [full], 2)
    init, objs4 = _mine(tmp_path / "empty", initial_load_path=full.path(2))
    assert init.load() and objs4["train_state"].step == 0
    assert all(torch.equal(v, _weights(objs3)[k]) for k, v in _weights(objs4).items())
    init, objs5 = _mine(tmp_path / "empty", initial_load_path=full.path(2), initial_load_model_only=False,
                        exclude_from_loading=["train_state"])
    assert init.load() and objs5["train_state"].step == 0  # excluded
    assert objs5["lr_schedulers"].state_dict() == objs3["lr_schedulers"].state_dict()
    nothing, _ = _mine(tmp_path / "none")
    assert nothing.load() is False  # a fresh start
    wrong, _ = _mine(tmp_path / "none", initial_load_path=str(tmp_path / "no_such_dir"))
    with pytest.raises(ConfigError, match="initial_load_path"):  # torchtitan: a ValueError too
        wrong.load()
    assert isinstance(ConfigError("x"), ValueError)

    # A seed checkpoint (torchtitan's train.py: save(curr_step=0, last_step=True)) loads model only.
    seed, objs6 = _mine(tmp_path / "seed", tw.build(seed=5))
    assert seed.save(0, last_step=True) and sorted(seed.checkpoints()) == [0]
    start, objs7 = _mine(tmp_path / "seed")
    assert start.load() and objs7["train_state"].step == 0
    assert all(torch.equal(v, _weights(objs6)[k]) for k, v in _weights(objs7).items())
    for m in (mgr, again, switched, full, init, nothing, wrong, seed, start, kept, resumed):
        m.close()


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_async_modes_follow_torchtitans_futures(tmp_path, mode, monkeypatch):
    import threading

    import distckpt.save_async as sa
    gate, real = threading.Event(), sa.stage

    def held(*args, **kwargs):  # the copy waits until the test lets it go
        assert gate.wait(60)
        return real(*args, **kwargs)
    monkeypatch.setattr(sa, "stage", held)
    mgr, objs = _mine(tmp_path, interval=2, async_mode=mode)
    gate.set()
    tw.train_step(objs, [mgr])
    assert mgr.save_future is None and mgr.staging_future is None
    gate.clear()
    pinned = mode == "async_with_pinned_mem"
    if not pinned:
        gate.set()  # "async" stages before save() returns
    tw.train_step(objs, [mgr])                     # step 2: an async save
    expected = _weights(objs)
    assert mgr.save_future is not None
    assert (mgr.staging_future is not None) == pinned
    if pinned:
        # save() returned before the copy (torchtitan's use_async_staging): staging_future is
        # resolved only once it ends, and maybe_wait_for_staging() waits for it.
        assert not mgr.staging_future.done() and not mgr.save_future.staged()
        waiter = threading.Thread(target=mgr.maybe_wait_for_staging)
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive(), "maybe_wait_for_staging() returned before the state was staged"
        gate.set()
        waiter.join(60)
        assert not waiter.is_alive() and mgr.save_future.staged()
    mgr.maybe_wait_for_staging()
    assert mgr.staging_future is None
    tw.train_step(objs, [mgr])                     # changes the weights after the snapshot
    mgr.maybe_wait_for_saving()
    assert mgr.save_future is None and mgr.checkpoints() == {2: (mgr.path(2), "distckpt")}
    tw.train_step(objs, [mgr])                     # step 4, left in flight: close() waits for it
    mgr.close()
    assert sorted(mgr.checkpoints()) == [2, 4]
    back, objs2 = _mine(tmp_path)
    assert back.load(step=2) and objs2["train_state"].step == 2
    assert all(torch.equal(v, expected[k]) for k, v in _weights(objs2).items())
    back.close()


class _RunsCode:
    """A pickle that runs code when unpickled: it touches ``self.marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_dataloader_pickle_that_would_run_code_is_refused_before_anything_loads(tmp_path):
    """torchtitan's dataloader keeps pickle.dumps bytes and unpickles them in load_state_dict: a
    crafted checkpoint ran its code there (the load returned True). Now each dp_rank pickle is
    decoded by distckpt.safepickle first: PickleNotAllowedError for a global that is not plain
    data, CheckpointCorruptError for bytes that are no pickle, ReshardError for another
    data-parallel size, each before the model, optimizer or train_state change;
    Config.allow_pickle hands the bytes over unchecked."""
    import pickle

    from distckpt.errors import CheckpointCorruptError, PickleNotAllowedError, ReshardError
    from distckpt.integrations.torchtitan import FORMAT
    mgr, objs = _mine(tmp_path / "run", interval=1)
    tw.train_step(objs, [mgr])
    step = objs["train_state"].step
    mgr.close()
    saved = distckpt.read(mgr.path(step))
    assert isinstance(saved["dataloader"]["dp_rank_0"], bytes) and saved["dataloader"]["world_size"] == 1
    marker = tmp_path / "ran"
    crafted = {"code": {"dp_rank_0": pickle.dumps({"x": _RunsCode(str(marker))})},
               "garbage": {"dp_rank_0": b"not a pickle"}, "world": {"world_size": 3}}
    expect = {"code": (PickleNotAllowedError, "posix.system"), "garbage": (CheckpointCorruptError, "not a readable"),
              "world": (ReshardError, "data-parallel size 3")}
    for name, change in crafted.items():
        folder = tmp_path / name
        sd = {**saved, "dataloader": {**saved["dataloader"], **change}}
        distckpt.CheckpointManager(str(folder)).save(step, sd, metadata={"torchtitan": {
            "format": FORMAT, "step": step, "model_only": False}})
        fresh, objs2 = _mine(folder, interval=1)
        before = _weights(objs2), objs2["train_state"].step
        cls, text = expect[name]
        with pytest.raises(cls, match=text):
            fresh.load()
        assert not marker.exists(), name
        assert objs2["train_state"].step == before[1] == 0, name
        assert all(torch.equal(v, before[0][k]) for k, v in _weights(objs2).items()), name
        fresh.close()
    # a real dataloader state (plain data) loads; allow_pickle hands a crafted one over unchecked
    fresh, objs2 = _mine(tmp_path / "run", interval=1)
    assert fresh.load() and objs2["train_state"].step == step
    fresh.close()
    trusting, _ = _mine(tmp_path / "code", interval=1, allow_pickle=True)
    try:
        trusting.load()  # (torchtitan's dataloader then gets {"x": 0}: what it makes of it is its own)
    except Exception:  # noqa: BLE001
        pass
    assert marker.exists()  # torchtitan's unpickler ran it: what allow_pickle trusts
    trusting.close()


def test_an_earlier_runs_step_is_refused_with_a_remedy_this_manager_offers(tmp_path):
    """A new run saves a step an earlier run left in the folder without loading first: torchtitan's
    DCP manager overwrites it; this manager refuses (the earlier run's step stays, bit-exact) with
    CheckpointExistsError whose remedy names what its Config offers, not overwrite=True (which
    torchtitan's Config has no field for)."""
    from distckpt.errors import CheckpointExistsError
    first, objs = _mine(tmp_path / "f", interval=1)
    tw.train_step(objs, [])
    first.save(1)
    first.close()
    before = distckpt.read(tmp_path / "f" / "step_00000001")
    second, objs2 = _mine(tmp_path / "f", tw.build(seed=1), interval=1)
    tw.train_step(objs2, [])
    with pytest.raises(CheckpointExistsError) as info:
        second.save(1)
    second.close()
    assert "overwrite=True" not in info.value.remedy and "load" in info.value.remedy, info.value.remedy
    after = distckpt.read(tmp_path / "f" / "step_00000001")
    assert before.keys() == after.keys()
    tensors = [k for k, v in before.items() if isinstance(v, torch.Tensor)]
    assert tensors and all(torch.equal(before[k], after[k]) for k in tensors)
