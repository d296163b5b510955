"""Which data files hold which boxes of a tensor: format version 4's ``where``.

With it a load reads only the indexes of the files that hold the boxes its rank wants, instead of
every file's (docs/FORMAT.md, "Where a tensor's chunks are"). A tensor's ``where`` is one of:

  * ``("grid", mesh, dims)``: ``mesh`` indexes the manifest's meshes, each ``(shape, ranks)``
    (a mesh shape and the writer rank at each coordinate, row-major, all distinct); tensor
    dimension ``dims[i]`` is split evenly over mesh dimension ``i`` (:func:`distckpt.plan.grid_part`,
    torch.chunk's and DTensor ``Shard``'s cut), and the elements of the cell at mesh coordinate
    ``c`` are in the data file written by ``ranks[c]``, in one or more chunks; an empty cell has
    none. A rank outside the mesh holds no chunk of the tensor. What FSDP, TP and TP+FSDP
    (DTensors with only ``Shard`` placements) save: O(1) per tensor, O(ranks) per mesh.
  * ``("ranks", ((start, stop), ...))``: the tensor's chunks are in the files of these writer
    ranks (sorted, disjoint, non-empty half-open ranges); nothing more is said of which boxes.
    Any other layout: a reader wanting any box of it reads all those files' indexes.

Pure integer math, no I/O; :mod:`distckpt.manifest` validates a ``where`` with :func:`problem`
and checks every chunk it reads against it with :func:`chunk_problem`.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Iterator, Sequence

from .plan import Box, grid_box

__all__ = ["problem", "mesh_problem", "holders", "ranks_for", "positions", "rank_cell", "chunk_problem", "ranges"]

#: The most ranges a ``("ranks", ...)`` where may list (one per writer rank at worst).
MAX_RANGES = 1 << 20


def _int(v: Any) -> bool:
    return type(v) is int


def problem(where: Any, meshes: Sequence, shape: Sequence[int], world: int) -> str | None:
    """What is wrong with ``where`` for a tensor of ``shape`` in a manifest with ``meshes`` and
    ``world`` ranks, or None. ``meshes`` must have been checked (:func:`mesh_problem`)."""
    if not isinstance(where, tuple) or not where or where[0] not in ("grid", "ranks"):
        return f"where must be ['grid', mesh, dims] or ['ranks', [[start, stop], ...]], found {where!r}"
    if where[0] == "grid":
        if len(where) != 3:
            return f"a grid where is ['grid', mesh, dims], found {where!r}"
        _, mi, dims = where
        if not _int(mi) or not 0 <= mi < len(meshes):
            return f"mesh {mi!r} does not exist (the manifest lists {len(meshes)} meshes)"
        mesh_shape = meshes[mi][0]
        if not isinstance(dims, tuple) or len(dims) != len(mesh_shape):
            return f"dims {dims!r} must give one tensor dimension per dimension of mesh {mi} {list(mesh_shape)}"
        if not all(_int(d) and 0 <= d < len(shape) for d in dims) or len(set(dims)) != len(dims):
            return f"dims {list(dims)} must be distinct dimensions of the shape {list(shape)}"
        return None
    if len(where) != 2 or not isinstance(where[1], tuple) or len(where[1]) > MAX_RANGES:
        return f"a ranks where is ['ranks', [[start, stop], ...]], found {where!r}"
    last = 0
    for r in where[1]:
        if (not isinstance(r, tuple) or len(r) != 2 or not all(_int(v) for v in r)
                or not last <= r[0] < r[1] <= world):
            return f"rank ranges {list(where[1])!r} must be sorted, disjoint, non-empty and inside [0, {world})"
        last = r[1]
    return None


def mesh_problem(mesh: Any, world: int) -> str | None:
    """What is wrong with one manifest mesh ``(shape, ranks)``, or None."""
    if not isinstance(mesh, tuple) or len(mesh) != 2 or not all(isinstance(v, tuple) for v in mesh):
        return f"a mesh is [shape, ranks], found {mesh!r}"
    shape, ranks = mesh
    if not shape or len(shape) > 64 or not all(_int(n) and n >= 1 for n in shape):
        return f"mesh shape {list(shape)!r} must be 1 to 64 positive integers"
    if math.prod(shape) != len(ranks):
        return f"mesh shape {list(shape)} has {math.prod(shape)} coordinates, its ranks list {len(ranks)}"
    if not all(_int(r) and 0 <= r < world for r in ranks) or len(set(ranks)) != len(ranks):
        return f"mesh ranks must be distinct ranks in [0, {world})"
    return None


def _coord(mesh_shape: Sequence[int], linear: int) -> tuple[int, ...]:
    out = []
    for n in reversed(mesh_shape):
        linear, c = divmod(linear, n)
        out.append(c)
    return tuple(reversed(out))


def _linear(mesh_shape: Sequence[int], coord: Sequence[int]) -> int:
    k = 0
    for n, c in zip(mesh_shape, coord):
        k = k * n + c
    return k


def holders(where: tuple, meshes: Sequence) -> list[int]:
    """Every writer rank that may hold chunks of the tensor, sorted."""
    if where[0] == "grid":
        return sorted(meshes[where[1]][1])
    return [r for start, stop in where[1] for r in range(start, stop)]


def positions(meshes: Sequence) -> list[dict[int, int]]:
    """Per mesh, ``{rank: its row-major coordinate index}``: what :func:`rank_cell` looks up
    (built once per manifest, so a lookup does not scan the mesh)."""
    return [{r: k for k, r in enumerate(ranks)} for _shape, ranks in meshes]


def rank_cell(where: tuple, meshes: Sequence, shape: Sequence[int], rank: int,
              where_is: list[dict[int, int]] | None = None) -> Box | None:
    """For a grid ``where``: the box whose elements ``rank``'s file holds (possibly empty), or
    None when ``rank`` is not in the mesh (its file holds no chunk of the tensor). ``where_is``:
    :func:`positions` of ``meshes``, when the caller has it."""
    mesh_shape, ranks = meshes[where[1]]
    linear = (where_is[where[1]] if where_is is not None else positions([meshes[where[1]]])[0]).get(rank)
    if linear is None:
        return None
    offsets, sizes = grid_box(shape, mesh_shape, where[2], _coord(mesh_shape, linear))
    return Box(offsets, sizes)


def _cells(shape: Sequence[int], mesh_shape: Sequence[int], dims: Sequence[int], box: Box) -> Iterator[tuple]:
    """The mesh coordinates whose (non-empty) cells intersect ``box``."""
    per_dim = []
    for n, d in zip(mesh_shape, dims):
        step = -(-shape[d] // n) if shape[d] else 1
        lo, hi = box.offsets[d], box.offsets[d] + box.sizes[d]
        if hi <= lo:
            return iter(())
        per_dim.append(range(lo // step, min(n, -(-hi // step))))
    return itertools.product(*per_dim)


def ranks_for(where: tuple, meshes: Sequence, shape: Sequence[int], box: Box) -> list[int]:
    """The writer ranks whose files may hold elements of ``box`` (a box inside ``shape``), sorted:
    for a grid, the ranks of the cells it intersects (O(those cells)); otherwise every holder."""
    if where[0] != "grid" or box.volume == 0:
        return holders(where, meshes) if box.volume else []
    mesh_shape, ranks = meshes[where[1]]
    return sorted(ranks[_linear(mesh_shape, c)] for c in _cells(shape, mesh_shape, where[2], box))


def chunk_problem(where: tuple, meshes: Sequence, shape: Sequence[int], rank: int, box: Box,
                  where_is: list[dict[int, int]] | None = None, cells: dict | None = None) -> str | None:
    """What is wrong with a chunk ``box`` found in the file of writer ``rank``, or None: for a grid
    it must lie inside that rank's cell; otherwise the rank must be a holder. ``where_is`` as
    :func:`rank_cell` takes it; ``cells``: {rank: its cell} of this tensor, filled here (a caller
    checking many chunks of one tensor computes each cell once)."""
    if where[0] == "grid":
        if cells is None:
            cell = rank_cell(where, meshes, shape, rank, where_is)
        elif rank in cells:
            cell = cells[rank]
        else:
            cell = cells[rank] = rank_cell(where, meshes, shape, rank, where_is)
        if cell is None:
            return f"rank {rank} is not in the tensor's mesh {where[1]}, so its file holds none of it"
        if any(o < co or o + s > co + cs for o, s, co, cs in zip(box.offsets, box.sizes, cell.offsets, cell.sizes)):
            return f"the chunk {box} lies outside rank {rank}'s cell {cell} of the grid"
        return None
    if not any(start <= rank < stop for start, stop in where[1]):
        return f"rank {rank} is not one of the tensor's holders {list(where[1])}"
    return None


def ranges(ranks: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Sorted distinct ``ranks`` as half-open runs ``((start, stop), ...)`` (a ranks where)."""
    out: list[list[int]] = []
    for r in sorted(set(ranks)):
        if out and out[-1][1] == r:
            out[-1][1] = r + 1
        else:
            out.append([r, r + 1])
    return tuple((a, b) for a, b in out)
