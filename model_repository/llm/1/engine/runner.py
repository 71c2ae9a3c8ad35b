"""Runs the exported decoder step on a batch, reading and writing the paged KV cache.

The cache is preallocated once as [layers, kv_heads, slots, head_dim] per K and V, where a slot
is one token position of one block. A step hands the graph the whole cache plus each row's past
slots (the graph gathers what it attends to, layer by layer), then writes the new tokens'
keys/values into the slots the block manager assigned. Nothing is allocated per sequence.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from engine.sequence import Sequence


@dataclass(frozen=True)
class RuntimeSpec:
    """The model facts `batchstring export` wrote to runtime.json."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def load(cls, path: Path) -> RuntimeSpec:
        raw = json.loads(path.read_text())
        return cls(raw["num_layers"], raw["num_kv_heads"], raw["head_dim"], raw["vocab_size"],
                   raw["context_length"], tuple(raw["eos_token_ids"]))

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4  # K and V, float32


@dataclass(frozen=True)
class StepBatch:
    """The padded tensors of one step plus where the new K/V go (see export/step.py)."""

    input_ids: np.ndarray  # [B, S] left-padded
    position_ids: np.ndarray  # [B, S]
    attention_mask: np.ndarray  # [B, P + S]
    past_slots: np.ndarray  # [B, P] cache slot of each past position (padding -> slot 0, masked)

    write_rows: np.ndarray  # [T] row of each real new token
    write_cols: np.ndarray  # [T] column (in S) of each real new token
    write_slots: np.ndarray  # [T] cache slot it is written to

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]


