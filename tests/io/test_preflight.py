"""Pre-flight checks (distckpt.checks, issue #4) against real faults.

Environment checks run on explicit env dicts (no process group needed). Storage faults are real:
small tmpfs and loop-mounted ext4 file systems, read-only mounts, a 1 MiB /dev/shm in a private
mount namespace, a child without CAP_DAC_OVERRIDE, a child with a tiny RLIMIT_NOFILE. Tests that
need root or a missing tool skip with the reason (tests/helpers/faults.py).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import resource
import subprocess
import types

import pytest

from distckpt import checks, sizes
from distckpt.checks import cli as checks_cli
from distckpt.checks import environment, filesystem, memory, nccl
from distckpt.errors import (
    DiskFullError,
    DistCkptError,
    DistributedEnvError,
    IOBackendUnavailableError,
    SharedMemoryError,
    StoragePermissionError,
    TooManyOpenFilesError,
)
from distckpt.storage.posix import guards
from distckpt.storage.posix.mounts import find_mount
from tests.conftest import open_fds
from tests.helpers.faults import (  # noqa: F401  (mounts is a fixture)
    PYTHON,
    REPO_ROOT,
    deleted_open_file,
    fill_inodes,
    fill_space,
    mounts,
    require_root,
    run_python,
)


MiB = 1 << 20
GOOD_ENV = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def assert_typed(err, cls, *, errno_=None, path=None):
    """The common contract of every typed error: class, errno, path, a remedy sentence."""
    assert isinstance(err, cls), f"{type(err).__name__} is not {cls.__name__}: {err}"
    assert isinstance(err, DistCkptError) and isinstance(err, Exception)
    if errno_ is not None:
        assert err.errno == errno_
    if path is not None:
        assert err.path == os.fspath(path)
    assert err.remedy and len(err.remedy) > 20 and err.remedy != DistCkptError.default_remedy
    return err


# ------------------------------------------------------------------------------------------------
# torchrun environment


def test_no_torchrun_variables_is_a_single_process():
    r = environment.torchrun_env_check({})
    assert r.status == "ok" and "single process" in r.message and r.error is None


def test_consistent_torchrun_env_is_ok():
    r = environment.torchrun_env_check(GOOD_ENV, world_size=4, local_world_size=2)
    assert r.status == "ok", r.message
    assert "127.0.0.1" in r.details["master_addr_resolves_to"]


def test_a_master_port_held_by_another_process_is_a_warning_before_the_rendezvous():
    """A port held on the master's host (a previous job still running) would fail the rendezvous
    with 'address already in use'; flagged only where this job's own store cannot be the holder."""
    import socket
    import subprocess
    import sys

    # The holder is another process, listening as a leftover job's store would.
    holder = subprocess.Popen([sys.executable, "-c", (
        "import socket, sys\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        "print(s.getsockname()[1], flush=True); sys.stdin.read()")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(holder.stdout.readline())
        env = {**GOOD_ENV, "RANK": "0", "MASTER_PORT": str(port)}
        r = environment.torchrun_env_check(env)
        assert r.status == "warning" and f"MASTER_PORT={port} is in use on this host" in r.message, r.message
        assert r.details["master_port_in_use"] is True
        # Where the job's own store may hold it, nothing is probed: torchrun's agent, a rank > 0.
        for own in ({**env, "TORCHELASTIC_RUN_ID": "job7"}, {**env, "RANK": "1"}):
            r = environment.torchrun_env_check(own)
            assert r.status == "ok" and "master_port_in_use" not in r.details, r.message
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    # Free now (SO_REUSEADDR: the closed listener's port is not "in use").
    r = environment.torchrun_env_check({**GOOD_ENV, "RANK": "0", "MASTER_PORT": str(port)})
    assert r.status == "ok" and r.details["master_port_in_use"] is False, r.message
    # A master on another host is not probed as if local (EADDRNOTAVAIL).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert environment._port_in_use(["192.0.2.1"], s.getsockname()[1]) is None
        assert environment._port_in_use(["127.0.0.1"], s.getsockname()[1]) == "127.0.0.1"


def _without(key):
    return {k: v for k, v in GOOD_ENV.items() if k != key}


@pytest.mark.parametrize("env,variable,found", [
    (_without("MASTER_PORT"), "MASTER_PORT", "unset"),
    (_without("MASTER_ADDR"), "MASTER_ADDR", "unset"),
    (_without("LOCAL_WORLD_SIZE"), "LOCAL_WORLD_SIZE", "unset"),
    ({**GOOD_ENV, "RANK": "4"}, "RANK", "4"),
    ({**GOOD_ENV, "RANK": "-1"}, "RANK", "-1"),
    ({**GOOD_ENV, "LOCAL_RANK": "one"}, "LOCAL_RANK", "'one'"),
    ({**GOOD_ENV, "WORLD_SIZE": "4.0"}, "WORLD_SIZE", "'4.0'"),
    ({**GOOD_ENV, "WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE", "0"),
    ({**GOOD_ENV, "LOCAL_RANK": "2"}, "LOCAL_RANK", "2"),
    ({**GOOD_ENV, "LOCAL_WORLD_SIZE": "8", "LOCAL_RANK": "1"}, "LOCAL_WORLD_SIZE", "8"),
    ({**GOOD_ENV, "MASTER_PORT": "70000"}, "MASTER_PORT", "70000"),
    ({**GOOD_ENV, "MASTER_PORT": "0"}, "MASTER_PORT", "0"),
    ({**GOOD_ENV, "MASTER_ADDR": "no-such-host.invalid"}, "MASTER_ADDR", "'no-such-host.invalid'"),
    ({**GOOD_ENV, "MASTER_ADDR": " "}, "MASTER_ADDR", "''"),
], ids=["missing-MASTER_PORT", "missing-MASTER_ADDR", "missing-LOCAL_WORLD_SIZE", "RANK>=WORLD_SIZE",
        "RANK<0", "LOCAL_RANK-not-int", "WORLD_SIZE-not-int", "WORLD_SIZE=0", "LOCAL_RANK>=LWS",
        "LWS>WORLD_SIZE", "port-70000", "port-0", "MASTER_ADDR-unresolvable", "MASTER_ADDR-empty"])
def test_broken_torchrun_variable_is_named(env, variable, found):
    r = environment.torchrun_env_check(env)
    assert r.status == "error", r.message
    err = assert_typed(r.error, DistributedEnvError)
    assert isinstance(err, RuntimeError)
    assert err.variable == variable
    assert err.found == found and err.expected
    assert variable in err.message and "expected" in err.message and "found" in err.message
    # The full run reports it the same way, and raise_on_error raises that very class.
    with pytest.raises(DistributedEnvError) as info:
        checks.preflight("/tmp", env=env, raise_on_error=True)
    assert info.value.variable == variable


def test_rank_field_comes_from_the_checked_env():
    r = environment.torchrun_env_check({**GOOD_ENV, "MASTER_PORT": "70000"})
    assert r.error.rank == 1


def test_world_size_argument_must_match_env():
    r = environment.torchrun_env_check(GOOD_ENV, world_size=8)
    assert r.error.variable == "WORLD_SIZE" and "8" in r.error.message
    r = environment.torchrun_env_check({}, world_size=2)
    assert r.error.variable == "WORLD_SIZE" and r.error.found == "unset"


def test_every_torchrun_problem_is_listed_at_once():
    r = environment.torchrun_env_check({"RANK": "5", "WORLD_SIZE": "2"})
    names = {"LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK"}
    assert all(n in r.message for n in names)
    assert len(r.details["problems"]) == 5


# ------------------------------------------------------------------------------------------------
# NCCL and Gloo

IFACES = ["eth0", "eth1", "ib0", "lo"]


def test_nccl_socket_ifname_typo_names_existing_interfaces():
    r = nccl.socket_ifname_check({"NCCL_SOCKET_IFNAME": "eht0"}, interfaces=IFACES)
    err = assert_typed(r.error, DistributedEnvError)
    assert err.variable == "NCCL_SOCKET_IFNAME"
    assert "eth0, eth1, ib0, lo" in err.message and "did you mean 'eth0'" in err.message


def test_nccl_socket_ifname_against_the_real_interfaces():
    real = nccl.list_interfaces()
    assert "lo" in real
    assert nccl.socket_ifname_check({"NCCL_SOCKET_IFNAME": "lo"}).status == "ok"
    r = nccl.socket_ifname_check({"NCCL_SOCKET_IFNAME": "nosuchif9"})
    assert r.error.variable == "NCCL_SOCKET_IFNAME" and all(i in r.message for i in real)


@pytest.mark.parametrize("value,status,used", [
    ("eth", "ok", ["eth0", "eth1"]),              # prefix match
    ("=eth", "error", []),                        # exact: no interface is called "eth"
    ("=eth1", "ok", ["eth1"]),
    ("^lo", "ok", ["eth0", "eth1", "ib0"]),       # exclude list
    ("^=eth", "ok", ["eth0", "eth1", "ib0", "lo"]),  # exact exclusion of a name that is absent
    ("^eth,ib,lo", "error", []),                  # excludes everything
    ("eth0,wlan", "warning", ["eth0"]),           # one entry matches nothing: a warning
])
def test_nccl_ifname_syntax(value, status, used):
    r = nccl.socket_ifname_check({"NCCL_SOCKET_IFNAME": value}, interfaces=IFACES)
    assert r.status == status, r.message
    assert r.details["nccl_interfaces"] == used
    if status == "error":
        assert_typed(r.error, DistributedEnvError)
        assert r.error.variable == "NCCL_SOCKET_IFNAME"


def test_gloo_ifname_takes_exact_names():
    assert nccl.socket_ifname_check({"GLOO_SOCKET_IFNAME": "eth0,lo"}, interfaces=IFACES).status == "ok"
    r = nccl.socket_ifname_check({"GLOO_SOCKET_IFNAME": "eth"}, interfaces=IFACES)
    assert r.error.variable == "GLOO_SOCKET_IFNAME" and "eth" in r.error.message
    r = nccl.socket_ifname_check({"GLOO_SOCKET_IFNAME": "^lo"}, interfaces=IFACES)
    assert "^ and = syntax does not apply" in r.error.message


def test_unknown_nccl_variable_suggests_the_known_name():
    r = nccl.nccl_vars_check({"NCCL_SOCKT_IFNAME": "eth0", "NCCL_DEBUG": "INFO"})
    assert r.status == "warning" and r.error is None
    assert r.details["unknown"] == {"NCCL_SOCKT_IFNAME": "NCCL_SOCKET_IFNAME"}
    assert "did you mean NCCL_SOCKET_IFNAME?" in r.message
    r = nccl.nccl_vars_check({"NCCL_TOTALLY_MADE_UP_THING": "1"})
    assert r.status == "warning" and r.details["unknown"] == {"NCCL_TOTALLY_MADE_UP_THING": None}


@pytest.mark.parametrize("name,value", [("NCCL_SHM_DISABLE", "true"), ("NCCL_P2P_DISABLE", "yes"),
                                        ("NCCL_IB_DISABLE", "2"), ("NCCL_BUFFSIZE", "4M")])
def test_nccl_variable_values(name, value):
    r = nccl.nccl_vars_check({name: value})
    err = assert_typed(r.error, DistributedEnvError)
    assert err.variable == name and repr(value) in err.message


def test_valid_nccl_variables_are_ok():
    env = {"NCCL_SHM_DISABLE": "1", "NCCL_BUFFSIZE": "8388608", "NCCL_DEBUG": "warn",
           "NCCL_SOCKET_IFNAME": "^lo", "NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert nccl.nccl_vars_check(env).status == "ok"


def test_nccl_ib_hca_devices_and_ports(tmp_path):
    (tmp_path / "mlx5_0" / "ports" / "1").mkdir(parents=True)
    (tmp_path / "mlx5_1" / "ports" / "1").mkdir(parents=True)
    check = lambda v, **e: nccl.ib_hca_check({"NCCL_IB_HCA": v, **e}, ib_root=str(tmp_path))  # noqa: E731
    assert check("mlx5").details["nccl_devices"] == ["mlx5_0", "mlx5_1"]
    assert check("=mlx5_0:1").status == "ok"
    assert check("^=mlx5_0").details["nccl_devices"] == ["mlx5_1"]
    r = check("mlx4_0")
    assert r.error.variable == "NCCL_IB_HCA" and "mlx5_0, mlx5_1" in r.message
    assert "no port 2" in check("mlx5_0:2").message
    assert check("^mlx5").status == "error"
    assert check("mlx4_0", NCCL_IB_DISABLE="1").status == "ok"
    r = nccl.ib_hca_check({"NCCL_IB_HCA": "mlx5_0"}, ib_root=str(tmp_path / "absent"))
    assert r.status == "error" and "none" in r.message


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_nccl_without_cuda_is_an_error(backend):
    r = nccl.backend_devices_check(backend, {})
    err = assert_typed(r.error, DistributedEnvError)
    assert "torch.cuda.is_available() is False" in err.message and "gloo" in err.remedy
    with pytest.raises(DistributedEnvError):
        checks.preflight("/tmp", backend=backend, env={}, raise_on_error=True)


def test_gloo_and_unknown_backends():
    assert nccl.backend_devices_check("gloo", {}).status == "ok"
    assert nccl.backend_devices_check(None, {}).status == "ok"
    r = nccl.backend_devices_check("ncl", {})
    assert_typed(r.error, DistributedEnvError)
    assert "'ncl'" in r.message


# ------------------------------------------------------------------------------------------------
# /dev/shm


def test_nccl_shm_estimate():
    seg = 4 * MiB + 512 * 1024 + 4800 * 1024 + 4096
    assert seg == 9637888  # the segment size NCCL names in its own /dev/shm warning
    assert memory.nccl_shm_bytes_per_rank({}) == seg * 2 * 2
    assert memory.nccl_shm_bytes_per_rank({"NCCL_SHM_DISABLE": "1"}) == 0
    assert memory.nccl_shm_bytes_per_rank({"NCCL_BUFFSIZE": str(MiB)}) == (seg - 3 * MiB) * 4


_SHM_CHILD = """
import os
from distckpt import checks
from distckpt.checks import memory
st = os.statvfs("/dev/shm")
emit({"shm_size": st.f_blocks * st.f_frsize})
r = memory.shm_check(backend="nccl", local_world_size=2, env={})
emit({"nccl": r.to_dict(), "error": error_dict(r.error) if r.error else None})
r = memory.shm_check(backend="gloo", shm_bytes_needed=4 << 20, env={})
emit({"workers": r.to_dict(), "error": error_dict(r.error) if r.error else None})
r = memory.shm_check(backend="nccl", local_world_size=2, env={"NCCL_SHM_DISABLE": "1"})
emit({"disabled": r.to_dict()})
report = checks.preflight("/tmp", backend="nccl", local_world_size=2, env={})
emit(report.to_dict())
"""


def test_small_dev_shm_in_a_private_namespace():
    host_before = os.statvfs("/dev/shm").f_blocks
    res = run_python(_SHM_CHILD, private_shm="1m", timeout=60).check()
    size, nccl, workers, disabled, report = res.emitted
    assert size["shm_size"] == MiB
    err = nccl["error"]
    assert "SharedMemoryError" in err["mro"] and "OSError" in err["mro"]
    assert err["errno"] == errno.ENOSPC and err["path"] == "/dev/shm"
    assert err["fields"]["needed"] == memory.nccl_shm_bytes_per_rank({}) * 2
    assert err["fields"]["free"] <= MiB
    assert "--shm-size" in err["remedy"] and "NCCL_SHM_DISABLE=1" in err["remedy"]
    assert "1.0 MiB" in err["message"]
    werr = workers["error"]
    assert werr["type"] == "SharedMemoryError" and werr["fields"]["needed"] == 4 * MiB
    assert "NCCL_SHM_DISABLE" not in werr["remedy"]
    assert disabled["disabled"]["status"] == "ok" and "NCCL_SHM_DISABLE=1" in disabled["disabled"]["message"]
    shm = next(c for c in report["checks"] if c["name"] == "shm")
    assert shm["status"] == "error" and shm["error"]["type"] == "SharedMemoryError"
    assert not report["ok"]
    assert os.statvfs("/dev/shm").f_blocks == host_before  # the host's /dev/shm was not touched


_SHM_RO_CHILD = """
from distckpt.checks import memory
from distckpt.errors import SharedMemoryError
r = memory.shm_check(backend="nccl", local_world_size=2, env={})
emit({"status": r.status, "error": type(r.error).__name__ if r.error else None,
      "errno": getattr(r.error, "errno", None), "message": r.message})
r = memory.shm_check(backend="gloo", env={})
emit({"status": r.status, "message": r.message})
"""


def test_a_read_only_dev_shm_is_not_ok_whatever_its_size():
    """A 1 GiB /dev/shm mounted read-only passed (`shm OK`) although NCCL cannot create a segment
    there (an outside trial). It is a SharedMemoryError (EROFS) when the job needs shared memory,
    a warning when it does not."""
    res = run_python(_SHM_RO_CHILD, private_shm="1g,ro", timeout=60).check()
    needed, not_needed = res.emitted
    assert needed["status"] == "error" and needed["error"] == "SharedMemoryError", needed
    assert needed["errno"] == errno.EROFS and "read-only" in needed["message"], needed
    assert not_needed["status"] == "warning" and "read-only" in not_needed["message"], not_needed


def test_shm_not_needed_is_ok():
    r = memory.shm_check(backend="gloo", local_world_size=4, env={})
    assert r.status == "ok" and "no shared-memory need" in r.message
    r = memory.shm_check(shm_bytes_needed=1 << 50, env={}, shm_path="/nonexistent-shm")
    assert isinstance(r.error, SharedMemoryError)


# ------------------------------------------------------------------------------------------------
# Disk space and inodes


def test_disk_too_small_on_a_real_tmpfs(mounts, tmp_path):
    mnt = mounts.tmpfs(tmp_path / "small", size="16m")
    target = mnt / "ckpt" / "step_1"  # does not exist yet: its file system is checked
    r = filesystem.disk_check(target, 64 * MiB, keep_last=2)
    err = assert_typed(r.error, DiskFullError, errno_=errno.ENOSPC, path=target)
    assert err.needed == 64 * MiB and 15 * MiB < err.free <= 16 * MiB
    assert err.mount_point == str(mnt) and err.fstype == "tmpfs"
    assert f"checkpoint needs 64.0 MiB on {mnt} (tmpfs), 16.0 MiB free" in err.message
    assert "must fit while the old ones still exist" in err.message and "keep_last=2" in err.message
    with pytest.raises(DiskFullError) as info:
        guards.check_save_space(target, 64 * MiB, rank=3)
    assert info.value.rank == 3 and info.value.needed == 64 * MiB and info.value.errno == errno.ENOSPC
    guards.check_save_space(target, 8 * MiB)  # fits: no exception
    with pytest.raises(DiskFullError) as info:
        checks.preflight(target, expected_bytes=64 * MiB, env={}, raise_on_error=True)
    assert info.value.free == err.free
    ok = filesystem.disk_check(target, 8 * MiB)
    assert ok.status == "ok" and "tmpfs" in ok.message


def test_keep_last_headroom_warning(mounts, tmp_path):
    mnt = mounts.tmpfs(tmp_path / "rot", size="16m")
    (mnt / "step_00000001").mkdir()
    (mnt / "step_00000001" / "MANIFEST").write_bytes(b"x")
    r = filesystem.disk_check(mnt, 6 * MiB, keep_last=3)  # 3 more checkpoints of 6 MiB will not fit
    assert r.status == "warning" and r.details["committed_checkpoints"] == 1
    assert "keep_last=3" in r.message and "later save" in r.message
    assert filesystem.disk_check(mnt, 6 * MiB, keep_last=1).status == "ok"


def test_full_tmpfs_write_probe_gives_enospc(mounts, tmp_path):
    mnt = mounts.tmpfs(tmp_path / "full", size="4m")
    assert fill_space(mnt) > 3 * MiB
    with pytest.raises(DiskFullError) as info:
        filesystem.check_writable(mnt)
    assert_typed(info.value, DiskFullError, errno_=errno.ENOSPC, path=mnt)
    assert sorted(p.name for p in mnt.iterdir()) == ["filler"]  # the probe was removed


def test_inode_exhaustion_on_ext4(mounts, tmp_path):
    mnt = mounts.ext4(tmp_path / "ext4", size="8m", inodes=16)
    assert 0 < fill_inodes(mnt) <= 16
    r = filesystem.disk_check(mnt, 4096)
    err = assert_typed(r.error, DiskFullError, errno_=errno.ENOSPC, path=mnt)
    assert err.free_inodes == 0 and err.needed_inodes >= 1 and err.fstype == "ext4"
    assert "inodes" in err.message and "df -i" in err.remedy
    with pytest.raises(DiskFullError) as info:  # the probe file gets no inode either
        filesystem.check_writable(mnt)
    assert info.value.errno == errno.ENOSPC and "0 inodes free" in info.value.message
    with pytest.raises(DiskFullError):
        guards.check_save_space(mnt, 1)


# ------------------------------------------------------------------------------------------------
# Permissions


def test_read_only_mount_is_erofs(mounts, tmp_path):
    ro = mounts.readonly(tmp_path / "ro")
    for target in (ro, ro / "not" / "yet"):
        with pytest.raises(StoragePermissionError) as info:
            filesystem.check_writable(target, rank=2)
        err = assert_typed(info.value, StoragePermissionError, errno_=errno.EROFS, path=ro)
        assert isinstance(err, PermissionError) and err.rank == 2
        assert "read-only" in err.remedy
    r = filesystem.writable_check(ro)
    assert r.status == "error" and isinstance(r.error, StoragePermissionError)
    with pytest.raises(StoragePermissionError):
        checks.preflight(ro / "ckpt", env={}, raise_on_error=True)


_EACCES_CHILD = """
from distckpt.checks import filesystem
from tests.helpers.faults import cap_effective
emit({"cap_eff": cap_effective()})
try:
    filesystem.check_writable(TARGET)
    emit({"error": None})
except Exception as exc:
    emit_error(exc)
"""


def test_eacces_without_cap_dac_override(tmp_path):
    require_root()
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, 0o555)
    filesystem.check_writable(locked)  # root with CAP_DAC_OVERRIDE ignores the mode bits
    res = run_python(_EACCES_CHILD.replace("TARGET", repr(str(locked))),
                     drop_caps=["cap_dac_override"]).check()
    caps, out = res.emitted
    assert not caps["cap_eff"] & (1 << 1), "CAP_DAC_OVERRIDE still effective in the child"
    err = out["error"]
    assert err is not None and "StoragePermissionError" in err["mro"] and "PermissionError" in err["mro"]
    assert err["errno"] == errno.EACCES and err["path"] == str(locked) and err["remedy"]
    assert list(locked.iterdir()) == []


# ------------------------------------------------------------------------------------------------
# File descriptors


_NOFILE_CHILD = """
import errno, os
from distckpt.checks import filesystem
from distckpt.errors import from_os_error
from distckpt.storage.posix import guards
try:
    guards.check_fd_limit(64, rank=0)
    emit({"error": None})
except Exception as exc:
    emit_error(exc)
guards.check_fd_limit(2)
emit({"small_ok": True})
emit({"report": filesystem.fd_limit_check(64).to_dict()})
fds = []
try:
    while True:
        fds.append(os.open("/dev/null", os.O_RDONLY))
except OSError as exc:  # the real EMFILE maps to the same class
    emit_error(from_os_error(exc, path="/dev/null", operation="open"))
finally:
    for fd in fds:
        os.close(fd)
"""


def test_tiny_rlimit_nofile_in_a_child():
    res = run_python(_NOFILE_CHILD, rlimits={resource.RLIMIT_NOFILE: (24, 24)}).check()
    first, small, report, real = res.emitted
    err = first["error"]
    assert err["type"] == "TooManyOpenFilesError" and "OSError" in err["mro"]
    assert err["errno"] == errno.EMFILE and err["rank"] == 0
    assert err["fields"]["needed"] == 64 and err["fields"]["limit"] == 24
    assert 3 <= err["fields"]["open"] < 24 and "hard limit (24) is too low" in err["remedy"]
    assert small["small_ok"] is True
    assert report["report"]["status"] == "error"
    assert report["report"]["error"]["type"] == "TooManyOpenFilesError"
    assert real["error"]["type"] == "TooManyOpenFilesError" and real["error"]["errno"] == errno.EMFILE


_NOFILE_JUST_ENOUGH = """
import os, resource, torch, distckpt
from distckpt.checks import preflight
from distckpt.storage.posix.guards import open_fd_count
path = os.environ["CKPT"]
distckpt.save({"w": torch.ones(8)}, path + "/warm")  # the first save's lazy imports open their files now
free = int(os.environ["FREE"])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (open_fd_count() + free, hard))
row = next(c for c in preflight(path + "/c", world_size=1).checks if c.name == "fd_limit")
emit({"status": row.status, "needed": row.details["needed"], "message": row.message})
try:
    distckpt.save({"w": torch.arange(1 << 20, dtype=torch.float32), "b": torch.ones(3)}, path + "/c")
    emit({"saved": distckpt.read(path + "/c")["w"].sum().item() == float(sum(range(1 << 20)))})
except Exception as exc:
    emit_error(exc)
"""


@pytest.mark.parametrize("free", [16, 8])
def test_fd_limit_asks_for_what_a_save_opens_not_more(tmp_path, free):
    """pre-flight asked for 64 + the world's file count (69 fds at one rank); one rank's save opens
    its own file only: 9, and 7 for distckpt's control group when there is a process group. With
    16 fds free the row is ok and the save succeeds; with 8 the row is an error and the save
    raises TooManyOpenFilesError before it writes."""
    res = run_python(_NOFILE_JUST_ENOUGH, env={"CKPT": str(tmp_path), "FREE": str(free)}).check()
    row, saved = res.emitted
    assert row["needed"] == 16, row
    if free == 16:
        assert row["status"] == "ok" and saved == {"saved": True}, (row, saved)
    else:
        assert row["status"] == "error" and saved["error"]["type"] == "TooManyOpenFilesError", (row, saved)
        assert not os.path.exists(tmp_path / "c")


def test_fd_limit_remedy_when_hard_limit_allows():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(f"hard RLIMIT_NOFILE {hard} too low for this test")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # lowering the soft limit is reversible
    try:
        with pytest.raises(TooManyOpenFilesError) as info:
            guards.check_fd_limit(1000)
        guards.check_fd_limit(100)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert info.value.needed == 1000 and info.value.limit == 256
    assert info.value.errno == errno.EMFILE and "ulimit -n" in info.value.remedy
    assert "hard limit" in info.value.remedy and "too low" not in info.value.remedy


# ------------------------------------------------------------------------------------------------
# Deleted-but-open files


def test_deleted_open_file_in_this_process(mounts, tmp_path):
    mnt = mounts.tmpfs(tmp_path / "held", size="32m")
    assert filesystem.deleted_open_files_check(mnt).status == "ok"
    with deleted_open_file(mnt, 8 * MiB) as (fd, former):
        r = filesystem.deleted_open_files_check(mnt)
        assert r.status == "warning" and r.error is None
        (me,) = [h for h in r.details["holders"] if h["pid"] == os.getpid()]
        assert 8 * MiB <= me["bytes"] <= 8 * MiB + 64 * 1024 and me["files"] == 1
        assert me["examples"] == [former]
        assert f"process {os.getpid()} (" in r.message and ("8.0 MiB" in r.message or "8.1 MiB" in r.message)
        assert "df says full and du says small" in r.message and str(mnt) in r.message
        # the full run reports it as a warning, not an error
        rep = checks.preflight(mnt, env={})
        assert rep.get("deleted_open_files").status == "warning"
    assert filesystem.deleted_open_files_check(mnt).status == "ok"


def test_deleted_open_file_in_another_process(mounts, tmp_path):
    mnt = mounts.tmpfs(tmp_path / "other", size="32m")
    code = (f"import os, sys\nfd = os.open({str(mnt / 'x')!r}, os.O_CREAT | os.O_RDWR)\n"
            "os.write(fd, b'z' * (4 << 20)); os.unlink(" + repr(str(mnt / "x")) + ")\n"
            "print('ready', flush=True); sys.stdin.read()\n")
    child = subprocess.Popen([PYTHON, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        r = filesystem.deleted_open_files_check(mnt)
        (h,) = [h for h in r.details["holders"] if h["pid"] == child.pid]
        assert h["comm"].startswith("python") and h["bytes"] >= 4 * MiB
        assert f"process {child.pid} ({h['comm']})" in r.message
    finally:
        child.communicate("", timeout=30)
    assert filesystem.deleted_open_files_check(mnt).status == "ok"


# ------------------------------------------------------------------------------------------------
# Mount table, probe hygiene, io backend, memlock


def test_find_mount_handles_spaces(mounts, tmp_path):
    mnt = mounts.tmpfs(tmp_path / "with space\tand tab", size="1m")
    m = find_mount(mnt / "deeper" / "not-yet")
    assert m.mount_point == str(mnt) and m.fstype == "tmpfs"
    r = filesystem.disk_check(mnt / "x", 1)
    assert r.details["mount_point"] == str(mnt)


def test_find_mount_picks_longest_prefix_and_unescapes(tmp_path):
    (tmp_path / "a b" / "c").mkdir(parents=True)
    esc = str(tmp_path).replace(" ", "\\040")
    fake = tmp_path / "mountinfo"
    fake.write_text(
        "1 0 8:1 / / rw - ext4 /dev/root rw\n"
        f"2 1 0:5 / {esc} rw - tmpfs tmpfs rw\n"
        f"3 2 0:6 / {esc}/a\\040b rw shared:1 - xfs /dev/sdb rw\n"
        f"4 2 0:7 / {esc}/a rw - btrfs /dev/sdc rw\n")  # "a" is not a path prefix of "a b"
    m = find_mount(tmp_path / "a b" / "c", mountinfo=str(fake))
    assert (m.mount_point, m.fstype, m.source) == (str(tmp_path / "a b"), "xfs", "/dev/sdb")


def test_write_probe_leaves_no_file_and_no_fd(tmp_path):
    before_fds = open_fds()
    filesystem.check_writable(tmp_path)
    filesystem.check_writable(tmp_path / "missing" / "dir")
    assert list(tmp_path.iterdir()) == [] and open_fds() == before_fds
    (tmp_path / "file").write_text("x")
    with pytest.raises(DistCkptError) as info:
        filesystem.check_writable(tmp_path / "file")
    assert info.value.errno == errno.ENOTDIR


def test_io_backend_reported_and_forced_failure(monkeypatch, tmp_path):
    choice = types.SimpleNamespace(name="pwrite", reason="O_DIRECT works, io_uring disabled",
                                   mem_align=4096, offset_align=512, directory=str(tmp_path))
    # Patched where io_backend_check looks it up at call time.
    monkeypatch.setattr(filesystem, "choose_backend", lambda d: choice)
    r = filesystem.io_backend_check(tmp_path / "not-yet")
    assert r.status == "ok" and "pwrite: O_DIRECT works" in r.message and r.details["offset_align"] == 512

    def refuse(d):
        raise IOBackendUnavailableError("io_uring_setup failed: [Errno 1] EPERM", path=d, errno=errno.EPERM)
    monkeypatch.setattr(filesystem, "choose_backend", refuse)
    r = filesystem.io_backend_check(tmp_path)
    assert r.status == "error" and isinstance(r.error, IOBackendUnavailableError)
    with pytest.raises(IOBackendUnavailableError):
        checks.preflight(tmp_path, env={}, raise_on_error=True)


def test_io_backend_with_the_real_module(tmp_path):
    r = filesystem.io_backend_check(tmp_path)
    assert r.status == "ok" and r.details["name"], r.message


_MEMLOCK_CHILD = """
from distckpt.checks import memory
emit(memory.memlock_check(pinned=True).to_dict())
emit(memory.memlock_check(pinned=False).to_dict())
"""


def test_low_memlock_with_pinned_memory_warns():
    res = run_python(_MEMLOCK_CHILD, rlimits={resource.RLIMIT_MEMLOCK: (MiB, MiB)}).check()
    pinned, unpinned = res.emitted
    assert pinned["status"] == "warning" and "ulimit -l" in pinned["message"] and "1.0 MiB" in pinned["message"]
    assert unpinned["status"] == "ok"


def test_huge_pages_check_reads_the_kernels_mode_and_torchs_variable(tmp_path):
    def sysfs(mode: str, per_size: str | None) -> str:
        d = tmp_path / f"{mode}-{per_size}"
        (d / "hugepages-2048kB").mkdir(parents=True, exist_ok=True)
        (d / "enabled").write_text({"always": "[always] madvise never", "madvise": "always [madvise] never",
                                    "never": "always madvise [never]"}[mode] + "\n")
        if per_size is not None:
            (d / "hugepages-2048kB" / "enabled").write_text(
                " ".join(f"[{m}]" if m == per_size else m for m in ("always", "inherit", "madvise", "never")))
        return str(d)

    r = memory.huge_pages_check({}, sysfs=sysfs("madvise", "inherit"))
    assert r.status == "ok" and r.details == {"mode": "madvise", "torch_thp": False}
    assert "THP_MEM_ALLOC_ENABLE=1" in r.message and "4 KiB" in r.message
    r = memory.huge_pages_check({"THP_MEM_ALLOC_ENABLE": "1"}, sysfs=sysfs("madvise", "inherit"))
    assert r.details["torch_thp"] and "large CPU tensors and async staging memory use 2 MiB" in r.message
    assert memory.huge_pages_check({}, sysfs=sysfs("always", None)).details["mode"] == "always"
    # The 2 MiB size's own setting wins over the global one (kernels with per-size THP).
    r = memory.huge_pages_check({}, sysfs=sysfs("madvise", "never"))
    assert r.status == "ok" and r.details["mode"] == "never" and "off (never)" in r.message
    r = memory.huge_pages_check({}, sysfs=str(tmp_path / "absent"))
    assert r.status == "ok" and r.details["mode"] is None and "not in this kernel" in r.message


# ------------------------------------------------------------------------------------------------
# Report, CLI


def test_report_table_json_and_raise_first(tmp_path):
    env = {**GOOD_ENV, "MASTER_PORT": "70000", "NCCL_SOCKT_IFNAME": "eth0"}
    rep = checks.preflight(tmp_path, expected_bytes=1 << 60, env=env)
    assert not rep.ok
    assert [c.name for c in rep.errors][:1] == ["torchrun_env"]
    assert {"torchrun_env", "disk"} <= {c.name for c in rep.errors}
    assert "nccl_vars" in {c.name for c in rep.warnings}
    text = str(rep)
    names = ["distckpt_config", "torchrun_env", "socket_ifname", "nccl_ib_hca", "nccl_vars", "backend_devices", "shm",
             "disk", "tmpdir", "deleted_open_files", "writable", "fd_limit", "io_backend", "memlock", "huge_pages"]
    assert [c.name for c in rep.checks] == names
    assert all(n in text for n in names) and "remedy:" in text and "MASTER_PORT=70000" in text
    data = json.loads(json.dumps(rep.to_dict(), default=str))
    disk = next(c for c in data["checks"] if c["name"] == "disk")
    assert disk["error"]["type"] == "DiskFullError" and disk["error"]["errno"] == errno.ENOSPC
    with pytest.raises(DistributedEnvError):
        rep.raise_first()
    clean = checks.preflight(tmp_path, expected_bytes=1024, env={})
    assert clean.ok and clean.raise_first() is None


def test_a_crashing_check_becomes_a_warning(monkeypatch, tmp_path):
    def boom(*a, **k):
        raise ZeroDivisionError("probe bug")
    monkeypatch.setattr(filesystem, "tmpdir_check", boom)  # where preflight() looks it up
    rep = checks.preflight(tmp_path, env={})
    r = rep.get("tmpdir")
    assert r.status == "warning" and "ZeroDivisionError: probe bug" in r.message
    assert rep.get("memlock") is not None  # the checks after it still ran


def test_parse_size():
    assert sizes.parse_size("10G") == 10 << 30 and sizes.parse_size("512MiB") == 512 << 20
    assert sizes.parse_size("61.2G") == int(61.2 * (1 << 30)) and sizes.parse_size("4096") == 4096
    with pytest.raises(ValueError, match="ambiguous"):  # one convention: binary units (distckpt.sizes)
        sizes.parse_size("61.2GB")
    with pytest.raises(ValueError):
        sizes.parse_size("ten gigs")


def test_cli_subcommand_and_exit_code(mounts, tmp_path, capsys, monkeypatch):
    parser = argparse.ArgumentParser(prog="distckpt")
    sub = parser.add_subparsers(dest="command", required=True)
    checks_cli.add_parser(sub)
    mnt = mounts.tmpfs(tmp_path / "cli", size="16m")
    args = parser.parse_args(["preflight", str(mnt), "--expected-bytes", "64M", "--json"])
    assert args.func(args) == 1
    data = json.loads(capsys.readouterr().out)
    assert not data["ok"]
    assert next(c for c in data["checks"] if c["name"] == "disk")["error"]["fields"]["needed"] == 64 * MiB
    for var in environment.TORCHRUN_VARS:  # the CLI checks the real environment
        monkeypatch.delenv(var, raising=False)
    args = parser.parse_args(["preflight", str(mnt), "--expected-bytes", "1M", "--backend", "gloo"])
    assert args.func(args) == 0
    assert "disk" in capsys.readouterr().out


def test_cli_as_a_process(mounts, tmp_path):
    mnt = mounts.tmpfs(tmp_path / "proc", size="16m")
    env = {k: v for k, v in os.environ.items() if k not in environment.TORCHRUN_VARS}
    env["PYTHONPATH"] = str(REPO_ROOT)
    run = lambda size: subprocess.run(  # noqa: E731
        [PYTHON, "-m", "distckpt.checks", str(mnt), "--expected-bytes", size],
        capture_output=True, text=True, timeout=120, env=env, cwd=str(REPO_ROOT))
    bad = run("64M")
    assert bad.returncode == 1 and "DISK" not in bad.stdout and "disk" in bad.stdout
    assert "ERROR" in bad.stdout and "remedy:" in bad.stdout and "(tmpfs)" in bad.stdout
    good = run("1M")
    assert good.returncode == 0, good.stdout + good.stderr


def test_package_exports_the_function(tmp_path):
    import distckpt
    rep = distckpt.preflight(tmp_path, env={})
    assert isinstance(rep, checks.PreflightReport) and rep.ok


def test_distckpt_variables_have_their_own_row_and_a_typo_is_counted(tmp_path, monkeypatch):
    """A bad DISTCKPT_TIMEOUT_S was reported under the io_backend row, a misspelt variable only as
    a Python warning on stderr (the report said 0 warnings), and a bad object-store knob not at all
    for a local path (an outside trial). They are the distckpt_config row's, counted."""
    from distckpt.checks import preflight
    env = {"DISTCKPT_IO_BAKCEND": "pwrite"}
    report = preflight(str(tmp_path), env=env)
    row = next(c for c in report.checks if c.name == "distckpt_config")
    assert row.status == "warning" and "DISTCKPT_IO_BACKEND" in row.message, row
    report = preflight(str(tmp_path), env={"DISTCKPT_TIMEOUT_S": "nan"})
    row = next(c for c in report.checks if c.name == "distckpt_config")
    assert row.status == "error" and "DISTCKPT_TIMEOUT_S" in row.message and not report.ok, row
    monkeypatch.setenv("DISTCKPT_OBJECT_LEASE_S", "garbage")  # read from this process's environment
    row = next(c for c in preflight(str(tmp_path)).checks if c.name == "distckpt_config")
    assert row.status == "error" and "DISTCKPT_OBJECT_LEASE_S" in row.message, row
    monkeypatch.delenv("DISTCKPT_OBJECT_LEASE_S")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DISTCKPT_")}
    row = next(c for c in preflight(str(tmp_path), env=clean).checks if c.name == "distckpt_config")
    assert row.status == "ok", row


def test_every_bad_distckpt_variable_is_named_in_one_run(tmp_path):
    """Three bad values: the row named only the first (the one load_config stops at), so a user
    fixed them one run at a time."""
    from distckpt.checks import preflight
    env = {"DISTCKPT_IO_BACKEND": "fast", "DISTCKPT_TIMEOUT_S": "nan", "DISTCKPT_BLOCK_SIZE": "3x"}
    row = next(c for c in preflight(str(tmp_path), env=env).checks if c.name == "distckpt_config")
    assert row.status == "error", row
    for name in env:
        assert name in row.message, (name, row.message)
    assert len(row.details["problems"]) == 3, row.details
