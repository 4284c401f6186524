"""``--mode dynamic`` over conditional drafts with the engine (conditioned and eagle3 heads): a
step's tokens follow the definition computed exhaustively from full passes (chi-square), the
drafter's conditionals at every step are those of a full pass over the text with the sampled
t+1 (the deferred head caches stay in step), batch rows equal their runs alone, and the plan
chooses the joint (auto / conditional / outer) with one-line refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multitoken.base.errors import UsageError
from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import generate, generate_batch
from multitoken.decoding.dynamo.step import Prefix
from multitoken.decoding.plan import resolve

from .conftest import RatioTable, attach
from .dynamo.conditional_oracle import exact_step, tempered
from .dynamo.test_conditional import assert_follows
from .test_batch import alone, encode

PROMPT = [0, 3, 1]


def head_logits(model, text: list[int], prefix: list[int]) -> torch.Tensor:
    """The drafter's logits for the token after ``prefix`` at the text's last position, from one
    full pass over ``text + prefix`` read as training reads it (teacher forcing) # -> [V]."""
    heads, at, m = model.heads, len(text) - 1, len(prefix)
    ids = torch.tensor([text + prefix])
    with torch.no_grad():
        feats = model.features(ids)
        if heads.config.head_type == "conditioned":  # head m reads token t+1 only
            return heads.log_probs(m, feats)[0, at]

        def tokens_at(i, _prev):  # step i at position t reads the text's token t+i
            return torch.cat([ids[:, i:], torch.zeros(1, i, dtype=torch.long)], 1)

        for i, out in heads._chain(feats, tokens_at):
            if i == m:
                return heads.target_log_probs(heads.draft_head(heads.norm(out)))[0, at]
    raise AssertionError(f"no step {m}")


def small_model(backbone, head_type: str):
    model = attach(backbone, head_type, n_future=3, seed=1)
    with torch.no_grad():  # far from the base, so that t+1 changes the conditionals visibly
        for p in model.heads.parameters():
            p.add_(torch.randn_like(p) * (0.5 if head_type == "eagle3" else 0.3))
    return model


@pytest.mark.parametrize("head_type", ["conditioned", "eagle3"])
def test_a_step_follows_the_definition_from_full_passes(small_vocab_backbone, head_type):
    """The first step's 1-3 tokens, sampled by the engine, against the exact distribution of
    the definition with p from the base and q from full teacher-forced passes."""
    model = small_model(small_vocab_backbone, head_type)
    v = small_vocab_backbone.vocab_size
    cfg = DecodeConfig(mode="dynamic", eps_b=0.1, temperature=0.8, top_k=v, max_new_tokens=3, stop_at_eos=False)
    table = RatioTable()
    with torch.no_grad():
        base = small_vocab_backbone.model(torch.tensor([PROMPT])).logits[0, -1].numpy()
    p1 = tempered(base, v, 0.8)
    seen = np.zeros(v, dtype=bool)
    seen[PROMPT] = True
    exact = exact_step(p1, lambda prefix: tempered(head_logits(model, PROMPT, list(prefix)).numpy(), v, 0.8), 3,
                       cfg.resolved(), table, seen)
    counts: dict[tuple, int] = {}
    for seed in range(600):
        firsts = []
        generate(model, PROMPT, DecodeConfig(**{**cfg.__dict__, "seed": seed}), table=table,
                 on_tokens=lambda tokens: firsts.append(tuple(tokens)))
        counts[firsts[0]] = counts.get(firsts[0], 0) + 1
    assert_follows(counts, exact)
    assert {1, 3} <= {len(t) for t in counts}, counts


@pytest.mark.parametrize("head_type", ["conditioned", "eagle3"])
def test_every_steps_conditionals_are_a_full_pass_over_the_text(tiny_backbones, head_type, monkeypatch):
    """At every step the drafter's top-k for t+2 given the sampled t+1 equals a full pass over
    the text so far plus t+1: the deferred head layers (conditioned) and the drafter's cache
    (eagle3) hold each position conditioned on its real next token, over steps of 1-3 tokens."""
    model = attach(tiny_backbones["llama"], head_type)
    seen_steps = []

    def extend(self, cand, *args):  # the drafter's top-k for t+2, where it was asked
        if len(self.tokens) == 1:
            self.asked = cand
        return real_extend(self, cand, *args)

    def choice(self):
        seen_steps.append((self.tokens[0], getattr(self, "asked", None)))
        return real_choice(self)

    real_extend, real_choice = Prefix.extend, Prefix.choice
    monkeypatch.setattr(Prefix, "extend", extend)
    monkeypatch.setattr(Prefix, "choice", choice)
    prompt = encode(model.backbone)[1]
    cfg = DecodeConfig(mode="dynamic", eps_b=0.03, max_new_tokens=16, stop_at_eos=False, top_k=8)
    texts = []
    res = generate(model, prompt, cfg, table=RatioTable(), on_tokens=lambda tokens: texts.append(list(tokens)))
    assert {1, 3} <= set(res.trace.orders) and len(seen_steps) == len(texts)
    assert sum(cand is not None for _, cand in seen_steps) >= 4
    text = list(prompt)
    for (first, cand), step in zip(seen_steps, texts):
        assert step[0] == first
        if cand is None:  # t+1 too unlikely for any longer step: the drafter was not asked
            text += step
            continue
        ref = torch.topk(head_logits(model, text, [first]), 8)
        np.testing.assert_array_equal(cand.ids, ref.indices.numpy())
        np.testing.assert_allclose(cand.probs, torch.softmax(ref.values.double() / 0.7, -1).numpy(), atol=1e-4)
        text += step


