// A decode step of a pre-norm transformer (the Llama family's layer: RMSNorm, fused q/k/v with
// rotary q and k, paged attention, o, RMSNorm, gated SiLU MLP) on the CPU, every layer in one C
// call and one parallel region, over GGUF Q8_0 / Q4_1 weights (--quantization q8_0 / q4_1), int8
// rows with a scale per row (--quantization int8) or dense fp32 / bf16 ones (--dtype float32 /
// bfloat16).
//
// Why: a one-sequence step reads ~85 MB of Q4_1 weights, about 10 ms; layer by layer in torch
// the same step took 19-25 ms, the difference being some 25 torch ops a layer (each a dispatch
// and an allocation: an RMSNorm of 576 floats cost 50 us), seven C calls and as many parallel
// regions. Here the threads stay in one region for the whole step and meet at a barrier between
// the phases of a layer (llama.cpp's graph runs the same way). Dense weights pay the same
// overhead layer by layer (an fp32 step reads 430 MB of layer weights, and took 8-10 ms more
// than that read).
//
// The pieces are the tested kernels' own: the GGUF dot products of cpu_gemm_gguf.c (exact fp32
// activations), the attention of cpu_decode_attention.c (its rows, lengths and block tables:
// kernels/cpu_attention.py's decode plan), its K/V layout. Added here: dense dot products (a
// bf16 weight widened exactly to fp32: it is an fp32's top half; activations stay fp32),
// RMSNorm (sum of squares in double), the rotary turn of q and k (heads with each pair (i, i +
// D/2) at (2i, 2i + 1), the layout worker/model/llama.py loads), SiLU(gate) * up (exp_poly), the K/V
// writes with rounding to bf16 (to nearest even, as torch rounds), and the residual sums, added
// in place by the o and down projections' rows as they are computed.
#include "cpu_gemm_gguf.c"
#include "cpu_decode_attention.c"
#include "cpu_bf16_tile.h"
#include "cpu_bf16_amx.h"
#include "cpu_dense_rows.h"

#include <math.h>

// One layer's weights and cache, fixed for the model's life (the caller builds them once).
typedef struct {
    const uint8_t *qkv, *o, *gate_up, *down;     // [N, K]: GGUF blocks (K / 32 a row), fp32 or bf16
    int64_t ld_qkv, ld_o, ld_gate_up, ld_down;    // bytes per weight row
    const float *norm1, *norm2;                   // [H]: input and post-attention RMSNorm
    void *k_cache, *v_cache;                      // kernels/cpu_attention.py's layouts
    const float *scale_qkv, *scale_o, *scale_gate_up, *scale_down;  // int8 rows' scales [N], else NULL
} DecodeLayer;

// What changes with each step.
typedef struct {
    int T, H, Hq, Hkv, D, I, bs;   // tokens; hidden, heads, head dim, MLP width, block size
    int wtype, cache_dtype;        // ggml type (8 Q8_0, 3 Q4_1, 0 F32, 30 BF16, 24 I8); 0 fp32, 1 bf16 cache
    int num_rows, threads, isa;    // decode rows; isa 2 AVX-512F, 1 AVX2 + FMA
    float eps, scale;
    const float *cis;              // [positions, D / 2, 2]: cos, sin
    const int64_t *positions, *slots;   // [T]; slot < 0: not written
    const int32_t *rows, *lens, *tables;  // per decode row: its token, visible positions, blocks
    int64_t ldt;
    const float *final_norm;       // [H]
    float *h;                      // [T, H]: in the embeddings; the residual stream, summed in place
    float *out;                    // [T, H]: the final norm of the last layer's stream
    int bf16_dot;                  // bf16 weights, on activations rounded to bf16: 1 AVX512-BF16 dot
                                   // products, 2 AMX tiles (pagoda_decode_layer_bf16_dot says which
                                   // this CPU has); 0 widened weights, fp32 activations
    int prefetch;                  // attention: pagoda_decode_attention's prefetch
} DecodeStep;

int pagoda_decode_layer_isa(void) {
    const int gguf = pagoda_gguf_isa();
    if (gguf >= 3) return 2;
    return gguf >= 1 ? 1 : 0;
}

static void rms_norm_row(const float *x, const float *w, float eps, int H, float *out) {
    double ss = 0.0;
    for (int i = 0; i < H; i++) ss += (double)x[i] * x[i];
    const float r = 1.0f / sqrtf((float)(ss / H) + eps);
    for (int i = 0; i < H; i++) out[i] = (x[i] * r) * w[i];
}

