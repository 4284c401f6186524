"""Tree verification (issue 17): the tree's mask and positions, its rows against fresh forwards
over each path, cache compaction, greedy output equal to transformers' ``generate`` and sampled
output distributed as the base model."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from multitoken.decoding import generate as generate_any
from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import generate
from multitoken.decoding.trees import (ACCURACY_FILE, Accuracies, Tree, best_first, expected_accepted,
                                      fallback_accuracies, read_accuracies)
from multitoken.decoding.rules import greedy_kept, read_walks, sampled_draw, sampled_inputs, sampled_walk
from multitoken.decoding.verify import verdict_of
from multitoken.base.errors import UsageError
from multitoken.decoding.trace import Trace
from multitoken.decoding.plan import resolve
from multitoken.decoding.tree_proposer import Trees
from multitoken.embedded import EMBEDDED_STATS
from multitoken.pipeline.sources.assets import load_model
from multitoken.stats.table import CooccurrenceTable
from multitoken.pipeline.runtime.incremental import _tree_context

from .conftest import RatioTable, attach
from .test_exactness import PROMPTS, hf_greedy, merge_small_cells

# root 5; 7 and 9 its children (head 1's ranks 0, 1); 11 under 7, 13 under 9 (head 2); 17 under 13
STORIES = ["Once upon a time", "The little dog ran to the park and", "Lily and Ben were playing with a ball. Then"]
TREE = Tree(tokens=[5, 7, 9, 11, 13, 17], parents=[-1, 0, 0, 1, 2, 4], depths=[0, 1, 1, 2, 2, 3], ranks=[0, 0, 1, 0, 0, 0])


def test_mask_and_positions_of_a_small_tree_match_hand_built_ones(tiny_backbones):
    hand = torch.tensor([[1, 0, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0, 0],
                         [1, 0, 1, 0, 0, 0],
                         [1, 1, 0, 1, 0, 0],
                         [1, 0, 1, 0, 1, 0],
                         [1, 0, 1, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(TREE.attend(), hand)
    assert TREE.offsets().tolist() == [0, 1, 1, 2, 2, 3]
    assert TREE.children == [[1, 2], [3], [4], [], [5], []] and TREE.path(5) == [0, 2, 4, 5]
    bb = tiny_backbones["llama"]  # what the layers get: the context fully visible, then the tree
    caches = type("C", (), {"length": 3})()
    ctx = _tree_context(bb, torch.zeros(1, 6, bb.hidden_size), caches, TREE.attend(), TREE.offsets())
    assert ctx.position_ids.tolist() == [[3, 4, 4, 5, 5, 6]]
    assert torch.equal(ctx.mask[0, 0], torch.cat([torch.ones(6, 3, dtype=torch.bool), hand], 1))


def test_best_first_takes_the_nodes_of_highest_expected_acceptance():
    acc = [[0.6, 0.2], [0.5, 0.1]]
    shape = best_first([[math.log(x) for x in row] for row in acc], 3)
    # 0.6 (head 1 rank 0), then 0.6 * 0.5 = 0.3 under it, then 0.2 (head 1 rank 1)
    assert (shape.parents, shape.depths, shape.ranks) == ((-1, 0, 1, 0), (0, 1, 2, 1), (0, 0, 0, 1))
    assert expected_accepted(shape, acc) == pytest.approx(0.6 + 0.3 + 0.2)
    assert shape.within(1).depths == (0, 1, 1)
    assert len(best_first([[math.log(x) for x in row] for row in acc], 100)) == 1 + 2 + 2 * 2  # all there is


def test_tree_rows_equal_a_fresh_forward_over_each_path(tiny_backbones, arch, head_type):
    model = attach(tiny_backbones[arch], head_type)
    context = [3, 8, 1, 4]
    caches = model.new_caches()
    model.step(torch.tensor([context]), caches)
    out = model.step(torch.tensor([TREE.tokens]), caches, attend=TREE.attend(), offsets=TREE.offsets())
    for node in range(len(TREE)):
        ids = torch.tensor([context + [TREE.tokens[i] for i in TREE.path(node)]])
        fresh = model.head_logits(ids, last_only=True, next_known=0)  # n x [1, 1, V] (steps read every position)
        for i in range(model.n_future):
            torch.testing.assert_close(out.head_log_probs(i, node), fresh[i][:, 0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("head_type", ["replicated", "whs"])  # layer heads: their own caches compacted too
def test_kv_compaction_equals_a_fresh_forward_over_the_accepted_text(tiny_backbones, arch, head_type):
    model = attach(tiny_backbones[arch], head_type)
    context, path = [3, 8, 1, 4], TREE.path(5)  # [0, 2, 4, 5]: not a prefix of the tree's nodes
    caches = model.new_caches()
    model.step(torch.tensor([context]), caches)
    model.step(torch.tensor([TREE.tokens]), caches, attend=TREE.attend(), offsets=TREE.offsets())
    caches.keep(len(context), [path])
    text = context + [TREE.tokens[i] for i in path]
    fresh = model.new_caches()
    model.step(torch.tensor([text]), fresh)
    assert caches.length == fresh.length == len(text)
    for got, want in zip((caches.backbone, *caches.heads), (fresh.backbone, *fresh.heads)):
        for a, b in zip(got.layers, want.layers):
            if getattr(b, "is_initialized", False) and b.keys is not None and b.keys.numel():
                torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)
    nxt = model.step(torch.tensor([[19]]), caches)  # decoding goes on from the compacted caches
    full = model.head_logits(torch.tensor([text + [19]]), last_only=True)
    for i in range(model.n_future):
        torch.testing.assert_close(nxt.head_log_probs(i, 0), full[i][:, 0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tree,nodes,joint", [("static", "5", False), ("dynamic", "8", False), ("dynamic", "8", True)])
def test_greedy_tree_equals_transformers_generate(tiny_backbones, arch, head_type, tree, nodes, joint):
    backbone = tiny_backbones[arch]
    model = attach(backbone, head_type)
    table = RatioTable() if joint else None  # joint: the dynamic tree ranks its paths under the mask
    for prompt in PROMPTS[:2]:
        ids = backbone.tokenizer(prompt, return_tensors="pt").input_ids
        cfg = DecodeConfig(mode="speculative", greedy=True, max_new_tokens=20, tree=tree, tree_nodes=nodes, draft_k=6,
                           drafter="joint" if joint else "auto")  # auto: CP heads draft sequentially, no joint
        res = generate(model, ids, cfg, table=table)
        assert res.token_ids == hf_greedy(backbone, ids, 20), prompt
        assert res.trace.tree == tree and res.trace.tree_nodes == int(nodes)
        assert ("co-occurrence" in res.trace.tree_accuracies) == joint


def test_greedy_tree_with_heads_that_guess_well(tiny_backbones, arch):
    """Medusa heads at their zero init guess the base's own next tokens: many of their guesses are
    right one position late, so paths of several nodes and non-first siblings get accepted."""
    backbone = tiny_backbones[arch]
    model = attach(backbone, "medusa", n_future=4)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.zero_()
    ids = backbone.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    ref = hf_greedy(backbone, ids, 40)
    res = generate(model, ids, DecodeConfig(mode="speculative", greedy=True, max_new_tokens=40, tree="dynamic", tree_nodes="32"))
    assert res.token_ids == ref
    chain = generate(model, ids, DecodeConfig(mode="speculative", greedy=True, max_new_tokens=40))
    assert res.trace.forward_passes <= chain.trace.forward_passes


def test_embedded_heads_accept_more_per_forward_with_a_tree():
    model, _ = load_model(None)
    ids = model.backbone.tokenizer("The little dog ran to the park and", return_tensors="pt").input_ids
    cfg = dict(mode="speculative", greedy=True, max_new_tokens=64)
    chain = generate(model, ids, DecodeConfig(**cfg))
    for tree in ("static", "dynamic"):
        res = generate(model, ids, DecodeConfig(**cfg, tree=tree, tree_nodes="16"))
        assert res.token_ids == chain.token_ids
        assert res.trace.tokens_per_forward > chain.trace.tokens_per_forward
        assert sum(c for r, c in res.trace.tree_sibling_ranks.items() if r > 0) > 0


# sampling --------------------------------------------------------------------------------------
def exact_penalised(backbone, prompt: list[int], penalty: float, length: int = 2) -> torch.Tensor:
    """p(x1, ..., x_length | prompt) with DynaMo's repetition penalty # -> [V] * length."""
    v = backbone.vocab_size

    def dist(ids):
        logits = backbone.model(torch.tensor([ids])).logits[0, -1].float()
        seen = torch.zeros(v, dtype=torch.bool)
        seen[ids] = True
        return torch.softmax(logits - math.log(penalty) * seen, -1)  # [V]

    def joint(ids, left):
        p = dist(ids)
        return p if left == 1 else torch.stack([p[a] * joint(ids + [a], left - 1) for a in range(v)])

    with torch.no_grad():
        return joint(list(prompt), length)


