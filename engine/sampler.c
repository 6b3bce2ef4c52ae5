/* One token per row, drawn from softmax(x / T) over the row's logits, optionally restricted to the top-k / top-p
 * nucleus / min-p tokens, with one uniform u in [0, 1) per row. Weights are w = exp((x - max x) / T), so the most
 * likely token weighs exactly 1; tokens of weight zero (logits of -inf: a grammar's mask; anything below exp(-87)
 * of the most likely token) are never drawn.
 *
 * Unfiltered rows invert the cumulative distribution in token order: the first index j with
 * w_0 + ... + w_j > u * (w_0 + ... + w_{V-1}). Three passes over the logits: the max; the weights, summed per
 * 64-token chunk (float32 within a chunk, float64 across chunks); the chunk where the running sum passes u * total,
 * whose weights are recomputed and summed one by one. Rounding can leave the target past a chunk's last token (a
 * chunk's sum and its one-by-one sum differ by ulps): that chunk's last token of nonzero weight is drawn then, a
 * bias of order 1e-7 of the chunk's mass.
 *
 * Filtered rows keep what engine/sampler.py's filter_probs keeps, in the order of a descending sort (ties: the
 * lower token id first): rank r survives while r < top_k, the mass of ranks before r is below top_p of the total,
 * and its weight is at least min_p (of the most likely token's); rank 0 always survives. Without a full sort: a
 * histogram of the weights by their top 12 bits (the float's exponent and 4 mantissa bits; weights are in [0, 1],
 * so the bits order them) finds the bucket where the cut must fall, only the tokens from there up are gathered
 * and sorted, and the draw inverts the kept tokens' cumulative weight in that sorted order (the same
 * distribution as in token order; the pure-torch path uses token order, so the two draw different tokens for the
 * same u, each with the right probabilities).
 *
 * Why: the exponential race the sampler used before (argmax of p / E, E ~ Exp(1)) needs one random number per
 * vocabulary entry; torch's exponential_ over a batch-64 step of SmolLM2's 49,152-token vocabulary took 49 ms
 * (2 cores, AMD EPYC Zen 5), nearly as much as the step's forward pass (67 ms), and softmax and the division
 * allocate and fault in three 12.5 MB tensors more; filtering sorted every row (torch's sort: 106 ms at batch
 * 64). A row whose total is not a positive finite number (NaN logits) gets its first largest logit. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

#define CHUNK 64         /* tokens per partial sum */
#define NV (CHUNK / VK)  /* its vectors (vec16.h's target width) */
#define PARALLEL_ROWS 4  /* fewer rows run on the calling thread */
#define LOWEST (-87.0f)  /* expk's range: weights below exp(LOWEST) of the largest are zero */
#define BUCKET_SHIFT 19  /* a weight's bucket: its float bits >> 19 */
#define BUCKETS 2048     /* buckets of weights in [0, 1]: 1.0f's bits >> 19 is 2032 */

typedef struct {
    float w;
    int32_t id;
} cand_t;

typedef struct {  /* one thread's scratch */
    double *sums;  /* per chunk */
    int32_t *count;
    double *mass;
    cand_t *cand;
} scratch_t;

/* the chunk's weights exp((x[j] - m) * inv_temp), zero below exp(LOWEST) and past the row's end */
static inline void chunk_weights(const float *x, int64_t base, int64_t vocab, float m, float inv_temp, vk w[NV]) {
    if (base + CHUNK <= vocab) {
        for (int k = 0; k < NV; k++) w[k] = loadk(x + base + VK * k);
    } else {
        float buf[CHUNK];
        for (int j = 0; j < CHUNK; j++) buf[j] = base + j < vocab ? x[base + j] : -INFINITY;
        for (int k = 0; k < NV; k++) w[k] = loadk(buf + VK * k);
    }
    for (int k = 0; k < NV; k++) {
        const vk t = (w[k] - m) * inv_temp;
        w[k] = pickk(t < LOWEST, (vk){0}, expk(t));
    }
}

