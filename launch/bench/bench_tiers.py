"""Tiered checkpoints (distckpt.tiers, issue #25): what the training loop pays, how fast the drain
runs, and how fast a replaced node restores, side by side in one run against one local server.

    python launch/bench/bench_tiers.py [--size 512M] [--tensors 8] [--repeat 2] [--no-llama]
                                       [--no-loop] [--no-restore] [--no-save-drain] [--no-replicas] [--restore-size 512M] [--dir /tmp]

Started from the repository root: it starts the test suite's SeaweedFS server
(tests/helpers/s3server.py) on 127.0.0.1 with free ports and stops it at the end. Every contender
runs in the same process against the same server, rounds interleaved (A B C D, A B C D, ...) so a
machine loaded by other work slows each alike; the median and best round are printed, with ratios.

1. Blocked time of a save (per state shape): TieredCheckpointManager.save, blocking=True (returns
   once the local tier committed) and blocking=False (the handle returned: the staging copy), vs
   CheckpointManager.save on a local directory alone and CheckpointManager.save on s3:// (a direct
   save to the same server). Goals: tiered <= 1.1x local-only, direct S3 >= 5x tiered.
2. Drain throughput: the step's data bytes / (local commit -> wait_durable returns) vs a raw s3fs
   upload of the same files (``fs.put_file`` of each file, one after another as the drain does, with
   distckpt's part size and parts in flight). Goal >= 0.9x. With the CPU seconds per GiB of this
   process and of the server, and a drain to a second local directory (the drain's own cost).
3. A training loop (a 2-layer MLP on CPU, batch calibrated to a step of ~20-50 ms) stepping while a
   drain of the synthetic state runs, vs the same loop with nothing in the background: median step
   time ratio, goal <= 1.1x. Diagnostics in the same rounds: the same drain with its threads, the
   fsspec I/O thread and the server's threads at nice 19; the loop while a raw s3fs upload of the
   same files runs (the server + client's share); while a drain to a second local directory runs
   (the drain's own read / crc32c / copy, no server). All of it with torch's default threads and
   with one torch thread.
4. Recovery of a lost node, three ways side by side: 2 gloo ranks (spawned), each with a private
   local directory (node0, node1), DTensors sharded on dim 0 saved once by a
   TieredCheckpointManager with replicas=1, replicated and drained. Interleaved in each round:
   mgr.load with both nodes intact (local); with node1's copy of the step gone (rank 1 fetches its
   file from node 0's replica: peers); with node0's replica moved aside too (rank 1 reads from the
   remote tier); and distckpt.load of the remote step URL (both ranks remote). Goal: peers beat
   remote.
5. The blocked time of a tiered save with replicas=1 against replicas=0 (the same 2 ranks and
   state, two managers with their own local roots, interleaved; each save then waited until
   replicated and durable). Goal: <= 1.1x.

State shapes: (a) ``--tensors`` float32 tensors of ``--size`` bytes in all; (b) a LLaMA-like
transformer's state_dict (transformers.LlamaConfig, random init; ``--llama-*``) plus its Adam
state after one step (exp_avg, exp_avg_sq: 3x the parameters' bytes).
"""

from __future__ import annotations

import argparse
import gc
import glob
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

sys.path.insert(1, str(Path(__file__).resolve().parent))
from bench import local_bytes  # noqa: E402  (bytes of a nested state's tensors)

MiB = 1 << 20


# ------------------------------------------------------------------------------------------------ states


