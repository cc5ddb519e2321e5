/* Paged attention on CPU, batch-invariant: one query row over its sequence's keys in the
   paged pool, read in place through the page table; extend (many rows of a sequence) and
   decode (one) are the same code.

   The arithmetic of one (query row, head), at position p, over keys start .. p
   (start = max(0, p - window + 1) with a sliding window, else 0), is fixed, and the same
   in every path (AVX-512, AVX2, plain C) whatever the other rows, the chunking of rows,
   the page size or the threads:

     m = -inf, l = 0, acc[0 .. D) = 0          (float32; q, k, v read exactly as float32)
     for each block of 16 key positions [16 b, 16 b + 16) meeting [start, p], in order:
       s[t] = tree16(part) * scale, part[j] = the fma chain from 0 of q[e] * k_t[e] over
              e = 32 c + 2 j + 1, then 32 c + 2 j, for each pair chunk c < D / 32 in order,
              then (D % 32 = 16) e = D - 16 + j; s[t] = -inf off [start, p]
       m' = max(m, max_t s[t]); alpha = exp(m - m'); e[t] = exp(s[t] - m')
       l = fma(l, alpha, tree16(e))
       acc[d] = acc[d] * alpha, then acc[d] = fma(e[t], v_t[d], acc[d]) for t = 0 .. 15
              with e[t] != 0 (a key that adds nothing is skipped: 0 * v could turn -0 to +0)
       m = m'
     out = acc / l, rounded to the output dtype (nearest even)

   tree16(v): v[j] += v[j + h] for h = 8, 4, 2, 1 (j < h); the result is v[0]. exp is the
   polynomial below (Cephes' expf), identical in every path; denormals are flushed (DAZ
   and FTZ) for the call. Keys off [start, p] in a block are never read (zeros stand in).

   The pair order of q . k is `vdpbf16ps`': per lane, the odd element of a pair, then the
   even one, each product exact (bfloat16 inputs) and each sum rounded, so an AVX-512 BF16
   build takes a bfloat16 pool's keys as they lie, with no widening copy. Every other path
   widens the keys into float32 rows in the virtual order of `perm_dim` (a 32-chunk's odd
   elements, then its even ones) and q once likewise, and runs its fma chains over those
   rows in 16-lane chunks: the same chain, the same bits.

   Work is split by the caller over items (a run of rows of one sequence, and one kv head,
   all of them, or a contiguous part of the q heads where there are fewer runs than
   threads): each (row, head) is computed by one thread, whole. An item of all
   the kv heads reads each block of the sequence's keys once, whole (its heads lie side
   by side in the pool), where an item per kv head reads a third of each line run per
   pass; the keys two blocks ahead are prefetched. Neither changes a bit. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define KEYS 16
#define MAX_DIM 256

static inline float bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t float_to_bf16(float f) {  /* round to nearest even; NaN stays NaN */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* exp(x) for x <= 0 (-inf included), Cephes expf: x = n ln2 + r, |r| <= ln2 / 2 */
#define EXP_FLOOR -87.0f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
#define ROUND_MAGIC 12582912.0f /* 1.5 * 2^23: (t + M) - M rounds t to an integer */
#define P0 1.9875691500e-4f
#define P1 1.3981999507e-3f
#define P2 8.3334519073e-3f
#define P3 4.1665795894e-2f
#define P4 1.6666665459e-1f
#define P5 5.0000001201e-1f

static inline float exp_plain(float x) {
    if (!(x >= EXP_FLOOR)) return 0.0f;
    volatile float t = x * LOG2E;  /* volatile: the two roundings as written */
    volatile float shifted = t + ROUND_MAGIC;
    float n = shifted - ROUND_MAGIC;
    float r = fmaf(n, -LN2_HI, x);
    r = fmaf(n, -LN2_LO, r);
    float p = fmaf(P0, r, P1);
    p = fmaf(p, r, P2); p = fmaf(p, r, P3); p = fmaf(p, r, P4); p = fmaf(p, r, P5);
    float y = fmaf(p, r * r, r) + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale; memcpy(&scale, &bits, 4);
    return y * scale;
}

