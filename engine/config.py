"""Engine settings, parsed from the `parameters` block of config.pbtxt (all strings there)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path

RUNTIMES = ("onnxruntime", "torchscript")
SCHEDULING = ("continuous", "static")
FAULT_MODES = ("", "fail_steps", "raise_in_send")


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Path
    runtime: str = "onnxruntime"
    device: str = "cpu"  # set from the instance Triton created, never from the config
    scheduling: str = "continuous"
    max_num_seqs: int = 64  # sequences resident in one step
    max_waiting_seqs: int = 64  # accepted, not yet admitted; beyond it requests wait in Triton's queue
    kv_cache_tokens: int = 32768  # cache budget; x runtime bytes_per_token = memory
    block_size: int = 16  # tokens per KV-cache block
    max_prefill_tokens: int = 4096  # padded tokens in one prefill step (bounds its latency)
    max_input_bytes: int = 16384  # text_input larger than this is refused before tokenizing
    default_max_tokens: int = 16  # vLLM's default when sampling_parameters has no max_tokens
    oom_backoff_seconds: float = 30.0  # after a real OOM, admit at most half the failing batch this long
    fault_marker: str = ""  # test-only: a prompt containing it makes its step raise an OOM-style error
    fault_mode: str = ""  # test-only: "fail_steps" (every step raises) or "raise_in_send" (every response fails)
    threads: int = 0  # intra-op threads for the runtime; 0 = the runtime's default

    def __post_init__(self) -> None:
        if self.runtime not in RUNTIMES:
            raise ValueError(f"parameter runtime must be one of {RUNTIMES}; got {self.runtime!r}")
        if self.fault_mode not in FAULT_MODES:
            raise ValueError(f"parameter fault_mode must be one of {FAULT_MODES}; got {self.fault_mode!r}")
        if self.scheduling not in SCHEDULING:
            raise ValueError(f"parameter scheduling must be one of {SCHEDULING}; got {self.scheduling!r}")
        positive = ("max_num_seqs", "max_waiting_seqs", "kv_cache_tokens", "block_size", "max_prefill_tokens",
                    "max_input_bytes", "default_max_tokens")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"parameter {name} must be >= 1; got {getattr(self, name)}")

    @classmethod
    def from_parameters(cls, params: dict[str, str], **fixed) -> EngineConfig:
        """Typed view of string parameters; unknown names are an error, not silently ignored."""
        types = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(params) - set(types) - set(fixed))
        if unknown:
            raise ValueError(f"unknown engine parameter(s) {unknown}; known: {sorted(types)}")
        converters = {"int": int, "float": float, "str": str, "Path": Path}
        values = {}
        for name, raw in params.items():
            try:
                values[name] = converters[types[name]](raw)
            except ValueError:
                raise ValueError(f"parameter {name} must be {types[name]}; got {raw!r}") from None
        return cls(**{**values, **fixed})

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)
