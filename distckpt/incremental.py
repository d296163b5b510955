"""Incremental checkpoints of row-sharded tensors (embedding tables and their optimizer state).

A *chain* is a full checkpoint (the *base*) followed by *deltas*; each delta holds, for every
tracked tensor, only the rows whose bytes changed since the previous link (its *parent*), and in
full everything else of the state dict (dense parameters, scalars, ...). Every link is a normal
atomic distckpt checkpoint; its chain position sits in the manifest's user metadata under
``"distckpt.chain"`` (docs/INCREMENTAL.md)::

    saver = IncrementalSaver(IncrementalPolicy(rows={"model.emb.weight": 0}, full_every=8))
    saver.save(state_dict, "/ckpt/step_00000100")     # collective; full or delta, as the policy says
    distckpt.load(state_dict, "/ckpt/step_00000150")  # composes base + deltas, any plan / world size

Change tracking: per row, a 64-bit digest of the row's bytes (computed vectorised in torch, in
blocks of rows) is kept from the last save and compared with the current one. It is exact where it
matters: a change confined to one 32-bit word of a row always changes the digest (every step of
the per-word mixing is a bijection), and any other change escapes with probability about 2^-64.
It depends on nothing but the bytes: optimizer-only updates, rows written by hand, and updates from
any code path are all seen, which tracking the ids of looked-up rows cannot promise. With
``IncrementalPolicy(watch_writes=True)`` only the rows on pages written since the previous link
are hashed again (distckpt.writewatch: the kernel's write protection, which sees every write of
this process, fused C++ optimizers included; the tensor version counter does not).

Invariants:
  * A delta names its parent by directory name and save id; a link whose parent is missing,
    replaced (another save id), damaged or of another chain raises :class:`ChainBrokenError`
    before a byte of the chain is read. Nothing is ever composed from a partial chain.
  * The saver's digests advance only when a save committed: a failed or crashed save leaves
    them (and the chain on disk) at the previous link, so the next delta is relative to a link
    that exists.
  * All ranks take the same full/delta decision (one all-gather of the per-rank counts).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import os
import uuid
from typing import Any, Callable, Mapping

import torch

from .chain import FORMAT, META_KEY, ChainLink, _broken, chain_info, chain_of, dependencies
from .deltarecords import (DELTA_ROOT, box_of, check_all_overlaps, check_box, check_ids_form, check_no_stray,
                           check_rows_dtype, checked_ids, pieces_of, read_records)
from .verify import verify_chain
from .errors import ConfigError, DistCkptError
from .tensorbytes import dtype_from_name, dtype_name

log = logging.getLogger("distckpt")

__all__ = ["IncrementalPolicy", "IncrementalSaver", "ChainLink", "chain_of", "chain_info", "dependencies",
           "verify_chain", "row_digests", "META_KEY", "DELTA_ROOT", "Target", "plan_deltas"]

def without_records(tree: dict) -> dict:
    """A delta's MANIFEST tree without its records' container (``DELTA_ROOT``): they are no state
    of its own, not even as an empty container (a delta with no changed row has one)."""
    if tree["t"] != "dict":
        return tree
    return {"t": "dict", "k": [[k, c] for k, c in tree["k"] if k != DELTA_ROOT]}


# ------------------------------------------------------------------------------------------------
# Row digests

_MULTS: dict[int, torch.Tensor] = {}
_BLOCK_ELEMS = 1 << 16   # words per contiguous copy of a block of strided host rows (<= 512 KiB)


def _multipliers(width: int) -> torch.Tensor:
    m = _MULTS.get(width)
    if m is None:
        g = torch.Generator().manual_seed(0x5EED)
        m = torch.randint(-(1 << 62), 1 << 62, (width,), generator=g, dtype=torch.int64) * 2 + 1  # odd
        _MULTS[width] = m
    return m


def row_digests(t: torch.Tensor, row_dim: int = 0) -> torch.Tensor:
    """A 64-bit digest (int64) of the bytes of every slice ``t.select(row_dim, i)``.

    A row is read as words of 64 bits (32, 16 or 8 when its size is not a multiple of 8): word j
    of value w becomes x = w * P_j, then x ^ (x >>> 32), then * Q (P_j, Q odd; all mod 2^64), and
    a row's digest is the sum of its words'. Each step is a bijection, so a change confined to one
    word always changes the digest; other changes escape with probability about 2^-64. Bit-exact:
    -0.0 and 0.0, NaN payloads differ. Computed by the C core (csrc/rowdigest.c) without the GIL,
    straight from the tensor's memory when each row is contiguous in host memory, otherwise from
    contiguous copies of blocks of rows (a few hundred KiB at a time). A GPU tensor is hashed on
    its device by the same formula in torch ops; only the digests come back.
    """
    from . import _uring
    x = t.detach().movedim(row_dim, 0)
    n = x.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.int64)
    row_bytes = x[0].numel() * x.element_size()
    if row_bytes == 0:
        return torch.zeros(n, dtype=torch.int64)
    # The widest word that divides the row: 64-bit words halve the work of 32-bit ones.
    size = next(z for z in (8, 4, 2, 1) if row_bytes % z == 0)
    width = row_bytes // size
    mult = _multipliers(width)
    out = torch.empty(n, dtype=torch.int64)
    if x.device.type == "cpu" and x[0].is_contiguous() and not x.is_conj() and not x.is_neg():
        _uring.row_digests(x.data_ptr(), n, x.stride(0) * x.element_size(), width, size,
                           mult.data_ptr(), out.data_ptr())
        return out
    if x.device.type != "cpu":
        return _device_digests(x, size, mult)
    step = max(1, _BLOCK_ELEMS // width)
    for a in range(0, n, step):
        blk = x[a:a + step].resolve_conj().resolve_neg().contiguous()
        _uring.row_digests(blk.data_ptr(), blk.shape[0], row_bytes, width, size,
                           mult.data_ptr(), out[a:].data_ptr())
    return out


_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_DEVICE_BLOCK_WORDS = 1 << 24   # int64 temporaries per block on a device: 128 MiB
_Q = -7046029254386353131       # csrc/rowdigest.h's ROWDIGEST_Q as int64


def _device_digests(x: torch.Tensor, size: int, mult: torch.Tensor) -> torch.Tensor:
    """row_digests of a tensor on a device (a GPU): the same formula in torch integer ops on the
    device, in blocks of rows, on the caller's current stream (so after the kernels that wrote
    the rows); only the digests (8 bytes a row) come back to the host. Copying the rows to the
    host to hash them there would move the whole table across PCIe at every save."""
    n, width = x.shape[0], mult.numel()
    m = mult.to(x.device)
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    step = max(1, _DEVICE_BLOCK_WORDS // width)
    for a in range(0, n, step):
        blk = x[a:a + step].resolve_conj().resolve_neg().contiguous().reshape(-1)
        w = blk.view(torch.uint8).view(_WORD_DTYPES[size]).reshape(-1, width)
        # int64 products wrap mod 2^64; smaller words are zero-extended (their sign bits masked).
        h = w * m if size == 8 else w.to(torch.int64).bitwise_and_((1 << (8 * size)) - 1).mul_(m)
        h.bitwise_xor_(h.bitwise_right_shift(32).bitwise_and_(0xFFFFFFFF)).mul_(_Q)   # logical >> 32
        torch.sum(h, dim=1, out=out[a:a + step])
    return out.cpu()


# ------------------------------------------------------------------------------------------------
# Policy


@dataclasses.dataclass(frozen=True, slots=True)
class _DeltaStats:
    """What each rank tells the others before a link is written: its tracked bytes and rows, changed
    and total, whether its tracked tensors or their sharding changed (``unknown``), and (rank 0)
    whether the previous link is still the one this saver wrote (``parent_ok``). Together they decide,
    the same way on every rank, whether the link is a delta or a full checkpoint. ``why``: this
    rank's own reason for a full link (``force_full``, no previous link, other tracked tensors,
    shapes or dtypes, ``full_every``), ``parent``: the save id of the link this rank would extend.
    Both are exchanged because ranks can disagree (``force_full`` passed on one rank, a rank whose
    saver was rebuilt): a rank deciding alone would save a delta while another saves the full
    state, and each would wait for the other in a different collective. ``plain``: whether this
    rank has plain tracked tensors whose replicas a delta must check (it leaves them out of the
    save); their digests are exchanged only once a delta is decided, so a full link never
    digests them twice. ``replicas``: this rank's pieces that other ranks hold too (a Replicate
    DTensor's), each with a digest of its row digests now and of those of the previous link: one
    rank writes a replicated piece's rows, measured against its own previous copy, so the link is
    full unless every holder's copy agrees now and agreed at the previous link (the base holds
    the copy of whichever rank the full save's plan chose: replicas that differed then, even
    resynced since, would compose one rank's rows onto another's base)."""

    changed_bytes: int
    total_bytes: int
    changed_rows: int
    total_rows: int
    unknown: bool
    parent_ok: bool
    why: str | None
    parent: str | None
    plain: bool
    replicas: tuple = ()   # (fqn, offsets, sizes, digest of its row digests) of pieces other ranks may hold


@dataclasses.dataclass(frozen=True)
class IncrementalPolicy:
    """When a save is a delta and which tensors are tracked.

    Args:
        rows: the tracked tensors, ``{fqn: row dimension}`` (fqns as in the checkpoint,
            ``"model.emb.weight"``), or a callable taking the state dict and returning that
            (``distckpt.integrations.torchrec.incremental_rows`` for a TorchRec state dict). None:
            every ShardedTensor / DTensor leaf, row dimension 0. Tracked leaves must sit in dicts.
        full_every: at most this many links per chain: a full checkpoint at least every
            ``full_every`` saves (1: every save is full).
        max_delta_fraction: a save whose changed rows exceed this fraction of the tracked bytes
            is written full instead (a delta would cost about as much and lengthen the chain).
        max_chain_fraction: a save is written full once the chain's deltas would hold more than
            this fraction of the tracked bytes. A restore reads the base plus every delta and
            scatters the deltas' rows, so this bounds its cost (measured 1.0-1.5x a full
            checkpoint's restore at 0.25 on a 2-core VM, more when its cores are busy with other
            work: docs/BENCHMARKS.md).
        watch_writes: re-hash only the rows on pages written since the previous link
            (distckpt.writewatch: the kernel's write protection, Linux >= 6.7), instead of every
            tracked row. Exact for host tensors in private anonymous memory that only this
            process's CPUs write (any code path, fbgemm's fused optimizers included); a row on
            memory a device writes by DMA (RDMA-registered buffers) would be missed, hence opt-in.
            Tensors that do not qualify (GPU, pinned, shared or file memory) and kernels without
            the feature are hashed whole, as without it; ``IncrementalSaver.watch_status`` says
            which and why.
    """

    rows: Mapping[str, int] | Callable[[Any], Mapping[str, int]] | None = None
    full_every: int = 8
    max_delta_fraction: float = 0.3
    max_chain_fraction: float = 0.25
    watch_writes: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.watch_writes, bool):
            raise ConfigError(f"watch_writes={self.watch_writes!r} must be a bool")
        if not isinstance(self.full_every, int) or self.full_every < 1:
            raise ConfigError(f"full_every={self.full_every!r} must be a positive int")
        for name in ("max_delta_fraction", "max_chain_fraction"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v >= 0:
                raise ConfigError(f"{name}={v!r} must be a number >= 0")


# ------------------------------------------------------------------------------------------------
# State-dict plumbing (tracked leaves live in dicts)


def _resolve_rows(rows: Any, state_dict: Any, items: dict) -> dict[str, int]:
    from .flatten import TensorItem
    if callable(rows):
        rows = rows(state_dict)
    if rows is None:
        rows = {f: 0 for f, it in items.items() if isinstance(it, TensorItem) and it.kind != "tensor" and it.shape}
    out = {}
    for fqn, d in dict(rows).items():
        it = items.get(fqn)
        if not isinstance(it, TensorItem):
            raise ConfigError(f"incremental rows: {fqn!r} is not a tensor of the state dict")
        if not isinstance(d, int) or not 0 <= d < len(it.shape):
            raise ConfigError(f"incremental rows: row dimension {d!r} of {fqn!r} (shape {list(it.shape)})")
        if not all(isinstance(k, str) for k in it.path):
            raise ConfigError(f"incremental rows: {fqn!r} must be reachable through dicts with str keys")
        out[fqn] = d
    return out


def _without(tree: dict, paths: list[tuple]) -> dict:
    """A copy of ``tree`` without the leaves at ``paths`` (only the dicts on those paths copied)."""
    heads: dict[Any, list[tuple]] = {}
    for p in paths:
        heads.setdefault(p[0], []).append(p[1:])
    out = dict(tree)
    for k, rests in heads.items():
        if any(not r for r in rests):
            out.pop(k, None)
        elif isinstance(tree.get(k), dict):
            out[k] = _without(tree[k], rests)
    return out


def _piece_key(fqn: str, offsets: tuple, sizes: tuple) -> tuple:
    return (fqn, tuple(offsets), tuple(sizes))


def _replicated(piece: Any) -> bool:
    """Whether other ranks hold the same box as ``piece``: a piece of a DTensor with a Replicate
    placement (a plain tensor's replicas are left to rank 0 in :meth:`IncrementalSaver._local`)."""
    from torch.distributed.tensor import DTensor, Replicate
    return isinstance(piece.owner, DTensor) and any(isinstance(pl, Replicate) for pl in piece.owner.placements)


def _digest_of(digests: torch.Tensor | None) -> bytes:
    """A digest of a piece's row digests, the same on every rank holding the same rows (None: no
    previous digests)."""
    if digests is None:
        return b"\0" * 16
    return hashlib.blake2b(digests.detach().cpu().contiguous().numpy().tobytes(), digest_size=16).digest()


def _replica_writers(stats: list) -> tuple[dict[tuple, int], list[str]]:
    """From every rank's :class:`_DeltaStats`: ``({piece key: the lowest rank holding it}, [fqns whose
    holders' digests differ])`` for the pieces sent as replicated. One rank writes a replica's
    rows: each holder writing its own made overlapping records, which a load composed in any
    order."""
    holders: dict[tuple, list] = {}
    for r, st in enumerate(stats):
        for fqn, offsets, sizes, digest in st.replicas:
            holders.setdefault(_piece_key(fqn, offsets, sizes), []).append((r, digest))
    writer = {key: min(r for r, _d in held) for key, held in holders.items()}
    differ = sorted({key[0] for key, held in holders.items() if len({d for _r, d in held}) > 1})
    return writer, differ


def _signature(t: torch.Tensor, row_dim: int) -> tuple:
    """Which memory a piece's digests describe: a piece whose tensor moved (reallocated, another
    view) is hashed whole, whatever the pages at its old address did."""
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype), row_dim)


