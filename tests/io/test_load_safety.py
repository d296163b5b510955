"""Loading hostile, read-only and vanishing checkpoints: typed errors, no writes, no surprises.

* sizes torch cannot hold, and sizes the files do not have, are rejected before anything is
  allocated (ManifestCorruptError / DataFileTruncatedError, never TypeError / RuntimeError);
* a MANIFEST that is a symlink is not followed, and no message quotes a non-manifest's bytes;
* load / read / verify write nothing into the checkpoint (names, sizes and mtimes unchanged) and
  work on a read-only ext4, a read-only bind mount and without write permission;
* a step removed by rotation (or replaced by an overwrite) while it is read is reported as
  removed (CheckpointRemovedError), not as damage.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import threading

import msgpack
import pytest
import torch

import distckpt
from distckpt import errors as E
from distckpt.checksum import crc32c
from distckpt.storage import posix as dio
from distckpt import manifest as mf
from distckpt.storage.posix.manifests import load_manifest
from distckpt.storage.posix import loading

from ..helpers.faults import mounts, require_root, run_python  # noqa: F401  (mounts is a fixture)


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(256, 64, generator=g), "b": torch.arange(10), "empty": torch.empty(0, 3),
            "step": 5}


def _rewrite_manifest(path: str, edit) -> None:
    """Replace path/MANIFEST with a well-formed one (valid header and crc32c) whose body ``edit``
    changed: what a hostile or damaged writer could produce, past every byte-level check."""
    body = mf.to_plain(load_manifest(path))
    del body["format_version"]
    body = copy.deepcopy(body)
    for f in body["files"]:  # written as version 1: the chunks in the MANIFEST, no file index
        del f["index"]
    body.pop("meshes", None)  # nor where each tensor's chunks are (version 4)
    for t in body["tensors"].values():
        t.pop("where", None)
    edit(body)
    raw = msgpack.packb(body, use_bin_type=True)
    head = mf._HEADER.pack(mf.MAGIC, 1, 0, len(raw)) + raw
    with open(os.path.join(path, "MANIFEST"), "wb") as f:
        f.write(head + crc32c(head).to_bytes(4, "little"))


# ------------------------------------------------------------------------------------------------
# 1. Sizes


@pytest.mark.parametrize("shape,phrase", [
    ([2**63, 2**63, 0], "expected an integer in [0, 2**63)"),
    ([2**64 - 1, 0], "expected an integer in [0, 2**63)"),
    ([2**40, 2**40, 0, 2**40], "more than a tensor can address"),
])
def test_read_rejects_shapes_torch_cannot_hold(tmp_path, shape, phrase):
    path = str(tmp_path / "c")
    distckpt.save(_state(), path)
    _rewrite_manifest(path, lambda b: b["tensors"]["empty"].update(shape=shape))
    for call in (lambda: distckpt.read(path), lambda: distckpt.load({"empty": torch.empty(0, 3)}, path)):
        with pytest.raises(E.ManifestCorruptError) as ei:
            call()
        assert phrase in ei.value.message and ei.value.path == os.path.join(path, "MANIFEST")


def test_read_checks_file_sizes_before_allocating(tmp_path):
    """A MANIFEST claiming a 4 TiB tensor in a file of a few KiB: the truncated file is reported,
    nothing of the claimed size is allocated (torch would raise "can't allocate memory")."""
    path = str(tmp_path / "c")
    distckpt.save({"x": torch.arange(100, dtype=torch.float32)}, path)
    real_size = os.path.getsize(os.path.join(path, "rank00000.bin"))
    n = 1 << 40  # float32 elements: 4 TiB

    def claim(body):
        body["files"][0]["size"] = 1 << 62
        body["checksum_block"] = 1 << 30  # keeps the crc list short: 4096 entries
        t = body["tensors"]["x"]
        t["shape"] = [n]
        c = t["chunks"][0]
        c.update(sizes=[n], nbytes=4 * n, crcs=[0] * -(-4 * n // body["checksum_block"]))

    _rewrite_manifest(path, claim)
    with pytest.raises(E.DataFileTruncatedError) as ei:
        distckpt.read(path)
    assert ei.value.expected == 1 << 62 and ei.value.found == real_size
    assert ei.value.path == os.path.join(path, "rank00000.bin")


def test_load_checks_every_file_before_filling(tmp_path):
    """A checkpoint of two data files whose second is truncated: load() fails before it writes
    one byte into the caller's tensors (it used to fill "w" from the first file, then fail)."""
    path = str(tmp_path / "c")
    distckpt.save(_state(), path)
    import shutil
    shutil.copyfile(os.path.join(path, "rank00000.bin"), os.path.join(path, "rank00001.bin"))

    def two_files(body):  # "b" is read from the copy (same offset): a valid two-rank layout
        body["world_size"] = 2
        body["files"].append(dict(body["files"][0], name="rank00001.bin", rank=1))
        body["tensors"]["b"]["chunks"][0]["file"] = 1

    _rewrite_manifest(path, two_files)
    into = {"w": torch.zeros(256, 64), "b": torch.zeros(10, dtype=torch.int64), "empty": torch.empty(0, 3), "step": 0}
    distckpt.load(into, path)  # the layout is valid
    assert torch.equal(into["b"], torch.arange(10))
    os.truncate(os.path.join(path, "rank00001.bin"), 100)
    into = {"w": torch.zeros(256, 64), "b": torch.zeros(10, dtype=torch.int64), "empty": torch.empty(0, 3), "step": 0}
    with pytest.raises(E.DataFileTruncatedError):
        distckpt.load(into, path)
    assert not into["w"].any() and not into["b"].any()


