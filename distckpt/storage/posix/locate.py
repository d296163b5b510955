"""Is this path a checkpoint? And if not, what is it?

:func:`check_checkpoint_dir` runs before a MANIFEST is opened (load, read, read_manifest, the CLI's
inspect and verify). When the path is not a committed checkpoint directory it raises the typed
error that names what the path really is and a remedy that works there: an empty directory, a
CheckpointManager root (pass one of its steps), a directory of other checkpoints, a torch.save
file, a path under a regular file, a save's temporary directory. "This checkpoint never finished"
is said only where that is true (data files without a MANIFEST).

It only looks (stat, listdir, the first bytes of a file): never writes, never unpickles, no torch.
"""

from __future__ import annotations

import difflib
import os
import re
import stat

from ...errors import CheckpointIncompleteError, CheckpointNotFoundError
from ...hf import hf_files
from ...manifest import MAGIC, MANIFEST_NAME
from ...sizes import format_bytes
from .. import is_url, normalize_path
from ..roots import holder_error
from .leftovers import TMP_RE, saves_of

__all__ = ["check_checkpoint_dir", "checkpoint_path"]

_DATA_RE = re.compile(r"rank[0-9]{5}\.bin\Z")
# torch.save writes a zip archive (PyTorch >= 1.6) or, with _use_new_zipfile_serialization=False,
# a bare pickle stream (protocol 2..5 start with 0x80 and the protocol number).
_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_MAGICS = tuple(bytes([0x80, p]) for p in range(2, 6))
_TORCH_SUFFIXES = (".pt", ".pth", ".ckpt", ".tar")


def _head(path: str, n: int = 8) -> bytes:
    try:
        # O_NONBLOCK: a FIFO must not block this look (regular files ignore the flag).
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return b""
    try:
        return os.read(fd, n)
    except OSError:
        return b""
    finally:
        os.close(fd)


def _file_under_path(path: str) -> str | None:
    """The nearest ancestor of ``path`` that exists but is not a directory (the ENOTDIR cause)."""
    probe = os.path.dirname(path)
    while probe and probe != os.path.dirname(probe):
        if os.path.lexists(probe):
            return None if os.path.isdir(probe) else probe
        probe = os.path.dirname(probe)
    return None


def _not_found(path: str) -> CheckpointNotFoundError:
    blocker = _file_under_path(path)
    if blocker is not None:
        return CheckpointNotFoundError(
            f"no checkpoint at {path}: {blocker} is a file, not a directory", path=path,
            remedy=f"Check the path: nothing can exist under the file {blocker}.")
    parent, name = os.path.split(path)
    hint = ""
    try:
        close = difflib.get_close_matches(name, os.listdir(parent), n=3, cutoff=0.6)
    except OSError:
        close = []
    if close:
        hint = f"; similar names in {parent}: {', '.join(close)}"
    saves = _interrupted_saves(parent, name)
    if saves is not None:
        return saves
    return CheckpointNotFoundError(f"no checkpoint at {path}: nothing exists there{hint}", path=path)


def _interrupted_saves(parent: str, name: str) -> CheckpointNotFoundError | None:
    """Nothing is at ``parent/name``, but a save to it left (or is writing) ``.NAME.tmp-*``: say
    so, with its size, and how it goes away."""
    saves = saves_of(parent, name)
    if not saves:
        return None
    path = os.path.join(parent, name)
    shown = ", ".join(f"{lo.entry} ({format_bytes(size)})" for lo, size in saves)
    if any(lo.state == "unknown" for lo, _ in saves) and not any(lo.state == "dead" for lo, _ in saves):
        return CheckpointNotFoundError(
            f"no checkpoint at {path}: a save to it left {shown} beside it, and whether that save still runs "
            "cannot be told from this host (its lock names another host)", path=path, found="save of another host",
            remedy="Check that save's host; if it is dead, save again (or reclaim it with "
                   f"distckpt.CheckpointManager({parent!r}).reclaim(other_hosts=True)).")
    if any(lo.state == "alive" for lo, _ in saves):
        return CheckpointNotFoundError(
            f"no checkpoint at {path} yet: a save to it is in progress ({shown} beside it)", path=path,
            found="save in progress", remedy="Wait for that save to finish, or load an older checkpoint.")
    return CheckpointNotFoundError(
        f"no checkpoint at {path}: a save to it was interrupted (killed or crashed) before it committed, "
        f"leaving its temporary directory {shown} beside it; no save to {path} has finished", path=path,
        found="interrupted save",
        remedy=f"Load an older checkpoint, or save again. The next save to {path} deletes the leftover "
               f"(so does distckpt.CheckpointManager({parent!r}).reclaim()); it is never loadable.")


