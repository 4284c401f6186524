"""scripts/llama_cpp_ops.py's reading of a perf report: samples sorted by ggml function into ops,
shares of the compute samples only (loading, the tokenizer and libc left out)."""

from __future__ import annotations

import pytest

from .test_scripts import SCRIPTS, load_script

REPORT = """
# Overhead  Shared Object      Symbol
    57.65%  llama-completion      [.] ggml_vec_dot_q4_1_q8_1
    13.93%  llama-completion      [.] ggml_vec_dot_q8_0_q8_0
     2.51%  llama-completion      [.] ggml_compute_forward_flash_attn_ext
     2.33%  llama-completion      [.] ggml_compute_forward_mul_mat
     2.08%  llama-completion      [.] llama_vocab::impl::load
     0.79%  libm.so.6             [.] __expf_fma
     0.57%  llama-completion      [.] quantize_row_q8_1
     0.42%  llama-completion      [.] ggml_compute_forward_rms_norm_mul_fused
     0.63%  [kernel.kallsyms]     [k] _raw_spin_unlock_irqrestore
"""


def test_samples_go_to_their_ops_and_shares_count_compute_only():
    script = load_script(SCRIPTS / "llama_cpp_ops.py")
    got = script.shares(REPORT)
    compute = 57.65 + 13.93 + 2.51 + 2.33 + 0.79 + 0.57 + 0.42
    assert got["Q4_1 dot products (ggml_vec_dot_q4_1_q8_1)"] == pytest.approx(57.65 / compute)
    assert got["attention (flash_attn_ext, f16 dot products, softmax, exp)"] == pytest.approx((2.51 + 0.79) / compute)
    assert got["activations to int8 (quantize_row_q8_*)"] == pytest.approx(0.57 / compute)
    assert got["other ggml compute (mul_mat driver, add, mul, silu, get_rows, threads)"] == pytest.approx(2.33 / compute)
    assert sum(got.values()) == pytest.approx(1.0)
    assert script.shares("no samples here") == {}