# ------------------------------------------------------------------------------------------------
# 2. MANIFEST symlinks


def test_manifest_symlink_is_not_followed(tmp_path):
    secret = tmp_path / "outside.txt"
    secret.write_text("root:x:0:0:SECRET-CONTENT\n")
    path = str(tmp_path / "c")
    distckpt.save(_state(), path)
    os.unlink(os.path.join(path, "MANIFEST"))
    os.symlink(secret, os.path.join(path, "MANIFEST"))
    before = os.stat(secret).st_atime_ns
    for call in (lambda: distckpt.read(path), lambda: distckpt.load(_state(), path),
                 lambda: distckpt.read_manifest(path)):
        with pytest.raises(E.ManifestCorruptError) as ei:
            call()
        assert "symbolic link" in ei.value.message
        assert "root:x" not in str(ei.value) and "SECRET" not in str(ei.value)
    assert os.stat(secret).st_atime_ns == before


def test_bad_magic_does_not_quote_the_file(tmp_path):
    path = str(tmp_path / "c")
    distckpt.save(_state(), path)
    with open(os.path.join(path, "MANIFEST"), "wb") as f:
        f.write(b"root:x:0:0:SECRET-CONTENT\n")
    with pytest.raises(E.ManifestCorruptError) as ei:
        distckpt.read(path)
    assert "bad magic" in ei.value.message and "root:x" not in str(ei.value)


_SPARSE_MANIFEST = """
import os, resource, sys
import distckpt
from distckpt import errors as E
path = sys.argv[1]
try:
    distckpt.read(path)
except E.ManifestCorruptError as exc:
    print("typed", "checksum mismatch" in exc.message)
print("peak_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def test_a_manifest_declaring_the_largest_body_is_read_into_memory_once(tmp_path):
    """A 28-byte MANIFEST made sparse to the largest body the format allows (1 GiB of zeros, a
    wrong checksum): refused with its checksum error after holding the file once, not twice."""
    path = str(tmp_path / "c")
    distckpt.save(_state(), path)
    header = mf._HEADER.pack(mf.MAGIC, mf.FORMAT_VERSION, 0, mf.MAX_MANIFEST_BYTES)
    with open(os.path.join(path, "MANIFEST"), "wb") as f:
        f.write(header)
        f.truncate(mf._OVERHEAD + mf.MAX_MANIFEST_BYTES)
    out = subprocess.run([sys.executable, "-c", _SPARSE_MANIFEST, path], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    said = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert said["typed"] == "True", out.stdout
    # The interpreter and torch take a few hundred MiB; the file 1 GiB; twice that is over 2 GiB.
    assert int(said["peak_kib"]) < (mf.MAX_MANIFEST_BYTES + (600 << 20)) >> 10, said


# ------------------------------------------------------------------------------------------------
# 3. A load writes nothing


def _snapshot(root: str) -> dict:
    """Every name under ``root`` (root included) with its type, size, mtime and ctime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for p in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return out


