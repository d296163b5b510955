"""The storage seam: :class:`Store`, the one interface between distckpt and where bytes live.

Everything above storage/ (the commit protocol, loads, the manager, the command line, verify,
the integrations) reaches a checkpoint only through these methods; a new back end is one new
folder under storage/ whose class implements every abstract method here.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from typing import Any, Callable, Mapping, Sequence

__all__ = ["Store", "Leftover", "Ownership", "ROOT_LOCK_NAME"]

# The one save lock (POSIX) or lease (object stores) of a CheckpointManager root, held by whichever
# manager save is in flight there, from its PREPARE to the end of its rotation.
ROOT_LOCK_NAME = ".distckpt.lock"


@dataclasses.dataclass(frozen=True)
class Leftover:
    """Something a save or deletion left beside its checkpoint, and whether its owner lives.

    ``entry``: its name relative to the root listed; ``name``: the checkpoint it belongs to
    (``""`` for the root lock); ``kind``: ``tmp`` (a save's area, or a ``latest`` replacement
    file), ``del`` (a directory being deleted) or ``lock`` (a save lock); ``path``: where it is.
    ``state``: ``alive`` (its save holds its lock or lease now: never touched), ``dead``
    (reclaimable), ``unknown`` (its liveness cannot be decided from here: left alone).
    ``owner``: the lock's owner record (host, pid, started_unix, save_id, what) when there is one."""

    entry: str
    name: str
    kind: str
    path: str
    state: str
    owner: dict | None


class Ownership(abc.ABC):
    """A root's exclusive owner, held by one live process at a time (:meth:`Store.take_ownership`):
    a flock on POSIX, a renewed lease on object stores. ``record``: what it says of its holder
    (host, pid, save_id: the owner's id, what, and the caller's extra fields)."""

    record: dict

    @abc.abstractmethod
    def check(self, operation: str) -> None:
        """Prove that this process still holds it, before ``operation`` changes what it guards.

        Raises:
            SaveInProgressError: it was released, taken over by another holder (``owner``), or
                could not be proven held (an object store that does not answer within the lease).
        """

    @abc.abstractmethod
    def gone(self) -> bool:
        """True once it can never be proven held again (released, taken over, its lock file
        replaced): a new one must be taken."""

    @abc.abstractmethod
    def release(self) -> None:
        """Give it up (a no-op when already released or taken over). Never raises."""


