// Paged decode attention on the CPU: for each decode row (one query token of a sequence, seeing
// its first len positions) and each query head, softmax(q . K^T * scale) V over the row's block
// table, read where the keys and values lie in the cache. One call a layer replaces the dozen
// torch ops of kernels/cpu_attention.py's decode path (two embedding_bags, a padded softmax, the
// index copies around them), which on a single stream cost as much as the layer's projections.
//
// Layouts (kernels/cpu_attention.py): K blocks [num_blocks, Hkv, D, bs] (each block holds its keys
// transposed, so the scores of one block are bs-long rows: contiguous FMAs over positions),
// V blocks [num_blocks, bs, Hkv, D]. The cache is fp32 or bf16 (dtype 0 or 1); q and out are fp32.
// Positions at or past len are never read: the last block's stale slots (NaN, a freed block's
// keys) cannot leak, as the tests check with a poisoned cache.
//
// The loops are plain C the compiler vectorizes; the body is compiled twice, for AVX-512F and for
// AVX2 + FMA (pagoda_decode_attention_isa says which this CPU runs; both are tested), with an exp
// it can vectorize (exp_poly: Cody-Waite reduction and a degree-6 polynomial, within 2 ulp of
// expf over the softmax's range (-inf, 0]). Work is split over (row, query head) pairs, or, for a bf16
// cache with enough rows, (row, kv head) pairs whose query heads share each load (attend_task).
#include "cpu_attention_math.h"

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int pagoda_decode_attention_isa(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0;
    return __builtin_cpu_supports("avx512f") ? 2 : 1;
}

// Blocks lie anywhere in the cache, so the hardware prefetchers lose the stream at each block's
// end: the next blocks' keys (or values) can be requested `ahead` blocks ahead (PREFETCH_BLOCKS;
// 0: not at all). Whether that pays is the machine's: on a Zen 5 it sped fp32 and bf16 up, on a
// Zen 2 it slows fp32 by a tenth and bf16 needs it (worker/startup/measurements.py measures it).
// Into L2 (prefetcht1), not L1: on an AMX Xeon a bf16 step's attention of 64 rows over 30 layers
// read 11.9-12.4 GB/s so, 10.8-11.8 into L1, whose fill buffers the requests then held.
#define PREFETCH_BLOCKS 2

static inline int64_t elem_bytes(int dtype) { return dtype == 0 ? 4 : 2; }  // fp32 or bf16

// Bytes [from, from + n) of block j + ahead's keys for head h (ahead 0: none), requested into L2.
// The loops over a block's head dimension request the rows a step reads, spread over the block's
// products: all 32-64 lines at a block's start stalled on the fill buffers with the products
// waiting (a bf16 step's attention of 64 rows over 30 layers 50.7-54.2 -> 39.2-43.8 ms, AMX Xeon).
__attribute__((always_inline))
static inline void prefetch_keys(const void *k_cache, const int32_t *table, int j, int nblocks, int h, int Hkv,
                                 int D, int bs, const int dtype, const int ahead, int64_t from, int64_t n) {
    if (!ahead || j + ahead >= nblocks) return;
    const char *at = (const char *)k_cache + ((int64_t)table[j + ahead] * Hkv + h) * D * bs * elem_bytes(dtype) + from;
    for (int64_t b = 0; b < n; b += 64) __builtin_prefetch(at + b, 0, 2);
}

// Row o (a position) of block j + ahead's values for head h, requested into L2 as row o of block
// j is read (spread as the keys are).
__attribute__((always_inline))
static inline void prefetch_values(const void *v_cache, const int32_t *table, int j, int nblocks, int o, int h,
                                   int Hkv, int D, int bs, const int dtype, const int ahead) {
    if (!ahead || j + ahead >= nblocks) return;
    const int64_t row = D * elem_bytes(dtype);
    const char *at = (const char *)v_cache + (((int64_t)table[j + ahead] * bs + o) * Hkv + h) * row;
    for (int64_t b = 0; b < row; b += 64) __builtin_prefetch(at + b, 0, 2);
}

