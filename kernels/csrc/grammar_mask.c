/* Structured outputs' token mask on the CPU: -inf on every token a row's grammar forbids.
 *
 * bitmask is xgrammar's int32 layout: bit j of word w of row r set when the grammar of row r
 * allows token 32 w + j. Row r of the bitmask masks logits row rows[r]. A word with every bit set
 * (a free stretch of a string, say) is skipped, so a mostly-allowed row costs a read of its
 * mask. One thread: it runs between torch's parallel regions, whose threads would fight a team
 * of its own (a step took seconds with one). xgrammar's own CPU kernel is slower still, and
 * writes past a row for mask bits beyond the vocabulary.
 */
#include <math.h>
#include <stdint.h>

#define NEG_INF_BITS 0xff800000u /* -inf as a float's bits */

/* One path, portable C that the compiler vectorizes: every CPU runs it (kernels/cbuild.py
 * IsaKernel asks). */
int pagoda_mask_isa(void) { return 1; }

void pagoda_mask_rows(float *logits, int64_t row_stride, const int64_t *rows, int64_t num_rows,
                      const int32_t *bitmask, int64_t words, int64_t vocab, int isa) {
    (void)isa;
    for (int64_t r = 0; r < num_rows; r++) {
        float *x = logits + rows[r] * row_stride;
        const uint32_t *m = (const uint32_t *)(bitmask + r * words);
        for (int64_t w = 0; w < words; w++) {
            uint32_t bits = m[w];
            if (bits == 0xffffffffu)
                continue;
            uint32_t *v = (uint32_t *)(x + w * 32);
            int64_t n = vocab - w * 32 < 32 ? vocab - w * 32 : 32;
            if (n == 32) {  /* branch-free, so the compiler vectorizes it */
                for (int j = 0; j < 32; j++) {
                    uint32_t keep = 0u - ((bits >> j) & 1u);
                    v[j] = (v[j] & keep) | (NEG_INF_BITS & ~keep);
                }
            } else {
                for (int64_t j = 0; j < n; j++)
                    if (!((bits >> j) & 1u))
                        x[w * 32 + j] = -INFINITY;
            }
        }
    }
}
