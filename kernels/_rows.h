/* Row loads shared by the CPU kernels (kernels/_decode.c, kernels/_select.c): a row of d
 * values, bf16 or float32, as float32. */
#ifndef STRATA_KERNELS_ROWS_H
#define STRATA_KERNELS_ROWS_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline void load_row(const void *src, int bf16, float *dst, int d) {
    if (bf16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int i = 0; i < d; i++)
            dst[i] = bf16_to_f32(s[i]);
    } else {
        memcpy(dst, src, (size_t)d * sizeof(float));
    }
}

#endif
