/*
 * The KV tier codec: pages of 16-bit (bf16) or 32-bit (fp32) K/V values to 8- or 4-bit codes
 * and back, without the GIL. The format (kvstore/tiers/codec.py is the reference in torch):
 *
 *   A page is `rows` rows of `hd` values (rows = 2 * kv_heads * page_size: K then V, head by
 *   head, token by token). Each row is cut into groups of `group` channels; a group gets an
 *   asymmetric float16 (min, scale) pair, meta[row, g] = {scale, min}, and each value the code
 *   c = clamp(rint((x - min) / scale), 0, 2^bits - 1) (0 when scale is 0), computed in fp32
 *   from the float16-rounded min and scale; decoding gives c * scale + min (the product is
 *   exact in fp32: an 8-bit code times an 11-bit significand), rounded to bf16 (nearest even)
 *   or kept in fp32. Codes: one byte each (bits 8) or two to a byte (bits 4: element 2i in the
 *   low nibble, 2i + 1 in the high one), row after row, `rows * hd * bits / 8` bytes a page.
 *
 *   encode(src, codes, meta, rows, hd, group, bits, bf16)
 *   decode(codes, meta, dst, rows, hd, group, bits, bf16[, simd])
 *       src/dst: uint64 [n] addresses of pages; codes: uint64 [n] addresses of their codes;
 *       meta: uint64 [n] addresses of their rows * (hd / group) * 2 float16 values. simd: 2
 *       AVX-512 where the CPU has it, 1 AVX2 (+FMA, F16C), 0 the portable C; every path gives
 *       the same bits. Values beyond float16's range (|x| > 65504) are clamped to it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#define F16_MAX 65504.0f

/* ------------------------------------------------------------------ float16 and bf16 bits */
static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* float32 -> float16, round to nearest even (subnormals too), as torch's .to(float16) */
static uint16_t f32_to_f16(float f) {
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u)                               /* inf / nan */
        return sign | (ax > 0x7f800000u ? 0x7e00 : 0x7c00);
    if (ax >= 0x477ff000u)                               /* rounds past 65504: inf */
        return sign | 0x7c00;
    if (ax < 0x38800000u) {                              /* below 2^-14: subnormal or 0 */
        /* the value in units of 2^-24, rounded to nearest even, by float arithmetic */
        float v = bits_f32(ax) * 16777216.0f;            /* exact: a power-of-two scale */
        float r = rintf(v);                              /* the current rounding: nearest even */
        return sign | (uint16_t)r;
    }
    uint32_t mant = ax & 0x7fffffu;
    uint32_t e = (ax >> 23) - 112;                       /* rebias 127 -> 15 */
    uint32_t h = (e << 10) | (mant >> 13);
    uint32_t rest = mant & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1)))
        h += 1;                                          /* a carry into the exponent is right */
    return sign | (uint16_t)h;
}

static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0)
        return (sign ? -1.0f : 1.0f) * (float)m * (1.0f / 16777216.0f);
    if (e == 31)
        return bits_f32(sign | 0x7f800000u | (m << 13));
    return bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    u += 0x7fffu + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static inline float load_x(const void *src, Py_ssize_t i, int bf16) {
    float x = bf16 ? bits_f32((uint32_t)((const uint16_t *)src)[i] << 16)
                   : ((const float *)src)[i];
    return x > F16_MAX ? F16_MAX : (x < -F16_MAX ? -F16_MAX : x);
}

/* ------------------------------------------------------------------------------- encode */
typedef struct {
    Py_ssize_t rows, hd, group;
    int bits, bf16;
} fmt_t;

static void encode_page(const fmt_t *f, const void *src, uint8_t *codes, uint16_t *meta) {
    const Py_ssize_t groups = f->hd / f->group;
    const float levels = (float)((1 << f->bits) - 1);
    float x[256];
    uint8_t q[256];
    for (Py_ssize_t r = 0; r < f->rows; r++) {
        for (Py_ssize_t g = 0; g < groups; g++) {
            const Py_ssize_t at = r * f->hd + g * f->group, n = f->group;
            for (Py_ssize_t i = 0; i < n; i++)
                x[i] = load_x(src, at + i, f->bf16);
            float mn = x[0], mx = x[0];
            for (Py_ssize_t i = 1; i < n; i++) {
                mn = x[i] < mn ? x[i] : mn;
                mx = x[i] > mx ? x[i] : mx;
            }
            uint16_t mn_h = f32_to_f16(mn);
            float mnf = f16_to_f32(mn_h);
            uint16_t s_h = f32_to_f16((mx - mnf) / levels);
            float sf = f16_to_f32(s_h);
            meta[2 * (r * groups + g)] = s_h;
            meta[2 * (r * groups + g) + 1] = mn_h;
            if (sf > 0.0f) {
                for (Py_ssize_t i = 0; i < n; i++) {
                    float c = rintf((x[i] - mnf) / sf);
                    q[i] = (uint8_t)(c < 0.0f ? 0.0f : (c > levels ? levels : c));
                }
            } else {
                memset(q, 0, (size_t)n);
            }
            if (f->bits == 8)
                memcpy(codes + at, q, (size_t)n);
            else
                for (Py_ssize_t i = 0; i < n; i += 2)
                    codes[(at + i) >> 1] = (uint8_t)(q[i] | (q[i + 1] << 4));
        }
    }
}