@pytest.mark.parametrize("tree", ["static", "dynamic", "joint"])
def test_sampled_tree_matches_the_base_distribution(small_vocab_backbone, tree):
    model = attach(small_vocab_backbone, "medusa", n_future=2)
    with torch.no_grad():  # head 2 clearly different from the base: its first guess is often wrong
        model.heads.blocks[0][0].linear.weight.normal_(0, 1.0)
    prompt, v, runs = [0, 3, 1], small_vocab_backbone.vocab_size, 400
    counts, ranks = torch.zeros(v, v), {}
    table = RatioTable() if tree == "joint" else None  # the mask reorders the candidates: still exact
    for seed in range(runs):
        res = generate(model, prompt, DecodeConfig(mode="speculative", temperature=1.0, top_k=v, max_new_tokens=2, seed=seed,
                                                   stop_at_eos=False, tree="dynamic" if tree == "joint" else tree, tree_nodes="3"),
                       table=table)
        a, b = res.token_ids
        counts[a, b] += 1
        for r, c in res.trace.tree_sibling_ranks.items():
            ranks[r] = ranks.get(r, 0) + c
    expected = exact_penalised(small_vocab_backbone, prompt, 1.1) * runs
    stat = chisquare(*merge_small_cells(counts.flatten(), expected.flatten()))
    assert stat.pvalue > 1e-3, (counts, expected)
    assert ranks.get(0, 0) > 20 and ranks.get(1, 0) + ranks.get(2, 0) > 20  # siblings past the first were kept


