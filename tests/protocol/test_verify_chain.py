"""``distckpt.verify.verify`` of a delta checks its incremental chain, as ``distckpt verify`` does
(one implementation: the command line prints the library's report)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import distckpt
from distckpt.cli import main as cli
from distckpt.errors import ChainBrokenError
from distckpt.incremental import IncrementalPolicy, IncrementalSaver, verify_chain
from distckpt.verify import verify


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(2000, 8, generator=g), "lin": torch.randn(3, 3, generator=g), "step": 0}


@pytest.fixture
def chain(tmp_path):
    """c0 (full) <- c1 <- c2 (deltas) under tmp_path."""
    saver = IncrementalSaver(IncrementalPolicy(rows={"emb": 0}, full_every=10, max_chain_fraction=5.0,
                                               max_delta_fraction=0.9))
    sd = _state(1)
    for k in range(3):
        sd["emb"][k * 10:k * 10 + 5] += 1.0
        sd["step"] = k
        saver.save(sd, str(tmp_path / f"c{k}"))
    assert saver.last_kind == "delta"
    return tmp_path


def _flip(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[100] ^= 0xFF  # inside the first chunk
    open(path, "wb").write(bytes(data))


def test_verify_of_a_sound_delta_covers_its_links(chain):
    report = verify(str(chain / "c2"))
    assert report.ok and report.chain == [str(chain / "c2"), str(chain / "c1"), str(chain / "c0")]
    assert [r.path for r in report.links] == [str(chain / "c1"), str(chain / "c0")]
    assert all(r.blocks_checked == r.blocks_expected > 0 for r in (report, *report.links))
    assert [p for p, _ in verify_chain(chain / "c2")] == report.chain


def test_verify_of_a_delta_with_a_damaged_link_is_not_ok(chain, capsys):
    _flip(str(chain / "c0" / "rank00000.bin"))
    report = verify(str(chain / "c2"))
    assert report.own_ok and not report.ok
    assert report.damaged_links == [str(chain / "c0")]
    assert report.links[-1].bad_blocks
    assert cli(["verify", str(chain / "c2"), "--no-progress"]) == 1
    assert "chain DAMAGED: c0" in capsys.readouterr().out
    assert cli(["verify", "--json", str(chain / "c2")]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["json_format"] == 1
    assert [d["ok"] for d in doc["links"]] == [True, True, False]


@pytest.mark.parametrize("how", ["deleted", "replaced", "uncommitted"])
def test_verify_of_a_delta_with_a_broken_chain_raises(chain, how):
    link = chain / "c1"
    if how == "deleted":
        shutil.rmtree(link)
    elif how == "replaced":  # another save under the link's name: its save id differs
        shutil.rmtree(link)
        distckpt.save(_state(2), str(link), no_dist=True)
    else:
        os.unlink(link / "MANIFEST")
    with pytest.raises(ChainBrokenError) as ei:
        verify(str(chain / "c2"))
    assert ei.value.link == str(link)
    assert cli(["verify", str(chain / "c2"), "--no-progress"]) == 1
