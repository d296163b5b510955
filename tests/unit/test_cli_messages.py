"""What the command line and the readers say about paths and arguments: what a file really is,
what an interrupted save left, sizes in a unit that fits, typed errors for bad sizes, a torch-free
``ls``, and ``json_format`` in every --json document."""

from __future__ import annotations

import json
import os
import pickle
import signal
import struct
import subprocess
import sys

import pytest
import torch

import distckpt
from distckpt import errors
from distckpt.cli import main as cli

from ..protocol.test_manager import stopped_mid_save

PY = sys.executable


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "distckpt", *args], capture_output=True, text=True, timeout=300)


# ------------------------------------------------------------------------------------------------
# What a path is (item 14)


def test_a_safetensors_file_whose_header_length_starts_with_0x80_is_named_as_such(tmp_path):
    # A 640-byte header: its u64 length starts 0x80 0x02, the first bytes of a pickle protocol 2 stream.
    header = b'{"__metadata__":{}}'.ljust(640)
    st = tmp_path / "model.safetensors"
    st.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(errors.CheckpointNotFoundError) as ei:
        distckpt.read(st)
    assert "is a safetensors file" in ei.value.message and "pickle" not in str(ei.value), str(ei.value)
    legacy = tmp_path / "legacy.pt"  # a real pickle stream is still called one
    legacy.write_bytes(pickle.dumps({"a": 1}, protocol=2))
    with pytest.raises(errors.CheckpointNotFoundError, match="a pickle file"):
        distckpt.read(legacy)


def test_inspect_of_a_dcp_directory_says_who_wrote_it(tmp_path):
    import torch.distributed.checkpoint as dcp
    path = tmp_path / "dcp"
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(path), no_dist=True)
    proc = _run("inspect", str(path))
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("written by"))
    assert "torch.distributed.checkpoint" in line and "distckpt (version" not in line, line
    assert not line.rstrip().endswith("save"), line
    doc = json.loads(_run("inspect", "--json", str(path)).stdout)
    assert doc["format"] == "torch.distributed.checkpoint" and doc["json_format"] == 1


# ------------------------------------------------------------------------------------------------
# An interrupted save (item 15)


def test_an_interrupted_save_is_named_by_read_and_ls(tmp_path, capsys):
    root = str(tmp_path / "root")
    os.makedirs(root)
    with stopped_mid_save(root, 7, mode="plain") as (saver, tmp):
        os.kill(saver.pid, signal.SIGKILL)  # what a second Ctrl-C (or the OOM killer) leaves
        saver.wait()
    with open(os.path.join(root, tmp, "rank00000.bin"), "ab") as f:  # bytes it had written, whenever it stopped
        f.write(bytes(3 << 20))
    target = os.path.join(root, "step_00000007")
    assert not os.path.exists(target)
    with pytest.raises(errors.CheckpointNotFoundError) as ei:
        distckpt.read(target)
    text = str(ei.value)
    assert tmp in text and "interrupted" in text and "MiB)" in text, text
    assert "next save" in ei.value.remedy and "reclaim()" in ei.value.remedy
    capsys.readouterr()
    assert cli(["ls", root]) == 0
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if tmp in ln)
    assert "interrupted save" in row and "in progress" not in row and "MiB" in row, out
    assert "reclaim()" in out, out
    distckpt.CheckpointManager(root).reclaim()
    assert os.listdir(root) == []


def test_ls_names_an_overwrites_unfinished_deletion_as_the_replaced_checkpoint(tmp_path, capsys, monkeypatch):
    """An overwrite swaps the new checkpoint in and then deletes the old one, now under the new
    save's tmp name; a kill between the two leaves the old checkpoint there. ls calls it what it
    is (not an interrupted save), and reclaim removes it like any dead leftover."""
    from distckpt.storage.posix.store import PosixStore
    target = str(tmp_path / "ck")
    distckpt.save({"w": torch.ones(4)}, target)
    monkeypatch.setattr(PosixStore, "discard", lambda self, replaced: None)  # the kill after the exchange
    distckpt.save({"w": torch.zeros(4)}, target, overwrite=True)
    monkeypatch.undo()
    (left,) = [e for e in os.listdir(tmp_path) if e != "ck"]
    capsys.readouterr()
    assert cli(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if left in ln)
    assert "overwrite replaced" in row and "interrupted save" not in row and "reclaimable" in row, out
    distckpt.CheckpointManager(str(tmp_path)).reclaim()
    assert os.listdir(tmp_path) == ["ck"]
    assert torch.equal(distckpt.read(target)["w"], torch.zeros(4))


# ------------------------------------------------------------------------------------------------
# Arguments, units, ls, json (item 16)


