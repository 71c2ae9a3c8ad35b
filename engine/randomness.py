"""The random numbers sampled rows draw: one owner for every stream the engine advances.

A sampled row takes one uniform number per token (the step's inverse-CDF draw, export/sampler.py).
A request with a seed draws from its own stream, so its tokens depend on nothing but its seed and
its own text, whoever shares its steps; the others share the engine's stream. A seeded row's n-th
token takes the n-th number of its stream however that token was produced, so the two features
that produce tokens outside a plain decode step keep the count here:
- a forced run of structured output (engine/grammar.py) appends tokens without a step: the
  numbers they would have drawn are skipped (`skip`);
- a speculative draft row (engine/speculation.py) draws one number per verified position, and
  keeps only the tokens it accepts: its stream is held before the step and re-seated after it to
  the numbers its kept tokens used (`hold`, `reseat`).
"""

from __future__ import annotations

import weakref

import numpy as np

from batchstring.engine.sequence import Sequence


class RandomStreams:
    """The shared stream, and every seeded request's own (kept on its `Sequence.rng`, which only
    this class reads or advances)."""

    def __init__(self, seed: int | None = None) -> None:
        self.shared = np.random.default_rng(seed)  # the numbers of requests without a seed
        # states held for draft rows; one held for a row then given no drafts is overwritten or dropped with it
        self._held: weakref.WeakKeyDictionary[Sequence, dict] = weakref.WeakKeyDictionary()

    @staticmethod
    def _stream(seq: Sequence) -> np.random.Generator | None:
        """A seeded request's stream, made at its first draw."""
        if seq.rng is None and seq.params.seed is not None:
            seq.rng = np.random.default_rng(seq.params.seed)
        return seq.rng

    def uniforms(self, seqs: list[Sequence]) -> np.ndarray:
        """One number in (0, 1] per row: from the row's own stream if it has a seed, else shared."""
        uniform = 1.0 - self.shared.random(len(seqs))
        for k, seq in enumerate(seqs):
            if seq.params.seed is not None:
                uniform[k] = 1.0 - self._stream(seq).random()
        return uniform

    def skip(self, seq: Sequence, count: int) -> None:
        """`count` tokens were produced without a draw (a forced run): a sampled seeded row skips
        the numbers they would have drawn."""
        stream = self._stream(seq)
        if stream is not None and not seq.params.greedy:
            stream.random(count)

    def hold(self, seq: Sequence) -> None:
        """Remembers where a seeded row's stream stands before a step that may draw more numbers
        than the tokens it keeps (a draft row's verified positions)."""
        stream = self._stream(seq)
        if stream is not None and (not seq.params.greedy or seq.params.logprobs is not None):
            self._held[seq] = stream.bit_generator.state

    def reseat(self, seq: Sequence, used: int) -> None:
        """A held stream as if it had drawn `used` numbers since `hold`."""
        state = self._held.pop(seq, None)
        if state is not None:
            stream = seq.rng
            stream.bit_generator.state = state
            stream.random(used)
