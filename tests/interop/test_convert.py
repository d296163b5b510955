"""distckpt.convert: to DCP (read back by dcp.load), torch.save format (torch.load weights_only),
Hugging Face safetensors (transformers from_pretrained), DCP -> distckpt; bounded memory."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import distckpt
from distckpt.convert import _slices, convert, parse_size
from distckpt.errors import CheckpointExistsError

from ..helpers.faults import mounts  # noqa: F401  (a fixture)


def _state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {
        "model": {"w": torch.randn(33, 17, generator=g), "h": torch.randn(9, 5, generator=g).to(torch.bfloat16),
                  "ids": torch.randint(0, 1000, (13,), generator=g), "s": torch.tensor(1.5),
                  "f8": torch.randn(6, 4, generator=g).to(torch.float8_e4m3fn)},
        "optim": {"step": 12, "groups": [{"lr": 0.01, "name": "a"}, {"lr": 0.02, "name": "b"}]},
        "pair": (torch.arange(4), 3),
    }


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.contiguous().view(torch.uint8) if a.dim() else a.view(1).view(torch.uint8),
                           b.contiguous().view(torch.uint8) if b.dim() else b.view(1).view(torch.uint8))
    elif isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b and type(a) is type(b)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("src") / "ckpt")
    distckpt.save(_state(), path)
    return path


def test_slices_tile_row_major():
    for shape in [(33, 17), (5,), (), (3, 4, 5), (2, 0, 3), (1, 1000)]:
        covered = torch.zeros(shape, dtype=torch.int32)
        flat_order = []
        for offsets, sizes in _slices(shape, 4, 40):
            assert all(o + s <= n for o, s, n in zip(offsets, sizes, shape))
            assert max(1, torch.Size(sizes).numel()) * 4 <= max(40, 4)
            idx = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            covered[idx] += 1
            flat_order.append(sum(o * st for o, st in zip(offsets, torch.empty(shape).stride())))
        assert bool((covered == 1).all())
        assert flat_order == sorted(flat_order)


def test_slices_in_a_stored_order_are_contiguous_runs_of_that_layout():
    """With ``order`` (a DCP chunk's dims outermost first), each slice is one contiguous byte run
    of the layout whose strides fall in that order, and the slices tile the shape in that order:
    a convert reads each byte of a transposed or channels_last tensor once, not once per
    row-major slice (review: 16x the bytes at --memory-limit 64M for a 256 MiB tensor)."""
    import itertools

    from distckpt.plan import Box, byte_range

    for shape in [(6, 5), (3, 4, 5), (2, 3, 4, 5), (7,), (4, 1, 3)]:
        for order in itertools.permutations(range(len(shape))):
            strides = [0] * len(shape)
            step = 1
            for d in reversed(order):
                strides[d], step = step, step * shape[d]
            covered = torch.zeros(shape, dtype=torch.int32)
            starts = []
            for offsets, sizes in _slices(shape, 4, 24, order):
                start, end = byte_range(Box.full(shape), Box(offsets, sizes), 4, strides)
                assert end - start == torch.Size(sizes).numel() * 4, (shape, order, offsets, sizes)
                covered[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))] += 1
                starts.append(start)
            assert bool((covered == 1).all()) and starts == sorted(starts), (shape, order)


def test_a_transposed_dcp_tensor_converts_exactly_in_small_slices(tmp_path):
    import torch.distributed.checkpoint as dcp

    w = torch.randn(1024, 768).t()  # 3 MiB, stored column-major by DCP
    c = torch.randn(8, 64, 32, 32).to(memory_format=torch.channels_last)  # 2 MiB, NHWC
    src = str(tmp_path / "dcp")
    dcp.save({"w": w, "c": c}, checkpoint_id=src, no_dist=True)
    dst = str(tmp_path / "dc")
    convert(src, dst, to="distckpt", memory_limit=1 << 20)  # 256 KiB slices: 12 of w, 8 of c
    got = distckpt.read(dst)
    assert torch.equal(got["w"], w) and torch.equal(got["c"], c)


def test_parse_size():
    assert parse_size("5GiB") == 5 << 30 and parse_size("100K") == 100 << 10 and parse_size("4096") == 4096
    with pytest.raises(ValueError, match="ambiguous"):  # one convention: binary units (distckpt.sizes)
        parse_size("100KB")
    with pytest.raises(ValueError):
        parse_size("5 parsecs")


def test_to_torch_loads_with_weights_only(src, tmp_path):
    dst = str(tmp_path / "model.pt")
    res = convert(src, dst, to="torch", memory_limit=1 << 20)
    assert res.files == [dst] and not res.skipped
    _same(_state(), torch.load(dst, weights_only=True))
    _same(_state()["model"], torch.load(dst, weights_only=True, mmap=True)["model"])  # 64-byte aligned records
    with pytest.raises(CheckpointExistsError):
        convert(src, dst, to="torch")


def test_to_dcp_loads_with_dcp_load(src, tmp_path):
    import torch.distributed.checkpoint as dcp

    dst = str(tmp_path / "dcp")
    # a 1 MiB limit slices into 256 KiB pieces; 4 KiB forces "w" (2244 bytes) into one chunk per
    # 60 rows... use a tiny limit through the internal slice size to get several chunks
    convert(src, dst, to="dcp", memory_limit=1 << 20)
    want = _state()
    target = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()},
              "optim": {"step": 0, "groups": [{"lr": 0.0, "name": ""}, {"lr": 0.0, "name": ""}]},
              "pair": (torch.zeros(4, dtype=torch.int64), 0)}
    dcp.load(target, checkpoint_id=dst, no_dist=True)
    _same(want["model"], target["model"])
    assert target["optim"] == want["optim"]
    # and distckpt reads its own export back
    _same(want, distckpt.read(dst))


def test_to_dcp_splits_large_tensors_into_chunks(tmp_path):
    import torch.distributed.checkpoint as dcp
    import distckpt.convert as cv

    src = str(tmp_path / "src")
    big = torch.randn(300, 1000)  # 1.2 MB, more than a quarter of a 1 MiB limit
    distckpt.save({"big": big}, src)
    dst = str(tmp_path / "dcp")
    cv.convert(src, dst, to="dcp", memory_limit=1 << 20)
    md = dcp.FileSystemReader(dst).read_metadata()
    assert len(md.state_dict_metadata["big"].chunks) == 5  # 65 rows (260 kB) each
    out = {"big": torch.zeros(300, 1000)}
    dcp.load(out, checkpoint_id=dst, no_dist=True)
    assert torch.equal(out["big"], big)


def test_dcp_to_distckpt(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"model": {k: v for k, v in _state()["model"].items()}, "step": 5}
    src = str(tmp_path / "dcp")
    dcp.save(state, checkpoint_id=src, no_dist=True)
    dst = str(tmp_path / "dc")
    convert(src, dst, to="distckpt", memory_limit=1 << 20)
    assert os.path.exists(os.path.join(dst, "MANIFEST"))
    _same(state, distckpt.read(dst))
    assert distckpt.read_manifest(dst)["checksum_algo"] == "crc32c"


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def test_to_safetensors_from_pretrained_bit_exact(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _tiny_llama()
    src = str(tmp_path / "ckpt")
    distckpt.save({"model": model.state_dict(), "step": 3}, src)
    dst = str(tmp_path / "hf")
    res = convert(src, dst, to="safetensors", prefix="model.", max_shard_size=20_000, memory_limit=1 << 20)
    assert res.skipped == {"step": "not a tensor (safetensors holds tensors only)"}
    index = json.load(open(os.path.join(dst, "model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    for s in shards:  # the cap holds unless one tensor alone is larger
        from safetensors import safe_open
        with safe_open(os.path.join(dst, s), framework="pt") as f:
            sizes = [f.get_tensor(k).nbytes for k in f.keys()]
        assert sum(sizes) <= 20_000 or len(sizes) == 1
    assert set(index["weight_map"]) == set(model.state_dict())
    model.config.save_pretrained(dst)
    loaded = AutoModelForCausalLM.from_pretrained(dst)
    want, got = model.state_dict(), loaded.state_dict()
    assert set(want) == set(got)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k

    bf = str(tmp_path / "hf_bf16")
    convert(src, bf, to="safetensors", prefix="model.", dtype="bf16")
    from safetensors.torch import load_file
    got = load_file(os.path.join(bf, "model.safetensors"))
    for k, v in want.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.to(torch.bfloat16)), k


def test_cli_convert(src, tmp_path, capsys):
    from distckpt.cli import main

    dst = str(tmp_path / "cli.pt")
    assert main(["convert", src, dst, "--to", "torch", "--memory-limit", "16MiB"]) == 0
    out, err = capsys.readouterr()
    assert "tensors" in out and err == ""  # no progress bar when stderr is not a terminal
    _same(_state(), torch.load(dst, weights_only=True))
    with pytest.raises(SystemExit):  # bad usage: argparse exits 2
        main(["convert", src, str(tmp_path / "x"), "--to", "nope"])
    assert main(["convert", src, str(tmp_path / "x"), "--to", "dcp", "--prefix", "model."]) == 2
    assert "safetensors only" in capsys.readouterr().err and not os.path.exists(tmp_path / "x")
    # Through the API a bad option is a ConfigError (a ValueError, and one of distckpt's typed
    # errors: it was a bare ValueError).
    from distckpt.convert import convert
    from distckpt.errors import ConfigError
    for bad in ({"to": "onnx"}, {"to": "torch", "dtype": "bf16"}, {"to": "safetensors", "dtype": "int8"},
                {"to": "torch", "memory_limit": 1}):
        with pytest.raises(ConfigError):
            convert(src, str(tmp_path / "x"), **bad)
    assert not os.path.exists(tmp_path / "x")
    # A MANIFEST file stands for its directory, as in inspect and verify (it used to be refused
    # with a misleading "cannot be created there" StorageError).
    dst = str(tmp_path / "from_manifest.pt")
    assert main(["convert", os.path.join(src, "MANIFEST"), dst, "--to", "torch"]) == 0, capsys.readouterr().err
    _same(_state(), torch.load(dst, weights_only=True))


def test_progress_bar_on_a_terminal(src, tmp_path, monkeypatch):
    """stderr on a pseudo-terminal: tqdm draws its bar (and not when it is not a tty: test above)."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    os.set_blocking(master, False)
    with os.fdopen(slave, "w") as tty:
        monkeypatch.setattr(sys, "stderr", tty)
        convert(src, str(tmp_path / "p.pt"), to="torch")
        tty.flush()
        # The pty hands the bytes over asynchronously: read until the final bar arrived (or 10 s).
        drawn, deadline = b"", time.monotonic() + 10
        while b"100%" not in drawn and time.monotonic() < deadline:
            try:
                drawn += os.read(master, 1 << 16)
            except BlockingIOError:
                time.sleep(0.02)
    os.close(master)
    assert b"100%" in drawn and b"-> torch" in drawn, drawn[-300:]


def test_failed_conversion_leaves_nothing(tmp_path):
    src = str(tmp_path / "src")
    distckpt.save({"a": torch.ones(3), "b": torch.ones(1000)}, src)
    data = os.path.join(src, "rank00000.bin")
    os.truncate(data, os.path.getsize(data) - 100)  # "b" is cut short: found only once writing
    from distckpt.errors import DataFileTruncatedError
    for to, dst in (("safetensors", tmp_path / "st"), ("torch", tmp_path / "t.pt"), ("dcp", tmp_path / "d")):
        with pytest.raises(DataFileTruncatedError):
            convert(src, str(dst), to=to)
        assert not os.path.exists(dst) and not os.path.exists(str(dst) + ".tmp"), to


def test_safetensors_dtypes_round_trip_and_a_reserved_name_is_refused(tmp_path):
    """Every dtype the safetensors format and library hold (the fnuz float8s included: a valid
    file of them was called damaged) reads back bit-exact, and converts back to safetensors as
    safetensors' own load_file reads it; a tensor named __metadata__ (the header's reserved
    entry, a file load_file refuses) is an UnsupportedValueError before anything is written."""
    from safetensors.torch import load_file, save_file

    from distckpt.errors import UnsupportedValueError
    from distckpt.hf import ST_DTYPES

    src = tmp_path / "hf"
    src.mkdir()
    sd = {name: torch.randn(5).to(getattr(torch, dtype)) if getattr(torch, dtype).is_floating_point
          else torch.arange(5).to(getattr(torch, dtype)) for name, dtype in ST_DTYPES.items()}
    save_file(sd, str(src / "model.safetensors"))
    got = distckpt.read(str(src))
    assert sorted(got) == sorted(sd)
    for k, v in sd.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k
    convert(str(src), str(tmp_path / "back"), to="safetensors")
    back = {}
    for f in sorted(os.listdir(tmp_path / "back")):
        if f.endswith(".safetensors"):
            back.update(load_file(str(tmp_path / "back" / f)))
    assert sorted(back) == sorted(sd) and all(torch.equal(back[k].view(torch.uint8), v.view(torch.uint8))
                                              for k, v in sd.items())
    reserved = str(tmp_path / "reserved")
    distckpt.save({"__metadata__": torch.ones(2), "w": torch.ones(3)}, reserved)
    with pytest.raises(UnsupportedValueError, match="__metadata__"):
        convert(reserved, str(tmp_path / "st"), to="safetensors")
    assert not os.path.exists(tmp_path / "st")


@pytest.mark.parametrize("to", ["torch", "safetensors", "dcp"])
def test_output_appears_whole_and_a_killed_runs_leftover_is_cleared(src, tmp_path, monkeypatch, to):
    """Output is written in the work directory DST.tmp and renamed into place complete (a
    conversion killed half-way left a partial DST that a rerun refused as existing); what a killed
    run left there (its marker file says so) is removed by the next conversion to DST."""
    import distckpt.convert as conv
    dst = str(tmp_path / "out")
    os.makedirs(dst + ".tmp")
    open(os.path.join(dst + ".tmp", conv._WORK_MARK), "w").close()
    open(os.path.join(dst + ".tmp", "model-00001-of-00002.safetensors"), "wb").close()  # half-written
    seen = {}
    real = conv._publish

    def publish(work, final):
        seen["before"] = os.path.exists(final)
        real(work, final)

    monkeypatch.setattr(conv, "_publish", publish)
    res = convert(src, dst, to=to)
    assert os.path.exists(dst) and not os.path.exists(dst + ".tmp")
    assert seen == {"before": False}  # nothing under DST until the output was complete
    if to != "torch":
        assert conv._WORK_MARK not in os.listdir(dst) and sorted(res.files) == sorted(
            os.path.join(dst, f) for f in os.listdir(dst))


@pytest.mark.parametrize("to", ["torch", "safetensors"])
def test_what_is_at_the_work_path_and_is_no_conversions_is_never_removed(tmp_path, to):
    """An outside trial: convert removed whatever was at DST.tmp as "left by a conversion that did
    not finish": a user's directory there, and the source itself when named DST.tmp (`distckpt
    convert /x/llama.tmp /x/llama`), which then failed blaming the checkpoint it had deleted. Only a
    work directory carrying a conversion's marker is removed now; anything else is
    CheckpointExistsError (the source: ConfigError), and nothing is touched."""
    from distckpt.errors import CheckpointExistsError, ConfigError
    import safetensors.torch as st
    user = tmp_path / "export.tmp"
    user.mkdir()
    (user / "notes.txt").write_text("precious")
    ck = str(tmp_path / "ck")
    distckpt.save({"w": torch.ones(2)}, ck, no_dist=True)
    with pytest.raises(CheckpointExistsError, match="lacks"):
        convert(ck, str(tmp_path / "export"), to=to)
    assert (user / "notes.txt").read_text() == "precious" and not (tmp_path / "export").exists()
    (tmp_path / "file.tmp").write_text("a file")
    with pytest.raises(CheckpointExistsError):
        convert(ck, str(tmp_path / "file"), to=to)
    assert (tmp_path / "file.tmp").read_text() == "a file"
    source = tmp_path / "llama.tmp"
    source.mkdir()
    st.save_file({"w": torch.ones(3)}, str(source / "model.safetensors"))
    with pytest.raises(ConfigError, match="work path"):
        convert(str(source), str(tmp_path / "llama"), to=to)
    assert torch.equal(st.load_file(str(source / "model.safetensors"))["w"], torch.ones(3))


@pytest.mark.parametrize("to", ["torch", "safetensors", "dcp", "distckpt"])
def test_a_destination_without_room_or_read_only_is_a_typed_error(tmp_path, mounts, to):
    """A destination that cannot hold the output is DiskFullError before a byte is written
    (``--to distckpt`` needs twice the tensor bytes: its scratch copy; before, a sparse scratch
    mapping died of SIGBUS when the disk filled, and torch's zip writer said "unexpected pos"); a
    read-only one is StoragePermissionError, not a bare OSError. Nothing is left behind."""
    from distckpt.errors import DiskFullError, StoragePermissionError
    src = str(tmp_path / "src")
    distckpt.save({"model": {f"t{i}": torch.randn(1 << 19) for i in range(4)}}, src)  # 8 MiB of tensors
    small = mounts.tmpfs(tmp_path / "small", size="12m" if to == "distckpt" else "6m")
    with pytest.raises(DiskFullError) as ei:
        convert(src, str(small / "out"), to=to)
    assert ei.value.details["needed"] == (16 << 20 if to == "distckpt" else 8 << 20)
    assert os.listdir(small) == []
    ro = mounts.tmpfs(tmp_path / "ro", size="32m", readonly=True)
    with pytest.raises(StoragePermissionError):
        convert(src, str(ro / "out"), to=to)
    if to == "safetensors":  # what it writes counts: one tensor of the four, cast to bf16, fits
        res = convert(src, str(small / "out"), to=to, prefix="model.t0", dtype="bf16")
        assert res.bytes >= 1 << 20 and len(os.listdir(small / "out")) == 1


def test_convert_module_has_no_heavy_top_level_import():
    """cli.py imports distckpt.convert for its add_parser: torch, numpy, safetensors and tqdm are
    imported inside the functions that need them, never at module level."""
    import ast

    import distckpt.convert as cv
    tree = ast.parse(open(cv.__file__).read())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top for a in n.names] + [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not any(x.split(".")[0] in ("torch", "numpy", "safetensors", "tqdm") for x in names), names


_RSS_SCRIPT = textwrap.dedent("""
    import json, os, sys, threading, time, torch
    import torch.distributed.checkpoint, safetensors  # imports are baseline, not conversion memory
    import distckpt
    from distckpt.convert import convert

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    src, out, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
    report = {}
    for to in ("safetensors", "torch", "dcp", "distckpt"):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        base = status("VmRSS")
        anon = [status("RssAnon")]
        done = threading.Event()

        def sample():  # RssAnon has no high-water mark of its own
            while not done.wait(0.02):
                anon.append(status("RssAnon"))

        th = threading.Thread(target=sample)
        th.start()
        convert(src, os.path.join(out, to), to=to, memory_limit=limit, progress=False)
        done.set()
        th.join()
        report[to] = {"base": base, "peak": status("VmHWM"), "anon_grew": max(anon) - anon[0]}
    print(json.dumps(report))
""")

_MAKE_SCRIPT = textwrap.dedent("""
    import sys, torch, distckpt
    # 256 MiB: one 128 MiB tensor (twice the 64 MiB bound: it must be sliced) and four of 32 MiB
    state = {"big": torch.arange(32 << 20, dtype=torch.float32)}
    for i in range(4):
        state[f"layer{i}"] = torch.full((8, 1 << 20), float(i))
    distckpt.save(state, sys.argv[1])
""")


def test_peak_memory_stays_under_the_bound(tmp_path):
    """A 256 MiB checkpoint converted with a 64 MiB limit: peak RSS above the baseline (after
    imports) stays under the limit for the exports (safetensors, torch, dcp); for --to distckpt,
    whose tensors sit in a memory-mapped temporary file (page cache, counted as RssFile), the
    anonymous memory does."""
    import shutil

    src, out = str(tmp_path / "big"), str(tmp_path / "out")
    os.makedirs(out)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    limit = 64 << 20
    try:
        subprocess.run([sys.executable, "-c", _MAKE_SCRIPT, src], check=True, env=env, timeout=300)
        proc = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, src, out, str(limit)], capture_output=True,
                              text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        for to, r in report.items():
            grew = r["peak"] - r["base"]
            print(f"{to}: peak RSS grew {grew >> 20} MiB, RssAnon grew {r['anon_grew'] >> 20} MiB (limit {limit >> 20} MiB)")
            assert r["anon_grew"] < limit, (to, r)
            if to != "distckpt":
                assert grew < limit, (to, r)
    finally:
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


