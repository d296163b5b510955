/*
 * ring.h: the raw io_uring layer of distckpt._uring (implemented in ring.c): one ring, set up,
 * mapped, fed and reaped through the io_uring system calls alone (<linux/io_uring.h>, no
 * liburing). It knows nothing of Python, of files or of buffers; writer.c and reader.c decide
 * what goes in flight and own the memory the kernel reads or writes.
 *
 * Invariants (what the callers rely on, and what they must do in return):
 *   - fd lifecycle: ring_setup() opens the ring fd and maps its three areas; ring_free() unmaps
 *     them and closes the fd, and is the only place a ring fd is closed (the one exception,
 *     _uring.probe_uring in module.c, opens and closes a throw-away ring of its own). A failed
 *     ring_setup() leaves nothing open or mapped. ring_free() is safe on a ring that was only
 *     ring_init_empty()ed, that failed to set up, or that was already freed.
 *   - The caller never calls ring_free() with a request in flight (the kernel could still write
 *     into memory about to be released: the objects drain first; one whose request outlived
 *     ring_wait()'s deadline and ring_cancel_all()'s grace never frees it), and never submits with
 *     `entries` requests in flight (so the SQ always has room). The CQ is twice the SQ, so
 *     completions never overflow.
 *   - Every function returns 0 or a positive errno (ring_pop: 1 or 0); nothing raises, prints
 *     or needs the GIL: all of it runs with the GIL released (ring_signal_hook, module.c's, takes
 *     the GIL itself when a signal interrupts an interruptible wait).
 *   - A ring is used by one thread at a time (its owner's busy flag guarantees it).
 */
#ifndef DISTCKPT_RING_H
#define DISTCKPT_RING_H

#include <linux/io_uring.h>
#include <stddef.h>
#include <stdint.h>

struct ring {
    int fd;
    unsigned entries;
    int ext_arg; /* IORING_FEAT_EXT_ARG: io_uring_enter takes a timeout (kernel 5.11+) */
    void *sq_ptr, *cq_ptr;
    size_t sq_sz, cq_sz;
    struct io_uring_sqe *sqes;
    size_t sqes_sz;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_cqe *cqes;
};

/* The raw system calls; -1 with errno on failure. setup and register are also used outside
 * ring.c: module.c's probe, and the fixed-buffer registrations of writer.c and reader.c. */
int sys_io_uring_setup(unsigned entries, struct io_uring_params *p);
int sys_io_uring_register(int fd, unsigned opcode, const void *arg, unsigned nr_args);

/* An empty ring: fd -1, nothing mapped (what ring_free() leaves behind). */
void ring_init_empty(struct ring *r);
/* Unmap and close everything the ring holds (no request may be in flight). Idempotent. */
void ring_free(struct ring *r);
/* Returns 0 or a positive errno. On failure nothing is left open or mapped. */
int ring_setup(struct ring *r, unsigned entries);
/* Queue one SQE and submit it (buf_index >= 0: a fixed-buffer opcode). Returns 0 or a positive
 * errno. The caller guarantees that fewer than `entries` requests are in flight. */
int ring_submit(struct ring *r, uint8_t opcode, int fd, void *addr, unsigned len, uint64_t off,
                uint64_t user_data, int buf_index);
/* Block until at least one completion is available, or for at most timeout_ms milliseconds
 * (0: no deadline). Returns 0, ETIME when the deadline passed with none, EINTR when
 * `interruptible` and a signal's handler raised (ring_signal_hook), or a positive errno. */
int ring_wait(struct ring *r, unsigned timeout_ms, int interruptible);
/* Called without the GIL when a signal interrupts an interruptible wait: nonzero ends the wait
 * with EINTR. module.c sets it to run Python's signal handlers (main thread only), returning
 * nonzero when one raised, its exception left set for the call to raise. */
extern int (*ring_signal_hook)(void);
/* Ask the kernel to cancel every request in flight (their completions still come, as
 * -ECANCELED or as done). Returns 0 or a positive errno. */
int ring_cancel_all(struct ring *r);
/* Tests only: 1 makes ring_wait() use its poll(2) fallback (module.c's _test_poll_wait). */
extern int ring_force_poll_wait;

/* How long a caller waits, after ring_cancel_all(), for the cancelled requests to complete
 * (one deadline for all of them: ring_deadline, then ring_ms_until per wait); those that still
 * do not are in flight for good (the caller's object is then wedged). */
#define RING_CANCEL_GRACE_MS 2000
/* The monotonic time (ms) `ms` from now, and the ms left until such a time, at least 1 (a wait
 * given it ends at that deadline: ring_wait's 0 would mean none). */
int64_t ring_deadline(unsigned ms);
unsigned ring_ms_until(int64_t until);

/* The user_data of ring_cancel_all()'s own request; ring_pop() consumes its completion. */
#define RING_CANCEL_UD UINT64_MAX

/* Pop one available completion of the caller's requests; returns 0 if none. The completion of
 * ring_cancel_all()'s request is consumed here, never returned. Inline here: it runs once per
 * completion in the writer's and the reader's loops. */
static inline int ring_pop(struct ring *r, uint64_t *user_data, int32_t *res)
{
    for (;;) {
        unsigned head = *r->cq_head;
        struct io_uring_cqe *cqe;
        if (__atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE) == head)
            return 0;
        cqe = &r->cqes[head & *r->cq_mask];
        *user_data = cqe->user_data;
        *res = cqe->res;
        __atomic_store_n(r->cq_head, head + 1, __ATOMIC_RELEASE);
        if (*user_data != RING_CANCEL_UD)
            return 1;
    }
}

#endif
