/* A step's decoder layers in one native call: for every layer, the same kernels the Python layer calls one by one
 * (engine/models/llama.py), in the same order, on the same inputs, so the rows come out bit-identical:
 *
 *   h = rms_norm(x [+ residual])            row_ops.c (the first layer copies x into the residual instead)
 *   qkv = h @ Wqkv^T (+ b)                  few_rows_gemm.c
 *   qk = rope(q and k inside qkv)           row_ops.c
 *   pool[slots] = k, v                      row_ops.c
 *   a = attention(q over each row's pages)  runner/attention/cpu_decode.c for decode rows (draft tree paths
 *                                           included), cpu_prefill.c for prefill chunks
 *   (last layer: a and residual cut to the rows whose logits are wanted, as CausalLM.forward does)
 *   h = rms_norm(a @ Wo^T + residual)       few_rows_gemm.c, row_ops.c
 *   x = (silu(gate) * up)(h @ Wgu^T) @ Wd^T few_rows_gemm.c, row_ops.c
 *
 * Why: at batch 1 those are ~10 calls a layer, 300 for SmolLM2's 30 layers, and each costs Python, ctypes and
 * torch's dispatch and allocation (tens of microseconds together) while the arithmetic of a row is a few: in
 * bfloat16 the few-rows GEMM read the weights in ~3.7 ms of an ~8 ms step. The kernels come in as function
 * pointers from the libraries the Python path loaded, so both paths run the same machine code; this file only
 * sequences them, in scratch the caller keeps across steps. Rows are the step's decode rows (one per sequence, or
 * a sequence's newest token and its draft nodes), then its prefill chunks' rows; x holds the embeddings on entry,
 * and on return the last layer's MLP output of the out rows (every row without them), residual their running
 * sum (the model's final norm adds the two). Returns 0, -1 without scratch or without the prefill kernel for a
 * step with chunks, or the first kernel's nonzero code (then the step's outputs are undefined, and the caller
 * raises).
 *
 * The ends of a forward can come in too (a step with ``ids``, ``logits``): x gathered from the embedding rows of
 * the step's tokens, the RoPE rows from the float32 tables at the step's positions (rounded to the model's dtype as
 * torch's ``to`` rounds them), and after the last layer the model's final norm and LM head over the out rows, the
 * logits widened to float32, as CausalLM.tail and head compute them. At batch 1 those ends were ~0.5 ms of a ~10 ms
 * bfloat16 SmolLM2 step in Python and torch (embedding 0.06, RoPE rows 0.1, the final norm 0.12 and the rows'
 * selection 0.11, the head's dispatch and widening 0.18): each op a few microseconds in a microbenchmark, tens in a
 * step, whose 270 MB of weights leave nothing of Python's or torch's in the caches. -3: a token id outside the
 * embedding, or a position outside the RoPE tables. */
#include <stdint.h>
#include <string.h>

#include "vec16.h"

typedef int (*gemm_fn)(const void *x, const void *w, const void *bias, void *y, int m, int n, int k, int threads);
typedef int (*norm_fn)(const void *x, void *residual, const void *w, void *out, int rows, int dim, float eps,
                       int dtype, int threads);
typedef int (*rope_fn)(const void *x, int64_t row_stride, void *out, const void *cos_t, const void *sin_t,
                       int tokens, int heads, int dim, int dtype, int threads);
typedef int (*kv_fn)(void *k_cache, void *v_cache, const int64_t *slots, int64_t num_slots, const void *k,
                     const void *v, int64_t rows, int64_t row_bytes, int64_t k_stride, int64_t v_stride,
                     int threads);
typedef int (*attn_fn)(const void *q, const void *k_cache, const void *v_cache, void *out,
                       const int64_t *page_table, const int64_t *kv_lens, const int64_t *extra_slots,
                       const int64_t *extra_lens, int batch, int num_heads, int num_kv_heads, int head_dim,
                       int page_size, int max_pages, int max_extra, float scale, int dtype, int kv_dtype,
                       int num_threads, int generic_only);
