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

#include "cpu_dense_rows.h"
#include "cpu_weight_panel.h"

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

// AVX2: the dense rows' dot products (kernels/csrc/cpu_dense_rows.h: one or two rows of x keep
// four sums each, as one sum a row made each FMA wait on the last and one row of x read 8.5
// GB/s of int8 weights on a Zen 2 EPYC that copies at 23) over K's multiple of 32, the rest
// one weight at a time.
__attribute__((target("avx2,fma")))
static void dots_avx2(const float *x, int64_t ldx, int rows, const int8_t *w, int64_t K, float *s) {
    const int64_t k32 = K / 32 * 32;
    const uint8_t *wb = (const uint8_t *)w;
    switch (rows) {
        case 1: dense_avx2(x, ldx, wb, k32, s, 1, TYPE_I8); break;
        case 2: dense_avx2(x, ldx, wb, k32, s, 2, TYPE_I8); break;
        case 3: dense_avx2(x, ldx, wb, k32, s, 3, TYPE_I8); break;
        default: dense_avx2(x, ldx, wb, k32, s, 4, TYPE_I8); break;
    }
    for (int m = 0; m < rows; m++)
        for (int64_t j = k32; j < K; j++) s[m] += x[m * ldx + j] * (float)w[j];
}

// isa: 2 = AVX-512F, 1 = AVX2 + FMA (the caller asks pagoda_int8_isa which it may use).
void pagoda_int8_xwt(const float *x, int64_t ldx, const int8_t *w, int64_t ldw, const float *scale,
                     float *out, int64_t ldo, int M, int64_t N, int64_t K, int threads, int isa) {
    if (isa == 1 && M >= PANEL_MIN_ROWS) {
        #pragma omp parallel num_threads(threads)
        panel_xwt(x, ldx, M, (const uint8_t *)w, ldw, TYPE_I8, scale, N, K, out, ldo, 0);
        return;
    }
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
