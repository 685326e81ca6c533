/* Page selection for sparse decode in C, without the GIL (kernels/page_select.py,
 * `native_select`): the selector's scores and select_pages' top-k in one call per layer.
 *
 * The torch path costs ~0.75 ms a layer for 8 sequences x 438 pages here (8 bmm calls over
 * upcast summaries, then ~25 small ops for the top-k) and takes the GIL between its ops, which
 * the pipeline's stage threads compete for; this call 0.58-0.59 ms with the AVX-512 scoring
 * (16 pages' sums per query head out of one transpose-and-add, kernels/_rows.h, and the next
 * block's rows prefetched: 0.63-0.66 without), 0.72-0.73 with the portable one
 * (bench/results/sparse_ops.txt): reading the summaries bounds it. Where the CPU has AVX2
 * but not AVX-512, the AVX2 blocked scoring (8 pages' sums out of one transpose-and-add).
 *
 * Scores, per (sequence b, KV head h, page p): the max over the GQA group's query heads of
 *   quest: sum_d (q_d < 0 ? q_d * min_d : q_d * max_d)   (Quest's upper bound of q . k)
 *   mean:  q . mean_d
 * from summaries [rows, KVH, 3, D] (rows min, max, mean), bf16 or float32, float32 sums.
 *
 * Selection per row (b, h), as select_pages: the first `sink` and last `local` pages are kept
 * (forced), then up to `prior_pages` non-forced pages with the highest finite prior
 * ([rows, KVH] float32, -inf: none), then the best-scoring others, min(n_b, k) pages in all,
 * listed ascending. NaN and -inf scores rank below every finite one. Ties at the cut go to
 * the lower page number. The union of a sequence's heads' pages is listed too.
 *
 * `threads` > 1: the sequences are shared by that many threads of kernels/_decode.c's pool
 * (8 x 438 pages, budget 64: 330 -> 175 us a layer on two threads, 2-core AMD EPYC), and
 * with fewer sequences than threads their pages' scoring is (`score_first`); each
 * sequence's rows go to fixed places, then one pass moves them to CSR order, so the output
 * does not depend on the thread count.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_api.h"
#include "_select_score.h"
#include "_select_top.h"

/* what one select_pages call shares with its tasks */
typedef struct {
    const float *q;
    const uint64_t *sa, *pa;
    const int64_t *np_, *hb;
    int bf16, quest, kvh, g, d, simd;
    int64_t sink, local, kk, pk, p_max, page_bytes, head_bytes, row_bytes;
    /* outputs at fixed places: row r's pages at ix + r * kk (and its union positions, local
     * to its sequence, at upos + r * kk), their count in cnt[r]; sequence b's union at
     * ux + b * p_max, its count in ucnt[b] */
    int64_t *ix, *cnt, *ux, *ucnt, *upos;
    float *so;
    /* [B][KVH][p_max + 1] the scores, when tasks of page ranges made them before the
     * selection (few sequences, more threads); NULL: each sequence's task scores it */
    float *scored;
} sel_call;

/* one task: sequences b0 .. b1 - 1; a scoring task: pages p0 .. p1 - 1 of sequence b0 */
typedef struct {
    const sel_call *c;
    int b0, b1, failed;
    int64_t p0, p1;
} sel_task;

/* scores of pages p0 .. p1 - 1 of sequence b into out [KVH][stride] (from its page 0) */
static void score_range(const sel_call *c, int b, int64_t p0, int64_t p1, float *out,
                        int64_t stride, float *qq) {
    score_seq(c->q + (int64_t)b * c->kvh * c->g * c->d, c->kvh, c->g, c->d,
              (const char *)(uintptr_t)c->sa[b] + p0 * c->page_bytes, c->page_bytes,
              c->head_bytes, c->row_bytes, c->bf16, c->quest, p1 - p0, out + p0, stride, qq,
              c->simd);
}

/* select one sequence's rows (see the file's comment) into the call's fixed places; sc:
 * scratch [KVH + 2][stride] and [KVH * g * 2D] floats, its first KVH rows the scores unless
 * the call has them (c->scored) */
