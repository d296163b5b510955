"""Pure box math and write/read planning, shared by save, restore and the manifest validator.

Everything here is plain Python on integers: no torch, no torch.distributed, no I/O. That keeps the
math testable with property tests and lets every rank compute the same plan from the same inputs.

Coordinates: a :class:`Box` is a half-open hyper-rectangle ``[offsets[d], offsets[d] + sizes[d])``
in *global element* coordinates of one tensor. A saved *chunk* is a box whose elements are stored
C-contiguous (row-major) in a data file; byte positions inside a chunk are therefore
``flat_index * itemsize`` with the chunk's own row-major strides. (A chunk of another format's
checkpoint may be stored in another dense layout, a permutation of row-major: the functions that
take ``strides`` handle it, see :func:`is_dense_layout`.)

Invariants:
  * Boxes are immutable values (hashable, comparable); ``offsets`` and ``sizes`` are tuples of
    non-negative ints of equal length. A zero-dimensional box (``()``, ``()``) has volume 1: it is
    the single element of a scalar tensor.
  * :func:`intersect` returns ``None`` rather than an empty box, so a returned box always holds at
    least one element.
  * :func:`plan_reads` returns pieces that exactly tile the wanted box (pairwise disjoint, union
    equal to it) or raises :class:`~distckpt.errors.ReshardError`; it never returns a partial plan.
  * :func:`assign_owners` is a pure function of its input's *content* (not of dict order), so every
    rank computes the same owners from the same gathered candidates.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Hashable, Iterable, Mapping, Sequence, TypeVar

from .errors import ReshardError

__all__ = [
    "ALIGNMENT",
    "Box",
    "intersect",
    "TilingDefect",
    "find_tiling_defect",
    "is_row_tiling",
    "assign_owners",
    "assign_offsets",
    "byte_range",
    "row_major_strides",
    "is_dense_layout",
    "outermost_dim",
    "ReadPiece",
    "plan_reads",
    "expand_to_blocks",
    "grid_part",
    "grid_box",
    "grid_chunk_counts",
    "choose_checksum_block",
    "choose_checksum_block_counted",
]

#: Byte alignment of every chunk inside a data file: O_DIRECT needs offsets (and lengths) that are
#: multiples of the logical block size, and 4096 covers every common device and file system.
ALIGNMENT = 4096

K = TypeVar("K", bound=Hashable)


@dataclasses.dataclass(frozen=True, slots=True)
class Box:
    """A half-open hyper-rectangle of tensor elements: ``[offsets[d], offsets[d] + sizes[d])``.

    Attributes:
        offsets: Start index along each dimension (global element coordinates).
        sizes: Extent along each dimension (may be 0: an empty box).

    Raises:
        ValueError: (at construction) lengths differ, or an entry is negative or not an int.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        offsets, sizes = self.offsets, self.sizes
        # Fast path (the planner builds tens of thousands of boxes from plain ints): nothing to
        # normalise. Anything else takes the checking path below.
        if (type(offsets) is tuple and type(sizes) is tuple and len(offsets) == len(sizes)
                and all(type(v) is int and v >= 0 for v in offsets)
                and all(type(v) is int and v >= 0 for v in sizes)):
            return
        try:
            # operator.index accepts numpy and torch integer scalars and refuses floats; the
            # stored values are plain ints so boxes hash and compare the same on every rank.
            offsets = tuple(operator.index(v) for v in self.offsets)
            sizes = tuple(operator.index(v) for v in self.sizes)
        except TypeError:
            raise ValueError(f"Box offsets {self.offsets!r} / sizes {self.sizes!r} must be integers") from None
        if len(offsets) != len(sizes):
            raise ValueError(f"Box offsets {offsets} and sizes {sizes} have different lengths")
        # bool is an int subclass; a True offset is a bug upstream, not a 1.
        if any(v < 0 for v in offsets + sizes) or any(isinstance(v, bool) for v in (*self.offsets, *self.sizes)):
            raise ValueError(f"Box offsets {offsets} / sizes {sizes} must be non-negative ints")
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "sizes", sizes)

    @classmethod
    def full(cls, shape: Sequence[int]) -> "Box":
        """The box covering a whole tensor of ``shape``."""
        return cls((0,) * len(shape), tuple(shape))

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        """Exclusive end index along each dimension."""
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    @property
    def volume(self) -> int:
        """Number of elements (1 for a zero-dimensional box)."""
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def contains(self, other: "Box") -> bool:
        """True if every element of ``other`` lies in this box (an empty ``other`` needs only its
        bounds inside). Boxes of different rank never contain each other."""
        if self.ndim != other.ndim:
            return False
        return all(
            so <= oo and oo + os_ <= so + ss
            for so, ss, oo, os_ in zip(self.offsets, self.sizes, other.offsets, other.sizes)
        )

    def relative_to(self, origin: "Box") -> "Box":
        """This box in coordinates whose origin is ``origin``'s first element.

        Raises:
            ValueError: ``origin`` does not contain this box.
        """
        if not origin.contains(self):
            raise ValueError(f"box {self} is not inside {origin}")
        return Box(tuple(a - b for a, b in zip(self.offsets, origin.offsets)), self.sizes)

    def __str__(self) -> str:
        # Slice notation reads naturally in error messages: [0:4, 8:16].
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes)) + "]"


