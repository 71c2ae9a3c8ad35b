"""The sampling head of the exported step: next token per row, chosen inside the graph.

The engine never sees vocabulary-sized tensors: the step turns each row's logits into one token
id and its log-probability (plus the top-n log-probabilities for rows that ask), so on a GPU the
logits never leave the device and on a CPU the work runs in the runtime's threads.

The host names the rows whose end-of-sequence ids are banned (`min_tokens` not reached) and the
rows that sample or want log-probabilities; for those it supplies temperature (0 = greedy), top_k
(0 = off), top_p, min_p (0 = off) and one uniform number in (0, 1] drawn from the request's own
generator. Two sparse inputs change logits before any choice, for greedy and sampled rows alike,
and cost nothing for rows they do not name:
- adjustments, one entry per (row, token) that has one: `adjust_bias` is added (logit_bias), then
  `adjust_scale` divides a positive logit and multiplies a negative one (repetition penalty, 1 =
  none), then `adjust_shift` is subtracted (frequency * count + presence, folded by the host);
- grammar masks: `token_mask` holds one packed bitmask per row of `mask_rows` (int32 words, bit
  b of word w allows token 32 * w + b, llguidance's layout); tokens it does not allow get -inf.
Everything else is per-row arithmetic, so a seeded request gets the same tokens whatever its
batch-mates. Vocabulary-sized work beyond the argmax is done only for the rows that need it: a
greedy row that asks for nothing costs one argmax.

Exactness (no full sort of the vocabulary anywhere):
- greedy rows: exactly the argmax of the logits (first index on ties, as numpy's argmax);
- temperature only (top_k off, top_p = 1): exact inverse-CDF sampling over the whole vocabulary,
  in vocabulary order, done in two levels (blocks of `BLOCK` tokens, then within the block) so it
  needs only reductions over the vocabulary and cumulative sums over short rows;
- top_k and top_p: the candidates are the `candidates` most likely tokens (one TopK, sorted), and
  top_p is applied over them as vLLM applies it (after top_k, renormalised); the draw is an
  inverse CDF over the kept candidates in descending order. Exact when top_k <= candidates and the
  nucleus fits in the candidates; otherwise the kept set is cut at the candidates (top_k larger
  than `candidates` behaves as top_k = candidates).
"""

from __future__ import annotations

import torch
from torch import nn

CANDIDATES = 64  # most likely tokens considered for top_k / top_p
TOP_LOGPROBS = 20  # top-n log-probabilities a request may ask for (vLLM's default max_logprobs)
BLOCK = 256  # tokens per block of the two-level inverse CDF


