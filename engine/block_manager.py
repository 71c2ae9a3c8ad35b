"""Paged KV-cache bookkeeping: which fixed-size blocks of cache slots each sequence owns.

Paging (as in vLLM) lets the budget be spent on tokens that exist rather than on the
maximum length every sequence might reach, so more sequences fit in the same memory.
The cache arrays themselves live in the runner; this class hands out block numbers and keeps
them in a table (one row per sequence holding blocks) that the step builder reads in one go.
"""

from __future__ import annotations

import numpy as np

from engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, max_rows: int, max_tokens_per_seq: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low numbers first
        self.table = np.zeros((max_rows, self.blocks_for(max_tokens_per_seq)), np.int64)
        self._free_rows = list(range(max_rows - 1, -1, -1))
        # position -> (block index in the sequence's table, offset in the block), computed once
        self.positions = np.arange(max_tokens_per_seq + 1)
        self.block_of = self.positions // block_size
        self.offset_of = self.positions % block_size

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
        if seq.row is None:
            seq.row = self._free_rows.pop()
        start = len(seq.blocks)
        seq.blocks.extend(self._free.pop() for _ in range(need))
        self.table[seq.row, start : len(seq.blocks)] = seq.blocks[start:]

    def release(self, seq: Sequence) -> None:
        self._free.extend(reversed(seq.blocks))
        seq.blocks = []
        seq.num_cached = 0
        if seq.row is not None:
            self._free_rows.append(seq.row)
            seq.row = None
