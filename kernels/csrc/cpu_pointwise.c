// The pointwise parts of a bf16 Llama layer on the CPU, each one C call over all of a step's rows:
// the residual sum and RMSNorm, the rotary turn of q and k, and SiLU(gate) * up. In torch each
// is 4-9 ops (an fp32 copy of the activations, the statistics, a rounding, the weight), about 14%
// of a bf16 prefill step and 15% of a 32-sequence decode step (bench/profile_cpu.py).
//
// Each rounds where worker/model/layers.py's torch ops round (HF's arithmetic in bf16): the residual
// sum to bf16; the norm's statistics in fp32, its product rounded to bf16 before the weight's,
// which rounds again; the rotary turn in fp32, rounded once; SiLU rounded to bf16 before the
// product with up, which rounds again. Rounding is to nearest even (to_bf16), as torch rounds.
// AVX-512 (F, BW, VL) takes 16 values a vector in explicit code; AVX2 + FMA the same loops in plain
// C the compiler vectorizes. The plain loops ran at 2-7 cycles a value on an AMX Xeon (8-wide,
// their roundings and exp in mixed integer and float code): a fifth of a bf16 prefill step.
#include "cpu_attention_math.h"
#include "cpu_bf16_vec.h"

#include <math.h>
#include <omp.h>
#include <stdint.h>

int pagoda_pointwise_isa(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0;
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") || !__builtin_cpu_supports("avx512vl"))
        return 1;
    return __builtin_cpu_supports("avx512bf16") ? 3 : 2;
}

__attribute__((always_inline)) static inline float bf(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// Rows [t0, t1): x += residual (where given), out = RMSNorm(x) * w.
__attribute__((always_inline))
static inline void norm_rows(uint16_t *x, const uint16_t *residual, const uint16_t *w, float eps, int H,
                             uint16_t *out, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
        uint16_t *restrict xr = x + t * H;
        uint16_t *restrict o = out + t * H;
        if (residual) {
            const uint16_t *restrict r = residual + t * H;
            for (int i = 0; i < H; i++) xr[i] = to_bf16(bf(xr[i]) + bf(r[i]));
        }
        float ss = 0.0f;
        #pragma omp simd reduction(+:ss)
        for (int i = 0; i < H; i++) ss += bf(xr[i]) * bf(xr[i]);
        const float rstd = 1.0f / sqrtf(ss / (float)H + eps);
        for (int i = 0; i < H; i++) o[i] = to_bf16(bf(to_bf16(bf(xr[i]) * rstd)) * bf(w[i]));
    }
}

// Rows [t0, t1) of heads whose pairs (2i, 2i + 1) turn by cis[t][i] = (cos, sin), in place.
__attribute__((always_inline))
static inline void rotate_rows(uint16_t *x, int64_t ld, int heads, int D, const float *cis, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
        const float *restrict c = cis + t * D;
        for (int h = 0; h < heads; h++) {
            uint16_t *restrict xh = x + t * ld + (int64_t)h * D;
            for (int i = 0; i < D / 2; i++) {
                const float a = bf(xh[2 * i]), b = bf(xh[2 * i + 1]), cos = c[2 * i], sin = c[2 * i + 1];
                xh[2 * i] = to_bf16(a * cos - b * sin);
                xh[2 * i + 1] = to_bf16(a * sin + b * cos);
            }
        }
    }
}

// x * sigmoid(x), e^-|x| by exp_poly (which takes arguments <= 0); one division, no branch, so
// that the loop vectorizes.
__attribute__((always_inline)) static inline float silu(float x) {
    const float e = exp_poly(-__builtin_fabsf(x));
    return x * (x >= 0.0f ? 1.0f : e) / (1.0f + e);
}

// Rows [t0, t1) of gu = [gate | up] (I each): out = SiLU(gate) * up. In chunks through fp32
// buffers: a loop that mixes bf16 and exp_poly's int32 does not vectorize, fp32 alone does.
#define CHUNK 256
__attribute__((always_inline))
static inline void silu_mul_rows(const uint16_t *gu, int I, uint16_t *out, int64_t t0, int64_t t1) {
    float gate[CHUNK], act[CHUNK];
    for (int64_t t = t0; t < t1; t++) {
        const uint16_t *restrict g = gu + t * 2 * I;
        uint16_t *restrict o = out + t * I;
        for (int i0 = 0; i0 < I; i0 += CHUNK) {
            const int n = I - i0 < CHUNK ? I - i0 : CHUNK;
            for (int i = 0; i < n; i++) gate[i] = bf(g[i0 + i]);
            for (int i = 0; i < n; i++) act[i] = silu(gate[i]);
            for (int i = 0; i < n; i++) o[i0 + i] = to_bf16(bf(to_bf16(act[i])) * bf(g[I + i0 + i]));
        }
    }
}

