"""Reshardable DeepSpeed ZeRO checkpoints (distckpt.integrations.deepspeed.save/load), real DeepSpeed.

One save launch (2 ranks, torchrun, gloo, DS_ACCELERATOR=cpu) trains and saves nine engines
(stage 0 fp32 and bf16, stage 1 fp32, stage 2 bf16, stage 3 bf16 with every parameter
partitioned, stage 3 fp32 with the small parameters persistent; three of them with a frozen
weight; ZeRO-Offload to the CPU at stages 2 and 3, once with bf16 masters and Adam states); three
load launches restore all of them at 1, 2 and 3 ranks and compare every master weight and Adam
state (exp_avg, exp_avg_sq, step), gathered with DeepSpeed's own API, with the saved ones; one
more launch checks the typed error cases. Worker: deepspeed_zero_worker.py.
pytest-timeout's limit covers a test's fixture set-up too: the tests that need only the save launch
come first, so that each test pays for one launch at most, and every launch has its own, shorter,
time limit (LAUNCH_TIMEOUT_S).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import distckpt
from distckpt.errors import ReshardError
from distckpt.flatten import LocalPieces, flat_range_boxes

from ..helpers.distributed import kill_tree

pytest.importorskip("deepspeed")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, "tests", "helpers", "deepspeed_zero_worker.py")
# "+persist": ZeRO-3 keeps parameters under 1000 elements whole (the biases), the rest partitioned;
# "+frozen": the first (largest) weight has requires_grad=False
# "+offload": ZeRO-Offload to the CPU (DeepSpeedCPUAdam; at stage 3 the parameters too);
# "+bf16master": bf16 master weights and bf16 Adam states (DeepSpeed's options for offload)
CONFIGS = ["0:fp32+frozen", "0:bf16", "1:fp32", "2:bf16+frozen", "3:bf16+frozen", "3:fp32+persist",
           "2:bf16+offload", "3:bf16+offload", "3:bf16+offload+bf16master"]
PARTITIONED = ["1:fp32", "2:bf16+frozen", "3:bf16+frozen", "3:fp32+persist", "2:bf16+offload", "3:bf16+offload"]
# The longest launch takes about 2 minutes on an idle 2-core machine; 3x that still passes, and the
# limit leaves room under pytest's 600 s for the test's own checks.
LAUNCH_TIMEOUT_S = 480
# A first build of fused Adam in a venv: 41 s on an idle 2-core machine, 7.5 minutes under a load
# of 8 (two compiler processes at a third of a core each); CPU Adam's build takes as long (41 s
# idle). The test does nothing else and has a pytest limit of its own, above this one, which
# leaves both builds at that load 2.5 minutes to spare each.
BUILD_TIMEOUT_S = 2400


def _torchrun(n: int, *args: str, timeout: int = LAUNCH_TIMEOUT_S) -> None:
    """Run the worker with ``args`` on ``n`` ranks. Fails the test when it fails, when it runs past
    ``timeout`` (torchrun and every process under it killed) or when DeepSpeed built or loaded its shm op (the
    worker skips it: see _without_shm_op)."""
    env = dict(os.environ)
    env.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO,
                # small checksum blocks, so that a rank's share of this small model is fewer blocks
                # than the whole file (reads are widened to whole checksum blocks)
                "DISTCKPT_CHECKSUM_BLOCK": "64K"})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", WORKER, *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        output, _ = proc.communicate()
        tail = "\n".join(output.splitlines()[-60:])
        pytest.fail(f"torchrun {' '.join(args[:1])} x{n} did not finish within {timeout} s (killed):\n{tail}")
    tail = "\n".join(output.splitlines()[-60:])
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {' '.join(args[:1])} x{n} failed ({proc.returncode}):\n{tail}")
    assert "deepspeed_shm_comm" not in output, f"torchrun {' '.join(args[:1])} x{n} built DeepSpeed's shm op:\n{tail}"


@pytest.mark.timeout(BUILD_TIMEOUT_S + 300)
def test_deepspeed_builds_its_ops_inside_the_venv():
    """DeepSpeed's CPU fused Adam (the workers' optimizer) and its CPU Adam (ZeRO-Offload's),
    JIT-built (or found built) in a process of its own, land in this venv's torch_extensions
    (tests/conftest.py), not in the user-wide cache that other venvs rebuild with their own flags.
    First in the file: a first build takes a minute or more, paid here and not inside a launch's
    time limit."""
    code = ("from deepspeed.accelerator import get_accelerator; "
            "get_accelerator().create_op_builder('FusedAdamBuilder').load(); "
            "get_accelerator().create_op_builder('CPUAdamBuilder').load()")
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "DS_ACCELERATOR": "cpu"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # the compiler too
        output, _ = proc.communicate()
        pytest.fail(f"building DeepSpeed's fused_adam op took over {BUILD_TIMEOUT_S} s (killed):\n{output[-4000:]}")
    assert proc.returncode == 0, output[-4000:]
    root = os.path.join(sys.prefix, "torch_extensions")
    for op in ("fused_adam", "cpu_adam"):
        assert glob.glob(os.path.join(root, op, "*.so")), f"no {op} build under {root}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dszero"))
    for cfg in CONFIGS:
        stage, dtype = cfg.split(":")
        os.makedirs(os.path.join(root, f"s{stage}{dtype}", "out"))
    _torchrun(2, "save", root, *CONFIGS)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _dir(root: str, cfg: str) -> str:
    stage, dtype = cfg.split(":")
    return os.path.join(root, f"s{stage}{dtype}")


def _docs(root: str, cfg: str, world: int) -> list[dict]:
    files = sorted(glob.glob(os.path.join(_dir(root, cfg), "out", f"load_{world}_rank*.json")))
    assert len(files) == world, files
    return [json.load(open(f)) for f in files]


def test_consolidated_read_equals_zero_to_fp32(saved):
    """distckpt.read(path, keys=["model"]) on one process == DeepSpeed's zero_to_fp32 of its own
    checkpoint of the same engine at the same moment."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from ..helpers.deepspeed_zero_worker import Net
    for cfg in PARTITIONED:
        ours = distckpt.read(os.path.join(_dir(saved, cfg), "ckpt"), keys=["model"])["model"]
        theirs = get_fp32_state_dict_from_zero_checkpoint(os.path.join(_dir(saved, cfg), "out", "ds"), tag="t")
        assert sorted(ours) == sorted(theirs), cfg
        for k, v in theirs.items():
            assert ours[k].dtype == v.dtype and torch.equal(ours[k], v), (cfg, k)
        # and it loads strictly into the model (whose non-persistent buffers it leaves out)
        model = Net()
        assert any(model.rotary._non_persistent_buffers_set), "the model has no non-persistent buffer"
        model.load_state_dict(ours, strict=True)
    ref = torch.load(os.path.join(_dir(saved, "0:bf16"), "out", "ref.pt"), weights_only=True)["ref"]
    ours = distckpt.read(os.path.join(_dir(saved, "0:bf16"), "ckpt"), keys=["model"])["model"]
    for k, v in ref.items():
        assert torch.equal(ours[k], v["fp32"]), k


def test_inspect_shows_deepspeed_line(saved):
    from distckpt.cli import main
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["inspect", os.path.join(_dir(saved, "3:bf16+frozen"), "ckpt")])
    assert rc in (0, None)
    line = [ln for ln in buf.getvalue().splitlines() if ln.startswith("deepspeed")]
    assert line and "ZeRO stage 3" in line[0] and "data-parallel size 2" in line[0] and "bfloat16" in line[0], buf.getvalue()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_reshard_load_is_exact(saved, world):
    """Saved at 2 ranks, loaded at 1, 2, 3: fp32 masters and Adam states identical, the module
    weights rebuilt from them, counters and client state back, training continues (at 2 ranks:
    the very losses of the run that never stopped). A partitioned rank reads less than the
    checkpoint when resharding."""
    _torchrun(world, "load", saved, *CONFIGS)
    for cfg in CONFIGS:
        docs = _docs(saved, cfg, world)
        for d in docs:
            assert d["bad"] == [], (cfg, world, d["bad"][:10])
            # 6 parameters x (fp32, exp_avg, exp_avg_sq, step), or 5 of them and a frozen one
            assert d["compared"] == (4 * 5 + 1 if "frozen" in cfg else 4 * 6), cfg
            assert d["module_mismatch"] == [], (cfg, d["module_mismatch"])
            assert d["client"] == {"epoch": 7, "note": "x"}
            assert d["saved_dp"] == 2 and d["global_steps"] == 5 and d["finite"]
            if world == 2:
                assert d["cont"] == d["ref_cont"], (cfg, d["rank"])
        total = docs[0]["ckpt_bytes"]
        read = [d["bytes_read"] for d in docs]
        print(f"{cfg} at {world} rank(s): bytes read per rank {read} of {total}")
        if cfg in PARTITIONED and world > 1:
            # each rank reads about its 1/world share (whole checksum blocks), never the whole
            assert max(read) < 0.75 * total, (cfg, world, read, total)
            assert sum(read) < 1.3 * total
        if cfg.startswith("0:"):  # replicated: every rank needs every element
            assert all(r >= docs[0]["ckpt_bytes"] * 0.9 for r in read)


