/*
 * distckpt._uring: O_DIRECT streaming writer and ranged reader on raw io_uring syscalls.
 *
 * With csrc/crc32c.c (the checksum Reader.fill checks) this is all the C in distckpt. It is torch-independent: it sees bytes through the buffer
 * protocol and nothing else. It uses the io_uring system calls directly (<linux/io_uring.h> only,
 * no liburing), so building it needs gcc and the Python headers and nothing more.
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
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <linux/io_uring.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <unistd.h>

#include "crc32c.h"
#include "rowdigest.h"

#ifndef STATX_DIOALIGN
#define STATX_DIOALIGN 0x00002000U
#endif

/* ------------------------------------------------------------------------------------------ */
/* Raw io_uring ring.                                                                           */

struct ring {
    int fd;
    unsigned entries;
    void *sq_ptr, *cq_ptr;
    size_t sq_sz, cq_sz;
    struct io_uring_sqe *sqes;
    size_t sqes_sz;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_cqe *cqes;
};

static int sys_io_uring_setup(unsigned entries, struct io_uring_params *p)
{
    return (int)syscall(__NR_io_uring_setup, entries, p);
}

static int sys_io_uring_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags)
{
    return (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, NULL, 0);
}

static int sys_io_uring_register(int fd, unsigned opcode, const void *arg, unsigned nr_args)
{
    return (int)syscall(__NR_io_uring_register, fd, opcode, arg, nr_args);
}

static void ring_init_empty(struct ring *r)
{
    memset(r, 0, sizeof(*r));
    r->fd = -1;
}

static void ring_free(struct ring *r)
{
    if (r->sqes && r->sqes != MAP_FAILED)
        munmap(r->sqes, r->sqes_sz);
    if (r->cq_ptr && r->cq_ptr != MAP_FAILED && r->cq_ptr != r->sq_ptr)
        munmap(r->cq_ptr, r->cq_sz);
    if (r->sq_ptr && r->sq_ptr != MAP_FAILED)
        munmap(r->sq_ptr, r->sq_sz);
    if (r->fd >= 0)
        close(r->fd);
    ring_init_empty(r);
}

/* Returns 0 or a positive errno. On failure nothing is left open or mapped. */
static int ring_setup(struct ring *r, unsigned entries)
{
    struct io_uring_params p;
    int err;

    ring_init_empty(r);
    memset(&p, 0, sizeof(p));
    /* CQ twice the SQ so completions can never overflow while at most `entries` are in flight. */
    p.flags = IORING_SETUP_CQSIZE;
    p.cq_entries = entries * 2;
    r->fd = sys_io_uring_setup(entries, &p);
    if (r->fd < 0) {
        r->fd = -1;
        return errno;
    }
    r->entries = p.sq_entries;
    r->sq_sz = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_sz = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        if (r->cq_sz > r->sq_sz)
            r->sq_sz = r->cq_sz;
        r->cq_sz = r->sq_sz;
    }
    r->sq_ptr = mmap(NULL, r->sq_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                     IORING_OFF_SQ_RING);
    if (r->sq_ptr == MAP_FAILED)
        goto fail;
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        r->cq_ptr = r->sq_ptr;
    } else {
        r->cq_ptr = mmap(NULL, r->cq_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                         IORING_OFF_CQ_RING);
        if (r->cq_ptr == MAP_FAILED)
            goto fail;
    }
    r->sqes_sz = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqes_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                   IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED)
        goto fail;
    r->sq_head = (unsigned *)((char *)r->sq_ptr + p.sq_off.head);
    r->sq_tail = (unsigned *)((char *)r->sq_ptr + p.sq_off.tail);
    r->sq_mask = (unsigned *)((char *)r->sq_ptr + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)((char *)r->sq_ptr + p.sq_off.array);
    r->cq_head = (unsigned *)((char *)r->cq_ptr + p.cq_off.head);
    r->cq_tail = (unsigned *)((char *)r->cq_ptr + p.cq_off.tail);
    r->cq_mask = (unsigned *)((char *)r->cq_ptr + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)((char *)r->cq_ptr + p.cq_off.cqes);
    return 0;