class SamplingHead(nn.Module):
    def __init__(self, vocab_size: int, eos_ids: list[int], never_ids: list[int] = (),
                 candidates: int = CANDIDATES, branches: bool = True) -> None:
        super().__init__()
        self.branches = branches
        self.vocab_size = vocab_size
        self.candidates = min(candidates, vocab_size)
        self.top_n = min(TOP_LOGPROBS, self.candidates)
        self.blocks = -(-vocab_size // BLOCK)
        self.register_buffer("eos_mask", _mask(vocab_size, eos_ids), persistent=False)
        # a buffer, not an arange in forward: it moves with the weights (see export/step.py)
        self.register_buffer("rank", torch.arange(self.candidates)[None, :], persistent=False)
        # ids the tokenizer does not have, inside the vocabulary (those past its end are cut off)
        self.register_buffer("never_mask", _mask(vocab_size, never_ids) if never_ids else None, persistent=False)
        bits = torch.tensor([1 << b for b in range(31)] + [-(1 << 31)], dtype=torch.int32)
        self.register_buffer("bits", bits[None, None, :], persistent=False)  # bit b of an int32 word

    def forward(self, logits: torch.Tensor, ban_rows: torch.Tensor, sample_rows: torch.Tensor,
                *rest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`_choose`, or an argmax when no row samples, wants log-probabilities or has a logit
        adjustment: a greedy step skips the head's ~130 operators, and one whose rows follow a
        grammar or have EOS banned (`_greedy`) applies those first, in a dozen more. Exported
        (torch.export, ONNX) these are `If`s on the inputs' shapes; a TorchScript trace records no
        control flow, so it keeps the whole head, which gives the same tokens. Without `branches`
        the export keeps it too: torch 2.13's ONNX exporter cannot put an `If` after operators
        whose output sizes depend on data (a mixture's routing, export/mixture.py)."""
        adjust_rows = rest[7]  # in `_choose`'s order
        operands = (logits, ban_rows, sample_rows, *rest)
        if torch.jit.is_tracing() or (torch.compiler.is_exporting() and not self.branches):
            return self._choose(*operands)
        greedy = sample_rows.shape[0] + adjust_rows.shape[0] == 0
        if not torch.compiler.is_exporting():
            return (self._greedy if greedy else self._choose)(*operands)
        return torch.cond(greedy, self._greedy, self._choose, operands)

    def _greedy(self, *operands: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Greedy rows only: the plain argmax, or (some rows with EOS banned or a grammar's mask)
        the argmax of what each row allows."""
        ban_rows, mask_rows = operands[1], operands[8]
        plain = ban_rows.shape[0] + mask_rows.shape[0] == 0
        if not torch.compiler.is_exporting():
            return (self._argmax if plain else self._allowed_argmax)(*operands)
        return torch.cond(plain, self._argmax, self._allowed_argmax, operands)

    def _allowed_argmax(self, logits: torch.Tensor, ban_rows: torch.Tensor, sample_rows: torch.Tensor,
                        temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, uniform: torch.Tensor,
                        min_p: torch.Tensor, mask_rows: torch.Tensor, token_mask: torch.Tensor,
                        *adjustments: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`_choose`'s greedy tokens without its sampling: masks, then EOS bans, then the argmax."""
        logits = self._constrain(self._known(logits), mask_rows, token_mask)
        without_eos = torch.where(self.eos_mask[None, :], float("-inf"), logits[ban_rows])
        no_ids = sample_rows[:, None] * self.rank[:, : self.top_n]
        return logits.argmax(-1).index_put((ban_rows,), without_eos.argmax(-1)), temperature * 0, no_ids, no_ids.float()

    def _argmax(self, logits: torch.Tensor, ban_rows: torch.Tensor, sample_rows: torch.Tensor,
                temperature: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What `_choose` returns when every row is plain greedy: the argmax, and no sampled rows."""
        no_ids = sample_rows[:, None] * self.rank[:, : self.top_n]  # [0, n]: the branches' shapes agree
        return self._known(logits).argmax(-1), temperature * 0, no_ids, no_ids.float()

    def _known(self, logits: torch.Tensor) -> torch.Tensor:
        """-inf for the ids the tokenizer does not have."""
        if self.never_mask is None:
            return logits
        return torch.where(self.never_mask[None, :], float("-inf"), logits)

    def _choose(
        self,
        logits: torch.Tensor,  # [R, V] float32
        ban_rows: torch.Tensor,  # [K] rows (of R) whose end-of-sequence ids are banned
        sample_rows: torch.Tensor,  # [M] rows (of R) that sample or want log-probabilities
        temperature: torch.Tensor,  # [M] float32, 0 = greedy
        top_k: torch.Tensor,  # [M] int64, 0 = off
        top_p: torch.Tensor,  # [M] float32 in (0, 1]
        uniform: torch.Tensor,  # [M] float32 in (0, 1]
        min_p: torch.Tensor,  # [M] float32 in [0, 1], 0 = off
        mask_rows: torch.Tensor,  # [G] rows (of R) constrained by a grammar
        token_mask: torch.Tensor,  # [G, W] int32 packed bitmask, 32 * W >= V
        adjust_rows: torch.Tensor,  # [E] row (of R) of each adjustment; (row, token) pairs unique
        adjust_tokens: torch.Tensor,  # [E] int64
        adjust_bias: torch.Tensor,  # [E] float32, added first
        adjust_scale: torch.Tensor,  # [E] float32 > 0, then divides positive / multiplies negative logits
        adjust_shift: torch.Tensor,  # [E] float32, then subtracted
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = _adjust(self._known(logits), adjust_rows, adjust_tokens, adjust_bias, adjust_scale, adjust_shift)
        logits = self._constrain(logits, mask_rows, token_mask)
        banned = torch.zeros_like(logits[:, 0], dtype=torch.bool).index_put(
            (ban_rows,), torch.ones_like(ban_rows, dtype=torch.bool))
        without_eos = torch.where(self.eos_mask[None, :], float("-inf"), logits[ban_rows])
        greedy = logits.argmax(-1).index_put((ban_rows,), without_eos.argmax(-1))
        rows = logits[sample_rows]
        rows = torch.where(banned[sample_rows][:, None] & self.eos_mask[None, :], float("-inf"), rows)
        peak = rows.max(-1, keepdim=True).values
        log_norm = torch.log(torch.exp(rows - peak).sum(-1)) + peak[:, 0]  # ORT's ReduceLogSumExp is slow
        candidates, candidate_ids = rows.topk(self.candidates, -1)  # sorted, most likely first
        scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature))[:, None]
        top = candidates[:, :1]
        # min_p: a token less likely than min_p times the most likely one (after temperature) is out
        below = (rows - top) / scale < torch.log(min_p)[:, None]
        full = torch.exp((torch.where(below, float("-inf"), rows) - top) / scale)  # [M, V], the largest is 1
        full = nn.functional.pad(full, (0, self.blocks * BLOCK - self.vocab_size)).view(-1, self.blocks, BLOCK)
        block_mass = full.sum(-1)  # [M, blocks]
        by_vocab = _draw_two_level(full, block_mass, uniform)
        weights = torch.exp((candidates - top) / scale) * ~below.gather(1, candidate_ids)
        keep = _top_k_top_p(weights, block_mass.sum(-1), top_k, top_p, self.rank)
        by_rank = candidate_ids.gather(1, _draw(weights * keep, uniform)[:, None])[:, 0]
        restricted = (top_k > 0) | (top_p < 1)
        sampled = torch.where(restricted, by_rank, by_vocab)
        sampled = torch.where(temperature > 0, sampled, greedy[sample_rows])
        tokens = greedy.index_put((sample_rows,), sampled)
        token_logprobs = rows.gather(1, sampled[:, None])[:, 0] - log_norm
        top_logprobs = candidates[:, : self.top_n] - log_norm[:, None]
        # dense, as `torch.cond` requires of both branches' outputs
        return tokens, token_logprobs, candidate_ids[:, : self.top_n].contiguous(), top_logprobs

    def _constrain(self, logits: torch.Tensor, mask_rows: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
        """-inf for every token a row's grammar does not allow now. The unpacked bits are padded
        with a [G, V] block so that the slice to V columns needs no vocabulary size from the host."""
        rows = logits[mask_rows]
        bits = (token_mask[:, :, None] & self.bits) != 0  # [G, W, 32]
        padding = torch.zeros_like(rows, dtype=torch.bool)
        allowed = torch.cat((bits.flatten(1), padding), 1)[:, : rows.shape[1]]
        return logits.index_put((mask_rows,), torch.where(allowed, rows, float("-inf")))


def _adjust(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, bias: torch.Tensor,
            scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """logit_bias, repetition, frequency and presence penalties, in vLLM's order, on the named entries."""
    x = logits[rows, tokens] + bias
    x = torch.where(x > 0, x / scale, x * scale) - shift
    return logits.index_put((rows, tokens), x)


def _mask(size: int, ids: list[int]) -> torch.Tensor:
    mask = torch.zeros(size, dtype=torch.bool)
    mask[[i for i in ids if i < size]] = True
    return mask


def _top_k_top_p(weights: torch.Tensor, full_mass: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """Which sorted candidates survive top_k, then top_p over the top_k-renormalised mass;
    `rank` is [1, candidates]: 0, 1, 2, ..."""
    in_k = (top_k[:, None] <= 0) | (rank < top_k[:, None])  # a top_k past the candidates keeps them all
    kept = weights * in_k
    cumulative = torch.cumsum(kept, -1)
    mass = torch.where(top_k > 0, cumulative[:, -1], full_mass)
    return in_k & ((cumulative - kept) < (top_p * mass)[:, None])  # the first candidate always stays


def _draw(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: the first index whose cumulative weight reaches u * total (u in (0, 1]).

    The target is positive and at most the total, so the chosen index always has weight > 0.
    """
    cumulative = torch.cumsum(weights, -1)
    target = uniform * cumulative[:, -1]
    return (cumulative < target[:, None]).sum(-1)


def _draw_two_level(full: torch.Tensor, block_mass: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse CDF over [M, blocks, BLOCK] weights: pick the block, then the token inside it."""
    cumulative = torch.cumsum(block_mass, -1)
    target = uniform * cumulative[:, -1]
    block = (cumulative[:, :-1] < target[:, None]).sum(-1)  # rounding can leave the target past the last block
    before = (cumulative - block_mass).gather(1, block[:, None])[:, 0]
    inside = full.gather(1, block[:, None, None].expand(-1, 1, full.shape[2]))[:, 0]  # [M, BLOCK]
    inside_cumulative = torch.cumsum(inside, -1)
    # Rounding between the two sums must not push the target outside the block's real tokens.
    smallest = torch.finfo(inside.dtype).tiny
    remaining = torch.minimum(torch.clamp(target - before, min=smallest), inside_cumulative[:, -1])
    return block * full.shape[2] + (inside_cumulative < remaining[:, None]).sum(-1)
