/* Paged prefill (extend) attention for CPUs: every query row of a chunk attends causally over its sequence's
 * pages, the cached prefix and the chunk itself (written into the pool before this call), read in place: no
 * gather copy of the prefix, no mask tensor. Flash-attention style: a task is one sequence, one kv head and
 * BQ query positions (with the query heads that share the kv head); it walks the keys up to its last position
 * BK at a time, keeping scores, running max and denominators, and the output rows in float32 (online softmax).
 *
 * Per key block: K is converted to float32 and transposed (VK x VK lanes at a time by shuffles) into [D][BK], so
 * a query row's BK scores are D broadcast-FMAs into two vectors (no horizontal sums), RB query rows sharing each
 * K load, two FMA chains per row; the weights then multiply the block's V rows (converted once) into the output rows,
 * RB rows x PVW vectors at a time. Written with GCC vector extensions in the target's width (vec16.h's vk): a
 * block is two vectors of keys, with AVX-512 32 keys and RB 8 rows; otherwise 16 keys and 4 rows, for 16
 * registers of 8 floats (on 16-float vectors GCC kept every value in memory there: an AVX2-only Zen
 * 1 host ran 4 x 512 tokens of SmolLM2's heads in 229 ms a layer, 5 GFLOP/s, and 37 ms on 8 floats, SDPA 52; RB
 * 2, 6 or 8 and PVW 3 or 4 level within 10%). Two vectors of 8 keys there, not one: each broadcast of q serves
 * two FMAs (AVX2 has no broadcast operand), and a block's softmax bookkeeping (the max, the correction, the
 * output's rescaling and reload) is paid once per 16 keys; same host, 4 x 512 tokens, variants alternating (ad
 * hoc): 36.7 -> 29.9 ms a layer (33 -> 40.5 GFLOP/s) in float32, 35.6 -> 30.0 in bfloat16; 32 keys with 2 rows
 * and 4 output vectors 1.03x more, each weight broadcast once per row group 0.85x; a SmolLM2 prefill
 * (bench_decode_ab --prefill-attention-base) of one 2,048-token prompt 11.62 -> 10.56 s in float32 (1.10x), 12.09
 * -> 11.20 in bfloat16, of 4 x 512 tokens 8.00 -> 7.80 s. Tasks are taken dynamically, the longest (latest
 * positions) first, since causal tasks differ in length.
 *
 * Why: torch's CPU flash attention (SDPA) took 45% of a bfloat16 SmolLM2 prefill step (8 x 512 tokens: 949 ms
 * of 2.1 s, 30 layers; 3.6-4.7 ms per sequence and layer for 9 heads x 512 x 64, ~80 GFLOP/s). Tuned on that
 * shape (AMD EPYC, 2 cores, variants alternating in one process): one FMA chain per row and 4 rows per load
 * 21 ms a layer, 8 rows 1.11-1.25x, a second chain 1.05-1.11x, the shuffle transpose (it was scalar stores)
 * 1.03x, 2 output vectors per row instead of 4 (32 registers spilled) 1.07x: 12.4 ms, ~190 GFLOP/s; 32
 * positions per task against 64: 0.95x, kept for shorter prompts' balance. docs/benchmarks.md has the step.
 * bfloat16 q and cache with D % 32 == 0 on a CPU with AVX-512 BF16 take task_bf16 (below): bfloat16 pair dot
 * products, half the instructions of the float32 FMAs; on that shape 9.6 against 11.5 ms a layer (1.17-1.21x, two
 * alternating runs), worst difference to SDPA over the tests' cases 0.0118 (was 0.0078; bound 0.02).
 * Then the softmax's per-block reductions (`python -m benchmarks.bench_prefill_kernel --base REV`, 4 x 512 tokens):
 * the running max by a shuffle tree (it was 15 scalar compares), its correction factor's exp only when the max
 * moved, and the denominators kept lanewise (one sum at the end, not one per block): float32 5.95 -> 4.99 ms a
 * layer (203 -> 243 GFLOP/s), bfloat16 4.81 -> 3.93 (252 -> 308).
 * On a Zen 4 host (AVX-512 on 256-bit units: half those rates, bfloat16 7.5 ms a layer, 160 GFLOP/s) `perf`
 * put a third of task_bf16 in the softmax, latency-bound: one row's exp polynomial, max tree and rescaling
 * branch after another, and an integer division (r / G) per row and block. With AVX-512 a block is now 32 keys
 * (each q broadcast serves two products, the bookkeeping and the output's reload per 32 keys, two exp chains per
 * row), exp applies 2^n by VSCALEFPS, lanes past a row's last key are mask registers, r / G is divided once per
 * task, and the running max moves only when a block passes it by more than LAZY_MAX (so rescaling, and its
 * unpredictable branch, become rare): bfloat16 7.46 -> 4.82 ms a layer (162 -> 251 GFLOP/s, 1.55x), float32
 * 9.62 -> 8.10 (1.19x); AVX2 code from the same source (-march=x86-64-v3 on that host) 1.04x, bit-identical.
 * With AVX-512 a row's block then asks only whether any of its scores passes the running max by LAZY_MAX (two
 * masked compares) and reduces the block's max only when one does, instead of reducing it every block: the same
 * bits, bfloat16 1.02-1.04x (4 x 512 tokens, four runs; one 2,048-token prompt 1.03x), float32 0.99-1.02x.
 *
 * Layout: q/out rows [T, heads, D] (heads and D contiguous, rows `q_stride`/`out_stride` elements apart, so q
 * may be a view of the fused projection); k_cache/v_cache [slots, kv_heads, D]; per sequence: its first row in
 * q (q_starts), query rows (q_lens), keys attended by its last row (kv_lens; the prefix is kv_len - q_len) and
 * its pages (page_table [nseq, max_pages]). dtype (q, out) and kv_dtype: 0 = float32, 1 = bfloat16, 2 = float16.
 * Returns 0, -1 for shapes it does not take, -2 out of memory. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

#define BQ 32 /* query positions per task */
#define BK (2 * VK) /* keys per block: two vectors of scores per row */
#define NB 2 /* score vectors per row and block */
#define PVW 2 /* output vectors per row held in registers while the weights multiply V */
#ifdef __AVX512F__
#define RB 8 /* query rows sharing each load */
#else
#define RB 4 /* 16 registers: 2 x RB score chains, two K vectors and the broadcasts */
#endif
#define MAX_DIM 256
#define MAX_GROUP 16

