"""The C read pipeline of a load (`_uring.Reader.fill`, csrc/reader.c) and its crc32c (csrc/crc32c.c):
checks before copies, nothing copied after a mismatch, a bad plan refused before any I/O, short
files, the page-cache path. distckpt.load's own guarantees are in test_load_safety.py and
test_load_pipeline.py. About 2 s."""

from __future__ import annotations

import mmap
import os
import random

import pytest
import torch

from distckpt import _uring
from distckpt import errors as E
from distckpt import fill as F
from distckpt.checksum import crc32c
from distckpt.storage import posix as dio

from ..conftest import open_fds
from .test_io_roundtrip import ext4_dir  # noqa: F401 - fixture

BLOCK = 16 << 10      # checksum block of these tests
SLOT = 64 << 10       # bounce slot: a segment reads at most this much
SIZE = 5 * SLOT + 333  # the file: five full segments and an unaligned tail


@pytest.fixture(params=("uring", "pwrite"))
def choice(request, ext4_dir):  # noqa: F811
    dio.reset_choices()
    return dio.choose_backend(ext4_dir, backend=request.param)


def _file(ext4_dir, choice):  # noqa: F811
    data = random.Random(5).randbytes(SIZE)
    path = os.path.join(ext4_dir, "f.bin")
    with dio.open_writer(path, choice=choice) as w:
        w.write(data)
    return path, data


def _plan(data: bytes, dest: torch.Tensor, *, bad_check: int | None = None):
    """One segment per SLOT of the file; every segment checked in BLOCK blocks and copied whole
    to the same offset of ``dest`` (a flat uint8 tensor of SIZE bytes)."""
    segs, checks, copies = bytearray(), bytearray(), bytearray()
    dests = F._DEST.pack(dest.data_ptr(), dest.numel())
    nchecks = ncopies = 0
    for i, off in enumerate(range(0, SIZE, SLOT)):
        want = min(SLOT, SIZE - off)
        c0 = nchecks
        for a in range(0, want, BLOCK):
            n = min(BLOCK, want - a)
            crc = crc32c(data[off + a:off + a + n])
            if bad_check == nchecks:
                crc ^= 1
            checks += F._CHECK.pack(a, n, crc)
            nchecks += 1
        copies += F._COPY.pack(off, 0, 0, want, 0)
        segs += F._SEG.pack(off, SLOT, want, c0, nchecks - c0, ncopies, 1)
        ncopies += 1
    return bytes(segs), bytes(checks), bytes(copies), dests


def _reference_table() -> list[int]:
    table = []
    for n in range(256):
        for _ in range(8):
            n = (n >> 1) ^ (0x82F63B78 & -(n & 1))  # the Castagnoli polynomial, reflected
        table.append(n)
    return table


_TABLE = _reference_table()


