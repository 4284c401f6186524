"""The capability probe (kernels/cpu_features.py): ``MULTITOKEN_CPU_FEATURES`` only takes
features away, names its fix when misspelt, turns the kernel's instructions off and caps oneDNN,
so that a forced run takes the smaller CPU's paths."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from multitoken.base.errors import UsageError
from multitoken.kernels import cpu_features

FIELDS = ("avx2", "avx512", "vnni", "onednn_bf16", "native_bf16")


def test_levels_only_take_features_away(monkeypatch):
    monkeypatch.setenv(cpu_features.ENV, "native")
    native = cpu_features.features()
    seen = {}
    for level in ("plain", "avx2", "avx512"):
        monkeypatch.setenv(cpu_features.ENV, level)
        seen[level] = cpu_features.features()
        assert seen[level].level == level and cpu_features.forced()
        assert all(getattr(native, f) or not getattr(seen[level], f) for f in FIELDS), level
    assert not any(getattr(seen["plain"], f) for f in FIELDS)
    assert not (seen["avx2"].avx512 or seen["avx2"].vnni or seen["avx2"].onednn_bf16) and seen["avx2"].lanes() == 16
    assert not seen["avx512"].vnni and seen["avx512"].avx512 == native.avx512
    assert not seen["avx512"].native_bf16 and "-mno-avx512bf16" in cpu_features.LEVELS["avx512"][1]  # a Skylake-SP
    flags = set(cpu_features.cpu_flags().split())
    assert native.native_bf16 == (native.onednn_bf16 and bool(flags & {"avx512_bf16", "amx_bf16"}))
    assert "-mno-avx512f" in cpu_features.LEVELS["avx2"][1] and "-mno-avx512vnni" in cpu_features.LEVELS["avx512"][1]
    assert seen["avx512"].lacks("vnni") == "needs AVX512-VNNI; MULTITOKEN_CPU_FEATURES=avx512 reports a CPU below it"


def test_a_misspelt_level_names_the_choices(monkeypatch):
    monkeypatch.setenv(cpu_features.ENV, "avx-2")
    with pytest.raises(UsageError) as err:
        cpu_features.features()
    assert str(err.value) == ("MULTITOKEN_CPU_FEATURES='avx-2' is not a CPU level\n"
                              "  fix: set it to one of plain, avx2, avx512, native, or unset it")


def test_a_forced_process_caps_onednn_below_avx512():
    """Forced to ``avx2`` before any linear runs, torch's oneDNN itself refuses bf16, as on an
    AVX2 CPU (the user's own ``ONEDNN_MAX_CPU_ISA`` wins)."""
    code = ("import torch; from multitoken.kernels import cpu_features as c; import os; "
            "print(os.environ['ONEDNN_MAX_CPU_ISA'], bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()), c.features().onednn_bf16)")
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    done = subprocess.run([sys.executable, "-c", code], env={**env, cpu_features.ENV: "avx2"},
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["AVX2", "False", "False"]
    done = subprocess.run([sys.executable, "-c", code], env={**env, cpu_features.ENV: "avx2", "ONEDNN_MAX_CPU_ISA": "AVX"},
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split()[0] == "AVX"
