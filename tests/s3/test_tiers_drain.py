"""distckpt.tiers.drain against the suite's real S3 server (SeaweedFS), on two real gloo ranks.

Each test saves a step with a normal 2-rank ``distckpt.save`` into a local directory (both ranks
share it here; the node-private local commit is distckpt.tiers.localcommit's), then drains it
with ``drain_step`` over the ranks' "drain" control group. What is held:

* the remote step loads bit-exact from the URL, its MANIFEST is the local one byte for byte, each
  rank sent its own file, a second drain sends nothing (``already_remote``), nothing else is left
  in the bucket;
* a flipped byte in a local data file: ChecksumMismatchError on every rank, no MANIFEST remotely
  and nothing left under the step;
* a local data file missing: TierIncompleteError on every rank naming it, nothing sent;
* the remote step committed by another save: CheckpointExistsError on every rank, that step kept;
* the server silent (stall) or resetting connections once the upload began (tests/helpers/s3proxy.py):
  a typed error on every rank within a bound, nothing visible remotely; once the server answers
  again the next drain completes, bit-exact, and no incomplete upload is left.
"""

from __future__ import annotations

import os
import threading
import time
from urllib.parse import urlsplit

import pytest
import torch

import distckpt
from distckpt.errors import (CheckpointExistsError, ChecksumMismatchError, DistCkptError, EndpointUnreachableError,
                             SaveInProgressError, TierIncompleteError)
from distckpt.storage import open_store
from tests.helpers.distributed import run_ranks
from tests.helpers.s3proxy import FaultProxy

LEASE_S = 5.0
FAULT_BOUND_S = 60.0   # a faulted drain raises on every rank within this (3 s request deadlines, a few requests)


def _state(rank: int) -> dict:
    """Rank ``rank``'s part of the step: 12 MiB of its own (three 5 MiB parts), one tensor every
    rank holds (saved by one writer) and a value."""
    g = torch.Generator().manual_seed(100 + rank)
    return {f"w{rank}": torch.randn(3 << 20, generator=g),
            "shared": torch.arange(1000, dtype=torch.bfloat16), "step": 7}


def _expected(world: int) -> dict:
    out = {}
    for r in range(world):
        out.update(_state(r))
    return out


def _assert_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


def _objects(bucket, prefix: str) -> set[str]:
    """Every object under ``prefix/`` in ``bucket``, from one flat listing (the empty directories
    SeaweedFS keeps after a deletion are no objects)."""
    url = f"{bucket.url}/{prefix}"
    return {f"{prefix}/{k}" for k in open_store(url, bucket.storage_options).objects(url)}


def _drain(local: str, url: str, options: dict, **kw):
    from distckpt._dist import control_group
    from distckpt.tiers.drain import drain_step
    return drain_step(control_group(channel="drain"), local_path=local, remote_path=url, storage_options=options,
                      **kw)


_CLASSES = (ChecksumMismatchError, TierIncompleteError, CheckpointExistsError, EndpointUnreachableError)


def _err(exc: DistCkptError) -> dict:
    """What a test checks of a rank's error (picklable)."""
    return {"type": type(exc).__name__, "message": str(exc), "committed": getattr(exc, "committed", False),
            "causes": sorted({type(e).__name__ for e in (exc.failures or {}).values()}),
            "files": getattr(exc, "files", None), "is": {c.__name__: isinstance(exc, c) for c in _CLASSES}}


def _env(rank_env: dict | None = None) -> None:
    os.environ["DISTCKPT_OBJECT_PART_SIZE"] = "5M"
    os.environ.update(rank_env or {})


# ---------------------------------------------------------------------------------------------


def _save_and_drain_twice(rank, world, local, url, options):
    _env()
    saved = distckpt.save(_state(rank), local)
    sent: list[int] = []
    first = _drain(local, url, options, progress=sent.append)
    second = _drain(local, url, options, progress=sent.append)
    return saved.save_id, first, second, sum(sent)


