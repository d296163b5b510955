"""Optimizer hyper-parameters as the DeepSpeed and TorchRec integrations store them.

Each param group's plain values (lr, betas, weight_decay, eps, ...) are kept as JSON in the
integration's metadata, and put back onto the live param groups on load, as torch's
``Optimizer.load_state_dict`` does with the saved ``param_groups``. The JSON comes from a file, so
every saved value is checked first: it must be able to stand where it goes (a number for a
number, betas of two numbers for betas of two), or the load is refused before anything changes.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ManifestCorruptError

__all__ = ["plain", "plain_groups", "fits", "check_groups", "set_groups"]

_SKIP = object()
# What a param group holds that is not a hyper-parameter: its parameters, and (torch >= 2.6, an
# optimizer built over named parameters) their names, which follow the live group's parameters.
_IDENTITY = ("params", "param_names")


def plain(value: Any) -> Any:
    """``value`` as JSON data (tuples as lists, a one-element tensor as its number), or the
    module's ``_SKIP`` marker for what is not a hyper-parameter a restart needs (DeepSpeed's
    bookkeeping objects, tensors of state)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if torch.is_tensor(value):
        return value.item() if value.numel() == 1 else _SKIP
    if isinstance(value, (tuple, list)):
        items = [plain(v) for v in value]
        return _SKIP if any(v is _SKIP for v in items) else items
    return _SKIP


def plain_groups(groups: list[dict]) -> list[dict]:
    """The plain hyper-parameters of each param group (``params`` left out)."""
    return [{k: pv for k, v in group.items() if k not in _IDENTITY and (pv := plain(v)) is not _SKIP}
            for group in groups]


def fits(saved: Any, cur: Any) -> bool:
    """Whether a saved JSON value can stand where ``cur`` is: a number for a number or a
    one-element tensor, a bool for a bool, a list of as many fitting values for a tuple or list
    (betas), a str for a str. None stands for None and for a bool, and None takes any plain value:
    torch's implementation flags (``foreach``, ``fused``) default to None and a run may set them,
    and torch's ``load_state_dict`` puts the saved group's value back either way."""
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if cur is None:
        return saved is None or isinstance(saved, (bool, int, float, str))
    if saved is None:
        return isinstance(cur, bool)
    if torch.is_tensor(cur):
        return cur.numel() == 1 and number(saved)
    if isinstance(cur, bool):
        return isinstance(saved, bool)
    if number(cur):
        return number(saved)
    if isinstance(cur, (tuple, list)):
        return isinstance(saved, list) and len(saved) == len(cur) and all(map(fits, saved, cur))
    if isinstance(cur, str):
        return isinstance(saved, str)
    return False


def check_groups(live: list[dict], saved: Any, *, path: str, key: str) -> None:
    """Check that ``saved`` (from a checkpoint's metadata) is a list of dicts whose every value
    :func:`set_groups` would set fits the value it replaces.

    Raises:
        ManifestCorruptError: naming the group and the hyper-parameter (``key`` is the metadata
            field), before anything is set.
    """
    if not isinstance(saved, list) or not all(isinstance(g, dict) for g in saved):
        raise ManifestCorruptError(f"the saved param groups are not a list of objects: {str(saved)[:200]}",
                                   path=path, key=key)
    for g, (group, values) in enumerate(zip(live, saved)):
        for k, v in values.items():
            if k in group and k not in _IDENTITY and not fits(v, group[k]):
                raise ManifestCorruptError(f"saved hyper-parameter {k!r} of param group {g} is {str(v)[:100]}, "
                                           f"which cannot stand for this optimizer's {group[k]!r}", path=path, key=key)


def set_groups(live: list[dict], saved: list[dict]) -> None:
    """Put the saved values (checked by :func:`check_groups`) into the live groups, group by
    group: a one-element tensor is filled in place, a tuple rebuilt as one; a key the live group
    does not have is not added (it is not this optimizer's)."""
    for group, values in zip(live, saved):
        for k, v in values.items():
            if k not in group or k in _IDENTITY:
                continue
            cur = group[k]
            if torch.is_tensor(cur):
                cur.fill_(v)
            elif isinstance(cur, tuple):
                group[k] = tuple(v)
            else:
                group[k] = v