typedef _Float16 hkf __attribute__((vector_size(VK * 2)));

/* VK elements from base[idx] as float32 */
static inline vk loadk_any(const void *base, int64_t idx, int dtype) {
    if (dtype == 0) return loadk((const float *)base + idx);
    if (dtype == 1) return loadk_bf16((const uint16_t *)base + idx);
    hkf hf;
    memcpy(&hf, (const uint16_t *)base + idx, sizeof hf);
    return __builtin_convertvector(hf, vk);
}

static inline void store_row(void *out, int64_t idx, const float *src, float inv, int D, int dtype) {
    for (int d = 0; d < D; d++) {
        const float v = src[d] * inv;
        if (dtype == 0) {
            ((float *)out)[idx + d] = v;
        } else if (dtype == 1) {
            ((uint16_t *)out)[idx + d] = f32_to_bf16(v);
        } else {
            ((_Float16 *)out)[idx + d] = (_Float16)v;
        }
    }
}

typedef struct {
    const void *q, *k_cache, *v_cache;
    void *out;
    const int64_t *q_starts, *q_lens, *kv_lens, *page_table;
    int num_heads, group, page_size, max_pages, dtype, kv_dtype;
    int64_t q_stride, out_stride, kv_stride; /* elements between query rows, output rows, pool slots */
    float scale;
} Args;

/* r[i][l] <- r[l][i] for N x N lanes: rounds of swapping the off-diagonal halves of 2x2 blocks of N/2, ..., 1
 * lanes */
#define SWAP_ROUND(N, V, VI, B, LO, HI) \
    for (int i = 0; i < N; i++) \
        if (!(i & B)) { \
            const V a = r[i], b = r[i + B]; \
            r[i] = __builtin_shuffle(a, b, (VI)LO); \
            r[i + B] = __builtin_shuffle(a, b, (VI)HI); \
        }
