"""Which steps keep_last rotation may delete: the rule every root and tier rotates by.

A step is kept when it is among the newest ``keep_last`` by number *or* among the newest
``keep_last`` by commit time (its MANIFEST's ``created_unix``, ties by number: the order
``latest`` and ``load()`` use). Number alone was not enough: after a rollback (load step 450 of
450/480/500, save 460 and 470) the resumed branch is numbered below the abandoned one, and a
count by number deleted the newest trained states (460, 470) while the abandoned 480 and 500
stayed, so a later fallback loaded the abandoned branch. Commit time alone would trust clocks
across jobs (a new job's clock running behind would rotate away its own newest numbers): the
union keeps both promises. With the jobs' clocks in step it converges: once the abandoned steps
fall below the newest numbers they are the oldest commits too, and go. (Commit times are wall
clocks: a job whose clock runs behind the abandoned one's sees its own steps as older, as
``latest`` does.)

A step whose commit time is unknown (its MANIFEST could not be read: a timeout, a refusal) is
kept and counts as newer than no other step, so an unknown time can only keep more. A step
whose MANIFEST is known damaged is no newer than any other (:data:`DAMAGED`): numbers alone
decide it, as before commit times counted, so a damaged step never stays for good.
"""

from __future__ import annotations

import bisect
from typing import Callable, Iterable

__all__ = ["beyond_keep_last", "DAMAGED"]

#: What ``commit_time`` returns for a step whose MANIFEST is known damaged (it never loads).
DAMAGED = float("-inf")


def beyond_keep_last(steps: Iterable[int], keep_last: int,
                     commit_time: Callable[[int], float | None]) -> tuple[list[int], list[int]]:
    """Split ``steps`` (one branch of a root) for a rotation keeping ``keep_last`` (>= 1).

    Returns ``(doomed, kept_by_time)``, both ascending: ``doomed`` are the steps outside the
    newest ``keep_last`` by number and outside the newest ``keep_last`` by commit time (at least
    ``keep_last`` steps are known to be committed after each); ``kept_by_time`` are those outside
    the newest by number that a known commit time keeps (to report; a step of unknown time is
    kept too, in neither list). ``commit_time(step)`` is called only when some step lies outside
    the newest by number, once per step, newest number first; None means unknown,
    :data:`DAMAGED` known damaged. Never raises but what ``commit_time`` raises."""
    ordered = sorted(set(steps))
    beyond = ordered[:-keep_last]
    if not beyond:
        return [], []
    times = {s: commit_time(s) for s in reversed(ordered)}
    known = sorted((t, s) for s, t in times.items() if t is not None)
    doomed, by_time = [], []
    for s in beyond:
        t = times[s]
        if t is None:
            continue
        newer = len(known) - bisect.bisect_right(known, (t, s))
        (doomed if newer >= keep_last else by_time).append(s)
    return doomed, by_time
