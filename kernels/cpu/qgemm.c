/* Weight-only quantized GEMM, batch-invariant: y (M, N) = x (M, K) @ W.T for bfloat16 x
   and int4 (per-group scale and zero) or int8 (per-row scale) W, any M.

   The arithmetic of one output y[m][n] is fixed, and it is the same in every path
   (AVX-512 BF16, AVX2, plain C) and for any M, tiling or thread split:

     int4, groups of G inputs, w = (q - 8) * s + z with bfloat16 s and z:
       y = 0
       for each group g in order:
         acc = 0
         for each pair (k, k + 1) of the group in order:
           acc = acc + (q[k+1] - 8) * x[k+1]      (the odd input first: vdpbf16ps' order)
           acc = acc + (q[k]   - 8) * x[k]
         y = fma(s, acc, y)
         y = fma(z, xs[g], y)                     (xs[g]: the sum of the group's x, below)
     int8, w = q * s with a bfloat16 s per row: acc as above over all of K, y = s * acc.
     bfloat16 (a dense weight, e.g. the LM head): acc as above over all of K with the
       weight's bfloat16 w for (q - 8), y = acc.

   Each product is exact in float32 (a 4- or 8-bit integer times a bfloat16), so only the
   additions round, one at a time, in that order; the weight is never rounded. Denormals
   are flushed (DAZ and FTZ, as vdpbf16ps always does) in every path. The output is y
   rounded to bfloat16 (nearest even) or kept in float32.

   xs[g] = sum of x[k] over the group: 16 lanes, lane j summing x[g0 + j + 16 i] over i
   in order, then halved 16 -> 8 -> 4 -> 2 -> 1 (lane j + half added to lane j).

   Packed int4 layout, for each block of 16 output columns (c) and 8 inputs (k0 .. k0+7):
   64 bytes, 32 uint16 words; word 2c + p holds q[k0 + 2i + p][c] in nibble i (bits
   4i .. 4i+3). Blocks are ordered [N / 16][K / 8]. Scales and zeros: (K / G, N, 2)
   bfloat16 (s, z). Packed int8 layout: for each block of 16 columns and 2 inputs, 32
   bytes, byte 2c + p = q[k + p][c]; blocks [N / 16][K / 2]. Scales: (N,) bfloat16.
   Packed bfloat16 layout: as int8's with 16-bit words (64 bytes a block).

   Work is split by the caller over column blocks only ([cb_begin, cb_end) of the N / 16
   blocks), so a row's bits never depend on the other rows or on the thread count. */

#include <stdint.h>
#include <string.h>
#include <math.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

