"""Speculative decoding with n-gram (prompt lookup) drafts, verified by the exported step.

Drafts: a decoding sequence whose last few tokens occurred earlier in its prompt or output
proposes the tokens that followed them then (the most recent occurrence, the longest n-gram
first). Code repeats itself — names, call patterns, whole lines — so a completion often continues
what its prompt already holds. Finding a draft is a dictionary lookup per sequence: each
sequence's n-grams are indexed as its tokens arrive.

Verification is one step of the exported graph: a row's last token and its k draft tokens go in
like a short prefill chunk, and the step returns the next token at each of the k + 1 positions,
chosen exactly as a decode step would choose it (greedy argmax, or an inverse-CDF draw with the
row's own uniform number). Draft token i is accepted while the step chose it at position i - 1;
the first position whose choice differs gives the next token, and so does the position after the
last draft when all are accepted. For a greedy row that is exactly plain decoding. For a sampled
row it is the standard rejection rule for a point-mass draft — accept d with probability p(d),
else draw from p with d removed, renormalised — realised with one uniform number per position:
the inverse-CDF draw equals d with probability p(d), and when it does not, it is distributed as p
without d. So every row keeps its output distribution, and a seeded row uses the same random
numbers as without speculation (the n-th token takes the n-th number of its own stream) and
produces the same tokens with speculation on or off.

The cache keeps only accepted tokens: a row's cached count advances by 1 + accepted; the keys and
values written for rejected drafts sit in slots past it and are overwritten when those positions
are fed again.

Speculation is this module's from end to end: the core asks `propose` for the scheduled step's
drafts, the scheduler gives them room in the cache (`Scheduler.grant_drafts`), and `verify` turns
the step that ran into what plain decoding would have produced. A seeded row's stream is held
before the step and re-seated after it (engine/randomness.py).

Policy (when drafts are proposed at all), in order:
- server-wide: `speculative_tokens` (k) > 0; per request: sampling parameter `speculative`
  (default true);
- only decoding rows of continuous batching with chunked prefill (the default; the core turns
  speculation off otherwise), not below
  `min_tokens`, without a grammar (structured output) or penalties / logit_bias, and at most as
  many drafts as tokens the request may still generate less one;
- the batch is small: drafts are added to a step only while the step, drafts included, stays
  within `speculative_step_tokens` tokens. A step is cheap per token only while the device is
  bound by reading weights and cache; once the batch alone fills it, verifying drafts costs
  as much as the tokens they might save, so a full batch never speculates. Within the budget a
  row drafts whenever its lookup finds a match: on the CPU a row of 1 + 4 tokens costs little more
  than a row of one, so a draft pays even when it is seldom accepted, and a
  back-off after rejected drafts measured worse (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np

from batchstring.engine.batch import StepBatch, Work
from batchstring.engine.isolation import Ran
from batchstring.engine.randomness import RandomStreams
from batchstring.engine.runner import StepOutput
from batchstring.engine.sequence import Sequence
from batchstring.engine.stats import EngineStats

# Longest n-gram looked up. A longer match is a more specific context: on code prompts 8 gave more
# tokens per decode step and more tokens/s than 3 or 5 (docs/benchmarks.md, speculative decoding).
NGRAM_MAX = 8
NGRAM_MIN = 1  # shortest


class _Index:
    """One sequence's n-grams: for each n, the n tokens before position p -> p (the latest p)."""

    __slots__ = ("done", "grams")

    def __init__(self) -> None:
        self.done = 1  # positions below this are indexed
        self.grams: list[dict[tuple[int, ...], int]] = [{} for _ in range(NGRAM_MAX + 1)]

    def draft(self, tokens: list[int], k: int) -> tuple[int, ...]:
        end = len(tokens)
        for p in range(self.done, end):
            for n in range(NGRAM_MIN, min(NGRAM_MAX, p) + 1):
                self.grams[n][tuple(tokens[p - n : p])] = p
        self.done = max(self.done, end)
        for n in range(min(NGRAM_MAX, end - 1), NGRAM_MIN - 1, -1):
            p = self.grams[n].get(tuple(tokens[end - n :]))
            if p is not None:
                return tuple(tokens[p : p + k])
        return ()


