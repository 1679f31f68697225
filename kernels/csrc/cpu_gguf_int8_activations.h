// The GGUF kernel's int8-activation paths (kernels/csrc/cpu_gemm_gguf.c: 2 AVX2 int8, 4 AVX-512
// VNNI), as llama.cpp multiplies its Q4_1 / Q8_0 weights: each row of x quantized once per call
// to int8 blocks of 32, then integer dot products per block, scaled in fp32. Included by
// cpu_gemm_gguf.c, whose helpers (bytes4_at, half_at) and types it uses.
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_weight_types.h"


// x's rows as int8 blocks: q[M][K] and, per block, (d, s = d * sum(q)) in ds[M][K / 32][2].
// rintf rounds half to even, as numpy's rint does (the tests hold it to that).
__attribute__((target("avx2,fma,f16c")))
void pagoda_gguf_quantize_x(const float *x, int64_t ldx, int M, int64_t K, int8_t *q, float *ds) {
    for (int m = 0; m < M; m++) {
        for (int64_t k = 0; k < K; k += QK) {
            const float *xb = x + m * ldx + k;
            float amax = 0.0f;
            for (int j = 0; j < QK; j++) amax = __builtin_fmaxf(amax, __builtin_fabsf(xb[j]));
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int j = 0; j < QK; j++) {
                const int v = (int)__builtin_rintf(xb[j] * id);
                q[m * K + k + j] = (int8_t)v;
                sum += v;
            }
            ds[2 * (m * (K / QK) + k / QK)] = d;
            ds[2 * (m * (K / QK) + k / QK) + 1] = d * (float)sum;
        }
    }
}

// s[m] = x_m . w for `rows` quantized rows of x (q, ds) and one weight row of nb blocks.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c"), always_inline))
static inline void body_vnni(const int8_t *q, int64_t K, const float *ds, const uint8_t *w, int64_t nb,
                             float *s, const int rows, const int type) {
    __m512 acc[4];
    __m128 off[4];  // Q4_1: m_w * s_x of every block, in lanes 1 and 3
    float tail[4] = {0};
    for (int m = 0; m < rows; m++) acc[m] = _mm512_setzero_ps(), off[m] = _mm_setzero_ps();
    const int bytes = type == TYPE_Q8_0 ? 34 : 20;
    const __m512i low4 = _mm512_set1_epi8(15), zero = _mm512_setzero_si512();
    // The scale of block 0 (lane 0 of d_w * d_x, ...) to lanes 0-7, block 1's (lane 2) to 8-15.
    const __m512i halves = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2, w += 2 * bytes) {
        const uint8_t *w1 = w + bytes;
        __m512i wq;
        __m128 dm;  // d0, m0, d1, m1 (Q8_0: d0, 0, d1, 0)
        __mmask64 neg = 0;
        if (type == TYPE_Q4_1) {
            __m128i p0 = _mm_loadu_si128((const __m128i *)(w + 4)), p1 = _mm_loadu_si128((const __m128i *)(w1 + 4));
            __m256i u0 = _mm256_set_m128i(_mm_srli_epi16(p0, 4), p0), u1 = _mm256_set_m128i(_mm_srli_epi16(p1, 4), p1);
            wq = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(u0), u1, 1), low4);
            dm = _mm_cvtph_ps(_mm_set_epi32(0, 0, (int)bytes4_at(w1), (int)bytes4_at(w)));
        } else {
            wq = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(w + 2))),
                                    _mm256_loadu_si256((const __m256i *)(w1 + 2)), 1);
            dm = _mm_cvtph_ps(_mm_set_epi32(0, 0, half_at(w1), half_at(w)));
            neg = _mm512_movepi8_mask(wq);  // VPDPBUSD takes one unsigned side: |w| and x signed by w
            wq = _mm512_abs_epi8(wq);
        }
        for (int m = 0; m < rows; m++) {
            __m512i xq = _mm512_loadu_si512((const void *)(q + m * K + b * QK));
            if (type == TYPE_Q8_0) xq = _mm512_mask_sub_epi8(xq, neg, zero, xq);
            __m512i dot = _mm512_dpbusd_epi32(zero, wq, xq);
            __m128 prod = _mm_mul_ps(dm, _mm_loadu_ps(ds + 2 * (m * nb + b)));  // d_w d_x, m_w s_x, ...
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                     _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(prod)), acc[m]);
            if (type == TYPE_Q4_1) off[m] = _mm_add_ps(off[m], prod);
        }
    }
    if (b < nb) {  // an odd block out
        __m256i wq, neg = _mm256_setzero_si256();
        __m128 dm;
        if (type == TYPE_Q4_1) {
            __m128i p = _mm_loadu_si128((const __m128i *)(w + 4));
            wq = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(p, 4), p), _mm256_set1_epi8(15));
            dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)bytes4_at(w)));
        } else {
            neg = _mm256_loadu_si256((const __m256i *)(w + 2));
            wq = _mm256_abs_epi8(neg);
            dm = _mm_cvtph_ps(_mm_cvtsi32_si128(half_at(w)));
        }
        for (int m = 0; m < rows; m++) {
            __m256i xq = _mm256_loadu_si256((const __m256i *)(q + m * K + b * QK));
            if (type == TYPE_Q8_0) xq = _mm256_sign_epi8(xq, neg);
            __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq, xq);
            __m128i h = _mm_add_epi32(_mm256_castsi256_si128(dot), _mm256_extracti128_si256(dot, 1));
            h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
            h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
            const float *dsx = ds + 2 * (m * nb + b);
            tail[m] = (float)_mm_cvtsi128_si32(h) * (_mm_cvtss_f32(dm) * dsx[0]) +
                      (type == TYPE_Q4_1 ? _mm_cvtss_f32(_mm_movehdup_ps(dm)) * dsx[1] : 0.0f);
        }
    }
    for (int m = 0; m < rows; m++) {
        __m128 o = off[m];
        s[m] = _mm512_reduce_add_ps(acc[m]) + tail[m] + _mm_cvtss_f32(_mm_shuffle_ps(o, o, 1)) +
               _mm_cvtss_f32(_mm_shuffle_ps(o, o, 3));
    }
}

