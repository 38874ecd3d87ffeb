/* The AVX-512 (F + BW + VL) loop of the GGUF kernel for the types of group_rows (Q5_0, Q5_1,
 * Q2_K-Q6_K): rows of W against 1-8 rows of x, 16 float lanes a register where gguf_avx2.h has 8.
 *
 * At decode shapes the fused loops are bound by their vector operations, not by memory (one
 * thread reads 5-10 GB/s of blocks); a 512-bit register converts 16 weights to float and
 * multiplies 16 of them into x in one operation each, so a sub-block of 32 weights costs about
 * half the operations of the AVX2 loop. x stays float32 and the accumulation float32: only the
 * summation order differs from the dequantized weight times x, as in every other loop here.
 *
 *   Q4_K, Q5_K, Q5_0, Q5_1 (sub-blocks of 32): the quants are read straight from the block
 *       (16 bytes widened to 16 lanes; the 5th bit of Q5 merged through a lane mask), the
 *       scales and mins from decode_group (with_q 0).
 *   Q6_K, Q3_K, Q2_K (sub-blocks of 16): decode_group's int8 quants, 16 a register.
 *
 * At one row of x, Q5_0 / Q5_1 take rows_512_1 instead (blocks read in place, 4 rows of W at a time).
 *
 * Two forms, as in group_rows: the t form (1-2 rows of x, sub-blocks of 32) sums q x over a
 * sub-block and multiplies the sum by its scale, mins against x's block sums; the w form makes
 * the sub-block's float weights (q scale + min) once and multiplies them into every row.
 */
#ifndef PAGODA_GGUF_AVX512_H
#define PAGODA_GGUF_AVX512_H

#include <immintrin.h>
#include <math.h>

#include "gguf_avx2.h"

/* Whether group_rows_512 reads the quants of `type` straight from the block (sub-blocks of 32). */
INLINE int direct_512(const int type) {
    return type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q5_0 || type == GGML_Q5_1;
}

INLINE __m512 lanes_to_ps(const __m512i v) { return _mm512_cvtepi32_ps(v); }

/* Q4_K / Q5_K: the sub-blocks 2p and 2p + 1 of a block as floats, q[0..1] and q[2..3] (16 each). */
INLINE void k_pair_512(const int type, const uint8_t *restrict blk, const int p, __m512 q[4]) {
    const int five = type == GGML_Q5_K;
    const uint8_t *ql = blk + 16 + 32 * five + 32 * p, *qh = blk + 16;
    const __m512i low4 = _mm512_set1_epi32(0x0F), bit5 = _mm512_set1_epi32(0x10);
    for (int h = 0; h < 2; ++h) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ql + 16 * h)));
        __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_srli_epi32(v, 4);
        if (five) { /* bit 2p of qh[l] is the 5th bit of weight l of sub-block 2p, bit 2p + 1 of 2p + 1 */
            const __m128i bits = _mm_loadu_si128((const __m128i *)(qh + 16 * h));
            lo = _mm512_mask_or_epi32(lo, _mm_test_epi8_mask(bits, _mm_set1_epi8((char)(1 << (2 * p)))), lo, bit5);
            hi = _mm512_mask_or_epi32(hi, _mm_test_epi8_mask(bits, _mm_set1_epi8((char)(1 << (2 * p + 1)))), hi, bit5);
        }
        q[h] = lanes_to_ps(lo);
        q[2 + h] = lanes_to_ps(hi);
    }
}

/* One sub-block of 32 weights (q[0..1], floats) against mt rows of x at xg (rows K apart):
 * the t form when t_form (scale s32 = scale[0]), else the w form (sub-blocks of 32 or 16). */