/* ------------------------------------------------------------------------------- decode */
static void decode_portable(const fmt_t *f, const uint8_t *codes, const uint16_t *meta,
                            void *dst) {
    const Py_ssize_t groups = f->hd / f->group;
    for (Py_ssize_t r = 0; r < f->rows; r++)
        for (Py_ssize_t g = 0; g < groups; g++) {
            const float sf = f16_to_f32(meta[2 * (r * groups + g)]);
            const float mnf = f16_to_f32(meta[2 * (r * groups + g) + 1]);
            const Py_ssize_t at = r * f->hd + g * f->group;
            for (Py_ssize_t i = 0; i < f->group; i++) {
                const Py_ssize_t e = at + i;
                const int c = f->bits == 8 ? codes[e] : (codes[e >> 1] >> ((e & 1) * 4)) & 15;
                const float y = (float)c * sf + mnf;
                if (f->bf16)
                    ((uint16_t *)dst)[e] = f32_to_bf16(y);
                else
                    ((float *)dst)[e] = y;
            }
        }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_SIMD_PATHS 1
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX512 __attribute__((target("avx512f,avx512bw,f16c")))

/* 16 codes from element e on: 16 bytes (bits 8) or 8 bytes unpacked low nibble first */
static inline AVX2 __m128i codes16(const uint8_t *codes, Py_ssize_t e, int bits) {
    if (bits == 8)
        return _mm_loadu_si128((const __m128i *)(codes + e));
    const __m128i b = _mm_loadl_epi64((const __m128i *)(codes + (e >> 1)));
    const __m128i low = _mm_set1_epi8(0x0f);
    return _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
}

static inline AVX2 __m256i bf16_round8(__m256 y) {
    __m256i u = _mm256_castps_si256(y);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    return _mm256_srli_epi32(u, 16);
}

static AVX2 void decode_avx2(const fmt_t *f, const uint8_t *codes, const uint16_t *meta,
                             void *dst) {
    const Py_ssize_t groups = f->hd / f->group;
    for (Py_ssize_t r = 0; r < f->rows; r++)
        for (Py_ssize_t g = 0; g < groups; g++) {
            const __m256 s = _mm256_set1_ps(_cvtsh_ss(meta[2 * (r * groups + g)]));
            const __m256 m = _mm256_set1_ps(_cvtsh_ss(meta[2 * (r * groups + g) + 1]));
            const Py_ssize_t at = r * f->hd + g * f->group;
            for (Py_ssize_t e = at; e < at + f->group; e += 16) {
                const __m128i c = codes16(codes, e, f->bits);
                const __m256 y0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c)),
                                                  s, m);
                const __m256 y1 = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(c, 8))), s, m);
                if (f->bf16) {
                    __m256i p = _mm256_packus_epi32(bf16_round8(y0), bf16_round8(y1));
                    p = _mm256_permute4x64_epi64(p, 0xd8);
                    _mm256_storeu_si256((__m256i *)((uint16_t *)dst + e), p);
                } else {
                    _mm256_storeu_ps((float *)dst + e, y0);
                    _mm256_storeu_ps((float *)dst + e + 8, y1);
                }
            }
        }
}

static AVX512 void decode_avx512(const fmt_t *f, const uint8_t *codes, const uint16_t *meta,
                                 void *dst) {
    const Py_ssize_t groups = f->hd / f->group;
    for (Py_ssize_t r = 0; r < f->rows; r++)
        for (Py_ssize_t g = 0; g < groups; g++) {
            const __m512 s = _mm512_set1_ps(_cvtsh_ss(meta[2 * (r * groups + g)]));
            const __m512 m = _mm512_set1_ps(_cvtsh_ss(meta[2 * (r * groups + g) + 1]));
            const Py_ssize_t at = r * f->hd + g * f->group;
            for (Py_ssize_t e = at; e < at + f->group; e += 16) {
                const __m128i c = codes16(codes, e, f->bits);
                const __m512 y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c)), s,
                                                 m);
                if (f->bf16) {
                    __m512i u = _mm512_castps_si512(y);
                    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                   _mm512_set1_epi32(1));
                    u = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
                    _mm256_storeu_si256((__m256i *)((uint16_t *)dst + e),
                                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
                } else {
                    _mm512_storeu_ps((float *)dst + e, y);
                }
            }
        }
}
#endif