static inline float tree16(const float *in) {
    float v[16];
    memcpy(v, in, sizeof v);
    for (int h = 8; h >= 1; h /= 2)
        for (int j = 0; j < h; j++) v[j] += v[j + h];
    return v[0];
}

/* What one call attends: the step's query rows and the pool they read. */
typedef struct {
    const void *q; int64_t q_row, q_head;        /* (T, H, D): element strides */
    const void *k_cache, *v_cache;               /* (P, page_size, H_kv, D) contiguous */
    void *out;                                   /* (T, H, D) contiguous */
    const int64_t *row_seq, *row_pos;            /* (T,): sequence and position; pos -1 = padding */
    const int64_t *page_table; int64_t table_stride;
    int64_t page_size, heads, kv_heads, dim, window;
    float scale;
    int bf16;
} Call;

typedef struct { float m, l, acc[MAX_DIM]; } State;

static inline float load_at(const void *base, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

typedef uint32_t __attribute__((may_alias)) word32;  /* a float's bits, read or written */

/* the element of a row of d that lies at v in the pair order: in each whole 32-chunk its
   16 odd elements, then its 16 even ones; a 16-element tail as it is */
static inline int64_t perm_dim(int64_t v, int64_t d) {
    if (v >= d / 32 * 32) return v;
    const int64_t r = v % 32, base = v - r;
    return r < 16 ? base + 2 * r + 1 : base + 2 * (r - 16);
}

/* row (d elements at `at`) widened into float32 in the pair order */
static inline void load_row_paired(const void *base, int64_t at, int64_t d, int bf16,
                                   float *out) {
    if (bf16) {  /* a bfloat16 pair is one 32-bit word: odd in the high half, even low */
        const word32 *w = (const word32 *)((const uint16_t *)base + at);
        word32 *o = (word32 *)out;
        const int64_t whole = d / 32 * 32;
        for (int64_t c = 0; c < whole; c += 32) {  /* a mask and a shift */
#if defined(__AVX512F__)
            __m512i x = _mm512_loadu_si512(w + c / 2);
            _mm512_storeu_si512(o + c, _mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u)));
            _mm512_storeu_si512(o + c + 16, _mm512_slli_epi32(x, 16));
#elif defined(__AVX2__)
            for (int h = 0; h < 16; h += 8) {
                __m256i x = _mm256_loadu_si256((const __m256i *)(w + c / 2 + h));
                _mm256_storeu_si256((__m256i *)(o + c + h),
                                    _mm256_and_si256(x, _mm256_set1_epi32((int)0xFFFF0000u)));
                _mm256_storeu_si256((__m256i *)(o + c + 16 + h), _mm256_slli_epi32(x, 16));
            }
#else
            for (int j = 0; j < 16; j++) {
                o[c + j] = w[c / 2 + j] & 0xFFFF0000u;
                o[c + 16 + j] = w[c / 2 + j] << 16;
            }
#endif
        }
        for (int64_t e = whole; e < d; e++) out[e] = load_at(base, at + e, 1);
    } else {
        for (int64_t e = 0; e < d; e++) out[e] = ((const float *)base)[at + perm_dim(e, d)];
    }
}

#define PREFETCH_BLOCKS 2 /* key j's K/V rows are asked for (into L2) as key j - 32 loads */

/* keys [16 blk, 16 blk + 16) of sequence `seq`, kv head g, as float32 rows (zeros
   outside [lo, hi]); the same keys of block blk + PREFETCH_BLOCKS are prefetched, one
   key at a time, so their reads overlap this block's work (no effect on any result) */
