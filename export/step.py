"""The decoder step we export: our own functional forward over a Hugging Face model's weights.

One graph serves prefill and decode for a continuous-batching engine that keeps its own paged
KV cache. The engine gathers the cached keys/values of the sequences it is running, pads them
to a common length, and feeds only the tokens that are new; the step returns logits for the
last position and the keys/values of the new tokens only, which the engine writes back.

Signature (L layers, H kv heads, D head dim, V vocab; B, S, P are dynamic):

    input_ids       int64  [B, S]           new tokens, LEFT-padded so every row ends at S-1
    position_ids    int64  [B, S]           absolute position of each new token
    attention_mask  bool   [B, P + S]       True where a key is real (past or new), False = padding
    past_keys       f32    [L, B, P, H, D]  cached keys, rows right-padded to P
    past_values     f32    [L, B, P, H, D]
    ->
    logits          f32    [B, V]           at position S-1 of every row
    new_keys        f32    [L, B, S, H, D]  keys of the S new tokens (after rotary)
    new_values      f32    [L, B, S, H, D]

Keys are stored after the rotary embedding, as HF's own cache stores them, so a cached key
never has to be rotated again. The [.., P, H, D] layout matches a paged cache of shape
[L, blocks, block_size, H, D]: gathering a row's blocks yields its past without a transpose.
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
        past_keys: torch.Tensor,
        past_values: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.embed(input_ids)
        cos, sin = self._rotary(position_ids)
        bias = self._attention_bias(attention_mask, input_ids.shape[1])
        new_keys, new_values = [], []
        for i, layer in enumerate(self.layers):
            attn_out, k, v = self._attention(layer.self_attn, layer.input_layernorm(h), cos, sin, bias,
                                             past_keys[i], past_values[i])
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
        """Additive bias [B, 1, 1, S, P+S]: padding keys and future new tokens are masked.

        A large finite negative (not -inf) keeps fully padded rows finite instead of NaN.
        """
        total = attention_mask.shape[1]
        query_pos = torch.arange(new_len, device=attention_mask.device)[:, None] + (total - new_len)
        key_pos = torch.arange(total, device=attention_mask.device)[None, :]
        allowed = (key_pos <= query_pos)[None, :, :] & attention_mask[:, None, :].bool()
        zero = torch.zeros((), dtype=torch.float32)
        bias = torch.where(allowed, zero, torch.full((), torch.finfo(torch.float32).min))
        return bias[:, None, None, :, :]

    def _attention(self, attn, x, cos, sin, bias, past_k, past_v):
        """Grouped-query attention without materialising repeated K/V heads."""
        b, s, _ = x.shape
        group = self.num_heads // self.num_kv_heads
        q = attn.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys = torch.cat((past_k, k), dim=1)  # [B, T, H, D]
        values = torch.cat((past_v, v), dim=1)
        q = q.view(b, s, self.num_kv_heads, group, self.head_dim).permute(0, 2, 3, 1, 4)  # [B,H,G,S,D]
        scores = torch.matmul(q, keys.permute(0, 2, 3, 1)[:, :, None]) * self.scaling + bias
        probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        out = torch.matmul(probs, values.permute(0, 2, 1, 3)[:, :, None])  # [B,H,G,S,D]
        out = out.permute(0, 3, 1, 2, 4).reshape(b, s, self.num_heads * self.head_dim)
        return attn.o_proj(out), k, v


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
