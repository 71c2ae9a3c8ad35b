"""The block table and how one step's attention walks it (numpy only: the export's verification
and the GPU check import it on machines without the engine's other dependencies).

The step attends over the paged cache by *pairs*: a pair is one row of an attention group and one
span of `C` consecutive blocks of that row's past, so a row of P past tokens makes ceil(P / (C *
block_size)) pairs (one, masked, if it has no past) and the work of a step follows the sum of its
rows' contexts, not rows x longest (export/step.py). The graph derives every pair from three things the host sends per
group: each row's table row, each row's past length, and a shape carrier `[pairs, C, 0]` whose
shape alone says how many pairs there are and how many blocks each spans (it holds no bytes), so
nothing the host builds per step grows with the contexts. The table itself is the engine's
long-lived `BlockTable`: passed by reference on the CPU, mirrored on a device and updated there
from its journal of changes.

`span_blocks` picks C per step and group by a cost model measured on the CPU (docs/benchmarks.md,
"paged attention"): every key gathered, padding included, costs ~1; every pair costs
PAIR_COST keys' worth more (a small matrix multiply per kv head, its scatter entries) plus its
queries' gather. Uniform rows get one pair each (the whole past in one span, as a padded batch
would, but without its padding); a long row among short ones gets many pairs of a few blocks.
`single_span_blocks` says when a small step may take the single-group graph, whose pairs are its
rows: when one span as long as the longest row wastes little.
"""

from __future__ import annotations

import numpy as np

PAIR_COST = 32  # keys' worth of fixed work per pair (see the module docstring)
SPANS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # candidate blocks per pair, besides whole pasts


class BlockTable:
    """Which cache block holds each block of each row's tokens: `array[row, i]` is the block of
    the row's i-th block of tokens. One spare row at the end keeps the step's reads of a span
    that runs past a row's last column inside the array (they are masked: only entries within
    the row's past are attended to).

    `journal()` turns on a journal of every entry written; `drain()` hands the entries written
    since the last drain to a device mirror, so a step sends what changed, not the table.
    """

    def __init__(self, rows: int, width: int) -> None:
        self.array = np.zeros((rows + 1, max(1, width)), np.int64)
        self._journal: tuple[list[int], list[int]] | None = None

    @property
    def width(self) -> int:
        return self.array.shape[1]

    def write(self, row: int, start: int, blocks: list[int]) -> None:
        self.array[row, start : start + len(blocks)] = blocks
        if self._journal is not None and blocks:
            flat = row * self.width + start
            self._journal[0].extend(range(flat, flat + len(blocks)))
            self._journal[1].extend(blocks)

    def journal(self) -> None:
        """From now on, remember every entry written (a device mirror wants them)."""
        if self._journal is None:
            self._journal = ([], [])

    def drain(self) -> tuple[np.ndarray, np.ndarray]:
        """(flat indices, blocks) written since the last drain, each index once with its last
        write (a device's indexed assignment leaves duplicates' order undefined)."""
        if self._journal is None or not self._journal[0]:
            return _NONE, _NONE
        index, blocks = (np.asarray(part, np.int64) for part in self._journal)
        self._journal = ([], [])
        last = len(index) - 1 - np.unique(index[::-1], return_index=True)[1]
        return index[last], blocks[last]


_NONE = np.zeros(0, np.int64)


def span_blocks(context: np.ndarray, queries: int, block_size: int, group: int) -> int:
    """Blocks per pair for a group whose rows have `context` past tokens and `queries` query
    positions each (1 for decoding rows), with `group` query heads per kv head: the candidate of
    least modelled cost (module docstring). O(rows) per candidate."""
    blocks = -(-context // block_size)
    longest = int(blocks.max(initial=0))
    if longest <= 1:
        return 1
    candidates = np.asarray(sorted({c for c in SPANS if c < longest} | {longest}), np.int64)
    pairs = np.maximum(1, -(-blocks[None, :] // candidates[:, None]))  # [candidates, rows]
    keys = pairs * candidates[:, None] * block_size
    cost = (keys * queries + pairs * (PAIR_COST + group * queries)).sum(axis=1)
    return int(candidates[np.argmin(cost)])


def single_span_blocks(context: np.ndarray, block_size: int) -> int | None:
    """Blocks of the longest row, when one span that long per row gathers at most twice the
    keys the rows hold (and a block per row more); else None."""
    blocks = -(-context // block_size)
    longest = max(1, int(blocks.max(initial=0)))
    padded = longest * len(context)
    return longest if padded <= 2 * int(blocks.sum()) + len(context) else None


def pair_count(context: np.ndarray, span: int, block_size: int) -> int:
    return int(np.maximum(1, -(-context // (span * block_size))).sum())


def pair_carrier(context: np.ndarray, span: int, block_size: int) -> np.ndarray:
    """The `[pairs, span, 0]` shape carrier of a group (no bytes: its shape is the message)."""
    return np.empty((pair_count(context, span, block_size), span, 0), np.int64)
