"""Restore from the tiers: each data file from the fastest tier that holds the same save.

A step of a tiered checkpoint lives in up to two kinds of places (docs/TIERS.md):
each node's PRIVATE local directory (``LOCAL/step_N/``: the global MANIFEST and the data files of
that node's ranks only) and the remote root (``REMOTE/step_N/``: the MANIFEST, byte for byte the
same, and every data file, once drained). A node's directory may be empty (a replaced node), hold
only some files, or hold another save of the step (saved again since); the remote copy may be
absent or still draining (uncommitted).

:func:`load_tiered` (collective) restores one step:
  1. survey: every rank reads its node's local MANIFEST and notes the data files there with the
     size the MANIFEST gives; rank 0 reads the remote MANIFEST; one all-gather;
  2. the *reference save*: the remote MANIFEST's save id when the remote tier committed the step
     (it holds every file), else the one save every local copy holds (nodes that disagree, with
     nothing remote, are no complete copy: TierIncompleteError). A local copy is used only when
     its MANIFEST is byte for byte the reference's (same save id), so two saves are never mixed;
  3. the reference manifest: its MANIFEST bytes and (format 3) each data file's index, read once
     each, from a node that holds the file locally when one does, else from the remote tier; one
     all-gather, then every rank decodes and validates it (as distckpt.load does);
  3b. with the job's node layout (the manager passes it): the files a rank needs that its node's
     copy lacks are fetched whole from a node that holds the same save, over the process group
     (distckpt.tiers.peers: checked on both ends, installed in this node's local tier: the one
     write a tiered load makes, a repair of its own node's copy), when the remote tier does not
     hold the step or the rank reads a good part of the file; a few bytes of a file stay a
     ranged read from the remote tier;
  4. every rank plans its reads from that manifest exactly as :func:`distckpt.load` does
     (resharding included: another world size, another sharding), then each data file it needs
     becomes part of one of two fill parts: the node's local directory when the node's copy is the
     reference's and holds the file, else the remote tier (ranged GETs). A file on neither raises
     TierIncompleteError before any byte of the state dict changed. The fill (distckpt.fill) reads
     both parts in one pass and verifies every checksum block: a damaged local byte raises
     ChecksumMismatchError like any load, it never falls back to the remote copy silently (the
     manager's load then loads the step again from the remote tier alone, with a warning naming
     the damaged files: TieredCheckpointManager.load).

:func:`step_availability` (collective) is the manager's view of every step on both tiers: what the
remote tier committed and what each node holds, for ``latest`` across tiers and for its status.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any, Iterable, Mapping

from .. import manifest as mf
from .._dist import ControlGroup, _portable, control_group
from ..chain import chain_info
from ..checksum import crc32c
from ..errors import (CheckpointIncompleteError, CheckpointNotFoundError, ConfigError, DistCkptError,
                      ManifestCorruptError, PeerLostError, TierIncompleteError)
from ..fill import Part, Task
from ..gcpause import gc_paused
from ..listing import _STEP_RE
from ..restore import LoadResult, _load_local, exchange_load_outcome
from ..source import Source
from ..storage import Store, basename, is_url, join, normalize_path, open_store
from .nodes import NodeLayout, node_layout

__all__ = ["load_tiered", "step_availability", "StepTiers", "LocalCopy", "LOCAL", "REMOTE"]

log = logging.getLogger("distckpt")

#: The tier names of :attr:`distckpt.LoadResult.bytes_by_tier`.
LOCAL, REMOTE = "local", "remote"


@dataclasses.dataclass(frozen=True)
class LocalCopy:
    """What one node's local directory holds of a step: the save its MANIFEST names
    (``save_id``, ``created_unix``), how many data files that save has (``nfiles``) and which of
    them are there with the size the MANIFEST gives (``files``, indexes into ``manifest.files``)."""

    save_id: str
    created_unix: float
    nfiles: int
    files: frozenset[int]


@dataclasses.dataclass(frozen=True)
class StepTiers:
    """Where one step is, on every tier (:func:`step_availability`).

    ``remote_save_id`` / ``remote_created_unix``: the save the remote tier committed (None: not
    committed there). ``local[n]``: what node n's directory holds (None: no committed copy);
    ``node_of[r]``: the node of rank r (distckpt.tiers.nodes). ``problems``: copies whose MANIFEST
    could not be read, one line each (they count as absent).
    """

    step: int
    remote_save_id: str | None
    remote_created_unix: float | None
    local: tuple[LocalCopy | None, ...]
    node_of: tuple[int, ...]
    problems: tuple[str, ...] = ()

    @property
    def local_save_id(self) -> str | None:
        """The save the nodes' copies hold when every node that holds a copy holds the same one;
        None when no node holds one or when they disagree."""
        ids = {c.save_id for c in self.local if c is not None}
        return ids.pop() if len(ids) == 1 else None

    @property
    def local_complete(self) -> bool:
        """True when the nodes' copies of one save hold every data file of it between them (what a
        drain needs: each file from a node that has it). Not the same as every rank reaching the
        files it needs: see :meth:`missing`."""
        sid = self.local_save_id
        if sid is None:
            return False
        copies = [c for c in self.local if c is not None]
        held = frozenset().union(*(c.files for c in copies))
        return len(held) == copies[0].nfiles

    @property
    def reference_save_id(self) -> str | None:
        """The save a load of this step reads (:func:`load_tiered`): the remote tier's when it
        committed the step, else the nodes' common one; None when there is none."""
        return self.remote_save_id if self.remote_save_id is not None else self.local_save_id

    @property
    def created_unix(self) -> float | None:
        """The reference save's commit time (None when there is no reference save)."""
        if self.remote_save_id is not None:
            return self.remote_created_unix
        sid = self.local_save_id
        return next((c.created_unix for c in self.local if c is not None and c.save_id == sid), None)

    def why_incomplete(self, remote_listed: bool = True) -> str | None:
        """None when a tier holds a complete copy of the step (the remote tier committed it, or
        the nodes' copies of one save hold every data file between them); else one line saying
        what is missing, by name, for a warning. ``remote_listed`` False: the remote tier did not
        answer its listing, so whether it holds the step is not known (said so: "has not
        committed it" read as a lost step while the remote tier held it)."""
        if self.remote_save_id is not None or self.local_complete:
            return None
        copies = [c for c in self.local if c is not None]
        if not copies:
            why = "no node's local directory holds a MANIFEST of it that decodes"
        elif self.local_save_id is None:
            why = f"the nodes hold different saves of it ({sorted({c.save_id for c in copies})})"
        else:
            held = frozenset().union(*(c.files for c in copies))
            names = [mf.data_file_name(i) for i in range(copies[0].nfiles) if i not in held]
            why = (f"data file(s) {names[:20]}{' ...' if len(names) > 20 else ''} are in no node's local "
                   f"directory (absent, or not the size the MANIFEST gives)")
        problems = f"; {'; '.join(self.problems)}" if self.problems else ""
        remote = ("the remote tier has not committed it" if remote_listed else
                  "the remote tier, which did not answer, is not known to hold it")
        return f"{why}, and {remote}{problems}"

    def missing(self, rank: int, files: Iterable[int]) -> list[int]:
        """The data files among ``files`` that ``rank`` cannot read from any tier: not in its
        node's copy of the reference save and not committed remotely (all of them when there is no
        reference save)."""
        files = sorted(set(files))
        if self.remote_save_id is not None:
            return []
        sid = self.local_save_id
        copy = self.local[self.node_of[rank]]
        if sid is None or copy is None or copy.save_id != sid:
            return files
        return [i for i in files if i not in copy.files]

    def complete_for(self, needs: Mapping[int, Iterable[int]]) -> bool:
        """True when every rank reaches every data file it needs (``needs[rank]``: file indexes),
        which is when :func:`load_tiered` of this step finds every file."""
        return self.reference_save_id is not None and not any(self.missing(r, f) for r, f in needs.items())


