"""distckpt.convert: to DCP (read back by dcp.load), torch.save format (torch.load weights_only),
Hugging Face safetensors (transformers from_pretrained), DCP -> distckpt; bounded memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import distckpt
from distckpt.convert import _slices, convert, parse_size
from distckpt.errors import CheckpointExistsError


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


def test_parse_size():
    assert parse_size("5GiB") == 5 << 30 and parse_size("100KB") == 100_000 and parse_size("4096") == 4096
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


def test_cli_convert(src, tmp_path):
    dst = str(tmp_path / "cli.pt")
    proc = subprocess.run([sys.executable, "-m", "distckpt", "convert", src, dst, "--to", "torch"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "tensors" in proc.stdout and "\r" not in proc.stderr  # no progress bar when not a tty
    _same(_state(), torch.load(dst, weights_only=True))
    proc = subprocess.run([sys.executable, "-m", "distckpt", "convert", src, str(tmp_path / "x"), "--to", "dcp",
                           "--prefix", "model."], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0


_RSS_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    import distckpt
    from distckpt.convert import convert

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    src, out, to, limit = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    import torch.distributed.checkpoint, safetensors  # imports are baseline, not conversion memory
    base = status("VmRSS")
    convert(src, out, to=to, memory_limit=limit, progress=False)
    print(json.dumps({"base": base, "peak": status("VmHWM")}))
""")

_MAKE_SCRIPT = textwrap.dedent("""
    import sys, torch, distckpt
    g = torch.Generator().manual_seed(0)
    # 1 GiB: one 512 MiB tensor (twice the bound: it must be sliced) and eight of 64 MiB
    state = {"big": torch.randn(512, 256 * 1024, generator=g)}
    for i in range(8):
        state[f"layer{i}"] = torch.randn(64, 256 * 1024, generator=g)
    distckpt.save(state, sys.argv[1])
""")


def test_peak_memory_stays_under_the_bound(tmp_path):
    """A 1 GiB checkpoint converted with a 256 MiB limit: the process's peak RSS above its
    baseline (after imports) stays under 256 MiB for every export."""
    import shutil

    src = str(tmp_path / "big")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-c", _MAKE_SCRIPT, src], check=True, env=env, timeout=300)
    limit = 256 << 20
    try:
        for to in ("safetensors", "torch", "dcp"):
            out = str(tmp_path / f"out_{to}")
            proc = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, src, out, to, str(limit)], capture_output=True,
                                  text=True, env=env, timeout=300)
            assert proc.returncode == 0, proc.stderr
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            grew = r["peak"] - r["base"]
            print(f"{to}: baseline {r['base'] >> 20} MiB, peak {r['peak'] >> 20} MiB, grew {grew >> 20} MiB")
            assert grew < limit, (to, grew)
            shutil.rmtree(out, ignore_errors=True) if os.path.isdir(out) else os.unlink(out)
    finally:
        shutil.rmtree(src, ignore_errors=True)
