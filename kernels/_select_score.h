/* The scoring half of kernels/_select.c: each page's score per (sequence, KV head) from its
 * summaries, the max over the GQA group's query heads (see _select.c's comment), portable and
 * AVX-512. Included by _select.c only. */
#ifndef STRATA_KERNELS_SELECT_SCORE_H
#define STRATA_KERNELS_SELECT_SCORE_H

#include <math.h>
#include <stdint.h>
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

#ifdef HAVE_AVX2_PATH
/* score_seq16 in 8 lanes, f a multiple of 8: pages in blocks of 8, each query head's 8 sums
 * out of one hsum8x8 of per-page partial sums (a page's row read once for every head, from
 * L1 chunk by chunk: AVX2's 16 registers do not hold a 2D row); the max over the group, NaN
 * winning, as score_seq16's. */
static AVX2 void score_seq8(const float *qq, int kvh, int g, int f, const char *summ,
                            int64_t page_bytes, int64_t head_bytes, int64_t off, int bf16,
                            int64_t n, float *out, int64_t stride) {
    float part[MAX_G * 64] __attribute__((aligned(32)));       /* [g][8 pages][8 lanes] */
    const int nv = f / 8, es = bf16 ? 2 : 4;
    const __m256 nan = _mm256_set1_ps(NAN);
    const __m256 lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t p0 = 0; p0 < n; p0 += 8) {
        const int nb = n - p0 < 8 ? (int)(n - p0) : 8;
        for (int h = 0; h < kvh; h++) {
            const float *qh = qq + (int64_t)h * g * f;
            for (int t = 0; t < 8; t++) {
                if (t >= nb) {
                    for (int j = 0; j < g; j++)
                        _mm256_store_ps(part + j * 64 + t * 8, _mm256_setzero_ps());
                    continue;
                }
                const char *row = summ + (p0 + t) * page_bytes + h * head_bytes + off;
                if (p0 + t + 8 < n)         /* the next block's row (see score_seq16) */
                    for (int o = 0; o < f * es; o += 64)
                        _mm_prefetch(row + 8 * page_bytes + o, _MM_HINT_T0);
                __m256 acc[MAX_G];
                for (int j = 0; j < g; j++)
                    acc[j] = _mm256_setzero_ps();
                for (int c = 0; c < nv; c++) {
                    const __m256 x = load8f(row + c * 8 * es, bf16);
                    for (int j = 0; j < g; j++)
                        acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + j * f + 8 * c), x, acc[j]);
                }
                for (int j = 0; j < g; j++)
                    _mm256_store_ps(part + j * 64 + t * 8, acc[j]);
            }
            __m256 best = _mm256_set1_ps(-INFINITY);
            for (int j = 0; j < g; j++) {
                const __m256 v = hsum8x8(part + j * 64);
                const __m256 bad = _mm256_or_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q),
                                                _mm256_cmp_ps(best, best, _CMP_UNORD_Q));
                best = _mm256_blendv_ps(_mm256_max_ps(best, v), nan, bad);
            }
            const __m256i keep = _mm256_castps_si256(
                _mm256_cmp_ps(lanes, _mm256_set1_ps((float)nb), _CMP_LT_OQ));
            _mm256_maskstore_ps(out + h * stride + p0, keep, best);
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
    if (simd == 2) {
        score_seq16(qq, kvh, g, f, summ, page_bytes, head_bytes, off, bf16, n, out, stride);
        return;
    }
#endif
#ifdef HAVE_AVX2_PATH
    if (simd == 1) {
        score_seq8(qq, kvh, g, f, summ, page_bytes, head_bytes, off, bf16, n, out, stride);
        return;
    }
#endif
    (void)simd;
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

#endif
