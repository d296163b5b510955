/*
 * ring.c: the raw io_uring layer (see ring.h for its interface and invariants): the three system
 * calls, the ring's setup (io_uring_setup, then the mmap of the SQ ring, the CQ ring unless the
 * kernel maps both at once, and the SQE array), its release, submit and wait. ring_pop() is
 * inline in ring.h.
 *
 * fd lifecycle: ring_setup() opens the ring fd (io_uring_setup) and, on any failure after that,
 * unmaps what it mapped and closes the fd itself; on success the fd belongs to the struct ring
 * until ring_free() closes it (called from writer_release() and reader_release()). No function
 * here touches any other fd: the file fds passed to ring_submit() are the caller's.
 *
 * Memory ordering: the SQ tail is stored with release semantics after the SQE is written, the
 * CQ tail loaded with acquire before a CQE is read, and the CQ head stored with release after.
 */
#define _GNU_SOURCE
#include "ring.h"

#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

int sys_io_uring_setup(unsigned entries, struct io_uring_params *p)
{
    return (int)syscall(__NR_io_uring_setup, entries, p);
}

static int sys_io_uring_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags)
{
    return (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, NULL, 0);
}

int sys_io_uring_register(int fd, unsigned opcode, const void *arg, unsigned nr_args)
{
    return (int)syscall(__NR_io_uring_register, fd, opcode, arg, nr_args);
}

void ring_init_empty(struct ring *r)
{
    memset(r, 0, sizeof(*r));
    r->fd = -1;
}

void ring_free(struct ring *r)
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
int ring_setup(struct ring *r, unsigned entries)
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
int ring_submit(struct ring *r, uint8_t opcode, int fd, void *addr, unsigned len,
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
int ring_wait(struct ring *r)
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
