"""The decoder families the step exports, as data: what each does beyond Llama's layer.

One step (export/step.py) runs every family. What differs between them is either named here
per model_type (where a layer's norms sit, how queries and keys are normalised) or read from the
checkpoint's own config and modules, which already say it: the attention scale (`scaling`),
per-layer sliding windows (`sliding_window`, `layer_types`), layers without rotary embeddings
(`use_rope`), per-layer rotary tables (Gemma 3's `{layer_type}_inv_freq`), partial rotary (the
length of `inv_freq`), soft-capping, and Granite's multipliers. A model_type not listed is
refused by name, as is any feature the step does not reproduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

# Each decoder sublayer (attention, then MLP) as (norm before it, norm after it); None: no norm there.
PRE = (("input_layernorm", None), ("post_attention_layernorm", None))  # Llama: x + f(norm(x))
SANDWICH = (("input_layernorm", "post_attention_layernorm"),  # Gemma 2/3: x + norm(f(norm(x)))
            ("pre_feedforward_layernorm", "post_feedforward_layernorm"))
POST = ((None, "post_attention_layernorm"), (None, "post_feedforward_layernorm"))  # OLMo 2: x + norm(f(x))


@dataclass(frozen=True)
class Family:
    """What a family's layer does that its config and modules do not say by themselves."""

    norms: tuple[tuple[str | None, str | None], ...] = PRE
    qk_norm: str | None = None  # "head": each head's queries/keys (Qwen3, Gemma 3); "all": all heads at once (OLMo 2)
    # How a mixture's experts are stored: "stacked" [E, 2f, d] gate then up (Qwen3-MoE, Mixtral);
    # "interleaved" [E, d, 2f] gate and up alternating, with biases and a clamped GLU (gpt-oss)
    experts: str = "stacked"


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(),
    "qwen3": Family(qk_norm="head"),
    "olmo2": Family(norms=POST, qk_norm="all"),
    "granite": Family(),
    "smollm3": Family(),
    "phi3": Family(),
    "starcoder2": Family(),
    "gemma2": Family(norms=SANDWICH),
    "gemma3_text": Family(norms=SANDWICH, qk_norm="head"),
    "qwen3_moe": Family(qk_norm="head"),
    "mixtral": Family(),
    "gpt_oss": Family(experts="interleaved"),
}

# Known families whose missing feature we can name (anything else: "model_type ... is not supported").
MISSING = {
    "qwen2_moe": "shared experts beside the routed ones",
    "gemma3": "the vision tower (export the text model, model_type gemma3_text)",
    "phimoe": "its sparsemixer routing",
}
UNSUPPORTED_ROPE = {"dynamic": "its frequencies change with every sequence length"}


class UnsupportedModel(ValueError):
    """The checkpoint's architecture is outside what the step implements."""


class LayerPlan(NamedTuple):
    """What one layer's attention does beyond plain causal attention over every past token."""

    window: int | None  # a query sees keys at most window - 1 positions back (HF's sliding_window)
    rope: str | None  # which rotary table rotates its queries and keys; None: no rotary embedding (NoPE)


def family_of(config) -> Family:
    """The checkpoint's family, or a refusal naming what is missing."""
    model_type = getattr(config, "model_type", "?")
    if model_type in MISSING:
        raise UnsupportedModel(f"model_type {model_type!r} needs {MISSING[model_type]}, which batchstring does not "
                               f"export yet; supported: {', '.join(FAMILIES)}")
    if model_type not in FAMILIES:
        raise UnsupportedModel(f"model_type {model_type!r} is not supported; batchstring exports these decoder "
                               f"families: {', '.join(FAMILIES)}")
    for params in _rope_parameters(config):
        rope = params.get("rope_type", "default")
        if rope in UNSUPPORTED_ROPE:
            raise UnsupportedModel(f"rope_type {rope!r} is not supported: {UNSUPPORTED_ROPE[rope]}")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModel("bidirectional attention (use_bidirectional_attention) is not a causal decoder")
    return FAMILIES[model_type]


