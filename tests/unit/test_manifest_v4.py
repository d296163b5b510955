"""Format version 4: where each tensor's chunks are (distckpt.where), and a manifest that carries
the chunks of some data files only (what a load reads at scale).

The golden directory tests/golden/v4 is the v3 golden checkpoint (the same data files) with a
version-4 MANIFEST; the hostile cases edit its body and re-wrap it with a valid crc32c, so they
reach the schema and the checks against the indexes."""

from __future__ import annotations

import itertools
import os

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distckpt import manifest as mf
from distckpt import where as wh
from distckpt.errors import ManifestCorruptError
from distckpt.plan import Box, grid_box, intersect
from distckpt.storage.posix.manifests import load_manifest
from tests.unit.test_manifest import GOLDEN, gen

V4 = os.path.join(GOLDEN, "v4")


def _files() -> list[bytes]:
    out = []
    for i in range(2):
        with open(os.path.join(V4, mf.data_file_name(i)), "rb") as f:
            out.append(f.read())
    return out


def _read_index(files: list[bytes]):
    return lambda header, i: files[i][header.files[i].index[0]:]


def _stored() -> bytes:
    with open(os.path.join(V4, "MANIFEST"), "rb") as f:
        return f.read()


def _edited(edit) -> bytes:
    """The golden v4 MANIFEST with its body edited by ``edit`` (valid header and crc32c)."""
    body = msgpack.unpackb(_stored()[24:-4], raw=False, strict_map_key=False)
    edit(body)
    return gen.wrap(msgpack.packb(body, use_bin_type=True), version=4)


def _partial(data: bytes, files: list[int], index_files: list[bytes] | None = None) -> mf.Manifest:
    index_files = index_files or _files()
    header = mf.decode_header(data)
    records = {i: mf.parse_index(header, i, _read_index(index_files)(header, i)) for i in files}
    return mf.with_chunks(header, records, partial=True)


def test_golden_v4_directory_encodes_decodes_and_loads_whole_or_by_file():
    want = gen.golden_manifest_v4()
    assert mf.encode(want) == _stored()
    m = load_manifest(V4)
    assert m == want and m.format_version == 4 and m.files_read is None
    assert {k: t.chunks for k, t in m.tensors.items()} == {k: t.chunks for k, t in gen.golden_manifest_v2().tensors.items()}
    body = msgpack.unpackb(_stored()[24:-4], raw=False, strict_map_key=False)
    assert body["meshes"] == [[[2], [0, 1]]] and body["tensors"]["model.w"]["where"] == ["grid", 0, [0]]
    # Which files a box needs: the grid cells it meets; every holder for a tensor listed by ranks.
    header = mf.decode_header(_stored())
    assert mf.files_for(header, "model.w", Box((0, 0), (2, 6))) == [0]
    assert mf.files_for(header, "model.w", Box((1, 0), (2, 6))) == [0, 1]
    assert mf.files_for(header, "opt.0.exp_avg", Box((0, 2), (2, 2))) == [1]
    assert mf.files_for(header, "step_t", Box((), ())) == [1]
    assert mf.files_for(header, "empty", Box((0, 0), (0, 3))) == []
    # File 0 alone: its chunks only, each grid cell of rank 0 exactly covered.
    p = _partial(_stored(), [0])
    assert p.files_read == frozenset({0})
    assert [c.file for c in p.tensors["model.w"].chunks] == [0]
    assert p.tensors["model.b"].chunks == m.tensors["model.b"].chunks
    assert p.tensors["step_t"].chunks == ()
    # A version-3 manifest has no where: every box needs every file, and no partial read exists.
    v3 = load_manifest(os.path.join(GOLDEN, "v3"))
    assert mf.files_for(v3, "model.w", Box((0, 0), (1, 1))) == [0, 1]
    with pytest.raises(ValueError, match="needs a version-4 manifest"):
        mf.with_chunks(mf.decode_header(open(os.path.join(GOLDEN, "v3", "MANIFEST"), "rb").read()), {}, partial=True)


def _set_where(fqn, value):
    def edit(body):
        body["tensors"][fqn]["where"] = value
    return edit


