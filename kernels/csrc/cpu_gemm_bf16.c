// out[M, N] (bf16) = x[M, K] (bf16) @ w[N, K]^T (bf16), fp32 accumulation, rounded once to
// bf16 (round to nearest even), as torch's bf16 linear rounds. For the few rows of a decode
// step, where torch's bf16 linear reads the weights at a small fraction of the memory bandwidth.
//
// One library, three instruction sets chosen at run time (pagoda_bf16_isa): AMX tiles
// (cpu_bf16_amx.h) past a few rows, AVX512-BF16 dot products (vdpbf16ps, 32 products an
// instruction) and an AVX2 + FMA path that widens bf16 to fp32 with a shift or a mask. Each
// weight row is read once for all M rows of x, which stay in L1 or L2, so with few rows the kernel runs at the speed weights stream from memory; with more
// (AVX512-BF16: tiles of 4 x 4, one reduction for four sums) it runs past torch's bf16 linear
// up to the rows worker/model/cpu_matmul.py measures at start-up.
#include "cpu_bf16_tile.h"

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#include "cpu_bf16_amx.h"

int pagoda_bf16_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
        __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") && amx_permitted())
        return 3;
    if (__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw")) return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
    return 0;
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// Up to 4 rows of x against one weight row: each weight vector is loaded once for all of them.
// With 1-4 rows of x, one weight row at a time (a single stream a thread) reads the weights
// faster than tiles of four rows (bench/bench_gemm.py --dtype bfloat16: 6.5 against 7.6 ms with
// one row); from 8 rows the tiles' fewer reductions win.
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static void dots_avx512bf16(const uint16_t *x, int64_t ldx, int rows, const uint16_t *w,
                            int64_t K, float *s) {
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k);
        for (int m = 0; m < rows; m++)
            a[m] = _mm512_dpbf16_ps(a[m], (__m512bh)_mm512_loadu_si512(x + m * ldx + k), wv);
    }
    for (int m = 0; m < rows; m++) {
        float t = _mm512_reduce_add_ps(a[m]);
        for (int64_t j = k; j < K; j++) t += from_bf16(x[m * ldx + j]) * from_bf16(w[j]);
        s[m] = t;
    }
}

#define ROW_AT_A_TIME 4  // rows of x up to which dots_avx512bf16 serves

// Four sums rounded to bf16 as to_bf16 rounds (to nearest even, a NaN made quiet), in the low
// half: one tile row's outputs in a few vector instructions instead of a scalar loop.
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static inline __m128i round4_bf16(__m128 v) {
    const __m128i u = _mm_castps_si128(v);
    const __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
    const __m128i even = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(u, _mm_set1_epi32(0x7fff)), lsb), 16);
    const __m128i quiet = _mm_or_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(0x40));
    const __m128i r = _mm_blendv_epi8(even, quiet, _mm_castps_si128(_mm_cmpunord_ps(v, v)));
    return _mm_packus_epi32(r, r);
}

// A tile's sums rounded into out[i * ldo + j] (mr rows, nr of the 4 columns kept).
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static inline void store_rounded(const __m128 sums[4], int mr, int nr, uint16_t *out, int64_t ldo) {
    for (int i = 0; i < mr; i++) {
        const __m128i r = round4_bf16(sums[i]);
        if (nr == 4) {
            _mm_storel_epi64((__m128i *)(out + i * ldo), r);
        } else {
            uint16_t v[8];
            _mm_storeu_si128((__m128i *)v, r);
            for (int j = 0; j < nr; j++) out[i * ldo + j] = v[j];
        }
    }
}

