"""Always-on verification of the exported step against the Hugging Face model's own forward.

The reference is HF's eager forward on each row's real, unpadded tokens; our step sees the same
rows padded into one batch, with past keys/values taken from HF's own cache. Comparing logits
and the new keys/values checks the math, the padding/mask logic and the cache convention at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

TOLERANCE = 1e-4
CASES = [(batch, past) for batch in (1, 3, 8) for past in (0, 17, 100)]
NEW_TOKENS = 5
GREEDY_TOKENS = 32
GREEDY_PROMPTS = ("def ", "import os\n", "class Parser:\n    def __init__(self")

StepFn = Callable[..., tuple[np.ndarray, np.ndarray, np.ndarray]]


class VerificationError(RuntimeError):
    """The exported step does not reproduce the HF model; the artifacts must not be served."""


@dataclass
class CaseResult:
    batch: int
    past: int
    padded: bool
    max_diff: dict[str, float]  # runtime -> max |Δlogits| (and Δkv) against HF


@dataclass
class Case:
    """A padded batch: row i has `past_lens[i]` cached and `new_lens[i]` new tokens."""

    feeds: dict[str, np.ndarray]
    ref_logits: np.ndarray
    ref_new_kv: list[tuple[np.ndarray, np.ndarray]]  # per row: [L, H, s, D] keys/values of its new tokens
    new_lens: list[int]


def make_case(hf_model, batch: int, past: int, rng: np.random.Generator) -> Case:
    """Rows of different lengths; their cached K/V (from HF's own cache) sit at shuffled cache
    slots among garbage slots, so the test also covers the slot indirection and the masks."""
    cfg = hf_model.config
    layers, heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    head_dim = hf_model.model.layers[0].self_attn.head_dim
    past_lens = [past - (i * 7) % (past + 1) for i in range(batch)]
    new_lens = [max(1, NEW_TOKENS - i % 3) for i in range(batch)]
    num_slots = sum(past_lens) + 11
    order = rng.permutation(num_slots)
    key_cache = rng.standard_normal((layers, heads, num_slots, head_dim)).astype(np.float32)
    value_cache = rng.standard_normal((layers, heads, num_slots, head_dim)).astype(np.float32)
    ids = np.zeros((batch, NEW_TOKENS), np.int64)
    pos = np.zeros((batch, NEW_TOKENS), np.int64)
    mask = np.zeros((batch, past + NEW_TOKENS), bool)
    past_slots = np.full((batch, past), num_slots - 1, np.int64)  # padding points at a garbage slot
    ref_logits, ref_kv, used = [], [], 0
    for i, (p, s) in enumerate(zip(past_lens, new_lens)):
        row = torch.from_numpy(rng.integers(0, cfg.vocab_size, size=p + s))
        with torch.no_grad():
            full = hf_model(input_ids=row[None], use_cache=True)
        ref_logits.append(full.logits[0, -1].float().numpy())
        keys = np.stack([layer.keys[0].float().numpy() for layer in full.past_key_values.layers])  # [L,H,T,D]
        values = np.stack([layer.values[0].float().numpy() for layer in full.past_key_values.layers])
        slots = order[used : used + p]
        used += p
        key_cache[:, :, slots] = keys[:, :, :p]
        value_cache[:, :, slots] = values[:, :, :p]
        past_slots[i, :p] = slots
        ref_kv.append((keys[:, :, p:], values[:, :, p:]))
        ids[i, NEW_TOKENS - s :] = row[p:].numpy()
        pos[i, NEW_TOKENS - s :] = np.arange(p, p + s)
        mask[i, :p] = True
        mask[i, past + NEW_TOKENS - s :] = True
    feeds = {"input_ids": ids, "position_ids": pos, "attention_mask": mask, "past_slots": past_slots,
             "key_cache": key_cache, "value_cache": value_cache}
    return Case(feeds, np.stack(ref_logits), ref_kv, new_lens)


def case_error(case: Case, run: StepFn) -> float:
    logits, new_k, new_v = run(**case.feeds)
    err = float(np.abs(logits - case.ref_logits).max())
    for i, s in enumerate(case.new_lens):
        ref_k, ref_v = case.ref_new_kv[i]
        err = max(err, float(np.abs(new_k[:, :, i, -s:] - ref_k).max()),
                  float(np.abs(new_v[:, :, i, -s:] - ref_v).max()))
    return err


def verify_logits(hf_model, runtimes: dict[str, StepFn], seed: int = 0) -> list[CaseResult]:
    rng = np.random.default_rng(seed)
    results = []
    for batch, past in CASES:
        case = make_case(hf_model, batch, past, rng)
        diffs = {name: case_error(case, run) for name, run in runtimes.items()}
        results.append(CaseResult(batch, past, batch > 1, diffs))
    return results


def greedy_with_step(
    run: StepFn, prompt_ids: list[int], new_tokens: int, kv_shape: tuple[int, ...], suppress: list[int]
) -> list[int]:
    """Plain greedy loop over the step: one prefill, then one token per call.

    `suppress` (the EOS ids) is masked as HF's `min_new_tokens` does, so both run full length.
    """
    layers, heads, head_dim = kv_shape
    total = len(prompt_ids) + new_tokens
    key_cache = np.zeros((layers, heads, total, head_dim), np.float32)
    value_cache = np.zeros_like(key_cache)
    out: list[int] = []
    feed, n_past = list(prompt_ids), 0
    for _ in range(new_tokens):
        s = len(feed)
        logits, k, v = run(
            input_ids=np.asarray([feed], np.int64),
            position_ids=np.arange(n_past, n_past + s, dtype=np.int64)[None],
            attention_mask=np.ones((1, n_past + s), bool),
            past_slots=np.arange(n_past, dtype=np.int64)[None],
            key_cache=key_cache,
            value_cache=value_cache,
        )
        key_cache[:, :, n_past : n_past + s] = k[:, :, 0]
        value_cache[:, :, n_past : n_past + s] = v[:, :, 0]
        n_past += s
        scores = logits[0].copy()
        scores[suppress] = -np.inf
        token = int(np.argmax(scores))
        out.append(token)
        feed = [token]
    return out


def verify_greedy(
    hf_model, encode: Callable[[str], list[int]], eos_ids: list[int], runtimes: dict[str, StepFn]
) -> dict[str, dict[str, bool]]:
    """HF `generate` (greedy, EOS ignored) vs our step loop, token for token, per prompt."""
    cfg = hf_model.config
    kv_shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, hf_model.model.layers[0].self_attn.head_dim)
    results: dict[str, dict[str, bool]] = {}
    for prompt in GREEDY_PROMPTS:
        ids = encode(prompt)
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS,
                do_sample=False, eos_token_id=eos_ids or None, pad_token_id=(eos_ids or [0])[0],
            )[0, len(ids) :].tolist()
        results[prompt] = {name: greedy_with_step(run, ids, GREEDY_TOKENS, kv_shape, eos_ids) == ref
                           for name, run in runtimes.items()}
    return results
