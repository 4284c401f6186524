"""The step profile (pipeline/eval/step_profile.py): every op lands in the part of the step it ran
in, what no op covers is the residue, the parts sum to the step's wall time, and the labels leave
the model as it was."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.engine import generate
from multitoken.kernels import gemv_rows
from multitoken.kernels.cpu_linear import PackedLinear
from multitoken.pipeline.eval import step_profile
from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
from multitoken.pipeline.model.model import MultiTokenModel

from ..conftest import build_tiny_llama


def _event(name, start, end, parent=None, memory=0, thread=1):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), cpu_parent=parent,
                           self_cpu_memory_usage=memory, thread=thread)


def test_each_op_goes_to_its_innermost_label_and_the_rest_is_the_residue():
    run = _event("mt.generate", 0, 100)
    prefill, step = _event("mt.step", 0, 10, run), _event("mt.step", 20, 60, run)
    linear = _event("mt.linear:q4_1:q_proj", 25, 40, step)
    kernel = _event("multitoken_avx2::gemv", 27, 37, linear, memory=64)
    attention = _event("mt.attention", 42, 50, step)
    sdpa = _event("aten::scaled_dot_product_attention", 43, 49, attention)
    nested = _event("aten::empty", 44, 45, sdpa, memory=128)  # inside sdpa's time: not counted again
    logic = _event("aten::argmax", 70, 75, run)
    before = _event("aten::embedding", 2, 4, prefill)  # the prompt's pass: outside the window
    other_thread = _event("aten::mm", 30, 90, None, thread=2)
    found = step_profile.attribute([run, prefill, step, linear, kernel, attention, sdpa, nested, logic, before, other_thread])
    assert found["steps"] == 1 and found["wall_us"] == 90  # from the prefill's end to the run's end
    parts = found["parts_us"]
    assert parts["linear kernels: q4_1"] == 10 and found["kernels_by_linear_us"] == {"q_proj": {"q4_1": 10}}
    assert parts["attention (scores, softmax, KV cache)"] == 6 and parts["decoding logic (outside the model)"] == 5
    assert parts["Python in the linears' wrappers"] == 5  # the label's 15 less its op's 10
    assert parts["Python and dispatch elsewhere"] == 90 - 21 - 5
    assert sum(parts.values()) == found["wall_us"] and found["ops_us"] == 21 and found["residue_us"] == 69
    assert found["ops_per_step"] == 4 and found["top_level_ops_per_step"] == 3
    assert found["allocating_ops_per_step"] == 1 and found["allocated_kb_per_step"] == round(64 / 1024, 1)


def test_the_one_row_layer_op_is_split_into_its_kernels_ops_and_own_time():
    run = _event("mt.generate", 0, 100)
    prefill, step = _event("mt.step", 0, 10, run), _event("mt.step", 20, 60, run)
    label = _event("mt.row:q4_1:q_proj+k_proj+v_proj,q4_1:o_proj,q8_0:gate_proj+up_proj,q4_1:down_proj", 21, 59, step)
    row = _event("multitoken_native::llama_row", 22, 58, label)
    children = [_event("aten::mean", 23, 24, row, memory=32), _event("multitoken_native::gemv", 24, 30, row),
                _event("aten::scaled_dot_product_attention", 31, 35, row), _event("multitoken_native::gemv", 35, 38, row),
                _event("multitoken_native::gemv", 39, 45, row), _event("aten::silu", 45, 46, row),
                _event("multitoken_native::gemv", 46, 55, row)]
    inner = _event("aten::empty", 25, 26, children[1], memory=64)  # inside a kernel's time: not counted again
    row.cpu_children = children
    found = step_profile.attribute([run, prefill, step, label, row, *children, inner])
    assert found["kernels_by_linear_us"] == {"q_proj+k_proj+v_proj": {"q4_1": 6}, "o_proj": {"q4_1": 3},
                                             "gate_proj+up_proj": {"q8_0": 6}, "down_proj": {"q4_1": 9}}
    parts = found["parts_us"]
    assert parts["linear kernels: q4_1"] == 18 and parts["linear kernels: q8_0"] == 6
    assert parts[step_profile.ROW_OPS] == 6 and parts[step_profile.ROW_SELF] == 36 - 30
    assert sum(parts.values()) == found["wall_us"] == 90 and found["top_level_ops_per_step"] == 1
    assert found["allocating_ops_per_step"] == 1


def test_a_profile_needs_a_step_after_the_prompt():
    run = _event("mt.generate", 0, 100)
    with pytest.raises(ValueError, match="no step after the prompt"):
        step_profile.attribute([run, _event("mt.step", 0, 10, run)])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    bb = load_backbone(BackboneConfig(base=str(build_tiny_llama(tmp_path_factory.mktemp("llama"), layers=2, hidden=64)),
                                      cpu_linear="rows"))
    torch.manual_seed(0)
    return MultiTokenModel.attach(bb, {"head_type": "replicated", "n_future": 2, "init": "copy"})


@pytest.mark.parametrize("mode", ["ar", "speculative"])
def test_a_real_run_is_attributed_whole_and_leaves_the_model_as_it_was(model, mode):
    cfg = DecodeConfig(mode=mode, greedy=True, max_new_tokens=6, stop_at_eos=False)
    ids = torch.tensor([[1, 5, 9, 14]])
    plain = generate(model, ids, cfg)
    found, result = step_profile.profile_run(model, ids, cfg)
    assert result.token_ids == plain.token_ids  # labels change no result
    assert found["steps"] == result.trace.forward_passes - 1
    assert abs(sum(found["parts_us"].values()) - found["wall_us"]) <= 0.1 * len(found["parts_us"])
    assert found["top_level_ops_per_step"] > 0 and found["residue_us"] > 0
    formats = step_profile.formats(model)
    if gemv_rows.library() is not None:  # the suite packs every linear: each step runs our kernels
        assert set(formats) == {"f32"} and set(found["kernels_by_format_us"]) == {"f32"}
        names = {part for name in found["kernels_by_linear_us"] for part in name.split("+")}  # fused: q_proj+k_proj+v_proj
        assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= names
        assert any(name.startswith("lm_head") for name in names)  # the unembedding, logits or argmax
    for m in model.modules():  # the wrappers are gone: the class's methods again
        assert "forward" not in m.__dict__ and "argmax" not in m.__dict__
    assert "step" not in model.__dict__
    lean = model.backbone.lean  # the lean layer forward's functions and fused linears are their own again
    assert lean.plans and "run" not in lean.__dict__ and "run_rows" not in lean.__dict__
    assert all("run" not in plan.row.__dict__ for plan in lean.plans.values() if plan.row is not None)
    for plan in lean.plans.values():
        assert plan.attention.__name__ == "sdpa_attention_forward" and plan.norm.__name__ == "_rms_norm"
        assert all("forward" not in f.__dict__ and "joint" not in f.__dict__ for f in (plan.qkv, plan.gate_up) if f)


def test_labels_name_a_linear_by_its_format_and_modules_by_class(model):
    model.prepare_linears()
    labels = {name: step_profile.label_of(name, m) for name, m in model.named_modules()}
    packed = [name for name, m in model.named_modules() if isinstance(m, PackedLinear)]
    assert packed and all(labels[n] == f"mt.linear:{dict(model.named_modules())[n].format}:{n.rsplit('.', 1)[-1]}"
                          for n in packed)
    kinds = set(labels.values())
    assert {"mt.attention", "mt.norm", "mt.mlp", "mt.layer", "mt.embed", "mt.rotary"} <= kinds