def build_batch(seqs: list[Sequence], block_size: int) -> StepBatch:
    """Feeds each sequence's pending tokens on top of its cached ones (prefill and decode alike)."""
    pasts = [s.num_cached for s in seqs]
    news = [s.num_tokens - s.num_cached for s in seqs]
    b, p, s = len(seqs), max(pasts), max(news)
    input_ids = np.zeros((b, s), np.int64)
    position_ids = np.zeros((b, s), np.int64)
    mask = np.zeros((b, p + s), bool)
    past_slots = np.zeros((b, p), np.int64)
    rows, cols, slots = [], [], []
    for i, (seq, n_past, n_new) in enumerate(zip(seqs, pasts, news)):
        table = np.asarray(seq.blocks, np.int64)
        positions = np.arange(n_past + n_new)
        seq_slots = table[positions // block_size] * block_size + positions % block_size
        past_slots[i, :n_past] = seq_slots[:n_past]
        input_ids[i, s - n_new :] = seq.pending_ids
        position_ids[i, s - n_new :] = positions[n_past:]
        mask[i, :n_past] = True
        mask[i, p + s - n_new :] = True
        rows.append(np.full(n_new, i))
        cols.append(np.arange(s - n_new, s))
        slots.append(seq_slots[n_past:])
    return StepBatch(input_ids, position_ids, mask, past_slots,
                     np.concatenate(rows), np.concatenate(cols), np.concatenate(slots))


class Runner(Protocol):
    spec: RuntimeSpec

    def step(self, batch: StepBatch) -> np.ndarray:
        """Logits [B, V] for each row's last token; the new K/V are already in the cache."""
        ...


def _ort_session(model_dir: Path, device: str, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads > 0:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(str(model_dir / "model.onnx"), options, providers=_ort_providers(device))


class OnnxRunner:
    """ONNX Runtime on the CPU; the cache is host memory (numpy), handed over without a copy."""

    def __init__(self, model_dir: Path, spec: RuntimeSpec, num_slots: int, device: str, threads: int) -> None:
        self.session = _ort_session(model_dir, device, threads)
        self.spec = spec
        shape = (spec.num_layers, spec.num_kv_heads, num_slots, spec.head_dim)
        # full(), not zeros(): touch every page now, so resident memory is flat from the start
        self.keys = np.full(shape, 0.0, np.float32)
        self.values = np.full(shape, 0.0, np.float32)

    def step(self, batch: StepBatch) -> np.ndarray:
        logits, new_k, new_v = self.session.run(None, {
            "input_ids": batch.input_ids,
            "position_ids": batch.position_ids,
            "attention_mask": batch.attention_mask,
            "past_slots": batch.past_slots,
            "key_cache": self.keys,  # passed by reference: onnxruntime reads numpy memory in place
            "value_cache": self.values,
        })
        self.keys[:, :, batch.write_slots] = new_k[:, :, batch.write_rows, batch.write_cols]
        self.values[:, :, batch.write_slots] = new_v[:, :, batch.write_rows, batch.write_cols]
        return logits


class OnnxCudaRunner:
    """ONNX Runtime's CUDA provider with the cache resident on the GPU.

    onnxruntime cannot write into an input in place, so the cache is a pair of torch CUDA tensors:
    bound to the session by pointer (I/O binding; no cache byte crosses PCIe, only ids, masks and
    logits do), and updated with torch's indexed assignment after each step.
    """

    def __init__(self, model_dir: Path, spec: RuntimeSpec, num_slots: int, device: str, threads: int) -> None:
        import torch

        self.session = _ort_session(model_dir, device, threads)
        self.torch = torch
        self.device = torch.device(device)
        self.spec = spec
        shape = (spec.num_layers, spec.num_kv_heads, num_slots, spec.head_dim)
        self.keys = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.values = torch.zeros(shape, dtype=torch.float32, device=self.device)

    def _bind(self, binding, name: str, tensor, output: bool = False) -> None:
        bind = binding.bind_output if output else binding.bind_input
        bind(name, "cuda", self.device.index or 0, np.float32, list(tensor.shape), tensor.data_ptr())

    def step(self, batch: StepBatch) -> np.ndarray:
        torch = self.torch
        b, s = batch.input_ids.shape
        spec = self.spec
        logits = torch.empty((b, spec.vocab_size), dtype=torch.float32, device=self.device)
        new_k = torch.empty((spec.num_layers, spec.num_kv_heads, b, s, spec.head_dim), device=self.device)
        new_v = torch.empty_like(new_k)
        binding = self.session.io_binding()
        for name in ("input_ids", "position_ids", "attention_mask", "past_slots"):
            binding.bind_cpu_input(name, getattr(batch, name))
        self._bind(binding, "key_cache", self.keys)
        self._bind(binding, "value_cache", self.values)
        for name, tensor in (("logits", logits), ("new_keys", new_k), ("new_values", new_v)):
            self._bind(binding, name, tensor, output=True)
        torch.cuda.current_stream(self.device).synchronize()  # last step's cache writes are visible
        self.session.run_with_iobinding(binding)
        rows, cols, slots = (torch.from_numpy(a).to(self.device) for a in
                             (batch.write_rows, batch.write_cols, batch.write_slots))
        self.keys[:, :, slots] = new_k[:, :, rows, cols]
        self.values[:, :, slots] = new_v[:, :, rows, cols]
        return logits.cpu().numpy()


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


class TorchScriptRunner:
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
        shape = (spec.num_layers, spec.num_kv_heads, num_slots, spec.head_dim)
        self.keys = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.values = torch.zeros(shape, dtype=torch.float32, device=self.device)

    def step(self, batch: StepBatch) -> np.ndarray:
        torch = self.torch

        def dev(a: np.ndarray):
            return torch.from_numpy(a).to(self.device, non_blocking=True)

        past, slots = dev(batch.past_slots), dev(batch.write_slots)
        rows, cols = dev(batch.write_rows), dev(batch.write_cols)
        with torch.inference_mode():
            logits, new_k, new_v = self.module(
                dev(batch.input_ids), dev(batch.position_ids), dev(batch.attention_mask), past,
                self.keys, self.values,
            )
            self.keys[:, :, slots] = new_k[:, :, rows, cols]
            self.values[:, :, slots] = new_v[:, :, rows, cols]
        return logits.cpu().numpy()


def build_runner(runtime: str, model_dir: Path, spec: RuntimeSpec, num_slots: int, device: str, threads: int) -> Runner:
    kind = TorchScriptRunner if runtime == "torchscript" else OnnxRunner if device == "cpu" else OnnxCudaRunner
    return kind(model_dir, spec, num_slots, device, threads)
