"""What each tier of a tiered manager holds, step by step, without torch and without writing:
``distckpt ls LOCAL --remote URL``.

One row per step found on either tier: the local copy on this node (which of the step's data
files this node's directory holds), the remote copy, and whether both are the same save. Reads
MANIFEST headers and stats data files only (distckpt.listing's rules), never a byte of data.
"""

from __future__ import annotations

import dataclasses
import os

from ..errors import ConfigError, DistCkptError, ObjectStoreError, StorageError
from ..listing import RootListing, StepInfo, list_root
from ..storage import join, normalize_path, open_store
from .records import TIER_ID_NAME, TIER_RECORD_NAME, read_drained, tier_id

__all__ = ["TierRow", "list_tiers", "pairing_problem"]


@dataclasses.dataclass(frozen=True)
class TierRow:
    """One step of a tiered root.

    ``local``: this node's copy: ``committed`` or ``broken`` (distckpt.listing's status), or None
    when absent; ``local_files``/``files``: data files of the step this node's directory holds,
    of how many the MANIFEST names (a node holds its own ranks' files). ``remote``: the remote
    copy's status, or None; ``unknown`` when the remote tier could not be listed (then
    ``drained`` says whether this node's drained record, distckpt.tiers.records, names this very
    save as having reached it). ``same_save``: both copies are one save (same save id), None when
    either is missing. ``latest``: the newest step committed on either tier."""

    step: int
    local: str | None
    remote: str | None
    local_files: int
    files: int
    same_save: bool | None
    size_bytes: int | None
    created_unix: float | None
    ranks: int | None
    latest: bool = False
    problem: str | None = None
    drained: bool | None = None

    @property
    def durable(self) -> bool:
        return self.remote == "committed"


def _files_here(info: StepInfo) -> tuple[int, int]:
    """(data files present, data files named) of a committed local step."""
    from .. import manifest as mf
    store = open_store(info.path)
    man = mf.decode_header(store.manifest_bytes(info.path), path=info.path)
    present = 0
    for i in range(len(man.files)):
        _, size, _ = store.data_file_stat(info.path, man, i)
        present += size == man.files[i].size
    return present, len(man.files)


def pairing_problem(local: str | os.PathLike, remote: str | os.PathLike, *,
                    storage_options: dict | None = None) -> str | None:
    """Why the remote root ``remote`` is not the remote tier the local tier ``local`` drains to,
    from the local tier's pairing record (distckpt.tiers.records) and the remote root's identity;
    None when it is, or when the local tier records none (a new one). A TieredCheckpointManager
    on such a pair raises TierMismatchError; a listing of it would mix two runs' steps, or call
    steps not durable that are, on another root. Raises the stores' typed errors."""
    local, remote = normalize_path(local), normalize_path(remote)
    text = open_store(local).read_pointer(join(local, TIER_RECORD_NAME))
    mine = tier_id(text)
    if mine is None:
        return None
    lines = text.splitlines()
    paired_root = lines[1].strip() if len(lines) > 1 else None
    try:
        found = tier_id(open_store(remote, storage_options).read_pointer(join(remote, TIER_ID_NAME)))
    except DistCkptError as exc:
        if not isinstance(exc, StorageError) or isinstance(exc, ObjectStoreError):
            raise
        # A local path that is no directory (a regular file): no tier there at all.
        return (f"the local tier drains to tier {mine}" + (f" at {paired_root}" if paired_root else "") +
                f"; {remote} cannot hold a tier ({type(exc).__name__}: {exc.message}): this is not its remote tier")
    if found == mine:
        return None
    where = (f"holds tier {found}" if found is not None else
             "holds no tier identity (a new root, or a file system that is not mounted)")
    return (f"the local tier drains to tier {mine}" + (f" at {paired_root}" if paired_root else "") +
            f"; {remote} {where}: this is not its remote tier")


def list_tiers(local: str | os.PathLike, remote: str | os.PathLike, *, storage_options: dict | None = None
               ) -> tuple[list[TierRow], RootListing | None, RootListing | None, DistCkptError | None]:
    """The rows of a tiered root (ascending by step), with each tier's own listing (None for a
    tier whose root does not exist yet, or could not be listed) and the remote tier's error when
    it could not be listed (else None): the local tier is still listed then, each row's remote
    status ``unknown``.

    Raises StorageError subclasses for a local root that cannot be listed."""
    from ..errors import CheckpointNotFoundError

    def listing(path, options):
        try:
            return list_root(path, storage_options=options)
        except CheckpointNotFoundError:
            return None

    loc = listing(normalize_path(local), None)
    try:
        rem, remote_error = listing(normalize_path(remote), storage_options), None
    except ConfigError:
        raise  # a URL that names no store: not a remote tier that could not be listed
    except DistCkptError as exc:
        # A dark or refusing remote tier: what this node holds is still worth showing (the
        # local copies are what a load would use now).
        rem, remote_error = None, exc
    drained = _drained_here(normalize_path(local), normalize_path(remote)) if remote_error is not None else {}
    by_step: dict[int, dict[str, StepInfo]] = {}
    for tier, lst in (("local", loc), ("remote", rem)):
        for e in (lst.entries if lst is not None else []):
            if e.step is not None:
                by_step.setdefault(e.step, {})[tier] = e
    rows = []
    for step in sorted(by_step):
        lo, re_ = by_step[step].get("local"), by_step[step].get("remote")
        here, named, problem = 0, 0, None
        if lo is not None and lo.status == "committed":
            here, named = _files_here(lo)
            if here < named:
                # One node's view: in a job of several nodes each holds its own ranks' files, so
                # fewer here is normal; whether the others hold the rest only a load can tell.
                problem = (f"this node holds {here} of the {named} data files" +
                           (" (the remote tier holds them all)" if re_ is not None and re_.status == "committed"
                            else "; the remote tier could not be listed, so it is complete only if other nodes' "
                                 "local directories or the remote tier hold the rest" if remote_error is not None
                            else "; the remote tier does not hold the step, so it is complete only if other "
                                 "nodes' local directories hold the rest"))
        same = None
        if lo is not None and re_ is not None and lo.save_id and re_.save_id:
            same = lo.save_id == re_.save_id
            if not same:
                problem = f"the tiers hold two saves of this step (local {lo.save_id}, remote {re_.save_id})"
        ref = re_ if re_ is not None and re_.status == "committed" else lo
        remote_status = re_.status if re_ else "unknown" if remote_error is not None else None
        recorded = (lo is not None and lo.save_id is not None and drained.get(step) == lo.save_id
                    if remote_error is not None else None)
        rows.append(TierRow(step, lo.status if lo else None, remote_status, here, named or
                            (ref.ranks or 0), same, ref.size_bytes, ref.created_unix, ref.ranks, problem=problem,
                            drained=recorded))
    committed = [r for r in rows if "committed" in (r.local, r.remote)]
    if committed:
        newest = max(committed, key=lambda r: (r.created_unix or 0.0, r.step))
        rows = [dataclasses.replace(r, latest=r.step == newest.step) for r in rows]
    return rows, loc, rem, remote_error


def _drained_here(local_root: str, remote_root: str) -> dict[int, str]:
    """{step: save id} this node's drained record names for the remote tier its local tier is
    paired with, at ``remote_root`` ({} without either record, or for another root)."""
    store = open_store(local_root)
    try:
        tier = tier_id(store.read_pointer(join(local_root, TIER_RECORD_NAME)))
    except DistCkptError:
        return {}
    return read_drained(store, local_root, tier, remote_root)