// The scores s[0, nblocks * bs) of one query head (q pre-scaled) over its kv head's K blocks.
__attribute__((always_inline))
static inline void scores(const float *restrict q, const void *k_cache, const int32_t *table, int nblocks,
                          int h, int Hkv, int D, int bs, float *restrict s, const int dtype, const int ahead) {
    for (int j = 0; j < nblocks; j++) {
        const int64_t kb = ((int64_t)table[j] * Hkv + h) * D * bs;  // this head's [D, bs] in block j
        float *restrict sj = s + (int64_t)j * bs;
        if (bs % 16 == 0 && D % 4 == 0) {  // whole vectors of positions, summed in registers
            // Four sums over d (d mod 4) per vector: one sum's FMAs wait on each other's latency,
            // which left the whole decode attention a tenth slower (bench_cpu_attention.py --decode).
            for (int p = 0; p < bs; p += 16) {
                v8 a[4][2] = {{{0}}};
                for (int d = 0; d < D; d += 4) {
                    if (p == 0) prefetch_keys(k_cache, table, j, nblocks, h, Hkv, D, bs, dtype, ahead, d * bs * elem_bytes(dtype), 4 * bs * elem_bytes(dtype));
                    for (int e = 0; e < 4; e++) {
                        const int64_t at = kb + (int64_t)(d + e) * bs + p;
                        a[e][0] += q[d + e] * load8(k_cache, at, dtype);
                        a[e][1] += q[d + e] * load8(k_cache, at + 8, dtype);
                    }
                }
                *(v8 *)(sj + p) = (a[0][0] + a[1][0]) + (a[2][0] + a[3][0]);
                *(v8 *)(sj + p + 8) = (a[0][1] + a[1][1]) + (a[2][1] + a[3][1]);
            }
            continue;
        }
        prefetch_keys(k_cache, table, j, nblocks, h, Hkv, D, bs, dtype, ahead, 0, D * bs * elem_bytes(dtype));
        for (int p = 0; p < bs; p++) sj[p] = 0.0f;
        for (int d = 0; d < D; d++)
            for (int p = 0; p < bs; p++) sj[p] += q[d] * load_elem(k_cache, kb + (int64_t)d * bs + p, dtype);
    }
}

// out[0, D) = sum over positions p < len of w[p] * V[p] (this kv head's rows), scaled by inv.
// Positions go block by block (no division per position: it cost more than the FMAs).
#define FOR_EACH_POSITION(body)                                                              \
    for (int j = 0, p = 0; p < len; j++) {                                                   \
        const int64_t first = (int64_t)table[j] * bs;                                        \
        for (int o = 0; o < bs && p < len; o++, p++) {                                       \
            prefetch_values(v_cache, table, j, (len + bs - 1) / bs, o, h, Hkv, D, bs, dtype, ahead); \
            const int64_t vrow = ((first + o) * Hkv + h) * D;                                \
            body                                                                             \
        }                                                                                    \
    }

__attribute__((always_inline))
static inline void weighted_values(const float *restrict w, const void *v_cache, const int32_t *table, int len,
                                   int h, int Hkv, int D, int bs, float inv, float *restrict out, const int dtype,
                                   const int ahead) {
    if (D == 64) {  // SmolLM2's and most small models': the row in 8 registers
        v8 acc[8] = {{0}};
        FOR_EACH_POSITION(for (int c = 0; c < 8; c++) acc[c] += w[p] * load8(v_cache, vrow + 8 * c, dtype);)
        for (int c = 0; c < 8; c++) *(v8 *)(out + 8 * c) = acc[c] * inv;
        return;
    }
    if (D % 8 == 0 && D <= 256) {
        v8 acc[32] = {{0}};
        FOR_EACH_POSITION(for (int c = 0; c < D / 8; c++) acc[c] += w[p] * load8(v_cache, vrow + 8 * c, dtype);)
        for (int c = 0; c < D / 8; c++) *(v8 *)(out + 8 * c) = acc[c] * inv;
        return;
    }
    for (int d = 0; d < D; d++) out[d] = 0.0f;
    FOR_EACH_POSITION(for (int d = 0; d < D; d++) out[d] += w[p] * load_elem(v_cache, vrow + d, dtype);)
    for (int d = 0; d < D; d++) out[d] *= inv;
}