def test_joint_tree_takes_the_nodes_of_most_masked_joint_mass():
    # head 2 guesses ids 4, 5 (0.6, 0.4), head 3 ids 6, 7 (0.7, 0.3); after root 1 the corpus never
    # saw (1, 4, 6): the joint cells are (4, 7) 0.18, (5, 6) 0.28, (5, 7) 0.12 (/ 0.58), so
    # node 5 (0.40) comes first, then its child 6 (0.28), then node 4 (0.18: tied with its own child
    # (4, 7), the shallower first)
    v = 8
    ratio = np.ones((v, v, v))
    ratio[1, 4, 6] = 0.0
    cfg = DecodeConfig(mode="speculative", greedy=True, temperature=1.0, tree="dynamic", tree_nodes="3", draft_k=2,
                       drafter="joint").resolved()  # the top-k probabilities as given
    model = SimpleNamespace(heads=SimpleNamespace(), heads_dir=None, n_future=3)
    table = RatioTable(ratio)
    run = SimpleNamespace(cfg=cfg, model=model, table=table, vocab=v, device=torch.device("cpu"), plan=resolve(cfg, model, table),
                          draft_cfg=replace(cfg, static_threshold=False, adaptive_threshold=False))
    row = SimpleNamespace(trace=Trace())
    steps = Trees(run, fallback_accuracies(2))
    assert run.plan.joint_tree and steps.ranks == 2
    scores = np.log([[0.6, 0.4], [0.7, 0.3]])
    tree = steps.tree([[[4, 5], [6, 7]], scores.tolist()], 1, 2, row)
    assert (tree.tokens, tree.parents, tree.depths, tree.ranks) == ([1, 5, 6, 4], [-1, 0, 1, 0], [0, 1, 2, 1], [0, 1, 0, 0])
    steps.budget = 10  # every node of positive mass, the unseen (4, 6) never
    assert sorted(steps.tree([[[4, 5], [6, 7]], scores.tolist()], 1, 2, row).tokens[1:]) == [4, 5, 6, 7, 7]
    # stats of order 2 cover head 2 only: (1, 4) seen a quarter as often, so 4 has 0.15 / 0.55 and
    # 5 0.40 / 0.55 of the mass; head 3 multiplies its parent's by its own probability
    pairs = np.ones((v, v))
    pairs[1, 4] = 0.25
    run.table = RatioTable(pairs)
    run.table.max_order = 2
    run.plan = resolve(cfg, model, run.table)
    steps = Trees(run, fallback_accuracies(2))
    steps.budget = 4
    tree = steps.tree([[[4, 5], [6, 7]], scores.tolist()], 1, 2, row)  # 5 (.73), 5-6 (.51), 4 (.27), 5-7 (.22)
    assert (tree.tokens, tree.parents, tree.depths, tree.ranks) == ([1, 5, 6, 4, 7], [-1, 0, 1, 0, 1], [0, 1, 2, 1, 2], [0, 1, 0, 0, 1])
    assert row.trace.dynamic_kernel  # the joint grids are counted in the row's trace