typedef int (*act_fn)(const void *gate_up, void *out, int tokens, int inter, int dtype, int threads);
typedef int (*prefill_fn)(const void *q, const void *k_cache, const void *v_cache, void *out,
                          const int64_t *q_starts, const int64_t *q_lens, const int64_t *kv_lens,
                          const int64_t *page_table, int num_seqs, int max_pages, int num_heads, int num_kv_heads,
                          int head_dim, int page_size, int64_t q_stride, int64_t out_stride, float scale, int dtype,
                          int kv_dtype, int num_threads);

typedef struct {
    const void *w, *b; /* weight [n, k] in the GEMM function's layout (dense, or pair blocks), bias [n] or NULL */
} Linear;

typedef struct {
    const void *ln1, *ln2; /* the input and post-attention norms' weights */
    Linear qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* this layer's K and V: [num_slots, kv_heads, head_dim] */
} Layer;

typedef struct {
    gemm_fn gemm;
    norm_fn norm;
    rope_fn rope;
    kv_fn kv_write;
    attn_fn attention;
    act_fn act;
    prefill_fn prefill; /* NULL: the stack takes no extends */
    const Layer *layers;
    int num_layers, hidden, heads, kv_heads, head_dim, inter, page_size, dtype;
    int64_t num_slots;
    float eps, scale;
    int gemm_rows; /* the most rows one GEMM call takes: more go in pieces */
    /* the ends (NULL where the stack is not given them) */
    const void *embed;      /* [vocab, hidden] */
    const void *final_norm; /* the model's last norm's weight */
    Linear head;            /* [vocab, hidden] in head_gemm's layout */
    gemm_fn head_gemm;
    int vocab, head_rows; /* head_rows: the most rows one head_gemm call takes */
} Stack;

typedef struct {
    int rows, max_pages, max_extra, threads;
    const void *cos, *sin;                                   /* [rows, head_dim] in the model's dtype */
    const int64_t *slots, *page_table, *kv_lens, *extra_slots, *extra_lens; /* AttentionMeta's decode rows' */
    int num_decode, num_extends, extend_max_pages, num_out;
    /* the extends (prefill chunks, rows num_decode on): first row, rows, keys attended by the last, pages */
    const int64_t *q_starts, *q_lens, *extend_kv_lens, *extend_page_table;
    const int64_t *out_rows; /* [num_out]: the rows the last layer projects out (NULL: every row) */
    void *scratch;           /* splitserve_layer_stack_scratch(rows) bytes, 4 KiB aligned */
    /* the ends: ids [rows] (NULL: x_io holds the embeddings), positions [rows] into the float32 tables
     * rope_cos/rope_sin [rope_rows, head_dim] (NULL: cos/sin hold the rows' values), logits [out rows, vocab] float32
     * (NULL: x_io and residual_io get the last layer's output and the residual), head_out [out rows, vocab] where
     * a bfloat16 head writes before the widening */
    const int64_t *ids, *positions;
    const float *rope_cos, *rope_sin;
    int64_t rope_rows;
    float *logits;
    void *head_out;
} Step;

/* The step's activations live in buffers of their own (x and the residual are copied in and out), each at a
 * different offset within a 4 KiB page (SKEW apart): with them packed back to back, a float32 step of 4 rows ran
 * 1.3x slower than the per-layer path (19.9 against 15.6 ms a step on a Zen 5 host), loads of one buffer
 * presumably waiting on stores to another at the same address bits (4K aliasing); skewed, 12.7 against 16.0. */
#define NBUF 11
#define SKEW 320

/* buffer i's share of the scratch: whole pages, the buffer starting SKEW * (i + 1) bytes into the first */
static int64_t buffer_bytes(int64_t bytes, int i) { return (bytes + SKEW * (i + 1) + 4095) / 4096 * 4096; }

/* y[m, n] = x[m, k] @ W^T (+ b) by `gemm`, in pieces of its `most` rows */
static int pieces(gemm_fn gemm, int most, int64_t es, const void *x, const Linear *w, void *y, int m, int n, int k,
                  int nt) {
    for (int r = 0; r < m; r += most) {
        const int rows = m - r < most ? m - r : most;
        const int rc = gemm((const char *)x + (int64_t)r * k * es, w->w, w->b, (char *)y + (int64_t)r * n * es, rows,
                            n, k, nt);
        if (rc) return rc;
    }
    return 0;
}

