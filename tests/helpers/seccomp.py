"""Make io_uring really unavailable to one process: a seccomp filter, in pure Python (ctypes).

The filter answers io_uring_setup (x86_64 syscall 425) with EPERM, exactly what Docker's default
seccomp profile or kernel.io_uring_disabled=2 do, and allows everything else. It applies to the
calling thread and everything it later starts, so call it in a fresh child process (it cannot be
removed) before any other thread exists. The machine-wide sysctl is never touched.
"""

from __future__ import annotations

import ctypes
import errno
import platform

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2

BPF_LD_W_ABS = 0x20   # BPF_LD | BPF_W | BPF_ABS
BPF_JEQ_K = 0x15      # BPF_JMP | BPF_JEQ | BPF_K
BPF_RET_K = 0x06      # BPF_RET | BPF_K

AUDIT_ARCH_X86_64 = 0xC000003E
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
NR_IO_URING_SETUP_X86_64 = 425

# struct seccomp_data { int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]; }
_OFF_NR, _OFF_ARCH = 0, 4


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def supported() -> bool:
    """The filter is written for x86_64 syscall numbers only."""
    return platform.machine() == "x86_64"


def deny_io_uring_setup(err: int = errno.EPERM) -> None:
    """Install the filter in this process. Raises OSError if the kernel refuses it."""
    if not supported():
        raise RuntimeError("deny_io_uring_setup supports x86_64 only")
    program = [
        (BPF_LD_W_ABS, 0, 0, _OFF_ARCH),
        # Another ABI (x32/i386 via int 0x80) has other numbers: leave it alone (jump to allow).
        (BPF_JEQ_K, 0, 3, AUDIT_ARCH_X86_64),
        (BPF_LD_W_ABS, 0, 0, _OFF_NR),
        (BPF_JEQ_K, 0, 1, NR_IO_URING_SETUP_X86_64),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | (err & 0xFFFF)),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ]
    filters = (_SockFilter * len(program))(*[_SockFilter(*ins) for ins in program])
    prog = _SockFprog(len(program), filters)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    # NO_NEW_PRIVS lets an unprivileged process install a filter (and is harmless as root).
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"prctl(PR_SET_NO_NEW_PRIVS): {errno.errorcode.get(e)}")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.cast(ctypes.pointer(prog), ctypes.c_void_p), 0, 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"prctl(PR_SET_SECCOMP): {errno.errorcode.get(e)}")


