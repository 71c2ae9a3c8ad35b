"""Structured output in the engine: one home for what a grammar does to a request, step by step.

engine/grammar.py compiles grammars and computes masks (llguidance); this module is where the
engine uses them, at the three points a constrained request meets:
- admission (`attach`, on the caller's thread): its guide compiled into its `Sequence.constraint`;
- each step's inputs (`step_masks`, from engine/batch.py): the packed masks of its constrained rows;
- after each step (`after_step`, from the core, after the scheduler's update): the chosen token fed
  to its grammar (a grammar that cannot take it ends the request with an error), then the run of
  tokens its grammar now admits one at a time, appended without a step (`forced_runs`): each is
  the only token its mask allows, so greedy and sampled decoding alike would pick it. Their keys
  and values are computed with the row's next step (engine/batch.py `split_step` keeps them out
  of a prompt chunk's padding), and a seeded sampled row skips the numbers each would have drawn
  (engine/randomness.py), so its later tokens are the same.
"""

from __future__ import annotations

import numpy as np

from batchstring.engine.grammar import GrammarCompiler, fill_masks, forced_runs
from batchstring.engine.randomness import RandomStreams
from batchstring.engine.sequence import Sequence

_NO_MASKS = (np.zeros(0, np.int64), np.zeros((0, 0), np.int32))


def step_masks(seqs: list[Sequence], rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The constrained rows among `rows` and their grammars' masks, all rows at once."""
    rows = [i for i in rows if seqs[i].constraint is not None]
    if not rows:
        return _NO_MASKS
    return np.asarray(rows, np.int64), fill_masks([seqs[i].constraint for i in rows])


class StructuredOutput:
    def __init__(self, compiler: GrammarCompiler, eos_token_ids: tuple[int, ...], skip_forced_tokens: bool,
                 random: RandomStreams) -> None:
        self.compiler = compiler
        self.eos = frozenset(eos_token_ids)
        self.skip_forced_tokens = skip_forced_tokens
        self.random = random

    def attach(self, seq: Sequence) -> None:
        """Compiles the request's guide (InvalidRequest naming the field when it cannot be used)."""
        if seq.params.guide is not None:
            seq.constraint = self.compiler.constraint(seq.params.guide)

    def after_step(self, sampled: list[Sequence], tokens: np.ndarray, ended: dict[Sequence, str]) -> int:
        """Feeds each constrained row its token (already appended by the scheduler's update) and
        records in `ended` the rows whose grammar cannot take it ("error") and those a forced run
        takes to max_tokens ("length"). Returns the tokens forced."""
        forcing = []
        for seq, token in zip(sampled, tokens.tolist()):
            if seq.constraint is None or seq.padding:
                continue
            params = seq.params
            eos_banned = token in self.eos and not params.ignore_eos and len(seq.output_ids) <= params.min_tokens
            if not seq.constraint.advance(token, eos_banned):
                ended[seq] = "error"  # its grammar admits no token here
            elif seq not in ended and self._may_force(seq):
                forcing.append(seq)
        return self._force(forcing, ended) if forcing else 0

    def _may_force(self, seq: Sequence) -> bool:
        """Not a row whose caller reads each token as it comes (streaming, stop strings) or wants
        each one's log-probability, which only a step computes."""
        return self.skip_forced_tokens and seq.params.logprobs is None and not seq.output.per_token

    def _force(self, seqs: list[Sequence], ended: dict[Sequence, str]) -> int:
        rooms = [seq.params.max_tokens - len(seq.output_ids) for seq in seqs]
        runs = forced_runs([seq.constraint for seq in seqs], rooms, self.eos)
        for seq, run, room in zip(seqs, runs, rooms):
            seq.output_ids.extend(run)
            self.random.skip(seq, len(run))
            if len(run) == room:
                ended[seq] = "length"
        return sum(map(len, runs))
