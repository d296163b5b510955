/*
 * reader.c: distckpt._uring.Reader, the O_DIRECT ranged reader: read_into() reads a list of
 * ranges through aligned staging (or straight into a destination that is aligned), queue_depth in
 * flight; fill() is the verified read pipeline of a load (distckpt/fill.py): read segments into
 * the caller's bounce slots, check their crc32c blocks, then copy their runs to the destinations.
 *
 * fd lifecycle: Reader_new marks the object as owning nothing (fd -1, closed). Reader_init opens
 * the file with O_RDONLY|O_DIRECT|O_CLOEXEC|O_NOFOLLOW through io_setup() (core.c) and the ring
 * through ring_setup(); a second __init__ is refused. The file fd and the ring fd are closed only by
 * reader_release(): from close(), from dealloc, or from Reader_init's failure path (close(2)'s
 * result is ignored: the fd is read-only). fill()'s cached_fd (a buffered fd of the same file, for
 * segments whose pages are all in the page cache, and with through_cache for every segment, so
 * a load fills the cache; -1 for none) is the caller's: borrowed for the call, never closed here. `fileno` is a view for fstat callers.
 *
 * Invariants: read_into() and fill() never return with a request in flight, so release never
 * waits; the one exception is a wedged reader (reader_wait()), which then keeps its staging, its
 * ring and the call's buffers for ever. The buffer fill() registered with the ring stays exported (reg_view) until the reader
 * closes or a call passes another buffer, so its pages stay mapped while the kernel holds them;
 * reader_release() drops that export and then closes the ring (which drops the registration).
 * A short read that ends before the requested bytes raises EOFError. See core.h for the
 * module-wide invariants (GIL, busy flag, close()).
 */
#include "core.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "crc32c.h"

typedef struct {
    PyObject_HEAD
    PyObject *path;
    int fd;
    int closed;
    int busy;
    int use_uring;
    int wedged;          /* a read outlived its deadline and its cancel: see reader_wait() */
    unsigned timeout_ms; /* deadline of the wait for any one completion (0: none) */
    struct ring ring;
    size_t block_size;
    unsigned queue_depth;
    size_t offset_align, mem_align;
    char *stage; /* queue_depth * block_size */
    size_t stage_sz;
    /* Reader.fill's slots stay registered with the ring from one call to the next while the
     * caller passes the same buffer: registering pins (and faults in) every slot page, which for
     * 6 x 4 MiB slots cost ~30 ms a call, paid once per tensor by a conversion that reads tensor
     * by tensor. The buffer is held (reg_view, a buffer export) until the reader closes or
     * another buffer comes, so it cannot be unmapped while the kernel may write into its pages. */
    Py_buffer reg_view;
    size_t reg_slot;
    unsigned reg_nslots;
    int reg_fixed; /* 1: registered; 0: the kernel refused it (RLIMIT_MEMLOCK): plain READ */
} ReaderObject;

/* One I/O: read `len` bytes at file offset `off` into `buf` (staging or the destination itself),
 * then copy `want` bytes starting `skip` bytes in to `dest` (nothing to copy when direct). */
struct piece {
    uint64_t off;
    unsigned len;
    unsigned skip;
    size_t want;
    char *dest;
    int direct;
    int slot;
};

static void reader_release(ReaderObject *r)
{
    if (r->closed)
        return;
    r->closed = 1;
    if (r->fd >= 0)
        close(r->fd); /* safe even when wedged: a request holds its own file reference */
    r->fd = -1;
    if (r->wedged)
        return; /* reads may still land in staging or the registered buffer: keep both for ever */
    /* With the GIL (every caller but Reader_init's failure path, which has no registration):
     * closing the ring below drops the registration, so the held buffer can go now. */
    if (r->reg_view.obj)
        PyBuffer_Release(&r->reg_view);
    /* read_into and fill never return with requests in flight (unless wedged), so nothing
     * references staging here. */
    ring_free(&r->ring);
    if (r->stage)
        munmap(r->stage, r->stage_sz);
    r->stage = NULL;
}

static PyObject *Reader_new(PyTypeObject *type, PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kwds))
{
    ReaderObject *r = (ReaderObject *)type->tp_alloc(type, 0);
    if (r) {
        r->fd = -1;
        r->closed = 1;
        ring_init_empty(&r->ring);
    }
    return (PyObject *)r;
}

