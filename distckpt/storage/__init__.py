"""Storage back ends.

``posix`` is the local fast path: data files through per-rank O_DIRECT io_uring writers, and a
commit made of directory operations (tmp dir, fsync, rename; see :mod:`distckpt.storage.posix.commit`).
"""
