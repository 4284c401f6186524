"""``with_heads``: multi-token decoding from transformers' own ``generate`` (custom_generate)."""

from __future__ import annotations

import re

import pytest
import torch

from multitoken.base.errors import UsageError
from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
from multitoken.pipeline.integrations.hf_generate import with_heads
from multitoken.pipeline.model.model import MultiTokenModel

from ..conftest import REPO


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
    ours = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=2,
                          custom_generate=with_heads(str(heads)))
    assert ours[:, :5].tolist() == ids.tolist()
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


def _readme_block() -> str:
    """The README's python block that calls ``with_heads``."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    return next(b for b in blocks if "with_heads(" in b)


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
    block = _readme_block()
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
    (mt, _), = getattr(model, ATTACHED).values()
    trees._STEP_TIMES.clear()  # a new process: the times come from the file, not from timing
    with monkeypatch.context() as patch:
        patch.setattr(mt, "step", lambda *a, **k: pytest.fail("the verify step was timed again"))
        assert trees.step_times(mt, argmax=True) == {int(b): t for b, t in next(iter(kept.values())).items()}
    again = model.generate(ids, max_new_tokens=64, do_sample=False,
                           custom_generate=scope["with_heads"](scope["HEADS"], tree="static"))
    assert again.tolist() == out.tolist() and len(getattr(model, ATTACHED)) == 1  # the heads loaded once


def test_heads_and_stats_take_the_names_the_command_line_takes():
    with_heads("embedded:stories260K-heads", stats="embedded:stories260K-stats")  # no error: both resolve
    with pytest.raises(UsageError, match="embedded:stories260K-heads") as err:
        with_heads("embedded:no-such-heads")
    assert "embedded:no-such-heads: the package ships no folder of that name" in str(err.value)  # resolve_base's check
