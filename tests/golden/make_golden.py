"""Regenerate the MANIFEST golden file and the corrupt-file corpus.

Usage (from the repository root)::

    .venv/bin/python tests/golden/make_golden.py

Writes ``tests/golden/manifest_v1.bin``, ``tests/golden/manifest_v2.bin`` (format 2: the typed value
nodes of object kind ``value``), ``tests/golden/v3/`` (format 3: a whole checkpoint directory,
MANIFEST plus the two data files whose indexes hold the chunk records), ``tests/golden/v4/``
(format 4: the same data files, the MANIFEST saying where each tensor's chunks are) and
``tests/golden/corrupt/*.bin`` plus
``tests/golden/corrupt/EXPECTED.json`` ({file name: a phrase its ManifestCorruptError message must
contain}). The tests never run this script: they compare the stored bytes with what the code
produces. Regenerating is only right when the format version changes (add ``manifest_v2.bin`` and
keep the v1 file, so readers keep proving they reject or read it). If ``manifest_v1.bin`` changes
while the version stays 1, the encoder broke the format.

The corrupt corpus has two families: byte damage of the golden file (magic, version, flags,
lengths, checksum), and well-formed files (valid header and crc32c) whose body breaks one schema
rule, built by editing the golden body and re-wrapping it with :func:`wrap`.
"""

from __future__ import annotations

import copy
import json
import os
import struct
import sys
from typing import Any, Callable

import msgpack

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from distckpt.checksum import crc32c  # noqa: E402
from distckpt.manifest import (  # noqa: E402
    ChunkRecord,
    FileEntry,
    Manifest,
    ObjectEntry,
    TensorEntry,
    block_crcs,
    encode,
    encode_index,
    to_plain,
)

CHECKSUM_BLOCK = 16  # tiny, so that chunks have several checksum blocks


def _pattern(n: int, seed: int) -> bytes:
    # Deterministic chunk bytes: the checksums in the golden file are crc32c of these.
    return bytes((seed * 31 + i * 7) & 0xFF for i in range(n))


def golden_manifest() -> Manifest:
    """The fixed manifest stored in manifest_v1.bin (two ranks, every kind of entry)."""
    file_sizes = [4096, 4096]
    chunks_spec = {
        # fqn: (dtype, shape, kind, [(offsets, sizes, file, offset)])
        "model.w": ("float32", (4, 6), "dtensor", [((0, 0), (2, 6), 0, 0), ((2, 0), (2, 6), 1, 0)]),
        "model.b": ("bfloat16", (6,), "tensor", [((0,), (6,), 0, 512)]),
        "step_t": ("int64", (), "tensor", [((), (), 1, 512)]),
        "empty": ("float16", (0, 3), "tensor", []),
        "opt.0.exp_avg": (
            "float8_e4m3fn",
            (2, 4),
            "sharded_tensor",
            [((0, 0), (2, 2), 0, 1024), ((0, 2), (2, 2), 1, 1024)],
        ),
        "cplx": ("complex64", (3,), "tensor", [((0,), (3,), 0, 1536)]),
    }
    itemsize = {"float32": 4, "bfloat16": 2, "int64": 8, "float16": 2, "float8_e4m3fn": 1, "complex64": 8}
    tensors = {}
    seed = 0
    for fqn, (dtype, shape, kind, specs) in chunks_spec.items():
        chunks = []
        for offsets, sizes, file, offset in specs:
            n = itemsize[dtype]
            for s in sizes:
                n *= s
            seed += 1
            chunks.append(ChunkRecord(offsets, sizes, file, offset, n, block_crcs(_pattern(n, seed), CHECKSUM_BLOCK)))
        tensors[fqn] = TensorEntry(dtype, shape, tuple(chunks), kind)
    objects = {
        "step": ObjectEntry("int", 100),
        "lr": ObjectEntry("float", 0.001),
        "name": ObjectEntry("str", "golden run"),
        "flag": ObjectEntry("bool", True),
        "blob": ObjectEntry("bytes", b"\x00\x01\xff"),
        "nothing": ObjectEntry("none", None),
        "pickled": ObjectEntry("pickle", b"\x80\x04N."),  # pickle.dumps(None); never unpickled here
    }
    ref = lambda fqn: {"t": "ref", "fqn": fqn}  # noqa: E731
    tree = {
        "t": "dict",
        "k": [
            ["model", {"t": "dict", "k": [["w", ref("model.w")], ["b", ref("model.b")]]}],
            ["optim", {"t": "dict", "k": [[0, {"t": "dict", "k": [["exp_avg", ref("opt.0.exp_avg")]]}]]}],
            ["extra", {"t": "list", "v": [ref("step_t"), ref("empty"), {"t": "tuple", "v": [ref("cplx"), ref("blob")]}]}],
            ["step", ref("step")],
            ["lr", ref("lr")],
            ["name", ref("name")],
            ["flag", ref("flag")],
            ["nothing", ref("nothing")],
            ["pickled", ref("pickled")],
        ],
    }
    return Manifest(
        format_version=1,
        save_id="golden-0001",
        world_size=2,
        created_unix=1700000000.5,
        checksum_algo="crc32c",
        checksum_block=CHECKSUM_BLOCK,
        files=(FileEntry("rank00000.bin", file_sizes[0], 0), FileEntry("rank00001.bin", file_sizes[1], 1)),
        tensors=tensors,
        objects=objects,
        tree=tree,
        meta={"io_backend": "pwrite", "distckpt_version": "0.1.0", "step": 100, "user": {"note": "golden", "xs": [1, 2.5, None, True, b"x"]}},
    )


