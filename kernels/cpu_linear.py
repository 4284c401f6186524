"""Prepacked CPU linears for decoding: a step over 2-16 tokens reads each weight once, as a one-token step does.

Two layouts: oneDNN's blocked one (``--cpu-linear packed``) and the column blocks of our own
compiled multi-row GEMV (``--cpu-linear rows``, float32, rows_kernel.py: built with the machine's
C++ compiler on first use; where it cannot be, those layers take oneDNN's layout; a weight that is
exactly a GGUF's Q4_1 / Q8_0 codes or 16-bit floats keeps those codes, grid_weights.py). What follows
holds for both; the rows kernel's one-row step runs at MKL's GEMV rate, oneDNN's does not.

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
(SmolLM2, pythia-160m and up) the same logits whatever the row count; one copy of the weights; at a measured 10-15% over MKL's fp32 GEMV (README,
Benchmarks). A packed layer keeps its device and dtype: move or cast a model before it decodes,
or after ``train()``.
"""

from __future__ import annotations

import copy
import ctypes
import sys

import torch
import torch.nn.functional as F
from torch import nn

from multitoken.kernels import cpu_features, grid_weights, rows_kernel

PACKED, ROWS, STOCK = "packed", "rows", "stock"
ROWS_F32 = "rows-f32"  # the rows kernel on float32 blocks only: GGUF codes not kept (what they are worth)
CPU_LINEARS = (PACKED, ROWS, ROWS_F32, STOCK)
ONEDNN = "onednn"  # the layout of a PACKED layer (and of a ROWS model's bf16 layers)
PACKED_DTYPES = (torch.float32, torch.bfloat16)
# Smallest weight packed (elements). oneDNN spends ~15 us per call (measured on a [64, 64] layer:
# 17 us against F.linear's 2 us), about what reading 100k fp32 weights from memory takes: below
# that a layer is call overhead either way (a stories260K step took 1.4-1.9x longer packed).
MIN_WEIGHTS = 100_000
# Rows the layout is chosen for: any hint >= 2 gives oneDNN's blocked layout (1 keeps the plain
# one), and that layout serves every row count without a reorder.
ROW_HINT = 16

_STATE: dict = {"usable": {}, "warned": False}  # usable: dtype -> bool, probed once per process


def grids_on() -> bool:
    """Whether the rows layout can keep weights found on a Q4_1 / Q8_0 grid as their codes here
    (grid_weights.py; exact, so ``rows`` does; ``rows-f32`` keeps float32 blocks, to measure)."""
    return rows_usable() and _STATE["usable"].get("grid", False)


def _say_once(message: str) -> None:
    if not _STATE["warned"]:
        _STATE["warned"] = True
        print(f"multitoken: {message}; CPU linears fall back to F.linear", file=sys.stderr)


def _reorder(weight: torch.Tensor, layout: str = ONEDNN, grids: bool = True) -> tuple[torch.Tensor, int | None]:
    """The weight [N, K] in oneDNN's blocked layout (an opaque mkldnn tensor), or in the rows
    kernel's: its grid codes where it lies on a Q4_1 / Q8_0 grid (grid_weights.py; the kind
    second), else column blocks [N / L, K, L] (rows_kernel.py)."""
    if layout == ROWS:
        found = grid_weights.find_grid(weight.detach()) if grids and grids_on() else None
        if found is not None:
            return grid_weights.pack_grid(*found), found[0]
        return rows_kernel.block_weight(weight), None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROW_HINT), None


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # [..., K] -> [..., N]


