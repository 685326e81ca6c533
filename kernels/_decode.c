/* Sparse decode attention over per-row page lists, in C without the GIL (kernels/sparse_attention.py).
 *
 * Row r = b * KVH + h attends its `group` query heads to the tokens of the pages listed in
 * slots[row_ptr[r]:row_ptr[r + 1]] (KV head h of each page; the row's last page holds
 * last_len[r] tokens, the others page_size). The pool is [S, 2, KVH, page_size, D] (HND: a
 * head's slice of a page is contiguous), bf16 or float32; queries, output and the log-sum-exp
 * are float32. Online softmax one page at a time (flash-decoding's recurrence), float32
 * accumulation. Reads each page's K and V once, where torch gathers them into a padded
 * workspace, upcasts and runs SDPA over the padding. An empty row yields out 0, lse -inf
 * (the half of a split attention with none of the row's pages). With `carry`, out and lse
 * come in holding the result over other pages (the first half of a split attention), and
 * the row goes on from there: each row's result is then one recurrence, the same bits
 * whatever the batch it runs in (merging the halves with torch's vectorised exp is not).
 *
 * Three implementations of a row: the portable one (attend_row, vectorised by the compiler per
 * token); where the CPU has AVX2 and FMA and D is a multiple of 8, attend_row8 (below: blocks
 * of 8 tokens; 24 rows x 64 pages of bf16 on an AMD EPYC with AVX2 only, see
 * kernels/sparse_attention.py); and, where the CPU has AVX-512 and D is a multiple of 16,
 * attend_row16: a block of 16
 * tokens' scores per query head in one vector (no horizontal sum per token), a vector exp, and
 * the next page prefetched. 24 rows x 64 pages of bf16, 1 thread: 0.78-0.79 against 2.2
 * ms; over every page of 8 x 7K tokens 6.3-6.5 against 17.5-17.7 ms a layer, ~7 GB/s of K/V,
 * this box's attention bandwidth (bench/results/sparse_ops.txt). The two round differently
 * (float32 sums in another order; the vector exp within 2 ulp of expf); one process always
 * runs the same one, so its modes still agree bit for bit.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "_pool.h"
#include "_rows.h"

#define MAX_D 256
#define MAX_G 16
#define MAX_PS 64

/* exp(x) for x <= 0, 0 below -80: a denormal weight makes every multiply that touches it
 * ~100x slower on x86, and attention to a long context is full of negligible weights */
static inline float safe_exp(float x) { return x < -80.f ? 0.f : expf(x); }

static inline float dot(const float *a, const float *b, int d) {
    /* 16 lanes of partial sums: vectorized without reassociating a single float sum */
    float acc[16] = {0};
    int i = 0;
    for (; i + 16 <= d; i += 16)
        for (int k = 0; k < 16; k++)
            acc[k] += a[i + k] * b[i + k];
    float s = 0.f;
    for (; i < d; i++)
        s += a[i] * b[i];
    for (int k = 0; k < 16; k++)
        s += acc[k];
    return s;
}

static inline void axpy(float *acc, float w, const float *v, int d) {
    for (int i = 0; i < d; i++)
        acc[i] += w * v[i];
}

static inline void scale_vec(float *acc, float c, int d) {
    for (int i = 0; i < d; i++)
        acc[i] *= c;
}

/* a row's online-softmax state to start from: none, or with `carry` the first half's
 * normalized result (out as the accumulator, its lse as the max, 1 as the sum) */
static inline void start_row(float *m, float *l, float *out, const float *lse, int g, int d,
                             int carry) {
    for (int j = 0; j < g; j++) {
        m[j] = carry ? lse[j] : -INFINITY;
        l[j] = carry && !isinf(lse[j]) ? 1.f : 0.f;
    }
    if (!carry)
        memset(out, 0, sizeof(float) * (size_t)g * d);
}