static void select_seq(const sel_call *c, int b, float *sc, uint8_t *chosen, int64_t *umap,
                       int64_t stride) {
    const int kvh = c->kvh;
    const int64_t n = c->np_[b], sink = c->sink, local = c->local, p_max = c->p_max;
    float *scratch = sc + stride * kvh, *pv = scratch + stride, *qq = pv + stride;
    uint8_t *any = chosen + (size_t)stride * kvh, *elig = any + stride;
    memset(any, 0, (size_t)n);
    if (c->scored)
        sc = c->scored + (int64_t)b * kvh * stride;
    else
        score_range(c, b, 0, n, sc, stride, qq);
    for (int h = 0; h < kvh; h++) {
        const int64_t r = (int64_t)b * kvh + h;
        uint8_t *ch = chosen + (size_t)stride * h;
        int64_t kh = c->kk, ph = c->pk;
        if (c->hb) {               /* this head's own budget and prior share */
            kh = c->hb[h] > sink + local ? c->hb[h] : sink + local;
            if (kh > p_max) kh = p_max;
            ph = kh - (kh < sink + local ? kh : sink + local);
            if (ph > c->hb[kvh + h]) ph = c->hb[kvh + h];
        }
        float *key = sc + stride * h;
        memset(ch, 0, (size_t)n);
        if (c->so)
            memcpy(c->so + r * p_max, key, sizeof(float) * (size_t)n);
        /* forced: sink and local pages */
        int64_t m = 0;
        for (int64_t p = 0; p < n; p++)
            if (p < sink || p >= n - local) { ch[p] = 1; m++; }
        /* prior: the top ph finite priors among the others */
        if (c->pa && c->pa[b] && ph > 0) {
            const float *pr = (const float *)(uintptr_t)c->pa[b];
            for (int64_t p = 0; p < n; p++) {
                pv[p] = pr[p * kvh + h];
                elig[p] = !ch[p] && pv[p] > -INFINITY;
            }
            m += mark_top(pv, elig, n, ph, scratch, ch);
        }
        /* the best-scoring others, NaN and -inf last */
        int64_t want = (n < kh ? n : kh) - m;
        if (want > 0) {
            for (int64_t p = 0; p < n; p++) {
                float v = key[p];
                key[p] = isnan(v) || v == -INFINITY ? -FLT_MAX
                         : (v == INFINITY ? FLT_MAX : v);
                elig[p] = !ch[p];
            }
            mark_top(key, elig, n, want, scratch, ch);
        }
        int64_t *row = c->ix + r * c->kk, o = 0;
        for (int64_t p = 0; p < n; p++)
            if (ch[p]) { row[o++] = p; any[p] = 1; }
        c->cnt[r] = o;
    }
    int64_t *u = c->ux + (int64_t)b * p_max, o = 0;
    for (int64_t p = 0; p < n; p++)
        if (any[p]) { umap[p] = o; u[o++] = p; }
    c->ucnt[b] = o;
    if (c->upos)     /* each row entry's position among its sequence's union entries */
        for (int h = 0; h < kvh; h++) {
            const int64_t r = (int64_t)b * kvh + h;
            for (int64_t e = 0; e < c->cnt[r]; e++)
                c->upos[r * c->kk + e] = umap[c->ix[r * c->kk + e]];
        }
}

/* a scoring task (c->scored): its page range's scores */
static void run_score_task(void *arg) {
    sel_task *t = arg;
    const sel_call *c = t->c;
    float *qq = malloc(sizeof(float) * (size_t)((int64_t)c->kvh * c->g * 2 * c->d));
    if (!qq)
        t->failed = 1;
    else
        score_range(c, t->b0, t->p0, t->p1, c->scored + (int64_t)t->b0 * c->kvh *
                    (c->p_max + 1), c->p_max + 1, qq);
    free(qq);
}

