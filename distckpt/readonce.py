"""Read-once loads: a byte range that several ranks of a load need is read from storage by one of
them and sent to the others over the job's gloo control group.

Why: a job with D replicas of each shard (DDP, HSDP, TorchRec's data-parallel tables, any
``Replicate`` placement) otherwise reads every replicated byte D times; on an object store shared
by many nodes that is D times the requests, the egress and the slowest reader's time, and a
restart after a failure is a pure load that every accelerator of the job waits for.

How (one load; collective over the control group; driven by :func:`distckpt.fill.fill`, which
plans a rank's read segments first):

  1. PLAN   Every rank sends rank 0 the keys ``(data file, offset, end)`` of its planned segments
            (a gather: O(own segments) per rank). The same tasks give the same segments on every
            rank (fill.plan_segments is a function of the tasks), so replicas' segments have equal
            keys. A key that two or more ranks need is *shared*: one of them reads it, the one
            with the fewest bytes to read so far (:func:`assign`); the others receive it. Rank 0
            sends each rank (a scatter: O(own segments)) the shared keys it takes part in, in one
            global order. A rank that failed before it could plan (a state dict that does not
            match, ...) sends its failure instead; rank 0 then tells every rank to stop before any
            byte is read (:class:`Aborted`), and the load's outcome exchange raises that failure.
  2. MOVE   Every rank walks its shared keys in the global order. The reader reads the segment
            (verifying its checksum blocks as a local read does), copies it into its own tensors
            and sends it, followed by a 16-byte status (_STATUS), down a tree of fan-out
            FAN_OUT over the ranks that need it: each receiver receives it into a bounce buffer,
            forwards it as it came to its own children, then checks every checksum block itself
            against the index and only then copies it (no byte reaches a tensor unverified,
            whatever happened on the way). No rank sends more than FAN_OUT copies of a segment,
            however many replicas. Walking one global order is what keeps it free of deadlock:
            the lowest key any rank waits on has every rank it involves there (each finished
            everything below it), and a tree's ranks only wait on their parent.
  3. REST   The segments only this rank needs are read by the ordinary fill, after the moves.

Failures: every planned message is still exchanged, so no rank waits for a message that will not
come. A reader that failed (or fails on this key) sends the status without usable bytes, naming
its error's class (a relay whose sender died forwards a PeerLostError status); the receiver raises
that class (a ChecksumMismatchError for a bad block on the reading rank's storage, with its
offset), marks the key unfilled and goes on. A receiver that failed still receives, forwards and
discards. Every wait has the control group's DISTCKPT_TIMEOUT_S: a peer that died is a
PeerLostError naming it, and is skipped afterwards. The load then raises on every rank (the
outcome exchange), with ``filled`` / ``partly_filled`` naming what was filled with verified bytes
(kept on a rank whose outcome exchange itself lost the dead peer: ControlGroup.exchange_outcome).

When (``DISTCKPT_READ_ONCE``): ``on`` shares whenever two ranks need the same segment; ``off``
never (no extra collective); ``auto`` (default) shares for an object store (no two ranks share a
page cache there) and for a local path when the group spans more than one host; on a single host
a local file that fits the page cache is read from the device once anyway (distckpt's read-cache
rule), so ``auto`` leaves it off there (docs/BENCHMARKS.md has both measured). The setting must be
the same on every rank of the job, like every DISTCKPT_* setting: a rank with ``off`` skips the
plan's collective, and the others then fail at DISTCKPT_TIMEOUT_S with a PeerLostError.

Memory: two bounce buffers of the fill's segment size read ahead for sending and one for
receiving, all released before the rest of the fill maps its own.
"""

from __future__ import annotations

import dataclasses
import datetime
import queue
import socket
import struct
import threading
from typing import Any, Callable, Mapping, Sequence

