"""Builds the exported step's inputs for one iteration, as array operations over its rows.

Rows that decode one token go to the step's decode group and are built together without a
per-row loop; rows that prefill several tokens (few per step) go to the prefill group. A step of
at most SMALL_STEP_TOKENS tokens puts every row in the prefill group: padded together they waste
almost nothing, and the CPU runs such a step on a graph with that group only (export/step.py).
So is a step of one row, however long (a lone caller's prompt): one row pads nothing, and where
the small-step session has every core, that graph's fewer operators on spinning threads prefill it
in about 0.65x the time (engine/runner.py; docs/benchmarks.md, one caller).
The prefill group pads its rows to the widest, so a step whose few-token rows (forced runs,
drafts) would pad to a prompt chunk's width runs as two calls instead, when the attention model
says so (`split_step`). The layout is export/step.py's.

What a row costs here does not grow with its context: its table row, its past length and the
cache slots of its new tokens. The step reads the rest from the block table itself, which the
runner holds (engine/block_table.py), and each group's pairs are a shape, not an array.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from batchstring.engine.block_manager import BlockManager
from batchstring.engine.block_table import BlockTable, pair_carrier, single_span_blocks, span_blocks
from batchstring.engine.config import EngineConfig
from batchstring.engine.randomness import RandomStreams
from batchstring.engine.sampling_params import SamplingParams
from batchstring.engine.sequence import Sequence
from batchstring.engine.structured_output import step_masks
from batchstring.export.contract import SamplingInputs, StepInputs

SMALL_STEP_TOKENS = 16  # a step of at most this many tokens (or of one row): one attention group (CPU: its own graph)
# Keys x queries of padded attention worth a second runner call of a step (split_step), by device.
# CPU: the cost of one runner call, from a fit over recorded steps (docs/benchmarks.md, long contexts).
# CUDA: a call is hundreds of kernel launches while padded attention is cheap, so only padding of
# millions of keys x queries splits a step; an estimate, not yet measured on a GPU (engine
# parameter split_step_cost).
SPLIT_STEP_COSTS = {"cpu": 4096, "cuda": 1 << 24}


@dataclass(frozen=True)
class Work:
    """A sequence in a step: feed its next `new` tokens; `samples`: its next token is wanted.
    `draft`: speculative tokens fed after its last one (new = 1 + len(draft)); the token after
    each of them comes back too (engine/speculation.py)."""

    seq: Sequence
    new: int
    samples: bool = True
    draft: tuple[int, ...] = ()


@dataclass(frozen=True)
class _Group:
    """One attention group's rows (decode or prefill) in export/step.py's layout."""

    ids: np.ndarray
    positions: np.ndarray
    tokens: np.ndarray  # [B, S] packed index of each new token, left-padded
    mask: np.ndarray  # [B, S] real tokens
    rows: np.ndarray  # [B] rows of the block table
    context: np.ndarray  # [B] past tokens
    writes: np.ndarray
    order: np.ndarray
    last: np.ndarray

    def partitions(self, block_size: int, query_group: int, span: int | None = None) -> np.ndarray:
        """The group's split-K shape carrier; `span`: blocks per partition (None: the cost
        model's choice, engine/block_table.py)."""
        span = span or span_blocks(self.context, self.tokens.shape[1], block_size, query_group)
        return pair_carrier(self.context, span, block_size)


@dataclass
class StepBatch:
    inputs: StepInputs  # the step's inputs, block table and caches excepted (export/contract.py)
    table: BlockTable  # the block table the step reads (the runner passes or mirrors it)
    write_slots: np.ndarray  # [T] cache slot of each new token, in packed order
    work: list[Work]  # every sequence in the step, in packed order (decode group first, if any)
    sampled: list[Sequence]  # the R sequences whose next token comes back, in output order