static int Reader_init(ReaderObject *r, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"path", "block_size", "queue_depth", "offset_align", "mem_align",
                             "uring", "timeout_ms", NULL};
    PyObject *path = NULL;
    Py_ssize_t block_size = 4 << 20, queue_depth = 8, offset_align = 4096, mem_align = 4096;
    int use_uring = 1, e = 0;
    unsigned int timeout_ms = 0; /* 0: no deadline */
    long page = sysconf(_SC_PAGESIZE);

    if (r->path) {
        PyErr_SetString(PyExc_RuntimeError, "Reader already initialized");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&|nnnnpI:Reader", kwlist, PyUnicode_FSConverter,
                                     &path, &block_size, &queue_depth, &offset_align, &mem_align,
                                     &use_uring, &timeout_ms))
        return -1;
    r->path = path;
    if (offset_align <= 0 || !is_pow2((size_t)offset_align) || mem_align <= 0 ||
        !is_pow2((size_t)mem_align) || block_size <= 0 || !is_pow2((size_t)block_size) ||
        block_size < page || block_size < offset_align || block_size > (1 << 30) ||
        queue_depth < 1 || queue_depth > 4096) {
        PyErr_SetString(PyExc_ValueError, "bad block_size/queue_depth/alignment");
        return -1;
    }
    r->block_size = (size_t)block_size;
    r->offset_align = (size_t)offset_align;
    r->mem_align = (size_t)mem_align;
    r->use_uring = use_uring;
    r->timeout_ms = timeout_ms;
    r->queue_depth = use_uring ? (unsigned)queue_depth : 1;
    r->stage_sz = r->queue_depth * r->block_size;
    r->closed = 0;
    Py_BEGIN_ALLOW_THREADS
    e = io_setup(PyBytes_AS_STRING(path), O_RDONLY | O_DIRECT | O_CLOEXEC | O_NOFOLLOW, r->stage_sz,
                 use_uring, r->queue_depth, &r->stage, &r->ring, &r->fd);
    if (e)
        reader_release(r);
    Py_END_ALLOW_THREADS
    if (e) {
        raise_errno_path(e, path);
        return -1;
    }
    return 0;
}

/* Wait for the next completion of a read loop (GIL released). Returns 0 when one is ready. When
 * none came within the reader's deadline (or a signal's handler raised meanwhile): cancels every
 * read in flight and returns ETIMEDOUT (EINTR) once (*grace_until set: 0 before); the caller
 * stops submitting and goes on reaping until that one grace deadline (RING_CANCEL_GRACE_MS).
 * When it passes too, or io_uring_enter itself fails, the reads still in flight may land at any
 * time: the reader is wedged (its staging, its ring and the buffers of the call are never
 * released) and the caller returns at once. */
static int reader_wait(ReaderObject *r, int64_t *grace_until)
{
    int e = ring_wait(&r->ring, *grace_until ? ring_ms_until(*grace_until) : r->timeout_ms, !*grace_until);
    if (!e)
        return 0;
    if ((e == ETIME || e == EINTR) && !*grace_until) {
        *grace_until = ring_deadline(RING_CANCEL_GRACE_MS);
        if (ring_cancel_all(&r->ring) == 0)
            return e == ETIME ? ETIMEDOUT : EINTR;
    }
    r->wedged = 1;
    return e == ETIME ? ETIMEDOUT : e;
}

/* Completion of piece p with result res. Returns 0, a positive errno, or -1 for a short read. */
static int piece_done(ReaderObject *r, struct piece *p, int64_t res)
{
    if (res < 0)
        return (int)-res;
    if ((uint64_t)res < p->skip + p->want)
        return -1;
    if (!p->direct)
        memcpy(p->dest, r->stage + (size_t)p->slot * r->block_size + p->skip, p->want);
    return 0;
}

