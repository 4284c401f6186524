"""A decoding step's Llama layers, on one sequence's rows, as one C++ op each or all as one op.

A one-token step of a small model is mostly the interpreter between ~40 small ops per layer
(docs/benchmarks/profile.md). ``Row`` runs a layer's step as ``llama_row`` and ``Stack`` every
layer's as ``llama_rows`` (kernels/layer_step.cpp): the ops of lean_layers.py's one-row and
multi-row paths, in their order, on the same tensors, with the element-wise ones as loops that
round as torch's ops do, so every output and cache entry is the layer's own, bit for bit
(tests/pipeline/test_lean_layers.py). One exception, by design: on the int8 setting
(``--cpu-linear rows-q8``) the attention runs one row at a time (row_attention.cpp), so that a
chain's or a tree's rows are the one-token steps' bits there (tests/kernels/test_gemv_int8.py).

They apply where that holds and nothing is lost: batch 1, one row without a mask or up to
``gemv_rows.MAX_ROWS`` rows (a chain, a tree) under a boolean mask, float32, SDPA attention,
RMSNorm, SiLU, the rolled rotary and transformers' own, q|k|v and gate|up fused and o / down
packed, all in compiled formats and on no fallback, and a KV cache whose layers are in-place
buffers with room for the rows (pipeline/runtime/kv_cache.py). Anywhere else they answer None and
the Python path runs. A ``Stack`` is checked once per step (the layers, the attention kind, none
training; the modules each reads by identity and no linear on its fallback in full once per run
and after any submodule was set anywhere): the per-layer checks are what it saves.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, is_
from typing import Callable

import torch
from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook
from transformers.integrations.sdpa_attention import use_gqa_in_sdpa

from multitoken.kernels import cpu_linear, gemv_rows
from multitoken.kernels.cpu_linear import PackedLinear
from multitoken.kernels.formats import Format

READS = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj", "act_fn")))
NORMS = ("input_layernorm", "post_attention_layernorm")
LINEARS = 7  # ``reads`` gives the linears first
# sizes[0] of a row: its attention, SDPA (transformers' bits) or per row (layer_step.cpp: each row's
# bits whatever the rows beside it, which the int8 setting needs for a chain to be its ``ar``)
SDPA, PER_ROW = 0, 1


def rotary_tables(ctx) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The pass's rotary tables [B, 1, T, d]: cos, sin, the signed sin the rolled rotary reads
    (lean_layers._rolled_rotary), and half of d; made once per pass."""
    tables = ctx.derived.get("rolled_rotary")
    if tables is None:
        cos, sin = ctx.position_embeddings  # [B, T, d]
        half = sin.shape[-1] // 2
        signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        tables = ctx.derived["rolled_rotary"] = (cos.unsqueeze(1), sin.unsqueeze(1), signed.unsqueeze(1), half)
    return tables


def llama_rms_norm(norm: nn.Module) -> bool:
    """Whether ``norm`` is transformers' LlamaRMSNorm, whose ops the lean forward and the row ops
    reproduce (by class name: each family's modeling module defines its own class)."""
    return type(norm).__name__ == "LlamaRMSNorm"


def _compiled(linear: nn.Module) -> bool:
    """Whether ``linear`` is packed in a compiled format and reads it (not on its fallback)."""
    return isinstance(linear, PackedLinear) and linear.spec.code is not None and linear.dense is None


def _silu(act: nn.Module) -> bool:
    """Whether the activation computes ``F.silu`` (transformers' own class, not a hub kernel's)."""
    return isinstance(act, nn.SiLU) or (type(act).__name__ == "SiLUActivation"
                                        and type(act).forward.__qualname__ == "SiLUActivation.forward")


