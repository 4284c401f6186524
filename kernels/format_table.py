"""The table of weight formats: per format, how a float weight is packed into it, the fast
linear and argmax that read it, and the plain reference they are tested against
(tests/kernels/test_format_table.py runs every test over every entry).

``FORMATS`` maps a name to a ``Spec``. The compiled ones (``code``: formats.Format, read by
ops.cpp) keep the exactness contract (docs/kernels.md): a row's logits are bit-identical whatever
the row count, and the exact narrow formats' logits bit-identical to the float32 blocks' of the
same weights. ``q4_1_q8`` and ``q8_0_q8`` (the ``rows-q8`` setting, gemv_int8.cpp) are not exact by
design: they read Q4_1's and Q8_0's codes with the rows put on an int8 grid first, as llama.cpp
does; their rows still do not depend on the row count. ``onednn`` is torch's own prepacked linear
(fp32 rows exact across row counts; bf16 within rounding). To add a format: a Format value, its kernel in gemv_rows.cpp and its case in
ops.cpp, then an entry here; the parametrised tests take it from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from multitoken.kernels import gemv_rows, gguf_codes
from multitoken.kernels.formats import Format

ROW_HINT = 16  # oneDNN's layout is chosen for this many rows; any hint >= 2 serves every row count


@dataclass(frozen=True)
class Spec:
    """One weight format. ``pack(weight [N, K])`` -> the packed tensor, or None where the weight's
    values are not exactly this format's; ``linear(x [..., K], packed, n, bias)`` -> [..., N];
    ``argmax(x, packed, n, scratch)`` -> [...] long, exactly ``linear(...).argmax(-1)``, or None
    where it does not apply (``scratch``: a dict the layer keeps, for copies made on first use);
    ``dense(packed, n)`` -> the weight [N, K] back, exactly, in plain torch."""

    name: str
    code: Format | None  # the compiled kernel's format; None: oneDNN's
    pack: Callable[[torch.Tensor], torch.Tensor | None]
    linear: Callable[..., torch.Tensor]
    argmax: Callable[..., torch.Tensor | None] | None
    dense: Callable[[torch.Tensor, int], torch.Tensor]
    exact: bool = True  # False: the rows go onto int8 grids first (INT8_ACTIVATIONS), within their error

    def reference(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The plain reference # [..., K] -> [..., N] float64: the decoded weight times x, exact
        to float64 (the fast linear must lie within its float32 chain's rounding of it)."""
        b = None if bias is None else bias.double()
        return F.linear(x.double(), self.dense(packed, n).double(), b)


def _float_rows(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu"


def _f32_pack(weight: torch.Tensor) -> torch.Tensor | None:
    return gemv_rows.block_weight(weight) if weight.dtype == torch.float32 else None


def _f32_argmax(x, packed, n, scratch):
    """The int8 screen (gemv_rows.screen_weight, made on first use): exact, at a quarter of the reads."""
    if not _float_rows(x):
        return None
    if "screen" not in scratch:
        scratch["screen"] = gemv_rows.screen_weight(packed)
    found = gemv_rows.argmax(x, packed, scratch["screen"], n)
    return None if found is None else found[0]


def _codes(kind: Format, read: Format | None = None) -> Spec:
    """The entry of GGUF codes ``kind``, read by the kernel of ``read`` (another kernel on the
    same bytes: Q4_1_Q8, Q8_0_Q8), else its own."""
    read = kind if read is None else read

    def pack(weight):
        parts = gguf_codes.codes_in(weight, kind)
        return None if parts is None else gguf_codes.pack(kind, parts)

    def linear(x, packed, n, bias):
        return gguf_codes.linear(x, packed, read, n, bias)

    def argmax(x, packed, n, scratch):
        """Q8_0: the int16 prefilter where built; every narrow format: the logits' argmax (never
        a dense copy)."""
        if not _float_rows(x):
            return None
        if read == Format.Q8_0 and gguf_codes.prefilter_built():
            if "l1" not in scratch:
                scratch["l1"] = gguf_codes.l1_norms(packed, n)
            if (found := gguf_codes.q8_argmax(x, packed, n, scratch["l1"])) is not None:
                return found
        return linear(x, packed, n, None).argmax(-1)

    return Spec(read.name.lower(), read, pack, linear, argmax, lambda packed, n: gguf_codes.dense(packed, kind, n),
                exact=read == kind)


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROW_HINT)


def _onednn_linear(x, packed, n, bias):
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # [..., K] -> [..., N]


FORMATS: dict[str, Spec] = {
    "f32": Spec("f32", Format.F32, _f32_pack, gemv_rows.linear, _f32_argmax, gemv_rows.dense_weight),
    **{kind.name.lower(): _codes(kind) for kind in (Format.Q4_1, Format.Q8_0, Format.BF16, Format.F16)},
    "q4_1_q8": _codes(Format.Q4_1, Format.Q4_1_Q8),
    "q8_0_q8": _codes(Format.Q8_0, Format.Q8_0_Q8),
    "onednn": Spec("onednn", None, _onednn_pack, _onednn_linear, None, lambda packed, n: packed.to_dense()),
}
CODES = ("q4_1", "q8_0", "bf16", "f16")  # the narrow formats, narrowest first: a weight takes the first that holds it
# The formats the int8-activation setting (cpu_linear.ROWS_Q8) reads in place of exact ones.
INT8_ACTIVATIONS = {"q4_1": "q4_1_q8", "q8_0": "q8_0_q8"}
