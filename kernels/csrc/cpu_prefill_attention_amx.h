// The prefill attention's tile on AMX (bf16 cache and queries, head dims a multiple of 32): the
// same task as cpu_prefill_attention.c's TILE (16 queries x the G query heads of one kv head,
// softmax kept online), with both products on the tiles. The fp32 tile ran at 110-130 GFLOP/s on
// an AMX Xeon where torch's bf16 SDPA, itself on AMX, ran at 170-460 (bench/bench_cpu_attention.py).
//
// For each chunk of 32 keys:
// - K's 32 keys are repacked into B tiles (pairs of d interleaved, as TDPBF16PS reads them: the
//   cache holds keys transposed, so a pair is two 32-byte rows woven together), and the rows'
//   queries, kept in bf16 as they came, are the A tiles: S = Q K^T in fp32;
// - the softmax runs on S's rows in AVX-512 (scaled there, in fp32), and its weights, rounded to
//   bf16, are the A tile of P V; their sum is taken from the rounded weights, so that the
//   output's weights sum to 1 as in fp32;
// - V's 32 keys are repacked into B tiles of key pairs (keys past the tile's last position as
//   zeros: stale slots hold anything, NaN in the tests), and P V is added to the fp32 sums on the
//   tiles (C loaded from the sums, stored back).
#ifndef PAGODA_CPU_PREFILL_ATTENTION_AMX_H
#define PAGODA_CPU_PREFILL_ATTENTION_AMX_H

#include "cpu_bf16_amx.h"

#define AKC 32  // keys a chunk: two B tiles of keys for Q K^T, the K dimension of P V

static inline int amx_tile_fits(int D) { return D % 32 == 0; }

// Floats of scratch a thread needs (every part 64-byte aligned): queries, sums, scores,
// weights, packed K and V, running max and total.
static inline size_t amx_tile_scratch(int G, int D) {
    const size_t R = (size_t)(16 * G + 15) / 16 * 16;
    return R * D / 2 + R * D + R * AKC + R * AKC / 2 + (size_t)D * AKC + 2 * (R + 16);
}

// Two runs of 16 bf16 woven into 32: (a0, b0, a1, b1, ...): a pair row of a B tile.
__attribute__((target("avx512f,avx512bw"))) static inline __m512i amx_weave(__m256i a, __m256i b) {
    const __m512i idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                         39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);  // a: 0-31, b: 32-63
    return _mm512_permutex2var_epi16(_mm512_castsi256_si512(a), idx, _mm512_castsi256_si512(b));
}

