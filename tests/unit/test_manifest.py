"""MANIFEST format: golden bytes, the corrupt-file corpus, validation rules, hostile input."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distckpt.checksum import crc32c
from distckpt.errors import (CheckpointCorruptError, CheckpointIncompleteError, ChecksumMismatchError,
                             DataFileMissingError, DataFileTruncatedError, ManifestCorruptError)
from distckpt.manifest import (
    DTYPE_ITEMSIZE,
    MAGIC,
    ChunkRecord,
    FileEntry,
    Manifest,
    ObjectEntry,
    TensorEntry,
    block_crcs,
    data_file_name,
    decode,
    decode_header,
    encode,
    to_plain,
    validate,
)
from distckpt.storage.posix.manifests import load_manifest, read_manifest_bytes

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden")


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_golden", os.path.join(GOLDEN, "make_golden.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gen = _load_generator()


def _manifest(tensors=None, objects=None, *, files=None, block=16, tree=None, meta=None) -> Manifest:
    """A small valid-by-construction manifest; the tree references everything once."""
    tensors = tensors or {}
    objects = objects or {}
    if tree is None:
        tree = {"t": "dict", "k": [[k, {"t": "ref", "fqn": k}] for k in [*tensors, *objects]]}
    return Manifest(
        format_version=1,
        save_id="t",
        world_size=1,
        created_unix=1.0,
        checksum_algo="crc32c",
        checksum_block=block,
        files=files if files is not None else (FileEntry("rank00000.bin", 1 << 20, 0),),
        tensors=tensors,
        objects=objects,
        tree=tree,
        meta=meta if meta is not None else {},
    )


def _chunk(offsets, sizes, itemsize=4, *, file=0, offset=0, block=16) -> ChunkRecord:
    n = itemsize
    for s in sizes:
        n *= s
    return ChunkRecord(tuple(offsets), tuple(sizes), file, offset, n, (0,) * -(-n // block))


def _grid(shape, splits, itemsize=4) -> tuple[ChunkRecord, ...]:
    """Chunks of a grid split: splits[d] = cut points along dim d; chunks laid out back to back."""
    import itertools

    ranges = []
    for d, n in enumerate(shape):
        cuts = [0, *splits[d], n]
        ranges.append([(a, b - a) for a, b in zip(cuts, cuts[1:])])
    chunks, pos = [], 0
    for combo in itertools.product(*ranges):
        c = _chunk([o for o, _ in combo], [s for _, s in combo], itemsize, offset=pos)
        pos += c.nbytes
        chunks.append(c)
    return tuple(chunks)


def _corrupt_msg(m: Manifest) -> str:
    with pytest.raises(ManifestCorruptError) as ei:
        validate(m, path="/ckpt/MANIFEST")
    assert ei.value.path == "/ckpt/MANIFEST"
    return ei.value.message


# ------------------------------------------------------------------------------------------
# Golden bytes and the corrupt corpus.


def test_golden_encodes_to_stored_bytes():
    with open(os.path.join(GOLDEN, "manifest_v1.bin"), "rb") as f:
        stored = f.read()
    assert encode(gen.golden_manifest()) == stored


def test_golden_decodes_back_equal():
    with open(os.path.join(GOLDEN, "manifest_v1.bin"), "rb") as f:
        m = decode(f.read())
    assert m == gen.golden_manifest()
    # Types survive: int keys stay ints, bytes stay bytes, the scalar tensor keeps shape ().
    assert m.tree["k"][1][1]["k"][0][0] == 0
    assert m.objects["blob"].value == b"\x00\x01\xff"
    assert m.tensors["step_t"].shape == ()
    assert m.tensors["empty"].chunks == ()


def test_golden_v2_encodes_to_stored_bytes_and_decodes_back():
    with open(os.path.join(GOLDEN, "manifest_v2.bin"), "rb") as f:
        stored = f.read()
    assert encode(gen.golden_manifest_v2()) == stored
    m = decode(stored)
    assert m == gen.golden_manifest_v2() and m.format_version == 2
    assert struct.unpack_from("<8sI", stored) == (MAGIC, 2)
    assert m.objects["v.betas"] == ObjectEntry("value", {"t": "tuple", "v": [0.9, 0.95]})


def test_golden_v1_still_loads_with_format_2_reader():
    # Old checkpoints stay loadable: the v1 bytes decode unchanged under the v2 reader.
    with open(os.path.join(GOLDEN, "manifest_v1.bin"), "rb") as f:
        m = decode(f.read())
    assert m.format_version == 1 and m == gen.golden_manifest()


def test_golden_v3_directory_encodes_and_decodes_with_its_indexes():
    """Format 3: the MANIFEST lists no chunk; each data file ends with its index. The stored
    directory matches what the generator builds byte for byte, and load_manifest gives back
    every chunk record (the same as the v2 golden manifest's)."""
    d = os.path.join(GOLDEN, "v3")
    with open(os.path.join(d, "MANIFEST"), "rb") as f:
        stored = f.read()
    want = gen.golden_manifest_v3()
    assert encode(want) == stored
    for i, data in enumerate(gen.golden_v3_files()):
        with open(os.path.join(d, data_file_name(i)), "rb") as f:
            assert f.read() == data
    m = load_manifest(d)
    assert m == want and m.format_version == 3
    assert {k: t.chunks for k, t in m.tensors.items()} == {k: t.chunks for k, t in gen.golden_manifest_v2().tensors.items()}
    body = msgpack.unpackb(stored[24:-4], raw=False, strict_map_key=False)
    assert all("chunks" not in t for t in body["tensors"].values())
    assert [f["index"] for f in body["files"]] == [list(f.index) for f in want.files]
    # Without a way to read the indexes a version-3 MANIFEST cannot be decoded (never "no chunks").
    with pytest.raises(TypeError, match="needs read_index"):
        decode(stored)
    assert decode_header(stored).tensors["model.w"].chunks is None


def _v3_copy(tmp_path):
    import shutil
    d = tmp_path / "v3"
    shutil.copytree(os.path.join(GOLDEN, "v3"), d)
    return d


def test_v3_index_damage_is_named(tmp_path):
    d = _v3_copy(tmp_path)
    f1 = d / "rank00001.bin"
    good = f1.read_bytes()
    bad = bytearray(good)
    bad[gen.V3_CHUNK_AREA + 20] ^= 1
    f1.write_bytes(bytes(bad))
    with pytest.raises(ChecksumMismatchError) as ei:
        load_manifest(d)
    assert "index of rank00001.bin" in ei.value.message and ei.value.path == str(f1)
    f1.write_bytes(good[:-1])
    with pytest.raises(DataFileTruncatedError):
        load_manifest(d)
    f1.unlink()
    with pytest.raises(DataFileMissingError):
        load_manifest(d)
    os.symlink(os.path.join(GOLDEN, "v3", "rank00001.bin"), f1)  # an identical file, outside: refused (I7)
    with pytest.raises(CheckpointCorruptError) as ei:
        load_manifest(d)
    assert "symlink" in ei.value.message


def _v3_variant(tmp_path, edit_files=None, index_records=None):
    """A copy of the v3 golden directory whose rank00001.bin index holds ``index_records`` (a
    function of the golden records) and/or whose MANIFEST files are edited."""
    from distckpt.manifest import encode_index
    d = _v3_copy(tmp_path)
    m = gen.golden_manifest_v3()
    files = list(m.files)
    if index_records is not None:
        recs = [(k, c) for k, t in m.tensors.items() for c in t.chunks if c.file == 1]
        data = gen.golden_v3_files()[1][: gen.V3_CHUNK_AREA] + encode_index(index_records(recs))
        (d / "rank00001.bin").write_bytes(data)
        files[1] = FileEntry(files[1].name, len(data), 1, (gen.V3_CHUNK_AREA, len(data) - gen.V3_CHUNK_AREA,
                                                           crc32c(data[gen.V3_CHUNK_AREA:])))
    if edit_files is not None:
        files = edit_files(files)
    # encode() validates what it is given: write the MANIFEST of the header alone, past that check.
    header = dataclasses.replace(m, files=tuple(files), tensors={k: dataclasses.replace(t, chunks=None)
                                                                 for k, t in m.tensors.items()})
    body = msgpack.packb(_body_of(header), use_bin_type=True)
    (d / "MANIFEST").write_bytes(gen.wrap(body, version=3))
    return d


def _body_of(m):
    from distckpt.manifest import _to_body
    return _to_body(m)


@pytest.mark.parametrize("case,phrase", [
    ("unknown_tensor", "a chunk of 'nope', which is not a tensor of the MANIFEST"),
    ("dropped_chunk", "do not cover the shape"),
    ("twice", "overlap"),
    ("index_beyond_file", "index bytes [4096, 1000004096) lie beyond the end of the file"),
    ("chunk_over_index", "overlap"),
    ("bad_index_bytes", "does not start with"),
])
def test_v3_hostile_indexes_are_refused(tmp_path, case, phrase):
    edit_files, index_records = None, None
    if case == "unknown_tensor":
        index_records = lambda recs: recs + [("nope", recs[0][1])]  # noqa: E731
    elif case == "dropped_chunk":
        index_records = lambda recs: [r for r in recs if r[0] != "model.w"]  # noqa: E731
    elif case == "twice":
        index_records = lambda recs: recs + [recs[0]]  # noqa: E731
    elif case == "index_beyond_file":
        edit_files = lambda fs: [fs[0], FileEntry(fs[1].name, fs[1].size, 1, (4096, 10**9, 0))]  # noqa: E731
    elif case == "chunk_over_index":
        index_records = lambda recs: [(k, dataclasses.replace(c, offset=gen.V3_CHUNK_AREA - 8) if k == "model.w" else c)  # noqa: E731
                                      for k, c in recs]
    elif case == "bad_index_bytes":
        def edit_files(fs):
            return [fs[0], FileEntry(fs[1].name, fs[1].size, 1, (0, 16, crc32c(bytes(16))))]
        data = bytearray(gen.golden_v3_files()[1])
        data[:16] = bytes(16)  # the bytes the hostile index reference points at: crc matches, no magic
    d = _v3_variant(tmp_path / case, edit_files, index_records)
    if case == "bad_index_bytes":
        (d / "rank00001.bin").write_bytes(bytes(data))
    with pytest.raises(ManifestCorruptError) as ei:
        load_manifest(d)
    assert phrase in ei.value.message


def test_v3_keys_are_exactly_the_versions_keys(tmp_path):
    # A version-2 body with an index reference, and a version-3 body without one, are refused.
    plain = to_plain(gen.golden_manifest_v2())
    del plain["format_version"]
    plain["files"][0]["index"] = [0, 8, 0]
    with pytest.raises(ManifestCorruptError, match="unexpected keys \\['index'\\]"):
        decode(gen.wrap(msgpack.packb(plain, use_bin_type=True), version=2))
    body = _body_of(dataclasses.replace(gen.golden_manifest_v3(), tensors={}))
    del body["files"][0]["index"]
    with pytest.raises(ManifestCorruptError, match="missing keys \\['index'\\]"):
        decode_header(gen.wrap(msgpack.packb(body, use_bin_type=True), version=3))


def test_golden_header_layout():
    data = encode(gen.golden_manifest())
    magic, version, flags, length = struct.unpack_from("<8sIIQ", data)
    assert (magic, version, flags, length) == (MAGIC, 1, 0, len(data) - 28)
    assert struct.unpack_from("<I", data, len(data) - 4)[0] == crc32c(data[:-4])
    body = msgpack.unpackb(data[24:-4], raw=False)
    assert list(body) == ["save_id", "world_size", "created_unix", "checksum_algo", "checksum_block",
                          "files", "tensors", "objects", "tree", "meta"]


def _expected_corpus() -> dict[str, str]:
    with open(os.path.join(GOLDEN, "corrupt", "EXPECTED.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("name", sorted(_expected_corpus()))
def test_corrupt_corpus_file_is_rejected(name):
    phrase = _expected_corpus()[name]
    path = os.path.join(GOLDEN, "corrupt", name)
    with pytest.raises(ManifestCorruptError) as ei:
        decode(read_manifest_bytes(path), path=path)
    assert phrase in ei.value.message
    assert ei.value.path == path


def test_corrupt_corpus_is_complete_and_matches_generator():
    stored = {n for n in os.listdir(os.path.join(GOLDEN, "corrupt")) if n.endswith(".bin")}
    assert stored == set(_expected_corpus())
    for name, (data, phrase) in gen.corrupt_corpus().items():
        with open(os.path.join(GOLDEN, "corrupt", name), "rb") as f:
            assert f.read() == data, f"{name} differs from make_golden.py: regenerate only on a version bump"
        assert _expected_corpus()[name] == phrase
    required = {"bad_magic", "version5", "value_kind_in_v1", "flipped_body_byte", "truncated", "extra_byte", "path_traversal",
                "offset_beyond_file", "overlapping_chunks", "non_covering_chunks", "nbytes_mismatch",
                "unknown_dtype", "huge_length"}
    assert {n[:-4] for n in stored} >= required


def test_unsupported_version_names_found_and_supported():
    data = gen.wrap(encode(gen.golden_manifest())[24:-4], version=7)
    with pytest.raises(ManifestCorruptError) as ei:
        decode(data)
    assert "version 7" in str(ei.value) and "supported: 1" in str(ei.value)
    assert ei.value.found_version == 7


# ------------------------------------------------------------------------------------------
# Round trips and canonical encoding.


def test_roundtrip_is_deterministic_and_order_independent():
    t1 = TensorEntry("float32", (2,), (_chunk([0], [2]),))
    t2 = TensorEntry("int8", (3,), (_chunk([0], [3], 1, offset=64),))
    a = _manifest({"a": t1, "b": t2})
    b = _manifest({"b": t2, "a": t1}, tree=a.tree)
    assert encode(a) == encode(b)
    assert decode(encode(a)) == a


def test_tuples_in_tree_and_meta_compare_equal_after_decode():
    t = TensorEntry("float32", (2,), [_chunk([0], [2])])
    m = _manifest({"x": t}, tree={"t": "tuple", "v": ({"t": "ref", "fqn": "x"},)}, meta={"shape": (1, 2)})
    assert m.tree == {"t": "tuple", "v": [{"t": "ref", "fqn": "x"}]}
    assert decode(encode(m)) == m


def test_int_timestamp_encodes_like_float():
    assert encode(dataclasses.replace(_manifest(), created_unix=5)) == encode(dataclasses.replace(_manifest(), created_unix=5.0))


def test_to_plain_is_plain_data():
    plain = to_plain(gen.golden_manifest())
    assert plain["format_version"] == 1
    assert plain["tensors"]["model.w"]["chunks"][0]["offsets"] == [0, 0]
    assert plain["files"][1] == {"name": "rank00001.bin", "size": 4096, "rank": 1}
    # Plain means msgpack-able without hooks.
    assert msgpack.unpackb(msgpack.packb(plain, use_bin_type=True), raw=False, strict_map_key=False) == plain


def test_encode_refuses_invalid_manifest():
    m = _manifest({"x": TensorEntry("float32", (2,), (_chunk([0], [1]),))})
    with pytest.raises(ValueError, match="refusing to encode an invalid manifest.*do not cover"):
        encode(m)


def test_block_crcs_definition():
    data = bytes(range(40))
    assert block_crcs(data, 16) == (crc32c(data[:16]), crc32c(data[16:32]), crc32c(data[32:]))
    assert block_crcs(b"", 16) == ()
    assert data_file_name(3) == "rank00003.bin"


# ------------------------------------------------------------------------------------------
# Validation rules.


@pytest.mark.parametrize(
    "name",
    ["../rank00000.bin", "rank00000.bin/..", "/abs/rank00000.bin", "rank0000.bin", "rank00000.bin\x00",
     "rank\u0660\u0660\u0660\u0660\u0660.bin", "sub/rank00000.bin", "", "RANK00000.BIN"],
)
def test_file_names_cannot_escape(name):
    m = _manifest(files=(FileEntry(name, 10, 0),))
    assert "not a plain data file name" in _corrupt_msg(m)


def test_file_entries():
    two = (FileEntry("rank00000.bin", 0, 0), FileEntry("rank00000.bin", 0, 0))
    assert "listed twice" in _corrupt_msg(_manifest(files=two))
    assert "rank 1 is not in [0, world_size=1)" in _corrupt_msg(_manifest(files=(FileEntry("rank00001.bin", 0, 1),)))
    assert "size" in _corrupt_msg(_manifest(files=(FileEntry("rank00000.bin", -1, 0),)))


def test_all_dtypes_known_with_itemsizes():
    for name in ["float32", "bfloat16", "float16", "float64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                 "float8_e5m2fnuz", "float8_e8m0fnu", "bool", "complex32", "complex64", "complex128",
                 "uint16", "uint32", "uint64", "int8", "uint8", "int16", "int32", "int64"]:
        assert name in DTYPE_ITEMSIZE
    assert DTYPE_ITEMSIZE["bool"] == 1 and DTYPE_ITEMSIZE["complex32"] == 4 and DTYPE_ITEMSIZE["complex128"] == 16


def test_dtype_table_matches_torch():
    torch = pytest.importorskip("torch")
    for name, size in DTYPE_ITEMSIZE.items():
        assert getattr(torch, name).itemsize == size, name


def test_chunk_rules():
    def t(chunks, shape=(4,), dtype="float32"):
        return _manifest({"x": TensorEntry(dtype, shape, tuple(chunks))})

    assert "unknown dtype 'float13'" in _corrupt_msg(t([_chunk([0], [4])], dtype="float13"))
    assert "must both have 1 entries" in _corrupt_msg(t([_chunk([0, 0], [4, 1])]))
    assert "outside the shape" in _corrupt_msg(t([_chunk([2], [4])]))
    assert "file index 1 is out of range" in _corrupt_msg(t([dataclasses.replace(_chunk([0], [4]), file=1)]))
    assert "file index True" in _corrupt_msg(t([dataclasses.replace(_chunk([0], [4]), file=True)]))
    assert "beyond the end of rank00000.bin" in _corrupt_msg(t([_chunk([0], [4], offset=(1 << 20) - 8)]))
    assert "nbytes is 15, expected 16" in _corrupt_msg(t([dataclasses.replace(_chunk([0], [4]), nbytes=15)]))
    assert "2 checksums, expected 1" in _corrupt_msg(t([dataclasses.replace(_chunk([0], [4]), crcs=(0, 0))]))
    assert "not a 32-bit" in _corrupt_msg(t([dataclasses.replace(_chunk([0], [4]), crcs=(1 << 32,))]))
    # Every kind of bad checksum is named, wherever it sits among good ones (checked in bulk).
    for bad in (-1, 1 << 32, True, 1.0, "1", None, (1,)):
        for at in range(3):
            crcs = [7, 8, 9]
            crcs[at] = bad
            sixteen = dataclasses.replace(_chunk([0], [12]), crcs=tuple(crcs))  # 48 bytes: 3 blocks
            assert f"checksum {bad!r} is not a 32-bit" in _corrupt_msg(t([sixteen], shape=(12,))), (bad, at)
    validate(t([dataclasses.replace(_chunk([0], [12]), crcs=(0, (1 << 32) - 1, 5))], shape=(12,)),
             path="/ckpt/MANIFEST")  # the bounds themselves are fine
    assert "overlap" in _corrupt_msg(t([_chunk([0], [3]), _chunk([2], [2], offset=64)]))
    assert "no chunk holds region [3:4]" in _corrupt_msg(t([_chunk([0], [3])]))
    assert "kind" in _corrupt_msg(_manifest({"x": TensorEntry("float32", (4,), (_chunk([0], [4]),), "weird")}))
    # Two chunks whose bytes overlap in the file.
    assert "overlap" in _corrupt_msg(t([_chunk([0], [2]), _chunk([2], [2], offset=4)]))


def test_a_strided_chunk_is_validated_and_never_encoded():
    """Only a chunk read from another format's checkpoint (DCP's channels_last or transposed
    chunks) carries strides: they must lay its box out densely, and no MANIFEST can be written
    with one (the strides are not in the format: the bytes would be read as row-major)."""
    from distckpt.manifest import encode_index

    def t(strides, sizes=(2, 3)):
        chunk = dataclasses.replace(_chunk([0] * len(sizes), list(sizes)), strides=strides)
        return _manifest({"x": TensorEntry("float32", sizes, (chunk,))})

    validate(t((1, 2)), path="/ckpt/MANIFEST")                 # transposed: dense
    validate(t((5, 1), sizes=(1, 3)), path="/ckpt/MANIFEST")   # a size-1 dimension's stride is free
    assert "do not lay sizes [2, 3] out densely" in _corrupt_msg(t((1, 3)))  # a gap
    for bad in ((1, 1), (3,), (-1, 2), (1.0, 2), (True, 2)):   # overlapping, wrong length, not ints
        assert "out densely" in _corrupt_msg(t(bad)), bad
    assert to_plain(t((1, 2)))["tensors"]["x"]["chunks"][0]["strides"] == [1, 2]
    assert "strides" not in to_plain(t(None))["tensors"]["x"]["chunks"][0]
    with pytest.raises(ValueError, match="strided layout"):
        encode(t((1, 2)))
    with pytest.raises(ValueError, match="strided layout"):
        encode_index([("x", dataclasses.replace(_chunk([0, 0], [2, 3]), strides=(1, 2)))])


def test_unhashable_values_from_hostile_input_are_typed_errors():
    m = _manifest({"x": TensorEntry(["float32"], (4,), (_chunk([0], [4]),))})  # type: ignore[arg-type]
    assert "unknown dtype" in _corrupt_msg(m)
    m = _manifest(objects={"o": ObjectEntry({"k": 1}, 1)})  # type: ignore[arg-type]
    assert "kind" in _corrupt_msg(m)


def test_empty_and_scalar_tensors():
    # No elements: no chunks needed; zero-volume chunks are allowed and hold no bytes.
    validate(_manifest({"e": TensorEntry("float32", (0, 5), ())}))
    validate(_manifest({"e": TensorEntry("float32", (0, 5), (_chunk([0, 0], [0, 5]),))}))
    # A zero-volume chunk inside a non-empty tensor is ignored by the coverage check.
    validate(_manifest({"x": TensorEntry("float32", (4,), (_chunk([0], [4]), _chunk([2], [0], offset=64)))}))
    # A scalar is one chunk with offsets () and sizes ().
    validate(_manifest({"s": TensorEntry("int64", (), (_chunk([], [], 8),))}))
    assert "do not cover" in _corrupt_msg(_manifest({"s": TensorEntry("int64", (), ())}))
    two = (_chunk([], [], 8), _chunk([], [], 8, offset=64))
    assert "overlap" in _corrupt_msg(_manifest({"s": TensorEntry("int64", (), two)}))


def test_objects():
    ok = {k: ObjectEntry(k, v) for k, v in
          [("int", -5), ("float", 1.5), ("bool", False), ("str", "s"), ("bytes", b"b"), ("none", None), ("pickle", b"p")]}
    m = _manifest(objects=ok)
    assert decode(encode(m)) == m
    assert "needs a int value, found bool" in _corrupt_msg(_manifest(objects={"o": ObjectEntry("int", True)}))
    assert "needs a float value, found int" in _corrupt_msg(_manifest(objects={"o": ObjectEntry("float", 1)}))
    assert "does not fit in 64 bits" in _corrupt_msg(_manifest(objects={"o": ObjectEntry("int", 1 << 64)}))
    assert "is not one of" in _corrupt_msg(_manifest(objects={"o": ObjectEntry("set", b"")}))
    t = TensorEntry("float32", (1,), (_chunk([0], [1]),))
    m = _manifest({"x": t}, {"x": ObjectEntry("int", 1)}, tree={"t": "ref", "fqn": "x"})
    assert "also a tensor" in _corrupt_msg(m)


def test_tree_rules():
    o = {"a": ObjectEntry("int", 1), "b": ObjectEntry("int", 2)}
    ref = lambda f: {"t": "ref", "fqn": f}  # noqa: E731
    # str and int keys are distinct and keep their type.
    m = _manifest(objects=o, tree={"t": "dict", "k": [[1, ref("a")], ["1", ref("b")]]})
    assert decode(encode(m)).tree["k"][0][0] == 1
    cases = [
        ({"t": "dict", "k": [[1, ref("a")], [1, ref("b")]]}, "duplicate dict key 1"),
        ({"t": "dict", "k": [[True, ref("a")], ["b", ref("b")]]}, "must be a str or an int"),
        ({"t": "list", "v": [ref("a"), ref("a"), ref("b")]}, "referenced more than once"),
        ({"t": "list", "v": [ref("a")]}, "not referenced"),
        ({"t": "list", "v": [ref("a"), ref("zz")]}, "refers to 'zz'"),
        ({"t": "set", "v": [ref("a"), ref("b")]}, "unknown node type 'set'"),
        ({"t": "list", "v": [ref("a"), ref("b")], "x": 1}, "has keys"),
        ({"t": "dict", "k": [[1]]}, "[key, node] pair"),
        ("nope", "expected a node"),
    ]
    for tree, phrase in cases:
        assert phrase in _corrupt_msg(_manifest(objects=o, tree=tree)), phrase
    deep: dict = ref("a")
    for _ in range(150):
        deep = {"t": "list", "v": [deep]}
    assert "deeper than" in _corrupt_msg(_manifest(objects={"a": o["a"]}, tree=deep))


def test_meta_must_be_plain():
    assert "not plain data" in _corrupt_msg(_manifest(meta={"x": {1, 2}}))
    assert "key 1 is not a str" in _corrupt_msg(_manifest(meta={"x": {1: 2}}))


# ------------------------------------------------------------------------------------------
# Hostile bytes (valid header and checksum, crafted body).


def _wrap_obj(body) -> bytes:
    return gen.wrap(msgpack.packb(body, use_bin_type=True))


def test_duplicate_map_keys_rejected():
    good = encode(gen.golden_manifest())[24:-4]
    # Append a second "meta" key by hand: a map of 11 entries whose last key repeats.
    assert good[0] == 0x8A  # fixmap with 10 entries
    body = bytes([0x8B]) + good[1:] + msgpack.packb("meta") + msgpack.packb({})
    with pytest.raises(ManifestCorruptError, match="duplicate map key 'meta'"):
        decode(gen.wrap(body))


def test_deep_nesting_and_odd_types_rejected():
    with pytest.raises(ManifestCorruptError, match="not valid msgpack"):
        decode(gen.wrap(b"\x91" * 100_000 + b"\xc0"))
    with pytest.raises(ManifestCorruptError, match="body: expected a map"):
        decode(_wrap_obj([1, 2]))
    plain = to_plain(gen.golden_manifest())
    del plain["format_version"]
    plain["meta"] = {"when": msgpack.Timestamp(0)}
    with pytest.raises(ManifestCorruptError, match="Timestamp is not plain data"):
        decode(_wrap_obj(plain))
    plain["meta"] = {b"k": 1}
    with pytest.raises(ManifestCorruptError):
        decode(_wrap_obj(plain))
    with pytest.raises(ManifestCorruptError, match="after the body"):
        decode(gen.wrap(msgpack.packb({}) + b"\xc0"))


def test_declared_array_longer_than_body_is_rejected_without_allocating():
    with pytest.raises(ManifestCorruptError, match="not valid msgpack"):
        decode(gen.wrap(b"\xdd\xff\xff\xff\xff"))


_plain_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(),
                        st.text(max_size=8), st.binary(max_size=8))
_plain = st.recursive(_plain_leaf, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                          st.dictionaries(st.text(max_size=6), kids, max_size=4)),
                      max_leaves=20)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_mutated_body_only_raises_manifest_corrupt(data):
    plain = to_plain(gen.golden_manifest())
    del plain["format_version"]
    # Replace one node somewhere in the body with random plain data.
    node = plain
    path = []
    while isinstance(node, (dict, list)) and node and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(list(node) if isinstance(node, dict) else list(range(len(node)))))
        path.append(key)
        node = node[key]
    if path:
        parent = plain
        for k in path[:-1]:
            parent = parent[k]
        parent[path[-1]] = data.draw(_plain)
    try:
        m = decode(_wrap_obj(plain))
    except ManifestCorruptError:
        return
    # Whatever decodes re-encodes canonically (bytes, not ==: a NaN in meta is not equal to itself).
    assert encode(decode(encode(m))) == encode(m)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 1700), st.integers(0, 255))
