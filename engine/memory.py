"""The KV cache's size: as configured, or (`kv_cache_tokens: auto`) sized to what can be live.

`auto` takes the smallest of three ceilings, each stated in the start-up line (`CachePlan.reason`):

- live: what `max_num_seqs` sequences of the model's full context can ever hold. More cache than
  that is never used (the shipped 512-token model on a 141 GB GPU would otherwise take ~65 M
  tokens, 2000x what 64 sequences can use).
- memory: `kv_cache_memory_fraction` of the device memory free before the model loads, less the
  weights (the exported files' size) and less the step's activations at `max_num_batched_tokens`,
  estimated from the model's shape (`activation_bytes`). As vLLM's `gpu_memory_utilization`.
- index: ONNX Runtime 1.20's CUDA Gather computes offsets in 32 bits, and the step gathers from
  the cache flattened to [L*H*N, D], so that view must stay under 2^31 elements. A configured size
  beyond it is refused with the numbers; `auto` is capped.

ONNX Runtime's CUDA arena (weights and activations; the cache itself is torch memory bound by
pointer) is bounded by the same estimate: `CachePlan.arena_bytes`, which the runner sets as the
provider's `gpu_mem_limit`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from batchstring.export.layout import SHARED_WEIGHTS, SMALL_STEP_GRAPH

GIB = 2**30
INDEX_LIMIT = 2**31  # elements a 32-bit Gather offset can address
ACTIVATION_MARGIN = 1.25  # workspace and fragmentation beyond the tensors counted
SMALL_STEP_SESSION_BYTES = 256 << 20  # weights up to which the CPU gives small steps a session of their own


def free_bytes(device: str) -> tuple[int, str]:
    """Free memory on `device` and where the figure comes from."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free, f"{device} free memory (torch.cuda.mem_get_info)"
    return _host_available(), "host memory available (/proc/meminfo)"


def _host_available() -> int:
    """MemAvailable, read directly so that the engine needs no psutil (the GPU check runs without it)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("kv_cache_tokens auto: /proc/meminfo has no MemAvailable; set kv_cache_tokens to a number")


def small_step_graph(model_dir: Path, runtime: str, device: str, threads: int) -> str | None:
    """The graph of the CPU's second ONNX Runtime session, for small steps (engine/runner.py
    OnnxRunner), or None where there is none: only with `threads` 0, and only for weights up to
    SMALL_STEP_SESSION_BYTES. The session saves operators, which is what a small model's step costs;
    a real-size model's step reads its weights, so a second copy of them buys little
    (docs/configuration.md, `threads`)."""
    if runtime == "torchscript" or device != "cpu" or threads != 0:
        return None
    if _session_bytes(model_dir / "model.onnx") > SMALL_STEP_SESSION_BYTES:
        return None
    return SMALL_STEP_GRAPH if (model_dir / SMALL_STEP_GRAPH).exists() else "model.onnx"


def weight_bytes(model_dir: Path, runtime: str, device: str = "cpu", threads: int = 1) -> int:
    """What the runtime will hold: the ONNX graph and its external data, or the TorchScript file;
    and the small-step session's copy where there is one. A session holds its own copy even where
    the two graphs read one file (export/shared_weights.py): each prepacks them for its kernels."""
    if runtime == "torchscript":
        return _size(model_dir / "model.pt")
    small = small_step_graph(model_dir, runtime, device, threads)
    return sum(_session_bytes(model_dir / graph) for graph in ("model.onnx", small) if graph)


def _session_bytes(graph: Path) -> int:
    return _size(graph) + _size(_weights_of(graph))


def _weights_of(graph: Path) -> Path:
    """The external data a graph reads: its own file, or the export's one shared file."""
    own = graph.with_name(f"{graph.name}.data")
    return own if own.exists() else graph.with_name(SHARED_WEIGHTS)


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def activation_bytes(spec, max_num_batched_tokens: int, max_num_seqs: int, max_past: int) -> int:
    """Peak memory of one step beyond weights and cache, from the model's shape.

    Counted: one layer's tensors over the packed tokens (hidden states, q/k/v, the MLP's gate and
    up projections), the new keys/values the step returns for every layer, the blocks one layer
    gathers for `max_num_seqs` decoding rows of up to `max_past` past tokens each (rows sharing a
    prefix gather its blocks each) with their float32 scores and probabilities, the float32
    scores and probabilities of `max_num_batched_tokens` prefill queries over a past of
    `max_past` (a long prompt's last chunks: the room a long request needs), and the sampler's
    float32 vocabulary rows; times ACTIVATION_MARGIN for the runtime's workspace.
    """
    size = spec.dtype_bytes
    tokens, rows = max_num_batched_tokens, max_num_seqs
    q_heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    per_token = 4 * spec.hidden_size + (q_heads + 2 * kv_heads) * dim + 3 * spec.intermediate_size
    packed = tokens * per_token * size
    new_kv = 2 * spec.num_layers * kv_heads * tokens * dim * size
    gathered = rows * max_past * (2 * kv_heads * dim * size + 2 * q_heads * 4)
    prefill_scores = tokens * max_past * 2 * q_heads * 4
    sampler = min(rows, tokens) * spec.vocab_size * 4 * 4
    return int((packed + new_kv + gathered + prefill_scores + sampler) * ACTIVATION_MARGIN)