// s[0, len) <- e^(s - max s), unnormalized; returns 1 / their sum (the values' scale).
__attribute__((always_inline)) static inline float softmax(float *restrict s, int len) {
    float most = s[0];
    #pragma omp simd reduction(max:most)
    for (int p = 1; p < len; p++) most = s[p] > most ? s[p] : most;
    for (int p = 0; p < len; p++) s[p] = exp_poly(s[p] - most);
    float sum = 0.0f;
    #pragma omp simd reduction(+:sum)
    for (int p = 0; p < len; p++) sum += s[p];
    return 1.0f / sum;
}

__attribute__((always_inline))
static inline void attend(const float *q, const void *k_cache, const void *v_cache, const int32_t *table,
                          int len, int h, int Hkv, int D, int bs, float scale, float *restrict s,
                          float *restrict qs, float *out, const int dtype, const int ahead) {
    for (int d = 0; d < D; d++) qs[d] = q[d] * scale;
    scores(qs, k_cache, table, (len + bs - 1) / bs, h, Hkv, D, bs, s, dtype, ahead);
    weighted_values(s, v_cache, table, len, h, Hkv, D, bs, softmax(s, len), out, dtype, ahead);
}

// The G (up to 4) query heads that share kv head h (GQA), together: q and out hold them D apart.
// Each key and value vector is loaded (in bf16, widened) once for all G, and the G heads' sums are independent
// chains the core overlaps, where attend's one head leaves the FMA units waiting on its own sums.
// G is a constant in each copy (attend_grouped's switch), so the sums stay in registers.
// s: G * width scores; qs: G * D.
__attribute__((always_inline))
static inline void attend_group(const float *q, const void *k_cache, const void *v_cache, const int32_t *table,
                                int len, int h, int Hkv, int D, int bs, float scale, int width,
                                float *restrict s, float *restrict qs, float *out, const int dtype, const int G,
                                const int ahead) {
    for (int i = 0; i < G * D; i++) qs[i] = q[i] * scale;
    const int nblocks = (len + bs - 1) / bs;
    for (int j = 0; j < nblocks; j++) {
        const int64_t kb = ((int64_t)table[j] * Hkv + h) * D * bs;
        for (int p = 0; p < bs; p += 16) {
            v8 a[4][2];
            for (int g = 0; g < G; g++) a[g][0] = a[g][1] = (v8){0};
            for (int d = 0; d < D; d++) {
                if (p == 0) prefetch_keys(k_cache, table, j, nblocks, h, Hkv, D, bs, dtype, ahead, d * bs * elem_bytes(dtype), bs * elem_bytes(dtype));
                const int64_t at = kb + (int64_t)d * bs + p;
                const v8 k0 = load8(k_cache, at, dtype), k1 = load8(k_cache, at + 8, dtype);
                for (int g = 0; g < G; g++) {
                    a[g][0] += qs[g * D + d] * k0;
                    a[g][1] += qs[g * D + d] * k1;
                }
            }
            for (int g = 0; g < G; g++) {
                *(v8 *)(s + (int64_t)g * width + (int64_t)j * bs + p) = a[g][0];
                *(v8 *)(s + (int64_t)g * width + (int64_t)j * bs + p + 8) = a[g][1];
            }
        }
    }
    float inv[4];
    for (int g = 0; g < G; g++) inv[g] = softmax(s + (int64_t)g * width, len);
    for (int c0 = 0; c0 < D; c0 += 32) {  // a quarter-row of 4 vectors per head: G * 4 sums in registers
        v8 acc[4][4];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < 4; c++) acc[g][c] = (v8){0};
        FOR_EACH_POSITION({
            v8 v[4];
            for (int c = 0; c < 4; c++) v[c] = load8(v_cache, vrow + c0 + 8 * c, dtype);
            for (int g = 0; g < G; g++) {
                const float w = s[(int64_t)g * width + p];
                for (int c = 0; c < 4; c++) acc[g][c] += w * v[c];
            }
        })
        for (int g = 0; g < G; g++)
            for (int c = 0; c < 4; c++) *(v8 *)(out + g * D + c0 + 8 * c) = acc[g][c] * inv[g];
    }
}

