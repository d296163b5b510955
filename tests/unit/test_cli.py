"""The command line as people use it: --help/--version without torch, inspect, verify, sizes."""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pickle
import pty
import shutil
import struct
import subprocess
import sys
import termios
import warnings

import pytest
import torch

import distckpt
from distckpt import cli, config, manifest as mf
from distckpt.storage.posix.manifests import load_manifest
from distckpt.sizes import format_bytes, parse_size
from distckpt.verify import verify

from ..helpers.distributed import run_ranks

PY = sys.executable


def _run(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([PY, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, **kw)


def _imported(args: list[str]) -> set[str]:
    """Top-level packages a `python -m distckpt ARGS` run imported (from -X importtime)."""
    proc = _run("-X", "importtime", "-m", "distckpt", *args)
    assert proc.returncode == 0, proc.stderr
    names = set()
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["verify", "--help"], ["inspect", "--help"],
                                  ["preflight", "--help"], ["bench", "--help"]])
def test_help_and_version_do_not_import_torch(args):
    """Parsing the command line is torch-free; commands import what they need when they run."""
    names = _imported(args)
    assert "distckpt" in names  # the probe works
    assert not names & {"torch", "numpy", "distckpt._uring"}, sorted(names & {"torch", "numpy"})


def test_version():
    proc = _run("-m", "distckpt", "--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"distckpt {distckpt.__version__}"


def _all_actions(parser: argparse.ArgumentParser, prefix: str = ""):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _all_actions(sub, f"{prefix}{name} ")
        elif not isinstance(action, (argparse._HelpAction,)):
            yield prefix, action


def test_every_argument_has_help():
    missing = [f"{where}{a.dest}" for where, a in _all_actions(cli.build_parser())
               if not a.help]
    assert missing == []


def test_package_names_resolve_lazily():
    """`distckpt.save` is the function even after its submodule was imported (lazy package)."""
    proc = _run("-c", "import sys, distckpt; assert 'torch' not in sys.modules; import distckpt.manager; "
                      "import distckpt.save_async, distckpt.save_sync; from distckpt import save, load, read, CheckpointManager; "
                      "assert callable(distckpt.save) and distckpt.save is save; "
                      "assert callable(distckpt.async_save) and callable(distckpt.preflight); "
                      "assert set(distckpt.__all__) <= set(dir(distckpt))")
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------------------------
# inspect


def test_inspect_shows_values_versions_and_sizes(tmp_path):
    ck = tmp_path / "ck"
    distckpt.save({"model": {"w": torch.zeros(100, 10), "b": torch.zeros(3, dtype=torch.bfloat16)},
                   "step": 7, "name": "run-a", "lr": 0.25, "cfg": (1, 2)}, ck, metadata={"owner": "team"})
    proc = _run("-m", "distckpt", "inspect", str(ck))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    values = out.split("\nvalues\n")[1].split("\n\n")[0] + "\n"
    assert "  step: 7\n" in values and "  name: 'run-a'\n" in values and "  lr: 0.25\n" in values
    assert "  cfg: (1, 2)\n" in values and "int" not in values  # a tuple of plain values is one value
    assert f"distckpt {distckpt.__version__}" in out and "world size  1 rank" in out
    assert "created     20" in out and "UTC" in out
    assert "float32   [100, 10]" in out and "3.9 KiB" in out and "bfloat16" in out
    assert "2 tensors (1,003 elements, 3.9 KiB), 4 values" in out

    doc = json.loads(_run("-m", "distckpt", "inspect", "--json", str(ck)).stdout)
    assert doc["json_format"] == 1 and doc["world_size"] == 1 and doc["distckpt_version"] == distckpt.__version__
    assert doc["values"]["step"] == {"kind": "int", "value": 7}
    assert doc["values"]["name"] == {"kind": "str", "value": "run-a"}
    assert doc["tensors"]["model.w"] == {"dtype": "float32", "shape": [100, 10], "bytes": 4000, "kind": "tensor",
                                         "chunks": 1}
    assert doc["totals"]["tensors"] == 2 and doc["totals"]["tensor_bytes"] == 4006 and doc["totals"]["values"] == 4
    assert doc["totals"]["file_bytes"] == sum(f["bytes"] for f in doc["files"]) > 4006
    assert doc["meta"] == {"user": {"owner": "team"}}
    assert abs(doc["created_unix"] - os.stat(ck / "MANIFEST").st_mtime) < 60
    assert doc["checksum"]["algorithm"] == "crc32c"


class _Evil:
    """Unpickling this runs a command: verify and inspect must never do it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_inspect_and_verify_never_unpickle(tmp_path):
    marker = tmp_path / "unpickled"
    ck = tmp_path / "ck"
    distckpt.save({"w": torch.ones(4), "evil": _Evil(marker)}, ck, allow_pickle=True)
    out = _run("-m", "distckpt", "inspect", str(ck))
    assert out.returncode == 0 and "<pickled object" in out.stdout and "not unpickled" in out.stdout
    assert _run("-m", "distckpt", "verify", str(ck)).returncode == 0
    assert not marker.exists()


def test_inspect_shows_values_written_through_dcp_as_dcp_reads_them(tmp_path):
    """dcp.save through DistCkptStorageWriter stores each value as DCP's torch.save bytes: inspect
    showed `<1261 bytes>`; it shows the value as torch's restricted unpickler gives it, and what
    that unpickler refuses as refused (nothing is unpickled with code)."""
    import torch.distributed.checkpoint as dcp

    from distckpt.integrations.dcp import DistCkptStorageWriter

    marker = tmp_path / "unpickled"
    ck = tmp_path / "ck"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "assuming the intent is to save in a single process"
        dcp.save({"w": torch.ones(2), "step": 7, "name": "run-a", "evil": _Evil(marker)},
                 storage_writer=DistCkptStorageWriter(str(ck)), no_dist=True)
    out = _run("-m", "distckpt", "inspect", str(ck))
    assert out.returncode == 0, out.stderr
    assert "  step: 7\n" in out.stdout and "  name: 'run-a'\n" in out.stdout, out.stdout
    assert "  evil: <DCP value, " in out.stdout and "not loaded" in out.stdout and not marker.exists()
    doc = json.loads(_run("-m", "distckpt", "inspect", "--json", str(ck)).stdout)
    assert doc["values"]["step"]["text"] == "7" and "refused" in doc["values"]["evil"]
    # bytes that are not torch.save's: that value is shown as such, the report goes on
    from distckpt import manifest as mf
    from distckpt.cli import inspect_document
    from distckpt.restore import load_manifest
    m = load_manifest(str(ck))
    m.objects["step"] = mf.ObjectEntry("bytes", b"junk")
    values = inspect_document(m, str(ck))["values"]
    assert "CheckpointCorruptError" in values["step"]["refused"] and values["name"]["text"] == "'run-a'"


# --------------------------------------------------------------------------------------------
# verify


def _save_two_files(rank, world_size, path):
    g = torch.Generator().manual_seed(1)
    sd = {f"t{i}": torch.randn(64 << 10, generator=g) for i in range(6)}  # 6 x 256 KiB, replicated
    distckpt.save(sd, path)


@pytest.fixture(scope="module")
def two_file_ckpt(tmp_path_factory):
    """One 2-rank checkpoint (64 KiB checksum blocks) for the verify tests, saved once: spawning
    real gloo ranks is the slow part. Tests damage copies of it."""
    path = str(tmp_path_factory.mktemp("two_files") / "ck")
    run_ranks(_save_two_files, 2, path, env={"DISTCKPT_CHECKSUM_BLOCK": str(64 << 10)})
    yield path
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_verify_reports_every_bad_block_in_every_file(tmp_path, two_file_ckpt):
    """Three blocks damaged in two files (two in one tensor's chunk): all three are reported, with
    file, offset and key; the exit status is 1; nothing is written into the checkpoint."""
    ck = str(tmp_path / "ck")
    shutil.copytree(two_file_ckpt, ck)
    m = load_manifest(ck)
    assert len(m.files) == 2
    by_file: dict[int, list] = {}
    for fqn, t in sorted(m.tensors.items()):
        for c in t.chunks:
            by_file.setdefault(c.file, []).append((fqn, c))
    assert len(by_file) == 2, "both ranks' files hold chunks"
    (fqn_a, ca), (fqn_b, cb) = by_file[0][0], by_file[1][0]
    damaged = {(m.files[0].name, ca.offset + 5, fqn_a), (m.files[0].name, ca.offset + 2 * (64 << 10) + 9, fqn_a),
               (m.files[1].name, cb.offset + 3 * (64 << 10), fqn_b)}
    for name, offset, _ in damaged:
        _flip(os.path.join(ck, name), offset)
    before = {e.name: os.lstat(os.path.join(ck, e.name)).st_mtime_ns for e in os.scandir(ck)}

    proc = _run("-m", "distckpt", "verify", "--json", ck)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    block = 64 << 10
    got = {(b["file"], b["offset"], b["key"]) for b in report["bad_blocks"]}
    assert got == {(name, off - (off - c_off) % block, key)
                   for (name, off, key), c_off in zip(sorted(damaged), [ca.offset, ca.offset, cb.offset])}
    assert all(b["expected"] != b["found"] for b in report["bad_blocks"])
    assert report["blocks_checked"] == report["blocks_expected"] == sum(len(c.crcs) for t in m.tensors.values()
                                                                        for c in t.chunks)
    assert report["bytes_read"] == sum(f.size for f in m.files) and report["file_problems"] == []

    human = _run("-m", "distckpt", "verify", ck)
    assert human.returncode == 1 and human.stdout.count("BAD BLOCK") == 3
    assert "DAMAGED: 3 bad block(s)" in human.stdout and "/s)" in human.stdout
    assert {e.name: os.lstat(os.path.join(ck, e.name)).st_mtime_ns for e in os.scandir(ck)} == before


def test_verify_reports_missing_and_truncated_files_and_goes_on(tmp_path, two_file_ckpt):
    ck = tmp_path / "ck"
    shutil.copytree(two_file_ckpt, ck)
    m = load_manifest(ck)
    blocks0 = sum(len(c.crcs) for t in m.tensors.values() for c in t.chunks if c.file == 0)
    # A truncated file loses its index (format 3: at its end) first: the file is reported twice
    # (its size, its chunks that cannot be located), and the other file is still checked whole.
    os.truncate(ck / m.files[1].name, m.files[1].size - 10)
    report = verify(ck)
    assert not report.ok
    problems = [(p.file, p.problem) for p in report.file_problems]
    assert [f for f, _ in problems] == [m.files[1].name] * 2, problems
    assert "truncated" in problems[0][1] and "cannot be located or checked" in problems[1][1]
    assert report.bad_blocks == [] and report.blocks_checked == report.blocks_expected == blocks0 > 0
    os.unlink(ck / m.files[0].name)
    report = verify(ck)
    assert {p.file for p in report.file_problems} == {m.files[0].name, m.files[1].name}
    assert "missing" in str(report.file_problems[0])


def test_verify_names_a_damaged_index_and_checks_the_other_files(tmp_path, two_file_ckpt):
    ck = tmp_path / "ck"
    shutil.copytree(two_file_ckpt, ck)
    m = load_manifest(ck)
    off, length, _ = m.files[1].index
    with open(ck / m.files[1].name, "r+b") as f:  # one bit of the index of rank 1's file
        f.seek(off + length // 2)
        b = f.read(1)
        f.seek(off + length // 2)
        f.write(bytes([b[0] ^ 0x10]))
    c = next(c for t in m.tensors.values() for c in t.chunks if c.file == 0 and c.nbytes)
    with open(ck / m.files[0].name, "r+b") as f:  # and one bit of a chunk of rank 0's file
        f.seek(c.offset)
        b = f.read(1)
        f.seek(c.offset)
        f.write(bytes([b[0] ^ 0x01]))
    report = verify(ck)
    assert [(p.file, "index is damaged" in p.problem and "crc32c" in p.problem) for p in report.file_problems] == \
        [(m.files[1].name, True)]
    assert [(b.file, b.offset) for b in report.bad_blocks] == [(m.files[0].name, c.offset)]
    proc = _run("-m", "distckpt", "verify", str(ck))
    assert proc.returncode == 1 and "index is damaged" in proc.stdout, proc.stdout + proc.stderr


_RSS_CHILD = r"""
import resource, sys, json
from distckpt.verify import verify
verify(sys.argv[1] + "/small")                      # warm up: imports, reader, thread pool
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
report = verify(sys.argv[1] + "/big", window=4 << 20)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"ok": report.ok, "bytes": report.bytes_read, "growth_kib": peak - base, "base_kib": base}))
"""


def test_verify_memory_is_bounded(tmp_path):
    """A 320 MiB checkpoint is verified with < 48 MiB of peak RSS growth (window 4 MiB: two
    windows in memory). Reading it whole, as verify did before, grows RSS by the checkpoint size."""
    size = 320 << 20
    try:
        distckpt.save({"x": torch.ones(4)}, tmp_path / "small")
        distckpt.save({f"w{i}": torch.full((size // 8 // 4,), float(i)) for i in range(8)}, tmp_path / "big")
        proc = _run("-c", _RSS_CHILD, str(tmp_path))
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["ok"] and out["bytes"] >= size
        assert out["growth_kib"] < 48 << 10, out
    finally:
        shutil.rmtree(tmp_path / "big", ignore_errors=True)


def test_verify_progress_bar_only_on_a_terminal(tmp_path):
    ck = tmp_path / "ck"
    distckpt.save({"w": torch.ones(1 << 20)}, ck)
    piped = _run("-m", "distckpt", "verify", str(ck))
    assert piped.returncode == 0 and "verify:" not in piped.stderr and "%|" not in piped.stderr
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal has a size
    try:
        proc = subprocess.run([PY, "-m", "distckpt", "verify", str(ck)], stdout=subprocess.PIPE,
                              stderr=follower, timeout=120, env=os.environ)
        os.close(follower)
        follower = -1
        chunks = []
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's other end is closed
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    assert proc.returncode == 0
    tty_err = b"".join(chunks).decode(errors="replace")
    assert "verify:" in tty_err and "100%" in tty_err  # tqdm drew (and finished) its bar


# --------------------------------------------------------------------------------------------
# sizes: one convention


def test_sizes_binary_everywhere():
    assert parse_size("60G") == parse_size("60GiB") == 60 << 30
    assert parse_size("512M") == 512 << 20 and parse_size("4096") == 4096 and parse_size("1.5K") == 1536
    for ambiguous in ("60GB", "1 MB", "2kB"):
        with pytest.raises(ValueError, match="ambiguous"):
            parse_size(ambiguous)
    assert format_bytes(60 << 30) == "60.0 GiB" and format_bytes(1536) == "1.5 KiB" and format_bytes(12) == "12 B"
    args = cli.build_parser().parse_args(["preflight", "/tmp", "--expected-bytes", "60G"])
    assert args.expected_bytes == 60 << 30
    assert config.load_config({"DISTCKPT_BLOCK_SIZE": "8M", "DISTCKPT_CHECKSUM_BLOCK": "64KiB"}).block_size == 8 << 20
    assert config.load_config({"DISTCKPT_CHECKSUM_BLOCK": "64KiB"}).checksum_block == 64 << 10
    assert config.load_config({"DISTCKPT_BLOCK_SIZE": "1048576"}).block_size == 1 << 20
    with pytest.raises(distckpt.errors.ConfigError, match="ambiguous"):
        config.load_config({"DISTCKPT_BLOCK_SIZE": "8MB"})
    proc = _run("-m", "distckpt", "preflight", "/tmp", "--expected-bytes", "60GB")
    assert proc.returncode == 2 and "ambiguous" in proc.stderr


def test_unknown_variable_is_warned_once_with_the_closest_name(monkeypatch):
    monkeypatch.setattr(config, "_warned", set())
    env = {"DISTCKPT_IO_BAKCEND": "pwrite", "DISTCKPT_QUEUE_DEPTH": "4"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config.load_config(env)
        config.load_config(env)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "DISTCKPT_IO_BAKCEND" in messages[0] and "DISTCKPT_IO_BACKEND" in messages[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config.load_config({"DISTCKPT_QUEUE_DEPTH": "4", "DISTCKPT_VENV": "/x", "DISTCKPT_STAGING_POOL_BYTES": "0",
                            "DISTCKPT_ARRIVAL_TIMEOUT_S": "5", "DISTCKPT_STAGE_BLOCK": "1M",
                            "DISTCKPT_STAGE_BLOCKS": "3"})
    assert caught == []


def test_staging_ring_config():
    """The writer's staging ring is its own setting (default 4 x 2 MiB), bounded by the request size
    and the queue depth; its defaults follow smaller ones."""
    cfg = config.load_config({})
    assert (cfg.stage_block, cfg.stage_blocks, cfg.block_size) == (2 << 20, 4, 4 << 20)
    small = config.load_config({"DISTCKPT_BLOCK_SIZE": "1M", "DISTCKPT_QUEUE_DEPTH": "2"})
    assert (small.stage_block, small.stage_blocks) == (1 << 20, 3)
    for env in ({"DISTCKPT_STAGE_BLOCK": "8M"}, {"DISTCKPT_STAGE_BLOCK": "3M"}, {"DISTCKPT_STAGE_BLOCKS": "1"},
                {"DISTCKPT_STAGE_BLOCKS": "10"}):
        with pytest.raises(distckpt.errors.ConfigError):
            config.load_config(env)


def test_ls_of_a_root_with_a_step_it_cannot_read_exits_3(tmp_path, monkeypatch, capsys):
    """A step whose MANIFEST read failed for a reason other than its content (a request that timed
    out, a refusal) is listed `unreadable`: the listing is incomplete, and ls exited 0 all the
    same (an outside trial, on an object store). It exits 3 now, as verify does for NOT
    VERIFIED; 0 once every step reads."""
    import torch

    from distckpt import cli, errors
    from distckpt.storage.posix.store import PosixStore
    root = tmp_path / "root"
    for step in (1, 2):
        distckpt.save({"w": torch.ones(2) * step}, root / f"step_{step:08d}")
    real = PosixStore.manifest_bytes

    def stalled(self, path):
        if path.endswith("step_00000002"):
            raise errors.StorageIOError("read of the MANIFEST timed out", path=path)
        return real(self, path)

    monkeypatch.setattr(PosixStore, "manifest_bytes", stalled)
    assert cli.main(["ls", str(root)]) == 3
    assert "unreadable" in capsys.readouterr().out
    assert cli.main(["ls", "--json", str(root)]) == 3
    monkeypatch.undo()
    assert cli.main(["ls", str(root)]) == 0


def test_ls_of_one_delta_link_names_a_broken_chain(tmp_path, capsys):
    """`distckpt ls ROOT/step_N` of a delta whose parent was deleted by hand said `committed`
    (exit 0, problem null in --json) while `ls ROOT` named the break and load raised
    ChainBrokenError (an outside trial). The one-checkpoint listing walks its chain too."""
    import shutil

    import torch

    from distckpt import cli
    from distckpt.incremental import IncrementalPolicy, IncrementalSaver
    sd = {"w": torch.randn(64, 4, generator=torch.Generator().manual_seed(0))}
    saver = IncrementalSaver(IncrementalPolicy(rows={"w": 0}, max_delta_fraction=1.0, max_chain_fraction=100.0))
    for step in range(3):
        sd["w"][step] += 1
        saver.save(sd, tmp_path / f"step_{step:08d}")
    assert cli.main(["ls", str(tmp_path / "step_00000002")]) == 0
    assert "broken" not in capsys.readouterr().out
    shutil.rmtree(tmp_path / "step_00000001")
    cli.main(["ls", "--json", str(tmp_path / "step_00000002")])
    listed = json.loads(capsys.readouterr().out)
    assert "chain is broken" in listed["entries"][0]["problem"], listed
