/* One (sequence, KV head) row of decode attention over a list of pages, as an online-softmax
 * state (kernels/_decode.c splits rows into chunks of pages and merges the chunks' states).
 *
 * A row's state for each of its `group` query heads j: m[j] the largest score so far, l[j] the
 * sum of exp(score - m[j]), acc[j * d:(j + 1) * d] the sum of exp(score - m[j]) V. A row
 * function goes on from the state it is given over n pages (the last holding `last` tokens),
 * one page at a time: flash-decoding's recurrence, float32 accumulation.
 *
 * Three implementations: the portable one (attend_row, vectorised by the compiler per token);
 * where the CPU has AVX2 and FMA and d is a multiple of 8, attend_row8 (blocks of 8 tokens);
 * where it has AVX-512 and d is a multiple of 16, attend_row16: a block of 16 tokens' scores
 * per query head in one vector (no horizontal sum per token), a vector exp, and the next
 * pages prefetched. They round differently (float32 sums in another order; the vector exp
 * within 2 ulp of expf); one process always runs the same one. */
#ifndef STRATA_KERNELS_ATTEND_ROWS_H
#define STRATA_KERNELS_ATTEND_ROWS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

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

/* Start loading the row's next pages while this one computes: page p + 2 into L2, page p + 1
 * (already on its way to L2) into L1. A page's K and V of one head are 2 x ps x d elements
 * 64-byte lines apart from each other. Prefetching only page p + 1 into L1 streamed 8.7 GB/s
 * a thread from DRAM (1 x 7K tokens of bf16, pages in slot order); with this 14.5, one
 * core's DRAM read bandwidth (docs/perf-notes.md). */
static inline void prefetch_head(const char *k, int64_t v_bytes, int64_t head_len, int l1) {
    for (int64_t o = 0; o < head_len; o += 64) {
        if (l1) {
            __builtin_prefetch(k + o, 0, 3);
            __builtin_prefetch(k + v_bytes + o, 0, 3);
        } else {
            __builtin_prefetch(k + o, 0, 2);
            __builtin_prefetch(k + v_bytes + o, 0, 2);
        }
    }
}

static inline void prefetch_ahead(const char *pool, const int64_t *slots, int64_t p, int64_t n,
                                  int64_t slot_bytes, int64_t head_bytes, int64_t v_bytes,
                                  int64_t head_len) {
    if (p + 2 < n)
        prefetch_head(pool + slots[p + 2] * slot_bytes + head_bytes, v_bytes, head_len, 0);
    if (p + 1 < n)
        prefetch_head(pool + slots[p + 1] * slot_bytes + head_bytes, v_bytes, head_len, 1);
}

/* a row's state to start from: empty, or with `carry` a first half's normalized result (out,
 * lse): its out as the accumulator, its lse as the max, 1 as the sum. acc may be out itself. */
static inline void start_row(float *m, float *l, float *acc, const float *out, const float *lse,
                             int g, int d, int carry) {
    for (int j = 0; j < g; j++) {
        m[j] = carry ? lse[j] : -INFINITY;
        l[j] = carry && !isinf(lse[j]) ? 1.f : 0.f;
    }
    if (!carry)
        memset(acc, 0, sizeof(float) * (size_t)g * d);
    else if (acc != out)
        memcpy(acc, out, sizeof(float) * (size_t)g * d);
}

