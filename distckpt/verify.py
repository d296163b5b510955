"""Verify a checkpoint on disk: every byte of every data file against the MANIFEST's checksums.

Promises:
  * Bounded memory, whatever the checkpoint's size: each data file is streamed in windows of
    ``window`` bytes with one window read ahead (two in memory at most), and a checksum block is
    hashed incrementally across windows (crc32c is streamable), so neither a file nor a block is
    ever held whole. Nothing else grows with the data: the manifest is the only other allocation.
  * Every problem is reported, not only the first: each bad block (file, byte offset, key,
    expected and found crc32c), each missing, truncated, oversized or non-regular data file. A
    damaged file does not stop the others from being checked.
  * Read-only: the checkpoint is opened for reading only (no probe file is created next to it:
    distckpt.storage.posix.choose_read_backend), nothing is unpickled (objects live inside the MANIFEST,
    whose own checksum is checked when it is decoded), and torch is not imported.
  * With the O_DIRECT backends the bytes come from the device, not from the page cache: a block
    that rotted on disk is caught even when a clean copy of it is still cached.

Raises only for what makes checking impossible (no checkpoint there, a damaged MANIFEST, an I/O
error); damage to data files is the report's content (:attr:`VerifyReport.ok`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import logging
import mmap
import os
import time
from typing import Any, Callable, Iterator

from . import manifest as mf
from .checksum import crc32c
from .errors import DataFileTruncatedError

log = logging.getLogger("distckpt")

__all__ = ["BadBlock", "FileProblem", "VerifyReport", "verify", "verify_chain", "DEFAULT_WINDOW"]

#: Bytes read per request. Two windows are in memory at once (one being checked, one being read).
DEFAULT_WINDOW = 16 << 20


@dataclasses.dataclass(frozen=True)
class BadBlock:
    """A checksum block whose bytes do not match the MANIFEST.

    Attributes:
        file: Data file name (``rank00000.bin``).
        offset: Byte offset of the block in that file.
        length: Block length in bytes.
        key: The tensor (fqn) the block belongs to.
        block: Index of the block inside its chunk.
        expected: crc32c recorded in the MANIFEST.
        found: crc32c of the bytes on disk, or None when they could not be read (past the end).
    """

    file: str
    offset: int
    length: int
    key: str
    block: int
    expected: int
    found: int | None

    def __str__(self) -> str:
        found = "missing (past the end of the file)" if self.found is None else f"found {self.found:#010x}"
        return (f"{self.file} at byte {self.offset} ({self.length} bytes, block {self.block} of key "
                f"{self.key!r}): expected crc32c {self.expected:#010x}, {found}")


@dataclasses.dataclass(frozen=True)
class FileProblem:
    """A data file that is missing, not a regular file, of the wrong size, or unreadable (EIO...)."""

    file: str
    problem: str

    def __str__(self) -> str:
        return f"{self.file}: {self.problem}"


@dataclasses.dataclass
class VerifyReport:
    """The outcome of :func:`verify`. ``ok`` is True when every block matched and every file is sound."""

    path: str
    files: int
    bytes_expected: int
    bytes_read: int = 0
    blocks_checked: int = 0
    blocks_expected: int = 0
    bad_blocks: list[BadBlock] = dataclasses.field(default_factory=list)
    file_problems: list[FileProblem] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    backend: str | None = None
    checksum_block: int = 0
    #: For a delta of an incremental chain: the paths of every link it needs, itself first, its
    #: full base last (empty for any other checkpoint).
    chain: list[str] = dataclasses.field(default_factory=list)
    #: For a delta: the reports of the links it needs (``chain[1:]``), newest first.
    links: list["VerifyReport"] = dataclasses.field(default_factory=list)
    #: For a node's copy of a tiered step (``verify(..., node_copy=True)``): the data files absent
    #: from it, which other nodes hold (not checked, not problems).
    not_here: list[str] = dataclasses.field(default_factory=list)

    @property
    def own_ok(self) -> bool:
        """True when this checkpoint's own data files are sound (its links not counted)."""
        return not self.bad_blocks and not self.file_problems

    @property
    def ok(self) -> bool:
        """True when every block matched and every file is sound, in this checkpoint and, for a
        delta, in every link of its chain."""
        return self.own_ok and all(link.ok for link in self.links)

    @property
    def damaged_links(self) -> list[str]:
        """The paths of the checkpoints (this one and its links) whose data is damaged."""
        return [r.path for r in (self, *self.links) if not r.own_ok]

    @property
    def bytes_per_second(self) -> float:
        return self.bytes_read / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self, *, links: bool = True) -> dict:
        """Plain data for ``distckpt verify --json`` (documented in docs/CLI.md). With ``links``
        (a delta's report), ``ok`` covers the whole chain and ``chain`` / ``links`` are added;
        without, the document is this checkpoint's alone (``ok``: :attr:`own_ok`)."""
        out = {
            "path": self.path,
            "ok": self.ok if links else self.own_ok,
            "files": self.files,
            "bytes_expected": self.bytes_expected,
            "bytes_read": self.bytes_read,
            "blocks_expected": self.blocks_expected,
            "blocks_checked": self.blocks_checked,
            "checksum_block": self.checksum_block,
            "seconds": round(self.seconds, 6),
            "bytes_per_second": round(self.bytes_per_second),
            "backend": self.backend,
            "bad_blocks": [dataclasses.asdict(b) for b in self.bad_blocks],
            "file_problems": [dataclasses.asdict(p) for p in self.file_problems],
        }
        if self.not_here:
            out["not_here"] = list(self.not_here)
        if links and self.chain:
            out["chain"] = list(self.chain)
            out["links"] = [r.to_dict(links=False) for r in self.links]
        return out