# ------------------------------------------------------------------------------------------------
# load_tiered


@dataclasses.dataclass(frozen=True)
class _Survey:
    """One rank's part of the survey (step 1): its node's local copy (with a crc32c of its
    MANIFEST bytes and its path, for messages), and on rank 0 the remote MANIFEST's bytes."""

    local_path: str | None
    local: LocalCopy | None
    local_digest: int | None
    remote_manifest: bytes | None
    error: BaseException | None
    # A MANIFEST of this rank's node copy (on rank 0 also the remote one) that does not decode: that
    # copy counts as absent (as in step_availability), named here for the warnings and errors.
    local_problem: str | None = None
    remote_problem: str | None = None


@dataclasses.dataclass(frozen=True)
class _Reads:
    """One rank's part of the reference manifest (step 3): the reference MANIFEST's bytes (from
    the rank chosen to read them) and the indexes of the data files it was given."""

    manifest: bytes | None
    indexes: dict[int, bytes]
    error: BaseException | None


def load_tiered(state_dict: Any, *, local_path: str | None, remote_path: str | None,
                storage_options: dict | None = None, process_group: Any = None, strict: bool = True,
                verify: bool = True, allow_pickle: bool = False, cast: str = "exact",
                layout: NodeLayout | None = None, damaged: Mapping[int, Iterable[str]] | None = None) -> LoadResult:
    """Fill ``state_dict`` from one step of a tiered checkpoint, each rank reading every data file
    it needs from its node's local copy when that copy belongs to the reference save, else from
    the remote tier (module docstring). Collective over ``process_group`` (every rank calls it,
    each with its own node's ``local_path``).

    Args:
        local_path: this rank's node-local step directory (``LOCAL/step_N``); it may be absent,
            hold some files only, or hold another save. None: no local tier.
        remote_path: the step on the remote tier (``s3://bucket/run7/step_N``, or a shared
            directory); it may be absent or uncommitted. None: no remote tier (a load from the local
            copies alone, e.g. while the remote store is down).
        storage_options: fsspec options of the remote tier (as :func:`distckpt.save`).
        strict, verify, allow_pickle, cast: as :func:`distckpt.load`.
        layout: the job's nodes (distckpt.tiers.nodes). Given, a file a rank needs that its node
            lacks is first fetched from another node that holds the same save, over the process
            group (distckpt.tiers.peers: verified on both ends, installed in this node's local
            tier), and read from the remote tier only when no node holds it: a replaced node
            restores from its peers' replicas without reading the remote tier.
        damaged: {node: data file names} that an earlier load of the step found damaged in that
            node's local copy (node numbers as in ``layout``; the same on every rank): counted as
            absent there, so they come from another node's copy (installed over the damaged file,
            as for a file the node lacks) or from the remote tier.

    Returns:
        The :class:`distckpt.LoadResult` of :func:`distckpt.load` (``path``: the reference copy's,
        the remote step when it is the reference), with ``bytes_by_tier`` = {"local": n,
        "remote": m}: the bytes of this rank's tensors each tier served.

    Raises (on every rank, as :func:`distckpt.load`: the failing ranks' common class):
        TierIncompleteError: a data file a rank needs is on no tier it can reach (``files`` names
            them, ``step`` the step, ``tiers`` what each tier holds), or the nodes hold different
            saves and the remote tier none; raised before any byte of the state dict changed.
        CheckpointNotFoundError: no tier holds a committed copy of the step.
        ConfigError: no tier given, a URL as ``local_path``, a bad ``cast``, or a delta of an
            incremental chain (chains are loaded from their directory with distckpt.load).
        ManifestCorruptError: a MANIFEST that does not decode, or a local one that names the
            reference save but differs from the reference MANIFEST.
        ChecksumMismatchError: a block read from either tier differs from its checksum (no
            fallback to the other tier: damage is reported, as by any load).
        And what :func:`distckpt.load` raises (StateDictMismatchError, DataFileTruncatedError,
        CheckpointRemovedError, the object store's errors, PeerLostError...).
    """
    t0 = time.monotonic()
    group = control_group(process_group, operation="load_tiered()")
    result, error = None, None
    try:
        with contextlib.ExitStack() as guards, gc_paused():
            result = _load_tiered(group, guards, state_dict, local_path, remote_path, storage_options,
                                  strict, verify, allow_pickle, cast, t0, layout, damaged or {})
    except Exception as exc:  # noqa: BLE001 - every rank raises the same, below
        error = exc
    exchange_load_outcome(group, error, result, state_dict)
    return result


