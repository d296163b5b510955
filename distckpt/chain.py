"""Incremental chains on disk: which checkpoints a delta needs, and whether they are all there.

A link of a chain is a normal committed checkpoint whose MANIFEST carries, in its user metadata
under ``"distckpt.chain"`` (docs/INCREMENTAL.md)::

    {"format": "distckpt.chain/1", "kind": "full" | "delta", "chain": id, "seq": n,
     "base": dir name, "parent": dir name | None, "parent_save_id": str | None,
     "tracked": [[fqn, row dim], ...], "link_bytes", "chain_bytes", "tracked_bytes", ...}

A delta names its parent (a sibling directory) and the parent's save id; the chain ends in a full
link (seq 0). This module only reads MANIFESTs and imports no torch (``distckpt verify`` and
``distckpt ls`` use it); saving chains and planning their deltas' rows is distckpt.incremental,
loading one distckpt.restore (its links from :meth:`distckpt.source.Source.links`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from .errors import ChainBrokenError, CheckpointCorruptError, CheckpointNotFoundError, DistCkptError
from .storage.posix.manifests import load_manifest, load_manifest_header

__all__ = ["ChainLink", "chain_info", "chain_of", "dependencies", "META_KEY", "FORMAT"]

META_KEY = "distckpt.chain"
FORMAT = "distckpt.chain/1"


@dataclasses.dataclass(frozen=True)
class ChainLink:
    """One committed link: its path, manifest and chain metadata (``meta``: the manifest's
    ``"distckpt.chain"`` entry)."""

    path: str
    manifest: Any
    meta: dict

    @property
    def kind(self) -> str:
        return self.meta["kind"]

    @property
    def tracked(self) -> dict[str, int]:
        return {f: int(d) for f, d in self.meta["tracked"]}


def chain_info(manifest: Any) -> dict | None:
    """The chain metadata of a manifest (None for a checkpoint that is no chain link)."""
    user = manifest.meta.get("user") if isinstance(manifest.meta, dict) else None
    info = user.get(META_KEY) if isinstance(user, dict) else None
    return info if isinstance(info, dict) else None


def _broken(link: str, reason: str, *, cause: BaseException | None = None) -> ChainBrokenError:
    err = ChainBrokenError(f"incremental chain broken at {link}: {reason}", path=link, link=link, reason=reason)
    if cause is not None:
        err.__cause__ = cause
    return err


def _checked(link: str, meta: dict, manifest: Any) -> dict:
    """``meta`` once its fields have the form every reader of a chain relies on (a crafted or
    damaged entry raised KeyError, TypeError or IndexError in them).

    Raises:
        ChainBrokenError: naming the first field that does not.
    """
    def count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0
    kind, seq, tracked = meta.get("kind"), meta.get("seq", 0), meta.get("tracked")
    problem = None
    if kind not in ("full", "delta"):
        problem = f"its kind is {kind!r}, not 'full' or 'delta'"
    elif not count(seq) or (kind == "delta") != (seq > 0):
        problem = f"its position (seq) is {seq!r}"
    elif not (isinstance(tracked, list) and all(
            isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and count(e[1]) for e in tracked)):
        problem = f"its tracked tensors are not a list of [name, row dimension]: {str(tracked)[:200]}"
    else:
        for fqn, dim in tracked:
            entry = manifest.tensors.get(fqn) if kind == "full" else None
            if entry is not None and dim >= len(entry.shape):
                problem = f"tracked tensor {fqn} has {len(entry.shape)} dimension(s), its row dimension is {dim}"
                break
    if problem is not None:
        raise _broken(link, f"its chain metadata is malformed: {problem}")
    return meta


def chain_of(path: str | os.PathLike, *, chunks: bool = True) -> list[ChainLink]:
    """The links a checkpoint needs, newest (``path`` itself) first, base last.

    A checkpoint that is no chain link, or a full link, is a chain of one. Reads only MANIFESTs
    and, with ``chunks`` (to load the chain), every link's data file indexes (format 3); without,
    the links' manifests have no chunk records (enough for the chain's structure: ``verify``).

    Raises:
        ChainBrokenError: a link is missing, not committed, does not decode, was replaced by
            another save (save id differs from what its child recorded), belongs to another chain,
            has chain metadata of the wrong form, or the chain does not end in a full link.
        The errors of reading ``path``'s own MANIFEST (CheckpointNotFoundError, ...).
    """
    path = os.path.abspath(os.fspath(path))
    load = load_manifest if chunks else load_manifest_header
    m = load(path)
    info = chain_info(m)
    links = [ChainLink(path, m, _checked(path, info, m) if info is not None else {"kind": "full", "tracked": [],
                                                                                    "seq": 0})]
    seen = {path}
    while links[-1].kind == "delta":
        child = links[-1]
        meta = child.meta
        parent = meta.get("parent")
        if not isinstance(parent, str) or not parent or "/" in parent or parent in (".", ".."):
            raise _broken(child.path, f"it names no valid parent ({parent!r})")
        ppath = os.path.join(os.path.dirname(child.path), parent)
        if ppath in seen:
            raise _broken(child.path, f"its parent {parent} is already in the chain (a cycle)")
        seen.add(ppath)
        try:
            pm = load(ppath)
        except (CheckpointNotFoundError, CheckpointCorruptError, DistCkptError) as exc:
            raise _broken(ppath, f"the parent of {os.path.basename(child.path)} cannot be read "
                                 f"({type(exc).__name__}: {getattr(exc, 'message', exc)})", cause=exc) from exc
        pinfo = chain_info(pm)
        if pm.save_id != meta.get("parent_save_id"):
            raise _broken(ppath, f"it is not the checkpoint {os.path.basename(child.path)} was saved against "
                                 f"(save id {pm.save_id}, expected {meta.get('parent_save_id')}): it was replaced")
        if pinfo is None or pinfo.get("chain") != meta.get("chain"):
            raise _broken(ppath, f"it belongs to another chain than {os.path.basename(child.path)}")
        if pinfo.get("seq") != meta.get("seq", 0) - 1 or pinfo.get("tracked") != meta.get("tracked"):
            raise _broken(ppath, "its position or tracked tensors do not match its child's")
        if pinfo.get("shapes") != meta.get("shapes"):   # absent from both in chains of older savers
            raise _broken(ppath, f"its tracked tensors' shapes or dtypes ({pinfo.get('shapes')}) are not its "
                                 f"child's ({meta.get('shapes')}): the child's rows cannot be composed into it")
        links.append(ChainLink(ppath, pm, _checked(ppath, pinfo, pm)))
    if links[-1].kind != "full":
        raise _broken(links[-1].path, f"the chain ends in a {links[-1].kind!r} link, not a full checkpoint")
    base = links[-1]
    for fqn, recorded in (base.meta.get("shapes") or {}).items():
        # The deltas' boxes are checked against these shapes (distckpt.incremental.plan_deltas):
        # they must be the base's own tensors'.
        entry = base.manifest.tensors.get(fqn)
        if entry is None or not isinstance(recorded, list) or not recorded or list(entry.shape) != recorded[0]:
            raise _broken(base.path, f"its chain metadata gives {fqn} the shape "
                                     f"{recorded[0] if isinstance(recorded, list) and recorded else recorded!r}, "
                                     f"its tensor has {None if entry is None else list(entry.shape)}")
    return links


def dependencies(path: str | os.PathLike) -> list[str] | None:
    """Directory names of the links ``path`` depends on (its ancestors, newest first), or None
    when the walk cannot reach the chain's full base: a link's MANIFEST cannot be read (damaged,
    missing, or an I/O error that may pass) or names an impossible parent. Never raises: rotation
    uses it, and treats None as "depends on anything" (it then deletes nothing), so a link that
    is unreadable for a moment is never taken for unneeded."""
    path = os.path.abspath(os.fspath(path))
    out: list[str] = []
    try:
        info = chain_info(load_manifest_header(path))
        while info is not None and info.get("kind") == "delta":
            parent = info.get("parent")
            if not isinstance(parent, str) or parent in out or "/" in parent:
                return None
            out.append(parent)
            info = chain_info(load_manifest_header(os.path.join(os.path.dirname(path), parent)))
    except Exception:  # noqa: BLE001 - any failure: the chain's extent is unknown
        return None
    return out
