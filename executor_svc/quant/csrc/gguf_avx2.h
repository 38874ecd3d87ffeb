/* The AVX2 + FMA + F16C inner loops of the GGUF kernel: rows of W (packed blocks) against a
 * tile of rows of x (float32), and rows of W dequantized into floats.
 *
 * Three loops, chosen per call by the number of rows of x (see run_rows in gguf_matmul.c):
 *
 *   fused_rows    Q4_0 / Q4_1 / Q8_0 / I8_ROW, 1-4 rows of x: the block's integers meet x
 *                 directly, one scale per block, x's block sums for the additive part
 *                 (sum_j (d q_j + m) x_j = d sum_j q_j x_j + m sum_j x_j).
 *   group_rows    every other type, 1-4 rows of x ("t" form) and tiles of 8 rows ("w" form):
 *                 a group of 256 weights (one super-block, or 8 blocks of 32) is first decoded
 *                 into 256 int8 values, a float scale per sub-block of 16 or 32 and an additive
 *                 min per sub-block (decode_group). The t form sums q x per sub-block, times its
 *                 scale, plus min times x's block sums (8 mins against 8 sums: one multiply-add
 *                 a group); the w form makes the group's float weights (q scale + min) once and
 *                 multiplies them into every row of the tile, as a float32 GEMM would.
 *   fused_rows_wide  Q4_0 / Q4_1 / Q8_0 / I8_ROW in tiles of 8 rows: the w form of fused_rows.
 *
 * In a build with AVX-512 F/BW/VL, group_rows_512 (gguf_avx512.h) takes group_rows' types instead.
 *
 * and dequant_row_avx2 for the dequantize + GEMM path (prefill) and embedding lookups, equal to
 * the bit to dequant_row_scalar (the same float operations, vectorised).
 */
#ifndef PAGODA_GGUF_AVX2_H
#define PAGODA_GGUF_AVX2_H

#include <immintrin.h>

#include "gguf_blocks.h"

#define INLINE static inline __attribute__((always_inline))

/* How far ahead the row loops prefetch. Measured on this 2-core machine, the decoder's linears
 * of the default model called in model order at one token: no prefetch 15.7-16.7 ms a token;
 * 2 rows ahead 8.9, 4 rows 7.4-7.8, 8 rows 8.1, 16 rows 8.0 (bench: the note of #18). */
#define PREFETCH_ROWS 4

/* Rows stream from memory once per token (the weights do not stay in cache between tokens):
 * prefetch the row PREFETCH_ROWS ahead, so its loads overlap this row's arithmetic. */
INLINE void prefetch_ahead(const uint8_t *row, const int64_t row_bytes, const int64_t n, const int64_t n1) {
    if (n + PREFETCH_ROWS < n1) {
        const uint8_t *ahead = row + PREFETCH_ROWS * row_bytes;
        for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch((const char *)(ahead + o), _MM_HINT_T0);
    }
}

INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 16 bytes of nibbles -> the block's 32 integers as 4 x 8 floats (low nibbles first). */
INLINE void nibbles(const uint8_t *qs, __m256 q[4]) {
    /* two 8-byte loads widened to 32-bit lanes, then masked and shifted there: 2 shuffles a
     * block instead of 6 (shuffles have one port; shifts, masks and conversions have two) */
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs));
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8)));
    const __m256i mask = _mm256_set1_epi32(0x0F);
    q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, mask));
    q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b, mask));
    q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
    q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}

/* 32 int8 -> 4 x 8 floats. */
INLINE void int8s(const uint8_t *qs, __m256 q[4]) {
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * i))));
}

/* ---- Q4_0 / Q4_1 / Q8_0 / I8_ROW ------------------------------------------------------- */

INLINE int64_t simple_bsize(const int type) { return type == GGML_Q4_0 ? 18 : type == GGML_Q4_1 ? 20 : type == GGML_Q8_0 ? 34 : 32; }

