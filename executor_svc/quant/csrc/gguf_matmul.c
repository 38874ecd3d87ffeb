/* y = x @ W.T with W kept in GGUF blocks, dequantized on the fly, accumulated in float32.
 *
 *   W  [N rows][row_bytes]   packed blocks of one GGML type along each row (K weights a row)
 *   x  [M][K]                float32, contiguous
 *   y  [M][ldy]              float32: row m's N outputs at y + m * ldy (ldy >= N)
 *
 * Supported: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (llama.cpp's block
 * layouts: gguf_blocks.h) and I8_ROW, Pagoda's own int8 layout for `--quantization int8`.
 * The numbers are those of the dequantized weight (as the `gguf` package computes it) times x,
 * in float32; only the summation order differs (Q5_0 against one row of x, where the CPU has AVX-512
 * VNNI: x carried as integers of 22 bits a value, float32-grade, see gguf_avx512.h; and the opt-in
 * int8 activations, which are not). With AVX2 + FMA + F16C (gguf_avx2.h) every
 * type is fused, blocks against x without a float copy of the weight, in tiles of 1-4 and of 8
 * rows of x; with AVX-512 F/BW/VL too, Q5_0, Q5_1 and the K-quants take a 512-bit loop
 * (gguf_avx512.h) in tiles of 1-8 rows. Without AVX2 (another CPU, or a compiler without those
 * flags) each row of W is dequantized by portable C (gguf_blocks.h) and dotted with the rows of x.
 *
 * Threads: torch's OpenMP team where the process has one OpenMP runtime (built with -fopenmp,
 * the library's libgomp.so.1 is torch's, already loaded; the caller checks and says so through
 * gguf_use_openmp), else a small pthread pool of our own (a torch whose runtime is bundled under
 * another name: linking libgomp would start a second pool). One team for torch's GEMMs, the
 * decode attention and these loops: two pools that spin between their jobs took the cores from
 * each other (a decode step of 40 requests: these matmuls 73 ms beside idle OpenMP threads,
 * 94-103 ms beside the attention's OpenMP threads spinning). The calling thread takes part;
 * rows go out in chunks claimed atomically (see the pool below), so a descheduled worker on a
 * shared machine holds up one chunk, not a fixed share of the matrix.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gguf_blocks.h"

enum { MAX_K = 65536, M_TILE = 4, MAX_THREADS = 64 };

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GGUF_SIMD 1
#include "gguf_avx2.h"
#else
#define GGUF_SIMD 0
#endif

/* AVX-512 F + BW + VL (-march=native on such a CPU): the types of group_rows take the 512-bit
 * loop of gguf_avx512.h; Q4_0 / Q4_1 / Q8_0 / I8_ROW keep their AVX2 loops either way. */
#if GGUF_SIMD && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define GGUF_AVX512 1
#include "gguf_avx512.h"
#else
#define GGUF_AVX512 0
#endif

/* AVX-512 VNNI too: Q5_0 against one row of x takes x as three int8 digits (gguf_set_digit_activations). */
#if GGUF_AVX512 && defined(__AVX512VNNI__)
#define GGUF_VNNI 1
#else
#define GGUF_VNNI 0
#endif

/* Q5_0, Q4_K and Q6_K may take int8 activations (gguf_set_int8_activations). Against one row of x: the
 * vpdpbusd loops of gguf_avx512.h where the CPU has AVX-512 VNNI, else their AVX2 form (gguf_avx2_q8.h):
 * the same bits for Q5_0 and Q4_K (gguf_q8_rows.h, shared); Q6_K's AVX2 loop scales by the integer
 * sub-block scales, and g_x4 holds its int16 pair offsets there. Against several rows: the loops of
 * gguf_q8_rows.h (rows_q8_m), shared by both builds, each row the bits of the one-row loop (Q6_K: the same
 * integers, other float roundings: its several-row loop takes the -32 offset a group at a time). */
#define GGUF_INT8 GGUF_SIMD
#if GGUF_SIMD && !GGUF_VNNI
#include "gguf_avx2_q8.h"
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

/* Types whose fused loops read x's block sums (xs: the sums of each 32 x values). */
static int needs_block_sums(const int type) {
    return type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q5_1 || type == GGML_Q4_K || type == GGML_Q5_K;
}