def synthetic(total: int, n: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(total // n // 4, generator=g) for i in range(n)}


def llama_state(hidden: int, layers: int, inter: int, vocab: int) -> dict:
    torch.manual_seed(0)
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter, vocab_size=vocab,
                          num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                          max_position_embeddings=2048, tie_word_embeddings=False)
        model = LlamaForCausalLM(cfg)
        ids = torch.randint(0, vocab, (1, 16))
        loss = model(input_ids=ids, labels=ids).loss
    except ImportError:  # an equivalent module: embeddings, attention + MLP projections, norms, head
        blocks = []
        for _ in range(layers):
            blocks += [torch.nn.Linear(hidden, hidden, bias=False) for _ in range(4)]
            blocks += [torch.nn.Linear(hidden, inter, bias=False), torch.nn.Linear(hidden, inter, bias=False),
                       torch.nn.Linear(inter, hidden, bias=False), torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)]
        model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(vocab, hidden), "layers": torch.nn.ModuleList(blocks),
                                     "head": torch.nn.Linear(hidden, vocab, bias=False)})
        loss = sum(p.sum() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    loss.backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def count_tensors(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, dict):
        return sum(count_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(count_tensors(v) for v in obj)
    return 0


# ------------------------------------------------------------------------------------------------ helpers


def part_settings() -> tuple[int, int]:
    from distckpt.storage.object.settings import settings
    cfg = settings()
    return cfg["part_size"], cfg["in_flight"]


def data_files(step_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(step_dir, "*.bin")))


def raw_put(fs, files: list[str], dest: str) -> None:
    """The limit: each data file uploaded as one object by s3fs, one after another (as a drain
    does on one rank), distckpt's part size and parts in flight."""
    part, in_flight = part_settings()
    for f in files:
        fs.put_file(f, f"{dest}/{os.path.basename(f)}", chunksize=part, max_concurrency=in_flight)


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system) used so far by this process (every thread) or by ``pid``."""
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds of this process and of the server between start() and stop()."""

    def __init__(self, server_pid: int):
        self.pid = server_pid

    def start(self):
        self.c0, self.s0 = cpu_s(), cpu_s(self.pid)

    def stop(self) -> tuple[float, float]:
        return cpu_s() - self.c0, cpu_s(self.pid) - self.s0


def med(xs):
    return statistics.median(xs)


def fmt(xs) -> str:
    return f"{med(xs):8.3f} {min(xs):8.3f} {max(xs):8.3f}"


# ------------------------------------------------------------------------------------------------ 1 + 2


def run_save_drain(server, bucket: str, tmp: str, name: str, sd, repeat: int) -> dict:
    """Blocked time of each save, drain and raw-upload time, interleaved rounds."""
    import distckpt
    from distckpt.tiers import TieredCheckpointManager

    opts = server.storage_options()
    fs = server.filesystem()
    base = os.path.join(tmp, name)
    local = distckpt.CheckpointManager(os.path.join(base, "local_only"), keep_last=1)
    direct = distckpt.CheckpointManager(f"s3://{bucket}/{name}/direct", keep_last=1, storage_options=opts)
    tiered = TieredCheckpointManager(local=os.path.join(base, "tier_local"), remote=f"s3://{bucket}/{name}/tiered",
                                     keep_last_local=1, keep_last_remote=1, storage_options=opts)
    posix = TieredCheckpointManager(local=os.path.join(base, "posix_local"), remote=os.path.join(base, "posix_remote"),
                                    keep_last_local=1, keep_last_remote=1)
    t: dict[str, list[float]] = {}
    cpu: dict[str, list[tuple[float, float]]] = {}
    meter = CpuMeter(server.pid)
    nbytes = 0

    def rec(k, v):
        t.setdefault(k, []).append(v)

    step = 0
    try:
        local.save(0, sd)  # warm-up, untimed: the process's first save pays one-off set-up
        for r in range(repeat):
            step += 1
            gc.collect()
            t0 = time.perf_counter()
            local.save(step, sd)
            rec("local-only save", time.perf_counter() - t0)

            step += 1
            gc.collect()
            t0 = time.perf_counter()
            tiered.save(step, sd)
            t1 = time.perf_counter()
            meter.start()
            tiered.wait_durable(step)
            t2 = time.perf_counter()
            cpu.setdefault("drain (blocking save)", []).append(meter.stop())
            rec("tiered save (blocking)", t1 - t0)
            rec("drain (blocking save)", t2 - t1)
            files = data_files(tiered.local_path(step))
            nbytes = sum(os.path.getsize(f) for f in files)
            gc.collect()
            dest = f"{bucket}/{name}/raw{r}"
            t0 = time.perf_counter()
            meter.start()
            raw_put(fs, files, dest)
            rec("raw s3fs put", time.perf_counter() - t0)
            cpu.setdefault("raw s3fs put", []).append(meter.stop())
            fs.rm(dest, recursive=True)

            step += 1
            gc.collect()
            t0 = time.perf_counter()
            handle = tiered.save(step, sd, blocking=False)
            t1 = time.perf_counter()
            handle.result()
            t2 = time.perf_counter()
            tiered.wait_durable(step)
            t3 = time.perf_counter()
            rec("tiered save (blocking=False)", t1 - t0)
            rec("  its local commit done", t2 - t0)
            rec("drain (async save)", t3 - t2)

            step += 1  # the drain's own cost: to a second local directory, no server
            posix.save(step, sd)
            gc.collect()
            t0 = time.perf_counter()
            meter.start()
            posix.wait_durable(step)
            rec("drain to a local dir", time.perf_counter() - t0)
            cpu.setdefault("drain to a local dir", []).append(meter.stop())

            step += 1
            gc.collect()
            t0 = time.perf_counter()
            direct.save(step, sd)
            rec("direct S3 save", time.perf_counter() - t0)
    finally:
        tiered.close()
        posix.close()
        local.close()
        direct.close()
    fs.rm(f"{bucket}/{name}", recursive=True)
    shutil.rmtree(base, ignore_errors=True)
    return {"times": t, "file_bytes": nbytes, "cpu": cpu}


