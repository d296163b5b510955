"""distckpt as PyTorch Lightning's CheckpointIO (distckpt.integrations.lightning), with the real
lightning 2.6.6 on CPU; no mocks.

One torchrun launch (tests/helpers/lightning_worker.py, 2 ranks, strategy "ddp", gloo) trains a
reference run for 4 epochs, then for each way of saving (the plugin; Lightning's AsyncCheckpointIO
around it; the plugin's own async_save) 2 epochs that checkpoint through it, then a new Trainer,
model and plugin fit to 4 epochs with ckpt_path="last": weights, optimizer and lr scheduler state of
every rank bit-exact equal to the reference. The other tests drive the plugin in this process (no
Trainer: ddp inside pytest's process is not possible): exact round trip, typed errors, rotation,
removal, and errors of background saves.
"""

from __future__ import annotations

import collections
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from ..helpers.distributed import free_port, kill_tree

if importlib.util.find_spec("lightning") is None:
    pytest.skip("lightning is not installed (pip install lightning==2.6.6)", allow_module_level=True)

import distckpt  # noqa: E402
from distckpt.errors import (CheckpointIncompleteError, CheckpointNotFoundError,  # noqa: E402
                             ChecksumMismatchError, ConfigError, DataFileTruncatedError, PickleNotAllowedError,
                             StorageError, UnsupportedValueError)
