/* y[m][n] = sum_k x[m][k] * w[n][k] (+ bias[n]) in float32 for up to a few hundred rows of x: the linear layers
 * of a decode batch or of a speculative verification (1 + draft tokens rows per request).
 *
 * Why: from 4 rows on, MKL's sgemm behind F.linear leaves its single-row (GEMV) path and the matmul costs
 * 2-3x the single-row time (measured on SmolLM2's shapes: the 49152 x 576 LM head took 3.2 ms for 1 row and
 * 9.3 ms for 5); on AMD hosts its float32 GEMM stays at ~190 GFLOP/s for any size, where oneDNN's reaches 440.
 * Here every weight row is read once from memory and the x rows stay in L1/L2. Measured on SmolLM2's shapes
 * (2 threads, AVX-512): 1.2-2.3x faster than F.linear for 4-8 rows, 1.5-4x for 9-20; with the tiles below,
 * 1.5-2x from 17 to 200 rows on a Zen 5 host (30 layers' shapes, ad hoc harness; 64 rows 57.7 ms against MKL's
 * 113, before the prefetching below). engine/models/gemm_timing.py measures at load which row counts come here.
 *
 * Up to ROWDOT_ROWS x rows, each weight row is read once and dotted with every x row, one accumulator per x row
 * in registers (the target's vector width along K, vk below); the tail of K runs scalar. More x rows are split as
 * evenly as possible into tiles of at most TILE_X, each taken against TILE_W weight rows (AVX-512: 4 x 6, 24
 * accumulators, 10 loads for 24 FMAs), the weight rows from L1 for every tile after the first. While a group of
 * weight rows is computed, the next group is prefetched, a share
 * of its rows during each tile, so the memory stream keeps going while the cores compute: without it the time of
 * a step was the sum of its compute and its weight reads, not the larger of the two (2 threads, Zen 5, SmolLM2's
 * 30 layers and LM head, interleaved in one C harness: 8 rows 23.2 -> 13.9 ms, 12 rows 34.0 -> 17.0, 20 rows
 * 29.9 -> 19.7, 64 rows 60.4 -> 53.4, against 10.5 ms for 1 row). Up to 7 rows the row-by-row loop is faster
 * still, once it prefetches its weight stream 8 KiB ahead: the hardware prefetcher alone left its loads waiting
 * as soon as the loop did more than one row's arithmetic per weight line (same harness, row-by-row up to 5 rows
 * and tiles above before, alternating: 1 row 8.2 -> 6.9 ms, 5 rows 11.8 -> 8.8). From 8 rows the tiles win again
 * (its 8 x loads per 8 FMAs bind the row-by-row loop): an engine's float32 decode step, tiles from 8 rows against
 * row-by-row up to 11 (bench_decode_ab --gemm-base, SmolLM2, 128-token contexts), batch 8 16.35 -> 14.74 ms,
 * 9 18.77 -> 13.37, 10 21.34 -> 14.54; batch 7 level either way. Every output is summed in the same order
 * whatever the row count (VK lanes along K, in two halves for bfloat16 weights on AVX2 (HALVES below), the same
 * halving tree, the tail scalar), so a row's result does not depend on its batch.
 * Parallel over blocks of 16 weight rows with OpenMP. Returns 0, or -1 for shapes it does not take. */
#include "vec16.h"

#define MAX_ROWS 256 /* cpu_gemm.py's MAX_ROWS */
#define ROWDOT_ROWS_BF16 11 /* the same for bfloat16, which has no tiles (more rows go to oneDNN) */
#define PREFETCH_BYTES 8192 /* of the weight stream, prefetched ahead of the row-by-row loop */

/* The float32 path works in the target's own vector width (vec16.h's vk, VK lanes along K): with AVX-512 the
 * tiles are 4 weight rows x 6 x rows (24 accumulators of 32 registers); elsewhere, with 16 registers of 8 floats,
 * 3 weight rows x 4 x rows (12 accumulators, 3 weight vectors, one x vector). The v16 loops this replaced ran an
 * AVX2-only Zen 1 host's 64 rows 7.9x slower than MKL, 8 rows 1.5x. */
