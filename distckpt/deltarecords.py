"""The records of a delta link of an incremental chain: their form, and the checks every reader
relies on.

A delta checkpoint (docs/INCREMENTAL.md) holds, under the root key ``_incr``, one record of three
entries per saved piece of tracked tensor number ``j`` (the tracked tensors sorted by name):

* ``_incr.<j>.<piece>.box``: the piece's global ``[offsets, sizes]``, a plain value, inside the
  tensor's recorded shape;
* ``_incr.<j>.<piece>.ids``: the row numbers it changed, a 1-D integer tensor, increasing, inside
  the box's rows (the tracked row dimension);
* ``_incr.<j>.<piece>.rows``: those rows, one per id, each of the box's other sizes.

Pieces of one tensor in one link are disjoint, except replicas: a Replicate DTensor's box, held
by several ranks, which savers before replicas were written once wrote once per rank. Where two
pieces overlap, they must hold the same row ids there and the same bytes in those rows
(:func:`check_overlaps`): a load writes both, and pieces that differ there would make the result
depend on which is copied last, and ``read`` and ``load`` disagree.

A load (:func:`distckpt.incremental.plan_deltas`) and ``distckpt verify`` (:func:`check_link`)
apply the same rules, from here: a record that ``verify`` passes is one a load composes, and one
a load would refuse is reported by ``verify``. Every break is a ChainBrokenError naming the record.
"""

from __future__ import annotations

import os

import torch

from .chain import ChainLink, _broken
from .errors import CheckpointCorruptError, CheckpointNotFoundError
from .fill import fill_boxes_of
from .tensorbytes import EXACT_CASTS, dtype_from_name
from .values import decode_value

__all__ = ["DELTA_ROOT", "box_of", "pieces_of", "check_no_stray", "check_box", "check_ids_form", "checked_ids",
           "check_rows_dtype", "overlapping_pairs", "check_overlaps", "check_all_overlaps", "check_link",
           "read_records", "link_error"]

DELTA_ROOT = "_incr"   # root key of the delta records inside a delta checkpoint


def box_of(link: ChainLink, fqn: str) -> tuple[list[int], list[int]]:
    """The (offsets, sizes) the box entry ``fqn`` of ``link`` gives, checked to be plain ints.
    Raises ChainBrokenError for an entry that is a pickle (never unpickled) or no box."""
    entry = link.manifest.objects.get(fqn)
    if entry is None:   # a tensor of that name (a bare KeyError before)
        raise _broken(link.path, f"delta record {fqn} is a tensor, not a box (a plain value)")
    if entry.kind == "pickle":   # a saver writes boxes as plain values: never unpickled
        raise _broken(link.path, f"delta record {fqn} is a pickle, not a box")
    box = decode_value(entry.kind, entry.value, fqn=fqn, path=link.path)
    if (not isinstance(box, list) or len(box) != 2 or not all(isinstance(b, list) for b in box)
            or len(box[0]) != len(box[1])
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in box[0] + box[1])):
        raise _broken(link.path, f"delta record {fqn} is not a box: {box!r}")
    return box[0], box[1]


def pieces_of(link: ChainLink, j: int) -> dict[str, dict[str, str]]:
    """{piece name: {"box"|"ids"|"rows": fqn}} of tracked tensor number ``j`` in ``link``.
    Raises ChainBrokenError for a piece that lacks one of the three."""
    prefix = f"{DELTA_ROOT}.{j}."
    out: dict[str, dict[str, str]] = {}
    for fqn in list(link.manifest.tensors) + list(link.manifest.objects):
        if fqn.startswith(prefix):
            piece, _, what = fqn[len(prefix):].rpartition(".")
            out.setdefault(piece, {})[what] = fqn
    for piece, parts in out.items():
        if set(parts) != {"box", "ids", "rows"}:
            missing = sorted({"box", "ids", "rows"} - set(parts))
            raise _broken(link.path, f"delta record {prefix}{piece} lacks {missing}")
    return out


