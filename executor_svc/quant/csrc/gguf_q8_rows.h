/* The int8-activation loops that the AVX-512 VNNI build (gguf_avx512.h) and the AVX2 build (gguf_avx2_q8.h)
 * share: Q5_0 and Q4_K against one row of x rounded to int8 (quantize_x_q8). The includer defines
 * dot4_add(acc, u, s), vpdpbusd's operation (acc + the sums of each 4 adjacent products of unsigned bytes u
 * and signed bytes s), and q5_0_bytes(blk) (a Q5_0 block's 32 quants as unsigned bytes, weight i in byte i). */
#ifndef PAGODA_GGUF_Q8_ROWS_H
#define PAGODA_GGUF_Q8_ROWS_H

#include "gguf_avx2.h"

INLINE float hsum256(const __m256 v) { return hsum(v); }

/* Rows [n, n + R) of a Q5_0 W against the int8 row (xq, xd, xc): R rows of W at a time (a constant in
 * each inlined copy), each with its own accumulator; the block's -16 offset (xc) starts lane 0. */
INLINE void tile_q5_0_q8(const uint8_t *restrict w, const int64_t row_bytes, const int64_t nb,
                         const int8_t *restrict xq, const float *restrict xd, const int32_t *restrict xc,
                         float *restrict y, const int64_t n, const int64_t n1, const int R) {
    __m256 acc[4];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) prefetch_ahead(w + (n + r) * row_bytes, row_bytes, n + r, n1);
    for (int64_t b = 0; b < nb; ++b) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + QK * b));
        const __m256i start = _mm256_setr_epi32(xc[b], 0, 0, 0, 0, 0, 0, 0);
        const float dx = xd[b];
        for (int r = 0; r < R; ++r) {
            const uint8_t *blk = w + (n + r) * row_bytes + 22 * b;
            const __m256i dot = dot4_add(start, q5_0_bytes(blk), xv);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(fp16(blk) * dx), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) y[n + r] = hsum256(acc[r]);
}

INLINE void rows_q5_0_q8(const uint8_t *restrict w, const int64_t row_bytes, const int64_t K, const int8_t *restrict xq,
                         const float *restrict xd, const int32_t *restrict xc, float *restrict y, const int64_t n0,
                         const int64_t n1) {
    const int64_t nb = K / QK;
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) tile_q5_0_q8(w, row_bytes, nb, xq, xd, xc, y, n, n1, 4);
    for (; n < n1; ++n) tile_q5_0_q8(w, row_bytes, nb, xq, xd, xc, y, n, n1, 1);
}

/* Q4_K: a sub-block of 32 4-bit quants against a block of x, its scale d sc times x's; the mins
 * (-dmin m) against the blocks' sums of the rounded x. */
INLINE void rows_q4_k_q8(const uint8_t *restrict w, const int64_t row_bytes, const int64_t K, const int8_t *restrict xq,
                         const float *restrict xd, const float *restrict xs, float *restrict y, const int64_t n0,
                         const int64_t n1) {
    const int64_t ng = K / QK_K;
    const __m256i low4 = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
    group_t G;
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *row = w + n * row_bytes;
        prefetch_ahead(row, row_bytes, n, n1);
        __m256 acc = _mm256_setzero_ps(), macc = _mm256_setzero_ps();
        for (int64_t g = 0; g < ng; ++g) {
            decode_group(GGML_Q4_K, row, g, K, &G, 0);
            const uint8_t *ql = row + g * 144 + 16;
            const int64_t b0 = g * 8;
            for (int j = 0; j < 4; ++j) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(ql + 32 * j));
                const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                const int64_t b = b0 + 2 * j;
                const __m256i xlo = _mm256_loadu_si256((const __m256i *)(xq + QK * b));
                const __m256i xhi = _mm256_loadu_si256((const __m256i *)(xq + QK * b + QK));
                const __m256i dlo = dot4_add(zero, lo, xlo), dhi = dot4_add(zero, hi, xhi);
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dlo), _mm256_set1_ps(G.scale[2 * j] * xd[b]), acc);
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dhi), _mm256_set1_ps(G.scale[2 * j + 1] * xd[b + 1]), acc);
            }
            macc = _mm256_fmadd_ps(_mm256_load_ps(G.min), _mm256_loadu_ps(xs + b0), macc);
        }
        y[n] = hsum256(_mm256_add_ps(acc, macc));
    }
}

