"""distckpt on an object store: a real S3 server (SeaweedFS, tests/helpers/s3server.py), real gloo ranks.

Covers: 2-rank save -> 1- and 3-rank load bit-exact (multipart uploads, ranged reads, DTensor
resharding), async save, CheckpointManager rotation and ``latest``, overwrite (old data deleted
only after the new MANIFEST), a MANIFEST naming a missing object, ``distckpt ls/inspect/verify``
on s3:// URLs with only the AWS_* variables, the commit with and without conditional creates
(a lost race is CheckpointExistsError, the winner stays complete), a save lease in flight is
never reclaimed, and a rank SIGKILLed mid-upload (nothing visible, previous checkpoint intact,
leftovers and the incomplete multipart upload removed by the next save).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import distckpt
from distckpt.errors import CheckpointExistsError, CheckpointNotFoundError, DataFileMissingError, SaveInProgressError
from distckpt.storage import open_store
from tests.helpers.distributed import RankError, run_ranks

ROWS, COLS = 2048, 1024  # 8 MiB float32: two 5 MiB parts per rank of two, several in flight
PART_ENV = {"DISTCKPT_OBJECT_PART_SIZE": "5M", "DISTCKPT_TIMEOUT_S": "30"}


def _full() -> dict:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(ROWS, COLS, generator=g),
            "b": torch.randn(9, 33, generator=g).to(torch.bfloat16),
            "ids": torch.arange(1000, dtype=torch.int64)}


def _dtensors(world: int, zero: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    full = _full()
    if zero:
        full = {k: torch.zeros_like(v) for k, v in full.items()}
    return {"w": distribute_tensor(full["w"], mesh, [Shard(0)]),
            "b": distribute_tensor(full["b"], mesh, [Shard(1)]),
            "ids": distribute_tensor(full["ids"], mesh, [Replicate()])}


def _save_body(rank, world, url, options):
    sd = {"model": _dtensors(world, zero=False), "step": 100, "name": "run7"}
    r = distckpt.save(sd, url + "/step_sync", storage_options=options)
    h = distckpt.async_save(sd, url + "/step_async", storage_options=options)
    a = h.result(timeout=120)
    return r.bytes_per_rank, r.backend, a.path


def _load_body(rank, world, url, options):
    sd = {"model": _dtensors(world, zero=True), "step": 0, "name": ""}
    res = distckpt.load(sd, url, storage_options=options)
    full = _full()
    for k, t in sd["model"].items():
        assert torch.equal(t.full_tensor(), full[k]), k
    assert sd["step"] == 100 and sd["name"] == "run7"
    need = sum(t.to_local().numel() * t.to_local().element_size() for t in sd["model"].values())
    # Read itself, or (read-once, on by default for an object store) received from the rank that
    # read the replicated "ids" for the others too.
    return res.bytes_read + res.bytes_from_peers, need


def test_two_ranks_save_one_and_three_load(s3_bucket):
    url = s3_bucket.url + "/run"
    opts = s3_bucket.storage_options
    sizes, backend, async_path = run_ranks(_save_body, 2, url, opts, env=PART_ENV)[0]
    assert backend == "fsspec:s3" and async_path == url + "/step_async"
    assert sizes[0] >= ROWS * COLS * 2 and sizes[1] >= ROWS * COLS * 2
    keys = s3_bucket.keys("run")
    man = distckpt.read_manifest(url + "/step_sync", storage_options=opts)
    assert sorted(keys) == sorted(
        [f"run/step_sync/MANIFEST", f"run/step_async/MANIFEST"]
        + [f"run/step_sync/{man['save_id']}/rank0000{r}.bin" for r in range(2)]
        + [f"run/step_async/{distckpt.read_manifest(url + '/step_async', storage_options=opts)['save_id']}"
           f"/rank0000{r}.bin" for r in range(2)])
    assert s3_bucket.multipart_uploads() == []
    # 1 rank: read() of everything, bit-exact.
    for step in ("step_sync", "step_async"):
        out = distckpt.read(url + "/" + step, storage_options=opts)
        for k, v in _full().items():
            assert torch.equal(out["model"][k], v), (step, k)
        assert out["step"] == 100 and out["name"] == "run7"
    # 3 ranks: each reads only the ranges its shards need (ranged GETs).
    for read, need in run_ranks(_load_body, 3, url + "/step_sync", opts, env=PART_ENV):
        assert need <= read <= need * 1.1 + (1 << 20), (read, need)


def test_manager_rotation_async_and_overwrite(s3_bucket):
    opts = s3_bucket.storage_options
    root = s3_bucket.url + "/mgr"
    with distckpt.CheckpointManager(root, keep_last=2, storage_options=opts) as m:
        for step in (1, 2, 3):
            m.save(step, {"w": torch.full((3000,), float(step)), "step": step})
        # Leftovers of a crashed save in step 3 (an object and an unfinished multipart upload):
        # the manager's next save removes them, and only them.
        dead = "f" * 32
        s3_bucket.fs.pipe_file(f"{s3_bucket.name}/mgr/step_00000003/{dead}/rank00000.bin", b"x" * 100)
        s3_bucket.fs.call_s3("create_multipart_upload", Bucket=s3_bucket.name,
                             Key=f"mgr/step_00000003/{dead}/rank00001.bin")
        # A step whose save crashed before any object completed: only an incomplete upload,
        # no object (an outside trial's killed server left this, and no later save removed it)
        up = s3_bucket.fs.call_s3("create_multipart_upload", Bucket=s3_bucket.name,
                                  Key=f"mgr/step_00000009/{dead}/rank00000.bin")
        s3_bucket.fs.call_s3("upload_part", Bucket=s3_bucket.name, Key=f"mgr/step_00000009/{dead}/rank00000.bin",
                             UploadId=up["UploadId"], PartNumber=1, Body=b"y" * 1000)
        h = m.save(4, {"w": torch.full((3000,), 4.0), "step": 4}, blocking=False)
        h.result(timeout=60)
        assert not any(dead in k for k in s3_bucket.keys("mgr")) and s3_bucket.multipart_uploads() == []
        assert m.steps() == [3, 4] and m.latest_step() == 4
        t = {"w": torch.zeros(3000), "step": 0}
        m.load(t)
        assert t["step"] == 4 and torch.equal(t["w"], torch.full((3000,), 4.0))
    assert s3_bucket.fs.cat_file(f"{s3_bucket.name}/mgr/latest") == b"step_00000004\n"
    assert {k.split("/")[1] for k in s3_bucket.keys("mgr") if k != "mgr/latest"} == {"step_00000003", "step_00000004"}
    # Overwrite: the new data under a new save id, then the MANIFEST, then the old data deleted.
    path = root + "/step_00000004"
    old_id = distckpt.read_manifest(path, storage_options=opts)["save_id"]
    with pytest.raises(CheckpointExistsError):
        distckpt.save({"w": torch.ones(3)}, path, storage_options=opts)
    distckpt.save({"w": torch.full((5,), 9.0)}, path, storage_options=opts, overwrite=True)
    new_id = distckpt.read_manifest(path, storage_options=opts)["save_id"]
    assert new_id != old_id
    assert set(s3_bucket.keys("mgr/step_00000004")) == {"mgr/step_00000004/MANIFEST",
                                                        f"mgr/step_00000004/{new_id}/rank00000.bin"}
    assert torch.equal(distckpt.read(path, storage_options=opts)["w"], torch.full((5,), 9.0))
    # The root itself is no checkpoint: said as of a local root (it said "objects but no
    # MANIFEST: a save in progress, or one that crashed; never loadable").
    with pytest.raises(CheckpointNotFoundError) as root_read:
        distckpt.read(root, storage_options=opts)
    assert root_read.value.details.get("found") == "manager root" and "step_00000004" in str(root_read.value)


def test_damaged_index_object_is_named_by_load_and_verify(s3_bucket):
    """Format 3 on S3: a data object whose index (its last bytes) was altered is refused when the
    checkpoint is opened (ChecksumMismatchError naming the object), before any tensor is filled;
    verify reports it as a file problem."""
    from distckpt.errors import ChecksumMismatchError
    from distckpt.verify import verify
    opts = s3_bucket.storage_options
    url = s3_bucket.url + "/idx/step_00000001"
    sd = {"w": torch.arange(50000, dtype=torch.float32), "b": torch.ones(7)}
    distckpt.save(sd, url, storage_options=opts)
    man = distckpt.read_manifest(url, storage_options=opts)
    key = f"{s3_bucket.name}/idx/step_00000001/{man['save_id']}/rank00000.bin"
    data = bytearray(s3_bucket.fs.cat_file(key))
    off, length, _ = man["files"][0]["index"]
    assert off + length == len(data)
    data[off + length // 2] ^= 0x04
    s3_bucket.fs.pipe_file(key, bytes(data))
    into = {"w": torch.zeros(50000), "b": torch.zeros(7)}
    with pytest.raises(ChecksumMismatchError) as ei:
        distckpt.load(into, url, storage_options=opts)
    assert "index of rank00000.bin" in ei.value.message and not into["w"].any()
    report = verify(url, storage_options=opts)
    assert not report.ok and [p.file for p in report.file_problems] == ["rank00000.bin"]
    assert "index is damaged" in report.file_problems[0].problem


def test_missing_object_is_typed_and_cli_uses_aws_env(s3_bucket, tmp_path):
    opts = s3_bucket.storage_options
    url = s3_bucket.url + "/cli/step_00000001"
    distckpt.save({"w": torch.arange(50000, dtype=torch.float32), "note": "hi"}, url, storage_options=opts)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(s3_bucket.env)  # no storage_options anywhere: the standard AWS variables only
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "distckpt", *args], env=env, capture_output=True, text=True,
                              timeout=120)

    ls = cli("ls", "--json", s3_bucket.url + "/cli")
    assert ls.returncode == 0, ls.stderr
    listing = json.loads(ls.stdout)
    assert [e["step"] for e in listing["entries"]] == [1] and listing["latest"] == 1
    ins = cli("inspect", "--json", url)
    assert ins.returncode == 0, ins.stderr
    assert json.loads(ins.stdout)["tensors"]["w"]["shape"] == [50000]
    ok = cli("verify", url)
    assert ok.returncode == 0 and "OK" in ok.stdout, ok.stdout + ok.stderr
    # The data object named by MANIFEST is gone: load raises DataFileMissingError, verify says so.
    save_id = distckpt.read_manifest(url, storage_options=opts)["save_id"]
    s3_bucket.fs.rm_file(f"{s3_bucket.name}/cli/step_00000001/{save_id}/rank00000.bin")
    with pytest.raises(DataFileMissingError) as info:
        distckpt.load({"w": torch.zeros(50000)}, url, storage_options=opts)
    assert "rank00000.bin" in str(info.value)
    bad = cli("verify", url)
    assert bad.returncode == 1 and "missing" in bad.stdout, bad.stdout + bad.stderr


@pytest.mark.parametrize("conditional", ["server", "readback"])
def test_commit_race_loser_gets_exists_error(s3_bucket, request, monkeypatch, conditional):
    """Two saves commit one path at once: the one that loses gets CheckpointExistsError, and the
    MANIFEST there names the winner's complete data. "server": SeaweedFS refuses the loser's
    If-None-Match create; "readback": a server that ignores the header, where the HEAD check
    and the read-back must catch it."""
    if conditional == "readback":
        request.getfixturevalue("s3_ignore_conditional")
        monkeypatch.setenv("DISTCKPT_OBJECT_CONDITIONAL", "0")
    opts = s3_bucket.storage_options
    url = s3_bucket.url + "/race/step_00000001"
    store = open_store(url, opts)
    winner = {"w": torch.full((4000,), 1.0)}
    real_pipe = store.fs._pipe_file  # the coroutine every object-store request of distckpt runs
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    # The other job runs inside our MANIFEST request: give that request and our lease room for it.
    monkeypatch.setenv("DISTCKPT_OBJECT_REQUEST_TIMEOUT_S", "600")
    monkeypatch.setenv("DISTCKPT_OBJECT_LEASE_S", "900")

    def other_job(overwrite: bool) -> None:
        # Another job (its own process, its own lease: a manager's root lock) saves the same path.
        code = ("import sys, torch; from distckpt.save_sync import save_in_root; "
                "save_in_root({'w': torch.full((4000,), 1.0)}, sys.argv[1], "
                "storage_options=eval(sys.argv[2]), overwrite=sys.argv[3] == '1', lock_path=sys.argv[4])")
        subprocess.run([sys.executable, "-c", code, url, repr(opts), "1" if overwrite else "0",
                        s3_bucket.url + "/race/.distckpt.lock"], env=env, check=True, timeout=120)

    async def racing_pipe(path, data, *args, **kwargs):
        # The other save's MANIFEST lands right before (server) or right after (readback) ours.
        if path.endswith("/MANIFEST") and not racing_pipe.done:
            racing_pipe.done = True
            if conditional == "server":
                await asyncio.to_thread(other_job, False)
                return await real_pipe(path, data, *args, **kwargs)
            out = await real_pipe(path, data, *args, **kwargs)
            await asyncio.to_thread(other_job, True)
            return out
        return await real_pipe(path, data, *args, **kwargs)

    racing_pipe.done = False
    monkeypatch.setattr(store.fs, "_pipe_file", racing_pipe)
    with pytest.raises(CheckpointExistsError):
        distckpt.save({"w": torch.full((4000,), 2.0)}, url, storage_options=opts)
    monkeypatch.undo()
    assert torch.equal(distckpt.read(url, storage_options=opts)["w"], winner["w"])
    save_id = distckpt.read_manifest(url, storage_options=opts)["save_id"]
    # The loser's data was deleted (abort); only the winner's objects remain.
    assert set(s3_bucket.keys("race")) == {"race/step_00000001/MANIFEST",
                                           f"race/step_00000001/{save_id}/rank00000.bin"}


@pytest.mark.parametrize("skew", [0, 1800])
def test_live_lease_blocks_and_is_never_reclaimed(s3_bucket, monkeypatch, skew):
    """A live save's lease blocks another save and keeps its data from any reclaim, also for a
    host whose clock runs 30 minutes ahead of the writer's (``skew``): the lease's age is read by
    the server's clock. Before, that host judged the live lease lapsed, took it over and
    reclaimed the running save's data."""
    import time
    import types

    from distckpt.storage.object import lease as lease_module
    from distckpt.storage.object import store as store_module
    from distckpt.storage.object.lease import Lease
    opts = s3_bucket.storage_options
    url = s3_bucket.url + "/lease/step_00000001"
    store = open_store(url, opts)
    lease = Lease.acquire(store, url + "/.lock", save_id="a" * 32, what=url, rank=0)
    try:
        s3_bucket.fs.pipe_file(f"{s3_bucket.name}/lease/step_00000001/{'a' * 32}/rank00000.bin", b"x" * 10)
        ahead = types.SimpleNamespace(monotonic=time.monotonic, sleep=time.sleep, perf_counter=time.perf_counter,
                                      time=lambda: time.time() + skew)
        monkeypatch.setattr(lease_module, "time", ahead)
        monkeypatch.setattr(store_module, "time", ahead)
        with pytest.raises(SaveInProgressError):
            distckpt.save({"w": torch.ones(3)}, url, storage_options=opts)
        assert store.reclaim_checkpoint(url) == []
        assert f"lease/step_00000001/{'a' * 32}/rank00000.bin" in s3_bucket.keys("lease")
        monkeypatch.setattr(lease_module, "time", time)
        monkeypatch.setattr(store_module, "time", time)
    finally:
        lease.release()
    distckpt.save({"w": torch.ones(3)}, url, storage_options=opts)  # the lease is gone: its data is dead
    assert f"lease/step_00000001/{'a' * 32}/rank00000.bin" not in s3_bucket.keys("lease")


