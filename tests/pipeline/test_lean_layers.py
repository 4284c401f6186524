"""The lean layer forward (pipeline/model/lean_layers.py) gives the layers' own bits: every step of
a decoding run (a prompt, one token, a chain, a rollback, a tree, ragged batched rows), every
hidden state, head layer and KV cache entry, with fused packed linears (float32 blocks and Q4_1
codes), stock linears and eager attention; on a tiny GQA Llama and the embedded stories260K.
Autograd and training keep the layers' own forward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from multitoken.kernels import gemv_rows
from multitoken.kernels.cpu_linear import PackedLinear
from multitoken.pipeline.model import attention, lean_layers, lean_rows
from multitoken.pipeline.model.lean_layers import LEAN
from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
from multitoken.pipeline.model.model import MultiTokenModel

from ..kernels.test_gguf_codes import on_q4

TREE_ATTEND = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
TREE_OFFSETS = torch.tensor([0, 1, 1, 2])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _run(model: MultiTokenModel) -> list[torch.Tensor]:
    """Every step kind of a decoding run; every hidden state and cache entry it leaves."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 500, (1, 9), generator=gen)
    caches, seen = model.new_caches(), []

    def step(new, **kw):
        out = model.step(new, caches, **kw)
        seen.extend([out.feats.base, *out.hiddens.values()])

    step(ids)  # a prompt
    for t in range(3):
        step(ids[:, t:t + 1])  # one token at a time
    start = caches.length
    step(ids[:, :3])  # a chain of three, two of them rejected
    caches.keep(start, [[0]])
    start = caches.length
    step(ids[:, 4:8], attend=TREE_ATTEND, offsets=TREE_OFFSETS)  # a tree, one path kept
    caches.keep(start, [[0, 1, 3]])
    step(ids[:, 8:9])
    seen.extend(x for layer in caches.backbone.layers for x in (layer.keys, layer.values))
    batch = model.new_caches()  # ragged rows: prompts of 9 and 6 tokens, then one token each
    for new, lengths in ((ids.repeat(2, 1), [9, 6]), (ids[:, :1].repeat(2, 1), None), (ids[:, 1:3].repeat(2, 1), [2, 1])):
        out = model.step(new, batch, lengths=lengths)
        seen.extend([out.feats.base, *out.hiddens.values()])
    return seen


def _model(base: str, linears: str = "rows", eager: bool = False, dtype: str = "float32") -> MultiTokenModel:
    bb = load_backbone(BackboneConfig(base=base, cpu_linear=linears, dtype=dtype))
    if eager:
        bb.causal_lm.set_attn_implementation("eager")
    elif dtype == "bfloat16":
        attention.use(bb.causal_lm)  # as the recipe's bf16 copy: one-token steps through our op
    torch.manual_seed(0)
    model = MultiTokenModel.attach(bb, {"head_type": "replicated", "n_future": 3, "init": "copy"})
    model.prepare_linears()
    return model


def _same_as_the_layers(model: MultiTokenModel, monkeypatch, rows: bool = False) -> None:
    """The lean forward's run is the layers' own, bit for bit: with its row ops where ``rows`` (every
    layer as one op, each layer as one op; one row and several), and without them."""
    bb = model.backbone
    ran = {"row": [], "stack": []}
    for name, cls in (("row", lean_rows.Row), ("stack", lean_rows.Stack)):
        run = cls.run
        monkeypatch.setattr(cls, "run", lambda *a, run=run, seen=ran[name]: seen.append(out := run(*a)) or out)
    lean = _run(model)
    assert bb.lean.plans, "the lean forward never ran"
    done = {name: sum(out is not None for out in outs) for name, outs in ran.items()}
    assert (done["stack"] >= 4) == rows, f"the layers' row op ran (or not) against the plan: {done}"
    several = [out[0].shape[1] for out in ran["stack"] if out is not None and out[0].shape[1] > 1]
    assert bool(several) == rows, "a chain or a tree step of several rows took the op (or not) against the plan"
    monkeypatch.setattr(lean_rows.Row, "of", staticmethod(lambda plan: None))
    bb.lean.plans.clear()
    bb.lean.stack = None
    python = _run(model)  # the lean forward's Python one-row path
    bb.lean.lean = None  # the layers' own forward, on the same (fused) linears
    own = _run(model)
    bb.lean.lean = LEAN[bb.model_type]
    assert len(lean) == len(python) == len(own)
    for i, (a, b, c) in enumerate(zip(lean, python, own)):
        assert a.shape == b.shape == c.shape and torch.equal(_bits(a), _bits(c)) and torch.equal(_bits(b), _bits(c)), i


