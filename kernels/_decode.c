/* Sparse decode attention over per-row page lists, in C without the GIL (kernels/sparse_attention.py).
 *
 * Row r = b * KVH + h attends its `group` query heads to the tokens of the pages listed in
 * slots[row_ptr[r]:row_ptr[r + 1]] (KV head h of each page; the row's last page holds
 * last_len[r] tokens, the others page_size). The pool is [S, 2, KVH, page_size, D] (HND: a
 * head's slice of a page is contiguous), bf16 or float32; queries, output and the log-sum-exp
 * are float32. Online softmax over a page at a time (kernels/_attend_rows.h), float32
 * accumulation, each page's K and V read once, where torch gathers them into a padded
 * workspace, upcasts and runs SDPA over the padding. An empty row yields out 0, lse -inf
 * (the half of a split attention with none of the row's pages). With `carry`, out and lse
 * come in holding the result over other pages (the first half of a split attention), and
 * the row goes on from there.
 *
 * Rows longer than CHUNK_TOKENS split into chunks that threads share, merged in a fixed order
 * (flash-decoding's split-K): a row's bits depend on its pages only, not on the batch or the
 * threads. The row functions and the chunks' merge round differently from one another's
 * instruction sets; one process always runs the same ones, so its modes agree bit for bit.
 * Speeds (bench/results/sparse_ops.txt, docs/perf-notes.md): over every page of 1 x 7K
 * tokens of bf16 one core streams ~14.5 GB/s, one core's DRAM read bandwidth.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "_api.h"
#include "_pool.h"
#include "_rows.h"

#include "_attend_rows.h"

typedef void (*row_fn)(const float *, const char *, int, int64_t, int64_t, int64_t,
                       const int64_t *, int64_t, int, int, int, int, float, float *, float *,
                       float *);

/* A row's pages go in chunks of CHUNK_TOKENS tokens' pages (the last chunk the rest): the
 * work items that threads share, so that one sequence's three rows keep two cores busy. A
 * row of one chunk is computed straight into out/lse; a longer one's chunks leave their
 * states in `state`, merged in chunk order after all items ran. Chunks depend only on the
 * row's page count, so a row's bits do not depend on the threads or the batch. */
#define CHUNK_TOKENS 512

/* One call's items and, for one thread, its run of them [i0, i1). */
typedef struct {
    row_fn fn;
    const float *q;
    const char *pool;
    int bf16, kvh, ps, d, g, carry;
    int64_t chunk;                          /* pages a chunk */
    int64_t slot_bytes, head_bytes, v_bytes;
    const int64_t *rp, *sl, *ip;            /* ip [rows + 1]: row r's items ip[r]..ip[r + 1] */
    const int32_t *ll;
    float scale;
    float *out, *lse, *state;               /* state: g x (d + 2) floats an item */
    int64_t i0, i1;
} rows_job;

static inline int64_t row_chunks(int64_t pages, int64_t chunk) {
    return pages <= chunk ? 1 : (pages + chunk - 1) / chunk;
}

/* item i (of row r): its first page in the row, and its page count */
static inline int64_t item_pages(const rows_job *j, int64_t r, int64_t i, int64_t *p0) {
    const int64_t pages = j->rp[r + 1] - j->rp[r];
    *p0 = (i - j->ip[r]) * j->chunk;
    return pages - *p0 < j->chunk ? pages - *p0 : j->chunk;
}

static void run_item(const rows_job *j, int64_t r, int64_t i) {
    const int g = j->g, d = j->d;
    const int64_t pages = j->rp[r + 1] - j->rp[r];
    const float *q = j->q + r * g * d;
    float *out = j->out + r * g * d, *lse = j->lse + r * g;
    const int64_t head_bytes = (r % j->kvh) * j->head_bytes;
    if (j->ip[r + 1] - j->ip[r] == 1) {     /* the whole row */
        float m[MAX_G], l[MAX_G];
        start_row(m, l, out, out, lse, g, d, j->carry);
        j->fn(q, j->pool, j->bf16, j->slot_bytes, head_bytes, j->v_bytes, j->sl + j->rp[r],
              pages, j->ll[r], j->ps, d, g, j->scale, m, l, out);
        finish_row(m, l, out, lse, g, d);
        return;
    }
    int64_t p0;
    const int64_t n = item_pages(j, r, i, &p0);
    float *m = j->state + i * g * (d + 2), *l = m + g, *acc = l + g;
    start_row(m, l, acc, out, lse, g, d, j->carry && p0 == 0);
    j->fn(q, j->pool, j->bf16, j->slot_bytes, head_bytes, j->v_bytes, j->sl + j->rp[r] + p0, n,
          p0 + n == pages ? j->ll[r] : j->ps, j->ps, d, g, j->scale, m, l, acc);
}