class Speculator:
    """Proposes drafts for a step and turns the verified step into what plain decoding would have
    produced, accepted tokens only."""

    def __init__(self, k: int, step_tokens: int, eos_token_ids: tuple[int, ...], stats: EngineStats,
                 random: RandomStreams) -> None:
        self.k = k
        self.step_tokens = step_tokens
        self.eos = frozenset(eos_token_ids)
        self.stats = stats  # the engine's: its `speculation` counters are bumped here
        self.random = random
        self._index: weakref.WeakKeyDictionary[Sequence, _Index] = weakref.WeakKeyDictionary()

    @property
    def enabled(self) -> bool:
        return self.k > 0

    def propose(self, work: list[Work]) -> dict[int, tuple[int, ...]]:
        """Drafts for the step's decoding rows, by index into `work`; none when they would take the
        step past `speculative_step_tokens` (see the module's policy)."""
        if not self.enabled:
            return {}
        tokens = sum(w.new for w in work)
        if tokens + self.k > self.step_tokens:
            return {}  # not even one row's drafts fit: a full batch costs nothing more
        rows = [i for i, w in enumerate(work) if w.new == 1 and w.samples and self._may_draft(w.seq)]
        if not rows or tokens + len(rows) * self.k > self.step_tokens:
            return {}
        drafts = {}
        for i in rows:
            seq = work[i].seq
            index = self._index.get(seq) or self._index.setdefault(seq, _Index())
            room = seq.params.max_tokens - len(seq.output_ids) - 1
            draft = index.draft(seq.all_ids, min(self.k, room))
            if draft:
                drafts[i] = draft
                self.random.hold(seq)  # a seeded row draws a number per verified position
        return drafts

    def _may_draft(self, seq: Sequence) -> bool:
        """Rows whose later positions the step would treat like their first are left out: a
        grammar's mask and the penalties follow the tokens generated, which drafts would change
        mid-row, and so does the end-of-sequence ban below `min_tokens`."""
        params = seq.params
        return (params.speculative and len(seq.output_ids) + 1 < params.max_tokens
                and params.guide is None and not params.adjusts
                and (params.ignore_eos or len(seq.output_ids) >= params.min_tokens))

    def verify(self, ran: Ran) -> Ran:
        """The step as plain decoding would have left it: each draft row keeps its accepted drafts
        and the token after them (cut at an end-of-sequence token), and caches only what it keeps."""
        work, batch, out = ran.work, ran.batch, ran.out
        drafts = {w.seq: w for w in work if w.draft}
        if not drafts:
            return ran
        keep = np.ones(len(batch.sampled), bool)
        tokens = out.tokens.tolist()
        kept_work = {}
        row = 0
        while row < len(batch.sampled):
            seq = batch.sampled[row]
            w = drafts.get(seq)
            if w is None:
                row += 1
                continue
            accepted = self._accepted(w, tokens[row : row + len(w.draft) + 1])
            keep[row + accepted + 1 : row + len(w.draft) + 1] = False
            kept_work[seq] = dataclasses.replace(w, new=1 + accepted, draft=w.draft[:accepted])
            self.random.reseat(seq, accepted + 1)  # one number per token kept, as without drafts
            row += len(w.draft) + 1
        work = [kept_work.get(w.seq, w) for w in work]
        return Ran(work, _compact_batch(batch, keep), _compact_output(out, keep, batch.inputs.sampling.sample_rows))

    def _accepted(self, w: Work, chosen: list[int]) -> int:
        """Drafts accepted (leading positions where the step chose the draft token), cut so that the
        kept tokens end at the first end-of-sequence token; records the counters."""
        accepted = 0
        while accepted < len(w.draft) and chosen[accepted] == w.draft[accepted]:
            accepted += 1
        self.stats.speculation.record(len(w.draft), accepted)
        if not w.seq.params.ignore_eos:
            ends = [i for i, token in enumerate(chosen[: accepted + 1]) if token in self.eos]
            accepted = ends[0] if ends else accepted
        return accepted


def _compact_batch(batch: StepBatch, keep: np.ndarray) -> StepBatch:
    """The kept rows of `sampled`, and `sample_rows` renumbered to them: what is read after the
    step (the rest of the inputs stay as they ran)."""
    rows = batch.inputs.sampling.sample_rows
    renumbered = (np.cumsum(keep) - 1)[rows[keep[rows]]]
    sampled = [seq for seq, kept in zip(batch.sampled, keep) if kept]
    return dataclasses.replace(batch, sampled=sampled, inputs=batch.inputs.replace(sample_rows=renumbered))


def _compact_output(out: StepOutput, keep: np.ndarray, sample_rows: np.ndarray) -> StepOutput:
    kept_rows = keep[sample_rows]
    return StepOutput(out.tokens[keep], out.logprobs[kept_rows], out.top_ids[kept_rows], out.top_logprobs[kept_rows])
