// out[M, N] (bf16) = x[M, K] (bf16) @ w[N, K]^T (bf16), fp32 accumulation, rounded once to
// bf16 (round to nearest even), as torch's bf16 linear rounds. For the few rows of a decode
// step, where torch's bf16 linear reads the weights at a small fraction of the memory bandwidth.
//
// One library, two instruction sets chosen at run time (pagoda_bf16_isa): AVX512-BF16 dot
// products (vdpbf16ps, 32 products an instruction) and an AVX2 + FMA path that widens bf16 to
// fp32 with a shift. Each output column's weight row is read once for all M rows of x, which
// stay in L1, so with few rows the kernel runs at the speed weights stream from memory.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

int pagoda_bf16_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw")) return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
    return 0;
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// Up to 4 rows of x against one weight row: each weight vector is loaded once for all of them.
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

__attribute__((target("avx2,fma")))
static inline __m256 widen(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

__attribute__((target("avx2,fma")))
static void dots_avx2(const uint16_t *x, int64_t ldx, int rows, const uint16_t *w, int64_t K,
                      float *s) {
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv = widen(w + k);
        for (int m = 0; m < rows; m++) a[m] = _mm256_fmadd_ps(widen(x + m * ldx + k), wv, a[m]);
    }
    for (int m = 0; m < rows; m++) {
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(a[m]), _mm256_extractf128_ps(a[m], 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        float t = _mm_cvtss_f32(h);
        for (int64_t j = k; j < K; j++) t += from_bf16(x[m * ldx + j]) * from_bf16(w[j]);
        s[m] = t;
    }
}

// isa: 2 = AVX512-BF16, 1 = AVX2 + FMA (the caller asks pagoda_bf16_isa which it may use).
void pagoda_bf16_xwt(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw,
                     uint16_t *out, int64_t ldo, int M, int64_t N, int64_t K, int threads, int isa) {
    void (*dots)(const uint16_t *, int64_t, int, const uint16_t *, int64_t, float *) =
        isa == 2 ? dots_avx512bf16 : dots_avx2;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *wn = w + n * ldw;
        float s[4];
        for (int m = 0; m < M; m += 4) {
            int rows = M - m < 4 ? M - m : 4;
            dots(x + m * ldx, ldx, rows, wn, K, s);
            for (int r = 0; r < rows; r++) out[(m + r) * ldo + n] = to_bf16(s[r]);
        }
    }
}
