"""The weight formats the CPU kernels read: one enum, the single source of their values.

The compiled ops (ops.cpp) get these values at build time as ``-DMT_FORMAT_<NAME>=<value>``
(gemv_rows.py), so no number is written twice; an unknown value is an error in both languages
(``Format(value)`` raises here, ``TORCH_CHECK`` there). format_table.py gives each format its
``pack``, ``linear``, ``argmax`` and plain reference.

Layouts, per column block of ``L`` outputs (``L``: the build's lanes, 32 with AVX512F, else 16):

- ``F32``: float32 ``[ceil(N / L), K, L]``, zero-padded past N;
- ``BF16`` / ``F16``: the same blocks in 16-bit floats, as bytes ``[B, K, 2L]``;
- ``Q4_1`` / ``Q8_0``: GGUF's codes per chunk of ``QK`` inputs ``[B, K / QK, bytes]``: d ``[L]``
  float16, (Q4_1) m ``[L]`` float16, then the codes (Q4_1: per input L / 2 bytes, output j in
  byte j's low nibble and j + L / 2 in its high one; Q8_0: L int8).
"""

from __future__ import annotations

import enum

QK = 32  # inputs per GGUF Q4_1 / Q8_0 block


class Format(enum.IntEnum):
    """A compiled kernel's weight format (the value is what ops.cpp receives)."""

    F32 = 0  # float32 column blocks
    Q4_1 = 1  # GGUF Q4_1 codes: w = d q + m, q in 0..15, d and m float16 per QK inputs
    Q8_0 = 2  # GGUF Q8_0 codes: w = d q, q in -127..127, d float16 per QK inputs
    BF16 = 3  # bfloat16 values in the float blocks' layout
    F16 = 4  # float16 values in the float blocks' layout
    Q4_1_Q8 = 5  # Q4_1's codes and layout, read with int8 activations (ggml's Q8_1 grid): not exact
    Q8_0_Q8 = 6  # Q8_0's codes and layout, read with int8 activations: not exact


def parse(value: int | Format) -> Format:
    """``value`` as a Format; an unknown one is a ValueError naming the known ones."""
    try:
        return Format(value)
    except ValueError:
        raise ValueError(f"unknown weight format {value!r}: the kernels read "
                         f"{', '.join(f'{f.name}={f.value}' for f in Format)}") from None


def defines() -> list[str]:
    """The compiler flags that hand the values to ops.cpp."""
    return [f"-DMT_FORMAT_{f.name}={f.value}" for f in Format]


NARROW = {Format.Q4_1: "Q4_1", Format.Q8_0: "Q8_0", Format.BF16: "bfloat16", Format.F16: "float16"}