/* Rows [n0, n1) of W against rows [0, mt) of x, mt <= 4; xs = block sums of x; y's rows ldy apart. */
INLINE void fused_rows(const int type, const uint8_t *restrict w, const int64_t row_bytes, const int64_t K,
                       const float *restrict x, const float *restrict xs, const int64_t mt, float *restrict y,
                       const int64_t ldy, const int64_t n0, const int64_t n1) {
    const int64_t nb = K / QK, bsize = simple_bsize(type);
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *row = w + n * row_bytes;
        prefetch_ahead(row, row_bytes, n, n1);
        float row_scale = 1.f;
        if (type == I8_ROW) {
            memcpy(&row_scale, row, 4);
            row += 4;
        }
        __m256 acc[4];
        float mins[4];
        for (int64_t m = 0; m < mt; ++m) {
            acc[m] = _mm256_setzero_ps();
            mins[m] = 0.f;
        }
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = row + b * bsize;
            __m256 q[4];
            float mb = 0.f;
            const float d = type == I8_ROW ? 1.f : fp16(blk);
            if (type == I8_ROW) {
                int8s(blk, q);
            } else if (type == GGML_Q8_0) {
                int8s(blk + 2, q);
            } else if (type == GGML_Q4_1) {
                mb = fp16(blk + 2);
                nibbles(blk + 4, q);
            } else {
                mb = -8.f * d;
                nibbles(blk + 2, q);
            }
            const __m256 dv = _mm256_set1_ps(d);
            for (int64_t m = 0; m < mt; ++m) {
                const float *xb = x + m * K + b * QK;
                __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
                t = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), t);
                t = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), t);
                t = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), t);
                acc[m] = type == I8_ROW ? _mm256_add_ps(t, acc[m]) : _mm256_fmadd_ps(t, dv, acc[m]);
                if (type == GGML_Q4_0 || type == GGML_Q4_1) mins[m] += mb * xs[m * nb + b];
            }
        }
        for (int64_t m = 0; m < mt; ++m) y[m * ldy + n] = hsum(acc[m]) * row_scale + mins[m];
    }
}

/* Rows [n0, n1) of W against 8 rows of x: each block is dequantized once into 4 x 8 floats
 * (w = d q + m, as the `gguf` package computes it) and multiplied into all 8 rows, so a block
 * costs 4 multiply-adds a row of x, as in a float32 GEMM, where fused_rows spends about 7
 * (its block sums and scale). For batches; fused_rows stays faster at 1-4 rows. */
enum { WIDE_TILE = 8 };
INLINE void fused_rows_wide(const int type, const uint8_t *restrict w, const int64_t row_bytes, const int64_t K,
                            const float *restrict x, float *restrict y, const int64_t ldy, const int64_t n0,
                            const int64_t n1) {
    const int64_t nb = K / QK, bsize = simple_bsize(type);
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *row = w + n * row_bytes;
        prefetch_ahead(row, row_bytes, n, n1);
        float row_scale = 1.f;
        if (type == I8_ROW) {
            memcpy(&row_scale, row, 4);
            row += 4;
        }
        __m256 acc[WIDE_TILE];
        for (int m = 0; m < WIDE_TILE; ++m) acc[m] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = row + b * bsize;
            __m256 q[4];
            if (type == I8_ROW) {
                int8s(blk, q);
            } else {
                const __m256 dv = _mm256_set1_ps(fp16(blk));
                if (type == GGML_Q8_0) {
                    int8s(blk + 2, q);
                    for (int i = 0; i < 4; ++i) q[i] = _mm256_mul_ps(q[i], dv);
                } else if (type == GGML_Q4_1) {
                    const __m256 mv = _mm256_set1_ps(fp16(blk + 2));
                    nibbles(blk + 4, q);
                    for (int i = 0; i < 4; ++i) q[i] = _mm256_add_ps(_mm256_mul_ps(q[i], dv), mv);
                } else {
                    const __m256 eight = _mm256_set1_ps(8.f);
                    nibbles(blk + 2, q);
                    for (int i = 0; i < 4; ++i) q[i] = _mm256_mul_ps(_mm256_sub_ps(q[i], eight), dv);
                }
            }
            for (int m = 0; m < WIDE_TILE; ++m) {
                const float *xb = x + m * K + b * QK;
                acc[m] = _mm256_fmadd_ps(q[0], _mm256_loadu_ps(xb), acc[m]);
                acc[m] = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), acc[m]);
                acc[m] = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), acc[m]);
                acc[m] = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), acc[m]);
            }
        }
        for (int m = 0; m < WIDE_TILE; ++m) y[m * ldy + n] = hsum(acc[m]) * row_scale;
    }
}

