/* Matmuls of a few float32 rows by 4- and 8-bit group-quantized weights, on the CPU.
 *
 *   out[m, n] = sum_k x[m, k] * w[n, k],   w[n, k] = scale[n, g] * q[n, k] + zero[n, g]
 *
 * for groups g of 32 along k (GGUF's Q4_0 / Q4_1 / Q8_0 blocks map onto this with their own
 * codes). Each row of x is first rounded to integers per group of 32 (xq = round(x / dx),
 * dx = max|x| / (2^(xbits-1) - 1)), so a group's dot product is integer:
 *
 *   sum_k x w ~= scale * dx * sum(q * xq) + zero * dx * sum(xq)
 *
 * xbits 8 is llama.cpp's scheme (int8 x: u8 x s8 products by maddubs, the fewest
 * instructions); xbits 16 keeps 15 bits of x (int16 products by madd), within ~1e-3 of the
 * dequantized weight's float result where int8 x can be 0.3-0.5 logit standard deviations
 * off on the bundled model.
 *
 * Codes: 4-bit, unsigned 0..15, two to a byte, group by group: byte j of a group holds element
 * j in its low nibble and element j + 16 in its high one (GGUF's order); 8-bit, signed, one
 * byte each. Scales and zeros are float16, [N, K / 32] (zero may be absent: 0).
 *
 * Each output is a function of its own row of x and its own row of w, computed in one fixed
 * order: the result of a row does not depend on the batch it is in, nor on the threads.
 * Output rows split over `threads` threads of a pool kept between calls (kernels/_pool.h).
 * Paths: AVX2 where the CPU has AVX2, FMA and F16C, portable C elsewhere; `simd` 0 forces
 * the portable one. Runs without the GIL. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_pool.h"

#define GROUP 32
#define MAX_THREADS POOL_MAX
#define MIN_N_PER_THREAD 64

static float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {                         /* subnormal: normalize */
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while (!(man & 0x400));
            bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

typedef struct {
    /* x as integer groups: xq [M, K] (int8 or int16), dx [M, G] (its step), xs [M, G]
     * (dx * sum xq) */
    const void *xq;
    int xbits;
    const float *dx, *xs;
    const uint8_t *codes;
    const uint16_t *scale, *zero;
    int bits;
    Py_ssize_t m, k, n, n0, n1;
    float *out;
} job_t;

/* ---- the activations, quantized ------------------------------------------------------- */
static void quantize_rows(const float *x, Py_ssize_t m, Py_ssize_t k, int xbits, void *xq,
                          float *dx, float *xs) {
    const Py_ssize_t groups = k / GROUP;
    const float top = xbits == 8 ? 127.f : 32767.f;
    for (Py_ssize_t r = 0; r < m; r++)
        for (Py_ssize_t g = 0; g < groups; g++) {
            const Py_ssize_t at = r * k + g * GROUP;
            const float *v = x + at;
            float amax = 0.f;
            for (int i = 0; i < GROUP; i++)
                amax = fmaxf(amax, fabsf(v[i]));
            const float d = amax / top, inv = amax > 0.f ? top / amax : 0.f;
            int sum = 0;
            for (int i = 0; i < GROUP; i++) {
                long c = lrintf(v[i] * inv);
                c = c > (long)top ? (long)top : c < -(long)top ? -(long)top : c;
                if (xbits == 8)
                    ((int8_t *)xq)[at + i] = (int8_t)c;
                else
                    ((int16_t *)xq)[at + i] = (int16_t)c;
                sum += (int)c;
            }
            dx[r * groups + g] = d;
            xs[r * groups + g] = d * (float)sum;
        }
}

static inline int32_t x_at(const job_t *j, Py_ssize_t i) {
    return j->xbits == 8 ? ((const int8_t *)j->xq)[i] : ((const int16_t *)j->xq)[i];
}

/* ---- portable --------------------------------------------------------------------------- */
static void run_portable(const job_t *j) {
    const Py_ssize_t groups = j->k / GROUP;
    const Py_ssize_t row_bytes = j->bits == 4 ? j->k / 2 : j->k;
    int8_t w[GROUP];
    for (Py_ssize_t n = j->n0; n < j->n1; n++) {
        const uint8_t *c = j->codes + n * row_bytes;
        for (Py_ssize_t r = 0; r < j->m; r++) {
            float acc = 0.f, zacc = 0.f;
            for (Py_ssize_t g = 0; g < groups; g++) {
                if (j->bits == 4) {
                    const uint8_t *b = c + g * (GROUP / 2);
                    for (int i = 0; i < GROUP / 2; i++) {
                        w[i] = (int8_t)(b[i] & 0x0f);
                        w[i + GROUP / 2] = (int8_t)(b[i] >> 4);
                    }
                } else {
                    memcpy(w, c + g * GROUP, GROUP);
                }
                const Py_ssize_t at = r * j->k + g * GROUP;
                int32_t dot = 0;
                for (int i = 0; i < GROUP; i++)
                    dot += (int32_t)w[i] * x_at(j, at + i);
                const float s = f16_to_f32(j->scale[n * groups + g]);
                acc += s * j->dx[r * groups + g] * (float)dot;
                if (j->zero)
                    zacc += f16_to_f32(j->zero[n * groups + g]) * j->xs[r * groups + g];
            }
            j->out[r * j->n + n] = acc + zacc;
        }
    }
}

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

