"""The CUDA path: GPU tensors saved through the pinned staging ring and loaded back onto the GPU.

Needs a CUDA GPU (skipped elsewhere, with the reason in the summary). What it holds:
  * a save of GPU tensors writes exactly the bytes and checksums a save of their host copies
    writes (the ring cuts pieces at checksum-block multiples), and loads back bit-exact onto the
    GPU and onto the host, including pieces larger than a staging slot, non-contiguous, conj,
    0-d and empty tensors;
  * stream ordering: kernels queued on the caller's current stream (default or not) before save()
    have written the tensors before they are copied;
  * async_save snapshots GPU tensors: changing them after it returns does not change the checkpoint;
  * incremental saves of GPU tables: digests computed on the GPU equal the host's, and a chain of
    GPU links composes bit-exact onto the GPU and the host;
  * NCCL training with a gloo control group ("cpu:gloo,cuda:nccl"), FSDP2 fully_shard and
    get_state_dict/set_state_dict: the restored run continues bit-identically.
"""

from __future__ import annotations

import os

import pytest
import torch

import distckpt
from distckpt.config import get_config
from distckpt.verify import verify

from ..helpers.distributed import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (the GPU staging and NCCL paths)")


def _state(device: str) -> dict:
    g = torch.Generator().manual_seed(7)
    big = torch.randn(3000, 1024, generator=g).to(torch.bfloat16)  # 6 MiB: many 256 KiB slot parts
    return {
        "big": big.to(device),
        "t": torch.randn(300, 500, generator=g).t().to(device),  # non-contiguous
        "c": torch.complex(torch.randn(40, generator=g), torch.randn(40, generator=g)).to(device).conj(),
        "b": (torch.randn(1000, generator=g) > 0).to(device),
        "scalar": torch.tensor(3.25, dtype=torch.float64).to(device),
        "empty": torch.empty(0, 5).to(device),
        "small": [torch.randn(17, generator=g).to(device) for _ in range(50)],
        "i8": torch.randint(-128, 127, (4097,), dtype=torch.int8, generator=g).to(device),
    }


def _flat(sd, prefix=""):
    out = {}
    for k, v in sd.items() if isinstance(sd, dict) else enumerate(sd):
        if isinstance(v, (dict, list)):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _same(a, b) -> bool:
    a, b = a.detach().cpu().resolve_conj(), b.detach().cpu().resolve_conj()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


@pytest.fixture
def small_ring(monkeypatch):
    # 512 KiB of staging: 2 slots of 256 KiB, so "big" (6 MiB) streams through the ring in 24 parts.
    monkeypatch.setenv("DISTCKPT_DEVICE_STAGING", "512K")
    monkeypatch.setenv("DISTCKPT_CHECKSUM_BLOCK", "64K")
    get_config.cache_clear()
    yield
    get_config.cache_clear()


def test_gpu_save_equals_host_save_and_loads_bit_exact(tmp_path, small_ring):
    gpu = _state("cuda")
    host = {k: ([t.cpu() for t in v] if isinstance(v, list) else v.cpu()) for k, v in gpu.items()}
    distckpt.save(gpu, str(tmp_path / "gpu"))
    distckpt.save(host, str(tmp_path / "host"))
    # The same chunks with the same bytes and checksums. (Only file offsets may differ: a host
    # chunk may be placed a few bytes later so that it is written zero-copy, Writer.pad_for.)
    def chunks(path):
        m = distckpt.read_manifest(str(path))
        data = open(os.path.join(str(path), "rank00000.bin"), "rb").read()
        return {fqn: [(c["offsets"], c["sizes"], c["nbytes"], c["crcs"], data[c["offset"]:c["offset"] + c["nbytes"]])
                      for c in e["chunks"]] for fqn, e in m["tensors"].items()}
    g, h = chunks(tmp_path / "gpu"), chunks(tmp_path / "host")
    assert g == h and len(g) == len(_flat(gpu))
    assert verify(str(tmp_path / "gpu")).ok

    dst = _state("cuda")
    for t in _flat(dst).values():
        if t.numel() and t.dtype != torch.bool:
            t.zero_()
    distckpt.load(dst, str(tmp_path / "gpu"))
    want = _flat(gpu)
    bad = [k for k, v in _flat(dst).items() if not _same(v, want[k])]
    assert not bad, bad
    assert all(v.device.type == "cuda" for v in _flat(dst).values())

    hdst = {k: ([torch.zeros_like(t).cpu() for t in v] if isinstance(v, list) else torch.zeros_like(v).cpu())
            for k, v in gpu.items()}
    distckpt.load(hdst, str(tmp_path / "gpu"))
    bad = [k for k, v in _flat(hdst).items() if not _same(v, want[k])]
    assert not bad, bad


