"""``MultiTokenModel.step`` with explicit caches == a full recompute, for every head type, both
architectures, float and quantized backbones; cropping forgets exactly the rejected positions."""

from __future__ import annotations

import os

import pytest
import torch

from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import generate
from multitoken.kernels import cpu_linear
from multitoken.pipeline.runtime import unembed_costs
from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
from multitoken.pipeline.runtime.unembed_costs import LINEAR, TRANSPOSED, UnembedCosts, fixed_costs, costs_for

from .conftest import attach


@pytest.fixture
def three_fast_rows(monkeypatch):
    """The unembedding plan pinned to a rule (up to 3 rows at the 1-row rate, then (W x^T)^T):
    the CPU's measured plan depends on the machine and its load."""
    monkeypatch.setattr(unembed_costs, "PINNED", fixed_costs(3))


def incremental_log_probs(model, ids: torch.Tensor, cuts: list[int]) -> list[torch.Tensor]:
    """Per-head log-probs at every position, fed in chunks, with a rejected detour cropped."""
    caches, pieces = model.new_caches(), []
    bounds = [0, *cuts, ids.shape[1]]
    for a, b in zip(bounds[:-1], bounds[1:]):
        start = caches.length
        model.step(torch.tensor([[7, 11, 13]]), caches)  # drafts that get rejected...
        caches.keep(start, [[]])  # ...and forgotten
        out = model.step(ids[:, a:b], caches)
        pieces.append(torch.stack([torch.stack([out.head_log_probs(i, p)[0] for p in range(b - a)])
                                   for i in range(model.n_future)]))  # [n, T_chunk, V]
    assert caches.length == ids.shape[1]
    return torch.cat(pieces, 1)  # [n, T, V]


def test_step_with_caches_equals_full_recompute(tiny_backbones, arch, head_type):
    model = attach(tiny_backbones[arch], head_type)
    ids = torch.randint(0, 500, (1, 11), generator=torch.Generator().manual_seed(1))
    # Steps read every position (read_from 0): token t+1 is not settled anywhere, conditioned
    # heads read the base's argmax at every position, as next_known=0 does
    full = torch.stack([lp[0] for lp in model.head_logits(ids, last_only=False, next_known=0)])  # [n, T, V]
    got = incremental_log_probs(model, ids, [5, 6, 9])
    torch.testing.assert_close(got, full, atol=1e-4, rtol=1e-4)


def test_read_from_keeps_only_later_positions(tiny_backbones, head_type):
    """A prompt's pass unembeds only the rows decoding reads; those rows are unchanged."""
    model = attach(tiny_backbones["llama"], head_type)
    ids = torch.randint(0, 500, (1, 9), generator=torch.Generator().manual_seed(3))
    full = model.step(ids, model.new_caches())
    part = model.step(ids, model.new_caches(), read_from=6)
    assert part.base_logits().shape[1] == 3
    # Positions before read_from are settled (a prompt's): conditioned heads read the prompt's
    # own next token there, the base's argmax from read_from on
    settled = [lp[0] for lp in model.head_logits(ids, last_only=False, next_known=6)]  # n x [T, V]
    for i in range(model.n_future):
        for p in (6, 8):
            if model.heads.needs_next_tokens:
                torch.testing.assert_close(part.head_log_probs(i, p)[0], settled[i][p], atol=1e-4, rtol=1e-4)
            else:
                torch.testing.assert_close(part.head_log_probs(i, p), full.head_log_probs(i, p), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="not kept"):
        part.head_log_probs(0, 5)


def test_head_layers_get_their_own_caches(tiny_backbones):
    model = attach(tiny_backbones["llama"], "replicated", n_future=3)
    caches = model.new_caches()
    assert len(caches.heads) == 2
    model.step(torch.tensor([[1, 2, 3, 4]]), caches)
    last = model.backbone.num_layers - 1  # head layers are replicas of the final layer, same slot
    assert all(c.layers[last].keys.shape[-2] == 4 for c in caches.heads)
    assert caches.backbone.get_seq_length() == 4


