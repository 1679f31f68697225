// out[M, N] (fp32) = x[M, K] (fp32) @ W[N, K]^T with W in one of GGUF's block formats, as the
// file stores it (--quantization q8_0 / q4_1). Every row of W is K / 32 blocks of 32 weights:
//   Q8_0 (ggml type 8, 34 bytes): fp16 d, int8 q[32];            w[j] = d * q[j]
//   Q4_1 (ggml type 3, 20 bytes): fp16 d, fp16 m, uint8 qs[16];  w[j] = d * q[j] + m, where
//                                 q[j] = qs[j] & 15 and q[j + 16] = qs[j] >> 4 (j < 16)
// A decode step reads every weight once, so a single stream's step is bound by the weights' bytes:
// 34/32 (Q8_0) and 20/32 (Q4_1) of a byte a weight against fp32's 4. Each block is dequantized
// into fp32 registers (one multiply or FMA per vector, shared by every row of x of a pass) and
// multiplied there: the activations stay exact fp32, so nothing is lost beyond the format's own
// rounding, and the matrix never exists in fp32 in memory.
//
// Four paths chosen at run time (pagoda_gguf_isa), numbered so that a CPU that runs one runs every
// lower one (the tests run each):
//   1 AVX2 + FMA, 3 AVX-512F: exact fp32 activations. A block is 4 vectors of 8 (2 of 16);
//     each weight row is read once for up to 4 (8) rows of x, which stay in L1, so a block's
//     dequantization is shared by as many; every row of x keeps two accumulators, so that
//     consecutive FMAs do not wait on each other's latency (one row is the common case: decode;
//     with AVX2 it factors each block's scales out of its sum instead, row_avx2).
//   2 AVX2 int8, 4 AVX-512 VNNI: int8 activations, as llama.cpp multiplies its Q4_1 / Q8_0
//     weights (its Q8_1 activations). Each row of x is quantized once per call, per block of 32:
//     d = max |x| / 127, q = round(x / d), and s = d * sum(q) for Q4_1's offset; then a block's
//     dot product is integer, d_w * d_x * sum(q_w q_x) (+ m_w * s_x for Q4_1): one VPDPBUSD per
//     two blocks (AVX-512 VNNI) or VPMADDUBSW + VPMADDWD per block (AVX2), instead of widening
//     every weight to fp32. The integer sums are exact; the error is x's rounding (d / 2 a value).
// All need F16C for the block scales.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_weight_panel.h"
#include "cpu_weight_types.h"

int pagoda_gguf_isa(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("f16c") || !__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
        return 0;
    if (!__builtin_cpu_supports("avx512f")) return 2;
    if (!(__builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
          && __builtin_cpu_supports("avx512vnni"))) return 3;
    return 4;
}

static inline uint32_t bytes4_at(const uint8_t *p) {  // blocks are byte-packed: no alignment
    uint32_t v = 0;
    __builtin_memcpy(&v, p, 4);
    return v;
}

static inline uint16_t half_at(const uint8_t *p) {
    uint16_t h;
    __builtin_memcpy(&h, p, 2);
    return h;
}

// The bodies take the row count and the format as constants: each (rows, type) pair below is
// compiled on its own, with no branch in the block loop (one row, the common case, is a straight
// run of loads, conversions and FMAs).
#define CALL(body, n, type) case n: body(x, ldx, w, K, s, n, type); return;
#define ROWS_1_TO_4(body, type) CALL(body, 1, type) CALL(body, 2, type) CALL(body, 3, type) CALL(body, 4, type)
#define ROWS_5_TO_8(body, type) CALL(body, 5, type) CALL(body, 6, type) CALL(body, 7, type) CALL(body, 8, type)

