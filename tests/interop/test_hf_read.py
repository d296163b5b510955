"""A Hugging Face safetensors directory (``save_pretrained`` output) is a load source
(distckpt/hf.py): a real transformers Llama saved as one file and as shards, read and loaded
bit-exact into a fresh model, loaded at 2 real gloo ranks into FSDP2 DTensor state with each rank
reading about half of the bytes, the state-dict semantics of every other source (strict,
missing / unexpected keys, the cast policy), the CLI, and hostile headers and indexes as typed
errors."""

from __future__ import annotations

import copy
import json
import os
import struct

import pytest
import torch

import distckpt
from distckpt.errors import (CheckpointCorruptError, DataFileMissingError, DataFileTruncatedError,
                             StateDictMismatchError, UnsupportedValueError)
from tests.helpers.distributed import run_ranks

pytest.importorskip("transformers")


def _config(**kw):
    from transformers import LlamaConfig

    args = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    args.update(kw)
    return LlamaConfig(**args)


def _model(seed: int, **kw):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(_config(**kw))


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The same model saved by save_pretrained as one file and as shards of at most 20 kB."""
    root = tmp_path_factory.mktemp("hf")
    model = _model(0)
    model.save_pretrained(str(root / "single"))
    model.save_pretrained(str(root / "sharded"), max_shard_size="20KB")
    return model, str(root / "single"), str(root / "sharded")


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_read_and_load_bit_exact(saved, layout):
    model, single, sharded = saved
    path = single if layout == "single" else sharded
    names = sorted(os.listdir(path))
    if layout == "single":
        assert "model.safetensors" in names and "model.safetensors.index.json" not in names
    else:
        assert "model.safetensors.index.json" in names and sum(n.endswith(".safetensors") for n in names) > 2
    want = model.state_dict()

    full = distckpt.read(path)
    assert set(full) == set(want)
    for k, v in want.items():
        assert _bits_equal(full[k], v), k

    fresh = _model(1)  # other weights: every value must come from the files
    assert not torch.equal(fresh.state_dict()["lm_head.weight"], want["lm_head.weight"])
    res = distckpt.load(fresh.state_dict(), path)
    assert res.missing == [] and res.unexpected == [] and res.cast == {}
    got = fresh.state_dict()
    for k, v in want.items():
        assert _bits_equal(got[k], v), k
    ids = torch.arange(12).view(2, 6)
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)

    # nested the way a training job holds it: {"model": model.state_dict()} with the prefix
    # "model." stripped by HF's naming (LlamaForCausalLM keys are "model.layers..." already)
    sub = {"model": {k.removeprefix("model."): torch.zeros_like(v) for k, v in want.items() if k.startswith("model.")}}
    res = distckpt.load(sub, path)
    assert res.unexpected == ["lm_head.weight"]
    assert _bits_equal(sub["model"]["norm.weight"], want["model.norm.weight"])


def test_state_dict_semantics(saved, tmp_path):
    model, single, _ = saved
    want = model.state_dict()

    # a key the files lack: named, nothing read; strict=False loads the rest and lists it
    sd = {k: torch.zeros_like(v) for k, v in want.items()}
    sd["extra.weight"] = torch.zeros(3)
    with pytest.raises(StateDictMismatchError) as ei:
        distckpt.load(sd, single)
    assert ei.value.missing == ["extra.weight"]
    assert int(sd["lm_head.weight"].count_nonzero()) == 0
    res = distckpt.load(sd, single, strict=False)
    assert res.missing == ["extra.weight"] and _bits_equal(sd["lm_head.weight"], want["lm_head.weight"])

    # another shape: named
    bad = {"lm_head.weight": torch.zeros(5, 5)}
    with pytest.raises(StateDictMismatchError, match="lm_head.weight"):
        distckpt.load(bad, single)

    # bf16 file -> fp32 model: exact, automatic, reported; fp32 file -> bf16 model: refused
    # unless cast="allow" (the library's cast policy, as for every source)
    bf = str(tmp_path / "bf16")
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(bf)
    halves = {k: v.to(torch.bfloat16) for k, v in want.items()}
    fp32 = {k: torch.zeros_like(v) for k, v in want.items()}
    res = distckpt.load(fp32, bf)
    assert set(res.cast) == set(want) and res.cast["lm_head.weight"] == "bfloat16->float32"
    for k in want:
        assert _bits_equal(fp32[k], halves[k].float()), k
    low = {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in want.items()}
    with pytest.raises(StateDictMismatchError, match="cast"):
        distckpt.load(low, single)
    distckpt.load(low, single, cast="allow")
    assert _bits_equal(low["lm_head.weight"], halves["lm_head.weight"])


def test_cli_read_inspect_verify_convert(saved, tmp_path, capsys):
    from distckpt.cli import main

    model, _, sharded = saved
    assert main(["inspect", sharded, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["meta"]["format"] == "safetensors"
    assert main(["verify", sharded]) == 0
    assert "safetensors" in capsys.readouterr().out
    out = str(tmp_path / "sd.pt")
    assert main(["convert", sharded, out, "--to", "torch", "--no-progress"]) == 0
    got = torch.load(out, weights_only=True)
    for k, v in model.state_dict().items():
        assert _bits_equal(got[k], v), k
    back = str(tmp_path / "st")  # safetensors -> safetensors through the converter: same bytes
    assert main(["convert", sharded, back, "--to", "safetensors", "--no-progress"]) == 0
    from safetensors.torch import load_file
    got = load_file(os.path.join(back, "model.safetensors"))
    assert all(_bits_equal(got[k], v) for k, v in model.state_dict().items())


# ---------------------------------------------------------------------------------------------
# FSDP2 at 2 ranks.

_FSDP_CFG = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=2)


def _fsdp_body(rank, world, path):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = _model(100 + rank, **_FSDP_CFG)  # each rank other weights: none may survive
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sd = get_model_state_dict(model)
    assert all(isinstance(v, DTensor) for v in sd.values())
    needed = sum(v.to_local().numel() * v.element_size() for v in sd.values())
    res = distckpt.load(sd, path)
    from safetensors.torch import load_file
    want = load_file(os.path.join(path, "model.safetensors"))
    full = {k: v.full_tensor() for k, v in get_model_state_dict(model).items()}
    exact = sorted(k for k in want if _bits_equal(full[k], want[k]))
    return {"bytes_read": res.bytes_read, "needed": needed, "exact": exact, "keys": sorted(want),
            "unexpected": res.unexpected}


def test_fsdp2_two_ranks_each_reads_its_own_ranges(tmp_path):
    path = str(tmp_path / "hf")
    _model(0, **_FSDP_CFG).save_pretrained(path)
    data = os.path.getsize(os.path.join(path, "model.safetensors"))
    results = run_ranks(_fsdp_body, 2, path, timeout=300)
    for rank, r in enumerate(results):
        print(f"rank {rank}: read {r['bytes_read']} bytes for {r['needed']} needed of {data}")
        assert r["exact"] == r["keys"] and r["unexpected"] == []
        # its own shards' bytes, plus alignment at both ends of each range: about half the file
        assert r["needed"] <= r["bytes_read"] <= 0.6 * data, r


# ---------------------------------------------------------------------------------------------
# Hostile directories.


def _write(path: str, header: dict | bytes, data: bytes, length: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


def _entry(dtype="F32", shape=(2, 2), offs=(0, 16)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offs)}


@pytest.mark.parametrize("case, error, match", [
    ("huge header length", CheckpointCorruptError, "header length"),
    ("header past EOF", DataFileTruncatedError, "header of"),
    ("offsets past EOF", DataFileTruncatedError, "past the end"),
    ("overlapping", CheckpointCorruptError, "overlaps"),
    ("gap", CheckpointCorruptError, "gap"),
    ("trailing bytes", CheckpointCorruptError, "belong to no tensor"),
    ("bad dtype", CheckpointCorruptError, "not a safetensors dtype"),
    ("list dtype", CheckpointCorruptError, "not a safetensors dtype"),
    ("object dtype", CheckpointCorruptError, "not a safetensors dtype"),
    ("empty but unaddressable", CheckpointCorruptError, "more than a tensor can address"),
    ("sub-byte dtype", UnsupportedValueError, "sub-byte"),
    ("size mismatch", CheckpointCorruptError, "needs 16"),
    ("negative shape", CheckpointCorruptError, "non-negative"),
    ("bool shape", CheckpointCorruptError, "non-negative"),
    ("reversed offsets", CheckpointCorruptError, "begin <= end"),
    ("not json", CheckpointCorruptError, "JSON"),
    ("json list", CheckpointCorruptError, "JSON object"),
    ("duplicate key", CheckpointCorruptError, "twice"),
    ("extra field", CheckpointCorruptError, "exactly"),
    ("bad metadata", CheckpointCorruptError, "__metadata__"),
    ("metadata a list", CheckpointCorruptError, "__metadata__"),
    ("metadata false", CheckpointCorruptError, "__metadata__"),
    ("metadata null", None, None),   # the safetensors library reads it as none: so does distckpt
    ("lone surrogate name", CheckpointCorruptError, "surrogate"),
    ("65 dimensions", UnsupportedValueError, "65 dimensions, more than the 64"),
    ("short file", DataFileTruncatedError, "too short"),
])
def test_hostile_header_is_a_typed_error(tmp_path, case, error, match):
    p = str(tmp_path / "model.safetensors")
    data = bytes(range(16))
    if case == "huge header length":
        _write(p, {"a": _entry()}, data, length=1 << 40)
    elif case == "header past EOF":
        _write(p, {"a": _entry()}, data, length=4096)
    elif case == "offsets past EOF":
        _write(p, {"a": _entry(shape=(1 << 20,), offs=(0, 4 << 20))}, data)
    elif case == "overlapping":
        _write(p, {"a": _entry(shape=(2,), offs=(0, 8)), "b": _entry(shape=(2,), offs=(4, 12)),
                   "c": _entry(shape=(1,), offs=(12, 16))}, data)
    elif case == "gap":
        _write(p, {"a": _entry(shape=(2,), offs=(0, 8)), "b": _entry(shape=(1,), offs=(12, 16))}, data)
    elif case == "trailing bytes":
        _write(p, {"a": _entry(shape=(2,), offs=(0, 8))}, data)
    elif case == "bad dtype":
        _write(p, {"a": _entry(dtype="F99")}, data)
    elif case == "list dtype":
        _write(p, {"a": _entry(dtype=["F32"])}, data)
    elif case == "object dtype":
        _write(p, {"a": _entry(dtype={"F32": 1})}, data)
    elif case == "empty but unaddressable":  # no byte, yet torch cannot make it (docs/FORMAT.md rule)
        _write(p, {"z": _entry(shape=(0, 1 << 62, 1 << 62), offs=(0, 0)), "a": _entry(offs=(0, 16))}, data)
    elif case == "sub-byte dtype":
        _write(p, {"a": _entry(dtype="F4", shape=(32,))}, data)
    elif case == "size mismatch":
        _write(p, {"a": _entry(shape=(2, 2), offs=(0, 12)), "b": _entry(shape=(1,), offs=(12, 16))}, data)
    elif case == "negative shape":
        _write(p, {"a": _entry(shape=(-2, -2))}, data)
    elif case == "bool shape":
        _write(p, {"a": {"dtype": "U8", "shape": [True], "data_offsets": [0, 16]}}, data)
    elif case == "reversed offsets":
        _write(p, {"a": _entry(offs=(16, 0))}, data)
    elif case == "not json":
        _write(p, b"{not json at all}", data)
    elif case == "json list":
        _write(p, b"[1, 2]", data)
    elif case == "duplicate key":
        _write(p, b'{"a": ' + json.dumps(_entry()).encode() + b', "a": ' + json.dumps(_entry()).encode() + b"}", data)
    elif case == "extra field":
        _write(p, {"a": dict(_entry(), code="import os")}, data)
    elif case == "bad metadata":
        _write(p, {"__metadata__": {"format": 1}, "a": _entry()}, data)
    elif case == "metadata a list":  # falsy values were taken for none (an outside trial)
        _write(p, {"__metadata__": [], "a": _entry()}, data)
    elif case == "metadata false":
        _write(p, {"__metadata__": False, "a": _entry()}, data)
    elif case == "metadata null":
        _write(p, {"__metadata__": None, "a": _entry()}, data)
    elif case == "lone surrogate name":  # JSON's escape of no Unicode character: raw errors later
        _write(p, b'{"a\\ud800": ' + json.dumps(_entry()).encode() + b"}", data)
    elif case == "65 dimensions":  # said "not a list of non-negative integers", which it is
        _write(p, {"a": _entry(shape=(1,) * 61 + (2, 2, 2, 2), offs=(0, 64))}, data + bytes(48))
    elif case == "short file":
        with open(p, "wb") as f:
            f.write(b"\x01\x02")
    if error is None:
        assert torch.equal(distckpt.read(str(tmp_path))["a"], torch.frombuffer(bytearray(data), dtype=torch.float32).view(2, 2))
        return
    with pytest.raises(error, match=match):
        distckpt.read(str(tmp_path))
    with pytest.raises(error, match=match):  # load goes through the same checks, before any read
        distckpt.load({"a": torch.zeros(2, 2)}, str(tmp_path), no_dist=True)


def test_hostile_index_is_a_typed_error(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.ones(2), "b": torch.zeros(3)}, str(tmp_path / "part-1.safetensors"))
    index = tmp_path / "model.safetensors.index.json"

    def check(weight_map, error, match, raw=None):
        index.write_text(raw if raw is not None else json.dumps({"metadata": {}, "weight_map": weight_map}))
        with pytest.raises(error, match=match):
            distckpt.read(str(tmp_path))

    check({"a": "../part-1.safetensors"}, CheckpointCorruptError, "plain file name")
    check({"a": "/etc/passwd"}, CheckpointCorruptError, "plain file name")
    check({"a": "missing.safetensors"}, DataFileMissingError, "missing")
    check({"a": "part-1.safetensors", "c": "part-1.safetensors"}, CheckpointCorruptError, "no file has it")
    check({}, CheckpointCorruptError, "no weight_map object", raw="[]")
    check({}, CheckpointCorruptError, "an empty weight_map")
    # a symlinked shard (the hub cache's layout) is refused, not followed
    os.symlink("part-1.safetensors", str(tmp_path / "link.safetensors"))
    check({"a": "link.safetensors"}, UnsupportedValueError, "symlink")
    index.write_text(json.dumps({"weight_map": {"a": "part-1.safetensors", "b": "part-1.safetensors"}}))
    got = distckpt.read(str(tmp_path))
    assert torch.equal(got["a"], torch.ones(2)) and torch.equal(got["b"], torch.zeros(3))
    # A tensor of a named file that the index omits is read too, as transformers' loader does
    # (docs/INTEROP.md): the index says which files to open.
    index.write_text(json.dumps({"weight_map": {"a": "part-1.safetensors"}}))
    got = distckpt.read(str(tmp_path))
    assert sorted(got) == ["a", "b"] and torch.equal(got["b"], torch.zeros(3))


def test_dcp_sharded_safetensors_are_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.ones(2)}, str(tmp_path / "model.safetensors"),
              metadata={"DCP_SHARDING_INFO": json.dumps({"a": {"saved_offsets": [2]}})})
    with pytest.raises(UnsupportedValueError, match="DCP_SHARDING_INFO"):
        distckpt.read(str(tmp_path))


def test_same_name_in_two_shards_is_corrupt(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.ones(2)}, str(tmp_path / "s1.safetensors"))
    save_file({"a": torch.zeros(2)}, str(tmp_path / "s2.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}))
    with pytest.raises(CheckpointCorruptError, match="in both"):
        distckpt.read(str(tmp_path))


def test_reference_parity_of_headers_and_shard_names(tmp_path):
    """What the safetensors library reads, distckpt reads (outside trial): JSON whitespace before
    the header's opening brace, and shard names with spaces, '+', '@', '~' or non-ASCII letters
    (refused as "not a plain file name" before). Paths stay refused (test above)."""
    from safetensors.torch import load_file, save_file

    p = tmp_path / "ws"
    p.mkdir()
    _write(str(p / "model.safetensors"), b"  \n" + json.dumps({"a": _entry()}).encode(),
           torch.arange(4, dtype=torch.float32).numpy().tobytes())
    assert torch.equal(distckpt.read(str(p))["a"], load_file(str(p / "model.safetensors"))["a"])
    names = ["model 1.safetensors", "model+2.safetensors", "w@v3~.safetensors", "modèle-4.safetensors"]
    shards = tmp_path / "names"
    shards.mkdir()
    weight_map = {}
    for i, name in enumerate(names):
        save_file({f"t{i}": torch.full((3,), float(i))}, str(shards / name))
        weight_map[f"t{i}"] = name
    (shards / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    got = distckpt.read(str(shards))
    assert sorted(got) == ["t0", "t1", "t2", "t3"] and all(torch.equal(got[f"t{i}"], torch.full((3,), float(i)))
                                                         for i in range(4))


def test_an_io_error_reading_a_header_is_the_storages_typed_error(tmp_path, monkeypatch):
    """EIO while a header is read was a bare OSError (an outside trial)."""
    import errno

    import distckpt.hf as hf
    from distckpt.errors import StorageIOError
    from safetensors.torch import save_file

    save_file({"a": torch.ones(2)}, str(tmp_path / "model.safetensors"))

    def eio(*_a):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(hf.os, "pread", eio)
    fd = os.open(str(tmp_path / "model.safetensors"), os.O_RDONLY)
    try:
        with pytest.raises(StorageIOError):
            hf.read_header(fd, str(tmp_path / "model.safetensors"), os.fstat(fd).st_size)
    finally:
        os.close(fd)


def test_a_file_replaced_between_its_header_and_its_data_is_never_read_at_the_old_offsets(tmp_path, monkeypatch):
    """A safetensors file replaced (renamed over) by another valid file of the same size, its
    tensors in the other order, after its header was read: the data were read at the old offsets,
    q's values returned as k's, silently (an outside trial; a foreign checkpoint has no checksums).
    The directory's files are now part of the identity the load's guard compares at its end:
    CheckpointRemovedError, "changed"."""
    import distckpt.hf as hf
    from distckpt.errors import CheckpointRemovedError

    def write(path, order):
        vals = {"q": torch.full((4,), 1.0), "k": torch.full((4,), 2.0)}
        header, data, off = {}, b"", 0
        for n in order:
            header[n] = {"dtype": "F32", "shape": [4], "data_offsets": [off, off + 16]}
            data += vals[n].numpy().tobytes()
            off += 16
        _write(path, header, data)

    p = str(tmp_path / "model.safetensors")
    write(p, ["q", "k"])
    real = hf.load_manifest

    def swap_after_listing(path):
        m = real(path)
        write(p + ".new", ["k", "q"])
        os.replace(p + ".new", p)
        return m

    monkeypatch.setattr(hf, "load_manifest", swap_after_listing)
    with pytest.raises(CheckpointRemovedError, match="changed while it was being read"):
        distckpt.read(str(tmp_path))
    out = {"q": torch.zeros(4), "k": torch.zeros(4)}
    with pytest.raises(CheckpointRemovedError):
        distckpt.load(out, str(tmp_path), no_dist=True)
    monkeypatch.setattr(hf, "load_manifest", real)
    got = distckpt.read(str(tmp_path))  # unchanged during the read: read as it is
    assert torch.equal(got["q"], torch.full((4,), 1.0)) and torch.equal(got["k"], torch.full((4,), 2.0))


def test_the_read_guard_watches_the_checkpoints_files_only_and_their_change_time(tmp_path, monkeypatch):
    """A trainer writing beside an HF output directory (a trainer_state.json, a later checkpoint's
    subdirectory) made every load of it fail as "changed" (an outside trial): only the metadata and
    data files are compared now. A same-size rewrite that restored the modification time (cp -p,
    rsync -t) was missed: the change time is compared too."""
    import distckpt.hf as hf
    from distckpt.errors import CheckpointRemovedError
    from safetensors.torch import save_file

    save_file({"a": torch.full((4,), 1.0)}, str(tmp_path / "model.safetensors"))
    real = hf.load_manifest

    def beside(path):
        m = real(path)
        (tmp_path / "trainer_state.json").write_text("{}")
        (tmp_path / "checkpoint-500").mkdir(exist_ok=True)
        (tmp_path / "checkpoint-500" / "optimizer.pt").write_bytes(b"x")
        return m

    monkeypatch.setattr(hf, "load_manifest", beside)
    assert torch.equal(distckpt.read(str(tmp_path))["a"], torch.full((4,), 1.0))

    def rewrite_keeping_mtime(path):
        m = real(path)
        p = str(tmp_path / "model.safetensors")
        st = os.stat(p)
        raw = bytearray(open(p, "rb").read())
        raw[-1] ^= 0x40   # one bit of the last value, the same size
        with open(p, "r+b") as f:
            f.write(bytes(raw))
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
        return m

    monkeypatch.setattr(hf, "load_manifest", rewrite_keeping_mtime)
    with pytest.raises(CheckpointRemovedError, match="changed while it was being read"):
        distckpt.read(str(tmp_path))


def test_a_directory_rewritten_in_place_during_a_load_never_calls_what_it_read_the_checkpoint(tmp_path, monkeypatch):
    """A Hugging Face directory whose second shard is rewritten in place (same size) while a load
    reads it: the guard sees the change once the load finished, and the error listed every key as
    filled with "verified bytes of the checkpoint as it was", while one held the rewritten bytes (a
    re-trial): a file without checksums cannot tell. Every key is partly filled now."""
    import distckpt.fill as F
    from safetensors.torch import save_file

    from distckpt.errors import CheckpointRemovedError
    g = torch.Generator().manual_seed(0)
    src = {f"t{i}": torch.randn(1 << 18, generator=g) for i in range(4)}
    save_file({"t0": src["t0"], "t1": src["t1"]}, str(tmp_path / "a.safetensors"))
    save_file({"t2": src["t2"], "t3": src["t3"]}, str(tmp_path / "b.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "t0": "a.safetensors", "t1": "a.safetensors", "t2": "b.safetensors", "t3": "b.safetensors"}}))
    real, calls = F._run_pipeline, []

    def rewrite_b_after_a(path, segs, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            b = tmp_path / "b.safetensors"
            data = bytearray(b.read_bytes())
            data[-1000] ^= 0xFF
            b.write_bytes(bytes(data))
        return real(path, segs, *args, **kwargs)
    monkeypatch.setattr(F, "_run_pipeline", rewrite_b_after_a)
    dst = {k: torch.full((1 << 18,), -7.0) for k in src}
    with pytest.raises(CheckpointRemovedError) as info:
        distckpt.load(dst, str(tmp_path))
    assert len(calls) >= 2 and info.value.filled == [] and info.value.partly_filled == sorted(src), info.value
    assert "partly filled" in str(info.value)
