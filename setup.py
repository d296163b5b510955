"""Builds the C core (csrc/uring.c -> distckpt._uring). Everything else lives in pyproject.toml.

The extension uses raw io_uring syscalls and needs no system library, so `pip install` works with
only gcc and the Python headers. A build failure is an install failure: no silent pure-Python build.
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "distckpt._uring",
            sources=["csrc/uring.c", "csrc/crc32c.c", "csrc/rowdigest.c"],
            depends=["csrc/crc32c.h", "csrc/rowdigest.h"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror=implicit-function-declaration"],
        )
    ]
)