def usable(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build runs the packed ops in ``dtype`` and they agree with
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
    if rows_kernel.library() is None:
        return False  # said on stderr by rows_kernel
    gen = torch.Generator().manual_seed(0)
    w, b, x = (torch.randn(*s, generator=gen) for s in ((40, 64), (40,), (9, 64)))  # a partial last block
    y = rows_kernel.rows_linear(x, rows_kernel.block_weight(w), 40, b)
    if not torch.allclose(y, F.linear(x, w, b), rtol=1e-4, atol=1e-4):  # sums of 64 products
        _say_once("the compiled rows kernel disagrees with F.linear")
        return False
    _STATE["usable"]["grid"] = grid_weights.probe()
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
    try:
        y = _packed_linear(x, _reorder(w)[0], b)
    except (RuntimeError, AttributeError) as err:  # op missing (AttributeError) or failing
        _say_once(f"the oneDNN packed linear is unavailable in {dtype} ({type(err).__name__}: {err})")
        return False
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # sums of 64 products: far above the rounding
    if not torch.allclose(y.float(), F.linear(x, w, b).float(), rtol=tol, atol=tol):
        _say_once(f"the oneDNN packed linear disagrees with F.linear in {dtype}")
        return False
    return True


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose weight lives in oneDNN's blocked layout or the rows kernel's column
    blocks (``layout``), for inference.

    ``stock`` is the original module (kept outside the module tree, so the packed model shows
    no parameter here); its weight's storage is released unless ``shared``. ``packed`` is the
    opaque oneDNN tensor (ONEDNN) or the [N / L, K, L] blocks (ROWS); ``weight`` reads the values
    back in the plain layout (a fresh copy per read, for code that inspects weights; writing to
    it changes nothing)."""

    def __init__(self, stock: nn.Linear, packed: torch.Tensor, shared: bool, layout: str = ONEDNN, grid: int | None = None,
                 grids: bool = True):
        super().__init__()
        object.__setattr__(self, "stock", stock)  # not a submodule: no parameters, no state_dict
        self.in_features, self.out_features = stock.in_features, stock.out_features
        self.packed, self.shared, self.layout, self.grid = packed, shared, layout, grid
        self.grids = grids  # whether codes were looked for (``rows``), or float32 blocks kept (``rows-f32``)
        self.dense: torch.Tensor | None = None  # set by the fallback
        self.screen: dict | None = None  # the argmax screen's int8 copy (rows layout), made on first use

    @property
    def weight(self) -> torch.Tensor:
        return self.dense_weight()

    @property
    def bias(self) -> torch.Tensor | None:
        return self.stock.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        # kept lean: a SmolLM2 step calls ~200 of these, and each microsecond here is 0.2 ms a step
        if self.dense is None and not (x.requires_grad and torch.is_grad_enabled()):
            bias = self.stock.bias
            try:
                if self.layout == ROWS:
                    if x.dtype == torch.float32 and x.is_cpu:
                        if self.grid:
                            return grid_weights.grid_linear(x, self.packed, self.grid, self.out_features, bias)
                        return rows_kernel.rows_linear(x, self.packed, self.out_features, bias)
                    raise RuntimeError(f"the rows kernel takes float32 CPU inputs, not {x.dtype} on {x.device.type}")
                return _packed_linear(x, self.packed, bias)
            except RuntimeError as err:
                _say_once(f"the packed linear failed ({err})")
                self.dense = self.dense_weight()
        # autograd (a gradient w.r.t. x through a frozen packed layer) or the fallback
        return F.linear(x, self.dense if self.dense is not None else self.dense_weight(), self.bias)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """``self(x).argmax(-1)`` exactly # [..., K] -> [...] long, reading the weight mostly from
        an int8 copy (rows_kernel.rows_argmax; made on first use, a quarter of the fp32 blocks'
        size), or None where that does not apply (not the rows layout, a bias, not a float32 CPU
        input, more rows than the kernel takes): then take ``self(x).argmax(-1)``. Q8_0 grid codes
        (a GGUF's unembedding) are screened by int16 dot products (grid_screen.cpp, where the
        kernel was built with AVX512-VNNI: only there is the screen's bound made), other codes
        give the logits' argmax directly."""
        if self.grid and self.dense is None and x.dtype == torch.float32 and x.device.type == "cpu":
            if self.grid == grid_weights.Q8 and self.bias is None and grid_weights.screen_built():
                if self.screen is None:
                    self.screen = {"l1": grid_weights.grid_l1(self.packed, self.out_features)}
                found = grid_weights.grid_argmax(x, self.packed, self.out_features, self.screen["l1"])
                if found is not None:
                    return found
            return self(x).argmax(-1)
        if (self.grid or self.layout != ROWS or self.dense is not None or self.bias is not None
                or x.dtype != torch.float32 or x.device.type != "cpu"):
            return None
        if self.screen is None:
            self.screen = rows_kernel.screen_weight(self.packed)
        found = rows_kernel.rows_argmax(x, self.packed, self.screen, self.out_features)
        return None if found is None else found[0]

    def dense_weight(self) -> torch.Tensor:
        """The weight [N, K] in the plain layout, exactly (a reorder, no arithmetic)."""
        if self.shared:
            return self.stock.weight.detach()
        if self.grid:
            return grid_weights.dense_grid(self.packed, self.grid, self.out_features)
        return rows_kernel.dense_weight(self.packed, self.out_features) if self.layout == ROWS else self.packed.to_dense()

    def unpacked(self) -> nn.Linear:
        """The stock module with its dense weight back (the same Parameter objects)."""
        if not self.shared:
            self.stock.weight.data = self.dense_weight()
        return self.stock

    def __deepcopy__(self, memo) -> "PackedLinear":
        stock = copy.deepcopy(self.stock, memo)  # a released weight copies empty; a shared one via memo
        if not self.shared:
            stock.weight.data = self.dense_weight()
        return _packed(stock, self.shared, self.layout, self.grids)

    def extra_repr(self) -> str:
        grid = f", {grid_weights.NAMES[self.grid]} grid" if self.grid else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"packed ({self.layout}{grid})")


def _layout(module: nn.Module, mode: str) -> str | None:
    """The layout ``mode`` packs ``module`` in, or None where it stays stock: ROWS for float32
    weights where the compiled kernel runs (``rows``), else oneDNN's where it runs."""
    w = module.weight
    if not (type(module) is nn.Linear and w.device.type == "cpu" and w.dtype in PACKED_DTYPES
            and w.numel() >= MIN_WEIGHTS and (module.bias is None or module.bias.dtype == w.dtype)):
        return None
    return _layout_for(w.dtype, mode)


def _layout_for(dtype: torch.dtype, mode: str) -> str | None:
    """The layout a packable weight of ``dtype`` takes under ``mode`` (None: no kernel runs here)."""
    if mode in (ROWS, ROWS_F32) and dtype == torch.float32 and rows_usable():
        return ROWS
    return ONEDNN if usable(dtype) else None


def layout_of(module: nn.Module) -> str | None:
    """A packed module's layout (None: not packed)."""
    return module.layout if isinstance(module, PackedLinear) else None


def _packed(stock: nn.Linear, shared: bool, layout: str = ONEDNN, grids: bool = True) -> PackedLinear:
    """``stock`` packed; its weight's storage released unless ``shared`` (the packed copy replaces it)."""
    packed, grid = _reorder(stock.weight, layout, grids)
    packed = PackedLinear(stock, packed, shared, layout, grid, grids)
    if not shared:
        stock.weight.data = torch.empty(0, dtype=stock.weight.dtype)
    return packed


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


def _file_maps() -> list[tuple[int, int]]:
    """Address ranges of this process's file-backed memory maps (Linux; none elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    fields = [line.split() for line in lines]
    return [tuple(int(a, 16) for a in f[0].split("-")) for f in fields if len(f) >= 6 and f[4] != "0"]


def _own_copies(root: nn.Module, maps: list[tuple[int, int]]) -> None:
    """Copy every parameter and buffer under ``root`` that lives in a file map into memory of
    its own. transformers may load a checkpoint as one copy-on-write map of its file, which
    stays (and stays resident once the packing read it) while any tensor points into it: the
    released dense weights would free nothing."""
    for t in [*root.parameters(), *root.buffers()]:
        ptr = t.data_ptr() if t.numel() else 0
        if any(a <= ptr < b for a, b in maps):
            t.data = t.data.clone()


def _trim_heap() -> None:
    """Give the released dense weights' pages back to the OS: glibc keeps freed heap memory
    mapped (and counted in RSS) below live allocations, such as the packed copies made after."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator returns memory its own way
        return


@torch.inference_mode(False)  # decoding packs inside inference mode; the tensors outlive it (training)
def pack(root: nn.Module, mode: str = PACKED) -> int:
    """Swap every packable ``nn.Linear`` under ``root`` for a ``PackedLinear`` in the layout
    ``mode`` asks for (``packed``: oneDNN's; ``rows``: the compiled kernel's for float32, GGUF codes
    kept as codes; ``rows-f32``: the same on float32 blocks only); returns
    how many were swapped (none where the ops are unusable). Idempotent."""
    found = [(parent, name, child, layout) for parent, name, child in _children(root)
             if type(child) is nn.Linear and (layout := _layout(child, mode)) is not None]
    counts = _weight_counts(root) if found else {}
    maps = _file_maps() if found else []
    mapped = any(any(a <= child.weight.data_ptr() < b for a, b in maps) for _, _, child, _ in found)
    swapped: dict[int, PackedLinear] = {}  # a module held by two parents is packed once
    for parent, name, child, layout in found:
        if id(child) not in swapped:
            try:
                swapped[id(child)] = _packed(child, counts[id(child.weight)] > 1, layout, mode != ROWS_F32)
            except RuntimeError as err:  # this one stays stock
                _say_once(f"a weight {tuple(child.weight.shape)} could not be packed ({err})")
                continue
        setattr(parent, name, swapped[id(child)])
    if mapped:
        _own_copies(root, maps)
    if swapped:
        _trim_heap()
    return len(swapped)


@torch.inference_mode(False)
def unpack(root: nn.Module) -> int:
    """Put every ``PackedLinear`` under ``root`` back as its stock ``nn.Linear`` (the same
    module and Parameter objects, the weight values exactly as before); returns how many."""
    found = [(parent, name, child) for parent, name, child in _children(root) if isinstance(child, PackedLinear)]
    for parent, name, child in found:
        setattr(parent, name, child.unpacked())
    return len(found)


def prepare(root: nn.Module, mode: str) -> int:
    """The linears ``mode`` asks for (``packed``, ``rows``, ``rows-f32`` or ``stock``); returns how
    many are packed. Layers packed for another mode are unpacked first."""
    packed = [m for m in root.modules() if isinstance(m, PackedLinear)]
    if mode == STOCK or any(m.layout != _layout_for(m.stock.weight.dtype, mode)  # dtype kept in stock
                            or m.grids != (mode != ROWS_F32) for m in packed):
        unpack(root)
    if mode == STOCK:
        return 0
    pack(root, mode)
    return sum(isinstance(m, PackedLinear) for m in root.modules())
