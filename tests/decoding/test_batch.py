"""Batched decoding: each row is exactly what it would be alone (greedy: == batch 1 == transformers'
``generate``; sampled: == batch 1 with the row's seed, and in distribution per row), whatever the
other rows do (different prompt lengths, acceptances, back-off orders, finishing times)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from multitoken.decoding import sampling as dynamo_candidates
from multitoken.decoding import generate as generate_any
from multitoken.decoding.engine import generate_batch
from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import generate
from multitoken.decoding.drafts import independent_drafts
from multitoken.decoding.proposal import Drafts
from multitoken.pipeline.model.loading import BackboneConfig, load_backbone

from .conftest import RatioTable, attach
from .test_exactness import exact_pairs, hf_greedy, merge_small_cells

TEXTS = ["Once upon a time", "The little dog ran to the big", "She", "He said that the"]


def encode(backbone, texts=TEXTS) -> list[list[int]]:
    return [backbone.tokenizer(t).input_ids for t in texts]


def alone(model, prompts, cfg, seeds=None, **kwargs) -> list[list[int]]:
    seeds = seeds or [cfg.sampling.seed] * len(prompts)
    return [generate(model, p, DecodeConfig(**{**cfg.__dict__, "seed": s}), **kwargs).token_ids for p, s in zip(prompts, seeds)]


def test_greedy_rows_equal_batch_one_and_transformers_generate(tiny_backbones, arch, chain_head_type):
    backbone = tiny_backbones[arch]
    model = attach(backbone, chain_head_type)
    prompts = encode(backbone)
    refs = [hf_greedy(backbone, torch.tensor([p]), 16) for p in prompts]
    for mode in ("ar", "speculative"):
        got = generate_batch(model, prompts, DecodeConfig(mode=mode, greedy=True, max_new_tokens=16, stop_at_eos=False))
        assert [r.token_ids for r in got] == refs, mode
        assert all(r.trace.batch_size == len(prompts) for r in got)


@pytest.mark.parametrize("mode,drafter,table", [
    ("speculative", "independent", False), ("speculative", "joint", True), ("typical", "auto", False),
    ("dynamic", "auto", True), ("dynamic", "auto", False), ("ar", "auto", False)])
@pytest.mark.parametrize("greedy", [True, False])
def test_every_mode_row_equals_the_row_alone_with_its_seed(tiny_backbones, arch, mode, drafter, table, greedy):
    model = attach(tiny_backbones[arch], "replicated")
    prompts = encode(model.backbone)
    seeds = [3, 1, 4, 1]
    cfg = DecodeConfig(mode=mode, drafter=drafter, greedy=greedy, max_new_tokens=14, eps_b=0.1, stop_at_eos=False)
    kwargs = {"table": RatioTable()} if table else {}
    got = generate_batch(model, prompts, cfg, seeds=seeds, **kwargs)
    assert [r.token_ids for r in got] == alone(model, prompts, cfg, seeds, **kwargs)


@pytest.mark.parametrize("head_type", ["cp", "medusa", "whs"])
def test_sampled_speculative_rows_of_every_drafter_head_equal_their_runs_alone(tiny_backbones, head_type):
    model = attach(tiny_backbones["llama"], head_type)
    prompts = encode(model.backbone)
    cfg = DecodeConfig(mode="speculative", max_new_tokens=14, stop_at_eos=False, temperature=1.0)
    got = generate_batch(model, prompts, cfg, seeds=[0, 1, 2, 3])
    assert [r.token_ids for r in got] == alone(model, prompts, cfg, [0, 1, 2, 3])


def test_rows_accepting_everything_nothing_and_some_in_one_batch(tiny_backbones, arch):
    """Row 0 drafts the reference continuation (all accepted), row 1 a token the base never
    picks (all rejected), row 2 its heads (some): each row still equals transformers."""
    backbone = tiny_backbones[arch]
    model = attach(backbone, "medusa")
    prompts = encode(backbone)[:3]
    refs = [hf_greedy(backbone, torch.tensor([p]), 18) for p in prompts]
    never = next(t for t in range(backbone.vocab_size) if all(t not in r for r in refs))

    produced = {0: [], 1: [], 2: []}  # tokens final so far per row (on_tokens)

    def drafter(heads, first, g, row_, run):
        row = row_.cfg.sampling.seed  # the seeds name the rows here
        if row == 0:  # ``first`` is the token after the ones produced so far
            done = len(produced[0])
            return Drafts(torch.tensor(refs[0][done + 1: done + 1 + g]), None)
        if row == 1:
            return Drafts(torch.full((g,), never), None)
        return independent_drafts(heads, first, g, row_, run)

    got = generate_batch(model, prompts, DecodeConfig(mode="speculative", greedy=True, max_new_tokens=18, stop_at_eos=False),
                         seeds=[0, 1, 2], drafter=drafter, on_tokens=lambda row, tokens: produced[row].extend(tokens))
    assert [r.token_ids for r in got] == refs
    assert set(got[0].trace.accepted_lengths) <= {2, 1}  # everything offered (1 only at the budget's end)
    assert set(got[1].trace.accepted_lengths) == {0}
    assert got[0].trace.forward_passes < got[1].trace.forward_passes  # the fast row finished first


def test_dynamic_rows_back_off_to_different_orders_in_one_step(small_vocab_backbone):
    """A peaked 4-token model: at eps_b 0.5 some rows emit 3 tokens while others back off."""
    model = attach(small_vocab_backbone, "replicated", n_future=3)
    prompts = [[0, 3, 1], [2, 1, 1, 0, 3], [1], [3, 3]]
    cfg = DecodeConfig(mode="dynamic", max_new_tokens=24, eps_b=0.5, top_k=4, stop_at_eos=False)
    got = generate_batch(model, prompts, cfg, seeds=[0, 1, 2, 3], table=RatioTable())
    assert [r.token_ids for r in got] == alone(model, prompts, cfg, [0, 1, 2, 3], table=RatioTable())
    orders = [dict(r.trace.orders) for r in got]
    assert len({tuple(sorted(o.items())) for o in orders}) > 1  # rows took different orders
    assert any(len(o) > 1 for o in orders)  # and a row backed off at some steps but not others


def test_rows_finish_at_different_times_by_eos_and_budget(tiny_backbones, arch):
    backbone = tiny_backbones[arch]
    model = attach(backbone, "replicated")
    prompts = encode(backbone)
    cfg = DecodeConfig(mode="speculative", greedy=True, max_new_tokens=20)
    first = generate_batch(model, prompts, DecodeConfig(mode="speculative", greedy=True, max_new_tokens=20, stop_at_eos=False))
    eos = first[1].token_ids[4]  # row 1 ends at its 5th token (others may end too, later or never)
    gen = backbone.causal_lm.generation_config
    saved = gen.eos_token_id
    gen.eos_token_id = eos
    try:
        got = generate_batch(model, prompts, cfg)
        solo = alone(model, prompts, cfg)
    finally:
        gen.eos_token_id = saved
    assert [r.token_ids for r in got] == solo
    assert len(got[1].token_ids) == 5 and got[1].token_ids[-1] == eos
    assert max(len(r.token_ids) for r in got) == 20  # another row ran to the budget
    assert got[1].trace.forward_passes < max(r.trace.forward_passes for r in got)  # it left the batch early


def test_padded_tensor_with_attention_mask_either_side(tiny_backbones):
    model = attach(tiny_backbones["gpt_neox"], "medusa")
    prompts = encode(model.backbone)
    width = max(map(len, prompts))
    cfg = DecodeConfig(mode="speculative", greedy=True, max_new_tokens=10, stop_at_eos=False)
    want = alone(model, prompts, cfg)
    for side in ("left", "right"):
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, p in enumerate(prompts):
            cols = slice(width - len(p), width) if side == "left" else slice(0, len(p))
            ids[b, cols], mask[b, cols] = torch.tensor(p), 1
        assert [r.token_ids for r in generate_any(model, ids, cfg, attention_mask=mask)] == want
    assert generate_any(model, prompts[0], cfg).token_ids == want[0]  # one prompt: one result


@pytest.mark.parametrize("arch,quantization", [("llama", "8bit"), ("gpt_neox", "4bit"), ("llama", "4bit"), ("gpt_neox", "8bit")])
def test_quantized_batch_rows_equal_their_own_generate(tiny_neox_q_dir, tiny_llama_q_dir, arch, quantization):
    base = {"llama": tiny_llama_q_dir, "gpt_neox": tiny_neox_q_dir}[arch]
    bb = load_backbone(BackboneConfig(base=str(base), quantization=quantization))
    model = attach(bb, "replicated")
    prompts = encode(bb)[:3]
    refs = [bb.model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=10,
                              do_sample=False, pad_token_id=bb.tokenizer.eos_token_id)[0, len(p):].tolist() for p in prompts]
    for mode in ("ar", "speculative"):
        got = generate_batch(model, prompts, DecodeConfig(mode=mode, greedy=True, max_new_tokens=10, stop_at_eos=False))
        assert [r.token_ids for r in got] == refs, mode


@pytest.mark.parametrize("drafter", ["heads", "joint"])
def test_sampled_rows_match_the_base_distribution_per_row(small_vocab_backbone, drafter):
    """200 seeds x 2 prompts of different lengths in ONE batch: each prompt's pairs pass the
    chi-square test against the exact base distribution (per row: its own prompt and seed)."""
    model = attach(small_vocab_backbone, "medusa", n_future=2)
    with torch.no_grad():
        model.heads.blocks[0][0].linear.weight.normal_(0, 1.0)
    prompts = [[0, 3, 1], [2, 1, 1, 0, 3]]
    runs = 200
    kwargs = {"table": RatioTable()} if drafter == "joint" else {}
    v = model.backbone.vocab_size
    cfg = DecodeConfig(mode="speculative", temperature=1.0, top_k=v, max_new_tokens=2, n=2, stop_at_eos=False)
    rows = [p for p in prompts for _ in range(runs)]
    seeds = [s for _ in prompts for s in range(runs)]
    got = generate_batch(model, rows, cfg, seeds=seeds, **kwargs)
    for k, prompt in enumerate(prompts):
        counts = torch.zeros(v, v)
        for res in got[k * runs:(k + 1) * runs]:
            a, b = res.token_ids
            counts[a, b] += 1
        expected = exact_pairs(small_vocab_backbone, prompt) * runs
        assert chisquare(*merge_small_cells(counts.flatten(), expected.flatten())).pvalue > 1e-3, (prompt, counts)
    assert got[7].token_ids == generate(model, rows[7], DecodeConfig(**{**cfg.__dict__, "seed": 7}), **kwargs).token_ids


def test_bad_batches_are_refused(tiny_backbones):
    from multitoken.base.errors import UsageError

    model = attach(tiny_backbones["llama"], "medusa")
    with pytest.raises(UsageError, match="empty"):
        generate_batch(model, [[1, 2], []], DecodeConfig())
    with pytest.raises(UsageError, match="seeds"):
        generate_batch(model, [[1, 2], [3]], DecodeConfig(), seeds=[1])
    with pytest.raises(UsageError, match="--seed"):
        generate_batch(model, [[1, 2], [3]], DecodeConfig(), seeds=[1, -1])


@pytest.mark.parametrize("compact", [False, True])
def test_ragged_caches_equal_each_row_recomputed_alone(tiny_backbones, arch, head_type, compact, monkeypatch):
    """Left-padded prompts, steps of different lengths per row, per-row crops of rejected
    drafts, a row leaving, optionally compaction: every row's heads at every real position of
    a step equal a full pass over that row's own tokens."""
    from multitoken.pipeline.runtime import ragged
    from multitoken.decoding.proposal import left_pad

    if compact:
        monkeypatch.setattr(ragged, "COMPACT_MIN", 0)
        monkeypatch.setattr(ragged, "COMPACT_SLACK", 0.0)
    model = attach(tiny_backbones[arch], head_type)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 9, 2)]
    caches, kept = model.new_caches(), [0, 1, 2]

    def feed(pieces: list[list[int]]):
        width = max(map(len, pieces))
        out = model.step(left_pad([torch.tensor(p) for p in pieces], width, "cpu"), caches, lengths=[len(p) for p in pieces])
        for j, (row, piece) in enumerate(zip(kept, pieces)):
            full = torch.stack([lp[0] for lp in model.head_logits(torch.tensor([seqs[row]]), last_only=False, next_known=0)])  # [n, T, V]
            for k in range(len(piece)):
                pos = width - len(piece) + k
                got = torch.stack([out.head_log_probs(i, pos)[j] for i in range(model.n_future)])
                torch.testing.assert_close(got, full[:, len(seqs[row]) - len(piece) + k], atol=1e-4, rtol=1e-4)

    feed([list(s) for s in seqs])
    for step, (new, drop) in enumerate([([3, 1, 2], [2, 0, 1]), ([1, 3, 3], [0, 2, 2]), ([2, 1], [1, 0])]):
        pieces = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in new]
        for row, p in zip(kept, pieces):
            seqs[row] += p
        start, width = caches.length, max(new)
        feed(pieces)
        caches.keep(start, [list(range(width - n, width - d)) for n, d in zip(new, drop)])  # each row's rejected tail forgotten
        for row, d in zip(kept, drop):
            seqs[row] = seqs[row][: len(seqs[row]) - d]
        if step == 1:
            caches.keep_rows([0, 2])
            kept = [0, 2]
    assert caches.row_lengths(len(kept)) == [len(seqs[r]) for r in kept]
    assert (caches.compactions > 0) == compact


