/* kernels/_qmatmul.c's tile layout both ways, included there once. `pack_tiles`: int16
 * codes [N, K] (4-bit 0..15 or 8-bit -128..127) into the tiles, rows past N zero (what
 * kernels/packed_linear.py `_our_layout` had done in several torch passes: 17 of an 8B
 * file's 57 s of loading). And dense weights from the tiles:
 *
 *   w[n, k] = scale[n, g] * q[n, k] + zero[n, g]   (one rounding: a fused multiply-add)
 *
 * as float32, or bf16 rounded to nearest even. A prefill chunk of a model that keeps no dense
 * copy of its weights multiplies by such a copy of one matmul at a time, made when it runs
 * (kernels/packed_linear.py `StagedWeight`): the GEMM of a few hundred rows by a dense
 * weight runs about twice as fast as our integer kernel, and this costs one pass over the
 * weight. Uses the job's codes, scale, zero, bits, k, n, tiles [t0, t1), out and out_bf16.
 * Included after run_parallel, with the module's Python functions `dequant` and `pack_codes`.
 * Paths: AVX2 + FMA + F16C (a tile's group is 16 units of 8 int32 lanes, one per row:
 * two 8 x 8 transposes give each row its 32 codes), portable C. */

static inline uint16_t dq_bf16(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

/* tiles [t0, t1) of job->codes (written) from the int16 codes at job->xq ([N, K]) */
static void pack_tiles(const job_t *j) {
    const Py_ssize_t groups = j->k / GROUP, gb = TILE_GROUP_BYTES(j->bits);
    uint8_t *out = (uint8_t *)j->codes;
    for (Py_ssize_t t = j->t0; t < j->t1; t++)
        for (Py_ssize_t g = 0; g < groups; g++) {
            uint8_t *c = out + (t * groups + g) * gb;
            memset(c, 0, gb);
            for (int i = 0; i < TILE && t * TILE + i < j->n; i++) {
                const int16_t *q = j->xq + (t * TILE + i) * j->k + g * GROUP;
                for (int e = 0; e < GROUP; e++) {
                    if (j->bits == 8) {
                        c[(e >> 1) * 16 + 2 * i + (e & 1)] = (uint8_t)(int8_t)q[e];
                    } else {
                        const int at = (e >> 3) * 32 + ((e >> 1) & 1) * 16 + 2 * i + (e & 1);
                        c[at] |= (uint8_t)((q[e] & 0x0f) << ((e >> 2) & 1 ? 4 : 0));
                    }
                }
            }
        }
}

static void dequant_portable(const job_t *j) {
    const Py_ssize_t groups = j->k / GROUP, gb = TILE_GROUP_BYTES(j->bits);
    for (Py_ssize_t t = j->t0; t < j->t1; t++)
        for (Py_ssize_t g = 0; g < groups; g++) {
            const uint8_t *c = j->codes + (t * groups + g) * gb;
            const Py_ssize_t at = (t * groups + g) * TILE;
            for (int i = 0; i < TILE && t * TILE + i < j->n; i++) {
                const float s = f16_to_f32(j->scale[at + i]);
                const float z = j->zero ? f16_to_f32(j->zero[at + i]) : 0.f;
                const Py_ssize_t o = (t * TILE + i) * j->k + g * GROUP;
                for (int e = 0; e < GROUP; e++) {
                    const float v = fmaf((float)code_at(c, j->bits, i, e), s, z);
                    if (j->out_bf16)
                        ((uint16_t *)j->out)[o + e] = dq_bf16(v);
                    else
                        j->out[o + e] = v;
                }
            }
        }
}

#ifdef HAVE_AVX2_PATH
#define DQ_TARGET __attribute__((target("avx2,fma,f16c")))

/* r[0..7]: 8 x 8 int32 -> its transpose, in place */
static inline __attribute__((always_inline)) DQ_TARGET void dq_transpose8(__m256i *r) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 4) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
        t[i + 2] = _mm256_unpacklo_epi32(r[i + 2], r[i + 3]);
        t[i + 3] = _mm256_unpackhi_epi32(r[i + 2], r[i + 3]);
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
    }
}

/* 8 floats -> 8 bf16 (nearest even) */
static inline __attribute__((always_inline)) DQ_TARGET __m128i dq_bf16x8(__m256 v) {
    __m256i b = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)),
                          16);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08));
}

/* a tile's group: its 16 units (pair p of every row: int32 lane i is row i's pair) */
static inline __attribute__((always_inline)) DQ_TARGET void dq_units(const uint8_t *c, int bits,
                                                                     __m256i *u) {
    if (bits == 4) {
        const __m256i low = _mm256_set1_epi8(0x0f);
        for (int b = 0; b < 4; b++) {       /* 32 bytes: units 4b .. 4b + 3 */
            const __m256i v = _mm256_loadu_si256((const __m256i *)(c + 32 * b));
            const __m256i lo = _mm256_and_si256(v, low);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            u[4 * b] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo));
            u[4 * b + 1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1));
            u[4 * b + 2] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi));
            u[4 * b + 3] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1));
        }
    } else {
        for (int p = 0; p < GROUP / 2; p++)
            u[p] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(c + 16 * p)));
    }
}