/* ---- the other types: groups of 256 weights decoded into int8 + scales ----------------- */

enum { GROUP = 256 };

typedef struct {
    int8_t q[GROUP] __attribute__((aligned(32)));
    float scale[16] __attribute__((aligned(32))); /* per sub-block (of group_sub() weights) */
    float min[16] __attribute__((aligned(32)));   /* per sub-block, added: w = scale q + min */
} group_t;

/* Weights a sub-block (one scale): 16 or 32. */
INLINE int group_sub(const int type) { return type == GGML_Q2_K || type == GGML_Q3_K || type == GGML_Q6_K ? 16 : 32; }

/* Whether the type has an additive min per sub-block. */
INLINE int group_has_min(const int type) {
    return type == GGML_Q5_1 || type == GGML_Q2_K || type == GGML_Q4_K || type == GGML_Q5_K;
}

/* 32 bits -> 32 bytes, 0xFF where the bit is set (byte i for bit i; ggml's bytes_from_bits_32). */
INLINE __m256i bytes_from_bits(const uint8_t *p) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuffle);
    return _mm256_cmpeq_epi8(_mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
}

/* 8 bytes (uint8 when !is_signed) times d into 8 floats at out. */
INLINE void bytes_times(const uint8_t *p, const int is_signed, const float d, float *out) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    const __m256i v = is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
    _mm256_store_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(d)));
}

/* Q4_K / Q5_K: the 8 scales and 8 mins as bytes (ggml's utmp unpacking of the 12 bytes). */
INLINE void k4_scales_mins(const uint8_t *packed, uint8_t sc[8], uint8_t mn[8]) {
    const uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    uint32_t u[3], s[2], m[2];
    memcpy(u, packed, 12);
    s[0] = u[0] & kmask1;
    s[1] = (u[2] & kmask2) | (((u[0] >> 6) & kmask3) << 4);
    m[0] = u[1] & kmask1;
    m[1] = ((u[2] >> 4) & kmask2) | (((u[1] >> 6) & kmask3) << 4);
    memcpy(sc, s, 8);
    memcpy(mn, m, 8);
}

/* The 5th bit of each byte's weight for sub-block s (bit s of qh) moved to 0x10. */
INLINE __m256i k5_high(const __m256i qh, const int s) {
    const __m256i t = s < 4 ? _mm256_slli_epi16(qh, 4 - s) : s == 4 ? qh : _mm256_srli_epi16(qh, s - 4);
    return _mm256_and_si256(t, _mm256_set1_epi8(0x10));
}

/* Q6_K: half h (128 weights) of a block's 6-bit quants, unsigned 0-63, as four registers of 32 (each a
 * block of 32 weights: weights 32 c .. 32 c + 31 of the half in q[c]). */
INLINE void q6_k_quants(const uint8_t *restrict blk, const int h, __m256i q[4]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03), m2h = _mm256_set1_epi8(0x0C),
                  m2hh = _mm256_set1_epi8(0x30);
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
    q[0] = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4));
    q[1] = _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_slli_epi16(_mm256_and_si256(qh, m2h), 2));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(qh, m2hh));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4), _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2hh));
}

/* Q6_K: half h's 8 sub-block scales (int8 at blk + 192 + 8 h) as int16, in both 128-bit halves. */
INLINE __m256i q6_k_half_scales(const uint8_t *restrict blk, const int h) {
    return _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(blk + 192 + 8 * h))));
}

