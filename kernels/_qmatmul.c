/* Matmuls of a few float32 rows by 4- and 8-bit group-quantized weights, on the CPU.
 *
 *   out[m, n] = sum_k x[m, k] * w[n, k],   w[n, k] = scale[n, g] * q[n, k] + zero[n, g]
 *
 * for groups g of 32 along k (GGUF's Q4_0 / Q4_1 / Q8_0 blocks map onto this with their own
 * codes). Each row of x is first rounded to int16 per group of 32 (xq = round(x / dx),
 * dx = max|x| / top), so a group's dot product is integer:
 *
 *   sum_k x w ~= scale * dx * sum(q * xq) + zero * dx * sum(xq)
 *
 * xbits 16 (top 32767) keeps 15 bits of x, within ~1e-3 of the dequantized weight's float
 * result; xbits 8 (top 127) is llama.cpp's rounding, 0.3-0.5 logit standard deviations off on
 * the bundled model, kept for comparison (same instructions).
 *
 * Layout (kernels/packed_linear.py `_our_layout` writes it): output rows in tiles of 8 (N
 * padded with zero rows), tile by tile, group by group. A tile's group is 16 units of an
 * element pair (e, e + 1) for its 8 rows: 16 codes, row-major (row i's pair at 2i, 2i + 1).
 *   8-bit: signed bytes, unit p (elements 2p, 2p + 1) at bytes 16p .. 16p + 15 (256 a group).
 *   4-bit: unsigned 0..15, 128 bytes a group: elements 8b .. 8b + 7 in the 32 bytes from 32b,
 *          units 4b (low nibbles of bytes 0-15), 4b + 1 (low, 16-31), 4b + 2 (high, 0-15),
 *          4b + 3 (high, 16-31): element e = 8b + 4 nibble + 2 half + (e & 1).
 *   Scales and zeros: float16 [tiles, K / 32, 8] (zero may be absent: 0).
 * So one SIMD register multiplies a unit by x's pair for 8 outputs at once, and a group's
 * float scaling is one multiply-add for 8 outputs (kernels/_qmatmul_tiles.h).
 *
 * Each output is a function of its own row of x and its own row of w, computed in one fixed
 * order: the result of a row does not depend on the batch it is in, nor on the threads.
 * Tiles split over `threads` threads (kernels/_pool.h). Paths: AVX-512 VNNI (vpdpwssd on
 * 256-bit registers) where the CPU has it and simd is 2, AVX2 + FMA + F16C (madd) for simd 1
 * or 2, portable C (simd 0). Runs without the GIL. */
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
#define TILE 8
#define TILE_GROUP_BYTES(bits) ((bits) == 4 ? TILE * GROUP / 2 : TILE * GROUP)
#define MAX_THREADS POOL_MAX
#define MIN_TILES_PER_THREAD 8

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
    /* x as integer groups: xq [M, K] int16, dx [M, G] (its step), xs [M, G] (dx * sum xq) */
    const int16_t *xq;
    const float *dx, *xs;
    const uint8_t *codes;
    const uint16_t *scale, *zero;
    int bits;
    Py_ssize_t m, k, n, t0, t1;     /* [t0, t1): this job's tiles */
    float *out;
    int out_bf16;                   /* dequant: out holds bf16 (kernels/_qmatmul_dequant.h) */
} job_t;

/* ---- the activations, quantized ------------------------------------------------------- */
static void quantize_rows(const float *x, Py_ssize_t m, Py_ssize_t k, int xbits, int16_t *xq,
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
                xq[at + i] = (int16_t)c;
                sum += (int)c;
            }
            dx[r * groups + g] = d;
            xs[r * groups + g] = d * (float)sum;
        }
}

