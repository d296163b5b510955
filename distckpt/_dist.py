"""The only module that imports torch.distributed: the control plane of save and load.

Invariants:
  * Control messages (plans, per-rank records, errors, the commit verdict) travel over a *gloo*
    group, even when training uses NCCL: they are small Python objects, and gloo needs no device
    memory and honours its timeout on CPU.
  * Every collective is bounded by DISTCKPT_TIMEOUT_S; a dead or hung peer becomes a
    :class:`PeerLostError` on the surviving ranks, never an endless wait.
  * Errors are exchanged, not thrown across: every phase ends with an exchange (an all-gather, or a
    gather to rank 0 answered by a scatter or broadcast) in which each rank contributes either its
    result or its typed error, so all ranks take the same decision.
  * Before the first collective of a save or load, every rank checks in through the job's store
    (:func:`check_arrival`), bounded by DISTCKPT_ARRIVAL_TIMEOUT_S: a call made on some ranks only
    (``save()`` on rank 0 only) raises :class:`RanksMissingError` naming the missing ranks within
    that bound, instead of a raw torch error after DISTCKPT_TIMEOUT_S. Any torch error of group
    creation is typed too (PeerLostError).
  * Every request to the job's key-value store has a deadline (:class:`_StoreWorker`): torch's
    store client has none of its own, and a store whose host is stopped (rank 0 hosting it, frozen)
    accepts the connection and never answers.
  * A control group whose collective failed (gloo closes its connections then) is never used
    again: at the next arrival check every rank votes, and if any rank's group was lost they all
    build a new one together; without that check (or on another channel) the next call raises
    PeerLostError at once, saying why.
  * Without an initialized process group, :func:`control_group` returns a one-rank group and save /
    load run as plain single-process functions.
  * A thread that close() may leave inside a collective (a tiered manager's drain) uses an
    ``exit_safe`` group: it waits for a collective in Python, never inside torch, and stops calling
    torch once the process exits (:func:`_stop_torch_calls_at_exit`), so the interpreter's
    finalization never ends it inside torch's C++ (SIGABRT, see :class:`ControlGroup`).
"""

from __future__ import annotations

import atexit
import datetime
import errno as _errno
import logging
import os
import pickle
import queue
import threading
import time
from typing import Any, Callable

from .config import get_config
from .errors import DistCkptError, PeerLostError, RanksMissingError, collective_error, fill_rank

log = logging.getLogger("distckpt")

__all__ = ["ControlGroup", "control_group", "is_distributed", "check_arrival"]


def is_distributed() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_initialized()