typedef struct {
    int type;
    const uint8_t *w;
    int64_t row_bytes, K, M, N, ldy;
    const float *x, *xs;
    float *y;
    const int64_t *idx; /* dequantize job: row ids (NULL: rows 0..N-1) */
    int dequant;
    int q8;      /* Q5_0 / Q4_K / Q6_K with int8 activations: x quantized into g_xq ... g_x4 (one row) */
    int q8_rows; /* ... or into g_mx* (several rows): rows_q8_m */
    int d3; /* Q5_0 at one row of x, x as three int8 digits (g_xd3, g_xsc, g_xoff): the default where VNNI */
    int64_t chunk_rows, chunks;
} job_t;

/* The int8 activations of the job in flight (one caller at a time), and whether they are asked for; whether
 * a Q5_0 matmul at one row of x takes x as digits (digits_x in gguf_avx512.h: on unless switched off). */
static int g_int8_x, g_digits_x = GGUF_VNNI;
#if GGUF_INT8
static int8_t g_xq[MAX_K];
static float g_xd[MAX_K / 32];
static int32_t g_xc[MAX_K / 32];
static float g_xs[MAX_K / 32];
static int32_t g_x4[MAX_K / 4];
/* The same for several rows of x (q8 with M > 1): row m at m K (xq), m K / 32 (xd, xc, xs), m K / 16 (Q6_K's
 * sub-block sums, int16); grown as needed, kept for the process (about 1.5 bytes a value of x: less than x). */
static int8_t *g_mxq;
static float *g_mxd, *g_mxs;
static int32_t *g_mxc;
static int16_t *g_mx16;
static int64_t g_mx_values;
#endif
#if GGUF_VNNI
static int8_t g_xd3[3 * MAX_K];
static float g_xsc[MAX_K / 4];
static int32_t g_xoff[MAX_K / 4];
#endif

#if GGUF_INT8
/* x [M][K] quantized row by row into g_mxq ... g_mxs as quantize_x_q8 does one row; for Q6_K, g_mx16 holds
 * each row's sub-block sums (int16, K / 16 a row: q6_k_x_sums). Returns 0 where the buffers cannot grow (the
 * caller keeps float32 x). */
static int quantize_rows_q8(const int type, const float *x, const int64_t M, const int64_t K) {
    const int64_t values = M * K;
    if (values > g_mx_values) {
        free(g_mxq), free(g_mxd), free(g_mxs), free(g_mxc), free(g_mx16);
        g_mxq = malloc(values), g_mxd = malloc(values / QK * sizeof(float)), g_mxs = malloc(values / QK * sizeof(float));
        g_mxc = malloc(values / QK * sizeof(int32_t)), g_mx16 = malloc(values / 16 * sizeof(int16_t));
        g_mx_values = g_mxq && g_mxd && g_mxs && g_mxc && g_mx16 ? values : 0;
        if (!g_mx_values) return 0;
    }
    for (int64_t m = 0; m < M; ++m) {
        const int64_t o = m * K, ob = m * (K / QK);
        quantize_x_q8(x + o, K, g_mxq + o, g_mxd + ob, g_mxc + ob, g_mxs + ob, g_x4); /* (g_x4: scratch here) */
        if (type == GGML_Q6_K) q6_k_x_sums(g_mxq + o, K, g_mx16 + m * (K / 16));
    }
    return 1;
}
#endif

static void dequant_row(const int type, const uint8_t *row, const int64_t K, float *out) {
#if GGUF_SIMD
    dequant_row_avx2(type, row, K, out);
#else
    dequant_row_scalar(type, row, K, out);
#endif
}

#if GGUF_SIMD

INLINE void fused_tile(const int type, const job_t *j, const float *x, const float *xs, const int64_t mt, float *y,
                       const int64_t n0, const int64_t n1) {
    switch (mt) { /* constant tile sizes: the accumulators stay in registers */
    case 1: fused_rows(type, j->w, j->row_bytes, j->K, x, xs, 1, y, j->ldy, n0, n1); break;
    case 2: fused_rows(type, j->w, j->row_bytes, j->K, x, xs, 2, y, j->ldy, n0, n1); break;
    case 3: fused_rows(type, j->w, j->row_bytes, j->K, x, xs, 3, y, j->ldy, n0, n1); break;
    default: fused_rows(type, j->w, j->row_bytes, j->K, x, xs, 4, y, j->ldy, n0, n1);
    }
}