from distckpt.integrations.lightning import DistCkptCheckpointIO  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, "tests", "helpers", "lightning_worker.py")
MODES = ("sync", "wrapped", "async")
# The launch takes about 30 s on an idle 2-core machine (most of it importing Lightning twice at
# once); the limit leaves room for a loaded one and still stops a hang.
LAUNCH_TIMEOUT_S = 150


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("lightning"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DISTCKPT_TIMEOUT_S": "60",
           "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), WORKER, out, "first", "resume"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        output, _ = proc.communicate()
        pytest.fail(f"the torchrun launch did not finish within {LAUNCH_TIMEOUT_S} s (killed):\n{output[-6000:]}")
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{output[-6000:]}"
    return out


def _equal(a, b, where: str = "") -> None:
    """Same types, same keys in the same order, tensors with equal dtype, shape and bytes."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for key in a:
            _equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _final(out: str, name: str, rank: int) -> dict:
    return torch.load(os.path.join(out, f"{name}_rank{rank}.pt"), weights_only=True)


def _is_checkpoint(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "MANIFEST"))


# ---------------------------------------------------------------------------------------------
# Trainer.fit on 2 ranks (ddp) and resume with ckpt_path="last".


@pytest.mark.slow  # the torchrun launch: 15-25 s
@pytest.mark.parametrize("mode", MODES)
def test_ddp_fit_resumed_from_last_is_bit_exact(fitted, mode):
    for rank in (0, 1):
        reference = _final(fitted, "reference", rank)
        first, resumed = _final(fitted, f"first_{mode}", rank), _final(fitted, f"resumed_{mode}", rank)
        assert first["global_step"] == 8 and reference["global_step"] == resumed["global_step"] == 16
        # The resumed model started from other weights: equal only if the checkpoint was loaded.
        _equal(reference, resumed, f"{mode} rank {rank}")
    ckdir = os.path.join(fitted, mode)
    assert _is_checkpoint(os.path.join(ckdir, "last.ckpt"))  # a committed distckpt directory, no torch file
    names = sorted(n for n in os.listdir(ckdir) if not n.startswith("."))
    if mode == "sync":
        # keep_last=2 with save_top_k=-1 (ModelCheckpoint deletes nothing): last.ckpt + the newest epoch.
        assert names == ["epoch=3-step=16.ckpt", "last.ckpt"]
    else:
        assert names == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt",
                         "epoch=3-step=16.ckpt", "last.ckpt"]
    assert all(_is_checkpoint(os.path.join(ckdir, n)) for n in names)


@pytest.mark.slow  # needs the launch
def test_checkpoint_reads_back_as_lightning_wrote_it(fitted):
    ck = DistCkptCheckpointIO().load_checkpoint(os.path.join(fitted, "sync", "epoch=3-step=16.ckpt"))
    assert ck["epoch"] == 3 and ck["global_step"] == 16 and ck["hyper_parameters"] == {"lr": 0.01}
    assert type(ck["state_dict"]) is collections.OrderedDict and "" in ck["state_dict"]._metadata
    assert ck["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.999)  # a tuple again
    assert ck["lr_schedulers"][0]["step_size"] == 3
    assert set(ck["loops"]) >= {"fit_loop", "validate_loop"}
    assert all(t.device.type == "cpu" for t in ck["state_dict"].values())


# ---------------------------------------------------------------------------------------------
# In this process: exactness and typed errors.


def _lightning_like() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    return {"epoch": 1, "global_step": 7, "pytorch-lightning_version": "2.6.6",
            "state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "lr_schedulers": [],
            "loops": {"fit_loop": {"state_dict": {}, "epoch_loop.state_dict": {"_batches_that_stepped": 7}}},
            "callbacks": {"ModelCheckpoint{'monitor': 'loss'}": {
                "best_model_score": torch.tensor(0.25), "best_k_models": {"/ck/epoch=0.ckpt": torch.tensor(0.25)},
                "kth_value": torch.tensor(float("inf")), "dirpath": "/ck", "last_model_path": ""}},
            "hyper_parameters": {"lr": 1e-3, "dims": (3, 4), "tags": {"a", "b"}, "big": 1 << 70, "none": None},
            "empty": {}, "scalar": torch.tensor(3, dtype=torch.int64), "bf16": torch.ones(2, dtype=torch.bfloat16)}


def test_round_trip_is_exact_and_leaves_no_torch_file(tmp_path):
    io = DistCkptCheckpointIO()
    ck = _lightning_like()
    path = str(tmp_path / "run" / "epoch=1-step=7.ckpt")  # the parent is created, as torch IO does
    io.save_checkpoint(ck, path)
    io.save_checkpoint(ck, path)  # Lightning rewrites a name (last.ckpt): replaced atomically
    assert _is_checkpoint(path)
    back = io.load_checkpoint(path)
    _equal(ck, back)
    assert back["state_dict"]._metadata == ck["state_dict"]._metadata  # BatchNorm's version 2 kept
    assert io.load_checkpoint(path, map_location="cpu")["scalar"].device.type == "cpu"
    with pytest.raises(ConfigError):
        io.load_checkpoint(path, map_location={"cuda:0": "cpu"})
    if not torch.cuda.is_available():   # a bare AssertionError from torch before (an outside trial)
        with pytest.raises(ConfigError, match="no CUDA device"):
            io.load_checkpoint(path, map_location="cuda")


def test_unsupported_values_are_named_and_pickle_is_opt_in(tmp_path):
    path = str(tmp_path / "a.ckpt")
    ck = {"state_dict": {"w": torch.ones(2)}, "hyper_parameters_type": collections.Counter}  # omegaconf's case
    with pytest.raises(UnsupportedValueError) as err:
        DistCkptCheckpointIO().save_checkpoint(ck, path)
    assert err.value.key == "hyper_parameters_type" and not os.path.exists(path)
    # Containers that would come back as another type: refused even with allow_pickle.
    for bad, key in [({"cb": collections.defaultdict(lambda: 0)}, "cb"),  # a factory that is code
                     ({"m": torch.nn.Linear(1, 1)}, "m")]:  # state_dict()/load_state_dict(): not a dict
        with pytest.raises(UnsupportedValueError) as err:
            DistCkptCheckpointIO(allow_pickle=True).save_checkpoint(bad, path)
        assert err.value.key == key and not os.path.exists(path)
    DistCkptCheckpointIO(allow_pickle=True).save_checkpoint(ck, path)
    with pytest.raises(PickleNotAllowedError):  # never unpickled unless asked
        DistCkptCheckpointIO().load_checkpoint(path)
    with pytest.raises(PickleNotAllowedError):  # weights_only=True refuses it even then
        DistCkptCheckpointIO(allow_pickle=True).load_checkpoint(path, weights_only=True)
    assert DistCkptCheckpointIO(allow_pickle=True).load_checkpoint(path)["hyper_parameters_type"] is collections.Counter


def test_a_stock_multisteplr_and_builtin_defaultdicts_come_back_with_their_types(tmp_path):
    """torch's MultiStepLR keeps its milestones in a Counter: Lightning's checkpoint of any job
    using it held one, which this plugin refused; it comes back as the Counter (int keys), and a
    defaultdict of a builtin type with its factory, as torch.save gives them back."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4], gamma=0.5)
    ck = {"state_dict": {"w": torch.ones(2)}, "lr_schedulers": [sched.state_dict()],
          "callbacks": {"Tally": {"seen": collections.defaultdict(int, {"a": 2})}}}
    path = str(tmp_path / "m.ckpt")
    DistCkptCheckpointIO().save_checkpoint(ck, path)
    back = DistCkptCheckpointIO().load_checkpoint(path)
    milestones = back["lr_schedulers"][0]["milestones"]
    assert type(milestones) is collections.Counter and milestones == collections.Counter({2: 1, 4: 1})
    seen = back["callbacks"]["Tally"]["seen"]
    assert type(seen) is collections.defaultdict and seen.default_factory is int and seen["new"] == 0
    fresh = torch.optim.lr_scheduler.MultiStepLR(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1),
                                                 milestones=[9])
    fresh.load_state_dict(back["lr_schedulers"][0])
    assert fresh.milestones == sched.milestones


