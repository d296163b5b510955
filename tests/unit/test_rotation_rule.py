"""distckpt.rotation.beyond_keep_last: the keep_last rule every root and tier rotates by."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from distckpt.rotation import DAMAGED, beyond_keep_last


def test_a_rollback_keeps_the_newest_commits_and_the_newest_numbers():
    times = {450: 1.0, 480: 2.0, 500: 3.0, 460: 4.0, 470: 5.0, 510: 6.0}
    doomed, by_time = beyond_keep_last(times, 2, times.get)
    assert doomed == [450, 460, 480] and by_time == [470]


def test_nothing_beyond_keep_last_reads_no_commit_time():
    def never(step):
        raise AssertionError("read")
    assert beyond_keep_last([1, 2], 2, never) == ([], [])


def test_an_unknown_time_is_kept_and_counts_as_newer_than_nothing():
    times = {1: 1.0, 2: None, 3: 3.0, 4: 4.0}
    doomed, by_time = beyond_keep_last(times, 2, times.get)
    assert doomed == [1] and by_time == []  # 2 is kept, in neither list
    # Were 2's unknown time counted as newer, 1 would have 3 newer; it has 2 known: still doomed.
    times = {1: 5.0, 2: None, 3: 3.0, 4: 4.0}
    assert beyond_keep_last(times, 2, times.get) == ([], [1])


def test_a_damaged_step_goes_by_its_number_alone():
    """A MANIFEST known damaged never loads: it must not stay for good as an unknown time would
    (it also stopped every later deletion on a local root, whose chain check could not read it)."""
    times = {1: DAMAGED, 2: 2.0, 3: 3.0}
    assert beyond_keep_last(times, 2, times.get) == ([1], [])
    times = {1: 1.0, 2: 2.0, 3: DAMAGED}
    assert beyond_keep_last(times, 2, times.get) == ([], [1])  # 3 kept by number; 1 and 2 by time


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.integers(0, 40), st.one_of(st.none(), st.just(DAMAGED), st.integers(0, 10).map(float)), max_size=12),
       st.integers(1, 5))
def test_doomed_is_exactly_what_neither_order_keeps(times, keep):
    doomed, by_time = beyond_keep_last(times, keep, times.get)
    steps = sorted(times)
    newest_numbers = set(steps[-keep:])
    known = sorted((t, s) for s, t in times.items() if t is not None)
    newest_commits = {s for _, s in known[-keep:]}
    unknown = {s for s, t in times.items() if t is None}
    assert set(doomed) | set(by_time) == set(steps) - newest_numbers - unknown
    assert not set(doomed) & (newest_numbers | newest_commits | unknown)
    # Everything else goes: each doomed step has at least keep known commits after it.
    assert set(doomed) == set(steps) - newest_numbers - newest_commits - unknown
