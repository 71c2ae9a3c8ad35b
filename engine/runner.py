"""Runs the exported step on a batch, reading and writing the paged KV cache.

The cache is preallocated once as [layers, kv_heads, blocks, block_size, head_dim] per K and V.
A step hands the graph the whole cache and the whole block table (the graph gathers the blocks it
attends to, layer by layer), then writes the new tokens' keys/values into the slots (block x
block_size + offset) the block manager assigned. On the CPU the table is the engine's own array,
read in place; on a GPU it is a device copy that each step updates with the entries written since
the last one (`DeviceTable`). Nothing is allocated per sequence, and only token ids and
log-probabilities come back to the host: vocabulary-sized tensors stay in the runtime (on a GPU,
on the device).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from batchstring.engine.adapters import AdapterSlots
from batchstring.engine.batch import SMALL_STEP_TOKENS, StepBatch
from batchstring.engine.block_table import BlockTable
from batchstring.engine.cores import available_cores
from batchstring.engine.cuda_graph_padding import PaddedStep, pad_decode
from batchstring.engine.memory import small_step_graph
from batchstring.export.contract import (
    FETCHED,
    INPUT_NAMES,
    OUTPUT_NAMES,
    AdapterWeights,
    Held,
    StepInputs,
    arguments,
    no_adapters,
)

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
    # the shape beyond the cache, for the activation estimate (engine/memory.py)
    num_heads: int = 0
    hidden_size: int = 0
    intermediate_size: int = 0
    sliding_windows: tuple[int | None, ...] = ()  # per layer (None: every past token)
    adapter_sites: dict[str, tuple[int, int]] = field(default_factory=dict)  # (in, out) of each adaptable projection
    source: str = ""  # the checkpoint it was exported from (adapters name their base model)
    adapters: bool = False  # the step applies LoRA adapters (`batchstring export --adapters`)

    @classmethod
    def load(cls, path: Path) -> RuntimeSpec:
        raw = json.loads(path.read_text())
        if tuple(raw.get("inputs", ())) != INPUT_NAMES or tuple(raw.get("outputs", ())) != OUTPUT_NAMES:
            raise RuntimeError(f"{path.parent} holds a step exported by another batchstring (its inputs and outputs "
                               "are not this engine's); export it again with `batchstring export`")
        # Exports before hidden_size was recorded: query heads x head dim, and a 4x MLP (an upper bound).
        hidden = raw.get("hidden_size", raw["num_heads"] * raw["head_dim"])
        return cls(raw["num_layers"], raw["num_kv_heads"], raw["head_dim"], raw["vocab_size"], raw["context_length"],
                   tuple(raw["eos_token_ids"]), tuple(raw["inputs"]), raw.get("dtype", "float32"),
                   raw.get("sampling_defaults", {}), raw["num_heads"], hidden,
                   raw.get("intermediate_size", 4 * hidden), tuple(raw.get("sliding_windows", ())),
                   {site: tuple(features) for site, features in raw.get("adapter_sites", {}).items()},
                   raw.get("source", ""), bool(raw.get("adapters", False)))

    @property
    def window(self) -> int | None:
        """How far back any layer reads, if every layer has a sliding window (else None)."""
        windows = self.sliding_windows
        return max(windows) if windows and all(windows) else None

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes  # K and V

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.num_kv_heads, num_blocks, block_size, self.head_dim)


@dataclass(frozen=True)
class StepOutput:
    tokens: np.ndarray  # [R] int64: the next token of each sampled row
    logprobs: np.ndarray  # [M] float32: for the rows of inputs.sampling.sample_rows, their token's log-probability
    top_ids: np.ndarray  # [M, n]: for those rows, the most likely tokens
    top_logprobs: np.ndarray  # [M, n]


class PagedCacheRunner:
    """What every runtime shares: one step = run the graph, then write the new K/V to their slots.

    The held inputs (`held`) are the block table, the caches and the resident adapters' weights,
    converted to the runtime's arrays once per change of the resident set (engine/adapters.py)."""

    spec: RuntimeSpec
    adapters: AdapterSlots | None = None  # the engine's, when it serves adapters
    _adapter_version: int = -1
    _adapter_weights: AdapterWeights | None = None
    _no_adapters: AdapterWeights | None = None

    def held(self, table, adapters: bool = True) -> Held:
        """The held inputs with `table` as the runtime takes it; `adapters` False: none resident.
        Per step this is a version check: the runtime's arrays are made when the set changes."""
        slots = self.adapters if adapters else None
        if slots is not None and slots.version != self._adapter_version:
            self._adapter_weights, self._adapter_version = slots.weights(self._device_array), slots.version
        weights = self._adapter_weights if slots is not None else None
        if weights is None:
            if self._no_adapters is None:
                self._no_adapters = no_adapters(self.spec.adapter_sites, self.spec.num_layers, self._zeros)
            weights = self._no_adapters
        return Held(table, self.keys, self.values, weights)

    def _device_array(self, array: np.ndarray):
        """A host array as the runtime's held input (numpy here; a tensor on the device for torch)."""
        return array

    def _zeros(self, shape: tuple):
        return self._device_array(np.zeros(shape, self.keys.dtype if isinstance(self.keys, np.ndarray) else np.float32))

    def step(self, batch: StepBatch) -> StepOutput:
        tokens, logprobs, top_ids, top_logprobs, new_keys, new_values = self._run(batch.inputs, batch.table)
        self._write(batch.write_slots, new_keys, new_values)
        return StepOutput(tokens, logprobs, top_ids, top_logprobs)

    def _run(self, inputs: StepInputs, table: BlockTable) -> tuple:
        raise NotImplementedError

    def _write(self, slots: np.ndarray, new_keys, new_values) -> None:
        """Cache slot s is token s % block_size of block s // block_size: a view of the cache
        as [layers, kv_heads, blocks x block_size, head_dim] takes the writes."""
        for cache, new in ((self.keys, new_keys), (self.values, new_values)):
            cache.reshape(*cache.shape[:2], -1, cache.shape[-1])[:, :, slots] = new


