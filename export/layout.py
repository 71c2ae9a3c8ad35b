"""Where the model comes from and where the exported files go (no heavy imports here)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = REPO_ROOT / "export" / "default_model"
MODEL_VERSION_DIR = REPO_ROOT / "model_repository" / "llm" / "1"
ARTIFACTS = ("model.onnx", "model.pt", "tokenizer.json", "runtime.json")
# The ONNX step for small steps (export/step.py `single_group`), written for float32 exports, the
# CPU's: the CPU runner sends steps of a few tokens to it; GPU runners run model.onnx only.
SMALL_STEP_GRAPH = "model.small.onnx"


STEP_FILES = {"onnxruntime": "model.onnx", "torchscript": "model.pt"}


def missing_artifacts(version_dir: Path = MODEL_VERSION_DIR, runtime: str | None = None) -> list[str]:
    """What the served files lack: every artifact, or with `runtime` the one step file it runs."""
    wanted = ARTIFACTS if runtime is None else [n for n in ARTIFACTS if n not in STEP_FILES.values()
                                                or n == STEP_FILES.get(runtime)]
    return [name for name in wanted if not (version_dir / name).is_file()]

# The exported step's inputs and outputs, in order (export/step.py says what each is); an export whose
# runtime.json lists others was made by another batchstring and is refused (engine/runner.py).
INPUT_NAMES = (
    "input_ids", "position_ids",
    "decode_tokens", "decode_rows", "decode_context", "decode_pairs",
    "prefill_tokens", "prefill_mask", "prefill_rows", "prefill_context", "prefill_pairs",
    "token_order", "block_table",
    "logit_tokens", "ban_rows", "sample_rows", "temperature", "top_k", "top_p", "uniform",
    "min_p", "mask_rows", "token_mask",
    "adjust_rows", "adjust_tokens", "adjust_bias", "adjust_scale", "adjust_shift",
    "key_cache", "value_cache",
)
OUTPUT_NAMES = ("next_tokens", "token_logprobs", "top_ids", "top_logprobs", "logits", "new_keys", "new_values")