#define ROWDOT_ROWS 7 /* up to this many x rows keep one accumulator each in registers; more go in tiles */
/* with bfloat16 weights in halves, two accumulators per x row: 7 rows' 14 spilled (7 rows 0.56x the tiles' pace) */
#define ROWDOT_ROWS_FOR(WB) (HALVES(WB) == 2 ? 6 : ROWDOT_ROWS)
#ifdef __AVX512F__
#define TILE_W 4      /* weight rows per tile */
#define TILE_X 6      /* x rows per tile at most */
#else
#define TILE_W 3
#define TILE_X 4
#endif

/* Make the compiler hold a vector in a register: GCC otherwise folds the load of an
 * x vector into each of its 4 FMAs (a memory operand), 4 loads where 1 does, and the tiles' loop becomes bound by
 * the load ports instead of the FMAs. SmolLM2's 30 layers, distinct weights per layer, alternating with the
 * folded build (2 threads, Zen 5): 12 rows 16.4 -> 12.6 ms, 32 rows 29.7 -> 23.7, 64 rows 47.1 -> 43.2; a batch-64
 * float32 decode step 126.5 -> 114.5 ms (bench_decode_ab --gemm-base). Without AVX no register holds a vk (32
 * bytes), and the constraint would not compile. */
#ifdef __AVX__
#define KEEP_IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define KEEP_IN_REGISTER(v) ((void)(v))
#endif

/* Bfloat16 weights on AVX2 without AVX-512 (vec16.h's BF16_HALVES 2) go through K 2 * VK elements a step, each
 * step's weights widened in two halves by one interleave of zeros each (loadk_bf16_half: elements 0-3 and 8-11,
 * then 4-7 and 12-15; the x rows are widened once per call into the same order), one accumulator per half, the two
 * added lane by lane before the halving tree. Widening by a zero-extending load and a shift (two operations per 8
 * weights instead of one per 8) bound the one-row loop at ~20 GB/s of bfloat16 weights from L3 as from memory;
 * with the interleave, SmolLM2's 30 layers' weights and LM head at one x row, in huge pages, 2 threads, Zen 1,
 * alternating in one C harness: 13.7 -> 11.2 ms (19.6 -> 24.0 GB/s; the host reads ~27). Elsewhere a step is VK
 * elements and one half, in order. */
#define HALVES(WB) ((WB) ? BF16_HALVES : 1)
#define KSTEP(WB) (HALVES(WB) * VK)

/* Half h of the weights at element i: float32 weights (WB 0) as they are, bfloat16 ones (WB 1) widened to float32
 * (exact). WB is a constant after inlining, so each instantiation compiles to one weight type's loop. */
static inline __attribute__((always_inline)) vk loadw(const void *w, int64_t i, const int h, const int WB) {
    return WB ? loadk_bf16_half((const uint16_t *)w + i, h) : loadk((const float *)w + i);
}
static inline __attribute__((always_inline)) float w_at(const void *w, int64_t i, const int WB) {
    return WB ? bf16_to_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}
/* an output, rounded to bfloat16 to nearest even where the weights are bfloat16 */
static inline __attribute__((always_inline)) void put_y(void *y, int64_t i, float v, const int WB) {
    if (WB) ((uint16_t *)y)[i] = f32_to_bf16(v);
    else ((float *)y)[i] = v;
}
#define W_AT(w, i) ((const char *)(w) + (int64_t)(i) * (WB ? 2 : 4)) /* element i's address */
#define LINE_ELEMS (WB ? 32 : 16) /* weight elements in a 64-byte line: a whole number of steps */

/* An output's sum: its accumulators' halves added lane by lane, the halving tree, then the scalar tail of K (from
 * kv on, x in its natural order) and the bias. */
static inline __attribute__((always_inline)) void finish(vk a0, vk a1, const float *xr, const void *wr, int kv,
                                                         int k_dim, const void *bias, void *y, int64_t at,
                                                         const int WB) {
    float s = hsumk(HALVES(WB) == 2 ? a0 + a1 : a0);
    for (int k = kv; k < k_dim; k++) s += xr[k] * w_at(wr, k, WB);
    put_y(y, at, s + (bias ? w_at(bias, 0, WB) : 0.0f), WB);
}

/* ROWS x rows (a constant after inlining) against WR (1 or 2) weight rows, read once, front to back (one stream
 * per thread, prefetched 8 KiB ahead: 4 and 16 KiB measured slower), the accumulators in registers (x rows from
 * L1/L2), a weight line a loop iteration (no branch for the prefetch). At these row counts the weight reads bound
 * the time, unless the chains of dependent FMAs do. */