INLINE void group_tile(const int type, const job_t *j, const float *x, const float *xs, const int64_t mt, float *y,
                       const int64_t n0, const int64_t n1) {
    switch (mt) {
    case 1: group_rows(type, j->w, j->row_bytes, j->K, x, xs, 1, y, j->ldy, n0, n1); break;
    case 2: group_rows(type, j->w, j->row_bytes, j->K, x, xs, 2, y, j->ldy, n0, n1); break;
    case 3: group_rows(type, j->w, j->row_bytes, j->K, x, xs, 3, y, j->ldy, n0, n1); break;
    case 4: group_rows(type, j->w, j->row_bytes, j->K, x, xs, 4, y, j->ldy, n0, n1); break;
    default: group_rows(type, j->w, j->row_bytes, j->K, x, xs, WIDE_TILE, y, j->ldy, n0, n1);
    }
}

#if GGUF_AVX512
INLINE void group_tile_512(const int type, const job_t *j, const float *x, const float *xs, const int64_t mt, float *y,
                           const int64_t n0, const int64_t n1) {
    switch (mt) {
    case 1: group_rows_512(type, j->w, j->row_bytes, j->K, x, xs, 1, y, j->ldy, n0, n1); break;
    case 2: group_rows_512(type, j->w, j->row_bytes, j->K, x, xs, 2, y, j->ldy, n0, n1); break;
    case 3: group_rows_512(type, j->w, j->row_bytes, j->K, x, xs, 3, y, j->ldy, n0, n1); break;
    case 4: group_rows_512(type, j->w, j->row_bytes, j->K, x, xs, 4, y, j->ldy, n0, n1); break;
    case 5: group_rows_512(type, j->w, j->row_bytes, j->K, x, xs, 5, y, j->ldy, n0, n1); break;
    case 6: group_rows_512(type, j->w, j->row_bytes, j->K, x, xs, 6, y, j->ldy, n0, n1); break;
    case 7: group_rows_512(type, j->w, j->row_bytes, j->K, x, xs, 7, y, j->ldy, n0, n1); break;
    default: group_rows_512(type, j->w, j->row_bytes, j->K, x, xs, WIDE_TILE, y, j->ldy, n0, n1);
    }
}
#endif

/* Rows [n0, n1) of W against every row of x: tiles of 8 rows while more than 8 are left (a
 * batch of exactly 8 takes two tiles of 4, faster there), then tiles of up to 4. With AVX-512
 * the types of group_rows take tiles of 8 while 8 are left, then one tile of the rest. */
INLINE void tiles(const int type, const job_t *j, const int64_t n0, const int64_t n1) {
    const int simple = type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q8_0 || type == I8_ROW;
    int64_t m0 = 0;
#if GGUF_INT8
    if (j->q8 && j->q8_rows) {
        rows_q8_m(type, j->w, j->row_bytes, j->K, j->M, g_mxq, g_mxd, g_mxc, g_mxs, g_mx16, j->y, j->ldy,
                  n0, n1);
        return;
    }
    if (type == GGML_Q5_0 && j->q8) {
        rows_q5_0_q8(j->w, j->row_bytes, j->K, g_xq, g_xd, g_xc, j->y, n0, n1);
        return;
    }
    if (type == GGML_Q4_K && j->q8) {
        rows_q4_k_q8(j->w, j->row_bytes, j->K, g_xq, g_xd, g_xs, j->y, n0, n1);
        return;
    }
    if (type == GGML_Q6_K && j->q8) {
        rows_q6_k_q8(j->w, j->row_bytes, j->K, g_xq, g_xd, g_x4, j->y, n0, n1);
        return;
    }
#endif
#if GGUF_VNNI
    if (type == GGML_Q5_0 && j->d3) {
        rows_q5_0_d3(j->w, j->row_bytes, j->K, g_xd3, g_xsc, g_xoff, j->y, n0, n1);
        return;
    }
#endif
#if GGUF_AVX512
    if (j->M == 1 && one_row_512(type)) {
        rows_512_1(type, j->w, j->row_bytes, j->K, j->x, j->xs, j->y, n0, n1);
        return;
    }
    if (!simple) {
        for (; m0 < j->M; m0 += WIDE_TILE) {
            const int64_t mt = j->M - m0 < WIDE_TILE ? j->M - m0 : WIDE_TILE;
            group_tile_512(type, j, j->x + m0 * j->K, j->xs + m0 * (j->K / QK), mt, j->y + m0 * j->ldy, n0, n1);
        }
        return;
    }
#endif
    for (; j->M - m0 >= WIDE_TILE && j->M > 2 * M_TILE; m0 += WIDE_TILE) {
        const float *x = j->x + m0 * j->K;
        float *y = j->y + m0 * j->ldy;
        if (simple) fused_rows_wide(type, j->w, j->row_bytes, j->K, x, y, j->ldy, n0, n1);
        else group_tile(type, j, x, NULL, WIDE_TILE, y, n0, n1);
    }
    for (; m0 < j->M; m0 += M_TILE) {
        const int64_t mt = j->M - m0 < M_TILE ? j->M - m0 : M_TILE;
        const float *x = j->x + m0 * j->K, *xs = j->xs + m0 * (j->K / QK);
        float *y = j->y + m0 * j->ldy;
        if (simple) fused_tile(type, j, x, xs, mt, y, n0, n1);
        else group_tile(type, j, x, xs, mt, y, n0, n1);
    }
}