def check_no_stray(link: ChainLink, n_tracked: int) -> None:
    """Raise ChainBrokenError when a record of ``link`` sits under a number no tracked tensor has:
    a reader would skip it, and its rows would be lost without a word."""
    numbers = {str(j) for j in range(n_tracked)}
    stray = sorted(f for f in list(link.manifest.tensors) + list(link.manifest.objects)
                   if f.startswith(DELTA_ROOT + ".") and f[len(DELTA_ROOT) + 1:].split(".", 1)[0] not in numbers)
    if stray:
        raise _broken(link.path, f"delta record {stray[0]} belongs to no tracked tensor ({n_tracked} tracked)")


def check_box(link: ChainLink, fqn: str, box_fqn: str, offsets: list[int], sizes: list[int],
              shape: list[int] | None) -> None:
    """Raise ChainBrokenError when the box ``(offsets, sizes)`` of tracked tensor ``fqn`` is not
    inside its recorded ``shape`` (None: a chain of an older saver, which recorded none): its rows
    beyond the shape would be dropped by every target without a word."""
    if shape is not None and (len(shape) != len(offsets) or any(o + n > m for o, n, m in zip(offsets, sizes, shape))):
        raise _broken(link.path, f"{box_fqn}: box {[offsets, sizes]} is not inside {fqn}'s shape {shape}")


def check_ids_form(link: ChainLink, ids_fqn: str) -> None:
    """Raise ChainBrokenError when the ids entry ``ids_fqn`` is no tensor, or one of another shape
    than 1-D (before any of it is read)."""
    entry = link.manifest.tensors.get(ids_fqn)
    if entry is None:   # a plain value of that name (a bare KeyError before)
        raise _broken(link.path, f"{ids_fqn}: row ids saved as a value, not a tensor")
    shape = list(entry.shape)
    if len(shape) != 1:
        raise _broken(link.path, f"{ids_fqn}: row ids of shape {shape}, not 1-D")


def checked_ids(link: ChainLink, parts: dict[str, str], ids: torch.Tensor, offsets: list[int],
                sizes: list[int], dim: int, fqn: str) -> torch.Tensor:
    """``ids`` (read from ``parts["ids"]``) as int64, once they are increasing row numbers inside the
    box's rows along the row dimension ``dim``, and the rows record holds one row per id of the
    box's other sizes. Raises ChainBrokenError otherwise: row ids are searched (sorted) and scatter
    rows, so any other ids would land rows silently in the wrong place, and a rows record of
    another shape was cut to the box."""
    if dim >= len(offsets):
        raise _broken(link.path, f"{fqn}: its row dimension {dim} is not one of its pieces' {len(offsets)}")
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise _broken(link.path, f"{parts['ids']}: row ids of shape {list(ids.shape)} and dtype {ids.dtype}")
    ids = ids.to(torch.int64)
    if ids.numel() and (bool((ids[1:] <= ids[:-1]).any()) or int(ids[0]) < offsets[dim]
                        or int(ids[-1]) >= offsets[dim] + sizes[dim]):
        raise _broken(link.path, f"{parts['ids']}: row ids not increasing inside rows "
                                 f"[{offsets[dim]}, {offsets[dim] + sizes[dim]})")
    rows = link.manifest.tensors.get(parts["rows"])
    expected = [ids.numel()] + [sizes[k] for k in range(len(sizes)) if k != dim]
    if rows is None or list(rows.shape) != expected:
        found = "no tensor" if rows is None else f"rows of shape {list(rows.shape)}"
        raise _broken(link.path, f"{parts['rows']}: {found}, not {expected} "
                                 f"({ids.numel()} row ids in box {[offsets, sizes]})")
    return ids


def check_rows_dtype(link: ChainLink, fqn: str, rows_fqn: str, into: str) -> None:
    """Raise ChainBrokenError when the rows entry ``rows_fqn`` of tracked tensor ``fqn`` holds a
    dtype that cannot be composed into ``into`` (a dtype name) without rounding: the same dtype,
    or an exact cast (bf16 rows into fp32), is composed; wider rows over a narrower base (a
    chain whose tensors changed dtype mid-way, written before links recorded their dtypes) are
    not."""
    rows = link.manifest.tensors[rows_fqn].dtype
    if rows != into and into not in EXACT_CASTS.get(rows, ()):
        raise _broken(link.path, f"{rows_fqn}: its rows are {rows}, the chain's base holds {fqn} as {into}: they "
                                 f"cannot be composed without rounding")