def _load_tiered(group: ControlGroup, guards: contextlib.ExitStack, state_dict: Any, local_path: str | None,
                 remote_path: str | None, storage_options: dict | None, strict: bool, verify: bool,
                 allow_pickle: bool, cast: str, t0: float, layout: NodeLayout | None,
                 damaged: Mapping[int, Iterable[str]]) -> LoadResult:
    """:func:`load_tiered` inside its read guards. Every rank runs the same two all-gathers
    whatever fails where, and a failure any rank meets there is raised on every rank."""
    # 1. Survey: this rank's node copy; rank 0 also the remote MANIFEST.
    local_store = remote_store = None
    local_bytes, local_error = None, None
    try:
        if cast not in ("exact", "allow"):
            raise ConfigError(f"cast={cast!r}: expected 'exact' or 'allow'")
        if local_path is None and remote_path is None:
            raise ConfigError("load_tiered needs a local_path, a remote_path, or both")
        if local_path is not None:
            if is_url(local_path):
                raise ConfigError(f"the local tier must be a local directory, not the URL {local_path}",
                                  path=local_path, remedy="Pass this node's own step directory as local_path.")
            local_path = normalize_path(local_path)
            local_store = open_store(local_path)
            # Guarded from before its MANIFEST is read, so a copy rotated away or replaced while it
            # is read is named as such; a directory that is not there (a replaced node) is read
            # from nowhere, and a guard would call whatever error the load raises its removal. Nor
            # is one without a MANIFEST (an empty directory, a crashed install): nothing is read
            # from it, and the install of the files fetched from peers replaces it, which the
            # guard took for a removal mid-read and failed a load that had filled every tensor.
            if local_store.is_committed(local_path):
                guards.enter_context(local_store.guard_reads(local_path))
        if remote_path is not None:
            remote_path = normalize_path(remote_path)
            remote_store = open_store(remote_path, storage_options)
        copy = remote = local_problem = remote_problem = None
        if local_store is not None:
            try:
                here = frozenset(damaged.get(layout.node if layout is not None else 0, ()))
                copy, local_bytes = _local_copy(local_store, local_path, here)
            except ManifestCorruptError as exc:
                local_problem = _damaged_copy(exc, local_path, "this node's")
        if group.rank == 0 and remote_store is not None:
            try:
                remote = _remote_manifest(remote_store, remote_path)
            except ManifestCorruptError as exc:
                remote_problem = _damaged_copy(exc, remote_path, "the remote tier's")
        mine = _Survey(local_path, copy, None if local_bytes is None else crc32c(local_bytes), remote, None,
                       local_problem, remote_problem)
    except Exception as exc:  # noqa: BLE001 - every rank raises it after the all-gather
        local_error = exc
        mine = _Survey(None, None, None, None, _portable(exc))
    survey = group.all_gather(mine)
    group.raise_failures([s.error for s in survey], local_error, operation="load")
    step = basename(remote_path if remote_path is not None else local_path)
    problems = [p for s in survey for p in (s.local_problem, s.remote_problem) if p]

    # 2. The reference save (the same on every rank), 3. its manifest.
    try:
        ref = _reference(survey, step, remote_path)
    except (CheckpointNotFoundError, TierIncompleteError) as exc:
        if problems:
            exc.add_note("distckpt: copies passed over, their MANIFEST damaged: " + "; ".join(problems))
        raise
    own = survey[group.rank].local if ref.usable[group.rank] else None
    stale = sorted({(s.local_path, s.local.save_id) for s, ok in zip(survey, ref.usable) if s.local is not None and not ok})
    if stale and group.rank == 0:
        # The remote tier's save is the reference; a node copy of another save of the step is
        # never read, but never passed over in silence either: it is the state this node saved.
        log.warning("distckpt: step %s: loading save %s (%s); node copies of other saves of the step are passed over: %s "
                    "(a stale disk, or another job saving into the same remote tier %s)", step, ref.save_id,
                    "the remote tier's" if ref.remote is not None else "the nodes'",
                    "; ".join(f"{p}: save {sid}" for p, sid in stale), remote_path)
    if ref.remote is not None:
        # Guarded once it is known to be committed (a guard around a step that is not there would
        # call any error of this load its removal), before any of its data is read.
        guards.enter_context(remote_store.guard_reads(remote_path))
    reads = group.all_gather(_read_reference(group.rank, ref, own, local_bytes, local_store, local_path,
                                             remote_store, remote_path))
    group.raise_failures([r.error for r in reads], None, operation="load")
    data = ref.remote if ref.remote is not None else reads[ref.manifest_rank].manifest
    indexes = {i: b for r in reads for i, b in r.indexes.items()}
    manifest = mf.decode(data, path=join(ref.path, mf.MANIFEST_NAME), read_index=lambda _header, i: indexes[i])
    info = chain_info(manifest)
    if info is not None and info.get("kind") == "delta":
        raise ConfigError(f"step {step} is a delta of an incremental chain: a tiered load reads whole checkpoints only",
                          path=ref.path, remedy="Load it with distckpt.load from the directory that holds its chain.")

    # 3b. Files this rank needs that its node lacks: from the nodes that hold them, when some do.
    fetched = 0
    if layout is not None and local_store is not None:
        own, fetched = _fetch_from_peers(group, layout, survey, ref, own, state_dict, manifest, data, local_store,
                                         local_path, strict, verify, allow_pickle, cast, t0)

    # 4. Plan as distckpt.load does; read each file from this node's copy or the remote tier.
    served = {LOCAL: 0, REMOTE: 0}

    def parts_for(tasks: list[Task]) -> list[Part]:
        by_tier: dict[str, list[Task]] = {LOCAL: [], REMOTE: []}
        missing = set()
        for t in tasks:
            if own is not None and t.chunk.file in own.files:
                by_tier[LOCAL].append(t)
            elif ref.remote is not None:
                by_tier[REMOTE].append(t)
            else:
                missing.add(t.chunk.file)
        if missing:
            names = [manifest.files[i].name for i in sorted(missing)]
            mine = survey[group.rank]
            holders = sorted({r for r, s in enumerate(survey) if ref.usable[r]
                              and any(i in s.local.files for i in missing)})
            if mine.local_problem is not None or (mine.local is not None and mine.local.save_id != ref.save_id):
                # Its node holds a copy it cannot use: a load never overwrites a copy (it may be
                # the only evidence of what went wrong), so the peers' files are not installed.
                why = (f"its MANIFEST does not decode ({mine.local_problem})" if mine.local_problem is not None else
                       f"it is another save of the step ({mine.local.save_id})")
                raise TierIncompleteError(
                    f"step {step} (save {ref.save_id}): rank {group.rank} needs data file(s) {names[:20]}; its node's "
                    f"copy at {local_path} cannot be used ({why}), the remote tier ({remote_path}) has not committed "
                    f"the step" + (f", and the nodes of ranks {holders} hold verified copies of them" if holders else ""),
                    path=local_path or remote_path, step=step, files=names, tiers=ref.describe(survey),
                    remedy=f"Move {local_path} aside (or delete it) on that node and load again: a node without a copy "
                           f"fetches the files from its peers." if holders else None)
            raise TierIncompleteError(
                f"step {step} (save {ref.save_id}): rank {group.rank} needs data file(s) {names[:20]}, which its "
                f"node's directory ({local_path}) does not hold, and the remote tier ({remote_path}) has not committed "
                f"the step", path=local_path or remote_path, step=step, files=names, tiers=ref.describe(survey))
        for tier, ts in by_tier.items():
            served[tier] = sum(t.inter.volume * t.itemsize for t in ts)
        stores = {LOCAL: (local_store, local_path), REMOTE: (remote_store, remote_path)}
        return [Part(*stores[tier], manifest, ts) for tier, ts in by_tier.items() if ts]

    # What the result and the plan's messages name: the reference copy (the remote step, else this
    # rank's node copy when it is the reference's).
    if ref.remote is not None:
        source = Source(remote_path, remote_store, "distckpt")
    else:
        source = Source(local_path if own is not None else ref.path, local_store, "distckpt")
    result = _load_local(source, manifest, state_dict, strict, verify, allow_pickle, cast, t0, parts_for=parts_for)
    result = dataclasses.replace(result, bytes_by_tier=served, bytes_from_peers=fetched)
    remote_damaged = survey[0].remote_problem
    if remote_damaged is not None:
        # Loaded from the nodes' copies, which nothing could check against the remote tier's save.
        result = dataclasses.replace(result, remote_unchecked=f"its MANIFEST does not decode ({remote_damaged})")
    return result