@pytest.mark.parametrize("arch,quantization", [("llama", "8bit"), ("gpt_neox", "4bit")])
def test_quantized_backbone_decodes_like_its_own_generate(tiny_neox_q_dir, tiny_llama_q_dir, arch, quantization):
    base = {"llama": tiny_llama_q_dir, "gpt_neox": tiny_neox_q_dir}[arch]  # widths every CPU kernel takes
    bb = load_backbone(BackboneConfig(base=str(base), quantization=quantization))
    model = attach(bb, "replicated")
    ids = bb.tokenizer("Once upon a time", return_tensors="pt").input_ids
    ref = bb.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                            pad_token_id=bb.tokenizer.eos_token_id)[0, ids.shape[1]:].tolist()
    for mode in ("ar", "speculative"):
        assert generate(model, ids, DecodeConfig(mode=mode, greedy=True, max_new_tokens=12)).token_ids == ref
    res = generate(model, ids, DecodeConfig(mode="dynamic", eps_b=0.0, max_new_tokens=12))
    assert len(res.token_ids) == 12


def test_cpu_steps_unembed_only_the_rows_read_at_the_one_row_rate(tiny_backbones, three_fast_rows):
    """Verification (3 positions, 2 head layers): the 3 base rows in one call, then the heads at
    the anchor in a call of 2 rows, per anchor read; never a call over the CPU's 3 fast rows. The
    logits are those of one call over every row, to float rounding."""
    model = attach(tiny_backbones["llama"], "replicated")
    caches = model.new_caches()
    model.step(torch.tensor([[1, 5, 9, 4]]), caches)
    out = model.step(torch.tensor([[7, 11, 13]]), caches)  # commit + 2 drafts
    heads = sorted(out.hiddens)
    every = torch.cat([out.feats.base] + [out.hiddens[i] for i in heads], 1)  # [1, 9, H]
    ref = torch.log_softmax(model.backbone.logits(every).float(), -1).split(3, 1)  # (1 + L) x [1, 3, V]
    torch.testing.assert_close(out.base_log_probs(), ref[0])
    for pos in (1, 2):
        for j, i in enumerate(heads):
            torch.testing.assert_close(out.head_log_probs(i, pos)[0], ref[1 + j][0, pos])
    assert dict(out.unembed_rows) == {3: 1, 2: 2}


def test_a_one_position_step_unembeds_base_and_heads_in_one_call(tiny_backbones, three_fast_rows):
    """Dynamic / ar steps read one position: 1 base + 2 head rows fit one fast call."""
    model = attach(tiny_backbones["llama"], "replicated")
    caches = model.new_caches()
    out = model.step(torch.tensor([[1, 5, 9, 4]]), caches, read_from=3)
    out.head_log_probs(0, 3), out.head_log_probs(2, 3), out.head_log_probs(1, 3)
    assert dict(out.unembed_rows) == {3: 1}


def test_the_plan_prices_every_batch_row(tiny_backbones, monkeypatch):
    """Two rows reading one position: base + 2 heads is 6 rows. Up to 3 rows cost one, more
    cost a row each, so one call of 6 (cost 6) loses to 2 + 4 rows (cost 1 + 4): the base's rows
    go first and the heads' in a second call, read at the shared anchor without another."""
    monkeypatch.setattr(unembed_costs, "PINNED", UnembedCosts(lambda rows: {r: {LINEAR: 1.0 if r <= 3 else float(r)} for r in rows}))
    model = attach(tiny_backbones["llama"], "replicated")
    caches = model.new_caches()
    out = model.step(torch.tensor([[1, 5, 9, 4], [2, 6, 8, 3]]), caches, read_from=3)
    out.base_logits(), out.anchor_head_logits(1, (3, 3)), out.anchor_head_logits(2, (3, 3))
    assert dict(out.unembed_rows) == {2: 1, 4: 1}


@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_unembed_beyond_the_fast_rows_agrees_within_rounding(tiny_backbones, rows, three_fast_rows):
    """(W x^T)^T for more rows than the CPU's fast count: each logit is the same dot product
    summed in another order, so it differs from F.linear's by at most H * eps * sum |w_i x_i|."""
    from multitoken.pipeline.runtime.step_output import unembed

    bb = tiny_backbones["gpt_neox"]
    x = torch.randn(1, rows, bb.hidden_size, generator=torch.Generator().manual_seed(rows))
    got, ref = unembed(bb, x), bb.logits(x)
    w = bb.unembedding.weight
    bound = bb.hidden_size * torch.finfo(torch.float32).eps * (x.abs() @ w.abs().T)  # [1, R, V]
    assert got.shape == ref.shape and bool(((got - ref).abs() <= bound).all())
    if rows <= 3:
        assert torch.equal(got, ref)  # the fast rows go through the module itself


