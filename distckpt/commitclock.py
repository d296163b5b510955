"""Commit times that order a root's steps even when the hosts' clocks disagree.

A manager's newest step is the newest by commit time (the MANIFEST's ``created_unix``), not by
number: after a rollback (a job resumed from step 5 while steps 6-8 of the abandoned branch
remain) the resumed branch's steps are numbered below the abandoned ones and must win. Rank 0
takes the time from its own clock. A job restarted on a host whose clock runs behind the one
that committed the step it resumed from would stamp its new steps before that step: the next
restart loads the older step, silently. (A clock ahead does the same to the job after it.)

So a commit into a root is stamped no earlier than :data:`TICK` after the newest commit time
known under that root in this process: a Lamport clock on top of the wall clock. A manager makes
its root's newest commit time known before its first save (:func:`observe`: it reads every step's
time once); each commit stamped here is known from then on. With clocks in step the stamp is the
wall clock's time; with a clock behind, the steps committed until it catches up are stamped a
millisecond apart after the newest one (``distckpt ls`` then shows those times, not the host's).

Thread-safe; per process (each root's floor lives where its commits are stamped: rank 0).
"""

from __future__ import annotations

import threading
import time

__all__ = ["observe", "stamp", "TICK", "MAX_AHEAD_S"]

#: How far after the newest known commit time a commit is stamped at least (seconds).
TICK = 0.001
#: A commit time further ahead of this host's clock than this is not followed (:func:`observe`):
#: no clock is a year off, and a MANIFEST whose first bytes claim such a time (damaged, or forged)
#: would push every later commit there (up to the year 10000, where a MANIFEST's time ends).
MAX_AHEAD_S = 366 * 86400.0

_FLOOR: dict[str, float] = {}
_LOCK = threading.Lock()


def _key(root: str) -> str:
    return root.rstrip("/") or "/"


def observe(root: str, t: float | None) -> None:
    """Make ``t`` (a commit time read under ``root``; None: unknown, ignored) known: later
    commits into ``root`` are stamped after it. A time more than :data:`MAX_AHEAD_S` ahead of
    this host's clock is ignored."""
    if t is None or t > time.time() + MAX_AHEAD_S:
        return
    with _LOCK:
        k = _key(root)
        if t > _FLOOR.get(k, float("-inf")):
            _FLOOR[k] = t


def stamp(root: str) -> float:
    """The commit time of a commit into ``root`` now: the wall clock, or :data:`TICK` after the
    newest commit time known under ``root`` if the clock is not past it. Known from then on."""
    with _LOCK:
        k = _key(root)
        t = max(time.time(), _FLOOR.get(k, float("-inf")) + TICK)
        _FLOOR[k] = t
        return t
