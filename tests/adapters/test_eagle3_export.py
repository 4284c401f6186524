"""``multitoken export --format eagle3``: EAGLE-3's checkpoint layout, read back bit for bit, the
function its readers compute written out from the files alone, refusals, and (interop) llama.cpp's
own converter on a tiny export."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from multitoken.pipeline.cli import main
from multitoken.pipeline.integrations import llama_cpp
from multitoken.pipeline.model.export_eagle3 import RENAMED, read_eagle3
from multitoken.pipeline.model.model import MultiTokenModel



@pytest.fixture(scope="module", params=["gpt_neox", "llama"])
def drafter(request, tiny_neox_dir, tiny_llama_dir, tmp_path_factory):
    """Eagle3 heads with a reduced draft vocabulary and weights far from their start, saved."""
    base = {"gpt_neox": tiny_neox_dir, "llama": tiny_llama_dir}[request.param]
    out = tmp_path_factory.mktemp("eagle3") / "heads"
    assert main(["attach", "--base", str(base), "--head", "eagle3", "--n", "3", "--draft-vocab-size", "48", "--out", str(out)]) == 0
    model = MultiTokenModel.from_pretrained(None, out)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    model.heads.set_draft_vocab(torch.arange(5, 5 + 3 * 48, 3))
    model.save_heads(out, command="attach")
    return MultiTokenModel.from_pretrained(None, out), out, base


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference_first_step(cfg: dict, t: dict, states: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
    """Draft log-probabilities of step 1 over a prefix, from the exported files alone, as
    llama.cpp's eagle3 graph computes them # states [T, 3H], embeds [T, H] -> [T, V]."""
    eps, nh, nkv, hd = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    g = states @ t["fc.weight"].T  # [T, H]
    x = torch.cat([_rms(embeds, t["midlayer.input_layernorm.weight"], eps), _rms(g, t["midlayer.hidden_norm.weight"], eps)], -1)
    T = x.shape[0]
    q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(T, nh, hd).transpose(0, 1)
    k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(T, nkv, hd).transpose(0, 1).repeat_interleave(nh // nkv, 0)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(T, nkv, hd).transpose(0, 1).repeat_interleave(nh // nkv, 0)
    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd)
    ang = torch.arange(T).float()[:, None] * inv[None]  # [T, hd/2]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    rot = lambda z: z * cos + torch.cat([-z[..., hd // 2:], z[..., :hd // 2]], -1) * sin  # noqa: E731
    att = F.scaled_dot_product_attention(rot(q), rot(k), v, is_causal=True).transpose(0, 1).reshape(T, -1)
    mid = att @ t["midlayer.self_attn.o_proj.weight"].T + g  # residual: the raw fused state (norm_before_residual false)
    h = _rms(mid, t["midlayer.post_attention_layernorm.weight"], eps)
    mlp = (F.silu(h @ t["midlayer.mlp.gate_proj.weight"].T) * (h @ t["midlayer.mlp.up_proj.weight"].T)) @ t["midlayer.mlp.down_proj.weight"].T
    logits = _rms(mid + mlp, t["norm.weight"], eps) @ t["lm_head.weight"].T  # [T, Vd]
    out = torch.full((T, cfg["vocab_size"]), float("-inf"))
    draft = torch.arange(cfg["draft_vocab_size"])
    out[:, draft + t["d2t"]] = torch.log_softmax(logits, -1)
    return out


def test_export_reads_back_exactly_and_computes_the_drafter(drafter, tmp_path, capsys):
    model, heads_dir, base = drafter
    export = tmp_path / "E"
    assert main(["export", "--format", "eagle3", "--heads", str(heads_dir), "--out", str(export)]) == 0
    assert "EAGLE-3's layout" in capsys.readouterr().out
    cfg, tensors = read_eagle3(export)
    state = model.heads.state_dict()
    assert set(tensors) == {RENAMED.get(k, k) for k in state} and "embed_tokens.weight" not in tensors
    for name, value in state.items():
        assert torch.equal(tensors[RENAMED.get(name, name)], value), name
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    bb = model.backbone
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 48 and cfg["vocab_size"] == bb.vocab_size and cfg["target_hidden_size"] == bb.hidden_size
    assert cfg["eagle_aux_hidden_state_layer_ids"] == model.config.aux_layers == cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert cfg["multitoken"]["base"] == str(base) and cfg["multitoken"]["base_license"]
    assert cfg["norm_before_residual"] is False and (export / "README.md").is_file()
    ids = torch.tensor([[1, 17, 300, 42, 9, 255, 77, 3]])
    with torch.no_grad():
        feats = model.features(ids)
        want = model.heads.log_probs(1, feats)[0]  # step 1 at every position
        states = torch.cat([feats.layer_states[k - 1] for k in cfg["eagle_aux_hidden_state_layer_ids"]], -1)[0]
        got = _reference_first_step(cfg, tensors, states, bb.embeddings(feats.next_ids)[0])
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[torch.isfinite(got)], want[torch.isfinite(want)], rtol=1e-4, atol=1e-4)


def test_export_refuses_what_it_cannot_write(drafter, tmp_path, tiny_llama_dir, capsys):
    _, heads_dir, _ = drafter
    assert main(["attach", "--base", str(tiny_llama_dir), "--head", "medusa", "--n", "2", "--out", str(tmp_path / "m")]) == 0
    capsys.readouterr()
    cases = [(["--heads", str(tmp_path / "m")], "--format eagle3 exports eagle3 heads; " + str(tmp_path / "m") + " holds medusa heads"),
             (["--heads", str(heads_dir), "--lm-heads", "copies"], "--lm-heads applies to --format medusa only")]
    for argv, message in cases:
        assert main(["export", "--format", "eagle3", *argv, "--out", str(tmp_path / "E")]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "E").exists()


@pytest.mark.interop
def test_llama_cpps_converter_reads_the_export(drafter, tmp_path):
    source = llama_cpp.source()
    if source is None:
        pytest.skip(str(llama_cpp.missing_source()))
    model, heads_dir, base = drafter
    export, gguf_file = tmp_path / "E", tmp_path / "drafter.gguf"
    assert main(["export", "--format", "eagle3", "--heads", str(heads_dir), "--out", str(export)]) == 0
    llama_cpp.convert(source, export, gguf_file, target=base, timeout=300)
    sys.path.insert(0, str(source / "gguf-py"))
    try:
        from gguf import GGUFReader
    finally:
        sys.path.pop(0)
    reader = GGUFReader(gguf_file)
    names = {t.name: t for t in reader.tensors}
    fields = {f.name: f for f in reader.fields.values()}
    assert fields["general.architecture"].contents() == "eagle3"
    layers = next(f for k, f in fields.items() if k.endswith("extract_layers") or k.endswith("target_layers"))
    assert list(layers.contents()) == model.config.aux_layers
    _, tensors = read_eagle3(export)
    absolute = torch.from_numpy(names["d2t"].data.copy()).long().flatten()  # the converter adds the draft ids to our offsets
    assert torch.equal(absolute, model.heads.to_target(torch.arange(48))) and torch.equal(absolute - torch.arange(48), tensors["d2t"])
    fc = torch.from_numpy(names["fc.weight"].data.copy()).reshape(tensors["fc.weight"].shape)
    assert torch.equal(fc, tensors["fc.weight"])
