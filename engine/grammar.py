"""Constrained decoding: a request's grammar, compiled once, and its state while it generates.

The engine is llguidance (docs/client.md, "Structured output", says why): it computes a row's mask of allowed tokens
lazily, from the grammar's current state, instead of compiling the whole grammar against the
vocabulary up front, so a new schema costs about a millisecond before its first token and the
per-step masks of a whole batch are computed in Rust (in parallel, outside the GIL, where the
host has the cores for it).

Where the engine uses it (engine/structured_output.py): compiled at admission, on the caller's
thread (bounded in size by engine/sampling_params.py and in work by llguidance's fuel limits, then a
wall-clock check; cached by grammar text in a bounded LRU of compiled templates, each request
getting a copy that shares the template's lexer caches; a grammar that does not compile, or admits
no text at all, is refused with the field it came from); `fill_masks` each step; `advance` and
`forced_runs` after it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from batchstring.engine.cores import available_cores
from batchstring.engine.errors import InvalidRequest
from batchstring.engine.sampling_params import Guide

COMPILE_SECONDS = 2.0  # a grammar that takes longer to compile (and check) than this is refused
CACHE_ENTRIES = 512  # compiled grammars kept, least recently used first out
# Masks are computed in llguidance's pool only where it has cores to spread them over and there
# are PARALLEL_MASKS or more; else on the calling thread. On 2 cores the pool (one thread, its
# default of 80% of the CPUs, or two) lost at every batch size (docs/benchmarks.md, structured output).
POOL_MIN_CORES = 4
PARALLEL_MASKS = 8
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance():
    """Imported on first use: engines that never see a constrained request do not load it."""
    import llguidance

    return llguidance


class Constraint:
    """One request's position in its grammar."""

    def __init__(self, matcher, kind: str, words: int) -> None:
        self.matcher = matcher
        self.kind = kind
        self.words = words  # int32 words of its bitmask
        self.mask: np.ndarray | None = None  # the current state's mask, once computed (fill_masks)

    def advance(self, token: int, eos_banned: bool = False) -> bool:
        """Feeds the chosen token; False when the grammar cannot take it (the request must end).
        `eos_banned`: the token is an end of sequence that min_tokens forbade, so the step chose it
        only because the grammar allowed nothing else."""
        self.mask = None
        return not eos_banned and self.matcher.consume_token(token)

    @property
    def error(self) -> str:
        reason = self.matcher.get_error().splitlines()[0] if self.matcher.is_error() else \
            "it allows only the end of the text, which min_tokens does not allow yet"
        return f"sampling_parameters.{self.kind}: the grammar admits no further token ({reason})"


class GrammarCompiler:
    """Compiles guides for one model's tokenizer; thread-safe (requests arrive on any thread)."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_ids: tuple[int, ...],
                 cache_entries: int = CACHE_ENTRIES, compile_seconds: float = COMPILE_SECONDS) -> None:
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)  # int32 words of one row's bitmask
        self.eos_ids = list(eos_ids)
        self.cache_entries = cache_entries
        self.compile_seconds = compile_seconds
        self._templates: OrderedDict[Guide, object] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer = None
        self.compiled = 0  # grammars compiled (cache misses), for tests and benchmarks

    def _llg_tokenizer(self):
        """llguidance's view of the tokenizer (about a second for a 128k vocabulary), built once."""
        with self._lock:
            if self._tokenizer is None:
                text = self.tokenizer_json.read_text(encoding="utf-8")  # the stub's locale may be ASCII
                self._tokenizer = _llguidance().LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self.eos_ids)
            return self._tokenizer

    def constraint(self, guide: Guide) -> Constraint:
        """A fresh matcher for `guide`; raises InvalidRequest naming the field when it cannot be used."""
        with self._lock:
            template = self._templates.get(guide)
            if template is not None:
                self._templates.move_to_end(guide)
        if template is None:
            template = self._compile(guide)
            with self._lock:
                self._templates[guide] = template
                while len(self._templates) > self.cache_entries:
                    self._templates.popitem(last=False)
        return Constraint(template.deep_copy(), guide.kind, self.words)

    def _compile(self, guide: Guide):
        llg = _llguidance()
        tokenizer = self._llg_tokenizer()
        field = f"sampling_parameters.{guide.kind}"
        began = time.monotonic()
        try:
            if guide.kind in ("json_schema", "json_object"):
                # Compact JSON (", " and ": "): free whitespace lets a model pad until max_tokens.
                grammar = llg.LLMatcher.grammar_from_json_schema(guide.text, defaults=JSON_STYLE)
            else:
                grammar = llg.grammar_from("gbnf" if guide.kind == "grammar" else guide.kind, guide.text)
        except ValueError as exc:
            raise InvalidRequest(f"{field} is not valid: {_first_line(exc)}") from None
        matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"{field} is not usable: {_first_line(matcher.get_error())}")
        # The first mask: proves the grammar admits some text, and warms the template's caches.
        fill_masks([Constraint(matcher, guide.kind, self.words)])
        if matcher.is_error():
            raise InvalidRequest(f"{field} admits no text at all: no token can start it "
                                 f"({matcher.get_error().split(maxsplit=1)[0]})")
        elapsed = time.monotonic() - began
        if elapsed > self.compile_seconds:
            raise InvalidRequest(f"{field} took {elapsed:.1f} s to compile; at most {self.compile_seconds:g} s "
                                 "is allowed: simplify it")
        self.compiled += 1
        return matcher



