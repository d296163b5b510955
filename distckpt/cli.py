"""The ``distckpt`` command line (also ``python -m distckpt``).

    distckpt ls ROOT            committed steps under a CheckpointManager root
    distckpt ls LOCAL --remote URL   the steps of a TieredCheckpointManager, a column per tier
    distckpt inspect PATH       what a checkpoint holds: values, tensors, sizes, who wrote it (--json)
    distckpt verify PATH        read every byte and check every checksum, with bounded memory
    distckpt preflight PATH     the pre-flight checks (distckpt.checks)
    distckpt bench DIR          I/O and save/load benchmarks (distckpt.bench)

Exit status: 0 on success, 1 when a check or verification failed (or a distckpt error), 2 on bad
usage, 3 when a request failed and the answer is incomplete (verify: NOT VERIFIED; ls: a step it
could not read), 130 when interrupted (Ctrl-C).

Parsing the command line imports no torch and runs no probe: this module and what it imports at
start-up stay light, and each command imports what it needs when it runs (``--help`` and
``--version`` answer at once). Output formats: docs/CLI.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import sys
import time

from . import __version__
from .clijson import JSON_FORMAT  # the version every --json document carries (a leaf: preflight reads it too)
from .errors import DistCkptError
from .sizes import CONVENTION, format_bytes
from .values import VALUE_KIND, describe


def _cmd_ls(args) -> int:
    """Print :func:`distckpt.listing.list_root` (the library builds the listing; this only formats
    it). Never writes: no directory is created, nothing is reclaimed. Imports no torch
    (distckpt.listing is torch-free), so it answers as fast as ``inspect``."""
    from .errors import CheckpointNotFoundError
    from .listing import list_root
    from .storage import open_store
    if args.remote:
        return _ls_tiers(args)
    try:
        listing = list_root(args.root)
    except CheckpointNotFoundError as exc:
        print(f"distckpt ls: {exc.message}", file=sys.stderr)
        return 2
    if listing.kind == "root" and not listing.entries and not listing.leftovers and listing.latest_pointer is None:
        # Nothing of a checkpoint root there (no step, no save's leftover, no `latest`): a wrong path.
        try:
            names = sorted(os.listdir(listing.path))
        except OSError:
            names = []
        held = f" (it holds {', '.join(names[:5])}{' ...' if len(names) > 5 else ''})" if names else " (it is empty)"
        print(f"distckpt ls: {listing.path} holds no checkpoints{held}", file=sys.stderr)
        return 2
    # A step whose MANIFEST could not be read (a timeout, a refusal: not known to be damaged) makes
    # the listing incomplete: exit 3, as verify's NOT VERIFIED (it exited 0).
    incomplete = 3 if any(e.status == "unreadable" and e.step is not None for e in listing.entries) else 0
    if args.json:
        print(json.dumps({"json_format": JSON_FORMAT, **listing.to_dict()}, indent=1, sort_keys=True))
        return incomplete

    def chain(e):  # an incremental chain's link: "full", or "delta 2 <- step_00000150"
        c = e.chain
        if not c:
            return "-"
        return "full" if c.get("kind") == "full" else f"delta {c.get('seq')} <- {c.get('parent')}"

    rows = [("STEP", "SIZE", "SAVED (UTC)", "RANKS", "CHAIN", "LATEST", "STATUS")]
    for e in listing.entries:
        rows.append((str(e.step) if e.step is not None else e.name,
                     format_bytes(e.size_bytes) if e.size_bytes is not None else "-", _when(e.created_unix),
                     str(e.ranks) if e.ranks is not None else "-", chain(e), "latest" if e.is_latest else "",
                     e.status if e.problem is None else f"{e.status}: {e.problem}"))
    print(f"{listing.path} ({'checkpoint' if listing.kind == 'checkpoint' else 'checkpoint root'})")
    if len(rows) == 1:
        print("  no checkpoints")
    else:
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        for r in rows:
            print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    if listing.pointer_problem:
        print(f"  note: {listing.pointer_problem}")
    if listing.kind == "root" and _is_tier_local_root(listing.path):
        # One node's local tier of a TieredCheckpointManager: each node holds its own ranks' files,
        # so "committed" here says nothing of the other nodes' (a save killed between the nodes'
        # publishes leaves a step that no load takes, marked latest above).
        print("  note: this is one node's local tier of a tiered checkpoint: a step here is complete only with the "
              "other nodes' files or its remote copy; `distckpt ls ROOT --remote URL` and the manager's load() "
              "tell")
    unreadable = [e.name for e in listing.entries if e.status == "unreadable" and e.step is not None]
    if unreadable and listing.kind == "root":
        print(f"  note: {', '.join(unreadable)} cannot be read (above): no step is marked latest, since "
              "CheckpointManager.load() raises until it can be read")
    saves = [lo for lo in listing.leftovers if lo.kind != "lock" or lo.name == ""]
    store = open_store(listing.path)
    if saves:
        print("saves in flight, and what interrupted saves and overwrites left:")
        for lo in saves:
            o = lo.owner or {}
            who = (f"host {o.get('host', '?')} pid {o.get('pid', '?')}, started {_when(o.get('started_unix'))}"
                   if o else "owner unknown")
            alive = lo.state == "alive"
            what = {"tmp": "save in progress" if alive else "interrupted save", "del": "deletion",
                    "lock": "save lock"}[lo.kind]
            if lo.kind == "tmp" and lo.state == "dead" and store.replaced_checkpoint(lo.path):
                what = "checkpoint an overwrite replaced (its deletion did not finish)"
            used = store.bytes_under(lo.path) if lo.kind != "lock" else None
            size = f" ({format_bytes(used)})" if used is not None else ""
            verdict = {"alive": "ALIVE (in flight)", "dead": "dead: reclaimable",
                       "unknown": "unknown (another host's; left alone)",
                       "settling": "failed commit whose request may still land: kept for DISTCKPT_OBJECT_LATE_S"}[lo.state]
            print(f"  {lo.entry}{size}  {what}  {who}  {verdict}")
        if any(lo.state == "dead" for lo in saves):
            print(f"  reclaim the dead ones: the next save of the same name does, or "
                  f"python -c \"import distckpt; distckpt.CheckpointManager({listing.path!r}).reclaim()\"")
    return incomplete


def _ls_tiers(args) -> int:
    """``distckpt ls LOCAL --remote URL``: :func:`distckpt.tiers.listing.list_tiers`, one row per
    step, a column per tier. Never writes; imports no torch."""
    from .tiers.listing import list_tiers, pairing_problem
    rows, loc, rem, remote_error = list_tiers(args.root, args.remote)
    if loc is None and rem is None and remote_error is None:
        print(f"distckpt ls: neither {args.root} nor {args.remote} exists", file=sys.stderr)
        return 2
    # The remote root named is the local tier's own remote tier (as TieredCheckpointManager
    # checks): else the table mixes another run's steps in, or calls every step not remote.
    mismatch = pairing_problem(args.root, args.remote) if remote_error is None and loc is not None else None
    # The local tier is shown even when the remote tier could not be listed; the exit status
    # says the listing is incomplete (3: a request failed, as for a step `ls` could not read),
    # or that the two roots are not one tiered checkpoint (1).
    status = 3 if remote_error is not None else 1 if mismatch else 0
    if args.json:
        import dataclasses
        doc = {"json_format": JSON_FORMAT, "local": args.root, "remote": args.remote,
               "local_exists": loc is not None, "steps": [dataclasses.asdict(r) for r in rows]}
        if remote_error is not None:
            doc["remote_error"] = {"type": type(remote_error).__name__, "message": str(remote_error)}
        if mismatch:
            doc["not_paired"] = mismatch
        print(json.dumps(doc, indent=1, sort_keys=True))
        return status
    if loc is None and remote_error is not None:
        raise remote_error  # nothing to show: the local tier does not exist either


    def local(r):
        if r.local is None:
            return "-"
        return r.local if r.local != "committed" else f"committed ({r.local_files}/{r.files} files here)"

    def remote(r):
        if r.remote == "unknown":
            return "unknown (recorded drained)" if r.drained else "unknown"
        return r.remote or "-"

    table = [("STEP", "SIZE", "SAVED (UTC)", "RANKS", "LOCAL (this node)", "REMOTE", "LATEST", "NOTE")]
    for r in rows:
        table.append((str(r.step), format_bytes(r.size_bytes) if r.size_bytes is not None else "-",
                      _when(r.created_unix), str(r.ranks) if r.ranks is not None else "-", local(r),
                      remote(r), "latest" if r.latest else "", r.problem or ""))
    print(f"{args.root} (local tier) -> {args.remote} (remote tier)")
    if len(table) == 1:
        print("  no checkpoints")
    else:
        widths = [max(len(t[i]) for t in table) for i in range(len(table[0]) - 1)]
        for t in table:
            print("  " + "  ".join(c.ljust(w) for c, w in zip(t, widths)) + "  " + t[-1])
    if remote_error is not None:
        print(f"distckpt ls: the remote tier {args.remote} could not be listed ({type(remote_error).__name__}: "
              f"{remote_error}); REMOTE says what this node's drained record tells", file=sys.stderr)
    if mismatch:
        print(f"distckpt ls: NOT PAIRED: {mismatch} (a TieredCheckpointManager refuses the pair: "
              f"TierMismatchError); REMOTE above is that root's, not this local tier's remote tier", file=sys.stderr)
    return status


# --------------------------------------------------------------------------------------------
# inspect


def _plain_json(value):
    """JSON-able form of a MANIFEST value: bytes become {"hex": ...} (first 1 KiB) with their length."""
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": len(value), "hex": bytes(value[:1024]).hex()}
    if isinstance(value, dict):
        return {str(k): _plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_json(v) for v in value]
    return value


def _when(t: float | None) -> str:
    """A commit time as "YYYY-MM-DD HH:MM:SS" (UTC); "-" when there is none or it is no date (a
    value no MANIFEST that decodes holds, from a header read without validation)."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) if t is not None else "-"
    except (OverflowError, OSError, ValueError):
        return "-"


