"""Control-plane cost of a load at 1 to 4,096 ranks, simulated in one process, and a real gloo load.

The save side's control plane is launch/bench/bench_scale.py; this is the load side: what a rank
receives and decodes before it reads a byte of data, as format version 3 loaded (every index to
every rank) and as format version 4 loads (each rank the indexes its boxes need), side by side on
the same checkpoint. What runs is distckpt's own code:

* the save is planned as bench_scale plans it (every rank's PLAN message, rank 0's merge), every
  rank's data-file index is built as WRITE builds it (one ChunkRecord per chunk written,
  ``manifest.encode_index``), and the MANIFEST with ``commit._build_manifest`` (format 4);
* format 3's metadata step: rank 0 read the MANIFEST and every index and broadcast them, pickled
  as gloo's broadcast_object_list carries them (``v3 recv/rank``), and every rank decoded and
  validated all of it (``manifest.decode`` with every index); then it planned its reads
  (``fill.box_tasks``) for its own pieces at the same world size, as a restart does (``v3 s``:
  both, CPU seconds);
* format 4's (``Source.manifest`` with the boxes the rank wants): the MANIFEST from rank 0, then
  ``manifest.files_for`` those boxes, ``parse_index`` of those files' indexes only and
  ``with_chunks(partial=True)``, then the same planning (``v4 files``, ``v4 read/rank``: the
  MANIFEST plus those indexes, ``v4 s``).

Layouts as bench_scale's (``fsdp``, ``tp_fsdp``, ``torchrec``). Format 3's figures need every
index built (bench_scale builds a sample), so a configuration whose simulation is estimated (from
the per-record rate measured so far) to take longer than ``--budget`` seconds gets format 4's
figures only (the other indexes' references are copied: nothing reads them), marked "not run".

With ``--real N`` it also runs N real gloo ranks under torchrun: an FSDP-like state dict of
``--real-tensors`` row-sharded DTensors is saved once and loaded three times; each rank reports
the bytes it received in the load's metadata broadcasts (pickled, as gloo carries them), the
indexes it read from storage itself (format 4) and their bytes, its time in ``Source.manifest``
and its whole load time.

Usage: python launch/bench/bench_load_scale.py [--ranks 8,64,512,4096] [--tensors 200,5000]
                                         [--layouts fsdp,tp_fsdp,torchrec] [--budget 60] [--real 16]
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_scale import (ROOT, _cpu, _fmt_bytes, _pieces, _rss_kib, launch_real, plan_all, rank_index,  # noqa: E402
                         parse_args, real_finish, real_setup)


def run_one(layout: str, world: int, tensors: int, every_index: bool = True) -> dict:
    """One configuration, in this process: the figures as a dict (see the module docstring).
    ``every_index=False`` builds only the indexes the sampled rank reads under format 4 (the
    others' references are copied from one built index: nothing reads them), so the largest
    configurations fit; the format-3 figures are then None."""
    sys.path.insert(0, ROOT)
    from distckpt import commit
    from distckpt import manifest as mf
    from distckpt.checksum import crc32c
    from distckpt.fill import box_tasks
    from distckpt.plan import Box

    rss0 = _rss_kib()
    t_sim = time.monotonic()
    planned = plan_all(layout, world, tensors)
    plan = planned["plan"]
    rank = min(1, world - 1)
    wanted = [(fqn, Box(tuple(o), tuple(s))) for fqn, _shape, boxes in _pieces(layout, world, tensors, rank)
              for o, s in boxes]
    indexes, refs, records_n = {}, {}, 0

    def build(r: int) -> None:
        nonlocal records_n
        records, offset = rank_index(planned, r)
        records_n += len(records)
        index = mf.encode_index(records)
        indexes[r] = index
        refs[r] = ((offset, len(index), crc32c(index)), offset + len(index))

    if every_index:
        for r in range(world):
            build(r)
    else:
        build(rank)
        like = refs[rank]
        header = commit._build_manifest(plan, [commit.WriteOutcome(*refs.get(r, like), "uring", "simulated")
                                               for r in range(world)], "0" * 32, world, plan.checksum_block, None)
        for fqn, box in wanted:  # the files the sampled rank will read
            for i in mf.files_for(header, fqn, box):
                if i not in indexes:
                    build(i)
    like = refs[rank]
    outcomes = [commit.WriteOutcome(*refs.get(r, like), "uring", "simulated") for r in range(world)]
    data = mf.encode(commit._build_manifest(plan, outcomes, "0" * 32, world, plan.checksum_block, None))
    sim_s = time.monotonic() - t_sim
    out = {"layout": layout, "ranks": world, "tensors": tensors, "records": records_n if every_index else None,
           "manifest_bytes": len(data), "sim_s": sim_s}
    if every_index:
        # Format 3's load: rank 0 broadcasts the MANIFEST and every index; each rank decodes all.
        out["index_bytes"] = sum(len(i) for i in indexes.values())
        out["recv_v3"] = len(pickle.dumps((data, indexes, None), protocol=pickle.HIGHEST_PROTOCOL))
        m3, out["decode_v3_s"] = _cpu(lambda: mf.decode(data, path="MANIFEST",
                                                        read_index=lambda header, i: indexes[i]))
        requests = [(fqn, box.offsets, box.sizes, None) for fqn, box in wanted]
        _, out["plan_v3_s"] = _cpu(box_tasks, "ckpt", m3, requests)
        del m3
    else:
        out.update(index_bytes=None, recv_v3=None, decode_v3_s=None, plan_v3_s=None)

    # Format 4's: the MANIFEST from rank 0, then this rank's own reads of the indexes it needs.
    def v4():
        header = mf.decode_header(data, path="MANIFEST")
        files = set()
        for fqn, box in wanted:
            files.update(mf.files_for(header, fqn, box))
        records = {i: mf.parse_index(header, i, indexes[i]) for i in sorted(files)}
        return mf.with_chunks(header, records, "MANIFEST", partial=True), files

    (m4, files), out["decode_v4_s"] = _cpu(v4)
    out["files_v4"] = len(files)
    out["recv_v4"] = len(data) + sum(len(indexes[i]) for i in files)
    requests = [(fqn, box.offsets, box.sizes, None) for fqn, box in wanted]
    tasks, out["plan_v4_s"] = _cpu(box_tasks, "ckpt", m4, requests)
    out["tasks"] = len(tasks)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out["peak_rss_mib"] = (peak - rss0) / 1024
    return out


def real_worker(tensors: int, out: str) -> None:
    """One rank of the real run (under torchrun, gloo): saves an FSDP-like state dict of ``tensors``
    row-sharded DTensors once, loads it three times. Rank 0 writes the figures."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    rank, world, mesh, sd, directory = real_setup(tensors, torch.randn)
    import distckpt
    from distckpt import _dist, source

    got = {"recv": 0, "manifest_s": 0.0, "index_reads": 0, "index_bytes": 0}
    real_broadcast, real_manifest = _dist.ControlGroup.broadcast, source.Source.manifest_for_boxes

    def broadcast(self, obj=None, src=0):  # what this rank receives in the load's metadata step
        value = real_broadcast(self, obj, src)
        if self.rank != src:
            got["recv"] += len(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        return value

    def timed(fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            got["manifest_s"] += time.perf_counter() - t0

    def manifest(self, group=None):  # the collective step, then (format 4) this rank's index reads
        opened = timed(real_manifest, self, group)
        return (lambda wanted: timed(opened, wanted)) if callable(opened) else opened

    path = os.path.join(directory, "s")
    distckpt.save(sd, path)
    from distckpt.storage import open_store
    store_cls = type(open_store(path))
    real_read_index = store_cls.read_index

    def read_index(self, p, header, i):  # the indexes this rank reads from storage itself
        data = real_read_index(self, p, header, i)
        got["index_reads"] += 1
        got["index_bytes"] += len(data)
        return data

    _dist.ControlGroup.broadcast, source.Source.manifest_for_boxes = broadcast, manifest
    store_cls.read_index = read_index
    rows = []
    for _ in range(3):
        target = {k: distribute_tensor(torch.zeros(world * 4, 16), mesh, [Shard(0)]) for k in sd}
        got.update(recv=0, manifest_s=0.0, index_reads=0, index_bytes=0)
        dist.barrier()
        t0 = time.perf_counter()
        distckpt.load(target, path)
        rows.append({"load_s": time.perf_counter() - t0, **got})
        assert all(torch.equal(target[k].to_local(), sd[k].to_local()) for k in sd)
    real_finish(rank, world, rows, out, directory, manifest_bytes=os.path.getsize(os.path.join(path, "MANIFEST")),
                data_file=os.path.getsize(os.path.join(path, "rank00001.bin" if world > 1 else "rank00000.bin")))


def run_real(world: int, tensors: int) -> None:
    """Launch ``world`` real gloo ranks with torchrun and print what they measured."""
    doc = launch_real(__file__, world, tensors)
    ranks = doc["ranks"]
    print(f"real run: {world} gloo ranks x {tensors} row-sharded tensors, saved once, loaded 3 times; "
          f"MANIFEST {_fmt_bytes(doc['manifest_bytes'])}, a data file {_fmt_bytes(doc['data_file'])}")
    print(f"{'load':>4} {'recv/rank':>10} {'indexes/rank':>12} {'index bytes/rank':>16} {'manifest s (max)':>16} "
          f"{'load s (min..max)':>18}")
    for i in range(3):
        others = [r[i] for r in ranks[1:]] or [ranks[0][i]]
        loads = [r[i]["load_s"] for r in ranks]
        print(f"{i:>4} {_fmt_bytes(max(o['recv'] for o in others)):>10} "
              f"{max(r[i]['index_reads'] for r in ranks):>12} "
              f"{_fmt_bytes(max(r[i]['index_bytes'] for r in ranks)):>16} "
              f"{max(r[i]['manifest_s'] for r in ranks):>16.3f} {min(loads):>8.3f}..{max(loads):.3f}")


def main(argv=None) -> int:
    args = parse_args(__doc__, argv, ranks="8,64,512,4096", tensors="200,5000",
                      budget_help="give only format 4's figures for configurations whose format-3 simulation "
                                  "is estimated to take longer than this many seconds",
                      real_help="also run this many real gloo ranks under torchrun")
    if args.real_worker:
        tensors, out = args.real_worker.split(",", 1)
        real_worker(int(tensors), out)
        return 0
    if args.one:
        layout, world, tensors, *rest = args.one.split(",")
        print(json.dumps(run_one(layout, int(world), int(tensors), every_index="v4only" not in rest)))
        return 0
    print(f"{'layout':9} {'ranks':>5} {'tensors':>7} {'MANIFEST':>10} | {'v3 recv/rank':>12} {'v3 s':>7} | "
          f"{'v4 files':>8} {'v4 read/rank':>12} {'v4 s':>7} | {'peak RSS':>9}")
    for layout in args.layouts.split(","):
        # Per chunk record, the highest simulation rate measured so far decides whether building
        # every index (format 3's figures) fits the budget; format 4's run at any size.
        sim_rate = None
        for tensors in (int(t) for t in args.tensors.split(",")):
            for world in (int(w) for w in args.ranks.split(",")):
                records = tensors * world + (50 if layout == "torchrec" else 0)
                every = sim_rate is None or sim_rate * records <= args.budget
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one",
                                      f"{layout},{world},{tensors}" + ("" if every else ",v4only")],
                                     capture_output=True, text=True)
                if out.returncode != 0:
                    print(f"{layout:9} {world:>5} {tensors:>7} failed: {out.stderr.strip()[-300:]}")
                    continue
                r = json.loads(out.stdout)
                if every and r["records"] >= 10000:  # below that, fixed costs inflate the rate
                    sim_rate = max(sim_rate or 0.0, r["sim_s"] / r["records"])
                v3 = (f"{_fmt_bytes(r['recv_v3']):>12} {r['decode_v3_s'] + r['plan_v3_s']:>7.2f}" if every
                      else f"{'(not run)':>12} {'':>7}")
                print(f"{layout:9} {world:>5} {tensors:>7} {_fmt_bytes(r['manifest_bytes']):>10} | {v3} | "
                      f"{r['files_v4']:>8} {_fmt_bytes(r['recv_v4']):>12} {r['decode_v4_s'] + r['plan_v4_s']:>7.3f} | "
                      f"{r['peak_rss_mib']:>5.0f} MiB", flush=True)
    if args.real:
        run_real(args.real, args.real_tensors)
    return 0


if __name__ == "__main__":
    sys.exit(main())