_CONVERT_ALL = textwrap.dedent("""
    import os, sys
    from distckpt.convert import convert
    src, out = sys.argv[1], sys.argv[2]
    for to in ("safetensors", "torch", "dcp", "distckpt"):
        convert(src, os.path.join(out, to), to=to, memory_limit=1 << 20, progress=False)
""")


def test_conversion_sets_up_its_readers_once_not_per_tensor(tmp_path):
    """Converting 2N tensors sets up no more io_uring rings and registers no more buffers than
    converting N: each source file's reader (ring, registered slots) is opened once per
    conversion, not once per slice. Tensors of 512 KiB under a 1 MiB limit (slices of 256 KiB)
    make every slice its own read pass, so batching small tensors cannot hide a per-read set-up.
    Counted with strace over all four targets."""
    import shutil

    from distckpt.storage.posix import choose_backend

    if shutil.which("strace") is None:
        pytest.skip("strace is not installed (tests/run.sh installs it)")
    counts = {}
    for n in (4, 8):
        src, out = str(tmp_path / f"src{n}"), str(tmp_path / f"out{n}")
        os.makedirs(out)
        distckpt.save({f"w{i}": torch.full((128, 1024), float(i)) for i in range(n)}, src)
        if choose_backend(src, read_only=True).name != "uring":
            pytest.skip("io_uring reads are not available here: nothing to count")
        log = str(tmp_path / f"strace{n}.log")
        proc = subprocess.run(["strace", "-f", "--seccomp-bpf", "-qq", "-o", log, "-e", "trace=io_uring_setup,io_uring_register",
                               sys.executable, "-c", _CONVERT_ALL, src, out], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0 and "ptrace" in proc.stderr and "Operation not permitted" in proc.stderr:
            pytest.skip("strace cannot trace here (ptrace refused)")
        assert proc.returncode == 0, proc.stderr[-2000:]
        text = open(log).read()
        counts[n] = (text.count("io_uring_setup("), text.count("io_uring_register("))
        assert torch.equal(distckpt.read(os.path.join(out, "distckpt"))["w7" if n == 8 else "w3"],
                           torch.full((128, 1024), float(n - 1)))
    print(f"io_uring_setup, io_uring_register calls: 4 tensors {counts[4]}, 8 tensors {counts[8]}")
    assert counts[4][0] > 0, "the conversion read through io_uring"
    assert counts[8] == counts[4], counts


class _Pair(__import__("collections").namedtuple("_Pair", "a b")):
    """A namedtuple: saved by distckpt as a typed value, refused by torch.load(weights_only=True)."""


def test_to_torch_checks_weights_only_only_where_it_can_fail(src, tmp_path, monkeypatch):
    """Plain structures (dicts, lists, tuples, str/int/float/bool/None, tensors) are exported
    without loading the file back (weights_only accepts them by construction); anything else is
    still loaded back with torch.load(weights_only=True), and refused with a typed error."""
    import distckpt.convert as C
    from distckpt.errors import UnsupportedValueError

    calls = []
    real = C._check_weights_only
    monkeypatch.setattr(C, "_check_weights_only", lambda *a: (calls.append(a), real(*a)))
    dst = str(tmp_path / "plain.pt")
    convert(src, dst, to="torch")
    assert calls == []
    _same(_state(), torch.load(dst, weights_only=True))

    odd = str(tmp_path / "odd")
    distckpt.save({"w": torch.ones(3), "pair": _Pair(1, "x")}, odd)
    with pytest.raises(UnsupportedValueError, match="weights_only"):
        convert(odd, str(tmp_path / "odd.pt"), to="torch")
    assert len(calls) == 1 and not os.path.exists(str(tmp_path / "odd.pt"))


def test_to_distckpt_leaves_no_descriptor_or_mapping_of_its_scratch_file(src, tmp_path):
    """The scratch file is unlinked at once; what it held must go when convert returns, not at
    the cyclic garbage collector's next run: a numpy memmap kept a dup of its descriptor and
    flatten's self-referencing closure kept every view (one fd and the tensors' bytes of disk
    space per conversion). Checked with the collector off."""
    import gc

    from tests.helpers.io_helpers import open_paths

    def held():
        fds = open_paths()
        with open("/proc/self/maps") as f:
            maps = f.read()
        return sum(".distckpt-convert-" in t for t in fds), maps.count(".distckpt-convert-")

    gc.collect()
    gc.disable()
    try:
        for i in range(2):
            convert(src, str(tmp_path / f"out{i}"), to="distckpt", progress=False)
            assert held() == (0, 0)
    finally:
        gc.enable()
    assert torch.equal(distckpt.read(tmp_path / "out1")["model"]["w"], distckpt.read(src)["model"]["w"])


def test_to_dcp_of_a_tree_that_misplaces_a_tensor_is_manifest_corrupt(tmp_path):
    """A MANIFEST (checksum correct) whose tree puts tensor 'model.u8' under the keys model.x:
    read() and load() would disagree on its key, and convert --to dcp died with a bare KeyError.
    A typed ManifestCorruptError, and no output."""
    import dataclasses

    from distckpt import manifest as mf
    from distckpt.errors import ManifestCorruptError
    from distckpt.storage.posix.manifests import load_manifest
    path = str(tmp_path / "ck")
    distckpt.save({"model": {"u8": torch.arange(4, dtype=torch.uint8)}}, path)
    m = load_manifest(path)
    tree = {"t": "dict", "k": [["model", {"t": "dict", "k": [["x", {"t": "ref", "fqn": "model.u8"}]]}]]}
    with open(os.path.join(path, "MANIFEST"), "wb") as f:
        f.write(mf.encode(dataclasses.replace(m, tree=tree)))
    with pytest.raises(ManifestCorruptError, match="'model.u8' under the keys 'model.x'"):
        convert(path, str(tmp_path / "out"), to="dcp", progress=False)
    assert not os.path.exists(tmp_path / "out")


def test_a_checkpoint_written_through_dcp_converts_with_its_values(tmp_path):
    """dcp.save through DistCkptStorageWriter stores each value as DCP's torch.save bytes: convert
    decodes them as load() does (it wrote those bytes out as the values, a silent difference)."""
    import torch.distributed.checkpoint as dcp

    from distckpt.integrations.dcp import DistCkptStorageWriter

    def state():
        return {"w": torch.arange(6.0).view(2, 3), "step": 7, "lr": 0.5, "name": "x"}

    src = str(tmp_path / "ck")
    dcp.save(state(), storage_writer=DistCkptStorageWriter(src), no_dist=True)
    convert(src, str(tmp_path / "out.pt"), to="torch", progress=False)
    _same(state(), torch.load(str(tmp_path / "out.pt"), weights_only=True))
    convert(src, str(tmp_path / "out_d"), to="distckpt", progress=False)
    _same(state(), distckpt.read(str(tmp_path / "out_d")))
    convert(src, str(tmp_path / "out_dcp"), to="dcp", progress=False)
    back = {"w": torch.zeros(2, 3), "step": 0, "lr": 0.0, "name": ""}
    dcp.load(back, checkpoint_id=str(tmp_path / "out_dcp"), no_dist=True)
    _same(state(), back)


def test_cli_convert_rebuilds_user_classes_only_with_import(tmp_path):
    """A value of the user's own Enum / namedtuple / dataclass: a fresh `distckpt convert` process
    has not imported its module and distckpt imports nothing a checkpoint names, so the error
    names the key and the option to follow; `--import MODULE` imports it, by the user's word."""
    (tmp_path / "mymod.py").write_text(textwrap.dedent("""\
        import collections, dataclasses, enum
        class Color(enum.Enum):
            RED = 1
        P = collections.namedtuple("P", "a b")
        @dataclasses.dataclass
        class D:
            x: int = 1
    """))

    def run(*args):
        return subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)

    save = ("import torch, distckpt, mymod; distckpt.save({'w': torch.ones(2), 'c': mymod.Color.RED, "
            "'p': mymod.P(1, 2), 'd': mymod.D(3)}, 'ck', no_dist=True)")
    assert run("-c", save).returncode == 0
    r = run("-m", "distckpt", "convert", "ck", "out", "--to", "distckpt", "--no-progress")
    assert r.returncode == 1 and "UnsupportedValueError" in r.stderr, r.stderr
    assert "value at 'c'" in r.stderr and "distckpt convert --import mymod" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
    # the installed command (no current directory on its sys.path) finds it as `python -m` does
    cli = os.path.join(os.path.dirname(sys.executable), "distckpt")
    r = subprocess.run([cli, "convert", "ck", "out", "--to", "distckpt", "--import", "mymod", "--no-progress"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    check = ("import distckpt, mymod; v = distckpt.read('out'); "
             "assert (v['c'], v['p'], v['d']) == (mymod.Color.RED, mymod.P(1, 2), mymod.D(3)), v")
    assert run("-c", check).returncode == 0
    # torch.load(weights_only=True) refuses the user's classes: a typed error naming the global
    r = run("-m", "distckpt", "convert", "ck", "out.pt", "--to", "torch", "--import", "mymod", "--no-progress")
    assert r.returncode == 1 and "mymod.Color" in r.stderr and "add_safe_globals" in r.stderr, r.stderr
    assert not (tmp_path / "out.pt").exists()
    r = run("-m", "distckpt", "convert", "ck", "out2", "--to", "distckpt", "--import", "no_such_mod_x")
    assert r.returncode == 2 and "--import no_such_mod_x: ModuleNotFoundError" in r.stderr, r.stderr


def test_a_url_source_or_destination_is_refused_and_a_file_url_is_a_local_path(tmp_path, monkeypatch):
    """convert made an s3:// destination a local path (abspath: "./s3:/bucket/x"), wrote the
    safetensors there and exited 0 (an outside trial). A URL is a ConfigError now, before anything
    is read or written; a file:// URL is the local path it names."""
    from distckpt.convert import convert
    from distckpt.errors import ConfigError
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "src"
    distckpt.save({"w": torch.arange(6.0)}, src)
    for s, d in ((str(src), "s3://bucket/x"), ("s3://bucket/src", str(tmp_path / "out"))):
        with pytest.raises(ConfigError, match="is a URL"):
            convert(s, d, to="safetensors")
    assert sorted(os.listdir(tmp_path)) == ["src"]
    convert(f"file://{src}", f"file://{tmp_path}/out", to="safetensors")
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]


def test_the_sources_metadata_is_carried_or_listed_as_skipped(tmp_path):
    """A safetensors source's ``__metadata__`` (a quantization note, say) and a distckpt source's
    user metadata were dropped by every target, and listed nowhere (an outside trial). Now a
    safetensors output carries the string entries (its "format" is "pt"), a distckpt output the
    whole, and torch / dcp outputs, which have no place for it, list each entry as skipped; so
    does a safetensors output for an entry that is no string, and for one the source's shards
    disagree on."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"a": torch.ones(2)}, str(hf / "s1.safetensors"), metadata={"format": "pt", "quant": "awq-4bit"})
    save_file({"b": torch.zeros(2)}, str(hf / "s2.safetensors"), metadata={"format": "pt", "quant": "gptq",
                                                                          "note": "keep"})
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "s1.safetensors",
                                                                                "b": "s2.safetensors"}}))
    res = convert(str(hf), str(tmp_path / "st"), to="safetensors", progress=False)
    with safe_open(str(tmp_path / "st" / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt", "quant": "awq-4bit", "note": "keep"}
    # "quant" differs between the files; "note" only one of them has
    assert sorted(res.skipped) == ["(metadata) safetensors_metadata.note", "(metadata) safetensors_metadata.quant"]
    assert all("disagree" in why for why in res.skipped.values()), res.skipped
    res = convert(str(hf), str(tmp_path / "dc"), to="distckpt", progress=False)
    assert distckpt.read_manifest(str(tmp_path / "dc"))["meta"]["user"] == {
        "safetensors_metadata": {"format": "pt", "quant": "awq-4bit", "note": "keep"}}
    # ... and back: the distckpt copy's record becomes the safetensors output's metadata again
    convert(str(tmp_path / "dc"), str(tmp_path / "st2"), to="safetensors", progress=False)
    with safe_open(str(tmp_path / "st2" / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt", "quant": "awq-4bit", "note": "keep"}
    for to in ("torch", "dcp"):
        res = convert(str(hf), str(tmp_path / to), to=to, progress=False)
        assert list(res.skipped) == ["(metadata) safetensors_metadata"], res.skipped
    mine = tmp_path / "mine"
    distckpt.save({"w": torch.ones(2)}, str(mine), metadata={"run": "r7", "step": 5}, no_dist=True)
    res = convert(str(mine), str(tmp_path / "mine_st"), to="safetensors", progress=False)
    with safe_open(str(tmp_path / "mine_st" / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt", "run": "r7"}
    assert list(res.skipped) == ["(metadata) step"]
    convert(str(mine), str(tmp_path / "mine_dc"), to="distckpt", progress=False)
    assert distckpt.read_manifest(str(tmp_path / "mine_dc"))["meta"]["user"] == {"run": "r7", "step": 5}
    res = convert(str(mine), str(tmp_path / "mine.pt"), to="torch", progress=False)
    assert sorted(res.skipped) == ["(metadata) run", "(metadata) step"]


def test_bad_dtype_and_shard_size_options_are_config_errors(src, tmp_path):
    """--dtype bogus said "unknown dtype in MANIFEST ... restore from an older checkpoint" (exit 1);
    --max-shard-size 0 wrote a shard per tensor. Both are ConfigError now, before anything is written."""
    from distckpt.errors import ConfigError
    with pytest.raises(ConfigError, match="not a dtype name"):
        convert(src, str(tmp_path / "a"), to="safetensors", dtype="bogus")
    for bad in (0, -5):
        with pytest.raises(ConfigError, match="max_shard_size"):
            convert(src, str(tmp_path / "b"), to="safetensors", max_shard_size=bad)
    assert os.listdir(tmp_path) == []


def test_a_second_conversion_to_the_same_destination_never_takes_the_first_ones_work(tmp_path, src):
    """Two conversions to one DST: the second found the first's live DST.tmp, deleted it as a
    killed run's and wrote its own there; the first then published the second's half-written work
    as DST, reported success, and left DST partial once the second was stopped (an outside trial).
    The work directory's marker is flocked by its conversion while it lives: a second one is
    SaveInProgressError and touches nothing; a dead one's is removed; a work directory replaced
    under a conversion is never published."""
    import subprocess as sp

    import distckpt.convert as conv
    from distckpt.errors import SaveInProgressError
    dst = str(tmp_path / "out")
    first = conv._Work.claim(dst + ".tmp", src)
    open(os.path.join(first.path, "model.safetensors"), "wb").close()   # its output so far
    with pytest.raises(SaveInProgressError, match="another conversion"):
        convert(src, dst, to="safetensors", progress=False)
    assert sorted(os.listdir(first.path)) == [conv._WORK_MARK, "model.safetensors"] and not os.path.exists(dst)
    first.remove()
    assert not os.path.exists(dst + ".tmp")
    # A conversion killed mid-way (its process gone, its lock with it): the next one goes on.
    code = ("import sys, os; import distckpt.convert as c; w = c._Work.claim(sys.argv[1], sys.argv[2]); "
            "open(os.path.join(w.path, 'half'), 'wb').close(); os._exit(9)")
    assert sp.run([sys.executable, "-c", code, dst + ".tmp", src], timeout=120).returncode == 9
    assert os.path.exists(os.path.join(dst + ".tmp", "half"))
    res = convert(src, dst, to="safetensors", progress=False)
    assert os.path.isfile(os.path.join(dst, "model.safetensors")) and not os.path.exists(dst + ".tmp") and res.files
    # Replaced under a live conversion (removed by hand, recreated): not published, not removed.
    w = conv._Work.claim(str(tmp_path / "x.tmp"), src)
    import shutil
    shutil.rmtree(w.path)
    os.makedirs(w.path)
    open(os.path.join(w.path, conv._WORK_MARK), "w").close()
    with pytest.raises(SaveInProgressError, match="no longer this conversion's"):
        w.publish(str(tmp_path / "x"), None)
    w.remove()
    assert os.path.isdir(w.path) and not os.path.exists(tmp_path / "x")


@pytest.mark.parametrize("to", ["safetensors", "distckpt"])
def test_a_source_rewritten_during_the_conversion_publishes_nothing(tmp_path, monkeypatch, to):
    """A Hugging Face source replaced after its first tensor was converted: the output held one
    tensor of each version and convert reported success (an outside trial; read() of the same
    directory raised). The source's identity is compared before the output is published:
    CheckpointRemovedError, nothing under DST."""
    from safetensors.torch import save_file

    import distckpt.convert as conv
    from distckpt.errors import CheckpointRemovedError
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"a": torch.full((4,), 1.0), "b": torch.full((4,), 1.0)}, str(hf / "model.safetensors"))
    done = []

    def then_replace(real):
        def read(self, batch):
            out = real(self, batch)
            if not done:
                done.append(1)
                save_file({"a": torch.full((4,), 2.0), "b": torch.full((4,), 2.0)}, str(hf / "model.new"))
                os.replace(str(hf / "model.new"), str(hf / "model.safetensors"))
            return out
        return read

    for name in ("fill", "read_boxes"):   # (the targets read through one or the other)
        monkeypatch.setattr(conv._Source, name, then_replace(getattr(conv._Source, name)))
    real_copy = conv._RangeCopier.copy   # (or copy the Hugging Face source's ranges file to file)

    def copy_then_replace(self, *args):
        real_copy(self, *args)
        if not done:
            then_replace(lambda _self, _batch: None)(None, None)
    monkeypatch.setattr(conv._RangeCopier, "copy", copy_then_replace)
    with pytest.raises(CheckpointRemovedError, match="changed while it was being read"):
        convert(str(hf), str(tmp_path / "out"), to=to, progress=False, memory_limit=1 << 20)
    assert done and not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "out.tmp")


@pytest.mark.parametrize("to", ["safetensors", "torch"])
def test_many_batches_through_the_reused_read_buffers_convert_exactly(tmp_path, to, monkeypatch):
    """A conversion to a torch or safetensors file reads batches into two reused buffers, the next
    on a thread while this one is written (_Source.stream(reuse=True)): a view overwritten before
    it was written would put one tensor's bytes under another's name. A Hugging Face directory of
    tensors of many sizes (unaligned offsets in the file, runs above and below the size a cached
    run is read straight into its destination), a 4 MiB memory limit (batches of 512 KiB, a
    tensor cut into slices across batches): every tensor exactly as safetensors reads it."""
    from safetensors.torch import load_file, save_file
    g = torch.Generator().manual_seed(3)
    sizes = [(7,), (1000, 33), (64, 1024), (3, 5, 7), (300, 700), (17,), (2048, 513)]
    tensors = {f"t{i:02d}": torch.randn(sizes[i % len(sizes)], generator=g).to(
        [torch.float32, torch.bfloat16, torch.float16][i % 3]) for i in range(21)}
    src = tmp_path / "hf"
    src.mkdir()
    save_file(tensors, str(src / "model.safetensors"))
    want = load_file(str(src / "model.safetensors"))
    out = tmp_path / ("out.safetensors" if to == "safetensors" else "out.pt")
    import distckpt.convert as conv
    real = conv._bytes_of
    # Through the read buffers: not the file-to-file copy that a safetensors target takes of a
    # Hugging Face source's tensors (test_a_hugging_face_source_is_copied_range_by_range_...).
    monkeypatch.setattr(conv._Source, "raw_range", lambda self, fqn: None)

    def slow_writer(t):   # the reader thread runs ahead of every write: a buffer reused too early shows
        time.sleep(0.003)
        return real(t)
    monkeypatch.setattr(conv, "_bytes_of", slow_writer)
    convert(str(src), str(out), to=to, memory_limit=4 << 20, progress=False)
    got = load_file(str(out / "model.safetensors")) if to == "safetensors" else torch.load(str(out), weights_only=True)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k
    back = distckpt.read(str(src))   # the read path alone, from the page cache
    assert all(torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)) for k, v in want.items())


def _hf_two_shards(path) -> dict:
    """A Hugging Face directory of two safetensors files and an index; its tensors."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(5)
    tensors = {f"layer.{i}.w": torch.randn((37 * (i + 1), 129), generator=g).to(
        [torch.float32, torch.bfloat16, torch.float16][i % 3]) for i in range(6)}
    tensors["empty"] = torch.zeros((0, 4))
    path.mkdir()
    names = sorted(tensors)
    shards = {"a.safetensors": names[:4], "b.safetensors": names[4:]}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(path / fname))
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    return tensors


