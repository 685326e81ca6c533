/* A decoder layer's decode step in one call (kernels/decode_layer.py): the Llama layer of
 * engine/llama.py over B rows of one new token each, float32 activations, weights in our 4-
 * or 8-bit formats, the KV store's resident table:
 *
 *   xn = norm1(x); qkv = xn @ Wqkv; [Qwen3: norm each q and k head]; RoPE(q, k) [not in
 *   SmolLM3's NoPE layers]; K/V into the pool; a = attention(q);
 *   h = x + a @ Wo; y = silu(g) * u for [g|u] = norm2(h) @ Wgu; x = h + y @ Wdown
 *
 * A step's ~15 torch and C calls a layer, each with its Python around it, were most of a
 * decode step's time on a slow core (~10 of 24 ms at 1K tokens on an AMD EPYC without
 * AVX-512). The ops are the other modules' own (the matmul of _qmatmul.c, the norm, RoPE and
 * K/V write of _layerops.c, the table attention of _decode.c: reached through their `api`
 * capsules), so the bits are the model's layers' own where they run those ops.
 *
 * LoRA adapters (S_LORA: kernels/decode_layer.py's LoraWords): after each of the four
 * matmuls, each adapter row's s (x A^T) B^T is added, as engine/lora.py adds it op by op.
 *
 * Sparse layers (S_SPARSE: kernels/decode_layer.py's SparseWords) select their pages (the
 * selection of _select.c) and attend to them (_decode.c's selected attention) in the same
 * call, their results (entries, union entries, nanoseconds selecting and attending) written
 * to the sparse table's results for the KV store to settle after the layer.
 *
 * The plan is int64 tables built in Python: the step's (STEP_* words), the model's
 * (LAYER_WORDS a layer) and the sparse layers'. Runs without the GIL but for the table's
 * check. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "_api.h"

enum {      /* the step's words (kernels/decode_layer.py writes them) */
    S_ROWS, S_HIDDEN, S_HEADS, S_KV_HEADS, S_HEAD_DIM, S_INTER, S_PAGE, S_POOL_BF16,
    S_N_SLOTS, S_ATTN_SIMD, S_THREADS, S_X, S_COS, S_SIN, S_POOL, S_TOK_OFF, S_INDPTR,
    S_LAST, S_SCRATCH, S_QMM_SIMD, S_LAYERS, S_ENTRIES, S_TOK_SLOTS, S_HEAD_SLOTS,
    S_ATTN_THREADS, S_SPARSE, S_LORA, STEP_WORDS
};
enum {      /* the sparse table's header (SparseWords): the selection's, the attention's */
    P_PRIORS, P_SUMM_BF16, P_QUEST, P_SINK, P_LOCAL, P_SEL_SIMD, P_SEL_THREADS, P_OFF_INDICES,
    P_OFF_UINDPTR, P_OFF_UINDICES, P_OFF_UPOS, P_N_LAYER_SLOTS, P_STARTS, P_LAST, P_MARKS,
    P_N_KEYS, P_COMPLETED, P_PAGE_IDS, P_ID_STRIDE, P_DEC_SIMD, P_DEC_THREADS, P_RESULTS,
    SPARSE_HEADER
};
enum {      /* then a row a layer (R_SPARSE 0: the layer attends to the step's table) */
    R_SPARSE, R_INS, R_OUT, R_BUDGET, R_PRIOR_PAGES, R_HEADS, R_SLOTS, R_KEY_BASE, SPARSE_ROW
};
enum { RES_NNZ, RES_UNNZ, RES_SELECT_NS, RES_ATTEND_NS, RESULT_WORDS };
enum {      /* a layer's words: the two norms' weights, the q and k heads' norms' (Qwen3; 0:
             * none), whether it rotates q and k (0: SmolLM3's NoPE layers), then 5 a matmul
             * (qkv, o, gate_up, down) */
    L_NORM1, L_NORM2, L_QNORM, L_KNORM, L_ROPE, L_W, LAYER_WORDS = L_W + 4 * 5
};
enum { W_CODES, W_SCALE, W_ZERO, W_BITS, W_XBITS };
enum {      /* the step's LoRA table (S_LORA, 0: none; kernels/decode_layer.py's LoraWords):
             * how many adapters, each row's adapter (int64 [B], -1: the base model), the
             * adapters' tables (int64 [adapters] addresses) */
    LR_ADAPTERS, LR_ROW_ADAPTER, LR_TABLES, LORA_HEADER
};
enum {      /* an adapter's table, int64 [layers, 4, LORA_ENTRY] (decode_layer.lora_table): per
             * layer and matmul (qkv, o, gate_up, down) A^T [in, r] and B^T [r, out] (its
             * scale folded in) float32, and r (0: the matmul is not adapted) */
    LA_AT, LA_BT, LA_RANK, LORA_ENTRY
};
#define MAX_LORA_RANK 256
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

