"""Prepacked CPU linears for decoding: a step over 2-16 tokens reads each weight once, as a one-token step does.

The weight formats are one table (format_table.py): oneDNN's blocked layout (``--cpu-linear
packed``) and the formats of our own compiled multi-row GEMV (``--cpu-linear rows``, float32
weights, gemv_rows.py: built on first use; where it cannot be, those layers take oneDNN's layout;
a weight that is exactly a GGUF's Q4_1 / Q8_0 codes or 16-bit floats keeps that format,
gguf_codes.py; ``--cpu-linear rows-q8``: the same, with Q4_1 / Q8_0 codes read against int8 activations,
gemv_int8.cpp). ``PackedLinear`` reads its weight through its format's entry and nothing else.

torch's fp32 ``F.linear`` on the CPU calls MKL, whose cost grows almost linearly with the rows
for a few rows; oneDNN on a weight reordered once into its blocked layout reads the weight once
per call whatever the row count (memory-bound), and computes each fp32 row the same way for any
row count, so a verification step's logits are bit-identical to a one-token step's (bf16: equal
within rounding, as the kernel may block more rows differently). The ops are
private to torch (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``): a probe
checks them against ``F.linear`` once per process and dtype, and any error falls back to
``F.linear`` (said once on stderr); tested with the torch of constraints.txt.

When: packing is a decoding-time state of a model (``MultiTokenModel.new_caches`` packs, once;
``train()`` restores the stock modules), so training, LoRA and head building always see plain
``nn.Linear`` modules with their own Parameter objects. What: every float32 / bfloat16
``nn.Linear`` on the CPU with at least ``MIN_WEIGHTS`` weights (backbone, heads, unembedding;
a smaller one costs oneDNN's per-call overhead more than its read, so a tiny model such as
stories260K keeps torch's linears and pythia-mini packs only its unembedding; quantized
bitsandbytes layers are other classes and peft LoRA layers are not entered). The packed weight
replaces the dense one (its storage is released; ``unpack`` restores it exactly from the packed
copy), except where the weight is shared with another module (a tied embedding keeps its dense
copy for the lookup). One-token steps use the packed weight too: where every linear is packed
(SmolLM2, pythia-160m and up) the same logits whatever the row count; one copy of the weights.
A packed layer keeps its device and dtype: move or cast a model before it decodes,
or after ``train()``.
"""

from __future__ import annotations

import copy
import sys
from typing import Callable, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from multitoken.base.progress import status
from multitoken.kernels import cpu_features, gemv_rows, gguf_codes, host_memory, pack_cache
from multitoken.kernels.format_table import CODES, FORMATS, INT8_ACTIVATIONS, Spec
from multitoken.kernels.formats import Format

PACKED, ROWS, STOCK = "packed", "rows", "stock"
ROWS_F32 = "rows-f32"  # the rows kernel on float32 blocks only: GGUF codes not kept (what they are worth)
ROWS_Q8 = "rows-q8"  # rows, with Q4_1 / Q8_0 codes read against int8 activations as llama.cpp does: not exact
CPU_LINEARS = (PACKED, ROWS, ROWS_Q8, ROWS_F32, STOCK)
COMPILED_MODES = (ROWS, ROWS_Q8, ROWS_F32)  # the modes of our compiled kernel
ONEDNN = "onednn"  # the layout of a PACKED layer (and of a ROWS model's bf16 layers)
PACKED_DTYPES = (torch.float32, torch.bfloat16)
# Smallest weight packed (elements): oneDNN's fixed cost per call is about what reading this many
# fp32 weights from memory takes, so below it a layer is call overhead either way (a tiny model
# such as stories260K decodes faster on torch's own linears).
MIN_WEIGHTS = 100_000

# A weight's GGUF codes where they are known (gguf_file.GGUFCodes): (Format, parts) as
# gguf_codes.find_codes gives them, or None (then the floats are searched).
Codes = Callable[[torch.Tensor], "tuple[Format, list] | None"]

