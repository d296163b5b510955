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
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* Tests only (_uring._test_poll_wait): wait through poll(2) even where the kernel has
 * IORING_FEAT_EXT_ARG, so the fallback of kernels older than 5.11 runs here too. */
int ring_force_poll_wait;

/* Set by module.c: see ring.h. NULL: signals never end a wait. */
int (*ring_signal_hook)(void);

int sys_io_uring_setup(unsigned entries, struct io_uring_params *p)
{
    return (int)syscall(__NR_io_uring_setup, entries, p);
}

static int sys_io_uring_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags)
{
    return (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, NULL, 0);
}

/* The kernel ABI of the wait's timeout, spelled here so that older <linux/io_uring.h> headers
 * (before 5.11, 5.19) still build: struct io_uring_getevents_arg, struct __kernel_timespec and
 * the flags. The running kernel says what it supports (IORING_FEAT_EXT_ARG; a cancel it does not
 * know fails alone). */
#ifndef IORING_FEAT_EXT_ARG
#define IORING_FEAT_EXT_ARG (1U << 8)
#endif
#ifndef IORING_ENTER_EXT_ARG
#define IORING_ENTER_EXT_ARG (1U << 3)
#endif
#ifndef IORING_ASYNC_CANCEL_ANY
#define IORING_ASYNC_CANCEL_ANY (1U << 2)
#endif
struct ring_getevents_arg {
    uint64_t sigmask;
    uint32_t sigmask_sz;
    uint32_t pad;
    uint64_t ts;
};
struct ring_timespec {
    int64_t tv_sec;
    long long tv_nsec;
};

/* io_uring_enter(GETEVENTS) that returns -1/ETIME once `ts` passes with fewer than min_complete
 * completions (IORING_ENTER_EXT_ARG, kernel 5.11+). */
static int sys_io_uring_wait_until(int fd, unsigned min_complete, const struct ring_timespec *ts)
{
    struct ring_getevents_arg arg;
    memset(&arg, 0, sizeof(arg));
    arg.sigmask_sz = _NSIG / 8;
    arg.ts = (uint64_t)(uintptr_t)ts;
    return (int)syscall(__NR_io_uring_enter, fd, 0, min_complete,
                        IORING_ENTER_GETEVENTS | IORING_ENTER_EXT_ARG, &arg, sizeof(arg));
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
    r->ext_arg = (p.features & IORING_FEAT_EXT_ARG) != 0;
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

/* The next SQE of the ring, zeroed, for the caller to fill; sqe_submit() publishes it. */
static struct io_uring_sqe *sqe_get(struct ring *r)
{
    struct io_uring_sqe *sqe = &r->sqes[*r->sq_tail & *r->sq_mask];
    memset(sqe, 0, sizeof(*sqe));
    return sqe;
}

/* Publish the SQE sqe_get() returned and submit it. Returns io_uring_enter's count of submitted
 * SQEs (>= 0) or a negative errno. */
static int sqe_submit(struct ring *r)
{
    unsigned tail = *r->sq_tail;
    unsigned idx = tail & *r->sq_mask;
    r->sq_array[idx] = idx;
    /* Release: the kernel must see the SQE contents before the new tail. */
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
    for (;;) {
        int ret = sys_io_uring_enter(r->fd, 1, 0, 0);
        if (ret >= 0)
            return ret;
        if (errno != EINTR)
            return -errno;
    }
}

/* Queue one SQE and submit it. Returns 0 or a positive errno. The caller guarantees that fewer
 * than `entries` requests are in flight, so the SQ always has room. */
int ring_submit(struct ring *r, uint8_t opcode, int fd, void *addr, unsigned len,
                uint64_t off, uint64_t user_data, int buf_index)
{
    struct io_uring_sqe *sqe = sqe_get(r);
    int ret;

    sqe->opcode = opcode;
    sqe->fd = fd;
    sqe->addr = (uint64_t)(uintptr_t)addr;
    sqe->len = len;
    sqe->off = off;
    sqe->user_data = user_data;
    if (buf_index >= 0)
        sqe->buf_index = (uint16_t)buf_index;
    ret = sqe_submit(r);
    if (ret < 0)
        return -ret;
    return ret == 1 ? 0 : EAGAIN;
}

static int64_t now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

int64_t ring_deadline(unsigned ms)
{
    return now_ms() + ms;
}

unsigned ring_ms_until(int64_t until)
{
    int64_t left = until - now_ms();
    return left < 1 ? 1 : left > 0x7fffffff ? 0x7fffffff : (unsigned)left;
}

static int cq_ready(struct ring *r)
{
    return __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE) != *r->cq_head;
}