_LOAD_READ_VERIFY = """
import torch, distckpt
from distckpt.storage import posix as dio
from distckpt.cli import main
path = PATH
dio.reset_choices()  # every step probes afresh: the probe is what used to write
g = torch.Generator().manual_seed(3)
want = {"w": torch.randn(256, 64, generator=g), "b": torch.arange(10), "empty": torch.empty(0, 3), "step": 5}
got = {"w": torch.zeros(256, 64), "b": torch.zeros(10, dtype=torch.int64), "empty": torch.empty(0, 3), "step": 0}
distckpt.load(got, path)
assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"]) and got["step"] == 5
backends = [c.name for c in dio.last_choices()]
dio.reset_choices()
assert torch.equal(distckpt.read(path)["w"], want["w"])
backends += [c.name for c in dio.last_choices()]
dio.reset_choices()
assert main(["verify", path]) == 0
emit({"backends": backends})
"""


def _load_read_verify_here(path: str) -> dict:
    scope = {"PATH": path, "emit": lambda obj: scope.__setitem__("emitted", obj)}
    exec(_LOAD_READ_VERIFY, scope)
    return scope["emitted"]


def test_load_read_verify_write_nothing(tmp_path):
    """Directory listings, sizes and mtimes/ctimes of the checkpoint and its parent are unchanged
    after load, read and verify, each with a fresh backend probe (the probe used to create and
    delete .distckpt-align-* / .distckpt-probe-* files inside the checkpoint)."""
    root = str(tmp_path / "root")
    mgr = distckpt.CheckpointManager(root)
    mgr.save(1, _state())
    before = _snapshot(root)
    _load_read_verify_here(mgr.path(1))
    assert _snapshot(root) == before