/* out normalized, lse = max + log(sum); a row without tokens gives lse -inf */
static inline void finish_row(const float *m, const float *l, float *out, float *lse, int g,
                              int d) {
    for (int j = 0; j < g; j++) {
        if (l[j] > 0.f) {
            scale_vec(out + j * d, 1.f / l[j], d);
            lse[j] = m[j] + logf(l[j]);
        } else {
            lse[j] = -INFINITY;
        }
    }
}

/* one clone per instruction set, picked at load time; the helpers inline into each */
__attribute__((target_clones("avx512f", "avx2", "default")))
static void attend_row(const float *q, const char *pool, int bf16, int64_t slot_bytes,
                       int64_t head_bytes, int64_t v_bytes, const int64_t *slots, int64_t n,
                       int last, int ps, int d, int g, float scale, float *out, float *lse,
                       int carry) {
    float m[MAX_G], l[MAX_G], s[MAX_PS * MAX_G], row[MAX_D];
    const int64_t tok_bytes = (int64_t)d * (bf16 ? 2 : 4);
    start_row(m, l, out, lse, g, d, carry);
    for (int64_t p = 0; p < n; p++) {
        const int ntok = p == n - 1 ? last : ps;
        const char *k = pool + slots[p] * slot_bytes + head_bytes;
        const char *v = k + v_bytes;
        for (int t = 0; t < ntok; t++) {
            load_row(k + t * tok_bytes, bf16, row, d);
            for (int j = 0; j < g; j++)
                s[t * g + j] = scale * dot(q + j * d, row, d);
        }
        for (int j = 0; j < g; j++) {
            float mx = m[j];
            for (int t = 0; t < ntok; t++)
                mx = s[t * g + j] > mx ? s[t * g + j] : mx;
            if (mx > m[j]) {
                const float c = safe_exp(m[j] - mx);
                l[j] *= c;
                scale_vec(out + j * d, c, d);
                m[j] = mx;
            }
            for (int t = 0; t < ntok; t++) {
                const float w = safe_exp(s[t * g + j] - m[j]);
                s[t * g + j] = w;
                l[j] += w;
            }
        }
        for (int t = 0; t < ntok; t++) {
            load_row(v + t * tok_bytes, bf16, row, d);
            for (int j = 0; j < g; j++)
                axpy(out + j * d, s[t * g + j], row, d);
        }
    }
    finish_row(m, l, out, lse, g, d);
}

#ifdef HAVE_AVX512_PATH
/* exp(x) for x <= 0, 0 below -80 (safe_exp's rule; NaN stays NaN): Cephes' expf, x = n ln2
 * + r with |r| <= ln2 / 2, a degree-7 polynomial of r scaled by 2^n; within 2 ulp of expf */
static inline AVX512 __m512 exp16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-80.f), _CMP_NLT_UQ);
    return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, n));
}