INLINE void step_512(const int type, const int t_form, const __m512 q[2], const float *restrict xg, const int64_t K,
                     const int64_t mt, const float *scale, const float *min, __m512 *acc) {
    if (t_form) {
        const __m512 sv = _mm512_set1_ps(scale[0]);
        for (int64_t m = 0; m < mt; ++m) {
            const float *xb = xg + m * K;
            const __m512 t = _mm512_fmadd_ps(q[1], _mm512_loadu_ps(xb + 16), _mm512_mul_ps(q[0], _mm512_loadu_ps(xb)));
            acc[m] = _mm512_fmadd_ps(t, sv, acc[m]);
        }
        return;
    }
    __m512 wv[2];
    for (int i = 0; i < 2; ++i) {
        const int s = group_sub(type) == 32 ? 0 : i;
        const __m512 sv = _mm512_set1_ps(scale[s]);
        wv[i] = group_has_min(type) ? _mm512_fmadd_ps(q[i], sv, _mm512_set1_ps(min[s])) : _mm512_mul_ps(q[i], sv);
    }
    for (int64_t m = 0; m < mt; ++m) {
        const float *xb = xg + m * K;
        acc[m] = _mm512_fmadd_ps(wv[0], _mm512_loadu_ps(xb), acc[m]);
        acc[m] = _mm512_fmadd_ps(wv[1], _mm512_loadu_ps(xb + 16), acc[m]);
    }
}

/* Q5_0 / Q5_1: one block's 32 weights as floats, q[0] weights 0-15, q[1] 16-31 (Q5_0: q - 16); the
 * 5th bits tested in vector registers (qh broadcast, one lane bit each) rather than moved to mask
 * registers from a general register, which at one row of x cost more than the rest of the block. */
INLINE void q5_block_512(const int has_m, const uint8_t *restrict blk, __m512 q[2]) {
    uint32_t qh;
    memcpy(&qh, blk + 2 + 2 * has_m, 4);
    const __m512i bits = _mm512_set1_epi32((int)qh);
    const __m512i lo_bit = _mm512_set_epi32(1 << 15, 1 << 14, 1 << 13, 1 << 12, 1 << 11, 1 << 10, 1 << 9, 1 << 8,
                                            1 << 7, 1 << 6, 1 << 5, 1 << 4, 1 << 3, 1 << 2, 1 << 1, 1 << 0);
    const __m512i hi_bit = _mm512_slli_epi32(lo_bit, 16);
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 6 + 2 * has_m)));
    __m512i lo = _mm512_and_si512(v, _mm512_set1_epi32(0x0F)), hi = _mm512_srli_epi32(v, 4);
    if (has_m) {
        lo = _mm512_mask_or_epi32(lo, _mm512_test_epi32_mask(bits, lo_bit), lo, _mm512_set1_epi32(0x10));
        hi = _mm512_mask_or_epi32(hi, _mm512_test_epi32_mask(bits, hi_bit), hi, _mm512_set1_epi32(0x10));
    } else {
        lo = _mm512_mask_or_epi32(lo, _mm512_testn_epi32_mask(bits, lo_bit), lo, _mm512_set1_epi32(-16));
        hi = _mm512_mask_or_epi32(hi, _mm512_testn_epi32_mask(bits, hi_bit), hi, _mm512_set1_epi32(-16));
    }
    q[0] = lanes_to_ps(lo);
    q[1] = lanes_to_ps(hi);
}

/* Whether rows_512_1 takes `type` at one row of x. Q4_0 / Q4_1 / Q8_0 in this form measured no
 * faster than fused_rows (Q4_1 576 x 1536, one thread: 62.0 vs 61.7 us), so they keep it. */
INLINE int one_row_512(const int type) { return type == GGML_Q5_0 || type == GGML_Q5_1; }

/* Q5_0 / Q5_1 against one row of x (decode at one token), R rows of W at a time (a constant in
 * each inlined copy). Each block straight from memory, 16 weights a register, its scale read in
 * place rather than through decode_group; R independent accumulators, so one row's chain of
 * multiply-adds is not the loop's bound and a short row's loop and final sum are paid once for
 * R rows; Q5_1's min times x's block sum xs, as fused_rows does Q4_1's. Measured, one row of x,
 * Gemma 3 270M's 2048 x 640 Q5_0 gate: one thread 105 -> 99 us, two 66 -> 53 us, against
 * group_rows_512's t form. */