def _on_q4_grid(base, out):
    """The tiny Llama with every linear's weights on a Q4_1 grid (packed as Q4_1 codes)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.weight.data = on_q4(module.weight.data)
    model.save_pretrained(out)
    for f in base.glob("tokenizer*"):
        (out / f.name).write_bytes(f.read_bytes())
    return out


@pytest.mark.parametrize("grid", ["f32", "q4_1"])
def test_lean_steps_are_the_layers_bits_with_fused_linears(tiny_llama_q_dir, tmp_path, grid, monkeypatch):
    """64 wide: q, k and v fill whole column blocks, so one-row steps rotate q and k as one tensor,
    and take the row op (kernels/layer_step.cpp)."""
    base = tiny_llama_q_dir if grid == "f32" else _on_q4_grid(tiny_llama_q_dir, tmp_path)
    model = _model(str(base))
    if not gemv_rows.available():
        pytest.skip("needs the compiled kernels")
    layer = model.backbone.layers[0]
    assert isinstance(layer.self_attn.q_proj, PackedLinear) and layer.self_attn.q_proj.format == grid
    with torch.no_grad():
        assert model.backbone.lean.plan(layer).rotary_one is lean_layers._rolled_rotary  # Llama's rotate_half
    _same_as_the_layers(model, monkeypatch, rows=True)
    fused = model.backbone.lean.fused()
    assert fused and all(f.format == grid for f in fused.values())
    assert {f.names for f in fused.values()} == {("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")}
    assert all(f.exact_split for f in fused.values())


def test_lean_steps_are_the_layers_bits_on_stories260k(stories_dir, monkeypatch):
    model = _model(str(stories_dir))
    _same_as_the_layers(model, monkeypatch, rows=True)


@pytest.mark.parametrize("eager", [False, True])
def test_lean_steps_are_the_layers_bits_with_stock_linears(tiny_llama_dir, eager, monkeypatch):
    model = _model(str(tiny_llama_dir), linears="stock", eager=eager)
    _same_as_the_layers(model, monkeypatch)
    assert not model.backbone.lean.fused()  # nothing packed: each linear called alone


def test_lean_steps_are_the_layers_bits_in_bfloat16_through_our_attention(tiny_llama_dir, monkeypatch):
    """A bf16 model on oneDNN's packed linears, set to our attention (the recipe's bf16 copy): the
    lean forward (its one-op norms included) is the layers' own, bit for bit."""
    model = _model(str(tiny_llama_dir), "packed", dtype="bfloat16")
    assert model.backbone.config._attn_implementation == attention.NAME
    _same_as_the_layers(model, monkeypatch)


def test_a_module_replaced_between_steps_is_the_one_read(tiny_llama_q_dir, monkeypatch):
    """The row ops hold a layer's tensors: a norm, activation or linear put in its place after a
    run is read by the next run, not the one planned."""
    model = _model(str(tiny_llama_q_dir))
    with torch.no_grad():
        _run(model)
    layer = model.backbone.layers[1]
    norm = copy.deepcopy(layer.input_layernorm)
    norm.weight.data.mul_(1.5)
    layer.input_layernorm = norm
    _same_as_the_layers(model, monkeypatch, rows=True)


@torch.no_grad()
def test_the_stack_sees_a_module_moved_mid_run_between_runs_and_a_fallback(tiny_llama_q_dir):
    """The stack compares every module it reads once per run; within a run, that no submodule was
    set anywhere and no packed linear fell back stands in for it. A norm set mid-run (the hook
    sees it), a final norm set mid-run (the op applies it: its output is the layers' own), one
    put straight into ``_modules`` between runs (no hook: the new run's compare sees it), and a
    linear on its fallback each make the next step build a new stack."""
    model = _model(str(tiny_llama_q_dir))
    if not gemv_rows.available():
        pytest.skip("needs the compiled kernels")
    bb, gen = model.backbone, torch.Generator().manual_seed(1)
    ids = torch.randint(3, 500, (1, 12), generator=gen)
    caches = model.new_caches()
    model.step(ids[:, :9], caches)
    model.step(ids[:, 9:10], caches)
    stack = bb.lean.stack
    assert stack is not None and stack.op is not None and stack.checked() is caches.backbone
    assert stack.norm_args[0] is bb.final_norm.weight  # the final norm runs in the op too
    model.step(ids[:, 10:11], caches)
    assert bb.lean.stack is stack  # nothing moved: the same stack

    def moved_norm(layer):
        norm = copy.deepcopy(layer.post_attention_layernorm)
        norm.weight.data.mul_(1.5)
        return norm

    layer = bb.layers[1]
    layer.post_attention_layernorm = moved_norm(layer)  # mid-run, through setattr
    model.step(ids[:, 11:12], caches)
    assert bb.lean.stack is not stack and any(w is layer.post_attention_layernorm.weight for w in bb.lean.stack.weights)
    final = copy.deepcopy(bb.final_norm)
    final.weight.data.mul_(0.5)
    setattr(bb.decoder, bb.spec.final_norm, final)
    start = caches.length
    out = model.step(ids[:, 11:12], caches)
    assert bb.lean.stack.norm is final and bb.lean.stack.norm_args[0] is final.weight
    caches.keep(start, [[]])
    bb.lean.lean = None  # the layers' own forward
    assert torch.equal(_bits(model.step(ids[:, 11:12], caches).feats.base), _bits(out.feats.base))
    bb.lean.lean = LEAN[bb.model_type]
    stack = bb.lean.stack
    layer._modules["post_attention_layernorm"] = moved_norm(layer)  # no hook runs
    caches = model.new_caches()
    model.step(ids[:, :9], caches)
    model.step(ids[:, 9:10], caches)
    assert bb.lean.stack is not stack and any(w is layer.post_attention_layernorm.weight for w in bb.lean.stack.weights)
    o = bb.layers[0].self_attn.o_proj
    assert isinstance(o, PackedLinear) and o.dense is None
    with pytest.raises(RuntimeError):  # the kernel refuses float64 (the fallback taken), then F.linear does too
        o(torch.ones(1, o.in_features, dtype=torch.float64))
    assert o.dense is not None
    model.step(ids[:, 10:11], caches)
    assert bb.lean.stack.op is None  # a linear on its fallback: no row op for its layer