__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void body_avx2_int8(const int8_t *q, int64_t K, const float *ds, const uint8_t *w, int64_t nb,
                                  float *s, const int rows, const int type) {
    __m256 acc[4];
    __m128 off[4];  // Q4_1: m_w * s_x of every block, in lane 1
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps(), off[m] = _mm_setzero_ps();
    const int bytes = type == TYPE_Q8_0 ? 34 : 20;
    const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++, w += bytes) {
        __m256i wq, sgn = _mm256_setzero_si256();
        __m128 dm;  // d, m (Q8_0: d, 0)
        if (type == TYPE_Q4_1) {
            __m128i p = _mm_loadu_si128((const __m128i *)(w + 4));
            wq = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(p, 4), p), low4);
            dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)bytes4_at(w)));
        } else {
            sgn = _mm256_loadu_si256((const __m256i *)(w + 2));
            wq = _mm256_sign_epi8(sgn, sgn);  // VPMADDUBSW takes one unsigned side: |w| and x signed by w
            dm = _mm_cvtph_ps(_mm_cvtsi32_si128(half_at(w)));
        }
        for (int m = 0; m < rows; m++) {
            __m256i xq = _mm256_loadu_si256((const __m256i *)(q + m * K + b * QK));
            if (type == TYPE_Q8_0) xq = _mm256_sign_epi8(xq, sgn);
            // pairs of u8 x s8 products in int16 (at most 2 * 128 * 127: no saturation), then int32
            __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wq, xq), ones);
            __m128 prod = _mm_mul_ps(dm, _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(ds + 2 * (m * nb + b)))));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcastss_ps(prod), acc[m]);
            if (type == TYPE_Q4_1) off[m] = _mm_add_ps(off[m], prod);
        }
    }
    for (int m = 0; m < rows; m++) {
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        s[m] = _mm_cvtss_f32(h) + _mm_cvtss_f32(_mm_shuffle_ps(off[m], off[m], 1));
    }
}

#define QCALL(body, n, type) case n: body(q, K, ds, w, nb, s, n, type); return;
#define QROWS(body, type) QCALL(body, 1, type) QCALL(body, 2, type) QCALL(body, 3, type) QCALL(body, 4, type)

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))
static void qdots_vnni(const int8_t *q, int64_t K, const float *ds, int rows, const uint8_t *w, int64_t nb,
                       int type, float *s) {
    if (type == TYPE_Q8_0) { switch (rows) { QROWS(body_vnni, TYPE_Q8_0) } }
    else { switch (rows) { QROWS(body_vnni, TYPE_Q4_1) } }
}

__attribute__((target("avx2,fma,f16c")))
static void qdots_avx2(const int8_t *q, int64_t K, const float *ds, int rows, const uint8_t *w, int64_t nb,
                       int type, float *s) {
    if (type == TYPE_Q8_0) { switch (rows) { QROWS(body_avx2_int8, TYPE_Q8_0) } }
    else { switch (rows) { QROWS(body_avx2_int8, TYPE_Q4_1) } }
}

static void xwt_int8(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, int type, float *out,
                     int64_t ldo, int M, int64_t N, int64_t K, int threads, int isa) {
    const int64_t nb = K / QK;
    int8_t *q = malloc((size_t)M * K);
    float *ds = malloc((size_t)M * nb * 2 * sizeof(float));
    pagoda_gguf_quantize_x(x, ldx, M, K, q, ds);
    void (*dots)(const int8_t *, int64_t, const float *, int, const uint8_t *, int64_t, int, float *) =
        isa == 4 ? qdots_vnni : qdots_avx2;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float s[4];
        for (int m = 0; m < M; m += 4) {
            int rows = M - m < 4 ? M - m : 4;
            dots(q + m * K, K, ds + 2 * m * nb, rows, w + n * ldw, nb, type, s);
            for (int r = 0; r < rows; r++) out[(m + r) * ldo + n] = s[r];
        }
    }
    free(q);
    free(ds);
}