class DeviceTable:
    """A device copy of the engine's block table: copied whole at the first step, then each step
    writes only the entries the table's journal says changed (a handful of blocks appended), so
    what crosses to the device per step does not grow with the contexts."""

    def __init__(self, torch, device) -> None:
        self.torch, self.device = torch, device
        self.source: BlockTable | None = None
        self.tensor = None

    def sync(self, table: BlockTable):
        torch = self.torch
        if table is not self.source:
            table.journal()  # before the copy: every later write reaches the device
            table.drain()
            copy = torch.tensor(table.array, device=self.device)
            if self.tensor is not None and self.tensor.shape == copy.shape:
                self.tensor.copy_(copy)  # in place: a CUDA graph holds this tensor's address
            else:
                self.tensor = copy
            self.source = table
        index, blocks = table.drain()
        if len(index):
            try:
                self.tensor.view(-1)[torch.from_numpy(index).to(self.device)] = torch.from_numpy(blocks).to(self.device)
            except BaseException:
                self.source = None  # what was drained did not arrive: the next step copies the table whole
                raise
        return self.tensor


def _ort_session(model_dir: Path, device: str, threads: int, arena_bytes: int = 0, graph: str = "model.onnx",
                 spin: bool = False):
    """Intra-op threads spin between operators only where `spin` says so (the small-step session,
    see OnnxRunner). ONNX Runtime's default keeps every session's workers busy-waiting, which only
    pays on cores nobody else wants: a large step's parallel operators are long enough for a
    sleeping worker's wake-up not to matter, while a spinning one holds a core that tritonserver,
    the front door and the responder want (a batch-64 decode step on 2 busy cores, measured side
    by side: docs/benchmarks.md, one caller)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    if threads > 0:
        options.intra_op_num_threads = threads
    providers = ort_providers(device, ort.get_available_providers(), arena_bytes)
    session = ort.InferenceSession(str(model_dir / graph), options, providers=providers)
    check_providers(session, device)
    return session


def ort_providers(device: str, available: list[str], arena_bytes: int = 0) -> list:
    """The provider list for `device`: the CUDA provider on the instance's own GPU, its arena
    bounded by `arena_bytes` (engine/memory.py's plan; 0 = onnxruntime's default) and grown by what
    is asked rather than in doubling chunks."""
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in available:
        raise RuntimeError(
            f"Triton placed this instance on {device} but onnxruntime has no CUDA provider (it offers "
            f"{', '.join(available)}); install onnxruntime-gpu instead of onnxruntime (`pip uninstall onnxruntime` "
            "first: both install the same `onnxruntime` package), or use runtime torchscript"
        )
    options = {"device_id": int(device.split(":")[1]), "arena_extend_strategy": "kSameAsRequested"}
    if arena_bytes:
        options["gpu_mem_limit"] = arena_bytes
    return [("CUDAExecutionProvider", options), "CPUExecutionProvider"]


def check_providers(session, device: str) -> None:
    """ONNX Runtime drops a provider whose libraries fail to load and runs on the CPU instead,
    with a log line nobody reads: a session on a GPU instance without the CUDA provider is an error."""
    if device == "cpu" or "CUDAExecutionProvider" in session.get_providers():
        return
    raise RuntimeError(
        f"onnxruntime created the session for {device} without its CUDA provider (active: "
        f"{', '.join(session.get_providers())}): {cuda_provider_load_error()}. It would run on the CPU; "
        "install the CUDA and cuDNN libraries this onnxruntime-gpu was built for (importing torch first "
        "makes a CUDA build of torch provide them), or use runtime torchscript"
    )


def cuda_provider_load_error() -> str:
    """Why onnxruntime's CUDA provider library does not load: the dynamic loader names the library
    it could not find (e.g. libcublasLt.so.12), which onnxruntime's own fallback hides."""
    import ctypes

    import onnxruntime as ort

    library = Path(ort.__file__).parent / "capi" / "libonnxruntime_providers_cuda.so"
    if not library.exists():
        return f"onnxruntime {ort.__version__} has no CUDA provider library (the CPU-only package)"
    try:
        ctypes.CDLL(str(library))
    except OSError as exc:
        return f"loading {library.name} fails: {exc}"
    return f"{library.name} loads, so the provider failed to start on the device (see onnxruntime's log)"


