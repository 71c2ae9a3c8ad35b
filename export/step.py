"""The decoder step we export: our own functional forward over a Hugging Face model's weights.

One graph serves a whole engine iteration: rows that decode one token and rows that prefill
(a whole prompt, or a chunk of one) run together. The engine keeps its own paged KV cache and
block table; it passes both whole (read-only) plus, per row, its table row and its past length,
and feeds only the tokens that are new. The step returns the next token of every row that asks
for one (sampled inside the graph, see export/sampler.py) and the keys/values of the new tokens,
which the engine writes back.

Signature (L layers, H kv heads, D head dim, V vocabulary; every other size dynamic):

    input_ids       int64 [T]            the new tokens of every row, packed
    position_ids    int64 [T]            absolute position of each
    decode_tokens   int64 [Bd, 1]        decode group: the packed index of each row's one token
    decode_rows     int64 [Bd]           each row's row of block_table
    decode_context  int64 [Bd]           each row's past tokens (in the cache)
    decode_pairs    int64 [Pd, Cd, 0]    shape carrier: Pd (row, span of Cd blocks) pairs (engine/block_table.py)
    prefill_tokens  int64 [Bp, Sp]       prefill group: packed index of each new token, LEFT-padded
    prefill_mask    bool  [Bp, Sp]       True where prefill_tokens is a real token
    prefill_rows    int64 [Bp]
    prefill_context int64 [Bp]
    prefill_pairs   int64 [Pp, Cp, 0]
    token_order     int64 [T]            where token t sits in (decode rows, then prefill rows x Sp)
    block_table     int64 [R, W]         cache block of each row's i-th block of tokens (whole, read only)
    logit_tokens    int64 [R']           packed index of each token whose successor is wanted
    ban_rows        int64 [K]            rows (of R') whose end-of-sequence ids are banned (min_tokens)
    sample_rows     int64 [M]            rows (of R') that sample or want log-probabilities
    temperature     f32   [M]            0 = greedy
    top_k           int64 [M]            0 = off
    top_p           f32   [M]
    uniform         f32   [M]            in (0, 1], from the request's own generator
    min_p           f32   [M]            0 = off
    mask_rows       int64 [G]            rows (of R') constrained by a grammar
    token_mask      int32 [G, W']        their packed bitmasks of allowed tokens (32 * W' >= V)
    adjust_rows     int64 [E]            logit adjustments (logit_bias, penalties): row of each entry
    adjust_tokens   int64 [E]            token of each entry
    adjust_bias     f32   [E]            added
    adjust_scale    f32   [E]            repetition penalty (1 = none)
    adjust_shift    f32   [E]            subtracted (frequency * count + presence)
    key_cache       [L, H, N, S, D]      the engine's paged cache: N blocks of S tokens (read only), model dtype
    value_cache     [L, H, N, S, D]
    ->
    next_tokens     int64 [R']
    token_logprobs  f32   [M]            log-probability of each sampled row's token under the model
    top_ids         int64 [M, n]         the n most likely tokens of each sampled row
    top_logprobs    f32   [M, n]
    logits          f32   [R', V]        for verification; the engine never fetches them
    new_keys        [L, H, T, D]         keys of the new tokens (after rotary), packed like input_ids
    new_values      [L, H, T, D]

Why this shape:
- Linear layers (projections, MLP, head) run on the packed tokens: no compute is spent on padding.
- Attention costs what the contexts hold. Each group's past is read as pairs (a row, a span of
  C of its blocks): the pairs' blocks are gathered per layer and kv head in one Gather (whole
  blocks: [bs, D] rows, not token slots), every query of a row meets every span of that row in
  one batched matrix multiply, and the row's softmax is put together from its pairs with a
  scatter-max and scatter-sums (flash-decoding's split of the keys, in plain operators). Nothing
  is padded to the longest row: a row of 15k tokens among rows of 100 makes its own ~15k/(C bs)
  pairs, the others one or two each. The host picks C per step (engine/block_table.py).
- The new tokens' own keys are attended apart (a small [S, S] causal block per row) and joined in
  the same softmax: the cache is never copied to append them, and the engine writes them back
  after the step.
- Decode rows (one query each) and prefill rows (many) form two groups, so a decode row's span
  does not pay for a prefill row's queries. A small step (a few rows, drafts included) wastes
  almost nothing in one group, and on a CPU its time goes to the number of operators, not to
  arithmetic: a second graph, exported with `single_group`, has the prefill group only (every row
  in it; the decode inputs are accepted and ignored). The engine puts every row of a step of at
  most SMALL_STEP_TOKENS tokens in the prefill group (engine/batch.py), which both graphs compute
  alike, and the CPU runner sends those steps to this graph (engine/runner.py).
- Whatever is the same in every layer is computed once per step: the pairs, their blocks, the
  masks and the scatter indices; a layer adds its offset to the block indices.
- Keys are cached after the rotary embedding, as HF's cache does.
- q/k/v and gate/up are one projection each (`StepLayer`), and one rotation covers every head of
  the fused projection (the values' factors are cos 1, sin 0): five matrix multiplies per layer
  become two, and no outputs are concatenated.
- No tensor is created on a device named in the code: a trace records such a device as a
  constant, and `torch.jit.load(map_location=...)` moves only parameters and buffers. Fixed
  index tensors are buffers (they move with the weights); everything sized at run time is built
  from an input (`new_ones(...).cumsum`, `zeros_like`), so one TorchScript file exported on the
  CPU runs on any device, each Triton instance on its own GPU (tests/test_gpu_path.py proves it
  on the `meta` device).
"""

