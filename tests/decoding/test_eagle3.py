"""Decoding with the eagle3 drafter (decoding/drafts.py): its drafts from its own KV cache
are the chain the training-time test computes over the final text, sampled chains keep the
base's distribution (drafts over a draft vocabulary included), rows equal their runs alone, and
the modes it does not serve say so in one line. Greedy exactness against transformers and the
device reads are in test_exactness / test_batch / test_device with the other heads."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from multitoken.base.errors import UsageError
from multitoken.decoding.drafts import Eagle3Chains
from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import generate, generate_batch
from multitoken.decoding.rules import greedy_accept, typical_rule
from multitoken.pipeline.model.model import MultiTokenModel

from .conftest import attach
from .test_batch import alone, encode
from .test_exactness import merge_small_cells


def loose_typical(drafts, q, p, sampler, **kwargs):
    """Typical acceptance with a bound near 0: nearly every draft is kept, so the drafter
    catches up over several kept positions per step."""
    return typical_rule(1e-12, 1e-12)(drafts, q, p, sampler)


@pytest.mark.parametrize("rule", [greedy_accept, loose_typical], ids=["greedy", "loose-typical"])
def test_engine_drafts_are_the_training_time_chain_over_the_final_text(tiny_backbones, arch, rule, monkeypatch):
    """Every chain the engine drafted after the token at text position p equals the drafter's
    greedy chain that ``log_probs`` computes from one full pass over the final text at p - 1
    (step 1 reading the token at p): the cache holds the right slots at the right positions
    after every verdict, whatever each step kept."""
    model = attach(tiny_backbones[arch], "eagle3", n_future=4)
    prompt = model.backbone.tokenizer("The little dog").input_ids
    emitted, chains = [], []

    def judge(drafts, q, p, sampler, **kwargs):
        chains.append((len(prompt) + len(emitted) - 1, drafts.tolist()))  # the committed token's position
        return rule(drafts, q, p, sampler, **kwargs)

    calls, step = [], model.heads.step

    def spy(hidden, token_ids, cache, positions, *args, **kwargs):  # every drafter pass: its positions and logits
        logits, out = step(hidden, token_ids, cache, positions, *args, **kwargs)
        calls.append((positions[0].tolist(), logits[0]))
        return logits, out

    model.heads.step = spy
    catch_up = Eagle3Chains.catch_up
    monkeypatch.setattr(Eagle3Chains, "catch_up", lambda self, *a: calls.append(None) or catch_up(self, *a))
    cfg = DecodeConfig(mode="speculative", greedy=True, max_new_tokens=20, stop_at_eos=False)
    res = generate(model, prompt, cfg, acceptor=judge, on_tokens=emitted.extend)
    text = prompt + res.token_ids
    with torch.no_grad():
        feats = model.features(torch.tensor([text]))
        full = [model.heads.log_probs(i, feats)[0] for i in range(1, 4)]  # 3 x [T, V]
    steps = torch.stack([lp.argmax(-1) for lp in full]).tolist()  # [3, T]
    assert len(chains) >= 5 and any(len(d) == 3 for _, d in chains)
    for pos, drafts in chains:
        assert drafts == [steps[i][pos - 1] for i in range(len(drafts))], (pos, drafts)
    # every drafter pass's logits equal the full pass's, at its step and anchor: its slots and positions are right
    anchor, caught_up = None, False
    for call in calls:
        if call is None:  # a catch-up's pass follows: step 1 at every position it covers
            caught_up = True
            continue
        positions, logits = call
        if caught_up:
            at, index, anchor, caught_up = positions, 0, positions[-1], False
        else:  # step i + 1 at position anchor + i
            at, index = [anchor], positions[0] - anchor
        torch.testing.assert_close(model.heads.target_log_probs(logits), full[index][at], atol=1e-4, rtol=1e-4)
    assert sum(call is None for call in calls) == len(chains) and len(calls) > 3 * len(chains)
    kept = sum(length * count for length, count in res.trace.accepted_lengths.items())
    if rule is loose_typical:
        assert kept >= len(chains)  # several positions kept per step: the catch-up ran over them


def exact_triples(backbone, prompt: list[int]) -> torch.Tensor:
    """p(x1, x2, x3 | prompt) for every triple # -> [V, V, V]."""
    v = backbone.vocab_size
    with torch.no_grad():
        p1 = backbone.model(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        p2 = backbone.model(torch.tensor([prompt + [a] for a in range(v)])).logits[:, -1].softmax(-1)  # [V, V]
        seqs = torch.tensor([prompt + [a, b] for a in range(v) for b in range(v)])
        p3 = backbone.model(seqs).logits[:, -1].softmax(-1).reshape(v, v, v)
    return p1[:, None, None] * p2[:, :, None] * p3


def small_drafter(backbone, vocab_ids=None) -> MultiTokenModel:
    """An untrained eagle3 drafter of 2 steps on the 4-token model, far from the base (q != p);
    ``vocab_ids``: the draft vocabulary (None: every token)."""
    torch.manual_seed(0)
    size = 0 if vocab_ids is None else len(vocab_ids)
    model = MultiTokenModel.attach(backbone, {"head_type": "eagle3", "n_future": 3, "draft_vocab_size": size})
    if vocab_ids is not None:
        model.heads.set_draft_vocab(vocab_ids)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return model.eval()


@pytest.mark.parametrize("vocab_ids", [None, [1, 3]], ids=["whole-vocab", "draft-vocab"])
def test_sampled_eagle3_chains_keep_the_base_distribution(small_vocab_backbone, vocab_ids):
    """Two sampled drafts per step (the second from the drafter's own cached step), judged by
    rejection sampling: every 3-token continuation follows the base (chi-square), with drafts
    kept and rejected; over a draft vocabulary the drafts' q is 0 outside it."""
    model = small_drafter(small_vocab_backbone, vocab_ids)
    prompt, v = [0, 3, 1], small_vocab_backbone.vocab_size
    counts, accepted = torch.zeros(v, v, v), torch.zeros(3)
    for seed in range(500):
        res = generate(model, prompt, DecodeConfig(mode="speculative", temperature=1.0, top_k=v, max_new_tokens=3,
                                                   seed=seed, stop_at_eos=False))
        counts[tuple(res.token_ids)] += 1
        for length, c in res.trace.accepted_lengths.items():
            accepted[length] += c
    expected = exact_triples(small_vocab_backbone, prompt) * counts.sum()
    stat = chisquare(*merge_small_cells(counts.flatten(), expected.flatten()))
    assert stat.pvalue > 1e-3, (counts, expected)
    assert accepted[0] > 20 and accepted[1:].sum() > 20  # both branches ran
    if vocab_ids is not None:
        assert accepted[2] > 0  # two drafts kept in one step: both were in the draft vocabulary


@pytest.mark.parametrize("tree", ["chain", "dynamic"])
@pytest.mark.parametrize("mode", ["speculative", "typical"])
@pytest.mark.parametrize("greedy", [True, False])
def test_eagle3_rows_equal_their_runs_alone(tiny_backbones, mode, greedy, tree):
    """Rows of one batch keep different counts each step (one drafter cache, slot = position): every
    row equals its run alone with its seed, sampled and typical included, chains and trees."""
    model = attach(tiny_backbones["llama"], "eagle3")
    prompts, seeds = encode(model.backbone), [3, 1, 4, 1]
    cfg = DecodeConfig(mode=mode, greedy=greedy, max_new_tokens=14, stop_at_eos=False, temperature=1.0, tree=tree,
                       tree_nodes="6" if tree == "dynamic" else "auto")
    got = generate_batch(model, prompts, cfg, seeds=seeds)
    assert [r.token_ids for r in got] == alone(model, prompts, cfg, seeds)


@pytest.mark.parametrize("settings,what", [
    (dict(mode="dynamic", dynamic_joint="outer"), "--dynamic-joint outer"), (dict(tree="static", tree_nodes="4"), "--tree static"),
    (dict(lookup=3), "--lookup"), (dict(tree="dynamic", lookup=3), "--lookup"),
    (dict(drafter="independent"), "--drafter independent")])
def test_modes_eagle3_does_not_serve_are_refused_in_one_line(tiny_backbones, settings, what):
    model = attach(tiny_backbones["llama"], "eagle3")
    with pytest.raises(UsageError) as err:
        generate(model, [1, 5, 9], DecodeConfig(max_new_tokens=4, **settings))
    assert what in err.value.problem and "\n" not in err.value.problem and err.value.fix
    assert len(generate(model, [1, 5, 9], DecodeConfig(mode="ar", max_new_tokens=3)).token_ids) == 3


def test_the_eagle3_drafter_needs_eagle3_heads(tiny_backbones):
    model = attach(tiny_backbones["llama"], "medusa")
    with pytest.raises(UsageError, match="--drafter eagle3"):
        generate(model, [1, 5, 9], DecodeConfig(drafter="eagle3", max_new_tokens=4))


def test_dynamic_trees_grow_the_drafters_own_chain_and_decode_exactly(tiny_backbones, arch, monkeypatch):
    """EAGLE-2's tree from the drafter: with every candidate kept, each node's best child is
    the drafter's greedy chain (the training-time test's over the final text) as deep as it was
    expanded, so its expansions saw the right slots; greedy output equals transformers'."""
    from multitoken.decoding import tree_proposer

    from .test_exactness import hf_greedy

    model = attach(tiny_backbones[arch], "eagle3", n_future=4)
    ids = model.backbone.tokenizer("Once upon a time", return_tensors="pt").input_ids
    grown, plain = [], tree_proposer.Eagle3Trees.__call__

    def spy(self, out, rows, anchors, live):
        lengths = {j: len(rows[j].prompt) + len(rows[j].out_ids) for j in live}
        proposal = plain(self, out, rows, anchors, live)
        grown.extend((lengths[j], proposal.trees[s]) for s, j in enumerate(live))
        return proposal

    monkeypatch.setattr(tree_proposer.Eagle3Trees, "__call__", spy)
    calls, step = [], model.heads.step

    def spy_step(hidden, token_ids, cache, positions, attend=None, *args, **kwargs):  # catch-ups (attend None), then expansions
        logits, out = step(hidden, token_ids, cache, positions, attend, *args, **kwargs)
        calls.append((attend is None, positions[0].tolist(), logits[0]))
        return logits, out

    model.heads.step = spy_step
    res = generate(model, ids, DecodeConfig(mode="speculative", greedy=True, max_new_tokens=20, tree="dynamic", tree_nodes="64"))
    assert res.token_ids == hf_greedy(model.backbone, ids, 20)
    text = ids[0].tolist() + res.token_ids
    with torch.no_grad():
        steps = torch.stack([model.heads.log_probs(i, model.features(torch.tensor([text])))[0].argmax(-1) for i in range(1, 4)]).tolist()
    with torch.no_grad():
        second = model.heads.log_probs(2, model.features(torch.tensor([text])))[0]  # [T, V]
    firsts = [(positions[-1], calls[c + 1]) for c, (caught, positions, _) in enumerate(calls[:-1]) if caught and not calls[c + 1][0]]
    assert len(firsts) >= 5
    for anchor, (_, positions, logits) in firsts:  # depth 1's best node, expanded first: step 2 at the anchor
        assert positions[0] == anchor + 1
        torch.testing.assert_close(model.heads.target_log_probs(logits[0]), second[anchor], atol=1e-4, rtol=1e-4)
    reached = []
    for length, tree in grown:
        node, depth = 0, 0
        while tree.children[node]:
            node = tree.children[node][0]  # rank 0: the drafter's most probable child
            assert tree.tokens[node] == steps[depth][length - 1], (length, depth)
            depth += 1
        reached.append(depth)
    assert len(grown) >= 5 and min(reached[:-2]) >= 1 and max(reached) == 3