/* Q6_K against int8 x (gguf_avx2_q8.h, gguf_q8_rows.h): the shuffle that spreads sub-block 2c's int16 scale
 * over a register's low half and 2c + 1's over its high half, from 8 int16 scales repeated in both halves. */
INLINE __m256i q6_k_scale_pick(const int c) {
    const char a = (char)(4 * c), b = (char)(4 * c + 1), e = (char)(4 * c + 2), f = (char)(4 * c + 3);
    return _mm256_setr_epi8(a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, e, f, e, f, e, f, e, f, e, f, e, f, e, f, e, f);
}

/* Q6_K's offset against 32 int8 x: -32 times each pair's sum, 16 int16 (the quants are stored + 32). */
INLINE __m256i q6_k_x_offsets(const __m256i xv) {
    return _mm256_maddubs_epi16(_mm256_set1_epi8(32), _mm256_sign_epi8(xv, _mm256_set1_epi8(-1)));
}

/* Group g of a row (K weights) into G; returns its number of weights (256, or fewer for the
 * last group of a row of 32-weight blocks). with_q 0: the scales and mins only (Q4_K, Q5_K,
 * Q5_0, Q5_1; the others decode their quants regardless). */
INLINE int decode_group(const int type, const uint8_t *restrict row, const int64_t g, const int64_t K, group_t *restrict G,
                        const int with_q) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    if (type == GGML_Q5_0 || type == GGML_Q5_1) {
        const int has_m = type == GGML_Q5_1, bsize = 22 + 2 * has_m;
        const int64_t first = g * 8, left = K / QK - first;
        const int count = left < 8 ? (int)left : 8;
        const uint8_t *blk = row + first * bsize;
        for (int i = 0; i < count; ++i, blk += bsize) {
            G->scale[i] = fp16(blk);
            if (has_m) G->min[i] = fp16(blk + 2);
            if (!with_q) continue;
            const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 6 + 2 * has_m));
            const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), low4);
            const __m256i set = bytes_from_bits(blk + 2 + 2 * has_m);
            /* Q5_0: q - 16 as int8 (nibble | 0xF0 where the 5th bit is clear); Q5_1: q */
            const __m256i q = has_m ? _mm256_or_si256(nib, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
                                    : _mm256_or_si256(nib, _mm256_andnot_si256(set, _mm256_set1_epi8((char)0xF0)));
            _mm256_store_si256((__m256i *)(G->q + 32 * i), q);
        }
        return count * QK;
    }
    const uint8_t *blk = row + g * block_bytes(type);
    if (type == GGML_Q4_K || type == GGML_Q5_K) {
        const int five = type == GGML_Q5_K;
        uint8_t sc[8], mn[8];
        k4_scales_mins(blk + 4, sc, mn);
        bytes_times(sc, 0, fp16(blk), G->scale);
        bytes_times(mn, 0, -fp16(blk + 2), G->min); /* -(dmin m): (d sc q) + min equals d sc q - dmin m exactly */
        if (!with_q) return QK_K;
        const uint8_t *ql = blk + 16 + 32 * five;
        const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(ql + 32 * j));
            __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            if (five) {
                lo = _mm256_or_si256(lo, k5_high(qh, 2 * j));
                hi = _mm256_or_si256(hi, k5_high(qh, 2 * j + 1));
            }
            _mm256_store_si256((__m256i *)(G->q + 64 * j), lo);
            _mm256_store_si256((__m256i *)(G->q + 64 * j + 32), hi);
        }
        return QK_K;
    }
    if (type == GGML_Q6_K) {
        const float d = fp16(blk + 208);
        bytes_times(blk + 192, 1, d, G->scale);
        bytes_times(blk + 200, 1, d, G->scale + 8);
        const __m256i bias = _mm256_set1_epi8(32);
        for (int h = 0; h < 2; ++h) {
            __m256i q[4];
            q6_k_quants(blk, h, q);
            for (int c = 0; c < 4; ++c) _mm256_store_si256((__m256i *)(G->q + 128 * h + 32 * c), _mm256_sub_epi8(q[c], bias));
        }
        return QK_K;
    }
    if (type == GGML_Q3_K) {
        int8_t sc[16];
        q3_k_scales(blk + 96, sc);
        const float d = fp16(blk + 108);
        bytes_times((const uint8_t *)sc, 1, d, G->scale);
        bytes_times((const uint8_t *)sc + 8, 1, d, G->scale + 8);
        const __m256i hm = _mm256_loadu_si256((const __m256i *)blk), m2 = _mm256_set1_epi8(0x03), four = _mm256_set1_epi8(4);
        for (int h = 0; h < 2; ++h) {
            const __m256i qv = _mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * h));
            for (int j = 0; j < 4; ++j) {
                const __m256i low = _mm256_and_si256(_mm256_srli_epi16(qv, 2 * j), m2);
                const __m256i bit = _mm256_set1_epi8((char)(1 << (4 * h + j)));
                const __m256i clear = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), _mm256_setzero_si256());
                _mm256_store_si256((__m256i *)(G->q + 128 * h + 32 * j), _mm256_sub_epi8(low, _mm256_and_si256(clear, four)));
            }
        }
        return QK_K;
    }
    /* Q2_K */
    const float d = fp16(blk + 80), dmin = -fp16(blk + 82);
    {
        const __m128i s = _mm_loadu_si128((const __m128i *)blk), m4 = _mm_set1_epi8(0x0F);
        uint8_t sc[16], mn[16];
        _mm_storeu_si128((__m128i *)sc, _mm_and_si128(s, m4));
        _mm_storeu_si128((__m128i *)mn, _mm_and_si128(_mm_srli_epi16(s, 4), m4));
        for (int i = 0; i < 16; i += 8) {
            bytes_times(sc + i, 0, d, G->scale + i);
            bytes_times(mn + i, 0, dmin, G->min + i);
        }
    }
    const __m256i m2 = _mm256_set1_epi8(0x03);
    for (int h = 0; h < 2; ++h) {
        const __m256i qv = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * h));
        for (int j = 0; j < 4; ++j)
            _mm256_store_si256((__m256i *)(G->q + 128 * h + 32 * j), _mm256_and_si256(_mm256_srli_epi16(qv, 2 * j), m2));
    }
    return QK_K;
}