def test_reshard_errors_are_typed(saved):
    """Another parameter shape or set, other optimizer param groups, another ZeRO stage, another
    optimizer, Adam for AdamW, bf16 masters for fp32 ones (rounding), a checkpoint that is not a DeepSpeed
    one: ReshardError on every rank, before the engine is touched; partial offload is an
    UnsupportedValueError. And what does load: stage 1 -> 2, stage 1 -> 3 with
    allow_stage_change, a client torch.optim.AdamW, a rollback into engines that trained on (stage
    1 and 3: state filled in place), ZeRO-Offload turned on and off, fp32 masters for bf16 ones.
    Damaged or crafted metadata: ManifestCorruptError, the engine untouched."""
    out = os.path.join(_dir(saved, "1:fp32"), "out")
    distckpt.save({"x": torch.ones(3)}, os.path.join(out, "plain"), no_dist=True)
    cases = ["shape", "params", "groups", "stage", "optimizer", "not_deepspeed"]
    out2 = os.path.join(saved, "s2fp32", "out")
    os.makedirs(out2)
    _torchrun(2, "error:" + ",".join(cases + ["stage2", "stage3_allowed", "rollback"]), saved, "1:fp32",
              "2:fp32:client_adamw,client_rank,client_one_rank", "3:bf16+frozen:rollback", "1:fp32:offload_on",
              "2:bf16+offload:offload_off,adam_l2,hostile,offloaded_states,install_refused,sched_class,rollback_prestep,tied",
              "3:bf16+offload:offload_off,partial,master_bf16",
              "3:bf16+offload+bf16master:master_fp32")
    expect = {"shape": "changed shape", "params": "not in the checkpoint", "stage": "stage 1, loading at stage 3",
              "optimizer": "saved optimizer FusedAdam, now SGD", "not_deepspeed": "not a distckpt DeepSpeed",
              "groups": "saved 1 optimizer param group(s), now 2"}
    for rank in (0, 1):
        # a client torch.optim.AdamW (0-d tensor step) round-trips exactly
        assert json.load(open(os.path.join(out2, f"err_client_adamw_rank{rank}.json")))["same"]
        # client_state differing per rank: typed, and the remedy it gives works (rank 0's kept)
        cr = json.load(open(os.path.join(out2, f"err_client_rank_rank{rank}.json")))
        assert cr["raised"]["class"] == "StateDictMismatchError" and "client.rank" in cr["raised"]["message"], cr
        assert "replicated='rank0'" in cr["raised"]["remedy"], cr
        # rank 0's kept; an OrderedDict comes back as one (it came back a dict)
        # an nn.Parameter too, and one object under two keys (they came back as two plain tensors)
        assert cr["kept"] == {"types": ["OrderedDict", ["b", "a"]], "rank": 0, "same": 1, "odd": True,
                              "param": ["Parameter", True, True], "empty": ["dict", "OrderedDict"]}, cr
        # a value only rank 1 cannot store: every rank raises it at once, nothing is written
        one = json.load(open(os.path.join(out2, f"err_client_one_rank_rank{rank}.json")))
        assert one["raised"]["class"] == "UnsupportedValueError" and "client.d" in one["raised"]["message"], one
        assert one["seconds"] < 30 and one["written"] is False, one
        # stage 1 -> 2 loads (one layout); stage 1 -> 3 when asked for; both exact
        for case in ("stage2", "stage3_allowed", "rollback"):
            assert json.load(open(os.path.join(out, f"err_{case}_rank{rank}.json")))["same"], case
        # an engine that trained on, loading the older checkpoint: state filled in place, exact
        assert json.load(open(os.path.join(_dir(saved, "3:bf16+frozen"), "out", f"err_rollback_rank{rank}.json")))["same"]
        # ZeRO-Offload turned on (FusedAdam -> DeepSpeedCPUAdam) and off again; bf16 masters and
        # Adam states onto fp32 ones (widened); a rollback to a checkpoint saved before the first
        # step (no optimizer state) into an engine that trained; dds.consolidated of a model with
        # a tied parameter, equal to zero_to_fp32 (both names, one tensor): exact
        for cfg, case in (("1:fp32", "offload_on"), ("2:bf16+offload", "offload_off"), ("3:bf16+offload", "offload_off"),
                          ("3:bf16+offload+bf16master", "master_fp32"), ("2:bf16+offload", "rollback_prestep"),
                          ("2:bf16+offload", "tied")):
            assert json.load(open(os.path.join(_dir(saved, cfg), "out", f"err_{case}_rank{rank}.json")))["same"], cfg
        # what cannot load exactly, or cannot be described, is typed and leaves the engine as it was
        for cfg, case, cls, text in (
                ("2:bf16+offload", "adam_l2", "ReshardError", "saved with AdamW (adam_w_mode=True)"),
                ("3:bf16+offload", "master_bf16", "ReshardError", "saved master weights in float32, this engine's are bfloat16"),
                ("3:bf16+offload", "partial", "UnsupportedValueError", "partial optimizer offload (ratio 0.5"),
                ("2:bf16+offload", "sched_class", "ReshardError", "lr scheduler WarmupLR, this engine's is WarmupCosineLR")):
            d = json.load(open(os.path.join(_dir(saved, cfg), "out", f"err_{case}_rank{rank}.json")))
            assert d["raised"] == cls and text in d["message"] and d["untouched"], (case, d)
        # a load into an engine whose states offload_states() moved away: typed, nothing changed;
        # after reload_states() exact, and no offload scratch buffer is saved as Adam state
        # (stage 2: DeepSpeed 0.19.8's offload_states() refuses ZeRO-3 with offloaded parameters, and
        # fails on this model's frozen weight at ZeRO-3 without them)
        d = json.load(open(os.path.join(_dir(saved, "2:bf16+offload"), "out", f"err_offloaded_states_rank{rank}.json")))
        assert d["raised"]["class"] == "UnsupportedValueError" and "reload_states" in d["raised"]["message"], d
        assert d["untouched"] and d["same"] and d["keys"] == ["exp_avg", "exp_avg_sq", "step"], d
        # install(): a refused load leaves the module, step counters and scheduler as they were
        d = json.load(open(os.path.join(_dir(saved, "2:bf16+offload"), "out", f"err_install_refused_rank{rank}.json")))
        assert d["raised"]["class"] == "ReshardError" and "adam_w_mode" in d["raised"]["message"] and d["untouched"], d
        # damaged or crafted metadata: typed, on every rank, the engine exactly as it was (it was
        # an AttributeError, KeyError or ValueError midway, or a load that set the step counter to
        # a string, the lr to "abc" and the loss scale to "big")
        hostile = json.load(open(os.path.join(_dir(saved, "2:bf16+offload"), "out", f"err_hostile_rank{rank}.json")))
        assert len(hostile) == 17
        for name, d in hostile.items():
            assert d["raised"] and d["raised"].startswith("distckpt.errors.ManifestCorruptError"), (name, d)
            assert d["untouched"], (name, d)
    for case in cases:
        for rank in (0, 1):
            d = json.load(open(os.path.join(out, f"err_{case}_rank{rank}.json")))
            assert d["raised"] == "ReshardError", (case, d)
            assert expect[case] in d["message"], (case, d["message"])
            assert d["untouched"], case


