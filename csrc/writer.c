/*
 * writer.c: distckpt._uring.Writer, the streaming O_DIRECT writer of a data file: appends are
 * copied into a ring of aligned staging blocks written with io_uring (or pwrite with uring=False),
 * sources of a block or more go to the disk straight from the caller's memory (zero-copy), the
 * file is preallocated ahead of the writes, staging can be registered as fixed buffers, and
 * write_checksummed() computes the crc32c of each block of the bytes while they are written.
 *
 * fd lifecycle: Writer_new marks the object as owning nothing (fd -1, closed). Writer_init opens
 * the file with O_WRONLY|O_CREAT|O_EXCL|O_DIRECT|O_CLOEXEC through io_setup() (core.c) and the
 * ring through ring_setup(); a second __init__ is refused rather than leak the first fd. The file
 * fd and the ring fd are closed only by writer_release(): from close() (which raises OSError if
 * close(2) of the file fails; the fd is gone either way), from dealloc, or from Writer_init's
 * failure path. writer_release() first waits for every write in flight, then closes the file,
 * then frees the ring, then unmaps staging (a wedged writer, whose write outlived its deadline
 * and its cancel, closes the file and keeps the rest for ever: writer_abandon()). `fileno` is a view for fstat/fsync callers: the
 * caller never closes it.
 *
 * Invariants: zero-copy writes are complete before write() returns (the caller's memory is never
 * referenced afterwards, error or not), except for a write_checksummed() given `hold`: the caller
 * then promises the bytes stay unchanged until flush(), and the writer keeps `hold` (and the
 * buffer) referenced while that source's writes are in flight, so the disk's queue does not drain
 * at the end of each large source. At most one held source has writes in flight after any call
 * returns; a held call waits for the previous one's writes before it returns, and flush(), close()
 * and an error wait for all. Staged writes may stay in flight between calls, and
 * the first error of any completion is sticky (w->err) and raised by the next call; flush() writes
 * the padded tail, waits for everything and truncates the file to its exact size, after which
 * appends are refused. See core.h for the module-wide invariants (GIL, busy flag, close()).
 */
#include "core.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include "crc32c.h"

/* Synchronous full pwrite; returns 0 or a positive errno. A write that makes no progress is
 * reported as ENOSPC, which is what every file system means by it. */
static int pwrite_all(int fd, const char *buf, size_t len, uint64_t off)
{
    while (len) {
        ssize_t n = pwrite(fd, buf, len, (off_t)off);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (n == 0)
            return ENOSPC;
        buf += n;
        len -= (size_t)n;
        off += (uint64_t)n;
    }
    return 0;
}

/* Preallocation: O_DIRECT writes that extend i_size are completed synchronously by ext4 (and
 * serialize on the inode lock), which throws away the queue depth. Growing the file ahead of the
 * writes with fallocate() turns every write into an overwrite of allocated (unwritten) blocks,
 * which ext4 and xfs run in parallel. The file is truncated to its exact size at finish().
 * fallocate is advisory here: if the file system refuses it or is nearly full, the writer just
 * stops preallocating and the real write reports the real error. */
#define PREALLOC_MIN (64ULL << 20)
#define PREALLOC_MAX (256ULL << 20)

typedef struct {
    PyObject_HEAD
    PyObject *path;          /* str/bytes path, for error messages */
    int fd;                  /* file fd, -1 when closed */
    int closed;
    int busy;                /* a call is running with the GIL released */
    int use_uring;
    int flushed;             /* flush() ran: the file is complete, no more appends */
    int fixed;               /* staging registered with IORING_REGISTER_BUFFERS */
    int want_fixed;          /* fixed_buffers=True: register at the first full staging block */
    int fixed_errno;         /* why the kernel refused the registration (0: not refused) */
    int prealloc;            /* fallocate ahead still enabled */
    int wedged;              /* a write outlived its deadline and its cancel: see writer_abandon */
    int releasing;           /* writer_release() drains: waits no signal may end (dealloc raises nothing) */
    unsigned timeout_ms;     /* deadline of the wait for any one completion (0: none) */
    struct ring ring;
    size_t block_size;       /* largest zero-copy request; sources >= it may skip staging */
    size_t stage_block;      /* bytes per staging block (one staged request), <= block_size */
    unsigned queue_depth;
    unsigned nblocks;        /* staging blocks: up to nblocks - 1 staged writes in flight */
    size_t offset_align;
    char *stage;             /* nblocks * stage_block, page aligned */
    size_t stage_sz;
    unsigned char *inflight; /* per block: a write from it is in flight */
    uint64_t *blk_off;       /* per block: file offset of its in-flight write */
    unsigned *blk_len;       /* per block: length of its in-flight write */
    unsigned cur;            /* block being filled */
    size_t fill;             /* bytes in the block being filled */
    uint64_t pos;            /* logical bytes written (tell()) */
    uint64_t blk_start;      /* file offset of the block being filled */
    uint64_t alloc_end;      /* file preallocated up to here */
    uint64_t prealloc_max;   /* largest fallocate step */
    unsigned ninflight;      /* staging + direct writes in flight (<= queue_depth) */
    int err;                 /* first deferred error (positive errno), sticky */
    size_t mem_align;        /* O_DIRECT memory alignment; 0 disables the zero-copy path */
    size_t zc_min;           /* smallest source written zero-copy (>= block_size): see writer_append */
    /* Zero-copy writes straight from the caller's buffer, user_data nblocks + k. They are all
     * complete before write() returns, so the caller's memory is never referenced afterwards. */
    unsigned char *d_inflight;
    const char **d_src;
    uint64_t *d_off;
    unsigned *d_len;
    unsigned *d_gen;         /* per direct slot: the append call (w->gen) that submitted it */
    unsigned d_count;
    unsigned gen;            /* append calls so far */
    /* The held source (write_checksummed(..., hold)): referenced while its zero-copy writes are in
     * flight across calls; released (GIL held) once none is. */
    PyObject *held;
    Py_buffer held_view;
    struct wcrc *crc;        /* write_checksummed(): checksums of the bytes being appended */
} WriterObject;