def _sharing(ck: dict) -> tuple:
    """What torch.save keeps of a checkpoint's tensors besides their values: types, requires_grad,
    which keys are one object, which share memory with which."""
    flat = {"p": ck["p"], "q": ck["extra"][0], "a": ck["a"], "b": ck["b"], "tied1": ck["state_dict"]["enc.weight"],
            "tied2": ck["state_dict"]["dec.weight"], "rg": ck["rg"]}
    kinds = {k: (type(t).__name__, t.requires_grad) for k, t in flat.items()}
    same = {(x, y) for x in flat for y in flat if x < y and flat[x] is flat[y]}
    shared = {(x, y) for x in flat for y in flat if x < y and flat[x].data_ptr() == flat[y].data_ptr()}
    return kinds, same, shared


def test_parameters_and_shared_tensors_come_back_as_torch_checkpoint_io_gives_them(tmp_path, caplog):
    """nn.Parameter came back a plain tensor (requires_grad False) and one tensor under two keys
    (or tied weights: two tensors over one memory) as two copies; TorchCheckpointIO, in the same
    run, is the reference. A partial view is its own copy, logged by name."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    w = torch.randn(3, 2)
    w[0, 0] = float("nan")  # a diverged run's tied weights: NaN != NaN must not fail the load
    x = torch.arange(4.0)
    p = torch.nn.Parameter(torch.ones(2))
    ck = {"p": p, "extra": [p, torch.nn.Parameter(torch.zeros(1), requires_grad=False)], "a": x, "b": x,
          "view": x[1:], "state_dict": {"enc.weight": w.detach(), "dec.weight": w.detach()},
          "empty": torch.nn.Parameter(torch.zeros(0)), "rg": torch.ones(2, requires_grad=True)}
    torch_io = TorchCheckpointIO()
    torch_io.save_checkpoint(ck, str(tmp_path / "torch.ckpt"))
    want = torch_io.load_checkpoint(str(tmp_path / "torch.ckpt"), weights_only=False)
    io = DistCkptCheckpointIO()
    with caplog.at_level("WARNING", logger="distckpt"):
        io.save_checkpoint(ck, str(tmp_path / "d.ckpt"))
        io.save_checkpoint(ck, str(tmp_path / "d2.ckpt"))  # the next epoch: logged once, not at every save
    assert caplog.text.count("view shares memory with a but not element for element") == 1, caplog.text
    got = DistCkptCheckpointIO().load_checkpoint(str(tmp_path / "d.ckpt"))
    assert _sharing(got) == _sharing(want), (_sharing(got), _sharing(want))
    assert _sharing(want)[1] == {("a", "b"), ("p", "q")} and ("tied1", "tied2") in _sharing(want)[2]
    for key in ("a", "view"):
        assert torch.equal(got[key], ck[key])
    assert torch.equal(got["state_dict"]["dec.weight"].nan_to_num(), w.nan_to_num())
    assert got["extra"][1].requires_grad is False and type(got["empty"]) is torch.nn.Parameter
    for odd in (torch.ones(2).to_sparse(), torch.ones(2, 2).to_sparse_csr(),
                torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)):
        with pytest.raises(UnsupportedValueError):  # flatten's typed refusal, not torch's error
            DistCkptCheckpointIO().save_checkpoint({"state_dict": {"x": odd}}, str(tmp_path / "odd.ckpt"))


def test_load_from_checkpoint_reads_this_plugins_checkpoints_as_lightning_reads_its_own(tmp_path):
    """LightningModule.load_from_checkpoint reads with torch.load and never asks the CheckpointIO
    (IsADirectoryError on this plugin's directory); distckpt's load_from_checkpoint follows
    Lightning's steps. Reference: Lightning's own classmethod on TorchCheckpointIO's file, from the
    same fit, in the same run (hyper-parameters, a kwarg override, the weights)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from distckpt.integrations.lightning import load_from_checkpoint

    class Tiny(pl.LightningModule):
        def __init__(self, width: int = 3, lr: float = 0.1):
            super().__init__()
            self.save_hyperparameters()
            self.layer = torch.nn.Linear(width, 1)

        def training_step(self, batch, _):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 5)), batch_size=4)
    paths = {}
    for name, plugin in (("torch", TorchCheckpointIO()), ("distckpt", DistCkptCheckpointIO())):
        torch.manual_seed(0)
        trainer = pl.Trainer(max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                             accelerator="cpu", plugins=[plugin],
                             callbacks=[ModelCheckpoint(dirpath=str(tmp_path / name), save_last=True)])
        trainer.fit(Tiny(width=5, lr=0.05), data)
        paths[name] = str(tmp_path / name / "last.ckpt")
    assert _is_checkpoint(paths["distckpt"])
    with pytest.raises(IsADirectoryError):  # Lightning's classmethod: why the function exists
        Tiny.load_from_checkpoint(paths["distckpt"])
    want = Tiny.load_from_checkpoint(paths["torch"], lr=0.5)
    got = load_from_checkpoint(Tiny, paths["distckpt"], lr=0.5)
    assert type(got) is Tiny and dict(got.hparams) == dict(want.hparams) == {"width": 5, "lr": 0.5}
    _equal(dict(want.state_dict()), dict(got.state_dict()))
    with pytest.raises(ConfigError):
        load_from_checkpoint(Tiny, paths["distckpt"], hparams_file=str(tmp_path / "h.json"))
    assert dict(load_from_checkpoint(Tiny, paths["distckpt"], weights_only=True).hparams) == {"width": 5, "lr": 0.05}
    with pytest.raises(ConfigError, match="not a LightningModule"):  # before anything is read
        load_from_checkpoint(torch.nn.Linear, paths["distckpt"])
    # crafted values Lightning's steps index or compare: typed (a str's .update, packaging's
    # InvalidVersion before)
    from distckpt.errors import CheckpointCorruptError
    tree, user = distckpt.read(paths["distckpt"]), distckpt.read_manifest(paths["distckpt"])["meta"]["user"]
    for key, value in (("hyper_parameters", "abc"), ("hyper_parameters", [1, 2]), ("pytorch-lightning_version", 5)):
        crafted = str(tmp_path / f"crafted-{key}-{type(value).__name__}")
        distckpt.save({**tree, key: value}, crafted, no_dist=True, metadata=user)
        with pytest.raises(CheckpointCorruptError, match=key):
            load_from_checkpoint(Tiny, crafted)


