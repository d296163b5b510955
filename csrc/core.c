/*
 * core.c: the helpers writer.c and reader.c share (see core.h): the OSError helper, the page-aligned
 * staging allocation, and io_setup(), the construction tail of a Writer or Reader.
 *
 * fd lifecycle: io_setup() is where a Writer's or Reader's file fd is opened (open(2) with the
 * flags its __init__ passes: O_CLOEXEC and O_DIRECT always), after its staging and its ring, so a
 * failure to set those up never leaves a created file behind. The fd is stored in the object only
 * on success and belongs to it from then on; io_setup() never closes anything. On a failure the
 * caller's __init__ runs its release function at once (still without the GIL), which frees the
 * staging and the ring that were set up; the object is then closed (closed=1, fd -1). The object's
 * own release function (writer_release, reader_release) is the only place its file fd is closed.
 */
#include "core.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>

PyObject *raise_errno_path(int err, PyObject *path)
{
    /* An exception already set: a signal's handler raised during a wait of this call (ring.h,
     * ring_signal_hook), which ended it (EINTR, or ETIMEDOUT once the cancelled requests outlived
     * their grace); that exception (KeyboardInterrupt...) is the one to raise. */
    if (PyErr_Occurred())
        return NULL;
    errno = err;
    if (path)
        return PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
    return PyErr_SetFromErrno(PyExc_OSError);
}

/* Allocate `size` bytes of page-aligned anonymous memory. NULL on failure (errno set). */
static char *stage_alloc(size_t size)
{
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : (char *)p;
}

/* See core.h. Staging first, then the ring, the file last (so a failure leaves no file behind);
 * on failure the caller releases whatever was set up (its release function handles partial
 * states). */
int io_setup(const char *path, int flags, size_t stage_sz, int use_uring, unsigned depth,
             char **stage, struct ring *ring, int *fdp)
{
    int fd;
    *stage = stage_alloc(stage_sz);
    if (!*stage)
        return errno;
    if (use_uring) {
        int e = ring_setup(ring, depth);
        if (e)
            return e;
    }
    fd = open(path, flags, 0644);
    if (fd < 0)
        return errno;
    *fdp = fd;
    return 0;
}

/* ring_signal_hook (ring.h): run Python's signal handlers from inside a wait that released the
 * GIL. Only the main thread runs handlers (PyErr_CheckSignals does nothing elsewhere); a handler
 * that raised leaves its exception set in this thread, which the call raises once it holds the
 * GIL again (raise_errno_path with EINTR). Returns 1 when a handler raised. */
int run_signal_handlers(void)
{
    PyGILState_STATE g = PyGILState_Ensure();
    int raised = PyErr_CheckSignals() != 0;
    PyGILState_Release(g);
    return raised;
}