/* write_checksummed(): the crc32c of each `block` bytes of the caller's buffer, computed while
 * its bytes are written: zero-copy, over the part already submitted while the queue is full
 * (the CPU checksums while the disk works); staged, over each piece just before it is copied
 * into staging (so the copy reads it from cache). One pass over the bytes, none while idle. */
struct wcrc {
    const char *base;  /* the caller's buffer */
    size_t done;       /* bytes of it checksummed */
    size_t block;
    uint32_t cur;      /* crc of the current partial block */
    size_t in;         /* bytes in the current partial block */
    uint32_t *out;
    size_t nout;
};

#define WCRC_PIECE (256u << 10) /* staged copies run in pieces this size when checksumming */

static void wcrc_advance(struct wcrc *c, size_t upto)
{
    while (c->done < upto) {
        size_t take = c->block - c->in;
        if (take > upto - c->done)
            take = upto - c->done;
        c->cur = crc32c_update(c->cur, c->base + c->done, take);
        c->done += take;
        c->in += take;
        if (c->in == c->block) {
            c->out[c->nout++] = c->cur;
            c->cur = 0;
            c->in = 0;
        }
    }
}

/* Reap every available completion. GIL not needed. */
static void writer_reap(WriterObject *w)
{
    uint64_t ud;
    int32_t res;
    while (ring_pop(&w->ring, &ud, &res)) {
        unsigned b = (unsigned)ud;
        if (b >= w->nblocks) {
            unsigned k = b - w->nblocks;
            if (k >= w->queue_depth || !w->d_inflight[k])
                continue; /* cannot happen: user_data is always a request we submitted */
            w->d_inflight[k] = 0;
            w->d_count--;
            w->ninflight--;
            if (res < 0) {
                if (!w->err)
                    w->err = -res;
            } else if ((unsigned)res < w->d_len[k] && !w->err) {
                int e = pwrite_all(w->fd, w->d_src[k] + res, w->d_len[k] - (unsigned)res,
                                   w->d_off[k] + (uint64_t)res);
                if (e)
                    w->err = e;
            }
            continue;
        }
        if (!w->inflight[b])
            continue;
        w->inflight[b] = 0;
        w->ninflight--;
        if (res < 0) {
            if (!w->err)
                w->err = -res;
        } else if ((unsigned)res < w->blk_len[b] && !w->err) {
            /* Short write (the device filled up mid-request): finish it synchronously so the
             * true errno (ENOSPC, EFBIG...) is reported rather than a silent hole. */
            int e = pwrite_all(w->fd, w->stage + (size_t)b * w->stage_block + res,
                               w->blk_len[b] - (unsigned)res, w->blk_off[b] + (uint64_t)res);
            if (e)
                w->err = e;
        }
    }
}

/* No completion came within the deadline (err ETIMEDOUT), or a signal's handler raised during
 * the wait (err EINTR): fail the writer with err (sticky) and try to end what is in flight. The
 * cancelled writes complete with -ECANCELED (or as done) within the grace; if some still do not,
 * the writer is wedged: its staging, its ring and the held source are never released
 * (writer_release(), writer_keep()), so the kernel can never touch memory that was freed or
 * reused. A leak of one writer's few MiB, never a use after free. */
static void writer_abandon(WriterObject *w, int err)
{
    w->err = err; /* before reaping, so the cancelled writes' -ECANCELED is not the error */
    if (ring_cancel_all(&w->ring) == 0) {
        int64_t until = ring_deadline(RING_CANCEL_GRACE_MS);
        while (w->ninflight && ring_wait(&w->ring, ring_ms_until(until), 0) == 0)
            writer_reap(w);
    }
    if (w->ninflight)
        w->wedged = 1;
}

/* Wait for one completion. Returns 0, ETIMEDOUT when none came within the writer's deadline,
 * EINTR when a signal's handler raised meanwhile (the writer is failed either way:
 * writer_abandon), or a positive errno of io_uring_enter itself. */
static int writer_wait_one(WriterObject *w)
{
    int e;
    if (w->wedged)
        return w->err ? w->err : ETIMEDOUT;
    e = ring_wait(&w->ring, w->timeout_ms, !w->releasing);
    if (e == ETIME || e == EINTR) {
        e = e == ETIME ? ETIMEDOUT : EINTR;
        writer_abandon(w, e);
        return e;
    }
    if (e)
        return e;
    writer_reap(w);
    return 0;
}

/* Wait until nothing is in flight. A failure of io_uring_enter itself (should never happen once
 * the ring exists) is returned; completions' errors go to w->err. */
