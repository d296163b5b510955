"""Every Python block of the README runs, as written, against the real library.

Only what a reader must supply is supplied: ``model``, ``optim`` (a trained model and a stepped
Adam), ``step``, a directory for ``/ckpt``, and for the S3 block the test server's bucket and
``storage_options``. The "Use" block is run in its two halves (the saving job, then the job that
resumes, with a fresh model and optimizer in between), and the resumed model and Adam moments must
equal the saved ones: a block that loads nothing, or loads the optimizer silently fresh, fails.
"""

from __future__ import annotations

import copy
import os
import re

import pytest
import torch

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")
RESUME = "# in the job that resumes"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", open(README).read(), flags=re.S)


def _model():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _use_block() -> str:
    (block,) = [b for b in _python_blocks() if "distckpt.CheckpointManager(\"/ckpt\"" in b]
    return block


def test_every_python_block_compiles():
    blocks = _python_blocks()
    assert len(blocks) >= 2
    for b in blocks:
        compile(b, README, "exec")


def _run_use_block(tmp_path):
    import distckpt

    block = _use_block().replace('"/ckpt', f'"{tmp_path}/ckpt')
    assert RESUME in block, "the Use block has no resuming half"
    saving, _, rest = block.partition(RESUME)
    resuming = rest.split("\n", 1)[1]  # after the comment line
    torch.manual_seed(0)
    model = _model()
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(3):
        model(torch.randn(5, 8)).sum().backward()
        optim.step()
    saved_model = copy.deepcopy(model.state_dict())
    saved_optim = copy.deepcopy(optim.state_dict())
    ns = {"model": model, "optim": optim, "step": 100, "torch": torch}
    exec(compile(saving, README, "exec"), ns)
    # The job that resumes: a fresh model and an optimizer that has never stepped.
    torch.manual_seed(1)
    ns["model"] = _model()
    ns["optim"] = torch.optim.Adam(ns["model"].parameters(), lr=0.5)
    exec(compile(resuming, README, "exec"), ns)
    mgr = ns["mgr"]
    mgr.close()  # waits for the block's last async save
    for k, v in saved_model.items():
        assert torch.equal(ns["model"].state_dict()[k], v), k
    got = ns["optim"].state_dict()
    assert got["param_groups"][0]["lr"] == 0.01
    for i, st in saved_optim["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got["state"][i][name], st[name]), (i, name)
    assert mgr.steps() == [100, 200]
    assert torch.equal(distckpt.read(f"{tmp_path}/ckpt/s200")["optim"]["state"]["0.weight"]["exp_avg"],
                       saved_optim["state"][0]["exp_avg"])
    return ns


def test_the_use_block_saves_and_resumes_model_and_optimizer_exactly(tmp_path):
    _run_use_block(tmp_path)


def test_the_object_store_block_on_the_test_server(tmp_path, s3_bucket):
    ns = _run_use_block(tmp_path)
    (block,) = [b for b in _python_blocks() if "s3://bucket/run7" in b]
    block = block.replace("s3://bucket", s3_bucket.url)
    block = re.sub(r"^opts = .*$", "opts = TEST_OPTIONS", block, count=1, flags=re.M)
    ns["TEST_OPTIONS"] = s3_bucket.storage_options
    exec(compile(block, README, "exec"), ns)
    ns["mgr"].close()
    import distckpt

    back = distckpt.read(f"{s3_bucket.url}/run7/step_00000100", storage_options=s3_bucket.storage_options)
    assert torch.equal(back["model"]["0.weight"], ns["model"].state_dict()["0.weight"])


def test_the_tiers_block_on_the_test_server(tmp_path, s3_bucket):
    ns = _run_use_block(tmp_path)
    (block,) = [b for b in _python_blocks() if "TieredCheckpointManager(" in b]
    block = block.replace("s3://bucket", s3_bucket.url).replace("/nvme/ckpt/run7", str(tmp_path / "nvme"))
    ns["opts"] = s3_bucket.storage_options
    exec(compile(block, README, "exec"), ns)
    import distckpt

    back = distckpt.read(f"{s3_bucket.url}/tiers7/step_00000100", storage_options=s3_bucket.storage_options)
    assert torch.equal(back["model"]["0.weight"], ns["model"].state_dict()["0.weight"])
    assert (tmp_path / "nvme" / "step_00000100" / "MANIFEST").read_bytes() == \
        s3_bucket.fs.cat(f"{s3_bucket.name}/tiers7/step_00000100/MANIFEST")


def test_raw_optimizer_state_loaded_into_name_keyed_state_names_the_real_cause(tmp_path):
    """The README's old mistake: a raw optim.state_dict() (keyed by parameter index) saved, loaded
    into get_state_dict's form (keyed by name). The error must name that cause and must not advise
    strict=False, which would leave Adam's state fresh."""
    import distckpt
    from distckpt.errors import StateDictMismatchError
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _model()
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optim.step()
    distckpt.save({"model": model.state_dict(), "optim": optim.state_dict()}, tmp_path / "ck")
    msd, osd = get_state_dict(model, optim)
    with pytest.raises(StateDictMismatchError) as ei:
        distckpt.load({"model": msd, "optim": osd}, tmp_path / "ck")
    text = str(ei.value)
    assert "keyed by parameter index in the checkpoint" in text and "by parameter name" in text
    assert "strict=False would not load this optimizer state" in ei.value.remedy
    assert "Pass strict=False to load what matches" not in ei.value.remedy
    # The reverse: saved by name, loaded into a raw optimizer state dict that has stepped.
    distckpt.save({"model": msd, "optim": osd}, tmp_path / "named")
    with pytest.raises(StateDictMismatchError) as ei:
        distckpt.load({"model": model.state_dict(), "optim": optim.state_dict()}, tmp_path / "named")
    assert "keyed by parameter name in the checkpoint" in str(ei.value)
