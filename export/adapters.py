"""LoRA adapters inside the exported step: many fine-tunes of one base model in one batch.

The step takes the resident adapters' low-rank matrices as inputs (export/contract.py), stacked
per site (a projection of the step: q/k/v, o, gate/up, down) as A [layers, slots, in, rank] and
B [layers, slots, rank, out], B already scaled. Loading an adapter writes its slot of these
inputs (engine/adapters.py); the graph is never exported again.

The engine groups the step's adapted tokens by adapter, one row of `adapter_tokens` per adapter
in the step, padded to the largest group (engine/batch.py). Per site and layer, each group's
tokens are gathered and multiplied by its own adapter's A and B in one batched product (the
segmented product of punica and S-LoRA, in stock operators), masked where padded, and added to
the projection's output at those tokens. A token costs its adapter's rank, not every resident
adapter's; rows without an adapter cost nothing, and a step without adapted tokens skips the
products (exported: one `If` per site and layer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


class AdapterRows(NamedTuple):
    """One step's adapter inputs, as the step reads them."""

    tokens: torch.Tensor  # [groups, width] packed index of each adapted token, a group per adapter (padding 0)
    mask: torch.Tensor  # [groups, width, 1] 1 for a token, 0 for padding, in the model's dtype
    index: torch.Tensor  # [groups] each group's adapter slot
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # site -> (A, B) stacked over layers and slots
    branches: bool = True  # exported: a step without adapted tokens skips the products (an `If`)

    @classmethod
    def of(cls, tokens: torch.Tensor, mask: torch.Tensor, index: torch.Tensor,
           weights: dict[str, tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype,
           branches: bool = True) -> AdapterRows:
        return cls(tokens, mask.to(dtype)[:, :, None], index, weights, branches)

    def of_layer(self, layer: int) -> Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]:
        """(site, the projection's input [1, T, in], its output [1, T, out]) -> the output with
        each adapted token's delta added. Exported, a step without adapted tokens runs none of it
        (`torch.cond`, an ONNX `If`): the operators per site and layer that the base model's steps
        would otherwise pay. A TorchScript trace records no control flow and keeps them (empty
        products); so does the export of a mixture (see export/sampler.py `branches`)."""
        def adapt(site: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            if site not in self.weights:
                return y
            a, b = (w[layer] for w in self.weights[site])  # [slots, in, rank], [slots, rank, out]
            operands = (x, y, self.tokens, self.mask, self.index, a, b)
            if self.branches and torch.compiler.is_exporting():
                return torch.cond(self.tokens.shape[0] == 0, _unchanged, _added, operands)
            return _added(*operands)
        return adapt


def _added(x: torch.Tensor, y: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, index: torch.Tensor,
           a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    groups, width = tokens.shape
    flat = tokens.reshape(groups * width)
    picked = torch.index_select(x[0], 0, flat).view(groups, width, a.shape[1])
    low = torch.bmm(picked, torch.index_select(a, 0, index))  # [groups, width, rank]
    delta = torch.bmm(low, torch.index_select(b, 0, index)) * mask  # [groups, width, out]
    return y[0].index_add(0, flat, delta.view(groups * width, b.shape[2]))[None]


def _unchanged(x: torch.Tensor, y: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
    return y.clone()  # a branch may not return its input itself
