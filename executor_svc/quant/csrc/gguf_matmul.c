/* y = x @ W.T with W kept in GGUF blocks, dequantized on the fly, accumulated in float32.
 *
 *   W  [N rows][row_bytes]   packed blocks of one GGML type along each row (K weights a row)
 *   x  [M][K]                float32, contiguous
 *   y  [M][N]                float32
 *
 * Supported: Q4_0, Q4_1, Q8_0 (fused: the block's integers meet x directly, one scale per
 * block, AVX2 + FMA), Q4_K, Q5_K, Q6_K (each row dequantized into a float buffer on the
 * stack, then dotted with every row of x), and I8_ROW, Pagoda's own int8 layout for
 * `--quantization int8` (not a GGML type): a row is its float32 scale, then K int8 values. The numbers are those of the dequantized weight
 * (as the `gguf` package computes it) times x, in float32; only the summation order differs.
 *
 *   Q4_1 block (20 bytes): d fp16, m fp16, 16 bytes of nibbles; w[j] = d * q[j] + m, with
 *   q[j] the low nibble of byte j and q[j + 16] its high nibble. Then
 *       sum_j w[j] x[j] = d * sum_j q[j] x[j] + m * sum_j x[j],
 *   and the block sums of x are computed once per call. Q4_0 (18 bytes) is the same with
 *   m = -8 d; Q8_0 (34 bytes: d, 32 int8) has no m.
 *
 * Threads: a small pthread pool of our own (torch's OpenMP runtime is bundled under another
 * name, so linking libgomp would start a second, competing pool). The calling thread takes
 * part; rows go out in chunks claimed atomically (see the pool below), so a descheduled
 * worker on a shared machine holds up one chunk, not a fixed share of the matrix.
 */
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14, I8_ROW = 1000 };
enum { QK = 32, QK_K = 256, MAX_K = 65536, M_TILE = 4, MAX_THREADS = 64 };

static inline float fp16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 16 bytes of nibbles -> the block's 32 integers as 4 x 8 floats (low nibbles first). */
static inline void nibbles(const uint8_t *qs, __m256 q[4]) {
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

static inline void int8s(const uint8_t *qs, __m256 q[4]) {
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * i))));
}

/* How far ahead fused_rows prefetches. Measured on this 2-core machine, the decoder's linears
 * of the default model called in model order at one token: no prefetch 15.7-16.7 ms a token;
 * 2 rows ahead 8.9, 4 rows 7.4-7.8, 8 rows 8.1, 16 rows 8.0 (bench: the note of #18). */
#define PREFETCH_ROWS 4

/* Rows [n0, n1) of W against rows [m0, m0 + mt) of x, mt <= M_TILE; xs = block sums of x. */
static inline __attribute__((always_inline)) void fused_rows(
    const int type, const uint8_t *restrict w, const int64_t row_bytes, const int64_t K,
    const float *restrict x, const float *restrict xs, const int64_t mt, float *restrict y,
    const int64_t N, const int64_t n0, const int64_t n1) {
    const int64_t nb = K / QK;
    const int64_t bsize = type == GGML_Q4_0 ? 18 : type == GGML_Q4_1 ? 20 : type == GGML_Q8_0 ? 34 : 32;
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *row = w + n * row_bytes;
        /* Rows stream from memory once per token (the weights do not stay in cache between
         * tokens): prefetch the row PREFETCH_ROWS ahead, so its loads overlap this row's
         * arithmetic. See PREFETCH_ROWS for the figures. */
        if (n + PREFETCH_ROWS < n1) {
            const uint8_t *ahead = row + PREFETCH_ROWS * row_bytes;
            for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch((const char *)(ahead + o), _MM_HINT_T0);
        }
        float row_scale = 1.f;
        if (type == I8_ROW) {
            memcpy(&row_scale, row, 4);
            row += 4;
        }
        __m256 acc[M_TILE];
        float mins[M_TILE];
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
        for (int64_t m = 0; m < mt; ++m) y[m * N + n] = hsum(acc[m]) * row_scale + mins[m];
    }
}

