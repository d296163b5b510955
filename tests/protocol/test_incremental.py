"""Incremental checkpoints (distckpt.incremental, docs/INCREMENTAL.md).

The TorchRec part is a DLRM-style model (launch/examples/dlrm_train.py's: four tables, two of them
EXACT_ROWWISE_ADAGRAD, one EXACT_ADAGRAD, one data-parallel with a dense torch Adagrad; column-wise,
table-wise, row-wise and data-parallel on 2 ranks) trained on a Zipf-distributed id stream. One
2-rank launch trains, saves through a CheckpointManager with an incremental policy every K steps
(full and delta links), writes a plain full checkpoint of the same step as the reference, and is
SIGKILLed on both ranks in the middle of the next save. Then: restore the chain at 2 ranks on
another plan and at 1 rank, re-save the restored state as a plain full checkpoint, and compare
it with the reference bit for bit (tables and optimizer state); after the 2-rank restore the job
trains on and saves a delta against the restored step, which must compose exactly too.

The rest runs in this process: exactness of the row digests, chains of plain tensors (rotation
keeps what kept steps need, ChainBrokenError for a missing / replaced / damaged link, a crash
between links), `distckpt verify` of a chain and the CHAIN column of `distckpt ls`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import threading
import time

import pytest
import torch

import distckpt
import distckpt.errors
import distckpt.incremental as inc
from distckpt.cli import main as cli
from distckpt.deltarecords import box_of, pieces_of
from distckpt.errors import ChainBrokenError
from distckpt.incremental import IncrementalPolicy, IncrementalSaver, chain_of, row_digests
from tests.helpers.distributed import RankError, run_ranks

ROOT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K = 2            # save every K steps
STEPS = 14       # the last acknowledged save; the save of STEPS + K is killed
PLAN2 = {"t0": "column_wise:0,1", "t1": "table_wise:1", "t2": "row_wise", "t3": "data_parallel"}
# Restore plan on 2 ranks: t0 keeps its two column blocks (its per-row state needs them), the rest
# moves; t1 (elementwise state) is split by columns, so the chain saved after the restore mixes
# links with whole-width and half-width pieces of t1 (composed link by link, oldest first).
REPLAN2 = {"t0": "column_wise:1,0", "t1": "column_wise:0,1", "t2": "table_wise:0", "t3": "data_parallel"}
PLAN1 = {"t0": "column_wise:0,0", "t1": "table_wise:0", "t2": "row_wise", "t3": "data_parallel"}


def _dlrm():
    spec = importlib.util.spec_from_file_location("dlrm_train", os.path.join(ROOT_DIR, "launch", "examples", "dlrm_train.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _zipf_batch(dlrm, step: int, rank: int, world: int):
    """This rank's slice of global batch ``step``: ids drawn from a Zipf(1.1) law over each table's
    rows (hot rows spread over the table by a fixed permutation)."""
    from torchrec import KeyedJaggedTensor
    g = torch.Generator().manual_seed(777 + step)
    n = dlrm.GLOBAL_BATCH
    dense_x = torch.randn(n, dlrm.DENSE_IN, generator=g)
    labels = (torch.rand(n, generator=g) < 0.3).float()
    per = n // world
    vals, lens = [], []
    for i, (rows, _d, _o) in enumerate(dlrm.TABLES.values()):
        p = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** 1.1
        perm = torch.randperm(rows, generator=torch.Generator().manual_seed(i))
        lengths = torch.randint(1, 4, (n,), generator=g)
        ids = perm[torch.multinomial(p, int(lengths.sum()), replacement=True, generator=g)]
        offs = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        vals.append(ids[offs[rank * per]:offs[(rank + 1) * per]])
        lens.append(lengths[rank * per:(rank + 1) * per])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f_{t}" for t in dlrm.TABLES], values=torch.cat(vals),
                                              lengths=torch.cat(lens))
    return dense_x[rank * per:(rank + 1) * per], kjt, labels[rank * per:(rank + 1) * per]


def _train(dlrm, dmp, dense, step, rank, world):
    dense_x, kjt, labels = _zipf_batch(dlrm, step, rank, world)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(dmp(dense_x, kjt), labels, reduction="sum")
    (loss * world / dlrm.GLOBAL_BATCH).backward()
    dense.step()
    dense.zero_grad()


def _policy():
    from distckpt.integrations import torchrec as dtr
    # Every fourth save full; the fractions are loose so that this short run makes deltas.
    return IncrementalPolicy(rows=dtr.incremental_rows, full_every=4, max_delta_fraction=0.9,
                             max_chain_fraction=5.0)


def _train_and_crash(rank, world, root):
    from distckpt.integrations import torchrec as dtr
    dlrm = _dlrm()
    dmp, dense = dlrm.build(rank, world, PLAN2)
    mgr = distckpt.CheckpointManager(os.path.join(root, "ckpt"), keep_last=2, incremental=_policy())
    kinds = {}
    for step in range(STEPS + K):
        _train(dlrm, dmp, dense, step, rank, world)
        done = step + 1
        if done % K:
            continue
        sd = dtr.state_dict(dmp, optimizers=[dense], extra={"step": done})
        if done == STEPS + K:  # crash: both ranks SIGKILLed after writing their data, before MANIFEST
            marker = os.path.join(root, "killed")
            if rank == 0:
                import distckpt.commit as co

                def die(*a, **k):
                    open(marker, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
                co.manifest_bytes = die
            else:
                def watch():
                    while not os.path.exists(marker):
                        time.sleep(0.01)
                    os.kill(os.getpid(), signal.SIGKILL)
                threading.Thread(target=watch, daemon=True).start()
            mgr.save(done, sd, replicated=dtr.rank0_keys(sd))
            raise AssertionError("the save should have been killed")
        mgr.save(done, sd, replicated=dtr.rank0_keys(sd))
        kinds[done] = mgr._saver.last_kind
        if done == STEPS:  # the reference: a plain full checkpoint of the same state
            dtr.save(dmp, os.path.join(root, "ref"), optimizers=[dense], extra={"step": done})
        if rank == 0:
            with open(os.path.join(root, "kinds.json"), "w") as f:
                json.dump({"kinds": kinds, "steps": mgr.steps()}, f)


def _restore(rank, world, root, plan, tag, train_on):
    from distckpt.integrations import torchrec as dtr
    dlrm = _dlrm()
    dmp, dense = dlrm.build(rank, world, plan)
    mgr = distckpt.CheckpointManager(os.path.join(root, "ckpt"), keep_last=2, incremental=_policy())
    step = mgr.latest_step()
    extra = {"step": 0}
    dtr.load(dmp, mgr.path(step), optimizers=[dense], extra=extra)
    assert extra["step"] == step == STEPS
    dtr.save(dmp, os.path.join(root, f"re_{tag}"), optimizers=[dense], extra=extra)
    if not train_on:
        return None
    # Continue the chain of the restored step: the next save is a delta against it.
    mgr._saver.resume(dtr.state_dict(dmp, optimizers=[dense], extra=extra), mgr.path(step))
    for s in range(STEPS, STEPS + K):
        _train(dlrm, dmp, dense, s, rank, world)
    sd = dtr.state_dict(dmp, optimizers=[dense], extra={"step": STEPS + K})
    mgr.save(STEPS + K, sd, replicated=dtr.rank0_keys(sd))
    dtr.save(dmp, os.path.join(root, "ref_after"), optimizers=[dense], extra={"step": STEPS + K})
    return mgr._saver.last_kind


def _restore_merged(rank, world, root):
    """1 rank, t0's two column blocks merged into one (PLAN1 but t0 table-wise): its per-row
    state needs ``approximate_rowwise=True``. The chain (composed in t0's saved [2, rows] layout,
    then converted) and the plain full reference of the same step must give the same result."""
    from distckpt.errors import ReshardError
    from distckpt.integrations import torchrec as dtr
    dlrm = _dlrm()
    mgr = distckpt.CheckpointManager(os.path.join(root, "ckpt"))
    for src, tag in ((mgr.path(mgr.latest_step()), "merged_chain"), (os.path.join(root, "ref"), "merged_ref")):
        dmp, dense = dlrm.build(rank, world, dict(PLAN1, t0="table_wise:0"))
        with pytest.raises(ReshardError, match="column blocks"):
            dtr.load(dmp, src, optimizers=[dense])
        dtr.load(dmp, src, optimizers=[dense], approximate_rowwise=True)
        dtr.save(dmp, os.path.join(root, tag), optimizers=[dense])


def dtr_read(path):
    from distckpt.integrations import torchrec as dtr
    return dtr.read_tables(path)


def _same_tables(a_path, b_path):
    a, b = dtr_read(a_path), dtr_read(b_path)
    assert set(a["model"]) == set(b["model"]) and set(a["optim"]) == set(b["optim"])
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), f"model {k} differs"
    for p, st in a["optim"].items():
        assert set(st) == set(b["optim"][p])
        for name, v in st.items():
            assert torch.equal(v, b["optim"][p][name]), f"optim {p}.{name} differs"
    assert a["extra"] == b["extra"]


# The jobs' ranks fork from one server that imported these once (spawned ranks import torch and
# torchrec anew: seconds each on this 2-core machine); each job's ranks are fresh processes still.
# The server is the pytest process's, started by the first run_ranks(preload=...) (its preload and
# environment fixed then): the jobs that use it here set no environment beforehand.
_TORCHREC_PRELOAD = ["torch", "torchrec", "distckpt.integrations.torchrec", "tests.helpers.distributed",
                     "tests.protocol.test_incremental"]


@pytest.mark.skipif(importlib.util.find_spec("torchrec") is None, reason="needs torchrec")
def test_torchrec_chain_crash_restore(tmp_path):
    root = str(tmp_path)
    with pytest.raises(RankError) as ei:
        run_ranks(_train_and_crash, 2, root, timeout=300, preload=_TORCHREC_PRELOAD)
    assert all("exited with code -9" in tb for _e, tb in ei.value.errors.values()), ei.value
    with open(os.path.join(root, "kinds.json")) as f:
        record = json.load(f)
    kinds = {int(k): v for k, v in record["kinds"].items()}
    # full_every=4: full, delta, delta, delta, full, delta, delta
    assert kinds == {2: "full", 4: "delta", 6: "delta", 8: "delta", 10: "full", 12: "delta", 14: "delta"}, kinds
    ckpt = os.path.join(root, "ckpt")
    # keep_last=2 keeps 12 and 14; 14 needs 12 and 10 (its base); 2..8 were freed.
    assert record["steps"] == [10, 12, 14]
    assert [os.path.basename(link.path) for link in chain_of(os.path.join(ckpt, "step_00000014"))] == [
        "step_00000014", "step_00000012", "step_00000010"]
    assert any(n.startswith(".step_00000016.tmp-") for n in os.listdir(ckpt)), os.listdir(ckpt)
    # The chain composes in one process (distckpt.read) to the reference, bit for bit.
    _same_tables(os.path.join(ckpt, "step_00000014"), os.path.join(root, "ref"))
    # A delta holds the changed rows only: smaller than the full link.
    sizes = {e.step: e.size_bytes for e in distckpt.CheckpointManager(ckpt).describe().entries}
    assert sizes[12] < sizes[10] and sizes[14] < sizes[10], sizes

    # Restore at 2 ranks on another plan, train on, save a delta against the restored step.
    kinds_after = run_ranks(_restore, 2, root, REPLAN2, "two", True, timeout=300, preload=_TORCHREC_PRELOAD)
    _same_tables(os.path.join(root, "re_two"), os.path.join(root, "ref"))
    assert kinds_after == ["delta", "delta"]
    _same_tables(os.path.join(ckpt, "step_00000016"), os.path.join(root, "ref_after"))
    assert not any(".tmp-" in n for n in os.listdir(ckpt))  # the killed save's leftover was reclaimed

    # Restore the original chain's step 14 at 1 rank: remove step 16 so that 14 is latest again.
    shutil.rmtree(os.path.join(ckpt, "step_00000016"))
    run_ranks(_restore, 1, root, PLAN1, "one", False, timeout=300, preload=_TORCHREC_PRELOAD)
    _same_tables(os.path.join(root, "re_one"), os.path.join(root, "ref"))
    # The same chain onto a merged column split (approximate_rowwise): as the full reference does.
    run_ranks(_restore_merged, 1, root, timeout=300, preload=_TORCHREC_PRELOAD)
    _same_tables(os.path.join(root, "merged_chain"), os.path.join(root, "merged_ref"))
    merged = dtr_read(os.path.join(root, "merged_ref"))["optim"]["sparse.embedding_bags.t0.weight"]
    assert merged["momentum1"].shape[0] == 1    # one column block: the conversion did run


# ------------------------------------------------------------------------------------------------
# In-process checks on plain tensors


def test_digests_see_every_single_word_change():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(64, 7, generator=g)
    base = row_digests(t)
    for r in range(0, 64, 5):
        for c in range(7):
            u = t.clone()
            u.view(torch.int32)[r, c] ^= 1 << (r + c) % 32   # one bit of one word
            d = row_digests(u)
            assert d[r] != base[r]
            assert torch.equal(torch.cat([d[:r], d[r + 1:]]), torch.cat([base[:r], base[r + 1:]]))
    z = torch.zeros(3, 4)
    z2 = z.clone()
    z2[1, 2] = -0.0
    assert (row_digests(z) != row_digests(z2)).tolist() == [False, True, False]   # bitwise
    odd = torch.arange(30, dtype=torch.uint8).reshape(10, 3)                      # 3-byte rows
    odd2 = odd.clone()
    odd2[4, 1] += 1
    assert (row_digests(odd) != row_digests(odd2)).nonzero().reshape(-1).tolist() == [4]
    col = torch.randn(2, 50, generator=g)            # rows along dim 1 (the rowwise layout)
    col2 = col.clone()
    col2[1, 17] += 1
    assert (row_digests(col, 1) != row_digests(col2, 1)).nonzero().reshape(-1).tolist() == [17]


def _digests_by_formula(t: torch.Tensor, row_dim: int = 0) -> torch.Tensor:
    """docs/INCREMENTAL.md's digest, in plain torch integer ops (the reference for the C core)."""
    x = t.detach().movedim(row_dim, 0).resolve_conj().resolve_neg().contiguous()
    n = x.shape[0]
    row_bytes = x[0].numel() * x.element_size() if n else 0
    if n == 0 or row_bytes == 0:
        return torch.zeros(n, dtype=torch.int64)
    word, mask, size = next((w, m, z) for w, m, z in ((torch.int64, None, 8), (torch.int32, 0xFFFFFFFF, 4),
                                                      (torch.int16, 0xFFFF, 2), (torch.uint8, 0xFF, 1))
                            if row_bytes % z == 0)
    w = x.reshape(-1).view(torch.uint8).view(word).reshape(n, -1).to(torch.int64)
    if mask is not None:
        w = w.bitwise_and(mask)
    g = torch.Generator().manual_seed(0x5EED)   # P_j: distckpt.incremental._multipliers
    mult = torch.randint(-(1 << 62), 1 << 62, (w.shape[1],), generator=g, dtype=torch.int64) * 2 + 1
    h = w * mult
    h = h.bitwise_xor(h.bitwise_right_shift(32).bitwise_and(0xFFFFFFFF)) * -7046029254386353131   # * Q
    return h.sum(dim=1)