// attend_group in 16-float vectors, for the AVX-512 path: a block of 16 positions is one vector
// of scores, a 64-float head row four of values. Two sums per head over the head dimension
// (even and odd d) and 4 G sums over the values keep the FMA units fed; 32 registers hold them.
__attribute__((always_inline))
static inline void attend_group16(const float *q, const void *k_cache, const void *v_cache, const int32_t *table,
                                  int len, int h, int Hkv, int D, int bs, float scale, int width,
                                  float *restrict s, float *restrict qs, float *out, const int dtype, const int G,
                                  const int ahead) {
    for (int i = 0; i < G * D; i++) qs[i] = q[i] * scale;
    const int nblocks = (len + bs - 1) / bs;
    for (int j = 0; j < nblocks; j++) {
        const int64_t kb = ((int64_t)table[j] * Hkv + h) * D * bs;
        for (int p = 0; p < bs; p += 16) {
            v16 a[4][2];
            for (int g = 0; g < G; g++) a[g][0] = a[g][1] = (v16){0};
            for (int d = 0; d < D; d += 2) {
                if (p == 0) prefetch_keys(k_cache, table, j, nblocks, h, Hkv, D, bs, dtype, ahead, d * bs * elem_bytes(dtype), 2 * bs * elem_bytes(dtype));
                const int64_t at = kb + (int64_t)d * bs + p;
                const v16 k0 = load16(k_cache, at, dtype), k1 = load16(k_cache, at + bs, dtype);
                for (int g = 0; g < G; g++) {
                    a[g][0] += qs[g * D + d] * k0;
                    a[g][1] += qs[g * D + d + 1] * k1;
                }
            }
            for (int g = 0; g < G; g++)
                *(v16 *)(s + (int64_t)g * width + (int64_t)j * bs + p) = a[g][0] + a[g][1];
        }
    }
    float inv[4];
    for (int g = 0; g < G; g++) inv[g] = softmax(s + (int64_t)g * width, len);
    for (int c0 = 0; c0 < D; c0 += 64) {  // up to 64 floats of each head's row: G * 4 sums
        const int n = D - c0 < 64 ? (D - c0) / 16 : 4;
        v16 acc[4][4];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < 4; c++) acc[g][c] = (v16){0};
        FOR_EACH_POSITION({
            v16 v[4];
            for (int c = 0; c < n; c++) v[c] = load16(v_cache, vrow + c0 + 16 * c, dtype);
            for (int g = 0; g < G; g++) {
                const float w = s[(int64_t)g * width + p];
                for (int c = 0; c < n; c++) acc[g][c] += w * v[c];
            }
        })
        for (int g = 0; g < G; g++)
            for (int c = 0; c < n; c++) *(v16 *)(out + g * D + c0 + 16 * c) = acc[g][c] * inv[g];
    }
}

#include "cpu_decode_attention_bf16.h"

// Whether attend_grouped serves these shapes: whole vectors of positions and of the head, and a
// group small enough for its sums to stay in registers.
static inline int groups_fit(int G, int D, int bs) { return G >= 2 && G <= 4 && D % 32 == 0 && bs % 16 == 0; }

__attribute__((always_inline))
static inline void attend_grouped(const float *q, const void *k_cache, const void *v_cache, const int32_t *table,
                                  int len, int h, int Hkv, int D, int bs, float scale, int width,
                                  float *s, float *qs, float *out, const int dtype, int G, const int wide,
                                  const int ahead) {
#define GROUP(FN, N) FN(q, k_cache, v_cache, table, len, h, Hkv, D, bs, scale, width, s, qs, out, dtype, N, ahead)
    if (wide && dtype == 1 && bf16_pairs_fit(D, bs)) {
#define PAIRS(N) attend_group16_bf16(q, k_cache, v_cache, table, len, h, Hkv, D, scale, width, s, qs, out, N, ahead)
        if (G == 2) PAIRS(2);
        else if (G == 3) PAIRS(3);
        else PAIRS(4);
#undef PAIRS
    } else if (wide) {  // the AVX-512 path
        if (G == 2) GROUP(attend_group16, 2);
        else if (G == 3) GROUP(attend_group16, 3);
        else GROUP(attend_group16, 4);
    } else {
        if (G == 2) GROUP(attend_group, 2);
        else if (G == 3) GROUP(attend_group, 3);
        else GROUP(attend_group, 4);
    }
#undef GROUP
}