static inline __attribute__((always_inline)) void row_dot(const float *x, int k_dim, const int rows, const void *w,
                                                          const int WR, const void *bias, void *y, int n_total,
                                                          const int WB) {
    vk acc[2][2][ROWDOT_ROWS]; /* [half][weight row][x row] */
    for (int h = 0; h < HALVES(WB); h++)
        for (int r = 0; r < WR; r++)
            for (int i = 0; i < rows; i++) acc[h][r][i] = (vk){0};
    const int kv = k_dim - k_dim % KSTEP(WB);
#define ROW_STEP(K) \
    for (int h = 0; h < HALVES(WB); h++) { \
        vk wv[2]; \
        for (int r = 0; r < WR; r++) wv[r] = loadw(w, (int64_t)r * k_dim + (K), h, WB); \
        for (int i = 0; i < rows; i++) { \
            const vk xv = loadk(x + (int64_t)i * k_dim + (K) + h * VK); \
            for (int r = 0; r < WR; r++) acc[h][r][i] = fmak(acc[h][r][i], xv, wv[r]); /* a line's steps */ \
        } /* are not reassociated */ \
    }
    int k = 0;
    for (; k + LINE_ELEMS <= kv; k += LINE_ELEMS) {
        for (int r = 0; r < WR; r++) /* past the row: the next rows */
            __builtin_prefetch(W_AT(w, (int64_t)r * k_dim + k) + PREFETCH_BYTES, 0, 0);
        for (int j = 0; j < LINE_ELEMS / KSTEP(WB); j++) ROW_STEP(k + j * KSTEP(WB))
    }
    for (; k < kv; k += KSTEP(WB)) ROW_STEP(k)
#undef ROW_STEP
    for (int r = 0; r < WR; r++)
        for (int i = 0; i < rows; i++)
            finish(acc[0][r][i], acc[HALVES(WB) - 1][r][i], x + (int64_t)i * k_dim, W_AT(w, (int64_t)r * k_dim), kv,
                   k_dim, bias ? W_AT(bias, r) : 0, y, (int64_t)i * n_total + r, WB);
}

/* bfloat16 weights in one half (in order: AVX-512 without AVX-512 BF16) take their rows in pairs up to this many x
 * rows: widening a weight vector costs more than loading a float32 one, and one or two chains of dependent FMAs
 * per weight row then bound the loop (Zen 1, 2 threads, the weights of the comment at
 * splitserve_few_rows_gemm_bf16, alternating: 1 row 8.46 -> 6.70 ms, 2 rows 9.02 -> 7.74, 3 rows 9.36 -> 8.65, 4
 * rows 10.25 -> 9.82, 5 rows level). In two halves each output has two chains already, and a pair's two streams
 * measured slower (2 rows 0.85x): one weight row at a time. */
#define PAIRED_ROWS 4
#define ROWS_CASE(R) \
    case R: { \
        int r = 0; \
        if (WB && HALVES(WB) == 1 && R <= PAIRED_ROWS) \
            for (; r + 2 <= nb; r += 2) \
                row_dot(x, k, R, W_AT(wb, (int64_t)r * k), 2, bb ? W_AT(bb, r) : 0, (char *)yb + r * (WB ? 2 : 4), n, \
                        WB); \
        for (; r < nb; r++) \
            row_dot(x, k, R, W_AT(wb, (int64_t)r * k), 1, bb ? W_AT(bb, r) : 0, (char *)yb + r * (WB ? 2 : 4), n, WB); \
        break; \
    }

/* XR x rows against WR weight rows (constants after inlining): WR x XR accumulators in registers, so each
 * VK-float step loads WR + XR vectors for WR * XR FMAs, a pass over K per half (the second pass's weights from
 * L1). Every output is summed as row_dot sums it, so a row's result does not depend on the tile. */
