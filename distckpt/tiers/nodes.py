"""Which ranks form a node of the local tier, and who leads each node.

A *node* is the set of ranks that see the same local directory: the same host
(``socket.gethostname()``) and the same directory (``st_dev``, ``st_ino`` of the local root, after
it is created). Two ranks on one host with different local roots are two nodes (that is how the
tests simulate several machines); a path that reaches the same directory through a symlink is
the same node. Nodes are numbered in the order of their lowest rank, and that lowest rank is the
node's *leader*: it prepares, publishes and rotates the node's directory
(:mod:`distckpt.tiers.localcommit`).
"""

from __future__ import annotations

import dataclasses
import os
import socket

from .._dist import ControlGroup, _portable
from ..errors import ConfigError, from_os_error
from ..storage import is_url, normalize_path, open_store

__all__ = ["NodeLayout", "node_layout"]


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """The nodes of a group, as every rank of it holds them (the same on every rank but ``rank``).

    ``node_of[r]``: the node index of group rank r; ``leaders[n]``: the lowest rank of node n.
    Nodes are numbered by their lowest rank, so ``leaders`` is increasing and ``leaders[0] == 0``.
    """

    rank: int
    node_of: tuple[int, ...]
    leaders: tuple[int, ...]

    @property
    def node(self) -> int:
        """This rank's node."""
        return self.node_of[self.rank]

    @property
    def is_leader(self) -> bool:
        """True on the lowest rank of its node (the one that prepares and publishes it)."""
        return self.leaders[self.node] == self.rank

    def ranks_of(self, node: int) -> list[int]:
        """The group ranks of ``node``, increasing."""
        return [r for r, n in enumerate(self.node_of) if n == node]


def node_layout(group: ControlGroup, local_root: str) -> NodeLayout:
    """The nodes of ``group``, found by where each rank's ``local_root`` lives. Collective: every
    rank of ``group`` calls it with its own local root (one all-gather, bounded by the group's
    DISTCKPT_TIMEOUT_S). Creates ``local_root`` (and its parents, durably) when missing.

    Raises (on every rank, the same class: errors.collective_error):
        ConfigError: ``local_root`` is a URL (the local tier is a local directory).
        StorageError subclasses: creating or reading ``local_root`` failed (permissions, ...).
        PeerLostError: a peer died or did not answer within DISTCKPT_TIMEOUT_S.
    """
    key, error = None, None
    try:
        key = _node_key(local_root)
    except Exception as exc:  # reported by every rank below, so no rank waits for a missing peer
        error = exc
    # Each rank needs every rank's key to number the nodes: an all-gather of a few small tuples.
    reports = group.all_gather((key, None) if error is None else (None, _portable(error)))
    group.raise_failures([e for _, e in reports], error, operation="node_layout")
    numbers: dict[tuple, int] = {}
    leaders: list[int] = []
    node_of = []
    for r, (k, _) in enumerate(reports):
        if k not in numbers:  # ranks in increasing order: the first rank met is the lowest
            numbers[k] = len(leaders)
            leaders.append(r)
        node_of.append(numbers[k])
    return NodeLayout(rank=group.rank, node_of=tuple(node_of), leaders=tuple(leaders))


def _node_key(local_root: str) -> tuple[str, int, int]:
    """(host name, st_dev, st_ino) of ``local_root``, created first when missing."""
    if is_url(local_root):
        raise ConfigError(f"the local tier must be a local directory, not the URL {local_root}", path=local_root,
                          remedy="Pass each node's own local directory (e.g. /nvme/ckpt/run7) as the local tier.")
    path = normalize_path(local_root)
    open_store(path).make_root(path)
    try:
        st = os.stat(path)  # follows symlinks: two paths to one directory are one node
    except OSError as exc:
        raise from_os_error(exc, path=path, operation="stat") from exc
    return socket.gethostname(), st.st_dev, st.st_ino
