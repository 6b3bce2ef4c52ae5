/* Paged decode attention for CPUs: one query token per sequence, K/V read straight from the pages of the
 * pool (no gather copy), online softmax in float32 a page at a time. A task is one sequence with all its kv
 * heads (a page's rows are read whole, once, and the next page is prefetched since pages are scattered), or,
 * when the batch is too small to keep every thread busy, one sequence's share of its kv heads. The query
 * heads that share a kv head are processed together. Parallel over tasks with OpenMP.
 *
 * The task body is specialized for the common head dims (64, 128) so the compiler unrolls the dot products
 * and keeps an accumulator row in vector registers; other dims take the generic body. cpu_kernels.py compiles
 * with -ffp-contract=fast and reassociation allowed, so the dot products use FMAs and tree reductions.
 *
 * Layout: k_cache/v_cache [num_slots, kv_heads, head_dim]; slot = page * page_size + offset.
 * q/out [batch, heads, head_dim]; page_table [batch, max_pages] (int64); kv_lens [batch] (int64).
 * dtype: 0 = float32, 1 = bfloat16, 2 = float16. Returns 0, -1 for unsupported shapes, -2 out of memory. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEAD_DIM 256
#define MAX_PAGE 256
#define MAX_ROWS 128 /* query heads in one task */

/* exp(x) for x <= 0 without a libm call, so the loops over a page vectorize: x*log2(e) = n + f with
 * |f| <= 0.5, 2^f from a degree-6 polynomial (relative error ~2e-7), 2^n put into the exponent bits. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float t = x * 1.44269504088896341f;
    const float n = __builtin_rintf(t);
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

static inline uint16_t f32_to_bf16(float v) {
    uint32_t bits;
    memcpy(&bits, &v, 4);
    bits += 0x7FFF + ((bits >> 16) & 1); /* round to nearest even */
    return (uint16_t)(bits >> 16);
}

typedef uint32_t __attribute__((may_alias)) u32_alias;

/* Copy n rows of head_dim elements (row stride `stride` elements) to a dense float buffer. */
static inline __attribute__((always_inline)) void rows_to_f32(const void *base, int64_t off, int64_t stride,
                                                               int n, const int head_dim, int dtype, float *dst) {
    for (int r = 0; r < n; r++) {
        const int64_t o = off + r * stride;
        float *d = dst + (int64_t)r * head_dim;
        if (dtype == 0) {
            memcpy(d, (const float *)base + o, (size_t)head_dim * sizeof(float));
        } else if (dtype == 1) { /* bfloat16 is the top half of a float32: a widening shift, vectorized */
            const uint16_t *s = (const uint16_t *)base + o;
            u32_alias *d32 = (u32_alias *)d;
#pragma omp simd
            for (int i = 0; i < head_dim; i++) d32[i] = (uint32_t)s[i] << 16;
        } else {
            const _Float16 *s = (const _Float16 *)base + o;
#pragma omp simd
            for (int i = 0; i < head_dim; i++) d[i] = (float)s[i];
        }
    }
}

/* Ask the memory system for n rows of `bytes` bytes (rows `stride` elements of `elem` bytes apart). */
static inline void prefetch_rows(const void *base, int64_t off, int64_t stride, int n, int bytes, int elem) {
    for (int r = 0; r < n; r++) {
        const char *row = (const char *)base + (off + r * stride) * elem;
        for (int c = 0; c < bytes; c += 64) __builtin_prefetch(row + c, 0, 3);
    }
}

typedef struct {
    const void *q, *k_cache, *v_cache;
    void *out;
    const int64_t *page_table, *kv_lens;
    int num_heads, group, page_size, max_pages, dtype;
    int64_t stride; /* elements between consecutive slots */
    float scale;
} Args;

/* One sequence's kv heads [kv0, kv1), each with its `group` query heads, against every page of the sequence.
 * A page's rows for these heads are loaded (and, for 16-bit caches, converted) once for all of them.
 * head_dim is a compile-time constant in the specialized copies, so the accumulator row stays in registers. */