static int writer_drain(WriterObject *w)
{
    while (w->use_uring && w->ninflight) {
        int e = writer_wait_one(w);
        if (e)
            return e;
    }
    return 0;
}

static void writer_prealloc(WriterObject *w, uint64_t end)
{
    uint64_t step, target;
    if (!w->prealloc || end <= w->alloc_end)
        return;
    step = w->alloc_end < PREALLOC_MIN ? PREALLOC_MIN : w->alloc_end;
    if (step > w->prealloc_max)
        step = w->prealloc_max;
    target = w->alloc_end + step;
    if (target < end)
        target = end;
    if (fallocate(w->fd, 0, 0, (off_t)target) != 0) {
        w->prealloc = 0; /* advisory: see PREALLOC_MIN */
        return;
    }
    w->alloc_end = target;
}

/* Registering the staging blocks pins their pages once instead of on every request. It is done
 * lazily, at the first full staging block with nothing in flight: a small file (only a tail) or a
 * file written entirely through the zero-copy path would pay the pinning (tens of ms for 36 MiB)
 * for nothing. Optional: RLIMIT_MEMLOCK may refuse it for unprivileged users, and then plain
 * WRITE is used (w->fixed says which). */
static void writer_register(WriterObject *w)
{
    struct iovec *iov;
    w->want_fixed = 0;
    iov = PyMem_RawMalloc(w->nblocks * sizeof(struct iovec));
    if (!iov)
        return;
    for (unsigned i = 0; i < w->nblocks; i++) {
        iov[i].iov_base = w->stage + (size_t)i * w->stage_block;
        iov[i].iov_len = w->stage_block;
    }
    w->fixed = sys_io_uring_register(w->ring.fd, IORING_REGISTER_BUFFERS, iov, w->nblocks) == 0;
    w->fixed_errno = w->fixed ? 0 : errno;
    PyMem_RawFree(iov);
}

/* Write block b (len bytes, a multiple of offset_align) at file offset off. */
static int writer_submit(WriterObject *w, unsigned b, unsigned len, uint64_t off)
{
    char *buf = w->stage + (size_t)b * w->stage_block;
    int e;
    if (!w->use_uring)
        return pwrite_all(w->fd, buf, len, off);
    if (w->want_fixed && len == w->stage_block) {
        if (w->ninflight == 0)
            writer_register(w);
        else
            w->want_fixed = 0; /* not worth a quiesce of the ring */
    }
    /* Keep the preallocated region a full queue ahead of the writes (full blocks only: a small
     * file, whose only write is its tail, is not worth a fallocate). */
    if (len == w->stage_block)
        writer_prealloc(w, off + (uint64_t)w->block_size * (w->queue_depth + 1));
    w->blk_off[b] = off;
    w->blk_len[b] = len;
    e = ring_submit(&w->ring, w->fixed ? IORING_OP_WRITE_FIXED : IORING_OP_WRITE, w->fd, buf, len,
                    off, b, w->fixed ? (int)b : -1);
    if (e)
        return e;
    w->inflight[b] = 1;
    w->ninflight++;
    return 0;
}

/* Zero-copy: write the offset-aligned prefix of src straight from the caller's memory. Called
 * only when src is mem_align-aligned and the file position is offset_align-aligned. Returns the
 * number of bytes consumed (all written, none in flight) and sets w->err on failure. */
static size_t writer_direct(WriterObject *w, const char *src, size_t n)
{
    size_t total = n / w->offset_align * w->offset_align, done = 0;
    int e;
    if (w->fill) {
        /* Hand the partly filled staging block to the kernel as it is (its length is aligned). */
        e = writer_submit(w, w->cur, (unsigned)w->fill, w->blk_start);
        if (e) {
            w->err = e;
            return 0;
        }
        w->blk_start += w->fill;
        w->fill = 0;
        w->cur = (w->cur + 1) % w->nblocks;
        while (w->use_uring && w->inflight[w->cur] && !w->err) {
            if ((e = writer_wait_one(w)) != 0)
                w->err = e;
        }
        if (w->err)
            return 0;
    }
    while (done < total && !w->err) {
        size_t len = total - done < w->block_size ? total - done : w->block_size;
        if (!w->use_uring) {
            e = pwrite_all(w->fd, src + done, len, w->blk_start);
        } else {
            unsigned k = 0;
            if (w->crc && w->ninflight >= w->queue_depth)
                wcrc_advance(w->crc, (size_t)(src + done - w->crc->base)); /* while the disk works */
            while (w->ninflight >= w->queue_depth && !w->err) {
                if ((e = writer_wait_one(w)) != 0)
                    w->err = e;
            }
            if (w->err)
                break;
            while (w->d_inflight[k])
                k++; /* fewer than queue_depth direct writes are in flight: one slot is free */
            writer_prealloc(w, w->blk_start + (uint64_t)w->block_size * (w->queue_depth + 1));
            e = ring_submit(&w->ring, IORING_OP_WRITE, w->fd, (void *)(uintptr_t)(src + done), (unsigned)len,
                            w->blk_start, w->nblocks + k, -1);
            if (!e) {
                w->d_inflight[k] = 1;
                w->d_src[k] = src + done;
                w->d_off[k] = w->blk_start;
                w->d_len[k] = (unsigned)len;
                w->d_gen[k] = w->gen;
                w->d_count++;
                w->ninflight++;
            }
        }
        if (e) {
            w->err = e;
            break;
        }
        w->blk_start += len;
        w->pos += len;
        done += len;
    }
    if (w->crc && !w->err)
        wcrc_advance(w->crc, (size_t)(src + done - w->crc->base));
    return done; /* writes may still be in flight: writer_settle() decides how long they may stay */
}

