"""Decode steps of static shapes, so that a CUDA graph can hold one (engine/runner.py `CudaGraphs`).

On a GPU a decode step of a small model is bound by kernel launches (hundreds of operators, each
at least one launch), not by its arithmetic; a CUDA graph replays all of them as one. A graph
fixes every shape, so a decode step is padded to a bucket: rows to the next size in ROW_BUCKETS
(always one padding row at least, which the padded sampling indices point at), and each row's
past to one span of a power-of-two number of blocks (one pair per row: the step's own
`one_span_per_row` form, which both exported graphs compute as the general one does). Padding
rows decode token 0 at position 0 from the table's spare row with no past, and write their keys
and values to a scratch slot that no sequence owns. Steps that do not fit (a prefill row, a
grammar mask, logit adjustments, a long row among short ones, whose one span per row would waste
more than it saves, a row whose next token is not wanted) run as they are. A small step's one-token
rows (in the prefill group on every device, engine/batch.py) become the padded step's decode group.

Everything here is numpy: the padded step is checked against the unpadded one on the CPU
(tests/test_long_context.py); the capture itself only on a GPU (`make gpu-check`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchstring.engine.batch import StepBatch
from batchstring.engine.block_table import one_span_per_row

ROW_BUCKETS = (2, 4, 8, *range(16, 1025, 8))  # sizes a padded decode step may have


@dataclass(frozen=True)
class PaddedStep:
    key: tuple[int, int]  # (rows, blocks per pair): one graph per key
    feeds: dict[str, np.ndarray]
    write_slots: np.ndarray
    rows: int  # the real rows: outputs [:rows]
    sampled: int  # the real sampled rows: sampled outputs [:sampled]


def row_bucket(rows: int) -> int:
    return next(b for b in ROW_BUCKETS if b > rows)


def pad_decode(batch: StepBatch, block_size: int, scratch_slot: int) -> PaddedStep | None:
    """`batch` padded to its bucket, or None where it does not fit one (module docstring)."""
    f = batch.feeds
    group = _one_token_rows(f)
    rows = len(f["input_ids"])
    if group is None or len(f["mask_rows"]) or len(f["adjust_rows"]) or rows >= ROW_BUCKETS[-1]:
        return None
    if len(f["logit_tokens"]) != rows:  # a row that computes without sampling (a prompt's last-but-one chunk)
        return None
    context = f[f"{group}_context"]
    longest = one_span_per_row(context, block_size)
    if longest is None:
        return None
    span = min(1 << (longest - 1).bit_length(), batch.table.width)
    size = row_bucket(rows)
    pad = size - rows
    spare_row = batch.table.array.shape[0] - 1
    every = np.arange(size)
    sampled = len(f["sample_rows"])
    feeds = {
        **f,
        "input_ids": _grow(f["input_ids"], pad, 0), "position_ids": _grow(f["position_ids"], pad, 0),
        "decode_tokens": every[:, None], "decode_rows": _grow(f[f"{group}_rows"], pad, spare_row),
        "decode_context": _grow(context, pad, 0), "decode_pairs": np.empty((size, span, 0), np.int64),
        **_NO_PREFILL,
        "token_order": every, "logit_tokens": every,
        "ban_rows": _grow(f["ban_rows"], size - len(f["ban_rows"]), size - 1),
        **_padded_sampling(f, size - sampled, size - 1),
    }
    return PaddedStep((size, span), feeds, _grow(batch.write_slots, pad, scratch_slot), rows, sampled)


def _one_token_rows(feeds: dict[str, np.ndarray]) -> str | None:
    """The group holding every row when each row feeds one token: the decode group, or (a small
    step, engine/batch.py) the prefill group at width 1; None when some row feeds more."""
    if not len(feeds["prefill_rows"]):
        return "decode" if len(feeds["decode_rows"]) else None
    if not len(feeds["decode_rows"]) and feeds["prefill_tokens"].shape[1] == 1:
        return "prefill"
    return None


_NO_PREFILL = {"prefill_tokens": np.zeros((0, 1), np.int64), "prefill_mask": np.zeros((0, 1), bool),
               "prefill_rows": np.zeros(0, np.int64), "prefill_context": np.zeros(0, np.int64),
               "prefill_pairs": np.empty((0, 1, 0), np.int64)}


def _padded_sampling(feeds: dict[str, np.ndarray], pad: int, row: int) -> dict[str, np.ndarray]:
    """The sampled rows padded with greedy entries for a padding row (their duplicates only ever
    overwrite that row's token)."""
    neutral = {"sample_rows": row, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "uniform": 1.0, "min_p": 0.0}
    return {name: _grow(feeds[name], pad, value) for name, value in neutral.items()}


def _grow(values: np.ndarray, count: int, fill) -> np.ndarray:
    return np.concatenate([values, np.full(count, fill, values.dtype)])
