"""``with_heads``: multi-token decoding from transformers' own ``generate`` (custom_generate)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from multitoken.base.errors import UsageError
from multitoken.kernels.cpu_linear import PackedLinear
from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
from multitoken.pipeline.integrations.hf_generate import attached, with_heads
from multitoken.pipeline.model.model import MultiTokenModel

from ..conftest import readme_block


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """with_heads keeps tree step times under the cache: a test's go to its own folder."""
    monkeypatch.setenv("MULTITOKEN_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def heads_and_model(tiny_llama_dir, tmp_path_factory):
    """Replicated heads (perturbed copies) saved for the tiny Llama, and a plain transformers
    model object of that checkpoint."""
    from transformers import AutoModelForCausalLM

    backbone = load_backbone(BackboneConfig(base=str(tiny_llama_dir)))
    torch.manual_seed(0)
    heads = MultiTokenModel.attach(backbone, {"head_type": "replicated", "n_future": 3, "init": "copy"})
    with torch.no_grad():
        for p in heads.heads.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    out = tmp_path_factory.mktemp("hf_generate") / "heads"
    heads.save_heads(out)
    return out, AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()


def test_greedy_through_transformers_generate_equals_its_own(heads_and_model):
    heads, model = heads_and_model
    ids = torch.tensor([[1, 45, 230, 17, 99]])
    plain = model.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=2)
    for tree in ("chain", "static"):
        ours = model.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=2,
                              custom_generate=with_heads(str(heads), tree=tree))
        assert ours.tolist() == plain.tolist(), tree


def test_a_padded_batch_keeps_each_rows_prompt_and_output(heads_and_model):
    heads, model = heads_and_model
    rows = [[1, 45, 230, 17, 99], [1, 300, 12]]
    ids = torch.tensor([rows[0], [0, 0] + rows[1]])  # left padded, as transformers' batches are
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    method = with_heads(str(heads))
    ours = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=2,
                          custom_generate=method)
    assert ours[:, :5].tolist() == ids.tolist()
    assert [t.new_tokens for t in method.traces] == [12, 12]  # the latest call's trace per row
    for i, row in enumerate(rows):
        alone = model.generate(torch.tensor([row]), max_new_tokens=12, do_sample=False, pad_token_id=2)
        assert ours[i, 5:].tolist()[:12] == alone[0, len(row):].tolist()


def test_options_without_a_counterpart_are_refused(heads_and_model, tmp_path):
    heads, model = heads_and_model
    ids = torch.tensor([[1, 45, 230]])
    with pytest.raises(UsageError, match="NoRepeatNGram"):
        model.generate(ids, max_new_tokens=4, do_sample=False, no_repeat_ngram_size=2, pad_token_id=2,
                       custom_generate=with_heads(str(heads)))
    with pytest.raises(UsageError, match="not a heads dir"):
        with_heads(str(tmp_path))


