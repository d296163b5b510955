"""What a directory of checkpoints holds, without writing anything and without torch.

:func:`list_root` is ``distckpt ls`` and :meth:`distckpt.CheckpointManager.describe`: committed
steps with size, date, world size and incremental chain link, which one is latest, broken
entries, and the leftovers of saves in flight or crashed, all through the storage seam
(:class:`distckpt.storage.Store`). It reads MANIFESTs only, never a data file, and imports no
torch (the command line stays fast).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Callable

from . import chain
from .errors import (CheckpointCorruptError, CheckpointIncompleteError, CheckpointNotFoundError, DistCkptError,
                     ObjectNotFoundError, StorageError)
from .manifest import MANIFEST_NAME as MANIFEST
from .storage import Leftover, Store, basename, dirname, join, normalize_path, open_store

__all__ = ["list_root", "RootListing", "StepInfo", "Leftover", "owned_checkpoints"]

# Exactly the names CheckpointManager gives (step_dirname: 8 digits zero-padded, more without a
# leading zero): step_000000007 beside step_00000007 would list step 7 twice, and the manager's
# path(7) names only the second. [0-9], not \d (which takes any Unicode digit), and \Z, not $
# (which also matches before a trailing newline): "step_0000000\u0663" and "step_00000003\n" are
# other directories than step_00000003.
_STEP_RE = re.compile(r"step_([0-9]{8}|[1-9][0-9]{8,})\Z")


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """One checkpoint directory found by :func:`list_root`.

    ``status``: ``committed`` (MANIFEST decodes), ``broken`` (a ``step_N`` directory without
    MANIFEST, or a MANIFEST that does not decode: ``problem`` says which) or ``unreadable`` (its
    MANIFEST could not be read for a reason that says nothing about it: no permission, an I/O or
    network error, a format version newer than this reader; ``problem`` says which). ``step`` is
    None for a checkpoint directory not named ``step_N``. ``size_bytes``: data files + MANIFEST,
    from the manifest. ``ranks``: the world size that saved it. ``chain``: for a link of an incremental
    chain (distckpt.incremental), ``{"kind": "full"|"delta", "seq", "parent", "parent_save_id", "base",
    "chain", "link_bytes", "tracked_bytes"}`` (the parent and base by directory name), else None. A
    committed delta whose chain does not reach its full base among its siblings (a link deleted,
    damaged or replaced) has a ``problem`` saying where: loading or verifying it raises
    ChainBrokenError."""

    name: str
    path: str
    step: int | None
    status: str
    problem: str | None = None
    size_bytes: int | None = None
    created_unix: float | None = None
    ranks: int | None = None
    save_id: str | None = None
    is_latest: bool = False
    chain: dict | None = None


@dataclasses.dataclass(frozen=True)
class RootListing:
    """What :func:`list_root` found. ``kind``: ``root`` (a directory of checkpoints) or
    ``checkpoint`` (``path`` is one checkpoint directory: ``entries`` holds just it).
    ``latest``: the step ``CheckpointManager.load()`` would load (newest by commit order);
    ``latest_pointer``: what the ``latest`` file says (None when absent), ``pointer_problem``: why
    it disagrees with ``latest`` or cannot be read. ``leftovers``: saves in flight or crashed and
    deletions (:class:`~distckpt.storage.Leftover`, with owner and liveness)."""

    path: str
    kind: str
    entries: list[StepInfo]
    latest: int | None
    latest_pointer: str | None
    pointer_problem: str | None
    leftovers: list[Leftover]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _step_info(path: str, name: str, store: Store, *, strict: bool = True) -> StepInfo:
    """The step at ``path``: "committed", "broken" (its MANIFEST is damaged or missing), or with
    ``strict=False`` (a listing to show) "unreadable": its state is unknown (below). With
    ``strict`` (a decision: which step load() takes) those errors are raised."""
    from . import manifest as mf
    m = _STEP_RE.match(name)
    step = int(m.group(1)) if m else None
    # A listing reads MANIFESTs only (their own checksum and validation), never the data files:
    # a format-3 checkpoint's chunk records (in its data files' indexes) are checked by a load or
    # by verify, like its data.
    try:
        try:
            data = store.manifest_bytes(path)
            man = mf.decode_header(data, path=join(path, MANIFEST))
        except (CheckpointCorruptError, CheckpointNotFoundError, CheckpointIncompleteError, ObjectNotFoundError) as exc:
            # What the MANIFEST is (damaged) or is not (there): the step is broken. Any other
            # error (a timeout, a reset, throttling, no permission) says nothing about the step:
            # calling it broken made load() fall back to an older step, after which the next save
            # deleted this one as an abandoned branch. Nor does a MANIFEST of a format version
            # this reader does not know (a newer release wrote it): it is not damaged.
            if exc.details.get("found_version") is not None:
                raise
            problem = "no MANIFEST: never committed (or its MANIFEST was deleted)" \
                if not store.has_manifest(path) else f"{type(exc).__name__}: {exc.message}"
            return StepInfo(name, path, step, "broken", problem)
    except DistCkptError as exc:
        if strict:
            raise
        return StepInfo(name, path, step, "unreadable", f"{type(exc).__name__}: {exc.message} (not known to be "
                        "damaged; CheckpointManager.load() raises this until the step can be read)")
    info = chain.chain_info(man)
    link = None if info is None else {k: info.get(k) for k in ("kind", "seq", "parent", "parent_save_id", "base",
                                                                "chain", "link_bytes", "tracked_bytes")}
    return StepInfo(name, path, step, "committed", None, sum(f.size for f in man.files) + len(data),
                    man.created_unix, man.world_size, man.save_id, chain=link)


def _chain_problem(info: StepInfo, by_name: dict[str, StepInfo]) -> str | None:
    """Why the incremental chain of the committed link ``info`` does not reach its full base
    among the entries of its root (``by_name``), from their MANIFESTs as listed; None when it
    does, or when ``info`` is no delta. What :func:`distckpt.chain.chain_of` checks of the chain's
    structure, so that ``distckpt ls`` does not call committed a step that every load of it
    refuses (its data is not read: verify checks that)."""
    child, seen = info, {info.name}
    while child.chain is not None and child.chain.get("kind") == "delta":
        meta, parent = child.chain, child.chain.get("parent")
        target = by_name.get(parent) if isinstance(parent, str) else None
        if target is None or parent in seen:
            return f"its incremental chain is broken: {child.name}'s parent {parent!r} is not in this root"
        seen.add(parent)
        if target.status != "committed":
            return f"its incremental chain is broken: {child.name}'s parent {parent} is {target.status}"
        pmeta = target.chain or {}
        if (target.save_id != meta.get("parent_save_id") or pmeta.get("chain") != meta.get("chain")
                or pmeta.get("seq") != (meta.get("seq") or 0) - 1):
            return (f"its incremental chain is broken: {parent} is not the checkpoint {child.name} was saved "
                    "against (replaced, or another chain's)")
        child = target
    if info.chain is not None and child.chain is not None and child.chain.get("kind") != "full":
        return f"its incremental chain is broken: it ends in {child.name}, which is no full checkpoint"
    return None


def _ancestors(info: StepInfo, parent_dir: str, store) -> dict[str, StepInfo]:
    """{name: StepInfo} of ``info`` and the links its chain names, read from ``parent_dir`` as
    far as they go (for :func:`_chain_problem`, which names the first one missing or wrong)."""
    by_name, child = {info.name: info}, info
    while child.chain is not None and child.chain.get("kind") == "delta":
        parent = child.chain.get("parent")
        if not isinstance(parent, str) or not parent or "/" in parent or parent in by_name \
                or not store.exists(join(parent_dir, parent)):
            break
        child = by_name[parent] = _step_info(join(parent_dir, parent), parent, store, strict=False)
    return by_name


def _with_chain_problems(infos: list[StepInfo]) -> list[StepInfo]:
    by_name = {i.name: i for i in infos}
    out = []
    for i in infos:
        problem = _chain_problem(i, by_name) if i.status == "committed" and i.chain is not None else None
        out.append(i if problem is None else dataclasses.replace(
            i, problem=f"{problem} (loading or verifying it raises ChainBrokenError)"))
    return out


def _newest_by_commit(infos: list[StepInfo]) -> StepInfo | None:
    committed = [i for i in infos if i.status == "committed" and i.step is not None]
    return max(committed, key=lambda i: (i.created_unix, i.step), default=None)


def _listing(root: str, infos: list[StepInfo], pointer: str | None, leftovers: list,
             problem: str | None = None) -> RootListing:
    newest = _newest_by_commit(infos)
    # With a step whose MANIFEST cannot be read, no step is what load() would take: it raises
    # (a checkpoint directory not named step_N is no candidate of load()).
    unknown = any(i.status == "unreadable" and i.step is not None for i in infos)
    latest = newest.step if newest is not None and not unknown else None
    if pointer is not None and (newest is None or pointer != newest.name):
        target = next((i for i in infos if i.name == pointer), None)
        if target is None:
            problem = f"the latest file names {pointer!r}, which does not exist"
        elif target.status != "committed":
            problem = f"the latest file names {pointer!r}, which is broken"
        else:
            problem = (f"the latest file names {pointer!r} but {newest.name} was committed after it "
                       "(a crash between that commit and the pointer update): load() loads "
                       f"{newest.name}")
    infos = [dataclasses.replace(i, is_latest=(latest is not None and i.name == newest.name))
             for i in _with_chain_problems(infos)]
    infos.sort(key=lambda i: (i.step is None, i.step if i.step is not None else 0, i.name))
    return RootListing(root, "root", infos, latest, pointer, problem, leftovers)


def list_root(path: str | os.PathLike, *, other_hosts: bool = False, storage_options: dict | None = None) -> RootListing:
    """Describe a CheckpointManager root (or any directory of checkpoints, or one checkpoint
    directory) without writing anything: committed steps with size, date and world size, which
    one is latest, broken entries, and saves in flight or crashed with their owner and liveness.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist or is not a directory.
        StorageError subclasses: it cannot be listed (permissions, I/O).
    """
    root = normalize_path(path)
    store = open_store(root, storage_options)
    if store.has_manifest(root):  # one checkpoint, not a root
        info = _step_info(root, basename(root), store, strict=False)
        if info.status == "committed" and info.chain is not None:
            # A delta's chain runs through its siblings: one broken there was listed `committed`
            # here, while the listing of its root named the break (and load raises).
            problem = _chain_problem(info, _ancestors(info, dirname(root), store))
            if problem is not None:
                info = dataclasses.replace(info, problem=f"{problem} (loading or verifying it raises ChainBrokenError)")
        return RootListing(root, "checkpoint", [info], None, None, None, [])
    names = store.list_children(root)
    if not names and not store.exists(root):
        raise CheckpointNotFoundError(f"{root} does not exist", path=root,
                                      remedy="Check the path: pass a CheckpointManager root or a checkpoint directory.")
    # A name is a checkpoint when it has a MANIFEST, or a broken one when it is a step_N that holds
    # something (an empty "directory" an object store keeps after a deletion is nothing).
    def info(path: str) -> StepInfo | None:
        n = basename(path)
        if store.has_manifest(path) or (_STEP_RE.match(n) and store.exists(path)):
            return _step_info(path, n, store, strict=False)
        return None

    infos = []
    for got in store.for_each(info, [join(root, n) for n in names]):  # concurrent on an object store
        if isinstance(got, Exception):
            raise got
        if got is not None:
            infos.append(got)
    try:
        pointer, problem = store.read_pointer(join(root, "latest")), None
    except StorageError as exc:  # a FIFO, a symlink, a directory named latest: said, not fatal to a listing
        pointer, problem = None, f"the latest file cannot be read: {exc.message}"
    return _listing(root, infos, pointer, store.scan_leftovers(root, other_hosts=other_hosts), problem)


def owned_checkpoints(store: Store, parent: str, owned: Callable[[dict], bool]) -> list[tuple[str, float]]:
    """(name, commit time) of every committed checkpoint directly in ``parent`` whose MANIFEST's
    user metadata (``meta["user"]``, a dict or None) ``owned`` accepts: what an integration's
    rotation may delete. Symlinks are never listed (never deleted through); a checkpoint whose
    MANIFEST does not decode, or that cannot be looked at, is skipped (not ours to judge, never
    ours to delete). Raises the
    store's listing errors."""
    out = []
    for name in store.list_children(parent):
        path = join(parent, name)
        try:
            if not store.is_committed(path):
                continue
        except DistCkptError:
            continue  # it cannot be looked at: not ours to judge, never ours to delete
        try:
            manifest = store.load_manifest(path)
        except DistCkptError:
            continue
        user = manifest.meta.get("user")
        if owned(user if isinstance(user, dict) else None):
            out.append((name, manifest.created_unix))
    return out
