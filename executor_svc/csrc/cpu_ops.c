// The decoder's elementwise ops for a few rows of float32 on the CPU, one C call each.
//
// At one token per step, each of these is a handful of microseconds of arithmetic, and the
// torch version costs several dispatched ops (RMSNorm alone is seven: float, pow, mean, add,
// rsqrt, mul, mul). Here each is one loop over the rows, written to give the numbers of
// the torch ops in executor_svc/model.py (transformers' formulas, float32 throughout); only
// the summation order of RMSNorm's mean differs.
//
// Shapes are row-major with explicit row strides (in floats) where the input may be a view.

#include <math.h>
#include <stdint.h>
#include <string.h>

static float mean_square(const float *x, int64_t n) {
    // 8 partial sums (what -O3 vectorises into one AVX register), then a fixed-order tree
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += x[i + j] * x[i + j];
    float tail = 0.0f;
    for (; i < n; i++) tail += x[i] * x[i];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    return (s + tail) / (float)n;
}

static void norm_row(const float *x, const float *w, float *out, int64_t n, float eps) {
    float inv = 1.0f / sqrtf(mean_square(x, n) + eps);
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * inv);
}

// out[t] = w * (x[t] / sqrt(mean(x[t]^2) + eps))
void pagoda_rms_norm(const float *x, int64_t x_stride, const float *w, float *out, int64_t rows, int64_t n, float eps) {
    for (int64_t t = 0; t < rows; t++) norm_row(x + t * x_stride, w, out + t * n, n, eps);
}

// In place, each of the `heads` heads of `head_dim` in row t (rows `x_stride` floats apart) normed
// on its own with the same weight: Qwen3's and Gemma 3's q/k norms over head_dim.
void pagoda_rms_norm_heads(float *x, int64_t x_stride, int64_t heads, int64_t head_dim, const float *w, int64_t rows,
                           float eps) {
    for (int64_t t = 0; t < rows; t++)
        for (int64_t h = 0; h < heads; h++) {
            float *row = x + t * x_stride + h * head_dim;
            norm_row(row, w, row, head_dim, eps);  // (mean_square reads the whole row before it is written)
        }
}

// sum[t] = x[t] + residual[t]; out[t] = rms_norm(sum[t]).  `sum` may be `x` or `residual`.
void pagoda_add_rms_norm(const float *x, int64_t x_stride, const float *residual, int64_t r_stride, const float *w,
                         float *out, float *sum, int64_t rows, int64_t n, float eps) {
    for (int64_t t = 0; t < rows; t++) {
        const float *xr = x + t * x_stride, *rr = residual + t * r_stride;
        float *sr = sum + t * n;
        for (int64_t i = 0; i < n; i++) sr[i] = xr[i] + rr[i];
        norm_row(sr, w, out + t * n, n, eps);
    }
}

