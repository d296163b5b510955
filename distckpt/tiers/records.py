"""What a node's local tier records of its remote tier, in two small files at the local root.
Torch-free: ``distckpt ls`` and ``distckpt verify`` read them too.

  * ``.distckpt-tier-remote``: the identity of the remote tier this local tier drains to (its
    first line; the remote root's ``.distckpt-tier`` holds the same id). Written once, by the
    pairing check of distckpt.tiers.manager.
  * ``.distckpt-tier-drained``: the saves this node saw reach that remote tier, one line
    ``STEP SAVE_ID`` each, under two lines naming the tier id and the remote root they were
    drained to (a manager, or ``ls``, given another remote root uses none of it). Written
    by the node's leader after each drain that committed (distckpt.tiers.manager). A manager
    that starts while the remote tier does not answer trusts it for the steps it names with
    the same save id as the local copy: those are not queued again, so a restore-only job on
    a dark remote tier closes without reporting, as not durable, steps an earlier job drained.
    The remote tier, once it answers, is still what a listing believes: the record only ever
    spares a drain, never makes a step loadable.

A record that is missing, unreadable or names another tier or remote root counts as empty
(logged): the cost
is a drain queued again (which finds the save there and uploads nothing), never a step called
durable that is not.
"""

from __future__ import annotations

import logging
import re

from ..storage import Store, join

__all__ = ["TIER_ID_NAME", "TIER_RECORD_NAME", "DRAINED_RECORD_NAME", "tier_id", "read_drained", "record_drained"]

log = logging.getLogger("distckpt")

# The remote tier's identity (its root) and the one each node's local tier drains to (its root):
# TieredCheckpointManager._pair_tiers.
TIER_ID_NAME = ".distckpt-tier"
TIER_RECORD_NAME = ".distckpt-tier-remote"
DRAINED_RECORD_NAME = ".distckpt-tier-drained"

_MAX_BYTES = 4096
_LINE = re.compile(r"^(\d{1,18}) ([0-9A-Za-z_-]{1,128})$")


def tier_id(text: str | None) -> str | None:
    """The tier id a marker or record holds (its first line), or None."""
    return text.split()[0] if text and text.split() else None


def read_drained(store: Store, local_root: str, tier: str | None, remote_root: str) -> dict[int, str]:
    """{step: save id} that the drained record of ``local_root`` names for the remote tier
    ``tier`` (the local tier's pairing id) at ``remote_root`` (normalized); {} when there is no
    record, when it names another tier (the tiers were paired anew since) or another remote root
    (a manager given a new, maybe empty, root while the paired one holds the steps), when
    ``tier`` is None, or when it does not read or parse (a warning says so). Never raises: the
    record only spares drains."""
    if tier is None:
        return {}
    path = join(local_root, DRAINED_RECORD_NAME)
    try:
        text = store.read_pointer(path)
    except Exception as exc:  # noqa: BLE001 - an unreadable record spares nothing
        log.warning("distckpt: the drained record %s does not read (%s: %s): its steps are drained again", path,
                    type(exc).__name__, exc)
        return {}
    if not text:
        return {}
    lines = text.splitlines()
    if tier_id(lines[0]) != tier or len(lines) < 2 or lines[1] != remote_root:
        log.info("distckpt: the drained record %s names another remote tier than %s at %s: not used", path, tier,
                 remote_root)
        return {}
    out = {}
    for line in lines[2:]:
        m = _LINE.match(line.strip())
        if m is None:
            log.warning("distckpt: the drained record %s has a line that is not 'STEP SAVE_ID' (%r): the record "
                        "is not used", path, line[:80])
            return {}
        out[int(m.group(1))] = m.group(2)
    return out


def record_drained(store: Store, local_root: str, tier: str, remote_root: str, step: int, save_id: str,
                   present: set[int]) -> None:
    """Add ``step``'s ``save_id`` to the drained record of ``local_root`` for the remote tier
    ``tier`` at ``remote_root`` (normalized; a record of another tier or root is replaced),
    keeping only the steps of ``present`` (those still on the local tier), in one
    atomic replace (the lowest steps left out when they would not fit its 4 KiB). Called by the node's leader alone (the local tier's owner), on the drain
    thread. Raises StorageError subclasses."""
    if "\n" in remote_root:
        raise ValueError(f"a remote root with a line break cannot be recorded: {remote_root!r}")
    held = {s: sid for s, sid in read_drained(store, local_root, tier, remote_root).items() if s in present}
    held[step] = save_id
    lines = [f"{s} {held[s]}\n" for s in sorted(held)]
    # A pointer file is read 4 KiB at most (distckpt.storage): the lowest steps go first, which
    # costs them no more than a drain queued again.
    head = f"{tier}\n{remote_root}\n"
    while len(head.encode()) + sum(map(len, lines)) > _MAX_BYTES and lines:
        lines.pop(0)
    store.replace_pointer(join(local_root, DRAINED_RECORD_NAME), (head + "".join(lines)).encode())
