/* The device tier's eviction pass in C, without the GIL (kvstore/native_evict.py): victims by
 * the residency policy, their demotion to the host tier (host admission by the host's policy,
 * which evicts for them) and the slot-map updates of both tiers, in one call.
 *
 * It is Fetcher._evictable + residency.victims + Fetcher.evict_device(defer=True) of
 * kvstore/fetcher.py and kvstore/residency.py (the reference, and the path for other policies),
 * for the stock policies: cycle, lru and score. In torch that pass is ~60 small ops over the
 * device's and the host's slots (~1.4 ms, bench/evict_pass.py) on the pipeline's resolve thread, each
 * taking the GIL back from the engine thread's decode; here it is one call.
 *
 * Scores, larger evicted first (ties in no particular order):
 *   lru:   -last_used
 *   cycle: last_used <= now - period ? STALE + (now - last_used) : last_used
 *   score: cycle's over the stamp without its WEAK_FLAG; a live page with the flag adds WEAK,
 *          and on the device tier a live page the host holds too adds CHEAP
 * Host admission of demoted pages (incoming, last used at `used`):
 *   cycle, score: the `excess` worst of residents and incoming stay out (residents the device holds
 *          too rank below every other live one, SPARE less); admitted pages keep `used`
 *   lru:   every page is admitted, stamped `now`; the residents the device holds too go first
 *          (in slot order), then the least recently used.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define STALE ((int64_t)1 << 61)
#define SPARE ((int64_t)1 << 60)
#define WEAK_FLAG ((int64_t)1 << 58)      /* kvstore/residency.py: ScoreResidency */
#define WEAK ((int64_t)1 << 57)
#define CHEAP ((int64_t)1 << 58)
enum { LRU = 0, CYCLE = 1, SCORE = 2 };

typedef struct {
    int32_t *slot_of;      /* [max_keys] key -> slot, -1 absent */
    int64_t *key_of;       /* [n] slot -> key, -1 free */
    int32_t *free_;        /* [n] free-slot stack, free_[0:top] */
    uint8_t *pinned;       /* [n] bool: never evicted */
    int64_t *last_used;    /* [n] the policy's stamps */
    long long n, top;
    int kind;              /* LRU, CYCLE or SCORE */
    long long period;
} tier_t;

typedef struct {
    int64_t s;             /* score: larger goes first */
    int64_t i;             /* slot (or -1 - incoming index) */
} item_t;

static int parse_tier(PyObject *o, tier_t *t) {
    unsigned long long a[5];
    if (!PyArg_ParseTuple(o, "KKKKKLLiL;a tier is (slot_of, key_of, free, pinned, last_used "
                          "addresses, slots, free count, kind, period)", &a[0], &a[1], &a[2],
                          &a[3], &a[4], &t->n, &t->top, &t->kind, &t->period))
        return -1;
    t->slot_of = (int32_t *)(uintptr_t)a[0];
    t->key_of = (int64_t *)(uintptr_t)a[1];
    t->free_ = (int32_t *)(uintptr_t)a[2];
    t->pinned = (uint8_t *)(uintptr_t)a[3];
    t->last_used = (int64_t *)(uintptr_t)a[4];
    if (t->n < 0 || t->top < 0 || t->top > t->n || t->kind < LRU || t->kind > SCORE) {
        PyErr_SetString(PyExc_ValueError, "tier sizes out of range");
        return -1;
    }
    return 0;
}

static inline int64_t score(const tier_t *t, int64_t used, int64_t now) {
    if (t->kind == LRU)
        return -used;
    int64_t add = 0;
    if (t->kind == SCORE && used >= 0 && (used & WEAK_FLAG)) {
        used -= WEAK_FLAG;
        add = WEAK;
    }
    return used <= now - t->period ? STALE + (now - used) : used + add;
}

/* The `cap` largest scores seen: a min-heap in a[0:n], whose root is the score to beat once it
 * is full. Most candidates fail that one comparison, so a pass over every slot writes little. */
typedef struct {
    item_t *a;
    int64_t n, cap;
} top_t;

/* Whether a score could enter (cheaper checks may then be skipped for candidates that cannot). */
static inline int top_admits(const top_t *t, int64_t s) { return t->n < t->cap || s > t->a[0].s; }

static void top_push(top_t *t, item_t it) {
    item_t *a = t->a;
    if (t->n < t->cap) {                      /* sift up */
        int64_t c = t->n++;
        while (c > 0 && a[(c - 1) / 2].s > it.s) {
            a[c] = a[(c - 1) / 2];
            c = (c - 1) / 2;
        }
        a[c] = it;
        return;
    }
    if (t->cap == 0 || it.s <= a[0].s)
        return;
    int64_t c = 0;                            /* replace the root, sift down */
    for (;;) {
        int64_t l = 2 * c + 1, m = l;
        if (l >= t->n)
            break;
        if (l + 1 < t->n && a[l + 1].s < a[l].s)
            m = l + 1;
        if (a[m].s >= it.s)
            break;
        a[c] = a[m];
        c = m;
    }
    a[c] = it;
}