/* Sub-block s32 (32 weights) of a decoded group as 4 x 8 floats. */
INLINE void group_q(const int type, const group_t *G, const int s32, __m256 q[4]) {
    (void)type;
    int8s((const uint8_t *)G->q + 32 * s32, q);
}

/* The float weights of sub-block s32: q scale + min, 4 x 8 (the w form). */
INLINE void group_w(const int type, const group_t *G, const int s32, __m256 w[4]) {
    __m256 q[4];
    group_q(type, G, s32, q);
    for (int i = 0; i < 4; ++i) {
        const int s = group_sub(type) == 32 ? s32 : 2 * s32 + i / 2;
        const __m256 sv = _mm256_set1_ps(G->scale[s]);
        w[i] = group_has_min(type) ? _mm256_fmadd_ps(q[i], sv, _mm256_set1_ps(G->min[s])) : _mm256_mul_ps(q[i], sv);
    }
}

/* Whether 1-4 rows of x take the t form (else the w form): the t form costs 4 + mt (32-weight
 * scales) or 4 + 2 mt (16-weight) multiply-adds per 32 weights, the w form 4 + 4 mt; Q2_K's
 * mins come in sub-blocks of 16, which x's block sums (of 32) do not cover. */
INLINE int group_t_form(const int type, const int64_t mt) {
    if (type == GGML_Q2_K) return 0;
    return group_sub(type) == 32 || mt <= 2;
}

