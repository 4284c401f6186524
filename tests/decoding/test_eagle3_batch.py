"""The eagle3 drafter batched over rows (decoding/drafts.py ``Eagle3Chains``, decoding/tree_proposer.py
``Eagle3Trees``): one drafter pass per draft step (chains) or per depth (trees) for every row of a
step, whatever each row kept, and each row's proposals those of its run alone: the same draft
tokens and trees, their probabilities equal within float32 rounding of one drafter pass."""

from __future__ import annotations

import pytest
import torch

from multitoken.decoding import tree_proposer
from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.drafts import Eagle3Chains
from multitoken.decoding.engine import generate, generate_batch

from .conftest import attach
from .test_batch import encode

U = 2.0 ** -24  # float32's unit roundoff


def rounding_tolerance(model, span: int) -> float:
    """How far a row's drafter outputs may move between its batch and its run alone, where only
    the order of float32 sums differs (a padded attention span, a matmul blocked for more rows):
    a sum of at most K terms in two orders differs by at most 2 K u times the sum of the terms'
    magnitudes, K the longest sum of a drafter pass (q/k/v over [embeds; hidden], o_proj, the
    MLP's down_proj, attention over ``span`` slots). Taken as the bound on a draft probability
    (at most 1) and, times its magnitude, on a path's log-probability (first order: these
    models' activations and logits are O(1))."""
    s = model.heads.shape
    return 2 * max(2 * s.width, s.heads * s.head_dim, s.intermediate, span) * U


def record(model, monkeypatch, tree: bool):
    """Spy on the drafter: every row's proposal at every step, keyed by (its prompt, tokens
    emitted so far), and per step [the draft steps (a tree's depth) of each of its rows,
    the drafter passes it ran]. Cleared between runs, not re-patched."""
    proposals, passes, step = {}, [], model.heads.step

    def counted(*args, **kwargs):
        passes[-1][1] += 1
        return step(*args, **kwargs)

    monkeypatch.setattr(model.heads, "step", counted)
    cls, name = (tree_proposer.Eagle3Trees, "_grow") if tree else (Eagle3Chains, "__call__")
    plain = getattr(cls, name)

    def spy(self, out, rows, anchors, jobs, *run):
        passes.append([[n for *_, n in jobs], 0])
        got = plain(self, out, rows, anchors, jobs, *run)
        for r, (j, first, n) in enumerate(jobs):
            key = (tuple(rows[j].prompt), len(rows[j].out_ids))
            if tree:  # what ``_tree_of`` reads of the pack: a shallower row's deeper candidates go
                cols = got[r].cpu()
                proposals[key] = (first, cols[:, cols[2] < n])
            else:
                proposals[key] = (first, got[r].tokens.cpu(), None if got[r].probs is None else got[r].probs.cpu())
        return got

    monkeypatch.setattr(cls, name, spy)
    return proposals, passes


TEXTS = ["Once upon a time", "The little dog ran to the big", "She", "He said that the cat"]  # four lengths


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "dynamic-tree"])
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("mode", ["speculative", "typical"])
def test_batched_drafter_proposals_equal_each_rows_alone(tiny_backbones, monkeypatch, mode, tree, greedy):
    """Rows of four prompt lengths, each keeping its own count every step and reaching its
    budget's end at its own step: every proposal a row makes in the batch is the one it makes
    alone with its seed (draft tokens, and a tree's tokens, parents, depths and order exactly;
    the drafts' q and the path log-probabilities within float32 rounding), and each step runs
    one drafter pass per draft step (one per depth for trees) for all its rows."""
    model = attach(tiny_backbones["llama"], "eagle3", n_future=4)
    prompts, seeds = encode(model.backbone, TEXTS), [3, 1, 4, 1]
    assert len({len(p) for p in prompts}) == len(prompts)
    # typical_delta 1: these random drafts pass about half the time, so rows keep different counts and end apart
    cfg = DecodeConfig(mode=mode, greedy=greedy, temperature=1.0, max_new_tokens=16, stop_at_eos=False, typical_delta=1.0,
                       tree="dynamic" if tree else "chain", tree_nodes="10" if tree else "auto")
    proposals, passes = record(model, monkeypatch, tree)
    got = [r.token_ids for r in generate_batch(model, prompts, cfg, seeds=seeds)]
    batched, batched_passes = dict(proposals), list(passes)
    proposals.clear()
    assert got == [generate(model, p, DecodeConfig(**{**cfg.__dict__, "seed": s})).token_ids for p, s in zip(prompts, seeds)]
    assert batched.keys() == proposals.keys() and len(batched) >= 3 * len(prompts)
    # catch-up + n - 1 draft steps (depths) for all rows, the deepest row's n: once per step, whatever the rows
    assert all(count == max(ns) for ns, count in batched_passes), batched_passes
    assert max(len(ns) for ns, _ in batched_passes) == len(prompts)
    if mode == "typical":  # a row at its budget's end drafted fewer in a step with deeper rows
        assert any(min(ns) < max(ns) for ns, _ in batched_passes), batched_passes
    tol = rounding_tolerance(model, max(len(p) for p in prompts) + cfg.max_new_tokens + 16)
    for key, (first, *mine) in batched.items():
        ref_first, *ref = proposals[key]
        assert first == ref_first, key
        if tree:
            (cols,), (ref_cols,) = mine, ref
            assert torch.equal(cols[[0, 1, 2, 4]], ref_cols[[0, 1, 2, 4]]), key
            torch.testing.assert_close(cols[3], ref_cols[3], rtol=tol, atol=0)
        else:
            (tokens, q), (ref_tokens, ref_q) = mine, ref
            assert torch.equal(tokens, ref_tokens), key
            assert (q is None) == greedy and (ref_q is None) == greedy
            if q is not None:
                torch.testing.assert_close(q, ref_q, atol=tol, rtol=0)
