/* _pageio: the KV tiers' per-page work without the GIL.
 *
 * The disk tier's I/O threads used to do per extent and per page Python work (build the iovec
 * list, call os.preadv, hash each page, compare): ~20-30 us with the GIL held per extent. At the
 * thousands of extents a sparse decode step reads, that was ~200 ms of GIL per step, taken from
 * the engine thread that selects and computes (py-spy --gil on bench/pipeline.py's workload).
 * Here a whole task's extents are read with one call and a whole task's pages hashed with
 * another, both with the GIL released.
 *
 *   preadv_extents(fds, offsets, iov_ptr, iov_base, iov_len, got[, depth])
 *       extent i: preadv(fds[i], iov[iov_ptr[i]:iov_ptr[i+1]], offsets[i]); got[i] = bytes read,
 *       or -errno. iov_base holds addresses (uint64), iov_len lengths (int64). Returns False
 *       once io_uring has failed in this process (then pass depth 0). With depth > 0
 *       the extents go through this thread's io_uring, up to `depth` in flight (one thread
 *       keeps the disk's queue full at a few us of CPU per request, where a pool of threads
 *       each blocked in preadv costs a context switch or two per request); without io_uring
 *       (old kernel, seccomp) they run one after another as with depth 0.
 *   pwritev_extents(...)                  the same with pwritev.
 *   ring_available()                      whether io_uring works here (sets up this thread's).
 *   hash_pages(addrs, nbytes, out)        out[j] = XXH64(seed 0) of the nbytes at addrs[j].
 *   copy_pages(dst, dst_pages, src, src_pages, nbytes, dst_idx, src_idx)
 *       page dst_idx[i] of the pool at address dst <- page src_idx[i] of the pool at src
 *       (pools of dst_pages / src_pages pages of nbytes each; indices checked): the memory
 *       tiers' page moves (host -> device fills, device -> host demotions) as one copy per
 *       page, where torch needs a gather into a buffer and a scatter out of it.
 *
 * Arrays are int64/uint64 buffers (numpy). The caller keeps every buffer alive and unmoved for
 * the call. XXH64 is written from its specification (Yann Collet's xxHash, BSD 2-clause
 * algorithm), checked against the xxhash package in tests/test_tiers.py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <linux/io_uring.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

/* ----------------------------------------------------------------------------- XXH64 */
static const uint64_t P1 = 0x9E3779B185EBCA87ULL;
static const uint64_t P2 = 0xC2B2AE3D27D4EB4FULL;
static const uint64_t P3 = 0x165667B19E3779F9ULL;
static const uint64_t P4 = 0x85EBCA77C2B2AE63ULL;
static const uint64_t P5 = 0x27D4EB2F165667C5ULL;

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t read64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8); /* little-endian hosts (x86-64, aarch64) */
    return v;
}

static inline uint32_t read32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint64_t xxh_round(uint64_t acc, uint64_t input) {
    acc += input * P2;
    acc = rotl64(acc, 31);
    return acc * P1;
}

static inline uint64_t xxh_merge(uint64_t acc, uint64_t val) {
    acc ^= xxh_round(0, val);
    return acc * P1 + P4;
}

static uint64_t xxh64(const uint8_t *p, size_t len) {
    const uint8_t *end = p + len;
    uint64_t h;
    if (len >= 32) {
        uint64_t v1 = P1 + P2, v2 = P2, v3 = 0, v4 = (uint64_t)0 - P1;
        const uint8_t *limit = end - 32;
        do {
            v1 = xxh_round(v1, read64(p));
            v2 = xxh_round(v2, read64(p + 8));
            v3 = xxh_round(v3, read64(p + 16));
            v4 = xxh_round(v4, read64(p + 24));
            p += 32;
        } while (p <= limit);
        h = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
        h = xxh_merge(h, v1);
        h = xxh_merge(h, v2);
        h = xxh_merge(h, v3);
        h = xxh_merge(h, v4);
    } else {
        h = P5;
    }
    h += (uint64_t)len;
    while (p + 8 <= end) {
        h ^= xxh_round(0, read64(p));
        h = rotl64(h, 27) * P1 + P4;
        p += 8;
    }
    if (p + 4 <= end) {
        h ^= (uint64_t)read32(p) * P1;
        h = rotl64(h, 23) * P2 + P3;
        p += 4;
    }
    while (p < end) {
        h ^= (*p) * P5;
        h = rotl64(h, 11) * P1;
        p++;
    }
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
}

