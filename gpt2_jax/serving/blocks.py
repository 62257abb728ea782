"""The engine's KV blocks on the host: who holds which block of the pool, and the prefix cache.

A request holds the blocks its prompt and its output need (ceil((prompt + max_tokens) / C) of the pool's blocks of
C slots, see gpt2_jax.model.paged_cache), listed in its row's block table. A block fully filled with prompt tokens is
named by a hash of its tokens and of every block before it (so a name fixes the whole prefix, as in vLLM); once
computed it is registered under that name, and when its request ends it stays in the pool, evictable, until its
slots are needed (least recently used first). A new request looks up its prompt's leading blocks by name and takes
every one already there: those tokens are not computed again. Since a token's K/V are the same bits whoever
computed them (the model's batch invariance), a request served from cached blocks gives the same bits as on an
empty cache.

A block is never written once registered: a request reuses only whole blocks, at most (prompt - 1) // C of them,
so it always computes its last prompt token (whose logits it needs) into a block of its own.
"""

from __future__ import annotations

import collections
import hashlib
from typing import NamedTuple

import numpy as np

from gpt2_jax.model.paged_cache import NULL_BLOCK


class BlockPlan(NamedTuple):
    """What admitting a request would take: its cached leading blocks and how many fresh ones."""

    reused: list[int]  # blocks of the pool holding the prompt's first len(reused) x C tokens
    fresh: int  # blocks to hand out for the rest of the prompt and the output
    names: list[bytes]  # the names of the prompt's full blocks


def block_names(prompt: list[int], C: int) -> list[bytes]:
    """The name of each full block of C prompt tokens: a hash of its tokens chained to the previous block's name."""
    names, parent = [], b""
    tokens = np.asarray(prompt, np.int32)
    for j in range(len(prompt) // C):
        parent = hashlib.blake2b(parent + tokens[j * C : (j + 1) * C].tobytes(), digest_size=16).digest()
        names.append(parent)
    return names


class BlockPool:
    """num_blocks blocks of C slots (block 0, the null block, never handed out) and the prefix cache over them."""

    def __init__(self, num_blocks: int, C: int):
        self.C, self.num_blocks = C, num_blocks
        self.free: collections.deque[int] = collections.deque(range(1, num_blocks))
        self.refs = np.zeros(num_blocks, np.int64)
        self.name_of: dict[int, bytes] = {}  # registered block -> its name
        self.by_name: dict[bytes, int] = {}
        self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # registered, unheld: LRU first
        self.computing: set[bytes] = set()  # names some request's prefill is filling now
        self.queried = self.hits = self.evictions = 0  # prompt tokens looked up, found; blocks evicted

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.C)

    def plan(self, prompt: list[int], tokens: int) -> BlockPlan | None:
        """A request of `tokens` slots (prompt + max_tokens, capped at its table) -> its BlockPlan, or None if the pool
        cannot hold it now (it waits for blocks to come free)."""
        names = block_names(prompt, self.C)
        reused = []
        for name in names[: (len(prompt) - 1) // self.C]:
            block = self.by_name.get(name)
            if block is None:
                break
            reused.append(block)
        fresh = self.blocks_for(tokens) - len(reused)
        taken_idle = sum(b in self.idle for b in reused)
        if fresh > len(self.free) + len(self.idle) - taken_idle:
            return None
        return BlockPlan(reused, fresh, names)

    def waits_for(self, plan: BlockPlan, prompt_len: int) -> bool:
        """Whether the request's next block is being computed by another request right now: waiting for it (a
        chunk or two) beats computing it twice (n choices of one prompt, the same preamble arriving together)."""
        j = len(plan.reused)
        return j < (prompt_len - 1) // self.C and plan.names[j] in self.computing

    def take(self, plan: BlockPlan, prompt_len: int) -> list[int]:
        """Hand out a plan's blocks -> the row's blocks, in slot order (the reused ones first)."""
        self.queried += prompt_len
        self.hits += len(plan.reused) * self.C
        for b in plan.reused:
            self.refs[b] += 1
            self.idle.pop(b, None)
        fresh = [self._fresh() for _ in range(plan.fresh)]
        for b in fresh:
            self.refs[b] = 1
        self.computing.update(plan.names[len(plan.reused) :])
        return list(plan.reused) + fresh

    def _fresh(self) -> int:
        if self.free:
            return self.free.popleft()
        b, _ = self.idle.popitem(last=False)  # the least recently used cached block
        del self.by_name[self.name_of.pop(b)]
        self.evictions += 1
        return b

    def register(self, blocks: list[int], names: list[bytes], upto: int) -> None:
        """The row's first `upto` full prompt blocks now hold their tokens: name them (a name some other block
        already has keeps that block; this one stays the row's own)."""
        for j in range(upto):
            name = names[j]
            self.computing.discard(name)
            if name not in self.by_name and blocks[j] not in self.name_of:
                self.by_name[name], self.name_of[blocks[j]] = blocks[j], name

    def release(self, blocks: list[int], names: list[bytes]) -> None:
        """A row ends: its blocks are unheld; named ones stay cached (most recently used last), the rest are free."""
        for name in names:
            if name not in self.by_name:
                self.computing.discard(name)  # an unfinished prefill's
        for b in blocks:
            if b == NULL_BLOCK:
                continue
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if b in self.name_of:
                    self.idle[b] = None
                    self.idle.move_to_end(b)
                else:
                    self.free.append(b)

    def stats(self) -> dict:
        held = int((self.refs > 0).sum())
        return {"blocks_total": self.num_blocks - 1, "blocks_used": held, "blocks_cached": len(self.idle),
                "blocks_free": len(self.free), "prefix_queried_tokens": self.queried,
                "prefix_hit_tokens": self.hits, "prefix_evictions": self.evictions}  # fmt: skip
