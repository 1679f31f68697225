// The fp32 register blocks of kernels/csrc/cpu_gemm.c: MR rows of x against NR (4 or 1) rows of a
// weight, each (x row, weight row) pair a dot product held in one register (AVX2: 3 x 4 = 12 of
// 16; AVX-512F: up to 6 x 4 of 32), reduced to floats at the end of the row. Shared by the fp32
// GEMM and by the weight panels (cpu_weight_panel.h), which widen quantized or bf16 weights to
// fp32 a few rows at a time and multiply them with these same blocks.
#pragma once
#include <immintrin.h>
#include <stdint.h>

#define AVX2 __attribute__((target("avx2,fma")))

/* Lanes [0, n) of a load set, the rest 0 (the tail of K). */
AVX2 static inline __m256i blk_tail_mask(int n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes);
}

/* The four 8-lane sums of a, b, c, d as one 4-lane vector. */
AVX2 static inline __m128 blk_sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

AVX2 static inline float blk_hsum(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The sums of nr (4 or 1) accumulators into dst[0, nr). */
AVX2 static inline void blk_store_sums(float *dst, const __m256 *acc, int nr) {
    if (nr == 4)
        _mm_storeu_ps(dst, blk_sum4(acc[0], acc[1], acc[2], acc[3]));
    else
        dst[0] = blk_hsum(acc[0]);
}

/* Slice i of `slices` of 4 weight rows (row_bytes each, ldw bytes apart) requested into L2. A
 * pass of x's blocks over one group of weight rows spreads the next group's fetch over its blocks,
 * one slice each, where the first block fetching it all (a burst of 144-384 lines) left the next
 * group's loads waiting (cpu_gemm.c columns has the figures). */
AVX2 static inline void blk_prefetch_slice(const char *w, int64_t ldw, int64_t row_bytes, int i, int slices) {
    const int64_t b1 = row_bytes * (i + 1) / slices;
    for (int j = 0; j < 4; j++)
        for (int64_t b = row_bytes * i / slices; b < b1; b += 64) _mm_prefetch(w + j * ldw + b, _MM_HINT_T1);
}

/* MR rows of x against NR rows of w (MR * NR <= 12 registers of sums). PREFETCH: the next NR rows
 * of w, fetched by every block where x has at most 16 rows (cpu_gemm.c columns). Past that the
 * blocks fetch nothing (the `resident` ones) and the pass spreads the next rows' fetch over its
 * blocks (blk_prefetch_slice): every block fetching them evicted what the blocks read (Zen 2,
 * the model's projections: Q4_1 panels of 96 rows 218 -> 170 ms without, the fp32 GEMM's 300
 * rows 630 -> 540 with it on the first block only), and the first block alone left 32 rows at
 * 65-67 ms against 61-62 spread. */
#define BLOCK(NAME, MR, NR, PREFETCH)                                                         \
AVX2 static void NAME##_##MR##x##NR(const float *x, int64_t ldx, const float *w, int64_t ldw,   \
                              float *out, int64_t ldo, int K) {                            \
    __m256 acc[MR][NR];                                                                     \
    for (int i = 0; i < MR; i++)                                                            \
        for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();                       \
    int k = 0;                                                                              \
    for (; k + 8 <= K; k += 8) {                                                            \
        __m256 wv[NR];                                                                      \
        for (int j = 0; j < NR; j++) {                                                      \
            wv[j] = _mm256_loadu_ps(w + j * ldw + k);                                       \
            if (PREFETCH) _mm_prefetch((const char *)(w + (NR + j) * ldw + k), _MM_HINT_T0); \
        }                                                                                   \
        for (int i = 0; i < MR; i++) {                                                      \
            __m256 xv = _mm256_loadu_ps(x + i * ldx + k);                                   \
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]); \
        }                                                                                   \
    }                                                                                       \
    if (k < K) {                                                                            \
        __m256i mask = blk_tail_mask(K - k);                                                    \
        __m256 wv[NR];                                                                      \
        for (int j = 0; j < NR; j++) wv[j] = _mm256_maskload_ps(w + j * ldw + k, mask);     \
        for (int i = 0; i < MR; i++) {                                                      \
            __m256 xv = _mm256_maskload_ps(x + i * ldx + k, mask);                          \
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]); \
        }                                                                                   \
    }                                                                                       \
    for (int i = 0; i < MR; i++) blk_store_sums(out + i * ldo, acc[i], NR);                     \
}

BLOCK(block, 3, 4, 1) BLOCK(block, 2, 4, 1) BLOCK(block, 1, 4, 1)
BLOCK(block, 3, 1, 1) BLOCK(block, 2, 1, 1) BLOCK(block, 1, 1, 1)
BLOCK(resident, 3, 4, 0) BLOCK(resident, 2, 4, 0) BLOCK(resident, 1, 4, 0)
BLOCK(resident, 3, 1, 0) BLOCK(resident, 2, 1, 0) BLOCK(resident, 1, 1, 0)

