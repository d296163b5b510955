"""Builds the C core (csrc/*.c -> distckpt._uring). Everything else lives in pyproject.toml.

The extension uses raw io_uring syscalls and needs no system library, so `pip install` works with
only gcc and the Python headers. A build failure is an install failure: no silent pure-Python build.
Files, by object: ring.c (the io_uring layer), writer.c (Writer), reader.c (Reader and its fill
pipeline), fsops.c (statx, renameat2, the page-cache query), module.c (method table, small
bindings, module init), core.c (shared helpers), crc32c.c and rowdigest.c (pure computations).
-fvisibility=hidden: the files share functions with one another, not with the process; the
module exports PyInit__uring alone, as when it was one file of static functions.
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "distckpt._uring",
            sources=[
                "csrc/module.c",
                "csrc/writer.c",
                "csrc/reader.c",
                "csrc/fsops.c",
                "csrc/core.c",
                "csrc/ring.c",
                "csrc/crc32c.c",
                "csrc/rowdigest.c",
            ],
            depends=["csrc/core.h", "csrc/ring.h", "csrc/crc32c.h", "csrc/rowdigest.h"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Werror=implicit-function-declaration", "-fvisibility=hidden"],
        )
    ]
)
