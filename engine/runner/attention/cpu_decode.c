/* Paged decode attention for CPUs: one query token per sequence, K/V read straight from the pages of the
 * pool (no gather copy), online softmax in float32 a page at a time. A task is one sequence with all its kv
 * heads (a page's rows are read whole, once, and the pages ahead are prefetched since pages are scattered), or,
 * when the batch is too small to keep every thread busy, one sequence's share of its kv heads; without the
 * AVX-512 body, of one chunk of the sequence's keys (see splitserve_decode_attention). The query heads that share
 * a kv head are processed together. Parallel over tasks with OpenMP.
 *
 * The task body is specialized for the common head dims (64, 128) so the compiler unrolls the dot products
 * and keeps an accumulator row in vector registers; other dims take the generic body. cpu_kernels.py compiles
 * with -ffp-contract=fast and reassociation allowed, so the dot products use FMAs and tree reductions.
 *
 * With AVX-512 and head dims 64/128 with up to 8 query heads per kv head, a vectorized body takes over (see "AVX-512
 * body" below; with AVX2 alone, its scheme on 8-float vectors over bfloat16 caches: "AVX2 body"): 16 keys at a time,
 * K and V rows converted to float32 in registers (never through a buffer), the dot products of 16 keys summed with
 * one transpose-reduction, and the softmax of the 16 scores done as one vector. It asks for the K and V rows of the
 * page ahead one key row at a time, as it reads the current page's (``pf_row``), not a page's worth at once: a burst
 * of hundreds of prefetches at a page's start overflows the core's miss buffers and most of it is lost. Measured on
 * SmolLM2's shapes (batch 64 x 544 tokens, 30 layers, scattered pages, 2 cores of an AMD EPYC whose reads stream at
 * ~40 GB/s): float32 17 -> 22-27 GB/s (1.28x), bfloat16 13 -> 25-30 GB/s (1.9x); the burst's distance or cache hint
 * made no difference (0.97-1.02x), nor did huge pages under the pool.
 *
 * Whole rows (a task with every kv head of its sequence, pages a multiple of 16 keys): the reads that stream
 * best on that host are demand loads running along each row with K and V alternating (a harness reading the
 * same scattered pages with no arithmetic: 42-61 GB/s so, 31-43 GB/s in the head-by-head order fast_block
 * walks; software prefetches in the better order did not help, demand loads did). So such a task reads the
 * next 16-key block's rows that way, a few lines per step of the current block's compute (touch_step), and
 * prefetches the block after; fast_block then finds its rows in L1. SmolLM2 shapes, 30 layers of scattered
 * pages: batch 64 x 600 tokens 2.0 -> 1.6-1.7 ms a layer in float32 (1.19-1.23x), 0.95 -> 0.76 in bfloat16
 * (1.25x); batch 8 x 2000, page 32: 1.21-1.23x; batch 4: 1.07-1.21x. Without the prefetch of the block after,
 * 0.61-0.77x; reading a whole block before its compute, 1.15x in float32 and 0.91x in bfloat16; both walks in
 * one function, the bfloat16 case 8% slower (hence two bodies per shape). Tasks of some kv heads keep the walk
 * above (their rows are partial: the touch measured 0.83-0.91x in bfloat16 at batch 1-2).
 *
 * Layout: k_cache/v_cache [num_slots, kv_heads, head_dim]; slot = page * page_size + offset.
 * q/out [batch, heads, head_dim]; page_table [batch, max_pages] (int64); kv_lens [batch] (int64). A row may
 * also attend over slots of its own after its first kv_len positions (extra_slots [batch, max_extra], extra_lens
 * [batch], int64, or both NULL): a node of a speculative draft tree attends over its path, whose K/V sit at the
 * storage slots of its ancestors (engine/spec/tree.py), not at the positions before it. Those keys are taken as
 * positions kv_len onwards, in the pages and blocks such positions have (keys_of): the node's result is bit for bit
 * that of a row whose every key is in its pages (before 2026-12-07 they came one block each after the pages,
 * and bfloat16 outputs of tree speculation parted from plain decoding's where a near-tie flipped).
 * dtype (of q and out) and kv_dtype (of the caches): 0 = float32, 1 = bfloat16, 2 = float16; a float32 model
 * may keep a 16-bit cache. Returns 0, -1 for unsupported shapes, -2 out of memory. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

#define MAX_HEAD_DIM 256
#define MAX_PAGE 256
#define MAX_ROWS 128 /* query heads in one task */
#define CHUNK_KEYS 128 /* without the AVX-512 body, a row's keys per task, at least: see splitserve_decode_attention */
#define MAX_CHUNKS 4   /* and its tasks (chunks) at most */
#define PF_DIST 3 /* generic body: pages prefetched ahead (3 measured best: 1 was 13% slower in float32, 18% in bf16) */
#define PF_KEYS 16 /* AVX-512 body: keys (whole pages, at least one) between a row read and the row prefetched */
/* AVX-512 body: the locality of its prefetches of a block or page ahead, 1 (prefetcht2: into L2, not L1). With 3
 * (into L1, as before 2026-12-07) a float32 block's rows (24 KB for SmolLM2) asked for while the block before is
 * read into L1 and the current one is computed overflow a 32 KB L1. Zen 4, 2 threads, SmolLM2 shapes, this body
 * against the same kernel with 3, alternating (bench_decode_ab --kernel --kernel-shape smollm2 --kernel-base):
 * batch 64 x 576 tokens of scattered pages, 30 layers, ms a layer from DRAM, float32 2.65-2.71 -> 2.24-2.40,
 * bfloat16 1.39-1.47 -> 1.08-1.17 (a harness reading the same pages with no arithmetic: 26-27 GB/s with demand
 * loads, 30-33 with prefetcht2 a page ahead); batch 8 x 2,000 1.13 -> 0.93 and 0.59 -> 0.47. Decode steps
 * (--attention-base, pages contiguous as a fresh pool hands them out): float32 batch 64 154.4 -> 146.9 ms, batch
 * 16 44.2 -> 41.6, batch 1 14.1 -> 13.5; bfloat16 batch 1 8.4 -> 7.7 and 10.3 -> 9.7; bfloat16 batch 64 0.96-1.00x
 * in three runs (contiguous pages stream without it). */
#define PF_FAR 1

/* exp(x) for x <= 0 without a libm call, so the loops over a page vectorize: x*log2(e) = n + f with
 * |f| <= 0.5, 2^f from a degree-6 polynomial (relative error ~2e-7), 2^n put into the exponent bits. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float t = x * 1.44269504088896341f;
    const float n = __builtin_rintf(t);
    const float f = t - n;
    static const float c[] = EXP2_POLY;
    float p = c[0];
    for (int i = 1; i < 7; i++) p = p * f + c[i];
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
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
    const int64_t *extra_slots, *extra_lens; /* NULL, or per row: slots attended after its pages [batch, max_extra] */
    int num_heads, group, page_size, max_pages, max_extra, dtype, kv_dtype;
    int64_t stride; /* elements between consecutive slots */
    float scale;
    int64_t chunk;             /* keys a task takes at most (a whole number of pages), or 0: a whole row */
    const int64_t *chunk_base; /* per row: the index of its first chunk (with chunk) */
    float *partial;            /* per chunk and query head: max, denominator, D accumulators (merge_chunks) */
} Args;

/* A row's chunks of keys, from its length alone: with A->chunk, len / chunk rounded up, at most MAX_CHUNKS, at
 * least 1 (its draft path goes with its last) */
static inline int64_t chunks_of(int64_t chunk, int64_t len) {
    const int64_t n = chunk && len > chunk ? (len + chunk - 1) / chunk : 1;
    return n < MAX_CHUNKS ? n : MAX_CHUNKS;
}
static inline int64_t num_chunks(const Args *A, int64_t len) { return chunks_of(A->chunk, len); }

/* Row b's keys: its first kv_len positions through the page table, then its extra slots (a draft tree node's path,
 * one key each). The bodies walk them as one sequence of that length, in the same pages and blocks (by position)
 * as a row whose keys all sit in its pages, so a node's result is bit for bit that of the same keys reached
 * through the page table: an accepted draft's K, V and logits are those of plain decoding. */