/* Run all pieces; GIL released. Returns 0, a positive errno, or -1 (short read at *bad). */
static int reader_run(ReaderObject *r, struct piece *ps, size_t np, size_t *bad)
{
    int err = 0;
    if (!r->use_uring) {
        for (size_t i = 0; i < np; i++) {
            struct piece *p = &ps[i];
            char *buf = p->direct ? p->dest : r->stage;
            size_t got = 0;
            p->slot = 0;
            while (got < p->len) {
                ssize_t n = pread(r->fd, buf + got, p->len - got, (off_t)(p->off + got));
                if (n < 0 && errno == EINTR)
                    continue;
                if (n < 0) {
                    *bad = i;
                    return errno;
                }
                if (n == 0)
                    break; /* EOF: piece_done decides whether enough arrived */
                got += (size_t)n;
            }
            err = piece_done(r, p, (int64_t)got);
            if (err) {
                *bad = i;
                return err;
            }
        }
        return 0;
    }
    {
        unsigned nslots = r->queue_depth, nfree = nslots, ninflight = 0;
        int free_slots[4096];
        int64_t grace_until = 0;
        size_t next = 0;
        for (unsigned i = 0; i < nslots; i++)
            free_slots[i] = (int)i;
        while (next < np || ninflight) {
            /* Fill the queue, unless an error means we only drain now. */
            while (!err && next < np && ninflight < r->queue_depth) {
                struct piece *p = &ps[next];
                char *buf;
                int e;
                if (p->direct) {
                    p->slot = -1;
                    buf = p->dest;
                } else {
                    if (!nfree)
                        break;
                    p->slot = free_slots[--nfree];
                    buf = r->stage + (size_t)p->slot * r->block_size;
                }
                e = ring_submit(&r->ring, IORING_OP_READ, r->fd, buf, p->len, p->off, next, -1);
                if (e) {
                    if (!p->direct)
                        free_slots[nfree++] = p->slot;
                    err = e;
                    *bad = next;
                    break;
                }
                ninflight++;
                next++;
            }
            if (!ninflight)
                break;
            {
                int e = reader_wait(r, &grace_until);
                uint64_t ud;
                int32_t res;
                if (e) {
                    if (!err || r->wedged) {
                        err = e;
                        *bad = next;
                    }
                    if (r->wedged)
                        return err; /* reads still in flight: see reader_wait() */
                    continue;       /* reap the cancelled reads; submit nothing more */
                }
                while (ring_pop(&r->ring, &ud, &res)) {
                    struct piece *p = &ps[ud];
                    int pe = piece_done(r, p, res);
                    ninflight--;
                    if (!p->direct)
                        free_slots[nfree++] = p->slot;
                    if (pe && !err) {
                        err = pe;
                        *bad = (size_t)ud;
                    }
                }
            }
        }
    }
    return err;
}

/* 1 if ``r`` may start a read now; else 0 with ValueError (closed) or RuntimeError (another
   thread is reading with it: the GIL is released during reads). */
static int reader_usable(ReaderObject *r)
{
    if (r->closed) {
        PyErr_SetString(PyExc_ValueError, "I/O operation on closed reader");
        return 0;
    }
    if (r->busy) {
        PyErr_SetString(PyExc_RuntimeError, "reader is in use by another thread");
        return 0;
    }
    if (r->wedged) {
        /* A read of an earlier call may still complete into this ring: its completion would be
         * taken for one of the new call's (a wrong index into its pieces or slots). */
        errno = ETIMEDOUT;
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, r->path);
        return 0;
    }
    return 1;
}

static PyObject *Reader_read_into(ReaderObject *r, PyObject *arg)
{
    PyObject *seq = NULL, *result = NULL;
    Py_buffer *views = NULL;
    struct piece *ps = NULL;
    Py_ssize_t n, nviews = 0;
    size_t np = 0, cap = 0, bad = 0;
    int err;

    if (!reader_usable(r))
        return NULL;
    seq = PySequence_Fast(arg, "read_into expects a sequence of (offset, nbytes, buffer)");
    if (!seq)
        return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    views = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    if (!views) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        unsigned long long off, len;
        PyObject *buf;
        if (!PyArg_ParseTuple(item, "KKO:read_into request", &off, &len, &buf))
            goto out;
        if (PyObject_GetBuffer(buf, &views[i], PyBUF_WRITABLE) != 0)
            goto out;
        nviews = i + 1;
        /* The buffer may be longer than nbytes: then a read whose length is not aligned (the
         * tail of a file whose size is not) still goes straight into it, rounded up. */
        if ((unsigned long long)views[i].len < len) {
            PyErr_Format(PyExc_ValueError, "request %zd: buffer has %zd bytes, nbytes is %llu", i,
                         views[i].len, len);
            goto out;
        }
        /* Split into pieces of at most block_size aligned bytes. */
        {
            char *dest = views[i].buf;
            uint64_t o = off;
            size_t left = (size_t)len;
            int direct = ((uintptr_t)dest % r->mem_align == 0) && (off % r->offset_align == 0) &&
                         (round_up((size_t)len, r->offset_align) <= (size_t)views[i].len);
            while (left) {
                struct piece p;
                if (np == cap) {
                    size_t ncap = cap ? cap * 2 : 64;
                    struct piece *nps = PyMem_Realloc(ps, ncap * sizeof(struct piece));
                    if (!nps) {
                        PyErr_NoMemory();
                        goto out;
                    }
                    ps = nps;
                    cap = ncap;
                }
                memset(&p, 0, sizeof(p));
                p.dest = dest;
                p.direct = direct;
                if (direct) {
                    p.off = o;
                    p.want = left < r->block_size ? left : r->block_size;
                    /* Only the last piece can be unaligned; the buffer has room for it rounded up
                     * (checked above), and a read that stops at EOF after `want` bytes is whole. */
                    p.len = (unsigned)round_up(p.want, r->offset_align);
                    p.skip = 0;
                } else {
                    uint64_t start = o / r->offset_align * r->offset_align;
                    size_t room;
                    p.off = start;
                    p.skip = (unsigned)(o - start);
                    room = r->block_size - p.skip;
                    p.want = left < room ? left : room;
                    p.len = (unsigned)round_up(p.skip + p.want, r->offset_align);
                }
                ps[np++] = p;
                dest += p.want;
                o += p.want;
                left -= p.want;
            }
        }
    }
    r->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    err = reader_run(r, ps, np, &bad);
    Py_END_ALLOW_THREADS
    r->busy = 0;
    if (err == -1) {
        PyErr_Format(PyExc_EOFError, "short read: wanted bytes up to offset %llu",
                     (unsigned long long)(ps[bad].off + ps[bad].skip + ps[bad].want));
    } else if (err) {
        raise_errno_path(err, r->path);
    } else {
        result = Py_NewRef(Py_None);
    }
