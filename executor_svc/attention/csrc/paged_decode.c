/* Paged decode attention on the CPU: one query token per sequence, K/V read in place
 * from the paged cache (no gathered copy), grouped-query heads sharing each K/V row.
 *
 *   q       [num_seqs, num_heads, head_dim]                       float32, contiguous
 *   k_cache [num_blocks, block_size, num_kv_heads, head_dim]      float32, contiguous (v_cache alike;
 *                                                                 bfloat16 in paged_decode_attention_bf16)
 *   table   [num_seqs, table_stride]                              int32 block ids
 *   seq_lens[num_seqs]                                            int32, >= 1
 *   out     [num_seqs, num_heads, head_dim]                       float32
 *   window  a sliding layer's window (0: none): a sequence of length L attends to keys
 *           max(0, L - window) .. L - 1, read from inside the first one's block; the blocks
 *           before it are never read (the KV manager may have freed them)
 *
 * paged_decode_attention(_bf16) runs a range of sequences on the calling thread (a caller
 * without OpenMP splits the sequences into one range per thread; Python releases the GIL around
 * each call); paged_decode_attention_parts runs them all on the OpenMP team, a long sequence
 * split into parts (split-K, see num_parts) with the same bits. For a sequence every head is scored
 * against every key, reading each K row (all kv heads: contiguous) once; the scores are
 * softmaxed in float32 and each V row is read once to accumulate the outputs. A query
 * head h reads kv head h / (num_heads / num_kv_heads) (grouped-query attention).
 *
 * The bfloat16 entry reads a bfloat16 cache (each value widened to float32 exactly: its 16
 * bits are the high half of the float) and computes as the float32 one does; q and out stay
 * float32 (the caller casts a bfloat16 query in and the output back).
 *
 * Built with -fopenmp where the compiler has it, else -fopenmp-simd: the simd pragmas vectorise
 * the head_dim loops either way. With -fopenmp, paged_decode_attention_parts runs the ranges on
 * the OpenMP team, which is torch's own when the process has one OpenMP runtime (the library's
 * libgomp.so.1 is then torch's, already loaded: the caller checks); -ffast-math lets expf vectorise (libmvec) and
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
    const int64_t row_stride, const float scale, const int kv_bf16, const int64_t key_begin) {
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
    for (int64_t j0 = key_begin, n; j0 < len; j0 += n) { /* a window's first block is read from its first key */
        const int64_t b = j0 / block_size, off = j0 - b * block_size;
        const char *kb = KV_PTR(k_cache, (int64_t)blocks[b] * block_floats + off * row_stride);
        const char *vb = KV_PTR(v_cache, (int64_t)blocks[b] * block_floats + off * row_stride);
        n = len - j0 < block_size - off ? len - j0 : block_size - off;
        if ((b + 1) * block_size < len) {
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
            const float new_max = (j0 == key_begin || block_max > m[h]) ? block_max : m[h];
            const float correction = j0 == key_begin ? 1.f : expf(m[h] - new_max); /* o, l are 0 before the first */
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

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 values of a K/V row from element i, widened to float32 for a bfloat16 cache. */
static inline __attribute__((always_inline)) __m512 kv_load16(const char *row, const int64_t i, const int kv_bf16) {
    if (kv_bf16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)row + i);
}

/* exp(x) for 16 floats: 2^(x log2 e) as 2^n (scalef) times 2^f, |f| <= 1/2, by its Taylor
 * polynomial of degree 7 (relative error below 1e-8 before rounding: the float32 expf's
 * accuracy); x <= 0 here (a score minus the running max), so it only underflows, to 0. */