fail:
    err = errno;
    ring_free(r);
    return err;
}

/* Queue one SQE and submit it. Returns 0 or a positive errno. The caller guarantees that fewer
 * than `entries` requests are in flight, so the SQ always has room. */
static int ring_submit(struct ring *r, uint8_t opcode, int fd, void *addr, unsigned len,
                       uint64_t off, uint64_t user_data, int buf_index)
{
    unsigned tail = *r->sq_tail;
    unsigned idx = tail & *r->sq_mask;
    struct io_uring_sqe *sqe = &r->sqes[idx];
    int ret;

    memset(sqe, 0, sizeof(*sqe));
    sqe->opcode = opcode;
    sqe->fd = fd;
    sqe->addr = (uint64_t)(uintptr_t)addr;
    sqe->len = len;
    sqe->off = off;
    sqe->user_data = user_data;
    if (buf_index >= 0)
        sqe->buf_index = (uint16_t)buf_index;
    r->sq_array[idx] = idx;
    /* Release: the kernel must see the SQE contents before the new tail. */
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
    for (;;) {
        ret = sys_io_uring_enter(r->fd, 1, 0, 0);
        if (ret >= 0)
            return ret == 1 ? 0 : EAGAIN;
        if (errno != EINTR)
            return errno;
    }
}

/* Block until at least one completion is available. Returns 0 or a positive errno. */
static int ring_wait(struct ring *r)
{
    for (;;) {
        if (__atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE) != *r->cq_head)
            return 0;
        if (sys_io_uring_enter(r->fd, 0, 1, IORING_ENTER_GETEVENTS) >= 0)
            continue;
        if (errno != EINTR)
            return errno;
    }
}

/* Pop one available completion; returns 0 if none. */
static int ring_pop(struct ring *r, uint64_t *user_data, int32_t *res)
{
    unsigned head = *r->cq_head;
    struct io_uring_cqe *cqe;
    if (__atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE) == head)
        return 0;
    cqe = &r->cqes[head & *r->cq_mask];
    *user_data = cqe->user_data;
    *res = cqe->res;
    __atomic_store_n(r->cq_head, head + 1, __ATOMIC_RELEASE);
    return 1;
}

/* ------------------------------------------------------------------------------------------ */
/* Helpers.                                                                                     */

static PyObject *raise_errno_path(int err, PyObject *path)
{
    errno = err;
    if (path)
        return PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
    return PyErr_SetFromErrno(PyExc_OSError);
}

static int is_pow2(size_t v) { return v && !(v & (v - 1)); }

static size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

/* Allocate `size` bytes of page-aligned anonymous memory. NULL on failure (errno set). */
static char *stage_alloc(size_t size)
{
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : (char *)p;
}

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

/* ------------------------------------------------------------------------------------------ */
/* Writer.                                                                                      */

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
    int prealloc;            /* fallocate ahead still enabled */
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
    /* Zero-copy writes straight from the caller's buffer, user_data nblocks + k. They are all
     * complete before write() returns, so the caller's memory is never referenced afterwards. */
    unsigned char *d_inflight;
    const char **d_src;
    uint64_t *d_off;
    unsigned *d_len;
    unsigned d_count;
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

