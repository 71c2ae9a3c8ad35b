"""The exported step's contract: every input and output, and the typed values both sides exchange.

One module says what the step takes and returns. The exporter traces `DecoderStep` with
arguments in this order and names them from `INPUTS` (its dynamic axes too), the engine builds a
`StepInputs` (engine/batch.py), every runner feeds it by field (engine/runner.py), the CUDA-graph
padding rewrites it by field (engine/cuda_graph_padding.py), and the export's verification packs its test
rows into one as well (export/verify.py). Adding an input is a row in `INPUTS` and a field of
`StepInputs` or `SamplingInputs` (checked against each other at import), plus its producer and its
consumer in the step.

The runner's inputs, not the step's (`Held`): the block table, the two caches and the resident
adapters' weights live as long as the engine and are handed to every step as they are (see
engine/runner.py and engine/adapters.py).

Numpy only: the engine and the device check import it on machines without torch's exporters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

MODEL_DTYPE = "model"  # the export's dtype (float32, float16 or bfloat16): the caches and new keys/values


@dataclass(frozen=True)
class Tensor:
    """One input or output. `dims` name each axis: a name in `STATIC_DIMS` is fixed by the
    checkpoint, a number is fixed, any other name is dynamic and shared by every axis so named
    (the exporter makes one dynamic dimension of each)."""

    name: str
    dtype: str
    dims: tuple[str | int, ...]
    meaning: str


# The step's projections a LoRA adapter may change (q/k/v and gate/up are one projection each in
# the step, export/step.py): each site's stacked low-rank matrices are inputs the runner holds.
ADAPTER_SITES = ("qkv", "o", "gate_up", "down")

STATIC_DIMS = frozenset({"layers", "kv_heads", "head_dim", "vocab", "top_n",
                         *(f"{site}_{end}" for site in ADAPTER_SITES for end in ("in", "out"))})

INPUTS = (
    Tensor("input_ids", "int64", ("tokens",), "the new tokens of every row, packed"),
    Tensor("position_ids", "int64", ("tokens",), "absolute position of each"),
    Tensor("decode_tokens", "int64", ("decode_rows", 1), "decode group: the packed index of each row's one token"),
    Tensor("decode_rows", "int64", ("decode_rows",), "each row's row of block_table"),
    Tensor("decode_context", "int64", ("decode_rows",), "each row's computed tokens (in the cache)"),
    Tensor("decode_pairs", "int64", ("decode_pairs", "decode_span", 0),
           "split-K partitions: its shape alone says (row, span of blocks) pairs x blocks per span"),
    Tensor("prefill_tokens", "int64", ("prefill_rows", "prefill_new"),
           "prefill group: packed index of each new token, left-padded"),
    Tensor("prefill_mask", "bool", ("prefill_rows", "prefill_new"), "True where prefill_tokens is a real token"),
    Tensor("prefill_rows", "int64", ("prefill_rows",), "each row's row of block_table"),
    Tensor("prefill_context", "int64", ("prefill_rows",), "each row's computed tokens"),
    Tensor("prefill_pairs", "int64", ("prefill_pairs", "prefill_span", 0), "split-K partitions of the prefill group"),
    Tensor("token_order", "int64", ("tokens",), "where token t sits in (decode rows, then prefill rows x width)"),
    Tensor("block_table", "int64", ("table_rows", "table_width"),
           "cache block of each row's i-th block of tokens (the runner's, whole, read only)"),
    Tensor("logit_tokens", "int64", ("rows",), "packed index of each token whose successor is wanted"),
    Tensor("ban_rows", "int64", ("banned_rows",), "rows (of logit_tokens) whose end-of-sequence ids are banned"),
    Tensor("sample_rows", "int64", ("sampled_rows",), "rows that sample or want log-probabilities"),
    Tensor("temperature", "float32", ("sampled_rows",), "0 = greedy"),
    Tensor("top_k", "int64", ("sampled_rows",), "0 = off"),
    Tensor("top_p", "float32", ("sampled_rows",), "1 = off"),
    Tensor("uniform", "float32", ("sampled_rows",), "in (0, 1], from the request's own generator"),
    Tensor("min_p", "float32", ("sampled_rows",), "0 = off"),
    Tensor("mask_rows", "int64", ("masked_rows",), "rows constrained by a grammar"),
    Tensor("token_mask", "int32", ("masked_rows", "mask_words"), "their packed bitmasks (32 x words >= vocab)"),
    Tensor("adjust_rows", "int64", ("adjustments",), "logit adjustments (logit_bias, penalties): row of each"),
    Tensor("adjust_tokens", "int64", ("adjustments",), "token of each entry"),
    Tensor("adjust_bias", "float32", ("adjustments",), "added"),
    Tensor("adjust_scale", "float32", ("adjustments",), "repetition penalty (1 = none)"),
    Tensor("adjust_shift", "float32", ("adjustments",), "subtracted (frequency x count + presence)"),
    Tensor("adapter_tokens", "int64", ("adapter_groups", "group_width"),
           "packed index of each token whose row uses an adapter, a group per adapter (padding: 0)"),
    Tensor("adapter_mask", "float32", ("adapter_groups", "group_width"), "1 for a token, 0 for padding"),
    Tensor("adapter_index", "int64", ("adapter_groups",), "each group's adapter: its slot in the adapter weights"),
    *(tensor for site in ADAPTER_SITES for tensor in (
        Tensor(f"{site}_lora_a", MODEL_DTYPE, ("layers", "adapter_slots", f"{site}_in", f"{site}_rank"),
               f"resident adapters' A of the {site} projection, a fused projection's ranks side by side"),
        Tensor(f"{site}_lora_b", MODEL_DTYPE, ("layers", "adapter_slots", f"{site}_rank", f"{site}_out"),
               "their B times each adapter's scaling, block-diagonal over a fused projection's parts"))),
    Tensor("key_cache", MODEL_DTYPE, ("layers", "kv_heads", "cache_blocks", "block_size", "head_dim"),
           "the runner's paged cache: blocks of block_size tokens (read only)"),
    Tensor("value_cache", MODEL_DTYPE, ("layers", "kv_heads", "cache_blocks", "block_size", "head_dim"),
           "the values beside it"),
)

OUTPUTS = (
    Tensor("next_tokens", "int64", ("rows",), "the next token of each row of logit_tokens"),
    Tensor("token_logprobs", "float32", ("sampled_rows",), "log-probability of each sampled row's token"),
    Tensor("top_ids", "int64", ("sampled_rows", "top_n"), "the most likely tokens of each sampled row"),
    Tensor("top_logprobs", "float32", ("sampled_rows", "top_n"), "their log-probabilities"),
    Tensor("logits", "float32", ("rows", "vocab"), "for verification; the engine never fetches them"),
    Tensor("new_keys", MODEL_DTYPE, ("layers", "kv_heads", "tokens", "head_dim"),
           "keys of the new tokens (after rotary), packed like input_ids"),
    Tensor("new_values", MODEL_DTYPE, ("layers", "kv_heads", "tokens", "head_dim"), "their values"),
)

INPUT_NAMES = tuple(t.name for t in INPUTS)
OUTPUT_NAMES = tuple(t.name for t in OUTPUTS)
FETCHED = tuple(name for name in OUTPUT_NAMES if name != "logits")  # what a runner asks for
CACHES = ("key_cache", "value_cache")


AdapterWeights = NamedTuple("AdapterWeights", [(f"{site}_lora_{m}", Any) for site in ADAPTER_SITES for m in "ab"])
AdapterWeights.__doc__ = """The resident adapters' stacked matrices, per site (engine/adapters.py fills them)."""