static inline __attribute__((always_inline)) __m512 exp512(const __m512 x) {
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f)); /* f ln 2 */
    __m512 p = _mm512_set1_ps(1.f / 5040.f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 720.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* Lane i of the result: the sum of the 16 lanes of v[SUM16_SLOT[i]] (a transposing tree of
 * shuffles and adds: 15 adds for 16 sums instead of 16 horizontal reductions). */
static const int SUM16_SLOT[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
static inline __attribute__((always_inline)) __m512 sum16(const __m512 *v) {
    __m512 s1[8], s2[4], s3[2];
    for (int j = 0; j < 8; ++j)
        s1[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[j], v[j + 8], 0x44), _mm512_shuffle_f32x4(v[j], v[j + 8], 0xEE));
    for (int j = 0; j < 4; ++j)
        s2[j] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[j], s1[j + 4], 0x88), _mm512_shuffle_f32x4(s1[j], s1[j + 4], 0xDD));
    for (int j = 0; j < 2; ++j)
        s3[j] = _mm512_add_ps(_mm512_shuffle_ps(s2[j], s2[j + 2], 0x44), _mm512_shuffle_ps(s2[j], s2[j + 2], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], 0x88), _mm512_shuffle_ps(s3[0], s3[1], 0xDD));
}

/* attend_seq with AVX-512 registers, for head_dim = 16 * NV, NV <= MAX_NV (a constant in each inlined copy)
 * and a grouped-query group of at most MAX_GROUP heads: the loops run per kv head, so each K or
 * V row is widened once for the whole group, the group's queries (for the scores) or outputs
 * (for the sums) stay in registers across a block's tokens, and only the scores go through
 * memory. The same arithmetic as attend_seq (float32 products and sums, online softmax per
 * block); only the order of the additions inside a dot product differs. */
