/* Row loads shared by the CPU kernels (kernels/_decode.c, kernels/_select.c): a row of d
 * values, bf16 or float32, as float32; and their AVX-512 helpers. */
#ifndef STRATA_KERNELS_ROWS_H
#define STRATA_KERNELS_ROWS_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline void load_row(const void *src, int bf16, float *dst, int d) {
    if (bf16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int i = 0; i < d; i++)
            dst[i] = bf16_to_f32(s[i]);
    } else {
        memcpy(dst, src, (size_t)d * sizeof(float));
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
/* AVX-512 helpers, for functions compiled for it (AVX512) and run where the CPU has it */
#include <immintrin.h>
#define HAVE_AVX512_PATH 1
#define AVX512 __attribute__((target("avx512f")))

/* 16 values of a row, bf16 or float32, as float32 */
static inline AVX512 __m512 load16(const char *p, int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_loadu_ps((const float *)p);
}

/* lane t = the sum of the 16 values at p + 16 t, for t < 16 (p 64-byte aligned: aligned
 * loads): a transpose by shuffles, each lane's sum one fixed tree (the same bits whatever the
 * batch) */
static inline AVX512 __m512 hsum16x16(const float *p) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) {
        const __m512 x = _mm512_load_ps(p + 32 * i), y = _mm512_load_ps(p + 32 * i + 16);
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
    }
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                         _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

/* AVX2 helpers, for functions compiled for it (AVX2) and run where the CPU has AVX2 and FMA */
#define HAVE_AVX2_PATH 1
#define AVX2 __attribute__((target("avx2,fma")))

/* 8 values of a row, bf16 or float32, as float32 */
static inline AVX2 __m256 load8f(const char *p, int bf16) {
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    return _mm256_loadu_ps((const float *)p);
}

/* lane t = the sum of the 8 values at p + 8 t, for t < 8 (p 32-byte aligned): horizontal adds
 * and one swap of halves, each lane's sum one fixed tree (the same bits whatever the batch) */
static inline AVX2 __m256 hsum8x8(const float *p) {
    __m256 a[4], b[2];
    for (int i = 0; i < 4; i++)
        a[i] = _mm256_hadd_ps(_mm256_load_ps(p + 16 * i), _mm256_load_ps(p + 16 * i + 8));
    for (int i = 0; i < 2; i++)
        b[i] = _mm256_hadd_ps(a[2 * i], a[2 * i + 1]);
    return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20),
                         _mm256_permute2f128_ps(b[0], b[1], 0x31));
}

/* the max and the sum of 8 lanes, each one fixed tree */
static inline AVX2 float hmax8(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

static inline AVX2 float hadd8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
#endif

#endif
