"""A worker's start-up: load, size the KV cache, measure (and keep the measurements)."""