def intersect(a: Box, b: Box) -> Box | None:
    """The common elements of ``a`` and ``b``, or None when they share none.

    Raises:
        ValueError: the boxes have different ranks.
    """
    if a.ndim != b.ndim:
        raise ValueError(f"cannot intersect boxes of rank {a.ndim} and {b.ndim}: {a} and {b}")
    offsets, sizes = [], []
    for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        lo, hi = max(ao, bo), min(ao + as_, bo + bs)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return Box(tuple(offsets), tuple(sizes))


# --------------------------------------------------------------------------------------------
# Exact tiling check (used by the manifest validator and by plan_reads).


@dataclasses.dataclass(frozen=True, slots=True)
class TilingDefect:
    """Why a set of boxes does not exactly tile a region.

    Attributes:
        kind: ``"overlap"`` (two boxes share elements) or ``"uncovered"`` (no box holds them).
        region: Elements where the defect is, in the region's coordinates. For an overlap it is a
            non-empty part of the two boxes' intersection; for a gap, a box no input box touches.
        indices: The indices (into the input sequence) of the two overlapping boxes; ``()`` for a gap.
    """

    kind: str
    region: Box
    indices: tuple[int, ...]


def find_tiling_defect(boxes: Sequence[Box], region: Box) -> TilingDefect | None:
    """Check that ``boxes`` exactly tile ``region``: pairwise disjoint and their union is ``region``.

    Empty boxes (volume 0) hold no elements and are ignored. The check sweeps dimension 0 into
    slabs between consecutive box boundaries and recurses on the boxes active in each slab, so a
    grid-like layout (DTensor meshes, row/column-wise shards, uneven splits) costs about
    O(n log n) for n boxes; only pathological staircase layouts approach O(n^2).

    Returns:
        None when the tiling is exact, else the first :class:`TilingDefect` found.

    Raises:
        ValueError: a box has a different rank than ``region`` or lies outside it.
    """
    nd = region.ndim
    live: list[int] = []
    for i, b in enumerate(boxes):
        if not region.contains(b):
            raise ValueError(f"box {i} {b} is not inside the region {region}")
        if b.volume:
            live.append(i)
    if region.volume == 0:
        return None  # every box inside an empty region is empty too
    if nd == 0:
        # A scalar: exactly one box must hold its single element.
        if not live:
            return TilingDefect("uncovered", region, ())
        if len(live) > 1:
            return TilingDefect("overlap", region, (live[0], live[1]))
        return None
    return _tile(boxes, live, region, 0, ())


def is_row_tiling(pieces: Sequence[tuple[Sequence[int], Sequence[int]]], shape: Sequence[int]) -> bool:
    """True when ``pieces`` ((offsets, sizes) pairs) provably tile ``shape`` exactly because they
    are row slabs: every piece spans the whole extent of every dimension after the first, and the
    pieces' ranges on dimension 0 are non-empty, disjoint and cover ``[0, shape[0])``. The layout
    FSDP, row-wise TorchRec tables and most ZeRO partitions produce, checked in O(n log n) on plain
    tuples (no :class:`Box` objects), which is what keeps a many-rank merge cheap.

    False means "not proven", not "defective": the caller then runs :func:`find_tiling_defect`,
    which names the defect (or finds none: a grid, a column split, empty pieces...)."""
    nd = len(shape)
    if nd == 0 or not pieces:
        return False
    rest = tuple(shape[1:])
    spans = []
    for offsets, sizes in pieces:
        if len(offsets) != nd or len(sizes) != nd or tuple(sizes[1:]) != rest or any(offsets[1:]):
            return False
        if sizes[0] <= 0:
            return False
        spans.append((offsets[0], sizes[0]))
    spans.sort()
    pos = 0
    for start, size in spans:
        if start != pos:
            return False
        pos += size
    return pos == shape[0] and all(isinstance(v, int) and v >= 0 for v in rest)