INLINE void tile_512_1(const int type, const uint8_t *restrict w, const int64_t row_bytes, const int64_t nb,
                       const float *restrict x, const float *restrict xs, float *restrict y, const int64_t n,
                       const int64_t n1, const int R) {
    const int has_m = type == GGML_Q5_1;
    const int64_t bsize = 22 + 2 * has_m;
    __m512 acc[4];
    float mins[4];
    for (int r = 0; r < R; ++r) {
        acc[r] = _mm512_setzero_ps();
        mins[r] = 0.f;
    }
    for (int r = 0; r < R; ++r) prefetch_ahead(w + (n + r) * row_bytes, row_bytes, n + r, n1);
    for (int64_t b = 0; b < nb; ++b) {
        const float *xb = x + b * QK;
        const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        for (int r = 0; r < R; ++r) {
            const uint8_t *blk = w + (n + r) * row_bytes + b * bsize;
            const float d = fp16(blk);
            __m512 q[2];
            q5_block_512(has_m, blk, q);
            const __m512 t = _mm512_fmadd_ps(q[1], x1, _mm512_mul_ps(q[0], x0));
            acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(d), acc[r]);
            if (has_m) mins[r] += fp16(blk + 2) * xs[b];
        }
    }
    for (int r = 0; r < R; ++r) y[n + r] = _mm512_reduce_add_ps(acc[r]) + mins[r];
}

INLINE void rows_512_1(const int type, const uint8_t *restrict w, const int64_t row_bytes, const int64_t K,
                       const float *restrict x, const float *restrict xs, float *restrict y, const int64_t n0,
                       const int64_t n1) {
    const int64_t nb = K / QK;
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) tile_512_1(type, w, row_bytes, nb, x, xs, y, n, n1, 4);
    for (; n < n1; ++n) tile_512_1(type, w, row_bytes, nb, x, xs, y, n, n1, 1);
}

/* Rows [n0, n1) of W against rows [0, mt) of x, 1 <= mt <= WIDE_TILE; xs = block sums of x
 * (of 32 weights), read by the t form of types with mins. */