static void run_items(void *arg) {
    const rows_job *j = (const rows_job *)arg;
    int64_t r = 0;
    for (int64_t i = j->i0; i < j->i1; i++) {
        while (j->ip[r + 1] <= i)
            r++;
        run_item(j, r, i);
    }
}

/* the chunks of each row of more than one, merged in order into out/lse */
static void merge_rows(const rows_job *j, Py_ssize_t rows) {
    const int g = j->g, d = j->d, stride = g * (d + 2);
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (j->ip[r + 1] - j->ip[r] == 1)
            continue;
        float *m = j->state + j->ip[r] * stride, *l = m + g, *acc = l + g;
        for (int64_t i = j->ip[r] + 1; i < j->ip[r + 1]; i++) {
            const float *mb = j->state + i * stride;
            merge_state(m, l, acc, mb, mb + g, mb + 2 * g, g, d);
        }
        memcpy(j->out + r * g * d, acc, sizeof(float) * (size_t)g * d);
        finish_row(m, l, j->out + r * g * d, j->lse + r * g, g, d);
    }
}

#define MAX_THREADS 64
#define MIN_PAGES_PER_THREAD 64     /* below this, handing items to a pool thread costs more than it saves */

/* The items split into `threads` contiguous runs of about equal pages, the first run on the
 * calling thread and the others on the threads of a pool kept between calls (kernels/_pool.h:
 * a thread started per call cost more than one layer's attention at 1 x 1K tokens). */
static void run_parallel(rows_job *base, Py_ssize_t rows, int threads) {
    const int64_t items = base->ip[rows], total = base->rp[rows] - base->rp[0];
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    if (threads > total / MIN_PAGES_PER_THREAD)
        threads = (int)(total / MIN_PAGES_PER_THREAD);
    if (threads > items)
        threads = (int)items;
    if (threads < 2) {
        base->i0 = 0;
        base->i1 = items;
        run_items(base);
        merge_rows(base, rows);
        return;
    }
    rows_job jobs[MAX_THREADS];
    void *args[MAX_THREADS];
    int64_t i = 0, r = 0, done = 0;         /* pages of the items before i */
    for (int t = 0; t < threads; t++) {
        jobs[t] = *base;
        jobs[t].i0 = i;
        const int64_t goal = total * (t + 1) / threads;
        while (i < items) {
            while (base->ip[r + 1] <= i)
                r++;
            int64_t p0;
            const int64_t n = item_pages(base, r, i, &p0);
            if (t < threads - 1 && 2 * done + n > 2 * goal && i > jobs[t].i0)
                break;                      /* the item's middle is past this run's share */
            done += n;
            i++;
        }
        jobs[t].i1 = i;
        args[t] = &jobs[t];
    }
    pool_run(run_items, args, threads);
    merge_rows(base, rows);
}

/* per-thread scratch for a call's item table and chunk states, grown as needed, kept */
static __thread void *scratch;
static __thread size_t scratch_bytes;

static void *scratch_for(size_t bytes) {
    if (bytes > scratch_bytes) {
        void *p = realloc(scratch, bytes);
        if (p == NULL)
            return NULL;
        scratch = p;
        scratch_bytes = bytes;
    }
    return scratch;
}

/* Row r's entries where first is set, and the others: two tables over the same rows, in
 * order; the row's last page length goes with the half holding its last entry, the other
 * half ends with a full page (PageTable.split's rule) */
static void split_table(const int64_t *rp, const int64_t *sl, const int32_t *ll,
                        const uint8_t *first, Py_ssize_t rows, int ps, int64_t *hrp,
                        int64_t *hsl, int32_t *hll, int64_t *trp, int64_t *tsl, int32_t *tll) {
    int64_t h = 0, t = 0;
    hrp[0] = trp[0] = 0;
    for (Py_ssize_t r = 0; r < rows; r++) {
        for (int64_t i = rp[r]; i < rp[r + 1]; i++) {
            if (first[i])
                hsl[h++] = sl[i];
            else
                tsl[t++] = sl[i];
        }
        hrp[r + 1] = h;
        trp[r + 1] = t;
        const int last_first = rp[r + 1] > rp[r] && first[rp[r + 1] - 1];
        hll[r] = last_first ? ll[r] : ps;
        tll[r] = last_first ? ps : ll[r];
    }
}

