"""distckpt.datafile.write_order: the order in which a data file's pieces are written."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from distckpt.datafile import write_order

MiB = 1 << 20


def test_small_pieces_fill_the_gaps_after_the_large_ones():
    # 3 large pieces after 6 small ones (the order a state's flattening may give).
    sizes = [MiB] * 6 + [64 * MiB] * 3
    order = write_order(sizes, 8 * MiB)
    assert order == [6, 0, 1, 7, 2, 3, 8, 4, 5]


def test_the_pieces_order_without_held_writes_or_large_pieces():
    sizes = [MiB, 64 * MiB, 2 * MiB, 64 * MiB]
    assert write_order(sizes, 0) == [0, 1, 2, 3]               # a sink that holds nothing
    assert write_order(sizes, 128 * MiB) == [0, 1, 2, 3]       # nothing large enough
    assert write_order([], 8 * MiB) == []


def test_shares_follow_bytes_not_counts():
    # One small piece as large as the other four together: it fills the first gap alone.
    sizes = [64 * MiB, 64 * MiB, 4 * MiB, MiB, MiB, MiB, MiB]
    assert write_order(sizes, 8 * MiB) == [0, 2, 1, 3, 4, 5, 6]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=60), st.sampled_from([0, 8, 16, 41]))
def test_a_permutation_keeping_each_class_in_order(sizes, hold_min):
    order = write_order(sizes, hold_min)
    assert sorted(order) == list(range(len(sizes)))
    large = [i for i in order if hold_min and sizes[i] >= hold_min]
    small = [i for i in order if i not in large]
    assert large == sorted(large) and small == sorted(small)
    if large:
        assert order[0] == large[0]          # the disk starts on a large piece
        # after the k-th large piece, at least k/L of the small pieces' bytes (rounded down) are placed
        total = sum(sizes[i] for i in small)
        for k, i in enumerate(large, 1):
            before = order[:order.index(large[k]) if k < len(large) else len(order)]
            placed = sum(sizes[j] for j in before if j in small)
            assert placed >= total * k // len(large)
    else:
        assert order == list(range(len(sizes)))
