"""``multitoken export --format medusa`` / ``multitoken import --format medusa``: our Medusa heads
in vLLM's ``medusa`` layout and back, bit for bit; FasterDecoding's layout read; the function each
layout's reader computes from the files checked by hand; what cannot be represented refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from multitoken.base.manifest import MANIFEST
from multitoken.pipeline.cli import main
from multitoken.pipeline.model.model import MultiTokenModel

IDS = torch.tensor([[1, 17, 300, 42, 9, 255, 77, 3, 128, 64]])


def _medusa_heads(base: Path, out: Path, n: int = 4, blocks: int = 2) -> MultiTokenModel:
    """Medusa heads with random non-zero weights and biases on ``base``, saved to ``out``."""
    assert main(["attach", "--base", str(base), "--head", "medusa", "--n", str(n), "--num-blocks", str(blocks),
                 "--out", str(out)]) == 0
    model = MultiTokenModel.from_pretrained(None, out)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.normal_(0, 0.3)
    model.save_heads(out, command="attach")
    return MultiTokenModel.from_pretrained(None, out)


@pytest.fixture(scope="module")
def trained(tiny_llama_dir, tmp_path_factory) -> tuple[MultiTokenModel, Path]:
    out = tmp_path_factory.mktemp("medusa") / "heads"
    return _medusa_heads(tiny_llama_dir, out), out


def _vllm_forward(export: Path, base_hidden: torch.Tensor) -> list[torch.Tensor]:
    """vLLM's Medusa (ResidualBlock: ``x = x + SiLU(layer(x))`` per layer, bias iff
    medusa_fc_bias; one lm head per head, or lm_heads.0 for all with original_lm_head), written
    out from the exported files alone: log-probabilities per head."""
    cfg = json.loads((export / "config.json").read_text())
    t = load_file(export / "model.safetensors")
    out = []
    for h in range(cfg["num_heads"]):
        x = base_hidden
        for ell in range(cfg["num_hidden_layers"]):
            b = t[f"blocks.{h}.layers.{ell}.bias"] if cfg["medusa_fc_bias"] else None
            x = x + torch.nn.functional.silu(torch.nn.functional.linear(x, t[f"blocks.{h}.layers.{ell}.weight"], b))
        lm = t["lm_heads.0.weight" if cfg["original_lm_head"] else f"lm_heads.{h}.weight"]
        out.append(torch.log_softmax(torch.nn.functional.linear(x, lm).float(), -1))
    return out


def test_export_is_vllms_layout_and_function(trained, tmp_path, capsys):
    model, heads = trained
    export = tmp_path / "E"
    assert main(["export", "--format", "medusa", "--heads", str(heads), "--out", str(export)]) == 0
    assert "exported 3 medusa heads (2 block(s) each)" in capsys.readouterr().out
    cfg = json.loads((export / "config.json").read_text())
    assert {k: cfg[k] for k in ("model_type", "architectures", "hidden_size", "vocab_size", "truncated_vocab_size",
                                "num_heads", "num_hidden_layers", "medusa_fc_bias", "original_lm_head", "torch_dtype")} == {
        "model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": 32, "vocab_size": 512,
        "truncated_vocab_size": 512, "num_heads": 3, "num_hidden_layers": 2, "medusa_fc_bias": True,
        "original_lm_head": True, "torch_dtype": "float32"}
    # vLLM's MedusaConfig.from_pretrained renames every top-level key holding "num" (+ heads/layers)
    assert [k for k in cfg if "num" in k] == ["num_heads", "num_hidden_layers"]
    assert cfg["multitoken"]["base"] == str(trained[0].backbone.name) and cfg["multitoken"]["version"]
    tensors = load_file(export / "model.safetensors")
    assert sorted(tensors) == sorted([f"blocks.{h}.layers.{ell}.{p}" for h in range(3) for ell in range(2)
                                      for p in ("weight", "bias")] + ["lm_heads.0.weight"])
    state = model.heads.state_dict()
    for h in range(3):
        for ell in range(2):
            for p in ("weight", "bias"):
                assert torch.equal(tensors[f"blocks.{h}.layers.{ell}.{p}"], state[f"blocks.{h}.{ell}.linear.{p}"])
    assert torch.equal(tensors["lm_heads.0.weight"], model.backbone.unembedding.weight)
    assert "Licence" in (export / "README.md").read_text()
    assert sorted(json.loads((export / MANIFEST).read_text())["files"]) == ["README.md", "config.json", "model.safetensors"]
    with torch.no_grad():
        base = model.features(IDS).base
        ours = model.head_logits(IDS, last_only=False)
    for h, theirs in enumerate(_vllm_forward(export, base)):
        torch.testing.assert_close(theirs, ours[h + 1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("lm_heads", ["shared", "copies"])
def test_export_then_import_is_exact(trained, tiny_llama_dir, tmp_path, lm_heads, capsys):
    model, heads = trained
    export, back = tmp_path / "E", tmp_path / "H2"
    assert main(["export", "--heads", str(heads), "--out", str(export), "--lm-heads", lm_heads]) == 0
    if lm_heads == "copies":
        cfg, tensors = json.loads((export / "config.json").read_text()), load_file(export / "model.safetensors")
        assert cfg["original_lm_head"] is False
        assert all(torch.equal(tensors[f"lm_heads.{h}.weight"], model.backbone.unembedding.weight) for h in range(3))
    assert main(["import", "--format", "medusa", str(export), "--base", str(tiny_llama_dir), "--out", str(back)]) == 0
    assert "imported 3 medusa heads (2 block(s) each, vllm layout)" in capsys.readouterr().out
    assert (back / "heads.safetensors").read_bytes() == (heads / "heads.safetensors").read_bytes()
    before, after = load_file(heads / "heads.safetensors"), load_file(back / "heads.safetensors")
    assert sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype
                                                   for k in before)
    again = MultiTokenModel.from_pretrained(None, back)
    assert again.config == model.config
    ours, theirs = model.head_logits(IDS, last_only=False), again.head_logits(IDS, last_only=False)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert json.loads((back / "import_config.json").read_text())["layout"] == "vllm"


def _fasterdecoding(root: Path, model: MultiTokenModel, *, prefix: str = "", lm: bool = True, lm_change: float = 0.0,
                    config: dict | None = None) -> Path:
    """A FasterDecoding checkpoint of two heads with one ResBlock each (bias on), as its
    train_legacy.py saves one: config.json + medusa_lm_head.safetensors."""
    root.mkdir()
    torch.manual_seed(2)
    hidden, unembed = model.backbone.hidden_size, model.backbone.unembedding.weight.detach()
    tensors = {}
    for h in range(2):
        tensors[f"{prefix}{h}.0.linear.weight"] = torch.randn(hidden, hidden) * 0.3
        tensors[f"{prefix}{h}.0.linear.bias"] = torch.randn(hidden) * 0.3
        if lm:
            tensors[f"{prefix}{h}.1.weight"] = unembed.clone() + lm_change
    save_file(tensors, root / "medusa_lm_head.safetensors")
    (root / "config.json").write_text(json.dumps(config or {"medusa_num_heads": 2, "medusa_num_layers": 1,
                                                            "base_model_name_or_path": "x", "version": "2"}))
    return root


@pytest.mark.parametrize("prefix, lm", [("", True), ("medusa_head.", False)], ids=["with-lm-heads", "legacy-prefixed"])
def test_fasterdecoding_layout_imports(trained, tiny_llama_dir, tmp_path, prefix, lm):
    model, _ = trained
    ckpt = _fasterdecoding(tmp_path / "fd", model, prefix=prefix, lm=lm)
    assert main(["import", str(ckpt), "--base", str(tiny_llama_dir), "--out", str(tmp_path / "H")]) == 0
    got = MultiTokenModel.from_pretrained(None, tmp_path / "H")
    assert got.n_future == 3 and got.config.num_blocks == 1
    t = load_file(ckpt / "medusa_lm_head.safetensors")
    with torch.no_grad():
        x = got.features(IDS).base
        logits = got.head_logits(IDS, last_only=False)
    unembed = got.backbone.unembedding.weight
    for h in range(2):  # FasterDecoding's ResBlock: x + SiLU(linear(x)), then the (base's) lm head
        y = x + torch.nn.functional.silu(torch.nn.functional.linear(x, t[f"{prefix}{h}.0.linear.weight"],
                                                                    t[f"{prefix}{h}.0.linear.bias"]))
        expected = torch.log_softmax(torch.nn.functional.linear(y, unembed).float(), -1)
        torch.testing.assert_close(logits[h + 1], expected, rtol=0, atol=1e-5)


def _vllm_dir(root: Path, model: MultiTokenModel, **cfg_changes) -> Path:
    root.mkdir()
    hidden, vocab = model.backbone.hidden_size, model.backbone.vocab_size
    tensors = {"blocks.0.layers.0.weight": torch.randn(hidden, hidden), "lm_heads.0.weight": model.backbone.unembedding.weight.detach().clone()}
    cfg = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": hidden, "vocab_size": vocab,
           "num_heads": 1, "num_hidden_layers": 1, **cfg_changes}
    if cfg.pop("token_map", False):
        tensors["token_map"] = torch.arange(100)
    save_file(tensors, root / "model.safetensors")
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def test_vllm_checkpoint_without_bias_imports_with_zero_bias(trained, tiny_llama_dir, tmp_path):
    model, _ = trained
    ckpt = _vllm_dir(tmp_path / "v", model)
    assert main(["import", str(ckpt), "--base", str(tiny_llama_dir), "--out", str(tmp_path / "H")]) == 0
    state = load_file(tmp_path / "H" / "heads.safetensors")
    assert torch.equal(state["blocks.0.0.linear.weight"], load_file(ckpt / "model.safetensors")["blocks.0.layers.0.weight"])
    assert torch.equal(state["blocks.0.0.linear.bias"], torch.zeros(32))


def test_bfloat16_checkpoint_onto_a_float32_base(trained, tiny_llama_dir, tmp_path):
    """The lm head is a bfloat16 copy of the base's float32 unembedding: equal in bfloat16."""
    model, _ = trained
    ckpt = _vllm_dir(tmp_path / "v", model)
    half = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(ckpt / "model.safetensors").items()}
    save_file(half, ckpt / "model.safetensors")
    assert main(["import", str(ckpt), "--base", str(tiny_llama_dir), "--out", str(tmp_path / "H")]) == 0
    state = load_file(tmp_path / "H" / "heads.safetensors")
    assert torch.equal(state["blocks.0.0.linear.weight"], half["blocks.0.layers.0.weight"].float())


