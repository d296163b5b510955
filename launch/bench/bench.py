"""Save / load benchmark against the peers: one run, one directory, one table.

    .venv/bin/python launch/bench/bench.py DIR [--size 1G] [--small 2000] [--ranks 1,2] [--repeat 3]

For each world size (spawned gloo ranks on this machine, every rank writing into DIR), repeated
``--repeat`` times with the methods interleaved inside each repetition (so drift of a shared
virtual disk hits all of them alike), the median reported:

  * fio O_DIRECT write limit: io_uring, 4 MiB blocks, iodepth 8, end_fsync, one job per rank,
    each job writing its rank's share (the physical limit: no copies, no checksums);
  * distckpt.save; torch.save + fsync (each rank its own shards); torch.distributed.checkpoint.save
    (defaults);
  * cold-cache loads (``sync; echo 3 > /proc/sys/vm/drop_caches`` before each): fio O_DIRECT read of
    the files fio wrote, distckpt.load, torch.distributed.checkpoint.load.

Then, on one rank: the peak RSS a sync save adds (fresh process; VmHWM reset through
/proc/self/clear_refs after the state is built), the time an async save blocks the caller against
one plain in-memory copy (``clone()`` of every tensor), 20000 tensors of 4 KiB (distckpt vs DCP), and
bytes read by a resharding load of the 2-rank checkpoint onto 1 (and 3) ranks.

The state: ``--small`` tensors of 4096 float32 (16 KiB) plus 8 large float32 tensors making up the
rest of ``--size``. With N ranks the large tensors are DTensors sharded on dim 0 (each rank holds
1/N) and the small ones are replicated (distckpt and DCP write each once).

Everything the benchmark creates under DIR is removed at the end (also on failure).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Appended, not inserted first: a --baseline-repo child (BaselineChild) has put the other checkout
# on sys.path before importing this module, and that checkout must stay the one imported. (It was
# inserted first until 2026-11-29, so every --baseline-repo child ran this checkout's code.)
if REPO not in sys.path:
    sys.path.append(REPO)

from distckpt.sizes import parse_size  # noqa: E402  (binary units: 1G = 1 GiB, as everywhere)

ROW_ELEMS = 4096  # columns of the large tensors (float32: 16 KiB per row)
N_BIG = 8


# -------------------------------------------------------------------------------------------------
# State


def big_rows(size: int, small: int, big: int = N_BIG) -> int:
    rest = max(size - small * ROW_ELEMS * 4, big * 12 * ROW_ELEMS * 4)
    rows = rest // (big * ROW_ELEMS * 4)
    return max(12, rows - rows % 12)  # divisible by 2, 3 and 4: even shards for 2-, 3- and 4-rank layouts


def make_state(size: int, small: int, rank: int, world: int, mesh=None, zeros: bool = False,
               big: int = N_BIG) -> dict:
    """``big`` float32 tensors of ROW_ELEMS columns (``size`` bytes with the small ones; sharded by
    rows over ``world`` as DTensors on ``mesh``) plus ``small`` replicated ones of one row."""
    import torch
    rows = big_rows(size, small, big)
    sd = {}
    g = torch.Generator().manual_seed(1234 + rank)
    for i in range(big):
        chunk = -(-rows // world)  # torch.chunk's split, as a DTensor's Shard(0) places it
        local_rows = max(0, min(chunk, rows - rank * chunk))
        local = torch.zeros(local_rows, ROW_ELEMS) if zeros else torch.rand(local_rows, ROW_ELEMS, generator=g)
        if mesh is not None:
            from torch.distributed.tensor import DTensor, Shard
            local = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                       shape=(rows, ROW_ELEMS), stride=(ROW_ELEMS, 1))
        sd[f"big.{i}"] = local
    gs = torch.Generator().manual_seed(99)  # the same small tensors on every rank: replicas
    for i in range(small):
        sd[f"small.{i}"] = torch.zeros(ROW_ELEMS) if zeros else torch.rand(ROW_ELEMS, generator=gs)
    return sd


def state_bytes(size: int, small: int, big: int = N_BIG) -> int:
    return big * big_rows(size, small, big) * ROW_ELEMS * 4 + small * ROW_ELEMS * 4


def llama_fsdp_state(world: int, args: dict, mesh_shape: tuple[int, ...] | None = None) -> dict:
    """The outside client's shape: an HF Llama built from a config (random init, seed 0), every
    decoder layer and the model ``fully_shard``ed over ``world`` CPU ranks, one AdamW step taken;
    returns ``{"model": ..., "optimizer": ...}`` from ``get_state_dict`` (DTensors). ``args``:
    hidden, layers, inter, vocab. ``mesh_shape`` (replicas, shards): HSDP, ``fully_shard`` on a
    2-D mesh (each shard held by ``replicas`` ranks)."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    heads = max(1, args["hidden"] // 64)
    cfg = LlamaConfig(hidden_size=args["hidden"], num_hidden_layers=args["layers"],
                      intermediate_size=args["inter"], vocab_size=args["vocab"], num_attention_heads=heads,
                      num_key_value_heads=heads, max_position_embeddings=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    mesh = (init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")) if mesh_shape
            else init_device_mesh("cpu", (world,)))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, args["vocab"], (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optimizer": osd}


def local_bytes(obj) -> int:
    """Bytes of the local shards of every tensor in a nested state."""
    import torch
    if isinstance(obj, torch.Tensor):
        t = obj.to_local() if hasattr(obj, "to_local") else obj
        return t.numel() * t.element_size()
    if isinstance(obj, dict):
        return sum(local_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(local_bytes(v) for v in obj)
    return 0


def zeros_like_state(obj):
    """A nested state of zero tensors shaped (and placed, for DTensors) like ``obj``."""
    import torch
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "to_local"):
            from torch.distributed.tensor import DTensor
            return DTensor.from_local(torch.zeros_like(obj.to_local()), obj.device_mesh, obj.placements,
                                      run_check=False, shape=obj.shape, stride=obj.stride())
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return {k: zeros_like_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [zeros_like_state(v) for v in obj]
    return obj


# -------------------------------------------------------------------------------------------------
# Helpers


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


class BaselineChild:
    """A benchmark script run again in a child process with another checkout first on sys.path
    (``env_var`` names that checkout to the child), driven line by line: the child prints "ready",
    then answers each ``call(verb)`` with one JSON line; closing its stdin ends it."""

    def __init__(self, script: str, env_var: str, repo: str, argv: list[str]) -> None:
        repo = os.path.realpath(repo)
        env = dict(os.environ, **{env_var: repo})
        self.p = subprocess.Popen([sys.executable, os.path.abspath(script), *argv], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.p.stdout.readline().split(maxsplit=1)
        # A baseline that is this checkout after all would compare the code with itself.
        where = line[1].strip() if len(line) > 1 else "?"
        if not line or line[0] != "ready" or not where.startswith(repo + os.sep):
            self.p.kill()
            self.p.wait(timeout=60)
            if not line or line[0] != "ready":
                raise RuntimeError("the --baseline-repo child did not start")
            raise RuntimeError(f"the --baseline-repo child imported distckpt from {where}, not from {repo}")

    def call(self, verb: str) -> dict:
        self.p.stdin.write(verb + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=60)


def ready() -> None:
    """What a --baseline-repo child prints once set up: "ready" and the distckpt it imported."""
    import distckpt
    print("ready", os.path.realpath(distckpt.__file__), flush=True)


def dir_bytes(path: str) -> int:
    """Bytes of every file under ``path``."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def rm(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def fio(directory: str, rw: str, world: int, per_job: int, tag: str) -> float:
    """fio's aggregate bandwidth (bytes/s) with ``world`` jobs, each on its own file of ``per_job`` bytes."""
    cmd = ["fio", f"--name=bench{tag}", f"--directory={directory}", f"--rw={rw}", "--direct=1",
           "--ioengine=io_uring", "--bs=4M", "--iodepth=8", f"--size={per_job}", f"--numjobs={world}",
           "--group_reporting", "--output-format=json"]
    if rw == "write":
        cmd.append("--end_fsync=1")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return job["write" if rw == "write" else "read"]["bw_bytes"]


def fio_write_seconds(directory: str, nbytes: int, tag: str) -> float:
    """fio's O_DIRECT io_uring write of ``nbytes`` into one new file under ``directory`` (4 MiB
    blocks, iodepth 8, end_fsync), after an ``os.sync``: seconds of fio's own runtime, from its
    first write to the end of its fsync (its file layout excluded). Removes its file."""
    os.sync()
    cmd = ["fio", f"--name=bench{tag}", f"--directory={directory}", "--rw=write", "--direct=1",
           "--ioengine=io_uring", "--bs=4M", "--iodepth=8", f"--size={nbytes}", "--end_fsync=1",
           "--output-format=json"]
    try:
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    finally:
        for path in fio_files(directory, tag):
            os.unlink(path)
    return json.loads(out[out.index("{"):])["jobs"][0]["write"]["runtime"] / 1000.0


def fio_files(directory: str, tag: str) -> list[str]:
    return [os.path.join(directory, f) for f in os.listdir(directory) if f.startswith(f"bench{tag}.")]


FIO_CMD = ("fio --name=bench --directory=DIR --rw={write,read} --direct=1 --ioengine=io_uring --bs=4M "
           "--iodepth=8 --size=SIZE/N --numjobs=N --group_reporting (--end_fsync=1 for write; "
           "drop_caches before read)")


# -------------------------------------------------------------------------------------------------
# The per-rank suite (spawned)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, port, args, queue):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    try:
        if world > 1:
            import torch.distributed as dist
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=1800))
        out = fn(rank, world, *args)
        if world > 1:
            import torch.distributed as dist
            dist.destroy_process_group()
        queue.put((rank, "ok", out))
    except BaseException as exc:  # noqa: BLE001
        import traceback
        queue.put((rank, "err", traceback.format_exc()))
        raise


def spawn(fn, world: int, *args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    while len(results) + len(errors) < world:
        try:
            rank, status, out = queue.get(timeout=5)
        except Exception:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a rank died: exit codes {[p.exitcode for p in procs]}; {errors}")
            continue
        (results if status == "ok" else errors)[rank] = out
    for p in procs:
        p.join()
    if errors:
        raise RuntimeError("\n".join(errors.values()))
    return [results[r] for r in range(world)]


def _barrier(world):
    if world > 1:
        import torch.distributed as dist
        dist.barrier()


def _timed(world, fn) -> float:
    _barrier(world)
    t0 = time.perf_counter()
    fn()
    _barrier(world)
    return time.perf_counter() - t0


def _suite(rank: int, world: int, work: str, size: int, small: int, repeat: int, keep_reshard: bool) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp

    import distckpt
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (world,))
    sd = make_state(size, small, rank, world, mesh)
    dst = make_state(size, small, rank, world, mesh, zeros=True)
    total = state_bytes(size, small)
    times: dict[str, list[float]] = {}
    notes = {}

    def rec(name, seconds):
        times.setdefault(name, []).append(seconds)

    def local_share() -> dict:
        out = {}
        for k, v in sd.items():
            if k.startswith("big."):
                out[k] = v.to_local() if mesh is not None else v
            elif int(k.split(".")[1]) % world == rank:
                out[k] = v
        return out

    # Warm-up: imports, backend probe, DCP's first-call setup; not timed.
    warm = os.path.join(work, f"warm{world}")
    distckpt.save({"x": torch.ones(1 << 20)}, warm, overwrite=True)
    dcp.save({"x": torch.ones(1 << 20)}, checkpoint_id=warm + "-dcp")
    _barrier(world)
    if rank == 0:
        rm(warm)
        rm(warm + "-dcp")
    cold = True
    for rep in range(repeat):
        # fio: write, then cold read of the same files
        if rank == 0:
            tag = f"{world}x{rep}"
            rec("fio_write", total / fio(work, "write", world, total // world, tag))
            cold &= drop_caches()
            rec("fio_read", total / fio(work, "read", world, total // world, tag))
            for f in fio_files(work, tag):
                rm(f)
        _barrier(world)

        path = os.path.join(work, f"dc{world}-{rep}")
        res = {}
        rec("dc_save", _timed(world, lambda: res.setdefault("r", distckpt.save(sd, path))))
        if rank == 0:
            cold &= drop_caches()
        rec("dc_load", _timed(world, lambda: distckpt.load(dst, path)))
        if rep == 0:
            for k in ("big.0", "small.5"):
                a, b = sd[k], dst[k]
                if mesh is not None and k.startswith("big."):
                    a, b = a.to_local(), b.to_local()
                assert torch.equal(a, b), k
            notes["backend"] = res["r"].backend
        _barrier(world)
        if rank == 0 and not (keep_reshard and rep == repeat - 1):
            rm(path)
        elif rank == 0:
            notes["reshard_src"] = path

        tpath = os.path.join(work, f"ts{world}-{rep}-rank{rank}.pt")
        share = local_share()

        def tsave():
            with open(tpath, "wb") as f:
                torch.save(share, f)
                f.flush()
                os.fsync(f.fileno())
        rec("torch_save", _timed(world, tsave))
        rm(tpath)

        dpath = os.path.join(work, f"dcp{world}-{rep}")
        rec("dcp_save", _timed(world, lambda: dcp.save(sd, checkpoint_id=dpath)))
        if rank == 0:
            cold &= drop_caches()
        rec("dcp_load", _timed(world, lambda: dcp.load(dst, checkpoint_id=dpath)))
        _barrier(world)
        if rank == 0:
            rm(dpath)
    notes["cold"] = cold

    if world == 1:
        # Async save: blocked time vs one plain in-memory copy of the state.
        for rep in range(repeat):
            t0 = time.perf_counter()
            copy = {k: v.clone() for k, v in sd.items()}
            rec("clone", time.perf_counter() - t0)
            del copy
        for rep in range(repeat + 1):
            apath = os.path.join(work, f"async-{rep}")
            t0 = time.perf_counter()
            h = distckpt.async_save(sd, apath)
            blocked = time.perf_counter() - t0
            for v in sd.values():  # training goes on: change the state in place at once
                v.add_(1.0)
            h.result()
            rec("async_total", time.perf_counter() - t0)
            rec("async_first" if rep == 0 else "async_blocked", blocked)
            rm(apath)
        from distckpt.staging.pool import staging_pool
        notes["pool_allocations"] = staging_pool().allocations
        staging_pool().clear()

        # 20000 tensors of 4 KiB
        many = {f"p.{i}": torch.rand(1024) for i in range(20000)}
        for rep in range(repeat):
            p1, p2 = os.path.join(work, f"many-dc-{rep}"), os.path.join(work, f"many-dcp-{rep}")
            rec("many_dc", _timed(1, lambda: distckpt.save(many, p1)))
            rec("many_dcp", _timed(1, lambda: dcp.save(many, checkpoint_id=p2)))
            notes["many_dc_files"] = sorted(os.listdir(p1))
            notes["many_dcp_files"] = sorted(os.listdir(p2))
            rm(p1)
            rm(p2)
    return {"times": times, "notes": notes}


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def _reshard(rank: int, world: int, src: str, size: int, small: int) -> dict:
    """Load the 2-rank checkpoint onto ``world`` ranks (large tensors sharded on dim 0 among them)."""
    import torch

    import distckpt
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (world,))
    dst = make_state(size, small, rank, world, mesh, zeros=True)
    needed = 0
    for k, v in dst.items():
        t = v.to_local() if mesh is not None and k.startswith("big.") else v
        needed += t.numel() * t.element_size()
    drop_caches() if rank == 0 else None
    _barrier(world)
    res = distckpt.load(dst, src)
    return {"read": res.bytes_read, "needed": needed}


def _rss_child(work: str, size: int, small: int) -> None:
    """Fresh process: peak RSS a sync save adds on top of the state."""
    import torch

    import distckpt
    distckpt.save({"x": torch.ones(1 << 20)}, os.path.join(work, "rss-warm"))
    sd = make_state(size, small, 0, 1)

    def status(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise KeyError(key)

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5\n")  # reset VmHWM to the current RSS
    before = status("VmRSS")
    distckpt.save(sd, os.path.join(work, "rss"))
    print(json.dumps({"before": before, "peak": status("VmHWM"), "state": state_bytes(size, small)}))


# -------------------------------------------------------------------------------------------------
# Table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("directory")
    ap.add_argument("--size", default="1G")
    ap.add_argument("--small", type=int, default=2000)
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the raw numbers here")
    ap.add_argument("--_rss", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    size = parse_size(args.size)
    if args._rss:
        _rss_child(args.directory, size, args.small)
        return 0
    if shutil.which("fio") is None:
        print("fio is not installed: apt-get install -y fio", file=sys.stderr)
        return 2
    worlds = [int(w) for w in args.ranks.split(",")]
    work = os.path.join(os.path.abspath(args.directory), f".distckpt-bench-{os.getpid()}")
    os.makedirs(work)
    total = state_bytes(size, args.small)
    out: dict = {"worlds": {}, "total": total}
    t_start = time.time()
    try:
        for w in worlds:
            r = spawn(_suite, w, work, size, args.small, args.repeat, w == 2)
            out["worlds"][w] = r[0]
        src = out["worlds"].get(2, {}).get("notes", {}).get("reshard_src")
        if src:
            out["reshard"] = {}
            for w in (1, 3):
                rr = spawn(_reshard, w, src, size, args.small)
                out["reshard"][w] = {"read": sum(x["read"] for x in rr), "needed": sum(x["needed"] for x in rr)}
        rss_dir = os.path.join(work, "rss")
        os.makedirs(rss_dir)
        p = subprocess.run([sys.executable, os.path.abspath(__file__), rss_dir, "--size", args.size,
                            "--small", str(args.small), "--_rss"], check=True, capture_output=True, text=True)
        out["rss"] = json.loads(p.stdout.strip().splitlines()[-1])
    finally:
        rm(work)
    out["seconds"] = time.time() - t_start
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print_table(out, args, worlds)
    return 0


def print_table(out: dict, args, worlds) -> None:
    total = out["total"]
    mb = lambda s: total / s / 1e6  # noqa: E731
    med = statistics.median

    def t(w, name):
        return med(out["worlds"][w]["times"][name])

    print(f"distckpt save/load vs peers: state {total / (1 << 30):.2f} GiB ({N_BIG} large float32 tensors + "
          f"{args.small} x 16 KiB), dir {os.path.abspath(args.directory)}, median of {args.repeat}, "
          f"backend {out['worlds'][worlds[0]]['notes'].get('backend')}")
    cols = [f"{w} rank{'s' if w > 1 else ''}" for w in worlds]
    print("| measurement | " + " | ".join(cols) + " | target |")
    print("|---|" + "---:|" * len(worlds) + "---|")

    def row(label, cells, target=""):
        print(f"| {label} | " + " | ".join(cells) + f" | {target} |")

    row("fio O_DIRECT write (limit)", [f"{mb(t(w, 'fio_write')):.0f} MB/s" for w in worlds])
    row("distckpt.save", [f"{mb(t(w, 'dc_save')):.0f} MB/s = {t(w, 'fio_write') / t(w, 'dc_save'):.2f}x fio"
                          for w in worlds], ">= 0.9x fio")
    row("torch.save + fsync", [f"{mb(t(w, 'torch_save')):.0f} MB/s = {t(w, 'fio_write') / t(w, 'torch_save'):.2f}x fio"
                               for w in worlds])
    row("DCP save (defaults)", [f"{mb(t(w, 'dcp_save')):.0f} MB/s = {t(w, 'fio_write') / t(w, 'dcp_save'):.2f}x fio"
                                for w in worlds])
    cold = all(out["worlds"][w]["notes"].get("cold") for w in worlds)
    tag = "cold" if cold else "WARM (drop_caches failed)"
    row(f"fio O_DIRECT read, {tag} (limit)", [f"{mb(t(w, 'fio_read')):.0f} MB/s" for w in worlds])
    row(f"distckpt.load, {tag}",
        [f"{mb(t(w, 'dc_load')):.0f} MB/s = {t(w, 'fio_read') / t(w, 'dc_load'):.2f}x fio, "
         f"{t(w, 'dcp_load') / t(w, 'dc_load'):.2f}x DCP" for w in worlds], ">= 0.9x fio, >= 2x DCP")
    row(f"DCP load, {tag}", [f"{mb(t(w, 'dcp_load')):.0f} MB/s" for w in worlds])
    rss = out["rss"]
    added = rss["peak"] - rss["before"]
    first = 1 if 1 in worlds else None
    row("peak RSS added by a sync save", [f"{added / (1 << 20):.1f} MiB" if w == 1 else "" for w in worlds],
        "<= 64 MiB")
    if first:
        clone, blocked = t(1, "clone"), t(1, "async_blocked")
        row("async save: caller blocked (steady state)",
            [f"{blocked:.3f} s = {blocked / clone:.2f}x one clone() ({clone:.3f} s); sync save {t(1, 'dc_save'):.2f} s"
             if w == 1 else "" for w in worlds], "<= 1.25x copy, << sync")
        row("async save: first call (allocates + faults staging)",
            [f"{t(1, 'async_first'):.3f} s; whole async save {t(1, 'async_total'):.2f} s" if w == 1 else ""
             for w in worlds])
        notes = out["worlds"][1]["notes"]
        row("20000 x 4 KiB save: distckpt vs DCP",
            [f"{t(1, 'many_dc'):.2f} s vs {t(1, 'many_dcp'):.2f} s = {t(1, 'many_dcp') / t(1, 'many_dc'):.1f}x; "
             f"files {notes['many_dc_files']} vs {notes['many_dcp_files']}" if w == 1 else "" for w in worlds],
            ">= 2x, one data file per rank")
    for w, r in sorted(out.get("reshard", {}).items()):
        row(f"resharding load 2 -> {w} rank{'s' if w > 1 else ''}: bytes read / needed",
            [f"{r['read'] / (1 << 20):.1f} / {r['needed'] / (1 << 20):.1f} MiB = {r['read'] / r['needed']:.3f}x"
             if i == 0 else "" for i, _ in enumerate(worlds)], "<= 1.1x")
    print(f"fio: {FIO_CMD}")
    print(f"whole run: {out['seconds']:.0f} s")


if __name__ == "__main__":
    raise SystemExit(main())
