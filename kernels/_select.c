/* Page selection for sparse decode in C, without the GIL (kernels/page_select.py,
 * `native_select`): the selector's scores and select_pages' top-k in one call per layer.
 *
 * The torch path costs ~0.75 ms a layer for 8 sequences x 438 pages here (8 bmm calls over
 * upcast summaries, then ~25 small ops for the top-k) and takes the GIL between its ops, which
 * the pipeline's stage threads compete for; this call 0.58-0.59 ms with the AVX-512 scoring
 * (16 pages' sums per query head out of one transpose-and-add, kernels/_rows.h, and the next
 * block's rows prefetched: 0.63-0.66 without), 0.72-0.73 with the portable one
 * (bench/results/sparse_ops.txt): reading the summaries bounds it.
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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_rows.h"

#define MAX_D 256
#define MAX_G 16

typedef float v8 __attribute__((vector_size(32)));

/* 8 floats from any address (a macro: no vector type crosses a function boundary, whose ABI
 * would differ between the clones) */
#define load8(p) ({ v8 v_; memcpy(&v_, (p), sizeof v_); v_; })

static inline float keep_max(float best, float v) { return v > best || isnan(v) ? v : best; }

/* the max of a0 . b .. a3 . b (NaN wins) and `best`; d a multiple of 8. Two 8-lane partial
 * sums per product (independent chains hide the FMA latency), added up once at the end. */
static inline float dot4(const float *a0, const float *a1, const float *a2, const float *a3,
                         const float *b, int d, float best) {
    v8 c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0}, e0 = {0}, e1 = {0}, e2 = {0}, e3 = {0};
    int i = 0;
    for (; i + 16 <= d; i += 16) {
        v8 x = load8(b + i), y = load8(b + i + 8);
        c0 += load8(a0 + i) * x; e0 += load8(a0 + i + 8) * y;
        c1 += load8(a1 + i) * x; e1 += load8(a1 + i + 8) * y;
        c2 += load8(a2 + i) * x; e2 += load8(a2 + i + 8) * y;
        c3 += load8(a3 + i) * x; e3 += load8(a3 + i + 8) * y;
    }
    for (; i + 8 <= d; i += 8) {
        v8 x = load8(b + i);
        c0 += load8(a0 + i) * x; c1 += load8(a1 + i) * x;
        c2 += load8(a2 + i) * x; c3 += load8(a3 + i) * x;
    }
    c0 += e0; c1 += e1; c2 += e2; c3 += e3;
    float s[4] = {0};
    for (int k = 0; k < 8; k++) {
        s[0] += c0[k]; s[1] += c1[k]; s[2] += c2[k]; s[3] += c3[k];
    }
    for (; i < d; i++) {
        s[0] += a0[i] * b[i]; s[1] += a1[i] * b[i];
        s[2] += a2[i] * b[i]; s[3] += a3[i] * b[i];
    }
    return keep_max(keep_max(keep_max(keep_max(best, s[0]), s[1]), s[2]), s[3]);
}

#ifdef HAVE_AVX512_PATH
/* score_seq with AVX-512, f (quest: 2D, mean: D) a multiple of 16: pages in blocks of 16, each
 * query head's 16 sums out of one transpose-and-add of per-page partial sums (no horizontal
 * sum per page); the max over the group as score_seq takes it (NaN wins). qq as score_seq's,
 * already filled. */
