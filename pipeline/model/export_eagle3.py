"""EAGLE-3 drafter heads in the checkpoint layout the serving engines read.

The layout of EAGLE-3's own checkpoints (``LlamaForCausalLMEagle3``), which vLLM
(``Eagle3LlamaForCausalLM``), SGLang and llama.cpp's converter (``conversion/llama.py``: a config
with ``draft_vocab_size`` and one layer is EAGLE-3, converted with ``--target-model-dir`` = the
base) all load:

- ``config.json``: a one-layer Llama config of the drafter's shape (``hidden_size``,
  ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``intermediate_size``,
  ``rms_norm_eps``, ``rope_theta`` / ``rope_scaling``), ``vocab_size`` = the base's,
  ``draft_vocab_size``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids`` (the layers
  whose *input* states are fused, top level for llama.cpp and in ``eagle_config`` for vLLM) and
  ``norm_before_residual: false`` (the residual is the un-normalised hidden state);
- ``model.safetensors``: ``fc.weight``, ``midlayer.*`` (``input_layernorm``, ``hidden_norm``,
  ``self_attn.{q,k,v,o}_proj``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``),
  ``norm.weight``, ``lm_head.weight`` [Vd, H], ``d2t`` (int64 [Vd], target id minus draft id) and
  ``t2d`` (bool [V]). No ``embed_tokens``: the engines take the target's embedding, as the
  drafter was trained to.

The export records the base it was trained for and the base's licence; ``read_eagle3`` reads
an export back (safetensors only, nothing unpickled).
"""

from __future__ import annotations

import json
from dataclasses import asdict
import shutil
from pathlib import Path

import torch

from multitoken.base.errors import CheckpointError
from multitoken.base.finite import check_finite
from multitoken.base.outputs import EAGLE3_EXPORT
from multitoken.base.publish import staged_output
from multitoken.embedded import portable_base
from multitoken.pipeline.model import export_medusa
from multitoken.pipeline.model.export_medusa import LICENSE, README, base_license
from multitoken.pipeline.model.model import MultiTokenModel

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
ARCHITECTURE = "LlamaForCausalLMEagle3"
RENAMED = {"draft_head.weight": "lm_head.weight"}  # ours -> EAGLE-3's; every other name is EAGLE-3's already


def check_exportable(heads_dir: str) -> None:
    """One line for heads the engines cannot serve as trained (export_medusa's checks, in
    EAGLE-3's words)."""
    export_medusa.check_exportable(heads_dir, "eagle3", drafts="draft steps", server="an engine",
                                   holder="an EAGLE-3 checkpoint")


def eagle3_tensors(model: MultiTokenModel) -> dict[str, torch.Tensor]:
    """The drafter's state dict under EAGLE-3's names (same tensors, same dtypes)."""
    state = model.heads.state_dict()
    return {RENAMED.get(k, k): v.detach().to("cpu").contiguous().clone() for k, v in state.items()}


def eagle3_config(model: MultiTokenModel, dtype: torch.dtype, license_note: str) -> dict:
    from importlib.metadata import version

    heads, bb = model.heads, model.backbone
    s, aux = heads.shape, list(heads.config.aux_layers)
    rope = dict(s.rope)
    theta, kind = rope.pop("rope_theta"), rope.pop("rope_type", "default")
    base_cfg = bb.config
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": s.width, "intermediate_size": s.intermediate, "num_hidden_layers": 1,
        "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim,
        "hidden_act": "silu", "rms_norm_eps": s.eps, "max_position_embeddings": s.max_positions,
        "rope_theta": theta, "rope_scaling": None if kind == "default" else {"rope_type": kind, **rope},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "vocab_size": bb.vocab_size, "draft_vocab_size": heads.draft_head.out_features,
        "target_hidden_size": bb.hidden_size, "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": aux,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True},
        "bos_token_id": getattr(base_cfg, "bos_token_id", None), "eos_token_id": getattr(base_cfg, "eos_token_id", None),
        "torch_dtype": str(dtype).removeprefix("torch."),
        "multitoken": {"version": version("multitoken"), "base": portable_base(bb.name), "base_model_type": bb.model_type,
                       "base_license": license_note, "draft_steps": model.n_future - 1,
                       "head_config": asdict(heads.config)},
    }


def write_eagle3(model: MultiTokenModel, out: str | Path, *, command: str = "export") -> Path:
    """Write ``model``'s drafter to ``out`` in EAGLE-3's layout, all or nothing, recorded."""
    from safetensors.torch import save

    tensors = eagle3_tensors(model)
    check_finite({k: v for k, v in tensors.items() if v.is_floating_point()}, "the drafter to export",
                 "these heads are unusable: train them again with a lower --lr")
    licence, note = base_license(model.backbone.name)
    config = eagle3_config(model, model.heads.fc.weight.dtype, note)
    with staged_output(out, EAGLE3_EXPORT.kind, command, marker=CONFIG) as stage:
        (stage / WEIGHTS).write_bytes(save(tensors, metadata={"format": "pt"}))
        if licence is not None:
            shutil.copyfile(licence, stage / LICENSE)
        (stage / README).write_text(_readme(config), encoding="utf-8")
        (stage / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return Path(out)


def _readme(config: dict) -> str:
    mt = config["multitoken"]
    return (f"# EAGLE-3 drafter for {mt['base']}\n\n"
            f"One decoder layer fusing the base's layers {config['eagle_aux_hidden_state_layer_ids']} (their input states), "
            f"drafting over {config['draft_vocab_size']} of the base's {config['vocab_size']} tokens, trained with multitoken "
            f"{mt['version']} on the base `{mt['base']}` ({mt['base_model_type']}) as it ran; it drafts "
            f"{mt['draft_steps']} step(s) per pass by default. EAGLE-3's checkpoint layout (`{ARCHITECTURE}`): vLLM and SGLang "
            "load it as an EAGLE-3 speculator; llama.cpp converts it with "
            "`convert_hf_to_gguf.py DIR --target-model-dir BASE`. Serve it only on that base: it reads the base's "
            "token embedding and hidden states.\n\n"
            f"Licence: the base's terms apply to these weights ({mt['base_license']}).\n")


def read_eagle3(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of an EAGLE-3 checkpoint folder, checked against each other."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    path = Path(path)
    fix = "pass a folder written by `multitoken export --format eagle3` (or another EAGLE-3 checkpoint)"
    try:
        config = json.loads((path / CONFIG).read_text(encoding="utf-8"))
        tensors = load((path / WEIGHTS).read_bytes())
    except (OSError, ValueError, SafetensorError) as err:
        raise CheckpointError(f"{path}: not a readable EAGLE-3 checkpoint ({str(err).splitlines()[0][:120]})", fix) from None
    if not isinstance(config, dict) or not isinstance(config.get("draft_vocab_size"), int):
        raise CheckpointError(f"{path / CONFIG} has no draft_vocab_size: not an EAGLE-3 config", fix)
    want = {"fc.weight": [config.get("hidden_size"), 3 * (config.get("target_hidden_size") or 0)],
            "lm_head.weight": [config["draft_vocab_size"], config.get("hidden_size")], "d2t": [config["draft_vocab_size"]]}
    for name, shape in want.items():
        if name not in tensors or list(tensors[name].shape) != shape:
            raise CheckpointError(f"{path / WEIGHTS}: {name} is missing or not of shape {shape}", fix)
    return config, tensors