INLINE void group_rows_512(const int type, const uint8_t *restrict w, const int64_t row_bytes, const int64_t K,
                           const float *restrict x, const float *restrict xs, const int64_t mt, float *restrict y,
                           const int64_t ldy, const int64_t n0, const int64_t n1) {
    const int64_t ng = (K + GROUP - 1) / GROUP, nb = K / QK;
    /* the t form costs 3 operations a row per 32 weights, the w form 2 plus 2 a row */
    const int t_form = group_sub(type) == 32 && mt <= 2, mins = t_form && group_has_min(type);
    const int direct = direct_512(type);
    group_t groups[2];
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *row = w + n * row_bytes;
        prefetch_ahead(row, row_bytes, n, n1);
        __m512 acc[WIDE_TILE];
        __m256 macc[2];
        float tail[2] = {0.f, 0.f};
        for (int64_t m = 0; m < mt; ++m) acc[m] = _mm512_setzero_ps();
        macc[0] = macc[1] = _mm256_setzero_ps();
        /* decoded one group ahead (see group_rows: store forwarding) */
        int next_nw = decode_group(type, row, 0, K, &groups[0], !direct);
        for (int64_t g = 0; g < ng; ++g) {
            const group_t *restrict G = &groups[g & 1];
            const int nw = next_nw;
            if (g + 1 < ng) next_nw = decode_group(type, row, g + 1, K, &groups[(g + 1) & 1], !direct);
            const float *xg = x + g * GROUP;
            if (type == GGML_Q4_K || type == GGML_Q5_K) {
                const uint8_t *blk = row + g * block_bytes(type);
                for (int p = 0; p < 4; ++p) {
                    __m512 q[4];
                    k_pair_512(type, blk, p, q);
                    step_512(type, t_form, q, xg + 64 * p, K, mt, G->scale + 2 * p, G->min + 2 * p, acc);
                    step_512(type, t_form, q + 2, xg + 64 * p + 32, K, mt, G->scale + 2 * p + 1, G->min + 2 * p + 1,
                             acc);
                }
            } else if (type == GGML_Q5_0 || type == GGML_Q5_1) {
                const int64_t bsize = block_bytes(type);
                for (int s = 0; s < nw / 32; ++s) {
                    __m512 q[2];
                    q5_block_512(type == GGML_Q5_1, row + (g * 8 + s) * bsize, q);
                    step_512(type, t_form, q, xg + 32 * s, K, mt, G->scale + s, G->min + s, acc);
                }
            } else { /* sub-blocks of 16, decoded: scales 2 s32 and 2 s32 + 1 */
                for (int s32 = 0; s32 < nw / 32; ++s32) {
                    const int8_t *qs = G->q + 32 * s32;
                    const __m512 q[2] = {lanes_to_ps(_mm512_cvtepi8_epi32(_mm_load_si128((const __m128i *)qs))),
                                         lanes_to_ps(_mm512_cvtepi8_epi32(_mm_load_si128((const __m128i *)(qs + 16))))};
                    step_512(type, 0, q, xg + 32 * s32, K, mt, G->scale + 2 * s32, G->min + 2 * s32, acc);
                }
            }
            if (mins) { /* sub-blocks of 32: min j against x's block sum j */
                if (nw == GROUP) {
                    const __m256 mv = _mm256_load_ps(G->min);
                    for (int64_t m = 0; m < mt; ++m)
                        macc[m] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + m * nb + g * 8), macc[m]);
                } else {
                    for (int64_t m = 0; m < mt; ++m)
                        for (int s = 0; s < nw / 32; ++s) tail[m] += G->min[s] * xs[m * nb + g * 8 + s];
                }
            }
        }
        for (int64_t m = 0; m < mt; ++m)
            y[m * ldy + n] = _mm512_reduce_add_ps(acc[m]) + (mins ? hsum(macc[m]) + tail[m] : 0.f);
    }
}

#if defined(__AVX512VNNI__)
/* ---- int8 activations (`--gguf-int8-activations`): Q5_0, Q4_K and Q6_K against one row of x, llama.cpp's way --
 *
 * Opt-in, and the only loops here that are not float32-grade: x is rounded to int8 per block of 32
 * (scale max|x| / 127, as llama.cpp's Q8_0 activations; the scale kept in float32), and a block's
 * 32 weights (5-bit, unsigned) are multiplied into it as bytes by one vpdpbusd, 4 products a lane,
 * exact in int32; the block's -16 offset is -16 times the sum of its int8 x, the accumulator's
 * starting value. The float loop above (rows_512_1) widens every weight to a float lane and
 * multiplies 16 a register; on AMD's Zen 4, which runs a 512-bit operation as two 256-bit ones,
 * 32 bytes a 256-bit register cost about half the operations. Q4_K the same way, a sub-block of 32
 * 4-bit quants against a block of x, its scale d sc times x's; its min (dmin m) against the sum of
 * the rounded x of the block; Q6_K's 6-bit quants with 16 scales a 256, two a register. Relative
 * error of a product against the float32 one: ~5e-3 (the
 * bound: tests/kernels/test_gguf_matmul.py). */

/* x [K] -> xq [K] int8, xd [K / 32] (the blocks' scales), xc [K / 32] (-16 times each block's int8 sum: Q5_0's
 * offset), xs [K / 32] (each block's sum of the rounded x, xd times its int8 sum: Q4_K's mins) and x4 [K / 4]
 * (-32 times the sum of each 4 int8 x: Q6_K's offset, lane by lane) */