__attribute__((target("avx512f,f16c"), always_inline))
static inline void body_avx512(const float *x, int64_t ldx, const uint8_t *w, int64_t K, float *s,
                               const int rows, const int type) {
    __m512 a[8][2];
    for (int m = 0; m < rows; m++) a[m][0] = a[m][1] = _mm512_setzero_ps();
    const int bytes = type == TYPE_Q8_0 ? 34 : 20;
    const __m512i low4 = _mm512_set1_epi32(15);
    for (int64_t k = 0; k < K; k += QK, w += bytes) {
        __m512 w0, w1;
        if (type == TYPE_Q8_0) {
            __m512 d = _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(half_at(w))));
            w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 2)))));
            w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 18)))));
        } else {
            __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)bytes4_at(w)));  // d, m: one conversion
            __m512 d = _mm512_broadcastss_ps(dm), mn = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
            __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + 4)));
            w0 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(q, low4)), mn);
            w1 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), mn);
        }
        for (int m = 0; m < rows; m++) {
            a[m][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * ldx + k), w0, a[m][0]);
            a[m][1] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * ldx + k + 16), w1, a[m][1]);
        }
    }
    for (int m = 0; m < rows; m++) s[m] = _mm512_reduce_add_ps(_mm512_add_ps(a[m][0], a[m][1]));
}

// row_avx2's factoring in 16-float vectors: x . (d q + m) = d (x . q) + m sum(x), two sums that
// alternate by block so that consecutive FMAs do not wait on each other. On an AMX Xeon a
// single stream's Q4_1 step spent most of its time here, compute-bound (84 MB of weights).
__attribute__((target("avx512f,f16c,fma"), always_inline))
static inline float row_avx512(const float *x, const float *xs, const uint8_t *w, int64_t K, const int type) {
    __m512 a[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    __m128 off = _mm_setzero_ps();
    const int bytes = type == TYPE_Q8_0 ? 34 : 20;
    const __m512i low4 = _mm512_set1_epi32(15);
    for (int64_t k = 0, b = 0; k < K; k += QK, w += bytes, b ^= 1) {
        __m512 q0, q1, d;
        if (type == TYPE_Q8_0) {
            d = _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(half_at(w))));
            q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 2))));
            q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 18))));
        } else {
            const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)bytes4_at(w)));
            d = _mm512_broadcastss_ps(dm);
            const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + 4)));
            q0 = _mm512_cvtepi32_ps(_mm512_and_si512(q, low4));   // weights 0 .. 15
            q1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));     // 16 .. 31
            off = _mm_fmadd_ps(dm, _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(xs + 2 * (k / QK)))), off);
        }
        const __m512 t = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16), q1, _mm512_mul_ps(_mm512_loadu_ps(x + k), q0));
        a[b] = _mm512_fmadd_ps(d, t, a[b]);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1])) +
           (type == TYPE_Q4_1 ? _mm_cvtss_f32(_mm_movehdup_ps(off)) : 0.0f);
}

// xs: row_sums of x's row where rows is 1 (row_avx512), else unread.
__attribute__((target("avx512f,f16c,fma")))
static void dots_avx512(const float *x, int64_t ldx, int rows, const uint8_t *w, int64_t K,
                        int type, const float *xs, float *s) {
    if (rows == 1) {
        s[0] = type == TYPE_Q8_0 ? row_avx512(x, xs, w, K, TYPE_Q8_0) : row_avx512(x, xs, w, K, TYPE_Q4_1);
        return;
    }
    if (type == TYPE_Q8_0) {
        switch (rows) { ROWS_1_TO_4(body_avx512, TYPE_Q8_0) ROWS_5_TO_8(body_avx512, TYPE_Q8_0) }
    } else {
        switch (rows) { ROWS_1_TO_4(body_avx512, TYPE_Q4_1) ROWS_5_TO_8(body_avx512, TYPE_Q4_1) }
    }
}