/* The t form's step for one sub-block of 32 weights (q, 4 x 8 floats) against mt rows of x. */
INLINE void t_step(const int type, const __m256 q[4], const float *restrict xg, const int64_t K, const int64_t mt,
                   const float *scale, __m256 *acc) {
    for (int64_t m = 0; m < mt; ++m) {
        const float *xb = xg + m * K;
        if (group_sub(type) == 32) {
            __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
            t = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), t);
            t = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), t);
            t = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), t);
            acc[m] = _mm256_fmadd_ps(t, _mm256_set1_ps(scale[0]), acc[m]);
        } else {
            const __m256 t0 = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), _mm256_mul_ps(q[0], _mm256_loadu_ps(xb)));
            const __m256 t1 = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), _mm256_mul_ps(q[2], _mm256_loadu_ps(xb + 16)));
            acc[m] = _mm256_fmadd_ps(t0, _mm256_set1_ps(scale[0]), acc[m]);
            acc[m] = _mm256_fmadd_ps(t1, _mm256_set1_ps(scale[1]), acc[m]);
        }
    }
}

/* Rows [n0, n1) of W against rows [0, mt) of x (mt <= 4, or WIDE_TILE); xs = block sums of x
 * (of 32 weights), read only by the t form of types with mins. */
INLINE void group_rows(const int type, const uint8_t *restrict w, const int64_t row_bytes, const int64_t K,
                       const float *restrict x, const float *restrict xs, const int64_t mt, float *restrict y,
                       const int64_t ldy, const int64_t n0, const int64_t n1) {
    const int64_t ng = (K + GROUP - 1) / GROUP, nb = K / QK;
    const int t_form = mt <= 4 && group_t_form(type, mt), mins = t_form && group_has_min(type);
    group_t groups[2];
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *row = w + n * row_bytes;
        prefetch_ahead(row, row_bytes, n, n1);
        __m256 acc[WIDE_TILE], macc[4];
        float tail[4];
        for (int64_t m = 0; m < mt; ++m) acc[m] = _mm256_setzero_ps();
        for (int64_t m = 0; m < 4; ++m) {
            macc[m] = _mm256_setzero_ps();
            tail[m] = 0.f;
        }
        /* decoded one group ahead: the group's int8 stores are long written when its loads come
         * (a load right behind a wider store to the same bytes stalls on store forwarding). The
         * t form of Q4_K reads its nibbles straight from the block, 2 sub-blocks a load, as
         * fused_rows does (the group holds its scales and mins only). */
        const int direct = t_form && type == GGML_Q4_K;
        int next_nw = decode_group(type, row, 0, K, &groups[0], !direct);
        for (int64_t g = 0; g < ng; ++g) {
            const group_t *restrict G = &groups[g & 1];
            const int nw = next_nw;
            if (g + 1 < ng) next_nw = decode_group(type, row, g + 1, K, &groups[(g + 1) & 1], !direct);
            if (direct) {
                const uint8_t *qs = row + g * 144 + 16;
                for (int j = 0; j < 4; ++j) {
                    __m256i a[4];
                    __m256 lo[4], hi[4];
                    for (int i = 0; i < 4; ++i) {
                        a[i] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 32 * j + 8 * i)));
                        lo[i] = _mm256_cvtepi32_ps(_mm256_and_si256(a[i], _mm256_set1_epi32(0x0F)));
                        hi[i] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a[i], 4));
                    }
                    t_step(type, lo, x + g * GROUP + 64 * j, K, mt, G->scale + 2 * j, acc);
                    t_step(type, hi, x + g * GROUP + 64 * j + 32, K, mt, G->scale + 2 * j + 1, acc);
                }
            } else {
                for (int s32 = 0; s32 < nw / 32; ++s32) {
                    const float *xg = x + g * GROUP + 32 * s32;
                    if (t_form) {
                        __m256 q[4];
                        group_q(type, G, s32, q);
                        t_step(type, q, xg, K, mt, G->scale + (group_sub(type) == 32 ? s32 : 2 * s32), acc);
                    } else {
                        __m256 wv[4];
                        group_w(type, G, s32, wv);
                        for (int64_t m = 0; m < mt; ++m) {
                            const float *xb = xg + m * K;
                            for (int i = 0; i < 4; ++i) acc[m] = _mm256_fmadd_ps(wv[i], _mm256_loadu_ps(xb + 8 * i), acc[m]);
                        }
                    }
                }
            }
            if (mins) { /* sub-blocks of 32: min j against x's block sum j */
                if (nw == GROUP) {
                    const __m256 mv = _mm256_load_ps(G->min);
                    for (int64_t m = 0; m < mt; ++m) macc[m] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + m * nb + g * 8), macc[m]);
                } else {
                    for (int64_t m = 0; m < mt; ++m)
                        for (int s = 0; s < nw / 32; ++s) tail[m] += G->min[s] * xs[m * nb + g * 8 + s];
                }
            }
        }
        for (int64_t m = 0; m < mt; ++m) y[m * ldy + n] = mins ? hsum(acc[m]) + hsum(macc[m]) + tail[m] : hsum(acc[m]);
    }
}