static const qmatmul_api *mm_api;
static const layerops_api *ops_api;
static const decode_api *attn_api;
static const select_api *sel_api;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* The scratch (S_SCRATCH, float32; kernels/decode_layer.py sizes it and views q in it):
 * xn [B, hidden], q|k|v [B, (H + 2 KVH) D], q [B, H, D], the attention's output a [B, H, D]
 * and its log-sum-exp [B, H]; after the attention, xn, gate|up [B, 2 I], act [B, I] and the
 * down projection [B, hidden] from its start. Where q starts: */
static float *scratch_q(const int64_t *st) {
    return (float *)(uintptr_t)st[S_SCRATCH] +
           st[S_ROWS] * (st[S_HIDDEN] + (st[S_HEADS] + 2 * st[S_KV_HEADS]) * st[S_HEAD_DIM]);
}

/* x [B, k] @ layer weight `w` (its 5 words) -> out [B, n]: 0, or -1 out of memory */
static int matmul(const int64_t *w, const float *x, Py_ssize_t b, Py_ssize_t k, Py_ssize_t n,
                  float *out, const int64_t *st) {
    return mm_api->qmm(x, b, k, (const uint8_t *)(uintptr_t)w[W_CODES],
                       (const uint16_t *)(uintptr_t)w[W_SCALE],
                       (const uint16_t *)(uintptr_t)w[W_ZERO], n, (int)w[W_BITS], out,
                       (int)st[S_QMM_SIMD], (int)st[S_THREADS], (int)w[W_XBITS]);
}

/* each q and k head of a row of q|k|v normed in place (Qwen3's q_norm, k_norm) */
static void norm_heads(float *row, const int64_t *lw, int nh, int kvh, Py_ssize_t d,
                       float eps) {
    const void *qn = (const void *)(uintptr_t)lw[L_QNORM];
    const void *kn = (const void *)(uintptr_t)lw[L_KNORM];
    for (int h = 0; h < nh; h++)
        ops_api->norm_row(row + h * d, NULL, qn, row + h * d, (int)d, eps, 0);
    for (int h = nh; h < nh + kvh; h++)
        ops_api->norm_row(row + h * d, NULL, kn, row + h * d, (int)d, eps, 0);
}

/* y [n] += (x [k] A^T) B^T: both as rows of axpy, so the CPU's widest vectors serve */
CLONES static void lora_row(const float *x, Py_ssize_t k, Py_ssize_t n, const float *at,
                            const float *bt, int r, float *y) {
    float t[MAX_LORA_RANK];
    for (int j = 0; j < r; j++)
        t[j] = 0.f;
    for (Py_ssize_t i = 0; i < k; i++) {
        const float xi = x[i], *a = at + i * r;
        for (int j = 0; j < r; j++)
            t[j] += xi * a[j];
    }
    for (int j = 0; j < r; j++) {
        const float tj = t[j], *b = bt + j * n;
        for (Py_ssize_t i = 0; i < n; i++)
            y[i] += tj * b[i];
    }
}

/* matmul m (0 qkv, 1 o, 2 gate_up, 3 down) of layer `layer`, y [B, n] = x [B, k] @ W: each
 * adapter row's delta added (engine/lora.py's, in the model's layers op by op) */
