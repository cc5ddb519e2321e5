/* The batched LoRA matmul, batch-invariant: for each row i whose slot s = row_slot[i] is
   not -1, y[i] += scaling[s] * (b[s] @ (a[s] @ x[i])), for bfloat16 or float32 x, y, a
   and b (all of one dtype), in two passes over the rows:

     shrink  t[i][j] = dot(a[s][j], x[i])                  j < R, rounded to x's dtype
     expand  y[i][c] = round(y[i][c] + scaling[s] * dot(b[s][c], t[i]))      c < M

   dot(w, u) over n terms is the float32 sum in one fixed order (the specification,
   `reference/lora.py`, writes the same order with torch ops):

     lane[j] = 0                                             j < 16
     for each chunk of 16 consecutive terms, in order:
       lane[j] = lane[j] + w[16 c + j] * u[16 c + j]         (the product rounded, then
                                                              the sum; 0 past n)
     halve 16 -> 8 -> 4 -> 2 -> 1: lane[j] = lane[j] + lane[j + half]

   so a float32 multiply is never fused into its add (fp-contract off below: with FMA a
   float32 product would not be rounded, and the reference could not follow), and
   scaling[s] * dot is rounded before it is added to y. Denormals are kept, as torch
   keeps them. A row's bits depend on nothing but its own x, y and slot: the caller may
   split the rows of the shrink and the columns of the expand over threads any way.

   Layouts: x (N, K) row stride ldx; y (N, M) row stride ldy (a column slice of a wider
   output is fine); a (L, R, K) contiguous; b (L, M, R) of any strides with a unit one in
   M (stored (L, R, M): the fast case, vectors load as they lie) or in R; t (N, R rounded
   up to 16) float32 scratch between the passes.

   The expand works on blocks of 16 columns: for each block, each slot's (R, 16) slice of
   b as float32 lane vectors (made once per block for all the slot's rows), then per row
   16 lane vectors side by side across the columns, so that every add and multiply of
   the fixed order is one vector op and the halving needs no shuffles. */

#pragma GCC optimize("fp-contract=off")
#pragma STDC FP_CONTRACT OFF

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define LANES 16    /* partial sums per dot product */
#define COLUMNS 16  /* columns of y per block of the expand: its vectors run across them */

/* 16 lanes as the target's native vectors: one AVX-512 register, two AVX ones, four
   SSE or NEON ones (a plain 64-byte vector type would live in memory without AVX-512) */
#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
#define NV (LANES / VW)
typedef float fvec __attribute__((vector_size(VW * 4)));
typedef uint32_t uvec __attribute__((vector_size(VW * 4)));
typedef int32_t ivec __attribute__((vector_size(VW * 4)));
typedef uint16_t hvec __attribute__((vector_size(VW * 2)));
typedef struct { fvec v[NV]; } f32x16;

#define INLINE static inline __attribute__((always_inline))

INLINE f32x16 zero16(void) {
    f32x16 z;
    for (int i = 0; i < NV; i++) z.v[i] = (fvec){0};
    return z;
}
INLINE f32x16 add16(f32x16 a, f32x16 b) {
    for (int i = 0; i < NV; i++) a.v[i] = a.v[i] + b.v[i];
    return a;
}
INLINE f32x16 mul16(f32x16 a, f32x16 b) {
    for (int i = 0; i < NV; i++) a.v[i] = a.v[i] * b.v[i];
    return a;
}
INLINE f32x16 scale16(float s, f32x16 a) {
    for (int i = 0; i < NV; i++) a.v[i] = s * a.v[i];
    return a;
}

static inline float lora_bf16_to_float(uint16_t v) {
    uint32_t u = (uint32_t)v << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t lora_float_to_bf16(float f) {  /* nearest even; NaN stays NaN */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* 16 consecutive elements (bfloat16 or float32) as float32 */
INLINE f32x16 load16(const void *p, int bf16) {
    f32x16 f;
#if defined(__AVX512F__)
    if (bf16) {  /* one widening load and a shift (the generic code below is split in halves
                    where the compiler prefers 256-bit vectors) */
        const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256((const __m256i *)p)), 16);
        memcpy(&f, &u, sizeof f);
        return f;
    }
#endif
    for (int i = 0; i < NV; i++) {
        if (bf16) {
            hvec h;
            memcpy(&h, (const uint16_t *)p + i * VW, sizeof h);
            uvec u = __builtin_convertvector(h, uvec) << 16;
            memcpy(&f.v[i], &u, sizeof u);
        } else {
            memcpy(&f.v[i], (const float *)p + i * VW, sizeof f.v[i]);
        }
    }
    return f;
}