def _created(unix: float) -> str:
    return datetime.datetime.fromtimestamp(unix, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


_PLAIN_KINDS = ("int", "float", "bool", "str", "bytes", "none")


def inspect_document(m, path: str) -> dict:
    """The ``distckpt inspect --json`` document for the Manifest ``m`` (docs/CLI.md has the schema).

    Values are shown as they are stored; pickled values are never unpickled (only their size).
    """
    tensors, tensor_bytes, elements = {}, 0, 0
    for fqn, t in m.tensors.items():
        nbytes = t.numel * t.itemsize
        tensors[fqn] = {"dtype": t.dtype, "shape": list(t.shape), "bytes": nbytes, "kind": t.kind,
                        "chunks": len(t.chunks)}
        tensor_bytes += nbytes
        elements += t.numel
    values = {}
    through_dcp = _written_through_dcp(m)
    for fqn, o in m.objects.items():
        if through_dcp and o.kind == "bytes":
            values[fqn] = _dcp_writer_value(o.value, fqn, path)
        elif o.kind == "pickle":
            values[fqn] = {"kind": "pickle", "bytes": len(o.value)}
        elif o.kind in _PLAIN_KINDS:
            values[fqn] = {"kind": o.kind, "value": _plain_json(o.value)}
        elif o.kind == VALUE_KIND:  # a typed value node: shown as text, no class is imported
            values[fqn] = {"kind": o.kind, "value": _plain_json(o.value), "text": describe(o.value)}
        else:  # stored outside the manifest (a DCP checkpoint's values): not loaded to be shown
            values[fqn] = {"kind": o.kind}
    meta = dict(m.meta)
    return {
        "json_format": JSON_FORMAT,
        "path": path,
        # who wrote it: "distckpt", or the foreign format read through distckpt (its MANIFEST is
        # built from that format's metadata: no save id, commit time or distckpt version recorded)
        "format": meta.get("format", "distckpt") if isinstance(meta.get("format"), str) else "distckpt",
        "format_version": m.format_version,
        "save_id": m.save_id,
        "created_unix": m.created_unix,
        "created_utc": _created(m.created_unix) if m.created_unix > 0 else None,  # None: not recorded (DCP)
        "distckpt_version": meta.pop("distckpt_version", None),
        "io_backend": meta.pop("io_backend", None),
        "world_size": m.world_size,
        "checksum": {"algorithm": m.checksum_algo, "block_bytes": m.checksum_block},
        "files": [{"name": f.name, "bytes": f.size, "rank": f.rank} for f in m.files],
        "totals": {"files": len(m.files), "file_bytes": sum(f.size for f in m.files),
                   "tensors": len(tensors), "tensor_bytes": tensor_bytes, "elements": elements,
                   "values": len(values)},
        "tensors": tensors,
        "values": values,
        "meta": _plain_json(meta),
    }


def _written_through_dcp(m) -> bool:
    from .dcp import writer_meta  # (no torch import)
    return writer_meta(m) is not None


def _dcp_writer_value(data: bytes, fqn: str, path: str) -> dict:
    """A value of a checkpoint written through distckpt's DCP StorageWriter (DCP's torch.save
    bytes), shown as load() decodes it: torch's restricted unpickler, which runs no code; what it
    refuses is shown as refused, never unpickled."""
    from .dcp import decode_writer_value

    entry = {"kind": "dcp", "bytes": len(data)}
    try:
        entry["text"] = _short(decode_writer_value(data, fqn=fqn, path=path), 200)
    except DistCkptError as exc:  # refused by the unpickler, or not torch.save bytes: shown, not fatal
        entry["refused"] = f"{type(exc).__name__}: {exc.message}"
    return entry


def _short(value, width: int = 70) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _deepspeed_line(meta: dict) -> str | None:
    """The summary of a DeepSpeed ZeRO checkpoint (distckpt.integrations.deepspeed.save), from the
    manifest's metadata alone (the command line never imports deepspeed)."""
    ds = (meta.get("user") or {}).get("deepspeed") if isinstance(meta.get("user"), dict) else None
    if not isinstance(ds, dict) or "stage" not in ds:
        return None
    return (f"ZeRO stage {ds.get('stage')}, saved at data-parallel size {ds.get('dp_size')}, model "
            f"{ds.get('model_dtype')} with {ds.get('master_dtype', 'float32')} master weights, {ds.get('params')} "
            f"parameters, optimizer "
            f"{ds.get('optimizer')}; loads at any data-parallel size (distckpt.integrations.deepspeed.load)")


def _shown(text: str) -> str:
    """``text`` (a key from a checkpoint) with every unprintable character escaped as Python
    escapes it: a downloaded file's escape sequences or newlines in a key must not reach the
    terminal (retitle it, clear it, fake rows of the table)."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _print_inspect(doc: dict) -> None:
    t = doc["totals"]
    ws = doc["world_size"]
    print(f"checkpoint  {doc['path']}")
    created = doc["created_utc"].replace("T", " ").replace("Z", " UTC") if doc["created_utc"] else "not recorded"
    print(f"created     {created}")
    if doc["format"] != "distckpt":  # read through distckpt.dcp / distckpt.hf: no distckpt fields
        version = doc["meta"].get("dcp_version")
        print(f"written by  {doc['format']}{f' (metadata version {version})' if version else ''}, not distckpt: "
              "no save id or commit time recorded")
    else:
        writer = (f"distckpt {doc['distckpt_version']}" if doc["distckpt_version"]
                  else "distckpt (version not recorded)")
        backend = f", io backend {doc['io_backend']}" if doc["io_backend"] else ""
        print(f"written by  {writer}{backend}; format v{doc['format_version']}, save {doc['save_id']}")
    print(f"world size  {ws} rank{'s' if ws != 1 else ''}; {t['files']} data file{'s' if t['files'] != 1 else ''}, "
          f"{format_bytes(t['file_bytes'])}")
    algo = doc["checksum"]["algorithm"]
    print(f"checksums   {algo} per {format_bytes(doc['checksum']['block_bytes'])} block" if algo != "none" else
          "checksums   none (the format has none)")
    print(f"contents    {t['tensors']} tensors ({t['elements']:,} elements, {format_bytes(t['tensor_bytes'])}), "
          f"{t['values']} values")
    ds = _deepspeed_line(doc["meta"])
    if ds:
        print(f"deepspeed   {ds}")
    if doc["values"]:
        print("\nvalues")
        for fqn, v in doc["values"].items():
            if v["kind"] == "pickle":
                shown = f"<pickled object, {v['bytes']} bytes, not unpickled>"
            elif v["kind"] == "dcp" and "bytes" in v:  # written through distckpt's DCP StorageWriter
                shown = v.get("text") or f"<DCP value, {v['bytes']} bytes, not loaded: {v['refused']}>"
            elif "value" not in v:
                shown = f"<{v['kind']} value, not loaded>"
            elif v["kind"] == "bytes":
                shown = f"<{v['value']['bytes']} bytes>"
            elif "text" in v:
                shown = v["text"]
            else:
                shown = _short(v["value"])
            print(f"  {_shown(fqn)}: {shown}")
    if doc["tensors"]:
        print("\ntensors")
        rows = [(_shown(fqn), e["dtype"], str(e["shape"]), format_bytes(e["bytes"]), str(e["chunks"]))
                for fqn, e in doc["tensors"].items()]
        head = ("key", "dtype", "shape", "bytes", "chunks")
        widths = [max(len(r[i]) for r in rows + [head]) for i in range(5)]
        print("  " + "  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip())
        for r in rows:
            print("  " + "  ".join((c.rjust(w) if i >= 3 else c.ljust(w)) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    if doc["meta"]:
        print(f"\nmetadata    {_shown(_short(doc['meta'], 200))}")


def _cmd_inspect(args) -> int:
    from . import manifest as mf
    from .storage import open_store
    from .storage.posix.locate import checkpoint_path

    path = checkpoint_path(args.path)  # a MANIFEST file stands for its directory, as in verify
    m = _interop_manifest(path, args.manifest)
    if m is None:  # a distckpt checkpoint; on an object store, credentials come from the AWS_* variables
        m = open_store(path).load_manifest(path)
    if args.manifest:
        print(json.dumps(_plain_json(mf.to_plain(m)), indent=1))
    elif args.json:
        print(json.dumps(inspect_document(m, path), indent=1))
    else:
        _print_inspect(inspect_document(m, path))
    return 0


def _interop_manifest(path: str, want_manifest: bool):
    """The manifest distckpt reads a torch.distributed.checkpoint or a Hugging Face safetensors
    directory as, or None for anything else (those are local directories: a URL is neither).

    Raises:
        DistCkptError: ``want_manifest`` (``--manifest``): such a directory has no MANIFEST to print.
    """
    from .dcp import is_dcp_checkpoint
    from .hf import is_hf_checkpoint
    if is_dcp_checkpoint(path):  # torch.distributed.checkpoint: its .metadata read as a manifest
        if want_manifest:
            raise DistCkptError("a torch.distributed.checkpoint has no MANIFEST to print", path=path,
                                remedy="Use --json for its contents.")
        from .dcp import load_manifest as dcp_manifest
        return dcp_manifest(path)
    if is_hf_checkpoint(path):  # Hugging Face safetensors: the files' headers as a manifest
        if want_manifest:
            raise DistCkptError("a Hugging Face safetensors directory has no MANIFEST to print", path=path,
                                remedy="Use --json for its contents.")
        from .hf import load_manifest as hf_manifest
        return hf_manifest(path)
    return None


# --------------------------------------------------------------------------------------------
# verify


def _cmd_verify(args) -> int:
    from .dcp import is_dcp_checkpoint
    from .hf import is_hf_checkpoint
    from .storage.posix.locate import checkpoint_path
    args.path = checkpoint_path(args.path)  # a MANIFEST file stands for its directory
    # DCP and Hugging Face directories are local (a URL is neither) and carry no checksums.
    if is_dcp_checkpoint(args.path):  # say what was checked, no more
        pickled = _read_dcp_all_but_pickles(args.path)
        print(f"{args.path}: a torch.distributed.checkpoint; every byte range and value read (it has no checksums)"
              + (f", but {len(pickled)} value(s) only a pickle rebuilds, read as bytes and not unpickled (verify "
                 f"never unpickles): {pickled[:20]}" if pickled else ""))
        return 0
    if is_hf_checkpoint(args.path):  # the same, said so
        from .restore import read
        read(args.path)
        print(f"{args.path}: a Hugging Face safetensors directory; every header and tensor read (it has no checksums)")
        return 0
    return _verify_and_print(args, args.path)


def _read_dcp_all_but_pickles(path: str) -> list[str]:
    """Read every tensor and value of the DCP checkpoint at ``path`` as a load would; a value
    that torch.load(weights_only=True) refuses (an io.BytesIO a dataloader saved) is read as
    bytes but not unpickled. Returns the keys of those values. Raises what distckpt.read raises
    otherwise (a damaged .metadata, a short file...)."""
    from .dcp import load_manifest
    from .errors import PickleNotAllowedError
    from .restore import read
    try:
        read(path)
        return []
    except PickleNotAllowedError:
        pass
    manifest = load_manifest(path)
    if manifest.tensors:
        read(path, keys=list(manifest.tensors))
    pickled = []
    for fqn in manifest.objects:
        try:
            read(path, keys=[fqn])
        except PickleNotAllowedError:
            pickled.append(fqn)
    return pickled


def _verify_and_print(args, path: str) -> int:
    """Verify ``path`` (a delta: its whole chain, distckpt.verify.verify) and print the report;
    returns the exit status."""
    from tqdm import tqdm

    from .verify import not_damage, verify

    bar = None

    def start(report) -> None:
        nonlocal bar
        if bar is not None:  # the previous link's
            bar.close()
        if not args.json:
            if report.chain:
                print(f"{report.path}: a delta of an incremental chain of {len(report.chain)} link(s): "
                      f"{' <- '.join(os.path.basename(p) for p in report.chain)}", file=sys.stderr)
            print(f"verifying {report.path}: {report.files} data file(s), {format_bytes(report.bytes_expected)}, "
                  f"{report.blocks_expected} crc32c blocks of {format_bytes(report.checksum_block)}, "
                  f"io backend {report.backend}", file=sys.stderr)
        # disable=None: tqdm draws only on a terminal; pipes and CI logs get no bar.
        bar = tqdm(total=report.bytes_expected, unit="B", unit_scale=True, unit_divisor=1024,
                   file=sys.stderr, disable=True if args.no_progress or args.json else None,
                   desc="verify")

    try:
        report = verify(path, progress=lambda n: bar.update(n), on_start=start, window=args.window,
                        node_copy=_is_tier_node_copy(path))
    except DistCkptError as exc:
        if not not_damage(exc):
            raise
        # Not a verdict on the data: the store did not answer (or refused), so nothing was found
        # wrong and nothing was proven right. Exit 3, never the "damaged" status 1 a cleaner acts on.
        if args.json:
            print(json.dumps({"json_format": JSON_FORMAT, "path": path, "ok": None,
                              "unverified": {"class": type(exc).__name__, "message": str(exc)}}, indent=1))
        else:
            print(f"{path}: NOT VERIFIED: {type(exc).__name__}: {exc} (a failed request, not damage found in the "
                  f"checkpoint; verify again when the store answers)")
        return 3
    finally:
        if bar is not None:
            bar.close()
    rc = 0 if report.ok else 1
    if args.json:
        if report.chain:  # {"chain": [paths], "links": [each link's own report], "ok"}
            doc = {"chain": report.chain, "links": [r.to_dict(links=False) for r in (report, *report.links)],
                   "ok": report.ok}
        else:
            doc = report.to_dict()
        print(json.dumps({"json_format": JSON_FORMAT, **doc}, indent=1))
        return rc
    for r in (report, *report.links):
        _print_report(r)
    if report.chain and report.ok:
        print(f"{path}: chain OK: {len(report.chain)} link(s), every checksum matches")
    elif report.chain:
        print(f"{path}: chain DAMAGED: {', '.join(os.path.basename(p) for p in report.damaged_links)}")
    return rc


def _is_tier_node_copy(path: str) -> bool:
    """Whether ``path`` is a step of a tiered manager's local root (its tier pairing record
    beside it): one node's copy, holding its own ranks' data files only (docs/TIERS.md)."""
    from .storage import is_url
    from .storage.posix.locate import checkpoint_path
    return not is_url(path) and _is_tier_local_root(os.path.dirname(checkpoint_path(path)))


def _is_tier_local_root(root: str) -> bool:
    """Whether the directory ``root`` is a tiered manager's local tier (its pairing record)."""
    from .storage import is_url
    from .tiers.records import TIER_RECORD_NAME
    return not is_url(root) and os.path.isfile(os.path.join(root, TIER_RECORD_NAME))


