"""Box math and planning: unit tests plus hypothesis properties checked against real bytes."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distckpt.errors import ReshardError
from distckpt.plan import (
    ALIGNMENT,
    MIN_GROUP,
    Box,
    assign_offsets,
    assign_owners,
    byte_range,
    expand_to_blocks,
    find_tiling_defect,
    intersect,
    is_dense_layout,
    is_row_tiling,
    plan_reads,
)

PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ------------------------------------------------------------------------------------------
# Strategies.

shapes = st.lists(st.integers(1, 7), min_size=1, max_size=4).map(tuple)


@st.composite
def grid_partition(draw, shape):
    """Chunks of a random grid split of ``shape`` (what DTensor / row- or column-wise sharding make)."""
    ranges = []
    for n in shape:
        cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []
        edges = [0, *cuts, n]
        ranges.append(list(zip(edges, edges[1:])))
    boxes = [Box((), ())]
    for rng in ranges:
        boxes = [Box(b.offsets + (lo,), b.sizes + (hi - lo,)) for b in boxes for lo, hi in rng]
    return boxes


@st.composite
def kd_partition(draw, shape):
    """A random recursive bisection: tilings that are not grids (staggered cuts)."""
    boxes = [Box.full(shape)]
    for _ in range(draw(st.integers(0, 8))):
        i = draw(st.integers(0, len(boxes) - 1))
        b = boxes[i]
        dims = [d for d in range(b.ndim) if b.sizes[d] > 1]
        if not dims:
            continue
        d = draw(st.sampled_from(dims))
        cut = draw(st.integers(1, b.sizes[d] - 1))
        lo = Box(b.offsets, b.sizes[:d] + (cut,) + b.sizes[d + 1 :])
        hi = Box(b.offsets[:d] + (b.offsets[d] + cut,) + b.offsets[d + 1 :], b.sizes[:d] + (b.sizes[d] - cut,) + b.sizes[d + 1 :])
        boxes[i : i + 1] = [lo, hi]
    return boxes


@st.composite
def sub_box(draw, shape, *, allow_empty=False):
    offsets, sizes = [], []
    for n in shape:
        lo = draw(st.integers(0, n - 1))
        size = draw(st.integers(0 if allow_empty else 1, n - lo))
        offsets.append(lo)
        sizes.append(size)
    return Box(tuple(offsets), tuple(sizes))


@st.composite
def layouts(draw):
    shape = draw(shapes)
    chunks = draw(st.one_of(grid_partition(shape), kd_partition(shape)))
    draw(st.randoms()).shuffle(chunks)
    want = draw(sub_box(shape))
    dtype = draw(st.sampled_from([np.int8, np.int16, np.int32, np.float64, np.complex128]))
    return shape, chunks, want, np.dtype(dtype)


def _sl(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))


# ------------------------------------------------------------------------------------------
# Box.


def test_box_basics():
    b = Box((1, 2), (3, 4))
    assert b.volume == 12 and b.ndim == 2 and b.ends == (4, 6)
    assert str(b) == "[1:4, 2:6]"
    assert Box((), ()).volume == 1
    assert Box((0, 0), (0, 5)).volume == 0
    assert b.contains(Box((2, 3), (1, 1))) and not b.contains(Box((0, 2), (2, 2)))
    assert not b.contains(Box((1,), (1,)))
    assert intersect(b, Box((3, 0), (5, 3))) == Box((3, 2), (1, 1))
    assert intersect(b, Box((4, 2), (1, 1))) is None  # touching is not intersecting
    assert Box([1], [2]) == Box((1,), (2,)) and hash(Box([1], [2])) == hash(Box((1,), (2,)))
    assert Box((2, 3), (1, 1)).relative_to(b) == Box((1, 1), (1, 1))
    for bad in [((0,), (1, 1)), ((-1,), (1,)), ((0,), (True,)), ((0.5,), (1,))]:
        with pytest.raises(ValueError):
            Box(*bad)
    with pytest.raises(ValueError):
        intersect(Box((0,), (1,)), Box((0, 0), (1, 1)))
    with pytest.raises(ValueError):
        Box((0,), (5,)).relative_to(Box((1,), (2,)))


# ------------------------------------------------------------------------------------------
# Tiling check.


@PROPS
@given(st.data())
def test_partitions_tile_exactly(data):
    shape = data.draw(shapes)
    chunks = data.draw(st.one_of(grid_partition(shape), kd_partition(shape)))
    assert find_tiling_defect(chunks, Box.full(shape)) is None
    assert sum(c.volume for c in chunks) == Box.full(shape).volume


@PROPS
@given(st.data())
def test_tiling_defects_are_real(data):
    shape = data.draw(shapes)
    chunks = data.draw(kd_partition(shape))
    region = Box.full(shape)
    if data.draw(st.booleans()) and len(chunks) > 1:
        dropped = chunks.pop(data.draw(st.integers(0, len(chunks) - 1)))
        defect = find_tiling_defect(chunks, region)
        assert defect is not None and defect.kind == "uncovered"
        assert defect.region.volume > 0 and dropped.contains(defect.region)
        assert all(intersect(c, defect.region) is None for c in chunks)
    else:
        extra = data.draw(sub_box(shape))
        chunks.append(extra)
        defect = find_tiling_defect(chunks, region)
        assert defect is not None and defect.kind == "overlap"
        i, j = defect.indices
        assert i != j and chunks[i].contains(defect.region) and chunks[j].contains(defect.region)


@PROPS
@given(st.data())
def test_row_tiling_fast_path_never_accepts_a_defect(data):
    """is_row_tiling may only say True where the full check finds no defect; on row slabs it
    must say True (that is the case it exists for)."""
    shape = data.draw(shapes)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, shape[0] - 1)), max_size=4)))) if shape[0] > 1 else []
    bounds = [0, *[c for c in cuts if c < shape[0]], shape[0]]
    rows = [((a,) + (0,) * (len(shape) - 1), (b - a,) + shape[1:]) for a, b in zip(bounds, bounds[1:])]
    assert is_row_tiling(rows, shape)
    pieces = data.draw(st.one_of(st.just(rows), kd_partition(shape).map(lambda cs: [(c.offsets, c.sizes) for c in cs])))
    if data.draw(st.booleans()) and len(pieces) > 1:  # a defect: one piece dropped, or one added
        pieces = pieces[:-1] if data.draw(st.booleans()) else pieces + [pieces[0]]
    if is_row_tiling(pieces, shape):
        assert find_tiling_defect([Box(o, s) for o, s in pieces], Box.full(shape)) is None


def test_tiling_zero_dim_and_empty():
    assert find_tiling_defect([Box((), ())], Box((), ())) is None
    assert find_tiling_defect([], Box((), ())).kind == "uncovered"
    assert find_tiling_defect([Box((), ()), Box((), ())], Box((), ())).indices == (0, 1)
    assert find_tiling_defect([], Box((0, 0), (0, 3))) is None
    assert find_tiling_defect([Box((0,), (4,)), Box((2,), (0,))], Box((0,), (4,))) is None
    with pytest.raises(ValueError, match="not inside"):
        find_tiling_defect([Box((0,), (5,))], Box((0,), (4,)))


def test_tiling_of_a_large_shuffled_grid():
    rows, cols = 100, 100
    boxes = [Box((r * 3, c * 2), (3, 2)) for r in range(rows) for c in range(cols)]
    random.Random(0).shuffle(boxes)
    assert find_tiling_defect(boxes, Box.full((rows * 3, cols * 2))) is None


# ------------------------------------------------------------------------------------------
# plan_reads against real bytes.


def _chunk_bytes(glob: np.ndarray, chunk: Box) -> bytes:
    return np.ascontiguousarray(glob[_sl(chunk)]).tobytes()


@PROPS
@given(layouts())
def test_plan_reads_reconstructs_want_from_byte_ranges(layout):
    shape, chunks, want, dtype = layout
    glob = (np.arange(int(np.prod(shape))) % 251 + 1).astype(dtype).reshape(shape)
    stored = {i: _chunk_bytes(glob, c) for i, c in enumerate(chunks)}
    pieces = plan_reads([(c, i) for i, c in enumerate(chunks)], want, itemsize=dtype.itemsize)

    dest = np.zeros(want.sizes, dtype=dtype)
    hits = np.zeros(want.sizes, dtype=np.int64)
    for p in pieces:
        chunk = chunks[p.payload]
        assert p.chunk == chunk and chunk.contains(p.box) and want.contains(p.box)
        assert p.in_chunk == p.box.relative_to(chunk) and p.in_want == p.box.relative_to(want)
        start, end = p.byte_range
        assert start % dtype.itemsize == 0 and end % dtype.itemsize == 0
        # Only these bytes are "read"; every element of the piece must be inside them.
        window = np.frombuffer(stored[p.payload][start:end], dtype=dtype)
        coords = np.indices(p.in_chunk.sizes).reshape(len(shape), -1) + np.array(p.in_chunk.offsets)[:, None]
        flat = np.ravel_multi_index(tuple(coords), chunk.sizes) - start // dtype.itemsize
        assert flat.min() == 0 and flat.max() == len(window) - 1  # smallest covering range
        values = window[flat].reshape(p.box.sizes)
        if p.contiguous:
            assert end - start == p.box.volume * dtype.itemsize
            assert np.array_equal(window.reshape(p.box.sizes), values)
        dest[_sl(p.in_want)] = values
        hits[_sl(p.in_want)] += 1
    assert (hits == 1).all()  # exact tiling: no gap, no overlap
    assert np.array_equal(dest, glob[_sl(want)])


@PROPS
@given(layouts(), st.data())
def test_plan_reads_names_uncovered_region(layout, data):
    shape, chunks, want, dtype = layout
    hit = [i for i, c in enumerate(chunks) if intersect(c, want) is not None]
    dropped = chunks[data.draw(st.sampled_from(hit))]
    rest = [c for c in chunks if c is not dropped]
    with pytest.raises(ReshardError) as ei:
        plan_reads([(c, None) for c in rest], want, itemsize=dtype.itemsize)
    region = ei.value.region
    assert want.contains(region) and dropped.contains(region)
    assert all(intersect(c, region) is None for c in rest)
    assert str(region) in str(ei.value)


@PROPS
@given(layouts())
def test_plan_reads_rejects_duplicate_chunks(layout):
    shape, chunks, want, dtype = layout
    dup = next(c for c in chunks if intersect(c, want) is not None)
    with pytest.raises(ReshardError, match="both hold"):
        plan_reads([(c, None) for c in chunks + [dup]], want, itemsize=dtype.itemsize)


def test_plan_reads_examples():
    rows = [(Box((0, 0), (2, 4)), "a"), (Box((2, 0), (2, 4)), "b")]
    pieces = plan_reads(rows, Box((1, 1), (2, 2)), itemsize=4)
    assert [(p.payload, p.box, p.in_want, p.byte_range, p.contiguous) for p in pieces] == [
        ("a", Box((1, 1), (1, 2)), Box((0, 0), (1, 2)), (20, 28), True),
        ("b", Box((2, 1), (1, 2)), Box((1, 0), (1, 2)), (4, 12), True),
    ]
    assert plan_reads(rows, Box((0, 0), (0, 4)), itemsize=4) == []
    (p,) = plan_reads([(Box((), ()), 7)], Box((), ()), itemsize=8)
    assert p.byte_range == (0, 8) and p.contiguous
    with pytest.raises(ReshardError, match=r"no saved chunk holds region \[4:5, 0:4\]"):
        plan_reads(rows, Box((3, 0), (2, 4)), itemsize=4)


# ------------------------------------------------------------------------------------------
# byte_range and expand_to_blocks.


def test_byte_range_examples():
    chunk = Box((10, 0, 0), (4, 5, 6))
    # Spans the trailing dims: exact.
    assert byte_range(chunk, Box((11, 0, 0), (2, 5, 6)), 2) == (60 * 1, 60 * 3)
    # A column: from its first to its last element.
    assert byte_range(chunk, Box((10, 0, 3), (4, 5, 1)), 1) == (3, 3 * 30 + 4 * 6 + 3 + 1)
    assert byte_range(chunk, chunk, 4) == (0, 120 * 4)
    with pytest.raises(ValueError, match="not inside"):
        byte_range(chunk, Box((0, 0, 0), (1, 1, 1)), 1)
    with pytest.raises(ValueError, match="empty"):
        byte_range(chunk, Box((10, 0, 0), (0, 1, 1)), 1)


def test_is_dense_layout_examples():
    assert is_dense_layout((4, 5), (5, 1)) and is_dense_layout((4, 5), (1, 4))       # row-major, transposed
    assert is_dense_layout((8, 3, 3, 3), (27, 1, 9, 3))                                # channels_last
    assert is_dense_layout((1, 5), (99, 1)) and is_dense_layout((), ())                # size 1; a scalar
    assert not is_dense_layout((4, 5), (1, 5))                                         # gaps
    assert not is_dense_layout((4, 5), (1, 1)) and not is_dense_layout((4, 5), (0, 1))  # overlapping
    assert not is_dense_layout((4, 5), (5,)) and not is_dense_layout((4, 5), (5, -1))


@st.composite
def strided_chunk(draw):
    """(chunk box, dense strides of a random permutation of its dims, a box inside it, a limit)."""
    sizes = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)))
    offsets = tuple(draw(st.integers(0, 3)) for _ in sizes)
    perm = draw(st.permutations(range(len(sizes))))      # perm[0]: the outermost dimension
    strides, acc = [0] * len(sizes), 1
    for d in reversed(perm):
        strides[d] = acc
        acc *= sizes[d]
    lo = [draw(st.integers(0, n - 1)) for n in sizes]
    sub = Box(tuple(o + a for o, a in zip(offsets, lo)), tuple(draw(st.integers(1, n - a)) for n, a in zip(sizes, lo)))
    return Box(offsets, sizes), tuple(strides), sub, draw(st.integers(1, 64))


@given(strided_chunk(), st.sampled_from([1, 2, 4]))
@PROPS
def test_strided_chunks_sub_boxes_and_byte_ranges_hold_exactly_their_values(case, itemsize):
    """What a load does with a chunk stored in another dense layout (fill._split_box, byte_range,
    then an as_strided view of the bytes read): every sub-box's byte range fits the limit (or is
    one element), the sub-boxes tile the box, and the view over those bytes is the box's values."""
    import torch

    from distckpt.fill import _split_box

    chunk, strides, sub, limit = case
    assert is_dense_layout(chunk.sizes, strides)
    n = chunk.volume
    values = torch.arange(n, dtype=torch.int64).reshape(chunk.sizes)         # the chunk, logically
    stored = torch.empty_strided(chunk.sizes, strides, dtype=torch.int64)
    stored.copy_(values)
    flat = torch.empty(n, dtype=torch.int64).as_strided((n,), (1,), 0)
    flat.copy_(torch.as_strided(stored, (n,), (1,)))                           # its bytes, in file order
    seen = torch.zeros(chunk.sizes, dtype=torch.int64)
    for box in _split_box(chunk, sub, itemsize, limit * itemsize, strides):
        assert sub.contains(box) and box.volume > 0
        s, e = byte_range(chunk, box, itemsize, strides)
        assert e - s <= max(limit * itemsize, itemsize) or box.volume == 1
        assert s % itemsize == 0 and e % itemsize == 0
        got = flat[s // itemsize:e // itemsize]
        got = got.as_strided(box.sizes, strides, got.storage_offset())
        rel = tuple(slice(o - c, o - c + z) for o, c, z in zip(box.offsets, chunk.offsets, box.sizes))
        assert torch.equal(got, values[rel])
        seen[rel] += 1
    want = torch.zeros(chunk.sizes, dtype=torch.int64)
    want[tuple(slice(o - c, o - c + z) for o, c, z in zip(sub.offsets, chunk.offsets, sub.sizes))] = 1
    assert torch.equal(seen, want)   # a tiling of the box: every element once, nothing outside


def test_a_strided_chunk_is_copied_flat_only_into_the_same_box_laid_out_the_same_way():
    """fill's choice between a flat copy (bytes in the same order: the C pipeline's memcpy) and a
    strided one: flat only where the destination's memory is the chunk's bytes in their order."""
    import torch

    from distckpt.fill import Task, _flat_dest
    from distckpt.manifest import ChunkRecord

    def decide(chunk_strides, dest, offsets=(0, 0, 0, 0), inter=None):
        sizes = (4, 3, 2, 5)
        chunk = ChunkRecord(offsets, sizes, 0, 0, 4 * 120, (), chunk_strides)
        box = Box(offsets, sizes)
        return _flat_dest(Task("x", chunk, inter or box, dest, box, 4, torch.float32))

    nhwc = (30, 1, 15, 3)
    cl = torch.zeros(4, 3, 2, 5).to(memory_format=torch.channels_last)
    assert cl.stride() == nhwc
    flat, off = decide(nhwc, cl)
    assert off == 0 and flat.dim() == 1 and flat.data_ptr() == cl.data_ptr() and flat.numel() == 120
    assert decide(nhwc, torch.zeros(4, 3, 2, 5)) is None                     # row-major destination
    assert decide(None, cl) is None                                          # row-major chunk
    assert decide(nhwc, cl.double()) is None                                 # a cast
    assert decide(nhwc, cl, inter=Box((0, 0, 0, 0), (2, 3, 2, 5))) is None   # part of the chunk
    assert decide(nhwc, torch.zeros(4, 3, 2, 5).permute(0, 1, 3, 2).contiguous().permute(0, 1, 3, 2)) is None
    conj = torch.zeros(4, 3, 2, 5, dtype=torch.complex64).to(memory_format=torch.channels_last).conj()
    assert _flat_dest(Task("x", ChunkRecord((0,) * 4, (4, 3, 2, 5), 0, 0, 960, (), nhwc), Box((0,) * 4, (4, 3, 2, 5)),
                           conj, Box((0,) * 4, (4, 3, 2, 5)), 8, torch.complex64)) is None
    # A size-1 dimension's stride does not matter: the bytes are in the same order.
    one = torch.zeros(1, 6).t()   # (6, 1) with strides (1, 6)
    chunk = ChunkRecord((0, 0), (6, 1), 0, 0, 24, (), (1, 1))
    assert _flat_dest(Task("y", chunk, Box((0, 0), (6, 1)), one, Box((0, 0), (6, 1)), 4, torch.float32)) is not None


@given(st.integers(0, 10_000), st.integers(0, 10_000), st.sampled_from([1, 7, 16, 4096]), st.integers(0, 5000))
@settings(max_examples=300, deadline=None)
def test_expand_to_blocks(a, b, block, extra):
    start, end = min(a, b), max(a, b)
    limit = end + extra
    s, e = expand_to_blocks(start, end, block, limit)
    if start == end:
        assert (s, e) == (start, end)
        return
    assert s <= start and end <= e <= limit
    assert s % block == 0 and (e % block == 0 or e == limit)
    assert start - s < block and (e - end < block)  # no whole block more than needed


def test_expand_to_blocks_rejects_bad_input():
    with pytest.raises(ValueError):
        expand_to_blocks(5, 4, 16, 100)
    with pytest.raises(ValueError):
        expand_to_blocks(0, 101, 16, 100)
    with pytest.raises(ValueError):
        expand_to_blocks(0, 1, 0, 100)


# ------------------------------------------------------------------------------------------
# Write planning.

keys = st.text(alphabet="abcdefgh.", min_size=1, max_size=6)


@PROPS
@given(st.integers(1, 8), st.dictionaries(keys, st.sampled_from([0, 1, 1000, 100 << 10, 300 << 10, 2 << 20]),
                                          min_size=1, max_size=40), st.randoms())
def test_assign_owners_all_replicated_is_balanced_and_deterministic(world, sizes, rnd):
    cands = {k: [(r, n) for r in range(world)] for k, n in sizes.items()}
    owners = assign_owners(cands)
    assert set(owners) == set(sizes) and all(0 <= r < world for r in owners.values())
    load = [0] * world
    for k, r in owners.items():
        load[r] += sizes[k]
    # LPT over the large items and the groups of small ones: off by at most the largest of them.
    group = max(MIN_GROUP, sum(sizes.values()) // world // 8)
    small = sum(n for n in sizes.values() if n < group)
    assert max(load) <= min(load) + max(max(sizes.values()), min(small, group)), (load, sizes)
    # Small items share few writers, one per group at most: a group closed by the next item and
    # that next group hold more than G bytes together, so there are fewer than 2 small / G + 2.
    writers = {owners[k] for k, n in sizes.items() if n < group}
    assert len(writers) < 2 * small / group + 2, (writers, small, group)
    # Same content, different dict and candidate order: same answer on every rank.
    items = list(cands.items())
    rnd.shuffle(items)
    shuffled = {k: rnd.sample(v, len(v)) for k, v in items}
    assert assign_owners(shuffled) == owners


@PROPS
@given(st.integers(1, 6), st.data())
def test_assign_owners_mixed(world, data):
    cands = {}
    for i in range(data.draw(st.integers(1, 30))):
        ranks = data.draw(st.sets(st.integers(0, world - 1), min_size=1, max_size=world))
        n = data.draw(st.integers(0, 500))
        cands[("k", i)] = [(r, n) for r in sorted(ranks)]
    owners = assign_owners(cands)
    for k, r in owners.items():
        assert r in {c for c, _ in cands[k]}
        if len(cands[k]) == 1:
            assert r == cands[k][0][0]


def test_assign_owners_examples():
    # Fixed shards count toward the load: rank 1 already holds 100 bytes, so both replicas go to 0
    # until it catches up; ties go to the lower rank.
    M = 1 << 20
    cands = {"s1": [(1, 100 * M)], "r1": [(0, 60 * M), (1, 60 * M)], "r2": [(0, 30 * M), (1, 30 * M)],
             "r3": [(0, 10 * M), (1, 10 * M)]}
    assert assign_owners(cands) == {"s1": 1, "r1": 0, "r2": 0, "r3": 0}
    assert assign_owners({"a": [(0, 5 * M), (1, 5 * M)], "b": [(0, 5 * M), (1, 5 * M)]}) == {"a": 0, "b": 1}
    # Small replicated items go together (one file for a load to read), not one per rank ...
    assert assign_owners({"a": [(0, 5), (1, 5)], "b": [(0, 5), (1, 5)]}) == {"a": 0, "b": 0}
    # ... in groups of at most G = max(MIN_GROUP, mean write / 8) bytes: 40 x 4 KiB over 4 ranks
    # make one group; 6 x 200 KiB (G = 256 KiB) six, spread over the 4 ranks.
    many = {f"n{i:02d}": [(r, 4 << 10) for r in range(4)] for i in range(40)}
    assert set(assign_owners(many).values()) == {0}
    six = {f"m{i}": [(r, 200 << 10) for r in range(4)] for i in range(6)}
    assert len(set(assign_owners(six).values())) == 4
    # Bytes written besides the items (a plan's grids) make the groups larger: one writer here.
    assert len(set(assign_owners(six, other_bytes=4 << 30, world=4).values())) == 1
    with pytest.raises(ValueError, match="no candidate"):
        assign_owners({"a": []})
    with pytest.raises(ValueError):
        assign_owners({"a": [(-1, 5)]})


@given(st.lists(st.integers(0, 20_000), max_size=30), st.sampled_from([1, 512, ALIGNMENT]))
@settings(max_examples=100, deadline=None)
def test_assign_offsets(sizes, alignment):
    offsets, end = assign_offsets(sizes, alignment=alignment)
    assert len(offsets) == len(sizes) and end % alignment == 0
    pos = 0
    for off, n in zip(offsets, sizes):
        assert off % alignment == 0 and off >= pos
        assert off - pos < alignment  # no gap larger than the padding
        pos = off + n
    assert pos <= end < pos + alignment or (pos == end == 0)
    with pytest.raises(ValueError):
        assign_offsets([1], alignment=3)