/* Which direct writes are in flight: *cur those of this call (w->gen), *old earlier calls'. */
static void writer_direct_gens(WriterObject *w, int *cur, int *old)
{
    *cur = *old = 0;
    for (unsigned k = 0; k < w->queue_depth && (!*cur || !*old); k++) {
        if (w->d_inflight[k]) {
            if (w->d_gen[k] == w->gen)
                *cur = 1;
            else
                *old = 1;
        }
    }
}

/* End of an append call (GIL released): the only direct writes left in flight are those of one
 * source whose memory the caller promised (hold) and the writer will keep referenced. Without
 * hold, this call's own writes complete (the caller's buffer is never referenced after return,
 * error or not); an earlier held source's may stay. With hold, this call's writes may stay, so
 * the earlier held source's must complete (one held source at a time). After an error nothing is
 * left in flight. */
static void writer_settle(WriterObject *w, int hold)
{
    while (w->use_uring && w->d_count) {
        int cur, old, e;
        writer_direct_gens(w, &cur, &old);
        if (!(w->err ? (cur || old) : hold ? (cur && old) : cur))
            return;
        if ((e = writer_wait_one(w)) != 0) {
            if (!w->err)
                w->err = e;
            return; /* io_uring_enter itself failed: writer_release() waits again */
        }
    }
}

/* After an append call, with the GIL: take over `view` (and a reference to `hold`) as the held
 * source if this call left writes in flight, releasing the previous held source, whose writes
 * writer_settle() completed; otherwise release `view` and, once nothing direct is in flight, the
 * previous held source. */
static void writer_keep(WriterObject *w, PyObject *hold, Py_buffer *view)
{
    int cur = 0, old = 0;
    if (w->use_uring && w->d_inflight)
        writer_direct_gens(w, &cur, &old);
    if (cur && (!hold || old)) {
        /* Only after io_uring_enter itself failed or a write outlived its deadline and its cancel
         * (wedged), so writer_settle() could not wait: the kernel may still read this buffer. It
         * is never released: a leak, never a use after free. */
        if (hold)
            Py_INCREF(hold);
        return;
    }
    if (cur) {
        if (w->held) {
            PyBuffer_Release(&w->held_view);
            Py_CLEAR(w->held);
        }
        Py_INCREF(hold);
        w->held = hold;
        w->held_view = *view; /* ownership moves: released when the writes are done */
        return;
    }
    if (view)
        PyBuffer_Release(view);
    if (w->held && !cur && !old) {
        PyBuffer_Release(&w->held_view);
        Py_CLEAR(w->held);
    }
}

/* Copy n bytes from src (or zeros when src is NULL) into staging, submitting each full block.
 * GIL released by the caller. Returns 0 or a positive errno (sticky). */
static int writer_stage(WriterObject *w, const char *src, size_t n)
{
    while (n) {
        size_t room = w->stage_block - w->fill, c = n < room ? n : room;
        char *dst = w->stage + (size_t)w->cur * w->stage_block + w->fill;
        if (w->err)
            return w->err;
        if (src && w->crc) {
            if (c > WCRC_PIECE)
                c = WCRC_PIECE;
            wcrc_advance(w->crc, (size_t)(src + c - w->crc->base));
        }
        if (src) {
            memcpy(dst, src, c);
            src += c;
        } else {
            memset(dst, 0, c);
        }
        w->fill += c;
        w->pos += c;
        n -= c;
        if (w->fill == w->stage_block) {
            int e = writer_submit(w, w->cur, (unsigned)w->stage_block, w->blk_start);
            if (e) {
                w->err = e;
                return e;
            }
            w->blk_start += w->stage_block;
            w->fill = 0;
            w->cur = (w->cur + 1) % w->nblocks;
            /* The next block may still be in flight from nblocks writes ago. */
            while (w->use_uring && w->inflight[w->cur]) {
                e = writer_wait_one(w);
                if (e) {
                    w->err = e;
                    return e;
                }
            }
        }
    }
    return w->err;
}

/* Append n bytes from src (or zeros when src is NULL). GIL released by the caller. Returns 0 or a
 * positive errno; an error is sticky.
 *
 * A source of at least zc_min bytes goes to the disk straight from its memory (zero-copy) from its
 * first byte that is mem_align-aligned, provided that byte lands on an offset_align-aligned file
 * position: the bytes before it (the head) are staged. A caller places a chunk so (see
 * distckpt.storage.posix.Writer.pad_for); torch's large CPU tensors sit 64 bytes past a page.
 * Without `hold`, zero-copy writes are all complete when the call returns, so the disk's queue
 * empties at the end of each such source; with `hold` they may stay in flight (writer_settle), as
 * staged writes always do. Sources under zc_min (at least block_size; Python passes
 * DISTCKPT_ZERO_COPY_MIN, by default one request) are staged. */