# ONNX element types (onnx.TensorProto): onnxruntime's I/O binding takes these integers from 1.20 on,
# the only way to name bfloat16, which numpy has no type for.
ORT_ELEMENT_TYPES = {"float32": 1, "float16": 10, "bfloat16": 16}
ORT_INTEGER_ELEMENTS = (1, 20)


def ort_element_type(dtype: str, ort_version: str):
    """The element type to bind a `dtype` device buffer with, or a refusal that says what to use."""
    major, minor = (int(part) for part in ort_version.split(".")[:2])
    if (major, minor) >= ORT_INTEGER_ELEMENTS:
        return ORT_ELEMENT_TYPES[dtype]
    if dtype == "bfloat16":
        raise RuntimeError(
            f"onnxruntime {ort_version} cannot bind bfloat16 buffers (numpy has no bfloat16; integer element "
            "types arrived in onnxruntime 1.20): install onnxruntime-gpu >= 1.20, serve this export with "
            "runtime torchscript, or export it with --dtype float16"
        )
    return np.dtype(dtype).type


def _numpy_dtype(spec: RuntimeSpec):
    if spec.dtype == "bfloat16":
        raise RuntimeError("onnxruntime cannot hold a bfloat16 cache in host memory; "
                           "serve bfloat16 exports with runtime torchscript")
    return np.dtype(spec.dtype)


