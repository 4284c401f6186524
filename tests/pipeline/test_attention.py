"""Our attention implementation for transformers (pipeline/model/attention.py): a batch's one-token
bf16 CPU steps through the ``decode_attention`` op, every other call transformers' SDPA path bit
for bit; a model set to it decodes through it in our engine and in transformers' ``generate`` alike."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from multitoken.kernels import gemv_rows
from multitoken.pipeline.model import attention
from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
from multitoken.pipeline.train.recipe_data import Continuer, bfloat16_copy

from ..kernels.conftest import needs_kernels

MODULE = SimpleNamespace(num_key_value_groups=3, is_causal=True, layer_idx=0, training=False)


def _qkv(rows: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(4, 6, rows, 64, generator=gen).to(dtype), torch.randn(4, 2, 19, 64, generator=gen).to(dtype),
            torch.randn(4, 2, 19, 64, generator=gen).to(dtype))


class _Counted:
    """The kernel library with its ``decode_attention`` calls counted."""

    def __init__(self, lib):
        self.lib, self.calls = lib, 0

    def __getattr__(self, name):
        if name != "decode_attention":
            return getattr(self.lib, name)

        def op(*args):
            self.calls += 1
            return self.lib.decode_attention(*args)
        return op


@needs_kernels()
def test_one_token_bf16_steps_take_the_op_and_every_other_call_sdpas_own_bits():
    q, k, v = _qkv(1, torch.bfloat16)
    mask = torch.ones(4, 1, 1, 19, dtype=torch.bool)
    mask[1, ..., :7] = False
    for m in (None, mask):
        out, weights = attention.attention(MODULE, q, k, v, m, scaling=0.125)
        assert weights is None and torch.equal(out, gemv_rows.library().decode_attention(q, k, v, m, 0.125))
        exact = sdpa_attention_forward(MODULE, q.double(), k.double(), v.double(), m, scaling=0.125)[0]
        assert out.shape == exact.shape  # and within one bf16 rounding (tests/kernels/test_decode_attention.py)
        assert bool(((out.double() - exact).abs() <= 2.0 ** -8 * exact.abs() + 2.0 ** -16 * float(v.abs().max())).all())
    additive = torch.zeros(4, 1, 1, 19, dtype=torch.bfloat16).masked_fill(~mask, -1e4)
    rows2 = _qkv(2, torch.bfloat16)
    for args in ((*_qkv(1, torch.float32), None), (*rows2, None), (q, k, v, additive)):
        assert torch.equal(attention.attention(MODULE, *args, scaling=0.125)[0],
                           sdpa_attention_forward(MODULE, *args, scaling=0.125)[0])
    torch.manual_seed(0)
    dropped = attention.attention(MODULE, q, k, v, None, dropout=0.5, scaling=0.125)[0]
    torch.manual_seed(0)
    assert torch.equal(dropped, sdpa_attention_forward(MODULE, q, k, v, None, dropout=0.5, scaling=0.125)[0])


def test_the_implementations_taking_sdpas_masks():
    assert attention.takes_sdpa_masks(SimpleNamespace(_attn_implementation="sdpa"))
    assert attention.takes_sdpa_masks(SimpleNamespace(_attn_implementation=attention.NAME))
    assert not attention.takes_sdpa_masks(SimpleNamespace(_attn_implementation="eager"))


@needs_kernels()
def test_a_bfloat16_copy_decodes_through_the_op_in_our_engine_and_in_generate(tied_llama_dir, monkeypatch):
    """The recipe's bf16 copy is set to it (the base keeps SDPA); both engines' one-token steps take
    the op, and our greedy rows are transformers' ``generate``'s on the same copy."""
    bb = load_backbone(BackboneConfig(base=str(tied_llama_dir)))
    copy = bfloat16_copy(bb)
    assert copy.model.config._attn_implementation == attention.NAME and bb.config._attn_implementation == "sdpa"
    counted = _Counted(gemv_rows.library())
    monkeypatch.setattr(attention.gemv_rows, "library", lambda: counted)
    prompts = torch.randint(3, bb.config.vocab_size, (5, 6), generator=torch.Generator().manual_seed(2))
    ours = Continuer(bb, "multitoken", "bfloat16")(prompts, 10, False, [0] * 5)[0]
    assert counted.calls >= 9 * bb.config.num_hidden_layers  # every one-token step's layers
    counted.calls = 0
    theirs = Continuer(bb, "transformers", "bfloat16")(prompts, 10, False, [0])[0]
    assert counted.calls >= 9 * bb.config.num_hidden_layers
    assert torch.equal(ours, theirs)


def test_without_the_kernels_it_is_sdpa(monkeypatch):
    monkeypatch.setattr(attention.gemv_rows, "library", lambda: None)
    q, k, v = _qkv(1, torch.bfloat16)
    assert torch.equal(attention.attention(MODULE, q, k, v, None, scaling=0.125)[0],
                       sdpa_attention_forward(MODULE, q, k, v, None, scaling=0.125)[0])


@pytest.fixture(autouse=True)
def _registered():
    attention.register()
