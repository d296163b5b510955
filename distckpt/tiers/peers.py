"""Peer transfers: data files of a committed step copied from one node's local tier to another's
over the job's own process group (a gloo side group), every byte checked against the step's
checksums on both ends. Used for replicas (each rank's file kept on ``replicas`` other nodes after
a save, :func:`replica_transfers`) and by a restore whose node lacks files another node holds (a
replaced node, :func:`distckpt.tiers.load.load_tiered`).

:func:`run_transfers` is collective over the group it is given; every rank runs the same rounds:

  1. ROUNDS   the transfers are cut into rounds in which a rank sends at most one file and
              receives at most one (:func:`schedule`), the same list on every rank.
  2. MOVE     in a round, a sender streams its file through distckpt.tiers.verified (every block
              and the index checked as read: a damaged local byte is never sent as good) in pieces
              of READ_PIECE bytes. Each piece moves in one exchange of the whole group
              (:meth:`distckpt._dist.ControlGroup.exchange`, an all-to-all in which a rank sends
              at most one piece and receives at most one), as many exchanges as the round's
              longest file has pieces, on every rank: no point-to-point send, which gloo completes
              only inside a blocking wait that a drain thread left at exit would abort in. A rank
              whose own create or write fails goes on exchanging to the last round (sending its
              files, dropping what it receives), so that no partner waits for bytes that will not
              come; a sender whose read fails sends zeros for the rest of that file, which then
              fail its receiver's check (the sender's error alone is reported: OUTCOME).
              The receiver writes into a private area of its node's local root
              (``.step_N.peer-<32 hex>/``, :func:`peer_area`: not a save's ``.tmp-`` name, which a
              save's reclaim would take for a dead save's and delete mid-transfer; a leftover the
              next manager's construction removes, :func:`remove_peer_areas`), fsyncs, then reads
              the file back through the same verified reader.
  3. OUTCOME  one all-gather: which files each rank received and verified, or its error.
  4. INSTALL  each node's leader moves its ranks' verified files into the node's step directory
              (renames, then a directory fsync); a node that holds no copy of the step gets one
              made like a save's: a fresh area with the MANIFEST's bytes, fsynced, renamed to
              ``step_N`` (the MANIFEST is the reference save's, byte for byte). A node whose
              directory holds another save of the step is left alone (reported).
  5. VERDICT  one all-gather: every rank returns the files its node gained, or every rank raises
              the same typed error.

Every wait has the group's deadline: a peer that dies mid-transfer is a PeerLostError on every
rank within the group's timeout (the pieces are bounded, so a live peer always progresses).
Memory per rank: two pieces each way in flight, two read ahead.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import queue
import re
import threading
import uuid
from typing import Callable

from .. import manifest as mf
from .._dist import ControlGroup, _portable
from ..errors import (CheckpointCorruptError, DistCkptError, HostMemoryError, PeerLostError, TierIncompleteError,
                      from_os_error, typed_memory_error)
from ..storage import Store, basename, dirname, join
from .nodes import NodeLayout
from .verified import piece_sizes, stream_verified

__all__ = ["Transfer", "schedule", "replica_transfers", "unreplicated", "fetch_transfers", "run_transfers", "PeerResult"]

log = logging.getLogger("distckpt")


@dataclasses.dataclass(frozen=True, order=True)
class Transfer:
    """Data file ``file`` of the step sent by rank ``src`` (whose node holds it) to rank ``dst``
    (which installs it in its node's directory)."""

    file: int
    src: int
    dst: int


@dataclasses.dataclass(frozen=True)
class PeerResult:
    """What :func:`run_transfers` did: ``installed[n]``: the files node n gained (every rank
    gets the whole list); ``sent``/``received``: this rank's bytes."""

    installed: dict
    sent: int
    received: int


def schedule(transfers: list[Transfer]) -> list[list[Transfer]]:
    """The transfers cut into rounds in which each rank sends at most one file and receives at
    most one, in a deterministic order (every rank computes the same rounds)."""
    rounds: list[list[Transfer]] = []
    busy: list[tuple[set, set]] = []
    for t in sorted(transfers):
        for k, (senders, receivers) in enumerate(busy):
            if t.src not in senders and t.dst not in receivers:
                rounds[k].append(t)
                senders.add(t.src)
                receivers.add(t.dst)
                break
        else:
            rounds.append([t])
            busy.append(({t.src}, {t.dst}))
    return rounds


def _spread(ranks: list[int], key: int) -> int:
    return ranks[key % len(ranks)]


_PEER_AREA_RE = re.compile(r"^\.step_[0-9]+\.peer-[0-9a-f]{32}\Z")


def peer_area(step_path: str) -> str:
    """A new private area beside ``step_path`` for files received from peers (or a copy of the
    step made around them), named so that no save's reclaim takes it for its own."""
    return join(dirname(step_path), f".{basename(step_path)}.peer-{uuid.uuid4().hex}")


def remove_peer_areas(root: str) -> list[str]:
    """Remove the peer areas (:func:`peer_area`) under the local root ``root``: what transfers
    that died left. Only while no transfer can be in flight into ``root``: a manager's
    construction, holding the local tier's owner lock, before its drain thread starts. Returns
    the names removed; raises StorageError subclasses."""
    try:
        names = [n for n in os.listdir(root) if _PEER_AREA_RE.match(n)]
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise from_os_error(exc, path=root, operation="list") from exc
    for name in names:
        _remove_tree(join(root, name))
    if names:
        log.info("distckpt: removed %d areas of peer transfers that did not finish under %s: %s", len(names), root,
                 names)
    return names


def replica_transfers(layout: NodeLayout, header: mf.Manifest, held: list[frozenset], replicas: int) -> list[Transfer]:
    """The transfers that give each data file ``replicas`` copies on nodes other than its home:
    its writer's node when its writer (rank i for file i) is in this job and that node holds it,
    else the first node in ring order (from the writer's node, or node 0) that holds it (ranks
    placed on other nodes at a restart, or a step saved by more ranks). File i goes to the next
    ``replicas`` nodes in ring order after its home, to the rank there with the same position in
    its node as the sender (spread), from its writer or else a rank of its home. ``held[n]``: the
    files node n holds already (skipped). A file no node holds is sent by no one: see
    :func:`unreplicated`."""
    nodes = len(layout.leaders)
    out = []
    for i, entry in enumerate(header.files):
        w = entry.rank if entry.rank is not None and entry.rank < len(layout.node_of) else None
        start = layout.node_of[w] if w is not None else 0
        home = next((n for n in ((start + k) % nodes for k in range(nodes)) if i in held[n]), None)
        if home is None:
            continue
        src = w if w is not None and layout.node_of[w] == home else _spread(layout.ranks_of(home), i)
        pos = layout.ranks_of(home).index(src)
        for j in range(1, min(replicas, nodes - 1) + 1):
            target = (home + j) % nodes
            if i not in held[target]:
                out.append(Transfer(i, src, _spread(layout.ranks_of(target), pos)))
    return out


def unreplicated(layout: NodeLayout, nfiles: int, held: list[frozenset], transfers: list[Transfer],
                 replicas: int) -> list[int]:
    """The data files that will not have ``replicas`` copies beyond their first (or one on every
    node, with fewer nodes) once ``transfers`` landed: held by no node, or by too few."""
    want = min(replicas, len(layout.leaders) - 1) + 1
    copies = [sum(i in h for h in held) for i in range(nfiles)]
    for t in transfers:
        copies[t.file] += 1
    return [i for i in range(nfiles) if copies[i] < want]


def replica_bytes_of_node(layout: NodeLayout, sizes: list[int], replicas: int, node: int) -> int:
    """The bytes of replicas ``node`` holds of one step whose rank r wrote ``sizes[r]`` bytes, by
    :func:`replica_transfers`' placement: the files of the ranks on the ``replicas`` nodes before
    it in ring order (for the local tier's room check)."""
    nodes = len(layout.leaders)
    return sum(sizes[r] for j in range(1, min(replicas, nodes - 1) + 1)
               for r in layout.ranks_of((node - j) % nodes))


def fetch_transfers(layout: NodeLayout, wanted: list[set], held: list[frozenset]) -> tuple[list[Transfer], set]:
    """The transfers that give every node the files its ranks want (``wanted[r]``: file indexes
    rank r needs that its node lacks) from a node that holds them (``held[n]``), each from the
    holder's rank chosen by the file's number (spread) to the wanting node's rank likewise.
    Returns (transfers, the files no node holds)."""
    need: dict[int, set] = {}
    for r, files in enumerate(wanted):
        need.setdefault(layout.node_of[r], set()).update(files)
    out, nowhere = [], set()
    for node in sorted(need):
        for i in sorted(need[node]):
            holders = [n for n in range(len(layout.leaders)) if n != node and i in held[n]]
            if not holders:
                nowhere.add(i)
                continue
            src_node = holders[i % len(holders)]
            out.append(Transfer(i, _spread(layout.ranks_of(src_node), i), _spread(layout.ranks_of(node), i)))
    return out, nowhere


# ------------------------------------------------------------------------------------------------
# run_transfers


@dataclasses.dataclass(frozen=True)
class _Outcome:
    """One rank's report after the rounds: the files it received and verified, in ``area``
    (None when it received none), or its error; ``unsent``: (file, receiving rank) of each file
    whose read failed on this rank as its sender; ``bad``: the received file whose copy failed its
    check (``error``)."""

    area: str | None
    files: tuple[int, ...]
    error: BaseException | None
    unsent: tuple[tuple[int, int], ...] = ()
    bad: int | None = None


def run_transfers(group: ControlGroup, transfers: list[Transfer], *, layout: NodeLayout, store: Store,
                  step_path: str, header: mf.Manifest, manifest: bytes,
                  progress: Callable[[int], None] | None = None) -> PeerResult:
    """Move ``transfers`` (module docstring), collective over ``group`` (every rank passes the same
    list, and its own node's ``step_path``). ``store``: the local tier's store; ``header``/
    ``manifest``: the step's MANIFEST (decoded, and its bytes for a node that has no copy).
    ``progress(n)``: called with each piece this rank sent. Each piece's exchange is bounded by
    the group's timeout (a peer that stops answering is a PeerLostError after it).

    Returns the same PeerResult on every rank. Raises on every rank (the failing ranks' common
    class, distckpt.errors.collective_error): ChecksumMismatchError (a sender's local byte, or a
    received file that does not match), TierIncompleteError (a node holds another save of the
    step), PeerLostError (a peer died or did not answer within the group's timeout), the local
    store's typed errors (a full disk...). Nothing is installed unless verified; a failed rank's
    area is removed.
    """
    rank = group.rank
    area, got, sent, received, error = None, [], 0, 0, None
    unsent: list[tuple] = []  # (file, receiver, error) of this rank's reads that failed (zeros sent)
    bad = None  # the received file whose copy failed its check
    rounds = schedule(transfers)
    # Every buffer is made before the first exchange, and a rank that cannot have them (out of
    # memory) says so to all: one that failed inside a round would leave its partners waiting
    # out the group's deadline in that round's exchanges.
    buffers, alloc_error = None, None
    try:
        buffers = _buffers(group, rounds, rank, header)
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        alloc_error = exc
    group.exchange_outcome(alloc_error, operation="peer transfer")
    try:
        for rnd in rounds:
            out = next((t for t in rnd if t.src == rank), None)
            into = next((t for t in rnd if t.dst == rank), None)
            # Every rank takes part in each of the round's exchanges (collectives), one with
            # nothing to move and one that failed already too (it still sends its file, and drops
            # what it receives): no peer waits out a deadline for a rank whose own disk failed.
            count = max(len(piece_sizes(header.files[t.file].size)) for t in rnd)
            if into is not None and area is None and error is None:
                area = peer_area(step_path)
                try:
                    _mkdir(area)
                except Exception as exc:  # noqa: BLE001 - reported to every rank below
                    error = exc
            try:
                s, r = _move(group, out, into, count, store, step_path, area, header, buffers, progress, unsent,
                             drop=error is not None)
                sent, received = sent + s, received + r
                if into is not None and error is None:
                    got.append(into.file)
            except PeerLostError:
                raise  # the group is lost: no further exchange can run
            except Exception as exc:  # noqa: BLE001 - this rank's own: the rounds go on, reported below
                error = error or exc
        if error is None:
            for i in got:  # read back: what landed on this node's disk is what was saved
                bad = i
                stream_verified(store, area, header, i, lambda _pos, _piece: None)
            bad = None
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        error = error or exc
    try:
        # The zeros a failed read sent are named only when that read's error is the one this rank
        # reports: its receiver's failed check is then that error's consequence. Behind another
        # error of this rank (a full disk first), the receiver's check is what reports the read.
        zeros_sent = tuple((f, d) for f, d, e in unsent if e is error)
        outcomes = group.all_gather(_Outcome(area, tuple(got), _portable(error) if group.world_size > 1 else error,
                                             zeros_sent, bad))
        # A copy that failed its check because its sender's read failed (zeros were sent) is that
        # read's consequence, not a second fault: the sender's error alone is reported.
        zeros = {sent for o in outcomes for sent in o.unsent}
        errors = [None if (o.bad, r) in zeros and isinstance(o.error, CheckpointCorruptError) else o.error
                  for r, o in enumerate(outcomes)]
        if errors[rank] is None and error is not None:
            log.warning("distckpt: peer transfer: the copy of %s received on this rank failed its check because "
                        "its sender could not read it (%s)", header.files[bad].name, error)
        installed, install_error = {}, None
        try:
            if not any(o.error is not None for o in outcomes):
                installed = {n: sorted(i for r in layout.ranks_of(n) for i in outcomes[r].files)
                             for n in range(len(layout.leaders))}
                if layout.is_leader and installed[layout.node]:
                    # The leader moves files out of its node's ranks' areas: each rank removes its
                    # own area only after the exchange below, which the leader joins after this.
                    _install(store, step_path, header, manifest,
                             [(outcomes[r].area, outcomes[r].files) for r in layout.ranks_of(layout.node)])
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            install_error = exc
        group.raise_failures(errors, error if errors[rank] is not None else None, operation="peer transfer")
        group.exchange_outcome(install_error, operation="peer transfer")
    finally:
        if area is not None:
            _remove_tree(area)
    return PeerResult(installed, sent, received)


def _move(group: ControlGroup, out: Transfer | None, into: Transfer | None, count: int, store: Store,
          step_path: str, area: str | None, header: mf.Manifest, buffers: tuple[list, list],
          progress: Callable[[int], None] | None, unsent: list[int], *, drop: bool = False) -> tuple[int, int]:
    """One round on this rank: ``count`` exchanges (:meth:`ControlGroup.exchange`), in which it
    sends the pieces of ``out``'s file and receives those of ``into``'s (None: nothing that way).
    ``buffers``: (send, receive) lists of :func:`_buffers`, each buffer as large as a piece.
    ``unsent``: (``out``'s file, its receiver, the read's error) is appended when its read failed
    (zeros were sent).
    ``drop``: this rank failed already: it writes nothing it receives (its own file it still sends:
    its receiver's copy is good, and its error is the one the rounds report). Returns (bytes sent,
    bytes received). This rank's own errors (its read, its file's create, write or fsync) are
    raised only after the round's last exchange: its partners never wait for bytes that will not
    come (a sender's zeros then fail its receiver's check). A failed exchange raises at once
    (PeerLostError: the group is lost)."""
    import numpy as np

    send_sizes = piece_sizes(header.files[out.file].size) if out is not None else []
    recv_sizes = piece_sizes(header.files[into.file].size) if into is not None else []
    pieces: queue.Queue = queue.Queue(maxsize=2)
    failed: list[BaseException] = []  # this rank's own errors, the reader's included
    stop = threading.Event()

    def read() -> None:  # the sender's reads and checks, one piece ahead of the network
        try:
            def consume(_pos: int, piece: memoryview) -> None:
                if stop.is_set():
                    raise _Stopped()
                pieces.put(bytearray(piece))

            stream_verified(store, step_path, header, out.file, consume)
        except _Stopped:
            pass
        except Exception as exc:  # noqa: BLE001 - sent as zeros, raised after the round
            typed = typed_memory_error(exc)
            failed.append(typed)
            unsent.append((out.file, out.dst, typed))
        finally:
            pieces.put(None)

    reader = None
    if out is not None:
        reader = threading.Thread(target=read, name="distckpt-peer-read", daemon=True)
        try:
            reader.start()
        except RuntimeError as exc:  # "can't start new thread" (no memory for its stack): zeros are sent
            typed = HostMemoryError(f"peer transfer: the reader of {header.files[out.file].name} could not start: "
                                    f"{exc}", errno=errno.ENOMEM)
            failed.append(typed)
            unsent.append((out.file, out.dst, typed))
            reader = None
            pieces.put(None)
    fd = -1
    sent = received = 0
    try:
        if into is not None and not drop:
            target = join(area, header.files[into.file].name)
            try:
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                failed.append(from_os_error(exc, path=target, operation="create"))
        # Two buffers each way (run_transfers made them): piece k+1's exchange runs while piece k
        # is written and piece k+2 read, so the network and the disks overlap instead of taking
        # turns. The calls into torch go through group.call: on the drain thread, none starts at
        # exit.
        sbufs, rbufs = buffers
        ways = len(sbufs)
        rviews = group.call(lambda: [memoryview(t.numpy()) for t in rbufs])
        pending = None  # (wait, piece index) of the exchange launched in the last iteration
        done_reading = reader is None

        def finish(wait, k: int) -> None:
            nonlocal sent, received
            wait()
            if k < len(recv_sizes):
                if fd >= 0 and not failed:
                    try:
                        _write_all(fd, rviews[k % ways][:recv_sizes[k]], target)
                    except Exception as exc:  # noqa: BLE001 - raised after the round
                        failed.append(exc)
                received += recv_sizes[k]
            if k < len(send_sizes):
                sent += send_sizes[k]
                if progress is not None:
                    progress(send_sizes[k])

        def staged(k: int, data) -> "torch.Tensor":
            piece = sbufs[k % ways][:send_sizes[k]]
            piece.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
            return piece

        for k in range(count):
            send = recv = None
            if k < len(send_sizes):
                data = None if done_reading else pieces.get()
                if data is None:  # the read failed or ended early: zeros keep the receiver in step
                    done_reading = True
                    data = bytes(send_sizes[k])
                send = group.call(staged, k, data)
            if k < len(recv_sizes):
                recv = group.call(lambda: rbufs[k % ways][:recv_sizes[k]])
            wait = group.exchange("peer transfer", send, out.dst if out is not None else None, recv,
                                  into.src if into is not None else None)
            if pending is not None:
                finish(*pending)
            pending = (wait, k)
        if pending is not None:
            finish(*pending)
        if fd >= 0 and not failed:
            try:
                os.fsync(fd)
            except OSError as exc:
                failed.append(from_os_error(exc, path=target, operation="fsync"))
    finally:
        stop.set()
        if fd >= 0:
            os.close(fd)
        if reader is not None:
            while reader.is_alive():  # unblock a reader waiting on a full queue
                try:
                    pieces.get_nowait()
                except queue.Empty:
                    reader.join(0.05)
    if failed:
        raise failed[0]
    return sent, received


def _buffers(group: ControlGroup, rounds: list, rank: int, header: mf.Manifest) -> tuple[list, list]:
    """(send, receive) buffers of this rank for every round of ``rounds``: two each way (one when
    no file of its has more than one piece), as large as its largest piece that way. Memory torch
    owns: gloo's thread releases the buffers of an exchange, and a Python buffer's release would
    need the GIL. Raises HostMemoryError when the memory cannot be had."""
    import torch

    def largest(pick) -> tuple[int, int]:
        sizes = [piece_sizes(header.files[t.file].size) for rnd in rounds for t in rnd if pick(t)]
        return max((max(p, default=0) for p in sizes), default=0), max((len(p) for p in sizes), default=0)

    (send, send_n), (recv, recv_n) = largest(lambda t: t.src == rank), largest(lambda t: t.dst == rank)
    ways = 2 if max(send_n, recv_n) > 1 else 1
    try:
        return group.call(lambda: tuple([torch.empty(n, dtype=torch.uint8) for _ in range(ways)]
                                        for n in (send, recv)))
    except MemoryError as exc:
        raise typed_memory_error(exc) from None
    except RuntimeError as exc:  # torch's CPU allocator: "DefaultCPUAllocator: can't allocate memory"
        if "allocate" not in str(exc):
            raise
        raise HostMemoryError(f"peer transfer buffers ({ways} x {send} + {ways} x {recv} bytes): {exc}",
                              errno=errno.ENOMEM, needed=ways * (send + recv)) from exc


class _Stopped(Exception):
    """The round ended before the reader did (an error elsewhere)."""


def _write_all(fd: int, data: memoryview, path: str) -> None:
    while data.nbytes:
        try:
            n = os.write(fd, data)
        except OSError as exc:
            raise from_os_error(exc, path=path, operation="write") from exc
        data = data[n:]


def _mkdir(path: str) -> None:
    try:
        os.mkdir(path, 0o755)
    except OSError as exc:
        raise from_os_error(exc, path=path, operation="mkdir") from exc


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise from_os_error(exc, path=path, operation="fsync") from exc


def _remove_tree(path: str) -> None:
    import shutil
    shutil.rmtree(path, ignore_errors=True)


def _install(store: Store, step_path: str, header: mf.Manifest, manifest: bytes,
             received: list[tuple[str | None, tuple[int, ...]]]) -> None:
    """The node leader's INSTALL (module docstring): the verified files of this node's ranks into
    its step directory, or a new copy of the step made around them.

    Raises TierIncompleteError when the directory holds another save of the step, and the
    store's typed errors."""
    try:
        there = store.committed_save_id(step_path)
    except DistCkptError:
        there = None
    moves = [(join(a, header.files[i].name), header.files[i].name) for a, files in received if a for i in files]
    if there is not None and there != header.save_id:
        raise TierIncompleteError(
            f"{step_path} holds save {there} of the step, not {header.save_id}: the files received from peers were "
            f"not installed there", path=step_path, step=basename(step_path),
            files=[name for _, name in moves], tiers={"local": there},
            remedy="Remove the stale copy of the step from this node's local tier, or load another step.")
    if there is not None:
        for src, name in moves:
            _rename(src, join(step_path, name))
        _fsync_dir(step_path)
        return
    # No copy on this node: one made like a save's, MANIFEST last, published by a rename.
    if store.exists(step_path):
        # A step directory without a MANIFEST (a crashed install, never a committed copy): replaced.
        _remove_tree(step_path)
    fresh = peer_area(step_path)
    _mkdir(fresh)
    try:
        for src, name in moves:
            _rename(src, join(fresh, name))
        target = join(fresh, mf.MANIFEST_NAME)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            _write_all(fd, memoryview(manifest), target)
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_dir(fresh)
        _rename(fresh, step_path)
        _fsync_dir(dirname(step_path))
    except OSError as exc:
        _remove_tree(fresh)
        raise from_os_error(exc, path=step_path, operation="install") from exc
    except BaseException:
        _remove_tree(fresh)
        raise


def _rename(src: str, dst: str) -> None:
    try:
        os.rename(src, dst)
    except OSError as exc:
        raise from_os_error(exc, path=dst, operation="rename") from exc

