"""One worker's KV blocks: reference counts, an LRU free list and the prefix cache.

The scheduler talks to its pool through this narrow interface only. Block ids are the worker's
physical block numbers; the pool never sees tensors.
"""
from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict
from typing import Iterable, Sequence

# The first block's parent, drawn at each start (vLLM's NONE_HASH): nobody outside this process
# can compute a block's hash, so nobody can aim a collision at one.
_ROOT = os.urandom(32)


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """A full block's identity, sha256 over everything before it (the parent's hash), its tokens
    and extra keys (the request's cache salt, on the first block) so that different contexts
    never share a block: a hit hands one request's KV to another, so it must never collide."""
    tokens = array("I", token_ids).tobytes()
    return hashlib.sha256(b"".join((parent_hash or _ROOT, len(tokens).to_bytes(4, "little"),
                                    tokens, extra))).digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        num_blocks: int, cache_salt: str = "") -> list[bytes]:
    """The one hash chain: `hashes`, those of the leading full blocks of token_ids, extended in
    place to the first num_blocks. The salt enters the first block, and through the chain every
    later one."""
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_blocks):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size],
                            cache_salt.encode() if i == 0 else b"")
        hashes.append(parent)
    return hashes


def full_block_hashes(token_ids: Sequence[int], block_size: int, num_blocks: int,
                      cache_salt: str = "") -> list[bytes]:
    """The chained hashes of the first num_blocks full blocks of a token sequence."""
    return extend_block_hashes([], token_ids, block_size, num_blocks, cache_salt)


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # Free blocks, least recently freed first. An OrderedDict gives O(1) removal of a cached
        # block that gets a new reference while still on the free list.
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        # Prefix cache statistics, in tokens, kept by KVCacheManager.count_admission.
        self.queries = 0
        self.hits = 0

    # -- capacity ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_blocks)

    # -- allocation -------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_blocks):
            raise MemoryError(f"asked for {n} blocks, {len(self.free_blocks)} free")
        out, popitem, ref_cnt, block_hash = [], self.free_blocks.popitem, self.ref_cnt, self.block_hash
        for _ in range(n):
            block, _ = popitem(last=False)
            if block_hash[block] is not None:
                self.forget_hash(block)
            ref_cnt[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        """Take one more reference on blocks found in the prefix cache or shared by a fork."""
        for block in blocks:
            if self.ref_cnt[block] == 0:
                del self.free_blocks[block]
            self.ref_cnt[block] += 1

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference each. Blocks are freed tail first, so that a sequence's last blocks,
        the least likely to be shared, are the first to be reused."""
        for block in reversed(blocks):
            self.ref_cnt[block] -= 1
            assert self.ref_cnt[block] >= 0, f"block {block} freed twice"
            if self.ref_cnt[block] == 0:
                if self.block_hash[block] is None:
                    # Nothing to find in it: reuse it before blocks that still hold a prefix.
                    self.free_blocks[block] = None
                    self.free_blocks.move_to_end(block, last=False)
                else:
                    self.free_blocks[block] = None

    # -- prefix cache -----------------------------------------------------------------------
    def cache_blocks(self, blocks: Sequence[int], block_hashes: Sequence[bytes]) -> None:
        """Make full, computed blocks findable by their hashes."""
        if not self.enable_prefix_caching:
            return
        block_hash, cached = self.block_hash, self.cached
        for block, h in zip(blocks, block_hashes):
            # An identical block already cached leaves this copy anonymous.
            if block_hash[block] is None and h not in cached:
                block_hash[block] = h
                cached[h] = block

    def find_cached(self, block_hashes: Sequence[bytes]) -> list[int]:
        """The longest run of leading blocks already in the cache (no references taken)."""
        hits = []
        if self.enable_prefix_caching:
            for h in block_hashes:
                block = self.cached.get(h)
                if block is None:
                    break
                hits.append(block)
        return hits

    def forget_hash(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            if self.cached.get(h) == block:
                del self.cached[h]

    # -- checks -----------------------------------------------------------------------------
    def check_invariant(self, tables: Iterable[Sequence[int]]) -> None:
        """free + referenced = total, and each refcount equals the number of tables holding it."""
        referenced = sum(1 for c in self.ref_cnt if c > 0)
        assert len(self.free_blocks) + referenced == self.num_blocks, \
            f"free {len(self.free_blocks)} + referenced {referenced} != total {self.num_blocks}"
        for block in self.free_blocks:
            assert self.ref_cnt[block] == 0, f"free block {block} has refcount {self.ref_cnt[block]}"
        counts = [0] * self.num_blocks
        for table in tables:
            for block in table:
                counts[block] += 1
        assert counts == self.ref_cnt, "refcounts differ from the block tables that hold them"
        for h, block in self.cached.items():
            assert self.block_hash[block] == h