void pagoda_rms_norm(const float *x, const float *w, float eps, int T, int H, float *out) {
    for (int t = 0; t < T; t++) rms_norm_row(x + (int64_t)t * H, w, eps, H, out + (int64_t)t * H);
}

static inline void store_elem(void *base, int64_t i, float f, int dtype) {
    if (dtype == 0) {
        ((float *)base)[i] = f;
        return;
    }
    uint32_t b;
    memcpy(&b, &f, 4);
    b += 0x7FFFu + ((b >> 16) & 1u);  // to nearest, ties to even (no NaN reaches here)
    ((uint16_t *)base)[i] = (uint16_t)(b >> 16);
}

typedef void (*dots_fn)(const float *, int64_t, int, const uint8_t *, int64_t, int, const float *, float *);

// Every weight format a layer may hold, by its ggml type.
__attribute__((target("avx2,fma,f16c")))
static void layer_dots_avx2(const float *x, int64_t ldx, int rows, const uint8_t *w, int64_t K,
                            int type, const float *xs, float *s) {
    if (type == TYPE_F32) {
        switch (rows) { ROWS_1_TO_4(dense_avx2, TYPE_F32) }
    } else if (type == TYPE_BF16) {
        switch (rows) { ROWS_1_TO_4(dense_avx2, TYPE_BF16) }
    } else if (type == TYPE_I8) {
        switch (rows) { ROWS_1_TO_4(dense_avx2, TYPE_I8) }
    } else {
        dots_avx2(x, ldx, rows, w, K, type, xs, s);
    }
}

__attribute__((target("avx512f,f16c")))
static void layer_dots_avx512(const float *x, int64_t ldx, int rows, const uint8_t *w, int64_t K,
                              int type, const float *xs, float *s) {
    if (type == TYPE_F32) {
        switch (rows) { ROWS_1_TO_4(dense_avx512, TYPE_F32) ROWS_5_TO_8(dense_avx512, TYPE_F32) }
    } else if (type == TYPE_BF16) {
        switch (rows) { ROWS_1_TO_4(dense_avx512, TYPE_BF16) ROWS_5_TO_8(dense_avx512, TYPE_BF16) }
    } else if (type == TYPE_I8) {
        switch (rows) { ROWS_1_TO_4(dense_avx512, TYPE_I8) ROWS_5_TO_8(dense_avx512, TYPE_I8) }
    } else {
        dots_avx512(x, ldx, rows, w, K, type, xs, s);
    }
}

// out[t, n] = (or +=) x[t] . W[n] for every weight row n, split over the team (an orphaned
// worksharing loop: called from inside the step's parallel region; it ends at a barrier). avx2:
// the dots are AVX2's, which take weight panels from PANEL_MIN_ROWS rows. One-row Q4_1 products
// read the row's block sums (lone_row_sums; each thread sums its own copy, x being complete when
// gemv is called).
// gemv's weight rows are requested GEMV_AHEAD rows ahead, into L2: a thread walks its share of
// the rows in order, yet the hardware alone streamed them at 6 GB/s a core (an fp32 step of 8
// tokens on an AMX Xeon: 59.5-63.2 ms without, 49.0-50.3 with; 1 token 28.1-29.6 -> 25.7-26.6).
#define GEMV_AHEAD 4
static void gemv(dots_fn dots, int most, int avx2, const float *x, int64_t ldx, int T, const uint8_t *w,
                 int64_t ldw, int type, const float *scale, int64_t N, int64_t K, float *out, int64_t ldo,
                 int add) {
    if (avx2 && T >= PANEL_MIN_ROWS) {
        panel_xwt(x, ldx, T, w, ldw, type, scale, N, K, out, ldo, add);
        return;
    }
    float xs[2 * (K / QK)];
    lone_row_sums(x, ldx, T, most, K, type, xs);
    #pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float s[8];
        if (n + GEMV_AHEAD < N) {
            const char *next = (const char *)(w + (n + GEMV_AHEAD) * ldw);
            for (int64_t b = 0; b < ldw; b += 64) __builtin_prefetch(next + b, 0, 2);
        }
        for (int m = 0; m < T; m += most) {
            const int rows = T - m < most ? T - m : most;
            dots(x + m * ldx, ldx, rows, w + n * ldw, K, type, xs, s);
            for (int r = 0; r < rows; r++) {
                float *o = out + (m + r) * ldo + n;
                const float v = scale ? s[r] * scale[n] : s[r];
                *o = add ? *o + v : v;
            }
        }
    }
}