class ControlGroup:
    """rank, world_size and the few collectives the protocol needs, over a gloo group.

    ``exit_safe``: for a thread that may still be inside a collective when the process exits (a
    tiered manager's drain thread, which close() leaves behind when a peer holds it up). torch's
    blocking collectives wait inside C++ with the GIL released; when such a wait ends during the
    interpreter's finalization (a peer's exit closes the connections), the thread cannot take the
    GIL back: CPython ends it with pthread_exit, whose unwinding crosses pybind11's
    ``~gil_scoped_release`` (noexcept) and the process aborts ("terminate called without an active
    exception", SIGABRT, after everything succeeded). An exit_safe group launches each collective
    asynchronously and polls for its end in Python (:func:`_await`); its short calls into torch
    are made under :data:`_TORCH_LOCK` and stop once the process exits (the thread parks: see
    :func:`_stop_torch_calls_at_exit`). Same messages, same errors."""

    def __init__(self, pg: Any | None, rank: int, world_size: int, *, exit_safe: bool = False) -> None:
        self.pg = pg
        self.rank = rank
        self.world_size = world_size
        self.exit_safe = exit_safe

    def _wrap(self, what: str, fn, *args):
        return self._typed(what, _Progress.enter(self.pg, self.rank), fn, *args)

    def _typed(self, what: str, progress: "_Progress | None", fn, *args):
        """``fn(*args)``, a step of the collective ``progress`` counted, its failure typed."""
        try:
            return fn(*args)
        except DistCkptError:
            raise
        except Exception as exc:  # gloo reports a dead peer or a timeout as RuntimeError/DistError
            # gloo closes the group's connections when a collective fails (its errors, and torch's
            # DistError, are RuntimeErrors): the group is never used again (control_group). An
            # error of this rank's own (a value that does not pickle) leaves the group as it is.
            if isinstance(exc, RuntimeError):
                _LOST.setdefault(self.pg, f"{what}: {type(exc).__name__}: {exc}")
            behind = progress.behind(self.world_size) if progress is not None else None
            fields: dict[str, Any] = {}
            named = ""
            if behind:
                fields["lost_ranks"] = behind
                named = (f"; group rank(s) {behind} (global rank(s) {[self._global(r) for r in behind]}) had not reached "
                         f"this {what} when it failed here: the lost rank is among them (it died, is stuck in I/O, "
                         "a hung device or a debugger, or called something else); look at their logs first")
            raise PeerLostError(
                f"{what} among {self.world_size} ranks failed: {type(exc).__name__}: {exc}{named}",
                rank=self.rank, **fields) from exc

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in rank order (a one-element list in a single process)."""
        if self.world_size == 1:
            return [obj]
        if self.exit_safe:
            return self._wrap("all_gather", _safe_all_gather, self.pg, obj, self.world_size)
        import torch.distributed as dist
        out: list[Any] = [None] * self.world_size

        def run():
            dist.all_gather_object(out, obj, group=self.pg)
            return out

        return self._wrap("all_gather", run)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        if self.world_size == 1:
            return obj
        if self.exit_safe:
            return self._wrap("broadcast", _safe_broadcast, self.pg, obj, self._global(src), self.rank == src)
        import torch.distributed as dist
        box = [obj]

        def run():
            dist.broadcast_object_list(box, src=self._global(src), group=self.pg)
            return box[0]

        return self._wrap("broadcast", run)

    def gather(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` in rank order on rank ``dst``; ``None`` on the other ranks.

        Unlike :meth:`all_gather`, a rank receives nothing: what a non-coordinator rank moves
        does not grow with the number of ranks."""
        if self.world_size == 1:
            return [obj]
        if self.exit_safe:
            return self._wrap("gather", _safe_gather, self.pg, obj, self.world_size, self._global(dst), self.rank == dst)
        import torch.distributed as dist
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None

        def run():
            dist.gather_object(obj, out, dst=self._global(dst), group=self.pg)
            return out

        return self._wrap("gather", run)

    def scatter(self, objs: list[Any] | None, src: int = 0) -> Any:
        """``objs[r]`` (given on rank ``src``, ``None`` elsewhere) delivered to rank r: each rank
        receives only its own element."""
        if self.world_size == 1:
            return objs[0]
        if self.exit_safe:
            return self._wrap("scatter", _safe_scatter, self.pg, objs if self.rank == src else None,
                              self._global(src))
        import torch.distributed as dist
        box: list[Any] = [None]

        def run():
            dist.scatter_object_list(box, objs if self.rank == src else None, src=self._global(src),
                                     group=self.pg)
            return box[0]

        return self._wrap("scatter", run)

    def exchange(self, what: str, send: Any | None, dst: int | None, recv: Any | None,
                 src: int | None) -> Callable[[], None]:
        """Start moving ``send`` (a uint8 tensor whose memory torch owns, or None) to group rank
        ``dst`` while ``recv`` (the same, or None) fills from group rank ``src``. Returns the wait
        for both, bounded by the group's timeout: PeerLostError (typed as every collective's) when
        a peer died or did not answer in time.

        Collective: every rank of the group calls it as many times, one with nothing to move with
        None: an all-to-all in which each rank moves at most one buffer each way. Not
        point-to-point sends: gloo completes those only inside a blocking ``wait()``, which an
        exit_safe group never makes (a thread left inside one at exit aborts the process), and
        all ranks' counts of the group's collectives stay equal, which a failure's message
        needs to name the rank behind (:class:`_Progress`)."""
        import torch
        import torch.distributed as dist
        world = self.world_size

        def launch():
            empty = torch.empty(0, dtype=torch.uint8)
            into, out = [0] * world, [0] * world
            if send is not None:
                out[dst] = send.numel()
            if recv is not None:
                into[src] = recv.numel()
            return dist.all_to_all_single(empty if recv is None else recv, empty if send is None else send,
                                          into, out, group=self.pg, async_op=True)

        progress = _Progress.enter(self.pg, self.rank)
        work = self._typed(what, progress, _in_torch if self.exit_safe else (lambda fn: fn()), launch)
        return lambda: self._typed(what, progress, _await if self.exit_safe else _wait, work)

    def call(self, fn, *args):
        """``fn(*args)``: a short call into torch (a buffer of this group's collectives made or
        filled). On an exit_safe group none starts once the process exits: the thread parks."""
        return _in_torch(fn, *args) if self.exit_safe else fn(*args)

    def members(self) -> tuple[int, ...]:
        """The global ranks of this group in group-rank order; ``()`` for a one-rank group. The
        same on every rank of the group, whatever its channel: a key for "this group of ranks"."""
        if self.world_size == 1 or self.pg is None:
            return ()
        import torch.distributed as dist
        return tuple(dist.get_process_group_ranks(self.pg))

    def _global(self, group_rank: int) -> int:
        import torch.distributed as dist
        return dist.get_global_rank(self.pg, group_rank) if self.pg is not None else group_rank

    def exchange_outcome(self, error: BaseException | None, *, operation: str, extra: Any = None) -> list[Any]:
        """All-gather every rank's error (or None); raise the same typed error on every rank when
        any rank failed (see :meth:`raise_failures`). ``extra``: a value of this rank's that rides
        on the same all-gather; returns every rank's, in rank order, when none failed.

        When the exchange itself fails (a peer died: PeerLostError) on a rank that had failed
        already, the PeerLostError raised there keeps what that rank knows: its own error in the
        message and in ``failures`` (``{this rank: error}``), its typed fields ``filled`` and
        ``partly_filled`` (a load's tensors already filled with verified bytes) copied, and the
        error as ``__cause__``."""
        if self.world_size == 1:
            gathered = [(error, extra)]
        else:
            try:
                gathered = self.all_gather((_portable(error), extra))
            except PeerLostError as lost:
                if error is None:
                    raise
                raise _lost_after(lost, error, self.rank, operation) from error
        self.raise_failures([e for e, _ in gathered], error, operation=operation)
        return [x for _, x in gathered]

    def raise_failures(self, errors: list, local_error: BaseException | None, *, operation: str) -> None:
        """Raise when any entry of ``errors`` (``errors[r]`` from rank r, as all-gathered) is set.

        Several ranks: on every rank, :func:`distckpt.errors.collective_error`: an instance of the
        failing ranks' common typed class (``except CheckpointNotFoundError`` catches a tag missing
        on every rank), else a :class:`RankFailureError`; both carry every rank's error in
        ``failures``. When *every* rank failed with the same class that is not one of distckpt's
        (a Stateful's ``state_dict()`` raising RuntimeError on every rank), each rank raises its own
        error itself, that class, as in a single process, with ``failures`` and ``failed_ranks``
        set on it, a note naming every rank's error, and the collective error as ``__cause__``
        when it had none. One rank: the error itself, unchanged. The io/storage layers that raised the errors do not
        know their rank (RANK is only set under torchrun), so it is recorded here, where it is
        known: ``failures[r].rank == r``, and a single-process error reports rank 0.
        """
        failures = {r: fill_rank(e, r) for r, e in enumerate(errors) if e is not None}
        if not failures:
            return
        if self.world_size == 1:
            raise fill_rank(local_error, 0) if local_error is not None else failures[0]
        collective = collective_error(failures, operation=operation, rank=self.rank)
        if (local_error is not None and not isinstance(local_error, DistCkptError)
                and len(failures) == self.world_size
                and all(getattr(e, "original_class", None) == _class_name(local_error) for e in failures.values())):
            # Every rank raises this same class: the caller's ``except RuntimeError`` (or its own
            # class) catches it on every rank, as the docs promise (docs/SEMANTICS.md, "Errors in
            # a job"); a collective error could only be a RankFailureError here.
            try:
                local_error.failures, local_error.failed_ranks = failures, sorted(failures)
                local_error.operation = operation
            except AttributeError:  # a class with __slots__: the note and the cause still say it
                pass
            if hasattr(local_error, "add_note"):
                local_error.add_note(f"distckpt: {operation} failed on every rank with {type(local_error).__name__} "
                                     f"({collective.message})")
            if local_error.__cause__ is None:
                local_error.__cause__ = collective
            raise local_error
        raise collective from local_error


