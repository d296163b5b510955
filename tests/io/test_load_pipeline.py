"""The load's read pipeline (distckpt.fill): verify before copy, bounded memory, bounded reads.

* A corrupt block never reaches the caller's tensors, and the error names what was filled.
* Peak RSS added by a load stays within 32 MiB of the tensors being filled (here they are already
  resident, so within 32 MiB), at 1, 2 and 3 gloo ranks, and nothing is held after it returns;
  measured in fresh spawned processes from /proc/self/status (VmHWM reset through clear_refs).
* A resharding load reads at most 1.1x the bytes it needs, for chunks smaller than a MiB too.
* Pages already in the page cache are read without O_DIRECT; a load of a checkpoint that fits
  the page cache leaves it cached (DISTCKPT_READ_CACHE=auto), so a second load reads memory.
"""

from __future__ import annotations

import ctypes
import gc
import os
import shutil

import pytest
import torch

import distckpt
from distckpt.errors import ChecksumMismatchError

from ..conftest import open_fds
from ..helpers.distributed import run_ranks

MiB = 1 << 20
SENTINEL = 7.0


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.rand(4096, 1024, generator=g),          # 16 MiB: several segments
            "b": torch.rand(4096, generator=g),                # 16 KiB: one segment
            "c": torch.rand(2048, 1024, generator=g)}          # 8 MiB


def _flip(path: str, key: str, at: int) -> None:
    m = distckpt.read_manifest(path)
    chunk = m["tensors"][key]["chunks"][0]
    fpath = os.path.join(path, m["files"][chunk["file"]]["name"])
    with open(fpath, "r+b") as f:
        f.seek(chunk["offset"] + at)
        byte = f.read(1)
        f.seek(chunk["offset"] + at)
        f.write(bytes([byte[0] ^ 0xFF]))


def _sentinel_like(sd: dict) -> dict:
    return {k: torch.full_like(v, SENTINEL) for k, v in sd.items()}


def test_corrupt_block_never_reaches_the_callers_tensor(tmp_path):
    src = _state()
    path = str(tmp_path / "ckpt")
    distckpt.save(src, path)
    block = distckpt.read_manifest(path)["checksum_block"]
    bad = 5 * MiB + 123  # a byte in the middle of "a", inside its 6th MiB
    _flip(path, "a", bad)
    dst = _sentinel_like(src)
    before = open_fds()
    with pytest.raises(ChecksumMismatchError) as info:
        distckpt.load(dst, path)
    assert open_fds() == before, "every reader of every worker is closed when the load raises"
    e = info.value
    assert e.key == "a"
    assert "already filled" in str(e) and isinstance(e.filled, list) and isinstance(e.partly_filled, list)
    # No byte of the corrupt block (nor anything unverified) landed in the caller's tensor.
    a = dst["a"].reshape(-1).view(torch.uint8)
    lo = bad // block * block
    assert torch.all(a[lo:lo + block].view(torch.float32) == SENTINEL)
    # Every byte is either as it was or the checkpoint's; the error says which keys were touched.
    for k in dst:
        same = dst[k] == src[k]
        untouched = dst[k] == SENTINEL
        assert torch.all(same | untouched), k
        if k in e.filled:
            assert torch.equal(dst[k], src[k]), k
        elif k in e.partly_filled:
            assert not torch.all(untouched), k
        else:
            assert torch.all(untouched), f"{k} changed but the error does not say so"
    assert "a" not in e.filled


def test_corrupt_small_tensor_is_left_untouched(tmp_path):
    src = _state(1)
    path = str(tmp_path / "ckpt")
    distckpt.save(src, path)
    _flip(path, "b", 4000)
    dst = _sentinel_like(src)
    with pytest.raises(ChecksumMismatchError) as info:
        distckpt.load(dst, path)
    assert info.value.key == "b" and "b" not in info.value.filled + info.value.partly_filled
    assert torch.all(dst["b"] == SENTINEL), "no byte of the corrupt tensor may change"
    # A good load afterwards fills everything.
    _flip(path, "b", 4000)
    distckpt.load(dst, path)
    assert all(torch.equal(dst[k], src[k]) for k in src)


