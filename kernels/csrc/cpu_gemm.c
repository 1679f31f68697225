/* out[M, N] = x[M, K] @ w[N, K]^T in fp32, for the CPU projections of a step with few rows.
 *
 * MKL's sgemm streams the weights at a fraction of the memory bandwidth when x has few rows
 * (kernels/cpu_gemm.py has the figures). Here each thread takes a contiguous share of w's rows
 * and reads it once, in its own layout: four rows at a time stay in L1 while every 3-row block
 * of x passes over them, and each (x row, w row) pair is a dot product held in one AVX2
 * register, 12 of them at once, reduced to floats at the end of the row.
 *
 * An AVX-512F path (cpu_gemm_isa says whether this CPU runs it; both are tested) does the same
 * with 16-lane registers and blocks of up to 6 rows of x, so that a verification's 5 rows
 * (speculative decoding) are one pass over the weights: on a 2-core AVX-512 Xeon 5 rows took
 * 1.55x one row's time with the AVX2 blocks (bench/bench_gemm.py).
 *
 * Each path is compiled for its instruction set (per-function target attributes), so the library
 * builds and loads on any x86-64 and cpu_gemm_isa says 0 where neither runs. Built with -O3
 * -fopenmp; libgomp.so.1 resolves to the copy torch has loaded, so these threads are torch's
 * threads. */
#define AVX2 __attribute__((target("avx2,fma")))
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

/* Lanes [0, n) of a load set, the rest 0 (the tail of K). */
AVX2 static inline __m256i tail_mask(int n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes);
}

/* The four 8-lane sums of a, b, c, d as one 4-lane vector. */
AVX2 static inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

AVX2 static inline float hsum(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The sums of nr (4 or 1) accumulators into dst[0, nr). */
AVX2 static inline void store_sums(float *dst, const __m256 *acc, int nr) {
    if (nr == 4)
        _mm_storeu_ps(dst, sum4(acc[0], acc[1], acc[2], acc[3]));
    else
        dst[0] = hsum(acc[0]);
}

/* MR rows of x against NR rows of w (MR * NR <= 12 registers of sums). */
#define BLOCK(MR, NR)                                                                         \
AVX2 static void block_##MR##x##NR(const float *x, int64_t ldx, const float *w, int64_t ldw,    \
                              float *out, int64_t ldo, int K) {                            \
    __m256 acc[MR][NR];                                                                     \
    for (int i = 0; i < MR; i++)                                                            \
        for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();                       \
    int k = 0;                                                                              \
    for (; k + 8 <= K; k += 8) {                                                            \
        __m256 wv[NR];                                                                      \
        for (int j = 0; j < NR; j++) {                                                      \
            wv[j] = _mm256_loadu_ps(w + j * ldw + k);                                       \
            _mm_prefetch((const char *)(w + (NR + j) * ldw + k), _MM_HINT_T0);              \
        }                                                                                   \
        for (int i = 0; i < MR; i++) {                                                      \
            __m256 xv = _mm256_loadu_ps(x + i * ldx + k);                                   \
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]); \
        }                                                                                   \
    }                                                                                       \
    if (k < K) {                                                                            \
        __m256i mask = tail_mask(K - k);                                                    \
        __m256 wv[NR];                                                                      \
        for (int j = 0; j < NR; j++) wv[j] = _mm256_maskload_ps(w + j * ldw + k, mask);     \
        for (int i = 0; i < MR; i++) {                                                      \
            __m256 xv = _mm256_maskload_ps(x + i * ldx + k, mask);                          \
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]); \
        }                                                                                   \
    }                                                                                       \
    for (int i = 0; i < MR; i++) store_sums(out + i * ldo, acc[i], NR);                     \
}

BLOCK(3, 4) BLOCK(2, 4) BLOCK(1, 4)
BLOCK(3, 1) BLOCK(2, 1) BLOCK(1, 1)