// One task on the tiles: queries t0.. of a sequence (start: its first row of q; n new tokens
// ending at position len - 1) and kv head h. The calling thread's tiles configured
// (amx_configure: eight tiles of 16 x 64 bytes).
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl")))
static void tile_amx(const Shape *sh, const int32_t *table, int64_t start, int n, int len, int t0, int h,
                     float *scratch) {
    const int G = sh->Hq / sh->Hkv, D = sh->D, bs = sh->bs, Hkv = sh->Hkv, steps = D / 32;
    const int nq = n - t0 < QT ? n - t0 : QT, pos0 = len - n + t0, rows = nq * G;
    const int R = (rows + 15) / 16 * 16, Rmax = (16 * G + 15) / 16 * 16;
    const uint16_t *kc = sh->k_cache, *vc = sh->v_cache;
    uint16_t *restrict qb = (uint16_t *)scratch;                            // [R][D]
    float *restrict acc = scratch + (size_t)Rmax * D / 2;                   // [R][D]
    float *restrict s = acc + (size_t)Rmax * D;                             // [R][AKC]
    uint16_t *restrict p = (uint16_t *)(s + (size_t)Rmax * AKC);            // [R][AKC]
    uint16_t *restrict kp = (uint16_t *)(s + (size_t)Rmax * AKC * 3 / 2);   // [2][steps][16][32]
    uint16_t *restrict vp = kp + (size_t)D * AKC;                           // [D / 16][16][32]
    float *restrict mx = (float *)(vp + (size_t)D * AKC), *restrict sum = mx + Rmax + 16;

    for (int i = 0; i < nq; i++)  // row i G + g: query i, head g (a query's G heads lie together)
        memcpy(qb + (size_t)i * G * D, (const uint16_t *)sh->q + (start + t0 + i) * sh->ldq + (int64_t)h * G * D,
               (size_t)G * D * sizeof(uint16_t));
    memset(qb + (size_t)rows * D, 0, (size_t)(R - rows) * D * sizeof(uint16_t));
    memset(acc, 0, (size_t)R * D * sizeof(float));
    memset(p + (size_t)rows * AKC, 0, (size_t)(R - rows) * AKC * sizeof(uint16_t));
    for (int r = 0; r < rows; r++) mx[r] = -__builtin_inff(), sum[r] = 0.0f;

    const __m512 scale = _mm512_set1_ps(sh->scale), ninf = _mm512_set1_ps(-__builtin_inff());
    const int kend = pos0 + nq;  // the keys the task sees: [0, kend)
    for (int k0 = 0; k0 < kend; k0 += AKC) {
        const int nk = kend - k0 < AKC ? kend - k0 : AKC, halves = nk > 16 ? 2 : 1;
        for (int half = 0; half < halves; half++) {  // K: pair rows of d for 16 keys
            const int key = k0 + 16 * half;
            const int64_t kb = ((int64_t)table[key / bs] * Hkv + h) * D * bs + key % bs;
            for (int q2 = 0; q2 < D / 2; q2++) {
                const __m256i a = _mm256_loadu_si256((const __m256i *)(kc + kb + (int64_t)(2 * q2) * bs));
                const __m256i b = _mm256_loadu_si256((const __m256i *)(kc + kb + (int64_t)(2 * q2 + 1) * bs));
                _mm512_store_si512(kp + ((size_t)(half * steps + q2 / 16) * 16 + q2 % 16) * 32, amx_weave(a, b));
            }
        }
        for (int rt = 0; rt < R / 16; rt++) {  // S = Q K^T, 16 rows at a time
            _tile_zero(0);
            _tile_zero(1);
            for (int st = 0; st < steps; st++) {
                _tile_loadd(2, qb + (size_t)rt * 16 * D + st * 32, D * 2);
                _tile_loadd(3, kp + (size_t)st * 512, 64);
                _tile_dpbf16ps(0, 2, 3);
                if (halves == 2) {
                    _tile_loadd(4, kp + (size_t)(steps + st) * 512, 64);
                    _tile_dpbf16ps(1, 2, 4);
                }
            }
            _tile_stored(0, s + (size_t)rt * 16 * AKC, AKC * 4);
            _tile_stored(1, s + (size_t)rt * 16 * AKC + 16, AKC * 4);
        }
        for (int r = 0; r < rows; r++) {  // the online softmax, weights into P in bf16
            int seen = pos0 + r / G - k0 + 1;  // keys of the chunk row r sees
            seen = seen > nk ? nk : seen;
            uint16_t *restrict pr = p + (size_t)r * AKC;
            if (seen <= 0) {
                _mm512_store_si512(pr, _mm512_setzero_si512());
                continue;
            }
            const __mmask16 m0 = seen >= 16 ? 0xffff : (__mmask16)((1u << seen) - 1);
            const __mmask16 m1 = seen >= 32 ? 0xffff : seen > 16 ? (__mmask16)((1u << (seen - 16)) - 1) : 0;
            const __m512 x0 = _mm512_mask_mul_ps(ninf, m0, _mm512_load_ps(s + (size_t)r * AKC), scale);
            const __m512 x1 = _mm512_mask_mul_ps(ninf, m1, _mm512_load_ps(s + (size_t)r * AKC + 16), scale);
            const float most_here = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));
            const float most = most_here > mx[r] ? most_here : mx[r];
            const __m512 top = _mm512_set1_ps(most);
            const __m256i w0 = round16_bf16(_mm512_castps_si512(_mm512_maskz_mov_ps(m0, exp16(_mm512_sub_ps(x0, top)))));
            const __m256i w1 = round16_bf16(_mm512_castps_si512(_mm512_maskz_mov_ps(m1, exp16(_mm512_sub_ps(x1, top)))));
            _mm256_store_si256((__m256i *)pr, w0);
            _mm256_store_si256((__m256i *)(pr + 16), w1);
            const __m512 back0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w0), 16));
            const __m512 back1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w1), 16));
            const float total = _mm512_reduce_add_ps(_mm512_add_ps(back0, back1));
            if (most != mx[r]) {
                const float keep = mx[r] == -__builtin_inff() ? 0.0f : exp_poly(mx[r] - most);
                const __m512 k = _mm512_set1_ps(keep);
                for (int x = 0; x < D; x += 16)
                    _mm512_store_ps(acc + (size_t)r * D + x, _mm512_mul_ps(k, _mm512_load_ps(acc + (size_t)r * D + x)));
                sum[r] *= keep;
                mx[r] = most;
            }
            sum[r] += total;
        }
        for (int j = 0; j < AKC / 2; j++) {  // V: pair rows of keys, keys past the chunk's as 0
            const int key = k0 + 2 * j;
            const __mmask16 ka = key < kend ? 0xffff : 0, kb = key + 1 < kend ? 0xffff : 0;
            const int64_t va = ka ? (((int64_t)table[key / bs] * bs + key % bs) * Hkv + h) * D : 0;
            const int64_t vb = kb ? (((int64_t)table[(key + 1) / bs] * bs + (key + 1) % bs) * Hkv + h) * D : 0;
            for (int c = 0; c < D / 16; c++) {
                const __m256i a = _mm256_maskz_loadu_epi16(ka, vc + va + c * 16);
                const __m256i b = _mm256_maskz_loadu_epi16(kb, vc + vb + c * 16);
                _mm512_store_si512(vp + ((size_t)c * 16 + j) * 32, amx_weave(a, b));
            }
        }
        for (int rt = 0; rt < R / 16; rt++) {  // sums += P V, 16 rows x 16 of d a tile, 4 tiles at once
            _tile_loadd(1, p + (size_t)rt * 16 * AKC, AKC * 2);
            for (int c0 = 0; c0 < D / 16; c0 += 4) {  // D / 16 is even: 2 or 4 tiles a pass
                float *at = acc + (size_t)rt * 16 * D + c0 * 16;
                const uint16_t *vt = vp + (size_t)c0 * 512;
                const int four = D / 16 - c0 >= 4;
                _tile_loadd(0, at, D * 4);
                _tile_loadd(5, at + 16, D * 4);
                _tile_loadd(2, vt, 64);
                _tile_loadd(3, vt + 512, 64);
                _tile_dpbf16ps(0, 1, 2);
                _tile_dpbf16ps(5, 1, 3);
                if (four) {
                    _tile_loadd(6, at + 32, D * 4);
                    _tile_loadd(7, at + 48, D * 4);
                    _tile_loadd(4, vt + 1024, 64);
                    _tile_loadd(2, vt + 1536, 64);
                    _tile_dpbf16ps(6, 1, 4);
                    _tile_dpbf16ps(7, 1, 2);
                }
                _tile_stored(0, at, D * 4);
                _tile_stored(5, at + 16, D * 4);
                if (four) {
                    _tile_stored(6, at + 32, D * 4);
                    _tile_stored(7, at + 48, D * 4);
                }
            }
        }
    }
    const int64_t ldo = (int64_t)sh->Hq * D;
    for (int r = 0; r < rows; r++) {
        const __m512 inv = _mm512_set1_ps(1.0f / sum[r]);
        uint16_t *o = (uint16_t *)sh->out + (start + t0 + r / G) * ldo + (int64_t)(h * G + r % G) * D;
        for (int x = 0; x < D; x += 16)
            _mm256_storeu_si256((__m256i *)(o + x),
                                round16_bf16(_mm512_castps_si512(_mm512_mul_ps(inv, _mm512_load_ps(acc + (size_t)r * D + x)))));
    }
}

#endif