/* a layer's GEMM, in pieces of the GEMM function's most rows */
static int gemm_pieces(const Stack *s, const void *x, const Linear *w, void *y, int m, int n, int k, int nt) {
    return pieces(s->gemm, s->gemm_rows, s->dtype ? 2 : 4, x, w, y, m, n, k, nt);
}

#define CHECK(call) \
    do { \
        const int rc_ = (call); \
        if (rc_) { \
            return rc_; \
        } \
    } while (0)

/* each buffer's elements for a step of t rows: x, residual, h, qkv_out, qk, qc, attn, gu, act, cos, sin */
static void buffer_sizes(const Stack *s, int t, int64_t sizes[NBUF]) {
    const int q = s->heads * s->head_dim, kv = s->kv_heads * s->head_dim;
    const int64_t per_row[NBUF] = {s->hidden, s->hidden, s->hidden, q + 2 * kv, q + kv, q, q, 2 * s->inter,
                                   s->inter, s->head_dim, s->head_dim};
    for (int i = 0; i < NBUF; i++) sizes[i] = (int64_t)t * per_row[i];
}

/* The scratch bytes a step of `rows` rows needs (the caller may keep one buffer of that size for every step: a
 * fresh allocation of tens of MB is mapped anew, and its first touches fault, at every call) */
int64_t splitserve_layer_stack_scratch(const Stack *s, int rows) {
    int64_t sizes[NBUF], total = 0;
    buffer_sizes(s, rows, sizes);
    for (int i = 0; i < NBUF; i++) total += buffer_bytes(sizes[i] * (s->dtype ? 2 : 4), i);
    return total;
}

/* x from the embedding rows of the step's ids, and its cos and sin rows from the tables at its positions, in the
 * model's dtype; -3 for an id or position outside them */
static int gather_inputs(const Stack *s, const Step *st, char *x, char *cos, char *sin) {
    const int64_t es = s->dtype ? 2 : 4, row = (int64_t)s->hidden * es, d = s->head_dim;
    for (int r = 0; r < st->rows; r++) {
        const int64_t id = st->ids[r], pos = st->positions[r];
        if (id < 0 || id >= s->vocab || pos < 0 || pos >= st->rope_rows) return -3;
        memcpy(x + r * row, (const char *)s->embed + id * row, (size_t)row);
        for (int64_t i = 0; i < d; i++) {
            const float c = st->rope_cos[pos * d + i], n = st->rope_sin[pos * d + i];
            if (s->dtype) {
                ((uint16_t *)cos)[r * d + i] = f32_to_bf16(c);
                ((uint16_t *)sin)[r * d + i] = f32_to_bf16(n);
            } else {
                ((float *)cos)[r * d + i] = c;
                ((float *)sin)[r * d + i] = n;
            }
        }
    }
    return 0;
}

/* the logits of the m out rows (x: the last layer's output, residual: the running sum): the final norm, the LM head
 * in pieces of its most rows, a bfloat16 head's output widened */
static int head_logits(const Stack *s, const Step *st, char *x, char *residual, char *h, int m, int nt) {
    const int64_t es = s->dtype ? 2 : 4, v = s->vocab;
    CHECK(s->norm(x, residual, s->final_norm, h, m, s->hidden, s->eps, s->dtype, nt));
    CHECK(pieces(s->head_gemm, s->head_rows, es, h, &s->head, s->dtype ? st->head_out : (void *)st->logits, m,
                 (int)v, s->hidden, nt));
    if (s->dtype) {
        const uint16_t *b = st->head_out;
        uint32_t *f = (uint32_t *)st->logits; /* bfloat16 is the top half of a float32 */
        for (int64_t i = 0; i < (int64_t)m * v; i++) f[i] = (uint32_t)b[i] << 16;
    }
    return 0;
}