def _tile(
    boxes: Sequence[Box], idxs: list[int], region: Box, dim: int, prefix: tuple[tuple[int, int], ...]
) -> TilingDefect | None:
    """Tile check of ``region`` restricted to the slab ``prefix`` (fixed ranges of dims < dim)."""
    lo = region.offsets[dim]
    hi = lo + region.sizes[dim]
    nd = region.ndim

    def slab_box(rng: tuple[int, int]) -> Box:
        # The defect region: the current slab, the given range on `dim`, the full region after it.
        spans = prefix + (rng,) + tuple(
            (region.offsets[d], region.offsets[d] + region.sizes[d]) for d in range(dim + 1, nd)
        )
        return Box(tuple(a for a, _ in spans), tuple(b - a for a, b in spans))

    if dim == nd - 1:
        ivs = sorted((boxes[i].offsets[dim], boxes[i].offsets[dim] + boxes[i].sizes[dim], i) for i in idxs)
        pos, owner = lo, -1
        for s, e, i in ivs:
            if s < pos:
                return TilingDefect("overlap", slab_box((s, min(e, pos))), (owner, i))
            if s > pos:
                return TilingDefect("uncovered", slab_box((pos, s)), ())
            pos, owner = e, i
        if pos < hi:
            return TilingDefect("uncovered", slab_box((pos, hi)), ())
        return None

    starts: dict[int, list[int]] = {}
    ends: dict[int, list[int]] = {}
    for i in idxs:
        o, s = boxes[i].offsets[dim], boxes[i].sizes[dim]
        starts.setdefault(o, []).append(i)
        ends.setdefault(o + s, []).append(i)
    bounds = sorted(set(starts) | set(ends) | {lo, hi})
    active: dict[int, None] = {}  # insertion-ordered set: deterministic defect reports
    for a, b in zip(bounds, bounds[1:]):
        for i in ends.get(a, ()):
            active.pop(i, None)
        for i in starts.get(a, ()):
            active[i] = None
        if not active:
            return TilingDefect("uncovered", slab_box((a, b)), ())
        defect = _tile(boxes, list(active), region, dim + 1, prefix + ((a, b),))
        if defect is not None:
            return defect
    return None


# --------------------------------------------------------------------------------------------
# Write planning.


def _stable_order_key(key: Hashable) -> str:
    # Dict order can differ between ranks; repr of str/int/tuple keys cannot.
    return repr(key)


#: The least bytes a group of small replicated items may hold (see :func:`assign_owners`).
MIN_GROUP = 256 << 10