def test_embedded_joint_trees_accept_more_per_forward_than_the_heads_alone():
    model, _ = load_model(None)
    table = CooccurrenceTable.for_tokenizer(EMBEDDED_STATS, model.backbone.tokenizer)
    cfg = DecodeConfig(mode="speculative", greedy=True, max_new_tokens=48, tree="dynamic", tree_nodes="4")
    tokens, passes = {}, {}
    for label, tab in (("heads", None), ("joint", table)):
        runs = [generate(model, model.backbone.tokenizer.encode(p), cfg, table=tab) for p in STORIES]
        tokens[label] = [r.token_ids for r in runs]
        passes[label] = sum(r.trace.forward_passes for r in runs)
        assert ("co-occurrence" in runs[0].trace.tree_accuracies) == (tab is not None)
    assert tokens["joint"] == tokens["heads"]  # greedy: the same text
    assert passes["joint"] < passes["heads"]


def test_sibling_rejection_sampling_is_exact_on_one_step():
    """The token after the root is distributed as p whatever the siblings: the exact law of the
    walk (keep 1st with p(x1); else 2nd with p(x2) / (1 - p(x1)); ...; else the residual)."""

    class Fixed:
        greedy = False
        gen = torch.Generator().manual_seed(0)

        def uniform(self, n):
            return torch.rand(n, generator=self.gen, dtype=torch.float64)

        def draw(self, probs):
            return torch.multinomial(probs.float(), 1, generator=self.gen).reshape(())

    p = torch.tensor([[0.1, 0.5, 0.15, 0.25]])
    tree = Tree([0, 1, 3, 2], [-1, 0, 0, 0], [0, 1, 1, 1], [0, 0, 1, 2])
    sampler, counts = Fixed(), torch.zeros(4)
    for _ in range(4000):
        path, _ = sampled_walk(tree, read_walks([sampled_inputs(tree, p.expand(4, 4), sampler)])[0])
        after = int(sampled_draw(tree, p.expand(4, 4), path[-1], sampler))
        counts[tree.tokens[path[-1]] if len(path) > 1 else after] += 1
    assert chisquare(counts.numpy(), (p[0] * 4000).numpy()).pvalue > 1e-3

    def greedy(best):
        tokens, parents, level, root = torch.from_numpy(tree.judging())
        return verdict_of(tree, *greedy_kept(tokens, torch.tensor(best), parents, level, root > 0, 1).tolist())

    assert greedy([1, 0, 0, 0]).path == [0, 1] and greedy([2, 0, 0, 0]).path == [0, 3]


# accuracies, options, trace -------------------------------------------------------------------
def test_static_tree_reads_the_accuracies_beside_the_heads(tmp_path, tiny_backbones):
    model = attach(tiny_backbones["llama"], "medusa")
    ids = tiny_backbones["llama"].tokenizer(PROMPTS[2], return_tensors="pt").input_ids
    cfg = DecodeConfig(mode="speculative", greedy=True, max_new_tokens=6, tree="static", tree_nodes="4")
    assert generate(model, ids, cfg).trace.tree_accuracies == "fallback prior"
    (tmp_path / ACCURACY_FILE).write_text(json.dumps({"rank_accuracy": [[0.5, 0.3, 0.1], [0.2, 0.1, 0.05]]}))
    model.heads_dir = str(tmp_path)
    trace = generate(model, ids, cfg).trace
    assert trace.tree_accuracies == str(tmp_path / ACCURACY_FILE) and "accuracies:" in trace.summary(verbose=True)
    acc = read_accuracies(tmp_path, 3)  # a third draft head the file does not cover: the prior's row
    assert acc.table[:2] == [[0.5, 0.3, 0.1], [0.2, 0.1, 0.05]] and acc.table[2] == fallback_accuracies(3).table[2]
    (tmp_path / ACCURACY_FILE).write_text("{not json")
    assert read_accuracies(tmp_path, 2).source.startswith("fallback prior (")
    fixed = Accuracies([[0.9, 0.05], [0.9, 0.05]], "given")
    assert generate(model, ids, cfg, tree_accuracies=fixed).trace.tree_accuracies == "given"