static inline int64_t keys_of(const int64_t *kv_lens, const int64_t *extra_lens, int b) {
    return kv_lens[b] + (extra_lens ? extra_lens[b] : 0);
}

/* The first position of row b's keys from which pages are not read in place: the start of the page holding its
 * first extra slot (the extras share that page's blocks with the stored keys before them), or all of them */
static inline int64_t in_place_keys(const Args *A, int b) {
    const int64_t len = A->kv_lens[b];
    return A->extra_lens && A->extra_lens[b] ? len / A->page_size * A->page_size : len;
}

/* Element offsets (from element col0 of each slot) of row b's keys at positions [start, start + n): stored ones
 * through the page table, the others from its extra slots */
static inline void gather_rows(const Args *A, int b, int64_t start, int n, int64_t col0, int64_t *rows) {
    const int64_t len = A->kv_lens[b], *pages = A->page_table + (int64_t)b * A->max_pages;
    const int ps = A->page_size;
    for (int t = 0; t < n; t++) {
        const int64_t pos = start + t;
        const int64_t slot = pos < len ? pages[pos / ps] * ps + pos % ps
                                       : A->extra_slots[(int64_t)b * A->max_extra + pos - len];
        rows[t] = slot * A->stride + col0;
    }
}

/* Keys in each of a row's chunks but its last: whole pages, the row's keys spread evenly over num_chunks */
static inline int64_t chunk_keys(const Args *A, int64_t len) {
    const int64_t n = num_chunks(A, len), pages = (len + A->page_size - 1) / A->page_size;
    return (pages + n - 1) / n * A->page_size;
}

/* Pages are scattered, so ask for the K and V rows of the pages PF_DIST ahead of the one at `start` (all of
 * them up to PF_DIST when starting): `row_bytes` per slot from element `col0` of each slot. */
static inline void prefetch_ahead(const Args *A, const int64_t *pages, int64_t start, int64_t len, int64_t col0,
                                  int row_bytes) {
    const int page_size = A->page_size, elem = A->kv_dtype == 0 ? 4 : 2;
    for (int64_t ahead = start == 0 ? 1 : PF_DIST; ahead <= PF_DIST; ahead++) {
        const int64_t ps = start + ahead * page_size;
        if (ps >= len) break;
        const int64_t next = pages[ps / page_size] * page_size * A->stride + col0;
        const int m = (int)((len - ps) < page_size ? (len - ps) : page_size);
        prefetch_rows(A->k_cache, next, A->stride, m, row_bytes, elem);
        prefetch_rows(A->v_cache, next, A->stride, m, row_bytes, elem);
    }
}

/* The generic body: the page PF_DIST ahead is asked for in shares, one before each query row's K loop and one
 * before its V loop on the current page, along each row with K and V alternating, instead of all at once when the
 * page starts (a burst of hundreds of prefetches overflows the core's miss buffers; see the AVX-512 body's note).
 * On an AVX2-only Zen 1 host (2 threads), where every head dim takes this body: a harness reading 16 x 544 tokens
 * of scattered SmolLM2 pages with no arithmetic streamed 9-14 GB/s head by head as the body reads them, 18.5-19
 * GB/s with the next page asked for along its rows through that walk; the kernel (bench_decode_ab --kernel
 * --kernel-shape smollm2 --context 544 --batch 16 --kernel-base) 1.63 -> 1.14 and 2.24 -> 1.64 ms a layer from
 * memory; float32 SmolLM2 decode steps at 512 tokens of context (--attention-base, alternating): batch 16 122.7 ->
 * 108.2 ms, batch 64 454.9 -> 401.4 (1.13x each). With a bfloat16 cache (a page widened into a buffer before its
 * compute): the kernel 1.32-1.36 -> 1.15 and 1.71 -> 1.52 ms a layer, bfloat16 steps at batch 16 1.025-1.04x (three
 * runs), batch 64 521.7 -> 504.8 ms. A share before every key instead measured the same in float32 from memory, up
 * to 10% slower in cache, and 0.95-1.0x with a bfloat16 cache. */
typedef struct {
    const char *k, *v;
    int64_t stride; /* bytes between rows */
    int row_bytes, rows, per, r, c; /* per: lines asked for a step; (r, c): the next row and byte */
} Spread;

static inline void spread_step(Spread *P) {
    for (int i = 0; i < P->per && P->r < P->rows; i++) {
        const int64_t off = P->r * P->stride + P->c;
        __builtin_prefetch(P->k + off, 0, 3);
        __builtin_prefetch(P->v + off, 0, 3);
        P->c += 64;
        if (P->c >= P->row_bytes) P->c = 0, P->r++;
    }
}

/* out[o : o + n] = src * inv, in the output's dtype */
static inline void store_row(const Args *A, int64_t o, const float *src, float inv, int n) {
    for (int d = 0; d < n; d++) {
        const float v = src[d] * inv;
        if (A->dtype == 0) ((float *)A->out)[o + d] = v;
        else if (A->dtype == 1) ((uint16_t *)A->out)[o + d] = f32_to_bf16(v);
        else ((_Float16 *)A->out)[o + d] = (_Float16)v;
    }
}

/* A task's query rows [qrow, qrow + rows) of row b, chunk c, done: the output where the chunk is the row's only
 * one, else the chunk's running max, denominator and accumulators, for merge_chunks. */
static inline void finish_rows(const Args *A, int b, int64_t c, int64_t qrow, int rows, const float *acc,
                               const float *mx, const float *den, int D) {
    if (num_chunks(A, keys_of(A->kv_lens, A->extra_lens, b)) == 1) {
        for (int r = 0; r < rows; r++)
            store_row(A, (qrow + r) * D, acc + (int64_t)r * D, den[r] > 0.f ? 1.f / den[r] : 0.f, D);
        return;
    }
    const int64_t head0 = qrow - (int64_t)b * A->num_heads;
    for (int r = 0; r < rows; r++) {
        float *p = A->partial + ((A->chunk_base[b] + c) * A->num_heads + head0 + r) * (D + 2);
        p[0] = mx[r];
        p[1] = den[r];
        memcpy(p + 2, acc + (int64_t)r * D, (size_t)D * sizeof(float));
    }
}

/* Query head h of row b, whose keys came in several chunks: the chunks' accumulators and denominators, each
 * scaled by exp(its max - the largest), summed in chunk order (so a row's result depends on its length and the
 * chunk size only, not on its batch). */
static void merge_chunks(const Args *A, int b, int h, int D) {
    const int64_t nch = num_chunks(A, keys_of(A->kv_lens, A->extra_lens, b)), step = (int64_t)A->num_heads * (D + 2);
    const float *p0 = A->partial + (A->chunk_base[b] * A->num_heads + h) * (D + 2);
    float m = -INFINITY, den = 0.f, acc[MAX_HEAD_DIM];
    for (int64_t c = 0; c < nch; c++) m = p0[c * step] > m ? p0[c * step] : m;
    for (int d = 0; d < D; d++) acc[d] = 0.f;
    for (int64_t c = 0; c < nch; c++) {
        const float *p = p0 + c * step;
        const float w = p[0] == -INFINITY ? 0.f : exp_nonpositive(p[0] - m);
        den += p[1] * w;
        for (int d = 0; d < D; d++) acc[d] += p[2 + d] * w;
    }
    store_row(A, ((int64_t)b * A->num_heads + h) * D, acc, den > 0.f ? 1.f / den : 0.f, D);
}

/* One sequence's kv heads [kv0, kv1), each with its `group` query heads, against every page of the sequence.
 * A page's rows for these heads are loaded (and, for 16-bit caches, converted) once for all of them.
 * head_dim is a compile-time constant in the specialized copies, so the accumulator row stays in registers. */