def _damaged_copy(exc: ManifestCorruptError, path: str, whose: str) -> str:
    """The line naming one tier's copy of a step whose MANIFEST does not decode, logged: a load
    passes it over as absent (step_availability does too) and reads the step from the copies that
    decode. Re-raises ``exc`` for a MANIFEST of a format version this reader does not know: a
    newer release's step is not damaged, and passing it over would load something else."""
    if exc.details.get("found_version") is not None:
        raise exc
    line = f"{join(path, mf.MANIFEST_NAME)}: {exc.message}"
    log.warning("distckpt: %s copy of %s is passed over, its MANIFEST does not decode (%s)", whose, basename(path),
                line)
    return line


#: With the remote tier up, a file this node lacks is fetched whole from a peer only when this rank
#: reads at least 1/_FETCH_FRACTION of it; smaller reads go to the remote tier.
_FETCH_FRACTION = 4


class _Planned(Exception):
    """Ends a dry run of the load's planning (:func:`_needed_files`) with what it would read."""

    def __init__(self, files: dict[int, int]) -> None:
        super().__init__("planned")
        self.files = files


def _needed_files(manifest: "mf.Manifest", state_dict: Any, strict: bool, verify: bool, allow_pickle: bool,
                  cast: str, t0: float, path: str, store: Store) -> dict[int, int]:
    """{data file: bytes of it} this rank's load of ``state_dict`` reads: the load's own planning,
    stopped before any byte is read (no byte of the state dict changes). Raises what the planning
    raises (StateDictMismatchError...)."""
    def capture(tasks: list[Task]) -> list[Part]:
        files: dict[int, int] = {}
        for t in tasks:
            files[t.chunk.file] = files.get(t.chunk.file, 0) + t.inter.volume * t.itemsize
        raise _Planned(files)

    try:
        _load_local(Source(path, store, "distckpt"), manifest, state_dict, strict, verify, allow_pickle, cast, t0,
                    parts_for=capture)
    except _Planned as planned:
        return planned.files
    return {}  # nothing to read (every value is a non-tensor)


