"""Always-on verification of the exported step against the Hugging Face model's own forward.

The reference is HF's eager forward on each row's real, unpadded tokens; our step sees the same
rows packed into one iteration (decode and prefill rows mixed, in shuffled order), with past
keys/values taken from HF's own cache and placed at shuffled cache slots among garbage ones.
Comparing logits and the new keys/values checks the math, the packing and masks and the cache
convention at once. The sampling outputs are checked too: greedy rows must give exactly the argmax
of the runtime's logits, sampled rows the token an independent, sort-based reference sampler
picks from the same logits with the same random number (a draw that lands within a rounding
error of a boundary between two tokens may go either way: a near-tie, counted apart).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from batchstring.engine.block_table import BlockTable, pair_carrier, span_blocks
from batchstring.export.contract import Held, SamplingInputs, StepInputs
from batchstring.export.sampler import CANDIDATES

HF_16BIT = "HF itself"  # the 16-bit HF forward, measured against the float32 truth as the runtimes are
# float32: absolute max |Δ|. 16 bits: relative, |Δ| / max(1, |ref|): a few rounding steps
# (float16 step 2^-10 ~ 1e-3, bfloat16 2^-7 ~ 8e-3, both relative).
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}
CASES = [(batch, past) for batch in (1, 3, 8) for past in (0, 17, 100)]
CASE_BLOCK_SIZE = 4  # small blocks: every case's rows cross many block and span boundaries
CASE_SPANS = (2, 3)  # blocks per pair, decode and prefill group: a past of 100 makes 13 and 9 pairs
NEW_TOKENS = 5
GREEDY_TOKENS = 32
GREEDY_PROMPTS = ("def ", "import os\n", "class Parser:\n    def __init__(self")
NEAR_TIE = 1e-4  # a draw this close (relative to the total mass) to a token boundary is a near-tie

StepFn = Callable[[StepInputs, Held], tuple[np.ndarray, ...]]  # a runtime's step on host arrays


class VerificationError(RuntimeError):
    """The exported step does not reproduce the HF model; the artifacts must not be served."""


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    ban_eos: bool = False
    uniform: float = 1.0


@dataclass
class Row:
    """One sequence in a step: its new tokens on top of `past` cached tokens, the i-th of which is
    in cache block `blocks[i // block_size]` at offset `i % block_size`."""

    new_ids: list[int]
    blocks: list[int]
    past: int
    sampling: Sampling = field(default_factory=Sampling)


class SingleGroup:
    """A step that reads every row from the prefill group (export/step.py `single_group`)."""

    def __init__(self, run: StepFn) -> None:
        self.run = run

    def __call__(self, inputs: StepInputs, held: Held) -> tuple[np.ndarray, ...]:
        return self.run(inputs, held)


def pack(rows: list[Row], key_cache: np.ndarray, value_cache: np.ndarray, single_group: bool = False,
         spans: tuple[int | None, int | None] = (None, None),
         sites: dict[str, tuple[int, int]] | None = None) -> tuple[StepInputs, Held]:
    """The step's inputs for `rows`, packed in the given order (see export/contract.py); with
    `single_group`, every row in the prefill group with one span as long as the longest row, as
    the engine packs a small step for the single-group graph. `spans`: blocks per pair of the
    decode and the prefill group (None: the engine's cost model). `sites`: the step's adapter
    sites, for empty adapter weights (None: the runtime adds them)."""
    block_size = key_cache.shape[3]
    decode = [] if single_group else [i for i, r in enumerate(rows) if len(r.new_ids) == 1]
    prefill = [i for i, r in enumerate(rows) if i not in decode]
    # at least as wide as a span: a span that runs past its row's last column reads the next row (masked)
    table = BlockTable(len(rows), max([len(r.blocks) for r in rows] + [span or 1 for span in spans]))
    for i, r in enumerate(rows):
        table.write(i, 0, list(r.blocks))
    starts = np.cumsum([0] + [len(r.new_ids) for r in rows])
    width = max([len(rows[i].new_ids) for i in prefill], default=1)
    order = np.zeros(starts[-1], np.int64)
    order[starts[decode]] = np.arange(len(decode))
    pre_tokens = np.zeros((len(prefill), width), np.int64)
    pre_mask = np.zeros((len(prefill), width), bool)
    for j, i in enumerate(prefill):
        n = len(rows[i].new_ids)
        pre_tokens[j, width - n :] = np.arange(starts[i], starts[i] + n)
        pre_mask[j, width - n :] = True
        order[starts[i] : starts[i] + n] = len(decode) + j * width + np.arange(width - n, width)
    groups = []
    for members, queries, span in ((decode, 1, spans[0]), (prefill, width, spans[1])):
        context = np.array([rows[i].past for i in members], np.int64)
        if single_group:
            span = max([-(-rows[i].past // block_size) for i in members] + [1])
        span = span or span_blocks(context, queries, block_size, 1)
        groups.append((np.array(members, np.int64), context, pair_carrier(context, span, block_size)))
    (decode_rows, decode_context, decode_pairs), (prefill_rows, prefill_context, prefill_pairs) = groups
    sampled = [i for i, r in enumerate(rows) if r.sampling.temperature > 0 or r.sampling.top_k or r.sampling.top_p < 1]
    s = [rows[i].sampling for i in sampled]
    sampling = SamplingInputs.plain(
        ban_rows=np.array([i for i, r in enumerate(rows) if r.sampling.ban_eos], np.int64),
        sample_rows=np.array(sampled, np.int64),
        temperature=np.array([x.temperature for x in s], np.float32),
        top_k=np.array([x.top_k for x in s], np.int64),
        top_p=np.array([x.top_p for x in s], np.float32),
        uniform=np.array([x.uniform for x in s], np.float32))
    inputs = StepInputs(
        input_ids=np.concatenate([r.new_ids for r in rows]).astype(np.int64),
        position_ids=np.concatenate([np.arange(r.past, r.past + len(r.new_ids)) for r in rows]),
        decode_tokens=starts[decode][:, None].astype(np.int64), decode_rows=decode_rows,
        decode_context=decode_context, decode_pairs=decode_pairs, prefill_tokens=pre_tokens, prefill_mask=pre_mask,
        prefill_rows=prefill_rows, prefill_context=prefill_context, prefill_pairs=prefill_pairs,
        token_order=order, logit_tokens=starts[1:] - 1, sampling=sampling, single_group=single_group)
    held = Held(table.array, key_cache, value_cache)
    if sites is not None:
        held = held.without_adapters(sites, lambda shape: np.zeros(shape, key_cache.dtype))
    return inputs, held


def place(cache: np.ndarray, blocks: list[int], start: int, values: np.ndarray) -> None:
    """Writes `values` [L, H, n, D] as tokens start.. of a row whose tokens live in `blocks`."""
    block_size = cache.shape[3]
    positions = np.arange(start, start + values.shape[2])
    cache[:, :, np.asarray(blocks, np.int64)[positions // block_size], positions % block_size] = values


def read(cache: np.ndarray, blocks: list[int], count: int) -> np.ndarray:
    """The first `count` tokens [L, H, count, D] of a row whose tokens live in `blocks`."""
    positions = np.arange(count)
    return cache[:, :, np.asarray(blocks, np.int64)[positions // cache.shape[3]], positions % cache.shape[3]]


# ----- the reference sampler -------------------------------------------------------------------


def reference_sample(logits: np.ndarray, s: Sampling, eos_ids: list[int],
                     candidates: int = CANDIDATES) -> tuple[int, float]:
    """What the step's sampler must pick, by the definition in export/sampler.py, written the
    obvious way (a full sort, float64). Returns (token, margin): the margin is how far the draw
    was from the nearest token boundary, relative to the total mass (small = near-tie)."""
    x = logits.astype(np.float64).copy()
    if s.ban_eos:
        x[[e for e in eos_ids if e < x.size]] = -np.inf
    if s.temperature == 0:
        return int(np.argmax(x)), 1.0
    weights = np.exp((x - x.max()) / s.temperature)
    restricted = s.top_k > 0 or s.top_p < 1
    if not restricted:  # inverse CDF over the whole vocabulary, in vocabulary order
        order = np.arange(x.size)
    else:  # top_k, then top_p over the renormalised top_k, among the `candidates` most likely
        order = np.argsort(-x, kind="stable")[: min(candidates, x.size)]
        k = min(s.top_k, order.size) if s.top_k > 0 else order.size
        kept = weights[order[:k]]
        mass = kept.sum() if s.top_k > 0 else weights.sum()
        before = np.cumsum(kept) - kept
        order = order[:k][before < s.top_p * mass]
    w = weights[order]
    cumulative = np.cumsum(w)
    target = s.uniform * cumulative[-1]
    index = int(min(np.searchsorted(cumulative, target, side="left"), order.size - 1))
    lower = cumulative[index - 1] if index else 0.0
    margin = min(target - lower, cumulative[index] - target) / cumulative[-1]
    return int(order[index]), float(margin)


# ----- logits and new K/V ----------------------------------------------------------------------


@dataclass
class CaseResult:
    batch: int
    past: int
    max_diff: dict[str, float]  # runtime -> max |Δlogits| (and Δkv) against HF
    sampled: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # runtime -> (checked, equal, near-ties)


@dataclass
class Case:
    inputs: StepInputs
    held: Held
    rows: list[Row]
    ref_logits: np.ndarray
    ref_new_kv: list[tuple[np.ndarray, np.ndarray]]  # per row: [L, H, s, D] keys/values of its new tokens


def _sampling_for(i: int, rng: np.random.Generator) -> Sampling:
    """Every kind of row: greedy, greedy with EOS banned, temperature, top_k, top_p, both."""
    kinds = [Sampling(), Sampling(ban_eos=True), Sampling(temperature=0.8), Sampling(temperature=1.0, top_k=5),
             Sampling(temperature=1.0, top_p=0.9), Sampling(temperature=0.7, top_k=40, top_p=0.95, ban_eos=True),
             Sampling(temperature=1.3), Sampling(temperature=1.0, top_k=1000)]
    base = kinds[i % len(kinds)]
    return Sampling(base.temperature, base.top_k, base.top_p, base.ban_eos, float(1.0 - rng.random()))


def make_case(hf_model, batch: int, past: int, rng: np.random.Generator,
              block_size: int = CASE_BLOCK_SIZE) -> Case:
    """Rows of different past and new lengths (decode rows among prefill rows, shuffled), their
    cached K/V (from HF's own cache) in shuffled cache blocks among garbage blocks. `hf_model` is
    the reference: the checkpoint in float32."""
    from transformers import DynamicCache

    cfg = hf_model.config
    layers, heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    head_dim = hf_model.model.layers[0].self_attn.head_dim
    device = hf_model.device
    past_lens = [past - (i * 7) % (past + 1) for i in range(batch)]
    new_lens = [max(1, NEW_TOKENS - i % 5) for i in range(batch)]  # 5, 4, 3, 2, 1, ...
    num_blocks = sum(-(-p // block_size) for p in past_lens) + 3
    order = rng.permutation(num_blocks)
    shape = (layers, heads, num_blocks, block_size, head_dim)
    key_cache = rng.standard_normal(shape).astype(np.float32)
    value_cache = rng.standard_normal(shape).astype(np.float32)
    rows, ref_logits, ref_kv, used = [], [], [], 0
    for i, (p, s) in enumerate(zip(past_lens, new_lens)):
        ids = torch.from_numpy(rng.integers(0, cfg.vocab_size, size=p + s))
        with torch.no_grad():  # a plain cache keeps every token, also of sliding-window layers
            full = hf_model(input_ids=ids[None].to(device), past_key_values=DynamicCache(), use_cache=True)
        ref_logits.append(_numpy(full.logits[0, -1]))
        keys = np.stack([_numpy(layer.keys[0]) for layer in full.past_key_values.layers])  # [L,H,T,D]
        values = np.stack([_numpy(layer.values[0]) for layer in full.past_key_values.layers])
        blocks = order[used : used + -(-p // block_size)].tolist()
        used += len(blocks)
        place(key_cache, blocks, 0, keys[:, :, :p])
        place(value_cache, blocks, 0, values[:, :, :p])
        rows.append(Row(ids[p:].tolist(), blocks, p, _sampling_for(i, rng)))
        ref_kv.append((keys[:, :, p:], values[:, :, p:]))
    shuffle = rng.permutation(batch)  # packed order is the engine's choice, not group order
    rows = [rows[i] for i in shuffle]
    inputs, held = pack(rows, key_cache, value_cache, spans=CASE_SPANS)
    return Case(inputs, held, rows, np.stack(ref_logits)[shuffle], [ref_kv[i] for i in shuffle])


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.float().cpu().numpy()


def case_error(case: Case, outputs: tuple[np.ndarray, ...], relative: bool = False) -> float:
    """Max |Δ| over logits and new K/V; `relative`: |Δ| / max(1, |reference|), the measure for
    16-bit runs, whose rounding step grows with the magnitude (one bfloat16 step at 10 is 0.06)."""
    def err(got: np.ndarray, ref: np.ndarray) -> float:
        diff = np.abs(got - ref)
        return float((diff / np.maximum(1.0, np.abs(ref)) if relative else diff).max())

    *_, logits, new_k, new_v = outputs
    worst = err(logits, case.ref_logits[:, : logits.shape[1]])
    start = 0
    for i, row in enumerate(case.rows):
        ref_k, ref_v = case.ref_new_kv[i]
        end = start + len(row.new_ids)
        worst = max(worst, err(new_k[:, :, start:end], ref_k), err(new_v[:, :, start:end], ref_v))
        start = end
    return worst


def hf_outputs(hf_model, case: Case) -> tuple:
    """HF's own forward (in its dtype) on a case's rows, shaped as the step's outputs that
    `case_error` reads: each row's last-token logits, and the K/V of its new tokens."""
    from transformers import DynamicCache

    logits, new_k, new_v = [], [], []
    device = hf_model.device
    for row in case.rows:
        cache = DynamicCache()
        for layer in range(case.held.key_cache.shape[0]):
            past = (read(cache, row.blocks, row.past)[layer][None] for cache in (case.held.key_cache,
                                                                                 case.held.value_cache))
            cache.update(*(torch.from_numpy(np.ascontiguousarray(t)).to(device, hf_model.dtype) for t in past), layer)
        with torch.no_grad():
            out = hf_model(input_ids=torch.tensor([row.new_ids], device=device), past_key_values=cache, use_cache=True,
                           position_ids=torch.arange(row.past, row.past + len(row.new_ids), device=device)[None])
        n = len(row.new_ids)
        logits.append(_numpy(out.logits[0, -1]))
        new_k.append(np.stack([_numpy(lay.keys[0, :, -n:]) for lay in out.past_key_values.layers]))
        new_v.append(np.stack([_numpy(lay.values[0, :, -n:]) for lay in out.past_key_values.layers]))
    return None, None, None, None, np.stack(logits), np.concatenate(new_k, 2), np.concatenate(new_v, 2)


def sampling_agreement(case: Case, outputs: tuple[np.ndarray, ...], eos_ids: list[int]) -> tuple[int, int, int]:
    """(rows checked, rows equal to the reference sampler, near-ties among the others)."""
    next_tokens, logits = outputs[0], outputs[4]
    equal = ties = 0
    for i, row in enumerate(case.rows):
        token, margin = reference_sample(logits[i], row.sampling, eos_ids)
        if token == int(next_tokens[i]):
            equal += 1
        elif margin < NEAR_TIE:
            ties += 1
    return len(case.rows), equal, ties


def verify_logits(hf_model, runtimes: dict[str, StepFn], eos_ids: list[int], seed: int = 0,
                  relative: bool = False, hf_16bit=None, cases: list[tuple[int, int]] = CASES) -> list[CaseResult]:
    """Each runtime's error against `hf_model`. With `hf_16bit` (the same checkpoint in the
    export's 16-bit dtype, `hf_model` then being its float32 truth), HF's own 16-bit forward is
    measured the same way and reported beside the runtimes, as the yardstick for theirs. The
    HF models run where they are (any device); the runtimes take and return host arrays."""
    rng = np.random.default_rng(seed)
    results = []
    for batch, past in cases:
        case = make_case(hf_model, batch, past, rng)
        single = pack(case.rows, case.held.key_cache, case.held.value_cache, single_group=True)
        outputs = {name: run(*(single if isinstance(run, SingleGroup) else (case.inputs, case.held)))
                   for name, run in runtimes.items()}
        errors = {n: case_error(case, o, relative) for n, o in outputs.items()}
        for name, run in runtimes.items():  # a two-group step takes a small step's packing too
            if not isinstance(run, SingleGroup):
                errors[name] = float(np.max([errors[name], case_error(case, run(*single), relative)]))  # NaN stays
        if hf_16bit is not None:
            errors[HF_16BIT] = case_error(case, hf_outputs(hf_16bit, case), relative)
        results.append(CaseResult(batch, past, errors,
                                  {n: sampling_agreement(case, o, eos_ids) for n, o in outputs.items()}))
    return results


# ----- greedy generation -----------------------------------------------------------------------


def greedy_with_step(run: StepFn, prompt_ids: list[int], new_tokens: int, kv_shape: tuple[int, ...],
                     eos_ids: list[int], dtype: np.dtype, block_size: int = CASE_BLOCK_SIZE) -> list[int]:
    """Plain greedy loop over the step: one prefill row, then one decode row per token, with the
    EOS ids banned (as HF's `min_new_tokens` does) so that both run full length; the row's blocks
    are scattered over the cache in reverse order."""
    return [token for token, _ in _greedy_loop(run, prompt_ids, new_tokens, kv_shape, eos_ids, dtype, block_size)]


def step_greedy_reference(run: StepFn, prompt_ids: list[int], new_tokens: int, kv_shape: tuple[int, ...],
                          eos_ids: list[int], dtype: np.dtype, tie: float = 2 * TOLERANCE["float32"],
                          block_size: int = CASE_BLOCK_SIZE) -> GreedyReference:
    """A step's own greedy tokens as the judge of another step (a quantized graph against the one
    it was made from), with the first near-tie of its logits, as `greedy_references` has HF's."""
    tokens, first_tie, runner_up = [], None, None
    for k, (token, logits) in enumerate(_greedy_loop(run, prompt_ids, new_tokens, kv_shape, eos_ids, dtype,
                                                     block_size)):
        tokens.append(token)
        if first_tie is None:
            allowed = logits.astype(np.float64)
            allowed[[i for i in eos_ids if i < len(allowed)]] = -np.inf
            second, best = np.argsort(allowed)[-2:]
            if allowed[best] - allowed[second] < tie:
                first_tie, runner_up = k, int(second if best == token else best)
    return GreedyReference(list(prompt_ids), tokens, first_tie, runner_up)


def _greedy_loop(run: StepFn, prompt_ids: list[int], new_tokens: int, kv_shape: tuple[int, ...],
                 eos_ids: list[int], dtype: np.dtype, block_size: int) -> Iterator[tuple[int, np.ndarray]]:
    """Each greedy token (EOS banned) with the logits it was chosen from."""
    layers, heads, head_dim = kv_shape
    num_blocks = -(-(len(prompt_ids) + new_tokens) // block_size)
    blocks = list(range(num_blocks - 1, -1, -1))
    key_cache = np.zeros((layers, heads, num_blocks, block_size, head_dim), dtype)
    value_cache = np.zeros_like(key_cache)
    out: list[int] = []
    feed = list(prompt_ids)
    for _ in range(new_tokens):
        n_past = len(prompt_ids) + len(out) - len(feed)
        row = Row(feed, blocks, n_past, Sampling(ban_eos=True))
        next_tokens, _, _, _, logits, k, v = run(*pack([row], key_cache, value_cache, isinstance(run, SingleGroup)))
        place(key_cache, blocks, n_past, k)
        place(value_cache, blocks, n_past, v)
        out.append(int(next_tokens[0]))
        yield out[-1], logits[0]
        feed = [out[-1]]


@dataclass
class GreedyReference:
    """HF `generate`'s greedy tokens for one prompt, and where they stop being a judge: the first
    position whose top two logits are closer than the runtimes may differ from HF (None: none).
    There either token is right, and one flipped tie changes the rest of the continuation: random
    weights over a large vocabulary make such near-ties common (a random 128k-vocabulary model
    has them within a few tokens)."""

    prompt_ids: list[int]
    tokens: list[int]
    first_tie: int | None
    runner_up: int | None  # HF's second choice at first_tie

    def agrees(self, got: list[int]) -> bool:
        """Equal up to the first near-tie, and one of HF's top two there."""
        if self.first_tie is None:
            return got == self.tokens
        k = self.first_tie
        return got[:k] == self.tokens[:k] and got[k] in (self.tokens[k], self.runner_up)


def greedy_references(hf_model, encode: Callable[[str], list[int]], eos_ids: list[int],
                      prompts: tuple[str, ...] = GREEDY_PROMPTS, new_tokens: int = GREEDY_TOKENS,
                      tie: float = 2 * TOLERANCE["float32"],
                      vocabulary: tuple[int, list[int]] | None = None) -> dict[str, GreedyReference]:
    """HF `generate` (greedy, EOS banned as `min_new_tokens` does) per prompt, with its near-ties.
    `vocabulary`: (ids below this, less these) are the ones the step samples from (the tokenizer's,
    `DecoderStep`'s vocab_size and never_ids); HF chooses among the same, not among an embedding's
    padding rows that no text has."""
    from transformers import LogitsProcessorList

    processors = LogitsProcessorList([StepVocabulary(*vocabulary)] if vocabulary else [])
    references = {}
    for prompt in prompts:
        ids = encode(prompt)
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([ids], device=hf_model.device), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, eos_token_id=eos_ids or None, pad_token_id=(eos_ids or [0])[0],
                logits_processor=processors,
                output_scores=True, return_dict_in_generate=True)  # scores: EOS banned, as the step bans it
        tokens = out.sequences[0, len(ids):].tolist()
        first_tie = runner_up = None
        for k, logits in enumerate(out.scores):
            top = torch.topk(logits[0].float(), 2)
            if float(top.values[0] - top.values[1]) < tie:
                first_tie, runner_up = k, int(top.indices[1] if int(top.indices[0]) == tokens[k] else top.indices[0])
                break
        references[prompt] = GreedyReference(ids, tokens, first_tie, runner_up)
    return references


class StepVocabulary:
    """A logits processor for HF `generate`: ids the step never samples (past `end`, or `never`)
    get -inf, so HF's greedy choice is made among the step's ids."""

    def __init__(self, end: int, never: list[int]) -> None:
        self.end, self.never = end, torch.tensor(never, dtype=torch.long)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores[:, self.end :] = float("-inf")
        scores[:, self.never.to(scores.device)] = float("-inf")
        return scores


def verify_greedy(hf_model, encode: Callable[[str], list[int]], eos_ids: list[int], runtimes: dict[str, StepFn],
                  cache_dtype: np.dtype = np.float32, prompts: tuple[str, ...] = GREEDY_PROMPTS,
                  new_tokens: int = GREEDY_TOKENS, references: dict[str, GreedyReference] | None = None,
                  vocabulary: tuple[int, list[int]] | None = None) -> dict[str, dict[str, bool]]:
    """Our step loop against HF `generate`, token for token up to the first near-tie, per prompt."""
    cfg = hf_model.config
    kv_shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, hf_model.model.layers[0].self_attn.head_dim)
    references = references or greedy_references(hf_model, encode, eos_ids, prompts, new_tokens,
                                                 vocabulary=vocabulary)
    return {prompt: {name: ref.agrees(greedy_with_step(run, ref.prompt_ids, len(ref.tokens), kv_shape, eos_ids,
                                                       cache_dtype))
                     for name, run in runtimes.items()}
            for prompt, ref in references.items()}


# ----- the tolerance rule ----------------------------------------------------------------------


def limit(case: CaseResult, dtype: str) -> float:
    """float32: an absolute TOLERANCE. 16 bits: twice what HF's own forward in that dtype is off
    from the float32 truth in the same case, and at least the dtype's TOLERANCE."""
    floor = TOLERANCE[dtype]
    return floor if dtype == "float32" else max(floor, 2 * case.max_diff[HF_16BIT])


def tolerance_failures(cases: list[CaseResult], dtype: str) -> list[str]:
    """Every runtime and case past its limit (NaN fails too), in words."""
    measure = "max |Δ|" if dtype == "float32" else "max |Δ|/max(1,|truth|)"
    return [f"{name}: {measure} {c.max_diff[name]:.2e} at {c.batch} rows, past {c.past} (limit {limit(c, dtype):.2e})"
            for c in cases for name in c.max_diff if name != HF_16BIT and not c.max_diff[name] <= limit(c, dtype)]
