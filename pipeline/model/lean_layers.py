"""A decoder layer's forward with fewer calls, bit-identical to the layer's own (decoding on the CPU).

A decoding step of a small model is mostly calls, not arithmetic: ~200 linears and their module
calls, wrappers and output tensors (docs/benchmarks/profile.md). For a layer family listed in
``LEAN`` (one row per ``model_type``) this runs the layer's own submodules and transformers' own
functions in the layer's own order: its norms' ops, its rotary function (``apply_rotary_pos_emb``
of the module that defines its attention class), its attention kernel (transformers' interface
for the model's ``_attn_implementation``), its cache's ``update``, its activation, with the same
tensors in and out, so every output is the layer's, bit for bit
(tests/pipeline/test_lean_layers.py). What changes: q / k / v, and the MLP's gate / up, each
take one kernel call where they are packed linears of one compiled format
(kernels/fused_linear.py: each output is the separate call's); on the CPU, RMSNorm's eight ops
are one op of the same roundings (layer_step.cpp's ``rms_norm``; elsewhere its two casts, no-ops
on float32, are left out); a one-row step rotates q and k as one tensor (element-wise ops: each
element as apart), ``rotate_half(x) * sin`` as ``roll(x) * signed sin`` (``_rolled_rotary``), and
on the CPU a one-token step of several rows rotates them in one op (layer_step.cpp's
``rotary_step``: the formula's ten ops, each rounded as torch's); the module calls of the attention and MLP blocks are gone. On the CPU the caches it extends are
written in place (pipeline/runtime/kv_cache.py), and where a step is one sequence of packed
layers the same ops run from C++, one op per layer or per step (lean_rows.py).

It runs only where the layer's own forward would compute the same thing: without autograd (a
training step keeps transformers' layers, their checkpointing included), with sdpa or eager
attention (the others read extra arguments), and on the layer class the row names. Anything
else goes to the layer's forward (``Backbone.run_layer``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from operator import itemgetter
from typing import Callable

import torch
from torch import nn

from multitoken.kernels import gemv_rows
from multitoken.kernels.fused_linear import FusedLinear, fusable
from multitoken.pipeline.model.attention import SDPA_MASKED
from multitoken.pipeline.model.lean_rows import Row, Stack, fits, llama_rms_norm, rotary_tables

ATTENTION_KINDS = (*SDPA_MASKED, "eager")  # attention kernels that read only (q, k, v, mask, scaling)
QKV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")


@dataclass
class Plan:
    """One layer's fused linears (None: its parts are called one by one) and the functions its
    family's modeling module defines (attributes, so the profile can label them)."""

    layer: nn.Module
    qkv: FusedLinear | None
    gate_up: FusedLinear | None
    norm: Callable  # (norm module, x) -> the norm's output
    rotary: Callable  # the family's apply_rotary_pos_emb(q, k, cos, sin)
    rotary_one: Callable  # (x, ctx) -> x rotated: q and k of a one-row step as one tensor
    attention: Callable  # transformers' attention kernel for ``kind``
    kind: str  # the model's attention implementation when planned
    linears: tuple[nn.Module, ...]  # q, k, v, gate, up as planned
    row: Row | None = None  # the layer's row op (lean_rows.py), where it gives this layer's bits

    def current(self, kinds: dict | None = None) -> bool:
        """Whether the layer's attention kind and linears are still the ones planned (a repack or
        unpack swaps them) and the fused ones still read their shares (no part on its fallback).
        ``kinds``: attention kinds already read this pass, by config (see ``_kind``)."""
        return (_kind(self.layer.self_attn.config, kinds) == self.kind
                and _linears(self.layer) == self.linears  # modules compare by identity
                and (self.qkv is None or self.qkv.current(self.qkv.parts))
                and (self.gate_up is None or self.gate_up.current(self.gate_up.parts)))


def _kind(config, kinds: dict | None) -> str:
    """``config._attn_implementation``, read once per pass where ``kinds`` (a pass's memo, by
    config) is given: a transformers config answers attribute reads through Python code, and
    every layer of a pass would read it twice."""
    if kinds is None:
        return config._attn_implementation
    kind = kinds.get(id(config))
    if kind is None:
        kind = kinds[id(config)] = config._attn_implementation
    return kind


_GET_QKV, _GET_GATE_UP = itemgetter(*QKV), itemgetter(*GATE_UP)  # checked every layer call: no Python loop


def _linears(layer: nn.Module) -> tuple[nn.Module, ...]:
    return _GET_QKV(layer.self_attn._modules) + _GET_GATE_UP(layer.mlp._modules)


def _fused(parts: tuple[nn.Module, ...], names: tuple[str, ...]) -> FusedLinear | None:
    return FusedLinear(list(parts), names) if fusable(list(parts)) else None