static int writer_append(WriterObject *w, const char *src, size_t n, int hold)
{
    w->gen++;
    if (src && w->mem_align && !w->err) {
        size_t head = (w->mem_align - (uintptr_t)src % w->mem_align) % w->mem_align;
        if (head && n >= head + w->zc_min && (w->fill + head) % w->offset_align == 0) {
            if (writer_stage(w, src, head)) {
                writer_settle(w, 0);
                return w->err;
            }
            src += head;
            n -= head;
        }
        if (n >= w->zc_min && (uintptr_t)src % w->mem_align == 0 && w->fill % w->offset_align == 0) {
            size_t done = writer_direct(w, src, n);
            src += done;
            n -= done;
        }
    }
    (void)writer_stage(w, src, n);
    if (w->use_uring)
        writer_reap(w); /* surface completed errors early; never blocks */
    writer_settle(w, hold);
    return w->err;
}

/* Release everything. Safe to call twice; the GIL may or may not be held (no Python calls). */
static int writer_release(WriterObject *w)
{
    int err = 0;
    if (w->closed)
        return 0;
    w->closed = 1;
    w->releasing = 1;
    /* Never unmap staging or close the ring with requests in flight. */
    if (w->ring.fd >= 0)
        (void)writer_drain(w);
    if (w->fd >= 0) {
        /* Closing the file is safe even when wedged: a request holds its own file reference. */
        if (close(w->fd) != 0)
            err = errno;
        w->fd = -1;
    }
    if (w->wedged || (w->use_uring && w->ninflight)) {
        /* A write is still in flight (its deadline and its cancel passed, or io_uring_enter
         * itself failed): the ring, staging and the bookkeeping stay allocated for ever. */
        w->wedged = 1;
        return err;
    }
    ring_free(&w->ring);
    if (w->stage) {
        munmap(w->stage, w->stage_sz);
        w->stage = NULL;
    }
    PyMem_RawFree(w->inflight);
    PyMem_RawFree(w->blk_off);
    PyMem_RawFree(w->blk_len);
    PyMem_RawFree(w->d_inflight);
    PyMem_RawFree((void *)w->d_src);
    PyMem_RawFree(w->d_off);
    PyMem_RawFree(w->d_len);
    PyMem_RawFree(w->d_gen);
    w->d_gen = NULL;
    w->inflight = NULL;
    w->blk_off = NULL;
    w->blk_len = NULL;
    w->d_inflight = NULL;
    w->d_src = NULL;
    w->d_off = NULL;
    w->d_len = NULL;
    return err;
}

/* After writer_release() (GIL held): nothing is in flight any more; let the held source go. */
static void writer_drop_held(WriterObject *w)
{
    if (w->held && !w->wedged) { /* wedged: the kernel may still read it (writer_abandon) */
        PyBuffer_Release(&w->held_view);
        Py_CLEAR(w->held);
    }
}

static int writer_enter(WriterObject *w)
{
    if (w->closed) {
        PyErr_SetString(PyExc_ValueError, "I/O operation on closed writer");
        return -1;
    }
    if (w->busy) {
        PyErr_SetString(PyExc_RuntimeError, "writer is in use by another thread");
        return -1;
    }
    w->busy = 1;
    return 0;
}

/* tp_new zero-fills; 0 is a valid fd, so mark "nothing owned" before any __init__ can fail. */
static PyObject *Writer_new(PyTypeObject *type, PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kwds))
{
    WriterObject *w = (WriterObject *)type->tp_alloc(type, 0);
    if (w) {
        w->fd = -1;
        w->closed = 1;
        ring_init_empty(&w->ring);
    }
    return (PyObject *)w;
}

/* Appends after flush() would land after the padded tail, not at tell(): refuse them. */
static int writer_enter_append(WriterObject *w)
{
    if (!w->closed && w->flushed) {
        PyErr_SetString(PyExc_ValueError, "write after flush(): the file is already complete");
        return -1;
    }
    return writer_enter(w);
}

