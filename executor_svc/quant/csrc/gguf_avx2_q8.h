/* Int8 activations (`--gguf-int8-activations`) on a CPU with AVX2 but without AVX-512 VNNI, as llama.cpp's
 * AVX2 loops compute them: vpdpbusd (4 byte products summed into each int32 lane) written as vpmaddubsw +
 * vpmaddwd. The lanes hold the same integers (no int16 saturation: the unsigned operand is a quant of at
 * most 6 bits, |x| <= 127, so a pair's sum is at most 2 * 63 * 127 < 32767). Q5_0 and Q4_K take the loops
 * the VNNI build takes (gguf_q8_rows.h), so the two builds give the same bits there. Q6_K has its own loop
 * here: its lanes are scaled by the sub-blocks' integer scales (vpmaddwd; one float multiply a block of 32,
 * not two: on the 1B's ffn_down, 2 threads of an AVX2 EPYC, 10.2 -> 16.6 GB/s of weights), the same
 * integers before the last float rounding. Same formats: x rounded to int8 per block of 32, scale
 * max|x| / 127. */
#ifndef PAGODA_GGUF_AVX2_Q8_H
#define PAGODA_GGUF_AVX2_Q8_H

#include "gguf_avx2.h"

/* vpdpbusd(acc, u, s) on AVX2: acc + the sums of each 4 adjacent products u (unsigned bytes) * s (signed). */
INLINE __m256i dot4_add(const __m256i acc, const __m256i u, const __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

INLINE float hmax256(const __m256 v) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

/* x [K] -> xq, xd, xc and xs exactly as gguf_avx512.h's quantize_x_q8 makes them; in x4's place, Q6_K's
 * offset for rows_q6_k_q8 below: [K / 2] int16, -32 times each 2 int8 x's sum. */
INLINE void quantize_x_q8(const float *restrict x, const int64_t K, int8_t *restrict xq, float *restrict xd,
                          int32_t *restrict xc, float *restrict xs, int32_t *restrict x4) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), ones = _mm256_set1_epi8(1);
    for (int64_t b = 0; b < K / QK; ++b) {
        const float *xb = x + QK * b;
        __m256 a[4], m = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
            a[i] = _mm256_loadu_ps(xb + 8 * i);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, a[i]));
        }
        const float amax = hmax256(m);
        const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        __m256i q[4];
        for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(a[i], inv));
        /* packs interleave the 128-bit halves; the permute puts the 32 bytes back in x's order */
        const __m256i xv = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
        _mm256_storeu_si256((__m256i *)(xq + QK * b), xv);
        /* a NaN or infinity in the block makes its scale NaN (see gguf_avx512.h) */
        const float sum = hsum(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
        uint32_t bits;
        memcpy(&bits, &sum, 4);
        xd[b] = (bits & 0x7F800000u) == 0x7F800000u ? __builtin_nanf("") : amax / 127.f;
        const __m256i sums4 = dot4_add(_mm256_setzero_si256(), ones, xv);
        const __m128i s2 = _mm_add_epi32(_mm256_castsi256_si128(sums4), _mm256_extracti128_si256(sums4, 1));
        const __m128i s1 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, _MM_SHUFFLE(1, 0, 3, 2)));
        const int32_t qsum = _mm_cvtsi128_si32(_mm_add_epi32(s1, _mm_shuffle_epi32(s1, _MM_SHUFFLE(2, 3, 0, 1))));
        xc[b] = -16 * qsum;
        xs[b] = xd[b] * (float)qsum;
        _mm256_storeu_si256((__m256i *)(x4 + 8 * b), q6_k_x_offsets(xv));
    }
}

/* A Q5_0 block's 32 quants as unsigned bytes 0-31, weight i in byte i. */
INLINE __m256i q5_0_bytes(const uint8_t *restrict blk) {
    const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 6));
    const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), _mm256_set1_epi8(0x0F));
    return _mm256_or_si256(nib, _mm256_and_si256(bytes_from_bits(blk + 2), _mm256_set1_epi8(0x10)));
}

#include "gguf_q8_rows.h"

/* Q6_K: 16 int8 scales a 256 (one per 16 weights) and d; 6-bit quants unsigned 0-63. A register of 32
 * quants is one block of x (two sub-blocks, one a 128-bit half): vpmaddubsw's pair sums of q x plus x's
 * pair sums times -32 (x2, from quantize_x_q8) are the pairs of (q - 32) x, |.| <= 2 * 32 * 128; vpmaddwd
 * against the sub-blocks' scales (each half its own) makes int32 lanes already scaled by sc, so one float
 * scale d xd[b] is left for the register. */
INLINE void rows_q6_k_q8(const uint8_t *restrict w, const int64_t row_bytes, const int64_t K, const int8_t *restrict xq,
                         const float *restrict xd, const int32_t *restrict x2, float *restrict y, const int64_t n0,
                         const int64_t n1) {
    const int64_t ng = K / QK_K;
    const int16_t *x2h = (const int16_t *)x2;
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *row = w + n * row_bytes;
        prefetch_ahead(row, row_bytes, n, n1);
        __m256 acc = _mm256_setzero_ps();
        for (int64_t g = 0; g < ng; ++g) {
            const uint8_t *blk = row + g * 210;
            const float d = fp16(blk + 208);
            for (int h = 0; h < 2; ++h) {
                const __m256i sc = q6_k_half_scales(blk, h);
                __m256i q[4];
                q6_k_quants(blk, h, q);
                for (int c = 0; c < 4; ++c) {
                    const int64_t b = g * 8 + 4 * h + c;
                    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(q[c], _mm256_loadu_si256((const __m256i *)(xq + QK * b))),
                                                           _mm256_loadu_si256((const __m256i *)(x2h + 16 * b)));
                    const __m256i dot = _mm256_madd_epi16(pairs, _mm256_shuffle_epi8(sc, q6_k_scale_pick(c)));
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * xd[b]), acc);
                }
            }
        }
        y[n] = hsum256(acc);
    }
}

#endif
