"""The simulated engine's prefix cache: full blocks of prompt tokens, hashed as a chain, LRU.

As vLLM's automatic prefix caching does, a block's key is the hash of the block before it,
its tokens and the LoRA adapter (the same tokens under another adapter are other KV values),
so a prompt hits the longest run of leading full blocks already computed; and of one
prompt's blocks, the tail ones are evicted first.
"""

from __future__ import annotations

from collections import OrderedDict


def block_keys(prompt_ids: list[int] | tuple[int, ...], block_size: int,
               lora: int = 0) -> list[int]:
    """Chained keys of the prompt's full blocks, first block first."""
    keys, parent = [], hash((-1, lora))  # ints only: the same in every process
    for start in range(0, len(prompt_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(prompt_ids[start:start + block_size])))
        keys.append(parent)
    return keys


class PrefixCache:
    """At most ``capacity`` blocks, least recently used evicted first.

    Args:
        capacity: blocks held (the engine's KV blocks).
        block_size: tokens per block.
    """

    def __init__(self, capacity: int, block_size: int) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def lookup(self, prompt_ids: list[int] | tuple[int, ...], lora: int = 0) -> int:
        """Prompt tokens already cached (a multiple of ``block_size``), without changing
        the cache."""
        hits = 0
        for key in block_keys(prompt_ids, self.block_size, lora):
            if key not in self._blocks:
                break
            hits += 1
        return hits * self.block_size

    def insert(self, prompt_ids: list[int] | tuple[int, ...], lora: int = 0) -> int:
        """Compute (or touch) the prompt's full blocks; returns the tokens that were cached
        before this call."""
        cached = self.lookup(prompt_ids, lora)
        # Tail blocks first, so the head of the prompt is the most recently used: eviction
        # takes a sequence's tail before its head, as vLLM frees a request's blocks in
        # reverse order (vllm/v1/core/single_type_kv_cache_manager.py, free()); a cached
        # tail is no use without its head.
        for key in reversed(block_keys(prompt_ids, self.block_size, lora)):
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
        return cached

    def insert_finished(self, prompt_ids: tuple[int, ...], output_ids: list[int] | tuple[int, ...],
                        lora: int = 0) -> None:
        """Cache a finished sequence's full blocks, as vLLM caches a sequence's blocks as
        they fill, generated tokens included (``KVCacheManager.allocate_slots``): its prompt
        and output up to the output's last token, whose KV no step computed."""
        self.insert((*prompt_ids, *output_ids[:-1]), lora)

    def reset(self) -> None:
        self._blocks.clear()