static inline void transpose16(v16 *r) {
    SWAP_ROUND(16, v16, v16i, 8, ((v16i){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}),
               ((v16i){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}))
    SWAP_ROUND(16, v16, v16i, 4, ((v16i){0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}),
               ((v16i){4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}))
    SWAP_ROUND(16, v16, v16i, 2, ((v16i){0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}),
               ((v16i){2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}))
    SWAP_ROUND(16, v16, v16i, 1, ((v16i){0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}),
               ((v16i){1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}))
}
#ifdef __AVX512F__
#define transposek transpose16
#else
static inline void transposek(vk *r) {
    SWAP_ROUND(8, vk, vki, 4, ((vki){0, 1, 2, 3, 8, 9, 10, 11}), ((vki){4, 5, 6, 7, 12, 13, 14, 15}))
    SWAP_ROUND(8, vk, vki, 2, ((vki){0, 1, 8, 9, 4, 5, 12, 13}), ((vki){2, 3, 10, 11, 6, 7, 14, 15}))
    SWAP_ROUND(8, vk, vki, 1, ((vki){0, 8, 2, 10, 4, 12, 6, 14}), ((vki){1, 9, 3, 11, 5, 13, 7, 15}))
}
#endif
#undef SWAP_ROUND

#ifdef __AVX512F__
/* any sign of x: the running max below may trail a row's scores by up to LAZY_MAX */
static inline vk exp_softmax(vk v) { return (vk)exp16_scalef((__m512)v); }
/* The running max moves only when a block's max passes it by more than this (weights up to e^8 ~ 3,000, well
 * inside float32), so after a row's first blocks its rescaling and that branch are rare. */
#define LAZY_MAX 8.f
#else
#define exp_softmax expk /* for x <= 0 only: the running max is exact */
#define LAZY_MAX 0.f
#endif

/* One row's online-softmax step over a block of NB vectors of scores, replaced by the weights (zero from key
 * `lim` on) against the running max; the denominator updated, the row's output so far rescaled when the max
 * moved. (softmax_rows does the same for RB rows at once with AVX-512.) */
static inline __attribute__((always_inline)) void softmax_block(vk *score, int64_t lim, float *mx, float *den,
                                                               float *orow, int D) {
    vki lane;
    for (int i = 0; i < VK; i++) lane[i] = i;
    vk top = pickk(lane < (int32_t)lim, score[0], (vk){0} - 1e30f);
    for (int c = 1; c < NB; c++) {
        const vk s = pickk(lane + VK * c < (int32_t)lim, score[c], (vk){0} - 1e30f);
        top = pickk(s > top, s, top);
    }
    const float m_old = *mx, m = hmaxk(top);
    const float m_new = m > m_old + LAZY_MAX ? m : m_old;
    for (int c = 0; c < NB; c++)
        score[c] = pickk(lane + VK * c < (int32_t)lim, exp_softmax(score[c] - m_new), (vk){0});
    vk d = score[0]; /* lanewise: summed once, at the end */
    for (int c = 1; c < NB; c++) d += score[c];
    *mx = m_new;
    if (m_new > m_old) {
        const float f = exp_softmax((vk){0} + (m_old - m_new))[0];
        storek(den, loadk(den) * f + d);
        for (int jj = 0; jj < D / VK; jj++) storek(orow + VK * jj, loadk(orow + VK * jj) * f);
    } else {
        storek(den, loadk(den) + d);
    }
}

#ifdef __AVX512F__
/* softmax_block for RB rows at once with AVX-512, their scores replaced by their weights (zero past each row's
 * `lim` keys; all zero, state untouched, where it is 0), step by step across the rows (their maxima, then every
 * exp, then the running sums), so the rows' chains interleave (row after row, each exp waited on its max tree and
 * scalar compare: 1.03-1.06x in bfloat16), with the lanes past `lim` in mask registers (the vector-extension
 * form spent 20% more of a bfloat16 prefill's attention on the same steps). The AVX2 build keeps softmax_block
 * row by row (through this, 0.94x there). */