static void load_block(const Call *c, int64_t seq, int64_t g, int64_t blk, int64_t lo,
                       int64_t hi, float *kb, float *vb) {
    const int64_t d = c->dim;
    const int64_t *pages = c->page_table + seq * c->table_stride;
    int64_t index = blk * KEYS / c->page_size, slot = blk * KEYS % c->page_size;
    for (int t = 0; t < KEYS; t++, slot++) {  /* (index, slot): key j's page and slot */
        if (slot == c->page_size) index++, slot = 0;
        int64_t j = blk * KEYS + t;
        if (j < lo || j > hi) {
            memset(kb + t * d, 0, d * sizeof(float));
            memset(vb + t * d, 0, d * sizeof(float));
            continue;
        }
        int64_t at = ((pages[index] * c->page_size + slot) * c->kv_heads + g) * d;
        const int64_t ahead = j + PREFETCH_BLOCKS * KEYS;
        if (ahead <= hi) {
            const int64_t bytes = d * (c->bf16 ? 2 : 4);
            const int64_t far = ((pages[ahead / c->page_size] * c->page_size +
                                  ahead % c->page_size) * c->kv_heads + g) * bytes;
            for (int64_t o = 0; o < bytes; o += 64) {
                __builtin_prefetch((const char *)c->k_cache + far + o, 0, 1);
                __builtin_prefetch((const char *)c->v_cache + far + o, 0, 1);
            }
        }
        load_row_paired(c->k_cache, at, d, c->bf16, kb + t * d);
        if (c->bf16) {  /* a loop the compiler vectorizes: widen and shift */
            const uint16_t *v = (const uint16_t *)c->v_cache + at;
            for (int64_t e = 0; e < d; e++) vb[t * d + e] = bf16_to_float(v[e]);
        } else {
            memcpy(vb + t * d, (const float *)c->v_cache + at, d * sizeof(float));
        }
    }
}

/* --- one block's update of one (row, head): plain C, the definition ---------------- */

__attribute__((unused)) static void update_plain(
    const float *q, const float *kb, const float *vb, int64_t d, float scale, int64_t lo,
    int64_t hi, int64_t first, State *st) {
    float s[KEYS], e[KEYS], block_max = -INFINITY;
    for (int t = 0; t < KEYS; t++) {
        int64_t j = first + t;
        float part[16] = {0};
        for (int64_t c = 0; c < d; c += 16)
            for (int i = 0; i < 16; i++) part[i] = fmaf(q[c + i], kb[t * d + c + i], part[i]);
        s[t] = (j < lo || j > hi) ? -INFINITY : tree16(part) * scale;
        block_max = fmaxf(block_max, s[t]);
    }
    float m = fmaxf(st->m, block_max);
    float alpha = exp_plain(st->m - m);
    for (int t = 0; t < KEYS; t++) e[t] = exp_plain(s[t] - m);
    st->l = fmaf(st->l, alpha, tree16(e));
    for (int64_t i = 0; i < d; i++) {
        float a = st->acc[i] * alpha;
        for (int t = 0; t < KEYS; t++)
            if (e[t] != 0.0f) a = fmaf(e[t], vb[t * d + i], a);
        st->acc[i] = a;
    }
    st->m = m;
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define ATTENTION_PATH "avx512"
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define DOT_BF16 1 /* q . k of bfloat16 pools by vdpbf16ps (the pair order above) */
#endif

/* 16 bfloat16 values as float32 (exact) */
static inline __m512 widen16(const uint16_t *x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x)), 16));
}
/* --- AVX-512: 16 lanes are one vector. The 16 keys' partial sums are reduced together,
   two vectors at a time, halving lanes as tree16 does (j + 8, + 4, + 2, + 1); the keys
   enter in the order that leaves key t in lane t. --------------------------------- */

static inline __m512 exp_512(__m512 x) {
    __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_FLOOR), _CMP_GE_OQ);
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(LOG2E));
    __m512 n = _mm512_sub_ps(_mm512_add_ps(t, _mm512_set1_ps(ROUND_MAGIC)),
                             _mm512_set1_ps(ROUND_MAGIC));
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(P0), r, _mm512_set1_ps(P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P5));
    __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_maskz_mov_ps(live, n)), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(live, y, _mm512_castsi512_ps(bits));
}