# ------------------------------------------------------------------------------------------------ 3


class MLP(torch.nn.Module):
    def __init__(self, d: int = 512, h: int = 2048):
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, h), torch.nn.Linear(h, d)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x)))


class Loop:
    """A training loop stepping on CPU; ``run(until)`` steps until ``until()`` and returns the step times."""

    def __init__(self, target_s: float = 0.030):
        torch.manual_seed(0)
        self.model = MLP()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        batch = 8
        while True:
            self.x = torch.randn(batch, 512)
            self.y = torch.randn(batch, 512)
            for _ in range(3):
                self.step()
            s = med([self.timed() for _ in range(7)])
            if s >= target_s or batch >= 4096:
                break
            batch = int(batch * max(1.25, min(4.0, target_s / s)))
        self.batch, self.calibrated = batch, s

    def step(self):
        self.opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()

    def timed(self) -> float:
        t0 = time.perf_counter()
        self.step()
        return time.perf_counter() - t0

    def run(self, until) -> list[float]:
        out = []
        while not until() or len(out) < 5:
            out.append(self.timed())
        return out


def _in_background(fn) -> threading.Event:
    done = threading.Event()

    def body():
        try:
            fn()
        finally:
            done.set()
    threading.Thread(target=body, daemon=True).start()
    return done


def _background_tids(server_pid: int) -> list[int]:
    """The threads a drain keeps busy: the drainers' threads, fsspec's I/O loop thread (s3fs's
    requests) and every thread of the server process."""
    import fsspec.asyn
    tids = [t.native_id for t in threading.enumerate() if t.name.startswith("distckpt-drain")]
    tids += [t.native_id for t in fsspec.asyn.iothread if t is not None]
    tids += [int(x) for x in os.listdir(f"/proc/{server_pid}/task")]
    return tids


def _renice(tids: list[int], nice: int) -> None:
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:  # gone, or not allowed
            pass


def run_loop(server, bucket: str, tmp: str, sd, repeat: int, threads: int) -> dict:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run_loop(server, bucket, tmp, sd, repeat)
    finally:
        torch.set_num_threads(before)