def group_destroyed(group: ControlGroup) -> bool:
    """Whether ``group``'s gloo group is gone from this process: destroy_process_group() (of the
    world, or of every group) unregisters it, and the world stops being initialized."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return True
    try:
        dist.get_process_group_ranks(group.pg)
    except (KeyError, ValueError, RuntimeError):  # KeyError in torch 2.x: not registered
        return True
    return False


def _lost_after(lost: PeerLostError, error: BaseException, rank: int, operation: str) -> PeerLostError:
    """The PeerLostError of an outcome exchange that failed on a rank that had failed already
    (see :meth:`ControlGroup.exchange_outcome`)."""
    fields = {k: getattr(error, k) for k in ("filled", "partly_filled") if getattr(error, k, None) is not None}
    if getattr(lost, "lost_ranks", None):
        fields["lost_ranks"] = lost.lost_ranks
    out = PeerLostError(
        f"{operation} failed on this rank with {type(error).__name__}: {getattr(error, 'message', error)}; then the "
        f"exchange of every rank's outcome failed too ({getattr(lost, 'message', lost)}), so the other ranks' "
        f"outcomes are unknown", rank=rank, **fields)
    out.failures, out.failed_ranks, out.operation = {rank: error}, [rank], operation
    return out


def _portable(error: BaseException | None) -> BaseException | None:
    """An error that will unpickle on the other ranks: typed errors as they are, anything else as
    a DistCkptError carrying the original type name and message (and ``original_class``: its
    module-qualified class name)."""
    if error is None or isinstance(error, DistCkptError):
        return error
    wrapped = DistCkptError(f"{type(error).__name__}: {error}")
    wrapped.__cause__ = None
    # The class travels by name (the object itself may not unpickle elsewhere), so that every rank
    # can tell that all failed alike (ControlGroup.raise_failures).
    wrapped.original_class = _class_name(error)
    return wrapped


def _class_name(error: BaseException) -> str:
    cls = type(error)
    return f"{cls.__module__}.{cls.__qualname__}"


# -- collectives a thread may be left inside at exit (ControlGroup(exit_safe=True)) ---------------

# Set once, at exit, under _TORCH_LOCK (_stop_torch_calls_at_exit): from then on an exit_safe
# group's thread makes no call into torch (it parks), so none is inside one when the interpreter
# finalizes. _TORCH_LOCK is held only across short calls (a tensor made, a collective launched,
# a finished one's result read), never across a wait.
_EXITING = False
_TORCH_LOCK = threading.Lock()
_POLL_FIRST_S = 0.0001
_POLL_MAX_S = 0.01
# How long the exit hook waits for a short call in flight (a bound, never reached in practice).
_EXIT_LOCK_S = 1.0


def _park():
    """The end of a thread that met the process's exit: it sleeps until the process is gone
    (a daemon: the interpreter's finalization ends it inside ``time.sleep``, harmlessly)."""
    while True:
        time.sleep(3600)


def _in_torch(fn, *args):
    """``fn(*args)`` (a short call into torch), unless the process is exiting: the thread parks."""
    with _TORCH_LOCK:
        if not _EXITING:
            return fn(*args)
    _park()


def _await(work: Any) -> None:
    """Wait for an async collective in Python (never blocked inside torch with the GIL released),
    then raise its error if it failed. ``Work.is_completed`` keeps the GIL; ``Work.wait`` on a
    finished work returns at once. The collective's own timeout (the group's) ends a stuck one."""
    delay = _POLL_FIRST_S
    while not _in_torch(work.is_completed):
        time.sleep(delay)
        delay = min(delay * 2, _POLL_MAX_S)
    _in_torch(work.wait)


def _wait(work: Any) -> None:
    """Wait for an async collective inside torch (a group that is not exit_safe)."""
    work.wait()


def _encode(obj: Any):
    """``obj`` pickled into a uint8 tensor whose memory torch owns (a tensor over a Python buffer
    would need the GIL to be freed, maybe by a gloo thread)."""
    import torch
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).clone()


def _decode(tensor: Any, size: int) -> Any:
    return pickle.loads(tensor[:size].numpy().tobytes())