// The products decode steps over bf16 weights can take here (bf16_dot): 2 AMX tiles (and the
// dot products), 1 AVX512-BF16 dot products, 0 neither.
int pagoda_decode_layer_bf16_dot(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512bw")) return 0;
    return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") && amx_permitted() ? 2 : 1;
}

// x's T rows rounded to bf16 into xb [T, K], as a bf16 model's projections round their inputs
// (an orphaned worksharing loop).
__attribute__((always_inline))
static inline void round_rows(const float *x, int64_t ldx, int T, int64_t K, uint16_t *xb) {
    #pragma omp for schedule(static)
    for (int t = 0; t < T; t++)
        for (int64_t k = 0; k < K; k++) xb[t * K + k] = to_bf16(x[t * ldx + k]);
}

// gemv for bf16 weights in AVX512-BF16 dot products: x's rows rounded to bf16 once (into xb,
// [T, K]), then 4 x 4 tiles (kernels/csrc/cpu_bf16_tile.h), as a bf16 model's projections round
// their inputs in torch. Widened weights against fp32 activations took two FMAs and a widening
// per 16 products; a dot product takes 32. An orphaned worksharing loop, as gemv.
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static void gemv_bf16_dot(const float *x, int64_t ldx, int T, const uint8_t *w, int64_t ldw, int64_t N,
                          int64_t K, float *out, int64_t ldo, int add, uint16_t *xb) {
    round_rows(x, ldx, T, K, xb);
    const int64_t ldr = ldw / 2;  // bf16 elements per weight row
    #pragma omp for schedule(static)
    for (int64_t g = 0; g < (N + 3) / 4; g++) {
        const int64_t n = g * 4;
        const int nr = N - n < 4 ? (int)(N - n) : 4;
        const uint16_t *rows[4];
        for (int j = 0; j < 4; j++) rows[j] = (const uint16_t *)w + (n + (j < nr ? j : nr - 1)) * ldr;
        const int tiles = (T + 3) / 4, per_tile = (4 + tiles - 1) / tiles;  // the next group's rows
        const int64_t end = n + 8 < N ? n + 8 : N;
        for (int m = 0, t = 0; m < T; m += 4, t++) {
            const int mr = T - m < 4 ? T - m : 4;
            __m128 sums[4];
            tile_sums(xb + m * K, K, rows, (const uint16_t *)w, ldr, K, sums, mr, n + 4, end, t, per_tile);
            for (int i = 0; i < mr; i++) {
                float v[4];
                _mm_storeu_ps(v, sums[i]);
                for (int j = 0; j < nr; j++) {
                    float *o = out + (m + i) * ldo + n + j;
                    *o = add ? *o + v[j] : v[j];
                }
            }
        }
    }
}

// gemv for bf16 weights in AMX tiles (cpu_bf16_amx.h): x's rows rounded to bf16 (as
// gemv_bf16_dot rounds them) and packed into B tiles once, then each task's 32 weight rows,
// straight from W, against every 32 rows of x. Where N or K is not a multiple of 32, the dot
// products. An orphaned worksharing loop, as gemv; the calling thread's tiles configured.
__attribute__((target("avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16")))
static void gemv_bf16_amx(const float *x, int64_t ldx, int T, const uint8_t *w, int64_t ldw, int64_t N,
                          int64_t K, float *out, int64_t ldo, int add, uint16_t *xb, uint16_t *xp) {
    if (N % AMX_GROUP || K % AMX_K) {
        gemv_bf16_dot(x, ldx, T, w, ldw, N, K, out, ldo, add, xb);
        return;
    }
    const int64_t ldr = ldw / 2, steps = K / AMX_K;
    const int blocks = (T + AMX_TILE - 1) / AMX_TILE;
    round_rows(x, ldx, T, K, xb);
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < blocks * steps; i++)
        amx_pack_tile(xb, K, T, i / steps, i % steps, xp + i * AMX_B_VALUES);
    #pragma omp for schedule(static)
    for (int64_t g = 0; g < N / AMX_GROUP; g++) {
        const uint16_t *wg = (const uint16_t *)w + g * AMX_GROUP * ldr;
        amx_group(wg, ldr, xp, T, steps, (g + 1) * AMX_GROUP < N ? wg + AMX_GROUP * ldr : NULL, out, ldo,
                  g * AMX_GROUP, add ? AMX_F32_ADD : AMX_F32);
    }
}