#define MAX_GROUP 8
#define MAX_NV 16 /* head_dim 256 (Gemma 2 and 3): the group's queries spill to the stack, L1 reads */
static inline __attribute__((always_inline)) void attend_seq_avx512(
    const float *restrict qs, const void *restrict k_cache, const void *restrict v_cache,
    const int32_t *restrict blocks, const int64_t len, float *restrict os, float *restrict scratch,
    const int64_t num_heads, const int64_t group, const int64_t num_kv_heads, const int NV, const int64_t block_size,
    const int64_t row_stride, const float scale, const int kv_bf16, const int64_t key_begin, const int64_t key_end,
    float *restrict ml_out) {
    const int64_t head_dim = 16 * NV;
    const int64_t block_floats = block_size * row_stride;
    const int64_t block_bytes = block_floats * (kv_bf16 ? 2 : 4);
    float *restrict p = scratch;                          /* [num_heads][block_size] */
    float *restrict m = scratch + num_heads * block_size; /* running max per head */
    float *restrict l = m + num_heads;                    /* running sum per head */
    for (int64_t h = 0; h < num_heads; ++h) {
        m[h] = 0.f;
        l[h] = 0.f;
        for (int64_t d = 0; d < head_dim; ++d) os[h * head_dim + d] = 0.f;
    }
    const int64_t end = key_end < len ? key_end : len;
    for (int64_t j0 = key_begin, n; j0 < end; j0 += n) {
        /* keys j0 .. j0 + n - 1, in one block: a window's first key may sit inside its block */
        const int64_t b = j0 / block_size, off = j0 - b * block_size;
        const char *kb = KV_PTR(k_cache, (int64_t)blocks[b] * block_floats + off * row_stride);
        const char *vb = KV_PTR(v_cache, (int64_t)blocks[b] * block_floats + off * row_stride);
        n = end - j0 < block_size - off ? end - j0 : block_size - off;
        /* the next block's K and V are requested a slice at a time, one slice per row read here,
         * so the loads of this block's rows and the requests for the next overlap (all at once
         * after a partial first block, whose fewer rows would request only part of it) */
        const int has_next = (b + 1) * block_size < end;
        const char *next_k = has_next ? KV_PTR(k_cache, (int64_t)blocks[b + 1] * block_floats) : kb;
        const char *next_v = has_next ? KV_PTR(v_cache, (int64_t)blocks[b + 1] * block_floats) : vb;
        const int64_t slice = block_bytes / (num_kv_heads * block_size); /* bytes requested per row read */
        if (has_next && off) {
            prefetch_block(next_k, block_bytes);
            prefetch_block(next_v, block_bytes);
        }
        /* scores: p[h][t] = scale * q_h . k_t */
        for (int64_t g = 0; g < num_kv_heads; ++g) {
            __m512 q[MAX_GROUP][MAX_NV];
            for (int64_t hh = 0; hh < group; ++hh)
                for (int i = 0; i < NV; ++i) q[hh][i] = _mm512_loadu_ps(qs + (g * group + hh) * head_dim + 16 * i);
            for (int64_t t0 = 0; t0 < n; t0 += 16) { /* 16 tokens' products, then their 16 sums at once */
                const int64_t nt = n - t0 < 16 ? n - t0 : 16;
                __m512 acc[MAX_GROUP][16];
                for (int64_t tt = 0; tt < 16; ++tt) {
                    const int slot = SUM16_SLOT[tt];
                    if (tt >= nt) {
                        for (int64_t hh = 0; hh < group; ++hh) acc[hh][slot] = _mm512_setzero_ps();
                        continue;
                    }
                    const int64_t t = t0 + tt;
                    const char *k = KV_PTR(kb, t * row_stride + g * head_dim);
                    if (has_next)
                        for (int64_t c = 0; c < slice; c += 64)
                            __builtin_prefetch(next_k + (g * block_size + t) * slice + c, 0, 1);
                    __m512 kv[MAX_NV];
                    for (int i = 0; i < NV; ++i) kv[i] = kv_load16(k, 16 * i, kv_bf16);
                    for (int64_t hh = 0; hh < group; ++hh) {
                        __m512 a = _mm512_mul_ps(q[hh][0], kv[0]);
                        for (int i = 1; i < NV; ++i) a = _mm512_fmadd_ps(q[hh][i], kv[i], a);
                        acc[hh][slot] = a;
                    }
                }
                const __mmask16 mask = nt == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nt) - 1);
                for (int64_t hh = 0; hh < group; ++hh)
                    _mm512_mask_storeu_ps(p + (g * group + hh) * block_size + t0, mask,
                                          _mm512_mul_ps(sum16(acc[hh]), _mm512_set1_ps(scale)));
            }
        }
        /* online softmax over the block, per head (as attend_seq) */
        float correction[num_heads];
        for (int64_t h = 0; h < num_heads; ++h) {
            float *ph = p + h * block_size;
            __m512 vmax = _mm512_set1_ps(-3.0e38f);
            for (int64_t t0 = 0; t0 < n; t0 += 16) {
                const __mmask16 mask = n - t0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t0)) - 1);
                vmax = _mm512_mask_max_ps(vmax, mask, vmax, _mm512_maskz_loadu_ps(mask, ph + t0));
            }
            const float block_max = _mm512_reduce_max_ps(vmax);
            const float new_max = (j0 == key_begin || block_max > m[h]) ? block_max : m[h];
            correction[h] = j0 == key_begin ? 1.f : expf(m[h] - new_max);
            __m512 vsum = _mm512_setzero_ps();
            for (int64_t t0 = 0; t0 < n; t0 += 16) {
                const __mmask16 mask = n - t0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t0)) - 1);
                const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, ph + t0), _mm512_set1_ps(new_max)));
                _mm512_mask_storeu_ps(ph + t0, mask, e);
                vsum = _mm512_mask_add_ps(vsum, mask, vsum, e);
            }
            l[h] = l[h] * correction[h] + _mm512_reduce_add_ps(vsum);
            m[h] = new_max;
        }
        /* o_h = o_h * correction + sum_t p[h][t] v_t, the group's outputs in registers */
        for (int64_t g = 0; g < num_kv_heads; ++g) {
            __m512 o[MAX_GROUP][MAX_NV];
            for (int64_t hh = 0; hh < group; ++hh) {
                const __m512 c = _mm512_set1_ps(correction[g * group + hh]);
                for (int i = 0; i < NV; ++i)
                    o[hh][i] = _mm512_mul_ps(c, _mm512_loadu_ps(os + (g * group + hh) * head_dim + 16 * i));
            }
            for (int64_t t = 0; t < n; ++t) {
                const char *v = KV_PTR(vb, t * row_stride + g * head_dim);
                if (has_next)
                    for (int64_t c = 0; c < slice; c += 64) __builtin_prefetch(next_v + (g * block_size + t) * slice + c, 0, 1);
                __m512 vv[MAX_NV];
                for (int i = 0; i < NV; ++i) vv[i] = kv_load16(v, 16 * i, kv_bf16);
                for (int64_t hh = 0; hh < group; ++hh) {
                    const __m512 w = _mm512_set1_ps(p[(g * group + hh) * block_size + t]);
                    for (int i = 0; i < NV; ++i) o[hh][i] = _mm512_fmadd_ps(w, vv[i], o[hh][i]);
                }
            }
            for (int64_t hh = 0; hh < group; ++hh)
                for (int i = 0; i < NV; ++i) _mm512_storeu_ps(os + (g * group + hh) * head_dim + 16 * i, o[hh][i]);
        }
    }
    if (ml_out) { /* one part of a split sequence: o unnormalised, each head's max and sum beside it */
        for (int64_t h = 0; h < num_heads; ++h) {
            ml_out[2 * h] = m[h];
            ml_out[2 * h + 1] = l[h];
        }
        return;
    }
    for (int64_t h = 0; h < num_heads; ++h) {
        const __m512 c = _mm512_set1_ps(1.f / l[h]);
        for (int i = 0; i < NV; ++i)
            _mm512_storeu_ps(os + h * head_dim + 16 * i, _mm512_mul_ps(c, _mm512_loadu_ps(os + h * head_dim + 16 * i)));
    }
}
#endif

