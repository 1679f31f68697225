"""The model and what runs it: the Llama family's layers, attention, weights loader, config,
KV cache, CPU matmul bounds and the one-C-call decode step."""
