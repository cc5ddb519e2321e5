/* A whole decode step of a Llama-family decoder, every layer, in one call: for B
   sequences of one new token each, over preallocated buffers, bfloat16 activations and
   int4/int8 weights (qgemm.c), paged attention (attention.c).

   It computes the same bits as the layer written in torch ops (radixserve/model/llama.py
   on the torch kernel set, bfloat16): every op below rounds as its torch counterpart does,
   step by step, and the GEMMs and the attention are the very functions that path calls.

     s    = bf16(x + residual)                         (float add, rounded; layer 0: s = x)
     ss   = torch's float sum of s*s over the row      (sum_sq below: its order exactly)
     r    = 1 / sqrt(ss / hidden + eps)                (float: div, add, sqrt, div)
     h    = bf16(w * bf16(s * r))                      (the norm; s is the new residual)
     qkv  = qgemm(h)                                   (bfloat16 out)
     rope on q and each k head, per pair (i, i + D/2) with c, s the float tables:
       q'[i]       = bf16(q[i] * c - q[i + D/2] * s)   (products rounded, then the sum;
       q'[i + D/2] = bf16(q[i + D/2] * c + q[i] * s)    torch's x*cos + roll(x)*sin)
     k, v → their pool slots; o = paged_attention(q); attn = qgemm_o(o)
     h    = the norm of (attn, s) as above; gu = qgemm_gate_up(h)
     a    = bf16(silu[gate] * up)                      (silu: torch's own bf16 → bf16 table)
     x    = qgemm_down(a)                              (the next layer's x)

   After the last layer, where the step has a head (a bfloat16 LM head): the final norm
   of the rows that want logits (as the layers' norms), qgemm_bf16 (bfloat16 out, as the
   torch path's LM head) and that widened to float32 (its `.float()`).

   LoRA (multi-LoRA serving): with row_slot, after each of the four GEMMs (before RoPE,
   the norm or silu · up read its output) the rows' adapter updates are added in place
   by lora.c's own functions, each adapted projection (q, k, v, o, gate, up, down) on its
   columns of the fused output: the bits of `lora_apply` on the torch path's projection
   output (radixserve/model/lora_manager.py `LoraBatch.add`), rows of slot -1 untouched.

   No multiply-add is contracted into an FMA here (fp-contract off): torch's elementwise
   ops round each product. Denormals are not flushed here (torch does not flush them);
   qgemm and attention flush inside their own calls, as they do when torch calls them.

   Rows: each row is one new token with its own position, KV slot and sequence (row_seq:
   its row of the page table). Several rows may be one sequence's (positions p, p + 1, ...
   of a cached turn's delta): every row's K/V is stored before any row attends, and a row
   at position p reads keys [0, p], so it sees the rows before it in this step and none
   after. Runs of one sequence's rows (chunks) are attended together, each K/V block read
   once for the run; a row's bits do not depend on its run (attention.c).

   Threads: `decode_step` is called once per thread (thread t of n, all with the same
   arguments); the threads split each GEMM's column blocks, the store's (row, kv head)
   items and the attention's (chunk, kv head) items, and meet at a barrier between
   dependent phases (6 per layer). Norms are computed by every thread into its own buffer
   (only thread 0 writes the residual), so no barrier waits for them. Which thread
   computes an output never changes its bits. A LoRA update's expand takes the same
   columns as the GEMM; its shrink (t = a @ x, ~2% of the GEMM's multiply-adds at rank
   16 on the default model) is computed by each thread for every adapter row, so it
   needs no barrier of its own (one more barrier per GEMM to split it measured no faster
   on 2 cores). */

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <math.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

/* the kernels this step calls (qgemm.c, attention.c: the same library) */
void qgemm_group_sums(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, int64_t group,
                      float *xs);
void qgemm_int4(const uint16_t *x, int64_t ldx, const uint8_t *w, const uint16_t *sz,
                const float *xs, void *y, int64_t ldy, int64_t out_f32, int64_t m, int64_t n,
                int64_t k, int64_t group, int64_t cb_begin, int64_t cb_end);
void qgemm_int8(const uint16_t *x, int64_t ldx, const int8_t *w, const uint16_t *scale,
                void *y, int64_t ldy, int64_t out_f32, int64_t m, int64_t k, int64_t cb_begin,
                int64_t cb_end);
