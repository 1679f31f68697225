// AMX tiles (Sapphire Rapids and later) for kernels/csrc/cpu_gemm_bf16.c's projections, computed
// as out^T = W x^T so that the weights load where they lie: an A tile is 16 weight rows x 32
// values of k straight from W (row stride ldw), a B tile 16 rows of x x 32 of k in the pairs
// TDPBF16PS reads (x packed once a call: kilobytes), a C tile 16 weights x 16 rows in fp32. The
// usual layout, B packed from the weights, would need a second copy of them (270 MB for
// SmolLM2 in bf16) or a repack on every call.
//
// Included by cpu_gemm_bf16.c and by the one-call decode step (kernels/csrc/cpu_decode_layer.c).
#ifndef PAGODA_CPU_BF16_AMX_H
#define PAGODA_CPU_BF16_AMX_H

#include "cpu_bf16_vec.h"

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TILE 16             // rows of a tile: weights in A and C, pairs of k in B
#define AMX_K 32                // values of k in a tile row (64 bytes of bf16)
#define AMX_GROUP 32            // weight rows a task takes: two A tiles against each B
#define AMX_B_VALUES (AMX_TILE * AMX_K)  // bf16 values in one packed B tile
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

struct amx_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Linux (5.16 and later) gives a process the tiles' 8 KB of state only on request: without it
// the first tile instruction is killed with SIGILL. Asked once, by pagoda_bf16_isa.
static int amx_permitted(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

// A 16 x 16 matrix of 32-bit values (r[i] its row i) transposed in registers: 64 shuffles where
// element by element it took 256 scalar moves, which made the epilogue and the packing of x cost
// more than the tiles' products past 64 rows (bench/bench_gemm.py --dtype bfloat16).
__attribute__((target("avx512f")))
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {  // 32-bit pairs
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  // 64-bit pairs
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {  // then 128-bit lanes, twice
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);       // lanes 0, 2 of each
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);   // lanes 1, 3 of each
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);        // lane 0 of every 4 rows
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);    // lane 2
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);  // lane 1
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd); // lane 3
    }
}

// x [M, K] as B tiles: for block b (16 rows of x) and step s (32 of k), 16 rows of pairs, row p
// holding (x[m][32 s + 2 p], x[m][32 s + 2 p + 1]) for m = 0..15; rows of x past M are zeros.
// A step's 16 rows of x, 16 pairs each, transposed as 32-bit values, are that tile.
__attribute__((target("avx512f")))
static inline void amx_pack_tile(const uint16_t *x, int64_t ldx, int M, int64_t b, int64_t s, uint16_t *tile) {
    __m512i r[16];
    for (int i = 0; i < 16; i++) {
        const int64_t m = b * AMX_TILE + i;
        r[i] = m < M ? _mm512_loadu_si512(x + m * ldx + s * AMX_K) : _mm512_setzero_si512();
    }
    transpose16(r);
    for (int p = 0; p < 16; p++) _mm512_store_si512(tile + p * 2 * AMX_TILE, r[p]);
}

// Bytes of x [M, K] packed: aligned to 64 for the tiles' loads.
static inline size_t amx_packed_bytes(int M, int64_t K) {
    return (size_t)((M + AMX_TILE - 1) / AMX_TILE * (K / AMX_K) * AMX_B_VALUES) * sizeof(uint16_t);
}

static inline uint16_t *amx_pack_x(const uint16_t *x, int64_t ldx, int M, int64_t K) {
    const int64_t blocks = (M + AMX_TILE - 1) / AMX_TILE, steps = K / AMX_K;
    uint16_t *packed = aligned_alloc(64, amx_packed_bytes(M, K));
    if (!packed) return NULL;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t s = 0; s < steps; s++) amx_pack_tile(x, ldx, M, b, s, packed + (b * steps + s) * AMX_B_VALUES);
    return packed;
}

// The calling thread's tile configuration (thread state): eight 16 x 64-byte tiles.
__attribute__((target("amx-tile"), noinline))
static void amx_configure(void) {
    struct amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = AMX_TILE;
        cfg.colsb[t] = 64;
    }
    // GCC 12 drops the stores above as dead (it does not see ldtilecfg read them), leaving an
    // invalid configuration (SIGSEGV): the empty asm makes them visible
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile"), noinline))
static void amx_release(void) {
    _tile_release();
}