def _print_report(report) -> int:
    for problem in report.file_problems:
        print(f"BAD FILE   {problem}")
    for bad in report.bad_blocks:
        print(f"BAD BLOCK  {bad}")
    if report.not_here:
        print(f"NOT HERE   {len(report.not_here)} of {report.files} data file(s), held by the other nodes of this tiered "
              f"step (a node's copy holds its own ranks' files): {', '.join(report.not_here[:10])}"
              f"{' ...' if len(report.not_here) > 10 else ''}; not checked here (`distckpt verify` of the remote "
              f"tier's copy checks the whole step)")
    rate = f"{format_bytes(report.bytes_per_second)}/s"
    summary = (f"{format_bytes(report.bytes_read)} read in {report.seconds:.2f} s ({rate}), "
               f"{report.blocks_checked} of {report.blocks_expected} blocks checked")
    if report.own_ok:
        what = (f"OK, every checksum of this node's {report.files - len(report.not_here)} data file(s) matches"
                if report.not_here else "OK, every checksum matches")
        print(f"{report.path}: {what}; {summary}")
        return 0
    files = sorted({b.file for b in report.bad_blocks} | {p.file for p in report.file_problems})
    print(f"{report.path}: DAMAGED: {len(report.bad_blocks)} bad block(s), {len(report.file_problems)} "
          f"file problem(s) in {', '.join(files)}; {summary}")
    return 1