from ._dist import ControlGroup
from .config import get_config
from .errors import (ChecksumMismatchError, CheckpointCorruptError, CheckpointNotFoundError, DataFileMissingError,
                     DataFileTruncatedError, DistCkptError, PeerLostError, StorageError)
from .storage import is_url

__all__ = ["Exchange", "Aborted", "assign", "for_load"]

#: What a reader's status says went wrong, by index + 1 (0: the bytes are good). A receiver raises
#: the first class here the reader's error is an instance of: the class its caller catches.
_CLASSES: tuple[type[DistCkptError], ...] = (ChecksumMismatchError, DataFileMissingError, DataFileTruncatedError,
                                              CheckpointCorruptError, CheckpointNotFoundError, StorageError,
                                              PeerLostError, DistCkptError)
# After a segment's bytes: the status (0: good, else 1 + the index of the reader's error class in
# _CLASSES) and a detail (for a checksum mismatch, the bad block's file offset; else -1).
_STATUS = struct.Struct("<qq")

Key = tuple[int, int, int]   # (data file index, aligned offset, aligned end)


class Aborted(Exception):
    """Another rank failed before the moves: this rank read and changed nothing (the load's
    outcome exchange raises the other rank's error here too)."""


#: How many ranks one rank sends a shared segment to: the reader sends it to FAN_OUT receivers,
#: each of which forwards it to FAN_OUT more (a tree), so no rank sends more than FAN_OUT copies
#: of a segment however many replicas need it, and a segment reaches D ranks in log2(D) hops.
FAN_OUT = 2


@dataclasses.dataclass(frozen=True)
class Move:
    """One shared key on one rank: ``tag`` (its number in the global order, the messages' tag),
    ``reader`` (the rank that reads it from storage), ``src`` (the rank this one receives it from;
    ``reader`` itself on the reader) and ``dst`` (the ranks this one sends or forwards it to)."""

    key: Key
    tag: int
    reader: int
    src: int
    dst: tuple[int, ...]