@pytest.mark.parametrize("args", [
    ["bench", "DIR", "--size", "1GB"],
    ["bench", "DIR", "--ring", "4MBx9"],
    ["bench", "DIR", "--ring", "4Mx"],
    ["bench", "DIR", "--block-size", "8MB"],
    ["convert", "SRC", "DST", "--to", "safetensors", "--max-shard-size", "5GB"],
])
def test_bad_sizes_are_usage_errors_with_the_reason(tmp_path, args):
    args = [str(tmp_path) if a in ("DIR", "SRC") else str(tmp_path / "out") if a == "DST" else a for a in args]
    proc = _run(*args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "ambiguous" in proc.stderr or "BLOCKxCOUNT" in proc.stderr, proc.stderr
    assert "invalid" not in proc.stderr, proc.stderr


def test_bench_names_a_missing_directory_and_prints_sizes_in_a_unit_that_fits(tmp_path, capsys):
    proc = _run("bench", str(tmp_path / "missing"))
    assert proc.returncode == 1 and "ConfigError" in proc.stderr and "does not exist" in proc.stderr, proc.stderr
    assert "health" not in proc.stderr, proc.stderr
    from distckpt.bench import run_io_bench
    import io
    out = io.StringIO()
    run_io_bench(tmp_path, 64 << 20, repeat=1, backends=("buffered",), baseline="loop", out=out)
    head = out.getvalue().splitlines()[0]
    assert "64.0 MiB per file" in head and "GiB per file" not in head, head


def test_ls_imports_no_torch_and_refuses_a_directory_without_checkpoints(tmp_path):
    root = tmp_path / "root"
    distckpt.CheckpointManager(root).save(1, {"w": torch.ones(4)})
    code = ("import sys; from distckpt.cli import main; rc = main(['ls', sys.argv[1]]); "
            "print('TORCH', 'torch' in sys.modules, rc)")
    proc = subprocess.run([PY, "-c", code, str(root)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "TORCH False 0" in proc.stdout, (proc.stdout, proc.stderr)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "README.md").write_text("# notes\n")
    proc = _run("ls", str(docs))
    assert proc.returncode == 2 and "holds no checkpoints" in proc.stderr and "README.md" in proc.stderr, proc.stderr


def test_convert_to_dcp_prints_no_torch_warning(tmp_path):
    distckpt.save({"w": torch.ones(3)}, tmp_path / "ck", no_dist=True)
    proc = _run("convert", str(tmp_path / "ck"), str(tmp_path / "out"), "--to", "dcp", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "torch.distributed is disabled" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr


def test_every_json_output_carries_json_format(tmp_path, capsys):
    root = tmp_path / "root"
    distckpt.CheckpointManager(root).save(1, {"w": torch.ones(4)})
    step = str(root / "step_00000001")
    for argv in (["ls", "--json", str(root)], ["inspect", "--json", step], ["verify", "--json", step],
                 ["preflight", "--json", str(tmp_path)]):
        capsys.readouterr()
        cli(argv)
        doc = json.loads(capsys.readouterr().out)
        assert doc.get("json_format") == 1, (argv, sorted(doc))


def test_help_lists_exit_status_130():
    proc = _run("--help")
    assert proc.returncode == 0 and "130 interrupted" in " ".join(proc.stdout.split()), proc.stdout


def test_inspect_escapes_unprintable_characters_of_keys(tmp_path, capsys):
    """Keys come from the checkpoint: a downloaded file's ESC / BEL sequences and newlines in a
    tensor name reached the terminal raw through `distckpt inspect` (retitle it, clear it, fake a
    row of the table: an outside trial). They are printed escaped."""
    from safetensors.torch import save_file
    save_file({"w\x1b]0;PWNED\x07\x1b[2J\nfake_row  uint8": torch.ones(1), "plain": torch.zeros(1)},
              str(tmp_path / "model.safetensors"))
    assert cli(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\nfake_row" not in out
    assert "w\\x1b]0;PWNED\\x07\\x1b[2J\\nfake_row  uint8" in out and "  plain " in out


def test_a_failed_host_allocation_of_torch_is_host_memory_error():
    """torch reports a host allocation it cannot make as a RuntimeError ("DefaultCPUAllocator:
    can't allocate memory"): read() of a tensor larger than the host's memory raised it raw."""
    raw = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 42949672960 bytes. Error code 12 (Cannot allocate memory)")
    typed = errors.typed_memory_error(raw)
    assert isinstance(typed, errors.HostMemoryError) and isinstance(typed, MemoryError) and typed.__cause__ is raw
    other = RuntimeError("something else")
    assert errors.typed_memory_error(other) is other