@pytest.mark.parametrize("mode", ["speculative", "joint", "dynamic", "ar"])
def test_one_host_read_per_step_for_the_whole_batch(tiny_backbones, mode, monkeypatch):
    """Reads of tensor values (``tolist`` / ``cpu`` / ``item``) per step do not grow with the
    batch: the committed ids, the verdicts and DynaMo's top-k of every row cross together."""
    model = attach(tiny_backbones["llama"], "replicated")
    prompts = encode(model.backbone)
    joint = mode == "joint"  # speculative with the joint drafter: every row's top-k in one read too
    cfg = DecodeConfig(mode="speculative" if joint else mode, drafter="joint" if joint else "auto", max_new_tokens=12,
                       eps_b=0.0, stop_at_eos=False)
    # on the CPU, top-k runs on the host (dynamo.exact_topk) and reads nothing; count the device path's reads
    monkeypatch.setattr(dynamo_candidates, "exact_topk", lambda *a: None)
    reads = []
    for name in ("tolist", "cpu", "item"):
        plain = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, (lambda f, n: lambda self, *a, **k: (reads.append(n), f(self, *a, **k))[1])(plain, name))
    got = generate_batch(model, prompts, cfg, seeds=[0, 1, 2, 3], table=RatioTable() if joint else None)
    steps = max(r.trace.forward_passes for r in got)  # proposals: one per pass (the last needs no pass after it)
    # the prompts are read once each, as lists; then one read per step, whatever the batch size
    drafting = steps - 1 if joint else 0  # joint drafts: the heads' top-k of every row, once per drafting step
    assert len(reads) - len(prompts) == steps + drafting, reads


def test_eager_attention_takes_the_additive_ragged_mask(tiny_model_dir):
    """Kernels other than SDPA read an additive float mask: rows still equal transformers'."""
    bb = load_backbone(BackboneConfig(base=str(tiny_model_dir)))
    bb.causal_lm.set_attn_implementation("eager")
    assert bb.config._attn_implementation == "eager"
    model = attach(bb, "replicated")
    prompts = encode(bb)[:3]
    refs = [hf_greedy(bb, torch.tensor([p]), 12) for p in prompts]
    got = generate_batch(model, prompts, DecodeConfig(mode="speculative", greedy=True, max_new_tokens=12, stop_at_eos=False))
    assert [r.token_ids for r in got] == refs