def _open_fds() -> set:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("kernel", ["copy_file_range", "pread-pwrite"])
def test_a_hugging_face_source_is_copied_range_by_range_exactly(tmp_path, monkeypatch, kernel):
    """HF -> safetensors copies each tensor kept in its dtype file to file in the kernel
    (copy_file_range): one copy fewer than a read and a write. Where the kernel cannot copy
    between the two files (EXDEV: another file system on an older kernel), the same ranges by
    pread and pwrite. Every tensor bit-exact, across shard boundaries of both sides; a cast
    tensor still goes through memory."""
    from safetensors.torch import load_file

    import distckpt.convert as conv
    want = _hf_two_shards(tmp_path / "hf")
    calls = []
    real = os.copy_file_range

    def spy(*args):
        calls.append(args[2])
        if kernel == "pread-pwrite":
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real(*args)
    monkeypatch.setattr(conv.os, "copy_file_range", spy)
    before = _open_fds()
    res = convert(str(tmp_path / "hf"), str(tmp_path / "out"), to="safetensors", max_shard_size=100_000,
                  memory_limit=1 << 20, progress=False)
    assert _open_fds() == before
    got = {}
    for f in res.files:
        if f.endswith(".safetensors"):
            got.update(load_file(f))
    assert len([f for f in res.files if f.endswith(".safetensors")]) > 2
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k
    assert len(calls) >= len([v for v in want.values() if v.numel()]), calls
    calls.clear()
    res = convert(str(tmp_path / "hf"), str(tmp_path / "cast"), to="safetensors", dtype="bf16", progress=False)
    got = load_file(res.files[0])
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.to(torch.bfloat16)) for k, v in want.items())
    assert len(calls) == len([v for v in want.values() if v.dtype == torch.bfloat16 and v.numel()]), calls


