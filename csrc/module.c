/*
 * module.c: the module distckpt._uring itself: its method table, the module definition and
 * PyInit__uring (which readies the Writer and Reader types of writer.c and reader.c, runs
 * crc32c_init() and adds Writer, Reader and CRC32C_HARDWARE), and the small bindings that are no
 * object's: probe_uring (can this process use io_uring at all), crc32c (csrc/crc32c.c),
 * row_digests (csrc/rowdigest.c) and address. The file-system bindings live in fsops.c.
 *
 * fd lifecycle: probe_uring() opens one ring fd (io_uring_setup) and closes it before returning;
 * nothing else here opens a file descriptor. crc32c, row_digests and address run on memory the
 * caller keeps valid (row_digests on raw addresses, without the GIL).
 */
#include "core.h"

#include <errno.h>
#include <string.h>
#include <unistd.h>

#include "crc32c.h"
#include "rowdigest.h"

static PyObject *mod_probe_uring(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a))
{
    struct io_uring_params p;
    int fd;
    memset(&p, 0, sizeof(p));
    fd = sys_io_uring_setup(2, &p);
    if (fd < 0)
        return raise_errno_path(errno, NULL);
    close(fd);
    return PyLong_FromUnsignedLong(p.features);
}

/* Tests only: make ring_wait() use its poll(2) fallback (the path of kernels before 5.11). */
static PyObject *mod_test_poll_wait(PyObject *Py_UNUSED(m), PyObject *arg)
{
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    ring_force_poll_wait = on;
    Py_RETURN_NONE;
}

/* Below this many bytes crc32c keeps the GIL: releasing and retaking it costs about as much as
   the checksum of 4 KiB (~0.1 us), and other threads gain nothing from so short a pause. */
#define CRC32C_KEEP_GIL_BELOW (32 << 10)

/* METH_FASTCALL with its own argument checks: PyArg_ParseTuple costs as much as a 4 KiB crc. */
static PyObject *mod_crc32c(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer v;
    unsigned long crc = 0;
    int hardware = 1;
    uint32_t out;
    if (nargs < 1 || nargs > 3) {
        PyErr_Format(PyExc_TypeError, "crc32c() takes from 1 to 3 positional arguments (%zd given)", nargs);
        return NULL;
    }
    if (nargs > 1) {
        crc = PyLong_AsUnsignedLong(args[1]);
        if (crc == (unsigned long)-1 && PyErr_Occurred())
            return NULL;
        if (crc > 0xffffffffUL) {
            PyErr_SetString(PyExc_OverflowError, "crc32c: crc must fit in 32 bits");
            return NULL;
        }
    }
    if (nargs > 2 && (hardware = PyObject_IsTrue(args[2])) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[0], &v, PyBUF_SIMPLE) != 0)
        return NULL;
    PyThreadState *released = v.len >= CRC32C_KEEP_GIL_BELOW ? PyEval_SaveThread() : NULL;
    out = hardware ? crc32c_update((uint32_t)crc, v.buf, (size_t)v.len)
                   : crc32c_software((uint32_t)crc, v.buf, (size_t)v.len);
    if (released)
        PyEval_RestoreThread(released);
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLong(out);
}