def test_the_shipped_heads_shape_static_trees_by_their_measured_accuracies():
    # scripts/build_heads.py measures them on its greedy held-out text (multitoken eval)
    model, _ = load_model(None)  # the embedded default
    acc = read_accuracies(model.heads_dir, model.n_future - 1)
    assert acc.source == str(Path(model.heads_dir) / ACCURACY_FILE)
    assert all(len(row) == 32 and all(0 <= x <= 1 for x in row) and row[0] > 2 * row[1] for row in acc.table)
    assert acc.table != fallback_accuracies(model.n_future - 1).table
    ids = model.backbone.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    cfg = DecodeConfig(mode="speculative", greedy=True, max_new_tokens=4, tree="static", tree_nodes="4")
    assert generate(model, ids, cfg).trace.tree_accuracies == acc.source


def test_auto_budget_picks_one_of_the_timed_budgets(tiny_backbones):
    model = attach(tiny_backbones["gpt_neox"], "medusa")
    ids = tiny_backbones["gpt_neox"].tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    res = generate(model, ids, DecodeConfig(mode="speculative", greedy=True, max_new_tokens=8, tree="static"))
    assert res.trace.tree_nodes in (4, 8, 16, 32, 64) and res.token_ids == hf_greedy(tiny_backbones["gpt_neox"], ids, 8)


@pytest.mark.parametrize("kwargs,match", [
    ({"mode": "ar", "tree": "static"}, "needs --mode speculative"),
    ({"mode": "dynamic", "tree": "dynamic"}, "needs --mode speculative"),
    ({"tree": "bush"}, "unknown tree"),
    ({"tree": "static", "tree_nodes": "0"}, r"\[1, 256\]"),
    ({"tree": "static", "tree_nodes": "many"}, "integer or auto"),
    ({"tree_nodes": "8"}, r"pass --tree static\|dynamic"),
    ({"mode": "typical", "tree": "chain", "tree_nodes": "auto-ish"}, r"--tree static\|dynamic"),
])
def test_bad_tree_options_name_the_fix(kwargs, match):
    with pytest.raises(UsageError, match=match):
        DecodeConfig(**kwargs).validate()


def test_typical_tree_runs_and_chain_stays_the_default(tiny_backbones):
    model = attach(tiny_backbones["llama"], "replicated")
    ids = tiny_backbones["llama"].tokenizer(PROMPTS[1], return_tensors="pt").input_ids
    res = generate(model, ids, DecodeConfig(mode="typical", max_new_tokens=12, tree="dynamic", tree_nodes="6", seed=3))
    assert len(res.token_ids) == 12 and res.trace.tree == "dynamic"
    assert DecodeConfig().trees.tree == "chain" and generate(model, ids, DecodeConfig(max_new_tokens=4)).trace.tree == "chain"


def test_a_batch_of_tree_rows_equals_each_row_alone(tiny_backbones):
    """The package's entry point with a list of prompts: the rows' trees are verified together
    (``test_batch_tree.py``), each row with its own seed, streaming (row, tokens)."""
    backbone = tiny_backbones["gpt_neox"]
    model = attach(backbone, "medusa")
    prompts = [backbone.tokenizer(p).input_ids for p in PROMPTS[:2]]
    cfg = DecodeConfig(mode="speculative", max_new_tokens=12, tree="dynamic", tree_nodes="6")
    streamed = {0: [], 1: []}
    rows = generate_any(model, prompts, cfg, seeds=[3, 4], on_tokens=lambda row, t: streamed[row].extend(t))
    for row, (ids, seed) in enumerate(zip(prompts, [3, 4])):
        alone = generate(model, ids, DecodeConfig(mode="speculative", max_new_tokens=12, tree="dynamic", tree_nodes="6", seed=seed))
        assert rows[row].token_ids == alone.token_ids == streamed[row]
