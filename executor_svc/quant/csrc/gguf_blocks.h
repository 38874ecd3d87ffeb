/* GGML block layouts and their dequantization, in portable C (the reference for the SIMD code
 * and the whole kernel where there is no AVX2). The layouts are llama.cpp's (ggml-common.h);
 * each block is dequantized with the same float32 operations, in the same order, as the `gguf`
 * package's `gguf.quants.dequantize` (itself a port of ggml-quants.c), so the floats are equal
 * to the bit:
 *
 *   type   weights bytes  layout                                              w =
 *   Q4_0   32      18     d, qs[16] (nibbles: j low, j+16 high)               d * (q - 8)
 *   Q4_1   32      20     d, m, qs[16]                                         d * q + m
 *   Q5_0   32      22     d, qh[4] (bit j: 5th bit of weight j), qs[16]       d * (q - 16)
 *   Q5_1   32      24     d, m, qh[4], qs[16]                                  d * q + m
 *   Q8_0   32      34     d, qs[32] int8                                       q * d
 *   Q2_K   256     84     scales[16] (4-bit scale | 4-bit min << 4), qs[64],   (d sc) q - (dmin m)
 *                         d, dmin; 16 sub-blocks of 16, q 2 bits
 *   Q3_K   256     110    hmask[32], qs[64], scales[12] (6-bit, packed), d     (d (sc - 32)) q,
 *                         16 sub-blocks of 16, q 2 low bits - 4 unless hmask    q in -4..3
 *   Q4_K   256     144    d, dmin, scales[12] (6-bit scales and mins), qs[128] (d sc) q - (dmin m)
 *                         8 sub-blocks of 32
 *   Q5_K   256     176    d, dmin, scales[12], qh[32], qs[128]                 (d sc) q - (dmin m)
 *   Q6_K   256     210    ql[128], qh[64], scales[16] int8, d                   (d sc) (q - 32)
 *
 * d, dmin and m are fp16. I8_ROW is Pagoda's own int8 layout for `--quantization int8` (not a
 * GGML type): a row is its float32 scale, then K int8 values.
 */
#ifndef PAGODA_GGUF_BLOCKS_H
#define PAGODA_GGUF_BLOCKS_H

#include <stdint.h>
#include <string.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

enum {
    GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8,
    GGML_Q2_K = 10, GGML_Q3_K = 11, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14,
    I8_ROW = 1000,
};
enum { QK = 32, QK_K = 256 };

static inline int64_t block_bytes(const int type) {
    switch (type) {
    case I8_ROW: return 32; /* after the row's scale */
    case GGML_Q4_0: return 18;
    case GGML_Q4_1: return 20;
    case GGML_Q5_0: return 22;
    case GGML_Q5_1: return 24;
    case GGML_Q8_0: return 34;
    case GGML_Q2_K: return 84;
    case GGML_Q3_K: return 110;
    case GGML_Q4_K: return 144;
    case GGML_Q5_K: return 176;
    case GGML_Q6_K: return 210;
    default: return 0;
    }
}

static inline int64_t block_weights(const int type) { return type >= GGML_Q2_K && type <= GGML_Q6_K ? QK_K : QK; }