/* 16 float32 stored at p (bfloat16 rounded as lora_float_to_bf16, or float32) */
INLINE void store16(void *p, int bf16, f32x16 f) {
    for (int i = 0; i < NV; i++) {
        if (bf16) {
            uvec u;
            memcpy(&u, &f.v[i], sizeof u);
            const uvec nan = (uvec)((u & 0x7FFFFFFFu) > 0x7F800000u);  /* all ones where NaN */
            const uvec rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
            const uvec quiet = (u >> 16) | 0x40u;
            hvec h = __builtin_convertvector((rounded & ~nan) | (quiet & nan), hvec);
            memcpy((uint16_t *)p + i * VW, &h, sizeof h);
        } else {
            memcpy((float *)p + i * VW, &f.v[i], sizeof f.v[i]);
        }
    }
}

INLINE float halve(f32x16 v) {  /* lane[j] += lane[j + half], 16 -> 1 */
    float lane[LANES];
    memcpy(lane, &v, sizeof lane);
    for (int half = LANES / 2; half >= 1; half /= 2)
        for (int j = 0; j < half; j++) lane[j] = lane[j] + lane[j + half];
    return lane[0];
}

/* the fixed-order dot product of w (n terms, bfloat16 or float32) and u (float32; n
   rounded up to 16 readable, zeros past n) */
static float fixed_dot(const void *w, int bf16, const float *u, int64_t n) {
    const size_t esize = bf16 ? 2 : 4;
    f32x16 lane = zero16();
    int64_t c = 0;
    for (; c + LANES <= n; c += LANES)
        lane = add16(lane, mul16(load16((const char *)w + c * esize, bf16), load16(u + c, 0)));
    if (c < n) {  /* the partial chunk, zeros past the end: adding 0 * 0 changes nothing */
        float wv[LANES] = {0};
        for (int64_t j = 0; j < n - c; j++)
            wv[j] = bf16 ? lora_bf16_to_float(((const uint16_t *)w)[c + j])
                         : ((const float *)w)[c + j];
        lane = add16(lane, mul16(load16(wv, 0), load16(u + c, 0)));
    }
    return halve(lane);
}

/* fixed_dot of four consecutive rows of w (each n terms) with u, side by side: the same
   order for each, four independent chains of adds that overlap in the pipeline (one
   chain waits an add's latency per chunk) */
static void fixed_dot4(const void *w, int bf16, const float *u, int64_t n, float *out) {
    const size_t esize = bf16 ? 2 : 4;
    const char *w0 = (const char *)w;
    f32x16 lane[4] = {zero16(), zero16(), zero16(), zero16()};
    int64_t c = 0;
    for (; c + LANES <= n; c += LANES) {
        const f32x16 uc = load16(u + c, 0);
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++)
            lane[q] = add16(lane[q], mul16(load16(w0 + (q * n + c) * esize, bf16), uc));
    }
    for (int q = 0; q < 4; q++) {
        if (c < n) {  /* the partial chunk, as fixed_dot */
            float wv[LANES] = {0};
            for (int64_t j = 0; j < n - c; j++)
                wv[j] = bf16 ? lora_bf16_to_float(((const uint16_t *)w0)[q * n + c + j])
                             : ((const float *)w0)[q * n + c + j];
            lane[q] = add16(lane[q], mul16(load16(wv, 0), load16(u + c, 0)));
        }
        out[q] = halve(lane[q]);
    }
}

/* fixed_dot of one row w (n terms) with four rows of u (ldu apart), side by side: w's
   conversion shared by the four, and four independent chains of adds */