static inline float bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t float_to_bf16(float f) {  /* round to nearest even; NaN stays NaN */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* --- the sums of x over each group: plain C (the compiler vectorizes the lanes; the
   order of the additions is the one written, which no optimization may change) ----- */

static void group_sums(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, int64_t group,
                       float *xs) {
    const int64_t groups = k / group;
    for (int64_t r = 0; r < m; r++) {
        const uint16_t *row = x + r * ldx;
        for (int64_t g = 0; g < groups; g++) {
            float v[16];
            for (int j = 0; j < 16; j++) v[j] = bf16_to_float(row[g * group + j]);
            for (int64_t i = 16; i < group; i += 16)
                for (int j = 0; j < 16; j++) v[j] += bf16_to_float(row[g * group + i + j]);
            for (int half = 8; half >= 1; half /= 2)
                for (int j = 0; j < half; j++) v[j] += v[j + half];
            xs[r * groups + g] = v[0];
        }
    }
}

static inline void store_row16(void *y, int64_t ldy, int out_f32, int64_t r, int64_t col,
                               const float *v) {
    if (out_f32) {
        memcpy((float *)y + r * ldy + col, v, 16 * sizeof(float));
    } else {
        uint16_t *o = (uint16_t *)y + r * ldy + col;
        for (int c = 0; c < 16; c++) o[c] = float_to_bf16(v[c]);
    }
}

/* --- plain C: the definition, and the path where no vector one is built ------------ */

__attribute__((unused)) static void int4_plain(
    const uint16_t *x, int64_t ldx, const uint8_t *w, const uint16_t *sz, const float *xs,
    void *y, int64_t ldy, int out_f32, int64_t m, int64_t n, int64_t k, int64_t group,
    int64_t cb_begin, int64_t cb_end) {
    const int64_t groups = k / group, kblocks = k / 8;
    for (int64_t r = 0; r < m; r++) {
        const uint16_t *row = x + r * ldx;
        for (int64_t cb = cb_begin; cb < cb_end; cb++) {
            float out[16] = {0};
            for (int64_t g = 0; g < groups; g++) {
                float acc[16] = {0};
                for (int64_t kb = g * group / 8; kb < (g + 1) * group / 8; kb++) {
                    const uint16_t *words = (const uint16_t *)(w + (cb * kblocks + kb) * 64);
                    for (int i = 0; i < 4; i++) {
                        float x0 = bf16_to_float(row[kb * 8 + 2 * i]);
                        float x1 = bf16_to_float(row[kb * 8 + 2 * i + 1]);
                        for (int c = 0; c < 16; c++) {
                            float q0 = (float)((words[2 * c] >> (4 * i)) & 15) - 8.0f;
                            float q1 = (float)((words[2 * c + 1] >> (4 * i)) & 15) - 8.0f;
                            acc[c] = acc[c] + q1 * x1;
                            acc[c] = acc[c] + q0 * x0;
                        }
                    }
                }
                const uint16_t *gsz = sz + (g * n + cb * 16) * 2;
                for (int c = 0; c < 16; c++) {
                    out[c] = fmaf(bf16_to_float(gsz[2 * c]), acc[c], out[c]);
                    out[c] = fmaf(bf16_to_float(gsz[2 * c + 1]), xs[r * groups + g], out[c]);
                }
            }
            store_row16(y, ldy, out_f32, r, cb * 16, out);
        }
    }
}

/* int8 (w: int8 codes, a scale per column) and bfloat16 (w: bfloat16 weights, scale NULL)
   share the packed pair layout and the order of the additions */
__attribute__((unused)) static void pairs_plain(
    const uint16_t *x, int64_t ldx, const void *w, const uint16_t *scale, void *y,
    int64_t ldy, int out_f32, int64_t m, int64_t k, int64_t cb_begin, int64_t cb_end) {
    const int64_t pairs = k / 2;
    for (int64_t r = 0; r < m; r++) {
        const uint16_t *row = x + r * ldx;
        for (int64_t cb = cb_begin; cb < cb_end; cb++) {
            float acc[16] = {0};
            for (int64_t kp = 0; kp < pairs; kp++) {
                const int64_t at = (cb * pairs + kp) * 32;
                float x0 = bf16_to_float(row[2 * kp]), x1 = bf16_to_float(row[2 * kp + 1]);
                /* the weights as float32 first: with the conversion inside the interleaved loop,
                   GCC 12.2 at -O3 -march=x86-64 computed wrong sums (vectorized) */
                float wf[32];
                for (int i = 0; i < 32; i++)
                    wf[i] = scale ? (float)((const int8_t *)w)[at + i]
                                  : bf16_to_float(((const uint16_t *)w)[at + i]);
                for (int c = 0; c < 16; c++) {
                    acc[c] = acc[c] + wf[2 * c + 1] * x1;
                    acc[c] = acc[c] + wf[2 * c] * x0;
                }
            }
            if (scale)
                for (int c = 0; c < 16; c++) acc[c] = bf16_to_float(scale[cb * 16 + c]) * acc[c];
            store_row16(y, ldy, out_f32, r, cb * 16, acc);
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define QGEMM_PATH "avx512-bf16"
/* --- AVX-512 BF16: vdpbf16ps on bfloat16 pairs; int4 codes become bfloat16 (q - 8)
   through a 32-entry table (vpermw reads 5 index bits: the table is repeated, so the
   next nibble's low bit does not matter). A tile is MT rows x NT blocks of 16 columns;
   its shape only changes which registers hold which outputs, never the arithmetic. --- */

static const uint16_t INT4_BF16[32] = {
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,  /* -8 .. -1 */
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,  /*  0 ..  7 */
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};

#define MAX_MT 6
#define MAX_NT 4

static inline __attribute__((always_inline)) void store_tile(
    __m512 v, void *y, int64_t ldy, int out_f32, int64_t r, int64_t col) {
    if (out_f32)
        _mm512_storeu_ps((float *)y + r * ldy + col, v);
    else
        _mm256_storeu_si256((__m256i *)((uint16_t *)y + r * ldy + col),
                            (__m256i)_mm512_cvtneps_pbh(v));
}

static inline __attribute__((always_inline)) void int4_tile(
    const uint16_t *x, int64_t ldx, const uint8_t *w, const uint16_t *sz, const float *xs,
    void *y, int64_t ldy, int out_f32, int64_t n, int64_t k, int64_t group, int64_t cb,
    const int MT, const int NT) {
    const __m512i lut = _mm512_loadu_si512((const void *)INT4_BF16);
    const __m512i zero_mask = _mm512_set1_epi32((int)0xFFFF0000);
    const int64_t groups = k / group, kblocks = k / 8;
    __m512 out[MAX_MT][MAX_NT];
#pragma GCC unroll 8
    for (int r = 0; r < MT; r++)
#pragma GCC unroll 8
        for (int c = 0; c < NT; c++) out[r][c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 acc[MAX_MT][MAX_NT];
#pragma GCC unroll 8
        for (int r = 0; r < MT; r++)
#pragma GCC unroll 8
            for (int c = 0; c < NT; c++) acc[r][c] = _mm512_setzero_ps();
        for (int64_t kb = g * group / 8; kb < (g + 1) * group / 8; kb++) {
            __m512i word[MAX_NT];
#pragma GCC unroll 8
            for (int c = 0; c < NT; c++) {
                const uint8_t *rec = w + ((cb + c) * kblocks + kb) * 64;
                /* the next tile's record into L2: a decode step streams the weight from
                   memory (measured: 5.6 -> 9.3 GB/s at one row, one thread) */
                _mm_prefetch((const char *)rec + NT * kblocks * 64, _MM_HINT_T1);
                word[c] = _mm512_loadu_si512((const void *)rec);
            }
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
#pragma GCC unroll 8
                for (int c = 0; c < NT; c++) {
                    __m512i codes = i ? _mm512_srli_epi16(word[c], 4 * i) : word[c];
                    __m512bh op = (__m512bh)_mm512_permutexvar_epi16(codes, lut);
#pragma GCC unroll 8
                    for (int r = 0; r < MT; r++) {
                        int32_t pair;
                        memcpy(&pair, x + r * ldx + kb * 8 + 2 * i, 4);
                        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], op,
                                                     (__m512bh)_mm512_set1_epi32(pair));
                    }
                }
            }
        }
#pragma GCC unroll 8
        for (int c = 0; c < NT; c++) {
            __m512i both = _mm512_loadu_si512((const void *)(sz + (g * n + (cb + c) * 16) * 2));
            __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(both, 16));
            __m512 z = _mm512_castsi512_ps(_mm512_and_si512(both, zero_mask));
#pragma GCC unroll 8
            for (int r = 0; r < MT; r++) {
                out[r][c] = _mm512_fmadd_ps(s, acc[r][c], out[r][c]);
                out[r][c] = _mm512_fmadd_ps(z, _mm512_set1_ps(xs[r * groups + g]), out[r][c]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MT; r++)
#pragma GCC unroll 8
        for (int c = 0; c < NT; c++) store_tile(out[r][c], y, ldy, out_f32, r, (cb + c) * 16);
}

/* int8 (BF 0: codes, a scale per column) or bfloat16 (BF 1: the weights themselves) */
static inline __attribute__((always_inline)) void pairs_tile(
    const uint16_t *x, int64_t ldx, const void *w, const uint16_t *scale, void *y,
    int64_t ldy, int out_f32, int64_t k, int64_t cb, const int MT, const int NT, const int BF) {
    const int64_t pairs = k / 2, block = BF ? 64 : 32;  /* bytes per block of pairs */
    __m512 acc[MAX_MT][MAX_NT];
#pragma GCC unroll 8
    for (int r = 0; r < MT; r++)
#pragma GCC unroll 8
        for (int c = 0; c < NT; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < pairs; kp++) {
#pragma GCC unroll 8
        for (int c = 0; c < NT; c++) {
            const char *b = (const char *)w + ((cb + c) * pairs + kp) * block;
            _mm_prefetch(b + NT * pairs * block, _MM_HINT_T1);  /* as int4_tile */
            __m512bh op;
            if (BF) {
                op = (__m512bh)_mm512_loadu_si512((const void *)b);
            } else {
                __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)b)));
                __m512 hi = _mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 16))));
                op = _mm512_cvtne2ps_pbh(hi, lo);
            }