/* ---- several rows of x (prefill chunks, batched decode steps): each row of W against every row of x ----
 * x's rows quantized one by one as for one row (row m: xq + m K, xd / xc / xs + m K / 32, s16 + m K / 16), so
 * each row of the product equals, to the bit, the one-row loop's on the same x row (same integer dot products,
 * same float operations in the same order), except Q6_K: the same integers, other float roundings (the
 * one-row loops add the -32 offset inside each register's integers, which at one row reads fewer bytes; here
 * it is taken a group at a time). The weight row's scales are decoded once and its quants unpacked
 * once per XR rows of x; XR = 4 keeps the accumulators and a register of unpacked quants in the 16 ymm
 * registers. */
enum { XR = 4 };

INLINE void tile_q5_0_q8_m(const uint8_t *restrict row, const int64_t K, const int8_t *restrict xq,
                           const float *restrict xd, const int32_t *restrict xc, float *restrict y, const int64_t ldy,
                           const int R) {
    const int64_t nb = K / QK;
    __m256 acc[XR];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = row + 22 * b;
        const __m256i wq = q5_0_bytes(blk);
        const float d = fp16(blk);
        for (int r = 0; r < R; ++r) {
            const __m256i start = _mm256_setr_epi32(xc[r * nb + b], 0, 0, 0, 0, 0, 0, 0);
            const __m256i dot = dot4_add(start, wq, _mm256_loadu_si256((const __m256i *)(xq + r * K + QK * b)));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * xd[r * nb + b]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) y[r * ldy] = hsum256(acc[r]);
}

/* sc, mn: the row's sub-block scales (d sc) and mins (-dmin m), K / 32 each, from decode_group */
INLINE void tile_q4_k_q8_m(const uint8_t *restrict row, const int64_t K, const float *restrict sc,
                           const float *restrict mn, const int8_t *restrict xq, const float *restrict xd,
                           const float *restrict xs, float *restrict y, const int64_t ldy, const int R) {
    const int64_t ng = K / QK_K, nb = K / QK;
    const __m256i low4 = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
    __m256 acc[XR];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
        const uint8_t *ql = row + g * 144 + 16;
        for (int j = 0; j < 4; ++j) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(ql + 32 * j));
            const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            const int64_t b = g * 8 + 2 * j;
            for (int r = 0; r < R; ++r) {
                const int8_t *xr = xq + r * K + QK * b;
                const __m256i dlo = dot4_add(zero, lo, _mm256_loadu_si256((const __m256i *)xr));
                const __m256i dhi = dot4_add(zero, hi, _mm256_loadu_si256((const __m256i *)(xr + QK)));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dlo), _mm256_set1_ps(sc[b] * xd[r * nb + b]), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dhi), _mm256_set1_ps(sc[b + 1] * xd[r * nb + b + 1]), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        __m256 macc = _mm256_setzero_ps();
        for (int64_t g = 0; g < ng; ++g)
            macc = _mm256_fmadd_ps(_mm256_load_ps(mn + 8 * g), _mm256_loadu_ps(xs + r * nb + 8 * g), macc);
        y[r * ldy] = hsum256(_mm256_add_ps(acc[r], macc));
    }
}

/* Q6_K: 16 int8 scales a 256 (one per 16 weights) and d; 6-bit quants q, unsigned 0-63, weight d sc (q - 32).
 * A register of 32 quants is one block of x (two sub-blocks, one a 128-bit half): vpmaddubsw's pair sums of
 * q x (|.| <= 2 * 63 * 128), vpmaddwd against the two sub-blocks' scales, so the int32 lanes are already
 * scaled by sc and one float scale d xd[b] is left for the register. The -32 offset is taken a group at a
 * time: vpmaddwd of x's 16 sub-block sums (s16, int16) against the 16 scales gives each of the 8 blocks'
 * sum of sc x, times -32 d xd[b] into a second accumulator (one vpmaddwd a group, instead of x's pair sums
 * added to every register). */