static void fixed_dot_rows4(const void *w, int bf16, const float *u, int64_t ldu, int64_t n,
                            float *out) {
    const size_t esize = bf16 ? 2 : 4;
    f32x16 lane[4] = {zero16(), zero16(), zero16(), zero16()};
    int64_t c = 0;
    for (; c + LANES <= n; c += LANES) {
        const f32x16 wc = load16((const char *)w + c * esize, bf16);
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) lane[q] = add16(lane[q], mul16(wc, load16(u + q * ldu + c, 0)));
    }
    if (c < n) {  /* the partial chunk, as fixed_dot */
        float wv[LANES] = {0};
        for (int64_t j = 0; j < n - c; j++)
            wv[j] = bf16 ? lora_bf16_to_float(((const uint16_t *)w)[c + j])
                         : ((const float *)w)[c + j];
        for (int q = 0; q < 4; q++)
            lane[q] = add16(lane[q], mul16(load16(wv, 0), load16(u + q * ldu + c, 0)));
    }
    for (int q = 0; q < 4; q++) out[q] = halve(lane[q]);
}

/* t of the rows g[0 .. m) (m <= 4), all of slot s, their x rows converted into xf */
static void shrink_group(const void *x, int64_t ldx, const void *a, int64_t s, const int64_t *g,
                         int64_t m, float *t, int64_t k, int64_t r, int bf16, float *xf) {
    const size_t esize = bf16 ? 2 : 4;
    const int64_t padded = (k + LANES - 1) / LANES * LANES, rp = (r + LANES - 1) / LANES * LANES;
    for (int64_t q = 0; q < m; q++) {
        const char *row = (const char *)x + g[q] * ldx * esize;
        float *xq = xf + q * padded;
        for (int64_t e = 0; e < k; e++)
            xq[e] = bf16 ? lora_bf16_to_float(((const uint16_t *)row)[e]) : ((const float *)row)[e];
        for (int64_t e = k; e < padded; e++) xq[e] = 0.0f;  /* zeros after the row */
    }
    const char *as = (const char *)a + s * r * k * esize;  /* a[s] (R, K) */
    if (m == 4) {  /* four rows: each row of a[s] read and converted once for them */
        float dots[4];
        for (int64_t j = 0; j < r; j++) {
            fixed_dot_rows4(as + j * k * esize, bf16, xf, padded, k, dots);
            for (int q = 0; q < 4; q++) t[g[q] * rp + j] = dots[q];
        }
    } else {  /* fewer: each row's dots four rows of a[s] at a time */
        for (int64_t q = 0; q < m; q++) {
            float *ti = t + g[q] * rp;
            int64_t j = 0;
            for (; j + 4 <= r; j += 4)
                fixed_dot4(as + j * k * esize, bf16, xf + q * padded, k, ti + j);
            for (; j < r; j++) ti[j] = fixed_dot(as + j * k * esize, bf16, xf + q * padded, k);
        }
    }
    for (int64_t q = 0; q < m; q++) {
        float *ti = t + g[q] * rp;
        for (int64_t j = 0; j < r; j++)  /* rounded to x's dtype */
            if (bf16) ti[j] = lora_bf16_to_float(lora_float_to_bf16(ti[j]));
        for (int64_t j = r; j < rp; j++) ti[j] = 0.0f;
    }
}

/* lora_shrink with the caller's scratch xf (4, K rounded up to 16) float32: no allocation
   (the native decode step calls it for every adapted projection of a step). The rows
   are taken slot by slot, up to four of a slot at once (a row's dots are the same
   whichever rows it is taken with). */
void lora_shrink_rows(const void *x, int64_t ldx, const void *a, const int64_t *row_slot,
                      float *t, int64_t k, int64_t r, int64_t bf16, int64_t row_begin,
                      int64_t row_end, float *xf) {
    for (int64_t prev = -1;;) {  /* the slots in increasing order */
        int64_t s = -1;
        for (int64_t i = row_begin; i < row_end; i++)
            if (row_slot[i] > prev && (s < 0 || row_slot[i] < s)) s = row_slot[i];
        if (s < 0) return;
        int64_t g[4], m = 0;
        for (int64_t i = row_begin; i < row_end; i++) {
            if (row_slot[i] != s) continue;
            g[m++] = i;
            if (m == 4) {
                shrink_group(x, ldx, a, s, g, m, t, k, r, (int)bf16, xf);
                m = 0;
            }
        }
        if (m) shrink_group(x, ldx, a, s, g, m, t, k, r, (int)bf16, xf);
        prev = s;
    }
}

