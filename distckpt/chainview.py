"""A delta of an incremental chain as the one checkpoint it stands for.

Readers built for one checkpoint (``distckpt convert``, DCP's StorageReader) ask for a MANIFEST
and for boxes of its tensors. :class:`ChainView` answers both for a delta the way
:func:`distckpt.read` composes it: the delta's own tensors and values, and each tracked tensor
from the chain's full base with every delta's newest rows written over it
(:func:`distckpt.incremental.plan_deltas` on the boxes asked for).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .chain import ChainLink
from .errors import CheckpointCorruptError, CheckpointNotFoundError
from .fill import Part, box_tasks, fill_parts, reading, side_reads
from .deltarecords import DELTA_ROOT
from .incremental import Target, plan_deltas, without_records
from .restore import _chain_error, _selects, fill_boxes
from .storage import open_store

__all__ = ["ChainView"]


class ChainView:
    """``links``: :func:`distckpt.chain.chain_of` of a delta (newest first). ``manifest``: a
    MANIFEST of the composed state (the newest link's, with its records left out and the base's
    tracked tensors put in; chunks name the link that holds them, so it is read only through
    :meth:`fill`)."""

    def __init__(self, links: list[ChainLink], *, verify: bool = True) -> None:
        newest, base = links[0], links[-1]
        self.links, self.tracked, self.verify = links, newest.tracked, verify
        self._ids: dict = {}  # the deltas' row ids, read once by the first box that needs them

        def own(fqn: str) -> bool:  # the delta's records are no state of its own
            return not _selects(fqn, [DELTA_ROOT])

        tensors = {f: e for f, e in newest.manifest.tensors.items() if own(f)}
        tensors.update({f: base.manifest.tensors[f] for f in self.tracked})  # chain_of checked they are there
        tree = _merged_tree(without_records(newest.manifest.tree), _pruned_tree(base.manifest.tree, set(self.tracked)))
        self.manifest = dataclasses.replace(newest.manifest, tensors=tensors, tree=tree,
                                            objects={f: e for f, e in newest.manifest.objects.items() if own(f)})

    def fill(self, requests: list[tuple[str, tuple, tuple, Any]]) -> None:
        """Read the boxes ``(fqn, offsets, sizes, destination tensor)`` of the composed state
        (blocks verified before use when ``verify``). Raises ChainBrokenError for a damaged or
        missing file of an older link, and the read errors of :func:`distckpt.read`."""
        newest, base = self.links[0], self.links[-1]
        own = [r for r in requests if r[0] not in self.tracked]
        tracked = [r for r in requests if r[0] in self.tracked]
        try:
            with reading():
                if own:
                    fill_boxes(newest.path, newest.manifest, own, verify=self.verify)
                if tracked:
                    fill_boxes(base.path, base.manifest, tracked, verify=self.verify)
                    targets: dict[str, list] = {}
                    for fqn, off, sz, dst in tracked:
                        targets.setdefault(fqn, []).append(Target(tuple(off), tuple(sz), dst))
                    reads, _ids = plan_deltas(list(reversed(self.links[:-1])), targets, self.tracked, self.verify,
                                              ids_cache=self._ids)
                    store = open_store(base.path)
                    # The deltas' rows of a box are a small share of it: read beside the base's
                    # pipeline slots (side_reads), which a caller reading slice by slice
                    # (convert's keep_open session) then keeps mapped and registered.
                    with side_reads():
                        fill_parts([Part(store, path, m, box_tasks(path, m, reqs)) for path, m, reqs in reads],
                                   verify=self.verify)
        except (CheckpointCorruptError, CheckpointNotFoundError) as exc:
            broken = _chain_error(exc, self.links)
            if broken is exc:
                raise
            raise broken from exc


def _pruned_tree(node: dict, keep: set) -> dict | None:
    """The part of a MANIFEST tree that leads to the refs in ``keep`` (None when none does)."""
    if node["t"] == "ref":
        return node if node["fqn"] in keep else None
    if node["t"] == "dict":
        kids = [[k, p] for k, c in node["k"] if (p := _pruned_tree(c, keep)) is not None]
        return {"t": "dict", "k": kids} if kids else None
    return node if any(_pruned_tree(c, keep) is not None for c in node["v"]) else None


def _merged_tree(newest: dict, base: dict | None) -> dict:
    """A delta's tree with its base's tracked tensors placed in it, as distckpt.read merges the
    two states (dicts key by key; anything else: the base's)."""
    if base is None:
        return newest
    if newest["t"] == "dict" and base["t"] == "dict":
        out = [[k, c] for k, c in newest["k"]]
        at = {k: i for i, (k, _c) in enumerate(out)}
        for k, c in base["k"]:
            if k in at:
                out[at[k]][1] = _merged_tree(out[at[k]][1], c)
            else:
                out.append([k, c])
        return {"t": "dict", "k": out}
    return base