static inline __attribute__((always_inline)) void tile_dot(const float *x, int k_dim, const int XR, const void *w,
                                                           const int WR, const void *bias, void *y, int n_total,
                                                           const void *pf, int pf_rows, const int WB) {
    vk acc[TILE_W][TILE_X], first[TILE_W][TILE_X]; /* first: half 0's sums while half 1's pass runs */
    const int kv = k_dim - k_dim % KSTEP(WB);
    for (int h = 0; h < HALVES(WB); h++) {
        for (int r = 0; r < WR; r++)
            for (int i = 0; i < XR; i++) acc[r][i] = (vk){0};
        for (int k = 0; k < kv; k += KSTEP(WB)) {
            vk wv[TILE_W];
            for (int r = 0; r < WR; r++) wv[r] = loadw(w, (int64_t)r * k_dim + k, h, WB);
            /* a line a row, in the first pass: pf_rows <= 2 (block() spreads TILE_W rows over >= 2 tiles) */
            if (h == 0 && k % LINE_ELEMS == 0) {
                if (pf_rows > 0) __builtin_prefetch(W_AT(pf, k), 0, 3);
                if (pf_rows > 1) __builtin_prefetch(W_AT(pf, (int64_t)k_dim + k), 0, 3);
            }
            for (int i = 0; i < XR; i++) {
                vk xv = loadk(x + (int64_t)i * k_dim + k + h * VK);
                KEEP_IN_REGISTER(xv);
                for (int r = 0; r < WR; r++) acc[r][i] += xv * wv[r];
            }
        }
        if (HALVES(WB) == 2 && h == 0)
            for (int r = 0; r < WR; r++)
                for (int i = 0; i < XR; i++) first[r][i] = acc[r][i];
    }
    for (int r = 0; r < WR; r++)
        for (int i = 0; i < XR; i++)
            finish(HALVES(WB) == 2 ? first[r][i] : acc[r][i], acc[r][i], x + (int64_t)i * k_dim,
                   W_AT(w, (int64_t)r * k_dim), kv, k_dim, bias ? W_AT(bias, r) : 0, y, (int64_t)i * n_total + r,
                   WB);
}

#define TILE_CASE(XR) \
    case XR: \
        if (wr == TILE_W) tile_dot(x, k, XR, w, TILE_W, bias, y, n, pf, pf_rows, WB); \
        else tile_dot(x, k, XR, w, 1, bias, y, n, pf, pf_rows, WB); \
        break;

/* `rows` (<= TILE_X) x rows against `wr` (TILE_W or 1) weight rows, prefetching `pf_rows` rows from `pf` */
static inline __attribute__((always_inline)) void tile_any(const float *x, int k, int rows, const void *w, int wr,
                                                           const void *bias, void *y, int n, const void *pf,
                                                           int pf_rows, const int WB) {
    switch (rows) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4)
#if TILE_X > 4
        TILE_CASE(5)
#endif
#if TILE_X > 5
        TILE_CASE(6)
#endif
    }
}

/* m (<= ROWDOT_ROWS) x rows against nb weight rows, one at a time */
static inline __attribute__((always_inline)) void row_block_any(const float *x, const void *wb, const void *bb,
                                                                void *yb, int m, int n, int k, int nb, const int WB) {
    switch (m) { /* a constant row count, so each loop is fully unrolled */
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7)
    }
}

/* One instantiation per weight type of tile() and row_block(), neither inlined into block(): the tiles' loop is
 * sensitive to where it lands: with the unrolled loops inlined into block(), GCC compiled it 1.2-1.3x slower
 * (12-16 rows), and placed after them it ran 3-8% slower at 24-32 rows (the same instructions); so the tiles
 * come first. */
static __attribute__((noinline)) void tile(const float *x, int k, int rows, const void *w, int wr, const void *bias,
                                           void *y, int n, const void *pf, int pf_rows) {
    tile_any(x, k, rows, w, wr, bias, y, n, pf, pf_rows, 0);
}
static __attribute__((noinline)) void tile_w16(const float *x, int k, int rows, const void *w, int wr,
                                               const void *bias, void *y, int n, const void *pf, int pf_rows) {
    tile_any(x, k, rows, w, wr, bias, y, n, pf, pf_rows, 1);
}
static __attribute__((noinline)) void row_block(const float *x, const void *wb, const void *bb, void *yb, int m,
                                                int n, int k, int nb) {
    row_block_any(x, wb, bb, yb, m, n, k, nb, 0);
}
static __attribute__((noinline)) void row_block_w16(const float *x, const void *wb, const void *bb, void *yb, int m,
                                                    int n, int k, int nb) {
    row_block_any(x, wb, bb, yb, m, n, k, nb, 1);
}