@pytest.mark.parametrize("edit,phrase", [
    (_set_where("model.w", ["grid", 3, [0]]), "mesh 3 does not exist"),
    (_set_where("model.w", ["grid", 0, [0, 1]]), "must give one tensor dimension per dimension of mesh 0"),
    (_set_where("model.w", ["grid", 0, [2]]), "must be distinct dimensions of the shape [4, 6]"),
    (_set_where("model.w", ["cells", 0]), "where must be ['grid', mesh, dims] or ['ranks'"),
    (_set_where("model.w", None), "where must be"),
    (_set_where("model.b", ["ranks", [[1, 1]]]), "must be sorted, disjoint, non-empty and inside [0, 2)"),
    (_set_where("model.b", ["ranks", [[1, 2], [0, 1]]]), "must be sorted, disjoint"),
    (_set_where("model.b", ["ranks", [[0, 3]]]), "inside [0, 2)"),
    (lambda b: b["tensors"]["model.b"].pop("where"), "missing keys ['where']"),
    (lambda b: b.pop("meshes"), "missing keys ['meshes']"),
    (lambda b: b.__setitem__("meshes", [[[3], [0, 1]]]), "has 3 coordinates, its ranks list 2"),
    (lambda b: b.__setitem__("meshes", [[[2], [0, 0]]]), "mesh ranks must be distinct ranks in [0, 2)"),
    (lambda b: b.__setitem__("meshes", [[[2], [0, 5]]]), "mesh ranks must be distinct ranks in [0, 2)"),
    (lambda b: b.__setitem__("meshes", [[[], []]]), "must be 1 to 64 positive integers"),
    (lambda b: b["files"][1].__setitem__("rank", 0), "two files of one rank"),
])
def test_a_hostile_where_or_mesh_is_refused_from_the_manifest_alone(edit, phrase):
    data = _edited(edit)
    with pytest.raises(ManifestCorruptError) as e:
        mf.decode_header(data)
    assert phrase in e.value.message, e.value.message
    with pytest.raises(ManifestCorruptError):
        mf.decode(data, read_index=_read_index(_files()))


@pytest.mark.parametrize("edit,files,phrase", [
    # The grid says model.w is cut on dim 1: file 0's chunk (rows 0-1, all columns) leaves its cell.
    (_set_where("model.w", ["grid", 0, [1]]), [0], "lies outside rank 0's cell"),
    (_set_where("model.w", ["grid", 0, [1]]), [0, 1], "lies outside rank 0's cell"),
    # model.b's chunk is in file 0, which the where does not list.
    (_set_where("model.b", ["ranks", [[1, 2]]]), [0], "rank 0 is not one of the tensor's holders"),
    # A mesh whose coordinates name the ranks the other way round.
    (lambda b: b.__setitem__("meshes", [[[2], [1, 0]]]), [1], "lies outside rank 1's cell"),
])
def test_a_where_the_indexes_contradict_is_refused_whole_and_partial(edit, files, phrase):
    data = _edited(edit)
    mf.decode_header(data)  # well formed: only the indexes show the lie
    with pytest.raises(ManifestCorruptError) as e:
        _partial(data, files)
    assert phrase in e.value.message, e.value.message
    with pytest.raises(ManifestCorruptError):
        mf.decode(data, read_index=_read_index(_files()))


def _rewrite_index(files: list[bytes], i: int, drop: str) -> tuple[list[bytes], bytes]:
    """Data file ``i`` without its chunk records of ``drop`` (a new index, its reference updated
    in a re-wrapped MANIFEST), so the crc32c checks pass and only the tiling can tell."""
    header = mf.decode_header(_stored())
    recs = [r for r in mf.parse_index(header, i, _read_index(files)(header, i)) if r[0] != drop]
    index = mf.encode_index(recs)
    off = header.files[i].index[0]
    files = list(files)
    files[i] = files[i][:off] + index

    def edit(body):
        body["files"][i]["size"] = len(files[i])
        body["files"][i]["index"] = [off, len(index), mf.crc32c(index)]
    return files, _edited(edit)


def test_a_read_file_that_does_not_cover_its_cell_is_refused_and_an_unread_one_is_not_judged():
    files, data = _rewrite_index(_files(), 1, "model.w")  # rank 1's cell of model.w is in no chunk
    with pytest.raises(ManifestCorruptError) as e:
        _partial(data, [1], files)
    assert "model.w" in e.value.message and "do not cover its cell" in e.value.message
    with pytest.raises(ManifestCorruptError, match="do not cover the shape"):
        mf.decode(data, read_index=_read_index(files))
    # Rank 0's reads never touch file 1: what they attach is exact, and file 1 is not judged.
    p = _partial(data, [0], files)
    assert [c.box for c in p.tensors["model.w"].chunks] == [Box((0, 0), (2, 6))]
    # A tensor listed by ranks is checked whole once its holders' files are all read.
    files, data = _rewrite_index(_files(), 0, "model.b")
    with pytest.raises(ManifestCorruptError, match="do not cover the shape"):
        _partial(data, [0], files)
    assert _partial(data, [1], files).tensors["model.b"].chunks == ()