def _is_safetensors(path: str, head: bytes) -> bool:
    """A safetensors file: a u64 little-endian header length, then that many bytes of JSON
    starting with ``{``, all inside the file. Checked before the pickle magic: a header length
    whose first byte is 0x80 (e.g. 640 + 256 k bytes) starts like a pickle stream."""
    if len(head) < 9 or head[8:9] != b"{":
        return False
    try:
        size = os.stat(path).st_size
    except OSError:
        return False
    return 8 + int.from_bytes(head[:8], "little") <= size


def _describe_file(path: str) -> CheckpointNotFoundError | None:
    head = _head(path, 9)
    if head.startswith(MAGIC):
        return None  # a MANIFEST file itself: distckpt.storage.posix.manifests.load_manifest accepts it
    if _is_safetensors(path, head):
        return CheckpointNotFoundError(
            f"{path} is a safetensors file, not a distckpt checkpoint (a distckpt checkpoint is a directory "
            f"holding {MANIFEST_NAME} and rankNNNNN.bin files)", path=path, found="safetensors",
            remedy=f"Pass the directory holding it ({os.path.dirname(path)}): distckpt reads a directory of "
                   "safetensors files (docs/INTEROP.md); or load it with safetensors.torch.load_file.")
    torch_file = head.startswith(_ZIP_MAGIC) or head.startswith(_PICKLE_MAGICS)
    if torch_file:
        what = "a torch.save file" if head.startswith(_ZIP_MAGIC) else "a pickle file (torch.save's legacy format)"
        return CheckpointNotFoundError(
            f"{path} is {what}, not a distckpt checkpoint (a distckpt checkpoint is a directory "
            f"holding {MANIFEST_NAME} and rankNNNNN.bin files)", path=path, found="torch.save",
            remedy=f"Load it with torch.load({path!r}, weights_only=True); to turn it into a distckpt "
                   "checkpoint, pass what that returns to distckpt.save(state, DIRECTORY).")
    return CheckpointNotFoundError(
        f"{path} is a file, not a distckpt checkpoint (a distckpt checkpoint is a directory holding "
        f"{MANIFEST_NAME} and rankNNNNN.bin files)", path=path, found="file",
        remedy="Pass the checkpoint directory that distckpt.save() created.")


def _committed_children(path: str, names: list[str]) -> list[str]:
    out = []
    for name in names:
        if TMP_RE.match(name):
            continue
        child = os.path.join(path, name)
        if os.path.isdir(child) and os.path.isfile(os.path.join(child, MANIFEST_NAME)):
            out.append(name)
    return out


