"""Lossless modes reproduce the base model: greedy token for token against transformers'
``generate``, sampling in distribution (chi-square on an enumerable vocabulary)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import generate
from multitoken.decoding.proposal import Drafts
from multitoken.pipeline.model.model import MultiTokenModel

from ..conftest import rank_odd_tokens
from .conftest import RatioTable, attach

PROMPTS = ["Once upon a time", "The little dog", "She said"]


def hf_greedy(backbone, ids: torch.Tensor, new: int) -> list[int]:
    out = backbone.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                  pad_token_id=backbone.tokenizer.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


def test_greedy_speculative_and_ar_equal_transformers_generate(tiny_backbones, arch, chain_head_type):
    backbone = tiny_backbones[arch]
    model = attach(backbone, chain_head_type)
    for prompt in PROMPTS:
        ids = backbone.tokenizer(prompt, return_tensors="pt").input_ids
        ref = hf_greedy(backbone, ids, 24)
        for mode in ("speculative", "ar"):
            got = generate(model, ids, DecodeConfig(mode=mode, greedy=True, max_new_tokens=24)).token_ids
            assert got == ref, (mode, prompt)


@pytest.mark.parametrize("head_type", ["replicated", "medusa"])
def test_greedy_speculative_with_joint_drafts_equals_generate(tiny_backbones, arch, head_type):
    backbone = tiny_backbones[arch]
    model = attach(backbone, head_type)
    ids = backbone.tokenizer(PROMPTS[1], return_tensors="pt").input_ids
    res = generate(model, ids, DecodeConfig(mode="speculative", greedy=True, max_new_tokens=24, drafter="joint"), table=RatioTable())
    assert res.token_ids == hf_greedy(backbone, ids, 24)


def test_whs_all_heads_still_verifies_with_the_base(tiny_backbones):
    """WHS "all heads" replaces head 1; lossless modes must still follow the base model."""
    backbone = tiny_backbones["llama"]
    model = MultiTokenModel.attach(backbone, {"head_type": "whs", "n_future": 3, "all_heads": True, "init": "random"})
    ids = backbone.tokenizer(PROMPTS[2], return_tensors="pt").input_ids
    ref = hf_greedy(backbone, ids, 16)
    for mode in ("ar", "speculative"):
        assert generate(model, ids, DecodeConfig(mode=mode, greedy=True, max_new_tokens=16)).token_ids == ref


def test_greedy_speculative_with_perfect_drafts_equals_generate(tiny_backbones, arch):
    """A drafter that knows the answer: every draft is accepted, caches are never cropped
    mid-run, and the output is still the base model's (n tokens per forward)."""
    backbone = tiny_backbones[arch]
    model = attach(backbone, "medusa")
    ids = backbone.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    ref = hf_greedy(backbone, ids, 30)
    full = ids[0].tolist() + ref

    def oracle(heads, first, g, row, run):
        pos = len(full) - len(ref) + run_len[0]  # index of ``first`` in ``full``
        return Drafts(torch.tensor(full[pos + 1: pos + 1 + g]), None)

    run_len = [0]

    def track(tokens):
        run_len[0] += len(tokens)

    res = generate(model, ids, DecodeConfig(mode="speculative", greedy=True, max_new_tokens=30), drafter=oracle, on_tokens=track)
    assert res.token_ids == ref
    assert res.trace.tokens_per_forward > 2.3  # 3 per verification pass, prompt pass excluded