@st.composite
def _grid_case(draw):
    nd = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=nd, max_size=nd)))
    mdims = draw(st.integers(1, min(2, nd)))
    dims = tuple(draw(st.permutations(range(nd)))[:mdims])
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=mdims, max_size=mdims)))
    ranks = tuple(draw(st.permutations(range(int(__import__("math").prod(mesh_shape))))))
    offsets = tuple(draw(st.integers(0, n)) for n in shape)
    sizes = tuple(draw(st.integers(0, n - o)) for n, o in zip(shape, offsets))
    return shape, mesh_shape, dims, ranks, Box(offsets, sizes)


@settings(max_examples=300, deadline=None)
@given(_grid_case())
def test_ranks_for_a_box_are_exactly_the_cells_it_meets(case):
    shape, mesh_shape, dims, ranks, box = case
    meshes = ((mesh_shape, ranks),)
    where = ("grid", 0, dims)
    assert wh.problem(where, meshes, shape, len(ranks)) is None
    brute = set()
    for k, coord in enumerate(itertools.product(*(range(n) for n in mesh_shape))):
        offsets, sizes = grid_box(shape, mesh_shape, dims, coord)
        cell = Box(offsets, sizes)
        assert wh.rank_cell(where, meshes, shape, ranks[k]) == cell
        if cell.volume and box.volume and intersect(cell, box) is not None:
            brute.add(ranks[k])
    assert wh.ranks_for(where, meshes, shape, box) == sorted(brute)


def test_ranges_and_holders():
    assert wh.ranges([5, 0, 1, 2, 7, 6, 2]) == ((0, 3), (5, 8))
    assert wh.ranges([]) == ()
    assert wh.holders(("ranks", ((0, 3), (5, 8))), ()) == [0, 1, 2, 5, 6, 7]
    assert wh.holders(("grid", 0, (0,)), (((2,), (3, 1)),)) == [1, 3]


def test_a_load_reads_by_boxes_unless_a_tensor_is_spread_over_most_files_without_a_grid():
    """distckpt.source decides from the MANIFEST alone (the same on every rank, no collective):
    each rank reads its own indexes, unless some tensor listed by ranks has more than half of the
    files as holders (then rank 0 reads every index once and broadcasts them, as before)."""
    from distckpt.source import _by_boxes
    assert _by_boxes(mf.decode_header(_stored()))  # grids, and tensors held by one file of two
    assert not _by_boxes(mf.decode_header(_edited(_set_where("model.b", ["ranks", [[0, 2]]]))))
    with open(os.path.join(GOLDEN, "v3", "MANIFEST"), "rb") as f:
        assert not _by_boxes(mf.decode_header(f.read()))


def test_encode_next_writes_what_encode_writes_and_checks_what_changed():
    """mf.encode_next (the commit of a save whose plan reuses the last layout) gives the bytes
    mf.encode gives for the whole new manifest, and validates every field it replaces, against
    the new files (nothing derived from the previous manifest's files survives)."""
    import dataclasses

    first = gen.golden_manifest_v4()
    enc = mf.encode_manifest(first)
    assert enc.data == mf.encode(first) == _stored()
    files = tuple(dataclasses.replace(f, size=f.size + 8192, index=(f.index[0] + 8192, f.index[1], i + 7))
                  for i, f in enumerate(first.files))
    objects = dict(first.objects, step=mf.ObjectEntry("int", 101), name=mf.ObjectEntry("str", "next run"))
    meta = {"io_backend": "uring", "user": {"xs": (1, [2, (3,)])}}  # tuples written as lists, as encode does
    fields = dict(save_id="b" * 32, created_unix=1234, files=files, objects=objects, meta=meta)
    nxt = mf.encode_next(enc, **fields)
    assert nxt.data == mf.encode(dataclasses.replace(first, **fields))
    back = mf.decode_header(nxt.data)
    assert back.files == files and back.objects == objects and back.save_id == "b" * 32
    assert mf.encode_next(nxt, **dict(fields, save_id="c" * 32)).data == mf.encode(
        dataclasses.replace(first, **dict(fields, save_id="c" * 32)))       # chained: the sections carry over

    bad = [
        dict(files=files[:1]),                                           # the mesh's rank 1 has no file
        dict(files=(files[0], dataclasses.replace(files[1], rank=2))),   # a rank outside the world
        dict(files=(files[0], dataclasses.replace(files[1], index=(2**40, 91, 0)))),  # index past the end
        dict(objects=dict(objects, step=mf.ObjectEntry("int", 2**64))),  # not a 64-bit int
        dict(objects=dict(objects, step=mf.ObjectEntry("bytes", "x"))),  # a value of another kind
        dict(meta={"x": object()}),                                      # meta not plain data
        dict(objects={k: v for k, v in objects.items() if k != "step"}),  # the tree names "step" still
        dict(created_unix=float("nan")),
    ]
    for edit in bad:
        with pytest.raises(ValueError, match="refusing to encode an invalid manifest"):
            mf.encode_next(enc, **dict(fields, **edit))
