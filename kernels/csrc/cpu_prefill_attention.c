// Paged causal attention on the CPU for sequences with many new tokens (prefill chunks): each
// query sees the positions up to its own, read where the keys and values lie in the cache, in one
// call a layer for every such sequence of the step. It replaces, per sequence, the gather of its
// context out of the blocks and torch's flash SDPA, which ran at about 80 GFLOP/s on 256-token
// sequences where this kernel runs at 180-220 (bench/bench_cpu_attention.py).
//
// Layouts as kernels/csrc/cpu_decode_attention.c's: K blocks [num_blocks, Hkv, D, bs] (keys
// transposed), V blocks [num_blocks, bs, Hkv, D], fp32 or bf16 (cache dtype 0 or 1); q and out
// [tokens, Hq, D] in fp32 or bf16 (io dtype), q's rows ldq apart, out's contiguous. Sequence i's n[i] queries are q's rows start[i]...,
// query t at position len[i] - n[i] + t.
//
// A task is one tile: QT consecutive queries of a sequence and the G query heads of one kv head,
// R = QT * G rows, each row's softmax kept online (running max and sum) over chunks of 16 keys:
// - scores: the tile's rows against 16 keys, RB rows at a time, each d one load of 16 keys
//   (widened once for all RB rows) and RB FMAs by a broadcast query element;
// - masking: a row's weights for keys past its own position are 0 (only the tile's last chunks
//   have any), and keys past the tile's last position are never read from V (stale slots hold
//   anything: the tests poison them with NaN);
// - values: RV rows at a time, their sums for up to four vectors of d in registers over the
//   chunk's keys, each V vector loaded once for the RV rows.
// The body is compiled for AVX-512F (16-float vectors) and AVX2 + FMA (8-float vectors); a bf16
// cache is widened to fp32 as it is read. Where the CPU has AMX, a bf16 cache with bf16 queries
// takes the tiles instead (cpu_prefill_attention_amx.h: the same tasks, both products in
// TDPBF16PS).
#include "cpu_attention_math.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QT 16    // queries a tile
#define KC 16    // keys a chunk; the block size is a multiple of it
#define MAX_G 8  // query heads a kv head

int pagoda_prefill_attention_fits(int Hq, int Hkv, int D, int bs) {
    return Hq % Hkv == 0 && Hq / Hkv <= MAX_G && D % 16 == 0 && D <= 256 && bs % KC == 0;
}

typedef struct {
    const void *q, *k_cache, *v_cache;
    void *out;
    int64_t ldq;  // q's row stride: its rows may be a slice of the fused qkv projection's
    int cache_dtype, io_dtype, Hq, Hkv, D, bs;
    float scale;
} Shape;

#define PAD 12  // rows are computed in groups of RB (12 or 6) and RV (6 or 2): a tile's are padded to 12

static inline int padded_rows(int G) { return (QT * G + PAD - 1) / PAD * PAD; }

static inline size_t tile_scratch(int G, int D) {  // floats: queries, sums, scores, max, total
    return (size_t)padded_rows(G) * (2 * (size_t)D + KC + 2);
}