static inline __attribute__((always_inline)) void softmax_rows(vk sc[RB][NB], const int64_t *lim, float *mx,
                                                              float *den, float *o, int D) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __mmask16 seen[RB][NB];
    float m_new[RB];
    for (int j = 0; j < RB; j++) {
        const __m512 bar = _mm512_set1_ps(mx[j] + LAZY_MAX);
        __mmask16 above = 0;
        for (int c = 0; c < NB; c++) {
            seen[j][c] = _mm512_cmplt_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(VK * c)),
                                                 _mm512_set1_epi32((int)lim[j]));
            above |= _mm512_mask_cmp_ps_mask(seen[j][c], (__m512)sc[j][c], bar, _CMP_GT_OQ);
        }
        m_new[j] = mx[j];
        if (above) { /* the block passes the running max by more than LAZY_MAX (a row's first block, then rare) */
            __m512 top = _mm512_set1_ps(-1e30f);
            for (int c = 0; c < NB; c++) top = _mm512_mask_max_ps(top, seen[j][c], top, (__m512)sc[j][c]);
            m_new[j] = _mm512_reduce_max_ps(top);
        }
    }
    for (int j = 0; j < RB; j++)
        for (int c = 0; c < NB; c++)
            sc[j][c] = (vk)_mm512_maskz_mov_ps(seen[j][c], (__m512)exp_softmax(sc[j][c] - m_new[j]));
    for (int j = 0; j < RB; j++) {
        const vk d = sc[j][0] + sc[j][1];
        if (m_new[j] > mx[j]) {
            const float f = exp_softmax((vk){0} + (mx[j] - m_new[j]))[0];
            storek(den + VK * j, loadk(den + VK * j) * f + d);
            for (int jj = 0; jj < D / VK; jj++)
                storek(o + (int64_t)j * D + VK * jj, loadk(o + (int64_t)j * D + VK * jj) * f);
            mx[j] = m_new[j];
        } else {
            storek(den + VK * j, loadk(den + VK * j) + d);
        }
    }
}
#endif

/* Scratch floats per thread: query rows and output rows (padded to RB rows), K transposed, V, max, denominator
 * (VK lanes per row) */
static size_t scratch_floats(int group, int D) {
    const size_t rows = ((size_t)BQ * group + RB - 1) / RB * RB;
    return 2 * rows * D + 2 * (size_t)BK * D + (VK + 1) * rows;
}