def test_missing_and_damaged_checkpoints_raise_typed_errors(tmp_path):
    io = DistCkptCheckpointIO()
    with pytest.raises(CheckpointNotFoundError):
        io.load_checkpoint(str(tmp_path / "nothing.ckpt"))
    open(tmp_path / "plain.ckpt", "wb").write(b"not a checkpoint")
    with pytest.raises(CheckpointNotFoundError):
        io.load_checkpoint(str(tmp_path / "plain.ckpt"))
    path = str(tmp_path / "c.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.arange(4096, dtype=torch.float32)}, "epoch": 1}, path)
    data = os.path.join(path, "rank00000.bin")
    with open(data, "r+b") as f:  # flip one byte of the tensor's block
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ChecksumMismatchError):
        io.load_checkpoint(path)
    os.truncate(data, 1000)
    with pytest.raises(DataFileTruncatedError):
        io.load_checkpoint(path)
    os.unlink(os.path.join(path, "MANIFEST"))
    with pytest.raises(CheckpointIncompleteError):
        io.load_checkpoint(path)


def test_keep_last_rotates_only_this_plugins_checkpoints(tmp_path):
    d = tmp_path / "ck"
    ck = {"state_dict": {"w": torch.ones(3)}, "epoch": 0}
    io = DistCkptCheckpointIO(keep_last=2)
    io.save_checkpoint(ck, str(d / "epoch=0.ckpt"))
    import distckpt
    distckpt.save({"w": torch.ones(1)}, str(d / "foreign"), no_dist=True)  # not the plugin's: never rotated
    os.symlink("epoch=0.ckpt", str(d / "last.ckpt"))  # save_last="link": its target is kept
    io.load_checkpoint(str(d / "last.ckpt"))  # through the link
    resumed = DistCkptCheckpointIO(keep_last=2)
    resumed.save_checkpoint(ck, str(d / "epoch=1.ckpt"))
    resumed.load_checkpoint(str(d / "epoch=1.ckpt"))  # the run resumed from it: kept
    for e in (2, 3, 4):
        resumed.save_checkpoint(ck, str(d / f"epoch={e}.ckpt"))
    # Excess by age at the last save: epoch=0 (a link's target), 1 (resumed from), 2 (deleted).
    assert sorted(n for n in os.listdir(d) if not n.startswith(".")) == [
        "epoch=0.ckpt", "epoch=1.ckpt", "epoch=3.ckpt", "epoch=4.ckpt", "foreign", "last.ckpt"]
    with pytest.raises(ConfigError):
        DistCkptCheckpointIO(keep_last=0)