from __future__ import annotations

import copy
from typing import NamedTuple

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
        self.register_buffer("kv_head_index", torch.arange(self.num_kv_heads)[:, None, None], persistent=False)
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
        decode_rows: torch.Tensor,
        decode_context: torch.Tensor,
        decode_pairs: torch.Tensor,
        prefill_tokens: torch.Tensor,
        prefill_mask: torch.Tensor,
        prefill_rows: torch.Tensor,
        prefill_context: torch.Tensor,
        prefill_pairs: torch.Tensor,
        token_order: torch.Tensor,
        block_table: torch.Tensor,
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
        inputs = [(prefill_tokens, prefill_mask, prefill_rows, prefill_context, prefill_pairs)]
        if not self.single_group:
            decode_mask = torch.ones_like(decode_tokens, dtype=torch.bool)
            inputs.insert(0, (decode_tokens, decode_mask, decode_rows, decode_context, decode_pairs))
        groups = [self._group(*group, block_table, key_cache.shape) for group in inputs]
        spans = [group[4].shape[1] * key_cache.shape[3] for group in inputs]  # keys per pair
        # One flat Gather of whole blocks per layer and group: indexing key_cache[i] first would copy the layer.
        _, kv_heads, num_blocks, block_size, dim = key_cache.shape
        flat_keys = key_cache.reshape(-1, block_size, dim)
        flat_values = value_cache.reshape(-1, block_size, dim)
        layer_stride = kv_heads * num_blocks
        new_kv = []
        q_heads = self.num_heads
        for i, layer in enumerate(self.layers):
            x = _rms_norm(layer.input_layernorm, h)
            qkv = _rotate(layer.qkv(x).view(-1, q_heads + 2 * kv_heads, dim), cos, sin)  # [T, Hq + 2H, D]
            outs = []
            for group, span in zip(groups, spans):
                blocks = group.blocks + i * layer_stride if i else group.blocks
                past = [torch.index_select(flat, 0, blocks).view(kv_heads, -1, span, dim)
                        for flat in (flat_keys, flat_values)]  # [H, P, C * bs, D]
                q_g, k_g, v_g = _take(qkv, group.tokens).split((q_heads, kv_heads, kv_heads), dim=2)
                outs.append(self._attention(q_g, k_g, v_g, group, *past))
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

    def _group(self, tokens: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor, context: torch.Tensor,
               pairs: torch.Tensor, table: torch.Tensor, cache_shape) -> PagedGroup:
        """What every layer of one group reuses: its pairs (engine/block_table.py) and their blocks
        (layer 0's flat block indices, per kv head), the masks, and the scatter indices. The
        single-group graph takes one pair per row (see `_attention_rows`)."""
        _, kv_heads, num_blocks, block_size, _ = cache_shape
        span_blocks = pairs.shape[1]
        span = span_blocks * block_size
        group_size = self.num_heads // kv_heads
        first_columns = pairs.new_ones(span_blocks).cumsum(0) - 1  # [C]
        first_keys = pairs.new_ones(span).cumsum(0) - 1  # [C * bs]
        if self.single_group:  # pair b is row b's only span
            blocks = _take(table.reshape(-1), rows[:, None] * table.shape[1] + first_columns)
            past_bias = _bias(first_keys < context[:, None])[None, :, None, :]  # [1, B, 1, C * bs]
            joint = torch.cat((past_bias.expand(-1, -1, tokens.shape[1] * group_size, -1),
                               _attention_bias(mask, group_size)), dim=-1)  # [1, B, Q, C * bs + S]
            return PagedGroup(tokens, None, self._kv_blocks(blocks, num_blocks), joint)
        counts = ((context + (span - 1)) // span).clamp(min=1)  # pairs per row: at least one (masked if empty)
        ends = counts.cumsum(0)
        marks = pairs.new_zeros(pairs.shape[0] + 1).index_add(0, ends, torch.ones_like(ends))
        pair_row = marks.cumsum(0)[:-1]  # [P]: how many rows' pairs all come before it = its row
        span_index = torch.ones_like(pair_row).cumsum(0) - 1 - _take(ends - counts, pair_row)  # which span of its row
        columns = span_index[:, None] * span_blocks + first_columns  # [P, C]
        blocks = _take(table.reshape(-1), _take(rows, pair_row)[:, None] * table.shape[1] + columns)
        key_pos = span_index[:, None] * span + first_keys  # [P, C * bs]
        past_bias = _bias(key_pos < _take(context, pair_row)[:, None])[None, :, None, :]  # [1, P, 1, C * bs]
        scatter = pair_row[None, :, None, None].expand(kv_heads, -1, tokens.shape[1] * group_size, 1)
        row_of_pair = (torch.ones_like(rows).cumsum(0)[:, None] - 1 == pair_row[None, :]).float()[None]  # [1, B, P]
        return PagedGroup(tokens, pair_row, self._kv_blocks(blocks, num_blocks), past_bias,
                          _attention_bias(mask, group_size), scatter, row_of_pair)

    def _kv_blocks(self, blocks: torch.Tensor, num_blocks) -> torch.Tensor:
        """[H * P * C]: layer 0's flat block index of every pair's blocks, per kv head."""
        return (self.kv_head_index * num_blocks + blocks[None]).reshape(-1)

    def _attention(self, q, k, v, group: PagedGroup, past_k, past_v):
        """Grouped-query attention of one group; q [B, S, Hq, D] (already scaled), k/v [B, S, H, D],
        past [H, P, C * bs, D] (each pair's blocks). Returns [1, B * S, Hq * D] in the group's (row,
        position) order."""
        b, s = q.shape[:2]
        heads, group_size, dim = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        q = q.view(b, s, heads, group_size, dim).permute(2, 0, 1, 3, 4).reshape(heads, b, s * group_size, dim)
        k, v = k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)  # [H, B, S, D]
        attend = self._attention_rows if group.pair_row is None else self._attention_pairs
        out = attend(q, k, v, group, past_k, past_v).view(heads, b, s, group_size, dim)  # [H, B, Q, D]
        return out.permute(1, 2, 0, 3, 4).reshape(1, b * s, self.num_heads * dim)

    def _attention_rows(self, q, k, v, group: PagedGroup, past_k, past_v):
        """One pair per row (the single-group graph): one softmax over each row's span and its new
        tokens, with no scatter. A small step is a few rows of similar length, and on a CPU its
        time goes to the number of operators (engine/batch.py sends such steps here only when one
        span per row wastes little)."""
        span = past_k.shape[2]
        scores = torch.cat((torch.matmul(q, past_k.transpose(-1, -2)), torch.matmul(q, k.transpose(-1, -2))), dim=-1)
        probs = torch.softmax(scores.float() + group.past_bias, dim=-1).to(v.dtype)  # [H, B, Q, C * bs + S]
        on_past, on_new = probs.split((span, probs.shape[3] - span), dim=-1)
        return torch.matmul(on_past, past_v) + torch.matmul(on_new, v)

    def _attention_pairs(self, q, k, v, group: PagedGroup, past_k, past_v):
        """Attention over pairs; q [H, B, Q, D] (Q = S x G queries per row and kv head), k/v [H, B, S, D].

        Every query of a row meets each of the row's pairs in one matrix multiply; the row's
        softmax is assembled in float32 from the pairs' maxima and sums: a scatter-max over the
        pairs' maxima, then the pairs' sums of exponentials and their products with the values
        summed per row by one matrix multiply with the [rows, pairs] membership matrix (ONNX
        Runtime's ScatterElements is a serial loop, ~8 ns an element; the multiply, rows x pairs
        x Q x D, costs less than the attention it sums), the new tokens' own scores and products
        joining them.
        """
        queries = torch.index_select(q, 1, group.pair_row)  # [H, P, Q, D]
        past_scores = torch.matmul(queries, past_k.transpose(-1, -2)).float() + group.past_bias  # [H, P, Q, C*bs]
        new_scores = torch.matmul(q, k.transpose(-1, -2)).float() + group.new_bias  # [H, B, Q, S]
        top = new_scores.amax(-1, keepdim=True).scatter_reduce(  # [H, B, Q, 1]: each query's max
            1, group.scatter, past_scores.amax(-1, keepdim=True), reduce="amax", include_self=True)
        past_probs = torch.exp(past_scores - torch.index_select(top, 1, group.pair_row))
        new_probs = torch.exp(new_scores - top)
        heads, rows, count, dim = q.shape
        sums = past_probs.sum(-1, keepdim=True)
        if v.dtype == torch.float32:
            weighted = torch.matmul(past_probs, past_v)
        else:  # a pair's weights sum to up to C * bs: normalised first, or its weighted values overflow 16 bits
            # (a row without a past has one pair of masked keys, whose weights sum to 0)
            weighted = torch.matmul((past_probs / sums.clamp(min=1e-30)).to(v.dtype), past_v).float() * sums
        per_pair = torch.cat((weighted, sums), dim=-1)  # [H, P, Q, D + 1]
        per_row = torch.matmul(group.row_of_pair, per_pair.view(heads, per_pair.shape[1], count * (dim + 1)))
        per_row = per_row.view(heads, rows, count, dim + 1)  # [H, B, Q, D + 1]
        out = torch.matmul(new_probs.to(v.dtype), v).float() + per_row[..., :dim]
        return (out / (new_probs.sum(-1, keepdim=True) + per_row[..., dim:])).to(v.dtype)