def _fetch_from_peers(group: ControlGroup, layout: NodeLayout, survey: list[_Survey], ref: _Reference,
                      own: LocalCopy | None, state_dict: Any, manifest: "mf.Manifest", data: bytes,
                      local_store: Store, local_path: str, strict: bool, verify: bool, allow_pickle: bool,
                      cast: str, t0: float) -> tuple[LocalCopy | None, int]:
    """Step 3b of :func:`load_tiered`: every rank's needed files that its node lacks, fetched
    from other nodes that hold the reference save's copy of them (distckpt.tiers.peers), then
    this rank's node copy surveyed again. Collective (two all-gathers and the transfers' own).
    Returns (this rank's usable node copy, bytes this rank received).

    Raises on every rank: the planning's errors, what :func:`distckpt.tiers.peers.run_transfers`
    raises."""
    from .peers import fetch_transfers, run_transfers

    wanted, error = set(), None
    mine = survey[group.rank]
    # This node's directory holds another save of the step, or a copy whose MANIFEST does not
    # decode: nothing is installed there (the install would refuse, or replace a committed copy),
    # so its ranks read what they lack from the remote tier (TierIncompleteError without one).
    occupied = own is None and (mine.local is not None or mine.local_problem is not None)
    try:
        needs = _needed_files(manifest, state_dict, strict, verify, allow_pickle, cast, t0, local_path, local_store)
        held_here = set(own.files) if own is not None else set()
        # A whole file is worth fetching from a peer when the remote tier cannot serve it, or when
        # this rank reads a good part of it; a few bytes of it (a value another rank wrote) are a
        # ranged read from the remote tier instead of a whole file's copy.
        wanted = set() if occupied else {
            i for i, nbytes in needs.items() if i not in held_here
            and (ref.remote is None or nbytes * _FETCH_FRACTION >= manifest.files[i].size)}
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        error = exc
    asked = group.all_gather(sorted(wanted) if error is None else _portable(error))
    group.raise_failures([a if isinstance(a, BaseException) else None for a in asked], error, operation="load")
    if not any(asked):
        return own, 0
    # What each node holds of the reference save (its ranks see one directory: its leader's survey).
    held = [survey[leader].local.files if ref.usable[leader] else frozenset() for leader in layout.leaders]
    transfers, nowhere = fetch_transfers(layout, [set(a) for a in asked], held)
    if nowhere:
        log.warning("distckpt: data files %s of %s are on no node as part of the save being loaded (%s; a node's "
                    "copy of another save does not count): read from the remote tier", sorted(nowhere)[:20],
                    local_path, manifest.save_id)
    if not transfers:
        return own, 0
    try:
        result = run_transfers(group, transfers, layout=layout, store=local_store, step_path=local_path,
                               header=manifest, manifest=data)
    except PeerLostError:
        raise
    except DistCkptError as exc:
        if ref.remote is None:
            raise
        # The transfers' verdict is the same on every rank, so every rank goes on alike: what
        # could not be fetched (a node's step path that is no directory, a disk full) is read
        # from the remote tier, which holds the same save. This node's copy is surveyed again:
        # an install may have moved some files in before it failed.
        log.warning("distckpt: %s: the files fetched from other nodes could not all be installed (%s: %s): "
                    "reading what this node lacks from the remote tier", local_path, type(exc).__name__,
                    getattr(exc, "message", exc))
        try:
            copy, _ = _local_copy(local_store, local_path)
        except DistCkptError:
            copy = None
        return (copy if copy is not None and copy.save_id == ref.save_id else None), 0
    gained = result.installed.get(layout.node, [])
    if not gained:
        # Nothing installed here (an occupied node among them: its copy, whose MANIFEST may not
        # even decode, is not surveyed again): this node's copy is as the survey found it.
        return own, result.received
    log.warning("distckpt: %s: fetched data files %s of save %s from other nodes (this node lacked them)",
                local_path, [manifest.files[i].name for i in gained][:20], ref.save_id)
    copy, _ = _local_copy(local_store, local_path)
    return (copy if copy is not None and copy.save_id == ref.save_id else None), result.received


