"""Format-3 fields that size anything, taken from a real checkpoint: bounded, typed, and the same
verdict from load, read and verify.

* A ``checksum_block`` past the largest block a writer uses (2**30) is refused by all three with
  the same ManifestCorruptError naming the field, the bound and the value (it sized the read
  buffers: ENOMEM, OverflowError); at the bound, the buffers are sized by the chunks.
* Seeded random mutations of a small checkpoint's MANIFEST fields and data file index entries
  (re-checksummed, so that they get past the crc32c checks): every load / read / verify either
  succeeds bit-exactly or raises a DistCkptError subclass, within a time bound, with no fd left
  open; a read that succeeds means verify finds the checkpoint sound.
"""

from __future__ import annotations

import copy
import os
import random
import shutil
import signal
import struct

import msgpack
import pytest
import torch

import distckpt
from distckpt import fill as fill_mod
from distckpt.checksum import crc32c
from distckpt import manifest as mf
from distckpt.errors import DistCkptError, ManifestCorruptError
from distckpt.verify import verify


def _state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(64, 48, generator=g), "b": torch.arange(40, dtype=torch.int64),
            "h": torch.randn(3, 5, generator=g).to(torch.bfloat16), "step": 3}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fuzz") / "ck")
    distckpt.save(_state(), path, no_dist=True)
    return path


def _write_manifest(path: str, body: dict) -> None:
    """A MANIFEST with a valid header and crc32c around ``body`` (past the byte-level checks)."""
    raw = msgpack.packb(body, use_bin_type=True)
    head = mf._HEADER.pack(mf.MAGIC, mf.FORMAT_VERSION, 0, len(raw)) + raw
    with open(os.path.join(path, "MANIFEST"), "wb") as f:
        f.write(head + struct.pack("<I", crc32c(head)))


def _body(path: str) -> dict:
    data = open(os.path.join(path, "MANIFEST"), "rb").read()
    return msgpack.unpackb(data[24:-4], raw=False)


def _copy(good: str, dst: str) -> str:
    shutil.copytree(good, dst)
    return dst


def _outcomes(path: str) -> dict:
    """{'read' | 'load' | 'verify': the result or the exception} for the checkpoint at ``path``."""
    out = {}
    try:
        out["read"] = distckpt.read(path)
    except Exception as exc:  # noqa: BLE001 - classified by the callers
        out["read"] = exc
    dest = {"w": torch.zeros(64, 48), "b": torch.zeros(40, dtype=torch.int64),
            "h": torch.zeros(3, 5, dtype=torch.bfloat16), "step": 0}
    try:
        distckpt.load(dest, path, no_dist=True)
        out["load"] = dest
    except Exception as exc:  # noqa: BLE001
        out["load"] = exc
    try:
        out["verify"] = verify(path)
    except Exception as exc:  # noqa: BLE001
        out["verify"] = exc
    return out


@pytest.mark.parametrize("block", [2**31, 2**44, 2**63, 0])
def test_huge_checksum_block_is_refused_alike_by_load_read_and_verify(good, tmp_path, block):
    p = _copy(good, str(tmp_path / "ck"))
    body = _body(p)
    body["checksum_block"] = block
    _write_manifest(p, body)
    out = _outcomes(p)
    for op, got in out.items():
        assert isinstance(got, ManifestCorruptError), (op, got)
        assert "checksum_block" in got.message and "2**30" in got.message and f"found {block}" in got.message, \
            (op, got.message)
    from distckpt.cli import main
    assert main(["verify", p, "--no-progress"]) == 1


