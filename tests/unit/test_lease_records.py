"""Which save-lease records count as live (distckpt.storage.object.lease.Lease.is_live): a record a
distckpt writer makes while its save runs, and nothing else. A crafted or damaged record (a renewal
time far in the future, a lease of 1e300 s or Infinity, a save id that is not a string) once
counted as live for ever: every drain to that root retried until someone deleted it by hand."""

from __future__ import annotations

import math

import pytest

from distckpt.storage.object.lease import MAX_LEASE_S, Lease

NOW = 1_800_000_000.0


def _rec(**kw):
    return {"host": "h", "pid": 1, "save_id": "f" * 32, "what": "x", "started_unix": NOW - 10,
            "renewed_unix": NOW - 5, "lease_s": 30, "beat": 3, **kw}


def test_a_running_saves_record_is_live_and_a_lapsed_one_is_not():
    assert Lease.is_live(_rec(), NOW)
    assert Lease.is_live(_rec(renewed_unix=NOW + 5), NOW)  # a writer's clock a little ahead
    # more than a lease ahead: still live (a live lease is never judged dead for its writer's clock)
    assert Lease.is_live(_rec(renewed_unix=NOW + 300), NOW)
    assert not Lease.is_live(_rec(renewed_unix=NOW - 31), NOW)
    assert Lease.is_live(_rec(lease_s=MAX_LEASE_S, renewed_unix=NOW - MAX_LEASE_S + 1), NOW)


@pytest.mark.parametrize("fields", [
    {"renewed_unix": NOW + 1e9},            # far ahead of any clock: would never lapse
    {"renewed_unix": NOW + MAX_LEASE_S + 1},  # ahead by more than any lease lasts
    {"lease_s": 1e300},
    {"lease_s": math.inf},
    {"lease_s": math.nan},
    {"renewed_unix": math.inf},
    {"lease_s": MAX_LEASE_S + 1},
    {"lease_s": 0},
    {"lease_s": -5},
    {"save_id": ["a"]},
    {"save_id": None},
])
def test_records_no_writer_makes_are_dead(fields):
    assert not Lease.is_live(_rec(**fields), NOW)


def test_unreadable_records_are_dead():
    for rec in ({}, {"save_id": "a"}, {"save_id": "a", "renewed_unix": NOW}, {"save_id": "a", "lease_s": 30},
                {"save_id": "a", "renewed_unix": "soon", "lease_s": 30}):
        assert not Lease.is_live(rec, NOW)


def test_live_by_this_clock_or_by_the_servers():
    """A reader whose clock runs 30 minutes ahead of the writer's: live by the server's clock (the
    object's age, 2 s), which this clock alone judged dead, letting a save take over a live lease
    and reclaim its data. A one-second lease renewed 0.3 s ago whose whole-second server dates say
    1 s: live by this clock. Lapsed by both: dead. A record written just now but claiming a
    renewal at the epoch: no writer's (a day off the server's time)."""
    ahead = NOW + 1800
    assert not Lease.is_live(_rec(), ahead)
    assert Lease.is_live(_rec(), ahead, age_s=2.0, server_now=NOW - 3)
    assert Lease.is_live(_rec(lease_s=1, renewed_unix=NOW - 0.3), NOW, age_s=1.0, server_now=NOW)
    assert not Lease.is_live(_rec(renewed_unix=NOW - 40), NOW, age_s=40.0, server_now=NOW)
    assert not Lease.is_live(_rec(renewed_unix=0.0), NOW, age_s=0.0, server_now=NOW)