def _killed_body(rank, world, url, options, marker):
    sd = {f"w{rank}": torch.full((ROWS, COLS), float(rank + 1))}  # per-rank keys: 8 MiB each
    if rank == 1:
        from distckpt.storage.object import store as objectstore

        real = objectstore._Upload._flush_part

        def flush_then_die(self):
            real(self)  # the first part is in flight, the upload is open: die now
            os.kill(os.getpid(), signal.SIGKILL)

        objectstore._Upload._flush_part = flush_then_die
    try:
        distckpt.save(sd, url, storage_options=options, overwrite=True)
    except Exception as exc:  # rank 0: the peer is gone; nothing may be committed
        with open(marker, "w") as f:
            f.write(type(exc).__name__)
        return type(exc).__name__
    return "saved"


def test_rank_killed_mid_upload(s3_bucket, tmp_path):
    opts = s3_bucket.storage_options
    url = s3_bucket.url + "/kill/step_00000001"
    before = {"w": torch.arange(1000, dtype=torch.float32)}
    distckpt.save(before, url, storage_options=opts)
    old_id = distckpt.read_manifest(url, storage_options=opts)["save_id"]
    marker = str(tmp_path / "rank0.txt")
    with pytest.raises(RankError) as info:
        run_ranks(_killed_body, 2, url, opts, marker, env=PART_ENV, timeout=150)
    assert set(info.value.errors) == {1} and "-9" in info.value.errors[1][1]
    assert open(marker).read() == "PeerLostError"
    # Nothing visible: the MANIFEST is the previous save's, which loads bit-exact.
    assert distckpt.read_manifest(url, storage_options=opts)["save_id"] == old_id
    assert torch.equal(distckpt.read(url, storage_options=opts)["w"], before["w"])
    # Leftovers: the crashed save's prefix and rank 1's unfinished multipart upload.
    store = open_store(url, opts)
    dead = store.leftovers(url)
    assert dead and all(state == "dead" for _, state in dead)
    assert any("rank00001.bin" in u["Key"] for u in s3_bucket.multipart_uploads())
    # The next save removes them (and aborts the upload), and commits.
    distckpt.save({"w": torch.ones(10)}, url, storage_options=opts, overwrite=True)
    new_id = distckpt.read_manifest(url, storage_options=opts)["save_id"]
    assert set(s3_bucket.keys("kill")) == {"kill/step_00000001/MANIFEST",
                                           f"kill/step_00000001/{new_id}/rank00000.bin"}
    assert s3_bucket.multipart_uploads() == []