def overlapping_pairs(boxes: list[tuple[list[int], list[int]]]) -> list[tuple[int, int]]:
    """The pairs ``(a, b)``, ``a < b``, of ``boxes`` (offsets, sizes) that share an element. A sweep
    along the dimension whose offsets take the most distinct values: pieces sharded along it are
    compared with their neighbours only, not with every other piece."""
    if len(boxes) < 2:
        return []
    ndim = len(boxes[0][0])
    k = max(range(ndim), key=lambda d: len({o[d] for o, _s in boxes}))
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][k])
    active: list[int] = []
    out = []
    for i in order:
        oi, si = boxes[i]
        if any(n <= 0 for n in si):
            continue   # an empty box shares nothing
        active = [a for a in active if boxes[a][0][k] + boxes[a][1][k] > oi[k]]
        for a in active:
            oa, sa = boxes[a]
            if all(max(x, y) < min(x + m, y + n) for x, m, y, n in zip(oa, sa, oi, si)):
                out.append((min(a, i), max(a, i)))
        active.append(i)
    return sorted(out)


def check_overlaps(link: ChainLink, fqn: str, dim: int, pieces: list[tuple[dict, list, list, torch.Tensor]],
                   verify: bool) -> int:
    """Raise ChainBrokenError unless every two of ``pieces`` (parts, offsets, sizes, checked int64
    ids) of tracked tensor ``fqn`` in ``link`` that overlap hold the same row ids inside their
    common box and the same bytes in those rows there (the overlapping rows are read, checksums
    checked with ``verify``). Returns the bytes read: none where no pieces overlap."""
    pairs = overlapping_pairs([(o, s) for _p, o, s, _i in pieces])
    reads, compare = [], []
    for a, b in pairs:
        (pa, oa, sa, ia), (pb, ob, sb, ib) = pieces[a], pieces[b]
        lo = [max(x, y) for x, y in zip(oa, ob)]
        hi = [min(x + m, y + n) for x, m, y, n in zip(oa, sa, ob, sb)]
        spans = []
        for parts, off, ids in ((pa, oa, ia), (pb, ob, ib)):
            first, last = int(torch.searchsorted(ids, lo[dim])), int(torch.searchsorted(ids, hi[dim]))
            spans.append((parts, off, ids[first:last], first, last))
        (_, _, ids_a, fa, la), (_, _, ids_b, fb, lb) = spans
        if not torch.equal(ids_a, ids_b):
            raise _broken(link.path, f"{pa['ids']} and {pb['ids']} overlap in box {[lo, [h - l for l, h in zip(lo, hi)]]} "
                                     f"of {fqn} but changed different rows there: replicas that differ")
        if la == fa:
            continue
        dtypes = sorted({link.manifest.tensors[p["rows"]].dtype for p in (pa, pb)})
        if len(dtypes) > 1:
            raise _broken(link.path, f"{pa['rows']} and {pb['rows']} overlap in {fqn} but hold rows of dtypes "
                                     f"{dtypes}")
        dtype = dtype_from_name(dtypes[0], path=link.path)
        bufs = []
        for parts, off, _ids, first, last in spans:
            offs = [first] + [lo[k] - off[k] for k in range(len(off)) if k != dim]
            szs = [last - first] + [hi[k] - lo[k] for k in range(len(off)) if k != dim]
            buf = torch.empty(szs, dtype=dtype)
            reads.append((parts["rows"], tuple(offs), tuple(szs), buf))
            bufs.append(buf)
        compare.append((pa["rows"], pb["rows"], bufs))
    if not reads:
        return 0
    nbytes = read_records([(link.path, link.manifest, reads)], verify, "overlapping delta rows")
    for name_a, name_b, (x, y) in compare:
        # bytes, not values: NaN rows that are the same bits are equal, -0.0 and 0.0 are not
        if x.numel() and not torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)):
            raise _broken(link.path, f"{name_a} and {name_b} overlap in {fqn} and hold different values for the "
                                     f"same rows: replicas that differ (a load would keep whichever it copies last)")
    return nbytes


