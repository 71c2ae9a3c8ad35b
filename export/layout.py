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


def missing_artifacts(version_dir: Path = MODEL_VERSION_DIR) -> list[str]:
    return [name for name in ARTIFACTS if not (version_dir / name).is_file()]
