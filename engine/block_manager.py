"""Paged KV-cache bookkeeping: which fixed-size blocks of cache slots each sequence owns.

Paging (as in vLLM) lets the budget be spent on tokens that exist rather than on the
maximum length every sequence might reach, so more sequences fit in the same memory.
The cache arrays themselves live in the runner; this class hands out block numbers and keeps
them in a table (one row per sequence holding blocks) that the step builder reads in one go.

Automatic prefix caching: a block full of computed tokens is known by a hash of its tokens and
of the blocks before it: BLAKE2b, keyed by the sequence's `cache_salt` (the front door derives it
from the caller's API key and an optional per-request salt). A predictable hash (Python's `hash()`
of token ids) would let a crafted prompt collide with another tenant's block and read or poison
it (CVE-2025-25183 in vLLM); a keyed cryptographic one makes collisions infeasible and keeps each
tenant's blocks out of every other tenant's reach, so not even time to first token tells one
tenant what another has cached.

A sequence whose tokens start with known blocks reuses them (reference counted) and computes
only the rest. A block nobody uses any more keeps its contents and its
hash until its space is needed: free blocks without contents are handed out first, then cached
ones, least recently freed first. Shared blocks are only ever full ones, and a sequence always
computes at least its last token, so nobody writes into a block another sequence reads.
"""

from __future__ import annotations

import functools
import hashlib
from array import array
from collections import OrderedDict