@pytest.mark.parametrize("case", ["set twice", "device"])
def test_a_value_load_refuses_fails_verify_too(tmp_path, case):
    """A value node that passes the MANIFEST's structural checks but that no save writes (a set
    holding one element twice, a device string torch cannot parse): load refused it with
    ManifestCorruptError while `distckpt verify` said OK (an outside trial). verify now builds the
    values as a load does (no code runs) and reports it against the MANIFEST."""
    p = str(tmp_path / "ck")
    distckpt.save({"w": torch.ones(2), "s": {1, 2}, "d": torch.device("cpu")}, p, no_dist=True)
    body = _body(p)
    if case == "set twice":
        body["objects"]["s"]["value"]["v"] = [1, 1]
    else:
        body["objects"]["d"]["value"]["v"] = "cpu:x"
    _write_manifest(p, body)
    out = _outcomes(p)
    assert isinstance(out["read"], ManifestCorruptError), out  # as a load of it
    report = out["verify"]
    assert not report.ok and [f.file for f in report.file_problems] == ["MANIFEST"], report
    from distckpt.cli import main
    assert main(["verify", p, "--no-progress"]) == 1


def test_checksum_block_at_the_bound_reads_with_buffers_sized_by_the_chunks(good, tmp_path, monkeypatch):
    """2**30 is a block a writer may use (DISTCKPT_CHECKSUM_BLOCK=1G): every chunk here is one
    partial block, whose crc32c is the one a small block gave (each chunk fits one), so the
    checkpoint reads bit-exactly; the read buffers follow the chunks, not the 1 GiB block."""
    p = _copy(good, str(tmp_path / "ck"))
    body = _body(p)
    assert body["checksum_block"] >= max(t.numel() * t.element_size() for t in _state().values()
                                         if isinstance(t, torch.Tensor))
    body["checksum_block"] = 1 << 30
    _write_manifest(p, body)
    sizes = []
    real = fill_mod.mmap.mmap

    class _Mmap:  # records the size of every buffer fill maps
        PAGESIZE = fill_mod.mmap.PAGESIZE

        @staticmethod
        def mmap(fd, size, *a, **k):
            sizes.append(size)
            return real(fd, size, *a, **k)

    monkeypatch.setattr(fill_mod, "mmap", _Mmap)
    got = distckpt.read(p)
    for k, v in _state().items():
        assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v
    assert sizes and max(sizes) <= 64 << 20, sizes
    assert verify(p).ok


# ------------------------------------------------------------------------------------------------
# Seeded mutations of the format-3 fields.

_NUMBERS = [0, 1, 2, 7, 4095, 4096, 4097, 2**30, 2**30 + 1, 2**31, 2**32, 2**44, 2**62, 2**63 - 1, 2**63,
            2**64 - 1, -1, -(2**63)]
_ODD = [None, True, "x", 1.5, [], {}, b"\x00", [1, 2]]


def _mutant(rng: random.Random, value):
    """A hostile replacement for ``value``: a boundary number, a near neighbour, or another type."""
    r = rng.random()
    if isinstance(value, bool) or not isinstance(value, int):
        return rng.choice(_NUMBERS + _ODD)
    if r < 0.5:
        return rng.choice(_NUMBERS)
    if r < 0.8:
        return value + rng.choice([-4096, -1, 1, 4096, value, 3 * value])
    return rng.choice(_ODD)


