"""One step of the worker: the fixed pipeline, its hooks, the persistent batch, the sampler,
logits processors, logprobs, the plan's checks and beam search's hook."""
