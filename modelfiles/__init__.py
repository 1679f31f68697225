"""A model's files: where a --model name points and what is derived from them (the tokenizer,
dequantized weights). Below every process package, so that the worker and the gateway, which
both read the model, import it without importing the launcher."""
