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
    assert 0 < t.prefill_s <= t.model_s <= t.wall_s
    assert t.decoding_s == t.wall_s - t.model_s > 0  # the logic's time: proposals, verdicts, bookkeeping
    d = json.loads(json.dumps(res.as_dict()))
    assert d["trace"]["tokens_per_forward"] == round(20 / t.forward_passes, 4)
    assert "tokens/forward" in t.summary()
    assert "accepted drafts" not in t.summary() and "rows per unembedding call" not in t.summary()  # internals: verbose
    assert "accepted drafts per verification" in t.summary(verbose=True)
    assert "rows per unembedding call" in t.summary(verbose=True)


def test_packing_the_linears_is_timed_apart_from_the_run(tiny_backbones):
    """A model's first run packs its CPU linears: that time is the trace's ``prepare_s``, not
    part of ``wall_s`` (tokens per second count decoding); a second run packs nothing."""
    model = attach(tiny_backbones["llama"], "replicated")
    model.train().eval()  # the stock linears back (train), heads in eval mode: the next run packs them again
    cfg = DecodeConfig(mode="speculative", max_new_tokens=8, stop_at_eos=False, greedy=True)
    first = generate(model, [1, 5, 9], cfg).trace
    again = generate(model, [1, 5, 9], cfg).trace
    assert first.prepare_s > 0 and again.prepare_s < first.prepare_s
    assert first.model_s <= first.wall_s and "packing the linears" not in again.summary()


def test_what_a_step_unembeds_inside_is_counted_once(tiny_backbones, monkeypatch):
    """Conditioned heads read the base's argmax inside the step (token t+1): its unembedding
    is in the forward's time, and must not be added to the model time a second time. Each
    unembedding is made to take 20 ms, so a double count would put model time above wall time."""
    import time

    from multitoken.pipeline.runtime import step_output, unembed_costs

    slow = step_output.unembed
    monkeypatch.setattr(step_output, "unembed", lambda bb, rows: (time.sleep(0.02), slow(bb, rows))[1])
    monkeypatch.setattr(unembed_costs, "PINNED", unembed_costs.UnembedCosts(
        lambda rows: {r: {unembed_costs.LINEAR: 1.0, unembed_costs.ARGMAX: 2.0} for r in rows}))  # logits, no screen
    model = attach(tiny_backbones["llama"], "conditioned")
    t = generate(model, [1, 5, 9], DecodeConfig(mode="speculative", max_new_tokens=12, stop_at_eos=False, greedy=True)).trace
    assert 0.02 * t.forward_passes <= t.model_s <= t.wall_s


def test_dynamic_trace_counts_orders_and_backoffs(tiny_backbones):
    model = attach(tiny_backbones["llama"], "replicated")
    res = generate(model, [1, 5, 9], DecodeConfig(mode="dynamic", eps_b=0.3, max_new_tokens=30, stop_at_eos=False),
                   table=RatioTable())
    t = res.trace
    assert sum(order * steps for order, steps in t.orders.items()) >= 30  # the last step may be cut
    assert sum(t.orders.values()) == t.forward_passes
    assert all(order in (2, 3) for order in t.backoffs)
