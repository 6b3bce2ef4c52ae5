/* Paged decode attention for CPUs: one query token per sequence, K/V read straight from the pages of the
 * pool (no gather copy), online softmax in float32 a page at a time, the query heads that share a KV head
 * processed together so every K/V row is read once. Parallel over (sequence, kv head) with OpenMP.
 *
 * Layout: k_cache/v_cache [num_slots, kv_heads, head_dim]; slot = page * page_size + offset.
 * q/out [batch, heads, head_dim]; page_table [batch, max_pages] (int64); kv_lens [batch] (int64).
 * dtype: 0 = float32, 1 = bfloat16, 2 = float16. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
#define MAX_PAGE 256

/* exp(x) for x <= 0 without a libm call, so the loops over a page vectorize: x*log2(e) = n + f with
 * |f| <= 0.5, 2^f from a degree-6 polynomial (relative error ~2e-7), 2^n put into the exponent bits. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float t = x * 1.44269504088896341f;
    const float n = __builtin_roundf(t);
    const float f = t - n;
    float p = 1.5403530393381606e-4f;
    p = p * f + 1.3333558146428443e-3f;
    p = p * f + 9.6181291076284772e-3f;
    p = p * f + 5.5504108664821580e-2f;
    p = p * f + 2.4022650695910071e-1f;
    p = p * f + 6.9314718055994531e-1f;
    p = p * f + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float v) {
    uint32_t bits;
    memcpy(&bits, &v, 4);
    bits += 0x7FFF + ((bits >> 16) & 1); /* round to nearest even */
    return (uint16_t)(bits >> 16);
}

/* Copy n rows of head_dim elements (row stride `stride` elements) to a dense float buffer. */
static void rows_to_f32(const void *base, int64_t off, int64_t stride, int n, int head_dim, int dtype,
                        float *dst) {
    for (int r = 0; r < n; r++) {
        const int64_t o = off + r * stride;
        float *d = dst + (int64_t)r * head_dim;
        if (dtype == 0) {
            memcpy(d, (const float *)base + o, (size_t)head_dim * sizeof(float));
        } else if (dtype == 1) {
            const uint16_t *s = (const uint16_t *)base + o;
            for (int i = 0; i < head_dim; i++) d[i] = bf16_to_f32(s[i]);
        } else {
            const _Float16 *s = (const _Float16 *)base + o;
            for (int i = 0; i < head_dim; i++) d[i] = (float)s[i];
        }
    }
}

int splitserve_decode_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                                const int64_t *page_table, const int64_t *kv_lens, int batch, int num_heads,
                                int num_kv_heads, int head_dim, int page_size, int max_pages, float scale,
                                int dtype, int num_threads) {
    if (head_dim > MAX_HEAD_DIM || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > MAX_GROUP ||
        page_size > MAX_PAGE)
        return -1;
    const int group = num_heads / num_kv_heads;
    const int64_t stride = (int64_t)num_kv_heads * head_dim; /* elements between consecutive slots */
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads)
    for (int b = 0; b < batch; b++) {
        for (int kvh = 0; kvh < num_kv_heads; kvh++) {
            float qf[MAX_GROUP][MAX_HEAD_DIM];
            float acc[MAX_GROUP][MAX_HEAD_DIM];
            float mx[MAX_GROUP], denom[MAX_GROUP];
            float s[MAX_GROUP][MAX_PAGE];
            float kbuf[MAX_PAGE * MAX_HEAD_DIM], vbuf[MAX_PAGE * MAX_HEAD_DIM];
            const int64_t qrow = (int64_t)b * num_heads + (int64_t)kvh * group;
            rows_to_f32(q, qrow * head_dim, head_dim, group, head_dim, dtype, &qf[0][0]);
            for (int g = group - 1; g > 0; g--) {  /* spread the dense rows out, last first: no overlap */
                memmove(qf[g], &qf[0][0] + (int64_t)g * head_dim, (size_t)head_dim * sizeof(float));
            }
            for (int g = 0; g < group; g++) {
                for (int d = 0; d < head_dim; d++) { qf[g][d] *= scale; acc[g][d] = 0.f; }
                mx[g] = -INFINITY;
                denom[g] = 0.f;
            }
            const int64_t len = kv_lens[b];
            const int64_t *pages = page_table + (int64_t)b * max_pages;
            for (int64_t start = 0; start < len; start += page_size) {
                const int n = (int)((len - start) < page_size ? (len - start) : page_size);
                const int64_t off = pages[start / page_size] * page_size * stride + (int64_t)kvh * head_dim;
                const float *kr, *vr;
                int64_t rs; /* row stride of kr/vr in floats */
                if (dtype == 0) {
                    kr = (const float *)k_cache + off;
                    vr = (const float *)v_cache + off;
                    rs = stride;
                } else {
                    rows_to_f32(k_cache, off, stride, n, head_dim, dtype, kbuf);
                    rows_to_f32(v_cache, off, stride, n, head_dim, dtype, vbuf);
                    kr = kbuf;
                    vr = vbuf;
                    rs = head_dim;
                }
                for (int g = 0; g < group; g++) {
                    const float *qg = qf[g];
                    float *sg = s[g];
                    float m = mx[g];
                    for (int t = 0; t < n; t++) {
                        const float *k = kr + t * rs;
                        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                        for (int d = 0; d < head_dim; d++) dot += qg[d] * k[d];
                        sg[t] = dot;
                        m = dot > m ? dot : m;
                    }
                    const float c = mx[g] == -INFINITY ? 0.f : exp_nonpositive(mx[g] - m);
                    float den = 0.f;
#pragma omp simd reduction(+ : den)
                    for (int t = 0; t < n; t++) {
                        sg[t] = exp_nonpositive(sg[t] - m);
                        den += sg[t];
                    }
                    float *a = acc[g];
#pragma omp simd
                    for (int d = 0; d < head_dim; d++) a[d] *= c;
                    for (int t = 0; t < n; t++) {
                        const float p = sg[t];
                        const float *v = vr + t * rs;
#pragma omp simd
                        for (int d = 0; d < head_dim; d++) a[d] += p * v[d];
                    }
                    mx[g] = m;
                    denom[g] = denom[g] * c + den;
                }
            }
            for (int g = 0; g < group; g++) {
                const int64_t o = (qrow + g) * head_dim;
                const float inv = denom[g] > 0.f ? 1.f / denom[g] : 0.f;
                for (int d = 0; d < head_dim; d++) {
                    const float v = acc[g][d] * inv;
                    if (dtype == 0) ((float *)out)[o + d] = v;
                    else if (dtype == 1) ((uint16_t *)out)[o + d] = f32_to_bf16(v);
                    else ((_Float16 *)out)[o + d] = (_Float16)v;
                }
            }
        }
    }
    return 0;
}