/* state a <- a followed by b (the states of two runs of a row's pages), in one fixed order */
static inline void merge_state(float *ma, float *la, float *acca, const float *mb,
                               const float *lb, const float *accb, int g, int d) {
    for (int j = 0; j < g; j++) {
        const float mx = ma[j] > mb[j] ? ma[j] : mb[j];
        if (isinf(mx) && mx < 0)            /* both empty */
            continue;
        const float ca = safe_exp(ma[j] - mx), cb = safe_exp(mb[j] - mx);
        la[j] = la[j] * ca + lb[j] * cb;
        for (int i = 0; i < d; i++)
            acca[j * d + i] = acca[j * d + i] * ca + accb[j * d + i] * cb;
        ma[j] = mx;
    }
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
                       int last, int ps, int d, int g, float scale, float *m, float *l,
                       float *out) {
    float s[MAX_PS * MAX_G], row[MAX_D];
    const int64_t tok_bytes = (int64_t)d * (bf16 ? 2 : 4), head_len = ps * tok_bytes;
    for (int64_t p = 0; p < n; p++) {
        prefetch_ahead(pool, slots, p, n, slot_bytes, head_bytes, v_bytes, head_len);
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
 * widened to float32 once; the next pages' K and V prefetched while this one computes.
 * Inlined with d constant for the common head size, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) AVX512 void attend_row16(
        const float *q, const char *pool, int bf16, int64_t slot_bytes, int64_t head_bytes,
        int64_t v_bytes, const int64_t *slots, int64_t n, int last, int ps, const int d, int g,
        float scale, float *m, float *l, float *out) {
    float part[MAX_G * 256] __attribute__((aligned(64)));       /* [g][16 tokens][16 lanes] */
    float w[MAX_G * 16] __attribute__((aligned(64)));           /* [g][16 tokens] */
    float vrow[16 * MAX_D] __attribute__((aligned(64)));        /* a block's V as float32 */
    const int nv = d / 16;
    const int64_t tok_bytes = (int64_t)d * (bf16 ? 2 : 4), head_len = ps * tok_bytes;
    for (int64_t p = 0; p < n; p++) {
        const char *k = pool + slots[p] * slot_bytes + head_bytes;
        const char *v = k + v_bytes;
        prefetch_ahead(pool, slots, p, n, slot_bytes, head_bytes, v_bytes, head_len);
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
                __m512 kc[MAX_D / 16];          /* the token's K, widened once for all heads */
                for (int c = 0; c < nv; c++)
                    kc[c] = load16(kr + c * 16 * (bf16 ? 2 : 4), bf16);
                for (int j = 0; j < g; j++) {
                    __m512 acc = _mm512_setzero_ps();
                    for (int c = 0; c < nv; c++)
                        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * d + 16 * c), kc[c], acc);
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
}

static AVX512 void attend_row_d64(const float *q, const char *pool, int bf16, int64_t slot_bytes,
                                  int64_t head_bytes, int64_t v_bytes, const int64_t *slots,
                                  int64_t n, int last, int ps, int d, int g, float scale,
                                  float *m, float *l, float *out) {
    (void)d;
    attend_row16(q, pool, bf16, slot_bytes, head_bytes, v_bytes, slots, n, last, ps, 64, g,
                 scale, m, l, out);
}

static AVX512 void attend_row_avx512(const float *q, const char *pool, int bf16,
                                     int64_t slot_bytes, int64_t head_bytes, int64_t v_bytes,
                                     const int64_t *slots, int64_t n, int last, int ps, int d,
                                     int g, float scale, float *m, float *l, float *out) {
    attend_row16(q, pool, bf16, slot_bytes, head_bytes, v_bytes, slots, n, last, ps, d, g,
                 scale, m, l, out);
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
        float scale, float *m, float *l, float *out) {
    float part[MAX_G * 64] __attribute__((aligned(32)));        /* [g][8 tokens][8 lanes] */
    float w[MAX_G * 8] __attribute__((aligned(32)));            /* [g][8 tokens] */
    __m256 r[MAX_D / 8];
    const int nv = d / 8, es = bf16 ? 2 : 4;
    const int64_t tok_bytes = (int64_t)d * es, head_len = ps * tok_bytes;
    const __m256 lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t p = 0; p < n; p++) {
        const char *k = pool + slots[p] * slot_bytes + head_bytes;
        const char *v = k + v_bytes;
        prefetch_ahead(pool, slots, p, n, slot_bytes, head_bytes, v_bytes, head_len);
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
}

static AVX2 void attend_row_d64_avx2(const float *q, const char *pool, int bf16,
                                     int64_t slot_bytes, int64_t head_bytes, int64_t v_bytes,
                                     const int64_t *slots, int64_t n, int last, int ps, int d,
                                     int g, float scale, float *m, float *l, float *out) {
    (void)d;
    attend_row8(q, pool, bf16, slot_bytes, head_bytes, v_bytes, slots, n, last, ps, 64, g,
                scale, m, l, out);
}

static AVX2 void attend_row_avx2(const float *q, const char *pool, int bf16,
                                 int64_t slot_bytes, int64_t head_bytes, int64_t v_bytes,
                                 const int64_t *slots, int64_t n, int last, int ps, int d, int g,
                                 float scale, float *m, float *l, float *out) {
    attend_row8(q, pool, bf16, slot_bytes, head_bytes, v_bytes, slots, n, last, ps, d, g,
                scale, m, l, out);
}
#endif

#endif