/* attend_row with AVX-512, d a multiple of 16: a page in blocks of up to 16 tokens; a block's
 * scores for each query head in one vector (its K rows read once for all heads), its V rows
 * widened to float32 once; the next page's K and V prefetched while this one computes.
 * Inlined with d constant for the common head size, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) AVX512 void attend_row16(
        const float *q, const char *pool, int bf16, int64_t slot_bytes, int64_t head_bytes,
        int64_t v_bytes, const int64_t *slots, int64_t n, int last, int ps, const int d, int g,
        float scale, float *out, float *lse, int carry) {
    float m[MAX_G], l[MAX_G];
    float part[MAX_G * 256] __attribute__((aligned(64)));       /* [g][16 tokens][16 lanes] */
    float w[MAX_G * 16] __attribute__((aligned(64)));           /* [g][16 tokens] */
    float vrow[16 * MAX_D] __attribute__((aligned(64)));        /* a block's V as float32 */
    const int nv = d / 16;
    const int64_t tok_bytes = (int64_t)d * (bf16 ? 2 : 4), head_len = ps * tok_bytes;
    start_row(m, l, out, lse, g, d, carry);
    for (int64_t p = 0; p < n; p++) {
        const char *k = pool + slots[p] * slot_bytes + head_bytes;
        const char *v = k + v_bytes;
        if (p + 1 < n) {
            const char *nk = pool + slots[p + 1] * slot_bytes + head_bytes;
            for (int64_t o = 0; o < head_len; o += 64) {
                _mm_prefetch(nk + o, _MM_HINT_T0);
                _mm_prefetch(nk + v_bytes + o, _MM_HINT_T0);
            }
        }
        const int ntok = p == n - 1 ? last : ps;
        for (int t0 = 0; t0 < ntok; t0 += 16) {
            const int nb = ntok - t0 < 16 ? ntok - t0 : 16;
            for (int t = 0; t < 16; t++) {
                if (t >= nb) {
                    for (int j = 0; j < g; j++)
                        _mm512_store_ps(part + j * 256 + t * 16, _mm512_setzero_ps());
                    continue;
                }
                const char *kr = k + (t0 + t) * tok_bytes;
                for (int j = 0; j < g; j++) {
                    __m512 acc = _mm512_setzero_ps();
                    for (int c = 0; c < nv; c++)
                        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * d + 16 * c),
                                              load16(kr + c * 16 * (bf16 ? 2 : 4), bf16), acc);
                    _mm512_store_ps(part + j * 256 + t * 16, acc);
                }
            }
            const __mmask16 valid = (__mmask16)((1u << nb) - 1);
            for (int j = 0; j < g; j++) {
                const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid,
                    _mm512_mul_ps(hsum16x16(part + j * 256), _mm512_set1_ps(scale)));
                const float mx = _mm512_reduce_max_ps(s);
                if (mx > m[j]) {
                    const float cf = safe_exp(m[j] - mx);
                    l[j] *= cf;
                    scale_vec(out + j * d, cf, d);
                    m[j] = mx;
                }
                const __m512 e = exp16(_mm512_sub_ps(s, _mm512_set1_ps(m[j])));
                l[j] += _mm512_reduce_add_ps(e);
                _mm512_store_ps(w + j * 16, e);
            }
            for (int t = 0; t < nb; t++)
                for (int c = 0; c < nv; c++)
                    _mm512_store_ps(vrow + t * d + 16 * c,
                                    load16(v + (t0 + t) * tok_bytes + c * 16 * (bf16 ? 2 : 4), bf16));
            for (int j = 0; j < g; j++)
                for (int c = 0; c < nv; c++) {
                    __m512 acc = _mm512_loadu_ps(out + j * d + 16 * c);
                    for (int t = 0; t < nb; t++)
                        acc = _mm512_fmadd_ps(_mm512_set1_ps(w[j * 16 + t]),
                                              _mm512_load_ps(vrow + t * d + 16 * c), acc);
                    _mm512_storeu_ps(out + j * d + 16 * c, acc);
                }
        }
    }
    finish_row(m, l, out, lse, g, d);
}

static AVX512 void attend_row_d64(const float *q, const char *pool, int bf16, int64_t slot_bytes,
                                  int64_t head_bytes, int64_t v_bytes, const int64_t *slots,
                                  int64_t n, int last, int ps, int d, int g, float scale,
                                  float *out, float *lse, int carry) {
    (void)d;
    attend_row16(q, pool, bf16, slot_bytes, head_bytes, v_bytes, slots, n, last, ps, 64, g,
                 scale, out, lse, carry);
}

static AVX512 void attend_row_avx512(const float *q, const char *pool, int bf16,
                                     int64_t slot_bytes, int64_t head_bytes, int64_t v_bytes,
                                     const int64_t *slots, int64_t n, int last, int ps, int d,
                                     int g, float scale, float *out, float *lse, int carry) {
    attend_row16(q, pool, bf16, slot_bytes, head_bytes, v_bytes, slots, n, last, ps, d, g,
                 scale, out, lse, carry);
}
#endif

#ifdef HAVE_AVX2_PATH
/* exp16's rule and polynomial in 8 lanes; 2^n built in the exponent bits (n >= -116 wherever
 * the result is kept, so it is a normal float: the same value as AVX-512's scalef) */
