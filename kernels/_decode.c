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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
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

/* one clone per instruction set, picked at load time; the helpers inline into each */
__attribute__((target_clones("avx512f", "avx2", "default")))
static void attend_row(const float *q, const char *pool, int bf16, int64_t slot_bytes,
                       int64_t head_bytes, int64_t v_bytes, const int64_t *slots, int64_t n,
                       int last, int ps, int d, int g, float scale, float *out, float *lse,
                       int carry) {
    float m[MAX_G], l[MAX_G], s[MAX_PS * MAX_G], row[MAX_D];
    const int64_t tok_bytes = (int64_t)d * (bf16 ? 2 : 4);
    if (carry) {
        /* out normalized over the first half: the state (max lse, sum 1, acc out) */
        for (int j = 0; j < g; j++) {
            m[j] = lse[j];
            l[j] = isinf(lse[j]) ? 0.f : 1.f;
        }
    } else {
        for (int j = 0; j < g; j++) {
            m[j] = -INFINITY;
            l[j] = 0.f;
        }
        memset(out, 0, sizeof(float) * (size_t)g * d);
    }
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
    for (int j = 0; j < g; j++) {
        if (l[j] > 0.f) {
            scale_vec(out + j * d, 1.f / l[j], d);
            lse[j] = m[j] + logf(l[j]);
        } else {
            lse[j] = -INFINITY;
        }
    }
}

static PyObject *sparse_decode(PyObject *self, PyObject *args) {
    unsigned long long q, pool, row_ptr, slots, last, out, lse;
    int bf16, kvh, ps, d, g, carry;
    Py_ssize_t rows;
    float scale;
    if (!PyArg_ParseTuple(args, "KKiiiiiKKKnfKKp", &q, &pool, &bf16, &kvh, &ps, &d, &g, &row_ptr,
                          &slots, &last, &rows, &scale, &out, &lse, &carry))
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
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < rows; r++)
        attend_row((const float *)(uintptr_t)q + r * g * d, (const char *)(uintptr_t)pool, bf16,
                   slot_bytes, (r % kvh) * head_bytes, v_bytes, sl + rp[r], rp[r + 1] - rp[r],
                   ll[r], ps, d, g, scale, (float *)(uintptr_t)out + r * g * d,
                   (float *)(uintptr_t)lse + r * g, carry);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"sparse_decode", sparse_decode, METH_VARARGS,
     "sparse_decode(q, pool, bf16, kvh, page_size, head_dim, group, row_ptr, slots, last_len, "
     "rows, scale, out, lse, carry): addresses of contiguous buffers (q/out float32 [rows, "
     "group, D], row_ptr/slots int64, last_len int32, lse float32 [rows, group]; with carry, "
     "out/lse hold a first half's result to go on from); without the GIL"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_decode", NULL, -1, methods};

PyMODINIT_FUNC PyInit__decode(void) { return PyModule_Create(&module); }
