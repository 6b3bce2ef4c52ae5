/* Part of few_rows_gemm.c's library, which includes it once after its own definitions (MAX_ROWS, KEEP_IN_REGISTER,
 * vec16.h): the output-lanes GEMM and its bfloat16 pair form, in a file of their own. engine/native.py keys the
 * compiled library by the headers beside a source too. */
#ifndef SPLITSERVE_LANES_GEMM_H
#define SPLITSERVE_LANES_GEMM_H

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The output-lanes GEMM: weights kept in a layout of their own (cpu_gemm.lanes_pack), so that a vector holds 16
 * outputs' weights: block b (outputs 16b to 16b + 15, zero rows past n) is [k][16] in float32, [k / 2][16][2] in
 * bfloat16 (a 32-bit lane holds one output's weights for k and k + 1), the blocks back to back. A step takes 4 bytes
 * of each x row (an element, or a bfloat16 pair) broadcast to every lane and one FMA (VDPBF16PS in bfloat16, with
 * AVX-512 BF16: the pair GEMM) per block, so the sums build up lane by lane along K with no horizontal sum at the
 * end, and a tile of LANES_ROWS x rows against LANES_VECS blocks keeps 24 accumulators in registers: 3 weight loads
 * and 8 broadcasts for 24 FMAs. Every output is one accumulator run over k from 0 to the end in the same order,
 * whatever the tile or the row count, so a row's result does not depend on its batch here either (though not the
 * same bits as the row-dot loops and tiles above, which sum along K in lanes and then a tree).
 * Over SmolLM2's 30 layers' shapes on a Zen 4 host (2 threads, ad hoc, alternating), ms: bfloat16 against the
 * row-by-row loop above and oneDNN's packed GEMM, 1 row 7.6 / 8.2 / 12.6, 4 rows 8.5 / 10.8 / 12.7, 11 rows 11.6 /
 * 14.4 / 14.1, 64 rows 36.8 / - / 41.2; float32 against the tiles above and oneDNN, 1 row 9.9 / 14.2 / 19.7, 4 rows
 * 10.6 / 22.6 / 16.0, 16 rows 20.0 / 30.0 / 26.2, 64 rows 66.7 / 84.5 / 82.8, 128 rows 132.4 / 170.5 / 148.0: the
 * tiles' horizontal sums and their x loads along K cost more than broadcasts. */
#ifdef __AVX512F__
#define LANES_ROWS 8 /* x rows per tile at most */
#define LANES_VECS 3 /* blocks of 16 outputs per tile */
#define LANES_F32 1
static inline int lanes_streams(int rows, int WB) { return (void)rows, (void)WB, LANES_VECS; } /* blocks a tile takes */
#include <immintrin.h>
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define LANES_BF16 1
#else
#define LANES_BF16 0
#endif

/* acc + x * w lane by lane: one float32 FMA, or (WB) the sum of each lane's bfloat16 pair products */
static inline __attribute__((always_inline)) __m512 lanes_fma(__m512 acc, __m512 x, __m512 w, const int WB) {
#if LANES_BF16
    if (WB) return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
#endif
    (void)WB;
    return _mm512_fmadd_ps(x, w, acc);
}