class PagedGroup(NamedTuple):
    """One attention group's per-step tensors (see `DecoderStep._group`); Q = S x G queries per
    row and kv head. One pair per row (the single-group graph): no pair_row and no scatters, and
    past_bias covers the row's span and its new tokens, [1, B, Q, C * bs + S]."""

    tokens: torch.Tensor  # [B, S] packed index of each query position
    pair_row: torch.Tensor | None  # [P] the group row of each pair
    blocks: torch.Tensor  # [H * P * C] layer 0's flat block index of each pair's blocks, per kv head
    past_bias: torch.Tensor  # [1, P, 1, C * bs] float32: 0 on a past key, a large negative past the row's past
    new_bias: torch.Tensor | None = None  # [1, B, Q, S] float32: causal among the new tokens, padding masked
    scatter: torch.Tensor | None = None  # [H, P, Q, 1] pair_row, expanded for the scatter-max
    row_of_pair: torch.Tensor | None = None  # [1, B, P] float32: 1 where pair p is row b's


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


def _attention_bias(mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """Additive float32 bias [1, B, S x G, S] among a group's new tokens (left-padded): a query sees
    the real new tokens up to itself, for each of its G query heads. Positions are a cumulative sum
    over the mask's own shape (an arange would carry the tracing device)."""
    pos = torch.ones_like(mask, dtype=torch.int64).cumsum(1)  # [B, S]: 1, 2, ...
    allowed = (pos[:, None, :] <= pos[:, :, None]) & mask[:, None, :]  # [B, S, S]
    return _bias(allowed)[None, :, :, None, :].expand(-1, -1, -1, group_size, -1).flatten(2, 3)


def _bias(allowed: torch.Tensor) -> torch.Tensor:
    """0 where allowed, a large finite negative elsewhere (not -inf: a query with no allowed key
    stays finite instead of NaN)."""
    return torch.zeros_like(allowed, dtype=torch.float32).masked_fill(~allowed, torch.finfo(torch.float32).min)


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
