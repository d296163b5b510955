"""distckpt.storage.posix on a real ext4 file system: byte-exact round trips for every backend, O_DIRECT
alignment really enforced, ranged reads, strict fd lifecycle, path primitives."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import random

import pytest

from distckpt import _uring
from distckpt import errors as E
from distckpt.storage import posix as dio

from ..helpers.io_helpers import BACKENDS
from ..conftest import open_fds

SMALL_BLOCK = 64 << 10  # many blocks and a full queue even for small files


def _fs_type(path: str) -> str:
    best, fstype = "", ""
    with open("/proc/self/mounts") as f:
        for line in f:
            _, mnt, typ = line.split()[:3]
            if path.startswith(mnt) and len(mnt) > len(best):
                best, fstype = mnt, typ
    return fstype


@pytest.fixture
def ext4_dir(tmp_path):
    """A directory on ext4 (O_DIRECT alignment enforced there; tmpfs would hide bugs)."""
    fstype = _fs_type(os.path.realpath(str(tmp_path)))
    if fstype not in ("ext4", "xfs"):
        pytest.skip(f"pytest's tmp_path is on {fstype}, not ext4/xfs: alignment would not be enforced")
    return str(tmp_path)


@pytest.fixture(params=BACKENDS)
def choice(request, ext4_dir, monkeypatch):
    monkeypatch.setenv("DISTCKPT_BLOCK_SIZE", str(SMALL_BLOCK))
    # the zero-copy path from one request (the writer's floor: twice the block size)
    monkeypatch.setenv("DISTCKPT_ZERO_COPY_MIN", str(SMALL_BLOCK))
    dio.reset_choices()
    return dio.choose_backend(ext4_dir, backend=request.param)


def _payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def test_ext4_enforces_dio_alignment(ext4_dir):
    """The ground the other tests stand on: ext4 reports an alignment and rejects unaligned I/O."""
    probe = os.path.join(ext4_dir, "p")
    open(probe, "wb").close()
    mem, off, source = _uring.statx_dioalign(probe)
    assert source == "statx" and mem > 1 and off > 1
    os.unlink(probe)
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        buf = mmap.mmap(-1, 4096)
        with pytest.raises(OSError) as ei:
            os.pwrite(fd, memoryview(buf)[:100], 0)
        assert ei.value.errno == errno.EINVAL
    finally:
        os.close(fd)


@pytest.mark.parametrize("size", [0, 1, 100, 511, 512, 513, 4095, 4097,
                                  SMALL_BLOCK - 1, SMALL_BLOCK, SMALL_BLOCK + 1, 11 * SMALL_BLOCK + 17])
def test_roundtrip_exact(choice, ext4_dir, size):
    data = _payload(size, size)
    path = os.path.join(ext4_dir, f"f{size}.bin")
    rng = random.Random(size)
    before = open_fds()
    with dio.open_writer(path, choice=choice) as w:
        assert w.backend == choice.name and w.alignment % 4096 == 0
        view = memoryview(bytearray(b"x" + data))[1:]  # unaligned source, like tensor memory
        pos = 0
        while pos < size:
            n = min(size - pos, rng.choice([1, 7, 511, 4096, SMALL_BLOCK + 3, 3 * SMALL_BLOCK]))
            assert w.write(view[pos:pos + n]) == pos + n
            pos += n
        assert w.tell() == size
    assert w.close() == size  # idempotent
    assert os.path.getsize(path) == size
    with open(path, "rb") as f:
        assert f.read() == data
    assert open_fds() == before


@pytest.mark.parametrize("offset", [1, 0], ids=["unaligned-source-staged", "aligned-source-zero-copy"])
def test_default_block_size_multi_block(ext4_dir, offset):
    """The production block size (4 MiB) with uring: a few blocks plus an odd tail. A source at an
    address the device cannot DMA from is copied through the staging blocks, which are registered
    with the ring at the first full block; an aligned one is written zero-copy from the caller's
    memory, with nothing to register. (The test used a bytes object, whose address the allocator
    picks: 1 time in 32 it was 512-aligned, went zero-copy, and the registration check failed.)"""
    dio.reset_choices()
    choice = dio.choose_backend(ext4_dir, backend="uring")
    n = 3 * (4 << 20) + 4097
    data = _payload(n, 1)
    area = mmap.mmap(-1, n + 4096)  # page-aligned: offset 0 is aligned, 1 is not
    src = memoryview(area)[offset:offset + n]
    src[:] = data
    path = os.path.join(ext4_dir, "big.bin")
    with dio.open_writer(path, choice=choice) as w:
        assert not w.fixed_buffers  # registered lazily, at the first full staging block
        w.write(src)
        if offset:
            # (RLIMIT_MEMLOCK may refuse an unprivileged registration)
            assert w.fixed_buffers or os.geteuid() != 0, f"registration refused: errno {w._c.fixed_buffers_errno}"
        else:
            assert not w.fixed_buffers and w._c.fixed_buffers_errno == 0
    del src
    area.close()
    with open(path, "rb") as f:
        assert f.read() == data


def test_env_forces_backend(ext4_dir, monkeypatch):
    for name in BACKENDS:
        monkeypatch.setenv("DISTCKPT_IO_BACKEND", name)
        from distckpt.config import get_config
        get_config.cache_clear()
        dio.reset_choices()
        path = os.path.join(ext4_dir, f"env-{name}.bin")
        with dio.open_writer(path) as w:
            assert w.backend == name
            w.write(b"abc")
        assert open(path, "rb").read() == b"abc"


def test_pad_to_and_aligned_chunks(choice, ext4_dir):
    path = os.path.join(ext4_dir, "pad.bin")
    with dio.open_writer(path, choice=choice) as w:
        w.write(b"a" * 10)
        assert w.pad_to() == w.alignment
        assert w.pad_to() == w.alignment  # already aligned: no-op
        w.write(b"b")
        assert w.pad_to(512) == w.alignment + 512
        w.write(b"c" * 3)
    raw = open(path, "rb").read()
    a = w.alignment
    assert raw == b"a" * 10 + bytes(a - 10) + b"b" + bytes(511) + b"ccc"


def test_durable_false_and_bytes_types(choice, ext4_dir):
    path = os.path.join(ext4_dir, "types.bin")
    arr = (ctypes.c_uint8 * 5)(*range(5))
    with dio.open_writer(path, choice=choice, durable=False) as w:
        w.write(b"xy")
        w.write(bytearray(b"z"))
        w.write(memoryview(arr))
    assert open(path, "rb").read() == b"xyz" + bytes(range(5))


def test_writer_refuses_existing_file_and_leaks_nothing(choice, ext4_dir):
    path = os.path.join(ext4_dir, "exists.bin")
    open(path, "wb").close()
    before = open_fds()
    with pytest.raises(E.StorageError) as ei:
        dio.open_writer(path, choice=choice)
    assert ei.value.errno == errno.EEXIST and isinstance(ei.value, OSError)
    assert open_fds() == before


def test_use_after_close_and_error_in_with_block(choice, ext4_dir):
    path = os.path.join(ext4_dir, "closed.bin")
    before = open_fds()
    with pytest.raises(RuntimeError):
        with dio.open_writer(path, choice=choice) as w:
            w.write(b"partial")
            raise RuntimeError("caller failed")
    assert w.closed and open_fds() == before
    assert os.path.exists(path)  # the partial file is the caller's to remove
    with pytest.raises(ValueError):
        w.write(b"more")
    assert w.close() == len(b"partial")  # no-op after abort: never masks the first error


@pytest.mark.parametrize("name", BACKENDS)
def test_fd_lifecycle_1000_cycles(ext4_dir, name, monkeypatch):
    """1000 x (open, write, close, unlink): no new fd at all, none pointing at a deleted file."""
    monkeypatch.setenv("DISTCKPT_BLOCK_SIZE", str(SMALL_BLOCK))
    dio.reset_choices()
    choice = dio.choose_backend(ext4_dir, backend=name)
    payload = _payload(SMALL_BLOCK + 123)
    before = open_fds()
    for i in range(1000):
        path = os.path.join(ext4_dir, f"cycle{i}.bin")
        w = dio.open_writer(path, choice=choice, durable=(i % 100 == 0))
        w.write(payload[: (i * 37) % len(payload)])
        w.close()
        os.unlink(path)
    after = open_fds()
    # (pytest's own capture files are deleted-but-open from the start: only ours matter)
    assert [t for t in after.values() if t.startswith(ext4_dir) or "cycle" in t] == []
    assert after == before


def _written(ext4_dir, choice, size, name="r.bin"):
    data = _payload(size, 7)
    path = os.path.join(ext4_dir, name)
    with dio.open_writer(path, choice=choice) as w:
        w.write(data)
    return path, data


def test_reader_unaligned_ranges_many_in_flight(choice, ext4_dir):
    size = 5 * SMALL_BLOCK + 333
    path, data = _written(ext4_dir, choice, size)
    rng = random.Random(3)
    reqs, expect = [], []
    for _ in range(200):
        off = rng.randrange(0, size)
        n = rng.randrange(0, min(size - off, 2 * SMALL_BLOCK + 5) + 1)
        kind = rng.randrange(3)
        if kind == 0:
            dest = bytearray(n)
        elif kind == 1:
            dest = (ctypes.c_char * n)()
        else:
            dest = memoryview(bytearray(n + 1))[1:]  # unaligned destination
        reqs.append((off, n, dest))
        expect.append(data[off:off + n])
    before = open_fds()
    with dio.open_reader(path, choice=choice) as r:
        assert r.size == size and r.backend == choice.name
        r.read_into(reqs)
    assert open_fds() == before
    for (off, n, dest), want in zip(reqs, expect):
        assert bytes(memoryview(dest).cast("B")) == want, (off, n)


def test_reader_aligned_zero_copy_path(choice, ext4_dir):
    """Page-aligned destination, offset and length: the direct (no staging) path."""
    size = 4 * SMALL_BLOCK
    path, data = _written(ext4_dir, choice, size)
    dest = mmap.mmap(-1, 3 * SMALL_BLOCK)
    with dio.open_reader(path, choice=choice) as r:
        r.read_into([(4096, 3 * SMALL_BLOCK - 4096, memoryview(dest)[: 3 * SMALL_BLOCK - 4096]),
                     (0, 0, bytearray())])
    assert bytes(dest[: 3 * SMALL_BLOCK - 4096]) == data[4096:3 * SMALL_BLOCK]


def test_reader_past_eof(choice, ext4_dir):
    path, data = _written(ext4_dir, choice, 1000)
    before = open_fds()
    with dio.open_reader(path, choice=choice) as r:
        with pytest.raises(E.DataFileTruncatedError) as ei:
            r.read_into([(0, 10, bytearray(10)), (990, 20, bytearray(20))])
        assert ei.value.expected == 1010 and ei.value.found == 1000
        dest = bytearray(10)
        r.read_into([(990, 10, dest)])  # still usable: checked before any I/O
        assert dest == data[990:]
        with pytest.raises(ValueError):
            r.read_into([(0, 10, bytearray(9))])
    assert r.closed and open_fds() == before
    with pytest.raises(ValueError):
        r.read_into([(0, 1, bytearray(1))])


def test_reader_missing_file(choice, ext4_dir):
    before = open_fds()
    with pytest.raises(E.StorageError) as ei:
        dio.open_reader(os.path.join(ext4_dir, "nope"), choice=choice)
    assert ei.value.errno == errno.ENOENT
    assert open_fds() == before


def test_choice_cached_logged_and_reported(ext4_dir, caplog):
    dio.reset_choices()
    with caplog.at_level(logging.INFO, logger="distckpt.storage.posix"):
        a = dio.choose_backend(ext4_dir, backend="auto")
        b = dio.choose_backend(ext4_dir, backend="auto")
    assert a is b and a.name == "uring"
    assert dio.last_choices() == [a]
    assert len([r for r in caplog.records if "uring" in r.getMessage()]) == 1
    assert a.offset_align >= 512 and a.mem_align >= 512 and a.reason


def test_exchange_and_fsync_paths(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("A")
    (b / "x").write_text("B")
    before = open_fds()
    dio.exchange_paths(a, b)
    assert (a / "x").read_text() == "B" and (b / "x").read_text() == "A"
    dio.fsync_path(tmp_path)
    dio.fsync_path(a / "x")
    with pytest.raises(E.StorageError) as ei:
        dio.exchange_paths(a, tmp_path / "missing")
    assert ei.value.errno == errno.ENOENT
    with pytest.raises(E.StorageError) as ei:
        dio.fsync_path(tmp_path / "missing")
    assert ei.value.errno == errno.ENOENT
    assert open_fds() == before


@pytest.mark.parametrize("lead", [0, 1, 512, 4096, SMALL_BLOCK - 512])
def test_aligned_source_zero_copy_path(choice, ext4_dir, lead):
    """Page-aligned sources of >= one block go straight from caller memory (no staging copy) on
    the O_DIRECT backends, after `lead` bytes went through staging; mixed with copies and a tail."""
    big = 5 * SMALL_BLOCK + 700  # not a multiple of the alignment: the rest goes through staging
    src = mmap.mmap(-1, big + 4096)
    src.write(_payload(big + 4096, lead))
    head = _payload(lead, 99)
    path = os.path.join(ext4_dir, "zc.bin")
    before = open_fds()
    with dio.open_writer(path, choice=choice) as w:
        w.write(head)
        w.write(memoryview(src)[:big])            # aligned address
        w.write(memoryview(src)[4096:4096 + big])  # aligned again, file position now unaligned
        w.pad_to(4096)
        w.write(memoryview(src)[:2 * SMALL_BLOCK])  # aligned address and aligned position
    src_bytes = bytes(src)
    expect = head + src_bytes[:big] + src_bytes[4096:4096 + big]
    expect += bytes(-len(expect) % 4096) + src_bytes[: 2 * SMALL_BLOCK]
    assert open(path, "rb").read() == expect
    assert open_fds() == before


@pytest.mark.parametrize("hint_delta", [0, -SMALL_BLOCK, 10 * SMALL_BLOCK + 3])
def test_size_hint_exact_under_over(choice, ext4_dir, hint_delta):
    """A size hint preallocates; the file still ends up exactly as long as what was written."""
    data = _payload(3 * SMALL_BLOCK + 5, 5)
    path = os.path.join(ext4_dir, "hint.bin")
    with dio.open_writer(path, choice=choice, size_hint=len(data) + hint_delta) as w:
        w.write(data)
    assert os.path.getsize(path) == len(data)
    assert open(path, "rb").read() == data


@pytest.mark.parametrize("ring", [(4096, 2), (16 << 10, 3), (64 << 10, 9)])
def test_staging_ring_smaller_than_requests(ext4_dir, ring):
    """The staging ring (stage_block x stage_blocks) is sized apart from the zero-copy request size:
    a small ring still writes every byte in place, staged and zero-copy writes interleaved."""
    stage_block, stage_blocks = ring
    src = mmap.mmap(-1, 9 * SMALL_BLOCK)
    src.write(_payload(9 * SMALL_BLOCK, stage_block))
    head = _payload(3 * stage_block + 123, 7)
    path = os.path.join(ext4_dir, "ring.bin")
    w = _uring.Writer(path, block_size=SMALL_BLOCK, queue_depth=8, offset_align=4096, mem_align=512,
                      fixed_buffers=True, stage_block=stage_block, stage_blocks=stage_blocks)
    w.write(head)                                      # staged, several ring turns
    w.write(memoryview(src)[: 4 * SMALL_BLOCK])         # aligned source, unaligned position: staged
    w.zeros(-w.tell() % 4096)
    w.write(memoryview(src)[: 9 * SMALL_BLOCK])         # aligned both: zero-copy requests of SMALL_BLOCK
    w.write(memoryview(bytearray(b"x" + head))[1:])     # staged again
    size = w.flush()
    w.close()
    data = bytes(src)
    expect = head + data[: 4 * SMALL_BLOCK]
    expect += bytes(-len(expect) % 4096) + data + head
    assert size == len(expect) and open(path, "rb").read() == expect


def test_staging_ring_arguments_are_checked(ext4_dir):
    for kw in ({"stage_block": 3 << 12}, {"stage_block": 2 * SMALL_BLOCK}, {"stage_blocks": 1},
               {"stage_blocks": 10}):
        with pytest.raises(ValueError, match="stage_block"):
            _uring.Writer(os.path.join(ext4_dir, "x.bin"), block_size=SMALL_BLOCK, queue_depth=8, **kw)
        assert not os.path.exists(os.path.join(ext4_dir, "x.bin"))


@pytest.mark.parametrize("lead", [0, 100])  # 0: page-aligned source at an aligned position (zero-copy)
def test_write_checksummed_matches_block_crcs(choice, ext4_dir, lead):
    """write_checksummed computes, in the write's own pass, the checksums save records: equal to
    manifest.block_crcs for every path (zero-copy, staged, buffered) and block/length mix."""
    from distckpt import manifest as mf
    rng = random.Random(lead)
    path = os.path.join(ext4_dir, "c.bin")
    expect = b"x" * lead
    with dio.open_writer(path, choice=choice) as w:
        w.write(expect)
        for n, block in [(0, 4096), (1, 4096), (5 * SMALL_BLOCK + 77, 16 << 10), (9 * SMALL_BLOCK, 64 << 10),
                         (3 * SMALL_BLOCK, 1 << 20)]:
            if lead == 0:
                w.pad_to(4096)
                expect += bytes(-len(expect) % 4096)
            src = mmap.mmap(-1, max(n, 1))
            src[:n] = rng.randbytes(n)
            data = memoryview(src)[:n]
            assert w.write_checksummed(data, block) == mf.block_crcs(bytes(data), block), (n, block)
            expect += bytes(data)
            data.release()
    with open(path, "rb") as f:
        assert f.read() == expect


@pytest.mark.parametrize("lead", [1, 64, 511, 4095])
def test_pad_for_places_misaligned_sources_for_zero_copy(choice, ext4_dir, lead):
    """A large source that starts ``lead`` bytes past a page (torch's large tensors: 64) is placed
    so that its first aligned byte lands on an aligned file position: the head is staged, the
    rest written from the source; the file holds exactly the bytes at the offsets returned."""
    rng = random.Random(lead)
    path = os.path.join(ext4_dir, "p.bin")
    src = mmap.mmap(-1, 4 * SMALL_BLOCK + 8192)
    src[:] = rng.randbytes(len(src))
    chunks = []
    with dio.open_writer(path, choice=choice) as w:
        end = w.write(b"y" * 333)
        for n in (3 * SMALL_BLOCK + 5, 100, 2 * SMALL_BLOCK):
            data = memoryview(src)[lead:lead + n]
            off = w.pad_for(data)
            aligned = -(-end // w.alignment) * w.alignment
            assert aligned <= off < aligned + choice.offset_align  # at most offset_align - 1 more
            # zero-copy from one request (twice the block size) past the first aligned byte
            if choice.name != "buffered" and n >= 2 * SMALL_BLOCK + choice.mem_align:
                # the source's first mem-aligned byte is at an offset-aligned file position
                assert (off + (-_uring.address(data) % choice.mem_align)) % choice.offset_align == 0
            crcs = w.write_checksummed(data, 16 << 10)
            end = off + n
            chunks.append((off, bytes(data), crcs))
            data.release()
    with open(path, "rb") as f:
        out = f.read()
    from distckpt import manifest as mf
    for off, want, crcs in chunks:
        assert out[off:off + len(want)] == want
        assert crcs == mf.block_crcs(want, 16 << 10)


class _Holder:
    """What a save passes as ``hold``: the only thing keeping a source's memory alive."""

    def __init__(self, n: int, seed: int) -> None:
        self.mem = mmap.mmap(-1, n)
        self.mem[:] = random.Random(seed).randbytes(n)


def test_held_sources_stay_in_flight_one_at_a_time_and_are_released(choice, ext4_dir):
    """write_checksummed(..., hold=obj): zero-copy writes of a source may outlive the call, so the
    writer references ``obj`` while they are in flight, never more than one held source at a time
    (a new held source is taken only once the previous one's writes are done, and the previous one
    is then let go), and none after close. The test overwrites each source as soon as the writer
    has let it go: the file still holds the bytes as they were."""
    import gc
    import sys
    import weakref
    from distckpt import manifest as mf
    path = os.path.join(ext4_dir, "h.bin")
    n = 64 * 2 * SMALL_BLOCK  # 64 zero-copy requests: the queue is full when the call returns
    expect, refs, holding = bytearray(), [], []
    prev = None
    with dio.open_writer(path, choice=choice) as w:
        for i in range(6):
            expect += bytes(w.pad_to(4096) - len(expect))
            holder = _Holder(n + 4096 * (i % 2), seed=i)
            view = memoryview(holder.mem)
            want = bytes(view)
            base = sys.getrefcount(holder)
            prev_refs = sys.getrefcount(prev)
            assert w.write_checksummed(view, 16 << 10, hold=holder) == mf.block_crcs(want, 16 << 10)
            expect += want
            holding.append(w._c.holding if w._c is not None else False)
            # referenced by the writer exactly while it is the held source
            assert sys.getrefcount(holder) - base == int(holding[-1])
            if prev is not None and (holding[-1] or not holding[-2]):
                # one held source at a time: taking this one let the previous one go
                assert sys.getrefcount(prev) == prev_refs - int(holding[-2])
                prev.mem[:] = bytes(len(prev.mem))  # a write still reading it would be caught
            del view  # (the writer holds its own export of the buffer while it writes from it)
            refs.append(weakref.ref(holder))
            prev = holder
            del holder
            gc.collect()
        if choice.name == "uring":
            assert any(holding)  # the queue really stays full from one source to the next
        else:
            assert not any(holding)  # pwrite and buffered finish every write in the call
    del prev
    gc.collect()
    assert all(r() is None for r in refs)  # nothing is kept after close
    with open(path, "rb") as f:
        assert f.read() == bytes(expect)


def test_held_source_released_when_the_writer_is_aborted(choice, ext4_dir):
    """A writer aborted (or collected) with a held source in flight waits for its writes and
    releases it: no reference outlives the writer, no fd stays open."""
    import gc
    import weakref
    before = open_fds()
    w = dio.open_writer(os.path.join(ext4_dir, "a.bin"), choice=choice)
    holder = _Holder(64 * 2 * SMALL_BLOCK, seed=7)
    w.write_checksummed(memoryview(holder.mem), 16 << 10, hold=holder)
    ref = weakref.ref(holder)
    del holder
    w.abort()
    gc.collect()
    assert ref() is None and w.closed and open_fds() == before


def test_only_the_held_source_has_writes_in_flight_between_calls(choice, ext4_dir):
    """Sources of two requests each, so a call returns while the previous source's writes may
    still be in flight: after every call the zero-copy writes in flight all come from one source,
    the one the writer holds."""
    path = os.path.join(ext4_dir, "s.bin")
    holders = [_Holder(2 * 2 * SMALL_BLOCK, seed=i) for i in range(4)]
    with dio.open_writer(path, choice=choice) as w:
        for i in range(200):
            h = holders[i % 4]
            w.write_checksummed(memoryview(h.mem), 16 << 10, hold=h)
            if w._c is not None:
                sources = w._c.direct_sources
                assert sources <= 1 and (sources == 0 or w._c.holding), (i, sources)
            if i % 7 == 3:
                w.write(b"z" * 1000)  # a staged write between two held ones takes nothing over
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    for i in range(200):
        assert data[pos:pos + 4 * SMALL_BLOCK] == holders[i % 4].mem[:], i
        pos += 4 * SMALL_BLOCK
        if i % 7 == 3:
            assert data[pos:pos + 1000] == b"z" * 1000
            pos += 1000
    assert pos == len(data)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_save_spreads_small_pieces_between_held_ones(backend, ext4_dir, monkeypatch):
    """With io_uring, a save writes the small pieces into the gaps after the large (held,
    zero-copy) ones, whose writes are still in flight (datafile.write_order); the other back ends
    keep the state's order. Either way the load is exact and nothing is left open."""
    import torch

    import distckpt
    from distckpt.restore import load_manifest
    monkeypatch.setenv("DISTCKPT_IO_BACKEND", backend)
    monkeypatch.setenv("DISTCKPT_BLOCK_SIZE", str(SMALL_BLOCK))
    monkeypatch.setenv("DISTCKPT_ZERO_COPY_MIN", str(SMALL_BLOCK))
    dio.reset_choices()
    g = torch.Generator().manual_seed(7)
    state = {f"s{i:02d}": torch.rand(1024, generator=g) for i in range(12)}            # 4 KiB each
    state.update({f"l{i}": torch.rand(3 * SMALL_BLOCK // 4 + 1, generator=g) for i in range(3)})  # 192 KiB + 4 B
    fds = open_fds()
    path = os.path.join(ext4_dir, "ck")
    distckpt.save(state, path)
    m = load_manifest(path)
    by_offset = [k for k, _ in sorted(((k, t.chunks[0].offset) for k, t in m.tensors.items()), key=lambda kv: kv[1])]
    kinds = "".join(k[0] for k in by_offset)
    if backend == "uring":
        assert kinds == "lsssslssssl" + "ssss", by_offset   # 48 KiB of small pieces after each
    else:
        assert kinds == "s" * 12 + "lll", by_offset
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    distckpt.load(out, path)
    assert all(torch.equal(out[k], state[k]) for k in state)
    assert open_fds() == fds