/* A signal interrupted the wait: 1 when it must end (an interruptible wait whose signal hook says
 * a handler raised), 0 to wait on. */
static int stop_on_signal(int interruptible)
{
    return interruptible && ring_signal_hook && ring_signal_hook();
}

/* Block until at least one completion is available, or until timeout_ms milliseconds have passed
 * without one (timeout_ms 0: no deadline). Returns 0, ETIME at the deadline, EINTR when a signal
 * arrived and the signal hook says its handler raised (interruptible waits only), or another
 * positive errno. Any other signal (EINTR) does not end the wait: the deadline bounds it.
 *
 * Why a deadline at all: a request the kernel consumed may never complete (seen once: an O_DIRECT
 * write on ext4 whose completion never reached the ring, nothing in flight on the device, no
 * io-wq worker), and a wait without one hangs its process for ever, where a checkpoint library
 * must fail with a typed error. The caller decides what a missed deadline means (ring_cancel_all).
 * Why the signal hook: a Ctrl-C (or pytest-timeout's alarm) would otherwise wait for the deadline.
 *
 * Kernels with IORING_FEAT_EXT_ARG (5.11+) bound io_uring_enter itself; older ones poll(2) the
 * ring fd (POLLIN once a completion is posted) and then enter to run pending completion work. */
int ring_wait(struct ring *r, unsigned timeout_ms, int interruptible)
{
    int64_t deadline = timeout_ms ? now_ms() + timeout_ms : 0;
    for (;;) {
        int64_t left;
        if (cq_ready(r))
            return 0;
        if (!timeout_ms) {
            if (sys_io_uring_enter(r->fd, 0, 1, IORING_ENTER_GETEVENTS) >= 0)
                continue;
            if (errno != EINTR)
                return errno;
            if (stop_on_signal(interruptible))
                return EINTR;
            continue;
        }
        left = deadline - now_ms();
        if (left <= 0)
            return cq_ready(r) ? 0 : ETIME;
        if (r->ext_arg && !ring_force_poll_wait) {
            struct ring_timespec ts = {.tv_sec = left / 1000, .tv_nsec = (left % 1000) * 1000000};
            if (sys_io_uring_wait_until(r->fd, 1, &ts) >= 0 || errno == ETIME)
                continue; /* the loop's head looks at the ring and at the clock */
            if (errno != EINTR)
                return errno;
            if (stop_on_signal(interruptible))
                return EINTR;
        } else {
            struct pollfd pfd = {.fd = r->fd, .events = POLLIN};
            int n = poll(&pfd, 1, left > 0x7fffffff ? 0x7fffffff : (int)left);
            if (n < 0 && errno != EINTR)
                return errno;
            if (n < 0 && stop_on_signal(interruptible))
                return EINTR;
            /* Completions may wait for this task to run their work: a GETEVENTS enter that asks for
             * none runs it without blocking. */
            if (sys_io_uring_enter(r->fd, 0, 0, IORING_ENTER_GETEVENTS) < 0 && errno != EINTR)
                return errno;
        }
    }
}

/* Ask the kernel to cancel every request in flight on the ring (IORING_OP_ASYNC_CANCEL with
 * IORING_ASYNC_CANCEL_ANY, kernel 5.19+). Returns 0 or a positive errno of the submission. The
 * cancel's own completion carries RING_CANCEL_UD and is skipped by ring_pop(); each request it
 * cancelled completes with -ECANCELED, and one already running on the device completes as it
 * would have. A kernel without CANCEL_ANY fails the cancel itself (-EINVAL): nothing is
 * cancelled, and the caller's grace wait decides as it would for a request that cannot be. */
int ring_cancel_all(struct ring *r)
{
    struct io_uring_sqe *sqe = sqe_get(r);
    int ret;

    sqe->opcode = IORING_OP_ASYNC_CANCEL;
    sqe->fd = -1;
    sqe->cancel_flags = IORING_ASYNC_CANCEL_ANY;
    sqe->user_data = RING_CANCEL_UD;
    ret = sqe_submit(r);
    return ret < 0 ? -ret : 0;
}
