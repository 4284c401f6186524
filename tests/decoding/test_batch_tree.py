"""Batched tree verification (issue 17, point 5): B rows with their own candidate trees in one
forward pass per step. Each row equals that row decoded alone (greedy: transformers' ``generate``;
sampled / typical: token for token with its seed); the batched tree mask and positions against
hand-built ones; per-row path compaction against a fresh forward over each row's text."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multitoken.decoding.engine import generate_batch
from multitoken.decoding.proposal import left_pad
from multitoken.decoding.tree_proposer import Trees
from multitoken.decoding.trees import attend_rows
from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import generate
from multitoken.decoding.trees import Tree
from multitoken.decoding.rules import read_walks
from multitoken.base.errors import UsageError
from multitoken.pipeline.runtime import ragged
from multitoken.pipeline.sources.assets import load_model

from .conftest import RatioTable, attach
from .test_batch import alone, encode
from .test_exactness import hf_greedy
from .test_tree import TREE

SMALL = Tree(tokens=[4, 6, 8], parents=[-1, 0, 0], depths=[0, 1, 1], ranks=[0, 0, 1])  # a root, two siblings


@pytest.mark.parametrize("tree,nodes", [("static", "5"), ("dynamic", "8")])
def test_greedy_tree_rows_equal_transformers_generate(tiny_backbones, arch, head_type, tree, nodes):
    backbone = tiny_backbones[arch]
    model = attach(backbone, head_type)
    prompts = encode(backbone)  # 4 prompts of different lengths
    refs = [hf_greedy(backbone, torch.tensor([p]), 16) for p in prompts]
    cfg = DecodeConfig(mode="speculative", greedy=True, max_new_tokens=16, stop_at_eos=False, tree=tree, tree_nodes=nodes)
    got = generate_batch(model, prompts, cfg)
    assert [r.token_ids for r in got] == refs
    assert all(r.trace.tree == tree and r.trace.tree_nodes == int(nodes) and r.trace.batch_size == 4 for r in got)
    assert [r.trace.forward_passes for r in got] == [generate(model, p, cfg).trace.forward_passes for p in prompts]


@pytest.mark.parametrize("tree", ["static", "dynamic"])
@pytest.mark.parametrize("mode,greedy,penalty", [("speculative", False, None), ("typical", False, None),
                                                 ("speculative", True, 1.3)])
def test_sampled_typical_and_penalised_tree_rows_equal_their_runs_alone(tiny_backbones, arch, tree, mode, greedy, penalty):
    model = attach(tiny_backbones[arch], "replicated")
    prompts = encode(model.backbone)
    seeds = [3, 1, 4, 1]
    cfg = DecodeConfig(mode=mode, greedy=greedy, repetition_penalty=penalty, max_new_tokens=14, stop_at_eos=False,
                       tree=tree, tree_nodes="6")
    got = generate_batch(model, prompts, cfg, seeds=seeds)
    assert [r.token_ids for r in got] == alone(model, prompts, cfg, seeds)


@pytest.mark.parametrize("mode,greedy", [("speculative", True), ("speculative", False), ("typical", False)])
def test_joint_tree_rows_equal_their_runs_alone(tiny_backbones, arch, mode, greedy):
    model = attach(tiny_backbones[arch], "replicated")
    prompts = encode(model.backbone)
    cfg = DecodeConfig(mode=mode, greedy=greedy, max_new_tokens=14, stop_at_eos=False, tree="dynamic",
                       tree_nodes="6", draft_k=5)
    got = generate_batch(model, prompts, cfg, seeds=[3, 1, 4, 1], table=RatioTable())
    assert [r.token_ids for r in got] == alone(model, prompts, cfg, [3, 1, 4, 1], table=RatioTable())
    assert all("co-occurrence" in r.trace.tree_accuracies for r in got)


@pytest.fixture(scope="module")
def embedded():
    return load_model(None)[0]


@pytest.mark.parametrize("greedy", [True, False])
def test_rows_accepting_long_paths_and_later_siblings_leave_at_different_times(embedded, greedy):
    """The embedded model's trained heads: rows accept paths of several nodes and siblings past
    the first, different lengths per step; an end of sequence met by one row makes it leave
    the batch early. Streaming per row too."""
    model = embedded
    prompts = encode(model.backbone, ["The little dog ran to the park and", "Once upon a time", "Lily saw a big red"])
    cfg = DecodeConfig(mode="speculative", greedy=greedy, max_new_tokens=30, stop_at_eos=False, tree="dynamic", tree_nodes="12")
    seeds = [0, 1, 2]
    streamed = {b: [] for b in range(len(prompts))}
    got = generate_batch(model, prompts, cfg, seeds=seeds, on_tokens=lambda row, t: streamed[row].extend(t))
    want = alone(model, prompts, cfg, seeds)
    assert [r.token_ids for r in got] == want == [streamed[b] for b in range(len(prompts))]
    assert max(max(r.trace.accepted_lengths) for r in got) >= 2
    assert sum(c for r in got for k, c in r.trace.tree_sibling_ranks.items() if k > 0) > 0
    eos = got[1].token_ids[6]
    gen = model.backbone.causal_lm.generation_config
    saved = gen.eos_token_id
    gen.eos_token_id = eos
    try:
        stop = DecodeConfig(**{**cfg.__dict__, "stop_at_eos": True})
        early = generate_batch(model, prompts, stop, seeds=seeds)
        assert [r.token_ids for r in early] == alone(model, prompts, stop, seeds)
    finally:
        gen.eos_token_id = saved
    assert early[1].token_ids[-1] == eos and len(early[1].token_ids) <= 7
    assert early[1].trace.forward_passes < max(r.trace.forward_passes for r in early)


def test_rows_stay_exact_when_holes_are_compacted_away(embedded, monkeypatch):
    """Rows accepting different path lengths leave holes; compaction forced whenever there is one."""
    monkeypatch.setattr(ragged, "COMPACT_MIN", 0)
    monkeypatch.setattr(ragged, "COMPACT_SLACK", 0.0)
    gathers = []
    plain = ragged.compact_index
    monkeypatch.setattr(ragged, "compact_index", lambda valid: (gathers.append(valid.shape), plain(valid))[1])
    prompts = encode(embedded.backbone, ["The little dog ran to the park and", "Once upon a time", "Lily saw"])
    cfg = DecodeConfig(mode="speculative", greedy=True, max_new_tokens=24, stop_at_eos=False, tree="static", tree_nodes="8")
    got = generate_batch(embedded, prompts, cfg)
    assert [r.token_ids for r in got] == alone(embedded, prompts, cfg)
    assert gathers


def test_one_node_trees_and_custom_drafters(tiny_backbones):
    """n = 1: every tree is its root alone (nothing to verify), as batch 1 does; a custom drafter
    or acceptor cannot go with a tree, batched or not."""
    model = attach(tiny_backbones["llama"], "medusa")
    prompts = encode(model.backbone)[:3]
    cfg = DecodeConfig(mode="speculative", n=1, max_new_tokens=6, stop_at_eos=False, tree="static", tree_nodes="3")
    got = generate_batch(model, prompts, cfg, seeds=[5, 6, 7])
    assert [r.token_ids for r in got] == alone(model, prompts, cfg, [5, 6, 7])
    with pytest.raises(UsageError, match="--tree chain"):
        generate_batch(model, prompts, cfg, drafter=lambda *a: None)


def test_batched_tree_mask_and_positions_match_hand_built_ones(tiny_backbones):
    """Row 0: the 6-node TREE after 3 context slots; row 1: a root and two siblings after 2
    tokens (its first slot a left pad), right-aligned after 3 step pads."""
    bb = tiny_backbones["llama"]
    attend = torch.from_numpy(attend_rows([TREE, SMALL], 6))
    offsets = torch.tensor([TREE.depths, [0, 0, 0] + SMALL.depths])
    past_valid = np.array([[True, True, True], [False, True, True]])
    new_valid = ragged.step_valid([6, 3], 6)
    ctx = ragged.tree_context(bb, torch.zeros(2, 6, bb.hidden_size), past_valid, 3, new_valid, attend, offsets)
    assert ctx.position_ids.tolist() == [[3, 4, 4, 5, 5, 6], [0, 0, 0, 2, 3, 3]]
    row0 = torch.cat([torch.ones(6, 3, dtype=torch.bool), TREE.attend()], 1)
    row1 = torch.tensor([[0, 0, 0, 1, 0, 0, 0, 0, 0],  # pads: themselves only
                         [0, 0, 0, 0, 1, 0, 0, 0, 0],
                         [0, 0, 0, 0, 0, 1, 0, 0, 0],
                         [0, 1, 1, 0, 0, 0, 1, 0, 0],  # root: the row's past, itself
                         [0, 1, 1, 0, 0, 0, 1, 1, 0],  # siblings: past, root, themselves
                         [0, 1, 1, 0, 0, 0, 1, 0, 1]], dtype=torch.bool)
    assert ctx.mask.shape == (2, 1, 6, 9)
    assert torch.equal(ctx.mask[0, 0], row0) and torch.equal(ctx.mask[1, 0], row1)


@pytest.mark.parametrize("head_type", ["replicated", "whs", "medusa"])
def test_kept_paths_equal_a_fresh_forward_over_each_rows_text(tiny_backbones, arch, head_type):
    """Two ragged rows, one tree step each (TREE; SMALL), each row's path kept (one not a prefix
    of its nodes, one a later sibling), then a token per row: every head at that token equals
    a full pass over the row's own text; the caches hold each row's tokens, no more."""
    model = attach(tiny_backbones[arch], head_type)
    contexts = [[3, 8, 1, 4], [9, 2]]
    caches = model.new_caches()
    model.step(left_pad([torch.tensor(c) for c in contexts], 4, "cpu"), caches, lengths=[4, 2])
    ids = torch.tensor([TREE.tokens, [0, 0, 0] + SMALL.tokens])
    offsets = torch.tensor([TREE.depths, [0, 0, 0] + SMALL.depths])
    model.step(ids, caches, lengths=[6, 3], attend=torch.from_numpy(attend_rows([TREE, SMALL], 6)), offsets=offsets)
    paths = [TREE.path(5), SMALL.path(2)]  # [0, 2, 4, 5], [0, 2]
    caches.keep(4, [paths[0], [3 + i for i in paths[1]]])
    texts = [contexts[0] + [TREE.tokens[i] for i in paths[0]], contexts[1] + [SMALL.tokens[i] for i in paths[1]]]
    assert caches.length == 4 + 4 and caches.row_lengths(2) == [len(t) for t in texts]
    out = model.step(torch.tensor([[19], [23]]), caches, lengths=[1, 1])
    for row, (text, nxt) in enumerate(zip(texts, (19, 23))):
        full = model.head_logits(torch.tensor([text + [nxt]]), last_only=True)
        for i in range(model.n_future):
            torch.testing.assert_close(out.head_log_probs(i, 0)[row], full[i][0, 0], atol=1e-4, rtol=1e-4)


def test_equal_paths_keep_the_unmasked_layout(tiny_backbones):
    """Rows keeping paths of one length with no holes before: no mask left (batch 1's fast path)."""
    model = attach(tiny_backbones["gpt_neox"], "replicated")
    caches = model.new_caches()
    model.step(torch.tensor([[3, 8, 1], [9, 2, 7]]), caches)
    model.step(torch.tensor([SMALL.tokens, SMALL.tokens]), caches, attend=torch.from_numpy(attend_rows([SMALL, SMALL], 3)),
               offsets=torch.tensor([SMALL.depths] * 2))
    caches.keep(3, [[0, 2], [0, 1]])
    assert caches.valid is None and caches.length == 5


@pytest.mark.parametrize("tree", ["static", "dynamic"])
@pytest.mark.parametrize("mode,greedy,verdict_reads", [("speculative", True, 1), ("speculative", False, 2),
                                                       ("typical", False, 2)])
@pytest.mark.parametrize("rows", [1, 4])
def test_a_batched_tree_step_reads_the_device_as_often_for_every_batch_size(tiny_backbones, tree, mode, greedy,
                                                                            verdict_reads, rows, monkeypatch):
    """Reads of tensor values per step do not grow with the batch: every row's guesses in one
    read, then greedy: every row's argmax after every node in one; sampled / typical: every
    row's walk inputs in one and every row's token after its path in one. A static tree under
    greedy verification at full depth in every row reads once: tokens and verdicts together."""
    model = attach(tiny_backbones["llama"], "replicated")
    prompts = encode(model.backbone)[:rows]
    cfg = DecodeConfig(mode=mode, greedy=greedy, max_new_tokens=12, stop_at_eos=False, tree=tree, tree_nodes="6")
    model.prepare_linears()  # packing the CPU linears reads their weights, once per model, before any step
    reads, on_device = [], []
    plain = Trees.__call__

    def propose(self, *args):
        proposal = plain(self, *args)
        on_device.append(proposal.static is not None)
        return proposal
    monkeypatch.setattr(Trees, "__call__", propose)
    for name in ("tolist", "cpu", "item", "numpy", "__int__", "__float__", "__bool__", "__index__"):
        counted = (lambda f, n: lambda self, *a, **k: (reads.append(n), f(self, *a, **k))[1])(getattr(torch.Tensor, name), name)
        monkeypatch.setattr(torch.Tensor, name, counted)
    got = generate_batch(model, prompts, cfg, seeds=list(range(rows)))
    steps = max(r.trace.forward_passes for r in got) - 1  # tree passes after the prompts'
    assert steps >= 3 and len(on_device) in (steps, steps + 1)  # the last may be a lone root, never fed
    # static greedy: every step but those where a row's last tokens make its tree shallower
    assert sum(on_device) >= steps - rows if tree == "static" and greedy else not any(on_device)
    # the prompts once each, as lists; the first roots after the prompts' pass; then per tree step
    assert len(reads) == len(prompts) + 1 + (1 + verdict_reads) * steps - sum(on_device), reads


def test_walk_inputs_of_rows_of_different_shapes_cross_in_one_read(monkeypatch):
    """``read_walks``: rows [N_b, C_b] of one dtype flattened into one transfer, split back exactly."""
    rows = [torch.arange(6, dtype=torch.float64).reshape(2, 3), torch.arange(10, 15, dtype=torch.float64).reshape(1, 5),
            torch.zeros(0, 4, dtype=torch.float64)]
    reads = []
    plain = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: (reads.append(self.shape), plain(self))[1])
    assert read_walks(rows) == [[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], [[10.0, 11.0, 12.0, 13.0, 14.0]], []]
    assert reads == [(11,)]