/* ---- dequantization ----------------------------------------------------------------------- */

INLINE void dequant_simple(const int type, const uint8_t *blk, float *y) {
    const float d = fp16(blk);
    __m256 q[4];
    const __m256 dv = _mm256_set1_ps(d);
    if (type == GGML_Q8_0) {
        int8s(blk + 2, q);
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(y + 8 * i, _mm256_mul_ps(q[i], dv));
        return;
    }
    if (type == GGML_Q4_1) {
        const __m256 mv = _mm256_set1_ps(fp16(blk + 2));
        nibbles(blk + 4, q);
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(y + 8 * i, _mm256_add_ps(_mm256_mul_ps(q[i], dv), mv));
        return;
    }
    nibbles(blk + 2, q);
    const __m256 eight = _mm256_set1_ps(8.f);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(y + 8 * i, _mm256_mul_ps(_mm256_sub_ps(q[i], eight), dv));
}

/* Group by group: q scale (+ min), multiplied then added as dequant_block_scalar does. */
INLINE void dequant_groups(const int type, const uint8_t *row, const int64_t K, float *out) {
    group_t G;
    for (int64_t g = 0; g < (K + GROUP - 1) / GROUP; ++g) {
        const int nw = decode_group(type, row, g, K, &G, 1);
        for (int s32 = 0; s32 < nw / 32; ++s32) {
            __m256 q[4];
            group_q(type, &G, s32, q);
            for (int i = 0; i < 4; ++i) {
                const int s = group_sub(type) == 32 ? s32 : 2 * s32 + i / 2;
                __m256 v = _mm256_mul_ps(q[i], _mm256_set1_ps(G.scale[s]));
                if (group_has_min(type)) v = _mm256_add_ps(v, _mm256_set1_ps(G.min[s]));
                _mm256_storeu_ps(out + g * GROUP + 32 * s32 + 8 * i, v);
            }
        }
    }
}

static void dequant_row_avx2(const int type, const uint8_t *row, const int64_t K, float *out) {
    switch (type) {
    case GGML_Q4_0: case GGML_Q4_1: case GGML_Q8_0: {
        const int64_t bb = block_bytes(type);
        for (int64_t b = 0; b < K / QK; ++b) dequant_simple(type, row + b * bb, out + b * QK);
        return;
    }
    case GGML_Q5_0: dequant_groups(GGML_Q5_0, row, K, out); return;
    case GGML_Q5_1: dequant_groups(GGML_Q5_1, row, K, out); return;
    case GGML_Q2_K: dequant_groups(GGML_Q2_K, row, K, out); return;
    case GGML_Q3_K: dequant_groups(GGML_Q3_K, row, K, out); return;
    case GGML_Q4_K: dequant_groups(GGML_Q4_K, row, K, out); return;
    case GGML_Q5_K: dequant_groups(GGML_Q5_K, row, K, out); return;
    case GGML_Q6_K: dequant_groups(GGML_Q6_K, row, K, out); return;
    default: dequant_row_scalar(type, row, K, out); /* I8_ROW */
    }
}

#endif