static inline __attribute__((always_inline)) void attend(const Args *A, float *scratch, int b, int kv0,
                                                         int kv1, int64_t c, const int head_dim) {
    const int group = A->group, page_size = A->page_size, dtype = A->dtype, kv_dtype = A->kv_dtype;
    const int64_t stride = A->stride;
    const int elem = kv_dtype == 0 ? 4 : 2;
    const int nkv = kv1 - kv0, rows = nkv * group, width = nkv * head_dim; /* width: elements per slot used */
    float *qf = scratch, *acc = qf + rows * head_dim; /* scratch: see scratch_floats() */
    float *kbuf = acc + rows * head_dim, *vbuf = kbuf + page_size * width;
    float mx[MAX_ROWS], denom[MAX_ROWS];
    float s[MAX_PAGE];
    const int64_t qrow = (int64_t)b * A->num_heads + (int64_t)kv0 * group;
    rows_to_f32(A->q, qrow * head_dim, head_dim, rows, head_dim, dtype, qf);
    for (int i = 0; i < rows * head_dim; i++) { qf[i] *= A->scale; acc[i] = 0.f; }
    for (int r = 0; r < rows; r++) { mx[r] = -INFINITY; denom[r] = 0.f; }
    const int64_t len = A->kv_lens[b], keys = keys_of(A->kv_lens, A->extra_lens, b), in_place = in_place_keys(A, b);
    const int64_t *pages = A->page_table + (int64_t)b * A->max_pages;
    const int64_t num_pages = (keys + page_size - 1) / page_size; /* of its keys, extras included */
    /* this task's pages [it0, it1): its chunk's */
    const int64_t cp = A->chunk ? chunk_keys(A, keys) / page_size : num_pages, it0 = c * cp;
    const int64_t it1 = it0 + cp < num_pages ? it0 + cp : num_pages;
    for (int64_t it = it0; it < it1; it++) {
        const int64_t start = it * page_size;
        const int n = (int)((keys - start) < page_size ? (keys - start) : page_size);
        int64_t off = 0;
        Spread P = {0};
        if (start < in_place) { /* a page of the sequence, read in place */
            off = pages[start / page_size] * page_size * stride + (int64_t)kv0 * head_dim;
            const int64_t ps = start + (int64_t)PF_DIST * page_size; /* the page PF_DIST ahead */
            if (start == 0) /* a later chunk's first pages: the chunk before asked for them */
                prefetch_ahead(A, pages, start, len, (int64_t)kv0 * head_dim, width * elem);
            if (ps < len) { /* spread over this page's compute: see Spread */
                const int64_t at = (pages[ps / page_size] * page_size * stride + (int64_t)kv0 * head_dim) * elem;
                const int m = (int)((len - ps) < page_size ? (len - ps) : page_size), points = 2 * rows;
                P = (Spread){(const char *)A->k_cache + at, (const char *)A->v_cache + at, stride * elem, width * elem,
                             m, (m * ((width * elem + 63) / 64) + points - 1) / points, 0, 0};
            }
        }
        const float *kp, *vp;
        int64_t rs; /* row stride of kp/vp in floats */
        if (start >= in_place) { /* the page holding the row's extra slots: its keys gathered */
            int64_t at[MAX_PAGE];
            gather_rows(A, b, start, n, (int64_t)kv0 * head_dim, at);
            for (int t = 0; t < n; t++) {
                rows_to_f32(A->k_cache, at[t], 0, 1, width, kv_dtype, kbuf + (int64_t)t * width);
                rows_to_f32(A->v_cache, at[t], 0, 1, width, kv_dtype, vbuf + (int64_t)t * width);
            }
            kp = kbuf;
            vp = vbuf;
            rs = width;
        } else if (kv_dtype == 0) {
            kp = (const float *)A->k_cache + off;
            vp = (const float *)A->v_cache + off;
            rs = stride;
        } else {
            rows_to_f32(A->k_cache, off, stride, n, width, kv_dtype, kbuf);
            rows_to_f32(A->v_cache, off, stride, n, width, kv_dtype, vbuf);
            kp = kbuf;
            vp = vbuf;
            rs = width;
        }
        for (int r = 0; r < rows; r++) {
            const float *kr = kp + (r / group) * head_dim, *vr = vp + (r / group) * head_dim;
            const float *qg = qf + r * head_dim;
            float m = mx[r];
            spread_step(&P);
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
            spread_step(&P);
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
        while (P.r < P.rows) spread_step(&P);
    }
    finish_rows(A, b, c, qrow, rows, acc, mx, denom, head_dim);
}

/* A vectorized body's task state, in its scratch: the task's query rows (from query row `qrow`) scaled and
 * widened, zeroed accumulators (D floats each per query row), a `lanes`-wide denominator and a running max per
 * query row. */
typedef struct {
    float *qs, *accs, *dens, *mx;
} TaskState;

static inline TaskState task_state(const Args *A, float *scratch, int64_t qrow, int rows, int D, int lanes) {
    TaskState T = {scratch, scratch + (int64_t)rows * D, scratch + (int64_t)2 * rows * D, NULL};
    T.mx = T.dens + rows * lanes;
    rows_to_f32(A->q, qrow * D, D, rows, D, A->dtype, T.qs);
    for (int i = 0; i < rows * D; i++) { T.qs[i] *= A->scale; T.accs[i] = 0.f; }
    for (int i = 0; i < rows * lanes; i++) T.dens[i] = 0.f;
    for (int r = 0; r < rows; r++) T.mx[r] = -INFINITY;
    return T;
}

/* ---- AVX-512 body ------------------------------------------------------------------------------------------
 * A task's state (scaled queries, accumulators, running max and denominators of its kv heads' query rows) lives
 * in the per-thread scratch; for every page, the keys are taken 16 at a time, and for each kv head its G query
 * rows are handled together so each K and V row is loaded and converted once:
 *   scores: per key, G partial-product vectors (D/16 FMAs each), then one transpose-reduction turns the 16
 *           keys' vectors into a vector of 16 scores;
 *   softmax: max, exp and the denominator over that vector (online: earlier blocks are rescaled);
 *   values:  per key, its weight broadcast into G x D/16 FMAs over the V row.
 * Bfloat16 queries over a bfloat16 cache, where the CPU has AVX-512 BF16, take the pair path (HAVE_PAIR below). */
#if defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_FAST 1
#define CHUNKED 0 /* its whole-row walk (attend_fast) takes a row's pages in one task */
#define FAST_MAX_GROUP 8
/* The pair path: bfloat16 queries over a bfloat16 cache, where the CPU has AVX-512 BF16 (VDPBF16PS: a float32
 * lane plus the exact products of two bfloat16 pairs). Scores: a key's raw K row against the raw (unscaled) query
 * rows, D / 32 instructions a key and query row where widening K took D / 16 loads-and-shifts and D / 16 FMAs; the
 * 16 keys' scores scaled after the transposition. Values: two keys a step, their V rows interleaved into pairs
 * (VPUNPCKLWD / VPUNPCKHWD, so the accumulators hold D in that order until pair_order puts it back) against their
 * weights rounded to bfloat16 (as a flash-attention GPU kernel rounds P before its P x V product; the denominator
 * keeps the float32 weights). Max error against float32 attention over the same bfloat16 K/V unchanged (7.0e-3 to
 * 7.8e-3 either way, SmolLM2's and a 32 x 8 x 128 shape at 37-2,000 keys: the output's own rounding); other bits
 * than the widening path's, the same for a row whatever its batch, task or draft tree. */
/* one body: NAME_D_G, a walk (WHOLE rows or pages) of one score path (PAIR or widening) */
#define BODY_FN(NAME, D, G, WHOLE, PAIR) \
    static void NAME##_##D##_##G(const void *A, float *w, int b, int kv0, int kv1, int64_t c) { \
        (void)c; \
        attend_fast((const Args *)A, w, b, kv0, kv1, D, G, WHOLE, PAIR); \
    }
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_PAIR 1
#define PAIR_FNS(D, G) BODY_FN(fastp, D, G, 0, 1) BODY_FN(fastpw, D, G, 1, 1)
#else
#define HAVE_PAIR 0
#define PAIR_FNS(D, G)
#endif

static inline __m512 load16(const void *base, int64_t idx, int kv_dtype) {
    if (kv_dtype == 0) return _mm512_loadu_ps((const float *)base + idx);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + idx));
    if (kv_dtype == 1) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* Lane t of the result is the sum of the 16 lanes of v[t]: pairs summed inside 128-bit lanes, then quads,
 * then across the four 128-bit lanes (45 shuffles and adds for 16 keys instead of a reduction per key). */
static inline __m512 sum16x16(const __m512 *v) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
    const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
    const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

/* Whole-row tasks read a block's K and V rows as demand loads spread through the compute of the block before
 * (touch_step), K and V alternating line by line along each row, and prefetch the block after: the hardware
 * streams such reads well (see "Whole rows" at attend_fast). */
