"""Dict subclasses of a state tree, recorded as plain data and rebuilt after a whole-tree read.

distckpt walks every dict of a state dict (DCP's rule: a dict is always a container) and the
MANIFEST's tree stores a dict as a dict, so :func:`distckpt.read` gives plain dicts back; a
:func:`distckpt.load` fills the caller's own containers and keeps their types. Integrations that
read a whole tree back *without* a template (Lightning's CheckpointIO, DeepSpeed's checkpoint
engine, the lr-scheduler state of :mod:`distckpt.integrations.deepspeed.zero`) call
:func:`record` at save, keep the records in their metadata (plain data), and :func:`rebuild`
after the read, so what comes back has the types torch.save would have given back.

Rebuilt exactly: ``collections.OrderedDict`` (with torch's ``_metadata``, the module versions
``load_state_dict`` reads), ``collections.Counter`` (``MultiStepLR.milestones``) and
``collections.defaultdict`` whose ``default_factory`` is None or a builtin type of
:data:`FACTORIES`. Anything a whole-tree read would give back as another type is refused at
save by :func:`record` (UnsupportedValueError naming its key): another dict subclass, a
defaultdict with any other factory (rebuilding it would mean importing or running code named by
the checkpoint), a Stateful object (its ``state_dict()`` is what is stored), a list or tuple
subclass that holds tensors or dicts (it is walked, so it comes back as a plain one).

A record is a list: ``[path, kind, stored]`` for an OrderedDict (``kind``/``stored``: its
``_metadata`` as :func:`distckpt.values.encode_value` gives it, or None and None), and
``[path, None, None, type, arg]`` for the others (``type`` ``"Counter"`` with ``arg`` None, or
``"defaultdict"`` with ``arg`` the factory's name or None). ``path`` is the list of keys from the
recorded root. Records are in walk order: a container before the containers inside it.
"""

from __future__ import annotations

import collections
from typing import Any

from .errors import ManifestCorruptError, UnsupportedValueError
from .flatten import _holds_dict, odd_keys, set_leaf
from .values import _is_stateful, decode_value, encode_value, holds_tensor

__all__ = ["FACTORIES", "record", "rebuild"]

#: The ``default_factory`` values of a defaultdict that are rebuilt (by name; builtins only).
FACTORIES: dict[str, type] = {t.__name__: t for t in (int, float, str, bytes, bool, list, dict, set, tuple, frozenset)}
_MAX_DEPTH = 100


def _fqn(path: tuple) -> str:
    return ".".join(str(p) for p in path) or "<root>"


def _refuse(path: tuple, what: str, remedy: str) -> None:
    raise UnsupportedValueError(f"value at {_fqn(path)!r} is {what}, which would load back as a plain container",
                                key=_fqn(path), remedy=remedy)


def _record_of(obj: dict, path: tuple) -> list | None:
    """The record of the dict ``obj`` at ``path`` (None for a plain dict). Raises
    UnsupportedValueError for a dict subclass that cannot be rebuilt."""
    t = type(obj)
    if t is dict:
        return None
    if t is collections.OrderedDict:
        md = getattr(obj, "_metadata", None)
        if md is None:
            return [list(path), None, None]
        # torch's _metadata is an OrderedDict {prefix: {"version": n}}: stored as a dict node
        # (which keeps the order); anything else in it is refused by name.
        plain = {k: dict(v) if type(v) is collections.OrderedDict else v for k, v in md.items()} \
            if isinstance(md, dict) else md
        kind, stored = encode_value(f"{_fqn(path)}._metadata", plain, allow_pickle=False)
        return [list(path), kind, stored]
    if t is collections.Counter:
        return [list(path), None, None, "Counter", None]
    if t is collections.defaultdict:
        factory = obj.default_factory
        if factory is None:
            return [list(path), None, None, "defaultdict", None]
        if FACTORIES.get(getattr(factory, "__name__", None)) is factory:
            return [list(path), None, None, "defaultdict", factory.__name__]
        _refuse(path, f"a collections.defaultdict with default_factory {factory!r}",
                f"Store dict(value) (or a defaultdict of one of {sorted(FACTORIES)}) and rebuild it on load.")
    _refuse(path, f"a {t.__module__}.{t.__qualname__} (a dict subclass)",
            "Store dict(value) instead (or an OrderedDict, Counter or defaultdict of a builtin type).")
    return None  # unreachable: _refuse raises