# ------------------------------------------------------------------------------------------------
# The core support: flat ranges of a global tensor as boxes (no DeepSpeed needed)


def test_flat_range_boxes_cover_exactly_in_order():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.given(st.lists(st.integers(1, 5), min_size=0, max_size=4), st.data())
    @hypothesis.settings(max_examples=150, deadline=None)
    def check(shape, data):
        n = 1
        for d in shape:
            n *= d
        a = data.draw(st.integers(0, n))
        b = data.draw(st.integers(a, n))
        full = torch.arange(n).view(shape) if shape else torch.tensor(0)
        got = []
        for off, sz in flat_range_boxes(tuple(shape), a, b):
            assert len(off) == len(sz) == len(shape)
            view = full
            for dim, (o, s) in enumerate(zip(off, sz)):
                view = view.narrow(dim, o, s)
            got += view.reshape(-1).tolist()
        assert got == list(range(a, b))
        assert len(flat_range_boxes(tuple(shape), a, b)) <= max(1, 2 * len(shape) - 1)

    check()


def test_local_pieces_reshard_single_process(tmp_path):
    """Pieces of flat ranges saved from one process, loaded as other ranges: exact, in place into
    the flat buffers, reading only what the new ranges need."""
    torch.manual_seed(0)
    full = torch.randn(300, 77)
    flat = full.reshape(-1)
    cut = 10_001
    a, b = flat[:cut].clone(), flat[cut:].clone()
    sd = {"w": LocalPieces.from_flat(full.shape, torch.float32, [(0, a), (cut, b)])}
    distckpt.save(sd, tmp_path / "c", no_dist=True)
    assert torch.equal(distckpt.read(tmp_path / "c")["w"], full)
    lo, hi = 5_000, 9_000
    buf = torch.zeros(hi - lo)
    res = distckpt.load({"w": LocalPieces.from_flat(full.shape, torch.float32, [(lo, buf)])}, tmp_path / "c",
                        no_dist=True)
    assert torch.equal(buf, flat[lo:hi])
    assert res.bytes_read < full.numel() * 4