typedef struct {
    const char *k, *v, *pk, *pv; /* the next block's first K and V rows; the block after's (NULL: none) */
    int64_t stride;               /* bytes between rows */
    int row_bytes, rows, per, r, c; /* per: lines read a step; (r, c): the next row and byte */
} Touch;

static inline __attribute__((always_inline)) void touch_step(Touch *T) {
    for (int i = 0; i < T->per && T->r < T->rows; i++) {
        const int64_t off = T->r * T->stride + T->c;
        const __m512i a = _mm512_loadu_si512(T->k + off), b = _mm512_loadu_si512(T->v + off);
        __asm__ volatile("" : : "v"(a), "v"(b)); /* the loads are the point: keep them */
        if (T->pk) {
            __builtin_prefetch(T->pk + off, 0, PF_FAR);
            __builtin_prefetch(T->pv + off, 0, PF_FAR);
        }
        T->c += 64;
        if (T->c >= T->row_bytes) T->c = 0, T->r++;
    }
}

/* Keys [t0, t0 + n) of one page (n <= 16, row `row0` = the page's first slot, offset to the task's first kv
 * head) against the G query rows of each of the task's nkv kv heads. */
static inline __attribute__((always_inline)) void fast_block(const Args *A, float *qs, float *accs, float *dens,
                                                              float *mx, int64_t row0, const int64_t *at, int n,
                                                              int nkv, const int D, const int G, int64_t pf_row,
                                                              Touch *T, const uint16_t *qraw, const int PAIR) {
    const int DV = D / 16, kv_dtype = A->kv_dtype, elem = kv_dtype == 0 ? 4 : 2;
    const int64_t stride = A->stride;
    const __mmask16 valid = (__mmask16)((1u << n) - 1u);
    for (int h = 0; h < nkv; h++) {
        const int64_t hoff = row0 + (int64_t)h * D; /* key t's row: hoff + t * stride, or at[t] + h * D */
#define KEY_ROW(t) (at ? at[t] + (int64_t)h * D : hoff + (int64_t)(t) * stride)
        float *qh = qs + (int64_t)h * G * D, *ah = accs + (int64_t)h * G * D, *dh = dens + (int64_t)h * G * 16;
        float *mh = mx + h * G;
        __m512 q[FAST_MAX_GROUP][8], part[FAST_MAX_GROUP][16];
#if HAVE_PAIR
        __m512i qp[FAST_MAX_GROUP][4]; /* PAIR: the raw query rows, 32 bfloat16 a vector */
        if (PAIR)
            for (int g = 0; g < G; g++)
                for (int j = 0; j < D / 32; j++)
                    qp[g][j] = _mm512_loadu_si512(qraw + ((int64_t)h * G + g) * D + 32 * j);
        else
#endif
            for (int g = 0; g < G; g++)
                for (int j = 0; j < DV; j++) q[g][j] = _mm512_loadu_ps(qh + g * D + 16 * j);
        for (int t = 0; t < 16; t++) {
            if (t >= n) {
                for (int g = 0; g < G; g++) part[g][t] = _mm512_setzero_ps();
                continue;
            }
            if (T) touch_step(T);
            if (pf_row >= 0) { /* the same row of the page ahead, K and V */
                const int64_t at = (pf_row + (int64_t)h * D + t * stride) * elem;
                for (int c = 0; c < D * elem; c += 64) {
                    __builtin_prefetch((const char *)A->k_cache + at + c, 0, PF_FAR);
                    __builtin_prefetch((const char *)A->v_cache + at + c, 0, PF_FAR);
                }
            }
#if HAVE_PAIR
            if (PAIR) { /* bfloat16 pairs of q and K, their products summed in float32 lanes */
                __m512i kp[4];
                for (int j = 0; j < D / 32; j++)
                    kp[j] = _mm512_loadu_si512((const uint16_t *)A->k_cache + KEY_ROW(t) + 32 * j);
                for (int g = 0; g < G; g++) {
                    __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)qp[g][0], (__m512bh)kp[0]);
                    for (int j = 1; j < D / 32; j++) s = _mm512_dpbf16_ps(s, (__m512bh)qp[g][j], (__m512bh)kp[j]);
                    part[g][t] = s;
                }
                continue;
            }
#endif
            __m512 k[8];
            for (int j = 0; j < DV; j++) k[j] = load16(A->k_cache, KEY_ROW(t) + 16 * j, kv_dtype);
            for (int g = 0; g < G; g++) {
                __m512 s = _mm512_mul_ps(q[g][0], k[0]);
                for (int j = 1; j < DV; j++) s = _mm512_fmadd_ps(q[g][j], k[j], s);
                part[g][t] = s;
            }
        }
        float pw[FAST_MAX_GROUP][16];
        for (int g = 0; g < G; g++) {
            /* PAIR: the queries were not scaled, the scores are */
            const __m512 s = PAIR ? _mm512_mul_ps(sum16x16(part[g]), _mm512_set1_ps(A->scale)) : sum16x16(part[g]);
            const float m_old = mh[g];
            const float blk = _mm512_mask_reduce_max_ps(valid, s);
            const float m = blk > m_old ? blk : m_old;
            const __m512 p = _mm512_maskz_mov_ps(valid, exp16_scalef(_mm512_sub_ps(s, _mm512_set1_ps(m))));
            _mm512_storeu_ps(pw[g], p);
            if (m == m_old) { /* the max did not move: no correction (it would multiply by exactly 1) */
                _mm512_storeu_ps(dh + g * 16, _mm512_add_ps(_mm512_loadu_ps(dh + g * 16), p));
                continue;
            }
            const float c = m_old == -INFINITY ? 0.f : exp_nonpositive(m_old - m);
            const __m512 cv = _mm512_set1_ps(c);
            _mm512_storeu_ps(dh + g * 16, _mm512_fmadd_ps(_mm512_loadu_ps(dh + g * 16), cv, p));
            mh[g] = m;
            for (int j = 0; j < DV; j++)
                _mm512_storeu_ps(ah + g * D + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(ah + g * D + 16 * j), cv));
        }
        __m512 acc[FAST_MAX_GROUP][8];
        for (int g = 0; g < G; g++)
            for (int j = 0; j < DV; j++) acc[g][j] = _mm512_loadu_ps(ah + g * D + 16 * j);
#if HAVE_PAIR
        if (PAIR) { /* two keys a step: their V rows interleaved into pairs, their weights rounded to a pair */
            uint32_t pp[FAST_MAX_GROUP][8];
            for (int g = 0; g < G; g++)
                _mm256_storeu_si256((__m256i *)pp[g], (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(pw[g])));
            for (int t = 0; t < n; t += 2) {
                if (T) touch_step(T);
                if (T && t + 1 < n) touch_step(T);
                __m512i lo[4], hi[4];
                for (int c = 0; c < D / 32; c++) {
                    const __m512i a = _mm512_loadu_si512((const uint16_t *)A->v_cache + KEY_ROW(t) + 32 * c);
                    const __m512i b = t + 1 < n ? _mm512_loadu_si512((const uint16_t *)A->v_cache + KEY_ROW(t + 1) +
                                                                     32 * c)
                                                : _mm512_setzero_si512();
                    lo[c] = _mm512_unpacklo_epi16(a, b), hi[c] = _mm512_unpackhi_epi16(a, b);
                }
                for (int g = 0; g < G; g++) {
                    const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pp[g][t / 2]);
                    for (int c = 0; c < D / 32; c++) {
                        acc[g][2 * c] = _mm512_dpbf16_ps(acc[g][2 * c], (__m512bh)lo[c], w);
                        acc[g][2 * c + 1] = _mm512_dpbf16_ps(acc[g][2 * c + 1], (__m512bh)hi[c], w);
                    }
                }
            }
            for (int g = 0; g < G; g++)
                for (int j = 0; j < DV; j++) _mm512_storeu_ps(ah + g * D + 16 * j, acc[g][j]);
            continue;
        }
