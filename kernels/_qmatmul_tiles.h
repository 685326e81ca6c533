/* One SIMD path of kernels/_qmatmul.c over its tiles of 8 output rows (the layout is written
 * there), included once per instruction set with:
 *
 *   TILES(name)          the path's function names (name##_avx2, ...)
 *   TILES_TARGET         its __attribute__((target(...)))
 *   PAIR_DOT(acc, w, x)  acc + per int32 lane (one output row) w[2i] x[0] + w[2i+1] x[1]
 *
 * A unit is one register of 16 int16 codes: element pair (e, e + 1) of each of the tile's 8
 * rows; x's pair at e is broadcast to every lane. A group's integer dot products stay in int32
 * lanes, one per output row, and are scaled once a group: the float work is one multiply-add
 * per group for 8 outputs (the per-row layout paid one per group and output). */

/* one tile's outputs for the R rows of x from r0 (bits, R: constants where inlined) */
static inline __attribute__((always_inline)) TILES_TARGET void TILES(tile)(
        const job_t *j, const int bits, const int R, Py_ssize_t t, Py_ssize_t r0) {
    const Py_ssize_t groups = j->k / GROUP, k = j->k, gb = TILE_GROUP_BYTES(bits);
    const int16_t *xq = j->xq + r0 * k;
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256 f[4];
    for (int r = 0; r < R; r++)
        f[r] = _mm256_setzero_ps();
    for (Py_ssize_t g = 0; g < groups; g++) {
        const uint8_t *c = j->codes + (t * groups + g) * gb;
        const int16_t *xg = xq + g * GROUP;
        __m256i a[4];
        for (int r = 0; r < R; r++)
            a[r] = _mm256_setzero_si256();
        if (bits == 4) {
            for (int b = 0; b < 4; b++) {       /* 32 bytes: elements 8b .. 8b + 7 */
                const __m256i v = _mm256_loadu_si256((const __m256i *)(c + 32 * b));
                const __m256i lo = _mm256_and_si256(v, low);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                const __m256i u[4] = {_mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo)),
                                      _mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1)),
                                      _mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi)),
                                      _mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1))};
                for (int q = 0; q < 4; q++)
                    for (int r = 0; r < R; r++)
                        a[r] = PAIR_DOT(a[r], u[q],
                                        _mm256_set1_epi32(pair_at(xg + r * k + 8 * b + 2 * q)));
            }
        } else {
            for (int p = 0; p < GROUP / 2; p++) {
                const __m256i u = _mm256_cvtepi8_epi16(
                    _mm_loadu_si128((const __m128i *)(c + 16 * p)));
                for (int r = 0; r < R; r++)
                    a[r] = PAIR_DOT(a[r], u, _mm256_set1_epi32(pair_at(xg + r * k + 2 * p)));
            }
        }
        const Py_ssize_t at = (t * groups + g) * TILE;
        const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(j->scale + at)));
        for (int r = 0; r < R; r++)
            f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r]),
                                   _mm256_mul_ps(s, _mm256_set1_ps(j->dx[(r0 + r) * groups + g])),
                                   f[r]);
        if (j->zero) {
            const __m256 z = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(j->zero + at)));
            for (int r = 0; r < R; r++)
                f[r] = _mm256_fmadd_ps(z, _mm256_set1_ps(j->xs[(r0 + r) * groups + g]), f[r]);
        }
    }
    const Py_ssize_t n0 = t * TILE, valid = j->n - n0 < TILE ? j->n - n0 : TILE;
    for (int r = 0; r < R; r++) {
        float *o = j->out + (r0 + r) * j->n + n0;
        if (valid == TILE) {
            _mm256_storeu_ps(o, f[r]);
        } else {
            float tmp[TILE];
            _mm256_storeu_ps(tmp, f[r]);
            memcpy(o, tmp, valid * sizeof(float));
        }
    }
}

/* tiles [t0, t1) (bits: a constant where inlined) */
static inline __attribute__((always_inline)) TILES_TARGET void TILES(tiles)(const job_t *j,
                                                                            const int bits) {
    for (Py_ssize_t t = j->t0; t < j->t1; t++) {
        Py_ssize_t r0 = 0;
        for (; r0 + 4 <= j->m; r0 += 4)
            TILES(tile)(j, bits, 4, t, r0);
        switch (j->m - r0) {
        case 3: TILES(tile)(j, bits, 3, t, r0); break;
        case 2: TILES(tile)(j, bits, 2, t, r0); break;
        case 1: TILES(tile)(j, bits, 1, t, r0); break;
        }
    }
}

static TILES_TARGET void TILES(run)(const job_t *j) {
    if (j->bits == 4)
        TILES(tiles)(j, 4);
    else
        TILES(tiles)(j, 8);
}