out:
    /* Wedged: direct reads may still land in the callers' buffers; keep them exported (and their
     * objects alive) for ever rather than let that memory be freed and reused. */
    for (Py_ssize_t i = 0; i < nviews && !r->wedged; i++)
        PyBuffer_Release(&views[i]);
    if (!r->wedged)
        PyMem_Free(views);
    PyMem_Free(ps);
    Py_XDECREF(seq);
    return result;
}

/* ------------------------------------------------------------------------------------------ */
/* Reader.fill: the verified read pipeline of a load (distckpt/fill.py).                       */
/*
 * One call reads a list of segments into `nslots` bounce slots of the caller's buffer, keeping
 * every free slot's read in flight; as each read completes, this thread checks the crc32c of
 * every checksum block the segment holds and only then copies the segment's byte runs into the
 * destinations, frees the slot and submits the next segment. So the disk always has the other
 * slots' reads while one segment is checked and copied, the checksum and the copy run on bytes
 * that are still in cache, and no Python runs per segment or per tensor.
 *
 * Promises: no byte of a segment is copied unless every check of that segment matched; after the
 * first mismatch or error nothing more is copied, every read in flight is reaped before the call
 * returns, and done[i] == 1 exactly for the segments whose copies completed (2 for a segment read
 * straight into its destinations, fill_direct, that failed after some of its runs were). Every offset and
 * length is checked against the buffer, the bytes the read delivers and the destination sizes
 * before any I/O (ValueError), so a wrong plan cannot write outside a destination.
 */

struct fill_seg {
    uint64_t off;   /* file offset, offset_align aligned */
    uint32_t len;   /* bytes to read, offset_align aligned (may pass EOF) */
    uint32_t want;  /* bytes that must arrive (the read may stop at EOF after them) */
    uint32_t check0, ncheck, copy0, ncopy;
};
struct fill_check { uint32_t buf_off, len, crc; };
struct fill_copy { uint64_t dest_off; uint32_t dest, buf_off, len, pad; };
struct fill_dest { uint64_t addr, nbytes; };

#define FILL_MAX_SLOTS 64

struct fill_job {
    ReaderObject *r;
    char *buf;
    size_t slot;
    unsigned nslots;
    const struct fill_seg *segs;
    size_t nsegs;
    const struct fill_check *checks;
    const struct fill_copy *copies;
    const struct fill_dest *dests;
    unsigned char *done;
    int cached_fd;
    int through_cache; /* uncached segments too are read from cached_fd (buffered, filling the cache) */
    int fixed; /* slots registered with the ring: READ_FIXED, no per-read page pinning */
    int reg_drop, reg_new; /* unregister the reader's previous buffer / register this one first */
    int mismatch;
    size_t bad_seg, bad_check;
    uint32_t got;
    uint64_t cached_bytes, direct_bytes, buffered_bytes;
};

/* pread until `len` bytes or EOF; *got = bytes read. Returns 0 or a positive errno. */
static int pread_full(int fd, char *buf, size_t len, uint64_t off, size_t *got)
{
    *got = 0;
    while (*got < len) {
        ssize_t n = pread(fd, buf + *got, len - *got, (off_t)(off + *got));
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return errno;
        if (n == 0)
            break;
        *got += (size_t)n;
    }
    return 0;
}

/* Check, then copy, segment si held in b. Returns 1 on a checksum mismatch (nothing copied). */
static int fill_process(struct fill_job *j, size_t si, const char *b)
{
    const struct fill_seg *s = &j->segs[si];
    for (size_t k = s->check0; k < (size_t)s->check0 + s->ncheck; k++) {
        const struct fill_check *c = &j->checks[k];
        uint32_t got = crc32c_update(0, b + c->buf_off, c->len);
        if (got != c->crc) {
            j->mismatch = 1;
            j->bad_seg = si;
            j->bad_check = k;
            j->got = got;
            return 1;
        }
    }
    for (size_t k = s->copy0; k < (size_t)s->copy0 + s->ncopy; k++) {
        const struct fill_copy *c = &j->copies[k];
        memcpy((char *)(uintptr_t)j->dests[c->dest].addr + c->dest_off, b + c->buf_off, c->len);
    }
    j->done[si] = 1;
    return 0;
}