// The floats of scratch a thread passes attend_task: G * (width + 10 D), for a group's scores,
// scaled queries (8 D: attend_group16_bf16's paired ones; one head uses the first width + D), and
// bf16 q and out widened (the last 2 G D).
static inline size_t attend_scratch(int Hq, int Hkv, int D, int width) {
    return (size_t)(Hq / Hkv) * (size_t)(width + 10 * D);
}

// One task of a layer's decode attention. Tasks are (row, kv head) pairs, each its G query heads
// together, where there are enough of them to share among the threads (grouped); else (row, query
// head) pairs, so that one row's 9 heads keep two threads busy where its 3 kv heads would not.
// s: scratch of attend_scratch(...) floats. io: q and out fp32 (0) or bf16 (1: the task's heads
// widened into scratch, and its outputs rounded from there, to nearest even).
__attribute__((always_inline))
static inline void attend_task(int64_t task, int grouped, const void *q, int64_t ldq, const void *k_cache,
                               const void *v_cache, const int32_t *rows, const int32_t *lens,
                               const int32_t *tables, int64_t ldt, int Hq, int Hkv, int D, int bs,
                               float scale, void *out, int64_t ldo, int width, float *s, const int dtype,
                               const int wide, const int io, const int ahead) {
    const int G = Hq / Hkv, per_row = grouped ? Hkv : Hq, n = (grouped ? G : 1) * D;
    const int r = (int)(task / per_row), head = (int)(task % per_row);
    const int hq = grouped ? head * G : head;
    const int64_t at_q = rows[r] * ldq + (int64_t)hq * D, at_out = rows[r] * ldo + (int64_t)hq * D;
    const float *qh = (const float *)q + at_q;
    float *oh = (float *)out + at_out;
    if (io == 1) {
        float *qb = s + (int64_t)G * (width + 8 * D);
        for (int i = 0; i < n; i++) qb[i] = load_elem(q, at_q + i, 1);
        qh = qb;
        oh = qb + n;
    }
    if (grouped)
        attend_grouped(qh, k_cache, v_cache, tables + r * ldt, lens[r], head, Hkv, D, bs, scale, width,
                       s, s + (int64_t)G * width, oh, dtype, G, wide, ahead);
    else
        attend(qh, k_cache, v_cache, tables + r * ldt, lens[r], hq / G, Hkv, D, bs, scale, s, s + width,
               oh, dtype, ahead);
    if (io == 1)
        for (int i = 0; i < n; i++) ((uint16_t *)out)[at_out + i] = to_bf16(oh[i]);
}

// How a layer's attention is split: grouped for a bf16 cache, where each widened load then serves
// the whole group, if its (row, kv head) tasks are at least 4 a thread. An fp32 cache stays head by
// head: grouped, in 8-float vectors a step of 64 rows measured a third slower, and in the AVX-512
// path's 16-float ones the offline workload 5% slower (docs/benchmarks-history.md, "Stop 41").
static inline int attend_grouped_here(int num_rows, int Hq, int Hkv, int D, int bs, int dtype, int threads) {
    return dtype == 1 && groups_fit(Hq / Hkv, D, bs) && (int64_t)num_rows * Hkv >= 4 * (int64_t)threads;
}