def golden_manifest_v2() -> Manifest:
    """manifest_v2.bin: the v1 golden manifest as format 2, plus one object of kind ``value`` per
    value node type (distckpt/values.py)."""
    m = golden_manifest()
    values = {
        "v.betas": {"t": "tuple", "v": [0.9, 0.95]},
        "v.buffer": {"t": "list", "v": [1, 2, {"t": "dict", "k": [[0, "a"], [{"t": "tuple", "v": [1, 2]}, None]]}]},
        "v.set": {"t": "set", "v": [1, 2]},
        "v.frozenset": {"t": "frozenset", "v": ["a"]},
        "v.bigint": {"t": "int", "v": "1180591620717411303424"},
        "v.size": {"t": "size", "v": [2, 3]},
        "v.dtype": {"t": "dtype", "v": "bfloat16"},
        "v.device": {"t": "device", "v": "cpu"},
        "v.namedtuple": {"t": "namedtuple", "c": "collections:OrderedDict", "f": ["a"], "v": [1]},
        "v.enum": {"t": "enum", "c": "enum:Enum", "v": "X"},
        "v.dataclass": {"t": "dataclass", "c": "mod:DC", "f": [["x", 1]]},
        "v.numpy": {"t": "numpy", "d": "<f4", "s": None, "v": b"\x00\x00\xc0?"},
        "v.ndarray": {"t": "numpy", "d": "<i8", "s": [2], "v": bytes(16)},
    }
    objects = dict(m.objects)
    objects.update({k: ObjectEntry("value", v) for k, v in values.items()})
    tree = copy.deepcopy(m.tree)
    tree["k"].append(["v", {"t": "dict", "k": [[k[2:], {"t": "ref", "fqn": k}] for k in values]}])
    return Manifest(format_version=2, save_id="golden-0002", world_size=m.world_size, created_unix=m.created_unix,
                    checksum_algo=m.checksum_algo, checksum_block=m.checksum_block, files=m.files,
                    tensors=m.tensors, objects=objects, tree=tree, meta=m.meta)


V3_CHUNK_AREA = 4096  # each v3 data file: the v1 golden chunk bytes in 4096 bytes, then its index


