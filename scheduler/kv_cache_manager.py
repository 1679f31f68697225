"""The only door between the scheduler and one worker's KV blocks.

It owns the block math (how many blocks n more tokens need), the block hashes of each request
(computed once, as its tokens become known), the prefix cache, copy-on-write forks and the CPU
swap pool. The scheduler decides who runs; this file decides which blocks they get, and never
which request goes first. Nothing else reads or writes the pools: their free counts, the
prefix-cache switch and statistics are read through the methods here, and block moves come out as
plain (src, dst) pairs, which become protobuf only where the plan is built (scheduler/step.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.block_pool import BlockPool, extend_block_hashes

if TYPE_CHECKING:
    from scheduler.request import Request


_NONE: list[int] = []  # "no new blocks", shared: callers only read it

BlockMove = tuple[int, int]  # (source block, destination block): a swap or a copy-on-write


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_cpu_blocks: int = 0) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.cpu_pool = BlockPool(num_cpu_blocks, enable_prefix_caching=False)
        # A plain attribute, not a property over the pool's: results read it for every row.
        self.prefix_caching = enable_prefix_caching

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free(self) -> int:
        """Device blocks on the free list (cached prefixes nobody holds included)."""
        return self.pool.num_free

    @property
    def num_used(self) -> int:
        return self.pool.num_used

    @property
    def has_swap_space(self) -> bool:
        return self.cpu_pool.num_blocks > 0

    @property
    def num_cpu_free(self) -> int:
        """CPU swap blocks nobody holds."""
        return self.cpu_pool.num_free

    def ref_count(self, block: int) -> int:
        """How many sequences hold a device block (forks and beams share theirs)."""
        return self.pool.ref_cnt[block]

    def prefix_stats(self) -> tuple[int, int]:
        """(tokens looked up, tokens found) in the prefix cache, at first admissions."""
        return self.pool.queries, self.pool.hits

    def count_admission(self, req: "Request") -> None:
        """A sequence's prefix hit at its first admission, for the statistics (a recompute
        after preemption would count its own earlier blocks as hits)."""
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = req.num_computed_tokens
            self.pool.queries += req.num_tokens
            self.pool.hits += req.num_computed_tokens

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ---------------------------------------------------------------------------
    def _hash_up_to(self, req: "Request", num_blocks: int) -> list[bytes]:
        """req's block hashes for its first num_blocks full blocks, extending what it holds."""
        return extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size, num_blocks,
                                   req.cache_salt)

    def get_computed_blocks(self, req: "Request") -> list[int]:
        """Cached blocks holding the longest prefix of req's known tokens; never all of them, so
        that at least one token is computed and logits exist. Takes no reference."""
        if not self.pool.enable_prefix_caching or req.sampling.HasField("prompt_logprobs"):
            return []  # prompt logprobs need the logits of every prompt position
        hashes = self._hash_up_to(req, (req.num_tokens - 1) // self.block_size)
        return self.pool.find_cached(hashes[:(req.num_tokens - 1) // self.block_size])

    def cache_blocks(self, req: "Request") -> None:
        """Make req's full blocks findable once their tokens are known and computed."""
        if req.num_computed_tokens // self.block_size <= req.num_cached_blocks:
            return  # the usual step: no block filled
        full = min(req.num_computed_tokens, len(req.all_token_ids)) // self.block_size
        if not self.pool.enable_prefix_caching or full <= req.num_cached_blocks:
            return
        hashes = self._hash_up_to(req, full)
        start, req.num_cached_blocks = req.num_cached_blocks, full
        self.pool.cache_blocks(req.block_ids[start:full], hashes[start:full])

    def uncache_from(self, req: "Request", position: int) -> None:
        """Blocks of req from the one holding `position` on leave the prefix cache: a failed step
        may have left their KV unwritten. By hash, so blocks req no longer holds go too."""
        cached, block_hash = self.pool.cached, self.pool.block_hash
        for h in req.block_hashes[position // self.block_size:]:
            block = cached.get(h)
            if block is not None and block_hash[block] == h:
                self.pool.forget_hash(block)
        req.num_cached_blocks = min(req.num_cached_blocks, position // self.block_size)

    # -- allocation -----------------------------------------------------------------------------
    def allocate_slots(self, req: "Request", num_new_tokens: int,
                       computed_blocks: list[int] | None = None,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Blocks for req's next num_new_tokens tokens, after its computed ones, and room for
        num_lookahead_tokens more (speculative decoding's draft tokens; none yet). On admission,
        computed_blocks (from get_computed_blocks) become the head of its table. Returns the new
        block ids, or None, changing nothing, when the pool cannot hold them."""
        pool = self.pool
        num_new_tokens += num_lookahead_tokens  # room for them too; Step.take counts the computed
        if computed_blocks is None:
            # The common case, a decode within its last block, costs one comparison.
            need = (req.num_computed_tokens + num_new_tokens + self.block_size - 1) // self.block_size \
                - len(req.block_ids)
            if need <= 0:
                return _NONE
            if need > len(pool.free_blocks):
                return None
            new = pool.allocate(need)
            req.block_ids += new
            return new
        else:
            have, computed = len(computed_blocks), len(computed_blocks) * self.block_size
            # A cached block nobody references sits on the free list: taking it uses a free slot.
            reviving = sum(1 for b in computed_blocks if pool.ref_cnt[b] == 0)
        need = max(0, self.blocks_for(computed + num_new_tokens) - have)
        if need + reviving > pool.num_free:
            return None
        if computed_blocks is not None:
            pool.touch(computed_blocks)
            req.block_ids = list(computed_blocks)
            req.num_cached_blocks = len(computed_blocks)
        new = pool.allocate(need) if need else []
        req.block_ids += new
        return new

    def free(self, req: "Request") -> None:
        """Drop req's references on device and CPU blocks. Its full blocks stay cached (and
        findable) until the pool reuses them."""
        if req.block_ids:
            self.pool.free(req.block_ids)
            req.block_ids = []
        if req.cpu_block_ids:
            self.cpu_pool.free(req.cpu_block_ids)
            req.cpu_block_ids = []
        req.num_cached_blocks = 0

    def fork(self, parent: "Request", child: "Request") -> BlockMove | None:
        """child shares parent's full blocks and gets its own last block, which the parent has
        partly filled: the returned copy (run by the worker before the forward) fills it."""
        c, bs = parent.num_computed_tokens, self.block_size
        full = c // bs
        shared = parent.block_ids[:full]
        self.pool.touch(shared)
        own = self.pool.allocate(1)
        child.block_ids = shared + own
        child.block_hashes = parent.block_hashes[:full]
        child.num_cached_blocks = min(parent.num_cached_blocks, full)
        return (parent.block_ids[full], own[0]) if c % bs else None

    def share(self, parent: "Request", child: "Request") -> None:
        """Beam search: child takes a reference on every block of parent, the partial last one
        too; whichever of them writes into a shared partial block first copies it (write_slots)."""
        self.pool.touch(parent.block_ids)
        child.block_ids = list(parent.block_ids)
        full = parent.num_computed_tokens // self.block_size
        child.block_hashes = parent.block_hashes[:full]
        child.num_cached_blocks = min(parent.num_cached_blocks, full)

    def write_slots(self, req: "Request", n: int) -> tuple[list[int], BlockMove | None]:
        """allocate_slots for a sequence that may share its partial last block (share): that
        block is copied into one of its own first. Check write_cost first: this must not fail.
        Only a sequence new to the worker may copy (its NewSeq carries the new table)."""
        copy, last = None, req.block_ids[-1] if req.block_ids else -1
        if req.num_computed_tokens % self.block_size and self.pool.ref_cnt[last] > 1:
            if req.on_worker:
                raise RuntimeError(f"{req.seq_id}: a held sequence would copy its last block")
            own = self.pool.allocate(1)[0]
            self.pool.free([last])
            req.block_ids[-1] = own
            copy = (last, own)
        new = self.allocate_slots(req, n)
        if new is None:
            raise MemoryError(f"{req.seq_id}: write_slots without room")
        return new, copy

    def write_cost(self, work: list[tuple["Request", int]]) -> int:
        """Free blocks write_slots needs for (sequence, tokens) pairs, taken in that order: the
        last of the sequences sharing a partial block keeps it."""
        refs: dict[int, int] = {}
        need = 0
        for req, n in work:
            if req.num_computed_tokens % self.block_size:
                last = req.block_ids[-1]
                r = refs.get(last, self.pool.ref_cnt[last])
                if r > 1:
                    need += 1
                    refs[last] = r - 1
            need += max(0, self.blocks_for(req.num_computed_tokens + n) - len(req.block_ids))
        return need

    def fork_cost(self, parent: "Request", num_children: int, num_new_tokens: int) -> int:
        """Free blocks a fork step needs: the parent's growth plus one own block per child."""
        grow = self.blocks_for(parent.num_computed_tokens + num_new_tokens) - len(parent.block_ids)
        return max(0, grow) + num_children

    # -- swap -----------------------------------------------------------------------------------
    def can_swap_out(self, req: "Request") -> bool:
        return bool(req.block_ids) and self.cpu_pool.can_allocate(len(req.block_ids))

    def swap_out(self, req: "Request") -> list[BlockMove]:
        cpu = self.cpu_pool.allocate(len(req.block_ids))
        ops = list(zip(req.block_ids, cpu))
        self.pool.free(req.block_ids)
        req.block_ids, req.cpu_block_ids, req.num_cached_blocks = [], cpu, 0
        return ops

    def swap_in(self, req: "Request", num_new_tokens: int) -> list[BlockMove] | None:
        """Device blocks for req's swapped blocks plus room for num_new_tokens, or None."""
        back = len(req.cpu_block_ids)
        need = max(back, self.blocks_for(req.num_computed_tokens + num_new_tokens))
        if need > self.pool.num_free:
            return None
        gpu = self.pool.allocate(need)
        ops = list(zip(req.cpu_block_ids, gpu))
        self.cpu_pool.free(req.cpu_block_ids)
        req.cpu_block_ids, req.block_ids = [], gpu
        return ops

    # -- checks ---------------------------------------------------------------------------------
    def check_invariant(self, reqs) -> None:
        self.pool.check_invariant([r.block_ids for r in reqs])
        self.cpu_pool.check_invariant([r.cpu_block_ids for r in reqs])
