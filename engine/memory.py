"""`kv_cache_tokens: auto`: the KV cache sized from the memory that is actually free.

A fixed token count is right for one model on one device only. As vLLM's
`gpu_memory_utilization`, the cache takes a fraction of the device's memory: here, of what is free
before the model loads, less the weights (the size of the exported files, which the runtime
holds once). What the fraction leaves is for activations and the runtime's workspace.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

GIB = 2**30
WEIGHT_FILES = ("model.onnx", "model.onnx.data", "model.pt")


def free_bytes(device: str) -> tuple[int, str]:
    """Free memory on `device` and where the figure comes from."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free, f"{device} free memory (torch.cuda.mem_get_info)"
    import psutil

    return psutil.virtual_memory().available, "host memory available (psutil)"


def weight_bytes(model_dir: Path, runtime: str) -> int:
    """What the runtime will hold: the ONNX graph and its external data, or the TorchScript file."""
    names = ("model.pt",) if runtime == "torchscript" else ("model.onnx", "model.onnx.data")
    return sum((model_dir / n).stat().st_size for n in names if (model_dir / n).exists())


def auto_cache_tokens(free: int, fraction: float, weights: int, bytes_per_token: int, block_size: int,
                      context_length: int, source: str) -> int:
    """Whole blocks of the memory the fraction allows, beyond the weights; at least one full context."""
    budget = int(free * fraction) - weights
    tokens = max(0, budget // bytes_per_token) // block_size * block_size
    if tokens < context_length:
        raise ValueError(
            f"kv_cache_tokens auto: {source} is {free / GIB:.2f} GiB; x kv_cache_memory_fraction {fraction:g} "
            f"less {weights / GIB:.2f} GiB of weights leaves room for {tokens} cached tokens "
            f"({bytes_per_token} bytes each), less than one full context ({context_length} tokens). "
            "Free memory on the device, raise kv_cache_memory_fraction, export in 16 bits, "
            "or set kv_cache_tokens to a number"
        )
    return tokens


@dataclass(frozen=True)
class CachePlan:
    """The KV cache's size in tokens, and how it was chosen (for the start-up line)."""

    tokens: int
    reason: str


def plan_cache(config, spec, model_dir: Path) -> CachePlan:
    """`kv_cache_tokens` as configured, or sized from free memory when it is `auto` (0)."""
    if config.kv_cache_tokens:
        return CachePlan(config.kv_cache_tokens, "kv_cache_tokens as configured")
    free, source = free_bytes(config.device)
    tokens = auto_cache_tokens(free, config.kv_cache_memory_fraction, weight_bytes(model_dir, config.runtime),
                               spec.bytes_per_token, config.block_size, spec.context_length, source)
    return CachePlan(tokens, f"auto: {config.kv_cache_memory_fraction:g} of {source}, less the weights")
