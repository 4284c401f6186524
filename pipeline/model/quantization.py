"""Which Linear layers bitsandbytes can quantize on the target device, decided before loading.

Read from bitsandbytes 0.50's CPU backend (``nn/modules.py``, ``functional.py``,
``backends/cpu/ops.py``, ``backends/default/ops.py`` and its C kernels):

- 8-bit (``Linear8bitLt``): row-wise int8 quantization, then ``torch._int_mm`` (CPUs with
  AVX512) or dequantize + matmul. Any shape.
- 4-bit on a CPU without AVX512-BF16, or while the layer trains: the weight is quantized and
  dequantized in blocks of 64 over the flattened [N * K] tensor, then a float matmul. Any shape.
- 4-bit on a CPU with AVX512-BF16, in eval mode on inputs that need no gradient (generation,
  evaluation): ``Linear4bit.forward`` repacks the weight for the fused ``gemv_4bit`` kernel
  (``functional._convert_weight_packed_for_cpu``). It needs out_features N to be a multiple of
  32 (``block_n``; the C kernel aborts the process on a partial block of columns) and
  in_features K a multiple of the quantization blocksize 64 (the absmax vector is reshaped to
  [N, K // 64]: a 32-wide layer fails with "shape '[96, 0]' is invalid", a 172-wide one with
  "N must be divisible by block_n").

Layers a kernel cannot take stay in float (transformers' ``llm_int8_skip_modules``, which both
bitsandbytes quantizers honour); the caller says which.
"""

from __future__ import annotations

import logging
import re
import sys
from dataclasses import dataclass, field

import torch
from torch import nn

from multitoken.base.errors import UsageError

PACKED_BLOCK_N = 32  # bitsandbytes functional._convert_weight_packed_for_cpu(block_n=32)
BLOCKSIZE_4BIT = 64  # bitsandbytes Params4bit default blocksize (transformers keeps it)


def packed_cpu_4bit(device: str) -> bool:
    """Does 4-bit inference on ``device`` take bitsandbytes' AVX512-BF16 packed kernel?"""
    if torch.device(device).type != "cpu":
        return False
    # Importing bitsandbytes on such a CPU logs a warning that the optional `kernels` package is
    # missing (it then uses its own C kernel, same constraints): not the user's concern.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    from bitsandbytes.functional import has_avx512bf16

    return bool(has_avx512bf16())


def fits_4bit(out_features: int, in_features: int, packed: bool) -> bool:
    """Can a [out, in] Linear run 4-bit (``packed``: on the AVX512-BF16 CPU kernel)?"""
    return not packed or (out_features % PACKED_BLOCK_N == 0 and in_features % BLOCKSIZE_4BIT == 0)


@dataclass
class QuantizedLayers:
    """The Linear layers to quantize and those left in float, by module name."""

    quantized: list[str] = field(default_factory=list)
    left_float: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (out, in)
    default_skips: list[str] = field(default_factory=list)  # output embeddings: always float

    def skip_modules(self) -> list[str] | None:
        """``llm_int8_skip_modules`` (exact names); None keeps transformers' default choice."""
        if not self.left_float:
            return None
        return [re.escape(n) for n in [*self.default_skips, *self.left_float]]

    def note(self, quantization: str) -> str:
        """One line naming the layers left in float and why."""
        groups = sorted({re.sub(r"\.\d+\.", ".*.", n) for n in self.left_float})
        total = len(self.quantized) + len(self.left_float)
        return (f"note: {quantization} on this CPU (bitsandbytes' AVX512-BF16 kernel) needs out_features % "
                f"{PACKED_BLOCK_N} == 0 and in_features % {BLOCKSIZE_4BIT} == 0; {len(self.left_float)} of "
                f"{total} linear layers stay in float: {', '.join(groups)}")


def quantized_layers(model_config, quantization: str, device: str, packed: bool | None = None) -> QuantizedLayers:
    """Which Linear layers of a model with ``model_config`` fit the kernels of ``device``
    (``packed``: assume that CPU kernel is taken or not, instead of asking this machine).

    Shapes come from the model built on the meta device (no memory, no weights read).
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, trust_remote_code=False)
    output = model.get_output_embeddings()
    result = QuantizedLayers(default_skips=[n for n, m in model.named_modules() if m is output])
    if packed is None:
        packed = packed_cpu_4bit(device)
    packed = packed and quantization == "4bit"
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module is output:
            continue
        if fits_4bit(module.out_features, module.in_features, packed):
            result.quantized.append(name)
        else:
            result.left_float[name] = (module.out_features, module.in_features)
    return result


def checked_quantized_layers(model_config, quantization: str, device: str, base: str) -> QuantizedLayers:
    """``quantized_layers``, printing one note when some layers stay in float, refusing when none fits."""
    result = quantized_layers(model_config, quantization, device)
    if not result.quantized:
        shapes = sorted({f"{o}x{i}" for o, i in result.left_float.values()})
        raise UsageError(
            f"{quantization} quantization fits none of {base!r}'s linear layers on this CPU (out x in: "
            f"{', '.join(shapes)}; bitsandbytes' AVX512-BF16 kernel needs out % {PACKED_BLOCK_N} == 0 and "
            f"in % {BLOCKSIZE_4BIT} == 0)",
            "drop --quantization, or use --quantization 8bit",
        )
    if result.left_float:
        print(result.note(quantization), file=sys.stderr)
    return result