@pytest.mark.parametrize("side_stream", [False, True])
def test_kernels_queued_before_save_are_in_the_checkpoint(tmp_path, side_stream):
    x = torch.zeros(32 << 20, device="cuda")  # 128 MiB
    s = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        for _ in range(20):  # long enough that an unordered copy would see partial sums
            x.add_(1.0)
        distckpt.save({"x": x}, str(tmp_path / "c"))
    out = {"x": torch.empty(32 << 20)}
    distckpt.load(out, str(tmp_path / "c"))
    assert torch.all(out["x"] == 20.0)


def test_async_save_snapshots_gpu_tensors(tmp_path):
    x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    want = x.cpu().clone()
    h = distckpt.async_save({"x": x}, str(tmp_path / "a"))
    x.mul_(-1)  # after the call returned: must not reach the checkpoint
    h.result()
    out = {"x": torch.empty(1 << 20)}
    distckpt.load(out, str(tmp_path / "a"))
    assert torch.equal(out["x"], want)


@pytest.mark.parametrize("side_stream", [False, True])
def test_background_staging_copies_the_state_of_the_call_beside_later_kernels(tmp_path, side_stream):
    """stage_in_background on CUDA: kernels queued before the call (on the caller's current stream,
    unsynchronized) are in the checkpoint; kernels queued after it (the next forward) run beside
    the copy without changing it; an in-place change queued before wait_staged() fails the save
    with StateChangedError, one queued after it does not reach the checkpoint."""
    from distckpt.errors import StateChangedError
    x = torch.zeros(32 << 20, device="cuda")  # 128 MiB
    y = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    sd = {"x": x, "y": y}
    s = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        for _ in range(20):  # long enough that an unordered copy would see partial sums
            x.add_(1.0)
        h = distckpt.async_save(sd, str(tmp_path / "a"), stage_in_background=True)
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):  # the next forward and backward: does not touch the state
            a = (a @ a) / 4096
        assert h.wait_staged(120)
        x.mul_(-1)  # the optimizer step, after the staging
        y.zero_()
    h.result()
    out = {"x": torch.empty(32 << 20), "y": torch.empty(1 << 20)}
    distckpt.load(out, str(tmp_path / "a"))
    assert torch.all(out["x"] == 20.0) and torch.equal(out["y"], torch.arange(1 << 20, dtype=torch.float32))

    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        h = distckpt.async_save(sd, str(tmp_path / "b"), stage_in_background=True)
        x.add_(1.0)  # before wait_staged(): the optimizer did not wait
    with pytest.raises(StateChangedError):
        h.result()
    assert not os.path.exists(str(tmp_path / "b"))