/* t[i] for rows [row_begin, row_end) that have a slot (the others are left alone): t
   (N, R rounded up to 16) float32, zeros past R; a (L, R, K) contiguous */
void lora_shrink(const void *x, int64_t ldx, const void *a, const int64_t *row_slot,
                 float *t, int64_t k, int64_t r, int64_t bf16, int64_t row_begin,
                 int64_t row_end) {
    const int64_t padded = (k + LANES - 1) / LANES * LANES;
    float *xf = malloc((size_t)(4 * padded) * sizeof(float));  /* (4, K): rows in float32 */
    if (!xf) abort();
    lora_shrink_rows(x, ldx, a, row_slot, t, k, r, bf16, row_begin, row_end, xf);
    free(xf);
}

/* bt[j][q] = b[s][c0 + q][j] for the block's columns q < cols, j < R rounded up to 16
   (zeros past R and past cols: computed, never stored). b[s][c][j] is at
   b + s * ls + c * lm + j * lr (elements). */
static void column_block(const void *b, int bf16, int64_t ls, int64_t lm, int64_t lr,
                         int64_t s, int64_t c0, int64_t cols, int64_t r, f32x16 *bt) {
    const size_t esize = bf16 ? 2 : 4;
    if (lm == 1 && cols == COLUMNS) {  /* B stored (L, R, M): each lane vector one load */
        for (int64_t j = 0; j < r; j++)
            bt[j] = load16((const char *)b + (s * ls + c0 + j * lr) * esize, bf16);
        for (int64_t j = r; j % LANES; j++) bt[j] = zero16();
        return;
    }
    for (int64_t j0 = 0; j0 < r; j0 += LANES) {
        float row[COLUMNS][LANES] = {{0}}, col[LANES][COLUMNS];  /* b's rows, then columns */
        for (int64_t q = 0; q < cols; q++) {
            const int64_t at = s * ls + (c0 + q) * lm + j0 * lr;
            if (lr == 1 && j0 + LANES <= r) {  /* (L, M, R) contiguous: a vector per row */
                const f32x16 v = load16((const char *)b + at * esize, bf16);
                memcpy(row[q], &v, sizeof v);
            } else {
                for (int64_t j = 0; j < LANES && j0 + j < r; j++)
                    row[q][j] = bf16 ? lora_bf16_to_float(((const uint16_t *)b)[at + j * lr])
                                     : ((const float *)b)[at + j * lr];
            }
        }
        for (int j = 0; j < LANES; j++)
            for (int q = 0; q < COLUMNS; q++) col[j][q] = row[q][j];
        for (int j = 0; j < LANES; j++) bt[j0 + j] = load16(col[j], 0);
    }
}

/* out[q] = dot(b[s][c0 + q], t) for the block's 16 columns in the fixed order, the 16
   dot products' lanes side by side (lane[j] across the columns), each step one vector op;
   rp = R rounded up to 16 (bt and t hold zeros past R: 0 * 0 adds nothing).
   The lanes start as the first chunk's products rather than 0 + them: the two differ
   only in the sign of a zero, and so does every sum built from them (x + 0 = x + -0 for
   x != 0), so the dot differs at most in the sign of a zero, which the + 0 at the end
   settles as the order from +0 does (it never yields -0) */
INLINE f32x16 expand_block(const f32x16 *bt, const float *t, int64_t rp) {
    f32x16 lane[LANES];  /* unrolled whole, so that the lanes stay in registers */
#pragma GCC unroll 16
    for (int j = 0; j < LANES; j++) lane[j] = scale16(t[j], bt[j]);
    for (int64_t c = LANES; c < rp; c += LANES)
#pragma GCC unroll 16
        for (int j = 0; j < LANES; j++) lane[j] = add16(lane[j], scale16(t[c + j], bt[c + j]));
#pragma GCC unroll 4
    for (int half = LANES / 2; half >= 1; half /= 2)
#pragma GCC unroll 8
        for (int j = 0; j < half; j++) lane[j] = add16(lane[j], lane[j + half]);
    return add16(lane[0], zero16());
}