def record(tree: Any) -> list[list]:
    """The records of every OrderedDict, Counter and defaultdict in ``tree`` (module docstring),
    after checking that every container distckpt walks would come back with its own type.

    Raises:
        UnsupportedValueError: a container that would come back as another type (named by key).
    """
    out: list[list] = []

    def walk(obj: Any, path: tuple, depth: int) -> None:
        if depth > _MAX_DEPTH:
            return  # distckpt's own flatten reports the depth
        if odd_keys(obj, path):
            return  # a dict of plain values stored as one value, its type and keys kept (values.py)
        if isinstance(obj, dict):
            rec = _record_of(obj, path)
            if rec is not None:
                out.append(rec)
            for key, value in obj.items():
                walk(value, path + (key,), depth + 1)
            return
        if _is_stateful(obj):
            _refuse(path, f"a {type(obj).__qualname__} object with state_dict()/load_state_dict()",
                    "Store value.state_dict() and call load_state_dict() on load.")
        if isinstance(obj, (list, tuple)) and (holds_tensor(obj) or (type(obj) is list and _holds_dict(obj))):
            if type(obj) not in (list, tuple):
                _refuse(path, f"a {type(obj).__qualname__} holding tensors or dicts",
                        "Store a plain list or tuple (or a dict) instead.")
            for i, value in enumerate(obj):
                walk(value, path + (i,), depth + 1)

    walk(tree, (), 0)
    return out


def _container(node: dict, rec: list, where: str, path: Any) -> dict:
    """The container ``rec`` describes, holding ``node``'s items."""
    if len(rec) == 3:
        od = collections.OrderedDict(node)
        kind, stored = rec[1], rec[2]
        if kind is not None:
            meta = decode_value(kind, stored, fqn=f"{_fqn(tuple(rec[0]))}._metadata", path=path)
            if not isinstance(meta, dict):  # (an OrderedDict's _metadata maps keys to their metadata)
                raise ManifestCorruptError(f"{where}: {rec!r}: the _metadata is a {type(meta).__name__}, not a dict",
                                           path=path)
            od._metadata = collections.OrderedDict(meta)
        return od
    kind, arg = rec[3], rec[4]
    if kind == "Counter" and arg is None:
        return collections.Counter(node)
    if kind == "defaultdict" and (arg is None or (isinstance(arg, str) and arg in FACTORIES)):
        return collections.defaultdict(FACTORIES[arg] if arg is not None else None, node)
    raise ManifestCorruptError(f"{where}: {rec!r} names no container type this version rebuilds", path=path)


def rebuild(tree: Any, records: Any, *, where: str, path: Any) -> Any:
    """``tree`` (a whole-tree read) with the containers ``records`` describe put back. ``where``
    names the records in messages (``meta.user.lightning.ordered``); ``path`` is the checkpoint.

    Raises:
        ManifestCorruptError: the records are malformed or name no dict of ``tree``.
        UnsupportedValueError: an OrderedDict's ``_metadata`` that cannot be decoded here.
    """
    if not isinstance(records, list):
        raise ManifestCorruptError(f"{where}: expected a list, found {type(records).__name__}", path=path)
    for rec in records:
        if not isinstance(rec, list) or len(rec) not in (3, 5) or not isinstance(rec[0], list):
            raise ManifestCorruptError(f"{where}: {rec!r} is not a container record", path=path)
        keys = tuple(rec[0])
        try:
            node = tree
            for key in keys:
                node = node[key]
        except (TypeError, KeyError, IndexError):
            raise ManifestCorruptError(f"{where}: {rec!r} names no dict of the checkpoint", path=path) from None
        if not isinstance(node, dict):
            raise ManifestCorruptError(f"{where}: {_fqn(keys)} is not a dict", path=path)
        new = _container(node, rec, where, path)
        if not keys:
            tree = new
        else:
            set_leaf(tree, keys, new)
    return tree