def exact_pairs(backbone, prompt: list[int]) -> torch.Tensor:
    """p(x1, x2 | prompt) for every pair # -> [V, V]."""
    v = backbone.vocab_size
    with torch.no_grad():
        p1 = backbone.model(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        seqs = torch.tensor([prompt + [a] for a in range(v)])
        p2 = backbone.model(seqs).logits[:, -1].softmax(-1)  # [V, V]
    return p1[:, None] * p2


def sampled_pairs(model, prompt, runs: int, **kwargs):
    v = model.backbone.vocab_size
    counts = torch.zeros(v, v)
    accepted = torch.zeros(2)
    for seed in range(runs):
        res = generate(model, prompt, DecodeConfig(mode="speculative", temperature=1.0, top_k=v, max_new_tokens=2,
                                                   n=2, seed=seed, stop_at_eos=False), **kwargs)
        a, b = res.token_ids
        counts[a, b] += 1
        for length, c in res.trace.accepted_lengths.items():
            accepted[length] += c
    return counts, accepted


def merge_small_cells(obs: torch.Tensor, exp: torch.Tensor, least: float = 5.0):
    """Pool the cells expected fewer than ``least`` times (chi-square's validity condition)."""
    keep = exp >= least
    o, e = obs[keep], exp[keep].double()
    if (~keep).any():
        o = torch.cat([o, obs[~keep].sum(0, keepdim=True)])
        e = torch.cat([e, exp[~keep].sum(0, keepdim=True).double()])
    return o.double().numpy(), (e * o.sum() / e.sum()).numpy()


def rigged(heads, first, g, row, run):
    """A drafter blind to the context that prefers token 0: many drafts get rejected."""
    q = torch.tensor([0.7, 0.1, 0.1, 0.1]).expand(g, 4)
    tokens = torch.multinomial(q, 1, generator=row.sampler.gen).reshape(-1)
    return Drafts(tokens, q.clone())


@pytest.mark.parametrize("head_type,drafter", [("medusa", "heads"), ("medusa", "rigged"), ("medusa", "joint"), ("cp", "cp")])
def test_sampled_speculative_matches_base_distribution(small_vocab_backbone, head_type, drafter):
    model = attach(small_vocab_backbone, head_type, n_future=2)
    if head_type == "medusa":
        with torch.no_grad():  # a head clearly different from the base: q != p
            model.heads.blocks[0][0].linear.weight.normal_(0, 1.0)
    prompt = [0, 3, 1]
    kwargs = {"rigged": {"drafter": rigged}, "joint": {"table": RatioTable()}}.get(drafter, {})
    counts, accepted = sampled_pairs(model, prompt, 400, **kwargs)
    expected = exact_pairs(small_vocab_backbone, prompt) * counts.sum()
    stat = chisquare(*merge_small_cells(counts.flatten(), expected.flatten()))
    assert stat.pvalue > 1e-3, (counts, expected)
    assert accepted[0] > 20 and accepted[1] > 20  # acceptance was partial: both branches ran


@pytest.mark.parametrize("head_type", ["replicated", "conditioned"])
def test_greedy_with_a_draft_vocabulary_equals_generate(tiny_backbones, arch, head_type, tmp_path):
    """Drafts scored over a few tokens only (draft_vocab.py): chains, trees and batches still
    give transformers' greedy output (test_draft_vocab.py checks what the head rows read)."""
    backbone = tiny_backbones[arch]
    model = attach(backbone, head_type)
    rank_odd_tokens(model, tmp_path, backbone.vocab_size // 4)
    prompts = [backbone.tokenizer(p, return_tensors="pt").input_ids for p in PROMPTS]
    refs = [hf_greedy(backbone, ids, 20) for ids in prompts]
    for tree in ("chain", "static", "dynamic"):
        nodes = {"tree_nodes": "6"} if tree != "chain" else {}
        cfg = DecodeConfig(mode="speculative", greedy=True, max_new_tokens=20, tree=tree, **nodes)
        for ids, ref in zip(prompts, refs):
            res = generate(model, ids, cfg)
            assert res.token_ids == ref, (tree, ids)
    rows = [ids[0].tolist() for ids in prompts]
    batch = generate(model, rows, DecodeConfig(mode="speculative", greedy=True, max_new_tokens=20, tree="dynamic", tree_nodes="6"))
    assert [r.token_ids for r in batch] == refs


def test_sampled_speculative_with_a_draft_vocabulary_matches_the_base(small_vocab_backbone, tmp_path):
    """Drafts drawn over 2 of the 4 tokens (q zero elsewhere): the output keeps the base's
    distribution, and both acceptance branches run."""
    model = attach(small_vocab_backbone, "replicated", n_future=2)
    rank_odd_tokens(model, tmp_path, 1)  # token 1 only: every draft is 1, accepted with p(1) / q(1) = p(1)
    prompt = [0, 3, 1]
    counts, accepted = sampled_pairs(model, prompt, 400)
    expected = exact_pairs(small_vocab_backbone, prompt) * counts.sum()
    stat = chisquare(*merge_small_cells(counts.flatten(), expected.flatten()))
    assert stat.pvalue > 1e-3, (counts, expected)
    assert accepted[0] > 20 and accepted[1] > 20
