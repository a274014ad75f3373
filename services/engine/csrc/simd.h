/* What the CPU kernels share: AVX-512 helpers for bfloat16 data (x86 with AVX-512 BF16). */
#ifndef TANDEM_SIMD_H
#define TANDEM_SIMD_H

#include <stdint.h>
#include <immintrin.h>

#define INLINE static inline __attribute__((always_inline))

INLINE __m512 exp512(__m512 x) {
    /* e^x = 2^n e^r, n = round(x / ln 2), |r| <= ln 2 / 2: a degree-6 polynomial (~1 ulp). */
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

INLINE __m512 bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 16 floats rounded to bfloat16 (to nearest, ties to even: as torch rounds), stored. */
INLINE void store_bf16x16(uint16_t *p, __m512 x) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(x));
}

/* The same for the first n (< 16) lanes: loads and stores that touch nothing past them. */
INLINE __m512 bf16x16_n(const uint16_t *p, int n) {
    __mmask16 m = (__mmask16)((1u << n) - 1);
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

INLINE void store_bf16x16_n(uint16_t *p, __m512 x, int n) {
    _mm256_mask_storeu_epi16(p, (__mmask16)((1u << n) - 1), (__m256i)_mm512_cvtneps_pbh(x));
}

/* x rounded to bfloat16 and back: one torch operation's result in a bfloat16 tensor. */
INLINE __m512 round_bf16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

INLINE __m512 negate(__m512 x) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x),
                                                _mm512_set1_epi32((int)0x80000000u)));
}

/* torch's F.silu(gate) * up of bfloat16 gate and up: silu rounded to bfloat16, times up (the
   caller rounds the product). */
INLINE __m512 silu_mul(__m512 g, __m512 u) {
    __m512 e = exp512(negate(g));
    __m512 s = round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    return _mm512_mul_ps(s, u);
}

#endif
