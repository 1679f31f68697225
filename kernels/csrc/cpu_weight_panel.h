// Many rows of x against a weight in any format (cpu_weight_types.h): every group of 4 weight
// rows is widened to fp32 once, into a panel that stays in L1, and the fp32 GEMM's register
// blocks (cpu_gemm_blocks.h: 3 rows of x by 4 weight rows, 12 sums) pass each row of x over it.
//
// Why: the row-at-a-time dot products (cpu_gemm_gguf.c, cpu_gemm_int8.c, the decode step's gemv)
// widen a weight row again for every 4 rows of x, and hold one weight row's sums at a time (5
// loads to 4 FMAs). From about 8 rows of x on they ran at 83-87 GFLOP/s on a Zen 2 EPYC where
// the fp32 blocks run at 116-129, so a batch was slower quantized than in fp32: the weights'
// bytes stop mattering there, and a weight is widened once per chunk of rows, not once per 4.
// The values are the format's own fp32 weights (Q4_1: d * q + m as one FMA, as the dot products
// widen them), so the result is the fp32 product with the dequantized weights.
//
// AVX2 + FMA + F16C only: the AVX-512 paths keep their dot products until measured against this.
#pragma once
#include <stdlib.h>
#include <string.h>

#include "cpu_dense_rows.h"
#include "cpu_gemm_blocks.h"
#include "cpu_weight_types.h"

// Rows of x from which the AVX2 projections take the panels: on a Zen 2 EPYC (bench/bench_gemm.py
// --quantization int8 / q4_1, the model's projections) they win from 12 rows (int8 31 against 34
// ms, Q4_1 29 against 35), lose at 8 (int8 29 against 23; widening every weight costs some ms)
// and at 32 rows take 60 ms where the dot products take 98.
#define PANEL_MIN_ROWS 12

// One weight row of K values of `type` (not fp32, read in place) as fp32; K a multiple of 32
// for the GGUF formats.
__attribute__((target("avx2,fma,f16c")))
static void widen_row(const uint8_t *w, int64_t K, int type, float *out) {
    int64_t k = 0;
    if (type == TYPE_Q8_0 || type == TYPE_Q4_1) {
        const int bytes = type == TYPE_Q8_0 ? 34 : 20;
        const __m256i low4 = _mm256_set1_epi32(15);
        for (; k < K; k += QK, w += bytes) {
            if (type == TYPE_Q8_0) {
                uint16_t h;
                memcpy(&h, w, 2);
                const __m256 d = _mm256_set1_ps(_cvtsh_ss(h));
                for (int i = 0; i < 4; i++)
                    _mm256_storeu_ps(out + k + 8 * i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                        _mm_loadl_epi64((const __m128i *)(w + 2 + 8 * i))))));
            } else {
                uint32_t b;
                memcpy(&b, w, 4);
                const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)b));
                const __m256 d = _mm256_broadcastss_ps(dm), m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
                for (int i = 0; i < 2; i++) {  // byte j: weight j (low nibble) and 16 + j (high)
                    const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + 4 + 8 * i)));
                    _mm256_storeu_ps(out + k + 8 * i, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(q, low4)), m));
                    _mm256_storeu_ps(out + k + 16 + 8 * i, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), m));
                }
            }
        }
    } else {  // int8 or bf16 (widened as the step's dense rows widen them), then the tail
        for (; k + 8 <= K; k += 8) _mm256_storeu_ps(out + k, dense8(w, k, type));
        for (; k < K; k++) {
            if (type == TYPE_I8) {
                out[k] = (float)((const int8_t *)w)[k];
            } else {
                const uint32_t v = (uint32_t)((const uint16_t *)w)[k] << 16;  // an fp32's top half
                memcpy(out + k, &v, 4);
            }
        }
    }
}

// out[m, n] = x[m] . W[n], times scale[n] where scale is given, added to out[m, n] where `add`,
// for m < M and n < N; W's rows of `type`, ldw bytes apart. An orphaned worksharing loop over
// groups of 4 weight rows: called by every thread of a parallel region, which it leaves at a
// barrier. Each chunk of x's rows (at most MAX_ROW_CHUNK, kept in L2) passes over the thread's
// share; dense fp32 rows are read in place.
AVX2 static void panel_xwt(const float *x, int64_t ldx, int M, const uint8_t *w, int64_t ldw, int type,
                           const float *scale, int64_t N, int64_t K, float *out, int64_t ldo, int add) {
    const Blocks *b = &AVX2_RESIDENT_BLOCKS;
    float *panel = type == TYPE_F32 ? NULL : malloc((size_t)(4 * K) * sizeof(float));
    const int64_t groups = (N + 3) / 4;
    const int chunks = (M + MAX_ROW_CHUNK - 1) / MAX_ROW_CHUNK;
    const int chunk = ((M + chunks - 1) / chunks + b->most - 1) / b->most * b->most;
    // fp32 weights (the one-call decode step's) stream the next group in slices, as the fp32
    // GEMM's blocks do: decode steps of 32 rows 119 -> 111-113 ms, 64 rows 217-220 -> 208-212
    // (bench/profile_cpu.py, Zen 2). Quantized rows, a quarter of the bytes or less, gained
    // nothing measurable (Q4_1, 32 and 64 rows).
    const int64_t row_bytes = K * 4;
    for (int m0 = 0; m0 < M; m0 += chunk) {
        const int m1 = M - m0 < chunk ? M : m0 + chunk;
        // nowait: each chunk hands every thread the same groups, so no output is shared
        #pragma omp for schedule(static) nowait
        for (int64_t g = 0; g < groups; g++) {
            const int64_t n = 4 * g;
            const int nr = N - n < 4 ? (int)(N - n) : 4;
            const float *p = (const float *)(w + n * ldw);
            int64_t ldp = ldw / (int64_t)sizeof(float);
            if (type != TYPE_F32) {
                for (int r = 0; r < nr; r++) widen_row(w + (n + r) * ldw, K, type, panel + r * K);
                p = panel, ldp = K;
            }
            const int slices = (m1 - m0 + b->most - 1) / b->most;
            for (int m = m0, i = 0; m < m1; i++) {
                const int mr = m1 - m < b->most ? m1 - m : b->most;
                float s[3 * 4];
                if (type == TYPE_F32 && n + 8 <= N)  // the next group: this thread's (static schedule)
                    blk_prefetch_slice((const char *)(w + (n + 4) * ldw), ldw, row_bytes, i, slices);
                if (nr == 4)
                    b->four[mr](x + m * ldx, ldx, p, ldp, s, 4, (int)K);
                else
                    for (int r = 0; r < nr; r++) b->one[mr](x + m * ldx, ldx, p + r * ldp, ldp, s + r, 4, (int)K);
                for (int i = 0; i < mr; i++)
                    for (int j = 0; j < nr; j++) {
                        float *o = out + (m + i) * ldo + n + j;
                        const float v = scale ? s[4 * i + j] * scale[n + j] : s[4 * i + j];
                        *o = add ? *o + v : v;
                    }
                m += mr;
            }
        }
    }
    #pragma omp barrier
    free(panel);
}