#if defined(__AVX512F__)
/* Split-K (flash-decoding): a sequence of the AVX-512 loop with at least 2 * PART_MIN_KEYS keys
 * is attended in parts of whole blocks, at most MAX_PARTS, each with its own running max and
 * sum, then merged in part order. The parts depend on the sequence's length and the block size
 * alone, not on the threads, so a one-thread call and paged_decode_attention_parts (which runs
 * the parts of one sequence on several threads: one long stream's decode is no longer one
 * core's) give the same bits. A shorter sequence is one part: the whole-sequence loop. */
#define MAX_PARTS 8
#define PART_MIN_KEYS 64

static inline int avx512_ok(const int64_t group, const int64_t head_dim) {
    return group <= MAX_GROUP && (head_dim == 64 || head_dim == 128 || head_dim == 256);
}

/* The parts of keys [first, len) (first > 0 under a sliding window): by the blocks they touch. */
static inline int64_t num_parts(const int64_t first, const int64_t len, const int64_t block_size) {
    const int64_t blocks = (len - 1) / block_size - first / block_size + 1;
    const int64_t parts = blocks / ((PART_MIN_KEYS + block_size - 1) / block_size);
    return parts < 1 ? 1 : parts > MAX_PARTS ? MAX_PARTS : parts;
}

/* Keys [begin, end) of part p of `parts` of keys [first, len) (whole blocks, as even as the blocks
 * allow; the first part starts at `first`, possibly inside its block). */
static inline void part_keys(const int64_t first, const int64_t len, const int64_t block_size, const int64_t parts,
                             const int64_t p, int64_t *begin, int64_t *end) {
    const int64_t b0 = first / block_size, blocks = (len - 1) / block_size - b0 + 1;
    const int64_t b = (b0 + blocks * p / parts) * block_size, e = (b0 + blocks * (p + 1) / parts) * block_size;
    *begin = b > first ? b : first;
    *end = e < len ? e : len;
}
#endif

/* The first key a decode at position len - 1 sees: a sliding window of `window` keys (0: none)
 * ends at the query (transformers' mask: key j visible when j > len - 1 - window). */
