"""distckpt.containers: dict subclasses recorded at save and rebuilt after a whole-tree read, through
a real save and read on disk; what cannot come back as its own type is refused by name."""

from __future__ import annotations

import collections

import msgpack
import pytest
import torch

import distckpt
from distckpt import containers
from distckpt.errors import ManifestCorruptError, UnsupportedValueError


def _state() -> dict:
    od = collections.OrderedDict([("w", torch.arange(4.0)), ("b", torch.ones(2))])
    od._metadata = collections.OrderedDict([("", {"version": 1}), ("sub", {"version": 2})])
    return {
        "module": od,
        "sched": {"milestones": collections.Counter({4: 1, 9: 2}), "last_epoch": 3, "gamma": 0.1},
        "counts": collections.defaultdict(int, {"seen": 3}),
        "lists": collections.defaultdict(list, {"a": [1, 2]}),
        "plain": collections.defaultdict(None, {"x": 1}),
        "nested": [{"inner": collections.Counter("aab")}, {"t": torch.zeros(1)}],
        "counter_of_str": collections.Counter({"n": 2}),
    }


def _same(a, b, where="") -> None:
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, collections.defaultdict):
        assert a.default_factory is b.default_factory, where
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_a_whole_tree_read_gets_its_containers_back(tmp_path):
    state = _state()
    records = containers.record(state)
    # records are plain data: they survive msgpack, as the integrations store them
    records = msgpack.unpackb(msgpack.packb(records, use_bin_type=True), raw=False, strict_map_key=False)
    distckpt.save(state, str(tmp_path / "c"), no_dist=True)
    tree = distckpt.read(str(tmp_path / "c"))
    assert type(tree["sched"]["milestones"]) is dict  # what read alone gives: plain dicts
    rebuilt = containers.rebuild(tree, records, where="records", path=str(tmp_path))
    _same(state, rebuilt)
    assert rebuilt["module"]._metadata == state["module"]._metadata
    rebuilt["counts"]["new"] += 1  # the factory works
    assert rebuilt["sched"]["milestones"][4] == 1 and list(rebuilt["nested"][0]["inner"].elements()) == ["a", "a", "b"]


def test_an_ordered_dict_root_is_rebuilt():
    tree = {"a": 1, "b": 2}
    out = containers.rebuild(tree, containers.record(collections.OrderedDict(tree)), where="r", path=None)
    assert type(out) is collections.OrderedDict and list(out) == ["a", "b"]


class _MyDict(dict):
    pass


class _Stateful:
    def state_dict(self):
        return {"x": 1}

    def load_state_dict(self, sd):
        pass


class _MyList(list):
    pass


@pytest.mark.parametrize("value, what", [
    (collections.defaultdict(lambda: 0), "default_factory"),
    (collections.defaultdict(collections.Counter), "default_factory"),
    (_MyDict(a=1), "dict subclass"),
    (_Stateful(), "state_dict()"),
    (_MyList([torch.zeros(1)]), "holding tensors"),
])
def test_what_would_come_back_as_another_type_is_refused_by_key(value, what):
    with pytest.raises(UnsupportedValueError) as info:
        containers.record({"outer": {"here": value}})
    assert "'outer.here'" in str(info.value) and what in str(info.value)


@pytest.mark.parametrize("records, why", [
    ({"not": "a list"}, "expected a list"),
    ([[["missing"], None, None]], "names no dict"),
    ([[["x"], None, None]], "is not a dict"),
    ([[["d"], None, None, "Deque", None]], "no container type"),
    ([[["d"], None, None, "defaultdict", "eval"]], "no container type"),
    ([["d", None]], "not a container record"),
    # crafted: an unhashable factory name, a _metadata that is no dict (TypeError / ValueError before)
    ([[["d"], None, None, "defaultdict", ["int"]]], "no container type"),
    ([[["d"], None, None, "defaultdict", {"a": 1}]], "no container type"),
    ([[["d"], "bogus", 5]], "not a dict"),
    ([[["d"], "bogus", "ab"]], "not a dict"),
    ([[["d"], "value", {"t": "int", "v": 5}]], "not a dict"),
])
def test_malformed_records_are_a_corrupt_manifest(records, why):
    with pytest.raises(ManifestCorruptError, match=why):
        containers.rebuild({"d": {"k": 1}, "x": 5}, records, where="records", path="/ckpt")
