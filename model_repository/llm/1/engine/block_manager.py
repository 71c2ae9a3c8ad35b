"""Paged KV-cache bookkeeping: which fixed-size blocks of cache slots each sequence owns.

Paging (as in vLLM) lets the budget be spent on tokens that exist rather than on the
maximum length every sequence might reach, so more sequences fit in the same memory.
The cache arrays themselves live in the runner; this class only hands out block numbers.
"""

from __future__ import annotations

from engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low numbers first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still needs so that `num_tokens` of its tokens fit in the cache."""
        return max(0, self.blocks_for(num_tokens) - len(seq.blocks))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.extra_blocks(seq, num_tokens) <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self.extra_blocks(seq, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"KV cache exhausted: need {need} blocks, {len(self._free)} free")
        seq.blocks.extend(self._free.pop() for _ in range(need))

    def release(self, seq: Sequence) -> None:
        self._free.extend(reversed(seq.blocks))
        seq.blocks = []
        seq.num_cached = 0