/* Rows [n0, n1) of W against 8 rows of x: each block is dequantized once into 4 x 8 floats
 * (w = d q + m, as the `gguf` package computes it) and multiplied into all 8 rows, so a block
 * costs 4 multiply-adds a row of x, as in a float32 GEMM, where fused_rows spends about 7
 * (its block sums and scale). For batches; fused_rows stays faster at 1-4 rows. */
enum { WIDE_TILE = 8 };
static inline __attribute__((always_inline)) void fused_rows_wide(
    const int type, const uint8_t *restrict w, const int64_t row_bytes, const int64_t K,
    const float *restrict x, float *restrict y, const int64_t N, const int64_t n0, const int64_t n1) {
    const int64_t nb = K / QK;
    const int64_t bsize = type == GGML_Q4_0 ? 18 : type == GGML_Q4_1 ? 20 : type == GGML_Q8_0 ? 34 : 32;
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *row = w + n * row_bytes;
        if (n + PREFETCH_ROWS < n1) {
            const uint8_t *ahead = row + PREFETCH_ROWS * row_bytes;
            for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch((const char *)(ahead + o), _MM_HINT_T0);
        }
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
        for (int m = 0; m < WIDE_TILE; ++m) y[m * N + n] = hsum(acc[m]) * row_scale;
    }
}

/* ---- K-quants: one row dequantized into floats (ported from ggml's dequantize_row_*) ---- */