def _module_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return norm(x)


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm.forward``'s bits: on the CPU the kernels' ``rms_norm`` op (its eight ops as
    one, float32 or bfloat16 rows and weight; layer_step.cpp), else its ops on float32 ``x``, less
    its two casts to float32 (no-ops there)."""
    if (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.dtype == norm.weight.dtype
            and x.is_contiguous() and (lib := gemv_rows.library()) is not None):
        return lib.rms_norm(x, norm.weight, norm.variance_epsilon)
    if x.dtype != torch.float32:
        return norm(x)
    variance = x.pow(2).mean(-1, keepdim=True)
    return norm.weight * (x * torch.rsqrt(variance + norm.variance_epsilon))


def llama_plan(layer: nn.Module) -> Plan:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    modeling = sys.modules[type(layer.self_attn).__module__]
    linears, kind = _linears(layer), layer.self_attn.config._attn_implementation
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(kind, modeling.eager_attention_forward)
    rotate_half = modeling.rotate_half

    def rotary_one(x, ctx):  # apply_rotary_pos_emb's formula on one tensor
        cos, sin = ctx.position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return (x * cos) + (rotate_half(x) * sin)

    plan = Plan(layer, _fused(linears[:3], QKV), _fused(linears[3:], GATE_UP),
                _rms_norm if llama_rms_norm(layer.input_layernorm) and llama_rms_norm(layer.post_attention_layernorm)
                else _module_norm,
                modeling.apply_rotary_pos_emb, _rolled_rotary if _halves_swapped(rotate_half) else rotary_one,
                attention, kind, linears)
    plan.row = Row.of(plan) if plan.norm is _rms_norm and plan.rotary_one is _rolled_rotary else None
    return plan


def _halves_swapped(rotate_half: Callable) -> bool:
    """Whether ``rotate_half`` is the usual ``cat(-x2, x1)`` of x's halves x1, x2 (checked on a
    probe: a fixed permutation with signs shows on distinct values)."""
    probe = torch.arange(1.0, 9.0)
    return torch.equal(rotate_half(probe), torch.cat((-probe[4:], probe[:4])))


def _rolled_rotary(x: torch.Tensor, ctx) -> torch.Tensor:
    """``(x * cos) + (rotate_half(x) * sin)`` in fewer ops, the same bits: ``rotate_half(x) * sin``
    is ``roll(x) * cat(-sin1, sin2)`` element for element ((-a) * b and a * (-b) are one rounding
    of one product, negated), and the unsqueezed cos and signed sin are made once per pass."""
    cos, _, signed, half = rotary_tables(ctx)
    return (x * cos) + (x.roll(half, -1) * signed)


def _qkv(plan: Plan, x: torch.Tensor, ctx, cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v rotated # [B, T, H] -> [B, heads, T, d] each, k and v before the cache."""
    attn = plan.layer.self_attn
    shape = (*x.shape[:-1], -1, attn.head_dim)  # [B, T, heads, d]
    cos, sin = ctx.position_embeddings
    fused = plan.qkv if cache is not None else None  # v then reaches attention through the cache's copy, as the layer's does
    if fused is not None and x.shape[0] * x.shape[1] == 1 and fused.exact_split:
        # one row: q and k rotated as one tensor (element-wise ops: each element's bits as
        # apart), v a view; several rows keep the layer's own tensors (SDPA reads their strides)
        heads = fused.joint(x).view(shape).transpose(1, 2)  # [1, q + 2 kv heads, 1, d]
        q_heads, kv = fused.outs[0] // attn.head_dim, fused.outs[1] // attn.head_dim
        qk = plan.rotary_one(heads[:, :q_heads + kv], ctx)
        return qk[:, :q_heads], qk[:, q_heads:], heads[:, q_heads + kv:]
    if fused is not None:
        q, k, v = fused(x)
    else:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    q, k, v = q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)
    if x.shape[1] == 1 and plan.rotary_one is _rolled_rotary and (lib := _step_rotary(q, cos)) is not None:
        q, k = lib.rotary_step(q, k, cos, sin)  # one token a row: its ten ops as one, their bits
    else:
        q, k = plan.rotary(q, k, cos, sin)
    return q, k, v


def _step_rotary(q: torch.Tensor, cos: torch.Tensor):
    """The kernels where their ``rotary_step`` takes a one-token step's q [B, heads, 1, d] and
    tables [B or 1, 1, d] (layer_step.cpp: transformers' formula, each op rounded as torch's), else None."""
    if (q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16) or cos.dtype != q.dtype
            or cos.dim() != 3 or cos.stride(-1) != 1 or q.stride(-1) != 1 or q.shape[-1] % 2):
        return None
    return gemv_rows.library()


def _attention(plan: Plan, x: torch.Tensor, ctx, cache) -> torch.Tensor:
    """The attention block after its norm # [B, T, H] -> [B, T, H]."""
    attn = plan.layer.self_attn
    q, k, v = _qkv(plan, x, ctx, cache)
    if cache is not None:
        k, v = cache.update(k, v, attn.layer_idx)
    out, _ = plan.attention(attn, q, k, v, ctx.mask, dropout=0.0, scaling=attn.scaling)  # [B, T, heads, d]
    return attn.o_proj(out.reshape(*x.shape[:-1], -1).contiguous())