void paged_attention(const void *q, int64_t q_row, int64_t q_head, const void *k_cache,
                     const void *v_cache, void *out, const int64_t *row_seq,
                     const int64_t *row_pos, const int64_t *page_table, int64_t table_stride,
                     int64_t page_size, int64_t heads, int64_t kv_heads, int64_t dim,
                     int64_t window, double scale, int64_t bf16, const int64_t *chunks,
                     int64_t item_heads, int64_t item_begin, int64_t item_end,
                     int64_t item_step);
int64_t attention_item_heads(int64_t chunks, int64_t kv_heads, int64_t threads);
void qgemm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, void *y, int64_t ldy,
                int64_t out_f32, int64_t m, int64_t k, int64_t cb_begin, int64_t cb_end);
void lora_shrink_rows(const void *x, int64_t ldx, const void *a, const int64_t *row_slot,
                      float *t, int64_t k, int64_t r, int64_t bf16, int64_t row_begin,
                      int64_t row_end, float *xf);
void lora_expand_cols(const float *t, const void *b, int64_t ls, int64_t lm, int64_t lr,
                      const float *scaling, const int64_t *row_slot, void *y, int64_t ldy,
                      int64_t n, int64_t r, int64_t num_slots, int64_t bf16, int64_t col_begin,
                      int64_t col_end, void *scratch, int64_t *made);