#pragma GCC unroll 8
            for (int r = 0; r < MT; r++) {
                int32_t pair;
                memcpy(&pair, x + r * ldx + 2 * kp, 4);
                acc[r][c] = _mm512_dpbf16_ps(acc[r][c], op, (__m512bh)_mm512_set1_epi32(pair));
            }
        }
    }
#pragma GCC unroll 8
    for (int c = 0; c < NT; c++) {
        __m512 s = BF ? _mm512_setzero_ps() : _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(scale + (cb + c) * 16))),
            16));
#pragma GCC unroll 8
        for (int r = 0; r < MT; r++)
            store_tile(BF ? acc[r][c] : _mm512_mul_ps(s, acc[r][c]), y, ldy, out_f32, r,
                       (cb + c) * 16);
    }
}

/* Tiles: up to two rows take four column blocks per tile (enough independent
   accumulators for one row); more rows take six rows by two blocks, so that a weight
   block is unpacked once for six rows. Leftover rows and blocks take smaller tiles of
   the same code. */
#define TILE_ROWS 6
#define TILE_COLS 2
#define FEW_ROWS 2
#define FEW_ROWS_COLS 4

#define INT4_AT(MT, NT)                                                                     \
    int4_tile(x + r0 * ldx, ldx, w, sz, xs + r0 * groups, (char *)y + r0 * ldy * esize, ldy, \
              out_f32, n, k, group, cb, MT, NT)