INLINE void tile_q6_k_q8_m(const uint8_t *restrict row, const int64_t K, const int8_t *restrict xq,
                           const float *restrict xd, const int16_t *restrict s16, float *restrict y, const int64_t ldy,
                           const int R) {
    const int64_t ng = K / QK_K, nb = K / QK;
    __m256 acc[XR], cacc[XR];
    for (int r = 0; r < R; ++r) acc[r] = cacc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
        const uint8_t *blk = row + g * 210;
        const float d = fp16(blk + 208);
        const __m256i sc_all = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        const __m256 dm32 = _mm256_set1_ps(-32.f * d);
        for (int r = 0; r < R; ++r) {
            const __m256i sums = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(s16 + r * (K / 16) + 16 * g)), sc_all);
            const __m256 dx = _mm256_mul_ps(dm32, _mm256_loadu_ps(xd + r * nb + 8 * g));
            cacc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), dx, cacc[r]);
        }
        for (int h = 0; h < 2; ++h) {
            const __m256i sc = q6_k_half_scales(blk, h);
            __m256i q[4];
            q6_k_quants(blk, h, q);
            for (int c = 0; c < 4; ++c) {
                const int64_t b = g * 8 + 4 * h + c;
                const __m256i scc = _mm256_shuffle_epi8(sc, q6_k_scale_pick(c));
                for (int r = 0; r < R; ++r) {
                    const __m256i pairs = _mm256_maddubs_epi16(q[c], _mm256_loadu_si256((const __m256i *)(xq + r * K + QK * b)));
                    const __m256i dot = _mm256_madd_epi16(pairs, scc);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * xd[r * nb + b]), acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < R; ++r) y[r * ldy] = hsum256(_mm256_add_ps(acc[r], cacc[r]));
}

/* x's sub-block sums for tile_q6_k_q8_m: s16[i] = the sum of int8 x[16 i .. 16 i + 15] (|.| <= 2,048). */
INLINE void q6_k_x_sums(const int8_t *restrict xq, const int64_t K, int16_t *restrict s16) {
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < K / QK; ++b) {
        /* pairs -> 4-sums (int32, 8 lanes: 4 a sub-block) -> each 128-bit half's sum */
        const __m256i s4 = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, _mm256_loadu_si256((const __m256i *)(xq + QK * b))), ones16);
        const __m256i s8 = _mm256_hadd_epi32(s4, s4), s16v = _mm256_hadd_epi32(s8, s8);
        s16[2 * b] = (int16_t)_mm256_extract_epi32(s16v, 0);
        s16[2 * b + 1] = (int16_t)_mm256_extract_epi32(s16v, 4);
    }
}

/* Rows [n0, n1) of W (Q5_0, Q4_K or Q6_K) against the M int8 rows of x; y[m * ldy + n]. */
INLINE void rows_q8_m(const int type, const uint8_t *restrict w, const int64_t row_bytes, const int64_t K,
                      const int64_t M, const int8_t *restrict xq, const float *restrict xd, const int32_t *restrict xc,
                      const float *restrict xs, const int16_t *restrict s16, float *restrict y, const int64_t ldy,
                      const int64_t n0, const int64_t n1) {
    const int64_t nb = K / QK;
    float sc[MAX_K / QK] __attribute__((aligned(32))), mn[MAX_K / QK] __attribute__((aligned(32)));
    group_t G;
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *row = w + n * row_bytes;
        prefetch_ahead(row, row_bytes, n, n1);
        if (type == GGML_Q4_K) {
            for (int64_t g = 0; g < K / QK_K; ++g) {
                decode_group(GGML_Q4_K, row, g, K, &G, 0);
                memcpy(sc + 8 * g, G.scale, 8 * sizeof(float));
                memcpy(mn + 8 * g, G.min, 8 * sizeof(float));
            }
        }
        for (int64_t m = 0; m < M; m += XR) {
            const int R = M - m < XR ? (int)(M - m) : XR;
            const int8_t *q = xq + m * K;
            float *out = y + m * ldy + n;
#define PAGODA_Q8_TILE(RR)                                                                                             \
    if (type == GGML_Q5_0) tile_q5_0_q8_m(row, K, q, xd + m * nb, xc + m * nb, out, ldy, RR);                          \
    else if (type == GGML_Q4_K) tile_q4_k_q8_m(row, K, sc, mn, q, xd + m * nb, xs + m * nb, out, ldy, RR);           \
    else tile_q6_k_q8_m(row, K, q, xd + m * nb, s16 + m * (K / 16), out, ldy, RR);
            switch (R) { /* constant tile heights: the accumulators stay in registers */
            case 1: PAGODA_Q8_TILE(1) break;
            case 2: PAGODA_Q8_TILE(2) break;
            case 3: PAGODA_Q8_TILE(3) break;
            default: PAGODA_Q8_TILE(XR)
            }
#undef PAGODA_Q8_TILE
        }
    }
}

#endif