@dataclasses.dataclass(frozen=True)
class _Reference:
    """The reference save of a tiered load, the same on every rank (:func:`_reference`).

    ``path``: where its MANIFEST is (the remote step, else the first node copy's), for messages;
    ``remote``: the remote MANIFEST's bytes when the remote tier committed the step, else None;
    ``usable[r]``: rank r's node copy is the reference save's; ``manifest_rank``: without a
    remote copy, the rank that sends the MANIFEST's bytes; ``index_rank[i]``: the rank that reads
    data file i's index (the lowest whose node copy holds the file, else rank 0 from the remote
    tier)."""

    save_id: str
    path: str
    remote: bytes | None
    usable: tuple[bool, ...]
    manifest_rank: int
    index_rank: tuple[int, ...]

    def describe(self, survey: list[_Survey]) -> dict:
        """What each tier holds, for TierIncompleteError's ``tiers``: {"remote": ..., "local":
        {what a node copy holds: [the ranks that see such a copy]}} (nodes often share one path
        name, so ranks, not paths, tell them apart)."""
        local: dict[str, list[int]] = {}
        for r, s in enumerate(survey):
            what = ("no committed copy" if s.local is None else
                    f"save {s.local.save_id}, {len(s.local.files)} of {s.local.nfiles} data files "
                    f"({sorted(s.local.files)[:8]}{'...' if len(s.local.files) > 8 else ''})")
            local.setdefault(f"{s.local_path}: {what}", []).append(r)
        return {"remote": f"save {self.save_id}" if self.remote is not None else "not committed", "local": local}


