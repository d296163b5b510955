"""distckpt.integrations.hyperparams: saved optimizer hyper-parameters (JSON from a checkpoint)
checked against the live param groups before they are set."""

from __future__ import annotations

import pytest
import torch

from distckpt.errors import ManifestCorruptError
from distckpt.integrations import hyperparams


def _groups():
    p = torch.nn.Parameter(torch.ones(2))
    return torch.optim.Adam([p], lr=torch.tensor(0.01), betas=(0.9, 0.99), foreach=None).param_groups


def test_plain_groups_keep_json_values_and_leave_the_rest():
    groups = _groups()
    groups[0]["bookkeeping"] = object()
    plain = hyperparams.plain_groups(groups)[0]
    assert plain["lr"] == pytest.approx(0.01) and plain["betas"] == [0.9, 0.99] and plain["foreach"] is None
    assert "params" not in plain and "bookkeeping" not in plain


@pytest.mark.parametrize("saved, cur, ok", [
    (0.1, 0.01, True), (1, 0.5, True), (True, 0.5, False), ("abc", 0.5, False), (None, 0.5, False),
    (None, True, True), (None, False, True),  # foreach / fused: saved at their None default, set now
    (0.2, torch.tensor(0.1), True), ("x", torch.tensor(0.1), False), (0.2, torch.ones(2), False),
    (False, True, True), (1, True, False),
    ([0.8, 0.9], (0.9, 0.99), True), ([0.8], (0.9, 0.99), False), ([0.8, "x"], (0.9, 0.99), False),
    ("adam", "adamw", True), (3, "adam", False),
    (True, None, True), (None, None, True), ([1], None, False),
    (1, object(), False),
])
def test_fits(saved, cur, ok):
    assert hyperparams.fits(saved, cur) is ok


def test_check_then_set_restores_in_place_and_adds_nothing():
    groups = _groups()
    lr = groups[0]["lr"]
    groups[0]["param_names"] = ["w"]
    saved = [{"lr": 0.5, "betas": [0.8, 0.95], "foreach": True, "not_this_optimizers": 3, "params": [7],
              "param_names": ["a", "b", "c"]}]
    hyperparams.check_groups(groups, saved, path="p", key="k")
    hyperparams.set_groups(groups, saved)
    assert groups[0]["lr"] is lr and lr.item() == 0.5  # a tensor lr is filled, not replaced
    assert groups[0]["betas"] == (0.8, 0.95) and isinstance(groups[0]["betas"], tuple)
    assert groups[0]["foreach"] is True and "not_this_optimizers" not in groups[0]
    assert len(groups[0]["params"]) == 1 and groups[0]["param_names"] == ["w"]  # the live group's
    assert "param_names" not in hyperparams.plain_groups(groups)[0]


@pytest.mark.parametrize("saved", [{"lr": "abc"}, [{"lr": "abc"}], [{"betas": [0.9, 0.99, 0.5]}], [3]])
def test_a_saved_value_that_cannot_stand_is_refused_before_anything_is_set(saved):
    groups = _groups()
    before = dict(groups[0])
    with pytest.raises(ManifestCorruptError) as info:
        hyperparams.check_groups(groups, saved, path="p", key="meta.groups")
    assert info.value.details["key"] == "meta.groups"
    assert groups[0] == before
