/*
 * fsops.c: the file-system calls of distckpt._uring that are not a Writer's or a Reader's:
 * statx_dioalign() (a path's O_DIRECT alignment), rename_exchange() (renameat2 RENAME_EXCHANGE),
 * and the page-cache query cached_pages() (C, also used by reader.c's fill pipeline) with its
 * binding. Each binding releases the GIL around its system calls and raises OSError with errno
 * (and the path names, where there are paths).
 *
 * fd lifecycle: statx_dioalign() opens a file descriptor only on its fallback path (kernels
 * without STATX_DIOALIGN): the block device node /dev/block/MAJOR:MINOR, O_RDONLY|O_CLOEXEC, for
 * one BLKSSZGET ioctl, closed before it returns on every path. cached_pages() borrows the
 * caller's fd and never closes it; its mincore() fallback maps the range PROT_READ, never touches
 * it (no page faulted in, no SIGBUS possible) and unmaps it before returning. rename_exchange()
 * opens nothing.
 */
#include "core.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#ifndef STATX_DIOALIGN
#define STATX_DIOALIGN 0x00002000U
#endif

PyObject *mod_statx_dioalign(PyObject *Py_UNUSED(m), PyObject *arg)
{
    PyObject *path = NULL, *res = NULL;
    struct statx stx;
    struct stat st;
    int r, e = 0;
    unsigned mem = 0, off = 0;
    const char *source = NULL;

    if (!PyUnicode_FSConverter(arg, &path))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    memset(&stx, 0, sizeof(stx));
    r = (int)syscall(__NR_statx, AT_FDCWD, PyBytes_AS_STRING(path), 0,
                     STATX_BASIC_STATS | STATX_DIOALIGN, &stx);
    if (r != 0 && errno != ENOSYS) {
        e = errno;
    } else if (r == 0 && (stx.stx_mask & STATX_DIOALIGN)) {
        /* 0/0 is the kernel saying "this file system does not support O_DIRECT". */
        mem = stx.stx_dio_mem_align;
        off = stx.stx_dio_offset_align;
        source = "statx";
    } else if (stat(PyBytes_AS_STRING(path), &st) != 0) {
        e = errno;
    } else {
        /* Older kernels: the device's logical sector size is what O_DIRECT must honour. */
        char dev[64];
        int fd, ssz = 0;
        snprintf(dev, sizeof(dev), "/dev/block/%u:%u", major(st.st_dev), minor(st.st_dev));
        fd = open(dev, O_RDONLY | O_CLOEXEC);
        if (fd >= 0 && ioctl(fd, BLKSSZGET, &ssz) == 0 && ssz > 0) {
            mem = off = (unsigned)ssz;
            source = "BLKSSZGET";
        } else if (st.st_blksize > 0) {
            mem = off = (unsigned)st.st_blksize;
            source = "st_blksize";
        } else {
            mem = off = 4096;
            source = "default";
        }
        if (fd >= 0)
            close(fd);
    }
    Py_END_ALLOW_THREADS
    if (e)
        raise_errno_path(e, path);
    else
        res = Py_BuildValue("(IIs)", mem, off, source);
    Py_DECREF(path);
    return res;
}

PyObject *mod_rename_exchange(PyObject *Py_UNUSED(m), PyObject *args)
{
    PyObject *a = NULL, *b = NULL;
    int r;
    if (!PyArg_ParseTuple(args, "O&O&:rename_exchange", PyUnicode_FSConverter, &a,
                          PyUnicode_FSConverter, &b)) {
        Py_XDECREF(a);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    r = (int)syscall(__NR_renameat2, AT_FDCWD, PyBytes_AS_STRING(a), AT_FDCWD, PyBytes_AS_STRING(b),
                     RENAME_EXCHANGE);
    Py_END_ALLOW_THREADS
    if (r != 0) {
        PyErr_SetFromErrnoWithFilenameObjects(PyExc_OSError, a, b);
        Py_DECREF(a);
        Py_DECREF(b);
        return NULL;
    }
    Py_DECREF(a);
    Py_DECREF(b);
    Py_RETURN_NONE;
}

#ifndef __NR_cachestat
#define __NR_cachestat 451 /* the same number on every architecture (asm-generic and x86) */
#endif

struct dc_cachestat_range { uint64_t off, len; };
struct dc_cachestat { uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted; };

/* Pages of [off, off+len) of fd in the page cache: cachestat(2) (Linux 6.5), else mincore(2) on a
 * PROT_READ mapping that is never touched (so no page is faulted in and no SIGBUS is possible).
 * Returns 0 or a positive errno. */
int cached_pages(int fd, uint64_t off, uint64_t len, uint64_t *cached, uint64_t *total)
{
    long page = sysconf(_SC_PAGESIZE);
    uint64_t start = off / (uint64_t)page * (uint64_t)page;
    uint64_t end = round_up((size_t)(off + len), (size_t)page);
    struct dc_cachestat_range range = {start, end - start};
    struct dc_cachestat cs;
    *total = (end - start) / (uint64_t)page;
    *cached = 0;
    if (!len)
        return 0;
    memset(&cs, 0, sizeof(cs));
    if (syscall(__NR_cachestat, fd, &range, &cs, 0) == 0) {
        *cached = cs.nr_cache;
        return 0;
    }
    if (errno != ENOSYS && errno != EPERM)
        return errno;
    {
        unsigned char *vec;
        void *map = mmap(NULL, (size_t)(end - start), PROT_READ, MAP_SHARED, fd, (off_t)start);
        int e = 0;
        if (map == MAP_FAILED)
            return errno;
        vec = malloc((size_t)*total);
        if (!vec)
            e = ENOMEM;
        else if (mincore(map, (size_t)(end - start), vec) != 0)
            e = errno;
        else
            for (uint64_t i = 0; i < *total; i++)
                *cached += vec[i] & 1;
        free(vec);
        munmap(map, (size_t)(end - start));
        return e;
    }
}

PyObject *mod_cached_pages(PyObject *Py_UNUSED(m), PyObject *args)
{
    int fd, e;
    unsigned long long off, len;
    uint64_t cached = 0, total = 0;
    if (!PyArg_ParseTuple(args, "iKK:cached_pages", &fd, &off, &len))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    e = cached_pages(fd, off, len, &cached, &total);
    Py_END_ALLOW_THREADS
    if (e)
        return raise_errno_path(e, NULL);
    return Py_BuildValue("(KK)", (unsigned long long)cached, (unsigned long long)total);
}
