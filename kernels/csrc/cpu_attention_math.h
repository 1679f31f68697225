// What kernels/csrc's attention kernels share: an element or vector of a cache (fp32 or bf16,
// dtype 0 or 1) widened to fp32, and an exp they can vectorize. Included by each kernel's source,
// whose target attributes compile these inline bodies for AVX-512F or AVX2 + FMA.
#ifndef PAGODA_CPU_ATTENTION_MATH_H
#define PAGODA_CPU_ATTENTION_MATH_H

#include <stdint.h>
#include <string.h>

__attribute__((always_inline)) static inline float load_elem(const void *base, int64_t i, const int dtype) {
    if (dtype == 0) return ((const float *)base)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)base)[i] << 16;  // bf16: the top half of an fp32
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// e^x for x <= 0 (a softmax's shifted scores); below -87 it is 0, as e^x is in fp32. Loops of
// it vectorize for AVX2 only without trapping math (kernels/cbuild.py EXP_KERNEL_FLAGS).
__attribute__((always_inline)) static inline float exp_poly(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // rounded to nearest: 1.5 * 2^23
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // x - n ln 2, in two steps
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;  // 2^n: n >= -126 here
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

// 8 floats: an AVX2 register; 16: an AVX-512 one.
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef uint16_t u16x8 __attribute__((vector_size(16), aligned(2)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

__attribute__((always_inline)) static inline v8 load8(const void *base, int64_t i, const int dtype) {
    if (dtype == 0) return *(const v8 *)((const float *)base + i);
    u32x8 bits = __builtin_convertvector(*(const u16x8 *)((const uint16_t *)base + i), u32x8) << 16;
    return (v8)bits;
}

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

__attribute__((always_inline)) static inline v16 load16(const void *base, int64_t i, const int dtype) {
    if (dtype == 0) return *(const v16 *)((const float *)base + i);
    u32x16 bits = __builtin_convertvector(*(const u16x16 *)((const uint16_t *)base + i), u32x16) << 16;
    return (v16)bits;
}

// x rounded to the nearest bf16, ties to even (a NaN stays a NaN).
__attribute__((always_inline)) static inline uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#endif
