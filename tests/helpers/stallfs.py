"""A FUSE file system whose reads and writes stall on demand: a device that stops answering.

Run as a daemon process (``python -m tests.helpers.stallfs MOUNTPOINT FLAG``): an in-memory file
system (the operations of tests/helpers/powercut_fs.py, never cut) served by several threads. While
the file ``FLAG`` exists (outside the mount), every read() and write() of a file whose path
contains FLAG's text (all files when it is empty; ``TEXT@N``: only at offsets below N,
``TEXT@>N``: only at offsets from N on) waits in this process, as a stuck device or an
unanswering server would: the kernel's request stays in flight and the caller's I/O does not
complete. Removing ``FLAG`` lets them all finish. Metadata, flush
and release are served at once, so a caller that gives up on a stalled request can still close its
files and go on. tests/io/test_io_deadline.py uses it for the C core's completion deadline.
"""

from __future__ import annotations

import os
import sys
import time

from tests.helpers.powercut_fs import PowerCutFS, _fuse_class, image_to_nodes


class StallFS(PowerCutFS):
    def __init__(self, flag: str) -> None:
        super().__init__(image_to_nodes({"d": {}}), None, lambda event: None)
        self.flag = flag

    def init_with_config(self, conn, config) -> None:
        super().init_with_config(conn, config)
        if conn is not None:
            # Room for every request a stalled save keeps in flight (a zero-copy write of 8 MiB is
            # split into many FUSE requests): with the default 12 the kernel makes the next
            # submission itself wait for a free slot, inside io_uring_enter, where no deadline of
            # the caller's can reach it.
            conn.max_background = 4096
            conn.congestion_threshold = 4096

    def _stall(self, path: str, offset: int) -> None:
        while True:
            try:
                with open(self.flag) as f:
                    part, _, below = f.read().partition("@")
            except FileNotFoundError:
                return
            if part not in path:
                return
            if below.startswith(">") and offset < int(below[1:]):
                return
            if below and not below.startswith(">") and offset >= int(below):
                return
            time.sleep(0.02)

    def read(self, path, size, offset, fh):
        self._stall(path, offset)
        return super().read(path, size, offset, fh)

    def write(self, path, data, offset, fh):
        self._stall(path, offset)
        return super().write(path, data, offset, fh)


if __name__ == "__main__":
    mountpoint, flag = sys.argv[1], sys.argv[2]
    # Threads enough for every stalled request and the flush that a caller's close() sends while
    # they stall (libfuse's default of 10 runs out with one stalled zero-copy write).
    _fuse_class()(StallFS(flag), mountpoint, foreground=True, nothreads=False, fsname="distckpt-stall",
                  default_permissions=True, max_threads=1024)
