"""PosixStore: the :class:`distckpt.storage.Store` of local file systems.

It adds no behaviour: every method is the call sequence the POSIX commit protocol has always
made (tmp dir + save lock in PREPARE, an O_DIRECT data file per rank, MANIFEST written and fsynced
inside the tmp dir, one rename / RENAME_EXCHANGE, parent fsync), so its syscalls are exactly
those the crash tests enumerate. What a rank writes and rank 0 prepares is in
:mod:`distckpt.storage.posix.saving`, the save locks in :mod:`distckpt.storage.posix.savelock`.
"""

from __future__ import annotations

import os
from typing import Any

from ... import manifest as mf
from .. import Store
from . import commit as local
from . import saving

__all__ = ["PosixStore"]


class PosixStore(Store):
    kind = "posix"

    def prepare(self, final: str, save_id: str, overwrite: bool, needed: int, rank: int,
                lock_path: str | None) -> tuple[str, Any]:
        return saving.prepare_save_dir(final, save_id, overwrite, needed, rank, lock_path)

    def write_rank(self, area: str, rank: int, pieces: list, checksum_block: int) -> tuple:
        records, size, choice = saving.write_rank_file(os.path.join(area, mf.data_file_name(rank)), rank, pieces,
                                                       checksum_block)
        return records, size, choice.name, choice.reason

    def publish(self, area: str, final: str, manifest: bytes, overwrite: bool) -> str | None:
        local.write_file_durable(os.path.join(area, mf.MANIFEST_NAME), manifest)
        return local.publish_dir(area, final, overwrite=overwrite)

    def discard(self, replaced: str) -> None:
        local.delete_tree(replaced)

    def abort(self, area: str, world: int) -> None:
        # Every name a save puts in its tmp dir, so an abort can remove it without an fd (EMFILE).
        local.delete_tree(area, names=[mf.MANIFEST_NAME] + [mf.data_file_name(r) for r in range(world)])

    def load_manifest(self, path: str) -> "mf.Manifest":
        return mf.load_manifest(path)

    def read_index(self, path: str, header: "mf.Manifest", i: int) -> bytes:
        return mf.read_local_index(path, header.files[i])

    def committed_save_id(self, final: str) -> str | None:
        return mf.load_manifest_header(final).save_id

    def save_id_of_area(self, area: str) -> str:
        return os.path.basename(area).rsplit("tmp-", 1)[-1]
