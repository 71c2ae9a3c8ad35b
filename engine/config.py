"""Engine settings, parsed from the `parameters` block of config.pbtxt (all strings there)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

RUNTIMES = ("onnxruntime", "torchscript")
AUTO = 0  # kv_cache_tokens: sized from the free memory (engine/memory.py); max_input_bytes: from the context;
# split_step_cost: by device (engine/batch.py SPLIT_STEP_COSTS)
AUTO_PARAMETERS = ("kv_cache_tokens", "max_input_bytes", "split_step_cost")
# max_input_bytes auto: this many bytes per token of the model's context (English averages ~4 bytes a
# token, code ~3; only text of much longer tokens than any tokenizer makes reaches it), so the byte cap
# refuses nothing the context would take and bounds what is tokenised before the context is checked.
INPUT_BYTES_PER_TOKEN = 32
SCHEDULING = ("continuous", "static")


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Path
    runtime: str = "onnxruntime"
    device: str = "cpu"  # set from the instance Triton created, never from the config
    scheduling: str = "continuous"
    max_num_seqs: int = 64  # sequences resident in one step
    max_waiting_seqs: int = 64  # accepted, not yet admitted; beyond it requests wait in Triton's queue
    kv_cache_tokens: int = 32768  # cache budget (x runtime bytes_per_token = memory); 0 or "auto": sized from memory
    kv_cache_memory_fraction: float = 0.9  # with kv_cache_tokens auto: share of the free memory for weights + cache
    block_size: int = 16  # tokens per KV-cache block
    max_num_batched_tokens: int = 512  # tokens in one step: decode rows plus prefill chunks (bounds its latency)
    long_prefill_token_threshold: int = 128  # a longer prompt gets at most this many tokens per step (0 = no cap)
    enable_chunked_prefill: bool = True  # prefill long prompts a chunk per step, beside the decoding sequences
    enable_prefix_caching: bool = True  # reuse the cached blocks of prompts that start the same way
    max_input_bytes: int = AUTO  # text_input larger than this is refused before tokenizing; auto: 32 x context
    default_max_tokens: int = 16  # vLLM's default when sampling_parameters has no max_tokens
    oom_backoff_seconds: float = 30.0  # after a real OOM, admit at most half the failing batch this long
    fault_marker: str = ""  # test-only fault injection (engine/faults.py); empty = off
    stall_seconds: float = 60.0  # a step running longer than this (work pending) means the engine is broken
    threads: int = 0  # intra-op threads for the runtime; 0 = the runtime's default
    small_step_threads: int = 2  # threads 0, ONNX Runtime on the CPU: spinning threads of the small-step session
    speculative_tokens: int = 4  # n-gram draft tokens per decoding row and step; 0 = no speculation
    speculative_step_tokens: int = 16  # drafts only while the step, drafts included, has at most this many tokens
    skip_forced_tokens: bool = True  # a constrained row's tokens its grammar admits one at a time need no step
    split_step_cost: int = AUTO  # keys x queries of padded attention worth a second call of a step; auto: by device
    cuda_graphs: bool = False  # torchscript on a GPU: decode steps replayed from CUDA graphs (cuda_graph_padding.py)
    adapters: str = ""  # LoRA adapters served from the start: NAME=DIR[,NAME=DIR...] (engine/adapters.py)
    adapter_dir: str = ""  # a directory watched for adapters: each subdirectory is one, named as it is
    max_adapters: int = 8  # adapter slots resident at once; more adapters are swapped in by least recent use

    def __post_init__(self) -> None:
        if self.runtime not in RUNTIMES:
            raise ValueError(f"parameter runtime must be one of {RUNTIMES}; got {self.runtime!r}")
        if self.scheduling not in SCHEDULING:
            raise ValueError(f"parameter scheduling must be one of {SCHEDULING}; got {self.scheduling!r}")
        positive = ("max_num_seqs", "max_waiting_seqs", "block_size", "max_num_batched_tokens",
                    "default_max_tokens", "small_step_threads", "max_adapters")
        if self.split_step_cost < 0:
            raise ValueError(f"parameter split_step_cost must be a positive number or auto; got {self.split_step_cost}")
        if self.max_input_bytes < 0:
            raise ValueError(f"parameter max_input_bytes must be a positive number of bytes or auto; got "
                             f"{self.max_input_bytes}")
        if self.kv_cache_tokens < 0 or not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError("parameter kv_cache_tokens must be a positive number of tokens or auto, and "
                             f"kv_cache_memory_fraction in (0, 1]; got {self.kv_cache_tokens}, "
                             f"{self.kv_cache_memory_fraction}")
        if self.speculative_tokens < 0 or self.speculative_step_tokens < 1:
            raise ValueError("parameter speculative_tokens must be >= 0 (0: off) and speculative_step_tokens >= 1; "
                             f"got {self.speculative_tokens}, {self.speculative_step_tokens}")
        if self.cuda_graphs and self.runtime != "torchscript":
            raise ValueError("parameter cuda_graphs needs runtime torchscript (the CUDA graphs are captured around "
                             f"the TorchScript step); got runtime {self.runtime!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("parameter long_prefill_token_threshold must be >= 0 (0: no cap); "
                             f"got {self.long_prefill_token_threshold}")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"parameter {name} must be >= 1; got {getattr(self, name)}")
        if self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"parameter max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                f"({self.max_num_seqs}) with chunked prefill: every running sequence decodes in every step"
            )

    def adapter_dirs(self) -> dict[str, Path]:
        """`adapters` as name -> directory."""
        named = {}
        for item in filter(None, (part.strip() for part in self.adapters.split(","))):
            name, sep, path = item.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"parameter adapters takes NAME=DIR pairs separated by commas; got {item!r}")
            named[name.strip()] = Path(path.strip())
        return named

    def input_bytes(self, context_length: int) -> int:
        """The byte cap on text_input: as configured, or (auto) INPUT_BYTES_PER_TOKEN x the context."""
        return self.max_input_bytes or INPUT_BYTES_PER_TOKEN * context_length

    @classmethod
    def from_parameters(cls, params: dict[str, str], **fixed) -> EngineConfig:
        """Typed view of string parameters; unknown names are an error, not silently ignored."""
        types = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(params) - set(types) - set(fixed))
        if unknown:
            raise ValueError(f"unknown engine parameter(s) {unknown}; known: {sorted(types)}")
        converters = {"int": int, "float": float, "str": str, "Path": Path, "bool": _bool}
        values = {}
        for name, raw in params.items():
            if name in AUTO_PARAMETERS and raw.strip().lower() == "auto":
                values[name] = AUTO
                continue
            try:
                values[name] = converters[types[name]](raw)
            except ValueError:
                raise ValueError(f"parameter {name} must be {types[name]}; got {raw!r}") from None
        return cls(**{**values, **fixed})


def _bool(raw: str) -> bool:
    if raw.strip().lower() not in ("true", "false"):
        raise ValueError(raw)
    return raw.strip().lower() == "true"
