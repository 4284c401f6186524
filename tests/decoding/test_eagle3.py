"""Decoding with the eagle3 drafter (decoding/drafts.py): its drafts from its own KV cache
are the chain the training-time test computes over the final text, and the modes it does not
serve say so in one line. Greedy exactness against transformers and the
device reads are in test_exactness / test_batch / test_device with the other heads."""

from __future__ import annotations

import pytest
import torch

from multitoken.base.errors import UsageError
from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import generate
from multitoken.decoding.rules import greedy_accept, typical_rule

from .conftest import attach


def loose_typical(drafts, q, p, sampler, **kwargs):
    """Typical acceptance with a bound near 0: nearly every draft is kept, so the drafter
    catches up over several kept positions per step."""
    return typical_rule(1e-12, 1e-12)(drafts, q, p, sampler)


@pytest.mark.parametrize("rule", [greedy_accept, loose_typical], ids=["greedy", "loose-typical"])
def test_engine_drafts_are_the_training_time_chain_over_the_final_text(tiny_backbones, arch, rule):
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

    cfg = DecodeConfig(mode="speculative", greedy=True, max_new_tokens=20, stop_at_eos=False)
    res = generate(model, prompt, cfg, acceptor=judge, on_tokens=emitted.extend)
    text = prompt + res.token_ids
    with torch.no_grad():
        feats = model.features(torch.tensor([text]))
        steps = torch.stack([model.heads.log_probs(i, feats)[0].argmax(-1) for i in range(1, 4)]).tolist()  # [3, T]
    assert len(chains) >= 5 and any(len(d) == 3 for _, d in chains)
    for pos, drafts in chains:
        assert drafts == [steps[i][pos - 1] for i in range(len(drafts))], (pos, drafts)
    kept = sum(length * count for length, count in res.trace.accepted_lengths.items())
    if rule is loose_typical:
        assert kept >= len(chains)  # several positions kept per step: the catch-up ran over them


@pytest.mark.parametrize("settings,what", [
    (dict(mode="dynamic"), "--mode dynamic"), (dict(tree="static", tree_nodes="4"), "--tree static / dynamic"),
    (dict(tree="dynamic", tree_nodes="4"), "--tree static / dynamic"), (dict(lookup=3), "--lookup"),
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
