"""Tensor parallelism: the sharded layers' group, and the ranks of one worker."""