/* R x rows against V blocks from output n0 on; WB: bfloat16 (a constant after inlining, as R and V) */
static inline __attribute__((always_inline)) void lanes_tile(const char *x, int k_dim, const int R, const char *wl,
                                                             const int V, const void *bias, void *y, int n_total,
                                                             int n0, const int WB) {
    __m512 acc[LANES_VECS][LANES_ROWS];
    for (int v = 0; v < V; v++)
        for (int i = 0; i < R; i++) acc[v][i] = _mm512_setzero_ps();
    const int64_t row = (int64_t)k_dim * (WB ? 2 : 4), block = 16 * row; /* bytes */
    for (int c = 0; c < (WB ? k_dim / 2 : k_dim); c++) { /* 4 bytes of each x row, 64 of each block, a step */
        __m512 w[LANES_VECS];
        for (int v = 0; v < V; v++) w[v] = _mm512_loadu_ps(wl + v * block + (int64_t)c * 64);
        for (int i = 0; i < R; i++) {
            int32_t bits;
            memcpy(&bits, x + i * row + (int64_t)c * 4, sizeof bits);
            const __m512 xb = _mm512_castsi512_ps(_mm512_set1_epi32(bits));
            for (int v = 0; v < V; v++) acc[v][i] = lanes_fma(acc[v][i], xb, w[v], WB);
        }
    }
    for (int v = 0; v < V; v++) {
        const int at = n0 + 16 * v, left = n_total - at;
        const __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
#if LANES_BF16
        if (WB) {
            const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                        _mm256_maskz_loadu_epi16(m, (const uint16_t *)bias + at)), 16))
                                  : _mm512_setzero_ps();
            for (int i = 0; i < R; i++) {
                uint16_t out[16];
                storek_bf16(out, (vk)_mm512_add_ps(acc[v][i], b)); /* to nearest even, as f32_to_bf16 */
                _mm256_mask_storeu_epi16((uint16_t *)y + (int64_t)i * n_total + at, m,
                                         _mm256_loadu_si256((const __m256i *)out));
            }
            continue;
        }
#endif
        const __m512 b = bias ? _mm512_maskz_loadu_ps(m, (const float *)bias + at) : _mm512_setzero_ps();
        for (int i = 0; i < R; i++)
            _mm512_mask_storeu_ps((float *)y + (int64_t)i * n_total + at, m, _mm512_add_ps(acc[v][i], b));
    }
}

#define LANES_CASE(R) \
    case R: \
        if (V == LANES_VECS) lanes_tile(x, k, R, wl, LANES_VECS, bias, y, n, n0, WB); \
        else if (V == 2) lanes_tile(x, k, R, wl, 2, bias, y, n, n0, WB); \
        else lanes_tile(x, k, R, wl, 1, bias, y, n, n0, WB); \
        break;

static inline __attribute__((always_inline)) void lanes_rows_any(const char *x, int k, int rows, const char *wl,
                                                                 int V, const void *bias, void *y, int n, int n0,
                                                                 const int WB) {
    switch (rows) {
        LANES_CASE(1) LANES_CASE(2) LANES_CASE(3) LANES_CASE(4) LANES_CASE(5) LANES_CASE(6) LANES_CASE(7)
        LANES_CASE(8)
    }
}
static __attribute__((noinline)) void lanes_rows_f32(const char *x, int k, int rows, const char *wl, int V,
                                                     const void *bias, void *y, int n, int n0, const char *pf,
                                                     int pf_lines, int c0, int c1, float *state, int spread) {
    /* not prefetched here: the AVX-512 build was measured without (Zen 4); every line, consecutive blocks
     * (LANES_CHUNK and LANES_SPREAD are AVX2's) */
    (void)pf, (void)pf_lines, (void)c0, (void)c1, (void)state, (void)spread;
    lanes_rows_any(x, k, rows, wl, V, bias, y, n, n0, 0);
}
#if LANES_BF16
static __attribute__((noinline)) void lanes_rows_bf16(const char *x, int k, int rows, const char *wl, int V,
                                                      const void *bias, void *y, int n, int n0, const char *pf,
                                                      int pf_lines, int c0, int c1, float *state, int spread) {
    (void)pf, (void)pf_lines, (void)c0, (void)c1, (void)state, (void)spread;
    lanes_rows_any(x, k, rows, wl, V, bias, y, n, n0, 1);
}
#endif

