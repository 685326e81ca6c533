/* The AVX2 path of kernels/_qmatmul.c (its job_t, GROUP and run_portable before it): a
 * block of up to 4 rows of x against one output row of codes at a time, the accumulators in
 * registers. Included by _qmatmul.c only. */
#ifndef STRATA_KERNELS_QMATMUL_AVX2_H
#define STRATA_KERNELS_QMATMUL_AVX2_H

/* ---- AVX2 ------------------------------------------------------------------------------- */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX2_PATH 1
#define AVX2 __attribute__((target("avx2,fma,f16c")))

static inline AVX2 float hadd8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* 32 codes of a group as bytes in element order: unsigned 0..15 or signed */
static inline AVX2 __m256i load_group(const uint8_t *c, int bits) {
    if (bits == 8)
        return _mm256_loadu_si256((const __m256i *)c);
    const __m128i b = _mm_loadu_si128((const __m128i *)c), low = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
}

/* float16 [n] -> float32 (F16C: every AVX2 CPU has it) */
static inline AVX2 void halves(const uint16_t *h, float *f, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++)
        f[i] = _cvtsh_ss(h[i]);
}

/* sum a[i] * b[i], i < n, in one fixed order */
static inline AVX2 float dot_f32(const float *a, const float *b, Py_ssize_t n) {
    __m256 acc = _mm256_setzero_ps();
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hadd8(acc);
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}

#define INLINE static inline __attribute__((always_inline))

/* a group of codes, ready for group_dot: for int8 x, the 32 codes as bytes (w) and as
 * unsigned bytes (u: maddubs multiplies unsigned by signed bytes, so signed codes go in as |w|
 * with their signs moved onto x); for int16 x, codes 0-15 (w) and 16-31 (u) as int16 */
typedef struct {
    __m256i w, u;
} wgroup;

INLINE AVX2 wgroup load_w(const uint8_t *c, const int bits, const int xbits) {
    wgroup r;
    if (xbits == 8) {
        r.w = load_group(c, bits);
        r.u = bits == 4 ? r.w : _mm256_sign_epi8(r.w, r.w);
    } else if (bits == 4) {
        const __m128i b = _mm_loadu_si128((const __m128i *)c), low = _mm_set1_epi8(0x0f);
        r.w = _mm256_cvtepu8_epi16(_mm_and_si128(b, low));
        r.u = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), low));
    } else {
        r.w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)c));
        r.u = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(c + 16)));
    }
    return r;
}

/* the int32 dot of a group of codes with the group of x at `x`, as 8 lanes (bits and xbits:
 * constants) */
INLINE AVX2 __m256i group_dot(wgroup w, const void *x, const int bits, const int xbits) {
    if (xbits == 16) {
        const __m256i *p = (const __m256i *)x;
        return _mm256_add_epi32(_mm256_madd_epi16(w.w, _mm256_loadu_si256(p)),
                                _mm256_madd_epi16(w.u, _mm256_loadu_si256(p + 1)));
    }
    __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    if (bits == 8)
        xv = _mm256_sign_epi8(xv, w.w);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w.u, xv), _mm256_set1_epi16(1));
}

/* output row n for the R rows of x from r0 (bits, xbits and R constants where inlined: the
 * accumulators stay in registers) */
INLINE AVX2 void block_avx2(const job_t *j, const int bits, const int xbits, const int R,
                            Py_ssize_t n, Py_ssize_t r0, const float *sc, const float *ze) {
    const Py_ssize_t groups = j->k / GROUP, k = j->k, xb = xbits / 8;
    const Py_ssize_t gbytes = bits == 4 ? GROUP / 2 : GROUP;
    const uint8_t *c = j->codes + n * (groups * gbytes);
    const char *xq = (const char *)j->xq + r0 * k * xb;
    const float *dx = j->dx + r0 * groups;
    /* two accumulators a row (even and odd groups): two FMA chains in flight */
    __m256 a0[4], a1[4];
    for (int r = 0; r < R; r++)
        a0[r] = a1[r] = _mm256_setzero_ps();
    Py_ssize_t g = 0;
    for (; g + 2 <= groups; g += 2) {
        const wgroup w0 = load_w(c + g * gbytes, bits, xbits);
        const wgroup w1 = load_w(c + (g + 1) * gbytes, bits, xbits);
        for (int r = 0; r < R; r++) {
            const char *x = xq + (r * k + g * GROUP) * xb;
            const __m256i d0 = group_dot(w0, x, bits, xbits);
            const __m256i d1 = group_dot(w1, x + GROUP * xb, bits, xbits);
            a0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0),
                                    _mm256_set1_ps(sc[g] * dx[r * groups + g]), a0[r]);
            a1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1),
                                    _mm256_set1_ps(sc[g + 1] * dx[r * groups + g + 1]), a1[r]);
        }
    }
    if (g < groups) {
        const wgroup w0 = load_w(c + g * gbytes, bits, xbits);
        for (int r = 0; r < R; r++) {
            const __m256i d0 = group_dot(w0, xq + (r * k + g * GROUP) * xb, bits, xbits);
            a0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0),
                                    _mm256_set1_ps(sc[g] * dx[r * groups + g]), a0[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float y = hadd8(_mm256_add_ps(a0[r], a1[r]));
        if (j->zero)
            y += dot_f32(ze, j->xs + (r0 + r) * groups, groups);
        j->out[(r0 + r) * j->n + n] = y;
    }
}

/* rows [n0, n1) of the output (bits, xbits: constants where inlined) */
INLINE AVX2 void rows_avx2(const job_t *j, const int bits, const int xbits, float *sc,
                           float *ze) {
    const Py_ssize_t groups = j->k / GROUP, m = j->m;
    for (Py_ssize_t n = j->n0; n < j->n1; n++) {
        halves(j->scale + n * groups, sc, groups);
        if (j->zero)
            halves(j->zero + n * groups, ze, groups);
        Py_ssize_t r0 = 0;
        for (; r0 + 4 <= m; r0 += 4)
            block_avx2(j, bits, xbits, 4, n, r0, sc, ze);
        switch (m - r0) {
        case 3: block_avx2(j, bits, xbits, 3, n, r0, sc, ze); break;
        case 2: block_avx2(j, bits, xbits, 2, n, r0, sc, ze); break;
        case 1: block_avx2(j, bits, xbits, 1, n, r0, sc, ze); break;
        }
    }
}

static AVX2 void run_avx2(const job_t *j) {
    const Py_ssize_t groups = j->k / GROUP;
    float *sc = malloc(2 * groups * sizeof(float));
    if (!sc) {
        run_portable(j);
        return;
    }
    if (j->bits == 4 && j->xbits == 8)
        rows_avx2(j, 4, 8, sc, sc + groups);
    else if (j->bits == 4)
        rows_avx2(j, 4, 16, sc, sc + groups);
    else if (j->xbits == 8)
        rows_avx2(j, 8, 8, sc, sc + groups);
    else
        rows_avx2(j, 8, 16, sc, sc + groups);
    free(sc);
}
#endif

#endif