static int Writer_init(WriterObject *w, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"path", "block_size", "queue_depth", "offset_align", "uring",
                             "fixed_buffers", "prealloc_max", "mem_align", "stage_block", "stage_blocks",
                             "zero_copy_min", "timeout_ms", NULL};
    PyObject *path = NULL;
    Py_ssize_t block_size = 4 << 20, queue_depth = 8, offset_align = 4096;
    Py_ssize_t stage_block = 0, stage_blocks = 0; /* 0: block_size, queue_depth + 1 */
    Py_ssize_t zero_copy_min = 0;                 /* 0: block_size */
    unsigned int timeout_ms = 0;                  /* 0: no deadline */
    long long prealloc_max = (long long)PREALLOC_MAX;
    Py_ssize_t mem_align = 0;
    int use_uring = 1, fixed = 0, e = 0;
    long page = sysconf(_SC_PAGESIZE);

    if (w->path) { /* __init__ called twice: refuse rather than leak the first fd */
        PyErr_SetString(PyExc_RuntimeError, "Writer already initialized");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&|nnnppLnnnnI:Writer", kwlist, PyUnicode_FSConverter,
                                     &path, &block_size, &queue_depth, &offset_align, &use_uring,
                                     &fixed, &prealloc_max, &mem_align, &stage_block, &stage_blocks,
                                     &zero_copy_min, &timeout_ms))
        return -1;
    w->path = path; /* owned; bytes */
    if (offset_align <= 0 || !is_pow2((size_t)offset_align) || block_size <= 0 ||
        !is_pow2((size_t)block_size) || block_size < page || block_size < offset_align ||
        block_size > (1 << 30) || queue_depth < 1 || queue_depth > 4096 || mem_align < 0 ||
        (mem_align && !is_pow2((size_t)mem_align))) {
        PyErr_SetString(PyExc_ValueError,
                        "block_size must be a power of two >= page size and >= offset_align "
                        "(a power of two), <= 1 GiB; queue_depth between 1 and 4096; mem_align "
                        "0 or a power of two");
        return -1;
    }
    if (stage_block == 0)
        stage_block = block_size;
    if (stage_blocks == 0)
        stage_blocks = queue_depth + 1;
    if (stage_block < 0 || !is_pow2((size_t)stage_block) || stage_block < page || stage_block < offset_align ||
        stage_block > block_size || stage_blocks < 2 || stage_blocks > queue_depth + 1) {
        PyErr_SetString(PyExc_ValueError,
                        "stage_block must be a power of two >= page size and >= offset_align, <= block_size; "
                        "stage_blocks between 2 and queue_depth + 1");
        return -1;
    }
    if (zero_copy_min == 0)
        zero_copy_min = block_size;
    if (zero_copy_min < block_size) {
        PyErr_SetString(PyExc_ValueError, "zero_copy_min must be 0 (block_size) or >= block_size");
        return -1;
    }
    w->block_size = (size_t)block_size;
    w->zc_min = (size_t)zero_copy_min;
    w->timeout_ms = timeout_ms;
    w->stage_block = (size_t)stage_block;
    w->offset_align = (size_t)offset_align;
    w->mem_align = (size_t)mem_align;
    w->use_uring = use_uring;
    w->queue_depth = use_uring ? (unsigned)queue_depth : 1;
    /* stage_blocks - 1 staged writes in flight plus the block being filled (pwrite: one). The
     * staging ring is the writer's whole memory cost; it is sized apart from the zero-copy
     * request size, so small staging does not shrink the large direct writes. */
    w->nblocks = use_uring ? (unsigned)stage_blocks : 1;
    w->stage_sz = w->nblocks * w->stage_block;
    /* prealloc_max=0 disables preallocation. */
    w->prealloc = use_uring && prealloc_max > 0;
    w->prealloc_max = prealloc_max > 0 ? (uint64_t)prealloc_max : 0;
    w->closed = 0;
    w->want_fixed = use_uring && fixed;

    w->inflight = PyMem_RawCalloc(w->nblocks, 1);
    w->blk_off = PyMem_RawCalloc(w->nblocks, sizeof(uint64_t));
    w->blk_len = PyMem_RawCalloc(w->nblocks, sizeof(unsigned));
    w->d_inflight = PyMem_RawCalloc(w->queue_depth, 1);
    w->d_src = PyMem_RawCalloc(w->queue_depth, sizeof(char *));
    w->d_off = PyMem_RawCalloc(w->queue_depth, sizeof(uint64_t));
    w->d_len = PyMem_RawCalloc(w->queue_depth, sizeof(unsigned));
    w->d_gen = PyMem_RawCalloc(w->queue_depth, sizeof(unsigned));
    if (!w->inflight || !w->blk_off || !w->blk_len || !w->d_inflight || !w->d_src || !w->d_off ||
        !w->d_len || !w->d_gen) {
        writer_release(w);
        PyErr_NoMemory();
        return -1;
    }
    Py_BEGIN_ALLOW_THREADS
    e = io_setup(PyBytes_AS_STRING(path), O_WRONLY | O_CREAT | O_EXCL | O_DIRECT | O_CLOEXEC, w->stage_sz,
                 use_uring, w->queue_depth, &w->stage, &w->ring, &w->fd);
    if (e)
        writer_release(w);
    Py_END_ALLOW_THREADS
    if (e) {
        raise_errno_path(e, path);
        return -1;
    }
    return 0;
}

static PyObject *Writer_write(WriterObject *w, PyObject *arg)
{
    Py_buffer view;
    int e;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) != 0)
        return NULL;
    if (writer_enter_append(w) != 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    e = writer_append(w, (const char *)view.buf, (size_t)view.len, 0);
    Py_END_ALLOW_THREADS
    w->busy = 0;
    writer_keep(w, NULL, &view);
    if (e)
        return raise_errno_path(e, w->path);
    return PyLong_FromUnsignedLongLong(w->pos);
}

