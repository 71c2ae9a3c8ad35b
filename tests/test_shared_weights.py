"""One copy of the weights on disk for the export's two ONNX graphs (export/shared_weights.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from batchstring.engine.memory import weight_bytes as held_bytes
from batchstring.export.layout import SHARED_WEIGHTS, SMALL_STEP_GRAPH
from batchstring.export.shared_weights import share_weights, weight_bytes
from tests.engine_helpers import GREEDY, engine, varied_prompts

FILES = ("model.onnx", SMALL_STEP_GRAPH, "runtime.json", "tokenizer.json")


@pytest.fixture()
def export_copy(model_dir, tmp_path) -> Path:
    for name in FILES:
        shutil.copyfile(model_dir / name, tmp_path / name)
    return tmp_path


def externalise(directory: Path) -> None:
    """Each graph's every tensor in its own data file, as a real-size export writes them (the
    smallest included: they must come back inside their graph)."""
    import onnx

    for name in ("model.onnx", SMALL_STEP_GRAPH):
        model = onnx.load(str(directory / name))
        onnx.save_model(model, str(directory / name), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=f"{name}.data", size_threshold=0)


def tokens(directory: Path, prompts: list[str], together: bool) -> list[list[int]]:
    """Greedy tokens, each prompt alone (small steps: the small-step graph) or all in one batch
    (the full graph)."""
    eng = engine(directory)
    seqs = [eng.make_sequence(p, GREEDY, lambda o: None) for p in prompts]
    for group in ([seqs] if together else [[s] for s in seqs]):
        eng.generate(group)
    return [s.output_ids for s in seqs]


@pytest.mark.parametrize("written", ["inline", "external"])
def test_the_two_graphs_read_one_weights_file_and_compute_what_they_computed_apart(model_dir, export_copy, written):
    prompts = varied_prompts(6)
    before = {together: tokens(model_dir, prompts, together) for together in (False, True)}
    if written == "external":
        externalise(export_copy)
    size = weight_bytes(export_copy)
    files = sorted(p.name for p in export_copy.iterdir())
    assert not share_weights(export_copy), "the shipped model's graphs are small: they stay as they are"
    assert sorted(p.name for p in export_copy.iterdir()) == files
    assert share_weights(export_copy, from_bytes=0)
    assert (export_copy / SHARED_WEIGHTS).exists() and not (export_copy / f"{SMALL_STEP_GRAPH}.data").exists()
    assert weight_bytes(export_copy) < 0.55 * size, "every tensor once"
    assert held_bytes(export_copy, "onnxruntime", "cpu", 0) > 0.95 * size, "each session still holds its copy"
    assert {together: tokens(export_copy, prompts, together) for together in (False, True)} == before


def test_an_export_sharing_its_weights_is_quantized_and_served(export_copy):
    from batchstring.export.layout import HELDOUT_TEXT
    from batchstring.export.quantize import Quantization, quantize_export

    assert share_weights(export_copy, from_bytes=0)
    measured = quantize_export(export_copy, Quantization("int8"), HELDOUT_TEXT.read_text(), bound=100.0)
    assert measured.quantized > 0 and measured.greedy_same == measured.prompts and measured.rise < 5.0
    assert sorted(p.name for p in export_copy.iterdir()) == sorted(FILES), "small again: self-contained graphs"
    assert all(tokens(export_copy, varied_prompts(2), together=False)), "both sessions load and generate"