def _run_loop(server, bucket: str, tmp: str, sd, repeat: int) -> dict:
    from distckpt.tiers import TieredCheckpointManager

    opts = server.storage_options()
    fs = server.filesystem()
    loop = Loop()
    base = os.path.join(tmp, "loop")
    tiered = TieredCheckpointManager(local=os.path.join(base, "tier_local"), remote=f"s3://{bucket}/loop/tiered",
                                     keep_last_local=1, keep_last_remote=1, storage_options=opts)
    posix = TieredCheckpointManager(local=os.path.join(base, "posix_local"), remote=os.path.join(base, "posix_remote"),
                                    keep_last_local=1, keep_last_remote=1)
    steps: dict[str, list[float]] = {}  # every step time of every window of a kind
    meds: dict[str, list[float]] = {}   # each window's median
    window = {"s": 8.0}

    def rec(k, xs):
        steps.setdefault(k, []).extend(xs)
        meds.setdefault(k, []).append(med(xs))

    step = 0
    try:
        for r in range(repeat):
            # no background work: as long as the last drain took
            end = time.perf_counter() + window["s"]
            rec("no drain", loop.run(lambda: time.perf_counter() >= end))

            step += 1
            tiered.save(step, sd)  # blocked time not part of the loop's figure
            t0 = time.perf_counter()
            done = _in_background(lambda s=step: tiered.wait_durable(s))
            rec("drain to S3 in flight", loop.run(done.is_set))
            window["s"] = time.perf_counter() - t0

            # The same with the drain's threads and the server's at nice 19 (a remote server does
            # not take the training node's cores; the drain's own threads yield to training).
            step += 1
            tiered.save(step, sd)
            tids = _background_tids(server.pid)
            _renice(tids, 19)
            try:
                done = _in_background(lambda s=step: tiered.wait_durable(s))
                rec("drain to S3, nice 19", loop.run(done.is_set))
            finally:
                _renice(tids, 0)

            files = data_files(tiered.local_path(step))
            dest = f"{bucket}/loop/raw{r}"
            done = _in_background(lambda: raw_put(fs, files, dest))
            rec("raw s3fs put in flight", loop.run(done.is_set))
            fs.rm(dest, recursive=True)

            step += 1
            posix.save(step, sd)
            done = _in_background(lambda s=step: posix.wait_durable(s))
            rec("drain to local dir in flight", loop.run(done.is_set))
    finally:
        tiered.close()
        posix.close()
    fs.rm(f"{bucket}/loop", recursive=True)
    shutil.rmtree(base, ignore_errors=True)
    return {"steps": steps, "meds": meds, "batch": loop.batch, "bytes": local_bytes(sd), "calibrated": loop.calibrated,
            "threads": torch.get_num_threads()}


# ------------------------------------------------------------------------------------------------ 4


def _sharded(full: dict, zero: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (2,))
    return {k: distribute_tensor(torch.zeros_like(v) if zero else v, mesh, [Shard(0)]) for k, v in full.items()}


