"""PPL_d against hand computations at the two ends of eps_b (0: order n every step, 1: order 1)."""

import math

import pytest
import torch

from multitoken.pipeline.eval.dynamic_ppl import DynamicPPL
from multitoken.pipeline.eval.headscores import score_head


def test_ppl_d_ends_and_middle(tiny_model):
    ids = torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(2))
    logps = tiny_model.head_logits(ids, last_only=False)  # 3 x [B, T, V]
    dyn = DynamicPPL([0.0, 0.5, 1.0], tiny_model, budget=10_000)
    feats = tiny_model.features(ids)
    for i in range(3):
        dyn.add_head(i, score_head(tiny_model, i, feats, ids, k=dyn.k))
    dyn.end_batch(ids)
    rows = {r["eps_b"]: r for r in dyn.report()}
    # eps_b = 1: one token per step, PPL_d is the base perplexity over the 2 x 15 targets.
    nll1 = -sum(float(logps[0][b, t, ids[b, t + 1]]) for b in range(2) for t in range(15))
    assert rows[1.0]["tokens_per_step"] == 1.0 and rows[1.0]["ppl_d"] == pytest.approx(math.exp(nll1 / 30), rel=1e-6)
    # eps_b = 0: steps at t = 0, 3, 6, 9, 12 emit 3 tokens each, scored by heads 1, 2, 3.
    nll0 = -sum(float(logps[i][b, t, ids[b, t + i + 1]]) for b in range(2) for t in (0, 3, 6, 9, 12) for i in range(3))
    assert rows[0.0]["tokens_per_step"] == 3.0 and rows[0.0]["steps"] == 10
    assert rows[0.0]["ppl_d"] == pytest.approx(math.exp(nll0 / 30), rel=1e-6)
    # eps_b = 0.5: the random heads are near uniform over their top-k, so no grid cell comes near 0.5
    # and every step backs off: the very walk of eps_b = 1 (mixed orders: the test below).
    assert rows[0.5] == {**rows[1.0], "eps_b": 0.5}


def test_each_step_scores_the_order_the_proposal_chose(tiny_model, monkeypatch):
    """Mixed orders: at each cursor t the walk asks the proposal (greedy, capped by the tokens
    left, the context x_<=t as history, head i's candidates at t), scores the m reference tokens
    it chose with heads 1..m and moves to t + m."""
    from types import SimpleNamespace

    from multitoken.pipeline.eval import dynamic_ppl

    ids = torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(5))
    logps = tiny_model.head_logits(ids, last_only=False)  # 3 x [1, T, V]
    script, calls = iter([2, 1, 3, 3, 2]), []  # cursors 0, 2, 3, 6, 9; at 9 two tokens are left

    def scripted(cands, n, cfg, table, seen, rng):
        calls.append((n, set(seen.nonzero()[0].tolist()), [int(c.ids[0]) for c in cands], rng))
        return SimpleNamespace(order=next(script))

    monkeypatch.setattr(dynamic_ppl, "dynamic_propose", scripted)
    dyn = DynamicPPL([0.5], tiny_model, budget=10_000)
    feats = tiny_model.features(ids)
    for i in range(3):
        dyn.add_head(i, score_head(tiny_model, i, feats, ids, k=dyn.k))
    dyn.end_batch(ids)
    steps = [(0, 2), (2, 1), (3, 3), (6, 3), (9, 2)]  # (cursor, order)
    row = ids[0].tolist()
    for (t, _), (n, seen, tops, rng) in zip(steps, calls, strict=True):
        assert n == min(3, 11 - t) and seen == set(row[:t + 1]) and rng is None
        assert tops == [int(logps[i][0, t].argmax()) for i in range(n)]
    nll = -sum(float(logps[i][0, t, row[t + i + 1]]) for t, m in steps for i in range(m))
    got = dyn.report()[0]
    assert (got["tokens"], got["steps"]) == (11, 5) and got["tokens_per_step"] == 11 / 5
    assert got["ppl_d"] == pytest.approx(math.exp(nll / 11), rel=1e-6)


def test_budget_stops_walking(tiny_model):
    ids = torch.randint(3, 512, (3, 8), generator=torch.Generator().manual_seed(3))
    dyn = DynamicPPL([1.0], tiny_model, budget=8)
    feats = tiny_model.features(ids)
    for i in range(3):
        dyn.add_head(i, score_head(tiny_model, i, feats, ids, k=dyn.k))
    dyn.end_batch(ids)
    assert dyn.report()[0]["tokens"] == 7 and dyn.full


def test_batched_candidates_equal_the_proposals_own_top_k(tiny_model):
    """The walk's candidates, made for every position of a batch in one call from the stored
    top-k, are those ``dynamic_propose`` makes from the head's distribution (ids and probs)."""
    from multitoken.decoding.dynamo import head_candidates

    ids = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(4))
    dyn = DynamicPPL([0.5], tiny_model, budget=10_000)
    feats = tiny_model.features(ids)
    logps = tiny_model.head_logits(ids, last_only=False)
    for i in range(3):
        sc = score_head(tiny_model, i, feats, ids, k=dyn.k)
        cands = dyn._candidates(sc.top_vals.cpu(), sc.top_ids.cpu())
        for b in range(2):
            for t in (0, 5, 11):
                ref = head_candidates(logps[i][b, t][None], dyn.k, dyn.cfg.sampling.temperature)[0]
                assert (cands[b][t].ids == ref.ids).all()
                assert abs(cands[b][t].probs - ref.probs).max() <= 1e-6