static inline AVX2 __m256 exp8(__m256 x) {
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-80.f), _CMP_NLT_UQ);
    return _mm256_and_ps(keep, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* attend_row16 in 8 lanes, d a multiple of 8: a page in blocks of up to 8 tokens, a token's K
 * row loaded once for every query head, a block's scores per head from one hsum8x8 */
static inline __attribute__((always_inline)) AVX2 void attend_row8(
        const float *q, const char *pool, int bf16, int64_t slot_bytes, int64_t head_bytes,
        int64_t v_bytes, const int64_t *slots, int64_t n, int last, int ps, const int d, int g,
        float scale, float *out, float *lse, int carry) {
    float m[MAX_G], l[MAX_G];
    float part[MAX_G * 64] __attribute__((aligned(32)));        /* [g][8 tokens][8 lanes] */
    float w[MAX_G * 8] __attribute__((aligned(32)));            /* [g][8 tokens] */
    __m256 r[MAX_D / 8];
    const int nv = d / 8, es = bf16 ? 2 : 4;
    const int64_t tok_bytes = (int64_t)d * es, head_len = ps * tok_bytes;
    const __m256 lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    start_row(m, l, out, lse, g, d, carry);
    for (int64_t p = 0; p < n; p++) {
        const char *k = pool + slots[p] * slot_bytes + head_bytes;
        const char *v = k + v_bytes;
        if (p + 1 < n) {
            const char *nk = pool + slots[p + 1] * slot_bytes + head_bytes;
            for (int64_t o = 0; o < head_len; o += 64) {
                _mm_prefetch(nk + o, _MM_HINT_T0);
                _mm_prefetch(nk + v_bytes + o, _MM_HINT_T0);
            }
        }
        const int ntok = p == n - 1 ? last : ps;
        for (int t0 = 0; t0 < ntok; t0 += 8) {
            const int nb = ntok - t0 < 8 ? ntok - t0 : 8;
            for (int t = 0; t < 8; t++) {
                if (t >= nb) {
                    for (int j = 0; j < g; j++)
                        _mm256_store_ps(part + j * 64 + t * 8, _mm256_setzero_ps());
                    continue;
                }
                const char *kr = k + (t0 + t) * tok_bytes;
                for (int c = 0; c < nv; c++)
                    r[c] = load8f(kr + c * 8 * es, bf16);
                for (int j = 0; j < g; j++) {
                    __m256 acc = _mm256_setzero_ps();
                    for (int c = 0; c < nv; c++)
                        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * d + 8 * c), r[c], acc);
                    _mm256_store_ps(part + j * 64 + t * 8, acc);
                }
            }
            const __m256 valid = _mm256_cmp_ps(lanes, _mm256_set1_ps((float)nb), _CMP_LT_OQ);
            for (int j = 0; j < g; j++) {
                const __m256 s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                    _mm256_mul_ps(hsum8x8(part + j * 64), _mm256_set1_ps(scale)), valid);
                const float mx = hmax8(s);
                if (mx > m[j]) {
                    const float cf = safe_exp(m[j] - mx);
                    l[j] *= cf;
                    scale_vec(out + j * d, cf, d);
                    m[j] = mx;
                }
                const __m256 e = exp8(_mm256_sub_ps(s, _mm256_set1_ps(m[j])));
                l[j] += hadd8(e);
                _mm256_store_ps(w + j * 8, e);
            }
            for (int c = 0; c < nv; c++) {
                __m256 vr[8];
                for (int t = 0; t < nb; t++)
                    vr[t] = load8f(v + (t0 + t) * tok_bytes + c * 8 * es, bf16);
                for (int j = 0; j < g; j++) {
                    __m256 acc = _mm256_loadu_ps(out + j * d + 8 * c);
                    for (int t = 0; t < nb; t++)
                        acc = _mm256_fmadd_ps(_mm256_set1_ps(w[j * 8 + t]), vr[t], acc);
                    _mm256_storeu_ps(out + j * d + 8 * c, acc);
                }
            }
        }
    }
    finish_row(m, l, out, lse, g, d);
}