def test_missing_bucket_and_bad_credentials_are_typed(s3_bucket):
    from distckpt.errors import BucketNotFoundError, ObjectStoreAccessError
    server = s3_bucket.server
    gone = "s3://no-such-bucket-" + s3_bucket.name[2:] + "/run/step_00000001"
    bad = dict(server.storage_options(), secret="wrong")
    url = s3_bucket.url + "/creds/step_00000001"
    for call in (lambda o, u: distckpt.save({"w": torch.ones(3)}, u, storage_options=o),
                 lambda o, u: distckpt.load({"w": torch.ones(3)}, u, storage_options=o),
                 lambda o, u: distckpt.CheckpointManager(u.rsplit("/", 1)[0], storage_options=o).steps()):
        with pytest.raises(BucketNotFoundError):
            call(s3_bucket.storage_options, gone)
        with pytest.raises(ObjectStoreAccessError):
            call(bad, url)
    assert s3_bucket.keys() == []


def test_overwritten_while_loading_is_checkpoint_removed(s3_bucket, monkeypatch):
    from distckpt.errors import CheckpointRemovedError
    from distckpt.storage.object.store import ObjectStore
    opts = s3_bucket.storage_options
    url = s3_bucket.url + "/ow/step_00000001"
    distckpt.save({"w": torch.ones(1000)}, url, storage_options=opts)
    real = ObjectStore.data_readers

    def overwrite_first(self, *args, **kwargs):
        # Between this load's MANIFEST read and its data reads, another save replaces the step.
        monkeypatch.setattr(ObjectStore, "data_readers", real)
        distckpt.save({"w": torch.full((1000,), 2.0)}, url, storage_options=opts, overwrite=True)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ObjectStore, "data_readers", overwrite_first)
    target = {"w": torch.zeros(1000)}
    with pytest.raises(CheckpointRemovedError):
        distckpt.load(target, url, storage_options=opts)
    assert torch.equal(target["w"], torch.zeros(1000))  # untouched: no byte of either save landed
    distckpt.load(target, url, storage_options=opts)
    assert torch.equal(target["w"], torch.full((1000,), 2.0))