def golden_v3_files() -> list[bytes]:
    """The two data files of tests/golden/v3: each chunk's pattern bytes at its offset, zeros
    between, the file's index at offset 4096."""
    m = golden_manifest_v2()
    areas = [bytearray(V3_CHUNK_AREA) for _ in m.files]
    records: list[list] = [[] for _ in m.files]
    seed = 0
    for fqn, t in m.tensors.items():  # the order golden_manifest() numbered the patterns in
        for c in t.chunks:
            seed += 1
            areas[c.file][c.offset:c.offset + c.nbytes] = _pattern(c.nbytes, seed)
            records[c.file].append((fqn, c))
    return [bytes(area) + encode_index(recs) for area, recs in zip(areas, records)]


def golden_manifest_v3() -> Manifest:
    """tests/golden/v3/MANIFEST as decode() returns it: the v2 golden manifest as format 3, each
    file with its index reference (the chunks themselves are in the data files)."""
    m = golden_manifest_v2()
    files = tuple(FileEntry(f.name, len(data), f.rank, (V3_CHUNK_AREA, len(data) - V3_CHUNK_AREA,
                                                        crc32c(data[V3_CHUNK_AREA:])))
                  for f, data in zip(m.files, golden_v3_files()))
    return Manifest(format_version=3, save_id="golden-0003", world_size=m.world_size, created_unix=m.created_unix,
                    checksum_algo=m.checksum_algo, checksum_block=m.checksum_block, files=files,
                    tensors=m.tensors, objects=m.objects, tree=m.tree, meta=m.meta)


#: Where each golden tensor's chunks are (format 4): the grid tensors are split evenly over one
#: 2-rank mesh, the others listed by the ranks whose files hold them.
V4_MESHES = (((2,), (0, 1)),)
V4_WHERE = {
    "model.w": ("grid", 0, (0,)),
    "opt.0.exp_avg": ("grid", 0, (1,)),
    "model.b": ("ranks", ((0, 1),)),
    "cplx": ("ranks", ((0, 1),)),
    "step_t": ("ranks", ((1, 2),)),
    "empty": ("ranks", ()),
}


def golden_manifest_v4() -> Manifest:
    """tests/golden/v4/MANIFEST as decode() returns it: the v3 golden checkpoint (same data files)
    as format 4, each tensor with its ``where`` and the manifest with its meshes."""
    m = golden_manifest_v3()
    tensors = {fqn: TensorEntry(t.dtype, t.shape, t.chunks, t.kind, V4_WHERE[fqn]) for fqn, t in m.tensors.items()}
    return Manifest(format_version=4, save_id="golden-0004", world_size=m.world_size, created_unix=m.created_unix,
                    checksum_algo=m.checksum_algo, checksum_block=m.checksum_block, files=m.files,
                    tensors=tensors, objects=m.objects, tree=m.tree, meta=m.meta, meshes=V4_MESHES)


def wrap(body: bytes, *, version: int = 1, flags: int = 0, length: int | None = None) -> bytes:
    """Header + body + crc32c, with a valid checksum over whatever header fields are given."""
    head = b"DCKPTMF1" + struct.pack("<IIQ", version, flags, len(body) if length is None else length) + body
    return head + struct.pack("<I", crc32c(head))


def _body() -> dict[str, Any]:
    plain = to_plain(golden_manifest())
    del plain["format_version"]  # lives in the header, not the body
    return plain


def _schema_case(edit: Callable[[dict], None]) -> bytes:
    body = copy.deepcopy(_body())
    edit(body)
    return wrap(msgpack.packb(body, use_bin_type=True))


def _v2_case(edit: Callable[[dict], None]) -> bytes:
    plain = to_plain(golden_manifest_v2())
    del plain["format_version"]
    edit(plain)
    return wrap(msgpack.packb(plain, use_bin_type=True), version=2)


def _flip_body_byte(data: bytes) -> bytes:
    b = bytearray(data)
    b[40] ^= 0x01  # inside the body; the stored crc32c no longer matches
    return bytes(b)