def test_fuzz_raw_bytes_only_raise_manifest_corrupt(junk, pos, xor):
    good = bytearray(encode(gen.golden_manifest()))
    good[min(pos, len(good) - 1)] ^= xor
    for data in (bytes(good), junk, gen.wrap(junk), MAGIC + junk):
        try:
            decode(data)
        except ManifestCorruptError:
            pass


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_fuzz_v3_index_past_its_crc_only_raises_manifest_corrupt(data):
    """A version-3 index damaged and then given a matching crc32c in the MANIFEST (a hostile
    writer, not a flipped bit): decoding either gives a manifest that validates or raises
    ManifestCorruptError; never another exception, never chunks outside the rules."""
    from distckpt.manifest import encode_index
    m = gen.golden_manifest_v3()
    records = [(k, c) for k, t in m.tensors.items() for c in t.chunks if c.file == 1]
    raw = bytearray(encode_index(records))
    how = data.draw(st.sampled_from(["flip", "cut", "junk", "record"]))
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(8, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
    elif how == "cut":
        raw = raw[: data.draw(st.integers(8, len(raw) - 1))]
    elif how == "junk":
        raw = bytearray(b"DCKPTIX3" + data.draw(st.binary(max_size=300)))
    else:  # one record replaced by random plain values of the right arity
        j = data.draw(st.integers(0, len(records) - 1))
        plain = st.one_of(st.integers(-2, 2**64 - 1), st.text(max_size=5), st.lists(st.integers(-1, 10), max_size=3),
                          st.binary(max_size=12), st.none())
        rows = msgpack.unpackb(bytes(raw[8:]), raw=False)
        rows[j] = [data.draw(plain) for _ in range(6)]
        raw = bytearray(b"DCKPTIX3" + msgpack.packb(rows, use_bin_type=True))
    files = list(m.files)
    files[1] = FileEntry(files[1].name, gen.V3_CHUNK_AREA + len(raw), 1,
                         (gen.V3_CHUNK_AREA, max(len(raw), 8), crc32c(bytes(raw))))
    header = dataclasses.replace(m, files=tuple(files), tensors={k: dataclasses.replace(t, chunks=None)
                                                                 for k, t in m.tensors.items()})
    indexes = {0: gen.golden_v3_files()[0][gen.V3_CHUNK_AREA:], 1: bytes(raw)}
    try:
        out = decode(encode(header), read_index=lambda h, i: indexes[i])
    except ManifestCorruptError:
        return
    validate(out)


# ------------------------------------------------------------------------------------------
# Scale.


def test_ten_thousand_chunks_validate_quickly():
    grid = _grid((1000, 1000), [list(range(10, 1000, 10)), list(range(10, 1000, 10))])
    cols = _grid((8, 10_000), [[], list(range(1, 10_000))])
    assert len(grid) == len(cols) == 10_000
    files = (FileEntry("rank00000.bin", 1 << 30, 0),)
    for chunks, shape in ((grid, (1000, 1000)), (cols, (8, 10_000))):
        m = _manifest({"w": TensorEntry("float32", shape, chunks)}, files=files)
        data = encode(m)  # validates the 10k-chunk tiling (the speed is a benchmark's business)
        assert decode(data) == m
    # The same grid with one chunk missing is caught.
    m = _manifest({"w": TensorEntry("float32", (1000, 1000), grid[:5000] + grid[5001:])}, files=files)
    assert "no chunk holds region [500:510, 0:10]" in _corrupt_msg(m)


# ------------------------------------------------------------------------------------------
# Reading files.


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_read_and_load_manifest(tmp_path):
    data = encode(gen.golden_manifest())
    (tmp_path / "MANIFEST").write_bytes(data)
    before = _fd_count()
    assert read_manifest_bytes(tmp_path / "MANIFEST") == data
    assert load_manifest(tmp_path) == gen.golden_manifest()
    assert load_manifest(tmp_path / "MANIFEST") == gen.golden_manifest()
    assert _fd_count() == before


def test_missing_manifest_is_incomplete(tmp_path):
    before = _fd_count()
    with pytest.raises(CheckpointIncompleteError) as ei:
        load_manifest(tmp_path)
    assert ei.value.path == str(tmp_path / "MANIFEST")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "MANIFEST").mkdir()
    with pytest.raises(ManifestCorruptError, match="not a regular file"):
        read_manifest_bytes(tmp_path / "d" / "MANIFEST")
    assert _fd_count() == before


def test_a_manifest_over_the_readers_limit_is_never_committed(tmp_path, monkeypatch):
    # Readers refuse a body over MAX_MANIFEST_BYTES; a writer that produced one would commit a
    # checkpoint nobody can load (about 17 M chunks at the real limit). Here the limit is lowered.
    import torch

    import distckpt
    from distckpt import manifest as mf
    from distckpt.errors import UnsupportedValueError
    sd = {f"t{i}": torch.zeros(2) for i in range(20)}
    distckpt.save(sd, tmp_path / "fits")
    size = len(read_manifest_bytes(tmp_path / "fits" / "MANIFEST"))
    monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", size // 2)
    with pytest.raises(UnsupportedValueError, match="would be .* more than the .* bytes every reader accepts"):
        distckpt.save(sd, tmp_path / "big")
    assert sorted(os.listdir(tmp_path)) == ["fits"]  # nothing committed, nothing left behind