def build_step(work: list[Work], blocks: BlockManager, random: RandomStreams | None = None,
               query_group: int = 1) -> StepBatch:
    """`random`: the engine's streams (a fresh unseeded one if None); `query_group`: query heads per
    kv head, for the choice of span (engine/block_table.py)."""
    single_group = len(work) == 1 or sum(w.new for w in work) <= SMALL_STEP_TOKENS
    decode = [w for w in work if w.new == 1]
    prefill = [w for w in work if w.new > 1]
    if single_group and prefill:  # rows of one token join the others in the prefill group
        decode, prefill = [], work
    d = _decode_group(decode, blocks)
    p = _prefill_group(prefill, blocks, len(decode)) if prefill else None
    if single_group and not prefill:  # the decode group, built without a per-row loop, is a prefill group of width 1
        d, p = _EMPTY, d
    p = p or _EMPTY
    ordered = decode + prefill if prefill else decode
    logit_tokens = np.concatenate([d.last, p.last])
    if all(w.samples and not w.draft for w in ordered):
        sampled = [w.seq for w in ordered]
    else:  # a draft row is sampled at each of its positions
        outputs = [1 + len(w.draft) for w in ordered]
        keep = np.repeat(np.fromiter((w.samples for w in ordered), bool, len(ordered)), outputs)
        logit_tokens = logit_tokens[keep]
        sampled = [w.seq for w, n in zip(ordered, outputs) if w.samples for _ in range(n)]
    size = blocks.block_size
    # A small step whose rows fit one span each without much waste runs, on the CPU, on the
    # single-group graph, whose partitions are its rows (engine/runner.py OnnxRunner)
    rows_span = single_span_blocks(p.context, size) if single_group else None
    prefill_pairs = p.partitions(size, query_group, rows_span)
    inputs = StepInputs(
        input_ids=np.concatenate([d.ids, p.ids]), position_ids=np.concatenate([d.positions, p.positions]),
        decode_tokens=d.tokens, decode_rows=d.rows, decode_context=d.context,
        decode_pairs=d.partitions(size, query_group),
        prefill_tokens=p.tokens, prefill_mask=p.mask, prefill_rows=p.rows, prefill_context=p.context,
        prefill_pairs=prefill_pairs, token_order=np.concatenate([d.order, p.order]), logit_tokens=logit_tokens,
        sampling=sampling_inputs(sampled, random or RandomStreams()), **_adapter_rows(ordered),
        single_group=single_group and not len(d.rows) and len(prefill_pairs) == len(p.rows))
    return StepBatch(inputs, blocks.table, np.concatenate([d.writes, p.writes]), ordered, sampled)


def _adapter_rows(ordered: list[Work]) -> dict[str, np.ndarray]:
    """The tokens of rows with an adapter, a group (a row of the array) per adapter in the step,
    padded to the largest group, with the padding's mask and each group's slot (export/adapters.py)."""
    slots = np.fromiter((w.seq.adapter_slot for w in ordered), np.int64, len(ordered))
    if not (slots >= 0).any():
        return {}
    per_token = np.repeat(slots, np.fromiter((w.new for w in ordered), np.int64, len(ordered)))
    tokens = np.flatnonzero(per_token >= 0)
    by_slot = np.argsort(per_token[tokens], kind="stable")
    index, counts = np.unique(per_token[tokens], return_counts=True)
    group, within = _runs(counts, np.cumsum(counts))
    grouped = np.zeros((len(index), int(counts.max())), np.int64)
    mask = np.zeros(grouped.shape, np.float32)
    grouped[group, within] = tokens[by_slot]
    mask[group, within] = 1.0
    return {"adapter_tokens": grouped, "adapter_mask": mask, "adapter_index": index}


def split_cost(config: EngineConfig) -> int:
    """The engine's split_step_cost: as configured, or (auto) SPLIT_STEP_COSTS for its device."""
    return config.split_step_cost or SPLIT_STEP_COSTS["cuda" if config.device.startswith("cuda") else "cpu"]