// The tasks [*first, *last) of thread `me` of `team` (num_rows rows of per_row tasks each):
// contiguous, as a static schedule's, so that the tasks of a kv head stay on one thread with its
// keys and values in cache, but an equal share of the positions read, not of the tasks: a row of
// 600 positions costs three of 200, and equal counts left one thread waiting at the barrier. A
// task is the thread's whose share holds its middle; bs stands for a task's own costs.
static inline void attend_share(const int32_t *lens, int num_rows, int per_row, int bs, int me, int team,
                                int64_t *first, int64_t *last) {
    const int64_t tasks = (int64_t)num_rows * per_row;
    int64_t total = 0, at = 0, t = 0;
    for (int r = 0; r < num_rows; r++) total += (int64_t)(lens[r] + bs) * per_row;
    const int64_t from = total * me / team, to = total * (me + 1) / team;
    for (; t < tasks && 2 * at + lens[t / per_row] + bs < 2 * from; t++) at += lens[t / per_row] + bs;
    *first = t;
    for (; t < tasks && 2 * at + lens[t / per_row] + bs < 2 * to; t++) at += lens[t / per_row] + bs;
    *last = t;
}

#define TASK(DTYPE, IO, WIDE) attend_task(t, grouped, q, ldq, k_cache, v_cache, rows, lens, tables, ldt, Hq, Hkv, \
                                    D, bs, scale, out, ldo, width, s, DTYPE, WIDE, IO, ahead)
#define RUN(ISA, TARGET, WIDE)                                                                        \
    __attribute__((target(TARGET)))                                                                   \
    static void run_##ISA(const void *q, int64_t ldq, const void *k_cache, const void *v_cache,       \
                          int dtype, const int32_t *rows, const int32_t *lens, const int32_t *tables, \
                          int64_t ldt, int num_rows, int Hq, int Hkv, int D, int bs, float scale,     \
                          void *out, int64_t ldo, int width, int threads, int grouped, int io,        \
                          int ahead) {                                                                \
        _Pragma("omp parallel num_threads(threads)")                                                  \
        {                                                                                             \
            float *s = malloc(attend_scratch(Hq, Hkv, D, width) * sizeof(float));                     \
            int64_t first, last;                                                                      \
            attend_share(lens, num_rows, grouped ? Hkv : Hq, bs, omp_get_thread_num(),                \
                         omp_get_num_threads(), &first, &last);                                       \
            for (int64_t t = first; t < last; t++) {                                                  \
                if (dtype == 0) {                                                                     \
                    if (io == 0) TASK(0, 0, WIDE); else TASK(0, 1, WIDE);                          \
                } else {                                                                              \
                    if (io == 0) TASK(1, 0, WIDE); else TASK(1, 1, WIDE);                          \
                }                                                                                     \
            }                                                                                         \
            free(s);                                                                                  \
        }                                                                                             \
    }

RUN(avx512, "avx512f", 1)
RUN(avx2, "avx2,fma", 0)
#undef TASK

// q [tokens, Hq, D] with row stride ldq (elements); out likewise (ldo); both fp32 (io 0) or bf16
// (io 1); rows[i]: decode row i's token in q and out; lens[i] >= 1 its visible positions; tables
// [num_rows, ldt] its blocks. width: at least the largest ceil(len / bs) * bs (the scores'
// scratch). isa: 2 AVX-512F, 1 AVX2. grouping: 1 query heads grouped by kv head where the shapes
// fit, 0 never, -1 as attend_grouped_here decides (the tests run both). prefetch: the next blocks
// requested PREFETCH_BLOCKS ahead (1) or left to the hardware (0).
void pagoda_decode_attention(const void *q, int64_t ldq, const void *k_cache, const void *v_cache,
                             int dtype, const int32_t *rows, const int32_t *lens, const int32_t *tables,
                             int64_t ldt, int num_rows, int Hq, int Hkv, int D, int bs, float scale,
                             void *out, int64_t ldo, int width, int threads, int isa, int grouping, int io,
                             int prefetch) {
    const int grouped = grouping < 0 ? attend_grouped_here(num_rows, Hq, Hkv, D, bs, dtype, threads)
                                     : grouping && groups_fit(Hq / Hkv, D, bs);
    (isa == 2 ? run_avx512 : run_avx2)(q, ldq, k_cache, v_cache, dtype, rows, lens, tables, ldt, num_rows,
                                       Hq, Hkv, D, bs, scale, out, ldo, width, threads, grouped, io,
                                       prefetch ? PREFETCH_BLOCKS : 0);
}

#include "cpu_kv_write.h"  // pagoda_write_kv: the same library writes the cache it reads