def test_remove_checkpoint_removes_only_checkpoints(tmp_path):
    io = DistCkptCheckpointIO()
    path = str(tmp_path / "a.ckpt")
    io.save_checkpoint({"w": torch.ones(1)}, path)
    os.symlink("a.ckpt", str(tmp_path / "last.ckpt"))
    io.remove_checkpoint(str(tmp_path / "last.ckpt"))  # the link only
    assert _is_checkpoint(path) and not os.path.lexists(str(tmp_path / "last.ckpt"))
    io.remove_checkpoint(path)
    assert not os.path.exists(path)
    io.remove_checkpoint(path)  # nothing there: nothing to do, as TorchCheckpointIO
    (tmp_path / "file.ckpt").write_bytes(b"x")
    with pytest.raises(CheckpointNotFoundError):
        io.remove_checkpoint(str(tmp_path / "file.ckpt"))
    (tmp_path / "dir.ckpt").mkdir()
    (tmp_path / "dir.ckpt" / "keep").write_bytes(b"x")
    with pytest.raises(CheckpointIncompleteError):
        io.remove_checkpoint(str(tmp_path / "dir.ckpt"))
    assert (tmp_path / "file.ckpt").exists() and (tmp_path / "dir.ckpt" / "keep").exists()


def test_errors_of_background_saves_are_raised(tmp_path):
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    (tmp_path / "file").write_bytes(b"x")
    under_a_file = str(tmp_path / "file" / "c.ckpt")
    io = DistCkptCheckpointIO(async_save=True)
    with pytest.raises(UnsupportedValueError):  # found while planning: raised by the call itself
        io.save_checkpoint({"f": lambda: 0}, str(tmp_path / "x.ckpt"))
    # Fails on distckpt's thread: raised by teardown (or by the call itself when the thread has
    # already failed by the time it returns).
    with pytest.raises(StorageError):
        io.save_checkpoint({"w": torch.ones(2)}, under_a_file)
        io.teardown()
    io.teardown()  # reported once
    good = str(tmp_path / "ok.ckpt")
    io.save_checkpoint({"w": torch.ones(2)}, good)
    assert io.load_checkpoint(good)["w"].sum() == 2  # a load waits for the save in flight
    wrapped = AsyncCheckpointIO(DistCkptCheckpointIO())
    # Lightning's wrapper raises it at its next save_checkpoint or at teardown, whichever comes
    # first after its thread failed (here the save itself may already see it).
    with pytest.raises(StorageError):
        wrapped.save_checkpoint({"w": torch.ones(2)}, under_a_file)
        wrapped.teardown()


