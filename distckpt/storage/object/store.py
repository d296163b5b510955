"""ObjectStore: the :class:`distckpt.storage.Store` of fsspec object stores (S3 through s3fs).

An object store has no rename and no flock, so the commit is built from what it does have:
atomic single-object PUTs, conditional creates (``If-None-Match: *``) and multipart uploads that
are invisible until completed. Layout of a checkpoint ``C`` (docs/FORMAT.md, "Object stores")::

    C/MANIFEST                    the commit marker and index; names its save id
    C/<save-id>/rank00000.bin     data objects of the save whose MANIFEST names <save-id>
    C/.lock                       lease of a plain save of C in flight (a manager uses ROOT/.distckpt.lock)
    ROOT/latest                   "step_00000100\\n", one PUT after the MANIFEST

Protocol and the promises it keeps:
  * PREPARE (rank 0): take the lease (a conditional create of the lock object holding host, pid,
    save id and a renewal time a heartbeat thread refreshes every ``lease_s / 4``; a lock whose
    renewal is older than ``lease_s`` belongs to a dead save and is broken), reclaim dead
    leftovers of C, refuse a committed C unless overwrite. The save area is ``C/<save-id>``.
  * WRITE (every rank): ``C/<save-id>/rankNNNNN.bin`` by a multipart upload (several parts in
    flight from a bounded pool of part buffers; a shard smaller than one part is one PUT). An
    object is visible only once its upload completes, so a crashed rank leaves at most an
    incomplete upload (aborted by the next reclaim) and never a short object.
  * COMMIT (rank 0): ``C/<save-id>/.publishing`` is written (the time the MANIFEST's request is
    sent; deleted once the commit is known), then MANIFEST last, with a conditional create: the save that loses a race gets
    CheckpointExistsError and its data is deleted. An overwrite replaces MANIFEST in one PUT
    conditional on the ETag of the MANIFEST it read (``If-Match``: an overwrite that lands late,
    after another save replaced that MANIFEST, fails instead of replacing the newer commit);
    readers see the old MANIFEST and its complete old data, or the new one and its complete new
    data (the two saves' data live under different save-id prefixes); then the old save's prefix
    is deleted. A server that does not honour conditional writes (``DISTCKPT_OBJECT_CONDITIONAL=0``)
    gets a HEAD check before the PUT and a read-back after it (the MANIFEST must carry this save's
    id), so a lost race is still detected.
  * A request distckpt gave up on can still land (a gateway that buffered it forwards it late).
    So the MANIFEST's request is the only one whose late landing could matter, and it is fenced:
    an overwrite by its ``If-Match``, a create by its ``If-None-Match`` plus the data it names
    being kept for ``DISTCKPT_OBJECT_LATE_S`` after ``.publishing`` (below).
  * Reclaim (the next save of C, a manager's save and ``reclaim()``): a ``C/<id>/`` prefix is
    deleted, and incomplete multipart uploads under it aborted, only when MANIFEST does not name
    ``<id>``, no live lease (C/.lock or the root's) names it, and it holds no ``.publishing``
    younger than ``DISTCKPT_OBJECT_LATE_S`` (state ``settling``: its MANIFEST may still land); so a
    save in flight is never touched, and no late MANIFEST ever lands on deleted data.
  * Reads: ranged GETs of exactly the bytes the load plan asks for (:mod:`distckpt.fill` runs
    several in flight, coalesces neighbours across small gaps and verifies every checksum block).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import logging
import os
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

from ... import datafile
from ... import manifest as mf
from ...errors import (CheckpointCorruptError, CheckpointExistsError, CheckpointIncompleteError, CheckpointNotFoundError,
                      CheckpointRemovedError, ConfigError,
                      DataFileMissingError, DataFileTruncatedError, DistCkptError, ManifestCorruptError,
                      ResponseIncompleteError, SaveInProgressError)
from ...config import get_config
from ...plan import ALIGNMENT
from .. import ROOT_LOCK_NAME, Leftover, Store, join
from ..base import Ownership
from ..roots import holder_error
from . import request as objrequest
from .errors import NoSuchKey, client_config, translate
from .lease import Lease
from .settings import settings

__all__ = ["ObjectStore", "translate_error"]

log = logging.getLogger("distckpt")

LOCK_NAME = ".lock"
#: Written into a save's data prefix just before its MANIFEST's request is sent (module docstring).
PUBLISHING_NAME = ".publishing"
_MAX_PARTS = 10000           # S3's most parts per upload
_SAVE_ID_LEN = 32
_PEEK_BYTES = 4096           # a MANIFEST's first bytes, where its commit time is (peek_commit_time)
#: How many answers in a row may hold fewer bytes than the object is known to have before a read
#: fails with ResponseIncompleteError. Such an answer is the network's doing (a connection closed
#: before the end of a body sent without Content-Length), not a damaged object: asked again.
SHORT_ANSWER_TRIES = 3


def translate_error(exc: BaseException, url: str, rank: int | None, operation: str,
                    endpoint: str | None = None, conditional: bool = False) -> BaseException:
    """A typed DistCkptError for an exception of the object-store client (``exc`` itself when it
    already is one): :func:`distckpt.storage.object.errors.translate`."""
    return translate(exc, url=url, rank=rank, operation=operation, endpoint=endpoint, conditional=conditional)


class ObjectStore(Store):
    """The object-store back end over one fsspec file system (see the module docstring)."""

    kind = "object"

    def __init__(self, fs: Any, protocol: str) -> None:
        self.fs = fs
        self.protocol = protocol
        kwargs = getattr(fs, "client_kwargs", None) or {}
        self.endpoint = kwargs.get("endpoint_url") or getattr(fs, "endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL")

    @classmethod
    def for_url(cls, url: str, storage_options: Mapping[str, Any] | None) -> "ObjectStore":
        import fsspec
        # Several processes write: never trust a cached listing. Bounded connect/read timeouts and
        # botocore's standard retries, so a dead endpoint is a typed error, not a hang.
        options: dict[str, Any] = {"use_listings_cache": False}
        options.update(storage_options or {})
        if protocol_of(url) == "s3":
            options["config_kwargs"] = {**client_config(), **dict(options.get("config_kwargs") or {})}
        protocol = protocol_of(url)
        try:
            fs, _ = fsspec.core.url_to_fs(url, **options)
        except (ImportError, ValueError, TypeError) as exc:
            raise ConfigError(f"cannot open {url} with fsspec (storage_options={sorted(options)}): {exc}",
                              path=url, remedy="Install the fsspec back end of that scheme (s3fs for s3://) and "
                                               "pass options it knows.") from exc
        return cls(fs, protocol)

    # -- names ------------------------------------------------------------------------------

    def _key(self, url: str) -> str:
        return self.fs._strip_protocol(url)

    def _url(self, key: str) -> str:
        return f"{self.protocol}://{key}"

    def _call(self, operation: str, url: str, method: str, *args, rank: int | None = None, nbytes: int = 0,
              conditional: bool = False, timeout_s: float | None = None, **kwargs):
        """The file system's coroutine ``_<method>(*args, **kwargs)`` as one request of
        :mod:`distckpt.storage.object.request`: under a deadline (``timeout_s``, else the default for
        ``nbytes`` of body), throttles retried (bounded), failures typed. A plain "no such key"
        is :class:`NoSuchKey` for the caller to give its meaning (a missing MANIFEST, a missing
        data object); a missing bucket is BucketNotFoundError (which a caller catching NoSuchKey
        does not catch).

        Raises:
            NoSuchKey, EndpointUnreachableError (no answer within the deadline), and the typed
            errors of :func:`distckpt.storage.object.errors.translate`.
        """
        coro = getattr(self.fs, "_" + method)
        try:
            return objrequest.run(self.fs.loop, lambda: coro(*args, **kwargs), url=url, operation=operation,
                                  rank=rank, endpoint=self.endpoint, conditional=conditional, timeout_s=timeout_s,
                                  nbytes=nbytes)
        except DistCkptError as exc:
            if type(exc).__name__ == "ObjectNotFoundError":
                raise NoSuchKey(url) from exc
            raise

    def _s3(self, operation: str, url: str, api: str, *, rank: int | None = None, nbytes: int = 0,
            conditional: bool = False, timeout_s: float | None = None, **params):
        """One S3 API call (``api``: ``put_object``, ``list_objects_v2``...) through :meth:`_call`."""
        return self._call(operation, url, "call_s3", api, rank=rank, nbytes=nbytes, conditional=conditional,
                          timeout_s=timeout_s, **params)

    def _get_with_etag(self, url: str, limit: int, *,
                       too_large_empty: bool = False) -> tuple[bytes, str, float | None, float | None] | None:
        """The whole object at ``url``, its ETag, its age in seconds by the server's clock (the
        answer's ``Date`` less its ``LastModified``) and the server's time (``Date``, seconds since
        the epoch; both None when the server sends no date) from one GET (so they belong
        together), or None when it does not exist; an object above ``limit``
        bytes is ManifestCorruptError, or with ``too_large_empty`` empty bytes and its ETag, its
        body unread (a lease record no writer makes: unreadable, so dead, and replaceable
        conditionally on that ETag)."""
        bucket, key, _ = self.fs.split_path(self._key(url))

        async def get():
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
            body = resp["Body"]
            now, modified = _server_time(resp), resp.get("LastModified")
            age = (now - modified).total_seconds() if now is not None and modified is not None else None
            clock = now.timestamp() if now is not None and age is not None else None
            try:
                if int(resp.get("ContentLength") or 0) > limit and too_large_empty:
                    return b"", resp.get("ETag"), age, clock
                if int(resp.get("ContentLength") or 0) > limit:
                    raise ManifestCorruptError(f"{url} has {resp.get('ContentLength')} bytes, more than the {limit} "
                                               f"allowed", path=url, expected=f"<= {limit}",
                                               found=resp.get("ContentLength"))
                data = await body.read()
            finally:
                body.close()
            length = resp.get("ContentLength")
            if length is not None and len(data) != int(length):
                # aiohttp checks a declared length itself; this is the last guard before a cut
                # MANIFEST would be decoded (and called damaged).
                raise _short_answer(url, len(data), int(length), 0, self.endpoint, answers=1)
            return data, resp.get("ETag"), age, clock
        try:
            return objrequest.run(self.fs.loop, get, url=url, operation="get", endpoint=self.endpoint, nbytes=limit)
        except DistCkptError as exc:
            if type(exc).__name__ == "ObjectNotFoundError":
                return None
            raise

    def _exists(self, url: str) -> bool:
        try:  # info, not fs.exists: exists() says False for a missing bucket or a refused request
            self._call("head", url, "info", self._key(url))
            return True
        except NoSuchKey:
            return False

    def _read_small(self, url: str, limit: int) -> bytes | None:
        """The whole object at ``url`` (None when absent), refusing one above ``limit`` bytes."""
        got = self._read_small_tagged(url, limit)
        return None if got is None else got[0]

    def _read_small_tagged(self, url: str, limit: int) -> tuple[bytes, str | None] | None:
        """(the whole object at ``url``, the ETag its HEAD gave) or None when absent, refusing one
        above ``limit`` bytes. Two requests, each under the deadline of its own size (both again,
        at most SHORT_ANSWER_TRIES times, while the GET does not hold the HEAD's size). Should the
        object change between them, a write conditional on that ETag fails, as it should."""
        attempt = 0
        try:
            while True:
                attempt += 1
                info = self._call("head", url, "info", self._key(url))
                if info.get("type") == "directory":
                    return None
                if info["size"] > limit:
                    raise ManifestCorruptError(f"{url} has {info['size']} bytes, more than the {limit} allowed",
                                               path=url, expected=f"<= {limit}", found=info["size"])
                try:
                    data = _get_whole(lambda: self._call("get", url, "cat_file", self._key(url), nbytes=info["size"]),
                                      url, info["size"], 0, self.endpoint, tries=1)
                except ResponseIncompleteError:
                    # Cut short, or the object was replaced between the HEAD and the GET (an
                    # overwrite: the GET held the new one's bytes, the retries asked for the old
                    # size and blamed the network): its size is asked again.
                    if attempt == SHORT_ANSWER_TRIES:
                        raise
                    continue
                return data, info.get("ETag")
        except NoSuchKey:
            return None

    # -- read side ------------------------------------------------------------------------------

    def is_committed(self, path: str) -> bool:
        return self._exists(join(path, mf.MANIFEST_NAME))

    #: The most requests :meth:`for_each` keeps in flight.
    FOR_EACH_IN_FLIGHT = 16

    def for_each(self, query: Callable[[str], Any], paths: Sequence[str]) -> list[Any]:
        # Each query is one or two round trips under its own deadline: a root of 1,000 steps
        # took 1,000 round trips one after the other on every listing (steps(), latest_step()).
        if len(paths) < 2:
            return super().for_each(query, paths)
        one = super().for_each
        with concurrent.futures.ThreadPoolExecutor(min(self.FOR_EACH_IN_FLIGHT, len(paths)),
                                                   thread_name_prefix="distckpt-query") as pool:
            return list(pool.map(lambda path: one(query, [path])[0], paths))

    def manifest_bytes(self, path: str) -> bytes:
        """The raw MANIFEST of the checkpoint at ``path``.

        Raises:
            CheckpointNotFoundError: nothing at ``path``.
            CheckpointIncompleteError: objects under ``path`` but no MANIFEST (never committed).
        """
        data = self._read_small(join(path, mf.MANIFEST_NAME), mf.MAX_MANIFEST_FILE_BYTES)
        if data is not None:
            return data
        found = self.objects(path)
        if found:
            # A manager root (or any parent of checkpoints) holds objects too: say what it is.
            held = holder_error(path, sorted({rel.split("/")[0] for rel in found
                                              if rel.count("/") == 1 and rel.endswith("/" + mf.MANIFEST_NAME)}), join)
            if held is not None:
                raise held
            raise CheckpointIncompleteError(
                f"{path} holds objects but no MANIFEST: a save in progress, or one that crashed; never loadable",
                path=path)
        raise CheckpointNotFoundError(f"no checkpoint at {path} (no {mf.MANIFEST_NAME})", path=path)

    def read_index(self, path: str, header: "mf.Manifest", i: int) -> bytes:
        """The index bytes of data object ``i`` (one HEAD, which checks its size, and one ranged
        GET). Raises DataFileMissingError, DataFileTruncatedError, CheckpointCorruptError."""
        urls, open_reader, _, _ = self.data_readers(path, header, [i])
        off, length, _ = header.files[i].index
        buf = bytearray(length)
        reader = open_reader(urls[i])
        reader.read_into([(off, length, memoryview(buf))])
        try:
            mf.check_index_bytes(header, i, buf, urls[i])
        except CheckpointCorruptError as exc:
            # As for a data range (distckpt.fill): the answer may have changed in transit; read
            # it once more, and a second mismatch is the stored bytes.
            log.warning("distckpt: the index of %s does not match its checksum (%s): reading it again, the first "
                        "answer may have changed in transit", urls[i], exc.message)
            reader.read_into([(off, length, memoryview(buf))])
            mf.check_index_bytes(header, i, buf, urls[i])
        return bytes(buf)

    @contextlib.contextmanager
    def guard_reads(self, path: str) -> Iterator[None]:
        """A data object missing inside the block because the checkpoint was overwritten or
        deleted while it was read leaves as CheckpointRemovedError (as on a local file system).
        Objects are never renamed, and a save's data lives under its own save id: a read that
        succeeded read one checkpoint, so success stands."""
        try:
            yield
        except DataFileMissingError as exc:
            seen = os.path.basename(os.path.dirname(exc.path or ""))
            try:
                now = self.committed_save_id(path)
            except Exception:  # noqa: BLE001 - the original error says enough
                now = seen
            if now == seen:
                raise  # the same save's object is missing: damage, not a replacement
            fields = {k: getattr(exc, k) for k in ("filled", "partly_filled") if getattr(exc, k, None) is not None}
            raise CheckpointRemovedError(
                f"{path} was {'replaced by another save' if now else 'deleted'} while it was read ({exc.message})",
                path=path, renamed_to=None, replaced=now is not None, **fields) from exc

    def data_url(self, path: str, manifest: "mf.Manifest", index: int) -> str:
        return join(path, manifest.save_id, manifest.files[index].name)

    def data_readers(self, path: str, manifest: "mf.Manifest", file_indexes: list[int], *,
                     piece: int | None = None):
        """(urls, open_reader, align, backend) for :func:`distckpt.fill.fill`; every data object
        is checked against the size MANIFEST gives first (one HEAD each). ``piece`` is moot: each
        request is one ranged GET of exactly its bytes.

        Raises:
            DataFileMissingError, DataFileTruncatedError, CheckpointCorruptError (too long).
        """
        urls, sizes = {}, {}
        for i in file_indexes:
            url = self.data_url(path, manifest, i)
            entry = manifest.files[i]
            try:
                size = self._call("head", url, "info", self._key(url))["size"]
            except NoSuchKey:
                raise DataFileMissingError(f"data object {manifest.save_id}/{entry.name} listed in MANIFEST is "
                                           f"missing", path=url) from None
            if size < entry.size:
                raise DataFileTruncatedError(f"data object {entry.name} has {size} bytes, MANIFEST says {entry.size}",
                                             path=url, expected=entry.size, found=size)
            if size > entry.size:
                raise CheckpointCorruptError(f"data object {entry.name} has {size} bytes, MANIFEST says "
                                                f"{entry.size}", path=url, expected=entry.size, found=size)
            urls[i], sizes[url] = url, size
        return urls, (lambda u: _RangeReader(self, u, sizes[u])), 1, f"fsspec:{self.protocol}"

    def peek_commit_time(self, path: str) -> float | None:
        # One ranged GET of the first few KiB, where a whole decode takes a HEAD and a GET of the
        # whole MANIFEST (megabytes for a state of thousands of tensors): latest_step and
        # rotation order every step of a root this way.
        url = join(path, mf.MANIFEST_NAME)
        try:
            data = self._call("get", url, "cat_file", self._key(url), start=0, end=_PEEK_BYTES, nbytes=_PEEK_BYTES)
        except NoSuchKey:
            return None
        except DistCkptError as exc:
            if _empty_range(exc):  # an empty object has no first byte (HTTP 416): it does not tell
                return None
            raise
        return mf.commit_time_of_prefix(data)

    def data_file_stat(self, path: str, manifest: "mf.Manifest", i: int) -> tuple[str, int | None, str | None]:
        url = self.data_url(path, manifest, i)
        try:
            return url, self._call("head", url, "info", self._key(url))["size"], None
        except NoSuchKey:
            return url, None, "missing (listed in MANIFEST)"

    def whole_file_readers(self, sizes: Mapping[str, int]):
        return (lambda u: _RangeReader(self, u, sizes[u])), (f"fsspec:{self.protocol}" if sizes else None)

    # -- save side ------------------------------------------------------------------------------

    def prepare(self, final: str, save_id: str, overwrite: bool, needed: int, rank: int,
                lock_path: str | None) -> tuple[str, Any]:
        if "/" not in final.split("://", 1)[-1].strip("/"):
            # A checkpoint is a key prefix with a parent: its probe, its root lock and its
            # listing as a step live there (the pre-flight failed with a raw ValueError).
            raise ConfigError(f"{final} is a bucket, not a checkpoint path in one", path=final, rank=rank,
                              remedy=f"Save under a prefix of it, e.g. {final.rstrip('/')}/ckpt; a CheckpointManager "
                                     f"root may be the bucket itself.")
        if get_config().preflight:
            self._preflight(final, rank)
        lock_url = lock_path or join(final, LOCK_NAME)
        lease = Lease.acquire(self, lock_url, save_id=save_id, what=final, rank=rank)
        self._lease = lease  # publish() checks it is still ours
        try:
            self.reclaim_checkpoint(final, root_lock=join(_parent(final), ROOT_LOCK_NAME), own_id=save_id)
            if self.is_committed(final) and not overwrite:
                raise CheckpointExistsError(f"a committed checkpoint already exists at {final}", path=final, rank=rank)
            return join(final, save_id), lease
        except BaseException:
            lease.release()
            raise

    def _preflight(self, final: str, rank: int) -> None:
        """Before the first byte of a save (DISTCKPT_PREFLIGHT=1): the credentials resolve, the
        endpoint answers, the bucket exists, and a probe object next to the checkpoint (a file
        under its parent prefix, which no listing of checkpoints or leftovers counts) is created
        and removed (distckpt.storage.object.check); each failure is its typed error.

        Raises:
            ConfigError: DISTCKPT_OBJECT_CONDITIONAL=1 but the server overwrote the probe's
                conditional create: the commit could not tell a lost race from a win.
        """
        from .check import check_object_store
        found = check_object_store(_parent(final), fs=self.fs, rank=rank)
        if found.get("conditional") is False and settings()["conditional"]:
            raise ConfigError(
                f"the object store behind {final} overwrote an object created with If-None-Match: * (it does "
                "not honour conditional creates), so the MANIFEST's conditional create could not detect "
                "another save committing the same checkpoint", path=final, rank=rank,
                variable="DISTCKPT_OBJECT_CONDITIONAL",
                remedy="Set DISTCKPT_OBJECT_CONDITIONAL=0: the commit then checks before and reads back after "
                       "writing the MANIFEST.")

    def write_rank(self, area: str, rank: int, pieces: list, checksum_block: int) -> tuple:
        """One rank's data object, laid out by :mod:`distckpt.datafile` into a multipart upload (its
        sink), visible once the upload completes. Returns (index ref, size, backend, reason)."""
        url = join(area, mf.data_file_name(rank))
        # The parts are sized before the first byte: from an upper bound of the object's size, so
        # that it takes at most _MAX_PARTS parts.
        bound = datafile.size_bound(pieces, checksum_block, _Upload.alignment, moves_chunks=False)
        cfg = settings()
        part = _part_size(cfg, bound)
        up = _Upload(self, url, part_size=part, in_flight=cfg["in_flight"], size_bound=bound, rank=rank)
        try:
            written = datafile.write_data_file(up, rank, pieces, checksum_block)
            up.finish()
        except BaseException:
            up.abort()
            raise
        return written.index, written.size, f"fsspec:{self.protocol}", (
            f"object store: multipart upload, {part >> 20} MiB parts, {cfg['in_flight']} in flight")

    def copy_data_file(self, area: str, rank: int, size: int, feed: Callable[[Any], None]) -> int:
        """Data object ``rank`` of ``area`` from the bytes ``feed(upload)`` appends: the same
        multipart upload as :meth:`write_rank` (parts sized for ``size``; at most ``in_flight``
        parts uploading while one more is filled), visible once it completes. Returns ``size``.

        On error the upload is aborted (no partial object appears). When the error came from the
        request that completes it (or from the single PUT of a small object), whose answer may
        have been lost after the server acted, the whole object may be there: it is left, never
        deleted, because a drain's retry uploads the same key of the same area (the area is named
        by the local save) and a deletion that lands late (a gateway forwarding it after its
        deadline) would remove the retry's object after the retry committed its MANIFEST. The
        area stays until a reclaim of the remote root if no try ever commits (``distckpt
        reclaim``, ``CheckpointManager.reclaim()``). The upload's requests
        carry no rank: the caller's collective records the copying rank on the error (the
        object's name is in its URL).

        Raises:
            DataFileTruncatedError, CheckpointCorruptError: ``feed`` appended fewer / more than ``size``
                bytes.
            The typed request errors (EndpointUnreachableError, QuotaExceededError, ...), and
            whatever ``feed`` raises.
        """
        url = join(area, mf.data_file_name(rank))
        cfg = settings()
        up = _Upload(self, url, part_size=_part_size(cfg, size), in_flight=cfg["in_flight"], size_bound=size,
                     rank=None)
        try:
            feed(up)
            if up.tell() != size:
                cls = DataFileTruncatedError if up.tell() < size else CheckpointCorruptError
                raise cls(f"{_basename(url)}: the copy supplied {up.tell()} bytes, expected {size}", path=url,
                          expected=size, found=up.tell())
            up.finish()
        except BaseException:
            up.abort()
            raise
        return size

    def publish(self, area: str, final: str, manifest: bytes, overwrite: bool) -> str | None:
        """Write MANIFEST (the commit point). Returns the replaced save's data prefix, or None.

        First every data object MANIFEST names is checked (one HEAD each), then the lease is
        proven still held (:meth:`Lease.ensure_held`), and the MANIFEST's PUT is sent with a
        deadline inside the lease's remaining window: it cannot land after another save may have
        broken the lease and reclaimed this save's data.

        A PUT that fails without a definite answer (no answer within its deadline, a reset
        connection) may have landed all the same: the MANIFEST there is read back
        (:meth:`_resolve_lost_answer`); one that carries this save's id means the save is committed
        (this returns normally). Any other outcome raises with ``data_kept = True``: the caller
        must not delete the save's data (the PUT may still land; the next save's reclaim deletes
        the data once no MANIFEST names it); ``commit_unknown = True`` and ``committed = None``
        when even the read-back failed.

        Raises:
            CheckpointExistsError: another save committed ``final`` first (its MANIFEST is kept).
            SaveInProgressError: the lease was taken over, or could not be renewed.
            DataFileMissingError, DataFileTruncatedError: a data object is gone or short.
            EndpointUnreachableError and the other typed request errors (see above).
        """
        url = join(final, mf.MANIFEST_NAME)
        save_id = _basename(area)
        m = mf.decode_header(manifest)
        self.data_readers(_parent(area), m, list(range(len(m.files))))
        got = self._read_small_tagged(url, mf.MAX_MANIFEST_FILE_BYTES)
        old_id, old_etag = None, None
        if got is not None:
            if not overwrite:
                raise CheckpointExistsError(f"another save committed {final} while this one was writing",
                                            path=final, remedy="Save to another path, or pass overwrite=True.")
            old_id, old_etag = mf.decode_header(got[0], path=url).save_id, got[1]
        conditional = settings()["conditional"] and (got is None or old_etag is not None)
        # The time this MANIFEST's request is sent, where a reclaim finds it: until
        # DISTCKPT_OBJECT_LATE_S later, the request may still land, so the data stays.
        marker = join(area, PUBLISHING_NAME)
        self._call("mark the commit", marker, "pipe_file", self._key(marker), save_id.encode(), rank=0,
                   nbytes=len(save_id))
        timeout = objrequest.request_timeout(len(manifest))
        lease = getattr(self, "_lease", None)
        if lease is not None:
            window = lease.ensure_held()
            if window < 0.25:
                raise SaveInProgressError(
                    f"too little of the save lease {lease.url} is left to commit {final} safely ({window:.2f} s)",
                    path=final, rank=0, owner=None,
                    remedy="Nothing was committed. Raise DISTCKPT_OBJECT_LEASE_S (the endpoint answers slowly).")
            timeout = min(timeout, window)
        try:
            if conditional and got is not None:
                # An overwrite of the MANIFEST read above, and of nothing newer (If-Match).
                bucket, key, _ = self.fs.split_path(self._key(url))
                self._s3("write MANIFEST", url, "put_object", Bucket=bucket, Key=key, Body=manifest, IfMatch=old_etag,
                         rank=0, conditional=True, nbytes=len(manifest), timeout_s=timeout)
            else:
                self._call("write MANIFEST", url, "pipe_file", self._key(url), manifest,
                           mode="create" if conditional else "overwrite", rank=0, conditional=conditional,
                           nbytes=len(manifest), timeout_s=timeout)
        except CheckpointExistsError as exc:
            # The create (or the overwrite of the MANIFEST read) lost, or a retried request found
            # what its own first try wrote (the answer was lost): only the save id there can tell.
            there = self.committed_save_id(final)
            if there != save_id:
                if got is None:
                    raise
                raise CheckpointExistsError(f"another save replaced the MANIFEST of {final} while this one was "
                                            f"writing (save {there} is there)", path=final, rank=0,
                                            remedy="Save to another path, or overwrite again.") from exc
        except DistCkptError as exc:
            self._resolve_lost_answer(final, save_id, old_id, exc)
        if not conditional:
            # Read back: the MANIFEST now there must be this save's. Without conditional writes
            # the last PUT wins; the loser learns it here. The PUT
            # succeeded, so a read-back that fails leaves the save committed unless another raced.
            try:
                back = self.committed_save_id(final)
            except (DistCkptError, NoSuchKey) as exc:
                raise _outcome_unknown(exc, final, save_id, "the MANIFEST was written but reading it back failed")
            if back != save_id:
                raise CheckpointExistsError(f"another save replaced the MANIFEST of {final} (read-back found another "
                                            f"save id)", path=final, remedy="Save to another path.")
        # Committed: the mark has done its job (a deletion that lands late removes nothing else).
        try:
            self._call("delete", marker, "rm_file", self._key(marker), rank=0)
        except (DistCkptError, NoSuchKey) as exc:
            log.info("distckpt: %s stays after the commit (harmless): %s", marker, exc)
        return join(final, old_id) if old_id and old_id != save_id else None

    def _resolve_lost_answer(self, final: str, save_id: str, old_id: str | None, exc: DistCkptError) -> None:
        """The MANIFEST's PUT raised ``exc`` without a definite answer, so it may have landed (or
        may still land: a request can reach the server after the client gave up on it). Read the
        MANIFEST back: this save's id there means committed (return). Otherwise raise, with the
        data kept (``data_kept``): deleting it now could leave a late-landing MANIFEST without its
        data; a reclaim deletes it once no MANIFEST names it and DISTCKPT_OBJECT_LATE_S has passed.
        Nothing (or the replaced save's id) there, or the read-back fails: ``exc`` marked
        ``commit_unknown`` (``committed = None``). Another save's id: CheckpointExistsError (its
        conditional create or overwrite fences this request off)."""
        try:
            there = self.committed_save_id(final)
        except (DistCkptError, NoSuchKey) as check:
            raise _outcome_unknown(exc, final, save_id, f"reading the MANIFEST back failed: {check}")
        if there == save_id:
            log.warning("distckpt: the answer to the MANIFEST write of %s was lost (%s), but it landed: committed",
                        final, exc)
            return
        if there is None or there == old_id:
            # Not there now, but the request may still land (until DISTCKPT_OBJECT_LATE_S; its data
            # is kept that long): the outcome is not known.
            raise _outcome_unknown(exc, final, save_id, "the MANIFEST is not there yet, but its request may still "
                                   f"land within DISTCKPT_OBJECT_LATE_S ({settings()['late_s']:.0f} s)")
        err = CheckpointExistsError(f"another save committed {final} while this one was writing (its MANIFEST, "
                                    f"save {there}, is there; this save's request failed: {exc.message})",
                                    path=final, rank=0, remedy="Save to another path, or pass overwrite=True.")
        err.data_kept = True
        raise err from exc

    def discard(self, replaced: str) -> None:
        self.delete_prefix(replaced)

    def abort(self, area: str, world: int) -> None:
        self.delete_prefix(area)

    def abort_for_retry(self, area: str, world: int) -> None:
        """Abort the area's incomplete multipart uploads only (each by its upload id: a late abort
        cannot touch another try's objects). Its completed objects stay: the retry overwrites
        them under the same keys, or a reclaim deletes them once no save holds the area. A
        deletion of the prefix now could land after the retry committed and remove its data."""
        self.abort_uploads(area)

    def committed_save_id(self, final: str) -> str | None:
        data = self._read_small(join(final, mf.MANIFEST_NAME), mf.MAX_MANIFEST_FILE_BYTES)
        return None if data is None else mf.decode_header(data).save_id

    def save_id_of_area(self, area: str) -> str:
        return _basename(area)

    # -- deletion and reclaim ---------------------------------------------------------------------

    def objects(self, prefix: str) -> list[str]:
        """Keys (relative to ``prefix/``) of every object under ``prefix/``: one flat listing, no
        directory emulation (a server such as SeaweedFS keeps empty "directories" around)."""
        bucket, key, _ = self.fs.split_path(self._key(prefix))
        key = key.rstrip("/") + "/"
        out, token = [], None
        while True:
            kw = {"ContinuationToken": token} if token else {}
            try:
                page = self._s3("list", prefix, "list_objects_v2", Bucket=bucket, Prefix=key, **kw)
            except NoSuchKey:
                return out
            out += [o["Key"][len(key):] for o in page.get("Contents") or [] if not o["Key"].endswith("/")]
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return out

    def delete_prefix(self, prefix: str) -> None:
        """Delete every object under ``prefix/`` and abort the incomplete multipart uploads there."""
        self.abort_uploads(prefix)
        bucket, key, _ = self.fs.split_path(self._key(prefix))
        key = key.rstrip("/") + "/"
        rel = self.objects(prefix)
        for i in range(0, len(rel), 1000):
            batch = [{"Key": key + r} for r in rel[i:i + 1000]]
            self._s3("delete", prefix, "delete_objects", Bucket=bucket, Delete={"Objects": batch, "Quiet": True})
        # Directory markers some servers keep (SeaweedFS), deepest first; absent keys are no-ops.
        dirs = {key + r.rsplit("/", 1)[0] + "/" for r in rel if "/" in r} | {key}
        for d in sorted(dirs, key=len, reverse=True):
            try:
                self._s3("delete", self._url(f"{bucket}/{d}"), "delete_object", Bucket=bucket, Key=d)
            except (DistCkptError, NoSuchKey):  # cosmetic: an empty "directory" holds no data
                pass
        self.fs.invalidate_cache(self._key(prefix))

    def abort_uploads(self, prefix: str) -> list[str]:
        bucket, key, _ = self.fs.split_path(self._key(prefix))
        out = []
        try:
            listing = self._s3("list uploads", prefix, "list_multipart_uploads", Bucket=bucket,
                               Prefix=key.rstrip("/") + "/")
        except (NoSuchKey, AttributeError):
            return out
        for up in listing.get("Uploads") or []:
            try:
                self._s3("abort upload", prefix, "abort_multipart_upload", Bucket=bucket, Key=up["Key"],
                         UploadId=up["UploadId"])
                out.append(up["Key"])
            except (DistCkptError, NoSuchKey) as exc:  # best effort; the next reclaim retries
                log.warning("distckpt: could not abort the multipart upload of %s: %s", up["Key"], exc)
        return out

    def _live_ids(self, lock_urls: list[str]) -> set[str]:
        ids = set()
        for url in lock_urls:
            rec, _, age, clock = Lease.read_aged(self, url)
            if rec is not None and Lease.is_live(rec, age_s=age, server_now=clock) and isinstance(rec.get("save_id"), str):
                ids.add(rec["save_id"])
        return ids

    def leftovers(self, final: str, root_lock: str | None = None) -> list[tuple[str, str]]:
        """(prefix URL, state) of every save-id prefix under ``final`` that MANIFEST does not
        name: ``alive`` (a live lease names it), ``settling`` (its MANIFEST's request was sent less
        than DISTCKPT_OBJECT_LATE_S ago and may still land) or ``dead``. Never writes."""
        prefixes = {r.split("/", 1)[0] for r in self.objects(final) if "/" in r}
        ids = set(prefixes) | {u.split("/", 1)[0] for u in self._upload_keys(final) if "/" in u}
        ids = {i for i in ids if len(i) == _SAVE_ID_LEN and all(c in "0123456789abcdef" for c in i)}
        if not ids:
            return []
        # Locks are read after the listing, MANIFEST after the locks: a save creates its lease
        # before its first object and publishes MANIFEST before it drops the lease, so an id
        # listed above is named by one of the two if its save is alive or committed.
        live = self._live_ids([join(final, LOCK_NAME)] + ([root_lock] if root_lock else []))
        committed = self.committed_save_id(final)
        out = []
        for i in sorted(ids):
            if i != committed:
                state = "alive" if i in live else "settling" if self._settling(join(final, i)) else "dead"
                out.append((join(final, i), state))
        return out

    def _settling(self, prefix: str) -> bool:
        """Whether the save of ``prefix`` sent its MANIFEST's request less than
        DISTCKPT_OBJECT_LATE_S ago (its ``.publishing``, by the server's clock): the request may
        still land, so its data must stay. Settling while its age is below the window by this
        host's clock or by the server's (the answer's ``Date`` less its ``LastModified``): by this
        host's clock alone, a clock 15 minutes ahead judged a request sent a moment ago late, and
        its data was deleted before its MANIFEST landed."""
        url = join(prefix, PUBLISHING_NAME)
        bucket, key, _ = self.fs.split_path(self._key(url))
        try:
            head = self._s3("head", url, "head_object", Bucket=bucket, Key=key)
        except NoSuchKey:
            return False
        when = head.get("LastModified")
        now = _server_time(head)
        if when is None:
            return True  # cannot tell: keep it
        # Settling by either clock: the server's dates have whole seconds, this host's may be off.
        late = settings()["late_s"]
        return time.time() - when.timestamp() < late or (now is not None and (now - when).total_seconds() < late)

    def reclaim_checkpoint(self, final: str, root_lock: str | None = None, own_id: str | None = None) -> list[str]:
        """Delete the dead leftovers of ``final`` (:meth:`leftovers`); returns their prefixes.

        ``own_id``: the save id of the caller's own save, whose lease it holds (so its prefix looks
        alive). A save id is fresh for every save, except a drain's (distckpt.tiers.drain: the
        local save's id, reused by every try): a failed earlier try of the same drain may have left
        incomplete multipart uploads under this prefix, which are aborted here; its completed
        objects are rewritten by this try."""
        removed = []
        for prefix, state in self.leftovers(final, root_lock):
            if state == "dead":
                self.delete_prefix(prefix)
                removed.append(prefix)
            elif own_id is not None and _basename(prefix) == own_id:
                self.abort_uploads(prefix)
        if removed:
            log.info("distckpt: reclaimed %d leftovers of dead saves under %s: %s", len(removed), final, removed)
        return removed

    def check_root(self, root: str) -> None:
        pass  # any prefix of a bucket can hold checkpoints; the bucket itself is checked by a save's preflight

    def make_root(self, root: str) -> None:
        pass  # a prefix exists once an object is under it

    def exists(self, path: str) -> bool:
        # Objects, not a "directory": a server such as SeaweedFS keeps empty ones after a deletion.
        return bool(self.objects(path))

    def has_manifest(self, path: str) -> bool:
        return self.is_committed(path)

    def take_ownership(self, path: str, *, owner_id: str, what: str, extra: Mapping[str, Any],
                       holder_dead: Callable[[dict], bool]) -> Ownership:
        return Lease.acquire(self, path, save_id=owner_id, what=what, rank=0, extra=extra, holder_dead=holder_dead,
                             wait_out=True)

    def scan_leftovers(self, root: str, *, other_hosts: bool = False) -> list[Leftover]:
        """The save-id prefixes under each child of ``root`` that no MANIFEST names, as Leftovers
        of kind ``tmp`` (``other_hosts`` is moot: a lease says whether its save lives)."""
        out = []
        for name in self._unclean_children(root):
            for prefix, state in self.leftovers(join(root, name), root_lock=join(root, ROOT_LOCK_NAME)):
                out.append(Leftover(f"{name}/{_basename(prefix)}", name, "tmp", prefix, state, None))
        return out

    def _unclean_children(self, root: str) -> list[str]:
        """The children of ``root`` (a manager root) that may hold a leftover, from one flat
        listing of the root and one of its multipart uploads (not two requests per child): a
        child holding MANIFEST and a single save-id prefix is clean (the prefix a MANIFEST names
        always exists), so only the others need a look."""
        prefixes: dict[str, set[str]] = {}
        manifests = set()
        for rel in self.objects(root):
            parts = rel.split("/")
            if len(parts) == 2 and parts[1] == mf.MANIFEST_NAME:
                manifests.add(parts[0])
            elif len(parts) >= 3:
                prefixes.setdefault(parts[0], set()).add(parts[1])
        uploads = {u.split("/", 1)[0] for u in self._upload_keys(root) if "/" in u}
        # a step whose only trace is an incomplete multipart upload (its save crashed before any
        # object completed) has no object and may list as no directory: found by its uploads
        return [name for name in sorted(set(prefixes) | set(self.list_children(root)) | uploads)
                if not (name in manifests and len(prefixes.get(name, ())) == 1 and name not in uploads)]

    def bytes_under(self, path: str) -> int | None:
        return None  # the listing that would tell (sizes of every object) is not worth a look

    def list_children(self, root: str) -> list[str]:
        """Names of the 'directories' directly under ``root`` (no MANIFEST check)."""
        try:
            entries = self._call("list", root, "ls", self._key(root), detail=True)
        except NoSuchKey:
            return []
        return sorted(_basename(e["name"]) for e in entries if e.get("type") == "directory")

    def reclaim(self, root: str, *, other_hosts: bool = False,
                only: Callable[[str], bool] | None = None) -> list[str]:
        """Reclaim dead leftovers under every child of ``root`` (a manager root) that may hold
        one (:meth:`_unclean_children`; those ``only`` accepts). ``other_hosts`` is moot: a
        lease says whether its save lives, from any host."""
        removed = []
        for name in self._unclean_children(root):
            if only is not None and not only(name):
                continue
            removed += self.reclaim_checkpoint(join(root, name), root_lock=join(root, ROOT_LOCK_NAME))
        return removed

    def _upload_keys(self, prefix: str) -> list[str]:
        """Keys (relative to ``prefix/``) of the incomplete multipart uploads under it ([] where the
        store has no such listing)."""
        bucket, key, _ = self.fs.split_path(self._key(prefix))
        key = key.rstrip("/") + "/"
        try:
            listing = self._s3("list uploads", prefix, "list_multipart_uploads", Bucket=bucket, Prefix=key)
        except (NoSuchKey, AttributeError):  # not S3: no multipart listing
            return []
        return [u["Key"][len(key):] for u in listing.get("Uploads") or []]

    def replace_pointer(self, url: str, data: bytes) -> None:
        self._call("put", url, "pipe_file", self._key(url), data, nbytes=len(data))

    def read_pointer(self, url: str) -> str | None:
        data = self._read_small(url, 4096)
        return None if data is None else data.decode("utf-8", "replace").strip()

    def remove_checkpoint(self, path: str) -> None:
        """Delete a committed checkpoint: MANIFEST first (it stops being a checkpoint in that one
        DELETE), conditional on the ETag read with it, then that save's data prefix
        (``path/<save_id>/``) only; a crash in between leaves a prefix the next reclaim removes.

        Why not everything under ``path``: a remover frozen past its lease (a stopped process, a
        paused VM) wakes after another job took the root over and saved the same step again;
        deleting the whole prefix removed that save's data under its committed MANIFEST (a
        checkpoint that looks complete and does not load), and an unconditional DELETE removed
        its MANIFEST. A MANIFEST that changed since it was read is left (logged), with its data.
        Another save's data under ``path`` is a leftover for :meth:`reclaim` (which spares live
        saves'). Raises the store's typed errors."""
        url = join(path, mf.MANIFEST_NAME)
        got = self._get_with_etag(url, mf.MAX_MANIFEST_FILE_BYTES)
        if got is None:
            return  # nothing committed here: leftovers are reclaim's (it knows live saves)
        data, etag = got[0], got[1]
        try:
            save_id = mf.decode_header(data, path=url).save_id
        except DistCkptError as exc:  # a damaged MANIFEST: removed; its data is a dead leftover now
            log.warning("distckpt: removing %s whose MANIFEST does not decode (%s): its data is left to reclaim",
                        path, exc)
            save_id = None
        bucket, key, _ = self.fs.split_path(self._key(url))
        cond = {"IfMatch": etag} if settings()["conditional"] and etag else {}
        try:
            self._s3("delete", url, "delete_object", Bucket=bucket, Key=key, conditional=True, **cond)
        except CheckpointExistsError:
            log.warning("distckpt: not removing %s: its MANIFEST changed since it was read (another save committed "
                        "the step)", path)
            return
        except NoSuchKey:
            pass
        if save_id is not None:
            self.delete_prefix(join(path, save_id))
        self.fs.invalidate_cache(self._key(path))


def _server_time(response: dict) -> "datetime.datetime | None":
    """The server's clock when it answered (the HTTP ``Date`` header), or None without one."""
    import email.utils
    date = (response.get("ResponseMetadata") or {}).get("HTTPHeaders", {}).get("date")
    try:
        return email.utils.parsedate_to_datetime(date) if date else None
    except (TypeError, ValueError):
        return None


