"""Rank 0's read-once plan (distckpt.readonce.assign) and its switch, without a process group."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distckpt.config import load_config
from distckpt.errors import ConfigError
from distckpt.readonce import FAN_OUT, assign

MiB = 1 << 20


def test_replicas_split_the_reads_evenly_and_every_receiver_hears_from_its_reader():
    keys = [(f, o * 4 * MiB, (o + 1) * 4 * MiB) for f in range(2) for o in range(8)]   # 16 segments
    moves = assign([keys] * 4)   # DDP: every rank needs every segment
    reads = [sum(m.key[2] - m.key[1] for m in ms if m.src == r) for r, ms in enumerate(moves)]
    assert reads == [16 * MiB] * 4
    for r, ms in enumerate(moves):
        assert [m.key for m in ms] == sorted(keys)   # every shared key, in the global order
    for i in range(len(keys)):
        tree = {r: moves[r][i] for r in range(4)}
        reader = tree[0].reader
        # The reader sends FAN_OUT copies; the fourth rank hears from a relay, not from it.
        assert tree[reader].src == reader and len(tree[reader].dst) == FAN_OUT
        assert sorted(d for m in tree.values() for d in m.dst) == sorted(set(range(4)) - {reader})
        assert all(tree[d].src == r for r, m in tree.items() for d in m.dst)


def test_a_key_one_rank_needs_is_not_moved_and_counts_against_its_reads():
    own = [(0, 0, 64 * MiB)]   # rank 0 alone reads 64 MiB
    shared = [(1, i * MiB, (i + 1) * MiB) for i in range(4)]
    moves = assign([own + shared, shared])
    assert all(m.key != own[0] for ms in moves for m in ms)
    assert all(m.src == 1 for m in moves[1]), moves   # rank 0 is busy with its own bytes


def test_a_rank_without_keys_takes_no_part():
    k = (0, 0, 4096)
    moves = assign([[k], None, [k]])
    assert moves[1] == [] and len(moves[0]) == len(moves[2]) == 1
    (a,), (b,) = moves[0], moves[2]
    assert a.reader == b.reader in (0, 2)
    reader, other = (a, b) if a.reader == 0 else (b, a)
    assert reader.dst == (2 if reader is a else 0,) and other.src == reader.reader and other.dst == ()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sets(st.tuples(st.integers(0, 3), st.integers(0, 7)), max_size=12), min_size=1, max_size=6))
def test_every_shared_key_has_one_reader_among_those_that_need_it(needs):
    keys = [[(f, o * 1024, (o + 1) * 1024) for f, o in sorted(n)] for n in needs]
    moves = assign(keys)
    holders = {}
    for r, ks in enumerate(keys):
        for k in ks:
            holders.setdefault(k, set()).add(r)
    shared = {k: rs for k, rs in holders.items() if len(rs) > 1}
    tags, edges = {}, {}
    for r, ms in enumerate(moves):
        assert [m.key for m in ms] == sorted(k for k in shared if r in shared[k])
        for m in ms:
            assert m.reader in shared[m.key] and tags.setdefault(m.key, (m.tag, m.reader)) == (m.tag, m.reader)
            assert len(m.dst) <= FAN_OUT and (m.src == r) == (m.reader == r)
            for d in m.dst:
                edges.setdefault(m.key, []).append((r, d))
    assert len({t for t, _ in tags.values()}) == len(tags)   # one tag per key
    for k, rs in shared.items():
        # A tree: every rank but the reader has exactly one parent, and it is reached from the reader.
        kids = {}
        for a, b in edges.get(k, []):
            kids.setdefault(a, []).append(b)
        seen, todo = set(), [tags[k][1]]
        while todo:
            x = todo.pop()
            seen.add(x)
            todo.extend(kids.get(x, []))
        assert seen == rs and len(edges[k]) == len(rs) - 1


def test_the_switch():
    assert load_config({}).read_once == "auto"
    assert load_config({"DISTCKPT_READ_ONCE": "off"}).read_once == "off"
    with pytest.raises(ConfigError, match="DISTCKPT_READ_ONCE"):
        load_config({"DISTCKPT_READ_ONCE": "yes"})