// x * sigmoid(x), e^-|x| by exp_poly (which takes arguments <= 0): one division and no branch,
// so that a loop of it vectorizes (the same numbers as x / (1 + e) and x e / (1 + e)).
__attribute__((always_inline)) static inline float silu(float x) {
    const float e = exp_poly(-__builtin_fabsf(x));
    return x * (x >= 0.0f ? 1.0f : e) / (1.0f + e);
}

// One projection of the step: AMX tiles or bf16 dot products where the step takes them, else gemv
// (WIDE: the AVX-512 step, which takes no weight panels).
#define PROJECT(DOTS, MOST, WIDE, X, LDX, W, LDW, SCALE, N, K, OUT, LDO, ADD)                                \
    if (p->bf16_dot == 2) gemv_bf16_amx(X, LDX, T, W, LDW, N, K, OUT, LDO, ADD, xb, xp);                 \
    else if (p->bf16_dot) gemv_bf16_dot(X, LDX, T, W, LDW, N, K, OUT, LDO, ADD, xb);                    \
    else gemv(DOTS, MOST, !WIDE, X, LDX, T, W, LDW, p->wtype, SCALE, N, K, OUT, LDO, ADD)

#define STEP(ISA, TARGET, DOTS, MOST, WIDE)                                                            \
    __attribute__((target(TARGET)))                                                                    \
    static void step_##ISA(const DecodeLayer *layers, int num_layers, const DecodeStep *p, float *act, \
                           float *qkv, float *attn, float *gu, uint16_t *xb, uint16_t *xp, int width) { \
        const int T = p->T, H = p->H, D = p->D, I = p->I, Hq = p->Hq, Hkv = p->Hkv;                    \
        const int64_t nqkv = (int64_t)(Hq + 2 * Hkv) * D;                                              \
        const int grouped = attend_grouped_here(p->num_rows, Hq, Hkv, D, p->bs, p->cache_dtype,        \
                                                p->threads);                                           \
        _Pragma("omp parallel num_threads(p->threads)")                                                \
        {                                                                                              \
            float *s = malloc(attend_scratch(Hq, Hkv, D, width) * sizeof(float));                      \
            if (p->bf16_dot == 2) amx_configure();                                                     \
            int64_t first, last;  /* this thread's attention tasks: the same rows every layer */       \
            attend_share(p->lens, p->num_rows, grouped ? Hkv : Hq, p->bs, omp_get_thread_num(),        \
                         omp_get_num_threads(), &first, &last);                                        \
            for (int l = 0; l < num_layers; l++) {                                                     \
                const DecodeLayer *L = layers + l;                                                     \
                _Pragma("omp for schedule(static)")                                                    \
                for (int t = 0; t < T; t++)                                                            \
                    rms_norm_row(p->h + (int64_t)t * H, L->norm1, p->eps, H, act + (int64_t)t * H);    \
                PROJECT(DOTS, MOST, WIDE, act, H, L->qkv, L->ld_qkv, L->scale_qkv, nqkv, H, qkv, nqkv, 0); \
                /* q and k heads turned; k and v heads written to the cache */                         \
                _Pragma("omp for schedule(static)")                                                    \
                for (int64_t task = 0; task < (int64_t)T * (Hq + Hkv); task++) {                       \
                    const int t = (int)(task / (Hq + Hkv)), j = (int)(task % (Hq + Hkv));              \
                    float *x = qkv + t * nqkv + (int64_t)j * D;                                        \
                    const float *c = p->cis + p->positions[t] * D;                                     \
                    for (int i = 0; i < D / 2; i++) {                                                  \
                        const float x0 = x[2 * i], x1 = x[2 * i + 1];                                  \
                        x[2 * i] = x0 * c[2 * i] - x1 * c[2 * i + 1];                                  \
                        x[2 * i + 1] = x0 * c[2 * i + 1] + x1 * c[2 * i];                              \
                    }                                                                                  \
                    const int64_t slot = p->slots[t];                                                  \
                    if (j < Hq || slot < 0) continue;                                                  \
                    const int h = j - Hq;                                                              \
                    const float *v = qkv + t * nqkv + (int64_t)(Hq + Hkv + h) * D;                     \
                    const int64_t b = slot / p->bs, o = slot % p->bs;                                  \
                    const int64_t kbase = (b * Hkv + h) * D * p->bs + o, vbase = (slot * Hkv + h) * D; \
                    for (int d = 0; d < D; d++) {                                                      \
                        store_elem(L->k_cache, kbase + (int64_t)d * p->bs, x[d], p->cache_dtype);      \
                        store_elem(L->v_cache, vbase + d, v[d], p->cache_dtype);                       \
                    }                                                                                  \
                }                                                                                      \
                for (int64_t task = first; task < last; task++) {                                      \
                    if (p->cache_dtype == 0)                                                           \
                        attend_task(task, grouped, qkv, nqkv, L->k_cache, L->v_cache, p->rows, p->lens, \
                                    p->tables, p->ldt, Hq, Hkv, D, p->bs, p->scale, attn, (int64_t)Hq * D, \
                                    width, s, 0, WIDE, 0, p->prefetch ? PREFETCH_BLOCKS : 0);          \
                    else                                                                               \
                        attend_task(task, grouped, qkv, nqkv, L->k_cache, L->v_cache, p->rows, p->lens, \
                                    p->tables, p->ldt, Hq, Hkv, D, p->bs, p->scale, attn, (int64_t)Hq * D, \
                                    width, s, 1, WIDE, 0, p->prefetch ? PREFETCH_BLOCKS : 0);          \
                }                                                                                      \
                _Pragma("omp barrier")                                                                 \
                PROJECT(DOTS, MOST, WIDE, attn, (int64_t)Hq * D, L->o, L->ld_o, L->scale_o, H, (int64_t)Hq * D, p->h, H, \
                        1);                                                                            \
                _Pragma("omp for schedule(static)")                                                    \
                for (int t = 0; t < T; t++)                                                            \
                    rms_norm_row(p->h + (int64_t)t * H, L->norm2, p->eps, H, act + (int64_t)t * H);    \
                PROJECT(DOTS, MOST, WIDE, act, H, L->gate_up, L->ld_gate_up, L->scale_gate_up, 2 * (int64_t)I, H, gu, \
                        2 * (int64_t)I, 0);                                                            \
                /* in pieces of 16 (I is a multiple of 32): a scalar loop of exp_poly took a 64-token \
                   bf16 step about 5% */                                                               \
                _Pragma("omp for schedule(static)")                                                    \
                for (int64_t e = 0; e < (int64_t)T * I; e += 16) {                                     \
                    const float *g = gu + e / I * 2 * I + e % I;                                       \
                    for (int i = 0; i < 16; i++) act[e + i] = silu(g[i]) * g[I + i];                   \
                }                                                                                      \
                PROJECT(DOTS, MOST, WIDE, act, I, L->down, L->ld_down, L->scale_down, H, I, p->h, H, 1); \
            }                                                                                          \
            if (p->bf16_dot == 2) amx_release();                                                       \
            free(s);                                                                                   \
        }                                                                                              \
    }