/* A segment with no checksum to verify first (a format without them: DCP's files, safetensors)
 * whose pages are all cached and whose byte runs average at least this many bytes is read from the
 * page cache straight into its destinations: one copy instead of two (into a slot, then out). */
#define FILL_DIRECT_MIN_RUN (64u << 10)

/* Read each byte run of segment si from the buffered fd into its destination. Returns 0, a positive
 * errno, or -1 (the file ended first); *written says whether any destination byte changed. */
static int fill_direct(struct fill_job *j, size_t si, int *written)
{
    const struct fill_seg *s = &j->segs[si];
    *written = 0;
    for (size_t k = s->copy0; k < (size_t)s->copy0 + s->ncopy; k++) {
        const struct fill_copy *c = &j->copies[k];
        size_t got = 0;
        int e = pread_full(j->cached_fd, (char *)(uintptr_t)j->dests[c->dest].addr + c->dest_off, c->len,
                           s->off + c->buf_off, &got);
        if (got)
            *written = 1;
        if (e)
            return e;
        if (got < c->len)
            return -1;
    }
    return 0;
}

/* Submit (the rest of) slot sl's read: `g` bytes of segment s already arrived. A buffered read
 * (through_cache) asks the buffered fd for exactly the wanted bytes; an O_DIRECT one for the
 * aligned length. */
static int fill_submit(struct fill_job *j, unsigned sl, const struct fill_seg *s, uint32_t g, int buffered)
{
    char *b = j->buf + (size_t)sl * j->slot;
    return ring_submit(&j->r->ring, j->fixed ? IORING_OP_READ_FIXED : IORING_OP_READ,
                       buffered ? j->cached_fd : j->r->fd, b + g, (buffered ? s->want : s->len) - g,
                       s->off + g, sl, j->fixed ? (int)sl : -1);
}

static int fill_loop(struct fill_job *j, size_t *bad);

/* GIL released. Returns 0, a positive errno, or -1 (short read of segment *bad). The slots are
 * registered with the ring when the kernel allows it (RLIMIT_MEMLOCK may refuse: then plain
 * READ) and stay registered after the call (see ReaderObject.reg_view): a buffer another call
 * registered is unregistered first (reg_drop), this one registered only when new (reg_new). */
static int fill_run(struct fill_job *j, size_t *bad)
{
    ReaderObject *r = j->r;
    if (j->reg_drop)
        sys_io_uring_register(r->ring.fd, IORING_UNREGISTER_BUFFERS, NULL, 0);
    if (j->reg_new) {
        struct iovec iov[FILL_MAX_SLOTS];
        for (unsigned i = 0; i < j->nslots; i++) {
            iov[i].iov_base = j->buf + (size_t)i * j->slot;
            iov[i].iov_len = j->slot;
        }
        r->reg_fixed = sys_io_uring_register(r->ring.fd, IORING_REGISTER_BUFFERS, iov, j->nslots) == 0;
    }
    j->fixed = r->use_uring && r->reg_fixed;
    return fill_loop(j, bad);
}