#define INT8_AT(MT, NT)                                                                    \
    pairs_tile(x + r0 * ldx, ldx, w, scale, (char *)y + r0 * ldy * esize, ldy, out_f32, k, cb, \
               MT, NT, 0)
#define BF16_AT(MT, NT)                                                                    \
    pairs_tile(x + r0 * ldx, ldx, w, NULL, (char *)y + r0 * ldy * esize, ldy, out_f32, k, cb, \
               MT, NT, 1)
/* rows [r0, r0 + rows) (rows < 7) of one tile of NT column blocks */
#define ROWS_SWITCH(AT, NT)                                                                 \
    switch (rows) {                                                                         \
    case 1: AT(1, NT); break;                                                               \
    case 2: AT(2, NT); break;                                                               \
    case 3: AT(3, NT); break;                                                               \
    case 4: AT(4, NT); break;                                                               \
    case 5: AT(5, NT); break;                                                               \
    default: AT(6, NT); break;                                                              \
    }
/* every tile of blocks [cb_begin, cb_end) x rows [0, m) */
#define TILES(AT)                                                                           \
    int64_t cb = cb_begin;                                                                  \
    if (m <= FEW_ROWS) {                                                                    \
        const int64_t r0 = 0, rows = m;                                                     \
        for (; cb + FEW_ROWS_COLS <= cb_end; cb += FEW_ROWS_COLS) ROWS_SWITCH(AT, FEW_ROWS_COLS) \
    }                                                                                       \
    for (; cb + TILE_COLS <= cb_end; cb += TILE_COLS)                                       \
        for (int64_t r0 = 0; r0 < m; r0 += TILE_ROWS) {                                     \
            const int64_t rows = m - r0 < TILE_ROWS ? m - r0 : TILE_ROWS;                   \
            ROWS_SWITCH(AT, TILE_COLS)                                                      \
        }                                                                                   \
    for (; cb < cb_end; cb++)                                                               \
        for (int64_t r0 = 0; r0 < m; r0 += TILE_ROWS) {                                     \
            const int64_t rows = m - r0 < TILE_ROWS ? m - r0 : TILE_ROWS;                   \
            ROWS_SWITCH(AT, 1)                                                              \
        }

