#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t float_to_bf16(float f) {  /* round to nearest even */
    uint32_t u; memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* packed: (n/block, k, block/2) bytes, low nibble row j, high nibble row j + block/2 of
   each block (block: 64 where PyTorch packs for AVX-512, 32 for AVX2);
   sz: (k/group, n, 2) bfloat16 (scale, zero); w = (q - 8) * scale + zero, in float32
   ((q - 8) * scale is exact: fused or not, only the add rounds).
   out: (2k, n) bfloat16: rows [0, k) hold hi = bf16(w), rows [k, 2k) lo = bf16(w - hi),
   so that hi + lo is w to within 2^-16 of it. Rows [k_begin, k_end) of K. */
static void dequant_plain(const uint8_t *packed, const uint16_t *sz, uint16_t *out,
                          int64_t n, int64_t k, int64_t group, int64_t block, int64_t k_begin,
                          int64_t k_end) {
    const int64_t half = block / 2;
    for (int64_t kk = k_begin; kk < k_end; kk++) {
        const uint16_t *g = sz + (kk / group) * n * 2;
        uint16_t *hi_row = out + kk * n, *lo_row = out + (k + kk) * n;
        for (int64_t nb = 0; nb < n / block; nb++) {
            const uint8_t *p = packed + (nb * k + kk) * half;
            int64_t n0 = nb * block;
            float w[64];
            for (int j = 0; j < half; j++) {
                w[j] = (float)((p[j] & 15) - 8) * bf16_to_float(g[(n0 + j) * 2])
                       + bf16_to_float(g[(n0 + j) * 2 + 1]);
                w[half + j] = (float)((p[j] >> 4) - 8) * bf16_to_float(g[(n0 + half + j) * 2])
                              + bf16_to_float(g[(n0 + half + j) * 2 + 1]);
            }
            for (int j = 0; j < block; j++) {
                uint16_t h = float_to_bf16(w[j]);
                hi_row[n0 + j] = h;
                lo_row[n0 + j] = float_to_bf16(w[j] - bf16_to_float(h));
            }
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BF16__)
#include <immintrin.h>
/* 16 rows of one k: codes (low or high nibbles of 16 bytes) -> hi and lo bfloat16; the
   lanes where w or w - hi is subnormal, which the conversion flushes to zero */
static inline __mmask16 rows16(const uint8_t *p, int high, const uint16_t *g,
                               uint16_t *hi, uint16_t *lo) {
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    q = high ? _mm512_srli_epi32(q, 4) : _mm512_and_si512(q, _mm512_set1_epi32(15));
    __m512 qf = _mm512_sub_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(8.0f));
    __m512i sz = _mm512_loadu_si512((const void *)g);  /* 16 (scale, zero) pairs */
    __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(sz, 16));
    __m512 z = _mm512_castsi512_ps(_mm512_and_si512(sz, _mm512_set1_epi32((int)0xFFFF0000)));
    __m512 w = _mm512_fmadd_ps(qf, s, z);
    __m256bh h = _mm512_cvtneps_pbh(w);
    __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
    __m512 l = _mm512_sub_ps(w, hf);
    _mm256_storeu_si256((__m256i *)hi, (__m256i)h);
    _mm256_storeu_si256((__m256i *)lo, (__m256i)_mm512_cvtneps_pbh(l));
    return _mm512_fpclass_ps_mask(w, 0x20) | _mm512_fpclass_ps_mask(l, 0x20);
}

/* as dequant_plain; nonzero if a weight was subnormal (then the range is to be redone) */
static __mmask16 dequant_avx512(const uint8_t *packed, const uint16_t *sz, uint16_t *out,
                                int64_t n, int64_t k, int64_t group, int64_t block,
                                int64_t k_begin, int64_t k_end) {
    const int64_t half = block / 2;
    __mmask16 subnormal = 0;
    for (int64_t kk = k_begin; kk < k_end; kk++) {
        const uint16_t *g = sz + (kk / group) * n * 2;
        uint16_t *hi_row = out + kk * n, *lo_row = out + (k + kk) * n;
        for (int64_t nb = 0; nb < n / block; nb++) {
            const uint8_t *p = packed + (nb * k + kk) * half;
            int64_t n0 = nb * block;
            for (int r = 0; r < block; r += 16) {  /* rows n0 + r .. n0 + r + 15 */
                subnormal |= rows16(p + (r % half), r >= half, g + (n0 + r) * 2,
                                    hi_row + n0 + r, lo_row + n0 + r);
            }
        }
    }
    return subnormal;
}
#endif

void dequant_int4(const uint8_t *packed, const uint16_t *sz, uint16_t *out, int64_t n,
                  int64_t k, int64_t group, int64_t block, int64_t k_begin, int64_t k_end) {
#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BF16__)
    /* no real checkpoint has weights below ~1e-35: plain C keeps them as torch does */
    if (!dequant_avx512(packed, sz, out, n, k, group, block, k_begin, k_end)) return;
#endif
    dequant_plain(packed, sz, out, n, k, group, block, k_begin, k_end);
}