def test_storage_options_reach_an_object_store(s3_bucket):
    opts = s3_bucket.storage_options
    io = DistCkptCheckpointIO(storage_options=opts, keep_last=2)
    ck = _lightning_like()
    base = s3_bucket.url + "/run/checkpoints"
    for e in range(3):
        io.save_checkpoint(ck, f"{base}/epoch={e}.ckpt")
    io.save_checkpoint(ck, f"{base}/epoch=2.ckpt")  # rewritten in place of the old one
    _equal(ck, io.load_checkpoint(f"{base}/epoch=2.ckpt"))
    tops = {k.split("/")[2] for k in s3_bucket.keys("run/checkpoints")}
    assert {"epoch=1.ckpt", "epoch=2.ckpt"} <= tops and "epoch=0.ckpt" not in tops  # keep_last=2
    io.remove_checkpoint(f"{base}/epoch=1.ckpt")
    with pytest.raises(CheckpointNotFoundError):
        io.load_checkpoint(f"{base}/epoch=1.ckpt")
    with pytest.raises(ConfigError):  # fsspec options for a local path: refused, not ignored
        DistCkptCheckpointIO(storage_options=opts).save_checkpoint(ck, "/tmp/never-written.ckpt")


class _Marker:
    """Unpickling it would create a file: proof that code from the checkpoint ran."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_torch_save_file_from_torch_checkpoint_io_is_read_without_running_code(tmp_path):
    """A run that switches from Lightning's default TorchCheckpointIO resumes from its last .ckpt
    file: DistCkptCheckpointIO reads it with torch.load(weights_only=True), equal to what
    TorchCheckpointIO gives back. A file holding a global the restricted unpickler refuses is a
    PickleNotAllowedError naming it, and nothing of it runs (allow_pickle=True reads it)."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO
    ck = _lightning_like()
    ck["hyper_parameters"].pop("tags")  # a set: weights_only=True refuses it (as it does in Lightning)
    path = str(tmp_path / "last.ckpt")
    TorchCheckpointIO().save_checkpoint(ck, path)
    _equal(TorchCheckpointIO().load_checkpoint(path, weights_only=True), DistCkptCheckpointIO().load_checkpoint(path))
    marker = tmp_path / "ran"
    TorchCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(2)}, "evil": _Marker(str(marker))},
                                        str(tmp_path / "evil.ckpt"))
    with pytest.raises(PickleNotAllowedError) as info:
        DistCkptCheckpointIO().load_checkpoint(str(tmp_path / "evil.ckpt"))
    assert "open" in str(info.value) and "\x1b" not in str(info.value), str(info.value)
    assert not marker.exists()
    DistCkptCheckpointIO(allow_pickle=True).load_checkpoint(str(tmp_path / "evil.ckpt"))
    assert marker.exists()