@pytest.mark.root
def test_load_on_read_only_ext4(mounts, tmp_path):
    d = mounts.ext4(tmp_path / "e", size="32m")
    path = os.path.join(d, "c")
    distckpt.save(_state(), path)
    r = subprocess.run(["mount", "-o", "remount,ro", str(d)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    before = _snapshot(str(d))
    out = _load_read_verify_here(path)
    assert len(out["backends"]) == 2 and "buffered" not in out["backends"], out  # O_DIRECT, probed by reading
    assert _snapshot(str(d)) == before


@pytest.mark.root
def test_load_on_read_only_bind_mount(tmp_path):
    require_root("a bind mount")
    src, dst = tmp_path / "src", tmp_path / "dst"
    dst.mkdir()
    distckpt.save(_state(), str(src / "c"))
    subprocess.run(["mount", "--bind", str(src), str(dst)], check=True, capture_output=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(dst)], check=True, capture_output=True)
        with pytest.raises(OSError):  # really read-only
            open(dst / "c" / "x", "wb")
        before = _snapshot(str(src))
        _load_read_verify_here(str(dst / "c"))
        assert _snapshot(str(src)) == before
    finally:
        subprocess.run(["umount", "-l", str(dst)], capture_output=True)


@pytest.mark.root
def test_load_without_write_permission(tmp_path):
    """Root without CAP_DAC_OVERRIDE, on a checkpoint whose directory is mode 0555."""
    path = tmp_path / "c"
    distckpt.save(_state(), str(path))
    for p in path.iterdir():
        p.chmod(0o444)
    path.chmod(0o555)
    before = _snapshot(str(tmp_path))
    really = f"""
try:
    open({str(path / 'x')!r}, "wb")
    raise AssertionError("the checkpoint is writable: the test proves nothing")
except PermissionError:
    pass
"""
    try:
        res = run_python(really + _LOAD_READ_VERIFY.replace("PATH", repr(str(path))),
                         drop_caps=("cap_dac_override",), timeout=120).check()
        after = _snapshot(str(tmp_path))
    finally:
        path.chmod(0o755)
    assert res.data["backends"], res.stdout
    assert after == before


# ------------------------------------------------------------------------------------------------
# 6. A step removed while it is read


def _race(monkeypatch, stage: str) -> tuple[threading.Event, threading.Event]:
    """Hold the next load or read at ``stage`` until the test has rotated or overwritten the step:
    "manifest" (directory checked, MANIFEST not yet opened) or "data" (MANIFEST read, no data
    file opened yet). Returns (reached, done): the reader sets ``reached`` and waits for ``done``.
    Only the order is forced; the rotation, the files and the errors are real."""
    name = {"manifest": "check_committed", "data": "check_data_file"}[stage]
    real = getattr(loading, name)
    reached, done = threading.Event(), threading.Event()

    def hold(*args):
        out = real(*args) if stage == "manifest" else None
        if not reached.is_set():
            reached.set()
            assert done.wait(60)
        return out if stage == "manifest" else real(*args)

    monkeypatch.setattr(loading, name, hold)
    return reached, done


@pytest.mark.parametrize("stage", ["manifest", "data"])
@pytest.mark.parametrize("api", ["read", "load"])
def test_read_racing_rotation_is_reported_as_removed(tmp_path, monkeypatch, stage, api):
    mgr = distckpt.CheckpointManager(str(tmp_path / "root"), keep_last=1)
    mgr.save(1, _state())
    reached, done = _race(monkeypatch, stage)
    outcome = {}

    def reader():
        try:
            if api == "read":
                distckpt.read(mgr.path(1))
            else:
                distckpt.load(_state(), mgr.path(1))
            outcome["error"] = None
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            outcome["error"] = exc

    t = threading.Thread(target=reader)
    t.start()
    try:
        assert reached.wait(60)
        mgr.save(2, _state())  # commits step 2, then rotates step 1 away
        assert mgr.steps() == [2]
    finally:
        done.set()
        t.join(60)
    exc = outcome["error"]
    assert isinstance(exc, E.CheckpointRemovedError), repr(exc)
    assert isinstance(exc, E.CheckpointNotFoundError) and exc.path == mgr.path(1)
    assert "was removed while it was being read" in exc.message and "damaged" not in str(exc)
    assert "keep_last" in exc.remedy and exc.replaced is False


@pytest.mark.parametrize("verify", [True, False])
def test_read_racing_overwrite_is_reported_as_replaced(tmp_path, monkeypatch, verify):
    """An overwrite swaps another checkpoint in under the name between MANIFEST and data: the
    data files now open are the new one's. With the same layout the sizes agree and, without
    verification, nothing else would notice: the load fails instead of mixing the two."""
    path = str(tmp_path / "c")
    distckpt.save(_state(), path)
    reached, done = _race(monkeypatch, "data")
    outcome = {}

    def reader():
        try:
            distckpt.read(path, verify=verify)
            outcome["error"] = None
        except BaseException as exc:  # noqa: BLE001
            outcome["error"] = exc

    t = threading.Thread(target=reader)
    t.start()
    try:
        assert reached.wait(60)
        other = _state()
        other["w"] = other["w"] + 1
        distckpt.save(other, path, overwrite=True)
    finally:
        done.set()
        t.join(60)
    exc = outcome["error"]
    assert isinstance(exc, E.CheckpointRemovedError), repr(exc)
    assert exc.replaced is True and "another directory now has its name" in exc.message


def test_an_overwrite_whose_directory_reuses_the_inode_is_reported_as_replaced(tmp_path, monkeypatch):
    """ext4 reuses a freed inode number at once: after two overwrites in a row, the directory now
    at the name can have the inode of the one the load began in. The files are swapped in place
    here (same directory inode, another save's MANIFEST and data): that is a replacement, not
    damage (it was a ChecksumMismatchError telling the user to restore an older checkpoint)."""
    path, other = str(tmp_path / "c"), str(tmp_path / "other")
    distckpt.save(_state(), path)
    changed = _state()
    changed["w"] = changed["w"] + 1
    distckpt.save(changed, other)
    reached, done = _race(monkeypatch, "data")
    outcome = {}

    def reader():
        try:
            distckpt.read(path)
            outcome["error"] = None
        except BaseException as exc:  # noqa: BLE001
            outcome["error"] = exc

    t = threading.Thread(target=reader)
    t.start()
    try:
        assert reached.wait(60)
        before = os.stat(path).st_ino
        for name in os.listdir(other):
            os.replace(os.path.join(other, name), os.path.join(path, name))
        assert os.stat(path).st_ino == before
    finally:
        done.set()
        t.join(60)
    exc = outcome["error"]
    assert isinstance(exc, E.CheckpointRemovedError), repr(exc)
    assert exc.replaced is True and "damaged" not in str(exc)


def test_a_replacement_seen_after_the_fill_says_what_the_load_filled(tmp_path, monkeypatch):
    """The overwrite lands after every byte was read and verified (the guard's last look sees
    it): the caller's tensors and values already hold the checkpoint as it was, and the error
    says so (``filled``), as a failed fill's does, instead of reading as "nothing changed"."""
    from distckpt import restore
    path, other = str(tmp_path / "c"), str(tmp_path / "other")
    saved = {k: v for k, v in _state().items() if isinstance(v, torch.Tensor)}
    distckpt.save({**saved, "step": 1}, path)
    distckpt.save({**saved, "w": saved["w"] + 1, "step": 2}, other)
    real = restore.fill_parts

    def fill_then_replace(*args, **kwargs):
        out = real(*args, **kwargs)
        os.rename(path, path + ".old")
        os.rename(other, path)  # another job's overwrite lands now
        return out

    monkeypatch.setattr(restore, "fill_parts", fill_then_replace)
    mine = {**{k: torch.full_like(v, 7) for k, v in saved.items()}, "step": 0}
    with pytest.raises(E.CheckpointRemovedError) as ei:
        distckpt.load(mine, path)
    assert ei.value.filled == sorted([*saved, "step"]) and ei.value.partly_filled == []  # the value was put in place
    assert "the load had finished" in str(ei.value)
    assert all(torch.equal(mine[k], v) for k, v in saved.items()) and mine["step"] == 1


def test_missing_data_file_in_place_is_still_damage(tmp_path):
    """The directory is still there, unchanged: a missing data file is damage, as before."""
    path = str(tmp_path / "c")
    distckpt.save(_state(), path)
    os.unlink(os.path.join(path, "rank00000.bin"))
    with pytest.raises(E.DataFileMissingError) as ei:
        distckpt.read(path)
    assert not isinstance(ei.value, E.CheckpointRemovedError)


@pytest.mark.parametrize("where", ["index", "data"])
def test_verify_reports_an_unreadable_file_and_checks_the_others(tmp_path, monkeypatch, where):
    """EIO reading one data file (its index at the end, or its data): verify reports that file as a
    problem, names the error, and still checks the other file, whose blocks all pass; an index
    that cannot be read no longer surfaces as a BufferError."""
    import shutil
    from distckpt.storage.posix.store import PosixStore
    from distckpt.verify import verify
    golden = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden", "v4")
    path = str(tmp_path / "c")
    shutil.copytree(golden, path)
    whole = verify(path)
    assert whole.ok and whole.files == 2
    with open(os.path.join(path, "MANIFEST"), "rb") as f:
        index_at = mf.decode_header(f.read()).files[0].index[0]
    real = PosixStore.whole_file_readers

    def failing(self, sizes):
        opener, backend = real(self, sizes)

        def open_one(p):
            reader = opener(p)
            if os.path.basename(p) == "rank00000.bin":
                inner = reader.read_into

                def read_into(requests):
                    if any((off >= index_at) == (where == "index") for off, _, _ in requests):
                        raise E.StorageIOError("read failed: [Errno 5] Input/output error", path=p, errno=5)
                    return inner(requests)
                reader.read_into = read_into
            return reader
        return open_one, backend

    monkeypatch.setattr(PosixStore, "whole_file_readers", failing)
    report = verify(path)
    assert not report.ok and [p.file for p in report.file_problems] == ["rank00000.bin"]
    assert "Input/output error" in report.file_problems[0].problem
    assert report.bad_blocks == []
    assert 1 <= report.blocks_checked < whole.blocks_checked  # rank00001.bin's, all good


def test_a_load_that_fails_reading_an_index_says_it_filled_nothing(tmp_path, monkeypatch):
    """EIO reading a data file's index (before any byte moves): the error says what it filled,
    nothing (``filled`` / ``partly_filled`` empty, as README promises of a load's read errors),
    and the caller's state dict is untouched."""
    from distckpt.storage.posix.store import PosixStore
    path = str(tmp_path / "c")
    distckpt.save(_state(), path)

    def eio(self, *args, **kwargs):
        raise E.StorageIOError("read failed: [Errno 5] Input/output error", path=path, errno=5)

    monkeypatch.setattr(PosixStore, "read_index", eio)
    into = {"w": torch.zeros(256, 64), "b": torch.zeros(10, dtype=torch.int64), "empty": torch.empty(0, 3), "step": 0}
    with pytest.raises(E.StorageIOError) as ei:
        distckpt.load(into, path)
    assert ei.value.filled == [] and ei.value.partly_filled == []
    assert not into["w"].any() and into["step"] == 0


# ------------------------------------------------------------------------------------------------
# 7. Several reads of one checkpoint as one (distckpt.source.pinned: DeepSpeed's engine load)


def test_reads_inside_a_pin_decode_the_manifest_once_and_come_from_one_checkpoint(tmp_path, monkeypatch):
    """Key-by-key reads inside ``pinned`` decode the MANIFEST once; an overwrite between two of
    them fails the block as CheckpointRemovedError. Without the pin each read stands alone: the
    second read returns the other save's value, and nothing says the two came from two saves."""
    from distckpt.source import pinned
    path = str(tmp_path / "c")
    distckpt.save(_state(), path)
    decodes = []
    real = mf.decode
    monkeypatch.setattr(mf, "decode", lambda *a, **k: decodes.append(1) or real(*a, **k))
    with pinned(path):
        w = distckpt.read(path, keys=["w"])["w"]
        into = {"b": torch.zeros(10, dtype=torch.int64)}
        distckpt.load(into, path, strict=False)
        assert distckpt.read(path, keys=["step"])["step"] == 5
    assert len(decodes) == 1, decodes
    assert torch.equal(w, _state()["w"]) and torch.equal(into["b"], _state()["b"])

    other = _state()
    other["b"] = other["b"] + 100
    with pytest.raises(E.CheckpointRemovedError) as ei:
        with pinned(path):
            distckpt.read(path, keys=["w"])
            distckpt.save(other, path, overwrite=True)
            distckpt.read(path, keys=["b"])
    assert ei.value.replaced is True and "damaged" not in str(ei.value)
    # outside a pin the same two reads return parts of two saves: what the pin is for
    distckpt.save(_state(), path, overwrite=True)
    distckpt.read(path, keys=["w"])
    distckpt.save(other, path, overwrite=True)
    assert torch.equal(distckpt.read(path, keys=["b"])["b"], other["b"])


def _pinned_load_body(rank, world_size, root, swap):
    import shutil
    import torch.distributed as dist
    from distckpt.source import pinned
    path, other = os.path.join(root, "c"), os.path.join(root, "other")
    decodes = []
    real = mf.decode
    mf.decode = lambda *a, **k: decodes.append(1) or real(*a, **k)
    into = {"w": torch.zeros(256, 64), "b": torch.zeros(10, dtype=torch.int64), "empty": torch.empty(0, 3), "step": 0}
    try:
        if swap and rank == 0:
            # rank 0 pins the checkpoint as it was; rank 1 pins the one that took its name
            with pinned(path):
                dist.barrier()
                os.rename(path, path + ".old")
                shutil.copytree(other, path)
                dist.barrier()
                distckpt.load(into, path)
        else:
            if swap:
                dist.barrier()
                dist.barrier()
            with pinned(path):
                distckpt.load(into, path)
        return {"error": None, "decodes": len(decodes), "w": torch.equal(into["w"], _state()["w"]), "step": into["step"]}
    except Exception as exc:  # noqa: BLE001 - the test checks which
        return {"error": type(exc).__name__, "message": str(exc), "decodes": len(decodes)}
    finally:
        mf.decode = real


@pytest.mark.parametrize("swap", [False, True], ids=["same", "overwritten-between-ranks"])
def test_a_pinned_load_on_two_ranks_uses_each_ranks_pin_and_refuses_two_saves(tmp_path, swap):
    """A 2-rank load inside every rank's pin: each rank decodes once (its pin's), rank 0's MANIFEST
    still travels to every rank, and a rank whose pin holds another save (the checkpoint was
    overwritten between the ranks' pins) raises CheckpointRemovedError; no rank hangs."""
    from ..helpers.distributed import run_ranks
    distckpt.save(_state(), str(tmp_path / "c"))
    other = _state()
    other["w"] = other["w"] + 1
    distckpt.save(other, str(tmp_path / "other"))
    results = run_ranks(_pinned_load_body, 2, str(tmp_path), swap, timeout=120)
    if not swap:
        assert [r["error"] for r in results] == [None, None], results
        assert [r["decodes"] for r in results] == [1, 1] and all(r["w"] and r["step"] == 5 for r in results), results
    else:
        assert results[1]["error"] == "CheckpointRemovedError", results
        assert "rank 0 read another MANIFEST than rank 1" in results[1]["message"], results
        assert results[0]["error"] == "CheckpointRemovedError", results


def test_an_outage_inside_a_pin_is_not_called_a_removal(tmp_path, monkeypatch):
    """EIO while reading inside a pin, with the MANIFEST unreadable too (the same outage): the
    pin's guard called the intact checkpoint "removed" (remedy: load a newer step). The read's
    own error stands."""
    from distckpt.source import pinned
    from distckpt.storage.posix.store import PosixStore
    path = str(tmp_path / "c")
    distckpt.save(_state(), path)

    def eio(self, p):
        raise E.StorageIOError("read MANIFEST failed: [Errno 5] Input/output error", path=p, errno=5)

    with pytest.raises(E.StorageIOError) as info:
        with pinned(path) as source:
            monkeypatch.setattr(PosixStore, "manifest_bytes", eio)
            with source.guard():
                raise E.StorageIOError("read failed: [Errno 5] Input/output error", path=path, errno=5)
    assert not isinstance(info.value, E.CheckpointRemovedError)
    monkeypatch.undo()
    assert torch.equal(distckpt.read(path)["w"], _state()["w"])


def _sources(tmp_path, kind: str) -> tuple[str, str, dict]:
    """(checkpoint path, its one data file, the tensors) of a checkpoint of ``kind``."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(9)
    ref = {"x": torch.randn(1 << 20, generator=g), "y": torch.randn(3 << 18, generator=g)}
    d = tmp_path / kind
    if kind == "hf":
        d.mkdir()
        save_file(ref, str(d / "model.safetensors"))
        return str(d), str(d / "model.safetensors"), ref
    if kind == "dcp":
        dcp.save(ref, checkpoint_id=str(d), no_dist=True)
        return str(d), str(d / "__0_0.distcp"), ref
    distckpt.save(ref, str(d), no_dist=True)
    return str(d), str(d / "rank00000.bin"), ref


@pytest.mark.parametrize("kind", ["hf", "dcp", "distckpt"])
@pytest.mark.parametrize("when", ["before-open", "after-open"])
def test_a_data_file_that_shrinks_while_it_is_read_is_a_typed_error_naming_what_was_filled(
        tmp_path, monkeypatch, kind, when):
    """A data file cut to half after its size was checked against the MANIFEST (a rewrite, a
    download in progress): before the reader opened it, the read plan packed a negative length
    (a bare struct.error); after, the short read was reported, but for a Hugging Face or DCP
    source as a CheckpointRemovedError without the ``filled`` / ``partly_filled`` its cause
    carried, although tensors had changed (an outside trial). Now a typed error either way, its
    lists saying what holds verified bytes, the rest untouched."""
    import distckpt.fill as F
    path, victim, ref = _sources(tmp_path, kind)
    real = F.fill

    def cut_then_fill(*args, **kwargs):
        opener = kwargs["open_reader"]
        if when == "before-open":
            os.truncate(victim, os.path.getsize(victim) // 2)
        else:
            def opened_then_cut(p):
                r = opener(p)
                os.truncate(victim, os.path.getsize(victim) // 2)
                return r
            kwargs["open_reader"] = opened_then_cut
        return real(*args, **kwargs)
    monkeypatch.setattr(F, "fill", cut_then_fill)
    state = {k: torch.zeros_like(v) for k, v in ref.items()}
    with pytest.raises((E.DataFileTruncatedError, E.CheckpointRemovedError)) as info:
        distckpt.load(state, path)
    filled, partly = info.value.filled, info.value.partly_filled
    assert isinstance(filled, list) and isinstance(partly, list), info.value
    for k, v in ref.items():
        if k in filled:
            assert torch.equal(state[k], v), k
        elif k not in partly:
            assert not state[k].any(), k   # untouched


def _asymmetric_damage_body(rank: int, world_size: int, path: str) -> dict:
    from distckpt import errors
    state = {"a": torch.zeros(1 << 16), "step": 0} if rank == 0 else {"b": torch.zeros(1 << 16)}
    try:
        distckpt.load(state, path)
    except errors.ChecksumMismatchError as exc:
        return {"filled": exc.filled, "partly": exc.partly_filled, "changed": bool(next(iter(state.values())).any()),
                "step": state.get("step")}
    return {"filled": None}


def test_each_rank_of_a_failed_load_says_what_its_own_state_dict_holds(tmp_path):
    """Rank 1 reads a damaged block, rank 0 loads its own key whole: every rank raises the same
    ChecksumMismatchError (a copy of rank 1's), and rank 0's said filled=[] (rank 1's lists)
    although its tensor had been filled with verified bytes (an outside trial); then it named
    its tensor but not the value it had put in place (a re-trial). Each rank's error now names
    its own keys, values included."""
    from ..helpers.distributed import run_ranks
    path = str(tmp_path / "ck")
    distckpt.save({"a": torch.randn(1 << 16), "b": torch.randn(1 << 16), "step": 7}, path, no_dist=True)
    data = tmp_path / "ck" / "rank00000.bin"
    raw = bytearray(data.read_bytes())
    man = load_manifest(path)
    at = man.tensors["b"].chunks[0].offset + 100
    raw[at] ^= 1
    data.write_bytes(bytes(raw))
    results = run_ranks(_asymmetric_damage_body, 2, path, timeout=180)
    # rank 0's load completed: its tensor and its value (put in place) are both named
    assert results[0] == {"filled": ["a", "step"], "partly": [], "changed": True, "step": 7}, results[0]
    assert results[1]["filled"] == [] and results[1]["partly"] == [] and not results[1]["changed"], results[1]


def test_a_failed_load_never_names_a_tensor_filled_through_a_conversion_buffer_or_a_tuple_roots_fill(tmp_path):
    """A tensor loaded in another dtype is filled through a buffer in its saved dtype, copied in
    only after the whole fill: a fill that failed on another tensor listed it as filled while it
    was untouched. And a tuple root whose value cannot be replaced raised after its tensors were
    filled, naming none (a re-trial)."""
    g = torch.Generator().manual_seed(4)
    src = {"a": torch.randn(1 << 18, generator=g).to(torch.bfloat16), "b": torch.randn(1 << 18, generator=g)}
    path = str(tmp_path / "cast")
    distckpt.save(src, path, no_dist=True)
    chunk = load_manifest(path).tensors["b"].chunks[0]
    data = tmp_path / "cast" / "rank00000.bin"
    raw = bytearray(data.read_bytes())
    raw[chunk.offset + chunk.nbytes - 8] ^= 0xFF
    data.write_bytes(bytes(raw))
    dst = {"a": torch.full((1 << 18,), -7.0), "b": torch.full((1 << 18,), -7.0)}
    with pytest.raises(E.ChecksumMismatchError) as info:
        distckpt.load(dst, path)
    assert "a" not in info.value.filled + info.value.partly_filled and bool((dst["a"] == -7).all()), info.value

    tup = str(tmp_path / "tuple")
    distckpt.save((torch.arange(4.0), 5), tup, no_dist=True)
    mine = (torch.zeros(4), 6)
    with pytest.raises(E.StateDictMismatchError) as info:
        distckpt.load(mine, tup)
    assert info.value.filled == ["0"] and torch.equal(mine[0], torch.arange(4.0)), info.value


@pytest.mark.parametrize("damage", ["newest-rows", "older-rows", "base"])
def test_a_failed_chain_load_names_what_each_tensor_holds(tmp_path, damage):
    """An incremental chain (full step 1, deltas 2 and 3) whose load fails: a failure in the rows
    pass said filled=[] while 'dense' held the checkpoint and 'emb' the base's rows (or named a
    delta's own record as partly filled), and a broken older link said nothing at all (a
    re-trial). An untracked tensor is filled once the first pass was; a tracked one, holding the
    base and maybe some rows, is partly filled; nothing else changed."""
    from distckpt.incremental import IncrementalPolicy
    root = str(tmp_path / "chain")
    mgr = distckpt.CheckpointManager(root, keep_last=5, incremental=IncrementalPolicy(
        rows={"emb": 0}, full_every=8, max_delta_fraction=0.9, max_chain_fraction=0.9))
    g = torch.Generator().manual_seed(2)
    sd = {"emb": torch.randn(64, 16, generator=g), "dense": torch.randn(32, generator=g), "step": 1}
    want = {}
    for step in (1, 2, 3):
        sd["emb"][step * 3] += 1.0
        sd["dense"] += 1.0
        sd["step"] = step
        mgr.save(step, sd)
        want[step] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    victim = mgr.path({"newest-rows": 3, "older-rows": 2, "base": 1}[damage])
    man = load_manifest(victim)
    data = os.path.join(victim, "rank00000.bin")
    raw = bytearray(open(data, "rb").read())
    for key, entry in man.tensors.items():
        if (damage == "base" and key == "emb") or (damage != "base" and key.endswith(".rows")):
            raw[entry.chunks[0].offset] ^= 0xFF
    open(data, "wb").write(bytes(raw))
    dst = {"emb": torch.full((64, 16), -7.0), "dense": torch.full((32,), -7.0), "step": -7}
    with pytest.raises(E.DistCkptError) as info:
        distckpt.load(dst, mgr.path(3))
    filled, partly = info.value.filled, info.value.partly_filled
    assert set(filled) | set(partly) <= {"emb", "dense", "step"}, (filled, partly)
    for key in ("emb", "dense"):
        if key in filled:
            assert torch.equal(dst[key], want[3][key]), key
        elif key not in partly:
            assert bool((dst[key] == -7).all()), key
    assert "dense" in filled and dst["step"] == -7, (filled, partly)
