"""LoRA adapters served beside their base model: read from PEFT's files, checked against the
export, and kept in a fixed number of slots of the step's adapter inputs.

An adapter is the two files `peft` saves (`adapter_config.json`, `adapter_model.safetensors`).
Its low-rank pairs are mapped onto the step's projections (export/adapters.py): q/k/v onto the
fused qkv site, gate/up onto gate_up, o and down onto their own; on a fused site an adapter's
ranks sit side by side in A, and B is block-diagonal over the parts' output columns, so one
product gives every part its own delta. B carries the scaling (`lora_alpha / r`, or
`/ sqrt(r)` with rsLoRA), so the step adds x A B and nothing else.

`AdapterSlots` is the engine's cache of resident adapters (vLLM's LoRA slots, TensorRT-LLM's
adapter cache): `slots` of them at once, a row taking its adapter's slot while it runs; an adapter
not resident takes a free slot or the least recently used one no row holds, and a request whose
adapter finds none waits in line (engine/scheduler.py) rather than failing. The stacked inputs are
rebuilt when the resident set changes, never per step.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from batchstring.engine.errors import InvalidRequest
from batchstring.export.contract import ADAPTER_SITES, AdapterWeights

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
MAX_RANK = 64  # per module: past it the extra width costs more than a merged model
# PEFT's target module -> (site of the step, part of the site: its index among the fused outputs)
MODULES = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "qkv_proj": ("qkv", None),
           "o_proj": ("o", None), "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1),
           "gate_up_proj": ("gate_up", None), "c_fc": ("gate_up", None), "down_proj": ("down", None),
           "c_proj": ("down", None)}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot serve this base model; the message names it and what differs."""


class UnknownAdapter(InvalidRequest):
    """A request named an adapter this server does not serve."""

    code = "NOT_FOUND"  # Triton's error code (HTTP 404)


@dataclass(frozen=True)
class Adapter:
    """One adapter, laid out for the step: per site, A [layers, in, width] and B [layers, width,
    out] (scaled), width the sum of its parts' ranks (zero where it does not touch the site)."""

    name: str
    path: Path
    key: bytes  # a digest of its files: keys its prefix-cache blocks, so a replaced adapter shares nothing
    a: dict[str, np.ndarray]
    b: dict[str, np.ndarray]
    rank: int

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in (*self.a.values(), *self.b.values()))