static void lora_add(const int64_t *st, int layer, int m, const float *x, Py_ssize_t k,
                     Py_ssize_t n, float *y) {
    const int64_t *lt = (const int64_t *)(uintptr_t)st[S_LORA];
    if (!lt)
        return;
    const int64_t *row_adapter = (const int64_t *)(uintptr_t)lt[LR_ROW_ADAPTER];
    const int64_t *tables = (const int64_t *)(uintptr_t)lt[LR_TABLES];
    for (Py_ssize_t r = 0; r < st[S_ROWS]; r++) {
        const int64_t a = row_adapter[r];
        if (a < 0 || a >= lt[LR_ADAPTERS])
            continue;
        const int64_t *e = (const int64_t *)(uintptr_t)tables[a] +
                           ((int64_t)layer * 4 + m) * LORA_ENTRY;
        if (e[LA_RANK] > 0)
            lora_row(x + r * k, k, n, (const float *)(uintptr_t)e[LA_AT],
                     (const float *)(uintptr_t)e[LA_BT], (int)e[LA_RANK], y + r * n);
    }
}

/* whether the LoRA table's ranks for layer `layer` are ones lora_row serves */
static int lora_ranks_ok(const int64_t *st, int layer) {
    const int64_t *lt = (const int64_t *)(uintptr_t)st[S_LORA];
    if (!lt)
        return 1;
    const int64_t *tables = (const int64_t *)(uintptr_t)lt[LR_TABLES];
    for (int64_t a = 0; a < lt[LR_ADAPTERS]; a++) {
        const int64_t *e = (const int64_t *)(uintptr_t)tables[a] +
                           (int64_t)layer * 4 * LORA_ENTRY;
        for (int m = 0; m < 4; m++)
            if (e[m * LORA_ENTRY + LA_RANK] < 0 || e[m * LORA_ENTRY + LA_RANK] > MAX_LORA_RANK)
                return 0;
    }
    return 1;
}

/* the attention's inputs: xn = norm1(x), qkv = xn @ Wqkv, the heads' norms (Qwen3), RoPE, q
 * to its own rows [B, H, D] (scratch), K/V into the pool; 0, -1 out of memory, or 1 + the
 * token whose K/V slot is out of range (nothing written) */
static int attention_inputs(const int64_t *st, const int64_t *lw, int layer, float eps) {
    const Py_ssize_t b = st[S_ROWS], hid = st[S_HIDDEN], d = st[S_HEAD_DIM];
    const int nh = (int)st[S_HEADS], kvh = (int)st[S_KV_HEADS];
    const Py_ssize_t nq = (Py_ssize_t)nh * d, nqkv = nq + 2 * (Py_ssize_t)kvh * d;
    float *x = (float *)(uintptr_t)st[S_X], *xn = (float *)(uintptr_t)st[S_SCRATCH];
    float *qkv = xn + b * hid, *q = scratch_q(st);
    for (Py_ssize_t r = 0; r < b; r++)
        ops_api->norm_row(x + r * hid, NULL, (const void *)(uintptr_t)lw[L_NORM1], xn + r * hid,
                          (int)hid, eps, 0);
    if (matmul(lw + L_W, xn, b, hid, nqkv, qkv, st))
        return -1;
    lora_add(st, layer, 0, xn, hid, nqkv, qkv);
    const float *cs = (const float *)(uintptr_t)st[S_COS];
    const float *sn = (const float *)(uintptr_t)st[S_SIN];
    for (Py_ssize_t r = 0; r < b; r++) {
        if (lw[L_QNORM])
            norm_heads(qkv + r * nqkv, lw, nh, kvh, d, eps);
        if (lw[L_ROPE])
            ops_api->rope_row(qkv + r * nqkv, cs + r * d, sn + r * d, nh + kvh, (int)d, 0);
        memcpy(q + r * nq, qkv + r * nqkv, sizeof(float) * nq);
    }
    const int64_t *tok = (const int64_t *)(uintptr_t)st[S_TOK_SLOTS] + (int64_t)layer * b;
    return ops_api->write_rows(
        (char *)(uintptr_t)st[S_POOL], st[S_N_SLOTS], kvh, (int)st[S_PAGE], (int)d,
        (int)st[S_POOL_BF16], (const char *)(qkv + nq), (const char *)(qkv + nq + kvh * d),
        nqkv, tok, (const int64_t *)(uintptr_t)st[S_TOK_OFF], b, 0);
}

