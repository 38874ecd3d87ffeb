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
