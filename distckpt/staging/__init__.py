"""Staging memory: the host memory a save copies tensors into before writing them.

``pool``: the aligned host arenas of async saves (a snapshot of the state, kept for the next save);
``ring``: the small pinned ring through which a sync save's GPU pieces reach the writer, copied
while other pieces are written. Tensor <-> byte views are :mod:`distckpt.tensorbytes`.
"""
