"""Single-process save / load / read: round trips, strictness, corruption, the commit's edges."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import distckpt
from distckpt import errors
from distckpt.storage.posix.leftovers import reclaim_tmp_dirs

from ..conftest import open_fds

BACKENDS = ["uring", "pwrite", "buffered"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("DISTCKPT_IO_BACKEND", request.param)
    return request.param


def _all_dtypes_state():
    g = torch.Generator().manual_seed(0)
    sd = {
        "f32": torch.randn(1000, 37, generator=g),
        "f64": torch.randn(13, generator=g, dtype=torch.float64),
        "bf16": torch.randn(257, 3, generator=g).to(torch.bfloat16),
        "f16": torch.randn(5, 5, generator=g).to(torch.float16),
        "f8": torch.randn(64, generator=g).to(torch.float8_e4m3fn),
        "f8b": torch.randn(7, generator=g).to(torch.float8_e5m2),
        "bool": torch.rand(33, generator=g) > 0.5,
        "c64": torch.randn(9, generator=g, dtype=torch.complex64),
        "i8": torch.randint(-128, 127, (100,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (3, 3), generator=g, dtype=torch.uint8),
        "i64": torch.randint(-2**62, 2**62, (11,), generator=g, dtype=torch.int64),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "noncontig": torch.randn(40, 30, generator=g).t(),
        "nan": torch.tensor([float("nan"), -0.0, float("inf")]),
        "nested": {"list": [torch.arange(5), {"deep": torch.ones(2, 2)}], "tuple": (torch.zeros(3), 7)},
        "ints": {0: torch.arange(3.0), 1: {"step": 10}},
        "obj": {"i": 5, "big": 2**63 + 1, "f": 0.25, "s": "hello", "b": b"\x00\x01", "n": None, "t": True},
        "big": torch.randn(3 << 20, generator=g),  # 12 MiB: several staging blocks and checksum blocks
    }
    return sd


def _assert_same(a, b, path=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        # bytes, not values: NaN payloads, -0.0 and float8 compare exactly
        assert torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (path, list(a), list(b))
        for k in a:
            _assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}.{i}")
    else:
        assert a == b and type(a) is type(b), (path, a, b)


def _zeros_like_state(sd):
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, dict):
        return {k: _zeros_like_state(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_zeros_like_state(v) for v in sd]
    if isinstance(sd, tuple):
        return tuple(_zeros_like_state(v) for v in sd)
    return None


def test_round_trip_every_dtype(tmp_path, backend):
    sd = _all_dtypes_state()
    before = open_fds()
    res = distckpt.save(sd, tmp_path / "ck")
    assert res.backend == backend and res.world_size == 1 and res.total_bytes >= sd["big"].nbytes
    # read(): full tensors and the original nesting (tuples, int keys) back
    _assert_same(sd, distckpt.read(tmp_path / "ck"))
    # load(): in place into pre-allocated tensors; plain values replaced
    target = _zeros_like_state(sd)
    big_ptr = target["big"].data_ptr()
    out = distckpt.load(target, tmp_path / "ck")
    assert target["big"].data_ptr() == big_ptr, "load must fill the caller's tensors in place"
    assert out.missing == [] and out.unexpected == [] and out.mismatched == {}
    # a value inside a tuple is replaced too: the tuple is rebuilt and put back in its parent
    assert out.not_replaced == [] and target["nested"]["tuple"][1] == 7
    _assert_same(sd, target)
    assert open_fds() == before


def test_load_into_lazy_conj_and_neg_views(tmp_path):
    # A destination that is a lazy conj()/neg view has no plain bytes: load writes through the view
    # (the caller then reads the saved values), it does not raise an untyped view error.
    c = torch.complex(torch.randn(64), torch.randn(64))
    distckpt.save({"c": c, "n": torch.arange(8.0)}, tmp_path / "ck")
    dst = {"c": torch.zeros(64, dtype=torch.complex64).conj(), "n": torch.zeros(8)._neg_view()}
    distckpt.load(dst, tmp_path / "ck")
    assert dst["c"].is_conj() and torch.equal(dst["c"].resolve_conj(), c)
    assert torch.equal(dst["n"].resolve_neg(), torch.arange(8.0))


def test_read_selected_keys(tmp_path):
    sd = {"model": {"a": torch.arange(4), "b": torch.ones(2)}, "optim": {"lr": 0.1}, "step": 3}
    distckpt.save(sd, tmp_path / "ck")
    got = distckpt.read(tmp_path / "ck", keys=["model.a", "step"])
    assert list(got) == ["model", "step"] and list(got["model"]) == ["a"] and got["step"] == 3
    assert list(distckpt.read(tmp_path / "ck", keys=["optim"])) == ["optim"]
    with pytest.raises(errors.StateDictMismatchError):
        distckpt.read(tmp_path / "ck", keys=["nope"])


def test_read_key_selects_whole_dotted_names_only(tmp_path):
    # A key selects itself and the names under it at a dot: "model.a" is not a prefix of
    # "model.ab", and a key that is only part of a name ("mod", "model.a.x") selects nothing.
    sd = {"model": {"a": torch.arange(4), "ab": torch.ones(2), "a.b": torch.zeros(3)}, "m": 1, "step": 3}
    distckpt.save(sd, tmp_path / "ck")
    got = distckpt.read(tmp_path / "ck", keys=["model.a", "model.a", "m"])
    assert sorted(got["model"]) == ["a", "a.b"] and got["m"] == 1 and "step" not in got
    assert torch.equal(got["model"]["a"], torch.arange(4)) and torch.equal(got["model"]["a.b"], torch.zeros(3))
    for bad in (["mod"], ["model.a.x"], ["model.", "step"]):
        with pytest.raises(errors.StateDictMismatchError) as info:
            distckpt.read(tmp_path / "ck", keys=bad)
        assert info.value.missing == [k for k in bad if k != "step"]


def test_manifest_is_plain_msgpack_and_described(tmp_path):
    distckpt.save({"w": torch.ones(3, 4, dtype=torch.bfloat16)}, tmp_path / "ck", metadata={"run": "x"})
    m = distckpt.read_manifest(tmp_path / "ck")
    assert m["tensors"]["w"]["dtype"] == "bfloat16" and list(m["tensors"]["w"]["shape"]) == [3, 4]
    assert m["meta"]["user"] == {"run": "x"}
    raw = (tmp_path / "ck" / "MANIFEST").read_bytes()
    assert raw.startswith(b"DCKPTMF1") and b"\x80" not in raw[:2]  # not a pickle


def test_strict_reports_every_mismatch_at_once(tmp_path):
    distckpt.save({"a": torch.zeros(3), "b": torch.zeros(2, 2), "c": torch.zeros(4), "gone": torch.zeros(1)},
                  tmp_path / "ck")
    target = {"a": torch.ones(3), "b": torch.ones(3, 2), "c": torch.ones(4, dtype=torch.float16),
              "new_layer": torch.ones(5)}
    with pytest.raises(errors.StateDictMismatchError) as ei:
        distckpt.load(target, tmp_path / "ck")
    e = ei.value
    assert e.missing == ["new_layer"] and e.unexpected == ["gone"]
    # "gone" is listed for information: keys the state dict does not ask for are never an error
    assert e.shape_mismatch == {"b": ([2, 2], [3, 2])} and e.dtype_mismatch == {"c": ("float32", "float16")}
    assert isinstance(e, KeyError) and e.remedy
    assert torch.equal(target["a"], torch.ones(3)), "strict failure must not touch the caller's tensors"
    with pytest.raises(errors.StateDictMismatchError):  # a narrowing cast is refused even with strict=False
        distckpt.load(target, tmp_path / "ck", strict=False)
    del target["c"]
    out = distckpt.load(target, tmp_path / "ck", strict=False)
    assert torch.equal(target["a"], torch.zeros(3)) and torch.equal(target["b"], torch.ones(3, 2))
    assert out.missing == ["new_layer"] and out.unexpected == ["c", "gone"] and set(out.mismatched) == {"b"}


def test_flipped_byte_is_detected(tmp_path):
    sd = {"x": torch.randn(1 << 18), "y": torch.randn(100)}
    distckpt.save(sd, tmp_path / "ck")
    data = tmp_path / "ck" / "rank00000.bin"
    chunk = distckpt.read_manifest(tmp_path / "ck")["tensors"]["x"]["chunks"][0]
    with open(data, "r+b") as f:
        f.seek(chunk["offset"] + 700_000)
        b = f.read(1)
        f.seek(chunk["offset"] + 700_000)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(errors.ChecksumMismatchError) as ei:
        distckpt.load({"x": torch.empty(1 << 18), "y": torch.empty(100)}, tmp_path / "ck")
    e = ei.value
    # the error names the checksum block holding the flip (the save picks the block size)
    block = distckpt.read_manifest(tmp_path / "ck")["checksum_block"]
    assert e.key == "x" and e.file == "rank00000.bin" and e.offset == chunk["offset"] + 700_000 // block * block
    # verify=False skips the check (the caller asked for it)
    distckpt.load({"x": torch.empty(1 << 18), "y": torch.empty(100)}, tmp_path / "ck", verify=False)
    # the unaffected key still loads
    distckpt.load({"y": torch.empty(100)}, tmp_path / "ck", strict=False)


def test_flipped_byte_in_a_large_chunk_read_in_place(tmp_path):
    """A large chunk spans several read segments: the bad block is found and the load raises
    (the caller learns its tensors are not the checkpoint)."""
    n = 3 << 20  # 12 MiB of float32: takes the in-place path
    distckpt.save({"x": torch.randn(n)}, tmp_path / "ck")
    chunk = distckpt.read_manifest(tmp_path / "ck")["tensors"]["x"]["chunks"][0]
    flip_at = chunk["offset"] + 5 * (1 << 20) + 123  # inside checksum block 5
    with open(tmp_path / "ck" / "rank00000.bin", "r+b") as f:
        f.seek(flip_at)
        b = f.read(1)
        f.seek(flip_at)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(errors.ChecksumMismatchError) as ei:
        distckpt.load({"x": torch.empty(n)}, tmp_path / "ck")
    assert ei.value.key == "x" and ei.value.offset == chunk["offset"] + 5 * (1 << 20)


def test_fifo_manifest_is_refused_not_waited_on(tmp_path):
    distckpt.save({"x": torch.zeros(3)}, tmp_path / "ck")
    os.unlink(tmp_path / "ck" / "MANIFEST")
    os.mkfifo(tmp_path / "ck" / "MANIFEST")
    with pytest.raises(errors.ManifestCorruptError):
        distckpt.read(tmp_path / "ck")


def test_truncated_missing_and_incomplete(tmp_path):
    distckpt.save({"x": torch.randn(5000)}, tmp_path / "ck")
    data = tmp_path / "ck" / "rank00000.bin"
    size = data.stat().st_size
    os.truncate(data, size - 10)
    with pytest.raises(errors.DataFileTruncatedError) as ei:
        distckpt.load({"x": torch.empty(5000)}, tmp_path / "ck")
    assert ei.value.expected == size and ei.value.found == size - 10
    data.unlink()
    with pytest.raises(errors.DataFileMissingError):
        distckpt.load({"x": torch.empty(5000)}, tmp_path / "ck")
    (tmp_path / "ck" / "MANIFEST").unlink()
    with pytest.raises(errors.CheckpointNotFoundError, match="empty directory"):  # nothing left in it
        distckpt.load({"x": torch.empty(5000)}, tmp_path / "ck")
    with pytest.raises(errors.CheckpointNotFoundError):
        distckpt.read(tmp_path / "nothing-here")


def test_damaged_manifest(tmp_path):
    distckpt.save({"x": torch.randn(50)}, tmp_path / "ck")
    m = tmp_path / "ck" / "MANIFEST"
    raw = bytearray(m.read_bytes())
    raw[40] ^= 0xFF
    m.write_bytes(bytes(raw))
    with pytest.raises(errors.ManifestCorruptError):
        distckpt.read(tmp_path / "ck")


def test_refuses_to_overwrite_and_swaps_atomically(tmp_path):
    distckpt.save({"x": torch.zeros(10)}, tmp_path / "ck")
    with pytest.raises(errors.CheckpointExistsError) as ei:
        distckpt.save({"x": torch.ones(10)}, tmp_path / "ck")
    assert isinstance(ei.value, FileExistsError)
    assert torch.equal(distckpt.read(tmp_path / "ck")["x"], torch.zeros(10))
    distckpt.save({"x": torch.ones(10)}, tmp_path / "ck", overwrite=True)
    assert torch.equal(distckpt.read(tmp_path / "ck")["x"], torch.ones(10))
    assert sorted(os.listdir(tmp_path)) == ["ck"], "the replaced checkpoint and tmp dirs are gone"
    (tmp_path / "userdir").mkdir()
    (tmp_path / "userdir" / "precious.txt").write_text("keep me")
    with pytest.raises(errors.CheckpointExistsError):
        distckpt.save({"x": torch.ones(1)}, tmp_path / "userdir", overwrite=True)
    assert (tmp_path / "userdir" / "precious.txt").read_text() == "keep me"


def test_tmp_dirs_never_load_and_are_reclaimed(tmp_path):
    distckpt.save({"x": torch.zeros(10)}, tmp_path / "ck")
    tmp = tmp_path / (".ck2.tmp-" + "a" * 32)
    os.rename(tmp_path / "ck", tmp)
    with pytest.raises(errors.CheckpointIncompleteError):
        distckpt.read(tmp)
    distckpt.save({"x": torch.ones(10)}, tmp_path / "ck2")  # reclaims .ck2.tmp-*
    assert sorted(os.listdir(tmp_path)) == ["ck2"]
    assert reclaim_tmp_dirs(str(tmp_path)) == []


def test_pickle_is_opt_in_both_ways(tmp_path):
    class Thing:
        pass
    with pytest.raises(errors.UnsupportedValueError) as ei:
        distckpt.save({"a": {"thing": Thing()}}, tmp_path / "ck")
    assert ei.value.key == "a.thing" and isinstance(ei.value, TypeError)
    assert not (tmp_path / "ck").exists() and os.listdir(tmp_path) == []
    import datetime
    distckpt.save({"a": {"thing": datetime.date(2020, 1, 2)}}, tmp_path / "ck", allow_pickle=True)
    with pytest.raises(errors.PickleNotAllowedError):
        distckpt.read(tmp_path / "ck")
    assert distckpt.read(tmp_path / "ck", allow_pickle=True) == {"a": {"thing": datetime.date(2020, 1, 2)}}
    target = {"a": {"thing": None}}
    with pytest.raises(errors.PickleNotAllowedError):
        distckpt.load(target, tmp_path / "ck")
    distckpt.load(target, tmp_path / "ck", allow_pickle=True)
    assert target["a"]["thing"] == datetime.date(2020, 1, 2)


def test_loading_never_unpickles_by_default(tmp_path):
    """A hostile manifest entry of kind pickle must not run code unless the caller opted in."""
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))
    distckpt.save({"e": Evil()}, tmp_path / "ck", allow_pickle=True)
    for call in (lambda: distckpt.read(tmp_path / "ck"), lambda: distckpt.load({"e": None}, tmp_path / "ck")):
        with pytest.raises(errors.PickleNotAllowedError):
            call()
    assert not marker.exists()


def test_errors_are_picklable_and_typed():
    e = errors.ChecksumMismatchError("bad", path="/x", file="rank00000.bin", key="k", offset=4096)
    e2 = pickle.loads(pickle.dumps(e))
    assert (e2.key, e2.offset, e2.path, e2.file) == ("k", 4096, "/x", "rank00000.bin")
    assert errors.DistCkptError.__bases__ == (Exception,)


def test_fd_lifecycle_save_load_many(tmp_path, backend):
    before = open_fds()
    for i in range(30):
        distckpt.save({"x": torch.full((1000,), float(i))}, tmp_path / f"c{i}")
        t = {"x": torch.empty(1000)}
        distckpt.load(t, tmp_path / f"c{i}")
        assert t["x"][0].item() == i
    assert open_fds() == before
