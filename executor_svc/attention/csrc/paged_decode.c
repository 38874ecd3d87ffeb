/* Paged decode attention on the CPU: one query token per sequence, K/V read in place
 * from the paged cache (no gathered copy), grouped-query heads sharing each K/V row.
 *
 *   q       [num_seqs, num_heads, head_dim]                       float32, contiguous
 *   k_cache [num_blocks, block_size, num_kv_heads, head_dim]      float32, contiguous (v_cache alike;
 *                                                                 bfloat16 in paged_decode_attention_bf16)
 *   table   [num_seqs, table_stride]                              int32 block ids
 *   seq_lens[num_seqs]                                            int32, >= 1
 *   out     [num_seqs, num_heads, head_dim]                       float32
 *
 * The caller splits the sequences into one contiguous range per thread (each call runs on
 * one thread; Python releases the GIL around it). For a sequence every head is scored
 * against every key, reading each K row (all kv heads: contiguous) once; the scores are
 * softmaxed in float32 and each V row is read once to accumulate the outputs. A query
 * head h reads kv head h / (num_heads / num_kv_heads) (grouped-query attention).
 *
 * The bfloat16 entry reads a bfloat16 cache (each value widened to float32 exactly: its 16
 * bits are the high half of the float) and computes as the float32 one does; q and out stay
 * float32 (the caller casts a bfloat16 query in and the output back).
 *
 * Built with -fopenmp-simd only: the simd pragmas vectorise the head_dim loops; no OpenMP
 * runtime is linked (torch brings its own). -ffast-math lets expf vectorise (libmvec) and
 * the dot products reassociate; no infinity or NaN is ever formed here (the running max
 * starts from the first block's).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Ask for the next block while this one is worked on: blocks sit at random places, so the
 * hardware prefetchers cannot guess them, and one core alone has too few misses in flight to
 * reach the memory bandwidth. */
static inline void prefetch_block(const char *block, const int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(block + i, 0, 1);
}

static inline float bf16_to_float(const uint16_t x) {
    union {
        uint32_t u;
        float f;
    } v = {(uint32_t)x << 16};
    return v.f;
}

/* The value at element index i of a K/V row: float32, or bfloat16 widened (kv_bf16, a constant
 * in every inlined copy, so each copy has one load and no branch). */
#define KV_AT(row, i) (kv_bf16 ? bf16_to_float(((const uint16_t *)(row))[i]) : ((const float *)(row))[i])
#define KV_PTR(base, offset) ((const char *)(base) + (offset) * (kv_bf16 ? 2 : 4))

/* One sequence, every head, one pass over its blocks (online softmax, as flash-decoding):
 * each K/V row of a block (all kv heads, contiguous) is read once, and the next block's K and
 * V are requested while this one is worked on. `scratch` holds num_heads * (block_size + 2)
 * floats. */