def no_adapters(sites: dict[str, tuple[int, int]], layers: int, zeros: Callable[[tuple], Any]) -> AdapterWeights:
    """Weights with no adapter slot: `sites` maps a site to its projection's (in, out) features
    (a site the model lacks: (0, 0)); `zeros(shape)` makes an array of the runtime's kind."""
    def pair(site: str) -> tuple:
        fan_in, fan_out = sites.get(site, (0, 0))
        return zeros((layers, 0, fan_in, 0)), zeros((layers, 0, 0, fan_out))
    return AdapterWeights(*(array for site in ADAPTER_SITES for array in pair(site)))


class Held(NamedTuple):
    """The inputs a runner holds for the engine's lifetime and passes to every step as they are."""

    block_table: Any
    key_cache: Any
    value_cache: Any
    adapters: AdapterWeights | None = None  # None: no adapter resident (`without_adapters` fills it)

    def without_adapters(self, sites: dict[str, tuple[int, int]], zeros: Callable[[tuple], Any]) -> Held:
        """These inputs with empty adapter weights where none were given (see `no_adapters`)."""
        if self.adapters is not None:
            return self
        return self._replace(adapters=no_adapters(sites, self.key_cache.shape[0], zeros))

    def named(self) -> dict[str, Any]:
        """Each held input by its contract name."""
        if self.adapters is None:
            raise ValueError("the step's held inputs lack the adapter weights: call Held.without_adapters first")
        return {"block_table": self.block_table, "key_cache": self.key_cache, "value_cache": self.value_cache,
                **self.adapters._asdict()}


