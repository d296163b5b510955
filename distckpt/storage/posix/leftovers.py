"""The hidden entries saves leave beside a local checkpoint, whether their saves still live, and
their reclaim.

A save of ``PARENT/NAME`` works in ``PARENT/.NAME.tmp-<save id>`` and holds ``PARENT/.NAME.lock``
(:mod:`distckpt.storage.posix.savelock`) while it runs; a deletion renames its victim to
``.NAME.del-<hex>`` first (docs/FORMAT.md, "Saves in flight"). Looking (:func:`scan_leftovers`,
:func:`saves_of`: listdir and a read-only lock probe) never writes and imports no torch, for
``distckpt ls`` and the messages of a read; :func:`reclaim_tmp_dirs` deletes what it finds dead.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from typing import Callable

from ...errors import from_os_error
from ..base import ROOT_LOCK_NAME, Leftover
from . import commit as local
from . import savelock

__all__ = ["TMP_RE", "LOCK_RE", "lock_file", "scan_leftovers", "saves_of", "tree_bytes", "reclaim_tmp_dirs"]

log = logging.getLogger("distckpt")

# Hidden siblings: ".NAME.tmp-<hex>" (a save in progress or crashed), ".NAME.del-<hex>" (a deletion).
TMP_RE = re.compile(r"^\.(?P<name>.+)\.(?P<what>tmp|del)-[0-9a-f]{32}\Z")
# ".NAME.lock": the liveness lock of a save of NAME in flight (storage.savelock); the root lock
# (storage.base.ROOT_LOCK_NAME) is held by whichever manager save is in flight in the root.
LOCK_RE = re.compile(r"^\.(?P<name>.+)\.lock\Z")


def lock_file(parent: str, name: str) -> str:
    """The liveness lock of a save of ``parent/name`` (see :mod:`distckpt.storage.posix.savelock`)."""
    return os.path.join(parent, f".{name}.lock")


def scan_leftovers(parent: str, *, other_hosts: bool = False) -> list[Leftover]:
    """Every tmp/del/lock entry in ``parent`` with the liveness of its owner. Never writes.

    A leftover of ``NAME`` is alive when ``.NAME.lock`` or the root lock (``ROOT_LOCK_NAME``: a
    manager's save, its rotation and its ``latest`` update) is held; dead when both are free (or
    absent) and were last held on this host; unknown otherwise. The directory is listed *before*
    the locks are probed: a save creates its tmp dir only after taking its lock and releases the
    lock only after the tmp dir is gone, so a listed entry whose locks are free is never live."""
    try:
        entries = os.listdir(parent)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise from_os_error(exc, path=parent, operation="list") from exc
    groups: dict[str, list[tuple[str, str]]] = {}
    for entry in sorted(entries):
        m = TMP_RE.match(entry)
        if m:
            groups.setdefault(m.group("name"), []).append((entry, m.group("what")))
            continue
        m = LOCK_RE.match(entry)
        if m and entry != ROOT_LOCK_NAME:
            groups.setdefault(m.group("name"), []).append((entry, "lock"))
    if not groups and ROOT_LOCK_NAME not in entries:
        return []
    root_state = savelock.probe(os.path.join(parent, ROOT_LOCK_NAME), other_hosts=other_hosts)
    out = []
    for name, members in groups.items():
        own = savelock.probe(lock_file(parent, name), other_hosts=other_hosts)
        if all(kind == "lock" for _, kind in members) and not (own.owner and "save_id" in own.owner):
            continue  # a ".X.lock" of some other tool, not a save lock of ours: not ours to touch
        states = {own.state, root_state.state}
        state = "alive" if "alive" in states else "unknown" if "unknown" in states else "dead"
        holder = own if own.state == "alive" or root_state.state != "alive" else root_state
        owner = holder.owner or own.owner or root_state.owner
        # A lock entry carries its own record (what reclaim must match before unlinking it).
        out += [Leftover(e, name, kind, os.path.join(parent, e), state, own.owner if kind == "lock" else owner)
                for e, kind in members]
    if ROOT_LOCK_NAME in entries:
        out.append(Leftover(ROOT_LOCK_NAME, "", "lock", os.path.join(parent, ROOT_LOCK_NAME),
                            root_state.state if root_state.state != "absent" else "dead", root_state.owner))
    return out


def tree_bytes(path: str, *, limit: int = 100_000) -> int:
    """Bytes of the regular files under ``path`` (a leftover directory), counting at most
    ``limit`` entries (a leftover holds a few data files; the bound keeps a look cheap). Never
    follows symlinks; entries that vanish meanwhile are skipped."""
    total, seen, stack = 0, 0, [path]
    while stack and seen < limit:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    seen += 1
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        elif e.is_file(follow_symlinks=False):
                            total += e.stat(follow_symlinks=False).st_size
                    except OSError:
                        continue
        except OSError:
            continue
    return total


def saves_of(parent: str, name: str) -> list[tuple[Leftover, int]]:
    """The temporary directories of saves of ``parent/name`` (``.NAME.tmp-*``) with their liveness
    and size in bytes: what an interrupted (or running) save to that path left. Never writes."""
    try:
        found = scan_leftovers(parent)
    except Exception:  # noqa: BLE001 - a look for a message: an unreadable parent shows nothing
        return []
    return [(lo, tree_bytes(lo.path)) for lo in found
            if lo.kind == "tmp" and lo.name == name and os.path.isdir(lo.path)]


def reclaim_tmp_dirs(parent: str, name: str | None = None, *, other_hosts: bool = False,
                     only: Callable[[str], bool] | None = None) -> list[str]:
    """Delete the leftovers of *dead* saves and deletions in ``parent`` (``.NAME.tmp-*`` /
    ``.NAME.del-*`` and stale ``.NAME.lock`` files; all names when ``name`` is None, those
    ``only`` accepts when it is given). A leftover
    whose save is alive (its lock is held, by any process) is never touched; one whose liveness
    cannot be decided (another host's, see :mod:`distckpt.storage.posix.savelock`) is left alone and
    logged as a warning unless ``other_hosts``. Committed directories are never touched.
    Returns the entries removed."""
    removed, kept = [], []
    leftovers = scan_leftovers(parent, other_hosts=other_hosts)
    with_dirs = {lo.name for lo in leftovers if lo.kind != "lock"}
    for lo in leftovers:
        if name is not None and lo.name not in (name, ""):
            continue
        if only is not None and not only(lo.name):
            continue
        if lo.state != "dead":
            kept.append(lo)
            continue
        if lo.kind == "lock":
            # Only a lock of ours (an owner record; or an empty one, of a save that died while
            # starting, beside its leftovers or at the root lock's name) whose record is unchanged
            # since the probe, under an exclusive lock.
            save_id = lo.owner.get("save_id") if lo.owner else None
            ours = save_id is not None or (lo.owner is None and (lo.entry == ROOT_LOCK_NAME or lo.name in with_dirs))
            if ours and savelock.remove_if_dead(lo.path, save_id):
                removed.append(lo.entry)
        else:
            local.delete_tree(lo.path)
            removed.append(lo.entry)
    if removed:
        log.info("distckpt: reclaimed %d leftovers of dead saves in %s: %s", len(removed), parent, removed)
    unknown = [lo for lo in kept if lo.state == "unknown"]
    if unknown:
        log.warning("distckpt: left %d leftovers in %s alone: their save's liveness cannot be decided from "
                    "host %s (owners: %s). If those saves are dead, remove them with "
                    "CheckpointManager(ROOT).reclaim(other_hosts=True) or by hand.", len(unknown), parent,
                    socket.gethostname(), sorted({f"{(lo.owner or {}).get('host', '?')}:{(lo.owner or {}).get('pid', '?')}"
                                                   for lo in unknown}))
    return removed
