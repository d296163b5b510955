"""Tiered checkpoints (issue #25): a save commits on each node's private local directory at local
disk speed, then drains to a remote object store in the background; a restore reads each data
file from the fastest tier that holds it. One concept per module, e.g. :mod:`distckpt.tiers.nodes`
(which ranks share a local directory, and who leads each node) and
:mod:`distckpt.tiers.localcommit` (the commit protocol of a save whose directory is per node).
"""