class OnnxRunner(PagedCacheRunner):
    """ONNX Runtime on the CPU; the cache is host memory (numpy), handed over without a copy.

    With `threads` 0 (the default) a step of at most SMALL_STEP_TOKENS tokens (every row in the
    prefill group: engine/batch.py) runs on a session of its own, on the small-step graph where the
    export wrote one (export/layout.py SMALL_STEP_GRAPH: the prefill group only, a quarter fewer
    operators), with `small_step_threads` intra-op threads (at most `available_cores`) that spin
    between operators. A small step is hundreds of operators of microseconds each: a worker that
    sleeps between them is woken for every parallel one (on a virtual machine, an interrupt to
    another core each time), which costs what the second core saves, while a spinning one is there
    at once (served, both variants alternating: docs/benchmarks.md, one caller). With other work on
    the cores it degrades to about one thread's speed. 1 = one thread, nothing spins. Large steps
    (which want every core) run on the other session, whose workers sleep; so does a longer step
    of one row (a lone prompt, packed for the small graph too), unless the small session has every
    core already: then its fewer operators on spinning threads prefill it in ~0.65x the time
    (docs/benchmarks.md, one caller).
    Both sessions hold the weights, so host memory holds them twice (engine/memory.py counts both):
    a fixed `threads`, or weights past SMALL_STEP_SESSION_BYTES, keep one session.
    """

    def __init__(self, model_dir: Path, spec: RuntimeSpec, num_blocks: int, block_size: int, device: str,
                 threads: int, small_step_threads: int = 1) -> None:
        self.session = _ort_session(model_dir, device, threads)
        self.small_session = self.session
        self.small_takes_lone_rows = False  # a lone row's step longer than SMALL_STEP_TOKENS goes to the small session
        small = small_step_graph(model_dir, "onnxruntime", device, threads)
        if small:
            workers = min(small_step_threads, available_cores())
            self.small_session = _ort_session(model_dir, device, workers, graph=small, spin=workers > 1)
            self.small_takes_lone_rows = workers >= available_cores()
        self.spec = spec
        # full(), not zeros(): touch every page now, so resident memory is flat from the start
        self.keys = np.full(spec.cache_shape(num_blocks, block_size), 0.0, _numpy_dtype(spec))
        self.values = np.full(spec.cache_shape(num_blocks, block_size), 0.0, _numpy_dtype(spec))

    def _run(self, inputs: StepInputs, table: BlockTable) -> tuple:
        # The caches and the block table are passed by reference: onnxruntime reads numpy memory in place.
        small = inputs.single_group and (inputs.tokens <= SMALL_STEP_TOKENS or self.small_takes_lone_rows)
        session = self.small_session if small else self.session
        return session.run(FETCHED, inputs.feeds(self.held(table.array)))