def test_file_url_is_the_local_fast_path(tmp_path):
    from distckpt.errors import ConfigError
    sd = {"w": torch.arange(5000, dtype=torch.float32)}
    res = distckpt.save(sd, f"file://{tmp_path}/step_00000001")
    assert res.path == str(tmp_path / "step_00000001") and not res.backend.startswith("fsspec")
    assert (tmp_path / "step_00000001" / "MANIFEST").is_file()
    assert torch.equal(distckpt.read(str(tmp_path / "step_00000001"))["w"], sd["w"])
    with pytest.raises(ConfigError):  # fsspec options make no sense for a local path: said, not ignored
        distckpt.save(sd, str(tmp_path / "step_00000002"), storage_options={"key": "k"})
    assert not (tmp_path / "step_00000002").exists()


def test_a_rotation_whose_lease_was_taken_over_deletes_nothing(s3_bucket, monkeypatch):
    """A manager save frozen between its commit and its rotation past its lease (a stopped
    process, a paused VM) resumed its rotation after another job had broken the lease and taken
    the root over, and deleted that job's steps (an outside trial: every step gone). Each deletion
    and the `latest` write now first prove the lease (one conditional renewal): the takeover is
    SaveInProgressError (the step it saved stays committed) and nothing of the root is deleted."""
    from distckpt.storage.object.lease import Lease

    opts = s3_bucket.storage_options
    root = s3_bucket.url + "/mgr"
    m = distckpt.CheckpointManager(root, keep_last=1, storage_options=opts)
    for step in (1, 2):
        m.save(step, {"w": torch.full((300,), float(step))})
    reader = m._commit_time_reader

    def taken_over_meanwhile():
        # Another job's save breaks the lease (If-Match on the ETag it read) while this save waits.
        store = open_store(root, opts)
        url = root + "/.distckpt.lock"
        record, etag = Lease.read_versioned(store, url)
        Lease._put(store, url, {**record, "save_id": "f" * 32, "pid": 1, "renewed_unix": record["renewed_unix"] + 1},
                   match=etag, operation="take over", rank=0)
        return reader()

    monkeypatch.setattr(m, "_commit_time_reader", taken_over_meanwhile)
    with pytest.raises(SaveInProgressError) as info:
        m.save(3, {"w": torch.full((300,), 3.0)})
    assert info.value.committed is True, info.value
    monkeypatch.undo()
    assert sorted({k.split("/")[1] for k in s3_bucket.keys("mgr") if k.startswith("mgr/step_")}) == [
        "step_00000002", "step_00000003"]  # keep_last=1 would have deleted 2
    assert torch.equal(distckpt.read(root + "/step_00000002", storage_options=opts)["w"], torch.full((300,), 2.0))


