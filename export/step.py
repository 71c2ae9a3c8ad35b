"""The decoder step we export: our own functional forward over a Hugging Face model's weights.

One graph serves a whole engine iteration: rows that decode one token and rows that prefill
(a whole prompt, or a chunk of one) run together. The engine keeps its own paged KV cache; it
passes the whole cache (read-only) plus, per row, the cache slots of that row's past tokens, and
feeds only the tokens that are new. The step returns the next token of every row that asks for
one (sampled inside the graph, see export/sampler.py) and the keys/values of the new tokens,
which the engine writes back.

Signature (L layers, H kv heads, D head dim, V vocabulary; T, Bd, Pd, Bp, Sp, Pp, R, M, G, W, E, N
dynamic):

    input_ids       int64 [T]            the new tokens of every row, packed
    position_ids    int64 [T]            absolute position of each
    decode_tokens   int64 [Bd, 1]        decode group: the packed index of each row's one token
    decode_slots    int64 [Bd, Pd]       cache slot of each past position (padding: any slot)
    decode_mask     bool  [Bd, Pd + 1]   True where a key is real (past, then the token itself)
    prefill_tokens  int64 [Bp, Sp]       prefill group: packed index of each new token, LEFT-padded
    prefill_slots   int64 [Bp, Pp]
    prefill_mask    bool  [Bp, Pp + Sp]
    token_order     int64 [T]            where token t sits in (decode rows, then prefill rows x Sp)
    logit_tokens    int64 [R]            packed index of each token whose successor is wanted
    ban_rows        int64 [K]            rows (of R) whose end-of-sequence ids are banned (min_tokens)
    sample_rows     int64 [M]            rows (of R) that sample or want log-probabilities
    temperature     f32   [M]            0 = greedy
    top_k           int64 [M]            0 = off
    top_p           f32   [M]
    uniform         f32   [M]            in (0, 1], from the request's own generator
    min_p           f32   [M]            0 = off
    mask_rows       int64 [G]            rows (of R) constrained by a grammar
    token_mask      int32 [G, W]         their packed bitmasks of allowed tokens (32 * W >= V)
    adjust_rows     int64 [E]            logit adjustments (logit_bias, penalties): row of each entry
    adjust_tokens   int64 [E]            token of each entry
    adjust_bias     f32   [E]            added
    adjust_scale    f32   [E]            repetition penalty (1 = none)
    adjust_shift    f32   [E]            subtracted (frequency * count + presence)
    key_cache       [L, H, N, D]         the engine's paged cache, N slots (read only), model dtype
    value_cache     [L, H, N, D]
    ->
    next_tokens     int64 [R]
    token_logprobs  f32   [M]            log-probability of each sampled row's token under the model
    top_ids         int64 [M, n]         the n most likely tokens of each sampled row
    top_logprobs    f32   [M, n]
    logits          f32   [R, V]         for verification; the engine never fetches them
    new_keys        [L, H, T, D]         keys of the new tokens (after rotary), packed like input_ids
    new_values      [L, H, T, D]

Why this shape:
- Linear layers (projections, MLP, head) run on the packed tokens: no compute is spent on padding.
- Attention runs per group. Decode rows (one query each) and prefill rows (many) would waste
  Sp-fold work on each other if padded together, so each group is padded only within itself.
- A small step (a few rows, drafts included) wastes almost nothing padded together, and on a CPU
  its time goes to the number of operators, not to arithmetic: a second graph, exported with
  `single_group`, has the prefill group only (every row in it; the decode inputs are accepted and
  ignored) and about a quarter fewer operators. The engine puts every row of a step of at most
  SMALL_STEP_TOKENS tokens in the prefill group (engine/batch.py), which both graphs compute
  alike, and the CPU runner sends those steps to this graph (engine/runner.py).
- On a CPU a decode step is bound by memory traffic over the past keys/values. Gathering them per
  layer inside the graph (instead of copying every row's past into a padded batch first) touches
  each byte once, while it is hot in cache, and the [H, B, 1, P, D] layout that Gather yields is
  the one the attention matmuls consume, so past keys/values are never concatenated or transposed:
  scores for past and new keys are computed apart and joined (they are D times smaller).
- Keys are cached after the rotary embedding, as HF's cache does.
- q/k/v and gate/up are one projection each (`StepLayer`), and one rotation covers every head of
  the fused projection (the values' factors are cos 1, sin 0): five matrix multiplies per layer
  become two, and no outputs are concatenated.
- On a small step the operators' count, not their arithmetic, sets the time: whatever is the same
  in every layer is computed once per step (the gathers' row offsets, the attention scale, folded
  into the queries' rotary factors), and index shapes carry the axes the matmuls broadcast over.
- No tensor is created on a device named in the code: a trace records such a device as a
  constant, and `torch.jit.load(map_location=...)` moves only parameters and buffers. Fixed
  index tensors are buffers (they move with the weights); everything sized at run time is built
  from an input (`ones_like(...).cumsum`, `zeros_like`), so one TorchScript file exported on the
  CPU runs on any device, each Triton instance on its own GPU (tests/test_gpu_path.py proves it
  on the `meta` device).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from batchstring.export.sampler import SamplingHead

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
    """One engine iteration over the modules of a `*ForCausalLM` (see module docstring).

    `vocab_size` may be smaller than the checkpoint's: ids past the tokenizer's last one (padded
    vocabularies) are cut off the logits and `never_ids` (holes in the tokenizer's ids) are masked,
    so a token the tokenizer cannot turn into text is never sampled.
    """

    def __init__(self, hf_model, eos_ids: list[int] = (), vocab_size: int | None = None,
                 never_ids: list[int] = (), single_group: bool = False) -> None:
        super().__init__()
        self.single_group = single_group
        check_supported(hf_model.config)
        inner = hf_model.model
        attn = inner.layers[0].self_attn
        if hasattr(attn, "q_norm"):
            raise UnsupportedModel("per-head q/k normalisation (Qwen3-style) is not supported")
        self.embed = inner.embed_tokens
        self.layers = nn.ModuleList(StepLayer(layer) for layer in inner.layers)
        self.norm = inner.norm
        self.lm_head = hf_model.lm_head
        cfg = hf_model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = attn.head_dim
        rotary = inner.rotary_emb
        self.register_buffer("inv_freq", rotary.inv_freq.detach().clone().float(), persistent=False)
        self.register_buffer("kv_head_index", torch.arange(self.num_kv_heads)[:, None, None, None], persistent=False)
        # The rotary factors cover every head of the fused projection: the queries' carry the attention
        # scale (one multiply per step, not per layer), the values' are cos 1, sin 0 (left as they are).
        # In the model's dtype, as the weights: the export's dtype check reads every constant.
        heads = (self.num_heads, self.num_kv_heads, self.num_kv_heads)
        head_scale = torch.tensor([attn.scaling] * heads[0] + [1.0] * heads[1] + [0.0] * heads[2])
        value_heads = torch.tensor([0.0] * (heads[0] + heads[1]) + [1.0] * heads[2])
        self.register_buffer("head_scale", head_scale[None, :, None].to(self.dtype), persistent=False)
        self.register_buffer("value_heads", value_heads[None, :, None].to(self.dtype), persistent=False)
        self.rope_scale = float(rotary.attention_scaling)
        self.vocab_size = min(vocab_size or self.lm_head.out_features, self.lm_head.out_features)
        self.sampler = SamplingHead(self.vocab_size, list(eos_ids), list(never_ids))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def as_single_group(self) -> DecoderStep:
        """This step with the prefill group only (see the module docstring), its modules shared."""
        twin = copy.copy(self)
        twin.single_group = True
        return twin

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        decode_tokens: torch.Tensor,
        decode_slots: torch.Tensor,
        decode_mask: torch.Tensor,
        prefill_tokens: torch.Tensor,
        prefill_slots: torch.Tensor,
        prefill_mask: torch.Tensor,
        token_order: torch.Tensor,
        logit_tokens: torch.Tensor,
        ban_rows: torch.Tensor,
        sample_rows: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        uniform: torch.Tensor,
        min_p: torch.Tensor,
        mask_rows: torch.Tensor,
        token_mask: torch.Tensor,
        adjust_rows: torch.Tensor,
        adjust_tokens: torch.Tensor,
        adjust_bias: torch.Tensor,
        adjust_scale: torch.Tensor,
        adjust_shift: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        # Activations keep a leading axis of 1 ([1, T, d]): ONNX Runtime runs 3-D linear layers as
        # MatMul with prepacked weights, measurably faster at small T than the Gemm a 2-D input gets.
        h = self.embed(input_ids[None])
        cos, sin = self._rotary(position_ids)
        inputs = [(prefill_tokens, prefill_slots, prefill_mask)]
        if not self.single_group:
            inputs.insert(0, (decode_tokens, decode_slots, decode_mask))
        groups = [(tokens, slots, _attention_bias(mask, tokens.shape[1])) for tokens, slots, mask in inputs]
        # One flat Gather per layer and group: indexing key_cache[i] first would copy the whole layer.
        num_slots = key_cache.shape[2]
        flat_keys = key_cache.reshape(-1, self.head_dim)
        flat_values = value_cache.reshape(-1, self.head_dim)
        layer_stride = self.num_kv_heads * num_slots
        past_rows = [self.kv_head_index * num_slots + slots[None, :, None] for _, slots, _ in groups]  # [H, B, 1, P]
        new_kv = []
        q_heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        for i, layer in enumerate(self.layers):
            x = _rms_norm(layer.input_layernorm, h)
            qkv = _rotate(layer.qkv(x).view(-1, q_heads + 2 * kv_heads, dim), cos, sin)  # [T, Hq + 2H, D]
            outs = []
            for (tokens, _, bias), rows in zip(groups, past_rows):
                rows = rows + i * layer_stride if i else rows
                q_g, k_g, v_g = _take(qkv, tokens).split((q_heads, kv_heads, kv_heads), dim=2)
                outs.append(self._attention(q_g, k_g, v_g, bias, _take(flat_keys, rows), _take(flat_values, rows)))
            h = h + layer.o_proj(torch.index_select(torch.cat(outs, 1), 1, token_order))
            h = h + layer.mlp(_rms_norm(layer.post_attention_layernorm, h))
            new_kv.append(qkv[:, q_heads:])  # [T, 2H, D]
        last = _take(h[0], logit_tokens)[None]
        logits = self.lm_head(_rms_norm(self.norm, last))[0].float()
        if self.vocab_size < logits.shape[1]:
            logits = logits[:, : self.vocab_size]
        sampled = self.sampler(logits, ban_rows, sample_rows, temperature, top_k, top_p, uniform, min_p,
                               mask_rows, token_mask, adjust_rows, adjust_tokens, adjust_bias, adjust_scale,
                               adjust_shift)
        new_keys, new_values = torch.stack(new_kv).transpose(1, 2).split(kv_heads, dim=1)  # [L, H, T, D] each
        return (*sampled, logits, new_keys, new_values)

    def _rotary(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, Hq + 2H, D] for every head of the fused projection: the queries' scaled
        by the attention scale (rotation is linear: scaling the rotated query scales its scores),
        the values' cos 1 and sin 0, so one rotation per layer leaves them exactly as they were."""
        freqs = position_ids[:, None].float() * self.inv_freq  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        return ((emb.cos() * self.rope_scale).to(self.dtype) * self.head_scale + self.value_heads,
                (emb.sin() * self.rope_scale).to(self.dtype) * self.head_scale)

    def _attention(self, q, k, v, bias, past_k, past_v):
        """Grouped-query attention of one group; q [B, S, Hq, D] (already scaled), k/v [B, S, H, D],
        past [H, B, 1, P, D] (the 1 broadcasts over a kv head's query group).

        Returns [1, B * S, Hq * D], the rows in the group's (row, position) order.
        """
        b, s = q.shape[:2]
        heads, group, dim = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        q = q.view(b, s, heads, group, dim).permute(2, 0, 3, 1, 4)  # [H, B, G, S, D]
        k = k.view(b, s, heads, 1, dim).permute(2, 0, 3, 1, 4)  # [H, B, 1, S, D]
        v = v.view(b, s, heads, 1, dim).permute(2, 0, 3, 1, 4)
        scores = torch.cat((torch.matmul(q, past_k.transpose(-1, -2)), torch.matmul(q, k.transpose(-1, -2))),
                           dim=-1)  # [H, B, G, S, P+S]
        probs = torch.softmax(scores.float() + bias, dim=-1).to(v.dtype)
        past_len = past_k.shape[3]
        on_past, on_new = probs.split((past_len, s), dim=-1)
        out = torch.matmul(on_past, past_v) + torch.matmul(on_new, v)
        return out.permute(1, 3, 0, 2, 4).reshape(1, b * s, self.num_heads * dim)


class StepLayer(nn.Module):
    """One decoder layer's weights as the step runs them: q, k and v as one projection, gate and
    up as another (two matrix multiplies where the checkpoint has five, and no concatenation of
    their outputs). Only the fused copies are held, so neither export file stores a layer's
    projection twice; the norms, o_proj and down_proj are the checkpoint's own modules."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.qkv = _fused_linear(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o_proj = attn.o_proj
        self.gate_up = _fused_linear(mlp.gate_proj, mlp.up_proj)
        self.down_proj = mlp.down_proj
        self.act_fn = mlp.act_fn

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def _fused_linear(*parts: nn.Linear) -> nn.Linear:
    """One Linear whose outputs are `parts`' outputs side by side (a missing bias counts as zeros)."""
    weight = parts[0].weight
    has_bias = any(p.bias is not None for p in parts)
    fused = nn.Linear(weight.shape[1], sum(p.out_features for p in parts), bias=has_bias,
                      device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if has_bias:
            fused.bias.copy_(torch.cat([p.bias if p.bias is not None else torch.zeros_like(p.weight[:, 0])
                                        for p in parts]))
    return fused.requires_grad_(False)


def _attention_bias(attention_mask: torch.Tensor, new_len: int) -> torch.Tensor:
    """Additive float32 bias [1, B, 1, S, P+S]: padding keys and future new tokens are masked.

    Key positions are a cumulative sum over the mask's own shape (an arange would carry the
    tracing device). A large finite negative (not -inf) keeps fully padded rows finite instead of NaN.
    """
    key_pos = torch.ones_like(attention_mask, dtype=torch.int64).cumsum(1)  # [B, P+S]: 1, 2, ...
    query_pos = key_pos[:, key_pos.shape[1] - new_len :]  # [B, S]: the new tokens are the last S keys
    allowed = (key_pos[:, None, :] <= query_pos[:, :, None]) & attention_mask[:, None, :].bool()
    bias = torch.zeros_like(allowed, dtype=torch.float32).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return bias[None, :, None, :, :]


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF's RMSNorm (float32 statistics, weight applied in the model's dtype), written with a
    division so that ONNX Runtime fuses it into one SimplifiedLayerNormalization kernel."""
    xf = x.float()
    normed = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * normed.to(x.dtype)


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] along the first axis, for an index of any shape: one flat Gather in ONNX
    (advanced indexing exports as GatherND plus reshapes, measurably slower)."""
    return torch.index_select(x, 0, index.reshape(-1)).view(*index.shape, *x.shape[1:])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