static inline __attribute__((always_inline)) void attend(const Args *A, float *scratch, int b, int kv0,
                                                         int kv1, const int head_dim) {
    const int group = A->group, page_size = A->page_size, dtype = A->dtype;
    const int64_t stride = A->stride;
    const int elem = dtype == 0 ? 4 : 2;
    const int nkv = kv1 - kv0, rows = nkv * group, width = nkv * head_dim; /* width: elements per slot used */
    float *qf = scratch, *acc = qf + rows * head_dim; /* scratch: see scratch_floats() */
    float *kbuf = acc + rows * head_dim, *vbuf = kbuf + page_size * width;
    float mx[MAX_ROWS], denom[MAX_ROWS];
    float s[MAX_PAGE];
    const int64_t qrow = (int64_t)b * A->num_heads + (int64_t)kv0 * group;
    rows_to_f32(A->q, qrow * head_dim, head_dim, rows, head_dim, dtype, qf);
    for (int i = 0; i < rows * head_dim; i++) { qf[i] *= A->scale; acc[i] = 0.f; }
    for (int r = 0; r < rows; r++) { mx[r] = -INFINITY; denom[r] = 0.f; }
    const int64_t len = A->kv_lens[b];
    const int64_t *pages = A->page_table + (int64_t)b * A->max_pages;
    for (int64_t start = 0; start < len; start += page_size) {
        const int n = (int)((len - start) < page_size ? (len - start) : page_size);
        const int64_t off = pages[start / page_size] * page_size * stride + (int64_t)kv0 * head_dim;
        if (start + page_size < len) { /* pages are scattered: ask for the next one while this one is used */
            const int64_t next = pages[start / page_size + 1] * page_size * stride + (int64_t)kv0 * head_dim;
            const int m = (int)((len - start - page_size) < page_size ? (len - start - page_size) : page_size);
            prefetch_rows(A->k_cache, next, stride, m, width * elem, elem);
            prefetch_rows(A->v_cache, next, stride, m, width * elem, elem);
        }
        const float *kp, *vp;
        int64_t rs; /* row stride of kp/vp in floats */
        if (dtype == 0) {
            kp = (const float *)A->k_cache + off;
            vp = (const float *)A->v_cache + off;
            rs = stride;
        } else {
            rows_to_f32(A->k_cache, off, stride, n, width, dtype, kbuf);
            rows_to_f32(A->v_cache, off, stride, n, width, dtype, vbuf);
            kp = kbuf;
            vp = vbuf;
            rs = width;
        }
        for (int r = 0; r < rows; r++) {
            const float *kr = kp + (r / group) * head_dim, *vr = vp + (r / group) * head_dim;
            const float *qg = qf + r * head_dim;
            float m = mx[r];
            for (int t = 0; t < n; t++) {
                const float *k = kr + t * rs;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < head_dim; d++) dot += qg[d] * k[d];
                s[t] = dot;
                m = dot > m ? dot : m;
            }
            const float c = mx[r] == -INFINITY ? 0.f : exp_nonpositive(mx[r] - m);
            float den = 0.f;
#pragma omp simd reduction(+ : den)
            for (int t = 0; t < n; t++) {
                s[t] = exp_nonpositive(s[t] - m);
                den += s[t];
            }
            float a[MAX_HEAD_DIM];
            float *ar = acc + r * head_dim;
#pragma omp simd
            for (int d = 0; d < head_dim; d++) a[d] = ar[d] * c;
            for (int t = 0; t < n; t++) {
                const float p = s[t];
                const float *v = vr + t * rs;
#pragma omp simd
                for (int d = 0; d < head_dim; d++) a[d] += p * v[d];
            }
#pragma omp simd
            for (int d = 0; d < head_dim; d++) ar[d] = a[d];
            mx[r] = m;
            denom[r] = denom[r] * c + den;
        }
    }
    for (int r = 0; r < rows; r++) {
        const int64_t o = (qrow + r) * head_dim;
        const float inv = denom[r] > 0.f ? 1.f / denom[r] : 0.f;
        for (int d = 0; d < head_dim; d++) {
            const float v = acc[r * head_dim + d] * inv;
            if (dtype == 0) ((float *)A->out)[o + d] = v;
            else if (dtype == 1) ((uint16_t *)A->out)[o + d] = f32_to_bf16(v);
            else ((_Float16 *)A->out)[o + d] = (_Float16)v;
        }
    }
}

static void attend_64(const Args *A, float *w, int b, int kv0, int kv1) { attend(A, w, b, kv0, kv1, 64); }
static void attend_128(const Args *A, float *w, int b, int kv0, int kv1) { attend(A, w, b, kv0, kv1, 128); }
static void attend_any(const Args *A, float *w, int b, int kv0, int kv1, int hd) { attend(A, w, b, kv0, kv1, hd); }

int splitserve_decode_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                                const int64_t *page_table, const int64_t *kv_lens, int batch, int num_heads,
                                int num_kv_heads, int head_dim, int page_size, int max_pages, float scale,
                                int dtype, int num_threads) {
    if (head_dim > MAX_HEAD_DIM || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > MAX_ROWS ||
        page_size > MAX_PAGE)
        return -1;
    const Args A = {q, k_cache, v_cache, out, page_table, kv_lens, num_heads, num_heads / num_kv_heads,
                    page_size, max_pages, dtype, (int64_t)num_kv_heads * head_dim, scale};
    /* Enough sequences to share out: one task per sequence (its pages read as whole rows); otherwise split
     * each sequence's kv heads into tasks of `per` heads, so small batches still keep every thread busy. */
    const int group = num_heads / num_kv_heads;
    int per = num_kv_heads;
    while (per > 1 && ((int64_t)batch * (num_kv_heads / per) < 2 * (int64_t)num_threads || per * group > MAX_ROWS))
        per--;
    while (num_kv_heads % per) per--;
    const int tasks_per_seq = num_kv_heads / per;
    /* per-thread scratch: query rows and accumulators, plus one converted K and V page for 16-bit caches */
    const size_t floats = (size_t)2 * per * group * head_dim + (dtype ? (size_t)2 * page_size * per * head_dim : 0);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = malloc(floats * sizeof(float));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < (int64_t)batch * tasks_per_seq; task++) {
            if (!scratch) continue;
            const int b = (int)(task / tasks_per_seq), kv0 = (int)(task % tasks_per_seq) * per;
            if (head_dim == 64) attend_64(&A, scratch, b, kv0, kv0 + per);
            else if (head_dim == 128) attend_128(&A, scratch, b, kv0, kv0 + per);
            else attend_any(&A, scratch, b, kv0, kv0 + per, head_dim);
        }
        free(scratch);
    }
    return failed ? -2 : 0;
}