_STATE: dict = {"usable": {}, "warned": False}  # usable: dtype -> bool, probed once per process
FALLBACKS = [0]  # packed linears put on their fallback in this process (what a plan built on them watches)


@runtime_checkable
class ArgmaxHead(Protocol):
    """A module that can give its logits' argmax without making them: ``argmax(x)`` # [..., K] ->
    [...] long, exactly ``self(x).argmax(-1)``, or None where it cannot here (then take the logits)."""

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None: ...


_ARGMAX_HEADS: dict[type, bool] = {}


def is_argmax_head(module: nn.Module) -> bool:
    """``isinstance(module, ArgmaxHead)``, answered once per class (a protocol's check walks its
    members on every call, and greedy decoding asks every step)."""
    kind = type(module)
    if kind not in _ARGMAX_HEADS:
        _ARGMAX_HEADS[kind] = isinstance(module, ArgmaxHead)
    return _ARGMAX_HEADS[kind]


def grids_on() -> bool:
    """Whether the rows layout can keep weights in a narrow format here (gguf_codes.py: exact,
    so ``rows`` does; ``rows-f32`` keeps float32 blocks, to measure)."""
    return rows_usable() and _STATE["usable"].get("grid", False)


def _say_once(message: str) -> None:
    if not _STATE["warned"]:
        _STATE["warned"] = True
        print(f"multitoken: {message}; CPU linears fall back to F.linear", file=sys.stderr)