static int fill_loop(struct fill_job *j, size_t *bad)
{
    ReaderObject *r = j->r;
    unsigned free_slots[FILL_MAX_SLOTS], nfree = j->nslots, inflight = 0;
    size_t slot_seg[FILL_MAX_SLOTS];
    uint32_t slot_got[FILL_MAX_SLOTS];
    unsigned char slot_buffered[FILL_MAX_SLOTS];
    size_t next = 0;
    int err = 0, stop = 0;
    int64_t grace_until = 0;

    for (unsigned i = 0; i < j->nslots; i++)
        free_slots[i] = j->nslots - 1 - i;
    while ((!stop && next < j->nsegs) || inflight) {
        while (!stop && next < j->nsegs && nfree) {
            const struct fill_seg *s = &j->segs[next];
            unsigned sl = free_slots[--nfree];
            char *b = j->buf + (size_t)sl * j->slot;
            int cached = 0, e;
            if (j->cached_fd >= 0 && s->want) {
                uint64_t c = 0, t = 0;
                cached = cached_pages(j->cached_fd, s->off, s->want, &c, &t) == 0 && c == t;
            }
            if (cached && s->ncheck == 0 && s->ncopy && s->want / s->ncopy >= FILL_DIRECT_MIN_RUN) {
                int written = 0;
                free_slots[nfree++] = sl;
                e = fill_direct(j, next, &written);
                if (e) {
                    if (written)
                        j->done[next] = 2; /* some of its runs copied: partly */
                    err = e;
                    *bad = next;
                    stop = 1;
                    break;
                }
                j->cached_bytes += s->want;
                j->done[next] = 1;
                next++;
                continue;
            }
            if (cached || !r->use_uring) {
                /* All pages cached (a buffered pread touches no disk), or no io_uring here. */
                size_t got = 0;
                int buffered = cached || (j->through_cache && j->cached_fd >= 0);
                e = pread_full(buffered ? j->cached_fd : r->fd, b, buffered ? s->want : s->len, s->off, &got);
                free_slots[nfree++] = sl;
                if (e || got < s->want) {
                    err = e ? e : -1;
                    *bad = next;
                    stop = 1;
                    break;
                }
                if (cached)
                    j->cached_bytes += s->want;
                else if (buffered)
                    j->buffered_bytes += s->want;
                else
                    j->direct_bytes += s->want;
                if (fill_process(j, next, b))
                    stop = 1;
                next++;
                continue;
            }
            slot_buffered[sl] = j->through_cache && j->cached_fd >= 0;
            e = fill_submit(j, sl, s, 0, slot_buffered[sl]);
            if (e) {
                free_slots[nfree++] = sl;
                err = e;
                *bad = next;
                stop = 1;
                break;
            }
            slot_seg[sl] = next;
            slot_got[sl] = 0;
            inflight++;
            next++;
        }
        if (!inflight)
            break;
        {
            uint64_t ud;
            int32_t res;
            int e = reader_wait(r, &grace_until);
            if (e) {
                if (!err || r->wedged) {
                    err = e;
                    *bad = next;
                }
                stop = 1;
                if (r->wedged)
                    return err; /* reads still in flight: see reader_wait() */
                continue;       /* reap the cancelled reads */
            }
            while (ring_pop(&r->ring, &ud, &res)) {
                unsigned sl = (unsigned)ud;
                size_t si = slot_seg[sl];
                const struct fill_seg *s = &j->segs[si];
                char *b = j->buf + (size_t)sl * j->slot;
                if (res < 0) {
                    inflight--;
                    free_slots[nfree++] = sl;
                    if (!err) {
                        err = -res;
                        *bad = si;
                    }
                    stop = 1;
                    continue;
                }
                slot_got[sl] += (uint32_t)res;
                if (res > 0 && slot_got[sl] < s->want && !stop &&
                    (slot_buffered[sl] || slot_got[sl] % r->offset_align == 0)) {
                    /* A short read (aligned, for O_DIRECT): ask for the rest. */
                    e = fill_submit(j, sl, s, slot_got[sl], slot_buffered[sl]);
                    if (!e)
                        continue;
                    if (!err) {
                        err = e;
                        *bad = si;
                    }
                    stop = 1;
                }
                inflight--;
                free_slots[nfree++] = sl;
                if (slot_got[sl] < s->want) {
                    if (!err) {
                        err = -1;
                        *bad = si;
                    }
                    stop = 1;
                    continue;
                }
                if (slot_buffered[sl])
                    j->buffered_bytes += s->want;
                else
                    j->direct_bytes += s->want;
                if (!stop && fill_process(j, si, b))
                    stop = 1;
            }
        }
    }
    return err;
}

/* Borrow a contiguous read-only view of `obj` whose size is a multiple of `item`. */
static int fill_view(PyObject *obj, Py_buffer *v, size_t item, const char *what, size_t *n)
{
    if (PyObject_GetBuffer(obj, v, PyBUF_SIMPLE) != 0)
        return -1;
    if ((size_t)v->len % item) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes is not a whole number of %zu-byte records", what,
                     v->len, item);
        PyBuffer_Release(v);
        v->obj = NULL;
        return -1;
    }
    *n = (size_t)v->len / item;
    return 0;
}