static inline float bf(uint16_t b) {
    uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t to_bf(float f) {  /* round to nearest even; NaN stays NaN (as torch) */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* One projection's weight: int4 (packed, scales/zeros, group) or int8 (packed, scales). */
typedef struct {
    const void *w, *scales;
    int64_t n, k, group, is_int8;
} Proj;

typedef struct {
    const uint16_t *input_norm, *post_norm;  /* (hidden,) bfloat16 */
    Proj qkv, o, gate_up, down;
    void *k_cache, *v_cache;                 /* (P, page_size, kv_heads, head_dim) bfloat16 */
} Layer;

/* One adapted projection's LoRA stack (lora.c's layouts), its update added to the
   columns [start, start + width) of a fused output (q, k, v of qkv; gate, up of gate_up) */
typedef struct {
    const void *a, *b;        /* a (L, R, K) contiguous; b (L, width, R) by b_ls, b_lm, b_lr */
    const float *scaling;     /* (L,) */
    const uint8_t *holds;     /* (L,): slot s holds an adapter that adapts this projection */
    int64_t b_ls, b_lm, b_lr, start, width;
} LoraProj;

/* a layer's LoraProj entries: q, k, v, o, gate, up, down (a NULL: not adapted) */
#define LORA_PROJS 7

typedef struct {
    atomic_int arrived, generation;
} Barrier;

/* The step: shapes, the inputs of this step and the buffers (all preallocated). */
typedef struct {
    int64_t num_layers, batch, hidden, heads, kv_heads, head_dim, inter, sum_lanes;
    float eps;
    double scale;
    int64_t page_size, table_stride;
    const Layer *layers;
    const float *cos, *sin;                  /* (max_pos, head_dim / 2) float32 */
    const uint16_t *silu;                    /* (65536,) torch's silu of every bfloat16 */
    const int64_t *positions, *slots;        /* (B,) */
    const int64_t *page_table;               /* (S, table_stride): each sequence's pages */
    const int64_t *row_seq, *row_pos, *chunks; /* (B,), (B,), (C + 1,): attention's rows */
    uint16_t *x;                             /* (B, hidden): in the embeddings, out the last down */
    uint16_t *residual[2];                   /* (B, hidden) each; the stream ends in [0] */
    uint16_t *qkv, *attn, *proj, *gate_up, *act;  /* shared activations */
    uint16_t *h;                             /* (threads, B, hidden) each thread's norm output */
    float *xs;                               /* (threads, B, max K / 16) each thread's group sums */
    int64_t xs_stride;
    Barrier *barrier;
    int64_t num_chunks;                      /* C: runs of rows [chunks[i], chunks[i + 1]) */
    /* LoRA: row_slot NULL when no row has an adapter */
    const int64_t *row_slot;                 /* (B,) each row's slot, -1: the base model */
    const LoraProj *lora;                    /* (num_layers, LORA_PROJS) */
    int64_t lora_rank, lora_slots;           /* R and L of every stack */
    float *lora_t;                           /* (threads, B, R up to 16) */
    float *lora_xf;                          /* (threads, 4, K up to 16) */
    void *lora_bt;                           /* (threads, L, R up to 16, 16) float32, aligned */
    int64_t *lora_made;                      /* (threads, L) */
    int64_t lora_t_stride, lora_xf_stride, lora_bt_stride;  /* per thread, in elements */
    /* the head (head_w NULL: none): rows head_rows of the last layer's output through the
       final norm and the bfloat16 LM head (qgemm_bf16's packed layout, vocab rows) */
    const uint16_t *final_norm, *head_w;     /* (hidden,); (vocab / 16, hidden / 2, 32) */
    int64_t vocab;
    float head_eps;
    const int64_t *head_rows;                /* (head_count,) rows of the step */
    int64_t head_count;
    uint16_t *head_y;                        /* (head_count, vocab) the head's bfloat16 out */
    float *logits;                           /* (head_count, vocab) the same, as float32 */
} Step;

static void barrier_wait(Barrier *b, int64_t threads) {
    if (threads == 1) return;
    int gen = atomic_load_explicit(&b->generation, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == threads - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&b->generation, 1, memory_order_release);
        return;
    }
    /* spin while the other thread is about to arrive; yield the core if it is not
       running (a shared machine), so a preempted partner gets it back sooner */
    for (int spins = 0; atomic_load_explicit(&b->generation, memory_order_acquire) == gen;)
        if (++spins < 4000) CPU_RELAX(); else sched_yield();
}

/* torch's float sum of v (n,) as its CPU kernel adds it (aten/src/ATen/native/cpu/
   SumKernel.cpp, cascade_sum over a contiguous row): vectors of `lanes` floats (its
   Vectorized<float> where the sum kernel runs: 8 on torch 2.13's x86 builds, AVX-512
   machines included; decode.py finds it by comparing with torch once), the vectors taken four at a time into four accumulators
   (multi_row_sum: levels of 2^level_power), the leftover vectors into the first, the
   four summed in order, then the scalar tail from 0, then the lanes in order. */
static float sum_sq(const float *v, int64_t n, int64_t lanes) {
    float acc[4][4][16], part[4][16];
    const int64_t vecs = n / lanes, size = vecs / 4;
    int64_t ceil_log2 = 1;
    if (size > 2) while ((int64_t)1 << ceil_log2 < size) ceil_log2++;
    const int64_t power = ceil_log2 / 4 > 4 ? ceil_log2 / 4 : 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    memset(acc, 0, sizeof acc);
    int64_t i = 0;
#define ADD_ROW(dst, row)                                                                 \
    for (int r = 0; r < 4; r++)                                                           \
        for (int64_t l = 0; l < lanes; l++) dst[r][l] += v[((row) * 4 + r) * lanes + l];
    while (i + step <= size) {
        for (int64_t j = 0; j < step; j++, i++) ADD_ROW(acc[0], i)
        for (int lv = 1; lv < 4; lv++) {
            for (int r = 0; r < 4; r++)
                for (int64_t l = 0; l < lanes; l++) {
                    acc[lv][r][l] += acc[lv - 1][r][l];
                    acc[lv - 1][r][l] = 0.0f;
                }
            if (i & (mask << (lv * power))) break;
        }
    }
    for (; i < size; i++) ADD_ROW(acc[0], i)
#undef ADD_ROW
    for (int lv = 1; lv < 4; lv++)
        for (int r = 0; r < 4; r++)
            for (int64_t l = 0; l < lanes; l++) acc[0][r][l] += acc[lv][r][l];
    memcpy(part, acc[0], sizeof part);
    for (int64_t vi = size * 4; vi < vecs; vi++)
        for (int64_t l = 0; l < lanes; l++) part[0][l] += v[vi * lanes + l];
    for (int r = 1; r < 4; r++)
        for (int64_t l = 0; l < lanes; l++) part[0][l] += part[r][l];
    float total = 0.0f;
    for (int64_t t = vecs * lanes; t < n; t++) total += v[t];
    for (int64_t l = 0; l < lanes; l++) total += part[0][l];
    return total;
}

#define MAX_HIDDEN 16384

/* h = the norm of s = x (+ res_in) with weight w; res_out = s (when not NULL) */
static void rmsnorm_row(const uint16_t *x, const uint16_t *res_in, uint16_t *res_out,
                        const uint16_t *w, uint16_t *h, int64_t n, float eps, int64_t lanes) {
    float s32[MAX_HIDDEN], sq[MAX_HIDDEN];
    for (int64_t i = 0; i < n; i++) {
        uint16_t s = res_in ? to_bf(bf(x[i]) + bf(res_in[i])) : x[i];
        if (res_out) res_out[i] = s;
        s32[i] = bf(s);
        sq[i] = s32[i] * s32[i];
    }
    volatile float mean = sum_sq(sq, n, lanes) / (float)n;  /* volatile: each op rounds */
    volatile float var = mean + eps;
    volatile float root = sqrtf(var);
    const float r = 1.0f / root;
    for (int64_t i = 0; i < n; i++) h[i] = to_bf(bf(w[i]) * bf(to_bf(s32[i] * r)));
}

static void norm_rows(const Step *c, const uint16_t *x, const uint16_t *res_in,
                      uint16_t *res_out, const uint16_t *w, uint16_t *h) {
    const int64_t n = c->hidden;
    for (int64_t b = 0; b < c->batch; b++)
        rmsnorm_row(x + b * n, res_in ? res_in + b * n : NULL, res_out ? res_out + b * n : NULL,
                    w, h + b * n, n, c->eps, c->sum_lanes);
}

/* y[:, blocks [cb0, cb1)] = x (B, p->k) @ p, with x's group sums xs */
static void gemm(const Step *c, const Proj *p, const uint16_t *x, const float *xs,
                 uint16_t *y, int64_t ldy, int64_t cb0, int64_t cb1) {
    if (cb0 >= cb1) return;
    if (p->is_int8)
        qgemm_int8(x, p->k, (const int8_t *)p->w, (const uint16_t *)p->scales, y, ldy, 0,
                   c->batch, p->k, cb0, cb1);
    else
        qgemm_int4(x, p->k, (const uint8_t *)p->w, (const uint16_t *)p->scales, xs, y, ldy, 0,
                   c->batch, p->n, p->k, p->group, cb0, cb1);
}

static void sums(const Step *c, const Proj *p, const uint16_t *x, float *xs) {
    if (!p->is_int8) qgemm_group_sums(x, p->k, c->batch, p->k, p->group, xs);
}

/* thread t's share [lo, hi) of n items in contiguous ranges */
static inline void share(int64_t n, int64_t t, int64_t threads, int64_t *lo, int64_t *hi) {
    *lo = n * t / threads;
    *hi = n * (t + 1) / threads;
}

/* rope in place on one head's D values at position pos */
static void rope_head(uint16_t *x, const float *cs, const float *sn, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = bf(x[i]), b = bf(x[i + half]);
        float a_c = a * cs[i], b_s = b * -sn[i], b_c = b * cs[i], a_s = a * sn[i];
        x[i] = to_bf(a_c + b_s);
        x[i + half] = to_bf(b_c + a_s);
    }
}