/* y[i][c0 .. c0 + cols) = round(y + scaling * dots) */
INLINE void add_block(void *y, int bf16, int64_t at, int64_t cols, float scale, f32x16 dots) {
    const f32x16 d = scale16(scale, dots);
    const size_t esize = bf16 ? 2 : 4;
    if (cols == COLUMNS) {
        void *out = (char *)y + at * esize;
        store16(out, bf16, add16(load16(out, bf16), d));
    } else {
        float dv[COLUMNS];
        memcpy(dv, &d, sizeof dv);
        for (int64_t q = 0; q < cols; q++) {
            if (bf16) {
                uint16_t *out = (uint16_t *)y + at + q;
                *out = lora_float_to_bf16(lora_bf16_to_float(*out) + dv[q]);
            } else {
                float *out = (float *)y + at + q;
                *out = *out + dv[q];
            }
        }
    }
}

/* lora_expand with the caller's scratch: bt (L, R rounded up to 16, 16) float32, 64-byte
   aligned, and made (L,) int64: no allocation (the native decode step calls it for
   every adapted projection of a step, on each thread's share of the columns) */
void lora_expand_cols(const float *t, const void *b, int64_t ls, int64_t lm, int64_t lr,
                      const float *scaling, const int64_t *row_slot, void *y, int64_t ldy,
                      int64_t n, int64_t r, int64_t num_slots, int64_t bf16, int64_t col_begin,
                      int64_t col_end, void *scratch, int64_t *made) {
    const int64_t rp = (r + LANES - 1) / LANES * LANES;
    /* (L, R rounded up to 16) lane vectors: each slot's column block, made when a row
       first needs it (made[s]: the block it holds) */
    f32x16 *bt = scratch;
    for (int64_t s = 0; s < num_slots; s++) made[s] = -1;
    for (int64_t c0 = col_begin; c0 < col_end; c0 += COLUMNS) {
        const int64_t cols = col_end - c0 < COLUMNS ? col_end - c0 : COLUMNS;
        for (int64_t i = 0; i < n; i++) {
            const int64_t s = row_slot[i];
            if (s < 0) continue;
            if (made[s] != c0) {
                column_block(b, (int)bf16, ls, lm, lr, s, c0, cols, r, bt + s * rp);
                made[s] = c0;
            }
            const f32x16 *bs = bt + s * rp;
            const float *ti = t + i * rp;
            /* the common ranks with a constant trip count: the lanes stay in registers */
            const f32x16 dots = rp == 16   ? expand_block(bs, ti, 16)
                                : rp == 32 ? expand_block(bs, ti, 32)
                                : rp == 64 ? expand_block(bs, ti, 64)
                                           : expand_block(bs, ti, rp);
            add_block(y, (int)bf16, i * ldy + c0, cols, scaling[s], dots);
        }
    }
}

/* y[i][col_begin .. col_end) for every row that has a slot, from its t[i] (as
   lora_shrink wrote it); b's element
   strides ls, lm, lr (either lm or lr is 1); num_slots is L, the stack's depth */
void lora_expand(const float *t, const void *b, int64_t ls, int64_t lm, int64_t lr,
                 const float *scaling, const int64_t *row_slot, void *y, int64_t ldy,
                 int64_t n, int64_t r, int64_t num_slots, int64_t bf16, int64_t col_begin,
                 int64_t col_end) {
    const int64_t rp = (r + LANES - 1) / LANES * LANES;
    f32x16 *bt = aligned_alloc(64, (size_t)(num_slots * rp) * sizeof(f32x16));
    int64_t *made = malloc((size_t)num_slots * sizeof(int64_t));
    if (!bt || !made) abort();
    lora_expand_cols(t, b, ls, lm, lr, scaling, row_slot, y, ldy, n, r, num_slots, bf16,
                     col_begin, col_end, bt, made);
    free(made);
    free(bt);
}