#endif
        for (int t = 0; t < n; t++) {
            if (T) touch_step(T);
            __m512 v[8];
            for (int j = 0; j < DV; j++) v[j] = load16(A->v_cache, KEY_ROW(t) + 16 * j, kv_dtype);
            for (int g = 0; g < G; g++) {
                const __m512 w = _mm512_set1_ps(pw[g][t]);
                for (int j = 0; j < DV; j++) acc[g][j] = _mm512_fmadd_ps(w, v[j], acc[g][j]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int j = 0; j < DV; j++) _mm512_storeu_ps(ah + g * D + 16 * j, acc[g][j]);
    }
#undef KEY_ROW
}

/* Keys [start, keys) of row b, gathered a page at a time (its extra slots and the stored keys that share their
 * page), in the blocks of their positions, for the task's kv heads [kv0, kv0 + nkv) */
#define TAIL_FN(D, G) \
    static __attribute__((noinline)) void tail_##D##_##G(const Args *A, float *qs, float *accs, float *dens, \
                                                         float *mx, int b, int kv0, int nkv, int64_t start, \
                                                         int64_t keys, const uint16_t *qraw) { \
        for (; start < keys; start += A->page_size) { \
            const int n = (int)((keys - start) < A->page_size ? (keys - start) : A->page_size); \
            int64_t at[MAX_PAGE]; \
            gather_rows(A, b, start, n, (int64_t)kv0 * D, at); \
            for (int t0 = 0; t0 < n; t0 += 16) { \
                const int m = n - t0 < 16 ? n - t0 : 16; \
                if (qraw) fast_block(A, qs, accs, dens, mx, 0, at + t0, m, nkv, D, G, -1, NULL, qraw, 1); \
                else fast_block(A, qs, accs, dens, mx, 0, at + t0, m, nkv, D, G, -1, NULL, NULL, 0); \
            } \
        } \
    }
#define TAIL_FNS(D) TAIL_FN(D, 1) TAIL_FN(D, 2) TAIL_FN(D, 3) TAIL_FN(D, 4) TAIL_FN(D, 5) TAIL_FN(D, 6) \
    TAIL_FN(D, 7) TAIL_FN(D, 8)
TAIL_FNS(64)
TAIL_FNS(128)
typedef void (*tail_fn)(const Args *, float *, float *, float *, float *, int, int, int, int64_t, int64_t,
                        const uint16_t *);
static const tail_fn TAIL_64[FAST_MAX_GROUP] = {tail_64_1, tail_64_2, tail_64_3, tail_64_4,
                                                tail_64_5, tail_64_6, tail_64_7, tail_64_8};
static const tail_fn TAIL_128[FAST_MAX_GROUP] = {tail_128_1, tail_128_2, tail_128_3, tail_128_4,
                                                 tail_128_5, tail_128_6, tail_128_7, tail_128_8};

/* An accumulator row of the pair values back in the order of D: vector 2c holds elements 32c + 8L + i of its
 * lanes 4L + i (i < 4, L < 4: VPUNPCKLWD's pairs), vector 2c + 1 the elements 4 further on */
static inline void pair_order(float *row, int D) {
    float tmp[MAX_HEAD_DIM];
    for (int c = 0; c < D / 32; c++)
        for (int l = 0; l < 16; l++) {
            const int d = 32 * c + 8 * (l / 4) + l % 4;
            tmp[d] = row[32 * c + l], tmp[d + 4] = row[32 * c + 16 + l];
        }
    memcpy(row, tmp, sizeof(float) * (size_t)D);
}

/* Block k of a sequence (16 keys; a page holds page_size / 16): its first row (from element col0 of the slot),
 * and in *count its keys (0 past the end) */
static inline int64_t block_at(const Args *A, const int64_t *pages, int64_t len, int64_t k, int64_t col0,
                               int *count) {
    const int bpp = A->page_size / 16;
    const int64_t page = k / bpp, t0 = (k % bpp) * 16, pos = page * A->page_size + t0;
    if (pos >= len) {
        *count = 0;
        return -1;
    }
    *count = (int)(len - pos < 16 ? len - pos : 16);
    return pages[page] * A->page_size * A->stride + col0 + t0 * A->stride;
}

/* Scratch floats of the fast body for tasks of `per` kv heads: queries and accumulators (D each per query
 * row), a 16-lane denominator and a running max per query row. */
static size_t fast_scratch_floats(int per, int group, int head_dim) {
    return (size_t)per * group * (2 * head_dim + 16 + 1);
}

static inline __attribute__((always_inline)) void attend_fast(const Args *A, float *scratch, int b, int kv0,
                                                               int kv1, const int D, const int G, const int whole,
                                                               const int PAIR) {
    const int nkv = kv1 - kv0, rows = nkv * G, page_size = A->page_size;
    const int elem = A->kv_dtype == 0 ? 4 : 2;
    const int64_t qrow = (int64_t)b * A->num_heads + (int64_t)kv0 * G;
    const TaskState T0 = task_state(A, scratch, qrow, rows, D, 16);
    float *qs = T0.qs, *accs = T0.accs, *dens = T0.dens, *mx = T0.mx;
    const uint16_t *qraw = PAIR ? (const uint16_t *)A->q + qrow * D : NULL; /* the task's raw bfloat16 queries */
    /* the keys read in place (their pages through the table), then the rest gathered (see keys_of) */
    const int64_t len = in_place_keys(A, b), keys = keys_of(A->kv_lens, A->extra_lens, b), stride = A->stride;
    const int64_t *pages = A->page_table + (int64_t)b * A->max_pages;
    const int64_t num_pages = (len + page_size - 1) / page_size, ahead = (PF_KEYS + page_size - 1) / page_size;
    if (whole) { /* every kv head (whole rows) and whole 16-key blocks: see touch_step */
        const int bytes = nkv * D * elem;
        int cnt, cnt1, cnt2;
        int64_t row = block_at(A, pages, len, 0, 0, &cnt), row1 = block_at(A, pages, len, 1, 0, &cnt1);
        if (cnt) { /* the first block: read at once, the next one asked for */
            Touch T = {(const char *)A->k_cache + row * elem, (const char *)A->v_cache + row * elem,
                       cnt1 ? (const char *)A->k_cache + row1 * elem : NULL,
                       cnt1 ? (const char *)A->v_cache + row1 * elem : NULL, stride * elem, bytes, cnt, 1, 0, 0};
            while (T.r < T.rows) touch_step(&T);
        }
        for (int64_t k = 0; cnt; k++) {
            const int64_t row2 = block_at(A, pages, len, k + 2, 0, &cnt2);
            Touch T = {(const char *)A->k_cache + row1 * elem, (const char *)A->v_cache + row1 * elem,
                       cnt2 ? (const char *)A->k_cache + row2 * elem : NULL,
                       cnt2 ? (const char *)A->v_cache + row2 * elem : NULL, stride * elem, bytes, cnt1,
                       (cnt1 * (bytes / 64) + nkv * (16 + cnt) - 1) / (nkv * (16 + cnt)), 0, 0};
            fast_block(A, qs, accs, dens, mx, row, NULL, cnt, nkv, D, G, -1, cnt1 ? &T : NULL, qraw, PAIR);
            while (cnt1 && T.r < T.rows) touch_step(&T);
            row = row1, cnt = cnt1, row1 = row2, cnt1 = cnt2;
        }
    } else for (int64_t start = 0; start < len; start += page_size) {
        const int n = (int)((len - start) < page_size ? (len - start) : page_size);
        const int64_t row0 = pages[start / page_size] * page_size * stride + (int64_t)kv0 * D;
        if (start == 0) prefetch_ahead(A, pages, start, len, (int64_t)kv0 * D, nkv * D * elem);
        /* the page PF_KEYS keys ahead (at least the next one); the same rows of it as of this one */
        const int64_t pf_page = start / page_size + ahead, pf_row = pf_page < num_pages
            ? pages[pf_page] * page_size * stride + (int64_t)kv0 * D : -1;
        for (int t0 = 0; t0 < n; t0 += 16)
            fast_block(A, qs, accs, dens, mx, row0 + t0 * stride, NULL, n - t0 < 16 ? n - t0 : 16, nkv, D, G,
                       pf_row < 0 ? -1 : pf_row + t0 * stride, NULL, qraw, PAIR);
    }
    if (keys > len) { /* the page holding extra slots, in its blocks: out of line, so the walks above stay as tight */
        const tail_fn tail = D == 64 ? TAIL_64[G - 1] : TAIL_128[G - 1];
        tail(A, qs, accs, dens, mx, b, kv0, nkv, len, keys, qraw);
    }
    for (int r = 0; r < rows; r++) {
        const float den = _mm512_reduce_add_ps(_mm512_loadu_ps(dens + r * 16));
        if (PAIR) pair_order(accs + (int64_t)r * D, D);
        store_row(A, (qrow + r) * D, accs + (int64_t)r * D, den > 0.f ? 1.f / den : 0.f, D);
    }
}