def test_the_trace_records_device_sync_and_rows_per_call(tiny_backbones, three_fast_rows):
    model = attach(tiny_backbones["llama"], "replicated")
    cfg = DecodeConfig(mode="speculative", greedy=True, max_new_tokens=12)
    plain = generate(model, [1, 5, 9, 4], cfg)
    profiled = generate(model, [1, 5, 9, 4], cfg, profile=True)
    assert plain.token_ids == profiled.token_ids
    assert (plain.trace.device, plain.trace.synchronised, profiled.trace.synchronised) == ("cpu", False, True)
    rows = plain.trace.unembed_rows
    assert rows and max(rows) <= 3 and plain.trace.as_dict()["unembed_rows"] == {str(k): v for k, v in sorted(rows.items())}


def test_the_plan_joins_calls_only_when_one_call_is_not_dearer():
    """Costs per row count: one call of 9 rows against 3 + 2 rows in two calls."""
    flat = UnembedCosts(lambda rows: {r: {LINEAR: 1.0 + 0.01 * r} for r in rows})  # call overhead dominates
    assert flat.one_call(9, 3, 2) and flat.form(9) == LINEAR
    steep = UnembedCosts(lambda rows: {r: {LINEAR: float(r), TRANSPOSED: 1.5 + 0.5 * r} for r in rows})
    assert not steep.one_call(9, 3, 2) and steep.form(9) == TRANSPOSED and steep.form(1) == LINEAR
    assert UnembedCosts().one_call(9, 3, 2) and UnembedCosts().form(9) == LINEAR  # accelerator: one call


def test_the_cpu_plan_measures_each_row_count_once_and_one_row_only_by_the_module(tiny_backbones, monkeypatch):
    monkeypatch.setattr(unembed_costs, "_COSTS", {})  # this process's earlier decodes measured other counts
    cpu_linear.unpack(tiny_backbones["llama"].model)  # a stock unembedding (earlier decodes packed it)
    head = tiny_backbones["llama"].unembedding
    x = torch.zeros(1, head.weight.shape[1])
    plan = costs_for(head, x)
    assert plan is costs_for(head, x)  # cached per process
    plan.one_call(9, 3, 2)
    assert {1, 2, 3, 9} >= set(plan.table) >= {2, 3, 9}
    assert set(plan.table[9]) == {LINEAR, TRANSPOSED} and all(v > 0 for v in plan.table[9].values())
    assert set(plan.cost(1) and plan.table[1]) == {LINEAR}  # ar's row stays transformers' computation
    measured = dict(plan.table)
    plan.one_call(9, 3, 2)
    assert plan.table == measured  # nothing re-measured
    assert costs_for(head, x.to("meta")).measure is None  # no values to time: one call
    cpu_linear.pack(tiny_backbones["llama"].model)
    packed = costs_for(tiny_backbones["llama"].unembedding, x)
    packed.one_call(9, 3, 2)
    assert packed is not plan and set(packed.table[9]) == {LINEAR}  # (W x^T)^T needs a plain weight


def test_masked_gqa_passes_read_grouped_heads_in_place_with_the_same_values(tiny_backbones, monkeypatch):
    """A multi-token pass of a grouped-query model (tiny llama: 4 heads, 2 KV heads) runs under
    transformers' TRANSFORMERS_SDPA_FORCE_GQA (torch's enable_gqa, no repeat_kv copy): the same
    logits as without it, and the setting is as before once the pass is over."""
    from multitoken.pipeline.model import backbone as backbone_mod

    monkeypatch.delenv(backbone_mod.GQA_SETTING, raising=False)
    model = attach(tiny_backbones["llama"], "replicated")
    seen = []
    real = backbone_mod.Backbone.run_layer

    def spy(self, *args, **kwargs):
        seen.append(os.environ.get(backbone_mod.GQA_SETTING))
        return real(self, *args, **kwargs)

    def logits(scope_on: bool):
        monkeypatch.setattr(backbone_mod, "_SDPA_GQA", scope_on)
        caches = model.new_caches()
        model.step(torch.tensor([[1, 5, 9, 4]]), caches)
        out = model.step(torch.tensor([[7, 11, 13]]), caches)
        return torch.cat([out.base_logits(), out._head_row(1, 2)[:, None]], 1)

    monkeypatch.setattr(backbone_mod.Backbone, "run_layer", spy)
    plain, grouped = logits(False), logits(True)
    assert torch.equal(plain, grouped)
    assert set(seen[: len(seen) // 2]) == {None} and set(seen[len(seen) // 2:]) == {"1"}
    assert backbone_mod.GQA_SETTING not in os.environ
    one = model.step(torch.tensor([[3]]), model.new_caches())  # one token: no mask, transformers' own GQA path
    assert one.feats.ctx.mask is None and os.environ.get(backbone_mod.GQA_SETTING) is None
