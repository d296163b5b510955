"""PLAN at scale: summaries gathered to rank 0 only, each rank told only which of its pieces it
writes, and a plan cache that is reused only when every rank's layout is unchanged (real gloo
ranks). The cost figures themselves come from launch/bench/bench_scale.py, not from timed tests."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_ranks


def _state(rank: int, world: int, step: int, rows: int = 12):
    """A sharded weight (row-sharded: rank r holds rows [r*k, (r+1)*k)), a replicated bias and
    a step value that is the same on every rank."""
    from torch.distributed.tensor import DeviceMesh, Shard, Replicate, distribute_tensor
    mesh = DeviceMesh("cpu", list(range(world)))
    torch.manual_seed(step)
    full = torch.randn(rows, 4)
    bias = torch.randn(4)
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": distribute_tensor(bias, mesh, [Replicate()]),
            "step": step}, full, bias


def _body(rank, world, root):
    import distckpt
    from distckpt import errors, saveplan
    out = []
    for step in range(3):  # same layout every time: the first plans, the next two reuse
        sd, full, bias = _state(rank, world, step)
        res = distckpt.save(sd, f"{root}/s{step}")
        out.append(res.plan_cached)
        back = distckpt.read(f"{root}/s{step}")
        assert torch.equal(back["w"], full) and torch.equal(back["b"], bias) and back["step"] == step
    # Values that differ between ranks are caught although the layout (and so the plan) is cached:
    # a non-tensor value, and a plain (replicated) tensor's content.
    sd, _, _ = _state(rank, world, 3)
    sd["step"] = rank
    with pytest.raises(errors.StateDictMismatchError, match="'step' differs"):
        distckpt.save(sd, f"{root}/bad")
    sd, _, _ = _state(rank, world, 3)
    sd["plain"] = torch.full((2,), float(rank))
    distckpt.save(dict(sd, plain=torch.zeros(2)), f"{root}/plain_ok")
    with pytest.raises(errors.StateDictMismatchError, match="'plain' differs"):
        distckpt.save(sd, f"{root}/plain_bad")
    # One rank's layout changes (a new key): a full plan on every rank, never the stale one.
    sd, full, bias = _state(rank, world, 4)
    sd["extra"] = torch.arange(3.0)
    res = distckpt.save(sd, f"{root}/s4")
    out.append(res.plan_cached)
    assert torch.equal(distckpt.read(f"{root}/s4")["extra"], torch.arange(3.0))
    # Back to the first layout: it differs from the last plan's (the cache holds one plan), so it plans.
    sd, full, bias = _state(rank, world, 5)
    res = distckpt.save(sd, f"{root}/s5")
    out.append(res.plan_cached)
    # Caches out of step: rank 1 forgets its plan (it sends its full layout while rank 0 says
    # "same"), then rank 0 forgets (rank 1 says "same" for a plan rank 0 no longer holds): each
    # time every rank sends its layout again, once, and the plan is merged anew, never guessed.
    for who, step in ((1, 6), (0, 7)):
        if rank == who:
            saveplan._PLAN_CACHE.clear()
        sd, full, bias = _state(rank, world, step)
        res = distckpt.save(sd, f"{root}/s{step}")
        out.append(res.plan_cached)
        back = distckpt.read(f"{root}/s{step}")
        assert torch.equal(back["w"], full) and torch.equal(back["b"], bias) and back["step"] == step
    return out


def test_plan_is_cached_only_while_every_layout_is_unchanged(tmp_path):
    r0, r1 = run_ranks(_body, 2, str(tmp_path))
    assert r0 == r1
    # s0 plans, s1/s2 reuse (plain_ok plans a layout with 'plain', plain_bad reuses it and fails
    # its value check); s4 (new key) plans; s5 (key removed again) plans; s6 and s7 plan after
    # the resend round.
    assert r0 == [False, True, True, False, False, False, False]


def test_single_process_saves_use_the_cache_too(tmp_path):
    import distckpt
    sd = {"w": torch.arange(6.0), "meta": {"lr": 0.1}}
    assert distckpt.save(sd, tmp_path / "a").plan_cached is False
    sd["w"] += 1
    sd["meta"]["lr"] = 0.2
    res = distckpt.save(sd, tmp_path / "b")
    assert res.plan_cached is True
    # The phases of a blocking save account for its whole time.
    assert set(res.phase_seconds) == {"plan", "prepare", "write", "commit"}
    assert all(v >= 0 for v in res.phase_seconds.values())
    assert abs(sum(res.phase_seconds.values()) - res.seconds) < 0.05 * res.seconds + 1e-3, res
    back = distckpt.read(tmp_path / "b")
    assert torch.equal(back["w"], sd["w"]) and back["meta"] == {"lr": 0.2}
    sd["w2"] = torch.zeros(2)
    assert distckpt.save(sd, tmp_path / "c").plan_cached is False


def test_a_reused_plan_re_encodes_only_what_changes_per_save(tmp_path, monkeypatch):
    """A save whose plan comes from the cache commits a MANIFEST re-encoded only in its per-save
    fields (commit.manifest_bytes -> mf.encode_next): the bytes are those of a whole encode, and
    a changed layout encodes whole again."""
    import distckpt
    from distckpt import manifest as mf
    calls = []
    whole = mf.encode_manifest
    monkeypatch.setattr(mf, "encode_manifest", lambda m: calls.append(m.save_id) or whole(m))
    sd = {"w": torch.arange(6.0), "opt": {"step": 1, "lr": 0.1, "name": "a"}}
    for i, name in enumerate("abc"):
        sd["w"] += 1
        sd["opt"].update(step=i, name=name * (i + 1))
        res = distckpt.save(sd, tmp_path / name)
        assert res.plan_cached is (i > 0)
        data = (tmp_path / name / "MANIFEST").read_bytes()
        assert whole(mf.decode_header(data)).data == data   # what a whole encode writes
        back = distckpt.read(tmp_path / name)
        assert torch.equal(back["w"], sd["w"]) and back["opt"] == sd["opt"]
    assert len(calls) == 1                      # only the first save encoded everything
    sd["w2"] = torch.zeros(2)
    distckpt.save(sd, tmp_path / "d")
    assert len(calls) == 2 and distckpt.read(tmp_path / "d")["w2"].shape == (2,)
