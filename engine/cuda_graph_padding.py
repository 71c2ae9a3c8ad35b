"""Decode steps of static shapes, so that a CUDA graph can hold one (engine/runner.py `CudaGraphs`).

On a GPU a decode step of a small model is bound by kernel launches (hundreds of operators, each
at least one launch), not by its arithmetic; a CUDA graph replays all of them as one. A graph
fixes every shape, so a decode step is padded to a bucket: rows to the next size in ROW_BUCKETS
(always one padding row at least, which the padded sampling indices point at), and each row's
past to one span of a power-of-two number of blocks (one pair per row: the step's own
`single_span_blocks` form, which both exported graphs compute as the general one does). Padding
rows decode token 0 at position 0 from the table's spare row with no past, and write their keys
and values to a scratch slot that no sequence owns. Steps that do not fit (a prefill row, a
grammar mask, logit adjustments, a long row among short ones, whose one span per row would waste
more than it saves, a row whose next token is not wanted) run as they are. A small step's one-token
rows (in the prefill group on every device, engine/batch.py) become the padded step's decode group.

Everything here is numpy: the padded step is checked against the unpadded one on the CPU
(tests/test_long_context.py); the capture itself only on a GPU (`make gpu-check`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from batchstring.engine.batch import StepBatch
from batchstring.engine.block_table import single_span_blocks
from batchstring.export.contract import SamplingInputs, StepInputs

ROW_BUCKETS = (2, 4, 8, *range(16, 1025, 8))  # sizes a padded decode step may have


@dataclass(frozen=True)
class PaddedStep:
    key: tuple[int, int]  # (rows, blocks per pair): one graph per key
    inputs: StepInputs
    write_slots: np.ndarray
    rows: int  # the real rows: outputs [:rows]
    sampled: int  # the real sampled rows: sampled outputs [:sampled]


def row_bucket(rows: int) -> int:
    return next(b for b in ROW_BUCKETS if b > rows)


def pad_decode(batch: StepBatch, block_size: int, scratch_slot: int) -> PaddedStep | None:
    """`batch` padded to its bucket, or None where it does not fit one (module docstring)."""
    f, s = batch.inputs, batch.inputs.sampling
    group = _one_token_rows(f)
    rows = f.tokens
    if group is None or len(s.mask_rows) or len(s.adjust_rows) or rows >= ROW_BUCKETS[-1]:
        return None
    if f.rows != rows:  # a row that computes without sampling (a prompt's last-but-one chunk)
        return None
    table_rows, context = group
    longest = single_span_blocks(context, block_size)
    if longest is None:
        return None
    span = min(1 << (longest - 1).bit_length(), batch.table.width)
    size = row_bucket(rows)
    pad = size - rows
    spare_row = batch.table.array.shape[0] - 1
    every = np.arange(size)
    sampled = len(s.sample_rows)
    padded = f.replace(
        input_ids=_grow(f.input_ids, pad, 0), position_ids=_grow(f.position_ids, pad, 0),
        decode_tokens=every[:, None], decode_rows=_grow(table_rows, pad, spare_row),
        decode_context=_grow(context, pad, 0), decode_pairs=np.empty((size, span, 0), np.int64),
        prefill_tokens=np.zeros((0, 1), np.int64), prefill_mask=np.zeros((0, 1), bool),
        prefill_rows=_NOTHING, prefill_context=_NOTHING, prefill_pairs=np.empty((0, 1, 0), np.int64),
        token_order=every, logit_tokens=every, single_group=False, sampling=_padded_sampling(s, size),
    )
    return PaddedStep((size, span), padded, _grow(batch.write_slots, pad, scratch_slot), rows, sampled)


def _one_token_rows(inputs: StepInputs) -> tuple[np.ndarray, np.ndarray] | None:
    """(table rows, computed tokens) of the group holding every row when each row feeds one
    token: the decode group, or (a small step, engine/batch.py) the prefill group at width 1;
    None when some row feeds more."""
    if not len(inputs.prefill_rows):
        return (inputs.decode_rows, inputs.decode_context) if len(inputs.decode_rows) else None
    if not len(inputs.decode_rows) and inputs.prefill_tokens.shape[1] == 1:
        return inputs.prefill_rows, inputs.prefill_context
    return None


_NOTHING = np.zeros(0, np.int64)


def _padded_sampling(s: SamplingInputs, size: int) -> SamplingInputs:
    """The banned and sampled rows padded with greedy entries for the last padding row (their
    duplicates only ever overwrite that row's token)."""
    pad, row = size - len(s.sample_rows), size - 1
    return dataclasses.replace(
        s, ban_rows=_grow(s.ban_rows, size - len(s.ban_rows), row), sample_rows=_grow(s.sample_rows, pad, row),
        temperature=_grow(s.temperature, pad, 0.0), top_k=_grow(s.top_k, pad, 0), top_p=_grow(s.top_p, pad, 1.0),
        uniform=_grow(s.uniform, pad, 1.0), min_p=_grow(s.min_p, pad, 0.0))


def _grow(values: np.ndarray, count: int, fill) -> np.ndarray:
    return np.concatenate([values, np.full(count, fill, values.dtype)])