static PyObject *Reader_fill(ReaderObject *r, PyObject *args)
{
    PyObject *bufobj, *segobj, *chkobj, *cpyobj, *dstobj, *doneobj, *result = NULL;
    Py_buffer vb = {0}, vs = {0}, vc = {0}, vp = {0}, vd = {0}, vdone = {0};
    Py_ssize_t slot;
    int cached_fd, through_cache = 0, err;
    size_t nsegs = 0, nchecks = 0, ncopies = 0, ndests = 0, bad = 0;
    struct fill_job j;

    if (!PyArg_ParseTuple(args, "OnOOOOOi|p:fill", &bufobj, &slot, &segobj, &chkobj, &cpyobj, &dstobj,
                          &doneobj, &cached_fd, &through_cache))
        return NULL;
    if (!reader_usable(r))
        return NULL;
    if (PyObject_GetBuffer(bufobj, &vb, PyBUF_WRITABLE) != 0)
        goto out;
    if (PyObject_GetBuffer(doneobj, &vdone, PyBUF_WRITABLE) != 0)
        goto out;
    if (fill_view(segobj, &vs, sizeof(struct fill_seg), "segments", &nsegs) ||
        fill_view(chkobj, &vc, sizeof(struct fill_check), "checks", &nchecks) ||
        fill_view(cpyobj, &vp, sizeof(struct fill_copy), "copies", &ncopies) ||
        fill_view(dstobj, &vd, sizeof(struct fill_dest), "dests", &ndests))
        goto out;
    memset(&j, 0, sizeof(j));
    j.r = r;
    j.buf = vb.buf;
    j.slot = (size_t)slot;
    j.segs = vs.buf;
    j.nsegs = nsegs;
    j.checks = vc.buf;
    j.copies = vp.buf;
    j.dests = vd.buf;
    j.done = vdone.buf;
    j.cached_fd = cached_fd;
    j.through_cache = through_cache;
    /* Everything is checked before any I/O: a wrong plan is a ValueError, never a stray write. */
    if (slot <= 0 || (size_t)slot % r->offset_align || (size_t)slot % r->mem_align ||
        (uintptr_t)vb.buf % r->mem_align || (size_t)slot > ((size_t)1 << 31)) {
        PyErr_SetString(PyExc_ValueError, "fill: slot must be a positive multiple of the alignment, "
                                          "in an aligned buffer");
        goto out;
    }
    j.nslots = (unsigned)((size_t)vb.len / (size_t)slot);
    if (j.nslots > r->queue_depth)
        j.nslots = r->queue_depth;
    if (j.nslots > FILL_MAX_SLOTS)
        j.nslots = FILL_MAX_SLOTS;
    if (!j.nslots) {
        PyErr_SetString(PyExc_ValueError, "fill: buffer holds no slot");
        goto out;
    }
    if ((size_t)vdone.len < nsegs) {
        PyErr_SetString(PyExc_ValueError, "fill: done has fewer bytes than there are segments");
        goto out;
    }
    for (size_t i = 0; i < nsegs; i++) {
        const struct fill_seg *s = &j.segs[i];
        if (s->len > (size_t)slot || s->want > s->len || s->off % r->offset_align ||
            s->len % r->offset_align || (size_t)s->check0 + s->ncheck > nchecks ||
            (size_t)s->copy0 + s->ncopy > ncopies) {
            PyErr_Format(PyExc_ValueError, "fill: segment %zu is out of bounds", i);
            goto out;
        }
        for (size_t k = s->check0; k < (size_t)s->check0 + s->ncheck; k++)
            if ((size_t)j.checks[k].buf_off + j.checks[k].len > s->want) {
                PyErr_Format(PyExc_ValueError, "fill: check %zu passes the bytes segment %zu reads", k, i);
                goto out;
            }
        for (size_t k = s->copy0; k < (size_t)s->copy0 + s->ncopy; k++) {
            const struct fill_copy *c = &j.copies[k];
            if ((size_t)c->buf_off + c->len > s->want || c->dest >= ndests ||
                c->dest_off + c->len > j.dests[c->dest].nbytes || c->dest_off + c->len < c->dest_off) {
                PyErr_Format(PyExc_ValueError, "fill: copy %zu is out of bounds", k);
                goto out;
            }
        }
    }
    memset(j.done, 0, nsegs);
    if (r->use_uring && (!r->reg_view.obj || r->reg_view.obj != vb.obj || r->reg_view.buf != vb.buf ||
                         r->reg_slot != (size_t)slot || r->reg_nslots != j.nslots)) {
        if (r->reg_view.obj) { /* another buffer (or slot layout) than the registered one */
            j.reg_drop = r->reg_fixed;
            PyBuffer_Release(&r->reg_view);
        }
        /* An export of its own, held past this call: the registered pages stay mapped. */
        if (PyObject_GetBuffer(bufobj, &r->reg_view, PyBUF_WRITABLE) != 0) {
            if (j.reg_drop) /* nothing may stay registered without its buffer held */
                sys_io_uring_register(r->ring.fd, IORING_UNREGISTER_BUFFERS, NULL, 0);
            r->reg_fixed = 0;
            goto out;
        }
        r->reg_slot = (size_t)slot;
        r->reg_nslots = j.nslots;
        r->reg_fixed = 0;
        j.reg_new = 1;
    }
    r->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    err = fill_run(&j, &bad);
    Py_END_ALLOW_THREADS
    r->busy = 0;
    if (err == -1) {
        PyErr_Format(PyExc_EOFError, "short read: wanted bytes up to offset %llu",
                     (unsigned long long)(j.segs[bad].off + j.segs[bad].want));
    } else if (err) {
        raise_errno_path(err, r->path);
    } else if (j.mismatch) {
        result = Py_BuildValue("(KKK(nnk))", (unsigned long long)j.cached_bytes,
                               (unsigned long long)j.direct_bytes, (unsigned long long)j.buffered_bytes,
                               (Py_ssize_t)j.bad_seg,
                               (Py_ssize_t)j.bad_check, (unsigned long)j.got);
    } else {
        result = Py_BuildValue("(KKKO)", (unsigned long long)j.cached_bytes,
                               (unsigned long long)j.direct_bytes, (unsigned long long)j.buffered_bytes, Py_None);
    }
out:
    if (vb.obj && !r->wedged) /* wedged: reads may still land in the slots (reader_wait) */
        PyBuffer_Release(&vb);
    if (vdone.obj)
        PyBuffer_Release(&vdone);
    if (vs.obj)
        PyBuffer_Release(&vs);
    if (vc.obj)
        PyBuffer_Release(&vc);
    if (vp.obj)
        PyBuffer_Release(&vp);
    if (vd.obj)
        PyBuffer_Release(&vd);
    return result;
}