def _set(path: list, value: Any) -> Callable[[dict], None]:
    def edit(body: dict) -> None:
        node = body
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value

    return edit


def _shrink_last_chunk(body: dict) -> None:
    # Row 3 of model.w is left uncovered; nbytes and crcs stay consistent with the smaller box.
    chunk = body["tensors"]["model.w"]["chunks"][1]
    chunk["sizes"] = [1, 6]
    chunk["nbytes"] = 24
    chunk["crcs"] = chunk["crcs"][:2]


def corrupt_corpus() -> dict[str, tuple[bytes, str]]:
    """{file name: (bytes, phrase the error message must contain)}."""
    good = encode(golden_manifest())
    body = good[24:-4]
    w = ["tensors", "model.w", "chunks"]
    return {
        "bad_magic.bin": (b"DCKPTMF0" + good[8:], "bad magic"),
        "empty.bin": (b"", "bad magic"),
        "version5.bin": (wrap(body, version=5), "format version 5 is not supported by this reader (supported: 1, 2, 3, 4)"),
        "value_kind_in_v1.bin": (_schema_case(_set(["objects", "name"], {"kind": "value", "value": "x"})),
                                 "kind 'value' needs format version 2"),
        "bad_value_node.bin": (_v2_case(_set(["objects", "v.size", "value", "v"], ["x"])),
                               "a 'size' value node needs a list of non-negative ints"),
        # A torch.Size holds int64: a dimension of 2**63 is no size (it loaded, then failed in use).
        "size_dim_2_63.bin": (_v2_case(_set(["objects", "v.size", "value", "v"], [2**63])),
                              "a 'size' value node needs a list of non-negative ints below 2**63"),
        "int_not_decimal.bin": (_v2_case(_set(["objects", "v.size", "value"], {"t": "int", "v": " 1_000 "})),
                                "' 1_000 ' is not a decimal integer"),
        # On an object store the save id names the data objects' prefix: never a path.
        "save_id_traversal.bin": (_schema_case(_set(["save_id"], "../step_2/x")), "save_id: '../step_2/x' is not a plain id"),
        "save_id_empty.bin": (_schema_case(_set(["save_id"], "")), "save_id: '' is not a plain id"),
        "flags.bin": (wrap(body, flags=1), "flags are 0x00000001"),
        "flipped_body_byte.bin": (_flip_body_byte(good), "checksum mismatch"),
        "truncated.bin": (good[:-10], "truncated"),
        "header_only.bin": (good[:20], "truncated"),
        "extra_byte.bin": (good + b"\x00", "1 unexpected bytes after the checksum"),
        "huge_length.bin": (wrap(body, length=1 << 62), "exceeds the limit"),
        "not_msgpack.bin": (wrap(b"\xc1" + body[1:]), "not valid msgpack"),
        "ext_type.bin": (wrap(b"\xd4\x05\x00"), "ext type 5 is not allowed"),
        "path_traversal.bin": (_schema_case(_set(["files", 0, "name"], "../x")), "'../x' is not a plain data file name"),
        "absolute_path.bin": (_schema_case(_set(["files", 0, "name"], "/etc/passwd")), "is not a plain data file name"),
        "offset_beyond_file.bin": (_schema_case(_set(w + [0, "offset"], 4090)), "lie beyond the end of rank00000.bin"),
        "overlapping_chunks.bin": (_schema_case(_set(w + [1, "offsets"], [1, 0])), "overlap"),
        "non_covering_chunks.bin": (_schema_case(_shrink_last_chunk), "do not cover the shape"),
        "nbytes_mismatch.bin": (_schema_case(_set(w + [0, "nbytes"], 47)), "nbytes is 47, expected 48"),
        "crc_count_mismatch.bin": (_schema_case(_set(w + [0, "crcs"], [1])), "1 checksums, expected 3"),
        "unknown_dtype.bin": (_schema_case(_set(["tensors", "model.w", "dtype"], "float13")), "unknown dtype 'float13'"),
        "file_index_out_of_range.bin": (_schema_case(_set(w + [0, "file"], 7)), "file index 7 is out of range"),
        "dangling_ref.bin": (_schema_case(_set(["tree", "k", 3, 1, "fqn"], "nope")), "refers to 'nope'"),
        "missing_key.bin": (_schema_case(lambda b: b.pop("meta")), "missing keys ['meta']"),
        # Sizes torch cannot hold (int64): an empty tensor whose dimensions overflow, one whose
        # non-zero dimensions overflow the storage size, a file size that is no off_t.
        "dim_overflow.bin": (_schema_case(_set(["tensors", "empty", "shape"], [2**63, 2**63, 0])),
                             "expected an integer in [0, 2**63), found 9223372036854775808"),
        "dim_u64_max.bin": (_schema_case(_set(["tensors", "empty", "shape"], [2**64 - 1, 0])),
                            "expected an integer in [0, 2**63), found 18446744073709551615"),
        "storage_overflow.bin": (_schema_case(_set(["tensors", "empty", "shape"], [2**40, 2**40, 0, 2**40])),
                                 "is too large: the product of its non-zero dimensions is 2658455991569831745807614120560689152 bytes"),
        "file_size_overflow.bin": (_schema_case(_set(["files", 0, "size"], 2**63)),
                                   "size: expected an integer in [0, 2**63)"),
        # Readers size their read buffers from checksum_block: anything past the largest block a
        # writer uses (2**30) is refused before it sizes an allocation (2**44 failed with ENOMEM,
        # 2**63 with OverflowError). The crc counts are left as they were (one per chunk fits).
        "checksum_block_2_31.bin": (_schema_case(_set(["checksum_block"], 2**31)),
                                    "checksum_block: expected an integer in [1, 2**30] (the largest block a writer "
                                    "uses), found 2147483648"),
        "checksum_block_2_44.bin": (_schema_case(_set(["checksum_block"], 2**44)),
                                    "found 17592186044416"),
        "checksum_block_2_63.bin": (_schema_case(_set(["checksum_block"], 2**63)),
                                    "found 9223372036854775808"),
        "checksum_block_zero.bin": (_schema_case(_set(["checksum_block"], 0)),
                                    "checksum_block: expected an integer in [1, 2**30]"),
    }