INLINE void quantize_x_q8(const float *restrict x, const int64_t K, int8_t *restrict xq, float *restrict xd,
                          int32_t *restrict xc, float *restrict xs, int32_t *restrict x4) {
    const __m256i ones = _mm256_set1_epi8(1);
    for (int64_t b = 0; b < K / QK; ++b) {
        const float *xb = x + QK * b;
        const __m512 a0 = _mm512_loadu_ps(xb), a1 = _mm512_loadu_ps(xb + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
        const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(a0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(a1, inv));
        _mm_storeu_si128((__m128i *)(xq + QK * b), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(xq + QK * b + 16), _mm512_cvtsepi32_epi8(q1));
        /* a NaN or infinity in the block (its sum's exponent all ones, tested on the bits: fast-math is on)
         * makes its scale NaN, so the products come out NaN as float32 x's would, not quietly finite */
        const float sum = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
        uint32_t bits;
        memcpy(&bits, &sum, 4);
        xd[b] = (bits & 0x7F800000u) == 0x7F800000u ? __builtin_nanf("") : amax / 127.f;
        const int32_t qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        xc[b] = -16 * qsum;
        xs[b] = xd[b] * (float)qsum;
        /* Q6_K's offset, a lane at a time (its sub-blocks of 16 split a block of x): -32 times each 4 x's sum */
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + QK * b));
        const __m256i sums4 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, xv);
        _mm256_storeu_si256((__m256i *)(x4 + 8 * b), _mm256_mullo_epi32(sums4, _mm256_set1_epi32(-32)));
    }
}

/* A Q5_0 block's 32 quants as unsigned bytes 0-31, weight i in byte i: the 16 bytes of nibbles in
 * both halves, the upper half shifted down 4, then 16 added where the block's 5th bit is set. */
INLINE __m256i q5_0_bytes(const uint8_t *restrict blk) {
    uint32_t qh;
    memcpy(&qh, blk + 2, 4);
    const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blk + 6)));
    const __m256i shift = _mm256_set_epi64x(4, 4, 0, 0);
    const __m256i nibbles = _mm256_and_si256(_mm256_srlv_epi64(both, shift), _mm256_set1_epi8(0x0F));
    return _mm256_mask_add_epi8(nibbles, (__mmask32)qh, nibbles, _mm256_set1_epi8(0x10));
}

INLINE __m256i dot4_add(const __m256i acc, const __m256i u, const __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }

#include "gguf_q8_rows.h"

/* Rows [n0, n1) of a Q6_K W against the int8 row: per 256 weights its 16 scales (d sc, one per 16
 * weights) and four 32-byte registers of 6-bit quants (unsigned, 0-63) a half, each against a block of
 * x; the -32 offset starts each lane (x4), and the lanes of a register's two sub-blocks take their own
 * scale. */
INLINE void rows_q6_k_q8(const uint8_t *restrict w, const int64_t row_bytes, const int64_t K, const int8_t *restrict xq,
                         const float *restrict xd, const int32_t *restrict x4, float *restrict y, const int64_t n0,
                         const int64_t n1) {
    const int64_t ng = K / QK_K;
    float sc[16] __attribute__((aligned(32)));
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *row = w + n * row_bytes;
        prefetch_ahead(row, row_bytes, n, n1);
        __m256 acc = _mm256_setzero_ps();
        for (int64_t g = 0; g < ng; ++g) {
            const uint8_t *blk = row + g * 210;
            const float d = fp16(blk + 208);
            bytes_times(blk + 192, 1, d, sc);
            bytes_times(blk + 200, 1, d, sc + 8);
            for (int h = 0; h < 2; ++h) {
                __m256i q[4];
                q6_k_quants(blk, h, q);
                for (int c = 0; c < 4; ++c) {
                    const int64_t b = g * 8 + 4 * h + c;
                    const int s0 = 8 * h + 2 * c;
                    const __m256i dot = _mm256_dpbusd_epi32(_mm256_loadu_si256((const __m256i *)(x4 + 8 * b)), q[c],
                                                            _mm256_loadu_si256((const __m256i *)(xq + QK * b)));
                    const __m256 scale = _mm256_set_m128(_mm_set1_ps(sc[s0 + 1] * xd[b]), _mm_set1_ps(sc[s0] * xd[b]));
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc);
                }
            }
        }
        y[n] = hsum256(acc);
    }
}