typedef void (*decode_fn)(const fmt_t *, const uint8_t *, const uint16_t *, void *);

/* ------------------------------------------------------------------------------ Python */
static int get_addrs(PyObject *obj, Py_buffer *view, const char *name, Py_ssize_t *n) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != 8) {
        PyErr_Format(PyExc_ValueError, "%s: an array of 64-bit addresses", name);
        PyBuffer_Release(view);
        return -1;
    }
    Py_ssize_t len = view->len / 8;
    if (*n >= 0 && len != *n) {
        PyErr_Format(PyExc_ValueError, "%s: %zd addresses, expected %zd", name, len, *n);
        PyBuffer_Release(view);
        return -1;
    }
    *n = len;
    return 0;
}

static int check_fmt(const fmt_t *f) {
    if ((f->bits != 8 && f->bits != 4) || f->rows <= 0 || f->group <= 0 || f->group % 16 ||
        f->group > 256 ||
        f->hd % f->group) {
        PyErr_Format(PyExc_ValueError, "unsupported codec format: %d bits, %zd rows, hd %zd, "
                     "group %zd (bits 8 or 4; group a multiple of 16 dividing hd)", f->bits,
                     f->rows, f->hd, f->group);
        return -1;
    }
    return 0;
}

static PyObject *run(PyObject *args, int encode) {
    PyObject *o[3];
    fmt_t f;
    int simd = 2;
    if (encode) {
        if (!PyArg_ParseTuple(args, "OOOnnnii", &o[0], &o[1], &o[2], &f.rows, &f.hd, &f.group,
                              &f.bits, &f.bf16))
            return NULL;
    } else if (!PyArg_ParseTuple(args, "OOOnnnii|i", &o[0], &o[1], &o[2], &f.rows, &f.hd,
                                 &f.group, &f.bits, &f.bf16, &simd)) {
        return NULL;
    }
    if (check_fmt(&f) < 0)
        return NULL;
    static const char *names[2][3] = {{"codes", "meta", "dst"}, {"src", "codes", "meta"}};
    Py_buffer v[3];
    Py_ssize_t n = -1;
    for (int i = 0; i < 3; i++)
        if (get_addrs(o[i], &v[i], names[encode][i], &n) < 0) {
            for (int j = 0; j < i; j++)
                PyBuffer_Release(&v[j]);
            return NULL;
        }
    const uint64_t *a0 = v[0].buf, *a1 = v[1].buf, *a2 = v[2].buf;
    decode_fn fn = decode_portable;
#ifdef HAVE_SIMD_PATHS
    if (simd >= 2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("f16c"))
        fn = decode_avx512;
    else if (simd >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c"))
        fn = decode_avx2;
#else
    (void)simd;
#endif
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < n; j++) {
        if (encode)
            encode_page(&f, (const void *)(uintptr_t)a0[j], (uint8_t *)(uintptr_t)a1[j],
                        (uint16_t *)(uintptr_t)a2[j]);
        else
            fn(&f, (const uint8_t *)(uintptr_t)a0[j], (const uint16_t *)(uintptr_t)a1[j],
               (void *)(uintptr_t)a2[j]);
    }
    Py_END_ALLOW_THREADS
    for (int i = 0; i < 3; i++)
        PyBuffer_Release(&v[i]);
    Py_RETURN_NONE;
}

static PyObject *encode(PyObject *self, PyObject *args) { return run(args, 1); }
static PyObject *decode(PyObject *self, PyObject *args) { return run(args, 0); }

static PyObject *paths(PyObject *self, PyObject *noargs) {
    int best = 0;
#ifdef HAVE_SIMD_PATHS
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("f16c"))
        best = 2;
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c"))
        best = 1;
#endif
    return PyLong_FromLong(best);
}

static PyMethodDef methods[] = {
    {"encode", encode, METH_VARARGS,
     "encode(src, codes, meta, rows, hd, group, bits, bf16): pages at the addresses src[j] "
     "to codes[j] and meta[j] (see the module comment); without the GIL"},
    {"decode", decode, METH_VARARGS,
     "decode(codes, meta, dst, rows, hd, group, bits, bf16[, simd]): codes[j] and meta[j] to "
     "the page at dst[j]; simd 2 AVX-512, 1 AVX2, 0 portable (the best the CPU has at most); "
     "without the GIL"},
    {"best_simd", paths, METH_NOARGS, "the best decode path this CPU runs: 2, 1 or 0"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvcodec", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kvcodec(void) { return PyModule_Create(&module); }
