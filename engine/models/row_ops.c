/* The small per-row ops of a decoder layer, for float32 or bfloat16 rows: RMSNorm, optionally fused with the
 * residual add before it, and rotate-half RoPE (below). The norm:
 *   residual += x (rounded to the dtype, as torch's add rounds it);
 *   out = w * (residual * rsqrt(mean(residual^2) + eps))
 * or, without a residual, the same over x. The arithmetic is float32 and the roundings are torch's own
 * (the pure-torch path in engine/models/norm.py): bfloat16 rounds h = v * r to bfloat16 before the weight multiplies
 * it, then rounds the product; only the order of the sum of squares differs (a few float32 ulps of the mean).
 *
 * Why: in torch the norm is seven small ops (cast, pow, mean, add, rsqrt, mul, mul) and the residual add an eighth,
 * each a dispatch and an allocation; at decode batch sizes, where a row is 576 values, their overhead is the cost
 * (SmolLM2's 61 norms: about 2 ms of a 23 ms batch-1 step on 2 cores). Rows are independent: OpenMP splits them
 * when there are enough to pay for waking the threads. Returns 0, or -1 for a dtype it does not take. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec16.h"

#define PARALLEL_ROWS 64 /* fewer rows run on the calling thread */

static void row_f32(const float *x, float *res, const float *w, float *out, int dim, float eps) {
    const float *v = x;
    if (res) {
        for (int i = 0; i < dim; i++) res[i] += x[i];
        v = res;
    }
    float sum = 0.0f;
    for (int i = 0; i < dim; i++) sum += v[i] * v[i];
    const float r = 1.0f / sqrtf(sum / (float)dim + eps);
    for (int i = 0; i < dim; i++) out[i] = w[i] * (v[i] * r);
}

static void row_bf16(const uint16_t *x, uint16_t *res, const uint16_t *w, uint16_t *out, int dim, float eps,
                     float *scratch) {
    float sum = 0.0f;
    for (int i = 0; i < dim; i++) {
        float v = bf16_to_f32(x[i]);
        if (res) {
            res[i] = f32_to_bf16(bf16_to_f32(res[i]) + v);
            v = bf16_to_f32(res[i]);
        }
        scratch[i] = v;
        sum += v * v;
    }
    const float r = 1.0f / sqrtf(sum / (float)dim + eps);
    for (int i = 0; i < dim; i++) out[i] = f32_to_bf16(bf16_to_f32(w[i]) * bf16_to_f32(f32_to_bf16(scratch[i] * r)));
}

/* x, residual (or NULL) and out: [rows, dim], contiguous; w: [dim]; dtype 0 = float32, 1 = bfloat16 */
int splitserve_rms_norm(const void *x, void *residual, const void *w, void *out, int rows, int dim, float eps,
                        int dtype, int threads) {
    if (rows < 0 || dim < 1 || dim > 16384 || (dtype != 0 && dtype != 1)) return -1;
    const int nt = rows >= PARALLEL_ROWS && threads > 1 ? threads : 1;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int r = 0; r < rows; r++) {
        const int64_t at = (int64_t)r * dim;
        if (dtype == 0) {
            row_f32((const float *)x + at, residual ? (float *)residual + at : 0, (const float *)w,
                    (float *)out + at, dim, eps);
        } else {
            float scratch[dim];
            row_bf16((const uint16_t *)x + at, residual ? (uint16_t *)residual + at : 0, (const uint16_t *)w,
                     (uint16_t *)out + at, dim, eps, scratch);
        }
    }
    return 0;
}

/* Rotate-half RoPE: out[t][h] = x[t][h] * cos[t] + rotate_half(x[t][h]) * sin[t], each product and the sum
 * rounded to bfloat16 as torch's mul, mul_ and add_ round them (engine/models/rope.py; in float32 the compiler
 * may fuse a product into the add, which differs from torch by an ulp). x: [tokens, heads, dim]
 * with rows (tokens) ``row_stride`` elements apart (q and k inside the fused QKV projection's output); out:
 * contiguous; cos, sin: [tokens, dim]. */
int splitserve_rope(const void *x, int64_t row_stride, void *out, const void *cos_t, const void *sin_t, int tokens,
                    int heads, int dim, int dtype, int threads) {
    if (tokens < 0 || heads < 1 || dim < 2 || dim % 2 || (dtype != 0 && dtype != 1)) return -1;
    const int half = dim / 2, nt = tokens >= PARALLEL_ROWS && threads > 1 ? threads : 1;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int t = 0; t < tokens; t++) {
        for (int h = 0; h < heads; h++) {
            const int64_t in = (int64_t)t * row_stride + (int64_t)h * dim, at = ((int64_t)t * heads + h) * dim;
            if (dtype == 0) {
                const float *xr = (const float *)x + in, *c = (const float *)cos_t + (int64_t)t * dim,
                            *s = (const float *)sin_t + (int64_t)t * dim;
                float *o = (float *)out + at;
                for (int i = 0; i < dim; i++) {
                    const float rot = i < half ? -xr[i + half] : xr[i - half];
                    o[i] = xr[i] * c[i] + rot * s[i]; /* may contract to an FMA: one rounding fewer */
                }
            } else {
                const uint16_t *xr = (const uint16_t *)x + in, *c = (const uint16_t *)cos_t + (int64_t)t * dim,
                               *s = (const uint16_t *)sin_t + (int64_t)t * dim;
                uint16_t *o = (uint16_t *)out + at;
                for (int i = 0; i < dim; i++) {
                    const float rot = i < half ? -bf16_to_f32(xr[i + half]) : bf16_to_f32(xr[i - half]);
                    const float a = bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[i]) * bf16_to_f32(c[i])));
                    const float b = bf16_to_f32(f32_to_bf16(rot * bf16_to_f32(s[i])));
                    o[i] = f32_to_bf16(a + b);
                }
            }
        }
    }
    return 0;
}

