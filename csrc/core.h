/*
 * core.h: what the files of distckpt._uring share. writer.c (the Writer type), reader.c (the
 * Reader type and its fill pipeline), fsops.c (file-system calls: statx, renameat2, the page-cache
 * query) and module.c (the method table, the small bindings, the module init) each include it
 * first: it includes Python.h, which must come before any system header. ring.h is the io_uring
 * layer underneath (no Python); crc32c.h and rowdigest.h are the pure computations. core.c
 * holds the shared error helper and the construction tail of a Writer or Reader.
 *
 * The module is torch-independent: it sees bytes through the buffer protocol and nothing else,
 * and needs gcc and the Python headers to build, nothing more.
 *
 * Invariants (what distckpt.storage.posix and the tests rely on):
 *   - Every failure of a system call surfaces as OSError carrying errno and the file name; nothing
 *     here prints, aborts, or kills the process. A short read that ends before the requested bytes
 *     raises EOFError (distckpt.storage.posix turns it into DataFileTruncatedError).
 *   - The GIL is released around every copy, submit and wait. The caller's buffer stays exported
 *     (Py_buffer held) for the whole call, and every copy out of it finishes before the call
 *     returns, so no caller memory is referenced after a method returns.
 *   - No request is ever in flight when a staging buffer is unmapped or the ring fd closed: close()
 *     (and dealloc, which calls it) first waits for every outstanding completion.
 *   - Every wait for a completion has a deadline (the objects' timeout_ms, DISTCKPT_IO_TIMEOUT_S):
 *     past it the requests in flight are cancelled and the call raises OSError(ETIMEDOUT). A
 *     request that outlives its cancel's grace too leaves the object *wedged* (its `wedged`
 *     attribute): it then never unmaps its staging, never closes its ring and never releases the
 *     caller buffers of that call, so the kernel cannot write into memory that was freed or reused
 *     (a leak, by design). Its file fd is still closed by close(). A signal whose Python handler
 *     raises (Ctrl-C's KeyboardInterrupt) ends a wait the same way, and the call raises the
 *     handler's exception (run_signal_handlers); close() and dealloc wait on regardless.
 *   - close() is idempotent and releases everything the object owns (file fd, ring fd, ring
 *     mappings, staging memory). After close() the object holds no fd.
 *   - Staging buffers are mmap()ed (page aligned, so aligned for any DIO memory alignment up to the
 *     page size) and owned by the object; a writer's are stage_block bytes each (a reader's
 *     block_size), a multiple of the file system's DIO offset alignment.
 *   - One object is not safe for concurrent use from several threads; a second call while one is
 *     running with the GIL released raises RuntimeError instead of corrupting state.
 *
 * SIGXFSZ: a write past RLIMIT_FSIZE makes the kernel send SIGXFSZ, whose default action kills the
 * process. This module does NOT touch signal dispositions (that is process-global policy); CPython
 * itself ignores SIGXFSZ at start-up, and distckpt.storage.posix re-asserts SIG_IGN on first use when an
 * embedding application left it at SIG_DFL, so the write fails with EFBIG and surfaces as OSError.
 */
#ifndef DISTCKPT_CORE_H
#define DISTCKPT_CORE_H

#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdint.h>

#include "ring.h"

/* Set OSError from errno `err` (positive), with the file name when path is not NULL; returns
 * NULL so a binding can `return raise_errno_path(e, path);`. Needs the GIL. (core.c) */
PyObject *raise_errno_path(int err, PyObject *path);

/* ring_signal_hook (ring.h), set by the module init: runs Python's signal handlers (GIL taken
 * and given back); 1 when one raised, its exception left set. (core.c) */
int run_signal_handlers(void);

static inline int is_pow2(size_t v) { return v && !(v & (v - 1)); }

static inline size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

/* The shared tail of Writer and Reader construction, without the GIL (core.c): page-aligned
 * staging, then the ring (use_uring), then the file opened with `flags` last, so a failure
 * leaves no file behind. Returns 0 or an errno; *fdp is set only on success. On failure the
 * caller's release function frees whatever was set up. */
int io_setup(const char *path, int flags, size_t stage_sz, int use_uring, unsigned depth,
             char **stage, struct ring *ring, int *fdp);

/* Pages of [off, off+len) of fd in the page cache (fsops.c). Returns 0 or a positive errno;
 * no GIL needed. fd is the caller's: never closed here. */
int cached_pages(int fd, uint64_t off, uint64_t len, uint64_t *cached, uint64_t *total);

/* The types (writer.c, reader.c), readied and added by the module init (module.c). */
extern PyTypeObject WriterType;
extern PyTypeObject ReaderType;

/* fsops.c's bindings, named in module.c's method table. */
PyObject *mod_statx_dioalign(PyObject *m, PyObject *arg);
PyObject *mod_rename_exchange(PyObject *m, PyObject *args);
PyObject *mod_cached_pages(PyObject *m, PyObject *args);

#endif