def _reference(survey: list[_Survey], step: str, remote_path: str | None) -> _Reference:
    """The reference save and who reads which part of its manifest, from the survey (every rank
    computes the same).

    Raises:
        CheckpointNotFoundError: no tier holds a committed copy.
        TierIncompleteError: no remote copy and the nodes hold different saves, or a data file
            that no node holds (format 3 needs every file's index to decode the manifest, and a
            step with a file on no tier is no complete copy).
        ManifestCorruptError: a node copy's MANIFEST names the reference save but has other bytes.
    """
    remote = survey[0].remote_manifest
    where = remote_path or next((s.local_path for s in survey if s.local_path is not None), None)
    if remote is not None:
        header = mf.decode_header(remote, path=join(remote_path, mf.MANIFEST_NAME))
        save_id, digest, path, nfiles, manifest_rank = header.save_id, crc32c(remote), remote_path, len(header.files), 0
    else:
        copies = [(r, s) for r, s in enumerate(survey) if s.local is not None]
        if not copies:
            raise CheckpointNotFoundError(
                f"step {step} has no committed copy: the remote tier ({remote_path}) holds none and no node's local "
                f"directory does", path=where,
                remedy="Load a step that a tier committed (TieredCheckpointManager.latest_step()).")
        saves: dict[str, list[int]] = {}
        for r, s in copies:
            saves.setdefault(s.local.save_id, []).append(r)
        if len(saves) > 1:
            raise TierIncompleteError(
                f"step {step} has no complete copy of one save: the nodes hold different saves of it "
                f"({'; '.join(f'save {sid} on ranks {rs}' for sid, rs in saves.items())}) and the remote tier "
                f"({remote_path}) holds none", path=where, step=step, files=[],
                tiers={"remote": "not committed", "local": saves},
                remedy="Load an older step that the remote tier holds: the newest save of this step did not reach "
                       "every node.")
        manifest_rank, first = copies[0]
        save_id, digest, path, nfiles = first.local.save_id, first.local_digest, first.local_path, first.local.nfiles
    usable = tuple(s.local is not None and s.local.save_id == save_id for s in survey)
    for s, ok in zip(survey, usable):
        if ok and s.local_digest != digest:
            raise ManifestCorruptError(
                f"the MANIFEST of {s.local_path} names save {save_id} but differs from that save's MANIFEST at {path}: "
                f"a save has one MANIFEST, so one of the two is damaged", path=join(s.local_path, mf.MANIFEST_NAME),
                expected=f"crc32c {digest:#010x}", found=f"crc32c {s.local_digest:#010x}")
    index_rank, missing = [], []
    for i in range(nfiles):
        holder = next((r for r, s in enumerate(survey) if usable[r] and i in s.local.files), None)
        if holder is None and remote is not None:
            holder = 0
        if holder is None:
            missing.append(i)
        index_rank.append(-1 if holder is None else holder)
    ref = _Reference(save_id, path, remote, usable, manifest_rank, tuple(index_rank))
    if missing:
        names = [mf.data_file_name(i) for i in missing]   # file i is rank i's (distckpt.commit's order)
        raise TierIncompleteError(
            f"step {step} (save {save_id}) has no complete copy: data file(s) {names[:20]} are in no node's local "
            f"directory and " + (f"the remote tier ({remote_path}) has not committed the step" if remote_path else
                                 "the remote tier was not read"), path=where, step=step,
            files=names, tiers=ref.describe(survey))
    return ref


def _read_reference(rank: int, ref: _Reference, own: LocalCopy | None, local_bytes: bytes | None,
                    local_store: Store | None, local_path: str | None, remote_store: Store | None,
                    remote_path: str | None) -> _Reads:
    """This rank's share of the reference manifest: the MANIFEST's bytes when it is
    ``ref.manifest_rank`` (no remote copy), and the indexes ``ref.index_rank`` gives it, each from
    its node's copy (``own``, whose MANIFEST bytes are ``local_bytes``) or, on rank 0, from the
    remote tier. Never raises: an error travels in the result, so every rank reaches the
    all-gather."""
    try:
        send = local_bytes if ref.remote is None and rank == ref.manifest_rank else None
        wanted = [i for i, r in enumerate(ref.index_rank) if r == rank]
        indexes: dict[int, bytes] = {}
        if wanted:
            # A rank given an index holds the reference MANIFEST: remote, or its node's identical copy.
            header = mf.decode_header(ref.remote if ref.remote is not None else local_bytes, path=ref.path)
            if header.format_version >= 3:   # earlier formats keep the chunks in the MANIFEST
                for i in wanted:
                    if own is not None and i in own.files:
                        indexes[i] = local_store.read_index(local_path, header, i)
                    else:
                        indexes[i] = remote_store.read_index(remote_path, header, i)
        return _Reads(send, indexes, None)
    except Exception as exc:  # noqa: BLE001 - raised on every rank after the all-gather
        return _Reads(None, {}, _portable(exc))


def _local_copy(store: Store, path: str, damaged: frozenset[str] = frozenset()
                ) -> tuple[LocalCopy | None, bytes | None]:
    """(what the local step directory ``path`` holds, its MANIFEST's bytes); (None, None) when it
    holds no committed copy (absent, empty, a save's leftovers). Reads the MANIFEST and one
    ``lstat`` per data file; a data file there with another size than the MANIFEST's is not
    counted (it is read from the remote tier) and logged, nor is one named in ``damaged`` (data
    file names a load found damaged here: read from a peer's replica or the remote tier).

    Raises ManifestCorruptError (a MANIFEST that does not decode) and StorageError subclasses."""
    try:
        data = store.manifest_bytes(path)
    except (CheckpointNotFoundError, CheckpointIncompleteError):
        return None, None
    header = mf.decode_header(data, path=join(path, mf.MANIFEST_NAME))
    held = []
    for i, entry in enumerate(header.files):
        if entry.name in damaged:
            continue
        where, size, _problem = store.data_file_stat(path, header, i)
        if size == entry.size:
            held.append(i)
        elif size is not None:
            log.warning("distckpt: %s has %d bytes, its MANIFEST says %d: not read from the local tier", where, size,
                        entry.size)
    return LocalCopy(header.save_id, header.created_unix, len(header.files), frozenset(held)), data


