"""The trace adds up: tokens, forward passes, accepted lengths, orders and times."""

from __future__ import annotations

import json

from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import generate

from .conftest import RatioTable, attach


def test_speculative_trace_is_consistent(tiny_backbones):
    model = attach(tiny_backbones["llama"], "medusa")
    res = generate(model, [1, 5, 9], DecodeConfig(mode="speculative", max_new_tokens=20, stop_at_eos=False, seed=3))
    t = res.trace
    assert t.new_tokens == len(res.token_ids) == 20
    # every pass after the prompt's verifies drafts; each yields accepted + 1 tokens
    assert sum(t.accepted_lengths.values()) == t.forward_passes - 1
    assert 0 < t.model_s <= t.wall_s and t.decoding_s >= 0 and t.prefill_s <= t.model_s
    d = json.loads(json.dumps(res.as_dict()))
    assert d["trace"]["tokens_per_forward"] == round(20 / t.forward_passes, 4)
    assert "tokens/forward" in t.summary()


def test_dynamic_trace_counts_orders_and_backoffs(tiny_backbones):
    model = attach(tiny_backbones["llama"], "replicated")
    res = generate(model, [1, 5, 9], DecodeConfig(mode="dynamic", eps_b=0.3, max_new_tokens=30, stop_at_eos=False),
                   table=RatioTable())
    t = res.trace
    assert sum(order * steps for order, steps in t.orders.items()) >= 30  # the last step may be cut
    assert sum(t.orders.values()) == t.forward_passes
    assert all(order in (2, 3) for order in t.backoffs)
