"""The remote tier's owner: one live TieredCheckpointManager per remote root.

Two jobs draining into one remote root see each other's steps: each one's ``keep_last_remote``
rotation counts the other's, and deletes durable steps of a job that already rotated its local
copies away. So rank 0 of a manager holds the remote root's owner (``REMOTE/.distckpt-tiers.owner``,
:meth:`distckpt.storage.base.Store.take_ownership`: a flock on a directory, a renewed lease on an
object store) from construction to ``close()``, and proves it still holds it before each drain
prepares, before it publishes, and before each write of the rotation that follows
(:meth:`RemoteOwner.hold`). A closed manager never takes it again.

A second job is refused (SaveInProgressError) while the owner lives. A restarted job must not
wait for its own dead predecessor: a flock is free at once, but an object-store lease lives on
for DISTCKPT_OBJECT_LEASE_S after its holder died. The lease is taken over at once when the
restart can prove its holder dead: each manager records its owner id in its rank 0's node's local
tier (``LOCAL/.distckpt-tiers.remote-owner``), and a lease whose holder ran on a node of this job
(same host and local root) that recorded that very id is dead, because that node's leader holds
the node's local owner flock now (``LOCAL/.distckpt-tiers.owner``), which the holder held for as
long as it held the lease. Any other live lease (a job moved to new hosts, or another job) is
watched: taken over once it stays unchanged for its whole lease, refused once it is renewed
(:meth:`distckpt.storage.object.lease.Lease.acquire`).
"""

from __future__ import annotations

import logging
import threading
import uuid

from .._dist import ControlGroup
from ..errors import SaveInProgressError
from ..storage import Ownership, Store, join
from ..storage.posix.savelock import this_host
from .nodes import NodeLayout

__all__ = ["OWNER_NAME", "OWNER_RECORD_NAME", "RemoteOwner"]

#: The owner lock of a tier's root: the local tier's flock (each node's leader) and the remote
#: tier's flock or lease (rank 0). Not named like a save's lock (``.NAME.lock``), so listings and
#: reclaims never take it for one.
OWNER_NAME = ".distckpt-tiers.owner"
#: In a node's local tier: the owner id of the last manager whose rank 0 ran on this node.
OWNER_RECORD_NAME = ".distckpt-tiers.remote-owner"

log = logging.getLogger("distckpt")


class RemoteOwner:
    """Rank 0's hold on the remote tier's owner (every rank builds one; only rank 0's acts).

    Built collectively (:meth:`_gather`: every node's leader tells where it runs and which owner
    id its node recorded). :meth:`take` and :meth:`hold` run on rank 0 alone, inside a step
    whose outcome the caller shares with the other ranks."""

    def __init__(self, group: ControlGroup, layout: NodeLayout, local_store: Store, local_root: str,
                 remote_store: Store, remote_root: str) -> None:
        self._local_store, self._local_root = local_store, local_root
        self._remote_store, self._remote_root = remote_store, remote_root
        self.owner_id = uuid.uuid4().hex  # one per manager: a lost answer to its own create is recognised
        self._held: Ownership | None = None
        self._closed = False  # released for good (the manager closed): never taken again
        self._lock = threading.Lock()  # _held and _closed: the drain thread takes, close releases
        self._nodes: list[dict] = []
        self._gather(group, layout)

    def _gather(self, group: ControlGroup, layout: NodeLayout) -> None:
        """Collective: every rank learns each node's (host, local root, recorded owner id)."""
        mine = None
        if layout.is_leader:
            try:
                text = self._local_store.read_pointer(join(self._local_root, OWNER_RECORD_NAME))
            except Exception as exc:  # noqa: BLE001 - the record only spares a restart the wait
                log.warning("distckpt: cannot read %s (%s: %s): a lease this node's last manager left on the remote "
                            "tier is waited out", join(self._local_root, OWNER_RECORD_NAME), type(exc).__name__, exc)
                text = None
            mine = {"host": this_host(), "local_root": self._local_root, "owner": (text or "").strip() or None}
        self._nodes = [g for g in group.all_gather(mine) if g is not None]

    def _holder_dead(self, record: dict) -> bool:
        """Whether the holder of the live-looking lease ``record`` is provably gone (module
        docstring): it ran on a node of this job that recorded its id."""
        return any(n["owner"] is not None and n["owner"] == record.get("save_id") and n["host"] == record.get("host")
                   and n["local_root"] == record.get("local_root") for n in self._nodes)

    def take(self) -> None:
        """Rank 0: take the remote tier's owner (a no-op while held) and record its id in this
        node's local tier.

        Raises:
            SaveInProgressError: another live manager owns the remote tier (``owner``: its record).
            The stores' typed errors.
        """
        if self._held is not None:
            return
        if self._closed:
            # A drain thread a close left behind (inside a held request) must not take the tier
            # after close released it: nothing would ever release it again.
            raise self._closed_error()
        path = join(self._remote_root, OWNER_NAME)
        self._remote_store.make_root(self._remote_root)  # a new tier (the pairing check passed before)
        try:
            held = self._remote_store.take_ownership(
                path, owner_id=self.owner_id, what=f"TieredCheckpointManager({self._local_root} -> {self._remote_root})",
                extra={"local_root": self._local_root}, holder_dead=self._holder_dead)
        except SaveInProgressError as exc:
            other = exc.details.get("owner") or {}
            raise SaveInProgressError(
                f"another TieredCheckpointManager owns the remote tier {self._remote_root}: {other.get('what', '?')} "
                f"(host {other.get('host', '?')}, pid {other.get('pid', '?')}); two jobs draining into one remote "
                f"root would rotate away each other's steps", path=self._remote_root, owner=other,
                remedy="Give each job its own remote root, or close the other manager first.") from exc
        with self._lock:
            closed = self._closed
            if not closed:
                try:
                    self._local_store.replace_pointer(join(self._local_root, OWNER_RECORD_NAME),
                                                      f"{self.owner_id}\n".encode())
                except BaseException:
                    held.release()
                    raise
                self._held = held
        if closed:  # closed while this thread waited for the tier
            held.release()
            raise self._closed_error()

    def hold(self, operation: str) -> None:
        """Rank 0, before ``operation`` changes the remote tier: prove this manager owns it,
        taking the owner first when it has none (the remote tier did not answer at
        construction, or another manager took it over since).

        Raises:
            SaveInProgressError: another live manager owns it, it was taken over, or it could not
                be proven held (an object store that did not answer): retried by the drain.
            The stores' typed errors.
        """
        self.take()
        with self._lock:
            held = self._held
        if held is None:  # released by close meanwhile
            raise self._closed_error()
        try:
            held.check(operation)
        except SaveInProgressError as exc:
            if held.gone():
                log.error("distckpt: this manager no longer owns the remote tier %s (%s): its drains wait until it "
                          "owns it again", self._remote_root, exc)
                with self._lock:
                    if self._held is held:
                        self._held = None
                held.release()
            raise

    def _closed_error(self) -> SaveInProgressError:
        return SaveInProgressError(f"this TieredCheckpointManager was closed: it no longer takes or holds the "
                                   f"remote tier {self._remote_root}", path=self._remote_root, owner=None,
                                   remedy="Nothing more was changed.")

    def release(self) -> None:
        """Give the owner up for good (a no-op on other ranks and when not held): :meth:`take`
        and :meth:`hold` refuse from then on. Never raises."""
        with self._lock:
            self._closed = True
            held, self._held = self._held, None
        if held is not None:
            held.release()
