/* A decoder layer's small ops in C (kernels/layer_ops.py): RMSNorm (with the residual add
 * before it), RoPE in place, the scatter of a step's new K/V into the pool's slots, and the
 * summaries of the pages it wrote, and SiLU(gate) * up in float32 (a polynomial exp the
 * compiler vectorizes: a row of libm expf calls lost to torch's vectorized exp, 10 against 5
 * us at one row).
 *
 * Each is one call where torch runs 3 to 8 ops, each with its dispatch and a temporary: at
 * one decode row the ops are a few hundred values, so the dispatch is the cost (~20 us a
 * layer for the two RMSNorms and RoPE on an AMD EPYC, against ~2 us here). The arithmetic is
 * torch's (and transformers'): float32 statistics, and in bf16 every op's result rounded to
 * bf16 (round to nearest even) where torch's op would round it, so the results equal torch's
 * but for the order of the RMSNorm's sum of squares (a last-bit difference in rare values).
 * Every row is computed alone, the same bits whatever the batch. Rows: portable C, compiled
 * for AVX-512, AVX2 and the base ISA (target_clones: the CPU picks at load).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_api.h"
#include "_rows.h"

#define MAX_DIM 16384
#define MAX_HEAD 256
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

static inline uint16_t f32_to_bf16(float f) {
    /* round to nearest even, as torch's c10::BFloat16; NaN stays a (quiet) NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static inline float rnd(float f) { return bf16_to_f32(f32_to_bf16(f)); }   /* through bf16 */