// Weight rows in blocks of up to four groups of four (as many as fit 24 KB, so that they stay in
// L1 beside a tile of x), the blocks split over the threads; for each block, every 4 rows of x
// against each group: a tile of x is read from L2 once per block, not once per group, and the
// weights stream from memory once. A group past N's end repeats its last row and drops its sums.
// The next block is prefetched a few rows a tile over all of the block's tiles: prefetched only
// while the first rows of x passed (as before), memory idled while the others did, and 8-48 rows
// ran 5-19% slower (bench/bench_gemm.py --dtype bfloat16).
// That walk as an orphaned worksharing loop over the blocks (its callers' threads split them, in a
// static schedule): BODY sees each tile's sums (rows m .. m + mr - 1 of x, weight rows n .. n + nr
// - 1). Shared by xwt_avx512bf16 and the greedy max (cpu_bf16_greedy.h), which must compute every
// product as this computes it.
#define BF16_TILES(x, ldx, w, ldw, M, N, K, BODY)                                                       \
    do {                                                                                                 \
        const int64_t groups_ = ((N) + 3) / 4;                                                           \
        const int64_t fit_ = 24576 / (4 * 2 * (K)), per_block_ = fit_ < 1 ? 1 : fit_ > 4 ? 4 : fit_;     \
        const int64_t blocks_ = (groups_ + per_block_ - 1) / per_block_;                                 \
        const int64_t tiles_ = ((M) + 3) / 4 * per_block_, block_rows_ = 4 * per_block_;                 \
        const int64_t per_tile_ = (block_rows_ + tiles_ - 1) / tiles_;                                   \
        _Pragma("omp for schedule(static)")                                                              \
        for (int64_t b_ = 0; b_ < blocks_; b_++) {                                                       \
            const int64_t g1_ = (b_ + 1) * per_block_ < groups_ ? (b_ + 1) * per_block_ : groups_;       \
            const int64_t next_ = g1_ * 4, end_ = next_ + block_rows_ < (N) ? next_ + block_rows_ : (N); \
            int64_t t_ = 0;                                                                              \
            for (int m = 0; m < (M); m += 4) {                                                           \
                const int mr = (M) - m < 4 ? (M) - m : 4;                                                \
                for (int64_t g_ = b_ * per_block_; g_ < g1_; g_++, t_++) {                               \
                    const int64_t n = g_ * 4;                                                            \
                    const int nr = (N) - n < 4 ? (int)((N) - n) : 4;                                     \
                    const uint16_t *rows_[4];                                                            \
                    for (int j_ = 0; j_ < 4; j_++) rows_[j_] = (w) + (n + (j_ < nr ? j_ : nr - 1)) * (ldw); \
                    __m128 sums[4];                                                                      \
                    tile_sums((x) + m * (ldx), ldx, rows_, w, ldw, K, sums, mr, next_, end_, t_, per_tile_); \
                    BODY                                                                                 \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
    } while (0)

__attribute__((target("avx512f,avx512bw,avx512bf16")))
static void xwt_avx512bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw, uint16_t *out,
                           int64_t ldo, int M, int64_t N, int64_t K, int threads) {
    #pragma omp parallel num_threads(threads)
    BF16_TILES(x, ldx, w, ldw, M, N, K, store_rounded(sums, mr, nr, out + m * ldo + n, ldo););
}

// The AVX2 path, in the fp32 kernel's blocks (kernels/csrc/cpu_gemm.c): four weight rows at a
// time against every 3 rows of x, 12 sums in registers. 16 bf16 weights are one load, and two
// instructions make them fp32: a shift left by 16 gives the even ones, a mask the odd ones (a
// bf16 is the top half of an fp32). x is widened once per call into that order (each 16 of a row
// as its 8 even values, then its 8 odd ones), so that the pairs line up. Widening x and W for
// every (row, weight row) pair made 8 rows cost 2.3x one row; widening by zero-extension and
// shift, 2 instructions for 8 weights, held 8-64 rows at 62 GFLOP/s.
#define MR2 3
__attribute__((target("avx2,fma")))
static inline float hsum8(__m256 a) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// mr (1-3) rows of xf (fp32, K16 values in even/odd order, then the tail as it is) against nr
// (1-4) rows of w; sums into s[i * 4 + j].
__attribute__((target("avx2,fma")))
static void block_avx2(const float *xf, int64_t K, int mr, const uint16_t *w, int64_t ldw, int nr,
                       float *s) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    const int64_t K16 = K / 16 * 16;
    __m256 a[MR2][4];
    for (int i = 0; i < MR2; i++)
        for (int j = 0; j < 4; j++) a[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K16; k += 16) {
        for (int j = 0; j < nr; j++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(w + j * ldw + k));
            _mm_prefetch((const char *)(w + (nr + j) * ldw + k), _MM_HINT_T0);
            __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
            __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
            for (int i = 0; i < mr; i++) {
                a[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xf + i * K + k), even, a[i][j]);
                a[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xf + i * K + k + 8), odd, a[i][j]);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float t = hsum8(a[i][j]);
            for (int64_t r = K16; r < K; r++) t += xf[i * K + r] * from_bf16(w[j * ldw + r]);
            s[i * 4 + j] = t;
        }
}