def test_a_hugging_face_source_that_shrinks_or_a_full_disk_mid_copy_is_typed_and_publishes_nothing(
        tmp_path, mounts, monkeypatch):
    """The source file cut short after its header was read: DataFileTruncatedError naming it
    (copy_file_range returns 0 at its end), not a short tensor in a published file. The
    destination filling up mid-copy (the pre-flight room check bypassed, so the real tmpfs
    fills): DiskFullError. Nothing under DST, no descriptor left open either way."""
    import distckpt.convert as conv
    from distckpt.errors import DataFileTruncatedError, DiskFullError
    _hf_two_shards(tmp_path / "hf")
    real = conv._RangeCopier.copy
    cut = []

    def cut_then_copy(self, src, offset, nbytes, *rest):
        if not cut:
            cut.append(src)
            os.truncate(src, offset + nbytes // 2)
        return real(self, src, offset, nbytes, *rest)
    monkeypatch.setattr(conv._RangeCopier, "copy", cut_then_copy)
    before = _open_fds()
    with pytest.raises(DataFileTruncatedError) as ei:
        convert(str(tmp_path / "hf"), str(tmp_path / "out"), to="safetensors", progress=False)
    assert ei.value.path == cut[0] and _open_fds() == before
    assert not os.path.exists(tmp_path / "out")
    monkeypatch.setattr(conv._RangeCopier, "copy", real)

    big = tmp_path / "big"
    big.mkdir()
    from safetensors.torch import save_file
    save_file({"w": torch.randn(1 << 20)}, str(big / "model.safetensors"))  # 4 MiB
    small = mounts.tmpfs(tmp_path / "small", size="2m")
    monkeypatch.setattr(conv, "_check_room", lambda *a, **k: None)
    with pytest.raises(DiskFullError):
        convert(str(big), str(small / "out"), to="safetensors", progress=False)
    assert os.listdir(small) == [] and _open_fds() == before
