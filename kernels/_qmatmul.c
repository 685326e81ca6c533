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

#include "_api.h"
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

#include "_qmatmul_avx2.h"

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
static qmatmul_api api = {qmm_run};

PyMODINIT_FUNC PyInit__qmatmul(void) {
    pool_init();
    PyObject *m = PyModule_Create(&module);
    if (m && add_api(m, "api", "kernels._qmatmul.api", &api) < 0)
        Py_CLEAR(m);
    return m;
}
