"""Several packed linears that read the same input, as one kernel call (a layer's q / k / v, its
MLP's gate / up).

A compiled format stores a weight as column blocks of L outputs along its first axis
(format_table.py), and the kernel computes every output as its own chain of fused multiply-adds
over the input features in order, whatever the other outputs (docs/kernels.md, the exactness
contract). The parts' blocks concatenated along that axis are then one weight whose outputs are
the parts' outputs bit for bit: one call instead of several, one output tensor instead of
several. A part whose outputs end in a partial block keeps its zero-padded columns in the fused
weight (so every later part starts on a block), and the split drops them.

The parts keep working alone: their packed weights become views of the fused one (one copy of the
weights), so unpacking, copying or calling a part still gives its own weight and outputs.
"""

from __future__ import annotations

import torch
from torch import nn

from multitoken.kernels import gemv_rows
from multitoken.kernels.cpu_linear import PackedLinear
from multitoken.kernels.formats import Format


def fusable(parts: list[nn.Module]) -> bool:
    """Whether ``parts`` can share one call: at least two compiled-format ``PackedLinear``s of one
    format and input width, none on its fallback."""
    if len(parts) < 2 or not all(isinstance(p, PackedLinear) for p in parts):
        return False
    spec, k = parts[0].spec, parts[0].in_features
    return (spec.code is not None and all(p.spec is spec and p.in_features == k and p.dense is None for p in parts)
            and all(p.bias is None or p.bias.dtype == torch.float32 for p in parts))


class FusedLinear(nn.Module):
    """``parts`` (``fusable``) as one linear: ``forward(x)`` # [..., K] -> a tuple of [..., N_i],
    each bit-identical to ``parts[i](x)``. Kept outside the model's module tree (no parameters, no
    state_dict); ``format`` and ``names`` are for the profile's labels."""

    def __init__(self, parts: list[PackedLinear], names: tuple[str, ...]):
        super().__init__()
        if not fusable(parts):
            raise ValueError("FusedLinear takes two or more compiled-format PackedLinears of one format and input width")
        width = gemv_rows.lanes()
        blocks = [p.packed.shape[0] for p in parts]
        object.__setattr__(self, "parts", tuple(parts))  # not submodules: the model holds them
        self.names, self.spec, self.in_features = names, parts[0].spec, parts[0].in_features
        self.sizes = [b * width for b in blocks]  # each part's outputs, padded to whole blocks
        self.outs = [p.out_features for p in parts]
        self.n = sum(self.sizes)
        self.packed = torch.cat([p.packed for p in parts])  # [sum blocks, ...]
        self.bias = None if all(p.bias is None for p in parts) else torch.cat(
            [_padded(p.bias, p.out_features, size) for p, size in zip(parts, self.sizes)])
        start = 0
        for part, b in zip(parts, blocks):  # one copy of the weights: each part reads its share of the fused one
            part.packed, start = self.packed[start:start + b], start + b
        self.exact_split = self.sizes == self.outs  # no padded columns to drop

    @property
    def format(self) -> str:
        return self.spec.name

    def current(self, parts: tuple[nn.Module, ...]) -> bool:
        """Whether ``parts`` are still the modules fused here, each reading its share (a repack or
        an unpack swaps the modules)."""
        return all(a is b and a.dense is None for a, b in zip(parts, self.parts))

    def joint(self, x: torch.Tensor) -> torch.Tensor:
        """The fused output # [..., K] -> [..., sum of the parts' padded widths]: part i's outputs
        are its slice (``sizes``), padded columns included; the kernel's refusals raise."""
        return self.spec.linear(x, self.packed, self.n, self.bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # [..., K] -> ([..., N_i], ...)
        if self.spec.code == Format.F32 and x.numel() // self.in_features > gemv_rows.MAX_ROWS:
            return tuple(part(x) for part in self.parts)  # a prompt's float32 blocks take a matmul: per part, as before
        try:
            out = self.spec.linear(x, self.packed, self.n, self.bias)  # [..., sum sizes] (not through joint: one label per call in a profile)
        except RuntimeError:  # what the kernel refuses, each part handles (its F.linear fallback)
            return tuple(part(x) for part in self.parts)
        pieces = out.split(self.sizes, dim=-1)
        return pieces if self.exact_split else tuple(p[..., :n] for p, n in zip(pieces, self.outs))

    def extra_repr(self) -> str:
        return f"{'+'.join(self.names)}: in_features={self.in_features}, outs={self.outs}, packed ({self.format})"


def _padded(bias: torch.Tensor | None, n: int, size: int) -> torch.Tensor:
    """A part's bias (zeros where it has none) padded with zeros to ``size`` outputs # -> [size]."""
    out = torch.zeros(size, dtype=torch.float32)
    if bias is not None:
        out[:n] = bias.detach()
    return out
