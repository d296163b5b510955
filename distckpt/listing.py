"""What a directory of checkpoints holds, without writing anything and without torch.

:func:`list_root` is ``distckpt ls`` and :meth:`distckpt.CheckpointManager.describe`: committed
steps with size, date, world size and incremental chain link, which one is latest, broken
entries, and the leftovers of saves in flight or crashed (distckpt.leftovers). It reads
MANIFESTs only, never a data file, and imports no torch (the command line stays fast).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from . import chain
from .errors import CheckpointNotFoundError, DistCkptError, from_os_error
from .leftovers import ROOT_LOCK_NAME, Leftover, scan_leftovers
from .manifest import MANIFEST_NAME as MANIFEST
from .storage import is_url, join, normalize_path, open_store

__all__ = ["list_root", "RootListing", "StepInfo", "Leftover"]

_STEP_RE = re.compile(r"^step_(\d{8,})$")


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """One checkpoint directory found by :func:`list_root`.

    ``status``: ``committed`` (MANIFEST decodes) or ``broken`` (a ``step_N`` directory without
    MANIFEST, or a MANIFEST that does not decode: ``problem`` says which). ``step`` is None for a
    checkpoint directory not named ``step_N``. ``size_bytes``: data files + MANIFEST, from the
    manifest. ``ranks``: the world size that saved it. ``chain``: for a link of an incremental
    chain (distckpt.incremental), ``{"kind": "full"|"delta", "seq", "parent", "base", "chain",
    "link_bytes", "tracked_bytes"}`` (the parent and base by directory name), else None."""

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
    deletions (:class:`~distckpt.coordinator.Leftover`, with owner and liveness)."""

    path: str
    kind: str
    entries: list[StepInfo]
    latest: int | None
    latest_pointer: str | None
    pointer_problem: str | None
    leftovers: list[Leftover]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _step_info(path: str, name: str, store: Any = None) -> StepInfo:
    from . import manifest as mf
    m = _STEP_RE.match(name)
    step = int(m.group(1)) if m else None
    # A listing reads MANIFESTs only (their own checksum and validation), never the data files:
    # a format-3 checkpoint's chunk records (in its data files' indexes) are checked by a load or
    # by verify, like its data.
    if store is not None:  # an object store: one GET of MANIFEST
        try:
            data = store.manifest_bytes(path)
            man = mf.decode_header(data, path=join(path, MANIFEST))
        except DistCkptError as exc:
            return StepInfo(name, path, step, "broken", f"{type(exc).__name__}: {exc.message}")
        return StepInfo(name, path, step, "committed", None, sum(f.size for f in man.files) + len(data),
                        man.created_unix, man.world_size, man.save_id)
    try:
        man = mf.load_manifest_header(path)
        size = sum(f.size for f in man.files) + os.path.getsize(os.path.join(path, MANIFEST))
    except DistCkptError as exc:
        problem = "no MANIFEST: never committed (or its MANIFEST was deleted)" \
            if not os.path.lexists(os.path.join(path, MANIFEST)) else f"{type(exc).__name__}: {exc.message}"
        return StepInfo(name, path, step, "broken", problem)
    except OSError as exc:
        return StepInfo(name, path, step, "broken", f"{type(exc).__name__}: {exc}")
    info = chain.chain_info(man)
    link = None if info is None else {k: info.get(k) for k in ("kind", "seq", "parent", "base", "chain",
                                                                "link_bytes", "tracked_bytes")}
    return StepInfo(name, path, step, "committed", None, size, man.created_unix, man.world_size, man.save_id,
                    chain=link)


def _newest_by_commit(infos: list[StepInfo]) -> StepInfo | None:
    committed = [i for i in infos if i.status == "committed" and i.step is not None]
    return max(committed, key=lambda i: (i.created_unix, i.step), default=None)


def _read_pointer(root: str) -> str | None:
    try:
        with open(os.path.join(root, "latest"), "rb") as f:
            return f.read(4096).decode("utf-8", "replace").strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise from_os_error(exc, path=os.path.join(root, "latest"), operation="read") from exc


def _list_root_store(root: str, storage_options: dict | None) -> RootListing:
    """:func:`list_root` of an object-store root (or checkpoint). Never writes."""
    store = open_store(root, storage_options)
    if store.is_committed(root):
        info = _step_info(root, root.rsplit("/", 1)[-1], store)
        return RootListing(root, "checkpoint", [info], None, None, None, [])
    names = store.list_children(root)
    if not names:
        raise CheckpointNotFoundError(f"nothing at {root}", path=root,
                                      remedy="Check the URL: pass a CheckpointManager root or a checkpoint.")
    # A name is a checkpoint when it has MANIFEST, or a broken one when it holds objects (an
    # empty "directory" a server keeps after a deletion is nothing).
    names = [n for n in names if store.is_committed(join(root, n)) or (_STEP_RE.match(n) and store.objects(join(root, n)))]
    infos = [_step_info(join(root, n), n, store) for n in names]
    leftovers = []
    for n in names:
        for prefix, state in store.leftovers(join(root, n), root_lock=join(root, ROOT_LOCK_NAME)):
            leftovers.append(Leftover(f"{n}/{prefix.rsplit('/', 1)[-1]}", n, "tmp", prefix, state, None))
    return _listing(root, infos, store.read_pointer(join(root, "latest")), leftovers)


def _listing(root: str, infos: list[StepInfo], pointer: str | None, leftovers: list) -> RootListing:
    newest = _newest_by_commit(infos)
    latest = newest.step if newest is not None else None
    problem = None
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
    infos = [dataclasses.replace(i, is_latest=(newest is not None and i.name == newest.name)) for i in infos]
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
    if is_url(root):
        return _list_root_store(root, storage_options)
    if not os.path.isdir(root):
        what = "does not exist" if not os.path.lexists(root) else "is not a directory"
        raise CheckpointNotFoundError(f"{root} {what}", path=root,
                                      remedy="Check the path: pass a CheckpointManager root or a checkpoint directory.")
    if os.path.lexists(os.path.join(root, MANIFEST)):
        info = _step_info(root, os.path.basename(root))
        return RootListing(root, "checkpoint", [dataclasses.replace(info, is_latest=False)], None, None, None, [])
    try:
        names = sorted(os.listdir(root))
    except OSError as exc:
        raise from_os_error(exc, path=root, operation="list") from exc
    infos = []
    for name in names:
        full = os.path.join(root, name)
        if name.startswith(".") or not os.path.isdir(full) or os.path.islink(full):
            continue
        if _STEP_RE.match(name) or os.path.lexists(os.path.join(full, MANIFEST)):
            infos.append(_step_info(full, name))
    return _listing(root, infos, _read_pointer(root), scan_leftovers(root, other_hosts=other_hosts))