static AVX2 void attend_row_d64_avx2(const float *q, const char *pool, int bf16,
                                     int64_t slot_bytes, int64_t head_bytes, int64_t v_bytes,
                                     const int64_t *slots, int64_t n, int last, int ps, int d,
                                     int g, float scale, float *out, float *lse, int carry) {
    (void)d;
    attend_row8(q, pool, bf16, slot_bytes, head_bytes, v_bytes, slots, n, last, ps, 64, g,
                scale, out, lse, carry);
}

static AVX2 void attend_row_avx2(const float *q, const char *pool, int bf16,
                                 int64_t slot_bytes, int64_t head_bytes, int64_t v_bytes,
                                 const int64_t *slots, int64_t n, int last, int ps, int d, int g,
                                 float scale, float *out, float *lse, int carry) {
    attend_row8(q, pool, bf16, slot_bytes, head_bytes, v_bytes, slots, n, last, ps, d, g,
                scale, out, lse, carry);
}
#endif

typedef void (*row_fn)(const float *, const char *, int, int64_t, int64_t, int64_t,
                       const int64_t *, int64_t, int, int, int, int, float, float *, float *, int);

/* A contiguous run of rows of one call, for one thread. */
typedef struct {
    row_fn fn;
    const float *q;
    const char *pool;
    int bf16, kvh, ps, d, g, carry;
    int64_t slot_bytes, head_bytes, v_bytes;
    const int64_t *rp, *sl;
    const int32_t *ll;
    float scale;
    float *out, *lse;
    Py_ssize_t r0, r1;
} rows_job;

static void *run_rows(void *arg) {
    const rows_job *j = (const rows_job *)arg;
    for (Py_ssize_t r = j->r0; r < j->r1; r++)
        j->fn(j->q + r * j->g * j->d, j->pool, j->bf16, j->slot_bytes,
              (r % j->kvh) * j->head_bytes, j->v_bytes, j->sl + j->rp[r],
              j->rp[r + 1] - j->rp[r], j->ll[r], j->ps, j->d, j->g, j->scale,
              j->out + r * j->g * j->d, j->lse + r * j->g, j->carry);
    return NULL;
}

#define MAX_THREADS 64
#define MIN_PAGES_PER_THREAD 64     /* below this, handing rows to a pool thread costs more than it saves */

static void run_rows_task(void *arg) { run_rows(arg); }

/* The rows split into `threads` contiguous runs of about equal pages, the first run on the
 * calling thread and the others on the threads of a pool kept between calls (kernels/_pool.h:
 * a thread started per call cost more than one layer's attention at 1 x 1K tokens). Each row
 * is computed whole by one thread, so its bits do not depend on the split. */
static void run_parallel(rows_job *base, Py_ssize_t rows, int threads) {
    const int64_t total = base->rp[rows] - base->rp[0];
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    if (threads > total / MIN_PAGES_PER_THREAD)
        threads = (int)(total / MIN_PAGES_PER_THREAD);
    if (threads > rows)
        threads = (int)rows;
    if (threads < 2) {
        base->r0 = 0;
        base->r1 = rows;
        run_rows(base);
        return;
    }
    rows_job jobs[MAX_THREADS];
    void *args[MAX_THREADS];
    Py_ssize_t r = 0;
    for (int t = 0; t < threads; t++) {
        jobs[t] = *base;
        jobs[t].r0 = r;
        const int64_t goal = base->rp[0] + total * (t + 1) / threads;
        while (r < rows && (t == threads - 1 || base->rp[r + 1] <= goal))
            r++;
        if (r == jobs[t].r0 && r < rows)     /* every run takes a row at least */
            r++;
        jobs[t].r1 = r;
        args[t] = &jobs[t];
    }
    pool_run(run_rows_task, args, threads);
}

