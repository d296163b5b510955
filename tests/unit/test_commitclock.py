"""distckpt.commitclock: commit stamps that never go back under a root, whatever the wall clock does."""

from __future__ import annotations

import time

import pytest

from distckpt import commitclock

pytestmark = pytest.mark.unit


def test_stamps_follow_the_newest_known_time_of_their_root_only(monkeypatch):
    now = [1_000_000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    monkeypatch.setattr(commitclock, "_FLOOR", {})
    assert commitclock.stamp("/r1") == 1_000_000.0  # nothing known: the wall clock
    commitclock.observe("/r1/", 1_000_500.0)  # a step committed by a host 500 s ahead
    commitclock.observe("/r1", None)  # unknown: ignored
    commitclock.observe("/r1", 10.0)  # older: ignored
    first = commitclock.stamp("/r1")
    second = commitclock.stamp("/r1")
    assert first == pytest.approx(1_000_500.0 + commitclock.TICK) and second > first
    assert commitclock.stamp("/r2") == 1_000_000.0  # another root: its own floor
    now[0] = 2_000_000.0  # the clock passed the floor: the wall clock again
    assert commitclock.stamp("/r1") == 2_000_000.0
    now[0] = 1_500_000.0  # and went back: never before the last stamp
    assert commitclock.stamp("/r1") > 2_000_000.0


def test_a_time_more_than_a_year_ahead_is_not_followed(monkeypatch):
    """A MANIFEST whose first bytes claim a time far ahead (damaged or forged; the peek checks no
    checksum) pushed every later commit of its root there: one claiming the year 9999 made every
    later save fail (its stamp passed the MANIFEST's last valid time)."""
    monkeypatch.setattr(time, "time", lambda: 1_000_000.0)
    monkeypatch.setattr(commitclock, "_FLOOR", {})
    commitclock.observe("/r", 253402300799.9)
    commitclock.observe("/r", 1_000_000.0 + commitclock.MAX_AHEAD_S + 1)
    assert commitclock.stamp("/r") == 1_000_000.0
    commitclock.observe("/r", 1_000_000.0 + 86400)  # a clock a day ahead is followed
    assert commitclock.stamp("/r") == pytest.approx(1_000_000.0 + 86400 + commitclock.TICK)