static inline int64_t first_key(const int64_t len, const int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

#if defined(__AVX512F__)

/* Floats of one part's result: o [num_heads][head_dim], then (max, sum) per head. */
static inline int64_t part_floats(const int64_t num_heads, const int64_t head_dim) {
    return num_heads * (head_dim + 2);
}

static inline __attribute__((always_inline)) void attend_part(
    const float *restrict qs, const void *restrict k_cache, const void *restrict v_cache,
    const int32_t *restrict blocks, const int64_t len, float *restrict os, float *restrict scratch,
    const int64_t num_heads, const int64_t group, const int64_t num_kv_heads, const int64_t head_dim,
    const int64_t block_size, const int64_t row_stride, const float scale, const int kv_bf16, const int64_t key_begin,
    const int64_t key_end, float *restrict ml_out) {
    if (head_dim == 64)
        attend_seq_avx512(qs, k_cache, v_cache, blocks, len, os, scratch, num_heads, group, num_kv_heads, 4,
                          block_size, row_stride, scale, kv_bf16, key_begin, key_end, ml_out);
    else if (head_dim == 128)
        attend_seq_avx512(qs, k_cache, v_cache, blocks, len, os, scratch, num_heads, group, num_kv_heads, 8,
                          block_size, row_stride, scale, kv_bf16, key_begin, key_end, ml_out);
    else
        attend_seq_avx512(qs, k_cache, v_cache, blocks, len, os, scratch, num_heads, group, num_kv_heads, 16,
                          block_size, row_stride, scale, kv_bf16, key_begin, key_end, ml_out);
}

/* os = the parts' outputs merged: each rescaled to the largest max, summed in part order, over
 * the rescaled sums. */
static inline void merge_parts(const float *restrict partial, const int64_t parts, float *restrict os,
                               const int64_t num_heads, const int64_t head_dim) {
    const int64_t stride = part_floats(num_heads, head_dim), ml = num_heads * head_dim;
    for (int64_t h = 0; h < num_heads; ++h) {
        float mx = partial[ml + 2 * h];
        for (int64_t p = 1; p < parts; ++p) {
            const float mp = partial[p * stride + ml + 2 * h];
            mx = mp > mx ? mp : mx;
        }
        float w[MAX_PARTS], total = 0.f;
        for (int64_t p = 0; p < parts; ++p) {
            w[p] = expf(partial[p * stride + ml + 2 * h] - mx);
            total += w[p] * partial[p * stride + ml + 2 * h + 1];
        }
        const __m512 inv = _mm512_set1_ps(1.f / total);
        for (int64_t d = 0; d < head_dim; d += 16) {
            __m512 acc = _mm512_mul_ps(_mm512_set1_ps(w[0]), _mm512_loadu_ps(partial + h * head_dim + d));
            for (int64_t p = 1; p < parts; ++p)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(w[p]), _mm512_loadu_ps(partial + p * stride + h * head_dim + d),
                                      acc);
            _mm512_storeu_ps(os + h * head_dim + d, _mm512_mul_ps(acc, inv));
        }
    }
}
#endif

/* Sequences [seq_begin, seq_end) of a float32 (kv_bf16 0) or bfloat16 (1) cache. */
static inline __attribute__((always_inline)) void attend_range(
    const float *restrict q, const void *restrict k_cache, const void *restrict v_cache,
    const int32_t *restrict table, int64_t table_stride, const int32_t *restrict seq_lens, float *restrict out,
    float *restrict scratch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    float scale, int64_t seq_begin, int64_t seq_end, const int kv_bf16, const int64_t window) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row_stride = num_kv_heads * head_dim; /* values between consecutive tokens of a block */
    for (int64_t seq = seq_begin; seq < seq_end; ++seq) {
        const int32_t *blocks = table + seq * table_stride;
        const float *qs = q + seq * num_heads * head_dim;
        float *os = out + seq * num_heads * head_dim;
        const int64_t len = seq_lens[seq], first = first_key(len, window);
#if defined(__AVX512F__)
        if (avx512_ok(group, head_dim)) {
            const int64_t parts = num_parts(first, len, block_size);
            if (parts == 1) {
                attend_part(qs, k_cache, v_cache, blocks, len, os, scratch, num_heads, group, num_kv_heads, head_dim,
                            block_size, row_stride, scale, kv_bf16, first, len, NULL);
                continue;
            }
            float partial[MAX_PARTS * part_floats(num_heads, head_dim)];
            for (int64_t p = 0; p < parts; ++p) {
                int64_t begin, end;
                part_keys(first, len, block_size, parts, p, &begin, &end);
                float *po = partial + p * part_floats(num_heads, head_dim);
                attend_part(qs, k_cache, v_cache, blocks, len, po, scratch, num_heads, group, num_kv_heads, head_dim,
                            block_size, row_stride, scale, kv_bf16, begin, end, po + num_heads * head_dim);
            }
            merge_parts(partial, parts, os, num_heads, head_dim);
            continue;
        }
#endif
        /* constant head sizes let the compiler unroll the head_dim loops completely */
        switch (head_dim) {
        case 64:
            attend_seq(qs, k_cache, v_cache, blocks, len, os, scratch, num_heads, group, 64, block_size, row_stride, scale,
                       kv_bf16, first);
            break;
        case 128:
            attend_seq(qs, k_cache, v_cache, blocks, len, os, scratch, num_heads, group, 128, block_size, row_stride,
                       scale, kv_bf16, first);
            break;
        default:
            attend_seq(qs, k_cache, v_cache, blocks, len, os, scratch, num_heads, group, head_dim, block_size,
                       row_stride, scale, kv_bf16, first);
        }
    }
}

