/* What the kernels' C modules lend each other through capsules (a module's `api` object),
 * each layout written once, here: kernels/_layer.c composes a decode layer from _qmatmul's
 * matmul, _layerops' small ops and _decode's table attention; _select runs its tasks on
 * _decode's pool. The functions run without the GIL unless they say otherwise. */
#ifndef STRATA_KERNELS_API_H
#define STRATA_KERNELS_API_H

#include <Python.h>
#include <stdint.h>

typedef struct {    /* "kernels._qmatmul.api": qmm without its checks; 0, or -1 no memory */
    int (*qmm)(const float *x, Py_ssize_t m, Py_ssize_t k, const uint8_t *codes,
               const uint16_t *scale, const uint16_t *zero, Py_ssize_t n, int bits,
               float *out, int simd, int threads, int xbits);
} qmatmul_api;

typedef struct {    /* "kernels._layerops.api": one row each; write_rows: 0, or 1 + the first
                     * token whose slot or offset is out of range (nothing written) */
    void (*norm_row)(void *x, const void *res, const void *w, void *out, int dim, float eps,
                     int bf16);
    void (*rope_row)(void *x, const void *cos, const void *sin, int heads, int d, int bf16);
    int (*write_rows)(char *pool, Py_ssize_t n_slots, int kvh, int ps, int d, int pool_bf16,
                      const char *k, const char *v, Py_ssize_t src_stride, const int64_t *slots,
                      const int64_t *offs, Py_ssize_t tokens, int src_bf16);
    void (*silu_mul_row)(const float *g, const float *u, float *out, Py_ssize_t n);
} layerops_api;

typedef struct {    /* "kernels._decode.api": check_table with the GIL (-1: a ValueError
                     * set), then decode_table over the checked table (0, or -1 no memory) */
    int (*check_table)(const int64_t *rp, const int64_t *sl, const int32_t *ll,
                       Py_ssize_t rows, int ps, Py_ssize_t n_slots);
    int (*decode_table)(const float *q, const char *pool, int bf16, int kvh, int ps, int d,
                        int g, const int64_t *rp, const int64_t *sl, const int32_t *ll,
                        const uint8_t *first, Py_ssize_t rows, float scale, float *out,
                        float *lse, int carry, int simd, int threads);
} decode_api;

typedef struct {    /* "kernels._decode.pool_api": run fn(args[i]) for i < n on the pool */
    void (*run)(void (*fn)(void *), void **args, int n);
} pool_api;

/* module m's attribute `attr`, a capsule named `name` of `api`; -1 (an error set) or 0 */
static inline int add_api(PyObject *m, const char *attr, const char *name, void *api) {
    PyObject *cap = PyCapsule_New(api, name, NULL);
    if (!cap || PyModule_AddObject(m, attr, cap) < 0) {
        Py_XDECREF(cap);
        return -1;
    }
    return 0;
}

/* the capsule `name` of module `module`, imported first (PyCapsule_Import finds a
 * submodule only as an attribute of its package); NULL with an error set */
static inline const void *import_api(const char *module, const char *name) {
    PyObject *mod = PyImport_ImportModule(module);
    const void *api = mod ? PyCapsule_Import(name, 0) : NULL;
    Py_XDECREF(mod);            /* (sys.modules keeps it) */
    return api;
}

#endif