static void run_task(void *arg) {
    sel_task *t = arg;
    const sel_call *c = t->c;
    const int64_t stride = c->p_max + 1;
    float *sc = malloc(sizeof(float) * (size_t)(stride * (c->kvh + 2)
                                                + (int64_t)c->kvh * c->g * 2 * c->d));
    uint8_t *chosen = malloc((size_t)stride * (size_t)(c->kvh + 2));
    int64_t *umap = malloc(sizeof(int64_t) * (size_t)stride);
    if (!sc || !chosen || !umap)
        t->failed = 1;
    else
        for (int b = t->b0; b < t->b1; b++)
            select_seq(c, b, sc, chosen, umap, stride);
    free(sc);
    free(chosen);
    free(umap);
}

/* kernels/_decode.c's pool (a capsule): select_pages' tasks run on the threads the decode
 * attention runs on, rather than on a pool of their own spinning beside it */
typedef void (*task_fn)(void *);
static const pool_api *shared_pool = NULL;

#define MAX_TASKS 64

/* rows at fixed places (row r at v + r * width, cnt[r] values) moved to CSR order in place
 * (a row never moves right, so in row order nothing is overwritten before it moves);
 * ptr[0..rows]: their offsets */
static void compact(int64_t *v, const int64_t *cnt, int64_t rows, int64_t width, int64_t *ptr) {
    ptr[0] = 0;
    for (int64_t r = 0; r < rows; r++) {
        memmove(v + ptr[r], v + r * width, sizeof(int64_t) * (size_t)cnt[r]);
        ptr[r + 1] = ptr[r] + cnt[r];
    }
}

/* Fewer sequences than threads (one stream's decode): the threads score page ranges of each
 * sequence into c->scored first, then the sequences' tasks select from it (a page's score
 * is its own summaries' and query's: the same bits in any range). Ranges are multiples of 16
 * pages, the AVX-512 scoring's blocks. Returns 1 if out of memory; does nothing (c->scored
 * NULL) for calls too small to share. B = 1, 438 pages, two threads: 34 -> 25 us. */
#define SPLIT_MIN_PAGES 96

static int score_first(sel_call *c, int b_size, int threads, int64_t total) {
    if (b_size < 1 || !shared_pool)
        return 0;
    int parts = threads / b_size;
    if (parts > MAX_TASKS / b_size) parts = MAX_TASKS / b_size;
    if (parts < 2 || total < SPLIT_MIN_PAGES)
        return 0;
    const int64_t stride = c->p_max + 1;
    c->scored = malloc(sizeof(float) * (size_t)((int64_t)b_size * c->kvh * stride));
    if (!c->scored)
        return 1;
    sel_task tasks[MAX_TASKS];
    void *targs[MAX_TASKS];
    int n = 0;
    for (int b = 0; b < b_size; b++) {
        const int64_t np = c->np_[b], per = ((np + parts - 1) / parts + 15) / 16 * 16;
        for (int64_t p0 = 0; p0 < np; p0 += per) {
            tasks[n] = (sel_task){c, b, b + 1, 0, p0, p0 + per < np ? p0 + per : np};
            targs[n] = &tasks[n];
            n++;
        }
    }
    if (n > 1)
        shared_pool->run(run_score_task, targs, n);
    else if (n == 1)
        run_score_task(targs[0]);
    int failed = 0;
    for (int i = 0; i < n; i++)
        failed |= tasks[i].failed;
    return failed;
}

/* every sequence's selection: tasks of contiguous sequences with about as many pages each on
 * the pool (after score_first's page ranges, where it takes them); returns 1 if out of
 * memory */
static int run_tasks(sel_call *c, int b_size, int threads) {
    int n_tasks = threads < b_size ? threads : b_size;
    if (n_tasks > MAX_TASKS) n_tasks = MAX_TASKS;
    if (n_tasks < 1 || !shared_pool) n_tasks = 1;
    sel_task tasks[MAX_TASKS];
    void *targs[MAX_TASKS];
    int64_t total = 0, seen = 0;
    for (int b = 0; b < b_size; b++)
        total += c->np_[b] + 1;
    for (int i = 0, b = 0; i < n_tasks; i++) {
        tasks[i] = (sel_task){c, b, b, 0};
        while (b < b_size && (i == n_tasks - 1 || seen * n_tasks < total * (i + 1)))
            seen += c->np_[b++] + 1;
        tasks[i].b1 = b;
        targs[i] = &tasks[i];
    }
    int failed = score_first(c, b_size, threads, total);
    if (!failed && n_tasks > 1)
        shared_pool->run(run_task, targs, n_tasks);
    else if (!failed)
        run_task(targs[0]);
    for (int i = 0; i < n_tasks; i++)
        failed |= tasks[i].failed;
    return failed;
}