#elif defined(__AVX2__) && defined(__FMA__)
/* With AVX2 (16 registers of 8 floats) a block is two vectors, and a tile is R x rows against NB blocks with R * NB
 * at most 6: 12 accumulators, the sums lane by lane in the same order as above (the same bits as the AVX-512 build,
 * and the same whatever the tile). Up to 3 rows a tile takes several blocks at once (lanes_streams): each block is a
 * weight stream of its own, and one stream per thread left a 1-row GEMM waiting on memory (SmolLM2's 30 layers and
 * LM head, 2 threads, Zen 3, alternating: 1 row 16.3 -> 13.4 ms with 2 blocks, 15.4 -> 12.1 with 3). Where a
 * block takes more than one tile, each tile prefetches a share of the next block (the weights a tile reads from
 * memory are then read during the compute of the tiles before; 1.03-1.09x from 12 to 128 rows, level below,
 * against no prefetch; with one tile it cost up to 0.90x at 1 row). SmolLM2's 30 layers' shapes on a Zen 3 host
 * (2 threads, alternating with MKL behind F.linear, oneDNN's packed GEMM and the tiles above), ms: 8 rows 21.4 /
 * 47.9 / 29.5 / 20.6, 32 rows 44.0 / 79.4 / 59.8 / 52.8, 128 rows 149.8 / 205.9 / 190.3 / 206.1 (181 GFLOP/s, 89%
 * of the host's FMA peak, where MKL's was 65%), 512 rows (unprefetched) 597 / 642 / 686 / 956.
 * Bfloat16 (the pair layout: a 64-byte line holds a k pair for 16 outputs) is widened as it is read where the rows
 * fit one tile, the x rows once a call, and a block once into a float32 buffer where they take several (the same
 * bits either way: widening is exact). Against the tiles above and MKL on widened operands (SmolLM2's 30 layers and
 * LM head, Zen 3, 2 threads, alternating), ms: 1 row 9.7 / 12.1, 5 rows 10.5 / 15.8, 16 rows 33.7 / 56.6, 64 rows
 * 105.3 / 233.1 / 228.2, 128 rows 204.2 / 472.8 / 358.5, 512 rows 885.5 / 1930 / 1078. Widened in every tile
 * instead, 128 rows took 382 ms (with the odd half's mask in a register, the 12 accumulators spilled: slower still). */
#include <immintrin.h>
#define LANES_ROWS 6
#define LANES_F32 1
#define LANES_BF16 1
#define LANES_WIDEN_X 1 /* bfloat16 x rows widened to float32 once a call */
#define LANES_CHUNK 32 /* rows in 2-3 tiles: lines of a block each tile takes in turn (lanes_chunked) */
#define LANES_CHUNK_TILES 3
#define LANES_SPREAD 1 /* one tile against several blocks: each a contiguous run of the thread's (lanes_spread) */
#define LANES_CHUNK_ROWS_BF16 5 /* bfloat16 tiles' rows there (6-row tiles: 11 and 12 rows 0.89-0.96x, 18 0.85x) */

/* blocks a tile takes at once for its R rows (R * NB <= 6). Bfloat16 at 3 rows one: 3 x 2 took 12.5 ms where 3 x
 * 1 took 10.7 (the 30 layers and LM head, Zen 3, 2 threads, alternating; float32 3 x 2 1.04x faster than 3 x 1) */
static inline int lanes_streams(int rows, int WB) {
    return rows == 1 ? 4 : rows == 2 ? 3 : rows == 3 && !WB ? 2 : 1;
}

/* accumulator pair t (row i, block j: t = i * NB + j) += xb * (u, v) */
#define LANES_UP(t, xb) (l##t = _mm256_fmadd_ps(xb, u, l##t), h##t = _mm256_fmadd_ps(xb, v, h##t))
#define LANES_SLOT(t, xb) \
    switch (t) { \
    case 0: LANES_UP(0, xb); break; case 1: LANES_UP(1, xb); break; case 2: LANES_UP(2, xb); break; \
    case 3: LANES_UP(3, xb); break; case 4: LANES_UP(4, xb); break; default: LANES_UP(5, xb); break; \
    }

/* 8 outputs' weights at k step h of a 32-byte line: float32 as they are; bfloat16 pairs (WB) widened, k even (h 0)
 * by a shift, k odd (h 1) by two (exact; a mask's register made the 12 accumulators spill) */
static inline __attribute__((always_inline)) __m256 lanes_load(const char *p, const int h, const int WB) {
    if (!WB) return _mm256_loadu_ps((const float *)p);
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return _mm256_castsi256_ps(h ? _mm256_slli_epi32(_mm256_srli_epi32(v, 16), 16) : _mm256_slli_epi32(v, 16));
}

/* accumulator pair t to or from a tile's saved state (16 floats a pair), where the tile has it (R, NB: constants) */
#define LANES_LOAD(t) \
    if ((t) < R * NB) l##t = _mm256_loadu_ps(state + 16 * (t)), h##t = _mm256_loadu_ps(state + 16 * (t) + 8);