/* rope on the q heads of kv head g and on k head g of row b, then k, v to the pool */
static void rope_and_store(const Step *c, const Layer *ly, int64_t b, int64_t g) {
    const int64_t d = c->head_dim, group = c->heads / c->kv_heads;
    const int64_t q_size = c->heads * d, kv_size = c->kv_heads * d;
    uint16_t *row = c->qkv + b * (q_size + 2 * kv_size);
    const int64_t pos = c->positions[b];
    const float *cs = c->cos + pos * (d / 2), *sn = c->sin + pos * (d / 2);
    for (int64_t i = 0; i < group; i++) rope_head(row + (g * group + i) * d, cs, sn, d);
    uint16_t *k = row + q_size + g * d, *v = row + q_size + kv_size + g * d;
    rope_head(k, cs, sn, d);
    const int64_t slot = c->slots[b];
    if (slot < 0) return;
    memcpy((uint16_t *)ly->k_cache + (slot * c->kv_heads + g) * d, k, d * 2);
    memcpy((uint16_t *)ly->v_cache + (slot * c->kv_heads + g) * d, v, d * 2);
}

/* Whether the step adds p's updates: as the torch path (LoraBatch.add), a projection that
   none of the step's adapters adapts is skipped, and one that any adapts gets every
   adapter row's update (an adapter that does not adapt it has zeros in its slot). */