/* lanes (j, j + 8) of a and b: [a 0..7 sums, b 0..7 sums] */
static inline __m512 halve8(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
/* each 8-lane half: lanes (j, j + 4) */
static inline __m512 halve4(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
/* each 4-lane quarter: lanes (j, j + 2) */
static inline __m512 halve2(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
}
/* each 2-lane pair: lanes (j, j + 1) */
static inline __m512 halve1(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

static inline float tree16_512(__m512 v) {
    __m256 h8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
    __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
    __m128 h1 = _mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1));
    return _mm_cvtss_f32(h1);
}

/* The body, inlined with d a constant where it is one (64, 128: the loops unroll, q and
   the accumulators stay in registers). The arithmetic is the same for every d. */
static inline __attribute__((always_inline)) void update_512_body(
    const float *q, const float *kb, const float *vb, const int64_t d, float scale,
    int64_t lo, int64_t hi, int64_t first, State *st, const uint16_t *q16,
    const uint16_t *const *kp) {
    __m512 part[KEYS];
    for (int i = 0; i < KEYS; i++) {
        const int t = 4 * (i % 4) + i / 4;  /* key t's sums in part[i] */
        __m512 acc = _mm512_setzero_ps();
        if (kp != NULL) {  /* the keys in place (bfloat16), a pair a lane per vdpbf16ps */
#if defined(DOT_BF16)
            const int64_t whole = d / 32 * 32;
            for (int64_t c = 0; c < whole; c += 32)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q16 + c),
                                       (__m512bh)_mm512_loadu_si512(kp[t] + c));
            if (whole < d)  /* the tail, widened: q's is float32 in q already */
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + whole), widen16(kp[t] + whole), acc);
#endif
        } else {
            for (int64_t c = 0; c < d; c += 16)
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), _mm512_loadu_ps(kb + t * d + c), acc);
        }
        part[i] = acc;
    }
    __m512 a[8], b[4], c2[2];
    for (int i = 0; i < 8; i++) a[i] = halve8(part[2 * i], part[2 * i + 1]);
    for (int i = 0; i < 4; i++) b[i] = halve4(a[2 * i], a[2 * i + 1]);
    for (int i = 0; i < 2; i++) c2[i] = halve2(b[2 * i], b[2 * i + 1]);
    __m512 s = _mm512_mul_ps(halve1(c2[0], c2[1]), _mm512_set1_ps(scale));
    __m512i j = _mm512_add_epi32(_mm512_set1_epi32((int)first),
                                 _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    __mmask16 in = _mm512_cmp_epi32_mask(j, _mm512_set1_epi32((int)lo), _MM_CMPINT_NLT) &
                   _mm512_cmp_epi32_mask(j, _mm512_set1_epi32((int)hi), _MM_CMPINT_LE);
    s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), in, s);
    float m = fmaxf(st->m, _mm512_reduce_max_ps(s));
    float alpha = _mm_cvtss_f32(_mm512_castps512_ps128(exp_512(_mm512_set1_ps(st->m - m))));
    __m512 e = exp_512(_mm512_sub_ps(s, _mm512_set1_ps(m)));
    st->l = fmaf(st->l, alpha, tree16_512(e));
    float ev[KEYS];
    _mm512_storeu_ps(ev, e);
    /* acc[i] * alpha, then fma(e[t], v_t[i], .) for t in order, keys with e[t] = 0
       skipped: keys outer, the row's accumulators held across them */
    __m512 acc[MAX_DIM / 16];
    for (int64_t c = 0; c < d / 16; c++)
        acc[c] = _mm512_mul_ps(_mm512_loadu_ps(st->acc + 16 * c), _mm512_set1_ps(alpha));
    __mmask16 live = _mm512_cmp_ps_mask(e, _mm512_setzero_ps(), _CMP_NEQ_UQ);
    for (int t = 0; t < KEYS; t++) {
        if (!((live >> t) & 1)) continue;
        __m512 w = _mm512_set1_ps(ev[t]);
        for (int64_t c = 0; c < d / 16; c++)
            acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vb + t * d + 16 * c), acc[c]);
    }
    for (int64_t c = 0; c < d / 16; c++) _mm512_storeu_ps(st->acc + 16 * c, acc[c]);
    st->m = m;
}

static void update_512(const float *q, const float *kb, const float *vb, int64_t d,
                       float scale, int64_t lo, int64_t hi, int64_t first, State *st) {
    switch (d) {
    case 64: update_512_body(q, kb, vb, 64, scale, lo, hi, first, st, NULL, NULL); break;
    case 128: update_512_body(q, kb, vb, 128, scale, lo, hi, first, st, NULL, NULL); break;
    default: update_512_body(q, kb, vb, d, scale, lo, hi, first, st, NULL, NULL);
    }
}
#define UPDATE update_512

