"""What a collective save or load pays to decide unread async-save failures with every rank.

Every ``distckpt.save``/``load`` and CheckpointManager call on several ranks starts with
:func:`distckpt.save_async.raise_background_failure`: one all-gather of what each rank has unseen
over distckpt's control group (see docs/SEMANTICS.md, "Async saves"). This times that call alone,
with nothing unseen (the common case), against a plain gloo ``all_gather_object`` of the same
small payload on the job's process group, in the same run. Run under torchrun::

    torchrun --nproc_per_node 2 launch/bench/bench_decide.py --calls 200
    torchrun --nproc_per_node 4 launch/bench/bench_decide.py --calls 200

Rank 0 prints the median and p90 of each, in milliseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()

    import torch.distributed as dist

    from distckpt._dist import control_group
    from distckpt.save_async import raise_background_failure

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = control_group(None, operation="bench")

    def timed(fn) -> list[float]:
        for _ in range(10):  # warm-up: connections, first pickles
            fn()
        out = []
        for _ in range(args.calls):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    decide = timed(lambda: raise_background_failure(group))
    gather = timed(lambda: dist.all_gather_object([None] * world, []))
    if rank == 0:
        for name, xs in (("raise_background_failure(group)", decide), ("dist.all_gather_object (reference)", gather)):
            xs = sorted(xs)
            print(f"{name:38s} ranks {world}: median {statistics.median(xs):.2f} ms, "
                  f"p90 {xs[int(0.9 * (len(xs) - 1))]:.2f} ms ({len(xs)} calls)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