def _sizes(pg: Any, n: int, world: int) -> list[int]:
    """Every rank's ``n`` (all-gathered)."""
    import torch
    import torch.distributed as dist

    def launch():
        got = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        return got, dist.all_gather(got, torch.tensor([n], dtype=torch.int64), group=pg, async_op=True)

    got, work = _in_torch(launch)
    _await(work)
    return _in_torch(lambda: [int(t.item()) for t in got])


def _padded(data: Any, size: int):
    out = data.new_zeros(size)
    out[:data.numel()] = data
    return out


def _safe_all_gather(pg: Any, obj: Any, world: int) -> list[Any]:
    import torch
    import torch.distributed as dist
    mine = _in_torch(_encode, obj)
    sizes = _sizes(pg, mine.numel(), world)

    def launch():
        got = [torch.empty(max(sizes), dtype=torch.uint8) for _ in range(world)]
        return got, dist.all_gather(got, _padded(mine, max(sizes)), group=pg, async_op=True)

    got, work = _in_torch(launch)
    _await(work)
    return _in_torch(lambda: [_decode(t, k) for t, k in zip(got, sizes)])


def _safe_gather(pg: Any, obj: Any, world: int, dst: int, is_dst: bool) -> list[Any] | None:
    import torch
    import torch.distributed as dist
    mine = _in_torch(_encode, obj)
    sizes = _sizes(pg, mine.numel(), world)

    def launch():
        got = [torch.empty(max(sizes), dtype=torch.uint8) for _ in range(world)] if is_dst else None
        return got, dist.gather(_padded(mine, max(sizes)), got, dst=dst, group=pg, async_op=True)

    got, work = _in_torch(launch)
    _await(work)
    return _in_torch(lambda: [_decode(t, k) for t, k in zip(got, sizes)]) if is_dst else None


def _safe_broadcast(pg: Any, obj: Any, src: int, is_src: bool) -> Any:
    import torch
    import torch.distributed as dist

    def launch_size():
        data = _encode(obj) if is_src else None
        size = torch.tensor([data.numel() if is_src else 0], dtype=torch.int64)
        return data, size, dist.broadcast(size, src=src, group=pg, async_op=True)

    data, size, work = _in_torch(launch_size)
    _await(work)

    def launch_data():
        n = int(size.item())
        buf = data if is_src else torch.empty(n, dtype=torch.uint8)
        return n, buf, dist.broadcast(buf, src=src, group=pg, async_op=True)

    n, buf, work = _in_torch(launch_data)
    _await(work)
    return obj if is_src else _in_torch(_decode, buf, n)


def _safe_scatter(pg: Any, objs: list[Any] | None, src: int) -> Any:
    import torch
    import torch.distributed as dist
    is_src = objs is not None

    def launch_max():
        data = [_encode(o) for o in objs] if is_src else None
        top = torch.tensor([max(t.numel() for t in data) if is_src else 0], dtype=torch.int64)
        return data, top, dist.broadcast(top, src=src, group=pg, async_op=True)

    data, top, work = _in_torch(launch_max)
    _await(work)

    def launch_size():
        size = torch.zeros(1, dtype=torch.int64)
        sizes = [torch.tensor([t.numel()], dtype=torch.int64) for t in data] if is_src else None
        return size, dist.scatter(size, sizes, src=src, group=pg, async_op=True)

    size, work = _in_torch(launch_size)
    _await(work)

    def launch_data():
        m = int(top.item())
        buf = torch.empty(m, dtype=torch.uint8)
        padded = None
        if is_src:
            padded = [_padded(t, m) for t in data]
        return buf, dist.scatter(buf, padded, src=src, group=pg, async_op=True)

    buf, work = _in_torch(launch_data)
    _await(work)
    return _in_torch(lambda: _decode(buf, int(size.item())))


def _stop_torch_calls_at_exit() -> None:
    """At exit, before the interpreter finalizes (the last atexit hook in practice: registered at
    import), while daemon threads still run: no exit_safe group's thread, nor the store worker,
    calls into torch any more. One that is waiting for a
    collective (a drain thread close() left waiting for a peer held up in a request) parks when
    the collective ends, instead of being ended by the finalization inside torch's C++ (SIGABRT).
    Takes the lock only to wait out a short call in flight: microseconds."""
    global _EXITING
    took = _TORCH_LOCK.acquire(timeout=_EXIT_LOCK_S)
    try:
        _EXITING = True
    finally:
        if took:
            _TORCH_LOCK.release()


# Registered when this module is imported, so that it runs after every exit hook registered
# later (atexit is last in, first out): those of the program itself, which may still save or load
# a checkpoint (a final save in an exit hook) through the store and the drain.
atexit.register(_stop_torch_calls_at_exit)

_EXIT_HOOKS_REGISTERED = False


def _register_exit_hooks() -> None:
    """Once the process has a side group: :func:`_let_gloo_workers_finish`."""
    global _EXIT_HOOKS_REGISTERED
    if not _EXIT_HOOKS_REGISTERED:
        _EXIT_HOOKS_REGISTERED = True
        atexit.register(_let_gloo_workers_finish)


# (process group, channel) -> our gloo side group. Strong references: side groups live as long as
# the job's groups; after destroy_process_group a new world is a new key.
_SIDE_GROUPS: dict[tuple[Any, str], Any] = {}

# side group -> the failure that lost it (gloo closed its connections): such a group is never
# used again (control_group builds a new one in lockstep, or raises).
_LOST: dict[Any, str] = {}

# The channels whose lost groups the control channel's arrival check renews: those whose groups
# only the caller's thread fetches (an async save's background thread runs on the group its
# caller fetched for it, and the next async save fetches the next), so the check is a point every
# rank reaches in the same order, and no other thread fetches the group meanwhile. Not "dcp":
# dcp.async_save fetches it in DCP's own thread. A tiered manager's drain channels are its own
# (renewed by its next save).
_RENEWABLE = ("control", "background")