static inline float fp16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    uint32_t bits;
    if (exp == 0) { /* zero or subnormal: mant * 2^-24, exact in float32 */
        const float f = (float)mant * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j (0..7), as ggml's get_scale_min_k4. */
static inline void k_scale_min(const int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q3_K: the 16 6-bit scales (minus 32) of a block from its 12 packed bytes. */
static inline void q3_k_scales(const uint8_t *packed, int8_t out[16]) {
    const uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f;
    uint32_t aux[4];
    memcpy(aux, packed, 12);
    const uint32_t tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
    aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
    aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
    aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
    memcpy(out, aux, 16);
    for (int i = 0; i < 16; ++i) out[i] = (int8_t)(out[i] - 32);
}

/* One block of `type` (block_weights(type) weights) into y. */
static void dequant_block_scalar(const int type, const uint8_t *blk, float *y) {
    switch (type) {
    case GGML_Q4_0: {
        const float d = fp16(blk);
        for (int j = 0; j < 16; ++j) {
            y[j] = d * (float)((blk[2 + j] & 0xF) - 8);
            y[j + 16] = d * (float)((blk[2 + j] >> 4) - 8);
        }
        return;
    }
    case GGML_Q4_1: {
        const float d = fp16(blk), m = fp16(blk + 2);
        for (int j = 0; j < 16; ++j) {
            y[j] = d * (float)(blk[4 + j] & 0xF) + m;
            y[j + 16] = d * (float)(blk[4 + j] >> 4) + m;
        }
        return;
    }
    case GGML_Q5_0:
    case GGML_Q5_1: {
        const int has_m = type == GGML_Q5_1;
        const float d = fp16(blk), m = has_m ? fp16(blk + 2) : 0.f;
        uint32_t qh;
        memcpy(&qh, blk + 2 + 2 * has_m, 4);
        const uint8_t *qs = blk + 6 + 2 * has_m;
        for (int j = 0; j < 16; ++j) {
            const int x0 = (qs[j] & 0xF) | (((qh >> j) & 1) << 4), x1 = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            if (has_m) {
                y[j] = d * (float)x0 + m;
                y[j + 16] = d * (float)x1 + m;
            } else {
                y[j] = d * (float)(x0 - 16);
                y[j + 16] = d * (float)(x1 - 16);
            }
        }
        return;
    }
    case GGML_Q8_0: {
        const float d = fp16(blk);
        for (int j = 0; j < 32; ++j) y[j] = (float)(int8_t)blk[2 + j] * d;
        return;
    }
    case GGML_Q2_K: { /* 16 sub-blocks of 16; 32 bytes of qs hold 128 weights, 2 bits each */
        const float d = fp16(blk + 80), dmin = fp16(blk + 82);
        const uint8_t *q = blk + 16;
        int is = 0;
        for (int n = 0; n < QK_K; n += 128, q += 32) {
            for (int shift = 0; shift < 8; shift += 2) {
                for (int half = 0; half < 2; ++half, ++is) {
                    const float dl = d * (float)(blk[is] & 0xF), ml = dmin * (float)(blk[is] >> 4);
                    for (int l = 0; l < 16; ++l) *y++ = dl * (float)((q[l + 16 * half] >> shift) & 3) - ml;
                }
            }
        }
        return;
    }
    case GGML_Q3_K: {
        int8_t sc[16];
        q3_k_scales(blk + 96, sc);
        const float d = fp16(blk + 108);
        const uint8_t *hm = blk, *q = blk + 32;
        int is = 0;
        uint8_t bit = 1;
        for (int n = 0; n < QK_K; n += 128, q += 32) {
            for (int shift = 0; shift < 8; shift += 2, bit <<= 1) {
                for (int half = 0; half < 2; ++half, ++is) {
                    const float dl = d * (float)sc[is];
                    for (int l = 16 * half; l < 16 * half + 16; ++l)
                        *y++ = dl * (float)(((q[l] >> shift) & 3) - ((hm[l] & bit) ? 0 : 4));
                }
            }
        }
        return;
    }
    case GGML_Q4_K:
    case GGML_Q5_K: {
        const int five = type == GGML_Q5_K;
        const float d = fp16(blk), dmin = fp16(blk + 2);
        const uint8_t *scales = blk + 4, *qh = blk + 16, *ql = blk + 16 + 32 * five;
        for (int j = 0; j < 8; j += 2, ql += 32) {
            uint8_t sc, m;
            k_scale_min(j, scales, &sc, &m);
            const float d1 = d * (float)sc, m1 = dmin * (float)m;
            k_scale_min(j + 1, scales, &sc, &m);
            const float d2 = d * (float)sc, m2 = dmin * (float)m;
            for (int l = 0; l < 32; ++l) {
                const int h1 = five ? ((qh[l] >> j) & 1) << 4 : 0, h2 = five ? ((qh[l] >> (j + 1)) & 1) << 4 : 0;
                y[l] = d1 * (float)((ql[l] & 0xF) | h1) - m1;
                y[l + 32] = d2 * (float)((ql[l] >> 4) | h2) - m2;
            }
            y += 64;
        }
        return;
    }
    case GGML_Q6_K: {
        const uint8_t *ql = blk, *qh = blk + 128;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = fp16(blk + 208);
        for (int n = 0; n < QK_K; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
            for (int l = 0; l < 32; ++l) {
                const int is = l / 16;
                const int q1 = (int)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = (int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = d * (float)sc[is] * (float)q1;
                y[l + 32] = d * (float)sc[is + 2] * (float)q2;
                y[l + 64] = d * (float)sc[is + 4] * (float)q3;
                y[l + 96] = d * (float)sc[is + 6] * (float)q4;
            }
        }
        return;
    }
    }
}

/* A row of K weights of `type` into out. */
static void dequant_row_scalar(const int type, const uint8_t *row, const int64_t K, float *out) {
    if (type == I8_ROW) {
        float scale;
        memcpy(&scale, row, 4);
        for (int64_t k = 0; k < K; ++k) out[k] = (float)(int8_t)row[4 + k] * scale;
        return;
    }
    const int64_t bw = block_weights(type), bb = block_bytes(type);
    for (int64_t b = 0; b < K / bw; ++b) dequant_block_scalar(type, row + b * bb, out + b * bw);
}

#endif