// 32 weight rows from w (ldw elements apart) against the packed blocks at b0 and, if both, the
// next: c[t][n][m] = weight 16 (t % 2) + n times row 16 (t / 2) + m of those blocks, in fp32.
// tmm0-3: C; 4, 5: A (the weights where they lie); 6, 7: B.
// ahead: the next group's weights (32 rows from there, ldw apart), fetched into L2 a share a step
// (NULL: none). An A tile takes 16 rows 64 bytes at a time, too many streams for the hardware
// prefetchers, so a group's first pass over x waited on memory for its weights.
__attribute__((target("amx-tile,amx-bf16")))
static inline void amx_products(const uint16_t *w, int64_t ldw, const uint16_t *b0, int both, int64_t steps,
                                float c[4][AMX_TILE][AMX_TILE], const uint16_t *ahead) {
    const int64_t stride = ldw * (int64_t)sizeof(uint16_t);
    const uint16_t *w1 = w + AMX_TILE * ldw, *b1 = b0 + steps * AMX_B_VALUES;
    const int64_t lines = AMX_GROUP * stride / 64, per_step = (lines + steps - 1) / steps;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < steps; s++) {
        if (ahead)
            for (int64_t i = s * per_step; i < (s + 1) * per_step && i < lines; i++)
                _mm_prefetch((const char *)ahead + i * 64, _MM_HINT_T1);
        _tile_loadd(4, w + s * AMX_K, stride);
        _tile_loadd(5, w1 + s * AMX_K, stride);
        _tile_loadd(6, b0 + s * AMX_B_VALUES, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        if (both) {
            _tile_loadd(7, b1 + s * AMX_B_VALUES, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    if (both) {
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
    }
}

// How amx_group stores its tiles: rounded to bf16, or fp32 written or added.
enum { AMX_BF16, AMX_F32, AMX_F32_ADD };

// A C tile (c[n][m]: 16 weights x 16 rows) into out's rows m0.. (mr of them), columns n0..
__attribute__((target("avx512f,avx512bw")))
static inline void amx_store(const float c[AMX_TILE][AMX_TILE], void *out, int64_t ldo, int m0, int mr,
                             int64_t n0, int store) {
    __m512i r[16];
    for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_si512(c[j]);
    transpose16(r);  // r[i]: row i of x's 16 outputs
    for (int i = 0; i < mr; i++) {
        const int64_t at = (m0 + i) * ldo + n0;
        if (store == AMX_BF16) {
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), round16_bf16(r[i]));
        } else {
            float *o = (float *)out + at;
            const __m512 v = _mm512_castsi512_ps(r[i]);
            _mm512_storeu_ps(o, store == AMX_F32_ADD ? _mm512_add_ps(_mm512_loadu_ps(o), v) : v);
        }
    }
}

// One task: 32 weight rows (w, ldw apart) against every 32 rows of x packed at xp (M rows,
// `steps` of 32 of k), into out's columns n0..n0 + 31; ahead: the next group's weights, fetched
// while the first rows pass (NULL: none). The calling thread's tiles configured.
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw")))
static inline void amx_group(const uint16_t *w, int64_t ldw, const uint16_t *xp, int M, int64_t steps,
                             const uint16_t *ahead, void *out, int64_t ldo, int64_t n0, int store) {
    const int blocks = (M + AMX_TILE - 1) / AMX_TILE;
    float c[4][AMX_TILE][AMX_TILE];
    for (int b = 0; b < blocks; b += 2) {
        const int both = b + 1 < blocks;
        amx_products(w, ldw, xp + (int64_t)b * steps * AMX_B_VALUES, both, steps, c, b == 0 ? ahead : NULL);
        for (int t = 0; t < (both ? 4 : 2); t++) {
            const int m0 = (b + t / 2) * AMX_TILE;
            amx_store(c[t], out, ldo, m0, M - m0 < AMX_TILE ? M - m0 : AMX_TILE, n0 + (t % 2) * AMX_TILE, store);
        }
    }
}

// The first N / 32 * 32 columns of out (returned; 0 where K is not a multiple of 32 or the
// memory for packed x is short: the caller computes what is left another way). Tasks are groups
// of 32 weight rows split over the threads; each takes every 32 rows of x in turn, its two A
// tiles loaded once per step for both B tiles (its weights come from memory for the first rows
// and from L2 after).
__attribute__((target("amx-tile,amx-bf16"), unused))
static int64_t xwt_amx(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw, uint16_t *out,
                       int64_t ldo, int M, int64_t N, int64_t K, int threads) {
    const int64_t groups = N / AMX_GROUP, steps = K / AMX_K;
    if (groups == 0 || K % AMX_K) return 0;
    uint16_t *xp = amx_pack_x(x, ldx, M, K);
    if (!xp) return 0;
    #pragma omp parallel num_threads(threads)
    {
        amx_configure();
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++)
            amx_group(w + g * AMX_GROUP * ldw, ldw, xp, M, steps, g + 1 < groups ? w + (g + 1) * AMX_GROUP * ldw : NULL,
                      out, ldo, g * AMX_GROUP, AMX_BF16);
        amx_release();
    }
    free(xp);
    return groups * AMX_GROUP;
}

#endif