# Lost groups forgotten while a thread of this process may still be inside one of their
# collectives (a failing async save's): kept referenced, never destroyed under it.
_RETIRED: list[Any] = []


class _StoreTimeout(Exception):
    pass


class _StoreWorker:
    """The one thread that sends distckpt's requests to the job's key-value store, so that each
    has a deadline: torch's store client has none (a TCPStore whose host process is stopped,
    rank 0 hosting it and frozen, accepts the connection and never answers; a request then
    blocks for ever, whatever the store's own timeout). A caller waits at most its deadline
    (:meth:`call` raises _StoreTimeout); the request itself goes on in the thread, a daemon, and
    requests run in the order they were made (a late one never overwrites a newer one's key).
    While one is stuck, later requests queue behind it and their callers time out too."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def call(self, fn, deadline_s: float, *, committed: threading.Event | None = None,
             committed_extra_s: float = 0.0):
        """``fn()`` run on the worker thread; raises _StoreTimeout when it has not returned within
        ``deadline_s``, or, when the request set ``committed`` by then (it passed a point after
        which the other ranks count on its outcome), within ``committed_extra_s`` more."""
        box: dict[str, Any] = {}
        done = threading.Event()

        def job() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box["error"] = exc
            finally:
                done.set()

        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="distckpt-store", daemon=True)
                self._thread.start()
        self._jobs.put(job)
        if not done.wait(deadline_s) and not (committed is not None and committed.is_set()
                                              and done.wait(committed_extra_s)):
            raise _StoreTimeout
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if _EXITING:  # no store request starts inside torch once the process exits
                _park()
            job()


_STORE = _StoreWorker()


def _forget_store_worker_in_child() -> None:
    # A forked child (a DataLoader worker) has none of the parent's threads: its requests, if it
    # ever makes any, start a worker of its own, and the parent's queued ones are not run twice.
    # The lock of the exit-safe collectives may have been held by a thread the child lacks.
    global _STORE, _TORCH_LOCK
    _STORE = _StoreWorker()
    _TORCH_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_store_worker_in_child)


# process group -> how many arrival checks this process has made on it (every rank counts alike;
# a new world after destroy_process_group is a new key, with a new store).
_ARRIVALS: dict[Any, int] = {}


class _Progress:
    """Which ranks reached a collective of a control group, for the message of one that failed.

    Before each collective a rank writes how many collectives of that group it has entered
    (``distckpt/coll/<group name>/<rank>`` in the job's store: one small set, a few microseconds).
    When the collective fails, the ranks whose count is lower never reached it: gloo's timeout
    does not say who, and "a peer died" is only useful with its rank."""

    _SEQ: dict = {}

    def __init__(self, store: Any, base: str, seq: int) -> None:
        self.store, self.base, self.seq = store, base, seq

    @classmethod
    def enter(cls, pg: Any, rank: int) -> "_Progress | None":
        """Record this rank's entry into the next collective of ``pg``; None where the store
        cannot be reached (the collective then reports the failure without names)."""
        try:
            from torch.distributed import distributed_c10d as c10d
            store = c10d._get_default_store()
            base = f"distckpt/coll/{c10d._get_process_group_name(pg)}"
            seq = cls._SEQ.get(pg, 0) + 1
            cls._SEQ[pg] = seq
            _STORE.call(lambda: store.set(f"{base}/{rank}", str(seq)), cls.LOOK_S)
            return cls(store, base, seq)
        except Exception:  # noqa: BLE001 - a diagnostic only; the collective itself reports a lost store
            return None

    #: How long the look may take: the store's host may be the frozen rank (a store request then
    #: waits for the store's own timeout, the process group's: 30 minutes by default).
    LOOK_S = 2.0

    def behind(self, world: int) -> list[int] | None:
        """The group ranks that had not entered this collective when it failed here (the lost
        rank among them, a rank that is only slower possibly too); None when the store cannot
        tell within LOOK_S (the look is left to a daemon thread then)."""
        def look() -> list[int]:
            keys = [f"{self.base}/{r}" for r in range(world)]
            if self.store.check(keys):
                counts = [int(v) for v in self.store.multi_get(keys)]
            else:  # a rank that never entered any collective of this group has no key yet
                counts = [int(self.store.get(k)) if self.store.check([k]) else 0 for k in keys]
            return [r for r, n in enumerate(counts) if n < self.seq]

        try:
            return _STORE.call(look, self.LOOK_S)
        except Exception:  # noqa: BLE001 - the store's host (rank 0) may be the lost one
            return None


def control_group_fds(world: int) -> int:
    """The fds distckpt's gloo control group among ``world`` ranks takes in each process: its event
    loop's epoll and pipe, a socket per peer, a few spare."""
    return 6 + world


def _fd_shortfall(world: int, rank: int, operation: str) -> BaseException | None:
    """The TooManyOpenFilesError that creating a gloo side group among ``world`` ranks would meet
    here (its event loop's epoll and pipe, a socket per peer, a few spare), or None. gloo reports
    EMFILE from inside group creation, after which the other ranks wait for this one until
    DISTCKPT_TIMEOUT_S; checked before it, the shortfall travels with the arrival check instead."""
    import resource
    from .errors import TooManyOpenFilesError
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        n_open = len(os.listdir("/proc/self/fd")) - 1  # less the listing's own fd
    except OSError:  # no /proc: let the group creation tell
        return None
    needed = control_group_fds(world)
    if n_open + needed <= soft:
        return None
    hard_txt = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    return TooManyOpenFilesError(
        f"{operation} needs about {needed} file descriptors for distckpt's gloo control group among {world} ranks "
        f"but only {max(soft - n_open, 0)} are left ({n_open} open, RLIMIT_NOFILE soft limit {soft}, hard limit "
        f"{hard_txt})", rank=rank, errno=_errno.EMFILE, needed=needed, open=n_open, limit=soft, hard=hard,
        remedy=f"Raise the soft limit (`ulimit -n {hard_txt}` before launching, or resource.setrlimit) or close "
               "files this process keeps open.")


# Past the arrival bound, how long a rank already counted waits for the verdict it is owed.
_VERDICT_MARGIN_S = 5.0


def _poll_key(store: Any, key: str, timeout: float) -> bool:
    """Whether ``key`` exists in ``store`` within ``timeout`` seconds, asked in short requests.
    Not ``store.wait``: torch's store client holds its one connection for the whole of a wait,
    so another thread's requests (DCP's thread creating its gloo group through the same store, as
    ``dcp.async_save`` does beside a load in the caller's thread) would wait behind it, and the
    ranks for each other, until the timeout."""
    end = time.monotonic() + timeout
    delay = 0.0005
    while not store.check([key]):
        left = end - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(delay, left))
        delay = min(delay * 2, 0.01)  # a late rank is seen within 10 ms of its arrival
    return True