static void drop(tier_t *t, int64_t slot) {
    t->slot_of[t->key_of[slot]] = -1;
    t->key_of[slot] = -1;
    t->free_[t->top++] = (int32_t)slot;
}

typedef struct {
    int64_t dev_evicted, host_evicted, demoted;
} result_t;

/* Host admission of `na` demoted pages (keys, last used `used`): evicts host residents for them
 * and clears admit[i] of the pages kept out; stamps[i] = the admitted page's host stamp. */
static void admit_host(tier_t *h, const tier_t *d, int64_t na, const int64_t *used,
                       uint8_t *admit, int64_t *stamps, int64_t now, item_t *items,
                       result_t *r) {
    int64_t excess = na - h->top;
    for (int64_t i = 0; i < na; i++) {
        admit[i] = 1;
        stamps[i] = h->kind != LRU ? used[i] : now;
    }
    if (excess <= 0)
        return;
    if (h->kind != LRU) {
        top_t top = {items, 0, excess};
        for (int64_t i = 0; i < na; i++)
            top_push(&top, (item_t){score(h, used[i], now), -1 - i});
        for (int64_t s = 0; s < h->n; s++) {
            int64_t k = h->key_of[s];
            if (k < 0 || h->pinned[s])
                continue;
            int64_t b = score(h, h->last_used[s], now);
            if (!top_admits(&top, b))          /* the spare rule only lowers a score */
                continue;
            if (b < STALE && d->slot_of[k] >= 0)
                b -= SPARE;
            top_push(&top, (item_t){b, s});
        }
        for (int64_t j = 0; j < top.n; j++) {
            if (items[j].i < 0) {
                admit[-1 - items[j].i] = 0;
            } else {
                drop(h, items[j].i);
                r->host_evicted++;
            }
        }
        return;
    }
    /* lru: spare copies first, in slot order, then the least recently used of the rest */
    int64_t got = 0;
    for (int64_t s = 0; s < h->n && got < excess; s++) {
        int64_t k = h->key_of[s];
        if (k >= 0 && !h->pinned[s] && d->slot_of[k] >= 0)
            items[got++] = (item_t){0, s};
    }
    if (got < excess) {
        top_t top = {items + got, 0, excess - got};
        for (int64_t s = 0; s < h->n; s++) {
            int64_t k = h->key_of[s];
            if (k < 0 || h->pinned[s])
                continue;
            int64_t b = score(h, h->last_used[s], now);
            if (top_admits(&top, b) && d->slot_of[k] < 0)
                top_push(&top, (item_t){b, s});
        }
        got += top.n;
    }
    for (int64_t j = 0; j < got; j++)
        drop(h, items[j].i);
    r->host_evicted += got;
}

/* The pass (see the module comment). */
static void run(tier_t *d, tier_t *h, const uint8_t *clean, const int64_t *protect,
                int64_t np, int64_t want, int64_t need, int64_t now, int64_t *out_dev,
                int64_t *out_host, int64_t *scratch, result_t *r) {
    item_t *items = (item_t *)scratch;                 /* [d.n + h.n] */
    int64_t *vic = scratch + 2 * (d->n + (h ? h->n : 0));
    int64_t *dem = vic + d->n, *used = dem + d->n, *stamps = used + d->n;
    uint8_t *mark = (uint8_t *)(stamps + d->n);      /* d.n bytes: protected, then admitted */
    memset(mark, 0, (size_t)d->n);
    for (int64_t j = 0; j < np; j++) {
        int32_t s = d->slot_of[protect[j]];
        if (s >= 0)
            mark[s] = 1;
    }
    top_t top = {items, 0, want < d->n ? want : d->n};
    for (int64_t s = 0; s < d->n; s++) {
        int64_t k = d->key_of[s];
        if (k >= 0 && !d->pinned[s] && !mark[s] && clean[k]) {
            int64_t b = score(d, d->last_used[s], now);
            if (d->kind == SCORE && h != NULL && b < STALE && h->slot_of[k] >= 0)
                b += CHEAP;                             /* a DRAM copy away */
            top_push(&top, (item_t){b, s});
        }
    }
    int64_t nv = top.n;
    if (nv < need || nv == 0)
        return;
    for (int64_t j = 0; j < nv; j++)
        vic[j] = items[j].i;
    if (h != NULL) {
        /* the victims the host lacks are demoted: the admitted ones get a host slot */
        int64_t na = 0;
        for (int64_t j = 0; j < nv; j++) {
            if (h->slot_of[d->key_of[vic[j]]] < 0) {
                dem[na] = vic[j];
                used[na++] = d->last_used[vic[j]];
            }
        }
        uint8_t *admit = mark;
        admit_host(h, d, na, used, admit, stamps, now, items, r);
        int64_t k = 0;
        for (int64_t i = 0; i < na; i++)
            k += admit[i];
        if (k > h->top)
            k = h->top;
        int64_t base = h->top - k, t = 0;
        for (int64_t i = 0; i < na && t < k; i++) {
            if (!admit[i])
                continue;
            int64_t key = d->key_of[dem[i]], slot = h->free_[base + t];
            h->slot_of[key] = (int32_t)slot;
            h->key_of[slot] = key;
            h->last_used[slot] = stamps[i];
            out_dev[t] = dem[i];
            out_host[t++] = slot;
        }
        h->top = base;
        r->demoted = k;
    }
    for (int64_t j = 0; j < nv; j++)
        drop(d, vic[j]);
    r->dev_evicted = nv;
}