@dataclass(frozen=True)
class BaseShape:
    """What an adapter is checked against: the export's runtime.json."""

    layers: int
    sites: dict[str, tuple[int, int]]  # (in, out) of each site the step can adapt
    parts: dict[str, tuple[int, ...]]  # output columns of each fused site's parts
    source: str  # the checkpoint's directory or Hub name, as exported

    @classmethod
    def of(cls, spec) -> BaseShape:
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        gate_up = spec.adapter_sites.get("gate_up", (0, 0))[1]
        parts = {"qkv": (q, kv, kv), "gate_up": (gate_up // 2, gate_up // 2)}
        return cls(spec.num_layers, dict(spec.adapter_sites), parts, spec.source)


def load_adapter(name: str, path: Path, base: BaseShape, dtype: np.dtype) -> Adapter:
    """Reads and checks a PEFT LoRA adapter; AdapterError says what is wrong with it."""
    from safetensors.numpy import load_file

    path = Path(path)
    what = f"adapter {name!r} ({path})"
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
        tensors = load_file(str(path / WEIGHTS_FILE))
    except Exception as exc:  # missing, unreadable, not JSON, not safetensors (its own error type)
        raise AdapterError(f"{what}: cannot read {CONFIG_FILE} and {WEIGHTS_FILE} ({exc}); a LoRA adapter is the "
                           "directory `peft` saves with save_pretrained") from None
    _check_config(what, config, base)
    pairs = _pairs(what, tensors, base)
    a, b = _stack(what, config, pairs, base, dtype)
    digest = hashlib.blake2b(digest_size=16)
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        digest.update((path / file).read_bytes())
    return Adapter(name, path, digest.digest(), a, b, max((w.shape[-1] for w in a.values()), default=0))


def _check_config(what: str, config: dict, base: BaseShape) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{what} is a {config.get('peft_type')} adapter; only LoRA adapters are served")
    refused = [k for k in ("use_dora", "modules_to_save", "fan_in_fan_out") if config.get(k)]
    if config.get("bias", "none") != "none":
        refused.append(f"bias={config['bias']}")
    if refused:
        raise AdapterError(f"{what} uses {', '.join(refused)}; served adapters are plain LoRA on the projections "
                           f"({', '.join(MODULES)}), bias 'none'")
    named = Path(str(config.get("base_model_name_or_path") or "")).name
    if named and base.source and named != Path(base.source).name:
        raise AdapterError(f"{what} was trained on {named!r}; this server's model is {Path(base.source).name!r}")


def _pairs(what: str, tensors: Mapping[str, np.ndarray], base: BaseShape) -> dict:
    """(layer, module) -> (A [r, in], B [out, r]), each checked against the base's shapes."""
    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise AdapterError(f"{what} has weights for {key!r}; adapters may change only the projections "
                               f"{', '.join(MODULES)}")
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in MODULES or MODULES[module][0] not in base.sites:
            sites = [m for m, (site, _) in MODULES.items() if site in base.sites]
            raise AdapterError(f"{what} targets {module!r}; this model's adaptable projections are {', '.join(sites)}")
        if layer >= base.layers:
            raise AdapterError(f"{what} has weights for layer {layer}; the model has {base.layers} layers")
        found.setdefault((layer, module), {})[which] = value
    if not found:
        raise AdapterError(f"{what} holds no LoRA weights (keys ending in lora_A.weight / lora_B.weight)")
    pairs = {}
    for (layer, module), ab in found.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{what}: layer {layer} {module} has lora_{''.join(ab)} without its pair")
        site, part = MODULES[module]
        fan_in = base.sites[site][0]
        fan_out = base.sites[site][1] if part is None else base.parts[site][part]
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != fan_in or b.shape[0] != fan_out or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{what}: layer {layer} {module} has A {list(a.shape)} and B {list(b.shape)}; "
                               f"this model wants A [r, {fan_in}] and B [{fan_out}, r]")
        if not 0 < a.shape[0] <= MAX_RANK:
            raise AdapterError(f"{what}: layer {layer} {module} has rank {a.shape[0]}; ranks 1 to {MAX_RANK} "
                               "are served")
        pairs[layer, module] = (a, b)
    return pairs


def _scale(config: dict, module: str, rank: int) -> float:
    alpha = float(next((v for k, v in (config.get("alpha_pattern") or {}).items() if k.endswith(module)),
                       config.get("lora_alpha", rank)))
    return alpha / (rank ** 0.5 if config.get("use_rslora") else rank)


def _stack(what: str, config: dict, pairs: dict, base: BaseShape,
           dtype: np.dtype) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per site: A [layers, in, width] and B [layers, width, out], ranks side by side."""
    a_out, b_out = {}, {}
    for site in {MODULES[m][0] for _, m in pairs}:
        fan_in, fan_out = base.sites[site]
        modules = sorted({m for _, m in pairs if MODULES[m][0] == site}, key=lambda m: MODULES[m][1] or 0)
        width = max(sum(pairs[layer, m][0].shape[0] for m in modules if (layer, m) in pairs)
                    for layer in range(base.layers))
        a = np.zeros((base.layers, fan_in, width), np.float32)
        b = np.zeros((base.layers, width, fan_out), np.float32)
        starts = np.cumsum((0, *base.parts.get(site, ())))
        for layer in range(base.layers):
            col = 0
            for module in (m for m in modules if (layer, m) in pairs):
                lora_a, lora_b = pairs[layer, module]
                rank, part = lora_a.shape[0], MODULES[module][1]
                out = slice(0, fan_out) if part is None else slice(starts[part], starts[part + 1])
                a[layer, :, col : col + rank] = lora_a.T
                b[layer, col : col + rank, out] = lora_b.T * _scale(config, module, rank)
                col += rank
        a_out[site], b_out[site] = a.astype(dtype), b.astype(dtype)
    return a_out, b_out


@dataclass
class AdapterSlots:
    """The resident adapters: which adapter each slot holds, how many running rows use it, and the
    step's stacked inputs for them (rebuilt when the resident set changes; `version` counts that).
    A slot holds one version of an adapter: one replaced or removed while rows use it stays until
    they finish, and new rows take the served version."""

    base: BaseShape
    slots: int
    dtype: np.dtype
    served: dict[str, Adapter] = field(default_factory=dict)
    resident: list[Adapter | None] = field(default_factory=list)
    users: list[int] = field(default_factory=list)
    last_used: list[int] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)  # name -> why its files could not be served
    version: int = 0
    _clock: int = 0
    _weights: AdapterWeights | None = None

    def add(self, adapter: Adapter) -> None:
        """Serves `adapter`, replacing a served one of its name."""
        self.served[adapter.name] = adapter
        self.refused.pop(adapter.name, None)
        self._evict_stale()

    def remove(self, name: str, why: str | None = None) -> None:
        """Stops serving `name` (`why`: its files were refused); rows using it finish first."""
        self.served.pop(name, None)
        self.refused.pop(name, None)
        if why:
            self.refused[name] = why
        self._evict_stale()

    def apply(self, change: AdapterChange) -> None:
        if change.adapter is not None:
            self.add(change.adapter)
        else:
            self.remove(change.name, change.error)

    def check(self, name: str) -> Adapter:
        """The served adapter called `name`; UnknownAdapter lists the served ones."""
        if name not in self.served:
            listed = ", ".join(sorted(self.served)) or "none"
            why = f" ({self.refused[name]})" if name in self.refused else ""
            raise UnknownAdapter(f"adapter {name!r} is not served here{why}; served adapters: {listed}")
        return self.served[name]

    def acquire(self, adapter: Adapter) -> int | None:
        """The slot of `adapter` for one more running row, loading it if needed; None: every slot
        is held by rows of other adapters (the row waits)."""
        self._clock += 1
        slot = next((s for s, held in enumerate(self.resident) if held is adapter), None)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            self._fill(slot, adapter)
        self.users[slot] += 1
        self.last_used[slot] = self._clock
        return slot

    def release(self, slot: int) -> None:
        self.users[slot] -= 1
        self._evict_stale()

    def weights(self, convert: Callable[[np.ndarray], object] = lambda w: w) -> AdapterWeights | None:
        """The step's adapter inputs for the resident set (None: nothing was ever resident)."""
        if not self.resident:
            return None
        if self._weights is None:
            self._weights = AdapterWeights(*(w for site in ADAPTER_SITES for w in self._stacked(site)))
        return AdapterWeights(*(convert(w) for w in self._weights))

    def _stacked(self, site: str) -> tuple[np.ndarray, np.ndarray]:
        fan_in, fan_out = self.base.sites.get(site, (0, 0))
        width = max((h.a[site].shape[-1] for h in self.resident if h is not None and site in h.a), default=0)
        a = np.zeros((self.base.layers, len(self.resident), fan_in, width), self.dtype)
        b = np.zeros((self.base.layers, len(self.resident), width, fan_out), self.dtype)
        for slot, adapter in enumerate(self.resident):
            if adapter is not None and site in adapter.a:
                rank = adapter.a[site].shape[-1]
                a[:, slot, :, :rank] = adapter.a[site]
                b[:, slot, :rank, :] = adapter.b[site]
        return a, b

    def _free_slot(self) -> int | None:
        if len(self.resident) < self.slots:
            self.resident.append(None)
            self.users.append(0)
            self.last_used.append(0)
            return len(self.resident) - 1
        idle = [s for s in range(len(self.resident)) if not self.users[s]]
        return min(idle, key=lambda s: self.last_used[s]) if idle else None

    def _evict_stale(self) -> None:
        """Empties the slots no row uses whose adapter is no longer the served one of its name."""
        for slot, held in enumerate(self.resident):
            if held is not None and not self.users[slot] and self.served.get(held.name) is not held:
                self._fill(slot, None)

    def _fill(self, slot: int, adapter: Adapter | None) -> None:
        self.resident[slot] = adapter
        self.version += 1
        self._weights = None


@dataclass(frozen=True)
class AdapterChange:
    """An adapter to serve (`adapter`), or a name to stop serving (`error`: why its files were refused)."""

    name: str
    adapter: Adapter | None = None
    error: str | None = None


class AdapterWatcher:
    """A directory whose subdirectories are adapters, each named as its subdirectory: `scan` reads
    what was added, changed (its files' sizes and times) or removed since the last scan, and
    loads the new ones off the engine's thread. A directory whose files cannot be served is
    reported with the reason and scanned again when they change."""

    def __init__(self, root: Path, base: BaseShape, dtype: np.dtype) -> None:
        self.root, self.base, self.dtype = Path(root), base, dtype
        self.seen: dict[str, tuple] = {}

    def scan(self) -> list[AdapterChange]:
        current = {}
        for path in sorted(self.root.iterdir()) if self.root.is_dir() else []:
            if (path / CONFIG_FILE).is_file():
                current[path.name] = (path, _signature(path))
        changes = [AdapterChange(name) for name in self.seen if name not in current]
        for name, (path, signature) in current.items():
            if self.seen.get(name) != signature:
                try:
                    changes.append(AdapterChange(name, load_adapter(name, path, self.base, self.dtype)))
                except AdapterError as exc:
                    changes.append(AdapterChange(name, error=str(exc)))
        self.seen = {name: signature for name, (_, signature) in current.items()}
        return changes


def _signature(path: Path) -> tuple:
    stats = [(path / name).stat() if (path / name).exists() else None for name in (CONFIG_FILE, WEIGHTS_FILE)]
    return tuple((s.st_size, s.st_mtime_ns) if s else None for s in stats)