#if defined(DOT_BF16)
/* update_512 with the keys read in place: kp[t] key t's bfloat16 row (a zero row off
   [lo, hi]), q16 the query as it lies */
static void update_512_pairs(const float *q, const uint16_t *q16, const uint16_t *const *kp,
                             const float *vb, int64_t d, float scale, int64_t lo, int64_t hi,
                             int64_t first, State *st) {
    switch (d) {
    case 64: update_512_body(q, NULL, vb, 64, scale, lo, hi, first, st, q16, kp); break;
    case 128: update_512_body(q, NULL, vb, 128, scale, lo, hi, first, st, q16, kp); break;
    default: update_512_body(q, NULL, vb, d, scale, lo, hi, first, st, q16, kp);
    }
}

static const uint16_t ZERO_ROW[MAX_DIM];

/* load_block for a bfloat16 pool read by vdpbf16ps: key t's K row found in place (kp[t],
   ZERO_ROW off [lo, hi]), V widened into vb as load_block does; the same prefetch. A loop
   of its own: load_block with a flag for it measured 1.3-1.5x slower (30 layers at 2k). */
static void load_block_pairs(const Call *c, int64_t seq, int64_t g, int64_t blk, int64_t lo,
                             int64_t hi, const uint16_t **kp, float *vb) {
    const int64_t d = c->dim;
    const int64_t *pages = c->page_table + seq * c->table_stride;
    const uint16_t *k_cache = c->k_cache, *v_cache = c->v_cache;
    int64_t index = blk * KEYS / c->page_size, slot = blk * KEYS % c->page_size;
    for (int t = 0; t < KEYS; t++, slot++) {  /* (index, slot): key j's page and slot */
        if (slot == c->page_size) index++, slot = 0;
        int64_t j = blk * KEYS + t;
        if (j < lo || j > hi) {
            kp[t] = ZERO_ROW;
            for (int64_t e = 0; e < d; e += 16) _mm512_storeu_ps(vb + t * d + e, _mm512_setzero_ps());
            continue;
        }
        int64_t at = ((pages[index] * c->page_size + slot) * c->kv_heads + g) * d;
        const int64_t ahead = j + PREFETCH_BLOCKS * KEYS;
        if (ahead <= hi) {
            const int64_t far = ((pages[ahead / c->page_size] * c->page_size +
                                  ahead % c->page_size) * c->kv_heads + g) * d;
            for (int64_t o = 0; o < d; o += 32) {
                __builtin_prefetch(k_cache + far + o, 0, 1);
                __builtin_prefetch(v_cache + far + o, 0, 1);
            }
        }
        kp[t] = k_cache + at;
        for (int64_t e = 0; e < d; e += 16) _mm512_storeu_ps(vb + t * d + e, widen16(v_cache + at + e));
    }
}
#endif

#elif defined(__AVX2__) && defined(__FMA__)
#define ATTENTION_PATH "avx2"
/* --- AVX2: a 16-lane vector is two halves of 8; tree16 per key. ------------------- */

static inline __m256 exp_256(__m256 x) {
    __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_FLOOR), _CMP_GE_OQ);
    __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(LOG2E));
    __m256 n = _mm256_sub_ps(_mm256_add_ps(t, _mm256_set1_ps(ROUND_MAGIC)),
                             _mm256_set1_ps(ROUND_MAGIC));
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(P0), r, _mm256_set1_ps(P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P5));
    __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_and_ps(live, n)), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(live, _mm256_mul_ps(y, _mm256_castsi256_ps(bits)));
}

static inline float tree16_256(__m256 lo, __m256 hi) {
    __m256 h8 = _mm256_add_ps(lo, hi);
    __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
    __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
    __m128 h1 = _mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1));
    return _mm_cvtss_f32(h1);
}