def _full(size: int, n: int) -> dict:
    g = torch.Generator().manual_seed(3)
    return {f"w{i}": torch.randn(size // n // 4 // 256, 256, generator=g) for i in range(n)}


def _timed_collective(fn) -> tuple[float, object]:
    import torch.distributed as dist
    gc.collect()
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t0, out


def _check(sd, full) -> None:
    for k, v in sd.items():
        assert torch.equal(v.full_tensor(), full[k]), f"restore of {k} is not bit-exact"


def _lose_node1(tmp: str, replica_too: bool) -> None:
    """Node 1 loses the step (its directory's copy gone, as on a replacement node); with
    ``replica_too`` node 0's replica of rank 1's file is moved aside as well, so only the remote
    tier holds it. Run on rank 0 between barriers."""
    step = "step_00000001"
    shutil.rmtree(os.path.join(tmp, "node1", step), ignore_errors=True)
    if replica_too:
        os.rename(os.path.join(tmp, "node0", step, "rank00001.bin"), os.path.join(tmp, "aside-rank00001.bin"))


def _put_back(tmp: str) -> None:
    aside = os.path.join(tmp, "aside-rank00001.bin")
    if os.path.exists(aside):
        os.rename(aside, os.path.join(tmp, "node0", "step_00000001", "rank00001.bin"))


def _restore_job(rank, world, tmp, url, opts, size, n, repeat):
    import torch.distributed as dist

    import distckpt
    from distckpt.tiers import TieredCheckpointManager

    full = _full(size, n)
    local = os.path.join(tmp, f"node{rank}")
    out: dict[str, list[float]] = {}
    split: dict[str, dict] = {}
    with TieredCheckpointManager(local=local, remote=url, keep_last_local=2, storage_options=opts,
                                 replicas=1) as mgr:
        mgr.save(1, _sharded(full, False))
        mgr.wait_durable(1)
        assert mgr.status(1).replicas == "replicated", mgr.status(1)
        cases = (("tiered load, intact (local)", None), ("tiered load, node1 lost (peers)", False),
                 ("tiered load, node1 lost, no replica (remote)", True))
        for _ in range(repeat):  # interleaved
            for name, replica_too in cases:
                if replica_too is not None and rank == 0:
                    _lose_node1(tmp, replica_too)
                dist.barrier()
                sd = _sharded(full, True)
                s, res = _timed_collective(lambda: mgr.load(sd, 1))
                _check(sd, full)
                if rank == 0:
                    _put_back(tmp)
                out.setdefault(name, []).append(s)
                split[name] = {"by_tier": dict(res.bytes_by_tier), "from_peers": res.bytes_from_peers}
            if rank == 0:
                _lose_node1(tmp, False)  # the remote-only case left node 1 without the step: it gets it back
            dist.barrier()
            mgr.load(_sharded(full, True), 1)  # (from its peer; untimed)
            sd = _sharded(full, True)
            s, _ = _timed_collective(lambda: distckpt.load(sd, f"{url}/step_00000001", storage_options=opts))
            _check(sd, full)
            out.setdefault("distckpt.load of the remote step", []).append(s)
    return out, split


def run_restore(server, bucket: str, tmp: str, size: int, n: int, repeat: int) -> dict:
    from tests.helpers.distributed import run_ranks
    base = os.path.join(tmp, "restore")
    os.makedirs(base)
    url = f"s3://{bucket}/restore"
    opts = server.storage_options()
    res = run_ranks(_restore_job, 2, base, url, opts, size, n, repeat, timeout=1800)
    shutil.rmtree(base, ignore_errors=True)
    server.filesystem().rm(f"{bucket}/restore", recursive=True)
    return {"times": res[0][0], "split": [x[1] for x in res]}  # rank 0's barrier-to-barrier times


# ------------------------------------------------------------------------------------------------ 5


def _replica_job(rank, world, tmp, url, opts, size, n, repeat):
    """Blocked time of a tiered save with replicas=1 vs replicas=0, interleaved: two managers per
    rank (one local root each), every save then waited until durable (replication, then drain)."""
    from distckpt.tiers import TieredCheckpointManager

    full = _full(size, n)
    out: dict[str, list[float]] = {}
    mgrs = {k: TieredCheckpointManager(local=os.path.join(tmp, f"{k}-node{rank}"), remote=f"{url}/{k}",
                                       keep_last_local=2, keep_last_remote=2, storage_options=opts, replicas=k)
            for k in (0, 1)}
    try:
        for step in range(1, repeat + 2):  # step 1: warm-up (first save: room check, plan)
            for k, mgr in mgrs.items():
                sd = _sharded(full, False)
                s, _ = _timed_collective(lambda: mgr.save(step, sd))
                mgr.wait_durable(step)
                if step > 1:
                    out.setdefault(f"tiered save, replicas={k}", []).append(s)
                if k:
                    assert mgr.status(step).replicas == "replicated", mgr.status(step)
    finally:
        for mgr in mgrs.values():
            mgr.close()
    return out


def run_replica_blocked(server, bucket: str, tmp: str, size: int, n: int, repeat: int) -> dict:
    from tests.helpers.distributed import run_ranks
    base = os.path.join(tmp, "replicas")
    os.makedirs(base)
    res = run_ranks(_replica_job, 2, base, f"s3://{bucket}/replicas", server.storage_options(), size, n, repeat,
                    timeout=1800)
    shutil.rmtree(base, ignore_errors=True)
    server.filesystem().rm(f"{bucket}/replicas", recursive=True)
    return res[0]  # rank 0's barrier-to-barrier times


# ------------------------------------------------------------------------------------------------ report


def main(argv=None) -> int:
    from distckpt.sizes import format_bytes, parse_size
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="512M", help="bytes of the synthetic state (default 512M = 512 MiB)")
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--repeat", type=int, default=2, help="interleaved rounds of each part (default 2)")
    p.add_argument("--llama-hidden", type=int, default=768)
    p.add_argument("--llama-layers", type=int, default=4)
    p.add_argument("--llama-inter", type=int, default=2048)
    p.add_argument("--llama-vocab", type=int, default=8000)
    p.add_argument("--no-llama", action="store_true")
    p.add_argument("--no-loop", action="store_true")
    p.add_argument("--no-restore", action="store_true")
    p.add_argument("--no-save-drain", action="store_true", help="skip parts 1 and 2")
    p.add_argument("--no-replicas", action="store_true", help="skip part 5")
    p.add_argument("--restore-size", default="512M")
    p.add_argument("--restore-repeat", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the local tiers go (default: a temporary directory)")
    args = p.parse_args(argv)
    size = parse_size(args.size)
    part, in_flight = part_settings()
    t_start = time.perf_counter()

    shapes = {"synthetic": synthetic(size, args.tensors)}
    if not args.no_llama:
        shapes["llama+adam"] = llama_state(args.llama_hidden, args.llama_layers, args.llama_inter, args.llama_vocab)
    results, loops, restore, replica_blocked = {}, [], None, None

    from tests.helpers.s3server import S3Server
    tmp = tempfile.mkdtemp(prefix="bench_tiers_", dir=args.dir)
    try:
        with S3Server() as server:
            bucket = server.create_bucket()
            for name, sd in ({} if args.no_save_drain else shapes).items():
                results[name] = run_save_drain(server, bucket, tmp, name, sd, args.repeat)
                print(f"[{time.perf_counter() - t_start:6.1f} s] {name} done", flush=True)
            if not args.no_loop:
                keys = list(shapes["synthetic"])
                half = {k: shapes["synthetic"][k] for k in keys[:max(1, len(keys) // 2)]}  # the drain ~ 8 s
                for threads in sorted({torch.get_num_threads(), 1}, reverse=True):
                    loops.append(run_loop(server, bucket, tmp, half, args.repeat, threads))
                    print(f"[{time.perf_counter() - t_start:6.1f} s] loop ({threads} threads) done", flush=True)
            if not args.no_restore:
                restore = run_restore(server, bucket, tmp, parse_size(args.restore_size), args.tensors,
                                      args.restore_repeat)
                print(f"[{time.perf_counter() - t_start:6.1f} s] restore done", flush=True)
            if not args.no_replicas:
                replica_blocked = run_replica_blocked(server, bucket, tmp, parse_size(args.restore_size),
                                                      args.tensors, args.restore_repeat)
                print(f"[{time.perf_counter() - t_start:6.1f} s] replicas done", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\nTiered checkpoints, SeaweedFS on 127.0.0.1, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at the end; object parts {part >> 20} MiB x {in_flight} in flight; "
          f"{args.repeat} interleaved rounds; {time.perf_counter() - t_start:.0f} s in all")
    for name, res in results.items():
        sd = shapes[name]
        t = res["times"]
        print(f"\n== {name}: {format_bytes(local_bytes(sd))} in {count_tensors(sd)} tensors, one process "
              f"(data files {format_bytes(res['file_bytes'])})")
        print(f"{'':32} {'median s':>8} {'best s':>8} {'worst s':>8}")
        for k, v in t.items():
            print(f"{k:32} {fmt(v)}")
        loc, tb, tn, d = (med(t["local-only save"]), med(t["tiered save (blocking)"]),
                          med(t["tiered save (blocking=False)"]), med(t["direct S3 save"]))
        print(f"blocked: tiered/local-only = {tb / loc:.2f}x (blocking), {tn / loc:.2f}x (blocking=False; "
              f"goal <= 1.1x); direct S3/tiered = {d / tb:.1f}x (blocking), {d / tn:.1f}x (blocking=False; goal >= 5x)")
        nb = res["file_bytes"]
        raw = med(t["raw s3fs put"])
        for k in ("drain (blocking save)", "drain (async save)"):
            dr = med(t[k])
            print(f"{k}: {nb / MiB / dr:.1f} MiB/s vs raw s3fs put {nb / MiB / raw:.1f} MiB/s = {raw / dr:.2f}x "
                  f"(goal >= 0.9x)")
        for k, v in res["cpu"].items():
            c, srv = med([x[0] for x in v]), med([x[1] for x in v])
            print(f"CPU per GiB, {k}: this process {c / nb * (1 << 30):.2f} s, the server {srv / nb * (1 << 30):.2f} s")
    for loop in loops:
        print(f"\n== training loop: 2-layer MLP 512-2048-512, batch {loop['batch']} "
              f"(calibrated {loop['calibrated'] * 1e3:.1f} ms/step), {loop['threads']} torch threads; "
              f"background: drain of the first half of the synthetic state ({format_bytes(loop['bytes'])})")
        print(f"{'':32} {'steps':>6} {'median ms':>9} {'p90 ms':>7}   window medians ms")
        base = med(loop["steps"]["no drain"])
        for k, xs in loop["steps"].items():
            p90 = sorted(xs)[int(0.9 * (len(xs) - 1))]
            print(f"{k:32} {len(xs):6d} {med(xs) * 1e3:9.1f} {p90 * 1e3:7.1f}   "
                  + " ".join(f"{m * 1e3:.1f}" for m in loop["meds"][k]) + f"   ({med(xs) / base:.2f}x)")
        print(f"median step with a drain to S3 in flight / without = "
              f"{med(loop['steps']['drain to S3 in flight']) / base:.2f}x (goal <= 1.1x)")
    if restore:
        print(f"\n== restore, 2 gloo ranks, DTensors sharded on dim 0, {format_bytes(parse_size(args.restore_size))} "
              f"in {args.tensors} tensors; node0/node1 private local dirs; barrier-to-barrier")
        for k, v in restore["times"].items():
            print(f"{k:32} {fmt(v)}")
        for r, split in enumerate(restore["split"]):
            print(f"rank {r}: " + "; ".join(f"{k}: {v['by_tier']}, from peers {v['from_peers']}" for k, v in split.items()))
        t = restore["times"]
        loc, peers, remote = (med(t["tiered load, intact (local)"]), med(t["tiered load, node1 lost (peers)"]),
                              med(t["tiered load, node1 lost, no replica (remote)"]))
        print(f"node1 lost: from peers {peers:.3f} s, from the remote tier {remote:.3f} s "
              f"(peers {remote / peers:.2f}x faster; goal: peers beat remote); intact, local {loc:.3f} s "
              f"(peers / local = {peers / loc:.2f}x)")
    if replica_blocked:
        print(f"\n== blocked time of a tiered save, 2 gloo ranks on 2 nodes, {format_bytes(parse_size(args.restore_size))} "
              f"in {args.tensors} DTensors; each save then waited until durable")
        for k, v in replica_blocked.items():
            print(f"{k:32} {fmt(v)}")
        r0, r1 = med(replica_blocked["tiered save, replicas=0"]), med(replica_blocked["tiered save, replicas=1"])
        print(f"replicas=1 / replicas=0 = {r1 / r0:.2f}x (goal <= 1.1x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