static void matmul_rows(const job_t *j, const int64_t n0, const int64_t n1) {
    switch (j->type) { /* constant types: no branch on the type inside the block loops */
    case GGML_Q4_0: tiles(GGML_Q4_0, j, n0, n1); break;
    case GGML_Q4_1: tiles(GGML_Q4_1, j, n0, n1); break;
    case GGML_Q5_0: tiles(GGML_Q5_0, j, n0, n1); break;
    case GGML_Q5_1: tiles(GGML_Q5_1, j, n0, n1); break;
    case GGML_Q8_0: tiles(GGML_Q8_0, j, n0, n1); break;
    case GGML_Q2_K: tiles(GGML_Q2_K, j, n0, n1); break;
    case GGML_Q3_K: tiles(GGML_Q3_K, j, n0, n1); break;
    case GGML_Q4_K: tiles(GGML_Q4_K, j, n0, n1); break;
    case GGML_Q5_K: tiles(GGML_Q5_K, j, n0, n1); break;
    case GGML_Q6_K: tiles(GGML_Q6_K, j, n0, n1); break;
    default: tiles(I8_ROW, j, n0, n1);
    }
}

#else /* portable: each row of W dequantized, then dotted with every row of x */

static void matmul_rows(const job_t *j, const int64_t n0, const int64_t n1) {
    static _Thread_local float buf[MAX_K];
    for (int64_t n = n0; n < n1; ++n) {
        dequant_row(j->type, j->w + n * j->row_bytes, j->K, buf);
        for (int64_t m = 0; m < j->M; ++m) {
            const float *xm = j->x + m * j->K;
            float acc = 0.f;
            for (int64_t k = 0; k < j->K; ++k) acc += buf[k] * xm[k];
            j->y[m * j->ldy + n] = acc;
        }
    }
}

#endif