# ------------------------------------------------------------------------------------------------
# Memory


N_BIG, BIG_ROWS, COLS, N_SMALL = 4, 1024, 4096, 500   # 4 x 16 MiB + 500 x 4 KiB = 66 MiB


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _trim() -> None:
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)


def _memory_body(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    mesh = init_device_mesh("cpu", (world,)) if world > 1 else None
    rows = [len(c) for c in torch.arange(BIG_ROWS).chunk(world)]  # DTensor's Shard(0) split
    start = sum(rows[:rank])

    def dst():
        sd = {}
        for i in range(N_BIG):
            local = torch.zeros(rows[rank], COLS)  # zeros: resident before the load starts
            sd[f"big.{i}"] = local if mesh is None else DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=(BIG_ROWS, COLS), stride=(COLS, 1))
        sd.update({f"small.{i}": torch.zeros(COLS // 4) for i in range(N_SMALL)})
        return sd

    distckpt.load(dst(), path)  # warm-up: imports, backend probe, the workers' first thread stacks
    sd = dst()
    _trim()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5\n")  # VmHWM := VmRSS
    before = _status("VmRSS")
    distckpt.load(sd, path)
    peak = _status("VmHWM")
    _trim()
    after = _status("VmRSS")
    local = sd["big.3"] if mesh is None else sd["big.3"].to_local()
    want = torch.arange(BIG_ROWS * COLS, dtype=torch.float32).reshape(BIG_ROWS, COLS)[start:start + rows[rank]] + 3
    assert torch.equal(local, want)
    return peak - before, after - before


@pytest.fixture(scope="module")
def big_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("loadmem")
    path = str(root / "ckpt")
    base = torch.arange(BIG_ROWS * COLS, dtype=torch.float32).reshape(BIG_ROWS, COLS)
    sd = {f"big.{i}": base + i for i in range(N_BIG)}
    sd.update({f"small.{i}": torch.full((COLS // 4,), float(i)) for i in range(N_SMALL)})
    distckpt.save(sd, path)
    del sd, base
    yield path
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_load_memory_is_bounded_and_released(big_ckpt, world):
    for rank, (added, held) in enumerate(run_ranks(_memory_body, world, big_ckpt)):
        assert added <= 32 * MiB, f"rank {rank}/{world}: a load added {added / MiB:.1f} MiB of RSS at its peak"
        assert held <= 2 * MiB, f"rank {rank}/{world}: {held / MiB:.1f} MiB still held after load returned"


def _save_memory_body(rank, world, root):
    sd = {f"big.{i}": torch.full((BIG_ROWS, COLS), float(i)) for i in range(N_BIG)}
    sd.update({f"small.{i}": torch.full((COLS // 4,), float(i)) for i in range(N_SMALL)})
    distckpt.save(sd, os.path.join(root, "warm"))  # imports, backend probe, first thread stacks
    shutil.rmtree(os.path.join(root, "warm"))
    _trim()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5\n")  # VmHWM := VmRSS
    before = _status("VmRSS")
    distckpt.save(sd, os.path.join(root, "ckpt"))
    return _status("VmHWM") - before


def test_save_memory_is_bounded(tmp_path):
    """A sync save adds at most 16 MiB of RSS (issue 14): the writer's staging ring (default
    4 x 2 MiB) is the only buffer; large aligned tensors are written from their own memory."""
    (added,) = run_ranks(_save_memory_body, 1, str(tmp_path))
    assert added <= 16 * MiB, f"a save added {added / MiB:.1f} MiB of RSS at its peak"
    shutil.rmtree(tmp_path / "ckpt")


# ------------------------------------------------------------------------------------------------
# Bytes read by a resharding load


SHAPES = {f"w{i}": (256 + 8 * i, 1024) for i in range(6)}        # ~1 MiB each: chunks < 1 MiB
SHAPES.update({f"norm{i}": (1024,) for i in range(6)})            # 4 KiB vectors, split too


def _full(name):
    n = 1
    for s in SHAPES[name]:
        n *= s
    return torch.arange(n, dtype=torch.float32).reshape(SHAPES[name]) + len(name)


def _save_sharded(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    distckpt.save({k: distribute_tensor(_full(k), mesh, [Shard(0)]) for k in SHAPES}, path)


def _load_sharded(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    sd = {k: distribute_tensor(torch.zeros(s), mesh, [Shard(0)]) for k, s in SHAPES.items()}
    res = distckpt.load(sd, path)
    needed = sum(v.to_local().numel() * 4 for v in sd.values())
    assert all(torch.equal(v.full_tensor(), _full(k)) for k, v in sd.items())
    return res.bytes_read, needed


def test_resharding_load_reads_at_most_1_1x_what_it_needs(tmp_path):
    """A 2-rank checkpoint of ~1 MiB tensors (chunks of ~512 KiB) loaded on 3 ranks: with 1 MiB
    checksum blocks every piece read its whole chunk (2.0x); the save now picks small blocks."""
    path = str(tmp_path / "ckpt")
    run_ranks(_save_sharded, 2, path)
    out = run_ranks(_load_sharded, 3, path)
    read, needed = sum(r for r, _ in out), sum(n for _, n in out)
    assert read <= 1.1 * needed, f"read {read} bytes for {needed} needed ({read / needed:.3f}x)"


# ------------------------------------------------------------------------------------------------
# Page cache


def test_cached_pages_are_read_without_o_direct(tmp_path):
    from distckpt.storage.posix import choose_backend, open_reader
    path = str(tmp_path / "ckpt")
    distckpt.save({"t": torch.rand(1 << 20)}, path)  # 4 MiB, written with O_DIRECT: not cached
    fpath = os.path.join(path, distckpt.read_manifest(path)["files"][0]["name"])
    choice = choose_backend(path)
    if choice.name == "buffered":
        pytest.skip("this file system refuses O_DIRECT: every read is buffered")
    size = os.path.getsize(fpath)
    fd = os.open(fpath, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # drop this file's clean pages
        buf = bytearray(size)
        with open_reader(fpath, choice=choice, through_cache=False) as r:
            r.read_into([(0, size, buf)])
            assert (r.direct_bytes, r.cached_bytes) == (size, 0)
        assert os.pread(fd, size, 0) == bytes(buf)  # buffered: now the pages are cached
        with open_reader(fpath, choice=choice) as r:
            r.read_into([(0, size, buf)])
            assert (r.direct_bytes, r.cached_bytes) == (0, size)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------------
# Ordering and shared workers (what an incremental chain's restore relies on)


class _SlowDest:
    """A fill destination (the protocol of distckpt.fill.box_tasks) whose copies take 0.3 s: without
    ordering, a later request's copy would land first and then be overwritten by this one."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.dtype = t, t.dtype

    def is_contiguous(self) -> bool:
        return False

    def narrow(self, dim: int, start: int, length: int) -> "_SlowDest":
        return _SlowDest(self.t.narrow(dim, start, length))

    def copy_(self, src: torch.Tensor) -> None:
        import time
        time.sleep(0.3)
        self.t.copy_(src)


def test_a_request_after_another_is_copied_after_it(tmp_path):
    from distckpt.fill import fill_boxes_of
    from distckpt.restore import load_manifest
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    distckpt.save({"x": torch.full((64, 16), 1.0)}, a)
    distckpt.save({"y": torch.full((64, 16), 2.0)}, b)
    dest = torch.zeros(64, 16)
    # x is copied slowly; y overwrites x's rows 8..40 and must land after it, in the same pass.
    fill_boxes_of([(a, load_manifest(a), [("x", (0, 0), (64, 16), _SlowDest(dest))]),
                   (b, load_manifest(b), [("y", (8, 0), (32, 16), dest[8:40], "x")])])
    want = torch.full((64, 16), 1.0)
    want[8:40] = 2.0
    assert torch.equal(dest, want)


def test_checkpoints_with_other_checksum_blocks_are_read_in_one_pass(tmp_path, monkeypatch):
    """A base and rows of another checkpoint (a chain's delta) whose checksum blocks differ are read
    in one fill, each file verified with its own block, the ordered request still after the
    other; a flipped byte in either is found and named."""
    import distckpt.fill as fill_mod
    from distckpt.fill import fill_boxes_of
    from distckpt.restore import load_manifest
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    big = torch.rand(4096, 1024)                   # 16 MiB chunk: a large block
    distckpt.save({"x": big}, a)
    distckpt.save({"y": torch.full((20, 1024), 2.0)}, b)   # 80 KiB: the smallest block
    ma, mb = load_manifest(a), load_manifest(b)
    assert ma.checksum_block > mb.checksum_block
    calls = []
    real = fill_mod.fill
    monkeypatch.setattr(fill_mod, "fill", lambda *a_, **k: calls.append(k["block"]) or real(*a_, **k))

    def run():
        dest = torch.zeros(4096, 1024)
        fill_boxes_of([(a, ma, [("x", (0, 0), (4096, 1024), _SlowDest(dest))]),
                       (b, mb, [("y", (0, 0), (20, 1024), dest[100:120], "x")])])
        return dest
    want = big.clone()
    want[100:120] = 2.0
    assert torch.equal(run(), want)
    assert len(calls) == 1 and sorted(set(calls[0].values())) == sorted({ma.checksum_block, mb.checksum_block})
    for path, key, at in ((b, "y", 70_000), (a, "x", 9 * MiB + 5)):
        _flip(path, key, at)
        with pytest.raises(ChecksumMismatchError) as ei:
            run()
        assert ei.value.key == key and ei.value.path.startswith(path)
        _flip(path, key, at)


def test_side_reads_use_small_bounce_buffers(tmp_path, monkeypatch):
    """Fills inside fill.side_reads() (a chain's row ids, read on a thread beside the base) map
    SIDE_SLOTS slots of about SIDE_SEGMENT bytes, not the main pass's 24 MiB, and load exactly."""
    import mmap as mmap_mod

    import distckpt.fill as fill_mod
    from distckpt.fill import fill_boxes_of
    from distckpt.restore import load_manifest
    path = str(tmp_path / "ckpt")
    sd = _state()
    distckpt.save(sd, path)
    sizes = []
    real = mmap_mod.mmap

    class Recording(real):
        def __new__(cls, fileno, length, *a, **k):
            sizes.append(length)
            return real.__new__(cls, fileno, length, *a, **k)
    monkeypatch.setattr(fill_mod.mmap, "mmap", Recording)
    dest = {k: torch.full_like(v, SENTINEL) for k, v in sd.items()}
    reqs = [(k, (0,) * v.dim(), tuple(v.shape), dest[k]) for k, v in sd.items()]
    with fill_mod.side_reads():
        fill_boxes_of([(path, load_manifest(path), reqs)])
    assert all(torch.equal(dest[k], v) for k, v in sd.items())
    assert sizes and max(sizes) <= fill_mod.SIDE_SLOTS * (fill_mod.SIDE_SEGMENT + 2 * MiB), sizes
    sizes.clear()
    fill_boxes_of([(path, load_manifest(path), reqs)])    # outside: the main pass's slots
    assert max(sizes) >= fill_mod.PIPELINE_SLOTS * fill_mod.SEGMENT


def test_fills_inside_reading_share_threads_and_buffers(tmp_path, monkeypatch):
    import threading

    import distckpt.fill as fill_mod
    path = str(tmp_path / "ckpt")
    distckpt.save(_state(), path)
    made = []
    real = fill_mod._Buffer.__init__

    def counting(self, size):
        made.append(size)
        real(self, size)
    monkeypatch.setattr(fill_mod._Buffer, "__init__", counting)
    def strided():
        # Column-major destinations: strided copies, which the worker threads do (contiguous
        # ones go through the C pipeline's own slots).
        return {k: (torch.full(v.shape[::-1], SENTINEL).t() if v.dim() == 2 else torch.full_like(v, SENTINEL))
                for k, v in _state().items()}

    with fill_mod.reading():
        for _ in range(3):
            dst = strided()
            distckpt.load(dst, path)
            assert torch.equal(dst["a"], _state()["a"])
        assert len(made) <= fill_mod.WORKERS        # the second and third loads reused them
    assert not [t for t in threading.enumerate() if t.name.startswith("distckpt-read")]
    made.clear()
    distckpt.load(strided(), path)    # outside a block: its own, released at return
    assert 1 <= len(made) <= fill_mod.WORKERS
    assert not [t for t in threading.enumerate() if t.name.startswith("distckpt-read")]


def test_kept_readers_survive_a_change_of_slot_size(tmp_path):
    """reading(keep_open=True) (a conversion) keeps each file's reader and the pipeline's slots
    between fills; a fill whose slots have another size (side_reads: 2 x 1 MiB instead of
    6 x 4 MiB) remaps them, which closes the kept readers: the fill must reopen its reader, not
    read with a closed one. No fd stays open after the block."""
    from distckpt.fill import reading, side_reads
    from distckpt.restore import load_manifest, read_boxes

    path = str(tmp_path / "ck")
    state = _state()
    distckpt.save(state, path)
    m = load_manifest(path)
    before = open_fds()
    with reading(keep_open=True):
        a = read_boxes(path, m, [("a", (0, 0), (4096, 1024))])[0]
        with side_reads():
            b = read_boxes(path, m, [("b", (0,), (4096,))])[0]
        c = read_boxes(path, m, [("c", (0, 0), (2048, 1024))])[0]
        assert len(open_fds()) > len(before)  # the kept reader
    assert open_fds() == before
    assert torch.equal(a, state["a"]) and torch.equal(b, state["b"]) and torch.equal(c, state["c"])


@pytest.mark.parametrize("mode", ("auto", "direct", "cache"))
def test_a_load_leaves_what_fits_in_the_page_cache(tmp_path, monkeypatch, mode):
    """DISTCKPT_READ_CACHE: ``auto`` and ``cache`` read the uncached pages of a checkpoint that
    fits the page cache through it, so the next load (an evaluation job, a restart in place)
    reads memory, not the device; ``direct`` reads them with O_DIRECT and leaves nothing cached.
    Every mode restores the same bytes."""
    from distckpt import _uring
    from distckpt.config import get_config
    from distckpt.storage.posix import choose_backend
    monkeypatch.setenv("DISTCKPT_READ_CACHE", mode)
    get_config.cache_clear()
    path = str(tmp_path / "ckpt")
    src = _state(3)
    distckpt.save(src, path)
    if choose_backend(path).name == "buffered":
        pytest.skip("this file system refuses O_DIRECT: every read is buffered")
    files = [os.path.join(path, f["name"]) for f in distckpt.read_manifest(path)["files"]]
    fds = [os.open(f, os.O_RDONLY) for f in files]
    try:
        for fd in fds:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        dst = {k: torch.zeros_like(v) for k, v in src.items()}
        distckpt.load(dst, path)
        assert all(torch.equal(dst[k], src[k]) for k in src)
        cached = sum(_uring.cached_pages(fd, 0, os.fstat(fd).st_size)[0] for fd in fds)
        total = sum(_uring.cached_pages(fd, 0, os.fstat(fd).st_size)[1] for fd in fds)
        if mode == "direct":
            assert cached <= len(fds)  # at most a tail page a buffered read of the index touched
        else:
            assert cached == total
    finally:
        for fd in fds:
            os.close(fd)
        get_config.cache_clear()