def test_digests_equal_the_formula_for_every_layout(monkeypatch):
    """The C core's digests (straight from memory, or from host copies of blocks of rows) equal
    the documented formula for every word size, odd row sizes, strided rows, rows along dim 1,
    lazy conj/neg views, and more rows than one block copy holds. So does the GPU path's torch
    version, run here on the host with blocks small enough that every case spans several."""
    monkeypatch.setattr(inc, "_DEVICE_BLOCK_WORDS", 1000)
    g = torch.Generator().manual_seed(3)
    big = torch.randn(300, 4096, generator=g)          # > _BLOCK_ELEMS words: several block copies
    cases = [
        (torch.randn(100, 16, generator=g), 0),                                    # 8-byte words
        (torch.randn(100, 3, generator=g), 0),                                     # 12 B: 4-byte words
        (torch.randn(100, 3, generator=g).to(torch.bfloat16), 0),                  # 6 B: 2-byte words
        (torch.randint(0, 255, (100, 5), dtype=torch.uint8, generator=g), 0),      # 5 B: bytes
        (torch.randn(100, 7, generator=g).to(torch.float64), 0),
        (torch.randn(40, 100, generator=g), 1),                                    # rows along dim 1
        (big, 1),
        (big, 0),
        (torch.randn(100, 32, generator=g)[::3, 4:20], 0),                         # strided rows
        (torch.randn(50, 4, 6, generator=g).permute(1, 0, 2), 1),                  # 3-d, row dim 1
        (torch.complex(torch.randn(30, 4, generator=g), torch.randn(30, 4, generator=g)).conj(), 0),
        (torch.complex(torch.randn(30, 4, generator=g), torch.randn(30, 4, generator=g)).conj().imag, 0),  # neg bit
        (torch.randn(1, 8, generator=g).expand(20, 8), 0),                         # stride 0 rows
        ((torch.randn(100, 9, generator=g) > 0), 0),                               # bool, 9 B rows
        (torch.randn(0, 4), 0),
        (torch.randn(5, 0), 0),
    ]
    for t, d in cases:
        got, want = row_digests(t, d), _digests_by_formula(t, d)
        assert got.dtype == torch.int64 and torch.equal(got, want), (t.shape, t.dtype, d)
        # The GPU path (torch ops on the tensor's device), run here on the host.
        x = t.movedim(d, 0)
        row_bytes = x[0].numel() * x.element_size() if x.shape[0] else 0
        if row_bytes:
            size = next(z for z in (8, 4, 2, 1) if row_bytes % z == 0)
            dev = inc._device_digests(x, size, inc._multipliers(row_bytes // size))
            assert torch.equal(dev, want), (t.shape, t.dtype, d)


def _state(seed: int):
    g = torch.Generator().manual_seed(seed)
    return {"model": {"emb": torch.randn(4000, 16, generator=g), "lin": torch.randn(3, 3, generator=g)},
            "optim": {"mom": torch.rand(2, 4000, generator=g)}, "step": 0}


ROWS = {"model.emb": 0, "optim.mom": 1}


def _touch(sd, step):
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, 4000, (12,), generator=g)
    sd["model"]["emb"][idx] += 1.0
    sd["optim"]["mom"][:, idx[:4]] += 0.5
    sd["model"]["lin"] += 1.0
    sd["step"] = step


def _expect(path, snap):
    got = distckpt.read(path)
    assert torch.equal(got["model"]["emb"], snap["model"]["emb"])
    assert torch.equal(got["optim"]["mom"], snap["optim"]["mom"])
    assert torch.equal(got["model"]["lin"], snap["model"]["lin"]) and got["step"] == snap["step"]
    target = _state(99)
    distckpt.load(target, path)
    assert torch.equal(target["model"]["emb"], snap["model"]["emb"])
    assert torch.equal(target["optim"]["mom"], snap["optim"]["mom"]) and target["step"] == snap["step"]


def _snap(sd):
    return {"model": {k: v.clone() for k, v in sd["model"].items()}, "optim": {"mom": sd["optim"]["mom"].clone()},
            "step": sd["step"]}


def test_manager_chain_rotation_verify_ls(tmp_path, capsys):
    root = str(tmp_path / "run")
    sd = _state(0)
    pol = IncrementalPolicy(rows=ROWS, full_every=4, max_delta_fraction=0.5, max_chain_fraction=2.0)
    mgr = distckpt.CheckpointManager(root, keep_last=2, incremental=pol)
    snaps, kept = {}, []
    for step in range(1, 10):
        _touch(sd, step)
        mgr.save(step, sd)
        snaps[step] = _snap(sd)
        kept.append(mgr.steps())
    # full at 1, 5, 9; 2-4 and 6-8 deltas. keep_last=2 never drops a link a kept step needs.
    assert [mgr.describe().entries[-1].chain["kind"]] == ["full"]
    assert kept[3] == [1, 2, 3, 4]          # step 4 needs 3, 2, 1
    assert kept[4] == [1, 2, 3, 4, 5]       # 4 is kept and still needs 1-3
    assert kept[5] == [5, 6]                # 6 needs only 5: 1-4 freed at once
    assert kept[8] == [5, 6, 7, 8, 9]     # 8 is kept and needs 5-7
    for step in mgr.steps():
        _expect(mgr.path(step), snaps[step])
    # A delta holds the changed rows (12 of 4000, 4 of them with new momentum) and the dense part.
    sizes = {e.step: e.size_bytes for e in mgr.describe().entries}
    capsys.readouterr()
    assert cli(["ls", root]) == 0
    out = capsys.readouterr().out
    assert "CHAIN" in out and "full" in out and "delta 3 <- step_00000007" in out, out
    assert sizes[9] > 2 * sizes[8]
    assert cli(["verify", mgr.path(8), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "chain OK: 4 link(s)" in out, out
    # A link deleted by hand: `ls` no longer calls its dependents plainly committed (each load of
    # them raises ChainBrokenError); the others are untouched.
    assert all(e.problem is None for e in mgr.describe().entries)
    hidden = mgr.path(6) + ".away"
    os.rename(mgr.path(6), hidden)
    entries = {e.step: e for e in mgr.describe().entries}
    assert entries[5].problem is None and entries[9].problem is None
    for step in (7, 8):
        assert entries[step].status == "committed" and "'step_00000006' is not in this root" in entries[step].problem
    assert cli(["ls", root]) == 0
    out = capsys.readouterr().out
    assert "committed: its incremental chain is broken" in out and "ChainBrokenError" in out, out
    os.rename(hidden, mgr.path(6))
    assert all(e.problem is None for e in mgr.describe().entries)
    # Resume in a new manager (a restarted job): the next save is a delta against the step loaded.
    mgr2 = distckpt.CheckpointManager(root, keep_last=2, incremental=pol)
    target = _state(5)
    mgr2.load(target)
    _touch(target, 10)
    mgr2.save(10, target)
    assert mgr2._saver.last_kind == "delta"
    _expect(mgr2.path(10), _snap(target))


def test_saver_paths_file_urls_and_object_stores(tmp_path, monkeypatch):
    """file:// URLs name the local directory; an object store URL is refused (typed) before
    anything is written, by every entry point of the saver, rather than taken for a local
    directory called "s3:"."""
    monkeypatch.chdir(tmp_path)
    sd = _state(4)
    saver = IncrementalSaver(IncrementalPolicy(rows=ROWS, max_delta_fraction=0.5, max_chain_fraction=2.0))
    saver.save(sd, f"file://{tmp_path}/s0")
    _touch(sd, 1)
    saver.save(sd, f"file://{tmp_path}/s1")
    assert saver.last_kind == "delta"
    _expect(str(tmp_path / "s1"), _snap(sd))
    for call in (lambda: saver.save(sd, "s3://bucket/run/s2"), lambda: saver.async_save(sd, "s3://bucket/run/s2"),
                 lambda: saver.resume(sd, "s3://bucket/run/s1")):
        with pytest.raises(distckpt.errors.ConfigError, match="local directories only"):
            call()
    assert sorted(os.listdir(tmp_path)) == ["s0", "s1"]
    _touch(sd, 2)
    saver.save(sd, str(tmp_path / "s2"))     # the saver is still at s1
    assert saver.last_kind == "delta" and [os.path.basename(x.path) for x in chain_of(str(tmp_path / "s2"))] == [
        "s2", "s1", "s0"]


def test_async_incremental_saves(tmp_path):
    root = str(tmp_path / "run")
    sd = _state(2)
    pol = IncrementalPolicy(rows=ROWS, full_every=8, max_delta_fraction=0.5, max_chain_fraction=2.0)
    mgr = distckpt.CheckpointManager(root, keep_last=None, incremental=pol)
    snaps = {}
    for step in (1, 2, 3):
        _touch(sd, step)
        h = mgr.save(step, sd, blocking=False)
        snaps[step] = _snap(sd)
        # Snapshot isolation: changed rows, unchanged rows and untracked tensors, right after return.
        sd["model"]["emb"][:50] += 100.0
        sd["optim"]["mom"][:, -3:] -= 7.0
        sd["model"]["lin"].zero_()
    h.result()    # each save was started while the previous one was in flight: it waited for it
    assert mgr._saver.last_kind == "delta"
    assert [e.chain["kind"] for e in mgr.describe().entries] == ["full", "delta", "delta"]
    assert [link.path for link in chain_of(mgr.path(3))] == [mgr.path(3), mgr.path(2), mgr.path(1)]
    for step in (1, 2, 3):
        _expect(mgr.path(step), snaps[step])
    # Step 3's delta holds the rows changed after step 2 returned (its digests are of the state
    # at the call, not of the tensors after it).
    sizes = {e.step: e.size_bytes for e in mgr.describe().entries}
    assert sizes[3] < sizes[1] / 2
    # A failed async save (the step exists) commits nothing and leaves the saver at step 3.
    os.makedirs(mgr.path(4))
    distckpt.save({"x": torch.zeros(1)}, mgr.path(4), overwrite=True)
    _touch(sd, 4)
    h = mgr.save(4, sd, blocking=False)
    with pytest.raises(distckpt.errors.CheckpointExistsError):
        h.result()
    h = mgr.save(5, sd, blocking=False)
    h.result()
    assert mgr._saver.last_kind == "delta"
    assert chain_of(mgr.path(5))[1].path == mgr.path(3)
    _expect(mgr.path(5), _snap(sd))


def test_chain_broken(tmp_path, capsys):
    root = str(tmp_path)
    sd = _state(1)
    saver = IncrementalSaver(IncrementalPolicy(rows=ROWS, full_every=10, max_chain_fraction=5.0,
                                               max_delta_fraction=0.9))
    snaps = {}
    for k in range(4):
        _touch(sd, k)
        saver.save(sd, os.path.join(root, f"c{k}"))
        snaps[k] = _snap(sd)
    assert [os.path.basename(link.path) for link in chain_of(os.path.join(root, "c3"))] == ["c3", "c2", "c1", "c0"]
    # A crash in the middle of the next save: a dead tmp dir, nothing committed; the chain still loads.
    _touch(sd, 4)
    import distckpt.commit as co
    real = co.manifest_bytes

    def boom(*a, **k):
        raise OSError(5, "simulated crash before the commit")
    co.manifest_bytes = boom
    try:
        with pytest.raises(Exception):
            saver.save(sd, os.path.join(root, "c4"))
    finally:
        co.manifest_bytes = real
    assert not os.path.exists(os.path.join(root, "c4"))
    _expect(os.path.join(root, "c3"), snaps[3])
    saver.save(sd, os.path.join(root, "c4"))           # still a delta against c3
    assert saver.last_kind == "delta"
    _expect(os.path.join(root, "c4"), _snap(sd))

    # A damaged delta (one byte of its data file flipped): ChainBrokenError on load and read.
    data = os.path.join(root, "c2", "rank00000.bin")
    raw = bytearray(open(data, "rb").read())
    for i in range(0, len(raw), 512):
        raw[i] ^= 0xFF
    shutil.copytree(os.path.join(root, "c2"), os.path.join(root, "c2.bak"))
    with open(data, "r+b") as f:
        f.write(raw)
    with pytest.raises(ChainBrokenError) as ei:
        distckpt.read(os.path.join(root, "c3"))
    assert ei.value.link.endswith("c2")
    target = _state(7)
    with pytest.raises(ChainBrokenError):
        distckpt.load(target, os.path.join(root, "c3"))
    capsys.readouterr()
    assert cli(["verify", os.path.join(root, "c3"), "--no-progress"]) == 1
    assert "chain DAMAGED: c2" in capsys.readouterr().out
    shutil.rmtree(os.path.join(root, "c2"))
    os.rename(os.path.join(root, "c2.bak"), os.path.join(root, "c2"))
    _expect(os.path.join(root, "c3"), snaps[3])

    # A missing link: ChainBrokenError before anything is read (the target stays untouched).
    os.rename(os.path.join(root, "c1"), os.path.join(root, "c1.away"))
    target = _state(7)
    before = target["model"]["emb"].clone()
    with pytest.raises(ChainBrokenError) as ei:
        distckpt.load(target, os.path.join(root, "c3"))
    assert ei.value.link.endswith("c1") and torch.equal(target["model"]["emb"], before)
    assert cli(["verify", os.path.join(root, "c3")]) == 1
    os.rename(os.path.join(root, "c1.away"), os.path.join(root, "c1"))

    # A replaced link (another save under the same name): ChainBrokenError naming it.
    shutil.rmtree(os.path.join(root, "c0"))
    distckpt.save(_state(3), os.path.join(root, "c0"))
    with pytest.raises(ChainBrokenError) as ei:
        distckpt.read(os.path.join(root, "c2"))
    assert ei.value.link.endswith("c0") and "replaced" in ei.value.reason
    # A saver whose previous link was replaced writes a full checkpoint, not a delta against it.
    shutil.rmtree(os.path.join(root, "c4"))
    distckpt.save(_state(4), os.path.join(root, "c4"))
    _touch(sd, 5)
    saver.save(sd, os.path.join(root, "c5"))
    assert saver.last_kind == "full"
    _expect(os.path.join(root, "c5"), _snap(sd))


# ------------------------------------------------------------------------------------------------
# Any row-sharded tensor: DTensors, tracked by the default rule, restored onto another sharding


def _dtensor_chain(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(5)
    emb = torch.randn(1000, 16, generator=g)
    saver = IncrementalSaver(IncrementalPolicy(full_every=5, max_chain_fraction=1.0))  # rows=None: DTensors
    kinds, touched = [], None
    for k in range(3):
        if k:
            touched = torch.randint(0, 1000, (40,), generator=g)
            emb[touched] += 1.0
        sd = {"model": {"emb": distribute_tensor(emb.clone(), mesh, [Shard(0)])}, "step": k}
        saver.save(sd, os.path.join(root, f"d{k}"))
        kinds.append(saver.last_kind)
    # Restore onto a column split (Shard(1)) at the same world size.
    target = {"model": {"emb": distribute_tensor(torch.zeros(1000, 16), mesh, [Shard(1)])}, "step": -1}
    distckpt.load(target, os.path.join(root, "d2"))
    same = torch.equal(target["model"]["emb"].full_tensor(), emb) and target["step"] == 2
    emb2 = emb.clone()
    # Continue the chain on the column split: d3 holds half-width pieces, d1 and d2 full-width
    # ones. d3 changes again rows that d2 holds (all columns), and other rows in the left half
    # only, so every row's columns come from different links.
    saver.resume(target, os.path.join(root, "d2"))
    emb[touched[:20]] += 2.0
    emb[torch.arange(500, 520), :8] -= 3.0
    sd = {"model": {"emb": distribute_tensor(emb.clone(), mesh, [Shard(1)])}, "step": 3}
    saver.save(sd, os.path.join(root, "d3"))
    kinds.append(saver.last_kind)
    target = {"model": {"emb": distribute_tensor(torch.zeros(1000, 16), mesh, [Shard(0)])}, "step": -1}
    distckpt.load(target, os.path.join(root, "d3"))
    same = same and torch.equal(target["model"]["emb"].full_tensor(), emb) and target["step"] == 3
    return kinds, same, (emb2, emb) if rank == 0 else None


def test_dtensor_rows_any_sharding(tmp_path, monkeypatch):
    res = run_ranks(_dtensor_chain, 2, str(tmp_path), timeout=180, preload=_TORCHREC_PRELOAD)
    assert [r[0] for r in res] == [["full", "delta", "delta", "delta"]] * 2
    assert all(r[1] for r in res)
    emb2, emb = res[0][2]
    assert torch.equal(distckpt.read(str(tmp_path / "d2"))["model"]["emb"], emb2)
    assert [link.meta["kind"] for link in chain_of(str(tmp_path / "d3"))] == ["delta", "delta", "delta", "full"]
    # The chain mixes column splits: d1 and d2 hold whole rows, d3 half rows.
    widths = {os.path.basename(link.path): sorted({box_of(link, parts["box"])[1][1]
                                                   for parts in pieces_of(link, 0).values()})
              for link in chain_of(str(tmp_path / "d3"))[:-1]}
    assert widths == {"d1": [16], "d2": [16], "d3": [8]}, widths
    # Composing it in one process writes every (row, column) at most once, from its newest link:
    # count the writes of the delta scatter per element of the target.
    counts: dict[int, torch.Tensor] = {}
    real = inc._ScatterRows.copy_

    def counted(self, src):
        t = self.target
        c = counts.setdefault(t.untyped_storage().data_ptr(),
                              torch.zeros(t.untyped_storage().nbytes() // t.element_size(), dtype=torch.int32))
        idx = self.idx if self.mask is None else self.idx[self.mask]
        c.as_strided(t.shape, t.stride(), t.storage_offset()).index_add_(
            0, idx, torch.ones((idx.numel(),) + tuple(t.shape[1:]), dtype=torch.int32))
        return real(self, src)
    monkeypatch.setattr(inc._ScatterRows, "copy_", counted)
    got = distckpt.read(str(tmp_path / "d3"))["model"]["emb"]
    assert torch.equal(got, emb)
    (written,) = counts.values()
    assert int(written.max()) == 1, "an element was written by two links"
    assert bool((written.reshape(1000, 16)[500:520, :8] == 1).all())   # d3's left half of these rows


# ------------------------------------------------------------------------------------------------
# watch_writes: only the rows on pages written since the previous link are hashed again


def _watch_or_skip():
    from distckpt import writewatch
    w = writewatch.get()
    if not w.available:
        pytest.skip(w.reason)
    return w


def _padded_state(seed: int):
    """_state(seed) with its tracked tensors inside larger buffers (two pages of untouched
    padding around each): a heap allocation shares its first and last page with its neighbours,
    whose writes (the save's own Python objects) would make those pages count as written."""
    sd = _state(seed)
    emb, mom = sd["model"]["emb"], sd["optim"]["mom"]
    pe, pm = 2 * 4096 // 64, 2 * 4096 // 4
    sd["model"]["emb"] = torch.zeros(emb.shape[0] + 2 * pe, emb.shape[1])[pe:-pe].copy_(emb)
    sd["optim"]["mom"] = torch.zeros(mom.shape[0], mom.shape[1] + 2 * pm)[:, pm:-pm].copy_(mom)
    return sd


def _count_hashed(monkeypatch):
    """Counts the rows the C core hashes (every host digest goes through it), independently of
    the saver's own last_hashed_rows."""
    from distckpt import _uring
    seen = []
    real = _uring.row_digests

    def counted(base, n, *rest):
        seen.append(n)
        return real(base, n, *rest)
    monkeypatch.setattr(_uring, "row_digests", counted)
    return seen


def test_watch_writes_hashes_only_written_rows_from_any_code_path(tmp_path, monkeypatch):
    monkeypatch.setattr(inc, "_RUN_COST_BYTES", 0)   # hash the written rows only, however few
    import ctypes
    _watch_or_skip()
    sd = _padded_state(3)
    emb, mom = sd["model"]["emb"], sd["optim"]["mom"]   # 4000 x 64 B rows; 2 x 4000 per-row state
    saver = IncrementalSaver(IncrementalPolicy(rows=ROWS, watch_writes=True, max_chain_fraction=2.0))
    seen = _count_hashed(monkeypatch)
    saver.save(sd, str(tmp_path / "a"))
    assert saver.last_kind == "full" and sum(seen) == saver.last_hashed_rows == 8000 and saver.watch_status == {}
    # Nothing written: nothing hashed, an empty delta.
    seen.clear()
    saver.save(sd, str(tmp_path / "b"))
    assert saver.last_kind == "delta" and sum(seen) == saver.last_hashed_rows == 0
    assert saver._link["rows_written"] == 0
    # Writes that bypass the version counter: .data, numpy, a raw pointer, the kernel (readinto).
    v0 = (emb._version, mom._version)
    emb.data[7, 3] = 123.0
    mom.numpy()[1, 3999] = -2.0
    ctypes.memmove(emb.data_ptr() + 2500 * 64 + 60, b"\x7f\x7f\x7f\x7f", 4)
    src = tmp_path / "row.bin"
    src.write_bytes(torch.full((16,), 9.0).numpy().tobytes())
    with open(src, "rb", buffering=0) as f:
        assert f.readinto(memoryview(emb[3100].numpy()).cast("B")) == 64
    assert (emb._version, mom._version) == v0, "these writes were meant to bypass the version counter"
    seen.clear()
    saver.save(sd, str(tmp_path / "c"))
    # Rows 7, 2500, 3100 and mom[1, 3999] changed. emb: only the rows on those three pages were
    # hashed (64 a page); mom whole (any written page does it: its rows are 8 bytes, as many as
    # the copy of their digests that hashing only some of them needs).
    assert saver.last_kind == "delta" and saver._link["rows_written"] == 4
    assert sum(seen) == saver.last_hashed_rows and 4000 in seen, seen
    assert 3 <= saver.last_hashed_rows - 4000 <= 3 * 4096 // 64, seen
    _expect(str(tmp_path / "c"), _snap(sd))
    # The digests kept are those of the whole state, as without watching.
    for key, dg in saver._digests.items():
        assert torch.equal(dg, row_digests(emb if key[0] == "model.emb" else mom, ROWS[key[0]])), key


def test_watch_writes_hashes_unwatchable_memory_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(inc, "_RUN_COST_BYTES", 0)   # hash the written rows only, however few
    _watch_or_skip()
    sd = _padded_state(4)
    sd["model"]["emb"].share_memory_()   # another process could write it: never trusted to the watch
    saver = IncrementalSaver(IncrementalPolicy(rows=ROWS, watch_writes=True))
    seen = _count_hashed(monkeypatch)
    saver.save(sd, str(tmp_path / "a"))
    seen.clear()
    saver.save(sd, str(tmp_path / "b"))
    assert "model.emb" in saver.watch_status and "optim.mom" not in saver.watch_status
    assert sum(seen) == saver.last_hashed_rows == 4000   # emb whole, mom not at all
    sd["model"]["emb"][11] += 1.0
    saver.save(sd, str(tmp_path / "c"))
    assert saver._link["rows_written"] == 1
    _expect(str(tmp_path / "c"), _snap(sd))


def test_watch_writes_after_a_failed_save_and_a_moved_tensor(tmp_path, monkeypatch):
    _watch_or_skip()
    sd = _padded_state(5)
    saver = IncrementalSaver(IncrementalPolicy(rows=ROWS, watch_writes=True, max_chain_fraction=2.0))
    saver.save(sd, str(tmp_path / "a"))
    sd["model"]["emb"][20] += 1.0
    # A failed save (the path exists) leaves the saver at "a": the row written before it is
    # still found by the next save, though that failed save's scan already re-protected its page.
    distckpt.save({"x": torch.zeros(1)}, str(tmp_path / "b"))
    with pytest.raises(distckpt.errors.CheckpointExistsError):
        saver.save(sd, str(tmp_path / "b"))
    saver.save(sd, str(tmp_path / "c"))
    assert saver.last_kind == "delta" and saver._link["rows_written"] == 1
    # A tracked tensor replaced by a copy (other memory) is hashed whole, not trusted to the
    # pages of the old one.
    sd["model"]["emb"] = sd["model"]["emb"].clone()
    sd["model"]["emb"][30] += 1.0
    seen = _count_hashed(monkeypatch)
    saver.save(sd, str(tmp_path / "d"))
    assert 4000 in seen and saver._link["rows_written"] == 1
    _expect(str(tmp_path / "d"), _snap(sd))


def _fused_watch(rank, world, root):
    """A 1-rank DistributedModelParallel with fused EXACT_ROWWISE_ADAGRAD and EXACT_SGD tables
    (fbgemm CPU kernels); returns what the test checks."""
    import torch.distributed as dist
    import torchrec.optim as tro
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from distckpt.flatten import flatten
    from distckpt.integrations import torchrec as dtr
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=f"t{i}", num_embeddings=20000, embedding_dim=16,
                                                            feature_names=[f"f{i}"]) for i in range(3)],
                                 device=torch.device("meta"))
    apply_optimizer_in_backward(tro.RowWiseAdagrad, [ebc.embedding_bags["t0"].weight, ebc.embedding_bags["t2"].weight],
                                {"lr": 0.05})
    apply_optimizer_in_backward(torch.optim.SGD, [ebc.embedding_bags["t1"].weight], {"lr": 0.1})
    plan = dtr.hand_plan({"": ebc}, {"": {"t0": "table_wise:0", "t1": "table_wise:0", "t2": "row_wise"}},
                         world_size=world)
    dmp = DistributedModelParallel(ebc, env=ShardingEnv.from_process_group(dist.group.WORLD), plan=plan,
                                   device=torch.device("cpu"))
    saver = IncrementalSaver(IncrementalPolicy(rows=dtr.incremental_rows, watch_writes=True))
    inc._RUN_COST_BYTES = int(os.environ["DISTCKPT_TEST_RUN_COST"])   # hash the written rows only

    def snapshot():
        sd = dtr.state_dict(dmp)
        _t, items = flatten(sd, check_objects=False)
        return sd, {f: [p.tensor.clone() for p in items[f].pieces] for f in dtr.incremental_rows(sd)}, items

    def step(ids):   # t0 (rowwise Adagrad) and t1 (SGD) see lookups; t2 none
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1", "f2"], values=torch.tensor(ids + ids[:1]),
                                                  lengths=torch.tensor([len(ids), 1, 0]))
        dmp(kjt).values().sum().backward()
    sd, before, _items = snapshot()
    saver.save(sd, os.path.join(root, "a"))
    step([5, 17000, 9000])
    per_piece = {}   # data_ptr -> rows hashed again by the second save
    real = inc._rehash_written

    def spy(t, row_dim, prev, written):
        out, n = real(t, row_dim, prev, written)
        per_piece[t.data_ptr()] = n
        return out, n
    inc._rehash_written = spy
    sd, after, items = snapshot()
    rows = dtr.incremental_rows(sd)
    changed = {f: sum(int((b != a).reshape(b.shape[0], -1).any(1).sum()) if rows[f] == 0
                      else int((b != a).any(0).sum()) for b, a in zip(before[f], after[f])) for f in after}
    saver.save(sd, os.path.join(root, "b"))
    distckpt.save(sd, os.path.join(root, "full"))
    _t, got = flatten(distckpt.read(os.path.join(root, "b")), check_objects=False)
    _t, ref = flatten(distckpt.read(os.path.join(root, "full")), check_objects=False)
    same = sorted(got) == sorted(ref) and all(torch.equal(got[f].pieces[0].tensor, ref[f].pieces[0].tensor)
                                              for f in rows)
    hashed = {f: sum(per_piece.get(p.tensor.data_ptr(), -10**9) for p in items[f].pieces) for f in rows}
    return saver.last_kind, saver._link["rows_written"], changed, hashed, saver.watch_status, same


def test_watch_writes_sees_fused_optimizer_steps(tmp_path):
    """fbgemm's fused TBE optimizers update weights and state in C++ without bumping the tensors'
    version counter (torchrec 1.8.0): the watch sees those writes all the same, and a table
    the step did not touch (t2) is not hashed at all."""
    _watch_or_skip()
    (kind, written, changed, hashed, status, same), = run_ranks(_fused_watch, 1, str(tmp_path), timeout=180,
                                                                       env={"DISTCKPT_TEST_RUN_COST": "0"},
                                                                       preload=_TORCHREC_PRELOAD)
    assert status == {} and kind == "delta" and same
    assert changed == {"model.embedding_bags.t0.weight": 3, "optim.embedding_bags.t0.weight.momentum1": 3,
                       "model.embedding_bags.t1.weight": 1, "model.embedding_bags.t2.weight": 0,
                       "optim.embedding_bags.t2.weight.momentum1": 0}, changed
    assert written == 7
    # Hashed again: the weight rows on a page with a changed row (64-byte rows: 64 a page), plus
    # those on each tensor's first and last page, which a heap allocation shares with its
    # neighbours; t0's momentum whole (4-byte rows: hashing only some needs a copy of their
    # 8-byte digests); t2's weights at most its two edge pages' rows, though 1.3 MB.
    w = "model.embedding_bags.t{}.weight"
    assert 3 <= hashed[w.format(0)] <= 5 * 64 and 1 <= hashed[w.format(1)] <= 3 * 64, hashed
    assert hashed["optim.embedding_bags.t0.weight.momentum1"] == 20000, hashed
    assert 0 <= hashed[w.format(2)] <= 2 * 64, hashed


def _forked_child_watch(conn):
    from distckpt import writewatch
    w = writewatch.get()
    conn.send((w.pid == os.getpid(), w is not _PARENT_WATCH[0]))
    conn.close()


_PARENT_WATCH: list = [None]


def test_watch_writes_a_forked_child_gets_its_own_watcher():
    """The parent's pagemap descriptor reads the parent's page tables: a child must not use it."""
    import multiprocessing as mp
    from distckpt import writewatch
    _watch_or_skip()
    _PARENT_WATCH[0] = writewatch.get()
    parent, child = mp.get_context("fork").Pipe()
    p = mp.get_context("fork").Process(target=_forked_child_watch, args=(child,))
    p.start()
    got = parent.recv()
    p.join(30)
    assert got == (True, True)


def test_watch_writes_sees_a_load_into_the_tracked_tensors(tmp_path):
    """distckpt.load fills the tensors in place from its read pipeline (C copies from bounce
    buffers, no torch op): a saver that goes on after it finds every row the load changed."""
    _watch_or_skip()
    sd = _padded_state(6)
    saver = IncrementalSaver(IncrementalPolicy(rows=ROWS, watch_writes=True, max_chain_fraction=2.0))
    saver.save(sd, str(tmp_path / "a"))
    old = _snap(sd)
    _touch(sd, 1)
    saver.save(sd, str(tmp_path / "b"))
    assert saver._link["rows_written"] > 0
    distckpt.load(sd, str(tmp_path / "a"))      # back to a's state, in place
    assert torch.equal(sd["model"]["emb"], old["model"]["emb"])
    saver.save(sd, str(tmp_path / "c"))
    assert saver.last_kind == "delta" and saver.last_hashed_rows > 0
    _expect(str(tmp_path / "c"), old)
