// Sixteen bf16 values at a time in AVX-512 registers, for the kernels that write their own
// vector code: widened to fp32 as read (tails by mask), rounded back as to_bf16 rounds, and e^x.
#ifndef PAGODA_CPU_BF16_VEC_H
#define PAGODA_CPU_BF16_VEC_H

#include <immintrin.h>
#include <stdint.h>

// n (at most 16) values from p widened to fp32; lanes past n are 0 and nothing past them is read.
__attribute__((target("avx512f,avx512bw,avx512vl")))
static inline __m512 load16_bf16(const uint16_t *p, __mmask16 n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(n, p)), 16));
}

// 16 floats rounded to bf16 as to_bf16 rounds (to nearest even, a NaN made quiet).
__attribute__((target("avx512f,avx512bw")))
static inline __m256i round16_bf16(__m512i u) {
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i even = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    const __mmask16 nan = _mm512_cmp_ps_mask(_mm512_castsi512_ps(u), _mm512_castsi512_ps(u), _CMP_UNORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, even, quiet));
}

// v rounded to bf16 and widened back: the value a bf16 tensor would hold.
__attribute__((target("avx512f,avx512bw")))
static inline __m512 rounded16_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(round16_bf16(_mm512_castps_si512(v))), 16));
}

// The first n (at most 16) of v rounded into p.
__attribute__((target("avx512f,avx512bw,avx512vl")))
static inline void store16_bf16(uint16_t *p, __m512 v, __mmask16 n) {
    _mm256_mask_storeu_epi16(p, n, round16_bf16(_mm512_castps_si512(v)));
}

// e^x for 16 x <= 0 (cpu_attention_math.h's exp_poly, its 2^n by vscalefps; 0 below -87).
__attribute__((target("avx512f"))) static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                     _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

// The lanes of a tail of n values (all 16 past it).
static inline __mmask16 lanes16(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }

#endif
