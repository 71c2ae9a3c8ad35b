"""The decoder step we export: our own functional forward over a Hugging Face model's weights.

One graph serves a whole engine iteration: rows that decode one token and rows that prefill
(a whole prompt, or a chunk of one) run together. The engine keeps its own paged KV cache and
block table; it passes both whole (read-only) plus, per row, its table row and its past length,
and feeds only the tokens that are new. The step returns the next token of every row that asks
for one (sampled inside the graph, see export/sampler.py) and the keys/values of the new tokens,
which the engine writes back.

Its inputs and outputs (names, dtypes, shapes, meanings) are export/contract.py's `INPUTS` and
`OUTPUTS`; `forward` takes them positionally in that order, as the exporters trace it, and reads
them by name.

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
  most SMALL_STEP_TOKENS tokens, or of one row (nothing to pad), in the prefill group
  (engine/batch.py), which both graphs compute alike, and the CPU runner sends those steps to
  this graph (engine/runner.py).
- Whatever is the same in every layer is computed once per step: the pairs, their blocks, the
  masks and the scatter indices; a layer adds its offset to the block indices.
- Families differ as data (export/family.py): where each sublayer's norms sit, q/k norms, each
  layer's sliding window (its own masks, built once per step per window) and rotary table (or
  none), soft-caps, multipliers, attention sinks; mixtures of experts run export/mixture.py.
- Keys are cached after the rotary embedding, as HF's cache does.
- q/k/v and gate/up are one projection each (`StepLayer`), and one rotation covers every head of
  the fused projection (the values' factors are cos 1, sin 0): five matrix multiplies per layer
  become two, and no outputs are concatenated.
- LoRA adapters of many fine-tunes share the step (export/adapters.py, exported with
  `adapters`): the tokens of rows with an adapter are gathered a group per adapter, multiplied by
  their own adapter's A and B in one batched product and added back. Rows without an adapter
  cost nothing, and a step with none skips the products.
- No tensor is created on a device named in the code: a trace records such a device as a
  constant, and `torch.jit.load(map_location=...)` moves only parameters and buffers. Fixed
  index tensors are buffers (they move with the weights); everything sized at run time is built
  from an input (`new_ones(...).cumsum`, `zeros_like`), so one TorchScript file exported on the
  CPU runs on any device, each Triton instance on its own GPU (tests/test_gpu_path.py proves it
  on the `meta` device).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from batchstring.export.adapters import AdapterRows
from batchstring.export.contract import ADAPTER_SITES, StepArguments
from batchstring.export.family import Family, UnsupportedModel, family_of, layer_plans, long_rope, rotary_tables
from batchstring.export.mixture import Mixture
from batchstring.export.sampler import SamplingHead

__all__ = ["DecoderStep", "UnsupportedModel", "check_supported"]


def check_supported(config) -> None:
    """Refuses, with the reason, checkpoints whose forward this step would not reproduce."""
    family_of(config)


class DecoderStep(nn.Module):
    """One engine iteration over the modules of a `*ForCausalLM` (see module docstring).

    `vocab_size` may be smaller than the checkpoint's: ids past the tokenizer's last one (padded
    vocabularies) are cut off the logits and `never_ids` (holes in the tokenizer's ids) are masked,
    so a token the tokenizer cannot turn into text is never sampled.
    """

    def __init__(self, hf_model, eos_ids: list[int] = (), vocab_size: int | None = None,
                 never_ids: list[int] = (), single_group: bool = False, adapters: bool = False) -> None:
        super().__init__()
        self.single_group = single_group
        self.adapters = adapters  # LoRA adapters applied (export/adapters.py); else their inputs go unread
        cfg = hf_model.config
        family = family_of(cfg)
        inner = hf_model.model
        attn = inner.layers[0].self_attn
        self.embed = inner.embed_tokens
        self.layers = nn.ModuleList(StepLayer(layer, family) for layer in inner.layers)
        self.plans = layer_plans(hf_model)
        self.windows = sorted({plan.window for plan in self.plans if plan.window})
        self.norm = inner.norm
        self.lm_head = hf_model.lm_head
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = attn.head_dim
        # Scalars of the family's forward (1 / None: the step leaves the operator out).
        self.embedding_multiplier = float(getattr(cfg, "embedding_multiplier", 1.0))
        self.residual_multiplier = float(getattr(cfg, "residual_multiplier", 1.0))
        self.logits_scaling = float(getattr(cfg, "logits_scaling", 1.0))
        self.attn_softcap = getattr(cfg, "attn_logit_softcapping", None)
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)
        tables = rotary_tables(inner.rotary_emb)
        self.rope_scale = {name: float(scale) for name, (_, scale) in tables.items()}
        self.rotary_dim = 2 * next(iter(tables.values()))[0].numel()  # < head_dim: partial rotary (Phi-3)
        for name, (inv_freq, _) in tables.items():
            self.register_buffer(f"inv_freq_{name}", inv_freq.detach().clone().float(), persistent=False)
        long = long_rope(cfg)
        self.long_from = None if long is None else long[1]
        self.register_buffer("inv_freq_long", None if long is None else long[0].detach().clone().float(),
                             persistent=False)
        self.register_buffer("kv_head_index", torch.arange(self.num_kv_heads)[:, None, None], persistent=False)
        # The rotary factors cover every head of the fused projection: the queries' carry the attention
        # scale (one multiply per step, not per layer), the values' are cos 1, sin 0 (left as they are).
        # In the model's dtype, as the weights: the export's dtype check reads every constant.
        heads = (self.num_heads, self.num_kv_heads, self.num_kv_heads)
        head_scale = torch.tensor([attn.scaling] * heads[0] + [1.0] * heads[1] + [0.0] * heads[2])
        value_heads = torch.tensor([0.0] * (heads[0] + heads[1]) + [1.0] * heads[2])
        self.register_buffer("head_scale", head_scale[None, :, None].to(self.dtype), persistent=False)
        self.register_buffer("value_heads", value_heads[None, :, None].to(self.dtype), persistent=False)
        self.vocab_size = min(vocab_size or self.lm_head.out_features, self.lm_head.out_features)
        self.sampler = SamplingHead(self.vocab_size, list(eos_ids), list(never_ids),
                                    branches=all(layer.mixture is None for layer in self.layers))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def as_single_group(self) -> DecoderStep:
        """This step with the prefill group only (see the module docstring), its modules shared."""
        twin = copy.copy(self)
        twin.single_group = True
        return twin

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`inputs` in export/contract.py's order (INPUTS); returns its OUTPUTS."""
        x = StepArguments(*inputs)
        # Activations keep a leading axis of 1 ([1, T, d]): ONNX Runtime runs 3-D linear layers as
        # MatMul with prepacked weights, measurably faster at small T than the Gemm a 2-D input gets.
        h = self.embed(x.input_ids[None])
        if self.embedding_multiplier != 1.0:
            h = h * self.embedding_multiplier
        ends = None if self.long_from is None else _row_ends(x.position_ids, x.prefill_tokens, x.prefill_mask)
        rotations = self._rotary(x.position_ids, ends)
        attention = [(x.prefill_tokens, x.prefill_mask, x.prefill_rows, x.prefill_context, x.prefill_pairs)]
        if not self.single_group:
            decode_mask = torch.ones_like(x.decode_tokens, dtype=torch.bool)
            attention.insert(0, (x.decode_tokens, decode_mask, x.decode_rows, x.decode_context, x.decode_pairs))
        groups = [self._group(*group, x.block_table, x.key_cache.shape, x.position_ids) for group in attention]
        spans = [group[4].shape[1] * x.key_cache.shape[3] for group in attention]  # keys per split-K partition
        # One flat Gather of whole blocks per layer and group: indexing key_cache[i] first would copy the layer.
        _, kv_heads, num_blocks, block_size, dim = x.key_cache.shape
        flat_keys = x.key_cache.reshape(-1, block_size, dim)
        flat_values = x.value_cache.reshape(-1, block_size, dim)
        layer_stride = kv_heads * num_blocks
        new_kv = []
        q_heads = self.num_heads
        adapters = self.adapters and AdapterRows.of(x.adapter_tokens, x.adapter_mask, x.adapter_index, {
            site: (getattr(x, f"{site}_lora_a"), getattr(x, f"{site}_lora_b")) for site in self.adapter_sites()},
            self.dtype, self.sampler.branches)
        for i, (layer, plan) in enumerate(zip(self.layers, self.plans)):
            adapt = adapters.of_layer(i) if adapters else _unadapted
            qkv = layer.project(_norm(layer.attn_norm, h), q_heads, kv_heads, dim, adapt)  # [T, Hq + 2H, D]
            if plan.rope is None:  # NoPE: only the queries' attention scale
                qkv = qkv * (self.head_scale + self.value_heads)
            else:
                qkv = _rotate(qkv, *rotations[plan.rope], self.rotary_dim)
            outs = []
            for windows, span in zip(groups, spans):
                group = windows[plan.window]
                blocks = group.blocks + i * layer_stride if i else group.blocks
                past = [torch.index_select(flat, 0, blocks).view(kv_heads, -1, span, dim)
                        for flat in (flat_keys, flat_values)]  # [H, P, C * bs, D]
                q_g, k_g, v_g = _take(qkv, group.tokens).split((q_heads, kv_heads, kv_heads), dim=2)
                outs.append(self._attention(q_g, k_g, v_g, group, *past, layer.sinks))
            joined = torch.index_select(torch.cat(outs, 1), 1, x.token_order)
            attended = adapt("o", joined, layer.o_proj(joined))
            h = h + self._residual(_norm(layer.attn_post_norm, attended))
            mlp = layer.mlp(_norm(layer.mlp_norm, h), adapt)
            h = h + self._residual(_norm(layer.mlp_post_norm, mlp))
            new_kv.append(qkv[:, q_heads:])  # [T, 2H, D]
        last = _take(h[0], x.logit_tokens)[None]
        logits = self.lm_head(_norm(self.norm, last))[0].float()
        if self.vocab_size < logits.shape[1]:
            logits = logits[:, : self.vocab_size]
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        if self.final_softcap:
            logits = _softcap(logits, self.final_softcap)
        sampled = self.sampler(logits, x.ban_rows, x.sample_rows, x.temperature, x.top_k, x.top_p, x.uniform,
                               x.min_p, x.mask_rows, x.token_mask, x.adjust_rows, x.adjust_tokens, x.adjust_bias,
                               x.adjust_scale, x.adjust_shift)
        new_keys, new_values = torch.stack(new_kv).transpose(1, 2).split(kv_heads, dim=1)  # [L, H, T, D] each
        return (*sampled, logits, new_keys, new_values)

    def adapter_sites(self) -> dict[str, tuple[int, int]]:
        """The projections an adapter may change, with their (in, out) features: every site but a
        mixture's MLP (its experts are not adapted)."""
        layer = self.layers[0]
        linears = {"qkv": layer.qkv, "o": layer.o_proj}
        if layer.mixture is None:
            linears |= {"gate_up": layer.gate_up, "down": layer.down_proj}
        return {site: (linears[site].in_features, linears[site].out_features)
                for site in ADAPTER_SITES if site in linears}

    def _residual(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.residual_multiplier if self.residual_multiplier != 1.0 else x

    def _rotary(self, position_ids: torch.Tensor,
                ends: torch.Tensor | None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per rotary table, cos and sin [T, Hq + 2H, D] for every head of the fused projection: the
        queries' scaled by the attention scale (rotation is linear: scaling the rotated query scales
        its scores), the values' cos 1 and sin 0, so one rotation per layer leaves them exactly as
        they were. Past a partial rotary's dims, cos 1 and sin 0: those dims pass unrotated. With
        LongRoPE, a token whose row reaches `long_from` (`ends`) takes the long factors."""
        positions = position_ids[:, None].float()
        tables = {}
        for name, scale in self.rope_scale.items():
            inv_freq = getattr(self, f"inv_freq_{name}")
            if ends is not None:
                inv_freq = torch.where((ends >= self.long_from)[:, None], self.inv_freq_long, inv_freq)
            freqs = positions * inv_freq  # [T, R/2]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
            if scale != 1.0:
                cos, sin = cos * scale, sin * scale
            if self.rotary_dim < self.head_dim:
                passed = torch.zeros_like(freqs[:, :1]).expand(-1, self.head_dim - self.rotary_dim)
                cos, sin = torch.cat((cos, passed + 1), dim=-1), torch.cat((sin, passed), dim=-1)
            cos, sin = (t[:, None, :].to(self.dtype) for t in (cos, sin))  # [T, 1, D]
            tables[name] = (cos * self.head_scale + self.value_heads, sin * self.head_scale)
        return tables

    def _group(self, tokens: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor, context: torch.Tensor,
               pairs: torch.Tensor, table: torch.Tensor, cache_shape,
               position_ids: torch.Tensor) -> dict[int | None, PagedGroup]:
        """What every layer of one group reuses: its pairs (engine/block_table.py) and their blocks
        (layer 0's flat block indices, per kv head), the masks, and the scatter indices; one
        variant per sliding window the layers use (None: no window), differing only in their
        masks. The single-group graph takes one pair per row (see `_attention_rows`)."""
        _, kv_heads, num_blocks, block_size, _ = cache_shape
        span_blocks = pairs.shape[1]
        span = span_blocks * block_size
        group_size = self.num_heads // kv_heads
        first_columns = pairs.new_ones(span_blocks).cumsum(0) - 1  # [C]
        first_keys = pairs.new_ones(span).cumsum(0) - 1  # [C * bs]
        queries = _take(position_ids, tokens) if self.windows else None  # [B, S]: each query's position
        if self.single_group:  # pair b is row b's only span
            blocks = self._kv_blocks(_take(table.reshape(-1), rows[:, None] * table.shape[1] + first_columns),
                                     num_blocks)
            past = first_keys < context[:, None]  # [B, C * bs]
            variants = {}
            for window in [None, *self.windows]:
                if window is None:
                    past_bias = _bias(past)[None, :, None, :].expand(-1, -1, tokens.shape[1] * group_size, -1)
                else:
                    past_bias = _bias(_per_query(past[:, None, :] & (queries[:, :, None] - first_keys < window),
                                                 group_size))
                joint = torch.cat((past_bias, _attention_bias(mask, group_size, window)), dim=-1)  # [1, B, Q, C*bs+S]
                variants[window] = PagedGroup(tokens, None, blocks, joint)
            return variants
        counts = ((context + (span - 1)) // span).clamp(min=1)  # pairs per row: at least one (masked if empty)
        ends = counts.cumsum(0)
        marks = pairs.new_zeros(pairs.shape[0] + 1).index_add(0, ends, torch.ones_like(ends))
        pair_row = marks.cumsum(0)[:-1]  # [P]: how many rows' pairs all come before it = its row
        span_index = torch.ones_like(pair_row).cumsum(0) - 1 - _take(ends - counts, pair_row)  # which span of its row
        columns = span_index[:, None] * span_blocks + first_columns  # [P, C]
        blocks = self._kv_blocks(_take(table.reshape(-1), _take(rows, pair_row)[:, None] * table.shape[1] + columns),
                                 num_blocks)
        key_pos = span_index[:, None] * span + first_keys  # [P, C * bs]
        past = (key_pos < _take(context, pair_row)[:, None])[:, None, :]  # [P, 1, C * bs]
        scatter = pair_row[None, :, None, None].expand(kv_heads, -1, tokens.shape[1] * group_size, 1)
        row_of_pair = (torch.ones_like(rows).cumsum(0)[:, None] - 1 == pair_row[None, :]).float()[None]  # [1, B, P]
        variants = {}
        for window in [None, *self.windows]:
            if window is None:  # [1, P, 1, C * bs]: the same for every query
                past_bias = _bias(past)[None]
            else:  # [1, P, Q, C * bs]
                near = _take(queries, pair_row)[:, :, None] - key_pos[:, None, :] < window
                past_bias = _bias(_per_query(past & near, group_size))
            variants[window] = PagedGroup(tokens, pair_row, blocks, past_bias,
                                          _attention_bias(mask, group_size, window), scatter, row_of_pair)
        return variants

    def _capped(self, scores: torch.Tensor) -> torch.Tensor:
        """Attention logit soft-capping (Gemma 2), on the scaled scores as HF applies it."""
        return _softcap(scores, self.attn_softcap) if self.attn_softcap else scores

    def _kv_blocks(self, blocks: torch.Tensor, num_blocks) -> torch.Tensor:
        """[H * P * C]: layer 0's flat block index of every pair's blocks, per kv head."""
        return (self.kv_head_index * num_blocks + blocks[None]).reshape(-1)

    def _attention(self, q, k, v, group: PagedGroup, past_k, past_v, sinks: torch.Tensor | None):
        """Grouped-query attention of one group; q [B, S, Hq, D] (already scaled), k/v [B, S, H, D],
        past [H, P, C * bs, D] (each pair's blocks). Returns [1, B * S, Hq * D] in the group's (row,
        position) order. `sinks` [Hq] (gpt-oss): a logit per query head that joins every softmax's
        denominator, as one more key whose value is zero."""
        b, s = q.shape[:2]
        heads, group_size, dim = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        q = q.view(b, s, heads, group_size, dim).permute(2, 0, 1, 3, 4).reshape(heads, b, s * group_size, dim)
        k, v = k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)  # [H, B, S, D]
        sink = None if sinks is None else (
            sinks.float().view(heads, 1, 1, group_size).expand(-1, -1, s, -1).reshape(heads, 1, s * group_size, 1))
        attend = self._attention_rows if group.pair_row is None else self._attention_pairs
        out = attend(q, k, v, group, past_k, past_v, sink).view(heads, b, s, group_size, dim)  # [H, B, Q, D]
        return out.permute(1, 2, 0, 3, 4).reshape(1, b * s, self.num_heads * dim)

    def _attention_rows(self, q, k, v, group: PagedGroup, past_k, past_v, sink):
        """One pair per row (the single-group graph): one softmax over each row's span and its new
        tokens, with no scatter. A small step is a few rows of similar length, and on a CPU its
        time goes to the number of operators (engine/batch.py sends such steps here only when one
        span per row wastes little)."""
        span = past_k.shape[2]
        scores = torch.cat((torch.matmul(q, past_k.transpose(-1, -2)), torch.matmul(q, k.transpose(-1, -2))), dim=-1)
        scores = self._capped(scores.float()) + group.past_bias
        if sink is not None:
            scores = torch.cat((scores, sink.expand(-1, scores.shape[1], -1, -1)), dim=-1)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)  # [H, B, Q, C * bs + S (+ 1)]
        on_past, on_new = probs.split((span, probs.shape[3] - span), dim=-1)
        if sink is not None:
            v = torch.cat((v, torch.zeros_like(v[:, :, :1])), dim=2)
        return torch.matmul(on_past, past_v) + torch.matmul(on_new, v)

    def _attention_pairs(self, q, k, v, group: PagedGroup, past_k, past_v, sink):
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
        past_scores = self._capped(torch.matmul(queries, past_k.transpose(-1, -2)).float())
        past_scores = past_scores + group.past_bias  # [H, P, Q, C * bs]
        new_scores = self._capped(torch.matmul(q, k.transpose(-1, -2)).float()) + group.new_bias  # [H, B, Q, S]
        if sink is not None:
            new_scores = torch.cat((new_scores, sink.expand(-1, new_scores.shape[1], -1, -1)), dim=-1)
            v = torch.cat((v, torch.zeros_like(v[:, :, :1])), dim=2)
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


Adapt = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]  # (site, its input, its output) -> output


def _unadapted(site: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return y


class StepLayer(nn.Module):
    """One decoder layer's weights as the step runs them: q, k and v as one projection, gate and
    up as another (two matrix multiplies where the checkpoint has five, and no concatenation of
    their outputs). Only the fused copies are held, so neither export file stores a layer's
    projection twice. Checkpoints that fuse them already (Phi-3) are taken as they are; an MLP
    without a gate (StarCoder2) runs as one. Norms sit where the family puts them (export/family.py)."""

    def __init__(self, layer: nn.Module, family: Family) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        (self.attn_norm, self.attn_post_norm), (self.mlp_norm, self.mlp_post_norm) = (
            (getattr(layer, n) if n else None for n in pair) for pair in family.norms)
        self.qk_norm = family.qk_norm
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.qkv = getattr(attn, "qkv_proj", None) or _fused_linear(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o_proj = attn.o_proj
        self.sinks = getattr(attn, "sinks", None)
        self.mixture = Mixture(mlp, family.experts) if hasattr(mlp, "experts") else None  # export/mixture.py
        self.gated = not hasattr(mlp, "c_fc")
        if not self.gated:  # down(act(up(x)))
            self.gate_up, self.down_proj, self.act_fn = mlp.c_fc, mlp.c_proj, mlp.act
        elif self.mixture is None:
            self.gate_up = getattr(mlp, "gate_up_proj", None) or _fused_linear(mlp.gate_proj, mlp.up_proj)
            self.down_proj = mlp.down_proj
            self.act_fn = getattr(mlp, "act_fn", None) or mlp.activation_fn

    def project(self, x: torch.Tensor, q_heads: int, kv_heads: int, dim: int, adapt: Adapt) -> torch.Tensor:
        """Queries, keys and values [T, Hq + 2H, D], the queries and keys normalised where the
        family does (before the rotary embedding, as HF does)."""
        qkv = adapt("qkv", x, self.qkv(x))
        if self.qk_norm == "all":  # over every head's dims at once
            q, k, v = qkv.split((q_heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
            qkv = torch.cat((_norm(self.q_norm, q), _norm(self.k_norm, k), v), dim=-1)
        qkv = qkv.view(-1, q_heads + 2 * kv_heads, dim)
        if self.qk_norm == "head":
            q, k, v = qkv.split((q_heads, kv_heads, kv_heads), dim=1)
            qkv = torch.cat((_norm(self.q_norm, q), _norm(self.k_norm, k), v), dim=1)
        return qkv

    def mlp(self, x: torch.Tensor, adapt: Adapt) -> torch.Tensor:
        if self.mixture is not None:
            return self.mixture(x)
        gate_up = adapt("gate_up", x, self.gate_up(x))
        if not self.gated:
            hidden = self.act_fn(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = self.act_fn(gate) * up
        return adapt("down", hidden, self.down_proj(hidden))


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


def _attention_bias(mask: torch.Tensor, group_size: int, window: int | None = None) -> torch.Tensor:
    """Additive float32 bias [1, B, S x G, S] among a group's new tokens (left-padded): a query sees
    the real new tokens up to itself (and fewer than `window` back), for each of its G query heads.
    Positions are a cumulative sum over the mask's own shape (an arange would carry the tracing
    device); a row's new tokens are consecutive, so their differences are the positions'."""
    pos = torch.ones_like(mask, dtype=torch.int64).cumsum(1)  # [B, S]: 1, 2, ...
    allowed = (pos[:, None, :] <= pos[:, :, None]) & mask[:, None, :]  # [B, S, S]
    if window is not None:
        allowed = allowed & (pos[:, :, None] - pos[:, None, :] < window)
    return _bias(allowed)[None, :, :, None, :].expand(-1, -1, -1, group_size, -1).flatten(2, 3)


def _row_ends(position_ids: torch.Tensor, prefill_tokens: torch.Tensor, prefill_mask: torch.Tensor) -> torch.Tensor:
    """[T]: the last position of each token's row in this step. A decode row's one token is its own
    last; a prefill row's last token is in its group's last column (rows are left-padded), and
    its padding writes to a spare slot past the end."""
    count = position_ids.shape[0]
    last = _take(position_ids, prefill_tokens[:, -1])  # [Bp]
    slots = torch.where(prefill_mask, prefill_tokens, count).reshape(-1)
    spread = last[:, None].expand_as(prefill_tokens).reshape(-1)
    return torch.cat((position_ids, position_ids[:1])).index_put((slots,), spread)[:count]


def _per_query(allowed: torch.Tensor, group_size: int) -> torch.Tensor:
    """[1, N, S x G, K] for a mask [N, S, K] of each query position: each of a position's G query
    heads sees what the position sees."""
    return allowed[:, :, None, :].expand(-1, -1, group_size, -1).flatten(1, 2)[None]


def _bias(allowed: torch.Tensor) -> torch.Tensor:
    """0 where allowed, a large finite negative elsewhere (not -inf: a query with no allowed key
    stays finite instead of NaN)."""
    return torch.zeros_like(allowed, dtype=torch.float32).masked_fill(~allowed, torch.finfo(torch.float32).min)


def _norm(norm: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
    """A layer's norm (None: none there). Llama-style RMSNorms (those with `variance_epsilon`)
    are written out so that ONNX Runtime fuses them; any other (Gemma's 1 + weight, LayerNorm
    with biases) runs as the checkpoint's own module."""
    if norm is None:
        return x
    if not hasattr(norm, "variance_epsilon"):
        return norm(x)
    xf = x.float()  # float32 statistics, weight applied in the model's dtype; a division, as ORT fuses it
    normed = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * normed.to(x.dtype)


def _softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] along the first axis, for an index of any shape: one flat Gather in ONNX
    (advanced indexing exports as GatherND plus reshapes, measurably slower)."""
    return torch.index_select(x, 0, index.reshape(-1)).view(*index.shape, *x.shape[1:])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """HF's rotate-half rotation over the first `rotary_dim` dims (the rest pass: their sin is 0)."""
    half, dim = rotary_dim // 2, x.shape[-1]
    parts = [-x[..., half:rotary_dim], x[..., :half]] + ([x[..., rotary_dim:]] if rotary_dim < dim else [])
    return x * cos + torch.cat(parts, dim=-1) * sin