def usable(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build runs oneDNN's packed ops in ``dtype`` and they agree with
    ``F.linear`` (probed once per process and dtype on a small layer)."""
    if dtype not in _STATE["usable"]:
        _STATE["usable"][dtype] = _probe(dtype)
    return _STATE["usable"][dtype]


def rows_usable() -> bool:
    """Whether the compiled rows kernel builds here and agrees with ``F.linear`` (once per process)."""
    if "rows" not in _STATE["usable"]:
        _STATE["usable"]["rows"] = _probe_rows()
    return _STATE["usable"]["rows"]


def _probe_rows() -> bool:
    if gemv_rows.library() is None:
        return False  # said on stderr by gemv_rows
    gen = torch.Generator().manual_seed(0)
    w, b, x = (torch.randn(*s, generator=gen) for s in ((40, 64), (40,), (9, 64)))  # a partial last block
    y = gemv_rows.linear(x, gemv_rows.block_weight(w), 40, b)
    if not torch.allclose(y, F.linear(x, w, b), rtol=1e-4, atol=1e-4):  # sums of 64 products
        _say_once("the compiled rows kernel disagrees with F.linear")
        return False
    _STATE["usable"]["grid"] = gguf_codes.probe()
    return True


def _probe(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        _say_once("this torch build has no oneDNN")
        return False
    if dtype == torch.bfloat16 and not cpu_features.features().onednn_bf16:  # torch's oneDNN would refuse
        _say_once(f"the oneDNN packed linear is unavailable in {dtype} ({cpu_features.features().lacks('onednn_bf16')})")
        return False
    gen = torch.Generator().manual_seed(0)
    w, b, x = (torch.randn(*s, generator=gen).to(dtype) for s in ((32, 64), (32,), (3, 64)))
    onednn = FORMATS[ONEDNN]
    try:
        y = onednn.linear(x, onednn.pack(w), 32, b)
    except (RuntimeError, AttributeError) as err:  # op missing (AttributeError) or failing
        _say_once(f"the oneDNN packed linear is unavailable in {dtype} ({type(err).__name__}: {err})")
        return False
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # sums of 64 products: far above the rounding
    if not torch.allclose(y.float(), F.linear(x, w, b).float(), rtol=tol, atol=tol):
        _say_once(f"the oneDNN packed linear disagrees with F.linear in {dtype}")
        return False
    return True


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose weight lives in one of format_table's formats, for inference.

    Its interface: ``forward`` (the linear), ``argmax`` (the logits' argmax, or None),
    ``format`` (the table's name), ``weight_key()`` (what identifies the stored weight), and
    ``weight`` / ``bias`` read back as an ``nn.Linear``'s (a fresh plain copy per read of the
    weight; writing to it changes nothing). ``stock`` is the original module (kept outside the
    module tree, so the packed model shows no parameter here); its weight's storage is released
    unless ``shared``."""

    def __init__(self, stock: nn.Linear, packed: torch.Tensor, shared: bool, spec: Spec, mode: str):
        super().__init__()
        object.__setattr__(self, "stock", stock)  # not a submodule: no parameters, no state_dict
        self.in_features, self.out_features = stock.in_features, stock.out_features
        self.packed, self.shared, self.spec, self.mode = packed, shared, spec, mode
        self.dense: torch.Tensor | None = None  # set by the fallback
        self.scratch: dict = {}  # the argmax's copies (an int8 screen, norms), made on first use

    @property
    def format(self) -> str:
        return self.spec.name

    @property
    def layout(self) -> str:
        """ROWS for the compiled kernel's formats, ONEDNN for oneDNN's."""
        return ONEDNN if self.spec.code is None else ROWS

    @property
    def weight(self) -> torch.Tensor:
        return self.dense_weight()

    @property
    def bias(self) -> torch.Tensor | None:
        return self.stock.bias

    def weight_key(self) -> tuple:
        """Identifies the stored weight (a repack changes it): for per-weight caches such as a plan's."""
        return id(self.packed), self.out_features, self.in_features, self.spec.name, self.stock.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        # kept lean: a SmolLM2 step calls ~200 of these. The kernels check dtype, device and
        # shapes themselves: what they refuse (a RuntimeError) takes F.linear from then on.
        if self.dense is None and not (x.requires_grad and torch.is_grad_enabled()):
            try:
                return self.spec.linear(x, self.packed, self.out_features, self.stock.bias)
            except RuntimeError as err:
                _say_once(f"the packed linear failed ({str(err).splitlines()[0]})")
                self.dense = self.dense_weight()
                FALLBACKS[0] += 1
        # autograd (a gradient w.r.t. x through a frozen packed layer) or the fallback
        return F.linear(x, self.dense if self.dense is not None else self.dense_weight(), self.bias)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """``self(x).argmax(-1)`` exactly # [..., K] -> [...] long, through the format's argmax
        (the float32 blocks' int8 screen, the Q8_0 codes' int16 prefilter), or None where it has
        none or it does not apply (a bias, the fallback, not a float32 CPU input, more rows than
        the kernel takes): then take ``self(x).argmax(-1)``."""
        if self.spec.argmax is None or self.dense is not None or self.stock.bias is not None:
            return None
        return self.spec.argmax(x, self.packed, self.out_features, self.scratch)

    def dense_weight(self) -> torch.Tensor:
        """The weight [N, K] in the plain layout, exactly (a reorder or an exact decode)."""
        if self.shared:
            return self.stock.weight.detach()
        return self.spec.dense(self.packed, self.out_features)

    def unpacked(self) -> nn.Linear:
        """The stock module with its dense weight back (the same Parameter objects)."""
        if not self.shared:
            self.stock.weight.data = self.dense_weight()
        return self.stock

    def __deepcopy__(self, memo) -> "PackedLinear":
        stock = copy.deepcopy(self.stock, memo)  # a released weight copies empty; a shared one via memo
        if not self.shared:
            stock.weight.data = self.dense_weight()
        return _packed(stock, self.shared, self.mode)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"packed ({self.spec.name})")


def _formats_for(dtype: torch.dtype, mode: str) -> tuple[str, ...]:
    """The formats a packable weight of ``dtype`` may take under ``mode``, tried in order (the
    last always holds it); empty: no kernel runs here, the layer stays stock."""
    if mode in COMPILED_MODES and dtype == torch.float32 and rows_usable():
        return (*(_narrow(mode) if mode != ROWS_F32 and grids_on() else ()), "f32")
    return (ONEDNN,) if usable(dtype) else ()


