"""Benchmark: incremental (delta) vs full checkpoints of TorchRec tables, 2 ranks, one run.

    torchrun --standalone --nproc-per-node 2 launch/bench/bench_incremental.py --dir /var/tmp/bench_incr \
        --rows 250000 --dim 64 --tables 4 --rounds 7 [--nochange 5] [--force-deltas] [--keep]

Model: launch/bench/bench_torchrec.py's (``--tables`` tables of rows x dim float32, fused
EXACT_ROWWISE_ADAGRAD, sharded column-wise / table-wise / row-wise / table-wise over 2 ranks).
For each touched fraction (1 %, 5 %, 20 %): a full incremental base, then ``--rounds`` rounds of
(one training step whose batch looks up a random ``fraction`` of every table's rows, exactly once
each: the fused optimizer updates those rows' weights and momentum; an incremental save under the
default policy, which writes a delta or, when the chain is long enough, a full checkpoint; a plain
full save of the same state for comparison). Then a restore of the longest chain of the run (its
base plus every delta) and of the plain full checkpoint of the same step, into the same model,
alternated ``--restores`` times (the fastest of each, and the ratio of the medians). Reported per
fraction (medians over the delta rounds): bytes written by a delta and by a full save, the changed rows' own bytes (weights + momentum of the
rows whose bytes changed), delta / changed, save seconds of each, the links' kinds, and restore
seconds of the chain vs the full checkpoint, and the file bytes each restore read (both ranks).
Rank 0 prints one JSON line per fraction, after one line with the cost of the row digests alone
and one with the fixed cost of a delta: ``--nochange`` saves of an unchanged state after a full
base, by a saver that hashes every row and one with ``watch_writes=True`` (re-hashes only the rows
on pages written since its previous link), alternated (the order swaps every round), medians.
Every round of a fraction also saves the state through a second, ``watch_writes=True`` saver
(its own chain, same policy) beside the hashing one and the plain full save, in an order that
rotates every round, so ``delta_save_s`` (hash every row), ``watch_delta_save_s`` and
``full_save_s`` come from the same rounds. Each line carries the load average at its end.
The page cache is left as the saves left it: their data files are written with O_DIRECT, so both
restores read from the disk.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

import distckpt  # noqa: E402
from distckpt.incremental import IncrementalPolicy, IncrementalSaver, row_digests  # noqa: E402
from distckpt.integrations import torchrec as dtr  # noqa: E402
from launch.bench.bench_torchrec import build  # noqa: E402


def timed(fn):
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t0, out


def touch(dmp, tables: int, rows: int, fraction: float, seed: int, rank: int, world: int) -> None:
    """One training step looking up a random ``fraction`` of each table's rows once each."""
    from torchrec import KeyedJaggedTensor
    g = torch.Generator().manual_seed(seed)
    n = int(rows * fraction)
    ids = [torch.randperm(rows, generator=g)[:n] for _ in range(tables)]
    per = n // world
    vals = torch.cat([t[rank * per:(rank + 1) * per] for t in ids])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(tables)], values=vals,
                                              lengths=torch.ones(per * tables, dtype=torch.int64))
    dmp(kjt).values().sum().backward()


def local_rows(dmp) -> int:
    """Tracked rows on this rank (all its pieces of every tracked tensor). Collective."""
    from distckpt.flatten import flatten
    sd = dtr.state_dict(dmp)
    rows = dtr.incremental_rows(sd)
    _t, items = flatten(sd, check_objects=False)
    return sum(p.tensor.shape[d] for f, d in rows.items() for p in items[f].pieces)