#define LANES_SAVE(t) \
    if ((t) < R * NB) _mm256_storeu_ps(state + 16 * (t), l##t), _mm256_storeu_ps(state + 16 * (t) + 8, h##t);

/* R x rows (float32: bfloat16 ones widened by the caller) against NB blocks from output n0 on (R, NB, WB: constants
 * after inlining); each k step, the block's weights are loaded once for all rows, and with R <= 2 the rows' x once
 * for all blocks. WB: bfloat16 weights, bias and output (rounded to nearest even), a 64-byte line holding a k pair.
 * Lines c0 to c1 only (of a block's k or k / 2); with ``state`` the accumulators start from it where c0 > 0 and are
 * saved to it where lines are left after c1 (the sums are the same: each one still runs over k in order) */
static inline __attribute__((always_inline)) void lanes_tile(const float *xf, int k_dim, const int R, const int NB,
                                                             const char *wl, const void *bias, void *y,
                                                             int n_total, int n0, const char *pf, int pf_lines,
                                                             const int WB, int c0, int c1, float *state, int spread) {
    /* named accumulators: held in an array, GCC stored all 12 to the stack at every step (the 30 layers' GEMMs ran
     * at 35% of the FMA peak) */
    const __m256 z = _mm256_setzero_ps();
    __m256 l0 = z, h0 = z, l1 = z, h1 = z, l2 = z, h2 = z, l3 = z, h3 = z, l4 = z, h4 = z, l5 = z, h5 = z;
    const int W16 = WB == 1; /* weights as bfloat16 pairs (else float32) */
    const int lines = W16 ? k_dim / 2 : k_dim; /* 64-byte lines a block */
    const int64_t bb = 64 * (int64_t)lines * spread; /* bytes from one of the tile's blocks to the next */
    if (state && c0 > 0) {
        LANES_LOAD(0) LANES_LOAD(1) LANES_LOAD(2) LANES_LOAD(3) LANES_LOAD(4) LANES_LOAD(5)
    }
    for (int c = c0; c < c1; c++) { /* a 64-byte line of each block a step */
        const char *wc = wl + 64 * (int64_t)c;
        if (c < pf_lines) _mm_prefetch(pf + 64 * (int64_t)c, _MM_HINT_T0);
        for (int hk = 0; hk < (W16 ? 2 : 1); hk++) {
            /* the odd k's weights loaded again rather than kept from the even k's load: kept, a 6-row tile's 12
             * accumulators spilled (6 rows 20.6 -> 10.9 ms over the 30 layers and LM head, Zen 3, 2 threads) */
            if (W16) __asm__ volatile("" ::: "memory");
            const int kk = W16 ? 2 * c + hk : c;
            __m256 x0 = _mm256_broadcast_ss(xf + kk), x1 = R > 1 ? _mm256_broadcast_ss(xf + k_dim + kk) : z;
            if (R <= 2) {
                KEEP_IN_REGISTER(x0);
                KEEP_IN_REGISTER(x1);
            }
            for (int j = 0; j < NB; j++) {
                __m256 u = lanes_load(wc + j * bb, hk, W16), v = lanes_load(wc + j * bb + 32, hk, W16);
                KEEP_IN_REGISTER(u);
                KEEP_IN_REGISTER(v);
                if (R <= 2) {
                    LANES_SLOT(j, x0)
                    if (R > 1) LANES_SLOT(NB + j, x1)
                } else {
                    for (int i = 0; i < R; i++) {
                        const __m256 xb = i == 0 ? x0 : i == 1 ? x1 : _mm256_broadcast_ss(xf + (int64_t)i * k_dim + kk);
                        LANES_SLOT(i * NB + j, xb)
                    }
                }
            }
        }
    }
    if (state && c1 < lines) {
        LANES_SAVE(0) LANES_SAVE(1) LANES_SAVE(2) LANES_SAVE(3) LANES_SAVE(4) LANES_SAVE(5)
        return;
    }
    const __m256 lo[6] = {l0, l1, l2, l3, l4, l5}, hi[6] = {h0, h1, h2, h3, h4, h5};
    for (int j = 0; j < NB; j++) {
        const int at = n0 + 16 * j * spread, left = n_total - at, cnt = left < 16 ? left : 16;
        float b[16] = {0};
        if (bias)
            for (int o = 0; o < cnt; o++)
                b[o] = WB ? bf16_to_f32(((const uint16_t *)bias)[at + o]) : ((const float *)bias)[at + o];
        const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
        for (int i = 0; i < R; i++) {
            float part[16];
            _mm256_storeu_ps(part, _mm256_add_ps(lo[i * NB + j], b0));
            _mm256_storeu_ps(part + 8, _mm256_add_ps(hi[i * NB + j], b1));
            if (WB) {
                uint16_t out[16];
                storek_bf16(out, loadk(part));
                storek_bf16(out + 8, loadk(part + 8));
                memcpy((uint16_t *)y + (int64_t)i * n_total + at, out, sizeof(uint16_t) * cnt);
            } else {
                memcpy((float *)y + (int64_t)i * n_total + at, part, sizeof(float) * cnt);
            }
        }
    }
}

#define LANES_TILE(R, NB) \
    case (R) * 8 + (NB): \
        lanes_tile((const float *)x, k, R, NB, wl, bias, y, n, n0, pf, pf_lines, WB, c0, c1, state, spread); \
        break;

/* rows x rows against V blocks (the driver's: at most lanes_streams(rows)) ``spread`` blocks apart, lines c0 to c1
 * (lanes_tile) */
static inline __attribute__((always_inline)) void lanes_rows_any(const char *x, int k, int rows, const char *wl,
                                                                 int V, const void *bias, void *y, int n, int n0,
                                                                 const char *pf, int pf_lines, const int WB,
                                                                 int c0, int c1, float *state, int spread) {
    switch (rows * 8 + V) {
        LANES_TILE(1, 1) LANES_TILE(1, 2) LANES_TILE(1, 3) LANES_TILE(1, 4) LANES_TILE(2, 1) LANES_TILE(2, 2)
        LANES_TILE(2, 3) LANES_TILE(3, 1) LANES_TILE(3, 2) LANES_TILE(4, 1) LANES_TILE(5, 1) LANES_TILE(6, 1)
    }
}
static __attribute__((noinline)) void lanes_rows_f32(const char *x, int k, int rows, const char *wl, int V,
                                                     const void *bias, void *y, int n, int n0, const char *pf,
                                                     int pf_lines, int c0, int c1, float *state, int spread) {
    lanes_rows_any(x, k, rows, wl, V, bias, y, n, n0, pf, pf_lines, 0, c0, c1, state, spread);
}
static __attribute__((noinline)) void lanes_rows_bf16(const char *x, int k, int rows, const char *wl, int V,
                                                      const void *bias, void *y, int n, int n0, const char *pf,
                                                      int pf_lines, int c0, int c1, float *state, int spread) {
    lanes_rows_any(x, k, rows, wl, V, bias, y, n, n0, pf, pf_lines, 1, c0, c1, state, spread);
}
/* the same over a bfloat16 block widened into float32 (lanes_widen: one block, its rows in several tiles) */
static __attribute__((noinline)) void lanes_rows_wide(const char *x, int k, int rows, const char *wl,
                                                      const void *bias, void *y, int n, int n0, const char *pf,
                                                      int pf_lines) {
    lanes_rows_any(x, k, rows, wl, 1, bias, y, n, n0, pf, pf_lines, 2, 0, k, NULL, 1);
}

/* a block of bfloat16 pairs ([k / 2][16][2]) into float32 ([k][16]; exact) */
static void lanes_widen(const char *w, int k, float *out) {
    for (int p = 0; p < k / 2; p++) /* k = 2p (h 0) and 2p + 1 (h 1), outputs 0-7 and 8-15 each */
        for (int h = 0; h < 2; h++)
            for (int half = 0; half < 2; half++)
                _mm256_storeu_ps(out + 32 * (int64_t)p + 16 * h + 8 * half,
                                 lanes_load(w + 64 * (int64_t)p + 32 * half, h, 1));
}
#else
#define LANES_F32 0
#define LANES_BF16 0
#endif

#if LANES_F32
/* AVX2: a 4-6 row tile's single block prefetched this far ahead (the AVX-512 tiles prefetch nothing): alternating
 * with no prefetch, SmolLM2's 30 layers and LM head (Zen 3, 2 threads), 5 rows 1.05-1.14x, 6 rows 1.08-1.14x, 4
 * rows level (0.97-1.00x); 4 and 8 KiB no better */
#define PREFETCH_LANES 2048

#ifdef LANES_CHUNK
/* rows in 2-3 tiles against one block (AVX2): LANES_CHUNK lines of it at a time, every tile in turn, each tile's
 * accumulators kept in ``state`` (12 pairs of 8 floats a tile) between pieces, so that the first tile reads the
 * piece from memory (pf_lines of its stream prefetched PREFETCH_LANES bytes ahead) and the others from L1 while
 * that stream is still being read. Each output is still one sum over k in order: the same bits. A whole block per
 * tile instead left the memory idle while the later tiles read it from L2: SmolLM2's 30 layers (Zen 3, 2 threads,
 * alternating), float32 7 and 8 rows 24.1 -> 19.0 ms (6 rows in one tile: 13-18 ms), 12 rows 1.06x, 16 rows 1.09x;
 * 32 lines a piece against 16, 64, 128 and 256: 1.03-1.10x, 0.94-0.98x, 0.90-0.93x, 0.84-0.92x. From 4 tiles on
 * it lost (24 rows 0.97x, 32 rows 0.91x, 64 rows 0.81x: each piece costs every tile a store and load of its
 * accumulators), so those keep whole blocks. Bfloat16 pairs are widened as read here, in every tile (widened once
 * a piece into a buffer that the tiles then read, 7-8 rows were level with whole blocks and 12-16 rows 0.85-0.94x),
 * in tiles of at most 5 rows (LANES_CHUNK_ROWS_BF16). Bfloat16 against whole widened blocks, ms: 7 rows 22.5 ->
 * 15.6, 8 rows 22.4 -> 16.9, 9-10 rows 1.30x, 13-14 rows 1.13x. */
static void lanes_chunked(const char *x, int k, int m, int tiles, const char *wg, const void *bias, void *y, int n,
                          int n0, int pf_lines, float *state, const int WB) {
    const int lines = WB ? k / 2 : k;
    for (int c0 = 0; c0 < lines; c0 += LANES_CHUNK) {
        const int c1 = lines - c0 < LANES_CHUNK ? lines : c0 + LANES_CHUNK;
        for (int t = 0, done = 0; t < tiles; t++) {
            const int rows = (m - done) / (tiles - t), pf = t == 0 ? pf_lines : 0;
            const char *xt = x + (int64_t)done * k * 4; /* float32 (bfloat16 rows widened once a call) */
            char *yt = (char *)y + (int64_t)done * n * (WB ? 2 : 4);
            if (WB)
                lanes_rows_bf16(xt, k, rows, wg, 1, bias, yt, n, n0, wg + PREFETCH_LANES, pf, c0, c1, state + 192 * t,
                                1);
            else
                lanes_rows_f32(xt, k, rows, wg, 1, bias, yt, n, n0, wg + PREFETCH_LANES, pf, c0, c1, state + 192 * t,
                               1);
            done += rows;
        }
    }
}
#endif

#ifdef LANES_SPREAD
/* rows in one tile against nb > 1 blocks (AVX2, 1-3 rows), inside the driver's parallel region: this thread's share
 * of the blocks split into nb contiguous runs, the tile taking one block of each run at a time, so each of its nb
 * weight streams reads on through its run rather than restarting at every group of nb consecutive blocks (the
 * hardware prefetcher ramps up again at each restart; the blocks of bfloat16 or k = 576 are 18 KiB). Each output is
 * still one sum over k in order: the same bits. SmolLM2's 30 layers and LM head (Zen 3, 2 threads, alternating),
 * against consecutive groups: bfloat16 1 and 2 rows 0.92-0.95x of the time, float32 0.96-0.98x. */
static void lanes_spread_tile(const char *x, int k, int m, const char *wl, int b0, int V, int spread,
                              const void *bias, void *y, int n, const int WB) {
    const char *w = wl + (int64_t)b0 * 16 * k * (WB ? 2 : 4);
    if (WB)
        lanes_rows_bf16(x, k, m, w, V, bias, y, n, 16 * b0, NULL, 0, 0, k / 2, NULL, spread);
    else
        lanes_rows_f32(x, k, m, w, V, bias, y, n, 16 * b0, NULL, 0, 0, k, NULL, spread);
}
static void lanes_spread(const char *x, int k, int m, const char *wl, int nb, const void *bias, void *y, int n,
                         int blocks, const int WB) {
    const int parts = omp_get_num_threads(), part = omp_get_thread_num();
    const int first = (int)((int64_t)blocks * part / parts), end = (int)((int64_t)blocks * (part + 1) / parts);
    const int run = (end - first) / nb; /* blocks a run */
    for (int i = 0; i < run; i++) /* a block of each run a tile */
        lanes_spread_tile(x, k, m, wl, first + i, nb, run, bias, y, n, WB);
    for (int b0 = first + nb * run; b0 < end; b0 += nb) /* those left over (fewer than nb), consecutive */
        lanes_spread_tile(x, k, m, wl, b0, end - b0 < nb ? end - b0 : nb, 1, bias, y, n, WB);
}
#endif

/* y = x @ W^T (+ bias) for m (<= MAX_ROWS) rows, W [n, k] in lane blocks (k even in bfloat16). Parallel over groups
 * of blocks (lanes_streams of the largest tile's rows); each group's x rows in tiles of at most LANES_ROWS, as even
 * as possible, the group's weights from L1/L2 for every tile after the first (AVX2, 2-3 tiles: lanes_chunked). */
static int lanes_gemm(const void *x, const void *wl, const void *bias, void *y, int m, int n, int k, int threads,
                      const int WB) {
    if (m < 1 || m > MAX_ROWS || n < 1 || k < 1 || (WB && k % 2)) return -1;
    const int64_t es = WB ? 2 : 4;
    int tiles = (m + LANES_ROWS - 1) / LANES_ROWS;
#ifdef LANES_CHUNK
    if (WB && tiles > 1 && (m + LANES_CHUNK_ROWS_BF16 - 1) / LANES_CHUNK_ROWS_BF16 <= LANES_CHUNK_TILES)
        tiles = (m + LANES_CHUNK_ROWS_BF16 - 1) / LANES_CHUNK_ROWS_BF16;
#endif
    const int nb = lanes_streams((m + tiles - 1) / tiles, WB);
    const int blocks = (n + 15) / 16, groups = (blocks + nb - 1) / nb;
    int64_t xes = es; /* bytes an x element, as the tiles read it */
#ifdef LANES_WIDEN_X
    float *xw = NULL;
    if (WB) {
        xw = malloc(sizeof(float) * (size_t)m * k);
        if (!xw) return -1;
        for (int64_t i = 0; i < (int64_t)m * k; i++) xw[i] = bf16_to_f32(((const uint16_t *)x)[i]);
        x = xw;
        xes = 4;
    }
#endif
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
    float *state = NULL; /* lanes_chunked's: each tile's 12 accumulator pairs, on this thread's stack */
#ifdef LANES_CHUNK
    float chunk_state[LANES_CHUNK_TILES * 192] __attribute__((aligned(64)));
    if (tiles > 1 && tiles <= LANES_CHUNK_TILES && nb == 1 && (!WB || (m + tiles - 1) / tiles <= LANES_CHUNK_ROWS_BF16))
        state = chunk_state;
#endif
    (void)state; /* unused where LANES_CHUNK is not defined (AVX-512) */
#ifdef LANES_WIDEN_X
    /* bfloat16 rows in more tiles: each block widened once into float32, for all of them */
    float *wide = WB && tiles > 1 && !state ? malloc(sizeof(float) * 16 * (size_t)k) : NULL;
#endif
#ifdef LANES_SPREAD
    if (tiles == 1 && nb > 1)
        lanes_spread(x, k, m, wl, nb, bias, y, n, blocks, WB);
    else
#endif
#pragma omp for schedule(static)
    for (int g = 0; g < groups; g++) {
        const int b0 = g * nb, V = blocks - b0 < nb ? blocks - b0 : nb;
        const char *wg = (const char *)wl + (int64_t)b0 * 16 * k * es;
        /* AVX2 (the tile's pf): where the rows take several tiles, the next group's weights, a share during each;
         * a single block in one tile, its own weights PREFETCH_LANES bytes ahead */
        const int ahead = tiles == 1 && nb == 1;
        const int lines = (tiles > 1 || ahead) && b0 + V < blocks ? (int)((int64_t)V * 16 * k * es / 64) : 0;
        const char *next = ahead ? wg + PREFETCH_LANES : wg + (int64_t)V * 16 * k * es;
#ifdef LANES_WIDEN_X
        if (wide) lanes_widen(wg, k, wide);
#endif
#ifdef LANES_CHUNK
        if (state) {
            const int own = WB ? k / 2 : k; /* the block's lines; the last block's stream prefetched to its end */
            lanes_chunked(x, k, m, tiles, wg, bias, y, n, 16 * b0, b0 + V < blocks ? own : own - PREFETCH_LANES / 64,
                          state, WB);
            continue;
        }
#endif
        for (int t = 0, done = 0; t < tiles; t++) {
            const int rows = (m - done) / (tiles - t), from = (int)((int64_t)lines * t / tiles);
            const int to = (int)((int64_t)lines * (t + 1) / tiles);
            const char *xt = (const char *)x + (int64_t)done * k * xes;
            char *yt = (char *)y + (int64_t)done * n * es;
#if LANES_BF16
#ifdef LANES_WIDEN_X
            if (wide) lanes_rows_wide(xt, k, rows, (const char *)wide, bias, yt, n, 16 * b0, next + 64 * (int64_t)from,
                                      to - from);
            else
#endif
            if (WB) lanes_rows_bf16(xt, k, rows, wg, V, bias, yt, n, 16 * b0, next + 64 * (int64_t)from, to - from, 0,
                                    k / 2, NULL, 1);
            else
#endif
                lanes_rows_f32(xt, k, rows, wg, V, bias, yt, n, 16 * b0, next + 64 * (int64_t)from, to - from, 0, k,
                               NULL, 1);
            done += rows;
        }
    }
#ifdef LANES_WIDEN_X
    free(wide);
#endif
    }
#ifdef LANES_WIDEN_X
    free(xw);
#endif
    return 0;
}

