"""The records of a delta link of an incremental chain: their form, and the checks every reader
relies on.

A delta checkpoint (docs/INCREMENTAL.md) holds, under the root key ``_incr``, one record of three
entries per saved piece of tracked tensor number ``j`` (the tracked tensors sorted by name):

* ``_incr.<j>.<piece>.box``: the piece's global ``[offsets, sizes]``, a plain value, inside the
  tensor's recorded shape;
* ``_incr.<j>.<piece>.ids``: the row numbers it changed, a 1-D integer tensor, increasing, inside
  the box's rows (the tracked row dimension);
* ``_incr.<j>.<piece>.rows``: those rows, one per id, each of the box's other sizes.

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
           "check_rows_dtype", "check_link", "read_records", "link_error"]

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


def check_link(link: ChainLink, *, verify: bool = True) -> int:
    """Check every record of the delta ``link`` (its manifest with its chunk records) as a load of
    its whole tracked tensors would: no stray record, every box inside its tensor's recorded shape
    and of its dimensions, every ids entry read (checksums checked with ``verify``) and increasing
    inside its box, every rows entry one row per id. Returns the bytes read (the ids).

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
    for fqn, parts, offsets, sizes, ids in found:
        checked_ids(link, parts, ids, offsets, sizes, tracked[fqn], fqn)
    return nbytes


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
