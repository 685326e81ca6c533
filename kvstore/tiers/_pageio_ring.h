/* _pageio_ring.h: the io_uring part of _pageio.c (included by it, after Python.h and the
 * system headers it needs): one ring per calling thread, raw syscalls (no liburing). */
#ifndef PAGEIO_RING_H
#define PAGEIO_RING_H

/* ----------------------------------------------------------------------------- io_uring */
/* One ring per calling thread (the disk tier's I/O threads live as long as the tier), set up
 * on first use with the raw syscalls (no liburing) and torn down when the thread exits. */

#define RING_ENTRIES 128

struct ring {
    int fd;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_map, *cq_map;
    size_t sq_len, cq_len, sqes_len;
};

static pthread_key_t ring_key;
static pthread_once_t ring_once = PTHREAD_ONCE_INIT;
static int ring_broken;     /* io_uring unavailable: every call runs the extents in turn */

static void ring_free(void *p) {
    struct ring *r = p;
    if (r->sqes != NULL && r->sqes != MAP_FAILED) munmap(r->sqes, r->sqes_len);
    if (r->cq_map != NULL && r->cq_map != MAP_FAILED) munmap(r->cq_map, r->cq_len);
    if (r->sq_map != NULL && r->sq_map != MAP_FAILED) munmap(r->sq_map, r->sq_len);
    if (r->fd >= 0) close(r->fd);
    free(r);
}

static void ring_key_init(void) {
    if (pthread_key_create(&ring_key, ring_free) != 0) ring_broken = 1;
}

static struct ring *ring_get(void) {
    pthread_once(&ring_once, ring_key_init);
    if (ring_broken) return NULL;
    struct ring *r = pthread_getspecific(ring_key);
    if (r != NULL) return r;
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    r = calloc(1, sizeof *r);
    if (r == NULL) return NULL;
    r->fd = (int)syscall(__NR_io_uring_setup, RING_ENTRIES, &p);
    if (r->fd < 0) goto fail;
    r->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    r->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sq_map = mmap(NULL, r->sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                     IORING_OFF_SQ_RING);
    r->cq_map = mmap(NULL, r->cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                     IORING_OFF_CQ_RING);
    r->sqes = mmap(NULL, r->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                   IORING_OFF_SQES);
    if (r->sq_map == MAP_FAILED || r->cq_map == MAP_FAILED || r->sqes == MAP_FAILED) goto fail;
    char *sq = r->sq_map, *cq = r->cq_map;
    r->sq_head = (unsigned *)(sq + p.sq_off.head);
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    if (pthread_setspecific(ring_key, r) != 0) goto fail;
    return r;
fail:
    ring_broken = 1;
    ring_free(r);
    return NULL;
}

#define NOT_RUN INT64_MIN     /* got[i] of an extent the ring did not complete */

/* Extents [0, e) through the ring, at most `depth` in flight; got[i] = the completion's result,
 * or NOT_RUN for extents the caller must still run (all of them if the ring fails at once).
 * Never returns with a read or write in flight. */
static void ring_run(struct ring *r, int write, Py_ssize_t e, const int64_t *fds,
                           const int64_t *offs, const int64_t *ptr, struct iovec *iov,
                           int64_t *got, unsigned depth) {
    Py_ssize_t next = 0, done = 0;
    unsigned inflight = 0, queued = 0;   /* submitted and not completed; in the SQ ring */
    int failed = 0;
    if (depth > RING_ENTRIES) depth = RING_ENTRIES;
    for (Py_ssize_t i = 0; i < e; i++) got[i] = NOT_RUN;
    while (done < next || (!failed && next < e)) {
        unsigned tail = *r->sq_tail;
        while (!failed && next < e && inflight + queued < depth) {
            unsigned idx = tail & *r->sq_mask;
            struct io_uring_sqe *sqe = &r->sqes[idx];
            memset(sqe, 0, sizeof *sqe);
            sqe->opcode = write ? IORING_OP_WRITEV : IORING_OP_READV;
            sqe->fd = (int)fds[next];
            sqe->off = (uint64_t)offs[next];
            sqe->addr = (uint64_t)(uintptr_t)&iov[ptr[next]];
            sqe->len = (unsigned)(ptr[next + 1] - ptr[next]);
            sqe->user_data = (uint64_t)next;
            r->sq_array[idx] = idx;
            tail++;
            next++;
            queued++;
        }
        __atomic_store_n(r->sq_tail, tail, __ATOMIC_RELEASE);
        int n = (int)syscall(__NR_io_uring_enter, r->fd, failed ? 0 : queued, inflight ? 1 : 0,
                             IORING_ENTER_GETEVENTS, NULL, 0);
        if (n < 0 && errno != EINTR && errno != EAGAIN && errno != EBUSY && !failed) {
            /* NOTE: not seen with a working ring (its fd is ours, the SQEs valid). Take back
             * what the kernel has not consumed, wait for what it has (completions are posted
             * without io_uring_enter), and leave the rest to the caller. */
            failed = ring_broken = 1;
            __atomic_store_n(r->sq_tail, __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE),
                             __ATOMIC_RELEASE);
            next -= queued;
            queued = 0;
        } else if (n > 0 && !failed) {
            queued -= (unsigned)n;
            inflight += (unsigned)n;
        }
        unsigned head = *r->cq_head;
        unsigned ctail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
        if (failed && head == ctail && inflight) sched_yield();
        for (; head != ctail; head++) {
            struct io_uring_cqe *cqe = &r->cqes[head & *r->cq_mask];
            got[cqe->user_data] = cqe->res;
            inflight--;
            done++;
        }
        __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    }
}

static PyObject *ring_available(PyObject *self, PyObject *noargs) {
    return PyBool_FromLong(ring_get() != NULL);
}

#endif /* PAGEIO_RING_H */