/* select_pages without the GIL, for the Python call below and kernels/_layer.c (through the
 * `api` capsule): 0, -1 out of memory, or 1 a shape it does not serve (nothing written) */
static int select_run(const select_args *a, int64_t *nnz, int64_t *unnz) {
    const int b_size = a->batch, kvh = a->kvh, d = a->d;
    const int64_t sink = a->sink, local = a->local;
    if (d < 1 || d > MAX_D || a->g < 1 || a->g > MAX_G || kvh < 1 || b_size < 0 || a->k < 1)
        return 1;
    sel_call c = {.q = a->q, .sa = a->summ, .pa = a->priors, .np_ = a->n_pages,
                  /* optional [2, kvh]: each KV head's budget, then its prior pages (k: their
                   * largest) */
                  .hb = a->head_budgets, .bf16 = a->bf16, .quest = a->quest, .kvh = kvh,
                  .g = a->g, .d = d, .sink = sink, .local = local, .ix = a->indices,
                  .ux = a->uindices, .upos = a->upos,     /* [B*KVH*k] or none */
                  .so = a->scores};
    int64_t *ip = a->indptr, *up = a->uindptr;
    for (int b = 0; b < b_size; b++)
        if (c.np_[b] > c.p_max) c.p_max = c.np_[b];
    const int64_t elem = a->bf16 ? 2 : 4;
    c.row_bytes = (int64_t)d * elem;
    c.head_bytes = 3 * c.row_bytes;
    c.page_bytes = (int64_t)kvh * c.head_bytes;
    /* k and the prior's share as select_pages computes them */
    c.kk = a->k > sink + local ? a->k : sink + local;
    if (c.kk > c.p_max) c.kk = c.p_max;
    c.pk = c.kk - (c.kk < sink + local ? c.kk : sink + local);
    if (c.pk > a->prior_pages) c.pk = a->prior_pages;
    if (c.pk > c.p_max) c.pk = c.p_max;
    /* the blocked scoring of the CPU's widest vectors: 2 AVX-512, 1 AVX2 + FMA, 0 portable */
    const int f = a->quest ? 2 * d : d;
    int simd = 0;
#ifdef HAVE_AVX512_PATH
    if (a->simd && f % 16 == 0 && __builtin_cpu_supports("avx512f"))
        simd = 2;
#endif
#ifdef HAVE_AVX2_PATH
    if (a->simd && !simd && f % 8 == 0 && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("fma"))
        simd = 1;
#endif
    c.simd = simd;
    int failed = 0;
    int64_t *cnt = malloc(sizeof(int64_t) * (size_t)((int64_t)b_size * (kvh + 1) + 1));
    if (!cnt) {
        failed = 1;
    } else {
        c.cnt = cnt;
        c.ucnt = cnt + (int64_t)b_size * kvh;
        failed = run_tasks(&c, b_size, a->threads);
        if (!failed) {
            compact(c.ix, c.cnt, (int64_t)b_size * kvh, c.kk, ip);
            if (c.upos)     /* laid out as the rows: the same offsets */
                compact(c.upos, c.cnt, (int64_t)b_size * kvh, c.kk, ip);
            compact(c.ux, c.ucnt, b_size, c.p_max, up);
            if (c.upos)     /* positions local to a sequence's union: among all of them */
                for (int b = 0; b < b_size; b++)
                    for (int64_t e = ip[(int64_t)b * kvh]; e < ip[(int64_t)(b + 1) * kvh]; e++)
                        c.upos[e] += up[b];
        }
    }
    free(cnt);
    free(c.scored);
    if (failed)
        return -1;
    *nnz = ip[(int64_t)b_size * kvh];
    *unnz = up[b_size];
    return 0;
}