static void update_256(const float *q, const float *kb, const float *vb, int64_t d,
                       float scale, int64_t lo, int64_t hi, int64_t first, State *st) {
    float s[KEYS], block_max = -INFINITY;
    for (int t = 0; t < KEYS; t++) {
        const float *k = kb + t * d;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (int64_t c = 0; c < d; c += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(k + c), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + c + 8), _mm256_loadu_ps(k + c + 8), a1);
        }
        int64_t j = first + t;
        s[t] = (j < lo || j > hi) ? -INFINITY : tree16_256(a0, a1) * scale;
        block_max = fmaxf(block_max, s[t]);
    }
    float m = fmaxf(st->m, block_max);
    float alpha = _mm256_cvtss_f32(exp_256(_mm256_set1_ps(st->m - m)));
    __m256 e0 = exp_256(_mm256_sub_ps(_mm256_loadu_ps(s), _mm256_set1_ps(m)));
    __m256 e1 = exp_256(_mm256_sub_ps(_mm256_loadu_ps(s + 8), _mm256_set1_ps(m)));
    st->l = fmaf(st->l, alpha, tree16_256(e0, e1));
    float ev[KEYS];
    _mm256_storeu_ps(ev, e0);
    _mm256_storeu_ps(ev + 8, e1);
    for (int64_t c = 0; c < d; c += 8) {
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(st->acc + c), _mm256_set1_ps(alpha));
        for (int t = 0; t < KEYS; t++)
            if (ev[t] != 0.0f)
                acc = _mm256_fmadd_ps(_mm256_set1_ps(ev[t]), _mm256_loadu_ps(vb + t * d + c), acc);
        _mm256_storeu_ps(st->acc + c, acc);
    }
    st->m = m;
}
#define UPDATE update_256

#else
#define ATTENTION_PATH "plain"
#define UPDATE update_plain
#endif

/* rows [r0, r1) of one sequence (positions increasing), q heads [qa, qb) */
static void attend_item(const Call *c, int64_t r0, int64_t r1, int64_t qa, int64_t qb) {
    const int64_t d = c->dim, group = c->heads / c->kv_heads, rows = r1 - r0;
    const int64_t seq = c->row_seq[r0], per = qb - qa; /* q heads of the item */
    if (per <= 0) return;
    int64_t lo = INT64_MAX, hi = -1;
    for (int64_t r = r0; r < r1; r++) {
        int64_t p = c->row_pos[r];
        if (p < 0) continue;
        int64_t start = c->window > 0 && p - c->window + 1 > 0 ? p - c->window + 1 : 0;
        lo = start < lo ? start : lo;
        hi = p > hi ? p : hi;
    }
    State *st = malloc(sizeof(State) * rows * per);
    float *q = malloc(sizeof(float) * rows * per * d);
    float *kb = malloc(sizeof(float) * 2 * KEYS * d), *vb = kb + KEYS * d;
#if defined(DOT_BF16)
    const uint16_t *kp[KEYS];  /* a bfloat16 pool's keys are read where they lie */
    const uint16_t *q16 = c->bf16 ? c->q : NULL;
#endif
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < per; i++) {
            State *s = st + r * per + i;
            s->m = -INFINITY;
            s->l = 0.0f;
            memset(s->acc, 0, d * sizeof(float));
            int64_t at = (r0 + r) * c->q_row + (qa + i) * c->q_head;
            load_row_paired(c->q, at, d, c->bf16, q + (r * per + i) * d);
        }
    for (int64_t blk = hi < 0 ? 0 : lo / KEYS; hi >= 0 && blk <= hi / KEYS; blk++)
        for (int64_t g = qa / group; g <= (qb - 1) / group; g++) {
#if defined(DOT_BF16)
            if (q16 != NULL) load_block_pairs(c, seq, g, blk, lo, hi, kp, vb);
            else
#endif
                load_block(c, seq, g, blk, lo, hi, kb, vb);
            for (int64_t r = 0; r < rows; r++) {
                int64_t p = c->row_pos[r0 + r];
                int64_t start = c->window > 0 && p - c->window + 1 > 0 ? p - c->window + 1 : 0;
                if (p < 0 || blk < start / KEYS || blk > p / KEYS) continue;
                const int64_t h0 = g * group > qa ? g * group : qa;
                const int64_t h1 = (g + 1) * group < qb ? (g + 1) * group : qb;
                for (int64_t i = h0 - qa; i < h1 - qa; i++) {
#if defined(DOT_BF16)
                    if (q16 != NULL) {
                        const int64_t at = (r0 + r) * c->q_row + (qa + i) * c->q_head;
                        update_512_pairs(q + (r * per + i) * d, q16 + at, kp, vb, d, c->scale,
                                         start, p, blk * KEYS, st + r * per + i);
                        continue;
                    }
#endif
                    UPDATE(q + (r * per + i) * d, kb, vb, d, c->scale, start, p, blk * KEYS,
                           st + r * per + i);
                }
            }
        }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < per; i++) {
            const State *s = st + r * per + i;
            int64_t at = ((r0 + r) * c->heads + qa + i) * d;
            int valid = c->row_pos[r0 + r] >= 0;
            for (int64_t e = 0; e < d; e++) {
                float v = valid ? s->acc[e] / s->l : 0.0f;
                if (c->bf16) ((uint16_t *)c->out)[at + e] = float_to_bf16(v);
                else ((float *)c->out)[at + e] = v;
            }
        }
    free(kb);
    free(q);
    free(st);
}

