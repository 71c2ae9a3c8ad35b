"""The GPU path, proven where no GPU is: a device-free TorchScript step (run on the meta device),
the KV cache's ceilings for real shapes on a 141 GB GPU, 16-bit binding and the CUDA provider
check of ONNX Runtime, and an image whose versions match the code (read from the files)."""

from __future__ import annotations

import json
import re
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from batchstring.engine.config import AUTO, EngineConfig
from batchstring.engine.memory import (
    INDEX_LIMIT,
    SMALL_STEP_SESSION_BYTES,
    activation_bytes,
    auto_plan,
    configured_plan,
    small_step_graph,
    weight_bytes,
)
from batchstring.engine.runner import RuntimeSpec, check_providers, ort_element_type, ort_providers
from batchstring.export import artifacts
from batchstring.export.layout import REPO_ROOT

H200 = 141 * 10**9  # bytes on the device; what mem_get_info reports free before the model loads is less
FREE = H200 - 2 * 2**30
GIB = 2**30


def spec_of(layers: int, heads: int, kv_heads: int, head_dim: int, hidden: int, intermediate: int, vocab: int,
            context: int, dtype: str) -> RuntimeSpec:
    return RuntimeSpec(layers, kv_heads, head_dim, vocab, context, (0,), artifacts.INPUT_NAMES, dtype, {}, heads,
                       hidden, intermediate)


SHIPPED = spec_of(4, 4, 2, 64, 256, 688, 4096, 512, "float16")
LLAMA_1B = spec_of(16, 32, 8, 64, 2048, 8192, 128256, 131072, "bfloat16")


def gpu_config(runtime: str = "onnxruntime", **changes) -> EngineConfig:
    return EngineConfig(model_dir=Path("."), runtime=runtime, device="cuda:3", **{"kv_cache_tokens": AUTO, **changes})


# ----- one TorchScript file for every device ---------------------------------------------------


def test_the_exported_torchscript_step_runs_with_every_tensor_on_the_meta_device(model_dir):
    """The shipped artifact, exported on this CPU: weights, inputs and both caches on `meta`. A tensor
    that the trace pinned to the CPU would meet meta tensors and fail, as it would on cuda:3."""
    spec = json.loads((model_dir / "runtime.json").read_text())
    outputs = artifacts.run_on_meta(model_dir / "model.pt", spec)
    assert {t.device.type for t in outputs} == {"meta"}
    next_tokens, logprobs, top_ids, top_logprobs, logits, new_keys, new_values = outputs
    assert next_tokens.shape == (3,) and logprobs.shape == (2,) and top_ids.shape == top_logprobs.shape == (2, 20)
    assert logits.shape == (3, spec["vocab_size"])
    assert new_keys.shape == new_values.shape == (spec["num_layers"], spec["num_kv_heads"], 6, spec["head_dim"])
    assert artifacts.device_constants(model_dir / "model.pt") == []
    assert artifacts.host_scalars(model_dir / "model.pt") == []