/* x's element pair at p as one int32 (to broadcast) */
static inline int32_t pair_at(const int16_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* ---- portable --------------------------------------------------------------------------- */
/* the code of element e of row i in a tile's group c (the layout above) */
static inline int code_at(const uint8_t *c, int bits, int i, int e) {
    if (bits == 8)
        return ((const int8_t *)c)[(e >> 1) * 16 + 2 * i + (e & 1)];
    const uint8_t byte = c[(e >> 3) * 32 + ((e >> 1) & 1) * 16 + 2 * i + (e & 1)];
    return (e >> 2) & 1 ? byte >> 4 : byte & 0x0f;
}

static void run_portable(const job_t *j) {
    const Py_ssize_t groups = j->k / GROUP, gb = TILE_GROUP_BYTES(j->bits);
    for (Py_ssize_t t = j->t0; t < j->t1; t++)
        for (Py_ssize_t r = 0; r < j->m; r++) {
            float acc[TILE] = {0.f};
            for (Py_ssize_t g = 0; g < groups; g++) {
                const uint8_t *c = j->codes + (t * groups + g) * gb;
                const int16_t *x = j->xq + r * j->k + g * GROUP;
                const Py_ssize_t at = (t * groups + g) * TILE;
                for (int i = 0; i < TILE; i++) {
                    int32_t dot = 0;
                    for (int e = 0; e < GROUP; e++)
                        dot += code_at(c, j->bits, i, e) * (int32_t)x[e];
                    acc[i] += f16_to_f32(j->scale[at + i]) * j->dx[r * groups + g] * (float)dot;
                    if (j->zero)
                        acc[i] += f16_to_f32(j->zero[at + i]) * j->xs[r * groups + g];
                }
            }
            for (int i = 0; i < TILE && t * TILE + i < j->n; i++)
                j->out[r * j->n + t * TILE + i] = acc[i];
        }
}

/* ---- SIMD paths (kernels/_qmatmul_tiles.h) ------------------------------------------------ */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX2_PATH 1

#define TILES(name) name##_avx2
#define TILES_TARGET __attribute__((target("avx2,fma,f16c")))
#define PAIR_DOT(acc, w, x) _mm256_add_epi32((acc), _mm256_madd_epi16((w), (x)))
#include "_qmatmul_tiles.h"
#undef TILES
#undef TILES_TARGET
#undef PAIR_DOT

#define TILES(name) name##_vnni
#define TILES_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))
#define PAIR_DOT(acc, w, x) _mm256_dpwssd_epi32((acc), (w), (x))
#include "_qmatmul_tiles.h"
#undef TILES
#undef TILES_TARGET
#undef PAIR_DOT
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

/* tiles split into `threads` tasks over the pool, task 0 on the calling thread */
static void run_parallel(run_fn fn, const job_t *base, int threads) {
    const Py_ssize_t tiles = base->t1 - base->t0;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    if (threads > tiles / MIN_TILES_PER_THREAD)
        threads = (int)(tiles / MIN_TILES_PER_THREAD);
    if (threads < 2) {
        fn(base);
        return;
    }
    task_t tasks[MAX_THREADS];
    void *args[MAX_THREADS];
    for (int t = 0; t < threads; t++) {
        tasks[t].fn = fn;
        tasks[t].job = *base;
        tasks[t].job.t0 = base->t0 + tiles * t / threads;
        tasks[t].job.t1 = base->t0 + tiles * (t + 1) / threads;
        args[t] = &tasks[t];
    }
    pool_run(run_task, args, threads);
}

#include "_qmatmul_dequant.h"

/* out[M, N] = x[M, K] @ w.T, as qmm below but for the checks; without the GIL (the caller
 * releases it). 0, or -1 where scratch could not be allocated. kernels/_layer.c calls it
 * through the `api` capsule. */
static int qmm_run(const float *x, Py_ssize_t m, Py_ssize_t k, const uint8_t *codes,
                   const uint16_t *scale, const uint16_t *zero, Py_ssize_t n, int bits,
                   float *out, int simd, int threads, int xbits) {
    if (m == 0 || n == 0)
        return 0;
    const Py_ssize_t groups = k / GROUP, tiles = (n + TILE - 1) / TILE;
    const size_t x_bytes = ((size_t)(m * k) * sizeof(int16_t) + 31) & ~(size_t)31;
    char *scratch = malloc(x_bytes + 2 * m * groups * sizeof(float));
    if (!scratch)
        return -1;
    int16_t *xq = (int16_t *)scratch;
    float *dx = (float *)(scratch + x_bytes), *xs = dx + m * groups;
    job_t job = {xq, dx, xs, codes, scale, zero, bits, m, k, n, 0, tiles, out};
    run_fn fn = run_portable;
#ifdef HAVE_AVX2_PATH
    if (simd >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        fn = run_avx2;
    if (simd >= 2 && fn == run_avx2 && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        fn = run_vnni;
#else
    (void)simd;
#endif
    quantize_rows(x, m, k, xbits, xq, dx, xs);
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

/* One row through E experts of an MoE layer, in one call (no Python between the matmuls,
 * so the pool's threads catch each next one while they spin): for expert e of `table`
 * (int64 [E, 8]: its gate|up codes, scale, zero, bits, then its down's),
 *   out[N] += weights[e] * down_e(silu(gate_e(x)) * up_e(x)),   x [K], gate|up [2I, K],
 * down [N, I], the experts in the table's order. float32 throughout; 0 or -1 (no memory). */
static int moe_row_run(const float *x, Py_ssize_t k, const int64_t *table, const float *weights,
                       Py_ssize_t experts, Py_ssize_t inter, Py_ssize_t n, float *out, int simd,
                       int threads, int xbits) {
    float *gu = malloc((size_t)(3 * inter + n) * sizeof(float));
    if (!gu)
        return -1;
    float *h = gu + 2 * inter, *y = h + inter;
    int failed = 0;
    for (Py_ssize_t e = 0; e < experts && !failed; e++) {
        const int64_t *r = table + 8 * e;
        failed = qmm_run(x, 1, k, (const uint8_t *)(uintptr_t)r[0],
                         (const uint16_t *)(uintptr_t)r[1], (const uint16_t *)(uintptr_t)r[2],
                         2 * inter, (int)r[3], gu, simd, threads, xbits);
        if (failed)
            break;
        for (Py_ssize_t i = 0; i < inter; i++)
            h[i] = gu[i] / (1.0f + expf(-gu[i])) * gu[inter + i];
        failed = qmm_run(h, 1, inter, (const uint8_t *)(uintptr_t)r[4],
                         (const uint16_t *)(uintptr_t)r[5], (const uint16_t *)(uintptr_t)r[6],
                         n, (int)r[7], y, simd, threads, xbits);
        for (Py_ssize_t j = 0; j < n && !failed; j++)
            out[j] += weights[e] * y[j];
    }
    free(gu);
    return failed;
}

static PyObject *moe_row(PyObject *self, PyObject *args) {
    unsigned long long x, table, weights, out;
    Py_ssize_t k, experts, inter, n;
    int simd = 1, threads = 1, xbits = 16, failed;
    if (!PyArg_ParseTuple(args, "KnKKnnnK|iii", &x, &k, &table, &weights, &experts, &inter, &n,
                          &out, &simd, &threads, &xbits))
        return NULL;
    if (k % GROUP || inter % GROUP || experts < 0 || n < 0 || (xbits != 8 && xbits != 16)) {
        PyErr_Format(PyExc_ValueError, "unsupported: K %zd and I %zd (multiples of %d), "
                     "%zd experts, N %zd, %d-bit x (8 or 16)", k, inter, GROUP, experts, n,
                     xbits);
        return NULL;
    }
    const int64_t *t = (const int64_t *)(uintptr_t)table;
    for (Py_ssize_t e = 0; e < experts; e++)
        if ((t[8 * e + 3] != 4 && t[8 * e + 3] != 8) || (t[8 * e + 7] != 4 && t[8 * e + 7] != 8)) {
            PyErr_SetString(PyExc_ValueError, "expert codes must be 4- or 8-bit");
            return NULL;
        }
    Py_BEGIN_ALLOW_THREADS
    failed = moe_row_run((const float *)(uintptr_t)x, k, t, (const float *)(uintptr_t)weights,
                         experts, inter, n, (float *)(uintptr_t)out, simd, threads, xbits);
    Py_END_ALLOW_THREADS
    if (failed)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    POOL_OPENMP_METHOD,
    {"pack_codes", pack_codes, METH_VARARGS,
     "pack_codes(codes, N, K, bits, out[, threads]): int16 codes [N, K] (4-bit 0..15, 8-bit "
     "-128..127) into qmm's tiles of 8 rows at out (bytes: tiles x K / 32 x 128 or 256; rows "
     "past N zero); without the GIL"},
    {"dequant", dequant, METH_VARARGS,
     "dequant(codes, scale, zero, N, K, bits, out, bf16[, simd, threads]): out[N, K] = scale * "
     "q + zero (one rounding) from qmm's codes, scales and zeros (zero 0: none), float32 or "
     "bf16 (nearest even) where bf16 is true; simd: 1 or 2 AVX2 where the CPU has it, 0 the "
     "portable path; without the GIL"},
    {"moe_row", moe_row, METH_VARARGS,
     "moe_row(x, K, table, weights, E, I, N, out[, simd, threads, xbits]): out[N] float32 += "
     "sum over E experts of weights[e] * down_e(silu(gate_e(x)) * up_e(x)) for one float32 "
     "row x[K]; table int64 [E, 8]: each expert's gate|up [2I, K] codes, scale, zero "
     "addresses and bits, then its down's [N, I] (qmm's layout); weights float32 [E]; "
     "without the GIL"},
    {"qmm", qmm, METH_VARARGS,
     "qmm(x, M, K, codes, scale, zero, N, bits, out[, simd, threads, xbits]): out[M, N] float32 = "
     "x[M, K] float32 @ w.T for w [N, K] in `bits`-bit codes (4: unsigned, two a byte; 8: "
     "signed bytes) with float16 scales and zeros (zero 0: none), in the tiles of 8 output "
     "rows this module's source lays out (kernels/packed_linear.py writes them); addresses of "
     "contiguous buffers. xbits: x rounded per group of 32 to 16-bit steps (~1e-3 of the float "
     "result) or 8-bit ones (llama.cpp's rounding). simd: 2 AVX-512 VNNI where the CPU has it, "
     "else as 1: AVX2 where the CPU has it; 0 the portable path; threads: tiles split over this "
     "many threads; without the GIL"},
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