def test_an_async_save_with_save_last_link_into_a_new_folder_does_not_stop_the_fit(tmp_path):
    """ModelCheckpoint(save_last="link") links last.ckpt to the checkpoint as soon as
    save_checkpoint returns. With async_save the checkpoint's folder was created only later, on
    the save's thread, so the link (and Lightning's fallback copy) met a folder that did not exist:
    FileNotFoundError, fit() stopped at its first checkpoint (an outside trial: 8 of 8 fits; the
    sync plugin and TorchCheckpointIO 0 of 8). The folder is now created before save_checkpoint
    returns; the link names the checkpoint, which resumes exactly once committed."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(5, 1)

        def training_step(self, batch, _):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 5)), batch_size=4)
    folder = tmp_path / "not" / "yet"
    plugin = DistCkptCheckpointIO(async_save=True)
    torch.manual_seed(0)
    model = Tiny()
    trainer = pl.Trainer(max_steps=4, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu", plugins=[plugin],
                         callbacks=[ModelCheckpoint(dirpath=str(folder), save_last="link", every_n_train_steps=2)])
    trainer.fit(model, data)
    last = folder / "last.ckpt"
    assert os.path.islink(last) and _is_checkpoint(str(last)), sorted(os.listdir(folder))
    back = DistCkptCheckpointIO().load_checkpoint(str(last))
    _equal(dict(back["state_dict"]), dict(model.state_dict()))
    assert back["global_step"] == 4


def test_keep_last_keeps_the_newest_run_s_checkpoints_after_a_restart_on_a_host_whose_clock_is_behind(tmp_path):
    """keep_last rotates by commit time. A run on a host whose clock was 5 minutes ahead saved
    steps 1-2; the next run, on a right clock, saved 3-5 and its rotation deleted 3 and 4 (older by
    the clocks) and kept the previous run's 1 and 2 (an outside review). The plugin now makes the
    folder's commit times known before its first save there (distckpt.commitclock)."""
    import json

    from ..helpers.faults import REPO_ROOT

    def run(phase: str, skew: float) -> list:
        env = os.environ | {"SKEW": str(skew), "PYTHONPATH": str(REPO_ROOT)}
        p = subprocess.run([sys.executable, "-m", "tests.helpers.skewed_clock_worker", "lightning", str(tmp_path),
                            phase], capture_output=True, text=True, env=env, timeout=240, cwd=str(REPO_ROOT))
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    assert run("save:1-2", -300) == ["step=1.ckpt", "step=2.ckpt"]
    assert run("save:3-5", 0) == ["step=4.ckpt", "step=5.ckpt"]


def test_last_checkpoint_finds_the_newest_committed_one_when_last_ckpt_dangles(tmp_path):
    """save_last="link" with async_save: a job killed before its save commits leaves last.ckpt a
    dangling link, and fit(ckpt_path="last") trained from scratch beside a committed checkpoint (an
    outside trial; Lightning's AsyncCheckpointIO does the same). last_checkpoint(dirpath) names the
    newest committed checkpoint of this plugin, by commit time, whatever the links say."""
    from distckpt.integrations.lightning import last_checkpoint
    folder = tmp_path / "ckpt"
    assert not os.path.exists(folder)
    with pytest.raises(CheckpointNotFoundError):
        last_checkpoint(folder)
    os.symlink("nowhere", str(tmp_path / "dangling"))   # returned None: "start from scratch"
    with pytest.raises(CheckpointNotFoundError):
        last_checkpoint(tmp_path / "dangling")
    folder.mkdir()
    assert last_checkpoint(folder) is None
    io = DistCkptCheckpointIO()
    io.save_checkpoint({"global_step": 4, "w": torch.ones(2)}, str(folder / "epoch=0-step=4.ckpt"))
    io.save_checkpoint({"global_step": 8, "w": torch.full((2,), 2.0)}, str(folder / "epoch=1-step=8.ckpt"))
    distckpt.save({"w": torch.zeros(2)}, str(folder / "other"), no_dist=True)   # not the plugin's: not a candidate
    os.symlink("epoch=2-step=12.ckpt", str(folder / "last.ckpt"))                # its save never committed
    assert not os.path.exists(folder / "last.ckpt")
    got = last_checkpoint(folder)
    assert got == str(folder / "epoch=1-step=8.ckpt")
    assert io.load_checkpoint(got)["global_step"] == 8