@pytest.mark.parametrize("case, message", [
    ("fd-lm-head-differs", "the lm head of Medusa head 1 differs from the base's unembedding"),
    ("fd-config-disagrees", "medusa_num_heads is 5 but medusa_lm_head.safetensors holds 2 heads"),
    ("vllm-truncated", "drafts from a truncated vocabulary"),
    ("vllm-token-map", "holds a token_map"),
    ("vllm-bias-missing", "blocks.0.layers.0 lacks its bias (medusa_fc_bias is true)"),
    ("pickle", "is a pickle; multitoken reads weights from safetensors only"),
    ("no-base", "import needs --base"),
    ("not-a-dir", "is not a directory"),
    ("dtype-rounds", "the base loads in bfloat16, which would round it"),
])
def test_import_refuses_in_one_line(trained, tiny_llama_dir, tmp_path, capsys, case, message):
    model, _ = trained
    ckpt = tmp_path / "ckpt"
    if case == "fd-lm-head-differs":
        _fasterdecoding(ckpt, model, lm_change=1e-3)
    elif case == "fd-config-disagrees":
        _fasterdecoding(ckpt, model, config={"medusa_num_heads": 5, "medusa_num_layers": 1})
    elif case == "vllm-truncated":
        _vllm_dir(ckpt, model, truncated_vocab_size=100)
    elif case == "vllm-token-map":
        _vllm_dir(ckpt, model, token_map=True)
    elif case == "vllm-bias-missing":
        _vllm_dir(ckpt, model, medusa_fc_bias=True)
    elif case == "pickle":
        ckpt.mkdir()
        (ckpt / "medusa_lm_head.pt").write_bytes(b"\x80\x04.")
    elif case == "not-a-dir":
        ckpt.write_text("x")
    elif case == "dtype-rounds":
        _vllm_dir(ckpt, model, medusa_fc_bias=False)
    base = [] if case == "no-base" else ["--base", str(tiny_llama_dir)]
    base += ["--dtype", "bfloat16"] if case == "dtype-rounds" else []
    capsys.readouterr()
    code = main(["import", str(ckpt), *base, "--out", str(tmp_path / "H")])
    err = capsys.readouterr().err
    assert code != 0 and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 2 and "fix:" in err  # the problem, then its fix
    assert not (tmp_path / "H").exists()