static void int4_vector(const uint16_t *x, int64_t ldx, const uint8_t *w, const uint16_t *sz,
                        const float *xs, void *y, int64_t ldy, int out_f32, int64_t m,
                        int64_t n, int64_t k, int64_t group, int64_t cb_begin, int64_t cb_end) {
    const int64_t groups = k / group, esize = out_f32 ? 4 : 2;
    TILES(INT4_AT)
}

/* int8 where scale is given, else bfloat16 weights */
static void pairs_vector(const uint16_t *x, int64_t ldx, const void *w, const uint16_t *scale,
                         void *y, int64_t ldy, int out_f32, int64_t m, int64_t k,
                         int64_t cb_begin, int64_t cb_end) {
    const int64_t esize = out_f32 ? 4 : 2;
    if (scale) {
        TILES(INT8_AT)
    } else {
        TILES(BF16_AT)
    }
}
#define INT4_KERNEL int4_vector
#define PAIRS_KERNEL pairs_vector
#elif defined(__AVX2__) && defined(__FMA__)
#define QGEMM_PATH "avx2"
/* --- AVX2: vdpbf16ps' two additions per pair as two float32 FMAs of exact products
   (the odd input first); a code becomes (q - 8) as 2^23 + q - (2^23 + 8), exactly.
   One block of 16 columns is two halves of 8; a tile is MT rows of one block. ------ */

static inline __attribute__((always_inline)) __m256 x_at(const uint16_t *row, int64_t kk) {
    return _mm256_castsi256_ps(_mm256_set1_epi32((int)((uint32_t)row[kk] << 16)));
}

/* (q - 8) of the nibble at bit `shift` of each 32-bit lane, as float32 */
static inline __attribute__((always_inline)) __m256 codes_at(__m256i lanes, int shift) {
    const __m256i magic = _mm256_set1_epi32(0x4B000000);
    __m256i q = _mm256_and_si256(_mm256_srli_epi32(lanes, shift), _mm256_set1_epi32(15));
    return _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(q, magic)),
                         _mm256_set1_ps(8388616.0f));
}

static inline __attribute__((always_inline)) void store_half(
    __m256 v, void *y, int64_t ldy, int out_f32, int64_t r, int64_t col) {
    float f[8];
    _mm256_storeu_ps(f, v);
    if (out_f32) {
        memcpy((float *)y + r * ldy + col, f, sizeof f);
    } else {
        uint16_t *o = (uint16_t *)y + r * ldy + col;
        for (int c = 0; c < 8; c++) o[c] = float_to_bf16(f[c]);
    }
}

#define AVX2_MT 3

static inline __attribute__((always_inline)) void int4_tile2(
    const uint16_t *x, int64_t ldx, const uint8_t *w, const uint16_t *sz, const float *xs,
    void *y, int64_t ldy, int out_f32, int64_t n, int64_t k, int64_t group, int64_t cb,
    const int MT) {
    const int64_t groups = k / group, kblocks = k / 8;
    __m256 out[AVX2_MT][2];
#pragma GCC unroll 4
    for (int r = 0; r < MT; r++) out[r][0] = out[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256 acc[AVX2_MT][2];
#pragma GCC unroll 4
        for (int r = 0; r < MT; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int64_t kb = g * group / 8; kb < (g + 1) * group / 8; kb++) {
            const uint8_t *rec = w + (cb * kblocks + kb) * 64;
            __m256i lanes[2] = {_mm256_loadu_si256((const __m256i *)rec),
                                _mm256_loadu_si256((const __m256i *)(rec + 32))};
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    __m256 q0 = codes_at(lanes[h], 4 * i), q1 = codes_at(lanes[h], 16 + 4 * i);
#pragma GCC unroll 4
                    for (int r = 0; r < MT; r++) {
                        const uint16_t *row = x + r * ldx + kb * 8 + 2 * i;
                        acc[r][h] = _mm256_fmadd_ps(q1, x_at(row, 1), acc[r][h]);
                        acc[r][h] = _mm256_fmadd_ps(q0, x_at(row, 0), acc[r][h]);
                    }
                }
            }
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m256i both = _mm256_loadu_si256((const __m256i *)(sz + (g * n + cb * 16 + 8 * h) * 2));
            __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(both, 16));
            __m256 z = _mm256_castsi256_ps(_mm256_and_si256(both, _mm256_set1_epi32((int)0xFFFF0000)));
