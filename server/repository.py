"""Reads config.pbtxt with Triton's own protobuf schema, and builds overlay repositories.

An overlay is a throw-away model repository whose `llm/config.pbtxt` is the chosen config with
changes applied (engine parameters, batching settings) and whose version directory is a link to
the real one. Tests, benchmarks and `batchstring serve --param` use it to run variants of the
model without editing the files users deploy.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from batchstring.client.defaults import MODEL
from batchstring.server.triton import DEFAULT_REPOSITORY

ConfigEdit = Callable[[model_config_pb2.ModelConfig], None]


def config_path(repository: Path, config_name: str | None) -> Path:
    model_dir = repository / MODEL
    return model_dir / "configs" / f"{config_name}.pbtxt" if config_name else model_dir / "config.pbtxt"


def load_config(repository: Path = DEFAULT_REPOSITORY, config_name: str | None = None) -> model_config_pb2.ModelConfig:
    return text_format.Parse(config_path(repository, config_name).read_text(), model_config_pb2.ModelConfig())


def parameters(config: model_config_pb2.ModelConfig) -> dict[str, str]:
    return {key: value.string_value for key, value in config.parameters.items()}


def set_parameters(config: model_config_pb2.ModelConfig, overrides: dict[str, str]) -> None:
    unknown = sorted(set(overrides) - set(config.parameters))
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown}; config.pbtxt defines {sorted(config.parameters)}")
    for key, value in overrides.items():
        config.parameters[key].string_value = str(value)


def write_overlay(
    target: Path,
    repository: Path = DEFAULT_REPOSITORY,
    config_name: str | None = None,
    params: dict[str, str] | None = None,
    edit: ConfigEdit | None = None,
) -> Path:
    """Creates `target/llm/{config.pbtxt, 1 -> real version dir}` and returns `target`."""
    config = load_config(repository, config_name)
    set_parameters(config, params or {})
    if edit:
        edit(config)
    model_dir = target / MODEL
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(text_format.MessageToString(config))
    for version in (repository / MODEL).iterdir():
        if version.is_dir() and version.name.isdigit():
            (model_dir / version.name).symlink_to(version.resolve(), target_is_directory=True)
    return target


MODEL_CODE = ("model.py", "responder.py", "metrics.py")  # the Triton adapter, beside every export


def repository_for(exported: Path, target: Path, repository: Path = DEFAULT_REPOSITORY) -> Path:
    """A model repository serving another export (`batchstring export --out DIR`): this
    repository's configs and model code, and a version directory linking to the exported files.
    `batchstring serve --repository TARGET` serves it; returns `target`."""
    model_dir = target / MODEL
    version = model_dir / "1"
    version.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_bytes((repository / MODEL / "config.pbtxt").read_bytes())
    shutil.copytree(repository / MODEL / "configs", model_dir / "configs", dirs_exist_ok=True)
    for name in MODEL_CODE:
        shutil.copyfile(repository / MODEL / "1" / name, version / name)
    for produced in Path(exported).iterdir():
        link = version / produced.name
        if produced.is_file() and not link.exists():
            link.symlink_to(produced.resolve())
    return target