def split_step(work: list[Work], block_size: int, call_cost: int) -> list[list[Work]]:
    """The step's rows as one runner call, or as two when that costs less: the prefill group pads
    its rows to the widest, so a forced run's or a draft's few tokens beside a prompt chunk of a
    hundred would attend a hundred query positions over their whole past. A cut width c sends the
    rows up to c to a first call and the wider ones to a second; a prefill row of width w and past
    p then costs (p + c) x c keys x queries of attention instead of (p + W) x W (W the widest).
    The cut of most savings splits the step when they exceed `call_cost`. Rows are independent
    within a step, so the two calls give each row what one call would. O(rows), in numpy."""
    wider = {w.new for w in work if w.new > 1}
    if len(wider) < 2:
        return [work]  # the prefill group has rows of one width: nothing is padded
    news = np.fromiter((w.new for w in work), np.int64, len(work))
    widths = np.asarray(sorted(wider), np.int64)
    past = np.fromiter((w.seq.num_computed for w in work), np.int64, len(work))
    prefill = news > 1
    wide = int(widths[-1])
    cuts = widths[:-1, None]  # [K, 1]
    short = prefill[None, :] & (news[None, :] <= cuts)  # [K, rows]
    saved = np.where(short, (past + wide) * wide - (past[None, :] + cuts) * cuts, 0).sum(axis=1)
    best = int(np.argmax(saved))
    if saved[best] <= call_cost:
        return [work]
    cut = int(widths[best])
    return [[w for w in work if w.new <= cut], [w for w in work if w.new > cut]]


_NOTHING = np.zeros(0, np.int64)
_EMPTY = _Group(_NOTHING, _NOTHING, np.zeros((0, 1), np.int64), np.zeros((0, 1), bool), _NOTHING, _NOTHING,
                _NOTHING, _NOTHING, _NOTHING)