def test_the_readme_block_runs_as_written_on_the_embedded_model(tmp_path, monkeypatch, capsys):
    """The README's block, with only its BASE and HEADS lines pointed at the embedded stories260K
    (SmolLM2 is not fetched here): it runs, prints transformers' greedy text, and a second
    with_heads call on the same model neither loads the heads again nor times the machine again."""
    import json

    from transformers import AutoModelForCausalLM

    from multitoken.decoding import trees
    from multitoken.embedded import DEFAULT_BASE
    from multitoken.pipeline.integrations.hf_generate import ATTACHED, STEP_TIMES_FILE

    monkeypatch.setenv("MULTITOKEN_CACHE", str(tmp_path))
    block = readme_block("with_heads(")
    for name, value in (("BASE", repr(str(DEFAULT_BASE))), ("HEADS", repr("embedded:stories260K-heads"))):
        block, n = re.subn(rf"^{name} = .*$", f"{name} = {value}", block, flags=re.M)
        assert n == 1, f"the README block no longer sets {name} on one line"
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    model, ids, out = scope["hf_model"], scope["ids"], scope["out"]
    plain = AutoModelForCausalLM.from_pretrained(DEFAULT_BASE).generate(ids, max_new_tokens=64, do_sample=False)
    assert out.tolist() == plain.tolist()
    assert scope["tokenizer"].decode(out[0], skip_special_tokens=True) in capsys.readouterr().out
    kept = json.loads((tmp_path / STEP_TIMES_FILE).read_text())  # measured once, kept for this machine
    assert len(kept) == 1 and "heads=replicatedx3" in next(iter(kept)) and "cpu=" in next(iter(kept))
    (mt, _), = getattr(model, ATTACHED)["heads"].values()
    trees._STEP_TIMES.clear()  # a new process: the times come from the file, not from timing
    with monkeypatch.context() as patch:
        patch.setattr(mt, "step", lambda *a, **k: pytest.fail("the verify step was timed again"))
        assert trees.step_times(mt, argmax=True) == {int(b): t for b, t in next(iter(kept.values())).items()}
    again = model.generate(ids, max_new_tokens=64, do_sample=False,
                           custom_generate=scope["with_heads"](scope["HEADS"], tree="static"))
    assert again.tolist() == out.tolist() and len(getattr(model, ATTACHED)["heads"]) == 1  # the heads loaded once


def test_heads_and_stats_take_the_names_the_command_line_takes():
    with_heads("embedded:stories260K-heads", stats="embedded:stories260K-stats")  # no error: both resolve
    with pytest.raises(UsageError, match="embedded:stories260K-heads") as err:
        with_heads("embedded:no-such-heads")
    assert "embedded:no-such-heads: the package ships no folder of that name" in str(err.value)  # resolve_base's check


def _fresh(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


def _greedy(model, ids, **kw):
    return model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=2, **kw).tolist()