/* `scratch`: num_heads * (block_size + 2) floats. `window`: a sliding window's keys (0: every key); the
 * table's blocks before the window's first key are never read (they may have been freed). */
void paged_decode_attention(const float *restrict q, const float *restrict k_cache, const float *restrict v_cache,
                            const int32_t *restrict table, int64_t table_stride, const int32_t *restrict seq_lens,
                            float *restrict out, float *restrict scratch, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, float scale, int64_t seq_begin, int64_t seq_end,
                            int64_t window) {
    attend_range(q, k_cache, v_cache, table, table_stride, seq_lens, out, scratch, num_heads, num_kv_heads, head_dim,
                 block_size, scale, seq_begin, seq_end, 0, window);
}

/* The same over a bfloat16 cache (uint16_t bit patterns); q, out and scratch float32. */
void paged_decode_attention_bf16(const float *restrict q, const uint16_t *restrict k_cache,
                                 const uint16_t *restrict v_cache, const int32_t *restrict table, int64_t table_stride,
                                 const int32_t *restrict seq_lens, float *restrict out, float *restrict scratch,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                 float scale, int64_t seq_begin, int64_t seq_end, int64_t window) {
    attend_range(q, k_cache, v_cache, table, table_stride, seq_lens, out, scratch, num_heads, num_kv_heads, head_dim,
                 block_size, scale, seq_begin, seq_end, 1, window);
}

/* paged_decode_attention_parts' arguments, every sequence on the calling thread (scratch's first row;
 * `threads` and `scratch_stride` unused): for a caller that holds one entry for either. The same bits. */
void paged_decode_attention_seqs(const float *restrict q, const void *restrict k_cache, const void *restrict v_cache,
                                 const int32_t *restrict table, int64_t table_stride, const int32_t *restrict seq_lens,
                                 float *restrict out, float *restrict scratch, int64_t scratch_stride,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                 float scale, int64_t num_seqs, int64_t threads, int64_t kv_bf16, int64_t window) {
    (void)scratch_stride;
    (void)threads;
    if (kv_bf16)
        attend_range(q, k_cache, v_cache, table, table_stride, seq_lens, out, scratch, num_heads, num_kv_heads,
                     head_dim, block_size, scale, 0, num_seqs, 1, window);
    else
        attend_range(q, k_cache, v_cache, table, table_stride, seq_lens, out, scratch, num_heads, num_kv_heads,
                     head_dim, block_size, scale, 0, num_seqs, 0, window);
}

#ifdef _OPENMP
#include <omp.h>
#include <stdlib.h>

/* One unit of paged_decode_attention_parts: a whole sequence (normalised into out), or part p of
 * one (into its place in `partial`). */
