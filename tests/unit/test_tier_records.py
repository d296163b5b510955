"""The drained record a node's local tier keeps of its remote tier (distckpt.tiers.records): what
it spares is only ever a drain, so anything it cannot vouch for counts as not recorded."""

from __future__ import annotations

import pytest

from distckpt.storage import open_store
from distckpt.tiers.records import DRAINED_RECORD_NAME, read_drained, record_drained

TIER = "a" * 32
ROOT = "s3://bucket/run7"


def _sid(n: int) -> str:
    return f"{n:032x}"


def test_recorded_saves_read_back_and_steps_gone_from_the_local_tier_are_dropped(tmp_path):
    store = open_store(str(tmp_path))
    record_drained(store, str(tmp_path), TIER, ROOT, 1, _sid(1), present={1})
    record_drained(store, str(tmp_path), TIER, ROOT, 2, _sid(2), present={1, 2})
    assert read_drained(store, str(tmp_path), TIER, ROOT) == {1: _sid(1), 2: _sid(2)}
    record_drained(store, str(tmp_path), TIER, ROOT, 3, _sid(3), present={2, 3})  # step 1 rotated away locally
    assert read_drained(store, str(tmp_path), TIER, ROOT) == {2: _sid(2), 3: _sid(3)}
    record_drained(store, str(tmp_path), TIER, ROOT, 3, _sid(33), present={2, 3})  # saved again, drained again
    assert read_drained(store, str(tmp_path), TIER, ROOT) == {2: _sid(2), 3: _sid(33)}


def test_the_record_stays_within_what_a_pointer_read_returns_dropping_the_lowest_steps(tmp_path):
    store = open_store(str(tmp_path))
    steps = range(200)
    for s in steps:
        record_drained(store, str(tmp_path), TIER, ROOT, s, _sid(s), present=set(steps))
    assert (tmp_path / DRAINED_RECORD_NAME).stat().st_size <= 4096
    got = read_drained(store, str(tmp_path), TIER, ROOT)
    assert 50 < len(got) < 200 and max(got) == 199 and got == {s: _sid(s) for s in range(min(got), 200)}


@pytest.mark.parametrize("body", [
    f"{'b' * 32}\n{ROOT}\n1 {_sid(1)}\n",              # another tier: the tiers were paired anew since
    f"{TIER}\ns3://bucket/other\n1 {_sid(1)}\n",      # another remote root (given a new, empty one)
    f"{TIER}\n1 {_sid(1)}\n",                          # no root line
    f"{TIER}\n{ROOT}\n1 {_sid(1)}\nnot a line\n",     # damaged
    f"{TIER}\n{ROOT}\n-1 {_sid(1)}\n",
    f"{TIER}\n{ROOT}\n1 ../../x\n",
    "",
])
def test_a_record_it_cannot_vouch_for_spares_nothing(tmp_path, body):
    (tmp_path / DRAINED_RECORD_NAME).write_text(body)
    store = open_store(str(tmp_path))
    assert read_drained(store, str(tmp_path), TIER, ROOT) == {}
    record_drained(store, str(tmp_path), TIER, ROOT, 5, _sid(5), present={1, 5})  # starts afresh
    assert read_drained(store, str(tmp_path), TIER, ROOT) == {5: _sid(5)}


def test_no_paired_tier_or_an_unreadable_record_is_empty(tmp_path):
    store = open_store(str(tmp_path))
    assert read_drained(store, str(tmp_path), None, ROOT) == {}
    (tmp_path / DRAINED_RECORD_NAME).mkdir()  # not a file: a StorageError inside, logged
    assert read_drained(store, str(tmp_path), TIER, ROOT) == {}