static DQ_TARGET void dequant_avx2(const job_t *j) {
    const Py_ssize_t groups = j->k / GROUP, gb = TILE_GROUP_BYTES(j->bits);
    for (Py_ssize_t t = j->t0; t < j->t1; t++)
        for (Py_ssize_t g = 0; g < groups; g++) {
            const Py_ssize_t at = (t * groups + g) * TILE;
            __m256i u[GROUP / 2];
            dq_units(j->codes + (t * groups + g) * gb, j->bits, u);
            dq_transpose8(u);               /* u[i]: row i's elements 0..15 (int16) */
            dq_transpose8(u + 8);           /* u[8 + i]: its elements 16..31 */
            const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(j->scale + at)));
            const __m256 z = j->zero ? _mm256_cvtph_ps(
                _mm_loadu_si128((const __m128i *)(j->zero + at))) : _mm256_setzero_ps();
            for (int i = 0; i < TILE && t * TILE + i < j->n; i++) {
                const __m256i lane = _mm256_set1_epi32(i);
                const __m256 si = _mm256_permutevar8x32_ps(s, lane);
                const __m256 zi = _mm256_permutevar8x32_ps(z, lane);
                const Py_ssize_t o = (t * TILE + i) * j->k + g * GROUP;
                for (int q = 0; q < 4; q++) {   /* elements 8q .. 8q + 7 */
                    const __m256i h = u[i + 8 * (q >> 1)];
                    const __m128i half = q & 1 ? _mm256_extracti128_si256(h, 1)
                                               : _mm256_castsi256_si128(h);
                    const __m256 v = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(half)), si, zi);
                    if (j->out_bf16)
                        _mm_storeu_si128((__m128i *)((uint16_t *)j->out + o + 8 * q),
                                         dq_bf16x8(v));
                    else
                        _mm256_storeu_ps(j->out + o + 8 * q, v);
                }
            }
        }
}
#undef DQ_TARGET
#endif

/* whether codes of this width and shape are ours (else a ValueError is set) */
static int codes_ok(int bits, Py_ssize_t k, Py_ssize_t n) {
    if ((bits == 4 || bits == 8) && k % GROUP == 0 && n >= 0)
        return 1;
    PyErr_Format(PyExc_ValueError, "unsupported: %d-bit codes (4 or 8), K %zd (a multiple of "
                 "%d), N %zd", bits, k, GROUP, n);
    return 0;
}

/* w [N, K] in float32 or bf16 (out_bf16) from the codes; without the GIL */
static PyObject *dequant(PyObject *self, PyObject *args) {
    unsigned long long codes, scale, zero, out;
    Py_ssize_t n, k;
    int bits, out_bf16, simd = 1, threads = 1;
    if (!PyArg_ParseTuple(args, "KKKnniKp|ii", &codes, &scale, &zero, &n, &k, &bits, &out,
                          &out_bf16, &simd, &threads))
        return NULL;
    if (!codes_ok(bits, k, n))
        return NULL;
    job_t job = {NULL, NULL, NULL, (const uint8_t *)(uintptr_t)codes,
                 (const uint16_t *)(uintptr_t)scale, (const uint16_t *)(uintptr_t)zero, bits,
                 0, k, n, 0, (n + TILE - 1) / TILE, (float *)(uintptr_t)out, out_bf16};
    run_fn fn = dequant_portable;
#ifdef HAVE_AVX2_PATH
    if (simd >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        fn = dequant_avx2;
#else
    (void)simd;
#endif
    Py_BEGIN_ALLOW_THREADS
    run_parallel(fn, &job, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* int16 codes [N, K] into the tile layout (`pack_tiles`); without the GIL */
static PyObject *pack_codes(PyObject *self, PyObject *args) {
    unsigned long long codes, out;
    Py_ssize_t n, k;
    int bits, threads = 1;
    if (!PyArg_ParseTuple(args, "KnniK|i", &codes, &n, &k, &bits, &out, &threads))
        return NULL;
    if (!codes_ok(bits, k, n))
        return NULL;
    job_t job = {(const int16_t *)(uintptr_t)codes, NULL, NULL, (const uint8_t *)(uintptr_t)out,
                 NULL, NULL, bits, 0, k, n, 0, (n + TILE - 1) / TILE, NULL, 0};
    Py_BEGIN_ALLOW_THREADS
    run_parallel(pack_tiles, &job, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}