def _standard_rotary(rotary: Callable) -> bool:
    """Whether ``rotary(q, k, cos, sin)`` computes transformers' Llama formula, x * cos +
    rotate_half(x) * sin with cos and sin unsqueezed at 1 (checked bit for bit on a probe: a hub
    kernel may stand in for it)."""
    gen = torch.Generator().manual_seed(0)
    q, k, cos, sin = (torch.randn(shape, generator=gen) for shape in ((1, 2, 3, 8), (1, 1, 3, 8), (1, 3, 8), (1, 3, 8)))
    want = [(x * cos[:, None]) + (torch.cat((-x[..., 4:], x[..., :4]), -1) * sin[:, None]) for x in (q, k)]
    with torch.no_grad():
        got = rotary(q, k, cos, sin)
    return all(torch.equal(a, b) for a, b in zip(got, want))


def reads(layer: nn.Module) -> tuple[nn.Module, ...]:
    """The modules a Llama layer's row op reads: q, k, v, o, gate, up, down, the activation and
    the two norms (without module attribute lookups)."""
    return (*(layer._modules[block]._modules[name] for block, names in READS for name in names),
            *(layer._modules[name] for name in NORMS))


def fits(hidden: torch.Tensor, ctx, cache) -> bool:
    """Whether a step's input, context and cache suit the row ops (see the module doc): one row
    without a mask, or up to ``gemv_rows.MAX_ROWS`` rows of one sequence under a boolean mask."""
    rows, mask = hidden.shape[1], ctx.mask
    return (cache is not None and hidden.shape[0] == 1 and 1 <= rows <= gemv_rows.MAX_ROWS
            and (mask is None if rows == 1 else (mask is not None and mask.dtype == torch.bool and mask.dim() == 4
                                                  and mask.shape[2] == rows))
            and hidden.dtype == torch.float32 and hidden.is_contiguous() and not getattr(cache, "offloading", False))


def _tables(ctx, half: int, past: int, rows: int):
    """(cos, signed sin, whether grouped kv heads are read in place) for a step of ``rows``
    after ``past`` slots, or None where the tables or the mask do not suit the ops."""
    cos, sin, signed, have = rotary_tables(ctx)
    if have != half or not (cos.is_contiguous() and signed.is_contiguous()) or cos.shape[0] != 1:
        return None
    mask = ctx.mask
    if mask is not None and mask.shape[-1] != past + rows:
        return None
    return cos, signed, mask is not None and use_gqa_in_sdpa(mask, None, None)