static PyObject *Writer_write_checksummed(WriterObject *w, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t block;
    struct wcrc c;
    PyObject *crcs = NULL, *result = NULL, *hold = Py_None;
    int e;
    if (!PyArg_ParseTuple(args, "y*n|O:write_checksummed", &view, &block, &hold))
        return NULL;
    if (hold == Py_None)
        hold = NULL;
    if (block <= 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "block must be positive");
        return NULL;
    }
    memset(&c, 0, sizeof(c));
    c.base = view.buf;
    c.block = (size_t)block;
    c.out = PyMem_Malloc(((size_t)view.len / (size_t)block + 1) * sizeof(uint32_t));
    if (!c.out) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    if (writer_enter_append(w) != 0) {
        PyMem_Free(c.out);
        PyBuffer_Release(&view);
        return NULL;
    }
    w->crc = &c;
    Py_BEGIN_ALLOW_THREADS
    e = writer_append(w, (const char *)view.buf, (size_t)view.len, hold != NULL);
    if (!e) {
        wcrc_advance(&c, (size_t)view.len);
        if (c.in)
            c.out[c.nout++] = c.cur;
    }
    Py_END_ALLOW_THREADS
    w->crc = NULL;
    w->busy = 0;
    writer_keep(w, hold, &view);
    if (e) {
        PyMem_Free(c.out);
        return raise_errno_path(e, w->path);
    }
    crcs = PyTuple_New((Py_ssize_t)c.nout);
    if (crcs) {
        for (size_t i = 0; i < c.nout; i++) {
            PyObject *v = PyLong_FromUnsignedLong(c.out[i]);
            if (!v) {
                Py_CLEAR(crcs);
                break;
            }
            PyTuple_SET_ITEM(crcs, (Py_ssize_t)i, v);
        }
    }
    PyMem_Free(c.out);
    if (crcs)
        result = Py_BuildValue("(KN)", (unsigned long long)w->pos, crcs);
    return result;
}

static PyObject *Writer_zeros(WriterObject *w, PyObject *arg)
{
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    int e;
    if (n < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "zeros(n) needs n >= 0");
        return NULL;
    }
    if (writer_enter_append(w) != 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    e = writer_append(w, NULL, (size_t)n, 0);
    Py_END_ALLOW_THREADS
    w->busy = 0;
    if (e)
        return raise_errno_path(e, w->path);
    return PyLong_FromUnsignedLongLong(w->pos);
}

/* Preallocate the whole file at once when the caller knows its size: one fallocate instead of
 * growing it in steps (each of which waits for the writes in flight). ENOSPC here is a real and
 * early answer (the file cannot fit), so it is raised; a file system without fallocate
 * (EOPNOTSUPP) just gets no preallocation. After a reservation nothing is preallocated ahead. */
static PyObject *Writer_reserve(WriterObject *w, PyObject *arg)
{
    long long n = PyLong_AsLongLong(arg);
    int e = 0;
    if (n < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "reserve(n) needs n >= 0");
        return NULL;
    }
    if (writer_enter(w) != 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (n > 0 && (uint64_t)n > w->alloc_end) {
        if (fallocate(w->fd, 0, 0, (off_t)n) == 0) {
            w->alloc_end = (uint64_t)n;
            /* The file's size is known and allocated: growing it further ahead would only take
             * free space that the other ranks' files (and every other writer of this file system)
             * need, and fail their exact allocations on a nearly full disk. */
            w->prealloc = 0;
        } else if (errno == EOPNOTSUPP || errno == ENOSYS) {
            w->prealloc = 0;
        } else {
            e = errno;
        }
    }
    Py_END_ALLOW_THREADS
    w->busy = 0;
    if (e)
        return raise_errno_path(e, w->path);
    Py_RETURN_NONE;
}

static PyObject *Writer_tell(WriterObject *w, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromUnsignedLongLong(w->pos);
}

/* Write the tail block padded to offset_align, wait for everything, truncate to the exact size. */
static PyObject *Writer_flush(WriterObject *w, PyObject *Py_UNUSED(ignored))
{
    int e = 0;
    if (writer_enter(w) != 0)
        return NULL;
    w->flushed = 1;
    Py_BEGIN_ALLOW_THREADS
    e = w->err;
    if (!e && w->fill) {
        size_t padded = round_up(w->fill, w->offset_align);
        memset(w->stage + (size_t)w->cur * w->stage_block + w->fill, 0, padded - w->fill);
        e = writer_submit(w, w->cur, (unsigned)padded, w->blk_start);
        if (!e) {
            /* The tail is in flight; flushed=1 forbids further appends. */
            w->blk_start += w->fill;
            w->fill = 0;
            w->cur = (w->cur + 1) % w->nblocks;
        }
    }
    if (!e)
        e = writer_drain(w);
    if (!e)
        e = w->err;
    /* Exact size: drops the padding of the tail and any preallocation beyond it. */
    if (!e && ftruncate(w->fd, (off_t)w->pos) != 0)
        e = errno;
    if (e && !w->err)
        w->err = e;
    Py_END_ALLOW_THREADS
    w->busy = 0;
    writer_keep(w, NULL, NULL);
    if (e)
        return raise_errno_path(e, w->path);
    return PyLong_FromUnsignedLongLong(w->pos);
}