STEP(avx512, "avx512f,f16c,fma", layer_dots_avx512, 8, 1)
STEP(avx2, "avx2,fma,f16c", layer_dots_avx2, 4, 0)

// Every layer of one decode step, then the final norm into p->out. Every token of the step is a
// decode row (rows covers 0 .. T - 1); the caller bounds positions, slots and tables by the
// cache (worker/step/plan_checks.py, kernels/cpu_attention.py), as for the kernels this reuses.
void pagoda_decode_step(const DecodeLayer *layers, int num_layers, const DecodeStep *p) {
    int width = 0;
    for (int r = 0; r < p->num_rows; r++) {
        const int w = (p->lens[r] + p->bs - 1) / p->bs * p->bs;
        width = w > width ? w : width;
    }
    const int64_t T = p->T, wide = p->H > p->I ? p->H : p->I;
    float *act = malloc(T * wide * sizeof(float));
    float *qkv = malloc(T * (p->Hq + 2 * p->Hkv) * p->D * sizeof(float));
    float *attn = malloc(T * p->Hq * p->D * sizeof(float));
    float *gu = malloc(T * 2 * p->I * sizeof(float));
    const int64_t widest = wide > (int64_t)p->Hq * p->D ? wide : (int64_t)p->Hq * p->D;
    uint16_t *xb = p->bf16_dot ? malloc(T * widest * sizeof(uint16_t)) : NULL;  // x rounded to bf16
    uint16_t *xp = p->bf16_dot == 2 ? aligned_alloc(64, amx_packed_bytes((int)T, widest)) : NULL;  // and packed
    DecodeStep step = *p;
    if (step.bf16_dot == 2 && !xp) step.bf16_dot = 1;  // no memory to pack x in: the dot products
    (p->isa == 2 ? step_avx512 : step_avx2)(layers, num_layers, &step, act, qkv, attn, gu, xb, xp, width);
    free(xb);
    free(xp);
    pagoda_rms_norm(p->h, p->final_norm, p->eps, p->T, p->H, p->out);
    free(act);
    free(qkv);
    free(attn);
    free(gu);
}