// Rows split evenly over the threads; a few rows (a decode step's) stay on one thread, where
// waking the others costs more than the work.
#define ROWS_APART(T, work, threads, body)                                                        \
    do {                                                                                          \
        const int n = (int64_t)(T) * (work) < (1 << 16) ? 1 : (threads);                          \
        _Pragma("omp parallel num_threads(n)")                                                    \
        {                                                                                         \
            const int64_t me = omp_get_thread_num(), all = omp_get_num_threads();               \
            const int64_t t0 = (T) * me / all, t1 = (T) * (me + 1) / all;                        \
            body;                                                                                 \
        }                                                                                         \
    } while (0)

#define PATHS(ISA, TARGET)                                                                          \
    __attribute__((target(TARGET))) static void norm_##ISA(uint16_t *x, const uint16_t *residual,   \
        const uint16_t *w, float eps, int64_t T, int H, uint16_t *out, int threads) {                \
        ROWS_APART(T, H, threads, norm_rows(x, residual, w, eps, H, out, t0, t1));                   \
    }                                                                                               \
    __attribute__((target(TARGET))) static void rotate_##ISA(uint16_t *x, int64_t ld, int heads, int D, \
        const float *cis, int64_t T, int threads) {                                                 \
        ROWS_APART(T, heads * D, threads, rotate_rows(x, ld, heads, D, cis, t0, t1));               \
    }                                                                                               \
    __attribute__((target(TARGET))) static void silu_mul_##ISA(const uint16_t *gu, int I, uint16_t *out, \
        int64_t T, int threads) {                                                                   \
        ROWS_APART(T, 8 * I, threads, silu_mul_rows(gu, I, out, t0, t1));                           \
    }

PATHS(avx2, "avx2,fma")