def _decode_group(decode: list[Work], blocks: BlockManager) -> _Group:
    """One row per sequence: its token, position, table row and past length, and its new token's slot."""
    n, size = len(decode), blocks.block_size
    if not n:
        return _EMPTY
    info = np.array([(w.seq.row, w.seq.num_computed, w.seq.token_at(w.seq.num_computed)) for w in decode], np.int64)
    rows, past, ids = info[:, 0], info[:, 1], info[:, 2]
    write = blocks.table.array[rows, past // size] * size + past % size
    order = np.arange(n)
    return _Group(ids, past, order[:, None], np.ones((n, 1), bool), rows, past, write, order, order)


def _prefill_group(prefill: list[Work], blocks: BlockManager, offset: int) -> _Group:
    """Rows of several new tokens: left-padded to the longest, in packed order. Built as array
    operations over the group's tokens (each row's token ids excepted), so a step of many forced
    runs or drafts costs what one row does."""
    n, size = len(prefill), blocks.block_size
    news = np.fromiter((w.new for w in prefill), np.int64, n)
    past = np.fromiter((w.seq.num_computed for w in prefill), np.int64, n)
    rows = np.fromiter((w.seq.row for w in prefill), np.int64, n)
    outputs = 1 + np.fromiter((len(w.draft) for w in prefill), np.int64, n)  # positions sampled: drafts + 1
    width, ends = int(news.max()), np.cumsum(news)
    row_of, within = _runs(news, ends)  # each new token's row, and its index within the row
    col = width - news[row_of] + within
    packed = offset + np.arange(int(ends[-1]))
    tokens = np.zeros((n, width), np.int64)
    mask = np.zeros((n, width), bool)
    tokens[row_of, col] = packed
    mask[row_of, col] = True
    fresh = past[row_of] + within
    writes = blocks.table.array[rows[row_of], fresh // size] * size + fresh % size
    ids = np.fromiter(chain.from_iterable(w.seq.pending_ids(w.new - len(w.draft)) + list(w.draft) for w in prefill),
                      np.int64, len(packed))
    last_row, last_within = _runs(outputs, np.cumsum(outputs))
    last = offset + ends[last_row] - outputs[last_row] + last_within
    return _Group(ids, fresh, tokens, mask, rows, past, writes, offset + row_of * width + col, last)


def _runs(lengths: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For runs of `lengths` laid end to end (`ends` their cumulative sum): each item's run, and
    its index within it."""
    run = np.repeat(np.arange(len(lengths)), lengths)
    return run, np.arange(int(ends[-1])) - (ends - lengths)[run]


_NO_SAMPLING = (np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.int64), np.zeros(0, np.float32),
                np.zeros(0, np.float32), np.zeros(0, np.float32))
_NO_ADJUSTMENTS = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.float32),
                   np.zeros(0, np.float32))


def sampling_inputs(seqs: list[Sequence], random: RandomStreams) -> SamplingInputs:
    """Per-row sampling values; each sampled row's uniform number from engine/randomness.py."""
    params = [s.params for s in seqs]
    ban = np.asarray([i for i, (s, p) in enumerate(zip(seqs, params))
                      if p.min_tokens and not p.ignore_eos and len(s.output_ids) < p.min_tokens], np.int64)
    special = [i for i, p in enumerate(params) if not p.plain]
    masks = step_masks(seqs, special)
    adjustments = _adjustments(seqs, params, special) if special else _NO_ADJUSTMENTS
    chosen = [i for i, p in enumerate(params) if not p.greedy or p.logprobs is not None]
    if not chosen:
        return SamplingInputs(ban, *_NO_SAMPLING, *masks, *adjustments)
    picked = [params[i] for i in chosen]
    uniform = random.uniforms([seqs[i] for i in chosen])
    return SamplingInputs(
        ban,
        np.asarray(chosen, np.int64),
        np.fromiter((p.temperature for p in picked), np.float32, len(picked)),
        np.fromiter((max(p.top_k, 0) for p in picked), np.int64, len(picked)),
        np.fromiter((p.top_p for p in picked), np.float32, len(picked)),
        uniform.astype(np.float32),
        np.fromiter((p.min_p for p in picked), np.float32, len(picked)),
        *masks,
        *adjustments,
    )


def _adjustments(seqs: list[Sequence], params: list[SamplingParams], special: list[int]) -> tuple[np.ndarray, ...]:
    """(row, token) entries for logit_bias and the penalties, for the rows that ask for them.

    vLLM's definitions: presence and frequency penalties count the generated tokens; the repetition
    penalty applies to every token seen (prompt and generated). The host folds each row's
    coefficients into per-entry values; the step scatters them onto the logits (export/sampler.py).
    """
    rows = [i for i in special if params[i].adjusts]
    if not rows:
        return _NO_ADJUSTMENTS
    parts = [_row_adjustments(i, seqs[i], params[i]) for i in rows]
    return tuple(np.concatenate(column) for column in zip(*parts))


def _row_adjustments(row: int, seq: Sequence, p: SamplingParams) -> tuple[np.ndarray, ...]:
    generated, counts = np.unique(np.asarray(seq.output_ids, np.int64), return_counts=True)
    seen = np.unique(np.asarray(seq.all_ids, np.int64)) if p.repetition_penalty != 1.0 else generated
    biased = np.fromiter((t for t, _ in p.logit_bias), np.int64, len(p.logit_bias))
    tokens = np.union1d(np.union1d(seen, generated), biased)
    count = np.zeros(len(tokens), np.float32)
    count[np.searchsorted(tokens, generated)] = counts
    bias = np.zeros(len(tokens), np.float32)
    bias[np.searchsorted(tokens, biased)] = [b for _, b in p.logit_bias]
    scale = np.where(np.isin(tokens, seen, assume_unique=True), p.repetition_penalty, 1.0).astype(np.float32)
    shift = (p.frequency_penalty * count + p.presence_penalty * (count > 0)).astype(np.float32)
    return np.full(len(tokens), row, np.int64), tokens, bias, scale, shift
