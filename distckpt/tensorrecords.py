"""nn.Parameters and shared tensors of a state tree, recorded as plain data and put back after a
whole-tree read.

distckpt stores each tensor's values once per key, so :func:`distckpt.read` gives plain tensors:
an ``nn.Parameter`` comes back as a tensor with ``requires_grad=False``, one tensor under two keys
as two copies, tied weights (two tensors over the same elements) as two memories. torch.save keeps
all three. Integrations whose reference is torch.save and that read a whole tree back without a
template (Lightning's CheckpointIO, DeepSpeed's ``client_state`` and checkpoint engine) call
:func:`record` at save, keep the records in their metadata, and :func:`restore` after the read.
A partial view of another tensor's memory (a slice, a transpose) comes back as its own tensor
with the same values: logged by name at save.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .errors import ManifestCorruptError
from .flatten import set_leaf

__all__ = ["record", "restore"]

log = logging.getLogger("distckpt")


def record(checkpoint: Any, *, warned: set | None = None) -> list[list]:
    """What a whole-tree read would not give back as torch.save does, as plain data: each
    ``nn.Parameter`` (``["param", path, requires_grad]``; a read gives a plain tensor), each
    plain tensor that requires grad (``["grad", path]``), and each
    tensor with the same memory as one met before, element for element (``["alias", path,
    first_path, same_object, requires_grad or None]``; a read gives two copies: tied weights,
    one tensor under two keys). Paths are key lists from the root. A tensor that overlaps
    another's memory otherwise (a slice, a transpose, an expansion of it) loads as its own copy:
    logged by name, values exact. Tensors without strided memory of their own (sparse, nested,
    meta...) are left to flatten's refusal. O(n log n) in the tensors. ``warned``: the (view, owner)
    pairs already logged, which are not logged again (a trainer saves the same state every epoch)."""
    out: list[list] = []
    by_id: dict[int, list] = {}                  # id of a tensor met (alive: the tree holds it) -> its path
    seen: dict[tuple, tuple[list, Any]] = {}     # (device, storage address, dtype, offset, shape, stride) -> first
    spans: dict[tuple, list[tuple[int, int, list]]] = {}  # (device, storage address) -> byte spans

    def memory(obj: torch.Tensor) -> tuple | None:
        if obj.layout != torch.strided or obj.is_meta or obj.numel() == 0:
            return None
        try:
            if obj.is_nested or obj.is_quantized:
                return None
            return str(obj.device), obj.untyped_storage().data_ptr()
        except Exception:  # noqa: BLE001 - no storage to share (a wrapper subclass, XLA): nothing to record
            return None

    def walk(obj: Any, path: list, depth: int) -> None:
        if depth > 100:
            return  # flatten reports the depth
        if isinstance(obj, dict):
            for key, value in obj.items():
                walk(value, path + [key], depth + 1)
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                walk(value, path + [i], depth + 1)
        elif type(obj) in (torch.Tensor, torch.nn.Parameter):
            param = type(obj) is torch.nn.Parameter
            rg = bool(obj.requires_grad) if param else None
            # A plain tensor that requires grad (an optimizer's fp32 copy) keeps the flag through
            # torch.save too.
            grad = not param and bool(obj.requires_grad)
            if id(obj) in by_id:  # one object under two keys (also one without memory: numel 0)
                out.append(["alias", path, by_id[id(obj)], True, rg])
                return
            by_id[id(obj)] = path
            where = memory(obj)
            if where is not None:
                key = (*where, obj.dtype, obj.storage_offset(), tuple(obj.shape), obj.stride())
                if key in seen:
                    first, first_obj = seen[key]
                    out.append(["alias", path, first, obj is first_obj, rg])
                    if grad and obj is not first_obj:
                        out.append(["grad", path])
                    return
                seen[key] = (path, obj)
                start = obj.storage_offset() * obj.element_size()
                extent = 1 + sum((n - 1) * st for n, st in zip(obj.shape, obj.stride()))
                spans.setdefault(where, []).append((start, start + extent * obj.element_size(), path))
            if param:
                out.append(["param", path, rg])
            elif grad:
                out.append(["grad", path])

    walk(checkpoint, [], 0)
    for intervals in spans.values():  # one sweep per storage: any overlap between distinct layouts
        intervals.sort(key=lambda span: span[0])
        reach, owner = -1, None
        for s0, e0, path in intervals:
            if s0 < reach and (warned is None or (tuple(path), tuple(owner)) not in warned):
                if warned is not None:
                    warned.add((tuple(path), tuple(owner)))
                log.warning("distckpt: %s shares memory with %s but not element for element (a slice, transpose "
                            "or expansion of it): it is saved and loaded as its own tensor with the same values, "
                            "no longer sharing memory", ".".join(map(str, path)), ".".join(map(str, owner)))
            if e0 > reach:
                reach, owner = e0, path
    return out




def restore(tree: Any, records: Any, *, where: str, path: str) -> Any:
    """``tree`` with the Parameters and shared tensors of :func:`record` put back (``tree`` is
    changed in place where it can be; use the return value). ``where`` names the records in
    messages, ``path`` the checkpoint.

    Raises ManifestCorruptError for a record that is malformed or names no tensor of ``tree``."""

    def bad(rec: Any) -> ManifestCorruptError:
        return ManifestCorruptError(f"{where}: {rec!r} names no tensor of the checkpoint",
                                    path=path)

    def at(keys: Any) -> torch.Tensor:
        node = tree
        try:
            for key in keys:
                if not isinstance(node, (dict, list, tuple)):  # never into a tensor (or a str)
                    raise KeyError(key)
                node = node[key]
        except (TypeError, KeyError, IndexError, ValueError, OverflowError):
            node = None
        if not isinstance(node, torch.Tensor):
            raise bad(keys)
        return node

    def parameter(value: torch.Tensor, requires_grad: bool, rec: Any) -> torch.nn.Parameter:
        try:  # an integer tensor cannot require grad: a forged record
            return torch.nn.Parameter(value, requires_grad=requires_grad)
        except RuntimeError:
            raise bad(rec) from None

    if not isinstance(records, list):
        raise bad(records)
    for rec in records:  # Parameters first: an alias of one is then the same Parameter
        if isinstance(rec, list) and len(rec) == 3 and rec[0] == "param" and isinstance(rec[1], list) and rec[1]:
            set_leaf(tree, tuple(rec[1]), parameter(at(rec[1]), bool(rec[2]), rec))
        elif not (isinstance(rec, list) and len(rec) == 5 and rec[0] == "alias" and isinstance(rec[1], list)
                  and rec[1] and isinstance(rec[2], list)) and not (
                isinstance(rec, list) and len(rec) == 2 and rec[0] == "grad" and isinstance(rec[1], list) and rec[1]):
            raise bad(rec)
    def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:  # NaN == NaN here, unlike torch.equal
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        return a.numel() == 0 or torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                                             b.contiguous().reshape(-1).view(torch.uint8))

    for rec in records:
        if rec[0] == "alias":
            first, mine = at(rec[2]), at(rec[1])
            if not same_bytes(first, mine):
                raise bad(rec)  # the bytes of the two differ: the record does not describe this tree
            if rec[3]:
                value = first
            else:
                value = first.detach()  # another tensor object over the same memory
                if rec[4] is not None:
                    value = parameter(value, bool(rec[4]), rec)
            set_leaf(tree, tuple(rec[1]), value)
    for rec in records:  # after the aliases: a detached alias gets its own flag
        if rec[0] == "grad":
            try:
                at(rec[1]).requires_grad_(True)
            except RuntimeError:  # an integer tensor: it cannot have required grad
                raise bad(rec) from None
    return tree
