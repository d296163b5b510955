"""Incremental chains at their edges (distckpt.incremental, docs/INCREMENTAL.md): a delta is
written only against a chain it can be composed into exactly.

* a tracked tensor whose dtype or global shape changed (a model loaded in another dtype or onto
  another column split, then resumed) starts a full link: a delta's rows are composed into the
  base's tensor, so they would be rounded to its dtype or cut to its shape;
* a chain written before links recorded their tensors' shapes and dtypes, whose delta rows are
  wider than its base's dtype, is refused at load (ChainBrokenError), never rounded;
* a chain whose older link was deleted makes the next save full (the previous link alone being
  there is not enough);
* a delta checks the replicas of plain tracked tensors across ranks, as a full save does
  (StateDictMismatchError on every rank; ``replicated="rank0"`` opts out);
* ranks that disagree about the link (``force_full`` on one rank, a saver rebuilt on one rank)
  all write a full link, instead of one rank saving a delta while another saves in full, each
  waiting for the other in a different collective.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import distckpt
import distckpt.incremental as inc
from distckpt.cli import main as cli
from distckpt.errors import ChainBrokenError, StateDictMismatchError
from distckpt.incremental import IncrementalPolicy, IncrementalSaver, chain_of
from distckpt.verify import verify
from tests.helpers.distributed import RankError, run_ranks

pytestmark = pytest.mark.timeout(300)

POLICY = dict(rows={"emb": 0}, full_every=10, max_delta_fraction=0.9, max_chain_fraction=5.0)


def _emb(dtype=torch.float16, cols: int = 8) -> dict:
    g = torch.Generator().manual_seed(1)
    return {"emb": torch.randn(200, cols, generator=g).to(dtype), "step": 0}


def _kinds(path: str) -> list[str]:
    return [link.meta["kind"] for link in chain_of(path)]


def test_a_dtype_change_starts_a_full_link(tmp_path):
    saver = IncrementalSaver(IncrementalPolicy(**POLICY))
    sd = _emb(torch.float16)
    saver.save(sd, tmp_path / "s1")
    sd["emb"][3] += 1
    saver.save(sd, tmp_path / "s2")
    assert saver.last_kind == "delta"
    # The job restarts in fp32 (loaded with an exact widening cast, then resumed: the digests are
    # the fp32 rows'), and writes values fp16 cannot hold.
    wide = {"emb": sd["emb"].float(), "step": 3}
    saver = IncrementalSaver(IncrementalPolicy(**POLICY))
    saver.resume(wide, tmp_path / "s2")
    wide["emb"][5] = 1.0 + 2.0 ** -20
    saver.save(wide, tmp_path / "s3")
    assert saver.last_kind == "full"
    assert _kinds(str(tmp_path / "s3")) == ["full"]
    wide["emb"][7] = 3.0 + 2.0 ** -19
    saver.save(wide, tmp_path / "s4")
    assert saver.last_kind == "delta"
    got = distckpt.read(str(tmp_path / "s4"))["emb"]
    assert got.dtype == torch.float32 and torch.equal(got, wide["emb"])


def test_a_chain_that_changed_dtype_before_links_recorded_it_is_refused(tmp_path, monkeypatch):
    """Chains written by savers that did not record shapes and dtypes (monkeypatched here) may
    hold fp32 rows over an fp16 base: the load refuses them rather than round the rows."""
    monkeypatch.setattr(inc, "_shapes", lambda items, rows: None)
    saver = IncrementalSaver(IncrementalPolicy(**POLICY))
    sd = _emb(torch.float16)
    saver.save(sd, tmp_path / "s1")
    wide = {"emb": sd["emb"].float(), "step": 1}
    saver = IncrementalSaver(IncrementalPolicy(**POLICY))
    saver.resume(wide, tmp_path / "s1")
    wide["emb"][5] = 1.0 + 2.0 ** -20
    saver.save(wide, tmp_path / "s2")
    assert saver.last_kind == "delta"   # what the old saver did
    monkeypatch.undo()
    with pytest.raises(ChainBrokenError, match="cannot be composed without rounding"):
        distckpt.read(str(tmp_path / "s2"))
    target = {"emb": torch.zeros(200, 8), "step": -1}
    with pytest.raises(ChainBrokenError, match="cannot be composed without rounding"):
        distckpt.load(target, str(tmp_path / "s2"))


def test_a_shape_change_starts_a_full_link_also_after_resume(tmp_path):
    saver = IncrementalSaver(IncrementalPolicy(**POLICY))
    sd = _emb(torch.float32, cols=8)
    saver.save(sd, tmp_path / "s1")
    sd["emb"][3] += 1
    saver.save(sd, tmp_path / "s2")
    assert saver.last_kind == "delta"
    # The same rows, fewer columns (per-row state of another column split): the same saver...
    narrow = {"emb": sd["emb"][:, :4].clone(), "step": 2}
    saver.save(narrow, tmp_path / "s3")
    assert saver.last_kind == "full"
    # ...and a new saver resumed from the wide chain onto the narrow state.
    again = IncrementalSaver(IncrementalPolicy(**POLICY))
    again.resume(narrow, tmp_path / "s2")
    narrow["emb"][9] += 1
    again.save(narrow, tmp_path / "s4")
    assert again.last_kind == "full"
    assert torch.equal(distckpt.read(str(tmp_path / "s4"))["emb"], narrow["emb"])


def test_a_deleted_older_link_makes_the_next_save_full(tmp_path):
    saver = IncrementalSaver(IncrementalPolicy(**POLICY))
    sd = _emb(torch.float32)
    for i in (1, 2, 3):
        sd["emb"][i] += 1
        saver.save(sd, tmp_path / f"s{i}")
    assert _kinds(str(tmp_path / "s3")) == ["delta", "delta", "full"]
    shutil.rmtree(tmp_path / "s2")   # s3, the previous link, is still there; its chain is not
    sd["emb"][4] += 1
    saver.save(sd, tmp_path / "s4")
    assert saver.last_kind == "full"
    assert torch.equal(distckpt.read(str(tmp_path / "s4"))["emb"], sd["emb"])


def _diverging_replica(rank: int, world: int, root: str, replicated: str) -> str:
    saver = IncrementalSaver(IncrementalPolicy(**POLICY))
    sd = _emb(torch.float32)   # a plain tensor: a replica on every rank
    saver.save(sd, f"{root}/s1")
    sd["emb"][3] += 1
    if rank == 1:
        sd["emb"][4] += 1   # rank 1's copy is no replica any more
    try:
        saver.save(sd, f"{root}/s2", replicated=replicated)
    except StateDictMismatchError as exc:
        return f"StateDictMismatchError: {exc}"
    return saver.last_kind


def test_a_delta_checks_plain_tensor_replicas_like_a_full_save(tmp_path):
    out = run_ranks(_diverging_replica, 2, str(tmp_path / "check"), "check", timeout=240)
    assert all(o.startswith("StateDictMismatchError") and "'emb' differs between ranks" in o for o in out), out
    assert _kinds(str(tmp_path / "check" / "s1")) == ["full"]
    assert not (tmp_path / "check" / "s2").exists()
    try:
        out = run_ranks(_diverging_replica, 2, str(tmp_path / "rank0"), "rank0", timeout=240)
    except RankError as exc:  # pragma: no cover - the message is the diagnosis
        pytest.fail(str(exc))
    assert out == ["delta", "delta"]
    got = distckpt.read(str(tmp_path / "rank0" / "s2"))["emb"]
    want = _emb(torch.float32)["emb"]
    want[3] += 1
    assert torch.equal(got, want)   # rank 0's copy, as asked


def _disagreeing(rank: int, world: int, root: str, how: str) -> str:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    emb = distribute_tensor(torch.arange(800.).reshape(200, 4), mesh, [Shard(0)])
    sd = {"emb": emb, "step": 0}
    policy = IncrementalPolicy(**dict(POLICY, rows=None))
    saver = IncrementalSaver(policy)
    saver.save(sd, f"{root}/s1")
    emb.to_local()[3] += 1
    if how == "rebuilt" and rank == 1:
        saver = IncrementalSaver(policy)   # this rank lost its saver (and its chain) alone
    saver.save(sd, f"{root}/s2", force_full=(how == "force_full" and rank == 1))
    return saver.last_kind


@pytest.mark.parametrize("how", ["force_full", "rebuilt"])
def test_ranks_that_disagree_about_the_link_all_write_it_full(tmp_path, how):
    try:
        out = run_ranks(_disagreeing, 2, str(tmp_path), how, timeout=240)
    except RankError as exc:  # pragma: no cover - the message is the diagnosis
        pytest.fail(str(exc))
    assert out == ["full", "full"]
    assert _kinds(str(tmp_path / "s2")) == ["full"]
    why = chain_of(str(tmp_path / "s2"))[0].meta["why"]
    assert "on rank 1; not on every rank" in why, why
    want = torch.arange(800.).reshape(200, 4)
    want[[3, 103]] += 1   # local row 3 of each rank's shard of 100 rows
    assert torch.equal(distckpt.read(str(tmp_path / "s2"))["emb"], want)


def _crafted_delta_cases(good):
    def records(box=([0, 0], [100, 8]), ids=(3, 50), rows=None, index="0"):
        box = [list(b) for b in box] if isinstance(box[0], (list, tuple)) else list(box)
        ids_t = ids if torch.is_tensor(ids) or isinstance(ids, list) else torch.tensor(list(ids), dtype=torch.int32)
        rows = rows if rows is not None else torch.stack([good["emb"][3], good["emb"][50]])
        return {index: {"r0p0": {"box": box, "ids": ids_t, "rows": rows}}}
    return {
        "box_of_ints": ({"_incr": records(box=(0, 100))}, {}),
        "ids_2d": ({"_incr": records(ids=torch.tensor([[3, 50]], dtype=torch.int32))}, {}),
        "ids_unsorted": ({"_incr": records(ids=(50, 3))}, {}),
        "ids_outside": ({"_incr": records(ids=(3, 150))}, {}),
        "ids_a_value": ({"_incr": records(ids=[3, 50])}, {}),   # a bare KeyError before
        "record_of_no_tracked_tensor": ({"_incr": records(index="5")}, {}),
        "seq_str": ({"_incr": records()}, {"seq": "1"}),
        "tracked_missing": ({"_incr": records()}, {"tracked": None}),
        "tracked_dim_str": ({"_incr": records()}, {"tracked": [["emb", "x"]]}),
        "kind_other": ({"_incr": records()}, {"kind": "partial"}),
    }


def test_crafted_chain_metadata_and_delta_records_are_chain_broken(tmp_path):
    """A delta link's chain metadata and its records are data from the checkpoint: crafted ones
    raised KeyError / TypeError / ValueError in the chain walk and the row planning, and two
    loaded silently wrong (unsorted row ids scattered rows to the wrong places; a record under a
    number no tracked tensor has was skipped, its rows lost). Now ChainBrokenError, from load and
    read alike, before a byte of the delta is copied; a load's error names the tensors the base's
    pass had filled (filled / partly_filled), as a checksum error does."""
    import copy
    import shutil

    from distckpt.errors import ChainBrokenError
    from distckpt.incremental import IncrementalPolicy, IncrementalSaver
    torch.manual_seed(0)
    sd = {"emb": torch.randn(100, 8), "dense": torch.randn(4)}
    saver = IncrementalSaver(IncrementalPolicy(rows={"emb": 0}, full_every=8, max_delta_fraction=0.9,
                                               max_chain_fraction=0.9))
    saver.save(sd, str(tmp_path / "step_1"))
    sd["emb"][3] += 1
    sd["emb"][50] += 2
    saver.save(sd, str(tmp_path / "step_2"))
    info = distckpt.read_manifest(str(tmp_path / "step_2"))["meta"]["user"]["distckpt.chain"]
    assert info["kind"] == "delta"
    good = {k: v.clone() for k, v in sd.items()}
    for name, (extra, info_change) in _crafted_delta_cases(good).items():
        meta = copy.deepcopy(info)
        for k, v in info_change.items():
            if v is None:
                meta.pop(k)
            else:
                meta[k] = v
        path = tmp_path / name
        distckpt.save({"dense": good["dense"].clone(), **extra}, str(path), no_dist=True,
                      metadata={"distckpt.chain": meta})
        with pytest.raises(ChainBrokenError):
            distckpt.read(str(path))
        dest = {"emb": torch.zeros(100, 8), "dense": torch.zeros(4)}
        with pytest.raises(ChainBrokenError) as raised:
            distckpt.load(dest, str(path), no_dist=True)
        if info_change:  # the chain's structure: refused before a byte is read, and by verify
            assert not dest["emb"].any() and not dest["dense"].any(), name
            with pytest.raises(ChainBrokenError):
                verify(str(path))
        else:  # its records are planned beside the base's pass: the error names what that filled
            # ('emb' holds the base's rows, not the chain's: partly filled)
            assert raised.value.filled == ["dense"] and raised.value.partly_filled == ["emb"], (name, raised.value.details)
            # verify fails what load refuses (its checksums all match): a problem of the MANIFEST
            report = verify(str(path))
            assert not report.ok and [p.file for p in report.file_problems] == ["MANIFEST"], (name, report)
        shutil.rmtree(path)
    # the same records, uncrafted, load exactly (the cases above differ from it in one thing each)
    assert verify(str(tmp_path / "step_2")).ok
    back = {"emb": torch.zeros(100, 8), "dense": torch.zeros(4)}
    distckpt.load(back, str(tmp_path / "step_2"), no_dist=True)
    assert torch.equal(back["emb"], good["emb"]) and torch.equal(back["dense"], good["dense"])


def test_a_save_that_replaces_a_link_of_its_own_chain_is_full_or_refused(tmp_path):
    """An incremental save with overwrite=True into a link of the chain it extends was written as
    a delta of that very link: it returned, the good checkpoint was gone, and the new one named
    itself as its parent (ChainBrokenError, "a cycle", on every load; an outside trial). Such a
    save is now written full. An incremental manager's overwrite of a step that other kept steps
    depend on (they would never load again) is refused with CheckpointExistsError, before
    anything is written."""
    from distckpt.errors import CheckpointExistsError
    policy = IncrementalPolicy(**POLICY)
    # A fixed path, saved again.
    saver = IncrementalSaver(policy)
    sd = _emb()
    saver.save(sd, tmp_path / "latest")
    sd["emb"][3] += 1
    saver.save(sd, tmp_path / "latest", overwrite=True)
    assert saver.last_kind == "full" and _kinds(str(tmp_path / "latest")) == ["full"]
    out = {"emb": torch.zeros(200, 8, dtype=torch.float16), "step": -1}
    distckpt.load(out, tmp_path / "latest", no_dist=True)
    assert torch.equal(out["emb"], sd["emb"])
    # A manager: the newest step saved again; then an older link others depend on.
    mgr = distckpt.CheckpointManager(tmp_path / "root", incremental=policy)
    for s in (100, 200, 300):
        sd["emb"][s // 100] += 1
        mgr.save(s, sd, no_dist=True)
    assert _kinds(mgr.path(300)) == ["delta", "delta", "full"]
    sd["emb"][7] += 1
    mgr.save(300, sd, overwrite=True, no_dist=True)
    assert _kinds(mgr.path(300)) == ["full"]
    assert mgr.load(out, no_dist=True).path.endswith("step_00000300") and torch.equal(out["emb"], sd["emb"])
    sd["emb"][8] += 1
    mgr.save(400, sd, no_dist=True)  # a delta of 300
    before = open(f"{mgr.path(300)}/MANIFEST", "rb").read()
    with pytest.raises(CheckpointExistsError, match="incremental chain of"):
        mgr.save(300, sd, overwrite=True, no_dist=True)
    assert open(f"{mgr.path(300)}/MANIFEST", "rb").read() == before
    assert mgr.load(out, step=400, no_dist=True) is not None and torch.equal(out["emb"], sd["emb"])
    # The manager's own replacement of an abandoned step is refused alike (an outside trial: it
    # was not checked, and step 350, saved against 400 and kept, never loaded again).
    fresh = distckpt.CheckpointManager(tmp_path / "root", incremental=policy)
    fresh.load(out, step=400, no_dist=True)
    out["emb"][9] += 1
    fresh.save(350, out, no_dist=True)                       # a delta of 400
    want = out["emb"].clone()
    back = distckpt.CheckpointManager(tmp_path / "root", incremental=policy)
    back.load(out, step=200, no_dist=True)                   # 300-400 are the abandoned branch
    before = open(f"{back.path(400)}/MANIFEST", "rb").read()
    with pytest.raises(CheckpointExistsError, match="incremental chain of"):
        back.save(400, out, no_dist=True)
    assert open(f"{back.path(400)}/MANIFEST", "rb").read() == before
    assert back.load(out, step=350, no_dist=True) is not None and torch.equal(out["emb"], want)


def test_read_with_keys_returns_only_what_they_select_from_a_delta_too(tmp_path):
    """read(delta, keys=["step"]) returned {'model': {}, 'optim': {}, 'step': 1}: the delta's own
    tree holds the containers of its tracked tensors empty (their rows live in the chain), and an
    empty container was always kept (an outside trial). So was a saved empty dict that no key
    selects, from any checkpoint. An empty container is now in the result only when a key
    selects it; keys=None reads everything, empty dicts included."""
    sd = {"model": {"emb": torch.randn(100, 4), "sub": {}}, "optim": {"mom": torch.zeros(100, 4)}, "extra": {},
          "step": 0}
    saver = IncrementalSaver(IncrementalPolicy(rows={"model.emb": 0, "optim.mom": 0}))
    saver.save(sd, tmp_path / "s0")
    sd["model"]["emb"][3] += 1
    sd["step"] = 1
    saver.save(sd, tmp_path / "s1")
    assert saver.last_kind == "delta"
    for path, step in ((tmp_path / "s0", 0), (tmp_path / "s1", 1)):
        assert distckpt.read(path, keys=["step"]) == {"step": step}
        got = distckpt.read(path, keys=["model"])  # its empty dict "model.sub" is under the key
        assert list(got) == ["model"] and sorted(got["model"]) == ["emb", "sub"] and got["model"]["sub"] == {}
        everything = distckpt.read(path)
        assert everything["extra"] == {} and sorted(everything) == ["extra", "model", "optim", "step"]
    assert torch.equal(distckpt.read(tmp_path / "s1", keys=["model"])["model"]["emb"], sd["model"]["emb"])
    # Empty containers are named as flatten names them: under a "" key, ".x" (a review).
    t = torch.ones(1)
    distckpt.save({"": {"x": {}, "t": t}, "x": {"z": t}}, tmp_path / "e", no_dist=True)
    assert distckpt.read(tmp_path / "e", keys=["x"]) == {"x": {"z": t}}
    assert distckpt.read(tmp_path / "e", keys=[""]) == {"": {"x": {}, "t": t}}


def _overwrite_on_rank0_only_body(rank: int, world_size: int, root: str) -> dict:
    from distckpt.errors import CheckpointExistsError
    mgr = distckpt.CheckpointManager(root, incremental=IncrementalPolicy(**POLICY))
    sd = _emb()
    mgr.save(1, sd)
    sd["emb"][3] += 1
    mgr.save(2, sd)  # a delta of step 1
    out = {}
    try:  # overwrite=True on rank 0 only: it alone acts on it (its prepare), as before
        mgr.save(1, sd, overwrite=rank == 0)
        out["overwrite"] = "saved"
    except CheckpointExistsError as exc:
        out["overwrite"] = "refused" if "incremental chain of" in exc.message else exc.message
    if rank == 1:  # one rank saves alone into its own directory: no collective, nothing waits
        saver = distckpt.CheckpointManager(os.path.join(root, "..", "alone"), incremental=IncrementalPolicy(**POLICY))
        saver.save(7, sd, no_dist=True)
        out["alone"] = saver.steps()
    out["steps"] = mgr.steps()
    return out


def test_incremental_saves_with_overwrite_on_one_rank_or_no_dist_neither_hang_nor_garble(tmp_path):
    """A review: the refusal of an overwrite that breaks a chain ran its exchange only on ranks
    that passed overwrite=True (with rank 0 alone passing it, the exchange paired with the
    incremental decision's all-gather: a TypeError on one rank, an AttributeError on the other);
    and an incremental manager's no_dist save waited at the arrival check for ranks that were not
    saving. Every incremental save now exchanges the refusal's outcome, and no_dist decides
    alone."""
    results = run_ranks(_overwrite_on_rank0_only_body, 2, str(tmp_path / "root"), timeout=240,
                        env={"DISTCKPT_TIMEOUT_S": "60", "DISTCKPT_ARRIVAL_TIMEOUT_S": "30"})
    assert [r["overwrite"] for r in results] == ["refused", "refused"], results
    assert results[1]["alone"] == [7] and all(r["steps"] == [1, 2] for r in results), results


def test_convert_of_a_delta_writes_the_state_its_chain_composes(tmp_path):
    """convert of a delta writes the state distckpt.read composes from its chain (the full base's
    tracked tensor, every delta's newest rows over it, the delta's own values), for every target,
    bit for bit, with slices smaller than the table (rows changed on both sides of a slice's
    edge). Before, every target wrote the delta's internal records (``_incr.*``) instead of the
    table; then convert refused a delta."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from distckpt.convert import convert

    g = torch.Generator().manual_seed(3)
    sd = {"tables": {"emb": torch.randn(4096, 128, generator=g)}, "dense": {"w": torch.randn(3, 5, generator=g)},
          "step": 0, "cfg": {}}
    saver = IncrementalSaver(IncrementalPolicy(rows={"tables.emb": 0}, full_every=10, max_delta_fraction=0.9,
                                               max_chain_fraction=5.0))
    saver.save(sd, tmp_path / "s1")
    for step, rows in ((1, [5, 511, 512, 4095]), (2, [512, 513, 2000])):
        sd["tables"]["emb"][rows] = float(step) * 100 + torch.arange(len(rows), dtype=torch.float32)[:, None]
        sd["dense"]["w"] += 1
        sd["step"] = step
        saver.save(sd, tmp_path / f"s{step + 1}")
        assert saver.last_kind == "delta"
    delta = str(tmp_path / "s3")
    want = distckpt.read(delta)
    assert torch.equal(want["tables"]["emb"], sd["tables"]["emb"]) and want["step"] == 2 and want["cfg"] == {}
    flat = {"tables.emb": sd["tables"]["emb"], "dense.w": sd["dense"]["w"]}
    for to in ("torch", "safetensors", "dcp", "distckpt"):
        out = str(tmp_path / f"out_{to}")
        res = convert(delta, out, to=to, memory_limit=1 << 20, progress=False)  # 256 KiB slices: 512 rows
        assert res.tensors == 2, (to, res)
        if to == "torch":
            got = torch.load(out, weights_only=True)
        elif to == "distckpt":
            got = distckpt.read(out)
        elif to == "dcp":
            got = {"tables": {"emb": torch.zeros(4096, 128)}, "dense": {"w": torch.zeros(3, 5)}, "step": -1}
            dcp.load(got, checkpoint_id=out, no_dist=True)
        else:
            got = {}
            for f in sorted(os.listdir(out)):
                if f.endswith(".safetensors"):
                    got.update(load_file(os.path.join(out, f)))
            assert sorted(got) == sorted(flat), to
            assert all(torch.equal(got[k], v) for k, v in flat.items()), to
            continue
        assert not any(str(k).startswith("_incr") for k in got), (to, list(got))
        assert torch.equal(got["tables"]["emb"], sd["tables"]["emb"]), to
        assert torch.equal(got["dense"]["w"], sd["dense"]["w"]) and got["step"] == 2, to
        if to != "dcp":
            assert got["cfg"] == {}, to
    # A damaged older link: ChainBrokenError naming it, nothing written.
    data = tmp_path / "s2" / "rank00000.bin"
    raw = bytearray(data.read_bytes())
    raw[4096] ^= 0xFF  # the first chunk's first byte: the delta's row ids
    data.write_bytes(bytes(raw))
    with pytest.raises(ChainBrokenError) as broken:
        convert(delta, tmp_path / "out_broken", to="torch", progress=False)
    assert str(tmp_path / "s2") in str(broken.value)
    assert not (tmp_path / "out_broken").exists()


def test_convert_of_a_delta_slice_by_slice_keeps_its_read_slots_mapped(tmp_path, monkeypatch):
    """convert of a delta reads each slice from the base through the C pipeline's slots and the
    deltas' rows inside it through a worker. The worker's buffer used to unmap the slots (and
    close the readers holding them registered) at every slice, so the next slice mapped,
    faulted in and registered them again: 9.65 s against 0.35 s for the full checkpoint at 256
    slices (docs/BENCHMARKS.md). Now the rows are read beside the slots (side_reads): the slots
    are unmapped once, when the conversion ends."""
    from distckpt import fill as fillmod
    from distckpt.convert import convert

    g = torch.Generator().manual_seed(5)
    sd = {"emb": torch.randn(8192, 64, generator=g), "step": 0}
    saver = IncrementalSaver(IncrementalPolicy(rows={"emb": 0}, full_every=10, max_delta_fraction=0.9,
                                               max_chain_fraction=5.0))
    saver.save(sd, tmp_path / "s1")
    for step in (1, 2):
        sd["emb"][torch.randperm(8192, generator=g)[:400]] += 1
        sd["step"] = step
        saver.save(sd, tmp_path / f"s{step + 1}")
        assert saver.last_kind == "delta"
    unmaps = []
    drop = fillmod._Session.drop_slots

    def counting(self):
        unmaps.append(self._slots is not None)
        return drop(self)

    monkeypatch.setattr(fillmod._Session, "drop_slots", counting)
    out = tmp_path / "out.pt"
    convert(str(tmp_path / "s3"), str(out), to="torch", memory_limit=1 << 20, progress=False)  # 8 slices
    assert torch.equal(torch.load(out, weights_only=True)["emb"], sd["emb"])
    assert sum(unmaps) == 1, f"the slots were unmapped {sum(unmaps)} times"


def test_dcps_reader_gives_a_delta_the_state_its_chain_composes(tmp_path):
    """DCP's StorageReader (DistCkptStorageReader) was given a delta's own MANIFEST and data:
    it returned the delta's internal records (``_incr.*``) in place of the tracked tensor, with no
    error (DCP's load-everything helper gave no ``emb`` at all, and
    ``dcp.load(allow_partial_load=True)`` left it untouched and reported success); then it refused
    a delta. It now shows DCP the state the chain composes, as distckpt.read gives it, with the
    chunks of the tracked tensor split across DCP's reads (a 2-rank-like resharded destination),
    and a damaged older link is ChainBrokenError."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from distckpt.integrations.dcp import DistCkptStorageReader

    saver = IncrementalSaver(IncrementalPolicy(**POLICY))
    sd = _emb(torch.float32)
    saver.save(sd, tmp_path / "s1")
    sd["emb"][5] = -1.0
    sd["emb"][150] = -2.0
    sd["step"] = 1
    saver.save(sd, tmp_path / "s2")
    sd["emb"][150] = -3.0
    sd["emb"][199] = -4.0
    sd["step"] = 2
    saver.save(sd, tmp_path / "s3")
    assert saver.last_kind == "delta"
    delta = str(tmp_path / "s3")
    assert torch.equal(distckpt.read(delta)["emb"], sd["emb"])

    dst = {"emb": torch.zeros(200, 8), "step": 0}
    dcp.load(dst, storage_reader=DistCkptStorageReader(delta), no_dist=True)
    assert torch.equal(dst["emb"], sd["emb"]) and dst["step"] == 2
    got = _load_state_dict_from_keys(storage_reader=DistCkptStorageReader(delta))
    assert sorted(got) == ["emb", "step"] and torch.equal(got["emb"], sd["emb"]) and got["step"] == 2
    # Boxes that cut the table where the deltas' rows are: each filled from the base and the rows.
    for lo, hi in ((0, 100), (100, 151), (151, 200)):
        part = torch.zeros(hi - lo, 8)
        reader = DistCkptStorageReader(delta)
        md = reader.read_metadata()
        assert md.state_dict_metadata["emb"].size == torch.Size([200, 8])
        class _Planner:
            def resolve_tensor(self, item):
                return part

            def commit_tensor(self, item, tensor):
                pass

        item = ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex("emb", torch.Size([lo, 0])),
                        dest_offsets=torch.Size([0, 0]), storage_index=MetadataIndex("emb", torch.Size([0, 0])),
                        storage_offsets=torch.Size([lo, 0]), lengths=torch.Size([hi - lo, 8]))
        reader.read_data(type("Plan", (), {"items": [item]})(), _Planner()).wait()
        assert torch.equal(part, sd["emb"][lo:hi]), (lo, hi)
    # A damaged older link: ChainBrokenError (DCP reports it as its CheckpointException).
    data = tmp_path / "s2" / "rank00000.bin"
    raw = bytearray(data.read_bytes())
    raw[4096] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(BaseException) as broken:  # noqa: PT011 - DCP wraps the reader's error in its own
        dcp.load({"emb": torch.zeros(200, 8), "step": 0}, storage_reader=DistCkptStorageReader(delta), no_dist=True)
    assert "ChainBrokenError" in str(broken.value) and str(tmp_path / "s2") in str(broken.value), broken.value


_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64])
def test_a_table_of_a_dtype_index_copy_lacks_restores_bit_exact(tmp_path, dtype):
    """An outside trial: the saver committed deltas of a float8 or uint16/32/64 table that no
    reader could load (a bare NotImplementedError from index_copy_, in read, load, convert and
    DCP's reader). The rows are now copied through an integer view of the same width."""
    from distckpt.convert import convert
    from distckpt.integrations.dcp import DistCkptStorageReader
    import torch.distributed.checkpoint as dcp

    sd = {"emb": ((torch.arange(64 * 8) % 50).reshape(64, 8).float()).to(dtype), "step": 0}
    saver = IncrementalSaver(IncrementalPolicy(**POLICY))
    saver.save(sd, tmp_path / "s1")
    bits = sd["emb"].view(_SAME_WIDTH_INT[sd["emb"].element_size()])
    bits[[3, 40]] = 7  # rows changed through the bits: torch cannot index_put these dtypes either
    sd["step"] = 1
    saver.save(sd, tmp_path / "s2")
    assert saver.last_kind == "delta"
    delta = str(tmp_path / "s2")

    def same(t):
        return t.dtype == dtype and torch.equal(t.view(bits.dtype), bits)

    assert same(distckpt.read(delta)["emb"])
    out = {"emb": torch.zeros(64, 8).to(dtype), "step": -1}
    distckpt.load(out, delta)
    assert same(out["emb"]) and out["step"] == 1
    convert(delta, tmp_path / "conv", to="distckpt", progress=False)
    assert same(distckpt.read(str(tmp_path / "conv"))["emb"])
    out = {"emb": torch.zeros(64, 8).to(dtype), "step": -1}
    dcp.load(out, storage_reader=DistCkptStorageReader(delta), no_dist=True)
    assert same(out["emb"])


def test_a_delta_with_no_changed_row_reads_as_its_saved_keys(tmp_path):
    """An outside trial: distckpt.read of a delta with no changed tracked row returned an extra
    empty ``_incr`` (the delta's own, empty, records container); convert and DCP's reader did not."""
    from distckpt.convert import convert

    sd = _emb(torch.float32)
    saver = IncrementalSaver(IncrementalPolicy(**POLICY))
    saver.save(sd, tmp_path / "s1")
    sd["step"] = 1
    saver.save(sd, tmp_path / "s2")
    assert saver.last_kind == "delta"
    got = distckpt.read(str(tmp_path / "s2"))
    assert sorted(got) == ["emb", "step"] and got["step"] == 1 and torch.equal(got["emb"], sd["emb"])
    convert(str(tmp_path / "s2"), tmp_path / "t.pt", to="torch", progress=False)
    assert sorted(torch.load(tmp_path / "t.pt", weights_only=True)) == ["emb", "step"]


def _chain_to_craft_on(tmp_path) -> tuple[dict, dict, object]:
    """A chain of a full link and a delta of one 100 x 4 table, for a crafted third link: (the
    state as saved, the chain metadata the third link needs, its path)."""
    sd = {"emb": {"w": torch.randn(100, 4, generator=torch.Generator().manual_seed(0))}, "step": 0}
    saver = IncrementalSaver(IncrementalPolicy(rows={"emb.w": 0}, max_delta_fraction=1.0, max_chain_fraction=100.0))
    saver.save(sd, tmp_path / "step_00000000")
    sd["emb"]["w"][3] += 1
    saver.save(sd, tmp_path / "step_00000001")
    parent = chain_of(str(tmp_path / "step_00000001"))[0]
    meta = {**parent.meta, "seq": 2, "parent": "step_00000001", "parent_save_id": parent.manifest.save_id}
    return sd, meta, tmp_path / "step_00000002"


@pytest.mark.parametrize("box, ids, rows", [
    ([[10, 0], [100, 4]], [99, 105, 109], (3, 4)),   # taller than the table: 105 and 109 were dropped
    ([[0, 0], [200, 4]], [150], (1, 4)),             # the same, every row dropped
    ([[0, 2], [100, 4]], [4], (1, 4)),               # columns past the table: half of the row written
    ([[0, 0], [100, 4]], [4, 5], (2, 5)),            # rows wider than the box: the 5th column dropped
    ([[0, 0], [100, 4]], [4, 5], (1, 4)),            # fewer rows than ids: an unnamed ReshardError
    ([[0, 0], [100, 4]], [4, 5], (2, 4, "float64")),  # rows wider than the table: verify passed it
    ("tensor", [4, 5], (2, 4)),                       # a box saved as a tensor: a bare KeyError
], ids=["box-past-the-rows", "box-twice-the-table", "box-past-the-columns", "rows-too-wide", "rows-too-few",
        "rows-of-another-dtype", "box-a-tensor"])
def test_a_delta_whose_box_or_rows_do_not_fit_its_table_is_chain_broken(tmp_path, box, ids, rows):
    """A delta link with valid checksums whose records disagree with the table (crafted: an outside
    trial): rows outside the table, or a rows record of another shape than its ids and box, loaded
    with rows silently dropped or cut. ChainBrokenError naming the link now, from load and read."""
    R, C = 100, 4
    sd, meta, crafted = _chain_to_craft_on(tmp_path)
    rows_t = torch.ones(rows[:2], dtype=getattr(torch, rows[2])) if len(rows) == 3 else torch.ones(rows)
    box_v = torch.tensor([[0, 0], [100, 4]]) if box == "tensor" else box
    distckpt.save({"_incr": {"0": {"r0p0": {"box": box_v, "ids": torch.tensor(ids, dtype=torch.int32),
                                            "rows": rows_t}}}, "step": 2},
                  crafted, metadata={"distckpt.chain": meta})
    with pytest.raises(ChainBrokenError) as info:
        distckpt.load({"emb": {"w": torch.zeros(R, C)}, "step": -1}, crafted)
    assert "step_00000002" in str(info.value) and "_incr.0.r0p0" in str(info.value), info.value
    with pytest.raises(ChainBrokenError):
        distckpt.read(crafted)
    # verify fails what load refuses (every checksum matches): the record, by name; exit status 1
    report = verify(crafted)
    assert not report.ok and len(report.file_problems) == 1 and "_incr.0.r0p0" in str(report.file_problems[0])
    assert [link.ok for link in report.links] == [True, True]
    assert cli(["verify", str(crafted)]) == 1


def test_a_base_whose_chain_metadata_misstates_a_tensors_shape_is_chain_broken(tmp_path):
    """The deltas' boxes are checked against the shapes the chain records: a base whose record
    disagrees with its own tensor is ChainBrokenError, before any row is read."""
    sd = {"w": torch.randn(10, 4)}
    saver = IncrementalSaver(IncrementalPolicy(rows={"w": 0}, max_delta_fraction=1.0, max_chain_fraction=100.0))
    saver.save(sd, tmp_path / "step_00000000")
    base = chain_of(str(tmp_path / "step_00000000"))[0]
    lying = tmp_path / "lying"
    distckpt.save({"w": sd["w"]}, lying, metadata={"distckpt.chain": {**base.meta, "shapes": {"w": [[20, 4], "float32"]}}})
    with pytest.raises(ChainBrokenError, match="gives w the shape"):
        chain_of(str(lying))


def _replicated_table(rank: int, world: int, root: str, diverge: bool) -> tuple:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    sd = {"emb": distribute_tensor(torch.arange(800.).reshape(200, 4), mesh, [Replicate()]), "step": 0}
    saver = IncrementalSaver(IncrementalPolicy(**POLICY))
    saver.save(sd, f"{root}/s1")
    sd["emb"].to_local()[[3, 7]] += 1
    if diverge and rank == 1:
        sd["emb"].to_local()[9] += 1   # rank 1's copy is no replica any more
    saver.save(sd, f"{root}/s2")
    return saver.last_kind, chain_of(f"{root}/s2")[0].meta.get("why")


def test_a_replicated_dtensors_delta_is_written_once_and_diverged_replicas_make_it_full(tmp_path):
    """Every rank holding a Replicate DTensor wrote its own copy of the changed rows into a delta:
    records of the same box that a load composes in any order, so replicas that had diverged loaded
    as whichever copy came last (and read and load could disagree). One rank writes them now; and
    replicas whose row digests differ make the link full, which keeps one rank's whole copy as a
    full save does, instead of composing one rank's rows onto another's."""
    out = run_ranks(_replicated_table, 2, str(tmp_path / "same"), False, timeout=240)
    assert [k for k, _w in out] == ["delta", "delta"], out
    keys = sorted(distckpt.read_manifest(str(tmp_path / "same" / "s2"))["tensors"])
    assert keys == ["_incr.0.r0p0.ids", "_incr.0.r0p0.rows"], keys
    want = torch.arange(800.).reshape(200, 4)
    want[[3, 7]] += 1
    assert torch.equal(distckpt.read(str(tmp_path / "same" / "s2"))["emb"], want)
    assert verify(str(tmp_path / "same" / "s2")).ok
    out = run_ranks(_replicated_table, 2, str(tmp_path / "diverged"), True, timeout=240)
    assert [k for k, _w in out] == ["full", "full"] and "replicas of tracked tensor 'emb' differ" in out[0][1], out
    got = distckpt.read(str(tmp_path / "diverged" / "s2"))["emb"]
    other = want.clone()
    other[9] += 1
    assert torch.equal(got, want) or torch.equal(got, other)   # one rank's whole copy, never a mix


FULL = [[0, 0], [100, 4]]


@pytest.mark.parametrize("first, second, why", [
    ((FULL, [4, 5], 1.0), (FULL, [5, 6], 1.0), "changed different rows"),            # replicas that diverged
    ((FULL, [4, 5], 1.0), (FULL, [4, 5], 2.0), "different values"),                  # the same rows, other values
    ((FULL, [4, 5], 1.0), ([[3, 0], [50, 4]], [4, 5], 2.0), "different values"),     # partly overlapping boxes
    ((FULL, [4, 5], 1.0), ([[40, 0], [60, 4]], [44, 45], 2.0), "changed different rows"),  # rows one box says unchanged
    (([[0, 0], [50, 4]], [4, 5], 1.0), ([[50, 0], [50, 4]], [54, 55], 2.0), None),  # disjoint rows: composed
    (([[0, 0], [100, 2]], [4, 5], 1.0), ([[0, 2], [100, 2]], [4, 5], 2.0), None),   # disjoint columns: composed
    ((FULL, [4, 5], 1.0), (FULL, [4, 5], 1.0), None),                                # equal replicas (older savers)
], ids=["other-rows", "other-values", "partial-box", "unchanged-in-one", "disjoint-rows", "disjoint-columns",
        "equal-replicas"])
def test_overlapping_pieces_of_one_link_must_agree_where_they_overlap(tmp_path, first, second, why):
    """Two pieces of one delta link that overlap (replicas each rank wrote, or a crafted link) were
    both copied, in whichever order the fill took: a load kept one of them, or a mix of both, without
    a word. Where they overlap they must hold the same row ids and the same bytes now, else
    ChainBrokenError from load, read and verify, naming both records; disjoint pieces and equal
    replicas compose as before."""
    R, C = 100, 4
    sd, meta, crafted = _chain_to_craft_on(tmp_path)
    records = {f"r{r}p0": {"box": box, "ids": torch.tensor(ids, dtype=torch.int32),
                           "rows": torch.full((len(ids), box[1][1]), value)}
               for r, (box, ids, value) in enumerate((first, second))}
    distckpt.save({"_incr": {"0": records}, "step": 2}, crafted, metadata={"distckpt.chain": meta})
    if why is None:
        want = sd["emb"]["w"].clone()
        for box, ids, value in (first, second):
            want[ids, box[0][1]:box[0][1] + box[1][1]] = value
        back = {"emb": {"w": torch.zeros(R, C)}, "step": -1}
        distckpt.load(back, crafted)
        assert torch.equal(back["emb"]["w"], want)
        assert torch.equal(distckpt.read(crafted)["emb"]["w"], want)
        assert verify(crafted).ok
        return
    with pytest.raises(ChainBrokenError, match=why) as info:
        distckpt.load({"emb": {"w": torch.zeros(R, C)}, "step": -1}, crafted)
    assert "_incr.0.r0p0" in str(info.value) and "_incr.0.r1p0" in str(info.value), info.value
    with pytest.raises(ChainBrokenError, match=why):
        distckpt.read(crafted)
    report = verify(crafted)
    assert not report.ok and len(report.file_problems) == 1 and why in str(report.file_problems[0]), report


def test_overlapping_pairs_finds_every_pair_a_brute_force_finds():
    """The sweep of distckpt.deltarecords.overlapping_pairs against every pair compared."""
    import random

    from distckpt.deltarecords import overlapping_pairs
    rng = random.Random(0)
    for _ in range(300):
        ndim = rng.randint(1, 3)
        boxes = [([rng.randint(0, 9) for _ in range(ndim)], [rng.randint(0, 4) for _ in range(ndim)])
                 for _ in range(rng.randint(0, 9))]
        brute = [(a, b) for a in range(len(boxes)) for b in range(a + 1, len(boxes))
                 if all(max(x, y) < min(x + m, y + n) for x, m, y, n in zip(*boxes[a], *boxes[b]))]
        assert overlapping_pairs(boxes) == brute, boxes


def _resynced_replicas(rank: int, world: int, root: str) -> tuple:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    # tables above plan.assign_owners' group size: the full saves spread their owners over the ranks
    sd = {"m": {f"e{i}": distribute_tensor(torch.arange(4096 * 64.0).reshape(4096, 64) + i, mesh, [Replicate()])
                for i in range(4)}, "step": 0}
    saver = IncrementalSaver(IncrementalPolicy(rows={f"m.e{i}": 0 for i in range(4)}, max_delta_fraction=1.0,
                                               max_chain_fraction=100.0))
    kinds, states = [], []

    def save(name):
        saver.save(sd, f"{root}/{name}")
        kinds.append(saver.last_kind)
        states.append({k: v.to_local().clone() for k, v in sd["m"].items()})
    save("s1")
    for t in sd["m"].values():   # a bad step: rank 1's replicas drift
        t.to_local()[9] += 1 + rank
    save("s2")
    for t in sd["m"].values():   # resynced from rank 0, then trained on
        dist.broadcast(t.to_local(), src=0)
        t.to_local()[3] += 1
    save("s3")
    for t in sd["m"].values():
        t.to_local()[5] += 1
    save("s4")
    return kinds, states


def test_replicas_resynced_after_they_differed_never_compose_one_ranks_rows_onto_anothers_base(tmp_path):
    """An outside re-trial: Replicate DTensors that differed at a full link (written by the ranks
    the plan chose as owners), then were resynced from rank 0: the next link was a delta of rank
    0's changed rows against rank 0's own previous copy, composed onto bases rank 1 had written,
    so the row rank 1 had drifted kept its old value, and verify said OK. A delta is written now
    only when the holders' copies agree now and agreed at the previous link."""
    out = run_ranks(_resynced_replicas, 2, str(tmp_path), timeout=240)
    assert [k for k, _s in out] == [["full", "full", "full", "delta"]] * 2, [k for k, _s in out]
    for i, name in enumerate(("s1", "s2", "s3", "s4")):
        got = distckpt.read(str(tmp_path / name))["m"]
        if i == 1:   # the replicas differed: one rank's whole copy per table, never a mix
            assert all(any(torch.equal(got[k], states[1][k]) for _k, states in out) for k in got), name
            continue
        assert all(torch.equal(got[k], out[0][1][i][k]) for k in got), name
        assert verify(str(tmp_path / name)).ok
