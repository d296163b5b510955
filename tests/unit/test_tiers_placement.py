"""Where peer replicas go and how they are exchanged (distckpt.tiers.peers), on synthetic layouts
of up to 5 nodes x 3 ranks: each file gets min(k, nodes - 1) copies on distinct nodes other than
its writer's; the room check's replica bytes per node equal what the placement sends there; the
rounds give each rank at most one send and one receive; a fetch names every missing file's holder
or reports it as held nowhere."""

from __future__ import annotations

import types

from hypothesis import given, settings, strategies as st

from distckpt.tiers.nodes import NodeLayout
from distckpt.tiers.peers import fetch_transfers, replica_bytes_of_node, replica_transfers, schedule, unreplicated


def _layout(per_node: list[int]) -> NodeLayout:
    node_of = tuple(n for n, k in enumerate(per_node) for _ in range(k))
    leaders = tuple(node_of.index(n) for n in range(len(per_node)))
    return NodeLayout(rank=0, node_of=node_of, leaders=leaders)


layouts = st.lists(st.integers(1, 3), min_size=1, max_size=5)


@settings(max_examples=200, deadline=None)
@given(layouts, st.integers(0, 5), st.data())
def test_replicas_land_on_other_nodes_and_the_room_check_counts_them(per_node, k, data):
    layout = _layout(per_node)
    world, nodes = len(layout.node_of), len(per_node)
    sizes = data.draw(st.lists(st.integers(0, 1 << 30), min_size=world, max_size=world))
    header = types.SimpleNamespace(files=[types.SimpleNamespace(rank=r) for r in range(world)])
    held = [frozenset(r for r in range(world) if layout.node_of[r] == n) for n in range(nodes)]
    transfers = replica_transfers(layout, header, held, k)
    copies = {i: {layout.node_of[t.dst] for t in transfers if t.file == i} for i in range(world)}
    for i in range(world):
        home = layout.node_of[i]
        assert home not in copies[i] and len(copies[i]) == min(k, nodes - 1), (i, copies[i])
    for t in transfers:
        assert layout.node_of[t.src] == layout.node_of[t.file]  # sent by a rank of the writer's node
    for n in range(nodes):
        into = sum(sizes[t.file] for t in transfers if layout.node_of[t.dst] == n)
        assert replica_bytes_of_node(layout, sizes, k, n) == into
    rounds = schedule(transfers)
    assert sorted(t for r in rounds for t in r) == sorted(transfers)
    for r in rounds:
        assert len({t.src for t in r}) == len(r) == len({t.dst for t in r})


@settings(max_examples=200, deadline=None)
@given(layouts, st.data())
def test_a_fetch_names_a_holder_for_every_file_or_reports_it(per_node, data):
    layout = _layout(per_node)
    world, nodes = len(layout.node_of), len(per_node)
    held = [frozenset(data.draw(st.sets(st.integers(0, world - 1)))) for _ in range(nodes)]
    wanted = [set(data.draw(st.sets(st.integers(0, world - 1)))) - held[layout.node_of[r]] for r in range(world)]
    transfers, nowhere = fetch_transfers(layout, wanted, held)
    for r in range(world):
        node = layout.node_of[r]
        for i in wanted[r]:
            got = [t for t in transfers if t.file == i and layout.node_of[t.dst] == node]
            if any(i in held[n] for n in range(nodes) if n != node):
                assert len(got) == 1 and i in held[layout.node_of[got[0].src]], (r, i, got)
            else:
                assert i in nowhere and not got


@settings(max_examples=300, deadline=None)
@given(layouts, st.integers(0, 5), st.integers(0, 4), st.data())
def test_replicas_of_files_held_off_their_writers_node(per_node, k, extra, data):
    # Ranks placed on other nodes at a restart, or a step saved by more ranks than this job has
    # (files of writers not in it): every file some node holds gets its copies from a node that
    # holds it; what no node holds is named by unreplicated(), never counted as replicated.
    layout = _layout(per_node)
    world, nodes = len(layout.node_of), len(per_node)
    nfiles = world + extra
    header = types.SimpleNamespace(files=[types.SimpleNamespace(rank=r) for r in range(nfiles)])
    held = [frozenset(data.draw(st.sets(st.integers(0, nfiles - 1)))) for _ in range(nodes)]
    transfers = replica_transfers(layout, header, held, k)
    want = min(k, nodes - 1) + 1
    for t in transfers:
        assert t.file in held[layout.node_of[t.src]] and t.file not in held[layout.node_of[t.dst]]
    assert len(set(transfers)) == len(transfers)
    for i in range(nfiles):
        holders = {n for n in range(nodes) if i in held[n]}
        after = holders | {layout.node_of[t.dst] for t in transfers if t.file == i}
        if holders:
            assert len(after) >= want, (i, holders, after)
    short = unreplicated(layout, nfiles, held, transfers, k)
    assert short == [i for i in range(nfiles) if not any(i in h for h in held)]