def test_removing_a_checkpoint_deletes_its_own_save_and_only_an_unchanged_manifest(s3_bucket, monkeypatch):
    """remove_checkpoint deleted the MANIFEST unconditionally and then every object under the
    step: a remover that woke after another job had saved the step again deleted that save's
    data under its committed MANIFEST (a checkpoint that looks complete and does not load). Now
    it deletes the MANIFEST it read (If-Match on its ETag) and that save's data prefix only."""
    opts = s3_bucket.storage_options
    path = s3_bucket.url + "/ck"
    distckpt.save({"w": torch.full((300,), 1.0)}, path, storage_options=opts)
    first = distckpt.read_manifest(path, storage_options=opts)["save_id"]
    other = "e" * 32  # another save's data in flight under the same step
    s3_bucket.fs.pipe_file(f"{s3_bucket.name}/ck/{other}/rank00000.bin", b"x" * 100)
    store = open_store(path, opts)
    # The MANIFEST changed between the remover's read and its DELETE: nothing is deleted.
    stale = store._get_with_etag
    monkeypatch.setattr(store, "_get_with_etag", lambda url, limit, **kw: (stale(url, limit, **kw)[0], '"0000"',
                                                                            None, None))
    store.remove_checkpoint(path)
    assert distckpt.read_manifest(path, storage_options=opts)["save_id"] == first
    monkeypatch.undo()
    store.remove_checkpoint(path)
    assert set(s3_bucket.keys("ck")) == {f"ck/{other}/rank00000.bin"}, s3_bucket.keys("ck")
