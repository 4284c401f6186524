"""The one decoder layer of an EAGLE-3 drafter, Llama-style whatever the base, and its KV cache.

The layer reads two inputs of width H: the token embedding (``input_layernorm``) and a hidden
state (``hidden_norm``: the fused target states at the first draft step, the layer's own
previous output after it). Attention's q/k/v take their concatenation [embeds; hidden] (2H
wide); the residual stream starts from the un-normalised hidden state; then
``post_attention_layernorm`` and a SwiGLU MLP. The layer returns its pre-norm output (what the
next draft step reads back); the drafter's final ``norm`` and its lm head follow it. This is
the computation of vLLM's ``Eagle3LlamaForCausalLM`` and llama.cpp's ``eagle3`` graph, with
their parameter names, so an export is a renaming only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LayerShape:
    """The drafter layer's dimensions, read from the base (``from_base``)."""

    width: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    rope: dict  # transformers' rope_parameters for a full-rotary Llama layer (rope_type, rope_theta, ...)
    max_positions: int

    @classmethod
    def from_base(cls, config, intermediate: int | None = None) -> "LayerShape":
        """Llama bases give their own shape; GPT-NeoX ones their width, heads, MLP size, norm eps
        and rotary base, with full rotary (a Llama layer is what the serving engines run)."""
        heads = config.num_attention_heads
        rope = dict(getattr(config, "rope_parameters", None) or {})
        rope.pop("partial_rotary_factor", None)
        rope.setdefault("rope_type", "default")
        rope.setdefault("rope_theta", float(getattr(config, "rope_theta", None) or getattr(config, "rotary_emb_base", 10000.0)))
        eps = getattr(config, "rms_norm_eps", None) or getattr(config, "layer_norm_eps", 1e-5)
        return cls(width=config.hidden_size, heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   intermediate=intermediate or config.intermediate_size, eps=float(eps), rope=rope,
                   max_positions=int(getattr(config, "max_position_embeddings", 2048)))


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Rotary(nn.Module):
    """RoPE tables from transformers' Llama implementation (every rope_type it knows)."""

    def __init__(self, shape: LayerShape):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        cfg = LlamaConfig(hidden_size=shape.width, num_attention_heads=shape.heads, head_dim=shape.head_dim,
                          rope_parameters=dict(shape.rope), max_position_embeddings=shape.max_positions)
        self.emb = LlamaRotaryEmbedding(cfg)  # inv_freq is a non-persistent buffer: nothing saved

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) # x [..], positions [B, T] -> [B, 1, T, D] each (broadcast over heads)."""
        cos, sin = self.emb(x, positions)
        return cos[:, None], sin[:, None]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


class Attention(nn.Module):
    def __init__(self, shape: LayerShape):
        super().__init__()
        s, inp = shape, 2 * shape.width
        self.shape = s
        self.q_proj = nn.Linear(inp, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(inp, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(inp, s.kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.width, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated queries and keys, values # [B, T, 2H] -> q [B, h, T, D], k / v [B, h, T, D]
        (key / value heads repeated up to the query heads: grouped-query attention)."""
        B, T, _ = x.shape
        s = self.shape
        q = self.q_proj(x).view(B, T, s.heads, s.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, s.kv_heads, s.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, s.kv_heads, s.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        group = s.heads // s.kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return q, k, v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """[B, h, T, D] -> [B, T, H]."""
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, shape: LayerShape):
        super().__init__()
        self.gate_proj = nn.Linear(shape.width, shape.intermediate, bias=False)
        self.up_proj = nn.Linear(shape.width, shape.intermediate, bias=False)
        self.down_proj = nn.Linear(shape.intermediate, shape.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """Split in two around attention, so the caller picks which keys each query sees: a KV
    cache when drafting, the training-time-test pattern when training (``adapters/eagle3.py``)."""

    def __init__(self, shape: LayerShape):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.width, shape.eps)
        self.hidden_norm = RMSNorm(shape.width, shape.eps)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.width, shape.eps)
        self.mlp = MLP(shape)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[embeds; hidden] normalised # [B, T, H] x 2 -> [B, T, 2H]."""
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, attended: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm output from attention's heads # o [B, h, T, D], hidden [B, T, H] -> [B, T, H]."""
        mid = self.self_attn.out(attended) + hidden  # residual from the un-normalised hidden state
        return mid + self.mlp(self.post_attention_layernorm(mid))


class DraftCache:
    """The drafter's own KV cache for B rows: keys / values [B, h, capacity, D], where slot s of
    a row holds position s of its text (a chain writes its slots at its positions), so rows of
    different lengths share it with no holes to track: a query of a chain sees the slots up to
    its own position, and a slot past a row's text is stale until a pass writes it. ``length``
    (host) is the span the passes have written: attention reads slots [0, span)."""

    def __init__(self):
        self.keys = self.values = None
        self.length = 0

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, span: int):
        """Write this pass's keys / values [B, h, T, D] at ``slots`` [B, T] (each < ``span``);
        returns the slots [0, span) # -> k, v [B, h, span, D]. The buffer grows by doubling
        (zeros: a stale slot is finite, so a masked read of it is exactly 0)."""
        B, h, _, D = k.shape
        if self.keys is None or self.keys.shape[2] < span:
            cap = max(span, 2 * (0 if self.keys is None else self.keys.shape[2]))
            keys, values = k.new_zeros(B, h, cap, D), v.new_zeros(B, h, cap, D)
            if self.keys is not None:
                keys[:, :, :self.length] = self.keys[:, :, :self.length]
                values[:, :, :self.length] = self.values[:, :, :self.length]
            self.keys, self.values = keys, values
        rows = torch.arange(B, device=slots.device)[:, None]  # [B, 1]
        self.keys[rows, :, slots] = k.transpose(1, 2)  # advanced indices first: [B, T, h, D]
        self.values[rows, :, slots] = v.transpose(1, 2)
        self.length = max(self.length, span)
        return self.keys[:, :, :span], self.values[:, :, :span]

    def keep_rows(self, index: list[int]) -> None:
        """The rows ``index`` in that order (finished rows leave; -1: a new, empty row)."""
        if self.keys is None:
            return
        grown = [torch.cat([x, x.new_zeros(1, *x.shape[1:])]) for x in (self.keys, self.values)]  # row -1: empty
        n = self.keys.shape[0]
        at = torch.tensor([i if i >= 0 else n for i in index], dtype=torch.long, device=self.keys.device)
        self.keys, self.values = (x.index_select(0, at) for x in grown)