/* a chunk's weights summed as a tree of halvings over its vectors, then over the lanes */
static inline float chunk_sum(const vk w[NV]) {
    vk v[NV];
    memcpy(v, w, sizeof v);
    for (int n = NV / 2; n >= 1; n /= 2)
        for (int k = 0; k < n; k++) v[k] = v[2 * k] + v[2 * k + 1];
    return hsumk(v[0]);
}

static inline uint32_t bucket_of(float w) {
    uint32_t bits;
    memcpy(&bits, &w, sizeof bits);
    return bits >> BUCKET_SHIFT;
}

static int cand_cmp(const void *a, const void *b) {
    const cand_t *p = a, *q = b;
    if (p->w != q->w) return p->w > q->w ? -1 : 1;
    return (p->id > q->id) - (p->id < q->id);
}

static int64_t first_max(const float *x, int64_t vocab) {
    int64_t best = 0;
    for (int64_t j = 1; j < vocab; j++)
        if (x[j] > x[best]) best = j;
    return best;
}

/* unfiltered: the chunk where u * total falls, then token by token */
static int64_t invert_in_order(const float *x, int64_t vocab, float m, float inv_temp, double target,
                               const double *sums) {
    const int64_t chunks = (vocab + CHUNK - 1) / CHUNK;
    double before = 0.0;
    int64_t c = 0, last = -1;
    for (; c < chunks; c++) {
        if (sums[c] > 0.0) last = c;
        if (before + sums[c] > target) break;
        before += sums[c];
    }
    if (c == chunks) c = last;  /* rounding put the target at the very end */
    vk w[NV];
    chunk_weights(x, c * CHUNK, vocab, m, inv_temp, w);
    float flat[CHUNK];
    for (int k = 0; k < NV; k++) storek(flat + VK * k, w[k]);
    int64_t j_pick = -1;
    for (int j = 0; j < CHUNK; j++) {
        if (flat[j] <= 0.0f) continue;
        j_pick = j;
        before += flat[j];
        if (before > target) break;
    }
    return c * CHUNK + j_pick;
}

/* filtered: the histogram's cut bucket, the tokens from there up sorted, the kept prefix, the draw in it */
static int64_t draw_filtered(const float *x, int64_t vocab, float m, float inv_temp, double total, double u,
                             int64_t top_k, double top_p, float min_p, scratch_t *s) {
    const int64_t chunks = (vocab + CHUNK - 1) / CHUNK;
    memset(s->count, 0, BUCKETS * sizeof *s->count);
    memset(s->mass, 0, BUCKETS * sizeof *s->mass);
    float flat[CHUNK];
    for (int64_t c = 0; c < chunks; c++) {
        vk w[NV];
        chunk_weights(x, c * CHUNK, vocab, m, inv_temp, w);
        for (int k = 0; k < NV; k++) storek(flat + VK * k, w[k]);
        for (int j = 0; j < CHUNK; j++) {
            if (flat[j] <= 0.0f) continue;
            const uint32_t b = bucket_of(flat[j]);
            s->count[b]++;
            s->mass[b] += flat[j];
        }
    }
    /* from the top: the first bucket the cut can fall in (or the last nonempty one) */
    int64_t seen = 0;
    double mass = 0.0;
    int cut = -1;
    for (int b = BUCKETS - 1; b >= 0; b--) {
        if (s->count[b] == 0) continue;
        cut = b;
        seen += s->count[b];
        mass += s->mass[b];
        uint32_t low_bits = (uint32_t)b << BUCKET_SHIFT;
        float low;
        memcpy(&low, &low_bits, sizeof low);
        if (seen >= top_k || mass >= top_p * total || low < min_p) break;
    }
    int64_t n = 0;
    for (int64_t c = 0; c < chunks; c++) {
        vk w[NV];
        chunk_weights(x, c * CHUNK, vocab, m, inv_temp, w);
        for (int k = 0; k < NV; k++) storek(flat + VK * k, w[k]);
        for (int j = 0; j < CHUNK; j++)
            if (flat[j] > 0.0f && (int)bucket_of(flat[j]) >= cut)
                s->cand[n++] = (cand_t){flat[j], (int32_t)(c * CHUNK + j)};
    }
    qsort(s->cand, (size_t)n, sizeof *s->cand, cand_cmp);
    double kept = 0.0;
    int64_t r = 0;
    for (; r < n; r++) {
        if (r > 0 && (r >= top_k || kept >= top_p * total || s->cand[r].w < min_p)) break;
        kept += s->cand[r].w;
    }
    const double target = u * kept;
    double acc = 0.0;
    for (int64_t i = 0; i < r; i++) {
        acc += s->cand[i].w;
        if (acc > target) return s->cand[i].id;
    }
    return s->cand[r - 1].id;
}