/* The KV write: row i of k and v (row_bytes each, rows k_stride / v_stride bytes apart: views of the fused
 * projection) into slot slots[i] of the caches (row_bytes per slot). The slots are scattered over a pool far
 * larger than the caches, so each row is written cold: torch's index_copy_ took ~170 us for 64 float32 rows of
 * SmolLM2 (its stores missed one after another) against 6 us with the rows in cache. Here the rows PF_ROWS
 * ahead are prefetched for writing while the current one is copied, and the rows are split over the threads.
 * Returns 0, or -1 if a slot is outside [0, num_slots). */
#define PF_ROWS 4

int splitserve_kv_write(void *k_cache, void *v_cache, const int64_t *slots, int64_t num_slots, const void *k,
                        const void *v, int64_t rows, int64_t row_bytes, int64_t k_stride, int64_t v_stride,
                        int threads) {
    for (int64_t i = 0; i < rows; i++)
        if (slots[i] < 0 || slots[i] >= num_slots) return -1;
    const int nt = rows >= 32 && threads > 1 ? threads : 1;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t i = 0; i < rows; i++) {
        if (i + PF_ROWS < rows) {
            const int64_t at = slots[i + PF_ROWS] * row_bytes;
            for (int64_t c = 0; c < row_bytes; c += 64) {
                __builtin_prefetch((char *)k_cache + at + c, 1, 3);
                __builtin_prefetch((char *)v_cache + at + c, 1, 3);
            }
        }
        memcpy((char *)k_cache + slots[i] * row_bytes, (const char *)k + i * k_stride, (size_t)row_bytes);
        memcpy((char *)v_cache + slots[i] * row_bytes, (const char *)v + i * v_stride, (size_t)row_bytes);
    }
    return 0;
}

/* SiLU-and-multiply of the MLP: out[t][i] = silu(gate[t][i]) * up[t][i], with gate and up the two halves of the
 * fused gate/up projection's row ([tokens, 2 * inter], contiguous) and out [tokens, inter]. silu(g) = g * s with
 * s = 1 / (1 + e) for g >= 0 and e / (1 + e) below, e = exp(-|g|) (expk: its argument is never positive, so
 * nothing overflows). bfloat16 rounds silu(g) to bfloat16 before the product and then the product, as torch's
 * silu followed by mul_ does. One function for every row count, so a decoding row gets the same bits whether it
 * runs with a prefill chunk, alone or in the native layer stack (engine/runner/layer_stack.c). */
static inline vk siluk(vk g) {
    const vk zero = {0};
    const vki pos = g >= zero;
    const vk e = expk(pickk(pos, zero - g, g));
    return g * (pickk(pos, zero + 1.0f, e) / (e + 1.0f));
}

static inline float silu1(float g) {
    vk v = {0};
    v[0] = g;
    return siluk(v)[0];
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
/* 16 bfloat16 lanes: VCVTNEPS2BF16 rounds to nearest even, as f32_to_bf16 does (NaNs stay NaNs, their bits may
 * differ); 2.5x fewer instructions than the generic conversions, which made this loop slower than torch's */
static inline __m512 widen_bf16(const uint16_t *p) {
    return (__m512)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}
static inline void silu_mulk_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o) {
    const __m512 s = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh((__m512)siluk((vk)widen_bf16(g))));
    _mm256_storeu_si256((__m256i *)o, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(s, widen_bf16(u))));
}
#else
static inline void silu_mulk_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o) {
    storek_bf16(o, roundk_bf16(siluk(loadk_bf16(g))) * loadk_bf16(u));
}
#endif

int splitserve_silu_mul(const void *gate_up, void *out, int tokens, int inter, int dtype, int threads) {
    if (tokens < 0 || inter < 1 || (dtype != 0 && dtype != 1)) return -1;
    const int nt = (int64_t)tokens * inter >= PARALLEL_ROWS * 1024 && threads > 1 ? threads : 1;
    const int iv = inter - inter % VK;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int t = 0; t < tokens; t++) {
        if (dtype == 0) {
            const float *g = (const float *)gate_up + (int64_t)t * 2 * inter, *u = g + inter;
            float *o = (float *)out + (int64_t)t * inter;
            for (int i = 0; i < iv; i += VK) storek(o + i, siluk(loadk(g + i)) * loadk(u + i));
            for (int i = iv; i < inter; i++) o[i] = silu1(g[i]) * u[i];
        } else {
            const uint16_t *g = (const uint16_t *)gate_up + (int64_t)t * 2 * inter, *u = g + inter;
            uint16_t *o = (uint16_t *)out + (int64_t)t * inter;
            for (int i = 0; i < iv; i += VK) silu_mulk_bf16(g + i, u + i, o + i);
            for (int i = iv; i < inter; i++)
                o[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(silu1(bf16_to_f32(g[i])))) * bf16_to_f32(u[i]));
        }
    }
    return 0;
}
