"""Tiered checkpoints: a save commits on each node's private local directory at local disk speed,
then drains to a remote tier (an object store) in the background; a restore reads each data file
from the nearest tier that holds a copy of the same save. docs/TIERS.md.

    from distckpt.tiers import TieredCheckpointManager

One concept per module:
  nodes        which ranks share a local directory (a node) and who leads each
  localcommit  the commit protocol of a save whose directory is per node
  drain        one collective copy of a committed local step to the remote tier, verified
  drainer      the background thread: the queue of steps to drain, retries, states
  load         a load that takes each file from the nearest tier; where each step is
  listing      what each tier holds (``distckpt ls LOCAL --remote URL``; torch-free)
  records      what a local tier records of its remote tier: which tier it drains to, which saves reached it
  owner        one live manager per local and per remote tier (the owner lock and lease)
  peers        data files copied between nodes (replicas, a replaced node's restore), checked on both ends
  verified     a committed data file read front to back with every checksum checked as it passes
  manager      TieredCheckpointManager, which puts them together

The manager is imported on first use (PEP 562), so ``distckpt ls`` (tiers.listing) stays torch-free.
"""

import importlib as _importlib

_LAZY = {"TieredCheckpointManager": ".manager", "TierStatus": ".manager"}

__all__ = ["TieredCheckpointManager", "TierStatus"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'distckpt.tiers' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
