"""What LoRA adapters cost a decode step: 64 rows spread over 8 resident adapters of rank 16
(every projection adapted) against the same 64 rows on the base model, in separate engines whose
runs take turns (the machine's noise falls on both alike).

The adapters are random, written in PEFT's file format for the export's shapes (nothing here
needs `peft`); the step is the engine's own (build_step + the runner), past 128 tokens a row.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchstring.engine.adapters import MODULES, BaseShape
from batchstring.engine.batch import Work, build_step
from batchstring.engine.config import EngineConfig
from batchstring.engine.core import EngineCore
from batchstring.engine.sampling_params import SamplingParams

ROWS, ADAPTERS, RANK, PAST, STEPS = 64, 8, 16, 128, 20
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterCost:
    runtime: str
    rows: int
    plain_ms: float  # median decode step of the export without adapters (the step as it was before them)
    base_ms: float  # the export with adapters, no row using one
    adapted_ms: float  # every row using one of ADAPTERS adapters (at 1 row: one adapter)
    adapter_bytes: int  # one adapter's matrices as held (rank RANK, every projection)

    @property
    def unused(self) -> float:
        """What a step pays for adapters it does not use."""
        return self.base_ms / self.plain_ms

    @property
    def ratio(self) -> float:
        return self.adapted_ms / self.base_ms


def write_adapters(model_dir: Path, out: Path, count: int = ADAPTERS, rank: int = RANK) -> dict[str, Path]:
    """`count` random LoRA adapters of the export in `model_dir`, as `peft` saves them."""
    from safetensors.numpy import save_file

    from batchstring.engine.runner import RuntimeSpec

    base = BaseShape.of(RuntimeSpec.load(model_dir / "runtime.json"))
    rng = np.random.default_rng(0)
    made = {}
    for i in range(count):
        tensors = {}
        for layer in range(base.layers):
            for module in TARGETS:
                site, part = MODULES[module]
                if site not in base.sites:
                    continue
                fan_in = base.sites[site][0]
                fan_out = base.sites[site][1] if part is None else base.parts[site][part]
                block = "mlp" if site in ("gate_up", "down") else "self_attn"
                prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
                tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((rank, fan_in), np.float32) * 0.02
                tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((fan_out, rank), np.float32) * 0.02
        path = out / f"adapter-{i}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}))
        made[path.name] = path
    return made


def _timed_step(model_dir: Path, runtime: str, adapters: dict[str, Path], rows: int) -> Callable[[], float]:
    """One decode step of `rows` rows, each past PAST tokens, spread over `adapters` (none: base)."""
    listing = ",".join(f"{name}={path}" for name, path in adapters.items())
    engine = EngineCore(EngineConfig(model_dir=model_dir, runtime=runtime, max_num_seqs=ROWS, adapters=listing,
                                     max_adapters=max(1, len(adapters))))
    names = list(adapters) or [None]
    ids = engine.codec.encode("x" * 4096)[:PAST]
    seqs = [engine.make_sequence("x", SamplingParams(max_tokens=8, temperature=0.0), lambda o: None,
                                 adapter=names[i % len(names)]) for i in range(rows)]
    blocks = engine.scheduler.blocks
    for seq in seqs:
        seq.prompt_ids, seq.output_ids = list(ids), [0]
        blocks.grow(seq, PAST + 1)
        seq.num_computed = PAST
        if seq.adapter is not None:
            seq.adapter_slot = engine.adapters.acquire(seq.adapter)
    batch = build_step([Work(s, 1) for s in seqs], blocks)
    engine.runner.step(batch)  # warm: kernels chosen, adapters moved to the runtime

    def timed() -> float:
        began = time.perf_counter()
        engine.runner.step(batch)
        return time.perf_counter() - began

    return timed


def compare(plain_dir: Path, model_dir: Path, runtime: str, scratch: Path, rows: int = ROWS, repeats: int = 5,
            progress: Callable[[], None] = lambda: None) -> AdapterCost:
    """`plain_dir` and `model_dir`: one checkpoint exported without and with `--adapters`."""
    adapters = write_adapters(model_dir, scratch)
    cases = {"plain": _timed_step(plain_dir, runtime, {}, rows), "base": _timed_step(model_dir, runtime, {}, rows),
             "adapted": _timed_step(model_dir, runtime, adapters, rows)}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):  # turns: each case's steps, then the next case's, and round again
        for name, step in cases.items():
            times[name].append(float(np.median([step() for _ in range(STEPS)])))
            progress()
    from batchstring.engine.adapters import load_adapter
    from batchstring.engine.runner import RuntimeSpec

    spec = RuntimeSpec.load(model_dir / "runtime.json")
    one = load_adapter("one", next(iter(adapters.values())), BaseShape.of(spec), np.dtype(spec.dtype))
    ms = {name: 1e3 * float(np.median(t)) for name, t in times.items()}
    return AdapterCost(runtime, rows, ms["plain"], ms["base"], ms["adapted"], one.nbytes)
