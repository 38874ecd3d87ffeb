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

#endif