/* ----------------------------------------------------------------------------- buffers */
/* A writable or read-only 1-D buffer of 8-byte items; `n` its length in items. */
static int get_buf(PyObject *obj, Py_buffer *view, int writable, const char *name, Py_ssize_t *n) {
    if (PyObject_GetBuffer(obj, view, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS |
                                          PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != 8) {
        PyErr_Format(PyExc_TypeError, "%s: expected an array of 8-byte integers", name);
        PyBuffer_Release(view);
        return -1;
    }
    *n = view->len / 8;
    return 0;
}

/* Two buffers as get_buf, of one length `n` (named `what` in the error); on failure neither
 * is held. */
static int get_pair(PyObject *oa, Py_buffer *va, int wa, const char *na, PyObject *ob,
                    Py_buffer *vb, int wb, const char *nb, const char *what, Py_ssize_t *n) {
    Py_ssize_t la, lb;
    if (get_buf(oa, va, wa, na, &la) < 0)
        return -1;
    if (get_buf(ob, vb, wb, nb, &lb) < 0) {
        PyBuffer_Release(va);
        return -1;
    }
    if (la != lb) {
        PyBuffer_Release(va);
        PyBuffer_Release(vb);
        PyErr_SetString(PyExc_ValueError, what);
        return -1;
    }
    *n = la;
    return 0;
}

#include "_pageio_ring.h"

/* ----------------------------------------------------------------------------- vectored I/O */

static PyObject *vector_io(PyObject *args, int write) {
    PyObject *o[6];
    int depth = 0;
    if (!PyArg_ParseTuple(args, "OOOOOO|i", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &depth))
        return NULL;
    static const char *names[6] = {"fds", "offsets", "iov_ptr", "iov_base", "iov_len", "got"};
    Py_buffer v[6];
    Py_ssize_t n[6];
    int held = 0;
    for (; held < 6; held++)
        if (get_buf(o[held], &v[held], held == 5, names[held], &n[held]) < 0)
            goto fail;
    Py_ssize_t e = n[0];
    if (n[1] != e || n[2] != e + 1 || n[5] != e || n[3] != n[4]) {
        PyErr_SetString(PyExc_ValueError, "extent arrays disagree in length");
        goto fail;
    }
    const int64_t *fds = v[0].buf, *offs = v[1].buf, *ptr = v[2].buf, *lens = v[4].buf;
    const uint64_t *bases = v[3].buf;
    int64_t *got = v[5].buf;
    for (Py_ssize_t i = 0; i < e; i++) {
        if (ptr[i] < 0 || ptr[i + 1] < ptr[i] || ptr[i + 1] > n[3] || ptr[i + 1] - ptr[i] > IOV_MAX) {
            PyErr_SetString(PyExc_ValueError, "iov_ptr out of range");
            goto fail;
        }
    }
    struct iovec *all = NULL;
    if (depth > 0 && e > 1 && (all = malloc((size_t)(n[3] > 0 ? n[3] : 1) * sizeof *all)) == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    struct ring *r = all != NULL ? ring_get() : NULL;
    if (r != NULL) {
        for (Py_ssize_t j = 0; j < n[3]; j++) {
            all[j].iov_base = (void *)(uintptr_t)bases[j];
            all[j].iov_len = (size_t)lens[j];
        }
        ring_run(r, write, e, fds, offs, ptr, all, got, (unsigned)depth);
    }
    free(all);
    struct iovec iov[IOV_MAX];
    for (Py_ssize_t i = 0; i < e; i++) {
        if (r != NULL && got[i] != NOT_RUN) continue;      /* the ring did this one */
        int cnt = (int)(ptr[i + 1] - ptr[i]);
        for (int j = 0; j < cnt; j++) {
            iov[j].iov_base = (void *)(uintptr_t)bases[ptr[i] + j];
            iov[j].iov_len = (size_t)lens[ptr[i] + j];
        }
        ssize_t r;
        do {
            r = write ? pwritev((int)fds[i], iov, cnt, (off_t)offs[i])
                      : preadv((int)fds[i], iov, cnt, (off_t)offs[i]);
        } while (r < 0 && errno == EINTR);
        got[i] = r < 0 ? -(int64_t)errno : (int64_t)r;
    }
    Py_END_ALLOW_THREADS
    for (int k = 0; k < held; k++)
        PyBuffer_Release(&v[k]);
    return PyBool_FromLong(!ring_broken);
fail:
    for (int k = 0; k < held; k++)
        PyBuffer_Release(&v[k]);
    return NULL;
}

static PyObject *preadv_extents(PyObject *self, PyObject *args) { return vector_io(args, 0); }
static PyObject *pwritev_extents(PyObject *self, PyObject *args) { return vector_io(args, 1); }

static PyObject *hash_pages(PyObject *self, PyObject *args) {
    PyObject *oa, *oo;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "OnO", &oa, &nbytes, &oo))
        return NULL;
    if (nbytes < 0) {
        PyErr_SetString(PyExc_ValueError, "nbytes must be >= 0");
        return NULL;
    }
    Py_buffer va, vo;
    Py_ssize_t na;
    if (get_pair(oa, &va, 0, "addrs", oo, &vo, 1, "out", "addrs and out differ in length",
                 &na) < 0)
        return NULL;
    const uint64_t *addrs = va.buf;
    uint64_t *out = vo.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < na; j++)
        out[j] = xxh64((const uint8_t *)(uintptr_t)addrs[j], (size_t)nbytes);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&va);
    PyBuffer_Release(&vo);
    Py_RETURN_NONE;
}