def _reference_crc32c(data: bytes) -> int:
    """CRC-32C from its definition (RFC 3720, appendix B.4), one byte at a time in Python: the
    reference both C paths are checked against."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def test_crc32c_matches_the_published_check_values():
    # RFC 3720 B.4 and the CRC catalogue's check value; the format's checksums are these.
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(bytes(32)) == 0x8A9136AA
    assert crc32c(b"\xff" * 32) == 0x62A8AB43
    assert crc32c(bytes(range(32))) == 0x46DD794E
    assert crc32c(bytes(range(31, -1, -1))) == 0x113FDB5C


def test_crc32c_matches_the_reference_on_both_paths():
    rng = random.Random(1)
    for n in [0, 1, 7, 8, 9, 767, 768, 769, 3 * 256 * 2 + 5, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 1, 100_003, 1 << 20]:
        data = rng.randbytes(n)
        want = _reference_crc32c(data)
        for lead in (0, 3, 7):  # the same bytes starting at several memory alignments
            b = memoryview(bytes(lead) + data)[lead:]
            assert crc32c(b) == want, (n, lead)
            assert _uring.crc32c(b) == want, (n, lead)
            assert _uring.crc32c(b, 0, False) == want, (n, lead)
            assert _uring.crc32c(b[n // 3:], _uring.crc32c(b[:n // 3])) == want  # continues a crc


def test_record_layout_matches_the_c_structs():
    assert (F._SEG.size, F._CHECK.size, F._COPY.size, F._DEST.size) == (32, 12, 24, 16)


def _cached_fraction(path: str) -> tuple[int, int]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return _uring.cached_pages(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _drop_pages(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.parametrize("through_cache", (False, True), ids=("direct", "through-cache"))
def test_fill_checks_then_copies_every_segment(choice, ext4_dir, through_cache):  # noqa: F811
    """O_DIRECT reads leave the file's pages uncached; reads through the cache (what a load of a
    file that fits the page cache does) are in flight the same way and leave every page cached,
    so the next load is served from memory."""
    path, data = _file(ext4_dir, choice)
    _drop_pages(path)
    dest = torch.zeros(SIZE, dtype=torch.uint8)
    buf = mmap.mmap(-1, 3 * SLOT)  # three slots: several reads in flight
    done = bytearray(6)
    before = open_fds()
    with dio.open_reader(path, choice=choice, through_cache=through_cache) as r:
        assert r.supports_fill and r.through_cache is through_cache
        assert r.fill_segments(buf, SLOT, *_plan(data, dest), done) is None
        if through_cache:  # the kernel's readahead may have cached later segments by their turn
            assert r.buffered_bytes + r.cached_bytes == SIZE and r.buffered_bytes >= SLOT and r.direct_bytes == 0
        else:  # (the writer may leave the unaligned tail's page cached: then that segment is cached)
            assert r.direct_bytes + r.cached_bytes == SIZE and r.direct_bytes >= 5 * SLOT and r.buffered_bytes == 0
    assert open_fds() == before
    assert bytes(done) == b"\x01" * 6
    assert bytes(dest.numpy()) == data
    cached, total = _cached_fraction(path)
    if through_cache:
        assert cached == total
    else:
        assert cached <= 1  # at most the tail's page


def test_fill_through_cache_still_checks_before_copying(choice, ext4_dir):  # noqa: F811
    """A bit flipped on the device (pages dropped, so the buffered read fetches it) is caught by
    the crc32c before anything of its segment is copied, exactly as on the O_DIRECT path."""
    path, data = _file(ext4_dir, choice)
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes([data[2 * SLOT + 5] ^ 0x10]), 2 * SLOT + 5)
    finally:
        os.close(fd)
    _drop_pages(path)
    dest = torch.zeros(SIZE, dtype=torch.uint8)
    done = bytearray(6)
    with dio.open_reader(path, choice=choice, through_cache=True) as r:
        bad = r.fill_segments(mmap.mmap(-1, 2 * SLOT), SLOT, *_plan(data, dest), done)
    assert bad is not None and bad[0] == 2
    assert done[2] == 0 and bytes(dest.numpy())[2 * SLOT:3 * SLOT] == bytes(SLOT)


def test_fill_through_cache_of_a_truncated_file_is_typed(choice, ext4_dir):  # noqa: F811
    path, data = _file(ext4_dir, choice)
    os.truncate(path, 3 * SLOT + 100)
    _drop_pages(path)
    dest = torch.zeros(SIZE, dtype=torch.uint8)
    r = dio.open_reader(path, choice=choice, through_cache=True)
    with pytest.raises(E.DataFileTruncatedError):
        r.fill_segments(mmap.mmap(-1, 2 * SLOT), SLOT, *_plan(data, dest), bytearray(6))
    assert r.closed


def test_fill_mismatch_copies_nothing_of_that_segment_or_after(choice, ext4_dir):  # noqa: F811
    path, data = _file(ext4_dir, choice)
    dest = torch.zeros(SIZE, dtype=torch.uint8)
    buf = mmap.mmap(-1, 2 * SLOT)
    done = bytearray(6)
    bad = SLOT // BLOCK + 2  # the third block of segment 1
    with dio.open_reader(path, choice=choice) as r:
        got = r.fill_segments(buf, SLOT, *_plan(data, dest, bad_check=bad), done)
        assert not r.closed  # a mismatch is not an I/O error: the reader stays usable
    seg, check, crc = got
    assert (seg, check) == (1, bad)
    assert crc == crc32c(data[SLOT + 2 * BLOCK:SLOT + 3 * BLOCK])
    # Segment 0 was copied if its read landed before segment 1's (completion order is the
    # kernel's: a buffered read may finish second); done says which, and its bytes agree.
    assert bytes(done[1:]) == b"\x00" * 5 and done[0] in (0, 1)
    out = bytes(dest.numpy())
    assert out[:SLOT] == (data[:SLOT] if done[0] else bytes(SLOT))
    assert out[SLOT:] == bytes(SIZE - SLOT)  # segment 1 verified blocks included: nothing copied


def test_fill_refuses_a_bad_plan_before_any_io(choice, ext4_dir):  # noqa: F811
    path, data = _file(ext4_dir, choice)
    dest = torch.zeros(SIZE, dtype=torch.uint8)
    segs, checks, copies, dests = _plan(data, dest)
    small = F._DEST.pack(dest.data_ptr(), SIZE - 1)  # the last copy would pass the destination
    buf = mmap.mmap(-1, 2 * SLOT)
    with dio.open_reader(path, choice=choice) as r:
        with pytest.raises(ValueError, match="copy 5 is out of bounds"):
            r.fill_segments(buf, SLOT, segs, checks, copies, small, bytearray(6))
        past = bytearray(segs)
        past[-32:] = F._SEG.pack(5 * SLOT, SLOT, SLOT, 0, 1, 5, 1)  # wants more than the slot's read
        with pytest.raises(ValueError, match="check 0 passes"):
            r.fill_segments(buf, SLOT, bytes(past[:-32]) + F._SEG.pack(5 * SLOT, 4096, 4096, 0, 1, 5, 1),
                            checks, copies, dests, bytearray(6))
        with pytest.raises(ValueError, match="slot"):
            r.fill_segments(buf, SLOT + 1, segs, checks, copies, dests, bytearray(6))
        with pytest.raises(ValueError, match="segment 0 is out of bounds"):
            r.fill_segments(buf, SLOT // 2, segs, checks, copies, dests, bytearray(6))
        with pytest.raises(ValueError, match="records"):
            r.fill_segments(buf, SLOT, segs[:-1], checks, copies, dests, bytearray(6))
        assert not r.closed
    assert int(dest.count_nonzero()) == 0


def test_fill_short_file_is_truncation(choice, ext4_dir):  # noqa: F811
    path, data = _file(ext4_dir, choice)
    dest = torch.zeros(SIZE, dtype=torch.uint8)
    segs, checks, copies, dests = _plan(data, dest)
    buf = mmap.mmap(-1, 2 * SLOT)
    before = open_fds()
    r = dio.open_reader(path, choice=choice)
    os.truncate(path, 3 * SLOT + 100)  # shrinks after open: segments 3 and 4 cannot arrive
    done = bytearray(6)
    with pytest.raises(E.DataFileTruncatedError):
        r.fill_segments(buf, SLOT, segs, checks, copies, dests, done)
    assert r.closed and open_fds() == before
    assert done[:3] == b"\x01\x01\x01" and done[3:] == b"\x00\x00\x00"
    assert bytes(dest.numpy())[3 * SLOT:] == bytes(SIZE - 3 * SLOT)


def test_fill_reads_cached_pages_with_buffered_reads(ext4_dir):  # noqa: F811
    dio.reset_choices()
    choice = dio.choose_backend(ext4_dir, backend="uring")
    path, data = _file(ext4_dir, choice)
    with open(path, "rb") as f:  # a buffered read leaves every page cached
        assert f.read() == data
    dest = torch.zeros(SIZE, dtype=torch.uint8)
    with dio.open_reader(path, choice=choice) as r:
        assert r.fill_segments(mmap.mmap(-1, 2 * SLOT), SLOT, *_plan(data, dest), bytearray(6)) is None
        assert r.cached_bytes == SIZE and r.direct_bytes == 0 and r.buffered_bytes == 0
    assert bytes(dest.numpy()) == data


def test_buffered_backend_has_no_pipeline(ext4_dir):  # noqa: F811
    dio.reset_choices()
    choice = dio.choose_backend(ext4_dir, backend="buffered")
    path, _ = _file(ext4_dir, choice)
    with dio.open_reader(path, choice=choice) as r:
        assert not r.supports_fill  # fill.py gives its segments to the worker threads


def test_fill_keeps_its_buffer_registered_until_another_comes_or_close(choice, ext4_dir):  # noqa: F811
    """With io_uring the slots stay registered with the ring between fills (a conversion's many
    small reads paid the registration of every slot page per read): the reader holds the buffer
    (an export: the mmap cannot be unmapped under the kernel) until a fill passes another buffer
    or the reader closes. Every fill's bytes are right, through the kept registration or a new
    one. With pwrite nothing is registered and nothing held."""
    path, data = _file(ext4_dir, choice)
    held = choice.name == "uring"
    first, second = mmap.mmap(-1, 3 * SLOT), mmap.mmap(-1, 2 * SLOT)
    with dio.open_reader(path, choice=choice, use_cache=False) as r:
        for buf in (first, first, second):
            dest = torch.zeros(SIZE, dtype=torch.uint8)
            assert r.fill_segments(buf, SLOT, *_plan(data, dest), bytearray(6)) is None
            assert bytes(dest.numpy()) == data
        first.close()  # released when `second` came
        if held:
            with pytest.raises(BufferError):
                second.close()
        else:
            second.close()
    second.close()  # released by close()