def test_drain_commits_the_local_step_bit_exact_and_once(s3_bucket, tmp_path):
    local, url = str(tmp_path / "local" / "step_00000001"), f"{s3_bucket.url}/run/step_00000001"
    results = run_ranks(_save_and_drain_twice, 2, local, url, s3_bucket.storage_options)
    save_id = results[0][0]  # rank 0's (a plain save's SaveResult.save_id is only rank 0's own)
    print("drain seconds per rank (first, second):",
          [(round(r[1].seconds, 2), round(r[2].seconds, 2)) for r in results])
    for rank, (_, first, second, sent) in enumerate(results):
        size = os.path.getsize(os.path.join(local, f"rank{rank:05d}.bin"))
        assert first.save_id == save_id and second.save_id == save_id
        assert (first.already_remote, first.bytes_uploaded, first.step_path_remote) == (False, size, url)
        assert (second.already_remote, second.bytes_uploaded) == (True, 0)
        assert sent == size, "progress reports every byte handed to the upload, once"
    with open(os.path.join(local, "MANIFEST"), "rb") as f:
        assert s3_bucket.fs.cat_file(f"{s3_bucket.name}/run/step_00000001/MANIFEST") == f.read()
    _assert_equal(distckpt.read(url, storage_options=s3_bucket.storage_options), _expected(2))
    assert _objects(s3_bucket, "run") == {"run/step_00000001/MANIFEST", f"run/step_00000001/{save_id}/rank00000.bin",
                                          f"run/step_00000001/{save_id}/rank00001.bin"}
    assert s3_bucket.multipart_uploads() == []


# ---------------------------------------------------------------------------------------------


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def _save_damage_and_drain(rank, world, local, url, options, damage):
    _env()
    distckpt.save(_state(rank), local)
    if rank == 0:  # before its first collective of the drain: every rank drains the damaged copy
        if damage == "flip":
            _flip(os.path.join(local, "rank00000.bin"), 5 << 20)  # inside w0, in the middle of a block
        elif damage == "missing":
            os.unlink(os.path.join(local, "rank00001.bin"))
    try:
        _drain(local, url, options)
    except DistCkptError as exc:
        return _err(exc)
    return None


def test_a_flipped_local_byte_fails_every_rank_and_commits_nothing(s3_bucket, tmp_path):
    local, url = str(tmp_path / "local" / "step_00000002"), f"{s3_bucket.url}/run/step_00000002"
    errors = run_ranks(_save_damage_and_drain, 2, local, url, s3_bucket.storage_options, "flip")
    for rank, err in enumerate(errors):
        assert err is not None, f"rank {rank} drained a damaged copy"
        assert err["is"]["ChecksumMismatchError"], err
        assert "rank00000.bin" in err["message"] and not err["committed"], err
    # Rank 1's file was uploaded and stays for the drain's retry, which writes the same keys (a
    # deletion of the area could land late, after the retry committed); no MANIFEST, no upload
    # left, and a reclaim removes the area once no drain holds it.
    left = _objects(s3_bucket, "run")
    assert left and not any(k.endswith("/MANIFEST") for k in left), left
    assert s3_bucket.multipart_uploads() == []
    assert distckpt.CheckpointManager(f"{s3_bucket.url}/run", storage_options=s3_bucket.storage_options).reclaim()
    assert _objects(s3_bucket, "run") == set()


def test_a_missing_local_data_file_is_tier_incomplete(s3_bucket, tmp_path):
    local, url = str(tmp_path / "local" / "step_00000003"), f"{s3_bucket.url}/run/step_00000003"
    errors = run_ranks(_save_damage_and_drain, 2, local, url, s3_bucket.storage_options, "missing")
    for err in errors:
        assert err is not None and err["is"]["TierIncompleteError"], err
        assert err["files"] == ["rank00001.bin"] and "rank00001.bin" in err["message"], err
    assert _objects(s3_bucket, "run") == set()


def test_a_remote_step_of_another_save_is_never_replaced(s3_bucket, tmp_path):
    local, url = str(tmp_path / "local" / "step_00000004"), f"{s3_bucket.url}/run/step_00000004"
    other = {"w": torch.full((100,), 3.0)}
    theirs = distckpt.save(other, url, storage_options=s3_bucket.storage_options, no_dist=True)
    before = _objects(s3_bucket, "run")
    errors = run_ranks(_save_damage_and_drain, 2, local, url, s3_bucket.storage_options, None)
    for err in errors:
        assert err is not None and err["is"]["CheckpointExistsError"], err
        assert theirs.save_id in err["message"], err
    assert _objects(s3_bucket, "run") == before
    _assert_equal(distckpt.read(url, storage_options=s3_bucket.storage_options), other)


