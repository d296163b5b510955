"""Control-plane cost of a save at 1 to 4,096 ranks, simulated in one process.

What it runs is distckpt's own code, not a model of it: every rank's PLAN message is built in the
exact format ``saveplan.plan_save`` sends first (``_summarize``'s summary, its layout
fingerprint and ``_plan_message``: compact layouts as a digest, rank 0's with its compact part),
rank 0's planning is ``saveplan._coordinate_plan`` (the merge and every rank's reply), run once
cold and once as the next save with unchanged layouts (the plan cache), and the MANIFEST (format
version 3) is built with ``commit._build_manifest`` and encoded with ``manifest.encode`` from
every rank's WRITE report (its data file's size and index reference). Each rank's index (one
ChunkRecord per written chunk, one crc per checksum block, ``manifest.encode_index``) is built for
a sample of ranks (0, 1, the last, the one owning most pieces). No collective runs: the
bytes on the wire are the pickled messages that gloo's gather/scatter_object would carry. The
grid descriptions and the container tree are the same on every rank, so the simulation builds
them (and their digest) once and gives every rank the same objects.

Per configuration it reports, in a fresh subprocess (so peak RSS is this configuration's alone):
  * ``send/rank``  bytes a rank other than 0 sends at PLAN (the largest over those ranks);
  * ``recv/rank``  bytes a rank other than 0 receives at PLAN (its reply: which pieces it writes);
  * ``rank0 recv`` bytes rank 0 receives (every rank's message, its own included);
  * ``plan s``     rank 0's CPU seconds to merge and build the replies (the other ranks do none);
  * ``cached s``   the same for the next save with unchanged layouts (plan cache hit);
  * ``manifest s`` CPU seconds to build + encode the MANIFEST (rank 0 only);
  * ``MANIFEST``   its encoded size;
  * ``index``      the largest data-file index of the sampled ranks (each rank writes its own);
  * ``index s``    CPU seconds to encode and checksum that index (the rank's own work);
  * ``peak RSS``   the process's peak RSS minus its RSS before the summaries were built (all
                   ranks' summaries live in this one process, so this is rank 0's, plus the others').

Layouts (per rank ``T`` tensors of the model, all floating point):
  * ``fsdp``     every tensor a DTensor ``Shard(0)`` over all ranks (FSDP2 fully_shard): a grid;
  * ``tp_fsdp``  every tensor a DTensor ``[Shard(0), Shard(1)]`` over a ``(W/8, 8)`` mesh: a grid;
  * ``torchrec`` ``T`` tables row-wise sharded across all ranks (DTensors over LocalShardsWrapper,
                 no mesh: described as a grid over every rank, as ``_summarize`` does for a
                 row block of an even split), plus 50 replicated dense tensors (piece by piece).

Configurations whose simulation (building every rank's summary, which takes the simulating
process far longer than rank 0's planning) would exceed ``--budget`` seconds are not run; a
MANIFEST estimated (from the highest per-piece rate measured so far) to take longer than the
budget is not built and its time and size are printed as estimates, marked ``~``. Nothing
estimated is presented as measured. ``--one LAYOUT,RANKS,TENSORS[,nomanifest]`` runs one
configuration whatever its cost and prints its figures as JSON.

With ``--real N`` it also runs N real gloo ranks under torchrun (each an FSDP-like state dict of
``--real-tensors`` row-sharded DTensors, saved three times with unchanged layouts) and prints rank
0's PLAN time cold and cached, and the PLAN bytes each rank sent and received (pickled, as gloo
carries them), to check the simulation's figures against real ones.

Usage: python launch/bench/bench_scale.py [--ranks 1,8,64,512,4096] [--tensors 200,5000,20000]
                                    [--layouts fsdp,tp_fsdp,torchrec] [--budget 60] [--real 16]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _pieces(layout: str, world: int, tensors: int, rank: int):
    """(fqn, shape, [(offsets, sizes)]) of one rank: the same global tensors on every rank."""
    rows, cols = 4096, 1024
    if layout == "fsdp":
        step = -(-rows // world)
        for i in range(tensors):
            lo = min(rank * step, rows)
            n = max(0, min(step, rows - lo))
            yield f"layers.{i}.weight", (rows, cols), [((lo, 0), (n, cols))]
    elif layout == "tp_fsdp":
        tp = min(8, world)
        dp = world // tp
        r_dp, r_tp = divmod(rank, tp)
        rstep, cstep = -(-rows // dp), -(-cols // tp)
        for i in range(tensors):
            lo, clo = min(r_dp * rstep, rows), min(r_tp * cstep, cols)
            yield (f"layers.{i}.weight", (rows, cols),
                   [((lo, clo), (max(0, min(rstep, rows - lo)), max(0, min(cstep, cols - clo))))])
    elif layout == "torchrec":
        trows, dim = 1 << 24, 128
        step = -(-trows // world)
        for i in range(tensors):
            lo = min(rank * step, trows)
            yield f"sparse.ebc.tables.t{i}.weight", (trows, dim), [((lo, 0), (max(0, min(step, trows - lo)), dim))]
        for i in range(50):
            yield f"dense.{i}.weight", (512, 512), [((0, 0), (512, 512))]
    else:
        raise ValueError(layout)


def _grid(layout: str, world: int):
    """The mesh and split dims every rank gives the layout's DTensors (None: not an even grid)."""
    if layout == "fsdp":
        return ((world,), tuple(range(world))), (0,)
    if layout == "tp_fsdp":
        tp = min(8, world)
        return ((world // tp, tp), tuple(range(world))), (0, 1)
    return None  # TorchRec: see _summary


def _torchrec_grid(world: int, out: dict) -> tuple[list, dict]:
    """TorchRec's row-wise tables carry no mesh, but each rank's table piece is its row block of
    an even split over the group, which saveplan._summarize describes as a grid over every
    rank (one rank: nothing to describe). The replicated dense tensors stay piece by piece."""
    if world == 1:
        return [], {}
    return [((world,), tuple(range(world)))], {fqn: ("dtensor", "float32", tuple(t[2]), 0, (0,))
                                               for fqn, t in out.items() if fqn.startswith("sparse.")}


def _summary(layout: str, world: int, tensors: int, rank: int, shared: dict) -> dict:
    """A rank's PLAN summary in saveplan._summarize's format (no objects, no digests: the
    replicated dense tensors of the TorchRec layout are DTensor-like replicas). The grid
    descriptions and the tree are the same on every rank (that is the point of them), so one
    object serves all ranks (``shared``), as its digest does."""
    out = {}
    for fqn, shape, boxes in _pieces(layout, world, tensors, rank):
        out[fqn] = ("dtensor", "float32", shape, [(list(o), list(s), 4 * s[0] * s[1]) for o, s in boxes])
    if "tree" not in shared:
        # A flat state dict's container tree, as flatten() builds it.
        shared["tree"] = {"t": "dict", "k": [[fqn, {"t": "ref", "fqn": fqn}] for fqn in out]}
        g = _grid(layout, world)
        shared["meshes"] = [g[0]] if g else []
        shared["grid"] = {fqn: ("dtensor", "float32", tuple(t[2]), 0, g[1]) for fqn, t in out.items()} if g else {}
        if layout == "torchrec":
            shared["meshes"], shared["grid"] = _torchrec_grid(world, out)
    summary = {"tensors": out, "objects": {}, "tree": shared["tree"], "digests": {}, "grid": shared["grid"],
               "meshes": shared["meshes"]}
    if "digest" in shared:
        summary["_compact_digest"] = shared["digest"]
    return summary


class _Group:
    """The attributes of a ControlGroup that rank 0's planning reads (no collective is run)."""

    def __init__(self, world: int) -> None:
        self.pg, self.rank, self.world_size = object(), 0, world


def _cpu(fn, *args):
    """(fn(*args), CPU seconds it took), timed as a save runs: with the garbage collector paused
    (gcpause.gc_paused)."""
    from distckpt.gcpause import gc_paused
    with gc_paused():
        t0 = time.process_time()
        result = fn(*args)
        return result, time.process_time() - t0


def plan_all(layout: str, world: int, tensors: int) -> dict:
    """Every rank's PLAN message and rank 0's planning of them, cold and cached (see the module
    docstring). Returns the figures and, under ``"plan"`` / ``"grid"``, the merged plan and the
    grid descriptions (for :func:`rank_index`)."""
    sys.path.insert(0, ROOT)
    from distckpt import saveplan as co

    t_sim = time.monotonic()
    shared: dict = {}
    msgs, keys, sent = [], [], []
    for r in range(world):
        s = _summary(layout, world, tensors, r, shared)
        key = co._layout_key(s)
        # Rank 0 sends its compact part; the others its digest (what plan_save sends first).
        msg = co.LayoutMessage(co._plan_message(s, compact=True, with_part=r == 0), key)
        shared.setdefault("digest", s["_compact_digest"])
        # Bytes on the wire as gloo's gather/scatter_object carry them (pickled).
        sent.append(len(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)))
        msgs.append(msg)
        keys.append(key)
    group = _Group(world)
    (replies, plan), plan_s = _cpu(co._coordinate_plan, group, msgs, lambda fqn: True)
    assert isinstance(replies[0], co.PlanReply), replies[0]
    recv = [len(pickle.dumps(r, protocol=pickle.HIGHEST_PROTOCOL)) for r in replies]
    # The next save with the same layouts: every rank sends its fingerprint and values only.
    cache = co._PLAN_CACHE[group.pg]
    same = [co.SameLayoutMessage(k, cache.plan_id, {}, {}) for k in keys]
    del msgs
    (replies2, _), cached_s = _cpu(co._coordinate_plan, group, same, lambda fqn: True)
    assert isinstance(replies2[0], co.PlanReply) and replies2[0].cached, replies2[0]
    sent_cached = max(len(pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL)) for m in same)
    owned: dict[int, list] = {}
    for (fqn, off, sizes), r in plan.owners.items():
        owned.setdefault(r, []).append((fqn, off, sizes))
    return {"layout": layout, "ranks": world, "tensors": tensors, "pieces": plan.n_chunks,
            "compact": plan.compact, "send_per_rank": max(sent[1:] or sent), "send_rank0": sent[0],
            "recv_per_rank": max(recv[1:] or recv), "coord_recv": sum(sent), "merge_s": plan_s, "cached_s": cached_s,
            "send_cached": sent_cached, "sim_s": time.monotonic() - t_sim,
            "plan": plan, "grid": shared["grid"] if plan.compact else {}, "owned": owned}


