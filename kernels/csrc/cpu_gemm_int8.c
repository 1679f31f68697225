// out[M, N] (fp32) = x[M, K] (fp32) @ (scale[N] * w[N, K])^T with w int8, one scale per output
// channel: weight-only int8 (--quantization int8). A decode step reads every weight once, so a
// single stream's step is bound by the bytes of its weights; int8 weights are a quarter of fp32's.
// The int8 values are widened to fp32 in registers and multiplied there (no int8 arithmetic, so
// the activations stay exact fp32 and no VNNI is needed); the scale is applied once per output.
//
// Two instruction sets chosen at run time (pagoda_int8_isa): AVX-512F (16 weights an
// instruction) and AVX2 + FMA (8). Each weight row is read once for up to 4 rows of x, which
// stay in L1.
#include <immintrin.h>
#include <stdint.h>

int pagoda_int8_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
    return 0;
}

__attribute__((target("avx512f")))
static void dots_avx512(const float *x, int64_t ldx, int rows, const int8_t *w, int64_t K, float *s) {
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + k))));
        for (int m = 0; m < rows; m++)
            a[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * ldx + k), wv, a[m]);
    }
    for (int m = 0; m < rows; m++) {
        float t = _mm512_reduce_add_ps(a[m]);
        for (int64_t j = k; j < K; j++) t += x[m * ldx + j] * (float)w[j];
        s[m] = t;
    }
}

// AVX2: 32 weights a pass, the row count a constant of each compiled case, and one or two rows
// of x keeping four sums each: with one sum a row, each FMA waited about 5 cycles for the last,
// so one row of x took 8 weights per 5 cycles whatever memory gave (a Zen 2 EPYC: 8.5 GB/s of
// int8 weights on two cores, where it copies at 23).
#define SUMS(rows) ((rows) <= 2 ? 4 : 2)

__attribute__((target("avx2,fma"), always_inline))
static inline __m256 widen8(const int8_t *w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
}

__attribute__((target("avx2,fma"), always_inline))
static inline void body_avx2(const float *x, int64_t ldx, const int8_t *w, int64_t K, float *s, const int rows) {
    __m256 a[4][4];
    for (int m = 0; m < rows; m++)
        for (int i = 0; i < SUMS(rows); i++) a[m][i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m256 v[4];
        for (int i = 0; i < 4; i++) v[i] = widen8(w + k + 8 * i);
        for (int m = 0; m < rows; m++)
            for (int i = 0; i < 4; i++)
                a[m][i % SUMS(rows)] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + k + 8 * i), v[i],
                                                       a[m][i % SUMS(rows)]);
    }
    for (; k + 8 <= K; k += 8) {
        const __m256 v = widen8(w + k);
        for (int m = 0; m < rows; m++) a[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + k), v, a[m][0]);
    }
    for (int m = 0; m < rows; m++) {
        __m256 t = a[m][0];
        for (int i = 1; i < SUMS(rows); i++) t = _mm256_add_ps(t, a[m][i]);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        float r = _mm_cvtss_f32(h);
        for (int64_t j = k; j < K; j++) r += x[m * ldx + j] * (float)w[j];
        s[m] = r;
    }
}

__attribute__((target("avx2,fma")))
static void dots_avx2(const float *x, int64_t ldx, int rows, const int8_t *w, int64_t K, float *s) {
    switch (rows) {
        case 1: body_avx2(x, ldx, w, K, s, 1); return;
        case 2: body_avx2(x, ldx, w, K, s, 2); return;
        case 3: body_avx2(x, ldx, w, K, s, 3); return;
        default: body_avx2(x, ldx, w, K, s, 4); return;
    }
}

// isa: 2 = AVX-512F, 1 = AVX2 + FMA (the caller asks pagoda_int8_isa which it may use).
void pagoda_int8_xwt(const float *x, int64_t ldx, const int8_t *w, int64_t ldw, const float *scale,
                     float *out, int64_t ldo, int M, int64_t N, int64_t K, int threads, int isa) {
    void (*dots)(const float *, int64_t, int, const int8_t *, int64_t, float *) =
        isa == 2 ? dots_avx512 : dots_avx2;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wn = w + n * ldw;
        float s[4];
        for (int m = 0; m < M; m += 4) {
            int rows = M - m < 4 ? M - m : 4;
            dots(x + m * ldx, ldx, rows, wn, K, s);
            for (int r = 0; r < rows; r++) out[(m + r) * ldo + n] = s[r] * scale[n];
        }
    }
}