static int lora_takes(const Step *c, const LoraProj *p) {
    if (!p->a) return 0;
    for (int64_t i = 0; i < c->batch; i++)
        if (c->row_slot[i] >= 0 && p->holds[c->row_slot[i]]) return 1;
    return 0;
}

/* y += each adapter row's update of the projections [first, first + count) of the LoRA
   table (a layer's LORA_PROJS entries, then the next layer's), segments of one fused
   output y (B, ldy) of input x (B, k), on this thread's output columns: the ranges
   [cols[2 q], cols[2 q + 1]) for q < num_ranges. lora.c's arithmetic, the same bits as
   lora_apply on the torch path's projection output. Each thread computes the shrink
   t = a @ x of every adapter row itself (no barrier), for a projection it has columns of. */
static void lora_add(const Step *c, int64_t first, int64_t count, const uint16_t *x,
                     int64_t k, uint16_t *y, int64_t ldy, const int64_t *cols,
                     int64_t num_ranges, int64_t t) {
    if (!c->row_slot || !c->lora) return;
    const LoraProj *p = c->lora + first;
    float *tb = c->lora_t + t * c->lora_t_stride, *xf = c->lora_xf + t * c->lora_xf_stride;
    void *bt = (float *)c->lora_bt + t * c->lora_bt_stride;
    int64_t *made = c->lora_made + t * c->lora_slots;
    for (int64_t e = 0; e < count; e++, p++) {
        int64_t lo[2], hi[2], mine = 0;  /* this thread's columns of p, from p's start */
        for (int64_t q = 0; q < num_ranges; q++) {
            lo[q] = (cols[2 * q] > p->start ? cols[2 * q] : p->start) - p->start;
            hi[q] = (cols[2 * q + 1] < p->start + p->width ? cols[2 * q + 1]
                                                           : p->start + p->width) - p->start;
            mine |= lo[q] < hi[q];
        }
        if (!mine || !lora_takes(c, p)) continue;
        lora_shrink_rows(x, k, p->a, c->row_slot, tb, k, c->lora_rank, 1, 0, c->batch, xf);
        for (int64_t q = 0; q < num_ranges; q++)
            if (lo[q] < hi[q])
                lora_expand_cols(tb, p->b, p->b_ls, p->b_lm, p->b_lr, p->scaling, c->row_slot,
                                 y + p->start, ldy, c->batch, c->lora_rank, c->lora_slots, 1,
                                 lo[q], hi[q], bt, made);
    }
}