int splitserve_lanes_gemm(const float *x, const float *wl, const float *bias, float *y, int m, int n, int k,
                          int threads) {
    return lanes_gemm(x, wl, bias, y, m, n, k, threads, 0);
}

/* the same for bfloat16 (the pair GEMM: AVX-512 BF16, or AVX2 widening the pairs) */
int splitserve_pair_gemm_bf16(const uint16_t *x, const uint16_t *wl, const uint16_t *bias, uint16_t *y, int m,
                              int n, int k, int threads) {
    return LANES_BF16 ? lanes_gemm(x, wl, bias, y, m, n, k, threads, 1) : -1;
}

/* the most rows each takes (0: none on this CPU) */
int splitserve_lanes_rows_max(void) { return MAX_ROWS; }
int splitserve_pair_rows_max(void) { return LANES_BF16 ? MAX_ROWS : 0; }
#else
int splitserve_lanes_gemm(const float *x, const float *wl, const float *bias, float *y, int m, int n, int k,
                          int threads) {
    (void)x, (void)wl, (void)bias, (void)y, (void)m, (void)n, (void)k, (void)threads;
    return -1;
}

int splitserve_pair_gemm_bf16(const uint16_t *x, const uint16_t *wl, const uint16_t *bias, uint16_t *y, int m,
                              int n, int k, int threads) {
    (void)x, (void)wl, (void)bias, (void)y, (void)m, (void)n, (void)k, (void)threads;
    return -1;
}

int splitserve_lanes_rows_max(void) { return 0; }
int splitserve_pair_rows_max(void) { return 0; }
#endif

#endif /* SPLITSERVE_LANES_GEMM_H */
