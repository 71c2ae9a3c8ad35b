"""A mixture-of-experts MLP as the step runs it: each expert computes only the tokens routed to it.

Qwen3-MoE, Mixtral and gpt-oss route the same way: the top k experts per token by the router's
logits, weighted by the softmax of those k (Mixtral and gpt-oss; Qwen3-MoE with `norm_topk_prob`)
or by the whole softmax's values (Qwen3-MoE without). Each expert is a gated MLP; gpt-oss's has
biases and a clamped GLU.

Why this shape: compute and weight reads follow the experts each token uses. Per expert, the
tokens routed to it are found in the graph (a NonZero, so its size is the step's own), gathered,
run through that expert's two projections and added back with their routing weight. An expert no
token chose runs on zero rows and reads no weights. Every expert computing every token would
cost E / k times the active parameters (4x for 8 experts and top-2); gathering each token's
experts' weights would read them once per token instead of once per step. The experts' weights
are held one matrix per expert (the checkpoint stores them as one 3-D tensor), so each runtime
multiplies by a constant it can prepack, and neither export file stores them twice.
"""

from __future__ import annotations

import torch
from torch import nn


class Mixture(nn.Module):
    """A sparse MoE block: the router (`mlp.gate`, or gpt-oss's `mlp.router`, which has a bias)
    and the experts' 3-D weights, stored as `layout` says (export/family.py)."""

    def __init__(self, moe: nn.Module, layout: str) -> None:
        super().__init__()
        router, experts = getattr(moe, "gate", None) or moe.router, moe.experts
        self.top_k = int(router.top_k)
        self.renormalise = bool(getattr(router, "norm_topk_prob", True))
        bias = getattr(router, "bias", None)
        self.router = nn.Linear(router.weight.shape[1], router.weight.shape[0], bias=bias is not None,
                                dtype=router.weight.dtype)
        self.router.weight, self.router.bias = router.weight, bias
        if layout == "interleaved":  # [E, d, 2f], x @ W + b; gate and up alternate along 2f
            gate_up = [torch.cat((w[:, ::2], w[:, 1::2]), dim=1).T for w in experts.gate_up_proj.detach()]
            gate_up_bias = [torch.cat((b[::2], b[1::2])) for b in experts.gate_up_proj_bias.detach()]
            down, down_bias = [w.T for w in experts.down_proj.detach()], list(experts.down_proj_bias.detach())
            self.limit, self.alpha = float(experts.limit), float(experts.alpha)
        else:  # [E, 2f, d], linear(x, W): gate, then up
            gate_up, down = list(experts.gate_up_proj.detach()), list(experts.down_proj.detach())
            gate_up_bias = down_bias = [None] * len(gate_up)
            self.limit, self.act_fn = None, experts.act_fn
        self.gate_up = nn.ModuleList(_linear(w, b) for w, b in zip(gate_up, gate_up_bias))
        self.down = nn.ModuleList(_linear(w, b) for w, b in zip(down, down_bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x[0]  # [T, d]
        logits = self.router(flat).float()
        top, chosen = torch.topk(logits, self.top_k, dim=-1)  # [T, k]
        # the softmax of the top k = the whole softmax's top k renormalised (Mixtral, gpt-oss, Qwen3-MoE's
        # norm_topk_prob); without renormalising, the whole softmax's own values
        if self.renormalise:
            weights = torch.softmax(top, dim=-1)
        else:
            weights = torch.exp(top - logits.logsumexp(-1, keepdim=True))
        weights = weights.to(flat.dtype)
        out = torch.zeros_like(flat)
        for expert, (gate_up, down) in enumerate(zip(self.gate_up, self.down)):
            picked = chosen == expert  # [T, k]: at most one True per token
            tokens = torch.nonzero(picked.sum(-1) > 0)[:, 0]  # the tokens routed here, however many
            weight = torch.index_select((weights * picked).sum(-1), 0, tokens)
            gate, up = gate_up(torch.index_select(flat, 0, tokens)).chunk(2, dim=-1)
            out = out.index_add(0, tokens, down(self._glu(gate, up)) * weight[:, None])
        return out[None]

    def _glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.limit is None:
            return self.act_fn(gate) * up
        gate = gate.clamp(max=self.limit)  # gpt-oss: clamped, and up shifted by one
        return (up.clamp(min=-self.limit, max=self.limit) + 1) * gate * torch.sigmoid(gate * self.alpha)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """One expert's [out, in] matrix (and bias) as a Linear of its own."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear.requires_grad_(False)