def test_async_staging_is_pinned_ahead_and_never_on_the_callers_path(tmp_path, monkeypatch):
    """Nothing reserved: the first async save of GPU tensors stages through a plain (pageable)
    allocation and the pool then pins one of that size in the background (cudaHostRegister, exact
    size); reserved: the save stages into the pinned segment with DMAs. Both bit-exact."""
    from distckpt.staging import pool as pool_mod
    import distckpt.save_async as sa
    pool = pool_mod.StagingPool()
    monkeypatch.setattr(pool_mod, "_POOL", pool)
    monkeypatch.setattr(sa, "staging_pool", lambda: pool)
    sd = _state("cuda")
    want = {k: v.detach().cpu().clone() for k, v in _flat(sd).items()}
    distckpt.async_save(sd, str(tmp_path / "plain")).result()
    for _ in range(600):
        if pool.pending_bytes() == 0:
            break
        import time
        time.sleep(0.1)
    assert pool.pending_bytes() == 0 and pool.idle_bytes() > 0
    assert all(seg.pinned for seg in pool._idle), "the overflow was not replaced by pinned memory"
    with torch.cuda.device(0):
        distckpt.async_save(sd, str(tmp_path / "pinned")).result()
    for name in ("plain", "pinned"):
        back = _flat(distckpt.read(str(tmp_path / name)))
        assert set(back) == set(want)
        for k, v in want.items():
            assert _same(back[k], v), (name, k)
    assert pool.clear() > 0 and pool.idle_bytes() == 0
    res = distckpt.reserve_staging_memory(sd)
    assert res.wait(120) and res.error is None
    assert all(seg.pinned for seg in pool._idle)
    before = pool.allocations
    distckpt.async_save(sd, str(tmp_path / "reserved")).result()
    assert pool.allocations == before
    back = _flat(distckpt.read(str(tmp_path / "reserved")))
    for k, v in want.items():
        assert _same(back[k], v), ("reserved", k)
    pool.clear()