static PyObject *Reader_size(ReaderObject *r, PyObject *Py_UNUSED(ignored))
{
    struct stat st;
    if (r->closed) {
        PyErr_SetString(PyExc_ValueError, "I/O operation on closed reader");
        return NULL;
    }
    if (fstat(r->fd, &st) != 0)
        return raise_errno_path(errno, r->path);
    return PyLong_FromLongLong((long long)st.st_size);
}

static PyObject *Reader_close(ReaderObject *r, PyObject *Py_UNUSED(ignored))
{
    if (r->busy) {
        PyErr_SetString(PyExc_RuntimeError, "reader is in use by another thread");
        return NULL;
    }
    reader_release(r);
    Py_RETURN_NONE;
}

static PyObject *Reader_get_closed(ReaderObject *r, void *Py_UNUSED(c)) { return PyBool_FromLong(r->closed); }
static PyObject *Reader_get_fileno(ReaderObject *r, void *Py_UNUSED(c)) { return PyLong_FromLong(r->fd); }
static PyObject *Reader_get_wedged(ReaderObject *r, void *Py_UNUSED(c)) { return PyBool_FromLong(r->wedged); }

static void Reader_dealloc(ReaderObject *r)
{
    reader_release(r);
    Py_CLEAR(r->path);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyMethodDef Reader_methods[] = {
    {"read_into", (PyCFunction)Reader_read_into, METH_O,
     "read_into([(offset, nbytes, writable_buffer), ...]): read every range, queue_depth in "
     "flight. Raises OSError, or EOFError when the file ends before a requested byte."},
    {"fill", (PyCFunction)Reader_fill, METH_VARARGS,
     "fill(buffer, slot, segments, checks, copies, dests, done, cached_fd, through_cache=False) -> "
     "(cached_bytes, direct_bytes, buffered_bytes, mismatch): read segments into slots of buffer (reads in flight on every free "
     "slot), check each segment's crc32c blocks, then copy its runs into the destinations; "
     "mismatch is None or (segment, check, crc found), after which nothing more was copied. "
     "Records are packed structs (see csrc/reader.c); done[i] becomes 1 when segment i was copied "
     "(2: partly, a segment without checks read straight into its destinations that then failed). "
     "The buffer stays registered with the ring and held (an export: an mmap cannot be closed) "
     "until the reader closes or a call passes another buffer, so calls with one buffer pay the "
     "registration once. Raises ValueError (bad plan, before any I/O), OSError, EOFError."},
    {"size", (PyCFunction)Reader_size, METH_NOARGS, "size() -> int: the file's size (fstat)."},
    {"close", (PyCFunction)Reader_close, METH_NOARGS, "close(): release fds and staging. Idempotent."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Reader_getset[] = {
    {"closed", (getter)Reader_get_closed, NULL, "True once close() ran.", NULL},
    {"fileno", (getter)Reader_get_fileno, NULL, "The O_DIRECT file descriptor (-1 once closed).", NULL},
    {"wedged", (getter)Reader_get_wedged, NULL,
     "True once a read outlived the deadline (timeout_ms) and its cancel: the call failed with "
     "ETIMEDOUT and the reader keeps its staging, ring and the call's buffers for ever (the kernel "
     "may still write into them).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "distckpt._uring.Reader",
    .tp_basicsize = sizeof(ReaderObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Reader(path, block_size=4 MiB, queue_depth=8, offset_align=4096, mem_align=4096, "
              "uring=True)\n\nO_DIRECT ranged reader: reads go through aligned staging, or straight "
              "into the destination when its address, offset and length are all aligned.",
    .tp_new = Reader_new,
    .tp_init = (initproc)Reader_init,
    .tp_dealloc = (destructor)Reader_dealloc,
    .tp_methods = Reader_methods,
    .tp_getset = Reader_getset,
};
