"""Bounds shared by both ends of the internal sockets."""
from __future__ import annotations

MAX_ID_BYTES = 1024           # request ids, worker ids, salts, model names
MAX_LIST = 4096               # stop ids, eos ids, abort lists, logit_bias entries, logprobs