/* The AVX-512F blocks: 16 lanes, MR up to 6 (6 x 4 sums + 4 w + 1 x of the 32 registers). */
__attribute__((target("avx512f,avx2,fma")))
static inline __m256 blk_fold(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

#define BLOCK512(NAME, MR, NR, PREFETCH)                                                       \
__attribute__((target("avx512f,avx2,fma")))                                                    \
static void NAME##_##MR##x##NR(const float *x, int64_t ldx, const float *w, int64_t ldw,  \
                                 float *out, int64_t ldo, int K) {                          \
    __m512 acc[MR][NR];                                                                      \
    for (int i = 0; i < MR; i++)                                                             \
        for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();                        \
    int k = 0;                                                                               \
    for (; k + 16 <= K; k += 16) {                                                           \
        __m512 wv[NR];                                                                       \
        for (int j = 0; j < NR; j++) {                                                       \
            wv[j] = _mm512_loadu_ps(w + j * ldw + k);                                        \
            if (PREFETCH) _mm_prefetch((const char *)(w + (NR + j) * ldw + k), _MM_HINT_T0); \
        }                                                                                    \
        for (int i = 0; i < MR; i++) {                                                       \
            __m512 xv = _mm512_loadu_ps(x + i * ldx + k);                                    \
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);  \
        }                                                                                    \
    }                                                                                        \
    if (k < K) {                                                                             \
        const __mmask16 mask = (__mmask16)((1u << (K - k)) - 1);                             \
        __m512 wv[NR];                                                                       \
        for (int j = 0; j < NR; j++) wv[j] = _mm512_maskz_loadu_ps(mask, w + j * ldw + k);   \
        for (int i = 0; i < MR; i++) {                                                       \
            __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * ldx + k);                        \
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);  \
        }                                                                                    \
    }                                                                                        \
    for (int i = 0; i < MR; i++) {                                                           \
        __m256 folded[NR];                                                                   \
        for (int j = 0; j < NR; j++) folded[j] = blk_fold(acc[i][j]);                            \
        blk_store_sums(out + i * ldo, folded, NR);                                               \
    }                                                                                        \
}

#define BLOCKS512(NAME, PREFETCH)                                                                      \
    BLOCK512(NAME, 6, 4, PREFETCH) BLOCK512(NAME, 5, 4, PREFETCH) BLOCK512(NAME, 4, 4, PREFETCH)           \
    BLOCK512(NAME, 3, 4, PREFETCH) BLOCK512(NAME, 2, 4, PREFETCH) BLOCK512(NAME, 1, 4, PREFETCH)           \
    BLOCK512(NAME, 6, 1, PREFETCH) BLOCK512(NAME, 5, 1, PREFETCH) BLOCK512(NAME, 4, 1, PREFETCH)           \
    BLOCK512(NAME, 3, 1, PREFETCH) BLOCK512(NAME, 2, 1, PREFETCH) BLOCK512(NAME, 1, 1, PREFETCH)
BLOCKS512(block512, 1)
BLOCKS512(resident512, 0)

typedef void (*block_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, int);

typedef struct {
    int most;               /* rows of x a block takes */
    block_fn four[7], one[7];  /* [mr]: mr rows of x against 4 (1) rows of w */
} Blocks;

static const Blocks AVX2_BLOCKS = {3, {0, block_1x4, block_2x4, block_3x4},
                                   {0, block_1x1, block_2x1, block_3x1}};
/* The same blocks without the prefetch: for weights already in cache. */
static const Blocks AVX2_RESIDENT_BLOCKS = {3, {0, resident_1x4, resident_2x4, resident_3x4},
                                            {0, resident_1x1, resident_2x1, resident_3x1}};
static const Blocks AVX512_BLOCKS = {6, {0, block512_1x4, block512_2x4, block512_3x4, block512_4x4, block512_5x4, block512_6x4},
                                     {0, block512_1x1, block512_2x1, block512_3x1, block512_4x1, block512_5x1, block512_6x1}};
static const Blocks AVX512_RESIDENT_BLOCKS = {6, {0, resident512_1x4, resident512_2x4, resident512_3x4, resident512_4x4,
                                                  resident512_5x4, resident512_6x4},
                                              {0, resident512_1x1, resident512_2x1, resident512_3x1, resident512_4x1,
                                               resident512_5x1, resident512_6x1}};

/* Rows of x taken as one chunk that stays in L2 while a share of the weights passes over it. */
#define MAX_ROW_CHUNK 96
