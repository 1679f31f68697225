// The AVX-512 path's grouped decode attention over a bf16 cache in 16-slot blocks, widening bf16
// by halves of 32-bit lanes instead of element by element. A bf16 is the top half of an fp32, so
// 32 bf16 loaded as 16 32-bit lanes give 16 fp32 in one instruction each: the even elements
// (shifted left by 16) and the odd ones (the low half masked off). Widening 16 bf16 element by
// element took GCC three instructions and an insert (it splits the conversion into two 8-lane
// ones), more than the FMAs they fed; here 32 bf16 take one load and two instructions.
//
// Keys: rows d and d + 1 of a block's [D, 16] keys are one 64-byte load, so the even lanes
// hold the block's even positions (lanes 0-7 of row d, 8-15 of row d + 1) against the vector
// (q[d] x 8, q[d + 1] x 8); the halves are added and the even and odd positions interleaved once
// per block. Values: 32 values of a position's row are one load, even and odd columns apart
// until the end. The sums run in the same order as attend_group16's, so the scores and outputs
// are the same bits (bench/bench_cpu_attention.py --decode has the speed).
#ifndef PAGODA_CPU_DECODE_ATTENTION_BF16_H
#define PAGODA_CPU_DECODE_ATTENTION_BF16_H

#include <stdint.h>

typedef uint32_t u32x16_lanes __attribute__((vector_size(64), aligned(2)));

// Whether attend_group16_bf16 serves these shapes (G as groups_fit allows).
static inline int bf16_pairs_fit(int D, int bs) { return bs == 16 && D % 32 == 0; }

__attribute__((always_inline)) static inline void widen_pairs(const void *at, v16 *even, v16 *odd) {
    const u32x16_lanes bits = *(const u32x16_lanes *)at;
    *even = (v16)(bits << 16);
    *odd = (v16)(bits & 0xffff0000u);
}

// s: G * width scores; qq: G * 8 * D floats of scratch for the paired queries.
__attribute__((always_inline))
static inline void attend_group16_bf16(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                       const int32_t *table, int len, int h, int Hkv, int D, float scale,
                                       int width, float *restrict s, float *restrict qq, float *out,
                                       const int G, const int ahead) {
    const int bs = 16, pairs = D / 2;
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d += 2)
            for (int l = 0; l < 16; l++)
                qq[((int64_t)g * pairs + d / 2) * 16 + l] = q[g * D + d + (l >= 8)] * scale;
    const int nblocks = (len + bs - 1) / bs;
    for (int j = 0; j < nblocks; j++) {
        const uint16_t *kb = k_cache + ((int64_t)table[j] * Hkv + h) * D * bs;
        v16 e[4], o[4];
        for (int g = 0; g < G; g++) e[g] = o[g] = (v16){0};
        for (int d = 0; d < D; d += 2) {
            prefetch_keys(k_cache, table, j, nblocks, h, Hkv, D, bs, 1, ahead, (int64_t)d * bs * 2, 2 * bs * 2);  // a line a step
            v16 ke, ko;
            widen_pairs(kb + (int64_t)d * bs, &ke, &ko);
            for (int g = 0; g < G; g++) {
                const v16 qd = *(const v16 *)(qq + ((int64_t)g * pairs + d / 2) * 16);
                e[g] += qd * ke;
                o[g] += qd * ko;
            }
        }
        for (int g = 0; g < G; g++) {
            const v8 even = __builtin_shufflevector(e[g], e[g], 0, 1, 2, 3, 4, 5, 6, 7) +
                            __builtin_shufflevector(e[g], e[g], 8, 9, 10, 11, 12, 13, 14, 15);
            const v8 odd = __builtin_shufflevector(o[g], o[g], 0, 1, 2, 3, 4, 5, 6, 7) +
                           __builtin_shufflevector(o[g], o[g], 8, 9, 10, 11, 12, 13, 14, 15);
            *(v16 *)(s + (int64_t)g * width + (int64_t)j * bs) =
                __builtin_shufflevector(even, odd, 0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
        }
    }
    float inv[4];
    for (int g = 0; g < G; g++) inv[g] = softmax(s + (int64_t)g * width, len);
    const int dtype = 1;
    for (int c0 = 0; c0 < D; c0 += 64) {  // up to 64 values of each head's row: G * 4 sums
        const int n = D - c0 < 64 ? 1 : 2;  // loads of 32 values
        v16 acc[4][4];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < 4; c++) acc[g][c] = (v16){0};
        FOR_EACH_POSITION({
            v16 v[4];
            for (int c = 0; c < n; c++) widen_pairs(v_cache + vrow + c0 + 32 * c, &v[2 * c], &v[2 * c + 1]);
            for (int g = 0; g < G; g++) {
                const float w = s[(int64_t)g * width + p];
                for (int c = 0; c < 2 * n; c++) acc[g][c] += w * v[c];
            }
        })
        for (int g = 0; g < G; g++)
            for (int c = 0; c < n; c++) {  // even and odd columns back in order
                const v16 ev = acc[g][2 * c] * inv[g], od = acc[g][2 * c + 1] * inv[g];
                float *to = out + g * D + c0 + 32 * c;
                *(v16 *)to = __builtin_shufflevector(ev, od, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
                *(v16 *)(to + 16) =
                    __builtin_shufflevector(ev, od, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
            }
    }
}

#endif
