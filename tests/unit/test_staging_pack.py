"""The packing of async staging memory (distckpt.staging.pool): segments reserved for a state's
pieces hold those pieces exactly, in any order the save lists them, without overlap, aligned as
the O_DIRECT writer needs, and no segment is larger than 64 MiB unless one piece is."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from distckpt.staging.pool import _CHUNK, _PAGE, _pack, _piece_align, _place

sizes_st = st.lists(st.one_of(st.integers(0, 5000), st.integers(60 << 10, 70 << 10),
                              st.integers(1 << 20, 40 << 20), st.integers(_CHUNK - 4096, _CHUNK + 8192)),
                    min_size=1, max_size=60)


def _check(sizes, caps, placed, cursors):
    spans = {}
    for n, p in zip(sizes, placed):
        if n == 0 and not caps:
            continue  # nothing to stage at all: stage() returns before placing
        assert p is not None, "a reserved piece did not fit its reservation"
        seg, off = p
        assert off % _piece_align(n) == 0 and off + n <= caps[seg]
        spans.setdefault(seg, []).append((off, off + n))
    for seg, ss in spans.items():
        ss.sort()
        assert all(a[1] <= b[0] for a, b in zip(ss, ss[1:])), "pieces overlap"
    assert all(c <= cap for c, cap in zip(cursors, caps))


@settings(max_examples=300, deadline=None)
@given(sizes_st, st.randoms(use_true_random=False))
def test_a_reservation_holds_its_pieces_in_any_order(sizes, rnd):
    caps = _pack(sizes)
    assert all(c % _PAGE == 0 for c in caps)
    assert all(c <= max(_CHUNK, -(-max(sizes) // _PAGE) * _PAGE) for c in caps)
    # Padding only: at most one alignment gap per piece and one page per segment.
    assert sum(caps) <= sum(n + _PAGE - 1 for n in sizes) + len(caps) * _PAGE
    _check(sizes, caps, *_place(sizes, caps))
    shuffled = list(sizes)
    rnd.shuffle(shuffled)
    _check(shuffled, caps, *_place(shuffled, caps))


def test_pieces_that_do_not_fit_are_reported():
    placed, cursors = _place([100, 5000, 200], [4096])
    assert placed[1] is None and placed[0] is not None and placed[2] is not None
    assert _place([], [4096]) == ([], [0])


def test_an_overflow_that_cannot_be_allocated_gives_the_idle_segments_back(monkeypatch):
    """take() with reserved segments too small for the save and an overflow segment that cannot
    be allocated (out of memory): the error propagates, and the segments it took go back to the
    pool, so in_use_bytes() returns to 0 and the next reservation is not quietly skipped."""
    import pytest

    from distckpt.staging import pool as pool_mod
    pool = pool_mod.StagingPool()
    res = pool.reserve([1 << 20], pin=False)
    assert res.wait(30) and res.error is None
    held = pool.held_bytes()
    assert held >= 1 << 20 and pool.in_use_bytes() == 0
    real = pool_mod.Segment

    def no_memory(capacity, *, pin, prefault):
        raise MemoryError("no room for the overflow")

    monkeypatch.setattr(pool_mod, "Segment", no_memory)
    with pytest.raises(MemoryError):
        pool.take([1 << 20, 4 << 20])  # the second piece needs an overflow segment
    monkeypatch.setattr(pool_mod, "Segment", real)
    assert pool.in_use_bytes() == 0
    assert pool.held_bytes() == held  # the reserved segment is idle again
    pool.clear()
