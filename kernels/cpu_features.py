"""The capability probe: which CPU features the fast CPU paths find here, asked in one place by
the code (gemv_rows.py's build, cpu_linear.py's oneDNN bf16 choice) and by the tests.

What each fast path needs, and what other CPUs get instead:

- the rows kernel's 512-bit blocks (32 outputs, 12 rows in registers): AVX512F; with AVX2 + FMA
  its 256-bit blocks (16 outputs, 4 rows); without AVX2 plain loops (16 outputs);
- the int16 argmax prefilter of Q8_0 codes (argmax_prefilter.cpp): AVX512-VNNI (with
  AVX512BW); without it greedy steps take the argmax of the codes' logits;
- oneDNN's packed bfloat16 linear: what torch's oneDNN says it runs (AVX512 BW, VL and DQ, or
  AVX-NE-CONVERT); without it bfloat16 layers keep ``F.linear``, said once on stderr;
- bfloat16 arithmetic in hardware (AVX512-BF16's dot products, or AMX-BF16's tiles), which
  makes a bfloat16 matmul cheaper than a float32 one: training's ``--compute-dtype auto`` runs
  under bfloat16 autocast only there (elsewhere oneDNN emulates bfloat16 by conversions, at no gain).

``MULTITOKEN_CPU_FEATURES`` (read here, once per process) makes this machine answer as a
smaller CPU would, so that one machine tests every CPU's paths (``.ci/run``):

- unset or ``native``: this CPU's own features;
- ``avx512``: no AVX512-VNNI, no AVX512-BF16 / AMX (an Intel Skylake-SP);
- ``avx2``: no AVX512 at all (AMD Zen 1-3, Intel Haswell to Comet Lake): no VNNI screen, no
  oneDNN bfloat16;
- ``plain``: no AVX2 / FMA either (the kernel's plain loops).

A level only takes features away. Where it is set the code takes those CPUs' paths for real: the
kernel is compiled with the instructions above the level turned off (``kernel_flags``, a cache
entry of its own), oneDNN's bfloat16 linear is not used below ``avx512``, and oneDNN itself is
capped at the level (``ONEDNN_MAX_CPU_ISA``, set here unless already set; it takes effect where
oneDNN has not started yet in this process, as when this module is imported before any linear
runs). bitsandbytes' 4-bit kernel keeps its own detection (quantization.py).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch

from multitoken.base.errors import UsageError

ENV = "MULTITOKEN_CPU_FEATURES"
NATIVE = "native"
# level -> (rank, the compiler flags that turn off what is above it, oneDNN's ISA cap)
LEVELS = {
    "plain": (0, ["-mno-avx512f", "-mno-avx2", "-mno-fma"], "AVX"),
    "avx2": (1, ["-mno-avx512f"], "AVX2"),
    "avx512": (2, ["-mno-avx512vnni", "-mno-avx512bf16"], "AVX512_CORE"),
    NATIVE: (3, [], None),
}


def level() -> str:
    """The level ``MULTITOKEN_CPU_FEATURES`` sets (``native`` where unset or empty)."""
    value = os.environ.get(ENV, "").strip().lower() or NATIVE
    if value not in LEVELS:
        raise UsageError(f"{ENV}={os.environ[ENV]!r} is not a CPU level",
                         f"set it to one of {', '.join(LEVELS)}, or unset it")
    return value


def forced() -> bool:
    return level() != NATIVE


def cpu_flags() -> str:
    """The CPU's feature flags line (Linux ``/proc/cpuinfo``; elsewhere the processor's name)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


@dataclass(frozen=True)
class Features:
    """What the fast paths find here, the setting applied."""

    level: str  # the setting's level (``native`` unless forced)
    avx2: bool  # AVX2 + FMA: the kernel's 256-bit blocks
    avx512: bool  # AVX512F: the kernel's 512-bit blocks
    vnni: bool  # AVX512-VNNI + AVX512BW: the Q8_0 codes' int16 argmax screen
    onednn_bf16: bool  # oneDNN's bfloat16 linear
    native_bf16: bool  # bfloat16 dot products in hardware (AVX512-BF16 or AMX-BF16)

    def lanes(self) -> int:
        """The rows kernel's outputs per column block on such a CPU."""
        return 32 if self.avx512 else 16

    def lacks(self, feature: str) -> str:
        """Why ``feature`` (a field) is off here, in words for a one-line notice."""
        need = {"avx2": "AVX2 and FMA", "avx512": "AVX512F", "vnni": "AVX512-VNNI",
                "onednn_bf16": "AVX512 (BW, VL, DQ) or AVX-NE-CONVERT", "native_bf16": "AVX512-BF16 or AMX-BF16"}[feature]
        if self.level != NATIVE:
            return f"needs {need}; {ENV}={self.level} reports a CPU below it"
        if feature == "onednn_bf16" and os.environ.get("ONEDNN_MAX_CPU_ISA"):
            return f"needs {need}; ONEDNN_MAX_CPU_ISA={os.environ['ONEDNN_MAX_CPU_ISA']} caps oneDNN below it"
        return f"needs {need}, which this CPU lacks"


_CACHE: dict[str, Features] = {}


def features() -> Features:
    """This machine's features under the setting (once per process and level)."""
    name = level()
    if name not in _CACHE:
        rank = LEVELS[name][0]
        have = set(cpu_flags().split())
        if not have:  # no /proc/cpuinfo: torch's own dispatch level
            have = {"AVX512": {"avx2", "fma", "avx512f"}, "AVX2": {"avx2", "fma"}}.get(_aten_capability(), set())
        avx2 = rank >= 1 and {"avx2", "fma"} <= have
        avx512 = rank >= 2 and "avx512f" in have
        vnni = rank >= 3 and {"avx512f", "avx512bw", "avx512_vnni"} <= have
        native_bf16 = rank >= 3 and ("avx512_bf16" in have or "amx_bf16" in have)
        onednn = rank >= 2 and _onednn_bf16()
        _CACHE[name] = Features(name, avx2, avx512, vnni, onednn, native_bf16 and onednn)
    return _CACHE[name]


def kernel_flags() -> list[str]:
    """The compiler's instruction-set flags for the rows kernel under the setting."""
    base = ["-march=native"]
    return base + (["-mprefer-vector-width=512"] if level() in ("avx512", NATIVE) else []) + LEVELS[level()][1]


def _onednn_bf16() -> bool:
    """torch's own answer: whether its oneDNN runs bfloat16 on this CPU (at its ISA cap)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without the query: the CPU's flags, as torch checks them
        have = set(cpu_flags().split())
        return {"avx512bw", "avx512vl", "avx512dq"} <= have or "avx_ne_convert" in have


def _aten_capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return ""


def _cap_onednn() -> None:
    """oneDNN at the level's ISA, unless the user capped it (read when oneDNN first starts)."""
    try:
        cap = LEVELS[level()][2]
    except UsageError:  # said when the features are first asked for
        return
    if cap is not None:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", cap)


_cap_onednn()