/* ---- Q5_0 against one row of x, float32-grade (the default at one row; gguf_set_digit_activations) -------
 *
 * The float loop (rows_512_1) widens every weight to a float lane: ~12 512-bit operations a block of
 * 32. Here x is carried as integers instead, exactly enough to stand for float32 x: each 4 values
 * scaled by a power of two (2^(22 - e), e the exponent of their largest |x|) and rounded to integers
 * X, |X| <= 2^22, each split into three int8 digits (X = hi 65536 + mid 256 + lo, each in -128..127).
 * A block's 32 unsigned 5-bit quants (q5_0_bytes, as the int8 loop) times the three digits by three
 * vpdpbusd, the partial sums shifted 8 bits between them: each lane's sum of 4 q X exact in int32
 * (|lane| < 2^30), the -16 offset (-16 times the 4 X's sum) added exactly, then converted and scaled
 * by d 2^(e - 22), the lane's own scale. Beyond the float loop's roundings (a product, each add),
 * only x's: at most 2^-23 of the largest |x| of its 4 (float32's own rounding of a value is 2^-24 of
 * it), and the 4 products' sum is exact. Largest error against float64, relative to sum |x w| (2,048 x
 * 640, 640 x 2,048; tests/kernels/test_gguf_matmul.py bounds it at 1e-6): 3-6e-8 for normal x (the float
 * loop 2-3e-8), 2-3e-7 with 1 % of x 300 times the rest (the float loop 1.5-1.7e-7). 2 threads, weights
 * in cache, 2,048 x 640: 51.4 us float loop, 41.8 us here; in a decode step of a Gemma 3-shaped Q4_K_M
 * file (63 M Q5_0 weights a token, streamed from memory) 2.53-2.57 -> 2.25-2.34 ms a step.
 * A NaN or an infinity in a block makes its scales NaN, as in quantize_x_q8. */

/* x [K] -> xd3 [K / 32][3][32] (each block's hi, mid and lo digits), xsc [K / 4] (each 4's 2^(e - 22),
 * NaN for a block holding a NaN or an infinity) and xoff [K / 4] (-16 times each 4 X's sum: Q5_0's offset) */
INLINE void digits_x(const float *restrict x, const int64_t K, int8_t *restrict xd3, float *restrict xsc,
                     int32_t *restrict xoff) {
    const __m256i ones = _mm256_set1_epi8(1);
    const __m512i c128 = _mm512_set1_epi32(128), c255 = _mm512_set1_epi32(255);
    const __m512 floor_e = _mm512_set1_ps(-100.f), one = _mm512_set1_ps(1.f), top = _mm512_set1_ps(22.f);
    for (int64_t b = 0; b < K / QK; ++b) {
        const float *xb = x + QK * b;
        int8_t *d = xd3 + 3 * QK * b;
        const __m512 a[2] = {_mm512_loadu_ps(xb), _mm512_loadu_ps(xb + 16)};
        const float sum = _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1]));
        uint32_t bits;
        memcpy(&bits, &sum, 4);
        const int bad = (bits & 0x7F800000u) == 0x7F800000u;
        for (int h = 0; h < 2; ++h) {
            /* each lane: the largest |x| of its 4, its exponent e (largest < 2^e; -100 at least, so the
             * scales stay normal floats, and for 0), X = x 2^(22 - e) rounded to nearest */
            __m512 m = _mm512_abs_ps(a[h]);
            m = _mm512_max_ps(m, _mm512_permute_ps(m, _MM_SHUFFLE(2, 3, 0, 1)));
            m = _mm512_max_ps(m, _mm512_permute_ps(m, _MM_SHUFFLE(1, 0, 3, 2)));
            const __m512 e = _mm512_max_ps(_mm512_add_ps(_mm512_getexp_ps(m), one), floor_e);
            const __m512i X = _mm512_cvtps_epi32(_mm512_scalef_ps(a[h], _mm512_sub_ps(top, e)));
            const __m512 down = _mm512_scalef_ps(one, _mm512_sub_ps(e, top));
            _mm_storeu_ps(xsc + 8 * b + 4 * h, _mm512_castps512_ps128(_mm512_maskz_compress_ps(0x1111, down)));
            const __m512i lo = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(X, c128), c255), c128);
            const __m512i r = _mm512_srai_epi32(_mm512_sub_epi32(X, lo), 8);
            const __m512i mid = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(r, c128), c255), c128);
            const __m512i hi = _mm512_srai_epi32(_mm512_sub_epi32(r, mid), 8);
            _mm_storeu_si128((__m128i *)(d + 16 * h), _mm512_cvtepi32_epi8(hi));
            _mm_storeu_si128((__m128i *)(d + QK + 16 * h), _mm512_cvtepi32_epi8(mid));
            _mm_storeu_si128((__m128i *)(d + 2 * QK + 16 * h), _mm512_cvtepi32_epi8(lo));
        }
        if (bad) _mm256_storeu_ps(xsc + 8 * b, _mm256_set1_ps(__builtin_nanf("")));
        /* each 4 X's sum from its digits' sums, then times -16 */
        __m256i s4 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, _mm256_loadu_si256((const __m256i *)d));
        s4 = _mm256_dpbusd_epi32(_mm256_slli_epi32(s4, 8), ones, _mm256_loadu_si256((const __m256i *)(d + QK)));
        s4 = _mm256_dpbusd_epi32(_mm256_slli_epi32(s4, 8), ones, _mm256_loadu_si256((const __m256i *)(d + 2 * QK)));
        _mm256_storeu_si256((__m256i *)(xoff + 8 * b), _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(s4, 4)));
    }
}