def _rope_parameters(config) -> list[dict]:
    """Every rotary parameter set: one, or one per layer type (Gemma 3)."""
    params = getattr(config, "rope_parameters", None) or {}
    nested = [p for p in params.values() if isinstance(p, dict)]
    return nested or [params]


def layer_plans(hf_model) -> list[LayerPlan]:
    """Each layer's window and rotary table, from the modules (they hold what the config means for
    that family: Qwen's windows apply to the layers layer_types marks, Mistral's to all)."""
    config, inner = hf_model.config, hf_model.model
    context = config.max_position_embeddings
    plans = []
    for layer in inner.layers:
        attn = layer.self_attn
        window = getattr(attn, "sliding_window", getattr(config, "sliding_window", None))
        layer_type = getattr(attn, "layer_type", None)
        rope = layer_type if hasattr(inner.rotary_emb, f"{layer_type}_inv_freq") else "default"
        plans.append(LayerPlan(window if window and window < context else None,
                               rope if getattr(attn, "use_rope", True) else None))
    return plans


def rotary_tables(rotary) -> dict[str, tuple]:
    """Each rotary table the layers use: name -> (inv_freq, attention_scaling). The original
    frequencies: an HF forward past longrope's threshold swaps `inv_freq` for its long ones."""
    types = getattr(rotary, "layer_types", None)
    if types and hasattr(rotary, f"{types[0]}_inv_freq"):
        return {t: (getattr(rotary, f"{t}_original_inv_freq"), getattr(rotary, f"{t}_attention_scaling"))
                for t in types}
    return {"default": (getattr(rotary, "original_inv_freq", rotary.inv_freq), rotary.attention_scaling)}


def long_rope(config):
    """LongRoPE (Phi-3's 128k checkpoints, Phi-4-mini): (the long factors' inv_freq, the position
    from which they apply), or None. HF rotates a forward call's tokens with the long factors when
    the call reaches past original_max_position_embeddings, with the short ones otherwise; the
    step decides the same per row, by the row's last position in the step."""
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type") != "longrope":
        return None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    threshold = int(params["original_max_position_embeddings"])
    long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=threshold + 1)
    return long_inv_freq, threshold


def features(hf_model) -> list[str]:
    """What the step does for this checkpoint beyond a Llama layer, in words (the export prints it)."""
    config = hf_model.config
    family = family_of(config)
    plans = layer_plans(hf_model)
    found = []
    if family.norms != PRE:
        found.append("norms " + ("around each sublayer" if family.norms == SANDWICH else "after each sublayer"))
    if family.qk_norm:
        found.append(f"q/k norm ({family.qk_norm})")
    if hasattr(hf_model.model.layers[0].self_attn, "sinks"):
        found.append("attention sinks")
    windows = sorted({p.window for p in plans if p.window})
    if windows:
        local = sum(p.window is not None for p in plans)
        found.append(f"sliding window {', '.join(map(str, windows))} on {local}/{len(plans)} layers")
    if any(p.rope is None for p in plans):
        found.append(f"no rotary on {sum(p.rope is None for p in plans)}/{len(plans)} layers")
    if len(rotary_tables(hf_model.model.rotary_emb)) > 1:
        found.append("a rotary table per layer type")
    for name in ("attn_logit_softcapping", "final_logit_softcapping", "embedding_multiplier",
                 "residual_multiplier", "logits_scaling"):
        value = getattr(config, name, None)
        if value not in (None, 1.0):
            found.append(f"{name} {value:g}")
    mixtures = [layer.mlp for layer in hf_model.model.layers if hasattr(layer.mlp, "experts")]
    if mixtures:
        router = getattr(mixtures[0], "gate", None) or mixtures[0].router
        found.append(f"{mixtures[0].experts.num_experts} experts, top-{router.top_k} "
                     f"on {len(mixtures)}/{len(plans)} layers")
    for params in _rope_parameters(config):
        if params.get("rope_type", "default") != "default":
            found.append(f"rope {params['rope_type']}")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            found.append(f"partial rotary {params['partial_rotary_factor']:g}")
    return found