# ---------------------------------------------------------------------------------------------


@pytest.fixture
def proxy(s3_server):
    u = urlsplit(s3_server.endpoint)
    px = FaultProxy((u.hostname, u.port))
    yield px
    px.close()


def _save_fault_and_drain_again(rank, world, local, url, via, direct, healed):
    _env({"DISTCKPT_OBJECT_REQUEST_TIMEOUT_S": "3", "DISTCKPT_OBJECT_LEASE_S": str(LEASE_S)})
    distckpt.save(_state(rank), local)
    t0 = time.monotonic()
    try:
        _drain(local, url, via)
        first = None
    except DistCkptError as exc:
        first = _err(exc)
    took = time.monotonic() - t0
    visible = open_store(url, direct).is_committed(url) if rank == 0 else None
    left = [u["Key"] for u in open_store(url, direct).fs.call_s3("list_multipart_uploads", Bucket=urlsplit(url).netloc)
            .get("Uploads", [])] if rank == 0 else None
    with open(healed, "w"):
        pass  # the proxy forwards everything from now on
    # The failed drain's lease may not have been released (its DELETE got no answer): it lapses
    # after LEASE_S. Every rank gets the same SaveInProgressError meanwhile, so all retry together.
    for _ in range(6):
        try:
            return first, took, visible, _drain(local, url, via), left
        except SaveInProgressError:
            time.sleep(LEASE_S / 2)
    raise AssertionError("the drain found the lease held for 15 s after the fault")


@pytest.mark.slow  # ~30 s each: request deadlines of 3 s, a lapsing lease, two drains
@pytest.mark.parametrize("mode", ["stall", "reset"])
def test_a_server_fault_mid_upload_is_typed_in_time_and_the_next_drain_completes(s3_bucket, proxy, tmp_path, mode):
    local, url = str(tmp_path / "local" / "step_00000005"), f"{s3_bucket.url}/run/step_00000005"
    direct = s3_bucket.storage_options
    via = {**direct, "client_kwargs": {**direct["client_kwargs"], "endpoint_url": proxy.endpoint},
           "skip_instance_cache": True}
    healed = str(tmp_path / "healed")
    tripped = threading.Event()

    def rule(i, method, path):
        if os.path.exists(healed):
            return None
        # From the second part of a data object on: the uploads exist on the server and their
        # abort fails too, so the next drain must abort them itself (its area is the same).
        if method == "PUT" and ".bin" in path and "partNumber=2" in path:
            tripped.set()
        return mode if tripped.is_set() else None

    proxy.rule = rule
    results = run_ranks(_save_fault_and_drain_again, 2, local, url, via, direct, healed, timeout=300)
    assert tripped.is_set(), "the drain never reached its upload"
    assert results[0][4], "no upload was left on the server by the faulted drain: nothing tested"
    for rank, (first, took, visible, second, _) in enumerate(results):
        assert first is not None, f"rank {rank}: the drain succeeded through a {mode}"
        assert took < FAULT_BOUND_S, f"rank {rank} took {took:.0f} s to give up"
        assert not first["committed"], first
        if mode == "stall":
            assert "EndpointUnreachableError" in (first["causes"] or [first["type"]]), first
        assert not second.already_remote and second.bytes_uploaded > 0
    assert results[0][2] is False, "a MANIFEST was visible after the failed drain"
    print(f"{mode}: per rank (error, seconds): {[(r[0]['type'], round(r[1], 1)) for r in results]}")
    _assert_equal(distckpt.read(url, storage_options=direct), _expected(2))
    save_id = results[0][3].save_id
    assert _objects(s3_bucket, "run") == {"run/step_00000005/MANIFEST", f"run/step_00000005/{save_id}/rank00000.bin",
                                          f"run/step_00000005/{save_id}/rank00001.bin"}
    assert s3_bucket.multipart_uploads() == []