// The same three, 16 values a vector (tails by mask), rounding where the plain loops round:
// ROUND(v) gives v's 16 bf16 values, by integer arithmetic (round16_bf16) or, where the CPU has
// AVX512-BF16, by vcvtneps2bf16 (one instruction for nine; the same bits but for fp32 subnormals,
// which it flushes to zero).
#define POINTWISE16(ISA, TARGET, ROUND)                                                              \
    __attribute__((target(TARGET))) static inline __m512 rounded_##ISA(__m512 v) {                 \
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(ROUND(v)), 16));        \
    }                                                                                               \
    __attribute__((target(TARGET))) static inline void store_##ISA(uint16_t *p, __m512 v, __mmask16 m) { \
        _mm256_mask_storeu_epi16(p, m, ROUND(v));                                                   \
    }                                                                                               \
    __attribute__((target(TARGET))) static void norm_rows_##ISA(uint16_t *x, const uint16_t *residual, \
        const uint16_t *w, float eps, int H, uint16_t *out, int64_t t0, int64_t t1) {               \
        for (int64_t t = t0; t < t1; t++) {                                                         \
            uint16_t *restrict xr = x + t * H;                                                      \
            uint16_t *restrict o = out + t * H;                                                     \
            __m512 ss = _mm512_setzero_ps();                                                        \
            for (int i = 0; i < H; i += 16) {                                                       \
                const __mmask16 m = lanes16(H - i);                                                 \
                __m512 v = load16_bf16(xr + i, m);                                                  \
                if (residual) {                                                                     \
                    v = rounded_##ISA(_mm512_add_ps(v, load16_bf16(residual + t * H + i, m)));      \
                    store_##ISA(xr + i, v, m);                                                      \
                }                                                                                   \
                ss = _mm512_fmadd_ps(v, v, ss);                                                     \
            }                                                                                       \
            const __m512 rstd = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)H + eps)); \
            for (int i = 0; i < H; i += 16) {                                                       \
                const __mmask16 m = lanes16(H - i);                                                 \
                const __m512 v = rounded_##ISA(_mm512_mul_ps(load16_bf16(xr + i, m), rstd));        \
                store_##ISA(o + i, _mm512_mul_ps(v, load16_bf16(w + i, m)), m);                     \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
    /* a pair (a, b) and its turn (cos, sin), both interleaved: (a cos - b sin, a sin + b cos) */   \
    __attribute__((target(TARGET))) static void rotate_rows_##ISA(uint16_t *x, int64_t ld, int heads, int D, \
        const float *cis, int64_t t0, int64_t t1) {                                                 \
        for (int64_t t = t0; t < t1; t++)                                                           \
            for (int h = 0; h < heads; h++) {                                                       \
                uint16_t *restrict xh = x + t * ld + (int64_t)h * D;                                \
                for (int i = 0; i < D; i += 16) {                                                   \
                    const __mmask16 m = lanes16(D - i);                                             \
                    const __m512 v = load16_bf16(xh + i, m), c = _mm512_maskz_loadu_ps(m, cis + t * D + i); \
                    const __m512 swapped = _mm512_permute_ps(v, 0xb1);  /* (b, a) in each pair */   \
                    const __m512 plain = _mm512_mul_ps(v, _mm512_moveldup_ps(c));  /* rounded: */   \
                    const __m512 cross = _mm512_mul_ps(swapped, _mm512_movehdup_ps(c));  /* as torch */ \
                    store_##ISA(xh + i, _mm512_fmaddsub_ps(plain, _mm512_set1_ps(1.0f), cross), m);  \
                }                                                                                   \
            }                                                                                       \
    }                                                                                               \
    __attribute__((target(TARGET))) static void silu_mul_rows_##ISA(const uint16_t *gu, int I, uint16_t *out, \
        int64_t t0, int64_t t1) {                                                                   \
        const __m512 one = _mm512_set1_ps(1.0f);                                                    \
        for (int64_t t = t0; t < t1; t++) {                                                         \
            const uint16_t *restrict g = gu + t * 2 * I;                                            \
            uint16_t *restrict o = out + t * I;                                                     \
            for (int i = 0; i < I; i += 16) {                                                       \
                const __mmask16 m = lanes16(I - i);                                                 \
                const __m512 x = load16_bf16(g + i, m);                                             \
                const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));  /* e^-|x| */ \
                const __mmask16 positive = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);  \
                const __m512 act = _mm512_div_ps(_mm512_mul_ps(x, _mm512_mask_blend_ps(positive, e, one)), \
                                                 _mm512_add_ps(one, e));                            \
                store_##ISA(o + i, _mm512_mul_ps(rounded_##ISA(act), load16_bf16(g + I + i, m)), m); \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
    __attribute__((target(TARGET))) static void norm_##ISA(uint16_t *x, const uint16_t *residual,   \
        const uint16_t *w, float eps, int64_t T, int H, uint16_t *out, int threads) {                \
        ROWS_APART(T, H, threads, norm_rows_##ISA(x, residual, w, eps, H, out, t0, t1));             \
    }                                                                                               \
    __attribute__((target(TARGET))) static void rotate_##ISA(uint16_t *x, int64_t ld, int heads, int D, \
        const float *cis, int64_t T, int threads) {                                                 \
        ROWS_APART(T, heads * D, threads, rotate_rows_##ISA(x, ld, heads, D, cis, t0, t1));         \
    }                                                                                               \
    __attribute__((target(TARGET))) static void silu_mul_##ISA(const uint16_t *gu, int I, uint16_t *out, \
        int64_t T, int threads) {                                                                   \
        ROWS_APART(T, 8 * I, threads, silu_mul_rows_##ISA(gu, I, out, t0, t1));                     \
    }

#define ROUND_INT(v) round16_bf16(_mm512_castps_si512(v))
#define ROUND_NATIVE(v) ((__m256i)_mm512_cvtneps_pbh(v))
POINTWISE16(avx512, "avx512f,avx512bw,avx512vl", ROUND_INT)
POINTWISE16(avx512bf16, "avx512f,avx512bw,avx512vl,avx512bf16", ROUND_NATIVE)

void pagoda_rms_norm_bf16(uint16_t *x, const uint16_t *residual, const uint16_t *w, float eps, int64_t T,
                          int H, uint16_t *out, int threads, int isa) {
    (isa == 3 ? norm_avx512bf16 : isa == 2 ? norm_avx512 : norm_avx2)(x, residual, w, eps, T, H, out, threads);
}

void pagoda_rotary_bf16(uint16_t *x, int64_t ld, int heads, int D, const float *cis, int64_t T, int threads,
                        int isa) {
    (isa == 3 ? rotate_avx512bf16 : isa == 2 ? rotate_avx512 : rotate_avx2)(x, ld, heads, D, cis, T, threads);
}

void pagoda_silu_mul_bf16(const uint16_t *gu, int I, uint16_t *out, int64_t T, int threads, int isa) {
    (isa == 3 ? silu_mul_avx512bf16 : isa == 2 ? silu_mul_avx512 : silu_mul_avx2)(gu, I, out, T, threads);
}
