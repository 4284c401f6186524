"""Prompt lookup branches (decoding/trees.py): the context draft, the graft, greedy output that
stays transformers' with the lookup branch on, and sampled output that keeps the base's law."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from multitoken.base.errors import UsageError
from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import generate
from multitoken.decoding.trees import LOOKUP_RANK, Tree, adapt_lookup, context_draft, graft, with_lookup

from .conftest import attach
from .test_exactness import hf_greedy, merge_small_cells
from .test_tree import exact_penalised


def test_context_draft_takes_the_latest_occurrence_of_the_longest_suffix():
    #          0  1  2  3  4  5  6  7  8  9 10 11
    context = [5, 6, 7, 1, 9, 6, 7, 2, 3, 8, 6, 7]
    # suffix (8, 6, 7) never occurred before; (6, 7) did at 1 and 5: the latest, 5, is followed by 2, 3
    assert context_draft(context, 2) == [2, 3]
    assert context_draft(context, 10) == [2, 3, 8, 6, 7]  # runs to the context's end, no further
    assert context_draft([4, 5, 4, 9, 9, 1, 4], 3) == [9, 9, 1]  # one-token suffix: the latest earlier 4 is at 2
    assert context_draft([1, 2, 3], 4) == []  # nothing repeats
    assert context_draft([1, 2, 1], 0) == [] and context_draft([1], 3) == []


def test_graft_shares_the_heads_nodes_and_appends_the_rest():
    # root 10 -> (11, 12) at depth 1; 11 -> 13 at depth 2
    tree = Tree([10, 11, 12, 13], [-1, 0, 0, 1], [0, 1, 1, 2], [0, 0, 1, 0])
    grown = graft(tree, [11, 13, 14, 15])  # shares 11 and 13, adds 14 and 15 below them
    assert grown.tokens == [10, 11, 12, 13, 14, 15]
    assert grown.parents == [-1, 0, 0, 1, 3, 4] and grown.depths == [0, 1, 1, 2, 3, 4]
    assert grown.ranks[4:] == [LOOKUP_RANK] * 2
    other = graft(tree, [12, 11])  # leaves the heads' path at depth 2: a new node under 12
    assert other.tokens[4] == 11 and other.parents[4] == 2 and other.depths[4] == 2
    assert other.children[0] == [1, 2]  # head guesses keep their order among siblings
    assert len(graft(tree, [11, 13])) == 4  # already there: nothing added
    lone, drafted = with_lookup(Tree([7], [-1], [0], [0]), [7, 8, 9, 7], 2)  # the root is the context's last token
    assert lone.tokens == [7, 8, 9] and lone.depths == [0, 1, 2] and drafted == 2
    assert with_lookup(tree, [1, 2, 10], 3) == (tree, 0)  # no earlier 10: the tree as it was


def test_branch_length_follows_what_was_kept():
    assert adapt_lookup(0, 8, 8, 8) == 8  # first step: the flag's length, capped there
    assert adapt_lookup(4, 4, 5, 8) == 6 and adapt_lookup(7, 7, 7, 8) == 8  # all kept: two more, at most --lookup
    assert adapt_lookup(6, 6, 2, 8) == 5 and adapt_lookup(1, 1, 0, 8) == 1  # not all kept: one less, at least 1


def test_lookup_needs_verification():
    for bad in (dict(mode="dynamic"), dict(mode="dynamic", greedy=True), dict(mode="ar")):
        with pytest.raises(UsageError, match="--lookup .* needs --mode speculative or typical"):
            DecodeConfig(lookup=4, **bad).validate()
    for bad in (-1, 257):
        with pytest.raises(UsageError, match=r"--lookup must be in \[0, 256\]"):
            DecodeConfig(mode="speculative", greedy=True, lookup=bad).validate()
    DecodeConfig(mode="speculative", greedy=True, tree="static", lookup=4).validate()
    DecodeConfig(mode="speculative", greedy=True, lookup=4).validate()  # a chain: the heads' path plus the lookup one
    DecodeConfig(mode="speculative", lookup=4).validate()  # sampled: the walk judges the branch's tokens as point masses
    DecodeConfig(mode="typical", tree="dynamic", tree_nodes="4", lookup=4).validate()


@pytest.mark.parametrize("tree", ["chain", "static", "dynamic"])
def test_greedy_with_lookup_equals_generate_and_goes_past_the_heads(tiny_backbones, arch, tree):
    """The random tiny models' greedy text loops, so the lookup branch is kept for runs longer
    than the heads' two drafts; every token is still transformers' greedy token, alone and batched."""
    backbone = tiny_backbones[arch]
    model = attach(backbone, "replicated")
    prompts = [backbone.tokenizer(p, return_tensors="pt").input_ids for p in ("Once upon a time", "The little dog")]
    refs = [hf_greedy(backbone, ids, 40) for ids in prompts]
    nodes = {} if tree == "chain" else {"tree_nodes": "4"}
    cfg = DecodeConfig(mode="speculative", greedy=True, max_new_tokens=40, tree=tree, lookup=6, **nodes)
    deepest = passes = 0
    for ids, ref in zip(prompts, refs):
        res = generate(model, ids, cfg)
        assert res.token_ids == ref
        deepest = max(deepest, max(res.trace.accepted_lengths))
        assert res.trace.lookup == 6 and "prompt lookup" in res.trace.summary()
        passes += res.trace.forward_passes
    assert deepest > model.n_future - 1  # a kept path longer than any the heads can draft
    assert sum(r.trace.lookup_tokens for r in generate(model, [ids[0].tolist() for ids in prompts], cfg)) >= deepest - 2
    batch = generate(model, [ids[0].tolist() for ids in prompts], cfg)
    assert [r.token_ids for r in batch] == refs
    plain = DecodeConfig(mode="speculative", greedy=True, max_new_tokens=40, tree=tree, **nodes)
    assert sum(generate(model, ids, plain).trace.forward_passes for ids in prompts) > passes


@pytest.mark.parametrize("tree", ["chain", "dynamic"])
def test_sampled_with_lookup_matches_the_base_distribution(small_vocab_backbone, tree):
    """On a 4-token vocabulary every suffix repeats, so each step grafts a copied run of up to
    two tokens beside the head's guess; the first three sampled tokens keep the base's law (with
    the penalty), while copied tokens are both kept and rejected."""
    model = attach(small_vocab_backbone, "medusa", n_future=2)
    with torch.no_grad():  # the head clearly different from the base: its guess is often wrong
        model.heads.blocks[0][0].linear.weight.normal_(0, 1.0)
    prompt, v, runs = [0, 3, 1, 2, 0, 3, 1], small_vocab_backbone.vocab_size, 600
    nodes = {} if tree == "chain" else {"tree_nodes": "3"}
    counts, looked, deepest = torch.zeros(v, v, v), 0, 0
    for seed in range(runs):
        res = generate(model, prompt, DecodeConfig(mode="speculative", temperature=1.0, top_k=v, max_new_tokens=3, seed=seed,
                                                   stop_at_eos=False, tree=tree, lookup=2, **nodes))
        a, b, c = res.token_ids
        counts[a, b, c] += 1
        looked += res.trace.lookup_tokens
        deepest = max(deepest, max(res.trace.accepted_lengths))
    expected = exact_penalised(small_vocab_backbone, prompt, 1.1, length=3) * runs
    stat = chisquare(*merge_small_cells(counts.flatten(), expected.flatten()))
    assert stat.pvalue > 1e-3, (counts, expected)
    assert looked > 20 and deepest == 2  # the branch's tokens were kept, past the head's one draft
    assert looked < 2 * runs  # and rejected too


def test_typical_and_batched_sampled_runs_take_the_branch(small_vocab_backbone):
    """Typical acceptance walks the grafted tree too, and batched sampled rows draw their own
    branches: on the 4-token model's peaked text the copied runs are kept past the head's draft."""
    model = attach(small_vocab_backbone, "medusa", n_future=2)
    rows = [[0, 3, 1, 2, 0, 3, 1], [2, 1, 0, 3, 2, 1]]
    for mode in ("typical", "speculative"):
        cfg = DecodeConfig(mode=mode, temperature=1.0, top_k=4, max_new_tokens=40, tree="dynamic", tree_nodes="3",
                           lookup=4, seed=1, stop_at_eos=False)
        batch = generate(model, rows, cfg)
        assert all(len(r.token_ids) == 40 for r in batch)
        assert sum(r.trace.lookup_tokens for r in batch) > 0, mode
        assert max(max(r.trace.accepted_lengths) for r in batch) > model.n_future - 1, mode