static inline __attribute__((always_inline)) void attend_seq(
    const float *restrict qs, const void *restrict k_cache, const void *restrict v_cache,
    const int32_t *restrict blocks, const int64_t len, float *restrict os, float *restrict scratch,
    const int64_t num_heads, const int64_t group, const int64_t head_dim, const int64_t block_size,
    const int64_t row_stride, const float scale, const int kv_bf16) {
    const int64_t block_floats = block_size * row_stride; /* values of a block (all kv heads) */
    const int64_t block_bytes = block_floats * (kv_bf16 ? 2 : 4);
    float *restrict p = scratch;                                   /* [num_heads][block_size] */
    float *restrict m = scratch + num_heads * block_size;          /* running max per head */
    float *restrict l = m + num_heads;                             /* running sum per head */
    for (int64_t h = 0; h < num_heads; ++h) {
        m[h] = 0.f; /* set by the first block */
        l[h] = 0.f;
        float *o = os + h * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) o[d] = 0.f;
    }
    for (int64_t j0 = 0; j0 < len; j0 += block_size) {
        const int64_t b = j0 / block_size;
        const char *kb = KV_PTR(k_cache, (int64_t)blocks[b] * block_floats);
        const char *vb = KV_PTR(v_cache, (int64_t)blocks[b] * block_floats);
        const int64_t n = len - j0 < block_size ? len - j0 : block_size;
        if (j0 + block_size < len) {
            prefetch_block(KV_PTR(k_cache, (int64_t)blocks[b + 1] * block_floats), block_bytes);
            prefetch_block(KV_PTR(v_cache, (int64_t)blocks[b + 1] * block_floats), block_bytes);
        }
        for (int64_t t = 0; t < n; ++t) {
            const char *k_row = KV_PTR(kb, t * row_stride);
            for (int64_t h = 0; h < num_heads; ++h) {
                const float *qh = qs + h * head_dim;
                const char *k = KV_PTR(k_row, (h / group) * head_dim);
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * KV_AT(k, d);
                p[h * block_size + t] = dot * scale;
            }
        }
        for (int64_t h = 0; h < num_heads; ++h) {
            float *ph = p + h * block_size;
            float block_max = ph[0];
            for (int64_t t = 1; t < n; ++t) block_max = ph[t] > block_max ? ph[t] : block_max;
            const float new_max = (j0 == 0 || block_max > m[h]) ? block_max : m[h];
            const float correction = j0 == 0 ? 1.f : expf(m[h] - new_max); /* o and l are 0 before the first */
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < n; ++t) {
                ph[t] = expf(ph[t] - new_max);
                sum += ph[t];
            }
            l[h] = l[h] * correction + sum;
            m[h] = new_max;
            if (correction != 1.f) {
                float *o = os + h * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) o[d] *= correction;
            }
        }
        for (int64_t t = 0; t < n; ++t) {
            const char *v_row = KV_PTR(vb, t * row_stride);
            for (int64_t h = 0; h < num_heads; ++h) {
                const float w = p[h * block_size + t];
                const char *v = KV_PTR(v_row, (h / group) * head_dim);
                float *o = os + h * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) o[d] += w * KV_AT(v, d);
            }
        }
    }
    for (int64_t h = 0; h < num_heads; ++h) {
        float *o = os + h * head_dim;
        const float c = 1.f / l[h];
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) o[d] *= c;
    }
}

/* Sequences [seq_begin, seq_end) of a float32 (kv_bf16 0) or bfloat16 (1) cache. */
static inline __attribute__((always_inline)) void attend_range(
    const float *restrict q, const void *restrict k_cache, const void *restrict v_cache,
    const int32_t *restrict table, int64_t table_stride, const int32_t *restrict seq_lens, float *restrict out,
    float *restrict scratch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    float scale, int64_t seq_begin, int64_t seq_end, const int kv_bf16) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row_stride = num_kv_heads * head_dim; /* values between consecutive tokens of a block */
    for (int64_t seq = seq_begin; seq < seq_end; ++seq) {
        const int32_t *blocks = table + seq * table_stride;
        const float *qs = q + seq * num_heads * head_dim;
        float *os = out + seq * num_heads * head_dim;
        const int64_t len = seq_lens[seq];
        /* constant head sizes let the compiler unroll the head_dim loops completely */
        switch (head_dim) {
        case 64:
            attend_seq(qs, k_cache, v_cache, blocks, len, os, scratch, num_heads, group, 64, block_size, row_stride, scale,
                       kv_bf16);
            break;
        case 128:
            attend_seq(qs, k_cache, v_cache, blocks, len, os, scratch, num_heads, group, 128, block_size, row_stride,
                       scale, kv_bf16);
            break;
        default:
            attend_seq(qs, k_cache, v_cache, blocks, len, os, scratch, num_heads, group, head_dim, block_size,
                       row_stride, scale, kv_bf16);
        }
    }
}

/* `scratch`: num_heads * (block_size + 2) floats. */
void paged_decode_attention(const float *restrict q, const float *restrict k_cache, const float *restrict v_cache,
                            const int32_t *restrict table, int64_t table_stride, const int32_t *restrict seq_lens,
                            float *restrict out, float *restrict scratch, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, float scale, int64_t seq_begin, int64_t seq_end) {
    attend_range(q, k_cache, v_cache, table, table_stride, seq_lens, out, scratch, num_heads, num_kv_heads, head_dim,
                 block_size, scale, seq_begin, seq_end, 0);
}

/* The same over a bfloat16 cache (uint16_t bit patterns); q, out and scratch float32. */
void paged_decode_attention_bf16(const float *restrict q, const uint16_t *restrict k_cache,
                                 const uint16_t *restrict v_cache, const int32_t *restrict table, int64_t table_stride,
                                 const int32_t *restrict seq_lens, float *restrict out, float *restrict scratch,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                 float scale, int64_t seq_begin, int64_t seq_end) {
    attend_range(q, k_cache, v_cache, table, table_stride, seq_lens, out, scratch, num_heads, num_kv_heads, head_dim,
                 block_size, scale, seq_begin, seq_end, 1);
}