def assign_owners(candidates: Mapping[K, Sequence[tuple[int, int]]], *, other_bytes: int = 0,
                  world: int | None = None) -> dict[K, int]:
    """Pick exactly one writing rank per item so that bytes written per rank are balanced, and
    small replicated items land in few files.

    Items with one candidate (a rank's own shard) are fixed and count toward that rank's load
    first. Items with several candidates (replicated tensors, DTensor ``Replicate``) smaller than
    the group size G are first put in groups: those with the same candidate ranks, in
    ``repr(key)`` order, cut into groups of at most G bytes; G is an eighth of the mean bytes a
    rank writes (these items, plus ``other_bytes`` written besides them over ``world`` ranks:
    a plan's even grids), but at least MIN_GROUP. A group is placed as one item. Then every item
    with several candidates (groups included) is placed greedily, largest first, on the candidate
    with the least load so far; ties go to the lower rank. Items of equal size are taken in
    ``repr(key)`` order, so the result depends only on the content of ``candidates``: every rank
    computes the same answer from the same gathered input. For items replicated on every rank this
    is LPT scheduling: the largest load exceeds the smallest by at most the largest item or group.

    Why groups: a load reads the index of every data file holding a box it wants (format 4), and
    every rank wants each replicated tensor whole. Spread one by one, a model's many small
    replicated tensors (norms, biases, TorchRec's dense layers beside its sharded tables) land in
    up to every file, and every rank of a load then reads up to every index; grouped, a few. The
    cost is balance, bounded by G: an eighth of a rank's mean write (or 256 KiB).

    Args:
        candidates: ``{key: [(rank, nbytes), ...]}``; keys should have a deterministic ``repr``
            (str, int or tuples of them). A rank listed twice for one key counts once.
        other_bytes, world: bytes the ranks write besides these items, and how many ranks write
            (default: the ranks named in ``candidates``); only G depends on them.

    Returns:
        ``{key: owner_rank}`` with every key of ``candidates``.

    Raises:
        ValueError: a key has no candidate, or a rank or byte count is negative or not an int.
    """
    load: dict[int, int] = {}
    multi: list[tuple[int, str, Any, list[tuple[int, int]]]] = []
    owners: dict[K, int] = {}
    total = 0
    for key, cands in candidates.items():
        cands = list(cands)
        if not cands:
            raise ValueError(f"item {key!r} has no candidate rank")
        for rank, nbytes in cands:
            if type(rank) is not int or rank < 0 or type(nbytes) is not int or nbytes < 0:
                raise ValueError(f"item {key!r}: candidate ({rank!r}, {nbytes!r}) must be (rank >= 0, nbytes >= 0) ints")
            load.setdefault(rank, 0)
        if len({r for r, _ in cands}) == 1:
            owners[key] = cands[0][0]
            load[cands[0][0]] += cands[0][1]
            total += cands[0][1]
        else:
            size = max(n for _, n in cands)
            multi.append((-size, _stable_order_key(key), key, sorted(set(cands))))
            total += size
    group = max(MIN_GROUP, (total + other_bytes) // max(1, world or len(load)) // 8)
    units: list[tuple[int, str, list, list[int]]] = []   # (-bytes, order key, item keys, candidate ranks)
    small: dict[tuple[int, ...], list[tuple[str, Any, int]]] = {}
    for neg, order, key, cands in multi:
        ranks = sorted({r for r, _ in cands})
        if -neg < group:
            small.setdefault(tuple(ranks), []).append((order, key, -neg))
        else:
            units.append((neg, order, [key], ranks))
    for ranks, items in small.items():
        items.sort(key=lambda it: it[0])
        cur: list = []
        cur_bytes = 0
        for order, key, n in items:
            if cur and cur_bytes + n > group:
                units.append((-cur_bytes, cur[0][0], [k for _, k in cur], list(ranks)))
                cur, cur_bytes = [], 0
            cur.append((order, key))
            cur_bytes += n
        if cur:
            units.append((-cur_bytes, cur[0][0], [k for _, k in cur], list(ranks)))
    units.sort(key=lambda u: (u[0], u[1]))
    for neg, _, keys, ranks in units:
        rank = min(ranks, key=lambda r: (load[r], r))
        for key in keys:
            owners[key] = rank
        load[rank] += -neg
    # Preserve the caller's key order in the result (handy for logs); values are order-independent.
    return {key: owners[key] for key in candidates}


def assign_offsets(nbytes: Sequence[int], *, alignment: int = ALIGNMENT) -> tuple[list[int], int]:
    """Lay chunks out back to back in one data file, each starting at a multiple of ``alignment``.

    Args:
        nbytes: Size of each chunk, in write order.
        alignment: Start alignment (a power of two); O_DIRECT needs the device's logical block size.

    Returns:
        ``(offsets, end)``: each chunk's byte offset, and the end of the last chunk rounded up to
        ``alignment`` (what an O_DIRECT writer writes; the file may be truncated to the exact end).

    Raises:
        ValueError: ``alignment`` is not a positive power of two, or a size is negative.
    """
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a positive power of two, got {alignment!r}")
    offsets, pos = [], 0
    for n in nbytes:
        if type(n) is not int or n < 0:
            raise ValueError(f"chunk size must be a non-negative int, got {n!r}")
        offsets.append(pos)
        pos = -(-(pos + n) // alignment) * alignment
    return offsets, pos


# --------------------------------------------------------------------------------------------
# Read planning.


def row_major_strides(sizes: Sequence[int]) -> list[int]:
    """Element strides of a C-contiguous array of ``sizes`` (how a chunk's bytes are laid out)."""
    strides, acc = [0] * len(sizes), 1
    for d in range(len(sizes) - 1, -1, -1):
        strides[d] = acc
        acc *= sizes[d]
    return strides


def is_dense_layout(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether element ``strides`` lay an array of ``sizes`` out densely: its elements fill
    exactly ``prod(sizes)`` consecutive slots, no two in one (a permutation of a row-major
    layout, such as a transposed or channels_last tensor's). Dimensions of size 1 may have any
    stride (they never move an index); the others, from the smallest stride up, must have the
    strides of a row-major array whose dimensions run in that order, innermost first."""
    if len(sizes) != len(strides) or any(type(v) is not int or v < 0 for v in (*sizes, *strides)):
        return False
    acc = 1
    for d in sorted((d for d in range(len(sizes)) if sizes[d] > 1), key=lambda d: strides[d]):  # innermost first
        if strides[d] != acc:
            return False
        acc *= sizes[d]
    return True


def outermost_dim(sizes: Sequence[int], strides: Sequence[int] | None) -> int | None:
    """The dimension of size > 1 with the largest stride (the first such one for a row-major
    layout, ``strides`` None): slices along it are the layout's largest disjoint byte runs.
    None when every size is 1."""
    dims = [d for d in range(len(sizes)) if sizes[d] > 1]
    if not dims:
        return None
    if strides is None:
        return dims[0]
    return max(dims, key=lambda d: strides[d])


def byte_range(chunk: Box, sub: Box, itemsize: int, strides: Sequence[int] | None = None) -> tuple[int, int]:
    """The smallest contiguous byte range ``[start, end)`` of ``chunk`` holding ``sub``.

    ``start`` is the byte of ``sub``'s first element, ``end`` one past its last element. The range
    holds exactly ``sub``'s bytes when ``sub`` is contiguous in the chunk (for a row-major chunk:
    it spans the chunk on every dimension after its first one of size > 1), else it also holds
    bytes to skip.

    Args:
        chunk: The saved chunk (global coordinates).
        sub: A non-empty box inside ``chunk`` (global coordinates).
        itemsize: Bytes per element.
        strides: The chunk's element strides when it is not row-major (non-negative, as
            :func:`is_dense_layout` accepts); None: row-major.

    Raises:
        ValueError: ``sub`` is empty or not inside ``chunk``, or ``itemsize`` < 1.
    """
    if itemsize < 1:
        raise ValueError(f"itemsize must be >= 1, got {itemsize}")
    if not chunk.contains(sub):
        raise ValueError(f"box {sub} is not inside chunk {chunk}")
    if sub.volume == 0:
        raise ValueError(f"box {sub} is empty")
    first = last = 0
    for st, co, so, ss in zip(row_major_strides(chunk.sizes) if strides is None else strides, chunk.offsets,
                              sub.offsets, sub.sizes):
        rel = so - co
        first += rel * st
        last += (rel + ss - 1) * st
    return first * itemsize, (last + 1) * itemsize


def _is_contiguous(chunk: Box, sub: Box) -> bool:
    # Contiguous iff after the first dim where sub has size > 1, it spans the chunk entirely.
    seen_multi = False
    for cs, ss in zip(chunk.sizes, sub.sizes):
        if seen_multi and ss != cs:
            return False
        if ss > 1:
            seen_multi = True
    return True


@dataclasses.dataclass(frozen=True, slots=True)
class ReadPiece:
    """One read: the part of a saved chunk that lands in the wanted box.

    Attributes:
        payload: What the caller attached to the chunk (e.g. its ChunkRecord), passed through.
        chunk: The saved chunk's box (global coordinates).
        box: The elements to copy: chunk ∩ want (global coordinates, never empty).
        in_chunk: ``box`` relative to the chunk's first element (slice of the chunk's view).
        in_want: ``box`` relative to the wanted box's first element (slice of the destination).
        byte_range: ``(start, end)`` inside the chunk's bytes, from :func:`byte_range`.
        contiguous: True when ``byte_range`` holds exactly the piece's bytes in order, so they can
            be read straight into a contiguous destination; else read the range and slice.
    """

    payload: Any
    chunk: Box
    box: Box
    in_chunk: Box
    in_want: Box
    byte_range: tuple[int, int]
    contiguous: bool


def plan_reads(chunks: Iterable[tuple[Box, Any]], want: Box, *, itemsize: int) -> list[ReadPiece]:
    """Plan the reads that assemble ``want`` from saved chunks.

    Args:
        chunks: ``(chunk_box, payload)`` pairs; the saved chunks of one tensor, in any order.
        want: The box the caller needs (global coordinates), e.g. a rank's local shard.
        itemsize: Bytes per element of the tensor's dtype.

    Returns:
        One :class:`ReadPiece` per chunk that intersects ``want``, in input order; the pieces'
        boxes exactly tile ``want`` (an empty ``want`` gives ``[]``).

    Raises:
        ReshardError: part of ``want`` is held by no chunk (the message names the region), or
            two chunks hold the same elements of ``want``.
        ValueError: a chunk's rank differs from ``want``'s.
    """
    pieces: list[ReadPiece] = []
    for cbox, payload in chunks:
        box = intersect(cbox, want)
        if box is None:
            continue
        pieces.append(
            ReadPiece(
                payload=payload,
                chunk=cbox,
                box=box,
                in_chunk=box.relative_to(cbox),
                in_want=box.relative_to(want),
                byte_range=byte_range(cbox, box, itemsize),
                contiguous=_is_contiguous(cbox, box),
            )
        )
    if len(pieces) == 1 and pieces[0].box == want:
        return pieces  # one chunk holds all of it (the same sharding as saved): nothing to tile
    defect = find_tiling_defect([p.box for p in pieces], want)
    if defect is not None:
        if defect.kind == "uncovered":
            raise ReshardError(
                f"no saved chunk holds region {defect.region} of the wanted box {want} "
                f"({len(pieces)} chunks intersect it)",
                region=defect.region,
            )
        a, b = (pieces[i] for i in defect.indices)
        raise ReshardError(
            f"saved chunks {a.chunk} and {b.chunk} both hold region {defect.region} of the wanted box {want}",
            region=defect.region,
        )
    return pieces


def expand_to_blocks(start: int, end: int, block: int, limit: int) -> tuple[int, int]:
    """Widen the byte range ``[start, end)`` of a chunk to whole checksum blocks.

    Blocks start at multiples of ``block`` from the chunk's first byte; the last block of a chunk
    is partial, so the end is capped at ``limit`` (the chunk's nbytes). Checksum ``k`` of the chunk
    then covers ``[k * block, min((k + 1) * block, limit))`` and the widened range starts at block
    ``start // block``.

    Raises:
        ValueError: not ``0 <= start <= end <= limit`` or ``block < 1``.
    """
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if not 0 <= start <= end <= limit:
        raise ValueError(f"need 0 <= start <= end <= limit, got start={start}, end={end}, limit={limit}")
    if start == end:
        return start, end
    return (start // block) * block, min(-(-end // block) * block, limit)


# Smallest checksum block a save picks by itself: below this the per-block cost (one crc32c call
# and 5 bytes of MANIFEST each) outgrows what it saves; O_DIRECT reads are 4 KiB-aligned anyway.
MIN_CHECKSUM_BLOCK = 16 << 10
# A save picks its block so that MANIFEST holds at most this many checksums (about 5 MiB).
MAX_CHECKSUMS = 1 << 20


def choose_checksum_block(chunk_nbytes: Iterable[int], largest: int) -> int:
    """The checksum block for a checkpoint whose chunks have ``chunk_nbytes`` bytes (see
    :func:`choose_checksum_block_counted`, which takes the same sizes as ``{nbytes: count}``)."""
    counts: dict[int, int] = {}
    for n in chunk_nbytes:
        counts[n] = counts.get(n, 0) + 1
    return choose_checksum_block_counted(counts, largest)


def choose_checksum_block_counted(counts: Mapping[int, int], largest: int) -> int:
    """The checksum block for a checkpoint holding ``counts[n]`` chunks of ``n`` bytes.

    A resharding load that cuts a chunk must read and verify whole blocks, so every cut wastes up
    to one block on each side: a 1 MiB block doubled the bytes read for chunks under 1 MiB. This
    picks the largest power of two ``B <= largest`` whose waste, if every chunk were cut once
    (``sum(min(nbytes, 2 * B))``), stays within 4 % of the checkpoint's bytes; then at least
    ``MIN_CHECKSUM_BLOCK`` and large enough for ``MAX_CHECKSUMS`` checksums in all. Deterministic:
    every rank computes the same block from the same global plan. Taking the sizes as counts lets
    a plan of millions of equal chunks (an even split over thousands of ranks) pick its block in
    time proportional to the distinct sizes.

    Raises:
        ValueError: ``largest`` is not a power of two >= 1.
    """
    if largest < 1 or largest & (largest - 1):
        raise ValueError(f"largest must be a power of two, got {largest}")
    sizes = [(n, c) for n, c in counts.items() if n > 0 and c > 0]
    total = sum(n * c for n, c in sizes)
    floor = min(largest, MIN_CHECKSUM_BLOCK)
    need = -(-total // MAX_CHECKSUMS)  # the block that keeps the checksum count bounded
    block = largest
    while block > floor and sum(min(n, 2 * block) * c for n, c in sizes) > total // 25:
        block //= 2
    while block < need and block < largest:
        block *= 2
    return block


# --------------------------------------------------------------------------------------------
# Even grids: the layout of a DTensor whose placements are all Shard on distinct dimensions.


def grid_part(n: int, parts: int, i: int) -> tuple[int, int]:
    """``(start, size)`` of part ``i`` of a dimension of ``n`` elements cut into ``parts`` parts
    as ``torch.chunk`` and DTensor's ``Shard`` cut it: parts of ``ceil(n / parts)`` elements, the
    last non-empty one possibly shorter, the trailing ones empty (starting at ``n``).

    Raises:
        ValueError: ``parts < 1`` or ``i`` outside ``[0, parts)``.
    """
    if parts < 1 or not 0 <= i < parts:
        raise ValueError(f"part {i} of {parts} does not exist")
    chunk = -(-n // parts)
    start = i * chunk
    return min(start, n), max(0, min(n, start + chunk) - start)


def grid_box(shape: Sequence[int], mesh_shape: Sequence[int], dims: Sequence[int],
             coord: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, sizes)`` of the chunk at mesh coordinate ``coord`` of a tensor of ``shape``
    whose dimension ``dims[i]`` is split evenly (:func:`grid_part`) over mesh dimension ``i``.
    ``dims`` must be distinct: the chunks of all coordinates then tile ``shape`` exactly.

    Raises:
        ValueError: lengths differ, ``dims`` repeat or lie outside ``shape``, or ``coord`` lies
            outside ``mesh_shape``.
    """
    if not len(mesh_shape) == len(dims) == len(coord) or len(set(dims)) != len(dims):
        raise ValueError(f"mesh {list(mesh_shape)}, dims {list(dims)}, coordinate {list(coord)} do not describe a grid")
    offsets, sizes = [0] * len(shape), list(shape)
    for m, d, c in zip(mesh_shape, dims, coord):
        if not 0 <= d < len(shape):
            raise ValueError(f"dimension {d} does not exist in shape {list(shape)}")
        offsets[d], sizes[d] = grid_part(shape[d], m, c)
    return tuple(offsets), tuple(sizes)


def grid_chunk_counts(shape: Sequence[int], mesh_shape: Sequence[int], dims: Sequence[int]) -> dict[int, int]:
    """``{elements: number of chunks}`` over every coordinate of the grid of :func:`grid_box`:
    each split dimension has at most three part lengths (full, a shorter last one, empty), so
    this costs ``O(3 ** len(dims))``, not one step per chunk."""
    split = dict(zip(dims, mesh_shape))
    counts = {1: 1}
    for d, n in enumerate(shape):
        if d in split:
            parts = split[d]
            chunk = -(-n // parts)
            full = n // chunk if chunk else 0
            lengths: dict[int, int] = {}
            if full:
                lengths[chunk] = full
            rest = n - full * chunk
            if rest:
                lengths[rest] = lengths.get(rest, 0) + 1
            empty = parts - full - (1 if rest else 0)
            if empty:
                lengths[0] = lengths.get(0, 0) + empty
        else:
            lengths = {n: 1}
        nxt: dict[int, int] = {}
        for a, ca in counts.items():
            for b, cb in lengths.items():
                nxt[a * b] = nxt.get(a * b, 0) + ca * cb
        counts = nxt
    return counts
