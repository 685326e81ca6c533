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

#define SELECTED_ERROR_BYTES 160

typedef struct {    /* one sparse_decode_selected call of kernels/_decode.c (its docstring:
                     * the fields) */
    const float *q;
    const char *pool;
    int bf16, kvh, ps, d, g, simd, threads;
    Py_ssize_t batch, n_layer_slots, n_keys, id_stride, n_slots;
    const int64_t *indptr, *indices, *layer_slots, *starts, *selected_at, *page_ids;
    const int32_t *last_len;
    int64_t completed, key_base;
    float scale;
    float *out, *lse;
    char error[SELECTED_ERROR_BYTES];   /* what is wrong, where the call returns 1 */
} selected_args;

typedef struct {    /* "kernels._decode.api": check_table with the GIL (-1: a ValueError
                     * set), then decode_table over the checked table (0, or -1 no memory);
                     * decode_selected: the selection's table built, checked and attended (0,
                     * -1 no memory, 1 what is wrong in a->error) */
    int (*check_table)(const int64_t *rp, const int64_t *sl, const int32_t *ll,
                       Py_ssize_t rows, int ps, Py_ssize_t n_slots);
    int (*decode_table)(const float *q, const char *pool, int bf16, int kvh, int ps, int d,
                        int g, const int64_t *rp, const int64_t *sl, const int32_t *ll,
                        const uint8_t *first, Py_ssize_t rows, float scale, float *out,
                        float *lse, int carry, int simd, int threads);
    int (*decode_selected)(selected_args *a);
} decode_api;

typedef struct {    /* one select_pages call of kernels/_select.c (its docstring: the fields) */
    const float *q;                     /* [B, KVH, group, D] */
    const uint64_t *summ, *priors;      /* [B] summaries' addresses; priors' or NULL */
    const int64_t *n_pages, *head_budgets;  /* [B]; [2, KVH] or NULL */
    int bf16, quest, batch, kvh, g, d, simd, threads;
    int64_t k, sink, local, prior_pages;
    int64_t *indptr, *indices, *uindptr, *uindices, *upos;  /* outputs; upos or NULL */
    float *scores;                      /* or NULL */
} select_args;

typedef struct {    /* "kernels._select.api": the selection, returning (through nnz, unnz)
                     * its entries and union entries: 0, -1 no memory, 1 a shape not served */
    int (*select)(const select_args *a, int64_t *nnz, int64_t *unnz);
} select_api;

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