def rank_index(planned: dict, rank: int) -> tuple[list, int]:
    """Rank ``rank``'s data-file index as WRITE builds it: ``(fqn, ChunkRecord)`` for every chunk
    it writes (its grid chunks and the general pieces the plan gave it), and the data bytes
    before the index."""
    from distckpt import manifest as mf
    layout, world, tensors, plan = planned["layout"], planned["ranks"], planned["tensors"], planned["plan"]
    written = [(fqn, tuple(o), tuple(sz)) for fqn, _shape, boxes in _pieces(layout, world, tensors, rank)
               if fqn in planned["grid"] for o, sz in boxes if sz[0] and sz[1]]  # empty grid chunks are not written
    written += planned["owned"].get(rank, [])
    records, offset = [], 0
    for fqn, off, sizes in sorted(written):
        nbytes = 4
        for n in sizes:
            nbytes *= n
        nblocks = -(-nbytes // plan.checksum_block)
        records.append((fqn, mf.ChunkRecord(offsets=off, sizes=sizes, file=rank, offset=offset,
                                            nbytes=nbytes, crcs=tuple(range(nblocks)))))
        offset += -(-nbytes // 4096) * 4096
    return records, offset


def run_one(layout: str, world: int, tensors: int, manifest: bool = True) -> dict:
    """One configuration, in this process. Returns the figures as a dict. ``manifest=False``
    skips the WRITE records and the MANIFEST (one object per piece; too slow at the largest
    sizes), reported as None."""
    sys.path.insert(0, ROOT)
    from distckpt import commit
    from distckpt import manifest as mf
    from distckpt.checksum import crc32c

    rss0 = _rss_kib()
    planned = plan_all(layout, world, tensors)
    plan, owned = planned["plan"], planned["owned"]
    out = {k: v for k, v in planned.items() if k not in ("plan", "grid", "owned")}
    out.update(manifest_s=None, manifest_bytes=None)
    if manifest:
        # WRITE on a rank: its chunk records go into its data file's index (format version 3),
        # each rank's own work. Built for a sample of ranks (0, 1, the last, and the one owning
        # most pieces by the plan): building all 20 M records of 4,096 x 5,000 in one process would
        # measure the simulation, not any rank. The grid layouts give every rank the same count.
        busiest = max(owned, key=lambda r: len(owned[r])) if owned else 0
        sample = sorted({0, min(1, world - 1), world - 1, busiest})
        index_s, index_bytes, refs = 0.0, 0, {}
        for r in sample:
            records, offset = rank_index(planned, r)
            index, seconds = _cpu(mf.encode_index, records)
            crc, crc_seconds = _cpu(crc32c, index)
            index_s = max(index_s, seconds + crc_seconds)
            index_bytes = max(index_bytes, len(index))
            refs[r] = ((offset, len(index), crc), offset + len(index))
        like = refs[sample[1] if len(sample) > 1 else sample[0]]
        outcomes = [commit.WriteOutcome(*refs.get(r, like), "uring", "simulated") for r in range(world)]
        body, out["manifest_s"] = _cpu(
            lambda: mf.encode(commit._build_manifest(plan, outcomes, "0" * 32, world, plan.checksum_block, None)))
        out["manifest_bytes"] = len(body)
        out["index_s"], out["index_bytes"] = index_s, index_bytes
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out["peak_rss_mib"] = (peak - rss0) / 1024
    return out


def real_setup(tensors: int, make) -> tuple[int, int, Any, dict, str]:
    """A real run's rank (under torchrun): the gloo group, a 1-D mesh over every rank, an
    FSDP-like state dict of ``tensors`` row-sharded DTensors made by ``make(shape)`` (world x 4
    rows of 16), and a scratch directory rank 0 made. Returns (rank, world, mesh, sd, directory)."""
    sys.path.insert(0, ROOT)
    import tempfile

    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = DeviceMesh("cpu", list(range(world)))
    sd = {f"layers.{i}.weight": distribute_tensor(make((world * 4, 16)), mesh, [Shard(0)]) for i in range(tensors)}
    box = [tempfile.mkdtemp(prefix="distckpt-scale-") if rank == 0 else None]
    dist.broadcast_object_list(box)
    return rank, world, mesh, sd, box[0]


def real_finish(rank: int, world: int, rows: list, out: str, directory: str, **extra) -> None:
    """Gather every rank's ``rows``; rank 0 writes them (and ``extra``) to ``out`` as JSON and
    removes ``directory``; then the group ends."""
    import shutil

    import torch.distributed as dist
    everyone = [None] * world
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"ranks": everyone, **extra}, f)
        shutil.rmtree(directory, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


def real_worker(tensors: int, out: str) -> None:
    """One rank of the real run (under torchrun, gloo): an FSDP-like state dict of ``tensors``
    row-sharded DTensors, saved three times with unchanged layouts. Rank 0 writes the figures."""
    import torch

    rank, world, _mesh, sd, directory = real_setup(tensors, torch.zeros)
    import distckpt
    from distckpt import _dist
    from distckpt.commit import WriteOutcome

    sizes = {"gather": 0, "scatter": 0, "write": 0}
    real_gather, real_scatter = _dist.ControlGroup.gather, _dist.ControlGroup.scatter

    def gather(self, obj, dst=0):  # bytes this rank sends at PLAN, and its WRITE report
        n = len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        sizes["write" if isinstance(obj, WriteOutcome) else "gather"] += n
        return real_gather(self, obj, dst)

    def scatter(self, objs, src=0):  # bytes this rank receives at PLAN
        got = real_scatter(self, objs, src)
        sizes["scatter"] += len(pickle.dumps(got, protocol=pickle.HIGHEST_PROTOCOL))
        return got

    _dist.ControlGroup.gather, _dist.ControlGroup.scatter = gather, scatter
    rows = []
    for i in range(3):
        sizes.update(gather=0, scatter=0, write=0)
        res = distckpt.save(sd, os.path.join(directory, f"s{i}"))
        rows.append({"plan_s": res.plan_seconds, "cached": res.plan_cached, "save_s": res.seconds,
                     "sent": sizes["gather"], "recv": sizes["scatter"], "write": sizes["write"],
                     "phases": res.phase_seconds})
    real_finish(rank, world, rows, out, directory,
                manifest_bytes=os.path.getsize(os.path.join(directory, "s2", "MANIFEST")))


def launch_real(script: str, world: int, tensors: int) -> dict:
    """Run ``script --real-worker TENSORS,OUT`` on ``world`` real gloo ranks under torchrun and
    return the JSON its rank 0 wrote to OUT."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "real.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               os.path.abspath(script), "--real-worker", f"{tensors},{out}"]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


def run_real(world: int, tensors: int) -> None:
    """Launch ``world`` real gloo ranks with torchrun and print what they measured."""
    doc = launch_real(__file__, world, tensors)
    ranks = doc["ranks"]
    print(f"real run: {world} gloo ranks x {tensors} row-sharded tensors (3 saves, same layout)")
    print(f"{'save':>4} {'cached':>6} {'rank0 plan s':>12} {'max plan s':>10} {'save s':>7} "
          f"{'sent/rank':>10} {'recv/rank':>10} {'rank0 recv':>10} {'WRITE/rank':>10}")
    for i in range(3):
        others = [r[i] for r in ranks[1:]] or [ranks[0][i]]
        print(f"{i:>4} {str(ranks[0][i]['cached']):>6} {ranks[0][i]['plan_s']:>12.3f} "
              f"{max(r[i]['plan_s'] for r in ranks):>10.3f} {ranks[0][i]['save_s']:>7.3f} "
              f"{_fmt_bytes(max(o['sent'] for o in others)):>10} {_fmt_bytes(max(o['recv'] for o in others)):>10} "
              f"{_fmt_bytes(sum(r[i]['sent'] for r in ranks)):>10} {_fmt_bytes(max(o['write'] for o in others)):>10}")
    print(f"MANIFEST of the last save: {_fmt_bytes(doc['manifest_bytes'])}")
    print("rank 0's phases (s): " + "; ".join(
        f"save {i}: " + ", ".join(f"{k} {v:.3f}" for k, v in ranks[0][i]["phases"].items()) for i in range(3)))


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _checksums(layout: str, world: int, tensors: int) -> int:
    """About how many checksums the MANIFEST holds: at least one per non-empty piece and one per
    MiB of data (the block is at most DISTCKPT_CHECKSUM_BLOCK, 1 MiB; the TorchRec layout's
    tables are 8 GiB each)."""
    pieces = tensors * world + (50 if layout == "torchrec" else 0)
    data_mib = tensors * (8192 if layout == "torchrec" else 16)
    return max(pieces, data_mib)


def _work_units(layout: str, world: int, tensors: int) -> int:
    """What the MANIFEST's cost grows with (format 3): one unit per key plus one per rank."""
    return tensors + (50 if layout == "torchrec" else 0) + world


def _manifest_estimate(layout: str, world: int, tensors: int) -> int:
    """The MANIFEST size to expect (format 3): about 100 B per tensor (its entry and its place in
    the tree) plus 40 B per data file (name, size, rank, index reference)."""
    return 100 * (tensors + (50 if layout == "torchrec" else 0)) + 40 * world


def parse_args(doc: str, argv, *, ranks: str, tensors: str, budget_help: str, real_help: str) -> argparse.Namespace:
    """The command line both scale benchmarks share (``--one`` and ``--real-worker`` are their
    internal modes)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--ranks", default=ranks)
    ap.add_argument("--tensors", default=tensors)
    ap.add_argument("--layouts", default="fsdp,tp_fsdp,torchrec")
    ap.add_argument("--budget", type=float, default=60.0, help=budget_help)
    ap.add_argument("--real", type=int, default=0, help=real_help)
    ap.add_argument("--real-tensors", type=int, default=200)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--real-worker", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(__doc__, argv, ranks="1,8,64,512,4096", tensors="200,5000,20000",
                      budget_help="skip (extrapolate) configurations whose merge is estimated to take longer "
                                  "than this many seconds",
                      real_help="also run this many real gloo ranks under torchrun (each saves --real-tensors "
                                "row-sharded DTensors three times) and print their figures")
    if args.real_worker:
        tensors, out = args.real_worker.split(",", 1)
        real_worker(int(tensors), out)
        return 0
    if args.one:
        layout, world, tensors, *rest = args.one.split(",")
        print(json.dumps(run_one(layout, int(world), int(tensors), manifest=not rest)))
        return 0
    print(f"{'layout':9} {'ranks':>5} {'tensors':>7} {'pieces':>10} {'send/rank':>10} {'recv/rank':>10} "
          f"{'rank0 recv':>10} {'plan s':>7} {'cached s':>8} {'manifest s':>10} {'MANIFEST':>10} {'index':>10} "
          f"{'index s':>7} {'peak RSS':>10}")
    for layout in args.layouts.split(","):
        # Seconds per work unit, the highest measured so far: the MANIFEST build + encode (per
        # piece and checksum block) and the simulation as a whole (generating every rank's summary
        # and rank 0's planning), which decide what is run and what is only estimated.
        manifest_rate = sim_rate = None
        for tensors in (int(t) for t in args.tensors.split(",")):
            for world in (int(w) for w in args.ranks.split(",")):
                pieces = tensors * world + (50 if layout == "torchrec" else 0)
                units = _work_units(layout, world, tensors)
                if sim_rate is not None and sim_rate * pieces > args.budget:
                    print(f"{layout:9} {world:>5} {tensors:>7} {pieces:>10}   (not run: the simulation of every "
                          f"rank's summary is estimated at {sim_rate * pieces:.0f} s)")
                    continue
                skip_manifest = manifest_rate is not None and manifest_rate * units > args.budget
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one",
                                      f"{layout},{world},{tensors}" + (",nomanifest" if skip_manifest else "")],
                                     capture_output=True, text=True)
                if out.returncode != 0:
                    print(f"{layout:9} {world:>5} {tensors:>7} failed: {out.stderr.strip()[-300:]}")
                    continue
                r = json.loads(out.stdout)
                if pieces >= 10000:  # below that, fixed costs would inflate the per-piece rate
                    sim_rate = max(sim_rate or 0.0, r["sim_s"] / pieces)
                if r["manifest_s"] is not None:
                    manifest_rate = max(manifest_rate or 0.0, r["manifest_s"] / units)
                    man = (f"{r['manifest_s']:>10.2f} {_fmt_bytes(r['manifest_bytes']):>10} "
                           f"{_fmt_bytes(r['index_bytes']):>10} {r['index_s']:>7.3f}")
                else:
                    man = (f"~{manifest_rate * units:>9.0f} "
                           f"{'~' + _fmt_bytes(_manifest_estimate(layout, world, tensors)):>10} {'':>10} {'':>7}")
                print(f"{layout:9} {world:>5} {tensors:>7} {r['pieces']:>10} {_fmt_bytes(r['send_per_rank']):>10} "
                      f"{_fmt_bytes(r['recv_per_rank']):>10} {_fmt_bytes(r['coord_recv']):>10} {r['merge_s']:>7.2f} "
                      f"{r['cached_s'] * 1000:>6.2f}ms {man} {r['peak_rss_mib']:>7.0f} MiB", flush=True)
    if args.real:
        run_real(args.real, args.real_tensors)
    return 0


if __name__ == "__main__":
    sys.exit(main())