#if defined(__x86_64__) || defined(__i386__)
#define FLUSH_BEGIN unsigned int csr_ = _mm_getcsr(); _mm_setcsr(csr_ | 0x8040u);
#define FLUSH_END _mm_setcsr(csr_);
#else
#define FLUSH_BEGIN
#define FLUSH_END
#endif

const char *attention_path(void) { return ATTENTION_PATH; }

/* kv heads per item for `chunks` runs of rows on `threads` threads: all of them where
   the chunks alone keep every thread busy; else -threads: each chunk's q heads in
   `threads` contiguous parts, one per thread (a kv head's keys are read by at most two
   threads, and the threads' shares differ by one q head at most) */
int64_t attention_item_heads(int64_t chunks, int64_t kv_heads, int64_t threads) {
    return threads <= 1 || chunks >= 2 * threads ? kv_heads : -threads;
}

/* Items item_begin, item_begin + item_step, ... below item_end of chunks x head groups
   (the caller's threads take interleaved strides: later rows cost more). With item_heads
   > 0 (1 or kv_heads) a group is item_heads kv heads (per = kv_heads / item_heads groups
   a chunk): item i is rows [chunks[i / per], chunks[i / per + 1]) (one sequence's), kv
   heads [(i % per) item_heads, (i % per + 1) item_heads). With item_heads = -n a chunk's
   heads are n groups of contiguous q heads (per = n): group j is q heads
   [heads j / n, heads (j + 1) / n). out (T, H, D) in the dtype of q and the caches
   (bfloat16 or float32). */
void paged_attention(const void *q, int64_t q_row, int64_t q_head, const void *k_cache,
                     const void *v_cache, void *out, const int64_t *row_seq,
                     const int64_t *row_pos, const int64_t *page_table, int64_t table_stride,
                     int64_t page_size, int64_t heads, int64_t kv_heads, int64_t dim,
                     int64_t window, double scale, int64_t bf16, const int64_t *chunks,
                     int64_t item_heads, int64_t item_begin, int64_t item_end,
                     int64_t item_step) {
    Call c = {q, q_row, q_head, k_cache, v_cache, out, row_seq, row_pos, page_table,
              table_stride, page_size, heads, kv_heads, dim, window, (float)scale, (int)bf16};
    FLUSH_BEGIN
    const int64_t per = item_heads > 0 ? kv_heads / item_heads : -item_heads;
    const int64_t group = heads / kv_heads;
    for (int64_t i = item_begin; i < item_end; i += item_step) {
        const int64_t j = i % per;
        if (item_heads > 0)
            attend_item(&c, chunks[i / per], chunks[i / per + 1], j * item_heads * group,
                        (j + 1) * item_heads * group);
        else
            attend_item(&c, chunks[i / per], chunks[i / per + 1], heads * j / per,
                        heads * (j + 1) / per);
    }
    FLUSH_END
}
