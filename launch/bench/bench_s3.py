"""Save/load speed on S3, side by side in one run against one local server (SeaweedFS).

    python launch/bench/bench_s3.py [--size 256M] [--tensors 8] [--repeat 3] [--no-reshard]

Started from the repository root (it starts the test suite's server, tests/helpers/s3server.py, on
127.0.0.1 with free ports and stops it at the end). Measured on the same bytes, one process each,
rounds interleaved (A B C D, A B C D, ...) so a machine loaded by other work slows every contender
alike; the best round of each is reported, with the ratios:

  raw s3fs        the limit: one object of the same bytes, s3fs ``pipe`` (multipart, the same part
                  size and parts in flight as distckpt) and ``cat`` (one GET stream)
  distckpt        distckpt.save / distckpt.load to ``s3://bucket/...`` (storage_options)
  DCP             torch.distributed.checkpoint.save / load with FsspecWriter / FsspecReader
                  (their defaults: one file per rank, one thread)
  obstore         the Rust client (obstore.put / obstore.get, same part size and concurrency), if
                  installed (``pip install obstore``): is it faster than s3fs here?

Resharded load (unless --no-reshard): 2 gloo ranks save DTensors sharded on dim 0, 3 ranks load
them with other boundaries; the bytes each rank GETs from the server (counted by a botocore
hook on every GetObject response) against the bytes its shards need.

Replicated load (unless --no-replicated): 2 gloo ranks save plain tensors (each written once),
4 ranks each load all of it (DDP), with DISTCKPT_READ_ONCE off (every rank GETs every byte) and on
(distckpt.readonce: each byte GET once in the job, sent to the others over gloo), and DCP's
FsspecReader, interleaved: GET bytes and requests of all ranks against the checkpoint's size, and
the slowest rank's time, median of --repeat.

Goals: distckpt >= 0.9x raw s3fs and >= 2x DCP for save and load; resharded load reads
<= 1.1x the bytes it needs; a replicated load GETs <= 1.05x the checkpoint's bytes.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

MiB = 1 << 20


def _state_dict(total: int, n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    per = total // n // 4
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(n)}


def _nbytes(sd) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def _raw_bytes(sd) -> bytes:
    return b"".join(t.numpy().tobytes() for t in sd.values())


def _timed(fn) -> float:
    gc.collect()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _part_size() -> tuple[int, int]:
    from distckpt.storage.object.settings import settings
    cfg = settings()
    return cfg["part_size"], cfg["in_flight"]


def _obstore(server, bucket):
    try:
        import obstore
        from obstore.store import S3Store
    except ImportError:
        return None
    store = S3Store(bucket, endpoint=server.endpoint, access_key_id=server.key, secret_access_key=server.secret,
                    region="us-east-1", client_options={"allow_http": True})
    return obstore, store


def run_speed(server, bucket: str, size: int, n: int, repeat: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    import distckpt

    opts = server.storage_options()
    fs = server.filesystem()
    sd = _state_dict(size, n)
    nbytes = _nbytes(sd)
    blob = _raw_bytes(sd)
    part, in_flight = _part_size()
    ob = _obstore(server, bucket)
    times: dict[str, list[float]] = {}

    def rec(name, seconds):
        times.setdefault(name, []).append(seconds)

    for r in range(repeat):
        base = f"{bucket}/r{r}"
        rec("save raw s3fs", _timed(lambda: fs.pipe_file(f"{base}/raw.bin", blob, chunksize=part,
                                                          max_concurrency=in_flight)))
        rec("save distckpt", _timed(lambda: distckpt.save(sd, f"s3://{base}/distckpt", storage_options=opts)))
        rec("save DCP", _timed(lambda: dcp.save(sd, storage_writer=FsspecWriter(f"s3://{base}/dcp", **opts))))
        if ob:
            rec("save raw obstore", _timed(lambda: ob[0].put(ob[1], f"r{r}/obstore.bin", memoryview(blob),
                                                             chunk_size=part, max_concurrency=in_flight)))
    for r in range(repeat):
        base = f"{bucket}/r{r}"
        got = {}
        rec("load raw s3fs", _timed(lambda: got.update(s3fs=fs.cat_file(f"{base}/raw.bin"))))
        assert got.pop("s3fs") == blob, "raw s3fs read other bytes"
        out = {k: torch.empty_like(v) for k, v in sd.items()}
        rec("load distckpt", _timed(lambda: distckpt.load(out, f"s3://{base}/distckpt", storage_options=opts)))
        assert all(torch.equal(out[k], sd[k]) for k in sd), "distckpt load is not bit-exact"
        out = {k: torch.empty_like(v) for k, v in sd.items()}
        rec("load DCP", _timed(lambda: dcp.load(out, storage_reader=FsspecReader(f"s3://{base}/dcp", **opts))))
        assert all(torch.equal(out[k], sd[k]) for k in sd), "DCP load is not bit-exact"
        if ob:
            rec("load raw obstore", _timed(lambda: got.update(ob=ob[0].get(ob[1], f"r{r}/obstore.bin").bytes())))
            assert bytes(got.pop("ob")) == blob, "raw obstore read other bytes"
        fs.rm(f"{base}", recursive=True)
    return {"bytes": nbytes, "times": times, "part": part, "in_flight": in_flight, "obstore": bool(ob)}


# ------------------------------------------------------------------------------------------------ resharding


def _count_get_bytes():
    """Install a botocore hook counting the body bytes of every GetObject response of this process."""
    import botocore.handlers
    counter = {"bytes": 0, "requests": 0}

    def after(http_response=None, parsed=None, **_):
        if parsed is not None:
            counter["bytes"] += int(parsed.get("ContentLength") or 0)
            counter["requests"] += 1
    botocore.handlers.BUILTIN_HANDLERS.append(("after-call.s3.GetObject", after))
    return counter


def _dtensors(full: dict, world: int, zero: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    return {k: distribute_tensor(torch.zeros_like(v) if zero else v, mesh, [Shard(0)]) for k, v in full.items()}


def _reshard_full(size: int) -> dict:
    g = torch.Generator().manual_seed(1)
    return {"a": torch.randn(size // 8 // 64, 64, generator=g), "b": torch.randn(size // 8 // 64 + 3, 64, generator=g)}


def _reshard_save(rank, world, url, opts, size):
    import distckpt
    distckpt.save(_dtensors(_reshard_full(size), world, False), url, storage_options=opts)


def _reshard_load(rank, world, url, opts, size):
    counter = _count_get_bytes()  # before any client of this process exists
    import distckpt
    full = _reshard_full(size)
    sd = _dtensors(full, world, True)
    counter["bytes"] = counter["requests"] = 0
    distckpt.load(sd, url, storage_options=opts)
    needed = 0
    for k, v in sd.items():
        local = v.to_local()
        needed += local.numel() * local.element_size()
        assert torch.equal(v.full_tensor(), full[k]), k
    return counter["bytes"], needed, counter["requests"]


def run_reshard(server, bucket: str, size: int) -> dict:
    from tests.helpers.distributed import run_ranks
    url = f"s3://{bucket}/reshard"
    opts = server.storage_options()
    run_ranks(_reshard_save, 2, url, opts, size, timeout=600)
    got = run_ranks(_reshard_load, 3, url, opts, size, timeout=600)
    return {"per_rank": got, "read": sum(g[0] for g in got), "needed": sum(g[1] for g in got)}


# ------------------------------------------------------------------------------------------------ replicated


def _replicated_save(rank, world, url, dcp_url, opts, size):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    import distckpt
    sd = _reshard_full(size)
    distckpt.save(sd, url, storage_options=opts)
    dcp.save(sd, storage_writer=FsspecWriter(dcp_url, **opts))


def _replicated_load(rank, world, url, dcp_url, opts, size, repeat):
    counter = _count_get_bytes()  # before any client of this process exists
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    import distckpt
    from distckpt.bench import _env
    torch.set_num_threads(1)
    full = _reshard_full(size)
    out = {k: torch.zeros_like(v) for k, v in full.items()}
    distckpt.load(out, url, storage_options=opts)   # warm-up: imports, clients
    rows: dict[str, list] = {}
    contenders = ["distckpt, read-once off", "distckpt, read-once on", "DCP"]
    for i in range(repeat):
        for name in (contenders if i % 2 == 0 else contenders[::-1]):
            for v in out.values():
                v.zero_()
            dist.barrier()
            counter["bytes"] = counter["requests"] = 0
            t0 = time.perf_counter()
            if name == "DCP":
                dcp.load(out, storage_reader=FsspecReader(dcp_url, **opts))
            else:
                with _env(read_once="on" if name.endswith("on") else "off"):
                    distckpt.load(out, url, storage_options=opts)
            dt = time.perf_counter() - t0
            assert all(torch.equal(out[k], full[k]) for k in full), f"{name}: rank {rank} loaded other bytes"
            rows.setdefault(name, []).append((dt, counter["bytes"], counter["requests"]))
    return rows


def run_replicated(server, bucket: str, size: int, repeat: int) -> dict:
    from tests.helpers.distributed import run_ranks
    url, dcp_url = f"s3://{bucket}/replicated", f"s3://{bucket}/replicated-dcp"
    opts = server.storage_options()
    run_ranks(_replicated_save, 2, url, dcp_url, opts, size, timeout=600)
    fs = server.filesystem()
    sizes = {"distckpt": fs.du(f"{bucket}/replicated", total=True),
             "DCP": fs.du(f"{bucket}/replicated-dcp", total=True)}
    got = run_ranks(_replicated_load, 4, url, dcp_url, opts, size, repeat, timeout=900)
    return {"per_rank": got, "sizes": sizes}


# ------------------------------------------------------------------------------------------------ report


def main(argv=None) -> int:
    from distckpt.sizes import format_bytes, parse_size
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="256M", help="bytes of the state dict (default 256M = 256 MiB)")
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--reshard-size", default="64M")
    p.add_argument("--no-reshard", action="store_true")
    p.add_argument("--replicated-size", default="64M")
    p.add_argument("--no-replicated", action="store_true")
    p.add_argument("--only-replicated", action="store_true", help="skip the one-process and resharded runs")
    args = p.parse_args(argv)
    size = parse_size(args.size)

    from tests.helpers.s3server import S3Server
    with S3Server() as server:
        bucket = server.create_bucket()
        res = None if args.only_replicated else run_speed(server, bucket, size, args.tensors, args.repeat)
        reshard = None if args.no_reshard or args.only_replicated else run_reshard(
            server, bucket, parse_size(args.reshard_size))
        replicated = None if args.no_replicated else run_replicated(
            server, bucket, parse_size(args.replicated_size), args.repeat)
    if replicated:
        print(f"\nreplicated load from S3: saved by 2 ranks, each of 4 ranks loads all of it; median of "
              f"{args.repeat} interleaved rounds, load average {os.getloadavg()[0]:.1f}")
        print("| loader | GET bytes, all ranks / checkpoint bytes | GET requests, all ranks | seconds, slowest rank |")
        print("|---|---:|---:|---:|")
        per = replicated["per_rank"]
        for name in per[0]:
            reps = len(per[0][name])
            secs = [max(r[name][i][0] for r in per) for i in range(reps)]
            got = [sum(r[name][i][1] for r in per) for i in range(reps)]
            reqs = [sum(r[name][i][2] for r in per) for i in range(reps)]
            ckpt = replicated["sizes"]["DCP" if name == "DCP" else "distckpt"]
            print(f"| {name} | {statistics.median(got) / ckpt:.2f}x ({format_bytes(statistics.median(got))} / "
                  f"{format_bytes(ckpt)}) | {statistics.median(reqs):.0f} | {statistics.median(secs):.3f} "
                  f"({min(secs):.2f}..{max(secs):.2f}) |")
    if res is None:
        return 0

    nbytes, times = res["bytes"], res["times"]
    print(f"\nS3 (SeaweedFS on 127.0.0.1), {format_bytes(nbytes)} in {args.tensors} tensors, one process, "
          f"best of {args.repeat} interleaved rounds; distckpt parts {res['part'] >> 20} MiB x {res['in_flight']} "
          f"in flight (raw s3fs and obstore the same)")
    print(f"{'':22} {'best s':>8} {'median s':>9} {'MiB/s':>8}")
    best = {}
    for name, ts in times.items():
        best[name] = min(ts)
        print(f"{name:22} {min(ts):8.3f} {statistics.median(ts):9.3f} {nbytes / MiB / min(ts):8.1f}")
    for op in ("save", "load"):
        d = best[f"{op} distckpt"]
        line = (f"{op}: distckpt / raw s3fs = {best[f'{op} raw s3fs'] / d:.2f}x the limit's speed, "
                f"distckpt / DCP = {best[f'{op} DCP'] / d:.2f}x")
        if f"{op} raw obstore" in best:
            line += f", raw obstore / raw s3fs = {best[f'{op} raw s3fs'] / best[f'{op} raw obstore']:.2f}x"
        print(line)
    if reshard:
        print(f"resharded load (2 ranks saved, 3 load): read {format_bytes(reshard['read'])} for "
              f"{format_bytes(reshard['needed'])} needed = {reshard['read'] / reshard['needed']:.3f}x; per rank "
              + ", ".join(f"{format_bytes(r)}/{format_bytes(n)} in {q} GETs" for r, n, q in reshard["per_rank"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
