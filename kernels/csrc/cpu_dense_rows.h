// Dot products of up to 4 (AVX2) or 8 (AVX-512F) rows of fp32 x with one dense weight row of
// K elements (K a multiple of 32): fp32, bf16 (widened exactly: an fp32's top half) or int8
// (widened exactly; the caller applies the row's scale). Rows and type are constants of each
// compiled case. Shared by the one-call decode step (kernels/csrc/cpu_decode_layer.c) and the
// int8 projection kernel (kernels/csrc/cpu_gemm_int8.c).
#pragma once
#include <immintrin.h>
#include <stdint.h>

#include "cpu_weight_types.h"

// The 8 lanes of t summed.
__attribute__((target("avx2,fma"), always_inline))
static inline float dense_sum8(__m256 t) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}


__attribute__((target("avx2,fma"), always_inline))
static inline __m256 dense8(const uint8_t *w, int64_t k, const int type) {
    if (type == TYPE_F32) return _mm256_loadu_ps((const float *)w + k);
    if (type == TYPE_I8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)w + k))));
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + k)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

// One or two rows of x keep four sums each, three or four two: an FMA waits about 5 cycles for
// its sum, and with two sums one row of int8 weights took 16 weights per 5 cycles (a Zen 2 EPYC).
__attribute__((target("avx2,fma"), always_inline))
static inline void dense_avx2(const float *x, int64_t ldx, const uint8_t *w, int64_t K, float *s,
                              const int rows, const int type) {
    const int sums = rows <= 2 ? 4 : 2;
    __m256 a[4][4];
    for (int m = 0; m < rows; m++)
        for (int i = 0; i < sums; i++) a[m][i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m256 v[4];
        for (int i = 0; i < 4; i++) v[i] = dense8(w, k + 8 * i, type);
        for (int m = 0; m < rows; m++)
            for (int i = 0; i < 4; i++)
                a[m][i % sums] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + k + 8 * i), v[i], a[m][i % sums]);
    }
    for (int m = 0; m < rows; m++) {
        __m256 t0 = a[m][0], t1 = a[m][1];
        if (sums == 4) t0 = _mm256_add_ps(t0, a[m][2]), t1 = _mm256_add_ps(t1, a[m][3]);
        s[m] = dense_sum8(_mm256_add_ps(t0, t1));
    }
}

__attribute__((target("avx512f"), always_inline))
static inline __m512 dense16(const uint8_t *w, int64_t k, const int type) {
    if (type == TYPE_F32) return _mm512_loadu_ps((const float *)w + k);
    if (type == TYPE_I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)w + k))));
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}

__attribute__((target("avx512f"), always_inline))
static inline void dense_avx512(const float *x, int64_t ldx, const uint8_t *w, int64_t K, float *s,
                                const int rows, const int type) {
    __m512 a[8][2];
    for (int m = 0; m < rows; m++) a[m][0] = a[m][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const __m512 w0 = dense16(w, k, type), w1 = dense16(w, k + 16, type);
        for (int m = 0; m < rows; m++) {
            a[m][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * ldx + k), w0, a[m][0]);
            a[m][1] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * ldx + k + 16), w1, a[m][1]);
        }
    }
    for (int m = 0; m < rows; m++) s[m] = _mm512_reduce_add_ps(_mm512_add_ps(a[m][0], a[m][1]));
}