static AVX512 void score_seq16(const float *qq, int kvh, int g, int f, const char *summ,
                               int64_t page_bytes, int64_t head_bytes, int64_t off, int bf16,
                               int64_t n, float *out, int64_t stride) {
    float part[MAX_G * 256] __attribute__((aligned(64)));
    const int nv = f / 16, es = bf16 ? 2 : 4;
    const __m512 nan = _mm512_set1_ps(NAN);
    for (int64_t p0 = 0; p0 < n; p0 += 16) {
        const int nb = n - p0 < 16 ? (int)(n - p0) : 16;
        for (int h = 0; h < kvh; h++) {
            const float *qh = qq + (int64_t)h * g * f;
            for (int t = 0; t < 16; t++) {
                if (t >= nb) {
                    for (int j = 0; j < g; j++)
                        _mm512_store_ps(part + j * 256 + t * 16, _mm512_setzero_ps());
                    continue;
                }
                const char *row = summ + (p0 + t) * page_bytes + h * head_bytes + off;
                if (p0 + t + 16 < n)        /* the next block's row: 4 KiB pages stop the */
                    for (int o = 0; o < f * es; o += 64)      /* hardware's prefetcher */
                        _mm_prefetch(row + 16 * page_bytes + o, _MM_HINT_T0);
                __m512 r[2 * MAX_D / 16];
                for (int c = 0; c < nv; c++)
                    r[c] = load16(row + c * 16 * es, bf16);
                for (int j = 0; j < g; j++) {
                    __m512 acc = _mm512_setzero_ps();
                    for (int c = 0; c < nv; c++)
                        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + j * f + 16 * c), r[c], acc);
                    _mm512_store_ps(part + j * 256 + t * 16, acc);
                }
            }
            __m512 best = _mm512_set1_ps(-INFINITY);
            for (int j = 0; j < g; j++) {
                const __m512 v = hsum16x16(part + j * 256);
                const __mmask16 bad = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) |
                                      _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
                best = _mm512_mask_mov_ps(_mm512_max_ps(best, v), bad, nan);
            }
            _mm512_mask_storeu_ps(out + h * stride + p0, (__mmask16)((1u << nb) - 1), best);
        }
    }
}
#endif

/* scores [KVH][n] (row stride `stride`) of one sequence: q [KVH, g, D] float32; the summary
 * rows of page p, head h start at summ + p * page_bytes + h * head_bytes (min, max, mean, each
 * `row_bytes`). Pages outer: one pass over the summaries. Quest's bound is one dot product of
 * [min(q, 0), max(q, 0)] with the adjacent [min, max] rows. qq: scratch [KVH * g * 2D]. */
__attribute__((target_clones("avx512f", "avx2", "default")))
static void score_seq(const float *q, int kvh, int g, int d, const char *summ,
                      int64_t page_bytes, int64_t head_bytes, int64_t row_bytes, int bf16,
                      int quest, int64_t n, float *out, int64_t stride, float *qq, int simd) {
    float row[2 * MAX_D];
    const int f = quest ? 2 * d : d;
    for (int j = 0; j < kvh * g; j++)
        for (int i = 0; i < d; i++) {
            float v = q[j * d + i];
            if (quest) {
                qq[j * f + i] = v < 0.f ? v : 0.f;
                qq[j * f + d + i] = v < 0.f ? 0.f : v;
            } else {
                qq[j * f + i] = v;
            }
        }
    const int64_t off = quest ? 0 : 2 * row_bytes;
#ifdef HAVE_AVX512_PATH
    if (simd) {
        score_seq16(qq, kvh, g, f, summ, page_bytes, head_bytes, off, bf16, n, out, stride);
        return;
    }
#else
    (void)simd;
#endif
    for (int64_t p = 0; p < n; p++)
        for (int h = 0; h < kvh; h++) {
            load_row(summ + p * page_bytes + h * head_bytes + off, bf16, row, f);
            const float *qh = qq + (int64_t)h * g * f;
            float best = -INFINITY;
            /* four independent sums hide the FMA latency (a group of 3 repeats its last head) */
            for (int j = 0; j < g; j += 4) {
                const int last = g - 1;
                best = dot4(qh + j * f, qh + (j + 1 < g ? j + 1 : last) * f,
                            qh + (j + 2 < g ? j + 2 : last) * f,
                            qh + (j + 3 < g ? j + 3 : last) * f, row, f, best);
            }
            out[h * stride + p] = best;
        }
}

/* the value of rank `k` (0-based, descending) among v[0..n-1]: quickselect on a copy */
static float kth_largest(float *w, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        float pivot = w[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (w[i] > pivot) i++;
            while (w[j] < pivot) j--;
            if (i <= j) {
                float t = w[i]; w[i] = w[j]; w[j] = t;
                i++; j--;
            }
        }
        if (k <= j) hi = j;
        else if (k >= i) lo = i;
        else return w[k];
    }
    return w[k];
}

/* mark (chosen[p] = 1) the `k` entries of key[0..n-1] with the largest values among those
 * with eligible[p], ties to the lower p; returns how many */