_pool = None  # llguidance's executor; False where the host has fewer than POOL_MIN_CORES cores
_pool_lock = threading.Lock()


def _mask_pool():
    """Made on first use, sized to the cores this process may keep busy (llguidance's own default,
    80% of the CPUs, is a single thread on two)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            cores = available_cores()
            _pool = _llguidance().LLExecutor(min(32, cores)) if cores >= POOL_MIN_CORES else False
        return _pool


def fill_masks(constraints: list[Constraint]) -> np.ndarray:
    """[G, words] int32: each row's allowed tokens now, computed by llguidance in Rust, in parallel
    where there are cores for it (`POOL_MIN_CORES`, `PARALLEL_MASKS`). A mask computed already for the
    same state, by `forced_runs`, is reused. The rows are written in place through the matcher's
    pointer call, which llguidance's numpy helpers wrap with per-row checks this fresh array
    does not need."""
    missing = [(c.matcher, i) for i, c in enumerate(constraints) if c.mask is None]
    if not missing:  # the step's masks, every one left by forced_runs
        return np.stack([c.mask for c in constraints])
    masks = np.zeros((len(constraints), constraints[0].words), np.int32)
    pool = _mask_pool() if len(missing) >= PARALLEL_MASKS else None
    row_bytes = masks.shape[1] * masks.itemsize
    if pool:
        pool.unsafe_compute_mask_ptr(missing, masks.ctypes.data, row_bytes, len(masks))
    else:
        base = masks.ctypes.data
        for matcher, i in missing:
            matcher.unsafe_compute_mask_ptr(base + i * row_bytes, row_bytes)
    for i, c in enumerate(constraints):
        if c.mask is None:
            c.mask = masks[i]
        else:
            masks[i] = c.mask
    return masks


def forced_runs(constraints: list[Constraint], limits: list[int], eos: frozenset[int]) -> list[list[int]]:
    """Each row's run of tokens its grammar admits one at a time from here, consumed: at most its
    limit, and none that ends the text (the step decides that, as min_tokens may forbid it). A
    round per token: the masks of every row still in a run are computed in one `fill_masks` call
    (in parallel where the host has the cores) and their only tokens found together, so a batch's runs
    cost rounds, not rows x tokens, of Python. The last mask computed is the row's next step's."""
    runs: list[list[int]] = [[] for _ in constraints]
    live = [i for i, limit in enumerate(limits) if limit > 0]
    while live:
        going = []
        for i, token in zip(live, only_tokens(fill_masks([constraints[i] for i in live])).tolist()):
            if token < 0 or token in eos or not constraints[i].advance(token):
                continue
            runs[i].append(token)
            if len(runs[i]) < limits[i]:
                going.append(i)
        live = going
    return runs


def only_tokens(masks: np.ndarray) -> np.ndarray:
    """[G] the one token each packed mask [G, words] allows, or -1 where it allows several (or none)."""
    nonzero = masks != 0
    word = nonzero.argmax(axis=1)
    bits = masks[np.arange(len(masks)), word].astype(np.int64) & 0xFFFFFFFF
    single = (nonzero.sum(axis=1) == 1) & (bits & (bits - 1) == 0)
    bit = np.log2(np.where(single, bits, 1)).astype(np.int64)  # exact: a power of two
    return np.where(single, word * 32 + bit, -1)


def _first_line(error: object) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return " ".join(lines[:4])[:400] if lines else str(error)