def main() -> None:
    with open(os.path.join(HERE, "manifest_v1.bin"), "wb") as f:
        f.write(encode(golden_manifest()))
    with open(os.path.join(HERE, "manifest_v2.bin"), "wb") as f:
        f.write(encode(golden_manifest_v2()))
    os.makedirs(os.path.join(HERE, "v3"), exist_ok=True)
    with open(os.path.join(HERE, "v3", "MANIFEST"), "wb") as f:
        f.write(encode(golden_manifest_v3()))
    for i, data in enumerate(golden_v3_files()):
        with open(os.path.join(HERE, "v3", f"rank{i:05d}.bin"), "wb") as f:
            f.write(data)
    os.makedirs(os.path.join(HERE, "v4"), exist_ok=True)
    with open(os.path.join(HERE, "v4", "MANIFEST"), "wb") as f:
        f.write(encode(golden_manifest_v4()))
    for i, data in enumerate(golden_v3_files()):  # the v3 data files, unchanged
        with open(os.path.join(HERE, "v4", f"rank{i:05d}.bin"), "wb") as f:
            f.write(data)
    out = os.path.join(HERE, "corrupt")
    os.makedirs(out, exist_ok=True)
    expected = {}
    for name, (data, phrase) in sorted(corrupt_corpus().items()):
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
        expected[name] = phrase
    with open(os.path.join(out, "EXPECTED.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote manifest_v1.bin, manifest_v2.bin, v3/, v4/ and {len(expected)} corrupt files under {HERE}")


if __name__ == "__main__":
    main()