/* Two bodies per shape, so each holds one walk (one function with both ran the bfloat16 case 8% slower):
 * fast_D_G walks pages and prefetches (tasks of some kv heads, pages not a multiple of 16), fastw_D_G whole rows
 * (see touch_step); with the pair path, fastp_D_G and fastpw_D_G the same walks of its scores and values. */
#define FAST_FN(D, G) BODY_FN(fast, D, G, 0, 0) BODY_FN(fastw, D, G, 1, 0) PAIR_FNS(D, G)
#define FAST_FNS(D) FAST_FN(D, 1) FAST_FN(D, 2) FAST_FN(D, 3) FAST_FN(D, 4) FAST_FN(D, 5) FAST_FN(D, 6) \
    FAST_FN(D, 7) FAST_FN(D, 8)
FAST_FNS(64)
FAST_FNS(128)
typedef void (*fast_fn)(const void *, float *, int, int, int, int64_t);
static const fast_fn FAST_64[2][FAST_MAX_GROUP] = {
    {fast_64_1, fast_64_2, fast_64_3, fast_64_4, fast_64_5, fast_64_6, fast_64_7, fast_64_8},
    {fastw_64_1, fastw_64_2, fastw_64_3, fastw_64_4, fastw_64_5, fastw_64_6, fastw_64_7, fastw_64_8}};
static const fast_fn FAST_128[2][FAST_MAX_GROUP] = {
    {fast_128_1, fast_128_2, fast_128_3, fast_128_4, fast_128_5, fast_128_6, fast_128_7, fast_128_8},
    {fastw_128_1, fastw_128_2, fastw_128_3, fastw_128_4, fastw_128_5, fastw_128_6, fastw_128_7, fastw_128_8}};
#if HAVE_PAIR
static const fast_fn PAIR_64[2][FAST_MAX_GROUP] = {
    {fastp_64_1, fastp_64_2, fastp_64_3, fastp_64_4, fastp_64_5, fastp_64_6, fastp_64_7, fastp_64_8},
    {fastpw_64_1, fastpw_64_2, fastpw_64_3, fastpw_64_4, fastpw_64_5, fastpw_64_6, fastpw_64_7, fastpw_64_8}};
static const fast_fn PAIR_128[2][FAST_MAX_GROUP] = {
    {fastp_128_1, fastp_128_2, fastp_128_3, fastp_128_4, fastp_128_5, fastp_128_6, fastp_128_7, fastp_128_8},
    {fastpw_128_1, fastpw_128_2, fastpw_128_3, fastpw_128_4, fastpw_128_5, fastpw_128_6, fastpw_128_7,
     fastpw_128_8}};
#endif

/* bfloat16 queries over a bfloat16 cache take the pair path where the CPU has it (HAVE_PAIR) */
static fast_fn pick_fast(int head_dim, int group, int whole, int kv_dtype, int dtype) {
    if (group < 1 || group > FAST_MAX_GROUP) return NULL;
#if HAVE_PAIR
    if (kv_dtype == 1 && dtype == 1)
        return head_dim == 64 ? PAIR_64[whole][group - 1] : head_dim == 128 ? PAIR_128[whole][group - 1] : NULL;
#endif
    (void)kv_dtype, (void)dtype;
    return head_dim == 64 ? FAST_64[whole][group - 1] : head_dim == 128 ? FAST_128[whole][group - 1] : NULL;
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* ---- AVX2 body ----------------------------------------------------------------------------------------------
 * For hosts without AVX-512, over bfloat16 caches: the AVX-512 body's scheme on 8-float vectors. Keys 8 at a
 * time; per key, its K row of one kv head widened in registers (8 vectors at a time) and dotted with each of the
 * G query rows (the queries from L1: AVX2's 16 registers do not hold them), 8 keys' partial-product vectors per
 * query row summed by one transpose-reduction into a vector of 8 scores, their online softmax as one vector; then
 * per V row, widened VJ vectors at a time, its weight broadcast into VJ FMAs per query row, the accumulators of
 * every query row for those VJ vectors in registers. Nothing goes through a buffer: a first version that widened a
 * block's K and V rows into float32 buffers (as the generic body does a page's) was 0.8-0.95x the generic body
 * (GCC tuned for Zen 1 splits 32-byte stores in two, and the loads right after them waited). Pages are walked in
 * order, the same rows of the page PF_KEYS keys ahead prefetched key by key. A row's sums run in the same order
 * whatever task or batch it is in. Over float32 caches the generic body stays (this one: 0.77-0.88x there, the
 * generic one's spread page reads streaming better). Measured on an AVX2-only Zen 1 host (2 threads), SmolLM2's
 * shapes (9 heads, 3 kv heads, dim 64), 30 layers' pools of scattered pages, alternating with the generic body in
 * one C harness: bfloat16 batch 1 at 16-2048 tokens 1.13-1.25x, batch 4, 16 and 64 at 128-600 tokens
 * 1.17-1.24x; VJ 4 against 1 or 2: 1.02-1.09x. VJ is taken per G so that the G x VJ accumulators, the VJ V vectors and
 * the broadcast weight fit AVX2's 16 registers (VJ_OF): SmolLM2's G = 3 with VJ 4 needs 17, and GCC kept one
 * accumulator on the stack, a load-FMA-store chain through memory at every key (11% of the kernel's samples on a
 * Zen 3 host). There, with VJ 2 and the cache's dtype a constant (this body takes bfloat16 caches only), batch 1 at
 * 64-1,024 keys in cache ran 1.05-1.2x faster (same bits: each accumulator still sums its keys in order). */
#include <immintrin.h>
#define HAVE_FAST 1
#define CHUNKED 1
#define FAST_MAX_GROUP 8
#define VJ_MAX 4
/* V vectors per pass for G query rows a kv head: 4, or fewer where G x VJ + VJ + 1 registers would not fit */
#define VJ_OF(G) ((G) * 4 + 4 + 1 <= 16 ? 4 : (G) * 2 + 2 + 1 <= 16 ? 2 : 1)

static inline __m256 load8(const void *base, int64_t idx, int kv_dtype) {
    if (kv_dtype == 0) return _mm256_loadu_ps((const float *)base + idx);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + idx));
    if (kv_dtype == 1) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* Lane t of the result is the sum of the 8 lanes of v[t]: pairs inside 128-bit lanes, then quads, then the two
 * 128-bit lanes (21 shuffles and adds for 8 keys instead of a reduction per key). */
static inline __m256 sum8x8(const __m256 *v) {
    __m256 a[4];
    for (int i = 0; i < 4; i++)
        a[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    const __m256 b0 = _mm256_add_ps(_mm256_shuffle_ps(a[0], a[1], 0x44), _mm256_shuffle_ps(a[0], a[1], 0xEE));
    const __m256 b1 = _mm256_add_ps(_mm256_shuffle_ps(a[2], a[3], 0x44), _mm256_shuffle_ps(a[2], a[3], 0xEE));
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

/* Keys [0, n) (n <= 8) from row `row0` (the first key's slot, offset to the task's first kv head) against the G
 * query rows of each of the task's nkv kv heads. pf_row: the same rows of a page ahead, or -1. */
static inline __attribute__((always_inline)) void avx2_block(const Args *A, float *qs, float *accs, float *dens,
                                                              float *mx, int64_t row0, const int64_t *at, int n,
                                                              int nkv, const int D, const int G, int64_t pf_row) {
    const int DV = D / 8, kv_dtype = 1, elem = 2; /* bfloat16 caches only (pick_fast) */
    const int64_t stride = A->stride;
    const __m256 valid = _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    for (int h = 0; h < nkv; h++) {
        const int64_t hoff = row0 + (int64_t)h * D; /* key t's row: hoff + t * stride, or at[t] + h * D */
#define KEY_ROW(t) (at ? at[t] + (int64_t)h * D : hoff + (int64_t)(t) * stride)
        const float *qh = qs + (int64_t)h * G * D;
        __m256 part[FAST_MAX_GROUP][8];
        for (int t = 0; t < 8; t++) {
            if (t >= n) {
                for (int g = 0; g < G; g++) part[g][t] = _mm256_setzero_ps();
                continue;
            }
            if (pf_row >= 0) {
                const int64_t at = (pf_row + (int64_t)h * D + t * stride) * elem;
                for (int c = 0; c < D * elem; c += 64) {
                    __builtin_prefetch((const char *)A->k_cache + at + c, 0, 3);
                    __builtin_prefetch((const char *)A->v_cache + at + c, 0, 3);
                }
            }
            for (int j0 = 0; j0 < DV; j0 += 8) { /* 8 K vectors in registers, for every query row */
                __m256 k[8];
                for (int j = 0; j < 8 && j0 + j < DV; j++)
                    k[j] = load8(A->k_cache, KEY_ROW(t) + 8 * (j0 + j), kv_dtype);
                for (int g = 0; g < G; g++) {
                    const float *qg = qh + g * D + 8 * j0;
                    __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(qg), k[0]), s1 = _mm256_setzero_ps();
                    for (int j = 1; j < 8 && j0 + j < DV; j++) {
                        if (j & 1) s1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * j), k[j], s1);
                        else s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * j), k[j], s0);
                    }
                    part[g][t] = j0 ? _mm256_add_ps(part[g][t], _mm256_add_ps(s0, s1)) : _mm256_add_ps(s0, s1);
                }
            }
        }
        float pw[FAST_MAX_GROUP][8];
        for (int g = 0; g < G; g++) {
            const int r = h * G + g;
            const __m256 s = sum8x8(part[g]);
            const float m_old = mx[r];
            const float blk = hmaxk((vk)_mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, valid));
            const float m = blk > m_old ? blk : m_old;
            const __m256 p = _mm256_and_ps(valid, (__m256)expk((vk)_mm256_sub_ps(s, _mm256_set1_ps(m))));
            _mm256_storeu_ps(pw[g], p);
            float *dr = dens + r * 8, *ar = accs + (int64_t)r * D;
            if (m == m_old) { /* the max did not move: no correction (it would multiply by exactly 1) */
                _mm256_storeu_ps(dr, _mm256_add_ps(_mm256_loadu_ps(dr), p));
                continue;
            }
            const __m256 cv = _mm256_set1_ps(m_old == -INFINITY ? 0.f : exp_nonpositive(m_old - m));
            _mm256_storeu_ps(dr, _mm256_fmadd_ps(_mm256_loadu_ps(dr), cv, p));
            mx[r] = m;
            for (int j = 0; j < DV; j++) _mm256_storeu_ps(ar + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(ar + 8 * j), cv));
        }
        float *ah = accs + (int64_t)h * G * D;
        const int VJ = VJ_OF(G);
        for (int j0 = 0; j0 < DV; j0 += VJ) { /* VJ V vectors at a time, every query row's accumulators for them */
            __m256 acc[FAST_MAX_GROUP][VJ_MAX];
            for (int g = 0; g < G; g++)
                for (int j = 0; j < VJ; j++) acc[g][j] = _mm256_loadu_ps(ah + g * D + 8 * (j0 + j));
            for (int t = 0; t < n; t++) {
                __m256 v[VJ_MAX];
                for (int j = 0; j < VJ; j++) v[j] = load8(A->v_cache, KEY_ROW(t) + 8 * (j0 + j), kv_dtype);
                for (int g = 0; g < G; g++) {
                    const __m256 w = _mm256_broadcast_ss(&pw[g][t]);
                    for (int j = 0; j < VJ; j++) acc[g][j] = _mm256_fmadd_ps(w, v[j], acc[g][j]);
                }
            }
            for (int g = 0; g < G; g++)
                for (int j = 0; j < VJ; j++) _mm256_storeu_ps(ah + g * D + 8 * (j0 + j), acc[g][j]);
        }
    }