def check_arrival(pg: Any, rank: int, world: int, operation: str, problem: BaseException | None = None,
                  renew: tuple[str, ...] = (), kind: str | None = None) -> frozenset[str]:
    """Wait until every rank of ``pg`` has entered this same call (its n-th arrival check on
    ``pg``), at most DISTCKPT_ARRIVAL_TIMEOUT_S. Uses the job's key-value store (a few small keys
    per call; the previous call's keys are deleted), not a collective, so a missing rank costs
    only this bound. Every store request has a deadline (:class:`_StoreWorker`): the whole check
    takes at most DISTCKPT_ARRIVAL_TIMEOUT_S + DISTCKPT_TIMEOUT_S, even when the store's host is
    stopped; a rank already counted as arrived waits DISTCKPT_ARRIVAL_TIMEOUT_S + 5 s more for
    the verdict the others act on.

    ``problem``: this rank's own reason not to go on (an error it met before the collective,
    e.g. too few file descriptors to create the control group): it is recorded in the store
    before this rank counts as arrived, and once every rank arrived every rank raises the failing
    ranks' error (:func:`distckpt.errors.collective_error`), at once instead of after a timeout.

    ``kind``: what this rank's call is, for calls that other ranks could make differently at the
    same point (a save: ``"save"`` or ``"async_save"``): a rank whose kind differs from the first
    rank's to arrive records a ConfigError as its problem, so every rank raises it at once. Their
    collectives differ after the check: ranks mixing a blocking and an async save each waited at
    its own for DISTCKPT_TIMEOUT_S, then blamed a lost peer (an outside trial).

    ``renew``: the channels (of :data:`_RENEWABLE`) whose side groups of ``pg`` this rank lost
    (:data:`_LOST`). Returns the channels any rank said so of (the same set everywhere, read once
    all arrived): every rank then drops those groups, and builds each anew, together, where it is
    next used.

    Raises:
        RanksMissingError: on every rank that arrived, naming the group ranks that did not.
        PeerLostError: the store failed or did not answer in time (its host, rank 0 or the
            launcher's agent, died or is stopped).
        The failing ranks' error (above), on every rank.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    timeout = get_config().arrival_timeout_s
    try:
        store = c10d._get_default_store()
        name = c10d._get_process_group_name(pg)
    except Exception as exc:  # private API moved: say so rather than silently skip the check
        raise PeerLostError(f"cannot reach the job's store for the arrival check of {operation}: "
                            f"{type(exc).__name__}: {exc}", rank=rank) from exc
    seq = _ARRIVALS.get(pg, 0) + 1
    _ARRIVALS[pg] = seq
    base = f"distckpt/arrive/{name}"
    done = f"{base}/{seq}/done"
    # Set when this rank gave up waiting: the request that was stuck may still return (the
    # store's host resumed), and this rank must not then count as arrived for a call it left.
    abandoned = threading.Event()
    # Set once this rank is counted as arrived: the other ranks then act on the check's verdict
    # (a group rebuilt together), so this rank waits for it too, past its first deadline (a
    # whole process stopped and resumed finds that deadline passed: giving up then would leave
    # it out of a rebuild the others made, and torch's group numbering apart for good).
    counted = threading.Event()

    def protocol() -> bool:
        mine = problem
        if kind is not None and mine is None:
            first = store.compare_set(f"{base}/{seq}/kind", "", kind).decode()
            if first != kind:
                from .errors import ConfigError
                mine = ConfigError(
                    f"{operation} on this rank is a call of kind {kind!r} where another rank of the group made one of "
                    f"kind {first!r} at the same point: every rank must make the same kind of save, in the same order",
                    rank=rank,
                    remedy="Make every rank's save blocking, or every rank's async (async_save, "
                           "CheckpointManager.save(blocking=False)).")
        if mine is not None:  # recorded before this rank counts as arrived (see below)
            store.set(f"{base}/{seq}/fail/{rank}", pickle.dumps(_portable(mine)))
            store.add(f"{base}/{seq}/nfail", 1)
        if renew:  # likewise; the total first, so that a check with nothing lost reads one key
            for channel in renew:
                store.add(f"{base}/{seq}/renew/{channel}", 1)
            store.add(f"{base}/{seq}/renew", 1)
        store.set(f"{base}/last/{rank}", str(seq))
        # A set is sent without waiting for an answer: this request is answered, so once it
        # returns the store's host is answering, and the guard below is checked after any stall.
        store.add(f"{base}/{seq}/nfail", 0)
        if abandoned.is_set():
            raise _StoreTimeout
        arrived = store.add(f"{base}/{seq}/n", 1)
        counted.set()
        if abandoned.is_set():
            # The host stalled between the guard and the count, and this rank's caller gave up
            # meanwhile: nobody may go on counting it (the last rank reads "aborted").
            store.compare_set(done, "", "aborted")
            raise _StoreTimeout
        if arrived == world:
            verdict = store.compare_set(done, "", "ok")
        else:
            if not _poll_key(store, done, timeout):
                store.compare_set(done, "", "aborted")  # give up for everyone, unless the last rank just came
            verdict = store.get(done)
        if verdict != b"ok":
            missing = []
            for r in range(world):
                key = f"{base}/last/{r}"
                if not store.check([key]) or int(store.get(key)) < seq:
                    missing.append(r)
            if not missing:  # every rank came, but one gave up on a stalled store meanwhile
                raise PeerLostError(
                    f"the arrival check of {operation} among {world} ranks was aborted: every rank reached it, but "
                    f"one gave up waiting for the job's key-value store meanwhile (its host stalled)", rank=rank,
                    remedy="Look at rank 0's (or the launcher's) state; the next call checks again.")
            global_missing = [dist.get_global_rank(pg, r) if pg is not dist.group.WORLD else r for r in missing]
            raise RanksMissingError(
                f"{operation} was called on this rank but group rank(s) {missing} (global rank(s) "
                f"{global_missing}) of the {world}-rank group did not reach it within "
                f"DISTCKPT_ARRIVAL_TIMEOUT_S={timeout:g} s: such a rank exited or crashed, is stuck, or did "
                f"not call it (every rank of the group must call {operation}, in the same order)",
                rank=rank, missing=missing, operation=operation)
        # Every rank arrived, so every failing (or renewing) rank's record is in the store already.
        if store.add(f"{base}/{seq}/nfail", 0) > 0:
            failures = {}
            for r in range(world):
                key = f"{base}/{seq}/fail/{r}"
                if store.check([key]):
                    failures[r] = fill_rank(pickle.loads(store.get(key)), r)
            raise collective_error(failures, operation=operation, rank=rank)
        renewed = frozenset()
        if store.add(f"{base}/{seq}/renew", 0) > 0:
            renewed = frozenset(c for c in _RENEWABLE if store.add(f"{base}/{seq}/renew/{c}", 0) > 0)
        if rank == 0 and seq > 1:  # everyone has passed the previous check: drop its keys
            for key in (f"{base}/{seq - 1}/n", f"{base}/{seq - 1}/done", f"{base}/{seq - 1}/nfail", f"{base}/{seq - 1}/kind",
                        f"{base}/{seq - 1}/renew", *(f"{base}/{seq - 1}/renew/{c}" for c in _RENEWABLE)):
                try:
                    store.delete_key(key)
                except Exception:  # noqa: BLE001 - housekeeping only
                    pass
        return renewed

    deadline = timeout + get_config().timeout_s
    try:
        return _STORE.call(protocol, deadline, committed=counted, committed_extra_s=timeout + _VERDICT_MARGIN_S)
    except DistCkptError:
        raise
    except _StoreTimeout:
        abandoned.set()
        raise PeerLostError(
            f"the arrival check of {operation} among {world} ranks got no answer from the job's key-value store "
            f"within {deadline:g} s (DISTCKPT_ARRIVAL_TIMEOUT_S + DISTCKPT_TIMEOUT_S): the store's host (rank 0's "
            f"process when it hosts the store, or the launcher's agent) is stopped, hung or unreachable",
            rank=rank, remedy="Look at rank 0's (or the launcher's) state first; restart the job if it does not "
                              "recover.") from None
    except Exception as exc:
        raise PeerLostError(f"the arrival check of {operation} among {world} ranks failed: "
                            f"{type(exc).__name__}: {exc}", rank=rank) from exc


_GIL_HANDOFF_S = 0.05


def _let_gloo_workers_finish() -> None:
    """At exit, before the interpreter finalizes: give the GIL away for a moment.

    torch's gloo worker threads free a finished collective's tensors after the caller has gone
    on, and freeing a tensor whose Python object is already gone needs the GIL. A rank that exits
    right after its last collective (rank 1 of a job while rank 0 still writes a file, say) can
    reach finalization while a worker still waits for the GIL; the worker is then ended inside a
    C++ destructor and the process aborts with "terminate called without an active exception"
    (SIGABRT, after everything succeeded; pytorch/pytorch#190489, also after
    destroy_process_group). Registered once the process has a distckpt control group: a worker
    waiting for the GIL takes it within microseconds of this sleep."""
    time.sleep(_GIL_HANDOFF_S)


def group_members(process_group: Any | None = None) -> tuple[int, ...]:
    """:meth:`ControlGroup.members` of ``process_group`` (default: the world), without a
    collective: ``()`` outside a job or for a group of one rank."""
    if not is_distributed():
        return ()
    import torch.distributed as dist
    pg = process_group if process_group is not None else dist.group.WORLD
    return tuple(dist.get_process_group_ranks(pg)) if dist.get_world_size(pg) > 1 else ()


def _drop_side_group(pg: Any, channel: str, *, destroy: bool = True) -> None:
    """Forget the side group of (``pg``, ``channel``; ``pg`` None: the world), lost. With
    ``destroy`` it is destroyed where torch can (freeing its sockets; only when no thread of this
    process can be inside one of its collectives); a failure to destroy it changes nothing (it is
    never used again). Without, it is kept referenced (:data:`_RETIRED`)."""
    import torch.distributed as dist
    if pg is None:
        pg = dist.group.WORLD
    side = _SIDE_GROUPS.pop((pg, channel), None)
    if side is None:
        return
    _LOST.pop(side, None)
    if not destroy:
        _RETIRED.append(side)
        return
    try:
        dist.destroy_process_group(side)
    except Exception as exc:  # noqa: BLE001 - it is dropped either way
        log.info("distckpt: destroying a lost control group: %s: %s", type(exc).__name__, exc)


def control_group(process_group: Any | None = None, *, channel: str = "control",
                  operation: str = "save()/load()", timeout_s: float | None = None,
                  exit_safe: bool = False, kind: str | None = None) -> ControlGroup:
    """The control group for ``process_group`` (default: the world): a gloo side group of
    distckpt's own, created once per (group, channel). Must be called by every rank of the group
    (it runs a collective the first time).

    ``channel`` separates independent streams of collectives: an async save's background phases
    use their own ("background"), so they never interleave with a load or save issued meanwhile
    by the caller's thread on the "control" channel.

    ``timeout_s``: the bound on each collective of the side group (default DISTCKPT_TIMEOUT_S),
    fixed when the group of (group, channel) is created: a later call with another value gets
    the existing group. A tiered manager's "drain" channel takes DISTCKPT_DRAIN_TIMEOUT_S, since
    its ranks wait at a gather for the slowest rank's upload.

    ``exit_safe``: the group's collectives may be left running at exit (see :class:`ControlGroup`):
    for a thread that close() may leave behind.

    ``kind``: as :func:`check_arrival` (ranks making different kinds of call at this point raise
    ConfigError together)."""
    if not is_distributed():
        return ControlGroup(None, 0, 1)
    import torch.distributed as dist
    pg = process_group if process_group is not None else dist.group.WORLD
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    if world == 1:
        # A group of one rank needs no collective, and must not create a side group:
        # dist.new_group is collective over the whole world, and only this rank is calling.
        return ControlGroup(None, 0, 1)
    # DISTCKPT_ARRIVAL_TIMEOUT_S=0 turns the check off: a missing rank is then reported by the
    # first collective, after DISTCKPT_TIMEOUT_S.
    side = _SIDE_GROUPS.get((pg, channel))
    lost = _LOST.get(side) if side is not None else None
    if channel == "control" and get_config().arrival_timeout_s > 0:
        short = _fd_shortfall(world, rank, operation) if side is None else None
        mine = tuple(c for c in _RENEWABLE if _SIDE_GROUPS.get((pg, c)) in _LOST)
        for renewed in sorted(check_arrival(pg, rank, world, operation, problem=short, renew=mine, kind=kind)):
            # Some rank's group of that channel was lost (a collective failed: a peer stalled or
            # died, and gloo closed its connections): every rank drops its own (the vote is the
            # same on every rank), and all build a new one together: the control group below,
            # another channel's where it is next used, as its first one was.
            was = _SIDE_GROUPS.get((pg, renewed))
            log.warning("distckpt: rebuilding the %s group among %d ranks for %s (lost: %s)", renewed, world,
                        operation, _LOST.get(was) or "on another rank")
            # The control channel is this thread's alone; another's lost group may still be
            # inside a failing collective of an async save's thread: never destroyed under it.
            _drop_side_group(pg, renewed, destroy=renewed == "control")
        side = _SIDE_GROUPS.get((pg, channel))
    elif lost is not None:
        # Only the control channel's arrival check is a point where every rank agrees (before
        # anything runs on any renewable channel); it runs before each use of the others.
        renewable = channel in _RENEWABLE and get_config().arrival_timeout_s > 0
        why = ("the next call's arrival check rebuilds it on every rank" if renewable else
               "without the arrival check (DISTCKPT_ARRIVAL_TIMEOUT_S=0) the ranks cannot agree to build a new one"
               if channel in _RENEWABLE else "this process builds no other one")
        raise PeerLostError(
            f"distckpt's {channel} group among {world} ranks was lost ({lost}): gloo closed its connections, "
            f"so {operation} cannot run on it, and {why}", rank=rank,
            remedy="Call it again once every rank is back." if renewable else
            "Restart the job" + (" (or keep DISTCKPT_ARRIVAL_TIMEOUT_S > 0: the group is then rebuilt at the next "
                                 "call once every rank arrives)." if channel in _RENEWABLE else "."))
    # Always a side group of our own, even over a gloo world: it carries our bounded timeout
    # (DISTCKPT_TIMEOUT_S) instead of the training group's (30 minutes by default).
    if side is None:
        try:
            # A subgroup's side group is made by its own ranks only (use_local_synchronization):
            # otherwise torch names a group by a per-process count of the groups created, which
            # the ranks outside the subgroup did not advance, so the job's next dist.new_group
            # (any group) waited for ever on names that no longer matched, and two disjoint
            # subgroups saving at once drew the same name and cross-wired their ranks. The
            # world's keeps torch's default (every rank creates it: the counts stay equal).
            side = dist.new_group(ranks=dist.get_process_group_ranks(pg), backend="gloo",
                                  timeout=datetime.timedelta(
                                      seconds=get_config().timeout_s if timeout_s is None else timeout_s),
                                  use_local_synchronization=world < dist.get_world_size())
        except Exception as exc:  # DistStoreError / DistBackendError: a peer missing or dead
            raise PeerLostError(
                f"creating distckpt's gloo control group among {world} ranks for {operation} failed: "
                f"{type(exc).__name__}: {exc}", rank=rank,
                remedy="Every rank of the group must call it; check the other ranks' logs.") from exc
        _register_exit_hooks()
        _SIDE_GROUPS[(pg, channel)] = side
    return ControlGroup(side, rank, world, exit_safe=exit_safe)