def test_the_heads_run_on_packed_linears_of_a_copy_the_callers_model_unchanged(heads_and_model, tiny_llama_dir):
    """Our CPU linears on a runner: every linear of the copy packed, the caller's module tree,
    Parameters and values as they were, and its own generate still torch's stock greedy."""
    heads, _ = heads_and_model
    model, ids = _fresh(tiny_llama_dir), torch.tensor([[1, 45, 230, 17, 99]])
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    plain = _greedy(model, ids)
    assert _greedy(model, ids, custom_generate=with_heads(str(heads))) == plain
    mt, _ = attached(model, str(heads), None)
    packed = [m for m in mt.backbone.model.modules() if isinstance(m, PackedLinear)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert mt.backbone.model is not model and len(packed) == len(linears)  # every linear, on the copy
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, (ptr, value) in before.items():
        assert after[k].data_ptr() == ptr and torch.equal(after[k], value), k
    assert _greedy(model, ids) == plain


def test_stock_linears_decode_on_the_callers_model(heads_and_model, tiny_llama_dir):
    heads, _ = heads_and_model
    model, ids = _fresh(tiny_llama_dir), torch.tensor([[1, 300, 12]])
    assert _greedy(model, ids, custom_generate=with_heads(str(heads), cpu_linear="stock")) == _greedy(model, ids)
    mt, _ = attached(model, str(heads), None, "stock")
    assert mt.backbone.model is model and not any(isinstance(m, PackedLinear) for m in mt.modules())
    assert attached(model, str(heads), None, "stock")[0] is mt  # decoding left the weights' stamp as it was
    with pytest.raises(UsageError, match="unknown cpu_linear 'fast'") as err:
        with_heads(str(heads), cpu_linear="fast")
    assert "rows" in err.value.fix and "stock" in err.value.fix


def test_a_model_our_linears_cannot_take_keeps_its_own_saying_why_once(heads_and_model, tiny_llama_dir, capsys):
    heads, _ = heads_and_model
    model, ids = _fresh(tiny_llama_dir).half(), torch.tensor([[1, 45, 230]])
    for _ in range(2):
        assert _greedy(model, ids, custom_generate=with_heads(str(heads))) == _greedy(model, ids)
    notes = [line for line in capsys.readouterr().err.splitlines() if "with_heads" in line]
    assert notes == ["multitoken: with_heads decodes on the model's own linears: its weights are float16, and our "
                     "CPU linears take float32 / bfloat16 (cpu_linear=\"stock\" asks for them without this note)"]
    assert attached(model, str(heads), None)[0].backbone.model is model


def test_weights_changed_after_the_first_call_are_decoded_not_the_old_copy(heads_and_model, tiny_llama_dir, tmp_path):
    """The runner is a copy: weights loaded into the caller's model after (a fine-tune's: every
    layer but the embedding, which the heads' base check reads) build it again."""
    from ..conftest import build_tiny_llama

    heads, _ = heads_and_model
    model, ids = _fresh(tiny_llama_dir), torch.tensor([[1, 45, 230, 17, 99]])
    method = with_heads(str(heads))
    first = _greedy(model, ids, custom_generate=method)
    runner = attached(model, str(heads), None)[0].backbone.model
    other = _fresh(build_tiny_llama(tmp_path / "other", seed=1))
    model.load_state_dict({k: v for k, v in other.state_dict().items() if "embed_tokens" not in k}, strict=False)
    plain = _greedy(model, ids)
    assert plain != first  # the premise: the new weights continue the prompt otherwise
    assert _greedy(model, ids, custom_generate=method) == plain
    assert attached(model, str(heads), None)[0].backbone.model is not runner


def test_a_later_call_neither_copies_packs_nor_times_and_a_one_token_reply_is_one_forward(
        heads_and_model, tiny_llama_dir, monkeypatch):
    """What a call costs once the model has met with_heads: the decode alone. A one-token reply
    is the prompt's one forward pass, as transformers' own generate makes it."""
    from multitoken.decoding import trees
    from multitoken.pipeline.integrations import hf_generate

    heads, _ = heads_and_model
    model, ids = _fresh(tiny_llama_dir), torch.tensor([[1, 45, 230, 17, 99]])
    _greedy(model, ids, custom_generate=with_heads(str(heads), tree="static"))  # copies, packs, times
    mt, _ = attached(model, str(heads), None)
    trees._STEP_TIMES.clear()  # as a new process would: the times from STEP_TIMES_FILE
    monkeypatch.setattr(hf_generate, "_runner", lambda *a: pytest.fail("the model was copied again"))
    packed = [m for m in mt.modules() if isinstance(m, PackedLinear)]
    forwards, step = [], mt.step
    monkeypatch.setattr(mt, "step", lambda new_ids, *a, **k: forwards.append(new_ids.shape) or step(new_ids, *a, **k))
    out = model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=2,
                         custom_generate=with_heads(str(heads), tree="static"))
    assert out.tolist() == model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=2).tolist()
    assert forwards == [torch.Size([1, 5])]  # the prompt's pass, nothing timed
    assert packed and [m for m in mt.modules() if isinstance(m, PackedLinear)] == packed  # the same packed layers, none again


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")
def test_a_model_on_cuda_decodes_on_its_own_linears_saying_so_once(heads_and_model, tiny_llama_dir, capsys):
    heads, _ = heads_and_model
    model, ids = _fresh(tiny_llama_dir).to("cuda"), torch.tensor([[1, 45, 230, 17, 99]], device="cuda")
    for _ in range(2):
        assert _greedy(model, ids, custom_generate=with_heads(str(heads))) == _greedy(model, ids)
    notes = [line for line in capsys.readouterr().err.splitlines() if "with_heads" in line]
    assert len(notes) == 1 and "the model is on cuda:0, and our linears are CPU kernels" in notes[0]
    assert attached(model, str(heads), None)[0].backbone.model is model