/* One task: sequence s, kv head h, query positions [i0, i0 + BQ) of the chunk. */
static inline __attribute__((always_inline)) void task(const Args *A, float *scr, int64_t s, int h, int64_t i0,
                                                       const int D) {
    const int G = A->group, ps = A->page_size, DV = D / VK;
    const int64_t q_len = A->q_lens[s], prefix = A->kv_lens[s] - q_len, first = A->q_starts[s];
    const int ni = (int)(q_len - i0 < BQ ? q_len - i0 : BQ), rows = ni * G, padded = (rows + RB - 1) / RB * RB;
    float *qs = scr, *o = qs + (int64_t)padded * D, *kt = o + (int64_t)padded * D, *vb = kt + BK * D;
    float *mx = vb + BK * D, *den = mx + padded;
    const int64_t *pages = A->page_table + s * A->max_pages;
    /* row r = i * G + g: position i0 + i, query head h * G + g */
    int32_t at[BQ * MAX_GROUP]; /* i = r / G, divided once */
    for (int r = 0; r < padded; r++) {
        float *qr = qs + (int64_t)r * D;
        at[r] = r / G;
        if (r < rows) {
            const int64_t idx = (first + i0 + r / G) * A->q_stride + ((int64_t)h * G + r % G) * D;
            for (int j = 0; j < DV; j++) storek(qr + VK * j, loadk_any(A->q, idx + VK * j, A->dtype) * A->scale);
        } else {
            memset(qr, 0, (size_t)D * sizeof(float));
        }
        memset(o + (int64_t)r * D, 0, (size_t)D * sizeof(float));
        mx[r] = -1e30f;
        storek(den + VK * r, (vk){0});
    }
    const int64_t end = prefix + i0 + ni; /* keys seen by the last position */
    for (int64_t kb = 0; kb < end; kb += BK) {
        const int nk = (int)(end - kb < BK ? end - kb : BK);
        vk kr[BK][MAX_DIM / VK]; /* the block's K rows, then transposed VK dims at a time into kt */
        for (int t = 0; t < BK; t++) {
            if (t >= nk) {
                for (int j = 0; j < DV; j++) kr[t][j] = (vk){0};
                continue;
            }
            const int64_t key = kb + t, slot = pages[key / ps] * ps + key % ps;
            const int64_t idx = slot * A->kv_stride + (int64_t)h * D;
            for (int j = 0; j < DV; j++) {
                kr[t][j] = loadk_any(A->k_cache, idx + VK * j, A->kv_dtype);
                storek(vb + t * D + VK * j, loadk_any(A->v_cache, idx + VK * j, A->kv_dtype));
            }
        }
        for (int j = 0; j < DV; j++)
            for (int c = 0; c < NB; c++) {
                vk r[VK];
                for (int t = 0; t < VK; t++) r[t] = kr[VK * c + t][j];
                transposek(r);
                for (int i = 0; i < VK; i++) storek(kt + (VK * j + i) * BK + VK * c, r[i]);
            }
        /* rows before the block's first key's position see none of it (row order is position order) */
        const int64_t unseen = kb - prefix - i0 > 0 ? (kb - prefix - i0) * G : 0;
        for (int r0 = (int)(unseen / RB * RB); r0 < rows; r0 += RB) {
            /* a row's two vectors of scores are two FMA chains, and each broadcast of q serves both */
            vk sc[RB][NB];
            for (int j = 0; j < RB; j++) sc[j][0] = sc[j][1] = (vk){0};
            for (int d = 0; d < D; d++) {
                const vk k = loadk(kt + d * BK), k2 = loadk(kt + d * BK + VK);
                for (int j = 0; j < RB; j++) {
                    const float qd = qs[(int64_t)(r0 + j) * D + d];
                    sc[j][0] += qd * k;
                    sc[j][1] += qd * k2;
                }
            }
            int64_t lim[RB]; /* keys each row sees */
            for (int j = 0; j < RB; j++) {
                const int64_t pos = prefix + i0 + at[r0 + j];
                lim[j] = r0 + j < rows ? (pos - kb + 1 < nk ? pos - kb + 1 : nk) : 0;
            }
            float w[RB][BK];
#ifdef __AVX512F__
            softmax_rows(sc, lim, mx + r0, den + VK * r0, o + (int64_t)r0 * D, D);
            for (int j = 0; j < RB; j++)
                for (int c = 0; c < NB; c++) storek(w[j] + VK * c, sc[j][c]);
#else
            for (int j = 0; j < RB; j++) {
                const int r = r0 + j;
                if (lim[j] <= 0) {
                    memset(w[j], 0, sizeof w[j]);
                    continue;
                }
                softmax_block(sc[j], lim[j], mx + r, den + VK * r, o + (int64_t)r * D, D);
                for (int c = 0; c < NB; c++) storek(w[j] + VK * c, sc[j][c]);
            }
#endif
            for (int d0 = 0; d0 < D; d0 += VK * PVW) { /* RB rows x PVW vectors of output in registers */
                vk acc[RB][PVW];
                const int nv = (D - d0) / VK < PVW ? (D - d0) / VK : PVW;
                for (int j = 0; j < RB; j++)
                    for (int c = 0; c < nv; c++) acc[j][c] = loadk(o + (int64_t)(r0 + j) * D + d0 + VK * c);
                for (int t = 0; t < nk; t++) {
                    vk v[PVW];
                    for (int c = 0; c < nv; c++) v[c] = loadk(vb + t * D + d0 + VK * c);
                    for (int j = 0; j < RB; j++)
                        for (int c = 0; c < nv; c++) acc[j][c] += w[j][t] * v[c];
                }
                for (int j = 0; j < RB; j++)
                    for (int c = 0; c < nv; c++) storek(o + (int64_t)(r0 + j) * D + d0 + VK * c, acc[j][c]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        const int64_t idx = (first + i0 + r / G) * A->out_stride + ((int64_t)h * G + r % G) * D;
        const float sum = hsumk(loadk(den + VK * r));
        store_row(A->out, idx, o + (int64_t)r * D, sum > 0.f ? 1.f / sum : 0.f, D, A->dtype);
    }
}

static void task_64(const Args *A, float *w, int64_t s, int h, int64_t i0) { task(A, w, s, h, i0, 64); }
static void task_128(const Args *A, float *w, int64_t s, int h, int64_t i0) { task(A, w, s, h, i0, 128); }
static void task_any(const Args *A, float *w, int64_t s, int h, int64_t i0, int D) { task(A, w, s, h, i0, D); }

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_BF16_TASK 1
typedef uint16_t h32u __attribute__((vector_size(64)));

/* The task for bfloat16 q and cache with D % 32 == 0, on AVX-512 BF16: the same walk, but scores and weighted
 * sums are bfloat16 dot products of pairs (VDPBF16PS, two products per float32 lane), so half the instructions.
 * q * scale is rounded to bfloat16 (exact for a power-of-two scale) and each block's softmax weights are rounded
 * to bfloat16 before they multiply V, as torch's CPU flash attention does for bfloat16; the maxima, denominators
 * and output rows stay float32. K pairs (dims 2j, 2j+1 of one key) are transposed 16 keys x 16 pairs at a time;
 * V rows are interleaved two keys at a time. */
static inline __attribute__((always_inline)) void task_bf16(const Args *A, float *scr, int64_t s, int h,
                                                            int64_t i0, const int D) {
    const int G = A->group, ps = A->page_size, DW = D / 2;
    const int64_t q_len = A->q_lens[s], prefix = A->kv_lens[s] - q_len, first = A->q_starts[s];
    const int ni = (int)(q_len - i0 < BQ ? q_len - i0 : BQ), rows = ni * G, padded = (rows + RB - 1) / RB * RB;
    uint32_t *qp = (uint32_t *)scr;                        /* [padded][DW] pairs of q * scale */
    float *o = scr + (int64_t)padded * DW;                 /* [padded][D] */
    uint32_t *ktp = (uint32_t *)(o + (int64_t)padded * D); /* [DW][BK] K pairs, transposed */
    uint32_t *vp = ktp + DW * BK;                          /* [BK / 2][D] V pairs of two keys */
    float *mx = (float *)(vp + BK / 2 * D), *den = mx + padded;
    const int64_t *pages = A->page_table + s * A->max_pages;
    const uint16_t *kc = A->k_cache, *vc = A->v_cache;
    int32_t at[BQ * MAX_GROUP]; /* r / G, divided once */
    for (int r = 0; r < padded; r++) {
        uint16_t *qr = (uint16_t *)(qp + (int64_t)r * DW);
        at[r] = r / G;
        if (r < rows) {
            const uint16_t *src = (const uint16_t *)A->q + (first + i0 + r / G) * A->q_stride +
                                  ((int64_t)h * G + r % G) * D;
            for (int d = 0; d < D; d++) qr[d] = f32_to_bf16(bf16_to_f32(src[d]) * A->scale);
        } else {
            memset(qr, 0, (size_t)D * sizeof(uint16_t));
        }
        memset(o + (int64_t)r * D, 0, (size_t)D * sizeof(float));
        mx[r] = -1e30f;
        storek(den + VK * r, (vk){0});
    }
    const int64_t end = prefix + i0 + ni;
    for (int64_t kb = 0; kb < end; kb += BK) {
        const int nk = (int)(end - kb < BK ? end - kb : BK);
        v16 kr[BK][MAX_DIM / 32]; /* the block's K rows as pairs, 16 pairs a vector */
        const uint16_t *vrow[BK];
        static const uint16_t zeros[MAX_DIM];
        for (int t = 0; t < BK; t++) {
            if (t >= nk) {
                for (int j = 0; j < DW / 16; j++) kr[t][j] = (v16){0};
                vrow[t] = zeros;
                continue;
            }
            const int64_t key = kb + t, slot = pages[key / ps] * ps + key % ps;
            const int64_t idx = slot * A->kv_stride + (int64_t)h * D;
            for (int j = 0; j < DW / 16; j++) memcpy(&kr[t][j], kc + idx + 32 * j, 64);
            vrow[t] = vc + idx;
        }
        for (int half = 0; half < BK / 16; half++)
            for (int j = 0; j < DW / 16; j++) {
                v16 r[16];
                for (int t = 0; t < 16; t++) r[t] = kr[16 * half + t][j];
                transpose16(r);
                for (int i = 0; i < 16; i++) memcpy(ktp + (16 * j + i) * BK + 16 * half, &r[i], 64);
            }
        for (int tp = 0; tp < BK / 2; tp++)
            for (int d0 = 0; d0 < D; d0 += 32) {
                h32u a, b;
                memcpy(&a, vrow[2 * tp] + d0, 64);
                memcpy(&b, vrow[2 * tp + 1] + d0, 64);
                const h32u lo = __builtin_shuffle(a, b, (h32u){0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                               8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46,
                                                               15, 47});
                const h32u hi = __builtin_shuffle(a, b, (h32u){16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22,
                                                               54, 23, 55, 24, 56, 25, 57, 26, 58, 27, 59, 28, 60,
                                                               29, 61, 30, 62, 31, 63});
                memcpy(vp + tp * D + d0, &lo, 64);
                memcpy(vp + tp * D + d0 + 16, &hi, 64);
            }
        const int64_t unseen = kb - prefix - i0 > 0 ? (kb - prefix - i0) * G : 0;
        for (int r0 = (int)(unseen / RB * RB); r0 < rows; r0 += RB) {
            __m512 sc[RB][2]; /* keys 0-15 and 16-31 of the block: each broadcast of a q pair serves both */
            for (int j = 0; j < RB; j++) sc[j][0] = sc[j][1] = _mm512_setzero_ps();
            for (int d = 0; d < DW; d++) {
                const __m512bh k = (__m512bh)_mm512_loadu_si512(ktp + d * BK);
                const __m512bh k2 = (__m512bh)_mm512_loadu_si512(ktp + d * BK + 16);
                for (int j = 0; j < RB; j++) {
                    const __m512bh q = (__m512bh)_mm512_set1_epi32((int)qp[(int64_t)(r0 + j) * DW + d]);
                    sc[j][0] = _mm512_dpbf16_ps(sc[j][0], q, k);
                    sc[j][1] = _mm512_dpbf16_ps(sc[j][1], q, k2);
                }
            }
            int64_t lim[RB];
            vk p[RB][NB];
            for (int j = 0; j < RB; j++) {
                const int64_t pos = prefix + i0 + at[r0 + j];
                lim[j] = r0 + j < rows ? (pos - kb + 1 < nk ? pos - kb + 1 : nk) : 0;
                p[j][0] = (vk)sc[j][0];
                p[j][1] = (vk)sc[j][1];
            }
            softmax_rows(p, lim, mx + r0, den + VK * r0, o + (int64_t)r0 * D, D);
            uint32_t wp[RB][BK / 2];
            for (int j = 0; j < RB; j++) {
                const __m512bh pb = _mm512_cvtne2ps_pbh((__m512)p[j][1], (__m512)p[j][0]);
                memcpy(wp[j], &pb, sizeof wp[j]);
            }
            const int npairs = (nk + 1) / 2;
            for (int d0 = 0; d0 < D; d0 += 16 * PVW) {
                __m512 acc[RB][PVW];
                for (int j = 0; j < RB; j++)
                    for (int c = 0; c < PVW; c++) acc[j][c] = _mm512_loadu_ps(o + (int64_t)(r0 + j) * D + d0 + 16 * c);
                for (int tp = 0; tp < npairs; tp++) {
                    __m512bh v[PVW];
                    for (int c = 0; c < PVW; c++) v[c] = (__m512bh)_mm512_loadu_si512(vp + tp * D + d0 + 16 * c);
                    for (int j = 0; j < RB; j++) {
                        const __m512bh w = (__m512bh)_mm512_set1_epi32((int)wp[j][tp]);
                        for (int c = 0; c < PVW; c++) acc[j][c] = _mm512_dpbf16_ps(acc[j][c], w, v[c]);
                    }
                }
                for (int j = 0; j < RB; j++)
                    for (int c = 0; c < PVW; c++) _mm512_storeu_ps(o + (int64_t)(r0 + j) * D + d0 + 16 * c, acc[j][c]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        const int64_t idx = (first + i0 + r / G) * A->out_stride + ((int64_t)h * G + r % G) * D;
        const float sum = hsumk(loadk(den + VK * r));
        store_row(A->out, idx, o + (int64_t)r * D, sum > 0.f ? 1.f / sum : 0.f, D, A->dtype);
    }
}

static void task_bf16_64(const Args *A, float *w, int64_t s, int h, int64_t i0) { task_bf16(A, w, s, h, i0, 64); }
static void task_bf16_any(const Args *A, float *w, int64_t s, int h, int64_t i0, int D) {
    task_bf16(A, w, s, h, i0, D);
}
#endif

/* 1 when the kernel takes these shapes (callers use another path otherwise), else 0 */
int splitserve_prefill_supported(int head_dim, int num_heads, int num_kv_heads, int page_size) {
    return head_dim >= 16 && head_dim <= MAX_DIM && head_dim % 16 == 0 && num_kv_heads >= 1 &&
           num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= MAX_GROUP && page_size >= 1;
}

int splitserve_prefill_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                                 const int64_t *q_starts, const int64_t *q_lens, const int64_t *kv_lens,
                                 const int64_t *page_table, int num_seqs, int max_pages, int num_heads,
                                 int num_kv_heads, int head_dim, int page_size, int64_t q_stride,
                                 int64_t out_stride, float scale,
                                 int dtype, int kv_dtype, int num_threads) {
    if (!splitserve_prefill_supported(head_dim, num_heads, num_kv_heads, page_size) || dtype < 0 || dtype > 2 ||
        kv_dtype < 0 || kv_dtype > 2 || num_seqs < 0)
        return -1;
    for (int s = 0; s < num_seqs; s++)
        if (q_lens[s] < 1 || kv_lens[s] < q_lens[s] || (kv_lens[s] + page_size - 1) / page_size > max_pages)
            return -1;
    const Args A = {q, k_cache, v_cache, out, q_starts, q_lens, kv_lens, page_table, num_heads,
                    num_heads / num_kv_heads, page_size, max_pages, dtype, kv_dtype, q_stride, out_stride,
                    (int64_t)num_kv_heads * head_dim, scale};
    /* tasks: (block of positions, sequence, kv head), latest blocks (the most keys) first */
    int64_t max_blocks = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int64_t nb = (q_lens[s] + BQ - 1) / BQ;
        max_blocks = nb > max_blocks ? nb : max_blocks;
    }
    const int64_t slots = max_blocks * num_seqs * num_kv_heads;
    const size_t floats = scratch_floats(A.group, head_dim);
#ifdef HAVE_BF16_TASK
    const int bf16 = dtype == 1 && kv_dtype == 1 && head_dim % 32 == 0; /* task_bf16 */
#endif
    int failed = 0;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
        float *scratch = malloc(floats * sizeof(float));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < slots; i++) {
            const int64_t blk = max_blocks - 1 - i / ((int64_t)num_seqs * num_kv_heads);
            const int s = (int)(i / num_kv_heads % num_seqs), h = (int)(i % num_kv_heads);
            if (!scratch || blk * BQ >= q_lens[s]) continue;
#ifdef HAVE_BF16_TASK
            if (bf16 && head_dim == 64) task_bf16_64(&A, scratch, s, h, blk * BQ);
            else if (bf16) task_bf16_any(&A, scratch, s, h, blk * BQ, head_dim);
            else
#endif
            if (head_dim == 64) task_64(&A, scratch, s, h, blk * BQ);
            else if (head_dim == 128) task_128(&A, scratch, s, h, blk * BQ);
            else task_any(&A, scratch, s, h, blk * BQ, head_dim);
        }
        free(scratch);
    }
    return failed ? -2 : 0;
}