/* Rows [n, n + R) of a Q5_0 W against x's digits (xd3, xsc, xoff), R independent accumulators. */
INLINE void tile_q5_0_d3(const uint8_t *restrict w, const int64_t row_bytes, const int64_t nb,
                         const int8_t *restrict xd3, const float *restrict xsc, const int32_t *restrict xoff,
                         float *restrict y, const int64_t n, const int64_t n1, const int R) {
    __m256 acc[4];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) prefetch_ahead(w + (n + r) * row_bytes, row_bytes, n + r, n1);
    for (int64_t b = 0; b < nb; ++b) {
        const int8_t *d = xd3 + 3 * QK * b;
        const __m256i xh = _mm256_loadu_si256((const __m256i *)d);
        const __m256i xm = _mm256_loadu_si256((const __m256i *)(d + QK));
        const __m256i xl = _mm256_loadu_si256((const __m256i *)(d + 2 * QK));
        const __m256i off = _mm256_loadu_si256((const __m256i *)(xoff + 8 * b));
        const __m256 s = _mm256_loadu_ps(xsc + 8 * b);
        for (int r = 0; r < R; ++r) {
            const uint8_t *blk = w + (n + r) * row_bytes + 22 * b;
            const __m256i q = q5_0_bytes(blk);
            __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, xh);
            dot = _mm256_dpbusd_epi32(_mm256_slli_epi32(dot, 8), q, xm);
            dot = _mm256_dpbusd_epi32(_mm256_slli_epi32(dot, 8), q, xl);
            dot = _mm256_add_epi32(dot, off);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(_mm256_set1_ps(fp16(blk)), s), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) y[n + r] = hsum256(acc[r]);
}

INLINE void rows_q5_0_d3(const uint8_t *restrict w, const int64_t row_bytes, const int64_t K,
                         const int8_t *restrict xd3, const float *restrict xsc, const int32_t *restrict xoff,
                         float *restrict y, const int64_t n0, const int64_t n1) {
    const int64_t nb = K / QK;
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) tile_q5_0_d3(w, row_bytes, nb, xd3, xsc, xoff, y, n, n1, 4);
    for (; n < n1; ++n) tile_q5_0_d3(w, row_bytes, nb, xd3, xsc, xoff, y, n, n1, 1);
}
#endif

#endif