@pytest.mark.parametrize("head_type", ["conditioned", "eagle3"])
@pytest.mark.parametrize("greedy", [True, False])
def test_rows_equal_their_runs_alone(tiny_backbones, head_type, greedy):
    model = attach(tiny_backbones["llama"], head_type)
    prompts, seeds = encode(model.backbone), [3, 1, 4, 1]
    cfg = DecodeConfig(mode="dynamic", greedy=greedy, max_new_tokens=14, eps_b=0.03, top_k=8, stop_at_eos=False)
    got = generate_batch(model, prompts, cfg, seeds=seeds, table=RatioTable())
    assert [r.token_ids for r in got] == alone(model, prompts, cfg, seeds, table=RatioTable())
    orders = [r.trace.orders for r in got]
    assert sum(o.get(3, 0) for o in orders) > 0 and sum(o.get(1, 0) for o in orders) > 0  # rows back off differently


@pytest.mark.parametrize("head_type", ["conditioned", "eagle3"])
def test_eps_b_zero_and_one_through_the_engine(tiny_backbones, head_type):
    """eps_b = 0: every step emits n tokens; eps_b = 1: one, with only head 1 read (no drafter)."""
    model = attach(tiny_backbones["llama"], head_type)
    prompt = encode(model.backbone)[2]
    for eps_b, order in ((0.0, model.n_future), (1.0, 1)):
        res = generate(model, prompt, DecodeConfig(mode="dynamic", eps_b=eps_b, max_new_tokens=4 * order, stop_at_eos=False),
                       table=RatioTable())
        assert dict(res.trace.orders) == {order: 4} and len(res.token_ids) == 4 * order


@pytest.mark.parametrize("head_type,joint,resolved", [
    ("conditioned", "auto", "conditional"), ("eagle3", "auto", "conditional"), ("replicated", "auto", "outer"),
    ("conditioned", "outer", "outer"), ("medusa", "outer", "outer")])
def test_the_plan_chooses_the_joint(tiny_backbones, head_type, joint, resolved):
    model = attach(tiny_backbones["llama"], head_type)
    plan = resolve(DecodeConfig(mode="dynamic", dynamic_joint=joint), model, RatioTable())
    assert plan.joint == resolved
    assert plan.defer_heads == (resolved == "conditional" and head_type == "conditioned")
    assert ("conditional joint" in plan.describe()) == (resolved == "conditional")
    unread = resolve(DecodeConfig(mode="dynamic", dynamic_joint=joint, eps_b=1.0), model, RatioTable())
    assert unread.heads_read == 1 and not unread.defer_heads and unread.drafter is None  # eps_b = 1: head 1 only


def test_outer_keeps_the_old_grid_for_conditioned_heads(tiny_backbones):
    """--dynamic-joint outer: the heads run in the pass (conditioned on the base's argmax) and
    the grid is the outer product; the default conditional path gives other tokens."""
    model = attach(tiny_backbones["llama"], "conditioned")
    prompt = encode(model.backbone)[0]
    cfg = DecodeConfig(mode="dynamic", eps_b=0.0, top_k=8, max_new_tokens=12, stop_at_eos=False, seed=2)
    calls = []
    outer = generate(model, prompt, DecodeConfig(**{**cfg.__dict__, "dynamic_joint": "outer"}), table=RatioTable(),
                     on_tokens=calls.append)
    cond = generate(model, prompt, cfg, table=RatioTable())
    assert "conditional" not in outer.trace.plan and "conditional" in cond.trace.plan
    assert len(calls) == 4 and dict(outer.trace.orders) == dict(cond.trace.orders) == {3: 4}  # eps_b = 0: n tokens
    assert outer.token_ids != cond.token_ids


@pytest.mark.parametrize("head_type,joint,what", [("replicated", "conditional", "--dynamic-joint conditional"),
                                                  ("eagle3", "outer", "--dynamic-joint outer")])
def test_a_joint_the_heads_cannot_give_is_refused_in_one_line(tiny_backbones, head_type, joint, what):
    model = attach(tiny_backbones["llama"], head_type)
    with pytest.raises(UsageError) as err:
        generate(model, [1, 5, 9], DecodeConfig(mode="dynamic", dynamic_joint=joint, max_new_tokens=4))
    assert what in err.value.problem and "\n" not in err.value.problem and err.value.fix