static void layer(const Step *c, const Layer *ly, int64_t index, int64_t t, int64_t threads) {
    const int64_t B = c->batch, n = c->hidden, d = c->head_dim, inter = c->inter;
    const int64_t qkv_n = ly->qkv.n, q_size = c->heads * d;
    const int64_t lp = index * LORA_PROJS;  /* the layer's LoRA entries */
    uint16_t *h = c->h + t * B * n;
    float *xs = c->xs + t * B * c->xs_stride;
    /* the residual stream lives in residual[0] between layers and in residual[1] between
       a layer's two norms: each norm reads one and writes the other */
    uint16_t *res_a = c->residual[0], *res_b = c->residual[1];
    int64_t lo, hi;
    /* input norm: x (+ the residual) → h; the residual → res_b (thread 0) */
    norm_rows(c, c->x, index ? res_a : NULL, t == 0 ? res_b : NULL, ly->input_norm, h);
    sums(c, &ly->qkv, h, xs);
    share(qkv_n / 16, t, threads, &lo, &hi);
    gemm(c, &ly->qkv, h, xs, c->qkv, qkv_n, lo, hi);
    lora_add(c, lp, 3, h, n, c->qkv, qkv_n, (int64_t[]){16 * lo, 16 * hi}, 1, t);  /* q, k, v */
    barrier_wait(c->barrier, threads);
    /* rope and store: items (row, kv head), strided over the threads; then, once every
       row's K/V is in the pool, attention: items (chunk, kv heads), strided likewise */
    for (int64_t i = t; i < B * c->kv_heads; i += threads)
        rope_and_store(c, ly, i / c->kv_heads, i % c->kv_heads);
    barrier_wait(c->barrier, threads);
    const int64_t item_heads = attention_item_heads(c->num_chunks, c->kv_heads, threads);
    paged_attention(c->qkv, qkv_n, d, ly->k_cache, ly->v_cache, c->attn, c->row_seq, c->row_pos,
                    c->page_table, c->table_stride, c->page_size, c->heads, c->kv_heads, d, 0,
                    c->scale, 1, c->chunks, item_heads,
                    t, c->num_chunks * (item_heads > 0 ? c->kv_heads / item_heads : -item_heads),
                    threads);
    barrier_wait(c->barrier, threads);
    sums(c, &ly->o, c->attn, xs);
    share(n / 16, t, threads, &lo, &hi);
    gemm(c, &ly->o, c->attn, xs, c->proj, n, lo, hi);
    lora_add(c, lp + 3, 1, c->attn, q_size, c->proj, n, (int64_t[]){16 * lo, 16 * hi}, 1, t);
    barrier_wait(c->barrier, threads);
    /* post norm: attn (+ res_b) → h; the residual → res_a (thread 0; nobody reads res_a
       any more this layer) */
    norm_rows(c, c->proj, res_b, t == 0 ? res_a : NULL, ly->post_norm, h);
    /* gate and up columns of the same share, then silu(gate) * up of those columns */
    sums(c, &ly->gate_up, h, xs);
    share(inter / 16, t, threads, &lo, &hi);
    gemm(c, &ly->gate_up, h, xs, c->gate_up, 2 * inter, lo, hi);
    gemm(c, &ly->gate_up, h, xs, c->gate_up, 2 * inter, inter / 16 + lo, inter / 16 + hi);
    lora_add(c, lp + 4, 2, h, n, c->gate_up, 2 * inter,  /* gate, up */
             (int64_t[]){16 * lo, 16 * hi, inter + 16 * lo, inter + 16 * hi}, 2, t);
    for (int64_t b = 0; b < B; b++) {
        const uint16_t *gate = c->gate_up + b * 2 * inter, *up = gate + inter;
        uint16_t *a = c->act + b * inter;
        for (int64_t j = 16 * lo; j < 16 * hi; j++) a[j] = to_bf(bf(c->silu[gate[j]]) * bf(up[j]));
    }
    barrier_wait(c->barrier, threads);
    sums(c, &ly->down, c->act, xs);
    share(n / 16, t, threads, &lo, &hi);
    gemm(c, &ly->down, c->act, xs, c->x, n, lo, hi);
    lora_add(c, lp + 6, 1, c->act, inter, c->x, n, (int64_t[]){16 * lo, 16 * hi}, 1, t);
    barrier_wait(c->barrier, threads);
}

/* The logits of the head's rows, as `LlamaModel.logits` makes them: the final norm of
   (x, residual) (every thread all the rows, into its own buffer), the LM head's bfloat16
   product (the thread's share of its column blocks) and that widened to float32. */
static void head(const Step *c, int64_t t, int64_t threads) {
    const int64_t n = c->hidden, rows = c->head_count, vocab = c->vocab;
    uint16_t *h = c->h + t * c->batch * n;
    for (int64_t i = 0; i < rows; i++) {
        const int64_t r = c->head_rows[i];
        rmsnorm_row(c->x + r * n, c->residual[0] + r * n, NULL, c->final_norm, h + i * n, n,
                    c->head_eps, c->sum_lanes);
    }
    int64_t lo, hi;
    share(vocab / 16, t, threads, &lo, &hi);
    if (lo >= hi) return;
    qgemm_bf16(h, n, c->head_w, c->head_y, vocab, 0, rows, n, lo, hi);
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 16 * lo; j < 16 * hi; j++)
            c->logits[i * vocab + j] = bf(c->head_y[i * vocab + j]);
}

/* Thread t of `threads`: every layer, then the head where the step has one. After it, x
   holds the last layer's output and residual[0] the residual stream before it (the
   torch path's (x, residual) pair, for the final norm). */
void decode_step(const Step *c, int64_t t, int64_t threads) {
    for (int64_t i = 0; i < c->num_layers; i++) layer(c, c->layers + i, i, t, threads);
    if (c->head_w != NULL) head(c, t, threads);
}

/* sum_sq alone, for choosing `lanes` (the one that reproduces torch's sum here) */
float decode_sum(const float *v, int64_t n, int64_t lanes) { return sum_sq(v, n, lanes); }

int64_t decode_step_size(void) { return (int64_t)sizeof(Step); }
int64_t decode_layer_size(void) { return (int64_t)sizeof(Layer); }