static PyObject *Writer_fsync(WriterObject *w, PyObject *Py_UNUSED(ignored))
{
    int e = 0;
    if (writer_enter(w) != 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (fsync(w->fd) != 0)
        e = errno;
    Py_END_ALLOW_THREADS
    w->busy = 0;
    if (e)
        return raise_errno_path(e, w->path);
    Py_RETURN_NONE;
}

static PyObject *Writer_close(WriterObject *w, PyObject *Py_UNUSED(ignored))
{
    int e;
    if (w->busy) {
        PyErr_SetString(PyExc_RuntimeError, "writer is in use by another thread");
        return NULL;
    }
    if (w->closed)
        Py_RETURN_NONE;
    Py_BEGIN_ALLOW_THREADS
    e = writer_release(w);
    Py_END_ALLOW_THREADS
    writer_drop_held(w);
    if (e)
        return raise_errno_path(e, w->path);
    Py_RETURN_NONE;
}

static PyObject *Writer_get_closed(WriterObject *w, void *Py_UNUSED(c)) { return PyBool_FromLong(w->closed); }
static PyObject *Writer_get_fileno(WriterObject *w, void *Py_UNUSED(c)) { return PyLong_FromLong(w->fd); }
static PyObject *Writer_get_fixed(WriterObject *w, void *Py_UNUSED(c)) { return PyBool_FromLong(w->fixed); }
static PyObject *Writer_get_fixed_errno(WriterObject *w, void *Py_UNUSED(c)) { return PyLong_FromLong(w->fixed_errno); }
static PyObject *Writer_get_wedged(WriterObject *w, void *Py_UNUSED(c)) { return PyBool_FromLong(w->wedged); }
static PyObject *Writer_get_holding(WriterObject *w, void *Py_UNUSED(c)) { return PyBool_FromLong(w->held != NULL); }
static PyObject *Writer_get_direct_sources(WriterObject *w, void *Py_UNUSED(c))
{
    int cur = 0, old = 0;
    if (w->use_uring && w->d_inflight)
        writer_direct_gens(w, &cur, &old);
    return PyLong_FromLong(cur + old);
}

static void Writer_dealloc(WriterObject *w)
{
    writer_release(w);
    writer_drop_held(w);
    Py_CLEAR(w->path);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyMethodDef Writer_methods[] = {
    {"write", (PyCFunction)Writer_write, METH_O,
     "write(buffer) -> int: append a C-contiguous buffer; returns the new position. Raises OSError."},
    {"write_checksummed", (PyCFunction)Writer_write_checksummed, METH_VARARGS,
     "write_checksummed(buffer, block, hold=None) -> (position, crcs): write(buffer), and the crc32c "
     "of each block bytes of it (the last one partial), computed while the bytes are being written. "
     "With hold (any object that keeps buffer's memory alive; the caller promises the bytes stay "
     "unchanged until flush()), zero-copy writes of buffer may stay in flight after return: the "
     "writer references hold and buffer until they are done (at most one such source at a time)."},
    {"zeros", (PyCFunction)Writer_zeros, METH_O, "zeros(n) -> int: append n zero bytes."},
    {"tell", (PyCFunction)Writer_tell, METH_NOARGS, "tell() -> int: bytes appended so far."},
    {"reserve", (PyCFunction)Writer_reserve, METH_O,
     "reserve(nbytes): fallocate the file to nbytes up front (the final ftruncate trims it)."},
    {"flush", (PyCFunction)Writer_flush, METH_NOARGS,
     "flush() -> int: write the padded tail, wait for all writes, ftruncate to the exact size."},
    {"fsync", (PyCFunction)Writer_fsync, METH_NOARGS, "fsync(): fsync the file."},
    {"close", (PyCFunction)Writer_close, METH_NOARGS,
     "close(): wait for in-flight writes, close the file and the ring, free staging. Idempotent."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Writer_getset[] = {
    {"closed", (getter)Writer_get_closed, NULL, "True once close() ran.", NULL},
    {"fileno", (getter)Writer_get_fileno, NULL, "The file fd, -1 when closed.", NULL},
    {"fixed_buffers", (getter)Writer_get_fixed, NULL, "Staging registered with the ring.", NULL},
    {"fixed_buffers_errno", (getter)Writer_get_fixed_errno, NULL,
     "The errno with which the kernel refused to register the staging (0: not refused).", NULL},
    {"holding", (getter)Writer_get_holding, NULL,
     "True while the writer references a held source (write_checksummed's hold): set when a call "
     "returns with its writes in flight, cleared by a later call once they are done.", NULL},
    {"direct_sources", (getter)Writer_get_direct_sources, NULL,
     "How many sources (0, 1, or 2 meaning more) have zero-copy writes in flight now: for tests of "
     "the rule that only the held source may.", NULL},
    {"wedged", (getter)Writer_get_wedged, NULL,
     "True once a write outlived the deadline (timeout_ms) and its cancel: the writer failed with "
     "ETIMEDOUT and keeps its staging, ring and held source for ever (the kernel may still read "
     "them).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject WriterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "distckpt._uring.Writer",
    .tp_basicsize = sizeof(WriterObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Writer(path, block_size=4 MiB, queue_depth=8, offset_align=4096, uring=True, "
              "fixed_buffers=False, prealloc_max=256 MiB, mem_align=0, stage_block=block_size, "
              "stage_blocks=queue_depth+1)\n\n"
              "Streaming O_DIRECT writer. Creates path with O_WRONLY|O_CREAT|O_EXCL|O_DIRECT|O_CLOEXEC, "
              "copies appended bytes into a ring of stage_blocks aligned staging blocks of stage_block "
              "bytes (its whole memory) and writes full ones with io_uring (stage_blocks - 1 in flight) "
              "or, with uring=False, with synchronous pwrite. Sources "
              "aligned to mem_align (non-zero) of at least one block are written from the caller's "
              "memory directly, complete before the call returns unless write_checksummed got hold. prealloc_max=0 disables "
              "fallocate-ahead. Methods: write, zeros, reserve, tell, flush, fsync, close.",
    .tp_new = Writer_new,
    .tp_init = (initproc)Writer_init,
    .tp_dealloc = (destructor)Writer_dealloc,
    .tp_methods = Writer_methods,
    .tp_getset = Writer_getset,
};