int splitserve_layer_stack(const Stack *s, const Step *st, void *x_io, void *residual_io) {
    const int t = st->rows, d = s->head_dim, q = s->heads * d, kv = s->kv_heads * d, qkv = q + 2 * kv;
    const int64_t es = s->dtype ? 2 : 4;
    int64_t sizes[NBUF];
    buffer_sizes(s, t, sizes);
    char *scratch = st->scratch;
    if (!scratch || (st->num_extends && !s->prefill)) return -1;
    char *buf[NBUF], *at = scratch;
    for (int i = 0; i < NBUF; i++) {
        buf[i] = at + SKEW * (i + 1);
        at += buffer_bytes(sizes[i] * es, i);
    }
    char *x = buf[0], *residual = buf[1], *h = buf[2], *qkv_out = buf[3], *qk = buf[4], *qc = buf[5],
         *attn = buf[6], *gu = buf[7], *act = buf[8];
    const void *cos_rows = st->cos, *sin_rows = st->sin;
    if (st->ids) {
        if (!s->embed || !st->positions) return -1;
        CHECK(gather_inputs(s, st, x, buf[9], buf[10]));
        cos_rows = buf[9], sin_rows = buf[10];
    } else {
        memcpy(x, x_io, (size_t)(sizes[0] * es));
    }
    if (st->logits && (!s->head_gemm || !s->final_norm || (s->dtype && !st->head_out))) return -1;
    const int nt = st->threads, nd = st->num_decode, hid = s->hidden;
    int m = t; /* rows carried through the layer's output projection and MLP */
    for (int l = 0; l < s->num_layers; l++) {
        const Layer *L = &s->layers[l];
        if (l == 0) {
            memcpy(residual, x, (size_t)(sizes[0] * es));
            CHECK(s->norm(x, NULL, L->ln1, h, t, hid, s->eps, s->dtype, nt));
        } else {
            CHECK(s->norm(x, residual, L->ln1, h, t, hid, s->eps, s->dtype, nt));
        }
        CHECK(gemm_pieces(s, h, &L->qkv, qkv_out, t, qkv, hid, nt));
        CHECK(s->rope(qkv_out, qkv, qk, cos_rows, sin_rows, t, s->heads + s->kv_heads, d, s->dtype, nt));
        CHECK(s->kv_write(L->k_cache, L->v_cache, st->slots, s->num_slots, qk + (int64_t)q * es,
                          qkv_out + (int64_t)(q + kv) * es, t, kv * es, (int64_t)(q + kv) * es, qkv * es, nt));
        if (nd) {
            for (int r = 0; r < nd; r++)
                memcpy(qc + (int64_t)r * q * es, qk + (int64_t)r * (q + kv) * es, (size_t)(q * es));
            CHECK(s->attention(qc, L->k_cache, L->v_cache, attn, st->page_table, st->kv_lens, st->extra_slots,
                               st->extra_lens, nd, s->heads, s->kv_heads, d, s->page_size, st->max_pages,
                               st->max_extra, s->scale, s->dtype, s->dtype, nt, 0));
        }
        if (st->num_extends) {
            CHECK(s->prefill(qk, L->k_cache, L->v_cache, attn, st->q_starts, st->q_lens, st->extend_kv_lens,
                             st->extend_page_table, st->num_extends, st->extend_max_pages, s->heads, s->kv_heads, d,
                             s->page_size, q + kv, q, s->scale, s->dtype, s->dtype, nt));
        }
        const char *a = attn;
        if (l == s->num_layers - 1 && st->out_rows) { /* only these rows' outputs are read after this layer */
            m = st->num_out;
            for (int r = 0; r < m; r++) {
                memcpy(qc + (int64_t)r * q * es, attn + st->out_rows[r] * q * es, (size_t)(q * es));
                memcpy(h + (int64_t)r * hid * es, residual + st->out_rows[r] * hid * es, (size_t)(hid * es));
            }
            memcpy(residual, h, (size_t)((int64_t)m * hid * es));
            a = qc;
        }
        CHECK(gemm_pieces(s, a, &L->o, x, m, hid, q, nt));
        CHECK(s->norm(x, residual, L->ln2, h, m, hid, s->eps, s->dtype, nt));
        CHECK(gemm_pieces(s, h, &L->gate_up, gu, m, 2 * s->inter, hid, nt));
        CHECK(s->act(gu, act, m, s->inter, s->dtype, nt));
        CHECK(gemm_pieces(s, act, &L->down, x, m, hid, s->inter, nt));
    }
    if (st->logits) return head_logits(s, st, x, residual, h, m, nt);
    memcpy(x_io, x, (size_t)((int64_t)m * hid * es));
    memcpy(residual_io, residual, (size_t)((int64_t)m * hid * es));
    return 0;
}