def test_a_shape_handed_to_a_device_operator_is_found_and_shape_arithmetic_is_not(tmp_path):
    """A traced shape (or a tensor constant) is a CPU tensor wherever the step runs: arithmetic takes
    it beside GPU tensors, clamp with a tensor bound or an index does not (the clamp failed so on an
    H200), and neither the CPU nor the meta device objects, so the saved graph is read for it."""

    class Clamped(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.clamp(x, max=x.shape[0] - 1)

    class Indexed(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.index_select(x, 0, torch.tensor([1, 2]))

    class Scaled(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * x.shape[0] - (x.shape[0] - 1)

    found = {}
    for module in (Clamped(), Indexed(), Scaled()):
        path = tmp_path / f"{type(module).__name__}.pt"
        torch.jit.trace(module, torch.arange(4.0)).save(str(path))
        found[type(module).__name__] = artifacts.host_scalars(path)
    assert len(found["Clamped"]) == 1 and found["Clamped"][0].startswith("aten::clamp (argument 2)")
    assert found["Indexed"], "a constant index tensor stays on the CPU"
    assert found["Scaled"] == []


def test_the_meta_run_catches_a_tensor_made_on_a_fixed_device(tmp_path):
    """The check itself can fail: a traced arange without a device becomes a CPU constant."""

    class Pinned(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.arange(x.shape[0])

    path = tmp_path / "pinned.pt"
    torch.jit.trace(Pinned(), torch.zeros(3)).save(str(path))
    assert artifacts.device_constants(path), "the saved code names torch.device('cpu')"
    module = torch.jit.load(str(path))
    graph, weights = torch._C._jit_pass_lower_graph(module.inlined_graph, module._c)
    function = torch._C._create_function_from_graph("pinned", graph)
    with pytest.raises(RuntimeError):
        function(torch.zeros(3, device="meta"), *weights)


# ----- the cache's ceilings ---------------------------------------------------------------------


def test_auto_gives_the_shipped_model_what_64_sequences_can_use_not_65_million_tokens():
    plan = auto_plan(gpu_config(), SHIPPED, weights=30 * 2**20, free=FREE, source="cuda:3 free memory")
    assert plan.tokens == 64 * 512 == 32768, "64 sequences x 512-token context: all that can ever be live"
    assert "set by the live (64 sequences x 512-token context) ceiling" in plan.reason
    memory = int(re.search(r"memory \(.*?\): ([\d,]+)", plan.reason).group(1).replace(",", ""))
    assert memory > 60_000_000, "memory alone would allow ~2000x more"
    assert "step activations" in plan.reason and "max_num_batched_tokens 512" in plan.reason
    assert 0 < plan.activation_bytes < GIB and plan.arena_bytes == 30 * 2**20 + plan.activation_bytes
    assert "ONNX Runtime CUDA arena limited to" in plan.reason


def test_auto_keeps_a_1b_model_under_onnx_runtimes_32_bit_gather_and_torchscript_under_memory():
    weights = int(2.47e9)
    onnx = auto_plan(gpu_config(), LLAMA_1B, weights, FREE, "cuda:3 free memory")
    assert onnx.tokens == 262128, "(2^31 - 1) // (16 layers x 8 kv heads x 64) = 262143, in whole blocks of 16"
    assert 16 * 8 * onnx.tokens * 64 < INDEX_LIMIT <= 16 * 8 * (onnx.tokens + 16) * 64
    assert "set by the index (ONNX Runtime CUDA: 32-bit Gather offsets) ceiling" in onnx.reason
    torchscript = auto_plan(gpu_config("torchscript"), LLAMA_1B, weights, FREE, "cuda:3 free memory")
    assert "set by the memory" in torchscript.reason and torchscript.arena_bytes == 0
    # 64 rows of a 131072-token past: 64 x 131072 x (K+V 2 x 8 x 64 x 2 bytes + scores 2 x 32 x 4), and 512
    # prefill queries over that past: 512 x 131072 x scores 2 x 32 x 4; x 1.25
    assert torchscript.activation_bytes == pytest.approx((64 * 131072 * (2048 + 256) + 512 * 131072 * 256) * 1.25,
                                                         rel=0.02)
    used = torchscript.tokens * LLAMA_1B.bytes_per_token + weights + torchscript.activation_bytes
    assert used <= 0.9 * FREE < used + 16 * LLAMA_1B.bytes_per_token, "whole blocks of what the fraction leaves"
    assert 2_000_000 < torchscript.tokens < 64 * 131072


def test_a_configured_cache_past_the_index_ceiling_is_refused_with_the_numbers():
    config = gpu_config(kv_cache_tokens=300_000)
    with pytest.raises(ValueError, match=r"\[16 x 8 x 300000, 64\] has 2,457,600,000 elements.*at most 262128"):
        configured_plan(config, LLAMA_1B, 0)
    assert configured_plan(gpu_config("torchscript", kv_cache_tokens=300_000), LLAMA_1B, 0).tokens == 300_000


def test_auto_refuses_less_than_one_context_and_names_every_ceiling():
    assert EngineConfig.from_parameters({"kv_cache_tokens": "auto"}, model_dir=".").kv_cache_tokens == AUTO
    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        EngineConfig(model_dir=".", kv_cache_memory_fraction=1.5)
    with pytest.raises(ValueError, match=r"less than one full context \(131072 tokens\).*live.*memory"):
        auto_plan(gpu_config("torchscript"), LLAMA_1B, int(2.47e9), 24 * GIB, "cuda:0 free memory")


def test_activations_grow_with_the_step_and_the_past():
    small = activation_bytes(LLAMA_1B, 512, 64, 4096)
    assert activation_bytes(LLAMA_1B, 8192, 64, 4096) > small
    assert activation_bytes(LLAMA_1B, 512, 64, 131072) > 20 * small


# ----- ONNX Runtime on CUDA: element types and the provider --------------------------------------


def test_bfloat16_is_bound_by_its_onnx_element_type_or_refused_with_what_to_use():
    assert ort_element_type("bfloat16", "1.20.2") == 16 and ort_element_type("float16", "1.31.1") == 10
    assert ort_element_type("float32", "1.20.2") == 1
    assert ort_element_type("float16", "1.19.2") is np.float16
    with pytest.raises(RuntimeError, match=r"onnxruntime 1.19.2 cannot bind bfloat16.*>= 1.20.*torchscript.*float16"):
        ort_element_type("bfloat16", "1.19.2")


class _Session:
    """What check_providers reads of an onnxruntime session."""

    def __init__(self, providers: list[str]) -> None:
        self.providers = providers

    def get_providers(self) -> list[str]:
        return self.providers


def test_a_silent_cpu_fallback_is_an_error_that_names_what_is_missing():
    check_providers(_Session(["CUDAExecutionProvider", "CPUExecutionProvider"]), "cuda:0")
    check_providers(_Session(["CPUExecutionProvider"]), "cpu")
    with pytest.raises(RuntimeError) as info:
        check_providers(_Session(["CPUExecutionProvider"]), "cuda:0")
    message = str(info.value)
    assert "without its CUDA provider (active: CPUExecutionProvider)" in message
    assert "no CUDA provider library (the CPU-only package)" in message, "this machine's onnxruntime is the CPU one"


def test_the_cuda_provider_runs_on_the_instances_own_gpu_with_a_bounded_arena():
    name, options = ort_providers("cuda:3", ["CUDAExecutionProvider", "CPUExecutionProvider"], 5 * GIB)[0]
    assert name == "CUDAExecutionProvider"
    assert options == {"device_id": 3, "gpu_mem_limit": 5 * GIB, "arena_extend_strategy": "kSameAsRequested"}
    with pytest.raises(RuntimeError, match=r"install onnxruntime-gpu instead of onnxruntime.*pip uninstall"):
        ort_providers("cuda:0", ["CPUExecutionProvider"])


# ----- the image matches the code ----------------------------------------------------------------

DOCKERFILE = (REPO_ROOT / "docker" / "Dockerfile").read_text()
# NGC Triton release -> its Python (the release notes' "Ubuntu N including Python X.Y")
NGC_TRITON_PYTHON = {"24.10": (3, 10), "24.11": (3, 10), "24.12": (3, 12), "25.01": (3, 12), "25.02": (3, 12)}
PYTHON_FEATURES = {"asyncio.timeout_at": (3, 11), "asyncio.timeout(": (3, 11), "tomllib": (3, 11)}


def python_floor_of_the_code() -> tuple[int, int]:
    """The newest Python feature our shipped code uses (tests excepted)."""
    floor = (3, 8)
    for path in REPO_ROOT.glob("*/**/*.py"):
        if path.parts[len(REPO_ROOT.parts)] in (".venv", "tests") or not path.is_file():
            continue
        text = path.read_text()
        floor = max([floor, *(v for feature, v in PYTHON_FEATURES.items() if feature in text)])
    return floor


def test_every_python_in_the_image_runs_the_code_and_pyproject_says_so():
    floor = python_floor_of_the_code()
    assert floor >= (3, 11), "the front door and client use asyncio.timeout_at"
    declared = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert tuple(int(p) for p in declared.removeprefix(">=").split(".")) >= floor
    triton = re.search(r"ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:(\d+\.\d+)-py3", DOCKERFILE).group(1)
    assert triton in NGC_TRITON_PYTHON, f"add NGC {triton}'s Python version from its release notes"
    assert NGC_TRITON_PYTHON[triton] >= floor, f"NGC Triton {triton} ships Python {NGC_TRITON_PYTHON[triton]}"
    for version in re.findall(r"^FROM python:(\d+\.\d+)-", DOCKERFILE, re.MULTILINE):
        assert tuple(int(p) for p in version.split(".")) >= floor


def test_the_image_exports_float16_with_the_torch_it_serves_with_and_checks_the_artifact_there():
    assert "export_model(dtype='float16')" in DOCKERFILE
    torches = set(re.findall(r"torch==([\d.]+)", DOCKERFILE))
    assert len(torches) == 1, f"export and serving stages install different torch versions: {torches}"
    server = DOCKERFILE[DOCKERFILE.index("AS server"):]
    assert all(f"{check}(" in server for check in ("run_on_meta", "device_constants", "host_scalars")), \
        "the serving stage loads what export wrote"


def test_the_images_onnx_runtime_binds_bfloat16_and_the_cache_stays_under_its_gather_limit():
    version = re.search(r"onnxruntime-gpu==([\d.]+)", DOCKERFILE).group(1)
    ort_element_type("bfloat16", version)  # raises below 1.20
    # its CUDA Gather offsets are 32-bit: auto caps under the limit, a larger fixed size is refused
    plan = auto_plan(gpu_config(), LLAMA_1B, 0, 10 * H200, "test memory")
    assert 16 * 8 * plan.tokens * 64 < INDEX_LIMIT


def test_one_onnx_runtime_package_at_a_time():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("onnxruntime")]
    extras = project["optional-dependencies"]
    assert extras["cpu"] == ["onnxruntime==1.32.0"] and extras["gpu"][0].startswith("onnxruntime-gpu==")
    assert "'.[dev,cpu]'" in (REPO_ROOT / "Makefile").read_text()


# ----- the device check's own limits --------------------------------------------------------------


def test_a_gpu_check_stage_ends_at_its_limit_and_the_report_holds_every_stage_so_far(tmp_path):
    from batchstring.cli.gpu_check import CheckFailed, Scope, Stage, run_stage, write_report

    def wrong(ctx: dict) -> list[str]:
        raise CheckFailed("logits differ")

    slow = Stage("slow", 1, lambda ctx: [str(time.sleep(30))])
    failing, late = Stage("failing", 10, wrong), Stage("late", 10, lambda ctx: ["ran"])
    began = time.monotonic()
    run_stage(slow, {}, deadline=began + 60)
    run_stage(failing, {}, deadline=began + 60)
    run_stage(late, {}, deadline=time.monotonic() + 2)
    assert time.monotonic() - began < 5, "a stage is stopped at its own limit"
    assert (slow.status, slow.lines) == ("FAIL", ["timed out after 1 s (its limit)"])
    assert (failing.status, failing.lines) == ("FAIL", ["CheckFailed: logits differ"])
    assert late.lines == ["not run: the check's time budget is spent"]
    write_report(tmp_path, Scope("cpu", True), False, [slow, failing, late])
    report = json.loads((tmp_path / "report.json").read_text())
    assert [(s["name"], s["status"]) for s in report["stages"]] == [("slow", "FAIL"), ("failing", "FAIL"),
                                                                    ("late", "FAIL")]
    assert "### failing: FAIL" in (tmp_path / "report.md").read_text()


def test_the_weights_counted_are_those_each_runtime_loads(tmp_path):
    """The CPU's ONNX Runtime with `threads` 0 holds two sessions (the second on the small-step
    graph when the export wrote one); GPU runners hold one; external weights count with their graph."""
    for name, size in (("model.onnx", 10), ("model.onnx.data", 20), ("model.small.onnx", 5),
                       ("model.small.onnx.data", 7), ("model.pt", 3)):
        (tmp_path / name).write_bytes(b"x" * size)
    assert weight_bytes(tmp_path, "onnxruntime", "cpu", 0) == 10 + 20 + 5 + 7
    assert weight_bytes(tmp_path, "onnxruntime", "cpu", 4) == weight_bytes(tmp_path, "onnxruntime", "cuda:0") == 30
    assert weight_bytes(tmp_path, "torchscript", "cpu", 0) == 3
    (tmp_path / "model.small.onnx.data").unlink()
    assert weight_bytes(tmp_path, "onnxruntime", "cpu", 0) == 10 + 20 + 5 + 20, "one file of weights, two sessions"
    (tmp_path / "model.small.onnx").unlink()
    assert weight_bytes(tmp_path, "onnxruntime", "cpu", 0) == 2 * 30, "a second session of model.onnx"
    with open(tmp_path / "model.onnx.data", "r+b") as data:  # sparse: a real-size model's weights
        data.truncate(SMALL_STEP_SESSION_BYTES + 1)
    assert weight_bytes(tmp_path, "onnxruntime", "cpu", 0) == 10 + SMALL_STEP_SESSION_BYTES + 1, "one session"
    assert small_step_graph(tmp_path, "onnxruntime", "cpu", 0) is None


def test_the_structured_output_stage_says_what_to_install_where_llguidance_is_missing(monkeypatch):
    """Tier 1 needs no llguidance: its stage reports how to add it (the version we pin) instead of
    failing the check."""
    from batchstring.cli import gpu_check

    real = gpu_check.importlib.util.find_spec
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llguidance" else real(name, *a))
    lines = gpu_check.structured_output({"scope": gpu_check.Scope("cpu", True), "exports": {}})
    pin = next(d for d in tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
               if d.startswith("llguidance=="))
    assert lines[0].startswith("not measured") and f"pip install {pin}`" in lines[0]


def test_the_quantized_stage_compares_int8_and_int4_with_the_step_they_came_from(model_dir, tmp_path):
    """Tier 2's quantized stage, on the CPU with the float32 export: both schemes quantized and
    measured, each step's greedy tokens and time per step beside the unquantized one's."""
    import shutil

    from batchstring.cli.gpu_check import Scope, quantized_on_device

    version = tmp_path / "repository" / "llm" / "1"
    version.mkdir(parents=True)
    for name in ("model.onnx", "model.small.onnx", "runtime.json", "tokenizer.json"):
        shutil.copyfile(model_dir / name, version / name)
    lines = quantized_on_device({"scope": Scope("cpu", True), "repository": tmp_path / "repository",
                                 "scratch": tmp_path})
    rows = {cells[0]: cells for cells in (line.strip("| ").split(" | ") for line in lines[2:] if line.startswith("| "))}
    assert set(rows) >= {"float32", "int8", "int4"}, lines
    assert rows["float32"][1] == "4/4" and rows["float32"][3] == "1.00x"
    assert all(int(rows[scheme][1].split("/")[0]) > 0 for scheme in ("int8", "int4"))
    assert lines[0].startswith("int8: ") and "matrix multiplies quantized" in lines[0]