static PyObject *mod_row_digests(PyObject *Py_UNUSED(m), PyObject *args)
{
    unsigned long long base, mult, out;
    Py_ssize_t n, stride, width;
    int word;
    if (!PyArg_ParseTuple(args, "KnnniKK:row_digests", &base, &n, &stride, &width, &word, &mult, &out))
        return NULL;
    if (n < 0 || width < 1 || (word != 1 && word != 2 && word != 4 && word != 8) || !mult || !out ||
        (n > 0 && !base)) {
        PyErr_SetString(PyExc_ValueError, "row_digests: n >= 0, width >= 1, word in 1/2/4/8, non-null addresses");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    row_digests((const uint8_t *)(uintptr_t)base, (size_t)n, (ptrdiff_t)stride, (size_t)width, word,
                (const uint64_t *)(uintptr_t)mult, (uint64_t *)(uintptr_t)out);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *mod_address(PyObject *Py_UNUSED(m), PyObject *arg)
{
    Py_buffer v;
    uintptr_t a;
    if (PyObject_GetBuffer(arg, &v, PyBUF_SIMPLE) != 0)
        return NULL;
    a = (uintptr_t)v.buf;
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLongLong((unsigned long long)a);
}

static PyMethodDef module_methods[] = {
    {"address", mod_address, METH_O,
     "address(buffer) -> int: the memory address of a contiguous buffer's first byte (to place a "
     "chunk in a file so that the buffer can be written zero-copy; see Writer.pad_for)."},
    {"crc32c", (PyCFunction)(void (*)(void))mod_crc32c, METH_FASTCALL,
     "crc32c(data, crc=0, hardware=True) -> int: CRC-32C of the bytes-like data (C-contiguous) "
     "continuing crc (the checksum of every checksum block, MANIFEST and index); hardware=False "
     "forces the table fallback. Raises TypeError (not a contiguous buffer, wrong argument count) "
     "and OverflowError (crc not a 32-bit unsigned int)."},
    {"row_digests", mod_row_digests, METH_VARARGS,
     "row_digests(base, n, stride, width, word, mult, out): the 64-bit digest of each of n rows "
     "at address base + i*stride (width words of word bytes, contiguous) into the uint64 array at "
     "address out, with width uint64 multipliers at address mult (csrc/rowdigest.h). Addresses "
     "are the caller's to keep valid; runs without the GIL. Raises ValueError for bad sizes."},
    {"cached_pages", mod_cached_pages, METH_VARARGS,
     "cached_pages(fd, offset, length) -> (cached, total): how many of the pages holding bytes "
     "[offset, offset+length) of fd are in the page cache (cachestat, else mincore on an untouched "
     "mapping). Raises OSError."},
    {"probe_uring", mod_probe_uring, METH_NOARGS,
     "probe_uring() -> int: io_uring_setup + close; returns the feature bits. Raises OSError "
     "(EPERM under a seccomp filter or kernel.io_uring_disabled, ENOSYS without io_uring)."},
    {"_test_poll_wait", mod_test_poll_wait, METH_O,
     "_test_poll_wait(on): tests only; True makes every ring wait poll(2) the ring fd (the deadline "
     "path of kernels without IORING_FEAT_EXT_ARG) instead of io_uring_enter's own timeout."},
    {"statx_dioalign", mod_statx_dioalign, METH_O,
     "statx_dioalign(path) -> (mem_align, offset_align, source): O_DIRECT alignment from statx "
     "STATX_DIOALIGN (source 'statx'; 0, 0 means O_DIRECT unsupported), else BLKSSZGET on the "
     "device, else st_blksize, else 4096. Raises OSError."},
    {"rename_exchange", mod_rename_exchange, METH_VARARGS,
     "rename_exchange(a, b): atomically swap two paths (renameat2 RENAME_EXCHANGE). Raises OSError."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef uring_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "distckpt._uring",
    .m_doc = "O_DIRECT io_uring writer/reader on raw syscalls (see csrc/core.h for invariants).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__uring(void)
{
    PyObject *m;
    if (PyType_Ready(&WriterType) < 0 || PyType_Ready(&ReaderType) < 0)
        return NULL;
    crc32c_init();
    ring_signal_hook = run_signal_handlers;
    m = PyModule_Create(&uring_module);
    if (!m)
        return NULL;
    if (PyModule_AddObjectRef(m, "Writer", (PyObject *)&WriterType) < 0 ||
        PyModule_AddObjectRef(m, "Reader", (PyObject *)&ReaderType) < 0 ||
        PyModule_AddIntConstant(m, "CRC32C_HARDWARE", crc32c_hardware()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