def _window_arg(text: str) -> int:
    from .sizes import parse_size

    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 4096 or value % 4096:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a multiple of 4 KiB")
    return value


# --------------------------------------------------------------------------------------------
# parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="distckpt", description="distckpt: distributed sharded checkpoints for PyTorch.",
        epilog=f"Exit status: 0 success, 1 a check or verification failed (or a distckpt error), 2 bad usage, "
               f"3 a request failed, the answer incomplete (verify: NOT VERIFIED; ls: a step it could not read), "
               f"130 interrupted (Ctrl-C). "
               f"Sizes use {CONVENTION}: 60G = 60 GiB. Run `distckpt COMMAND --help` for a command's options.")
    parser.add_argument("--version", action="version", version=f"distckpt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("ls", help="list the checkpoints under a root (or one checkpoint): step, size, date, "
                       "ranks, latest, broken entries, saves in flight; never writes")
    p.add_argument("root", help="a CheckpointManager root, a directory of checkpoints, or one checkpoint directory")
    p.add_argument("--json", action="store_true", help="print the listing as JSON (for scripts)")
    p.add_argument("--remote", metavar="URL", help="ROOT is the local tier of a TieredCheckpointManager and URL its "
                   "remote tier: one column per tier (AWS_* variables give the remote's credentials)")
    p.set_defaults(func=_cmd_ls)
    p = sub.add_parser("inspect", help="what a checkpoint holds: values, tensors, sizes, who wrote it",
                       description="Print a checkpoint's contents from its MANIFEST (no data file is read, "
                                   "nothing is unpickled).")
    p.add_argument("path", help="checkpoint directory (a step directory of a CheckpointManager root)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--json", action="store_true",
                     help=f"print a JSON document for scripts (json_format {JSON_FORMAT}, see docs/CLI.md)")
    how.add_argument("--manifest", action="store_true",
                     help="print the whole MANIFEST as JSON, every chunk and checksum included")
    p.set_defaults(func=_cmd_inspect)
    p = sub.add_parser("verify", help="read every byte and check every checksum (bounded memory)",
                       description="Stream every data file and check each crc32c block against the MANIFEST. "
                                   "Every bad block is reported; exit status 1 if any. Never unpickles, "
                                   "never writes into the checkpoint.")
    p.add_argument("path", help="checkpoint directory")
    p.add_argument("--json", action="store_true",
                   help=f"print the report as JSON (json_format {JSON_FORMAT}, see docs/CLI.md)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (it is shown only when stderr is a terminal anyway)")
    p.add_argument("--window", type=_window_arg, default=16 << 20, metavar="SIZE",
                   help="bytes per read; memory use is about twice this (default 16M)")
    p.set_defaults(func=_cmd_verify)
    for module in ("distckpt.checks.cli", "distckpt.bench", "distckpt.convert"):
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except DistCkptError as exc:
        print(f"distckpt: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("distckpt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `distckpt inspect ... | head`: the reader left; say nothing more and do not let Python's
        # exit flush raise again on the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