/* job's rows over the table (rp, sl, ll), going on from out/lse with `carry` */
static void run_table(rows_job *job, Py_ssize_t rows, int threads, const int64_t *rp,
                      const int64_t *sl, const int32_t *ll, int carry, int64_t *ip) {
    ip[0] = 0;
    for (Py_ssize_t r = 0; r < rows; r++)
        ip[r + 1] = ip[r] + row_chunks(rp[r + 1] - rp[r], job->chunk);
    job->rp = rp;
    job->sl = sl;
    job->ll = ll;
    job->ip = ip;
    job->carry = carry;
    run_parallel(job, rows, threads);
}

/* the row function for the CPU, the head size and `simd` */
static row_fn pick_row_fn(int d, int simd) {
#ifdef HAVE_AVX512_PATH
    if (simd >= 2 && d % 16 == 0 && __builtin_cpu_supports("avx512f"))
        return d == 64 ? attend_row_d64 : attend_row_avx512;
    if (simd >= 1 && d % 8 == 0 && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("fma"))
        return d == 64 ? attend_row_d64_avx2 : attend_row_avx2;
#else
    (void)d;
    (void)simd;
#endif
    return attend_row;
}

/* the shapes the rows serve: 0, or -1 with what is wrong in msg (cap bytes); without the GIL */
static int shape_fault(int d, int g, int ps, int kvh, char *msg, size_t cap) {
    if (d < 1 || d > MAX_D || g < 1 || g > MAX_G || ps < 1 || ps > MAX_PS || kvh < 1) {
        snprintf(msg, cap, "unsupported shape: head_dim %d (<= %d), group %d (<= %d), "
                 "page_size %d (<= %d)", d, MAX_D, g, MAX_G, ps, MAX_PS);
        return -1;
    }
    return 0;
}

/* shape_fault with the GIL: -1 with a ValueError set */
static int check_shape(int d, int g, int ps, int kvh) {
    char msg[SELECTED_ERROR_BYTES];
    if (shape_fault(d, g, ps, kvh, msg, sizeof msg) == 0)
        return 0;
    PyErr_SetString(PyExc_ValueError, msg);
    return -1;
}

/* the table must stay inside the pool: the rows read what it lists. 0, or -1 with what is
 * wrong in msg (cap bytes); without the GIL */
static int table_fault(const int64_t *rp, const int64_t *sl, const int32_t *ll,
                       Py_ssize_t rows, int ps, Py_ssize_t n_slots, char *msg, size_t cap) {
    if (rows < 0) {
        snprintf(msg, cap, "%zd rows", rows);
        return -1;
    }
    for (Py_ssize_t r = 0; r < rows; r++)
        if (rp[r + 1] < rp[r]) {
            snprintf(msg, cap, "page table rows out of order (row_ptr falls)");
            return -1;
        } else if (ll[r] > ps || (rp[r + 1] > rp[r] && ll[r] < 0)) {
            snprintf(msg, cap, "page table outside the pool (last page length %d of %d)",
                     ll[r], ps);
            return -1;
        }
    for (int64_t i = rp[0]; i < rp[rows]; i++)
        if (sl[i] < 0 || sl[i] >= n_slots) {
            snprintf(msg, cap, "page table outside the pool (slot %lld in a pool of %zd)",
                     (long long)sl[i], n_slots);
            return -1;
        }
    return 0;
}

/* table_fault with the GIL: -1 with a ValueError set */
static int check_table(const int64_t *rp, const int64_t *sl, const int32_t *ll,
                       Py_ssize_t rows, int ps, Py_ssize_t n_slots) {
    char msg[SELECTED_ERROR_BYTES];
    if (table_fault(rp, sl, ll, rows, ps, n_slots, msg, sizeof msg) == 0)
        return 0;
    PyErr_SetString(PyExc_ValueError, msg);
    return -1;
}

/* the rows of a checked table (with `first`: its entries where set, then the others, going
 * on from them); without the GIL (the caller releases it). 0, or -1 where scratch could not
 * be allocated. kernels/_layer.c calls it through the `api` capsule. */
