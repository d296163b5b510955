"""Listing a CheckpointManager root of many steps on S3: ``steps()``, ``latest_step()`` and
``describe()`` (what ``distckpt ls`` prints), with
the per-step queries one after the other (as before) and concurrent (``ObjectStore.for_each``),
side by side in one run against one local server (SeaweedFS).

    python launch/bench/bench_listing.py [--steps 200] [--rtt-ms 20] [--repeat 3]

Started from the repository root (it starts the test suite's server, tests/helpers/s3server.py, on
127.0.0.1 with free ports and stops it at the end). The steps are saved straight to the server;
the listings go through the suite's proxy (tests/helpers/s3proxy.py), which holds every request
``--rtt-ms`` before forwarding it: the round trip of a real object store, which loopback does not
have (``--rtt-ms 0``: loopback alone). Rounds interleaved (sequential, concurrent, ...); the
median of each is reported, with the ratio. Each listing is checked against the steps saved.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    from distckpt import CheckpointManager
    from distckpt.storage.object.store import ObjectStore
    from tests.helpers.s3proxy import FaultProxy
    from tests.helpers.s3server import S3Server

    server = S3Server().start()
    try:
        url = f"s3://{server.create_bucket()}/run"
        direct = CheckpointManager(url, storage_options=server.storage_options())
        for step in range(args.steps):
            direct.save(step, {"w": torch.arange(4.0)})
        u = urlsplit(server.endpoint)
        with FaultProxy((u.hostname, u.port)) as proxy:
            delay = args.rtt_ms / 1000
            proxy.rule = lambda n, method, path: ("delay", delay) if delay else None
            opts = server.storage_options()
            opts["client_kwargs"] = {**opts["client_kwargs"], "endpoint_url": proxy.endpoint}
            mgr = CheckpointManager(url, storage_options={**opts, "skip_instance_cache": True})
            times: dict[tuple[str, int], list[float]] = {}
            default = ObjectStore.FOR_EACH_IN_FLIGHT
            for _ in range(args.repeat):
                for in_flight in (1, default):
                    # On the class: describe() opens a store of its own.
                    ObjectStore.FOR_EACH_IN_FLIGHT = in_flight
                    t0 = time.perf_counter()
                    assert mgr.steps() == list(range(args.steps))
                    times.setdefault(("steps()", in_flight), []).append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    assert mgr.latest_step() == args.steps - 1
                    times.setdefault(("latest_step()", in_flight), []).append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    assert len(mgr.describe().entries) == args.steps
                    times.setdefault(("describe()", in_flight), []).append(time.perf_counter() - t0)
        ObjectStore.FOR_EACH_IN_FLIGHT = default
        print(f"{args.steps} steps, {args.rtt_ms:g} ms added to each request, median of {args.repeat}")
        print(f"{'call':<15} {'one at a time':>14} {'concurrent':>11} {'speed-up':>9}")
        for call in ("steps()", "latest_step()", "describe()"):
            seq = statistics.median(times[(call, 1)])
            con = statistics.median(times[(call, ObjectStore.FOR_EACH_IN_FLIGHT)])
            print(f"{call:<15} {seq:>12.2f} s {con:>9.2f} s {seq / con:>8.1f}x")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