@torch.no_grad()
def test_repacking_replans_and_training_keeps_the_layers_forward(tiny_llama_dir):
    model = _model(str(tiny_llama_dir))
    bb, layer = model.backbone, model.backbone.layers[0]
    first = bb.lean.plan(layer)
    assert first is not None and bb.lean.plan(layer) is first  # planned once
    with torch.enable_grad():
        assert bb.lean.plan(layer) is None  # autograd: transformers' layer, checkpointing and all
    model.train()  # stock linears back; the head layers train (the base stays in eval mode)
    assert bb.lean.plan(model.heads.layers[0]) is None
    again = bb.lean.plan(layer)
    assert again is not first and again.qkv is None  # the swapped linears are seen: unpacked, nothing fused
    model.prepare_linears()
    if gemv_rows.available():
        assert bb.lean.plan(layer).qkv is not None


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_one_token_steps_rotary_op_is_the_formulas_bits(dtype):
    """``rotary_step`` on q / k as the layer's views leave them (rows apart by all heads), tables for
    every row or one for all: transformers' ``apply_rotary_pos_emb``, bit for bit; bad shapes refused."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    op = gemv_rows.library()
    if op is None:
        pytest.skip("needs the compiled kernels: an x86-64 CPU and a C++ compiler with OpenMP")
    gen = torch.Generator().manual_seed(4)
    for rows, heads, d in ((1, 9, 64), (5, 4, 8), (256, 3, 64)):
        q = (torch.randn(rows, 1, heads * d, generator=gen) * 3).to(dtype).view(rows, 1, heads, d).transpose(1, 2)
        k = (torch.randn(rows, 1, 2 * d, generator=gen) * 3).to(dtype).view(rows, 1, 2, d).transpose(1, 2)
        angles = torch.rand(rows, 1, d, generator=gen) * 40
        for cos, sin in ((angles.cos().to(dtype), angles.sin().to(dtype)), (angles[:1].cos().to(dtype), angles[:1].sin().to(dtype))):
            got = op.rotary_step(q, k, cos, sin)
            want = apply_rotary_pos_emb(q, k, cos, sin)
            assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, want)), (rows, heads, d)
    with pytest.raises(RuntimeError, match="rotary_step"):
        op.rotary_step(q, k, cos.float() if dtype == torch.bfloat16 else cos.bfloat16(), sin)
    with pytest.raises(RuntimeError, match="rotary_step"):
        op.rotary_step(torch.cat([q, q], 2), k, cos, sin)  # two tokens a row


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])  # float16: the module's own
@pytest.mark.parametrize("kernels", [True, False])
def test_the_lean_rms_norm_is_the_modules_bits(dtype, kernels, monkeypatch):
    """The kernels' one op (float32 and bfloat16), or without them the norm's ops less its casts:
    the module's bits on every row width and scale."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    if kernels and gemv_rows.library() is None:
        pytest.skip("needs the compiled kernels: an x86-64 CPU and a C++ compiler with OpenMP")
    if not kernels:
        monkeypatch.setattr(lean_layers.gemv_rows, "library", lambda: None)
    gen = torch.Generator().manual_seed(3)
    for width, rows in ((64, 1), (576, 1), (576, 7), (960, 3), (576, 256)):
        norm = LlamaRMSNorm(width, eps=1e-5)
        norm.weight.data = torch.randn(width, generator=gen)
        norm.to(dtype)
        for scale in (1e-3, 1.0, 40.0):
            x = (torch.randn(2, rows, width, generator=gen) * scale).to(dtype)
            assert torch.equal(_bits(lean_layers._rms_norm(norm, x)), _bits(norm(x)))
