"""Async staging segments reserved ahead ask for transparent huge pages; the overflow segment a
save faults in on the caller's path does not (distckpt/staging/pool.py, ``_mapping``). Read back
from the kernel's own account of the process's mappings (/proc/self/smaps)."""

from __future__ import annotations

import gc

import pytest

from distckpt.checks.memory import huge_pages_check
from distckpt.staging.pool import Segment

MIB = 1 << 20


def _thp_mode() -> str | None:
    """The kernel's THP mode for 2 MiB pages, as the preflight check reads it."""
    return huge_pages_check({}).details["mode"]


def _mapping_of(addr: int) -> dict:
    """The /proc/self/smaps entry holding ``addr``: perms and its numeric fields."""
    found: dict | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if fields and "-" in fields[0] and not fields[0].endswith(":"):
                if found is not None:
                    break
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo <= addr < hi:
                    found = {"perms": fields[1], "path": fields[5] if len(fields) > 5 else ""}
            elif found is not None and fields[0].endswith(":") and len(fields) >= 2 and fields[1].isdigit():
                found[fields[0][:-1]] = int(fields[1])
    assert found is not None, hex(addr)
    return found


@pytest.mark.skipif(_thp_mode() != "madvise", reason="needs THP in madvise mode (then only memory that asks "
                    "is eligible); 'always' makes every mapping eligible and 'never' none")
def test_reserved_segments_ask_for_huge_pages_and_the_overflow_does_not():
    reserved = Segment(6 * MIB, pin=False, prefault=True)
    m = _mapping_of(reserved.buf.data_ptr())
    # Private anonymous memory (mmap(-1, n) alone would be shared: shmem, never huge pages here).
    assert m["perms"] == "rw-p" and not m["path"] and m["THPeligible"] == 1, m
    assert reserved.buf.data_ptr() % 4096 == 0 and bool((reserved.buf[::MIB] == 0).all())
    overflow = Segment(6 * MIB, pin=False, prefault=False)
    m = _mapping_of(overflow.buf.data_ptr())
    assert m["perms"] == "rw-p" and m["THPeligible"] == 0, m
    reserved.free()
    overflow.free()


def test_a_freed_segment_stays_mapped_while_a_view_of_it_lives():
    seg = Segment(4 * MIB, pin=False, prefault=True)
    view = seg.buf[4096:8192]
    seg.free()
    gc.collect()
    # As torch memory is freed: with its last view (a staged piece may still point into it).
    view.fill_(5)
    assert int(view.sum()) == 5 * 4096 and _mapping_of(view.data_ptr())["perms"] == "rw-p"
    empty = Segment(0, pin=False, prefault=True)
    assert empty.buf.numel() == 0