#pragma GCC unroll 4
            for (int r = 0; r < MT; r++) {
                out[r][h] = _mm256_fmadd_ps(s, acc[r][h], out[r][h]);
                out[r][h] = _mm256_fmadd_ps(z, _mm256_set1_ps(xs[r * groups + g]), out[r][h]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < MT; r++)
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) store_half(out[r][h], y, ldy, out_f32, r, cb * 16 + 8 * h);
}

/* the codes of parity p (0: even inputs, 1: odd) of 8 columns from 16 bytes, as float32 */
static inline __attribute__((always_inline)) __m256 int8_at(const int8_t *b, int p) {
    __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b));
    v = p ? _mm256_srai_epi32(v, 16) : _mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16);
    return _mm256_cvtepi32_ps(v);
}

/* bfloat16 weights of parity p of 8 columns from 16 words, as float32 (exact) */
static inline __attribute__((always_inline)) __m256 bf16_at(const uint16_t *b, int p) {
    __m256i v = _mm256_loadu_si256((const __m256i *)b);
    v = p ? _mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)) : _mm256_slli_epi32(v, 16);
    return _mm256_castsi256_ps(v);
}

/* int8 (BF 0: codes, a scale per column) or bfloat16 (BF 1: the weights themselves) */
static inline __attribute__((always_inline)) void pairs_tile2(
    const uint16_t *x, int64_t ldx, const void *w, const uint16_t *scale, void *y,
    int64_t ldy, int out_f32, int64_t k, int64_t cb, const int MT, const int BF) {
    const int64_t pairs = k / 2, block = BF ? 64 : 32;  /* bytes per block of pairs */
    __m256 acc[AVX2_MT][2];
#pragma GCC unroll 4
    for (int r = 0; r < MT; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t kp = 0; kp < pairs; kp++) {
        const char *b = (const char *)w + (cb * pairs + kp) * block;
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const char *half = b + h * block / 2;
            __m256 w0 = BF ? bf16_at((const uint16_t *)half, 0) : int8_at((const int8_t *)half, 0);
            __m256 w1 = BF ? bf16_at((const uint16_t *)half, 1) : int8_at((const int8_t *)half, 1);
#pragma GCC unroll 4
            for (int r = 0; r < MT; r++) {
                const uint16_t *row = x + r * ldx + 2 * kp;
                acc[r][h] = _mm256_fmadd_ps(w1, x_at(row, 1), acc[r][h]);
                acc[r][h] = _mm256_fmadd_ps(w0, x_at(row, 0), acc[r][h]);
            }
        }
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        __m256 s = BF ? _mm256_setzero_ps() : _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(scale + cb * 16 + 8 * h))), 16));
#pragma GCC unroll 4
        for (int r = 0; r < MT; r++)
            store_half(BF ? acc[r][h] : _mm256_mul_ps(s, acc[r][h]), y, ldy, out_f32, r,
                       cb * 16 + 8 * h);
    }
}

#define INT4_AT2(MT)                                                                         \
    int4_tile2(x + r0 * ldx, ldx, w, sz, xs + r0 * groups, (char *)y + r0 * ldy * esize, ldy, \
               out_f32, n, k, group, cb, MT)
#define INT8_AT2(MT)                                                                         \
    pairs_tile2(x + r0 * ldx, ldx, w, scale, (char *)y + r0 * ldy * esize, ldy, out_f32, k, cb, MT, 0)
#define BF16_AT2(MT)                                                                         \
    pairs_tile2(x + r0 * ldx, ldx, w, NULL, (char *)y + r0 * ldy * esize, ldy, out_f32, k, cb, MT, 1)