_RUN_COST_BYTES = 16384   # _rehash_written's cost of one run of rows, in bytes hashed


def _rehash_written(t: torch.Tensor, row_dim: int, prev: torch.Tensor,
                    written: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The digests of ``t``'s rows given the previous ones (``prev``) and which pages under ``t``
    were written since they were taken (``written``: one bool per page from the page holding
    ``t``'s first byte, distckpt.writewatch): every row with a byte on a written page is hashed
    again (or all rows, where that costs less), the others keep their digest (their bytes
    cannot have changed). Returns (digests, rows hashed); ``prev`` is never modified."""
    from . import _uring
    from .writewatch import PAGE
    x = t.detach().movedim(row_dim, 0)
    n = x.shape[0]
    pages = torch.nonzero(written).reshape(-1)
    if pages.numel() == 0 or n == 0:
        return prev, 0   # nothing under this piece was written: no row can have changed
    es = x.element_size()
    row_bytes = x[0].numel() * es
    stride = x.stride(0) * es
    span = (sum((m - 1) * s for m, s in zip(x.shape[1:], x.stride()[1:])) + 1) * es   # a row's byte extent
    if stride == 0 or row_bytes == 0:
        return row_digests(t, row_dim), n
    inplace = x[0].is_contiguous()   # else each run's rows are copied in blocks first (row_digests)
    skew = x.data_ptr() % PAGE   # the first row starts this far into the first page
    # Runs of consecutive written pages, as byte ranges [a, b) relative to the first row's start;
    # row i covers [i * stride, i * stride + span) and meets [a, b) when i * stride < b and
    # i * stride + span > a.
    brk = torch.nonzero(pages[1:] - pages[:-1] != 1).reshape(-1)
    a = torch.cat([pages[:1], pages[brk + 1]]) * PAGE - skew
    b = (torch.cat([pages[brk], pages[-1:]]) + 1) * PAGE - skew
    lo = (torch.div(a - span, stride, rounding_mode="floor") + 1).clamp_(min=0)
    hi = torch.div(b - 1, stride, rounding_mode="floor").clamp_(max=n - 1) + 1   # exclusive
    ok = lo < hi
    lo, hi = lo[ok], hi[ok]
    if lo.numel() == 0:
        return prev, 0
    # Runs are sorted and may touch or overlap where two written pages share a row: merge them.
    if lo.numel() > 1:
        cut = torch.nonzero(lo[1:] > torch.cummax(hi, 0).values[:-1]).reshape(-1) + 1
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), cut])
        lo, hi = lo[starts], torch.cummax(hi, 0).values[torch.cat([cut - 1, torch.tensor([hi.numel() - 1])])]
    m = int((hi - lo).sum())
    # Cost model, in bytes hashed: the runs in place need a copy of the previous digests (8 bytes
    # a row) and one Python-level call per run, 1.5-6 us measured on the 2-core test VM, about
    # what hashing 16 KiB takes there.
    per_run = _RUN_COST_BYTES * (1 if inplace else 4)
    if m * row_bytes * (1 if inplace else 2) + n * 8 + lo.numel() * per_run >= n * row_bytes:
        return row_digests(t, row_dim), n
    out = prev.clone()
    if not inplace:
        for r0, r1 in zip(lo.tolist(), hi.tolist()):
            out[r0:r1] = row_digests(x[r0:r1], 0)
        return out, m
    size = next(z for z in (8, 4, 2, 1) if row_bytes % z == 0)
    width = row_bytes // size
    mult = _multipliers(width)
    base, optr, mptr = x.data_ptr(), out.data_ptr(), mult.data_ptr()
    for r0, r1 in zip(lo.tolist(), hi.tolist()):
        _uring.row_digests(base + r0 * stride, r1 - r0, stride, width, size, mptr, optr + 8 * r0)
    return out, m


# ------------------------------------------------------------------------------------------------
# Saving


def _shapes(items: dict, rows: dict) -> dict[str, list]:
    """{fqn: [global shape, dtype name]} of the tracked tensors: a link records them, and a delta
    is written only against a link whose tensors had the same (a delta's rows are composed into
    its base's tensor: another shape or dtype would be cut or rounded to the base's)."""
    return {f: [[int(v) for v in items[f].shape], dtype_name(items[f].dtype)] for f in sorted(rows)}


def _link_path(path: str | os.PathLike, operation: str) -> str:
    """A link's absolute local path (``file://`` URLs accepted). Raises ConfigError for an object
    store URL: chains are resolved and composed from sibling local directories (``os.path`` on an
    ``s3://`` string would name a local directory called ``s3:`` instead)."""
    from .storage import is_url, normalize_path
    if is_url(os.fsdecode(path) if isinstance(path, bytes) else os.fspath(path)):
        raise ConfigError(f"{operation}: {path}: incremental chains are written to local directories only",
                          remedy="Save the chain to a local or mounted file system, or save full checkpoints "
                                 "(distckpt.save / CheckpointManager without incremental=) to object storage.")
    return normalize_path(path)


class IncrementalSaver:
    """Saves a chain: full checkpoints and deltas against the previous link, per the policy.

    One saver per job (it holds the digests of the last committed link: 8 bytes per tracked row
    on this rank). After a restart, :meth:`resume` with the state just loaded continues the chain
    of the loaded checkpoint; without it the first save is full.

    ``last_hashed_rows``: the rows this rank hashed for its last save or resume (every tracked
    row, unless the policy's ``watch_writes`` let it skip rows on pages nobody wrote);
    ``watch_status``: with ``watch_writes``, the tracked tensors hashed whole and why.
    """

    def __init__(self, policy: IncrementalPolicy | None = None) -> None:
        self.policy = policy or IncrementalPolicy()
        self._digests: dict[tuple, torch.Tensor] = {}
        # Per piece, where its digests were taken: (data_ptr, shape, strides, dtype, scan epoch)
        # when its pages are watched (watch_writes), so the next save re-hashes only the rows on
        # pages written after that scan; None otherwise.
        self._refs: dict[tuple, tuple | None] = {}
        self._link: dict | None = None   # chain metadata + path + save_id of the last committed link
        self._pending = None   # the AsyncSaveHandle of this saver's last async save
        self.last_kind: str | None = None
        self.last_hashed_rows = 0   # rows this rank hashed for its last save / resume (of all tracked)
        self.watch_status: dict[str, str] = {}   # fqn -> why its pieces are hashed whole (watch_writes)

    # -- bookkeeping -------------------------------------------------------------------------------

    def _local(self, state_dict: Any, group: Any):
        from .flatten import flatten
        _tree, items = flatten(state_dict, check_objects=False)
        rows = _resolve_rows(self.policy.rows, state_dict, items)
        if DELTA_ROOT in (state_dict if isinstance(state_dict, dict) else {}):
            raise ConfigError(f"an incremental state dict may not use the root key {DELTA_ROOT!r}")
        if not isinstance(state_dict, dict):
            raise ConfigError("an incremental save needs a dict as the state dict's root")
        local = []
        for j, fqn in enumerate(sorted(rows)):
            it, d = items[fqn], rows[fqn]
            if it.kind == "tensor" and group.rank != 0:
                continue  # a plain tensor is a replica: the lowest rank writes it
            local.extend((fqn, j, i, p) for i, p in enumerate(it.pieces))
        watch, why_not, epoch = None, {}, None
        if self.policy.watch_writes:
            from .writewatch import get
            watch = get()
            for fqn, _j, _i, p in local:   # new pages are watched before the scan below
                why = watch.watch(p.tensor)
                if why is not None:
                    why_not.setdefault(fqn, why)
            epoch = watch.scan()   # every write before this is in memory; any later one is seen later
        self.watch_status = why_not
        pieces = []   # (fqn, j, piece index, Piece, digests, reference for the next save)
        hashed = 0
        for fqn, j, i, p in local:
            d = rows[fqn]
            key = _piece_key(fqn, p.offsets, p.sizes)
            sig = _signature(p.tensor, d) if watch is not None and fqn not in why_not else None
            prev, ref = self._digests.get(key), self._refs.get(key)
            written = None
            if sig is not None and ref is not None and prev is not None and ref[:-1] == sig:
                written = watch.written_since(p.tensor, ref[-1])
            if written is None:
                dg = row_digests(p.tensor, d)
                hashed += dg.numel()
            else:
                dg, n = _rehash_written(p.tensor, d, prev, written)
                hashed += n
            pieces.append((fqn, j, i, p, dg, None if sig is None else sig + (epoch,)))
        self.last_hashed_rows = hashed
        return items, rows, pieces

    def resume(self, state_dict: Any, path: str | os.PathLike, *, process_group: Any = None) -> None:
        """Continue the chain of the checkpoint at ``path`` whose state ``state_dict`` now holds
        (right after loading it): the next save may be a delta against it. Collective."""
        from ._dist import control_group
        self._wait_pending()
        group = control_group(process_group, operation="IncrementalSaver.resume()")
        path = _link_path(path, "IncrementalSaver.resume()")
        links = chain_of(path)
        items, rows, pieces = self._local(state_dict, group)
        meta = links[0].meta
        if meta.get("chain") is None or sorted(rows) != [f for f, _d in meta.get("tracked", [])] \
                or any(rows[f] != d for f, d in meta.get("tracked", [])) or meta.get("shapes") != _shapes(items, rows):
            # Not a chain of these tensors (other keys, row dims, global shapes or dtypes: a model
            # loaded onto another plan or in another dtype): the next save is full.
            self._digests, self._refs, self._link = {}, {}, None
            return
        self._digests = {_piece_key(f, p.offsets, p.sizes): dg for f, _j, _i, p, dg, _r in pieces}
        self._refs = {_piece_key(f, p.offsets, p.sizes): r for f, _j, _i, p, _dg, r in pieces}
        self._link = dict(meta, path=path, save_id=links[0].manifest.save_id)

    # -- the save ----------------------------------------------------------------------------------

    def save(self, state_dict: Any, path: str | os.PathLike, *, process_group: Any = None,
             metadata: dict | None = None, force_full: bool = False, **save_kwargs: Any):
        """Save ``state_dict`` at ``path`` as the next link of the chain (collective).

        A delta when the policy allows (and the previous link is still committed, unreplaced, in
        the same directory), else a full checkpoint. ``save_kwargs`` go to
        :func:`distckpt.save_sync.save_in_root` (:func:`distckpt.save`'s options, and a root owner's
        ``after_commit`` / ``lock_path``).
        Returns its SaveResult; ``self.last_kind`` is ``"full"`` or ``"delta"``. Waits first for
        this saver's async save still in flight (the next link depends on its outcome).

        Raises what :func:`distckpt.save` raises, and ConfigError for a bad ``rows`` policy.
        After a failure the chain and this saver stay at the previous link.
        """
        from .save_sync import save_in_root
        path, to_save, info, pieces, meta = self._prepare(state_dict, path, process_group, metadata, force_full,
                                                          "IncrementalSaver.save()",
                                                          save_kwargs.get("replicated", "check"),
                                                          bool(save_kwargs.get("no_dist")))
        try:
            result = save_in_root(to_save, path, process_group=process_group, metadata=meta, **save_kwargs)
        except DistCkptError as exc:
            if getattr(exc, "committed", False) is True:   # committed, then an after-commit step failed
                self._advance(info, path, pieces)
            raise
        self._advance(info, path, pieces)
        return result

    def async_save(self, state_dict: Any, path: str | os.PathLike, *, process_group: Any = None,
                   metadata: dict | None = None, force_full: bool = False,
                   on_outcome: Callable | None = None, **save_kwargs: Any):
        """:meth:`save` through :func:`distckpt.async_save`: returns an AsyncSaveHandle once the
        link's content is staged (collective).

        Before it returns, the full/delta decision is taken, the changed rows are gathered into
        new memory (a delta), and the state dict's other tensors are copied into staging memory
        (async_save's snapshot isolation): changing any tensor afterwards does not change this
        link. Its digests become the saver's reference only once the link commits, on the save's
        own thread; the next :meth:`save` / :meth:`async_save` / :meth:`resume` of this saver
        waits for that first, so it is a delta against the link that exists. ``on_outcome(result,
        error)``: called on the save's thread once the link's outcome has moved the saver on (see
        :func:`distckpt.save_async.async_save_in_root`).

        Raises ConfigError for a bad ``rows`` policy; a save's own errors are raised by the
        handle's ``result()``, as for :func:`distckpt.async_save`.
        """
        from .save_async import async_save_in_root
        path, to_save, info, pieces, meta = self._prepare(state_dict, path, process_group, metadata, force_full,
                                                          "IncrementalSaver.async_save()",
                                                          save_kwargs.get("replicated", "check"),
                                                          bool(save_kwargs.get("no_dist")))

        def outcome(result, error) -> None:   # on the save's thread, before its handle reports done
            if result is not None or getattr(error, "committed", False) is True:
                self._advance(info, path, pieces)
            if on_outcome is not None:
                on_outcome(result, error)
        self._pending = async_save_in_root(to_save, path, process_group=process_group, metadata=meta,
                                           on_outcome=outcome, **save_kwargs)
        return self._pending

    def _wait_pending(self) -> None:
        """Wait until this saver's async save in flight (if any) has committed or failed, and its
        outcome has moved the saver on (its error is left to its handle and to
        distckpt.save_async.raise_background_failure)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def _prepare(self, state_dict: Any, path: str | os.PathLike, process_group: Any, metadata: dict | None,
                 force_full: bool, operation: str, replicated: Any,
                 no_dist: bool = False) -> tuple[str, dict, dict, list, dict]:
        """The full/delta decision (collective, unless ``no_dist``: this process alone, as the
        save's own ``no_dist``) and what to save: (the link's absolute path, state dict to save,
        chain metadata, this rank's pieces with their digests, the MANIFEST's user metadata).
        ``replicated``: save's option of that name (which plain tensors must be equal on every
        rank holding them).

        Raises ConfigError for an object store URL before any collective; StateDictMismatchError
        (on every rank) when a delta's plain tracked tensor differs between ranks, as a full save
        would."""
        from ._dist import ControlGroup, control_group
        from .saveplan import check_replicated_option, inconsistent_ranks, replica_problems, tensor_digests
        checked = check_replicated_option(replicated)
        self._wait_pending()
        path = _link_path(path, operation)
        # no_dist: the save runs without a collective (save_in_root), so must the decision: a
        # control group would wait at its arrival check for ranks that are not saving.
        group = ControlGroup(None, 0, 1) if no_dist else control_group(process_group, operation=operation)
        items, rows, pieces = self._local(state_dict, group)
        tracked = [[f, rows[f]] for f in sorted(rows)]
        shapes = _shapes(items, rows)
        changed_bytes = total_bytes = changed_rows = total_rows = 0
        unknown = False
        selections = []
        for fqn, j, i, p, dg, _ref in pieces:
            d = rows[fqn]
            prev = self._digests.get(_piece_key(fqn, p.offsets, p.sizes))
            if prev is None or prev.shape != dg.shape:
                unknown = True
                sel = torch.arange(dg.numel())
            elif dg is prev:   # watch_writes: no page of this piece was written, nothing to compare
                sel = torch.zeros(0, dtype=torch.int64)
            else:
                sel = torch.nonzero(dg != prev).reshape(-1)
            n = dg.numel()
            row_bytes = (p.tensor.numel() // max(n, 1)) * p.tensor.element_size()
            changed_rows += sel.numel()
            total_rows += n
            changed_bytes += sel.numel() * row_bytes
            total_bytes += n * row_bytes
            selections.append(sel)
        link = self._link
        parent_ok = False
        if link is not None and group.rank == 0 and os.path.dirname(link["path"]) == os.path.dirname(path):
            # The whole chain, not only the parent: a delta on a chain whose older link was
            # deleted or replaced would be committed, listed, and never load.
            try:
                links = chain_of(link["path"], chunks=False)
                # A save that replaces a link of the chain it would extend (overwrite=True of the
                # step it resumed from or of an older link) would leave a delta on a chain
                # missing that link, or naming itself as its parent: it is written full.
                parent_ok = (links[0].manifest.save_id == link["save_id"]
                             and os.path.abspath(path) not in {os.path.abspath(c.path) for c in links})
            except DistCkptError:
                parent_ok = False
        pol = self.policy
        why = None   # this rank's own reason for a full link: known before any exchange
        if force_full:
            why = "asked"
        elif link is None:
            why = "no previous link"
        elif link.get("tracked") != tracked:
            why = "the tracked tensors changed"
        elif link.get("shapes") != shapes:
            why = ("the tracked tensors' global shapes or dtypes changed" if "shapes" in link
                   else "the previous link does not record its tensors' shapes and dtypes (an older distckpt)")
        elif link["seq"] + 1 >= pol.full_every:
            why = f"full_every={pol.full_every}"
        plain = [f for f in sorted(rows) if items[f].kind == "tensor" and checked(f)] if group.world_size > 1 else []
        # A replica's digests now and at the previous link: both must agree between its holders.
        replicas = tuple((fqn, tuple(p.offsets), tuple(p.sizes),
                          _digest_of(dg) + _digest_of(self._digests.get(_piece_key(fqn, p.offsets, p.sizes))))
                         for fqn, _j, _i, p, dg, _r in pieces if _replicated(p)) if group.world_size > 1 else ()
        stats = group.all_gather(_DeltaStats(changed_bytes, total_bytes, changed_rows, total_rows, bool(unknown),
                                             parent_ok, why, None if link is None else link["save_id"], bool(plain),
                                             replicas))
        writer, differ = _replica_writers(stats)
        c_bytes, t_bytes = sum(s.changed_bytes for s in stats), sum(s.total_bytes for s in stats)
        # From here on every input is the same on every rank, and so is the decision.
        reasons = [(r, s.why) for r, s in enumerate(stats) if s.why is not None]
        if reasons:
            r, why = reasons[0]
            if any(s.why != why for s in stats):
                why = f"{why} (on rank {r}; not on every rank)"
        elif len({s.parent for s in stats}) > 1:
            why = "the ranks' previous links differ (a saver rebuilt or resumed on some ranks only)"
        elif not stats[0].parent_ok:
            why = (f"the previous link {link['path']} or a link it depends on is gone, replaced, in another directory, "
                   f"or replaced by this very save")
        elif any(s.unknown for s in stats):
            why = "tracked tensors or their sharding changed since the previous link"
        elif differ:
            why = (f"the replicas of tracked tensor {differ[0]!r} differ between ranks, now or at the previous link: a "
                   f"delta would compose one rank's rows onto another's")
        elif c_bytes > pol.max_delta_fraction * t_bytes:
            why = f"{c_bytes} changed bytes > max_delta_fraction={pol.max_delta_fraction} of {t_bytes}"
        elif link.get("chain_bytes", 0) + c_bytes > pol.max_chain_fraction * t_bytes:
            why = f"the chain's deltas would exceed max_chain_fraction={pol.max_chain_fraction}"
        name = os.path.basename(path)
        if why is None:
            if any(st.plain for st in stats):
                # A delta leaves its plain tracked tensors out of the save: check their replicas
                # here, as a full save's plan would (digested only once the link is a delta).
                replicas = dict(zip(plain, tensor_digests([items[f].pieces[0].tensor for f in plain])))
                problems = replica_problems(group.all_gather(replicas))
                if problems:   # the same on every rank: each raises before the save's collective
                    raise inconsistent_ranks(problems)
            info = {"format": FORMAT, "kind": "delta", "chain": link["chain"], "seq": link["seq"] + 1,
                    "base": link["base"], "parent": os.path.basename(link["path"]),
                    "parent_save_id": link["save_id"], "tracked": tracked, "shapes": shapes,
                    "chain_bytes": link.get("chain_bytes", 0) + c_bytes, "link_bytes": c_bytes,
                    "tracked_bytes": t_bytes, "rows_written": sum(s.changed_rows for s in stats),
                    "rows_total": sum(s.total_rows for s in stats)}
            records: dict[str, dict] = {}
            for (fqn, j, i, p, _dg, _ref), sel in zip(pieces, selections):
                if sel.numel() == 0 or writer.get(_piece_key(fqn, p.offsets, p.sizes), group.rank) != group.rank:
                    continue   # nothing changed, or a replica another rank writes
                d = rows[fqn]
                t = p.tensor
                vals = t.detach().index_select(d, sel.to(t.device)).movedim(d, 0).contiguous()
                box = [[int(v) for v in p.offsets], [int(v) for v in p.sizes]]   # a value: in the MANIFEST
                ids = sel + p.offsets[d]
                if ids.numel() and int(ids[-1]) < 2**31:  # 4 bytes a row instead of 8
                    ids = ids.to(torch.int32)
                records.setdefault(str(j), {})[f"r{group.rank}p{i}"] = {"box": box, "ids": ids, "rows": vals}
            to_save = _without(state_dict, [items[f].path for f in rows])
            to_save[DELTA_ROOT] = records
        else:
            info = {"format": FORMAT, "kind": "full", "chain": uuid.uuid4().hex, "seq": 0, "base": name,
                    "parent": None, "parent_save_id": None, "tracked": tracked, "shapes": shapes, "chain_bytes": 0,
                    "link_bytes": t_bytes, "tracked_bytes": t_bytes, "rows_written": sum(s.total_rows for s in stats),
                    "rows_total": sum(s.total_rows for s in stats), "why": why}
            info = group.broadcast(info)   # one chain id for every rank
            to_save = state_dict
        meta = dict(metadata or {})
        meta[META_KEY] = info
        return path, to_save, info, pieces, meta

    def _advance(self, info: dict, path: str, pieces: list) -> None:
        """The save committed: the next delta is relative to it."""
        from .storage.posix.manifests import load_manifest
        try:
            save_id = load_manifest(path).save_id
        except DistCkptError:  # committed, then lost (rotated, deleted): the next save is full
            self._digests, self._refs, self._link, self.last_kind = {}, {}, None, info["kind"]
            return
        self._digests = {_piece_key(f, p.offsets, p.sizes): dg for f, _j, _i, p, dg, _r in pieces}
        self._refs = {_piece_key(f, p.offsets, p.sizes): r for f, _j, _i, p, _dg, r in pieces}
        self._link = dict(info, path=path, save_id=save_id)
        self.last_kind = info["kind"]


# ------------------------------------------------------------------------------------------------
# Planning a chain's load: which rows of which delta (distckpt.restore plans and fills the rest)


@dataclasses.dataclass
class Target:
    """A box of a tracked tensor this rank loads (global ``offsets`` and ``sizes``) and the
    tensor holding it, which the deltas' rows are scattered into."""

    offsets: tuple
    sizes: tuple
    tensor: torch.Tensor


class _ScatterRows:
    """A read destination (see distckpt.fill.box_tasks) whose dim-0 index i is row ``idx[i]``
    of ``target``: the fill narrows it to each unit's box and copies the unit in with one
    ``index_copy_``."""

    def __init__(self, target: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype,
                 mask: torch.Tensor | None = None) -> None:
        self.target, self.idx, self.dtype, self.mask = target, idx, dtype, mask   # mask: rows to write

    def is_contiguous(self) -> bool:
        return False   # never a flat byte run: the fill takes the narrow/copy_ path

    def narrow(self, dim: int, start: int, length: int) -> "_ScatterRows":
        if dim == 0:
            mask = self.mask.narrow(0, start, length) if self.mask is not None else None
            return _ScatterRows(self.target, self.idx.narrow(0, start, length), self.dtype, mask)
        return _ScatterRows(self.target.narrow(dim, start, length), self.idx, self.dtype, self.mask)

    def copy_(self, src: torch.Tensor) -> None:
        idx = self.idx
        if self.mask is not None and not bool(self.mask.all()):
            idx, src = idx[self.mask], src[self.mask.to(src.device)]
        if idx.numel():
            target, src = self.target, src.to(dtype=self.target.dtype, device=self.target.device)
            bits = _SAME_SIZE_INT.get(target.element_size())
            if bits is not None and target.dtype not in _INDEX_COPY_DTYPES:
                # index_copy_ has no kernel for float8 and uint16/32/64 (a bare NotImplementedError
                # made every delta of such a table unloadable): the rows' bits are copied instead,
                # through an integer view of the same width, which is exact.
                target, src = target.view(bits), src.view(bits)
            target.index_copy_(0, idx, src)


#: Integer dtypes of each element width: a bit-exact view for a row copy of any dtype of that width.
_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: The dtypes whose index_copy_ works on every device distckpt restores to (the rest go through _SAME_SIZE_INT).
_INDEX_COPY_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
                                torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
                                torch.complex128})