/* all m rows against weight rows [n0, n0 + nb) */
static inline __attribute__((always_inline)) void block(const float *x, const void *w, const void *bias, void *y,
                                                        int m, int n, int k, int n0, int nb, const int WB) {
    const void *wb = W_AT(w, (int64_t)n0 * k), *bb = bias ? W_AT(bias, n0) : 0;
    void *yb = (char *)y + (int64_t)n0 * (WB ? 2 : 4);
    /* TILE_W weight rows at a time from memory, then from L1 for every tile of x rows (in L2) */
    if (m > ROWDOT_ROWS_FOR(WB)) {
        const int tiles = (m + TILE_X - 1) / TILE_X;
        for (int r = 0; r < nb;) {
            const int wr = nb - r >= TILE_W ? TILE_W : 1;
            const int ahead = n - (n0 + r + wr) < TILE_W ? n - (n0 + r + wr) : TILE_W; /* the next group's rows */
            for (int t = 0, done = 0; t < tiles; t++) {
                const int rows = (m - done) / (tiles - t), p0 = ahead * t / tiles, p1 = ahead * (t + 1) / tiles;
                const float *xt = x + (int64_t)done * k;
                const void *wt = W_AT(wb, (int64_t)r * k), *bt = bb ? W_AT(bb, r) : 0;
                const void *pf = W_AT(wb, (int64_t)(r + wr + p0) * k);
                void *yt = (char *)yb + ((int64_t)done * n + r) * (WB ? 2 : 4);
                if (WB) tile_w16(xt, k, rows, wt, wr, bt, yt, n, pf, p1 - p0);
                else tile(xt, k, rows, wt, wr, bt, yt, n, pf, p1 - p0);
                done += rows;
            }
            r += wr;
        }
        return;
    }
    if (WB) row_block_w16(x, wb, bb, yb, m, n, k, nb);
    else row_block(x, wb, bb, yb, m, n, k, nb);
}
static __attribute__((noinline)) void block_f32(const float *x, const void *w, const void *bias, void *y, int m,
                                                int n, int k, int n0, int nb) {
    block(x, w, bias, y, m, n, k, n0, nb, 0);
}
static __attribute__((noinline, unused)) void block_w16(const float *x, const void *w, const void *bias, void *y, int m,
                                                int n, int k, int n0, int nb) {
    block(x, w, bias, y, m, n, k, n0, nb, 1);
}

#define BLOCK_ROWS 16 /* weight rows per parallel task: each x-row tile pass re-reads them from L1 */

int splitserve_few_rows_gemm(const float *x, const float *w, const float *bias, float *y, int m, int n, int k,
                             int threads) {
    if (m < 1 || m > MAX_ROWS || n < 1 || k < 1) return -1;
    const int blocks = (n + BLOCK_ROWS - 1) / BLOCK_ROWS;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int b = 0; b < blocks; b++) {
        const int n0 = b * BLOCK_ROWS;
        block_f32(x, w, bias, y, m, n, k, n0, n - n0 < BLOCK_ROWS ? n - n0 : BLOCK_ROWS);
    }
    return 0;
}

/* The same for bfloat16 x, weight, bias and y: float32 sums, the result rounded to bfloat16 to nearest even.
 * With AVX-512 BF16, up to ROWDOT_ROWS_BF16 rows (more return -1: oneDNN's packed GEMM takes them), row by row
 * with the weight stream prefetched, pairs of products in one instruction (VDPBF16PS, 32 elements a step, as
 * oneDNN's bfloat16 GEMM computes them). Elsewhere oneDNN has no bfloat16 GEMM worth the name (an AVX2-only Zen 1
 * host, 2 threads: F.linear took 15 ms for one row of 40 3,072 x 576 weights and 151 ms for 11, MKL's float32
 * 30 and 87), so the float32 path above takes every row count: the x rows widened to float32 once per call, each
 * weight vector as it is loaded (exact, so the sums are those of float32 products; on AVX2 in two halves, HALVES
 * above, elsewhere in the float32 path's order).
 * Against the bfloat16 row-by-row loop this replaced (each x row widened at every step of every weight row), on
 * 20 3,072 x 576 and 20 576 x 1,536 weights, alternating in one process, bit for bit the same: 1 row 10.7 -> 7.2
 * ms, 2 rows 15.3 -> 7.8, 4 rows 25.3 -> 9.8, 11 rows 60.8 -> 25.9; 64 rows 137 ms (F.linear ~4.7x that). In the
 * engine (bench_decode_ab --dtype bfloat16 --gemm-base): a batch-1 SmolLM2 step 29.0 -> 19.9 ms (float32's:
 * 28.3), batch 16 467 -> 112 ms, a 512-token prefill 11.2 -> 2.7 s. Either way each output's order of operations
 * is fixed, so a row's result does not depend on its batch. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

static inline __attribute__((always_inline)) void row_dot_bf16(const uint16_t *x, int k_dim, const int rows,
                                                               const uint16_t *w, const uint16_t *bias,
                                                               uint16_t *y, int n_total) {
    __m512 acc[ROWDOT_ROWS_BF16];
    for (int i = 0; i < rows; i++) acc[i] = _mm512_setzero_ps();
    const int kv = k_dim - k_dim % 32;
    for (int k = 0; k < kv; k += 32) {
        __builtin_prefetch(w + k + PREFETCH_BYTES / 2, 0, 0); /* 8 KiB ahead */
        for (int i = 0; i < rows; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(x + (int64_t)i * k_dim + k),
                                      (__m512bh)_mm512_loadu_si512(w + k));
    }
    for (int i = 0; i < rows; i++) {
        float s = hsum16((v16)acc[i]);
        const uint16_t *xr = x + (int64_t)i * k_dim;
        for (int k = kv; k < k_dim; k++) s += bf16_to_f32(xr[k]) * bf16_to_f32(w[k]);
        y[(int64_t)i * n_total] = f32_to_bf16(s + (bias ? bf16_to_f32(*bias) : 0.0f));
    }
}