static int64_t mark_top(const float *key, const uint8_t *eligible, int64_t n, int64_t k,
                        float *scratch, uint8_t *chosen) {
    int64_t m = 0;
    for (int64_t p = 0; p < n; p++)
        if (eligible[p]) scratch[m++] = key[p];
    if (k <= 0 || m == 0)
        return 0;
    if (k >= m) {
        for (int64_t p = 0; p < n; p++)
            if (eligible[p]) chosen[p] = 1;
        return m;
    }
    float t = kth_largest(scratch, m, k - 1);
    int64_t c = 0;
    for (int64_t p = 0; p < n; p++)
        if (eligible[p] && key[p] > t) { chosen[p] = 1; c++; }
    for (int64_t p = 0; p < n && c < k; p++)
        if (eligible[p] && key[p] == t && !chosen[p]) { chosen[p] = 1; c++; }
    return c;
}

static PyObject *select_pages(PyObject *self, PyObject *args) {
    unsigned long long q, summ_addrs, prior_addrs, n_pages, indptr, indices, uindptr, uindices,
        scores_out, head_budgets = 0, union_pos = 0;
    int bf16, quest, b_size, kvh, g, d, simd = 1;
    long long k, sink, local, prior_pages;
    if (!PyArg_ParseTuple(args, "KKKiiiiiiKLLLLKKKKK|pKK", &q, &summ_addrs, &prior_addrs,
                          &bf16, &quest, &b_size, &kvh, &g, &d, &n_pages, &k, &sink, &local,
                          &prior_pages, &indptr, &indices, &uindptr, &uindices, &scores_out,
                          &simd, &head_budgets, &union_pos))
        return NULL;
    if (d < 1 || d > MAX_D || g < 1 || g > MAX_G || kvh < 1 || b_size < 0 || k < 1) {
        PyErr_Format(PyExc_ValueError, "unsupported shape: head_dim %d (<= %d), group %d "
                     "(<= %d), kv heads %d, budget %lld", d, MAX_D, g, MAX_G, kvh, k);
        return NULL;
    }
    const int64_t *np_ = (const int64_t *)(uintptr_t)n_pages;
    /* optional [2, kvh]: each KV head's budget, then its prior pages (k: their largest) */
    const int64_t *hb = (const int64_t *)(uintptr_t)head_budgets;
    const uint64_t *sa = (const uint64_t *)(uintptr_t)summ_addrs;
    const uint64_t *pa = (const uint64_t *)(uintptr_t)prior_addrs;
    int64_t *ip = (int64_t *)(uintptr_t)indptr, *ix = (int64_t *)(uintptr_t)indices;
    int64_t *up = (int64_t *)(uintptr_t)uindptr, *ux = (int64_t *)(uintptr_t)uindices;
    float *so = (float *)(uintptr_t)scores_out;
    int64_t *upos = (int64_t *)(uintptr_t)union_pos;     /* [B*KVH*k] or none */
    int64_t p_max = 0;
    for (int b = 0; b < b_size; b++)
        if (np_[b] > p_max) p_max = np_[b];
    const int64_t elem = bf16 ? 2 : 4, row_bytes = (int64_t)d * elem;
    const int64_t head_bytes = 3 * row_bytes, page_bytes = (int64_t)kvh * head_bytes;
    /* k and the prior's share as select_pages computes them */
    int64_t kk = k > sink + local ? k : sink + local;
    if (kk > p_max) kk = p_max;
    int64_t pk = kk - (kk < sink + local ? kk : sink + local);
    if (pk > prior_pages) pk = prior_pages;
    if (pk > p_max) pk = p_max;
    int failed = 0;
#ifdef HAVE_AVX512_PATH
    simd = simd && ((quest ? 2 * d : d) % 16 == 0) && __builtin_cpu_supports("avx512f");
#endif
    Py_BEGIN_ALLOW_THREADS
    const int64_t stride = p_max + 1;
    float *sc = malloc(sizeof(float) * (size_t)(stride * (kvh + 2) + (int64_t)kvh * g * 2 * d));
    uint8_t *chosen = malloc((size_t)stride * (size_t)(kvh + 2));
    int64_t *umap = upos ? malloc(sizeof(int64_t) * (size_t)stride) : NULL;
    if (!sc || !chosen || (upos && !umap)) {
        failed = 1;
    } else {
        float *scratch = sc + stride * kvh, *pv = scratch + stride, *qq = pv + stride;
        uint8_t *any = chosen + (size_t)stride * kvh, *elig = any + stride;
        ip[0] = 0;
        up[0] = 0;
        for (int b = 0; b < b_size; b++) {
            const int64_t n = np_[b];
            memset(any, 0, (size_t)n);
            score_seq((const float *)(uintptr_t)q + (int64_t)b * kvh * g * d, kvh, g, d,
                      (const char *)(uintptr_t)sa[b], page_bytes, head_bytes, row_bytes, bf16,
                      quest, n, sc, stride, qq, simd);
            for (int h = 0; h < kvh; h++) {
                const int64_t r = (int64_t)b * kvh + h;
                uint8_t *ch = chosen + (size_t)stride * h;
                int64_t kh = kk, ph = pk;
                if (hb) {               /* this head's own budget and prior share */
                    kh = hb[h] > sink + local ? hb[h] : sink + local;
                    if (kh > p_max) kh = p_max;
                    ph = kh - (kh < sink + local ? kh : sink + local);
                    if (ph > hb[kvh + h]) ph = hb[kvh + h];
                }
                float *key = sc + stride * h;
                memset(ch, 0, (size_t)n);
                if (so)
                    memcpy(so + r * p_max, key, sizeof(float) * (size_t)n);
                /* forced: sink and local pages */
                int64_t c = 0;
                for (int64_t p = 0; p < n; p++)
                    if (p < sink || p >= n - local) { ch[p] = 1; c++; }
                /* prior: the top pk finite priors among the others */
                if (pa && pa[b] && ph > 0) {
                    const float *pr = (const float *)(uintptr_t)pa[b];
                    for (int64_t p = 0; p < n; p++) {
                        pv[p] = pr[p * kvh + h];
                        elig[p] = !ch[p] && pv[p] > -INFINITY;
                    }
                    c += mark_top(pv, elig, n, ph, scratch, ch);
                }
                /* the best-scoring others, NaN and -inf last */
                int64_t want = (n < kh ? n : kh) - c;
                if (want > 0) {
                    for (int64_t p = 0; p < n; p++) {
                        float v = key[p];
                        key[p] = isnan(v) || v == -INFINITY ? -FLT_MAX
                                 : (v == INFINITY ? FLT_MAX : v);
                        elig[p] = !ch[p];
                    }
                    mark_top(key, elig, n, want, scratch, ch);
                }
                int64_t o = ip[r];
                for (int64_t p = 0; p < n; p++)
                    if (ch[p]) { ix[o++] = p; any[p] = 1; }
                ip[r + 1] = o;
            }
            int64_t o = up[b];
            for (int64_t p = 0; p < n; p++)
                if (any[p]) ux[o++] = p;
            up[b + 1] = o;
            if (upos) {     /* each row entry's position among the union's entries */
                for (int64_t u = up[b]; u < up[b + 1]; u++)
                    umap[ux[u]] = u;
                for (int64_t e = ip[(int64_t)b * kvh]; e < ip[(int64_t)(b + 1) * kvh]; e++)
                    upos[e] = umap[ix[e]];
            }
        }
    }
    free(sc);
    free(chosen);
    free(umap);
    Py_END_ALLOW_THREADS
    if (failed)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"select_pages", select_pages, METH_VARARGS,
     "select_pages(q, summary_addrs, prior_addrs, bf16, quest, batch, kvh, group, head_dim, "
     "n_pages, budget, sink, local, prior_pages, indptr, indices, union_indptr, union_indices, "
     "scores_out): addresses of contiguous buffers (q float32 [B, KVH, group, D]; summary_addrs "
     "uint64 [B] of [>= n_b, KVH, 3, D] summaries; prior_addrs uint64 [B] of [>= n_b, KVH] "
     "float32 priors, 0 for none, or 0 for no array; n_pages int64 [B]; outputs int64 "
     "[B*KVH+1], [B*KVH*k], [B+1], [B*P_max]; scores_out float32 [B*KVH, P_max] or 0; simd: "
     "the AVX-512 scoring where the CPU has it; head_budgets: 0 or int64 [2, KVH], each KV head's "
     "budget then its prior pages, budget their largest); union_pos: 0 or int64 [B*KVH*k], "
     "each listed page's position in union_indices; without the GIL"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_select", NULL, -1, methods};

PyMODINIT_FUNC PyInit__select(void) { return PyModule_Create(&module); }
