"""Store.copy_data_file on a local file system (the seam's WRITE from existing bytes, what a drain to
a POSIX tier writes through), and a whole drain between two local directories with read pieces that
cut checksum blocks in two.

What is held: the file has exactly the bytes fed, durable through the O_DIRECT writer; a feed that
raises, comes up short or runs long leaves no file and a typed error; a name that exists is never
overwritten or unlinked; the drain's verifier continues a block's crc32c across read pieces and
finds a flipped byte in a block that straddles two of them.
"""

from __future__ import annotations

import os

import pytest
import torch

import distckpt
from distckpt import manifest as mf
from distckpt._dist import ControlGroup
from distckpt.errors import (CheckpointCorruptError, ChecksumMismatchError, DataFileTruncatedError, DistCkptError,
                             StorageError)
from distckpt.storage import open_store
from distckpt.tiers import drain, verified


def _feeder(data: bytes, piece: int):
    def feed(sink):
        for i in range(0, len(data), piece):
            sink.write(memoryview(data)[i:i + piece])
    return feed


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 3 * 1024 * 1024 + 123])
def test_copy_writes_exactly_the_bytes_fed(tmp_path, size):
    store = open_store(str(tmp_path))
    data = os.urandom(size)
    assert store.copy_data_file(str(tmp_path), 7, size, _feeder(data, 1 << 20 if size > 5000 else 1000)) == size
    with open(tmp_path / "rank00007.bin", "rb") as f:
        assert f.read() == data


class _Boom(Exception):
    pass


@pytest.mark.parametrize("how", ["raises", "short", "long"])
def test_a_failed_copy_leaves_no_file(tmp_path, how):
    store = open_store(str(tmp_path))
    data = os.urandom(100_000)

    def feed(sink):
        sink.write(data[:50_000])
        if how == "raises":
            raise _Boom("the source failed")
        if how == "long":
            sink.write(data[50_000:] + b"x")

    expected = {"raises": _Boom, "short": DataFileTruncatedError, "long": CheckpointCorruptError}[how]
    with pytest.raises(expected) as info:
        store.copy_data_file(str(tmp_path), 0, len(data), feed)
    if how != "raises":
        assert (info.value.expected, info.value.found) == (100_000, 50_000 if how == "short" else 100_001)
    assert os.listdir(tmp_path) == []


def test_an_existing_file_is_neither_overwritten_nor_removed(tmp_path):
    store = open_store(str(tmp_path))
    (tmp_path / "rank00000.bin").write_bytes(b"keep me")
    with pytest.raises(StorageError):
        store.copy_data_file(str(tmp_path), 0, 3, _feeder(b"new", 3))
    assert (tmp_path / "rank00000.bin").read_bytes() == b"keep me"


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def test_a_late_failure_never_unlinks_a_file_another_try_put_at_the_same_path(tmp_path):
    """A drain's area is named after the local save, so a later try (another job's, after this
    rank was stopped and given up on) recreates the area and writes the same path. A copy that
    resumes and then fails unlinked that path: the later try's file, just before it published."""
    import shutil

    store = open_store(str(tmp_path))
    area = tmp_path / ".step_00000002.tmp-abc"
    area.mkdir()
    theirs = os.urandom(4096)

    def feed(sink):
        sink.write(b"x" * 4096)
        # Meanwhile this try was given up on: its area removed, the same name made again by the
        # next try, which wrote its own file there.
        shutil.rmtree(area)
        area.mkdir()
        (area / "rank00003.bin").write_bytes(theirs)
        raise _Boom("the source failed after this rank resumed")

    with pytest.raises(_Boom):
        store.copy_data_file(str(area), 3, 8192, feed)
    assert (area / "rank00003.bin").read_bytes() == theirs


def test_a_drain_between_local_directories_checks_blocks_cut_by_read_pieces(tmp_path, monkeypatch):
    # 16 KiB checksum blocks read in pieces of 12 KiB + 1: most blocks straddle two pieces.
    monkeypatch.setenv("DISTCKPT_CHECKSUM_BLOCK", "16K")
    monkeypatch.setattr(verified, "READ_PIECE", 12 * 1024 + 1)
    state = {"w": torch.randn(200_000, generator=torch.Generator().manual_seed(1)), "b": torch.arange(10), "n": 3}
    local, remote = str(tmp_path / "local" / "step_1"), str(tmp_path / "remote" / "step_1")
    saved = distckpt.save(state, local, no_dist=True)
    assert mf.decode_header(open(os.path.join(local, "MANIFEST"), "rb").read()).checksum_block == 16 * 1024
    group = ControlGroup(None, 0, 1)
    sent = []
    res = drain.drain_step(group, local_path=local, remote_path=remote, progress=sent.append)
    size = os.path.getsize(os.path.join(local, "rank00000.bin"))
    assert (res.save_id, res.bytes_uploaded, res.already_remote) == (saved.save_id, size, False)
    assert sum(sent) == size and max(sent) == 12 * 1024 + 1
    with open(os.path.join(local, "MANIFEST"), "rb") as a, open(os.path.join(remote, "MANIFEST"), "rb") as b:
        assert a.read() == b.read()
    back = distckpt.read(remote)
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"]) and back["n"] == 3
    assert drain.drain_step(group, local_path=local, remote_path=remote).already_remote

    # A flipped byte inside a block that straddles two read pieces (bytes 12289..16383 of the first
    # chunk's first block are in the second piece), drained to a fresh path: typed, nothing there.
    _flip(os.path.join(local, "rank00000.bin"), 14_000)
    other = str(tmp_path / "remote" / "step_2")
    with pytest.raises(ChecksumMismatchError) as info:
        drain.drain_step(group, local_path=local, remote_path=other)
    assert info.value.offset == 0 and info.value.path == os.path.join(local, "rank00000.bin")
    assert not os.path.exists(other)
    assert [n for n in os.listdir(tmp_path / "remote") if n != "step_1" and not n.endswith(".lock")] == []


def test_a_damaged_index_is_a_checksum_error(tmp_path):
    local, remote = str(tmp_path / "l"), str(tmp_path / "r")
    distckpt.save({"w": torch.ones(1000)}, local, no_dist=True)
    header = mf.decode_header(open(os.path.join(local, "MANIFEST"), "rb").read())
    off, length, _ = header.files[0].index
    _flip(os.path.join(local, "rank00000.bin"), off + length - 1)
    with pytest.raises(ChecksumMismatchError, match="index of rank00000.bin"):
        drain.drain_step(ControlGroup(None, 0, 1), local_path=local, remote_path=remote)
    assert not os.path.exists(remote)


def test_nothing_to_drain_is_typed(tmp_path):
    with pytest.raises(DistCkptError, match="no rank found a committed step"):
        drain.drain_step(ControlGroup(None, 0, 1), local_path=str(tmp_path / "none"), remote_path=str(tmp_path / "r"))