#define ROWS_CASE_BF16(R) \
    case R: \
        for (int r = 0; r < nb; r++) \
            row_dot_bf16(x, k, R, wb + (int64_t)r * k, bb ? bb + r : 0, yb + r, n); \
        break;

static __attribute__((noinline)) void row_block_bf16(const uint16_t *x, const uint16_t *wb, const uint16_t *bb,
                                                     uint16_t *yb, int m, int n, int k, int nb) {
    switch (m) {
        ROWS_CASE_BF16(1) ROWS_CASE_BF16(2) ROWS_CASE_BF16(3) ROWS_CASE_BF16(4) ROWS_CASE_BF16(5) ROWS_CASE_BF16(6)
        ROWS_CASE_BF16(7) ROWS_CASE_BF16(8) ROWS_CASE_BF16(9) ROWS_CASE_BF16(10) ROWS_CASE_BF16(11)
    }
}

int splitserve_few_rows_gemm_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int m,
                                  int n, int k, int threads) {
    if (m < 1 || m > ROWDOT_ROWS_BF16 || n < 1 || k < 1) return -1;
    const int blocks = (n + BLOCK_ROWS - 1) / BLOCK_ROWS;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int b = 0; b < blocks; b++) {
        const int n0 = b * BLOCK_ROWS, nb = n - n0 < BLOCK_ROWS ? n - n0 : BLOCK_ROWS;
        row_block_bf16(x, w + (int64_t)n0 * k, bias ? bias + n0 : 0, y + n0, m, n, k, nb);
    }
    return 0;
}

/* the most rows splitserve_few_rows_gemm_bf16 takes */
int splitserve_few_rows_bf16_max(void) { return ROWDOT_ROWS_BF16; }
#else
#include <stdlib.h>

int splitserve_few_rows_gemm_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int m,
                                  int n, int k, int threads) {
    if (m < 1 || m > MAX_ROWS || n < 1 || k < 1) return -1;
    float *xf = malloc(((size_t)m * k + VK) * sizeof *xf);
    if (!xf) return -1;
    const int kv = k - k % KSTEP(1);
    for (int i = 0; i < m; i++) { /* each x row widened in the weights' order of halves (KSTEP's comment) */
        const uint16_t *xr = x + (int64_t)i * k;
        float *fr = xf + (int64_t)i * k;
        for (int c = 0; c < kv; c += KSTEP(1))
            for (int h = 0; h < HALVES(1); h++) storek(fr + c + h * VK, loadk_bf16_half(xr + c, h));
        for (int c = kv; c < k; c++) fr[c] = bf16_to_f32(xr[c]);
    }
    const int blocks = (n + BLOCK_ROWS - 1) / BLOCK_ROWS;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int b = 0; b < blocks; b++) {
        const int n0 = b * BLOCK_ROWS;
        block_w16(xf, w, bias, y, m, n, k, n0, n - n0 < BLOCK_ROWS ? n - n0 : BLOCK_ROWS);
    }
    free(xf);
    return 0;
}

int splitserve_few_rows_bf16_max(void) { return MAX_ROWS; }
#endif

#include "lanes_gemm.h" /* the output-lanes GEMM (splitserve_lanes_gemm, splitserve_pair_gemm_bf16) */