def _cells(regions: set) -> list[tuple]:
    """The coarsest boxes (over the non-row dimensions) that tile every region of ``regions``:
    the products of the intervals between consecutive region bounds, per dimension, that lie in
    some region. Regions that are equal or disjoint are their own cells (one sharding plan over
    the chain); links saved on different column splits cut each other's regions into cells."""
    regions = list(regions)
    if len(regions) == 1:
        return regions
    ndim = len(regions[0])
    cuts = [sorted({v for r in regions for v in (r[k][1], r[k][2])}) for k in range(ndim)]
    out = []
    for cell in itertools.product(*[[(regions[0][k][0], a, b) for a, b in zip(c, c[1:])]
                                    for k, c in enumerate(cuts)]):
        if any(_within(cell, r) for r in regions):
            out.append(cell)
    return out


def _within(inner: tuple, outer: tuple) -> bool:
    return all(a2 <= a and b <= b2 for (_k, a, b), (_k2, a2, b2) in zip(inner, outer))


def _index_dtype(n: int) -> torch.dtype:
    """The narrowest signed integer dtype holding -1 .. n - 1 (newest-link maps: 1 byte a row for
    chains of fewer than 128 links)."""
    return next(d for d in (torch.int8, torch.int16, torch.int32, torch.int64) if n <= torch.iinfo(d).max)


