"""A FUSE file system that forgets what was not made durable: power cuts for the crash tests.

Run as a daemon process (``python -m tests.helpers.powercut_fs MOUNTPOINT``), driven by one JSON command
per line on stdin, answering one JSON line per event on stdout (tests/helpers/powercut.py drives it).
It is a real file system to the code under test: every open, write, fsync, rename goes through the
kernel's FUSE driver to this process (single-threaded, in arrival order; no kernel write-back
cache, so each write() reaches it before the syscall returns; lookups and attributes are never
cached, so a remount shows only what the image holds).

The model ("power loss drops every write that no fsync covered"), per object:
  * a file's *data* (and size) is durable once the file is fsynced (fsync or fdatasync); until
    then a cut leaves what the last fsync saw (nothing, for a new file);
  * a directory's *entries* (names -> objects: creations, renames in and out, unlinks, mkdir,
    rmdir) are durable once that directory is fsynced; a rename within one directory is persisted
    atomically by that fsync; a name whose directory was never fsynced since it appeared is lost.
The contents live in this process's memory, the "disk" (durable) and the "page cache" (current)
side by side. At a cut the daemon freezes (every later operation fails with EIO, so nothing more
can become durable) and derives three images of what a restart may find:
  * ``strict``: durable entries and durable data only (POSIX's minimum; the model above);
  * ``meta``: every namespace operation up to the cut persisted, in order, but no unsynced data
    (a journaling file system that committed its metadata without the data: ext4 data=writeback,
    or delayed allocation: a renamed file that was never fsynced comes back empty);
  * ``all``: everything up to the cut persisted (the journal committed just before the cut).
Real ext4 (data=ordered) is more forgiving than ``strict`` (its journal commits every few seconds
and, on fsync of a file, persists the new file's directory entry too; auto_da_alloc flushes data
on rename-over) and never worse than ``meta`` for metadata order; a checkpoint that survives all
three models survives it.

Operations counted as cut points (``op`` numbers, 1-based): create, mkdir, write, truncate,
fallocate, fsync, fsyncdir, rename, unlink, rmdir. ``cut_after: N`` applies operations 1..N and
freezes on the next one. Images are kept in memory by name and served by later mounts.

Commands: {"cmd": "seed", "dir": PATH, "image": NAME} loads a real directory tree as an image;
{"cmd": "mount", "image": NAME, "cut_after": N|null} mounts it (answers {"event": "mounted"}; a
cut answers {"event": "cut", "op": N}); unmounting (fusermount3 -u) answers {"event": "unmounted",
"ops": [[kind, path], ...], "images": {model: {"name", "fp"}}} where the images are the cut's, or,
with no cut, those of a cut after the last operation; {"cmd": "drop", "prefix": P} forgets images;
{"cmd": "dump", "image": NAME, "dir": PATH} writes one out as a directory tree; {"cmd": "quit"}.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import sys
import time

MODELS = ("strict", "meta", "all")
_COUNTED = ("create", "mkdir", "write", "truncate", "fallocate", "fsync", "fsyncdir", "rename",
            "unlink", "rmdir")
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
FUSE_CAP_WRITEBACK_CACHE = 1 << 16


class Node:
    """An object of the current state, with what of it is durable."""

    __slots__ = ("kind", "mode", "data", "entries", "synced_data", "synced_entries", "mtime", "ino")
    _next_ino = 2

    def __init__(self, kind: str, mode: int) -> None:
        self.kind = kind  # "f" or "d"
        self.mode = mode
        self.data = bytearray() if kind == "f" else None
        self.entries: dict[str, Node] | None = {} if kind == "d" else None
        self.synced_data: bytes | None = None        # file content at its last fsync
        self.synced_entries: dict[str, Node] | None = None  # directory entries at its last fsync
        self.mtime = time.time()
        self.ino = Node._next_ino
        Node._next_ino += 1


# An image is what a (re)mount serves: {"d": {name: image}} or {"f": bytes}; immutable.
def image_to_nodes(img: dict) -> Node:
    """Build a fully durable tree from an image (what is on the disk after a restart)."""
    if "f" in img:
        n = Node("f", 0o644)
        n.data = bytearray(img["f"])
        n.synced_data = img["f"]
        return n
    n = Node("d", 0o755)
    n.entries = {name: image_to_nodes(child) for name, child in img["d"].items()}
    n.synced_entries = dict(n.entries)
    return n


def nodes_to_image(n: Node, model: str) -> dict:
    """What a restart finds of the tree under ``n`` after a cut, under ``model``."""
    if n.kind == "f":
        if model == "all":
            return {"f": bytes(n.data)}
        return {"f": n.synced_data if n.synced_data is not None else b""}
    entries = n.entries if model in ("meta", "all") else (n.synced_entries or {})
    return {"d": {name: nodes_to_image(child, model) for name, child in entries.items()}}


def fingerprint(img: dict) -> str:
    h = hashlib.sha1()
    def walk(i, path):
        if "f" in i:
            h.update(f"F{path}\0{len(i['f'])}\0".encode())
            h.update(hashlib.sha1(i["f"]).digest())
        else:
            h.update(f"D{path}\0".encode())
            for name in sorted(i["d"]):
                walk(i["d"][name], f"{path}/{name}")
    walk(img, "")
    return h.hexdigest()


def image_from_dir(path: str) -> dict:
    if os.path.isdir(path) and not os.path.islink(path):
        return {"d": {name: image_from_dir(os.path.join(path, name)) for name in os.listdir(path)}}
    with open(path, "rb") as f:
        return {"f": f.read()}


def image_to_dir(img: dict, path: str) -> None:
    if "f" in img:
        with open(path, "wb") as f:
            f.write(img["f"])
        return
    os.makedirs(path, exist_ok=True)
    for name, child in img["d"].items():
        image_to_dir(child, os.path.join(path, name))


def _err(code: int) -> OSError:
    return OSError(code, os.strerror(code))


class PowerCutFS:
    """The mfusepy operations. ``cut_after``: freeze on operation cut_after+1 (None: never)."""

    use_ns = True

    def __init__(self, root: Node, cut_after: int | None, events) -> None:
        self.root = root
        self.cut_after = cut_after
        self.events = events
        self.ops: list[tuple[str, str]] = []
        self.frozen = False
        self.cut_images: dict[str, dict] | None = None
        self.fhs: dict[int, Node] = {}
        self.next_fh = 1

    # -- helpers ---------------------------------------------------------------------------
    def _check(self) -> None:
        if self.frozen:
            raise _err(errno.EIO)

    def _count(self, kind: str, path: str) -> None:
        """Called before a counted operation is applied: the cut freezes the file system here."""
        self._check()
        if self.cut_after is not None and len(self.ops) >= self.cut_after:
            self.frozen = True
            self.cut_images = {m: nodes_to_image(self.root, m) for m in MODELS}
            self.events({"event": "cut", "op": len(self.ops)})
            raise _err(errno.EIO)
        self.ops.append((kind, path))

    def _lookup(self, path: str) -> Node:
        n = self.root
        for part in path.strip("/").split("/"):
            if not part:
                continue
            if n.kind != "d":
                raise _err(errno.ENOTDIR)
            n = n.entries.get(part)
            if n is None:
                raise _err(errno.ENOENT)
        return n

    def _parent(self, path: str) -> tuple[Node, str]:
        head, name = os.path.split(path.rstrip("/"))
        parent = self._lookup(head or "/")
        if parent.kind != "d":
            raise _err(errno.ENOTDIR)
        return parent, name

    def _node(self, path: str | None, fh) -> Node:
        if fh and fh in self.fhs:
            return self.fhs[fh]
        return self._lookup(path)

    def _open_fh(self, n: Node) -> int:
        fh = self.next_fh
        self.next_fh += 1
        self.fhs[fh] = n
        return fh

    # -- mfusepy operations ----------------------------------------------------------------
    def init_with_config(self, conn, config) -> None:
        if config is not None:
            # No kernel caching of names or attributes: every lookup comes here.
            config.entry_timeout = 0.0
            config.attr_timeout = 0.0
            config.negative_timeout = 0.0
            config.hard_remove = 1
        if conn is not None:
            conn.want &= ~FUSE_CAP_WRITEBACK_CACHE  # each write() reaches us before it returns
        self.events({"event": "mounted"})

    def getattr(self, path, fh=None):
        self._check()
        n = self._node(path, fh)
        size = len(n.data) if n.kind == "f" else 4096
        mode = (stat.S_IFREG if n.kind == "f" else stat.S_IFDIR) | n.mode
        t = int(n.mtime * 1e9)
        return {"st_mode": mode, "st_nlink": 1 if n.kind == "f" else 2, "st_size": size, "st_ino": n.ino,
                "st_blksize": 4096, "st_blocks": (size + 511) // 512,
                "st_atime": t, "st_mtime": t, "st_ctime": t, "st_uid": os.getuid(), "st_gid": os.getgid()}

    def access(self, path, amode):
        self._check()
        self._lookup(path)
        return 0

    def statfs(self, path):
        self._check()
        total = 1 << 20  # 4 GiB of 4 KiB blocks; plenty for the tests
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": total, "f_bfree": total // 2,
                "f_bavail": total // 2, "f_files": 1 << 20, "f_ffree": 1 << 19, "f_favail": 1 << 19,
                "f_namemax": 255}

    def readdir(self, path, fh):
        self._check()
        n = self._node(path, fh)
        if n.kind != "d":
            raise _err(errno.ENOTDIR)
        return [".", ".."] + list(n.entries)

    def opendir(self, path):
        self._check()
        n = self._lookup(path)
        if n.kind != "d":
            raise _err(errno.ENOTDIR)
        return self._open_fh(n)

    def releasedir(self, path, fh):
        self.fhs.pop(fh, None)
        return 0

    def open(self, path, flags):
        self._check()
        n = self._lookup(path)
        if n.kind == "d" and flags & (os.O_WRONLY | os.O_RDWR):
            raise _err(errno.EISDIR)
        return self._open_fh(n)

    def create(self, path, mode, flags=0):
        parent, name = self._parent(path)
        if name in parent.entries:
            raise _err(errno.EEXIST)
        self._count("create", path)
        n = Node("f", mode & 0o7777)
        parent.entries[name] = n
        parent.mtime = time.time()
        return self._open_fh(n)

    def mkdir(self, path, mode):
        parent, name = self._parent(path)
        if name in parent.entries:
            raise _err(errno.EEXIST)
        self._count("mkdir", path)
        parent.entries[name] = Node("d", mode & 0o7777)
        parent.mtime = time.time()
        return 0

    def read(self, path, size, offset, fh):
        self._check()
        n = self._node(path, fh)
        return bytes(n.data[offset:offset + size])

    def write(self, path, data, offset, fh):
        n = self._node(path, fh)
        self._count("write", path)
        end = offset + len(data)
        if len(n.data) < offset:
            n.data.extend(bytes(offset - len(n.data)))
        n.data[offset:end] = data
        n.mtime = time.time()
        return len(data)

    def truncate(self, path, length, fh=None):
        n = self._node(path, fh)
        self._count("truncate", path)
        if length < len(n.data):
            del n.data[length:]
        else:
            n.data.extend(bytes(length - len(n.data)))
        n.mtime = time.time()
        return 0

    def fallocate(self, path, mode, offset, size, fh):
        n = self._node(path, fh)
        if mode & ~1:  # only plain allocation and FALLOC_FL_KEEP_SIZE
            raise _err(errno.EOPNOTSUPP)
        self._count("fallocate", path)
        if not mode & 1 and len(n.data) < offset + size:
            n.data.extend(bytes(offset + size - len(n.data)))
        return 0

    def fsync(self, path, datasync, fh):
        n = self._node(path, fh)
        self._count("fsync", path)
        n.synced_data = bytes(n.data)
        return 0

    def fsyncdir(self, path, datasync, fh):
        n = self._node(path, fh)
        self._count("fsyncdir", path)
        n.synced_entries = dict(n.entries)
        return 0

    def flush(self, path, fh):
        return 0  # close(2) makes nothing durable

    def release(self, path, fh):
        self.fhs.pop(fh, None)
        return 0

    def unlink(self, path):
        parent, name = self._parent(path)
        n = parent.entries.get(name)
        if n is None:
            raise _err(errno.ENOENT)
        if n.kind == "d":
            raise _err(errno.EISDIR)
        self._count("unlink", path)
        del parent.entries[name]
        return 0

    def rmdir(self, path):
        parent, name = self._parent(path)
        n = parent.entries.get(name)
        if n is None:
            raise _err(errno.ENOENT)
        if n.kind != "d":
            raise _err(errno.ENOTDIR)
        if n.entries:
            raise _err(errno.ENOTEMPTY)
        self._count("rmdir", path)
        del parent.entries[name]
        return 0

    def rename(self, old, new, flags=0):
        op, oname = self._parent(old)
        np_, nname = self._parent(new)
        src = op.entries.get(oname)
        if src is None:
            raise _err(errno.ENOENT)
        dst = np_.entries.get(nname)
        if flags & RENAME_EXCHANGE:
            if dst is None:
                raise _err(errno.ENOENT)
            self._count("rename", f"{old} <-> {new}")
            op.entries[oname], np_.entries[nname] = dst, src
            return 0
        if dst is not None:
            if flags & RENAME_NOREPLACE:
                raise _err(errno.EEXIST)
            if dst.kind == "d" and src.kind != "d":
                raise _err(errno.EISDIR)
            if dst.kind != "d" and src.kind == "d":
                raise _err(errno.ENOTDIR)
            if dst.kind == "d" and dst.entries:
                raise _err(errno.ENOTEMPTY)
        self._count("rename", f"{old} -> {new}")
        del op.entries[oname]
        np_.entries[nname] = src
        return 0

    def chmod(self, path, mode):
        self._check()
        self._lookup(path).mode = mode & 0o7777
        return 0

    def chown(self, path, uid, gid):
        self._check()
        return 0

    def utimens(self, path, times=None):
        self._check()
        self._lookup(path).mtime = time.time()
        return 0


def _fuse_class():
    import mfusepy

    class FUSE(mfusepy.FUSE):
        # mfusepy drops rename's flags; RENAME_EXCHANGE and RENAME_NOREPLACE must reach the fs.
        def rename_fuse_3(self, old: bytes, new: bytes, flags: int) -> int:
            return self.operations.rename(old.decode(self.encoding, self.errors),
                                          new.decode(self.encoding, self.errors), flags)

    return FUSE


def serve(mountpoint: str) -> None:
    out = sys.stdout
    def events(obj):
        out.write(json.dumps(obj) + "\n")
        out.flush()
    FUSE = _fuse_class()
    images: dict[str, dict] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        what = cmd["cmd"]
        if what == "seed":
            images[cmd["image"]] = image_from_dir(cmd["dir"])
            events({"event": "seeded", "fp": fingerprint(images[cmd["image"]])})
        elif what == "mount":
            fs = PowerCutFS(image_to_nodes(images[cmd["image"]]), cmd.get("cut_after"), events)
            FUSE(fs, mountpoint, foreground=True, nothreads=True, fsname="distckpt-powercut",
                 default_permissions=True)
            cut = fs.cut_images or {m: nodes_to_image(fs.root, m) for m in MODELS}
            tag = cmd.get("tag", "img")
            named = {}
            for m, img in cut.items():
                images[f"{tag}-{m}"] = img
                named[m] = {"name": f"{tag}-{m}", "fp": fingerprint(img)}
            events({"event": "unmounted", "ops": fs.ops, "cut": fs.frozen, "images": named})
        elif what == "drop":
            for name in [n for n in images if n.startswith(cmd["prefix"])]:
                del images[name]
            events({"event": "dropped"})
        elif what == "dump":
            image_to_dir(images[cmd["image"]], cmd["dir"])
            events({"event": "dumped"})
        elif what == "quit":
            return
        else:
            events({"event": "error", "error": f"unknown command {what!r}"})


if __name__ == "__main__":
    serve(sys.argv[1])