static int decode_table(const float *q, const char *pool, int bf16, int kvh, int ps, int d,
                        int g, const int64_t *rp, const int64_t *sl, const int32_t *ll,
                        const uint8_t *first, Py_ssize_t rows, float scale, float *out,
                        float *lse, int carry, int simd, int threads) {
    const int64_t elem = bf16 ? 2 : 4;
    const int64_t head_bytes = (int64_t)ps * d * elem;
    const int64_t v_bytes = kvh * head_bytes;
    const int64_t slot_bytes = 2 * v_bytes;
    const int64_t chunk = CHUNK_TOKENS / ps > 0 ? CHUNK_TOKENS / ps : 1;
    const int64_t nnz = rp[rows] - rp[0];
    /* scratch: with `first` the two halves' tables, then the items' rows and states (at most
     * one item a row and one a chunk of pages, whichever half) */
    const size_t split_words = first ? 2 * (size_t)(rows + 1) + 2 * (size_t)nnz + rows : 0;
    const size_t max_items = (size_t)rows + (size_t)(nnz / chunk) + 1;
    int64_t *buf = scratch_for(sizeof(int64_t) * (split_words + rows + 1) +
                               sizeof(float) * max_items * g * (d + 2));
    if (buf == NULL)
        return -1;
    int64_t *ip = buf + split_words;
    rows_job job = {pick_row_fn(d, simd), q, pool, bf16, kvh, ps, d, g, carry, chunk,
                    slot_bytes, head_bytes, v_bytes, rp, sl, ip, ll, scale, out, lse,
                    (float *)(ip + rows + 1), 0, 0};
    if (first == NULL) {
        run_table(&job, rows, threads, rp, sl, ll, carry, ip);
    } else {        /* the first half, then the rest going on from it */
        int64_t *hrp = buf, *trp = hrp + rows + 1, *hsl = trp + rows + 1, *tsl = hsl + nnz;
        int32_t *hll = (int32_t *)(tsl + nnz), *tll = hll + rows;
        split_table(rp, sl, ll, first, rows, ps, hrp, hsl, hll, trp, tsl, tll);
        run_table(&job, rows, threads, hrp, hsl, hll, carry, ip);
        run_table(&job, rows, threads, trp, tsl, tll, 1, ip);
    }
    return 0;
}

static PyObject *sparse_decode(PyObject *self, PyObject *args) {
    unsigned long long q, pool, row_ptr, slots, last, out, lse, first_ptr = 0;
    int bf16, kvh, ps, d, g, carry, simd = 2, threads = 1;
    Py_ssize_t rows, n_slots;
    float scale;
    if (!PyArg_ParseTuple(args, "KKiiiiiKKKnfKKpn|iiK", &q, &pool, &bf16, &kvh, &ps, &d, &g,
                          &row_ptr, &slots, &last, &rows, &scale, &out, &lse, &carry, &n_slots,
                          &simd, &threads, &first_ptr))
        return NULL;
    const int64_t *rp = (const int64_t *)(uintptr_t)row_ptr;
    const int64_t *sl = (const int64_t *)(uintptr_t)slots;
    const int32_t *ll = (const int32_t *)(uintptr_t)last;
    if (check_shape(d, g, ps, kvh) < 0 || check_table(rp, sl, ll, rows, ps, n_slots) < 0)
        return NULL;
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = decode_table((const float *)(uintptr_t)q, (const char *)(uintptr_t)pool, bf16,
                          kvh, ps, d, g, rp, sl, ll, (const uint8_t *)(uintptr_t)first_ptr,
                          rows, scale, (float *)(uintptr_t)out, (float *)(uintptr_t)lse, carry,
                          simd, threads);
    Py_END_ALLOW_THREADS
    if (failed)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

#include "_decode_selected.h"

static PyMethodDef methods[] = {
    POOL_OPENMP_METHOD,
    {"sparse_decode", sparse_decode, METH_VARARGS,
     "sparse_decode(q, pool, bf16, kvh, page_size, head_dim, group, row_ptr, slots, last_len, "
     "rows, scale, out, lse, carry, n_slots[, simd, threads]): addresses of contiguous buffers "
     "(q/out float32 [rows, group, D], row_ptr/slots int64, last_len int32, lse float32 [rows, "
     "group]; with carry, out/lse hold a first half's result to go on from); ValueError unless "
     "every slot is below n_slots and every last_len at most page_size; simd: "
     "2 the AVX-512 rows where the CPU has them, else AVX2; 1 AVX2 at most; 0 the portable "
     "rows; threads: rows shared by this many threads (long rows in chunks of pages); first: "
     "the address of a bool [entries] (0: none): each row attends to its entries where it "
     "is set, then goes on over the others as a carry would (two calls' bits in one); "
     "without the GIL"},
    {"sparse_decode_selected", sparse_decode_selected, METH_VARARGS,
     SPARSE_DECODE_SELECTED_DOC},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_decode", NULL, -1, methods};

/* the pool, for kernels/_select.c (its calls run on these threads, not on a pool of its own
 * spinning beside this one); a checked table's attention, for kernels/_layer.c */
static pool_api pool_capsule = {pool_run};
static decode_api api = {check_table, decode_table, decode_selected};

PyMODINIT_FUNC PyInit__decode(void) {
    pool_init();
    PyObject *m = PyModule_Create(&module);
    if (m && (add_api(m, "pool_api", "kernels._decode.pool_api", &pool_capsule) < 0 ||
              add_api(m, "api", "kernels._decode.api", &api) < 0))
        Py_CLEAR(m);
    return m;
}
