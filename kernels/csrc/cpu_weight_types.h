// The weight formats a projection may hold, by ggml's type numbers (a GGUF tensor's type).
#pragma once

#define QK 32       // weights in a GGUF block
#define TYPE_F32 0
#define TYPE_Q4_1 3   // 20 bytes a block: fp16 d, fp16 m, 16 bytes of nibbles
#define TYPE_Q8_0 8   // 34 bytes a block: fp16 d, int8 q[32]
#define TYPE_I8 24    // --quantization int8: int8 rows, a scale per row applied to each sum
#define TYPE_BF16 30
