"""Object-store saves under network faults, against the real test server behind a fault proxy.

tests/helpers/s3proxy.py sits between s3fs and SeaweedFS and can stall a request (sent, never answered,
the connection left open and silent), reset it, let the server act and then lose the answer (by a
reset, or by silence), or delay it. What is held here:

* every request of a save, faulted in turn: the save returns (the checkpoint is then the new one,
  bit-exact) or raises a typed DistCkptError within a bound; the checkpoint it overwrote is still
  there, bit-exact, unless the new one committed (and then the error says the outcome may be
  committed); the next save of the path succeeds and leaves no leftover;
* a silent endpoint mid-save gives every rank of a 2-rank job a typed error within a bound;
* the lease races: two savers breaking one dead lease (exactly one wins), a stalled holder whose
  late renewal lands after another save took over (it never overwrites the new lease), a
  heartbeat that stops renewing while a request is stuck past its deadline;
* a MANIFEST that landed while its answer was lost and the endpoint then went silent: the save
  says the outcome is unknown and its data is kept, so the committed checkpoint is complete;
* a MANIFEST request that lands after its client gave up (the proxy holds it whole and forwards
  it late): a late overwrite never replaces a newer commit, a late create finds its data.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from urllib.parse import urlsplit

import pytest
import torch

import distckpt
from distckpt.errors import DistCkptError, EndpointUnreachableError, SaveInProgressError
from distckpt.storage import open_store
from tests.helpers.distributed import run_ranks
from tests.helpers.s3proxy import FaultProxy

MODES = ["stall", "reset", "lose_answer", "act_then_stall"]
REQUEST_TIMEOUT_S = 0.5     # distckpt's request deadline in the faulted saves (its lowest allowed value: each
                            # stalled request costs it; a local request answers in milliseconds). The
                            # restoring saves use the default
LEASE_S = 5.0
BOUND_S = 45.0              # a faulted save returns or raises within this (deadlines + retries + load)


@pytest.fixture
def proxy(s3_server):
    u = urlsplit(s3_server.endpoint)
    px = FaultProxy((u.hostname, u.port))
    yield px
    px.close()


def _proxied(options: dict, proxy: FaultProxy) -> dict:
    opts = json.loads(json.dumps(options))
    opts["client_kwargs"]["endpoint_url"] = proxy.endpoint
    opts["skip_instance_cache"] = True  # its own client: the proxy's faults never reach the direct one
    return opts


def _state(v: float) -> dict:
    # 8 MiB + a small tensor: with 5 MiB parts, the big one is a multipart upload of two parts.
    return {"w": torch.arange(2 << 20, dtype=torch.float32) + v, "b": torch.full((100,), v), "step": int(v)}


def _equal(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and all(torch.equal(a[k], b[k]) for k in ("w", "b"))


def _save_retrying_lease(state, url, opts):
    """The next save of a path: a lease left by a save whose release was faulted lapses within
    LEASE_S; retried until then (never later than LEASE_S + 1 s after the first try)."""
    give_up = time.monotonic() + LEASE_S + 1
    while True:
        try:
            return distckpt.save(state, url, storage_options=opts, overwrite=True, no_dist=True)
        except SaveInProgressError:
            if time.monotonic() > give_up:
                raise
            time.sleep(0.5)  # retried as soon as the lease lapses (within LEASE_S of its last renewal)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_fault_at_every_request_of_an_overwriting_save(s3_bucket, proxy, monkeypatch, mode):
    monkeypatch.setenv("DISTCKPT_OBJECT_LEASE_S", str(LEASE_S))
    # A save whose MANIFEST request was faulted keeps its data while that request could land
    # (test_a_late_* below); here the next save must find no leftover at all.
    monkeypatch.setenv("DISTCKPT_OBJECT_LATE_S", "0")
    monkeypatch.setenv("DISTCKPT_OBJECT_PART_SIZE", "5M")
    if mode != "stall":  # the pre-flight's requests (a listing, a probe object) are swept once, with stalls
        monkeypatch.setenv("DISTCKPT_PREFLIGHT", "0")
    direct = s3_bucket.storage_options
    via = _proxied(direct, proxy)
    url = f"{s3_bucket.url}/ckpt"
    old, new = _state(1.0), _state(2.0)
    distckpt.save(old, url, storage_options=direct, no_dist=True)
    # The clean run: how many requests an overwriting save makes.
    proxy.reset_log()
    distckpt.save(new, url, storage_options=via, overwrite=True, no_dist=True)
    n = len(proxy.log)
    assert n >= 15, proxy.log
    distckpt.save(old, url, storage_options=direct, overwrite=True, no_dist=True)

    seen = []
    for k in range(n):
        proxy.reset_log()
        proxy.rule = lambda i, method, path, k=k: mode if i == k else None
        monkeypatch.setenv("DISTCKPT_OBJECT_REQUEST_TIMEOUT_S", str(REQUEST_TIMEOUT_S))
        t0 = time.monotonic()
        err = None
        try:
            distckpt.save(new, url, storage_options=via, overwrite=True, no_dist=True)
        except Exception as exc:  # noqa: BLE001 - checked below
            err = exc
        took = time.monotonic() - t0
        proxy.rule = lambda i, method, path: None
        monkeypatch.delenv("DISTCKPT_OBJECT_REQUEST_TIMEOUT_S")
        hit = proxy.log[k] if k < len(proxy.log) else None
        seen.append((k, hit, type(err).__name__ if err else "saved"))
        where = f"fault {mode} at request {k} {hit}"
        assert took < BOUND_S, f"{where}: the save took {took:.0f} s"
        try:
            loaded = distckpt.read(url, storage_options=direct)
        except DistCkptError as exc:
            pytest.fail(f"{where}: the checkpoint does not load ({exc}); the save said {err!r}; requests {proxy.log}")
        if err is None:
            assert _equal(loaded, new), f"{where}: save returned but the checkpoint is not the new one"
        else:
            assert isinstance(err, DistCkptError), f"{where}: untyped {type(err).__name__}: {err}"
            if _equal(loaded, new):
                assert getattr(err, "committed", False) is not False, (
                    f"{where}: the new checkpoint committed but the error says nothing was: {err}")
            else:
                assert _equal(loaded, old), f"{where}: the previous checkpoint was damaged ({err})"
        # The next save of the path works and leaves nothing behind.
        res = _save_retrying_lease(old, url, direct)
        assert _equal(distckpt.read(url, storage_options=direct), old)
        keys = set(s3_bucket.keys("ckpt"))
        assert keys == {"ckpt/MANIFEST", f"ckpt/{res.save_id}/rank00000.bin"}, f"{where}: leftovers {keys}"
        assert not [u for u in s3_bucket.multipart_uploads() if u["Key"].startswith("ckpt/")], where
    print(f"{mode}: {len(seen)} requests faulted: {seen}")


def _save_through_silence(rank, world, url, options, flag):
    """One rank of a 2-rank save whose endpoint goes silent mid-save (tests' proxy)."""
    # 3 s: the requests before the silence must not meet their deadline on a loaded machine
    os.environ["DISTCKPT_OBJECT_REQUEST_TIMEOUT_S"] = "3"
    os.environ["DISTCKPT_OBJECT_LEASE_S"] = str(LEASE_S)
    state = {f"w{rank}": torch.full((1 << 20,), float(rank))}
    t0 = time.monotonic()
    try:
        distckpt.save(state, url, storage_options=options)
        return ("saved", "", time.monotonic() - t0, [])
    except DistCkptError as exc:
        causes = sorted({type(e).__name__ for e in (getattr(exc, "failures", None) or {}).values()})
        return (type(exc).__name__, str(exc), time.monotonic() - t0, causes)
    except Exception as exc:  # noqa: BLE001 - reported as untyped
        return ("untyped " + type(exc).__name__, str(exc), time.monotonic() - t0, [])


def test_silent_endpoint_mid_save_every_rank_typed_in_time(s3_bucket, proxy):
    """The endpoint goes silent (requests sent, never answered, connections open) once the first
    data object is being written: both ranks raise a typed error within a bound instead of hanging
    forever; nothing is committed; once the endpoint answers again, the next save of the path works."""
    url = f"{s3_bucket.url}/silent/step_00000001"
    via = _proxied(s3_bucket.storage_options, proxy)
    silent = threading.Event()

    def rule(i, method, path):
        if method == "PUT" and ".bin" in path:
            silent.set()
        return "stall" if silent.is_set() else None

    proxy.rule = rule
    results = run_ranks(_save_through_silence, 2, url, via, None, timeout=240)
    assert silent.is_set(), "the save never reached its data upload"
    print("silent endpoint, per rank (error, seconds):", [(r[0], round(r[2], 1)) for r in results])
    for rank, (kind, text, seconds, causes) in enumerate(results):
        assert kind not in ("saved",) and not kind.startswith("untyped"), f"rank {rank}: {kind}: {text}"
        assert seconds < 90, f"rank {rank} took {seconds:.0f} s to give up"
        assert "EndpointUnreachableError" in (causes or [kind]), f"rank {rank}: {kind} {causes}: {text}"
    proxy.rule = lambda i, method, path: None
    assert not s3_bucket.fs.exists(f"{s3_bucket.name}/silent/step_00000001/MANIFEST")
    _save_retrying_lease({"w": torch.ones(10)}, url, s3_bucket.storage_options)
    assert torch.equal(distckpt.read(url, storage_options=s3_bucket.storage_options)["w"], torch.ones(10))


def _dead_lease(s3_bucket, key: str) -> str:
    url = f"{s3_bucket.url}/{key}"
    dead = {"host": "gone", "pid": 1, "save_id": "d" * 32, "what": url, "started_unix": 0.0, "renewed_unix": 0.0,
            "lease_s": 30.0, "beat": 0}
    s3_bucket.fs.pipe_file(f"{s3_bucket.name}/{key}", json.dumps(dead).encode())
    return url


def test_breakers_of_one_dead_lease_exactly_one_wins(s3_bucket):
    """Savers that find the same dead lease together: exactly one takes it (and the lease object
    names it); every other one gets SaveInProgressError. Before leases were taken over with a
    conditional overwrite, a breaker could delete another's fresh lease, and two believed they
    held it."""
    from distckpt.storage.object.lease import Lease

    for round_ in range(3):
        url = _dead_lease(s3_bucket, f"race{round_}/.lock")
        n = 6
        stores = [open_store(f"{s3_bucket.url}/race{round_}", {**s3_bucket.storage_options,
                                                             "skip_instance_cache": True}) for _ in range(n)]
        barrier = threading.Barrier(n)
        won, refused, other = [], [], []

        def contend(i):
            barrier.wait()
            try:
                won.append(Lease.acquire(stores[i], url, save_id=f"{i:032x}", what=url, rank=0))
            except SaveInProgressError:
                refused.append(i)
            except Exception as exc:  # noqa: BLE001 - reported below
                other.append(exc)

        threads = [threading.Thread(target=contend, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        try:
            assert not other, other
            assert len(won) == 1, f"round {round_}: {len(won)} savers believe they hold the lease"
            assert len(refused) == n - 1
            assert Lease.read(stores[0], url)["save_id"] == won[0].record["save_id"]
        finally:
            for lease in won:
                lease.release()


def test_stalled_holder_never_overwrites_the_lease_of_the_save_that_took_over(s3_bucket, proxy, monkeypatch):
    """A's renewals are held up in the network past its lease time; B finds the lease dead and
    takes it; then A's late renewals land. They must not replace B's lease (a plain PUT did), A
    learns it lost the lease, and A's release leaves B's lease alone."""
    from distckpt.storage.object.lease import Lease

    monkeypatch.setenv("DISTCKPT_OBJECT_LEASE_S", "1")
    url = f"{s3_bucket.url}/stall/.lock"
    a_store = open_store(f"{s3_bucket.url}/stall", _proxied(s3_bucket.storage_options, proxy))
    b_store = open_store(f"{s3_bucket.url}/stall", {**s3_bucket.storage_options, "skip_instance_cache": True})
    a = Lease.acquire(a_store, url, save_id="a" * 32, what=url, rank=0)
    # From now on every write of the lease by A reaches the server 2 s late (after A gave up on it).
    proxy.rule = lambda i, method, path: ("delay", 2.0) if method == "PUT" and path.endswith("/.lock") else None
    time.sleep(1.5)  # A's lease lapses (its renewals are stuck in the network)
    deadline = time.monotonic() + 20
    while True:
        try:
            b = Lease.acquire(b_store, url, save_id="b" * 32, what=url, rank=0)
            break
        except SaveInProgressError:
            # A renewal of A that the network held has just landed (on a loaded machine B looks
            # later): live by the server's clock for one more lease, then B finds it lapsed.
            assert time.monotonic() < deadline, "A's lease never lapsed"
            time.sleep(0.2)
    b._stop.set()  # B's own renewals would write over a damage: leave the lease as B took it
    b._thread.join()
    try:
        time.sleep(3.0)  # A's delayed renewals land now
        assert Lease.read(b_store, url)["save_id"] == "b" * 32, "a late renewal of A replaced B's lease"
        proxy.rule = lambda i, method, path: None
        deadline = time.monotonic() + 30
        while a.lost is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert a.lost is not None and a.lost.get("save_id") == "b" * 32
        a.release()
        assert Lease.read(b_store, url)["save_id"] == "b" * 32, "A's release deleted B's lease"
        with pytest.raises(SaveInProgressError):
            a.ensure_held()
    finally:
        proxy.rule = lambda i, method, path: None
        a.release()
        b.release()
    assert Lease.read(b_store, url) is None


def test_heartbeat_stops_renewing_while_a_request_is_stuck(s3_bucket, monkeypatch):
    """A save with a request stuck past its deadline (its cancellation did not take) must let its
    lease lapse: the heartbeat skips the renewal instead of keeping the root locked."""
    from distckpt.storage.object import request as objrequest
    from distckpt.storage.object.lease import Lease

    monkeypatch.setenv("DISTCKPT_OBJECT_LEASE_S", "1")
    url = f"{s3_bucket.url}/stuck/.lock"
    store = open_store(f"{s3_bucket.url}/stuck", s3_bucket.storage_options)
    lease = Lease.acquire(store, url, save_id="c" * 32, what=url, rank=0)
    try:
        assert lease.renew() is True
        with objrequest._in_flight_lock:
            objrequest._in_flight[-1] = time.monotonic() - 1.0  # a request 1 s past its deadline + grace
        try:
            time.sleep(0.5)  # a renewal that was already past its check lands first
            beat = Lease.read(store, url)["beat"]
            assert lease.renew() is False
            time.sleep(1.5)  # the heartbeat's own beats are skipped too
            rec = Lease.read(store, url)
            assert rec["beat"] == beat and not Lease.is_live(rec)
            other = Lease.acquire(store, url, save_id="e" * 32, what=url, rank=0)  # the root is free again
            other.release()
        finally:
            with objrequest._in_flight_lock:
                objrequest._in_flight.pop(-1, None)
    finally:
        lease.release()


def test_manifest_landed_answer_lost_endpoint_silent_keeps_the_data(s3_bucket, proxy, monkeypatch):
    """The MANIFEST's PUT reaches the server and lands, its answer never comes back, and the
    endpoint then goes silent, so the save cannot read back what happened. The save must raise a
    typed error saying the outcome is unknown and must not delete its data: once the endpoint is
    back, the committed checkpoint loads bit-exact (deleting the data would leave a committed
    MANIFEST without its data)."""
    monkeypatch.setenv("DISTCKPT_OBJECT_REQUEST_TIMEOUT_S", "2")
    monkeypatch.setenv("DISTCKPT_OBJECT_LEASE_S", "4")
    url = f"{s3_bucket.url}/lost/step_00000001"
    state = _state(3.0)
    landed = threading.Event()

    def rule(i, method, path):
        if landed.is_set():
            return "stall"
        if method == "PUT" and path.endswith("/MANIFEST"):
            landed.set()
            return "act_then_stall"
        return None

    proxy.rule = rule
    out: list = []
    t = threading.Thread(target=lambda: out.append(_try_save(state, url, _proxied(s3_bucket.storage_options,
                                                                                    proxy))))
    t.start()
    t.join(BOUND_S)
    assert not t.is_alive(), "the save hangs on a MANIFEST PUT that is never answered"
    proxy.rule = lambda i, method, path: None
    (err,) = out
    assert isinstance(err, EndpointUnreachableError) and err.errno == errno.ETIMEDOUT, err
    assert err.committed is None and err.commit_unknown is True and err.save_id in str(err)
    loaded = distckpt.read(url, storage_options=s3_bucket.storage_options)
    assert _equal(loaded, state)
    assert distckpt.read_manifest(url, storage_options=s3_bucket.storage_options)["save_id"] == err.save_id


LATE_S = 6.0  # how long after its client's deadline a delayed request lands (the proxy holds it whole)


def _late(path_suffix: str, method: str = "PUT"):
    """A proxy rule that holds the first ``method`` of a path ending in ``path_suffix`` whole and
    forwards it LATE_S later, after the client gave up on it (a gateway buffering a request in
    front of a slow backend); every other request passes."""
    held = threading.Event()

    def rule(i, m, path):
        if not held.is_set() and m == method and path.split("?")[0].endswith(path_suffix):
            held.set()
            return ("delay", LATE_S)
        return None
    return rule


def test_a_late_overwrite_never_replaces_the_newer_commit(s3_bucket, proxy, monkeypatch):
    """S1's overwriting MANIFEST PUT is held past its deadline: S1 says the outcome is unknown.
    S2 (the retry) overwrites and returns. S1's PUT then lands: it is conditional on the
    MANIFEST S1 read (If-Match), so it fails, and the checkpoint stays S2's, bit-exact; S1's data
    is kept while its request could still land (settling), never named by a MANIFEST."""
    monkeypatch.setenv("DISTCKPT_OBJECT_REQUEST_TIMEOUT_S", "2")
    monkeypatch.setenv("DISTCKPT_OBJECT_LEASE_S", "4")
    direct = s3_bucket.storage_options
    url = f"{s3_bucket.url}/late/ck"
    distckpt.save(_state(1.0), url, storage_options=direct, no_dist=True)
    proxy.rule = _late("/late/ck/MANIFEST")
    t0 = time.monotonic()
    err = _try_save(_state(2.0), url, _proxied(direct, proxy), overwrite=True)
    assert isinstance(err, DistCkptError) and err.commit_unknown is True and err.committed is None, err
    s2 = distckpt.save(_state(3.0), url, storage_options=direct, overwrite=True, no_dist=True)
    time.sleep(max(0.0, LATE_S + 2 - (time.monotonic() - t0)))  # S1's PUT has reached the server now
    assert distckpt.read_manifest(url, storage_options=direct)["save_id"] == s2.save_id
    assert _equal(distckpt.read(url, storage_options=direct), _state(3.0))
    leftovers = open_store(url, direct).leftovers(url)
    assert [state for _, state in leftovers] == ["settling"] and leftovers[0][0].endswith(err.save_id)


def test_a_late_manifest_create_finds_its_data(s3_bucket, proxy, monkeypatch):
    """A new step's MANIFEST PUT is held past its deadline (the save says the outcome is unknown);
    the next save's reclaim keeps that save's data (its request was sent: settling) instead of
    deleting it as dead; the late MANIFEST lands and the step loads bit-exact. Before, the
    reclaim deleted the data and the late MANIFEST made a step that looked committed and was not
    loadable."""
    monkeypatch.setenv("DISTCKPT_OBJECT_REQUEST_TIMEOUT_S", "2")
    monkeypatch.setenv("DISTCKPT_OBJECT_LEASE_S", "4")
    direct = s3_bucket.storage_options
    root = f"{s3_bucket.url}/late_create"
    distckpt.CheckpointManager(root, storage_options=direct).save(4, _state(4.0))
    proxy.rule = _late("/step_00000005/MANIFEST")
    t0 = time.monotonic()
    mgr = distckpt.CheckpointManager(root, storage_options=_proxied(direct, proxy))
    try:
        mgr.save(5, _state(5.0))
        err = None
    except DistCkptError as exc:
        err = exc
    assert err is not None and err.commit_unknown is True and err.data_kept is True, err
    again = distckpt.CheckpointManager(root, storage_options=direct)
    assert again.reclaim() == []  # settling, not dead
    # Also for a reclaimer whose clock runs 30 minutes ahead of the server's: the request's age is
    # taken by the server's clock (before, this host's clock judged it late and deleted the data).
    import types

    from distckpt.storage.object import store as object_store
    skewed = types.SimpleNamespace(monotonic=time.monotonic, sleep=time.sleep, perf_counter=time.perf_counter,
                                   time=lambda: time.time() + 1800)
    monkeypatch.setattr(object_store, "time", skewed)
    assert again.reclaim() == []
    monkeypatch.setattr(object_store, "time", time)
    time.sleep(max(0.0, LATE_S + 2 - (time.monotonic() - t0)))
    assert again.steps() == [4, 5]
    assert _equal(distckpt.read(again.path(5), storage_options=direct), _state(5.0))
    # Once DISTCKPT_OBJECT_LATE_S has passed, a leftover whose request was sent is dead like any other.
    monkeypatch.setenv("DISTCKPT_OBJECT_LATE_S", "0")
    store = open_store(root, direct)
    store._call("put", f"{root}/step_00000004/{'0' * 32}/.publishing", "pipe_file",
                store._key(f"{root}/step_00000004/{'0' * 32}/.publishing"), b"x")
    assert [p.rsplit("/", 1)[-1] for p in again.reclaim()] == ["0" * 32]


def _try_save(state, url, opts, **kwargs):
    try:
        distckpt.save(state, url, storage_options=opts, no_dist=True, **kwargs)
        return None
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        return exc


@pytest.mark.parametrize("mode", ["stall", "reset"])
def test_an_unanswered_manifest_read_at_resume_never_rolls_the_manager_back(s3_bucket, proxy, monkeypatch, mode):
    """Steps 100, 200 and 300 committed; at resume the GET of step 300's MANIFEST stalls (or is
    reset). The manager called step 300 "damaged", loaded 200 with only a warning, and its next
    save deleted the intact step 300 as an abandoned branch (an outside trial). The load must
    raise the typed error of the request, and step 300 must stay the one a later load finds."""
    monkeypatch.setenv("DISTCKPT_OBJECT_REQUEST_TIMEOUT_S", "1")
    root = f"{s3_bucket.url}/resume"
    direct = distckpt.CheckpointManager(root, keep_last=5, storage_options=s3_bucket.storage_options)
    for step in (100, 200, 300):
        direct.save(step, _state(float(step)))
    proxy.rule = lambda i, method, path: mode if method == "GET" and path.split("?")[0].endswith(
        "step_00000300/MANIFEST") else None
    mgr = distckpt.CheckpointManager(root, keep_last=5, storage_options=_proxied(s3_bucket.storage_options, proxy))
    into = _state(0.0)
    t0 = time.monotonic()
    with pytest.raises(DistCkptError) as info:
        mgr.load(into)
    assert time.monotonic() - t0 < BOUND_S
    assert isinstance(info.value, distckpt.errors.ObjectStoreError), repr(info.value)
    assert into["step"] == 0 and torch.equal(into["w"], _state(0.0)["w"])  # nothing loaded from step 200
    proxy.rule = lambda i, method, path: None
    assert direct.steps() == [100, 200, 300] and direct.latest_step() == 300
    back = _state(0.0)
    assert mgr.load(back).path.endswith("step_00000300") and _equal(back, _state(300.0))


def _first_get(suffix: str, action) -> tuple:
    """A proxy rule that answers the first GET of a key ending in ``suffix`` with ``action``,
    and a dict whose ``left`` is 0 once it has."""
    left = {"left": 1}

    def once(i, method, path):
        if method == "GET" and path.split("?")[0].endswith(suffix) and left["left"] > 0:
            left["left"] -= 1
            return action
        return None
    return once, left


@pytest.mark.parametrize("what", ["data", "MANIFEST"])
def test_a_body_cut_short_on_the_wire_is_asked_again_never_called_damage(s3_bucket, proxy, what):
    """A proxy drops an answer's Content-Length and closes after part of its body: the client
    cannot tell by framing that it is short. The object is intact, so this is the network's
    doing: one such answer is asked again and the load is exact; when every answer is cut, the
    error is ResponseIncompleteError (an EndpointUnreachableError), never DataFileTruncatedError
    or ManifestCorruptError with "this one is damaged" (an outside trial: one cut answer failed
    the whole load as a damaged checkpoint)."""
    url = f"{s3_bucket.url}/cut"
    distckpt.save(_state(7.0), url, storage_options=s3_bucket.storage_options, no_dist=True)
    suffix = "rank00000.bin" if what == "data" else "MANIFEST"
    proxy.rule, cut = _first_get(suffix, ("cut", 100))
    opts = _proxied(s3_bucket.storage_options, proxy)
    got = _state(0.0)
    distckpt.load(got, url, storage_options=opts)
    assert cut["left"] == 0 and _equal(got, _state(7.0))
    proxy.rule = lambda i, method, path: ("cut", 100) if method == "GET" and path.split("?")[0].endswith(suffix) else None
    t0 = time.monotonic()
    with pytest.raises(distckpt.errors.ResponseIncompleteError) as info:
        distckpt.load(_state(0.0), url, storage_options=_proxied(s3_bucket.storage_options, proxy))
    assert time.monotonic() - t0 < BOUND_S
    assert isinstance(info.value, distckpt.errors.EndpointUnreachableError)
    assert "is damaged" not in str(info.value) and "not known to be damaged" in info.value.remedy, info.value


@pytest.mark.parametrize("fault", ["lose_answer", "act_then_stall"])
def test_a_lost_answer_to_the_probe_create_neither_fails_the_save_nor_leaves_the_probe(s3_bucket, proxy,
                                                                                      monkeypatch, fault):
    """The pre-flight's probe create landed and its answer was lost: the client's retry of the
    conditional create got 412, the save failed with PreconditionFailed and the probe stayed for
    good (no listing or reclaim counts it; an outside trial). The probe's name is the call's own,
    so a 412 there is its own create: the save goes on. A create whose answer never comes fails
    the save typed, and the probe it may have left is deleted."""
    monkeypatch.setenv("DISTCKPT_OBJECT_REQUEST_TIMEOUT_S", str(REQUEST_TIMEOUT_S * 2))
    url = f"{s3_bucket.url}/probe/ck"
    hit = {"n": 0}

    def rule(i, method, path):
        if method == "PUT" and ".distckpt-probe-" in path and hit["n"] == 0:
            hit["n"] += 1
            return fault
        return None

    proxy.rule = rule
    opts = _proxied(s3_bucket.storage_options, proxy)
    if fault == "lose_answer":
        distckpt.save(_state(1.0), url, storage_options=opts, no_dist=True)
        got = _state(0.0)
        distckpt.load(got, url, storage_options=s3_bucket.storage_options)
        assert _equal(got, _state(1.0))
    else:
        with pytest.raises(distckpt.errors.EndpointUnreachableError):
            distckpt.save(_state(1.0), url, storage_options=opts, no_dist=True)
    assert hit["n"] == 1
    assert not [k for k in s3_bucket.keys("probe") if ".distckpt-probe-" in k], s3_bucket.keys("probe")


def test_a_bucket_is_no_checkpoint_path_but_may_be_a_manager_root(s3_bucket):
    """distckpt.save("s3://BUCKET") failed in its pre-flight with a raw ValueError (the parent of a
    bucket); it is a ConfigError now, before anything is written. A CheckpointManager root may be
    the bucket itself."""
    opts = s3_bucket.storage_options
    for path in (s3_bucket.url, s3_bucket.url + "/"):
        with pytest.raises(distckpt.errors.ConfigError, match="is a bucket"):
            distckpt.save(_state(1.0), path, storage_options=opts, no_dist=True)
    assert s3_bucket.keys() == []
    with distckpt.CheckpointManager(s3_bucket.url, storage_options=opts) as m:
        m.save(1, _state(1.0))
        assert m.steps() == [1]


def test_a_ranged_answer_longer_than_asked_is_asked_again_then_typed(s3_bucket, proxy):
    """A gateway that ignores a ranged GET's Range answers 200 with more bytes than asked: which of
    them are the range is unknown. They were accepted and copied into the destination, which
    failed with a raw ValueError (memoryview assignment), and `distckpt verify` exited 1 with a
    traceback (an outside trial). One such answer is asked again and the load is exact; when every
    answer is long, ResponseIncompleteError (typed, "not known to be damaged")."""
    url = f"{s3_bucket.url}/long"
    distckpt.save(_state(7.0), url, storage_options=s3_bucket.storage_options, no_dist=True)
    proxy.rule, left = _first_get("rank00000.bin", ("long", 8))
    got = _state(0.0)
    distckpt.load(got, url, storage_options=_proxied(s3_bucket.storage_options, proxy))
    assert left["left"] == 0 and _equal(got, _state(7.0))
    proxy.rule = lambda i, method, path: ("long", 8) if method == "GET" and "rank00000.bin" in path else None
    with pytest.raises(distckpt.errors.ResponseIncompleteError) as info:
        distckpt.load(_state(0.0), url, storage_options=_proxied(s3_bucket.storage_options, proxy))
    assert "ignored the Range header" in str(info.value) and "not known to be damaged" in info.value.remedy


def test_a_manifest_replaced_between_its_head_and_its_get_reads_the_new_one(s3_bucket, proxy):
    """The MANIFEST's size comes from a HEAD, its bytes from a GET. An overwrite landing between
    them made every retry ask for the old size and fail with ResponseIncompleteError blaming the
    network (an outside trial), where a reader gets the old MANIFEST or the new one. Its size is
    asked again now, and the new save is read."""
    url = f"{s3_bucket.url}/swap"
    opts = s3_bucket.storage_options
    distckpt.save({**_state(1.0), **{f"x{i}": torch.ones(2) for i in range(40)}}, url, storage_options=opts,
                  no_dist=True)
    swapped = {"done": False}

    def before_the_get(i, method, path):
        if method == "GET" and path.split("?")[0].endswith("MANIFEST") and not swapped["done"]:
            swapped["done"] = True  # after the HEAD was answered, before this GET is forwarded
            distckpt.save(_state(2.0), url, storage_options=opts, no_dist=True, overwrite=True)
        return None

    proxy.rule = before_the_get
    got = _state(0.0)
    distckpt.load(got, url, storage_options=_proxied(opts, proxy))
    assert swapped["done"] and _equal(got, _state(2.0))


@pytest.mark.parametrize("which", ["index", "data"])
def test_a_bit_flipped_in_transit_is_read_again_never_called_damage(s3_bucket, proxy, which):
    """One bit of one ranged GET's answer flipped on the way (the stored object intact): the load
    raised ChecksumMismatchError, "restore from an older checkpoint; this one is damaged", where a
    direct load right after was exact (an outside trial). A range or index that fails its checksum
    on an object store is read once more; a second mismatch (every answer flipped: what the store
    serves) is still ChecksumMismatchError."""
    url = f"{s3_bucket.url}/flip"
    distckpt.save(_state(7.0), url, storage_options=s3_bucket.storage_options, no_dist=True)
    skip = {"index": 0, "data": 1}[which]  # the first GET of the data object reads its index
    seen = {"n": 0, "flipped": 0}

    def once(i, method, path):
        if method == "GET" and path.split("?")[0].endswith("rank00000.bin"):
            seen["n"] += 1
            if seen["n"] == skip + 1:
                seen["flipped"] += 1
                return ("flip", 100)
        return None

    proxy.rule = once
    got = _state(0.0)
    distckpt.load(got, url, storage_options=_proxied(s3_bucket.storage_options, proxy))
    assert seen["flipped"] == 1 and _equal(got, _state(7.0))
    # `distckpt verify` likewise (it said DAMAGED: a review).
    from distckpt.verify import verify
    seen["n"] = seen["flipped"] = 0
    report = verify(url, storage_options=_proxied(s3_bucket.storage_options, proxy))
    assert seen["flipped"] == 1 and report.ok, report
    seen["n"] = 0

    def always(i, method, path):  # every answer of the index (or of the data ranges after it)
        if method == "GET" and path.split("?")[0].endswith("rank00000.bin"):
            seen["n"] += 1
            return ("flip", 100) if seen["n"] > skip else None
        return None

    proxy.rule = always
    with pytest.raises(distckpt.errors.CheckpointCorruptError):
        distckpt.load(_state(0.0), url, storage_options=_proxied(s3_bucket.storage_options, proxy))
    seen["n"] = 0
    assert not verify(url, storage_options=_proxied(s3_bucket.storage_options, proxy)).ok


def _save_model(rank, world, url, opts):
    from tests.protocol.test_read_once import _model
    distckpt.save(_model(), url, storage_options=opts)


def _load_model(rank, world, url, opts):
    from tests.protocol.test_read_once import _model, _zeros
    sd = _zeros()
    try:
        res = distckpt.load(sd, url, storage_options=opts)
    except Exception as exc:  # noqa: BLE001 - reported
        return f"{type(exc).__name__}: {str(exc)[:300]}"
    assert all(torch.equal(sd[k], v) for k, v in _model().items())
    return f"ok {res.bytes_from_peers > 0}"


@pytest.mark.parametrize("nth", [5, 7])
def test_a_bit_flipped_in_transit_on_a_read_once_load_is_read_again(s3_bucket, proxy, nth):
    """The same flip on a 2-rank load of replicated state (read-once: one rank reads a range and
    sends it to the other, DISTCKPT_READ_ONCE=auto, on for an object store): the reading rank did
    not read again, and both ranks raised ChecksumMismatchError (a review)."""
    from tests.protocol.test_read_once import _PRELOAD
    url, opts = s3_bucket.url + "/ro", s3_bucket.storage_options
    run_ranks(_save_model, 2, url, opts, env={"DISTCKPT_TIMEOUT_S": "60"}, preload=_PRELOAD)
    seen = {"n": 0, "flipped": 0}

    def once(i, method, path):  # the nth GET of a data object (the first ones read the indexes)
        if method == "GET" and ".bin" in path.split("?")[0]:
            seen["n"] += 1
            if seen["n"] == nth:
                seen["flipped"] += 1
                return ("flip", 1000)
        return None

    proxy.rule = once
    got = run_ranks(_load_model, 2, url, _proxied(opts, proxy), env={"DISTCKPT_TIMEOUT_S": "60"}, preload=_PRELOAD)
    assert seen["flipped"] == 1, seen
    assert all(g.startswith("ok") for g in got) and "ok True" in got, got  # exact, and read once


def test_verify_through_a_silent_endpoint_says_not_verified_never_damaged(s3_bucket, proxy):
    """`distckpt verify` of an intact checkpoint whose data GETs go unanswered said `DAMAGED`
    (exit 1, `ok: false`, the request error listed as a file problem; an outside trial): a
    cleaner acting on it deletes a good checkpoint. It says NOT VERIFIED with exit 3, and
    `ok: null` in --json; with the endpoint back, OK."""
    import subprocess
    import sys
    env = {**os.environ, **s3_bucket.env, "AWS_ENDPOINT_URL": proxy.endpoint, "DISTCKPT_OBJECT_REQUEST_TIMEOUT_S": "1"}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "distckpt", *args], env=env, capture_output=True, text=True,
                              timeout=120)

    url = f"{s3_bucket.url}/verify"
    distckpt.save(_state(3.0), url, storage_options=s3_bucket.storage_options, no_dist=True)
    proxy.rule = lambda i, method, path: "stall" if method == "GET" and "rank00000.bin" in path else None
    t0 = time.monotonic()
    out = cli("verify", url, "--no-progress")
    assert out.returncode == 3, out.stdout + out.stderr
    assert "NOT VERIFIED: EndpointUnreachableError" in out.stdout and "DAMAGED" not in out.stdout, out.stdout
    out = cli("verify", url, "--json")
    assert out.returncode == 3, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    assert doc["ok"] is None and doc["unverified"]["class"] == "EndpointUnreachableError", doc
    assert time.monotonic() - t0 < 2 * BOUND_S
    proxy.rule = lambda i, method, path: None
    out = cli("verify", url, "--no-progress")
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


def test_a_save_into_a_root_that_keeps_every_step_looks_at_no_older_step(s3_bucket, proxy):
    """After each commit rank 0 listed the root's steps, one HEAD per step (is it committed?),
    to find steps above the new one and to rotate: in a run that keeps every step (no keep_last)
    the n-th save sent n HEADs inside its commit (thousands after thousands of saves). With no
    keep_last and no step numbered above, none is sent; with keep_last, the steps are looked at as
    before and rotated."""
    root = s3_bucket.url + "/keepall"
    m = distckpt.CheckpointManager(root, storage_options=_proxied(s3_bucket.storage_options, proxy))
    for step in range(1, 9):
        proxy.reset_log()
        m.save(step, {"w": torch.full((100,), float(step))})
    heads = [path for _, method, path in proxy.log if method == "HEAD" and path.endswith("/MANIFEST")]
    assert not [p for p in heads if "step_0000000" in p and not p.endswith("step_00000008/MANIFEST")], heads
    assert m.steps() == list(range(1, 9))
    m = distckpt.CheckpointManager(root, storage_options=_proxied(s3_bucket.storage_options, proxy), keep_last=3)
    m.save(9, {"w": torch.full((100,), 9.0)})
    assert m.steps() == [7, 8, 9]


def test_latest_step_orders_an_object_store_root_by_one_ranged_get_per_step(s3_bucket, proxy, monkeypatch):
    """latest_step (and rotation) order a root's steps by MANIFEST commit time. On an object
    store every MANIFEST was decoded whole for it (a HEAD and a GET of the whole object each:
    megabytes per step for a large state); now one ranged GET of its first 4 KiB, and a decode of
    the newest only. An empty MANIFEST (HTTP 416 to a ranged GET) does not tell, and is decoded
    (damaged: passed over); a root gone silent raises the typed error after one deadline, not one
    per step."""
    opts = s3_bucket.storage_options
    root = s3_bucket.url + "/order"
    with distckpt.CheckpointManager(root, storage_options=opts) as m:
        for step in range(1, 7):
            m.save(step, {"w": torch.full((100,), float(step))})
    s3_bucket.fs.pipe_file(f"{s3_bucket.name}/order/step_00000007/MANIFEST", b"")  # damaged
    popts = _proxied(opts, proxy)
    m = distckpt.CheckpointManager(root, storage_options=popts)
    proxy.reset_log()
    assert m.latest_step() == 6
    seen = "\n".join(map(str, proxy.log))
    for step in range(1, 8):
        got = [method for _, method, path in proxy.log if path.endswith(f"/step_{step:08d}/MANIFEST")]
        if step <= 5:  # listed (a HEAD: committed?) and peeked (one GET), never decoded
            assert sorted(got) == ["GET", "HEAD"], (step, seen)
        else:  # the newest and the damaged one decoded too (a GET after HEADs)
            assert got.count("GET") == 2, (step, seen)
    # The per-step queries run concurrently (ObjectStore.for_each): with each MANIFEST HEAD held
    # 0.5 s (a far endpoint), the seven arrive together, not one per 0.5 s.
    arrived = []

    def held(n, method, path):
        if method == "HEAD" and path.split("?")[0].endswith("/MANIFEST"):
            arrived.append(time.monotonic())
            return ("delay", 0.5)
        return None

    proxy.rule = held
    assert m.steps() == list(range(1, 8))
    assert len(arrived) == 7 and max(arrived) - min(arrived) < 2.0, [t - arrived[0] for t in arrived]
    # Silent: the first peek waits out its deadline and raises, typed.
    proxy.rule = lambda n, method, path: "stall" if path.split("?")[0].endswith("/MANIFEST") else None
    monkeypatch.setenv("DISTCKPT_OBJECT_REQUEST_TIMEOUT_S", str(REQUEST_TIMEOUT_S))
    t0 = time.monotonic()
    with pytest.raises(EndpointUnreachableError):
        distckpt.CheckpointManager(root, storage_options=popts).latest_step()
    assert time.monotonic() - t0 < 3 * REQUEST_TIMEOUT_S + 5
