"""distckpt.safepickle: pickles of plain data and tensors decoded without running code."""

from __future__ import annotations

import collections
import io
import os
import pickle

import pytest
import torch

from distckpt import safepickle
from distckpt.errors import CheckpointCorruptError, PickleNotAllowedError


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _StorageRunsCode:
    """A tensor storage whose torch.save bytes hold a pickle that runs code (a plain pickle's
    storage loader calls torch.load(weights_only=False) on them)."""

    def __init__(self, marker):
        buf = io.BytesIO()
        torch.save(_RunsCode(marker), buf)
        self.data = buf.getvalue()

    def __reduce__(self):
        import torch.storage
        return (torch.storage._load_from_bytes, (self.data,))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_plain_data_and_tensors_round_trip_at_every_protocol(protocol):
    value = {"gen": torch.Generator().manual_seed(3).get_state(), "t": torch.arange(6.0).view(2, 3)[:, 1:],
             "nested": [1, 2.5, {"a": (None, True)}], "s": {1, 2}, "f": frozenset([3]), "b": b"\x00x",
             "c": 1 + 2j, "od": collections.OrderedDict(b=1, a=2), "big": 1 << 70}
    got = safepickle.loads(pickle.dumps(value, protocol=protocol))
    assert torch.equal(got.pop("gen"), value["gen"]) and torch.equal(got.pop("t"), value["t"])
    assert got == {k: v for k, v in value.items() if k not in ("gen", "t")}
    assert type(got["od"]) is collections.OrderedDict


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_the_plain_types_of_real_dataloader_states_round_trip(protocol):
    """What datasets and samplers keep in their state: numpy scalars, arrays and a RandomState's
    state, collections' containers, datetimes, torch sizes, dtypes and Parameters (each was
    refused, a resume stuck on PickleNotAllowedError)."""
    import datetime

    import numpy as np
    value = {"i": np.int64(3), "f": np.float32(1.5), "arr": np.arange(6).reshape(2, 3),
             "rs": np.random.RandomState(0).get_state(), "npdt": np.dtype("float32"), "size": torch.Size([2, 3]),
             "dtype": torch.bfloat16, "param": torch.nn.Parameter(torch.ones(2)), "c": collections.Counter(a=2),
             "dq": collections.deque([1, 2]), "dd": collections.defaultdict(int, a=1), "r": range(3),
             "sl": slice(1, 2), "when": datetime.datetime(2026, 1, 2), "ba": bytearray(b"xy")}
    got = safepickle.loads(pickle.dumps(value, protocol=protocol))
    assert np.array_equal(got.pop("arr"), value["arr"]) and type(got["param"]) is torch.nn.Parameter
    assert torch.equal(got.pop("param"), value["param"])
    rs = got.pop("rs")
    assert rs[0] == value["rs"][0] and np.array_equal(rs[1], value["rs"][1]) and rs[2:] == value["rs"][2:]
    assert got == {k: v for k, v in value.items() if k not in ("arr", "param", "rs")}
    assert type(got["dd"]) is collections.defaultdict and got["dd"].default_factory is int


@pytest.mark.parametrize("make", [_RunsCode, _StorageRunsCode])
def test_what_would_run_code_is_refused_and_does_not_run(tmp_path, make):
    marker = tmp_path / "ran"
    data = pickle.dumps({"state": make(str(marker))})
    with pytest.raises(PickleNotAllowedError) as info:
        safepickle.check(data, key="dataloader.dp_rank_0", path="p")
    assert info.value.details["keys"] == ["dataloader.dp_rank_0"] and not marker.exists()
    assert "which is not plain data" in info.value.message


@pytest.mark.parametrize("data", [b"", b"not a pickle", pickle.dumps({"a": 1})[:-3]])
def test_bytes_that_are_no_pickle_are_corrupt(data):
    with pytest.raises(CheckpointCorruptError):
        safepickle.check(data, key="k", path=None)