#undef KEY_ROW
}

/* Scratch floats of the AVX2 body for tasks of `per` kv heads: queries and accumulators (D each per query row),
 * an 8-lane denominator and a running max per query row, and a block's widened K and V rows. */
static size_t fast_scratch_floats(int per, int group, int head_dim) {
    return (size_t)per * group * (2 * head_dim + 8 + 1);
}

static inline __attribute__((always_inline)) void attend_avx2(const Args *A, float *scratch, int b, int kv0,
                                                               int kv1, int64_t c, const int D, const int G) {
    const int nkv = kv1 - kv0, rows = nkv * G, page_size = A->page_size;
    const int elem = A->kv_dtype == 0 ? 4 : 2;
    const int64_t qrow = (int64_t)b * A->num_heads + (int64_t)kv0 * G;
    const TaskState T0 = task_state(A, scratch, qrow, rows, D, 8);
    float *qs = T0.qs, *accs = T0.accs, *dens = T0.dens, *mx = T0.mx;
    /* keys before `len` read in place, then the page holding the extra slots gathered (see keys_of) */
    const int64_t len = in_place_keys(A, b), keys = keys_of(A->kv_lens, A->extra_lens, b), stride = A->stride;
    const int64_t *pages = A->page_table + (int64_t)b * A->max_pages;
    const int64_t num_pages = (len + page_size - 1) / page_size, ahead = (PF_KEYS + page_size - 1) / page_size;
    const int64_t ck = A->chunk ? chunk_keys(A, keys) : keys, k0 = c * ck, k1 = k0 + ck < keys ? k0 + ck : keys;
    for (int64_t start = k0; start < k1; start += page_size) {
        const int n = (int)((keys - start) < page_size ? (keys - start) : page_size);
        if (start >= len) {
            int64_t at[MAX_PAGE];
            gather_rows(A, b, start, n, (int64_t)kv0 * D, at);
            for (int t0 = 0; t0 < n; t0 += 8)
                avx2_block(A, qs, accs, dens, mx, 0, at + t0, n - t0 < 8 ? n - t0 : 8, nkv, D, G, -1);
            continue;
        }
        const int64_t row0 = pages[start / page_size] * page_size * stride + (int64_t)kv0 * D;
        if (start == 0) prefetch_ahead(A, pages, start, len, (int64_t)kv0 * D, nkv * D * elem);
        const int64_t pf_page = start / page_size + ahead, pf_row = pf_page < num_pages
            ? pages[pf_page] * page_size * stride + (int64_t)kv0 * D : -1;
        for (int t0 = 0; t0 < n; t0 += 8)
            avx2_block(A, qs, accs, dens, mx, row0 + t0 * stride, NULL, n - t0 < 8 ? n - t0 : 8, nkv, D, G,
                       pf_row < 0 ? -1 : pf_row + t0 * stride);
    }
    float den[MAX_ROWS];
    for (int r = 0; r < rows; r++) den[r] = hsumk((vk)_mm256_loadu_ps(dens + r * 8));
    finish_rows(A, b, c, qrow, rows, accs, mx, den, D);
}

#define FAST_FN(D, G) \
    static void fast_##D##_##G(const void *A, float *w, int b, int kv0, int kv1, int64_t c) { \
        attend_avx2((const Args *)A, w, b, kv0, kv1, c, D, G); \
    }
#define FAST_FNS(D) FAST_FN(D, 1) FAST_FN(D, 2) FAST_FN(D, 3) FAST_FN(D, 4) FAST_FN(D, 5) FAST_FN(D, 6) \
    FAST_FN(D, 7) FAST_FN(D, 8)
FAST_FNS(64)
FAST_FNS(128)
typedef void (*fast_fn)(const void *, float *, int, int, int, int64_t);
static const fast_fn FAST_64[FAST_MAX_GROUP] = {fast_64_1, fast_64_2, fast_64_3, fast_64_4,
                                                fast_64_5, fast_64_6, fast_64_7, fast_64_8};
static const fast_fn FAST_128[FAST_MAX_GROUP] = {fast_128_1, fast_128_2, fast_128_3, fast_128_4,
                                                 fast_128_5, fast_128_6, fast_128_7, fast_128_8};