/* the attention over the step's table, q -> a (scratch, after q): 0 or -1 out of memory */
static int table_attention(const int64_t *st, int layer, float scale, double *attn_s) {
    const Py_ssize_t b = st[S_ROWS], d = st[S_HEAD_DIM];
    const int nh = (int)st[S_HEADS], kvh = (int)st[S_KV_HEADS];
    const Py_ssize_t nq = (Py_ssize_t)nh * d;
    float *q = scratch_q(st), *a = q + b * nq;
    const double t0 = now();
    const int64_t *slots = (const int64_t *)(uintptr_t)st[S_HEAD_SLOTS] +
                           (int64_t)layer * st[S_ENTRIES];
    if (attn_api->decode_table(q, (const char *)(uintptr_t)st[S_POOL], (int)st[S_POOL_BF16], kvh,
                               (int)st[S_PAGE], (int)d, nh / kvh,
                               (const int64_t *)(uintptr_t)st[S_INDPTR], slots,
                               (const int32_t *)(uintptr_t)st[S_LAST], NULL, b * kvh, scale, a,
                               a + b * nq, 0, (int)st[S_ATTN_SIMD], (int)st[S_ATTN_THREADS]))
        return -1;
    *attn_s = now() - t0;
    return 0;
}

/* a sparse layer's row of the sparse table, or NULL where the layer attends to the table */
static const int64_t *sparse_row(const int64_t *st, int layer) {
    const int64_t *sp = (const int64_t *)(uintptr_t)st[S_SPARSE];
    const int64_t *row = sp ? sp + SPARSE_HEADER + (int64_t)layer * SPARSE_ROW : NULL;
    return row && row[R_SPARSE] ? row : NULL;
}

/* a sparse layer's attention, q -> a (scratch, after q): its pages selected, then attended;
 * 0, -1 out of memory, or 1 with what is wrong in `err` */
static int sparse_attention(const int64_t *st, const int64_t *row, int layer, float scale,
                            char *err, size_t cap) {
    const int64_t *sp = (const int64_t *)(uintptr_t)st[S_SPARSE];
    const int b = (int)st[S_ROWS], nh = (int)st[S_HEADS], kvh = (int)st[S_KV_HEADS];
    const int d = (int)st[S_HEAD_DIM];
    float *q = scratch_q(st), *a = q + (int64_t)b * nh * d;
    const int64_t *ins = (const int64_t *)(uintptr_t)row[R_INS];
    int64_t *out = (int64_t *)(uintptr_t)row[R_OUT];
    int64_t *res = (int64_t *)(uintptr_t)sp[P_RESULTS] + (int64_t)layer * RESULT_WORDS;
    select_args s = {q, (const uint64_t *)ins, sp[P_PRIORS] ? (const uint64_t *)(ins + 2 * b)
                                                            : NULL,
                     ins + b, (const int64_t *)(uintptr_t)row[R_HEADS], (int)sp[P_SUMM_BF16],
                     (int)sp[P_QUEST], b, kvh, nh / kvh, d, (int)sp[P_SEL_SIMD],
                     (int)sp[P_SEL_THREADS], row[R_BUDGET], sp[P_SINK], sp[P_LOCAL],
                     row[R_PRIOR_PAGES], out, out + sp[P_OFF_INDICES], out + sp[P_OFF_UINDPTR],
                     out + sp[P_OFF_UINDICES], out + sp[P_OFF_UPOS], NULL};
    const double t0 = now();
    int rc = sel_api->select(&s, &res[RES_NNZ], &res[RES_UNNZ]);
    if (rc) {
        snprintf(err, cap, "the selection does not serve this shape");
        return rc;
    }
    const double t1 = now();
    selected_args t = {
        .q = q, .pool = (const char *)(uintptr_t)st[S_POOL], .bf16 = (int)st[S_POOL_BF16],
        .kvh = kvh, .ps = (int)st[S_PAGE], .d = d, .g = nh / kvh, .simd = (int)sp[P_DEC_SIMD],
        .threads = (int)sp[P_DEC_THREADS], .batch = b, .n_layer_slots = sp[P_N_LAYER_SLOTS],
        .n_keys = sp[P_N_KEYS], .id_stride = sp[P_ID_STRIDE], .n_slots = st[S_N_SLOTS],
        .indptr = out, .indices = out + sp[P_OFF_INDICES],
        .layer_slots = (const int64_t *)(uintptr_t)row[R_SLOTS],
        .starts = (const int64_t *)(uintptr_t)sp[P_STARTS],
        .selected_at = (const int64_t *)(uintptr_t)sp[P_MARKS],
        .page_ids = (const int64_t *)(uintptr_t)sp[P_PAGE_IDS],
        .last_len = (const int32_t *)(uintptr_t)sp[P_LAST], .completed = sp[P_COMPLETED],
        .key_base = row[R_KEY_BASE], .scale = scale, .out = a, .lse = a + (int64_t)b * nh * d};
    rc = attn_api->decode_selected(&t);
    if (rc > 0)
        snprintf(err, cap, "%s", t.error);
    res[RES_SELECT_NS] = (int64_t)(1e9 * (t1 - t0));
    res[RES_ATTEND_NS] = (int64_t)(1e9 * (now() - t1));
    return rc;
}