static void run_rows(const job_t *j, const int64_t n0, const int64_t n1) {
    if (!j->dequant) {
        matmul_rows(j, n0, n1);
        return;
    }
    for (int64_t n = n0; n < n1; ++n) {
        const int64_t r = j->idx ? j->idx[n] : n;
        dequant_row(j->type, j->w + r * j->row_bytes, j->K, j->y + n * j->K);
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


static job_t g_job;
static _Atomic uint64_t g_state; /* (generation << 32) | next chunk */
static atomic_int g_active, g_sleepers;
static pthread_mutex_t g_mutex = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_wake = PTHREAD_COND_INITIALIZER;
static pthread_t g_pool[MAX_THREADS];
static int g_pool_size, g_threads = 1; /* g_threads: the caller included */
static int g_openmp;                   /* jobs on the OpenMP team instead of g_pool */
static const int64_t SPIN_NS = 200000;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
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
            cpu_relax();
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

/* Run jobs on the OpenMP team (on != 0) where this build has OpenMP; returns whether it will.
 * Call before gguf_set_threads. */
int gguf_use_openmp(const int on) {
#ifdef _OPENMP
    g_openmp = on != 0;
#else
    (void)on;
#endif
    return g_openmp;
}

/* Use `threads` threads in all (the caller included). Call before any job. */
int gguf_set_threads(int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (g_openmp) {
        g_threads = threads;
        return g_threads;
    }
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
#ifdef _OPENMP
    if (g_openmp) { /* the team's threads claim chunks as the pool's would; the region ends when all are done */
        atomic_store_explicit(&g_state, (uint64_t)gen << 32, memory_order_release);
#pragma omp parallel num_threads(g_threads)
        drain(gen);
        return;
    }
#endif
    pthread_mutex_lock(&g_mutex);
    atomic_store_explicit(&g_state, (uint64_t)gen << 32, memory_order_release);
    if (atomic_load(&g_sleepers)) pthread_cond_broadcast(&g_wake);
    pthread_mutex_unlock(&g_mutex);
    drain(gen);
    for (int spins = 0; atomic_load_explicit(&g_active, memory_order_acquire) > 0; ++spins) {
        if (spins < 2048) cpu_relax();
        else sched_yield(); /* a worker holding a chunk was descheduled: let it run */
    }
}

/* ---- entry points (one caller at a time) ------------------------------------------------ */

int gguf_supported(const int type) { return block_bytes(type) != 0; }

/* Weights a block of `type` (rows of W are whole blocks: K a multiple of it); 0: unsupported. */
int64_t gguf_block_weights(const int type) { return gguf_supported(type) ? (type == I8_ROW ? 1 : block_weights(type)) : 0; }

int64_t gguf_max_k(void) { return MAX_K; }

/* Whether the fused loops are this build's (AVX2 + FMA + F16C), else the portable row path. */
int gguf_simd(void) { return GGUF_SIMD; }

/* Whether the types of group_rows take the AVX-512 loop in this build (gguf_avx512.h). */
int gguf_avx512(void) { return GGUF_AVX512; }

/* Opt-in int8 activations (on != 0): Q5_0, Q4_K and Q6_K weights against any rows of x round x to int8
 * per block of 32 and multiply bytes (gguf_avx512.h, gguf_avx2_q8.h, gguf_q8_rows.h); every other type keeps float32 x. Returns
 * whether it is in effect (this build has AVX2, or AVX-512 VNNI). */
int gguf_set_int8_activations(const int on) {
    g_int8_x = GGUF_INT8 && on != 0;
    return g_int8_x;
}

/* Q5_0 against one row of x with x as three int8 digits (on != 0, the default; off: the float loop
 * rows_512_1, for comparison). Returns whether it is in effect (this build has AVX-512 VNNI). */
int gguf_set_digit_activations(const int on) {
    g_digits_x = GGUF_VNNI && on != 0;
    return g_digits_x;
}

/* y[m * ldy + n] = (x[M][K] @ dequant(W)[N][K].T)[m][n]; xs: scratch of M * K / 32 floats. */
void gguf_matmul_strided(const int type, const uint8_t *w, const int64_t row_bytes, const int64_t N, const int64_t K,
                         const float *x, const int64_t M, float *xs, float *y, const int64_t ldy) {
    if (GGUF_SIMD && needs_block_sums(type)) {
        for (int64_t i = 0; i < M * (K / QK); ++i) {
            const float *p = x + i * QK;
            float s = 0.f;
            for (int j = 0; j < QK; ++j) s += p[j];
            xs[i] = s;
        }
    }
    /* (x's integer forms live in arrays of MAX_K values a row: a longer row keeps float32 x) */
    int q8 = g_int8_x && M >= 1 && K <= MAX_K && (type == GGML_Q5_0 || type == GGML_Q4_K || type == GGML_Q6_K);
    const int d3 = !q8 && g_digits_x && M == 1 && K <= MAX_K && type == GGML_Q5_0;
    const int rows = q8 && M > 1;
#if GGUF_INT8
    if (q8 && !rows) quantize_x_q8(x, K, g_xq, g_xd, g_xc, g_xs, g_x4);
    if (rows) q8 = quantize_rows_q8(type, x, M, K);
#endif
#if GGUF_VNNI
    if (d3) digits_x(x, K, g_xd3, g_xsc, g_xoff);
#endif
    g_job = (job_t){.type = type, .w = w, .row_bytes = row_bytes, .K = K, .M = M, .N = N, .ldy = ldy, .x = x, .xs = xs,
                    .y = y, .q8 = q8, .q8_rows = rows, .d3 = d3};
    run_job(M * K);
}

/* y[M][N] = x[M][K] @ dequant(W)[N][K].T; xs: scratch of M * K / 32 floats. */
void gguf_matmul(const int type, const uint8_t *w, const int64_t row_bytes, const int64_t N, const int64_t K,
                 const float *x, const int64_t M, float *xs, float *y) {
    gguf_matmul_strided(type, w, row_bytes, N, K, x, M, xs, y, N);
}

/* out[i][K] = dequant(W)[idx[i]] for i < n (idx NULL: rows 0..n-1). */
void gguf_dequantize(const int type, const uint8_t *w, const int64_t row_bytes, const int64_t K,
                     const int64_t *idx, const int64_t n, float *out) {
    g_job = (job_t){.type = type, .w = w, .row_bytes = row_bytes, .K = K, .N = n, .y = out, .idx = idx, .dequant = 1};
    run_job(K);
}