@dataclasses.dataclass(frozen=True)
class _Block:
    start: int
    length: int
    crc: int
    key: str
    index: int


def _read_indexes(header: "mf.Manifest", mpath: str, readable: list, opener, report: VerifyReport):
    """(manifest with the chunks of every file whose index could be read, those files). A file
    whose index is unreadable, damaged or names an unknown tensor is a file problem: its chunks
    cannot be located, so its bytes are not checked. With every index read, the records must
    tile every tensor (ManifestCorruptError otherwise, as for a damaged MANIFEST)."""
    from .errors import CheckpointCorruptError, StorageError
    records, kept = {}, []
    for i, entry, (fpath, size) in readable:
        off, length, _ = entry.index
        problem = None
        if off + length > size:
            problem = f"its index (bytes [{off}, {off + length})) lies past the end of the file"
        else:
            buf = mmap.mmap(-1, max(4096, -(-length // 4096) * 4096))  # page-aligned, for O_DIRECT
            view = memoryview(buf)[:length]
            raw = again = None
            try:
                with opener(fpath) as reader:
                    reader.read_into([(off, length, view)])
                    raw = bytes(view)
                    if getattr(reader, "reread_on_mismatch", False):  # an answer may change in transit
                        again = lambda: _read_bytes(reader, off, length)  # noqa: E731
            except StorageError as exc:  # EIO...: this file is a problem, the others are checked
                if not_damage(exc):
                    raise
                problem = f"its index (bytes [{off}, {off + length})) cannot be read ({exc.message})"
            finally:
                try:
                    view.release()
                    buf.close()
                except BufferError:  # a reader wedged by a read past its deadline keeps the view
                    pass             # exported for ever (csrc/reader.c): the error above is the one
                    # to raise; the mapping goes when its last export does
            if raw is not None:
                try:
                    try:
                        recs = mf.parse_index(header, i, raw, mpath)
                    except CheckpointCorruptError as exc:
                        if again is None:
                            raise
                        log.warning("distckpt: verify: the index of %s does not match (%s): reading it again, the "
                                    "first answer may have changed in transit", fpath, exc.message)
                        recs = mf.parse_index(header, i, again(), mpath)
                    unknown = sorted({fqn for fqn, _ in recs} - set(header.tensors))
                    if unknown:
                        problem = f"its index names tensors the MANIFEST does not list: {unknown[:5]}"
                except CheckpointCorruptError as exc:
                    problem = f"its index is damaged ({exc.message})"
        if problem is not None:
            report.file_problems.append(FileProblem(entry.name, problem + ": its chunks cannot be located or checked"))
            continue
        records[i] = recs
        kept.append((i, entry, (fpath, size)))
    complete = len(records) == len(header.files)
    return mf.with_chunks(header, records, mpath, check=complete), kept


def _read_bytes(reader: Any, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset`` through ``reader`` (a re-read of a range whose first answer
    did not match its checksum)."""
    buf = bytearray(length)
    reader.read_into([(offset, length, memoryview(buf))])
    return bytes(buf)


def _blocks_of_file(manifest: "mf.Manifest", file_index: int) -> list[tuple[int, str, "mf.ChunkRecord"]]:
    chunks = [(c.offset, fqn, c) for fqn, t in manifest.tensors.items() for c in t.chunks
              if c.file == file_index and c.nbytes > 0]
    chunks.sort(key=lambda x: x[0])
    return chunks


def _iter_blocks(chunks: list, block: int) -> Iterator[_Block]:
    for offset, fqn, c in chunks:
        for i, crc in enumerate(c.crcs):
            start = i * block
            yield _Block(offset + start, min(block, c.nbytes - start), crc, fqn, i)


def not_damage(exc: BaseException) -> bool:
    """True for a read failure that says nothing about the checkpoint's data: an object-store
    request that failed (no answer, an answer cut short, throttled, refused), a local read that got
    no answer within DISTCKPT_IO_TIMEOUT_S (ETIMEDOUT: the storage stalled), no permission, no
    file descriptor or memory left. verify then raises it (the checkpoint could not be verified) instead of
    reporting the file as damaged; an I/O error of the device (EIO) is reported as a file problem."""
    from .errors import HostMemoryError, ObjectStoreError, StoragePermissionError, TooManyOpenFilesError
    return (isinstance(exc, (ObjectStoreError, StoragePermissionError, TooManyOpenFilesError, HostMemoryError))
            or getattr(exc, "errno", None) == errno.ETIMEDOUT)


def _check_file(fpath: str, name: str, size: int, chunks: list, block: int, window: int, opener,
                report: VerifyReport, progress: Callable[[int], None] | None,
                pool: concurrent.futures.Executor) -> None:
    from .errors import StorageError
    blocks = _iter_blocks(chunks, block)
    cur = next(blocks, None)
    running = 0
    # Page-aligned buffers (anonymous mmap), so O_DIRECT reads land in them without a copy.
    buffers = [mmap.mmap(-1, window), mmap.mmap(-1, window)] if size else []
    try:
        with opener(fpath) as reader:
            def read(k: int) -> tuple[int, int, memoryview]:
                start = k * window
                n = min(window, size - start)
                view = memoryview(buffers[k % 2])[:n]
                reader.read_into([(start, n, view)])
                return start, n, view

            n_windows = -(-size // window)
            pending = pool.submit(read, 0) if n_windows else None
            try:
                for k in range(n_windows):
                    try:
                        start, n, view = pending.result()
                    except StorageError as exc:  # EIO...: reported, and the other files are checked
                        pending = None
                        if not_damage(exc):
                            raise
                        report.file_problems.append(FileProblem(
                            name, f"unreadable from byte {k * window} ({exc.message}): the rest of the file "
                                  f"is not checked"))
                        return
                    pending = pool.submit(read, k + 1) if k + 1 < n_windows else None
                    end = start + n
                    while cur is not None and cur.start < end:
                        a, b = max(cur.start, start), min(cur.start + cur.length, end)
                        if b > a:
                            running = crc32c(view[a - start:b - start], running)
                        if cur.start + cur.length > end:
                            break  # the block continues in the next window
                        report.blocks_checked += 1
                        if running != cur.crc and getattr(reader, "reread_on_mismatch", False):
                            # An object store's answer may have changed in transit: the block is
                            # read once more, and only a second mismatch is damage.
                            log.warning("distckpt: verify: block %d of %r in %s does not match: reading it again, "
                                        "the first answer may have changed in transit", cur.index, cur.key, name)
                            running = crc32c(_read_bytes(reader, cur.start, cur.length))
                        if running != cur.crc:
                            report.bad_blocks.append(BadBlock(name, cur.start, cur.length, cur.key, cur.index,
                                                              cur.crc, running))
                        cur, running = next(blocks, None), 0
                    view.release()
                    report.bytes_read += n
                    if progress is not None:
                        progress(n)
            finally:
                if pending is not None:  # an error above: let the read in flight land first
                    concurrent.futures.wait([pending])
    finally:
        for buf in buffers:
            try:
                buf.close()
            except BufferError:  # a view is still alive after an error: the GC unmaps it later
                pass
    # Blocks that lie (partly) past the end of a truncated file: reported, never skipped.
    while cur is not None:
        report.blocks_checked += 1
        report.bad_blocks.append(BadBlock(name, cur.start, cur.length, cur.key, cur.index, cur.crc, None))
        cur = next(blocks, None)


def verify(path: str | os.PathLike, *, window: int = DEFAULT_WINDOW,
           progress: Callable[[int], None] | None = None,
           on_start: Callable[[VerifyReport], None] | None = None,
           storage_options: dict | None = None, node_copy: bool = False) -> VerifyReport:
    """Read every data file of the checkpoint at ``path`` and check every checksum block.

    A delta of an incremental chain (docs/INCREMENTAL.md) is only as sound as the links it needs:
    its chain's structure is checked first, from the MANIFESTs (every link present, committed,
    the very save the delta was saved against, of the same chain), then the delta and every link
    are verified, newest first. Their reports are ``report.links``, and ``report.ok`` is False
    when any of them is damaged (``report.damaged_links`` names them). ``distckpt verify`` prints
    this report.

    Args:
        path: A committed checkpoint directory, or an fsspec URL of one (``storage_options`` as
            :func:`distckpt.save`; its data objects are read with ranged GETs).
        window: Bytes per read (a multiple of 1 MiB is best); memory use is about 2 x ``window``.
        progress: Called with the number of bytes just checked (e.g. a tqdm bar's ``update``).
        on_start: Called with the (empty) report after the MANIFEST was read, before any data
            (``files``, ``bytes_expected``, ``blocks_expected`` and ``backend`` are filled in);
            once per link for a delta, the delta's first (its ``chain`` is filled in).
        node_copy: ``path`` is one node's copy of a tiered step (distckpt.tiers), which holds its
            own ranks' data files (and the replicas it keeps), not the others': an absent data
            file is listed in ``report.not_here``, not as a problem, and the files present are
            checked. Whether the node holds all of its own ranks' files is not known here (the
            nodes' ranks are not recorded in the step): ``TieredCheckpointManager.load()`` and
            ``status()`` tell, and ``distckpt verify`` of the remote tier's copy checks the whole
            step. ``distckpt verify`` sets it for a step whose root holds a tier pairing record.

    Returns:
        A :class:`VerifyReport` listing every bad block and file problem (``report.ok``).

    Raises:
        CheckpointNotFoundError, CheckpointIncompleteError: ``path`` is not a committed checkpoint.
        ManifestCorruptError: the MANIFEST is damaged (nothing else can be checked then).
        ChainBrokenError: ``path`` is a delta whose chain is broken: a link is missing, not
            committed, does not decode, was replaced by another save or belongs to another chain
            (its field ``link`` names it).
        ObjectStoreError (EndpointUnreachableError, ResponseIncompleteError, ...),
            StoragePermissionError, TooManyOpenFilesError: a read failed for a reason that says
            nothing about the data (:func:`not_damage`): the checkpoint could not be verified,
            which is not reported as damage.
        StorageError subclass: an I/O error reading the MANIFEST. An I/O error reading a data
            file (EIO...) is that file's problem in the report, and the other files are checked.
    """
    if window < 4096 or window % 4096:
        raise ValueError(f"window must be a positive multiple of 4096 bytes, not {window}")
    from .storage import is_url, open_store
    from .storage.posix.locate import checkpoint_path

    path = checkpoint_path(path)  # normalized; a MANIFEST file stands for its directory
    store = open_store(path, storage_options)
    # Chains are local only (distckpt.incremental): an object store's checkpoint is never a delta.
    chain = [] if is_url(path) else _chain(store, path)
    report = _verify_one(store, path, window, progress, on_start, chain, node_copy)
    for link in chain[1:]:
        report.links.append(_verify_one(store, link, window, progress, on_start, []))
    return report


def _chain(store, path: str) -> list[str]:
    """The paths of the links a delta at ``path`` needs, itself first ([] for any other
    checkpoint, and for a MANIFEST that cannot be read: :func:`_verify_one` says why). Raises
    ChainBrokenError for a broken chain or chain metadata a load refuses."""
    from .chain import chain_info, chain_of
    from .errors import DistCkptError
    try:
        info = chain_info(mf.decode_header(store.manifest_bytes(path)))
    except DistCkptError:
        return []
    if info is None:
        return []
    # Any chain metadata is checked as a load checks it (a kind other than full or delta, a
    # malformed field: ChainBrokenError), a full link's too.
    links = chain_of(path, chunks=False)
    return [] if len(links) == 1 else [link.path for link in links]


def _check_values(manifest: "mf.Manifest", report: VerifyReport) -> None:
    """Build every non-tensor value as a load would (distckpt.values: no code runs, nothing is
    imported): one that no save writes (a dict key twice, a device string torch cannot parse,
    numpy bytes that are not its shape) is a problem of the MANIFEST, so that verify fails what
    load refuses. A value whose class is not imported in this process (UnsupportedValueError) is
    no damage and is not reported; pickled values are not unpickled."""
    from .errors import ManifestCorruptError, UnsupportedValueError
    from .values import decode_value

    for fqn, entry in manifest.objects.items():
        try:
            decode_value(entry.kind, entry.value, fqn=fqn)
        except UnsupportedValueError:
            continue
        except ManifestCorruptError as exc:
            report.file_problems.append(FileProblem(mf.MANIFEST_NAME, exc.message))


def _stat_files(store, path: str, manifest: "mf.Manifest", report: VerifyReport, node_copy: bool = False) -> list:
    """[(file index, entry, (location, bytes to read))] of the data files that can be read at
    all; every missing, non-regular, truncated or oversized file is recorded in ``report`` (with
    ``node_copy``, an absent one in ``report.not_here``)."""
    readable = []
    for i, entry in enumerate(manifest.files):
        location, size, problem = store.data_file_stat(path, manifest, i)
        if size is None and node_copy and not store.exists(location):
            report.not_here.append(entry.name)
            continue
        if size is None:
            report.file_problems.append(FileProblem(entry.name, problem))
            continue
        if size < entry.size:
            report.file_problems.append(FileProblem(entry.name, f"truncated: {size} bytes, MANIFEST says {entry.size}"))
        elif size > entry.size:
            report.file_problems.append(FileProblem(entry.name, f"{size} bytes, MANIFEST says {entry.size} "
                                                                f"({size - entry.size} bytes appended)"))
        readable.append((i, entry, (location, min(size, entry.size))))
    return readable


def _verify_one(store, path: str, window: int, progress, on_start, chain: list[str],
                node_copy: bool = False) -> VerifyReport:
    """:func:`verify` of one checkpoint, its chain's links not included."""
    from .storage import join

    t0 = time.monotonic()
    mpath = join(path, mf.MANIFEST_NAME)
    data = store.manifest_bytes(path)
    # Format 3 keeps the chunk records in the data files: the MANIFEST alone first, then each
    # file's index below, so that a damaged file is reported and the others still checked.
    manifest = mf.decode_header(data, path=mpath)
    report = VerifyReport(path=path, files=len(manifest.files), bytes_expected=sum(f.size for f in manifest.files),
                          checksum_block=manifest.checksum_block, chain=list(chain))
    _check_values(manifest, report)
    readable = _stat_files(store, path, manifest, report, node_copy)
    opener, report.backend = store.whole_file_readers({loc: size for _, _, (loc, size) in readable})
    if manifest.format_version >= 3:
        manifest, readable = _read_indexes(manifest, mpath, readable, opener, report)
    not_here = set(report.not_here)
    absent = {i for i, entry in enumerate(manifest.files) if entry.name in not_here}
    report.blocks_expected = sum(len(c.crcs) for t in manifest.tensors.values() for c in t.chunks
                                 if c.file not in absent)
    if absent:
        report.bytes_expected -= sum(manifest.files[i].size for i in absent)
    if on_start is not None:
        on_start(report)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="distckpt-verify") as pool:
        for i, entry, (fpath, size) in readable:
            chunks = _blocks_of_file(manifest, i)
            try:
                _check_file(fpath, entry.name, size, chunks, manifest.checksum_block, window, opener,
                            report, progress, pool)
            except DataFileTruncatedError as exc:  # shrank while being read
                report.file_problems.append(FileProblem(entry.name, f"changed while being verified: {exc.message}"))
    if report.own_ok:
        _check_delta_records(path, manifest, report)
    report.seconds = time.monotonic() - t0
    return report


def _check_delta_records(path: str, manifest: "mf.Manifest", report: VerifyReport) -> None:
    """For a delta link whose blocks all matched: check its records as a load composes them
    (distckpt.deltarecords.check_link: boxes inside the recorded shapes, row ids increasing inside
    their boxes, one row per id), so that verify fails a crafted or mis-saved record a load
    refuses. A record that breaks a rule is a problem of the MANIFEST (where the records are)."""
    from .chain import ChainLink, chain_info
    from .errors import ChainBrokenError

    info = chain_info(manifest)
    if info is None or info.get("kind") != "delta":
        return
    from .deltarecords import check_link
    try:
        check_link(ChainLink(path, manifest, info))
    except ChainBrokenError as exc:
        report.file_problems.append(FileProblem(mf.MANIFEST_NAME, f"delta record: {exc.reason}"))


def verify_chain(path: str | os.PathLike, **verify_kwargs: Any) -> list[tuple[str, Any]]:
    """Check the chain's structure (:func:`distckpt.chain.chain_of`) and every link's data (:func:`verify`).

    Returns [(link path, VerifyReport)], newest first: :func:`verify` of ``path``
    (which checks a delta's whole chain, its ``ok`` covering every link) and then each link's own
    report. Raises ChainBrokenError for a structural break (a missing or replaced link); damaged
    data is reported in the links' reports."""
    path = os.path.abspath(os.fspath(path))
    report = verify(path, **verify_kwargs)
    return [(path, report), *zip(report.chain[1:], report.links)]
