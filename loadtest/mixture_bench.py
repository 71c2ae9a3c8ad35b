"""A mixture of experts against the dense model of the same active parameters: `engine-bench --only moe`.

Two random checkpoints of one shape (export/synthetic.py `mixture_pair`): Qwen3-MoE with 8
experts and top-2 routing, and Qwen3 whose MLP is as wide as two experts, so a token meets the
same number of weights in both (the router adds 8 x hidden). Each is exported once under
results/mixture/ and run by the engine's runner on decode steps of `rows` rows of 128 past
tokens, batch 1 and 64; dense and mixture run in separate runs taking turns, medians of runs.
The mixture's step can only match the dense one if each expert computes only its own tokens
(export/mixture.py): computing every expert for every token would cost 4x the MLP.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from batchstring.engine.config import EngineConfig
from batchstring.engine.core import EngineCore
from batchstring.loadtest.long_context import step_ms, taking_turns

PAST = 128
BATCHES = (1, 64)


@dataclass(frozen=True)
class MixtureRatio:
    rows: int
    dense_ms: float
    mixture_ms: float
    runtime: str

    @property
    def ratio(self) -> float:
        return self.mixture_ms / self.dense_ms


def mixture_models(root: Path = Path("results") / "mixture") -> dict[str, Path]:
    """The two exports, built once: {"dense": ..., "mixture": ...}."""
    from batchstring.export.exporter import export_model
    from batchstring.export.synthetic import mixture_pair, random_checkpoint

    exported = {}
    for name, config in mixture_pair().items():
        out = root / name / "exported"
        if not (out / "runtime.json").exists():
            export_model(random_checkpoint(root / name / "checkpoint", config), out, dtype="float32")
        exported[name] = out
    return exported


def compare(models: dict[str, Path], runtime: str = "onnxruntime", batches: tuple[int, ...] = BATCHES,
            repeats: int = 5, steps: int = 10, progress=None) -> list[MixtureRatio]:
    engines = {name: EngineCore(EngineConfig(model_dir=path, runtime=runtime, kv_cache_tokens=max(batches) * 160,
                                             max_num_seqs=max(batches)))
               for name, path in models.items()}
    results = []
    for rows in batches:
        ms = taking_turns({name: step_ms(engine, [PAST] * rows, steps, progress) for name, engine in engines.items()},
                           repeats)
        results.append(MixtureRatio(rows, ms["dense"], ms["mixture"], runtime))
    return results
