/* out[M, N] = x[M, K] @ w[N, K]^T in fp32, for the CPU projections of a step with few rows.
 *
 * MKL's sgemm streams the weights at a fraction of the memory bandwidth when x has few rows
 * (kernels/cpu_gemm.py has the figures). Here each thread takes a contiguous share of w's rows
 * and reads it once, in its own layout: four rows at a time stay in L1 while every 3-row block
 * of x passes over them, and each (x row, w row) pair is a dot product held in one AVX2
 * register, 12 of them at once, reduced to floats at the end of the row.
 *
 * An AVX-512F path (cpu_gemm_isa says whether this CPU runs it; both are tested) does the same
 * with 16-lane registers and blocks of up to 6 rows of x, so that a verification's 5 rows
 * (speculative decoding) are one pass over the weights: on a 2-core AVX-512 Xeon 5 rows took
 * 1.55x one row's time with the AVX2 blocks (bench/bench_gemm.py).
 *
 * Each path is compiled for its instruction set (per-function target attributes), so the library
 * builds and loads on any x86-64 and cpu_gemm_isa says 0 where neither runs. Built with -O3
 * -fopenmp; libgomp.so.1 resolves to the copy torch has loaded, so these threads are torch's
 * threads. */
#include <omp.h>

#include "cpu_gemm_blocks.h"

/* 2: AVX-512F, 1: AVX2 + FMA, 0: neither (the caller uses torch). */
int cpu_gemm_isa(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0;
    return __builtin_cpu_supports("avx512f") ? 2 : 1;
}

/* Rows [n0, n1) of w, all M rows of x. Up to 16 rows every block of x prefetches the weight rows
 * after its own (b). Past 16 the blocks take `then` (AVX2: the blocks without the prefetch), and
 * block i of the M / 3 requests the i-th slice of the next 4 weight rows into L2 (spread): on a
 * Zen 2 EPYC, prefetching in every block took the model's projections 8 rows 28 ms against 31
 * and 16 rows 43 against 45, but 32 rows 72 against 69, 96 rows 188 against 165 and 300 rows
 * 630 against 509; the first block alone fetching them (a burst of 144-384 lines) left 32 rows
 * at 65-67 ms, spread 61-62, and 64 rows at 114-116 against 111 (bench/bench_gemm.py). The
 * AVX-512 blocks do the same: on an AMX Xeon, 30 layers' projections cold from memory, 32 rows
 * 50.5-52.6 -> 46.1-49.3 ms, 48 rows 64.7-66.7 -> 59.0-60.7, 64 rows 81 -> 69-76, 17 rows
 * 36.3-37.3 -> 38.5-39.5 (alternating runs). */
AVX2 static void columns(const Blocks *b, const Blocks *then, const float *x, int64_t ldx, const float *w,
                    int64_t ldw, float *out, int64_t ldo, int M, int64_t n0, int64_t n1, int K) {
    const int spread = M > 16 && then != b, slices = (M + b->most - 1) / b->most;
    for (int64_t n = n0; n < n1;) {
        int nr = n1 - n >= 4 ? 4 : 1;
        for (int m = 0, i = 0; m < M; i++) {
            int mr = M - m >= b->most ? b->most : M - m;
            const Blocks *use = M <= 16 ? b : then;
            if (spread && n + 8 <= n1)
                blk_prefetch_slice((const char *)(w + (n + 4) * ldw), ldw * 4, (int64_t)K * 4, i, slices);
            (nr == 4 ? use->four : use->one)[mr](x + m * ldx, ldx, w + n * ldw, ldw, out + m * ldo + n, ldo, K);
            m += mr;
        }
        n += nr;
    }
}

void cpu_gemm_xwt(const float *x, int64_t ldx, const float *w, int64_t ldw, float *out,
                  int64_t ldo, int M, int64_t N, int K, int num_threads, int isa) {
    if (M <= 0 || N <= 0)
        return;
    const Blocks *b = isa == 2 ? &AVX512_BLOCKS : &AVX2_BLOCKS;
    const Blocks *then = isa == 2 ? &AVX512_RESIDENT_BLOCKS : &AVX2_RESIDENT_BLOCKS;
    /* Shares in whole 4-row groups; the last thread takes the rest. */
    int64_t groups = N / 4;
    /* Equal chunks of at most MAX_ROW_CHUNK rows, in whole blocks. */
    int chunks = (M + MAX_ROW_CHUNK - 1) / MAX_ROW_CHUNK;
    int chunk = ((M + chunks - 1) / chunks + b->most - 1) / b->most * b->most;
    #pragma omp parallel num_threads(num_threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t n0 = groups * t / nt * 4;
        int64_t n1 = t == nt - 1 ? N : groups * (t + 1) / nt * 4;
        /* x in chunks of rows that stay in L2 while the share of w passes over them. */
        for (int m0 = 0; m0 < M; m0 += chunk) {
            int mc = M - m0 < chunk ? M - m0 : chunk;
            columns(b, then, x + m0 * ldx, ldx, w, ldw, out + m0 * ldo, ldo, mc, n0, n1, K);
        }
    }
}