static inline void k_scale_min(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

static void dequant_q4_k(const uint8_t *blk, float *y) { /* 144 bytes: d, dmin, scales[12], qs[128] */
    const float d = fp16(blk), dmin = fp16(blk + 2);
    const uint8_t *scales = blk + 4, *q = blk + 16;
    int is = 0;
    for (int j = 0; j < QK_K; j += 64) {
        uint8_t sc, m;
        k_scale_min(is, scales, &sc, &m);
        const float d1 = d * sc, m1 = dmin * m;
        k_scale_min(is + 1, scales, &sc, &m);
        const float d2 = d * sc, m2 = dmin * m;
        for (int l = 0; l < 32; ++l) *y++ = d1 * (q[l] & 0xF) - m1;
        for (int l = 0; l < 32; ++l) *y++ = d2 * (q[l] >> 4) - m2;
        q += 32;
        is += 2;
    }
}

static void dequant_q5_k(const uint8_t *blk, float *y) { /* 176 bytes: d, dmin, scales[12], qh[32], qs[128] */
    const float d = fp16(blk), dmin = fp16(blk + 2);
    const uint8_t *scales = blk + 4, *qh = blk + 16, *ql = blk + 48;
    int is = 0;
    uint8_t u1 = 1, u2 = 2;
    for (int j = 0; j < QK_K; j += 64) {
        uint8_t sc, m;
        k_scale_min(is, scales, &sc, &m);
        const float d1 = d * sc, m1 = dmin * m;
        k_scale_min(is + 1, scales, &sc, &m);
        const float d2 = d * sc, m2 = dmin * m;
        for (int l = 0; l < 32; ++l) *y++ = d1 * ((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
        for (int l = 0; l < 32; ++l) *y++ = d2 * ((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
        ql += 32;
        is += 2;
        u1 <<= 2;
        u2 <<= 2;
    }
}

static void dequant_q6_k(const uint8_t *blk, float *y) { /* 210 bytes: ql[128], qh[64], scales[16] int8, d */
    const uint8_t *ql = blk, *qh = blk + 128;
    const int8_t *sc = (const int8_t *)(blk + 192);
    const float d = fp16(blk + 208);
    for (int n = 0; n < QK_K; n += 128) {
        for (int l = 0; l < 32; ++l) {
            const int is = l / 16;
            const int q1 = (int)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = (int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = d * sc[is] * q1;
            y[l + 32] = d * sc[is + 2] * q2;
            y[l + 64] = d * sc[is + 4] * q3;
            y[l + 96] = d * sc[is + 6] * q4;
        }
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
    }
}

static void dequant_simple(const int type, const uint8_t *blk, float *y) {
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

static int64_t block_bytes(const int type) {
    switch (type) {
    case I8_ROW: return 32; /* after the row's scale */
    case GGML_Q4_0: return 18;
    case GGML_Q4_1: return 20;
    case GGML_Q8_0: return 34;
    case GGML_Q4_K: return 144;
    case GGML_Q5_K: return 176;
    case GGML_Q6_K: return 210;
    default: return 0;
    }
}

static int64_t block_weights(const int type) { return type >= GGML_Q4_K ? QK_K : QK; }

static void dequant_row(const int type, const uint8_t *row, const int64_t K, float *out) {
    if (type == I8_ROW) {
        float scale;
        memcpy(&scale, row, 4);
        const int8_t *q = (const int8_t *)(row + 4);
        for (int64_t k = 0; k < K; ++k) out[k] = q[k] * scale;
        return;
    }
    const int64_t bw = block_weights(type), bb = block_bytes(type);
    for (int64_t b = 0; b < K / bw; ++b) {
        const uint8_t *blk = row + b * bb;
        float *y = out + b * bw;
        switch (type) {
        case GGML_Q4_K: dequant_q4_k(blk, y); break;
        case GGML_Q5_K: dequant_q5_k(blk, y); break;
        case GGML_Q6_K: dequant_q6_k(blk, y); break;
        default: dequant_simple(type, blk, y);
        }
    }
}

static void dequant_rows_dot(const int type, const uint8_t *restrict w, const int64_t row_bytes,
                             const int64_t K, const float *restrict x, const int64_t M, float *restrict y,
                             const int64_t N, const int64_t n0, const int64_t n1) {
    float buf[MAX_K] __attribute__((aligned(32)));
    for (int64_t n = n0; n < n1; ++n) {
        dequant_row(type, w + n * row_bytes, K, buf);
        for (int64_t m = 0; m < M; ++m) {
            const float *xm = x + m * K;
            __m256 acc = _mm256_setzero_ps();
            for (int64_t k = 0; k < K; k += 8) acc = _mm256_fmadd_ps(_mm256_load_ps(buf + k), _mm256_loadu_ps(xm + k), acc);
            y[m * N + n] = hsum(acc);
        }
    }
}

/* ---- the thread pool ------------------------------------------------------------------- */

/* Rows are handed out in chunks through one atomic word, (generation << 32) | next chunk:
 * every thread (the caller too) claims chunks until none is left, so a worker that the OS
 * has descheduled (shared cores) delays nothing but the chunk it holds. `g_active` counts
 * workers inside a job; the caller returns only when it is 0, so the job's fields are never
 * rewritten under a worker. Idle workers spin ~200 us, then sleep on a condition variable: a
 * decode step's attention between two linears takes 25-60 us, and a worker woken from sleep
 * came late to each o_proj (one token, in the step: 1.4 ms a token with a 50 us spin, 0.7 ms
 * with 200 us). */

typedef struct {
    int type;
    const uint8_t *w;
    int64_t row_bytes, K, M, N;
    const float *x, *xs;
    float *y;
    const int64_t *idx; /* dequantize job: row ids (NULL: rows 0..N-1) */
    int dequant;
    int64_t chunk_rows, chunks;
} job_t;

static job_t g_job;
static _Atomic uint64_t g_state; /* (generation << 32) | next chunk */
static atomic_int g_active, g_sleepers;
static pthread_mutex_t g_mutex = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_wake = PTHREAD_COND_INITIALIZER;
static pthread_t g_pool[MAX_THREADS];
static int g_pool_size, g_threads = 1; /* g_threads: the caller included */
static const int64_t SPIN_NS = 200000;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline __attribute__((always_inline)) void fused_tile(
    const int type, const job_t *j, const float *x, const float *xs, const int64_t mt, float *y, const int64_t n0,
    const int64_t n1) {
    switch (mt) { /* constant tile sizes: the accumulators stay in registers */
    case 1: fused_rows(type, j->w, j->row_bytes, j->K, x, xs, 1, y, j->N, n0, n1); break;
    case 2: fused_rows(type, j->w, j->row_bytes, j->K, x, xs, 2, y, j->N, n0, n1); break;
    case 3: fused_rows(type, j->w, j->row_bytes, j->K, x, xs, 3, y, j->N, n0, n1); break;
    default: fused_rows(type, j->w, j->row_bytes, j->K, x, xs, 4, y, j->N, n0, n1);
    }
}

static void run_rows(const job_t *j, const int64_t n0, const int64_t n1) {
    if (j->dequant) {
        for (int64_t n = n0; n < n1; ++n) {
            const int64_t r = j->idx ? j->idx[n] : n;
            dequant_row(j->type, j->w + r * j->row_bytes, j->K, j->y + n * j->K);
        }
        return;
    }
    if (j->type == GGML_Q4_0 || j->type == GGML_Q4_1 || j->type == GGML_Q8_0 || j->type == I8_ROW) {
        int64_t m0 = 0;
        for (; j->M - m0 >= WIDE_TILE && j->M > 2 * M_TILE; m0 += WIDE_TILE) {
            const float *x = j->x + m0 * j->K;
            float *y = j->y + m0 * j->N;
            switch (j->type) {
            case GGML_Q4_0: fused_rows_wide(GGML_Q4_0, j->w, j->row_bytes, j->K, x, y, j->N, n0, n1); break;
            case GGML_Q4_1: fused_rows_wide(GGML_Q4_1, j->w, j->row_bytes, j->K, x, y, j->N, n0, n1); break;
            case GGML_Q8_0: fused_rows_wide(GGML_Q8_0, j->w, j->row_bytes, j->K, x, y, j->N, n0, n1); break;
            default: fused_rows_wide(I8_ROW, j->w, j->row_bytes, j->K, x, y, j->N, n0, n1);
            }
        }
        for (; m0 < j->M; m0 += M_TILE) {
            const int64_t mt = j->M - m0 < M_TILE ? j->M - m0 : M_TILE;
            const float *x = j->x + m0 * j->K, *xs = j->xs + m0 * (j->K / QK);
            float *y = j->y + m0 * j->N;
            switch (j->type) { /* constant types: no branch on the type inside the block loop */
            case GGML_Q4_0: fused_tile(GGML_Q4_0, j, x, xs, mt, y, n0, n1); break;
            case GGML_Q4_1: fused_tile(GGML_Q4_1, j, x, xs, mt, y, n0, n1); break;
            case GGML_Q8_0: fused_tile(GGML_Q8_0, j, x, xs, mt, y, n0, n1); break;
            default: fused_tile(I8_ROW, j, x, xs, mt, y, n0, n1);
            }
        }
    } else {
        dequant_rows_dot(j->type, j->w, j->row_bytes, j->K, j->x, j->M, j->y, j->N, n0, n1);
    }
}

/* Claim and run chunks of generation `gen` until none is left. */
static void drain(const uint32_t gen) {
    uint64_t state = atomic_load_explicit(&g_state, memory_order_acquire);
    for (;;) {
        if ((uint32_t)(state >> 32) != gen || (int64_t)(state & 0xFFFFFFFFu) >= g_job.chunks) return;
        if (atomic_compare_exchange_weak_explicit(&g_state, &state, state + 1, memory_order_acq_rel, memory_order_acquire)) {
            const int64_t c = (int64_t)(state & 0xFFFFFFFFu);
            const int64_t n0 = c * g_job.chunk_rows, n1 = n0 + g_job.chunk_rows < g_job.N ? n0 + g_job.chunk_rows : g_job.N;
            run_rows(&g_job, n0, n1);
            state = atomic_load_explicit(&g_state, memory_order_acquire);
        }
    }
}

static void *worker(void *arg) {
    (void)arg;
    uint32_t seen = (uint32_t)(atomic_load(&g_state) >> 32);
    for (;;) {
        const int64_t start = now_ns();
        int spins = 0;
        uint32_t gen;
        while ((gen = (uint32_t)(atomic_load_explicit(&g_state, memory_order_acquire) >> 32)) == seen) {
            _mm_pause();
            if (++spins % 128 == 0 && now_ns() - start > SPIN_NS) {
                pthread_mutex_lock(&g_mutex);
                atomic_fetch_add(&g_sleepers, 1);
                while ((uint32_t)(atomic_load(&g_state) >> 32) == seen) pthread_cond_wait(&g_wake, &g_mutex);
                atomic_fetch_sub(&g_sleepers, 1);
                pthread_mutex_unlock(&g_mutex);
            }
        }
        seen = gen;
        atomic_fetch_add_explicit(&g_active, 1, memory_order_acq_rel);
        drain(gen);
        atomic_fetch_sub_explicit(&g_active, 1, memory_order_release);
    }
    return NULL;
}

/* Use `threads` threads in all (the caller included). Call before any job. */
int gguf_set_threads(int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    while (g_pool_size < threads - 1) {
        if (pthread_create(&g_pool[g_pool_size], NULL, worker, NULL)) break;
        pthread_detach(g_pool[g_pool_size]);
        ++g_pool_size;
    }
    g_threads = g_pool_size + 1 < threads ? g_pool_size + 1 : threads;
    return g_threads;
}

static void run_job(const int64_t work_per_row) {
    /* chunks of >= 8 rows and ~32k multiply-adds, at most ~8 per thread (fewer claims) */
    int64_t rows = 32768 / (work_per_row > 0 ? work_per_row : 1);
    const int64_t per_thread = (g_job.N + 8 * g_threads - 1) / (8 * g_threads);
    if (rows < per_thread) rows = per_thread;
    rows = rows < 8 ? 8 : (rows + 7) / 8 * 8;
    g_job.chunk_rows = rows;
    g_job.chunks = (g_job.N + rows - 1) / rows;
    if (g_threads == 1 || g_job.chunks == 1) {
        run_rows(&g_job, 0, g_job.N);
        return;
    }
    const uint32_t gen = (uint32_t)(atomic_load(&g_state) >> 32) + 1;
    pthread_mutex_lock(&g_mutex);
    atomic_store_explicit(&g_state, (uint64_t)gen << 32, memory_order_release);
    if (atomic_load(&g_sleepers)) pthread_cond_broadcast(&g_wake);
    pthread_mutex_unlock(&g_mutex);
    drain(gen);
    for (int spins = 0; atomic_load_explicit(&g_active, memory_order_acquire) > 0; ++spins) {
        if (spins < 2048) _mm_pause();
        else sched_yield(); /* a worker holding a chunk was descheduled: let it run */
    }
}

/* ---- entry points (one caller at a time) ------------------------------------------------ */

int gguf_supported(const int type) { return block_bytes(type) != 0; }

int64_t gguf_max_k(void) { return MAX_K; }

/* y[M][N] = x[M][K] @ dequant(W)[N][K].T; xs: scratch of M * K / 32 floats. */
void gguf_matmul(const int type, const uint8_t *w, const int64_t row_bytes, const int64_t N, const int64_t K,
                 const float *x, const int64_t M, float *xs, float *y) {
    if (type == GGML_Q4_0 || type == GGML_Q4_1) {
        for (int64_t i = 0; i < M * (K / QK); ++i) {
            const float *p = x + i * QK;
            float s = 0.f;
            for (int j = 0; j < QK; ++j) s += p[j];
            xs[i] = s;
        }
    }
    g_job = (job_t){.type = type, .w = w, .row_bytes = row_bytes, .K = K, .M = M, .N = N, .x = x, .xs = xs, .y = y};
    run_job(M * K);
}

/* out[i][K] = dequant(W)[idx[i]] for i < n (idx NULL: rows 0..n-1). */
void gguf_dequantize(const int type, const uint8_t *w, const int64_t row_bytes, const int64_t K,
                     const int64_t *idx, const int64_t n, float *out) {
    g_job = (job_t){.type = type, .w = w, .row_bytes = row_bytes, .K = K, .N = n, .y = out, .idx = idx, .dequant = 1};
    run_job(K);
}