static PyObject *sparse_decode(PyObject *self, PyObject *args) {
    unsigned long long q, pool, row_ptr, slots, last, out, lse;
    int bf16, kvh, ps, d, g, carry, simd = 2, threads = 1;
    Py_ssize_t rows, n_slots;
    float scale;
    if (!PyArg_ParseTuple(args, "KKiiiiiKKKnfKKpn|ii", &q, &pool, &bf16, &kvh, &ps, &d, &g,
                          &row_ptr, &slots, &last, &rows, &scale, &out, &lse, &carry, &n_slots,
                          &simd, &threads))
        return NULL;
    if (d < 1 || d > MAX_D || g < 1 || g > MAX_G || ps < 1 || ps > MAX_PS || kvh < 1) {
        PyErr_Format(PyExc_ValueError, "unsupported shape: head_dim %d (<= %d), group %d "
                     "(<= %d), page_size %d (<= %d)", d, MAX_D, g, MAX_G, ps, MAX_PS);
        return NULL;
    }
    const int64_t elem = bf16 ? 2 : 4;
    const int64_t head_bytes = (int64_t)ps * d * elem;
    const int64_t v_bytes = kvh * head_bytes;
    const int64_t slot_bytes = 2 * v_bytes;
    const int64_t *rp = (const int64_t *)(uintptr_t)row_ptr;
    const int64_t *sl = (const int64_t *)(uintptr_t)slots;
    const int32_t *ll = (const int32_t *)(uintptr_t)last;
    /* the table must stay inside the pool: the rows read what it lists */
    for (Py_ssize_t r = 0; r < rows; r++)
        if (ll[r] > ps || (rp[r + 1] > rp[r] && ll[r] < 0)) {
            PyErr_Format(PyExc_ValueError, "page table outside the pool (last page length %d "
                         "of %d)", ll[r], ps);
            return NULL;
        }
    for (int64_t i = 0; i < rp[rows]; i++)
        if (sl[i] < 0 || sl[i] >= n_slots) {
            PyErr_Format(PyExc_ValueError, "page table outside the pool (slot %lld in a pool "
                         "of %zd)", (long long)sl[i], n_slots);
            return NULL;
        }
    row_fn fn = attend_row;
#ifdef HAVE_AVX512_PATH
    if (simd >= 2 && d % 16 == 0 && __builtin_cpu_supports("avx512f"))
        fn = d == 64 ? attend_row_d64 : attend_row_avx512;
    else if (simd >= 1 && d % 8 == 0 && __builtin_cpu_supports("avx2") &&
             __builtin_cpu_supports("fma"))
        fn = d == 64 ? attend_row_d64_avx2 : attend_row_avx2;
#else
    (void)simd;
#endif
    rows_job job = {fn, (const float *)(uintptr_t)q, (const char *)(uintptr_t)pool, bf16, kvh,
                    ps, d, g, carry, slot_bytes, head_bytes, v_bytes, rp, sl, ll, scale,
                    (float *)(uintptr_t)out, (float *)(uintptr_t)lse, 0, 0};
    Py_BEGIN_ALLOW_THREADS
    run_parallel(&job, rows, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"sparse_decode", sparse_decode, METH_VARARGS,
     "sparse_decode(q, pool, bf16, kvh, page_size, head_dim, group, row_ptr, slots, last_len, "
     "rows, scale, out, lse, carry, n_slots[, simd, threads]): addresses of contiguous buffers "
     "(q/out float32 [rows, group, D], row_ptr/slots int64, last_len int32, lse float32 [rows, "
     "group]; with carry, out/lse hold a first half's result to go on from); ValueError unless "
     "every slot is below n_slots and every last_len at most page_size; simd: "
     "2 the AVX-512 rows where the CPU has them, else AVX2; 1 AVX2 at most; 0 the portable "
     "rows; threads: rows split over this many threads (by pages; each row on one); without "
     "the GIL"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_decode", NULL, -1, methods};

PyMODINIT_FUNC PyInit__decode(void) {
    pool_init();
    return PyModule_Create(&module);
}
