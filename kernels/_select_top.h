/* The top-k half of kernels/_select.c: the entries of a row with the largest keys, by a
 * radix select of the cut. Included by _select.c only. */
#ifndef STRATA_KERNELS_SELECT_TOP_H
#define STRATA_KERNELS_SELECT_TOP_H

#include <stdint.h>
#include <string.h>

/* a float's bits as an unsigned key in the same order (-0 as +0; no NaN comes here) */
static inline uint32_t order_key(float f) {
    f += 0.0f;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u & 0x80000000u ? ~u : u | 0x80000000u;
}

/* the value of rank `k` (0-based, descending) among w[0..n-1] (w is scratch, overwritten):
 * a radix select over the order keys, a byte at a time from the top, each pass keeping only
 * the keys whose bytes so far are the rank's (quickselect's data-dependent branches: a row
 * of 438 pages took 4.6 us to select with it, 3.2 with this; 8 rows x 438 pages, budget 64:
 * 381 -> 330 us a layer on one thread) */
static float kth_largest(float *w, int64_t n, int64_t k) {
    uint32_t *key = (uint32_t *)w;      /* in place: a key per value */
    for (int64_t i = 0; i < n; i++)
        key[i] = order_key(w[i]);
    uint32_t rank_key = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        int64_t hist[256] = {0};
        for (int64_t i = 0; i < n; i++)
            hist[key[i] >> shift & 255]++;
        int bin = 255;
        while (k >= hist[bin])
            k -= hist[bin--];
        rank_key |= (uint32_t)bin << shift;
        int64_t m = 0;          /* keep this bin's keys (no branch: half of them may differ) */
        for (int64_t i = 0; i < n; i++) {
            key[m] = key[i];
            m += (key[i] >> shift & 255) == (uint32_t)bin;
        }
        n = m;
    }
    uint32_t u = rank_key & 0x80000000u ? rank_key & 0x7fffffffu : ~rank_key;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* mark (chosen[p] = 1) the `k` entries of key[0..n-1] with the largest values among those
 * with eligible[p], ties to the lower p; returns how many */
static int64_t mark_top(const float *key, const uint8_t *eligible, int64_t n, int64_t k,
                        float *scratch, uint8_t *chosen) {
    int64_t m = 0;
    for (int64_t p = 0; p < n; p++)
        if (eligible[p]) scratch[m++] = key[p];
    if (k <= 0 || m == 0)
        return 0;
    if (k >= m) {
        for (int64_t p = 0; p < n; p++)
            if (eligible[p]) chosen[p] = 1;
        return m;
    }
    float t = kth_largest(scratch, m, k - 1);
    int64_t c = 0;
    for (int64_t p = 0; p < n; p++)
        if (eligible[p] && key[p] > t) { chosen[p] = 1; c++; }
    for (int64_t p = 0; p < n && c < k; p++)
        if (eligible[p] && key[p] == t && !chosen[p]) { chosen[p] = 1; c++; }
    return c;
}

#endif
