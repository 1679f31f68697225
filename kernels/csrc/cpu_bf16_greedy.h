// Greedy sampling fused into the vocabulary projection (kernels/csrc/cpu_gemm_bf16.c): for each
// row of x, the index of the largest of x . W[n] over the vocabulary, each product computed by
// the path pagoda_bf16_xwt takes for the same shapes and rounded to bf16 as it rounds, so the
// index is the one torch's max over xwt's logits gives: the first of tied maxima, the first NaN.
// The logits are never written: a step's [rows, vocab] of bf16, widened to fp32 and read again
// by a separate max, cost a 64-row decode step about 1.5 ms on an AMX Xeon, and the vocabulary
// projection alone streams its 57 MB of weights in about 2.
//
// Each thread keeps 16 candidates a row (lane j: the best of the indices it saw in that lane,
// in increasing order, so a strict comparison keeps the first); the threads' candidates are
// merged at the end in thread order, which is index order under a static schedule.
#ifndef PAGODA_CPU_BF16_GREEDY_H
#define PAGODA_CPU_BF16_GREEDY_H

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    float *v;     // [rows][16]: each lane's best value
    int32_t *i;   // [rows][16]: its index, -1 while the lane has seen none
} Best;

static int best_init(Best *b, int rows) {
    b->v = aligned_alloc(64, (size_t)rows * 16 * sizeof(float));
    b->i = aligned_alloc(64, (size_t)rows * 16 * sizeof(int32_t));
    if (!b->v || !b->i) return 0;
    for (int64_t k = 0; k < (int64_t)rows * 16; k++) {
        b->v[k] = -INFINITY;
        b->i[k] = -1;
    }
    return 1;
}

static void best_free(Best *b) {
    free(b->v);
    free(b->i);
}

// Lanes `valid` of v (already rounded to bf16) are the values of indices n0 + lane for row m.
// A lane takes a value greater than its best, a NaN over a number, anything while it is empty.
__attribute__((target("avx512f,avx512bw")))
static inline void best_update(Best *b, int m, __m512 v, int32_t n0, __mmask16 valid) {
    float *bv = b->v + (int64_t)m * 16;
    int32_t *bi = b->i + (int64_t)m * 16;
    const __m512 old = _mm512_load_ps(bv);
    const __m512i oldi = _mm512_load_si512(bi);
    __mmask16 take = _mm512_mask_cmp_ps_mask(valid, v, old, _CMP_GT_OQ);
    take |= _mm512_mask_cmp_ps_mask(valid, v, v, _CMP_UNORD_Q) & _mm512_cmp_ps_mask(old, old, _CMP_ORD_Q);
    take |= valid & _mm512_cmplt_epi32_mask(oldi, _mm512_setzero_si512());
    if (!take) return;
    const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(n0),
                                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    _mm512_store_ps(bv, _mm512_mask_blend_ps(take, old, v));
    _mm512_store_si512(bi, _mm512_mask_blend_epi32(take, oldi, idx));
}

// Whether candidate (v, i) wins over (bv, bi): by value, a NaN over a number, a lower index on a
// tie (and among NaNs).
static inline int best_wins(float v, int32_t i, float bv, int32_t bi) {
    if (i < 0) return 0;
    if (bi < 0) return 1;
    if (isnan(v) || isnan(bv)) return isnan(v) && (!isnan(bv) || i < bi);
    return v > bv || (v == bv && i < bi);
}

// out[m] = the winner of every thread's lanes of row m (threads[t] is thread t's Best).
static void best_merge(const Best *threads, int team, int rows, int64_t *out) {
    for (int m = 0; m < rows; m++) {
        float bv = -INFINITY;
        int32_t bi = -1;
        for (int t = 0; t < team; t++)
            for (int l = 0; l < 16; l++) {
                const float v = threads[t].v[(int64_t)m * 16 + l];
                const int32_t i = threads[t].i[(int64_t)m * 16 + l];
                if (best_wins(v, i, bv, bi)) {
                    bv = v;
                    bi = i;
                }
            }
        out[m] = bi;
    }
}

// Four sums of a tile row rounded as round4_bf16 rounds, widened back to fp32 in lanes 0-3.
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static inline __m512 rounded4(__m128 sums) {
    const __m128 r = _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(round4_bf16(sums)), 16));
    return _mm512_castps128_ps512(r);
}

// xwt_avx512bf16's blocks and tiles over columns [0, N), each tile's sums into b.
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static void greedy_tiles(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw, int M, int64_t N,
                         int64_t K, int64_t col0, Best *b) {
    BF16_TILES(x, ldx, w, ldw, M, N, K, {
        for (int i = 0; i < mr; i++)
            best_update(b, m + i, rounded4(sums[i]), (int32_t)(col0 + n), (__mmask16)((1u << nr) - 1));
    });
}

// pagoda_bf16_xwt's one weight row at a time (1-4 rows of x, few_tiles off), columns [0, N).
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static void greedy_dots(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw, int M, int64_t N,
                        int64_t K, int64_t col0, Best *b) {
    #pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float s[4];
        dots_avx512bf16(x, ldx, M, w + n * ldw, K, s);
        for (int r = 0; r < M; r++)
            best_update(b, r, _mm512_set1_ps(from_bf16(to_bf16(s[r]))), (int32_t)(col0 + n), 1);
    }
}

// xwt_amx's groups of 32 columns over [0, groups * 32), each C tile's rows into b; xp: x packed.
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw")))
static void greedy_amx(const uint16_t *xp, const uint16_t *w, int64_t ldw, int M, int64_t groups, int64_t steps,
                       Best *b) {
    const int blocks = (M + AMX_TILE - 1) / AMX_TILE;
    float c[4][AMX_TILE][AMX_TILE];
    #pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const uint16_t *wg = w + g * AMX_GROUP * ldw;
        const uint16_t *ahead = g + 1 < groups ? wg + AMX_GROUP * ldw : NULL;
        for (int blk = 0; blk < blocks; blk += 2) {
            const int both = blk + 1 < blocks;
            amx_products(wg, ldw, xp + (int64_t)blk * steps * AMX_B_VALUES, both, steps, c, blk == 0 ? ahead : NULL);
            for (int t = 0; t < (both ? 4 : 2); t++) {
                const int m0 = (blk + t / 2) * AMX_TILE, mr = M - m0 < AMX_TILE ? M - m0 : AMX_TILE;
                __m512i r[16];
                for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_si512(c[t][j]);
                transpose16(r);  // r[i]: row m0 + i's 16 columns
                for (int i = 0; i < mr; i++)
                    best_update(b, m0 + i, rounded16_bf16(_mm512_castsi512_ps(r[i])),
                                (int32_t)(g * AMX_GROUP + (t % 2) * AMX_TILE), 0xffff);
            }
        }
    }
}

#endif