def _remote_manifest(store: Store, path: str) -> bytes | None:
    """The remote step's MANIFEST bytes, checked to decode; None when the remote tier has not
    committed the step (nothing there, or a drain's data without its MANIFEST yet). Raises
    ManifestCorruptError and the object store's typed errors (an unreachable endpoint too: the
    reference save cannot be known then; pass remote_path=None to load from the local tier alone)."""
    try:
        data = store.manifest_bytes(path)
    except (CheckpointNotFoundError, CheckpointIncompleteError):
        return None
    mf.decode_header(data, path=join(path, mf.MANIFEST_NAME))
    return data


# ------------------------------------------------------------------------------------------------
# step_availability


def step_availability(group: ControlGroup, *, local_root: str, remote_root: str | None,
                      storage_options: dict | None = None, layout: NodeLayout | None = None) -> dict[int, StepTiers]:
    """Every step that either tier holds (``step_N`` names), with what each tier holds of it:
    {step: :class:`StepTiers`}, the same on every rank. Collective over ``group`` (one
    all-gather): each node's leader lists its local root (MANIFESTs and one ``lstat`` per data
    file), rank 0 the remote root (one MANIFEST read per step). Writes nothing, except that
    :func:`distckpt.tiers.nodes.node_layout` creates ``local_root`` when no ``layout`` is given.

    A step whose MANIFEST on a tier does not decode counts as absent there and is named in
    ``problems``; a step with data but no MANIFEST (a save or drain in flight) is absent.

    Raises (on every rank): StorageError subclasses and the object store's typed errors (a root
    that cannot be listed, a remote tier that does not answer), PeerLostError; ManifestCorruptError
    for a MANIFEST of a format version this reader does not know (a newer release wrote it: not
    damaged, and passing it over would load an older step, as CheckpointManager refuses too).
    """
    layout = layout if layout is not None else node_layout(group, local_root)
    local, remote, error = None, None, None
    try:
        if layout.is_leader:
            local = _local_steps(normalize_path(local_root))
        if group.rank == 0 and remote_root is not None:
            remote = _remote_steps(normalize_path(remote_root), storage_options)
    except Exception as exc:  # noqa: BLE001 - every rank raises it after the all-gather
        error = exc
    reports = group.all_gather((local, remote, _portable(error)))
    group.raise_failures([e for _, _, e in reports], error, operation="step_availability")
    remote_steps = reports[0][1] or {}
    node_steps = [reports[leader][0] or {} for leader in layout.leaders]
    out = {}
    for step in sorted(set(remote_steps).union(*node_steps)):
        rid, rcreated, rproblem = remote_steps.get(step, (None, None, None))
        copies, problems = [], [rproblem] if rproblem else []
        for node, steps in enumerate(node_steps):
            copy, problem = steps.get(step, (None, None))
            copies.append(copy)
            if problem:
                problems.append(f"node {node} (rank {layout.leaders[node]}): {problem}")
        out[step] = StepTiers(step, rid, rcreated, tuple(copies), layout.node_of, tuple(problems))
    return out


def _local_steps(root: str) -> dict[int, tuple[LocalCopy | None, str | None]]:
    """{step: (its copy, or None with the problem of a MANIFEST that does not decode)} under the
    local root ``root`` (absent: {})."""
    store = open_store(root)
    out = {}
    for name in store.list_children(root):
        m = _STEP_RE.match(name)
        if not m:
            continue
        try:
            copy, _data = _local_copy(store, join(root, name))
        except ManifestCorruptError as exc:
            if exc.details.get("found_version") is not None:
                raise  # a newer release's step is not damaged: passing it over loads an older one
            out[int(m.group(1))] = (None, f"{join(root, name)}: {exc.message}")
            continue
        if copy is not None:
            out[int(m.group(1))] = (copy, None)
    return out


def _remote_steps(root: str, storage_options: dict | None) -> dict[int, tuple[str | None, float | None, str | None]]:
    """{step: (committed save id, its commit time, None) or (None, None, problem)} for the steps
    the remote root ``root`` committed."""
    store = open_store(root, storage_options)
    out = {}
    for name in store.list_children(root):
        m = _STEP_RE.match(name)
        if not m:
            continue
        path = join(root, name)
        try:
            data = _remote_manifest(store, path)
        except ManifestCorruptError as exc:
            if exc.details.get("found_version") is not None:
                raise  # as in _local_steps
            out[int(m.group(1))] = (None, None, f"remote {path}: {exc.message}")
            continue
        if data is not None:
            header = mf.decode_header(data)
            out[int(m.group(1))] = (header.save_id, header.created_unix, None)
    return out