class OnnxCudaRunner(PagedCacheRunner):
    """ONNX Runtime's CUDA provider with the cache resident on the GPU.

    onnxruntime cannot write into an input in place, so the cache is a pair of torch CUDA tensors:
    bound to the session by pointer (I/O binding; no cache byte crosses PCIe), and updated with
    torch's indexed assignment after each step. The logits output is bound to device memory too;
    only token ids and log-probabilities are copied to the host. Every device buffer is bound with
    its real element type (bfloat16 included; `ort_element_type`).
    """

    def __init__(self, model_dir: Path, spec: RuntimeSpec, num_blocks: int, block_size: int, device: str,
                 threads: int, arena_bytes: int = 0) -> None:
        import onnxruntime as ort
        import torch  # before the session: a CUDA build of torch loads the CUDA libraries the provider needs

        self.elements = {dtype: ort_element_type(dtype, ort.__version__) for dtype in ("float32", spec.dtype)}
        self.session = _ort_session(model_dir, device, threads, arena_bytes)
        self.torch = torch
        self.device = torch.device(device)
        self.spec = spec
        self.dtype = getattr(torch, spec.dtype)
        self.keys = torch.zeros(spec.cache_shape(num_blocks, block_size), dtype=self.dtype, device=self.device)
        self.values = torch.zeros_like(self.keys)
        self.table = DeviceTable(torch, self.device)

    def _bind(self, binding, name: str, tensor, output: bool = False) -> None:
        bind = binding.bind_output if output else binding.bind_input
        dtype = str(tensor.dtype).removeprefix("torch.")
        element = np.int64 if dtype == "int64" else self.elements[dtype]
        bind(name, "cuda", self.device.index or 0, element, list(tensor.shape), tensor.data_ptr())

    def _run(self, inputs: StepInputs, table: BlockTable) -> tuple:
        torch = self.torch
        spec = self.spec
        tokens, rows = inputs.tokens, inputs.rows
        new_k = torch.empty((spec.num_layers, spec.num_kv_heads, tokens, spec.head_dim), dtype=self.dtype,
                            device=self.device)
        new_v = torch.empty_like(new_k)
        logits = torch.empty((rows, spec.vocab_size), dtype=torch.float32, device=self.device)
        binding = self.session.io_binding()
        for name, array in inputs.arrays().items():
            binding.bind_cpu_input(name, array)
        for name, tensor in self.held(self.table.sync(table)).named().items():
            self._bind(binding, name, tensor)
        for name in FETCHED[:4]:  # small: onnxruntime allocates them in host memory
            binding.bind_output(name, "cpu")
        for name, tensor in (("logits", logits), ("new_keys", new_k), ("new_values", new_v)):
            self._bind(binding, name, tensor, output=True)
        torch.cuda.current_stream(self.device).synchronize()  # last step's cache writes are visible
        self.session.run_with_iobinding(binding)
        small = binding.get_outputs()[:4]  # in the order bound
        return (*(value.numpy() for value in small), new_k, new_v)

    def _write(self, slots: np.ndarray, new_keys, new_values) -> None:
        super()._write(self.torch.from_numpy(slots).to(self.device), new_keys, new_values)

    def _device_array(self, array: np.ndarray):
        return self.torch.from_numpy(array).to(self.device, self.dtype)


class TorchScriptRunner(PagedCacheRunner):
    """The TorchScript step on the instance's device; the cache stays on that device.

    With `cuda_graphs` on a CUDA device, decode steps that fit a bucket (engine/cuda_graph_padding.py) are
    replayed from CUDA graphs (`CudaGraphs`), the cache write inside the graph; the cache gets one
    scratch block more, which the padding rows write to."""

    def __init__(self, model_dir: Path, spec: RuntimeSpec, num_blocks: int, block_size: int, device: str,
                 threads: int, cuda_graphs: bool = False) -> None:
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
        graphs = cuda_graphs and self.device.type == "cuda"
        self.keys = torch.zeros(spec.cache_shape(num_blocks + graphs, block_size), dtype=getattr(torch, spec.dtype),
                                device=self.device)
        self.values = torch.zeros_like(self.keys)
        self.table = DeviceTable(torch, self.device)
        self.graphs = CudaGraphs(self, num_blocks * block_size) if graphs else None

    def step(self, batch: StepBatch) -> StepOutput:
        # A CUDA graph is captured with no adapter resident: steps with adapter rows run plainly.
        adapted = len(batch.inputs.adapter_index)
        padded = self.graphs and not adapted and pad_decode(batch, self.keys.shape[3], self.graphs.scratch_slot)
        if not padded:
            return super().step(batch)
        return self.graphs.replay(padded, self.table.sync(batch.table))

    def _run(self, inputs: StepInputs, table: BlockTable) -> tuple:
        with self.torch.inference_mode():
            tokens, logprobs, top_ids, top_logprobs, _, new_k, new_v = self._call(self._inputs(inputs, table))
        return (*(t.cpu().numpy() for t in (tokens, logprobs, top_ids, top_logprobs)), new_k, new_v)

    def _inputs(self, inputs: StepInputs, table) -> list:
        """The step's arguments on the device, in order; `table` a device table or a BlockTable."""
        table = table if isinstance(table, self.torch.Tensor) else self.table.sync(table)
        torch = self.torch
        return inputs.positional(self.held(table),
                                 lambda array: torch.as_tensor(array).to(self.device, non_blocking=True))

    def _call(self, inputs: list) -> tuple:
        return self.module(*inputs)

    def _write(self, slots, new_keys, new_values) -> None:
        with self.torch.inference_mode():
            index = slots if isinstance(slots, self.torch.Tensor) else self.torch.from_numpy(slots).to(self.device)
            super()._write(index, new_keys, new_values)

    def _device_array(self, array: np.ndarray):
        return self.torch.from_numpy(array).to(self.device, self.keys.dtype)