def _nccl_fsdp2(rank, world, tmp):
    import datetime

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cuda", (world,))

        def build():
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).cuda()
            for layer in m:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(m, mesh=mesh)
            return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

        def step(m, opt, i):
            g = torch.Generator(device="cpu").manual_seed(100 + i)
            x = torch.randn(16, 64, generator=g).cuda()
            loss = m(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.item()

        m, opt = build()
        for i in range(3):
            step(m, opt, i)
        msd, osd = get_state_dict(m, opt)
        distckpt.save({"model": msd, "optim": osd, "step": 3}, os.path.join(tmp, "ck"))
        after = [step(m, opt, i) for i in range(3, 5)]

        m2, opt2 = build()
        msd2, osd2 = get_state_dict(m2, opt2)
        state = {"model": msd2, "optim": osd2, "step": 0}
        distckpt.load(state, os.path.join(tmp, "ck"))
        set_state_dict(m2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
        assert state["step"] == 3
        again = [step(m2, opt2, i) for i in range(3, 5)]
        same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(m.parameters(), m2.parameters()))
        return after, again, same
    finally:
        dist.destroy_process_group()


def test_nccl_fsdp2_resume_is_bit_identical(tmp_path):
    (after, again, same), = run_ranks(_nccl_fsdp2, 1, str(tmp_path), init_process_group=False, timeout=300)
    assert after == again
    assert same


def test_replica_digest_of_lazy_views_on_the_gpu():
    # The replica check digests plain tensors on their device; a conj/neg view digests the values
    # it stands for (it used to raise an untyped view error for a conj view on a GPU).
    from distckpt.saveplan import tensor_digests
    c = torch.complex(torch.randn(100), torch.randn(100)).cuda()
    x = torch.randn(1001).cuda()
    got = tensor_digests([c.conj(), c.conj().resolve_conj(), x._neg_view(), -x, x])
    assert got[0] == got[1] and got[2] == got[3] and got[3] != got[4]


def _two_rank_gpu_save(rank, world, tmp):
    # Two processes share the one GPU (NCCL refuses that, so the tensors' collectives are not
    # used: DTensors are built from their local shards); distckpt's own control group is gloo.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (world,))
    full = torch.arange(4096 * 33, dtype=torch.float32).reshape(4096, 33).cuda()
    rows = full.shape[0] // world
    local = full[rank * rows:(rank + 1) * rows].clone()
    sd = {"w": DTensor.from_local(local, mesh, [Shard(0)], run_check=False),
          "bias": torch.linspace(0, 1, 77).cuda(),            # a plain replica: digests compared
          "step": 5}
    distckpt.save(sd, os.path.join(tmp, "ck"))
    out = {"w": torch.empty(4096, 33, device="cuda"), "bias": torch.empty(77, device="cuda"), "step": 0}
    distckpt.load(out, os.path.join(tmp, "ck"))  # every rank reads the whole tensor
    ok = torch.equal(out["w"], full) and torch.equal(out["bias"], sd["bias"]) and out["step"] == 5
    # A replica that differs on one rank is refused (digests computed on the GPU), as on the host.
    bad = {"bias": torch.linspace(0, 1, 77).cuda() + rank}
    try:
        distckpt.save(bad, os.path.join(tmp, "bad"))
        refused = None
    except distckpt.errors.DistCkptError as exc:
        refused = type(exc).__name__
    return ok, refused


def test_two_ranks_save_gpu_shards_and_replicas(tmp_path):
    results = run_ranks(_two_rank_gpu_save, 2, str(tmp_path), timeout=300)
    assert [ok for ok, _ in results] == [True, True]
    assert results[0][1] == results[1][1] == "StateDictMismatchError"


def test_incremental_chain_of_gpu_tables(tmp_path, monkeypatch):
    """Incremental saves of GPU tables (as TorchRec keeps them): the row digests are computed on
    the GPU and equal the host's; a full link and two deltas of GPU tensors compose bit-exact
    into GPU and host targets; rows changed by a kernel queued just before the save are seen."""
    from distckpt.incremental import IncrementalPolicy, IncrementalSaver, row_digests
    g = torch.Generator().manual_seed(11)
    host = {"emb": torch.randn(5000, 24, generator=g), "mom": torch.rand(5000, generator=g),
            "col": torch.randn(16, 777, generator=g).to(torch.bfloat16)}
    for name, d in (("emb", 0), ("mom", 0), ("col", 1)):
        assert torch.equal(row_digests(host[name].cuda(), d), row_digests(host[name], d)), name
    big = torch.randn(70000, 300, generator=g)   # one device block of the default size (16 M words)
    assert torch.equal(row_digests(big.cuda()), row_digests(big))
    import distckpt.incremental as inc
    monkeypatch.setattr(inc, "_DEVICE_BLOCK_WORDS", 100_000)   # 667 rows a block: 105 blocks
    assert torch.equal(row_digests(big.cuda()), row_digests(big))
    assert torch.equal(row_digests(host["col"].cuda(), 1), row_digests(host["col"], 1))

    state = {"model": {"emb": host["emb"].cuda(), "col": host["col"].cuda()}, "optim": {"mom": host["mom"].cuda()},
             "step": 0}
    saver = IncrementalSaver(IncrementalPolicy(rows={"model.emb": 0, "optim.mom": 0, "model.col": 1},
                                               max_delta_fraction=0.9, max_chain_fraction=5.0))
    saver.save(state, str(tmp_path / "s0"))
    assert saver.last_kind == "full"
    for k, rows in ((1, [3, 99, 4999]), (2, [0, 99, 2500])):
        idx = torch.tensor(rows, device="cuda")
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):   # a kernel on another stream, then the save on it
            state["model"]["emb"].index_add_(0, idx, torch.ones(len(rows), 24, device="cuda"))
            state["optim"]["mom"][idx] += 1.0
            state["model"]["col"][:, rows[0]] -= 1
            state["step"] = k
            saver.save(state, str(tmp_path / f"s{k}"))
        assert saver.last_kind == "delta", k
    want = {"emb": state["model"]["emb"].cpu(), "mom": state["optim"]["mom"].cpu(), "col": state["model"]["col"].cpu()}
    for dev in ("cuda", "cpu"):
        dst = {"model": {"emb": torch.zeros(5000, 24, device=dev), "col": torch.zeros(16, 777, dtype=torch.bfloat16,
                                                                                     device=dev)},
               "optim": {"mom": torch.zeros(5000, device=dev)}, "step": -1}
        distckpt.load(dst, str(tmp_path / "s2"))
        assert dst["step"] == 2
        assert _same(dst["model"]["emb"], want["emb"]) and _same(dst["optim"]["mom"], want["mom"])
        assert _same(dst["model"]["col"], want["col"]), dev
