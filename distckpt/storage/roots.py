"""What a path that holds checkpoints below it is, for the error a reader of one checkpoint
raises there: a CheckpointManager root (its steps named) or a parent of checkpoints. Shared by
the back ends, so that ``distckpt verify ROOT``, ``inspect`` and ``load`` say the same of a local
root and of one on an object store."""

from __future__ import annotations

import re
from typing import Callable

from ..errors import CheckpointNotFoundError

__all__ = ["holder_error"]

_STEP_RE = re.compile(r"step_([0-9]+)\Z")


def holder_error(path: str, children: list[str], join: Callable[[str, str], str]) -> CheckpointNotFoundError | None:
    """The CheckpointNotFoundError for ``path``, which is no checkpoint but whose ``children``
    (names) are committed checkpoints: a CheckpointManager root when some are steps
    (``found="manager root"``, ``steps``), else a parent of checkpoints; None without children."""
    steps = sorted((int(m.group(1)), n) for n in children if (m := _STEP_RE.match(n)))
    if steps:
        newest = join(path, steps[-1][1])
        listed = ", ".join(n for _, n in steps[-5:])
        more = f" ({len(steps)} in all)" if len(steps) > 5 else ""
        return CheckpointNotFoundError(
            f"{path} is a CheckpointManager root, not a checkpoint: it holds the committed steps "
            f"{listed}{more}", path=path, found="manager root", steps=[s for s, _ in steps],
            remedy=f"Pass one step directory, e.g. the newest: {newest}; or use "
                   f"distckpt.CheckpointManager({path!r}).load(state), which loads the newest step.")
    if children:
        return CheckpointNotFoundError(
            f"{path} is not a checkpoint but holds checkpoints in subdirectories: "
            f"{', '.join(children[:5])}{' ...' if len(children) > 5 else ''}", path=path,
            found="parent of checkpoints", remedy=f"Pass one of them, e.g. {join(path, children[0])}.")
    return None