typedef void (*run_fn)(const job_t *);

typedef struct {
    run_fn fn;
    job_t job;
} task_t;

static void run_task(void *arg) {
    task_t *t = (task_t *)arg;
    t->fn(&t->job);
}

/* output rows split into `threads` tasks over the pool, task 0 on the calling thread */
static void run_parallel(run_fn fn, const job_t *base, int threads) {
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    if (threads > base->n / MIN_N_PER_THREAD)
        threads = (int)(base->n / MIN_N_PER_THREAD);
    if (threads < 2) {
        fn(base);
        return;
    }
    task_t tasks[MAX_THREADS];
    void *args[MAX_THREADS];
    for (int t = 0; t < threads; t++) {
        tasks[t].fn = fn;
        tasks[t].job = *base;
        tasks[t].job.n0 = base->n * t / threads;
        tasks[t].job.n1 = base->n * (t + 1) / threads;
        args[t] = &tasks[t];
    }
    pool_run(run_task, args, threads);
}

/* out[M, N] = x[M, K] @ w.T, as qmm below but for the checks; without the GIL (the caller
 * releases it). 0, or -1 where scratch could not be allocated. kernels/_layer.c calls it
 * through the `api` capsule. */
static int qmm_run(const float *x, Py_ssize_t m, Py_ssize_t k, const uint8_t *codes,
                   const uint16_t *scale, const uint16_t *zero, Py_ssize_t n, int bits,
                   float *out, int simd, int threads, int xbits) {
    if (m == 0 || n == 0)
        return 0;
    const Py_ssize_t groups = k / GROUP;
    const size_t x_bytes = ((size_t)(m * k * (xbits / 8)) + 31) & ~(size_t)31;
    char *scratch = malloc(x_bytes + 2 * m * groups * sizeof(float));
    if (!scratch)
        return -1;
    float *dx = (float *)(scratch + x_bytes), *xs = dx + m * groups;
    job_t job = {scratch, xbits, dx, xs, codes, scale, zero, bits, m, k, n, 0, n, out};
    run_fn fn = run_portable;
#ifdef HAVE_AVX2_PATH
    if (simd >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        fn = run_avx2;
#else
    (void)simd;
#endif
    quantize_rows(x, m, k, xbits, scratch, dx, xs);
    run_parallel(fn, &job, threads);
    free(scratch);
    return 0;
}

static PyObject *qmm(PyObject *self, PyObject *args) {
    unsigned long long x, codes, scale, zero, out;
    Py_ssize_t m, k, n;
    int bits, simd = 1, threads = 1, xbits = 16, failed;
    if (!PyArg_ParseTuple(args, "KnnKKKniK|iii", &x, &m, &k, &codes, &scale, &zero, &n, &bits,
                          &out, &simd, &threads, &xbits))
        return NULL;
    if ((bits != 4 && bits != 8) || k % GROUP || m < 0 || n < 0 || (xbits != 8 && xbits != 16)) {
        PyErr_Format(PyExc_ValueError, "unsupported: %d-bit codes (4 or 8), K %zd (a multiple "
                     "of %d), M %zd, N %zd, %d-bit x (8 or 16)", bits, k, GROUP, m, n, xbits);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    failed = qmm_run((const float *)(uintptr_t)x, m, k, (const uint8_t *)(uintptr_t)codes,
                     (const uint16_t *)(uintptr_t)scale, (const uint16_t *)(uintptr_t)zero, n,
                     bits, (float *)(uintptr_t)out, simd, threads, xbits);
    Py_END_ALLOW_THREADS
    if (failed)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    POOL_OPENMP_METHOD,
    {"qmm", qmm, METH_VARARGS,
     "qmm(x, M, K, codes, scale, zero, N, bits, out[, simd, threads, xbits]): out[M, N] float32 = "
     "x[M, K] float32 @ w.T for w [N, K] in `bits`-bit codes (4: two a byte, GGUF's order "
     "within a group of 32; 8: signed bytes) with float16 scale and zero [N, K / 32] (zero 0: "
     "none); addresses of contiguous buffers. xbits: x rounded per group of 32 to 16-bit "
     "integers (~1e-3 of the float result) or 8-bit ones (llama.cpp's, fewer instructions). simd: 1 AVX2 where the CPU has it, 0 the "
     "portable path; threads: output rows split over this many threads; without the GIL"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_qmatmul", NULL, -1, methods};

/* for kernels/_layer.c: the matmul without Python (its calls run on this module's pool) */
static struct {
    int (*qmm)(const float *, Py_ssize_t, Py_ssize_t, const uint8_t *, const uint16_t *,
               const uint16_t *, Py_ssize_t, int, float *, int, int, int);
} api = {qmm_run};

PyMODINIT_FUNC PyInit__qmatmul(void) {
    pool_init();
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    PyObject *cap = PyCapsule_New(&api, "kernels._qmatmul.api", NULL);
    if (!cap || PyModule_AddObject(m, "api", cap) < 0) {
        Py_XDECREF(cap);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