def test_local_pieces_must_tile(tmp_path):
    """Pieces that leave a hole are refused at save (the checkpoint would lose elements)."""
    t = torch.randn(100)
    sd = {"w": LocalPieces.from_flat((100,), torch.float32, [(0, t[:40]), (50, t[50:])])}
    with pytest.raises(distckpt.DistCkptError):
        distckpt.save(sd, tmp_path / "c", no_dist=True)
    assert not os.path.exists(tmp_path / "c")


def test_reshard_error_is_exported():
    from distckpt.integrations import deepspeed as dds
    assert callable(dds.save) and callable(dds.load)
    assert issubclass(ReshardError, distckpt.DistCkptError)


def test_offload_scratch_buffers_are_not_optimizer_state():
    """DeepSpeed's offload_states() keeps "<key>_offload_buffer" host copies in the Adam state for
    good (ZeRO-3): they were saved as state keys (the checkpoint 1.7x larger, and refused by an
    engine without them). A key of that name with no base key is state like any other."""
    from distckpt.integrations.deepspeed import zero
    master = torch.zeros(4)
    owner = zero._Owner(0, master, master, ["w"], [])
    lay = zero._Layout(3, "zero3", 0, 1, None, [owner], {"w": (4,)}, False, torch.float32, None)
    state = {"exp_avg": torch.zeros(4), "exp_avg_offload_buffer": torch.zeros(4), "step": 3,
             "momentum_offload_buffer": torch.zeros(4)}
    assert zero._flat_keys(lay, state, owner) == (["exp_avg", "momentum_offload_buffer"], ["step"])
