"""Speculative decoding: proposers (n-gram, suffix, draft model), the rejection sampler,
the speculator and its hook in the step."""