static int64_t draw_row(const float *x, int64_t vocab, float inv_temp, double u, int64_t top_k, float top_p,
                        float min_p, scratch_t *s) {
    const int64_t chunks = (vocab + CHUNK - 1) / CHUNK;
    const int64_t full = vocab / CHUNK;
    vk mv = (vk){0} - INFINITY;
    for (int64_t c = 0; c < full; c++)
        for (int k = 0; k < NV; k++) {
            const vk v = loadk(x + c * CHUNK + VK * k);
            mv = pickk(v > mv, v, mv);
        }
    float m = hmaxk(mv);
    for (int64_t j = full * CHUNK; j < vocab; j++) m = x[j] > m ? x[j] : m;
    double total = 0.0;
    for (int64_t c = 0; c < chunks; c++) {
        vk w[NV];
        chunk_weights(x, c * CHUNK, vocab, m, inv_temp, w);
        s->sums[c] = (double)chunk_sum(w);
        total += s->sums[c];
    }
    if (!(total > 0.0) || !isfinite(total)) return first_max(x, vocab);
    if (top_k < vocab || top_p < 1.0f || min_p > 0.0f)
        return draw_filtered(x, vocab, m, inv_temp, total, u, top_k, top_p, min_p, s);
    return invert_in_order(x, vocab, m, inv_temp, u * total, s->sums);
}

/* x: float32 logits, rows of `stride` elements; draw i samples x row `row_idx[i]` at 1 / temperature
 * `inv_temp[i]`, keeping its top_k[i] (>= vocab: all) / top_p[i] (1: all) / min_p[i] (0: all), with uniform
 * u[i]; out[i] gets its token. Returns 0, or -1 when out of memory. */
int splitserve_sample_rows(const float *x, const int64_t *row_idx, int64_t rows, int64_t vocab, int64_t stride,
                           const float *inv_temp, const int64_t *top_k, const float *top_p, const float *min_p,
                           const double *u, int64_t *out, int threads) {
    const int64_t chunks = (vocab + CHUNK - 1) / CHUNK;
    if (threads < 1) threads = 1;
    int filtered = 0; /* the histogram and candidates only when a row filters */
    for (int64_t i = 0; i < rows && !filtered; i++) filtered = top_k[i] < vocab || top_p[i] < 1.0f || min_p[i] > 0.0f;
    scratch_t *s = calloc((size_t)threads, sizeof *s);
    int failed = s == NULL;
    for (int t = 0; t < threads && !failed; t++) {
        s[t].sums = malloc((size_t)chunks * sizeof(double));
        failed = !s[t].sums;
        if (filtered && !failed) {
            s[t].count = malloc(BUCKETS * sizeof(int32_t));
            s[t].mass = malloc(BUCKETS * sizeof(double));
            s[t].cand = malloc((size_t)vocab * sizeof(cand_t));
            failed = !s[t].count || !s[t].mass || !s[t].cand;
        }
    }
    if (!failed) {
#pragma omp parallel for num_threads(threads) if (rows >= PARALLEL_ROWS) schedule(static)
        for (int64_t i = 0; i < rows; i++)
            out[i] = draw_row(x + row_idx[i] * stride, vocab, inv_temp[i], u[i], top_k[i], top_p[i], min_p[i],
                              &s[omp_get_thread_num()]);
    }
    for (int t = 0; s != NULL && t < threads; t++) {
        free(s[t].sums);
        free(s[t].count);
        free(s[t].mass);
        free(s[t].cand);
    }
    free(s);
    return failed ? -1 : 0;
}
