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


@pytest.mark.parametrize("make", [_RunsCode, _StorageRunsCode])
def test_what_would_run_code_is_refused_and_does_not_run(tmp_path, make):
    marker = tmp_path / "ran"
    data = pickle.dumps({"state": make(str(marker))})
    with pytest.raises(PickleNotAllowedError) as info:
        safepickle.check(data, key="dataloader.dp_rank_0", path="p")
    assert info.value.details["keys"] == ["dataloader.dp_rank_0"] and not marker.exists()


@pytest.mark.parametrize("data", [b"", b"not a pickle", pickle.dumps({"a": 1})[:-3]])
def test_bytes_that_are_no_pickle_are_corrupt(data):
    with pytest.raises(CheckpointCorruptError):
        safepickle.check(data, key="k", path=None)