def _describe_dir(path: str) -> Exception | None:
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return None  # let the MANIFEST open report the typed OS error
    if MANIFEST_NAME in names or ".metadata" in names or hf_files(path) is not None:
        # A distckpt checkpoint (its MANIFEST is validated next), a torch.distributed.checkpoint
        # directory or a Hugging Face safetensors one, which distckpt.dcp / distckpt.hf report on.
        return None
    if not names:
        return CheckpointNotFoundError(
            f"{path} is an empty directory: no checkpoint was ever saved here (or its files were deleted)", path=path, found="empty",
            remedy="Pass the directory that distckpt.save() wrote, or the step directory of a "
                   "CheckpointManager root (`distckpt ls ROOT` lists them).")
    held = holder_error(path, _committed_children(path, names), os.path.join)
    if held is not None:
        return held
    if any(_DATA_RE.match(n) for n in names):
        return CheckpointIncompleteError(
            f"{path} holds data files but no {MANIFEST_NAME}: the save that wrote them never "
            f"committed (or {MANIFEST_NAME} was deleted since)", path=path, found="data files without MANIFEST")
    unfinished = [n for n in names if TMP_RE.match(n)]
    if unfinished and len(unfinished) == len(names):
        return CheckpointIncompleteError(
            f"{path} holds only the temporary directories of unfinished saves ({', '.join(unfinished[:3])}): "
            f"no save into it has finished", path=path, found="only unfinished saves",
            remedy="Wait for the running save to finish, or load an older checkpoint; a crashed save's "
                   "directories are reclaimed by the next save or CheckpointManager start.")
    torch_files = [n for n in names if n.endswith(_TORCH_SUFFIXES)]
    shown = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
    remedy = "Pass the checkpoint directory that distckpt.save() created."
    if torch_files:
        which = f"{torch_files[0]} looks like a torch.save file" if len(torch_files) == 1 else \
            f"{', '.join(torch_files[:3])} look like torch.save files"
        remedy = f"{which}: load with torch.load(file, weights_only=True). " + remedy
    return CheckpointNotFoundError(
        f"{path} is not a distckpt checkpoint: it has no {MANIFEST_NAME} (it holds {shown})",
        path=path, found="other files", remedy=remedy)


def checkpoint_path(path: str | os.PathLike) -> str:
    """The canonical path of the checkpoint a reader was given (``storage.normalize_path``), where
    a path to a checkpoint's MANIFEST file (a regular file named MANIFEST that starts with the
    MANIFEST magic) stands for its directory: load, read, verify and inspect accept either, so
    nobody is ever told to move a MANIFEST (which would un-commit the checkpoint). Never raises
    for a path that does not exist (the callers say what is there)."""
    path = normalize_path(path)
    if is_url(path) or os.path.basename(path) != MANIFEST_NAME:
        return path
    try:
        st = os.lstat(path)  # a symlink named MANIFEST is not followed (the MANIFEST open refuses it)
    except OSError:
        return path
    if stat.S_ISREG(st.st_mode) and _head(path).startswith(MAGIC):
        return os.path.dirname(path)
    return path


def check_checkpoint_dir(path: str | os.PathLike) -> None:
    """Raise unless ``path`` looks like a committed checkpoint directory (its MANIFEST is read and
    validated afterwards, by distckpt.manifest).

    Raises:
        CheckpointNotFoundError: nothing at ``path`` (a file in the way is named), an empty
            directory, a CheckpointManager root (its steps are listed), a directory of checkpoints,
            a torch.save file or another file, a directory of other files.
        CheckpointIncompleteError: a save's temporary directory, a directory with data files but
            no MANIFEST, or one holding only unfinished saves.
    """
    path = os.path.abspath(os.fspath(path))
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise _not_found(path) from None
    except NotADirectoryError:
        raise _not_found(path) from None
    except OSError:
        return  # EACCES, ELOOP...: the MANIFEST open reports it as the typed storage error
    if TMP_RE.match(os.path.basename(path)):
        raise CheckpointIncompleteError(f"{path} is the temporary directory of an unfinished save", path=path)
    if stat.S_ISREG(st.st_mode):
        error = _describe_file(path)
    elif stat.S_ISDIR(st.st_mode):
        error = _describe_dir(path)
    else:
        error = None  # a FIFO or device: the MANIFEST open refuses it with its own message
    if error is not None:
        raise error