class Store(abc.ABC):
    """What the commit protocol, loads, the manager and the command line need from a back end.

    Paths are strings in the canonical form of :func:`distckpt.storage.normalize_path` (an absolute
    local path, or a URL); ``final`` is a checkpoint's path, ``area`` a save's private area.

    Call order of a save (distckpt.commit): ``prepare`` (rank 0) -> ``write_rank`` on every rank ->
    ``publish`` (rank 0, only when every rank's write succeeded) or ``abort``; after a publish
    that replaced a checkpoint, ``discard`` of what it returned. The lock ``prepare`` returns is
    released by the caller after the area is published or gone. A drain to another tier
    (distckpt.tiers.drain) calls ``copy_data_file`` in place of ``write_rank``: the same data
    files, byte for byte, from a committed checkpoint elsewhere.

    What every back end guarantees (docs/DESIGN.md, invariants I1-I8):
      * ``publish`` is the only step a reader can see, and it is atomic: a reader of ``final``
        finds the previous checkpoint or the new one, complete, never a mix (I1). It is called
        only after every ``write_rank`` returned; a failed publish leaves nothing new visible
        unless its error says ``published``.
      * ``abort`` never touches a published checkpoint; ``discard`` deletes only what ``publish``
        returned, which no reader can reach any more: an old checkpoint's data goes only after
        the new one is published (I2).
      * ``write_rank`` and ``copy_data_file`` are durable when they return; ``publish`` is durable
        when it returns (I3).
      * A save holds a lock or lease from ``prepare`` until its area is published or gone, and
        ``reclaim`` deletes only the leftovers of saves whose lock is free (I6).
      * Every method raises typed :class:`distckpt.errors.DistCkptError` subclasses, never a bare
        OSError or a client's exception, and every remote call runs under a deadline (I4).
      * The read and root sides never write, except ``make_root``, ``replace_pointer``,
        ``remove_checkpoint`` and ``reclaim`` (I7, I8).
    """

    #: The back end's name ("posix", "object"), for messages and results.
    kind: str = "abstract"

    # -- save side --------------------------------------------------------------------------------

    @abc.abstractmethod
    def prepare(self, final: str, save_id: str, overwrite: bool, needed: int, rank: int,
                lock_path: str | None) -> tuple[str, Any]:
        """PREPARE (rank 0): reclaim the dead leftovers of ``final``, take the save's lock or lease
        (at ``lock_path``, default one beside ``final``), refuse a committed ``final`` unless
        ``overwrite``, check room for ``needed`` bytes where the back end can, and create the save
        area. Returns (area, lock): the area is a str every rank can write to, the lock an object
        whose ``release()`` the caller runs once the area is published or gone. On error nothing
        is held.

        Raises:
            SaveInProgressError: another live save holds the lock.
            CheckpointExistsError: ``final`` is committed (and not ``overwrite``) or is not a checkpoint.
            DiskFullError, StorageError subclasses, ConfigError, and the object-store request errors.
        """

    @abc.abstractmethod
    def write_rank(self, area: str, rank: int, pieces: list, checksum_block: int) -> tuple:
        """WRITE (every rank): this rank's data file in ``area``, durable when this returns.
        Returns ((index offset, length, crc32c), size, backend name, backend reason).

        Raises StorageError subclasses (DiskFullError...) and the object-store request errors."""

    @abc.abstractmethod
    def copy_data_file(self, area: str, rank: int, size: int, feed: Callable[[Any], None]) -> int:
        """WRITE from existing bytes (a drain to another tier, :mod:`distckpt.tiers.drain`): data
        file ``rank`` (named ``rankNNNNN.bin`` like :meth:`write_rank`'s) of the save area ``area``,
        whose bytes ``feed(sink)`` appends, exactly ``size`` of them, with ``sink.write(data)``
        (a :class:`distckpt.datafile.Sink`; ``data`` is not referenced after the call returns).
        Durable (POSIX: fsynced) or visible (object stores: the upload completed) when this
        returns, as after :meth:`write_rank`. Returns ``size``.

        On any error, ``feed``'s own included, the error propagates, typed, and no partial file
        stays (POSIX: unlinked; object stores: the upload aborted). An object whose completing
        request went unanswered may have landed, whole: it is not deleted, since a drain's retry
        writes the same key of the same area and a late deletion would remove the retry's
        committed object (if nothing ever commits, a reclaim of the root deletes it).

        Raises:
            DataFileTruncatedError: ``feed`` appended fewer than ``size`` bytes;
                CheckpointCorruptError: more.
            StorageError subclasses (DiskFullError...), the object-store request errors, and
            whatever ``feed`` raises.
        """

    @abc.abstractmethod
    def publish(self, area: str, final: str, manifest: bytes, overwrite: bool) -> str | None:
        """COMMIT (rank 0): write ``manifest`` and make ``area`` the checkpoint ``final``, atomically
        and durably: the commit point. Returns what :meth:`discard` must delete afterwards (a
        replaced checkpoint's data), or None.

        An error raised with ``published = True`` happened after the commit became visible; one
        with ``data_kept = True`` means the caller must not :meth:`abort` (the commit may still
        land); ``commit_unknown`` marks an outcome that cannot be known.

        Raises:
            CheckpointExistsError: another save committed ``final`` first.
            SaveInProgressError: the save's lease was lost (object stores).
            StorageError subclasses and the object-store request errors.
        """

    @abc.abstractmethod
    def abort(self, area: str, world: int) -> None:
        """Delete an unpublished save area (``world`` ranks wrote into it). Never touches a
        published checkpoint. Raises StorageError subclasses / request errors (a caller logs them:
        the next reclaim finishes the job)."""

    def abort_for_retry(self, area: str, world: int) -> None:
        """Give up on an unpublished save area that a later try of the same save id writes again
        (a drain's retry: distckpt.tiers.drain). By default :meth:`abort`. A store whose requests
        can land after the client gave up on them (an object store) must not delete what the
        retry will write: a deletion that landed late would remove the retry's objects after its
        commit. Raises as :meth:`abort`."""
        self.abort(area, world)

    @abc.abstractmethod
    def discard(self, replaced: str) -> None:
        """Delete what :meth:`publish` returned (a replaced checkpoint, no longer visible).
        Raises StorageError subclasses / request errors."""

    @abc.abstractmethod
    def save_id_of_area(self, area: str) -> str:
        """The save id a save area carries (what :meth:`committed_save_id` returns once that save
        is published). Never raises."""

    @abc.abstractmethod
    def committed_save_id(self, final: str) -> str | None:
        """The save id of the checkpoint committed at ``final``, or None when there is none.

        Raises ManifestCorruptError (a MANIFEST that does not decode), StorageError subclasses
        and the object-store request errors."""

    # -- read side --------------------------------------------------------------------------------

    @abc.abstractmethod
    def is_committed(self, path: str) -> bool:
        """True when ``path`` is a committed checkpoint (its MANIFEST is there; a save's area never
        is). Raises StorageError subclasses / request errors for a failed look."""

    @abc.abstractmethod
    def manifest_bytes(self, path: str) -> bytes:
        """The raw MANIFEST of the committed checkpoint at ``path``, bounded by the format's limit.

        Raises:
            CheckpointNotFoundError: nothing (or something else) is at ``path``.
            CheckpointIncompleteError: a save's area, or data without a MANIFEST (never committed).
            ManifestCorruptError: not a regular file (a symlink is never followed), or too large.
            StorageError subclasses and the object-store request errors.
        """

    @abc.abstractmethod
    def read_index(self, path: str, header: Any, i: int) -> bytes:
        """The index bytes of data file ``i`` of the checkpoint at ``path`` (format version 3),
        after checking the file's size against ``header`` (a decoded MANIFEST) and the bytes
        against the index's length and crc32c there (:func:`distckpt.manifest.check_index_bytes`,
        so the error names this store's copy of the file).

        Raises DataFileMissingError, DataFileTruncatedError, CheckpointCorruptError (longer than
        the MANIFEST says, or not a regular file), ChecksumMismatchError (the index's bytes),
        StorageError subclasses / request errors."""

    def load_manifest(self, path: str) -> Any:
        """The decoded, validated Manifest of the committed checkpoint at ``path``, chunks included
        (read from the data files' indexes for format version 3). Raises what
        :meth:`manifest_bytes`, :meth:`read_index` and :func:`distckpt.manifest.decode` raise."""
        from .. import manifest as mf
        from . import join
        return mf.decode(self.manifest_bytes(path), path=join(path, mf.MANIFEST_NAME),
                         read_index=lambda header, i: self.read_index(path, header, i))

    def for_each(self, query: Callable[[str], Any], paths: Sequence[str]) -> list[Any]:
        """``query(path)`` (read-only calls of this store) for each of ``paths``, in order:
        its result, or the Exception it raised (returned, not raised). One after the other here;
        a back end whose every call is a round trip over the network runs them concurrently
        (listing a root of many steps). Never raises."""
        out: list[Any] = []
        for path in paths:
            try:
                out.append(query(path))
            except Exception as exc:  # noqa: BLE001 - returned to the caller, which decides
                out.append(exc)
        return out

    @abc.abstractmethod
    def peek_commit_time(self, path: str) -> float | None:
        """The commit time the MANIFEST at ``path`` claims, from its first few KiB (unchecked:
        only for ordering candidates); None when those bytes do not tell (absent, damaged, not
        a plain file). Never raises for what the bytes hold; raises the store's typed error for
        a request that fails (a timeout, a refusal): the caller cannot tell the step's state."""

    @abc.abstractmethod
    def data_readers(self, path: str, manifest: Any, file_indexes: list[int], *,
                     piece: int | None = None) -> tuple[Mapping[int, str], Callable[[str], Any], int, str]:
        """What :func:`distckpt.fill.fill` reads the data files ``file_indexes`` of ``manifest``
        with: (location of each file, ``open_reader(location)``, offset alignment, backend name).
        Every file is checked against the size the MANIFEST gives before a byte is read; ``piece``
        is the largest read the caller makes at once. Nothing is written.

        Raises DataFileMissingError, DataFileTruncatedError, CheckpointCorruptError (longer, or
        not a regular file), StorageError subclasses / request errors."""

    @abc.abstractmethod
    def guard_reads(self, path: str) -> contextlib.AbstractContextManager:
        """A context manager around the reads of the checkpoint at ``path`` (its MANIFEST, then its
        data files): an error raised inside it that is what the checkpoint's removal or
        replacement mid-read looks like (a data file missing, a MANIFEST gone, another save's
        files under the name) leaves it as CheckpointRemovedError, its cause kept; any other
        error leaves unchanged. Where data files are opened by path one after another (POSIX),
        a block that succeeded while another checkpoint took the name raises it too. Never
        writes."""

    @abc.abstractmethod
    def data_file_stat(self, path: str, manifest: Any, i: int) -> tuple[str, int | None, str | None]:
        """(location, size found, problem) of data file ``i``, for a check that reports damage
        instead of raising (verify): size None when the file cannot be read at all (``problem``
        says why: missing, not a regular file). Raises StorageError subclasses / request errors
        for a failed look."""

    @abc.abstractmethod
    def whole_file_readers(self, sizes: Mapping[str, int]) -> tuple[Callable[[str], Any], str | None]:
        """(``open_reader(location)``, backend name) for reading the data files ``sizes``
        (location -> bytes to read, from :meth:`data_file_stat`) from start to end; the backend is
        None when ``sizes`` is empty. Raises IOBackendUnavailableError, StorageError subclasses."""

    # -- root side: listing, the latest pointer, rotation, leftovers ------------------------------

    @abc.abstractmethod
    def check_root(self, root: str) -> None:
        """Refuse a root that can never hold checkpoints (POSIX: a pseudo file system such as
        /proc), before any save. Never writes. Raises ConfigError."""

    @abc.abstractmethod
    def make_root(self, root: str) -> None:
        """Create ``root`` (and its parents) durably where the back end has directories (POSIX);
        a no-op where a prefix needs no creation. Raises StorageError subclasses."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """True when something is stored at ``path`` (a directory, or objects under the prefix).
        Raises StorageError subclasses / request errors."""

    @abc.abstractmethod
    def has_manifest(self, path: str) -> bool:
        """True when an entry named MANIFEST is at ``path``, readable or not (a committed
        checkpoint, or a broken one). Raises StorageError subclasses / request errors."""

    @abc.abstractmethod
    def list_children(self, root: str) -> list[str]:
        """Sorted names of the entries directly under ``root`` that may hold a checkpoint (hidden
        leftovers and plain files excluded; no MANIFEST is checked); [] when nothing is at ``root``.

        Raises:
            CheckpointNotFoundError: ``root`` is something that holds no entries (a file).
            StorageError subclasses and the object-store request errors.
        """

    @abc.abstractmethod
    def read_pointer(self, path: str) -> str | None:
        """The checkpoint name the pointer file at ``path`` (a root's ``latest``) holds, or None
        when there is none. Raises StorageError subclasses / request errors."""

    @abc.abstractmethod
    def replace_pointer(self, path: str, data: bytes) -> None:
        """Replace the pointer file at ``path`` with ``data``, atomically and durably: a reader
        sees the old or the new content. Raises StorageError subclasses / request errors."""

    @abc.abstractmethod
    def remove_checkpoint(self, path: str) -> None:
        """Delete the committed checkpoint at ``path`` (rotation): it stops being a checkpoint in
        one step, before any of its data goes, so a half-deleted one never looks committed; its
        space is freed at once. Raises StorageError subclasses / request errors."""

    @abc.abstractmethod
    def take_ownership(self, path: str, *, owner_id: str, what: str, extra: Mapping[str, Any],
                       holder_dead: Callable[[dict], bool]) -> Ownership:
        """Take the owner lock or lease at ``path`` for as long as this process lives and does
        not release it. A holder that lives keeps it; one that died loses it: on POSIX at once
        (the kernel drops a dead process's flock), on an object store once its lease lapses
        (waited out here, up to twice DISTCKPT_OBJECT_LEASE_S), or at once when
        ``holder_dead(record)`` says the caller can prove the holder gone. ``owner_id`` and
        ``extra`` go into the new holder's record.

        Raises:
            SaveInProgressError: a live holder has it (its record is ``owner``), or a holder's
                lease neither renewed nor lapsed within the wait.
            StorageError subclasses / request errors.
        """

    @abc.abstractmethod
    def scan_leftovers(self, root: str, *, other_hosts: bool = False) -> list[Leftover]:
        """Every leftover of a save or deletion under ``root`` with its owner's liveness. Never
        writes. ``other_hosts``: trust free locks of other hosts (POSIX; moot where a lease says).
        Raises StorageError subclasses / request errors."""

    @abc.abstractmethod
    def bytes_under(self, path: str) -> int | None:
        """Bytes stored under ``path`` (a leftover's area), counted cheaply and boundedly, or None
        where the back end cannot tell without listing every object. Never raises, never writes."""

    def replaced_checkpoint(self, path: str) -> bool | None:
        """Whether the leftover area ``path`` holds a checkpoint that an overwrite replaced (its
        deletion did not finish), as opposed to an interrupted save's data; None where the back
        end cannot tell (object stores: neither has a MANIFEST any more). Never raises, never
        writes."""
        return None

    @abc.abstractmethod
    def reclaim(self, root: str, *, other_hosts: bool = False,
                only: Callable[[str], bool] | None = None) -> list[str]:
        """Delete the leftovers of dead saves under ``root``, never one of a live save (whichever
        process runs it) and never a committed checkpoint; ``only``: of the names (a leftover's
        checkpoint name, ``step_00000002`` for ``.step_00000002.tmp-*``) it accepts, and no
        other (a root whose other names' temporaries are written without the root lock, a tiered
        local tier's records, must pass one). Returns what was removed. Raises StorageError
        subclasses / request errors."""
