"""A save's liveness lock on an object store: the lease object and its heartbeat (see :class:`Lease`).
Every write of it is conditional on the ETag its writer last saw; the store it lives in is the
:class:`~distckpt.storage.object.store.ObjectStore` passed to each call."""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
from typing import Any, Callable

from ...errors import CheckpointExistsError, DistCkptError, SaveInProgressError
from ..base import Ownership
from . import request as objrequest
from .errors import NoSuchKey
from .settings import MAX_LEASE_S, settings

log = logging.getLogger("distckpt")


def _longest_wait(lease_s: float) -> float:
    """How long :meth:`Lease.acquire` watches a live-looking lease for it to lapse: twice this
    process's lease, at least a minute, and within 0.8 DISTCKPT_TIMEOUT_S (the other ranks wait
    for the outcome in a collective bounded by it)."""
    from ...config import get_config
    return min(max(2 * lease_s, 60.0), 0.8 * get_config().timeout_s)


class Lease(Ownership):
    """The liveness lock of a save on an object store (flock does not exist there), and a root's
    :class:`~distckpt.storage.base.Ownership` there (ObjectStore.take_ownership).

    An object holding {host, pid, save_id, what, started_unix, renewed_unix, lease_s, beat}. Every
    write of it is conditional on what the writer last saw, so that ownership changes hands
    exactly once and a stalled holder can never overwrite its successor:

      * taken with a conditional create (``If-None-Match: *``);
      * a lease whose renewal is older than ``lease_s`` is dead (its save crashed or is stuck);
        it is broken by overwriting it with ``If-Match: <the ETag read with the dead record>``:
        of several savers that found it dead together, exactly one wins, the others see a live
        lease and get SaveInProgressError (there is no delete-then-create window);
      * renewed by a heartbeat every ``lease_s / 4`` with ``If-Match: <own last ETag>``: a save
        whose lease was taken over learns it (``lost``) and never writes the lease again. The
        heartbeat also stops renewing while a request of this process is stuck past its deadline
        (:func:`distckpt.storage.object.request.in_flight_overdue`), so a stuck save's lease lapses;
      * released with ``DELETE If-Match: <own ETag>``, never deleting another save's lease.

    A write whose answer was lost may still have landed: when a conditional write fails, the
    record there is read back, and one that carries this save's id is this save's own (save ids
    are unique), so its ETag is adopted.

    :meth:`ensure_held` (before a commit) renews once and returns how long the lease is certain to
    stay valid: the MANIFEST's PUT is sent only with a deadline inside that window, so it cannot
    land after another save may have broken the lease and reclaimed this save's data.

    Without conditional writes (DISTCKPT_OBJECT_CONDITIONAL=0) each conditional write is emulated
    by reading the ETag just before writing, which narrows the races to that gap but cannot close
    them (docs/OBJECT_STORES.md).
    """

    def __init__(self, store: Any, url: str, record: dict, etag: str | None) -> None:
        self.store, self.url, self.record, self.etag = store, url, record, etag
        self.lost: dict | None = None     # the record found when this lease turned out taken over
        self.missed: BaseException | None = None  # why the last renewal failed (None after a success)
        self.proven = time.monotonic()    # when the last write that proved ownership was sent
        self._lock = threading.Lock()     # one write of the lease at a time (heartbeat vs commit)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="distckpt-lease", daemon=True)

    # -- reading ----------------------------------------------------------------------------------

    @staticmethod
    def _parse(data: bytes) -> dict:
        try:
            rec = json.loads(data)
            return rec if isinstance(rec, dict) else {}
        except ValueError:
            return {}

    @staticmethod
    def read(store: Any, url: str) -> dict | None:
        """The record of the lease at ``url`` ({} when unreadable), or None when there is none."""
        return Lease.read_aged(store, url)[0]

    @staticmethod
    def read_versioned(store: Any, url: str) -> tuple[dict | None, str | None]:
        """(record, ETag) of the lease at ``url`` from one GET, or (None, None)."""
        return Lease.read_aged(store, url)[:2]

    @staticmethod
    def read_aged(store: Any, url: str) -> tuple[dict | None, str | None, float | None, float | None]:
        """(record, ETag, seconds since its last write by the server's clock, the server's time;
        the last two None when the server does not say) of the lease at ``url`` from one GET, or
        (None, None, None, None). Each renewal rewrites the object, so that age is the time since
        the last renewal, whatever the clocks of the writer and of this host say (:meth:`is_live`)."""
        got = store._get_with_etag(url, 1 << 16, too_large_empty=True)
        return (None, None, None, None) if got is None else (Lease._parse(got[0]), got[1], got[2], got[3])

    @staticmethod
    def is_live(rec: dict, now: float | None = None, *, age_s: float | None = None,
                server_now: float | None = None) -> bool:
        """Whether the lease record ``rec`` names a save that renewed it within its ``lease_s``,
        by this clock (``now``, default the time, less the record's ``renewed_unix``) or by the
        server's (``age_s``: the object's age by the server's clock, :meth:`read_aged`, whose
        dates have whole seconds; ``server_now``: the server's time). Live when either says so:
        a host whose clock ran more than a lease ahead of the writer's judged a renewed lease dead
        by its own clock (and took it over, or reclaimed the live save's data), and the server's
        whole seconds can make a one-second lease look lapsed right after a renewal.

        A record no distckpt writer makes counts as dead (its lease can be broken): a save id that
        is not a string, a time or lease that is not a finite number, a lease longer than
        :data:`MAX_LEASE_S`, or a renewal more than :data:`MAX_LEASE_S` from this clock (ahead)
        or from the server's (either way: no skew between hosts is that large; a writer's clock a
        little ahead only keeps its lease live a little longer, as it always did). Such a record,
        crafted or damaged, would otherwise block every save and drain to the root for ever."""
        if not isinstance(rec.get("save_id"), str):
            return False
        try:
            renewed, lease = float(rec["renewed_unix"]), float(rec["lease_s"])
        except (KeyError, TypeError, ValueError):
            return False
        if not (math.isfinite(renewed) and math.isfinite(lease)) or not 0 < lease <= MAX_LEASE_S:
            return False
        age = (now or time.time()) - renewed
        if -MAX_LEASE_S < age < lease:
            return True
        return (age_s is not None and math.isfinite(age_s) and -MAX_LEASE_S < age_s < lease
                and server_now is not None and abs(server_now - renewed) < MAX_LEASE_S)

    # -- conditional writes -----------------------------------------------------------------------

    @staticmethod
    def _put(store: Any, url: str, record: dict, *, match: str | None, operation: str, rank: int | None,
             timeout_s: float | None = None) -> str | None:
        """Write ``record`` at ``url`` if the object there is in the state the writer saw:
        absent (``match`` None) or with ETag ``match``. Returns the new ETag.

        Raises:
            CheckpointExistsError: the object there is not what the writer saw.
        """
        bucket, key, _ = store.fs.split_path(store._key(url))
        body = json.dumps(record).encode()
        cond = {"IfNoneMatch": "*"} if match is None else {"IfMatch": match}
        if not settings()["conditional"]:
            _, now_etag = Lease.read_versioned(store, url)
            if now_etag != match:
                raise CheckpointExistsError(f"{operation}: {url} changed since it was read", path=url, rank=rank)
            cond = {}
        out = store._s3(operation, url, "put_object", Bucket=bucket, Key=key, Body=body, rank=rank,
                        conditional=True, nbytes=len(body), timeout_s=timeout_s, **cond)
        return out.get("ETag")

    # -- taking, renewing, releasing --------------------------------------------------------------

    @classmethod
    def acquire(cls, store: Any, url: str, *, save_id: str, what: str, rank: int, extra: Any = None,
                holder_dead: Callable[[dict], bool] | None = None, wait_out: bool = False) -> "Lease":
        """Take the lease at ``url``, breaking a dead one. ``extra`` fields join the record.
        ``holder_dead(record)``: True when the caller can prove the holder of a live-looking
        lease gone (its lease is then broken at once). ``wait_out``: rather than refuse a live
        lease, watch it (:meth:`_watch`, at most :func:`_longest_wait`): one that lapses is
        broken, one that is renewed is refused, as is one whose lease is longer than the wait.

        Raises:
            SaveInProgressError: a live lease of another save is there (or others kept taking it).
            EndpointUnreachableError and the other typed errors of a request.
        """
        lease_s = settings()["lease_s"]
        waited, unreadable = False, 0   # unreadable: creates refused with no record to read there
        for _attempt in range(4):
            now = time.time()
            record = {**(extra or {}), "host": socket.gethostname(), "pid": os.getpid(), "save_id": save_id,
                      "what": what, "started_unix": now, "renewed_unix": now, "lease_s": lease_s, "beat": 0}
            sent = time.monotonic()
            try:
                etag = cls._put(store, url, record, match=None, operation="create the save lease", rank=rank)
                return cls(store, url, record, etag)._started(sent)
            except CheckpointExistsError:
                pass
            other, other_etag, age, clock = cls.read_aged(store, url)
            if other is not None and other.get("save_id") == save_id:  # our create landed; its answer was lost
                return cls(store, url, record, other_etag)._started(sent)
            if other is None:
                unreadable += 1
                continue  # released in between: create again
            live = cls.is_live(other, age_s=age, server_now=clock)
            if live and holder_dead is not None and holder_dead(other):
                log.warning("distckpt: taking over the lease %s at once: its holder is gone (%s)", url, other)
            elif live:
                seen = ""  # what _watch saw of this very record ("" when it did not watch it)
                if wait_out and not waited:
                    waited = True
                    seen = cls._watch(store, url, other_etag, other, _longest_wait(lease_s))
                    if seen == "gone":
                        continue  # released meanwhile: create again
                if seen != "lapsed":
                    if seen:
                        other, _, age, _ = cls.read_aged(store, url)
                        other = other or {}
                    try:
                        ago = f"{age if age is not None else time.time() - float(other['renewed_unix']):.0f} s ago"
                    except (KeyError, TypeError, ValueError):
                        ago = "at an unknown time"
                    waited_text = ("" if not seen else
                                   "; it was renewed while this process watched it" if seen == "renewed" else
                                   f"; its lease ({other.get('lease_s')} s) is longer than the "
                                   f"{_longest_wait(lease_s):.0f} s this process waits for one to lapse (if its "
                                   f"holder is dead, delete {url})")
                    raise SaveInProgressError(
                        f"another save holds {url} (save {other.get('save_id')} of {other.get('what')}, host "
                        f"{other.get('host')} pid {other.get('pid')}, renewed {ago}){waited_text}", path=what,
                        rank=rank, owner=other)
                log.warning("distckpt: breaking the save lease %s: not renewed within its lease while this process "
                            "watched it (%s)", url, other)
            else:
                log.warning("distckpt: breaking the dead save lease %s (%s)", url, other)
            sent = time.monotonic()
            try:
                etag = cls._put(store, url, record, match=other_etag, operation="take over the dead save lease",
                                rank=rank)
                return cls(store, url, record, etag)._started(sent)
            except CheckpointExistsError:
                mine, mine_etag = cls.read_versioned(store, url)
                if mine is not None and mine.get("save_id") == save_id:
                    return cls(store, url, record, mine_etag)._started(sent)
                # another saver broke it first (or its owner renewed it): look again
        if unreadable == 4:
            # Never a lease: each create was refused, yet no record could be read there.
            raise CheckpointExistsError(
                f"could not take the lease {url}: its conditional create is refused, but no lease record is there "
                f"to read: something else stands at that name (objects under {url}/, on a server that keeps "
                f"directories?)", path=url, rank=rank,
                remedy=f"Remove what is at {url} (distckpt writes only a small JSON object there).")
        raise SaveInProgressError(f"could not take the save lease {url}: another save keeps taking it", path=what,
                                  rank=rank, owner=None)

    @classmethod
    def _watch(cls, store: Any, url: str, etag: str | None, record: dict, longest_s: float) -> str:
        """Watch the live-looking lease at ``url`` (read as ``record`` with ETag ``etag``) for at
        most ``longest_s``: ``gone`` (deleted), ``renewed`` (rewritten: its holder lives),
        ``lapsed`` (judged dead by :meth:`is_live`, or left unchanged for its whole ``lease_s``
        as this process's own clock counts it: a holder that renewed within its lease would
        have rewritten it, whatever the clocks of its host and of the server say), ``outlived``
        (its lease is longer than the wait)."""
        lease = float(record["lease_s"])  # is_live checked it: a finite number, at most MAX_LEASE_S
        limit = min(lease, longest_s)
        start = time.monotonic()
        while True:
            watched = time.monotonic() - start  # before the read: unchanged at least this long
            rec, now_etag, age, clock = cls.read_aged(store, url)
            if rec is None:
                return "gone"
            if now_etag != etag:
                return "renewed"
            if not cls.is_live(rec, age_s=age, server_now=clock):
                return "lapsed"
            if watched >= limit:
                return "lapsed" if lease <= longest_s else "outlived"
            time.sleep(max(0.0, min(1.0, max(0.05, lease / 16), limit - watched)))

    def gone(self) -> bool:
        return self.lost is not None or self._stop.is_set()

    def check(self, operation: str) -> None:
        """:meth:`ensure_held`, for an owner lease: raises SaveInProgressError naming ``operation``
        when it was released or taken over; when the renewal's request failed, that request's
        typed error (EndpointUnreachableError, ObjectStoreAccessError, ...): the cause to act on."""
        if self._stop.is_set():
            raise SaveInProgressError(f"{operation}: the lease {self.url} was released", path=self.url, rank=0,
                                      owner=None, remedy="Nothing more was changed; start the manager again.")
        try:
            self.ensure_held()
        except SaveInProgressError as exc:
            if self.lost is None and isinstance(self.missed, DistCkptError):
                raise self.missed from exc
            raise SaveInProgressError(f"{operation}: {exc.message}", path=self.url, rank=0, owner=self.lost,
                                      remedy="Nothing more was changed.") from None

    def _started(self, sent: float) -> "Lease":
        self.proven = sent
        self._thread.start()
        return self

    def renew(self, timeout_s: float | None = None) -> bool:
        """One conditional renewal. True when it proved ownership; False after a missed beat (an
        error, or a request of this process stuck past its deadline: the lease is then left to
        lapse) or when the lease was taken over (``lost`` says by whom). Never raises."""
        with self._lock:
            if self.lost is not None:
                return False
            overdue = objrequest.in_flight_overdue()
            if overdue > 0:
                log.warning("distckpt: not renewing the save lease %s: a request of this save is stuck %.0f s past its "
                            "deadline", self.url, overdue)
                return False
            record = {**self.record, "renewed_unix": time.time(), "beat": int(self.record.get("beat", 0)) + 1}
            sent = time.monotonic()
            try:
                try:
                    self.etag = self._put(self.store, self.url, record, match=self.etag, operation="renew the save lease",
                                          rank=0, timeout_s=timeout_s)
                except CheckpointExistsError:
                    there, etag = self.read_versioned(self.store, self.url)
                    if there is None or there.get("save_id") != self.record["save_id"]:
                        self.lost = there or {}
                        log.error("distckpt: the save lease %s was taken over by %s; this save changes nothing more "
                                  "there (no commit; no rotation, if it already committed)",
                                  self.url, there or "nobody (the lease object was deleted)")
                        return False
                    # Our previous write landed but its answer was lost: adopt it and write again.
                    self.etag = self._put(self.store, self.url, record, match=etag, operation="renew the save lease",
                                          rank=0, timeout_s=timeout_s)
            except (DistCkptError, NoSuchKey) as exc:  # a missed beat; the lease lasts 4 periods
                log.warning("distckpt: could not renew the save lease %s: %s", self.url, exc)
                self.missed = exc
                return False
            self.record, self.proven, self.missed = record, sent, None
            return True

    def ensure_held(self) -> float:
        """Prove this save still holds the lease (one conditional renewal) and return the seconds
        it is certain to stay valid: ``3/4 lease_s`` from when that renewal was sent (a quarter of
        the lease is left for clock differences between hosts), less the time since.

        Raises:
            SaveInProgressError: the lease was taken over, or it could not be renewed.
        """
        lease_s = float(self.record["lease_s"])
        if not self.renew(timeout_s=lease_s / 4):
            owner = self.lost
            why = ((f"it is now held by {owner}" if owner else "its object was deleted") if owner is not None
                   else "it could not be renewed (see the warning above)")
            raise SaveInProgressError(
                f"this save cannot prove it still holds its lease {self.url}: {why}", path=self.url,
                rank=0, owner=owner,
                remedy="Nothing was committed. Raise DISTCKPT_OBJECT_LEASE_S if saves stall that long, or check "
                       "the endpoint.")
        return 0.75 * lease_s - (time.monotonic() - self.proven)

    def _beat(self) -> None:
        period = self.record["lease_s"] / 4
        while not self._stop.wait(period):
            self.renew(timeout_s=period)
            if self.lost is not None:
                return

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still ours. Never raises; bounded by the
        request deadlines."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.lost is not None:
            return
        bucket, key, _ = self.store.fs.split_path(self.store._key(self.url))
        try:
            there, etag = self.read_versioned(self.store, self.url)
            if there is None or there.get("save_id") != self.record["save_id"]:
                return  # not ours (any more): never delete another save's lease
            cond = {"IfMatch": etag} if settings()["conditional"] and etag else {}
            self.store._s3("release the save lease", self.url, "delete_object", Bucket=bucket, Key=key, rank=0,
                           conditional=True, **cond)
        except CheckpointExistsError:
            pass  # it changed between the read and the delete: someone else's now
        except (DistCkptError, NoSuchKey) as exc:  # it expires on its own
            log.warning("distckpt: could not remove the save lease %s: %s", self.url, exc)