// a + b summed over their 8 lanes.
__attribute__((target("avx2,fma"), always_inline))
static inline float sum2_avx2(__m256 a, __m256 b) {
    const __m256 t = _mm256_add_ps(a, b);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void body_avx2(const float *x, int64_t ldx, const uint8_t *w, int64_t K, float *s,
                             const int rows, const int type) {
    __m256 a[4][2];
    for (int m = 0; m < rows; m++) a[m][0] = a[m][1] = _mm256_setzero_ps();
    const int bytes = type == TYPE_Q8_0 ? 34 : 20;
    const __m256i low4 = _mm256_set1_epi32(15);
    for (int64_t k = 0; k < K; k += QK, w += bytes) {
        __m256 v[4];  // v[i]: weights 8i .. 8i + 7
        if (type == TYPE_Q8_0) {
            __m256 d = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(half_at(w))));
            for (int i = 0; i < 4; i++)
                v[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                    _mm_loadl_epi64((const __m128i *)(w + 2 + 8 * i)))));
        } else {
            __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)bytes4_at(w)));
            __m256 d = _mm256_broadcastss_ps(dm), mn = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
            for (int i = 0; i < 2; i++) {  // bytes 8i .. 8i + 7: weights 8i .. (low nibbles) and 16 + 8i .. (high)
                __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + 4 + 8 * i)));
                v[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(q, low4)), mn);
                v[i + 2] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), mn);
            }
        }
        for (int m = 0; m < rows; m++) {
            const float *xk = x + m * ldx + k;
            a[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xk), v[0], a[m][0]);
            a[m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 8), v[1], a[m][1]);
            a[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 16), v[2], a[m][0]);
            a[m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 24), v[3], a[m][1]);
        }
    }
    for (int m = 0; m < rows; m++) s[m] = sum2_avx2(a[m][0], a[m][1]);
}

// One row of x (a single stream's decode), with the block's scales factored out of its sum:
// x . (d q + m) = d (x . q) + m sum(x), so a block costs its conversions and the FMAs on x, and
// no FMA dequantizes a weight (a Zen 2 EPYC: 18% more blocks a second, from L2; exact fp32
// arithmetic still, in another order). xs: x's block sums for Q4_1 as pairs (0, sum of block b)
// at xs[2b] (row_sums), so that d, m times a pair puts m sum(x) in lane 1 with one FMA.
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline float row_avx2(const float *x, const float *xs, const uint8_t *w, int64_t K, const int type) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    __m128 off = _mm_setzero_ps();
    const int bytes = type == TYPE_Q8_0 ? 34 : 20;
    const __m256i low4 = _mm256_set1_epi32(15);
    for (int64_t k = 0; k < K; k += QK, w += bytes) {
        const float *xk = x + k;
        __m256 t0, t1, d;
        if (type == TYPE_Q8_0) {
            d = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(half_at(w))));
            __m256 q[4];
            for (int i = 0; i < 4; i++)
                q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + 2 + 8 * i))));
            t0 = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 16), q[2], _mm256_mul_ps(_mm256_loadu_ps(xk), q[0]));
            t1 = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 24), q[3], _mm256_mul_ps(_mm256_loadu_ps(xk + 8), q[1]));
        } else {
            const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)bytes4_at(w)));
            d = _mm256_broadcastss_ps(dm);
            // bytes 4 .. 11: weights 0 .. 7 (low nibbles) and 16 .. 23 (high); 12 .. 19: 8 .. 15, 24 .. 31
            const __m256i q0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + 4)));
            const __m256i q1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + 12)));
            t0 = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 16), _mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)),
                                 _mm256_mul_ps(_mm256_loadu_ps(xk), _mm256_cvtepi32_ps(_mm256_and_si256(q0, low4))));
            t1 = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 24), _mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4)),
                                 _mm256_mul_ps(_mm256_loadu_ps(xk + 8), _mm256_cvtepi32_ps(_mm256_and_si256(q1, low4))));
            off = _mm_fmadd_ps(dm, _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(xs + 2 * (k / QK)))), off);
        }
        a0 = _mm256_fmadd_ps(d, t0, a0);
        a1 = _mm256_fmadd_ps(d, t1, a1);
    }
    return sum2_avx2(a0, a1) + (type == TYPE_Q4_1 ? _mm_cvtss_f32(_mm_movehdup_ps(off)) : 0.0f);
}

// xs for one row of x (row_avx2): (0, sum of block b) at xs[2b], b < K / 32.
static inline void row_sums(const float *x, int64_t K, float *xs) {
    for (int64_t b = 0; b < K / QK; b++) {
        float t = 0.0f;
        for (int j = 0; j < QK; j++) t += x[b * QK + j];
        xs[2 * b] = 0.0f;
        xs[2 * b + 1] = t;
    }
}

