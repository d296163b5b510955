"""CheckpointManager: numbered steps under one root, a durable ``latest`` pointer, keep_last rotation.

Layout (docs/FORMAT.md)::

    ROOT/step_00000100/       a committed checkpoint (has MANIFEST)
    ROOT/.step_00000200.tmp-… a save in progress or crashed: never loadable, reclaimed
    ROOT/latest               "step_00000100\\n", replaced by tmp + rename + directory fsync

Invariants:
  * The newest committed step is the largest ``step_N`` directory with a MANIFEST; ``latest`` is a
    convenience pointer for tools, written after the commit, and never trusted over the directories.
  * Rotation runs on rank 0 inside the commit (after the new checkpoint is durable, before any rank
    returns), deletes only committed steps older than the newest ``keep_last``, and renames each
    one aside before deleting it so a half-deleted step never looks committed. Deleted files are
    closed (no fd of ours stays open), so their blocks are freed at once.
  * Starting a manager reclaims tmp/del leftovers of crashed saves and deletions (rank 0 only).
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

from ._dist import is_distributed
from .coordinator import SaveResult, is_committed, reclaim_tmp_dirs
from .errors import CheckpointNotFoundError, ConfigError, from_os_error
from .restore import LoadResult, load
from .save import save
from .storage import local

if TYPE_CHECKING:
    from .async_save import AsyncSaveHandle

__all__ = ["CheckpointManager"]

_STEP_RE = re.compile(r"^step_(\d{8,})$")


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


class CheckpointManager:
    """Save numbered checkpoints under ``root`` and keep the newest ``keep_last`` of them.

    Args:
        root: directory holding the steps (created if missing).
        keep_last: how many committed steps to keep (None: all).
        process_group: the group save/load run over (default: the world).
    """

    def __init__(self, root: str | os.PathLike, *, keep_last: int | None = None, process_group: Any = None) -> None:
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ConfigError(f"keep_last={keep_last!r} must be a positive int or None")
        self.root = os.path.abspath(os.fspath(root))
        self.keep_last = keep_last
        self.process_group = process_group
        if self._rank() == 0:
            local.make_dirs_durable(self.root)
            reclaim_tmp_dirs(self.root)

    def _rank(self) -> int:
        if not is_distributed():
            return 0
        import torch.distributed as dist
        return dist.get_rank(self.process_group) if self.process_group is not None else dist.get_rank()

    def path(self, step: int) -> str:
        return os.path.join(self.root, step_dirname(step))

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise from_os_error(exc, path=self.root, operation="list") from exc
        out = []
        for name in names:
            m = _STEP_RE.match(name)
            if m and is_committed(os.path.join(self.root, name)):
                out.append(int(m.group(1)))
        return sorted(out)

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state_dict: Any, *, blocking: bool = True,
             **kwargs: Any) -> "SaveResult | AsyncSaveHandle":
        """Save ``state_dict`` as step ``step`` (collective), then point ``latest`` at it and rotate.

        Keyword arguments go to :func:`distckpt.save`. With ``blocking=False`` this is
        :func:`distckpt.async_save`: it returns an :class:`~distckpt.async_save.AsyncSaveHandle` as
        soon as the state is staged; ``latest`` and the rotation happen inside that save's commit,
        in the background. Saves are serialized per process (a later save waits for an earlier one
        still in flight), and rotation deletes only committed steps older than the newest
        ``keep_last``, so it never touches a step that is still being written.

        Raises what :func:`distckpt.save` raises (for ``blocking=False``: ``handle.result()`` does);
        rotation errors are raised too, after the new step is committed.
        """
        if not isinstance(step, int) or step < 0:
            raise ConfigError(f"step={step!r} must be a non-negative int")
        after = lambda: self._after_commit(step)  # noqa: E731
        if not blocking:
            from .async_save import async_save
            return async_save(state_dict, self.path(step), process_group=self.process_group,
                              _after_commit=after, **kwargs)
        return save(state_dict, self.path(step), process_group=self.process_group, _after_commit=after, **kwargs)

    def _after_commit(self, step: int) -> None:
        local.replace_file_atomic(os.path.join(self.root, "latest"), (step_dirname(step) + "\n").encode())
        if self.keep_last is None:
            return
        steps = self.steps()
        # Keep the newest keep_last steps; the one just committed is always among them.
        doomed = [s for s in steps[:-self.keep_last] if s != step]
        for old in doomed:
            local.remove_dir(self.path(old))

    def load(self, state_dict: Any, step: int | None = None, **kwargs: Any) -> LoadResult:
        """Load step ``step`` (default: the newest committed) into ``state_dict`` (collective).

        Raises CheckpointNotFoundError when there is no committed step, plus what
        :func:`distckpt.load` raises."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(f"no committed checkpoint under {self.root}", path=self.root)
        return load(state_dict, self.path(step), process_group=self.process_group, **kwargs)