#define TILES2(AT)                                                                           \
    for (int64_t cb = cb_begin; cb < cb_end; cb++)                                           \
        for (int64_t r0 = 0; r0 < m; r0 += AVX2_MT) {                                        \
            const int64_t rows = m - r0;                                                     \
            if (rows >= 3) AT(3); else if (rows == 2) AT(2); else AT(1);                     \
        }

static void int4_avx2(const uint16_t *x, int64_t ldx, const uint8_t *w, const uint16_t *sz,
                      const float *xs, void *y, int64_t ldy, int out_f32, int64_t m,
                      int64_t n, int64_t k, int64_t group, int64_t cb_begin, int64_t cb_end) {
    const int64_t groups = k / group, esize = out_f32 ? 4 : 2;
    TILES2(INT4_AT2)
}

/* int8 where scale is given, else bfloat16 weights */
static void pairs_avx2(const uint16_t *x, int64_t ldx, const void *w, const uint16_t *scale,
                       void *y, int64_t ldy, int out_f32, int64_t m, int64_t k,
                       int64_t cb_begin, int64_t cb_end) {
    const int64_t esize = out_f32 ? 4 : 2;
    if (scale) {
        TILES2(INT8_AT2)
    } else {
        TILES2(BF16_AT2)
    }
}
#define INT4_KERNEL int4_avx2
#define PAIRS_KERNEL pairs_avx2
#else
#define QGEMM_PATH "plain"
#define INT4_KERNEL int4_plain
#define PAIRS_KERNEL pairs_plain
#endif

/* --- entry points -------------------------------------------------------------------- */

#if defined(__x86_64__) || defined(__i386__)
/* DAZ and FTZ for the call (vdpbf16ps always flushes: the other paths must too) */
#define FLUSH_BEGIN unsigned int csr_ = _mm_getcsr(); _mm_setcsr(csr_ | 0x8040u);
#define FLUSH_END _mm_setcsr(csr_);
#else
#define FLUSH_BEGIN
#define FLUSH_END
#endif

const char *qgemm_path(void) { return QGEMM_PATH; }

/* xs (m, k / group) float32: each row's group sums, for qgemm_int4 */
void qgemm_group_sums(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, int64_t group,
                      float *xs) {
    FLUSH_BEGIN
    group_sums(x, ldx, m, k, group, xs);
    FLUSH_END
}

/* y[:, 16 cb_begin : 16 cb_end] of x (m, k) bfloat16 (row stride ldx) by the packed int4
   weight; y (row stride ldy) bfloat16, or float32 where out_f32 */
void qgemm_int4(const uint16_t *x, int64_t ldx, const uint8_t *w, const uint16_t *sz,
                const float *xs, void *y, int64_t ldy, int64_t out_f32, int64_t m, int64_t n,
                int64_t k, int64_t group, int64_t cb_begin, int64_t cb_end) {
    FLUSH_BEGIN
    INT4_KERNEL(x, ldx, w, sz, xs, y, ldy, (int)out_f32, m, n, k, group, cb_begin, cb_end);
    FLUSH_END
}

/* as qgemm_int4, for the packed int8 weight and its (16 blocks,) bfloat16 scales */
void qgemm_int8(const uint16_t *x, int64_t ldx, const int8_t *w, const uint16_t *scale,
                void *y, int64_t ldy, int64_t out_f32, int64_t m, int64_t k, int64_t cb_begin,
                int64_t cb_end) {
    FLUSH_BEGIN
    PAIRS_KERNEL(x, ldx, w, scale, y, ldy, (int)out_f32, m, k, cb_begin, cb_end);
    FLUSH_END
}

/* as qgemm_int8, for a packed bfloat16 weight (no scales) */
void qgemm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, void *y, int64_t ldy,
                int64_t out_f32, int64_t m, int64_t k, int64_t cb_begin, int64_t cb_end) {
    FLUSH_BEGIN
    PAIRS_KERNEL(x, ldx, w, NULL, y, ldy, (int)out_f32, m, k, cb_begin, cb_end);
    FLUSH_END
}
