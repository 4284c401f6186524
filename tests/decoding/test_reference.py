"""The engine against a reference loop of gpt-fast's size (its ``speculative_decode``, greedy,
the model's own heads as the draft model), written here from the model protocol alone: the
same tokens, the same forward passes, the same accepted lengths, step for step."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from multitoken.decoding import DecodeConfig, generate

from .conftest import attach
from .test_exactness import PROMPTS


@torch.inference_mode()
def reference(model, prompt: list[int], new: int, drafts_per_step: int) -> tuple[list[int], int, Counter]:
    """Greedy self-speculative decoding in one short loop -> (tokens, forward passes, accepted
    drafts per verification)."""
    caches = model.new_caches()
    out = model.step(torch.tensor([prompt]), caches, read_from=len(prompt) - 1)
    passes, accepted, tokens, at = 1, Counter(), [], len(prompt) - 1 - out.first  # at: the anchor's logits row

    def guesses(pos: int) -> tuple[int, list[int]]:  # the base's next token and each head's guess after it
        nxt = int(out.base_logits()[0, pos].argmax())
        return nxt, [int(out.anchor_head_log_probs(i, (pos + out.first,))[0].argmax()) for i in range(1, drafts_per_step + 1)]

    nxt, drafts = guesses(at)
    while True:
        tokens.append(nxt)
        k = min(drafts_per_step, new - len(tokens))
        if k < 0 or len(tokens) == new:
            return tokens, passes, accepted
        feed = [nxt] + drafts[:k]
        start = caches.length
        out = model.step(torch.tensor([feed]), caches)
        passes += 1
        best = out.base_logits()[0].argmax(-1).tolist()  # [1 + k]: the base's argmax after each fed token
        a = 0
        while a < k and feed[1 + a] == best[a]:
            a += 1
        if k:
            accepted[a] += 1
        tokens += feed[1:1 + a]
        caches.keep(start, [list(range(1 + a))])  # the rejected drafts forgotten
        if len(tokens) >= new:
            return tokens[:new], passes, accepted
        nxt, drafts = guesses(a)


@pytest.mark.parametrize("head_type", ["replicated", "medusa", "whs"])
@pytest.mark.parametrize("n", [2, 3])
def test_the_engine_follows_the_reference_loop_step_for_step(tiny_backbones, arch, head_type, n):
    model = attach(tiny_backbones[arch], head_type, n_future=3)
    tok = model.backbone.tokenizer
    for text in PROMPTS:
        prompt = tok(text).input_ids
        want, passes, accepted = reference(model, prompt, 20, n - 1)
        got = generate(model, prompt, DecodeConfig(mode="speculative", greedy=True, n=n, drafter="independent",
                                                   max_new_tokens=20, stop_at_eos=False))
        assert got.token_ids == want
        assert got.trace.forward_passes == passes and got.trace.accepted_lengths == accepted


def test_the_reference_loop_is_the_base_model_with_ar_passes_when_nothing_is_drafted(tiny_backbones, arch):
    """n = 1: the reference is plain argmax decoding, one pass per token, as the engine's ``ar``."""
    model = attach(tiny_backbones[arch], "replicated", n_future=2)
    prompt = model.backbone.tokenizer(PROMPTS[0]).input_ids
    want, passes, _ = reference(model, prompt, 12, 0)
    got = generate(model, prompt, DecodeConfig(mode="ar", greedy=True, max_new_tokens=12, stop_at_eos=False))
    assert got.token_ids == want and got.trace.forward_passes == passes == 12