def _narrow(mode: str) -> tuple[str, ...]:
    """The narrow formats ``mode`` keeps, narrowest first (ROWS_Q8: Q4_1 read with int8 activations)."""
    return tuple(INT8_ACTIVATIONS.get(name, name) for name in CODES) if mode == ROWS_Q8 else CODES


def _packable(module: nn.Module) -> bool:
    w = module.weight
    return (type(module) is nn.Linear and w.device.type == "cpu" and w.dtype in PACKED_DTYPES
            and w.numel() >= MIN_WEIGHTS and (module.bias is None or module.bias.dtype == w.dtype))


def format_of(module: nn.Module) -> str | None:
    """A packed module's format name (None: not packed)."""
    return module.format if isinstance(module, PackedLinear) else None


def weight_key(module: nn.Module) -> tuple:
    """What identifies a linear's stored weight, packed or not (for per-weight caches)."""
    if isinstance(module, PackedLinear):
        return module.weight_key()
    w = module.weight
    return w.data_ptr(), tuple(w.shape), w.dtype, type(module).__name__


def _packed(stock: nn.Linear, shared: bool, mode: str, codes: Codes | None = None,
            cached: tuple[str, torch.Tensor] | None = None) -> PackedLinear:
    """``stock`` packed in the first format of ``mode`` that holds it (the codes ``codes`` gives for
    its weight first, where ``mode`` keeps codes: read, not searched for), or as ``cached`` (format
    name, packed tensor: read back from pack_cache); its weight's storage released unless
    ``shared`` (the packed copy replaces it)."""
    weight = stock.weight.detach()
    names = _formats_for(weight.dtype, mode)
    if cached is not None:
        name, packed = cached
    elif codes is not None and names[0] == _narrow(mode)[0] and (known := codes(weight)) is not None:
        name, packed = _narrow(mode)[CODES.index(known[0].name.lower())], gguf_codes.pack(*known)
    else:
        for name in names:
            if (packed := FORMATS[name].pack(weight)) is not None:
                break
        else:
            raise RuntimeError(f"no format of {mode} holds a {weight.dtype} weight here")
    layer = PackedLinear(stock, packed, shared, FORMATS[name], mode)
    if not shared:
        stock.weight.data = torch.empty(0, dtype=stock.weight.dtype)
    return layer


def _children(root: nn.Module):
    """(parent, name, child) for every module under ``root``, not descending into peft's LoRA
    layers (their base layer and adapters stay stock) nor into packed ones."""
    for name, child in root.named_children():
        yield root, name, child
        if not hasattr(child, "base_layer") and not isinstance(child, PackedLinear):
            yield from _children(child)


def _weight_counts(root: nn.Module) -> dict[int, int]:
    """How many modules hold each parameter (a tied unembedding shares the embedding's)."""
    counts: dict[int, int] = {}
    for module in root.modules():
        for p in module.parameters(recurse=False):
            counts[id(p)] = counts.get(id(p), 0) + 1
    return counts


class _Cached:
    """One ``pack`` call's compiled-format layers on disk (pack_cache.py): read back where an entry
    holds them all, else stored once packed. Off below ``pack_cache.MIN_CACHED`` weights, for
    oneDNN's layout (an opaque tensor) and for codes whose source has no identity."""

    def __init__(self, children: list[nn.Linear], mode: str, codes: Codes | None):
        self.found, self.key = {}, None  # digest -> (format name, packed tensor); the entry's key
        rows = [c for c in children if mode in COMPILED_MODES and _formats_for(c.weight.dtype, mode)[-1] == "f32"]
        source = getattr(codes, "identity", None) if codes is not None else (lambda: None)
        if not rows or source is None or sum(c.weight.numel() for c in rows) < pack_cache.MIN_CACHED:
            return
        self.digests = {id(c): pack_cache.digest(c.weight) for c in rows}
        setting = {"mode": mode, "grids": grids_on(), "formats": _formats_for(torch.float32, mode), "codes": source(),
                   **pack_cache.layout(gemv_rows.lanes())}
        self.key = pack_cache.entry_key(list(self.digests.values()), setting)
        self.found = pack_cache.load(self.key, list(self.digests.values())) or {}

    def get(self, child: nn.Linear) -> tuple[str, torch.Tensor] | None:
        """(format name, packed tensor) of ``child`` from the entry, or None (pack it)."""
        hit = self.found.get(self.digests[id(child)]) if self.found else None
        return hit if hit and hit[0] in FORMATS and FORMATS[hit[0]].code is not None else None

    def store(self, swapped: dict[int, PackedLinear]) -> None:
        """Write the entry where it was missed and every layer it covers was packed."""
        if self.key is None or self.found or not all(i in swapped for i in self.digests):
            return
        pack_cache.store(self.key, {self.digests[i]: (swapped[i].format, swapped[i].packed) for i in self.digests})