static PyObject *copy_pages(PyObject *self, PyObject *args) {
    unsigned long long dst, src;
    Py_ssize_t dst_pages, src_pages, nbytes;
    PyObject *od, *os;
    if (!PyArg_ParseTuple(args, "KnKnnOO", &dst, &dst_pages, &src, &src_pages, &nbytes, &od, &os))
        return NULL;
    if (nbytes < 0 || dst_pages < 0 || src_pages < 0) {
        PyErr_SetString(PyExc_ValueError, "sizes must be >= 0");
        return NULL;
    }
    Py_buffer vd, vs;
    Py_ssize_t nd;
    if (get_pair(od, &vd, 0, "dst_idx", os, &vs, 0, "src_idx",
                 "dst_idx and src_idx differ in length", &nd) < 0)
        return NULL;
    const int64_t *di = vd.buf, *si = vs.buf;
    for (Py_ssize_t i = 0; i < nd; i++)
        if (di[i] < 0 || di[i] >= dst_pages || si[i] < 0 || si[i] >= src_pages) {
            PyBuffer_Release(&vd);
            PyBuffer_Release(&vs);
            PyErr_SetString(PyExc_ValueError, "page index out of range");
            return NULL;
        }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < nd; i++)
        memcpy((char *)(uintptr_t)dst + di[i] * nbytes,
               (const char *)(uintptr_t)src + si[i] * nbytes, (size_t)nbytes);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&vd);
    PyBuffer_Release(&vs);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"preadv_extents", preadv_extents, METH_VARARGS,
     "preadv_extents(fds, offsets, iov_ptr, iov_base, iov_len, got): one preadv per extent, "
     "without the GIL; got[i] = bytes read or -errno; depth > 0: through io_uring"},
    {"pwritev_extents", pwritev_extents, METH_VARARGS,
     "pwritev_extents(fds, offsets, iov_ptr, iov_base, iov_len, got): one pwritev per extent"},
    {"ring_available", ring_available, METH_NOARGS,
     "ring_available(): whether io_uring works here"},
    {"hash_pages", hash_pages, METH_VARARGS,
     "hash_pages(addrs, nbytes, out): out[j] = XXH64 (seed 0) of nbytes at addrs[j]"},
    {"copy_pages", copy_pages, METH_VARARGS,
     "copy_pages(dst, dst_pages, src, src_pages, nbytes, dst_idx, src_idx): page dst_idx[i] "
     "of the pool at dst <- page src_idx[i] of the pool at src, without the GIL"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pageio",
    "The KV tiers' page I/O, checksums and page copies without the GIL.", -1, methods};

PyMODINIT_FUNC PyInit__pageio(void) { return PyModule_Create(&module); }
