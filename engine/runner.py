"""Runs the exported step on a batch, reading and writing the paged KV cache.

The cache is preallocated once as [layers, kv_heads, slots, head_dim] per K and V, where a slot
is one token position of one block. A step hands the graph the whole cache plus each row's past
slots (the graph gathers what it attends to, layer by layer), then writes the new tokens'
keys/values into the slots the block manager assigned. Nothing is allocated per sequence, and
only token ids and log-probabilities come back to the host: vocabulary-sized tensors stay in
the runtime (on a GPU, on the device).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from batchstring.engine.batch import StepBatch

FETCHED = ("next_tokens", "token_logprobs", "top_ids", "top_logprobs", "new_keys", "new_values")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class RuntimeSpec:
    """The model facts `batchstring export` wrote to runtime.json."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    eos_token_ids: tuple[int, ...]
    inputs: tuple[str, ...]
    dtype: str = "float32"
    sampling_defaults: dict = field(default_factory=dict)  # the checkpoint's generation_config defaults

    @classmethod
    def load(cls, path: Path) -> RuntimeSpec:
        raw = json.loads(path.read_text())
        if "next_tokens" not in raw.get("outputs", []):
            raise RuntimeError(f"{path.parent} holds a step exported by an older batchstring; run `batchstring export`")
        return cls(raw["num_layers"], raw["num_kv_heads"], raw["head_dim"], raw["vocab_size"], raw["context_length"],
                   tuple(raw["eos_token_ids"]), tuple(raw["inputs"]), raw.get("dtype", "float32"),
                   raw.get("sampling_defaults", {}))

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]  # K and V

    def cache_shape(self, num_slots: int) -> tuple[int, int, int, int]:
        return (self.num_layers, self.num_kv_heads, num_slots, self.head_dim)


@dataclass(frozen=True)
class StepOutput:
    tokens: np.ndarray  # [R] int64: the next token of each sampled row
    logprobs: np.ndarray  # [M] float32: for the rows of feeds["sample_rows"], their token's log-probability
    top_ids: np.ndarray  # [M, n]: for the rows of feeds["sample_rows"], the most likely tokens
    top_logprobs: np.ndarray  # [M, n]


class PagedCacheRunner:
    """What every runtime shares: one step = run the graph, then write the new K/V to their slots."""

    spec: RuntimeSpec

    def step(self, batch: StepBatch) -> StepOutput:
        tokens, logprobs, top_ids, top_logprobs, new_keys, new_values = self._run(batch.feeds)
        self._write(batch.write_slots, new_keys, new_values)
        return StepOutput(tokens, logprobs, top_ids, top_logprobs)

    def _run(self, feeds: dict[str, np.ndarray]) -> tuple:
        raise NotImplementedError

    def _write(self, slots: np.ndarray, new_keys, new_values) -> None:
        self.keys[:, :, slots] = new_keys
        self.values[:, :, slots] = new_values