@dataclass
class Row:
    """A layer's step of one sequence's rows as ``llama_row``; its fixed arguments are made once per plan."""

    op: Callable
    weights: list[torch.Tensor]  # input norm, q|k|v, o, post norm, gate|up, down
    biases: list[torch.Tensor | None]
    sizes: list[int]  # the attention, 0, (format, n) per linear ... then heads, kv heads, head dim, half, gate n, up start, up n
    scalars: list[float]  # the norms' eps, the attention's scaling
    modules: tuple[nn.Module, ...]  # what it reads as planned (``reads``)

    @staticmethod
    def of(plan) -> "Row | None":
        """The row of a lean plan (lean_layers.Plan) whose norm and rotary are the lean ones, or None."""
        layer, qkv, gate_up = plan.layer, plan.qkv, plan.gate_up
        attn, mlp = layer.self_attn, layer.mlp
        o, down = attn.o_proj, mlp.down_proj
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if (plan.kind != "sdpa" or qkv is None or gate_up is None or not qkv.exact_split or attn.head_dim > 256
                or not (_compiled(o) and _compiled(down)) or not _silu(mlp.act_fn) or not _standard_rotary(plan.rotary)
                or any(n.weight.dtype != torch.float32 for n in norms) or (lib := gemv_rows.library()) is None):
            return None
        heads, kv = qkv.outs[0] // attn.head_dim, qkv.outs[1] // attn.head_dim
        linears = (qkv, o, gate_up, down)
        attention = PER_ROW if not all(lin.spec.exact for lin in linears) else SDPA  # int8 rows: see layer_step.cpp
        sizes = [attention, 0, int(qkv.spec.code), qkv.n, int(o.spec.code), o.out_features, 0, 0,
                 int(gate_up.spec.code), gate_up.n, int(down.spec.code), down.out_features,
                 heads, kv, attn.head_dim, attn.head_dim // 2, gate_up.outs[0], gate_up.sizes[0], gate_up.outs[1]]
        return Row(lib.llama_row, [norms[0].weight, qkv.packed, o.packed, norms[1].weight, gate_up.packed, down.packed],
                   [None, qkv.bias, o.stock.bias, None, gate_up.bias, down.stock.bias], sizes,
                   [norms[0].variance_epsilon, norms[1].variance_epsilon, attn.scaling], reads(layer))

    def formats(self) -> list[str]:
        """Its linears' formats in call order: q|k|v, o, gate|up, down."""
        return [Format(self.sizes[2 * i]).name.lower() for i in (1, 2, 4, 5)]

    def current(self, layer: nn.Module) -> bool:
        """Whether ``layer`` still holds the modules it was made from, its o / down on their packs
        (q / k / v and gate / up: the plan's own check)."""
        return (all(map(is_, reads(layer), self.modules))
                and self.modules[3].dense is None and self.modules[6].dense is None)

    def run(self, plan, hidden: torch.Tensor, ctx, cache) -> torch.Tensor | None:
        """The step of one row ``hidden`` [1, 1, H] # -> [1, 1, H], its key and value written to
        the cache's buffers in place; None where it does not apply now."""
        if not fits(hidden, ctx, cache):  # ``current``: checked where the plan is read (LeanLayers.plan)
            return None
        index, rows = plan.layer.self_attn.layer_idx, hidden.shape[1]
        layers = cache.layers
        slot_of = getattr(layers[index], "row_slot", None) if index < len(layers) else None
        slot = slot_of(rows) if slot_of is not None else None
        tables = None if slot is None else _tables(ctx, self.sizes[15], slot[2], rows)
        if tables is None:
            return None
        k, v, n = slot
        cos, signed, gqa = tables
        out = self.op(hidden, self.weights, self.biases, self.sizes, self.scalars, cos, signed, k, v, n, ctx.mask, gqa)
        layers[index].filled(n + rows)
        return out


_DENSE, _MODULES, _TRAINING = attrgetter("dense"), attrgetter("_modules"), attrgetter("training")
_MOVES = [0]  # submodules set anywhere in this process (torch's global hook below)


def _moved(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    _MOVES[0] += 1


register_module_module_registration_hook(_moved)


def _places(layers) -> tuple[list, list, list, list]:
    """Where each module the layers' row ops read sits, the blocks holding them included, in layer
    order: (each one's owner, the owner's ``_modules``, its name there, the module)."""
    owners, dicts, names, held = [], [], [], []
    for layer in layers:
        places = [(layer, name) for name in NORMS]
        for block, children in READS:
            places += [(layer, block), *((layer._modules[block], child) for child in children)]
        for owner, name in places:
            owners.append(owner), dicts.append(owner._modules), names.append(name), held.append(owner._modules[name])
    return owners, dicts, names, held


@dataclass
class Stack:
    """Every layer's step of one sequence's rows as ``llama_rows``: the layers' rows' arguments concatenated, and
    what they were made from (checked once per step). ``op`` None: some layer has no row (kept so
    that the answer is not worked out again every step)."""

    layers: tuple[nn.Module, ...]
    places: tuple[list, list, list, list]  # ``_places(layers)``: what ``current`` compares
    kind: str
    linears: tuple[nn.Module, ...] = ()  # each layer's seven linears
    op: Callable | None = None
    weights: list = None
    biases: list = None
    sizes: list = None
    scalars: list = None
    half: int = 0
    seen: tuple = ()  # (_MOVES, FALLBACKS) when ``current`` last compared the places in full
    checked: weakref.ref | None = None  # the cache it compared them for
    norm: nn.Module | None = None  # the final norm it was made with (the caller's, applied or not)
    norm_args: tuple = (None, 0.0)  # its weight and eps where the op applies it (``_final_norm``)

    @staticmethod
    def of(layers, rows: list[Row | None], kind: str, norm: nn.Module | None = None) -> "Stack":
        """The stack of ``layers`` whose rows are ``rows`` (None where a layer has none), and
        ``norm`` after them where the op reproduces it."""
        layers = tuple(layers)
        stack = Stack(layers, _places(layers), kind, norm=norm)
        if any(row is None for row in rows) or len({row.sizes[15] for row in rows}) != 1:
            return stack  # kept while its modules are: a linear packed or put in place is a new module
        stack.linears = tuple(m for layer in layers for m in reads(layer)[:LINEARS])  # packed, each with its fallback's ``dense``
        lib = gemv_rows.library()
        stack.op, stack.half = lib.llama_rows, rows[0].sizes[15]
        stack.weights = [w for row in rows for w in row.weights]
        stack.biases = [b for row in rows for b in row.biases]
        stack.sizes = [n for row in rows for n in row.sizes]
        stack.scalars = [x for row in rows for x in row.scalars]
        stack.norm_args = _final_norm(norm, rows[-1].weights[0])
        return stack

    def current(self, layers, kind: str, cache, norm: nn.Module | None = None) -> bool:
        """Whether ``layers`` are the ones it was made from, reading the same modules from the same
        places, no linear on its fallback, under the same attention kind, none training. Every
        step asks: the places are compared in full on a new ``cache`` (a new run) or after any
        submodule was set or any packed linear fell back anywhere; otherwise that nothing moved
        answers for them (touching some 400 modules, cold in the cache after a step, is a visible share
        of a small model's step)."""
        if (kind != self.kind or norm is not self.norm or len(layers) != len(self.layers)
                or not all(map(is_, layers, self.layers)) or any(map(_TRAINING, layers))):
            return False
        seen = (_MOVES[0], cpu_linear.FALLBACKS[0])
        if seen == self.seen and self.checked is not None and self.checked() is cache:
            return True
        owners, dicts, names, held = self.places
        if not (all(map(is_, map(_MODULES, owners), dicts)) and all(map(is_, map(dict.get, dicts, names), held))
                and all(map(is_, map(_DENSE, self.linears), repeat(None)))):
            return False
        self.compared(cache)
        return True

    def compared(self, cache) -> None:
        """Its places are the modules' now (compared, or just made from them), for ``cache``'s run."""
        self.seen, self.checked = (_MOVES[0], cpu_linear.FALLBACKS[0]), weakref.ref(cache)

    def run(self, hidden: torch.Tensor, ctx, cache, every: bool) -> list[torch.Tensor] | None:
        """Every layer's step of the rows ``hidden`` [1, T, H] # -> each layer's output (``every``) or
        the last two layers' [1, T, H], then the final norm's where it applies it (``norm_args``);
        None where the cache or the rotary do not suit it."""
        n, rows = len(self.layers), hidden.shape[1]
        layers = cache.layers
        if len(layers) < n:
            return None
        slots = [getattr(layer, "row_slot", _none)(rows) for layer in layers[:n]]
        if any(slot is None for slot in slots) or len({slot[2] for slot in slots}) != 1:
            return None
        past = slots[0][2]
        if (tables := _tables(ctx, self.half, past, rows)) is None:
            return None
        cos, signed, gqa = tables
        keep = list(range(n)) if every else [n - 2, n - 1]
        outs = self.op(hidden, self.weights, self.biases, self.sizes, self.scalars, cos, signed,
                       [s[0] for s in slots], [s[1] for s in slots], past, ctx.mask, gqa, keep, *self.norm_args)
        for layer in layers[:n]:
            layer.filled(past + rows)
        return outs


def _final_norm(norm: nn.Module | None, like: torch.Tensor) -> tuple[torch.Tensor | None, float]:
    """(weight, eps) of a final norm the op applies as transformers' LlamaRMSNorm (its class, a
    float32 weight like the layers' norm weight ``like``), else (None, 0.0): the caller's."""
    if norm is None or not llama_rms_norm(norm):
        return None, 0.0
    weight = norm._parameters.get("weight")
    if (weight is None or weight.dtype != torch.float32 or weight.shape != like.shape or weight.device != like.device
            or not weight.is_contiguous()):
        return None, 0.0
    return weight, float(norm.variance_epsilon)


def _none(rows: int):
    return None