def nochange(dmp, args, rank: int) -> None:
    """The fixed cost of a delta: saves of an unchanged state after a full base, hashing every
    row vs watching writes, alternated; rank 0 prints the medians."""
    root = os.path.join(args.dir, "nochange")
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    dist.barrier()
    pol = IncrementalPolicy(rows=dtr.incremental_rows, full_every=args.nochange + 1)
    savers = {"hash": IncrementalSaver(pol), "watch": IncrementalSaver(dataclasses.replace(pol, watch_writes=True))}
    sd = dtr.state_dict(dmp)
    for name, s in savers.items():
        timed(lambda: s.save(sd, os.path.join(root, f"{name}0")))
    t = {name: [] for name in savers}
    hashed = {name: [] for name in savers}
    for k in range(1, args.nochange + 1):
        for name in (["hash", "watch"] if k % 2 else ["watch", "hash"]):
            s = savers[name]
            sec, _r = timed(lambda: s.save(dtr.state_dict(dmp), os.path.join(root, f"{name}{k}")))
            assert s.last_kind == "delta" and s._link["rows_written"] == 0
            t[name].append(sec)
            hashed[name].append(s.last_hashed_rows)
    if rank == 0:
        med = statistics.median
        print(json.dumps({"nochange_delta_s": round(med(t["hash"]), 3),
                          "nochange_watch_delta_s": round(med(t["watch"]), 3),
                          "nochange_all_s": {k: [round(x, 3) for x in v] for k, v in t.items()},
                          "hashed_rows_rank0": {k: int(med(v)) for k, v in hashed.items()},
                          "watch_status_rank0": savers["watch"].watch_status,
                          "loadavg": os.getloadavg()}), flush=True)
        shutil.rmtree(root)
    dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--rows", type=int, default=250000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--tables", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7, help="train + save rounds after the first full save")
    ap.add_argument("--force-deltas", action="store_true", help="every round a delta, whatever the policy says")
    ap.add_argument("--fractions", default="0.01,0.05,0.2")
    ap.add_argument("--restores", type=int, default=3, help="alternated restores of the chain and the full")
    ap.add_argument("--keep", action="store_true", help="keep each fraction's checkpoints under DIR/f<fraction>")
    ap.add_argument("--nochange", type=int, default=5, help="no-change delta saves per saver (fixed cost)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dmp = build(rank, world, args.tables, args.rows, args.dim)
    sd = dtr.state_dict(dmp)
    # Digest cost alone: every local tracked row of this rank, hashed once.
    rows_of = dtr.incremental_rows(sd)
    from distckpt.flatten import flatten
    _t, items = flatten(sd, check_objects=False)
    t0 = time.perf_counter()
    nbytes = 0
    for fqn, d in rows_of.items():
        for p in items[fqn].pieces:
            row_digests(p.tensor, d)
            nbytes += p.tensor.numel() * p.tensor.element_size()
    digest_s = time.perf_counter() - t0
    if rank == 0:
        print(json.dumps({"digest_seconds_rank0": round(digest_s, 3), "digest_bytes_rank0": nbytes,
                          "digest_GiB_per_s": round(nbytes / digest_s / 2**30, 3),
                          "loadavg": os.getloadavg()}), flush=True)
    nochange(dmp, args, rank)
    nlocal = local_rows(dmp)   # collective (dtr.state_dict): on every rank
    for fi, fraction in enumerate(float(x) for x in args.fractions.split(",")):
        root = os.path.join(args.dir, f"f{fraction}")
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root)
        dist.barrier()
        # The default policy (full_every=8, max_delta_fraction=0.3, max_chain_fraction=0.25), or
        # --force-deltas: every round a delta (long chains, to see restore cost grow with them).
        policy = (IncrementalPolicy(rows=dtr.incremental_rows, full_every=args.rounds + 1, max_delta_fraction=1.0,
                                    max_chain_fraction=float(args.rounds))
                  if args.force_deltas else IncrementalPolicy(rows=dtr.incremental_rows))
        saver = IncrementalSaver(policy)
        wsaver = IncrementalSaver(dataclasses.replace(policy, watch_writes=True))
        sd = dtr.state_dict(dmp)
        _s, res = timed(lambda: saver.save(sd, os.path.join(root, "link0")))
        _s, res = timed(lambda: wsaver.save(sd, os.path.join(root, "wlink0")))
        assert saver.last_kind == "full" and wsaver.last_kind == "full"
        rec = {"delta_bytes": [], "full_bytes": [], "changed_bytes": [], "delta_s": [], "full_s": [],
               "changed_rows": [], "rows_total": 0, "kinds": [], "wdelta_s": [], "whashed": []}
        for k in range(1, args.rounds + 1):
            touch(dmp, args.tables, args.rows, fraction, 1000 * fi + k, rank, world)
            sd = dtr.state_dict(dmp)
            runs = {
                "delta": lambda: saver.save(sd, os.path.join(root, f"link{k}")),
                "watch": lambda: wsaver.save(sd, os.path.join(root, f"wlink{k}")),
                "full": lambda: distckpt.save(sd, os.path.join(root, f"full{k}")),
            }
            order = list(runs)[k % 3:] + list(runs)[:k % 3]   # each save goes first, second, third in turn
            got = {name: timed(runs[name]) for name in order}
            (ds, dres), (ws, _wres), (fs, fres) = got["delta"], got["watch"], got["full"]
            link = saver._link
            rec["kinds"].append(f"{saver.last_kind}:{link['seq']}")
            assert wsaver.last_kind == saver.last_kind and wsaver._link["rows_written"] == link["rows_written"], \
                "the watching saver must write the same rows"
            if wsaver.last_kind == "delta":
                rec["wdelta_s"].append(ws)
                rec["whashed"].append(wsaver.last_hashed_rows)
            rec["full_bytes"].append(fres.total_bytes)
            rec["full_s"].append(fs)
            if saver.last_kind == "delta":
                rec["delta_bytes"].append(dres.total_bytes)
                rec["changed_bytes"].append(link["link_bytes"])
                rec["changed_rows"].append(link["rows_written"])
                rec["rows_total"] = link["rows_total"]
                rec["delta_s"].append(ds)
            dist.barrier()
        # Restore the longest chain of the run (the newest link of the highest position) and the
        # plain full checkpoint of the same step.
        seqs = [int(x.split(":")[1]) for x in rec["kinds"]]
        last = max(range(1, args.rounds + 1), key=lambda k: (seqs[k - 1], k))
        chain_t, full_t = [], []
        for _ in range(args.restores):
            t, chain_res = timed(lambda: dtr.load(dmp, os.path.join(root, f"link{last}")))
            chain_t.append(t)
            t, full_res = timed(lambda: dtr.load(dmp, os.path.join(root, f"full{last}")))
            full_t.append(t)
        # File bytes each restore read, both ranks (checksum-block widening and merged gaps included).
        read = torch.tensor([chain_res.bytes_read, full_res.bytes_read], dtype=torch.int64)
        dist.all_reduce(read)
        med = statistics.median
        if rank == 0:
            out = {
                "fraction": fraction, "rows": args.rows, "dim": args.dim, "tables": args.tables, "world": world,
                "rows_changed_frac": round(med(rec["changed_rows"]) / rec["rows_total"], 4),
                "delta_MiB": round(med(rec["delta_bytes"]) / 2**20, 2),
                "changed_rows_MiB": round(med(rec["changed_bytes"]) / 2**20, 2),
                "delta_over_changed": round(med(rec["delta_bytes"]) / med(rec["changed_bytes"]), 3),
                "full_MiB": round(med(rec["full_bytes"]) / 2**20, 2),
                "full_over_delta_bytes": round(med(rec["full_bytes"]) / med(rec["delta_bytes"]), 2),
                "delta_save_s": round(med(rec["delta_s"]), 3), "full_save_s": round(med(rec["full_s"]), 3),
                "delta_over_full_save_s": round(med(rec["delta_s"]) / med(rec["full_s"]), 3),
                "watch_delta_save_s": round(med(rec["wdelta_s"]), 3),
                "watch_delta_over_full_save_s": round(med(rec["wdelta_s"]) / med(rec["full_s"]), 3),
                "watch_hashed_rows_frac_rank0": round(med(rec["whashed"]) / max(1, nlocal), 4),
                "kinds": rec["kinds"], "chain_links": seqs[last - 1] + 1,
                "restore_chain_s": round(min(chain_t), 3), "restore_full_s": round(min(full_t), 3),
                "restore_chain_over_full": round(min(chain_t) / min(full_t), 3),
                "restore_chain_over_full_median": round(med(chain_t) / med(full_t), 3),
                "restore_chain_read_MiB": round(int(read[0]) / 2**20, 1),
                "restore_full_read_MiB": round(int(read[1]) / 2**20, 1),
                "loadavg": os.getloadavg(),
            }
            print(json.dumps(out), flush=True)
            if not args.keep:
                shutil.rmtree(root)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