/* the rest: h = a @ Wo (a: the attention's output [B, H * D]), h += x, [g|u] = norm2(h) @
 * Wgu, x = h + (silu(g) * u) @ Wdown; 0 or -1 out of memory */
static int output_and_mlp(const int64_t *st, const int64_t *lw, int layer, float eps,
                          const float *a, float *h) {
    const Py_ssize_t b = st[S_ROWS], hid = st[S_HIDDEN], inter = st[S_INTER];
    const Py_ssize_t nq = st[S_HEADS] * st[S_HEAD_DIM];
    float *x = (float *)(uintptr_t)st[S_X], *xn = (float *)(uintptr_t)st[S_SCRATCH];
    float *gu = xn + b * hid, *act = gu + b * 2 * inter, *y = act + b * inter;
    if (matmul(lw + L_W + 5, a, b, nq, hid, h, st))
        return -1;
    lora_add(st, layer, 1, a, nq, hid, h);
    for (Py_ssize_t r = 0; r < b; r++)
        ops_api->norm_row(h + r * hid, x + r * hid, (const void *)(uintptr_t)lw[L_NORM2],
                          xn + r * hid, (int)hid, eps, 0);
    if (matmul(lw + L_W + 10, xn, b, hid, 2 * inter, gu, st))
        return -1;
    lora_add(st, layer, 2, xn, hid, 2 * inter, gu);
    for (Py_ssize_t r = 0; r < b; r++)
        ops_api->silu_mul_row(gu + r * 2 * inter, gu + r * 2 * inter + inter, act + r * inter,
                              inter);
    if (matmul(lw + L_W + 15, act, b, inter, hid, y, st))
        return -1;
    lora_add(st, layer, 3, act, inter, hid, y);
    for (Py_ssize_t i = 0; i < b * hid; i++)
        x[i] = h[i] + y[i];
    return 0;
}

/* part 0: the whole layer over the step's table; 1: the attention's inputs (q left in the
 * scratch for the caller's attention); 2: the rest, from the attention's output at `a` */