def assign(needs: Sequence[Sequence[Key] | None]) -> list[list[Move]]:
    """Rank 0's plan: ``needs[r]``, the segment keys rank r plans to read, to each rank's moves in
    the global (key) order. Each shared key is read by the rank that needs it with the fewest bytes
    to read so far (its unshared segments counted first), ties broken by rotating over the ranks by
    the key's number; the other ranks that need it form a tree of fan-out FAN_OUT below the reader
    (receivers in rank order, starting after the reader's, so the relays change from key to key).
    Deterministic."""
    holders: dict[Key, list[int]] = {}
    for r, keys in enumerate(needs):
        for k in keys or ():
            holders.setdefault(k, []).append(r)
    load = [0] * len(needs)
    for k, rs in holders.items():
        if len(rs) == 1:
            load[rs[0]] += k[2] - k[1]
    out: list[list[Move]] = [[] for _ in needs]
    world = len(needs)
    for tag, k in enumerate(sorted(k for k, rs in holders.items() if len(rs) > 1)):
        rs = holders[k]
        reader = min(rs, key=lambda r: (load[r], (r - tag) % world))
        load[reader] += k[2] - k[1]
        order = [reader] + sorted((r for r in rs if r != reader), key=lambda r: (r - reader) % world)
        for i, r in enumerate(order):
            children = tuple(order[c] for c in range(FAN_OUT * i + 1, min(FAN_OUT * i + FAN_OUT + 1, len(order))))
            out[r].append(Move(k, tag, reader, order[(i - 1) // FAN_OUT] if i else reader, children))
    return out


# group.pg -> the hosts of its ranks (one all-gather per group, the first time it is needed)
_HOSTS: dict[Any, tuple[str, ...]] = {}


def for_load(group: ControlGroup, path: str) -> "Exchange | None":
    """The exchange of one load of ``path`` over ``group``, or None when this load reads alone
    (one rank, ``DISTCKPT_READ_ONCE=off``, or ``auto`` on a local path with every rank on one
    host). The same answer on every rank (the same setting and path; the hosts all-gathered once).
    Collective the first time a group needs its hosts.

    Raises PeerLostError: the hosts' all-gather failed."""
    mode = get_config().read_once
    if group.world_size == 1 or mode == "off":
        return None
    if mode == "auto" and not is_url(path):
        hosts = _HOSTS.get(group.pg)
        if hosts is None:
            hosts = _HOSTS[group.pg] = tuple(group.all_gather(socket.gethostname()))
        if len(set(hosts)) == 1:
            return None
    return Exchange(group)


class Exchange:
    """The read-once part of one load on this rank (module docstring). Every rank of the group
    joins its plan exactly once: :meth:`run` from the fill, or :meth:`finish` when this rank's load
    never reached a fill with checksums (it failed, or it reads a chain or a DCP directory)."""

    def __init__(self, group: ControlGroup) -> None:
        self.group = group
        self.joined = False
        self.received = 0    # bytes this rank received and used

    # -- the plan ---------------------------------------------------------------------------------

    def _plan(self, keys: list[Key] | None) -> list[Move] | None:
        """The collective of step 1: ``keys`` (None: this rank failed) -> this rank's moves, or
        None when some rank failed."""
        self.joined = True
        needs = self.group.gather(keys)
        plans = None
        if self.group.rank == 0:
            plans = [None] * len(needs) if any(n is None for n in needs) else assign(needs)
        return self.group.scatter(plans)

    def finish(self, error: BaseException | None) -> None:
        """Join the plan with no segment (or as failed, when ``error``) if this rank has not yet:
        called by every load after its local part, whatever happened."""
        if not self.joined:
            self._plan(None if error is not None else [])

    # -- the moves --------------------------------------------------------------------------------

    def run(self, segments: list, outcome: Any, paths: Mapping[int, str], open_reader: Callable[[str], Any],
            blocks: Mapping[int, int], verify: bool, bufsize: int) -> list:
        """Plan with the other ranks and do this rank's moves for ``segments`` (fill's planned
        segments; ``outcome``: the fill's record of what was copied and its first error). Returns
        the segments this rank still reads itself. Raises :class:`Aborted` when another rank failed
        before the moves (nothing was read or copied)."""
        from .fill import _Buffer

        mine = {(s.file_index, s.offset, s.end): s for s in segments if not s.deps}
        moves = self._plan(sorted(mine))
        if moves is None:
            raise Aborted()
        if not moves:
            return segments
        shared = {m.key for m in moves}
        bufs = [_Buffer(bufsize + _STATUS.size) for _ in range(3)]
        try:
            self._moves(moves, mine, outcome, paths, open_reader, blocks, verify, bufs)
        finally:
            for b in bufs:
                b.close()
        return [s for s in segments if (s.file_index, s.offset, s.end) not in shared]

    def _moves(self, moves: list[Move], mine: dict, outcome: Any, paths: Mapping[int, str],
               open_reader: Callable[[str], Any], blocks: Mapping[int, int], verify: bool, bufs: list) -> None:
        """Step 2 (module docstring) on this rank: ``moves`` in their global order, the reads
        of the ones it sends on a thread one segment ahead."""
        from .fill import verify_read

        group = self.group
        bound = datetime.timedelta(seconds=get_config().timeout_s)
        lost: set[int] = set()   # peers found dead: skipped from then on
        reads = [m for m in moves if m.reader == group.rank]
        ready: queue.Queue = queue.Queue()
        free: queue.Queue = queue.Queue()
        for b in bufs[:2]:
            free.put(b)
        stop = threading.Event()

        def read_ahead() -> None:
            # The reader's side, one segment ahead of the network: read, verify, and hand over
            # (buffer, status, error). After a failure it hands over status-only buffers.
            readers: dict[int, Any] = {}
            failed: BaseException | None = None
            try:
                for m in reads:
                    buf = free.get()
                    if stop.is_set():
                        return
                    seg = mine[m.key]
                    err = failed if failed is not None else outcome.error
                    n = 0
                    if err is None:
                        try:
                            r = readers.get(seg.file_index)
                            if r is None:
                                for old in readers.values():
                                    old.close()
                                readers.clear()
                                r = readers[seg.file_index] = open_reader(paths[seg.file_index])
                            n = min(seg.end, r.size) - seg.offset
                            r.read_into([(seg.offset, n, buf.view[:seg.end - seg.offset])])
                            if verify:
                                verify_read(r, paths[seg.file_index], seg, n, buf.view, blocks[seg.file_index])
                        except BaseException as exc:  # noqa: BLE001 - sent as a status, raised by the fill
                            err = failed = exc
                    ready.put((m, buf, err, n))
            finally:
                for r in readers.values():
                    r.close()
                ready.put(None)

        thread = threading.Thread(target=read_ahead, name="distckpt-read-once", daemon=True) if reads else None
        if thread is not None:
            thread.start()
        rbuf = bufs[2]
        try:
            for m in moves:
                seg = mine[m.key]
                size = seg.end - seg.offset
                if m.reader == group.rank:
                    self._send(m, seg, size, ready, free, outcome, lost, bound, paths[seg.file_index])
                else:
                    self._receive(m, seg, size, rbuf, outcome, lost, bound, paths, blocks, verify)
        finally:
            stop.set()
            if thread is not None:
                for b in bufs[:2]:   # unblock a read-ahead waiting for a buffer
                    free.put(b)
                thread.join()

    def _send(self, m: Move, seg: Any, size: int, ready: queue.Queue, free: queue.Queue, outcome: Any,
              lost: set, bound: datetime.timedelta, fpath: str) -> None:
        """The reader's side of one move: the read-ahead's next buffer copied into this rank's own
        tensors (when good) and sent, with its status, to its receivers (``m.dst``)."""
        import torch

        from .fill import _copy

        got = ready.get()
        if got is None:
            raise RuntimeError("read-once: the read-ahead thread ended before its last move")  # a bug
        _m, buf, err, n = got
        try:
            status = 0 if err is None else 1 + _class_index(err)
            detail = getattr(err, "offset", -1) if err is not None else -1
            if err is not None:
                outcome.fail(err)
            elif not outcome.failed():
                with torch.no_grad():
                    _copy(seg, buf.tensor)
                outcome.copied([u.task.fqn for u in seg.units], n)
            buf.view[size:size + _STATUS.size] = _STATUS.pack(status, detail if isinstance(detail, int) else -1)
            self._forward(m, buf, size, outcome, lost, bound, fpath, seg)
        finally:
            free.put(buf)

    def _forward(self, m: Move, buf: Any, size: int, outcome: Any, lost: set, bound: datetime.timedelta,
                 fpath: str, seg: Any) -> None:
        """Send ``buf`` (the segment's ``size`` bytes and the status after them) to ``m.dst``, one
        after the other, each wait bounded; a receiver found dead is skipped from then on."""
        if not m.dst:
            return
        import torch
        import torch.distributed as dist

        group = self.group
        payload = torch.frombuffer(buf.view[:size + _STATUS.size], dtype=torch.uint8)
        try:
            for d in m.dst:
                if d in lost:
                    continue
                try:
                    req = group._wrap("read-once send", dist.isend, payload, group._global(d), group.pg, m.tag)
                    group._wrap("read-once send", req.wait, bound)
                except PeerLostError as exc:
                    lost.add(d)
                    outcome.fail(_peer_lost(exc, d, "receiving", m, seg, fpath))
        finally:
            del payload

    def _receive(self, m: Move, seg: Any, size: int, rbuf: Any, outcome: Any, lost: set,
                 bound: datetime.timedelta, paths: Mapping[int, str], blocks: Mapping[int, int],
                 verify: bool) -> None:
        """A receiver's side of one move: the bytes and status received from ``m.src`` into
        ``rbuf`` and forwarded as they came to ``m.dst`` (this rank's children in the move's tree;
        each checks them itself), then every checksum block verified here and the segment copied
        into this rank's tensors. After this rank failed it still receives and forwards (no rank
        must wait for a message that will not come) and uses nothing. When its sender is dead it
        forwards a PeerLostError status instead."""
        import torch
        import torch.distributed as dist

        from .fill import _copy, _verify

        group = self.group
        got = m.src not in lost
        if got:
            view = torch.frombuffer(rbuf.view[:size + _STATUS.size], dtype=torch.uint8)
            try:
                req = group._wrap("read-once receive", dist.irecv, view, group._global(m.src), group.pg, m.tag)
                group._wrap("read-once receive", req.wait, bound)
            except PeerLostError as exc:
                lost.add(m.src)
                outcome.fail(_peer_lost(exc, m.src, "sending", m, seg, paths[seg.file_index]))
                got = False
            finally:
                del view
        if not got:
            rbuf.view[size:size + _STATUS.size] = _STATUS.pack(1 + _CLASSES.index(PeerLostError), -1)
        self._forward(m, rbuf, size, outcome, lost, bound, paths[seg.file_index], seg)
        status, detail = _STATUS.unpack(rbuf.view[size:size + _STATUS.size])
        if not got or outcome.failed():
            return
        try:
            if status != 0:
                raise _peer_error(status, detail, m, seg, paths[seg.file_index])
            if verify:
                _verify(paths[seg.file_index], seg, rbuf.view, blocks[seg.file_index])
            with torch.no_grad():
                _copy(seg, rbuf.tensor)
        except BaseException as exc:  # noqa: BLE001 - raised by the fill
            outcome.fail(exc)
            return
        outcome.copied([u.task.fqn for u in seg.units], 0)
        self.received += size


def _class_index(exc: BaseException) -> int:
    from .fill import _Bad   # a block that failed its check, before fill() names it

    if isinstance(exc, _Bad):
        return _CLASSES.index(ChecksumMismatchError)
    for i, cls in enumerate(_CLASSES):
        if isinstance(exc, cls):
            return i
    return len(_CLASSES) - 1


def _peer_lost(exc: PeerLostError, peer: int, doing: str, m: Move, seg: Any, fpath: str) -> PeerLostError:
    """A lost peer of a move, named: which rank, doing what, with which bytes."""
    import os

    return PeerLostError(
        f"rank {peer}, {doing} bytes [{seg.offset}, {seg.end}) of {os.path.basename(fpath)} in this load's read-once "
        f"exchange (read by rank {m.reader}), died or did not answer within DISTCKPT_TIMEOUT_S: {exc.message}",
        path=fpath, peer=peer)


def _peer_error(status: int, detail: int, m: Move, seg: Any, fpath: str) -> DistCkptError:
    """The error a receiver raises for a reader's failed status: the reader's class."""
    import os

    cls = _CLASSES[min(status - 1, len(_CLASSES) - 1)]
    name = os.path.basename(fpath)
    via = f" (forwarded by rank {m.src})" if m.src != m.reader else ""
    what = (f"rank {m.reader}, which reads bytes [{seg.offset}, {seg.end}) of {name} for this rank too "
            f"(DISTCKPT_READ_ONCE){via}, failed on them or before them with {cls.__name__}; the failing rank's "
            f"own error says why")
    if cls is ChecksumMismatchError:
        # The bad block's offset, as the reader found it (the segment's start if it did not say).
        at = detail if detail >= 0 else seg.offset
        key = next((u.task.fqn for u in seg.units if u.at <= at < u.at + u.hi - u.lo), seg.units[0].task.fqn)
        return ChecksumMismatchError(what + f" (the bad block starts at byte {at})", path=fpath, file=name, key=key,
                                     offset=at, reader=m.reader)
    return cls(what, path=fpath, reader=m.reader)
