// The AVX512-BF16 tile of kernels/csrc/cpu_gemm_bf16.c's projections, shared with the one-call
// decode step (kernels/csrc/cpu_decode_layer.c): up to 4 rows of bf16 x against 4 bf16 weight
// rows in vdpbf16ps (32 products an instruction), 16 sums in registers, one reduction per four.
#ifndef PAGODA_CPU_BF16_TILE_H
#define PAGODA_CPU_BF16_TILE_H

#include <immintrin.h>
#include <stdint.h>

// The sums of four vectors, as the four floats of one: the reduction of a 4 x 4 tile's row.
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512d d01 = _mm512_castps_pd(s01), d23 = _mm512_castps_pd(s23);
    const __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d01, d23)),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(d01, d23)));  // a0..a3 a lane
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// MR (1-4) rows of x against 4 weight rows (w[j] for j < 4): 16 sums in registers, each weight
// vector loaded once for the MR rows, each x vector once for the 4 weight rows; sums[i] holds row
// i's four. ahead: ahead_rows weight rows (ldw apart) to prefetch, a line each per 32 of K.
__attribute__((always_inline, target("avx512f,avx512bw,avx512bf16")))
static inline void tile_sums_avx512bf16(const uint16_t *x, int64_t ldx, const uint16_t *const w[4], int64_t ldw,
                                        int64_t K, __m128 sums[4], const int MR, const uint16_t *ahead,
                                        int ahead_rows) {
    __m512 a[4][4];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < 4; j++) a[i][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh wv[4];
        for (int j = 0; j < 4; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w[j] + k);
        for (int r = 0; r < ahead_rows; r++) _mm_prefetch((const char *)(ahead + r * ldw + k), _MM_HINT_T0);
        for (int i = 0; i < MR; i++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * ldx + k);
            for (int j = 0; j < 4; j++) a[i][j] = _mm512_dpbf16_ps(a[i][j], xv, wv[j]);
        }
    }
    if (k < K) {  // the last K % 32 values, the rest of the vectors zero
        const __mmask32 left = (__mmask32)((1ull << (K - k)) - 1);
        __m512bh wv[4];
        for (int j = 0; j < 4; j++) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(left, w[j] + k);
        for (int i = 0; i < MR; i++) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(left, x + i * ldx + k);
            for (int j = 0; j < 4; j++) a[i][j] = _mm512_dpbf16_ps(a[i][j], xv, wv[j]);
        }
    }
    for (int i = 0; i < MR; i++) sums[i] = sum4(a[i][0], a[i][1], a[i][2], a[i][3]);
}

// The tile for mr (1-4) rows of x, each count its own copy (MR a constant: the sums stay in
// registers), prefetching tile t's share of the weight rows [next, end) of `base` when each tile
// of a pass takes per_tile of them: memory streams while every row of x passes, not the first.
__attribute__((always_inline, target("avx512f,avx512bw,avx512bf16")))
static inline void tile_sums(const uint16_t *x, int64_t ldx, const uint16_t *const w[4], const uint16_t *base,
                             int64_t ldw, int64_t K, __m128 sums[4], int mr, int64_t next, int64_t end,
                             int64_t t, int64_t per_tile) {
    const int64_t a0 = next + t * per_tile, a1 = a0 + per_tile < end ? a0 + per_tile : end;
    const int rows = a1 > a0 ? (int)(a1 - a0) : 0;
    const uint16_t *ahead = base + (rows ? a0 : 0) * ldw;
    if (mr == 4) tile_sums_avx512bf16(x, ldx, w, ldw, K, sums, 4, ahead, rows);
    else if (mr == 3) tile_sums_avx512bf16(x, ldx, w, ldw, K, sums, 3, ahead, rows);
    else if (mr == 2) tile_sums_avx512bf16(x, ldx, w, ldw, K, sums, 2, ahead, rows);
    else tile_sums_avx512bf16(x, ldx, w, ldw, K, sums, 1, ahead, rows);
}

#endif
