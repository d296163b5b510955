"""CRC-32C (Castagnoli), the one checksum of the format: every checksum block of a chunk, every
data file's index and every MANIFEST (docs/FORMAT.md).

``crc32c(data, crc=0) -> int``: the CRC-32C of ``data`` (any C-contiguous bytes-like object)
continuing ``crc``, so ``crc32c(b, crc32c(a)) == crc32c(a + b)``; the value of the Castagnoli CRC
the ``crc32c`` package and iSCSI compute. It is the C core's (csrc/crc32c.c: the SSE4.2 crc32
instruction on three interleaved streams, a table fallback on other CPUs), the same function the
C read pipeline verifies blocks with and the POSIX writer checksums them with, so a checksum has one
implementation. It keeps the GIL for buffers below 32 KiB (releasing it costs as much as the
checksum of 4 KiB) and releases it above. Raises TypeError for an object that is not a contiguous
buffer (a str included) and OverflowError for a ``crc`` that is not a 32-bit unsigned int.
"""

from __future__ import annotations

from ._uring import crc32c

__all__ = ["crc32c"]
