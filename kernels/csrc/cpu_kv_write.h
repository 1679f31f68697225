// The step's new keys and values into the paged cache, in the layouts kernels/csrc/
// cpu_decode_attention.c reads (K blocks [num_blocks, Hkv, D, bs], V blocks [num_blocks, bs, Hkv,
// D]). Included by that kernel's source, so that one library both writes and reads the cache.
#pragma once
#include <stdint.h>
#include <string.h>

// Keys of n tokens (rows [n, row], the cache's elements) into positions o..o+n-1 of one block's
// transposed keys [row, bs]: for each (head, d) row of the block, n elements side by side.
#define WRITE_KEYS(T)                                                                     \
    for (int64_t i = 0; i < row; i++)                                                     \
        for (int t = 0; t < n; t++) ((T *)kb)[i * bs + o + t] = ((const T *)k)[t * row + i];

static void write_keys(const char *k, char *kb, int64_t row, int bs, int64_t o, int n, int elem) {
    if (elem == 2) { WRITE_KEYS(uint16_t) }
    else { WRITE_KEYS(uint32_t) }  // elem 4: the caches are fp32, bf16 or fp16
}
#undef WRITE_KEYS

// The step's new keys and values into the cache (kernels/cpu_attention.py write_kv): token t goes
// to slot slots[t] (block slots[t] / bs, offset slots[t] % bs; negative: skipped). key and value
// [T, Hkv, D] hold the cache's own elements (elem bytes each: 4 fp32, 2 bf16 or fp16). Tokens go
// in runs of consecutive slots within a block (a prefill chunk's are): a run's values are one
// copy, its keys one transposition into the block: a 2048-token bf16 chunk's 30 layers took 17 ms
// element by element (a memcpy call each), 3.4 ms so.
void pagoda_write_kv(const void *key, const void *value, void *k_cache, void *v_cache, int elem,
                     const int64_t *slots, int T, int Hkv, int D, int bs) {
    const int64_t row = (int64_t)Hkv * D;
    for (int t = 0; t < T;) {
        const int64_t slot = slots[t];
        if (slot < 0) {
            t++;
            continue;
        }
        const int64_t b = slot / bs, o = slot % bs;
        int n = 1;
        while (t + n < T && o + n < bs && slots[t + n] == slot + n) n++;
        memcpy((char *)v_cache + slot * row * elem, (const char *)value + t * row * elem, (size_t)(n * row * elem));
        write_keys((const char *)key + t * row * elem, (char *)k_cache + b * row * bs * elem, row, bs, o, n, elem);
        t += n;
    }
}
