"""distckpt.tensorrecords: what a whole-tree read does not give back as torch.save does
(Parameters, requires_grad, one object under two keys, tied memory), recorded and put back; and
forged records, which come from a checkpoint's metadata, refused with ManifestCorruptError."""

from __future__ import annotations

import copy

import pytest
import torch

from distckpt import tensorrecords
from distckpt.errors import ManifestCorruptError


def _as_read(tree):
    """What a whole-tree read gives: plain tensors, each key its own copy, nothing requiring grad."""
    if isinstance(tree, dict):
        return {k: _as_read(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_as_read(v) for v in tree]
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone().as_subclass(torch.Tensor).requires_grad_(False)
    return copy.deepcopy(tree)


def test_zero_size_tensor_under_two_keys_is_one_object_as_with_torch_save():
    """A tensor without memory (numel 0) under two keys came back as two objects: aliases were
    found by memory only (a review)."""
    z = torch.nn.Parameter(torch.zeros(0))
    tree = {"a": z, "b": z, "c": torch.zeros(0)}
    got = tensorrecords.restore(_as_read(tree), tensorrecords.record(tree), where="t", path="p")
    assert got["a"] is got["b"] and type(got["a"]) is torch.nn.Parameter
    assert got["c"] is not got["a"]


@pytest.mark.parametrize("rec", [
    ["param", ["step"], True],               # an integer tensor cannot require grad
    ["alias", ["step2"], ["step"], False, True],
    ["grad", ["w", 2 ** 63]],                # a path that indexes into a tensor
    ["param", ["w", 0], True],
    ["grad", ["w", None]],
    ["alias", ["w", [0, 1]], ["w"], True, None],
])
def test_forged_records_are_manifest_corrupt_never_torch_errors(rec):
    tree = {"w": torch.ones(3), "step": torch.tensor(4), "step2": torch.tensor(4)}
    with pytest.raises(ManifestCorruptError):
        tensorrecords.restore(tree, [rec], where="meta.user.x.tensors", path="/ck")