// Neox rotary: each head's halves (x1, x2) become (x1 cos - x2 sin, x2 cos + x1 sin). Row t of
// `src` holds `heads` heads of `head_dim` from column 0, and so does row t of `dst` (which may
// be `src`: in place); cos and sin are [rows, head_dim / 2].
void pagoda_rotary_neox(const float *src, int64_t src_stride, float *dst, int64_t dst_stride, int64_t rows,
                        int64_t heads, int64_t head_dim, const float *cos_t, const float *sin_t) {
    int64_t half = head_dim / 2;
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos_t + t * half, *s = sin_t + t * half;
        for (int64_t h = 0; h < heads; h++) {
            const float *x1 = src + t * src_stride + h * head_dim, *x2 = x1 + half;
            float *y1 = dst + t * dst_stride + h * head_dim, *y2 = y1 + half;
            for (int64_t i = 0; i < half; i++) {
                float a = x1[i], b = x2[i];
                y1[i] = a * c[i] - b * s[i];
                y2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

// Row t of k and v (`src_stride` floats apart, `row_floats` each) into slot slots[t] of the
// paged caches, which hold `row_floats` floats a slot (block b, offset o: slot b * block_size + o).
void pagoda_write_kv(const float *k, const float *v, int64_t src_stride, float *k_cache, float *v_cache,
                     const int64_t *slots, int64_t rows, int64_t row_floats) {
    for (int64_t t = 0; t < rows; t++) {
        memcpy(k_cache + slots[t] * row_floats, k + t * src_stride, (size_t)row_floats * sizeof(float));
        memcpy(v_cache + slots[t] * row_floats, v + t * src_stride, (size_t)row_floats * sizeof(float));
    }
}

// x[t] = [gate | up] -> out[t] = gelu(gate) * up, gelu's tanh approximation (F.gelu(approximate="tanh"):
// 0.5 g (1 + tanh(z)), z = sqrt(2/pi) (g + 0.044715 g^3)): Gemma's GeGLU. Computed as g sigmoid(2 z), the
// same function (0.5 (1 + tanh z) = 1 / (1 + exp(-2 z))), through expf, which vectorises (libmvec) as
// silu's does, where tanhf stays a scalar call: 37 -> 3 us a row of 2048 (Gemma 3 270M's width).
// Within a few float32 ulps of torch's formula (tests/kernels/test_cpu_ops.py).
void pagoda_gelu_tanh_and_mul(const float *x, int64_t rows, int64_t n, float *out) {
    const float two_beta = 2.0f * 0.7978845608028654f, kappa = 0.044715f;
    for (int64_t t = 0; t < rows; t++) {
        const float *g = x + t * 2 * n, *u = g + n;
        float *o = out + t * n;
        for (int64_t i = 0; i < n; i++) {
            const float v = g[i];
            o[i] = v / (1.0f + expf(-two_beta * (v + kappa * v * v * v))) * u[i];
        }
    }
}

// float32 -> bfloat16, rounded to nearest even (as torch's .to(torch.bfloat16)); NaN stays NaN
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

// pagoda_write_kv into a bfloat16 cache: each value rounded as torch rounds it
void pagoda_write_kv_bf16(const float *k, const float *v, int64_t src_stride, uint16_t *k_cache, uint16_t *v_cache,
                          const int64_t *slots, int64_t rows, int64_t row_values) {
    for (int64_t t = 0; t < rows; t++) {
        uint16_t *kc = k_cache + slots[t] * row_values, *vc = v_cache + slots[t] * row_values;
        const float *ks = k + t * src_stride, *vs = v + t * src_stride;
        for (int64_t i = 0; i < row_values; i++) {
            kc[i] = to_bf16(ks[i]);
            vc[i] = to_bf16(vs[i]);
        }
    }
}

// x[t] = [gate | up], each n wide -> out[t] = silu(gate) * up, silu(g) = g / (1 + exp(-g))
void pagoda_silu_and_mul(const float *x, int64_t rows, int64_t n, float *out) {
    for (int64_t t = 0; t < rows; t++) {
        const float *g = x + t * 2 * n, *u = g + n;
        float *o = out + t * n;
        for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

// ---- LoRA deltas of a few rows (executor_svc/lora.py's LoraDelta, float32) ----------------------
//
// One adapter's delta on one projection, for the rows of the step that use it: t = x A.T (every slice's
// shrink at once: A holds the slices' A stacked, [rank][in]), then each slice's ranks expand into its own
// columns of y through B.T ([part_rank][cols], scaled by alpha / r): y[row][first_col + c] += t[row] . bt[:, c].
// A and B are read once for all the group's rows; the expand is a row of axpys over y's columns (no
// horizontal sums). `lora_deltas` below, inside pagoda_decode_layers.

#define PAGODA_LORA_PARTS 4
typedef struct {
    int64_t rank, a;  // A [rank][in] float32; rank 0: the adapter leaves this projection alone
    int64_t parts;
    int64_t first_rank[PAGODA_LORA_PARTS], part_rank[PAGODA_LORA_PARTS], first_col[PAGODA_LORA_PARTS],
        cols[PAGODA_LORA_PARTS], bt[PAGODA_LORA_PARTS];
} pagoda_lora_t;

typedef struct {  // one adapter's deltas on one layer's projections
    pagoda_lora_t qkv, o, gate_up, down;
} pagoda_lora_layer_t;

static float dot_f32(const float *a, const float *b, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float tail = 0.0f;
    for (; i < n; i++) tail += a[i] * b[i];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail;
}

// ---- A whole decode step's layers in one call (executor_svc/cpu_decode_path.py) ----------------
//
// The same calls, in the same order on the same buffers, as CpuDecodePath's per-layer loop in
// Python (so the same bits): each layer's norms, its GGUF matmuls (`matmul`, the GGUF kernel's
// gguf_matmul_strided), rotary, the K/V write, the decode attention on the OpenMP team (`attend`,
// paged_decode_attention_parts) and its MLP. One ctypes call a step instead of about fourteen a
// layer, each of which cost a microsecond or more of argument conversion in Python. Pointers
// travel as int64 (the ctypes structures in cpu_decode_path.py mirror these).

typedef void (*matmul_fn)(int type, const void *w, int64_t row_bytes, int64_t n, int64_t k, const float *x,
                          int64_t m, float *xs, float *y, int64_t ldy);
typedef void (*attend_fn)(const float *q, const void *k_cache, const void *v_cache, const int32_t *table,
                          int64_t table_stride, const int32_t *seq_lens, float *out, float *scratch,
                          int64_t scratch_stride, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size, float scale, int64_t num_seqs, int64_t threads, int64_t kv_bf16,
                          int64_t window);

#define PAGODA_MAX_SEGMENTS 4
typedef struct {  // y [rows, out] = x [rows, in] @ W.T, W in segments of rows (a merged projection's parts)
    int64_t segments, out, in;
    int64_t type[PAGODA_MAX_SEGMENTS], weight[PAGODA_MAX_SEGMENTS], row_bytes[PAGODA_MAX_SEGMENTS],
        rows[PAGODA_MAX_SEGMENTS];
} pagoda_linear_t;

typedef struct {
    pagoda_linear_t qkv, o, gate_up, down;
    int64_t norms[4];  // input, post-attention (+ pre- and post-feedforward: sandwich)
    int64_t q_norm, k_norm;  // 0: none
    int64_t gelu, local_rope, window, k_cache, v_cache;
    float scale;
} pagoda_layer_t;

typedef struct {
    int64_t rows, hidden, q_size, kv_size, inter, heads, kv_heads, head_dim, block_size, kv_bf16, threads, sandwich;
    int64_t matmul, attend;  // function pointers
    int64_t residual, hidden_out, normed, qkv, q, attn, gate_up, act, side, xs, scratch, scratch_stride;
    int64_t cos, sin, local_cos, local_sin;
    // LoRA (lora_groups 0: none): group g's rows lora_rows[lora_start[g] .. lora_start[g + 1]) take the deltas of
    // lora_tables[g] (its pagoda_lora_layer_t per layer); lora_t: scratch of rows * lora_rank (the largest
    // rank of a projection) floats; lora_threads: the OpenMP team's threads to split them over (1: this thread)
    int64_t lora_groups, lora_tables, lora_start, lora_rows, lora_t, lora_rank, lora_threads;
    float eps;
} pagoda_step_t;

static void linear(const pagoda_step_t *s, const pagoda_linear_t *l, const float *x, float *y) {
    const matmul_fn mm = (matmul_fn)(intptr_t)s->matmul;
    int64_t start = 0;
    for (int64_t i = 0; i < l->segments; i++) {
        mm((int)l->type[i], (const void *)(intptr_t)l->weight[i], l->row_bytes[i], l->rows[i], l->in, x, s->rows,
           (float *)(intptr_t)s->xs, y + start, l->out);
        start += l->rows[i];
    }
}

// Each LoRA group's delta of projection `which` (0 qkv, 1 o, 2 gate_up, 3 down) of layer `layer` into y
// [rows][ldy] (x [rows][in]), split over `lora_threads` threads of the
// OpenMP team (torch's, as the GGUF matmuls': cpu_ops is built with -fopenmp where that team is torch's) in
// one region: the shrinks of every group by rank row, then the expands by chunks of LORA_CHUNK output
// columns (disjoint writes). Each value is computed the same way whatever the number of threads.
#define LORA_CHUNK 64
static inline const pagoda_lora_t *lora_of(const pagoda_step_t *s, int64_t g, int64_t layer, int which) {
    const pagoda_lora_layer_t *t = (const pagoda_lora_layer_t *)(intptr_t)((const int64_t *)(intptr_t)s->lora_tables)[g] + layer;
    return which == 0 ? &t->qkv : which == 1 ? &t->o : which == 2 ? &t->gate_up : &t->down;
}

static void lora_deltas(const pagoda_step_t *s, int64_t layer, int which, const float *x, int64_t in, float *y,
                        int64_t ldy) {
    const int64_t G = s->lora_groups, Rmax = s->lora_rank, chunks = (ldy + LORA_CHUNK - 1) / LORA_CHUNK;
    const int64_t *start = (const int64_t *)(intptr_t)s->lora_start, *rows = (const int64_t *)(intptr_t)s->lora_rows;
    float *T = (float *)(intptr_t)s->lora_t;  // row (start[g] + i) of group g: its shrink, Rmax floats
    int64_t work = 0;  // multiply-adds
    for (int64_t g = 0; g < G; g++) {
        const pagoda_lora_t *L = lora_of(s, g, layer, which);
        work += (start[g + 1] - start[g]) * L->rank * (in + ldy / (L->parts > 0 ? L->parts : 1));
    }
    if (!work) return;
    int threads = (int)s->lora_threads;
    if (work < 16384) threads = 1;
    (void)threads;  // (without OpenMP: this thread)
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if (threads > 1)
#endif
    {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t item = 0; item < G * Rmax; item++) {
            const int64_t g = item / Rmax, j = item % Rmax;
            const pagoda_lora_t *L = lora_of(s, g, layer, which);
            if (j >= L->rank) continue;
            const float *aj = (const float *)(intptr_t)L->a + j * in;
            for (int64_t i = start[g]; i < start[g + 1]; i++) T[i * Rmax + j] = dot_f32(aj, x + rows[i] * in, in);
        }
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t item = 0; item < G * chunks; item++) {
            const int64_t g = item / chunks, lo = (item % chunks) * LORA_CHUNK;
            const int64_t hi = lo + LORA_CHUNK < ldy ? lo + LORA_CHUNK : ldy;
            const pagoda_lora_t *L = lora_of(s, g, layer, which);
            for (int64_t p = 0; p < (L->rank ? L->parts : 0); p++) {
                const int64_t c0 = L->first_col[p], cols = L->cols[p], r = L->part_rank[p];
                const int64_t a = lo > c0 ? lo : c0, b = hi < c0 + cols ? hi : c0 + cols;
                if (a >= b) continue;
                const float *bt = (const float *)(intptr_t)L->bt[p] + (a - c0);
                for (int64_t i = start[g]; i < start[g + 1]; i++) {
                    const float *ti = T + i * Rmax + L->first_rank[p];
                    float acc[LORA_CHUNK] = {0};
                    for (int64_t k = 0; k < r; k++) {
                        const float sk = ti[k], *bk = bt + k * cols;
                        for (int64_t c = 0; c < b - a; c++) acc[c] += sk * bk[c];
                    }
                    float *yr = y + rows[i] * ldy + a;
                    for (int64_t c = 0; c < b - a; c++) yr[c] += acc[c];
                }
            }
        }
    }
}

// per_layer [num_layers][5]: the layer's K/V write slots (int64), block table (int32), its row
// stride, sequence lengths (int32) and number of sequences (its KV cache group's step layout).
void pagoda_decode_layers(const pagoda_layer_t *layers, int64_t num_layers, const pagoda_step_t *s,
                          const int64_t *per_layer) {
    const int64_t rows = s->rows, hid = s->hidden, q_size = s->q_size, kv_size = s->kv_size;
    const int64_t qkv_width = q_size + 2 * kv_size, heads = s->heads, kv_heads = s->kv_heads, hd = s->head_dim;
    const float eps = s->eps;
    float *R = (float *)(intptr_t)s->residual, *H = (float *)(intptr_t)s->hidden_out, *N = (float *)(intptr_t)s->normed;
    float *QKV = (float *)(intptr_t)s->qkv, *Q = (float *)(intptr_t)s->q, *A = (float *)(intptr_t)s->attn;
    float *GU = (float *)(intptr_t)s->gate_up, *ACT = (float *)(intptr_t)s->act, *SIDE = (float *)(intptr_t)s->side;
    float *K = QKV + q_size, *V = QKV + q_size + kv_size;
    const attend_fn attend = (attend_fn)(intptr_t)s->attend;
    for (int64_t i = 0; i < num_layers; i++) {
        const pagoda_layer_t *L = layers + i;
        const int64_t *g = per_layer + 5 * i;
        const float *const *norms = (const float *const *)L->norms;
        void *KC = (void *)(intptr_t)L->k_cache, *VC = (void *)(intptr_t)L->v_cache;
        if (i == 0)
            pagoda_rms_norm(R, hid, norms[0], N, rows, hid, eps);
        else
            pagoda_add_rms_norm(H, hid, R, hid, norms[0], N, R, rows, hid, eps);
        linear(s, &L->qkv, N, QKV);
        if (s->lora_groups) lora_deltas(s, i, 0, N, hid, QKV, qkv_width);
        if (L->q_norm) {
            pagoda_rms_norm_heads(QKV, qkv_width, heads, hd, (const float *)(intptr_t)L->q_norm, rows, eps);
            pagoda_rms_norm_heads(K, qkv_width, kv_heads, hd, (const float *)(intptr_t)L->k_norm, rows, eps);
        }
        const float *cos_t = (const float *)(intptr_t)(L->local_rope ? s->local_cos : s->cos);
        const float *sin_t = (const float *)(intptr_t)(L->local_rope ? s->local_sin : s->sin);
        pagoda_rotary_neox(QKV, qkv_width, Q, q_size, rows, heads, hd, cos_t, sin_t);
        pagoda_rotary_neox(K, qkv_width, K, qkv_width, rows, kv_heads, hd, cos_t, sin_t);
        const int64_t *slots = (const int64_t *)(intptr_t)g[0];
        if (s->kv_bf16)
            pagoda_write_kv_bf16(K, V, qkv_width, KC, VC, slots, rows, kv_size);
        else
            pagoda_write_kv(K, V, qkv_width, KC, VC, slots, rows, kv_size);
        attend(Q, KC, VC, (const int32_t *)(intptr_t)g[1], g[2], (const int32_t *)(intptr_t)g[3], A,
               (float *)(intptr_t)s->scratch, s->scratch_stride, heads, kv_heads, hd, s->block_size, L->scale, g[4],
               s->threads, s->kv_bf16, L->window);
        linear(s, &L->o, A, H);
        if (s->lora_groups) lora_deltas(s, i, 1, A, q_size, H, hid);
        if (s->sandwich) {  // x = x + post_attention_norm(h); the MLP reads pre_feedforward_norm(x)
            pagoda_rms_norm(H, hid, norms[1], SIDE, rows, hid, eps);
            pagoda_add_rms_norm(SIDE, hid, R, hid, norms[2], N, R, rows, hid, eps);
        } else {
            pagoda_add_rms_norm(H, hid, R, hid, norms[1], N, R, rows, hid, eps);
        }
        linear(s, &L->gate_up, N, GU);
        if (s->lora_groups) lora_deltas(s, i, 2, N, hid, GU, 2 * s->inter);
        if (L->gelu)
            pagoda_gelu_tanh_and_mul(GU, rows, s->inter, ACT);
        else
            pagoda_silu_and_mul(GU, rows, s->inter, ACT);
        if (s->sandwich) {  // the layer's hidden output: post_feedforward_norm(mlp)
            linear(s, &L->down, ACT, SIDE);
            if (s->lora_groups) lora_deltas(s, i, 3, ACT, s->inter, SIDE, hid);
            pagoda_rms_norm(SIDE, hid, norms[3], H, rows, hid, eps);
        } else {
            linear(s, &L->down, ACT, H);
            if (s->lora_groups) lora_deltas(s, i, 3, ACT, s->inter, H, hid);
        }
    }
}

// ---- the sampled rows of a step's logits (a few rows of a vocabulary) ------------------------------------
// torch's reductions over one row of 49,152 logits measured 40-100 us each inside a decode step (isfinite of
// the sum, argmax; 14 and 43 us alone); one thread reads the row in a few microseconds. Finiteness is tested
// on the bits (-ffinite-math-only lets the compiler assume isfinite true).

static inline int all_finite(const float *x, int64_t n) {
    uint32_t seen = 0;  // the exponent bits: all ones somewhere iff a NaN or an infinity
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, x + i, 4);
        seen |= (bits & 0x7F800000u) == 0x7F800000u;
    }
    return !seen;
}

// finite[t] = 1 where row t of x [rows, n] (rows `stride` floats apart) holds no NaN or infinity
void pagoda_rows_finite(const float *x, int64_t stride, int64_t rows, int64_t n, uint8_t *finite) {
    for (int64_t t = 0; t < rows; t++) finite[t] = (uint8_t)all_finite(x + t * stride, n);
}

// out[t] = the index of the first largest value of row t (torch.argmax's), or -1 where the row holds a NaN or
// an infinity (the caller asks torch): the largest value of each chunk of 256 (a reduction the compiler
// vectorises), then the first index holding the largest of those in the first chunk that has it
#define ARGMAX_CHUNK 256
static inline float chunk_max(const float *x, int64_t n) {
    float m = x[0];
    for (int64_t i = 1; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

void pagoda_rows_argmax(const float *x, int64_t stride, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t t = 0; t < rows; t++) {
        const float *r = x + t * stride;
        if (n < 1 || !all_finite(r, n)) {
            out[t] = -1;
            continue;
        }
        int64_t best_chunk = 0;
        float top = chunk_max(r, n < ARGMAX_CHUNK ? n : ARGMAX_CHUNK);
        for (int64_t c = ARGMAX_CHUNK; c < n; c += ARGMAX_CHUNK) {
            const float m = chunk_max(r + c, n - c < ARGMAX_CHUNK ? n - c : ARGMAX_CHUNK);
            if (m > top) {
                top = m;
                best_chunk = c;
            }
        }
        int64_t i = best_chunk;
        while (i < n - 1 && r[i] != top) i++;
        out[t] = i;
    }
}