def check_all_overlaps(link: ChainLink, pieces: list, tracked: dict[str, int], verify: bool,
                       cache: dict | None = None) -> int:
    """:func:`check_overlaps` of ``pieces`` ((fqn, parts, offsets, sizes, checked ids) of ``link``),
    per tracked tensor. ``cache``: the sets of pieces already compared (a caller planning one
    tensor slice by slice compares them once; filled here). Returns the bytes read."""
    by_fqn: dict[str, list] = {}
    for fqn, parts, offsets, sizes, ids in pieces:
        by_fqn.setdefault(fqn, []).append((parts, offsets, sizes, ids))
    nbytes = 0
    for fqn, found in by_fqn.items():
        key = (link.path, "overlaps", fqn, tuple(p["ids"] for p, _o, _s, _i in found))
        if len(found) > 1 and (cache is None or key not in cache):
            nbytes += check_overlaps(link, fqn, tracked[fqn], found, verify)
            if cache is not None:
                cache[key] = True
    return nbytes


def check_link(link: ChainLink, *, verify: bool = True) -> int:
    """Check every record of the delta ``link`` (its manifest with its chunk records) as a load of
    its whole tracked tensors would: no stray record, every box inside its tensor's recorded shape
    and of its dimensions, every ids entry read (checksums checked with ``verify``) and increasing
    inside its box, every rows entry one row per id, overlapping pieces equal where they overlap
    (:func:`check_overlaps`). Returns the bytes read (the ids, and the rows of overlapping pieces).

    Raises:
        ChainBrokenError: naming the first record that breaks a rule, or whose ids cannot be read.
    """
    tracked = {fqn: dim for fqn, dim in link.meta.get("tracked") or []}
    order = sorted(tracked)
    check_no_stray(link, len(order))
    shapes = link.meta.get("shapes") or {}
    found = []   # (fqn, parts, offsets, sizes, ids buffer)
    requests = []
    for j, fqn in enumerate(order):
        recorded = shapes.get(fqn) or [None, None]   # [shape, dtype name]; absent from older savers'
        shape, dtype = recorded[0], recorded[1] if len(recorded) > 1 else None
        for _name, parts in sorted(pieces_of(link, j).items()):
            offsets, sizes = box_of(link, parts["box"])
            check_box(link, fqn, parts["box"], offsets, sizes, shape)
            check_ids_form(link, parts["ids"])
            if parts["rows"] in link.manifest.tensors and isinstance(dtype, str):
                check_rows_dtype(link, fqn, parts["rows"], dtype)
            entry = link.manifest.tensors[parts["ids"]]
            buf = torch.empty(tuple(entry.shape), dtype=dtype_from_name(entry.dtype, path=link.path))
            requests.append((parts["ids"], (0,), tuple(buf.shape), buf))
            found.append((fqn, parts, offsets, sizes, buf))
    nbytes = 0
    if requests:
        nbytes = read_records([(link.path, link.manifest, requests)], verify, "delta row ids")
    checked = [(fqn, parts, offsets, sizes, checked_ids(link, parts, ids, offsets, sizes, tracked[fqn], fqn))
               for fqn, parts, offsets, sizes, ids in found]
    return nbytes + check_all_overlaps(link, checked, tracked, verify)


def read_records(reads: list, verify: bool, what: str) -> int:
    """:func:`distckpt.fill.fill_boxes_of` of records; a damaged or missing data file is a
    ChainBrokenError naming its link. Returns the bytes read."""
    try:
        return fill_boxes_of(reads, verify=verify)
    except (CheckpointCorruptError, CheckpointNotFoundError) as exc:
        raise link_error(exc, [p for p, _m, _r in reads], what) from exc


def link_error(exc: BaseException, links: list[str], what: str) -> BaseException:
    """ChainBrokenError naming the link (of ``links``) whose file ``exc`` is about."""
    where = os.fspath(getattr(exc, "path", None) or "")
    link = next((p for p in links if where == p or where.startswith(p + os.sep)), links[0])
    return _broken(link, f"its {what} cannot be read ({type(exc).__name__}: "
                         f"{getattr(exc, 'message', exc)})", cause=exc)