from batchstring.engine.block_table import BlockTable
from batchstring.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, max_rows: int, max_tokens_per_seq: int,
                 prefix_caching: bool = True, window: int | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.window = window  # every layer's keys reach at most this far back: older blocks are given up
        self._plain = list(range(num_blocks - 1, -1, -1))  # free, no contents; pop() hands out low numbers first
        self._cached: OrderedDict[int, None] = OrderedDict()  # free with contents, least recently freed first
        self._refs = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self.table = BlockTable(max_rows, self.blocks_for(max_tokens_per_seq))
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self.query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # of which found cached

    # ----- sizes -------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._plain) + len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    @property
    def cached_blocks(self) -> int:
        """Blocks whose contents are known by hash (in use or free)."""
        return len(self._by_hash)

    def references(self, block: int) -> int:
        """How many sequences hold `block` (0: it is free)."""
        return self._refs[block]

    def free_blocks(self) -> set[int]:
        """Blocks nobody holds, with or without cached contents."""
        return set(self._plain) | set(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still needs so that `num_tokens` of its tokens fit in the cache."""
        return max(0, self.blocks_for(num_tokens) - len(seq.blocks))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.extra_blocks(seq, num_tokens) <= self.num_free

    # ----- allocation --------------------------------------------------------------------------

    def lookup(self, seq: Sequence) -> list[int]:
        """The cached blocks a waiting sequence can start from (nothing is taken yet)."""
        return self._lookup(seq) if self.prefix_caching else []

    def admit(self, seq: Sequence, hits: list[int], new_tokens: int, reserve: int = 0) -> bool:
        """Gives a waiting sequence its cached prefix `hits` and blocks for `new_tokens` beyond it;
        False (nothing changed) if that would leave fewer than `reserve` blocks free."""
        cached = len(hits) * self.block_size
        revived = sum(1 for b in hits if not self._refs[b])  # free cached blocks taken back into use
        if self.blocks_for(cached + new_tokens) - len(hits) + revived + reserve > self.num_free:
            return False
        if self.prefix_caching:
            self.query_tokens += seq.num_tokens
            self.hit_tokens += cached
        for block in hits:
            if not self._refs[block]:
                del self._cached[block]
            self._refs[block] += 1
        seq.committed = len(hits)
        self._assign(seq, hits)
        seq.num_computed = cached
        self.grow(seq, cached + new_tokens)
        return True

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self.extra_blocks(seq, num_tokens)
        if need > self.num_free:
            raise RuntimeError(f"KV cache exhausted: need {need} blocks, {self.num_free} free")
        fresh = [self._take() for _ in range(need)]
        for block in fresh:
            self._refs[block] = 1
        self._assign(seq, fresh)

    def _take(self) -> int:
        if self._plain:
            return self._plain.pop()
        block, _ = self._cached.popitem(last=False)  # evict the least recently freed
        if self._by_hash.get(self._hash[block]) == block:
            del self._by_hash[self._hash[block]]
        self._hash[block] = self._tokens[block] = None
        return block

    def _assign(self, seq: Sequence, blocks: list[int]) -> None:
        if seq.row is None:
            seq.row = self._free_rows.pop()
        start = len(seq.blocks)
        seq.blocks.extend(blocks)
        self.table.write(seq.row, start, blocks)

    def release(self, seq: Sequence) -> None:
        self._free(reversed(seq.blocks[seq.dropped:]))
        seq.blocks = []
        seq.dropped = 0
        seq.committed = 0
        seq.num_computed = 0
        if seq.row is not None:
            self._free_rows.append(seq.row)
            seq.row = None

    def slide(self, seq: Sequence) -> None:
        """Gives up the sequence's leading blocks that no layer's window reaches any more (a model
        whose every layer has a sliding window: Mistral, StarCoder2). A query at position q sees
        keys past q - window, and every later query of the sequence sits at num_computed or beyond.
        Its table row keeps pointing at the blocks given up: the step reads them there and masks
        them, whoever holds them now. With prefix caching, only blocks already made findable go:
        they stay findable until their space is needed, as any freed block does."""
        if self.window is None:
            return
        reachable = max(0, (seq.num_computed - self.window + 1) // self.block_size)
        end = min(reachable, seq.committed) if self.prefix_caching else reachable
        if end > seq.dropped:
            self._free(seq.blocks[seq.dropped:end])
            seq.dropped = end

    def _free(self, blocks) -> None:
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if self._hash[block] is None:
                self._plain.append(block)
            else:
                self._cached[block] = None

    # ----- the prefix cache --------------------------------------------------------------------

    def _lookup(self, seq: Sequence) -> list[int]:
        """Cached blocks that equal the sequence's leading full blocks, short of its last token
        (which must be computed: its logits give the next token)."""
        hits = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block = self._by_hash.get(self._key(seq, i))
            if block is None or self._tokens[block] != self._block_tokens(seq, i):  # a hash collision is a miss
                break
            hits.append(block)
        return hits

    def commit(self, seq: Sequence) -> None:
        """Makes the sequence's newly filled blocks findable by later sequences."""
        while seq.committed < seq.num_computed // self.block_size:
            i = seq.committed
            block, key = seq.blocks[i], self._key(seq, i)
            if self._hash[block] is None:
                self._hash[block], self._tokens[block] = key, self._block_tokens(seq, i)
                self._by_hash.setdefault(key, block)
            seq.committed += 1

    def _key(self, seq: Sequence, i: int) -> bytes:
        """The key of the sequence's i-th full block, computed once per sequence: a prompt that
        waits for room is looked up at every step, and a 16k-token one has a thousand blocks."""
        keys = seq.block_keys
        while len(keys) <= i:
            keys.append(block_key(keys[-1] if keys else b"", self._block_tokens(seq, len(keys)), seq.cache_salt))
        return keys[i]

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return seq.token_slice(i * self.block_size, (i + 1) * self.block_size)


def block_key(parent: bytes, tokens: tuple[int, ...], salt: bytes) -> bytes:
    """The key of a full block: 128 bits of BLAKE2b over the previous block's key and this block's
    tokens, keyed by the salt."""
    digest = _keyed(salt).copy()  # cheaper than keying a new one for every block
    digest.update(parent)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


@functools.lru_cache(maxsize=4096)
def _keyed(salt: bytes) -> hashlib.blake2b:
    """A BLAKE2b state keyed by the salt (its key is at most 64 bytes: a longer salt is hashed first)."""
    return hashlib.blake2b(digest_size=16, key=salt if len(salt) <= 64 else hashlib.blake2b(salt).digest())