def _outcome_unknown(exc: BaseException, final: str, save_id: str, why: str) -> BaseException:
    """``exc`` marked as a commit whose outcome is unknown: ``commit_unknown``, ``committed =
    None``, ``data_kept`` (the caller must not delete the save's data) and ``save_id``."""
    exc.committed, exc.commit_unknown, exc.data_kept, exc.save_id = None, True, True, save_id
    if isinstance(exc, DistCkptError):
        exc.message = (f"{exc.message}; whether the MANIFEST of {final} is this save's is unknown ({why}), so the "
                       f"data of save {save_id} is kept: if {final}/MANIFEST carries save_id {save_id}, the checkpoint "
                       f"is committed and complete")
        exc.args = (exc.message,)
    return exc


def _part_size(cfg: dict, size_bound: int) -> int:
    """The part size of an upload of at most ``size_bound`` bytes: DISTCKPT_OBJECT_PART_SIZE, raised
    so that the object takes at most S3's 10000 parts."""
    return max(cfg["part_size"], -(-size_bound // _MAX_PARTS))


def protocol_of(url: str) -> str:
    return url.split("://", 1)[0].lower()


def _basename(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


def _parent(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[0]


def _short_answer(url: str, got: int, expected: int, offset: int, endpoint: str | None,
                  answers: int = SHORT_ANSWER_TRIES) -> ResponseIncompleteError:
    said = "an answer" if answers == 1 else f"{answers} answers in a row"
    if got > expected:  # not a cut: a gateway that ignored the Range, or an object that changed
        return ResponseIncompleteError(
            f"get {url} failed: {said} held {got} bytes where {expected} were asked for at offset {offset} (something "
            f"between this node and the store ignored the Range header, or the object changed under the read)",
            path=url, url=url, operation="get", code="LongAnswer", endpoint=endpoint, errno=errno.EIO)
    return ResponseIncompleteError(
        f"get {url} failed: {said} held {got} of the {expected} bytes asked for at offset {offset}, which the "
        f"object holds (the connection closed before the end of the body)",
        path=url, url=url, operation="get", code="ShortAnswer", endpoint=endpoint, errno=errno.EIO)


def _empty_range(exc: DistCkptError) -> bool:
    """Whether ``exc`` is the answer to a ranged GET of an empty object (HTTP 416)."""
    return getattr(exc, "details", {}).get("status") == 416


def _get_whole(get: Callable[[], bytes], url: str, nbytes: int, offset: int, endpoint: str | None,
               tries: int = SHORT_ANSWER_TRIES) -> bytes:
    """``get()`` (a GET of ``nbytes`` the object is known to hold): exactly ``nbytes``, asked again
    while the answer is cut short, longer than asked (a gateway that ignores the Range header
    sends more: which of its bytes are the range is unknown; it was copied in and failed with a
    raw ValueError) or garbled on the wire, at most ``tries`` answers; then
    ResponseIncompleteError. Other errors (NoSuchKey, the request's typed errors) pass through."""
    for attempt in range(1, tries + 1):
        try:
            data = get()
        except ResponseIncompleteError:
            if attempt == tries:
                raise
            continue
        if len(data) == nbytes:
            return data
    raise _short_answer(url, len(data), nbytes, offset, endpoint, answers=tries)


class _RangeReader:
    """What :func:`distckpt.fill.fill` needs of a reader: ``size`` and ``read_into`` (one ranged
    GET per request); nothing to close."""

    #: A range whose bytes fail their checksum is read once more before the checkpoint is called
    #: damaged (distckpt.fill): an answer can change in transit, a stored object did not.
    reread_on_mismatch = True

    def __init__(self, store: ObjectStore, url: str, size: int) -> None:
        self.store, self.url, self.size = store, url, size
        self.key = store._key(url)

    def read_into(self, requests) -> None:
        for offset, nbytes, dest in requests:
            def get(offset=offset, nbytes=nbytes):
                return self.store._call("get", self.url, "cat_file", self.key, start=offset, end=offset + nbytes,
                                        nbytes=nbytes)
            try:
                # The object holds these bytes when they lie within its size (checked against the
                # MANIFEST when this reader was opened): a short answer is the connection's.
                if offset + nbytes <= self.size:
                    data = _get_whole(get, self.url, nbytes, offset, self.store.endpoint)
                else:
                    data = get()
            except NoSuchKey:
                raise DataFileMissingError(f"data object {_basename(self.url)} disappeared while it was read",
                                           path=self.url) from None
            if len(data) < nbytes:
                raise DataFileTruncatedError(f"data object {_basename(self.url)}: {len(data)} bytes at offset "
                                             f"{offset}, expected {nbytes}", path=self.url, expected=nbytes,
                                             found=len(data))
            dest[:nbytes] = data

    def close(self) -> None:
        pass

    def __enter__(self) -> "_RangeReader":
        return self

    def __exit__(self, *exc_info) -> None:
        pass


class _Upload:
    """One object written by a multipart upload, parts filled in this thread from a pool of
    ``in_flight + 1`` buffers while up to ``in_flight`` of them upload on fsspec's event loop.
    An object of at most one part is one PUT: the upload starts when a full part has more bytes
    after it. Invisible until :meth:`finish`; :meth:`abort` cancels it (the object never appears).

    It is the :class:`distckpt.datafile.Sink` of a data object: every byte is copied into a part
    buffer, so no chunk is ever moved for a zero-copy write (``pad_for`` is ``pad_to``).
    ``size_bound`` (an upper bound of the object's size) only sizes the first buffer."""

    #: Chunk and index starts (a data object is laid out as a local data file would be).
    alignment = ALIGNMENT
    #: Every byte is copied into a part buffer before write_checksummed returns: nothing of a
    #: chunk is referenced after its call, so the pieces are written in their own order.
    hold_min = 0

    def __init__(self, store: ObjectStore, url: str, *, part_size: int, in_flight: int, size_bound: int,
                 rank: int | None) -> None:
        self.store, self.url, self.rank = store, url, rank
        self.fs = store.fs
        self.bucket, self.key, _ = self.fs.split_path(store._key(url))
        self.part_size = part_size
        self.in_flight = in_flight
        self.pool = [bytearray(min(part_size, max(size_bound, 1)))]
        self.buf = self.pool.pop()
        self.fill = 0
        self.written = 0
        self.upload_id: str | None = None
        self.pending: list[tuple[int, concurrent.futures.Future, bytearray]] = []
        self.parts: list[dict] = []

    def _reap(self, block_until: int) -> None:
        """Collect finished parts; wait while more than ``block_until`` are in flight."""
        while self.pending and (len(self.pending) > block_until or self.pending[0][1].done()):
            number, fut, buf = self.pending.pop(0)
            try:
                out = objrequest.wait(fut, timeout_s=objrequest.request_timeout(len(buf)), url=self.url,
                                      operation=f"upload part {number}", rank=self.rank, endpoint=self.store.endpoint)
            except Exception as exc:  # noqa: BLE001 - typed by objrequest; anything else here
                raise translate_error(exc, self.url, self.rank, f"upload part {number}", self.store.endpoint) from exc
            self.parts.append({"PartNumber": number, "ETag": out["ETag"]})
            self.pool.append(buf)

    def _flush_part(self) -> None:
        if self.upload_id is None:
            self.upload_id = self.store._s3("create multipart upload", self.url, "create_multipart_upload",
                                            Bucket=self.bucket, Key=self.key, rank=self.rank)["UploadId"]
        number = len(self.parts) + len(self.pending) + 1
        body = memoryview(self.buf)[:self.fill]
        data = bytes(body) if self.fill < len(self.buf) else self.buf
        call = lambda: self.fs._call_s3("upload_part", Bucket=self.bucket, Key=self.key,  # noqa: E731
                                        PartNumber=number, UploadId=self.upload_id, Body=data)
        fut = objrequest.submit(self.fs.loop, call, url=self.url, operation=f"upload part {number}", rank=self.rank,
                                endpoint=self.store.endpoint, nbytes=len(data))
        self.pending.append((number, fut, self.buf))
        self._reap(self.in_flight)  # at most in_flight parts uploading, one more being filled
        self.buf = self.pool.pop() if self.pool else bytearray(self.part_size)
        self.fill = 0

    def tell(self) -> int:
        return self.written

    def write(self, data) -> int:
        """Copy ``data`` into the part buffers, sending each part that is full and followed by
        more bytes. Returns the new position (after ``data``). Raises the typed errors of a part's upload."""
        view = memoryview(data).cast("B")
        while view.nbytes:
            if self.fill == len(self.buf):
                self._flush_part()
            n = min(len(self.buf) - self.fill, view.nbytes)
            self.buf[self.fill:self.fill + n] = view[:n]
            self.fill += n
            self.written += n
            view = view[n:]
        return self.written

    def write_checksummed(self, data, block: int, hold=None) -> tuple[int, ...]:
        # hold is not needed: the bytes are copied into the part buffer before this returns.
        crcs = mf.block_crcs(data, block)
        self.write(data)
        return crcs

    def pad_to(self, alignment: int) -> int:
        return self.write(bytes(-self.written % alignment))

    def pad_for(self, data, alignment: int) -> int:
        return self.pad_to(alignment)

    def finish(self) -> int:
        """Send the last part and complete the upload (or PUT an object of at most one part);
        the object is visible when this returns. Returns its size."""
        if self.upload_id is None:
            self.store._call("put", self.url, "pipe_file", self.store._key(self.url),
                             bytes(memoryview(self.buf)[:self.fill]), rank=self.rank, nbytes=self.fill)
            return self.written
        if self.fill:
            self._flush_part()
        self._reap(0)
        self.store._s3("complete multipart upload", self.url, "complete_multipart_upload",
                       Bucket=self.bucket, Key=self.key, UploadId=self.upload_id, rank=self.rank,
                       MultipartUpload={"Parts": sorted(self.parts, key=lambda p: p["PartNumber"])})
        self.upload_id = None
        return self.written

    def abort(self) -> None:
        for _, fut, buf in self.pending:
            try:  # each part has its own deadline: this wait is bounded
                objrequest.wait(fut, timeout_s=objrequest.request_timeout(len(buf)), url=self.url,
                                operation="upload part", rank=self.rank, endpoint=self.store.endpoint)
            except Exception:  # noqa: BLE001 - the upload is aborted anyway
                pass
        self.pending.clear()
        if self.upload_id is not None:
            try:
                self.store._s3("abort upload", self.url, "abort_multipart_upload", Bucket=self.bucket, Key=self.key,
                               UploadId=self.upload_id, rank=self.rank)
            except (DistCkptError, NoSuchKey) as exc:  # the next reclaim aborts it
                log.warning("distckpt: could not abort the upload of %s: %s", self.url, exc)
            self.upload_id = None