def _ort_session(model_dir: Path, device: str, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads > 0:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(str(model_dir / "model.onnx"), options, providers=_ort_providers(device))


def _ort_providers(device: str) -> list:
    import onnxruntime as ort

    if device == "cpu":
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise RuntimeError(
            f"Triton placed this instance on {device} but onnxruntime has no CUDA provider; "
            "install onnxruntime-gpu (not onnxruntime) in the server image"
        )
    return [("CUDAExecutionProvider", {"device_id": int(device.split(":")[1])}), "CPUExecutionProvider"]


def _numpy_dtype(spec: RuntimeSpec):
    if spec.dtype == "bfloat16":
        raise RuntimeError("onnxruntime cannot hold a bfloat16 cache in host memory; "
                           "serve bfloat16 exports with runtime torchscript")
    return np.dtype(spec.dtype)


class OnnxRunner(PagedCacheRunner):
    """ONNX Runtime on the CPU; the cache is host memory (numpy), handed over without a copy."""

    def __init__(self, model_dir: Path, spec: RuntimeSpec, num_slots: int, device: str, threads: int) -> None:
        self.session = _ort_session(model_dir, device, threads)
        self.spec = spec
        # full(), not zeros(): touch every page now, so resident memory is flat from the start
        self.keys = np.full(spec.cache_shape(num_slots), 0.0, _numpy_dtype(spec))
        self.values = np.full(spec.cache_shape(num_slots), 0.0, _numpy_dtype(spec))

    def _run(self, feeds: dict[str, np.ndarray]) -> tuple:
        # The caches are passed by reference: onnxruntime reads numpy memory in place.
        return self.session.run(FETCHED, {**feeds, "key_cache": self.keys, "value_cache": self.values})


class OnnxCudaRunner(PagedCacheRunner):
    """ONNX Runtime's CUDA provider with the cache resident on the GPU.

    onnxruntime cannot write into an input in place, so the cache is a pair of torch CUDA tensors:
    bound to the session by pointer (I/O binding; no cache byte crosses PCIe), and updated with
    torch's indexed assignment after each step. The logits output is bound to device memory too;
    only token ids and log-probabilities are copied to the host.
    """

    def __init__(self, model_dir: Path, spec: RuntimeSpec, num_slots: int, device: str, threads: int) -> None:
        import torch

        self.session = _ort_session(model_dir, device, threads)
        self.torch = torch
        self.device = torch.device(device)
        self.spec = spec
        self.dtype = getattr(torch, spec.dtype)
        self.keys = torch.zeros(spec.cache_shape(num_slots), dtype=self.dtype, device=self.device)
        self.values = torch.zeros_like(self.keys)

    def _bind(self, binding, name: str, tensor, output: bool = False) -> None:
        bind = binding.bind_output if output else binding.bind_input
        element = np.float32 if tensor.dtype == self.torch.float32 else np.float16
        bind(name, "cuda", self.device.index or 0, element, list(tensor.shape), tensor.data_ptr())

    def _run(self, feeds: dict[str, np.ndarray]) -> tuple:
        torch = self.torch
        spec = self.spec
        tokens, rows = len(feeds["input_ids"]), len(feeds["logit_tokens"])
        new_k = torch.empty((spec.num_layers, spec.num_kv_heads, tokens, spec.head_dim), dtype=self.dtype,
                            device=self.device)
        new_v = torch.empty_like(new_k)
        logits = torch.empty((rows, spec.vocab_size), dtype=torch.float32, device=self.device)
        binding = self.session.io_binding()
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        self._bind(binding, "key_cache", self.keys)
        self._bind(binding, "value_cache", self.values)
        for name in FETCHED[:4]:  # small: onnxruntime allocates them in host memory
            binding.bind_output(name, "cpu")
        for name, tensor in (("logits", logits), ("new_keys", new_k), ("new_values", new_v)):
            self._bind(binding, name, tensor, output=True)
        torch.cuda.current_stream(self.device).synchronize()  # last step's cache writes are visible
        self.session.run_with_iobinding(binding)
        small = binding.get_outputs()[:4]  # in the order bound
        return (*(value.numpy() for value in small), new_k, new_v)

    def _write(self, slots: np.ndarray, new_keys, new_values) -> None:
        index = self.torch.from_numpy(slots).to(self.device)
        self.keys[:, :, index] = new_keys
        self.values[:, :, index] = new_values


class TorchScriptRunner(PagedCacheRunner):
    """The TorchScript step on the instance's device; the cache stays on that device."""

    def __init__(self, model_dir: Path, spec: RuntimeSpec, num_slots: int, device: str, threads: int) -> None:
        import torch

        if threads > 0:
            torch.set_num_threads(threads)
        # The profiling executor re-optimises for every new input shape; our shapes change every
        # step, so it would spend its time recompiling. Plain interpretation of the trace is faster.
        torch._C._get_graph_executor_optimize(False)
        self.torch = torch
        self.device = torch.device(device)
        with warnings.catch_warnings():  # torch 2.13 deprecates TorchScript; see export/artifacts.py
            warnings.simplefilter("ignore", DeprecationWarning)
            self.module = torch.jit.load(str(model_dir / "model.pt"), map_location=self.device).eval()
        self.spec = spec
        self.names = [n for n in spec.inputs if n not in ("key_cache", "value_cache")]
        self.keys = torch.zeros(spec.cache_shape(num_slots), dtype=getattr(torch, spec.dtype), device=self.device)
        self.values = torch.zeros_like(self.keys)

    def _run(self, feeds: dict[str, np.ndarray]) -> tuple:
        torch = self.torch
        inputs = [torch.from_numpy(feeds[n]).to(self.device, non_blocking=True) for n in self.names]
        with torch.inference_mode():
            tokens, logprobs, top_ids, top_logprobs, _, new_k, new_v = self.module(*inputs, self.keys, self.values)
        return (*(t.cpu().numpy() for t in (tokens, logprobs, top_ids, top_logprobs)), new_k, new_v)

    def _write(self, slots: np.ndarray, new_keys, new_values) -> None:
        index = self.torch.from_numpy(slots).to(self.device)
        with self.torch.inference_mode():
            self.keys[:, :, index] = new_keys
            self.values[:, :, index] = new_values


def build_runner(runtime: str, model_dir: Path, spec: RuntimeSpec, num_slots: int, device: str,
                 threads: int) -> PagedCacheRunner:
    kind = TorchScriptRunner if runtime == "torchscript" else OnnxRunner if device == "cpu" else OnnxCudaRunner
    return kind(model_dir, spec, num_slots, device, threads)