@dataclass(frozen=True)
class SamplingInputs:
    """Per-row sampling values of the step (export/sampler.py). Each names only the rows that use
    it, so a row that uses none of them costs nothing."""

    ban_rows: np.ndarray
    sample_rows: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    uniform: np.ndarray
    min_p: np.ndarray
    mask_rows: np.ndarray
    token_mask: np.ndarray
    adjust_rows: np.ndarray
    adjust_tokens: np.ndarray
    adjust_bias: np.ndarray
    adjust_scale: np.ndarray
    adjust_shift: np.ndarray

    @classmethod
    def plain(cls, ban_rows: np.ndarray, sample_rows: np.ndarray, temperature: np.ndarray, top_k: np.ndarray,
              top_p: np.ndarray, uniform: np.ndarray) -> SamplingInputs:
        """Sampling without min_p, grammars or logit adjustments."""
        empty = np.zeros(0, np.float32)
        return cls(ban_rows, sample_rows, temperature, top_k, top_p, uniform, np.zeros(len(sample_rows), np.float32),
                   np.zeros(0, np.int64), np.zeros((0, 0), np.int32), np.zeros(0, np.int64), np.zeros(0, np.int64),
                   empty, empty, empty)


@dataclass(frozen=True)
class StepInputs:
    """One step's inputs but the held ones, as the engine (or the verification) packed them.

    `single_group` is the packer's one decision of which graph may run the step: every row in the
    prefill group with one split-K partition each, which the single-group graph (export/step.py)
    computes as the full graph does."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    decode_tokens: np.ndarray
    decode_rows: np.ndarray
    decode_context: np.ndarray
    decode_pairs: np.ndarray
    prefill_tokens: np.ndarray
    prefill_mask: np.ndarray
    prefill_rows: np.ndarray
    prefill_context: np.ndarray
    prefill_pairs: np.ndarray
    token_order: np.ndarray
    logit_tokens: np.ndarray
    sampling: SamplingInputs
    adapter_tokens: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 0), np.int64))
    adapter_mask: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 0), np.float32))
    adapter_index: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    single_group: bool = False

    @property
    def tokens(self) -> int:
        return len(self.input_ids)

    @property
    def rows(self) -> int:
        """Rows whose next token comes back."""
        return len(self.logit_tokens)

    def replace(self, **changes) -> StepInputs:
        """This step with fields changed; sampling fields may be named directly."""
        sampling = {k: changes.pop(k) for k in list(changes) if k in _SAMPLING_FIELDS}
        if sampling:
            changes["sampling"] = dataclasses.replace(changes.get("sampling", self.sampling), **sampling)
        return dataclasses.replace(self, **changes)

    def arrays(self) -> dict[str, np.ndarray]:
        """The step's own inputs by contract name, in the contract's order (the held ones left out)."""
        return {name: self._value(name) for name in _OWN}

    def feeds(self, held: Held) -> dict[str, Any]:
        """Every input by name, for runtimes that take named inputs (ONNX Runtime)."""
        return {**self.arrays(), **held.named()}

    def positional(self, held: Held, convert: Callable[[np.ndarray], Any] = lambda array: array) -> list:
        """Every input in the step's argument order; `convert` turns each array of this step (not
        the held ones) into what the runtime takes (a tensor on its device)."""
        return arguments([convert(array) for array in self.arrays().values()], held)

    def _value(self, name: str) -> np.ndarray:
        return getattr(self.sampling if name in _SAMPLING_FIELDS else self, name)


def arguments(own: list, held: Held) -> list:
    """The step's arguments in order from its own inputs (in `StepInputs.arrays()`'s order, as the
    runtime's values: a CUDA graph's static buffers) and the held ones."""
    values, named = iter(own), held.named()
    return [named[name] if name in _HELD else next(values) for name in INPUT_NAMES]


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingInputs))
_HELD = frozenset({*Held._fields[:-1], *AdapterWeights._fields})
_OWN = tuple(name for name in INPUT_NAMES if name not in _HELD)


# The step's positional arguments by name: `DecoderStep.forward(*inputs)` reads them so.
StepArguments = NamedTuple("StepArguments", [(name, Any) for name in INPUT_NAMES])


def _check() -> None:
    """The typed values and the table describe the same inputs."""
    fields = [f.name for f in dataclasses.fields(StepInputs) if f.name not in ("sampling", "single_group")]
    declared = set(fields) | _SAMPLING_FIELDS | _HELD
    if declared != set(INPUT_NAMES) or len(declared) != len(INPUT_NAMES):
        raise AssertionError(f"export/contract.py: StepInputs, SamplingInputs and Held declare {sorted(declared)}, "
                             f"INPUTS {sorted(INPUT_NAMES)}")


_check()


def markdown() -> str:
    """The contract as the tables export/README.md shows (a test keeps the two the same)."""
    lines = []
    for title, tensors in (("input", INPUTS), ("output", OUTPUTS)):
        lines += [f"| {title} | type | shape | meaning |", "|---|---|---|---|"]
        for t in tensors:
            shape = ", ".join(str(d) for d in t.dims)
            lines.append(f"| `{t.name}` | {t.dtype} | [{shape}] | {t.meaning} |")
        lines.append("")
    return "\n".join(lines[:-1])


if __name__ == "__main__":
    print(markdown())