def plan_deltas(deltas: list[ChainLink], targets: dict[str, list[Target]], tracked: dict[str, int],
                verify: bool, ids_cache: dict | None = None) -> tuple[list, int]:
    """What to read from ``deltas`` (oldest first) so that every (row, column) of ``targets`` that
    some delta holds is written exactly once, from the newest delta holding it.

    Reads the row ids of every saved piece that overlaps a target piece of this rank (one pass
    over all links). Returns ``(reads, id_bytes)``: ``reads`` as for distckpt.fill.fill_boxes_of, one
    entry per link with rows to read (links whose rows are all superseded are not read), each
    request ``(rows fqn, offsets, sizes, scatter destination, tracked fqn)``: the row span of one
    piece's record holding newest copies, over one cell of columns, scattered from the read
    buffers straight into the target (superseded rows inside the span are read, not written).
    Since no (row, column) is written twice, the requests may be filled in any order; the tracked
    fqn, as ``after``, also lets a caller fill them in the base's own pass, after its tensor
    (distckpt.restore reads them in a pass after the base's).
    ``ids_cache``: the row ids read and checked by earlier calls (a caller planning one tensor
    slice by slice reads and checks each piece's ids once; filled here).
    Raises ChainBrokenError when a link's records are malformed or cannot be read."""
    order = sorted(tracked)

    # Pass 1: the ids (4 bytes a row) of every saved piece that overlaps a target piece of this
    # rank (the pieces' boxes are values in the MANIFEST), one read for every link at once.
    entries = []   # (link index, fqn, target, piece fqns, saved offsets, region, lo, target rows)
    wanted = []
    for link in deltas:
        check_no_stray(link, len(order))
        pieces = []
        shapes = link.meta.get("shapes") or {}   # absent in chains of older savers
        for fqn in targets:
            for _n, parts in sorted(pieces_of(link, order.index(fqn)).items()):
                soff, ssz = box_of(link, parts["box"])
                if any(len(soff) != len(t.offsets) for t in targets[fqn]):
                    raise _broken(link.path, f"{fqn}: a delta piece of {len(soff)} dims")
                check_box(link, fqn, parts["box"], soff, ssz, shapes.get(fqn, [None])[0])
                if any(all(max(a, b) < min(a + m, b + n) for a, m, b, n in zip(soff, ssz, t.offsets, t.sizes))
                       for t in targets[fqn]):
                    check_ids_form(link, parts["ids"])
                    pieces.append((fqn, parts, soff, ssz))
        wanted.append(pieces)
    # ids_cache holds only ids that passed the checks below (as int64): a caller planning one
    # tensor slice by slice neither reads nor checks a piece's ids again.
    cached = ids_cache if ids_cache is not None else {}
    new: dict[tuple, torch.Tensor] = {}
    ids_of, reads = [], []
    for link, pieces in zip(deltas, wanted):
        outs, reqs = [], []
        for _f, parts, _o, _s in pieces:
            key = (link.path, parts["ids"])
            out = cached.get(key)
            if out is None:
                out = new[key] = torch.empty(tuple(link.manifest.tensors[parts["ids"]].shape),
                                             dtype=dtype_from_name(link.manifest.tensors[parts["ids"]].dtype,
                                                                   path=link.path))
                reqs.append((parts["ids"], (0,), tuple(out.shape), out))
            outs.append(out)
        ids_of.append(outs)
        if reqs:
            reads.append((link.path, link.manifest, reqs))
    id_bytes = read_records(reads, verify, "delta row ids") if reads else 0
    for li, (link, pieces, got) in enumerate(zip(deltas, wanted, ids_of)):
        checked = []
        for (fqn, parts, soff, ssz), ids in zip(pieces, got):
            key = (link.path, parts["ids"])
            if key in new:
                ids = checked_ids(link, parts, ids, soff, ssz, tracked[fqn], fqn)
                if ids_cache is not None:
                    ids_cache[key] = ids
            checked.append((fqn, parts, soff, ssz, ids))
        id_bytes += check_all_overlaps(link, checked, tracked, verify, cached)
        for fqn, parts, soff, ssz, ids in checked:
            d = tracked[fqn]
            for t in targets[fqn]:
                region = []
                for k2 in range(len(soff)):
                    if k2 == d:
                        continue
                    lo2 = max(soff[k2], t.offsets[k2])
                    hi2 = min(soff[k2] + ssz[k2], t.offsets[k2] + t.sizes[k2])
                    if hi2 <= lo2:
                        break
                    region.append((k2, lo2, hi2))
                else:
                    r0, n = t.offsets[d], t.sizes[d]
                    lo = int(torch.searchsorted(ids, r0))
                    hi = int(torch.searchsorted(ids, r0 + n))
                    if hi > lo:
                        entries.append((li, fqn, t, parts, soff, tuple(region), lo, ids[lo:hi] - r0))
    # Pass 2: cut every target's regions into cells (equal or disjoint column ranges), then find
    # the newest link holding each (row, cell): a map of link indexes per target row (1 byte a row),
    # only where more than one link covers a cell.
    regions: dict[int, set] = {}
    for _li, _f, t, _p, _s, region, _lo, _rows in entries:
        regions.setdefault(id(t), set()).add(region)
    cells = {tid: _cells(regs) for tid, regs in regions.items()}
    covering: dict[tuple, int] = {}
    for _li, _f, t, _p, _s, region, _lo, _rows in entries:
        for cell in cells[id(t)]:
            if _within(cell, region):
                covering[(id(t), cell)] = covering.get((id(t), cell), 0) + 1
    newest: dict[tuple, torch.Tensor] = {}
    for li, fqn, t, _p, _s, region, _lo, rows in entries:
        for cell in cells[id(t)]:
            key = (id(t), cell)
            if covering[key] > 1 and _within(cell, region):
                if key not in newest:
                    newest[key] = torch.full((t.sizes[tracked[fqn]],), -1, dtype=_index_dtype(len(deltas)))
                newest[key][rows] = li
    # Pass 3: per link and (piece, cell), the row span from its first to its last newest copy.
    plans: list[list] = [[] for _ in deltas]
    for li, fqn, t, parts, soff, region, lo, rows in entries:
        for cell in cells[id(t)]:
            if not _within(cell, region):
                continue
            arr = newest.get((id(t), cell))
            keep = None if arr is None else torch.nonzero(arr[rows] == li).reshape(-1)
            if keep is None or keep.numel():
                plans[li].append((fqn, t, parts, soff, cell, lo, rows, keep))
    reads = []
    for li, plan in enumerate(plans):
        if not plan:
            continue
        link = deltas[li]
        reqs = []
        for fqn, t, parts, soff, cell, lo, rows, keep in plan:
            first, lastk = (0, rows.numel() - 1) if keep is None else (int(keep[0]), int(keep[-1]))
            offs, szs = [lo + first], [lastk - first + 1]
            for (k2, a, b) in cell:
                offs.append(a - soff[k2])
                szs.append(b - a)
            if len(link.manifest.tensors[parts["rows"]].shape) != len(offs):
                raise _broken(link.path, f"{fqn}: delta rows do not match their box")
            tv = t.tensor.movedim(tracked[fqn], 0)
            for pos, (k2, a, b) in enumerate(cell):
                tv = tv.narrow(pos + 1, a - t.offsets[k2], b - a)
            mask = None
            if keep is not None and keep.numel() < szs[0]:
                mask = torch.zeros(szs[0], dtype=torch.bool)
                mask[keep - first] = True
            dtype = dtype_from_name(link.manifest.tensors[parts["rows"]].dtype, path=link.path)
            # Rows composed into the base's tensor would be rounded to its dtype (a saver now
            # starts a full link when a dtype changes).
            check_rows_dtype(link, fqn, parts["rows"], dtype_name(tv.dtype))
            reqs.append((parts["rows"], tuple(offs), tuple(szs),
                         _ScatterRows(tv, rows[first:lastk + 1].to(tv.device), dtype, mask), fqn))
        reads.append((link.path, link.manifest, reqs))
    return reads, id_bytes
