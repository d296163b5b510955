"""A path to a checkpoint's MANIFEST file stands for its directory in load, read, verify and
inspect alike; no message ever advises moving or removing a file of a committed checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import distckpt
from distckpt import errors
from distckpt.cli import main as cli
from distckpt.verify import verify


@pytest.fixture
def ck(tmp_path):
    path = tmp_path / "ck"
    distckpt.save({"x": torch.arange(6.0), "n": 3}, path, no_dist=True)
    return path


def test_a_manifest_path_reads_as_its_directory(ck, capsys):
    m = ck / "MANIFEST"
    got = distckpt.read(m)
    assert torch.equal(got["x"], torch.arange(6.0)) and got["n"] == 3
    target = {"x": torch.zeros(6), "n": 0}
    assert distckpt.load(target, str(m), no_dist=True).path == str(ck)
    assert torch.equal(target["x"], torch.arange(6.0)) and target["n"] == 3
    report = verify(m)
    assert report.ok and report.path == str(ck)
    assert cli(["verify", str(m), "--no-progress"]) == 0
    assert f"{ck}: OK" in capsys.readouterr().out
    assert cli(["inspect", "--json", str(m)]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == str(ck)
    # The MANIFEST is still there: nothing was moved.
    assert m.is_file()
    # Only a real MANIFEST stands for its directory: a text file named MANIFEST, or a symlink to
    # the checkpoint's MANIFEST (never followed), is not taken for a checkpoint.
    d = ck.parent / "d"
    d.mkdir()
    (d / "MANIFEST").write_text("a text file\n")
    with pytest.raises(errors.CheckpointNotFoundError, match="is a file, not a distckpt checkpoint"):
        distckpt.read(d / "MANIFEST")
    os.symlink(m, ck.parent / "MANIFEST")
    with pytest.raises(errors.DistCkptError):
        distckpt.read(ck.parent / "MANIFEST")


def test_no_message_advises_moving_or_removing_a_checkpoint_file(ck):
    m = ck / "MANIFEST"
    for target in (m / "sub", m / "a" / "b"):
        with pytest.raises(errors.StorageError) as ei:
            distckpt.save({"x": torch.ones(2)}, target, no_dist=True)
        text = str(ei.value)
        assert f"checkpoint {ck}" in text, text
        assert "move the file" not in text and "remove" not in text, text
    with pytest.raises(errors.DistCkptError) as ei:
        distckpt.read(m / "x")
    assert "move the file" not in str(ei.value) and "remove" not in str(ei.value), str(ei.value)
    proc = subprocess.run([sys.executable, "-m", "distckpt", "verify", str(m / "x")], capture_output=True, text=True)
    assert proc.returncode == 1 and "move the file" not in proc.stderr, proc.stderr
    assert m.is_file()

