import os
import sys

import pytest

# DeepSpeed JIT-compiles its CPU ops into TORCH_EXTENSIONS_DIR, by default one folder per user that
# every virtual environment of the machine shares: each venv's own build flags then rebuild them
# (minutes, under a lock every launch waits on). Every launch the tests make builds into, and
# reuses, a folder of this venv, with this venv's ninja (another ninja version, e.g. the system's,
# reads the build log as out of date and rebuilds everything).
os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(sys.prefix, "torch_extensions")
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

# Each tier folder's tests carry its marker (registered in pyproject.toml), so that
# `-m unit`, `-m "not crash and not s3"` and the like select by tier; docs/TESTING.md lists the tiers.
TIERS = ("unit", "io", "protocol", "crash", "s3", "interop", "gpu")
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# The fast loop: `bash tests/run.sh -m "not slow"` leaves out these files (each one is minutes of
# crash sweeps, real DeepSpeed / TorchRec launches or network-fault sweeps) and tests marked slow.
# Matched by file name, whatever tier folder the file is in.
SLOW_FILES = {"test_crash.py", "test_crash_syscalls.py", "test_power_loss.py", "test_deepspeed_engine.py",
              "test_deepspeed_zero.py", "test_s3_faults.py", "test_s3_multinode.py", "test_torchrec.py",
              "test_torchrec_raw.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = os.path.abspath(str(item.fspath))
        if os.path.basename(path) in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
        tier = os.path.relpath(path, TESTS_DIR).split(os.sep)[0]
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))


# Every test sees the configuration the run was started with, never a cached one from another test.
@pytest.fixture(autouse=True)
def _fresh_config():
    from distckpt.config import get_config
    get_config.cache_clear()
    yield
    get_config.cache_clear()


def open_fds() -> dict[int, str]:
    """The fds this process has open right now: {fd: target}, sockets and pipes left out.

    Sockets are left out because the S3 tests' client pool (s3fs on aiohttp, on fsspec's loop
    thread) keeps connections alive and closes them on its own schedule, at any moment of a later
    test: a before/after comparison around a local-disk save then fails on a socket that save never
    touched. No local-disk path of distckpt opens a socket in this process (the gloo groups run in
    spawned processes), so leaving sockets out hides no leak that these comparisons look for.
    Pipes likewise: the pipes of an earlier test's subprocesses and multiprocessing queues are
    closed by the garbage collector at any later moment, and distckpt opens no pipe.
    """
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if not target.startswith(("socket:", "pipe:")):
            out[int(name)] = target
    return out


def highest_fd() -> int:
    """The highest fd this process has open, of any kind (sockets and pipes included): the base
    of an RLIMIT_NOFILE that leaves a known number of fds spare."""
    return max(int(name) for name in os.listdir("/proc/self/fd"))


# --------------------------------------------------------------------------------------------
# A real S3 server (SeaweedFS, tests/helpers/s3server.py): one per session, a fresh bucket per test.


class S3Bucket:
    """One empty bucket on the session's server: ``name``, ``url`` (``s3://NAME``),
    ``storage_options`` (read-write keys), ``server`` (the :class:`tests.helpers.s3server.S3Server`),
    ``fs`` (an s3fs filesystem on it) and ``env`` (AWS_* variables for clients without options)."""

    def __init__(self, server, name):
        self.server, self.name = server, name
        self.url = f"s3://{name}"
        self.storage_options = server.storage_options()
        self.env = server.env()
        self.fs = server.filesystem()

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key under ``prefix`` (relative to the bucket), sorted; fresh listing."""
        self.fs.invalidate_cache()
        base = f"{self.name}/{prefix}".rstrip("/")
        return sorted(k[len(self.name) + 1:] for k in self.fs.find(base))

    def multipart_uploads(self) -> list[dict]:
        """The bucket's unfinished multipart uploads (Key, UploadId)."""
        return self.fs.call_s3("list_multipart_uploads", Bucket=self.name).get("Uploads", [])


@pytest.fixture(scope="session")
def s3_server():
    """The session's SeaweedFS server (started on first use, stopped at the end)."""
    from tests.helpers.s3server import S3Server

    with S3Server() as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh bucket on the session server, emptied and deleted after the test."""
    name = s3_server.create_bucket()
    yield S3Bucket(s3_server, name)
    if s3_server.proc is not None:
        s3_server.remove_bucket(name)


@pytest.fixture
def s3_private_server(tmp_path_factory):
    """A server of this test's own (with one bucket), for tests that stop or kill it mid-way;
    stopped (by PID) afterwards whatever happened. Yields an S3Bucket on it."""
    from tests.helpers.s3server import S3Server

    server = S3Server().start()
    try:
        yield S3Bucket(server, server.create_bucket())
    finally:
        server.stop()


@pytest.fixture
def s3_ignore_conditional(monkeypatch):
    """Run the test as if the server did not honour conditional creates (If-None-Match: *):
    this process's S3 clients stop sending the header, and so do child processes (torchrun ranks)
    started with the environment this fixture sets (a sitecustomize on PYTHONPATH). Undone at
    teardown."""
    from tests.helpers.s3server import ignore_conditional_writes, ignore_conditional_writes_env, restore_conditional_writes

    ignore_conditional_writes()
    for name, value in ignore_conditional_writes_env().items():
        if os.environ.get(name) != value:
            monkeypatch.setenv(name, value)
    yield
    restore_conditional_writes()
