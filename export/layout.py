"""Where the model comes from and where the exported files go (no heavy imports here)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = REPO_ROOT / "export" / "default_model"
# Python source the shipped model was not trained on (a snapshot of this project's engine): the
# text a quantized export's perplexity is measured on (export/quantize.py).
HELDOUT_TEXT = REPO_ROOT / "export" / "heldout" / "python.txt"
MODEL_VERSION_DIR = REPO_ROOT / "model_repository" / "llm" / "1"
ARTIFACTS = ("model.onnx", "model.pt", "tokenizer.json", "runtime.json")
# The ONNX step for small steps (export/step.py `single_group`), written for float32 exports, the
# CPU's: the CPU runner sends steps of a few tokens to it (and a lone row's, when its session has every
# core: engine/runner.py); GPU runners run model.onnx only.
SMALL_STEP_GRAPH = "model.small.onnx"
# The weights both ONNX graphs read, each tensor once, in exports of real size (export/shared_weights.py).
SHARED_WEIGHTS = "model.onnx.data"


STEP_FILES = {"onnxruntime": "model.onnx", "torchscript": "model.pt"}


def missing_artifacts(version_dir: Path = MODEL_VERSION_DIR, runtime: str | None = None) -> list[str]:
    """What the served files lack: every artifact, or with `runtime` the one step file it runs."""
    wanted = ARTIFACTS if runtime is None else [n for n in ARTIFACTS if n not in STEP_FILES.values()
                                                or n == STEP_FILES.get(runtime)]
    return [name for name in wanted if not (version_dir / name).is_file()]
