/* One token per row, drawn from softmax(x / T) over the row's logits (or from non-negative weights, when top-k /
 * top-p / min-p have already zeroed the tokens they drop) by inverting the cumulative distribution at the row's
 * uniform u in [0, 1): the first index j with w_0 + ... + w_j > u * (w_0 + ... + w_{V-1}), where
 * w = exp((x - max x) / T). Tokens whose weight is zero (logits of -inf: a grammar's mask) are never drawn, and
 * neither is anything below exp(-87) of the most likely token.
 *
 * Why: the exponential race the sampler used before (argmax of p / E, E ~ Exp(1)) needs one random number per
 * vocabulary entry; torch's exponential_ over a batch-64 step of SmolLM2's 49,152-token vocabulary took 49 ms
 * (2 cores, AMD EPYC Zen 5), nearly as much as the step's forward pass (67 ms), and softmax and the division
 * allocate and fault in three 12.5 MB tensors more. Inversion needs one number per row. Here each row is three
 * passes over its logits: the max; the weights, summed per 64-token chunk (float32 within a chunk, float64 across
 * chunks); the chunk where the running sum passes u * total, whose weights are recomputed and summed one by one.
 * Rounding can leave the target past a chunk's last token (the chunk's sum and its one-by-one sum differ by
 * ulps): the chunk's last token of nonzero weight is drawn then, a bias of order 1e-7 of that chunk's mass.
 * A row whose total is not a positive finite number (NaN logits) gets its first largest logit. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec16.h"

#define CHUNK 64         /* tokens per partial sum: 4 vectors */
#define PARALLEL_ROWS 4  /* fewer rows run on the calling thread */
#define LOWEST (-87.0f)  /* exp16's range: weights below exp(LOWEST) of the largest are zero */

/* a chunk of the row as 4 vectors: x[base..base+CHUNK), padded past the row's end with `pad` */
static inline void load_chunk(const float *x, int64_t base, int64_t vocab, float pad, v16 out[4]) {
    if (base + CHUNK <= vocab) {
        for (int k = 0; k < 4; k++) out[k] = load16f(x + base + 16 * k);
        return;
    }
    float buf[CHUNK];
    for (int j = 0; j < CHUNK; j++) buf[j] = base + j < vocab ? x[base + j] : pad;
    for (int k = 0; k < 4; k++) out[k] = load16f(buf + 16 * k);
}

/* the chunk's weights: exp((x - m) * inv_temp) from logits (zero below exp(LOWEST)), or the values themselves */
static inline void chunk_weights(const float *x, int64_t base, int64_t vocab, int from_logits, float m,
                                 float inv_temp, v16 w[4]) {
    load_chunk(x, base, vocab, from_logits ? -INFINITY : 0.0f, w);
    if (!from_logits) return;
    for (int k = 0; k < 4; k++) {
        const v16 t = (w[k] - m) * inv_temp;
        w[k] = pick(t < LOWEST, (v16){0}, exp16(t));
    }
}

static int64_t first_max(const float *x, int64_t vocab) {
    int64_t best = 0;
    for (int64_t j = 1; j < vocab; j++)
        if (x[j] > x[best]) best = j;
    return best;
}

static int64_t draw_row(const float *x, int64_t vocab, int from_logits, float inv_temp, double u, double *sums) {
    const int64_t chunks = (vocab + CHUNK - 1) / CHUNK;
    float m = 0.0f;
    if (from_logits) {
        v16 mv = (v16){0} - INFINITY;
        for (int64_t c = 0; c < chunks; c++) {
            v16 v[4];
            load_chunk(x, c * CHUNK, vocab, -INFINITY, v);
            for (int k = 0; k < 4; k++) mv = pick(v[k] > mv, v[k], mv);
        }
        m = hmax(mv);
    }
    double total = 0.0;
    for (int64_t c = 0; c < chunks; c++) {
        v16 w[4];
        chunk_weights(x, c * CHUNK, vocab, from_logits, m, inv_temp, w);
        sums[c] = (double)hsum16((w[0] + w[1]) + (w[2] + w[3]));
        total += sums[c];
    }
    if (!(total > 0.0) || !isfinite(total)) return first_max(x, vocab);
    const double target = u * total;
    double before = 0.0;
    int64_t c = 0, last = -1;
    for (; c < chunks; c++) {
        if (sums[c] > 0.0) last = c;
        if (before + sums[c] > target) break;
        before += sums[c];
    }
    if (c == chunks) c = last;  /* rounding put the target at the very end */
    v16 w[4];
    chunk_weights(x, c * CHUNK, vocab, from_logits, m, inv_temp, w);
    float flat[CHUNK];
    for (int k = 0; k < 4; k++) store16f(flat + 16 * k, w[k]);
    int64_t pick_j = -1;
    for (int j = 0; j < CHUNK; j++) {
        if (flat[j] <= 0.0f) continue;
        pick_j = j;
        before += flat[j];
        if (before > target) break;
    }
    return c * CHUNK + pick_j;
}

/* x: float32 rows of `stride` elements; row i of the draw is x row `row_idx[i]`, with 1 / temperature
 * `inv_temp[i]` (ignored for weights) and uniform `u[i]`; out[i] gets its token. Returns 0, or -1 when out of
 * memory. */
int splitserve_sample_rows(const float *x, const int64_t *row_idx, int64_t rows, int64_t vocab, int64_t stride,
                           int from_logits, const float *inv_temp, const double *u, int64_t *out, int threads) {
    const int64_t chunks = (vocab + CHUNK - 1) / CHUNK;
    if (threads < 1) threads = 1;
    double *sums = malloc((size_t)threads * (size_t)chunks * sizeof(double));
    if (sums == NULL) return -1;
#pragma omp parallel for num_threads(threads) if (rows >= PARALLEL_ROWS) schedule(static)
    for (int64_t i = 0; i < rows; i++)
        out[i] = draw_row(x + row_idx[i] * stride, vocab, from_logits, inv_temp[i], u[i],
                          sums + (int64_t)omp_get_thread_num() * chunks);
    free(sums);
    return 0;
}