def _int_slots(node, where=()):
    """Paths to every int / str / list leaf of a decoded msgpack tree (the fields a mutation hits)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _int_slots(v, where + (k,))
    elif isinstance(node, list):
        yield where  # the list itself: its length is a field too
        for i, v in enumerate(node):
            yield from _int_slots(v, where + (i,))
    else:
        yield where


def _get(node, where):
    for k in where:
        node = node[k]
    return node


def _set(node, where, value):
    _get(node, where[:-1])[where[-1]] = value


def _mutate_manifest(rng: random.Random, p: str) -> str:
    body = _body(p)
    # The fields that size or place anything: the header ints, files, the tensors' shapes and dtypes.
    slots = [w for w in _int_slots(body) if w and w[0] in ("checksum_block", "world_size", "files", "tensors")]
    where = rng.choice(slots)
    old = _get(body, where)
    if isinstance(old, list) and rng.random() < 0.5:  # a list that grows or shrinks
        new = old + [rng.choice(_NUMBERS)] if rng.random() < 0.5 else old[:-1]
    elif isinstance(old, str) and where[-1] == "dtype":
        new = rng.choice(sorted(mf.DTYPE_ITEMSIZE) + ["float13", ""])
    else:
        new = _mutant(rng, old)
    _set(body, where, new)
    _write_manifest(p, body)
    return f"MANIFEST {'/'.join(map(str, where))}: {old!r} -> {new!r}"


def _mutate_index(rng: random.Random, p: str) -> str:
    """Change one field of one entry of a data file's index, then re-checksum the index and fix
    the file's size and index reference in the MANIFEST, so that the change reaches the parser."""
    body = _body(p)
    fi = rng.randrange(len(body["files"]))
    entry = body["files"][fi]
    off, length, _ = entry["index"]
    fpath = os.path.join(p, entry["name"])
    data = open(fpath, "rb").read()
    rows = msgpack.unpackb(data[off + len(mf.INDEX_MAGIC):off + length], raw=False)
    j = rng.randrange(len(rows))
    field = rng.randrange(6)  # fqn, offsets, sizes, offset, nbytes, crcs
    old = rows[j][field]
    if field == 5:
        new = old[:-4] if rng.random() < 0.5 and old else old + bytes(rng.choice([4, 8, 4000]))
    elif field == 0:
        new = rng.choice([rows[(j + 1) % len(rows)][0], "nope", 5])
    elif isinstance(old, list):
        r = rng.random()
        new = (old + [rng.choice(_NUMBERS)] if r < 0.3 else old[:-1] if r < 0.5 else
               [_mutant(rng, x) if rng.random() < 0.5 else x for x in old])
    else:
        new = _mutant(rng, old)
    rows[j][field] = new
    index = mf.INDEX_MAGIC + msgpack.packb(rows, use_bin_type=True)
    data = data[:off] + index
    with open(fpath, "wb") as f:
        f.write(data)
    entry["size"] = len(data)
    entry["index"] = [off, len(index), crc32c(index)]
    _write_manifest(p, body)
    return f"{entry['name']} index entry {j} field {field}: {old!r} -> {new!r}"


class _Hang(Exception):
    pass


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _same_bytes(a, b) -> bool:
    if isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and a.numel() * a.element_size() == b.numel() * b.element_size()
                and bytes(a.contiguous().view(torch.uint8).flatten().numpy())
                == bytes(b.contiguous().view(torch.uint8).flatten().numpy()))
    return a == b


def test_fuzz_format3_fields_only_typed_errors_or_exact_data(good, tmp_path):
    """300 seeded mutations (two thirds of the MANIFEST, one third of an index): each of read,
    load and verify succeeds bit-exactly or raises a DistCkptError, in at most 20 s, leaving no
    fd open; when read succeeds, verify must report the checkpoint sound."""
    want = _state()
    rng = random.Random(20261127)

    def alarm(signum, frame):
        raise _Hang()

    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        for case in range(300):
            p = _copy(good, str(tmp_path / f"c{case}"))
            what = _mutate_index(rng, p) if case % 3 == 2 else _mutate_manifest(rng, p)
            before = _open_fds()
            signal.alarm(20)
            try:
                out = _outcomes(p)
            finally:
                signal.alarm(0)
            leaked = _open_fds() - before
            assert not leaked, (case, what, {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in leaked
                                             if os.path.exists(f"/proc/self/fd/{fd}")})
            for op, got in out.items():
                if isinstance(got, BaseException):
                    assert isinstance(got, DistCkptError), (case, what, op, repr(got))
                elif op in ("read", "load"):
                    assert set(got) == set(want), (case, what, op)
                    assert all(_same_bytes(got[k], v) for k, v in want.items()), (case, what, op)
            if not isinstance(out["read"], BaseException):
                assert not isinstance(out["verify"], BaseException) and out["verify"].ok, (case, what)
            shutil.rmtree(p)
    finally:
        signal.signal(signal.SIGALRM, previous)