// One tile's attention for vectors of W floats (VT), RB rows a scores pass, RV rows a values pass
// (always whole groups: the rows past the tile's are zero queries whose results are dropped).
#define TILE(NAME, VT, W, LOAD, RB, RV)                                                               \
    __attribute__((always_inline)) static inline void NAME##_values(                                \
        float *restrict acc, const float *restrict s, const void *v_cache, int64_t vrow0, int64_t vstep, \
        int R, int D, int c0, int nk, const int nv, const int cd) {                                 \
        for (int r0 = 0; r0 < R; r0 += RV) {                                                        \
            VT a[RV][4];                                                                            \
            for (int r = 0; r < RV; r++)                                                            \
                for (int c = 0; c < nv; c++) a[r][c] = *(VT *)(acc + (r0 + r) * D + c0 + c * W);   \
            for (int key = 0; key < nk; key++) {                                                    \
                const int64_t vrow = vrow0 + key * vstep + c0;                                      \
                VT v[4];                                                                            \
                for (int c = 0; c < nv; c++) v[c] = LOAD(v_cache, vrow + c * W, cd);                \
                for (int r = 0; r < RV; r++) {                                                      \
                    const float w = s[(r0 + r) * KC + key];                                         \
                    for (int c = 0; c < nv; c++) a[r][c] += w * v[c];                               \
                }                                                                                   \
            }                                                                                       \
            for (int r = 0; r < RV; r++)                                                            \
                for (int c = 0; c < nv; c++) *(VT *)(acc + (r0 + r) * D + c0 + c * W) = a[r][c];   \
        }                                                                                           \
    }                                                                                               \
    __attribute__((always_inline)) static inline void NAME(                                         \
        const Shape *sh, const int32_t *table, int64_t start, int n, int len, int t0, int h,        \
        float *restrict scratch, const int cd, const int io) {                                      \
        const int G = sh->Hq / sh->Hkv, D = sh->D, bs = sh->bs, Hkv = sh->Hkv, P = padded_rows(G);  \
        const int nq = n - t0 < QT ? n - t0 : QT, pos0 = len - n + t0;                              \
        const int R = (nq * G + PAD - 1) / PAD * PAD;  /* rows computed: the real ones, padded */   \
        const int64_t ldo = (int64_t)sh->Hq * D;                                                    \
        float *restrict qs = scratch, *restrict acc = qs + (size_t)P * D;                           \
        float *restrict s = acc + (size_t)P * D, *restrict mx = s + (size_t)P * KC;                 \
        float *restrict sum = mx + P;                                                               \
        for (int i = 0; i < nq; i++)                                                                \
            for (int x = 0; x < G * D; x++)                                                         \
                qs[i * G * D + x] = load_elem(sh->q, (start + t0 + i) * sh->ldq + (int64_t)h * G * D + x, io) * sh->scale; \
        memset(qs + (size_t)nq * G * D, 0, (size_t)(R - nq * G) * D * sizeof(float));              \
        for (int r = 0; r < R; r++) mx[r] = -__builtin_inff(), sum[r] = 0.0f;                      \
        memset(acc, 0, (size_t)R * D * sizeof(float));                                              \
        const int kend = pos0 + nq;  /* the keys the tile sees: [0, kend) */                        \
        for (int k0 = 0; k0 < kend; k0 += KC) {                                                     \
            const int64_t block = table[k0 / bs], o = k0 % bs;                                      \
            const int64_t kb = (block * Hkv + h) * D * bs + o;                                      \
            for (int r0 = 0; r0 < R; r0 += RB) {                                                    \
                VT a[RB][KC / W];                                                                   \
                for (int r = 0; r < RB; r++)                                                        \
                    for (int c = 0; c < KC / W; c++) a[r][c] = (VT){0};                             \
                for (int d = 0; d < D; d++) {                                                       \
                    VT k[KC / W];                                                                   \
                    for (int c = 0; c < KC / W; c++) k[c] = LOAD(sh->k_cache, kb + (int64_t)d * bs + c * W, cd); \
                    for (int r = 0; r < RB; r++)                                                    \
                        for (int c = 0; c < KC / W; c++) a[r][c] += qs[(r0 + r) * D + d] * k[c];    \
                }                                                                                   \
                for (int r = 0; r < RB; r++)                                                        \
                    for (int c = 0; c < KC / W; c++) *(VT *)(s + (r0 + r) * KC + c * W) = a[r][c];  \
            }                                                                                       \
            const int nk = kend - k0 < KC ? kend - k0 : KC;  /* keys past these: no query sees */  \
            for (int r = 0; r < R; r++) {                                                           \
                float *restrict sr = s + r * KC;                                                    \
                const int seen = r < nq * G ? pos0 + r / G - k0 + 1 : 0;  /* its keys here */       \
                if (seen <= 0) {                                                                    \
                    for (int c = 0; c < KC; c++) sr[c] = 0.0f;                                      \
                    continue;                                                                       \
                }                                                                                   \
                float most = mx[r];                                                                 \
                for (int c = 0; c < seen && c < KC; c++) most = sr[c] > most ? sr[c] : most;        \
                const float keep = exp_poly(mx[r] - most);                                          \
                float total = 0.0f;                                                                 \
                for (int c = 0; c < KC; c++) {                                                      \
                    sr[c] = c < seen ? exp_poly(sr[c] - most) : 0.0f;                               \
                    total += sr[c];                                                                 \
                }                                                                                   \
                sum[r] = sum[r] * keep + total;                                                     \
                mx[r] = most;                                                                       \
                if (keep != 1.0f)                                                                   \
                    for (int x = 0; x < D; x++) acc[r * D + x] *= keep;                             \
            }                                                                                       \
            const int64_t vrow0 = ((block * bs + o) * Hkv + h) * D, vstep = (int64_t)Hkv * D;       \
            for (int c0 = 0; c0 < D; c0 += 4 * W) {                                                 \
                const int nv = D - c0 < 4 * W ? (D - c0) / W : 4;                                   \
                if (nv == 4) NAME##_values(acc, s, sh->v_cache, vrow0, vstep, R, D, c0, nk, 4, cd); \
                else if (nv == 3) NAME##_values(acc, s, sh->v_cache, vrow0, vstep, R, D, c0, nk, 3, cd); \
                else if (nv == 2) NAME##_values(acc, s, sh->v_cache, vrow0, vstep, R, D, c0, nk, 2, cd); \
                else NAME##_values(acc, s, sh->v_cache, vrow0, vstep, R, D, c0, nk, 1, cd);          \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < nq * G; r++) {                                                          \
            const float inv = 1.0f / sum[r];                                                        \
            const int64_t at = (start + t0 + r / G) * ldo + (int64_t)(h * G + r % G) * D;           \
            for (int x = 0; x < D; x++) {                                                           \
                const float y = acc[r * D + x] * inv;                                               \
                if (io == 0) ((float *)sh->out)[at + x] = y;                                        \
                else ((uint16_t *)sh->out)[at + x] = to_bf16(y);                                    \
            }                                                                                       \
        }                                                                                           \
    }

TILE(tile16, v16, 16, load16, 12, 6)
TILE(tile8, v8, 8, load8, 6, 2)

#include "cpu_prefill_attention_amx.h"

// 3: AMX tiles for a bf16 cache and queries (AVX-512F for the rest), 2: AVX-512F, 1: AVX2 + FMA.
int pagoda_prefill_attention_isa(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0;
    if (!__builtin_cpu_supports("avx512f")) return 1;
    if (__builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") && amx_permitted())
        return 3;
    return 2;
}

// Tasks run the longest first (the last tiles of the longest sequences see the most keys), each
// taken by the next free thread. BEFORE and AFTER: a thread's set-up and tear-down (the tiles').
#define RUN(ISA, TARGET, TILE_CALL, SCRATCH, BEFORE, AFTER)                                        \
    __attribute__((target(TARGET))) static void run_##ISA(                                         \
        const Shape *sh, const int32_t *starts, const int32_t *ns, const int32_t *lens,            \
        const int32_t *tables, int64_t ldt, int num_seqs, const int64_t *first, int threads) {     \
        const int64_t tasks = first[num_seqs];                                                     \
        _Pragma("omp parallel num_threads(threads)")                                               \
        {                                                                                          \
            float *scratch = aligned_alloc(64, ((SCRATCH) * sizeof(float) + 63) / 64 * 64);        \
            BEFORE;                                                                                \
            _Pragma("omp for schedule(dynamic, 1)")                                                \
            for (int64_t t = 0; t < tasks; t++) {                                                  \
                int i = 0;                                                                         \
                while (first[i + 1] <= t) i++;                                                     \
                const int64_t in_seq = t - first[i];                                               \
                const int tiles = (ns[i] + QT - 1) / QT;                                           \
                const int tile = tiles - 1 - (int)(in_seq / sh->Hkv), h = (int)(in_seq % sh->Hkv); \
                const int32_t *table = tables + i * ldt;                                           \
                TILE_CALL;                                                                         \
            }                                                                                      \
            AFTER;                                                                                 \
            free(scratch);                                                                         \
        }                                                                                          \
    }

// The fp32 tile, specialised for the two common dtype pairs.
#define VECTOR_TILE(TILE_FN)                                                                       \
    do {                                                                                           \
        if (sh->cache_dtype == 0 && sh->io_dtype == 0)                                             \
            TILE_FN(sh, table, starts[i], ns[i], lens[i], tile * QT, h, scratch, 0, 0);            \
        else if (sh->cache_dtype == 1 && sh->io_dtype == 1)                                        \
            TILE_FN(sh, table, starts[i], ns[i], lens[i], tile * QT, h, scratch, 1, 1);            \
        else                                                                                       \
            TILE_FN(sh, table, starts[i], ns[i], lens[i], tile * QT, h, scratch, sh->cache_dtype, sh->io_dtype); \
    } while (0)

#define VECTOR_SCRATCH tile_scratch(sh->Hq / sh->Hkv, sh->D)

RUN(avx512, "avx512f", VECTOR_TILE(tile16), VECTOR_SCRATCH, (void)0, (void)0)
RUN(avx2, "avx2,fma", VECTOR_TILE(tile8), VECTOR_SCRATCH, (void)0, (void)0)
RUN(amx, "amx-tile,amx-bf16,avx512f,avx512bw,avx512vl",
    tile_amx(sh, table, starts[i], ns[i], lens[i], tile * QT, h, scratch),
    amx_tile_scratch(sh->Hq / sh->Hkv, sh->D), amx_configure(), amx_release())

void pagoda_prefill_attention(const void *q, int64_t ldq, const void *k_cache, const void *v_cache, void *out,
                              int cache_dtype, int io_dtype, const int32_t *starts, const int32_t *ns,
                              const int32_t *lens, const int32_t *tables, int64_t ldt, int num_seqs,
                              int Hq, int Hkv, int D, int bs, float scale, int threads, int isa) {
    const Shape sh = {q, k_cache, v_cache, out, ldq, cache_dtype, io_dtype, Hq, Hkv, D, bs, scale};
    int64_t *first = malloc(((size_t)num_seqs + 1) * sizeof(int64_t));  // each sequence's first task
    first[0] = 0;
    for (int i = 0; i < num_seqs; i++) first[i + 1] = first[i] + (int64_t)((ns[i] + QT - 1) / QT) * Hkv;
    // the tiles take a bf16 cache and queries only
    const int amx = isa == 3 && cache_dtype == 1 && io_dtype == 1 && amx_tile_fits(D);
    (amx ? run_amx : isa >= 2 ? run_avx512 : run_avx2)(&sh, starts, ns, lens, tables, ldt, num_seqs, first, threads);
    free(first);
}