static int64_t scratch_words(int64_t dn, int64_t hn) { return 2 * (dn + hn) + 4 * dn + dn / 8 + 1; }

static PyObject *py_scratch_words(PyObject *self, PyObject *args) {
    long long dn, hn;
    if (!PyArg_ParseTuple(args, "LL", &dn, &hn))
        return NULL;
    return PyLong_FromLongLong(scratch_words(dn, hn));
}

static int get_i64(PyObject *o, Py_buffer *v, int writable, const char *name) {
    if (PyObject_GetBuffer(o, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT |
                           (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (v->itemsize != 8 || v->format == NULL || (strcmp(v->format, "l") != 0 &&
                                                  strcmp(v->format, "q") != 0)) {
        PyBuffer_Release(v);
        PyErr_Format(PyExc_ValueError, "%s must be a contiguous int64 array", name);
        return -1;
    }
    return 0;
}

static PyObject *evict_pass(PyObject *self, PyObject *args) {
    PyObject *od, *oh, *op, *oo, *os;
    unsigned long long clean_addr;
    long long max_keys, want, need, now;
    if (!PyArg_ParseTuple(args, "OOKLOLLLOO", &od, &oh, &clean_addr, &max_keys, &op, &want,
                          &need, &now, &oo, &os))
        return NULL;
    tier_t d, h;
    int host = oh != Py_None;
    if (parse_tier(od, &d) < 0 || (host && parse_tier(oh, &h) < 0))
        return NULL;
    if (want < 0 || need < 0 || want > ((long long)1 << 40)) {
        PyErr_SetString(PyExc_ValueError, "want and need must be in [0, 2**40]");
        return NULL;
    }
    Py_buffer vp, vo, vs;
    if (get_i64(op, &vp, 0, "protect") < 0)
        return NULL;
    if (get_i64(oo, &vo, 1, "out") < 0) {
        PyBuffer_Release(&vp);
        return NULL;
    }
    if (get_i64(os, &vs, 1, "scratch") < 0) {
        PyBuffer_Release(&vp);
        PyBuffer_Release(&vo);
        return NULL;
    }
    const int64_t *protect = vp.buf;
    int64_t np = vp.len / 8;
    const char *err = NULL;
    if (vo.len / 8 < 2 * want)
        err = "out must hold 2 x want demotions";
    else if (vs.len / 8 < scratch_words(d.n, host ? h.n : 0))
        err = "scratch too small (scratch_words)";
    for (int64_t j = 0; err == NULL && j < np; j++)
        if (protect[j] < 0 || protect[j] >= max_keys)
            err = "protect: keys outside [0, max_keys)";
    result_t r = {0, 0, 0};
    if (err == NULL) {
        int64_t *out = vo.buf;
        Py_BEGIN_ALLOW_THREADS
        run(&d, host ? &h : NULL, (const uint8_t *)(uintptr_t)clean_addr, protect, np, want,
            need, now, out, out + want, vs.buf, &r);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&vp);
    PyBuffer_Release(&vo);
    PyBuffer_Release(&vs);
    if (err != NULL) {
        PyErr_SetString(PyExc_ValueError, err);
        return NULL;
    }
    return Py_BuildValue("(LLLLL)", (long long)r.dev_evicted, d.top,
                         (long long)r.host_evicted, host ? h.top : 0LL, (long long)r.demoted);
}

static PyMethodDef methods[] = {
    {"evict_pass", evict_pass, METH_VARARGS,
     "evict_pass(device, host, clean, max_keys, protect, want, need, now, out, scratch) -> "
     "(device evicted, device free, host evicted, host free, demoted): evict up to `want` "
     "device pages, none if fewer than `need` can go; demotions (device slot, host slot) in "
     "out[:demoted], out[want:want + demoted]"},
    {"scratch_words", py_scratch_words, METH_VARARGS,
     "scratch_words(device slots, host slots): int64 words of scratch evict_pass needs"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_evict", NULL, -1, methods};

PyMODINIT_FUNC PyInit__evict(void) { return PyModule_Create(&module); }
