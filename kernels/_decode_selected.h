/* sparse_decode over a page selection as kernels/_select.c lists it, for the resident decode
 * path (kvstore/resident.py): the per-(sequence, KV head) table, the pages the last step
 * selected too (attended first), and the rows, in one call where Python built the table in
 * ~25 small torch ops a layer. Included by _decode.c only (its check_shape, check_table and
 * decode_table).
 *
 * Row r = b * KVH + h lists the pages indices[indptr[r]:indptr[r + 1]] (page numbers within
 * sequence b, ascending); entry e's slot is layer_slots[starts[b] + indices[e]], and it goes
 * first where selected_at[key_base + page_ids[b * id_stride + indices[e]]] == completed (the
 * last completed step selected its page too) or it is the row's last entry (the partial
 * page): the table and `first` that kvstore/step_attention.py's split attention builds, so
 * the same bits. */
#ifndef STRATA_KERNELS_DECODE_SELECTED_H
#define STRATA_KERNELS_DECODE_SELECTED_H

#include <stdlib.h>

#define SPARSE_DECODE_SELECTED_DOC                                                          \
    "sparse_decode_selected(q, pool, bf16, kvh, page_size, head_dim, group, batch, indptr, " \
    "indices, layer_slots, n_layer_slots, starts, last_len, selected_at, n_keys, completed, " \
    "key_base, page_ids, id_stride, scale, out, lse, n_slots, simd, threads): addresses of "  \
    "contiguous buffers (q/out float32 [batch * KVH, group, D], lse float32; indptr int64 "  \
    "[batch * KVH + 1], indices int64, layer_slots int64 [n_layer_slots], starts int64 "    \
    "[batch], last_len int32 [batch], selected_at int64 [n_keys], page_ids int64 [batch, "   \
    "id_stride]); ValueError where an entry falls outside them or the pool; without the GIL"

static PyObject *sparse_decode_selected(PyObject *self, PyObject *args) {
    unsigned long long q, pool, indptr, indices, layer_slots, starts, last, sel_at, page_ids,
        out, lse;
    int bf16, kvh, ps, d, g, simd = 2, threads = 1;
    Py_ssize_t batch, n_layer_slots, n_keys, id_stride, n_slots;
    long long completed, key_base;
    float scale;
    if (!PyArg_ParseTuple(args, "KKiiiiinKKKnKKKnLLKnfKKnii", &q, &pool, &bf16, &kvh, &ps, &d,
                          &g, &batch, &indptr, &indices, &layer_slots, &n_layer_slots, &starts,
                          &last, &sel_at, &n_keys, &completed, &key_base, &page_ids,
                          &id_stride, &scale, &out, &lse, &n_slots, &simd, &threads))
        return NULL;
    if (check_shape(d, g, ps, kvh) < 0)
        return NULL;
    if (batch < 0) {
        PyErr_Format(PyExc_ValueError, "%zd sequences", batch);
        return NULL;
    }
    const Py_ssize_t rows = batch * kvh;
    const int64_t *rp = (const int64_t *)(uintptr_t)indptr;
    const int64_t *ix = (const int64_t *)(uintptr_t)indices;
    const int64_t *ls = (const int64_t *)(uintptr_t)layer_slots;
    const int64_t *st = (const int64_t *)(uintptr_t)starts;
    const int32_t *lb = (const int32_t *)(uintptr_t)last;
    const int64_t *sa = (const int64_t *)(uintptr_t)sel_at;
    const int64_t *pid = (const int64_t *)(uintptr_t)page_ids;
    for (Py_ssize_t r = 0; r < rows; r++)
        if (rp[r + 1] < rp[r]) {
            PyErr_SetString(PyExc_ValueError, "selection rows out of order (indptr falls)");
            return NULL;
        }
    if (rp[0] != 0) {
        PyErr_SetString(PyExc_ValueError, "selection rows start at entry 0 (indptr[0])");
        return NULL;
    }
    const int64_t nnz = rp[rows];
    /* the table: slots [nnz], first [nnz], last lengths [rows] */
    int64_t *sl = malloc(sizeof(int64_t) * (size_t)(nnz + 1) + (size_t)nnz +
                         sizeof(int32_t) * (size_t)(rows + 1));
    if (sl == NULL)
        return PyErr_NoMemory();
    int32_t *ll = (int32_t *)(sl + nnz + 1);
    uint8_t *first = (uint8_t *)(ll + rows + 1);
    const char *bad = NULL;
    for (Py_ssize_t r = 0; r < rows && !bad; r++) {
        const Py_ssize_t b = r / kvh;
        ll[r] = lb[b];
        for (int64_t e = rp[r]; e < rp[r + 1]; e++) {
            const int64_t p = ix[e], at = st[b] + p;
            if (p < 0 || p >= id_stride || at < 0 || at >= n_layer_slots) {
                bad = "a selected page outside its sequence";
                break;
            }
            const int64_t key = key_base + pid[b * id_stride + p];
            if (key < 0 || key >= n_keys) {
                bad = "a selected page's key outside the selection's marks";
                break;
            }
            sl[e] = ls[at];
            first[e] = sa[key] == completed || e == rp[r + 1] - 1;
        }
    }
    PyObject *res = NULL;
    if (bad)
        PyErr_SetString(PyExc_ValueError, bad);
    else if (check_table(rp, sl, ll, rows, ps, n_slots) == 0) {
        int failed;
        Py_BEGIN_ALLOW_THREADS
        failed = decode_table((const float *)(uintptr_t)q, (const char *)(uintptr_t)pool, bf16,
                              kvh, ps, d, g, rp, sl, ll, first, rows, scale,
                              (float *)(uintptr_t)out, (float *)(uintptr_t)lse, 0, simd,
                              threads);
        Py_END_ALLOW_THREADS
        res = failed ? PyErr_NoMemory() : Py_NewRef(Py_None);
    }
    free(sl);
    return res;
}

#endif