static PyObject *select_pages(PyObject *self, PyObject *args) {
    unsigned long long q, summ_addrs, prior_addrs, n_pages, indptr, indices, uindptr, uindices,
        scores_out, head_budgets = 0, union_pos = 0;
    int bf16, quest, b_size, kvh, g, d, simd = 1, threads = 1;
    long long k, sink, local, prior_pages;
    if (!PyArg_ParseTuple(args, "KKKiiiiiiKLLLLKKKKK|pKKi", &q, &summ_addrs, &prior_addrs,
                          &bf16, &quest, &b_size, &kvh, &g, &d, &n_pages, &k, &sink, &local,
                          &prior_pages, &indptr, &indices, &uindptr, &uindices, &scores_out,
                          &simd, &head_budgets, &union_pos, &threads))
        return NULL;
    select_args a = {(const float *)(uintptr_t)q, (const uint64_t *)(uintptr_t)summ_addrs,
                     (const uint64_t *)(uintptr_t)prior_addrs,
                     (const int64_t *)(uintptr_t)n_pages, (const int64_t *)(uintptr_t)head_budgets,
                     bf16, quest, b_size, kvh, g, d, simd, threads, k, sink, local, prior_pages,
                     (int64_t *)(uintptr_t)indptr, (int64_t *)(uintptr_t)indices,
                     (int64_t *)(uintptr_t)uindptr, (int64_t *)(uintptr_t)uindices,
                     (int64_t *)(uintptr_t)union_pos, (float *)(uintptr_t)scores_out};
    int64_t nnz = 0, unnz = 0;
    int res;
    Py_BEGIN_ALLOW_THREADS
    res = select_run(&a, &nnz, &unnz);
    Py_END_ALLOW_THREADS
    if (res > 0)        /* select_run's refusal, nothing written */
        return PyErr_Format(PyExc_ValueError, "unsupported shape: head_dim %d (<= %d), group "
                            "%d (<= %d), kv heads %d, %d sequences, budget %lld", d, MAX_D, g,
                            MAX_G, kvh, b_size, k);
    if (res < 0)
        return PyErr_NoMemory();
    return Py_BuildValue("LL", (long long)nnz, (long long)unnz);
}

static PyMethodDef methods[] = {
    {"select_pages", select_pages, METH_VARARGS,
     "select_pages(q, summary_addrs, prior_addrs, bf16, quest, batch, kvh, group, head_dim, "
     "n_pages, budget, sink, local, prior_pages, indptr, indices, union_indptr, union_indices, "
     "scores_out): addresses of contiguous buffers (q float32 [B, KVH, group, D]; summary_addrs "
     "uint64 [B] of [>= n_b, KVH, 3, D] summaries; prior_addrs uint64 [B] of [>= n_b, KVH] "
     "float32 priors, 0 for none, or 0 for no array; n_pages int64 [B]; outputs int64 "
     "[B*KVH+1], [B*KVH*k], [B+1], [B*P_max]; scores_out float32 [B*KVH, P_max] or 0; simd: "
     "the AVX-512 or AVX2 blocked scoring where the CPU has it; head_budgets: 0 or int64 "
     "[2, KVH], each KV head's budget then its prior pages, budget their largest); "
     "union_pos: 0 or int64 [B*KVH*k], each listed page's position in union_indices; "
     "threads: sequences shared by this many threads (kernels/_decode.c's pool); without the "
     "GIL. Returns (entries, union entries)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_select", NULL, -1, methods};

/* the selection without the GIL, for kernels/_layer.c */
static select_api api = {select_run};

PyMODINIT_FUNC PyInit__select(void) {
    /* without kernels._decode (not built), every call runs on its caller's thread */
    shared_pool = import_api("kernels._decode", "kernels._decode.pool_api");
    if (!shared_pool)
        PyErr_Clear();
    PyObject *m = PyModule_Create(&module);
    if (m && add_api(m, "api", "kernels._select.api", &api) < 0)
        Py_CLEAR(m);
    return m;
}
