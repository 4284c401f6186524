"""Bad-input cases, part 3: damaged or unsafe weights (non-finite heads, a heads dir's LoRA
folder, a base folder of pickles) and the resume state's edits; ``bad_input_cases.py`` adds
them to ``CASES``."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

from multitoken.embedded import EMBEDDED_DIR

from .bad_output_cases import Case, _edit_json, _set, _train


class _Planted:
    def __init__(self, flag: str):
        self.flag = flag

    def __reduce__(self):
        return (os.system, (f"touch {self.flag}",))


def _state(edit):
    def damage(step, d):
        _edit_json(step / "state.json", edit)
    return damage


def _position(step: int | None = None, **fields):
    return _state(lambda st: {**st, "position": {**st["position"], **fields}, **({} if step is None else {"step": step})})


def resume_onto_finished_heads_without_checkpoint(w, d):  # was: replaced them with a new run
    out = Path(shutil.copytree(w["trained"], d / "trained"))
    return Case(_train(w, out, "--resume", "--lr", "1e-2"), 2, "holds no checkpoint to continue from",
                [out / "heads_config.json", out / "heads.safetensors", out / "train_metrics.json"])


def heads_all_nan(w, d):  # a consistent heads dir (checksum updated) whose weights are NaN
    import hashlib

    import torch
    from safetensors.torch import load_file, save

    h = Path(shutil.copytree(w["heads"], d / "H"))
    blob = save({k: torch.full_like(v, float("nan")) for k, v in load_file(h / "heads.safetensors").items()})
    (h / "heads.safetensors").write_bytes(blob)
    _edit_json(h / "heads_config.json", _set("heads_sha256", hashlib.sha256(blob).hexdigest()))
    return Case(["generate", "Once", "--heads", h, "--max-new-tokens", "2"], 1, "non-finite values (NaN or inf)")


LORA_CONFIG = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj"]}


def _lora_case(name, write, message):
    """The world's heads with a ``lora/`` folder that ``write(folder, d)`` fills."""
    def case(w, d):
        h = Path(shutil.copytree(w["heads"], d / "H"))
        _edit_json(h / "heads_config.json", _set("lora", "lora"))
        (h / "lora").mkdir()
        write(h / "lora", d)
        return Case(["generate", "Once", "--heads", h, "--max-new-tokens", "2"], 1, message)
    case.__name__ = name
    return case


def _lora_pickle(folder, d):
    (folder / "adapter_config.json").write_text(json.dumps(LORA_CONFIG))
    (folder / "adapter_model.bin").write_bytes(pickle.dumps({"w": _Planted(str(d / "PWNED"))}))


def _lora_config_truncated(folder, d):
    (folder / "adapter_config.json").write_text(json.dumps(LORA_CONFIG)[:30])


def _lora_weights_truncated(folder, d):
    import torch
    from safetensors.torch import save

    (folder / "adapter_config.json").write_text(json.dumps(LORA_CONFIG))
    blob = save({"base_model.model.q_proj.lora_A.weight": torch.zeros(8, 64)})
    (folder / "adapter_model.safetensors").write_bytes(blob[:-100])


def base_only_pickled(w, d):  # a --base folder whose weights are a pickle (that would run code)
    base = d / "base"
    base.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED_DIR / "stories260K" / name, base / name)
    (base / "pytorch_model.bin").write_bytes(pickle.dumps({"w": _Planted(str(d / "PWNED"))}))
    return Case(["generate", "Once", "--base", base, "--max-new-tokens", "2"], 1, "holds only pickled weights (pytorch_model.bin)")



def import_medusa_pickled(w, d):
    ckpt = d / "medusa"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"medusa_num_heads": 1, "medusa_num_layers": 1}')
    (ckpt / "medusa_lm_head.pt").write_bytes(pickle.dumps({"w": _Planted(str(d / "PWNED"))}))
    return Case(["import", ckpt, "--base", "embedded:stories260K", "--out", d / "new"], 1, "is a pickle; multitoken reads weights from safetensors only")


def import_medusa_nan(w, d):
    import torch
    from safetensors.torch import save_file

    ckpt = d / "medusa"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"medusa_num_heads": 1, "medusa_num_layers": 1}')
    save_file({"0.0.linear.weight": torch.full((64, 64), float("nan")), "0.0.linear.bias": torch.zeros(64)},
              ckpt / "medusa_lm_head.safetensors")
    return Case(["import", ckpt, "--base", "embedded:stories260K", "--out", d / "new"], 1, "non-finite values")


def _not_lora(folder, d):
    (folder / "adapter_config.json").write_text('{"peft_type": "IA3"}')


WEIGHT_CASES = [
    resume_onto_finished_heads_without_checkpoint, heads_all_nan, base_only_pickled, import_medusa_pickled, import_medusa_nan,
    _lora_case("lora_pickled_adapter", _lora_pickle, "holds only pickled weights (adapter_model.bin)"),
    _lora_case("lora_config_truncated", _lora_config_truncated, "adapter_config.json is not valid JSON"),
    _lora_case("lora_weights_truncated", _lora_weights_truncated, "adapter_model.safetensors is truncated"),
    _lora_case("lora_config_not_lora", _not_lora, "peft_type must be 'LORA'"),
]