def test_export_refuses_and_guards_its_output(trained, tiny_llama_dir, tmp_path, capsys):
    model, heads = trained
    assert main(["attach", "--base", str(tiny_llama_dir), "--head", "cp", "--n", "2", "--out", str(tmp_path / "cp")]) == 0
    lora = tmp_path / "lora-heads"
    shutil.copytree(heads, lora)
    record = json.loads((lora / "heads_config.json").read_text())
    (lora / "heads_config.json").write_text(json.dumps({**record, "lora": "lora"}))
    capsys.readouterr()
    cases = [
        (["--format", "eagle3", "--heads", str(heads)], "--format eagle3 exports eagle3 heads; " + str(heads) + " holds medusa heads"),
        (["--heads", str(lora)], "were trained with a LoRA adapter on the base; vLLM would serve them on the untuned base"),
        (["--heads", str(tmp_path / "cp")], "--format medusa exports medusa heads; " + str(tmp_path / "cp") + " holds cp heads"),
    ]
    for argv, message in cases:
        assert main(["export", *argv, "--out", str(tmp_path / "E")]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "E").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    assert main(["export", "--heads", str(heads), "--out", str(mine)]) == 2
    assert "is not empty and does not hold a Medusa export" in capsys.readouterr().err
    assert (mine / "config.json").read_text() == "{}"
    export = tmp_path / "E"
    assert main(["export", "--heads", str(heads), "--out", str(export)]) == 0
    first = (export / "model.safetensors").read_bytes()
    assert main(["export", "--heads", str(heads), "--out", str(export)]) == 2
    assert "already holds a Medusa export" in capsys.readouterr().err
    assert main(["export", "--heads", str(heads), "--out", str(export), "--overwrite", "--lm-heads", "copies"]) == 0
    assert (export / "model.safetensors").read_bytes() != first
    assert main(["import", str(export), "--base", str(tiny_llama_dir), "--out", str(export), "--overwrite"]) == 2
    assert "is the input" in capsys.readouterr().err
    other = tmp_path / "E2"
    assert main(["export", "--heads", str(heads), "--out", str(other)]) == 0
    assert main(["import", str(export), "--base", str(tiny_llama_dir), "--out", str(other), "--overwrite"]) == 2
    assert "holds a Medusa export (multitoken export --format medusa), not a heads dir" in capsys.readouterr().err


def test_export_names_the_licence_a_fetched_base_recorded(tiny_llama_dir, tmp_path, capsys):
    """A `multitoken fetch` conversion records its package's licence (conversion.json): the
    export's record and README carry it."""
    import shutil

    base = tmp_path / "fetched-base"
    shutil.copytree(tiny_llama_dir, base)
    (base / "conversion.json").write_text(json.dumps({"licence": "Apache-2.0 (a registry package)"}))
    _medusa_heads(base, tmp_path / "heads", n=3, blocks=1)
    assert main(["export", "--format", "medusa", "--heads", str(tmp_path / "heads"), "--out", str(tmp_path / "E")]) == 0
    cfg = json.loads((tmp_path / "E" / "config.json").read_text())
    assert cfg["multitoken"]["base_license"] == "Apache-2.0 (a registry package) (recorded by multitoken fetch)"
    assert "Apache-2.0 (a registry package)" in (tmp_path / "E" / "README.md").read_text()
