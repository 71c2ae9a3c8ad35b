"""Where `batchstring export` reads a checkpoint from: a local directory, or a Hugging Face Hub id.

A Hub id is downloaded by huggingface_hub into its own cache (resumable, shared with transformers,
read again offline with HF_HUB_OFFLINE=1 once there), with progress bars. Only what an export
reads comes down: the configs, the safetensors weights and the tokenizer's files, not the other
formats a repository often holds beside them (PyTorch .bin, GGUF, ONNX). A gated model's token
comes from the environment (HF_TOKEN), never from the command line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from batchstring.export.layout import DEFAULT_MODEL_DIR

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name, as the Hub spells repositories
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]
# The Hub's patterns match across "/": other models' files in subfolders (onnx/, text_encoder/), and
# Mistral's second copy of the weights beside the shards, stay there.
SKIPPED_FILES = ["*/*", "consolidated*"]


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory and the name the export reports and records (runtime.json's source):
    the directory's, or the Hub id at the commit it resolved to, so the export can be traced back."""

    path: Path
    name: str


def resolve(model: str | Path | None, revision: str | None = None) -> Checkpoint:
    """The checkpoint `--model` names: an existing directory (or anything that is not owner/name)
    as it is, else the Hub repository at `revision` (a branch, tag or commit; None: main)."""
    local = Path(model or DEFAULT_MODEL_DIR).expanduser()
    if local.exists() or not HUB_ID.match(str(model)):
        if revision:
            raise ValueError(f"--revision picks a version of a Hugging Face Hub id (owner/name); {local} is not one")
        return Checkpoint(local.resolve(), local.resolve().name)
    path = download(str(model), revision)
    return Checkpoint(path, f"{model}@{path.name}")  # a snapshot's directory is named by its commit


def download(repo_id: str, revision: str | None = None) -> Path:
    """The repository's snapshot in the Hugging Face cache, downloaded where it is not there yet."""
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=CHECKPOINT_FILES,
                                      ignore_patterns=SKIPPED_FILES))
    except Exception as exc:  # offline, not found, gated, no such revision, a connection lost mid-way (httpx, xet)
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"{repo_id} is not a local directory, and downloading it from the Hugging Face Hub failed: {reason} "
            "(a gated model needs HF_TOKEN in the environment; without network, download it where there is one, "
            f"`hf download {repo_id} --local-dir DIR`, and pass --model DIR)"
        ) from None
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"{repo_id} on the Hugging Face Hub has no .safetensors weights, which is what batchstring "
                         "reads; convert its weights (transformers' save_pretrained writes safetensors) and pass "
                         "--model DIR")
    return path