static PyObject *decode_layer(PyObject *self, PyObject *args) {
    unsigned long long step_addr, layers_addr, h_addr, a_addr = 0;
    int layer, part = 0;
    float eps, scale;
    if (!PyArg_ParseTuple(args, "KKKiff|iK", &step_addr, &layers_addr, &h_addr, &layer, &eps,
                          &scale, &part, &a_addr))
        return NULL;
    const int64_t *st = (const int64_t *)(uintptr_t)step_addr;
    if (layer < 0 || layer >= st[S_LAYERS] || part < 0 || part > 2 || (part == 2 && !a_addr)) {
        PyErr_Format(PyExc_ValueError, "decode_layer: layer %d of %lld, part %d", layer,
                     (long long)st[S_LAYERS], part);
        return NULL;
    }
    if (!lora_ranks_ok(st, layer)) {
        PyErr_Format(PyExc_ValueError, "decode_layer: layer %d's LoRA rank over %d", layer,
                     MAX_LORA_RANK);
        return NULL;
    }
    const Py_ssize_t rows = st[S_ROWS] * st[S_KV_HEADS];
    const int64_t *sparse = part == 0 ? sparse_row(st, layer) : NULL;
    if (part == 0 && !sparse && attn_api->check_table(
            (const int64_t *)(uintptr_t)st[S_INDPTR],
            (const int64_t *)(uintptr_t)st[S_HEAD_SLOTS] + (int64_t)layer * st[S_ENTRIES],
            (const int32_t *)(uintptr_t)st[S_LAST], rows, (int)st[S_PAGE], st[S_N_SLOTS]) < 0)
        return NULL;
    const int64_t *lw = (const int64_t *)(uintptr_t)layers_addr + (int64_t)layer * LAYER_WORDS;
    const float *a = part == 2 ? (const float *)(uintptr_t)a_addr
                               : scratch_q(st) + st[S_ROWS] * st[S_HEADS] * st[S_HEAD_DIM];
    double attn_s = 0.;
    char err[SELECTED_ERROR_BYTES] = "";
    int res = 0, attn_res = 0;
    Py_BEGIN_ALLOW_THREADS
    if (part < 2)
        res = attention_inputs(st, lw, layer, eps);
    if (res == 0 && part == 0)
        attn_res = sparse ? sparse_attention(st, sparse, layer, scale, err, sizeof err)
                          : table_attention(st, layer, scale, &attn_s);
    if (res == 0 && attn_res == 0 && part != 1)
        res = output_and_mlp(st, lw, layer, eps, a, (float *)(uintptr_t)h_addr);
    Py_END_ALLOW_THREADS
    if (res < 0 || attn_res < 0)
        return PyErr_NoMemory();
    if (res > 0)
        return PyErr_Format(PyExc_IndexError, "decode_layer: token %d's K/V slot or offset "
                            "out of range", res - 1);
    if (attn_res > 0)
        return PyErr_Format(PyExc_ValueError, "decode_layer: layer %d's selection: %s", layer,
                            err);
    return PyFloat_FromDouble(attn_s);
}

static PyMethodDef methods[] = {
    {"decode_layer", decode_layer, METH_VARARGS,
     "decode_layer(step, layers, h, layer, eps, scale[, part, a]): layer `layer` of a decode "
     "step in place on the step's x (addresses of kernels/decode_layer.py's tables; h: float32 "
     "[rows, hidden] scratch); part 0 the whole layer (a sparse layer's selection too), 1 up "
     "to the attention (its q in the scratch), 2 from the attention's output at address a "
     "(float32 [rows, heads * head_dim]); returns the table attention's seconds (a sparse "
     "layer's times go to the sparse table's results)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_layer", NULL, -1, methods};

PyMODINIT_FUNC PyInit__layer(void) {
    mm_api = import_api("kernels._qmatmul", "kernels._qmatmul.api");
    ops_api = mm_api ? import_api("kernels._layerops", "kernels._layerops.api") : NULL;
    attn_api = ops_api ? import_api("kernels._decode", "kernels._decode.api") : NULL;
    sel_api = attn_api ? import_api("kernels._select", "kernels._select.api") : NULL;
    if (!sel_api)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "STEP_WORDS", STEP_WORDS) < 0 ||
              PyModule_AddIntConstant(m, "LAYER_WORDS", LAYER_WORDS) < 0 ||
              PyModule_AddIntConstant(m, "SPARSE_HEADER", SPARSE_HEADER) < 0 ||
              PyModule_AddIntConstant(m, "SPARSE_ROW", SPARSE_ROW) < 0 ||
              PyModule_AddIntConstant(m, "RESULT_WORDS", RESULT_WORDS) < 0 ||
              PyModule_AddIntConstant(m, "LORA_HEADER", LORA_HEADER) < 0 ||
              PyModule_AddIntConstant(m, "LORA_ENTRY", LORA_ENTRY) < 0 ||
              PyModule_AddIntConstant(m, "MAX_LORA_RANK", MAX_LORA_RANK) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