def _mlp(plan: Plan, x: torch.Tensor) -> torch.Tensor:
    """The MLP after its norm # [B, T, H] -> [B, T, H]."""
    mlp = plan.layer.mlp
    if plan.gate_up is not None:
        gate, up = plan.gate_up(x)
        # the activation's vectorised and scalar loops may round differently: it runs over the
        # same contiguous rows as the layer's (a copy only where a step has several rows)
        gate = gate if gate.is_contiguous() else gate.contiguous()
    else:
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    return mlp.down_proj(mlp.act_fn(gate) * up)


def llama_forward(plan: Plan, hidden: torch.Tensor, ctx, cache) -> torch.Tensor:
    """``LlamaDecoderLayer.forward`` on ``hidden`` [B, T, H] under ``ctx`` (mask, rotary): each
    output's bits # -> [B, T, H]."""
    if plan.row is not None:
        if (out := plan.row.run(plan, hidden, ctx, cache)) is not None:
            return out
    layer = plan.layer
    hidden = hidden + _attention(plan, plan.norm(layer.input_layernorm, hidden), ctx, cache)
    return hidden + _mlp(plan, plan.norm(layer.post_attention_layernorm, hidden))


@dataclass(frozen=True)
class Lean:
    """A family's lean forward: the layer class it reproduces, its plan and its forward."""

    layer_class: str
    plan: Callable[[nn.Module], Plan]
    forward: Callable[[Plan, torch.Tensor, object, object], torch.Tensor]


LEAN: dict[str, Lean] = {"llama": Lean("LlamaDecoderLayer", llama_plan, llama_forward)}


class LeanLayers:
    """The lean forward of one backbone's layers: ``plan(layer)`` gives a layer's plan where the
    lean forward applies to it now, else None (then run the layer's own forward)."""

    def __init__(self, model_type: str, config):
        self.lean = LEAN.get(model_type)
        self.config = config
        self.plans: dict[int, Plan] = {}
        self.stack: Stack | None = None  # the last layers run as one op (``run_rows``)

    def plan(self, layer: nn.Module, ctx=None) -> Plan | None:
        """``ctx``: the pass's ``LayerContext``, where the attention kinds read are kept for the
        pass's other layers (None: read them now)."""
        kinds = None if ctx is None else ctx.derived.setdefault("attention_kinds", {})
        if (self.lean is None or torch.is_grad_enabled() or type(layer).__name__ != self.lean.layer_class
                or _kind(self.config, kinds) not in ATTENTION_KINDS or layer.training):
            return None
        plan = self.plans.get(id(layer))
        if (plan is None or plan.layer is not layer or not plan.current(kinds)
                or (plan.row is not None and not plan.row.current(layer))):
            plan = self.plans[id(layer)] = self.lean.plan(layer)
        return plan

    def run_rows(self, layers, hidden: torch.Tensor, ctx, cache, every: bool,
                 norm: nn.Module | None = None) -> tuple[list[torch.Tensor], torch.Tensor | None] | None:
        """``layers`` (two or more) on the rows ``hidden`` [1, T, H] of one sequence in one op
        (lean_rows.Stack) where each layer's row op applies # -> (each layer's output (``every``)
        or the last two's, the last one through ``norm`` where the op applies it, else None);
        None: run them one by one."""
        if self.lean is None or torch.is_grad_enabled() or len(layers) < 2 or not fits(hidden, ctx, cache):
            return None
        kind = self.config._attn_implementation
        stack = self.stack
        if stack is None or not stack.current(layers, kind, cache, norm):
            plans = [self.plan(layer, ctx) for layer in layers]
            rows = [None if p is None else p.row for p in plans]
            stack = self.stack = Stack.of(layers, rows, kind, norm)
            stack.compared(cache)  # made from the modules just now: the next compare is a move's
        outs = None if stack.op is None else stack.run(hidden, ctx, cache, every)
        if outs is None:
            return None
        return (outs[:-1], outs[-1]) if stack.norm_args[0] is not None else (outs, None)

    def runs_on(self, device: torch.device) -> bool:
        """Whether a decoding run on ``device`` takes the lean forward (inference on the CPU, an
        attention kernel it reproduces): where an in-place KV cache's bits are checked."""
        return (self.lean is not None and device.type == "cpu"
                and self.config._attn_implementation in ATTENTION_KINDS)

    def run(self, plan: Plan, hidden: torch.Tensor, ctx, cache) -> torch.Tensor:
        """The planned layer's lean forward # [B, T, H] -> [B, T, H]."""
        return self.lean.forward(plan, hidden, ctx, cache)

    def fused(self) -> dict[str, FusedLinear]:
        """Every fused linear planned so far, by a name that says where it sits (for the profile's labels)."""
        return {f"lean.{i}.{'_'.join(f.names)}": f for i, plan in enumerate(self.plans.values())
                for f in (plan.qkv, plan.gate_up) if f is not None}