static inline __attribute__((always_inline)) void attend_unit(
    const float *restrict q, const void *restrict k_cache, const void *restrict v_cache,
    const int32_t *restrict table, int64_t table_stride, const int32_t *restrict seq_lens, float *restrict out,
    float *restrict scratch, float *restrict partial, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, int64_t seq, int64_t p, int64_t parts, const int kv_bf16, const int64_t window) {
    if (parts == 1) {
        attend_range(q, k_cache, v_cache, table, table_stride, seq_lens, out, scratch, num_heads, num_kv_heads,
                     head_dim, block_size, scale, seq, seq + 1, kv_bf16, window);
        return;
    }
#if defined(__AVX512F__)
    int64_t begin, end;
    part_keys(first_key(seq_lens[seq], window), seq_lens[seq], block_size, parts, p, &begin, &end);
    attend_part(q + seq * num_heads * head_dim, k_cache, v_cache, table + seq * table_stride, seq_lens[seq], partial,
                scratch, num_heads, num_heads / num_kv_heads, num_kv_heads, head_dim, block_size,
                num_kv_heads * head_dim, scale, kv_bf16, begin, end, partial + num_heads * head_dim);
#endif
}

/* Sequences [0, num_seqs) on an OpenMP team of `threads` threads: in a process whose one OpenMP
 * runtime is torch's, the same threads its GEMMs use (still spinning after the last one), where a
 * pool of our own would compete with them for the cores. The work goes out as units claimed in
 * turn: a whole sequence, or one part of a split one (num_parts), so one long sequence is
 * attended on every thread; the split sequences' parts are merged after. The same bits as one
 * thread. Thread i uses scratch + i * scratch_stride; `window` as paged_decode_attention's. */
void paged_decode_attention_parts(const float *restrict q, const void *restrict k_cache, const void *restrict v_cache,
                                  const int32_t *restrict table, int64_t table_stride, const int32_t *restrict seq_lens,
                                  float *restrict out, float *restrict scratch, int64_t scratch_stride,
                                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                  float scale, int64_t num_seqs, int64_t threads, int64_t kv_bf16, int64_t window) {
    int64_t first_stack[65], *first = num_seqs < 65 ? first_stack : malloc((num_seqs + 1) * sizeof(int64_t));
    first[0] = 0;
    int split = 0;
#if defined(__AVX512F__)
    split = avx512_ok(num_heads / num_kv_heads, head_dim);
#endif
    for (int64_t i = 0; i < num_seqs; ++i) {
        int64_t parts = 1;
#if defined(__AVX512F__)
        if (split) parts = num_parts(first_key(seq_lens[i], window), seq_lens[i], block_size);
#endif
        first[i + 1] = first[i] + parts;
    }
    const int64_t units = first[num_seqs];
    const int64_t pf = num_heads * (head_dim + 2); /* floats of one part's result */
    float *partial = units > num_seqs ? malloc(units * pf * sizeof(float)) : NULL;
#pragma omp parallel num_threads(threads)
    {
        float *mine = scratch + omp_get_thread_num() * scratch_stride;
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < units; ++u) {
            int64_t lo = 0, hi = num_seqs; /* the sequence whose units hold u: first[lo] <= u < first[lo + 1] */
            while (hi - lo > 1) {
                const int64_t mid = (lo + hi) / 2;
                if (first[mid] <= u) lo = mid;
                else hi = mid;
            }
            const int64_t parts = first[lo + 1] - first[lo];
            float *part = partial ? partial + u * pf : NULL;
            if (kv_bf16)
                attend_unit(q, k_cache, v_cache, table, table_stride, seq_lens, out, mine, part, num_heads,
                            num_kv_heads, head_dim, block_size, scale, lo, u - first[lo], parts, 1, window);
            else
                attend_unit(q, k_cache, v_cache, table, table_stride, seq_lens, out, mine, part, num_heads,
                            num_kv_heads, head_dim, block_size, scale, lo, u - first[lo], parts, 0, window);
        }
#if defined(__AVX512F__)
        if (partial) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < num_seqs; ++i)
                if (first[i + 1] - first[i] > 1)
                    merge_parts(partial + first[i] * pf, first[i + 1] - first[i], out + i * num_heads * head_dim,
                                num_heads, head_dim);
        }
#endif
    }
    free(partial);
    if (first != first_stack) free(first);
}
#endif