static inline float get(const void *p, int bf16, Py_ssize_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void put(void *p, int bf16, Py_ssize_t i, float v) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* ------------------------------------------------------------------ RMSNorm */
/* out = w * (x * rsqrt(mean(x^2) + eps)); bf16: the normed row is rounded before the weight
 * multiplies it (transformers' LlamaRMSNorm). With `res`, x = x + res first, in place. */
static inline __attribute__((always_inline)) void norm_row_of(
        void *x, const void *res, const void *w, void *out, int dim, float eps, const int bf16) {
    float xf[MAX_DIM];
    for (int i = 0; i < dim; i++) {
        float v = get(x, bf16, i);
        if (res) {
            v += get(res, bf16, i);
            v = bf16 ? rnd(v) : v;
        }
        xf[i] = v;
    }
    if (res) {
        for (int i = 0; i < dim; i++)
            put(x, bf16, i, xf[i]);
    }
    float acc[16] = {0};
    int i = 0;
    for (; i + 16 <= dim; i += 16)
        for (int k = 0; k < 16; k++)
            acc[k] += xf[i + k] * xf[i + k];
    float ss = 0.f;
    for (; i < dim; i++)
        ss += xf[i] * xf[i];
    for (int k = 0; k < 16; k++)
        ss += acc[k];
    float r = 1.f / sqrtf(ss / (float)dim + eps);
    for (i = 0; i < dim; i++) {
        float y = xf[i] * r;
        if (bf16)
            y = rnd(y);
        put(out, bf16, i, get(w, bf16, i) * y);
    }
}

/* the dtype a constant of each call below: the loops vectorize */
CLONES static void norm_row(void *x, const void *res, const void *w, void *out, int dim,
                            float eps, int bf16) {
    if (bf16)
        norm_row_of(x, res, w, out, dim, eps, 1);
    else
        norm_row_of(x, res, w, out, dim, eps, 0);
}

static PyObject *rms_norm(PyObject *self, PyObject *args) {
    unsigned long long x, res, w, out;
    Py_ssize_t rows, x_stride, res_stride;
    int dim, bf16;
    float eps;
    if (!PyArg_ParseTuple(args, "KnKnKKnifp", &x, &x_stride, &res, &res_stride, &w, &out,
                          &rows, &dim, &eps, &bf16))
        return NULL;
    if (dim < 1 || dim > MAX_DIM || rows < 0) {
        PyErr_SetString(PyExc_ValueError, "rms_norm: bad shape");
        return NULL;
    }
    size_t es = bf16 ? 2 : 4;
    for (Py_ssize_t r = 0; r < rows; r++)
        norm_row((char *)x + r * x_stride * es,
                 res ? (const char *)res + r * res_stride * es : NULL, (const void *)w,
                 (char *)out + r * dim * es, dim, eps, bf16);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ RoPE */
/* heads of d values from x, each rotated in place: x * cos + rotate_half(x) * sin, where
 * rotate_half(x) = (-x2, x1); bf16: each product and the sum rounded (transformers' order).
 * Element i of each half in one iteration (both read before either is written: no
 * dependence between iterations), and bf16 a constant of each caller, so the loop
 * vectorizes: the per-element form ran 4x slower than torch's ops at a 2048-token chunk. */
static inline __attribute__((always_inline)) void rope_heads(void *x, const void *cos,
                                                             const void *sin, int heads,
                                                             int d, const int bf16) {
    const int half = d / 2;
    for (int h = 0; h < heads; h++) {
        const Py_ssize_t lo = (Py_ssize_t)h * d, hi = lo + half;
        for (int i = 0; i < half; i++) {
            float x1 = get(x, bf16, lo + i), x2 = get(x, bf16, hi + i);
            float a1 = x1 * get(cos, bf16, i), b1 = -x2 * get(sin, bf16, i);
            float a2 = x2 * get(cos, bf16, half + i), b2 = x1 * get(sin, bf16, half + i);
            if (bf16) {
                a1 = rnd(a1);
                b1 = rnd(b1);
                a2 = rnd(a2);
                b2 = rnd(b2);
            }
            put(x, bf16, lo + i, a1 + b1);
            put(x, bf16, hi + i, a2 + b2);
        }
    }
}

CLONES static void rope_row(void *x, const void *cos, const void *sin, int heads, int d,
                            int bf16) {
    if (bf16)
        rope_heads(x, cos, sin, heads, d, 1);
    else
        rope_heads(x, cos, sin, heads, d, 0);
}

static PyObject *rope(PyObject *self, PyObject *args) {
    unsigned long long x, cos, sin;
    Py_ssize_t rows, row_stride;
    int heads, d, bf16;
    if (!PyArg_ParseTuple(args, "KnKKniip", &x, &row_stride, &cos, &sin, &rows, &heads, &d,
                          &bf16))
        return NULL;
    if (d < 2 || d % 2 || d > MAX_DIM || heads < 0 || rows < 0) {
        PyErr_SetString(PyExc_ValueError, "rope: bad shape");
        return NULL;
    }
    size_t es = bf16 ? 2 : 4;
    for (Py_ssize_t r = 0; r < rows; r++)
        rope_row((char *)x + r * row_stride * es, (const char *)cos + r * d * es,
                 (const char *)sin + r * d * es, heads, d, bf16);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ K/V into the pool */
/* token t's K and V heads [kvh, d] (rows of k and v, `src_stride` values apart) go to page
 * slot slots[t] at offset offs[t] of the pool [n_slots, 2, kvh, ps, d] */
static int write_rows(char *pool, Py_ssize_t n_slots, int kvh, int ps, int d, int pool_bf16,
                      const char *k, const char *v, Py_ssize_t src_stride, const int64_t *sl,
                      const int64_t *of, Py_ssize_t tokens, int src_bf16) {
    for (Py_ssize_t t = 0; t < tokens; t++)
        if (sl[t] < 0 || sl[t] >= n_slots || of[t] < 0 || of[t] >= ps)
            return (int)t + 1;
    size_t pes = pool_bf16 ? 2 : 4, ses = src_bf16 ? 2 : 4;
    for (Py_ssize_t t = 0; t < tokens; t++)
        for (int kv = 0; kv < 2; kv++) {
            const char *src = (kv ? v : k) + t * src_stride * ses;
            for (int h = 0; h < kvh; h++) {
                char *dst = pool + ((((size_t)sl[t] * 2 + kv) * kvh + h) * ps + of[t]) * d * pes;
                const char *s = src + (size_t)h * d * ses;
                if (pool_bf16 == src_bf16)
                    memcpy(dst, s, d * pes);
                else
                    for (int i = 0; i < d; i++)
                        put(dst, pool_bf16, i, get(s, src_bf16, i));
            }
        }
    return 0;
}

static PyObject *write_kv(PyObject *self, PyObject *args) {
    unsigned long long pool, k, v, slots, offs;
    Py_ssize_t n_slots, tokens, src_stride;
    int kvh, ps, d, src_bf16, pool_bf16;
    if (!PyArg_ParseTuple(args, "KniiipKKnKKnp", &pool, &n_slots, &kvh, &ps, &d, &pool_bf16,
                          &k, &v, &src_stride, &slots, &offs, &tokens, &src_bf16))
        return NULL;
    const int64_t *sl = (const int64_t *)slots, *of = (const int64_t *)offs;
    const int bad = write_rows((char *)pool, n_slots, kvh, ps, d, pool_bf16, (const char *)k,
                               (const char *)v, src_stride, sl, of, tokens, src_bf16);
    if (bad) {
        PyErr_Format(PyExc_IndexError, "write_kv: slot %lld offset %lld out of range",
                     (long long)sl[bad - 1], (long long)of[bad - 1]);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ SiLU(gate) * up */
/* exp(x) for x <= 0 (Cephes' expf polynomial, the exponent's bits built directly; clamped
 * at -87, a normal float): plain C the compiler vectorizes */
static inline float exp_neg(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}

/* out[i] = silu(g[i]) * u[i]: e = exp(-|g|), silu(g) = g / (1 + e) for g >= 0, g e / (1 + e)
 * below (no overflow either side) */
CLONES
static void silu_mul_row(const float *g, const float *u, float *out, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        const float x = g[i], e = exp_neg(-fabsf(x));
        out[i] = (x >= 0.f ? x : x * e) / (1.f + e) * u[i];
    }
}

static PyObject *silu_mul(PyObject *self, PyObject *args) {
    unsigned long long g, u, out;
    Py_ssize_t rows, n, stride;
    if (!PyArg_ParseTuple(args, "KKKnnn", &g, &u, &out, &rows, &n, &stride))
        return NULL;
    for (Py_ssize_t r = 0; r < rows; r++)
        silu_mul_row((const float *)(uintptr_t)g + r * stride,
                     (const float *)(uintptr_t)u + r * stride, (float *)(uintptr_t)out + r * n,
                     n);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ page summaries */
/* A page's keys of one KV head, k [valid, d], as kernels/page_summary.py's summarize_pages
 * summarizes them: the channel-wise min and max (key values: its bits) and the mean (the
 * float32 sum over the tokens in order, divided by their count; torch adds blocks of 16
 * tokens and some head sizes in another order, so a mean may differ from its by float32
 * rounding), into out [3, d] in the keys' dtype. NaN propagates as in torch's amin / amax.
 * No tokens: +inf, -inf, 0. */
CLONES static void summarize_head(const void *k, int bf16, int valid, int d, void *out) {
    float mn[MAX_HEAD], mx[MAX_HEAD], sum[MAX_HEAD];
    for (int i = 0; i < d; i++) {
        mn[i] = INFINITY;
        mx[i] = -INFINITY;
        sum[i] = 0.f;
    }
    for (int t = 0; t < valid; t++)
        for (int i = 0; i < d; i++) {
            const float x = get(k, bf16, (Py_ssize_t)t * d + i);
            mn[i] = x < mn[i] || x != x ? x : mn[i];
            mx[i] = x > mx[i] || x != x ? x : mx[i];
            sum[i] += x;
        }
    const float n = (float)(valid > 0 ? valid : 1);
    for (int i = 0; i < d; i++) {
        put(out, bf16, i, mn[i]);
        put(out, bf16, d + i, mx[i]);
        put(out, bf16, 2 * d + i, sum[i] / n);
    }
}

/* the K half of pool slots slots[i] [n] (valid[i] tokens each) -> out [n, kvh, 3, d] */
static PyObject *summarize(PyObject *self, PyObject *args) {
    unsigned long long pool, slots, valid, out;
    Py_ssize_t n_slots, n;
    int kvh, ps, d, bf16;
    if (!PyArg_ParseTuple(args, "KniiipKKnK", &pool, &n_slots, &kvh, &ps, &d, &bf16, &slots,
                          &valid, &n, &out))
        return NULL;
    const int64_t *sl = (const int64_t *)slots, *va = (const int64_t *)valid;
    if (d < 1 || d > MAX_HEAD) {
        PyErr_Format(PyExc_ValueError, "summarize: head_dim %d (at most %d)", d, MAX_HEAD);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (sl[i] < 0 || sl[i] >= n_slots || va[i] < 0 || va[i] > ps) {
            PyErr_Format(PyExc_IndexError, "summarize: slot %lld with %lld tokens out of range",
                         (long long)sl[i], (long long)va[i]);
            return NULL;
        }
    const size_t es = bf16 ? 2 : 4;
    for (Py_ssize_t i = 0; i < n; i++)
        for (int h = 0; h < kvh; h++)
            summarize_head((const char *)pool + (((size_t)sl[i] * 2 * kvh + h) * ps) * d * es,
                           bf16, (int)va[i], d,
                           (char *)out + (((size_t)i * kvh + h) * 3) * d * es);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rms_norm", rms_norm, METH_VARARGS,
     "rms_norm(x, x_stride, res, res_stride, w, out, rows, dim, eps, bf16): addresses; "
     "res 0 for none (else x += res in place first); out contiguous [rows, dim]"},
    {"rope", rope, METH_VARARGS,
     "rope(x, row_stride, cos, sin, rows, heads, d, bf16): rotate the first `heads` heads of "
     "each row in place; cos/sin contiguous [rows, d]"},
    {"write_kv", write_kv, METH_VARARGS,
     "write_kv(pool, n_slots, kvh, ps, d, pool_bf16, k, v, src_stride, slots, offs, tokens, "
     "src_bf16): new tokens' K/V into the pool [n_slots, 2, kvh, ps, d]; slots/offs int64"},
    {"silu_mul", silu_mul, METH_VARARGS,
     "silu_mul(g, u, out, rows, n, stride): out [rows, n] = silu(g) * u, float32, g and u "
     "rows `stride` values apart"},
    {"summarize", summarize, METH_VARARGS,
     "summarize(pool, n_slots, kvh, ps, d, bf16, slots, valid, n, out): the K halves of n "
     "slots (valid tokens each; slots/valid int64) as page summaries, out [n, kvh, 3, d] in "
     "the pool's dtype"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_layerops", NULL, -1, methods};

/* for kernels/_layer.c: the ops without Python */
static layerops_api api = {norm_row, rope_row, write_rows, silu_mul_row};

PyMODINIT_FUNC PyInit__layerops(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && add_api(m, "api", "kernels._layerops.api", &api) < 0)
        Py_CLEAR(m);
    return m;
}