def index_ceiling(spec) -> int:
    """Most cache slots whose flattened [L*H*N, D] view stays under 2^31 elements."""
    return (INDEX_LIMIT - 1) // (spec.num_layers * spec.num_kv_heads * spec.head_dim)


@dataclass(frozen=True)
class CachePlan:
    """The KV cache's size in tokens, the memory set aside beside it, and why (the start-up line)."""

    tokens: int
    reason: str
    activation_bytes: int = 0  # the step's estimated peak at max_num_batched_tokens
    arena_bytes: int = 0  # ONNX Runtime's CUDA arena limit (weights + activations); 0 = not bounded


def _indexed(config) -> bool:
    """Whether the runtime gathers with 32-bit offsets: ONNX Runtime on CUDA (1.20, the image's)."""
    return config.runtime == "onnxruntime" and config.device.startswith("cuda")


def _blocks(tokens: int, block_size: int) -> int:
    return tokens // block_size * block_size


def plan_cache(config, spec, model_dir: Path) -> CachePlan:
    """`kv_cache_tokens` as configured (checked against the index ceiling), or `auto`."""
    weights = weight_bytes(model_dir, config.runtime, config.device, config.threads)
    if config.kv_cache_tokens:
        return configured_plan(config, spec, weights)
    free, source = free_bytes(config.device)
    return auto_plan(config, spec, weights, free, source)


def configured_plan(config, spec, weights: int) -> CachePlan:
    tokens = config.kv_cache_tokens
    if _indexed(config) and tokens > index_ceiling(spec):
        raise ValueError(
            f"kv_cache_tokens {tokens} is more than ONNX Runtime on CUDA can index: the cache flattened to "
            f"[layers x kv_heads x slots, head_dim] = [{spec.num_layers} x {spec.num_kv_heads} x {tokens}, "
            f"{spec.head_dim}] has {spec.num_layers * spec.num_kv_heads * tokens * spec.head_dim:,} elements, "
            f"at most {INDEX_LIMIT - 1:,} are allowed (32-bit Gather offsets). Set kv_cache_tokens to at most "
            f"{_blocks(index_ceiling(spec), config.block_size)}, or auto, or use runtime torchscript"
        )
    activations = activation_bytes(spec, config.max_num_batched_tokens, config.max_num_seqs,
                                   min(spec.context_length, tokens))
    arena = weights + activations if _indexed(config) else 0
    return CachePlan(tokens, f"kv_cache_tokens {tokens} as configured ({tokens * spec.bytes_per_token / GIB:.2f} "
                             f"GiB); step activations ~{activations / GIB:.2f} GiB (estimated)"
                             + _arena_text(arena), activations, arena)


def auto_plan(config, spec, weights: int, free: int, source: str) -> CachePlan:
    """The smallest of the live, memory and index ceilings, in whole blocks; refused under one context."""
    block = config.block_size
    live = -(-config.max_num_seqs * spec.context_length // block) * block
    ceilings = {f"live ({config.max_num_seqs} sequences x {spec.context_length}-token context)": live}
    if _indexed(config):
        ceilings["index (ONNX Runtime CUDA: 32-bit Gather offsets)"] = _blocks(index_ceiling(spec), block)
    upper = min(ceilings.values())
    activations = activation_bytes(spec, config.max_num_batched_tokens, config.max_num_seqs,
                                   min(spec.context_length, upper))
    budget = int(free * config.kv_cache_memory_fraction) - weights - activations
    fits = _blocks(max(0, budget) // spec.bytes_per_token, block)
    ceilings[f"memory ({config.kv_cache_memory_fraction:g} of {source} {free / GIB:.2f} GiB, less "
             f"{weights / GIB:.2f} GiB weights and ~{activations / GIB:.2f} GiB step activations at "
             f"max_num_batched_tokens {config.max_num_batched_tokens}, estimated from the model's shape)"] = fits
    tokens = min(ceilings.values())
    if tokens < spec.context_length:
        raise ValueError(
            f"kv_cache_tokens auto: room for {tokens} cached tokens ({spec.bytes_per_token} bytes each), less than "
            f"one full context ({spec.context_length} tokens). Ceilings: "
            + "; ".join(f"{name}: {value}" for name, value in ceilings.items())
            + ". Free memory on the device, raise kv_cache_memory_fraction, lower max_num_seqs or "
            "max_num_batched_tokens, export in 16 bits, or set kv_cache_tokens to a number"
        )
    binding = next(name for name, value in ceilings.items() if value == tokens)
    others = "; ".join(f"{name}: {value:,}" for name, value in ceilings.items() if name != binding)
    arena = weights + activations if _indexed(config) else 0
    reason = (f"auto: {tokens:,} tokens ({tokens * spec.bytes_per_token / GIB:.2f} GiB), set by the {binding} "
              f"ceiling; other ceilings: {others}" + _arena_text(arena))
    return CachePlan(tokens, reason, activations, arena)


def _arena_text(arena: int) -> str:
    return f"; ONNX Runtime CUDA arena limited to {arena / GIB:.2f} GiB" if arena else ""