static fast_fn pick_fast(int head_dim, int group, int whole, int kv_dtype, int dtype) { /* one walk: whole rows too */
    (void)whole, (void)dtype;
    if (group < 1 || group > FAST_MAX_GROUP || kv_dtype != 1) return NULL;
    return head_dim == 64 ? FAST_64[group - 1] : head_dim == 128 ? FAST_128[group - 1] : NULL;
}
#else
#define CHUNKED 1
typedef void (*fast_fn)(const void *, float *, int, int, int, int64_t);
static fast_fn pick_fast(int head_dim, int group, int whole, int kv_dtype, int dtype) {
    (void)head_dim, (void)group, (void)whole, (void)kv_dtype, (void)dtype;
    return NULL;
}
static size_t fast_scratch_floats(int per, int group, int head_dim) {
    (void)per, (void)group, (void)head_dim;
    return 0;
}
#endif

static void attend_64(const Args *A, float *w, int b, int kv0, int kv1, int64_t c) {
    attend(A, w, b, kv0, kv1, c, 64);
}
static void attend_128(const Args *A, float *w, int b, int kv0, int kv1, int64_t c) {
    attend(A, w, b, kv0, kv1, c, 128);
}
static void attend_any(const Args *A, float *w, int b, int kv0, int kv1, int64_t c, int hd) {
    attend(A, w, b, kv0, kv1, c, hd);
}

/* Whether row b's first page is its neighbour's: the rows of one sequence's draft (or of choices, or of a shared
 * prefix), whose pages the first of them brings into cache. The whole-row walk's extra reads only cost there: a
 * batch-1 verification of 4-11 rows over 900 tokens took 0.87-0.90x as long (float32) without this. */
static int shares_first_page(const Args *A, int b, int batch) {
    const int64_t first = A->kv_lens[b] > 0 ? A->page_table[(int64_t)b * A->max_pages] : -1;
    const int64_t *t = A->page_table, *lens = A->kv_lens, m = A->max_pages;
    return first >= 0 && ((b > 0 && lens[b - 1] > 0 && t[(int64_t)(b - 1) * m] == first) ||
                          (b + 1 < batch && lens[b + 1] > 0 && t[(int64_t)(b + 1) * m] == first));
}

/* 1 when the kernel takes these shapes (callers use another path otherwise), else 0 */
int splitserve_decode_supported(int head_dim, int num_heads, int num_kv_heads, int page_size) {
    return head_dim >= 1 && head_dim <= MAX_HEAD_DIM && num_kv_heads >= 1 && num_heads % num_kv_heads == 0 &&
           num_heads / num_kv_heads <= MAX_ROWS && page_size >= 1 && page_size <= MAX_PAGE;
}

int splitserve_decode_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                                const int64_t *page_table, const int64_t *kv_lens, const int64_t *extra_slots,
                                const int64_t *extra_lens, int batch, int num_heads, int num_kv_heads, int head_dim,
                                int page_size, int max_pages, int max_extra, float scale, int dtype, int kv_dtype,
                                int num_threads, int generic_only) {
    if (!splitserve_decode_supported(head_dim, num_heads, num_kv_heads, page_size) || dtype < 0 || dtype > 2 ||
        kv_dtype < 0 || kv_dtype > 2)
        return -1;
    /* Without the AVX-512 body a row's keys are split into up to MAX_CHUNKS chunks of whole pages, at least
     * CHUNK_KEYS each, from its length alone (every batch alike, so a row's result does not depend on its batch),
     * each chunk a task, the chunks merged after (merge_chunks): one row over 3 kv heads otherwise kept 2 threads
     * busy two thirds of the time. Zen 1 (AVX2), 2 threads, SmolLM2's shapes, bfloat16, 30 layers of scattered
     * pages, alternating with whole rows in one C harness: batch 1 at 512 and 1,024 tokens 1.37-1.49x, at 128
     * level; batch 2 1.1x; batch 4-64 at 512-1,024 tokens 0.96-0.985x (each chunk's set-up, partial results and
     * merge), at 128 level. Chunks of at least 128 keys and up to 4 measured best: unbounded chunks of 128, 0.92-0.96x
     * at batch 4-16; up to 2 chunks, tasks of one kv head at batch 1 (1.2-1.25x there). */
    const int64_t chunk = CHUNKED ? (CHUNK_KEYS + page_size - 1) / page_size * page_size : 0;
    int64_t *chunk_base = malloc(sizeof(int64_t) * ((size_t)batch + 1)), *chunk_row = NULL;
    float *partial = NULL;
    if (!chunk_base) return -2;
    chunk_base[0] = 0;
    for (int b = 0; b < batch; b++)
        chunk_base[b + 1] = chunk_base[b] + chunks_of(chunk, keys_of(kv_lens, extra_lens, b));
    const int64_t chunks = chunk_base[batch];
    if (chunks > batch) { /* some rows have several chunks: their partial results, and each chunk's row */
        partial = malloc(sizeof(float) * (size_t)chunks * num_heads * (head_dim + 2));
        chunk_row = malloc(sizeof(int64_t) * (size_t)chunks);
        if (!partial || !chunk_row) {
            free(chunk_base), free(partial), free(chunk_row);
            return -2;
        }
        for (int b = 0; b < batch; b++)
            for (int64_t i = chunk_base[b]; i < chunk_base[b + 1]; i++) chunk_row[i] = b;
    }
    const Args A = {q, k_cache, v_cache, out, page_table, kv_lens, extra_slots, extra_lens, num_heads,
                    num_heads / num_kv_heads, page_size, max_pages, max_extra, dtype, kv_dtype,
                    (int64_t)num_kv_heads * head_dim, scale, chunk, chunk_base, partial};
    /* Enough chunks to share out: one task per chunk (its pages read as whole rows); otherwise split each
     * chunk's kv heads into tasks of `per` heads, so small batches still keep every thread busy. */
    const int group = num_heads / num_kv_heads;
    int per = num_kv_heads;
    while (per > 1 && (chunks * (num_kv_heads / per) < 2 * (int64_t)num_threads || per * group > MAX_ROWS))
        per--;
    while (num_kv_heads % per) per--;
    const int tasks_per_seq = num_kv_heads / per;
    const int whole = per == num_kv_heads && page_size % 16 == 0;
    const fast_fn fast = generic_only ? NULL : pick_fast(head_dim, group, 0, kv_dtype, dtype),
                  fast_whole = generic_only ? NULL : pick_fast(head_dim, group, whole, kv_dtype, dtype);
    /* per-thread scratch: the fast body's state, or the generic body's query rows and accumulators plus one
     * converted K and V page for 16-bit caches or a page of gathered keys */
    const size_t floats = fast ? fast_scratch_floats(per, group, head_dim)
                               : (size_t)2 * per * group * head_dim +
                                     (kv_dtype || extra_lens ? (size_t)2 * page_size * per * head_dim : 0);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = malloc(floats * sizeof(float));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < chunks * tasks_per_seq; task++) {
            if (!scratch) continue;
            const int64_t ci = task / tasks_per_seq;
            const int b = chunk_row ? (int)chunk_row[ci] : (int)ci, kv0 = (int)(task % tasks_per_seq) * per;
            const int64_t c = ci - chunk_base[b];
            if (fast) {
                const fast_fn body = shares_first_page(&A, b, batch) ? fast : fast_whole;
                body((const void *)&A, scratch, b, kv0, kv0 + per, c);
            }
            else if (head_dim == 64) attend_64(&A, scratch, b, kv0, kv0 + per, c);
            else if (head_dim == 128) attend_128(&A, scratch, b, kv0, kv0 + per, c);
            else attend_any(&A, scratch, b, kv0, kv0 + per, c, head_dim);
        }
        if (partial) { /* after the tasks (the loop's barrier), in the same threads */
#pragma omp for schedule(static)
            for (int64_t i = 0; i < (int64_t)batch * num_heads; i++) {
                const int b = (int)(i / num_heads);
                if (scratch && chunk_base[b + 1] - chunk_base[b] > 1)
                    merge_chunks(&A, b, (int)(i % num_heads), head_dim);
            }
        }
        free(scratch);
    }
    free(chunk_base), free(partial), free(chunk_row);
    return failed ? -2 : 0;
}