__attribute__((target("avx2,fma")))
static void xwt_avx2(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw,
                     uint16_t *out, int64_t ldo, int M, int64_t N, int64_t K, int threads) {
    float *xf = malloc((size_t)M * (size_t)K * sizeof(float));
    if (!xf) return;  // a few rows of x: kilobytes
    const int64_t K16 = K / 16 * 16;
    for (int m = 0; m < M; m++) {
        const uint16_t *xm = x + m * ldx;
        float *row = xf + m * K;
        for (int64_t k = 0; k < K16; k += 16)
            for (int t = 0; t < 8; t++) {
                row[k + t] = from_bf16(xm[k + 2 * t]);
                row[k + 8 + t] = from_bf16(xm[k + 2 * t + 1]);
            }
        for (int64_t k = K16; k < K; k++) row[k] = from_bf16(xm[k]);
    }
    int64_t groups = (N + 3) / 4;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        int64_t n = g * 4;
        int nr = N - n < 4 ? (int)(N - n) : 4;
        float s[MR2 * 4];
        for (int m = 0; m < M; m += MR2) {
            int mr = M - m < MR2 ? M - m : MR2;
            block_avx2(xf + m * K, K, mr, w + n * ldw, ldw, nr, s);
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < nr; j++) out[(m + i) * ldo + n + j] = to_bf16(s[i * 4 + j]);
        }
    }
    free(xf);
}

// isa: 3 = AMX (with AVX512-BF16 for a few rows and what the tiles leave), 2 = AVX512-BF16,
// 1 = AVX2 + FMA (the caller asks pagoda_bf16_isa which it may use). few_tiles: 1-4 rows of x
// take the 4 x 4 tiles too, not one weight row at a time; which streams faster is the CPU's
// (worker/model/cpu_matmul.py measures it): one row at a time on a Zen 5 EPYC (6.4 against 7.6 ms for
// the model's projections), the tiles on an AMX Xeon (10.1 against 13.2; 4 rows 13.1 against 20.6).
void pagoda_bf16_xwt(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw,
                     uint16_t *out, int64_t ldo, int M, int64_t N, int64_t K, int threads, int isa,
                     int few_tiles) {
    if (isa == 3 && M > ROW_AT_A_TIME) {
        const int64_t done = xwt_amx(x, ldx, w, ldw, out, ldo, M, N, K, threads);
        if (done < N) xwt_avx512bf16(x, ldx, w + done * ldw, ldw, out + done, ldo, M, N - done, K, threads);
        return;
    }
    if (isa < 2) {
        xwt_avx2(x, ldx, w, ldw, out, ldo, M, N, K, threads);
        return;
    }
    if (M > ROW_AT_A_TIME || few_tiles) {
        xwt_avx512bf16(x, ldx, w, ldw, out, ldo, M, N, K, threads);
        return;
    }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float s[4];
        dots_avx512bf16(x, ldx, M, w + n * ldw, K, s);
        for (int r = 0; r < M; r++) out[r * ldo + n] = to_bf16(s[r]);
    }
}

#include "cpu_bf16_greedy.h"

// out[m] = the index n of the largest x[m] . w[n] (M rows, N columns), each product computed and
// rounded as pagoda_bf16_xwt computes and rounds it for the same arguments (cpu_bf16_greedy.h):
// torch's max over xwt's output gives the same indices. Returns 0, or -1 where this CPU has no
// path for it (isa < 2) or memory ran short; out is then untouched.
int pagoda_bf16_greedy(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw, int M, int64_t N,
                       int64_t K, int threads, int isa, int few_tiles, int64_t *out) {
    if (isa < 2 || M < 1 || N < 1 || N > INT32_MAX || threads < 1) return -1;
    uint16_t *xp = NULL;
    int64_t tiled = 0;  // the columns the AMX tiles take, as xwt_amx takes them
    if (isa == 3 && M > ROW_AT_A_TIME && N >= AMX_GROUP && K % AMX_K == 0) {
        xp = amx_pack_x(x, ldx, M, K);
        if (xp) tiled = N / AMX_GROUP * AMX_GROUP;
    }
    Best *each = calloc((size_t)threads, sizeof(Best));
    int ok = each != NULL;
    for (int t = 0; ok && t < threads; t++) ok = best_init(&each[t], M);
    if (ok) {
        #pragma omp parallel num_threads(threads)
        {
            Best *b = &each[omp_get_thread_num()];
            if (tiled) {
                amx_configure();
                greedy_amx(xp, w, ldw, M, tiled / AMX_GROUP, K / AMX_K, b);
                amx_release();
            }
            if (tiled < N) {
                if (M > ROW_AT_A_TIME || few_tiles) greedy_tiles(x, ldx, w + tiled * ldw, ldw, M, N - tiled, K, tiled, b);
                else greedy_dots(x, ldx, w + tiled * ldw, ldw, M, N - tiled, K, tiled, b);
            }
        }
        best_merge(each, threads, M, out);
    }
    for (int t = 0; each && t < threads; t++) best_free(&each[t]);
    free(each);
    free(xp);
    return ok ? 0 : -1;
}
