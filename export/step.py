"""The decoder step we export: our own functional forward over a Hugging Face model's weights.

One graph serves prefill and decode for a continuous-batching engine that keeps its own paged
KV cache. The engine passes its whole cache (read-only) plus, for each row, the cache slots of
that sequence's past tokens; it feeds only the tokens that are new. The step returns logits for
the last position and the keys/values of the new tokens only, which the engine writes back.

Signature (L layers, H kv heads, D head dim, V vocab; B, S, P, N are dynamic):

    input_ids       int64  [B, S]          new tokens, LEFT-padded so every row ends at S-1
    position_ids    int64  [B, S]          absolute position of each new token
    attention_mask  bool   [B, P + S]      True where a key is real (past or new), False = padding
    past_slots      int64  [B, P]          cache slot of each past position (padding: any slot)
    key_cache       f32    [L, H, N, D]    the engine's paged cache, N slots (read only)
    value_cache     f32    [L, H, N, D]
    ->
    logits          f32    [B, V]          at position S-1 of every row
    new_keys        f32    [L, H, B, S, D] keys of the S new tokens (after rotary)
    new_values      f32    [L, H, B, S, D]

Why this shape: on a CPU a decode step is bound by memory traffic over the past keys/values.
Gathering them per layer inside the graph (instead of copying every sequence's past into a
padded batch first) touches each byte once, while it is hot in cache, and the [H, B, P, D]
layout that Gather yields is the one the attention matmuls consume, so past keys/values are
never concatenated or transposed: scores for past and new keys are computed apart and joined
(they are D times smaller). Keys are cached after the rotary embedding, as HF's cache does.
"""

from __future__ import annotations

import torch
from torch import nn

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
UNSUPPORTED_ROPE = ("dynamic", "longrope")


class UnsupportedModel(ValueError):
    """The checkpoint's architecture is outside what the step implements."""


def check_supported(config) -> None:
    """Refuses, with the reason, checkpoints whose forward this step would not reproduce."""
    model_type = getattr(config, "model_type", "?")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not supported; batchstring exports Llama-family "
            f"decoders: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope in UNSUPPORTED_ROPE:
        raise UnsupportedModel(f"rope_type {rope!r} changes with sequence length and is not supported")
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "use_sliding_window", model_type == "mistral")
    if window and uses_window and window < config.max_position_embeddings:
        raise UnsupportedModel(
            f"sliding-window attention (window {window} < context {config.max_position_embeddings}) "
            "is not supported"
        )


class DecoderStep(nn.Module):
    """Prefill-or-decode step over the modules of a `*ForCausalLM` (see module docstring)."""

    def __init__(self, hf_model) -> None:
        super().__init__()
        check_supported(hf_model.config)
        inner = hf_model.model
        self.embed = inner.embed_tokens
        self.layers = inner.layers
        self.norm = inner.norm
        self.lm_head = hf_model.lm_head
        attn = self.layers[0].self_attn
        if hasattr(attn, "q_norm"):
            raise UnsupportedModel("per-head q/k normalisation (Qwen3-style) is not supported")
        cfg = hf_model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        rotary = inner.rotary_emb
        self.register_buffer("inv_freq", rotary.inv_freq.detach().clone().float(), persistent=False)
        self.rope_scale = float(rotary.attention_scaling)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        past_slots: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.embed(input_ids)
        cos, sin = self._rotary(position_ids)
        bias = self._attention_bias(attention_mask, input_ids.shape[1])
        # One flat Gather per layer: indexing key_cache[i] first would copy the whole layer.
        num_slots = key_cache.shape[2]
        flat_keys = key_cache.reshape(-1, self.head_dim)
        flat_values = value_cache.reshape(-1, self.head_dim)
        heads = torch.arange(self.num_kv_heads, device=past_slots.device)[:, None, None] * num_slots
        new_keys, new_values = [], []
        for i, layer in enumerate(self.layers):
            rows = heads + past_slots[None] + i * self.num_kv_heads * num_slots  # [H, B, P]
            past_k = flat_keys[rows]  # [H, B, P, D]
            past_v = flat_values[rows]
            attn_out, k, v = self._attention(layer.self_attn, layer.input_layernorm(h), cos, sin, bias, past_k, past_v)
            h = h + attn_out
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            new_keys.append(k)
            new_values.append(v)
        logits = self.lm_head(self.norm(h[:, -1, :]))
        return logits.float(), torch.stack(new_keys), torch.stack(new_values)

    def _rotary(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq  # [B, S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [B, S, 1, D]
        return emb.cos() * self.rope_scale, emb.sin() * self.rope_scale

    @staticmethod
    def _attention_bias(attention_mask: torch.Tensor, new_len: int) -> torch.Tensor:
        """Additive bias [1, B, 1, S, P+S]: padding keys and future new tokens are masked.

        A large finite negative (not -inf) keeps fully padded rows finite instead of NaN.
        """
        total = attention_mask.shape[1]
        query_pos = torch.arange(new_len, device=attention_mask.device)[:, None] + (total - new_len)
        key_pos = torch.arange(total, device=attention_mask.device)[None, :]
        allowed = (key_pos <= query_pos)[None, :, :] & attention_mask[:, None, :].bool()
        zero = torch.zeros((), dtype=torch.float32)
        bias = torch.where(allowed, zero, torch.full((), torch.finfo(torch.float32).min))
        return bias[None, :, None, :, :]

    def _attention(self, attn, x, cos, sin, bias, past_k, past_v):
        """Grouped-query attention in the cache's [H, B, ., D] layout; past K/V are only read."""
        b, s, _ = x.shape
        group = self.num_heads // self.num_kv_heads
        q = attn.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        q = q * cos + _rotate_half(q) * sin
        k = (k * cos + _rotate_half(k) * sin).permute(2, 0, 1, 3)  # [H, B, S, D]
        v = v.permute(2, 0, 1, 3)
        q = q.view(b, s, self.num_kv_heads, group, self.head_dim).permute(2, 0, 3, 1, 4)  # [H, B, G, S, D]
        scores = torch.cat(
            (torch.matmul(q, past_k[:, :, None].transpose(-1, -2)), torch.matmul(q, k[:, :, None].transpose(-1, -2))),
            dim=-1,
        ) * self.scaling + bias  # [H, B, G, S, P+S]
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        past_len = past_k.shape[2]
        out = torch.matmul(probs[..., :past_len], past_v[:, :, None])
        out = out + torch.matmul(probs[..., past_len:], v[:, :, None])
        out = out.permute(1, 3, 0, 2, 4).reshape(b, s, self.num_heads * self.head_dim)  # [B, S, H*G*D]
        return attn.o_proj(out), k, v


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