/* Wait for one completion. Returns 0 or a positive errno of io_uring_enter itself. */
static int writer_wait_one(WriterObject *w)
{
    int e = ring_wait(&w->ring);
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
    /* The caller's buffer must not be referenced once write() returns, error or not. */
    while (w->d_count) {
        if ((e = writer_wait_one(w)) != 0) {
            if (!w->err)
                w->err = e;
            break;
        }
    }
    return done;
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
 * A source of at least one block goes to the disk straight from its memory (zero-copy) from its
 * first byte that is mem_align-aligned, provided that byte lands on an offset_align-aligned file
 * position: the bytes before it (the head) are staged. A caller places a chunk so (see
 * distckpt.storage.posix.Writer.pad_for); torch's large CPU tensors sit 64 bytes past a page. */
static int writer_append(WriterObject *w, const char *src, size_t n)
{
    if (src && w->mem_align && !w->err) {
        size_t head = (w->mem_align - (uintptr_t)src % w->mem_align) % w->mem_align;
        if (head && n >= head + w->block_size && (w->fill + head) % w->offset_align == 0) {
            int e = writer_stage(w, src, head);
            if (e)
                return e;
            src += head;
            n -= head;
        }
        if (n >= w->block_size && (uintptr_t)src % w->mem_align == 0 && w->fill % w->offset_align == 0) {
            size_t done = writer_direct(w, src, n);
            src += done;
            n -= done;
        }
    }
    if (writer_stage(w, src, n))
        return w->err;
    if (w->use_uring)
        writer_reap(w); /* surface completed errors early; never blocks */
    return w->err;
}

/* Release everything. Safe to call twice; the GIL may or may not be held (no Python calls). */
static int writer_release(WriterObject *w)
{
    int err = 0;
    if (w->closed)
        return 0;
    w->closed = 1;
    /* Never unmap staging or close the ring with requests in flight. */
    if (w->ring.fd >= 0)
        (void)writer_drain(w);
    if (w->fd >= 0) {
        if (close(w->fd) != 0)
            err = errno;
        w->fd = -1;
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
    w->inflight = NULL;
    w->blk_off = NULL;
    w->blk_len = NULL;
    w->d_inflight = NULL;
    w->d_src = NULL;
    w->d_off = NULL;
    w->d_len = NULL;
    return err;
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

/* The shared tail of Writer/Reader construction, run without the GIL: staging first, then the
 * ring, the file last (so a failure leaves no file behind). Returns 0 or an errno; on failure
 * the caller releases whatever was set up (its release function handles partial states). */
static int io_setup(const char *path, int flags, size_t stage_sz, int use_uring, unsigned depth,
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

static int Writer_init(WriterObject *w, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"path", "block_size", "queue_depth", "offset_align", "uring",
                             "fixed_buffers", "prealloc_max", "mem_align", "stage_block", "stage_blocks", NULL};
    PyObject *path = NULL;
    Py_ssize_t block_size = 4 << 20, queue_depth = 8, offset_align = 4096;
    Py_ssize_t stage_block = 0, stage_blocks = 0; /* 0: block_size, queue_depth + 1 */
    long long prealloc_max = (long long)PREALLOC_MAX;
    Py_ssize_t mem_align = 0;
    int use_uring = 1, fixed = 0, e = 0;
    long page = sysconf(_SC_PAGESIZE);

    if (w->path) { /* __init__ called twice: refuse rather than leak the first fd */
        PyErr_SetString(PyExc_RuntimeError, "Writer already initialized");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&|nnnppLnnn:Writer", kwlist, PyUnicode_FSConverter,
                                     &path, &block_size, &queue_depth, &offset_align, &use_uring,
                                     &fixed, &prealloc_max, &mem_align, &stage_block, &stage_blocks))
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
    w->block_size = (size_t)block_size;
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
    if (!w->inflight || !w->blk_off || !w->blk_len || !w->d_inflight || !w->d_src || !w->d_off ||
        !w->d_len) {
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
    e = writer_append(w, (const char *)view.buf, (size_t)view.len);
    Py_END_ALLOW_THREADS
    w->busy = 0;
    PyBuffer_Release(&view);
    if (e)
        return raise_errno_path(e, w->path);
    return PyLong_FromUnsignedLongLong(w->pos);
}

static PyObject *Writer_write_checksummed(WriterObject *w, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t block;
    struct wcrc c;
    PyObject *crcs = NULL, *result = NULL;
    int e;
    if (!PyArg_ParseTuple(args, "y*n:write_checksummed", &view, &block))
        return NULL;
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
    e = writer_append(w, (const char *)view.buf, (size_t)view.len);
    if (!e) {
        wcrc_advance(&c, (size_t)view.len);
        if (c.in)
            c.out[c.nout++] = c.cur;
    }
    Py_END_ALLOW_THREADS
    w->crc = NULL;
    w->busy = 0;
    PyBuffer_Release(&view);
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
    e = writer_append(w, NULL, (size_t)n);
    Py_END_ALLOW_THREADS
    w->busy = 0;
    if (e)
        return raise_errno_path(e, w->path);
    return PyLong_FromUnsignedLongLong(w->pos);
}

/* Preallocate the whole file at once when the caller knows its size: one fallocate instead of
 * growing it in steps (each of which waits for the writes in flight). ENOSPC here is a real and
 * early answer (the file cannot fit), so it is raised; a file system without fallocate
 * (EOPNOTSUPP) just gets no preallocation. */
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
    if (e)
        return raise_errno_path(e, w->path);
    Py_RETURN_NONE;
}

static PyObject *Writer_get_closed(WriterObject *w, void *Py_UNUSED(c)) { return PyBool_FromLong(w->closed); }
static PyObject *Writer_get_fileno(WriterObject *w, void *Py_UNUSED(c)) { return PyLong_FromLong(w->fd); }
static PyObject *Writer_get_fixed(WriterObject *w, void *Py_UNUSED(c)) { return PyBool_FromLong(w->fixed); }

static void Writer_dealloc(WriterObject *w)
{
    writer_release(w);
    Py_CLEAR(w->path);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyMethodDef Writer_methods[] = {
    {"write", (PyCFunction)Writer_write, METH_O,
     "write(buffer) -> int: append a C-contiguous buffer; returns the new position. Raises OSError."},
    {"write_checksummed", (PyCFunction)Writer_write_checksummed, METH_VARARGS,
     "write_checksummed(buffer, block) -> (position, crcs): write(buffer), and the crc32c of each "
     "block bytes of it (the last one partial), computed while the bytes are being written."},
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
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject WriterType = {
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
              "memory directly, all complete before write() returns. prealloc_max=0 disables "
              "fallocate-ahead. Methods: write, zeros, reserve, tell, flush, fsync, close.",
    .tp_new = Writer_new,
    .tp_init = (initproc)Writer_init,
    .tp_dealloc = (destructor)Writer_dealloc,
    .tp_methods = Writer_methods,
    .tp_getset = Writer_getset,
};

/* ------------------------------------------------------------------------------------------ */
/* Reader.                                                                                      */

static int cached_pages(int fd, uint64_t off, uint64_t len, uint64_t *cached, uint64_t *total);

typedef struct {
    PyObject_HEAD
    PyObject *path;
    int fd;
    int closed;
    int busy;
    int use_uring;
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
    /* With the GIL (every caller but Reader_init's failure path, which has no registration):
     * closing the ring below drops the registration, so the held buffer can go now. */
    if (r->reg_view.obj)
        PyBuffer_Release(&r->reg_view);
    /* read_into never returns with requests in flight, so nothing references staging here. */
    if (r->fd >= 0)
        close(r->fd);
    r->fd = -1;
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
                             "uring", NULL};
    PyObject *path = NULL;
    Py_ssize_t block_size = 4 << 20, queue_depth = 8, offset_align = 4096, mem_align = 4096;
    int use_uring = 1, e = 0;
    long page = sysconf(_SC_PAGESIZE);

    if (r->path) {
        PyErr_SetString(PyExc_RuntimeError, "Reader already initialized");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&|nnnnp:Reader", kwlist, PyUnicode_FSConverter,
                                     &path, &block_size, &queue_depth, &offset_align, &mem_align,
                                     &use_uring))
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
                int e = ring_wait(&r->ring);
                uint64_t ud;
                int32_t res;
                if (e) /* the ring itself failed: nothing sane left to wait for */
                    return e;
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
    for (Py_ssize_t i = 0; i < nviews; i++)
        PyBuffer_Release(&views[i]);
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
 * returns, and done[i] == 1 exactly for the segments whose copies completed. Every offset and
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
    int fixed; /* slots registered with the ring: READ_FIXED, no per-read page pinning */
    int reg_drop, reg_new; /* unregister the reader's previous buffer / register this one first */
    int mismatch;
    size_t bad_seg, bad_check;
    uint32_t got;
    uint64_t cached_bytes, direct_bytes;
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

/* Submit (the rest of) slot sl's read: `g` bytes of segment s already arrived. */
static int fill_submit(struct fill_job *j, unsigned sl, const struct fill_seg *s, uint32_t g)
{
    char *b = j->buf + (size_t)sl * j->slot;
    return ring_submit(&j->r->ring, j->fixed ? IORING_OP_READ_FIXED : IORING_OP_READ, j->r->fd, b + g,
                       s->len - g, s->off + g, sl, j->fixed ? (int)sl : -1);
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
    size_t next = 0;
    int err = 0, stop = 0;

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
            if (cached || !r->use_uring) {
                /* All pages cached (a buffered pread touches no disk), or no io_uring here. */
                size_t got = 0;
                e = pread_full(cached ? j->cached_fd : r->fd, b, cached ? s->want : s->len, s->off, &got);
                free_slots[nfree++] = sl;
                if (e || got < s->want) {
                    err = e ? e : -1;
                    *bad = next;
                    stop = 1;
                    break;
                }
                if (cached)
                    j->cached_bytes += s->want;
                else
                    j->direct_bytes += s->want;
                if (fill_process(j, next, b))
                    stop = 1;
                next++;
                continue;
            }
            e = fill_submit(j, sl, s, 0);
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
            int e = ring_wait(&r->ring);
            if (e) /* the ring itself failed: nothing sane left to wait for */
                return e;
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
                if (res > 0 && slot_got[sl] < s->want && slot_got[sl] % r->offset_align == 0 && !stop) {
                    /* A short but aligned read: ask for the rest. */
                    e = fill_submit(j, sl, s, slot_got[sl]);
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
    int cached_fd, err;
    size_t nsegs = 0, nchecks = 0, ncopies = 0, ndests = 0, bad = 0;
    struct fill_job j;

    if (!PyArg_ParseTuple(args, "OnOOOOOi:fill", &bufobj, &slot, &segobj, &chkobj, &cpyobj, &dstobj,
                          &doneobj, &cached_fd))
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
        result = Py_BuildValue("(KK(nnk))", (unsigned long long)j.cached_bytes,
                               (unsigned long long)j.direct_bytes, (Py_ssize_t)j.bad_seg,
                               (Py_ssize_t)j.bad_check, (unsigned long)j.got);
    } else {
        result = Py_BuildValue("(KKO)", (unsigned long long)j.cached_bytes,
                               (unsigned long long)j.direct_bytes, Py_None);
    }
out:
    if (vb.obj)
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
     "fill(buffer, slot, segments, checks, copies, dests, done, cached_fd) -> (cached_bytes, "
     "direct_bytes, mismatch): read segments into slots of buffer (reads in flight on every free "
     "slot), check each segment's crc32c blocks, then copy its runs into the destinations; "
     "mismatch is None or (segment, check, crc found), after which nothing more was copied. "
     "Records are packed structs (see csrc/uring.c); done[i] becomes 1 when segment i was copied. "
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
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ReaderType = {
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

/* ------------------------------------------------------------------------------------------ */
/* Module functions.                                                                            */

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

static PyObject *mod_statx_dioalign(PyObject *Py_UNUSED(m), PyObject *arg)
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

static PyObject *mod_rename_exchange(PyObject *Py_UNUSED(m), PyObject *args)
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
static int cached_pages(int fd, uint64_t off, uint64_t len, uint64_t *cached, uint64_t *total)
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

static PyObject *mod_cached_pages(PyObject *Py_UNUSED(m), PyObject *args)
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
    .m_doc = "O_DIRECT io_uring writer/reader on raw syscalls (see csrc/uring.c for invariants).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__uring(void)
{
    PyObject *m;
    if (PyType_Ready(&WriterType) < 0 || PyType_Ready(&ReaderType) < 0)
        return NULL;
    crc32c_init();
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