class CudaGraphs:
    """Decode steps replayed from CUDA graphs, one per bucket (engine/cuda_graph_padding.py), captured the
    first time a bucket comes up: the step and its cache write, on static input buffers that each
    replay refills. The graphs share one memory pool (one replays at a time). Off by default
    (`cuda_graphs`): capture is verified by `make gpu-check` on a GPU, not on the CPU."""

    def __init__(self, runner: TorchScriptRunner, scratch_slot: int) -> None:
        self.runner = runner
        self.scratch_slot = scratch_slot  # the cache's extra block: where padding rows write
        self.captured: dict[tuple[int, int], tuple] = {}
        self.pool = None

    def replay(self, padded: PaddedStep, table) -> StepOutput:
        torch = self.runner.torch
        graph, buffers, slots, outputs = self.captured.get(padded.key) or self._capture(padded, table)
        for buffer, array in zip(buffers, padded.inputs.arrays().values()):
            buffer.copy_(torch.from_numpy(array), non_blocking=True)
        slots.copy_(torch.from_numpy(padded.write_slots), non_blocking=True)
        graph.replay()
        tokens, logprobs, top_ids, top_logprobs = (t.cpu().numpy() for t in outputs[:4])
        n, m = padded.rows, padded.sampled
        return StepOutput(tokens[:n], logprobs[:m], top_ids[:m], top_logprobs[:m])

    def _capture(self, padded: PaddedStep, table) -> tuple:
        runner, torch = self.runner, self.runner.torch
        buffers = [torch.as_tensor(array).to(runner.device) for array in padded.inputs.arrays().values()]  # static
        slots = torch.from_numpy(padded.write_slots).to(runner.device)
        ordered = arguments(buffers, runner.held(table, adapters=False))

        def step() -> tuple:
            outputs = runner._call(ordered)
            runner._write(slots, outputs[5], outputs[6])
            return outputs

        with torch.inference_mode():
            side = torch.cuda.Stream(runner.device)
            side.wait_stream(torch.cuda.current_stream(runner.device))
            with torch.cuda.stream(side):  # a first run off the capture: the allocator's and the kernels' set-up
                step()
            torch.cuda.current_stream(runner.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = step()
        self.pool = graph.pool()
        self.captured[padded.key] = (graph, buffers, slots, outputs)
        return self.captured[padded.key]


def build_runner(runtime: str, model_dir: Path, spec: RuntimeSpec, num_blocks: int, block_size: int, device: str,
                 threads: int, arena_bytes: int = 0, small_step_threads: int = 1,
                 cuda_graphs: bool = False) -> PagedCacheRunner:
    """`arena_bytes`: ONNX Runtime's CUDA arena limit (engine/memory.py's `CachePlan.arena_bytes`);
    `small_step_threads`: the CPU's small-step session (OnnxRunner); `cuda_graphs`: decode steps
    replayed from CUDA graphs (TorchScriptRunner on a GPU). The other runtimes ignore what is not theirs."""
    if runtime == "torchscript":
        return TorchScriptRunner(model_dir, spec, num_blocks, block_size, device, threads, cuda_graphs)
    if device != "cpu":
        return OnnxCudaRunner(model_dir, spec, num_blocks, block_size, device, threads, arena_bytes)
    return OnnxRunner(model_dir, spec, num_blocks, block_size, device, threads, small_step_threads)