// Where x's last row (of M) is alone in its pass of `most` rows, the dots read its block sums
// (Q4_1: row_avx2, row_avx512): its row_sums into xs; else xs is left unread.
static inline void lone_row_sums(const float *x, int64_t ldx, int M, int most, int64_t K, int type, float *xs) {
    if (type == TYPE_Q4_1 && M % most == 1) row_sums(x + (int64_t)(M - 1) * ldx, K, xs);
}

// xs: row_sums of x's row where rows is 1 (row_avx2), else unread.
__attribute__((target("avx2,fma,f16c")))
static void dots_avx2(const float *x, int64_t ldx, int rows, const uint8_t *w, int64_t K,
                      int type, const float *xs, float *s) {
    if (rows == 1) {
        s[0] = type == TYPE_Q8_0 ? row_avx2(x, xs, w, K, TYPE_Q8_0) : row_avx2(x, xs, w, K, TYPE_Q4_1);
    } else if (type == TYPE_Q8_0) {
        switch (rows) { ROWS_1_TO_4(body_avx2, TYPE_Q8_0) }
    } else {
        switch (rows) { ROWS_1_TO_4(body_avx2, TYPE_Q4_1) }
    }
}

#include "cpu_gguf_int8_activations.h"

// type: 8 = Q8_0, 3 = Q4_1 (ggml's numbers); K a multiple of 32; ldw in bytes. isa: a path of
// pagoda_gguf_isa (the caller asks it which it may use).
void pagoda_gguf_xwt(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, int type,
                     float *out, int64_t ldo, int M, int64_t N, int64_t K, int threads, int isa) {
    if (isa == 2 || isa == 4) {
        xwt_int8(x, ldx, w, ldw, type, out, ldo, M, N, K, threads, isa);
        return;
    }
    if (isa == 1 && M >= PANEL_MIN_ROWS) {
        #pragma omp parallel num_threads(threads)
        panel_xwt(x, ldx, M, w, ldw, type, NULL, N, K, out, ldo, 0);
        return;
    }
    void (*dots)(const float *, int64_t, int, const uint8_t *, int64_t, int, const float *, float *) =
        isa == 3 ? dots_avx512 : dots_avx2;
    const int most = isa == 3 ? 8 : 4;  // rows of x a pass over a weight row takes
    float *xs = malloc((size_t)(K / QK) * 2 * sizeof(float));
    lone_row_sums(x, ldx, M, most, K, type, xs);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wn = w + n * ldw;
        float s[8];
        for (int m = 0; m < M; m += most) {
            int rows = M - m < most ? M - m : most;
            dots(x + m * ldx, ldx, rows, wn, K, type, xs, s);
            for (int r = 0; r < rows; r++) out[(m + r) * ldo + n] = s[r];
        }
    }
    free(xs);
}

// out[N, K] (fp32) = the weights of the blocks w[N, K / 32 blocks]: for a prefill chunk, which
// multiplies them with torch's GEMM (bound by arithmetic, not bytes). One pass over the blocks in
// C, where torch needs several over [N, K] (nibbles, concatenation, conversion, scale). Plain
// loops the compiler vectorizes; AVX2 + FMA + F16C, which every path of pagoda_gguf_isa has.
__attribute__((target("avx2,fma,f16c")))
void pagoda_gguf_dequantize(const uint8_t *w, int64_t ldw, int type, float *out, int64_t N,
                            int64_t K, int threads) {
    const int bytes = type == TYPE_Q8_0 ? 34 : 20;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *b = w + n * ldw;
        float *o = out + n * K;
        for (int64_t k = 0; k < K; k += QK, b += bytes, o += QK) {
            float d = _cvtsh_ss(half_at(b));
            if (type == TYPE_Q8_0) {
                for (int j = 0; j < QK; j++) o[j] = d * (float)(int8_t)b[2 + j];
            } else {
                float m = _cvtsh_ss(half_at(b + 2));
                for (int j = 0; j < QK / 2; j++) {
                    o[j] = d * (float)(b[4 + j] & 15) + m;
                    o[j + QK / 2] = d * (float)(b[4 + j] >> 4) + m;
                }
            }
        }
    }
}