/* The AVX-512F blocks: 16 lanes, MR up to 6 (6 x 4 sums + 4 w + 1 x of the 32 registers). */
__attribute__((target("avx512f,avx2,fma")))
static inline __m256 fold(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

#define BLOCK512(MR, NR)                                                                       \
__attribute__((target("avx512f,avx2,fma")))                                                    \
static void block512_##MR##x##NR(const float *x, int64_t ldx, const float *w, int64_t ldw,  \
                                 float *out, int64_t ldo, int K) {                          \
    __m512 acc[MR][NR];                                                                      \
    for (int i = 0; i < MR; i++)                                                             \
        for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();                        \
    int k = 0;                                                                               \
    for (; k + 16 <= K; k += 16) {                                                           \
        __m512 wv[NR];                                                                       \
        for (int j = 0; j < NR; j++) {                                                       \
            wv[j] = _mm512_loadu_ps(w + j * ldw + k);                                        \
            _mm_prefetch((const char *)(w + (NR + j) * ldw + k), _MM_HINT_T0);               \
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
        for (int j = 0; j < NR; j++) folded[j] = fold(acc[i][j]);                            \
        store_sums(out + i * ldo, folded, NR);                                               \
    }                                                                                        \
}

BLOCK512(6, 4) BLOCK512(5, 4) BLOCK512(4, 4) BLOCK512(3, 4) BLOCK512(2, 4) BLOCK512(1, 4)
BLOCK512(6, 1) BLOCK512(5, 1) BLOCK512(4, 1) BLOCK512(3, 1) BLOCK512(2, 1) BLOCK512(1, 1)

#define MAX_ROW_CHUNK 96

typedef void (*block_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, int);

typedef struct {
    int most;               /* rows of x a block takes */
    block_fn four[7], one[7];  /* [mr]: mr rows of x against 4 (1) rows of w */
} Blocks;

static const Blocks AVX2_BLOCKS = {3, {0, block_1x4, block_2x4, block_3x4},
                                   {0, block_1x1, block_2x1, block_3x1}};
static const Blocks AVX512_BLOCKS = {6, {0, block512_1x4, block512_2x4, block512_3x4, block512_4x4, block512_5x4, block512_6x4},
                                     {0, block512_1x1, block512_2x1, block512_3x1, block512_4x1, block512_5x1, block512_6x1}};

/* 2: AVX-512F, 1: AVX2 + FMA, 0: neither (the caller uses torch). */
int cpu_gemm_isa(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0;
    return __builtin_cpu_supports("avx512f") ? 2 : 1;
}

/* Rows [n0, n1) of w, all M rows of x. */
AVX2 static void columns(const Blocks *b, const float *x, int64_t ldx, const float *w, int64_t ldw, float *out,
                    int64_t ldo, int M, int64_t n0, int64_t n1, int K) {
    for (int64_t n = n0; n < n1;) {
        int nr = n1 - n >= 4 ? 4 : 1;
        const block_fn *fns = nr == 4 ? b->four : b->one;
        for (int m = 0; m < M;) {
            int mr = M - m >= b->most ? b->most : M - m;
            fns[mr](x + m * ldx, ldx, w + n * ldw, ldw, out + m * ldo + n, ldo, K);
            m += mr;
        }
        n += nr;
    }
}

void cpu_gemm_xwt(const float *x, int64_t ldx, const float *w, int64_t ldw, float *out,
                  int64_t ldo, int M, int64_t N, int K, int num_threads, int isa) {
    if (M <= 0 || N <= 0)
        return;
    const Blocks *b = isa == 2 ? &AVX512_BLOCKS : &AVX2_BLOCKS;
    /* Shares in whole 4-row groups; the last thread takes the rest. */
    int64_t groups = N / 4;
    /* Equal chunks of at most MAX_ROW_CHUNK rows, in whole blocks. */
    int chunks = (M + MAX_ROW_CHUNK - 1) / MAX_ROW_CHUNK;
    int chunk = ((M + chunks - 1) / chunks + b->most - 1) / b->most * b->most;
    #pragma omp parallel num_threads(num_threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t n0 = groups * t / nt * 4;
        int64_t n1 = t == nt - 1 ? N : groups * (t + 1) / nt * 4;
        /* x in chunks of rows that stay in L2 while the share of w passes over them. */
        for (int m0 = 0; m0 < M; m0 += chunk) {
            int mc = M - m0 < chunk ? M - m0 : chunk;
            columns(b, x + m0 * ldx, ldx, w, ldw, out + m0 * ldo, ldo, mc, n0, n1, K);
        }
    }
}