@torch.inference_mode(False)  # decoding packs inside inference mode; the tensors outlive it (training)
def pack(root: nn.Module, mode: str = PACKED, codes: Codes | None = None) -> int:
    """Swap every packable ``nn.Linear`` under ``root`` for a ``PackedLinear`` in the layout
    ``mode`` asks for (``packed``: oneDNN's; ``rows``: the compiled kernel's for float32, GGUF codes
    and 16-bit values kept in their narrow formats; ``rows-q8``: the same, Q4_1 / Q8_0 codes read with
    int8 activations; ``rows-f32``: float32 blocks only); returns
    how many were swapped (none where the ops are unusable). Idempotent. ``codes``: the codes of
    the base's GGUF (gguf_file.py), taken for the weights they rebuild; the others' are searched."""
    found = [(parent, name, child) for parent, name, child in _children(root)
             if type(child) is nn.Linear and _packable(child) and _formats_for(child.weight.dtype, mode)]
    counts = _weight_counts(root) if found else {}
    maps = host_memory.file_maps() if found else []
    mapped = any(any(a <= child.weight.data_ptr() < b for a, b in maps) for _, _, child in found)
    if found:
        status(f"preparing {len(found)} linears")  # read back from the cache, else packed (said next)
    cache = _Cached(list({id(c): c for _, _, c in found}.values()), mode, codes)
    if found and not cache.found:
        status(f"packing {len(found)} linears" + (" (kept for the next runs)" if cache.key else ""))
    swapped: dict[int, PackedLinear] = {}  # a module held by two parents is packed once
    for parent, name, child in found:
        if id(child) not in swapped:
            try:
                swapped[id(child)] = _packed(child, counts[id(child.weight)] > 1, mode, codes, cache.get(child))
            except RuntimeError as err:  # this one stays stock
                _say_once(f"a weight {tuple(child.weight.shape)} could not be packed ({err})")
                continue
        setattr(parent, name, swapped[id(child)])
    cache.store(swapped)
    if mapped:
        host_memory.own_copies(root, maps)
    if swapped:
        host_memory.trim_heap()
    return len(swapped)


@torch.inference_mode(False)
def unpack(root: nn.Module) -> int:
    """Put every ``PackedLinear`` under ``root`` back as its stock ``nn.Linear`` (the same
    module and Parameter objects, the weight values exactly as before); returns how many."""
    found = [(parent, name, child) for parent, name, child in _children(root) if isinstance(child, PackedLinear)]
    for parent, name, child in found:
        setattr(parent, name, child.unpacked())
    return len(found)


def prepare(root: nn.Module, mode: str, codes: Codes | None = None) -> int:
    """The linears ``mode`` asks for (one of ``CPU_LINEARS``); returns how
    many are packed (``codes``: as ``pack``'s). Layers packed for another mode are unpacked first."""
    if mode not in CPU_LINEARS:
        raise ValueError(f"unknown CPU linear {mode!r}: one of {', '.join(CPU_LINEARS)}")
    if mode == STOCK or any(m.mode != mode for m in root.modules() if isinstance(m, PackedLinear)):
        unpack(root)
    if mode == STOCK:
        return 0
    pack(root, mode, codes)
    return sum(isinstance(m, PackedLinear) for m in root.modules())
